//! [`Engine`]: a handle to one reactor thread and its bounce pool.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, sync_channel};

use crate::buf::arena::{BounceArena, MIN_SLOT};
use crate::error::{Context, Error, OpKind, Result};
use crate::lane::Lane;
use crate::lane::doorbell::Doorbell;
use crate::lane::pread::PreadLane;
use crate::lane::uring::UringLane;
use crate::op::future::{NoTransfer, OpFuture};
use crate::op::msg::{Msg, ReactorHandle, SubmitMsg};
use crate::reactor::{Reactor, ReactorConfig};
use crate::target::GdsMode;

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

/// Settings for [`Engine`]. The defaults are the measured best on the machines in
/// BENCHMARKS.md (repository root): see each setting for its reason.
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    chunk_size: usize,
    queue_depth: usize,
    bounce_slots: usize,
    bounce_growth: Option<usize>,
    pool_wait_limit: std::time::Duration,
    backend: Backend,
    pread_threads: Option<usize>,
    punt_min: Option<usize>,
    spdk_memory: bool,
    cufile_compat: bool,
    reactor_spin: std::time::Duration,
    reactor_tick: std::time::Duration,
    /// Whether io_uring timed waits may use `IORING_ENTER_EXT_ARG` where the kernel has it
    /// (off in tests only: the timeout-SQE path that Linux 5.6–5.10 takes).
    uring_ext_arg: bool,
}

impl Default for EngineBuilder {
    fn default() -> Self {
        EngineBuilder {
            chunk_size: 4 << 20,
            queue_depth: 64,
            bounce_slots: 32,
            bounce_growth: None,
            pool_wait_limit: DEFAULT_POOL_WAIT_LIMIT,
            backend: Backend::Auto,
            pread_threads: None,
            punt_min: Some(64 << 10),
            spdk_memory: false,
            cufile_compat: false,
            reactor_spin: std::time::Duration::ZERO,
            reactor_tick: DEFAULT_REACTOR_TICK,
            uring_ext_arg: true,
        }
    }
}

impl EngineBuilder {
    /// Largest piece one I/O moves (default 4 MiB; a multiple of 4096, at most 1 GiB).
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.chunk_size = bytes;
        self
    }

    /// Most I/Os in the kernel at once (default 64).
    pub fn queue_depth(mut self, n: usize) -> Self {
        self.queue_depth = n;
        self
    }

    /// Bounce pool size in chunk-sized blocks (default 32, i.e. 128 MiB with 4 MiB chunks).
    /// Small requests take 4 KiB-granular pieces of a block, so this bounds bytes, not ops.
    pub fn bounce_slots(mut self, n: usize) -> Self {
        self.bounce_slots = n;
        self
    }

    /// How many blocks the bounce pool may grow by when futures that stopped polling
    /// (leaked with `mem::forget`, or never polled again) hold all of it (default: as many as
    /// `bounce_slots`, so the pool may double; 0: never grow). The growth is address space
    /// reserved at build time and costs memory only once used; it is never given back while
    /// the engine lives. Past it, requests that find no memory for
    /// [`pool_wait_limit`](Self::pool_wait_limit) fail with [`Error::PoolExhausted`] instead
    /// of waiting for good. Pools in SPDK's DMA heap do not grow.
    pub fn bounce_growth(mut self, blocks: usize) -> Self {
        self.bounce_growth = Some(blocks);
        self
    }

    /// How long a request may wait for bounce memory while nothing the engine has in flight
    /// can give any back (every slot held by futures that do not poll) before the pool grows
    /// or, grown to its limit, the waiting requests fail with [`Error::PoolExhausted`]
    /// (default [`DEFAULT_POOL_WAIT_LIMIT`]; at least 10 ms). The pool grows after a tenth of
    /// it. The engine cannot tell a leaked future from one its owner holds without polling: a
    /// program that keeps futures with bounce memory unpolled for longer than this (a stream
    /// whose consumer stalls, a worker thread blocked) while other requests wait sees those
    /// requests fail, not hang; raise the limit for such programs.
    pub fn pool_wait_limit(mut self, limit: std::time::Duration) -> Self {
        self.pool_wait_limit = limit;
        self
    }

    /// Allocates the bounce pool from SPDK's DMA heap (hugepages), which local PCIe NVMe
    /// drives opened with [`Engine::open_nvme`] need and NVMe/TCP can use. Starts SPDK's
    /// environment when the engine is built; fails with `Unsupported` where SPDK is missing.
    /// Default off: an anonymous mapping.
    pub fn spdk_memory(mut self, on: bool) -> Self {
        self.spdk_memory = on;
        self
    }

    /// Kernel interface (default [`Backend::Auto`]).
    pub fn backend(mut self, b: Backend) -> Self {
        self.backend = b;
        self
    }

    /// Whether [`Backend::Auto`] may use cuFile in *compatibility mode* (no nvidia-fs) for
    /// files opened with `direct` (default: no). Compatibility-mode cuFile does POSIX reads
    /// and host-to-device copies inside libcufile, which is what gpuio's bounce path does, and
    /// it measured slower on every workload tried (H200, same runs: 4 KiB random reads 0.70x,
    /// cold 4 MiB reads 0.97x, page-cache-warm reads 0.08x), so AUTO keeps the bounce path
    /// there and says why in [`File::gds_status`](crate::File::gds_status). With nvidia-fs
    /// loaded (true GPUDirect DMA) AUTO uses cuFile for `direct` files either way;
    /// [`Backend::Gds`] always uses cuFile.
    pub fn cufile_compat(mut self, on: bool) -> Self {
        self.cufile_compat = on;
        self
    }

    /// Threads of the pread pool, when it serves (default: the queue depth, at most 64).
    pub fn pread_threads(mut self, n: usize) -> Self {
        self.pread_threads = Some(n);
        self
    }

    /// Buffered I/O pieces of at least `bytes` are handed to io_uring's worker pool
    /// (`IOSQE_ASYNC`) so page-cache copies run on many cores at once; smaller ones are tried
    /// inline on the reactor thread. Default 64 KiB; `None` keeps everything inline.
    pub fn async_copy_threshold(mut self, bytes: Option<usize>) -> Self {
        self.punt_min = bytes;
        self
    }

    /// How long the reactor keeps looking for new requests and completions, without sleeping,
    /// after its last piece of work while operations are open (default: no spin). A sleeping
    /// reactor costs small requests thread wake-ups; spinning trades up to one core for them.
    /// Measured (BENCHMARKS.md, "Reactor spin"): 200 µs gave 4 KiB O_DIRECT random reads
    /// +10–20% on a 16-core machine with one runtime worker, and nothing measurable with
    /// sixteen; on a 2-core machine any spin lost IOPS (the spinning reactor takes the core the
    /// runtime needs). Worth trying for small-request services on large machines.
    pub fn reactor_spin(mut self, spin: std::time::Duration) -> Self {
        self.reactor_spin = spin;
        self
    }

    /// Longest the reactor sleeps while I/O is in the kernel before it looks at its queue and
    /// ring again on its own, rung or not (default [`DEFAULT_REACTOR_TICK`];
    /// `Duration::ZERO`: sleep until woken). With nothing in the kernel (an idle engine, or
    /// only leaked operations left) it sleeps until woken whatever this says. Measured on a
    /// 16-core H200 machine, 4 KiB O_DIRECT random reads at QD64: 102.7k IOPS without the
    /// tick, 115.4k with 100 µs, for +0.07 cores (BENCHMARKS.md, "Reactor tick"); a 200 µs
    /// spin gave the same for +0.45 cores.
    pub fn reactor_tick(mut self, tick: std::time::Duration) -> Self {
        self.reactor_tick = tick;
        self
    }

    /// Tests only: timed waits as on a kernel without `IORING_ENTER_EXT_ARG`.
    #[cfg(test)]
    pub(crate) fn without_ext_arg(mut self) -> Self {
        self.uring_ext_arg = false;
        self
    }

    /// Starts the reactor thread.
    pub fn build(self) -> Result<Engine> {
        let ctx = || Context::op(OpKind::Setup);
        if self.chunk_size < MIN_SLOT
            || self.chunk_size % MIN_SLOT != 0
            || self.chunk_size > 1 << 30
        {
            return Err(Error::invalid(
                ctx(),
                format!(
                    "chunk size {} must be a multiple of 4096 between 4 KiB and 1 GiB",
                    self.chunk_size
                ),
            ));
        }
        if !(1..=32768).contains(&self.queue_depth) {
            return Err(Error::invalid(ctx(), "queue depth must be 1..=32768"));
        }
        if !(1..=u16::MAX as usize).contains(&self.bounce_slots) {
            return Err(Error::invalid(ctx(), "bounce slots must be 1..=65535"));
        }
        if self.pool_wait_limit < std::time::Duration::from_millis(10) {
            // Growth comes after a tenth of the limit: below a millisecond, ordinary waits
            // for live futures would grow the pool and then fail requests.
            return Err(Error::invalid(
                ctx(),
                format!(
                    "pool wait limit {:?} is below 10 ms: live futures would be taken for leaks",
                    self.pool_wait_limit
                ),
            ));
        }
        let growth = self.bounce_growth.unwrap_or(self.bounce_slots);
        if growth > u16::MAX as usize {
            return Err(Error::invalid(
                ctx(),
                "bounce growth must be 0..=65535 blocks",
            ));
        }
        if self.backend == Backend::Gds {
            #[cfg(feature = "cuda")]
            crate::gds::driver::cufile()
                .map_err(|why| Error::unsupported(ctx().with_backend("cufile"), why))?;
            #[cfg(not(feature = "cuda"))]
            return Err(Error::unsupported(
                ctx().with_backend("cufile"),
                "gpuio was built without the `cuda` feature",
            ));
        }
        let block = self.chunk_size.next_power_of_two();
        let arena = Arc::new(if self.spdk_memory {
            BounceArena::new_dma(block, self.bounce_slots)
                .map_err(|why| Error::unsupported(ctx().with_backend("spdk"), why))?
        } else {
            BounceArena::new(block, self.bounce_slots, growth)
                .map_err(|e| Error::io(ctx().with_backend("bounce pool"), e))?
        });
        let doorbell =
            Arc::new(Doorbell::new().map_err(|e| Error::io(ctx().with_backend("eventfd"), e))?);
        let (tx, rx) = channel::<Msg>();
        let shared = Arc::new(ReactorHandle::new(tx, doorbell.clone(), arena.clone()));
        let (setup_tx, setup_rx) = sync_channel::<Result<BackendInfo>>(1);
        let backend = self.backend;
        let threads = self.pread_threads.unwrap_or(self.queue_depth.min(64));
        let qd = self.queue_depth;
        let ext_arg = self.uring_ext_arg;
        let reactor_shared = shared.clone();
        let cfg = ReactorConfig {
            chunk_size: self.chunk_size,
            queue_depth: self.queue_depth,
            punt_min: self.punt_min,
            spin: self.reactor_spin,
            tick: self.reactor_tick,
            pool_wait_limit: self.pool_wait_limit,
        };
        // Dropped when the reactor thread ends (however it ends): what the engine's drop waits on.
        let (exit_tx, exit_rx) = sync_channel::<()>(0);
        let spawned = std::thread::Builder::new()
            .name("gpuio-reactor".into())
            .spawn(move || {
                let _exit = exit_tx;
                let main = match make_main_lane(backend, qd, threads, &arena, &doorbell, ext_arg) {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = setup_tx.send(Err(e));
                        return;
                    }
                };
                let info = BackendInfo {
                    name: main.name(),
                    detail: main.describe(),
                };
                tracing::info!(backend = info.name, detail = %info.detail, "gpuio engine started");
                let _ = setup_tx.send(Ok(info));
                Reactor::new(rx, main, reactor_shared, cfg).run_to_end();
            })
            .map_err(|e| Error::io(ctx(), e))?;
        let info = match setup_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => {
                let _ = spawned.join();
                return Err(e);
            }
            Err(_) => {
                let _ = spawned.join();
                return Err(Error::ReactorDied {
                    ctx: Box::new(ctx()),
                    reason: "reactor thread exited during setup".into(),
                });
            }
        };
        let gds_mode = match self.backend {
            Backend::Auto => GdsMode::Auto,
            Backend::Gds => GdsMode::Forced,
            Backend::Uring | Backend::Pread => GdsMode::Off,
        };
        Ok(Engine {
            inner: Arc::new(EngineInner {
                shared,
                reactor: Some(spawned),
                reactor_exit: std::sync::Mutex::new(exit_rx),
                info,
                gds_mode,
                cufile_compat: self.cufile_compat,
                chunk_size: self.chunk_size,
                queue_depth: self.queue_depth,
                bounce_bytes: block * self.bounce_slots,
            }),
        })
    }
}

/// The main lane for `backend`: io_uring, or the pread pool (with the reason, where io_uring
/// was wanted but could not be set up).
fn make_main_lane(
    backend: Backend,
    qd: usize,
    threads: usize,
    arena: &BounceArena,
    doorbell: &Arc<Doorbell>,
    ext_arg: bool,
) -> Result<Box<dyn Lane>> {
    let ctx = || Context::op(OpKind::Setup);
    let uring = || {
        // SAFETY: the arena is kept alive by the reactor (and every op) for longer than the
        // lane, which the reactor drops first.
        unsafe { UringLane::new(qd as u32, &arena.block_iovecs(), doorbell.raw_fd(), ext_arg) }
            .map(|l| Box::new(l) as Box<dyn Lane>)
    };
    let pool = |reason: String| {
        PreadLane::new(threads, doorbell.clone(), reason)
            .map(|l| Box::new(l) as Box<dyn Lane>)
            .map_err(|e| Error::io(ctx().with_backend("pread"), e))
    };
    match backend {
        Backend::Uring => uring().map_err(|e| {
            Error::unsupported(
                ctx().with_backend("io_uring"),
                format!("{e}; use Backend::Auto or Backend::Pread to fall back"),
            )
        }),
        Backend::Pread => pool(String::new()),
        Backend::Auto | Backend::Gds => match uring() {
            Ok(l) => Ok(l),
            Err(e) => {
                let reason = format!("io_uring unavailable: {e}");
                tracing::warn!(%reason, "gpuio falls back to the pread pool");
                pool(reason)
            }
        },
    }
}

/// How long dropping the last engine handle waits for its reactor to drain and exit before
/// leaving it to finish in the background (`Engine::shutdown` waits for good).
const REACTOR_JOIN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

struct EngineInner {
    shared: Arc<ReactorHandle>,
    /// The reactor thread, joined when the last handle goes (see the drop).
    reactor: Option<std::thread::JoinHandle<()>>,
    /// Disconnects when the reactor thread ends.
    reactor_exit: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
    info: BackendInfo,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    gds_mode: GdsMode,
    cufile_compat: bool,
    chunk_size: usize,
    queue_depth: usize,
    bounce_bytes: usize,
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        // Last handle gone: close the queue and wake the reactor, which drains (operations
        // still pending fail with `Error::Shutdown`) and exits; then join it, so that its
        // ring, workers and pinned pool are gone when this returns (memory a device may still
        // write is quarantined instead, see `reactor::death`).
        self.shared.close();
        let Some(t) = self.reactor.take() else { return };
        if t.thread().id() == std::thread::current().id() {
            return;
        }
        // A drain takes microseconds to milliseconds (pieces in the kernel complete). Work that
        // cannot be seen to end soon (a CUDA stream still busy with a kernel, a hung device)
        // must not block the dropping thread, often an async runtime's worker: past the limit
        // the reactor finishes draining on its own and frees (or quarantines) what it holds.
        let exit = self.reactor_exit.lock().unwrap_or_else(|p| p.into_inner());
        match exit.recv_timeout(REACTOR_JOIN_WAIT) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    waited_ms = REACTOR_JOIN_WAIT.as_millis() as u64,
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
            .field("chunk_size", &self.inner.chunk_size)
            .field("queue_depth", &self.inner.queue_depth)
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

    /// Chunk size in bytes.
    pub fn chunk_size(&self) -> usize {
        self.inner.chunk_size
    }

    /// Queue depth.
    pub fn queue_depth(&self) -> usize {
        self.inner.queue_depth
    }

    /// Bytes of bounce memory.
    pub fn bounce_bytes(&self) -> usize {
        self.inner.bounce_bytes
    }

    /// Whether the bounce pool is page-locked with CUDA (it is pinned on the first device
    /// transfer; `false` before that, on machines without CUDA, or where the driver refused).
    pub fn bounce_pool_pinned(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            self.inner.shared.arena.is_pinned()
        }
        #[cfg(not(feature = "cuda"))]
        {
            false
        }
    }

    /// Whether the reactor has stopped (after shutdown, or because it died).
    pub fn is_shut_down(&self) -> bool {
        self.inner.shared.dead.load(Ordering::SeqCst)
    }

    /// Why the reactor died, if it did: its panic message or the kernel interface that
    /// failed. `None` while it runs and after an orderly [`shutdown`](Self::shutdown). A dead
    /// engine fails every pending and later operation with
    /// [`Error::ReactorDied`](crate::Error::ReactorDied) carrying this reason; open a new one.
    pub fn failure(&self) -> Option<&str> {
        self.inner.shared.death.get().map(String::as_str)
    }

    /// Whether the bounce pool is SPDK DMA memory ([`EngineBuilder::spdk_memory`]).
    pub fn bounce_pool_is_dma(&self) -> bool {
        self.inner.shared.arena.is_dma()
    }

    /// Stops the reactor: new operations fail with [`Error::Shutdown`], operations in flight
    /// are cancelled and drained, then the ring and the bounce pool are released. Resolves when
    /// that is done.
    pub async fn shutdown(&self) -> Result<()> {
        let fut = OpFuture::with_message(
            self.inner.shared.clone(),
            OpKind::Shutdown,
            NoTransfer,
            Msg::Shutdown(SubmitMsg {
                shared: None,
                req: None,
            }),
        );
        match fut.await {
            Ok(_) => Ok(()),
            // Already stopped: that is what was asked for, unless the reactor died.
            Err(Error::Shutdown { ctx }) => match self.inner.shared.refusal(*ctx) {
                Error::Shutdown { .. } => Ok(()),
                died => Err(died),
            },
            Err(e) => Err(e),
        }
    }

    /// Waits until `stream` has finished everything queued on it so far, without blocking a
    /// thread: the reactor polls an event recorded now and wakes the task. Use it instead of
    /// `stream.synchronize()` inside async code (a tokio worker parked in
    /// `cuStreamSynchronize` stalls every task scheduled on it).
    #[cfg(feature = "cuda")]
    pub fn synchronize(&self, stream: &cudarc::driver::CudaStream) -> crate::op::sync::StreamSync {
        crate::op::sync::start(&self.inner.shared, stream)
    }

    /// Most bounce bytes one operation may hold; batches keep their reads in flight within it.
    pub(crate) fn op_window(&self) -> usize {
        crate::reactor::op_window(&self.inner.shared.arena)
    }

    pub(crate) fn shared(&self) -> &Arc<ReactorHandle> {
        &self.inner.shared
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
