//! The cuFile lane: batch I/O between files and the device staging pool, polled for status
//! (the queue itself is `gds::batch`), with cuFile's routing, result codes and fallback.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;

use crate::error::{Context, Error};
use crate::gds::batch::{BatchEntry, BatchQueue, RES_LOST, cufile_code_of};
use crate::gds::pool::DeviceStagingPool;
use crate::gds::result::{CufileCode, cufile};
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
pub(crate) struct CufileLane {
    ready: Option<CufileBatch>,
    /// Why the lane could not be set up (asked once per engine).
    unavailable: Option<String>,
    /// The engine's reactors, each with a lane of its own: they share cuFile's in-flight limit.
    reactors: usize,
}

impl CufileLane {
    /// The lane of one of an engine's `reactors` reactors.
    pub(crate) fn for_reactor_of(reactors: usize) -> Self {
        CufileLane {
            ready: None,
            unavailable: None,
            reactors,
        }
    }
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
                    queue: BatchQueue::new(cf, BATCH_HANDLES, self.reactors),
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
