//! Text in and out of C: NUL-terminated paths in, snprintf-style buffers out.

use std::ffi::{CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use crate::status::{Failure, gpuio_status};

/// The path `ptr` names (a NUL-terminated string of any bytes, as Linux paths are).
///
/// # Safety
/// `ptr` is NULL (an error) or points to a NUL-terminated string.
pub(crate) unsafe fn c_path(ptr: *const libc::c_char, what: &str) -> Result<PathBuf, Failure> {
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{what}: path is a null pointer")));
    }
    // SAFETY: non-null, and the caller promises a NUL-terminated string.
    let bytes = unsafe { CStr::from_ptr(ptr) }.to_bytes();
    if bytes.is_empty() {
        return Err(Failure::invalid(format!("{what}: path is empty")));
    }
    Ok(PathBuf::from(OsStr::from_bytes(bytes)))
}

/// Writes `text` and a NUL into `buf` (at most `len` bytes); `*needed` gets the full size.
/// A buffer too small gets as much as fits (NUL-terminated) and `GPUIO_ERR_RANGE`.
///
/// # Safety
/// `buf` points to `len` writable bytes (or `len` is 0); `needed` is NULL or writable.
pub(crate) unsafe fn copy_out(
    text: &str,
    buf: *mut libc::c_char,
    len: usize,
    needed: *mut usize,
) -> Result<(), Failure> {
    let full = text.len() + 1;
    if !needed.is_null() {
        // SAFETY: non-null, and the caller promises it is writable.
        unsafe { *needed = full };
    }
    if len > 0 {
        if buf.is_null() {
            return Err(Failure::invalid(
                "output buffer is a null pointer with a non-zero length",
            ));
        }
        let n = text.len().min(len - 1);
        // SAFETY: `buf` has `len` writable bytes and `n < len`; the source is `text`'s bytes,
        // which cannot overlap memory the caller owns.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    if len < full {
        return Err(Failure::new(
            gpuio_status::GPUIO_ERR_RANGE,
            format!("output buffer of {len} bytes is too small: the text needs {full}"),
        ));
    }
    Ok(())
}
