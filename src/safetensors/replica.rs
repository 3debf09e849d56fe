//! Replicated shards copied GPU to GPU ([`Replicas::ReadOnce`]): choosing that where the GPUs
//! reach each other directly, and queuing the copies once every rank's reads are done.
//!
//! Ordering, for each pair of ranks a copy runs between (`from` read the bytes, `to` receives
//! them), whatever cudarc tracks (it orders nothing between two streams of one context that
//! it does not know to be in use, and nothing with its event tracking off):
//! - before the copies, `to`'s stream waits for `from`'s, where the reads' copies into
//!   `from`'s buffer were queued; each copy then goes on `to`'s stream, where cudarc records
//!   the destination's write event behind it;
//! - after them, `from`'s stream waits for `to`'s, and the source buffer's read event is
//!   recorded again on `from`'s stream: cudarc records it, for a copy between contexts, on the
//!   source's own stream before the copy is queued, so without this a stream-ordered free of
//!   the source, or a write to it ordered by its events, could overtake a copy still reading it.

use std::collections::BTreeSet;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DriverError};

use super::{ReplicaCopy, Replicas};
use crate::cuda::peer;

/// Every two of the streams' GPUs (distinct devices, each pair once).
fn gpu_pairs(streams: &[Arc<CudaStream>]) -> Vec<(Arc<CudaContext>, Arc<CudaContext>)> {
    let mut pairs: Vec<(Arc<CudaContext>, Arc<CudaContext>)> = Vec::new();
    for (i, a) in streams.iter().enumerate() {
        for b in &streams[i + 1..] {
            let (a, b) = (a.context(), b.context());
            let seen = pairs.iter().any(|(x, y)| {
                let (x, y) = (x.cu_device(), y.cu_device());
                (x, y) == (a.cu_device(), b.cu_device()) || (y, x) == (a.cu_device(), b.cu_device())
            });
            if a.cu_device() != b.cu_device() && !seen {
                pairs.push((a.clone(), b.clone()));
            }
        }
    }
    pairs
}

/// Whether to read replicated tensors once ([`Replicas::Auto`] resolved: every two of the
/// streams' GPUs reach each other directly, both ways).
pub(super) fn read_once(streams: &[Arc<CudaStream>], replicas: Replicas) -> bool {
    match replicas {
        Replicas::ReadEach => false,
        Replicas::ReadOnce => true,
        Replicas::Auto => gpu_pairs(streams)
            .iter()
            .all(|(a, b)| peer::can_access(a, b) && peer::can_access(b, a)),
    }
}

/// Turns on peer access between every two of the streams' GPUs, before the copies.
pub(super) fn enable_peers(streams: &[Arc<CudaStream>]) {
    for (a, b) in gpu_pairs(streams) {
        // Still correct without it: the driver stages the copies through host memory.
        if let Err(why) = peer::enable(&a, &b) {
            tracing::warn!("replicated shards will be copied through host memory: {why}");
        }
    }
}

/// Queues `copies` (each on its receiving rank's stream) in the order the module docs give.
pub(super) fn copy(
    streams: &[Arc<CudaStream>],
    bufs: &mut [CudaSlice<u8>],
    copies: &[ReplicaCopy],
) -> Result<(), DriverError> {
    let pairs: BTreeSet<(usize, usize)> = copies
        .iter()
        .map(|c| (c.from, c.to))
        .filter(|&(f, t)| !Arc::ptr_eq(&streams[f], &streams[t]))
        .collect();
    for &(from, to) in &pairs {
        streams[to].join(&streams[from])?;
    }
    let mut queued = Ok(());
    for c in copies {
        let (src, dst) = two(bufs, c.from, c.to);
        let src = src.slice(c.src.clone());
        let mut dst = dst.slice_mut(c.dst_start..c.dst_start + c.src.len());
        queued = streams[c.to].memcpy_dtod(&src, &mut dst);
        if queued.is_err() {
            break;
        }
    }
    // Also after a failure: copies queued before it still read their sources.
    let mut joined = Ok(());
    for &(from, to) in &pairs {
        joined = joined.and(streams[from].join(&streams[to]));
    }
    for from in pairs.iter().map(|p| p.0).collect::<BTreeSet<_>>() {
        // Records the source's read event on its own stream, now behind every copy.
        drop(bufs[from].device_ptr(&streams[from]));
    }
    queued.and(joined)
}

/// `v[a]` shared and `v[b]` exclusive (`a != b`).
fn two<T>(v: &mut [T], a: usize, b: usize) -> (&T, &mut T) {
    assert_ne!(a, b, "a replica copy between a rank and itself");
    if a < b {
        let (lo, hi) = v.split_at_mut(b);
        (&lo[a], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(a);
        (&hi[0], &mut lo[b])
    }
}
