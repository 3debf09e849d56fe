//! `gpuio bench`: fio-like throughput and IOPS of the engine on one file.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpuio::{Backend, Engine, EngineBuilder, OpenOptions};

use crate::CliResult;
use crate::size::fmt_bytes;
use crate::stdout::outln;
use crate::validate;

mod args;
mod peers;
mod report;
mod task;
mod threads;

use report::{PeerFields, PointJson};
use task::{Buffer, TaskStats};

pub use args::{BenchArgs, BenchBackend, Pattern, Rw, Target};
use peers::{
    Peer, PeerResult, fio, fio_available, kvikio_peer, kvikio_peer_binary, median_peer, spdk_perf,
    spdk_perf_binary,
};

/// How the refusals of a --file end.
const BENCH_FILES: &str = "gpuio benchmarks regular files and block devices";

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
    pub lat_p50_us: u64,
    /// 99th percentile request latency.
    pub lat_p99_us: u64,
    /// CPU cores the whole process kept busy (user + system) while it ran.
    pub cores: f64,
    /// The peers on the same target and settings (medians), under --compare: fio (or SPDK's
    /// perf for `spdk`) first, then KvikIO where it ran.
    pub peers: Vec<PeerResult>,
}

pub async fn run(a: BenchArgs) -> CliResult {
    a.check()?;
    let cuda = a.to.cudas()?;
    if a.no_event_tracking {
        for ctx in &cuda {
            // SAFETY: cudarc's events order a buffer's uses on different streams; every
            // buffer the bench makes is used on one stream only (its task's, or the one all
            // tasks share), read into by gpuio on that stream, and freed on it after the
            // stream is synchronised, so stream order alone orders its uses.
            unsafe { ctx.disable_event_tracking() };
        }
    }
    let max_bs = a.bs.iter().map(|b| b.0).max().unwrap_or(0);
    let spdk = a.backend.contains(&BenchBackend::Spdk);
    let needs_file = a.backend.iter().any(|b| *b != BenchBackend::Spdk);
    // A given file is looked at before any work: what it is (a FIFO would block a plain
    // open, a directory or /dev/zero has nothing to measure) and, for reads, its length.
    let given_len = match (&a.file, a.rw) {
        (Some(p), Rw::Read) if needs_file => {
            let f = validate::open_data_file(p, BENCH_FILES)?;
            // A block device's metadata says 0 bytes; the library asks the device.
            let len = gpuio::plan::align::file_len(std::os::fd::AsFd::as_fd(&f))
                .map_err(|e| format!("{}: {e}", p.display()))?;
            Some(len)
        }
        (Some(p), Rw::Write) if needs_file => {
            // Written files may not exist yet (they are created); existing ones must be data.
            if let Ok(m) = std::fs::metadata(p) {
                validate::refuse_unless_data(p, m.file_type(), BENCH_FILES)?;
            }
            None
        }
        _ => None,
    };
    // The namespace's span: its size, at most --size.
    let nvme_span = match &a.nvme {
        Some(trid) => {
            let engine = nvme_engine(Engine::builder().bounce_slots(1), "--target", trid)?;
            let len = engine.open_nvme(trid)?.len()?.min(a.size.0);
            if len < max_bs {
                return Err(format!(
                    "--target {trid}: the namespace span of {} is smaller than --bs {}",
                    fmt_bytes(len),
                    fmt_bytes(max_bs)
                )
                .into());
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
        Rw::Read => match given_len {
            Some(len) => len.min(a.size.0),
            None => gpuio::plan::align::file_len(std::os::fd::AsFd::as_fd(
                &std::fs::File::open(&path).map_err(|e| format!("{}: {e}", path.display()))?,
            ))
            .map_err(|e| format!("{}: {e}", path.display()))?,
        },
        Rw::Write => a.size.0,
    };
    if needs_file && span < max_bs {
        return Err(format!(
            "{}: {} to read{} is less than --bs {}",
            path.display(),
            fmt_bytes(span),
            if a.file.is_some() {
                " (at most --size)"
            } else {
                ""
            },
            fmt_bytes(max_bs)
        )
        .into());
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
                    ours.push(measure(&a, point, &path, span, &cuda).await?);
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
                report::against_peers(&mut m, &peers, rounds)?;
                m.result.peers = peers;
                if a.json {
                    outln!("{}", serde_json::to_string(&m.json)?)?;
                }
                results.push(m.result);
            }
        }
    }
    report::summary(&results)?;
    if let Some(p) = &a.plot {
        let title = format!(
            "gpuio bench: {} {} {} to {}, {}",
            if a.direct { "O_DIRECT" } else { "buffered" },
            format!("{:?}", a.pattern).to_lowercase(),
            format!("{:?}", a.rw).to_lowercase(),
            a.to,
            fmt_bytes(span),
        );
        crate::plot::write_svg(p, &title, &results)
            .map_err(|e| format!("--plot {}: {e}", p.display()))?;
        outln!("plot written to {}", p.display())?;
    }
    Ok(())
}

struct PointOutput {
    result: Measurement,
    json: PointJson,
}

/// Runs one point: its own engine, `qd` tasks for `a.seconds`, every latency recorded in a
/// histogram.
async fn measure(
    a: &BenchArgs,
    point: Point,
    path: &std::path::Path,
    span: u64,
    cudas: &[crate::bench::args::Cuda],
) -> Result<PointOutput, Box<dyn std::error::Error + Send + Sync>> {
    let Point { backend, bs, qd } = point;
    // The engine's own defaults (sized from the machine), as a user gets them; the bench only
    // raises the depth and the pool where its own concurrency needs more, and --chunk and
    // --iowq-workers override.
    let mut builder = Engine::builder();
    if let Some(c) = a.chunk {
        builder = builder.chunk_size(c.0 as usize);
    }
    if let Some(w) = a.iowq_workers {
        builder = builder.iowq_workers(w);
    }
    if let Some(n) = a.page_cache_copies {
        builder = builder.page_cache_copies(n);
    }
    if let Some(n) = a.copies_per_device {
        builder = builder.copies_per_device(n);
    }
    if a.no_residency {
        builder = builder.residency_aware(false);
    }
    if let Some(max) = a.page_cache_read_max {
        builder = builder.page_cache_read_max(max.0 as usize);
    }
    let base = builder.sizing();
    let chunk = if a.direct || backend == BenchBackend::Spdk {
        base.direct_chunk
    } else {
        base.buffered_chunk
    } as u64;
    let pieces_per_req = bs.div_ceil(chunk).max(1) as usize;
    // Blocks in flight: a batch counts as its blocks.
    let blocks = qd
        * if a.pattern == Pattern::Batch {
            a.batch
        } else {
            1
        };
    // Saturating: both are clamped below, and huge products (device buffers are not bounded
    // by host memory) must not overflow on the way.
    let qd_engine = blocks
        .saturating_mul(pieces_per_req)
        .clamp(base.queue_depth, 4096);
    // Room for every request in flight plus as much again awaiting copy-out.
    let pool = (2 * blocks as u64)
        .saturating_mul(bs.max(4096))
        .max(base.bounce_bytes as u64);
    let slots = pool.div_ceil(base.block() as u64).clamp(4, 65535) as usize;
    let engine = builder
        .backend(match backend {
            BenchBackend::Engine(b) => b,
            BenchBackend::Spdk => Backend::Auto,
        })
        // SPDK reads land in SPDK DMA memory, as they must for local PCIe drives.
        .spdk_memory(backend == BenchBackend::Spdk)
        .queue_depth(qd_engine)
        .bounce_slots(slots)
        .page_cache_fast_path(!a.no_fast_path)
        .mapped_reads(a.mapped_reads)
        .async_copy_threshold(if a.inline_copies {
            None
        } else {
            Some(a.async_copy_min.map_or(64 << 10, |b| b.0 as usize))
        });
    let engine = match a.reactor_spin_us {
        Some(us) => engine.reactor_spin(Duration::from_micros(us)),
        None => engine,
    };
    let engine = match a.reactor_tick_us {
        Some(us) => engine.reactor_tick(Duration::from_micros(us)),
        None => engine,
    };
    let engine = match a.reactors {
        Some(n) => engine.reactors(n as usize),
        None => engine,
    };
    let engine = match a.sqpoll_idle_ms {
        Some(ms) => engine.submission_polling(Duration::from_millis(ms)),
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
    let bytes_done = Arc::new(AtomicU64::new(0));
    let pb = indicatif::ProgressBar::new_spinner();
    pb.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    // Each request owns its buffer; on a GPU, its own stream too, so copies overlap.
    let buf_len = match a.pattern {
        // `BenchArgs::check` made sure this fits in memory, hence in a usize.
        Pattern::Batch => bs as usize * a.batch * if a.scatter { 2 } else { 1 },
        _ => bs as usize,
    };
    let mut buffers = Vec::with_capacity(qd);
    let mut streams = Vec::new();
    for t in 0..qd {
        // Requests are spread over the GPUs round-robin.
        let buf = match cudas.get(t % cudas.len().max(1)) {
            None if a.owned => Buffer::Aligned(gpuio::AlignedBuf::zeroed(buf_len)),
            None if a.blocking => Buffer::Blocking(vec![0xA5u8; buf_len]),
            None => Buffer::Host(vec![0xA5u8; buf_len]),
            Some(ctx) => {
                let mine =
                    streams
                        .iter()
                        .find(|s: &&Arc<gpuio::cuda::cudarc::driver::CudaStream>| {
                            Arc::ptr_eq(s.context(), ctx)
                        });
                let stream = match mine {
                    _ if a.default_stream => ctx.default_stream(),
                    Some(s) if a.one_stream => Arc::clone(s),
                    _ => ctx
                        .new_stream()
                        .map_err(|e| format!("CUDA stream: {e:?}"))?,
                };
                let d = stream
                    .alloc_zeros::<u8>(buf_len)
                    .map_err(|e| format!("CUDA alloc: {e:?}"))?;
                streams.push(stream);
                Buffer::Gpu(d)
            }
        };
        buffers.push((t, buf));
    }
    let cpu_start = process_cpu_seconds();
    let reactor_start = threads::cpu_by_thread(threads::REACTOR);
    let occ_start = engine.occupancy();
    let start = Instant::now();
    let work = Arc::new(task::Workload {
        file: Arc::new(file),
        rw: a.rw,
        pattern: a.pattern,
        bs,
        batch: a.batch,
        gap: if a.scatter { 2 } else { 1 },
        slots_in_span: span / bs,
        cursor: AtomicU64::new(0),
        bytes_done: Arc::clone(&bytes_done),
        start,
        deadline: Duration::from_secs_f64(a.seconds),
    });
    // Request t goes to task t % jobs: one task per request unless --jobs says fewer.
    let jobs = a.jobs.unwrap_or(qd).clamp(1, qd.max(1));
    let mut shares: Vec<Vec<(usize, Buffer)>> = (0..jobs).map(|_| Vec::new()).collect();
    for (t, buf) in buffers {
        shares[t % jobs].push((t, buf));
    }
    let tasks: Vec<_> = shares
        .into_iter()
        .map(|share| tokio::spawn(task::job(Arc::clone(&work), share)))
        .collect();
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
    let mut all = TaskStats::new();
    let mut per_gpu = vec![0u64; cudas.len()];
    for task in tasks {
        for (t, st) in task.await?? {
            if let Some(b) = per_gpu.get_mut(t % cudas.len().max(1)) {
                *b += st.bytes;
            }
            all.merge(&st)?;
        }
    }
    // Device copies are queued when a read resolves: the clock stops when they have landed.
    for s in &streams {
        s.synchronize()
            .map_err(|e| format!("CUDA synchronize: {e:?}"))?;
    }
    if a.rw == Rw::Write {
        work.file.sync_all().await?;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = process_cpu_seconds() - cpu_start;
    let reactor_end = threads::cpu_by_thread(threads::REACTOR);
    let occ = engine.occupancy().since(&occ_start);
    ticker.abort();
    pb.finish_and_clear();
    // 0 where nothing completed.
    let pct = |q: f64| all.lat_us.value_at_quantile(q);
    let gbps = all.bytes as f64 / secs / 1e9;
    let iops = all.ops as f64 / secs;
    // Device transfers say whether cuFile served them (and in which mode) or the bounce path.
    let served_by = match cudas.first() {
        _ if work.file.is_nvme() => "spdk".to_string(),
        Some(_) => match work.file.gds_status() {
            gpuio::gds::GdsStatus::Bounce(_) => format!("{}+bounce", engine.backend().name),
            s => s.name().to_string(),
        },
        None => engine.backend().name.to_string(),
    };
    // Requests the polling thread served from the page cache (`page_cache_fast_path`), as a
    // share of all: the path that served them is not the backend's.
    let cached_share = (engine.cached_reads() as f64 / all.ops.max(1) as f64).min(1.0);
    let fast = if cached_share > 0.0 {
        format!(
            " ({:.0}% of requests from the page cache in poll)",
            cached_share * 100.0
        )
    } else {
        String::new()
    };
    // Requests copied straight from registered page-cache mappings (`--mapped-reads`).
    let mapped_share = a
        .mapped_reads
        .then(|| (engine.mapped_reads() as f64 / all.ops.max(1) as f64).min(1.0));
    let fast = match mapped_share {
        Some(m) => format!("{fast} ({:.0}% of requests mapped, no CPU copy)", m * 100.0),
        None => fast,
    };
    outln!(
        "{} {:?}{} {:?} to {} bs={} qd={} {}: {} in {secs:.2} s = {gbps:.3} GB/s, {iops:.0} IOPS, \
         lat p50 {} us p99 {} us, CPU {:.2} cores ({:.3} CPU s/GB, {:.2} CPU s per million \
         requests), backend {served_by}{fast}",
        if a.direct { "O_DIRECT" } else { "buffered" },
        a.pattern,
        if a.scatter { " (scattered)" } else { "" },
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
        cpu / (all.ops as f64 / 1e6).max(1e-9),
    )?;
    let per_gpu_gbps: Vec<f64> = per_gpu.iter().map(|&b| b as f64 / secs / 1e9).collect();
    if per_gpu.len() > 1 {
        let each: Vec<String> =
            a.to.gpus()
                .iter()
                .zip(&per_gpu_gbps)
                .map(|(n, g)| format!("gpu:{n} {g:.3} GB/s"))
                .collect();
        outln!("  per GPU: {} (aggregate {gbps:.3} GB/s)", each.join(", "))?;
    }
    let reactor_busy = threads::cores_between(&reactor_start, &reactor_end, secs);
    let reactor_cores = reactor_busy.as_ref().map(|b| b.busiest);
    if occ.seconds() > 0.0 {
        let reactor = reactor_busy.map_or_else(String::new, |b| match b.threads {
            1 => format!(
                "; reactor thread {:.2} cores (near 1: the reactor is the limit)",
                b.busiest
            ),
            n => format!(
                "; {n} reactor threads {:.2} cores, the busiest {:.2} (near 1: it is the limit)",
                b.total, b.busiest
            ),
        });
        outln!(
            "  engine (queue depth {}): {occ}{reactor}",
            engine.queue_depth()
        )?;
    }
    let file_name = nvme.map_or_else(|| path.display().to_string(), str::to_string);
    let json = PointJson {
        bytes: all.bytes,
        seconds: secs,
        gbps,
        iops,
        ops: all.ops,
        lat_p50_us: pct(0.5),
        lat_p99_us: pct(0.99),
        cpu_cores: cpu / secs,
        cpu_s_per_gb: cpu / (all.bytes as f64 / 1e9).max(1e-9),
        cpu_s_per_mreq: cpu / (all.ops as f64 / 1e6).max(1e-9),
        reactor_cores,
        backend: served_by.clone(),
        backend_requested: backend.to_string(),
        backend_detail: engine.backend().detail.clone(),
        bounce_pinned: engine.bounce_pool_pinned(),
        rw: a.rw,
        pattern: a.pattern,
        bs,
        qd,
        direct: a.direct,
        to: a.to.to_string(),
        per_gpu_gbps: (per_gpu_gbps.len() > 1).then_some(per_gpu_gbps),
        cached_share,
        mapped_share,
        jobs: a.jobs,
        occupancy: crate::bench::report::OccupancyJson {
            in_kernel: occ.mean_in_kernel(),
            gated: occ.mean_gated(),
            starved_share: occ.starved_share(),
        },
        inline_copies: a.inline_copies,
        reactor_spin_us: a.reactor_spin_us,
        reactor_tick_us: a.reactor_tick_us,
        reactors: engine.reactors(),
        file: file_name,
        vs: None,
        peers: PeerFields::default(),
    };
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

/// User + system CPU seconds of this whole process so far (`getrusage(RUSAGE_SELF)`: the
/// reactor, the runtime's workers and io_uring's worker threads, which belong to the process).
pub(crate) fn process_cpu_seconds() -> f64 {
    // SAFETY: plain output struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is valid for writes; RUSAGE_SELF needs nothing else.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return 0.0;
    }
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// An engine for the SPDK namespace `trid` (named by `flag`): its bounce pool in SPDK's DMA
/// memory, which local PCIe drives need (and NVMe/TCP can use). Without it, opening a PCIe
/// drive fails with advice for library users (`EngineBuilder::spdk_memory`) that a CLI user
/// cannot follow. Where SPDK or its hugepages are missing, the error says which, with the
/// command that provides them.
pub fn nvme_engine(builder: EngineBuilder, flag: &str, trid: &str) -> Result<Engine, String> {
    builder
        .spdk_memory(true)
        .build()
        .map_err(|e| format!("{flag} {trid}: an engine with SPDK DMA memory: {e}"))
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
