//! The C API from C: each program in tests/c/ is compiled with the system C compiler (`cc`,
//! or `$CC`) against include/gpuio.h and the freshly built libgpuio_capi.so, run on a
//! temporary directory, and must print its `ok` lines and `PASS` and exit 0. The same programs
//! run again built with AddressSanitizer.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where cargo put libgpuio_capi.so for this test: `deps/`, beside the test binary (cargo
/// builds the crate's every crate type there for its tests, but copies them up into the
/// profile directory only for `cargo build`, so that copy may be stale).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    let deps = exe.parent().expect("the test binary lies in deps/");
    assert!(
        deps.join("libgpuio_capi.so").exists(),
        "{} has no libgpuio_capi.so (cargo builds it with the crate)",
        deps.display()
    );
    deps.to_path_buf()
}

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Compiles tests/c/`name`.c (with `extra` flags) into the test's scratch directory.
pub fn compile(name: &str, variant: &str, extra: &[&str]) -> PathBuf {
    let src = crate_dir().join(format!("tests/c/{name}.c"));
    build(&src, &format!("{name}{variant}"), extra)
}

/// Compiles one C (`.c`, with `$CC` or `cc`) or C++ (`.cpp`, with `$CXX` or `c++`) source
/// against the header and the library into the scratch directory as `out`.
fn build(src: &Path, out: &str, extra: &[&str]) -> PathBuf {
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c-api");
    std::fs::create_dir_all(&out_dir).expect("scratch directory");
    let exe = out_dir.join(out);
    let lib = lib_dir();
    let cpp = src.extension().is_some_and(|e| e == "cpp");
    let (var, default, std) = if cpp {
        ("CXX", "c++", "-std=c++17")
    } else {
        ("CC", "cc", "-std=c11")
    };
    let cc = std::env::var(var).unwrap_or_else(|_| default.into());
    let output = Command::new(&cc)
        .args([
            std,
            "-D_GNU_SOURCE",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-g",
            "-O1",
        ])
        .args(extra)
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg("-I")
        .arg(crate_dir().join("tests/c"))
        .arg("-I")
        .arg(crate_dir().join("../examples/c"))
        .arg(src)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lgpuio_capi", "-lpthread", "-ldl"])
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(
        output.status.success(),
        "compiling {} failed:\n{}",
        src.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    exe
}

/// Runs a compiled test program on a fresh directory; returns its standard output.
fn run(exe: &Path, env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().expect("temporary directory");
    run_with(exe, &[dir.path().as_os_str()], env)
}

/// Runs `exe` with `args`; fails unless it exits 0; returns its standard output.
fn run_with(exe: &Path, args: &[&std::ffi::OsStr], env: &[(&str, &str)]) -> String {
    // cargo's LD_LIBRARY_PATH names the profile directory too, whose copy of the library
    // may be stale (see `lib_dir`), and it outranks the binary's run path.
    let output = Command::new(exe)
        .args(args)
        .env("LD_LIBRARY_PATH", lib_dir())
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", exe.display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        exe.display(),
        output.status
    );
    // A panic caught at the C boundary still prints through the panic hook: bad input must
    // be refused before anything can panic, so none may show.
    assert!(
        !stderr.contains("panicked"),
        "{} printed a Rust panic:\n{stderr}",
        exe.display()
    );
    print!("{stdout}");
    stdout
}

/// Compiles and runs tests/c/`name`.c; checks it passed and printed each of `expected`.
fn c_test(name: &str, expected: &[&str]) {
    let out = run(&compile(name, "", &[]), &[]);
    check_output(name, &out, expected);
}

fn check_output(name: &str, out: &str, expected: &[&str]) {
    assert!(
        out.lines().any(|l| l == format!("PASS {name}")),
        "{name} did not print PASS {name}"
    );
    for line in expected {
        assert!(out.contains(line), "{name} did not print {line:?}");
    }
}

#[test]
fn sync_reads_writes_and_settings() {
    c_test(
        "sync",
        &[
            "ok read whole file",
            "ok short read at end of file",
            "ok write at two offsets, fsync, read back",
            "ok sizing: defaults and overrides",
            "ok check report",
        ],
    );
}

#[test]
fn async_wait_test_callback_and_eventfd() {
    c_test(
        "async",
        &[
            "ok wait",
            "ok test",
            "ok callback",
            "ok eventfd",
            "ok free waits for the callback",
            "ok write async",
        ],
    );
}

#[test]
fn batches() {
    c_test(
        "batch",
        &[
            "ok batch into host memory",
            "ok batch async",
            "ok error GPUIO_ERR_INVALID",
            "ok batch with dead files: every result written",
            "ok batch refused: every result written",
            "ok error GPUIO_ERR_INVALID: gpuio_read_batch: a batch of 18446744073709551615 \
             descriptors is more than any array holds",
        ],
    );
}

#[test]
fn every_error_path_has_a_status_and_a_message() {
    c_test(
        "errors",
        &[
            "ok error GPUIO_ERR_BAD_HANDLE",
            "ok error GPUIO_ERR_IO",
            "ok error GPUIO_ERR_SHUTDOWN",
            "ok error GPUIO_ERR_RANGE",
            "ok error GPUIO_ERR_WOULD_BLOCK",
            "ok error GPUIO_ERR_INVALID: gpuio_engine_settings.executor_threads 4294967295",
        ],
    );
}

#[test]
fn pending_requests_time_out_cancel_and_free() {
    c_test(
        "pending",
        &[
            "ok pending",
            "ok request_free cancels",
            "ok batch request_free cancels, every result written",
            "ok engine_free cancels",
        ],
    );
}

#[test]
fn agents_in_one_process() {
    c_test(
        "agent",
        &[
            "ok metadata exchanged",
            "ok read",
            "ok prepared write [0,1]->[1,0], notification after the data",
            "ok notifications: size query, too small kept, fetched",
            "ok descriptor lists serialised",
            "ok bad transfers refused",
            "ok removed peer refused, reloaded peer served",
            "ok deregistration waited for the transfer",
            "ok deregistered memory refused",
            "ok a wait for good ends when the agent is freed",
            "ok error GPUIO_ERR_INVALID: gpuio_xfer_create: local: descriptors is a null pointer",
            "ok error GPUIO_ERR_RANGE",
            "ok error GPUIO_ERR_TIMEOUT",
            "ok error GPUIO_ERR_BAD_HANDLE",
        ],
    );
}

#[test]
fn several_threads_submit_at_once() {
    c_test("threads", &["ok threads"]);
}

/// Device memory: on a machine without CUDA the program says why it skipped.
#[test]
fn device_memory_or_a_loud_skip() {
    let out = run(&compile("device", "", &[]), &[]);
    if let Some(line) = out.lines().find(|l| l.starts_with("SKIPPED")) {
        println!("device_memory_or_a_loud_skip: {line}");
        return;
    }
    check_output("device", &out, &["ok device read", "ok device write"]);
}

/// Every program again, built with AddressSanitizer (the C side instrumented; the library is
/// checked through what it hands back).
///
/// `fork` runs only without it: GCC's AddressSanitizer allocator takes no locks around
/// `fork()` (glibc's malloc does), so a child forked while any thread of the parent is inside
/// malloc or free inherits that lock held and hangs in its first allocation, whatever the
/// library does. CI caught it hanging 1 run in 20 (the child's new engine stuck in ASan's
/// `SizeClassAllocator64::GetFromAllocator`); unsanitized it passed 100 of 100.
#[test]
fn all_c_tests_under_address_sanitizer() {
    println!(
        "SKIPPED fork under ASan: its allocator is not fork-safe (see this test's comment); \
         an_engine_inherited_across_fork_refuses_in_the_child runs it unsanitized"
    );
    for name in [
        "sync", "async", "batch", "errors", "pending", "threads", "device", "agent",
    ] {
        let exe = compile(
            name,
            "-asan",
            &["-fsanitize=address", "-fno-omit-frame-pointer"],
        );
        // UCX's memory hooks (its malloc interception) do not work beside ASan's: agents
        // that load UCX need them off.
        let out = run(
            &exe,
            &[
                ("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0"),
                ("UCX_MEM_EVENTS", "no"),
            ],
        );
        if out.lines().any(|l| l.starts_with("SKIPPED")) {
            continue;
        }
        assert!(
            out.lines().any(|l| l == format!("PASS {name}")),
            "{name} under ASan did not pass"
        );
    }
}

/// A file of `len` bytes of a fixed pseudo-random pattern.
fn data_file(dir: &Path, len: usize) -> PathBuf {
    let path = dir.join("data.bin");
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let bytes: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(&path, bytes).expect("test data written");
    path
}

/// FNV-1a, 64 bits: what the examples print.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// examples/c/read_file.c prints the checksum of the file's bytes (computed here too), and
/// on a machine without CUDA says why it skipped device memory.
#[test]
fn example_read_file_prints_the_checksum() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = data_file(dir.path(), (5 << 20) + 777);
    let want = format!("{:016x}", fnv1a(&std::fs::read(&path).expect("data")));
    let exe = build(
        &crate_dir().join("../examples/c/read_file.c"),
        "read_file",
        &[],
    );
    let out = run_with(&exe, &[path.as_os_str()], &[]);
    let host = out
        .lines()
        .find(|l| l.starts_with("host:"))
        .expect("a host line");
    assert!(host.contains(&want), "host checksum: {host} (want {want})");
    let device = out
        .lines()
        .find(|l| l.starts_with("device:"))
        .expect("a device line");
    assert!(
        device.contains("skipped (") || (device.contains(&want) && device.ends_with("match")),
        "device line: {device}"
    );
}

/// examples/c/gpuio.hpp through examples/c/raii.cpp: both checksums equal the file's, and a
/// failure arrives as an exception with gpuio's message.
#[test]
fn example_cpp_wrapper() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = data_file(dir.path(), (3 << 20) + 5);
    let want = format!("{:016x}", fnv1a(&std::fs::read(&path).expect("data")));
    let exe = build(&crate_dir().join("../examples/c/raii.cpp"), "raii", &[]);
    let out = run_with(&exe, &[path.as_os_str()], &[]);
    for prefix in ["sync:", "async:"] {
        let line = out.lines().find(|l| l.starts_with(prefix)).expect("a line");
        assert!(line.contains(&want), "{line} (want {want})");
    }
    assert!(out.contains("error: gpuio_open") && out.contains("No such file"));
}

/// examples/c/throughput.c runs and reports a rate for the bytes it read.
#[test]
fn example_throughput_reports_a_rate() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = data_file(dir.path(), 16 << 20);
    let exe = build(
        &crate_dir().join("../examples/c/throughput.c"),
        "throughput",
        &[],
    );
    let args: Vec<&std::ffi::OsStr> = vec![
        path.as_os_str(),
        "--bs".as_ref(),
        "262144".as_ref(),
        "--qd".as_ref(),
        "8".as_ref(),
        "--seconds".as_ref(),
        "0.3".as_ref(),
    ];
    let out = run_with(&exe, &args, &[]);
    let line = out
        .lines()
        .find(|l| l.starts_with("c-async:"))
        .expect("a result line");
    let bytes: u64 = line
        .split(": ")
        .nth(2)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in {line}"));
    assert!(bytes >= 262144 && bytes % 262144 == 0, "{line}");
    assert!(line.ends_with("GB/s"), "{line}");
}

#[test]
fn an_engine_inherited_across_fork_refuses_in_the_child() {
    c_test(
        "fork",
        &[
            "ok error GPUIO_ERR_UNSUPPORTED",
            "ok child: the inherited engine refuses and frees",
            "ok child: a new engine works",
            "ok parent: its engine goes on",
        ],
    );
}
