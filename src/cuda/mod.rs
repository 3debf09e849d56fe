//! CUDA, probed at run time. gpuio builds and its host paths run on machines without a GPU or
//! CUDA libraries; this module finds out what is there without ever panicking (cudarc's own
//! loader panics when a library is missing, so nothing calls it before this probe says yes).

mod sys;

pub use sys::CudaProbe;

/// Looks for the CUDA driver library and asks it for its version and devices.
pub fn probe() -> CudaProbe {
    sys::probe()
}
