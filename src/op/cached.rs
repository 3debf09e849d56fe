//! Small reads into host memory served straight from the page cache by the thread that polls
//! them: one `preadv2(RWF_NOWAIT)` into the caller's buffer, which the kernel completes only
//! when every byte is cached and nothing would make it wait.
//!
//! A 4 KiB read through the reactor costs a message, a submission, a completion, a slot, a
//! copy out of it and two cross-thread wake-ups, several times the kernel's own work for a
//! cached page (`BENCHMARKS.md`: the reactor thread is what bounds small reads). Served here,
//! the read is one system call on the polling thread. The copy happens inside `poll`, into
//! the buffer the future borrows, so dropping or leaking the future afterwards changes nothing.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

/// Largest read the polling thread tries to serve from the page cache (bytes): a copy this
/// size takes microseconds, short enough to run on an async runtime's thread.
pub const CACHED_READ_MAX: usize = 64 << 10;

/// Reads `dst.len()` bytes at `offset` from `fd` if the page cache holds all of them (or
/// `offset` is at or past the end of the file: `Some(0)`). `None`: go through the reactor
/// (not all cached, a short read, any error). `refused` is the file's flag, set once the
/// kernel refuses `RWF_NOWAIT` for it as such (before Linux 4.14, or a file type without it):
/// the fast path is then not tried again on that file.
pub(crate) fn try_read(
    fd: RawFd,
    refused: &AtomicBool,
    dst: &mut [u8],
    offset: u64,
) -> Option<usize> {
    if refused.load(Ordering::Relaxed) || dst.is_empty() {
        return None;
    }
    let iov = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    let pos = libc::off_t::try_from(offset).ok()?;
    // SAFETY: `fd` is an open descriptor (the file the future borrows); `iov` describes
    // `dst`, writable and exclusively borrowed for the length of the call; the kernel writes
    // at most `iov_len` bytes into it and nothing after the call returns.
    let n = unsafe { libc::preadv2(fd, &iov, 1, pos, libc::RWF_NOWAIT) };
    if n < 0 {
        let err = std::io::Error::last_os_error().raw_os_error();
        if matches!(
            err,
            Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL)
        ) {
            refused.store(true, Ordering::Relaxed);
        }
        return None;
    }
    let n = n as usize;
    // A short count is end of file or a range only partly cached: the reactor's read tells
    // which (re-reading the cached part is harmless).
    (n == dst.len() || n == 0).then_some(n)
}
