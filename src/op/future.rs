//! [`OpFuture`]: the caller's side of one operation, and [`Transfer`], how its data crosses
//! into or out of caller memory.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use super::engine_shared::EngineShared;
use super::msg::{Msg, SubmitMsg};
use super::progress::{OpProgress, Progress};
use super::request::OpRequest;
use super::{OpShared, ReadyPieces};
use crate::error::{Context, Error, OpKind, Result};
use crate::target::FileKey;

/// How a future moves data between bounce slots and caller memory.
pub(crate) trait Transfer: Send + Unpin {
    /// Handles pieces the reactor handed over, returning the message that gives the slots back.
    /// The default is for operations that move no data through slots: none should come, and
    /// any that do go straight back.
    fn transfer(
        &mut self,
        pieces: ReadyPieces,
        _engine: &Arc<EngineShared>,
        shared: &Arc<OpShared>,
    ) -> Option<Msg> {
        debug_assert!(pieces.is_empty());
        (!pieces.is_empty()).then(|| Msg::release(shared, pieces))
    }

    /// An error the transfer hit (a failed device copy); the op then fails with it.
    fn take_error(&mut self) -> Option<Error> {
        None
    }

    /// Called once the op's result is in, before the future returns it.
    fn finish(&mut self, _shared: &Arc<OpShared>) {}
}

/// Host or device side of a transfer: one future type serves both.
pub(crate) enum Either<H, D> {
    Host(H),
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device(D),
}

impl<H: Transfer, D: Transfer> Transfer for Either<H, D> {
    fn transfer(
        &mut self,
        pieces: ReadyPieces,
        engine: &Arc<EngineShared>,
        shared: &Arc<OpShared>,
    ) -> Option<Msg> {
        match self {
            Either::Host(t) => t.transfer(pieces, engine, shared),
            Either::Device(t) => t.transfer(pieces, engine, shared),
        }
    }

    fn take_error(&mut self) -> Option<Error> {
        match self {
            Either::Host(t) => t.take_error(),
            Either::Device(t) => t.take_error(),
        }
    }

    fn finish(&mut self, shared: &Arc<OpShared>) {
        match self {
            Either::Host(t) => t.finish(shared),
            Either::Device(t) => t.finish(shared),
        }
    }
}

/// Operations that move no data through slots (fsync, shutdown).
pub(crate) struct NoTransfer;

impl Transfer for NoTransfer {}

enum OpState {
    /// Not yet sent to the reactor (futures are lazy).
    Unsent(Msg),
    /// Sent; waiting for pieces and the result.
    Running(Arc<OpShared>),
    /// Finished before reaching the reactor (invalid or empty request).
    Ready(Result<u64>),
    /// Result returned to the caller.
    Done,
}

/// Rounds of "take pieces, copy, give slots back" one `poll` may run before yielding.
const MAX_ROUNDS_PER_POLL: usize = 8;

/// The caller's side of one operation.
pub(crate) struct OpFuture<T: Transfer> {
    engine: Arc<EngineShared>,
    /// A read's file's home reactor where it is not `engine` (`engine::reactors`): the read
    /// is sent there instead if a write of the file is unfinished at its first poll.
    home: Option<(Arc<EngineShared>, FileKey)>,
    state: OpState,
    transfer: T,
    op: OpKind,
    /// Where the op reports the bytes it moves (`track`).
    progress: Option<OpProgress>,
}

impl<T: Transfer> OpFuture<T> {
    /// Reports the bytes this op moves, at most `len` (its range), to `progress`.
    pub(crate) fn track(&mut self, progress: &Arc<Progress>, len: u64) {
        self.progress = Some(OpProgress::new(progress, len));
    }

    /// Reports to `progress` (an op share made before the op was: `ReadInto`'s first poll).
    pub(crate) fn set_progress(&mut self, progress: Option<OpProgress>) {
        self.progress = progress;
    }

    /// Counts what the pieces did not of an op that ended with `r`.
    fn count_result(&mut self, r: &Result<u64>) {
        if let (Some(p), Ok(moved)) = (&mut self.progress, r) {
            p.finish(*moved);
        }
    }

    /// Sends the op to `home` instead if, at its first poll, a write of file `key` is
    /// unfinished (a read routed away from its file's home reactor: `engine::reactors`).
    pub(crate) fn with_home(mut self, home: Option<(Arc<EngineShared>, FileKey)>) -> Self {
        self.home = home;
        self
    }

    /// The reactor handle the op is (or will be) sent to (tests of the routing).
    #[cfg(test)]
    pub(crate) fn engine(&self) -> &Arc<EngineShared> {
        &self.engine
    }

    /// The transfer, to adjust before the first poll or to read back after the result.
    pub(crate) fn transfer_mut(&mut self) -> &mut T {
        &mut self.transfer
    }

    /// A future for `req`, sent on first poll.
    pub(crate) fn new(engine: Arc<EngineShared>, req: OpRequest, transfer: T) -> Self {
        let op = req.op_kind();
        let msg = Msg::Submit(SubmitMsg {
            shared: None,
            req: Some(req),
        });
        Self::with_message(engine, op, transfer, msg)
    }

    /// A future for a message that carries the op's `OpShared` (shutdown).
    pub(crate) fn with_message(
        engine: Arc<EngineShared>,
        op: OpKind,
        transfer: T,
        msg: Msg,
    ) -> Self {
        OpFuture {
            engine,
            home: None,
            state: OpState::Unsent(msg),
            transfer,
            op,
            progress: None,
        }
    }

    /// A future for an op whose work was queued elsewhere already (stream-ordered cuFile I/O):
    /// it waits for `shared` to complete.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn running(
        engine: Arc<EngineShared>,
        op: OpKind,
        transfer: T,
        shared: Arc<OpShared>,
    ) -> Self {
        OpFuture {
            engine,
            home: None,
            state: OpState::Running(shared),
            transfer,
            op,
            progress: None,
        }
    }

    /// A future that is already finished with `r` (validation failures, empty requests).
    pub(crate) fn ready(
        engine: Arc<EngineShared>,
        op: OpKind,
        transfer: T,
        r: Result<u64>,
    ) -> Self {
        OpFuture {
            engine,
            home: None,
            state: OpState::Ready(r),
            transfer,
            op,
            progress: None,
        }
    }
}

impl<T: Transfer> Future for OpFuture<T> {
    type Output = Result<u64>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<u64>> {
        let this = &mut *self;
        if let OpState::Unsent(_) = this.state {
            let OpState::Unsent(mut msg) = std::mem::replace(&mut this.state, OpState::Done) else {
                unreachable!()
            };
            let shared = OpShared::new();
            // Register the waker before the reactor can see the op.
            shared.lock().waker = Some(cx.waker().clone());
            match &mut msg {
                Msg::Submit(s) | Msg::Shutdown(s) => {
                    s.shared = Some(shared.clone());
                }
                _ => {}
            }
            // A write of the file started before this read (its count is taken on the writer's
            // thread before its future exists): the read goes where that write's pieces are,
            // so the range fence orders it after them.
            if let Some((home, key)) = this.home.take() {
                if home.writes_pending.any(&key) {
                    this.engine = home;
                }
            }
            // If the reactor is gone the message is dropped, and dropping a SubmitMsg completes
            // its op with `Error::Shutdown`, so the loop below returns instead of hanging.
            this.engine.reactor.send(msg);
            this.state = OpState::Running(shared);
        }
        let shared = match &this.state {
            OpState::Running(s) => s.clone(),
            OpState::Ready(_) => {
                let OpState::Ready(r) = std::mem::replace(&mut this.state, OpState::Done) else {
                    unreachable!()
                };
                this.count_result(&r);
                return Poll::Ready(r);
            }
            OpState::Done => {
                return Poll::Ready(Err(Error::invalid(
                    Context::op(this.op),
                    "future polled after it completed",
                )));
            }
            OpState::Unsent(_) => unreachable!(),
        };
        // A busy op could keep one poll copying for as long as the reactor feeds it; yield to
        // the executor after a few rounds so other tasks on this thread get their turn.
        for _ in 0..MAX_ROUNDS_PER_POLL {
            let (pieces, result) = {
                let mut st = shared.lock();
                let pieces = std::mem::take(&mut st.ready);
                let result = st.result.take();
                if pieces.is_empty() && result.is_none() {
                    match &st.waker {
                        Some(w) if w.will_wake(cx.waker()) => {}
                        _ => st.waker = Some(cx.waker().clone()),
                    }
                    return Poll::Pending;
                }
                (pieces, result)
            };
            if !pieces.is_empty() {
                if let Some(p) = &mut this.progress {
                    p.add(pieces.iter().map(|p| p.valid as u64).sum());
                }
                if let Some(msg) = this.transfer.transfer(pieces, &this.engine, &shared) {
                    this.engine.reactor.send(msg);
                }
                if let Some(e) = this.transfer.take_error() {
                    // Stop the op; whatever it still holds comes back through the reactor.
                    this.engine.reactor.send(Msg::Cancel(shared.clone()));
                    this.state = OpState::Done;
                    return Poll::Ready(Err(e));
                }
            }
            if let Some(r) = result {
                this.count_result(&r);
                this.transfer.finish(&shared);
                this.state = OpState::Done;
                return Poll::Ready(r);
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

impl<T: Transfer> Drop for OpFuture<T> {
    fn drop(&mut self) {
        if let OpState::Running(shared) = &self.state {
            // Dropped mid-flight: the reactor stops starting pieces and reclaims slots. In-flight
            // I/O only ever targets bounce slots or memory the op owns (an owned or lent buffer
            // the reactor lets go of after the last piece), so nothing waits for it here.
            self.engine.reactor.send(Msg::Cancel(shared.clone()));
        }
    }
}
