//! Mapped reads (`EngineBuilder::mapped_reads`): large warm reads into GPU memory copied
//! straight from registered page-cache mappings. What they return, which reads take them, and
//! what a dropped or leaked one leaves behind. Every test says loudly that it skipped where no
//! usable CUDA device exists.

// Each test holds its turn across its awaits on purpose: the tests count the registrar's
// threads process-wide, so they run one at a time; each has its own runtime.
#![allow(clippy::await_holding_lock)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use gpuio::Engine;
use gpuio::batch::{BatchPlan, ReadDesc};
use gpuio::cuda::cudarc::driver::{CudaSlice, CudaStream};

const MIB: usize = 1 << 20;

static TURNS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURNS.lock().unwrap_or_else(|p| p.into_inner())
}
/// The sentinel every destination is filled with before a read that must not land.
const SENTINEL: u8 = 0xA5;

fn mapped_engine() -> Engine {
    Engine::builder().mapped_reads(true).build().unwrap()
}

/// A file of `len` pattern bytes, read once so the page cache holds it.
fn warm_file(dir: &std::path::Path, len: usize) -> (std::path::PathBuf, Vec<u8>) {
    let (path, data) = test_file(dir, "warm", len, 29);
    let back = std::fs::read(&path).unwrap();
    assert_eq!(back.len(), data.len());
    (path, data)
}

fn filled(stream: &Arc<CudaStream>, len: usize) -> CudaSlice<u8> {
    stream.clone_htod(&vec![SENTINEL; len]).unwrap()
}

/// Waits up to 2 s for the engine's live registrations to reach `want`.
fn live_settles(engine: &Engine, want: usize) -> usize {
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        let live = engine.mapped_registrations_live();
        if live == want || Instant::now() > until {
            return live;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn registrar_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "gpuio-registrar")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mapped_reads_match_pread_on_any_stream() {
    let _turn = turn();
    let Some(ctx) = gpu("mapped_reads_match_pread_on_any_stream") else {
        return;
    };
    let dir = tmpdir();
    const LEN: usize = 48 * MIB + 4321;
    let (path, data) = warm_file(dir.path(), LEN);
    let engine = mapped_engine();
    let f = engine.open(&path).unwrap();
    let own = ctx.new_stream().unwrap();
    let other = ctx.new_stream().unwrap();
    // Aligned, unaligned, page-straddling, ending exactly at the end of the file.
    let cases: &[(u64, usize)] = &[
        (0, 2 * MIB),
        (4096, 16 * MIB),
        (12_345, 3 * MIB + 17),
        ((LEN - 5 * MIB - 1) as u64, 5 * MIB + 1),
        (1, 32 * MIB - 1),
    ];
    for (i, &(off, len)) in cases.iter().enumerate() {
        let mut dst = filled(&own, len);
        let before = engine.mapped_reads();
        let n = if i % 2 == 0 {
            within(f.read_into(&mut dst, off)).await.unwrap()
        } else {
            within(f.read_into(&mut dst, off).on_stream(&other))
                .await
                .unwrap()
        };
        assert_eq!(n, len, "case {i}");
        assert_eq!(engine.mapped_reads(), before + 1, "case {i} was not mapped");
        let got = own.clone_dtoh(&dst).unwrap();
        let want = &data[off as usize..off as usize + len];
        assert_eq!(differing(&got, want), 0, "case {i}: {off}+{len}");
    }
    assert_eq!(
        live_settles(&engine, 0),
        0,
        "registrations outlived their copies"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_that_do_not_qualify_take_the_bounce_path() {
    let _turn = turn();
    let Some(ctx) = gpu("reads_that_do_not_qualify_take_the_bounce_path") else {
        return;
    };
    let dir = tmpdir();
    const LEN: usize = 24 * MIB + 99;
    let (path, data) = warm_file(dir.path(), LEN);
    let engine = mapped_engine();
    let f = engine.open(&path).unwrap();
    let stream = ctx.new_stream().unwrap();

    // Below the size the mode takes.
    let mut small = filled(&stream, MIB);
    assert_eq!(within(f.read_into(&mut small, 5)).await.unwrap(), MIB);
    // Past the end of the file: short, through the reactor.
    let mut tail = filled(&stream, 4 * MIB);
    let off = (LEN - MIB) as u64;
    assert_eq!(within(f.read_into(&mut tail, off)).await.unwrap(), MIB);
    assert_eq!(
        engine.mapped_reads(),
        0,
        "a read that does not qualify was mapped"
    );
    assert_eq!(
        differing(&stream.clone_dtoh(&small).unwrap(), &data[5..5 + MIB]),
        0
    );
    let got = stream.clone_dtoh(&tail).unwrap();
    assert_eq!(differing(&got[..MIB], &data[LEN - MIB..]), 0);

    // Not in the page cache: written back and evicted, then read through the reactor. Where
    // the filesystem keeps its pages (tmpfs), that part is skipped, loudly.
    let evicted = {
        use std::os::fd::{AsFd, AsRawFd};
        let file = std::fs::File::open(&path).unwrap();
        file.sync_all().unwrap();
        // SAFETY: a valid descriptor; advice only.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let r = gpuio::plan::residency::residency(file.as_fd(), 4096, 8 * MIB as u64).unwrap();
        r.cached == 0
    };
    let mut cold = filled(&stream, 8 * MIB);
    assert_eq!(within(f.read_into(&mut cold, 4096)).await.unwrap(), 8 * MIB);
    if evicted {
        assert_eq!(
            engine.mapped_reads_submitted(),
            0,
            "a cold range was mapped"
        );
    } else {
        skipped(format!(
            "reads_that_do_not_qualify_take_the_bounce_path: the filesystem under {} keeps its \
             pages after POSIX_FADV_DONTNEED; the cold case needs a disk-backed one (set \
             GPUIO_TEST_DIR)",
            dir.path().display()
        ));
    }
    assert_eq!(
        differing(
            &stream.clone_dtoh(&cold).unwrap(),
            &data[4096..4096 + 8 * MIB]
        ),
        0
    );
    // The same range, now warm again, is mapped.
    let mut warm = filled(&stream, 8 * MIB);
    let _ = std::fs::read(&path).unwrap();
    within(f.read_into(&mut warm, 4096)).await.unwrap();
    assert_eq!(engine.mapped_reads(), 1, "the warm range was not mapped");
    assert_eq!(
        differing(
            &stream.clone_dtoh(&warm).unwrap(),
            &data[4096..4096 + 8 * MIB]
        ),
        0
    );
}

#[test]
fn dropped_or_leaked_before_the_copy_writes_nothing_and_unregisters() {
    let _turn = turn();
    let Some(ctx) = gpu("dropped_or_leaked_before_the_copy_writes_nothing_and_unregisters") else {
        return;
    };
    let dir = tmpdir();
    const LEN: usize = 64 * MIB;
    let (path, data) = warm_file(dir.path(), LEN);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let engine = mapped_engine();
    let f = engine.open(&path).unwrap();
    let stream = ctx.new_stream().unwrap();
    let len = 16 * MIB;

    // Dropped at its first poll (queued, or being registered), and dropped once registered:
    // each was handed to the registrar, none queued a copy, and nothing stays registered.
    for (i, registered_first) in [false, true].into_iter().enumerate() {
        let mut dst = filled(&stream, len);
        let mut fut = f.read_into(&mut dst, 0);
        assert!(
            !poll_once(&mut fut),
            "a mapped read finished at its first poll"
        );
        assert_eq!(
            engine.mapped_reads_submitted(),
            i as u64 + 1,
            "not handed to the registrar"
        );
        if registered_first {
            assert_eq!(
                live_settles(&engine, 1),
                1,
                "not registered before the drop"
            );
        }
        drop(fut);
        // A registration the registrar finishes after the drop is undone at its next turn.
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(
            live_settles(&engine, 0),
            0,
            "case {i}: still registered after the drop"
        );
        let got = stream.clone_dtoh(&dst).unwrap();
        assert!(
            got.iter().all(|&b| b == SENTINEL),
            "case {i}: a dropped read wrote"
        );
    }
    assert_eq!(engine.mapped_reads(), 0);

    // Leaked once registered: the registration stays until the engine goes, nothing lands.
    let mut dst = filled(&stream, len);
    let mut fut = f.read_into(&mut dst, MIB as u64);
    assert!(!poll_once(&mut fut));
    assert_eq!(
        live_settles(&engine, 1),
        1,
        "the leaked read was not registered"
    );
    std::mem::forget(fut);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(engine.mapped_registrations_live(), 1);
    let got = stream.clone_dtoh(&dst).unwrap();
    assert!(got.iter().all(|&b| b == SENTINEL), "a leaked read wrote");

    // The engine still serves reads beside the leaked one.
    let mut ok = filled(&stream, len);
    let n = rt
        .block_on(within(f.read_into(&mut ok, 2 * MIB as u64)))
        .unwrap();
    assert_eq!(n, len);
    assert_eq!(
        differing(
            &stream.clone_dtoh(&ok).unwrap(),
            &data[2 * MIB..2 * MIB + len]
        ),
        0
    );
    assert_eq!(engine.mapped_reads(), 1);

    // Dropping the engine revokes the leaked registration and ends the registrar's thread.
    assert_eq!(registrar_threads(), 1);
    drop(f);
    drop(engine);
    let until = Instant::now() + Duration::from_secs(2);
    while registrar_threads() > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(registrar_threads(), 0, "the registrar outlived its engine");
    assert_eq!(
        gpuio::cuda::mapped_registrations_live(),
        0,
        "the leaked read's registration outlived its engine"
    );
    let got = stream.clone_dtoh(&dst).unwrap();
    assert!(
        got.iter().all(|&b| b == SENTINEL),
        "a leaked read wrote after the engine went"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_mapped_reads_at_once_match() {
    let _turn = turn();
    let Some(ctx) = gpu("many_mapped_reads_at_once_match") else {
        return;
    };
    let dir = tmpdir();
    const LEN: usize = 128 * MIB;
    let (path, data) = warm_file(dir.path(), LEN);
    let engine = mapped_engine();
    let f = engine.open(&path).unwrap();
    let mut tasks = Vec::new();
    for i in 0..16u64 {
        let (f, ctx) = (f.clone(), ctx.clone());
        tasks.push(tokio::spawn(async move {
            let stream = ctx.new_stream().unwrap();
            let off = (i * 7 * MIB as u64 + i * 513) % (LEN as u64 - 8 * MIB as u64);
            let mut dst = filled(&stream, 8 * MIB);
            let n = f.read_into(&mut dst, off).await.unwrap();
            (off, n, stream.clone_dtoh(&dst).unwrap())
        }));
    }
    for t in tasks {
        let (off, n, got) = within(t).await.unwrap();
        assert_eq!(n, 8 * MIB);
        assert_eq!(
            differing(&got, &data[off as usize..off as usize + n]),
            0,
            "at {off}"
        );
    }
    assert_eq!(engine.mapped_reads(), 16);
    assert_eq!(live_settles(&engine, 0), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn large_reads_in_pieces_and_batch_runs_are_mapped() {
    let _turn = turn();
    let Some(ctx) = gpu("large_reads_in_pieces_and_batch_runs_are_mapped") else {
        return;
    };
    let dir = tmpdir();
    const LEN: usize = 200 * MIB + 777;
    let (path, data) = warm_file(dir.path(), LEN);
    let engine = mapped_engine();
    let f = engine.open(&path).unwrap();
    let stream = ctx.new_stream().unwrap();

    // One read of three registrations (64 + 64 + 22 MiB and a bit), from an odd offset.
    let (off, len) = (4097u64, 150 * MIB + 3);
    let mut dst = filled(&stream, len);
    assert_eq!(within(f.read_into(&mut dst, off)).await.unwrap(), len);
    assert_eq!(engine.mapped_reads(), 1);
    assert_eq!(
        engine.mapped_reads_submitted(),
        3,
        "not registered in three pieces"
    );
    let got = stream.clone_dtoh(&dst).unwrap();
    assert_eq!(differing(&got, &data[off as usize..off as usize + len]), 0);

    // A batch: two runs large enough to map (one of two pieces), small ones through the
    // batch's combined copies, into one buffer.
    let descs = vec![
        ReadDesc::new(&f, 0, 3 * MIB, 0),
        ReadDesc::new(&f, 10 * MIB as u64 + 1, 4096, 3 * MIB),
        ReadDesc::new(&f, 20 * MIB as u64 + 5, 70 * MIB, 3 * MIB + 4096),
        ReadDesc::new(&f, (LEN - 100) as u64, 100, 73 * MIB + 4096),
    ];
    let total = 73 * MIB + 4096 + 100;
    let mut buf = filled(&stream, total);
    let done = within(BatchPlan::new(descs.clone()).read_into(&mut buf))
        .await
        .exact(&descs);
    assert!(done.is_ok(), "{done:?}");
    assert_eq!(
        engine.mapped_reads(),
        3,
        "the batch's large runs were not mapped"
    );
    let got = stream.clone_dtoh(&buf).unwrap();
    for d in &descs {
        let want = &data[d.offset as usize..d.offset as usize + d.len];
        assert_eq!(
            differing(&got[d.dst_offset..d.dst_offset + d.len], want),
            0,
            "batch read at {}",
            d.offset
        );
    }
    assert_eq!(
        live_settles(&engine, 0),
        0,
        "registrations outlived their copies"
    );
}

#[test]
fn off_by_default() {
    let _turn = turn();
    let engine = Engine::new().unwrap();
    assert_eq!(engine.mapped_reads(), 0);
    assert_eq!(engine.mapped_registrations_live(), 0);
    assert_eq!(
        registrar_threads(),
        0,
        "a registrar started without mapped reads"
    );
}
