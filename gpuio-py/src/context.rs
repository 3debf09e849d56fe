//! Leaving the caller's CUDA context as it was.
//!
//! The library binds the context of the memory's GPU to the thread that queues copies (for a
//! sync call, the caller's), and finding out which GPU an address belongs to binds GPU 0's.
//! CUDA's runtime API (torch, cupy) takes its current device from the thread's current
//! context, so a read into `cuda:1` memory would quietly change a torch program's current
//! device. [`KeepCurrentContext`] records the thread's context and puts it back when dropped.

use gpuio::cuda::cudarc::driver::sys;

/// Restores the thread's current CUDA context when dropped.
pub struct KeepCurrentContext {
    saved: Option<sys::CUcontext>,
}

impl KeepCurrentContext {
    /// Records the current context; does nothing where CUDA is not usable (cudarc's loader
    /// must not be touched without a driver).
    pub fn save() -> Self {
        if !gpuio::cuda::available() {
            return KeepCurrentContext { saved: None };
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver was found (`available`); cuCtxGetCurrent writes one handle into
        // `ctx`, which outlives the call.
        let r = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
        KeepCurrentContext {
            saved: (r == sys::CUresult::CUDA_SUCCESS).then_some(ctx),
        }
    }
}

impl Drop for KeepCurrentContext {
    fn drop(&mut self) {
        if let Some(ctx) = self.saved {
            // SAFETY: `ctx` was this thread's current context (or null: none) when saved;
            // primary contexts stay alive while their owners (torch, cupy, gpuio) retain them.
            // A failure leaves the thread as the operation left it, which is only less tidy.
            let _ = unsafe { sys::cuCtxSetCurrent(ctx) };
        }
    }
}
