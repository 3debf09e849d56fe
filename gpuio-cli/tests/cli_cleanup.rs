//! `gpuio bench` and `gpuio soak` scratch files: gone after a signal; never larger than the
//! filesystem's free space.

mod cli_util;

use std::time::{Duration, Instant};

use cli_util::*;

#[test]
fn a_signal_during_bench_removes_its_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    // Without --file, bench makes its file in the system temp dir: TMPDIR.
    let mut b = Running::spawn(
        gpuio()
            .args(["bench", "--size", "256M", "--seconds", "30"])
            .env("TMPDIR", dir.path()),
    );
    wait_for_file(dir.path(), "gpuio-bench", &mut b);
    b.signal(libc::SIGTERM);
    let r = b.wait();
    assert!(
        names(dir.path()).is_empty(),
        "left behind: {:?}",
        names(dir.path())
    );
    assert_eq!(r.status.code(), Some(143), "{r:?}");
}

#[test]
fn a_signal_during_soak_removes_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Running::spawn(
        gpuio()
            .args(["soak", "--size", "64M", "--minutes", "1", "--dir"])
            .arg(dir.path()),
    );
    wait_for_file(dir.path(), "gpuio-soak", &mut s);
    s.signal(libc::SIGINT);
    let r = s.wait();
    assert!(
        names(dir.path()).is_empty(),
        "left behind: {:?}",
        names(dir.path())
    );
    assert_eq!(r.status.code(), Some(130), "{r:?}");
}

/// Free bytes for an unprivileged writer where `dir` lives.
fn free_bytes(dir: &std::path::Path) -> u64 {
    let c = std::ffi::CString::new(dir.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: a zeroed statvfs for the call to fill; a valid NUL-terminated path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_bavail as u64 * st.f_frsize as u64
}

#[test]
fn bench_refuses_a_size_beyond_the_free_space_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let size = (1u64 << 40).max(free_bytes(dir.path()) + (1 << 30));
    let start = Instant::now();
    let r = run(gpuio()
        .args(["bench", "--seconds", "1", "--size"])
        .arg(size.to_string())
        .env("TMPDIR", dir.path()));
    assert!(!r.ok(), "{r:?}");
    // Up front, not after filling the disk.
    assert!(start.elapsed() < Duration::from_secs(60), "{r:?}");
    let d = dir.path().to_string_lossy();
    assert!(r.stderr.contains(&*d) && r.stderr.contains("free"), "{r:?}");
    assert!(names(dir.path()).is_empty(), "{:?}", names(dir.path()));

    // A write bench grows --file up to --size: the same check, before creating it.
    let r = run(gpuio()
        .args(["bench", "--rw", "write", "--seconds", "1", "--size"])
        .arg(size.to_string())
        .arg("--file")
        .arg(dir.path().join("f")));
    assert!(!r.ok(), "{r:?}");
    assert!(r.stderr.contains(&*d) && r.stderr.contains("free"), "{r:?}");
    assert!(names(dir.path()).is_empty(), "{:?}", names(dir.path()));
}
