//! Leaked futures that hold the whole bounce pool (issue 18, item 6): later operations must
//! not wait for good. The pool grows (within its limit) and keeps serving; past the limit, a
//! request that finds no memory fails with `Error::PoolExhausted`, saying why, and the engine
//! serves again as soon as memory is free.

mod common;

use std::time::{Duration, Instant};

use common::*;
use gpuio::{Backend, Engine, Error};

/// 64 KiB blocks, a 4-block pool (one block per op) that may grow by 4 more.
fn small_engine(backend: Backend) -> Option<Engine> {
    match Engine::builder()
        .backend(backend)
        .chunk_size(64 << 10)
        .bounce_slots(4)
        .bounce_growth(4)
        .pool_wait_limit(Duration::from_millis(400))
        // The tests' reads must hold bounce slots: none is copied from the page cache in poll.
        .page_cache_read_max(gpuio::CACHED_READ_MAX)
        .build()
    {
        Ok(e) => Some(e),
        Err(e) => {
            skipped(format!("{backend:?} in the pool-stall test: {e}"));
            None
        }
    }
}

/// Leaks a write that holds one block of the pool for good: it was handed slots to fill and
/// is never polled again.
fn leak_a_write(f: &gpuio::File, buf: &[u8]) {
    let mut fut = Box::pin(f.write_from(buf, 0));
    assert!(
        !poll_once(&mut fut),
        "a 1 MiB write cannot finish in one poll here"
    );
    std::mem::forget(fut);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaked_futures_holding_the_pool_grow_it_then_fail_later_requests() {
    let dir = tmpdir();
    for backend in [Backend::Uring, Backend::Pread] {
        let Some(engine) = small_engine(backend) else {
            continue;
        };
        let path = dir.path().join(format!("stall-{backend:?}"));
        let f = gpuio::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .open(&engine, &path)
            .unwrap();
        let data = pattern(1 << 20, 3);
        let leaked = vec![0xEEu8; 1 << 20];
        // Four leaks hold the pool proper; a write after them is served by growth.
        for _ in 0..4 {
            leak_a_write(&f, &leaked);
        }
        let n = within_limit(Duration::from_secs(10), f.write_from(&data, 0))
            .await
            .unwrap_or_else(|e| panic!("{backend:?}: write after four leaks: {e}"));
        assert_eq!(n, data.len());
        let mut back = vec![0u8; data.len()];
        within_limit(Duration::from_secs(10), f.read_exact_at(&mut back, 0))
            .await
            .unwrap();
        assert!(back == data, "{backend:?}: read back after growth");
        // Four more take the growth too: now a request fails, quickly and saying why.
        for _ in 0..4 {
            leak_a_write(&f, &leaked);
        }
        let started = Instant::now();
        let e = within_limit(Duration::from_secs(10), f.read_into(&mut back, 0))
            .await
            .expect_err("no memory can come back: the read must fail, not wait");
        assert!(matches!(e, Error::PoolExhausted { .. }), "{backend:?}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("mem::forget") && msg.contains(path.to_str().unwrap()),
            "{msg}"
        );
        assert_eq!(
            std::io::Error::from(e).kind(),
            std::io::ErrorKind::OutOfMemory
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "failed only after {:?}",
            started.elapsed()
        );
        // Requests that need no bounce memory still run, and shutdown still works.
        within_limit(Duration::from_secs(10), f.sync_all())
            .await
            .unwrap();
        within_limit(Duration::from_secs(30), engine.shutdown())
            .await
            .unwrap();
    }
}

#[test]
fn a_wait_limit_below_ten_milliseconds_is_refused() {
    let e = Engine::builder()
        .pool_wait_limit(Duration::from_millis(1))
        .build()
        .expect_err("1 ms would take live futures for leaks");
    assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
    assert!(e.to_string().contains("10 ms"), "{e}");
}

/// A slow consumer is not a leak: a future that holds its slots but is polled again within the
/// wait limit keeps every other request waiting, then served, never failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_live_future_is_not_mistaken_for_a_leak() {
    let dir = tmpdir();
    let Some(engine) = small_engine(Backend::Pread) else {
        return;
    };
    let (path, data) = test_file(dir.path(), "slow", 1 << 20, 5);
    let f = engine.open(&path).unwrap();
    let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| vec![0u8; 1 << 20]).collect();
    let mut held = Vec::new();
    for b in bufs.iter_mut() {
        let mut fut = Box::pin(f.read_into(&mut b[..], 0));
        poll_once(&mut fut);
        held.push(fut);
    }
    // Everything is held; a request arrives, and the holders come back 100 ms later (well
    // inside the 400 ms limit, though past the growth point: growth is allowed, failure not).
    let mut late = vec![0u8; 1 << 20];
    let (r, ()) = tokio::join!(f.read_into(&mut late, 0), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for fut in held.drain(..) {
            assert_eq!(within(fut).await.unwrap(), 1 << 20);
        }
    });
    assert_eq!(r.unwrap(), 1 << 20);
    assert!(late == data);
}
