//! Pinned staging memory for the page-cache reads of batches into device memory
//! (`op::combine`). The copy engine reads a pinned stage directly, in stream order; from
//! pageable memory the driver first copies every byte into its own staging memory, inside the
//! call. `copy_ceiling` on the 16-core H100: 64 × 4 KiB in one batched call from one thread,
//! 2.04 M copies/s pinned against 0.63 M/s pageable (BENCHMARKS.md, thirteenth session).
//!
//! A stage is written only while it is free: taken from the pool before any copy out of it
//! was queued, or after the event recorded behind its last copies has completed. Stages are
//! made on demand, at most [`MAX_STAGES`], and kept for the process's life (a dropped
//! [`PinnedStage`] goes back to the pool, never to the system): unpinning
//! (`cuMemHostUnregister`) waits for the device's work, which a polling thread must not, and
//! memory a copy may still read must not be unmapped. Past the limit, or where pinning
//! fails, batches stage in pageable memory as before.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;

use super::event::EventGate;
use super::pinned::PinnedRegion;

/// Bytes of one stage: 256 reads of 4 KiB. A poll that stages more queues the full stage's
/// copies and goes on in another.
pub(crate) const PINNED_STAGE_LEN: usize = 1 << 20;

/// Most stages the process makes (32 MiB of page-locked memory).
const MAX_STAGES: usize = 32;

/// The memory of one stage: a private anonymous mapping, page-locked for every context.
struct StageMem {
    ptr: NonNull<u8>,
    _pin: PinnedRegion,
}

// SAFETY: the mapping is owned by this value, and moving it moves that ownership; the
// registration handle is `Send`.
unsafe impl Send for StageMem {}

/// Stages not in use, oldest first, each with the event behind its last copies.
struct Pool {
    free: VecDeque<(StageMem, Option<EventGate>)>,
    made: usize,
    /// Pinning failed once: no more attempts.
    broken: bool,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    free: VecDeque::new(),
    made: 0,
    broken: false,
});

/// A free pinned stage, lent by the pool; it goes back to it when dropped, with the event
/// [`set_busy`](Self::set_busy) gave it.
pub(crate) struct PinnedStage {
    mem: Option<StageMem>,
    busy: Option<EventGate>,
}

impl PinnedStage {
    /// The stage's address, for copies out of it.
    pub(crate) fn addr(&self) -> u64 {
        self.mem.as_ref().map_or(0, |m| m.ptr.as_ptr() as u64)
    }

    /// The whole stage, writable: no copy out of it is pending (the pool lends only free
    /// stages, and `set_busy` consumes the handle).
    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        match &self.mem {
            // SAFETY: the mapping is `PINNED_STAGE_LEN` bytes, readable and writable, lives for
            // the process, and `&mut self` makes this the only reference into it; no copy reads
            // it (see above).
            Some(m) => unsafe { std::slice::from_raw_parts_mut(m.ptr.as_ptr(), PINNED_STAGE_LEN) },
            None => &mut [],
        }
    }

    /// Gives the stage back, busy until `event` (recorded behind every copy queued out of it)
    /// completes; `None`: no copy out of it is pending.
    pub(crate) fn set_busy(mut self, event: Option<cudarc::driver::CudaEvent>) {
        self.busy = event.map(EventGate::new);
    }

    fn make(ctx: &Arc<CudaContext>) -> Option<StageMem> {
        // SAFETY: an anonymous private mapping of a fixed size at an address of the kernel's
        // choosing; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PINNED_STAGE_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let ptr = NonNull::new(p.cast::<u8>())?;
        // SAFETY: the mapping is never unmapped while registered: a stage lives for the process.
        match unsafe { PinnedRegion::register(ctx, ptr.as_ptr(), PINNED_STAGE_LEN) } {
            Ok(pin) => Some(StageMem { ptr, _pin: pin }),
            Err(why) => {
                tracing::debug!(%why, "batch stages stay pageable");
                // SAFETY: our own mapping, never registered or handed out.
                unsafe { libc::munmap(p, PINNED_STAGE_LEN) };
                None
            }
        }
    }
}

impl Drop for PinnedStage {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
            pool.free.push_back((mem, self.busy.take()));
        }
    }
}

/// A free stage: the oldest kept one if its copies have finished, else a new one while fewer
/// than [`MAX_STAGES`] exist (pinned through `ctx`, for every context). `None`: none is free
/// now; the caller stages in pageable memory.
pub(crate) fn take(ctx: &Arc<CudaContext>) -> Option<PinnedStage> {
    let mut pool = POOL.lock().unwrap_or_else(|p| p.into_inner());
    if pool.broken {
        return None;
    }
    if let Some((_, busy)) = pool.free.front() {
        match busy.as_ref().map_or(Ok(true), |e| e.query()) {
            Ok(true) => {
                let (mem, _done) = pool.free.pop_front()?;
                return Some(PinnedStage {
                    mem: Some(mem),
                    busy: None,
                });
            }
            Ok(false) => {}
            Err(why) => {
                // Its context failed: whether the copies still read the stage is unknown, so
                // it is never written again (its memory stays mapped and pinned).
                tracing::debug!(%why, "a pinned batch stage is retired");
                if let Some(lost) = pool.free.pop_front() {
                    std::mem::forget(lost);
                }
            }
        }
    }
    if pool.made >= MAX_STAGES {
        return None;
    }
    pool.made += 1;
    drop(pool);
    match PinnedStage::make(ctx) {
        Some(mem) => Some(PinnedStage {
            mem: Some(mem),
            busy: None,
        }),
        None => {
            POOL.lock().unwrap_or_else(|p| p.into_inner()).broken = true;
            None
        }
    }
}
