//! An engine's reactor threads, and which one serves each op.
//!
//! One reactor thread submits and completes every piece of its ops. Where that thread is the
//! limit (small O_DIRECT reads at high depth, where it spends about what fio's whole job
//! spends per read), an engine can run several ([`EngineBuilder::reactors`]): each has its own
//! queue, ring, op table and share of the bounce pool, so they share no lock and no line on
//! the I/O path.
//!
//! # Which reactor takes an op
//! A reactor's range fence (`reactor::fence`) orders the overlapping pieces that reactor
//! started; pieces on different reactors are not ordered. The routing therefore keeps every
//! pair the fence must order on one reactor:
//! - a file's writes and syncs go to its *home* reactor (from the file's identity, the
//!   fence's own key), and so do stream-ordered ops and every op on an NVMe namespace;
//! - a read goes home while a write of the file is unfinished (`PendingWrites`: counted on
//!   the caller's thread before the write's future exists, released when its reactor has
//!   finished the op, however it ended), so it waits behind overlapping write pieces still in
//!   the kernel exactly as with one reactor;
//! - other reads take the reactors in turn, per calling thread, so a single task keeping many
//!   reads in flight spreads them too, and no counter line moves between threads.
//!
//! A read that found no write pending and a write that starts after it are concurrent, which
//! one reactor does not order either (reads hold no range). So with any number of reactors a
//! completed write holds the file's bytes, a later read sees them, and what a dropped write
//! left in the kernel never lands after a later overlapping op.
//!
//! [`EngineBuilder::reactors`]: super::EngineBuilder::reactors

use std::cell::Cell;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::op::engine_shared::EngineShared;
use crate::target::{FileKey, Target};

/// One reactor thread and the handle its ops use.
pub(super) struct ReactorThread {
    pub(super) shared: Arc<EngineShared>,
    /// Joined when the engine's last handle goes.
    pub(super) thread: Option<JoinHandle<()>>,
    /// Disconnects when the thread ends.
    pub(super) exit: Mutex<Receiver<()>>,
}

/// What an op needs from the routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// A read: any reactor, unless a write of the file is unfinished.
    Read,
    /// A write, a sync, a stream-ordered op: the file's home reactor.
    Home,
}

/// The reactor (index) that takes an op of `route` on `target`, among `n`; for a read sent
/// away from its file's home, also the home, where the read goes instead if a write of the
/// file is unfinished at its first poll (`OpFuture::with_home`: the moment the op starts).
pub(super) fn pick(n: usize, target: &Target, route: Route) -> (usize, Option<usize>) {
    if n == 1 {
        return (0, None);
    }
    let home = home(&target.fence_key, n);
    if route == Route::Home || target.nvme.is_some() {
        return (home, None);
    }
    thread_local! {
        static TURN: Cell<usize> = const { Cell::new(0) };
    }
    let turn = TURN
        .try_with(|t| {
            let i = t.get().wrapping_add(1);
            t.set(i);
            i % n
        })
        .unwrap_or(home);
    (turn, (turn != home).then_some(home))
}

/// A file's home reactor: the same for every handle on the file (device and inode).
fn home(key: &FileKey, n: usize) -> usize {
    // A multiplicative mix of both halves: inodes of one directory are often consecutive.
    let h = (key.dev ^ key.ino.rotate_left(29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    ((h >> 32) % n as u64) as usize
}

/// Closes every reactor's queue (they drain at once, side by side), then joins each within
/// `wait` in all; a reactor still draining past it finishes in the background.
pub(super) fn close_and_join(reactors: &mut [ReactorThread], wait: Duration) {
    for r in reactors.iter() {
        r.shared.reactor.close();
    }
    let deadline = Instant::now() + wait;
    for r in reactors.iter_mut() {
        let Some(t) = r.thread.take() else { continue };
        if t.thread().id() == std::thread::current().id() {
            continue;
        }
        // A drain takes microseconds to milliseconds (pieces in the kernel complete). Work
        // that cannot be seen to end soon (a CUDA stream still busy with a kernel, a hung
        // device) must not block the dropping thread, often an async runtime's worker.
        let exit = r.exit.lock().unwrap_or_else(|p| p.into_inner());
        match exit.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Err(RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    waited_ms = wait.as_millis() as u64,
                    "gpuio engine dropped while its reactor still drains (CUDA work or I/O \
                     that has not ended); it finishes in the background"
                );
            }
            _ => {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{FileKey, Route, home, pick};
    use crate::op::future::{NoTransfer, OpFuture};
    use crate::op::request::{OpRequest, PendingWrite};
    use std::sync::Arc;

    #[test]
    fn a_file_has_one_home_and_files_spread() {
        let n = 4;
        let mut seen = [0usize; 4];
        for ino in 0..400u64 {
            let key = FileKey { dev: 2049, ino };
            let h = home(&key, n);
            assert_eq!(h, home(&key, n));
            seen[h] += 1;
        }
        // Consecutive inodes land on every reactor, none with most of them.
        assert!(seen.iter().all(|&c| (50..=150).contains(&c)), "{seen:?}");
    }

    /// Reads take the reactors in turn; writes and syncs go home; a read sent away goes home
    /// instead when a write of its file is unfinished at its first poll, and only then.
    #[test]
    fn reads_go_home_while_a_write_of_the_file_is_unfinished() {
        let n = 4;
        let engine = crate::Engine::builder()
            .reactors(n)
            .build()
            .expect("an engine of four reactors");
        assert_eq!(engine.reactors(), n);
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("routed");
        std::fs::write(&path, vec![7u8; 1 << 16]).expect("the file is written");
        let file = crate::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&engine, &path)
            .expect("the file opens");
        let target = file.target_arc();
        let home_at = home(&target.fence_key, n);
        let turns: std::collections::HashSet<usize> =
            (0..n).map(|_| pick(n, target, Route::Read).0).collect();
        assert_eq!(turns.len(), n, "reads take every reactor in turn");
        assert_eq!(pick(n, target, Route::Home), (home_at, None));
        for _ in 0..n {
            let (at, h) = pick(n, target, Route::Read);
            assert_eq!(
                h.is_some(),
                at != home_at,
                "a read away from home knows its home"
            );
        }
        let rs = &engine.inner.reactors;
        // A read routed away from home, polled once with and once without a write pending.
        let away = |pending: bool| {
            let (at, h) = loop {
                let (at, h) = engine.reactor_for(target, Route::Read);
                if h.is_some() {
                    break (at.clone(), h);
                }
            };
            let write = pending
                .then(|| PendingWrite::new(&engine.shared().writes_pending, &target.fence_key));
            let mut fut = OpFuture::new(
                at,
                OpRequest::Sync {
                    file: target.clone(),
                },
                NoTransfer,
            )
            .with_home(h);
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            let _ = std::future::Future::poll(std::pin::Pin::new(&mut fut), &mut cx);
            let went_home = Arc::ptr_eq(fut.engine(), &rs[home_at].shared);
            drop(write);
            went_home
        };
        assert!(away(true), "a write was unfinished: the read must go home");
        assert!(!away(false), "no write: the read stays where it was sent");
    }
}
