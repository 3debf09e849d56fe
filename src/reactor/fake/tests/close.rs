//! Closing the channel (`ReactorHandle::close`) without a lock around the sender: a message
//! sent before the close is taken or refused, one sent after it is refused at once, and one
//! that reaches a reactor already gone comes back to its sender and is refused there. No op
//! is ever left without a result.

use super::*;

fn read_req(file: &Arc<Target>, offset: u64, len: u64) -> OpRequest {
    OpRequest::Read {
        file: file.clone(),
        offset,
        len,
        device: None,
        owned: None,
    }
}

#[test]
fn a_submission_after_close_is_refused_at_once() {
    let h = harness(64 * K, 4, 64 * K, 8);
    let file = Arc::new(Target::fake(1));
    h.handle.reactor.close();
    let op = h.read(&file, 0, 4 * K as u64);
    let e = op
        .peek_result()
        .expect("refused without a turn of the reactor")
        .unwrap_err();
    assert!(e.contains("shut down"), "{e}");
}

#[test]
fn a_submission_queued_before_close_is_taken_then_shut_down() {
    let mut h = harness(64 * K, 4, 64 * K, 8);
    let file = Arc::new(Target::fake(1));
    let op = h.read(&file, 0, 4 * K as u64);
    h.handle.reactor.close();
    // The queue is drained before the close is acted on: the op is in the table, then fails
    // with the shutdown once its piece is back.
    let mut turns = 0;
    while h.turn() == Turn::Running {
        h.complete_all();
        turns += 1;
        assert!(turns < 100, "the reactor never drained");
    }
    let r = op.peek_result().expect("a result once drained");
    assert!(r.unwrap_err().contains("shut down"));
    assert_eq!(h.slots_in_use(), 0);
}

#[test]
fn a_submission_that_finds_the_reactor_gone_is_refused_by_the_sender() {
    let Harness {
        reactor, handle, ..
    } = harness(64 * K, 4, 64 * K, 8);
    // The receiver goes with the reactor while the handle still looks open: `send` gets the
    // message back from the channel and refuses it itself.
    drop(reactor);
    assert!(!handle.reactor.is_closed());
    let op = OpShared::new();
    handle.reactor.send(Msg::Submit(SubmitMsg {
        shared: Some(op.clone()),
        req: Some(read_req(&Arc::new(Target::fake(1)), 0, 4 * K as u64)),
    }));
    let e = op.peek_result().expect("refused at once").unwrap_err();
    assert!(e.contains("shut down"), "{e}");
}

/// Threads submit while the engine closes: every op gets a result (read, shut down, or
/// refused), whichever side of the close its send fell on.
#[test]
fn sends_racing_the_close_all_end() {
    let mut h = harness(64 * K, 16, 64 * K, 16);
    let file = Arc::new(Target::fake(1));
    let ops = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (handle, file, ops) = (h.handle.clone(), &file, &ops);
            s.spawn(move || {
                for i in 0..200u64 {
                    let op = OpShared::new();
                    handle.reactor.send(Msg::Submit(SubmitMsg {
                        shared: Some(op.clone()),
                        req: Some(read_req(file, (t * 200 + i) * 4 * K as u64, 4 * K as u64)),
                    }));
                    ops.lock().unwrap().push(op);
                }
            });
        }
        let mut turns = 0u32;
        loop {
            if turns == 20 {
                h.handle.reactor.close();
            }
            let state = h.turn();
            h.complete_all();
            // The futures' part: take what was read and give the slots back (after the close
            // the returns are dropped, as a real future's are).
            for op in ops.lock().unwrap().iter() {
                let pieces = op.reclaim_ready();
                if !pieces.is_empty() {
                    h.handle.reactor.send(Msg::release(op, pieces));
                }
            }
            if state == Turn::Drained {
                break;
            }
            turns += 1;
            assert!(turns < 100_000, "the reactor never drained");
        }
    });
    // Sends that landed after the reactor's last look go with its receiver.
    drop(h.reactor);
    let ops = ops.into_inner().unwrap();
    assert_eq!(ops.len(), 800);
    let (mut read, mut refused) = (0, 0);
    for op in &ops {
        match op.peek_result().expect("every op has a result") {
            Ok(n) => {
                assert_eq!(n, 4 * K as u64);
                read += 1;
            }
            Err(e) => {
                assert!(e.contains("shut down"), "{e}");
                refused += 1;
            }
        }
    }
    assert_eq!(read + refused, 800);
}
