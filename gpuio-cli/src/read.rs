//! `gpuio read PATH`: read a whole file through the engine, report throughput and a checksum.
//!
//! Host reads go through a bounded window of reused buffers (`DEPTH` × `WINDOW` bytes in
//! flight), not one buffer of the file's size: a 1 TiB sparse file used to abort the
//! process with "memory allocation of 1099511627776 bytes failed", as did any file larger
//! than the address space a `ulimit -v` leaves. Device reads still land in one device buffer
//! (that is what they measure), after checking that the file fits in free device memory.

use crate::stdout::outln;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use futures::StreamExt;
use futures::stream::FuturesOrdered;
use gpuio::{Backend, Engine, OpenOptions};

use crate::CliResult;
use crate::size::fmt_bytes;

#[derive(Args, Debug)]
pub struct ReadArgs {
    /// File to read.
    path: PathBuf,
    /// Use O_DIRECT.
    #[arg(long)]
    direct: bool,
    /// Destination memory: host, gpu, gpu:N.
    #[arg(long, default_value = "host")]
    to: crate::bench::Target,
    /// Backend.
    #[arg(long, default_value = "auto")]
    backend: Backend,
    /// Read every piece through the page cache, cached or not (default: ranges the page
    /// cache lacks are read with O_DIRECT; `EngineBuilder::residency_aware`).
    #[arg(long)]
    no_residency: bool,
}

/// The engine `gpuio read` runs on: the chosen backend, residency-aware unless told not.
fn engine(a: &ReadArgs) -> gpuio::Result<Engine> {
    Engine::builder()
        .backend(a.backend)
        .residency_aware(!a.no_residency)
        .build()
}

/// Bytes per read request. A multiple of 8, so that every window starts a new 8-byte word of
/// the checksum and folding window by window equals folding the whole file at once.
const WINDOW: u64 = 64 << 20;
/// Requests in flight (and buffers allocated): enough to keep the engine's queue full.
const DEPTH: usize = 4;

pub async fn run(a: ReadArgs) -> CliResult {
    if let Some(ctx) = a.to.cuda()? {
        return read_gpu(&a, ctx).await;
    }
    let engine = engine(&a)?;
    let file = OpenOptions::new()
        .read(true)
        .direct(a.direct)
        .open(&engine, &a.path)?;
    let len = file.len()?;
    let pb = crate::progress(len);
    let occ_start = engine.occupancy();
    let start = Instant::now();
    let (mut total, mut sum) = (0u64, 0u64);
    let mut spare: Vec<Vec<u8>> = Vec::with_capacity(DEPTH);
    let mut inflight = FuturesOrdered::new();
    let mut next = 0u64;
    loop {
        while inflight.len() < DEPTH && next < len {
            let n = WINDOW.min(len - next) as usize;
            let mut buf = spare.pop().unwrap_or_default();
            // A reused buffer keeps its allocation; only the last window is shorter.
            buf.resize(n, 0);
            let (file, off) = (&file, next);
            next += n as u64;
            inflight.push_back(async move {
                let r = file.read_into(&mut buf[..], off).await;
                (buf, r)
            });
        }
        // In file order: the progress and the checksum advance through the file.
        let Some((buf, r)) = inflight.next().await else {
            break;
        };
        let got = r?;
        sum = sum64(sum, &buf[..got]);
        total += got as u64;
        pb.inc(got as u64);
        spare.push(buf);
    }
    pb.finish_and_clear();
    if total < len {
        eprintln!(
            "gpuio: read: {} shrank during the read: {} of {} bytes read",
            a.path.display(),
            total,
            len
        );
    }
    let secs = start.elapsed().as_secs_f64();
    // Where the pieces spent the read (before the result line, which stays the last).
    outln!("  engine: {}", engine.occupancy().since(&occ_start))?;
    outln!(
        "read {} in {secs:.3} s: {:.3} GB/s via {} ({}), sum64 {sum:016x}",
        fmt_bytes(total),
        total as f64 / secs / 1e9,
        engine.backend().name,
        if a.direct { "O_DIRECT" } else { "buffered" },
    )?;
    Ok(())
}

/// Adds `bytes` to the running checksum: the wrapping sum of the file's 8-byte big-endian
/// words (a short last word counts as its bytes' big-endian value). `bytes` must start on a
/// word boundary of the file, and only the file's last piece may end off one.
fn sum64(acc: u64, bytes: &[u8]) -> u64 {
    // Whole words straight from memory (the buffers are allocator-aligned, so `head` is
    // empty in practice): a plain loop over `u64`s stays fast even in a debug build, where
    // per-chunk slice copies made the checksum, not the read, the cost of `gpuio read`.
    // SAFETY: every bit pattern is a valid u64; align_to only reinterprets the aligned middle.
    let (head, words, tail) = unsafe { bytes.align_to::<u64>() };
    if !head.is_empty() {
        return sum64_bytes(acc, bytes);
    }
    let mut acc = acc;
    for w in words {
        acc = acc.wrapping_add(u64::from_be(*w));
    }
    sum64_bytes(acc, tail)
}

/// [`sum64`] one byte at a time.
fn sum64_bytes(acc: u64, bytes: &[u8]) -> u64 {
    bytes.chunks(8).fold(acc, |a, c| {
        a.wrapping_add(c.iter().fold(0u64, |x, &b| (x << 8) | b as u64))
    })
}

/// `gpuio read --to gpu`: the whole file into one device buffer, timed until the copies land.
async fn read_gpu(
    a: &ReadArgs,
    ctx: std::sync::Arc<gpuio::cuda::cudarc::driver::CudaContext>,
) -> CliResult {
    let (path, direct) = (a.path.clone(), a.direct);
    let engine = engine(a)?;
    let file = OpenOptions::new()
        .read(true)
        .direct(direct)
        .open(&engine, &path)?;
    let len = file.len()?;
    // Ask before allocating: a failed allocation of a too-large file says little, and one
    // that succeeds by taking all free memory starves everything else on the device.
    let (free, total) = ctx
        .mem_get_info()
        .map_err(|e| format!("CUDA memory query on gpu:{}: {e:?}", ctx.ordinal()))?;
    if len > free as u64 {
        return Err(format!(
            "read: {} ({}) does not fit in gpu:{}'s free memory ({} free of {}); \
             read it into host memory (--to host) or free device memory",
            path.display(),
            fmt_bytes(len),
            ctx.ordinal(),
            fmt_bytes(free as u64),
            fmt_bytes(total as u64)
        )
        .into());
    }
    let len = len as usize;
    let stream = ctx
        .new_stream()
        .map_err(|e| format!("CUDA stream: {e:?}"))?;
    let mut dst = stream
        .alloc_zeros::<u8>(len.max(1))
        .map_err(|e| format!("CUDA alloc of {len} bytes: {e:?}"))?;
    let mut view = dst.slice_mut(..len);
    let occ_start = engine.occupancy();
    let start = Instant::now();
    let n = file.read_into(&mut view, 0).await?;
    stream
        .synchronize()
        .map_err(|e| format!("CUDA synchronize: {e:?}"))?;
    let secs = start.elapsed().as_secs_f64();
    outln!("  engine: {}", engine.occupancy().since(&occ_start))?;
    outln!(
        "read {} into gpu:{} in {secs:.3} s: {:.3} GB/s via {} ({}), bounce pool pinned: {}",
        fmt_bytes(n as u64),
        ctx.ordinal(),
        n as f64 / secs / 1e9,
        engine.backend().name,
        if direct { "O_DIRECT" } else { "buffered" },
        engine.bounce_pool_pinned(),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::sum64;

    /// The fold `gpuio read` printed before windows: over the whole file at once.
    fn sum64_whole(data: &[u8]) -> u64 {
        data.chunks(8).fold(0u64, |a, c| {
            a.wrapping_add(c.iter().fold(0u64, |x, &b| (x << 8) | b as u64))
        })
    }

    #[test]
    fn the_checksum_folded_by_windows_equals_the_whole_file_fold() {
        let mut rng = fastrand::Rng::with_seed(7);
        for len in [0usize, 1, 7, 8, 9, 4096, 4099, 10_003] {
            let data: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            // Windows of 8-byte multiples, the last one short.
            for w in [8usize, 16, 4096] {
                let by_windows = data.chunks(w).fold(0, sum64);
                assert_eq!(by_windows, sum64_whole(&data), "len {len} window {w}");
            }
        }
    }
}
