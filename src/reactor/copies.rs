//! Reactor-issued device copies: reads whose future took a device lease (`crate::cuda::lease`)
//! have their pieces copied into device memory here, on one non-blocking copy stream per
//! context, every piece that is ready in one loop turn in one driver call
//! (`cuMemcpyBatchAsync` where the driver has it), the slots of the batch behind one event, and
//! the lease released on the copy stream after the op's last copy. The future is woken once,
//! when its op is done.
//!
//! Soundness rests on the lease (see its module and `docs/device-leases.md`); what this room
//! adds: the copy stream never waits on a user stream (prior work on the destination is seen
//! by polling the lease's first event from the host, so no release can end up behind a wait
//! that needs it); every exit of a leased op (done, failed, cancelled, shutdown, death)
//! releases its lease on the copy stream after every copy queued for it; and slots go back to
//! the pool only after the copies' event has completed.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::CUstream;

use super::Reactor;
use crate::cuda::copylist::{self, CopySpec};
use crate::cuda::lease::{CopyFence, DeviceLease};
use crate::error::Error;
use crate::op::gate::{Gate, GateState, Gated};
use crate::op::msg::Msg;
use crate::op::request::LeasedDst;
use crate::op::{OpShared, ReadyPiece, ReadyPieces};

/// How often the reactor looks at a leased op's first event while its pieces wait for it.
pub(super) const PRIOR_WORK_POLL: Duration = Duration::from_micros(20);

/// A context's copy stream as this reactor uses it: the stream itself belongs to the context's
/// lease board (made on a caller's thread, kept for the process), the fence is this
/// reactor's. Nothing here makes a driver call that creates anything: with a user's thread
/// inside a call that waits on a leased stream, the driver holds such calls back (measured for
/// `cuEventCreate`), and the reactor must keep issuing the copies that end the wait.
struct CopyStream {
    ctx: Arc<CudaContext>,
    raw: CUstream,
    fence: Arc<CopyFence>,
}

/// The slots of a batch go back once the copy stream has passed the batch's fence signal.
struct FenceGate {
    fence: Arc<CopyFence>,
    seq: u32,
}

impl Gate for FenceGate {
    fn poll(&self) -> GateState {
        if self.fence.passed(self.seq) {
            GateState::Open
        } else {
            GateState::Closed
        }
    }
}

/// A leased read in the op table.
pub(super) struct LeasedOp {
    dst: LeasedDst,
    stream: usize,
    /// The lease's first event has completed: copies may go.
    prior_done: bool,
    /// Read pieces waiting for their copy.
    pending: ReadyPieces,
    /// Bounce bytes this op holds while its prior work is not done (counted in
    /// `Copies::speculative`).
    spec_bytes: usize,
    /// Asking whether the prior work is done failed: the op fails with this before any copy.
    prior_error: Option<String>,
}

/// The reactor's copy streams and the ops whose pieces wait for a copy.
#[derive(Default)]
pub(super) struct Copies {
    streams: Vec<CopyStream>,
    /// Ops with pending pieces (checked against the table: a key may have been reused).
    waiting: Vec<(usize, Arc<OpShared>)>,
    /// Ops taken off the run queue because their prior work is not done and the speculative
    /// budget is spent.
    parked: Vec<(usize, Arc<OpShared>)>,
    /// Bounce bytes held by leased ops whose prior work is not done. Such an op's pieces cannot
    /// be copied, and the work it waits for may be another leased op's (a later read on the
    /// same stream waits for an earlier one's release): were they free to take every slot, the
    /// earlier op could never read its pieces. They share at most the per-op window; the rest
    /// of the pool always serves ops whose copies can go.
    speculative: usize,
}

impl Copies {
    /// Whether pieces or ops wait for a lease's first event (the reactor then looks again
    /// soon).
    pub(super) fn waiting(&self) -> bool {
        !self.waiting.is_empty() || !self.parked.is_empty()
    }
}

/// Leases whose copies the current batch queues; each ends its issue when this drops.
struct Issuing(Vec<Arc<DeviceLease>>);

impl Drop for Issuing {
    fn drop(&mut self) {
        for lease in &self.0 {
            lease.end_issue();
        }
    }
}

/// What the scheduler may do with a leased op's next piece.
pub(super) enum LeaseGate {
    /// Start it (its prior work is done, or the speculative budget has room).
    Go,
    /// Take the op off the run queue until its prior work is done.
    Park,
}

/// One copy of a batch, and the op it serves.
struct Job {
    key: usize,
    copy: CopySpec,
}

impl Reactor {
    /// At accept: whether the reactor copies this op's pieces under its lease. Declined
    /// leases (not a plain bounce read, no copy stream) are released from the host at once,
    /// and the future copies.
    pub(super) fn take_lease(&mut self, dst: LeasedDst, bounce_read: bool) -> Option<LeasedOp> {
        if !bounce_read {
            dst.lease.release_unused();
            return None;
        }
        match self.copy_stream(&dst) {
            Ok(stream) => {
                self.engine
                    .leased_reads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Some(LeasedOp {
                    dst,
                    stream,
                    prior_done: false,
                    pending: ReadyPieces::new(),
                    spec_bytes: 0,
                    prior_error: None,
                })
            }
            Err(why) => {
                tracing::warn!(%why, "gpuio reactor has no copy stream; futures copy");
                dst.lease.release_unused();
                None
            }
        }
    }

    fn copy_stream(&mut self, dst: &LeasedDst) -> Result<usize, String> {
        let ctx = dst.lease.context();
        // By board, not by context handle: after a context reset the handle stays and the
        // board (with its copy stream) is made anew.
        if let Some(i) = self
            .copies
            .streams
            .iter()
            .position(|s| Arc::ptr_eq(s.fence.board(), dst.lease.board()))
        {
            return Ok(i);
        }
        let fence = Arc::new(CopyFence::new(dst.lease.board())?);
        self.copies.streams.push(CopyStream {
            ctx: ctx.clone(),
            raw: fence.stream(),
            fence,
        });
        Ok(self.copies.streams.len() - 1)
    }

    /// Before a leased op's next piece takes a slot: whether it may (see
    /// `Copies::speculative`). Ops without a lease always may.
    pub(super) fn lease_gate(&mut self, key: usize, piece_len: usize) -> LeaseGate {
        let budget = self.op_window;
        let op = &mut self.ops[key];
        let Some(l) = op.leased.as_mut() else {
            return LeaseGate::Go;
        };
        if l.prior_done || prior_done_now(l, &self.copies.streams) {
            self.copies.speculative -= std::mem::take(&mut l.spec_bytes);
            l.prior_done = true;
            return LeaseGate::Go;
        }
        if self.copies.speculative == 0 || self.copies.speculative + piece_len <= budget {
            return LeaseGate::Go;
        }
        self.copies.parked.push((key, op.shared.clone()));
        LeaseGate::Park
    }

    /// A slot was taken (`taken`) or given back by `key`: the speculative count follows.
    pub(super) fn lease_slot(&mut self, key: usize, bytes: usize, taken: bool) {
        let Some(l) = self.ops[key].leased.as_mut() else {
            return;
        };
        if taken && !l.prior_done {
            l.spec_bytes += bytes;
            self.copies.speculative += bytes;
        } else if !taken {
            let d = bytes.min(l.spec_bytes);
            l.spec_bytes -= d;
            self.copies.speculative -= d;
        }
    }

    /// Parked ops go back to the run queue once their prior work is done, the budget has
    /// room again, or they stopped (the scheduler then finishes them).
    fn unpark(&mut self) {
        if self.copies.parked.is_empty() {
            return;
        }
        let parked = std::mem::take(&mut self.copies.parked);
        for (key, shared) in parked {
            if !self.is_live(key, &shared) {
                continue;
            }
            let room = self.copies.speculative < self.op_window;
            let op = &mut self.ops[key];
            let stopped = op.stopped();
            let go = match op.leased.as_mut() {
                None => true,
                Some(l) => {
                    if !l.prior_done && prior_done_now(l, &self.copies.streams) {
                        self.copies.speculative -= std::mem::take(&mut l.spec_bytes);
                        l.prior_done = true;
                    }
                    l.prior_done || room || stopped
                }
            };
            if !go {
                self.copies.parked.push((key, shared));
            } else if !op.in_runnable {
                op.in_runnable = true;
                self.runnable.push_back(key);
            }
        }
    }

    /// A completed read piece of a leased op: it waits here for its copy.
    pub(super) fn hand_to_copies(&mut self, key: usize, p: ReadyPiece) {
        let op = &mut self.ops[key];
        let l = op.leased.as_mut().expect("a leased op");
        if l.pending.is_empty() {
            self.copies.waiting.push((key, op.shared.clone()));
        }
        l.pending.push(p);
    }

    /// Whether `key`'s leased pieces still wait for copies; a stopped op's pending pieces go
    /// back to the pool and its lease is released now (nothing more will be copied).
    pub(super) fn lease_busy(&mut self, key: usize) -> bool {
        let op = &mut self.ops[key];
        let stopped = op.stopped();
        let Some(l) = op.leased.as_mut() else {
            return false;
        };
        if !stopped {
            return !l.pending.is_empty();
        }
        let pending = std::mem::take(&mut l.pending);
        for p in pending {
            self.free_op_slot(key, p.slot);
        }
        let l = self.ops[key].leased.take().expect("checked above");
        if let Err(e) = self.end_lease(l) {
            tracing::error!(%e, "gpuio could not release a device lease");
        }
        false
    }

    /// Queues the lease's release on its copy stream, after every copy queued for it.
    pub(super) fn end_lease(&mut self, l: LeasedOp) -> Result<(), String> {
        self.copies.speculative -= l.spec_bytes;
        let cs = &self.copies.streams[l.stream];
        cs.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        // SAFETY: `cs.raw` is the live copy stream of the lease's context, bound above, and
        // every copy queued for this lease was queued on it.
        let r = unsafe { l.dst.lease.release_on(cs.raw) };
        if let Err(why) = &r {
            // Copies may be queued: the lease must not be released behind their back. The
            // destination's stream stays blocked (its Drop logs it).
            tracing::error!(%why, "releasing a device lease failed; its stream stays blocked");
        }
        r
    }

    /// Issues copies for every pending piece whose op's prior work is done, one batch per
    /// copy stream, and finishes the ops this completes.
    pub(super) fn issue_copies(&mut self) {
        self.unpark();
        if self.copies.waiting.is_empty() {
            return;
        }
        let waiting = std::mem::take(&mut self.copies.waiting);
        let mut jobs: Vec<Vec<Job>> = (0..self.copies.streams.len()).map(|_| Vec::new()).collect();
        let mut slots: Vec<Vec<(Arc<OpShared>, ReadyPieces)>> =
            (0..self.copies.streams.len()).map(|_| Vec::new()).collect();
        let mut touched = Vec::new();
        // Leases whose copies are being queued: their futures' drops wait until the batch
        // call has returned (`DeviceLease::stop_copies`).
        // A guard: a panic on the way (the reactor then dies) still ends the issue, or the
        // future's drop would wait for ever.
        let mut issuing = Issuing(Vec::new());
        for (key, shared) in waiting {
            if !self.is_live(key, &shared) {
                continue;
            }
            let op = &mut self.ops[key];
            let (offset, len) = (op.offset, op.len as usize);
            let stopped = op.stopped();
            let Some(l) = op.leased.as_mut() else {
                continue;
            };
            if l.pending.is_empty() {
                continue;
            }
            if stopped {
                touched.push(key);
                continue;
            }
            if !l.prior_done {
                let cs = &self.copies.streams[l.stream];
                let _ = cs.ctx.bind_to_thread();
                match l.dst.lease.prior_work_done() {
                    Ok(true) => {
                        self.copies.speculative -= std::mem::take(&mut l.spec_bytes);
                        l.prior_done = true;
                    }
                    Ok(false) => {
                        self.copies.waiting.push((key, shared));
                        continue;
                    }
                    Err(why) => {
                        if op.error.is_none() {
                            op.error = Some(Error::cuda_msg(op.ctx(offset), why));
                        }
                        touched.push(key);
                        continue;
                    }
                }
            }
            if let Some(why) = l.prior_error.take() {
                if op.error.is_none() {
                    op.error = Some(Error::cuda_msg(op.ctx(offset), why));
                }
                touched.push(key);
                continue;
            }
            if !l.dst.lease.begin_issue() {
                // The future was dropped: its Cancel is queued; the op stops next turn and its
                // pieces go back then.
                self.copies.waiting.push((key, shared));
                continue;
            }
            issuing.0.push(l.dst.lease.clone());
            let pieces = std::mem::take(&mut l.pending);
            l.dst.lease.copies_queued();
            for p in &pieces {
                if let Some((from, to, n)) = p.overlap(offset, len) {
                    jobs[l.stream].push(Job {
                        key,
                        copy: CopySpec {
                            dst: l.dst.ptr + to,
                            src: self.arena.slot_ptr(&p.slot) as u64 + from as u64,
                            n,
                            direct: self.arena.slot_is_pinned(&p.slot),
                        },
                    });
                }
            }
            slots[l.stream].push((shared, pieces));
            touched.push(key);
        }
        for (i, (jobs, slots)) in jobs.into_iter().zip(slots).enumerate() {
            if !slots.is_empty() {
                self.run_batch(i, jobs, slots);
            }
        }
        drop(issuing);
        for key in touched {
            if self.ops.contains(key) {
                self.maybe_finish(key);
            }
        }
    }

    /// Queues `jobs` on copy stream `i` and gates the slots behind one event; on failure the
    /// ops fail and the slots are abandoned (a copy may have been queued).
    fn run_batch(&mut self, i: usize, jobs: Vec<Job>, slots: Vec<(Arc<OpShared>, ReadyPieces)>) {
        let cs = &self.copies.streams[i];
        let issued = cs
            .ctx
            .bind_to_thread()
            .map_err(|e| format!("{e:?}"))
            .and_then(|()| {
                let copies: Vec<CopySpec> = jobs.iter().map(|j| j.copy).collect();
                // SAFETY: `raw` is the reactor's live copy stream of the bound context; each
                // source is a bounce slot the reactor owns until the batch's fence has passed;
                // each destination lies inside leased device memory that stays allocated until
                // the lease's release (queued after these copies) has run; destinations of one
                // op are disjoint pieces, and two ops never lease the same memory at once
                // (each holds it `&mut`).
                unsafe { copylist::queue(cs.raw, &copies) }
            })
            .and_then(|()| cs.fence.signal())
            .map(|seq| FenceGate {
                fence: cs.fence.clone(),
                seq,
            });
        match issued {
            Ok(gate) => {
                let releases = slots
                    .into_iter()
                    .map(|(s, p)| Msg::release(&s, p))
                    .collect();
                self.gated
                    .push(Gated::new(Box::new(gate), Msg::Many(releases), &self.arena));
            }
            Err(why) => {
                for j in &jobs {
                    let op = &mut self.ops[j.key];
                    if op.error.is_none() {
                        op.error = Some(Error::cuda_msg(op.ctx(op.offset), why.clone()));
                    }
                }
                for (s, p) in slots {
                    self.handle(Msg::Abandon(s, p));
                }
            }
        }
    }

    /// Death: releases every lease still held, on its copy stream (after whatever was queued).
    pub(super) fn release_leases(&mut self) {
        let keys: Vec<usize> = self
            .ops
            .iter()
            .filter(|(_, o)| o.leased.is_some())
            .map(|(k, _)| k)
            .collect();
        for key in keys {
            if let Some(l) = self.ops[key].leased.take() {
                let _ = self.end_lease(l);
            }
        }
    }

    /// After an orderly drain: the fences go back to their boards (the copy streams stay
    /// with the boards, for the process).
    pub(super) fn close_copy_streams(&mut self) {
        for cs in self.copies.streams.drain(..) {
            if let Ok(fence) = Arc::try_unwrap(cs.fence) {
                fence.close();
            }
        }
    }
}

/// Whether the lease's prior work has completed, asked now (an error counts as done: the
/// copy step then reports it).
/// An error counts as done, and is kept for `issue_copies`, which fails the op with it before
/// any copy.
fn prior_done_now(l: &mut LeasedOp, streams: &[CopyStream]) -> bool {
    let _ = streams[l.stream].ctx.bind_to_thread();
    match l.dst.lease.prior_work_done() {
        Ok(done) => done,
        Err(why) => {
            l.prior_error = Some(why);
            true
        }
    }
}
