//! Python objects as read destinations and write sources: host memory through the buffer
//! protocol (numpy, bytearray, memoryview) or DLPack (CPU torch tensors), device memory
//! through `__cuda_array_interface__` (v3, with its stream) or DLPack (`__dlpack__`, or a
//! "dltensor" capsule).
//!
//! Each [`Memory`] holds a reference to what keeps the memory alive (the buffer export, the
//! object, the DLPack capsule) for as long as an operation may touch it: host memory until
//! the operation's future is dropped (the library writes borrowed host memory only inside
//! the future's `poll`), device memory until the stream the copies were queued on has passed
//! them, which a dropped [`DeviceMemory`] waits for on the engine's reactor (see its `Drop`).

use std::ffi::c_void;
use std::sync::Arc;

use gpuio::RawDeviceSlice;
use gpuio::cuda::cudarc::driver::CudaStream;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyMemoryView};

use crate::errors::{invalid, to_py};

/// What an operation reads into or writes from.
pub enum Memory {
    /// Host memory.
    Host(HostMemory),
    /// Device memory.
    Device(DeviceMemory),
}

/// Host memory of a Python object, kept exported (a `bytearray` cannot resize meanwhile) or
/// alive until this is dropped.
pub struct HostMemory {
    ptr: *mut u8,
    len: usize,
    /// The object, or a memoryview holding an export of it. Held only for its drop. A drop
    /// while detached is deferred by PyO3 to the next attach (the end of a blocking call, or
    /// the pool's `exit::attach` before a result is delivered), so the export has ended before
    /// the caller sees the result.
    _keep: Py<PyAny>,
}

// SAFETY: the pointer is into memory the Python object owns, which `_keep` keeps exported or
// alive wherever this value goes; the library touches it from one thread at a time (the one
// polling the operation). `Py` is itself `Send + Sync`.
unsafe impl Send for HostMemory {}
// SAFETY: shared access only reads the bytes (write sources); see `Send`.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// The bytes, to read into.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `ptr` points at `len` bytes the kept export or object owns (checked
        // writable at extraction for destinations), alive as long as `self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The address and length, for the library's calls that take memory by address (agent
    /// registrations, which keep `self` for as long as the range is registered).
    pub fn range(&self) -> (u64, usize) {
        (self.ptr as u64, self.len)
    }

    /// The bytes, to write from.
    pub fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: as in `bytes_mut`, shared.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Device memory of a Python object, with the stream the copies are queued on.
pub struct DeviceMemory {
    /// The range, on the stream the operation uses.
    pub slice: RawDeviceSlice,
    /// The object (or its DLPack capsule), and the caller's stream object: a stream
    /// destroyed while copies are queued on it would leave the release below waiting on a
    /// dead (or reused) handle.
    keep: Vec<Py<PyAny>>,
    engine: gpuio::Engine,
}

impl Drop for DeviceMemory {
    /// Copies queued by the operation may still run on the stream after its future is done
    /// or dropped: the object (the tensor, or the DLPack capsule that owns it) is released
    /// only once the stream has passed them, waited for on the engine's reactor from the
    /// binding's own thread pool, so no thread blocks and no GIL is held meanwhile.
    fn drop(&mut self) {
        let keep = std::mem::take(&mut self.keep);
        let stream = self.slice.stream().clone();
        let engine = self.engine.clone();
        let Some(pool) = crate::runner::pool() else {
            // No pool to wait on: wait here (the copies are queued; this is their run time).
            let _ = stream.synchronize();
            // Possibly attached here (not a thread of gpuio's): a plain drop decrefs now where
            // attached and defers otherwise.
            drop(keep);
            return;
        };
        pool.spawn_ok(async move {
            if engine.synchronize(&stream).await.is_err() {
                // The engine could not wait (it shut down): wait here instead. This blocks
                // one pool thread, and only on this path.
                let _ = stream.synchronize();
            }
            release(keep);
        });
    }
}

/// Drops Python references with the interpreter attached (an object may own a large tensor:
/// release it now, not at the next attach). Only on gpuio's own threads (`exit::attach`).
pub fn release(keep: Vec<Py<PyAny>>) {
    if keep.is_empty() {
        return;
    }
    // Not attached (the interpreter is gone): pyo3 defers the decrefs instead.
    let _ = crate::exit::attach(move |_py| drop(keep));
}

/// A raw CUDA stream handle from a Python stream object: an int, an object with
/// `__cuda_stream__` (returns `(version, handle)`), `cuda_stream` (torch) or `ptr` (cupy).
pub fn stream_handle(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(h) = obj.extract::<u64>() {
        return Ok(h);
    }
    if let Ok(proto) = obj.getattr("__cuda_stream__") {
        let (_version, h): (u64, u64) = proto.call0()?.extract()?;
        return Ok(h);
    }
    for attr in ["cuda_stream", "ptr"] {
        if let Ok(h) = obj.getattr(attr).and_then(|v| v.extract::<u64>()) {
            return Ok(h);
        }
    }
    Err(PyTypeError::new_err(format!(
        "stream must be an int handle or a CUDA stream object (torch.cuda.Stream, \
         cupy.cuda.Stream, or one with __cuda_stream__), not {}",
        obj.get_type().name()?
    )))
}

/// For a CUDA torch tensor: torch's current stream on its device, the stream torch orders
/// work on the tensor by (its `__cuda_array_interface__` is version 2 and names no stream).
/// `None` for anything else, and without importing torch where the program has not.
fn torch_current_stream(obj: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
    let py = obj.py();
    let modules = py.import("sys")?.getattr("modules")?;
    let torch = modules.call_method1("get", ("torch",))?;
    if torch.is_none() {
        return Ok(None);
    }
    let tensor = torch.getattr("Tensor")?;
    if !obj.is_instance(&tensor)? || !obj.getattr("is_cuda")?.extract::<bool>()? {
        return Ok(None);
    }
    let stream = torch
        .getattr("cuda")?
        .call_method1("current_stream", (obj.getattr("device")?,))?;
    Ok(Some(stream.getattr("cuda_stream")?.extract()?))
}

/// `handle` on GPU `ordinal` as a cudarc stream (not owned: dropping it destroys nothing).
fn wrap_stream(ordinal: usize, handle: u64) -> PyResult<Arc<CudaStream>> {
    let ctx = gpuio::cuda::context(ordinal).map_err(to_py)?;
    // SAFETY: the caller named this stream (or the object did, through its CUDA array
    // interface or DLPack export) for memory on GPU `ordinal`, whose primary context torch,
    // cupy and cudarc share; it lives as long as the caller's stream object, which the caller
    // keeps while its operations run, as with any CUDA library taking a stream handle.
    Ok(unsafe { ctx.wrap_borrowed_stream(handle as usize as _) })
}

/// Which memory an operation may use: a destination (`write` access) or a source.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read into it: must be writable.
    Dst,
    /// Write from it.
    Src,
}

/// Extracts `obj` as memory for an operation on `engine`; `stream` is the caller's stream
/// (device memory only).
pub fn extract(
    engine: &gpuio::Engine,
    obj: &Bound<'_, PyAny>,
    stream: Option<&Bound<'_, PyAny>>,
    access: Access,
) -> PyResult<Memory> {
    let py = obj.py();
    let user_stream = stream.map(stream_handle).transpose()?;
    let stream_obj = stream.map(|s| s.clone().unbind());
    if obj.is_instance_of::<PyCapsule>() {
        return dlpack_capsule(engine, obj.clone().unbind(), user_stream, stream_obj);
    }
    if let Ok(cai) = obj.getattr("__cuda_array_interface__") {
        return cuda_array_interface(engine, obj, &cai, (user_stream, stream_obj), access);
    }
    if let Ok(view) = PyMemoryView::from(obj) {
        return host_buffer(py, &view, access).map(Memory::Host);
    }
    if obj.hasattr("__dlpack__")? {
        let (device_type, _id): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
        let kwargs = PyDict::new(py);
        if device_type == DL_CUDA {
            // DLPack's stream numbering: 1 is the legacy default stream (0 is not allowed).
            let consumer = match user_stream {
                None | Some(0) => 1,
                Some(h) => h,
            };
            kwargs.set_item("stream", consumer)?;
        }
        let capsule = obj.call_method("__dlpack__", (), Some(&kwargs))?;
        return dlpack_capsule(engine, capsule.unbind(), user_stream, stream_obj);
    }
    Err(PyTypeError::new_err(format!(
        "{} is not memory gpuio can use: pass an object with the buffer protocol (numpy array, \
         bytearray, memoryview), __cuda_array_interface__ or __dlpack__ (torch, cupy), or a \
         DLPack capsule",
        obj.get_type().name()?
    )))
}

fn host_buffer(
    py: Python<'_>,
    view: &Bound<'_, PyMemoryView>,
    access: Access,
) -> PyResult<HostMemory> {
    if access == Access::Dst && view.getattr("readonly")?.extract::<bool>()? {
        return Err(invalid(
            py,
            "the destination is read-only (bytes, or a read-only array): read into a \
             writable buffer such as a bytearray or a writable numpy array",
        ));
    }
    if !view.getattr("c_contiguous")?.extract::<bool>()? {
        return Err(invalid(
            py,
            "the buffer is not C-contiguous (a strided view or a transposed array): pass a \
             contiguous array (numpy.ascontiguousarray) or a contiguous slice",
        ));
    }
    let nbytes: usize = view.getattr("nbytes")?.extract()?;
    if nbytes == 0 {
        return Ok(HostMemory {
            ptr: std::ptr::null_mut(),
            len: 0,
            _keep: view.clone().into_any().unbind(),
        });
    }
    let bytes = view.call_method1("cast", ("B",))?;
    let (ptr, len) = {
        let buf = PyBuffer::<u8>::get(&bytes)?;
        (buf.buf_ptr().cast::<u8>(), buf.len_bytes())
        // `buf` is released here, attached. The memoryview `bytes` holds its own export of the
        // object, which keeps the memory in place (a bytearray cannot resize) for as long as
        // the memoryview lives. Keeping a `PyBuffer` instead would release it wherever the
        // operation is dropped, taking the GIL there outside `exit::attach` (a daemon thread
        // finishing a read during interpreter exit would be ended inside Rust frames).
    };
    Ok(HostMemory {
        ptr,
        len,
        _keep: bytes.unbind(),
    })
}

/// Whether `strides` (in bytes; `None`: row-major) describe a C-contiguous array.
fn c_contiguous(shape: &[usize], strides: Option<&[isize]>, item: usize) -> bool {
    let Some(strides) = strides else { return true };
    if shape.contains(&0) {
        return true;
    }
    let mut expect = item as isize;
    for (&n, &s) in shape.iter().zip(strides).rev() {
        if n > 1 && s != expect {
            return false;
        }
        expect *= n as isize;
    }
    true
}

fn device(
    engine: &gpuio::Engine,
    ordinal: usize,
    ptr: u64,
    len: usize,
    stream: u64,
    keep: Vec<Py<PyAny>>,
) -> PyResult<Memory> {
    let stream = wrap_stream(ordinal, stream)?;
    // SAFETY: `ptr..ptr + len` is the memory the object exported (checked to be device memory
    // of GPU `ordinal` by `new`); `keep` holds the object (or its DLPack capsule) until the
    // stream has passed every copy an operation queued (DeviceMemory's drop), and the object's
    // owner frees it in stream order.
    let slice = unsafe { RawDeviceSlice::new(ordinal, ptr, len) }
        .and_then(|s| s.with_stream(stream))
        .map_err(to_py)?;
    Ok(Memory::Device(DeviceMemory {
        slice,
        keep,
        engine: engine.clone(),
    }))
}

fn cuda_array_interface(
    engine: &gpuio::Engine,
    obj: &Bound<'_, PyAny>,
    cai: &Bound<'_, PyAny>,
    (user_stream, stream_obj): (Option<u64>, Option<Py<PyAny>>),
    access: Access,
) -> PyResult<Memory> {
    let py = obj.py();
    let cai = cai.cast::<PyDict>()?;
    let get = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        cai.get_item(key)?
            .ok_or_else(|| PyTypeError::new_err(format!("__cuda_array_interface__ has no {key:?}")))
    };
    let (ptr, readonly): (u64, bool) = get("data")?.extract()?;
    let shape: Vec<usize> = get("shape")?.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    let item: usize = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| {
            PyTypeError::new_err(format!("__cuda_array_interface__ typestr {typestr:?}"))
        })?;
    let strides: Option<Vec<isize>> = match cai.get_item("strides")? {
        Some(s) if !s.is_none() => Some(s.extract()?),
        _ => None,
    };
    if access == Access::Dst && readonly {
        return Err(invalid(py, "the device array is read-only"));
    }
    if !c_contiguous(&shape, strides.as_deref(), item) {
        return Err(invalid(
            py,
            "the device array is not C-contiguous: pass a contiguous tensor (.contiguous())",
        ));
    }
    let len = shape.iter().product::<usize>() * item;
    // The producer's stream, where work on the memory is queued: the interface's (v3), or
    // for a torch tensor (whose interface is v2) torch's current stream. None: nothing pending.
    let producer: Option<u64> = match cai.get_item("stream")? {
        Some(s) if !s.is_none() => Some(s.extract()?),
        _ => torch_current_stream(obj)?,
    };
    if len == 0 {
        return Ok(Memory::Host(HostMemory {
            ptr: std::ptr::null_mut(),
            len: 0,
            _keep: obj.clone().unbind(),
        }));
    }
    let ordinal = RawDeviceSlice::device_of(ptr).map_err(to_py)?;
    let stream = match (user_stream, producer) {
        (Some(u), Some(p)) if u != p => {
            // The copies go on the caller's stream, after the producer's pending work.
            let (us, ps) = (wrap_stream(ordinal, u)?, wrap_stream(ordinal, p)?);
            us.join(&ps).map_err(|e| {
                invalid(
                    py,
                    format!("ordering stream {u:#x} after stream {p:#x}: {e:?}"),
                )
            })?;
            u
        }
        (Some(u), _) => u,
        // CAI streams 1 and 2 are CUDA's legacy and per-thread default handles as they are.
        (None, Some(p)) => p,
        (None, None) => 0,
    };
    let keep = std::iter::once(obj.clone().unbind())
        .chain(stream_obj)
        .collect();
    device(engine, ordinal, ptr, len, stream, keep)
}

// DLPack's C structures (dlpack.h, version 0.8 ABI: unversioned "dltensor" capsules).
const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;
const DL_CUDA_MANAGED: i32 = 13;

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// Memory of a "dltensor" capsule. The capsule is kept, not consumed: its own destructor
/// calls the producer's deleter when the last reference goes (after the operation).
fn dlpack_capsule(
    engine: &gpuio::Engine,
    capsule: Py<PyAny>,
    user_stream: Option<u64>,
    stream_obj: Option<Py<PyAny>>,
) -> PyResult<Memory> {
    Python::attach(|py| {
        let cap = capsule.bind(py);
        // SAFETY: `cap` is a live object; PyCapsule_GetPointer checks that it is a capsule
        // named "dltensor" and sets an exception (returning null) otherwise.
        let raw = unsafe { pyo3::ffi::PyCapsule_GetPointer(cap.as_ptr(), c"dltensor".as_ptr()) };
        if raw.is_null() {
            let why = PyErr::take(py).map_or_else(String::new, |e| e.to_string());
            return Err(invalid(
                py,
                format!(
                    "not an unconsumed DLPack capsule named \"dltensor\" (a capsule can be \
                     consumed once; versioned capsules are not taken): {why}"
                ),
            ));
        }
        // SAFETY: a "dltensor" capsule holds a DLManagedTensor, valid while the capsule lives
        // unconsumed (we hold it); shape has ndim entries, strides ndim entries or null.
        let t = unsafe { &(*raw.cast::<DlManagedTensor>()).dl_tensor };
        let ndim = t.ndim.max(0) as usize;
        let shape: Vec<usize> = (0..ndim)
            // SAFETY: index < ndim, see above.
            .map(|i| unsafe { *t.shape.add(i) }.max(0) as usize)
            .collect();
        let item = (t.dtype.bits as usize * t.dtype.lanes as usize).div_ceil(8);
        let strides: Option<Vec<isize>> = (!t.strides.is_null()).then(|| {
            (0..ndim)
                // SAFETY: index < ndim, strides non-null (see above); DLPack strides count
                // elements, ours bytes.
                .map(|i| unsafe { *t.strides.add(i) } as isize * item as isize)
                .collect()
        });
        if !c_contiguous(&shape, strides.as_deref(), item) {
            return Err(invalid(
                py,
                "the DLPack tensor is not C-contiguous: pass a contiguous tensor",
            ));
        }
        let len = shape.iter().product::<usize>() * item;
        let ptr = (t.data as u64).wrapping_add(t.byte_offset);
        match t.device.device_type {
            _ if len == 0 => Ok(Memory::Host(HostMemory {
                ptr: std::ptr::null_mut(),
                len: 0,
                _keep: capsule.clone_ref(py),
            })),
            DL_CPU | DL_CUDA_HOST => Ok(Memory::Host(HostMemory {
                ptr: ptr as usize as *mut u8,
                len,
                _keep: capsule.clone_ref(py),
            })),
            DL_CUDA | DL_CUDA_MANAGED => {
                let ordinal = t.device.device_id.max(0) as usize;
                let stream = user_stream.unwrap_or(0);
                let keep = std::iter::once(capsule.clone_ref(py))
                    .chain(stream_obj)
                    .collect();
                device(engine, ordinal, ptr, len, stream, keep)
            }
            other => Err(PyTypeError::new_err(format!(
                "DLPack device type {other} is neither host nor CUDA memory"
            ))),
        }
    })
}
