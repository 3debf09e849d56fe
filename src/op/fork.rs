//! Engines do not survive `fork()`: the child has the parent's memory but none of its threads,
//! so an inherited engine's reactor is not running there, and its io_uring ring is the
//! parent's (shared mappings a child's submission would corrupt). Before this check, a child
//! that used an inherited engine waited for good on any read the reactor had to serve.
//!
//! Every process counts its forks (a `pthread_atfork` child handler, registered when the first
//! engine is built); an engine records the count it was built under, and one that sees another
//! count refuses every operation with [`Error::Unsupported`](crate::Error::Unsupported) naming
//! the fix, and its drop in the child leaves the parent's reactor, ring and pool alone.

use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};

static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork_in_child() {
    // Async-signal-safe: one atomic add.
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// The process's fork count now, registering the child handler on first use.
pub(crate) fn generation() -> u64 {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // SAFETY: the handler is a plain `extern "C"` function with no captured state that
        // only touches an atomic, which is allowed in a child between fork and exec.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(count_fork_in_child)) };
        if rc != 0 {
            tracing::warn!(
                rc,
                "pthread_atfork failed: gpuio cannot tell an engine inherited across fork()"
            );
        }
    });
    FORKS.load(Ordering::SeqCst)
}

/// Whether the process has forked since `built` was read (this is a child of the process
/// that built the engine).
pub(crate) fn inherited(built: u64) -> bool {
    FORKS.load(Ordering::Relaxed) != built
}

/// Why an inherited engine refuses an operation.
pub(crate) fn refusal_reason() -> String {
    format!(
        "this engine was created before fork() in a parent of process {} and cannot be used \
         in the child (its reactor thread does not exist here): create a new gpuio Engine \
         in the child, or start workers with the \"spawn\" or \"forkserver\" method",
        std::process::id()
    )
}
