//! Caller memory: `gpuio_buffer` descriptors turned into host slices or raw device ranges.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gpuio::RawDeviceSlice;
use gpuio::cuda::cudarc::driver::sys::CUstream;
use gpuio::cuda::cudarc::driver::{CudaContext, CudaStream};

use crate::engine::EngineHandle;
use crate::status::Failure;
use crate::{GPUIO_MEMORY_DEVICE, GPUIO_MEMORY_HOST};

/// Memory a read fills or a write drains. A zeroed struct with `ptr` and `len` set is host
/// memory.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gpuio_buffer {
    /// Host address, or for device memory the device address (a `CUdeviceptr`).
    pub ptr: *mut libc::c_void,
    /// Bytes.
    pub len: usize,
    /// `GPUIO_MEMORY_HOST` (0) or `GPUIO_MEMORY_DEVICE`.
    pub kind: u32,
    /// Device memory: the CUDA device index. gpuio uses the device's primary context (the one
    /// the CUDA runtime uses), and makes it current on the threads that issue copies (the
    /// calling thread for synchronous calls); the memory must be usable from it.
    pub device: i32,
    /// Device memory: the `CUstream` the copies are ordered on, or NULL. With a stream, an
    /// operation completes once its copies are queued on it: work queued on the stream
    /// afterwards sees the data (synchronize it before reading the memory from the host). With
    /// NULL, the copies go on the legacy default stream and the operation completes once they
    /// are done.
    pub stream: *mut libc::c_void,
}

/// CUDA contexts by device index, retained on first use.
#[derive(Default)]
pub(crate) struct Contexts(Mutex<HashMap<i32, Arc<CudaContext>>>);

impl Contexts {
    fn get(&self, device: i32) -> Result<Arc<CudaContext>, Failure> {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ctx) = map.get(&device) {
            return Ok(ctx.clone());
        }
        let ordinal = usize::try_from(device)
            .map_err(|_| Failure::invalid(format!("gpuio_buffer.device {device} is negative")))?;
        let ctx = gpuio::cuda::context(ordinal)?;
        map.insert(device, ctx.clone());
        Ok(ctx)
    }
}

/// Device memory of a request, and the stream to wait for when the caller gave none.
pub(crate) struct DeviceMemory {
    pub(crate) range: RawDeviceSlice,
    settle: Option<Arc<CudaStream>>,
}

impl DeviceMemory {
    /// Waits (without blocking a thread) for the copies when the caller named no stream.
    pub(crate) async fn settle(&self, engine: &gpuio::Engine) -> gpuio::Result<()> {
        match self.settler() {
            Some(s) => s.settle(engine).await,
            None => Ok(()),
        }
    }

    /// What to wait for after the copies, when the caller named no stream.
    pub(crate) fn settler(&self) -> Option<Settle> {
        self.settle.clone().map(Settle)
    }
}

/// The legacy default stream an operation's copies went on, to wait for.
pub(crate) struct Settle(Arc<CudaStream>);

impl Settle {
    /// Resolves once everything queued on the stream so far is done.
    pub(crate) async fn settle(&self, engine: &gpuio::Engine) -> gpuio::Result<()> {
        engine.synchronize(&self.0).await
    }
}

/// Where a read's bytes go.
pub(crate) enum Dst {
    Host(&'static mut [u8]),
    Device(DeviceMemory),
}

/// Where a write's bytes come from.
pub(crate) enum Src {
    Host(&'static [u8]),
    Device(DeviceMemory),
}

fn checked(buf: *const gpuio_buffer) -> Result<gpuio_buffer, Failure> {
    // SAFETY: the entry points' contract: NULL or a readable gpuio_buffer (every field's bit
    // patterns are valid values: pointers, integers).
    let b = unsafe { buf.as_ref() }
        .copied()
        .ok_or_else(|| Failure::invalid("gpuio_buffer is a null pointer"))?;
    if b.ptr.is_null() && b.len > 0 {
        return Err(Failure::invalid(format!(
            "gpuio_buffer.ptr is null with len {}",
            b.len
        )));
    }
    if b.kind != GPUIO_MEMORY_HOST && b.kind != GPUIO_MEMORY_DEVICE {
        return Err(Failure::invalid(format!(
            "gpuio_buffer.kind {} is not GPUIO_MEMORY_HOST or GPUIO_MEMORY_DEVICE",
            b.kind
        )));
    }
    if b.kind == GPUIO_MEMORY_HOST && isize::try_from(b.len).is_err() {
        return Err(Failure::invalid(
            "gpuio_buffer.len is larger than any host buffer",
        ));
    }
    Ok(b)
}

/// # Safety
/// The C contract for device buffers (see `gpuio_buffer`): the range stays allocated and
/// untouched by others until the operation completes, `stream` is NULL or a live stream of the
/// device's primary context that outlives the operation.
unsafe fn device(engine: &EngineHandle, b: &gpuio_buffer) -> Result<DeviceMemory, Failure> {
    let ctx = engine.contexts.get(b.device)?;
    let (stream, settle) = if b.stream.is_null() {
        let s = ctx.default_stream();
        (s.clone(), Some(s))
    } else {
        // SAFETY: the caller's stream belongs to this context and outlives the operation (the
        // C contract); the wrapper never destroys it.
        (
            unsafe { ctx.wrap_borrowed_stream(b.stream as CUstream) },
            None,
        )
    };
    // SAFETY: forwarded from this function's contract; the constructor checks with the driver
    // that the whole range is device memory of this GPU.
    let range =
        unsafe { RawDeviceSlice::new(ctx.ordinal(), b.ptr as u64, b.len) }?.with_stream(stream)?;
    Ok(DeviceMemory { range, settle })
}

/// The destination `buf` describes.
///
/// # Safety
/// `buf` is NULL or readable; the memory it names stays valid, and is touched by nothing else,
/// until the operation completes (the C contract).
pub(crate) unsafe fn dst(engine: &EngineHandle, buf: *const gpuio_buffer) -> Result<Dst, Failure> {
    let b = checked(buf)?;
    if b.kind == GPUIO_MEMORY_DEVICE {
        // SAFETY: forwarded.
        return Ok(Dst::Device(unsafe { device(engine, &b) }?));
    }
    if b.len == 0 {
        return Ok(Dst::Host(&mut []));
    }
    // SAFETY: non-null, `len` bytes the caller keeps valid and exclusive to this operation
    // until it completes (the C contract), at most isize::MAX (checked).
    Ok(Dst::Host(unsafe {
        std::slice::from_raw_parts_mut(b.ptr.cast::<u8>(), b.len)
    }))
}

/// The source `buf` describes.
///
/// # Safety
/// As for [`dst`], except that others may read the memory meanwhile.
pub(crate) unsafe fn src(engine: &EngineHandle, buf: *const gpuio_buffer) -> Result<Src, Failure> {
    let b = checked(buf)?;
    if b.kind == GPUIO_MEMORY_DEVICE {
        // SAFETY: forwarded.
        return Ok(Src::Device(unsafe { device(engine, &b) }?));
    }
    if b.len == 0 {
        return Ok(Src::Host(&[]));
    }
    // SAFETY: non-null, `len` readable bytes nobody writes until the operation completes (the
    // C contract), at most isize::MAX (checked).
    Ok(Src::Host(unsafe {
        std::slice::from_raw_parts(b.ptr.cast::<u8>().cast_const(), b.len)
    }))
}

impl Dst {
    /// Reads into this destination at `offset`.
    pub(crate) async fn read(self, file: &gpuio::File, offset: u64) -> gpuio::Result<usize> {
        match self {
            Dst::Host(buf) => file.read_into(buf, offset).await,
            Dst::Device(mut d) => {
                // Settle even after a failure: some copies may have been queued.
                let read = file.read_into(&mut d.range, offset).await;
                let settled = d.settle(file.engine()).await;
                let n = read?;
                settled?;
                Ok(n)
            }
        }
    }
}

impl Src {
    /// Writes this source at `offset`.
    pub(crate) async fn write(self, file: &gpuio::File, offset: u64) -> gpuio::Result<usize> {
        match self {
            Src::Host(buf) => file.write_from(buf, offset).await,
            // A write completes once the data is in the file: its copies out of device memory
            // are done by then, whichever stream they ran on.
            Src::Device(d) => file.write_from(&d.range, offset).await,
        }
    }
}
