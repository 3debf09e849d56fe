//! The cuFile lane: batch I/O between files and the device staging pool, polled for status.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;

use super::{Completion, IoKind, Lane, LaneIo, LaneMem, WaitHint};
use crate::gds::batch::{BatchEntry, BatchQueue};
use crate::gds::driver::cufile;
use crate::gds::pool::StagingPool;

/// Batch handles one engine may use at once (each carries one submission of up to 128 entries).
const BATCH_HANDLES: usize = 16;

/// How often the reactor reaps cuFile batch status while batch I/O is outstanding.
const POLL_INTERVAL: Duration = Duration::from_micros(20);

/// cuFile batch I/O as one engine's reactor runs it, into and out of one device staging pool.
pub(crate) struct CufileLane {
    queue: BatchQueue,
    pub(crate) pool: Arc<StagingPool>,
}

impl CufileLane {
    /// A lane with a staging pool of `bytes` on `ctx`'s device.
    pub(crate) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, String> {
        let cf = cufile()?;
        let pool = Arc::new(StagingPool::new(ctx, bytes)?);
        Ok(CufileLane {
            queue: BatchQueue::new(cf, BATCH_HANDLES),
            pool,
        })
    }
}

impl Lane for CufileLane {
    fn name(&self) -> &'static str {
        "cufile"
    }

    fn push(&mut self, io: LaneIo<'_>) -> io::Result<()> {
        let LaneMem::Device { offset } = io.mem else {
            return Err(io::Error::other(
                "cuFile pieces move through device staging memory",
            ));
        };
        let Some(fg) = io.target.gds() else {
            return Err(io::Error::other("the file has no cuFile registration"));
        };
        self.queue.push(BatchEntry {
            fh: fg.handle.raw(),
            dev_base: self.pool.base(),
            dev_offset: offset,
            file_offset: io.pos,
            len: io.len,
            write: io.kind == IoKind::Write,
            token: io.token,
        });
        Ok(())
    }

    fn flush(&mut self, out: &mut Vec<Completion>) {
        self.queue.submit(out);
    }

    fn wait(
        &mut self,
        _block: bool,
        _timeout: Option<Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()> {
        self.queue.reap(out);
        Ok(())
    }

    fn outstanding(&self) -> usize {
        self.queue.outstanding()
    }

    fn wait_hint(&self) -> WaitHint {
        if self.queue.outstanding() > 0 {
            WaitHint::PollEvery(POLL_INTERVAL)
        } else {
            WaitHint::Sleep
        }
    }
}
