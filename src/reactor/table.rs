//! The op table: accepting a request (planning it and choosing its route), messages about
//! ops (slots coming back, filled write slots, cancellation, shutdown), and finishing an op
//! once nothing of it is outstanding.

use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::Reactor;
use super::entry::Reader;
use crate::buf::arena::BounceSlot;
use crate::error::{Context, Error, OpKind};
use crate::lane::{Route, RouteAsk, Routed};
use crate::op::gate::Gated;
use crate::op::msg::Msg;
use crate::op::request::{DeviceCtx, OpRequest, OwnedTarget};
use crate::op::{DeviceStaging, OpRef, OpShared};
use crate::plan::{ReadPlan, WritePlan, residency};
use crate::target::Target;

use super::entry::{Lifecycle, OpEntry, Plan, Queue, SideRoute};

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
        if kind == OpKind::Read {
            let reader = match &device {
                Some(d) => Reader::Device(crate::op::request::device_number(d)),
                None => Reader::Host,
            };
            entry.reader = Some(reader);
            self.readers.add(reader);
        }
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
        if let Some(r) = op.reader {
            self.readers.remove(r);
        }
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
