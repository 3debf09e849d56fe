//! [`EngineBuilder`]: an engine's settings, sized from the machine unless set, and the start
//! of its reactor.

use std::sync::Arc;

use super::reactors::ReactorThread;
use super::{Backend, DEFAULT_POOL_WAIT_LIMIT, DEFAULT_REACTOR_TICK, Engine, EngineInner};
use crate::error::{Context, Error, OpKind, Result};
use crate::op::engine_shared::OpPolicy;
use crate::plan::sizing::{Machine, Sizing};
use crate::reactor::ReactorConfig;
use crate::target::GdsMode;
use crate::uring::UringOptions;

mod check;
mod start;
use check::Checked;

/// Most pread worker threads an engine starts ([`EngineBuilder::pread_threads`]). Each serves
/// one I/O at a time and costs a stack; thousands only contend, and the cap turns a mistyped
/// count into a clear error instead of the thread limit's bare EAGAIN.
const MAX_PREAD_THREADS: usize = 4096;

/// Settings for [`Engine`]. The defaults are the measured best on the machines in
/// BENCHMARKS.md (repository root): see each setting for its reason.

#[derive(Debug, Clone)]
pub struct EngineBuilder {
    /// Explicit piece sizes (`None`: sized from the machine, see [`Sizing`]).
    buffered_chunk: Option<usize>,
    direct_chunk: Option<usize>,
    queue_depth: Option<usize>,
    bounce_slots: Option<usize>,
    /// `Some(0)`: the kernel's own io-wq limit.
    iowq_workers: Option<u32>,
    page_cache_copies: Option<usize>,
    copies_per_device: Option<usize>,
    bounce_growth: Option<usize>,
    pool_wait_limit: std::time::Duration,
    backend: Backend,
    pread_threads: Option<usize>,
    punt_min: Option<usize>,
    residency_aware: bool,
    cached_fast_path: bool,
    host_cached_max: usize,
    mapped_reads: bool,
    spdk_memory: bool,
    cufile_compat: bool,
    reactor_spin: std::time::Duration,
    reactor_tick: std::time::Duration,
    /// Whether io_uring timed waits may use `IORING_ENTER_EXT_ARG` where the kernel has it
    /// (off in tests only: the timeout-SQE path that Linux 5.6–5.10 takes).
    uring_ext_arg: bool,
    submission_polling: Option<std::time::Duration>,
    reactors: Option<usize>,
}

impl Default for EngineBuilder {
    fn default() -> Self {
        EngineBuilder {
            buffered_chunk: None,
            direct_chunk: None,
            queue_depth: None,
            bounce_slots: None,
            iowq_workers: None,
            page_cache_copies: None,
            copies_per_device: None,
            bounce_growth: None,
            pool_wait_limit: DEFAULT_POOL_WAIT_LIMIT,
            backend: Backend::Auto,
            pread_threads: None,
            punt_min: Some(64 << 10),
            residency_aware: true,
            cached_fast_path: true,
            host_cached_max: crate::op::cached::HOST_CACHED_READ_MAX,
            mapped_reads: false,
            spdk_memory: false,
            cufile_compat: false,
            reactor_spin: std::time::Duration::ZERO,
            reactor_tick: DEFAULT_REACTOR_TICK,
            uring_ext_arg: true,
            submission_polling: None,
            reactors: None,
        }
    }
}

impl EngineBuilder {
    /// Largest piece one I/O moves, on every path (a multiple of 4096, at most 1 GiB). Sets
    /// both [`buffered_chunk_size`](Self::buffered_chunk_size) and
    /// [`direct_chunk_size`](Self::direct_chunk_size).
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.buffered_chunk = Some(bytes);
        self.direct_chunk = Some(bytes);
        self
    }

    /// Largest piece of a buffered (page-cache) read or write (default
    /// [`BUFFERED_CHUNK`](crate::plan::sizing::BUFFERED_CHUNK), 2 MiB).
    pub fn buffered_chunk_size(mut self, bytes: usize) -> Self {
        self.buffered_chunk = Some(bytes);
        self
    }

    /// Largest piece of an O_DIRECT, cuFile or NVMe transfer (default
    /// [`DIRECT_CHUNK`](crate::plan::sizing::DIRECT_CHUNK), 4 MiB).
    pub fn direct_chunk_size(mut self, bytes: usize) -> Self {
        self.direct_chunk = Some(bytes);
        self
    }

    /// Most I/Os in the kernel at once (default: four per core, at least 64; see
    /// [`Sizing`]).
    pub fn queue_depth(mut self, n: usize) -> Self {
        self.queue_depth = Some(n);
        self
    }

    /// Bounce pool size in blocks of the larger chunk size, rounded up to a power of two
    /// (default: sized from the cores and memory, at least 128 MiB; see [`Sizing`]). Small
    /// requests take 4 KiB-granular pieces of a block, so this bounds bytes, not ops.
    pub fn bounce_slots(mut self, n: usize) -> Self {
        self.bounce_slots = Some(n);
        self
    }

    /// Most io_uring worker threads copying buffered pieces at once
    /// (`IORING_REGISTER_IOWQ_MAX_WORKERS`, per ring; default two per core; 0 keeps the
    /// kernel's limit). Ignored by the pread pool.
    pub fn iowq_workers(mut self, n: u32) -> Self {
        self.iowq_workers = Some(n);
        self
    }

    /// Most buffered reads copied out of the page cache at once (pieces the reactor hands to
    /// io_uring's workers; default: sized from the machine, see `gpuio check`). Each is a CPU
    /// copy: more of them than the memory's bandwidth feeds only slow each other down. At
    /// least 1: [`build`](Self::build) refuses 0.
    pub fn page_cache_copies(mut self, n: usize) -> Self {
        self.page_cache_copies = Some(n);
        self
    }

    /// Most page-cache copies per GPU while every open read lands in GPU memory (default:
    /// [`COPIES_PER_DEVICE`](crate::plan::sizing::COPIES_PER_DEVICE), within
    /// [`page_cache_copies`](Self::page_cache_copies)). Setting `page_cache_copies` alone sets
    /// this to the same number: the cap is then exactly what was asked. At least 1.
    pub fn copies_per_device(mut self, n: usize) -> Self {
        self.copies_per_device = Some(n);
        self
    }

    /// The settings this builder would build with on this machine, each with its reason.
    pub fn sizing(&self) -> Sizing {
        let mut s = Sizing::for_machine(Machine::probe());
        let mut set = |what: &str, value: String| {
            s.reasons
                .push(format!("{what} {value}: set by the builder"));
        };
        if let Some(c) = self.buffered_chunk {
            set("buffered chunk", format!("{} KiB", c >> 10));
        }
        if let Some(c) = self.direct_chunk {
            set("direct chunk", format!("{} KiB", c >> 10));
        }
        if let Some(q) = self.queue_depth {
            set("queue depth", q.to_string());
        }
        if let Some(n) = self.page_cache_copies {
            set("page-cache copies", n.to_string());
        }
        if let Some(n) = self.copies_per_device {
            set("page-cache copies per GPU", n.to_string());
        }
        if let Some(n) = self.reactors {
            set("reactors", n.to_string());
        }
        if let Some(w) = self.iowq_workers {
            set(
                "io_uring workers",
                if w == 0 {
                    "kernel default".into()
                } else {
                    w.to_string()
                },
            );
        }
        s.buffered_chunk = self.buffered_chunk.unwrap_or(s.buffered_chunk);
        s.direct_chunk = self.direct_chunk.unwrap_or(s.direct_chunk);
        s.queue_depth = self.queue_depth.unwrap_or(s.queue_depth);
        s.reactors = self.reactors.unwrap_or(s.reactors);
        s.page_cache_copies = self.page_cache_copies.unwrap_or(s.page_cache_copies).max(1);
        s.copies_per_device = match (self.copies_per_device, self.page_cache_copies) {
            (Some(n), _) => n.max(1),
            (None, Some(n)) => n.max(1),
            (None, None) => s.copies_per_device,
        };
        s.iowq_workers = match self.iowq_workers {
            Some(0) => None,
            Some(w) => Some(w),
            None => s.iowq_workers,
        };
        let block = s.block();
        match self.bounce_slots {
            Some(n) => {
                s.bounce_bytes = n.saturating_mul(block);
                s.reasons.push(format!(
                    "bounce pool {n} x {} KiB blocks: set by the builder",
                    block >> 10
                ));
            }
            // Whole blocks, and no more than the slot table indexes (tiny chunks, such as
            // `gpuio cp --chunk 4K`, make small blocks).
            None => s.bounce_bytes = s.bounce_bytes.div_ceil(block).min(u16::MAX as usize) * block,
        }
        s
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

    /// Threads of the pread pool, when it serves (default: the queue depth, at most 64; at most
    /// 4096).
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

    /// Whether reads of buffered files on the io_uring and pread paths, up to
    /// [`CACHED_READ_MAX`](crate::CACHED_READ_MAX) bytes into device memory and up to
    /// [`page_cache_read_max`](Self::page_cache_read_max) into host memory, first try the page
    /// cache on the thread that polls them (default on): a `preadv2(RWF_NOWAIT)` straight into
    /// the caller's buffer, which the kernel serves only if the bytes are cached and it need not wait. For device memory the
    /// bytes go through a per-thread pageable buffer and one host-to-device copy queued on the
    /// destination's stream, which CUDA stages before the call returns. Served, the read is done
    /// in that poll: no bounce slot, no reactor, no wake-ups. Otherwise (not cached, partly cached, any error)
    /// the read goes through the reactor as usual. Off: every read goes through the reactor.
    ///
    /// While a write of the same file is unfinished on this engine (a live or leaked write
    /// future), small reads of it keep to the reactor, whose range fence orders them after
    /// write pieces in the kernel; a file written all the time gains nothing here. A read
    /// that misses the cache costs one extra system call, and may start readahead: on some
    /// filesystems that briefly waits for metadata on the polling thread.
    pub fn page_cache_fast_path(mut self, on: bool) -> Self {
        self.cached_fast_path = on;
        self
    }

    /// The largest read into host memory that the thread polling it serves straight from the
    /// page cache (`preadv2(RWF_NOWAIT)` into the caller's buffer, in pieces of at most 2 MiB
    /// per poll), where the page cache holds it all (a sampled estimate). Default
    /// [`HOST_CACHED_READ_MAX`](crate::HOST_CACHED_READ_MAX) (16 MiB); never below
    /// [`CACHED_READ_MAX`](crate::CACHED_READ_MAX). Larger reads, and reads of ranges the page
    /// cache lacks, take the bounce path: io-wq copies into bounce slots, then the future
    /// copies the slots into the buffer. The copies in poll run on the threads that poll the
    /// reads (so as many at once as reads are polled at once, outside the cap on page-cache
    /// copies), and such a read moves only while it is polled.
    pub fn page_cache_read_max(mut self, bytes: usize) -> Self {
        self.host_cached_max = bytes;
        self
    }

    /// Whether large warm reads into device memory skip the CPU copy (default off): a read of
    /// at least 2 MiB of a buffered file, wholly in the page cache, is mapped read-only, the
    /// mapping is registered with the CUDA driver (which pins the page-cache pages), and the
    /// GPU copies straight from them. One thread per engine registers and unregisters.
    ///
    /// What it trades (BENCHMARKS.md, "Mapped reads"): about a fifth of the CPU time per GB
    /// of the bounce path, at a rate the driver caps, because it serializes registration
    /// within a process (19–32 GB/s into one GPU on the hosts measured, against 41–50 GB/s
    /// through the bounce path on 12 cores). For loads that want the cores more than the last
    /// GB/s, onto a GPU the process is not busy with: the driver's unregistration waits for
    /// every kernel the process has queued on the device, so beside a long kernel a mapped
    /// load waits for it (the registrar releases registrations in batches to pay that wait
    /// rarely). A batch's runs (and so safetensors loads) of
    /// 2 MiB or more qualify as lone reads do. Reads that do not qualify (cold, partly cached,
    /// past the end of the file, O_DIRECT, a stream capturing a graph) and files
    /// whose mappings the driver refuses take the bounce path. Needs the `cuda` feature; does
    /// nothing without it.
    pub fn mapped_reads(mut self, on: bool) -> Self {
        self.mapped_reads = on;
        self
    }

    /// Whether large reads of buffered files ask the page cache what it holds first (default
    /// on): ranges it mostly lacks are read with O_DIRECT through a second descriptor, at the
    /// disk's direct rate, and ranges it holds are copied from it, so a cold file loads at
    /// depth and a warm one at copy speed with no flag on the file. Reads of at least
    /// [`RESIDENCY_MIN_READ`](crate::plan::residency::RESIDENCY_MIN_READ) bytes, on the
    /// io_uring and pread paths; O_DIRECT files, cuFile, SPDK and owned reads are unaffected.
    /// Off: every read of a buffered file goes through the page cache (and fills it).
    pub fn residency_aware(mut self, on: bool) -> Self {
        self.residency_aware = on;
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

    /// Lets a kernel thread poll io_uring's submission queue (`IORING_SETUP_SQPOLL`), sleeping
    /// after `idle` without work (rounded to milliseconds, at least one; default: off). The
    /// reactor then no longer pays the submission path itself, which for small O_DIRECT reads
    /// on a fast device is close to half of its time; the price is that thread, a full core
    /// while I/O flows, per engine. Measured on a RAM-backed loop device (H100 host, 4 KiB
    /// QD64, BENCHMARKS.md "Sixth session") it did not pay: the polling thread, which now runs
    /// the device driver's submission work, became the limit at one core, and IOPS fell 4–12%
    /// (owned reads: +3%, within noise); warm 16 MiB reads lost 3%. Hence off by default; try it
    /// where submissions are cheap for the kernel and many small reads meet a busy reactor.
    /// Where the kernel refuses it the ring is set up as without it, and the detail of
    /// [`Engine::backend`](crate::Engine::backend) says why. Ignored by the pread pool.
    pub fn submission_polling(mut self, idle: std::time::Duration) -> Self {
        self.submission_polling = Some(idle);
        self
    }

    /// Reactor threads (default 1). Each has its own queue, io_uring ring (or pread pool), op
    /// table and an equal share of the bounce pool and of its growth; the queue depth is per
    /// reactor. One reactor submits and completes every piece, and for small O_DIRECT reads at
    /// high depth it is the limit, at about one core. Writes and syncs of a file, and its reads
    /// while a write of it is unfinished, stay on one reactor (the file's), so the range fence
    /// orders them as with one; other reads take the reactors in turn. 1..=64, and at most one
    /// per bounce slot. The page-cache copy cap is the engine's: each reactor may run its share
    /// and borrows the rest while the others leave it. One op (and a batch's reads in flight)
    /// may hold a quarter of the engine's pool, at most half of its reactor's share, so one
    /// large read keeps as much in flight with two reactors as with one; past two, give a
    /// larger pool to keep it as deep. cuFile's in-flight limit is shared between the reactors
    /// too. Measured on a 16-core H200 host (BENCHMARKS.md, "Twentieth session"): two reactors
    /// took 4 KiB O_DIRECT reads at depth 64 from 0.86-0.90x to 0.97-0.98x fio's IOPS, for
    /// about 0.7 more cores; warm 16 MiB reads, small page-cache reads and writes were
    /// unchanged. Hence one by default, two for small-read services.
    pub fn reactors(mut self, n: usize) -> Self {
        self.reactors = Some(n);
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
        let Checked {
            sizing,
            block,
            slots,
            growth,
        } = self.check()?;
        if self.backend == Backend::Gds {
            #[cfg(feature = "cuda")]
            crate::gds::result::cufile()
                .map_err(|why| Error::unsupported(ctx().with_backend("cufile"), why))?;
            #[cfg(not(feature = "cuda"))]
            return Err(Error::unsupported(
                ctx().with_backend("cufile"),
                "gpuio was built without the `cuda` feature",
            ));
        }
        let policy = OpPolicy {
            cached_fast_path: self.cached_fast_path,
            host_cached_max: self.host_cached_max.max(crate::op::cached::CACHED_READ_MAX),
            mapped_reads: self.mapped_reads && cfg!(feature = "cuda"),
            lend_buffered: sizing.lends_buffered_reads().0,
        };
        // Each reactor gets an equal share of the pool, of its growth and of the pread
        // threads. The page-cache copies are the engine's: a reactor may always run its share
        // and borrows the rest from the others (`Reactor::copies_free`), so one large read on
        // one reactor copies as widely as with one reactor. Each ring's io-wq therefore has
        // room for all of them.
        let n = sizing.reactors;
        let share = |v: usize| v.div_ceil(n).max(1);
        let plan = start::ReactorPlan {
            backend: self.backend,
            spdk_memory: self.spdk_memory,
            block,
            slots: slots / n,
            // Growth of zero is "never grow"; otherwise every reactor may grow.
            growth: if growth == 0 { 0 } else { share(growth) },
            queue_depth: sizing.queue_depth,
            reactors: n,
            iowq: sizing
                .iowq_workers
                .map(|w| share(w as usize).max(sizing.page_cache_copies.min(w as usize)) as u32),
            pread_threads: share(self.pread_threads.unwrap_or(sizing.queue_depth.min(64))),
            uring: UringOptions {
                ext_arg: self.uring_ext_arg,
                sqpoll: self.submission_polling,
            },
            cfg: ReactorConfig {
                buffered_chunk: sizing.buffered_chunk,
                direct_chunk: sizing.direct_chunk,
                queue_depth: sizing.queue_depth,
                page_cache_copies: sizing.page_cache_copies,
                reactors: n,
                copies_per_device: sizing.copies_per_device,
                punt_min: self.punt_min,
                residency_min: self
                    .residency_aware
                    .then_some(crate::plan::residency::RESIDENCY_MIN_READ),
                spin: self.reactor_spin,
                tick: self.reactor_tick,
                pool_wait_limit: self.pool_wait_limit,
            },
        };
        let mut reactors = Vec::with_capacity(n);
        let mut info = None;
        for index in 0..n {
            let primary = reactors.first().map(|r: &ReactorThread| &r.shared);
            match plan.start(index, policy, primary) {
                Ok((r, i)) => {
                    reactors.push(r);
                    info.get_or_insert(i);
                }
                Err(e) => {
                    super::reactors::close_and_join(&mut reactors, super::REACTOR_JOIN_WAIT);
                    return Err(e);
                }
            }
        }
        let info = info.expect("at least one reactor");
        let gds_mode = match self.backend {
            Backend::Auto => GdsMode::Auto,
            Backend::Gds => GdsMode::Forced,
            Backend::Uring | Backend::Pread => GdsMode::Off,
        };
        Ok(Engine {
            inner: Arc::new(EngineInner {
                reactors: reactors.into_boxed_slice(),
                info,
                gds_mode,
                cufile_compat: self.cufile_compat,
                bounce_bytes: block * (slots / n) * n,
                sizing,
            }),
        })
    }
}
