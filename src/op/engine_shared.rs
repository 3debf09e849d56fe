//! [`EngineShared`]: what every engine handle and future of one engine share. The reactor's
//! channel, the bounce arena the futures copy out of, the registry of unfinished writes, the
//! engine's policy for ops and its counters, each a field of its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::msg::ReactorHandle;
use super::occupancy::OccupancyTotals;
use super::request::PendingWrites;
use crate::buf::arena::BounceArena;

/// How ops behave, fixed when the engine is built (`EngineBuilder`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpPolicy {
    /// Small host reads may be served straight from the page cache by the polling thread
    /// (`op::cached`); off, every read goes through the reactor.
    pub(crate) cached_fast_path: bool,
    /// Large warm reads into device memory DMA'd straight from registered page-cache
    /// mappings (`op::mapped`); off, they take the bounce path.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) mapped_reads: bool,
    /// Largest read into host memory the polling thread serves straight from the page cache
    /// (`op::cached`), in pieces of at most [`HOST_POLL_PIECE`](super::cached::HOST_POLL_PIECE)
    /// per poll.
    pub(crate) host_cached_max: usize,
    /// Blocking reads of buffered files land in place in the caller's memory
    /// (`Sizing::lends_buffered_reads`); off, they take `read_into`'s path.
    pub(crate) lend_buffered: bool,
}

impl OpPolicy {
    /// The largest read the polling thread tries to serve from the page cache: into host
    /// memory `host_cached_max`, into device memory (through a per-thread stage)
    /// [`CACHED_READ_MAX`](super::cached::CACHED_READ_MAX).
    pub(crate) fn cached_read_max(&self, into_host: bool) -> usize {
        if into_host {
            self.host_cached_max
        } else {
            super::cached::CACHED_READ_MAX
        }
    }
}

impl Default for OpPolicy {
    fn default() -> Self {
        OpPolicy {
            cached_fast_path: true,
            mapped_reads: false,
            host_cached_max: super::cached::HOST_CACHED_READ_MAX,
            lend_buffered: true,
        }
    }
}

/// Counters the engine reports (`Engine::cached_reads`, `Engine::occupancy`).
#[derive(Default)]
pub(crate) struct EngineStats {
    /// Reads the polling thread served from the page cache.
    pub(crate) cached_reads: StripedCounter,
    /// Where pieces spent their time (`op::occupancy`), published by the reactor.
    pub(crate) occupancy: OccupancyTotals,
    /// Tests only: turns of the reactor's loop, to see whether an idle reactor sleeps.
    #[cfg(test)]
    pub(crate) turns: std::sync::atomic::AtomicUsize,
}

/// The part of an engine every handle and future shares. Aligned to a cache line so that
/// the `Arc`'s counts, which every clone and drop changes, share no line with the fields
/// each operation reads.
#[repr(align(64))]
pub(crate) struct EngineShared {
    /// The channel to the reactor.
    pub(crate) reactor: ReactorHandle,
    /// The bounce slots futures copy read data out of and write data into.
    pub(crate) arena: Arc<BounceArena>,
    /// Writes whose futures exist and whose ops the reactor has not finished, per file
    /// (`request::PendingWrite`).
    pub(crate) writes_pending: Arc<PendingWrites>,
    /// Page-cache copies in flight in all of the engine's reactors together: a reactor past
    /// its share of the cap borrows what the others leave (`Reactor::copies_free`).
    pub(crate) page_cache_copies: Arc<AtomicUsize>,
    pub(crate) policy: OpPolicy,
    pub(crate) stats: EngineStats,
    /// Pinned memory batches into device memory stage page-cache reads in (`cuda::stage`).
    #[cfg(feature = "cuda")]
    pub(crate) stages: Arc<crate::cuda::stage::StagePool>,
    /// The thread that registers page-cache mappings for mapped reads, started at the first
    /// one (`None` inside: it could not be started).
    #[cfg(feature = "cuda")]
    registrar: std::sync::OnceLock<Option<Arc<crate::cuda::mapped::Registrar>>>,
}

impl EngineShared {
    pub(crate) fn new(reactor: ReactorHandle, arena: Arc<BounceArena>, policy: OpPolicy) -> Self {
        EngineShared {
            reactor,
            arena,
            writes_pending: Arc::new(PendingWrites::new()),
            page_cache_copies: Arc::default(),
            policy,
            stats: EngineStats::default(),
            #[cfg(feature = "cuda")]
            stages: Arc::default(),
            #[cfg(feature = "cuda")]
            registrar: std::sync::OnceLock::new(),
        }
    }

    /// The handle of another reactor of the same engine (`EngineBuilder::reactors`): its own
    /// queue, pool and counters; this one's policy, registry of unfinished writes (which routes
    /// reads of a file being written to its home reactor), count of page-cache copies and
    /// device stages.
    pub(crate) fn sibling(&self, reactor: ReactorHandle, arena: Arc<BounceArena>) -> Self {
        EngineShared {
            reactor,
            arena,
            writes_pending: self.writes_pending.clone(),
            page_cache_copies: self.page_cache_copies.clone(),
            policy: self.policy,
            stats: EngineStats::default(),
            #[cfg(feature = "cuda")]
            stages: self.stages.clone(),
            #[cfg(feature = "cuda")]
            registrar: std::sync::OnceLock::new(),
        }
    }

    /// The mapped reads' registrar, started now if it was not (`None`: mapped reads are off,
    /// or its thread could not be started).
    #[cfg(feature = "cuda")]
    pub(crate) fn registrar(&self) -> Option<&Arc<crate::cuda::mapped::Registrar>> {
        if !self.policy.mapped_reads {
            return None;
        }
        self.registrar
            .get_or_init(|| match crate::cuda::mapped::Registrar::start() {
                Ok(r) => Some(Arc::new(r)),
                Err(e) => {
                    tracing::warn!(error = %e, "mapped reads off: the registrar's thread did not start");
                    None
                }
            })
            .as_ref()
    }

    /// The registrar if it was started (without starting it).
    #[cfg(feature = "cuda")]
    pub(crate) fn started_registrar(&self) -> Option<&Arc<crate::cuda::mapped::Registrar>> {
        self.registrar.get().and_then(Option::as_ref)
    }
}

/// Stripes of a [`StripedCounter`]: more than the threads that usually poll at once.
const STRIPES: usize = 16;

/// The calling thread's stripe, fixed for its life (a thread being torn down gets the first).
fn thread_stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    MINE.try_with(|m| *m).unwrap_or(0)
}

/// Threads inside a short section ([`enter`](Self::enter) to the guard's drop), counted on
/// each thread's stripe, so that one thread can wait until every thread that entered before
/// some point has left ([`wait_empty`](Self::wait_empty)) without the section writing a line
/// every thread shares. `ReactorHandle::send` is the section: see its `settle_sends`.
#[derive(Default)]
pub(crate) struct StripedPresence([Stripe; STRIPES]);

/// A thread's presence in a [`StripedPresence`], ended by dropping it.
pub(crate) struct Present<'a>(&'a AtomicU64);

impl StripedPresence {
    /// Enters the section. The count is sequentially consistent, so that a thread which then
    /// reads a flag as unset is seen inside by a `wait_empty` that began after the flag was
    /// set (the Dekker pattern: see `ReactorHandle`).
    pub(crate) fn enter(&self) -> Present<'_> {
        let stripe = &self.0[thread_stripe()].0;
        stripe.fetch_add(1, Ordering::SeqCst);
        Present(stripe)
    }

    /// Waits until no thread is inside (a thread that enters after a stripe was seen empty is
    /// not waited for). Sections are a few instructions long: spin, then yield.
    pub(crate) fn wait_empty(&self) {
        for s in &self.0 {
            let mut spins = 0u32;
            while s.0.load(Ordering::SeqCst) != 0 {
                if spins < 64 {
                    std::hint::spin_loop();
                    spins += 1;
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }
}

impl Drop for Present<'_> {
    fn drop(&mut self) {
        // Release: what the thread did inside is visible to a `wait_empty` that reads the
        // stripe back at zero.
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// A count many threads add to: each thread adds to a stripe of its own, a cache line apart,
/// so that counting does not move one line between the cores' caches on every 4 KiB read.
#[derive(Default)]
pub(crate) struct StripedCounter([Stripe; STRIPES]);

#[derive(Default)]
#[repr(align(128))]
struct Stripe(AtomicU64);

impl StripedCounter {
    /// A count at zero (for statics; `Default` gives the same). The statics are on the
    /// device paths, so a build without `cuda` has no caller.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) const fn new() -> Self {
        StripedCounter([const { Stripe(AtomicU64::new(0)) }; STRIPES])
    }

    /// Adds `n` on the calling thread's stripe.
    pub(crate) fn add(&self, n: u64) {
        self.0[thread_stripe()].0.fetch_add(n, Ordering::Relaxed);
    }

    /// The sum of every stripe (each read once: a moment's total, not a snapshot).
    pub(crate) fn load(&self) -> u64 {
        self.0.iter().map(|s| s.0.load(Ordering::Relaxed)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::{StripedCounter, StripedPresence};
    use std::sync::{Arc, mpsc};
    use std::time::Duration;

    #[test]
    fn waiting_for_presence_waits_for_whoever_is_inside() {
        let p = Arc::new(StripedPresence::default());
        let inside = p.enter();
        let (tx, rx) = mpsc::channel();
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || {
                p.wait_empty();
                tx.send(()).unwrap();
            })
        };
        assert!(
            rx.recv_timeout(Duration::from_millis(50)).is_err(),
            "returned while a thread was inside"
        );
        drop(inside);
        rx.recv_timeout(Duration::from_secs(10))
            .expect("returned once the thread left");
        waiter.join().unwrap();
        // Nobody inside: at once.
        p.wait_empty();
    }

    #[test]
    fn a_striped_count_adds_up_across_threads() {
        let c = StripedCounter::default();
        std::thread::scope(|s| {
            for _ in 0..40 {
                s.spawn(|| (0..1000).for_each(|_| c.add(1)));
            }
        });
        c.add(5);
        assert_eq!(c.load(), 40_005);
    }
}
