//! The reactor: one thread per engine that owns the lanes (the main lane: an io_uring ring or
//! the pread pool; beside it cuFile and SPDK), the bounce pools, and every operation in flight.
//!
//! # Rooms
//! `mod.rs` is the loop and its sleep policy; `table.rs` accepts, cancels and finishes ops;
//! `sched.rs` starts pieces within the queue depth and each op's window and routes them to
//! lanes; `slots.rs` owns the host and device slot pools and notices a pool held by futures
//! that stopped polling; `complete.rs` turns completions into progress (retries, short
//! counts, end of file, cuFile fallback); `gate.rs` holds messages behind CUDA events;
//! `death.rs` decides what is quarantined when the reactor dies; `fence.rs` orders
//! overlapping pieces. Lanes (`crate::lane`) see pieces and tokens, never the table.
//!
//! # Life of a read
//! A future sends `Msg::Submit` through an MPSC queue and rings the eventfd doorbell if the
//! reactor sleeps. The reactor plans the request into chunk pieces (`crate::plan`),
//! gives each piece a bounce slot and submits it, up to the queue depth. When a piece
//! completes, the slot is handed to the future (`OpShared::hand_ready`) and its waker woken,
//! once, after the op's result is set where that was its last piece; the future's `poll`
//! copies the bytes into the caller's buffer and sends the slot back (`Msg::Release`, naming
//! the op by `OpRef`). Nothing on this path allocates for a one- or two-piece read. Writes
//! run the other way: the reactor hands out empty slots, `poll` fills them from the caller's
//! buffer and sends them back (`Msg::Filled`) to be written.
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
//! memory go. A pool CUDA pinned is unpinned and unmapped on a thread of its own once its last
//! user is gone: `cuMemHostUnregister` waits for all work on the device, and an engine's drop
//! must not wait for the application's kernels. A panic in the reactor fails every pending
//! operation with `Error::ReactorDied` and leaks (never frees) memory the kernel may still
//! write.

mod complete;
mod death;
mod entry;
#[cfg(test)]
mod fake;
pub(crate) mod fence;
mod gate;
mod sched;
mod slots;
mod table;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use slab::Slab;

use crate::buf::arena::{BounceArena, BounceSlot};
use crate::lane::doorbell::Doorbell;
use crate::lane::{Completion, IoKind, Lane, WaitHint};
use crate::op::OpShared;
use crate::op::ReadyPiece;
use crate::op::engine_shared::EngineShared;
use crate::op::gate::Gated;
use crate::op::msg::Msg;
use crate::op::occupancy::OccupancySampler;
use crate::plan::Piece;
use entry::OpEntry;
use fence::{RangeFence, Ticket};
use slots::{PoolStall, Slots};

/// Most bounce bytes one op may hold: a quarter of the engine's pool, so a leaked future,
/// whose slots are never given back, cannot take the whole pool; with several reactors
/// (`reactors`), each holding an equal part of the pool in `arena`, at most half of its own
/// reactor's part. One large read (a checkpoint's data section) then keeps as much in flight
/// with two reactors as with one.
pub(crate) fn op_window(arena: &BounceArena, reactors: usize) -> usize {
    (arena.block_size() * arena.blocks() * reactors.clamp(1, 2) / 4).max(arena.block_size())
}

/// A piece started by the reactor: in a lane, or held back by the fence.
struct InflightIo {
    op: usize,
    kind: IoKind,
    piece: Piece,
    slot: Option<BounceSlot>,
    done: usize,
    /// The piece's place in the range fence (reads and writes; fsync has none).
    ticket: Option<Ticket>,
    /// A read the page cache serves on an io-wq worker, counted against
    /// `ReactorConfig::page_cache_copies`.
    page_cache_copy: bool,
    /// The side lane the piece was last pushed to (`Reactor::side`), `None`: the main lane.
    lane: Option<usize>,
}

/// Engine-level settings the reactor needs.
#[derive(Clone)]
pub(crate) struct ReactorConfig {
    /// Largest piece of a buffered (page-cache) read or write.
    pub(crate) buffered_chunk: usize,
    /// Largest piece of an O_DIRECT, cuFile or NVMe transfer.
    pub(crate) direct_chunk: usize,
    pub(crate) queue_depth: usize,
    /// Most buffered reads punted to io-wq at once: each is a CPU copy out of the page
    /// cache, and past the memory's bandwidth more of them only slow each other down. Cold
    /// buffered pieces count too (residency-aware reads send large cold ranges O_DIRECT,
    /// which is not counted); the pread backend is not capped.
    pub(crate) page_cache_copies: usize,
    /// Reactors of the engine: each may always run its share of the page-cache copies, and
    /// borrows past it what the others leave (`Reactor::copies_free`).
    pub(crate) reactors: usize,
    /// Most page-cache copies per GPU while every open read lands in GPU memory
    /// (`Reactor::page_cache_cap`).
    pub(crate) copies_per_device: usize,
    /// Buffered pieces of at least this many bytes go to io-wq (`IOSQE_ASYNC`).
    pub(crate) punt_min: Option<usize>,
    /// Reads of buffered files of at least this many bytes read what the page cache lacks
    /// with O_DIRECT (`plan::residency`); `None`: off.
    pub(crate) residency_min: Option<u64>,
    /// Keep polling this long after the last work while operations are open (0: sleep at once).
    pub(crate) spin: Duration,
    /// Sleep at most this long while I/O is in the kernel (0: until woken).
    pub(crate) tick: Duration,
    /// How long ops may wait for bounce memory nothing in flight can return before the pool
    /// grows or they fail (`EngineBuilder::pool_wait_limit`).
    pub(crate) pool_wait_limit: Duration,
}

/// One engine's reactor. [`Reactor::run_to_end`] is the thread's body; [`Reactor::turn`] is one
/// pass of its loop, which tests drive by hand with a fake lane (no thread, file or GPU).
pub(crate) struct Reactor {
    rx: Receiver<Msg>,
    doorbell: Arc<Doorbell>,
    /// The main lane (io_uring or pread): the one the reactor sleeps in. `None` only once it
    /// was closed or quarantined.
    main: Option<Box<dyn Lane>>,
    backend: &'static str,
    arena: Arc<BounceArena>,
    slots: Slots,
    ops: Slab<OpEntry>,
    runnable: VecDeque<usize>,
    ios: Slab<InflightIo>,
    to_submit: VecDeque<(usize, ReadyPiece)>,
    /// Orders overlapping pieces of different ops by when they started (see `fence`).
    fence: RangeFence,
    /// Pieces (tokens in `ios`) started but held back by the fence, oldest first.
    fenced: VecDeque<usize>,
    /// Reads in `ios` that io-wq copies out of the page cache (`InflightIo::copy`).
    page_cache_copies_in_flight: usize,
    /// Ops out of the run queue until a page-cache copy ends, oldest first
    /// (`OpEntry::page_cache_parked`; a key whose op has finished since, or was replaced, is skipped).
    page_cache_parked: VecDeque<usize>,
    /// Open reads by the memory they land in (`sched::Readers`).
    readers: sched::Readers,
    /// Ops out of the run queue because of the window (they wait for their slots to return).
    window_blocked_ops: usize,
    /// Most bounce bytes one op may hold, so a leaked future (whose slots are never given
    /// back) can take at most this much of the pool out of service.
    op_window: usize,
    cfg: ReactorConfig,
    shutting_down: bool,
    /// The sends under way when the channel closed have landed (`ReactorHandle::settle_sends`).
    sends_settled: bool,
    shutdown_waiters: Vec<Arc<OpShared>>,
    completions: Vec<Completion>,
    /// Messages waiting for their gate to open.
    gated: Vec<Gated>,
    /// Some memory may still be touched by work we lost track of: never unmap the pool.
    compromised: bool,
    /// Work waited for bounce slots at the last scheduling pass (gates are then looked at on
    /// every turn: an open gate frees slots).
    short_of_slots: bool,
    /// The pool had no slot for the next piece at the last scheduling pass (`short_of_slots`
    /// without the ops held back by their window).
    pool_starved: bool,
    /// Set while ops wait for memory that only futures which do not poll could give back.
    stall: Option<PoolStall>,
    /// When the gates were last looked at.
    gates_polled: Instant,
    /// When the reactor last found work (a message or a completion); it spins, rather than
    /// sleeps, for `cfg.spin` after that while operations are open.
    last_work: Instant,
    shutdown_started: Option<Instant>,
    engine: Arc<EngineShared>,
    /// The lanes beside the main one, built by the engine from the backends present (cuFile,
    /// SPDK): each is asked once per op whether it serves it (`Lane::route`).
    side: Vec<Box<dyn Lane>>,
    /// Fault injection: panic at the next completion.
    panic_armed: bool,
    /// The serial number the next op taken gets (`crate::op::OpRef`).
    next_serial: u64,
    /// Adds up where pieces spend their time (`Engine::occupancy`).
    occupancy: OccupancySampler,
}

/// What [`Reactor::next_message`] found.
enum NextMsg {
    Msg(Msg),
    Empty,
    /// The channel has ended: closed, and everything sent before the close taken.
    End,
}

/// What one pass of the loop found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Keep going.
    Running,
    /// Shut down and drained: nothing is left in any lane, gate or table.
    Drained,
}

impl Reactor {
    pub(crate) fn new(
        rx: Receiver<Msg>,
        main: Box<dyn Lane>,
        side: Vec<Box<dyn Lane>>,
        engine: Arc<EngineShared>,
        mut cfg: ReactorConfig,
    ) -> Self {
        if !main.copies_on_kernel_workers() {
            // The pread pool's threads are its concurrency (and its only way to overlap cold
            // reads): the cap on io_uring's page-cache copies is not for them.
            cfg.page_cache_copies = usize::MAX;
            cfg.copies_per_device = usize::MAX;
        }
        let arena = engine.arena.clone();
        let op_window = op_window(&arena, cfg.reactors);
        Reactor {
            rx,
            doorbell: engine.reactor.doorbell.clone(),
            backend: main.name(),
            main: Some(main),
            slots: Slots::new(&arena),
            arena,
            ops: Slab::new(),
            runnable: VecDeque::new(),
            ios: Slab::new(),
            to_submit: VecDeque::new(),
            fence: RangeFence::default(),
            fenced: VecDeque::new(),
            page_cache_copies_in_flight: 0,
            page_cache_parked: VecDeque::new(),
            readers: sched::Readers::default(),
            op_window,
            window_blocked_ops: 0,
            cfg,
            shutting_down: false,
            sends_settled: false,
            shutdown_waiters: Vec::new(),
            completions: Vec::new(),
            gated: Vec::new(),
            compromised: false,
            short_of_slots: false,
            pool_starved: false,
            stall: None,
            gates_polled: Instant::now(),
            last_work: Instant::now(),
            shutdown_started: None,
            engine,
            side,
            panic_armed: false,
            next_serial: 0,
            occupancy: OccupancySampler::new(),
        }
    }

    /// The lanes beside the main one.
    fn side_lanes(&mut self) -> impl Iterator<Item = &mut dyn Lane> {
        self.side.iter_mut().map(|l| &mut **l as &mut dyn Lane)
    }

    /// Pieces out in the lanes beside the main one (their memory comes back only through them).
    fn side_outstanding(&self) -> usize {
        self.side.iter().map(|l| l.outstanding()).sum()
    }

    /// Runs the loop until shut down and drained.
    fn run(&mut self) -> std::io::Result<()> {
        while self.turn(true)? == Turn::Running {}
        self.close_lanes()
    }

    /// One pass: take messages, act on opened gates, start pieces, then wait in the lanes
    /// (sleeping only with `may_block`, and only when nothing is pending) and handle the
    /// completions found.
    pub(crate) fn turn(&mut self, may_block: bool) -> std::io::Result<Turn> {
        #[cfg(test)]
        self.engine
            .stats
            .turns
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.take_messages();
        if !self.gated.is_empty()
            && (self.short_of_slots
                || self.shutting_down
                || self.gates_polled.elapsed() >= gate::GATE_POLL_GAP)
        {
            self.poll_gates();
            self.gates_polled = Instant::now();
        }
        self.schedule();
        if self.shutting_down {
            self.enforce_shutdown_deadline();
            if self.ops.is_empty() && self.ios.is_empty() && self.gated.is_empty() {
                debug_assert_eq!(self.side_outstanding(), 0);
                self.occupancy.publish(&self.engine.stats.occupancy);
                return Ok(Turn::Drained);
            }
        }
        let (block, timeout) = self.sleep_policy(may_block);
        let mut block = block;
        let mut done = std::mem::take(&mut self.completions);
        for lane in self.side_lanes() {
            lane.flush(&mut done);
        }
        block &= done.is_empty();
        // The wait below is spent with what was just started in the kernel.
        self.sample_occupancy();
        let main = self.main.as_mut().expect("main lane present while running");
        main.wait(block, timeout, &mut done)?;
        self.doorbell.awake();
        for lane in self.side_lanes() {
            lane.wait(false, None, &mut done)?;
        }
        if !done.is_empty() {
            self.note_work();
        }
        for c in &done {
            self.on_completion(*c);
        }
        done.clear();
        self.completions = done;
        // Until the next wait: what the completions left.
        self.sample_occupancy();
        Ok(Turn::Running)
    }

    /// Notes the reactor's state for `Engine::occupancy`.
    fn sample_occupancy(&mut self) {
        // `ios` holds every lane's pieces (cuFile's and SPDK's too) and the fenced ones, which
        // wait outside the kernel.
        let in_kernel = self.ios.len().saturating_sub(self.fenced.len());
        let starved = self.pool_starved || self.stall.is_some();
        let busy = !self.ops.is_empty() || !self.ios.is_empty() || !self.gated.is_empty();
        self.occupancy.sample(
            &self.engine.stats.occupancy,
            in_kernel,
            self.gated.len(),
            starved,
            busy,
        );
    }

    /// Handles every queued message; the channel's end (`next_message`) starts shutdown.
    fn take_messages(&mut self) {
        loop {
            match self.next_message() {
                NextMsg::Msg(m) => {
                    self.note_work();
                    self.handle(m);
                }
                NextMsg::Empty => break,
                NextMsg::End => {
                    self.begin_shutdown();
                    break;
                }
            }
        }
    }

    /// The next queued message, or whether the queue is empty or has ended. Ended: closed
    /// (`ReactorHandle::close`) before this look, every send that found it open has landed
    /// (`ReactorHandle::settle_sends`, once), and empty. So a message sent before the close
    /// is always taken; one sent after it is refused by its sender.
    fn next_message(&mut self) -> NextMsg {
        let closed = self.engine.reactor.is_closed();
        if closed && !self.sends_settled {
            self.engine.reactor.settle_sends();
            self.sends_settled = true;
        }
        match self.rx.try_recv() {
            Ok(m) => NextMsg::Msg(m),
            Err(TryRecvError::Empty) if !closed => NextMsg::Empty,
            // Every sender gone cannot happen while the reactor holds the engine's handle;
            // it would end the channel as well.
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => NextMsg::End,
        }
    }

    /// Whether to sleep in the main lane, and for how long at most. Announces sleep on the
    /// doorbell first and looks at the queue once more: a producer that pushed before seeing
    /// the flag is caught here, one that pushes after it rings the doorbell.
    fn sleep_policy(&mut self, may_block: bool) -> (bool, Option<Duration>) {
        self.doorbell.prepare_sleep();
        let mut block = match self.next_message() {
            NextMsg::Msg(m) => {
                self.doorbell.awake();
                self.handle(m);
                false
            }
            NextMsg::Empty => may_block,
            NextMsg::End => {
                self.doorbell.awake();
                self.begin_shutdown();
                false
            }
        };
        let mut timeout = (!self.gated.is_empty()).then_some(gate::GATE_POLL_INTERVAL);
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
        for lane in self.side_lanes() {
            match lane.wait_hint() {
                WaitHint::Sleep => {}
                WaitHint::PollEvery(every) => {
                    timeout = Some(timeout.map_or(every, |t| t.min(every)))
                }
                WaitHint::Spin => block = false,
            }
        }
        (block, timeout)
    }

    /// Records that work was found, for the spin (a clock read per message only when
    /// spinning is on).
    fn note_work(&mut self) {
        if !self.cfg.spin.is_zero() {
            self.last_work = Instant::now();
        }
    }
}
