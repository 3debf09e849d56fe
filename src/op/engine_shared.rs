//! [`EngineShared`]: what every engine handle and future of one engine share. The reactor's
//! channel, the bounce arena the futures copy out of, the registry of unfinished writes, the
//! engine's policy for ops and its counters, each a field of its own.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

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
}

impl Default for OpPolicy {
    fn default() -> Self {
        OpPolicy {
            cached_fast_path: true,
        }
    }
}

/// Counters the engine reports (`Engine::cached_reads`, `Engine::occupancy`).
#[derive(Default)]
pub(crate) struct EngineStats {
    /// Reads the polling thread served from the page cache.
    pub(crate) cached_reads: AtomicU64,
    /// Where pieces spent their time (`op::occupancy`), published by the reactor.
    pub(crate) occupancy: OccupancyTotals,
    /// Tests only: turns of the reactor's loop, to see whether an idle reactor sleeps.
    #[cfg(test)]
    pub(crate) turns: std::sync::atomic::AtomicUsize,
}

/// The part of an engine every handle and future shares.
pub(crate) struct EngineShared {
    /// The channel to the reactor.
    pub(crate) reactor: ReactorHandle,
    /// The bounce slots futures copy read data out of and write data into.
    pub(crate) arena: Arc<BounceArena>,
    /// Writes whose futures exist and whose ops the reactor has not finished, per file
    /// (`request::PendingWrite`).
    pub(crate) writes_pending: Arc<PendingWrites>,
    pub(crate) policy: OpPolicy,
    pub(crate) stats: EngineStats,
}

impl EngineShared {
    pub(crate) fn new(reactor: ReactorHandle, arena: Arc<BounceArena>, policy: OpPolicy) -> Self {
        EngineShared {
            reactor,
            arena,
            writes_pending: Arc::new(PendingWrites::new()),
            policy,
            stats: EngineStats::default(),
        }
    }
}
