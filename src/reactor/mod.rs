//! The reactor: one thread per engine that owns the kernel interface (an io_uring ring or the
//! pread pool), the bounce pool, and every operation in flight.
//!
//! # Life of a read
//! A future sends `Msg::Submit` through an MPSC queue and rings the eventfd doorbell if the
//! reactor sleeps. The reactor plans the request into chunk pieces (`uring::plan`),
//! gives each piece a bounce slot and submits it, up to the queue depth. When a piece
//! completes, the slot is handed to the future (`OpShared::push_ready`) and its waker woken;
//! the future's `poll` copies the bytes into the caller's buffer and sends the slot back
//! (`Msg::Release`). Writes run the other way: the reactor hands out empty slots, `poll`
//! fills them from the caller's buffer and sends them back (`Msg::Filled`) to be written.
//!
//! # Soundness under cancellation and leaks
//! The kernel (or a pread worker) only ever reads or writes bounce slots, which belong to the
//! reactor's arena, or owned buffers the caller gave away (`File::read_owned` with a `Vec<u8>`
//! or `BytesMut`: the op holds the buffer until its last piece has completed, then hands it
//! back or, for a dropped future, frees it); it is never given borrowed caller memory.
//! Borrowed caller memory is touched only inside the future's own `poll`, while the future
//! holds the caller's borrow. Therefore:
//! - dropping a future mid-flight sends `Msg::Cancel`; pieces still in the kernel complete into
//!   slots the reactor then frees, and the caller's buffer is already free to reuse;
//! - leaking a future (`mem::forget`) stops all copies into or out of caller memory, because
//!   only `poll` copies and nobody polls a forgotten future. Its slots stay allocated (a leak of
//!   bounce memory, never corruption), and the arena's memory is kept mapped by an `Arc`.
//!   One op may hold at most a quarter of the pool (the per-op window), so one leaked future
//!   pins at most that much until the engine is dropped; leak four large ones and the pool is
//!   gone, which is the price `mem::forget` is allowed to charge.
//!
//! Nothing here relies on `Drop` running.
//!
//! # Ordering after cancellation
//! What a dropped or leaked operation already gave the kernel still lands, but never after a
//! later operation that overlaps it: a piece whose range meets a write piece of another op
//! started earlier waits for it outside the kernel (`fence`). So a write that completed holds
//! the file's bytes, and a read started after it sees them; unstarted pieces of a dropped op
//! never start. Widened to pages for O_DIRECT files, the same fence keeps concurrent
//! overlapping direct writers from failing the next fsync.
//!
//! # Leaked futures and the pool
//! Slots handed to a future that is never polled again are lost to the pool. When requests
//! wait for memory that nothing in flight can return, the pool grows into reserved address
//! space (`EngineBuilder::bounce_growth`), and past that limit the waiting requests fail with
//! `Error::PoolExhausted` after `EngineBuilder::pool_wait_limit`: never an endless wait.
//!
//! # Shutdown
//! `Engine::shutdown` (or the last engine handle going away) stops new work, fails unstarted
//! pieces with `Error::Shutdown`, reclaims slots not yet picked up, waits for every piece the
//! kernel holds to complete, retires the doorbell read, and only then lets the ring and pool
//! memory go. A panic in the reactor fails every pending operation with `Error::ReactorDied`
//! and leaks (never frees) memory the kernel may still write.

pub(crate) mod fence;

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use slab::Slab;

use crate::buf::arena::{BounceArena, BounceSlot, SlotAllocator};
use crate::error::{Context, Error, OpKind};
use crate::lane::doorbell::Doorbell;
use crate::lane::{Completion, Driver, IoKind, IoRequest};
use crate::op::gate::{GateState, Gated};
use crate::op::msg::{Msg, ReactorHandle};
use crate::op::request::{DeviceCtx, OpRequest, OwnedTarget};
use crate::op::{OpShared, ReadyPiece};
use crate::plan::{Piece, ReadPlan, Via, WritePlan};
use crate::target::Target;
use fence::{RangeFence, Ticket};

/// Most bounce bytes one op may hold (a quarter of the pool), so a leaked future, whose slots
/// are never given back, cannot take the whole pool.
pub(crate) fn op_window(arena: &BounceArena) -> usize {
    (arena.block_size() * arena.blocks() / 4).max(arena.block_size())
}

/// How long shutdown waits for gated work (CUDA copies) before leaking it and exiting.
const GATE_SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);
/// How often the reactor looks at gates while any are closed.
const GATE_POLL_INTERVAL: Duration = Duration::from_micros(100);
/// Least time between two looks at the gates while slots are not short: each look is a
/// `cuEventQuery` per gate, on the context lock the futures' copies need, and a busy reactor
/// turns many times per gate's life (measured: 4 KiB reads into GPU memory).
const GATE_POLL_GAP: Duration = Duration::from_micros(25);

enum Plan {
    Read(ReadPlan),
    Write(WritePlan),
    Sync,
}

impl Plan {
    fn len(&self) -> usize {
        match self {
            Plan::Read(p) => p.len(),
            Plan::Write(p) => p.len(),
            Plan::Sync => 1,
        }
    }

    /// Whether the pieces cover exactly `[offset, offset + len)`, no wider (an aligned read).
    fn covers_exactly(&self, offset: u64, len: u64) -> bool {
        let n = self.len();
        n == 0 || {
            let (first, last) = (self.piece(0), self.piece(n - 1));
            first.pos == offset && last.pos + last.len as u64 == offset + len
        }
    }

    fn piece(&self, i: usize) -> Piece {
        match self {
            Plan::Read(p) => p.piece(i),
            Plan::Write(p) => p.piece(i),
            Plan::Sync => Piece {
                pos: 0,
                len: 0,
                via: Via::Main,
            },
        }
    }
}

struct OpEntry {
    shared: Arc<OpShared>,
    file: Arc<Target>,
    kind: OpKind,
    plan: Plan,
    offset: u64,
    len: u64,
    /// Next piece to start.
    next: usize,
    /// Pieces in the kernel, out for filling, or filled and queued for submission.
    busy: usize,
    in_runnable: bool,
    /// Bounce bytes this op holds (in the kernel, out for filling, or awaiting copy-out).
    held_bytes: usize,
    /// Left the run queue because `held_bytes` reached the per-op window.
    window_blocked: bool,
    eof_at: Option<u64>,
    error: Option<Error>,
    /// File offset `error` names when it came from a piece that failed: pieces complete out of
    /// order, and the error kept is the one at the lowest failing offset (a later piece's
    /// ENOSPC must not hide an earlier one's). For writes every piece below it was written
    /// (pieces start in order; fenced ones still run); a failed read hands back no data.
    error_at: Option<u64>,
    cancelled: bool,
    /// Alignment the plan was made on (a short read not a multiple of it means end of file).
    align: u64,
    /// Direct-path pieces go through cuFile batch I/O into device staging slots.
    gds: bool,
    /// What serves this op, for error context.
    backend: &'static str,
    /// Pieces to run again on the bounce path after cuFile turned the file down.
    retry: Vec<Piece>,
    /// The caller's owned buffer the pieces are read into (instead of bounce slots).
    owned: Option<OwnedTarget>,
}

impl OpEntry {
    fn stopped(&self) -> bool {
        self.cancelled || self.error.is_some()
    }

    fn ctx(&self, offset: u64) -> Context {
        Context::op(self.kind)
            .with_path(&self.file.path)
            .with_offset(offset)
            .with_backend(self.backend)
    }

    /// Whether every piece has been started (or will never be).
    fn all_started(&self) -> bool {
        self.stopped() || (self.next == self.plan.len() && self.retry.is_empty())
    }
}

struct InflightIo {
    op: usize,
    kind: IoKind,
    piece: Piece,
    slot: Option<BounceSlot>,
    done: usize,
    /// The piece's place in the range fence (reads and writes; fsync has none).
    ticket: Option<Ticket>,
}

/// Engine-level settings the reactor needs.
pub(crate) struct ReactorConfig {
    pub(crate) chunk_size: usize,
    pub(crate) queue_depth: usize,
    /// Buffered pieces of at least this many bytes go to io-wq (`IOSQE_ASYNC`).
    pub(crate) punt_min: Option<usize>,
    /// Keep polling this long after the last work while operations are open (0: sleep at once).
    pub(crate) spin: Duration,
    /// Sleep at most this long while I/O is in the kernel (0: until woken).
    pub(crate) tick: Duration,
    /// How long ops may wait for bounce memory nothing in flight can return before the pool
    /// grows or they fail (`EngineBuilder::pool_wait_limit`).
    pub(crate) pool_wait_limit: Duration,
}

/// Ops have waited for bounce memory, with nothing in flight that could return any, since
/// `since`; `returned` is the count of slots given back then (any return restarts the wait).
#[derive(Clone, Copy)]
struct PoolStall {
    since: Instant,
    returned: u64,
    /// Which pool the waiting op needs (device staging or host bounce memory).
    on_device: bool,
}

pub(crate) struct Reactor {
    rx: Receiver<Msg>,
    doorbell: Arc<Doorbell>,
    driver: Option<Driver>,
    backend: &'static str,
    arena: Arc<BounceArena>,
    slots: SlotAllocator,
    ops: Slab<OpEntry>,
    runnable: VecDeque<usize>,
    ios: Slab<InflightIo>,
    to_submit: VecDeque<(usize, ReadyPiece)>,
    /// Orders overlapping pieces of different ops by when they started (see `fence`).
    fence: RangeFence,
    /// Pieces (tokens in `ios`) started but held back by the fence, oldest first.
    fenced: VecDeque<usize>,
    /// Ops out of the run queue because of the window (they wait for their slots to return).
    window_blocked_ops: usize,
    /// Most bounce bytes one op may hold, so a leaked future (whose slots are never given
    /// back) can take at most this much of the pool out of service.
    op_window: usize,
    cfg: ReactorConfig,
    shutting_down: bool,
    shutdown_waiters: Vec<Arc<OpShared>>,
    completions: Vec<Completion>,
    /// Messages waiting for their gate to open.
    gated: Vec<Gated>,
    /// Some memory may still be touched by work we lost track of: never unmap the pool.
    compromised: bool,
    /// Work waited for bounce slots at the last scheduling pass (gates are then looked at on
    /// every turn: an open gate frees slots).
    short_of_slots: bool,
    /// Slots given back so far (both pools): tells a stalled pool from a busy one.
    slots_returned: u64,
    /// Set while ops wait for memory that only futures which do not poll could give back.
    stall: Option<PoolStall>,
    /// When the gates were last looked at.
    gates_polled: Instant,
    /// When the reactor last found work (a message or a completion); it spins, rather than
    /// sleeps, for `cfg.spin` after that while operations are open.
    last_work: Instant,
    shutdown_started: Option<Instant>,
    engine: Arc<ReactorHandle>,
    /// cuFile batch I/O and its device staging pool, set up on the first cuFile transfer.
    #[cfg(feature = "cuda")]
    gds: Option<crate::lane::cufile::GdsLane>,
    /// Why the cuFile lane could not be set up (asked once per engine).
    #[cfg(feature = "cuda")]
    gds_unavailable: Option<String>,
    /// SPDK queue pairs of the NVMe namespaces this engine has served, made on first use.
    spdk: Option<crate::lane::spdk::SpdkLane>,
    #[cfg(test)]
    panic_armed: bool,
}

/// How often the reactor reaps cuFile batch status while batch I/O is outstanding.
#[cfg(feature = "cuda")]
const GDS_POLL_INTERVAL: Duration = Duration::from_micros(20);

impl Reactor {
    pub(crate) fn new(
        rx: Receiver<Msg>,
        driver: Driver,
        engine: Arc<ReactorHandle>,
        cfg: ReactorConfig,
    ) -> Self {
        let arena = engine.arena.clone();
        let op_window = op_window(&arena);
        Reactor {
            rx,
            doorbell: engine.doorbell.clone(),
            backend: driver.name(),
            driver: Some(driver),
            slots: SlotAllocator::new(arena.block_size(), arena.blocks()),
            arena,
            ops: Slab::new(),
            runnable: VecDeque::new(),
            ios: Slab::new(),
            to_submit: VecDeque::new(),
            fence: RangeFence::default(),
            fenced: VecDeque::new(),
            op_window,
            window_blocked_ops: 0,
            cfg,
            shutting_down: false,
            shutdown_waiters: Vec::new(),
            completions: Vec::new(),
            gated: Vec::new(),
            compromised: false,
            short_of_slots: false,
            slots_returned: 0,
            stall: None,
            gates_polled: Instant::now(),
            last_work: Instant::now(),
            shutdown_started: None,
            engine,
            #[cfg(feature = "cuda")]
            gds: None,
            #[cfg(feature = "cuda")]
            gds_unavailable: None,
            spdk: None,
            #[cfg(test)]
            panic_armed: false,
        }
    }

    /// Returns a slot to the pool it came from.
    fn free_slot(&mut self, slot: BounceSlot) {
        self.slots_returned += 1;
        if slot.on_device {
            #[cfg(feature = "cuda")]
            if let Some(l) = self.gds.as_mut() {
                l.slots.free(slot);
                return;
            }
            debug_assert!(false, "device slot freed without a cuFile lane");
        } else {
            self.slots.free(slot);
        }
    }

    /// Bounce memory in flight outside the ring (cuFile batch entries).
    fn lane_outstanding(&self) -> usize {
        let spdk = self.spdk.as_ref().map_or(0, |l| l.outstanding());
        #[cfg(feature = "cuda")]
        if let Some(l) = &self.gds {
            return l.queue.outstanding() + spdk;
        }
        spdk
    }

    /// Runs until shutdown; on panic fails everything and leaks what the kernel may still use.
    pub(crate) fn run_to_end(mut self) {
        let outcome = catch_unwind(AssertUnwindSafe(|| self.run()));
        let death = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("kernel interface failed: {e}")),
            Err(panic) => Some(
                panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".to_string()),
            ),
        };
        // The reason is recorded before the engine reads as stopped, so that every refusal
        // from then on names it.
        if let Some(reason) = &death {
            let _ = self.engine.death.set(reason.clone());
        }
        self.engine.dead.store(true, Ordering::SeqCst);
        self.engine.close();
        match death {
            None => {
                for w in self.shutdown_waiters.drain(..) {
                    w.complete(Ok(0));
                }
            }
            Some(reason) => self.die(reason),
        }
        // Submissions that raced the close fail now, naming the death where there was one
        // (SubmitMsg's Drop would say only "shut down").
        while let Ok(msg) = self.rx.try_recv() {
            if let Msg::Submit(mut m) | Msg::Shutdown(mut m) = msg {
                m.refuse(|ctx| self.engine.refusal(ctx));
            }
        }
    }

    fn die(&mut self, reason: String) {
        tracing::error!(%reason, "gpuio reactor died");
        let in_kernel = self.ios.len() > self.fenced.len();
        for (_, op) in self.ops.iter_mut() {
            if !in_kernel {
                // Nothing can land in an owned buffer any more: it goes back with the error.
                if let Some(o) = op.owned.take() {
                    op.shared.give_back(o.keep);
                }
            }
            op.shared.complete(Err(Error::ReactorDied {
                ctx: Box::new(op.ctx(op.offset)),
                reason: reason.clone(),
            }));
        }
        for w in self.shutdown_waiters.drain(..) {
            w.complete(Err(Error::ReactorDied {
                ctx: Box::new(Context::op(OpKind::Shutdown)),
                reason: reason.clone(),
            }));
        }
        // The kernel may still write into bounce slots and the doorbell buffer: unless all of
        // it is accounted for, never unmap them. A dead engine leaks; it must not corrupt.
        if in_kernel || self.retire_doorbell().is_err() {
            // Owned buffers of ops with pieces in the kernel, too.
            std::mem::forget(std::mem::take(&mut self.ops));
            std::mem::forget(self.driver.take());
            std::mem::forget(self.spdk.take());
            std::mem::forget(self.arena.clone());
            #[cfg(feature = "cuda")]
            std::mem::forget(self.gds.take());
        }
        if self.compromised {
            std::mem::forget(self.arena.clone());
            #[cfg(feature = "cuda")]
            std::mem::forget(self.gds.take());
        }
        // Gated messages still held drop here and keep the pool mapped if their copy may run.
    }

    /// Completes the doorbell read so that the ring can be dropped without the kernel ever
    /// writing its (freed) buffer.
    fn retire_doorbell(&mut self) -> std::io::Result<()> {
        if let Some(Driver::Uring(d)) = self.driver.as_mut() {
            let bell = self.doorbell.clone();
            d.retire_doorbell(move || bell.ring_always())?;
        }
        Ok(())
    }

    fn run(&mut self) -> std::io::Result<()> {
        loop {
            #[cfg(test)]
            self.engine.turns.fetch_add(1, Ordering::Relaxed);
            loop {
                match self.rx.try_recv() {
                    Ok(m) => {
                        self.note_work();
                        self.handle(m);
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.begin_shutdown();
                        break;
                    }
                }
            }
            if !self.gated.is_empty()
                && (self.short_of_slots
                    || self.shutting_down
                    || self.gates_polled.elapsed() >= GATE_POLL_GAP)
            {
                self.poll_gates();
                self.gates_polled = Instant::now();
            }
            self.schedule();
            if self.shutting_down {
                self.enforce_shutdown_deadline();
                if self.ops.is_empty() && self.ios.is_empty() && self.gated.is_empty() {
                    debug_assert_eq!(self.lane_outstanding(), 0);
                    break;
                }
            }
            // Announce sleep, then look once more: a producer that pushed before seeing the
            // flag is caught here, one that pushes after it rings the doorbell.
            self.doorbell.prepare_sleep();
            let block = match self.rx.try_recv() {
                Ok(m) => {
                    self.doorbell.awake();
                    self.handle(m);
                    false
                }
                Err(TryRecvError::Empty) => true,
                Err(TryRecvError::Disconnected) => {
                    self.doorbell.awake();
                    self.begin_shutdown();
                    false
                }
            };
            #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
            let mut timeout = (!self.gated.is_empty()).then_some(GATE_POLL_INTERVAL);
            if timeout.is_none() && !self.ios.is_empty() && !self.cfg.tick.is_zero() {
                // Look again soon even if nothing rings: measured faster for small requests
                // than relying on the doorbell alone (see `EngineBuilder::reactor_tick`).
                // Only while I/O is in the kernel, so leaked operations (open for good) never
                // keep an otherwise idle reactor waking.
                timeout = Some(self.cfg.tick);
            }
            if self.stall.is_some() {
                // Nothing may ring while the pool is stalled: look again in time to grow it
                // or fail the waiting ops.
                let look = (self.cfg.pool_wait_limit / 20)
                    .clamp(Duration::from_millis(1), Duration::from_millis(50));
                timeout = Some(timeout.map_or(look, |t| t.min(look)));
            }
            let mut block = block;
            if block
                && !self.cfg.spin.is_zero()
                && !self.ops.is_empty()
                && !self.shutting_down
                && self.last_work.elapsed() < self.cfg.spin
            {
                // Work was found a moment ago: the next request or completion is likely near,
                // and catching it without sleeping saves its producer a doorbell and this
                // thread a wake-up (see `EngineBuilder::reactor_spin`).
                self.doorbell.awake();
                block = false;
                std::hint::spin_loop();
            }
            #[cfg(feature = "cuda")]
            if let Some(l) = self.gds.as_mut() {
                l.queue.submit(&mut self.completions);
                if l.queue.outstanding() > 0 {
                    timeout = Some(GDS_POLL_INTERVAL);
                }
                block &= self.completions.is_empty();
            }
            if self.spdk.as_ref().is_some_and(|l| l.busy()) {
                // NVMe completions are found only by polling: spin while commands are out.
                block = false;
            }
            let driver = self.driver.as_mut().expect("driver present while running");
            driver.wait(block, timeout, &mut self.completions)?;
            self.doorbell.awake();
            if let Some(l) = self.spdk.as_mut() {
                let before = self.completions.len();
                l.reap(&mut self.completions);
                if self.completions.len() == before && l.busy() {
                    // Nothing yet: let the threads that consume completions (often on the same
                    // core) run before polling again.
                    std::thread::yield_now();
                }
            }
            #[cfg(feature = "cuda")]
            if let Some(l) = self.gds.as_mut() {
                l.queue.reap(&mut self.completions);
            }
            let done = std::mem::take(&mut self.completions);
            if !done.is_empty() {
                self.note_work();
            }
            for c in &done {
                self.on_completion(*c);
            }
            self.completions = done;
            self.completions.clear();
        }
        self.retire_doorbell()?;
        // Dropping the driver closes the ring (or joins the pool) with nothing in flight.
        self.driver.take();
        if self.compromised {
            // A copy engine may still touch bounce memory: keep it mapped (and pinned) forever.
            std::mem::forget(self.arena.clone());
            #[cfg(feature = "cuda")]
            std::mem::forget(self.gds.take());
        }
        Ok(())
    }

    /// Records that work was found, for the spin (a clock read per message only when
    /// spinning is on).
    fn note_work(&mut self) {
        if !self.cfg.spin.is_zero() {
            self.last_work = Instant::now();
        }
    }

    /// Acts on gated messages whose gate opened.
    fn poll_gates(&mut self) {
        if self.gated.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.gated.len() {
            let state = self.gated[i].gate.poll();
            if let GateState::Closed = state {
                i += 1;
                continue;
            }
            let Some(msg) = self.gated.swap_remove(i).take() else {
                continue;
            };
            match state {
                GateState::Broken(reason) => {
                    tracing::error!(%reason, "CUDA event failed; leaking its bounce slots");
                    self.abandon_msg(msg);
                }
                _ => self.handle(msg),
            }
        }
    }

    /// Accounts for the pieces in `msg` without ever reusing their slots.
    fn abandon_msg(&mut self, msg: Msg) {
        self.compromised = true;
        match msg {
            Msg::Filled(shared, pieces) | Msg::Abandon(shared, pieces) => {
                self.handle(Msg::Abandon(shared, pieces));
            }
            Msg::Release(..) => {}
            #[cfg(feature = "cuda")]
            Msg::StreamDone(done) => {
                // The stream may still write the parameter block: fail the op, keep the block.
                done.shared.complete(Err(Error::cuda_msg(
                    Context::op(done.op).with_path(&done.file.path),
                    "the stream never finished the cuFile operation",
                )));
                std::mem::forget(done);
            }
            #[cfg(feature = "cuda")]
            Msg::StreamIdle(shared) => shared.complete(Err(Error::cuda_msg(
                Context::op(OpKind::Sync).with_backend("cuda"),
                "the stream's event failed",
            ))),
            Msg::Gated(mut g) => {
                if let Some(inner) = g.take() {
                    self.abandon_msg(inner);
                }
            }
            other => self.handle(other),
        }
    }

    /// Shutdown must not hang on CUDA work that never finishes: past the deadline, leak it.
    fn enforce_shutdown_deadline(&mut self) {
        let started = *self.shutdown_started.get_or_insert_with(Instant::now);
        if self.gated.is_empty() || started.elapsed() < GATE_SHUTDOWN_DEADLINE {
            return;
        }
        tracing::error!(
            pending = self.gated.len(),
            "CUDA copies did not finish within the shutdown deadline; leaking the bounce pool"
        );
        for mut g in std::mem::take(&mut self.gated) {
            if let Some(msg) = g.take() {
                self.abandon_msg(msg);
            }
        }
    }

    fn begin_shutdown(&mut self) {
        if self.shutting_down {
            return;
        }
        self.shutting_down = true;
        self.shutdown_started = Some(Instant::now());
        let keys: Vec<usize> = self.ops.iter().map(|(k, _)| k).collect();
        for key in keys {
            let op = &mut self.ops[key];
            if op.error.is_none() && !op.cancelled {
                op.error = Some(Error::shutdown(op.ctx(op.offset)));
            }
            self.reclaim(key);
            self.maybe_finish(key);
        }
    }

    /// Takes back slots an op's future has not picked up.
    fn reclaim(&mut self, key: usize) {
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

    fn is_live(&self, key: usize, shared: &Arc<OpShared>) -> bool {
        self.ops
            .get(key)
            .is_some_and(|o| Arc::ptr_eq(&o.shared, shared))
    }

    /// Frees a slot `key` held, and puts the op back in the run queue if the window had
    /// stopped it.
    fn free_op_slot(&mut self, key: usize, slot: BounceSlot) {
        self.free_slot(slot);
        let op = &mut self.ops[key];
        op.held_bytes -= slot.size();
        if op.window_blocked && op.held_bytes < self.op_window {
            op.window_blocked = false;
            self.window_blocked_ops -= 1;
            if !op.in_runnable {
                op.in_runnable = true;
                self.runnable.push_back(key);
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Submit(mut m) => {
                let (Some(shared), Some(req)) = (m.shared.take(), m.req.take()) else {
                    return;
                };
                self.accept(shared, req);
            }
            Msg::Release(shared, slots) => {
                let key = shared.key();
                let live = self.is_live(key, &shared);
                for s in slots {
                    if live {
                        self.free_op_slot(key, s);
                    } else {
                        self.free_slot(s);
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
                        self.free_slot(p.slot);
                    }
                }
                if live {
                    self.maybe_finish(key);
                }
            }
            Msg::Cancel(shared) => {
                let key = shared.key();
                if self.is_live(key, &shared) {
                    self.ops[key].cancelled = true;
                    self.reclaim(key);
                    self.maybe_finish(key);
                } else {
                    // The op had already finished, but its future was dropped before taking
                    // the last pieces handed to it: their slots belong to nobody now.
                    for p in shared.reclaim_ready() {
                        self.free_slot(p.slot);
                    }
                }
            }
            Msg::Gated(g) => self.gated.push(g),
            #[cfg(feature = "cuda")]
            Msg::StreamDone(done) => {
                let r = done.result();
                done.shared.complete(r);
            }
            #[cfg(feature = "cuda")]
            Msg::StreamIdle(shared) => shared.complete(Ok(0)),
            #[cfg(test)]
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
                    if op.error.is_none() {
                        let ctx = op.ctx(op.offset);
                        op.error = Some(Error::cuda_msg(ctx, "device copy failed"));
                    }
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

    fn accept(&mut self, shared: Arc<OpShared>, req: OpRequest) {
        let kind = req.op_kind();
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
            } => (file, offset, len, device, None),
            OpRequest::Sync { file } => (file, 0, 0, None, None),
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
        let gds = match self.choose_gds(&file, device.as_ref(), &shared) {
            Ok(Some((gds_align, name))) => {
                align = align.max(gds_align);
                write_align = write_align.max(gds_align);
                backend = name;
                ctx = ctx.with_backend(name);
                true
            }
            Ok(None) => false,
            Err(reason) => {
                let e = Error::unsupported(ctx.with_backend("cufile"), reason);
                refuse(&shared, owned, e);
                return;
            }
        };
        let chunk = match &file.nvme {
            Some(ns) => {
                backend = "spdk";
                ns.chunk(self.cfg.chunk_size)
            }
            None => self.cfg.chunk_size,
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
        if owned.is_some() && (gds || file.nvme.is_some() || !plan.covers_exactly(offset, len)) {
            // The file layer offers owned reads only where pieces cover exactly the caller's
            // range in host memory; anything else would write outside the buffer.
            let e = Error::invalid(ctx, "owned read offered where it cannot land in place");
            refuse(&shared, owned, e);
            return;
        }
        let empty = plan.len() == 0;
        let key = self.ops.insert(OpEntry {
            shared: shared.clone(),
            file,
            kind,
            plan,
            offset,
            len,
            next: 0,
            busy: 0,
            in_runnable: !empty,
            held_bytes: 0,
            window_blocked: false,
            eof_at: None,
            error: None,
            error_at: None,
            cancelled: false,
            align,
            gds,
            backend,
            retry: Vec::new(),
            owned,
        });
        shared.key.store(key, Ordering::Relaxed);
        if empty {
            self.maybe_finish(key);
        } else {
            self.runnable.push_back(key);
        }
    }

    /// Whether an op with caller memory on `device` goes through cuFile: `Ok(Some((alignment,
    /// backend name)))` if so, `Ok(None)` for the bounce path, `Err` where cuFile is forced
    /// (`Backend::Gds`) but cannot serve.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn choose_gds(
        &mut self,
        file: &Arc<Target>,
        device: Option<&DeviceCtx>,
        shared: &Arc<OpShared>,
    ) -> std::result::Result<Option<(u64, &'static str)>, String> {
        #[cfg(feature = "cuda")]
        {
            let (Some(ctx), Some(fg)) = (device, file.gds()) else {
                return Ok(None);
            };
            if !fg.serves() {
                return Ok(None);
            }
            match self.gds_lane(ctx) {
                Ok(lane) => {
                    let _ = shared.staging.set(lane.pool.clone());
                    Ok(Some((fg.align, fg.status().backend_name())))
                }
                Err(reason) if fg.forced() => Err(reason),
                Err(_) => Ok(None),
            }
        }
        #[cfg(not(feature = "cuda"))]
        Ok(None)
    }

    /// The cuFile lane for memory on `ctx`'s device, set up on first use.
    #[cfg(feature = "cuda")]
    fn gds_lane(
        &mut self,
        ctx: &Arc<cudarc::driver::CudaContext>,
    ) -> std::result::Result<&mut crate::lane::cufile::GdsLane, String> {
        if self.gds.is_none() {
            if let Some(why) = &self.gds_unavailable {
                return Err(why.clone());
            }
            let bytes = self.arena.block_size() * self.arena.blocks();
            match crate::lane::cufile::GdsLane::new(
                ctx,
                self.arena.block_size(),
                self.arena.blocks(),
            ) {
                Ok(l) => {
                    tracing::info!(bytes, device = ctx.ordinal(), "gpuio cuFile lane ready");
                    self.gds = Some(l);
                }
                Err(why) => {
                    tracing::warn!(%why, "gpuio cannot set up cuFile batch I/O; device transfers use the bounce path");
                    self.gds_unavailable = Some(why.clone());
                    return Err(why);
                }
            }
        }
        let lane = self.gds.as_mut().expect("set above");
        if lane.pool.context().ordinal() != ctx.ordinal() {
            return Err(format!(
                "this engine's cuFile staging pool is on GPU {}; memory on GPU {} uses the bounce path",
                lane.pool.context().ordinal(),
                ctx.ordinal()
            ));
        }
        Ok(lane)
    }

    /// Starts pieces while the queue depth and the bounce pool allow.
    fn schedule(&mut self) {
        self.unfence();
        let qd = self.cfg.queue_depth;
        while self.ios.len() < qd {
            let Some((key, p)) = self.to_submit.pop_front() else {
                break;
            };
            if self.ops[key].stopped() {
                self.ops[key].busy -= 1;
                self.free_op_slot(key, p.slot);
                self.maybe_finish(key);
                continue;
            }
            self.submit_io(key, IoKind::Write, p.piece, Some(p.slot));
        }
        let mut starved = false;
        let mut starved_on_device = false;
        while let Some(&key) = self.runnable.front() {
            let op = &mut self.ops[key];
            if op.all_started() {
                self.runnable.pop_front();
                op.in_runnable = false;
                self.maybe_finish(key);
                continue;
            }
            let (piece, retried) = match op.retry.last() {
                Some(p) => (*p, true),
                None => (op.plan.piece(op.next), false),
            };
            if !retried && op.kind == OpKind::Read && op.eof_at.is_some_and(|e| piece.pos >= e) {
                // Past a known end of file: nothing to read.
                op.next += 1;
                continue;
            }
            // Writes also count filled pieces waiting for the kernel. Pieces out for filling
            // are bounded per op by the window instead: a leaked write holds them forever,
            // and must not stop other ops.
            let room = match op.kind {
                OpKind::Write => self.ios.len() + self.to_submit.len() < qd,
                _ => self.ios.len() < qd,
            };
            if !room {
                break;
            }
            let slot = if op.kind == OpKind::Sync || op.owned.is_some() {
                // Fsync needs no memory; an owned read lands in the caller's buffer.
                None
            } else {
                if op.held_bytes > 0 && op.held_bytes + piece.len > self.op_window {
                    // This op holds its share of the pool; let others run until it gives
                    // slots back (free_op_slot re-queues it).
                    op.window_blocked = true;
                    self.window_blocked_ops += 1;
                    op.in_runnable = false;
                    self.runnable.pop_front();
                    continue;
                }
                let on_device = op.gds && piece.via == Via::Main;
                let got = if on_device {
                    #[cfg(feature = "cuda")]
                    {
                        self.gds.as_mut().and_then(|l| l.slots.alloc(piece.len))
                    }
                    #[cfg(not(feature = "cuda"))]
                    None
                } else {
                    self.slots.alloc(piece.len)
                };
                match got {
                    Some(s) => {
                        op.held_bytes += s.size();
                        Some(s)
                    }
                    None => {
                        let fits = if on_device {
                            #[cfg(feature = "cuda")]
                            {
                                self.gds
                                    .as_ref()
                                    .is_none_or(|l| l.slots.order_for(piece.len).is_some())
                            }
                            #[cfg(not(feature = "cuda"))]
                            true
                        } else {
                            self.slots.order_for(piece.len).is_some()
                        };
                        if !fits {
                            // Waiting would never end: no slot of this size exists. The
                            // planner never makes such pieces (its fuzz target checks that);
                            // if one ever appears, fail the op rather than hang.
                            op.error = Some(Error::invalid(
                                op.ctx(piece.pos),
                                format!(
                                    "a {}-byte piece exceeds the largest bounce slot",
                                    piece.len
                                ),
                            ));
                            continue;
                        }
                        starved = true;
                        starved_on_device = on_device;
                        break;
                    }
                }
            };
            if retried {
                op.retry.pop();
            } else {
                op.next += 1;
            }
            op.busy += 1;
            // Round-robin between ops so one huge request cannot starve small ones.
            self.runnable.pop_front();
            if !op.all_started() {
                self.runnable.push_back(key);
            } else {
                op.in_runnable = false;
            }
            match (op.kind, slot) {
                (OpKind::Write, Some(slot)) => {
                    op.shared.push_ready(ReadyPiece {
                        piece,
                        valid: piece.len,
                        slot,
                    });
                }
                (OpKind::Sync, _) => self.submit_io(key, IoKind::Fsync, piece, None),
                (_, slot) => self.submit_io(key, IoKind::Read, piece, slot),
            }
        }
        self.short_of_slots = starved || self.window_blocked_ops > 0;
        self.doorbell.set_starved(self.short_of_slots);
        if starved {
            if self.check_pool_stall(starved_on_device) {
                // New memory: start what waited for it (growth is bounded, so is this).
                self.schedule();
            }
        } else {
            self.stall = None;
        }
    }

    /// Ops wait for bounce memory: fine while anything in flight (the kernel, a lane, a CUDA
    /// gate, a queued write) will give some back, or while futures keep giving slots back.
    /// When none came back for a while and nothing can, the slots are with futures that do
    /// not poll (leaked, or forgotten by their owner): grow the host pool by an op's window,
    /// and once it cannot grow, fail the waiting ops rather than let them wait for good.
    /// Returns whether the pool grew.
    fn check_pool_stall(&mut self, on_device: bool) -> bool {
        let in_flight = !self.ios.is_empty()
            || !self.to_submit.is_empty()
            || !self.gated.is_empty()
            || self.lane_outstanding() > 0;
        if in_flight {
            // The common case under load (a busy pool is starved on most passes): memory will
            // come back by itself, and no clock is read.
            self.stall = None;
            return false;
        }
        let now = Instant::now();
        let returned = self.slots_returned;
        let fresh = PoolStall {
            since: now,
            returned,
            on_device,
        };
        let stall = self.stall.get_or_insert(fresh);
        if stall.returned != returned || stall.on_device != on_device {
            *stall = fresh;
            return false;
        }
        let waited = now.duration_since(stall.since);
        let limit = self.cfg.pool_wait_limit;
        if !on_device && waited >= limit / 10 && self.grow_pool() {
            self.stall = None;
            return true;
        }
        if waited >= limit {
            self.stall = None;
            self.fail_starved(on_device);
        }
        false
    }

    /// Adds up to one op window of reserve blocks to the host pool; false at the limit.
    fn grow_pool(&mut self) -> bool {
        let block = self.arena.block_size();
        let have = self.slots.total() / block;
        let room = self.arena.capacity_blocks().saturating_sub(have);
        if room == 0 {
            return false;
        }
        let blocks = (self.op_window / block).max(1).min(room);
        self.slots.grow(blocks);
        tracing::warn!(
            added = blocks * block,
            total = (have + blocks) * block,
            "gpuio bounce pool held by futures that stopped polling (leaked?); grown"
        );
        true
    }

    /// Fails every op waiting for memory of the stalled pool.
    fn fail_starved(&mut self, on_device: bool) {
        #[cfg(feature = "cuda")]
        let device_pool = self.gds.as_ref().map_or(0, |l| l.slots.total());
        #[cfg(not(feature = "cuda"))]
        let device_pool = 0;
        let pool = if on_device {
            device_pool
        } else {
            self.slots.total()
        };
        tracing::error!(
            pool,
            waiting = self.runnable.len(),
            "gpuio bounce pool held by futures that stopped polling; failing the ops waiting for it"
        );
        let keys: Vec<usize> = self.runnable.iter().copied().collect();
        for key in keys {
            let op = &mut self.ops[key];
            // Only ops that take memory from the stalled pool: host ops behind a cuFile op
            // starved of device staging (which never grows) keep waiting for the host pool.
            if op.kind == OpKind::Sync || op.owned.is_some() || op.stopped() || op.gds != on_device
            {
                continue;
            }
            op.error = Some(Error::PoolExhausted {
                ctx: Box::new(op.ctx(op.offset)),
                pool,
            });
            self.maybe_finish(key);
        }
    }

    fn submit_io(&mut self, key: usize, kind: IoKind, piece: Piece, slot: Option<BounceSlot>) {
        let op = &self.ops[key];
        let ticket = (kind != IoKind::Fsync).then(|| {
            // Widened to the file's grain: a page for O_DIRECT files (whose buffered write
            // edges must not share a page with another op's direct piece), a sector for NVMe.
            let grain = op.align.max(op.file.write_align);
            self.fence.start(
                op.file.fence_key,
                piece.pos,
                piece.len as u64,
                grain,
                key,
                kind == IoKind::Write,
            )
        });
        let blocked = ticket.as_ref().is_some_and(|t| self.fence.blocked(t));
        let token = self.ios.insert(InflightIo {
            op: key,
            kind,
            piece,
            slot,
            done: 0,
            ticket,
        });
        if blocked {
            self.fenced.push_back(token);
        } else {
            self.push_io(token);
        }
    }

    /// Sends fenced pieces whose earlier overlapping writes have completed to the kernel, and
    /// drops those of cancelled ops (they never reach the kernel). Pieces of ops that failed
    /// still run: every piece below the failing offset is then written, so the offset the
    /// error names is the first byte not transferred.
    fn unfence(&mut self) {
        let mut i = 0;
        while i < self.fenced.len() {
            let token = self.fenced[i];
            let io = &self.ios[token];
            if self.ops[io.op].cancelled {
                self.fenced.remove(i);
                self.drop_unstarted(token);
                continue;
            }
            if io.ticket.as_ref().is_some_and(|t| self.fence.blocked(t)) {
                i += 1;
                continue;
            }
            self.fenced.remove(i);
            self.push_io(token);
        }
    }

    /// Forgets a piece that never reached the kernel.
    fn drop_unstarted(&mut self, token: usize) {
        let io = self.ios.remove(token);
        if let Some(t) = &io.ticket {
            self.fence.release(t);
        }
        self.ops[io.op].busy -= 1;
        if let Some(slot) = io.slot {
            self.free_op_slot(io.op, slot);
        }
        self.maybe_finish(io.op);
    }

    /// (Re)submits the unfinished remainder of in-flight I/O `token`.
    fn push_io(&mut self, token: usize) {
        let io = &self.ios[token];
        let file = &self.ops[io.op].file;
        #[cfg(feature = "cuda")]
        if let Some(s) = io.slot.filter(|s| s.on_device) {
            let (Some(lane), Some(fg)) = (self.gds.as_mut(), file.gds()) else {
                unreachable!("device slots exist only with a cuFile lane and a registered file");
            };
            lane.queue.push(crate::gds::batch::BatchEntry {
                fh: fg.handle.raw(),
                dev_base: lane.pool.base(),
                dev_offset: s.offset + io.done,
                file_offset: io.piece.pos + io.done as u64,
                len: io.piece.len - io.done,
                write: io.kind == IoKind::Write,
                token: token as u64,
            });
            return;
        }
        if let Some(ns) = &file.nvme {
            let buf = match &io.slot {
                // SAFETY: `done <= piece.len <= slot size`, so the pointer stays in the slot.
                Some(s) => unsafe { self.arena.slot_ptr(s).add(io.done) },
                None => std::ptr::null_mut(),
            };
            let (kind, partial) = (io.kind, io.piece.via == Via::Buffered);
            let (pos, len) = (io.piece.pos + io.done as u64, io.piece.len - io.done);
            let ns = ns.clone();
            self.spdk
                .get_or_insert_with(crate::lane::spdk::SpdkLane::new)
                .submit(
                    &ns,
                    crate::lane::spdk::LaneIo {
                        token: token as u64,
                        kind,
                        partial,
                        buf,
                        pos,
                        len,
                    },
                );
            return;
        }
        let fd = match io.piece.via {
            Via::Main => file.raw_fd(),
            Via::Buffered => file.buffered_raw_fd(),
        };
        let op = &self.ops[io.op];
        let (buf, fixed) = match (&io.slot, &op.owned) {
            (Some(s), _) => {
                // SAFETY: `done <= piece.len <= slot size`, so the pointer stays in the slot.
                let p = unsafe { self.arena.slot_ptr(s).add(io.done) };
                // Only the pool proper is registered; growth blocks are plain memory.
                let block = self.slots.block_of(s);
                let fixed = (block < self.arena.blocks()
                    && self.driver.as_ref().is_some_and(Driver::uses_fixed_buffers))
                .then_some(block as u16);
                (p, fixed)
            }
            // `accept` checked that the pieces cover exactly `[offset, offset + len)`, the
            // buffer's bytes, so `pos - offset + done < len`: the address stays inside the
            // buffer, which the op owns until every piece has completed. The kernel is the
            // only writer meanwhile (the future holds no access to it).
            (None, Some(o)) => (
                (o.addr + (io.piece.pos - op.offset) as usize + io.done) as *mut u8,
                None,
            ),
            (None, None) => (std::ptr::null_mut(), None),
        };
        // Buffered pieces large enough to be worth a kernel worker go to io-wq, so page-cache
        // hits are copied by many threads; small ones stay inline (a punt costs a switch).
        let buffered = io.piece.via == Via::Buffered || file.align == 1;
        let punt = self
            .cfg
            .punt_min
            .is_some_and(|m| buffered && io.piece.len - io.done >= m)
            && io.kind != IoKind::Fsync;
        let req = IoRequest {
            punt,
            kind: io.kind,
            fd,
            buf,
            len: (io.piece.len - io.done) as u32,
            pos: io.piece.pos + io.done as u64,
            fixed,
            token: token as u64,
        };
        let driver = self.driver.as_mut().expect("driver present while running");
        if let Err(e) = driver.push(req) {
            let res = -e.raw_os_error().unwrap_or(libc::EIO);
            self.on_completion(Completion {
                token: token as u64,
                res,
            });
        }
    }

    fn on_completion(&mut self, c: Completion) {
        #[cfg(test)]
        if self.panic_armed {
            panic!("injected reactor panic (test)");
        }
        let token = c.token as usize;
        let Some(io) = self.ios.get_mut(token) else {
            debug_assert!(false, "completion for unknown token {token}");
            return;
        };
        let key = io.op;
        let res = c.res;
        #[cfg(feature = "cuda")]
        if io.slot.is_some_and(|s| s.on_device)
            && (res == crate::gds::batch::RES_LOST
                || crate::gds::batch::cufile_code_of(res).is_some())
        {
            self.on_cufile_failure(token, res);
            return;
        }
        if res == -libc::EINTR || res == -libc::EAGAIN {
            self.push_io(token);
            return;
        }
        let align = self.ops[key].align;
        let mut failure = None;
        let mut eof = false;
        if res < 0 {
            failure = Some(res);
        } else {
            let n = res as usize;
            io.done += n;
            match io.kind {
                IoKind::Read => {
                    // Zero bytes, or a partial block under O_DIRECT, means end of file.
                    eof = n == 0 || (n as u64 % align != 0);
                }
                IoKind::Write if n == 0 => failure = Some(-libc::EIO),
                _ => {}
            }
            if failure.is_none() && !eof && io.done < io.piece.len && io.kind != IoKind::Fsync {
                self.push_io(token);
                return;
            }
        }
        let io = self.ios.remove(token);
        if let Some(t) = &io.ticket {
            self.fence.release(t);
        }
        let op = &mut self.ops[key];
        op.busy -= 1;
        if let Some(res) = failure {
            let pos = io.piece.pos + io.done as u64;
            let earlier = op.error_at.is_some_and(|at| pos < at);
            if op.error.is_none() || earlier {
                op.error = Some(Error::from_cqe(op.ctx(pos), res));
                op.error_at = Some(pos);
            }
        }
        if io.kind == IoKind::Read && io.done < io.piece.len && failure.is_none() {
            let at = io.piece.pos + io.done as u64;
            op.eof_at = Some(op.eof_at.map_or(at, |e| e.min(at)));
        }
        if let Some(slot) = io.slot {
            if io.kind == IoKind::Read && !op.stopped() && io.done > 0 {
                op.shared.push_ready(ReadyPiece {
                    piece: io.piece,
                    valid: io.done,
                    slot,
                });
            } else {
                self.free_op_slot(key, slot);
            }
        }
        self.maybe_finish(key);
    }

    /// A cuFile batch entry failed with a cuFile status (or was lost): fall back to the bounce
    /// path for the file where the status says cuFile cannot serve it (unless forced), else fail.
    #[cfg(feature = "cuda")]
    fn on_cufile_failure(&mut self, token: usize, res: i32) {
        use crate::gds::batch::{RES_LOST, cufile_code_of};
        use crate::gds::driver::CufileCode;
        let io = self.ios.remove(token);
        if let Some(t) = &io.ticket {
            self.fence.release(t);
        }
        let key = io.op;
        let slot = io.slot.expect("cuFile entries carry a device slot");
        let pos = io.piece.pos + io.done as u64;
        let op = &mut self.ops[key];
        op.busy -= 1;
        let lost = res == RES_LOST;
        let (why, fallback) = if lost {
            // cuFile cannot say whether the DMA still runs: never reuse that memory.
            self.compromised = true;
            op.held_bytes -= slot.size();
            (
                "cuFile lost track of a batch I/O (status query failed or stalled)".to_string(),
                true,
            )
        } else {
            let code = CufileCode {
                err: cufile_code_of(res).unwrap_or(5030),
                cu_err: 0,
            };
            (
                format!("cuFile batch I/O failed: {code}"),
                code.calls_for_fallback(),
            )
        };
        let fg = op.file.gds().expect("cuFile ops have a registered file");
        if !fg.forced() && fallback && !op.stopped() {
            // AUTO: the piece is read again through the bounce path (a new slot), and the file
            // stays there from now on.
            fg.fall_back(&op.file.path, why);
            op.gds = false;
            op.backend = self.backend;
            op.retry.push(io.piece);
            if !op.in_runnable && !op.window_blocked {
                op.in_runnable = true;
                self.runnable.push_back(key);
            }
        } else if op.error.is_none() {
            op.error = Some(Error::cuda_msg(op.ctx(pos), why));
            op.error_at = Some(pos);
        }
        if !lost {
            self.free_op_slot(key, slot);
        }
        self.maybe_finish(key);
    }

    /// Completes and removes `key` once nothing of it is outstanding.
    fn maybe_finish(&mut self, key: usize) {
        let op = &self.ops[key];
        if !op.all_started() || op.busy > 0 {
            return;
        }
        let mut op = self.ops.remove(key);
        if op.window_blocked {
            self.window_blocked_ops -= 1;
        }
        if op.in_runnable {
            self.runnable.retain(|&k| k != key);
        }
        if let Some(o) = op.owned.take() {
            // Nothing of the op is in the kernel any more: the buffer may go back (or, for a
            // dropped future, be freed here).
            op.shared.give_back(o.keep);
        }
        let result = match op.error.take() {
            Some(e) => Err(e),
            None if op.cancelled => return,
            None => match op.kind {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::gate::Gate;

    struct FixedGate(fn() -> GateState);

    impl Gate for FixedGate {
        fn poll(&self) -> GateState {
            (self.0)()
        }
    }

    fn gated(state: fn() -> GateState, arena: &Arc<BounceArena>) -> Gated {
        let release = Msg::Release(OpShared::new(), Vec::new());
        Gated::new(Box::new(FixedGate(state)), release, arena)
    }

    /// A gated message dropped before the reactor acted on it keeps the pool mapped unless its
    /// copy is known to be finished; one the reactor took over does not.
    #[test]
    fn undelivered_gated_message_keeps_the_pool_mapped() {
        let arena = Arc::new(BounceArena::new(1 << 16, 1, 0).unwrap());
        drop(gated(|| GateState::Open, &arena));
        assert_eq!(Arc::strong_count(&arena), 1, "finished copy: nothing kept");
        drop(gated(|| GateState::Closed, &arena));
        assert_eq!(
            Arc::strong_count(&arena),
            2,
            "running copy: pool kept mapped"
        );
        drop(gated(|| GateState::Broken("x".into()), &arena));
        assert_eq!(
            Arc::strong_count(&arena),
            3,
            "unknown copy: pool kept mapped"
        );
        let mut taken = gated(|| GateState::Closed, &arena);
        assert!(taken.take().is_some());
        drop(taken);
        assert_eq!(
            Arc::strong_count(&arena),
            3,
            "reactor took it over: nothing more kept"
        );
    }

    /// A panic in the reactor with reads in the kernel: every pending future fails with
    /// `ReactorDied` naming the panic, nothing hangs, the engine reports itself dead and
    /// refuses later work with the same reason.
    /// An 8 MiB file, a runtime, and small engines (64 KiB pieces, 8 in the kernel) on each
    /// backend this machine has, for the reactor panic tests: `each(backend, engine, file,
    /// runtime)` per engine.
    fn with_panic_fixture(
        test: &str,
        mut each: impl FnMut(crate::Backend, &crate::Engine, &crate::File, &tokio::runtime::Runtime),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, vec![7u8; 8 << 20]).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        for backend in [crate::Backend::Uring, crate::Backend::Pread] {
            let engine = match crate::Engine::builder()
                .backend(backend)
                .chunk_size(64 << 10)
                .queue_depth(8)
                .bounce_slots(16)
                .build()
            {
                Ok(e) => e,
                Err(e) => {
                    eprintln!("SKIPPED {backend:?} in {test}: {e}");
                    continue;
                }
            };
            let file = engine.open(&path).unwrap();
            each(backend, &engine, &file, &rt);
        }
    }

    #[test]
    fn reactor_panic_fails_pending_ops_and_marks_the_engine_dead() {
        with_panic_fixture("the reactor panic test", |backend, engine, file, rt| {
            rt.block_on(async {
                let mut bufs: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; 1 << 20]).collect();
                // Armed first: the first completion of any of these reads panics the reactor,
                // so none can finish, whatever the timing.
                engine.shared().send(Msg::PanicAtNextCompletion);
                let futs: Vec<_> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| file.read_into(b, (i as u64 % 8) << 20))
                    .collect();
                let results =
                    tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(futs))
                        .await
                        .expect("futures hung after the reactor panicked");
                for r in results {
                    match r {
                        Err(Error::ReactorDied { reason, .. }) => {
                            assert!(reason.contains("injected reactor panic"), "{reason}")
                        }
                        other => panic!("{backend:?}: expected ReactorDied, got {other:?}"),
                    }
                }
                assert!(engine.is_shut_down());
                assert!(engine.failure().unwrap().contains("injected"));
                let mut b = vec![0u8; 10];
                let e = file.read_into(&mut b, 0).await.unwrap_err();
                assert!(matches!(e, Error::ReactorDied { .. }), "{e}");
                assert!(e.to_string().contains("reactor thread died"), "{e}");
                let e = file.sync_all().await.unwrap_err();
                assert!(matches!(e, Error::ReactorDied { .. }), "{e}");
                let e = engine.shutdown().await.unwrap_err();
                assert!(matches!(e, Error::ReactorDied { .. }), "{e}");
            });
        });
    }

    /// Owned reads in the kernel when the reactor dies: each fails with `ReactorDied`, and
    /// its buffer is leaked (an empty one comes back), never freed while a piece may land.
    #[test]
    fn reactor_panic_leaks_owned_buffers_in_flight() {
        with_panic_fixture("the owned-read panic test", |backend, engine, file, rt| {
            rt.block_on(async {
                // Armed first: the first completion panics the reactor with the other pieces
                // of these reads (8 in the kernel at a time) still out.
                engine.shared().send(Msg::PanicAtNextCompletion);
                let futs: Vec<_> = (0..4u64)
                    .map(|i| file.read_owned(vec![0u8; 1 << 20], i << 20))
                    .collect();
                let results =
                    tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(futs))
                        .await
                        .expect("owned reads hung after the reactor panicked");
                let mut leaked = 0;
                for (r, v) in results {
                    assert!(
                        matches!(r, Err(Error::ReactorDied { .. })),
                        "{backend:?}: expected ReactorDied, got {r:?}"
                    );
                    if v.is_empty() {
                        leaked += 1;
                    } else {
                        // Only a read that never reached the kernel (refused after the death)
                        // may come back, untouched.
                        assert!(
                            v.len() == 1 << 20 && v.iter().all(|&b| b == 0),
                            "{backend:?}"
                        );
                    }
                }
                // The read whose completion set off the panic had pieces in the kernel.
                assert!(
                    leaked >= 1,
                    "{backend:?}: a buffer the kernel may write came back"
                );
            });
        });
    }

    /// Linux 5.6–5.10 have no `IORING_ENTER_EXT_ARG`: timed waits then go through a timeout
    /// SQE. Forced here on a kernel that has it: the engine says which path it took, reads and
    /// writes of many pieces (timed waits while they are in the kernel) are correct, an idle
    /// engine sleeps, and shutdown drains with no stray completion.
    #[test]
    fn timed_waits_without_ext_arg_use_a_timeout_sqe() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        let engine = match crate::Engine::builder()
            .backend(crate::Backend::Uring)
            .chunk_size(64 << 10)
            .queue_depth(8)
            .reactor_tick(Duration::from_micros(100))
            .without_ext_arg()
            .build()
        {
            Ok(e) => e,
            Err(e) => {
                eprintln!("SKIPPED: the no-EXT_ARG test needs io_uring: {e}");
                return;
            }
        };
        assert!(
            engine.backend().detail.contains("timeout SQE"),
            "{}",
            engine.backend().detail
        );
        let file = crate::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .open(&engine, &path)
            .unwrap();
        let data: Vec<u8> = (0..(8u32 << 20))
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            for round in 0..4u64 {
                let off = round * 12345;
                assert_eq!(file.write_from(&data[..], off).await.unwrap(), data.len());
                let mut back = vec![0u8; data.len()];
                assert_eq!(
                    file.read_into(&mut back[..], off).await.unwrap(),
                    data.len()
                );
                assert!(back == data, "round {round}");
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        let before = engine.shared().turns.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(200));
        let turns = engine.shared().turns.load(Ordering::Relaxed) - before;
        assert!(turns < 50, "idle reactor turned {turns} times in 200 ms");
        rt.block_on(engine.shutdown()).unwrap();
    }

    /// The tick wakes the reactor only while I/O is in the kernel: an engine whose one open
    /// operation is a leaked write (handed its slots to fill, never polled again, so open for
    /// good) goes to sleep.
    #[test]
    fn reactor_with_only_a_leaked_op_sleeps() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        for backend in [crate::Backend::Uring, crate::Backend::Pread] {
            // Four 64 KiB blocks, so one op holds one block at a time: the 4 MiB write below
            // needs 64 rounds of filling, more than one poll runs, and the leaked op stays
            // open whatever the timing.
            let engine = match crate::Engine::builder()
                .backend(backend)
                .chunk_size(64 << 10)
                .bounce_slots(4)
                .reactor_tick(Duration::from_micros(100))
                .build()
            {
                Ok(e) => e,
                Err(e) => {
                    eprintln!("SKIPPED {backend:?} in the idle-reactor test: {e}");
                    continue;
                }
            };
            let file = crate::OpenOptions::new()
                .write(true)
                .create(true)
                .open(&engine, &path)
                .unwrap();
            let buf = vec![3u8; 4 << 20];
            let mut fut = Box::pin(file.write_from(&buf, 0));
            let waker = futures::task::noop_waker();
            let mut cx = std::task::Context::from_waker(&waker);
            assert!(fut.as_mut().poll(&mut cx).is_pending());
            std::mem::forget(fut);
            std::thread::sleep(Duration::from_millis(200));
            let before = engine.shared().turns.load(Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(200));
            let turns = engine.shared().turns.load(Ordering::Relaxed) - before;
            // A 100 µs tick would turn about 2000 times in 200 ms.
            assert!(
                turns < 50,
                "{backend:?}: idle reactor turned {turns} times in 200 ms"
            );
        }
    }
}
