//! One op in the reactor's table ([`OpEntry`]): its plan, the queue it waits in, and its
//! lifecycle, with the rules for failing and cancelling it.

use std::sync::Arc;

use crate::error::{Context, Error, OpKind};
use crate::op::OpShared;
use crate::op::request::OwnedTarget;
use crate::plan::{Piece, ReadPlan, Via, WritePlan};
use crate::target::Target;

/// The pieces an op is split into.
pub(super) enum Plan {
    Read(ReadPlan),
    Write(WritePlan),
    Sync,
    /// Work already queued on a CUDA stream: no pieces, one gate.
    Await,
}

impl Plan {
    pub(super) fn len(&self) -> usize {
        match self {
            Plan::Read(p) => p.len(),
            Plan::Write(p) => p.len(),
            Plan::Sync => 1,
            Plan::Await => 0,
        }
    }

    /// Whether the pieces cover exactly `[offset, offset + len)`, no wider (an aligned read).
    pub(super) fn covers_exactly(&self, offset: u64, len: u64) -> bool {
        let n = self.len();
        n == 0 || {
            let (first, last) = (self.piece(0), self.piece(n - 1));
            first.pos == offset && last.pos + last.len as u64 == offset + len
        }
    }

    pub(super) fn piece(&self, i: usize) -> Piece {
        match self {
            Plan::Read(p) => p.piece(i),
            Plan::Write(p) => p.piece(i),
            Plan::Sync | Plan::Await => Piece {
                pos: 0,
                len: 0,
                via: Via::Main,
            },
        }
    }
}

/// Which side lane serves an op, and whether its main pieces move through that lane's device
/// staging memory (their slots then come from the device pool).
#[derive(Debug, Clone, Copy)]
pub(super) struct SideRoute {
    pub(super) lane: usize,
    pub(super) staged: bool,
}

/// Where an op waits to start its next piece: one of the reactor's queues, or none. One field
/// instead of three flags (`in_runnable`, `window_blocked`, `copy_parked`), so an op is never in
/// two of them at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Queue {
    /// In `Reactor::runnable`: it has pieces to start.
    Runnable,
    /// Out of the run queue until `held_bytes` drops below the per-op window (counted in
    /// `Reactor::window_blocked_ops`); `uncount_op_slot` puts it back.
    WindowBlocked,
    /// In `Reactor::page_cache_parked` until a page-cache copy frees up.
    PageCacheParked,
    /// In no queue: every piece started, or none to start (an awaited op).
    Idle,
}

/// Where an op is in its life in the table, as one value (tokio-uring's `Lifecycle`, for an
/// op of many pieces). Once it leaves `Running` no piece starts; it leaves the table when
/// nothing of it is outstanding (`Reactor::maybe_finish`). An op cannot be both failed and
/// cancelled: a cancelled op's result goes nowhere, so its errors are not kept.
pub(super) enum Lifecycle {
    /// Pieces to start or in flight, nothing failed.
    Running,
    /// Something failed; the remaining pieces in flight drain.
    Failed {
        error: Error,
        /// File offset of the failing piece, where a piece failed: pieces complete out of
        /// order, and the error kept is the one at the lowest failing offset (a later
        /// piece's ENOSPC must not hide an earlier one's). For writes every piece below it
        /// was written (pieces start in order; fenced ones still run); a failed read hands
        /// back no data.
        at: Option<u64>,
    },
    /// The future was dropped; the pieces in flight drain.
    Cancelled,
}

/// One op in the table.
pub(super) struct OpEntry {
    pub(super) shared: Arc<OpShared>,
    /// A write's place in the engine's count of unfinished writes (released with the entry).
    pub(super) _pending: Option<crate::op::request::PendingWrite>,
    pub(super) file: Arc<Target>,
    pub(super) kind: OpKind,
    pub(super) plan: Plan,
    pub(super) offset: u64,
    pub(super) len: u64,
    /// Next piece to start.
    pub(super) next: usize,
    /// Pieces in the kernel, out for filling, or filled and queued for submission.
    pub(super) busy: usize,
    /// Which queue the op waits in for its next piece.
    pub(super) queue: Queue,
    /// Bounce bytes this op holds (in the kernel, out for filling, or awaiting copy-out).
    pub(super) held_bytes: usize,
    pub(super) eof_at: Option<u64>,
    pub(super) life: Lifecycle,
    /// Alignment the plan was made on (a short read not a multiple of it means end of file).
    pub(super) align: u64,
    /// The side lane that serves this op (`Lane::route`); `None`: the main lane.
    pub(super) side: Option<SideRoute>,
    /// What serves this op, for error context.
    pub(super) backend: &'static str,
    /// Pieces to run again on the main lane after its side lane gave the file up.
    pub(super) retry: Vec<Piece>,
    /// The caller's owned buffer the pieces are read into (instead of bounce slots).
    pub(super) owned: Option<OwnedTarget>,
    /// The result an awaited op's gate delivered (`Plan::Await`).
    pub(super) awaited: Option<u64>,
    /// Each piece goes direct or buffered by what the page cache holds of it (a buffered
    /// file's large read planned on its O_DIRECT twin's alignment).
    pub(super) residency: bool,
    /// Whose memory a read's pieces end in, for the per-GPU cap on page-cache copies
    /// (`sched`); `None` for writes and syncs.
    pub(super) reader: Option<Reader>,
}

/// The memory a read lands in: host memory, or a GPU's (by number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reader {
    Host,
    Device(u32),
}

impl OpEntry {
    /// A new op on the main lane with nothing started; `accept` sets what differs.
    pub(super) fn new(
        shared: Arc<OpShared>,
        file: Arc<Target>,
        kind: OpKind,
        plan: Plan,
        offset: u64,
        len: u64,
        backend: &'static str,
    ) -> Self {
        let queue = if plan.len() == 0 {
            Queue::Idle
        } else {
            Queue::Runnable
        };
        OpEntry {
            shared,
            _pending: None,
            file,
            kind,
            plan,
            offset,
            len,
            next: 0,
            busy: 0,
            queue,
            held_bytes: 0,
            eof_at: None,
            life: Lifecycle::Running,
            align: 1,
            side: None,
            backend,
            retry: Vec::new(),
            owned: None,
            awaited: None,
            residency: false,
            reader: None,
        }
    }

    /// Whether no more pieces start (failed or cancelled).
    pub(super) fn stopped(&self) -> bool {
        !matches!(self.life, Lifecycle::Running)
    }

    pub(super) fn cancelled(&self) -> bool {
        matches!(self.life, Lifecycle::Cancelled)
    }

    /// Fails a running op with `error` (the first failure wins; a cancelled op keeps none).
    pub(super) fn fail(&mut self, error: Error) {
        if let Lifecycle::Running = self.life {
            self.life = Lifecycle::Failed { error, at: None };
        }
    }

    /// Fails the op for a piece that failed at file offset `pos`, keeping the error at the
    /// lowest failing offset.
    pub(super) fn fail_at(&mut self, pos: u64, error: impl FnOnce(Context) -> Error) {
        let replace = match &self.life {
            Lifecycle::Running => true,
            Lifecycle::Failed { at, .. } => at.is_some_and(|at| pos < at),
            Lifecycle::Cancelled => false,
        };
        if replace {
            let error = error(self.ctx(pos));
            self.life = Lifecycle::Failed {
                error,
                at: Some(pos),
            };
        }
    }

    /// The future is gone: nothing more starts and no result is kept.
    pub(super) fn cancel(&mut self) {
        self.life = Lifecycle::Cancelled;
    }

    /// Whether the op's main pieces move through its side lane's device staging memory.
    pub(super) fn device_staged(&self) -> bool {
        self.side.is_some_and(|r| r.staged)
    }

    pub(super) fn ctx(&self, offset: u64) -> Context {
        let ctx = Context::op(self.kind).with_backend(self.backend);
        if matches!(self.plan, Plan::Await) && self.file.path.as_os_str().is_empty() {
            return ctx; // a stream sync: no file, no offset
        }
        ctx.with_path(&self.file.path).with_offset(offset)
    }

    /// Whether every piece has been started (or will never be).
    pub(super) fn all_started(&self) -> bool {
        self.stopped() || (self.next == self.plan.len() && self.retry.is_empty())
    }
}
