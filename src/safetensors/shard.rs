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
//! weights make many small reads; reading the span once and scattering it would be cheaper
//! there (not done yet).

use super::{Checkpoint, FileTensor, SafetensorsFile, Tensor};
use crate::batch::{BatchPlan, ReadDesc};
use crate::error::{Error, OpKind, Result};

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

impl SafetensorsFile {
    /// One batch per rank (`ranks` of them) that loads the tensors `rule` places, and where
    /// each shard lands in that rank's destination (`buffer_range`, with the shard's shape;
    /// `file_range` is the whole tensor's). `rule` returns `None` for tensors no rank loads.
    /// A rule that does not fit a tensor (a dimension it lacks, or one that does not divide
    /// evenly, a rank out of range) is an [`Error::InvalidInput`] naming the tensor.
    pub fn plan_shards(
        &self,
        ranks: usize,
        mut rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<Vec<(BatchPlan, Vec<Tensor>)>> {
        let bad = |at: u64, why: String| Error::invalid(self.file.ctx(OpKind::Read, at), why);
        if ranks == 0 {
            return Err(bad(
                0,
                "a tensor-parallel load needs at least one rank".into(),
            ));
        }
        let mut at = vec![0usize; ranks];
        let mut descs: Vec<Vec<ReadDesc>> = (0..ranks).map(|_| Vec::new()).collect();
        let mut placed: Vec<Vec<Tensor>> = (0..ranks).map(|_| Vec::new()).collect();
        for t in &self.tensors {
            let Some(shard) = rule(t) else {
                continue;
            };
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
                    descs[rank].push(ReadDesc::new(&self.file, offset, len, dst));
                    dst += len;
                }
                placed[rank].push(Tensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape,
                    file_range: t.file_range.clone(),
                    buffer_range: start..dst,
                });
                at[rank] = dst;
            }
        }
        Ok(descs.into_iter().map(BatchPlan::new).zip(placed).collect())
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
    /// queued on each rank's stream, as [`load_device`](Self::load_device) does.
    #[cfg(feature = "cuda")]
    pub async fn load_shards_device(
        &self,
        streams: &[std::sync::Arc<cudarc::driver::CudaStream>],
        rule: impl FnMut(&FileTensor) -> Option<Shard>,
    ) -> Result<Vec<Checkpoint<cudarc::driver::CudaSlice<u8>>>> {
        let plans = self.plan_shards(streams.len(), rule)?;
        let ctx = || self.file.ctx(OpKind::Read, 0).with_backend("cuda");
        let bufs = plans
            .iter()
            .zip(streams)
            .map(|((p, _), s)| s.alloc_zeros::<u8>(p.dst_len().max(1)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::cuda(ctx(), e))?;
        self.load_ranks(plans, bufs).await
    }

    /// Runs every rank's plan into its buffer, all at once, and wraps each buffer with its
    /// shards.
    async fn load_ranks<B: crate::buf::ReadDst>(
        &self,
        plans: Vec<(BatchPlan, Vec<Tensor>)>,
        mut bufs: Vec<B>,
    ) -> Result<Vec<Checkpoint<B>>> {
        let loads = plans
            .iter()
            .zip(bufs.iter_mut())
            .map(|((plan, _), buf)| Self::run(plan, buf));
        for r in futures::future::join_all(loads).await {
            r?;
        }
        Ok(bufs
            .into_iter()
            .zip(plans)
            .map(|(buf, (_, tensors))| Checkpoint::new(buf, tensors, self.file.path()))
            .collect())
    }
}
