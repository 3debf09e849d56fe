//! Warm reads into device memory without a CPU copy (opt-in,
//! [`EngineBuilder::mapped_reads`](crate::EngineBuilder::mapped_reads)): the read's range of
//! the file is mapped read-only, the mapping is registered with the driver
//! (`cuMemHostRegister`, read-only), which pins the page-cache pages behind it, and the GPU
//! DMAs straight from them. This module is the registrar: one thread per engine that registers
//! and unregisters, because the driver serializes registration per process
//! (docs/mapped-reads.md) and a registration takes hundreds of microseconds that no runtime
//! thread should spend. The future that asked queues the copy itself, in its own `poll`
//! (`op::mapped`), as it does from a bounce slot.
//!
//! # Soundness
//! - **The mapping outlives its registration:** a [`MappedJob`] owns its mapping, and the
//!   registrar holds the job until it has unregistered it (or, where that cannot be known to be
//!   safe, keeps both for the process's life).
//! - **The registration outlives the copy that reads it:** the future queues its copy only
//!   while the job is `Registered`, under the job's lock, and leaves it `Gated` behind an event
//!   recorded after the copy; the registrar unregisters a gated job only once that event has
//!   completed. A future dropped or leaked before it queued a copy leaves the job `Registered`
//!   or `Queued`; the registrar unregisters it once it sees it abandoned, or at the engine's
//!   close (it then revokes the job under the same lock, so no copy can start afterwards).
//! - **The CPU never reads the mapping.** Only the driver (to pin) and the copy engine touch
//!   it: a file truncated under a mapping makes a registration fail (the pages are not there to
//!   pin), never a `SIGBUS`, and pinned pages stay valid memory until unregistered, so a copy
//!   racing a truncate or a write reads the bytes as they were pinned, as a racing `pread`
//!   could.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::driver::sys;

use super::event::EventGate;

/// Reads shorter than this keep the bounce path: a registration costs about 100 µs whatever
/// its size (docs/mapped-reads.md), against 0.5 ms of CPU copy for 2 MiB.
pub const MAPPED_READ_MIN: usize = 2 << 20;

/// How soon the registrar looks at copies' events again while some are pending, at first: a
/// 16 MiB copy takes about 300 µs. Each look that finds none complete doubles the wait, up to
/// [`GATE_POLL_MAX`], so a copy queued behind a long kernel costs a few wake-ups a
/// millisecond, not a core.
const GATE_POLL_MIN: Duration = Duration::from_micros(20);
const GATE_POLL_MAX: Duration = Duration::from_micros(640);

/// Registered bytes the registrar lets wait, their copies done, before it unregisters them all
/// at once (it also does whenever it has nothing queued or copying, and at close).
/// `cuMemHostUnregister` waits for all work the process has queued on the device (measured:
/// 1.04 s for a 1 GiB mapped read beside a 1 s kernel on another stream, against 23 ms through
/// the bounce path), so unregistering piece by piece would pay that wait for every 64 MiB while
/// kernels run; in a batch the first call pays it and the rest find little new work to wait for.
const RELEASE_BATCH: usize = 1 << 30;

/// Ranges registered for mapped reads in this process, every engine's.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Ranges registered for mapped reads in this process right now (every engine's): copies in
/// flight, registrations no future has taken yet, and any kept for good after a failure.
pub fn registrations_live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

/// Host memory a mapped read pins and copies from: one live mapping (of a file, in the
/// library: `plan::residency::FileMapping`) that the CPU never reads. A job owns it, so it
/// stays mapped for as long as the job may be registered or copied from.
///
/// # Safety
/// Implementors promise that `addr()` and `len()` describe the same range for the value's
/// whole life, that the range stays mapped (not unmapped or remapped) until the value drops,
/// and that nothing reads or writes it through a Rust reference.
pub(crate) unsafe trait PinnableRange: Send + Sync {
    /// Where the range starts.
    fn addr(&self) -> *mut std::ffi::c_void;
    /// Its length in bytes.
    fn len(&self) -> usize;
}

/// Where a job stands. One lock guards it and the waker; see the module's soundness notes.
pub(crate) enum JobState {
    /// Sent to the registrar, not registered yet.
    Queued,
    /// The registrar is registering it, outside the lock.
    Registering,
    /// Registered: the future may queue its copy.
    Registered,
    /// The copy is queued; unregister once this event has completed.
    Gated(EventGate),
    /// A copy may be queued with nothing to say when it ends: stays registered and mapped for
    /// the process's life.
    Stuck,
    /// Registration failed (the reason, and whether it is the file's: no later mapping of it
    /// would do better): the read goes the bounce way.
    Refused(String, bool),
    /// The future went before it queued a copy.
    Abandoned,
    /// The engine closed before the future took it.
    Revoked,
}

/// One read's mapping, registration state and waker, shared by the future and the registrar.
pub(crate) struct MappedJob {
    pub(crate) ctx: Arc<CudaContext>,
    map: Box<dyn PinnableRange>,
    state: Mutex<(JobState, Option<Waker>)>,
}

impl MappedJob {
    pub(crate) fn new(ctx: Arc<CudaContext>, map: Box<dyn PinnableRange>) -> Arc<Self> {
        Arc::new(MappedJob {
            ctx,
            map,
            state: Mutex::new((JobState::Queued, None)),
        })
    }

    /// Queues on `stream` a copy of `len` bytes of the mapping, from byte `at`, into device
    /// memory at `dst`. `Err`: the range lies outside the mapping, or the driver's error.
    ///
    /// # Safety
    /// The job must be registered and stay so until the copy has completed: the caller holds
    /// its lock with the state `Registered` and leaves it gated behind an event recorded after
    /// this call. `[dst, dst + len)` must be device memory writable in `stream`'s order, and
    /// `stream` a live stream of the context current on this thread.
    pub(crate) unsafe fn queue_copy(
        &self,
        dst: sys::CUdeviceptr,
        at: usize,
        len: usize,
        stream: sys::CUstream,
    ) -> Result<(), sys::CUresult> {
        if at.checked_add(len).is_none_or(|end| end > self.map.len()) {
            return Err(sys::CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the source lies inside the mapping (checked above), registered and kept so
        // until the copy completes (the caller's promise); the destination and stream are the
        // caller's promise too. The CPU does not read the source.
        let rc = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst,
                self.map.addr().cast::<u8>().add(at).cast(),
                len,
                stream,
            )
        };
        match rc {
            sys::CUresult::CUDA_SUCCESS => Ok(()),
            e => Err(e),
        }
    }

    /// The job's state and waker, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, (JobState, Option<Waker>)> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the state and takes the waker of the future waiting on it, to wake once the lock
    /// is released (a waker may run code of the runtime's that should not wait on this lock).
    fn settle(
        guard: &mut MutexGuard<'_, (JobState, Option<Waker>)>,
        to: JobState,
    ) -> Option<Waker> {
        guard.0 = to;
        guard.1.take()
    }
}

enum RegistrarMsg {
    Job(Arc<MappedJob>),
    /// A job changed state (gated or abandoned): look again.
    Poke,
    Close,
}

/// The engine's registrar: its thread, started at the first mapped read, and its counters.
pub(crate) struct Registrar {
    tx: mpsc::Sender<RegistrarMsg>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    exited: Mutex<mpsc::Receiver<()>>,
    counts: Arc<RegistrarCounts>,
}

/// What tests and `gpuio bench` read of a registrar.
#[derive(Default)]
pub(crate) struct RegistrarCounts {
    /// Ranges registered now.
    pub(crate) live: AtomicUsize,
    /// Pieces of mapped reads handed to the registrar.
    pub(crate) submitted: AtomicU64,
    /// The registrar's thread has taken its last job: a job still `Queued` will never move.
    pub(crate) gone: std::sync::atomic::AtomicBool,
    /// Reads whose copy was queued from a registration.
    pub(crate) served: AtomicU64,
    /// Registrations (pieces) the driver refused.
    pub(crate) refused: AtomicU64,
}

impl Registrar {
    /// Starts the registrar's thread.
    pub(crate) fn start() -> std::io::Result<Registrar> {
        let (tx, rx) = mpsc::channel();
        let (exit_tx, exited) = mpsc::channel();
        let counts = Arc::new(RegistrarCounts::default());
        let c = counts.clone();
        let thread = std::thread::Builder::new()
            .name("gpuio-registrar".into())
            .spawn(move || {
                run(rx, &c);
                drop(exit_tx);
            })?;
        Ok(Registrar {
            tx,
            thread: Mutex::new(Some(thread)),
            exited: Mutex::new(exited),
            counts,
        })
    }

    /// Hands `job` to the thread; `false` if it has gone (the read takes the bounce path).
    pub(crate) fn submit(&self, job: Arc<MappedJob>) -> bool {
        let sent = self.tx.send(RegistrarMsg::Job(job)).is_ok();
        if sent {
            self.counts.submitted.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// Tells the thread to close (as [`close`](Self::close), without waiting for it): reads
    /// it has not registered or whose registrations no future has taken fall back to the
    /// engine's reactor, which is shutting down too.
    pub(crate) fn begin_close(&self) {
        let _ = self.tx.send(RegistrarMsg::Close);
    }

    /// Tells the thread a job changed state.
    pub(crate) fn poke(&self) {
        let _ = self.tx.send(RegistrarMsg::Poke);
    }

    pub(crate) fn counts(&self) -> &RegistrarCounts {
        &self.counts
    }

    /// Closes the registrar: jobs not yet taken are revoked and unregistered, copies still
    /// running are waited for, then the thread exits; joined if that happens within `wait`
    /// (otherwise it finishes on its own).
    pub(crate) fn close(&self, wait: Duration) {
        let _ = self.tx.send(RegistrarMsg::Close);
        let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        let exited = self.exited.lock().unwrap_or_else(|p| p.into_inner());
        match exited.recv_timeout(wait) {
            Err(RecvTimeoutError::Timeout) => tracing::warn!(
                "gpuio engine dropped while mapped reads' copies still run; the registrar \
                 unregisters them in the background"
            ),
            _ => {
                let _ = t.join();
            }
        }
    }
}

impl Drop for Registrar {
    fn drop(&mut self) {
        self.close(Duration::from_secs(2));
    }
}

/// One job as the registrar holds it.
struct Entry {
    job: Arc<MappedJob>,
    registered: bool,
}

/// The registrar's loop: take jobs, register the oldest queued one per turn, unregister what
/// is done with; on close, revoke and drain.
fn run(rx: mpsc::Receiver<RegistrarMsg>, counts: &RegistrarCounts) {
    let mut jobs: VecDeque<Entry> = VecDeque::new();
    let mut closing = false;
    let mut gate_poll = GATE_POLL_MIN;
    // Registered jobs whose copies are done, to unregister together, and their bytes.
    let (mut releasing, mut releasing_bytes) = (Vec::new(), 0usize);
    loop {
        let (mut queued, mut gated) = (false, false);
        for e in &jobs {
            match e.job.lock().0 {
                JobState::Queued => queued = true,
                JobState::Gated(_) => gated = true,
                _ => {}
            }
        }
        let first = if closing || queued {
            match rx.try_recv() {
                Ok(m) => Some(m),
                Err(TryRecvError::Empty) => None,
                Err(TryRecvError::Disconnected) => Some(RegistrarMsg::Close),
            }
        } else if gated {
            match rx.recv_timeout(gate_poll) {
                Ok(m) => Some(m),
                Err(RecvTimeoutError::Timeout) => {
                    gate_poll = (gate_poll * 2).min(GATE_POLL_MAX);
                    None
                }
                Err(RecvTimeoutError::Disconnected) => Some(RegistrarMsg::Close),
            }
        } else {
            Some(rx.recv().unwrap_or(RegistrarMsg::Close))
        };
        let mut next = first;
        while let Some(m) = next {
            match m {
                RegistrarMsg::Job(job) => jobs.push_back(Entry {
                    job,
                    registered: false,
                }),
                RegistrarMsg::Poke => {}
                RegistrarMsg::Close => closing = true,
            }
            next = rx.try_recv().ok();
        }
        if !closing {
            if let Some(e) = jobs
                .iter_mut()
                .find(|e| matches!(e.job.lock().0, JobState::Queued))
            {
                register(e, counts);
            }
        }
        let before = jobs.len();
        jobs.retain_mut(|e| match settle(e, closing) {
            Settled::Keep => true,
            Settled::Done => false,
            Settled::Release => {
                releasing_bytes += e.job.map.len();
                releasing.push(e.job.clone());
                false
            }
        });
        if jobs.len() < before {
            gate_poll = GATE_POLL_MIN;
        }
        let busy = jobs.iter().any(|e| {
            matches!(
                e.job.lock().0,
                JobState::Queued | JobState::Registering | JobState::Gated(_)
            )
        });
        if !releasing.is_empty() && (closing || !busy || releasing_bytes >= RELEASE_BATCH) {
            release(&mut releasing, counts);
            releasing_bytes = 0;
        }
        if closing && jobs.is_empty() {
            // Jobs sent from here on find the channel open until this returns: mark the
            // registrar gone first (a future that sends after this sees it at its next look,
            // `MappedRead::poll`), then revoke whatever is already in the channel.
            counts.gone.store(true, Ordering::SeqCst);
            while let Ok(m) = rx.try_recv() {
                if let RegistrarMsg::Job(job) = m {
                    let mut g = job.lock();
                    let waker = MappedJob::settle(&mut g, JobState::Revoked);
                    drop(g);
                    if let Some(w) = waker {
                        w.wake();
                    }
                }
            }
            return;
        }
    }
}

/// Registers `e`'s mapping, outside its lock; the future is woken to queue its copy.
fn register(e: &mut Entry, counts: &RegistrarCounts) {
    let job = &e.job;
    {
        let mut g = job.lock();
        if !matches!(g.0, JobState::Queued) {
            return;
        }
        g.0 = JobState::Registering;
    }
    let rc = match job.ctx.bind_to_thread() {
        // SAFETY: the range is the job's own live mapping, which the job (held here) keeps
        // mapped until after it is unregistered; read-only registration matches its
        // protection. Nothing reads the memory on the CPU.
        Ok(()) => unsafe {
            sys::cuMemHostRegister_v2(
                job.map.addr(),
                job.map.len(),
                sys::CU_MEMHOSTREGISTER_READ_ONLY,
            )
        },
        Err(e) => e.0,
    };
    let mut g = job.lock();
    let to = if rc == sys::CUresult::CUDA_SUCCESS {
        e.registered = true;
        counts.live.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(1, Ordering::Relaxed);
        JobState::Registered
    } else {
        counts.refused.fetch_add(1, Ordering::Relaxed);
        // Out of pinnable memory, or a context that could not be bound, says nothing about
        // the file; other refusals (the filesystem's pages cannot be pinned, the range
        // vanished under a truncate) would recur.
        let transient = matches!(
            rc,
            sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
                | sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
                | sys::CUresult::CUDA_ERROR_INVALID_CONTEXT
                | sys::CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED
        );
        JobState::Refused(
            format!("cuMemHostRegister of a file mapping: {rc:?}"),
            !transient,
        )
    };
    if matches!(g.0, JobState::Abandoned) {
        return;
    }
    let waker = MappedJob::settle(&mut g, to);
    drop(g);
    if let Some(w) = waker {
        w.wake();
    }
}

/// What [`settle`] decided for a job.
enum Settled {
    /// Still the registrar's to watch.
    Keep,
    /// Done with: never registered, or kept registered for good.
    Done,
    /// Done with, and registered: unregister it (no copy reads it any more).
    Release,
}

/// Acts on `e`'s state: whether the registrar keeps watching it, is done with it, or should
/// unregister it.
fn settle(e: &mut Entry, closing: bool) -> Settled {
    let mut g = e.job.lock();
    let mut waker = None;
    match &g.0 {
        JobState::Queued | JobState::Registered if closing => {
            waker = MappedJob::settle(&mut g, JobState::Revoked);
        }
        JobState::Queued | JobState::Registering | JobState::Registered => return Settled::Keep,
        JobState::Gated(gate) => {
            let done = if closing {
                gate.wait().map(|()| true)
            } else {
                gate.query()
            };
            match done {
                Ok(true) => {}
                Ok(false) => return Settled::Keep,
                Err(why) => {
                    tracing::warn!(%why, "a mapped read's copy event failed; its pages stay pinned");
                    g.0 = JobState::Stuck;
                }
            }
        }
        JobState::Stuck | JobState::Refused(..) | JobState::Abandoned | JobState::Revoked => {}
    }
    let stuck = matches!(g.0, JobState::Stuck);
    drop(g);
    if let Some(w) = waker {
        w.wake();
    }
    match (e.registered, stuck) {
        (false, _) => Settled::Done,
        (true, true) => {
            // A copy may still read the pages: keep the registration and the mapping (the
            // job) for the process's life.
            std::mem::forget(e.job.clone());
            Settled::Done
        }
        (true, false) => Settled::Release,
    }
}

/// Unregisters every job in `jobs` (their copies are done, or none was queued). One the driver
/// does not unregister is kept, mapping and all, for the process's life, rather than unmapped
/// under the driver.
fn release(jobs: &mut Vec<Arc<MappedJob>>, counts: &RegistrarCounts) {
    for job in jobs.drain(..) {
        if unregister(&job) {
            counts.live.fetch_sub(1, Ordering::Relaxed);
            LIVE.fetch_sub(1, Ordering::Relaxed);
        } else {
            std::mem::forget(job);
        }
    }
}

/// Unregisters `job`'s mapping; `false` if the driver did not. No copy reads it: none was
/// queued, or its event completed.
fn unregister(job: &MappedJob) -> bool {
    if job.ctx.bind_to_thread().is_err() {
        return false;
    }
    // SAFETY: the mapping was registered by `register` and not unregistered since; no queued
    // copy reads it (the caller's precondition).
    let rc = unsafe { sys::cuMemHostUnregister(job.map.addr()) };
    rc == sys::CUresult::CUDA_SUCCESS
}
