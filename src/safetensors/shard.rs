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
//! is cached, and the rest in parallel through the engine. Narrow column splits of large
//! weights make many small reads, and they are slow: a 4 GiB checkpoint whose row-parallel
//! weights split into rows of 1 KiB loads over two GPUs in 1.9 s warm, against 0.11 s whole onto
//! one (BENCHMARKS.md). Reading each such tensor whole and cutting the part out on the GPU with
//! one strided copy is built on the `tp-cut` branch, waiting for a GPU run.

use std::ops::Range;

use super::{Checkpoint, FileTensor, SafetensorsFile, Tensor};
use crate::batch::{BatchPlan, ReadDesc};
use crate::error::{Error, OpKind, Result};

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
type ShardPlan = (Vec<(BatchPlan, Vec<Tensor>)>, Vec<ReplicaCopy>);

impl SafetensorsFile {
    /// One batch per rank (`ranks` of them) that loads the tensors `rule` places, and where
    /// each shard lands in that rank's destination (`buffer_range`, with the shard's shape;
    /// `file_range` is the whole tensor's). `rule` returns `None` for tensors no rank loads.
    /// A rule that does not fit a tensor (a dimension it lacks, or one that does not divide
    /// evenly, a rank out of range) is an [`Error::InvalidInput`] naming the tensor.
    /// Every rank reads its replicated tensors itself ([`Replicas::ReadEach`]).
    pub fn plan_shards(
        &self,
        ranks: usize,
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<Vec<(BatchPlan, Vec<Tensor>)>> {
        Ok(self.plan_ranks(ranks, rule, false)?.0)
    }

    /// As [`plan_shards`](Self::plan_shards), with every buffer laid out the same, except that
    /// each replicated tensor is read by one rank only ([`Replicas::ReadOnce`]): the copies
    /// that bring it to the other ranks come back alongside. Run them after the batches, on
    /// the receiving rank's stream.
    pub fn plan_shards_read_once(
        &self,
        ranks: usize,
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<ShardPlan> {
        self.plan_ranks(ranks, rule, true)
    }

    fn plan_ranks(
        &self,
        ranks: usize,
        mut rule: impl FnMut(&FileTensor) -> Option<Shard>,
        read_once: bool,
    ) -> Result<ShardPlan> {
        let bad = |at: u64, why: String| Error::invalid(self.file.ctx(OpKind::Read, at), why);
        if ranks == 0 {
            return Err(bad(
                0,
                "a tensor-parallel load needs at least one rank".into(),
            ));
        }
        let shards: Vec<Option<Shard>> = self.tensors.iter().map(&mut rule).collect();
        // Read once: replicated tensors go to owners in file order, equal shares of bytes, so
        // each owner's reads stay one contiguous stretch of the file.
        let replicated = |s: &Option<Shard>| read_once && ranks > 1 && *s == Some(Shard::Replicate);
        let total: u128 = (self.tensors.iter().zip(&shards))
            .filter(|(_, s)| replicated(s))
            .map(|(t, _)| t.byte_len() as u128)
            .sum();
        let mut before = 0u128;
        let mut at = vec![0usize; ranks];
        let mut descs: Vec<Vec<ReadDesc>> = (0..ranks).map(|_| Vec::new()).collect();
        let mut placed: Vec<Vec<Tensor>> = (0..ranks).map(|_| Vec::new()).collect();
        let mut copies: Vec<ReplicaCopy> = Vec::new();
        for (t, shard) in self.tensors.iter().zip(shards) {
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
                for (offset, len) in ranges {
                    if owner.is_none_or(|o| o == rank) {
                        descs[rank].push(ReadDesc::new(&self.file, offset, len, dst));
                    }
                    dst += len;
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
        Ok((plans, copies))
    }

    /// Loads every rank's shards ([`plan_shards`](Self::plan_shards)) into a host buffer per
    /// rank, all ranks at once.
    pub async fn load_shards_host(
        &self,
        ranks: usize,
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<Vec<Checkpoint<Vec<u8>>>> {
        let plans = self.plan_shards(ranks, rule)?;
        let bufs = plans.iter().map(|(p, _)| vec![0u8; p.dst_len()]).collect();
        self.load_ranks(plans, bufs).await
    }

    /// Loads rank `r`'s shards into one allocation on `streams[r]`'s device (a rank per
    /// stream: one GPU each, or several ranks on one GPU), all ranks at once. The copies are
    /// queued on each rank's stream, as [`load_device`](Self::load_device) does. Replicated
    /// tensors are read once and copied between GPUs where they reach each other directly
    /// ([`Replicas::Auto`]).
    #[cfg(feature = "cuda")]
    pub async fn load_shards_device(
        &self,
        streams: &[std::sync::Arc<cudarc::driver::CudaStream>],
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<Vec<Checkpoint<cudarc::driver::CudaSlice<u8>>>> {
        self.load_shards_device_with(streams, rule, Replicas::Auto)
            .await
    }

    /// [`load_shards_device`](Self::load_shards_device), with the way replicated tensors
    /// reach every rank chosen by the caller.
    #[cfg(feature = "cuda")]
    pub async fn load_shards_device_with(
        &self,
        streams: &[std::sync::Arc<cudarc::driver::CudaStream>],
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
        replicas: Replicas,
    ) -> Result<Vec<Checkpoint<cudarc::driver::CudaSlice<u8>>>> {
        let read_once = super::replica::read_once(streams, replicas);
        let (plans, copies) = self.plan_ranks(streams.len(), rule, read_once)?;
        if !copies.is_empty() {
            super::replica::enable_peers(streams);
        }
        let ctx = || self.file.ctx(OpKind::Read, 0).with_backend("cuda");
        let mut bufs = plans
            .iter()
            .zip(streams)
            .map(|((p, _), s)| s.alloc_zeros::<u8>(p.dst_len().max(1)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::cuda(ctx(), e))?;
        self.run_ranks(&plans, &mut bufs).await?;
        super::replica::copy(streams, &mut bufs, &copies).map_err(|e| Error::cuda(ctx(), e))?;
        Ok(self.wrap_ranks(bufs, plans))
    }

    /// Runs every rank's plan into its buffer, all at once, and wraps each buffer with its
    /// shards.
    async fn load_ranks<B: crate::buf::ReadDst>(
        &self,
        plans: Vec<(BatchPlan, Vec<Tensor>)>,
        mut bufs: Vec<B>,
    ) -> Result<Vec<Checkpoint<B>>> {
        self.run_ranks(&plans, &mut bufs).await?;
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
            .map(|((plan, _), buf)| Self::run(plan, buf));
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
            .map(|(buf, (_, tensors))| Checkpoint::new(buf, tensors, self.file.path()))
            .collect()
    }
}
