//! A batch whose descriptors land in several destinations (one buffer per GPU, say): each
//! descriptor names its destination by index. The plan is one [`BatchPlan`] per destination,
//! prepared once; running it starts every destination's reads at once, each with its own
//! device's copies, and reports one result per descriptor in the order given.

use super::{BatchPlan, BatchResult, ReadDesc};
use crate::buf::ReadDst;
use crate::error::{Error, OpKind, Result};

/// Descriptors spread over `destinations` buffers, validated and merged per destination.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("pages.bin");
/// # std::fs::write(&path, (0..=255u8).cycle().take(1 << 16).collect::<Vec<u8>>())?;
/// # let rt = tokio::runtime::Runtime::new()?;
/// # rt.block_on(async {
/// use gpuio::batch::{ReadDesc, SpreadPlan};
/// let engine = gpuio::Engine::new()?;
/// let file = engine.open(&path)?;
/// // Page 1 to the first buffer, pages 2 and 3 to the second (merged into one read there).
/// let plan = SpreadPlan::new(
///     2,
///     vec![
///         (0, ReadDesc::new(&file, 4096, 4096, 0)),
///         (1, ReadDesc::new(&file, 2 * 4096, 4096, 0)),
///         (1, ReadDesc::new(&file, 3 * 4096, 4096, 4096)),
///     ],
/// );
/// let mut bufs: Vec<Vec<u8>> = (0..2).map(|d| vec![0u8; plan.dst_len(d)]).collect();
/// assert_eq!(plan.read_into(&mut bufs).await.total()?, 3 * 4096);
/// # Ok::<_, gpuio::Error>(()) })?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct SpreadPlan {
    /// One plan per destination, numbering its descriptors by their places in the caller's
    /// list (`BatchPlan::number`).
    parts: Vec<BatchPlan>,
    /// Descriptors naming a destination that does not exist: `(place, destination, desc)`.
    rejected: Vec<(usize, usize, ReadDesc)>,
    /// Descriptors given.
    count: usize,
}

impl SpreadPlan {
    /// Validates and merges `descs`, each `(destination, descriptor)`, per destination.
    /// Descriptors that cannot run (a destination index of `destinations` or more, or what
    /// [`BatchPlan::new`] refuses) are kept and reported as errors in every result, naming
    /// the descriptor by its place in `descs`; the others run.
    pub fn new(destinations: usize, descs: Vec<(usize, ReadDesc)>) -> Self {
        let count = descs.len();
        let mut parts: Vec<Vec<ReadDesc>> = (0..destinations).map(|_| Vec::new()).collect();
        let mut numbers: Vec<Vec<usize>> = vec![Vec::new(); destinations];
        let mut rejected = Vec::new();
        for (i, (to, d)) in descs.into_iter().enumerate() {
            match parts.get_mut(to) {
                Some(part) => {
                    part.push(d);
                    numbers[to].push(i);
                }
                None => rejected.push((i, to, d)),
            }
        }
        let parts = parts
            .into_iter()
            .zip(numbers)
            .map(|(part, n)| BatchPlan::numbered(part, Some(n)))
            .collect();
        SpreadPlan {
            parts,
            rejected,
            count,
        }
    }

    /// How many destinations the plan reads into.
    pub fn destinations(&self) -> usize {
        self.parts.len()
    }

    /// The plan for destination `d` (its descriptors, reads and length).
    pub fn part(&self, d: usize) -> Option<&BatchPlan> {
        self.parts.get(d)
    }

    /// Bytes destination `d` must hold at least (0 for a destination with no descriptors, or
    /// none by that index).
    pub fn dst_len(&self, d: usize) -> usize {
        self.parts.get(d).map_or(0, BatchPlan::dst_len)
    }

    /// The descriptors in the order given to [`new`](Self::new) (for
    /// [`BatchResult::exact`]).
    pub fn descs(&self) -> Vec<ReadDesc> {
        let mut all: Vec<Option<ReadDesc>> = (0..self.count).map(|_| None).collect();
        for part in &self.parts {
            for (j, d) in part.descs().iter().enumerate() {
                all[part.number(j)] = Some(d.clone());
            }
        }
        for (i, _, d) in &self.rejected {
            all[*i] = Some(d.clone());
        }
        all.into_iter().flatten().collect()
    }

    /// Runs every destination's part at once, part `d` into `dsts[d]` (host or device memory,
    /// on any GPU: each part queues its copies on its own destination's stream). One result
    /// per descriptor, in the order given to [`new`](Self::new). A `dsts` of another length
    /// than [`destinations`](Self::destinations) fails every descriptor with
    /// [`Error::InvalidInput`] and reads nothing.
    ///
    /// Dropping the future mid-flight is as safe as for [`BatchPlan::read_into`], and so is
    /// leaking it, with one difference in what a leak costs: each part runs within its own
    /// per-operation window (a quarter of the bounce pool), so a leaked spread over four or
    /// more destinations can hold the whole pool until the engine is dropped. Other reads then
    /// grow the pool or fail with [`Error::PoolExhausted`] (`EngineBuilder::bounce_growth`,
    /// `pool_wait_limit`), never wait forever.
    // The signature states the future is `Send` (an `async fn` would only imply it).
    #[allow(clippy::manual_async_fn)]
    pub fn read_into<'a, D: ReadDst + Send>(
        &'a self,
        dsts: &'a mut [D],
    ) -> impl std::future::Future<Output = BatchResult> + Send + 'a {
        async move { self.run(dsts, None).await }
    }

    /// [`read_into`](Self::read_into), reporting to `progress` as
    /// [`BatchPlan::read_into_with_progress`] does.
    #[allow(clippy::manual_async_fn)]
    pub fn read_into_with_progress<'a, D: ReadDst + Send>(
        &'a self,
        dsts: &'a mut [D],
        progress: &'a std::sync::Arc<crate::op::progress::Progress>,
    ) -> impl std::future::Future<Output = BatchResult> + Send + 'a {
        async move { self.run(dsts, Some(progress)).await }
    }

    async fn run<D: ReadDst + Send>(
        &self,
        dsts: &mut [D],
        progress: Option<&std::sync::Arc<crate::op::progress::Progress>>,
    ) -> BatchResult {
        // Every place is filled below: each descriptor is in one part or rejected.
        let mut results: Vec<Result<usize>> = (0..self.count).map(|_| Ok(0)).collect();
        for (i, to, d) in &self.rejected {
            results[*i] = Err(Error::invalid(
                d.file.ctx(OpKind::Read, d.offset),
                format!(
                    "batch descriptor {i}: destination {to} does not exist ({} destinations)",
                    self.parts.len()
                ),
            ));
        }
        if dsts.len() != self.parts.len() {
            for part in &self.parts {
                for (j, d) in part.descs().iter().enumerate() {
                    let i = part.number(j);
                    results[i] = Err(Error::invalid(
                        d.file.ctx(OpKind::Read, d.offset),
                        format!(
                            "batch descriptor {i}: {} destinations given to a plan for {}",
                            dsts.len(),
                            self.parts.len()
                        ),
                    ));
                }
            }
            return BatchResult { results };
        }
        let runs = self
            .parts
            .iter()
            .zip(dsts.iter_mut())
            .map(|(part, dst)| part.read_into_tracked(dst, progress));
        for (done, part) in futures::future::join_all(runs)
            .await
            .into_iter()
            .zip(&self.parts)
        {
            for (j, r) in done.into_results().into_iter().enumerate() {
                results[part.number(j)] = r;
            }
        }
        BatchResult { results }
    }
}
