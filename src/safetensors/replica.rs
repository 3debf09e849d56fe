//! Replicated shards copied GPU to GPU ([`Replicas::ReadOnce`]): choosing that where the GPUs
//! reach each other directly, and queuing the copies once every rank's reads are done.
//!
//! Ordering: each copy is queued on the receiving rank's stream. cudarc makes that stream wait
//! for the source buffer's own stream (where the source rank's reads were copied in) and
//! records the destination's write event behind the copy. What cudarc does not cover, for
//! copies between contexts, is the source side: it records the source's read event on the
//! source's own stream, which the copy is not on. So the source's stream is made to wait for
//! every receiving stream afterwards, and freeing or overwriting the source (stream-ordered on
//! its own stream) cannot overtake a copy out of it.

use std::collections::BTreeSet;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DriverError};

use super::{ReplicaCopy, Replicas};
use crate::cuda::peer;

/// Whether to read replicated tensors once ([`Replicas::Auto`] resolved); where so, peer
/// access is turned on between every two of the streams' GPUs.
pub(super) fn read_once(streams: &[Arc<CudaStream>], replicas: Replicas) -> bool {
    let ctxs: Vec<_> = streams.iter().map(|s| s.context().clone()).collect();
    let pairs = || {
        ctxs.iter().enumerate().flat_map(|(i, a)| {
            ctxs[i + 1..]
                .iter()
                .filter(move |b| a.cu_device() != b.cu_device())
                .map(move |b| (a, b))
        })
    };
    let once = match replicas {
        Replicas::ReadEach => false,
        Replicas::ReadOnce => true,
        Replicas::Auto => pairs().all(|(a, b)| peer::can_access(a, b)),
    };
    if once {
        for (a, b) in pairs() {
            // Still correct without it: the driver stages the copies through host memory.
            if let Err(why) = peer::enable(a, b) {
                tracing::warn!("replicated shards will be copied through host memory: {why}");
            }
        }
    }
    once
}

/// Queues `copies` (each on its receiving rank's stream), then makes every source rank's
/// stream wait for the streams that copied out of its buffer (see the module docs).
pub(super) fn copy(
    streams: &[Arc<CudaStream>],
    bufs: &mut [CudaSlice<u8>],
    copies: &[ReplicaCopy],
) -> Result<(), DriverError> {
    let mut queued = Ok(());
    let mut pairs = BTreeSet::new();
    for c in copies {
        pairs.insert((c.from, c.to));
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
    for (from, to) in pairs {
        if !Arc::ptr_eq(&streams[from], &streams[to]) {
            joined = joined.and(streams[from].join(&streams[to]));
        }
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
