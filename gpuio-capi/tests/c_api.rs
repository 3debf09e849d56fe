//! The C API from C: each program in tests/c/ is compiled with the system C compiler (`cc`,
//! or `$CC`) against include/gpuio.h and the freshly built libgpuio_capi.so, run on a
//! temporary directory, and must print its `ok` lines and `PASS` and exit 0. The same programs
//! run again built with AddressSanitizer.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where cargo put libgpuio_capi.so: next to this test's `deps/` directory.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    let deps = exe.parent().expect("the test binary lies in deps/");
    let dir = deps.parent().expect("deps/ lies in the profile directory");
    assert!(
        dir.join("libgpuio_capi.so").exists(),
        "{} has no libgpuio_capi.so (cargo builds it with the crate)",
        dir.display()
    );
    dir.to_path_buf()
}

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Compiles tests/c/`name`.c (with `extra` flags) into the test's scratch directory.
pub fn compile(name: &str, variant: &str, extra: &[&str]) -> PathBuf {
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("c-api");
    std::fs::create_dir_all(&out_dir).expect("scratch directory");
    let exe = out_dir.join(format!("{name}{variant}"));
    let lib = lib_dir();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let output = Command::new(&cc)
        .args([
            "-std=c11",
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
        .arg(crate_dir().join(format!("tests/c/{name}.c")))
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lgpuio_capi", "-lpthread", "-ldl"])
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(
        output.status.success(),
        "compiling tests/c/{name}.c failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    exe
}

/// Runs a compiled test program on a fresh directory; returns its standard output.
fn run(exe: &Path, env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().expect("temporary directory");
    let output = Command::new(exe)
        .arg(dir.path())
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
            "ok engine_free cancels",
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
#[test]
fn all_c_tests_under_address_sanitizer() {
    for name in [
        "sync", "async", "batch", "errors", "pending", "threads", "device",
    ] {
        let exe = compile(
            name,
            "-asan",
            &["-fsanitize=address", "-fno-omit-frame-pointer"],
        );
        let out = run(&exe, &[("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")]);
        if out.lines().any(|l| l.starts_with("SKIPPED")) {
            continue;
        }
        assert!(
            out.lines().any(|l| l == format!("PASS {name}")),
            "{name} under ASan did not pass"
        );
    }
}
