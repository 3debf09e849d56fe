//! What a caller asks of the reactor: one read, write or sync of a [`Target`], and the device
//! its memory lives on.

use std::sync::Arc;

use super::gate::Gated;
use crate::error::OpKind;
use crate::target::Target;

pub(crate) use crate::cuda::{DeviceCtx, device_number};

/// The device a transfer's caller memory lives on (`None`: host memory).
pub(crate) type DeviceHint = Option<DeviceCtx>;

/// Caller memory the reactor owns for the length of a read (`File::read_owned`): the kernel
/// reads straight into it, no bounce slot and no copy. The reactor holds `keep` (the owned
/// buffer, whose heap memory `addr` points into) until the kernel is done with every piece,
/// then hands it back through `OpShared`, or drops it if the future was dropped; it never
/// frees it while a piece may still land (a dead reactor leaks it instead).
pub(crate) struct OwnedTarget {
    /// Address of the buffer's first byte (file offset `offset` of the read).
    pub(crate) addr: usize,
    pub(crate) keep: Box<dyn std::any::Any + Send>,
}

/// Unfinished writes of one engine, counted per file identity (hashed into a few counters:
/// two files sharing one only make the fast path more careful, never less).
pub(crate) struct PendingWrites([std::sync::atomic::AtomicUsize; PENDING_SHARDS]);

const PENDING_SHARDS: usize = 64;

impl PendingWrites {
    pub(crate) fn new() -> Self {
        PendingWrites(std::array::from_fn(|_| {
            std::sync::atomic::AtomicUsize::new(0)
        }))
    }

    fn shard(key: &crate::target::FileKey) -> usize {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        (h.finish() % PENDING_SHARDS as u64) as usize
    }

    /// Whether a write of the file `key` (or of one sharing its counter) is unfinished.
    pub(crate) fn any(&self, key: &crate::target::FileKey) -> bool {
        self.0[Self::shard(key)].load(std::sync::atomic::Ordering::SeqCst) != 0
    }
}

/// A write not yet finished in the reactor, counted in its engine's [`PendingWrites`] under
/// its file: made with the write's future (on the caller's thread, so a read the caller
/// starts afterwards sees it), dropped when the reactor removes the op from its table, or
/// with the request where it never gets there. While one is out, small reads of that file
/// keep to the reactor, whose range fence orders them after every overlapping write piece in
/// the kernel (`op::cached`).
pub(crate) struct PendingWrite {
    all: Arc<PendingWrites>,
    shard: usize,
}

impl PendingWrite {
    pub(crate) fn new(all: &Arc<PendingWrites>, key: &crate::target::FileKey) -> Self {
        let shard = PendingWrites::shard(key);
        all.0[shard].fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        PendingWrite {
            all: all.clone(),
            shard,
        }
    }
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        self.all.0[self.shard].fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// What the caller asked for.
pub(crate) enum OpRequest {
    Read {
        file: Arc<Target>,
        offset: u64,
        len: u64,
        device: DeviceHint,
        /// Read straight into this owned buffer (host memory, aligned for the file).
        owned: Option<OwnedTarget>,
    },
    Write {
        file: Arc<Target>,
        offset: u64,
        len: u64,
        device: DeviceHint,
        pending: PendingWrite,
    },
    Sync {
        file: Arc<Target>,
    },
    /// Work already queued on a CUDA stream (a stream-ordered cuFile read or write, a stream
    /// sync): the op stays in the reactor's table until the gate behind the work opens, so
    /// shutdown and death account for it like any other op.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Await {
        kind: OpKind,
        file: Option<Arc<Target>>,
        offset: u64,
        /// The gate and, behind it, `Msg::Awaited` for this op.
        gated: Gated,
    },
}

impl OpRequest {
    pub(crate) fn op_kind(&self) -> OpKind {
        match self {
            OpRequest::Read { .. } => OpKind::Read,
            OpRequest::Write { .. } => OpKind::Write,
            OpRequest::Sync { .. } => OpKind::Sync,
            OpRequest::Await { kind, .. } => *kind,
        }
    }

    pub(crate) fn file(&self) -> Option<&Arc<Target>> {
        match self {
            OpRequest::Read { file, .. }
            | OpRequest::Write { file, .. }
            | OpRequest::Sync { file } => Some(file),
            OpRequest::Await { file, .. } => file.as_ref(),
        }
    }
}
