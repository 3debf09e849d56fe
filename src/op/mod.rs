//! One operation as both sides see it: [`OpShared`] (the rendezvous between a future and the
//! reactor), the request (`request`), the messages about it (`msg`, `gate`), and the caller's
//! side, [`future::OpFuture`], generic over how data crosses into or out of caller memory
//! (`read`, `write`).

pub(crate) mod cached;
#[cfg(feature = "cuda")]
pub(crate) mod combine;
#[cfg(feature = "cuda")]
pub(crate) mod device;
pub(crate) mod future;
pub(crate) mod gate;
pub(crate) mod msg;
pub(crate) mod occupancy;
pub(crate) mod read;
pub(crate) mod request;
#[cfg(feature = "cuda")]
pub(crate) mod stream;
#[cfg(feature = "cuda")]
pub(crate) mod sync;
pub(crate) mod write;

use std::sync::atomic::{AtomicUsize, Ordering};
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

/// The device staging memory an op's cuFile pieces land in: its base address, and the pool
/// itself, kept alive by whatever gated copy still reads it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Staging {
    pub(crate) base: u64,
    pub(crate) keep: Arc<dyn std::any::Any + Send + Sync>,
}

/// State behind the mutex.
#[derive(Default)]
pub(crate) struct OpState {
    pub(super) waker: Option<Waker>,
    pub(super) ready: Vec<ReadyPiece>,
    pub(super) result: Option<Result<u64>>,
    /// An owned buffer handed back by the reactor (set before the result).
    owned: Option<Box<dyn std::any::Any + Send>>,
}

/// The rendezvous of one operation.
pub(crate) struct OpShared {
    /// Reactor-assigned slab key (usize::MAX until the reactor accepted the op).
    pub(crate) key: AtomicUsize,
    state: Mutex<OpState>,
    /// The device staging pool, for ops whose pieces cuFile moves (set by the reactor before
    /// it hands over any device slot).
    #[cfg(feature = "cuda")]
    pub(crate) staging: std::sync::OnceLock<Staging>,
}

impl OpShared {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(OpShared {
            key: AtomicUsize::new(usize::MAX),
            state: Mutex::new(OpState::default()),
            #[cfg(feature = "cuda")]
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

    /// Reactor: hand a piece to the future. Wakes it if it was waiting.
    pub(crate) fn push_ready(&self, p: ReadyPiece) {
        let waker = {
            let mut st = self.lock();
            st.ready.push(p);
            st.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
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
    pub(crate) fn reclaim_ready(&self) -> Vec<ReadyPiece> {
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

/// Result of a read or write as the caller sees it.
pub(crate) fn to_usize(r: Result<u64>) -> Result<usize> {
    r.map(|n| n as usize)
}
