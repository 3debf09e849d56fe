//! What a careless or hostile user of the `gpuio` command does, run against the real binary:
//! each case ends within a time limit, without a panic or an abort, and with an error that
//! names the flag or path at fault.

mod cli_util;

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Every case must finish well within this (a blocked open or a runaway run does not).
const LIMIT: Duration = Duration::from_secs(20);

/// What a run of the binary left.
struct Run {
    what: String,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    /// Failed cleanly: an ordinary error exit (1, or clap's 2 for a bad value), no panic.
    fn refused(&self) -> &Self {
        assert!(
            matches!(self.code, Some(1 | 2)),
            "{}: wanted a clean refusal (exit 1 or 2), got {:?}; stderr:\n{}",
            self.what,
            self.code,
            self.stderr
        );
        self.no_panic()
    }

    fn succeeded(&self) -> &Self {
        assert_eq!(
            self.code,
            Some(0),
            "{}: stdout:\n{}\nstderr:\n{}",
            self.what,
            self.stdout,
            self.stderr
        );
        self.no_panic()
    }

    fn no_panic(&self) -> &Self {
        assert!(
            !self.stderr.contains("panicked"),
            "{}: panicked:\n{}",
            self.what,
            self.stderr
        );
        self
    }

    /// stderr says all of `parts`.
    fn says(&self, parts: &[&str]) -> &Self {
        for p in parts {
            assert!(
                self.stderr.contains(p),
                "{}: stderr lacks {p:?}:\n{}",
                self.what,
                self.stderr
            );
        }
        self
    }
}

fn bin() -> Command {
    let mut c = Command::new(cli_util::bin());
    // Panic messages stay short; they are failures here either way.
    c.env("RUST_BACKTRACE", "0");
    c
}

/// Waits for `child` up to [`LIMIT`]; past it, kills it and fails the test.
fn wait(mut child: Child, what: &str) -> Option<i32> {
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status.code(),
            Ok(None) if start.elapsed() < LIMIT => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what}: still running after {LIMIT:?} (killed)");
            }
            Err(e) => panic!("{what}: waiting for gpuio: {e}"),
        }
    }
}

/// Runs `gpuio ARGS` with stdout and stderr in files (nothing blocks on a full pipe).
fn gpuio(args: &[&str]) -> Run {
    let what = format!("gpuio {}", args.join(" "));
    let dir = tempfile::tempdir().expect("temporary directory");
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let child = bin()
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("stdout file"))
        .stderr(std::fs::File::create(&err).expect("stderr file"))
        .spawn()
        .expect("spawn gpuio");
    let code = wait(child, &what);
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    Run {
        code,
        stdout: read(&out),
        stderr: read(&err),
        what,
    }
}

fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path without NUL");
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 temporary path")
}

// Item 5: a FIFO is refused at once, not opened and waited on.

#[test]
fn bench_refuses_a_fifo_without_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    gpuio(&["bench", "--file", s(&fifo), "--seconds", "0.1"])
        .refused()
        .says(&[s(&fifo), "is a FIFO"]);
}

#[test]
fn check_refuses_a_fifo_without_hanging() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    mkfifo(&fifo);
    gpuio(&["check", s(&fifo)])
        .refused()
        .says(&[s(&fifo), "is a FIFO"]);
}

// Item 7: values that panicked or aborted are refused up front, naming the flag.

#[test]
fn bench_chunk_zero_is_refused() {
    gpuio(&[
        "bench",
        "--chunk",
        "0",
        "--size",
        "1M",
        "--bs",
        "4K",
        "--seconds",
        "0.1",
    ])
    .refused()
    .says(&["--chunk", "multiple of 4 KiB"]);
}

#[test]
fn durations_past_a_year_are_refused() {
    gpuio(&["bench", "--seconds", "1e300", "--size", "1M", "--bs", "4K"])
        .refused()
        .says(&["--seconds", "longer than a year"]);
    let dir = tempfile::tempdir().unwrap();
    gpuio(&[
        "soak",
        "--minutes",
        "1e300",
        "--size",
        "1M",
        "--dir",
        s(dir.path()),
    ])
    .refused()
    .says(&["--minutes", "longer than a year"]);
}

#[test]
fn soak_regions_past_what_the_size_holds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    gpuio(&[
        "soak",
        "--regions",
        "100000000",
        "--size",
        "1M",
        "--minutes",
        "0.01",
        "--dir",
        s(dir.path()),
    ])
    .refused()
    .says(&["--regions 100000000", "at most 256 regions"]);
}

#[test]
fn other_bad_values_are_refused_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let d = s(dir.path());
    let w = dir.path().join("w");
    let cases: &[(&[&str], &[&str])] = &[
        (&["bench", "--qd", "0"], &["--qd", "1..=32768"]),
        (&["bench", "--qd", "100000000"], &["--qd", "1..=32768"]),
        (&["bench", "--bs", "0"], &["--bs", "at least 1 byte"]),
        (&["bench", "--size", "0"], &["--size", "at least 1 byte"]),
        (
            &["bench", "--chunk", "1000"],
            &["--chunk", "multiple of 4 KiB"],
        ),
        (
            &["bench", "--seconds", "nan"],
            &["--seconds", "not a finite"],
        ),
        (
            &["bench", "--seconds", "1e-300"],
            &["--seconds", "millisecond"],
        ),
        (
            &["bench", "--pattern", "batch", "--batch", "0"],
            &["--batch"],
        ),
        (&["bench", "--jobs", "0"], &["--jobs"]),
        (
            &["bench", "--blocking", "--rw", "write"],
            &["--blocking", "host memory"],
        ),
        (
            &["bench", "--blocking", "--owned"],
            &["--owned", "--blocking"],
        ),
        (
            &["bench", "--copies-per-device", "0"],
            &["--copies-per-device", "1..="],
        ),
        (
            &["bench", "--qd", "64", "--jobs", "3"],
            &["--qd 64", "--jobs 3", "multiple of 3"],
        ),
        // Buffers beyond the machine's memory: once an abort (or the OOM killer).
        (
            &[
                "bench",
                "--rw",
                "write",
                "--size",
                "1T",
                "--bs",
                "1T",
                "--file",
                s(&w),
            ],
            &["--bs 1T", "host memory"],
        ),
        (
            &[
                "bench",
                "--pattern",
                "batch",
                "--batch",
                "65536",
                "--bs",
                "1M",
                "--size",
                "1M",
            ],
            &["--batch 65536", "host memory"],
        ),
        (
            &["soak", "--tasks", "0", "--dir", d],
            &["--tasks", "1..=1048576"],
        ),
        (
            &["soak", "--tasks", "2000000", "--size", "1M", "--dir", d],
            &["--tasks", "1..=1048576"],
        ),
        (
            &["soak", "--max-len", "0", "--dir", d],
            &["--max-len", "at least 1 byte"],
        ),
        (
            &["soak", "--size", "0", "--dir", d],
            &["--size", "at least 1 byte"],
        ),
        (
            &["soak", "--size", "16000000T", "--dir", d],
            &["--size", "host memory"],
        ),
        (
            &["soak", "--minutes", "0", "--dir", d],
            &["--minutes", "millisecond"],
        ),
        (
            &["soak", "--modes", "fast", "--dir", d],
            &["--modes", "buffered, direct"],
        ),
    ];
    for (args, says) in cases {
        gpuio(args).refused().says(says);
    }
    assert!(!w.exists(), "a refused bench must not create its --file");
}

// Issue 40, item 10: a negative number reaches its flag's own check, which names the flag and
// says it cannot be negative (clap took `-1` for an unknown flag: "unexpected argument '-1'").

#[test]
fn negative_numbers_are_refused_by_their_flags() {
    let dir = tempfile::tempdir().unwrap();
    let d = s(dir.path());
    let src = dir.path().join("src");
    std::fs::write(&src, [1u8; 4096]).unwrap();
    let dst = dir.path().join("dst");
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "--seconds", "-1"], "--seconds"),
        (&["bench", "--qd", "-1"], "--qd"),
        (&["bench", "--bs", "-4096"], "--bs"),
        (&["bench", "--size", "-1"], "--size"),
        (&["bench", "--rounds", "-2"], "--rounds"),
        (&["bench", "--reactor-spin-us", "-5"], "--reactor-spin-us"),
        (&["bench", "--sqpoll-idle-ms", "-5"], "--sqpoll-idle-ms"),
        (&["soak", "--minutes", "-0.5", "--dir", d], "--minutes"),
        (&["soak", "--tasks", "-3", "--dir", d], "--tasks"),
        (&["soak", "--regions", "-3", "--dir", d], "--regions"),
        (
            &["soak", "--leak-percent", "-1", "--dir", d],
            "--leak-percent",
        ),
        (
            &["soak", "--drop-percent", "-1", "--dir", d],
            "--drop-percent",
        ),
        (&["soak", "--seed", "-1", "--dir", d], "--seed"),
        (&["cp", "--qd", "-1", s(&src), s(&dst)], "--qd"),
    ];
    for (args, flag) in cases {
        let r = gpuio(args);
        r.refused().says(&[flag, "negative"]);
        assert!(
            !r.stderr.contains("unexpected argument"),
            "{}: {}",
            r.what,
            r.stderr
        );
    }
    assert!(!dst.exists(), "a refused cp must not write");
}

/// Runs `gpuio ARGS` with stdout a pipe whose reader has already gone: every write fails with
/// EPIPE, as under `gpuio ARGS | head -1` once head has exited.
fn into_a_closed_pipe(args: &[&str]) -> Run {
    let what = format!("gpuio {} | (closed)", args.join(" "));
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: fresh descriptors that nothing else owns.
    let (reader, writer) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(reader);
    let mut cmd = bin();
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn gpuio");
    // The command keeps its copy of the write end until dropped.
    drop(cmd);
    let mut stderr = child.stderr.take().expect("stderr pipe");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let code = wait(child, &what);
    Run {
        code,
        stdout: String::new(),
        stderr: reader.join().unwrap_or_default(),
        what,
    }
}

#[test]
fn check_into_a_closed_pipe_ends_quietly() {
    let r = into_a_closed_pipe(&["check"]);
    r.succeeded();
    assert!(r.stderr.is_empty(), "{}: {}", r.what, r.stderr);
}

#[test]
fn bench_into_a_closed_pipe_ends_quietly() {
    let r = into_a_closed_pipe(&["bench", "--size", "1M", "--bs", "4K", "--seconds", "0.1"]);
    r.succeeded();
    assert!(r.stderr.is_empty(), "{}: {}", r.what, r.stderr);
}

// Item 10: what is not a regular file or block device is named as what it is.

#[test]
fn bench_names_what_is_not_a_regular_file() {
    let dir = tempfile::tempdir().unwrap();
    gpuio(&["bench", "--file", s(dir.path()), "--seconds", "0.1"])
        .refused()
        .says(&[
            s(dir.path()),
            "is a directory",
            "regular files and block devices",
        ]);
    gpuio(&["bench", "--file", "/dev/zero", "--seconds", "0.1"])
        .refused()
        .says(&[
            "/dev/zero is a character device",
            "regular files and block devices",
        ]);
    gpuio(&["bench", "--file", "/proc/cpuinfo", "--seconds", "0.1"])
        .refused()
        .says(&["/proc/cpuinfo", "pseudo filesystem"]);
}

#[test]
fn bench_checks_the_plot_path_before_the_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("missing").join("x.svg");
    // A minute-long point: only a refusal before the sweep ends within the limit.
    let args = [
        "bench",
        "--size",
        "1M",
        "--bs",
        "4K",
        "--seconds",
        "60",
        "--plot",
        s(&plot),
    ];
    gpuio(&args).refused().says(&[s(&plot), "--plot"]);
}

#[test]
fn check_reports_pseudo_filesystems_without_creating_files() {
    for (path, fs) in [("/proc", "proc"), ("/sys", "sysfs")] {
        let r = gpuio(&["check", path]);
        r.succeeded();
        assert!(
            r.stdout.contains(&format!("path {path}: filesystem {fs}")),
            "{}: {}",
            r.what,
            r.stdout
        );
        assert!(r.stdout.contains("not probed"), "{}: {}", r.what, r.stdout);
    }
}

#[test]
fn check_reads_a_read_only_directory_without_writing() {
    // A read-only bind mount in a mount namespace of its own (root only; skipped elsewhere).
    if !Command::new("unshare")
        .args(["-m", "true"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
    {
        eprintln!("skipped: no mount namespace here (unshare -m needs root)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("data"), [7u8; 4096]).unwrap();
    let d = s(dir.path());
    let script = format!(
        "mount --bind '{d}' '{d}' && mount -o remount,bind,ro '{d}' && exec '{}' check '{d}'",
        cli_util::bin().to_string_lossy()
    );
    let what = format!("gpuio check {d} (read-only)");
    let logs = tempfile::tempdir().unwrap();
    let out = logs.path().join("stdout");
    let child = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .env("RUST_BACKTRACE", "0")
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn unshare");
    let code = wait(child, &what);
    let stdout = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(code, Some(0), "{what}:\n{stdout}");
    assert!(
        stdout.contains("(a read-only filesystem; it is only read)")
            && stdout.contains("O_DIRECT open:"),
        "{what}:\n{stdout}"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, ["data"], "{what}: files left");
}

// Item 11: the CLI builds SPDK engines with DMA memory; its errors give no library advice.

#[test]
fn spdk_errors_give_cli_users_advice_they_can_follow() {
    // A PCIe address no machine has: nothing is ever read or written.
    let trid = "trtype:PCIe traddr:ffff:ff:1f.7";
    let dir = tempfile::tempdir().unwrap();
    let runs = [
        gpuio(&[
            "bench",
            "--backend",
            "spdk",
            "--target",
            trid,
            "--size",
            "4K",
            "--bs",
            "4K",
            "--seconds",
            "0.1",
        ]),
        gpuio(&[
            "soak",
            "--nvme",
            trid,
            "--size",
            "1M",
            "--minutes",
            "0.01",
            "--dir",
            s(dir.path()),
        ]),
    ];
    for r in &runs {
        r.refused().says(&[trid]);
        assert!(
            !r.stderr.contains("EngineBuilder") && !r.stderr.contains("spdk_memory"),
            "{}: advice only a library user can follow:\n{}",
            r.what,
            r.stderr
        );
    }
}

#[test]
fn bench_jobs_keep_every_request_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("jobs.bin");
    std::fs::write(&f, vec![7u8; 1 << 20]).unwrap();
    let run = gpuio(&[
        "bench",
        "--file",
        s(&f),
        "--size",
        "1M",
        "--bs",
        "4K",
        "--qd",
        "8",
        "--jobs",
        "2",
        "--pattern",
        "rand",
        "--seconds",
        "0.3",
        "--json",
    ]);
    run.succeeded();
    let last = run.stdout.lines().last().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(v["jobs"], 2, "{last}");
    assert_eq!(v["qd"], 8, "{last}");
    assert!(v["ops"].as_u64().unwrap() > 0, "{last}");
}
