//! [`RawDeviceSlice`]: a range of device memory that another library allocated (a torch or
//! cupy tensor, memory from a C program), known only by its address, as a read destination
//! and write source.
//!
//! cudarc's own slices carry their stream and events; raw memory carries neither, so the
//! slice names the stream its memory is used on ([`RawDeviceSlice::with_stream`]; default:
//! the device's legacy default stream). Copies are queued on that stream, so the memory's
//! owner orders later work (kernels, a stream-ordered free) after them the way it orders any
//! other work on the stream.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaStream, SyncOnDrop};

use super::sealed::Sealed;
use super::{ReadDst, ReadTarget, WriteSource, WriteSrc};
use crate::cuda::device::pointer_attribute;
use crate::cuda::{DeviceDst, DeviceSrc};
use crate::error::{Context, Error, OpKind, Result};

/// `len` bytes of device memory at `ptr` on GPU `ordinal`, used on one stream.
///
/// Built with the unsafe [`RawDeviceSlice::new`]: the type cannot know who owns the memory
/// or for how long, so the caller promises it stays valid while operations use it.
#[derive(Debug, Clone)]
pub struct RawDeviceSlice {
    ordinal: usize,
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
}

impl RawDeviceSlice {
    /// The `len` bytes at device address `ptr` on GPU `ordinal`, used on that device's legacy
    /// default stream until [`with_stream`](Self::with_stream) names another.
    ///
    /// Checks what the driver can tell: that CUDA is usable, that `ptr` is device (or
    /// managed) memory, and that the first and last byte belong to GPU `ordinal`. Fails with
    /// [`Error::Unsupported`] without CUDA and [`Error::InvalidInput`] otherwise.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be device memory of GPU `ordinal`'s primary context, valid for
    /// reads and writes, and stay allocated (not freed, nor reused by its owner for anything
    /// else) from this call until every operation using the slice has finished **on the
    /// stream** it runs on: after a read's or write's future resolves (or is dropped), copies
    /// it queued may still be running on the slice's stream. Freeing the memory in stream
    /// order on that stream (as torch's and cupy's allocators do for memory used on the stream
    /// it was allocated on), or after synchronising it, satisfies this.
    pub unsafe fn new(ordinal: usize, ptr: u64, len: usize) -> Result<Self> {
        let ctx = crate::cuda::context(ordinal)?;
        let stream = ctx.default_stream();
        let slice = RawDeviceSlice {
            ordinal,
            ptr,
            len,
            stream,
        };
        slice.check()?;
        Ok(slice)
    }

    /// Which GPU the device (or managed) memory at `ptr` belongs to, as the driver says
    /// (`Unsupported` without CUDA, `InvalidInput` for an address that is not CUDA memory).
    /// For callers that know an address but not its device (`__cuda_array_interface__`).
    pub fn device_of(ptr: u64) -> Result<usize> {
        // Any context initialises the driver for the query; device 0 always exists here.
        crate::cuda::context(0)?;
        let mut ordinal: i32 = -1;
        // SAFETY: the driver writes one int for CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL into
        // `ordinal`, which outlives the call; any address may be asked about.
        let r = unsafe {
            pointer_attribute(
                &mut ordinal,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS || ordinal < 0 {
            return Err(Error::invalid(
                Self::ctx(),
                format!("address {ptr:#x} is not CUDA memory (driver: {r:?})"),
            ));
        }
        Ok(ordinal as usize)
    }

    /// Uses the memory on `stream` (queue the copies there): a stream of the same GPU, which
    /// the caller keeps alive for as long as the slice's operations run.
    pub fn with_stream(mut self, stream: Arc<CudaStream>) -> Result<Self> {
        let on = stream.context().ordinal();
        if on != self.ordinal {
            return Err(Error::invalid(
                Self::ctx(),
                format!(
                    "stream of GPU {on} for memory on GPU {}: use a stream of the memory's device",
                    self.ordinal
                ),
            ));
        }
        self.stream = stream;
        Ok(self)
    }

    /// GPU ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stream the memory is used on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn ctx() -> Context {
        Context::op(OpKind::DeviceMemory).with_backend("cuda")
    }

    /// Asks the driver about the range: it starts in device (or managed) memory, and every
    /// allocation it passes through, from the first byte to the last, is memory of our GPU.
    /// Walking allocation by allocation accepts a range over several contiguous mappings (torch's
    /// expandable segments map a tensor's memory piecewise) and refuses one whose end runs into
    /// unmapped memory or another GPU's.
    fn check(&self) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::cuda(Self::ctx(), e))?;
        let end = self.ptr.checked_add(self.len as u64).ok_or_else(|| {
            Error::invalid(Self::ctx(), "device address range overflows".to_string())
        })?;
        let mut kind: u32 = 0;
        // SAFETY: CU_POINTER_ATTRIBUTE_MEMORY_TYPE writes one unsigned int into `kind`, which
        // outlives the call; the driver only looks the address up, never touches its memory.
        let r = unsafe {
            pointer_attribute(
                &mut kind,
                sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                self.ptr,
            )
        };
        let device = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
        let managed = sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32;
        if r != sys::CUresult::CUDA_SUCCESS || (kind != device && kind != managed) {
            return Err(Error::invalid(
                Self::ctx(),
                format!(
                    "address {:#x} is not CUDA device memory (driver: {r:?}, memory type {kind})",
                    self.ptr
                ),
            ));
        }
        let mut at = self.ptr;
        loop {
            let (start, size) = allocation_of(at).map_err(|r| {
                Error::invalid(
                    Self::ctx(),
                    format!(
                        "device range {:#x} + {} bytes runs past its allocation (no device \
                         memory at {at:#x}: driver {r:?})",
                        self.ptr, self.len
                    ),
                )
            })?;
            let mut ordinal: i32 = -1;
            // SAFETY: CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL writes one int into `ordinal`.
            let r = unsafe {
                pointer_attribute(
                    &mut ordinal,
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    at,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS || ordinal != self.ordinal as i32 {
                return Err(Error::invalid(
                    Self::ctx(),
                    format!(
                        "device range {:#x}..{end:#x} is not all memory of GPU {} (byte {at:#x}: \
                         driver {r:?}, GPU {ordinal})",
                        self.ptr, self.ordinal
                    ),
                ));
            }
            let alloc_end = start.saturating_add(size);
            if alloc_end >= end || alloc_end <= at {
                return Ok(());
            }
            at = alloc_end;
        }
    }
}

/// The start and size of the allocation (or mapping) holding `ptr`, or the driver's refusal.
fn allocation_of(ptr: u64) -> std::result::Result<(u64, u64), sys::CUresult> {
    let mut start: CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: RANGE_START_ADDR writes one CUdeviceptr.
    let r = unsafe {
        pointer_attribute(
            &mut start,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            ptr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(r);
    }
    // SAFETY: RANGE_SIZE writes one size_t.
    let r = unsafe {
        pointer_attribute(
            &mut size,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            ptr,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(r);
    }
    Ok((start, size as u64))
}

impl DeviceDst for RawDeviceSlice {
    fn byte_len(&self) -> usize {
        self.len
    }
    fn own_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn write_ptr<'s>(&'s mut self, _stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>) {
        // No cudarc events to record: the memory's owner orders its work by the stream.
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl DeviceSrc for RawDeviceSlice {
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

impl Sealed for RawDeviceSlice {}

impl ReadDst for RawDeviceSlice {
    fn target(&mut self) -> ReadTarget<'_> {
        ReadTarget::Device(self)
    }
}

impl WriteSrc for RawDeviceSlice {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Device(self)
    }
}
