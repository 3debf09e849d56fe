//! The reactor's cuFile lane: the batch queue, the device staging pool and its slots.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::buf::arena::SlotAllocator;
use crate::gds::batch::BatchQueue;
use crate::gds::driver::cufile;
use crate::gds::pool::StagingPool;

/// Batch handles one engine may use at once (each carries one submission of up to 128 entries).
const BATCH_HANDLES: usize = 16;

/// cuFile batch I/O as one engine's reactor runs it.
pub(crate) struct GdsLane {
    pub(crate) queue: BatchQueue,
    pub(crate) pool: Arc<StagingPool>,
    pub(crate) slots: SlotAllocator,
}

impl GdsLane {
    /// A staging pool shaped like the host bounce pool (`blocks` blocks of `block` bytes) on
    /// `ctx`'s device.
    pub(crate) fn new(ctx: &Arc<CudaContext>, block: usize, blocks: usize) -> Result<Self, String> {
        let cf = cufile()?;
        let pool = Arc::new(StagingPool::new(ctx, block * blocks)?);
        Ok(GdsLane {
            queue: BatchQueue::new(cf, BATCH_HANDLES),
            pool,
            slots: SlotAllocator::for_device(block, blocks),
        })
    }
}
