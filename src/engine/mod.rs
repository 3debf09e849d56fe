//! [`Engine`]: a handle to one reactor thread and its bounce pool.

use std::sync::Arc;

use crate::error::{Error, OpKind, Result};
use crate::op::engine_shared::EngineShared;
use crate::op::future::{NoTransfer, OpFuture};
use crate::op::msg::{Msg, SubmitMsg};
use crate::plan::sizing::Sizing;
use crate::target::{FileKey, GdsMode, Target};

mod builder;
pub use builder::EngineBuilder;
mod reactors;
use reactors::ReactorThread;
pub(crate) use reactors::Route;

/// The reactor's default tick (see [`EngineBuilder::reactor_tick`]).
pub const DEFAULT_REACTOR_TICK: std::time::Duration = std::time::Duration::from_micros(100);

/// How long a request waits for bounce memory that nothing in flight can give back before the
/// pool grows or the request fails (see [`EngineBuilder::pool_wait_limit`]). Live futures
/// give slots back within microseconds of being polled; five seconds without any is a leak
/// or a future its owner stopped polling, not load.
pub const DEFAULT_POOL_WAIT_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Which interface serves an engine's I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Backend {
    /// io_uring where it can be set up, else the pread pool (and the reason is recorded); for
    /// device memory, cuFile per file where it registers the file, else the bounce path (see
    /// [`crate::gds`]).
    #[default]
    Auto,
    /// io_uring only; building the engine fails where it is unavailable. No cuFile.
    Uring,
    /// The pread/pwrite thread pool. No cuFile.
    Pread,
    /// cuFile for every device-memory transfer: opening a file fails where cuFile cannot
    /// register it, and cuFile errors are reported instead of falling back. Host-memory
    /// transfers use io_uring (or the pread pool).
    Gds,
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Backend::Auto),
            "uring" | "io_uring" => Ok(Backend::Uring),
            "pread" => Ok(Backend::Pread),
            "gds" | "cufile" => Ok(Backend::Gds),
            other => Err(format!(
                "unknown backend {other:?} (auto, uring, pread, gds)"
            )),
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Auto => "auto",
            Backend::Uring => "uring",
            Backend::Pread => "pread",
            Backend::Gds => "gds",
        })
    }
}

/// What an engine runs on, and why.
#[derive(Debug, Clone)]
pub struct BackendInfo {
    /// `io_uring` or `pread`.
    pub name: &'static str,
    /// Flags, buffer registration, and for a fallback the reason io_uring was not used.
    pub detail: String,
}

/// How long dropping the last engine handle waits for its reactor to drain and exit before
/// leaving it to finish in the background (`Engine::shutdown` waits for good).
const REACTOR_JOIN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Aligned to a cache line: the `Arc`'s counts, which every `File` clone changes, share no
/// line with the handle's fields.
#[repr(align(64))]
struct EngineInner {
    /// The reactor threads; the first is the primary, whose handle serves what is not an op of
    /// a reactor's (the page-cache fast path, mapped reads, stream waits, the counters).
    reactors: Box<[ReactorThread]>,
    info: BackendInfo,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    gds_mode: GdsMode,
    cufile_compat: bool,
    bounce_bytes: usize,
    sizing: Sizing,
}

impl EngineInner {
    fn primary(&self) -> &Arc<EngineShared> {
        &self.reactors[0].shared
    }
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        // Last handle gone: close the queues and wake the reactors, which drain (operations
        // still pending fail with `Error::Shutdown`) and exit; then join them, so that their
        // rings and workers are gone when this returns and their pools are on their way out
        // (a pinned pool is unpinned on a thread of its own, `buf::arena`; memory a device may
        // still write is quarantined instead, see `reactor::death`).
        if self.primary().reactor.inherited() {
            // A forked child: the reactor threads, their rings and pools are the parent's (the
            // threads do not exist here). Waking or joining them would wait for nothing, and
            // freeing the pools would unpin memory the parent's CUDA context owns: leave all
            // of it to the process's exit.
            for r in self.reactors.iter_mut() {
                if let Some(t) = r.thread.take() {
                    std::mem::forget(t);
                }
            }
            return;
        }
        // Mapped reads first: revoke the registrations no copy has used, wait for the copies
        // that read the others, unregister everything.
        #[cfg(feature = "cuda")]
        if let Some(r) = self.primary().started_registrar() {
            r.close(REACTOR_JOIN_WAIT);
        }
        reactors::close_and_join(&mut self.reactors, REACTOR_JOIN_WAIT);
    }
}

/// A handle to one reactor thread. Cheap to clone; `Send + Sync`.
///
/// The reactor stops when [`shutdown`](Engine::shutdown) is awaited or the last handle (engines
/// and files) is dropped; either way everything in flight is cancelled and drained first.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.inner.info.name)
            .field("buffered_chunk", &self.inner.sizing.buffered_chunk)
            .field("direct_chunk", &self.inner.sizing.direct_chunk)
            .field("queue_depth", &self.inner.sizing.queue_depth)
            .finish()
    }
}

impl Engine {
    /// Settings for a new engine.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    /// An engine with default settings.
    pub fn new() -> Result<Engine> {
        Engine::builder().build()
    }

    /// Which backend serves this engine and why.
    pub fn backend(&self) -> &BackendInfo {
        &self.inner.info
    }

    /// Largest piece in bytes, over every path (O_DIRECT files size their alignment checks
    /// against it).
    pub fn chunk_size(&self) -> usize {
        self.inner
            .sizing
            .buffered_chunk
            .max(self.inner.sizing.direct_chunk)
    }

    /// Queue depth.
    pub fn queue_depth(&self) -> usize {
        self.inner.sizing.queue_depth
    }

    /// What this engine was built with, and why (the defaults are sized from the machine).
    pub fn sizing(&self) -> &Sizing {
        &self.inner.sizing
    }

    /// Bytes of bounce memory.
    pub fn bounce_bytes(&self) -> usize {
        self.inner.bounce_bytes
    }

    /// Readies the engine for transfers into and out of GPU memory: page-locks the bounce
    /// pool with CUDA now (`ctx` is any context; the registration is portable across them).
    /// Otherwise the first device transfer does it, and a large pool's registration (and the
    /// first touch of its pages) is then part of that transfer's time: a service that loads
    /// a checkpoint on request calls this at start-up. Returns whether the pool is pinned;
    /// where the driver refuses, device copies still work from pageable memory, slower.
    #[cfg(feature = "cuda")]
    pub fn prepare_device(&self, ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> bool {
        // Every reactor's pool is pinned (no short cut: all are tried, then all are asked).
        for r in self.inner.reactors.iter() {
            r.shared.arena.ensure_pinned(ctx);
        }
        self.inner
            .reactors
            .iter()
            .all(|r| r.shared.arena.is_pinned())
    }

    /// Whether the bounce pool is page-locked with CUDA (it is pinned on the first device
    /// transfer or by [`prepare_device`](Self::prepare_device); `false` before that, on
    /// machines without CUDA, or where the driver refused).
    pub fn bounce_pool_pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.inner
                .reactors
                .iter()
                .all(|r| r.shared.arena.is_pinned())
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Small reads (into host or device memory) so far that the polling thread served straight from the
    /// page cache, without the reactor (see [`EngineBuilder::page_cache_fast_path`]).
    pub fn cached_reads(&self) -> u64 {
        self.inner.primary().stats.cached_reads.load()
    }

    /// Reads into device memory so far copied straight from registered page-cache mappings
    /// (see [`EngineBuilder::mapped_reads`]).
    pub fn mapped_reads(&self) -> u64 {
        #[cfg(feature = "cuda")]
        if let Some(r) = self.inner.primary().started_registrar() {
            return r.counts().served.load(std::sync::atomic::Ordering::Relaxed);
        }
        0
    }

    /// Page-cache ranges registered with the driver for this engine's mapped reads right now:
    /// copies in flight, plus registrations whose futures have not taken them yet. For tests.
    #[doc(hidden)]
    pub fn mapped_registrations_live(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(r) = self.inner.primary().started_registrar() {
            return r.counts().live.load(std::sync::atomic::Ordering::Relaxed);
        }
        0
    }

    /// Pieces of mapped reads (at most 64 MiB each) handed to this engine's registrar so far,
    /// served or not. For tests.
    #[doc(hidden)]
    pub fn mapped_reads_submitted(&self) -> u64 {
        #[cfg(feature = "cuda")]
        if let Some(r) = self.inner.primary().started_registrar() {
            return r
                .counts()
                .submitted
                .load(std::sync::atomic::Ordering::Relaxed);
        }
        0
    }

    /// Where this engine's pieces have spent their time so far: take two and subtract
    /// ([`Occupancy::since`](crate::Occupancy::since)) for the pieces the kernel held on
    /// average, the slot releases waiting behind CUDA events, and the share of the time work
    /// waited for bounce memory (`gpuio bench`, `gpuio read` and the `load_safetensors`
    /// example print them). Published by the reactor about once a millisecond; only time in
    /// which the engine had work is counted, so a pause before a read does not dilute it.
    /// With several reactors, their pieces add up (see [`Occupancy::merge`](crate::Occupancy::merge)).
    pub fn occupancy(&self) -> crate::op::occupancy::Occupancy {
        let mut rs = self.inner.reactors.iter();
        let first = rs.next().map(|r| r.shared.stats.occupancy.snapshot());
        rs.fold(first.unwrap_or_default(), |all, r| {
            all.merge(&r.shared.stats.occupancy.snapshot())
        })
    }

    /// Fault injection for tests: the reactor panics at its next completion, as a bug would
    /// make it, so tests can check what a dying reactor leaves behind. Not for production use.
    #[doc(hidden)]
    pub fn inject_reactor_panic(&self) {
        for r in self.inner.reactors.iter() {
            r.shared
                .reactor
                .send(crate::op::msg::Msg::PanicAtNextCompletion);
        }
    }

    /// Whether this process is a child, made by `fork()`, of the process that built the
    /// engine. Such an engine refuses every operation with
    /// [`Error::Unsupported`](crate::Error::Unsupported) (its reactor thread did not survive
    /// the fork) and its drop leaves the parent's reactor and pool alone; bindings that run
    /// their own threads for it (the C API's executor) check this before using them.
    pub fn inherited_across_fork(&self) -> bool {
        self.inner.primary().reactor.inherited()
    }

    /// Whether the reactor has stopped (after shutdown, or because it died); with several
    /// reactors, whether any has.
    pub fn is_shut_down(&self) -> bool {
        self.inner
            .reactors
            .iter()
            .any(|r| r.shared.reactor.is_dead())
    }

    /// Why the reactor died, if it did: its panic message or the kernel interface that
    /// failed. `None` while it runs and after an orderly [`shutdown`](Self::shutdown). A dead
    /// engine fails every pending and later operation with
    /// [`Error::ReactorDied`](crate::Error::ReactorDied) carrying this reason; open a new one.
    ///
    /// With several reactors ([`EngineBuilder::reactors`]) each dies alone: its operations fail,
    /// and this gives the first reason found.
    pub fn failure(&self) -> Option<&str> {
        self.inner
            .reactors
            .iter()
            .find_map(|r| r.shared.reactor.death())
    }

    /// Whether the bounce pool is SPDK DMA memory ([`EngineBuilder::spdk_memory`]).
    pub fn bounce_pool_is_dma(&self) -> bool {
        self.inner.primary().arena.is_dma()
    }

    /// Stops the reactor (every reactor): new operations fail with [`Error::Shutdown`],
    /// operations in flight are cancelled and drained, then the rings and the bounce pools are
    /// released. Resolves when that is done.
    pub async fn shutdown(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(r) = self.inner.primary().started_registrar() {
            r.begin_close();
        }
        // Each reactor gets its message at the first poll, so they drain side by side.
        let stops = self.inner.reactors.iter().map(|r| {
            OpFuture::with_message(
                r.shared.clone(),
                OpKind::Shutdown,
                NoTransfer,
                Msg::Shutdown(SubmitMsg {
                    shared: None,
                    req: None,
                }),
            )
        });
        let outcomes = futures::future::join_all(stops).await;
        let mut first_err = None;
        for (outcome, r) in outcomes.into_iter().zip(self.inner.reactors.iter()) {
            let outcome = match outcome {
                Ok(_) => Ok(()),
                // Already stopped: that is what was asked for, unless the reactor died.
                Err(Error::Shutdown { ctx }) => match r.shared.reactor.refusal(*ctx) {
                    Error::Shutdown { .. } => Ok(()),
                    died => Err(died),
                },
                Err(e) => Err(e),
            };
            if let Err(e) = outcome {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Waits until `stream` has finished everything queued on it so far, without blocking a
    /// thread: the reactor polls an event recorded now and wakes the task. Use it instead of
    /// `stream.synchronize()` inside async code (a tokio worker parked in
    /// `cuStreamSynchronize` stalls every task scheduled on it).
    #[cfg(feature = "cuda")]
    pub fn synchronize(&self, stream: &cudarc::driver::CudaStream) -> crate::op::sync::StreamSync {
        crate::op::sync::start(self.inner.primary(), stream)
    }

    /// Most bounce bytes one operation may hold; batches keep their reads in flight within it.
    pub(crate) fn op_window(&self) -> usize {
        crate::reactor::op_window(&self.inner.primary().arena, self.inner.reactors.len())
    }

    /// The primary reactor's handle: the engine's policy, counters and fast paths.
    pub(crate) fn shared(&self) -> &Arc<EngineShared> {
        self.inner.primary()
    }

    /// The handle of the reactor that takes an op of `route` on `target`, and for a read
    /// sent away from the file's home reactor, the home (`reactors`: keeps every pair of ops
    /// the range fence must order on one reactor; see `OpFuture::with_home`).
    pub(crate) fn reactor_for(
        &self,
        target: &Target,
        route: Route,
    ) -> (&Arc<EngineShared>, Option<(Arc<EngineShared>, FileKey)>) {
        let rs = &self.inner.reactors;
        let (pick, home) = reactors::pick(rs.len(), target, route);
        (
            &rs[pick].shared,
            home.map(|h| (rs[h].shared.clone(), target.fence_key)),
        )
    }

    /// Reactor threads this engine runs ([`EngineBuilder::reactors`]).
    pub fn reactors(&self) -> usize {
        self.inner.reactors.len()
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn gds_mode(&self) -> GdsMode {
        self.inner.gds_mode
    }

    /// Whether AUTO may use compatibility-mode cuFile ([`EngineBuilder::cufile_compat`]).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn cufile_compat(&self) -> bool {
        self.inner.cufile_compat
    }
}
