//! Reactor tests: with a real main lane where the kernel matters, and with a fake lane that
//! runs the loop by hand, without threads, files or a GPU.

use super::*;
use std::sync::atomic::Ordering;

use crate::error::Error;
use crate::op::gate::{Gate, GateState};

struct FixedGate(fn() -> GateState);

impl Gate for FixedGate {
    fn poll(&self) -> GateState {
        (self.0)()
    }
}

fn gated(state: fn() -> GateState, arena: &Arc<BounceArena>) -> Gated {
    let release = Msg::Release(OpShared::new().op_ref(), Default::default());
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
            // The tests' 1 MiB reads of a just-written file must reach the reactor, not be
            // copied from the page cache by the polling thread.
            .page_cache_read_max(crate::CACHED_READ_MAX)
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
            engine.shared().reactor.send(Msg::PanicAtNextCompletion);
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

/// Reads submitted from several tasks while the reactor dies: every one fails with
/// `ReactorDied` naming the panic, never a plain `Shutdown`, whichever side of the death its
/// send fell on (a send under way when the channel closed lands before the reactor's last
/// look at the queue: `ReactorHandle::settle_sends`).
#[test]
fn reads_racing_a_reactor_death_all_name_it() {
    with_panic_fixture("the racing-death test", |backend, engine, file, rt| {
        rt.block_on(async {
            // 128 KiB reads: past the size the page cache serves in poll, so each reaches
            // the reactor.
            let tasks: Vec<_> = (0..4u64)
                .map(|t| {
                    let file = file.clone();
                    tokio::spawn(async move {
                        let mut b = vec![0u8; 128 << 10];
                        for i in 0u64.. {
                            let off = ((t * 16 + i) % 64) * (128 << 10);
                            if let Err(e) = file.read_into(&mut b, off).await {
                                return e;
                            }
                        }
                        unreachable!()
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_millis(20)).await;
            engine.shared().reactor.send(Msg::PanicAtNextCompletion);
            let errors =
                tokio::time::timeout(Duration::from_secs(20), futures::future::join_all(tasks))
                    .await
                    .expect("reads hung after the reactor panicked");
            for e in errors {
                match e.expect("task ran to its error") {
                    Error::ReactorDied { reason, .. } => {
                        assert!(reason.contains("injected reactor panic"), "{reason}")
                    }
                    other => panic!("{backend:?}: expected ReactorDied, got {other:?}"),
                }
            }
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
            engine.shared().reactor.send(Msg::PanicAtNextCompletion);
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
        // Reads too must wait in the kernel: none is copied from the page cache in poll.
        .page_cache_read_max(crate::CACHED_READ_MAX)
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
    let before = engine.shared().stats.turns.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(200));
    let turns = engine.shared().stats.turns.load(Ordering::Relaxed) - before;
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
        let before = engine.shared().stats.turns.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(200));
        let turns = engine.shared().stats.turns.load(Ordering::Relaxed) - before;
        // A 100 µs tick would turn about 2000 times in 200 ms.
        assert!(
            turns < 50,
            "{backend:?}: idle reactor turned {turns} times in 200 ms"
        );
    }
}
