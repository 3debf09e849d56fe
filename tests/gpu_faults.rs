//! GPU faults that change process-wide state, so they live in their own test binary: the CUDA
//! primary context destroyed under open files (in a child process of its own), and cuFile's
//! udev data removed mid-run. Each says loudly why it skipped where the machine cannot host it.

mod common;

use std::time::Duration;

use common::*;
use gpuio::gds::GdsStatus;
use gpuio::{Backend, Engine, Error, OpenOptions};

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

/// Set in the child process that runs the context reset alone.
const RESET_CHILD: &str = "GPUIO_TEST_CONTEXT_RESET_CHILD";

/// `cuDevicePrimaryCtxReset` under an engine that has pinned its pool and made its events in
/// that context, with a file open and the caller's device memory gone with the context: every
/// operation ends (error or correct data), none panics or hangs, host I/O keeps working, and
/// the engine shuts down. The bounce path only, in a process of its own: libcufile, once
/// opened by another test in this process, keeps its own allocations and threads in the
/// context, and a reset under it took the whole process down (libcufile's behaviour, not
/// gpuio's). The parent runs this test again in a child and checks how the child ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_context_destroyed_under_an_open_file() {
    const T: &str = "cuda_context_destroyed_under_an_open_file";
    if !gpuio::cuda::available() {
        skipped(format!("{T}: no usable CUDA device"));
        return;
    }
    if std::env::var_os(RESET_CHILD).is_none() {
        let run_child = |mode: &'static str| {
            let exe = std::env::current_exe().unwrap();
            tokio::task::spawn_blocking(move || {
                std::process::Command::new(exe)
                    .args(["--exact", T, "--nocapture", "--test-threads=1"])
                    .env(RESET_CHILD, mode)
                    .output()
            })
        };
        let out = run_child("bounce").await.unwrap().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        eprintln!("{T}: child process: {}\n{text}", out.status);
        assert!(
            out.status.success(),
            "{T}: the child failed ({})\n{text}",
            out.status
        );
        assert!(
            text.contains("1 passed"),
            "{T}: the child ran no test\n{text}"
        );
        // For the record (not asserted: it is libcufile's behaviour): the same reset in a
        // process where cuFile was opened first.
        if gpuio::gds::probe().driver.is_ok() {
            let out = run_child("after-cufile").await.unwrap().unwrap();
            let tail: String = String::from_utf8_lossy(&out.stderr)
                .lines()
                .rev()
                .take(3)
                .collect::<Vec<_>>()
                .join(" | ");
            eprintln!(
                "{T}: with cuFile opened first, the process ended with {}: {tail}",
                out.status
            );
        }
        return;
    }
    let ctx = gpuio::cuda::context(0).unwrap();
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "reset", 16 << 20, 41);
    if std::env::var(RESET_CHILD).as_deref() == Ok("after-cufile") {
        // Open libcufile in this process first (a forced cuFile read), as another test would.
        let gds = Engine::builder().backend(Backend::Gds).build().unwrap();
        if let Ok(g) = OpenOptions::new().read(true).direct(true).open(&gds, &path) {
            let s = ctx.default_stream();
            let mut d = s.alloc_zeros::<u8>(1 << 20).unwrap();
            let r = within(T, g.read_into(&mut d, 0)).await;
            eprintln!("{T}: cuFile read before the reset: {r:?}");
        }
        within(T, gds.shutdown()).await.unwrap();
    }
    let engine = Engine::builder().backend(Backend::Uring).build().unwrap();
    let f = engine.open(&path).unwrap();
    let stream = ctx.new_stream().unwrap();
    let mut d = stream.alloc_zeros::<u8>(4 << 20).unwrap();
    assert_eq!(within(T, f.read_into(&mut d, 5)).await.unwrap(), 4 << 20);
    assert!(engine.bounce_pool_pinned() || !gpuio::cuda::available());

    // SAFETY: resets device 0's primary context; every CUDA object made in it (the slice, the
    // stream, gpuio's events and its pool registration) becomes invalid, which is the fault
    // under test. This process (a child of the test run) does nothing else with the device.
    let rc =
        unsafe { gpuio::cuda::cudarc::driver::sys::cuDevicePrimaryCtxReset_v2(ctx.cu_device()) };
    eprintln!("{T}: cuDevicePrimaryCtxReset -> {rc:?}");

    // Into the vanished memory: an error naming CUDA, or (if the driver maps something there
    // again) a completed read; never a panic or a hang.
    match within(T, f.read_into(&mut d, 0)).await {
        Ok(n) => eprintln!("{T}: read into a pointer of the destroyed context returned {n}"),
        Err(e) => {
            assert!(matches!(e, Error::Cuda { .. }), "{e}");
            eprintln!("{T}: read into the destroyed context: {e}");
        }
    }
    std::mem::forget(d); // its free would go to a stream that no longer exists
    std::mem::forget(stream);

    // Host memory through the same engine and file still works.
    let mut h = vec![0u8; 3 << 20];
    assert_eq!(within(T, f.read_into(&mut h, 7)).await.unwrap(), 3 << 20);
    assert!(h[..] == data[7..7 + (3 << 20)]);

    // Fresh device memory: correct data, or a clear CUDA error; either way no hang.
    let fresh = gpuio::cuda::context(0)
        .map_err(|e| e.to_string())
        .and_then(|c| c.new_stream().map_err(|e| format!("{e:?}")));
    match fresh {
        Ok(s) => match s.alloc_zeros::<u8>(2 << 20) {
            Ok(mut d2) => match within(T, f.read_into(&mut d2, 11)).await {
                Ok(n) => {
                    assert_eq!(n, 2 << 20);
                    assert!(s.clone_dtoh(&d2).unwrap()[..] == data[11..11 + n]);
                    eprintln!("{T}: a fresh allocation after the reset read correctly");
                }
                Err(e) => {
                    assert!(matches!(e, Error::Cuda { .. }), "{e}");
                    eprintln!("{T}: fresh allocation after the reset: {e}");
                }
            },
            Err(e) => eprintln!("{T}: allocation after the reset failed in cudarc: {e:?}"),
        },
        Err(e) => eprintln!("{T}: no stream after the reset: {e}"),
    }
    within(T, engine.shutdown()).await.unwrap();
}

/// The block device's udev record removed while files are open through AUTO: files already
/// registered keep reading correctly; a file opened afterwards is served (correctly) through
/// the bounce path where cuFile now refuses it, with the reason. The record is restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cufile_udev_data_removed_mid_run() {
    const T: &str = "cufile_udev_data_removed_mid_run";
    if !gpuio::cuda::available() {
        skipped(format!("{T}: no usable CUDA device"));
        return;
    }
    let probe = gpuio::gds::probe();
    if let Err(e) = &probe.driver {
        skipped(format!("{T}: cuFile unavailable: {e}"));
        return;
    }
    let dir = tmpdir();
    let (path_a, data) = test_file(dir.path(), "a", 8 << 20, 51);
    let (path_b, _) = test_file(dir.path(), "b", 8 << 20, 51);
    // AUTO with compatibility-mode cuFile allowed, so it serves the file on these machines.
    let engine = Engine::builder().cufile_compat(true).build().unwrap();
    if !direct_ok(&engine, &path_a) {
        skipped(format!("{T}: no O_DIRECT here"));
        return;
    }
    let open = |p: &std::path::Path| {
        OpenOptions::new()
            .read(true)
            .direct(true)
            .open(&engine, p)
            .unwrap()
    };
    let a = open(&path_a);
    let (GdsStatus::CufileCompat | GdsStatus::Gds) = a.gds_status() else {
        skipped(format!(
            "{T}: cuFile does not serve this file to begin with ({}); phase B of the GPU \
             bundle gives it its udev data",
            a.gds_status()
        ));
        return;
    };
    let Some(record) = udev_record(&path_a) else {
        skipped(format!("{T}: no udev record file for this filesystem"));
        return;
    };
    let saved = std::fs::read(&record).unwrap();
    if std::fs::remove_file(&record).is_err() {
        skipped(format!(
            "{T}: cannot remove {} (not root?)",
            record.display()
        ));
        return;
    }
    struct Restore(std::path::PathBuf, Vec<u8>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = std::fs::write(&self.0, &self.1);
        }
    }
    let _restore = Restore(record.clone(), saved);

    let ctx = gpuio::cuda::context(0).unwrap();
    let stream = ctx.default_stream();
    let check = |f: gpuio::File, name: &'static str| {
        let stream = stream.clone();
        let data = &data;
        async move {
            let mut d = stream.alloc_zeros::<u8>((8 << 20) - 9).unwrap();
            let n = within(T, f.read_into(&mut d, 9)).await.unwrap();
            assert_eq!(n, (8 << 20) - 9, "{name}");
            assert!(
                stream.clone_dtoh(&d).unwrap()[..] == data[9..],
                "{name}: data"
            );
            eprintln!("{T}: {name} read correctly via {}", f.gds_status());
            f
        }
    };
    let a = check(a, "file registered before the removal").await;
    let b = check(open(&path_b), "file opened after the removal").await;
    match b.gds_status() {
        GdsStatus::Bounce(why) => assert!(why.contains("udev") || why.contains("cuFile"), "{why}"),
        other => eprintln!("{T}: cuFile still registered a file without its udev record ({other})"),
    }
    drop((a, b));
    within(T, engine.shutdown()).await.unwrap();
}

/// `/run/udev/data/b<major>:<minor>` of the filesystem holding `path`.
fn udev_record(path: &std::path::Path) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(path).ok()?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let p = std::path::PathBuf::from(format!("/run/udev/data/b{major}:{minor}"));
    p.exists().then_some(p)
}
