//! The quarantine: memory and handles that must never be freed because a device or the kernel
//! may still write them (I/O in flight when a reactor died, a CUDA copy whose event never
//! completed). What goes in is held by a process-wide list that is never dropped, and named,
//! so a leak is a deliberate, counted decision rather than a `mem::forget` somewhere.

use std::any::Any;
use std::sync::Mutex;

/// One quarantined thing: what it is and why it is held.
struct Held {
    what: String,
    _thing: Box<dyn Any + Send>,
}

/// Everything quarantined in this process. A `static` is never dropped, so nothing in it is
/// ever freed.
static QUARANTINE: Mutex<Vec<Held>> = Mutex::new(Vec::new());

/// Holds `thing` for the life of the process: it is never dropped (so never freed, unmapped,
/// unpinned or deregistered). `what` names it in [`quarantined`] and in the log.
pub(crate) fn hold(what: impl Into<String>, thing: impl Any + Send) {
    let what = what.into();
    tracing::error!(%what, "gpuio quarantines memory that I/O may still touch (leaked, never freed)");
    QUARANTINE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(Held {
            what,
            _thing: Box::new(thing),
        });
}

/// What this process has quarantined so far, one line each (empty in a healthy process).
pub fn quarantined() -> Vec<String> {
    QUARANTINE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|h| h.what.clone())
        .collect()
}
