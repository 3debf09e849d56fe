//! The pread/pwrite thread-pool driver, for machines where io_uring is unavailable
//! (`kernel.io_uring_disabled`, seccomp profiles of container runtimes, old kernels).
//!
//! It serves the same [`IoRequest`]s as the ring: worker threads run `preadv`-style system
//! calls into bounce slots and post `-errno` style results, then ring the reactor's doorbell.

use std::io;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::{Completion, IoKind, IoRequest, Lane, LaneIo};
use crate::lane::doorbell::Doorbell;

/// An [`IoRequest`] on its way to a worker thread.
struct Job(IoRequest);

// SAFETY: the raw buffer pointer in the request points into the bounce arena, which outlives
// every job (the reactor drains the driver before the arena can go), and the slot it names is
// owned by this job alone until its completion is posted.
unsafe impl Send for Job {}

/// Thread-pool driver.
pub(crate) struct PreadLane {
    jobs: Option<Sender<Job>>,
    done: Arc<Mutex<Vec<Completion>>>,
    doorbell: Arc<Doorbell>,
    workers: Vec<JoinHandle<()>>,
    reason: String,
    /// Pieces pushed and not yet collected.
    out: usize,
}

fn run_job(req: &IoRequest) -> i32 {
    // `req.fd` stays open until the op completes (the reactor's op holds its file).
    let r = match req.kind {
        // SAFETY: `req.buf` is valid for writes of `req.len` bytes: a bounce slot owned by this
        // job alone until its completion is posted (see `Job`).
        IoKind::Read => unsafe {
            libc::pread(
                req.fd,
                req.buf.cast(),
                req.len as usize,
                req.pos as libc::off_t,
            )
        },
        // SAFETY: `req.buf` is valid for reads of `req.len` bytes, owned as above.
        IoKind::Write => unsafe {
            libc::pwrite(
                req.fd,
                req.buf.cast(),
                req.len as usize,
                req.pos as libc::off_t,
            )
        },
        // SAFETY: no memory is passed; the descriptor is open (see above).
        IoKind::Fsync => unsafe { libc::fsync(req.fd) as isize },
    };
    if r < 0 {
        -io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    } else {
        r as i32
    }
}

impl PreadLane {
    /// Starts `threads` workers. `reason` says why this driver serves (for `BackendInfo`).
    pub(crate) fn new(threads: usize, doorbell: Arc<Doorbell>, reason: String) -> io::Result<Self> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let done = Arc::new(Mutex::new(Vec::new()));
        let mut workers = Vec::with_capacity(threads);
        for i in 0..threads.max(1) {
            let rx: Arc<Mutex<Receiver<Job>>> = rx.clone();
            let done = done.clone();
            let doorbell = doorbell.clone();
            let h = std::thread::Builder::new()
                .name(format!("gpuio-pread-{i}"))
                .spawn(move || {
                    loop {
                        // A poisoned lock only means another worker panicked mid-recv; the
                        // receiver itself is intact.
                        let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
                            Ok(j) => j,
                            Err(_) => return,
                        };
                        let res = run_job(&job.0);
                        done.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(Completion {
                                token: job.0.token,
                                res,
                            });
                        doorbell.ring();
                    }
                })
                .map_err(|e| {
                    io::Error::new(
                        e.kind(),
                        format!(
                            "starting pread thread {} of {}: {e} (ask for fewer with \
                             pread_threads)",
                            i + 1,
                            threads.max(1)
                        ),
                    )
                })?;
            workers.push(h);
        }
        Ok(PreadLane {
            jobs: Some(tx),
            done,
            doorbell,
            workers,
            reason,
            out: 0,
        })
    }

    fn description(&self) -> String {
        format!(
            "pread/pwrite thread pool ({} threads){}",
            self.workers.len(),
            if self.reason.is_empty() {
                String::new()
            } else {
                format!(": {}", self.reason)
            }
        )
    }

    fn push_request(&mut self, req: IoRequest) -> io::Result<()> {
        let tx = self
            .jobs
            .as_ref()
            .ok_or_else(|| io::Error::other("pread pool stopped"))?;
        tx.send(Job(req))
            .map_err(|_| io::Error::other("pread workers exited"))
    }

    fn collect(
        &mut self,
        block: bool,
        timeout: Option<std::time::Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()> {
        let before = out.len();
        out.append(&mut self.done.lock().unwrap_or_else(|p| p.into_inner()));
        if block && out.len() == before {
            // The reactor already announced sleep and re-checked its message queue; workers
            // ring after posting, so this wakes for either kind of work.
            self.doorbell.wait_blocking(timeout);
            out.append(&mut self.done.lock().unwrap_or_else(|p| p.into_inner()));
        }
        self.out -= out.len() - before;
        Ok(())
    }
}

impl Lane for PreadLane {
    fn name(&self) -> &'static str {
        "pread"
    }

    fn describe(&self) -> String {
        self.description()
    }

    fn push(&mut self, io: LaneIo<'_>) -> io::Result<()> {
        self.push_request(io.kernel_request())?;
        self.out += 1;
        Ok(())
    }

    fn wait(
        &mut self,
        block: bool,
        timeout: Option<std::time::Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()> {
        self.collect(block, timeout, out)
    }

    fn outstanding(&self) -> usize {
        self.out
    }
}

impl Drop for PreadLane {
    fn drop(&mut self) {
        // Closing the job channel lets each worker finish its job and exit.
        self.jobs.take();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
