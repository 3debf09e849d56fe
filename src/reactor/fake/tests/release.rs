//! Slot returns name their op by `OpRef` (slab key and serial number), without holding it.

use super::*;

/// A slot return that arrives after its op has finished, when a later op has taken the same
/// slab key, frees the slot into the pool without counting it against the later op: the later
/// op's held bytes do not move, it still finishes, and every slot is back at the end. (A
/// return named by key alone would take the slot off the later op's count.)
#[test]
fn a_late_release_never_counts_against_the_op_that_reused_its_key() {
    let mut h = harness(64 * K, 8, 64 * K, 8);
    let file = Arc::new(Target::fake(1));
    let first = h.read(&file, 0, 4 * K as u64);
    h.turn();
    h.complete_all();
    h.turn();
    // The piece and the result are both in, so the op has left the table; its "future" has
    // the piece and has not given the slot back yet.
    assert_eq!(first.peek_result(), Some(Ok(4 * K as u64)));
    let late: crate::op::SlotList = first.reclaim_ready().into_iter().map(|p| p.slot).collect();
    assert_eq!(late.len(), 1);
    let old = first.op_ref();
    let second = h.read(&file, 1 << 20, 2 * 64 * K as u64);
    h.turn();
    assert_eq!(
        second.key(),
        old.key,
        "the slab gave the later op the same key"
    );
    assert_ne!(second.op_ref(), old, "but another serial number");
    let held = h.reactor.ops[old.key].held_bytes;
    assert!(held > 0, "the later op holds slots");
    h.handle.reactor.send(Msg::Release(old, late));
    h.turn();
    assert_eq!(
        h.reactor.ops[old.key].held_bytes, held,
        "the late return was counted against the later op"
    );
    let mut got = 0;
    for _ in 0..16 {
        h.complete_all();
        h.turn();
        got += h.take_read(&second);
        h.turn();
        if second.peek_result().is_some() {
            break;
        }
    }
    assert_eq!(got, 2 * 64 * K);
    assert_eq!(second.peek_result(), Some(Ok(2 * 64 * K as u64)));
    assert_eq!(h.slots_in_use(), 0, "every slot is back in the pool");
}
