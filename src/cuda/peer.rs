//! Copies between GPUs that go straight over NVLink or PCIe peer-to-peer.
//!
//! Without peer access the driver still copies between GPUs, but through host memory: on the
//! lent two-H100 host (NVLink, `NV18`) a 1 GiB copy runs at 41 GB/s that way and at 389 GB/s
//! once access is on. Two switches matter, and both are per pair and direction:
//! `cuCtxEnablePeerAccess` covers memory from `cuMemAlloc` (what torch's allocator uses), and
//! `cuMemPoolSetAccess` covers memory from the device's stream-ordered pool (`cuMemAllocAsync`,
//! which cudarc uses where the driver has it). [`enable`] turns on both, in both directions.
//!
//! Turning access on is process-wide and stays on (the driver has no per-allocation switch for
//! context memory); it only lets the peer GPU map the memory, which no copy or kernel does
//! unless it is given a pointer to it.

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};

/// Whether GPU `a` can read and write GPU `b`'s memory directly (NVLink or PCIe
/// peer-to-peer). The same device counts as yes.
pub fn can_access(a: &CudaContext, b: &CudaContext) -> bool {
    if a.cu_device() == b.cu_device() {
        return true;
    }
    let mut yes = 0i32;
    // SAFETY: `yes` is a valid out-pointer; both arguments are devices the driver gave
    // cudarc, whose contexts are alive.
    let rc = unsafe { sys::cuDeviceCanAccessPeer(&mut yes, a.cu_device(), b.cu_device()) };
    rc == sys::CUresult::CUDA_SUCCESS && yes == 1
}

/// Lets `a` and `b` access each other's memory, both context allocations and the devices'
/// current memory pools. A no-op for one device; `Err` says which step the driver refused
/// (copies between the two still work then, staged through host memory).
pub fn enable(a: &Arc<CudaContext>, b: &Arc<CudaContext>) -> Result<(), String> {
    if a.cu_device() == b.cu_device() {
        return Ok(());
    }
    // Each direction makes its context current; the caller's current context (which the
    // runtime API, torch's included, reads as the current device) is put back after.
    let mut current: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: `current` is a valid out-pointer.
    let had = unsafe { sys::cuCtxGetCurrent(&mut current) } == sys::CUresult::CUDA_SUCCESS;
    let enabled = one_way(a, b).and_then(|()| one_way(b, a));
    if had {
        // SAFETY: `current` was this thread's current context a moment ago (or null, which
        // unbinds); the caller holds whatever keeps it alive.
        unsafe { sys::cuCtxSetCurrent(current) };
    }
    enabled
}

/// `from` may access `to`'s memory.
fn one_way(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<(), String> {
    from.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    // SAFETY: `to`'s context is alive (we hold it); the flags argument must be 0.
    let rc = unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) };
    if rc != sys::CUresult::CUDA_SUCCESS
        && rc != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
    {
        return Err(format!(
            "cuCtxEnablePeerAccess from GPU {} to GPU {}: {rc:?}",
            from.ordinal(),
            to.ordinal()
        ));
    }
    // `to`'s current pool (where cuMemAllocAsync takes memory from) opens to `from`.
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `pool` is a valid out-pointer and the device is one the driver gave cudarc.
    let rc = unsafe { sys::cuDeviceGetMemPool(&mut pool, to.cu_device()) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        // No stream-ordered pools on this driver: cudarc allocates with cuMemAlloc then.
        return Ok(());
    }
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: from.ordinal() as i32,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: `pool` came from the driver just now; `desc` is one valid descriptor.
    let rc = unsafe { sys::cuMemPoolSetAccess(pool, &desc, 1) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "cuMemPoolSetAccess for GPU {} on GPU {}'s pool: {rc:?}",
            from.ordinal(),
            to.ordinal()
        ));
    }
    Ok(())
}
