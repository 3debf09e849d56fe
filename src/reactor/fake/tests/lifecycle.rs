//! One lifecycle per op (`reactor::entry::Lifecycle`): pieces fail out of order and the error
//! kept is the one at the lowest failing offset; a cancelled op keeps no error and completes
//! nothing, even when a piece fails after the cancel; a failed op starts no more pieces.

use super::*;

/// Completes the pending pieces in the order given (indices into `pending()`), each with
/// `res` (`None`: the whole piece).
fn complete_as(h: &Harness, order: &[(usize, Option<i32>)]) {
    let mut st = h.lane.lock().unwrap();
    let pending = st.pending.clone();
    for &(i, res) in order {
        let p = pending[i];
        if res.is_none() && p.kind == IoKind::Read {
            for k in 0..p.len {
                // SAFETY: the reactor handed this memory to the lane for `len` bytes and keeps
                // it until the completion below is reaped.
                unsafe { *(p.ptr as *mut u8).add(k) = pattern(p.pos + k as u64) };
            }
        }
        st.ready.push(Completion {
            token: p.token,
            res: res.unwrap_or(p.len as i32),
        });
    }
    let done: Vec<u64> = order.iter().map(|&(i, _)| pending[i].token).collect();
    st.pending.retain(|p| !done.contains(&p.token));
}

#[test]
fn the_error_kept_is_the_one_at_the_lowest_failing_offset() {
    let mut h = harness(64 * K, 16, 64 * K, 64);
    let file = Arc::new(Target::fake(1));
    let op = h.read(&file, 0, 4 * 64 * K as u64);
    h.turn();
    assert_eq!(h.pending().len(), 4);
    // The last piece fails first, then the second; the others complete.
    complete_as(
        &h,
        &[
            (3, Some(-libc::EINVAL)),
            (1, Some(-libc::EIO)),
            (0, None),
            (2, None),
        ],
    );
    h.turn();
    let e = op.peek_result().expect("finished").unwrap_err();
    assert!(
        e.contains(&format!("at offset {}", 64 * K)),
        "the second piece's offset: {e}"
    );
    assert!(e.contains("Input/output error") || e.contains("EIO"), "{e}");
    let _ = op.reclaim_ready();
    assert_eq!(h.slots_in_use(), 0, "a failed read hands back no data");
}

#[test]
fn a_failed_op_starts_no_more_pieces() {
    // A window of one piece at a time: a 4-piece read, its first piece fails.
    let mut h = harness(64 * K, 4, 64 * K, 1);
    let file = Arc::new(Target::fake(1));
    let op = h.read(&file, 0, 4 * 64 * K as u64);
    h.turn();
    assert_eq!(h.pending().len(), 1);
    complete_as(&h, &[(0, Some(-libc::EIO))]);
    h.turn();
    h.turn();
    assert!(h.pending().is_empty(), "nothing started after the failure");
    assert!(op.peek_result().expect("finished").is_err());
    assert_eq!(h.lane.lock().unwrap().pushed, 1);
}

#[test]
fn a_cancelled_op_keeps_no_error_and_completes_nothing() {
    let mut h = harness(64 * K, 16, 64 * K, 64);
    let file = Arc::new(Target::fake(1));
    let op = h.read(&file, 0, 2 * 64 * K as u64);
    h.turn();
    assert_eq!(h.pending().len(), 2);
    h.handle.reactor.send(Msg::Cancel(op.clone()));
    h.turn();
    // A piece fails after the cancel, the other completes: the op leaves the table with no
    // result (its future is gone), and every slot comes back.
    complete_as(&h, &[(0, Some(-libc::EIO)), (1, None)]);
    h.turn();
    assert!(
        op.peek_result().is_none(),
        "a cancelled op's result goes nowhere"
    );
    assert_eq!(h.slots_in_use(), 0);
    assert!(h.reactor.ops.is_empty(), "the op left the table");
}
