//! Status codes, the thread-local last error, and the guard every entry point runs in.

use std::cell::RefCell;
use std::ffi::CString;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// What a call did. `GPUIO_OK` is 0; every other value is a failure (or, for
/// `GPUIO_PENDING` and `GPUIO_ERR_TIMEOUT`, a request or transfer that is still running, or
/// no notification yet; for `GPUIO_ERR_RANGE`, an output buffer to enlarge), and
/// `gpuio_last_error()` says what happened.
#[repr(C)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum gpuio_status {
    /// Success.
    GPUIO_OK = 0,
    /// An argument is invalid: a null pointer, an unknown flag, a bad setting, a range past the
    /// largest file offset, a file opened without the access asked for.
    GPUIO_ERR_INVALID = 1,
    /// A handle that is not live: closed, freed, never returned by gpuio, or of another kind.
    GPUIO_ERR_BAD_HANDLE = 2,
    /// The operating system reported an error (`gpuio_last_errno()` has its errno).
    GPUIO_ERR_IO = 3,
    /// The machine, the file or the build does not offer what was asked for (no CUDA, no GPU
    /// of that index, no io_uring where it was demanded).
    GPUIO_ERR_UNSUPPORTED = 4,
    /// A CUDA driver call failed.
    GPUIO_ERR_CUDA = 5,
    /// The engine was freed (or shut down) before or while the operation ran.
    GPUIO_ERR_SHUTDOWN = 6,
    /// No bounce memory came free in time (see the library's `Error::PoolExhausted`), or no
    /// memory for what a call must allocate (a batch's plan).
    GPUIO_ERR_NO_MEMORY = 7,
    /// The engine's reactor thread died; free the engine and create a new one.
    GPUIO_ERR_REACTOR_DIED = 8,
    /// `gpuio_request_wait`: the timeout passed first; the request is still running.
    /// `gpuio_agent_get_notif`: no notification came within the timeout.
    GPUIO_ERR_TIMEOUT = 9,
    /// `gpuio_request_test`: the request is still running. `gpuio_xfer_status`: the transfer
    /// is still in progress.
    GPUIO_PENDING = 10,
    /// The request was cancelled: its engine was freed while it ran.
    GPUIO_ERR_CANCELED = 11,
    /// An output buffer is too small (or NULL with a capacity of 0: a size query); the call
    /// says how large it must be.
    GPUIO_ERR_RANGE = 12,
    /// The call would block inside a completion callback (which runs on an engine's
    /// executor thread and must not block): waiting, synchronous I/O, freeing an engine.
    GPUIO_ERR_WOULD_BLOCK = 13,
    /// A bug in gpuio, caught at the C boundary instead of aborting the process.
    GPUIO_ERR_INTERNAL = 14,
}

use gpuio_status::*;

/// A failed call: its status, its message and, for OS errors, the errno.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) status: gpuio_status,
    pub(crate) message: String,
    pub(crate) errno: i32,
}

impl Failure {
    pub(crate) fn new(status: gpuio_status, message: impl Into<String>) -> Self {
        Failure {
            status,
            message: message.into(),
            errno: 0,
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Failure::new(GPUIO_ERR_INVALID, message)
    }

    /// Stores the failure as this thread's last error and returns its status.
    pub(crate) fn record(self) -> gpuio_status {
        let status = self.status;
        LAST.with(|last| {
            let mut last = last.borrow_mut();
            // An interior NUL cannot come from gpuio's messages, but a path may hold one byte
            // that C cannot show: replace rather than lose the message.
            let text = self.message.replace('\0', "\\0");
            last.message = CString::new(text).unwrap_or_default();
            last.errno = self.errno;
        });
        status
    }
}

impl From<gpuio::Error> for Failure {
    fn from(e: gpuio::Error) -> Self {
        let status = match &e {
            gpuio::Error::Io { .. } => GPUIO_ERR_IO,
            gpuio::Error::InvalidInput { .. } => GPUIO_ERR_INVALID,
            gpuio::Error::Unsupported { .. } => GPUIO_ERR_UNSUPPORTED,
            gpuio::Error::Shutdown { .. } => GPUIO_ERR_SHUTDOWN,
            gpuio::Error::Cuda { .. } => GPUIO_ERR_CUDA,
            gpuio::Error::PoolExhausted { .. } => GPUIO_ERR_NO_MEMORY,
            gpuio::Error::ReactorDied { .. } => GPUIO_ERR_REACTOR_DIED,
            // A variant added to the library later: its message still says what happened.
            _ => GPUIO_ERR_IO,
        };
        let errno = match &e {
            gpuio::Error::Io { source, .. } => source.raw_os_error().unwrap_or(0),
            _ => 0,
        };
        Failure {
            status,
            // The library's Display names the operation, path, offset and backend.
            message: e.to_string(),
            errno,
        }
    }
}

struct LastError {
    message: CString,
    errno: i32,
}

thread_local! {
    static LAST: RefCell<LastError> = RefCell::new(LastError {
        message: CString::default(),
        errno: 0,
    });
}

/// Runs an entry point's body: a failure becomes its status and this thread's last error; a
/// panic (a gpuio bug) is caught here, never unwinding into C, and reported the same way.
pub(crate) fn guard(body: impl FnOnce() -> Result<(), Failure>) -> gpuio_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => GPUIO_OK,
        Ok(Err(failure)) => failure.record(),
        Err(panic) => Failure::new(
            GPUIO_ERR_INTERNAL,
            format!(
                "internal error in gpuio (caught at the C boundary): {}",
                panic_message(&*panic)
            ),
        )
        .record(),
    }
}

/// The text of a caught panic.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// The message of the last call on this thread that failed ("" if none did). The pointer stays
/// valid until the next gpuio call on this thread that fails; copy the text to keep it.
#[unsafe(no_mangle)]
pub extern "C" fn gpuio_last_error() -> *const libc::c_char {
    // No guard: nothing here can panic (the thread-local access cannot fail while the thread
    // runs C code), and a guard would overwrite the very message asked for.
    LAST.with(|last| last.borrow().message.as_ptr())
}

/// The errno of the last call on this thread that failed with `GPUIO_ERR_IO` (0 otherwise, or
/// if the OS gave none).
#[unsafe(no_mangle)]
pub extern "C" fn gpuio_last_errno() -> i32 {
    LAST.with(|last| last.borrow().errno)
}

/// A short, constant name for a status value (`"GPUIO_ERR_IO"`), for logs; never null
/// (`"GPUIO_UNKNOWN_STATUS"` for a value that is no `gpuio_status`).
#[unsafe(no_mangle)]
pub extern "C" fn gpuio_status_name(status: i32) -> *const libc::c_char {
    // The value comes from C as a plain int: any int is accepted, so no enum is formed from it.
    const NAMES: [&std::ffi::CStr; 15] = [
        c"GPUIO_OK",
        c"GPUIO_ERR_INVALID",
        c"GPUIO_ERR_BAD_HANDLE",
        c"GPUIO_ERR_IO",
        c"GPUIO_ERR_UNSUPPORTED",
        c"GPUIO_ERR_CUDA",
        c"GPUIO_ERR_SHUTDOWN",
        c"GPUIO_ERR_NO_MEMORY",
        c"GPUIO_ERR_REACTOR_DIED",
        c"GPUIO_ERR_TIMEOUT",
        c"GPUIO_PENDING",
        c"GPUIO_ERR_CANCELED",
        c"GPUIO_ERR_RANGE",
        c"GPUIO_ERR_WOULD_BLOCK",
        c"GPUIO_ERR_INTERNAL",
    ];
    usize::try_from(status)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or(c"GPUIO_UNKNOWN_STATUS")
        .as_ptr()
}
