//! `gpuio load PATH`: load a checkpoint (a `.safetensors` file, a model directory or an
//! index file) into GPU or host memory, whole or across tensor-parallel ranks, optionally
//! verify every tensor against the file's bytes, and report GB/s and the path that served.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use gpuio::Engine;
use gpuio::safetensors::{FileTensor, SafetensorsModel, Shard};

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
    /// Compare every loaded tensor with the file's bytes read by std::fs.
    #[arg(long)]
    verify: bool,
    /// Loads in a row in one process (each timed).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
}

pub async fn run(a: LoadArgs) -> CliResult {
    if a.repeat == 0 || a.repeat > 1000 {
        return Err(format!("--repeat {}: want 1 to 1000", a.repeat).into());
    }
    if a.tp
        .is_some_and(|n| n == 0 || n > gpuio::safetensors::MAX_RANKS)
    {
        return Err(format!(
            "--tp {}: want 1 to {}",
            a.tp.unwrap_or(0),
            gpuio::safetensors::MAX_RANKS
        )
        .into());
    }
    let engine = Engine::new()?;
    let t = Instant::now();
    let model = SafetensorsModel::open(&engine, &a.path).await?;
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
        let t = Instant::now();
        let checked = match a.tp {
            None => load_whole(&model, &streams, a.verify).await?,
            Some(ranks) => load_ranks(&model, &streams, ranks, a.verify).await?,
        };
        let secs = t.elapsed().as_secs_f64();
        outln!(
            "load {round}: {} in {secs:.3} s = {:.2} GB/s into {}{} via {path}{}",
            fmt_bytes(bytes),
            bytes as f64 / secs / 1e9,
            a.to,
            a.tp.map_or(String::new(), |n| format!(" ({n} ranks)")),
            if a.verify {
                format!("; verified {checked} tensors")
            } else {
                String::new()
            }
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

/// The `--tp` rule: split along dimension 0 where it divides evenly, else replicate.
fn tp_rule(ranks: usize) -> impl Fn(&FileTensor) -> Option<Shard> + Copy {
    move |t: &FileTensor| {
        if t.shape.len() >= 2 && t.shape[0] % ranks == 0 {
            Some(Shard::Split(0))
        } else {
            Some(Shard::Replicate)
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
    verify: bool,
) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    let rule = tp_rule(ranks);
    if streams.is_empty() {
        let loaded = model.load_shards_host(ranks, rule).await?;
        return Ok(loaded.iter().map(|c| c.tensors().len()).sum());
    }
    let rank_streams: Vec<_> = (0..ranks)
        .map(|r| streams[r % streams.len()].clone())
        .collect();
    let loaded = model.load_shards_device(&rank_streams, rule).await?;
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
