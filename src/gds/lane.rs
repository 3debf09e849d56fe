//! The cuFile lane: batch I/O between files and the device staging pool, polled for status.
//!
//! Batch I/O as the reactor drives it: entries queue up, go out through
//! `cuFileBatchIOSubmit` on a small pool of batch handles (each with one submission
//! outstanding at a time, at most [`BATCH_MAX`] entries), and are reaped with non-blocking
//! `cuFileBatchIOGetStatus` (`min_nr = 0`, no timeout) from the reactor loop.

use std::ffi::{c_uint, c_void};
use std::io;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;

use crate::error::{Context, Error};
use crate::gds::driver::CufileCode;
use crate::gds::driver::{Cufile, check, cufile};
use crate::gds::pool::DeviceStagingPool;
use crate::gds::sys::{
    BATCH_MODE, OP_READ, OP_WRITE, RawBatch, RawHandle, RawIoEvent, RawIoParams, STATUS_CANCELED,
    STATUS_COMPLETE, STATUS_FAILED, STATUS_INVALID, STATUS_TIMEOUT,
};
use crate::lane::{
    Completion, IoKind, Lane, LaneIo, LaneMem, Outcome, Route, RouteAsk, Routed, WaitHint,
};
use crate::target::Target;

/// Batch handles one engine may use at once (each carries one submission of up to 128 entries).
const BATCH_HANDLES: usize = 16;

/// How often the reactor reaps cuFile batch status while batch I/O is outstanding.
const POLL_INTERVAL: Duration = Duration::from_micros(20);

/// cuFile batch I/O as one engine's reactor runs it, into and out of one device staging pool,
/// set up on the first op it serves (with the pool on that op's GPU). Routing, the meaning of
/// cuFile's result codes and the per-file fallback live here, behind `trait Lane`: the reactor
/// names none of them.
#[derive(Default)]
pub(crate) struct CufileLane {
    ready: Option<CufileBatch>,
    /// Why the lane could not be set up (asked once per engine).
    unavailable: Option<String>,
}

/// The set-up lane: its batch queue and staging pool.
struct CufileBatch {
    queue: BatchQueue,
    pool: Arc<DeviceStagingPool>,
}

impl CufileLane {
    /// The lane for memory on `ctx`'s device, set up on first use with a staging pool of
    /// `bytes`.
    fn ready_for(&mut self, ctx: &Arc<CudaContext>, bytes: usize) -> Result<&CufileBatch, String> {
        if self.ready.is_none() {
            if let Some(why) = &self.unavailable {
                return Err(why.clone());
            }
            let made = cufile().and_then(|cf| {
                Ok(CufileBatch {
                    queue: BatchQueue::new(cf, BATCH_HANDLES),
                    pool: Arc::new(DeviceStagingPool::new(ctx, bytes)?),
                })
            });
            match made {
                Ok(b) => {
                    tracing::info!(bytes, device = ctx.ordinal(), "gpuio cuFile lane ready");
                    self.ready = Some(b);
                }
                Err(why) => {
                    tracing::warn!(%why, "gpuio cannot set up cuFile batch I/O; device transfers use the bounce path");
                    self.unavailable = Some(why.clone());
                    return Err(why);
                }
            }
        }
        let batch = self.ready.as_ref().expect("set above");
        if batch.pool.context().ordinal() != ctx.ordinal() {
            return Err(format!(
                "this engine's cuFile staging pool is on GPU {}; memory on GPU {} uses the bounce path",
                batch.pool.context().ordinal(),
                ctx.ordinal()
            ));
        }
        Ok(batch)
    }
}

impl Lane for CufileLane {
    fn name(&self) -> &'static str {
        "cufile"
    }

    fn push(&mut self, io: LaneIo<'_>) -> io::Result<()> {
        let Some(batch) = self.ready.as_mut() else {
            return Err(io::Error::other("the cuFile lane is not set up"));
        };
        let LaneMem::Device { offset } = io.mem else {
            return Err(io::Error::other(
                "cuFile pieces move through device staging memory",
            ));
        };
        let Some(fg) = io.target.gds() else {
            return Err(io::Error::other("the file has no cuFile registration"));
        };
        batch.queue.push(BatchEntry {
            fh: fg.handle.raw(),
            dev_base: batch.pool.base(),
            dev_offset: offset,
            file_offset: io.pos,
            len: io.len,
            write: io.kind == IoKind::Write,
            token: io.token,
        });
        Ok(())
    }

    fn flush(&mut self, out: &mut Vec<Completion>) {
        if let Some(b) = self.ready.as_mut() {
            b.queue.submit(out);
        }
    }

    fn wait(
        &mut self,
        _block: bool,
        _timeout: Option<Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()> {
        if let Some(b) = self.ready.as_mut() {
            b.queue.reap(out);
        }
        Ok(())
    }

    fn outstanding(&self) -> usize {
        self.ready.as_ref().map_or(0, |b| b.queue.outstanding())
    }

    fn wait_hint(&self) -> WaitHint {
        if self.outstanding() > 0 {
            WaitHint::PollEvery(POLL_INTERVAL)
        } else {
            WaitHint::Sleep
        }
    }

    /// Device memory of a file cuFile serves (true GDS, compat where allowed, or forced).
    fn route(&mut self, ask: &RouteAsk<'_>) -> Routed {
        let (Some(ctx), Some(fg)) = (ask.device, ask.target.gds()) else {
            return Routed::No;
        };
        if !fg.serves() {
            return Routed::No;
        }
        let (block, blocks) = ask.pool_shape;
        match self.ready_for(ctx, block * blocks) {
            Ok(batch) => Routed::Take(Route {
                align: fg.align,
                chunk: ask.direct_chunk,
                backend: fg.status().backend_name(),
                staging: Some((batch.pool.base(), batch.pool.clone())),
            }),
            Err(why) if fg.forced() => Routed::Refuse {
                backend: "cufile",
                why,
            },
            Err(_) => Routed::No,
        }
    }

    fn classify(&self, res: i32, target: &Target) -> Outcome {
        let (why, fallback) = if res == RES_LOST {
            // cuFile cannot say whether the DMA still runs: the piece's memory is never reused.
            (
                "cuFile lost track of a batch I/O (status query failed or stalled)".to_string(),
                true,
            )
        } else if let Some(err) = cufile_code_of(res) {
            let code = CufileCode { err, cu_err: 0 };
            (
                format!("cuFile batch I/O failed: {code}"),
                code.calls_for_fallback(),
            )
        } else {
            return Outcome::Res(res);
        };
        let forced = target.gds().is_none_or(|fg| fg.forced());
        Outcome::Failed {
            why,
            fallback: fallback && !forced,
            lost: res == RES_LOST,
        }
    }

    fn fall_back(&self, target: &Target, why: String) {
        if let Some(fg) = target.gds() {
            fg.fall_back(&target.path, why);
        }
    }

    fn failure(&self, ctx: Context, why: String) -> Error {
        Error::cuda_msg(ctx, why)
    }
}

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
    queued: Vec<BatchEntry>,
    params: Vec<RawIoParams>,
    events: Vec<RawIoEvent>,
}

// SAFETY: batch handles are plain cuFile handles, usable from the (single) reactor thread that
// owns the queue; moving the queue to that thread is fine.
unsafe impl Send for BatchQueue {}

impl BatchQueue {
    pub(crate) fn new(cf: &'static Cufile, max_handles: usize) -> Self {
        BatchQueue {
            cf,
            idle: Vec::new(),
            busy: Vec::new(),
            created: 0,
            max_handles: max_handles.max(1),
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
        let mut raw: RawBatch = std::ptr::null_mut();
        // SAFETY: `raw` is writable; BATCH_MAX is within cuFile's documented limit.
        check(unsafe { (self.cf.lib.cuFileBatchIOSetUp)(&mut raw, BATCH_MAX as c_uint) })
            .map_err(|c| format!("cuFileBatchIOSetUp: {c}"))?;
        self.created += 1;
        Ok(Some(raw))
    }

    /// Submits queued entries on idle handles. Entries cuFile refuses complete at once (in
    /// `out`) with the refusal's code.
    pub(crate) fn submit(&mut self, out: &mut Vec<Completion>) {
        while !self.queued.is_empty() {
            let in_cufile: usize = self.busy.iter().map(|b| b.left).sum();
            let room = max_inflight().saturating_sub(in_cufile);
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
            let rc = unsafe {
                (self.cf.lib.cuFileBatchIOSubmit)(raw, n as c_uint, self.params.as_mut_ptr(), 0)
            };
            match check(rc) {
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
            let mut nr = b.left.min(BATCH_MAX) as c_uint;
            let mut zero = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: `raw` has a submission outstanding; `events` has room for `nr` events;
            // min_nr 0 with a zero timeout returns at once.
            let rc = unsafe {
                (self.cf.lib.cuFileBatchIOGetStatus)(
                    b.raw,
                    0,
                    &mut nr,
                    self.events.as_mut_ptr(),
                    &mut zero,
                )
            };
            let stalled = check(rc).is_ok() && nr == 0 && b.progress.elapsed() > STALL_LIMIT;
            if let Err(code) = check(rc).map_err(|c| c.to_string()).and_then(|()| {
                if stalled {
                    Err(format!("no entry completed in {STALL_LIMIT:?}"))
                } else {
                    Ok(())
                }
            }) {
                tracing::error!(%code, "cuFile batch failed or stalled; cancelling it");
                // SAFETY: `raw` is a live batch handle.
                let _ = unsafe { (self.cf.lib.cuFileBatchIOCancel)(b.raw) };
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
            for ev in &self.events[..(nr as usize).min(BATCH_MAX)] {
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
            unsafe { (self.cf.lib.cuFileBatchIODestroy)(raw) };
        }
        for b in self.busy.drain(..) {
            // SAFETY: cancelling is allowed on a live handle; it is then leaked, not destroyed.
            let _ = unsafe { (self.cf.lib.cuFileBatchIOCancel)(b.raw) };
        }
    }
}
