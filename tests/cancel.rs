//! Drop and leak: a future dropped or `mem::forget`-ten mid-flight never writes its destination
//! (or reads its source) afterwards. The kernel's writes are invisible to sanitizers, so each
//! test reuses the memory, fills it with a pattern, lets all I/O drain, and checks the pattern.

mod common;

use std::time::Duration;

use common::*;
use gpuio::Engine;

const LEN: usize = 16 << 20;

fn engines_for_cancel() -> Vec<(&'static str, Engine)> {
    // Small chunks and a shallow queue: a 16 MiB read is 64 pieces, so it is surely mid-flight.
    let mut v = Vec::new();
    for b in [gpuio::Backend::Uring, gpuio::Backend::Pread] {
        match Engine::builder()
            .backend(b)
            .chunk_size(256 << 10)
            .queue_depth(4)
            .bounce_slots(8)
            // Small reads must reach the reactor here, to be mid-flight when dropped.
            .page_cache_fast_path(false)
            .build()
        {
            Ok(e) => v.push((
                if b == gpuio::Backend::Uring {
                    "io_uring"
                } else {
                    "pread"
                },
                e,
            )),
            Err(e) => skipped(format!("{b:?} in cancel tests: {e}")),
        }
    }
    v
}

/// Waits until everything the engine had in flight has drained: a full read after the
/// cancelled one queues behind it.
async fn drain(engine: &Engine, path: &std::path::Path) {
    let f = engine.open(path).unwrap();
    let mut b = vec![0u8; LEN];
    assert_eq!(f.read_into(&mut b, 0).await.unwrap(), LEN);
    tokio::time::sleep(Duration::from_millis(20)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_read_never_writes_destination_again() {
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "d", LEN, 1);
    for (name, engine) in engines_for_cancel() {
        for (direct, f) in buffered_and_direct(&engine, &path) {
            for wait_us in [0u64, 200, 2000] {
                let mut c = Canaried::new(LEN, 8192);
                {
                    let mut fut = f.read_into(c.inner(), 0);
                    if poll_once(&mut fut) {
                        continue;
                    }
                    std::thread::sleep(Duration::from_micros(wait_us));
                    // Let some pieces land in slots waiting for copy-out, then drop.
                    poll_once(&mut fut);
                    drop(fut);
                }
                c.inner().fill(0x5A);
                drain(&engine, &path).await;
                assert!(
                    c.inner().iter().all(|&b| b == 0x5A),
                    "{name} direct={direct}: destination written after drop"
                );
                c.check_guards();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaked_read_never_writes_destination_again() {
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "d", LEN, 2);
    for (name, engine) in engines_for_cancel() {
        let f = engine.open(&path).unwrap();
        let mut c = Canaried::new(LEN, 8192);
        {
            let mut fut = f.read_into(c.inner(), 0);
            assert!(!poll_once(&mut fut));
            std::mem::forget(fut);
        }
        c.inner().fill(0x77);
        // The leaked op still holds bounce memory; the engine must keep working regardless.
        drain(&engine, &path).await;
        assert!(
            c.inner().iter().all(|&b| b == 0x77),
            "{name}: destination written after leak"
        );
        c.check_guards();
        // Freeing the destination after a leak is fine too (ASan would flag a later write).
        drop(c);
        drain(&engine, &path).await;
        // Shutdown with a leaked op completes: nothing waits on the forgotten future.
        tokio::time::timeout(Duration::from_secs(20), engine.shutdown())
            .await
            .expect("shutdown hung")
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_and_leaked_writes_never_read_source_again() {
    let dir = tmpdir();
    let (full, _) = test_file(dir.path(), "full", LEN, 4);
    for (name, engine) in engines_for_cancel() {
        for leak in [false, true] {
            let path = dir.path().join(format!("w-{name}-{leak}"));
            let f = engine.create(&path).unwrap();
            let mut src = vec![0x11u8; LEN];
            {
                let mut fut = f.write_from(&src, 0);
                if poll_once(&mut fut) {
                    eprintln!("{name}: write finished within one poll; nothing to cancel");
                    continue;
                }
                std::thread::sleep(Duration::from_micros(500));
                poll_once(&mut fut);
                if leak {
                    std::mem::forget(fut);
                } else {
                    drop(fut);
                }
            }
            // Reuse the source; none of this pattern may ever reach the file.
            src.fill(0x99);
            drain(&engine, &full).await;
            f.sync_all().await.unwrap();
            let on_disk = std::fs::read(&path).unwrap();
            assert!(
                on_disk.iter().all(|&b| b == 0x11 || b == 0),
                "{name} leak={leak}: source read after cancel"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_leaks_do_not_wedge_the_engine() {
    // A leaked op holds at most its window of slots; other ops still get through on the rest.
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "d", 1 << 20, 3);
    for (name, engine) in engines_for_cancel() {
        let f = engine.open(&path).unwrap();
        let mut keep = Vec::new();
        for _ in 0..20 {
            let mut b = vec![0u8; 4096];
            let mut fut = f.read_into(&mut b, 0);
            poll_once(&mut fut);
            std::mem::forget(fut);
            keep.push(b);
        }
        let mut b = vec![0u8; 100_000];
        let n = tokio::time::timeout(Duration::from_secs(20), f.read_into(&mut b, 5))
            .await
            .expect("hung")
            .unwrap();
        assert_eq!(n, 100_000, "{name}");
        assert!(b[..] == data[5..100_005]);
        // Leaked writes must not wedge later writes either.
        let w = engine.create(dir.path().join(format!("w-{name}"))).unwrap();
        let big = vec![1u8; 4 << 20];
        {
            let mut fut = w.write_from(&big, 0);
            poll_once(&mut fut);
            std::mem::forget(fut);
        }
        let n = tokio::time::timeout(Duration::from_secs(20), w.write_from(&data, 0))
            .await
            .expect("write hung")
            .unwrap();
        assert_eq!(n, data.len(), "{name}");
    }
}

/// A future dropped after its op finished in the reactor but before it took the last pieces
/// handed to it: those slots must still come back (they once leaked, and a soak wedged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_after_the_op_finished_gives_its_slots_back() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "late-drop", 1 << 20, 5);
    for (name, engine) in engines() {
        let f = engine.open(&path).unwrap();
        // 4 MiB pools: 64 leaked reads of 256 KiB would take them many times over.
        for _ in 0..64 {
            let mut buf = vec![0u8; 256 << 10];
            let mut fut = f.read_into(&mut buf, 4096);
            if poll_once(&mut fut) {
                continue; // finished within the first poll: nothing left to drop
            }
            // Let the reactor finish the op and hand over every piece, then drop unpolled.
            std::thread::sleep(Duration::from_millis(5));
            drop(fut);
        }
        let mut all = vec![0u8; 1 << 20];
        let n = tokio::time::timeout(Duration::from_secs(10), f.read_into(&mut all, 0))
            .await
            .unwrap_or_else(|_| panic!("{name}: engine wedged: slots leaked by late drops"))
            .unwrap();
        assert_eq!(n, data.len());
        assert_eq!(all, data, "{name}");
    }
}
