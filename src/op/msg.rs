//! The messages futures (and the engine) send the reactor, and [`ReactorHandle`], the sending
//! side every engine handle and future shares: an MPSC queue plus the doorbell that wakes a
//! sleeping reactor.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;

use super::engine_shared::StripedPresence;
use super::gate::Gated;
use super::request::OpRequest;
use super::{OpRef, OpShared, ReadyPieces};
use crate::error::{Context, Error, OpKind, Result};
use crate::lane::doorbell::Doorbell;

/// A submission. If it is dropped unprocessed (the reactor is gone), its op fails with
/// `Error::Shutdown` instead of leaving the future waiting forever.
pub(crate) struct SubmitMsg {
    pub(crate) shared: Option<Arc<OpShared>>,
    pub(crate) req: Option<OpRequest>,
}

impl SubmitMsg {
    /// Fails the op unprocessed with the error `why` makes of its context (once).
    pub(crate) fn refuse(&mut self, why: impl FnOnce(Context) -> Error) {
        if let Some(s) = self.shared.take() {
            let mut ctx = Context::op(self.req.as_ref().map_or(OpKind::Shutdown, |r| r.op_kind()));
            if let Some(r) = &mut self.req {
                if let Some(f) = r.file() {
                    ctx = ctx.with_path(&f.path);
                }
                // Never submitted: an owned buffer goes back untouched.
                if let OpRequest::Read { owned, .. } = r {
                    if let Some(o) = owned.take() {
                        s.give_back(o.keep);
                    }
                }
            }
            s.complete(Err(why(ctx)));
        }
    }
}

impl Drop for SubmitMsg {
    fn drop(&mut self) {
        self.refuse(Error::shutdown);
    }
}

/// Messages to the reactor.
pub(crate) enum Msg {
    Submit(SubmitMsg),
    /// Read slots whose data the future has copied out (no `Arc<OpShared>`: see [`OpRef`]).
    Release(OpRef, super::SlotList),
    /// Write slots the future has filled.
    Filled(Arc<OpShared>, ReadyPieces),
    /// The future was dropped before completion.
    Cancel(Arc<OpShared>),
    /// Stop; complete the carried op (if any) when fully drained.
    Shutdown(SubmitMsg),
    /// Act on the inner message once the gate opens (a CUDA copy has finished with the slots).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Gated(Gated),
    /// Pieces whose slots may still be in use by work nobody can track (a failed device copy):
    /// account for them, never reuse their slots.
    Abandon(Arc<OpShared>, ReadyPieces),
    /// A stream has passed work the op (in the table since its `OpRequest::Await`) waited
    /// for: always behind a gate.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Awaited(Arc<OpShared>, Awaited),
    /// Several messages behind one gate (the slots of one batch of reactor-issued copies).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Many(Vec<Msg>),
    /// Fault injection (tests): panic at the next completion (with I/O in flight), to prove
    /// that a reactor panic fails every pending future and leaves nothing hanging.
    PanicAtNextCompletion,
}

impl Msg {
    /// Gives back the slots of read pieces a future is done with.
    pub(crate) fn release(shared: &OpShared, pieces: ReadyPieces) -> Msg {
        Msg::Release(
            shared.op_ref(),
            pieces.into_iter().map(|p| p.slot).collect(),
        )
    }

    /// Whether the reactor must be woken for this message. Slot returns and cancellations
    /// only matter when the reactor waits for slots (see `Doorbell::ring_if_starved`); a
    /// gated message is as urgent as the message behind its gate.
    pub(crate) fn is_urgent(&self) -> bool {
        match self {
            Msg::Release(..) | Msg::Cancel(..) => false,
            Msg::Gated(g) => g.inner.as_ref().is_some_and(|m| m.is_urgent()),
            Msg::Many(m) => m.iter().any(Msg::is_urgent),
            _ => true,
        }
    }
}

/// What an awaited op was waiting for, and how its result is read once the stream is past it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum Awaited {
    /// A stream-ordered cuFile read or write: its result is in the parameter block cuFile
    /// wrote (which must outlive the stream's use of it: it is quarantined if the gate never
    /// opens).
    #[cfg(feature = "cuda")]
    Stream(crate::op::stream::StreamDone),
    /// The stream reached the point [`Engine::synchronize`](crate::Engine::synchronize) asked for.
    Idle,
    /// Tests: work that moved this many bytes.
    #[cfg(test)]
    Moved(u64),
}

impl Awaited {
    /// The op's result, read once the gate has opened.
    pub(crate) fn result(&self) -> Result<u64> {
        match self {
            #[cfg(feature = "cuda")]
            Awaited::Stream(done) => done.result(),
            Awaited::Idle => Ok(0),
            #[cfg(test)]
            Awaited::Moved(n) => Ok(*n),
        }
    }
}

/// The sending side of the reactor's channel, shared by every engine handle and future: the
/// MPSC queue, the doorbell that wakes a sleeping reactor, and whether anyone is still
/// listening (the reactor's death, an orderly stop, or a forked child). Nothing else: the
/// engine's policy and counters are in [`EngineShared`](super::engine_shared::EngineShared).
///
/// # Closing without a lock
/// Every future sends through the one `Sender` (twice per small read: the submission and the
/// slot's return), so it is never behind a lock: a mutex around it was contended by every
/// runtime thread at once (measured at QD128, BENCHMARKS "Fifteenth session"). Closing sets
/// `closed` and rings. A send reads `closed` and, finding it unset, is a section (`sending`):
/// enter, read `closed` again, push, leave. A send that finds `closed` set refuses its message
/// itself, naming the death where there was one (sends after the close never enter, so they
/// cannot keep the reactor waiting). The reactor, once it sees `closed`, waits for the sends
/// inside (`settle_sends`) and only then looks at the queue: every send that found the
/// channel open entered before the flag was set (both sides are sequentially consistent: the
/// sender enters, then reads the flag; the closer sets the flag, then the reactor reads the
/// stripes), so its message is in the queue by then, and "closed, then empty" means every
/// message sent before the close was taken, as when closing dropped the sender.
pub(crate) struct ReactorHandle {
    tx: Sender<Msg>,
    closed: AtomicBool,
    /// Sends under way (see the type's docs).
    sending: StripedPresence,
    pub(crate) doorbell: Arc<Doorbell>,
    dead: AtomicBool,
    /// Why the reactor died (a panic or a failed kernel interface); unset after an orderly stop.
    death: std::sync::OnceLock<String>,
    /// The process's fork count when the engine was built (`op::fork`): in a child of that
    /// process the engine refuses everything.
    fork_generation: u64,
}

impl ReactorHandle {
    pub(crate) fn new(tx: Sender<Msg>, doorbell: Arc<Doorbell>) -> Self {
        ReactorHandle {
            tx,
            closed: AtomicBool::new(false),
            sending: StripedPresence::default(),
            doorbell,
            dead: AtomicBool::new(false),
            death: std::sync::OnceLock::new(),
            fork_generation: super::fork::generation(),
        }
    }

    /// The reactor has stopped taking messages; `reason` where it died (not after an orderly
    /// stop). Closes the channel: what is sent from now on is refused.
    pub(crate) fn mark_dead(&self, reason: Option<String>) {
        if let Some(reason) = reason {
            let _ = self.death.set(reason);
        }
        self.dead.store(true, Ordering::SeqCst);
        self.close();
    }

    /// Whether the reactor has stopped (died or shut down).
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Why the reactor died, if it did.
    pub(crate) fn death(&self) -> Option<&str> {
        self.death.get().map(String::as_str)
    }

    /// The error for an operation the stopped engine cannot take: [`Error::ReactorDied`] with
    /// the reason where the reactor died, [`Error::Shutdown`] after an orderly stop.
    pub(crate) fn refusal(&self, ctx: Context) -> Error {
        if self.inherited() {
            return Error::Unsupported {
                ctx: Box::new(ctx),
                reason: super::fork::refusal_reason(),
            };
        }
        match self.death.get() {
            Some(reason) => Error::ReactorDied {
                ctx: Box::new(ctx),
                reason: reason.clone(),
            },
            None => Error::shutdown(ctx),
        }
    }

    /// Whether this process is a fork of the one that built the engine (`op::fork`).
    pub(crate) fn inherited(&self) -> bool {
        super::fork::inherited(self.fork_generation)
    }

    /// Whether the engine takes no more work here: its reactor has stopped, or this process
    /// is a forked child ([`refusal`](Self::refusal) says which).
    pub(crate) fn refuses_work(&self) -> bool {
        self.is_dead() || self.inherited()
    }

    /// Sends a message and rings the doorbell. A message to a closed or dead reactor (or from
    /// a forked child) is dropped, a submission refused.
    pub(crate) fn send(&self, msg: Msg) {
        let urgent = msg.is_urgent();
        let unsent = if self.inherited() {
            // No reactor here, and the doorbell is the parent's: refuse, ring nothing.
            Some(msg)
        } else if self.closed.load(Ordering::Acquire) {
            // Closed already: refused without entering the section, so sends after the
            // close (cancellations as futures drop, retries) never keep the reactor's
            // `settle_sends` waiting. Acquire: `mark_dead` sets the death before the flag,
            // and the refusal below names it.
            Some(msg)
        } else {
            let _inside = self.sending.enter();
            // Again inside the section: a close between the two reads is caught here, or
            // the reactor waits for this send (see the type's docs).
            if self.closed.load(Ordering::SeqCst) {
                Some(msg)
            } else {
                self.tx.send(msg).err().map(|e| e.0)
            }
        };
        if let Some(msg) = unsent {
            // The reactor is gone: a submission fails now, naming the death where there was
            // one (its Drop alone would say only "shut down").
            if let Msg::Submit(mut m) | Msg::Shutdown(mut m) = msg {
                m.refuse(|ctx| self.refusal(ctx));
            }
        } else {
            if urgent {
                self.doorbell.ring();
            } else {
                self.doorbell.ring_if_starved();
            }
        }
    }

    /// Closes the channel and wakes the reactor, which then sees it closed, drains and exits.
    /// Without the wake an idle reactor, asleep with no timeout, would never look.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.doorbell.ring_always();
    }

    /// Whether [`close`](Self::close) was called.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Waits until every send that found the channel open has put its message in the queue
    /// (the reactor, once it has seen [`is_closed`](Self::is_closed)): from then on the queue
    /// only shrinks, and once it is empty nothing sent before the close is missing.
    pub(crate) fn settle_sends(&self) {
        self.sending.wait_empty();
    }
}
