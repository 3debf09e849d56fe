//! Lanes beside the main one (cuFile and SPDK in the engine): the reactor routes an op to the
//! side lane that takes it, reads that lane's failures through the lane (`Lane::classify`),
//! falls back to the main lane where the lane allows it, fails the op with the lane's error
//! where it does not, never reuses memory of a lost piece, and quarantines the side lanes
//! when it dies with their pieces out. Before issue 36 the fake could not stand in for any
//! of this: the reactor decoded cuFile's codes itself.

use super::*;
use crate::reactor::fake::{FakeSideLane, SIDE_FAILED, SIDE_INO};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

struct Side {
    h: Harness,
    side: Arc<Mutex<FakeState>>,
    fell_back: Arc<AtomicUsize>,
}

fn with_side(fallback: bool, lost: bool) -> Side {
    let side = Arc::new(Mutex::new(FakeState::default()));
    let fell_back = Arc::new(AtomicUsize::new(0));
    let lane = FakeSideLane {
        state: side.clone(),
        fallback,
        lost,
        fell_back: fell_back.clone(),
    };
    let h = harness_with_side(64 * K, 16, 64 * K, 64, vec![Box::new(lane)]);
    Side { h, side, fell_back }
}

impl Side {
    fn side_pending(&self) -> usize {
        self.side.lock().unwrap().pending.len()
    }

    /// Fails every piece out in the side lane with its own failure code.
    fn fail_side(&self) {
        let mut st = self.side.lock().unwrap();
        let failed: Vec<Completion> = st
            .pending
            .drain(..)
            .map(|p| Completion {
                token: p.token,
                res: SIDE_FAILED,
            })
            .collect();
        st.ready.extend(failed);
    }
}

#[test]
fn a_side_lane_takes_its_ops_and_the_main_lane_the_rest() {
    let mut s = with_side(true, false);
    let side_file = Arc::new(Target::fake(SIDE_INO));
    let main_file = Arc::new(Target::fake(1));
    let a = s.h.read(&side_file, 0, 128 * K as u64);
    let b = s.h.read(&main_file, 0, 64 * K as u64);
    s.h.turn();
    assert_eq!(s.side_pending(), 2, "the side file's two pieces");
    assert_eq!(s.h.pending().len(), 1, "the other file's piece");
    s.side.lock().unwrap().complete_all();
    s.h.complete_all();
    s.h.turn();
    assert_eq!(s.h.take_read(&a), 128 * K);
    assert_eq!(s.h.take_read(&b), 64 * K);
    s.h.turn();
    assert_eq!(a.peek_result(), Some(Ok(128 * K as u64)));
    assert_eq!(b.peek_result(), Some(Ok(64 * K as u64)));
    assert_eq!(s.h.slots_in_use(), 0);
}

#[test]
fn a_side_lane_failure_that_asks_for_a_fallback_reruns_on_the_main_lane() {
    let mut s = with_side(true, false);
    let file = Arc::new(Target::fake(SIDE_INO));
    let op = s.h.read(&file, 0, 256 * K as u64);
    s.h.turn();
    assert_eq!(s.side_pending(), 4);
    s.fail_side();
    s.h.turn();
    assert_eq!(
        s.fell_back.load(SeqCst),
        4,
        "each failed piece told the lane"
    );
    let mut got = 0;
    for _ in 0..8 {
        s.h.turn();
        s.h.complete_all();
        s.h.turn();
        got += s.h.take_read(&op);
        if op.peek_result().is_some() {
            break;
        }
    }
    assert_eq!(got, 256 * K, "every byte arrived through the main lane");
    assert_eq!(op.peek_result(), Some(Ok(256 * K as u64)));
    assert_eq!(s.side_pending(), 0, "nothing went back to the side lane");
    s.h.turn();
    assert_eq!(s.h.slots_in_use(), 0, "every slot is back");
}

#[test]
fn a_side_lane_failure_without_a_fallback_fails_the_op_with_the_lanes_error() {
    let mut s = with_side(false, false);
    let file = Arc::new(Target::fake(SIDE_INO));
    let op = s.h.read(&file, 0, 128 * K as u64);
    s.h.turn();
    s.fail_side();
    s.h.turn();
    let e = op.peek_result().expect("finished").unwrap_err();
    assert!(e.contains("turned the piece down"), "{e}");
    assert!(e.contains("fake-side"), "the error names the lane: {e}");
    assert_eq!(s.fell_back.load(SeqCst), 0);
    assert!(s.h.pending().is_empty(), "no piece went to the main lane");
    assert_eq!(s.h.slots_in_use(), 0);
}

#[test]
fn a_lost_side_piece_keeps_its_memory_for_good() {
    let mut s = with_side(false, true);
    let file = Arc::new(Target::fake(SIDE_INO));
    let op = s.h.read(&file, 0, 64 * K as u64);
    s.h.turn();
    s.fail_side();
    s.h.turn();
    assert!(op.peek_result().expect("finished").is_err());
    assert_eq!(
        s.h.slots_in_use(),
        64 * K,
        "the lost piece's slot (bytes in use) is never given back to the pool"
    );
}

#[test]
fn death_with_side_pieces_out_quarantines_the_side_lanes() {
    let mut s = with_side(true, false);
    let file = Arc::new(Target::fake(SIDE_INO));
    let op = s.h.read(&file, 0, 128 * K as u64);
    s.h.turn();
    assert_eq!(s.side_pending(), 2);
    let reason = "fake death with side-lane pieces out".to_string();
    s.h.reactor.die(reason.clone());
    assert!(op.peek_result().unwrap().unwrap_err().contains(&reason));
    assert!(
        crate::buf::quarantine::quarantined()
            .iter()
            .any(|w| w.contains(&reason)),
        "the lanes and pool are held"
    );
    assert_eq!(
        Arc::strong_count(&s.side),
        2,
        "the side lane was kept (quarantined), not dropped"
    );
}
