//! Many copies queued on one stream in as few driver calls as the driver allows: copies from
//! pinned host memory (or device memory) go in `cuMemcpyBatchAsync` calls (CUDA 13 drivers), the rest one by one.
//!
//! One thread queuing 64 small copies in one call runs at about 1.1 M copies/s on the H100,
//! against about 0.4 M/s one call each (`BENCHMARKS.md`), and the driver lock the calls take is
//! taken once per batch instead of once per copy: this is what makes a batch of small reads
//! into device memory cheaper than as many single reads.

use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::CUstream;

use super::memops::{SrcOrder, copy_one, memops};

/// Most copies in one driver call.
const MAX_BATCH: usize = 1024;
/// Larger copies go one by one: the call costs microseconds against the copy's hundreds, and
/// large pieces (the page-cache-warm rate's path) then take the path measured at that rate.
const MAX_BATCHED_COPY: usize = 256 << 10;

/// Set once a batched call has failed: copies go one by one from then on, process-wide
/// (a driver that refuses once will refuse again, and each refusal costs a call).
static BATCH_BROKEN: AtomicBool = AtomicBool::new(false);

/// One copy of `n` bytes from `src` to `dst` (addresses in the unified address space).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CopySpec {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) n: usize,
    /// Whether the copy engine reads the source directly (pinned host memory or device
    /// memory): only such copies go in batched calls.
    pub(crate) direct: bool,
}

/// Whether `raw` is a stream batched calls accept (not the NULL, legacy or per-thread one).
fn batchable(raw: CUstream) -> bool {
    (raw as usize) > 2
}

/// Queues `copies` on `raw`, in stream order.
///
/// # Safety
/// `raw` must be a live stream of the context current on this thread. For every copy, the
/// source and destination ranges must be memory the device may access (device memory, or host
/// memory, pinned or not, each range within one allocation or registration) that stays valid
/// and untouched by anything else until the stream has passed the copies; no two destinations
/// may overlap (copies inside one batched call run in no particular order). Unpinned sources
/// are read before this returns (the driver stages them).
pub(crate) unsafe fn queue(raw: CUstream, copies: &[CopySpec]) -> Result<(), String> {
    let ops = memops().ok().filter(|o| o.has_batch());
    let batch = ops.is_some() && batchable(raw) && !BATCH_BROKEN.load(Ordering::Relaxed);
    let (mut one_by_one, direct): (Vec<&CopySpec>, Vec<&CopySpec>) = if batch {
        copies
            .iter()
            .partition(|c| !c.direct || c.n > MAX_BATCHED_COPY)
    } else {
        (copies.iter().collect(), Vec::new())
    };
    // A single copy gains nothing from the batched call's set-up.
    if direct.len() == 1 {
        one_by_one.extend(direct.iter().copied());
    } else if let Some(ops) = ops.filter(|_| !direct.is_empty()) {
        for chunk in direct.chunks(MAX_BATCH) {
            if BATCH_BROKEN.load(Ordering::Relaxed) {
                one_by_one.extend(chunk.iter().copied());
                continue;
            }
            let mut dsts: Vec<u64> = chunk.iter().map(|c| c.dst).collect();
            let mut srcs: Vec<u64> = chunk.iter().map(|c| c.src).collect();
            let mut sizes: Vec<usize> = chunk.iter().map(|c| c.n).collect();
            // SAFETY: the caller's preconditions are `copy_batch`'s; the stream is neither
            // NULL nor a special handle (`batchable`).
            let queued =
                unsafe { ops.copy_batch(&mut dsts, &mut srcs, &mut sizes, raw, SrcOrder::Stream) };
            if let Err(why) = queued {
                // No failure index in the v2 call: some may be queued. Queuing all of them
                // again one by one writes the same bytes to the same places, in stream order.
                tracing::warn!(%why, "batched device copies failed; copying one by one from now on");
                BATCH_BROKEN.store(true, Ordering::Relaxed);
                one_by_one.extend(chunk.iter().copied());
            }
        }
    }
    for c in one_by_one {
        // SAFETY: the caller's preconditions, for one copy.
        unsafe { copy_one(c.dst, c.src, c.n, raw) }?;
    }
    Ok(())
}

/// Set once a batched copy whose sources are read during the call has been refused: small
/// reads then stop staging in pageable memory, process-wide (`staged_ok`).
static STAGED_BROKEN: AtomicBool = AtomicBool::new(false);

/// Whether copies from pageable memory can be queued on `raw` with every source read before
/// the call returns: only `cuMemcpyBatchAsync` with `CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL`
/// promises that (a plain asynchronous copy from pageable memory "might" be synchronous, no
/// more), and it takes no NULL, legacy or per-thread stream.
pub(crate) fn staged_ok(raw: CUstream) -> bool {
    batchable(raw) && staged_available()
}

/// Whether the driver has the batched call staged copies need and has not refused it: on
/// the streams [`staged_ok`] refuses, they can still go through `side::queue_in_order`.
pub(crate) fn staged_available() -> bool {
    !STAGED_BROKEN.load(Ordering::Relaxed) && memops().is_ok_and(|o| o.has_batch())
}

/// Queues `copies`, every source in pageable host memory, on `raw`, and returns once the
/// driver has read every source: in `cuMemcpyBatchAsync` calls whose sources are read during
/// the call. Should the driver refuse one, the rest are queued one by one and the stream is
/// synchronised before returning, so the sources are free however this ends.
///
/// # Safety
/// `raw` must be a live stream of the context current on this thread, one [`staged_ok`]
/// accepted; every source must be readable host memory and every destination device memory
/// that stays valid until the stream has passed the copies; no two destinations may overlap.
pub(crate) unsafe fn queue_staged(raw: CUstream, copies: &[CopySpec]) -> Result<(), String> {
    let ops = memops()?;
    let mut rest: &[CopySpec] = copies;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(MAX_BATCH)];
        let mut dsts: Vec<u64> = chunk.iter().map(|c| c.dst).collect();
        let mut srcs: Vec<u64> = chunk.iter().map(|c| c.src).collect();
        let mut sizes: Vec<usize> = chunk.iter().map(|c| c.n).collect();
        // SAFETY: the caller's preconditions, with sources read before the call returns.
        let queued =
            unsafe { ops.copy_batch(&mut dsts, &mut srcs, &mut sizes, raw, SrcOrder::DuringCall) };
        if let Err(why) = queued {
            // Some may be queued: the rest go one by one from this chunk on (the same bytes to
            // the same places, in stream order), and the stream is drained so that no copy
            // reads a source after this returns.
            tracing::warn!(%why, "batched copies from pageable memory refused; small reads stop staging");
            STAGED_BROKEN.store(true, Ordering::Relaxed);
            let mut result = Ok(());
            for c in rest {
                // SAFETY: the caller's preconditions, for one copy.
                result = result.and(unsafe { copy_one(c.dst, c.src, c.n, raw) });
            }
            // SAFETY: `raw` is a live stream of the current context.
            let drained = unsafe { super::memops::synchronize(raw) };
            return result.and(drained);
        }
        rest = &rest[chunk.len()..];
    }
    Ok(())
}
