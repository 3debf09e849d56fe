//! `gpuio bench`: fio-like throughput and IOPS of the engine on one file.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use gpuio::batch::{BatchPlan, ReadDesc};
use gpuio::{Backend, Engine, OpenOptions};

use crate::CliResult;
use crate::size::{ByteSize, fmt_bytes, short_size};

/// Where data goes: `host`, `gpu` (device 0) or `gpu:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Host memory.
    Host,
    /// Memory of GPU N.
    Gpu(usize),
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "host" => Ok(Target::Host),
            "gpu" => Ok(Target::Gpu(0)),
            _ => s
                .strip_prefix("gpu:")
                .and_then(|n| n.parse().ok())
                .map(Target::Gpu)
                .ok_or_else(|| format!("{s:?}: expected host, gpu or gpu:N")),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Host => f.write_str("host"),
            Target::Gpu(n) => write!(f, "gpu:{n}"),
        }
    }
}

impl Target {
    /// The CUDA context for a GPU target (errors clearly where there is none).
    pub fn cuda(
        self,
    ) -> Result<Option<Arc<gpuio::cuda::cudarc::driver::CudaContext>>, gpuio::Error> {
        match self {
            Target::Host => Ok(None),
            Target::Gpu(n) => gpuio::cuda::context(n).map(Some),
        }
    }
}

/// A destination buffer in host or device memory.
enum Buffer {
    Host(Vec<u8>),
    /// `--owned`: read through `File::read_owned`.
    Aligned(gpuio::AlignedBuf),
    Gpu(gpuio::cuda::cudarc::driver::CudaSlice<u8>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Rw {
    Read,
    Write,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
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
    file: Option<PathBuf>,
    /// Bytes of the file to use.
    #[arg(long, default_value = "1G")]
    size: ByteSize,
    /// Read or write.
    #[arg(long, value_enum, default_value = "read")]
    rw: Rw,
    /// Sequential or random offsets (random ones are multiples of --bs), or batches of random
    /// blocks read as one operation.
    #[arg(long, value_enum, default_value = "seq")]
    pattern: Pattern,
    /// Bytes per request; a comma-separated list sweeps them (`4K,64K,1M`).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "1M")]
    bs: Vec<ByteSize>,
    /// Requests in flight (concurrent futures); a comma-separated list sweeps them.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "32")]
    qd: Vec<usize>,
    /// Blocks per batch with --pattern batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// O_DIRECT.
    #[arg(long)]
    direct: bool,
    /// Destination (or source) memory: host, gpu, gpu:N.
    #[arg(long, default_value = "host")]
    to: Target,
    /// Backend; a comma-separated list compares them (`uring,pread`). `spdk` reads the NVMe
    /// namespace given with --target instead of a file.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "auto")]
    backend: Vec<BenchBackend>,
    /// SPDK transport ID of the namespace `--backend spdk` uses
    /// (`trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:...`).
    #[arg(long = "target", value_name = "TRID")]
    nvme: Option<String>,
    /// Engine chunk size (default: 4M, or --bs if larger).
    #[arg(long)]
    chunk: Option<ByteSize>,
    /// Seconds to run each point.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Host reads through `File::read_owned` into an `AlignedBuf` per task (handed to the
    /// engine and back): the kernel reads into it in place, no bounce copy, O_DIRECT too.
    #[arg(long)]
    owned: bool,
    /// Copy page-cache hits inline on the reactor thread instead of on io_uring's workers.
    #[arg(long)]
    inline_copies: bool,
    /// How long the reactor polls, without sleeping, after its last work (microseconds;
    /// default 0: the engine's default, no spin).
    #[arg(long, value_name = "US")]
    reactor_spin_us: Option<u64>,
    /// Longest the reactor sleeps while I/O is in the kernel (microseconds; 0: until woken;
    /// default: the engine's, 100).
    #[arg(long, value_name = "US")]
    reactor_tick_us: Option<u64>,
    /// Print one JSON object per point (JSON lines); the last line of stdout is the last point.
    #[arg(long)]
    json: bool,
    /// Run the peers on the same target with the same settings, alternating with gpuio, and
    /// print the ratios: fio (io_uring engine) on files, SPDK's perf on NVMe namespaces, and
    /// KvikIO on files where its peer program is found (`kvikio-peer` on PATH or named by
    /// GPUIO_KVIKIO_PEER; `scripts/kvikio-peer.sh` builds it).
    #[arg(long)]
    compare: bool,
    /// KvikIO thread-pool sizes to try under --compare; the best one stands for KvikIO.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_value = "8,16,32")]
    kvikio_threads: Vec<usize>,
    /// Rounds per point (alternating with fio under --compare); medians are reported.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Write an SVG plot of throughput against block size and queue depth, one panel per
    /// backend.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
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

/// One point of a sweep.
#[derive(Debug, Clone, Copy)]
pub struct Point {
    /// The backend asked for.
    pub backend: BenchBackend,
    /// Bytes per request.
    pub bs: u64,
    /// Requests in flight.
    pub qd: usize,
}

/// What one point measured.
#[derive(Debug, Clone)]
pub struct Measurement {
    /// Where it was measured.
    pub point: Point,
    /// The path that served it (`io_uring`, `pread`, `cufile-compat`, `io_uring+bounce`, ...).
    pub served_by: String,
    /// Bytes per second / 1e9.
    pub gbps: f64,
    /// Requests per second.
    pub iops: f64,
    /// Median request latency.
    pub lat_p50_us: u32,
    /// 99th percentile request latency.
    pub lat_p99_us: u32,
    /// CPU cores the whole process kept busy (user + system) while it ran.
    pub cores: f64,
    /// The peers on the same target and settings (medians), under --compare: fio (or SPDK's
    /// perf for `spdk`) first, then KvikIO where it ran.
    pub peers: Vec<PeerResult>,
}

/// A peer's throughput at one point.
#[derive(Debug, Clone)]
pub struct PeerResult {
    /// `fio`, `spdk-perf` or `kvikio`.
    pub name: &'static str,
    /// Bytes per second / 1e9.
    pub gbps: f64,
    /// Requests per second.
    pub iops: f64,
    /// CPU cores the peer kept busy (user + system), where it reports them.
    pub cores: Option<f64>,
    /// How the peer ran, where it chose (KvikIO's best thread count).
    pub detail: Option<String>,
}

/// The median of a peer's rounds (each figure separately), standing for the point.
fn median_peer(rounds: &[PeerResult]) -> PeerResult {
    let med = |f: &dyn Fn(&PeerResult) -> f64| {
        let mut v: Vec<f64> = rounds.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // The detail of the median round by throughput.
    let mut by_gbps: Vec<&PeerResult> = rounds.iter().collect();
    by_gbps.sort_by(|x, y| x.gbps.total_cmp(&y.gbps));
    PeerResult {
        name: rounds[0].name,
        gbps: med(&|p| p.gbps),
        iops: med(&|p| p.iops),
        cores: rounds
            .iter()
            .all(|p| p.cores.is_some())
            .then(|| med(&|p| p.cores.unwrap_or(0.0))),
        detail: by_gbps[by_gbps.len() / 2].detail.clone(),
    }
}

struct TaskStats {
    bytes: u64,
    ops: u64,
    lat_us: Vec<u32>,
}

pub async fn run(a: BenchArgs) -> CliResult {
    let cuda = a.to.cuda()?;
    if a.owned && (a.rw == Rw::Write || a.pattern == Pattern::Batch || cuda.is_some()) {
        return Err("--owned reads into host memory (--rw read, --to host, seq or rand)".into());
    }
    if a.pattern == Pattern::Batch && (a.rw == Rw::Write || a.batch == 0) {
        return Err("--pattern batch reads (--rw read) with --batch of at least 1".into());
    }
    if a.bs.iter().any(|b| b.0 == 0)
        || a.qd.contains(&0)
        || a.kvikio_threads.contains(&0)
        || !a.seconds.is_finite()
        || a.seconds <= 0.0
    {
        return Err("--bs, --qd, --seconds and --kvikio-threads must be positive".into());
    }
    if let Some(p) = &a.plot {
        if p.extension().and_then(|e| e.to_str()) != Some("svg") {
            return Err(format!(
                "--plot {}: only SVG is written (name it *.svg)",
                p.display()
            )
            .into());
        }
    }
    let max_bs = a.bs.iter().map(|b| b.0).max().unwrap_or(0);
    let spdk = a.backend.contains(&BenchBackend::Spdk);
    if spdk != a.nvme.is_some() {
        return Err("--backend spdk and --target TRID go together".into());
    }
    let needs_file = a.backend.iter().any(|b| *b != BenchBackend::Spdk);
    // The namespace's span: its size, at most --size.
    let nvme_span = match &a.nvme {
        Some(trid) => {
            let len = Engine::new()?.open_nvme(trid)?.len()?.min(a.size.0);
            if len < max_bs {
                return Err(format!("namespace span {len} is smaller than --bs {max_bs}").into());
            }
            len
        }
        None => 0,
    };

    // The file: given, or a temporary one we fill first (once, for every point).
    let _tmp;
    let path = match &a.file {
        Some(p) => {
            if a.rw == Rw::Write && needs_file {
                check_write_room(p, a.size.0)?;
            }
            p.clone()
        }
        None if !needs_file => PathBuf::new(),
        None => {
            // Refuse a file the filesystem cannot hold before writing any of it; register it
            // so that Ctrl-C or SIGTERM removes it too (the guard's Drop covers errors).
            let dir = std::env::temp_dir();
            crate::cleanup::check_room(&dir, a.size.0, "bench: the temporary file of --size")?;
            let (t, _) = crate::cleanup::TempPath::create(&dir, "gpuio-bench-")?;
            let p = t.path().to_path_buf();
            _tmp = t;
            if a.rw == Rw::Read {
                fill(&Engine::new()?, &p, a.size.0).await?;
            }
            p
        }
    };
    let span = match a.rw {
        _ if !needs_file => nvme_span,
        Rw::Read => {
            // A block device's metadata says 0 bytes; the library asks the device.
            let len = std::fs::File::open(&path)
                .and_then(|f| gpuio::uring::align::file_len(std::os::fd::AsFd::as_fd(&f)))
                .map_err(|e| format!("{}: {e}", path.display()))?;
            if a.file.is_some() {
                len.min(a.size.0)
            } else {
                len
            }
        }
        Rw::Write => a.size.0,
    };
    if span < max_bs {
        return Err(format!("file span {span} is smaller than --bs {max_bs}").into());
    }

    let rounds = a.rounds.max(1);
    let fio_ok = a.compare && needs_file && fio_available();
    if a.compare && needs_file && !fio_ok {
        eprintln!("--compare: fio is not installed (apt-get install fio); measuring gpuio alone");
    }
    let perf = if a.compare && spdk {
        let p = spdk_perf_binary();
        if let Err(why) = &p {
            eprintln!("--compare: {why}; measuring gpuio alone on spdk");
        }
        p.ok()
    } else {
        None
    };
    let mut kvikio = if a.compare && needs_file {
        match kvikio_peer_binary() {
            Ok(bin) if a.pattern == Pattern::Batch => {
                eprintln!(
                    "--compare: {} found, but batches are not compared with KvikIO",
                    bin.display()
                );
                None
            }
            Ok(bin) => Some(bin),
            Err(why) => {
                eprintln!("--compare: {why}; measuring without KvikIO");
                None
            }
        }
    } else {
        None
    };
    let mut results = Vec::new();
    for &backend in &a.backend {
        for bs in a.bs.iter().map(|b| b.0) {
            for &qd in &a.qd {
                let point = Point { backend, bs, qd };
                let mut ours = Vec::with_capacity(rounds);
                let mut peer = Vec::with_capacity(rounds);
                let mut kv = Vec::with_capacity(rounds);
                let span = if backend == BenchBackend::Spdk {
                    nvme_span
                } else {
                    span
                };
                for _ in 0..rounds {
                    ours.push(measure(&a, point, &path, span, cuda.as_ref()).await?);
                    match (backend, &perf) {
                        (BenchBackend::Spdk, Some(bin)) => {
                            peer.push(spdk_perf(&a, point, bin).await?)
                        }
                        (BenchBackend::Engine(_), _) if fio_ok => {
                            peer.push(fio(&a, point, &path, span).await?)
                        }
                        _ => {}
                    }
                    if let (BenchBackend::Engine(_), Some(bin)) = (backend, &kvikio) {
                        match kvikio_peer(&a, point, bin, &path, span).await {
                            Ok(r) => kv.push(r),
                            Err(why) => {
                                // A machine KvikIO cannot run on (no CUDA driver, say): say
                                // so once and go on with the other peers.
                                eprintln!("--compare: KvikIO did not run: {why}");
                                kvikio = None;
                                kv.clear();
                            }
                        }
                    }
                }
                // The median round by throughput stands for the point.
                ours.sort_by(|x, y| x.result.gbps.total_cmp(&y.result.gbps));
                let mut m = ours.swap_remove(ours.len() / 2);
                let peers: Vec<PeerResult> = [peer, kv]
                    .iter()
                    .filter(|r| !r.is_empty())
                    .map(|r| median_peer(r))
                    .collect();
                for (i, p) in peers.iter().enumerate() {
                    let name = p.name;
                    let per_gb = |cores: f64, gbps: f64| {
                        if gbps > 0.0 {
                            format!("{:.3}", cores / gbps)
                        } else {
                            "-".to_string()
                        }
                    };
                    println!(
                        "  vs {name} (medians of {rounds}{}): gpuio {:.3} GB/s {:.0} IOPS, {name} \
                         {:.3} GB/s {:.0} IOPS: gpuio/{name} {:.2} (GB/s), {:.2} (IOPS); \
                         CPU cores gpuio {:.2}, {name} {}; CPU s/GB gpuio {}, {name} {}",
                        p.detail
                            .as_ref()
                            .map_or_else(String::new, |d| format!(", {d}")),
                        m.result.gbps,
                        m.result.iops,
                        p.gbps,
                        p.iops,
                        m.result.gbps / p.gbps,
                        m.result.iops / p.iops,
                        m.result.cores,
                        p.cores
                            .map_or_else(|| "-".to_string(), |c| format!("{c:.2}")),
                        per_gb(m.result.cores, m.result.gbps),
                        p.cores
                            .map_or_else(|| "-".to_string(), |c| per_gb(c, p.gbps)),
                    );
                    let key = name.replace('-', "_");
                    if i == 0 {
                        m.json["peer"] = name.into();
                        m.json["ratio_gbps"] = (m.result.gbps / p.gbps).into();
                        m.json["ratio_iops"] = (m.result.iops / p.iops).into();
                    }
                    m.json[format!("{key}_gbps")] = p.gbps.into();
                    m.json[format!("{key}_iops")] = p.iops.into();
                    m.json[format!("ratio_{key}_gbps")] = (m.result.gbps / p.gbps).into();
                    m.json[format!("ratio_{key}_iops")] = (m.result.iops / p.iops).into();
                    if let Some(c) = p.cores {
                        m.json[format!("{key}_cores")] = c.into();
                    }
                    if let Some(d) = &p.detail {
                        m.json[format!("{key}_detail")] = d.clone().into();
                    }
                }
                m.result.peers = peers;
                if a.json {
                    println!("{}", m.json);
                }
                results.push(m.result);
            }
        }
    }
    if results.len() > 1 || results.iter().any(|m| !m.peers.is_empty()) {
        println!(
            "{:<8} {:>8} {:>5} {:>9} {:>10} {:>8} {:>8}  {:>9} {:>10} {:>7}  served by (peer)",
            "backend",
            "bs",
            "qd",
            "GB/s",
            "IOPS",
            "p50 us",
            "p99 us",
            "peer GB/s",
            "peer IOPS",
            "ratio"
        );
        for m in &results {
            // One row per peer (the gpuio columns repeat), or one without a peer.
            let rows: Vec<(String, String, String, String)> = if m.peers.is_empty() {
                vec![("-".into(), "-".into(), "-".into(), String::new())]
            } else {
                m.peers
                    .iter()
                    .map(|f| {
                        (
                            format!("{:.3}", f.gbps),
                            format!("{:.0}", f.iops),
                            format!("{:.2}", m.gbps / f.gbps),
                            format!(" ({})", f.name),
                        )
                    })
                    .collect()
            };
            for (fg, fi, ratio, who) in rows {
                println!(
                    "{:<8} {:>8} {:>5} {:>9.3} {:>10.0} {:>8} {:>8}  {fg:>9} {fi:>10} {ratio:>7}  {}{who}",
                    m.point.backend.to_string(),
                    short_size(m.point.bs),
                    m.point.qd,
                    m.gbps,
                    m.iops,
                    m.lat_p50_us,
                    m.lat_p99_us,
                    m.served_by
                );
            }
        }
    }
    if let Some(p) = &a.plot {
        let title = format!(
            "gpuio bench: {} {} {} to {}, {}",
            if a.direct { "O_DIRECT" } else { "buffered" },
            format!("{:?}", a.pattern).to_lowercase(),
            format!("{:?}", a.rw).to_lowercase(),
            a.to,
            fmt_bytes(span),
        );
        crate::plot::write_svg(p, &title, &results)?;
        println!("plot written to {}", p.display());
    }
    Ok(())
}

struct PointOutput {
    result: Measurement,
    json: serde_json::Value,
}

/// Runs one point: its own engine, `qd` tasks for `a.seconds`, every latency recorded.
async fn measure(
    a: &BenchArgs,
    point: Point,
    path: &std::path::Path,
    span: u64,
    cuda: Option<&Arc<gpuio::cuda::cudarc::driver::CudaContext>>,
) -> Result<PointOutput, Box<dyn std::error::Error + Send + Sync>> {
    let Point { backend, bs, qd } = point;
    let chunk = a
        .chunk
        .map(|c| c.0)
        .unwrap_or((4u64 << 20).max(bs.next_multiple_of(4096)));
    let pieces_per_req = bs.div_ceil(chunk).max(1) as usize;
    // Blocks in flight: a batch counts as its blocks.
    let blocks = qd
        * if a.pattern == Pattern::Batch {
            a.batch
        } else {
            1
        };
    let qd_engine = (blocks * pieces_per_req).clamp(1, 4096);
    // Room for every request in flight plus as much again awaiting copy-out.
    let pool = (2 * blocks as u64 * bs.max(4096)).max(128 << 20);
    let slots = pool.div_ceil(chunk.next_power_of_two()).clamp(4, 65535) as usize;
    let engine = Engine::builder()
        .backend(match backend {
            BenchBackend::Engine(b) => b,
            BenchBackend::Spdk => Backend::Auto,
        })
        // SPDK reads land in SPDK DMA memory, as they must for local PCIe drives.
        .spdk_memory(backend == BenchBackend::Spdk)
        .chunk_size(chunk as usize)
        .queue_depth(qd_engine)
        .bounce_slots(slots)
        .async_copy_threshold(if a.inline_copies {
            None
        } else {
            Some(64 << 10)
        });
    let engine = match a.reactor_spin_us {
        Some(us) => engine.reactor_spin(Duration::from_micros(us)),
        None => engine,
    };
    let engine = match a.reactor_tick_us {
        Some(us) => engine.reactor_tick(Duration::from_micros(us)),
        None => engine,
    }
    .build()?;
    let nvme = a.nvme.as_deref().filter(|_| backend == BenchBackend::Spdk);
    let file = match a.rw {
        _ if nvme.is_some() => engine.open_nvme(nvme.unwrap_or_default())?,
        Rw::Read => OpenOptions::new()
            .read(true)
            .direct(a.direct)
            .open(&engine, path)?,
        Rw::Write => OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .direct(a.direct)
            .open(&engine, path)?,
    };
    let slots_in_span = span / bs;
    let file = Arc::new(file);
    let cursor = Arc::new(AtomicU64::new(0));
    let bytes_done = Arc::new(AtomicU64::new(0));
    let deadline = Duration::from_secs_f64(a.seconds);
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    let cpu_start = process_cpu_seconds();
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(qd);
    let mut streams = Vec::new();
    for t in 0..qd {
        let (file, cursor, bytes_done) = (file.clone(), cursor.clone(), bytes_done.clone());
        let (rw, pattern) = (a.rw, a.pattern);
        // Each task owns its buffer; on a GPU, its own stream too, so copies overlap.
        let buf_len = match pattern {
            Pattern::Batch => bs as usize * a.batch,
            _ => bs as usize,
        };
        let batch = a.batch;
        let owned = a.owned;
        let mut buf = match cuda {
            None if owned => Buffer::Aligned(gpuio::AlignedBuf::zeroed(buf_len)),
            None => Buffer::Host(vec![0xA5u8; buf_len]),
            Some(ctx) => {
                let stream = ctx
                    .new_stream()
                    .map_err(|e| format!("CUDA stream: {e:?}"))?;
                let d = stream
                    .alloc_zeros::<u8>(buf_len)
                    .map_err(|e| format!("CUDA alloc: {e:?}"))?;
                streams.push(stream);
                Buffer::Gpu(d)
            }
        };
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(0x9e37_79b9 ^ t as u64);
            let mut st = TaskStats {
                bytes: 0,
                ops: 0,
                lat_us: Vec::new(),
            };
            while start.elapsed() < deadline {
                if pattern == Pattern::Batch {
                    // A fresh plan per batch: preparing it is part of the cost measured.
                    let descs = (0..batch)
                        .map(|i| {
                            let off = rng.u64(0..slots_in_span) * bs;
                            ReadDesc::new(&file, off, bs as usize, i * bs as usize)
                        })
                        .collect();
                    let plan = BatchPlan::new(descs);
                    let t0 = Instant::now();
                    let n = match &mut buf {
                        Buffer::Host(b) => plan.read_into(b).await.total()?,
                        Buffer::Aligned(b) => plan.read_into(b).await.total()?,
                        Buffer::Gpu(b) => plan.read_into(b).await.total()?,
                    };
                    st.lat_us
                        .push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                    st.bytes += n as u64;
                    st.ops += batch as u64;
                    bytes_done.fetch_add(n as u64, Ordering::Relaxed);
                    continue;
                }
                let slot = match pattern {
                    Pattern::Rand => rng.u64(0..slots_in_span),
                    _ => cursor.fetch_add(1, Ordering::Relaxed) % slots_in_span,
                };
                let off = slot * bs;
                let t0 = Instant::now();
                let n = match (rw, &mut buf) {
                    (Rw::Read, Buffer::Aligned(b)) => {
                        let (r, back) = file.read_owned(std::mem::take(b), off).await;
                        *b = back;
                        r?
                    }
                    (Rw::Write, Buffer::Aligned(b)) => file.write_from(b, off).await?,
                    (Rw::Read, Buffer::Host(b)) => file.read_into(b, off).await?,
                    (Rw::Write, Buffer::Host(b)) => file.write_from(b, off).await?,
                    (Rw::Read, Buffer::Gpu(b)) => file.read_into(b, off).await?,
                    (Rw::Write, Buffer::Gpu(b)) => file.write_from(b, off).await?,
                };
                st.lat_us
                    .push(t0.elapsed().as_micros().min(u32::MAX as u128) as u32);
                st.bytes += n as u64;
                st.ops += 1;
                bytes_done.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok::<TaskStats, gpuio::Error>(st)
        }));
    }
    let ticker = {
        let pb = pb.clone();
        let bytes_done = bytes_done.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let s = start.elapsed().as_secs_f64();
                pb.set_message(format!(
                    "{:.1}s {} {:.2} GB/s",
                    s,
                    fmt_bytes(bytes_done.load(Ordering::Relaxed)),
                    bytes_done.load(Ordering::Relaxed) as f64 / s / 1e9
                ));
                pb.tick();
            }
        })
    };
    let mut all = TaskStats {
        bytes: 0,
        ops: 0,
        lat_us: Vec::new(),
    };
    for t in tasks {
        let st = t.await??;
        all.bytes += st.bytes;
        all.ops += st.ops;
        all.lat_us.extend(st.lat_us);
    }
    // Device copies are queued when a read resolves: the clock stops when they have landed.
    for s in &streams {
        s.synchronize()
            .map_err(|e| format!("CUDA synchronize: {e:?}"))?;
    }
    if a.rw == Rw::Write {
        file.sync_all().await?;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds() - cpu_start;
    ticker.abort();
    pb.finish_and_clear();
    all.lat_us.sort_unstable();
    let pct = |p: f64| -> u32 {
        if all.lat_us.is_empty() {
            return 0;
        }
        all.lat_us[((all.lat_us.len() - 1) as f64 * p).round() as usize]
    };
    let gbps = all.bytes as f64 / secs / 1e9;
    let iops = all.ops as f64 / secs;
    // Device transfers say whether cuFile served them (and in which mode) or the bounce path.
    let served_by = match cuda {
        _ if file.is_nvme() => "spdk".to_string(),
        Some(_) => match file.gds_status() {
            gpuio::gds::GdsStatus::Bounce(_) => format!("{}+bounce", engine.backend().name),
            s => s.name().to_string(),
        },
        None => engine.backend().name.to_string(),
    };
    println!(
        "{} {:?} {:?} to {} bs={} qd={} {}: {} in {secs:.2} s = {gbps:.3} GB/s, {iops:.0} IOPS, \
         lat p50 {} us p99 {} us, CPU {:.2} cores ({:.3} CPU s/GB), backend {served_by}",
        if a.direct { "O_DIRECT" } else { "buffered" },
        a.pattern,
        a.rw,
        a.to,
        fmt_bytes(bs),
        qd,
        nvme.map_or_else(|| path.display().to_string(), str::to_string),
        fmt_bytes(all.bytes),
        pct(0.5),
        pct(0.99),
        cpu / secs,
        cpu / (all.bytes as f64 / 1e9).max(1e-9),
    );
    let json = serde_json::json!({
        "cpu_cores": cpu / secs,
        "cpu_s_per_gb": cpu / (all.bytes as f64 / 1e9).max(1e-9),
        "bytes": all.bytes,
        "seconds": secs,
        "gbps": gbps,
        "iops": iops,
        "backend": served_by,
        "backend_requested": backend.to_string(),
        "backend_detail": engine.backend().detail,
        "rw": format!("{:?}", a.rw).to_lowercase(),
        "pattern": format!("{:?}", a.pattern).to_lowercase(),
        "bs": bs,
        "qd": qd,
        "direct": a.direct,
        "to": a.to.to_string(),
        "bounce_pinned": engine.bounce_pool_pinned(),
        "inline_copies": a.inline_copies,
        "reactor_spin_us": a.reactor_spin_us,
        "reactor_tick_us": a.reactor_tick_us,
        "ops": all.ops,
        "lat_p50_us": pct(0.5),
        "lat_p99_us": pct(0.99),
        "file": nvme.map_or_else(|| path.display().to_string(), str::to_string),
    });
    Ok(PointOutput {
        result: Measurement {
            point,
            served_by,
            gbps,
            iops,
            lat_p50_us: pct(0.5),
            lat_p99_us: pct(0.99),
            cores: cpu / secs,
            peers: Vec::new(),
        },
        json,
    })
}

/// A peer's name for the point's workload (fio's and perf's agree) and its depth: a batch
/// counts as its blocks.
fn peer_workload(a: &BenchArgs, point: Point) -> (&'static str, usize) {
    let rw = match (a.rw, a.pattern) {
        (Rw::Read, Pattern::Seq) => "read",
        (Rw::Read, _) => "randread",
        (Rw::Write, Pattern::Seq) => "write",
        (Rw::Write, _) => "randwrite",
    };
    let depth = point.qd
        * if a.pattern == Pattern::Batch {
            a.batch
        } else {
            1
        };
    (rw, depth)
}

fn fio_available() -> bool {
    std::process::Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// User + system CPU seconds of this whole process so far (`getrusage(RUSAGE_SELF)`: the
/// reactor, the runtime's workers and io_uring's worker threads, which belong to the process).
fn process_cpu_seconds() -> f64 {
    // SAFETY: plain output struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is valid for writes; RUSAGE_SELF needs nothing else.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// fio with the point's settings on the same file: io_uring engine, one job, `qd` deep (a
/// batch counts as its blocks), for `--seconds`. Reads go to host memory (fio has no GPU
/// target): for device points it stands for the storage side's ceiling.
async fn fio(
    a: &BenchArgs,
    point: Point,
    path: &std::path::Path,
    span: u64,
) -> Result<PeerResult, Box<dyn std::error::Error + Send + Sync>> {
    let (rw, depth) = peer_workload(a, point);
    let args = vec![
        "--name=gpuio-peer".to_string(),
        format!("--filename={}", path.display()),
        format!("--size={span}"),
        format!("--rw={rw}"),
        format!("--bs={}", point.bs),
        format!("--iodepth={depth}"),
        "--ioengine=io_uring".to_string(),
        format!("--direct={}", u8::from(a.direct)),
        // fio drops the file's page cache before it starts unless told not to: a buffered
        // point would then measure fio cold (and leave gpuio's next round cold too).
        "--invalidate=0".to_string(),
        "--time_based".to_string(),
        format!("--runtime={}", a.seconds.ceil().max(1.0) as u64),
        "--output-format=json".to_string(),
    ];
    let out =
        tokio::task::spawn_blocking(move || std::process::Command::new("fio").args(&args).output())
            .await??;
    if !out.status.success() {
        return Err(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    let v: serde_json::Value =
        serde_json::from_slice(&out.stdout).map_err(|e| format!("fio's JSON output: {e}"))?;
    let dir = if a.rw == Rw::Read { "read" } else { "write" };
    let job = &v["jobs"][0][dir];
    let (Some(bw), Some(iops)) = (job["bw_bytes"].as_f64(), job["iops"].as_f64()) else {
        return Err("fio's JSON output has no bw_bytes/iops".into());
    };
    let cpu = &v["jobs"][0];
    let cores = match (cpu["usr_cpu"].as_f64(), cpu["sys_cpu"].as_f64()) {
        (Some(u), Some(s)) => Some((u + s) / 100.0),
        _ => None,
    };
    Ok(PeerResult {
        name: "fio",
        gbps: bw / 1e9,
        iops,
        cores,
        detail: None,
    })
}

/// The KvikIO peer program (`scripts/kvikio-peer.sh` builds it): GPUIO_KVIKIO_PEER, else
/// `kvikio-peer` on PATH; or why there is none.
fn kvikio_peer_binary() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("GPUIO_KVIKIO_PEER") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("GPUIO_KVIKIO_PEER={} is not a file", p.display()))
        };
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("kvikio-peer"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "no KvikIO peer (kvikio-peer on PATH or GPUIO_KVIKIO_PEER; \
             scripts/kvikio-peer.sh builds it)"
                .to_string()
        })
}

/// KvikIO with the point's settings on the same file: `qd` requests of `bs` bytes in flight
/// through `FileHandle::pread`/`pwrite` (KvikIO splits each over its thread pool), into the
/// same kind of memory, for `--seconds` per thread count of `--kvikio-threads`; the best
/// thread count stands for KvikIO. KvikIO runs in its POSIX (compatibility) mode, its fastest
/// path on machines without nvidia-fs (ENVIRONMENT.md).
async fn kvikio_peer(
    a: &BenchArgs,
    point: Point,
    bin: &std::path::Path,
    path: &std::path::Path,
    span: u64,
) -> Result<PeerResult, Box<dyn std::error::Error + Send + Sync>> {
    let threads: Vec<String> = a.kvikio_threads.iter().map(|t| t.to_string()).collect();
    let mut args = vec![
        "--file".to_string(),
        path.display().to_string(),
        "--span".into(),
        span.to_string(),
        "--bs".into(),
        point.bs.to_string(),
        "--qd".into(),
        point.qd.to_string(),
        "--seconds".into(),
        a.seconds.to_string(),
        "--pattern".into(),
        if a.pattern == Pattern::Seq {
            "seq"
        } else {
            "rand"
        }
        .into(),
        "--rw".into(),
        if a.rw == Rw::Read { "read" } else { "write" }.into(),
        "--threads".into(),
        threads.join(","),
    ];
    if a.direct {
        args.push("--direct".into());
    }
    if let Target::Gpu(n) = a.to {
        args.extend(["--gpu".into(), "--device".into(), n.to_string()]);
    }
    let bin = bin.to_path_buf();
    let out =
        tokio::task::spawn_blocking(move || std::process::Command::new(&bin).args(&args).output())
            .await??;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr)
            .trim()
            .to_string()
            .into());
    }
    Ok(parse_kvikio_peer(&String::from_utf8_lossy(&out.stdout))?)
}

/// The KvikIO peer's result: its `{"best":true,...}` line (one line per thread count before).
fn parse_kvikio_peer(text: &str) -> Result<PeerResult, String> {
    let best = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["best"].as_bool() == Some(true))
        .ok_or_else(|| {
            format!(
                "no result line in the KvikIO peer's output: {}",
                text.trim()
            )
        })?;
    let (Some(gbps), Some(iops), Some(threads)) = (
        best["gbps"].as_f64(),
        best["iops"].as_f64(),
        best["threads"].as_u64(),
    ) else {
        return Err(format!(
            "the KvikIO peer's result line lacks figures: {best}"
        ));
    };
    Ok(PeerResult {
        name: "kvikio",
        gbps,
        iops,
        cores: best["cores"].as_f64(),
        detail: Some(format!("KvikIO best at {threads} threads")),
    })
}

/// SPDK's own `perf` example from the build `scripts/spdk.sh` made (next to the library gpuio
/// loads), or why it cannot be run.
fn spdk_perf_binary() -> Result<PathBuf, String> {
    let (lib, _) = gpuio::spdk::probe().library?;
    let home = std::path::Path::new(&lib)
        .parent()
        .and_then(|p| p.parent())
        .ok_or("no SPDK home")?;
    let bin = home.join("bin/perf");
    if bin.exists() {
        Ok(bin)
    } else {
        Err(format!("SPDK's perf is not at {}", bin.display()))
    }
}

/// SPDK's `perf` with the point's settings against the same namespace: one core (the machine's
/// last), `qd` deep (a batch counts as its blocks), for `--seconds`, reads or writes into its
/// own DMA memory (it has no GPU target).
async fn spdk_perf(
    a: &BenchArgs,
    point: Point,
    bin: &std::path::Path,
) -> Result<PeerResult, Box<dyn std::error::Error + Send + Sync>> {
    let (rw, depth) = peer_workload(a, point);
    let trid = a.nvme.clone().unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let lib_dir = bin
        .parent()
        .and_then(|p| p.parent())
        .map(|h| h.join("lib"))
        .unwrap_or_default();
    let args = vec![
        "-q".to_string(),
        depth.to_string(),
        "-o".to_string(),
        point.bs.to_string(),
        "-w".to_string(),
        rw.to_string(),
        "-t".to_string(),
        (a.seconds.ceil().max(1.0) as u64).to_string(),
        "-c".to_string(),
        format!("{:#x}", 1u64 << (cores - 1).min(63)),
        "-r".to_string(),
        trid,
    ];
    let bin = bin.to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&bin)
            .args(&args)
            .env("LD_LIBRARY_PATH", &lib_dir)
            .output()
    })
    .await??;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "SPDK perf failed: {}{}",
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    // "Total : <IOPS> <MiB/s> <avg us> <min> <max>"
    let nums: Vec<f64> = text
        .lines()
        .find(|l| l.trim_start().starts_with("Total"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, r)| {
            r.split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let [iops, mibs, ..] = nums[..] else {
        return Err(format!("no Total line in SPDK perf's output: {}", text.trim()).into());
    };
    Ok(PeerResult {
        name: "spdk-perf",
        gbps: mibs * 1048576.0 / 1e9,
        iops,
        // perf does not report it (it busy-polls its one core by design).
        cores: None,
        detail: None,
    })
}

/// `--rw write --file PATH` grows a regular file (or makes one) up to --size: refuse that
/// up front when the filesystem lacks the room, as for the temporary file. A block device
/// (or anything else that is not a regular file) has its size already.
fn check_write_room(path: &std::path::Path, size: u64) -> CliResult {
    let have = match std::fs::metadata(path) {
        Ok(m) if m.is_file() => m.len(),
        Ok(_) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        // Opening it later reports the problem with its path.
        Err(_) => return Ok(()),
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    crate::cleanup::check_room(dir, size.saturating_sub(have), "bench --rw write: --size")?;
    Ok(())
}

/// Fills a fresh file with `size` pseudo-random bytes through the engine.
async fn fill(engine: &Engine, path: &std::path::Path, size: u64) -> CliResult {
    let f = engine.create(path)?;
    const BLOCK: u64 = 8 << 20;
    let mut rng = fastrand::Rng::with_seed(1);
    let mut buf = vec![0u8; BLOCK as usize];
    rng.fill(&mut buf);
    let mut off = 0;
    while off < size {
        let n = BLOCK.min(size - off) as usize;
        f.write_from(&buf[..n], off).await?;
        off += n as u64;
    }
    f.sync_all().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(gbps: f64, cores: Option<f64>, detail: &str) -> PeerResult {
        PeerResult {
            name: "kvikio",
            gbps,
            iops: gbps * 1000.0,
            cores,
            detail: Some(detail.to_string()),
        }
    }

    #[test]
    fn a_peer_point_is_the_median_of_its_rounds() {
        let m = median_peer(&[
            peer(47.0, Some(2.0), "8"),
            peer(31.0, Some(1.0), "4"),
            peer(46.0, Some(3.0), "16"),
        ]);
        assert_eq!(m.gbps, 46.0);
        assert_eq!(m.iops, 46000.0);
        assert_eq!(m.cores, Some(2.0));
        // The detail comes from the median round by throughput.
        assert_eq!(m.detail.as_deref(), Some("16"));
        // One round without a CPU figure: no CPU figure for the point.
        let m = median_peer(&[peer(1.0, Some(1.0), "a"), peer(2.0, None, "b")]);
        assert_eq!(m.cores, None);
    }

    #[test]
    fn the_kvikio_peer_reports_its_best_thread_count() {
        let out = concat!(
            r#"{"threads":8,"gbps":47.1,"iops":2807.0,"cores":3.2}"#,
            "\n",
            r#"{"threads":16,"gbps":46.5,"iops":2771.0,"cores":5.0}"#,
            "\n",
            r#"{"best":true,"threads":8,"gbps":47.1,"iops":2807.0,"cores":3.2,"memory":"device"}"#,
            "\n"
        );
        let p = parse_kvikio_peer(out).unwrap();
        assert_eq!(
            (p.name, p.gbps, p.iops, p.cores),
            ("kvikio", 47.1, 2807.0, Some(3.2))
        );
        assert_eq!(p.detail.as_deref(), Some("KvikIO best at 8 threads"));
        let err = parse_kvikio_peer(r#"{"threads":8,"gbps":1.0}"#).unwrap_err();
        assert!(err.contains("no result line"), "{err}");
        let err = parse_kvikio_peer(r#"{"best":true,"gbps":1.0}"#).unwrap_err();
        assert!(err.contains("lacks figures"), "{err}");
    }
}
