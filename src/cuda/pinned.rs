//! Page-locking the bounce pool with CUDA, so host-to-device copies from it are true DMA and
//! asynchronous.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::sys;

/// A host range registered with `cuMemHostRegister`; unregistered on drop.
pub(crate) struct PinnedRegion {
    ctx: Arc<CudaContext>,
    base: *mut u8,
}

// SAFETY: the pointer is only handed back to the driver (unregister), never dereferenced.
unsafe impl Send for PinnedRegion {}
// SAFETY: as above.
unsafe impl Sync for PinnedRegion {}

impl PinnedRegion {
    /// Registers `[base, base + len)` as portable pinned memory (every context sees it pinned).
    ///
    /// # Safety
    /// The range must be mapped memory that stays mapped until the returned value is dropped.
    pub(crate) unsafe fn register(
        ctx: &Arc<CudaContext>,
        base: *mut u8,
        len: usize,
    ) -> Result<Self, String> {
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        // SAFETY: the caller guarantees the range is mapped for the region's lifetime.
        let rc = unsafe {
            sys::cuMemHostRegister_v2(base.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        if rc != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemHostRegister of {len} bytes failed: {rc:?}"));
        }
        Ok(PinnedRegion {
            ctx: ctx.clone(),
            base,
        })
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        // Errors are ignored: the memory is unmapped right after, and there is no one to tell.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: base was registered by `register` and not yet unregistered.
            let _ = unsafe { sys::cuMemHostUnregister(self.base.cast()) };
        }
    }
}
