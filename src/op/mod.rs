//! One operation as both sides see it: [`OpShared`] (the rendezvous between a future and the
//! reactor), the request (`request`), the messages about it (`msg`, `gate`), and the caller's
//! side, [`future::OpFuture`], generic over how data crosses into or out of caller memory
//! (`read`, `write`).

pub(crate) mod blocking;
pub(crate) mod cached;
#[cfg(feature = "cuda")]
pub(crate) mod combine;
#[cfg(feature = "cuda")]
pub(crate) mod device;
pub(crate) mod engine_shared;
pub(crate) mod fork;
pub(crate) mod future;
pub(crate) mod gate;
#[cfg(feature = "cuda")]
pub(crate) mod mapped;
pub(crate) mod msg;
pub(crate) mod occupancy;
pub(crate) mod progress;
pub(crate) mod read;
pub(crate) mod request;
#[cfg(feature = "cuda")]
pub(crate) mod stream;
#[cfg(feature = "cuda")]
pub(crate) mod sync;
pub(crate) mod write;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use crate::buf::arena::BounceSlot;
use crate::error::Result;
use crate::plan::Piece;

/// A piece of an operation handed to its future: read data waiting to be copied out, or an
/// empty slot waiting to be filled with data to write.
#[derive(Debug)]
pub(crate) struct ReadyPiece {
    pub(crate) piece: Piece,
    /// Bytes of the slot that hold file data at `piece.pos` (reads), or must be filled (writes).
    pub(crate) valid: usize,
    pub(crate) slot: BounceSlot,
}

impl ReadyPiece {
    /// Where this piece's valid bytes meet the caller's range: file bytes
    /// `[offset, offset + len)` held by the caller's buffer. Returns (offset in the slot,
    /// offset in the caller's buffer, bytes), or `None` if they do not meet.
    pub(crate) fn overlap(&self, offset: u64, len: usize) -> Option<(usize, u64, usize)> {
        let start = self.piece.pos.max(offset);
        let end = (self.piece.pos + self.valid as u64).min(offset + len as u64);
        (start < end).then(|| {
            (
                (start - self.piece.pos) as usize,
                start - offset,
                (end - start) as usize,
            )
        })
    }
}

/// Pieces handed over at once, between the reactor and a future. Most ops have one or two, so
/// they sit inline: a `Vec` allocated on one thread and freed on another takes the allocator's
/// arena lock on every small read (measured: a sixth of the reactor's time on 4 KiB reads).
pub(crate) type ReadyPieces = smallvec::SmallVec<[ReadyPiece; 2]>;

/// Slots a future gives back at once (inline for the same reason as [`ReadyPieces`]).
pub(crate) type SlotList = smallvec::SmallVec<[BounceSlot; 2]>;

/// The device staging memory an op's cuFile pieces land in: its base address, and the pool
/// itself, kept alive by whatever gated copy still reads it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct DeviceStaging {
    pub(crate) base: u64,
    pub(crate) keep: Arc<dyn std::any::Any + Send + Sync>,
}

/// State behind the mutex.
#[derive(Default)]
pub(crate) struct OpState {
    pub(super) waker: Option<Waker>,
    pub(super) ready: ReadyPieces,
    pub(super) result: Option<Result<u64>>,
    /// An owned buffer handed back by the reactor (set before the result).
    owned: Option<Box<dyn std::any::Any + Send>>,
}

/// Names an op in the reactor's table without holding its [`OpShared`]: the slab key and the
/// serial number the reactor gave the op when it took it (keys are reused, serials never).
///
/// Slot returns carry this instead of an `Arc<OpShared>`. The future's own `Arc` is then
/// usually the last one, so the op's memory is freed on the thread that allocated it; freed by
/// the reactor, every small read would take the allocator's lock of a runtime thread's arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpRef {
    pub(crate) key: usize,
    pub(crate) serial: u64,
}

/// The rendezvous of one operation.
pub(crate) struct OpShared {
    /// Reactor-assigned slab key (usize::MAX until the reactor accepted the op).
    pub(crate) key: AtomicUsize,
    /// Reactor-assigned serial number (u64::MAX until the reactor accepted the op).
    pub(crate) serial: AtomicU64,
    state: Mutex<OpState>,
    /// The device staging pool, for ops whose pieces cuFile moves (set by the reactor before
    /// it hands over any device slot; never set without CUDA).
    pub(crate) staging: std::sync::OnceLock<DeviceStaging>,
}

impl OpShared {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(OpShared {
            key: AtomicUsize::new(usize::MAX),
            serial: AtomicU64::new(u64::MAX),
            state: Mutex::new(OpState::default()),
            staging: std::sync::OnceLock::new(),
        })
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, OpState> {
        // The state is updated in single assignments; a panic elsewhere cannot leave it torn.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn key(&self) -> usize {
        self.key.load(Ordering::Relaxed)
    }

    /// The op's name in the reactor's table. Read by a future only after the reactor handed it
    /// a piece (through this op's mutex), so both numbers are the reactor's.
    pub(crate) fn op_ref(&self) -> OpRef {
        OpRef {
            key: self.key.load(Ordering::Relaxed),
            serial: self.serial.load(Ordering::Relaxed),
        }
    }

    /// Reactor: hand a piece to the future. Wakes it if it was waiting.
    pub(crate) fn push_ready(&self, p: ReadyPiece) {
        drop(self.hand_ready(p));
    }

    /// Reactor: hand a piece to the future, which is woken when the returned value is dropped,
    /// once the caller has settled the op's state. When the piece is the op's last, waking
    /// after the result is set too means one wake instead of two (a future woken for the piece
    /// alone would find no result, wait again, and need a second wake from another thread).
    pub(crate) fn hand_ready(&self, p: ReadyPiece) -> DeferredWake {
        let mut st = self.lock();
        st.ready.push(p);
        DeferredWake(st.waker.take())
    }

    /// Reactor: hands an owned buffer back, once no I/O can touch it (before `complete`).
    pub(crate) fn give_back(&self, buf: Box<dyn std::any::Any + Send>) {
        self.lock().owned = Some(buf);
    }

    /// Future: the owned buffer the reactor handed back, if it did.
    pub(crate) fn take_back(&self) -> Option<Box<dyn std::any::Any + Send>> {
        self.lock().owned.take()
    }

    /// Reactor: take back pieces the future has not picked up (cancel, shutdown).
    pub(crate) fn reclaim_ready(&self) -> ReadyPieces {
        std::mem::take(&mut self.lock().ready)
    }

    /// Tests: the result, if set, as text (taking nothing).
    #[cfg(test)]
    pub(crate) fn peek_result(&self) -> Option<std::result::Result<u64, String>> {
        self.lock()
            .result
            .as_ref()
            .map(|r| r.as_ref().map(|n| *n).map_err(|e| e.to_string()))
    }

    /// Sets the result (first one wins) and wakes the future.
    pub(crate) fn complete(&self, r: Result<u64>) {
        let waker = {
            let mut st = self.lock();
            if st.result.is_none() {
                st.result = Some(r);
            }
            st.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// A future's waker taken out of its op, woken when this is dropped: on the normal path after
/// the reactor has settled the op, and on a panic's unwinding too, so that a panic in between
/// costs no more than it did with an immediate wake. (As before, a panic inside `maybe_finish`
/// after the op left the table and before its result was set would leave the future waiting;
/// nothing there is expected to panic.)
#[must_use = "dropping it at once wakes the future now"]
pub(crate) struct DeferredWake(Option<Waker>);

impl Drop for DeferredWake {
    fn drop(&mut self) {
        if let Some(w) = self.0.take() {
            w.wake();
        }
    }
}

/// Result of a read or write as the caller sees it.
pub(crate) fn to_usize(r: Result<u64>) -> Result<usize> {
    r.map(|n| n as usize)
}
