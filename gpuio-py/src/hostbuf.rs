//! [`HostBuffer`]: host memory a load allocated and filled (`LoadPlan.read_host`), handed to
//! Python without a copy through the buffer protocol (`np.frombuffer`, `torch.frombuffer`).
//!
//! The load owns the memory while it runs, so the kernel reads into it in place
//! (`gpuio::batch::BatchPlan::read_to_vec`), and an interrupted or cancelled load never hands
//! out memory the kernel may still write: the buffer exists for Python only once every read
//! has ended.

use std::ffi::{c_int, c_void};
use std::mem::ManuallyDrop;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// Bytes a load read, as a writable buffer: wrap it with ``np.frombuffer(buf, np.uint8)`` or
/// ``torch.frombuffer(buf, dtype=torch.uint8)`` (no copy; the array keeps it alive).
#[pyclass(frozen, module = "gpuio._native")]
pub struct HostBuffer {
    ptr: *mut u8,
    len: usize,
    cap: usize,
}

// SAFETY: the buffer owns its allocation as the `Vec` it came from did, and Rust never reads or
// writes the bytes after `new`: they are reached only through the buffer protocol, by Python
// code under Python's own rules (as for a `bytearray`), so sharing the pointer between threads
// adds no data race on the Rust side.
unsafe impl Send for HostBuffer {}
// SAFETY: as for `Send`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Takes `buf`'s allocation.
    pub fn new(buf: Vec<u8>) -> Self {
        let mut buf = ManuallyDrop::new(buf);
        HostBuffer {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            cap: buf.capacity(),
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: pointer, length and capacity came from a `Vec<u8>` in `new`, and no buffer
        // view is left: each holds a reference to this object (`PyBuffer_FillInfo`), so the
        // object is dropped only after the last view is released.
        drop(unsafe { Vec::from_raw_parts(self.ptr, self.len, self.cap) });
    }
}

#[pymethods]
impl HostBuffer {
    fn __len__(&self) -> usize {
        self.len
    }

    /// # Safety
    /// Called by Python with a `Py_buffer` to fill (the buffer protocol's contract).
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("HostBuffer: no view to fill"));
        }
        // A failed request leaves no object in the view (the buffer protocol's rule; neither
        // PyO3 nor `PyBuffer_FillInfo` clears it).
        let fail = |e: PyErr| {
            // SAFETY: `view` is the caller's non-null `Py_buffer`.
            unsafe { (*view).obj = std::ptr::null_mut() };
            Err(e)
        };
        let (ptr, len) = (slf.get().ptr, slf.get().len);
        let Ok(len) = isize::try_from(len) else {
            return fail(PyBufferError::new_err(
                "HostBuffer: larger than a Python buffer",
            ));
        };
        // SAFETY: `view` is the caller's non-null `Py_buffer`; `ptr..ptr + len` is this
        // object's allocation, which lives while the view does (the view holds a reference to
        // the object); writable (readonly 0), as the allocation is ours to lend.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(view, slf.as_ptr(), ptr.cast::<c_void>(), len, 0, flags)
        };
        if rc == -1 {
            return fail(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Called by Python with a view `__getbuffer__` filled.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        // Nothing to undo: the view's reference to this object is Python's to drop.
    }
}
