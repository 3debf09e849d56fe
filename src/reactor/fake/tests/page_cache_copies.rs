//! The cap on page-cache copies (`ReactorConfig::page_cache_copies`): parked reads, turns,
//! cancellation.

use super::*;
use crate::reactor::entry::Reader;

/// With two page-cache copies allowed, a large buffered read has at most two pieces in
/// the lane, a small read behind it (too small to be punted) still starts at once, the
/// large one goes on as its copies end, and every byte arrives.
#[test]
fn page_cache_copies_are_capped_and_others_go_on() {
    let mut h = harness(64 * K, 64, 64 * K, 64);
    h.reactor.cfg.punt_min = Some(64 * K);
    h.reactor.cfg.page_cache_copies = 2;
    let file = Arc::new(Target::fake(1));
    let big = h.read(&file, 0, 8 * 64 * K as u64);
    let small = h.read(&file, 8 << 20, 4 * K as u64);
    h.turn();
    let pending = h.pending();
    assert_eq!(
        pending.iter().filter(|p| p.pos < 8 << 20).count(),
        2,
        "two copies at once"
    );
    assert_eq!(pending.len(), 3, "the small read starts beside them");
    let mut got = 0;
    for _ in 0..32 {
        h.complete_all();
        h.turn();
        got += h.take_read(&big);
        h.turn();
        assert!(h.pending().len() <= 2, "never more than two copies");
        if big.peek_result().is_some() {
            break;
        }
    }
    assert_eq!(got, 8 * 64 * K);
    assert_eq!(big.peek_result(), Some(Ok(8 * 64 * K as u64)));
    assert_eq!(h.take_read(&small), 4 * K);
    h.turn();
    assert_eq!(small.peek_result(), Some(Ok(4 * K as u64)));
    assert_eq!(h.reactor.page_cache_copies_in_flight, 0);
    assert!(h.reactor.page_cache_parked.is_empty());
}

/// Three large reads with one page-cache copy allowed: each ended copy wakes one parked
/// read, and every read finishes with all its bytes.
#[test]
fn parked_reads_take_turns_and_all_finish() {
    let mut h = harness(64 * K, 64, 64 * K, 64);
    h.reactor.cfg.punt_min = Some(64 * K);
    h.reactor.cfg.page_cache_copies = 1;
    let file = Arc::new(Target::fake(1));
    let reads: Vec<_> = (0..3u64)
        .map(|i| h.read(&file, i << 20, 4 * 64 * K as u64))
        .collect();
    let mut got = [0usize; 3];
    for _ in 0..64 {
        h.turn();
        assert!(h.pending().len() <= 1, "one copy at a time");
        h.complete_all();
        h.turn();
        for (g, r) in got.iter_mut().zip(&reads) {
            *g += h.take_read(r);
        }
        if reads.iter().all(|r| r.peek_result().is_some()) {
            break;
        }
    }
    for (r, g) in reads.iter().zip(got) {
        assert_eq!(g, 4 * 64 * K);
        assert_eq!(r.peek_result(), Some(Ok(4 * 64 * K as u64)));
    }
    h.turn();
    assert_eq!(h.reactor.page_cache_copies_in_flight, 0);
    assert_eq!(h.slots_in_use(), 0);
}

/// A read parked for a page-cache copy and then cancelled leaves the table; the parked
/// key is skipped afterwards.
#[test]
fn a_cancelled_parked_read_finishes() {
    let mut h = harness(64 * K, 64, 64 * K, 64);
    h.reactor.cfg.punt_min = Some(64 * K);
    h.reactor.cfg.page_cache_copies = 1;
    let file = Arc::new(Target::fake(1));
    let first = h.read(&file, 0, 64 * K as u64);
    let parked = h.read(&file, 1 << 20, 4 * 64 * K as u64);
    h.turn();
    assert_eq!(h.pending().len(), 1);
    h.handle.reactor.send(Msg::Cancel(parked.clone()));
    h.turn();
    h.complete_all();
    h.turn();
    assert_eq!(h.take_read(&first), 64 * K);
    h.turn();
    assert_eq!(first.peek_result(), Some(Ok(64 * K as u64)));
    assert!(
        h.pending().is_empty(),
        "nothing of the cancelled read started"
    );
    assert!(h.reactor.ops.is_empty());
    assert_eq!(h.slots_in_use(), 0);
}

/// A woken op that starts no copy (it was cancelled before its turn) does not strand the ops
/// parked behind it: the free copy goes to the next one.
#[test]
fn a_free_copy_goes_to_the_next_parked_op() {
    let mut h = harness(64 * K, 64, 64 * K, 64);
    h.reactor.cfg.punt_min = Some(64 * K);
    h.reactor.cfg.page_cache_copies = 1;
    let file = Arc::new(Target::fake(1));
    let first = h.read(&file, 0, 64 * K as u64);
    let second = h.read(&file, 1 << 20, 2 * 64 * K as u64);
    let third = h.read(&file, 2 << 20, 2 * 64 * K as u64);
    h.turn();
    assert_eq!(h.pending().len(), 1, "one copy; two ops parked");
    h.complete_all();
    h.turn();
    assert_eq!(h.take_read(&first), 64 * K);
    // The second op lost its turn: cancelled before it started anything.
    h.handle.reactor.send(Msg::Cancel(second.clone()));
    h.turn();
    assert_eq!(h.pending().len(), 1, "the third op took the free copy");
    let mut got = 0;
    for _ in 0..8 {
        h.complete_all();
        h.turn();
        got += h.take_read(&third);
        h.turn();
        if third.peek_result().is_some() {
            break;
        }
    }
    assert_eq!(got, 2 * 64 * K);
    assert_eq!(third.peek_result(), Some(Ok(2 * 64 * K as u64)));
    assert_eq!(h.reactor.page_cache_copies_in_flight, 0);
}

/// Makes op `key` a read into GPU `gpu` (the fake has no CUDA context to name one).
fn read_into_gpu(h: &mut Harness, key: usize, gpu: u32) {
    let old = h.reactor.ops[key].reader.take().expect("a read");
    h.reactor.readers.remove(old);
    h.reactor.readers.add(Reader::Device(gpu));
    h.reactor.ops[key].reader = Some(Reader::Device(gpu));
}

/// Where every open read lands in GPU memory, the cap is `copies_per_device` per GPU in use
/// (within the machine's cap); a host read open beside them restores the machine's cap; the
/// counts go back to nothing as the reads finish.
#[test]
fn reads_into_gpus_get_copies_per_gpu_in_use() {
    let mut h = harness(64 * K, 64, 64 * K, 64);
    h.reactor.cfg.punt_min = Some(64 * K);
    // Accept three reads with no copy free, then say where each lands.
    h.reactor.cfg.page_cache_copies = 0;
    let file = Arc::new(Target::fake(1));
    let a = h.read(&file, 0, 8 * 64 * K as u64);
    let b = h.read(&file, 1 << 20, 8 * 64 * K as u64);
    h.turn();
    assert!(h.pending().is_empty());
    let keys: Vec<usize> = h.reactor.ops.iter().map(|(k, _)| k).collect();
    assert_eq!(keys.len(), 2);
    for &k in &keys {
        read_into_gpu(&mut h, k, 0);
    }
    h.reactor.cfg.page_cache_copies = 4;
    h.reactor.cfg.copies_per_device = 1;
    assert_eq!(h.reactor.page_cache_cap(), 1, "one GPU in use");
    h.turn();
    assert_eq!(h.pending().len(), 1, "one copy for the one GPU");
    read_into_gpu(&mut h, keys[1], 1);
    assert_eq!(h.reactor.page_cache_cap(), 2, "two GPUs in use");
    h.turn();
    assert_eq!(h.pending().len(), 2, "a copy per GPU");
    // A host read beside them: the machine's cap.
    let c = h.read(&file, 2 << 20, 4 * 64 * K as u64);
    h.turn();
    assert_eq!(h.reactor.page_cache_cap(), 4);
    assert!(h.pending().len() <= 4);
    let (mut got_a, mut got_b, mut got_c) = (0, 0, 0);
    for _ in 0..64 {
        h.complete_all();
        h.turn();
        got_a += h.take_read(&a);
        got_b += h.take_read(&b);
        got_c += h.take_read(&c);
        h.turn();
        assert!(h.pending().len() <= h.reactor.page_cache_cap().max(1));
        if [&a, &b, &c].iter().all(|o| o.peek_result().is_some()) {
            break;
        }
    }
    assert_eq!((got_a, got_b, got_c), (8 * 64 * K, 8 * 64 * K, 4 * 64 * K));
    assert_eq!(h.reactor.page_cache_copies_in_flight, 0);
    assert_eq!(
        h.reactor.page_cache_cap(),
        4,
        "no reads open: the machine's cap"
    );
    assert!(h.reactor.readers.is_empty());
}

/// With two reactors the cap is the engine's: while the other reactor holds all of it, this
/// one still runs its share (half, rounded up); once the other's copies end, it borrows up to
/// the whole cap; and its count leaves the engine's as its copies end.
#[test]
fn reactors_run_their_share_and_borrow_the_rest() {
    use std::sync::atomic::Ordering;
    let mut h = harness(64 * K, 64, 64 * K, 64);
    h.reactor.cfg.punt_min = Some(64 * K);
    h.reactor.cfg.page_cache_copies = 4;
    h.reactor.cfg.reactors = 2;
    let engine = h.handle.page_cache_copies.clone();
    // The other reactor holds the whole cap.
    engine.store(4, Ordering::Relaxed);
    let file = Arc::new(Target::fake(1));
    let big = h.read(&file, 0, 16 * 64 * K as u64);
    h.turn();
    assert_eq!(h.pending().len(), 2, "its share of four over two reactors");
    assert_eq!(engine.load(Ordering::Relaxed), 6);
    h.turn();
    assert_eq!(
        h.pending().len(),
        2,
        "no more while the other holds the cap"
    );
    // The other reactor's copies end: this one borrows up to the cap.
    engine.fetch_sub(4, Ordering::Relaxed);
    h.turn();
    assert_eq!(h.pending().len(), 4, "the whole cap, borrowed");
    let mut got = 0;
    for _ in 0..64 {
        h.complete_all();
        h.turn();
        got += h.take_read(&big);
        h.turn();
        assert!(h.pending().len() <= 4, "never past the engine's cap");
        if big.peek_result().is_some() {
            break;
        }
    }
    assert_eq!(got, 16 * 64 * K);
    assert_eq!(big.peek_result(), Some(Ok(16 * 64 * K as u64)));
    assert_eq!(h.reactor.page_cache_copies_in_flight, 0);
    assert_eq!(
        engine.load(Ordering::Relaxed),
        0,
        "the engine's count is back to nothing"
    );
}
