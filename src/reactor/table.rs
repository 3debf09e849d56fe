//! The op table: accepting a request (planning it and choosing its route), messages about
//! ops (slots coming back, filled write slots, cancellation, shutdown), and finishing an op
//! once nothing of it is outstanding.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Reactor;
use crate::buf::arena::BounceSlot;
use crate::error::{Context, Error, OpKind};
use crate::lane::{Route, RouteAsk, Routed};
use crate::op::gate::Gated;
use crate::op::msg::Msg;
use crate::op::request::{DeviceCtx, OpRequest, OwnedTarget};
use crate::op::{DeviceStaging, OpRef, OpShared};
use crate::plan::{Piece, ReadPlan, Via, WritePlan, residency};
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
/// instead of three flags (`in_runnable`, `window_blocked`, `page_cache_parked`), so an op is never
/// in two of them at once.
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
}

impl OpEntry {
    /// A new op on the main lane with nothing started; `accept` sets what differs.
    fn new(
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

impl Reactor {
    pub(super) fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Submit(mut m) => {
                let (Some(shared), Some(req)) = (m.shared.take(), m.req.take()) else {
                    return;
                };
                self.accept(shared, req);
            }
            Msg::Release(op, slots) => {
                let key = op.key;
                let live = self.is_live_ref(op);
                for s in slots {
                    if live {
                        self.free_op_slot(key, s);
                    } else {
                        self.slots.free(s);
                    }
                }
            }
            Msg::Filled(shared, pieces) => {
                let key = shared.key();
                let live = self.is_live(key, &shared);
                for p in pieces {
                    if live && !self.ops[key].stopped() {
                        self.to_submit.push_back((key, p));
                    } else if live {
                        self.ops[key].busy -= 1;
                        self.free_op_slot(key, p.slot);
                    } else {
                        self.slots.free(p.slot);
                    }
                }
                if live {
                    self.maybe_finish(key);
                }
            }
            Msg::Cancel(shared) => {
                let key = shared.key();
                if self.is_live(key, &shared) {
                    self.ops[key].cancel();
                    self.reclaim(key);
                    self.maybe_finish(key);
                } else {
                    // The op had already finished, but its future was dropped before taking
                    // the last pieces handed to it: their slots belong to nobody now.
                    for p in shared.reclaim_ready() {
                        self.slots.free(p.slot);
                    }
                }
            }
            Msg::Gated(g) => self.gated.push(g),
            Msg::Many(msgs) => {
                for m in msgs {
                    self.handle(m);
                }
            }
            Msg::Awaited(shared, what) => {
                let key = shared.key();
                if self.is_live(key, &shared) {
                    let op = &mut self.ops[key];
                    op.busy -= 1;
                    match what.result() {
                        Ok(n) => op.awaited = Some(n),
                        Err(e) => op.fail(e),
                    }
                    self.maybe_finish(key);
                }
            }
            Msg::PanicAtNextCompletion => self.panic_armed = true,
            Msg::Abandon(shared, pieces) => {
                self.compromised = true;
                let key = shared.key();
                if self.is_live(key, &shared) {
                    let op = &mut self.ops[key];
                    for p in &pieces {
                        op.held_bytes -= p.slot.size();
                        if op.kind == OpKind::Write {
                            op.busy -= 1;
                        }
                    }
                    let ctx = op.ctx(op.offset);
                    op.fail(Error::cuda_msg(ctx, "device copy failed"));
                    self.maybe_finish(key);
                }
                // The slots themselves are never freed.
            }
            Msg::Shutdown(mut waiter) => {
                self.shutdown_waiters.extend(waiter.shared.take());
                self.begin_shutdown();
            }
        }
    }

    pub(super) fn accept(&mut self, shared: Arc<OpShared>, req: OpRequest) {
        let req = match req {
            OpRequest::Await {
                kind,
                file,
                offset,
                gated,
            } => return self.accept_awaited(shared, kind, file, offset, gated),
            other => other,
        };
        let kind = req.op_kind();
        let mut pending = None;
        let (file, offset, len, device, owned) = match req {
            OpRequest::Read {
                file,
                offset,
                len,
                device,
                owned,
            } => (file, offset, len, device, owned),
            OpRequest::Write {
                file,
                offset,
                len,
                device,
                pending: p,
            } => {
                pending = Some(p);
                (file, offset, len, device, None)
            }
            OpRequest::Sync { file } => (file, 0, 0, None, None),
            OpRequest::Await { .. } => unreachable!("handled above"),
        };
        // An op refused before any I/O hands its owned buffer back untouched.
        let refuse = |shared: &Arc<OpShared>, owned: Option<OwnedTarget>, e: Error| {
            if let Some(o) = owned {
                shared.give_back(o.keep);
            }
            shared.complete(Err(e));
        };
        let mut ctx = Context::op(kind)
            .with_path(&file.path)
            .with_offset(offset)
            .with_backend(self.backend);
        if self.shutting_down {
            refuse(&shared, owned, Error::shutdown(ctx));
            return;
        }
        let (mut align, mut write_align) = (file.align, file.write_align);
        let mut backend = self.backend;
        // Page-cache copies and disk (or DMA) transfers want different piece sizes
        // (`plan::sizing`); a side lane names its own.
        let mut chunk = if file.dio.is_some() {
            self.cfg.direct_chunk
        } else {
            self.cfg.buffered_chunk
        };
        let side = match self.route(&file, device.as_ref(), &shared) {
            Ok(Some((lane, route))) => {
                align = align.max(route.align);
                write_align = write_align.max(route.align);
                backend = route.backend;
                chunk = route.chunk;
                ctx = ctx.with_backend(route.backend);
                Some(SideRoute {
                    lane,
                    staged: route.staging.is_some(),
                })
            }
            Ok(None) => None,
            Err((name, reason)) => {
                refuse(
                    &shared,
                    owned,
                    Error::unsupported(ctx.with_backend(name), reason),
                );
                return;
            }
        };
        // A large read of a buffered file the page cache does not wholly hold is planned on
        // the O_DIRECT twin's alignment and chunk; each piece then goes direct or buffered by
        // what the cache holds of it when it starts (`sched`).
        let residency = kind == OpKind::Read
            && side.is_none()
            && owned.is_none()
            && self.cfg.residency_min.is_some_and(|m| len >= m)
            && file.dio.is_none()
            && file.fd.as_ref().is_some_and(|fd| {
                residency::estimate(fd.as_fd(), offset, len).is_ok_and(|r| !r.all_cached())
            })
            && match file.direct_twin(self.cfg.direct_chunk) {
                Some(twin) => {
                    align = align.max(u64::from(twin.align.offset));
                    chunk = self.cfg.direct_chunk;
                    true
                }
                None => false,
            };
        let plan = match kind {
            OpKind::Read => ReadPlan::new(offset, len, align, chunk).map(Plan::Read),
            OpKind::Write => WritePlan::new(offset, len, write_align, chunk).map(Plan::Write),
            _ => Ok(Plan::Sync),
        };
        let plan = match plan {
            Ok(p) => p,
            Err(e) => {
                refuse(&shared, owned, Error::invalid(ctx, e.to_string()));
                return;
            }
        };
        if owned.is_some() && (side.is_some() || !plan.covers_exactly(offset, len)) {
            // The file layer offers owned reads only where pieces cover exactly the caller's
            // range in host memory; anything else would write outside the buffer.
            let e = Error::invalid(ctx, "owned read offered where it cannot land in place");
            refuse(&shared, owned, e);
            return;
        }
        let empty = plan.len() == 0;
        let mut entry = OpEntry::new(shared.clone(), file, kind, plan, offset, len, backend);
        entry._pending = pending;
        entry.align = align;
        entry.side = side;
        entry.owned = owned;
        entry.residency = residency;
        let key = self.ops.insert(entry);
        self.name_op(&shared, key);
        if empty {
            self.maybe_finish(key);
        } else {
            self.runnable.push_back(key);
        }
    }

    /// Takes an op whose work is already queued on a CUDA stream into the table: no pieces,
    /// one outstanding gate, whose opening (`Msg::Awaited`) finishes it.
    fn accept_awaited(
        &mut self,
        shared: Arc<OpShared>,
        kind: OpKind,
        file: Option<Arc<Target>>,
        offset: u64,
        gated: Gated,
    ) {
        let backend = if file.is_some() {
            "cufile-stream"
        } else {
            "cuda"
        };
        let file = file.unwrap_or_else(|| Arc::new(Target::unnamed()));
        let mut entry = OpEntry::new(shared.clone(), file, kind, Plan::Await, offset, 0, backend);
        // The gate is the one thing outstanding.
        entry.busy = 1;
        let key = self.ops.insert(entry);
        self.name_op(&shared, key);
        // Queued on the stream already, so taken even while shutting down: shutdown waits for
        // it like for any piece in flight.
        self.gated.push(gated);
    }

    /// The side lane that serves an op on `file` with caller memory on `device`, asked in
    /// turn (`Lane::route`): `Ok(Some((lane, route)))`, `Ok(None)` for the main lane, or
    /// `Err((backend, why))` where a lane must serve and cannot. A lane that moves pieces
    /// through device staging memory gets the device slot pool, and the op's future learns
    /// where that memory is (`OpShared::staging`).
    fn route(
        &mut self,
        file: &Arc<Target>,
        device: Option<&DeviceCtx>,
        shared: &Arc<OpShared>,
    ) -> std::result::Result<Option<(usize, Route)>, (&'static str, String)> {
        let ask = RouteAsk {
            target: file,
            device,
            direct_chunk: self.cfg.direct_chunk,
            pool_shape: (self.arena.block_size(), self.arena.blocks()),
        };
        for (i, lane) in self.side.iter_mut().enumerate() {
            match lane.route(&ask) {
                Routed::No => continue,
                Routed::Refuse { backend, why } => return Err((backend, why)),
                Routed::Take(route) => {
                    if let Some((base, keep)) = &route.staging {
                        let (block, blocks) = ask.pool_shape;
                        self.slots.ensure_device(block, blocks);
                        let _ = shared.staging.set(DeviceStaging {
                            base: *base,
                            keep: keep.clone(),
                        });
                    }
                    return Ok(Some((i, route)));
                }
            }
        }
        Ok(None)
    }

    pub(super) fn begin_shutdown(&mut self) {
        if self.shutting_down {
            return;
        }
        self.shutting_down = true;
        self.shutdown_started = Some(Instant::now());
        let keys: Vec<usize> = self.ops.iter().map(|(k, _)| k).collect();
        for key in keys {
            let op = &mut self.ops[key];
            // Work already queued on a stream runs to its end: it reports its own result.
            if !matches!(op.plan, Plan::Await) {
                let ctx = op.ctx(op.offset);
                op.fail(Error::shutdown(ctx));
            }
            self.reclaim(key);
            self.maybe_finish(key);
        }
    }

    /// Takes back slots an op's future has not picked up.
    pub(super) fn reclaim(&mut self, key: usize) {
        let op = &self.ops[key];
        let pieces = op.shared.reclaim_ready();
        let is_write = op.kind == OpKind::Write;
        for p in pieces {
            if is_write {
                self.ops[key].busy -= 1;
            }
            self.free_op_slot(key, p.slot);
        }
    }

    /// Gives the op at `key` its serial number (`OpRef`).
    fn name_op(&mut self, shared: &OpShared, key: usize) {
        shared.key.store(key, Ordering::Relaxed);
        shared.serial.store(self.next_serial, Ordering::Relaxed);
        self.next_serial += 1;
    }

    /// Whether `op` names an op still in the table (not a later one under a reused key).
    pub(super) fn is_live_ref(&self, op: OpRef) -> bool {
        self.ops
            .get(op.key)
            .is_some_and(|o| o.shared.serial.load(Ordering::Relaxed) == op.serial)
    }

    /// Whether `shared` is the op at `key` (the same check as [`is_live_ref`](Self::is_live_ref)).
    pub(super) fn is_live(&self, key: usize, shared: &OpShared) -> bool {
        debug_assert_eq!(key, shared.key());
        self.is_live_ref(shared.op_ref())
    }

    /// Frees a slot `key` held, and puts the op back in the run queue if the window had
    /// stopped it.
    pub(super) fn free_op_slot(&mut self, key: usize, slot: BounceSlot) {
        self.slots.free(slot);
        self.uncount_op_slot(key, slot);
    }

    /// Takes `slot` off op `key`'s books without putting it back in the pool (a copy that may
    /// still read it cannot be seen to end).
    pub(super) fn uncount_op_slot(&mut self, key: usize, slot: BounceSlot) {
        let op = &mut self.ops[key];
        op.held_bytes -= slot.size();
        if op.queue == Queue::WindowBlocked && op.held_bytes < self.op_window {
            op.queue = Queue::Runnable;
            self.window_blocked_ops -= 1;
            self.runnable.push_back(key);
        }
    }

    /// Completes and removes `key` once nothing of it is outstanding.
    pub(super) fn maybe_finish(&mut self, key: usize) {
        let op = &self.ops[key];
        if !op.all_started() || op.busy > 0 {
            return;
        }
        let mut op = self.ops.remove(key);
        match op.queue {
            Queue::WindowBlocked => self.window_blocked_ops -= 1,
            Queue::Runnable => self.runnable.retain(|&k| k != key),
            // A stale key in `page_cache_parked` is skipped there (its op is gone or not parked).
            Queue::PageCacheParked | Queue::Idle => {}
        }
        if let Some(o) = op.owned.take() {
            // Nothing of the op is in the kernel any more: the buffer may go back (or, for a
            // dropped future, be freed here).
            op.shared.give_back(o.keep);
        }
        let result = match std::mem::replace(&mut op.life, Lifecycle::Cancelled) {
            Lifecycle::Failed { error, .. } => Err(error),
            Lifecycle::Cancelled => return,
            // Work on a stream reports its own count (a read's plan has no pieces to sum).
            Lifecycle::Running if matches!(op.plan, Plan::Await) => Ok(op.awaited.unwrap_or(0)),
            Lifecycle::Running => match op.kind {
                OpKind::Read => {
                    let end = op.offset + op.len;
                    Ok(op
                        .eof_at
                        .map_or(end, |e| e.min(end))
                        .saturating_sub(op.offset))
                }
                OpKind::Write => Ok(op.len),
                _ => Ok(0),
            },
        };
        op.shared.complete(result);
    }
}
