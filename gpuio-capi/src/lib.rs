//! # gpuio's C API
//!
//! A thin layer over the `gpuio` library for C and C++ programs: `libgpuio_capi.so` /
//! `libgpuio_capi.a` and `include/gpuio.h` (generated from this crate by cbindgen; a test
//! fails when the checked-in header differs from what the code generates).
//!
//! ## The contract (also at the top of the header)
//! - **Buffers stay valid until the operation completes**: for synchronous calls until they
//!   return, for asynchronous requests until the request completes (observed through
//!   `gpuio_request_wait`/`gpuio_request_test`, the callback, or the eventfd), or until
//!   `gpuio_request_free` of a running request (which cancels it and waits) returns.
//! - **Every function may be called from any thread**, on any handle, at the same time. Handles
//!   are tokens looked up in a table, never dereferenced: a closed or freed handle, a handle of
//!   another kind or a stray pointer is `GPUIO_ERR_BAD_HANDLE`, and a free racing a call on
//!   another thread waits for nothing and breaks nothing.
//! - **No call aborts the process on bad input**: null pointers, unknown flags, bad sizes and
//!   dead handles return a status with a message in `gpuio_last_error()` (op, path, offset and
//!   backend where they apply). A panic inside gpuio is caught at the boundary
//!   (`GPUIO_ERR_INTERNAL`).
//! - Asynchronous requests run on a small thread pool per engine (`executor_threads`); the
//!   library's futures are runtime-agnostic, so the caller needs no async runtime. Completion
//!   callbacks run on those threads and must not block.
//! - `gpuio_engine_free` cancels the engine's running requests (they complete with
//!   `GPUIO_ERR_CANCELED`) and waits until none touches its buffer, then stops the engine.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// The C names (`gpuio_engine`, `gpuio_status`, `GPUIO_OK`) are the API.
#![allow(non_camel_case_types)]

pub mod batch;
pub mod engine;
mod executor;
pub mod file;
pub mod memory;
mod registry;
pub mod request;
pub mod status;
mod text;

pub use status::gpuio_status;

/// `gpuio_open` flag: open for reading.
pub const GPUIO_OPEN_READ: u32 = 1;
/// `gpuio_open` flag: open for writing.
pub const GPUIO_OPEN_WRITE: u32 = 2;
/// `gpuio_open` flag: create the file if missing (needs `GPUIO_OPEN_WRITE`).
pub const GPUIO_OPEN_CREATE: u32 = 4;
/// `gpuio_open` flag: truncate to zero length (needs `GPUIO_OPEN_WRITE`).
pub const GPUIO_OPEN_TRUNCATE: u32 = 8;
/// `gpuio_open` flag: bypass the page cache (O_DIRECT); any offset and length still work.
pub const GPUIO_OPEN_DIRECT: u32 = 16;

/// `gpuio_engine_settings.backend`: io_uring where it can be set up, else the pread pool;
/// cuFile per file where it serves device memory.
pub const GPUIO_BACKEND_AUTO: u32 = 0;
/// `gpuio_engine_settings.backend`: io_uring only (creating the engine fails without it).
pub const GPUIO_BACKEND_URING: u32 = 1;
/// `gpuio_engine_settings.backend`: the pread/pwrite thread pool.
pub const GPUIO_BACKEND_PREAD: u32 = 2;
/// `gpuio_engine_settings.backend`: cuFile for every device-memory transfer.
pub const GPUIO_BACKEND_GDS: u32 = 3;

/// `gpuio_buffer.kind`: host memory (the zero value).
pub const GPUIO_MEMORY_HOST: u32 = 0;
/// `gpuio_buffer.kind`: CUDA device memory (`ptr` is a `CUdeviceptr`).
pub const GPUIO_MEMORY_DEVICE: u32 = 1;

/// What this machine offers gpuio for `path` (a regular file, a block device, or a directory
/// whose filesystem is probed with a scratch file that is removed again), as the text
/// `gpuio check PATH` prints: io_uring, the engine's sizing and why, O_DIRECT, CUDA,
/// GPUDirect Storage and SPDK. Written into `buf` NUL-terminated (at most `len` bytes); `*needed`
/// (if not NULL) gets the bytes the whole report needs, NUL included, and a smaller `len` is
/// `GPUIO_ERR_RANGE` with as much as fits written (call with `len` 0 to ask the size; the
/// report is built again on each call). Blocks while it probes.
///
/// # Safety
/// `path` is NULL (an error) or NUL-terminated; `buf` has `len` writable bytes (or `len` is
/// 0); `needed` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_check(
    path: *const libc::c_char,
    buf: *mut libc::c_char,
    len: usize,
    needed: *mut usize,
) -> gpuio_status {
    status::guard(|| {
        // SAFETY: forwarded from this function's contract.
        let path = unsafe { text::c_path(path, "gpuio_check") }?;
        let report = gpuio::check::report(&path)?;
        // SAFETY: forwarded from this function's contract.
        unsafe { text::copy_out(&report.to_string(), buf, len, needed) }
    })
}

/// The library's version, e.g. `"0.1.0"` (a static string; never null).
#[unsafe(no_mangle)]
pub extern "C" fn gpuio_version() -> *const libc::c_char {
    const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");
    VERSION.as_ptr().cast()
}
