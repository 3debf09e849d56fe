//! [`Progress`]: bytes a long load or save has moved so far, for progress bars and callbacks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes an operation (a batch, a checkpoint load or save) has moved so far, out of how many.
///
/// Share one in an `Arc` between the operation and whoever reports on it (a progress bar
/// thread, a Python callback): the operation adds to [`done`](Self::done) as pieces reach the
/// destination (read data copied out of, or handed to a device copy from, the bounce memory;
/// write data copied into it) and to [`total`](Self::total) as it plans its work. Both only
/// grow, so readers need no lock and see a monotone count; `done` reaches `total` when
/// everything planned has moved.
#[derive(Debug, Default)]
pub struct Progress {
    done: AtomicU64,
    total: AtomicU64,
}

impl Progress {
    /// A new count at zero of zero, in an `Arc` to share.
    pub fn new() -> Arc<Progress> {
        Arc::new(Progress::default())
    }

    /// Bytes moved so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Bytes planned so far.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Adds `n` bytes to the planned total.
    pub fn add_total(&self, n: u64) {
        self.total.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds `n` bytes to the count moved.
    pub fn add_done(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }
}

/// One op's share of a [`Progress`]: it adds at most `len` bytes, the op's own range, however
/// its pieces straddle the range's ends.
pub(crate) struct OpProgress {
    progress: Arc<Progress>,
    len: u64,
    counted: u64,
}

impl OpProgress {
    pub(crate) fn new(progress: &Arc<Progress>, len: u64) -> Self {
        OpProgress {
            progress: progress.clone(),
            len,
            counted: 0,
        }
    }

    /// `n` more bytes moved.
    pub(crate) fn add(&mut self, n: u64) {
        let n = n.min(self.len - self.counted);
        if n > 0 {
            self.counted += n;
            self.progress.add_done(n);
        }
    }

    /// The op finished having moved `moved` bytes in all: counts what the pieces did not
    /// (paths that move data without handing pieces to the future, such as cuFile's).
    pub(crate) fn finish(&mut self, moved: u64) {
        self.add(moved.saturating_sub(self.counted));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_op_counts_no_more_than_its_range() {
        let p = Progress::new();
        p.add_total(100);
        let mut op = OpProgress::new(&p, 100);
        op.add(60);
        op.add(60); // a piece straddling the range's end
        assert_eq!(p.done(), 100);
        op.finish(100);
        assert_eq!(p.done(), 100);
        let mut short = OpProgress::new(&p, 50);
        short.finish(20); // a short read at end of file
        assert_eq!((p.done(), p.total()), (120, 100));
    }
}
