//! Device memory: reads into and writes from GPU memory through the bounce path.
//! Every test says loudly that it skipped where no usable CUDA device exists.

// Each test holds its turn (`GPU_TURNS`) across its awaits on purpose: the lock orders whole
// tests, and each test's runtime is its own, so no task waits on a lock held on its thread.
#![allow(clippy::await_holding_lock)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use gpuio::batch::{BatchPlan, ReadDesc};
use gpuio::cuda::cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use gpuio::{Engine, OpenOptions};

/// Tests of this binary run side by side, except the one that times reads against a stream a
/// kernel holds. Beside other tests it took the whole hold; alone, never. Most likely, while
/// that kernel runs, another test's device-wide synchronising call (an engine unpinning its
/// pool, a synchronous free) holds the driver's locks, so its copies wait for its own kernel
/// (2 of 5 runs of the binary on the H100 with four test threads).
static GPU_TURNS: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn d2h(stream: &Arc<CudaStream>, d: &CudaSlice<u8>) -> Vec<u8> {
    stream.clone_dtoh(d).expect("dtov")
}

/// File bytes are a function of position, so kernels can check them without a reference.
fn byte_at(pos: u64) -> u8 {
    (pos.wrapping_mul(2_654_435_761) >> 7) as u8
}

fn formula_file(dir: &std::path::Path, len: usize) -> std::path::PathBuf {
    let p = dir.join("formula.bin");
    let data: Vec<u8> = (0..len as u64).map(byte_at).collect();
    std::fs::write(&p, data).unwrap();
    p
}

#[test]
fn no_cuda_is_unsupported_not_a_panic() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    if gpuio::cuda::available() {
        skipped("no_cuda_is_unsupported_not_a_panic: this machine has a GPU");
        return;
    }
    let e = gpuio::cuda::context(0).unwrap_err();
    assert!(matches!(e, gpuio::Error::Unsupported { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_random_ranges_match_pread() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu("device_random_ranges_match_pread") else {
        return;
    };
    let stream = ctx.default_stream();
    let dir = tmpdir();
    const LEN: usize = (1 << 30) + 12_345;
    let (path, _) = test_file(dir.path(), "big", LEN, 11);
    let engine = Engine::new().unwrap();
    for (direct, f) in buffered_and_direct(&engine, &path) {
        let mut rng = fastrand::Rng::with_seed(5);
        let mut cases: Vec<(u64, usize)> = vec![
            (0, 1),
            (4095, 4097),
            (1, (1 << 30) - 1),
            (4095, 1 << 30),
            (LEN as u64 - 3, 100),
        ];
        for _ in 0..30 {
            let len = 1usize << rng.u32(0..31);
            let len = rng.usize(len / 2..=len).max(1);
            cases.push((rng.u64(0..LEN as u64), len));
        }
        for (off, len) in cases {
            let mut d = stream.alloc_zeros::<u8>(len).unwrap();
            let n = f.read_into(&mut d, off).await.unwrap();
            let want = pread_ref(&path, off, len);
            assert_eq!(n, want.len(), "direct={direct} {off}+{len}");
            let got = d2h(&stream, &d);
            assert!(got[..n] == want[..], "direct={direct} data at {off}+{len}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_concurrent_reads_into_distinct_slices() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu("many_concurrent_reads_into_distinct_slices") else {
        return;
    };
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "d", 64 << 20, 12);
    let data = Arc::new(data);
    let engine = Engine::new().unwrap();
    let f = Arc::new(engine.open(&path).unwrap());
    let mut set = tokio::task::JoinSet::new();
    for t in 0..64u64 {
        let (f, data, ctx) = (f.clone(), data.clone(), ctx.clone());
        set.spawn(async move {
            let stream = ctx.new_stream().unwrap();
            let mut rng = fastrand::Rng::with_seed(t);
            for _ in 0..8 {
                let off = rng.usize(0..data.len());
                let len = rng.usize(1..4 << 20);
                let mut d = stream.alloc_zeros::<u8>(len).unwrap();
                let n = f.read_into(&mut d, off as u64).await.unwrap();
                assert_eq!(n, len.min(data.len() - off));
                let got = stream.clone_dtoh(&d).unwrap();
                assert!(got[..n] == data[off..off + n]);
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_write_then_read_back() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu("device_write_then_read_back") else {
        return;
    };
    let stream = ctx.default_stream();
    let dir = tmpdir();
    let engine = Engine::new().unwrap();
    for (direct, path, f) in fresh_rw_files(&engine, dir.path(), "w") {
        let src = pattern(37 << 20, 3);
        let d = stream.clone_htod(&src).unwrap();
        assert_eq!(f.write_from(&d, 777).await.unwrap(), src.len());
        f.sync_all().await.unwrap();
        let back = std::fs::read(&path).unwrap();
        assert_eq!(back.len(), 777 + src.len());
        assert!(back[777..] == src[..], "direct={direct}");
        // Typed slices, viewed as bytes, both ways.
        let floats: Vec<f32> = (0..1_000_003).map(|i| i as f32 * 0.5).collect();
        let df = stream.clone_htod(&floats).unwrap();
        f.write_from(&df, 0).await.unwrap();
        let mut back_f = stream.alloc_zeros::<f32>(floats.len()).unwrap();
        assert_eq!(f.read_into(&mut back_f, 0).await.unwrap(), floats.len() * 4);
        assert_eq!(stream.clone_dtoh(&back_f).unwrap(), floats);
    }
}

const CHECK_KERNEL: &str = r#"
extern "C" __global__ void check(const unsigned char* d, unsigned long long n,
                                 unsigned long long off, unsigned int* bad) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned char want = (unsigned char)(((off + i) * 2654435761ull) >> 7);
        if (d[i] != want) atomicAdd(bad, 1u);
    }
}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn read_ordered_on_stream_then_kernel_checks_it() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu("read_ordered_on_stream_then_kernel_checks_it") else {
        return;
    };
    let ptx = match cudarc::nvrtc::compile_ptx(CHECK_KERNEL) {
        Ok(p) => p,
        Err(e) => {
            skipped(format!(
                "read_ordered_on_stream_then_kernel_checks_it: NVRTC unavailable: {e:?}"
            ));
            return;
        }
    };
    let module = ctx.load_module(ptx).unwrap();
    let check = module.load_function("check").unwrap();
    let dir = tmpdir();
    const LEN: usize = 200 << 20;
    let path = formula_file(dir.path(), LEN);
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    // The buffer belongs to one stream; the read and the kernel are ordered on another.
    let home = ctx.new_stream().unwrap();
    let work = ctx.new_stream().unwrap();
    for (off, n) in [(0u64, LEN), (12_345, 64 << 20), (LEN as u64 - 1000, 1000)] {
        let mut d = home.alloc_zeros::<u8>(n).unwrap();
        let mut bad = work.alloc_zeros::<u32>(1).unwrap();
        let got = f.read_into(&mut d, off).on_stream(&work).await.unwrap();
        assert_eq!(got, n);
        let mut b = work.launch_builder(&check);
        let n64 = n as u64;
        b.arg(&d).arg(&n64).arg(&off).arg(&mut bad);
        unsafe { b.launch(LaunchConfig::for_num_elems(n.min(1 << 24) as u32)) }.unwrap();
        let bad = work.clone_dtoh(&bad).unwrap()[0];
        assert_eq!(bad, 0, "kernel saw {bad} wrong bytes at {off}+{n}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drop_and_leak_mid_flight_then_reuse_and_free() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu("drop_and_leak_mid_flight_then_reuse_and_free") else {
        return;
    };
    let stream = ctx.default_stream();
    let dir = tmpdir();
    const LEN: usize = 256 << 20;
    const GUARD: usize = 1 << 20;
    let (path, _) = test_file(dir.path(), "d", LEN, 21);
    let (full, _) = test_file(dir.path(), "full", 32 << 20, 22);
    let engine = Engine::builder()
        .chunk_size(1 << 20)
        .queue_depth(4)
        .bounce_slots(32)
        .build()
        .unwrap();
    let f = OpenOptions::new()
        .read(true)
        .direct(direct_ok(&engine, &path))
        .open(&engine, &path)
        .unwrap();
    let drain = || async {
        let g = engine.open(&full).unwrap();
        let mut b = vec![0u8; 32 << 20];
        g.read_into(&mut b, 0).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for leak in [false, true] {
        // Reuse: canary | destination | canary, all in one allocation.
        let mut whole = stream.clone_htod(&vec![CANARY; LEN + 2 * GUARD]).unwrap();
        {
            let mut view = whole.slice_mut(GUARD..GUARD + LEN);
            abandon_mid_flight(f.read_into(&mut view, 0), 2, leak);
        }
        // The caller takes the memory back and writes its own pattern (stream-ordered).
        let mut view = whole.slice_mut(GUARD..GUARD + LEN);
        stream.memcpy_htod(&vec![0x5Au8; LEN], &mut view).unwrap();
        drain().await;
        stream.synchronize().unwrap();
        let back = d2h(&stream, &whole);
        assert!(
            back[..GUARD].iter().all(|&b| b == CANARY),
            "leak={leak}: front canary"
        );
        assert!(
            back[GUARD + LEN..].iter().all(|&b| b == CANARY),
            "leak={leak}: back canary"
        );
        assert!(
            back[GUARD..GUARD + LEN].iter().all(|&b| b == 0x5A),
            "leak={leak}: destination written after cancel"
        );

        // Free: drop the destination mid-flight, then fill new allocations with a pattern.
        let mut doomed = stream.alloc_zeros::<u8>(LEN).unwrap();
        {
            let mut fut = f.read_into(&mut doomed, 0);
            poll_once(&mut fut);
            if leak {
                std::mem::forget(fut);
            } else {
                drop(fut);
            }
        }
        drop(doomed);
        let fresh: Vec<CudaSlice<u8>> = (0..4)
            .map(|_| stream.clone_htod(&vec![0x33u8; LEN / 4]).unwrap())
            .collect();
        drain().await;
        stream.synchronize().unwrap();
        for d in &fresh {
            assert!(
                d2h(&stream, d).iter().all(|&b| b == 0x33),
                "leak={leak}: freed memory written"
            );
        }
    }
    tokio::time::timeout(Duration::from_secs(30), engine.shutdown())
        .await
        .expect("shutdown hung")
        .unwrap();
}

/// Copies queued on another stream must finish before the buffer is freed on its own stream,
/// even after that other stream is gone (which turns cudarc's cross-stream tracking off).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn free_after_leaked_read_on_a_dropped_stream() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu("free_after_leaked_read_on_a_dropped_stream") else {
        return;
    };
    let home = ctx.default_stream();
    let dir = tmpdir();
    const LEN: usize = 128 << 20;
    let (path, _) = test_file(dir.path(), "d", LEN, 31);
    let (full, _) = test_file(dir.path(), "full", 16 << 20, 32);
    let engine = Engine::builder()
        .chunk_size(1 << 20)
        .queue_depth(8)
        .bounce_slots(64)
        .build()
        .unwrap();
    let f = engine.open(&path).unwrap();
    for _ in 0..3 {
        let work = ctx.new_stream().unwrap();
        let mut doomed = home.alloc_zeros::<u8>(LEN).unwrap();
        {
            let mut fut = f.read_into(&mut doomed, 0).on_stream(&work);
            for _ in 0..20 {
                if poll_once(&mut fut) {
                    break;
                }
                std::thread::sleep(Duration::from_micros(300));
            }
            std::mem::forget(fut);
        }
        drop(work);
        drop(doomed);
        let fresh: Vec<CudaSlice<u8>> = (0..4)
            .map(|_| home.clone_htod(&vec![0x44u8; LEN / 4]).unwrap())
            .collect();
        let g = engine.open(&full).unwrap();
        let mut b = vec![0u8; 16 << 20];
        g.read_into(&mut b, 0).await.unwrap();
        ctx.synchronize().unwrap();
        for d in &fresh {
            assert!(
                d2h(&home, d).iter().all(|&b| b == 0x44),
                "freed memory written by a queued copy"
            );
        }
    }
}

#[test]
fn synchronize_waits_for_the_stream_without_blocking_the_thread() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu("synchronize_waits_for_the_stream_without_blocking_the_thread") else {
        return;
    };
    // One thread: if `synchronize` blocked it, the ticker below could not run during the wait.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let engine = Engine::new().unwrap();
        let stream = ctx.new_stream().unwrap();
        let ptx = cudarc::nvrtc::compile_ptx(SPIN_KERNEL).unwrap();
        let spin = ctx.load_module(ptx).unwrap().load_function("spin").unwrap();
        let mut flag = stream.alloc_zeros::<u32>(1).unwrap();
        let ns: u64 = 300_000_000;
        let mut b = stream.launch_builder(&spin);
        b.arg(&ns).arg(&mut flag);
        // SAFETY: one thread writes the one u32 `flag` holds.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
        let done = stream.record_event(None).unwrap();

        let ticks = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let ticker = tokio::spawn({
            let ticks = ticks.clone();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    ticks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        });
        // The kernel must still be running when the wait starts, or there is nothing to wait
        // for. (An earlier form asserted a wait of at least 200 ms of the kernel's 300, which
        // failed once on an H100: how long the kernel runs after its launch is the device's
        // business, so the test now asks the stream itself.)
        assert!(
            !done.is_complete(),
            "the kernel ended before the wait began"
        );
        let t0 = std::time::Instant::now();
        engine.synchronize(&stream).await.expect("synchronize");
        let waited = t0.elapsed();
        ticker.abort();
        assert!(done.is_complete(), "resolved before the stream finished");
        // A 10 ms ticker on this one thread ticks about once per 10 ms of the wait unless the
        // wait blocks the thread, when it cannot tick at all; half that rate allows for timer
        // slack. Under 50 ms of waiting there is too little time to tell.
        let n = ticks.load(std::sync::atomic::Ordering::Relaxed);
        if waited >= Duration::from_millis(50) {
            let expected = (waited.as_millis() / 20) as u32;
            assert!(
                n >= expected,
                "the thread was blocked: {n} ticks in {waited:?} (at least {expected} expected)"
            );
        } else {
            println!("short wait ({waited:?}): the ticker check is skipped, {n} ticks");
        }
        assert_eq!(stream.clone_dtoh(&flag).unwrap(), vec![1]);

        // Dropping a wait midway is harmless; after shutdown a wait errs instead of hanging.
        b = stream.launch_builder(&spin);
        b.arg(&ns).arg(&mut flag);
        // SAFETY: as above.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
        let mut early = Box::pin(engine.synchronize(&stream));
        assert!(!poll_once(&mut early), "resolved while the kernel runs");
        drop(early);
        engine.shutdown().await.unwrap();
        let after = tokio::time::timeout(Duration::from_secs(5), engine.synchronize(&stream))
            .await
            .expect("synchronize after shutdown hung");
        assert!(after.is_err(), "synchronize after shutdown: {after:?}");
        stream.synchronize().unwrap();
    });
}

/// Device pointers at odd byte offsets (views into one allocation), read into and written
/// from, through the bounce path and through AUTO (cuFile for O_DIRECT files where it
/// registers): the bytes land exactly there and nowhere around them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misaligned_device_pointers() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu("misaligned_device_pointers") else {
        return;
    };
    let stream = ctx.default_stream();
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "m", 8 << 20, 21);
    for backend in [gpuio::Backend::Uring, gpuio::Backend::Auto] {
        // AUTO with compatibility-mode cuFile allowed: cuFile serves O_DIRECT files here.
        let engine = Engine::builder()
            .backend(backend)
            .cufile_compat(true)
            .build()
            .unwrap();
        for (direct, f) in buffered_and_direct(&engine, &path) {
            for (at, off, len) in [
                (1usize, 0u64, 4096usize),
                (3, 4095, 1 << 20),
                (4095, 12_345, (3 << 20) + 7),
                (4097, 0, 8 << 20),
            ] {
                let total = at + len + 4096;
                let mut d = stream.alloc_zeros::<u8>(total).unwrap();
                let n = {
                    let mut view = d.slice_mut(at..at + len);
                    f.read_into(&mut view, off).await.unwrap()
                };
                let want = pread_ref(&path, off, len);
                assert_eq!(n, want.len(), "{backend:?} direct={direct} at {at}");
                let got = d2h(&stream, &d);
                assert!(
                    got[..at].iter().all(|&b| b == 0),
                    "{backend:?}: bytes before the view"
                );
                assert!(
                    got[at..at + n] == want[..],
                    "{backend:?} direct={direct} at {at}: data"
                );
                assert!(
                    got[at + n..].iter().all(|&b| b == 0),
                    "{backend:?}: bytes after the view"
                );
            }
        }
        // Writes from a misaligned view, read back with std.
        let wpath = dir.path().join(format!("mw-{backend:?}"));
        for direct in [false, true] {
            std::fs::write(&wpath, vec![0u8; 4 << 20]).unwrap();
            let w = match OpenOptions::new()
                .read(true)
                .write(true)
                .direct(direct)
                .open(&engine, &wpath)
            {
                Ok(w) => w,
                Err(e) => {
                    skipped(format!(
                        "misaligned_device_pointers writes direct={direct}: {e}"
                    ));
                    continue;
                }
            };
            let src = stream.clone_htod(&data[..3 << 20]).unwrap();
            let view = src.slice(5..(2 << 20) + 5);
            assert_eq!(w.write_from(&view, 777).await.unwrap(), 2 << 20);
            w.sync_all().await.unwrap();
            let back = std::fs::read(&wpath).unwrap();
            assert!(
                back[777..777 + (2 << 20)] == data[5..(2 << 20) + 5],
                "{backend:?} direct={direct}"
            );
            assert!(back[..777].iter().all(|&b| b == 0));
        }
    }
}

/// Memory on another GPU than the one an engine served first: each transfer goes to the
/// memory's own device (its own stream), through the bounce path where the cuFile staging
/// pool lives on another GPU. Needs two GPUs; says so and skips otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_on_a_second_gpu() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    if gpu("memory_on_a_second_gpu").is_none() {
        return;
    }
    let count = gpuio::cuda::probe().devices.len();
    if count < 2 {
        skipped(format!(
            "memory_on_a_second_gpu: needs two GPUs, this machine has {count}"
        ));
        return;
    }
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "two", 16 << 20, 31);
    let engine = Engine::builder().cufile_compat(true).build().unwrap();
    let ctxs = [
        gpuio::cuda::context(0).unwrap(),
        gpuio::cuda::context(1).unwrap(),
    ];
    for (direct, f) in buffered_and_direct(&engine, &path) {
        for round in 0..4 {
            let ctx = &ctxs[round % 2];
            let stream = ctx.default_stream();
            let mut d = stream.alloc_zeros::<u8>(5 << 20).unwrap();
            let off = 1000 * round as u64 + 3;
            let n = f.read_into(&mut d, off).await.unwrap();
            assert_eq!(n, 5 << 20);
            assert!(
                d2h(&stream, &d)[..] == data[off as usize..off as usize + n],
                "direct={direct} GPU {}",
                round % 2
            );
            eprintln!(
                "memory_on_a_second_gpu: direct={direct} GPU {} via {}",
                round % 2,
                f.gds_status()
            );
        }
    }
}

/// Small reads into device memory served from the page cache on the polling thread
/// (`op::cached`): each goes through one per-thread pageable buffer that the next read reuses
/// at once, which is only right because CUDA stages a pageable source before the copy call
/// returns. The destination's stream is held up by a kernel while the reads queue their copies
/// behind it: had the driver read the buffer when the stream got there, every read but the
/// last would find the later reads' bytes. Half the reads go on another stream that is dropped
/// with the memory right after; fresh allocations must stay as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_cached_reads_into_device_memory_skip_the_reactor() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu("small_cached_reads_into_device_memory_skip_the_reactor") else {
        return;
    };
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "warm", 8 << 20, 41);
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut spinner = Spinner::new(&stream);
    const READS: usize = 400;
    let max = gpuio::CACHED_READ_MAX;
    let mut whole = stream.alloc_zeros::<u8>(READS * max).unwrap();
    let ns: u64 = 200_000_000;
    spinner.hold(&stream, ns);
    let (before, other) = (engine.cached_reads(), ctx.new_stream().unwrap());
    let mut rng = fastrand::Rng::with_seed(9);
    let mut want = Vec::new();
    for i in 0..READS {
        let len = rng.usize(1..=max);
        let off = rng.usize(0..data.len() - len);
        let mut view = whole.slice_mut(i * max..i * max + len);
        let fut = f.read_into(&mut view, off as u64);
        let n = if i % 2 == 0 {
            fut.await
        } else {
            fut.on_stream(&other).await
        }
        .unwrap();
        assert_eq!(n, len);
        want.push((i * max, off, len));
    }
    let served = engine.cached_reads() - before;
    stream.synchronize().unwrap();
    let got = d2h(&stream, &whole);
    for &(at, off, len) in &want {
        assert!(
            got[at..at + len] == data[off..off + len],
            "{len} bytes from {off}: {} differ",
            differing(&got[at..at + len], &data[off..off + len])
        );
    }
    if served == 0 {
        skipped(
            "small_cached_reads_into_device_memory_skip_the_reactor: no read was served \
                 from the page cache here (RWF_NOWAIT refused?); the reactor's path was checked",
        );
    } else {
        assert!(
            served as usize >= READS / 2,
            "only {served} of {READS} served"
        );
    }

    // Reads ordered on another stream (`on_stream`), held up there by a kernel, into memory
    // known only by its address (no cudarc events: what Python and C hand over), whose own
    // stream then overwrites it: the own stream must wait for the copies, or the pattern
    // written there would be overwritten by them afterwards.
    for round in 0..3u8 {
        let home = ctx.new_stream().unwrap();
        let other = ctx.new_stream().unwrap();
        let backing = home.alloc_zeros::<u8>(READS * 4096).unwrap();
        let (ptr, _sync) = gpuio::cuda::cudarc::driver::DevicePtr::device_ptr(&backing, &home);
        spinner.hold(&other, ns);
        let mut staged = 0;
        for i in 0..READS {
            let before = engine.cached_reads();
            // SAFETY: inside `backing`, which outlives the read; nothing else touches it.
            let mut view = unsafe { gpuio::RawDeviceSlice::new(0, ptr + (i * 4096) as u64, 4096) }
                .unwrap()
                .with_stream(home.clone())
                .unwrap();
            let fut = f.read_into(&mut view, (i * 4096) as u64).on_stream(&other);
            assert_eq!(fut.await.unwrap(), 4096);
            staged += (engine.cached_reads() - before) as usize;
        }
        let pattern = vec![0x66u8 ^ round; READS * 4096];
        // SAFETY: `ptr` is `backing`'s, READS * 4096 bytes; `pattern` outlives the copy (the
        // stream is synchronised below before it drops).
        unsafe {
            gpuio::cuda::cudarc::driver::result::memcpy_htod_async(ptr, &pattern, home.cu_stream())
        }
        .unwrap();
        ctx.synchronize().unwrap();
        let got = home.clone_dtoh(&backing).unwrap();
        assert!(
            got == pattern,
            "round {round}: {} bytes written by copies the memory's own stream did not wait \
             for ({staged} reads staged)",
            differing(&got, &pattern)
        );
    }
}

/// Small reads that go through the reactor (the page-cache fast path off, O_DIRECT where the
/// file system has it) into memory on a stream a kernel holds for two seconds: the copies'
/// sources are read during the copy call, so each read hands its slot back at once. A 64 KiB
/// pool (sixteen 4 KiB slots) serves 400 reads before the kernel ends, and every byte still
/// lands: a copy that read its slot after the call would find the slot reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_reads_return_their_slots_before_the_copies_run() {
    // Timed: no other test of this binary runs meanwhile (see `GPU_TURNS`).
    let _turn = GPU_TURNS.write().unwrap_or_else(|p| p.into_inner());
    const T: &str = "small_reads_return_their_slots_before_the_copies_run";
    let Some(ctx) = gpu(T) else {
        return;
    };
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "small", 8 << 20, 43);
    let engine = Engine::builder()
        .chunk_size(64 << 10)
        .bounce_slots(1)
        .page_cache_fast_path(false)
        .build()
        .unwrap();
    let f = OpenOptions::new()
        .read(true)
        .direct(direct_ok(&engine, &path))
        .open(&engine, &path)
        .unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut spinner = Spinner::new(&stream);
    const READS: usize = 400;
    const LEN: usize = 4096;
    let hold = Duration::from_secs(2);
    let mut whole = stream.alloc_zeros::<u8>(READS * LEN).unwrap();
    let before = gpuio::small_reads_released_early();
    spinner.hold(&stream, hold.as_nanos() as u64);
    let t0 = std::time::Instant::now();
    let mut rng = fastrand::Rng::with_seed(17);
    let mut want = Vec::new();
    for i in 0..READS {
        let off = rng.usize(0..data.len() / LEN) * LEN;
        let mut view = whole.slice_mut(i * LEN..(i + 1) * LEN);
        assert_eq!(f.read_into(&mut view, off as u64).await.unwrap(), LEN);
        want.push((i * LEN, off));
    }
    let took = t0.elapsed();
    let early = gpuio::small_reads_released_early() - before;
    stream.synchronize().unwrap();
    let got = d2h(&stream, &whole);
    for &(at, off) in &want {
        assert!(
            got[at..at + LEN] == data[off..off + LEN],
            "read {} from {off}: {} bytes differ",
            at / LEN,
            differing(&got[at..at + LEN], &data[off..off + LEN])
        );
    }
    if early == 0 {
        skipped(format!(
            "{T}: the driver has no batched copy that reads its sources during the call; \
             the event-gated path was checked instead ({took:?})"
        ));
    } else {
        assert!(early >= READS as u64, "{early} of {READS} released early");
        assert!(
            took < hold,
            "the reads waited for the held stream: {took:?}"
        );
        eprintln!("{T}: {READS} reads in {took:?} while the stream was held");
    }
}

/// Dropping an engine whose bounce pool and batch stages are pinned never waits for a kernel
/// on another stream: `cuMemHostUnregister` waits for the whole device (1.7 s behind a 2 s
/// kernel on the H100), so both are unpinned on a thread of their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_an_engine_never_waits_for_other_streams_kernels() {
    const T: &str = "dropping_an_engine_never_waits_for_other_streams_kernels";
    // Timed: no other test of this binary runs meanwhile (see `GPU_TURNS`).
    let _turn = GPU_TURNS.write().unwrap_or_else(|p| p.into_inner());
    let Some(ctx) = gpu(T) else {
        return;
    };
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "drop", 1 << 20, 44);
    let engine = Engine::builder().build().unwrap();
    let f = engine.open(&path).unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut dst = stream.alloc_zeros::<u8>(1 << 20).unwrap();
    // Large enough to go through the reactor's pool, which it pins.
    assert_eq!(f.read_into(&mut dst, 0).await.unwrap(), 1 << 20);
    assert!(d2h(&stream, &dst) == data, "the read landed wrong");
    let other = ctx.new_stream().unwrap();
    let mut spinner = Spinner::new(&other);
    let hold = Duration::from_secs(2);
    spinner.hold(&other, hold.as_nanos() as u64);
    // A batch of small cached reads whose copies wait behind the kernel: the pinned stage they
    // came through is still busy when the engine goes, so it must be neither waited for here
    // nor unmapped before the copies have read it.
    let mut small = other.alloc_zeros::<u8>(64 * 4096).unwrap();
    let descs: Vec<ReadDesc> = (0..64)
        .map(|i| ReadDesc::new(&f, (i * 8192) as u64, 4096, i * 4096))
        .collect();
    let batch = BatchPlan::new(descs.clone())
        .read_into(&mut small)
        .await
        .exact(&descs);
    assert!(batch.is_ok(), "{batch:?}");
    let t0 = std::time::Instant::now();
    drop(f);
    engine.shutdown().await.unwrap();
    drop(engine);
    let took = t0.elapsed();
    other.synchronize().unwrap();
    assert!(
        took < hold / 2,
        "dropping the engine waited for another stream's kernel: {took:?}"
    );
    let back = d2h(&other, &small);
    for (i, d) in descs.iter().enumerate() {
        let want = &data[d.offset as usize..d.offset as usize + 4096];
        assert!(
            back[i * 4096..(i + 1) * 4096] == *want,
            "batch read {i} landed wrong after the engine was dropped"
        );
    }
    eprintln!("{T}: engine dropped in {took:?} beside a {hold:?} kernel");
}

/// Small cached reads into memory used on the legacy default stream (torch's and cupy's
/// default): served on the polling thread through gpuio's side stream, in the legacy stream's
/// order both ways. Behind a kernel holding the legacy stream, a pattern is written over the
/// memory, then the reads, then the first read's range is zeroed: the reads must land after
/// the pattern (or it would overwrite them) and before the zeroing (or they would overwrite
/// it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_reads_on_the_legacy_stream_keep_its_order() {
    let _turn = GPU_TURNS.read().unwrap_or_else(|p| p.into_inner());
    const T: &str = "small_reads_on_the_legacy_stream_keep_its_order";
    let Some(ctx) = gpu(T) else {
        return;
    };
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "legacy", 4 << 20, 47);
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    let legacy = ctx.default_stream();
    assert!(
        legacy.cu_stream().is_null(),
        "cudarc's default stream is the NULL stream"
    );
    let mut spinner = Spinner::new(&legacy);
    const READS: usize = 64;
    const LEN: usize = 8192;
    let mut whole = legacy.alloc_zeros::<u8>(READS * LEN).unwrap();
    spinner.hold(&legacy, 300_000_000);
    legacy
        .memcpy_htod(&vec![0xABu8; READS * LEN], &mut whole)
        .unwrap();
    let before = engine.cached_reads();
    let mut want = Vec::new();
    for i in 0..READS {
        let off = (i * 7919 * 64) % (data.len() - LEN);
        let mut view = whole.slice_mut(i * LEN..(i + 1) * LEN);
        assert_eq!(f.read_into(&mut view, off as u64).await.unwrap(), LEN);
        want.push(off);
    }
    let served = engine.cached_reads() - before;
    legacy.memset_zeros(&mut whole.slice_mut(0..LEN)).unwrap();
    legacy.synchronize().unwrap();
    let got = d2h(&legacy, &whole);
    assert!(
        got[..LEN].iter().all(|&b| b == 0),
        "a read landed after the zeroing"
    );
    for (i, &off) in want.iter().enumerate().skip(1) {
        let at = i * LEN;
        assert!(
            got[at..at + LEN] == data[off..off + LEN],
            "read {i}: {} bytes differ (the pattern written before it overwrote it?)",
            differing(&got[at..at + LEN], &data[off..off + LEN])
        );
    }
    if served == 0 {
        skipped(format!(
            "{T}: no read was served on the polling thread (no batched copy call, or \
             RWF_NOWAIT refused); the reactor's path kept the order instead"
        ));
    }
}
