//! `gpuio bench`'s arguments and the checks made on them before any work starts.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, ValueEnum};
use gpuio::Backend;
use serde::Serialize;

use crate::size::ByteSize;
use crate::validate;

/// Most requests in flight per point: the engine's own queue-depth limit. Deeper only adds
/// tasks and buffers waiting for the same kernel queue.
const MAX_QD: usize = 32768;
/// Most blocks per batch (`--pattern batch`).
const MAX_BATCH: usize = 65536;
/// Most KvikIO threads tried under --compare.
const MAX_KVIKIO_THREADS: usize = 4096;
/// Most rounds per point: each keeps its measurements (and more than a million would take
/// days); `usize::MAX` made the allocation for them panic.
const MAX_ROUNDS: usize = 1_000_000;

/// Where data goes: `host`, `gpu` (device 0), `gpu:N`, or (`gpuio bench` only) several GPUs,
/// `gpu:0,1` or `gpu:all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Host memory.
    Host,
    /// Memory of GPU N.
    Gpu(usize),
    /// Memory of every GPU whose bit is set (at least two): tasks are spread over them.
    Gpus(u64),
}

/// Most GPUs one `--to gpu:...` list names (bits of [`Target::Gpus`]).
const MAX_GPUS: usize = 64;

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?}: expected host, gpu, gpu:N, gpu:N,M,... or gpu:all");
        let list = match s {
            "host" => return Ok(Target::Host),
            "gpu" => return Ok(Target::Gpu(0)),
            _ => s.strip_prefix("gpu:").ok_or_else(bad)?,
        };
        let ordinals: Vec<usize> = if list == "all" {
            let n = gpuio::cuda::probe().devices.len();
            if n == 0 {
                return Err(format!("{s:?}: this machine has no usable GPU"));
            }
            (0..n.min(MAX_GPUS)).collect()
        } else {
            list.split(',')
                .map(|n| n.trim().parse::<usize>().map_err(|_| bad()))
                .collect::<Result<_, _>>()?
        };
        let mut mask = 0u64;
        for &n in &ordinals {
            if n >= MAX_GPUS {
                return Err(format!(
                    "{s:?}: GPU {n} is past the {MAX_GPUS} a list may name"
                ));
            }
            if mask & (1 << n) != 0 {
                return Err(format!("{s:?}: GPU {n} is named twice"));
            }
            mask |= 1 << n;
        }
        Ok(match ordinals.as_slice() {
            [one] => Target::Gpu(*one),
            _ => Target::Gpus(mask),
        })
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Host => f.write_str("host"),
            Target::Gpu(n) => write!(f, "gpu:{n}"),
            Target::Gpus(_) => {
                let list: Vec<String> = self.gpus().iter().map(|n| n.to_string()).collect();
                write!(f, "gpu:{}", list.join(","))
            }
        }
    }
}

/// A CUDA context, as the commands hold them.
pub type Cuda = Arc<gpuio::cuda::cudarc::driver::CudaContext>;

impl Target {
    /// The GPU ordinals this target names (none for host memory).
    pub fn gpus(self) -> Vec<usize> {
        match self {
            Target::Host => Vec::new(),
            Target::Gpu(n) => vec![n],
            Target::Gpus(mask) => (0..MAX_GPUS).filter(|n| mask & (1 << n) != 0).collect(),
        }
    }

    /// The CUDA context for a one-GPU target (errors clearly where there is none, or where
    /// several GPUs are named: only `gpuio bench` spreads work over GPUs).
    pub fn cuda(self) -> Result<Option<Cuda>, Box<dyn std::error::Error + Send + Sync>> {
        match self {
            Target::Host => Ok(None),
            Target::Gpu(n) => Ok(Some(gpuio::cuda::context(n)?)),
            Target::Gpus(_) => Err(format!(
                "--to {self}: several GPUs are for `gpuio bench`; name one GPU here"
            )
            .into()),
        }
    }

    /// A context for each GPU this target names, in ordinal order.
    pub fn cudas(self) -> Result<Vec<Cuda>, gpuio::Error> {
        self.gpus().into_iter().map(gpuio::cuda::context).collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rw {
    Read,
    Write,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Sequential blocks.
    Seq,
    /// Random blocks.
    Rand,
    /// Batches of --batch random blocks each, packed into one buffer (`gpuio::batch`); IOPS
    /// count blocks, latency is per batch.
    Batch,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// File to use. Without it, a temporary file of --size is made (and removed). An existing
    /// file is only ever read, unless --rw write is given.
    #[arg(long)]
    pub(crate) file: Option<PathBuf>,
    /// Bytes of the file to use.
    #[arg(long, default_value = "1G", value_parser = validate::positive_size)]
    pub(crate) size: ByteSize,
    /// Read or write.
    #[arg(long, value_enum, default_value = "read")]
    pub(crate) rw: Rw,
    /// Sequential or random offsets (random ones are multiples of --bs), or batches of random
    /// blocks read as one operation.
    #[arg(long, value_enum, default_value = "seq")]
    pub(crate) pattern: Pattern,
    /// Bytes per request; a comma-separated list sweeps them (`4K,64K,1M`).
    #[arg(
        long,
        value_delimiter = ',',
        num_args = 1..,
        default_value = "1M",
        value_parser = validate::positive_size
    )]
    pub(crate) bs: Vec<ByteSize>,
    /// Requests in flight (concurrent futures); a comma-separated list sweeps them.
    #[arg(
        long,
        value_delimiter = ',',
        num_args = 1..,
        default_value = "32",
        value_parser = validate::count(MAX_QD)
    )]
    pub(crate) qd: Vec<usize>,
    /// Runtime tasks that keep the requests in flight, each polling its share of --qd
    /// together, as one fio job keeps its iodepth from one thread; fio gets as many jobs
    /// under --compare. Default: one task per request (and fio one job).
    #[arg(long, value_parser = validate::count(MAX_QD))]
    pub(crate) jobs: Option<usize>,
    /// Blocks per batch with --pattern batch.
    #[arg(long, default_value_t = 64, value_parser = validate::count(MAX_BATCH))]
    pub(crate) batch: usize,
    /// With --pattern batch: each block lands a block apart from the last in the destination
    /// (scattered, as the pages of a paged KV cache are) instead of next to it, so no two
    /// blocks' copies can be joined; the buffer is twice the batch.
    #[arg(long)]
    pub(crate) scatter: bool,
    /// O_DIRECT.
    #[arg(long)]
    pub(crate) direct: bool,
    /// Destination (or source) memory: host, gpu, gpu:N, or several GPUs (gpu:0,1 or gpu:all:
    /// tasks spread over them, each GPU's rate reported).
    #[arg(long, default_value = "host")]
    pub(crate) to: Target,
    /// Backend; a comma-separated list compares them (`uring,pread`). `spdk` reads the NVMe
    /// namespace given with --target instead of a file.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "auto")]
    pub(crate) backend: Vec<BenchBackend>,
    /// SPDK transport ID of the namespace `--backend spdk` uses
    /// (`trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:...`).
    #[arg(long = "target", value_name = "TRID")]
    pub(crate) nvme: Option<String>,
    /// Engine chunk size for every path, a multiple of 4K up to 1G (default: the engine's,
    /// sized from the machine: `gpuio check` prints it).
    #[arg(long, value_parser = validate::chunk_size)]
    pub(crate) chunk: Option<ByteSize>,
    /// Most io_uring workers copying buffered pieces at once (default: the engine's, two per
    /// core; 0: the kernel's limit).
    #[arg(long, value_name = "N", value_parser = validate::whole(0, u32::MAX))]
    pub(crate) iowq_workers: Option<u32>,
    /// Most buffered reads copied out of the page cache at once (default: the engine's,
    /// sized from the machine).
    #[arg(long, value_name = "N", value_parser = validate::count(1 << 20))]
    pub(crate) page_cache_copies: Option<usize>,
    /// Most page-cache copies per GPU while every open read lands in GPU memory (default: the
    /// engine's; `--page-cache-copies` alone sets this too)
    #[arg(long, value_name = "N", value_parser = validate::count(1 << 20))]
    pub(crate) copies_per_device: Option<usize>,
    /// Read every piece of a buffered file through the page cache, cached or not (default:
    /// large reads of ranges the page cache lacks go O_DIRECT; `EngineBuilder::residency_aware`).
    #[arg(long)]
    pub(crate) no_residency: bool,
    /// Seconds to run each point (at most a year).
    #[arg(long, default_value_t = 5.0, value_parser = validate::seconds)]
    pub(crate) seconds: f64,
    /// Host reads through `File::read_owned` into an `AlignedBuf` per task (handed to the
    /// engine and back): the kernel reads into it in place, no bounce copy, O_DIRECT too.
    #[arg(long)]
    pub(crate) owned: bool,
    /// Host reads (or `--pattern batch` batches) through `File::read_into_blocking` /
    /// `BatchPlan::read_into_blocking`, what the C and Python bindings' blocking calls use:
    /// each request's buffer lent to the kernel for the call (read in place past
    /// `--page-cache-read-max`), on a runtime thread given over to blocking.
    #[arg(long, conflicts_with = "owned")]
    pub(crate) blocking: bool,
    /// Every small read (host or device) through the reactor: no page-cache fast path on the polling
    /// thread (`EngineBuilder::page_cache_fast_path`).
    #[arg(long)]
    pub(crate) no_fast_path: bool,
    /// The largest read into host memory served straight from the page cache by the thread
    /// polling it (`EngineBuilder::page_cache_read_max`; default 16M; 64K: only small reads,
    /// as before the eighteenth session).
    #[arg(long, value_name = "SIZE")]
    pub(crate) page_cache_read_max: Option<ByteSize>,
    /// Large warm reads into GPU memory copied straight from the page cache, without a CPU
    /// copy: the range mapped and registered with the driver (`EngineBuilder::mapped_reads`).
    #[arg(long)]
    pub(crate) mapped_reads: bool,
    /// Every task's device buffer on one CUDA stream per GPU (as under a framework's current
    /// stream) instead of a stream per task.
    #[arg(long)]
    pub(crate) one_stream: bool,
    /// Every task's device buffer on the GPU's legacy default stream (where Python code on
    /// torch's or cupy's default stream has its memory).
    #[arg(long, conflicts_with = "one_stream")]
    pub(crate) default_stream: bool,
    /// Turns cudarc's event tracking off on the GPUs used, before any buffer exists: with
    /// several streams, cudarc otherwise makes every access to a buffer wait for its last
    /// read and write events and record a new one (three driver calls per read). Sound here:
    /// each task's buffer is used on its own stream only (or on the one stream all share).
    #[arg(long)]
    pub(crate) no_event_tracking: bool,
    /// Copy page-cache hits inline on the reactor thread instead of on io_uring's workers.
    #[arg(long, conflicts_with = "async_copy_min")]
    pub(crate) inline_copies: bool,
    /// Hand buffered pieces of at least this many bytes to io_uring's workers (default 64K;
    /// smaller ones are copied inline on the reactor thread).
    #[arg(long, value_name = "BYTES", value_parser = validate::positive_size)]
    pub(crate) async_copy_min: Option<ByteSize>,
    /// How long the reactor polls, without sleeping, after its last work (microseconds;
    /// default 0: the engine's default, no spin).
    #[arg(long, value_name = "US", value_parser = validate::whole(0, u64::MAX))]
    pub(crate) reactor_spin_us: Option<u64>,
    /// Longest the reactor sleeps while I/O is in the kernel (microseconds; 0: until woken;
    /// default: the engine's, 100).
    #[arg(long, value_name = "US", value_parser = validate::whole(0, u64::MAX))]
    pub(crate) reactor_tick_us: Option<u64>,
    /// Reactor threads of the engine, each with its own ring and share of the pool (default:
    /// the engine's, 1). Small O_DIRECT reads at high depth are bound by one reactor's core.
    #[arg(long, value_name = "N", value_parser = validate::whole(1u64, 64))]
    pub(crate) reactors: Option<u64>,
    /// Let a kernel thread poll io_uring's submission queue, sleeping after this many idle
    /// milliseconds (`EngineBuilder::submission_polling`; default: off). Costs a core while
    /// I/O flows; measured slower on a RAM-backed loop device (BENCHMARKS.md).
    #[arg(long, value_name = "MS", value_parser = validate::whole(1, 60_000u64))]
    pub(crate) sqpoll_idle_ms: Option<u64>,
    /// Print one JSON object per point (JSON lines); the last line of stdout is the last point.
    #[arg(long)]
    pub(crate) json: bool,
    /// Run the peers on the same target with the same settings, alternating with gpuio, and
    /// print the ratios: fio (io_uring engine) on files, SPDK's perf on NVMe namespaces, and
    /// KvikIO on files where its peer program is found (`kvikio-peer` on PATH or named by
    /// GPUIO_KVIKIO_PEER; `scripts/kvikio-peer.sh` builds it).
    #[arg(long)]
    pub(crate) compare: bool,
    /// KvikIO thread-pool sizes to try under --compare; the best one stands for KvikIO.
    #[arg(
        long,
        value_delimiter = ',',
        num_args = 1..,
        default_value = "8,16,32",
        value_parser = validate::count(MAX_KVIKIO_THREADS)
    )]
    pub(crate) kvikio_threads: Vec<usize>,
    /// Rounds per point (alternating with fio under --compare); medians are reported.
    #[arg(long, default_value_t = 1, value_parser = validate::whole(0, MAX_ROUNDS))]
    pub(crate) rounds: usize,
    /// Write an SVG plot of throughput against block size and queue depth, one panel per
    /// backend.
    #[arg(long, value_name = "FILE.svg")]
    pub(crate) plot: Option<PathBuf>,
}

/// What `--backend` names: an engine backend over a file, or SPDK over an NVMe namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchBackend {
    /// A file through the engine's kernel interface (and cuFile where it serves).
    Engine(Backend),
    /// The namespace given with --target, through SPDK.
    Spdk,
}

impl std::str::FromStr for BenchBackend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "spdk" => Ok(BenchBackend::Spdk),
            other => other
                .parse()
                .map(BenchBackend::Engine)
                .map_err(|e| format!("{e}, or spdk")),
        }
    }
}

impl std::fmt::Display for BenchBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BenchBackend::Engine(b) => b.fmt(f),
            BenchBackend::Spdk => f.write_str("spdk"),
        }
    }
}

impl BenchArgs {
    /// Everything about the arguments that can be known before any work starts (clap's
    /// parsers already refused zero, negative and out-of-range values one by one): the
    /// combinations, the host memory the sweep's buffers take, and where the plot goes. Run
    /// first, so that a mistake costs no temporary file and no sweep.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.owned && (self.rw == Rw::Write || self.pattern == Pattern::Batch) {
            return Err(
                "--owned reads into host memory (--rw read, --to host, seq or rand)".into(),
            );
        }
        if self.owned && self.to != Target::Host {
            return Err(format!(
                "--owned reads into host memory, not --to {}",
                self.to
            ));
        }
        if self.blocking && (self.rw == Rw::Write || self.to != Target::Host) {
            return Err(format!(
                "--blocking reads into host memory (--rw read, --to host), not {} --to {}",
                if self.rw == Rw::Write {
                    "writes"
                } else {
                    "reads"
                },
                self.to
            ));
        }
        let gpus = self.to.gpus().len();
        if let Some(qd) = self.qd.iter().find(|&&q| gpus > 1 && q % gpus != 0) {
            return Err(format!(
                "--qd {qd} does not spread evenly over the {gpus} GPUs of --to {}: use a \
                 multiple of {gpus}",
                self.to
            ));
        }
        if let Some(jobs) = self.jobs {
            if let Some(qd) = self.qd.iter().find(|&&q| q % jobs != 0) {
                return Err(format!(
                    "--qd {qd} does not split evenly into --jobs {jobs}: use a multiple of {jobs}"
                ));
            }
        }
        if matches!(self.to, Target::Gpus(_)) && self.compare {
            return Err(format!(
                "--compare measures one GPU's path against its peers; name one GPU, not --to {}",
                self.to
            ));
        }
        if self.pattern == Pattern::Batch && self.rw == Rw::Write {
            return Err("--pattern batch reads (--rw read)".into());
        }
        if self.scatter && self.pattern != Pattern::Batch {
            return Err("--scatter places the blocks of --pattern batch".into());
        }
        if self.backend.contains(&BenchBackend::Spdk) != self.nvme.is_some() {
            return Err("--backend spdk and --target TRID go together".into());
        }
        if let Some(p) = &self.plot {
            validate::plot_target(p)?;
        }
        // Each task of the deepest point holds a buffer of the largest block (a batch of
        // them with --pattern batch), all at once. In device memory an allocation that does
        // not fit fails cleanly; in host memory it aborts the process, hence the check.
        let max_bs = self.bs.iter().map(|b| b.0).max().unwrap_or(0);
        let max_qd = self.qd.iter().copied().max().unwrap_or(0) as u64;
        let per_task = match self.pattern {
            Pattern::Batch => max_bs
                .checked_mul(self.batch as u64)
                .and_then(|b| b.checked_mul(if self.scatter { 2 } else { 1 })),
            _ => Some(max_bs),
        };
        let per_task = per_task.filter(|&b| usize::try_from(b).is_ok());
        let what = format!(
            "--qd {max_qd} x --bs {}{}",
            crate::size::short_size(max_bs),
            if self.pattern == Pattern::Batch {
                format!(" x --batch {}", self.batch)
            } else {
                String::new()
            }
        );
        match self.to {
            Target::Host => validate::fits_in_memory(
                per_task.and_then(|b| b.checked_mul(max_qd)),
                &format!("{what} needs buffers"),
            ),
            Target::Gpu(_) | Target::Gpus(_) => per_task
                .map(drop)
                .ok_or_else(|| format!("{what}: one task's buffer is too large")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Target;

    #[test]
    fn gpu_lists_parse_and_print_back() {
        let t: Target = "gpu:1,0,3".parse().unwrap();
        assert_eq!(t, Target::Gpus(0b1011));
        assert_eq!(t.gpus(), vec![0, 1, 3]);
        assert_eq!(t.to_string(), "gpu:0,1,3");
        assert_eq!("gpu:2".parse::<Target>().unwrap(), Target::Gpu(2));
        assert_eq!("gpu".parse::<Target>().unwrap(), Target::Gpu(0));
        for bad in ["gpu:0,0", "gpu:64", "gpu:", "gpu:a", "gpu:1,", "cpu"] {
            assert!(bad.parse::<Target>().is_err(), "{bad}");
        }
        assert!(
            Target::Gpus(0b11).cuda().is_err(),
            "one-GPU commands refuse a list"
        );
    }
}
