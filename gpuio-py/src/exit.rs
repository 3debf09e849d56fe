//! Attaching to the interpreter safely while it exits.
//!
//! CPython 3.11–3.13 ends a daemon thread that tries to take the GIL once finalization has
//! begun with `pthread_exit`, which unwinds the thread's stack. Through the binding's Rust
//! frames (PyO3's trampolines catch unwinds) that unwind aborts the process ("FATAL: exception
//! not rethrown"): 1–4 runs in 100 of a program exiting with daemon threads inside `read_into`
//! did (issue 40). The threads gpuio starts itself (the asyncio pool) would do the same.
//!
//! So no thread but the exiting one attaches once exit has begun: `gpuio/__init__.py` registers
//! [`at_exit`] with `atexit`, which CPython runs on the exiting thread before finalization
//! starts. From then on a thread about to attach (after a blocking call, or a pool thread
//! delivering a result) parks for good instead, without the GIL; the process ends around it.
//! [`at_exit`] also waits for the threads already past the check to finish attaching, so that
//! none can be caught half way (the counter and the flag are checked in opposite orders, both
//! sequentially consistent). The exiting thread itself is never parked: calls from later
//! `atexit` handlers on it still work.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::thread::ThreadId;

use pyo3::prelude::*;

static EXITING: AtomicBool = AtomicBool::new(false);
static EXIT_THREAD: OnceLock<ThreadId> = OnceLock::new();
/// Threads between the check in [`enter`] and the end of their attach.
static ATTACHING: AtomicUsize = AtomicUsize::new(0);

/// Called before a thread attaches: parks it for good where the interpreter is exiting and
/// this is not the exiting thread; otherwise counts it as attaching (end with [`leave`]).
fn enter() {
    ATTACHING.fetch_add(1, SeqCst);
    if EXITING.load(SeqCst) && EXIT_THREAD.get() != Some(&std::thread::current().id()) {
        ATTACHING.fetch_sub(1, SeqCst);
        loop {
            std::thread::park();
        }
    }
}

fn leave() {
    ATTACHING.fetch_sub(1, SeqCst);
}

/// `py.detach(f)`, but the thread never attaches again after the interpreter began exiting
/// (it parks instead; see the module docs).
pub fn detach<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    let out = py.detach(move || {
        let out = f();
        enter();
        out
    });
    leave();
    out
}

/// `Python::try_attach(f)` for threads gpuio started: `None` where the interpreter is gone;
/// parks for good once it began exiting (see the module docs).
pub fn attach<R>(f: impl FnOnce(Python<'_>) -> R) -> Option<R> {
    enter();
    let out = Python::try_attach(f);
    leave();
    out
}

extern "C" fn forget_in_child() {
    // A child of fork() has only the forking thread: no other thread is attaching there, and
    // the interpreter is not exiting. Async-signal-safe: atomic stores.
    ATTACHING.store(0, SeqCst);
    EXITING.store(false, SeqCst);
}

/// Registers the fork handler that resets the counters in a child (once, at module import).
pub fn register_fork_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handler is a plain function that only stores to atomics, which is allowed
        // in a child between fork and exec.
        unsafe { libc::pthread_atfork(None, None, Some(forget_in_child)) };
    });
}

/// Registered with `atexit` by `gpuio/__init__.py`: from now on only this thread attaches.
#[pyfunction]
pub fn _at_exit(py: Python<'_>) {
    let _ = EXIT_THREAD.set(std::thread::current().id());
    EXITING.store(true, SeqCst);
    // Let the threads already past the check attach and go (they need the GIL to).
    py.detach(|| {
        while ATTACHING.load(SeqCst) != 0 {
            std::thread::yield_now();
        }
    });
}
