//! Loading a checkpoint across the ranks of a tensor-parallel group: each tensor replicated on
//! every rank, split along one dimension into equal parts (rank `r` gets part `r`), or given
//! to one rank. Every rank's shards go into one buffer of its own (host memory, or memory on
//! the rank's GPU), and all ranks load at once. Each rank asks only for its own part of the
//! file, straight into its own buffer, with no copy between ranks (on an O_DIRECT file the
//! blocks at the parts' edges are read by both neighbours).
//!
//! A split along dimension 0 is one contiguous range of the file; along a later dimension it
//! is one range per index of the dimensions before it (a `[rows, cols]` weight split by
//! columns is `rows` reads of `cols / ranks` elements each). Those reads go in the rank's
//! batch, so small ones are served from the page cache on the polling thread where the file
//! is cached, and the rest in parallel through the engine. Into GPU memory, a split part whose
//! rows are short (under 64 KiB) is instead cut out of the whole tensor: the rank reads the
//! tensor in one piece into a scratch buffer on its GPU and copies its rows out with one
//! strided `cuMemcpy2DAsync` (`cuda::copy_rows`), up to 1 GiB of such whole tensors per rank
//! (`CUT_SCRATCH_MAX`; past it, row reads again). A row per read made a 4 GiB checkpoint with
//! 1 KiB rows load over two GPUs in 1.9 s warm; cut, it loads in 0.14 s (BENCHMARKS.md).

use std::ops::Range;
use std::path::Path;

use super::{Checkpoint, FileTensor, SafetensorsFile, Tensor};
use crate::batch::{BatchPlan, ReadDesc};
use crate::error::{Context, Error, OpKind, Result};
use crate::file::File;

/// Most ranks a tensor-parallel load takes: far above any tensor-parallel group in use (they
/// follow the GPUs of one NVLink domain), far below a count that sizes allocations absurdly.
pub const MAX_RANKS: usize = 4096;

/// Appends a copy, or extends the last one between the same two ranks where both ends
/// continue it.
fn add_copy(copies: &mut Vec<ReplicaCopy>, from: usize, src: Range<usize>, to: usize, dst: usize) {
    if let Some(c) = copies
        .iter_mut()
        .rev()
        .find(|c| c.from == from && c.to == to)
        .filter(|c| c.src.end == src.start && c.dst_start + c.src.len() == dst)
    {
        c.src.end = src.end;
        return;
    }
    copies.push(ReplicaCopy {
        from,
        src,
        to,
        dst_start: dst,
    });
}

/// Where a tensor goes in a tensor-parallel load ([`SafetensorsFile::plan_shards`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shard {
    /// Every rank gets the whole tensor.
    Replicate,
    /// Dimension `d` is cut into as many equal parts as there are ranks; rank `r` gets part
    /// `r`, with the tensor's shape except `shape[d] / ranks` at `d`. The dimension must
    /// divide evenly, and each part's rows must be whole bytes.
    Split(usize),
    /// Only rank `r` gets the tensor, whole.
    Only(usize),
}

/// Each shard starts at a multiple of this in its rank's buffer (the alignment kernels and
/// vectorised loads want).
const SHARD_ALIGN: usize = 256;

/// One rank's part of `t` under `shard`: its shape and the file ranges, in order, that make
/// it up (`None`: this rank gets nothing of it).
type Part = (Vec<usize>, Vec<(u64, usize)>);

fn part_of(
    t: &FileTensor,
    shard: Shard,
    rank: usize,
    ranks: usize,
) -> Result<Option<Part>, String> {
    // Checked: a hostile header's dimensions after a zero one are bounded by nothing else.
    let elems = t.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let bits = t.dtype.bitsize();
    if elems.and_then(|e| e.checked_mul(bits)) != Some(t.byte_len() * 8) {
        return Err(format!(
            "{:?} of shape {:?} is not the {} bytes the header gives it",
            t.dtype,
            t.shape,
            t.byte_len()
        ));
    }
    let whole = || (t.shape.clone(), vec![(t.file_range.start, t.byte_len())]);
    match shard {
        Shard::Replicate => Ok(Some(whole())),
        Shard::Only(r) if r >= ranks => Err(format!("rank {r} is not one of the {ranks} ranks")),
        Shard::Only(r) => Ok((r == rank).then(whole)),
        Shard::Split(d) => {
            let Some(&len) = t.shape.get(d) else {
                return Err(format!(
                    "cannot split dimension {d} of a tensor of shape {:?}",
                    t.shape
                ));
            };
            if len % ranks != 0 {
                return Err(format!(
                    "dimension {d} of shape {:?} ({len}) does not split into {ranks} equal parts",
                    t.shape
                ));
            }
            let part = len / ranks;
            let mut shape = t.shape.clone();
            shape[d] = part;
            if t.byte_len() == 0 {
                return Ok(Some((shape, Vec::new())));
            }
            // Every product below is at most elements x bits, which is 8 x the byte length.
            let outer: usize = t.shape[..d].iter().product();
            let inner_bits = t.shape[d + 1..].iter().product::<usize>() * bits;
            let (row_bits, stride_bits) = (part * inner_bits, len * inner_bits);
            if row_bits % 8 != 0 {
                return Err(format!(
                    "a part of dimension {d} of {:?} {:?} is {row_bits} bits, not whole bytes",
                    t.dtype, t.shape
                ));
            }
            let (row, stride) = (row_bits / 8, (stride_bits / 8) as u64);
            let first = t.file_range.start + (rank * row) as u64;
            let ranges = (0..outer as u64)
                .map(|o| (first + o * stride, row))
                .collect();
            Ok(Some((shape, ranges)))
        }
    }
}

/// How a tensor-parallel load onto GPUs gets the tensors every rank holds whole
/// ([`Shard::Replicate`]) into each rank's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Replicas {
    /// [`ReadOnce`](Self::ReadOnce) where every pair of the ranks' GPUs can reach each other
    /// directly ([`cuda::peer::can_access`](crate::cuda::peer::can_access)), else
    /// [`ReadEach`](Self::ReadEach).
    #[default]
    Auto,
    /// Each replicated tensor is read from the file by one rank (the ranks take equal shares
    /// of the replicated bytes, in file order), then copied from that rank's buffer into every
    /// other rank's, GPU to GPU. The file and the host-to-GPU links carry the bytes once; on
    /// the lent NVLink host the copies run at about 390 GB/s, several times the page cache's
    /// rate, so replicating onto two GPUs takes about as long as loading onto one.
    ReadOnce,
    /// Every rank reads every replicated tensor from the file itself: N times the reads, but
    /// no GPU-to-GPU traffic. Better where GPUs reach each other only through host memory.
    ReadEach,
}

impl std::str::FromStr for Replicas {
    type Err = String;

    /// `auto`, `once` or `each`, as the CLI and the examples spell them.
    fn from_str(s: &str) -> std::result::Result<Replicas, String> {
        match s {
            "auto" => Ok(Replicas::Auto),
            "once" => Ok(Replicas::ReadOnce),
            "each" => Ok(Replicas::ReadEach),
            _ => Err(format!("{s:?}: want auto, once or each")),
        }
    }
}

/// A replicated shard that rank `to` receives by copy from rank `from`'s buffer rather than
/// by reading the file ([`SafetensorsFile::plan_shards_read_once`]). Offsets are bytes in the
/// ranks' buffers; adjacent shards with the same two ranks are one copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaCopy {
    /// The rank that reads the bytes from the file.
    pub from: usize,
    /// Where they are in `from`'s buffer.
    pub src: std::ops::Range<usize>,
    /// The rank that receives them.
    pub to: usize,
    /// Where they go in `to`'s buffer (`src.len()` bytes).
    pub dst_start: usize,
}

/// Every rank's batch and shards, and the copies between ranks that complete them.
pub(crate) type ShardPlan = (Vec<(BatchPlan, Vec<Tensor>)>, Vec<ReplicaCopy>);

/// A split part with short rows (shorter than [`CUT_ROW_MAX`]) that its rank cuts out of the
/// whole tensor, read into the rank's scratch buffer in one piece, instead of reading each
/// row on its own: `rows` rows of `width` bytes, `pitch` apart from `src` in the scratch,
/// packed at `dst` in the rank's buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Cut {
    pub(crate) rank: usize,
    pub(crate) src: usize,
    pub(crate) pitch: usize,
    pub(crate) width: usize,
    pub(crate) rows: usize,
    pub(crate) dst: usize,
}

/// Rows shorter than this are cut out of the whole tensor on the GPU rather than read one by
/// one: a read per row costs a system call (and, where the bytes are not cached, an O_DIRECT
/// request widened to the block size), where reading the whole tensor costs the other ranks'
/// bytes too. A row-parallel `[4096, 1024]` bf16 weight over two ranks is 4096 rows of 1 KiB.
const CUT_ROW_MAX: usize = 64 << 10;
/// Most scratch memory one rank's cuts may take (the whole tensors they are cut from are in
/// memory at once): tensors past it are read row by row instead, so a large model's load
/// needs at most this much beside its shards (a 70B model at TP=8 would otherwise hold tens
/// of GiB of whole row-parallel weights per GPU).
const CUT_SCRATCH_MAX: usize = 1 << 30;
/// Largest row pitch a strided copy is given (the driver bounds pitches; far above any row of a
/// real tensor).
const CUT_PITCH_MAX: usize = 1 << 30;

/// What [`Listing::plan_ranks`] plans: per rank, its batch and shards; the copies
/// between ranks; per rank, the batch that reads whole tensors into its scratch buffer, and
/// the parts it cuts out of them.
pub(crate) struct RankPlans {
    pub(crate) ranks: Vec<(BatchPlan, Vec<Tensor>)>,
    pub(crate) copies: Vec<ReplicaCopy>,
    pub(crate) scratch: Vec<BatchPlan>,
    pub(crate) cuts: Vec<Cut>,
}

/// The tensors a tensor-parallel load plans, in order, each with the file it is in, and the
/// path errors name: one file's, or every shard's of a [`SafetensorsModel`].
pub(crate) struct Listing<'a> {
    pub(crate) entries: Vec<(&'a File, &'a FileTensor)>,
    pub(crate) path: &'a Path,
    /// Where the loads report the bytes they move.
    pub(crate) progress: Option<&'a std::sync::Arc<crate::op::progress::Progress>>,
}

impl Listing<'_> {
    /// One batch per rank (`ranks` of them) that loads the tensors `rule` places, and where
    /// each shard lands in that rank's destination (`buffer_range`, with the shard's shape;
    /// `file_range` is the whole tensor's). `rule` returns `None` for tensors no rank loads.
    /// A rule that does not fit a tensor (a dimension it lacks, or one that does not divide
    /// evenly, a rank out of range) is an [`Error::InvalidInput`] naming the tensor.
    /// Every rank reads its replicated tensors itself ([`Replicas::ReadEach`]).
    pub(crate) fn plan_shards(
        &self,
        ranks: usize,
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<Vec<(BatchPlan, Vec<Tensor>)>> {
        Ok(self.plan_ranks(ranks, rule, false, false)?.ranks)
    }

    /// As [`plan_shards`](SafetensorsFile::plan_shards), with every buffer laid out the same, except that
    /// each replicated tensor is read by one rank only ([`Replicas::ReadOnce`]): the copies
    /// that bring it to the other ranks come back alongside. Run them after the batches, on
    /// the receiving rank's stream.
    pub(crate) fn plan_shards_read_once(
        &self,
        ranks: usize,
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<ShardPlan> {
        let p = self.plan_ranks(ranks, rule, true, false)?;
        Ok((p.ranks, p.copies))
    }

    /// `read_once`: replicated tensors are read by one owner and copied to the others;
    /// `cut`: split parts with short rows are cut out of the whole tensor (device loads).
    pub(crate) fn plan_ranks(
        &self,
        ranks: usize,
        mut rule: impl FnMut(&FileTensor) -> Option<Shard>,
        read_once: bool,
        cut: bool,
    ) -> Result<RankPlans> {
        let bad = |at: u64, why: String| {
            Error::invalid(
                Context::op(OpKind::Read)
                    .with_path(&std::sync::Arc::from(self.path))
                    .with_offset(at),
                why,
            )
        };
        if ranks == 0 || ranks > MAX_RANKS {
            // Each rank costs a plan and a buffer description before any byte is read: a
            // mistyped count (2**40) would otherwise exhaust memory and abort the process.
            return Err(bad(
                0,
                format!(
                    "a tensor-parallel load of {ranks} ranks: want 1 to {MAX_RANKS} \
                     (one plan and one buffer per rank)"
                ),
            ));
        }
        let shards: Vec<Option<Shard>> = self.entries.iter().map(|(_, t)| rule(t)).collect();
        // Read once: replicated tensors go to owners in file order, equal shares of bytes, so
        // each owner's reads stay one contiguous stretch of the file.
        let replicated = |s: &Option<Shard>| read_once && ranks > 1 && *s == Some(Shard::Replicate);
        let total: u128 = (self.entries.iter().map(|(_, t)| t).zip(&shards))
            .filter(|(_, s)| replicated(s))
            .map(|(t, _)| t.byte_len() as u128)
            .sum();
        let mut before = 0u128;
        let mut at = vec![0usize; ranks];
        let mut descs: Vec<Vec<ReadDesc>> = (0..ranks).map(|_| Vec::new()).collect();
        let mut placed: Vec<Vec<Tensor>> = (0..ranks).map(|_| Vec::new()).collect();
        let mut copies: Vec<ReplicaCopy> = Vec::new();
        let mut scratch_at = vec![0usize; ranks];
        let mut scratch: Vec<Vec<ReadDesc>> = (0..ranks).map(|_| Vec::new()).collect();
        let mut cuts: Vec<Cut> = Vec::new();
        for (&(file, t), shard) in self.entries.iter().zip(shards) {
            let Some(shard) = shard else {
                continue;
            };
            let owner = (replicated(&Some(shard)) && t.byte_len() > 0).then(|| {
                let o = (before * ranks as u128 / total) as usize;
                before += t.byte_len() as u128;
                o
            });
            let mut starts = vec![None; ranks];
            for rank in 0..ranks {
                let part = part_of(t, shard, rank, ranks).map_err(|why| {
                    bad(t.file_range.start, format!("tensor {:?}: {why}", t.name))
                })?;
                let Some((shape, ranges)) = part else {
                    continue;
                };
                // An empty shard takes no room (and cannot land past the buffer's end).
                let bytes: usize = ranges.iter().map(|r| r.1).sum();
                let start = if bytes == 0 {
                    at[rank]
                } else {
                    at[rank].next_multiple_of(SHARD_ALIGN)
                };
                let mut dst = start;
                // Rows of a split part: `ranges` are equal, evenly spaced rows of the tensor.
                let pitch = match &ranges[..] {
                    [a, b, ..] => (b.0 - a.0) as usize,
                    _ => 0,
                };
                let whole = scratch_at[rank].next_multiple_of(SHARD_ALIGN);
                if cut
                    && whole + t.byte_len() <= CUT_SCRATCH_MAX
                    && ranges.len() > 1
                    && ranges[0].1 < CUT_ROW_MAX
                    && pitch > ranges[0].1
                    && pitch <= CUT_PITCH_MAX
                {
                    scratch[rank].push(ReadDesc::new(
                        file,
                        t.file_range.start,
                        t.byte_len(),
                        whole,
                    ));
                    scratch_at[rank] = whole + t.byte_len();
                    cuts.push(Cut {
                        rank,
                        src: whole + (ranges[0].0 - t.file_range.start) as usize,
                        pitch,
                        width: ranges[0].1,
                        rows: ranges.len(),
                        dst,
                    });
                    dst += bytes;
                } else {
                    for (offset, len) in ranges {
                        if owner.is_none_or(|o| o == rank) {
                            descs[rank].push(ReadDesc::new(file, offset, len, dst));
                        }
                        dst += len;
                    }
                }
                starts[rank] = Some(start);
                placed[rank].push(Tensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape,
                    file_range: t.file_range.clone(),
                    buffer_range: start..dst,
                });
                at[rank] = dst;
            }
            if let Some(from) = owner {
                let len = t.byte_len();
                let src = starts[from].expect("the owner holds the replicated tensor");
                for (to, start) in starts.iter().enumerate().filter(|(to, _)| *to != from) {
                    let dst_start = start.expect("every rank holds a replicated tensor");
                    add_copy(&mut copies, from, src..src + len, to, dst_start);
                }
            }
        }
        // A rank's buffer ends where its layout does, also where copies fill its tail.
        let plans = (descs.into_iter().zip(at))
            .map(|(d, end)| BatchPlan::new(d).reserve_dst(end))
            .zip(placed)
            .collect();
        Ok(RankPlans {
            ranks: plans,
            copies,
            scratch: scratch.into_iter().map(BatchPlan::new).collect(),
            cuts,
        })
    }

    /// Loads every rank's shards ([`plan_shards`](SafetensorsFile::plan_shards)) into a host buffer per
    /// rank, all ranks at once.
    pub(crate) async fn load_shards_host(
        &self,
        ranks: usize,
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<Vec<Checkpoint<Vec<u8>>>> {
        let plans = self.plan_shards(ranks, rule)?;
        for (p, _) in &plans {
            super::advise_sequential(p);
        }
        // Each rank's buffer is its batch's own while it runs: reads land in it in place.
        let loads = plans
            .iter()
            .map(|(p, _)| SafetensorsFile::run_to_vec(p, self.progress));
        let bufs = futures::future::join_all(loads)
            .await
            .into_iter()
            .collect::<Result<Vec<_>>>()?;
        Ok(self.wrap_ranks(bufs, plans))
    }

    /// Loads rank `r`'s shards into one allocation on `streams[r]`'s device (a rank per
    /// stream: one GPU each, or several ranks on one GPU), all ranks at once. The copies are
    /// queued on each rank's stream, as [`load_device`](SafetensorsFile::load_device) does. Replicated
    /// tensors are read once and copied between GPUs where they reach each other directly
    /// ([`Replicas::Auto`]).
    #[cfg(feature = "cuda")]
    pub(crate) async fn load_shards_device(
        &self,
        streams: &[std::sync::Arc<cudarc::driver::CudaStream>],
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<Vec<Checkpoint<cudarc::driver::CudaSlice<u8>>>> {
        self.load_shards_device_with(streams, rule, Replicas::Auto)
            .await
    }

    /// [`load_shards_device`](SafetensorsFile::load_shards_device), with the way replicated tensors
    /// reach every rank chosen by the caller.
    #[cfg(feature = "cuda")]
    pub(crate) async fn load_shards_device_with(
        &self,
        streams: &[std::sync::Arc<cudarc::driver::CudaStream>],
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
        replicas: Replicas,
    ) -> Result<Vec<Checkpoint<cudarc::driver::CudaSlice<u8>>>> {
        let read_once = super::replica::read_once(streams, replicas);
        let RankPlans {
            ranks: plans,
            copies,
            scratch: scratch_plans,
            cuts,
        } = self.plan_ranks(streams.len(), rule, read_once, true)?;
        if !copies.is_empty() {
            super::replica::enable_peers(streams);
        }
        let ctx = || {
            Context::op(OpKind::Read)
                .with_path(&std::sync::Arc::from(self.path))
                .with_backend("cuda")
        };
        let mut bufs = plans
            .iter()
            .zip(streams)
            .map(|((p, _), s)| s.alloc_zeros::<u8>(p.dst_len().max(1)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::cuda(ctx(), e))?;
        // Whole tensors that ranks cut short-rowed parts out of, on each rank's stream.
        let mut scratch = scratch_plans
            .iter()
            .zip(streams)
            .map(|(p, s)| s.alloc_zeros::<u8>(p.dst_len().max(1)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::cuda(ctx(), e))?;
        let scratch_runs = scratch_plans
            .iter()
            .zip(scratch.iter_mut())
            .filter(|(p, _)| !p.descs().is_empty())
            .map(|(p, buf)| SafetensorsFile::run(p, buf, self.progress));
        let (loaded, scratched) = futures::future::join(
            self.run_ranks(&plans, &mut bufs),
            futures::future::join_all(scratch_runs),
        )
        .await;
        loaded?;
        scratched.into_iter().collect::<Result<Vec<()>>>()?;
        for c in &cuts {
            let (s, buf, from) = (&streams[c.rank], &mut bufs[c.rank], &scratch[c.rank]);
            crate::cuda::copy_rows(s, buf, c.dst, from, c.src, c.pitch, c.width, c.rows)
                .map_err(|why| Error::cuda_msg(ctx(), why))?;
        }
        // The scratch buffers are freed on their ranks' streams, behind the cuts (cudarc
        // recorded their read events there).
        drop(scratch);
        super::replica::copy(streams, &mut bufs, &copies).map_err(|e| Error::cuda(ctx(), e))?;
        Ok(self.wrap_ranks(bufs, plans))
    }

    /// Runs every rank's plan into its buffer, all at once.
    async fn run_ranks<B: crate::buf::ReadDst>(
        &self,
        plans: &[(BatchPlan, Vec<Tensor>)],
        bufs: &mut [B],
    ) -> Result<()> {
        let loads = plans
            .iter()
            .zip(bufs.iter_mut())
            .map(|((plan, _), buf)| SafetensorsFile::run(plan, buf, self.progress));
        for r in futures::future::join_all(loads).await {
            r?;
        }
        Ok(())
    }

    fn wrap_ranks<B>(
        &self,
        bufs: Vec<B>,
        plans: Vec<(BatchPlan, Vec<Tensor>)>,
    ) -> Vec<Checkpoint<B>> {
        bufs.into_iter()
            .zip(plans)
            .map(|(buf, (_, tensors))| Checkpoint::new(buf, tensors, self.path))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cut planning, run on the host: whole tensors read into each rank's scratch, parts cut
    /// out row by row as the device copy would, must equal the parts read row by row.
    #[test]
    fn cuts_give_the_same_parts_as_row_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cut.safetensors");
        let mut rng = fastrand::Rng::with_seed(5);
        let shapes: [(&str, Vec<usize>); 3] =
            [("w", vec![64, 96]), ("v", vec![4, 6, 48]), ("n", vec![96])];
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = shapes
            .iter()
            .map(|(n, s)| {
                let len = s.iter().product::<usize>() * 2;
                (
                    n.to_string(),
                    s.clone(),
                    (0..len).map(|_| rng.u8(..)).collect(),
                )
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, s, b)| {
                let v =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b)
                        .unwrap();
                (n.clone(), v)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let engine = crate::Engine::new().unwrap();
            let st = SafetensorsFile::open(&engine, &path).await.unwrap();
            let rule = |t: &FileTensor| {
                Some(match t.name.as_str() {
                    "w" => Shard::Split(1),
                    "v" => Shard::Split(2),
                    _ => Shard::Replicate,
                })
            };
            for ranks in [1, 2, 3, 4] {
                let rows = st.listing().plan_ranks(ranks, rule, false, false).unwrap();
                let cut = st.listing().plan_ranks(ranks, rule, false, true).unwrap();
                assert!(rows.cuts.is_empty());
                assert_eq!(cut.cuts.is_empty(), ranks == 1, "{ranks} ranks");
                for r in 0..ranks {
                    let want = {
                        let (plan, _) = &rows.ranks[r];
                        let mut b = vec![0u8; plan.dst_len()];
                        plan.read_into(&mut b).await.exact(plan.descs()).unwrap();
                        b
                    };
                    let (plan, placed) = &cut.ranks[r];
                    assert_eq!(placed, &rows.ranks[r].1, "the same layout either way");
                    let mut got = vec![0u8; plan.dst_len()];
                    plan.read_into(&mut got).await.exact(plan.descs()).unwrap();
                    let sp = &cut.scratch[r];
                    let mut scratch = vec![0u8; sp.dst_len()];
                    sp.read_into(&mut scratch).await.exact(sp.descs()).unwrap();
                    for c in cut.cuts.iter().filter(|c| c.rank == r) {
                        for row in 0..c.rows {
                            let from = c.src + row * c.pitch;
                            let to = c.dst + row * c.width;
                            got[to..to + c.width].copy_from_slice(&scratch[from..from + c.width]);
                        }
                    }
                    assert!(got == want, "{ranks} ranks, rank {r}");
                }
            }
        });
    }
}
