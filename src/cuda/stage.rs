//! Pinned staging memory for the page-cache reads of batches into device memory
//! (`op::combine`). The copy engine reads a pinned stage directly, in stream order; from
//! pageable memory the driver first copies every byte into its own staging memory, inside the
//! call. `copy_ceiling` on the 16-core H100: 64 × 4 KiB in one batched call from one thread,
//! 2.04 M copies/s pinned against 0.63 M/s pageable (BENCHMARKS.md, thirteenth session).
//!
//! A stage is written only while it is free: taken from the pool before any copy out of it
//! was queued, or after the event recorded behind its last copies has completed. Each engine
//! has a pool ([`StagePool`]); stages are made on demand, at most [`MAX_STAGES`] per pool, and
//! a dropped [`PinnedStage`] goes back to its pool, never to the system. When the engine and
//! every stage it lent are gone, the pool is emptied on a thread of its own: it waits for each
//! stage's last copies, then unpins and unmaps it (`cuMemHostUnregister` waits for all of the
//! device's work, which an engine's drop must not). Past the limit, or where pinning fails,
//! batches stage in pageable memory as before.

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;

use super::event::EventGate;
use super::pinned::PinnedRegion;

/// Bytes of one stage: 256 reads of 4 KiB. A poll that stages more queues the full stage's
/// copies and goes on in another.
pub(crate) const PINNED_STAGE_LEN: usize = 1 << 20;

/// Most stages one engine makes (32 MiB of page-locked memory).
const MAX_STAGES: usize = 32;

/// Pageable host memory that small device reads pass through: a private anonymous mapping of
/// its own, so no one else has pinned it (`cuMemHostRegister` on memory the heap later hands
/// out would make CUDA read it asynchronously; a mapping of ours is never registered by
/// anyone who does not own it). Its pages are only made when first touched.
pub(crate) struct PageableStage {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the stage is plain memory owned by this value; moving it to another thread moves
// that ownership, and `&self` gives out nothing (every access goes through `&mut self`).
unsafe impl Send for PageableStage {}

impl PageableStage {
    /// A stage of `len` bytes; `None` if the mapping fails.
    pub(crate) fn new(len: usize) -> Option<PageableStage> {
        // SAFETY: an anonymous private mapping of `len` bytes at an address of the kernel's
        // choosing; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        NonNull::new(p.cast()).map(|ptr| PageableStage { ptr, len })
    }

    /// The stage's address, for copies out of it.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The whole stage, writable.
    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes, readable and writable, lives as long as `self`,
        // and `&mut self` makes this the only reference into it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PageableStage {
    fn drop(&mut self) {
        // SAFETY: `ptr` is the start of our own `len`-byte mapping, referenced by no one once
        // `self` goes: the driver read a pageable stage before each copy call returned
        // (`queue_staged`), and a pinned stage's mapping is dropped only once no copy can read
        // it (`StageMem`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The memory of one pinned stage: a pageable stage of our own, page-locked for every
/// context. Dropping it unpins, then unmaps it (fields drop in order), which its owner does only
/// once no copy can read it: the pool's drain waits for each stage's event first, and a stage
/// whose copies cannot be accounted for (a failed query, wait or drain) is forgotten instead.
struct StageMem {
    _pin: PinnedRegion,
    map: PageableStage,
}

/// Stages not in use, oldest first, each with the event behind its last copies.
#[derive(Default)]
struct Pool {
    free: VecDeque<(StageMem, Option<EventGate>)>,
    made: usize,
    /// Pinning failed once: no more attempts.
    broken: bool,
}

/// One engine's pinned stages (see the module docs).
#[derive(Default)]
pub(crate) struct StagePool {
    pool: Mutex<Pool>,
}

impl Drop for StagePool {
    fn drop(&mut self) {
        let pool = std::mem::take(self.pool.get_mut().unwrap_or_else(|p| p.into_inner()));
        if pool.free.is_empty() {
            return;
        }
        // Only the thread lets the stages go: if it cannot be started, std drops the closure
        // unrun, and `ManuallyDrop` then leaks the stages (mapped and pinned) rather than
        // unmapping memory copies may still read, or this drop waiting for the device's work.
        let pool = std::mem::ManuallyDrop::new(pool);
        let job = move || {
            for (mem, busy) in std::mem::ManuallyDrop::into_inner(pool).free {
                match busy.map_or(Ok(()), |e| e.wait()) {
                    Ok(()) => drop(mem),
                    // Whether copies still read it is unknown: leave it mapped and pinned.
                    Err(_) => std::mem::forget(mem),
                }
            }
        };
        let _ = std::thread::Builder::new()
            .name("gpuio-unpin".into())
            .spawn(job);
    }
}

/// A free pinned stage, lent by the pool; it goes back to it when dropped, with the event
/// [`set_busy`](Self::set_busy) gave it.
pub(crate) struct PinnedStage {
    mem: Option<StageMem>,
    busy: Option<EventGate>,
    pool: Arc<StagePool>,
}

impl PinnedStage {
    /// The stage's address, for copies out of it.
    pub(crate) fn addr(&self) -> u64 {
        self.mem.as_ref().map_or(0, |m| m.map.addr())
    }

    /// The whole stage, writable: no copy out of it is pending (the pool lends only stages
    /// whose event has completed or that no copy used, a stage whose copies cannot be waited
    /// for is retired, and `set_busy` and `retire` consume the handle).
    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        match &mut self.mem {
            Some(m) => m.map.bytes(),
            None => &mut [],
        }
    }

    /// Gives the stage back, busy until `event` (recorded behind every copy queued out of it)
    /// completes; `None`: no copy out of it is pending.
    pub(crate) fn set_busy(mut self, event: Option<cudarc::driver::CudaEvent>) {
        self.busy = event.map(EventGate::new);
    }

    /// Never lends the stage again, nor unmaps it: copies may still read it and nothing says
    /// when they end (a failed drain). Its memory stays mapped and pinned for the process.
    pub(crate) fn retire(mut self) {
        if let Some(mem) = self.mem.take() {
            std::mem::forget(mem);
        }
    }

    fn make(ctx: &Arc<CudaContext>) -> Option<StageMem> {
        let mut map = PageableStage::new(PINNED_STAGE_LEN)?;
        let base = map.bytes().as_mut_ptr();
        // SAFETY: the mapping outlives the registration: `StageMem` drops `_pin` before `map`.
        match unsafe { PinnedRegion::register(ctx, base, PINNED_STAGE_LEN) } {
            Ok(pin) => Some(StageMem { _pin: pin, map }),
            Err(why) => {
                tracing::debug!(%why, "batch stages stay pageable");
                None
            }
        }
    }
}

impl Drop for PinnedStage {
    fn drop(&mut self) {
        if let Some(mem) = self.mem.take() {
            let mut pool = self.pool.pool.lock().unwrap_or_else(|p| p.into_inner());
            pool.free.push_back((mem, self.busy.take()));
        }
    }
}

impl StagePool {
    /// A free stage: the oldest kept one if its copies have finished, else a new one while
    /// fewer than [`MAX_STAGES`] exist (pinned through `ctx`, for every context). `None`: none
    /// is free now; the caller stages in pageable memory.
    pub(crate) fn take(self: &Arc<Self>, ctx: &Arc<CudaContext>) -> Option<PinnedStage> {
        let lend = |mem| PinnedStage {
            mem: Some(mem),
            busy: None,
            pool: self.clone(),
        };
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.broken {
            return None;
        }
        if let Some((_, busy)) = pool.free.front() {
            let queried = busy.as_ref().map_or(Ok(true), |e| e.query());
            if busy.is_some() {
                // The query made the event's context current (another GPU's, perhaps): the
                // caller's thread goes on with the one it asked for.
                let _ = ctx.bind_to_thread();
            }
            match queried {
                Ok(true) => {
                    let (mem, _done) = pool.free.pop_front()?;
                    return Some(lend(mem));
                }
                Ok(false) => {}
                Err(why) => {
                    // Its context failed: whether the copies still read the stage is unknown,
                    // so it is never written or unmapped again.
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
            Some(mem) => Some(lend(mem)),
            None => {
                self.pool.lock().unwrap_or_else(|p| p.into_inner()).broken = true;
                None
            }
        }
    }
}
