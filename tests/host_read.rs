//! Reads into host memory, checked against pread on the same file, on every backend,
//! buffered and O_DIRECT.

mod common;

use common::*;
use gpuio::{Engine, OpenOptions};

const FILE_LEN: usize = 6 * 1024 * 1024 + 1234;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_ranges_match_pread() {
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "data", FILE_LEN, 1);
    for (name, engine) in engines() {
        let mut files = vec![("buffered", engine.open(&path).unwrap())];
        if direct_ok(&engine, &path) {
            let f = OpenOptions::new()
                .read(true)
                .direct(true)
                .open(&engine, &path)
                .unwrap();
            files.push(("direct", f));
        }
        let mut rng = fastrand::Rng::with_seed(42);
        for (mode, file) in &files {
            for i in 0..150 {
                let off = match i % 3 {
                    0 => rng.u64(0..FILE_LEN as u64 + 10_000),
                    1 => rng.u64(0..64) * 4096,
                    _ => rng.u64(0..FILE_LEN as u64),
                };
                let len = match i % 4 {
                    0 => rng.usize(0..64),
                    1 => rng.usize(0..8192),
                    2 => rng.usize(0..3 << 20),
                    _ => rng.usize(0..FILE_LEN + 5000),
                };
                let mut c = Canaried::new(len, 4096);
                let n = file
                    .read_into(c.inner(), off)
                    .await
                    .unwrap_or_else(|e| panic!("{name} {mode} read {off}+{len}: {e}"));
                let want = pread_ref(&path, off, len);
                assert_eq!(n, want.len(), "{name} {mode} count at {off}+{len}");
                assert!(
                    c.inner()[..n] == want[..],
                    "{name} {mode} data at {off}+{len}"
                );
                c.check_guards();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_sizes() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "data", FILE_LEN, 2);
    let size = FILE_LEN as u64;
    for (name, engine) in engines() {
        let mut files = vec![engine.open(&path).unwrap()];
        if direct_ok(&engine, &path) {
            files.push(
                OpenOptions::new()
                    .read(true)
                    .direct(true)
                    .open(&engine, &path)
                    .unwrap(),
            );
        }
        for f in &files {
            let cases: &[(u64, usize, usize)] = &[
                (0, 0, 0),
                (17, 0, 0),
                (0, 1, 1),
                (size - 1, 1, 1),
                (1, 4095, 4095),
                (4095, 4097, 4097),
                (4096, 4097, 4097),
                (3, 5 << 20, 5 << 20),
                (size - 100, 4096, 100),
                (size, 10, 0),
                (size + 4096 * 3, 10_000, 0),
                (0, FILE_LEN + 9999, FILE_LEN),
            ];
            for &(off, len, want) in cases {
                let mut buf = vec![0xEEu8; len];
                let n = f.read_into(&mut buf, off).await.unwrap();
                assert_eq!(n, want, "{name} direct={} {off}+{len}", f.is_direct());
                let o = off as usize;
                assert!(n == 0 || buf[..n] == data[o..o + n]);
            }
            // read_exact_at: exact inside, UnexpectedEof across the end.
            let mut b = vec![0u8; 4097];
            f.read_exact_at(&mut b, 100).await.unwrap();
            assert_eq!(&b[..], &data[100..4197]);
            let e = f.read_exact_at(&mut b, size - 10).await.unwrap_err();
            assert!(
                matches!(
                    e,
                    gpuio::Error::UnexpectedEof {
                        wanted: 4097,
                        got: 10,
                        ..
                    }
                ),
                "{e}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destination_types_and_owned_buffers() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "data", 100_000, 3);
    for (_, engine) in engines() {
        let f = engine.open(&path).unwrap();
        let mut arr = [0u8; 300];
        assert_eq!(f.read_into(&mut arr, 7).await.unwrap(), 300);
        assert_eq!(&arr[..], &data[7..307]);
        let mut bm = bytes::BytesMut::zeroed(5000);
        assert_eq!(f.read_into(&mut bm, 1).await.unwrap(), 5000);
        assert_eq!(&bm[..], &data[1..5001]);
        let slice: &mut [u8] = &mut [0u8; 10];
        assert_eq!(f.read_into(slice, 99_995).await.unwrap(), 5);
        let (r, v) = f.read_owned(vec![0u8; 70_000], 30_000).await;
        assert_eq!(r.unwrap(), 70_000);
        assert_eq!(&v[..], &data[30_000..]);
        let (r, v) = f.read_owned(vec![0u8; 10], 200_000).await;
        assert_eq!(r.unwrap(), 0);
        assert_eq!(v.len(), 10);
        assert_eq!(f.len().unwrap(), 100_000);
    }
}

/// Many concurrent reads of one file from many tasks.
async fn concurrent_reads(
    engine: gpuio::Engine,
    path: std::path::PathBuf,
    data: std::sync::Arc<Vec<u8>>,
) {
    let file = std::sync::Arc::new(engine.open(&path).unwrap());
    let mut set = tokio::task::JoinSet::new();
    for t in 0..64u64 {
        let file = file.clone();
        let data = data.clone();
        set.spawn(async move {
            let mut rng = fastrand::Rng::with_seed(t);
            for _ in 0..20 {
                let off = rng.usize(0..data.len());
                let len = rng.usize(0..600_000);
                let mut buf = vec![0u8; len];
                let n = file.read_into(&mut buf, off as u64).await.unwrap();
                let want = len.min(data.len() - off);
                assert_eq!(n, want);
                assert!(buf[..n] == data[off..off + n]);
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
}

#[test]
fn concurrent_reads_multi_thread_runtime() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "data", FILE_LEN, 4);
    let data = std::sync::Arc::new(data);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    for (_, engine) in engines() {
        rt.block_on(concurrent_reads(engine, path.clone(), data.clone()));
    }
}

#[test]
fn concurrent_reads_current_thread_runtime() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "data", FILE_LEN, 5);
    let data = std::sync::Arc::new(data);
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for (_, engine) in engines() {
        rt.block_on(concurrent_reads(engine, path.clone(), data.clone()));
    }
}

#[test]
fn works_without_tokio() {
    // Runtime-agnostic: the futures executor drives the same futures.
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "data", 1 << 20, 6);
    for (_, engine) in engines() {
        let f = engine.open(&path).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let n = futures::executor::block_on(f.read_into(&mut buf, 0)).unwrap();
        assert_eq!(n, 1 << 20);
        assert!(buf == data);
    }
}

#[test]
fn futures_are_send() {
    fn is_send<T: Send>(_: &T) {}
    let engine = gpuio::Engine::builder()
        .bounce_slots(1)
        .chunk_size(1 << 16)
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = test_file(dir.path(), "d", 10, 1);
    let f = engine.open(&path).unwrap();
    let mut b = vec![0u8; 4];
    is_send(&f.read_into(&mut b, 0));
    is_send(&f.write_from(&b, 0));
    is_send(&f.read_exact_at(&mut b, 0));
    is_send(&f.sync_all());
    is_send(&f.read_owned(vec![0u8; 4], 0));
    is_send(&engine.shutdown());
}

#[test]
fn concurrent_reads_with_other_reactor_timing() {
    // A spinning reactor never sleeps between turns while operations are open: completions
    // must still be reaped (io_uring's deferred task work runs only on an enter that asks for
    // events) and every byte must match; shutdown must still end it. A reactor without a tick
    // sleeps until rung: the doorbell alone must carry every request.
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "data", FILE_LEN, 7);
    let data = std::sync::Arc::new(data);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let timings = [
        (
            "spin 200 us",
            std::time::Duration::from_micros(200),
            gpuio::DEFAULT_REACTOR_TICK,
        ),
        (
            "no tick",
            std::time::Duration::ZERO,
            std::time::Duration::ZERO,
        ),
    ];
    for (timing, spin, tick) in timings {
        for backend in [gpuio::Backend::Uring, gpuio::Backend::Pread] {
            let engine = match gpuio::Engine::builder()
                .backend(backend)
                .chunk_size(256 << 10)
                .queue_depth(8)
                .bounce_slots(16)
                .reactor_spin(spin)
                .reactor_tick(tick)
                .build()
            {
                Ok(e) => e,
                Err(e) => {
                    skipped(format!("{backend} backend, {timing}: {e}"));
                    continue;
                }
            };
            rt.block_on(concurrent_reads(engine.clone(), path.clone(), data.clone()));
            rt.block_on(engine.shutdown()).unwrap();
        }
    }
}

#[test]
fn a_spinning_reactor_reaps_completions_while_it_spins() {
    // With a spin longer than the test's patience, a reactor that only reaped completions
    // when it went to sleep (io_uring's deferred task work needs an enter that asks for
    // events) would hold each read for the whole spin.
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "data", 1 << 20, 8);
    for backend in [gpuio::Backend::Uring, gpuio::Backend::Pread] {
        let engine = match gpuio::Engine::builder()
            .backend(backend)
            .reactor_spin(std::time::Duration::from_secs(10))
            // The reads must reach the (spinning) reactor.
            .page_cache_fast_path(false)
            .build()
        {
            Ok(e) => e,
            Err(e) => {
                skipped(format!("{backend} backend with a spinning reactor: {e}"));
                continue;
            }
        };
        // O_DIRECT where the filesystem allows it, so completions come from the device (as
        // deferred task work) rather than inline from the page cache.
        let file = OpenOptions::new()
            .read(true)
            .direct(direct_ok(&engine, &path))
            .open(&engine, &path)
            .unwrap();
        let start = std::time::Instant::now();
        for i in 0..3u64 {
            let mut buf = vec![0u8; 4096];
            let off = i * 100_000;
            let n = futures::executor::block_on(file.read_into(&mut buf, off)).unwrap();
            assert_eq!(&buf[..n], &data[off as usize..off as usize + n]);
        }
        let took = start.elapsed();
        assert!(
            took < std::time::Duration::from_secs(5),
            "{backend}: 3 reads took {took:?} with a spinning reactor"
        );
        futures::executor::block_on(engine.shutdown()).unwrap();
    }
}

/// Small reads of cached bytes are served by the thread that polls them (counted), byte for
/// byte right at any offset and length up to `CACHED_READ_MAX`; across and past the end of the
/// file they give the counts the reactor gives; reads above `page_cache_read_max`, O_DIRECT
/// files and an engine with the fast path off never take it; bytes dropped from the cache
/// still read right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_cached_reads_are_served_on_the_polling_thread() {
    use std::os::fd::AsRawFd;
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "warm", (1 << 20) + 333, 61);
    // Where the kernel or filesystem refuses RWF_NOWAIT the fast path never runs: say so.
    if let Some(e) = nowait_refused(&path) {
        skipped(format!(
            "small_cached_reads_are_served_on_the_polling_thread: RWF_NOWAIT refused here ({e})"
        ));
        return;
    }
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    let mut rng = fastrand::Rng::with_seed(3);
    let before = engine.cached_reads();
    for _ in 0..300 {
        let len = rng.usize(1..=gpuio::CACHED_READ_MAX);
        let off = rng.usize(0..data.len() - len);
        let mut b = vec![0u8; len];
        assert_eq!(f.read_into(&mut b, off as u64).await.unwrap(), len);
        assert!(b == data[off..off + len], "{len} bytes at {off}");
    }
    // The file was just written: its pages are in the cache.
    assert!(
        engine.cached_reads() > before,
        "no small read of a just-written file was served from the page cache"
    );
    let end = data.len() as u64;
    let mut b = vec![0u8; 4096];
    assert_eq!(f.read_into(&mut b, end - 100).await.unwrap(), 100);
    assert!(b[..100] == data[data.len() - 100..]);
    assert_eq!(f.read_into(&mut b, end).await.unwrap(), 0);
    assert_eq!(f.read_into(&mut b, end + 5).await.unwrap(), 0);

    // Past CACHED_READ_MAX a host read is served in poll too (in pieces), up to the engine's
    // `page_cache_read_max`; above that it goes to the reactor.
    let served = engine.cached_reads();
    let mut big = vec![0u8; gpuio::CACHED_READ_MAX + 1];
    assert_eq!(f.read_into(&mut big, 1).await.unwrap(), big.len());
    assert!(big[..] == data[1..1 + big.len()]);
    assert_eq!(engine.cached_reads(), served + 1);
    let small_only = Engine::builder()
        .page_cache_read_max(gpuio::CACHED_READ_MAX)
        .build()
        .unwrap();
    let h = small_only.open(&path).unwrap();
    big.fill(0);
    assert_eq!(h.read_into(&mut big, 2).await.unwrap(), big.len());
    assert!(big[..] == data[2..2 + big.len()]);
    assert_eq!(small_only.cached_reads(), 0, "above page_cache_read_max");
    let served = engine.cached_reads();
    if direct_ok(&engine, &path) {
        let d = gpuio::OpenOptions::new()
            .read(true)
            .direct(true)
            .open(&engine, &path)
            .unwrap();
        assert_eq!(d.read_into(&mut b, 8192).await.unwrap(), 4096);
        assert!(b[..] == data[8192..8192 + 4096]);
    }
    assert_eq!(
        engine.cached_reads(),
        served,
        "O_DIRECT reads go to the reactor"
    );

    // While a write of this file is unfinished, small reads of it keep to the reactor: its range
    // fence orders them after overlapping write pieces in the kernel (a dropped write's too).
    let rw = open_rw(&engine, &path);
    let same = data[..4096].to_vec();
    let write = rw.write_from(&same[..], 0);
    let served = engine.cached_reads();
    assert_eq!(f.read_into(&mut b, 3).await.unwrap(), 4096);
    assert_eq!(engine.cached_reads(), served, "a write is pending");
    drop(write);
    assert_eq!(f.read_into(&mut b, 3).await.unwrap(), 4096);
    assert_eq!(
        engine.cached_reads(),
        served + 1,
        "no write is pending any more"
    );
    assert!(b[..] == data[3..3 + 4096]);

    // A read started after a write was dropped mid-flight sees what it will keep seeing: the
    // write's pieces already in the kernel land before it (the reactor's fence), not after.
    let (wpath, _) = test_file(dir.path(), "rewritten", 8 << 20, 62);
    let wf = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&engine, &wpath)
        .unwrap();
    let other = vec![0x5Au8; 8 << 20];
    for round in 0..4u64 {
        let mut w = Box::pin(wf.write_from(&other[..], 0));
        poll_once(&mut w);
        drop(w);
        let at = 4096 * (1 + 37 * round) + 512 * round;
        let mut first = vec![0u8; 4096];
        assert_eq!(wf.read_into(&mut first, at).await.unwrap(), 4096);
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let mut again = vec![0u8; 4096];
        assert_eq!(wf.read_into(&mut again, at).await.unwrap(), 4096);
        assert!(
            first == again,
            "round {round}: the dropped write landed after the read"
        );
    }

    let off = Engine::builder()
        .page_cache_fast_path(false)
        .build()
        .unwrap();
    let g = off.open(&path).unwrap();
    assert_eq!(g.read_into(&mut b, 77).await.unwrap(), 4096);
    assert!(b[..] == data[77..77 + 4096]);
    assert_eq!(off.cached_reads(), 0);

    // Dropped from the cache (clean pages go): served or not, the bytes are right.
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    let fd = std::fs::File::open(&path).unwrap();
    // SAFETY: a valid descriptor; advice only.
    unsafe { libc::posix_fadvise(fd.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    for at in [0usize, 12_345, 700_000] {
        assert_eq!(f.read_into(&mut b, at as u64).await.unwrap(), 4096);
        assert!(
            b[..] == data[at..at + 4096],
            "at {at} after the cache dropped it"
        );
    }
}

/// `path` opened for reading and writing on `engine`.
fn open_rw(engine: &Engine, path: &std::path::Path) -> gpuio::File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(engine, path)
        .unwrap()
}

/// Why `preadv2(RWF_NOWAIT)` fails on `path` here (then no read is served in poll), or `None`.
fn nowait_refused(path: &std::path::Path) -> Option<std::io::Error> {
    use std::os::fd::AsRawFd;
    let probe = std::fs::File::open(path).unwrap();
    let mut one = [0u8; 1];
    let iov = libc::iovec {
        iov_base: one.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: a valid descriptor and a one-byte buffer that outlives the call.
    let rc = unsafe { libc::preadv2(probe.as_raw_fd(), &iov, 1, 0, libc::RWF_NOWAIT) };
    (rc < 0).then(std::io::Error::last_os_error)
}

/// Counts the polls of the future it wraps.
struct CountPolls<F> {
    inner: F,
    polls: usize,
}

impl<F: std::future::Future + Unpin> std::future::Future for CountPolls<F> {
    type Output = F::Output;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        self.polls += 1;
        std::pin::Pin::new(&mut self.inner).poll(cx)
    }
}

/// With `page_cache_read_max`, larger reads of cached bytes into host memory are copied from
/// the page cache by the polling thread, one piece of at most 2 MiB per poll (the future
/// yields between pieces); byte for byte right at unaligned offsets; where a later piece
/// cannot be served the rest goes to the reactor after the bytes already copied; reads across
/// the end of the file or of a range partly missing from the page cache go to the reactor
/// whole; a future dropped or leaked between pieces leaves nothing that writes the buffer
/// later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn larger_cached_host_reads_are_copied_in_pieces_by_the_polling_thread() {
    use std::os::fd::{AsFd, AsRawFd};
    let dir = tmpdir();
    let len = (9 << 20) + 777;
    let (path, data) = test_file(dir.path(), "warm-large", len, 71);
    if let Some(e) = nowait_refused(&path) {
        skipped(format!(
            "larger_cached_host_reads_are_copied_in_pieces_by_the_polling_thread: \
             RWF_NOWAIT refused here ({e})"
        ));
        return;
    }
    let engine = Engine::builder()
        .page_cache_read_max(64 << 20)
        .build()
        .unwrap();
    let f = engine.open(&path).unwrap();

    // 5 MiB + 3 from an unaligned offset: three pieces, so three polls at least.
    let before = engine.cached_reads();
    let mut b = vec![0u8; (5 << 20) + 3];
    let mut read = CountPolls {
        inner: f.read_into(&mut b, 4097),
        polls: 0,
    };
    assert_eq!((&mut read).await.unwrap(), (5 << 20) + 3);
    assert!(read.polls >= 3, "{} polls", read.polls);
    drop(read);
    assert!(b[..] == data[4097..4097 + (5 << 20) + 3]);
    assert_eq!(engine.cached_reads(), before + 1);

    // Across the end of the file (the estimate counts pages past it as missing): the read goes
    // to the reactor, and the count is its.
    let mut b = vec![0u8; 3 << 20];
    let at = (len - 1000) as u64;
    assert_eq!(f.read_into(&mut b, at).await.unwrap(), 1000);
    assert!(b[..1000] == data[len - 1000..]);
    let at = (len - (2 << 20) - 1000) as u64;
    assert_eq!(f.read_into(&mut b, at).await.unwrap(), (2 << 20) + 1000);
    assert!(b[..(2 << 20) + 1000] == data[at as usize..]);

    // Dropped after its first piece, and leaked after its first piece: the buffer keeps what
    // the first poll copied and nothing writes it afterwards.
    for leak in [false, true] {
        let mut b = vec![0u8; 6 << 20];
        {
            let mut r = f.read_into(&mut b, 0);
            assert!(!poll_once(&mut r), "one poll copies one piece, not 6 MiB");
            if leak {
                std::mem::forget(r);
            }
        }
        let first = b.clone();
        assert!(first[..2 << 20] == data[..2 << 20], "leak {leak}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(
            b == first,
            "leak {leak}: the buffer changed after the future went"
        );
    }

    // A piece that cannot be served (here: a write of the file became pending between two
    // polls, so the reactor's fence must order what follows): the bytes the first poll copied
    // stay, the reactor reads the rest into the buffer after them, the count is the whole
    // read's. The write is never polled, and writes the same bytes anyway.
    let rw = open_rw(&engine, &path);
    let same = data[..4096].to_vec();
    let served = engine.cached_reads();
    let mut b = vec![0u8; 6 << 20];
    let n = {
        let mut read = f.read_into(&mut b, 3);
        assert!(!poll_once(&mut read), "one poll copies one piece");
        let write = rw.write_from(&same[..], 0);
        let n = (&mut read).await.unwrap();
        drop(write);
        n
    };
    assert_eq!(n, 6 << 20);
    assert!(b[..] == data[3..3 + (6 << 20)]);
    assert_eq!(
        engine.cached_reads(),
        served,
        "the read was not all served in poll"
    );

    // A range the page cache lacks in part goes to the reactor whole (the sampled estimate
    // sees it), and reads right.
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    let fd = std::fs::File::open(&path).unwrap();
    // SAFETY: a valid descriptor; advice only.
    unsafe { libc::posix_fadvise(fd.as_raw_fd(), 4 << 20, 0, libc::POSIX_FADV_DONTNEED) };
    let tail = gpuio::plan::residency::residency(fd.as_fd(), 4 << 20, 1 << 20).unwrap();
    if tail.cached > 0 {
        skipped(format!(
            "larger_cached_host_reads_are_copied_in_pieces_by_the_polling_thread: partly cached \
             half: the filesystem keeps its pages ({tail:?})"
        ));
        return;
    }
    let mut b = vec![0u8; 8 << 20];
    assert_eq!(f.read_into(&mut b, 1).await.unwrap(), 8 << 20);
    assert!(b[..] == data[1..1 + (8 << 20)]);
    assert_eq!(engine.cached_reads(), served);
}
