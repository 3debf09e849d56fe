//! Device memory known only by its address ([`RawDeviceRange`]): a range of a CUDA allocation
//! that cudarc did not hand out (a C caller's `CUdeviceptr`, another library's buffer), as a
//! read destination and a write source.
//!
//! cudarc's own slices carry the events that order their uses; a raw range has none, so the
//! caller orders its uses with the range's stream, the way the CUDA driver API itself works:
//! gpuio queues its copies on that stream (or on the stream given with `on_stream`), and work
//! queued on it afterwards sees them.

use std::sync::Arc;

use cudarc::driver::sys::{CUdeviceptr, CUpointer_attribute, CUresult, cuPointerGetAttribute};
use cudarc::driver::{CudaStream, SyncOnDrop};

use super::sealed::Sealed;
use super::{ReadDst, ReadTarget, WriteSource, WriteSrc};
use crate::cuda::{DeviceDst, DeviceSrc};
use crate::error::{Context, Error, OpKind, Result};

/// `len` bytes of device memory at `ptr`, used on `stream`.
#[derive(Debug)]
pub struct RawDeviceRange {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
}

impl RawDeviceRange {
    /// The range `[ptr, ptr + len)` of device memory, whose copies gpuio queues on `stream`.
    ///
    /// Checks with the driver (`cuPointerGetAttribute`) that the whole range lies inside one
    /// allocation the driver knows, so a host pointer, a stale address or a length running past
    /// the allocation is an [`Error::InvalidInput`] rather than a copy into other memory.
    ///
    /// # Safety
    /// - The allocation must stay allocated, and nothing may read it (for reads into it) or
    ///   write it (for either direction) other than through this range, until every operation
    ///   given the range has completed or been dropped **and** `stream` (or the stream given to
    ///   `on_stream`) has passed the copies they queued.
    /// - The allocation must be usable from `stream`'s context.
    /// - Other users of the memory must order their work with `stream` themselves: gpuio records
    ///   no cudarc events for a raw range.
    pub unsafe fn new(ptr: CUdeviceptr, len: usize, stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = || Context::op(OpKind::Setup).with_backend("cuda");
        if len > 0 {
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| Error::cuda(ctx(), e))?;
            let (start, size) = allocation_of(ptr).map_err(|rc| {
                Error::invalid(
                    ctx(),
                    format!("{ptr:#x} is not device memory the CUDA driver knows ({rc:?})"),
                )
            })?;
            let inside = ptr
                .checked_add(len as u64)
                .is_some_and(|end| ptr >= start && end <= start + size);
            if !inside {
                return Err(Error::invalid(
                    ctx(),
                    format!(
                        "device range {ptr:#x} + {len} bytes runs past its allocation \
                         ({start:#x} + {size} bytes)"
                    ),
                ));
            }
        }
        Ok(RawDeviceRange { ptr, len, stream })
    }

    /// The device address.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The stream gpuio queues this range's copies on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

/// The start and size of the allocation holding `ptr`, or the driver's refusal.
fn allocation_of(ptr: CUdeviceptr) -> std::result::Result<(u64, u64), CUresult> {
    let mut start: CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: both attributes write one value of the named type (a CUdeviceptr and a size_t)
    // into the pointed-to local; the driver only reads `ptr`'s address, never its memory.
    let rc = unsafe {
        cuPointerGetAttribute(
            (&raw mut start).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            ptr,
        )
    };
    if rc != CUresult::CUDA_SUCCESS {
        return Err(rc);
    }
    // SAFETY: as above.
    let rc = unsafe {
        cuPointerGetAttribute(
            (&raw mut size).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            ptr,
        )
    };
    if rc != CUresult::CUDA_SUCCESS {
        return Err(rc);
    }
    Ok((start, size as u64))
}

impl Sealed for RawDeviceRange {}

impl DeviceDst for RawDeviceRange {
    fn byte_len(&self) -> usize {
        self.len
    }
    fn own_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn write_ptr<'s>(&'s mut self, _stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>) {
        // No cudarc events: the caller orders its uses of the memory with the stream.
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl DeviceSrc for RawDeviceRange {
    fn byte_len(&self) -> usize {
        self.len
    }
    fn own_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn read_ptr<'s>(&'s self, _stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl ReadDst for RawDeviceRange {
    fn target(&mut self) -> ReadTarget<'_> {
        ReadTarget::Device(self)
    }
}

impl WriteSrc for RawDeviceRange {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Device(self)
    }
}
