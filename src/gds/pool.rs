//! [`DeviceStagingPool`]: device memory the reactor owns and cuFile batch I/O lands in, and
//! [`RegisteredBuffer`], the RAII cuFile registration of a caller's device buffer.
//!
//! cuFile batch reads are not ordered on any CUDA stream, so they must never target memory a
//! caller can get back while they run (a dropped or leaked future). They land in staging
//! slots instead; the future's `poll` then copies them into the destination on its stream
//! (device to device, ~100x faster than the storage behind it), exactly like host bounce slots.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, SyncOnDrop,
};

use super::result::{CufileCode, cufile};
use crate::buf::sealed::Sealed;
use crate::buf::{ReadDst, ReadTarget, WriteSource, WriteSrc};
use crate::cuda::{DeviceDst, DeviceSrc, Pod};

/// Device memory carved into staging slots, registered with cuFile where it allows.
pub(crate) struct DeviceStagingPool {
    ctx: Arc<CudaContext>,
    base: CUdeviceptr,
    registered: bool,
}

// SAFETY: a device pointer and a context handle; the driver API is thread-safe.
unsafe impl Send for DeviceStagingPool {}
// SAFETY: as above.
unsafe impl Sync for DeviceStagingPool {}

impl DeviceStagingPool {
    /// Allocates `len` bytes on `ctx`'s device and registers them with cuFile (failure to
    /// register is not fatal: cuFile then stages through its own buffers, and the reason is
    /// logged).
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, String> {
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        // SAFETY: the context is bound to this thread.
        let base = unsafe { cudarc::driver::result::malloc_sync(len) }
            .map_err(|e| format!("cuMemAlloc of {len} bytes for the staging pool: {e:?}"))?;
        let cf = cufile()?;
        // SAFETY: [base, base + len) is device memory we just allocated and free only after
        // deregistering it (Drop).
        let registered = match unsafe { cf.buf_register(base, len) } {
            Ok(()) => true,
            Err(code) => {
                tracing::warn!(%code, "cuFileBufRegister of the staging pool failed; unregistered");
                false
            }
        };
        Ok(DeviceStagingPool {
            ctx: ctx.clone(),
            base,
            registered,
        })
    }

    pub(crate) fn base(&self) -> CUdeviceptr {
        self.base
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for DeviceStagingPool {
    fn drop(&mut self) {
        // The reactor drops the pool only once no batch I/O and no copy touches it (or leaks it).
        if self.registered
            && let Ok(cf) = cufile()
        {
            // SAFETY: registered in `new`, deregistered once here.
            let _ = unsafe { cf.buf_deregister(self.base) };
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new`; nothing uses it any more (see above).
            let _ = unsafe { cudarc::driver::result::free_sync(self.base) };
        }
    }
}

/// A device buffer registered with cuFile (`cuFileBufRegister`) for as long as this value
/// lives; deregistered on drop.
///
/// It matters for stream-ordered I/O ([`File::read_on_stream`](crate::File::read_on_stream),
/// [`File::write_on_stream`](crate::File::write_on_stream)), which cuFile moves straight into
/// or out of the buffer: pass `&mut buf` (or `&buf` to write from it). Batch reads
/// (`read_into`) land in gpuio's own staging pool, which is registered once per engine, so
/// they gain nothing from it.
///
/// Registration pins the buffer's pages in the GPU's BAR for peer-to-peer DMA. It costs a
/// driver call that takes from tens of microseconds to milliseconds depending on size, and it
/// uses BAR space, so register long-lived buffers (weights, KV-cache arenas) once and reuse
/// them; short-lived buffers work unregistered. In cuFile's compatibility mode (no nvidia-fs)
/// registration changes nothing measurable.
///
/// The buffer derefs to `&CudaSlice<T>` (lengths, streams, `clone_dtoh(&*buf)`, kernel
/// arguments that only read) and gives mutable access as views of the same memory
/// ([`as_view_mut`](Self::as_view_mut), [`slice_mut`](Self::slice_mut)), never as
/// `&mut CudaSlice<T>`: through that, safe code could swap or overwrite the slice and free the
/// registered memory while cuFile still holds the registration.
///
/// ```compile_fail,E0596
/// # fn f(mut reg: gpuio::gds::RegisteredBuffer<u8>, mut other: gpuio::cuda::cudarc::driver::CudaSlice<u8>) {
/// std::mem::swap(&mut *reg, &mut other); // no `DerefMut`: the registered slice stays put
/// # }
/// ```
pub struct RegisteredBuffer<T: Pod> {
    slice: CudaSlice<T>,
    /// The registered base address, while registered.
    registered: Option<CUdeviceptr>,
}

impl<T: Pod> RegisteredBuffer<T> {
    /// Registers `slice` with cuFile. Fails with [`crate::Error::Unsupported`] where cuFile is
    /// unusable, and with the cuFile code where it refuses the buffer.
    pub fn new(slice: CudaSlice<T>) -> crate::error::Result<Self> {
        use crate::error::{Context, Error, OpKind};
        let ctx = || Context::op(OpKind::Setup).with_backend("cufile");
        let cf = cufile().map_err(|e| Error::unsupported(ctx(), e))?;
        let len = slice.num_bytes();
        if len == 0 {
            return Ok(RegisteredBuffer {
                slice,
                registered: None,
            });
        }
        let ptr = {
            let stream = slice.stream().clone();
            slice.device_ptr(&stream).0
        };
        // SAFETY: [ptr, ptr + len) is the slice's allocation, which outlives the registration
        // (deregistered in Drop or `into_inner` before the slice can be freed).
        unsafe { cf.buf_register(ptr, len) }
            .map_err(|c: CufileCode| Error::cuda_msg(ctx(), format!("cuFileBufRegister: {c}")))?;
        Ok(RegisteredBuffer {
            slice,
            registered: Some(ptr),
        })
    }

    /// The whole buffer as a mutable device view (kernel arguments that write, cudarc copies
    /// into it, `read_on_stream`); the allocation itself cannot be replaced through it.
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }

    /// Part of the buffer as a mutable device view, in elements, as `CudaSlice::slice_mut`.
    pub fn slice_mut(&mut self, bounds: impl std::ops::RangeBounds<usize>) -> CudaViewMut<'_, T> {
        self.slice.slice_mut(bounds)
    }

    /// The whole buffer as a device view.
    pub fn as_view(&self) -> CudaView<'_, T> {
        self.slice.as_view()
    }

    /// Deregisters and hands the slice back.
    pub fn into_inner(self) -> CudaSlice<T> {
        let mut this = std::mem::ManuallyDrop::new(self);
        this.deregister();
        // SAFETY: `this` is never dropped (ManuallyDrop) nor used again after its slice is
        // moved out, so the slice has exactly one owner.
        unsafe { std::ptr::read(&this.slice) }
    }

    fn deregister(&mut self) {
        if let (Some(ptr), Ok(cf)) = (self.registered.take(), cufile()) {
            // SAFETY: `ptr` was registered in `new` and is deregistered once (just taken).
            let _ = unsafe { cf.buf_deregister(ptr) };
        }
    }
}

impl<T: Pod> std::ops::Deref for RegisteredBuffer<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

// A destination and source for reads and writes like the slice itself (stream-ordered I/O
// is what registration is for), without handing out `&mut CudaSlice<T>`.
impl<T: Pod> Sealed for RegisteredBuffer<T> {}

impl<T: Pod> DeviceDst for RegisteredBuffer<T> {
    fn byte_len(&self) -> usize {
        self.slice.num_bytes()
    }
    fn own_stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
    fn write_ptr<'s>(&'s mut self, stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>) {
        self.slice.device_ptr_mut(stream)
    }
}

impl<T: Pod> ReadDst for RegisteredBuffer<T> {
    fn target(&mut self) -> ReadTarget<'_> {
        ReadTarget::Device(self)
    }
}

impl<T: Pod> DeviceSrc for RegisteredBuffer<T> {
    fn byte_len(&self) -> usize {
        self.slice.num_bytes()
    }
    fn own_stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
    fn read_ptr<'s>(&'s self, stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>) {
        self.slice.device_ptr(stream)
    }
}

impl<T: Pod> WriteSrc for RegisteredBuffer<T> {
    fn source(&self) -> WriteSource<'_> {
        WriteSource::Device(self)
    }
}

impl<T: Pod> Drop for RegisteredBuffer<T> {
    fn drop(&mut self) {
        self.deregister();
    }
}
