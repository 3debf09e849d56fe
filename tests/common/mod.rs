//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use gpuio::{Backend, Engine};

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}

/// Writes `len` pseudo-random bytes to `dir/name`.
pub fn test_file(dir: &Path, name: &str, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let p = dir.join(name);
    let data = pattern(len, seed);
    std::fs::write(&p, &data).unwrap();
    (p, data)
}

/// What `pread` returns for the same range (the reference).
pub fn pread_ref(path: &Path, off: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; len];
    let mut got = 0;
    while got < len {
        let n = f.read_at(&mut buf[got..], off + got as u64).unwrap();
        if n == 0 {
            break;
        }
        got += n;
    }
    buf.truncate(got);
    buf
}

/// Small engines (256 KiB chunks, 4 MiB pool) on every backend this machine has, so requests
/// span many chunks and the pool runs out. io_uring is skipped, loudly, where unavailable.
pub fn engines() -> Vec<(&'static str, Engine)> {
    let mut v = Vec::new();
    // The first three take every read through the reactor (small ones included), the last
    // serves small page-cache hits on the polling thread, as the default engine does.
    let through_reactor = |backend| {
        Engine::builder()
            .backend(backend)
            .chunk_size(256 << 10)
            .queue_depth(8)
            .bounce_slots(16)
            .page_cache_fast_path(false)
    };
    match through_reactor(Backend::Uring).build() {
        Ok(e) => v.push(("io_uring", e)),
        Err(e) => skipped(format!("io_uring backend in this test: {e}")),
    }
    // The same with a kernel thread taking submissions (`IORING_SETUP_SQPOLL`).
    match through_reactor(Backend::Uring)
        .submission_polling(std::time::Duration::from_millis(2))
        .build()
    {
        Ok(e) if e.backend().detail.contains("SQPOLL") => v.push(("io_uring, SQPOLL", e)),
        Ok(e) => skipped(format!(
            "submission polling in this test: the kernel refused it ({})",
            e.backend().detail
        )),
        Err(e) => skipped(format!(
            "io_uring with submission polling in this test: {e}"
        )),
    }
    // Three reactors: reads take them in turn, writes and syncs (and reads of a file being
    // written) keep to the file's own; each reactor has a third of the pool.
    match through_reactor(Backend::Uring)
        .bounce_slots(24)
        .reactors(3)
        .build()
    {
        Ok(e) => v.push(("io_uring, 3 reactors", e)),
        Err(e) => skipped(format!("io_uring with three reactors in this test: {e}")),
    }
    v.push(("pread", through_reactor(Backend::Pread).build().unwrap()));
    v.push((
        "auto, page-cache fast path",
        Engine::builder()
            .chunk_size(256 << 10)
            .queue_depth(8)
            .bounce_slots(16)
            .build()
            .unwrap(),
    ));
    v
}

/// Slow engines (64 KiB pieces, 4 in the kernel, 8 bounce slots) on io_uring and the pread
/// pool, for tests that need a large read still running when something happens to it (`what`
/// names the test in the skip message).
pub fn slow_engines(what: &str) -> Vec<(&'static str, Engine)> {
    let mut v = Vec::new();
    for (name, backend) in [("io_uring", Backend::Uring), ("pread", Backend::Pread)] {
        match Engine::builder()
            .backend(backend)
            .chunk_size(64 << 10)
            .queue_depth(4)
            .bounce_slots(8)
            .build()
        {
            Ok(e) => v.push((name, e)),
            Err(e) => skipped(format!("{name} in {what}: {e}")),
        }
    }
    v
}

/// Whether O_DIRECT works in `dir` (it does on ext4/xfs; tmpfs may refuse).
pub fn direct_ok(engine: &Engine, path: &Path) -> bool {
    match gpuio::OpenOptions::new()
        .read(true)
        .direct(true)
        .open(engine, path)
    {
        Ok(_) => true,
        Err(e) => {
            skipped(format!("O_DIRECT part of this test: {e}"));
            false
        }
    }
}

/// `path` opened buffered and, where this filesystem allows it, with O_DIRECT (said loudly
/// when not): `(direct, file)` pairs.
pub fn buffered_and_direct(engine: &Engine, path: &Path) -> Vec<(bool, gpuio::File)> {
    let mut v = vec![(false, engine.open(path).unwrap())];
    if direct_ok(engine, path) {
        let f = gpuio::OpenOptions::new()
            .read(true)
            .direct(true)
            .open(engine, path)
            .unwrap();
        v.push((true, f));
    }
    v
}

/// A fresh empty file per open mode, opened for reading and writing: buffered, and with
/// O_DIRECT where this filesystem allows it (said loudly when not): `(direct, path, file)`.
pub fn fresh_rw_files(
    engine: &Engine,
    dir: &Path,
    stem: &str,
) -> Vec<(bool, PathBuf, gpuio::File)> {
    let mut v = Vec::new();
    for direct in [false, true] {
        let path = dir.join(format!("{stem}-{direct}"));
        std::fs::write(&path, b"").unwrap();
        if direct && !direct_ok(engine, &path) {
            continue;
        }
        let f = gpuio::OpenOptions::new()
            .read(true)
            .write(true)
            .direct(direct)
            .open(engine, &path)
            .unwrap();
        v.push((direct, path, f));
    }
    v
}

/// A buffer with canary zones on both sides of the part handed out.
pub struct Canaried {
    pub buf: Vec<u8>,
    pub guard: usize,
    pub len: usize,
}

pub const CANARY: u8 = 0xC5;

impl Canaried {
    pub fn new(len: usize, guard: usize) -> Self {
        Canaried {
            buf: vec![CANARY; len + 2 * guard],
            guard,
            len,
        }
    }
    pub fn inner(&mut self) -> &mut [u8] {
        &mut self.buf[self.guard..self.guard + self.len]
    }
    pub fn check_guards(&self) {
        let g = self.guard;
        assert!(
            self.buf[..g].iter().all(|&b| b == CANARY),
            "front canary overwritten"
        );
        assert!(
            self.buf[g + self.len..].iter().all(|&b| b == CANARY),
            "back canary overwritten"
        );
    }
}

/// A scratch directory: `$GPUIO_TEST_DIR` if set, else cargo's target tmp dir when it exists
/// (so O_DIRECT runs on the disk, not a tmpfs), else the system temp dir. Chosen at run time
/// so bundled test binaries work on machines without the build tree.
pub fn tmpdir() -> tempfile::TempDir {
    let base = std::env::var_os("GPUIO_TEST_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
            p.is_dir().then_some(p)
        })
        .unwrap_or_else(std::env::temp_dir);
    tempfile::tempdir_in(base).unwrap()
}

/// Reports a skipped test (or part) on stderr directly, past libtest's output capture, so
/// the reason shows in every run.
pub fn skipped(why: impl std::fmt::Display) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}

/// GPU 0's context, or `None` after saying loudly that `test` skipped (no usable CUDA device).
pub fn gpu(test: &str) -> Option<std::sync::Arc<gpuio::cuda::cudarc::driver::CudaContext>> {
    if !gpuio::cuda::available() {
        let p = gpuio::cuda::probe();
        skipped(format!(
            "{test}: no usable CUDA device ({})",
            p.error.as_deref().unwrap_or("no devices")
        ));
        return None;
    }
    Some(gpuio::cuda::context(0).expect("CUDA context"))
}

/// Awaits `f`, failing the test if it takes longer than `limit` (a hang is a bug).
pub async fn within_limit<T>(
    limit: std::time::Duration,
    f: impl std::future::Future<Output = T>,
) -> T {
    tokio::time::timeout(limit, f)
        .await
        .expect("operation hung")
}

/// [`within_limit`] with a minute.
pub async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    within_limit(std::time::Duration::from_secs(60), f).await
}

/// Polls `f` once with a waker that does nothing (which submits it) and reports whether it
/// finished.
pub fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> bool {
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    matches!(
        std::pin::Pin::new(f).poll(&mut cx),
        std::task::Poll::Ready(_)
    )
}

/// Starts `fut`, lets it run for `ms` milliseconds, polls it again, and then, unless it has
/// finished, drops it or (`leak`) forgets it mid-flight.
pub fn abandon_mid_flight<F: std::future::Future + Unpin>(mut fut: F, ms: u64, leak: bool) {
    if poll_once(&mut fut) {
        return;
    }
    std::thread::sleep(std::time::Duration::from_millis(ms));
    poll_once(&mut fut);
    if leak {
        std::mem::forget(fut);
    } else {
        drop(fut);
    }
}

/// One round of the write-ordering check: starts a write of `first` at `off`, lets some of
/// its pieces reach the kernel (or the NVMe queue) for `ms` milliseconds, drops or (`leak`)
/// forgets it, and writes `second` over the same range to completion. The caller then reads
/// the range back: anything but `second` means the abandoned write landed after the later
/// one had completed. Host or device memory alike.
pub async fn abandon_write_then_rewrite<S: gpuio::WriteSrc + ?Sized>(
    f: &gpuio::File,
    off: u64,
    first: &S,
    second: &S,
    ms: u64,
    leak: bool,
) {
    let mut fut = Box::pin(f.write_from(first, off));
    // This poll takes slots to fill; abandon_mid_flight's first poll fills them and sends
    // them off, so pieces are in the kernel when it lets go.
    if !poll_once(&mut fut) {
        abandon_mid_flight(fut, ms, leak);
    }
    within(f.write_from(second, off)).await.unwrap();
}

/// Bytes of `got` that differ from `want` (memcmp first: byte loops are slow in debug builds).
pub fn differing(got: &[u8], want: &[u8]) -> usize {
    if got == want {
        0
    } else {
        got.iter().zip(want).filter(|(a, b)| a != b).count() + got.len().abs_diff(want.len())
    }
}

/// Prints a backtrace of the faulting thread on SIGSEGV (a GPU machine has no debugger):
/// diagnosis only; the process then aborts as it would have.
#[allow(dead_code)]
pub fn backtrace_on_segv() {
    extern "C" fn on_segv(sig: libc::c_int) {
        let bt = std::backtrace::Backtrace::force_capture();
        eprintln!(
            "signal {sig} on thread {:?}\n{bt}",
            std::thread::current().name()
        );
        std::process::abort();
    }
    // SAFETY: installs a handler for SIGSEGV; the handler is not async-signal-safe, which is
    // acceptable for a process that is about to abort anyway.
    unsafe { libc::signal(libc::SIGSEGV, on_segv as *const () as libc::sighandler_t) };
}

/// A kernel that keeps the GPU busy for about `ns` nanoseconds, then sets `*flag = 1`.
pub const SPIN_KERNEL: &str = r#"
extern "C" __global__ void spin(unsigned long long ns, unsigned int* flag) {
    unsigned long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (;;) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 >= ns) break;
    }
    *flag = 1;
}
"#;

/// [`SPIN_KERNEL`] loaded on a context, to hold a stream busy for a while (tests that need
/// work queued behind a running kernel).
pub struct Spinner {
    func: gpuio::cuda::cudarc::driver::CudaFunction,
    flag: gpuio::cuda::cudarc::driver::CudaSlice<u32>,
}

impl Spinner {
    /// Compiles and loads the kernel on `stream`'s context.
    pub fn new(stream: &std::sync::Arc<gpuio::cuda::cudarc::driver::CudaStream>) -> Spinner {
        let ctx = stream.context();
        let ptx = gpuio::cuda::cudarc::nvrtc::compile_ptx(SPIN_KERNEL).unwrap();
        let func = ctx.load_module(ptx).unwrap().load_function("spin").unwrap();
        let flag = stream.alloc_zeros::<u32>(1).unwrap();
        Spinner { func, flag }
    }

    /// Queues a kernel on `stream` that keeps it busy for about `ns` nanoseconds.
    pub fn hold(&mut self, stream: &gpuio::cuda::cudarc::driver::CudaStream, ns: u64) {
        use gpuio::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
        let mut b = stream.launch_builder(&self.func);
        b.arg(&ns).arg(&mut self.flag);
        // SAFETY: one thread writes the one u32 `flag` holds.
        unsafe { b.launch(LaunchConfig::for_num_elems(1)) }.unwrap();
    }
}

/// Drops `path`'s pages from the page cache, so the next reads of it find it cold.
pub fn evict(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: a valid descriptor; the advice changes no memory of this process.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise(DONTNEED)");
}

/// Bytes the destination of [`mixed_batch`] has.
pub const MIXED_BATCH_DST: usize = (6 << 20) + 8192;

/// A batch over a file of 9 MiB (of `test_file`'s pattern) into [`MIXED_BATCH_DST`] bytes:
/// one of each kind of descriptor, numbered as [`check_mixed_batch`] expects.
pub fn mixed_batch(f: &gpuio::File) -> Vec<gpuio::batch::ReadDesc> {
    use gpuio::batch::ReadDesc;
    vec![
        ReadDesc::new(f, 4097, 5 << 20, 0),       // 0 large, unaligned
        ReadDesc::new(f, 6 << 20, 3000, 5 << 20), // 1 small
        ReadDesc::new(f, 8 << 20, 8192, (5 << 20) + 4096), // 2 aligned
        ReadDesc::new(f, (9 << 20) - 100, 4000, 6 << 20), // 3 short at EOF
        ReadDesc::new(f, 5, 0, 100),              // 4 empty
        ReadDesc::new(f, 0, 4096, 7 << 20),       // 5 past the buffer's end
        ReadDesc::new(f, 2 << 20, (1 << 20) + 5, 3 << 20), // 6 overlaps 0's dst
    ]
}

/// Checks a run of [`mixed_batch`] (`got`, into `got_buf`) against `read_into`'s on the same
/// plan (`want`, `want_buf`), and the large run's bytes against the file's `data`.
pub fn check_mixed_batch(
    what: &str,
    got: &[gpuio::Result<usize>],
    got_buf: &[u8],
    want: &[gpuio::Result<usize>],
    want_buf: &[u8],
    data: &[u8],
) {
    use gpuio::Error;
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        match (a, b) {
            (Ok(x), Ok(y)) => assert_eq!(x, y, "{what}: descriptor {i}"),
            (Err(Error::InvalidInput { .. }), Err(Error::InvalidInput { .. })) => {}
            _ => panic!("{what}: descriptor {i}: {a:?} against {b:?}"),
        }
    }
    assert!(matches!(got[5], Err(Error::InvalidInput { .. })), "{what}");
    assert_eq!(got[3].as_ref().ok(), Some(&100), "{what}: short at EOF");
    assert!(
        got_buf[..5 << 20] == data[4097..4097 + (5 << 20)],
        "{what}: the large run's bytes"
    );
    assert!(got_buf == want_buf, "{what}: the same bytes as read_into");
}
