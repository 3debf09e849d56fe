//! An engine inherited across `fork()` (issue 40): the child has none of the parent's threads,
//! so its reactor is gone there. Every operation in the child fails at once with
//! `Error::Unsupported` naming fork and the fix, dropping the engine there returns at once,
//! and the parent's engine is untouched. Before, a child's read of 64 KiB or more waited for
//! good (small reads, served from the page cache by the calling thread, still worked).

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use futures::executor::block_on;
use gpuio::{Engine, Error};

/// What the child saw, one line per check: "ok" or what went wrong.
fn in_child(engine: Engine, file: gpuio::File, path: &std::path::Path) -> String {
    let refused = |what: &str, r: Result<usize, Error>| match r {
        Err(Error::Unsupported { reason, .. }) if reason.contains("fork()") => "ok".to_string(),
        other => format!("{what}: {other:?}"),
    };
    let mut big = vec![0u8; 1 << 20];
    let mut small = [0u8; 100];
    let lines = [
        refused("1 MiB read", block_on(file.read_into(&mut big[..], 0))),
        refused("100-byte read", block_on(file.read_into(&mut small[..], 0))),
        refused("write", block_on(file.write_from(&small[..], 0))),
        refused("open", engine.open(path).map(|_| 0)),
    ];
    let started = Instant::now();
    drop(file);
    drop(engine);
    let drop_took = started.elapsed();
    let mut out = lines.join("\n");
    if drop_took > Duration::from_millis(500) {
        out.push_str(&format!("\ndropping the engine took {drop_took:?}"));
    }
    out
}

#[test]
fn an_engine_inherited_across_fork_fails_clearly_in_the_child() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("f.bin");
    std::fs::write(&path, vec![7u8; 2 << 20]).unwrap();
    let engine = Engine::new().unwrap();
    let file = gpuio::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&engine, &path)
        .unwrap();
    let mut buf = vec![0u8; 1 << 20];
    assert_eq!(block_on(file.read_into(&mut buf[..], 0)).unwrap(), 1 << 20);

    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child only runs `in_child` (gpuio calls, allocation: glibc's allocator is
    // fork-safe) and leaves with `_exit`, never returning into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: the child's copy of the read end, unused here.
        unsafe { libc::close(fds[0]) };
        // The child's only handles: their drop is the engine's drop in a forked child.
        let report = in_child(engine, file, &path);
        // SAFETY: a valid descriptor and buffer; then leave without running destructors.
        unsafe {
            libc::write(fds[1], report.as_ptr().cast(), report.len());
            libc::_exit(0);
        }
    }
    // SAFETY: the parent owns both ends; the write end is closed so EOF follows the child.
    unsafe { libc::close(fds[1]) };
    // SAFETY: fds[0] is a descriptor this process owns alone from here.
    let mut reader = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fds[0]) });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = reader.read_to_string(&mut s);
        let _ = tx.send(s);
    });
    let report = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(r) => r,
        Err(_) => {
            // SAFETY: the child's pid; it hung, which is the failure being tested.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the child hung on the inherited engine");
        }
    };
    let mut status = 0;
    // SAFETY: reaps our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(report.lines().all(|l| l == "ok"), "{report}");
    assert_eq!(report.lines().count(), 4, "{report}");
    // The parent's engine goes on.
    buf.fill(0);
    assert_eq!(block_on(file.read_into(&mut buf[..], 0)).unwrap(), 1 << 20);
    assert!(buf.iter().all(|&b| b == 7));
}
