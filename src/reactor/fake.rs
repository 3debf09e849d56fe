//! A fake main lane for the reactor's unit tests: it records the pieces pushed to it and
//! completes them only when the test says so, filling read pieces with a pattern (byte =
//! file offset mod 251), so the reactor's window, cancel, reclaim and death logic can be
//! driven by hand, one [`Reactor::turn`](super::Reactor::turn) at a time, with no thread,
//! file, kernel or GPU.

use std::io;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::lane::{Completion, IoKind, Lane, LaneIo, LaneMem};

/// A piece the reactor pushed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pushed {
    pub(super) token: u64,
    pub(super) kind: IoKind,
    pub(super) pos: u64,
    pub(super) len: usize,
    ptr: usize,
}

/// What the test sees of the lane.
#[derive(Default)]
pub(super) struct FakeState {
    /// Pushed and not yet completed, oldest first.
    pub(super) pending: Vec<Pushed>,
    /// Every piece ever pushed.
    pub(super) pushed: usize,
    ready: Vec<Completion>,
}

/// The lane itself (the reactor owns it; the test keeps the shared state).
pub(super) struct FakeLane(pub(super) Arc<Mutex<FakeState>>);

/// The byte the fake "file" holds at `pos`.
pub(super) fn pattern(pos: u64) -> u8 {
    (pos % 251) as u8
}

impl FakeState {
    /// Completes the oldest `n` pending pieces in full (reads get the pattern).
    pub(super) fn complete(&mut self, n: usize) {
        for p in self.pending.drain(..n.min(self.pending.len())) {
            if p.kind == IoKind::Read {
                for i in 0..p.len {
                    // SAFETY: the reactor handed this memory to the lane for `len` bytes
                    // and keeps it until the completion below is reaped.
                    unsafe { *(p.ptr as *mut u8).add(i) = pattern(p.pos + i as u64) };
                }
            }
            let res = if p.kind == IoKind::Fsync {
                0
            } else {
                p.len as i32
            };
            self.ready.push(Completion {
                token: p.token,
                res,
            });
        }
    }

    /// Completes every pending piece.
    pub(super) fn complete_all(&mut self) {
        self.complete(self.pending.len());
    }
}

impl Lane for FakeLane {
    fn name(&self) -> &'static str {
        "fake"
    }

    fn push(&mut self, io: LaneIo<'_>) -> io::Result<()> {
        let ptr = match io.mem {
            LaneMem::Host { ptr, .. } => ptr as usize,
            _ => 0,
        };
        let mut st = self.0.lock().unwrap();
        st.pushed += 1;
        st.pending.push(Pushed {
            token: io.token,
            kind: io.kind,
            pos: io.pos,
            len: io.len,
            ptr,
        });
        Ok(())
    }

    fn wait(
        &mut self,
        _block: bool,
        _timeout: Option<Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()> {
        out.append(&mut self.0.lock().unwrap().ready);
        Ok(())
    }

    fn outstanding(&self) -> usize {
        let st = self.0.lock().unwrap();
        st.pending.len() + st.ready.len()
    }
}

mod side;
pub(super) use side::{FakeSideLane, SIDE_FAILED, SIDE_INO};

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;

    use super::*;
    use crate::buf::arena::BounceArena;
    use crate::lane::doorbell::Doorbell;
    use crate::op::engine_shared::{EngineShared, OpPolicy};
    use crate::op::msg::{Msg, ReactorHandle, SubmitMsg};
    use crate::op::request::OpRequest;
    use crate::op::{OpShared, ReadyPieces};
    use crate::reactor::{Reactor, ReactorConfig, Turn};
    use crate::target::Target;

    const K: usize = 1024;

    /// A reactor on a fake lane, driven by hand.
    struct Harness {
        reactor: Reactor,
        lane: Arc<Mutex<FakeState>>,
        handle: Arc<EngineShared>,
        arena: Arc<BounceArena>,
    }

    /// `blocks` bounce blocks of `block` bytes, pieces of `chunk` bytes, `qd` in the lane.
    fn harness(block: usize, blocks: usize, chunk: usize, qd: usize) -> Harness {
        harness_with_side(block, blocks, chunk, qd, Vec::new())
    }

    /// As [`harness`], with lanes beside the main one.
    fn harness_with_side(
        block: usize,
        blocks: usize,
        chunk: usize,
        qd: usize,
        side: Vec<Box<dyn Lane>>,
    ) -> Harness {
        let arena = Arc::new(BounceArena::new(block, blocks, 0).unwrap());
        let doorbell = Arc::new(Doorbell::new().unwrap());
        let (tx, rx) = channel();
        let reactor = ReactorHandle::new(tx, doorbell);
        let handle = Arc::new(EngineShared::new(
            reactor,
            arena.clone(),
            OpPolicy::default(),
        ));
        let lane = Arc::new(Mutex::new(FakeState::default()));
        let cfg = ReactorConfig {
            buffered_chunk: chunk,
            direct_chunk: chunk,
            queue_depth: qd,
            page_cache_copies: qd,
            reactors: 1,
            copies_per_device: qd,
            punt_min: None,
            residency_min: None,
            spin: Duration::ZERO,
            tick: Duration::ZERO,
            pool_wait_limit: Duration::from_secs(5),
        };
        let reactor = Reactor::new(
            rx,
            Box::new(FakeLane(lane.clone())),
            side,
            handle.clone(),
            cfg,
        );
        Harness {
            reactor,
            lane,
            handle,
            arena,
        }
    }

    impl Harness {
        fn submit(&self, req: OpRequest) -> Arc<OpShared> {
            let shared = OpShared::new();
            self.handle.reactor.send(Msg::Submit(SubmitMsg {
                shared: Some(shared.clone()),
                req: Some(req),
            }));
            shared
        }

        fn read(&self, file: &Arc<Target>, offset: u64, len: u64) -> Arc<OpShared> {
            self.submit(OpRequest::Read {
                file: file.clone(),
                offset,
                len,
                device: None,
                owned: None,
            })
        }

        fn write(&self, file: &Arc<Target>, offset: u64, len: u64) -> Arc<OpShared> {
            self.submit(OpRequest::Write {
                file: file.clone(),
                offset,
                len,
                device: None,
                pending: crate::op::request::PendingWrite::new(
                    &self.handle.writes_pending,
                    &file.fence_key,
                ),
            })
        }

        fn turn(&mut self) -> Turn {
            self.reactor.turn(false).unwrap()
        }

        fn pending(&self) -> Vec<Pushed> {
            self.lane.lock().unwrap().pending.clone()
        }

        fn complete(&self, n: usize) {
            self.lane.lock().unwrap().complete(n);
        }

        fn complete_all(&self) {
            self.lane.lock().unwrap().complete_all();
        }

        /// The future's part of a read: checks the pieces handed over against the pattern and
        /// gives their slots back. Returns the bytes seen.
        fn take_read(&self, op: &Arc<OpShared>) -> usize {
            let pieces = op.reclaim_ready();
            let mut seen = 0;
            for p in &pieces {
                // SAFETY: the reactor handed these slots to "the future" (this test).
                let bytes = unsafe { self.arena.slot_bytes(&p.slot, p.valid) };
                for (i, b) in bytes.iter().enumerate() {
                    assert_eq!(*b, pattern(p.piece.pos + i as u64), "byte {}", p.piece.pos);
                }
                seen += p.valid;
            }
            self.handle.reactor.send(Msg::release(op, pieces));
            seen
        }

        /// The future's part of a write: fills the empty slots handed over and sends them
        /// back. Returns the pieces filled.
        fn fill_write(&self, op: &Arc<OpShared>) -> usize {
            let pieces: ReadyPieces = op.reclaim_ready();
            let n = pieces.len();
            for p in &pieces {
                // SAFETY: as in `take_read`.
                let bytes = unsafe { self.arena.slot_bytes_mut(&p.slot, p.valid) };
                bytes.fill(0xAB);
            }
            self.handle.reactor.send(Msg::Filled(op.clone(), pieces));
            n
        }

        fn slots_in_use(&self) -> usize {
            self.reactor.slots.host.in_use()
        }
    }

    /// One large read holds at most its window (a quarter of the pool) of slots; a small read
    /// submitted after it still starts at once; the large one resumes as slots come back,
    /// and every byte arrives.
    #[test]
    fn window_bounds_one_op_and_others_still_run() {
        let mut h = harness(64 * K, 16, 64 * K, 64);
        let file = Arc::new(Target::fake(1));
        let big = h.read(&file, 0, 4 << 20);
        let small = h.read(&file, 8 << 20, 4 * K as u64);
        h.turn();
        let pending = h.pending();
        let big_pieces = pending.iter().filter(|p| p.pos < 8 << 20).count();
        assert_eq!(big_pieces, 4, "window = 1 MiB / 4 = four 64 KiB pieces");
        assert_eq!(pending.len(), 5, "the small read starts beside it");
        h.complete_all();
        h.turn();
        assert_eq!(h.take_read(&small), 4 * K);
        h.turn();
        assert_eq!(small.peek_result(), Some(Ok(4 * K as u64)));
        assert!(
            h.pending().is_empty(),
            "no new piece while the big read's slots are out"
        );
        let mut got = 0;
        for _ in 0..64 {
            got += h.take_read(&big);
            h.turn();
            assert!(
                h.pending().len() <= 4,
                "never more than the window in the lane"
            );
            h.complete_all();
            h.turn();
            if big.peek_result().is_some() {
                break;
            }
        }
        got += h.take_read(&big);
        assert_eq!(got, 4 << 20);
        assert_eq!(big.peek_result(), Some(Ok(4 << 20)));
        h.turn();
        assert_eq!(h.slots_in_use(), 0);
        assert!(h.reactor.ops.is_empty());
    }

    /// Cancelling an op with pieces in the lane starts nothing more; the pieces' slots come
    /// back when the lane completes them, and the op leaves the table without a result.
    #[test]
    fn cancel_stops_new_pieces_and_frees_every_slot() {
        let mut h = harness(64 * K, 16, 64 * K, 64);
        let file = Arc::new(Target::fake(1));
        let op = h.read(&file, 0, 4 << 20);
        h.turn();
        assert_eq!(h.pending().len(), 4);
        h.handle.reactor.send(Msg::Cancel(op.clone()));
        h.turn();
        let pushed = h.lane.lock().unwrap().pushed;
        assert_eq!(
            h.slots_in_use(),
            4 * 64 * K,
            "pieces in the lane keep their slots"
        );
        h.complete_all();
        h.turn();
        h.turn();
        assert_eq!(
            h.lane.lock().unwrap().pushed,
            pushed,
            "nothing started after cancel"
        );
        assert_eq!(h.slots_in_use(), 0);
        assert!(h.reactor.ops.is_empty() && h.reactor.ios.is_empty());
        assert_eq!(op.peek_result(), None, "a cancelled op has nobody to tell");
        assert!(
            op.reclaim_ready().is_empty(),
            "no slot left with the dropped future"
        );
    }

    /// Pieces handed to a future that is then dropped without taking them come back to the
    /// pool (the reactor reclaims them on cancel).
    #[test]
    fn cancel_reclaims_pieces_the_future_never_took() {
        let mut h = harness(64 * K, 16, 64 * K, 64);
        let file = Arc::new(Target::fake(1));
        let op = h.read(&file, 0, 256 * K as u64);
        h.turn();
        h.complete_all();
        h.turn();
        assert_eq!(h.slots_in_use(), 256 * K, "handed to the future, not taken");
        h.handle.reactor.send(Msg::Cancel(op.clone()));
        h.turn();
        assert_eq!(h.slots_in_use(), 0);
        assert!(h.reactor.ops.is_empty());
    }

    /// A write: empty slots go to the future, come back filled, go to the lane; a second write
    /// over the same range waits outside the lane until the first one's piece completes.
    #[test]
    fn overlapping_writes_reach_the_lane_in_order() {
        let mut h = harness(64 * K, 16, 64 * K, 64);
        let file = Arc::new(Target::fake(1));
        let first = h.write(&file, 0, 64 * K as u64);
        h.turn();
        assert_eq!(h.fill_write(&first), 1);
        h.turn();
        assert_eq!(h.pending().len(), 1);
        let second = h.write(&file, 4 * K as u64, 4 * K as u64);
        h.turn();
        assert_eq!(h.fill_write(&second), 1);
        h.turn();
        assert_eq!(
            h.pending().len(),
            1,
            "the overlapping write waits for the first"
        );
        h.complete(1);
        h.turn();
        assert_eq!(first.peek_result(), Some(Ok(64 * K as u64)));
        h.turn();
        let pending = h.pending();
        assert_eq!(pending.len(), 1, "now it runs");
        assert_eq!((pending[0].pos, pending[0].len), (4 * K as u64, 4 * K));
        h.complete_all();
        h.turn();
        assert_eq!(second.peek_result(), Some(Ok(4 * K as u64)));
        assert_eq!(h.slots_in_use(), 0);
    }

    /// The channel closed (`ReactorHandle::close`, as when the last engine handle goes): ops
    /// still running fail with `Shutdown`, the reactor waits for the pieces in its lane, then
    /// reports itself drained.
    #[test]
    fn shutdown_waits_for_the_lane_then_drains() {
        let mut h = harness(64 * K, 16, 64 * K, 64);
        let file = Arc::new(Target::fake(1));
        let op = h.read(&file, 0, 1 << 20);
        h.turn();
        h.handle.reactor.close();
        assert_eq!(h.turn(), Turn::Running, "pieces still in the lane");
        assert_eq!(op.peek_result(), None, "not finished while pieces are out");
        h.complete_all();
        assert_eq!(h.turn(), Turn::Running, "this turn reaps the completions");
        assert_eq!(h.turn(), Turn::Drained);
        let r = op.peek_result().expect("failed once drained");
        assert!(r.unwrap_err().contains("shut down"));
        assert_eq!(h.slots_in_use(), 0);
    }

    /// A reactor that dies with pieces in its lane fails every op with `ReactorDied` and
    /// quarantines the lane, the pool and the ops (named); one with nothing in its lane
    /// quarantines nothing.
    #[test]
    fn death_quarantines_only_what_a_lane_may_still_write() {
        let mut h = harness(64 * K, 16, 64 * K, 64);
        let file = Arc::new(Target::fake(1));
        let op = h.read(&file, 0, 1 << 20);
        h.turn();
        assert!(!h.pending().is_empty());
        let reason = "fake-lane death with pieces out".to_string();
        h.reactor.die(reason.clone());
        let r = op.peek_result().unwrap().unwrap_err();
        assert!(r.contains(&reason), "{r}");
        let held = crate::buf::quarantine::quarantined();
        assert!(
            held.iter().any(|w| w.contains(&reason)),
            "quarantine names it: {held:?}"
        );

        let mut idle = harness(64 * K, 16, 64 * K, 64);
        let op = idle.read(&file, 0, 64 * K as u64);
        idle.turn();
        idle.complete_all();
        idle.turn();
        let reason = "fake-lane death with nothing out".to_string();
        idle.reactor.die(reason.clone());
        assert!(op.peek_result().is_some());
        let held = crate::buf::quarantine::quarantined();
        assert!(
            !held.iter().any(|w| w.contains(&reason)),
            "nothing in the lane: nothing quarantined: {held:?}"
        );
    }

    /// A gate the test opens by hand.
    struct HandGate(Arc<std::sync::atomic::AtomicU8>);

    impl crate::op::gate::Gate for HandGate {
        fn poll(&self) -> crate::op::gate::GateState {
            use crate::op::gate::GateState;
            match self.0.load(std::sync::atomic::Ordering::SeqCst) {
                0 => GateState::Closed,
                1 => GateState::Open,
                _ => GateState::Broken("test".into()),
            }
        }
    }

    /// A read whose copied-out slots come back behind a gate that breaks (a CUDA event that
    /// fails) fails instead of waiting for them: with its window full it could otherwise start
    /// no more pieces and never finish. The slots stay out of the pool.
    #[test]
    fn slots_behind_a_broken_gate_fail_their_read_instead_of_stalling_it() {
        use crate::op::gate::Gated;
        let mut h = harness(64 * K, 16, 64 * K, 64);
        let file = Arc::new(Target::fake(1));
        let op = h.read(&file, 0, 16 * 64 * K as u64);
        h.turn();
        let started = h.pending().len();
        assert!(
            started < 16,
            "the op's window holds it to part of the read ({started})"
        );
        h.complete_all();
        h.turn();
        let slots: crate::op::SlotList = op.reclaim_ready().into_iter().map(|p| p.slot).collect();
        assert_eq!(slots.len(), started);
        let state = Arc::new(std::sync::atomic::AtomicU8::new(2));
        h.handle.reactor.send(Msg::Gated(Gated::new(
            Box::new(HandGate(state)),
            Msg::Release(op.op_ref(), slots),
            &h.arena,
        )));
        for _ in 0..3 {
            h.reactor.gates_polled = std::time::Instant::now() - Duration::from_secs(1);
            h.turn();
            h.complete_all();
        }
        let e = op.peek_result().expect("the read finished").unwrap_err();
        assert!(e.contains("event behind the device copies failed"), "{e}");
        assert!(h.reactor.ops.is_empty());
    }

    fn awaited(h: &Harness) -> (Arc<OpShared>, Arc<std::sync::atomic::AtomicU8>) {
        awaited_op(h, crate::error::OpKind::Sync, crate::op::msg::Awaited::Idle)
    }

    fn awaited_op(
        h: &Harness,
        kind: crate::error::OpKind,
        what: crate::op::msg::Awaited,
    ) -> (Arc<OpShared>, Arc<std::sync::atomic::AtomicU8>) {
        use crate::op::gate::Gated;
        let state = Arc::new(std::sync::atomic::AtomicU8::new(0));
        let shared = OpShared::new();
        let gated = Gated::new(
            Box::new(HandGate(state.clone())),
            Msg::Awaited(shared.clone(), what),
            &h.arena,
        );
        h.handle.reactor.send(Msg::Submit(SubmitMsg {
            shared: Some(shared.clone()),
            req: Some(OpRequest::Await {
                kind,
                file: None,
                offset: 0,
                gated,
            }),
        }));
        (shared, state)
    }

    /// Work queued on a stream is an op in the table: shutdown waits for its gate, and the
    /// op finishes with the gate's result, not with `Shutdown`.
    #[test]
    fn awaited_ops_are_in_the_table_and_shutdown_waits_for_them() {
        let mut h = harness(64 * K, 4, 64 * K, 8);
        let (op, gate) = awaited(&h);
        h.turn();
        assert_eq!(h.reactor.ops.len(), 1);
        h.handle.reactor.close();
        for _ in 0..3 {
            assert_eq!(h.turn(), Turn::Running, "the gate is still closed");
        }
        assert_eq!(op.peek_result(), None);
        gate.store(1, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            h.turn(),
            Turn::Drained,
            "the open gate finishes the last op"
        );
        assert_eq!(op.peek_result(), Some(Ok(0)));
    }

    /// A broken gate fails its awaited op with a CUDA error and quarantines what the op left
    /// with the stream; a reactor that dies with one pending fails it with `ReactorDied`.
    #[test]
    fn broken_or_orphaned_awaited_ops_fail_and_never_hang() {
        let mut h = harness(64 * K, 4, 64 * K, 8);
        let (op, gate) = awaited(&h);
        h.turn();
        gate.store(2, std::sync::atomic::Ordering::SeqCst);
        h.reactor.gates_polled = std::time::Instant::now() - Duration::from_secs(1);
        h.turn();
        let e = op.peek_result().unwrap().unwrap_err();
        assert!(e.contains("never completed"), "{e}");
        assert!(h.reactor.ops.is_empty());

        let (op, _gate) = awaited(&h);
        h.turn();
        h.reactor
            .die("fake-lane death with a stream op pending".into());
        let e = op.peek_result().unwrap().unwrap_err();
        assert!(e.contains("stream op pending"), "{e}");
    }

    /// A stream-ordered read finishes with the byte count its stream work reported (a read
    /// in the table has no pieces whose ends could be summed instead).
    #[test]
    fn an_awaited_read_reports_the_bytes_its_stream_moved() {
        let mut h = harness(64 * K, 4, 64 * K, 8);
        let (op, gate) = awaited_op(
            &h,
            crate::error::OpKind::Read,
            crate::op::msg::Awaited::Moved(64 << 20),
        );
        h.turn();
        gate.store(1, std::sync::atomic::Ordering::SeqCst);
        h.reactor.gates_polled = std::time::Instant::now() - Duration::from_secs(1);
        h.turn();
        assert_eq!(op.peek_result(), Some(Ok(64 << 20)));
    }

    mod close;
    mod lifecycle;
    mod page_cache_copies;
    mod release;
    mod side;
}
