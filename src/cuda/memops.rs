//! The driver call batched copies need that cudarc's result and safe tiers do not wrap:
//! `cuMemcpyBatchAsync_v2` (CUDA 13 drivers).
//!
//! cudarc's own wrappers resolve a symbol on first call and panic when the driver lacks it, so
//! these are resolved here, once, through `libloading` on the library cudarc loaded, and kept
//! as function pointers: a missing symbol is a reason to fall back, never a panic.

use std::sync::OnceLock;

use cudarc::driver::sys::{
    self, CUdeviceptr, CUmemcpyAttributes, CUmemcpySrcAccessOrder, CUresult, CUstream,
};

type BatchFn = unsafe extern "C" fn(
    *mut CUdeviceptr,
    *mut CUdeviceptr,
    *mut usize,
    usize,
    *mut CUmemcpyAttributes,
    *mut usize,
    usize,
    CUstream,
) -> CUresult;

/// The resolved entry points.
pub(crate) struct MemOps {
    /// `None` on drivers before CUDA 13 (copies are then issued one by one).
    batch: Option<BatchFn>,
}

/// The entry points, resolved once (`Err` is kept for drivers that cannot be asked at all).
/// Call only once [`crate::cuda::available`] said yes (cudarc panics if libcuda is missing).
pub(crate) fn memops() -> Result<&'static MemOps, String> {
    static OPS: OnceLock<Result<MemOps, String>> = OnceLock::new();
    OPS.get_or_init(|| {
        // SAFETY: libcuda is present (the caller checked); `culib` only loads it.
        let lib = unsafe { sys::culib() };
        // SAFETY: the requested types are the driver API's C signatures of these symbols
        // (CUDA driver API reference; cudarc's sys tier declares the same ones).
        unsafe {
            let batch = lib.get::<BatchFn>(b"cuMemcpyBatchAsync_v2\0").ok();
            Ok(MemOps {
                batch: batch.map(|b| *b),
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn check(r: CUresult, what: &str) -> Result<(), String> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}"))
    }
}

impl MemOps {
    /// Whether batched copies are available (a CUDA 13 driver).
    pub(crate) fn has_batch(&self) -> bool {
        self.batch.is_some()
    }

    /// Queues `dsts.len()` copies on `stream` in one driver call. With
    /// [`SrcOrder::Stream`] each source is read in stream order (never after a later event or
    /// value write on `stream`); with [`SrcOrder::DuringCall`] every source has been read when
    /// the call returns (the driver stages it), so it may be reused at once. Falls back to
    /// nothing: the caller checks [`has_batch`](Self::has_batch) first.
    ///
    /// # Safety
    /// `stream` must be a live non-NULL stream of the context current on this thread; for each
    /// `i`, `[srcs[i], srcs[i] + sizes[i])` and `[dsts[i], dsts[i] + sizes[i])` must be memory
    /// the device may access (device memory, or pinned host memory, each range within one
    /// registration; with `DuringCall`, any host memory) that stays valid until the stream has
    /// passed the copies (with `DuringCall`, sources only until the call returns), and no two
    /// destinations may overlap (copies inside one batch run in no particular order).
    pub(crate) unsafe fn copy_batch(
        &self,
        dsts: &mut [CUdeviceptr],
        srcs: &mut [CUdeviceptr],
        sizes: &mut [usize],
        stream: CUstream,
        order: SrcOrder,
    ) -> Result<(), String> {
        let Some(batch) = self.batch else {
            return Err("the driver has no cuMemcpyBatchAsync".into());
        };
        assert!(dsts.len() == srcs.len() && srcs.len() == sizes.len());
        if dsts.is_empty() {
            return Ok(());
        }
        // SAFETY: an all-zero attribute block is a valid bit pattern (integers and enums whose
        // zero is a declared variant); the source order is set next, the location hints stay
        // "invalid", which the driver ignores for memory that is not managed.
        let mut attrs: CUmemcpyAttributes = unsafe { std::mem::zeroed() };
        attrs.srcAccessOrder = match order {
            SrcOrder::Stream => CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            SrcOrder::DuringCall => {
                CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL
            }
        };
        let mut attr_idx = [0usize];
        // SAFETY: the arrays are as long as the count, one attribute entry at index 0 covers
        // every copy; the caller guarantees the memory and stream preconditions.
        check(
            unsafe {
                batch(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    dsts.len(),
                    &mut attrs,
                    attr_idx.as_mut_ptr(),
                    1,
                    stream,
                )
            },
            "cuMemcpyBatchAsync",
        )
    }
}

/// When a batched copy reads its sources (`CUmemcpySrcAccessOrder`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SrcOrder {
    /// In stream order: the source must stay valid until the stream has passed the copy.
    Stream,
    /// Before the call returns: the source may be reused as soon as it has.
    DuringCall,
}

/// Queues one copy of `n` bytes from `src` to `dst` on `stream` (addresses in the unified
/// address space: device memory or host memory, pinned or not).
///
/// # Safety
/// As [`MemOps::copy_batch`] for one copy; pageable host sources are read before the call
/// returns (the driver stages them).
pub(crate) unsafe fn copy_one(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    stream: CUstream,
) -> Result<(), String> {
    // SAFETY: the caller's preconditions are the driver's.
    check(
        unsafe { sys::cuMemcpyAsync(dst, src, n, stream) },
        "cuMemcpyAsync",
    )
}

/// Waits until `stream` has finished all work queued on it.
///
/// # Safety
/// `stream` must be a live stream of the context current on this thread.
pub(crate) unsafe fn synchronize(stream: CUstream) -> Result<(), String> {
    // SAFETY: the caller's precondition is the driver's.
    check(
        unsafe { sys::cuStreamSynchronize(stream) },
        "cuStreamSynchronize",
    )
}

/// Whether `stream` is being captured into a graph (work queued now would not run now).
///
/// # Safety
/// `stream` must be a live stream (or a NULL/legacy handle) of the context current on this
/// thread.
pub(crate) unsafe fn is_capturing(stream: CUstream) -> Result<bool, String> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the driver writes one status value into `status`, which outlives the call.
    check(
        unsafe { sys::cuStreamIsCapturing(stream, &mut status) },
        "cuStreamIsCapturing",
    )?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Queues on `stream` a copy of `rows` rows of `width` bytes each from `src` (rows `pitch`
/// bytes apart, the first at byte `src_at`) into `dst` at `dst_at`, rows packed: the strided
/// part of a tensor cut out of the whole tensor. Both buffers must be `stream`'s context's;
/// the ranges are checked against them, so bad arguments are an error, never a stray write.
/// cudarc's events order the copy after earlier uses of both buffers and later uses after it.
#[allow(clippy::too_many_arguments)]
#[cfg(feature = "safetensors")] // only tensor cuts use it
pub(crate) fn copy_rows(
    stream: &cudarc::driver::CudaStream,
    dst: &mut cudarc::driver::CudaSlice<u8>,
    dst_at: usize,
    src: &cudarc::driver::CudaSlice<u8>,
    src_at: usize,
    pitch: usize,
    width: usize,
    rows: usize,
) -> Result<(), String> {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    if rows == 0 || width == 0 {
        return Ok(());
    }
    let src_end = (rows - 1)
        .checked_mul(pitch)
        .and_then(|n| n.checked_add(src_at))
        .and_then(|n| n.checked_add(width));
    let dst_end = rows.checked_mul(width).and_then(|n| n.checked_add(dst_at));
    if pitch < width
        || src_end.is_none_or(|e| e > src.len())
        || dst_end.is_none_or(|e| e > dst.len())
    {
        return Err(format!(
            "a strided copy of {rows} rows of {width} bytes ({pitch} apart) from {src_at} does not \
             fit its buffers ({} and {} bytes)",
            src.len(),
            dst.len()
        ));
    }
    let ctx = stream.context();
    if src.context().cu_ctx() != ctx.cu_ctx() || dst.context().cu_ctx() != ctx.cu_ctx() {
        return Err("a strided copy between buffers of another context than its stream's".into());
    }
    ctx.bind_to_thread()
        .map_err(|e| format!("binding the context: {e:?}"))?;
    let (s, _read) = src.device_ptr(stream);
    let (d, _write) = dst.device_ptr_mut(stream);
    // Every field spelled out: `CUmemorytype` has no zero variant, so an all-zero value of
    // this struct is not a valid one (`mem::zeroed` aborts on it).
    let p = sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: s + src_at as u64,
        srcArray: std::ptr::null_mut(),
        srcPitch: pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: d + dst_at as u64,
        dstArray: std::ptr::null_mut(),
        dstPitch: width,
        WidthInBytes: width,
        Height: rows,
    };
    // SAFETY: the context is current; both ranges were checked to lie inside their device
    // buffers, which cudarc keeps allocated until the stream has passed this copy (its events,
    // recorded as the guards drop); the two buffers are distinct allocations (one borrowed
    // shared, one exclusive), so the ranges do not overlap; the copy is ordered on `stream`.
    check(
        unsafe { sys::cuMemcpy2DAsync_v2(&p, stream.cu_stream()) },
        "cuMemcpy2DAsync",
    )
}

/// Orders the memory's own stream (`own`, where cudarc frees it) after work just queued on
/// `stream`: by `ev`, recorded behind them, or by a new event. Nothing to do when they are the
/// same stream. When the ordering fails, `stream` is synchronised before the error returns, so
/// that work has finished before the caller regains (and may free) the memory.
pub(crate) fn order_after(
    stream: &cudarc::driver::CudaStream,
    own: &cudarc::driver::CudaStream,
    ev: Option<&cudarc::driver::CudaEvent>,
) -> Result<(), cudarc::driver::DriverError> {
    if stream.cu_stream() == own.cu_stream() {
        return Ok(());
    }
    let ordered = match ev {
        Some(ev) => own.wait(ev),
        None => stream.record_event(None).and_then(|ev| own.wait(&ev)),
    };
    if ordered.is_err() {
        let _ = stream.synchronize();
    }
    ordered
}
