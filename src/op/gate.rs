//! Work that must wait for a CUDA event before the reactor acts on it: the [`Gate`] trait
//! (polled, never waited on) and [`Gated`], a message behind a gate.

use std::sync::Arc;

use super::msg::Msg;
use crate::buf::arena::BounceArena;

/// Something the reactor polls, never waits on, before acting (a CUDA event).
pub(crate) trait Gate: Send {
    fn poll(&self) -> GateState;
}

/// What a [`Gate`] says.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum GateState {
    /// Done: act on the message.
    Open,
    /// Not yet.
    Closed,
    /// It will never tell: leak what the message holds.
    Broken(String),
}

/// A message that must wait for a gate (a CUDA copy touching bounce slots) to open.
///
/// If it is dropped before the reactor acted on it (sent after the reactor exited, or left in
/// the queue of a reactor that died) while the copy may still run, the bounce pool is kept
/// mapped and pinned for good: a copy engine must never touch memory that was given back.
pub(crate) struct Gated {
    pub(crate) gate: Box<dyn Gate>,
    pub(crate) inner: Option<Box<Msg>>,
    /// The bounce pool the gated copy touches (`None`: stream work that touches none of it).
    arena: Option<Arc<BounceArena>>,
    /// Other memory the gated work touches (the device staging pool).
    keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Gated {
    pub(crate) fn new(gate: Box<dyn Gate>, inner: Msg, arena: &Arc<BounceArena>) -> Self {
        Gated {
            gate,
            inner: Some(Box::new(inner)),
            arena: Some(arena.clone()),
            keep: None,
        }
    }

    /// A message behind work queued on a stream that touches no bounce or staging memory
    /// (a stream-ordered cuFile op moves caller memory; a stream sync moves nothing): if it
    /// is dropped with the gate closed, only the message is quarantined, not the pools.
    pub(crate) fn stream_work(gate: Box<dyn Gate>, inner: Msg) -> Self {
        Gated {
            gate,
            inner: Some(Box::new(inner)),
            arena: None,
            keep: None,
        }
    }

    /// Also keeps `mem` alive (forever) if the gated work may outlive the reactor.
    pub(crate) fn keeping(mut self, mem: Option<Arc<dyn std::any::Any + Send + Sync>>) -> Self {
        self.keep = mem;
        self
    }

    /// The message behind the gate; the gate's copy is no longer this value's concern.
    pub(crate) fn take(&mut self) -> Option<Msg> {
        self.inner.take().map(|m| *m)
    }
}

impl Drop for Gated {
    fn drop(&mut self) {
        if self.inner.is_some() && !matches!(self.gate.poll(), GateState::Open) {
            // The work may still run: quarantine the memory it touches and the message itself
            // (stream operations keep their parameter block in it).
            crate::buf::quarantine::hold(
                "bounce pool, staging memory and message behind a CUDA copy that may still run \
                 (its message was dropped before a reactor saw the copy end)",
                (self.arena.clone(), self.keep.take(), self.inner.take()),
            );
        }
    }
}

/// A CUDA event as a gate (the impl lives here so that `cuda` knows nothing of ops).
#[cfg(feature = "cuda")]
impl Gate for crate::cuda::event::EventGate {
    fn poll(&self) -> GateState {
        match self.query() {
            Ok(true) => GateState::Open,
            Ok(false) => GateState::Closed,
            Err(why) => GateState::Broken(why),
        }
    }
}
