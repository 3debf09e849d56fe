//! The cuFile batch queue the cuFile lane drives: entries queue up, go out through
//! `cuFileBatchIOSubmit` on a small pool of batch handles (each with one submission
//! outstanding at a time, at most [`BATCH_MAX`] entries), and are reaped with non-blocking
//! `cuFileBatchIOGetStatus` from the reactor loop. Every call goes through the result tier
//! (`gds::result`).

use std::ffi::c_void;

use super::result::Cufile;
use super::sys::{
    BATCH_MODE, OP_READ, OP_WRITE, RawBatch, RawHandle, RawIoEvent, RawIoParams, STATUS_CANCELED,
    STATUS_COMPLETE, STATUS_FAILED, STATUS_INVALID, STATUS_TIMEOUT,
};
use crate::lane::Completion;

/// Most entries one submission carries (cuFile's default `max_batch_io_size`).
pub(crate) const BATCH_MAX: usize = 128;

/// Most entries in cuFile at once. cuFile's `max_io_queue_depth` (cufile.json, 128 by default)
/// bounds its queue; in compatibility mode, measured on the H200 machine, submissions past it
/// never complete (160 outstanding 4 KiB reads hung, 128 ran). `GPUIO_CUFILE_MAX_INFLIGHT`
/// overrides it for a cufile.json with a larger depth.
const DEFAULT_MAX_INFLIGHT: usize = 128;

/// A submission with no entry completing for this long is treated as lost (cancelled, its
/// memory never reused; its ops fail, or under AUTO are read again through the bounce path)
/// instead of waited on.
const STALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

fn max_inflight() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("GPUIO_CUFILE_MAX_INFLIGHT")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n| n > 0)
            .unwrap_or(DEFAULT_MAX_INFLIGHT)
    })
}

/// Completion result for an entry whose fate cuFile could not tell (its batch status query
/// failed even after cancelling): the reactor must never reuse its memory.
pub(crate) const RES_LOST: i32 = i32::MIN;

/// cuFile status codes travel in `Completion::res` as `-code` (all above 5000, so they never
/// collide with `-errno`).
pub(crate) fn cufile_code_of(res: i32) -> Option<i32> {
    (res != RES_LOST && res <= -5000).then_some(-res)
}

/// One I/O for the batch queue.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchEntry {
    pub(crate) fh: RawHandle,
    pub(crate) dev_base: u64,
    pub(crate) dev_offset: usize,
    pub(crate) file_offset: u64,
    pub(crate) len: usize,
    pub(crate) write: bool,
    pub(crate) token: u64,
}

// SAFETY: the raw handle is only passed back to cuFile, which allows any thread.
unsafe impl Send for BatchEntry {}

struct Submitted {
    raw: RawBatch,
    tokens: Vec<u64>,
    done: Vec<bool>,
    left: usize,
    /// When an entry last completed (or the submission went out).
    progress: std::time::Instant,
}

/// The reactor's cuFile batch machinery.
pub(crate) struct BatchQueue {
    cf: &'static Cufile,
    idle: Vec<RawBatch>,
    busy: Vec<Submitted>,
    created: usize,
    max_handles: usize,
    /// Most entries this queue keeps in cuFile: its share of the process's limit.
    max_inflight: usize,
    queued: Vec<BatchEntry>,
    params: Vec<RawIoParams>,
    events: Vec<RawIoEvent>,
}

// SAFETY: batch handles are plain cuFile handles, usable from the (single) reactor thread that
// owns the queue; moving the queue to that thread is fine.
unsafe impl Send for BatchQueue {}

impl BatchQueue {
    /// A queue of at most `max_handles` batch handles that keeps at most `1/shares` of the
    /// in-flight limit in cuFile: an engine with several reactors has a queue in each, and
    /// together they stay within the limit past which compatibility mode hangs.
    pub(crate) fn new(cf: &'static Cufile, max_handles: usize, shares: usize) -> Self {
        BatchQueue {
            cf,
            idle: Vec::new(),
            busy: Vec::new(),
            created: 0,
            max_handles: max_handles.max(1),
            max_inflight: (max_inflight() / shares.max(1)).max(1),
            queued: Vec::new(),
            params: Vec::with_capacity(BATCH_MAX),
            events: vec![RawIoEvent::EMPTY; BATCH_MAX],
        }
    }

    pub(crate) fn push(&mut self, e: BatchEntry) {
        self.queued.push(e);
    }

    /// Entries queued or in cuFile.
    pub(crate) fn outstanding(&self) -> usize {
        self.queued.len() + self.busy.iter().map(|b| b.left).sum::<usize>()
    }

    fn handle(&mut self) -> Result<Option<RawBatch>, String> {
        if let Some(h) = self.idle.pop() {
            return Ok(Some(h));
        }
        if self.created >= self.max_handles {
            return Ok(None);
        }
        let raw = self
            .cf
            .batch_setup(BATCH_MAX as u32)
            .map_err(|c| format!("cuFileBatchIOSetUp: {c}"))?;
        self.created += 1;
        Ok(Some(raw))
    }

    /// Submits queued entries on idle handles. Entries cuFile refuses complete at once (in
    /// `out`) with the refusal's code.
    pub(crate) fn submit(&mut self, out: &mut Vec<Completion>) {
        while !self.queued.is_empty() {
            let in_cufile: usize = self.busy.iter().map(|b| b.left).sum();
            let room = self.max_inflight.saturating_sub(in_cufile);
            if room == 0 {
                return;
            }
            let raw = match self.handle() {
                Ok(Some(h)) => h,
                Ok(None) => return,
                Err(reason) => {
                    tracing::warn!(%reason, "cuFile batch handle setup failed");
                    if self.busy.is_empty() {
                        // Nothing in flight will free a handle: fail what waits.
                        for e in self.queued.drain(..) {
                            out.push(Completion {
                                token: e.token,
                                res: -5030,
                            });
                        }
                    }
                    return;
                }
            };
            let n = self.queued.len().min(BATCH_MAX).min(room);
            let batch: Vec<BatchEntry> = self.queued.drain(..n).collect();
            self.params.clear();
            // The cookie is the entry's index in its submission, so reaping finds it at once.
            for (k, e) in batch.iter().enumerate() {
                self.params.push(RawIoParams {
                    mode: BATCH_MODE,
                    dev_ptr_base: e.dev_base as *mut c_void,
                    file_offset: e.file_offset as i64,
                    dev_ptr_offset: e.dev_offset as i64,
                    size: e.len,
                    fh: e.fh,
                    opcode: if e.write { OP_WRITE } else { OP_READ },
                    cookie: k as *mut c_void,
                });
            }
            // SAFETY: `raw` is an idle batch handle; `params` holds `n <= BATCH_MAX` valid
            // entries whose handles are registered and whose device ranges lie inside the
            // registered staging pool (the reactor owns both until the entries complete).
            match unsafe { self.cf.batch_submit(raw, &mut self.params) } {
                Ok(()) => self.busy.push(Submitted {
                    raw,
                    tokens: batch.iter().map(|e| e.token).collect(),
                    done: vec![false; n],
                    left: n,
                    progress: std::time::Instant::now(),
                }),
                Err(code) => {
                    self.idle.push(raw);
                    for e in batch {
                        out.push(Completion {
                            token: e.token,
                            res: -code.err,
                        });
                    }
                }
            }
        }
    }

    /// Collects finished entries without waiting.
    pub(crate) fn reap(&mut self, out: &mut Vec<Completion>) {
        let mut i = 0;
        while i < self.busy.len() {
            let b = &mut self.busy[i];
            let want = b.left.min(BATCH_MAX);
            // SAFETY: `raw` has a submission outstanding.
            let status = unsafe { self.cf.batch_status(b.raw, &mut self.events[..want]) };
            let stalled = matches!(status, Ok(0)) && b.progress.elapsed() > STALL_LIMIT;
            let nr = match status {
                Ok(_) if stalled => Err(format!("no entry completed in {STALL_LIMIT:?}")),
                Ok(nr) => Ok(nr),
                Err(code) => Err(code.to_string()),
            };
            let nr = match nr {
                Ok(nr) => nr,
                Err(code) => {
                    tracing::error!(%code, "cuFile batch failed or stalled; cancelling it");
                    // SAFETY: `raw` is a live batch handle.
                    let _ = unsafe { self.cf.batch_cancel(b.raw) };
                    for (k, t) in b.tokens.iter().enumerate() {
                        if !b.done[k] {
                            out.push(Completion {
                                token: *t,
                                res: RES_LOST,
                            });
                        }
                    }
                    // The handle is not trusted again: leak it rather than reuse it.
                    self.busy.swap_remove(i);
                    continue;
                }
            };
            for ev in &self.events[..nr] {
                let k = ev.cookie as usize;
                let Some(&token) = b.tokens.get(k) else {
                    continue;
                };
                let res = match ev.status {
                    STATUS_COMPLETE => ev.ret.min(i32::MAX as usize) as i32,
                    STATUS_FAILED => {
                        let r = ev.ret as isize;
                        if r < 0 {
                            r.max(-(i32::MAX as isize)) as i32
                        } else if (5000..6000).contains(&r) {
                            -(r as i32)
                        } else {
                            -libc::EIO
                        }
                    }
                    STATUS_CANCELED => -libc::ECANCELED,
                    STATUS_TIMEOUT => -libc::ETIMEDOUT,
                    STATUS_INVALID => -libc::EINVAL,
                    _ => continue,
                };
                if b.done[k] {
                    continue;
                }
                b.done[k] = true;
                b.left -= 1;
                b.progress = std::time::Instant::now();
                out.push(Completion { token, res });
            }
            if b.left == 0 {
                let done = self.busy.swap_remove(i);
                self.idle.push(done.raw);
            } else {
                i += 1;
            }
        }
    }
}

impl Drop for BatchQueue {
    fn drop(&mut self) {
        // The reactor drops the queue only with nothing outstanding; a busy handle left here
        // (reactor death) is leaked, never destroyed under running I/O.
        for raw in self.idle.drain(..) {
            // SAFETY: idle handles have nothing outstanding.
            unsafe { self.cf.batch_destroy(raw) };
        }
        for b in self.busy.drain(..) {
            // SAFETY: cancelling is allowed on a live handle; it is then leaked, not destroyed.
            let _ = unsafe { self.cf.batch_cancel(b.raw) };
        }
    }
}
