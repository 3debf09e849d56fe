//! Many reads as one: descriptor lists ([`ReadDesc`]), prepared plans ([`BatchPlan`]), and
//! named extents ([`Catalog`]).
//!
//! A batch reads many `(file, offset, length)` ranges into disjoint places of **one**
//! destination (host or device memory): every tensor of a checkpoint into one allocation, a set
//! of KV-cache pages into a staging buffer. Preparing a plan validates the descriptors once,
//! sorts them, and merges neighbours that are contiguous both in the file and in the
//! destination into one read; executing it starts the reads together (they reach the
//! backend's queue as one burst: io_uring submissions, a cuFile batch), as many at once as fit
//! in the engine's per-operation window (a quarter of the bounce pool, so a batch, even a
//! leaked one, never takes the whole pool), and resolves to one [`BatchResult`] with a result
//! per descriptor. A plan can run any number of times, into
//! the same or another destination of sufficient length. A [`SpreadPlan`] spreads one batch
//! over several destinations (a buffer on each GPU): each descriptor names its destination.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("pages.bin");
//! # std::fs::write(&path, (0..=255u8).cycle().take(1 << 16).collect::<Vec<u8>>())?;
//! # let rt = tokio::runtime::Runtime::new()?;
//! # rt.block_on(async {
//! use gpuio::batch::{BatchPlan, ReadDesc};
//! let engine = gpuio::Engine::new()?;
//! let file = engine.open(&path)?;
//! // Pages 3, 4 (contiguous: merged into one read) and 9, packed into 12 KiB.
//! let plan = BatchPlan::new(vec![
//!     ReadDesc::new(&file, 3 * 4096, 4096, 0),
//!     ReadDesc::new(&file, 4 * 4096, 4096, 4096),
//!     ReadDesc::new(&file, 9 * 4096, 4096, 8192),
//! ]);
//! assert_eq!(plan.reads(), 2);
//! let mut buf = vec![0u8; plan.dst_len()];
//! let done = plan.read_into(&mut buf).await;
//! assert_eq!(done.total()?, 3 * 4096);
//! # Ok::<_, gpuio::Error>(()) })?;
//! # Ok(()) }
//! ```

mod catalog;
#[cfg(feature = "cuda")]
mod device;
mod owned;
mod spread;

pub use catalog::{Catalog, Extent, RecordKind};
pub use spread::SpreadPlan;

use std::future::Future;
use std::sync::Arc;

use crate::buf::{ReadDst, ReadTarget};
use crate::error::{Error, OpKind, Result};
use crate::file::File;
use crate::op::progress::Progress;
use crate::plan::MAX_POS;

/// One range to read: `len` bytes of `file` at `offset`, to land at byte `dst_offset` of the
/// batch's destination.
#[derive(Debug, Clone)]
pub struct ReadDesc {
    /// The file to read.
    pub file: File,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: usize,
    /// Byte offset in the destination.
    pub dst_offset: usize,
}

impl ReadDesc {
    /// `len` bytes of `file` at `offset`, into the destination at `dst_offset`.
    pub fn new(file: &File, offset: u64, len: usize, dst_offset: usize) -> Self {
        ReadDesc {
            file: file.clone(),
            offset,
            len,
            dst_offset,
        }
    }
}

/// One read the plan issues: a run of descriptors contiguous in file and destination.
#[derive(Debug)]
pub(crate) struct Run {
    /// The descriptor whose file the run reads (its first member): the plan's descriptors
    /// hold the file, so a plan made for every batch clones no handle per run.
    file: usize,
    offset: u64,
    dst_offset: usize,
    len: usize,
    /// Indices (into the descriptor list) of the members, in file order.
    members: Vec<usize>,
}

/// A validated, sorted and merged descriptor list, ready to run many times.
#[derive(Debug)]
pub struct BatchPlan {
    descs: Vec<ReadDesc>,
    runs: Vec<Run>,
    /// Why a descriptor cannot run (checked once, at preparation).
    rejected: Vec<Option<String>>,
    dst_len: usize,
    /// The numbers errors give the descriptors, where not their places (`numbered`).
    numbers: Option<Vec<usize>>,
}

impl BatchPlan {
    /// Validates and merges `descs`. Descriptors that cannot run (an overflowing file or
    /// destination range, a destination range overlapping an earlier descriptor's) are kept
    /// and reported as errors in every result, with the reason; the others run.
    pub fn new(descs: Vec<ReadDesc>) -> Self {
        Self::numbered(descs, None)
    }

    /// [`new`](Self::new), with the numbers errors give the descriptors (`None`: their
    /// places in `descs`): a [`SpreadPlan`]'s part names descriptors as its caller numbered
    /// them.
    pub(crate) fn numbered(descs: Vec<ReadDesc>, numbers: Option<Vec<usize>>) -> Self {
        let number = |i: usize| numbers.as_ref().map_or(i, |n| n[i]);
        let mut rejected: Vec<Option<String>> = vec![None; descs.len()];
        for (i, d) in descs.iter().enumerate() {
            if d.offset
                .checked_add(d.len as u64)
                .is_none_or(|e| e > MAX_POS)
            {
                rejected[i] = Some(format!(
                    "offset {} + length {} passes the largest file offset",
                    d.offset, d.len
                ));
            } else if d.dst_offset.checked_add(d.len).is_none() {
                rejected[i] = Some(format!(
                    "destination offset {} + length {} overflows",
                    d.dst_offset, d.len
                ));
            }
        }
        // Destination overlaps: in destination order, a range starting before the end of the
        // furthest range so far collides with the descriptor that reached that end.
        let mut by_dst: Vec<usize> = (0..descs.len())
            .filter(|&i| rejected[i].is_none() && descs[i].len > 0)
            .collect();
        by_dst.sort_by_key(|&i| (descs[i].dst_offset, i));
        let mut reach: Option<(usize, usize)> = None; // (end, descriptor)
        for &i in &by_dst {
            let d = &descs[i];
            match reach {
                Some((end, j)) if d.dst_offset < end => {
                    rejected[i] = Some(format!(
                        "destination range {}..{} overlaps descriptor {}'s",
                        d.dst_offset,
                        d.dst_offset + d.len,
                        number(j)
                    ));
                }
                _ => reach = Some((d.dst_offset + d.len, i)),
            }
        }
        // Merge runs: same file, contiguous in both the file and the destination.
        let mut runs: Vec<Run> = Vec::new();
        for &i in by_dst.iter().filter(|&&i| rejected[i].is_none()) {
            let d = &descs[i];
            if let Some(r) = runs.last_mut() {
                if descs[r.file].file.same_file(&d.file)
                    && r.offset + r.len as u64 == d.offset
                    && r.dst_offset + r.len == d.dst_offset
                {
                    r.len += d.len;
                    r.members.push(i);
                    continue;
                }
            }
            runs.push(Run {
                file: i,
                offset: d.offset,
                dst_offset: d.dst_offset,
                len: d.len,
                members: vec![i],
            });
        }
        let dst_len = runs.iter().map(|r| r.dst_offset + r.len).max().unwrap_or(0);
        BatchPlan {
            descs,
            runs,
            rejected,
            dst_len,
            numbers,
        }
    }

    /// The descriptors, in the order given.
    pub fn descs(&self) -> &[ReadDesc] {
        &self.descs
    }

    /// Reads the plan issues (after merging).
    pub fn reads(&self) -> usize {
        self.runs.len()
    }

    /// Bytes of destination the runnable descriptors need (the end of the furthest one).
    pub fn dst_len(&self) -> usize {
        self.dst_len
    }

    /// The plan with [`dst_len`](Self::dst_len) at least `len`: for destinations that hold more
    /// than the plan's reads fill (bytes copied in from elsewhere), so that buffers sized by
    /// the plan have room for them.
    pub fn reserve_dst(mut self, len: usize) -> Self {
        self.dst_len = self.dst_len.max(len);
        self
    }

    /// Bytes the runnable descriptors read, at most.
    pub fn bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.len as u64).sum()
    }

    /// Runs the plan into `dst` (host or device memory, any [`ReadDst`]). Reads start at the
    /// first poll, within the engine's per-operation window. Descriptors past `dst`'s end fail with [`Error::InvalidInput`]; reads
    /// past end of file give short counts, as [`File::read_into`] does.
    ///
    /// Device destinations: the copies are queued on `dst`'s own stream, and cudarc's write
    /// event for `dst` is recorded behind them after every poll, so later uses of `dst` on any
    /// stream follow them. Dropping or leaking the future mid-flight is as safe as it is for
    /// single reads: nothing issues copies afterwards.
    // The signature states the future is `Send` (an `async fn` would only imply it).
    #[allow(clippy::manual_async_fn)]
    pub fn read_into<'a, D: ReadDst + ?Sized>(
        &'a self,
        dst: &'a mut D,
    ) -> impl Future<Output = BatchResult> + Send + 'a {
        self.read_into_tracked(dst, None)
    }

    /// [`read_into`](Self::read_into), reporting to `progress`: the bytes of every read that
    /// can run are added to its total when the batch starts, and to its count as they land.
    #[allow(clippy::manual_async_fn)]
    pub fn read_into_with_progress<'a, D: ReadDst + ?Sized>(
        &'a self,
        dst: &'a mut D,
        progress: &'a Arc<Progress>,
    ) -> impl Future<Output = BatchResult> + Send + 'a {
        self.read_into_tracked(dst, Some(progress))
    }

    #[allow(clippy::manual_async_fn)]
    pub(crate) fn read_into_tracked<'a, D: ReadDst + ?Sized>(
        &'a self,
        dst: &'a mut D,
        progress: Option<&'a Arc<Progress>>,
    ) -> impl Future<Output = BatchResult> + Send + 'a {
        async move {
            let dst_len = match dst.target() {
                ReadTarget::Host(b) => b.len(),
                #[cfg(feature = "cuda")]
                ReadTarget::Device(d) => d.byte_len(),
            };
            let (results, fit) = self.runnable(dst_len, progress);
            let outcomes = match dst.target() {
                ReadTarget::Host(buf) => read_host(&fit, buf, progress).await,
                #[cfg(feature = "cuda")]
                ReadTarget::Device(d) => device::read_batch_device(&fit, d, progress).await,
            };
            self.gather(&fit, outcomes, results)
        }
    }

    /// What a run into a destination of `dst_len` bytes starts from: the results of the
    /// descriptors that cannot run (rejected by the plan, empty, or past the destination's
    /// end), and the runs that can, whose bytes are added to `progress`'s total.
    fn runnable(
        &self,
        dst_len: usize,
        progress: Option<&Arc<Progress>>,
    ) -> (Vec<Option<Result<usize>>>, Vec<RunOf<'_>>) {
        let mut results: Vec<Option<Result<usize>>> = self
            .rejected
            .iter()
            .enumerate()
            .map(|(i, r)| r.as_ref().map(|why| Err(self.invalid(i, why.clone()))))
            .collect();
        for (i, d) in self.descs.iter().enumerate() {
            if results[i].is_none() && d.len == 0 {
                results[i] = Some(Ok(0));
            }
        }
        let (fit, too_far): (Vec<&Run>, Vec<&Run>) = self
            .runs
            .iter()
            .partition(|r| r.dst_offset + r.len <= dst_len);
        let fit: Vec<RunOf<'_>> = fit
            .into_iter()
            .map(|run| RunOf {
                run,
                file: &self.descs[run.file].file,
            })
            .collect();
        for r in too_far {
            for &m in &r.members {
                let d = &self.descs[m];
                let why = format!(
                    "destination range {}..{} is past the destination's {dst_len} bytes",
                    d.dst_offset,
                    d.dst_offset + d.len
                );
                results[m] = Some(Err(self.invalid(m, why)));
            }
        }
        if let Some(p) = progress {
            p.add_total(fit.iter().map(|r| r.len() as u64).sum());
        }
        (results, fit)
    }

    /// Hands each run's outcome to its descriptors: the batch's result.
    fn gather(
        &self,
        fit: &[RunOf<'_>],
        outcomes: Vec<Result<usize>>,
        mut results: Vec<Option<Result<usize>>>,
    ) -> BatchResult {
        for (r, outcome) in fit.iter().zip(outcomes) {
            distribute(r.run, outcome, &self.descs, &mut results);
        }
        BatchResult {
            results: results.into_iter().map(|r| r.unwrap_or(Ok(0))).collect(),
        }
    }

    /// The number errors give descriptor `i` (its place, unless the plan was `numbered`).
    pub(crate) fn number(&self, i: usize) -> usize {
        self.numbers.as_ref().map_or(i, |n| n[i])
    }

    fn invalid(&self, i: usize, why: String) -> Error {
        let d = &self.descs[i];
        let n = self.number(i);
        Error::invalid(
            d.file.ctx(OpKind::Read, d.offset),
            format!("batch descriptor {n}: {why}"),
        )
    }
}

/// A run of a plan being executed, with the file its descriptor holds.
#[derive(Clone, Copy)]
pub(crate) struct RunOf<'p> {
    run: &'p Run,
    file: &'p File,
}

impl<'p> RunOf<'p> {
    /// The run's read into `dst` (exactly `self.len()` bytes long), reporting to `progress`.
    pub(crate) fn read<'a, D: ReadDst + ?Sized>(
        &self,
        dst: &'a mut D,
        progress: Option<&Arc<Progress>>,
    ) -> crate::op::read::ReadInto<'a>
    where
        'p: 'a,
    {
        let read = self.file.read_into(dst, self.run.offset);
        match progress {
            Some(p) => read.with_progress(p),
            None => read,
        }
    }

    /// The error for this run when its device copies could not be queued.
    #[cfg(feature = "cuda")]
    pub(crate) fn copy_failed(&self, why: &str) -> Error {
        Error::cuda_msg(
            self.file
                .ctx(OpKind::Read, self.run.offset)
                .with_backend("cuda"),
            why.to_string(),
        )
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn dst_offset(&self) -> usize {
        self.run.dst_offset
    }

    pub(crate) fn len(&self) -> usize {
        self.run.len
    }
}

/// Host destination: disjoint sub-slices, read within the engine's window.
async fn read_host(
    runs: &[RunOf<'_>],
    buf: &mut [u8],
    progress: Option<&Arc<Progress>>,
) -> Vec<Result<usize>> {
    let mut pieces = Vec::with_capacity(runs.len());
    let mut rest = buf;
    let mut at = 0;
    // Runs are in destination order and disjoint (the plan guarantees it).
    for r in runs {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.dst_offset() - at);
        let (piece, tail) = tail.split_at_mut(r.len());
        rest = tail;
        at = r.dst_offset() + r.len();
        pieces.push(piece);
    }
    read_bounded(runs, pieces, progress).await
}

/// Reads `runs[i]` into `pieces[i]`, as many at once as fit in the first run's engine's
/// per-op window (at least one). A batch then holds no more bounce memory than one large
/// read, so even a leaked batch future leaves the rest of the pool to other operations.
pub(crate) async fn read_bounded<P: ReadDst + ?Sized>(
    runs: &[RunOf<'_>],
    pieces: Vec<&mut P>,
    progress: Option<&Arc<Progress>>,
) -> Vec<Result<usize>> {
    let window = runs.first().map_or(0, |r| r.file.engine().op_window());
    let lens: Vec<usize> = runs.iter().map(|r| r.len()).collect();
    let mut pieces: Vec<Option<&mut P>> = pieces.into_iter().map(Some).collect();
    run_bounded(&lens, window, |i| {
        let piece = pieces[i].take().expect("run_bounded starts each job once");
        runs[i].read(piece, progress)
    })
    .await
}

/// Runs jobs `0..lens.len()` (job `i` moves `lens[i]` bytes and is started by `start(i)`), as
/// many at once as fit in `window` bytes (at least one), in order; each job's result.
pub(crate) async fn run_bounded<F, Fut>(
    lens: &[usize],
    window: usize,
    mut start: F,
) -> Vec<Result<usize>>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<usize>>,
{
    use futures::StreamExt;
    let mut results: Vec<Option<Result<usize>>> = (0..lens.len()).map(|_| None).collect();
    let mut pending = futures::stream::FuturesUnordered::new();
    let (mut next, mut in_flight) = (0, 0usize);
    loop {
        while next < lens.len() && (in_flight == 0 || in_flight + lens[next] <= window) {
            in_flight += lens[next];
            let (i, job) = (next, start(next));
            next += 1;
            pending.push(async move { (i, job.await) });
        }
        match pending.next().await {
            Some((i, res)) => {
                in_flight -= lens[i];
                results[i] = Some(res);
            }
            None => break,
        }
    }
    results.into_iter().map(|r| r.unwrap_or(Ok(0))).collect()
}

/// Hands a run's outcome to its members: byte counts split in file order, an error to each.
fn distribute(
    run: &Run,
    outcome: Result<usize>,
    descs: &[ReadDesc],
    results: &mut [Option<Result<usize>>],
) {
    match outcome {
        Ok(mut got) => {
            for &m in &run.members {
                let n = got.min(descs[m].len);
                results[m] = Some(Ok(n));
                got -= n;
            }
        }
        Err(e) => {
            for &m in &run.members {
                results[m] = Some(Err(e.duplicate()));
            }
        }
    }
}

/// Device copies of batches issued together so far in this process: (driver flushes, copies).
/// Each flush queues every piece that landed since the batch's last poll, in one batched
/// driver call where the driver has one.
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub fn combined_copies() -> (u64, u64) {
    (
        crate::op::combine::FLUSHES.load(),
        crate::op::combine::COPIES.load(),
    )
}

/// What a batch did: one result per descriptor, in the order given.
#[derive(Debug)]
pub struct BatchResult {
    results: Vec<Result<usize>>,
}

impl BatchResult {
    /// Per-descriptor results: bytes read (short past end of file) or why not.
    pub fn results(&self) -> &[Result<usize>] {
        &self.results
    }

    /// The results, owned.
    pub fn into_results(self) -> Vec<Result<usize>> {
        self.results
    }

    /// Total bytes read, or the first descriptor's error.
    pub fn total(self) -> Result<usize> {
        self.results.into_iter().try_fold(0, |acc, r| Ok(acc + r?))
    }

    /// Like [`total`](Self::total), but a short read (end of file) is an error too: an
    /// [`Error::UnexpectedEof`] naming the first short descriptor's file and offset, its
    /// length and the bytes it got. `descs` are the descriptors the batch ran, in order.
    pub fn exact(self, descs: &[ReadDesc]) -> Result<usize> {
        let mut total = 0;
        for (r, d) in self.results.into_iter().zip(descs) {
            let n = r?;
            if n < d.len {
                return Err(Error::UnexpectedEof {
                    ctx: Box::new(d.file.ctx(OpKind::Read, d.offset)),
                    wanted: d.len as u64,
                    got: n as u64,
                });
            }
            total += n;
        }
        Ok(total)
    }
}
