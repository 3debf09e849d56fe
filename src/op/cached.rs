//! Small reads into host memory served straight from the page cache by the thread that polls
//! them: one `preadv2(RWF_NOWAIT)` into the caller's buffer, which the kernel completes only
//! when every byte is cached and nothing would make it wait.
//!
//! A 4 KiB read through the reactor costs a message, a submission, a completion, a slot, a
//! copy out of it and two cross-thread wake-ups, several times the kernel's own work for a
//! cached page (`BENCHMARKS.md`: the reactor thread is what bounds small reads). Served here,
//! the read is one system call on the polling thread. The copy happens inside `poll`, into
//! the buffer the future borrows, so dropping or leaking the future afterwards changes nothing.
//!
//! Larger reads into host memory (up to [`HOST_CACHED_READ_MAX`] by default) take the same
//! call in pieces of [`HOST_POLL_PIECE`], one per poll, where the page cache holds the range:
//! one copy where the bounce path makes two (io-wq into a slot, the future out of it).
//!
//! Small reads into device memory take the same path through a per-thread pageable staging
//! buffer ([`with_stage`]): `RWF_NOWAIT` into it, then one copy from it on the destination's
//! stream, also inside `poll`. The copy is a `cuMemcpyBatchAsync` whose source is read during
//! the call (`CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL`, the one documented promise that a
//! pageable source is free when the call returns; a plain asynchronous copy "might" be
//! synchronous, no more), so the buffer is free for the next read at once: no bounce slot, no
//! event, no reactor, no wake. What is left is queued on the stream in front of cudarc's write
//! event, as every copy a read's future issues is. That call takes no NULL or legacy stream:
//! for memory used there (torch's and cupy's default stream), the copy goes on a side stream
//! of gpuio's ordered with the legacy one by two events (`cuda::side`). Where the call is
//! missing (drivers before CUDA 12.8), the stream is the per-thread default one, the stream is
//! being captured into a graph, small device reads go through the reactor. The copy call may wait while the driver's own staging
//! memory is full of earlier copies queued behind long work on the same stream: bounded by
//! that work, and the one way this path can hold the polling thread longer than a copy.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

/// Largest read the polling thread tries to serve from the page cache (bytes): a copy this
/// size takes microseconds, short enough to run on an async runtime's thread.
pub const CACHED_READ_MAX: usize = 64 << 10;

/// The largest read into host memory that the thread polling it copies from the page cache by
/// default (`EngineBuilder::page_cache_read_max`), 2 MiB (`HOST_POLL_PIECE`) per poll. One
/// copy (page cache to buffer) instead of the bounce path's two (page cache to slot, slot to
/// buffer). Measured on a 32-core host (BENCHMARKS.md, eighteenth session): 16 MiB reads at
/// depth 32 ran 1.6x the bounce path's rate (1 MiB: 2.3x), at depth 1 and 4 as fast on 0.6x
/// the cores. A lone 64 MiB read ran 0.77x and a lone 1 GiB read 0.87x (one thread copying
/// cold bytes into a cold buffer, where io-wq's many copies feed the bounce path), so larger
/// reads keep the bounce path; eight 64 MiB reads at once ran 1.27x in poll on half the cores.
pub const HOST_CACHED_READ_MAX: usize = 16 << 20;

/// Most bytes one poll of a larger host read copies from the page cache
/// (`EngineBuilder::page_cache_read_max`) before it yields to the runtime: about 0.4 ms of
/// copying, as long as a bounce read's copy of one 2 MiB piece into the buffer takes.
pub const HOST_POLL_PIECE: usize = 2 << 20;

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

/// Bytes of each thread's staging buffer for small device reads.
#[cfg(feature = "cuda")]
const STAGE_LEN: usize = CACHED_READ_MAX;

#[cfg(feature = "cuda")]
use crate::cuda::stage::PageableStage;

#[cfg(feature = "cuda")]
thread_local! {
    static STAGE: std::cell::RefCell<Option<PageableStage>> = const { std::cell::RefCell::new(None) };
    /// The stage a batch polled on this thread borrows for one poll (`op::combine`): kept
    /// between batches so its pages are made once, not on every batch.
    static BATCH_STAGE: std::cell::Cell<Option<PageableStage>> = const { std::cell::Cell::new(None) };
}

/// Bytes of a batch's stage (virtual: pages are made as reads touch them).
#[cfg(feature = "cuda")]
pub(crate) const BATCH_STAGE_LEN: usize = 4 << 20;

/// This thread's batch stage, or a new one if another batch holds it; `None` if the mapping
/// fails.
#[cfg(feature = "cuda")]
pub(crate) fn take_batch_stage() -> Option<PageableStage> {
    BATCH_STAGE
        .try_with(|c| c.take())
        .ok()
        .flatten()
        .or_else(|| PageableStage::new(BATCH_STAGE_LEN))
}

/// Keeps `stage` (its copies queued, its bytes read by the driver) for the next batch polled
/// on this thread.
#[cfg(feature = "cuda")]
pub(crate) fn keep_batch_stage(stage: PageableStage) {
    // During thread teardown the stage is simply dropped.
    let _ = BATCH_STAGE.try_with(|c| c.set(Some(stage)));
}

/// Runs `f` with this thread's staging buffer (made on first use); `None` where it cannot be
/// made or is in use further up this thread's stack.
#[cfg(feature = "cuda")]
pub(crate) fn with_stage<R>(f: impl FnOnce(&mut PageableStage) -> Option<R>) -> Option<R> {
    STAGE
        .try_with(|cell| {
            let mut slot = cell.try_borrow_mut().ok()?;
            if slot.is_none() {
                *slot = PageableStage::new(STAGE_LEN);
            }
            f(slot.as_mut()?)
        })
        .ok()
        .flatten()
}
