//! Running the real `gpuio` binary from the CLI tests: spawn, wait for a file, signal, reap.
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Generous: the VMs these run on are small and shared; a healthy run takes a fraction.
pub const LIMIT: Duration = Duration::from_secs(120);

/// The binary under test: cargo's build of it, or `GPUIO_BIN` where the tests run away from
/// the build tree (the GPU bundle carries the binary beside the test executables).
pub fn bin() -> std::ffi::OsString {
    std::env::var_os("GPUIO_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_gpuio").into())
}

pub fn gpuio() -> Command {
    Command::new(bin())
}

/// What a finished run left: exit status, stdout, stderr.
pub struct Ran {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    pub fn ok(&self) -> bool {
        self.status.success()
    }
}

impl std::fmt::Debug for Ran {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}\nstdout: {}\nstderr: {}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// Runs `cmd` to the end (at most [`LIMIT`]).
pub fn run(cmd: &mut Command) -> Ran {
    Running::spawn(cmd).wait()
}

/// A spawned `gpuio`, killed if the test ends (or fails) before it does.
pub struct Running {
    child: Option<Child>,
}

impl Running {
    pub fn spawn(cmd: &mut Command) -> Running {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn gpuio");
        Running { child: Some(child) }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid, which we have not reaped yet.
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0, "kill");
    }

    /// Whether it is still running.
    pub fn running(&mut self) -> bool {
        let c = self.child.as_mut().expect("running");
        matches!(c.try_wait(), Ok(None))
    }

    /// Waits for the end (at most [`LIMIT`], then kills it and fails the test).
    pub fn wait(mut self) -> Ran {
        let mut child = self.child.take().expect("running");
        let start = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().expect("try_wait") {
                break s;
            }
            if start.elapsed() > LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                panic!("gpuio did not finish within {LIMIT:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let mut stdout = String::new();
        let mut stderr = String::new();
        if let Some(mut o) = child.stdout.take() {
            let _ = o.read_to_string(&mut stdout);
        }
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut stderr);
        }
        Ran {
            status,
            stdout,
            stderr,
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The names in `dir`, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .expect("read_dir")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    v.sort();
    v
}

/// Waits (at most [`LIMIT`]) until `dir` holds a file whose name starts with `prefix`, while
/// `run` is still running; fails the test if it ends first.
pub fn wait_for_file(dir: &Path, prefix: &str, run: &mut Running) -> PathBuf {
    let start = Instant::now();
    loop {
        if let Some(n) = names(dir).into_iter().find(|n| n.starts_with(prefix)) {
            return dir.join(n);
        }
        assert!(
            run.running(),
            "gpuio ended before {prefix}* appeared in {}",
            dir.display()
        );
        assert!(
            start.elapsed() < LIMIT,
            "no {prefix}* in {} within {LIMIT:?}",
            dir.display()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// `len` pseudo-random bytes (fixed seed).
pub fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut v = vec![0u8; len];
    rng.fill(&mut v);
    v
}
