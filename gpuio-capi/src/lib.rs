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
//! - Agents are the exception to "until the call returns": memory given to
//!   `gpuio_agent_register` stays valid until `gpuio_agent_deregister` (or
//!   `gpuio_agent_free`) returns.
//!
//! ## Agents
//! The library's agents (NIXL's model: registrations, peers loaded from metadata, READ and
//! WRITE transfers between descriptor lists, notifications that arrive after the data) as
//! handles; `tests/c/agent.c` uses every call.
//! - `gpuio_agent_create(engine, name, flags, &agent)`: `GPUIO_AGENT_UCX_OFF` (peers in this
//!   process only), `GPUIO_AGENT_UCX_REQUIRED`, `GPUIO_AGENT_NO_IPC`, `GPUIO_AGENT_STAGE_DEVICE`; without a UCX flag,
//!   peers in other processes are reached through UCX where it loads. Two agents in one
//!   process copy straight between each other's memory. `gpuio_agent_free` deregisters what
//!   is left first.
//! - `gpuio_agent_register(agent, GPUIO_MEMORY_HOST or _DEVICE, addr, len, dev, &reg)`, and
//!   `gpuio_agent_deregister(reg)`, which waits for the transfers that touch the memory.
//! - `gpuio_agent_metadata` into a buffer, passed to the peer's `gpuio_agent_add_peer`
//!   (which gives back the peer's name); `gpuio_agent_remove_peer`.
//! - Descriptor lists are `gpuio_desc {addr, len, dev}` arrays with a count and a memory type;
//!   `gpuio_descs_serialize` / `_deserialize` carry them to a peer.
//! - `gpuio_xfer_create(agent, GPUIO_XFER_READ or _WRITE, local list, peer, remote list,
//!   notif, &xfer)` checks every range against the registrations once; prepared lists
//!   (`gpuio_prep_create`, with a peer or NULL for this agent) give
//!   `gpuio_xfer_create_prepped`, which pairs entries by index. `gpuio_xfer_post` starts it
//!   (again, once the last posting finished), `gpuio_xfer_status` polls (`GPUIO_PENDING`
//!   while it runs), `gpuio_xfer_wait` blocks, `gpuio_xfer_free` lets a posting run on.
//! - `gpuio_agent_send_notif`; `gpuio_agent_get_notif(agent, timeout_ms, ...)` hands out one
//!   notification (`GPUIO_ERR_TIMEOUT` for none).
//! - Variable-size outputs (metadata, serialised lists, notifications) follow one convention:
//!   a NULL buffer with a capacity of 0, or one too small, is `GPUIO_ERR_RANGE` with the size
//!   needed stored and nothing consumed; call again with a buffer that large.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
// The C names (`gpuio_engine`, `gpuio_status`, `GPUIO_OK`) are the API.
#![allow(non_camel_case_types)]

pub mod agent;
pub mod batch;
pub mod engine;
mod executor;
pub mod file;
pub mod memory;
pub mod options;
mod registry;
pub mod request;
pub mod status;
mod text;
pub mod xfer;

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

/// `gpuio_agent_create` flag: reach peers in this process only, never load UCX.
pub const GPUIO_AGENT_UCX_OFF: u32 = 1;
/// `gpuio_agent_create` flag: fail where UCX cannot be loaded (without either UCX flag, UCX
/// is used where it loads).
pub const GPUIO_AGENT_UCX_REQUIRED: u32 = 2;
/// `gpuio_agent_create` flag: reach device memory of a peer process on this host through UCX
/// rather than CUDA IPC.
pub const GPUIO_AGENT_NO_IPC: u32 = 4;
/// `gpuio_agent_create` flag: device memory moved over UCX passes through host memory even
/// where UCX could move it itself (a UCX without CUDA support always stages it).
pub const GPUIO_AGENT_STAGE_DEVICE: u32 = 8;

/// `gpuio_xfer_create` operation: from the remote descriptors into the local ones.
pub const GPUIO_XFER_READ: u32 = 0;
/// `gpuio_xfer_create` operation: from the local descriptors into the remote ones.
pub const GPUIO_XFER_WRITE: u32 = 1;

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
