//! `gpuio load PATH`: load a checkpoint (a `.safetensors` file, a model directory or an
//! index file) into GPU or host memory, whole or across tensor-parallel ranks, optionally
//! verify every tensor against the file's bytes, and report GB/s and the path that served.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use gpuio::Engine;
use gpuio::safetensors::{FileTensor, Replicas, SafetensorsModel, Shard};

use crate::CliResult;
use crate::bench::Target;
use crate::size::fmt_bytes;
use crate::stdout::outln;

#[derive(Args, Debug)]
pub struct LoadArgs {
    /// A .safetensors file, a model directory (through model.safetensors.index.json where it
    /// has one) or an index file.
    path: PathBuf,
    /// Destination: host, gpu (GPU 0), gpu:N, or a list gpu:N,M,... for the ranks of --tp.
    #[arg(long, default_value = "gpu")]
    to: Target,
    /// Tensor-parallel ranks: every tensor of two or more dimensions split along dimension 0
    /// where it divides evenly, every other tensor replicated; rank r on the r-th GPU of --to
    /// (round robin), or in host memory.
    #[arg(long)]
    tp: Option<usize>,
    /// Whole copies of the checkpoint, one per rank: rank r on the r-th GPU of --to (round
    /// robin), or in host memory. Not with --tp.
    #[arg(long, conflicts_with = "tp")]
    replicas: Option<usize>,
    /// How tensors every rank holds whole reach the ranks' GPUs: auto (read once and copied
    /// GPU to GPU where the GPUs reach each other directly), once, or each (every rank reads
    /// them from the file).
    #[arg(long, default_value = "auto", value_parser = str::parse::<Replicas>)]
    replicate_by: Replicas,
    /// Compare every loaded tensor with the file's bytes read by std::fs.
    #[arg(long)]
    verify: bool,
    /// A progress bar on stderr: on by default where stderr is a terminal.
    #[arg(long, overrides_with = "no_progress")]
    progress: bool,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Loads in a row in one process (each timed).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Runs of 2 MiB or more that the page cache holds copied straight from it into GPU
    /// memory, without a CPU copy (`EngineBuilder::mapped_reads`).
    #[arg(long)]
    mapped_reads: bool,
    /// Reactor threads of the engine (`EngineBuilder::reactors`); the library's default
    /// (one) when absent.
    #[arg(long, value_parser = crate::validate::whole(1usize, 64))]
    reactors: Option<usize>,
}

pub async fn run(a: LoadArgs) -> CliResult {
    if a.repeat == 0 || a.repeat > 1000 {
        return Err(format!("--repeat {}: want 1 to 1000", a.repeat).into());
    }
    for (flag, n) in [("--tp", a.tp), ("--replicas", a.replicas)] {
        if n.is_some_and(|n| n == 0 || n > gpuio::safetensors::MAX_RANKS) {
            return Err(format!(
                "{flag} {}: want 1 to {}",
                n.unwrap_or(0),
                gpuio::safetensors::MAX_RANKS
            )
            .into());
        }
    }
    // Ranks and how each tensor reaches them: split (--tp) or whole (--replicas).
    let ranks = match (a.tp, a.replicas) {
        (Some(n), _) => Some((n, tp_rule as Rule, "ranks")),
        (None, Some(n)) => Some((n, replicate_rule as Rule, "replicas")),
        (None, None) => None,
    };
    let mut engine = Engine::builder().mapped_reads(a.mapped_reads);
    if let Some(n) = a.reactors {
        engine = engine.reactors(n);
    }
    let engine = engine.build()?;
    let t = Instant::now();
    let mut model = SafetensorsModel::open(&engine, &a.path).await?;
    let show_progress = !a.no_progress && (a.progress || std::io::stderr().is_terminal());
    let bytes: u64 = model.tensors().map(|(_, t)| t.byte_len() as u64).sum();
    outln!(
        "{}: {} tensors, {} in {} file(s); headers read in {:.1} ms",
        a.path.display(),
        model.len(),
        fmt_bytes(bytes),
        model.shards().len(),
        t.elapsed().as_secs_f64() * 1e3
    )?;
    let gpus = a.to.gpus();
    let streams = gpus
        .iter()
        .map(|&g| gpuio::cuda::context(g).map(|c| c.default_stream()))
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(s) = streams.first() {
        let t = Instant::now();
        let pinned = engine.prepare_device(s.context());
        outln!(
            "bounce pool pinned with CUDA: {pinned} ({:.1} ms, start-up, not timed below)",
            t.elapsed().as_secs_f64() * 1e3
        )?;
    }
    let path = model.shards()[0].file().gds_status();
    for round in 1..=a.repeat {
        let rss_before = rss_kib("VmRSS:");
        reset_peak_rss();
        let bar = show_progress.then(|| {
            let p = gpuio::Progress::new();
            model.set_progress(Some(p.clone()));
            ProgressBar::start(p)
        });
        let (t, cpu0) = (Instant::now(), crate::bench::process_cpu_seconds());
        let mapped0 = engine.mapped_reads();
        let loaded = match ranks {
            None => load_whole(&model, &streams, a.verify).await,
            Some((n, rule, _)) => {
                load_ranks(&model, &streams, n, rule, a.replicate_by, a.verify).await
            }
        };
        let secs = t.elapsed().as_secs_f64();
        let cpu = crate::bench::process_cpu_seconds() - cpu0;
        // The bar stops (and clears its line) before anything else is printed, error or not.
        drop(bar);
        model.set_progress(None);
        let checked = loaded?;
        outln!(
            "load {round}: {} in {secs:.3} s = {:.2} GB/s into {}{} via {path}{}{}; CPU {:.2} \
             cores ({:.3} CPU s/GB)",
            fmt_bytes(bytes),
            bytes as f64 / secs / 1e9,
            a.to,
            ranks.map_or(String::new(), |(n, _, what)| format!(" ({n} {what})")),
            if a.mapped_reads {
                format!(", {} runs mapped", engine.mapped_reads() - mapped0)
            } else {
                String::new()
            },
            if a.verify {
                format!("; verified {checked} tensors")
            } else {
                String::new()
            },
            cpu / secs.max(1e-9),
            cpu / (bytes as f64 / 1e9).max(1e-9),
        )?;
        if let (Some(before), Some(peak)) = (rss_before, rss_kib("VmHWM:")) {
            // With --verify the host copies and file reads count too.
            outln!(
                "  host memory: peak resident {} above the {} before the load (bounce pool {})",
                fmt_bytes(peak.saturating_sub(before) << 10),
                fmt_bytes(before << 10),
                fmt_bytes(engine.bounce_bytes() as u64)
            )?;
        }
    }
    Ok(())
}

/// A `/proc/self/status` field in KiB (`VmRSS:` now, `VmHWM:` the peak since the last
/// [`reset_peak_rss`]); `None` where the file or field is missing.
fn rss_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line[field.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// Resets the kernel's peak-RSS mark (`VmHWM`) to the current RSS, so that the next reading
/// is this load's peak (writing 5 to `/proc/self/clear_refs`; Linux ≥ 4.0). Without it the
/// peak is the process's since it started, an upper bound.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Where each tensor goes across ranks.
type Rule = fn(&FileTensor, usize) -> Option<Shard>;

/// The `--tp` rule: split along dimension 0 where it divides evenly, else replicate.
fn tp_rule(t: &FileTensor, ranks: usize) -> Option<Shard> {
    if t.shape.len() >= 2 && t.shape[0] % ranks == 0 {
        Some(Shard::Split(0))
    } else {
        Some(Shard::Replicate)
    }
}

/// The `--replicas` rule: every tensor whole on every rank.
fn replicate_rule(_: &FileTensor, _: usize) -> Option<Shard> {
    Some(Shard::Replicate)
}

/// A progress bar on stderr, redrawn ten times a second from its own thread until dropped
/// (which draws the final count, then clears the line).
struct ProgressBar {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ProgressBar {
    fn start(p: Arc<gpuio::Progress>) -> ProgressBar {
        use std::io::Write;
        use std::sync::atomic::Ordering;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let halt = stop.clone();
        let thread = std::thread::spawn(move || {
            let t = Instant::now();
            let mut err = std::io::stderr();
            loop {
                // The last frame is drawn after the stop, so it shows the final count.
                let stopping = halt.load(Ordering::Acquire);
                let (done, total) = (p.done(), p.total());
                let width = 30;
                let filled = (done * width).checked_div(total).unwrap_or(0).min(width) as usize;
                let _ = write!(
                    err,
                    "\r[{}{}] {} / {}  {:.2} GB/s ",
                    "#".repeat(filled),
                    ".".repeat(width as usize - filled),
                    fmt_bytes(done),
                    fmt_bytes(total),
                    done as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9
                );
                let _ = err.flush();
                if stopping {
                    break;
                }
                std::thread::park_timeout(std::time::Duration::from_millis(100));
            }
            // Clear the bar's line for what is printed next.
            let _ = write!(err, "\r{}\r", " ".repeat(80));
            let _ = err.flush();
        });
        ProgressBar {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for ProgressBar {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

/// Loads every tensor into one buffer (GPU `streams[0]`, or host memory); returns the tensors
/// verified.
async fn load_whole(
    model: &SafetensorsModel,
    streams: &[Arc<gpuio::cuda::cudarc::driver::CudaStream>],
    verify: bool,
) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    let Some(stream) = streams.first() else {
        let ck = model.load_host(|_| true).await?;
        return Ok(if verify {
            check_against_files(model, ck.iter())?
        } else {
            0
        });
    };
    let ck = model.load_device(stream, |_| true).await?;
    stream.synchronize()?;
    if !verify {
        return Ok(0);
    }
    let host = stream.clone_dtoh(ck.buffer())?;
    let parts = ck
        .tensors()
        .iter()
        .map(|t| (t, &host[t.buffer_range.clone()]));
    check_against_files(model, parts)
}

/// Loads every rank's shards (rank r on `streams[r % len]`, or host memory); with `verify`,
/// each rank's bytes are compared with the same ranks loaded into host memory, which reads
/// the same parts of the files through another path.
async fn load_ranks(
    model: &SafetensorsModel,
    streams: &[Arc<gpuio::cuda::cudarc::driver::CudaStream>],
    ranks: usize,
    rule: Rule,
    replicas: Replicas,
    verify: bool,
) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    let rule = move |t: &FileTensor| rule(t, ranks);
    if streams.is_empty() {
        let loaded = model.load_shards_host(ranks, rule).await?;
        return Ok(loaded.iter().map(|c| c.tensors().len()).sum());
    }
    let rank_streams: Vec<_> = (0..ranks)
        .map(|r| streams[r % streams.len()].clone())
        .collect();
    let loaded = model
        .load_shards_device_with(&rank_streams, rule, replicas)
        .await?;
    for s in &rank_streams {
        s.synchronize()?;
    }
    if !verify {
        return Ok(0);
    }
    let want = model.load_shards_host(ranks, rule).await?;
    let mut checked = 0;
    for (rank, (got, want)) in loaded.iter().zip(&want).enumerate() {
        let host = rank_streams[rank].clone_dtoh(got.buffer())?;
        for t in got.tensors() {
            if host[t.buffer_range.clone()] != *want.bytes(&t.name)? {
                return Err(
                    format!("rank {rank}: tensor {:?} differs from the file", t.name).into(),
                );
            }
            checked += 1;
        }
    }
    Ok(checked)
}

/// Compares each loaded tensor with its bytes in its shard, read with `std::fs`.
fn check_against_files<'a>(
    model: &SafetensorsModel,
    loaded: impl Iterator<Item = (&'a gpuio::safetensors::Tensor, &'a [u8])>,
) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    use std::os::unix::fs::FileExt;
    let mut checked = 0;
    for (t, got) in loaded {
        let (shard, listed) = model
            .tensor(&t.name)
            .ok_or_else(|| format!("tensor {:?} is not in the checkpoint", t.name))?;
        let f = std::fs::File::open(shard.file().path())?;
        let mut want = vec![0u8; listed.byte_len()];
        f.read_exact_at(&mut want, listed.file_range.start)?;
        if want != got {
            return Err(format!(
                "tensor {:?} differs from {}",
                t.name,
                shard.file().path().display()
            )
            .into());
        }
        checked += 1;
    }
    Ok(checked)
}
