//! A batch into a host buffer it owns while it runs ([`BatchPlan::read_owned`]), or that its
//! blocked caller lends it ([`BatchPlan::read_into_blocking`]).
//!
//! Through [`BatchPlan::read_into`], every byte bound for host memory lands in a bounce slot
//! first and the batch's future copies it out, on the one thread that polls it; into a fresh
//! allocation that copy also takes a page fault per 4 KiB page. Given the buffer, the batch
//! instead has the kernel read each run straight into its range (`File::read_in_place`): for
//! buffered files io_uring's workers copy out of the page cache (and fault the pages in),
//! several at once. Runs the kernel cannot write in place (an NVMe namespace, an O_DIRECT file
//! with unaligned ranges) still go through bounce slots, into their own ranges.

use std::sync::Arc;

use super::{BatchPlan, BatchResult, RunOf, run_bounded};
use crate::buf::region::{HostRegion, zeroed_for_reads};
use crate::error::Result;
use crate::op::progress::Progress;

impl BatchPlan {
    /// Runs the plan into `buf`, which the batch owns until every read has ended, and hands
    /// it back with the result (descriptors past `buf`'s end fail as with
    /// [`read_into`](Self::read_into)).
    ///
    /// Reads of buffered files (and of O_DIRECT files where a run's offset, length and place
    /// in `buf` are aligned to the file's [`File::direct_alignment`](crate::File::direct_alignment))
    /// land in `buf` in place, as with [`File::read_owned`](crate::File::read_owned): no bounce
    /// slot and no copy on the polling thread. Others go through bounce slots. Dropping or
    /// leaking the future mid-flight is sound: the engine holds the buffer until the kernel is
    /// done with it, and frees it then. If the engine dies with a read in flight, the buffer is
    /// never freed and an empty `Vec` comes back with the errors.
    pub async fn read_owned(&self, buf: Vec<u8>) -> (BatchResult, Vec<u8>) {
        self.read_owned_tracked(buf, None).await
    }

    /// [`read_owned`](Self::read_owned), reporting to `progress` as
    /// [`read_into_with_progress`](Self::read_into_with_progress) does.
    pub async fn read_owned_with_progress(
        &self,
        buf: Vec<u8>,
        progress: &Arc<Progress>,
    ) -> (BatchResult, Vec<u8>) {
        self.read_owned_tracked(buf, Some(progress)).await
    }

    /// Runs the plan into a new buffer of [`dst_len`](Self::dst_len) zeroed bytes, backed by
    /// transparent huge pages where the kernel gives them (a page fault per 2 MiB rather than
    /// per 4 KiB as the reads land), as [`read_owned`](Self::read_owned) does; the buffer comes
    /// back with the result.
    pub async fn read_to_vec(&self) -> (BatchResult, Vec<u8>) {
        self.read_owned_tracked(zeroed_for_reads(self.dst_len()), None)
            .await
    }

    /// [`read_to_vec`](Self::read_to_vec), reporting to `progress`.
    pub async fn read_to_vec_with_progress(
        &self,
        progress: &Arc<Progress>,
    ) -> (BatchResult, Vec<u8>) {
        self.read_owned_tracked(zeroed_for_reads(self.dst_len()), Some(progress))
            .await
    }

    /// Runs the plan into host memory `dst`, blocking the calling thread until every read has
    /// ended (descriptors past `dst`'s end fail as with [`read_into`](Self::read_into)).
    ///
    /// The call lends `dst` to the engine and returns only once no read holds it, so the
    /// kernel writes it in place as for [`read_owned`](Self::read_owned): no bounce slot and
    /// no copy on this thread, the page cache copied out by several of io_uring's workers at
    /// once. For synchronous callers (the C and Python bindings, a thread of its own); see
    /// [`File::read_into_blocking`](crate::File::read_into_blocking) for what it costs an
    /// async task and what happens if the engine's reactor dies meanwhile.
    pub fn read_into_blocking(&self, dst: &mut [u8]) -> BatchResult {
        let (results, fit) = self.runnable(dst.len(), None);
        let (runs, lend) = (&fit, lends_buffered(&fit));
        let outcomes = crate::op::blocking::lend(
            dst,
            |region| async move { read_region(runs, &region, None, lend).await },
            crate::op::blocking::block_on,
        );
        self.gather(&fit, outcomes, results)
    }

    /// [`read_into_blocking`](Self::read_into_blocking), reporting to `progress` as
    /// [`read_into_with_progress`](Self::read_into_with_progress) does and asking `keep_going`
    /// about every 100 ms while the reads run. Once it answers `false` the reads are cancelled
    /// and `None` comes back, after every read has let go of `dst`: some of `dst` may have been
    /// written, and nothing writes it afterwards.
    pub fn read_into_blocking_with_progress(
        &self,
        dst: &mut [u8],
        progress: &Arc<Progress>,
        keep_going: &mut dyn FnMut() -> bool,
    ) -> Option<BatchResult> {
        let (results, fit) = self.runnable(dst.len(), Some(progress));
        let (runs, lend) = (&fit, lends_buffered(&fit));
        let outcomes = crate::op::blocking::lend(
            dst,
            |region| async move { read_region(runs, &region, Some(progress), lend).await },
            |reads| crate::op::blocking::run_asking(reads, keep_going),
        )?;
        Some(self.gather(&fit, outcomes, results))
    }

    pub(crate) async fn read_owned_tracked(
        &self,
        buf: Vec<u8>,
        progress: Option<&Arc<Progress>>,
    ) -> (BatchResult, Vec<u8>) {
        let (results, fit) = self.runnable(buf.len(), progress);
        let region = HostRegion::new(buf);
        let outcomes = read_region(&fit, &region, progress, true).await;
        let result = self.gather(&fit, outcomes, results);
        // Every read has ended and dropped its hold on the region, but for one the kernel may
        // still write (its engine died with it in flight), which keeps the region for good.
        let buf = HostRegion::into_vec(region).unwrap_or_default();
        (result, buf)
    }
}

/// Whether the engine of `runs` lends borrowed memory to reads of buffered files
/// (`Sizing::lends_buffered_reads`); a batch's files share one engine.
fn lends_buffered(runs: &[RunOf<'_>]) -> bool {
    runs.first()
        .is_none_or(|r| r.file.engine().shared().policy.lend_buffered)
}

/// One read of a run (in place, a part of it) into the region.
struct Job {
    run: usize,
    offset: u64,
    at: usize,
    len: usize,
    in_place: bool,
}

/// Reads every run into its range of `region`, at most a window's bytes at once: in place
/// where the file allows, in parts of a quarter of the engine's window (so a large run reports
/// progress as parts land and spreads over an engine's reactors); otherwise whole, through
/// bounce slots, and so are buffered runs unless `buffered_in_place`. Each run's outcome, in
/// order.
///
/// Cold data is read in place too, through the page cache, rather than O_DIRECT through
/// bounce slots as `read_into` does: on the 16-core H200 host a cold 4 GiB checkpoint loaded at
/// 1.68-1.78 GB/s in place against 1.26-1.33 with its cold parts through bounce slots
/// (BENCHMARKS.md, "Twenty-first session").
async fn read_region(
    runs: &[RunOf<'_>],
    region: &Arc<HostRegion>,
    progress: Option<&Arc<Progress>>,
    buffered_in_place: bool,
) -> Vec<Result<usize>> {
    let window = runs.first().map_or(0, |r| r.file.engine().op_window());
    // A multiple of 1 MiB keeps the parts of an aligned O_DIRECT run aligned.
    let part = ((window / 4) & !((1 << 20) - 1)).max(1 << 20);
    let mut jobs = Vec::new();
    for (i, r) in runs.iter().enumerate() {
        let (offset, at, len) = (r.run.offset, r.dst_offset(), r.len());
        let in_place = (buffered_in_place || r.file.is_direct())
            && r.file.lands_in_place(offset, len, region.addr(at));
        if !in_place {
            jobs.push(Job {
                run: i,
                offset,
                at,
                len,
                in_place: false,
            });
            continue;
        }
        let mut done = 0;
        while done < len {
            let n = part.min(len - done);
            jobs.push(Job {
                run: i,
                offset: offset + done as u64,
                at: at + done,
                len: n,
                in_place: true,
            });
            done += n;
        }
    }
    let lens: Vec<usize> = jobs.iter().map(|j| j.len).collect();
    let outcomes = run_bounded(&lens, window, |k| {
        let (j, file) = (&jobs[k], runs[jobs[k].run].file);
        let region = region.clone();
        async move {
            if !j.in_place {
                // SAFETY: the plan's runs are disjoint and inside the region (`runnable` kept
                // only those), and this run has no in-place part: no in-place read lands in
                // this range and no other slice of it exists. `region` keeps it allocated.
                let dst = unsafe { region.range_mut(j.at, j.len) };
                let read = file.read_into(dst, j.offset);
                return match progress {
                    Some(p) => read.with_progress(p).await,
                    None => read.await,
                };
            }
            let addr = region.addr(j.at);
            // SAFETY: the region clone keeps `addr..addr + len` allocated until the engine
            // gives it back; parts and runs are disjoint, so no other read or slice touches the
            // range; `lands_in_place` held for the run, and parts of it stay aligned.
            let (r, _back) =
                unsafe { file.read_in_place(j.offset, j.len, addr, Box::new(region)) }.await;
            if let (Some(p), Ok(n)) = (progress, &r) {
                p.add_done(*n as u64);
            }
            r
        }
    })
    .await;
    // A run's count is the bytes up to its first short part (the end of the file then): a
    // later part that found bytes (the file grew meanwhile) is not counted past the gap.
    let mut per_run: Vec<Result<usize>> = runs.iter().map(|_| Ok(0)).collect();
    let mut ended = vec![false; runs.len()];
    for (j, outcome) in jobs.iter().zip(outcomes) {
        let sum = &mut per_run[j.run];
        match (sum.as_mut(), outcome) {
            (Ok(_), Ok(_)) if ended[j.run] => {}
            (Ok(total), Ok(n)) => {
                *total += n;
                ended[j.run] = n < j.len;
            }
            (Ok(_), Err(e)) => *sum = Err(e),
            (Err(_), _) => {}
        }
    }
    per_run
}
