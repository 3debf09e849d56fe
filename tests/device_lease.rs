//! Device leases (reads whose copies the reactor issues; `EngineBuilder::device_leases`, whose
//! contract these tests keep): data lands; dropping or leaking a
//! leased read mid-flight, then freeing and reallocating its memory, never lets a copy touch
//! memory the caller got back (canaries around it, fresh allocations after it), with cudarc's
//! event tracking on and off and with `on_stream`; a dropped read releases its stream; a
//! dying reactor releases every lease it holds; several streams and several reads per stream
//! complete; the per-thread stream is refused. Each test says why it skipped where no
//! GPU (or no lease support) exists.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use gpuio::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use gpuio::{Engine, OpenOptions};

/// Tests here change context-wide state (event tracking): one at a time.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn gpu_with_leases(test: &str) -> Option<Arc<CudaContext>> {
    backtrace_on_segv();
    if !gpuio::cuda::available() {
        let p = gpuio::cuda::probe();
        skipped(format!(
            "{test}: no usable CUDA device ({})",
            p.error.as_deref().unwrap_or("no devices")
        ));
        return None;
    }
    if let Err(why) = gpuio::cuda::lease_support(0) {
        skipped(format!("{test}: device leases unsupported here ({why})"));
        return None;
    }
    Some(gpuio::cuda::context(0).expect("CUDA context"))
}

/// Builds with device leases on.
trait BuildLeased {
    fn build_leased(self) -> Engine;
}

impl BuildLeased for gpuio::EngineBuilder {
    fn build_leased(self) -> Engine {
        // SAFETY: these tests free a leaked read's destination only after its stream has
        // passed the read (`stream_done_within`), and free nothing synchronously.
        unsafe { self.device_leases(Some(gpuio::DEFAULT_LEASE_MIN)) }
            .build()
            .unwrap()
    }
}

fn d2h(stream: &Arc<CudaStream>, d: &CudaSlice<u8>) -> Vec<u8> {
    stream.clone_dtoh(d).expect("device to host")
}

/// Waits for `stream` on a blocking thread, failing the test if it takes longer than `limit`
/// (a lease never released would hang it).
async fn stream_done_within(stream: &Arc<CudaStream>, limit: Duration, what: &str) {
    let s = stream.clone();
    let t = Instant::now();
    let waited =
        tokio::time::timeout(limit, tokio::task::spawn_blocking(move || s.synchronize())).await;
    match waited {
        Ok(r) => r.unwrap().unwrap(),
        Err(_) => {
            panic!("{what}: the stream was still blocked after {limit:?} (lease never released)")
        }
    }
    eprintln!("{what}: stream free after {:?}", t.elapsed());
}

fn engine() -> Engine {
    Engine::builder()
        .chunk_size(1 << 20)
        .queue_depth(8)
        .bounce_slots(64)
        .build_leased()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leased_reads_land_and_are_counted() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(ctx) = gpu_with_leases("leased_reads_land_and_are_counted") else {
        return;
    };
    let dir = tmpdir();
    let (path, want) = test_file(dir.path(), "f", (64 << 20) + 4099, 41);
    let engine = engine();
    let f = engine.open(&path).unwrap();
    let s = ctx.default_stream();
    let x = ctx.new_stream().unwrap();
    let before = engine.leased_reads();
    let boards = gpuio::cuda::lease_boards_made();
    let mut leased = 0;
    for (off, len, on_x) in [
        (0u64, 64usize << 10, false),
        (12_345, (1 << 20) + 13, false),
        (4096, 48 << 20, true),
        (0, (64 << 20) + 4099, false),
        ((64 << 20) - 100, 1 << 20, false), // runs past the end: short
        (7, 4096, false),                   // below the lease threshold: the future copies
    ] {
        let mut d = s.alloc_zeros::<u8>(len).unwrap();
        let fut = f.read_into(&mut d, off);
        let fut = if on_x { fut.on_stream(&x) } else { fut };
        let n = within(fut).await.unwrap();
        let end = (off as usize + len).min(want.len());
        assert_eq!(n, end - off as usize, "read at {off}+{len}");
        if len >= gpuio::DEFAULT_LEASE_MIN {
            leased += 1;
        }
        // On X the bytes must be visible to X's later work without any host sync.
        let got = if on_x { d2h(&x, &d) } else { d2h(&s, &d) };
        assert_eq!(
            differing(&got[..n], &want[off as usize..end]),
            0,
            "{off}+{len}"
        );
        assert!(
            got[n..].iter().all(|&b| b == 0),
            "bytes past the end written"
        );
    }
    assert_eq!(
        engine.leased_reads() - before,
        leased,
        "reads that took a lease"
    );
    assert!(
        gpuio::cuda::lease_boards_made() <= boards.max(1),
        "leases set up new boards ({} before, {} after): the board's registration check fails",
        boards,
        gpuio::cuda::lease_boards_made()
    );
}

/// The soundness test: for drop and `mem::forget`, with cudarc's event tracking on
/// and off, on the memory's own stream and with `on_stream`: (1) the caller's own writes after
/// abandoning the read are what the memory holds, canaries untouched; (2) memory freed after
/// an abandoned read and allocated again, on the same stream and on another, stays untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn abandoned_leased_reads_never_touch_returned_memory() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(ctx) = gpu_with_leases("abandoned_leased_reads_never_touch_returned_memory") else {
        return;
    };
    const LEN: usize = 96 << 20;
    const GUARD: usize = 1 << 20;
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "d", LEN, 42);
    let engine = engine();
    let f = OpenOptions::new()
        .read(true)
        .direct(direct_ok(&engine, &path))
        .open(&engine, &path)
        .unwrap();
    let s = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    let x = ctx.new_stream().unwrap();
    for tracking in [true, false] {
        if !tracking {
            // SAFETY: every later use in this test orders itself by stream (one stream, or
            // synchronize), as the contract of disable_event_tracking asks.
            unsafe { ctx.disable_event_tracking() };
        }
        for leak in [false, true] {
            for on_x in [false, true] {
                let what = format!("tracking={tracking} leak={leak} on_stream={on_x}");
                let before = engine.leased_reads();
                let mut whole = s.clone_htod(&vec![CANARY; LEN + 2 * GUARD]).unwrap();
                {
                    let mut view = whole.slice_mut(GUARD..GUARD + LEN);
                    let fut = f.read_into(&mut view, 0);
                    let fut = if on_x { fut.on_stream(&x) } else { fut };
                    abandon_mid_flight(fut, 2, leak);
                }
                {
                    let mut view = whole.slice_mut(GUARD..GUARD + LEN);
                    s.memcpy_htod(&vec![0x5Au8; LEN], &mut view).unwrap();
                }
                stream_done_within(&s, Duration::from_secs(60), &what).await;
                assert_eq!(engine.leased_reads() - before, 1, "{what}: not leased");
                let back = d2h(&s, &whole);
                assert!(
                    back[..GUARD].iter().all(|&b| b == CANARY),
                    "{what}: front canary"
                );
                assert!(
                    back[GUARD + LEN..].iter().all(|&b| b == CANARY),
                    "{what}: back canary"
                );
                assert!(
                    back[GUARD..GUARD + LEN].iter().all(|&b| b == 0x5A),
                    "{what}: destination written after the caller took it back"
                );

                let mut doomed = s.alloc_zeros::<u8>(LEN).unwrap();
                {
                    let fut = f.read_into(&mut doomed, 0);
                    let fut = if on_x { fut.on_stream(&x) } else { fut };
                    abandon_mid_flight(fut, 2, leak);
                }
                if leak {
                    // The contract of `device_leases`: a leaked read's destination is freed
                    // only once its stream has passed the read. A dropped one at once.
                    stream_done_within(&s, Duration::from_secs(60), &what).await;
                }
                drop(doomed);
                let fresh: Vec<CudaSlice<u8>> = (0..4)
                    .map(|i| {
                        let on = if i % 2 == 0 { &s } else { &other };
                        on.clone_htod(&vec![0x33u8; LEN / 4]).unwrap()
                    })
                    .collect();
                stream_done_within(&s, Duration::from_secs(60), &what).await;
                ctx.synchronize().unwrap();
                for (i, d) in fresh.iter().enumerate() {
                    let on = if i % 2 == 0 { &s } else { &other };
                    assert!(
                        d2h(on, d).iter().all(|&b| b == 0x33),
                        "{what}: freed and reallocated memory written"
                    );
                }
            }
        }
        if !tracking {
            // SAFETY: all work above is complete (synchronized); tracking resumes for new slices.
            unsafe { ctx.enable_event_tracking() };
        }
    }
    within(engine.shutdown()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_leased_read_releases_its_stream() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(ctx) = gpu_with_leases("a_dropped_leased_read_releases_its_stream") else {
        return;
    };
    const LEN: usize = 512 << 20;
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "big", LEN, 43);
    // A small pool and depth: the whole read would take many turns.
    let engine = Engine::builder()
        .chunk_size(1 << 20)
        .queue_depth(2)
        .bounce_slots(8)
        .build_leased();
    let f = engine.open(&path).unwrap();
    let s = ctx.new_stream().unwrap();
    let mut d = s.alloc_zeros::<u8>(LEN).unwrap();
    {
        let mut fut = f.read_into(&mut d, 0);
        poll_once(&mut fut);
        std::thread::sleep(Duration::from_millis(5));
        drop(fut);
    }
    let t = Instant::now();
    stream_done_within(&s, Duration::from_secs(20), "dropped read").await;
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "the stream waited {:?} after the drop",
        t.elapsed()
    );
    within(engine.shutdown()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dying_reactor_releases_its_leases() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(ctx) = gpu_with_leases("a_dying_reactor_releases_its_leases") else {
        return;
    };
    const LEN: usize = 64 << 20;
    const GUARD: usize = 1 << 20;
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "d", LEN, 44);
    let engine = Engine::builder()
        .chunk_size(1 << 20)
        .queue_depth(2)
        .bounce_slots(16)
        .build_leased();
    let f = engine.open(&path).unwrap();
    let streams: Vec<Arc<CudaStream>> = (0..4).map(|_| ctx.new_stream().unwrap()).collect();
    let mut wholes: Vec<CudaSlice<u8>> = streams
        .iter()
        .map(|s| s.clone_htod(&vec![CANARY; LEN + 2 * GUARD]).unwrap())
        .collect();
    let mut views: Vec<_> = wholes
        .iter_mut()
        .map(|w| w.slice_mut(GUARD..GUARD + LEN))
        .collect();
    let mut futs: Vec<_> = views.iter_mut().map(|v| f.read_into(v, 0)).collect();
    for fut in &mut futs {
        poll_once(fut);
    }
    engine.inject_reactor_panic();
    for fut in futs {
        match within(fut).await {
            Err(gpuio::Error::ReactorDied { .. }) | Ok(_) => {}
            Err(e) => panic!("unexpected error after the reactor died: {e}"),
        }
    }
    drop(views);
    for (i, s) in streams.iter().enumerate() {
        stream_done_within(s, Duration::from_secs(20), &format!("stream {i}")).await;
        let back = d2h(s, &wholes[i]);
        assert!(
            back[..GUARD].iter().all(|&b| b == CANARY),
            "front canary {i}"
        );
        assert!(
            back[GUARD + LEN..].iter().all(|&b| b == CANARY),
            "back canary {i}"
        );
    }
    assert!(engine.failure().is_some(), "the reactor should have died");
}

/// Several streams, each with a large read followed by a small one on the same stream: every
/// read completes and lands. Four streams and the copy stream stay within the driver's
/// default eight hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`): past that, a stream held by a
/// lease can share a queue with the copy stream and deadlock (`docs/device-leases.md` §7), so
/// a test with more streams could hang or pass by luck of queue assignment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_streams_and_reads_sharing_a_stream_complete() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(ctx) = gpu_with_leases("many_streams_and_reads_sharing_a_stream_complete") else {
        return;
    };
    const STREAMS: usize = 4;
    const BIG: usize = 8 << 20;
    const SMALL: usize = 256 << 10;
    let dir = tmpdir();
    let (path, want) = test_file(dir.path(), "m", BIG + SMALL, 45);
    let engine = Engine::builder().build_leased();
    let f = engine.open(&path).unwrap();
    let streams: Vec<Arc<CudaStream>> = (0..STREAMS).map(|_| ctx.new_stream().unwrap()).collect();
    let mut bigs: Vec<CudaSlice<u8>> = streams
        .iter()
        .map(|s| s.alloc_zeros(BIG).unwrap())
        .collect();
    let mut smalls: Vec<CudaSlice<u8>> = streams
        .iter()
        .map(|s| s.alloc_zeros(SMALL).unwrap())
        .collect();
    let before = engine.leased_reads();
    {
        let mut futs = Vec::new();
        for (b, s) in bigs.iter_mut().zip(smalls.iter_mut()) {
            futs.push(f.read_into(b, 0));
            futs.push(f.read_into(s, BIG as u64));
        }
        let all = futures_join_all(futs);
        for r in tokio::time::timeout(Duration::from_secs(60), all)
            .await
            .expect("reads sharing streams deadlocked")
        {
            r.unwrap();
        }
    }
    assert_eq!(engine.leased_reads() - before, 2 * STREAMS as u64);
    for (i, s) in streams.iter().enumerate() {
        assert_eq!(differing(&d2h(s, &bigs[i]), &want[..BIG]), 0, "big {i}");
        assert_eq!(differing(&d2h(s, &smalls[i]), &want[BIG..]), 0, "small {i}");
    }
}

/// Reads queued one after another on one stream, with a pool too small for all of them: the
/// later ones wait (on the GPU) for the earlier ones' releases, so slots they hold while they
/// wait must not starve the earlier ones. Awaited last-first, they all complete and land.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn later_reads_on_a_stream_never_starve_earlier_ones() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(ctx) = gpu_with_leases("later_reads_on_a_stream_never_starve_earlier_ones") else {
        return;
    };
    const READS: usize = 6;
    const LEN: usize = 16 << 20;
    let dir = tmpdir();
    let (path, want) = test_file(dir.path(), "chain", READS * LEN, 47);
    // Eight 1 MiB slots, two per op: six ops that each took their share would hold 12.
    let engine = Engine::builder()
        .chunk_size(1 << 20)
        .queue_depth(8)
        .bounce_slots(8)
        .build_leased();
    let f = engine.open(&path).unwrap();
    let s = ctx.new_stream().unwrap();
    let mut dsts: Vec<CudaSlice<u8>> = (0..READS).map(|_| s.alloc_zeros(LEN).unwrap()).collect();
    let before = engine.leased_reads();
    {
        let mut futs: Vec<_> = dsts
            .iter_mut()
            .enumerate()
            .map(|(i, d)| f.read_into(d, (i * LEN) as u64))
            .collect();
        for fut in &mut futs {
            poll_once(fut);
        }
        while let Some(fut) = futs.pop() {
            let i = futs.len();
            let n = tokio::time::timeout(Duration::from_secs(60), fut)
                .await
                .unwrap_or_else(|_| panic!("read {i} never completed (starved)"))
                .unwrap();
            assert_eq!(n, LEN);
        }
    }
    assert_eq!(engine.leased_reads() - before, READS as u64);
    for (i, d) in dsts.iter().enumerate() {
        assert_eq!(
            differing(&d2h(&s, d), &want[i * LEN..(i + 1) * LEN]),
            0,
            "read {i}"
        );
    }
}

/// Polls every future until all are done (no extra crate for join_all).
async fn futures_join_all<F: std::future::Future + Unpin>(mut futs: Vec<F>) -> Vec<F::Output> {
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in futs.iter_mut().enumerate() {
            if out[i].is_none() {
                match std::pin::Pin::new(f).poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("polled to completion"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_thread_stream_is_refused_and_the_future_copies() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(ctx) = gpu_with_leases("the_per_thread_stream_is_refused_and_the_future_copies")
    else {
        return;
    };
    let dir = tmpdir();
    let (path, want) = test_file(dir.path(), "p", 8 << 20, 46);
    let engine = engine();
    let f = engine.open(&path).unwrap();
    let pts = ctx.per_thread_stream();
    let mut d = pts.alloc_zeros::<u8>(8 << 20).unwrap();
    let before = engine.leased_reads();
    let n = within(f.read_into(&mut d, 0)).await.unwrap();
    assert_eq!(n, 8 << 20);
    assert_eq!(
        engine.leased_reads(),
        before,
        "the per-thread stream took a lease"
    );
    let check = ctx.default_stream();
    pts.synchronize().unwrap();
    assert_eq!(differing(&d2h(&check, &d), &want), 0);
}
