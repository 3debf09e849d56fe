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

/// The UTF-8 text `ptr` names (a NUL-terminated string), for names: agents, peers.
///
/// # Safety
/// `ptr` is NULL (an error) or points to a NUL-terminated string that outlives `'a`.
pub(crate) unsafe fn c_str<'a>(ptr: *const libc::c_char, what: &str) -> Result<&'a str, Failure> {
    if ptr.is_null() {
        return Err(Failure::invalid(format!("{what} is a null pointer")));
    }
    // SAFETY: non-null, and the caller promises a NUL-terminated string that outlives `'a`.
    let bytes = unsafe { CStr::from_ptr(ptr) }.to_bytes();
    std::str::from_utf8(bytes).map_err(|e| Failure::invalid(format!("{what} is not UTF-8: {e}")))
}

/// The `n` elements at `ptr` (NULL with `n` 0: none), every array a caller passes with a
/// count: refused by `what` where the pointer is NULL with a count, misaligned for `T`, or
/// the count is over `max` (or over what any array of `T` holds), before anything is read.
/// `count` names the number in messages ("count", "length").
///
/// # Safety
/// `ptr` is NULL or points to `n` readable elements that outlive `'a`, every bit pattern of
/// which is a valid `T`.
pub(crate) unsafe fn c_array<'a, T>(
    ptr: *const T,
    n: usize,
    max: usize,
    what: &str,
    count: &str,
) -> Result<&'a [T], Failure> {
    if n == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(Failure::invalid(format!(
            "{what} is a null pointer with a {count} of {n}"
        )));
    }
    let max = max.min(isize::MAX as usize / size_of::<T>().max(1));
    if n > max {
        return Err(Failure::invalid(format!(
            "{what}: a {count} of {n} is more than the {max} it may be"
        )));
    }
    if !ptr.is_aligned() {
        return Err(Failure::invalid(format!(
            "{what} is not aligned for its element type"
        )));
    }
    // SAFETY: non-null and aligned (checked), `n` readable valid elements (the caller's
    // promise), at most isize::MAX bytes (checked).
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// The `len` bytes at `ptr` (NULL with `len` 0: none), for messages and metadata.
///
/// # Safety
/// `ptr` is NULL or points to `len` readable bytes that outlive `'a`.
pub(crate) unsafe fn c_bytes<'a>(
    ptr: *const u8,
    len: usize,
    what: &str,
) -> Result<&'a [u8], Failure> {
    // SAFETY: forwarded from this function's contract; any byte is a valid u8.
    unsafe { c_array(ptr, len, usize::MAX, what, "length") }
}

/// Writes `data` into `buf` (`cap` bytes) whole, or nothing: `*len` gets `data`'s length
/// either way, and a NULL `buf` (with `cap` 0: the size query) or a `cap` below it is
/// `GPUIO_ERR_RANGE`.
///
/// # Safety
/// `buf` is NULL or points to `cap` writable bytes; `len` is NULL (an error) or writable.
pub(crate) unsafe fn bytes_out(
    data: &[u8],
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
    what: &str,
) -> Result<(), Failure> {
    if len.is_null() {
        return Err(Failure::invalid(format!("{what}: len is a null pointer")));
    }
    if buf.is_null() && cap > 0 {
        return Err(Failure::invalid(format!(
            "{what}: the buffer is a null pointer with a capacity of {cap}"
        )));
    }
    // SAFETY: non-null, and writable by this function's contract.
    unsafe { *len = data.len() };
    if data.is_empty() {
        return Ok(());
    }
    if buf.is_null() || cap < data.len() {
        return Err(Failure::new(
            gpuio_status::GPUIO_ERR_RANGE,
            format!(
                "{what}: {} bytes do not fit a buffer of {cap}: *len has the size needed",
                data.len()
            ),
        ));
    }
    // SAFETY: `buf` has `cap >= data.len()` writable bytes; `data` is gpuio's own memory, so
    // the two cannot overlap.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf, data.len()) };
    Ok(())
}
