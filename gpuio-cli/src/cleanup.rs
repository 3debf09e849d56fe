//! Temporary files that must not outlive the command that made them.
//!
//! `cp` writes into a temporary file beside its destination, `bench` and `soak` into
//! multi-GiB scratch files. Each one is a [`TempPath`]: it is listed in a process-wide
//! registry from the moment it is created, removed by its `Drop` when the command fails (or
//! finishes with it), and removed by a signal listener when the user presses Ctrl-C or the
//! process gets SIGTERM/SIGHUP, after which the process exits with 128 + the signal number
//! (130 for SIGINT, 143 for SIGTERM), as a shell reports a process killed by that signal.
//!
//! The listener is a thread of its own running a small current-thread tokio runtime, not a
//! task on the command's runtime: the command's workers may be busy (or blocked in a
//! synchronous fill), and the cleanup must run regardless. It is started by the first
//! [`TempPath::create`], before that file exists, so there is no window in which a file
//! exists but a signal would leave it behind. Commands that never make a temporary file keep
//! the default signal behaviour.
//!
//! Creation, [`TempPath::persist`] (the rename into place) and the signal listener all hold
//! the registry lock while they touch the file system, so a signal either sees a file
//! created and listed, or stops the process before it is created; and it never removes a
//! temporary file in the middle of its rename.

use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::size::fmt_bytes;

/// The temporary files that exist now, by id.
struct Registry {
    next_id: u64,
    paths: Vec<(u64, PathBuf)>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    next_id: 0,
    paths: Vec::new(),
});

/// The registry, also after a panic elsewhere poisoned its lock: a list of paths stays
/// consistent whatever panicked, and cleanup matters most on the way down.
fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// A temporary file that is removed unless [`TempPath::persist`] moves it into place.
#[derive(Debug)]
pub struct TempPath {
    id: u64,
    path: PathBuf,
    /// False once persisted: the path then names someone else's file (or nothing).
    armed: bool,
}

impl TempPath {
    /// Creates a new empty file `DIR/PREFIX<random>` (mode 0600, so that a copy of a secret
    /// is never readable by others while it is written) and registers it for removal.
    /// Returns it with the open file.
    pub fn create(dir: &Path, prefix: &str) -> io::Result<(TempPath, File)> {
        ensure_listener()?;
        let mut reg = registry();
        let mut last = None;
        // A few tries: another process may have taken a name; 10 random characters make a
        // second collision vanishingly unlikely.
        for _ in 0..16 {
            let name: String = std::iter::repeat_with(fastrand::alphanumeric)
                .take(10)
                .collect();
            let path = dir.join(format!("{prefix}{name}"));
            match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
            {
                Ok(file) => {
                    let id = reg.next_id;
                    reg.next_id += 1;
                    reg.paths.push((id, path.clone()));
                    let tmp = TempPath {
                        id,
                        path,
                        armed: true,
                    };
                    return Ok((tmp, file));
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("cannot create a temporary file in {}: {e}", dir.display()),
                    ));
                }
            }
        }
        Err(last.unwrap_or_else(|| io::Error::other("no free temporary name")))
    }

    /// The temporary file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the path (typically a rename into place) while no signal can remove it,
    /// and stops tracking the path if `f` succeeds. If `f` fails, the file is removed as on
    /// any other failure.
    pub fn persist<T>(mut self, f: impl FnOnce(&Path) -> io::Result<T>) -> io::Result<T> {
        let mut reg = registry();
        let r = f(&self.path);
        if r.is_ok() {
            self.armed = false;
            reg.paths.retain(|(id, _)| *id != self.id);
        }
        r
        // On failure `self` drops after the lock guard (declared later, dropped first), and
        // removes the file.
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let mut reg = registry();
        if self.armed {
            // Gone already is fine; anything else is worth a word, since it leaves a file.
            if let Err(e) = std::fs::remove_file(&self.path) {
                if e.kind() != io::ErrorKind::NotFound {
                    // Not eprintln!: it panics when stderr is a closed pipe, and Drop must not.
                    use std::io::Write;
                    let _ = writeln!(
                        io::stderr(),
                        "gpuio: cannot remove temporary file {}: {e}",
                        self.path.display()
                    );
                }
            }
        }
        reg.paths.retain(|(id, _)| *id != self.id);
    }
}

/// Starts the signal listener once; later calls return its setup's outcome.
fn ensure_listener() -> io::Result<()> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    STARTED
        .get_or_init(start_listener)
        .clone()
        .map_err(io::Error::other)
}

fn start_listener() -> Result<(), String> {
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<Result<(), String>>(1);
    std::thread::Builder::new()
        .name("gpuio-signals".into())
        .spawn(move || listen(ready_tx))
        .map_err(|e| format!("cannot start the signal listener: {e}"))?;
    // The handlers are installed once the listener says so: only then may files be made.
    ready_rx
        .recv()
        .map_err(|_| "the signal listener stopped during setup".to_string())?
}

fn listen(ready: std::sync::mpsc::SyncSender<Result<(), String>>) {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(format!("cannot start the signal listener: {e}")));
            return;
        }
    };
    rt.block_on(async move {
        let streams = (|| {
            Ok::<_, io::Error>((
                signal(SignalKind::interrupt())?,
                signal(SignalKind::terminate())?,
                signal(SignalKind::hangup())?,
            ))
        })();
        let (mut int, mut term, mut hup) = match streams {
            Ok(s) => s,
            Err(e) => {
                let _ = ready.send(Err(format!("cannot install signal handlers: {e}")));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        let signo = tokio::select! {
            _ = int.recv() => libc::SIGINT,
            _ = term.recv() => libc::SIGTERM,
            _ = hup.recv() => libc::SIGHUP,
        };
        remove_all_and_exit(signo);
    });
}

/// Removes every registered file and ends the process with 128 + `signo`. The registry lock
/// is held until the end, so no new temporary file can appear (or be renamed) meanwhile.
fn remove_all_and_exit(signo: i32) -> ! {
    let reg = registry();
    for (_, path) in &reg.paths {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => eprintln!(
                "gpuio: cannot remove temporary file {}: {e}",
                path.display()
            ),
        }
    }
    let name = match signo {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "SIGHUP",
    };
    eprintln!("\ngpuio: interrupted by {name}");
    // _exit, not exit: the engine's threads may be mid-I/O, and atexit handlers (of CUDA's
    // libraries, for one) racing with them can hang or crash; nothing is left to flush.
    // SAFETY: _exit has no preconditions.
    unsafe { libc::_exit(128 + signo) }
}

/// Free bytes for an unprivileged writer in the filesystem holding `dir` (statvfs).
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statvfs writes one struct into `st`, which outlives the call; `c` is a valid
    // NUL-terminated string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Refuses, before anything is written, a `needed`-byte file for `what` in `dir` when the
/// filesystem has less room: filling a disk to find out hurts everyone else on it.
pub fn check_room(dir: &Path, needed: u64, what: &str) -> Result<(), String> {
    let free =
        free_bytes(dir).map_err(|e| format!("{}: cannot query free space: {e}", dir.display()))?;
    if needed > free {
        return Err(format!(
            "{what} needs {} in {}, which has {} free",
            fmt_bytes(needed),
            dir.display(),
            fmt_bytes(free)
        ));
    }
    Ok(())
}
