//! `gpuio`: check what a machine offers, copy and read files through the engine, and measure
//! throughput fio-style.

mod bench;
mod check;
mod plot;
mod size;
mod soak;
mod stdout;
mod validate;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use futures::StreamExt;
use gpuio::{Backend, Engine, OpenOptions};

use size::{ByteSize, fmt_bytes};

#[derive(Parser)]
#[command(
    name = "gpuio",
    version,
    about = "Async storage I/O into GPU and host memory"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// What this machine offers for gpuio, and why.
    Check {
        /// A file or directory whose filesystem to examine (default: current directory).
        path: Option<PathBuf>,
    },
    /// Copy SRC to DST through the engine (reads and writes both go through gpuio).
    Cp {
        /// Source file.
        src: PathBuf,
        /// Destination file (created or truncated).
        dst: PathBuf,
        /// Use O_DIRECT on both files.
        #[arg(long)]
        direct: bool,
        /// Chunk size of the engine (suffixes K, M, G).
        #[arg(long, default_value = "4M")]
        chunk: ByteSize,
        /// Engine queue depth.
        #[arg(long, default_value_t = 32)]
        qd: usize,
        /// Backend.
        #[arg(long, default_value = "auto")]
        backend: Backend,
    },
    /// Read a whole file into memory and report throughput.
    Read {
        /// File to read.
        path: PathBuf,
        /// Use O_DIRECT.
        #[arg(long)]
        direct: bool,
        /// Destination memory: host, gpu, gpu:N.
        #[arg(long, default_value = "host")]
        to: bench::Target,
        /// Backend.
        #[arg(long, default_value = "auto")]
        backend: Backend,
    },
    /// Measure read or write throughput, fio-style.
    Bench(bench::BenchArgs),
    /// Mixed reads and writes checked against a model of the file, on every backend.
    Soak(soak::SoakArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpuio: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(async {
        match cli.cmd {
            Cmd::Check { path } => check::run(path),
            Cmd::Cp {
                src,
                dst,
                direct,
                chunk,
                qd,
                backend,
            } => cp(src, dst, direct, chunk.0, qd, backend).await,
            Cmd::Read {
                path,
                direct,
                to,
                backend,
            } => read(path, direct, to, backend).await,
            Cmd::Bench(args) => bench::run(args).await,
            Cmd::Soak(args) => soak::run(args).await,
        }
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout has gone (`gpuio check | head -4`): nothing left to say.
        Err(e) if stdout::is_closed(&*e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuio: {e}");
            ExitCode::FAILURE
        }
    }
}

type CliResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn progress(total: u64) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb
}

async fn cp(
    src: PathBuf,
    dst: PathBuf,
    direct: bool,
    chunk: u64,
    qd: usize,
    backend: Backend,
) -> CliResult {
    let engine = Engine::builder()
        .chunk_size(chunk as usize)
        .queue_depth(qd)
        .backend(backend)
        .build()?;
    let input = OpenOptions::new()
        .read(true)
        .direct(direct)
        .open(&engine, &src)?;
    let output = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .direct(direct)
        .open(&engine, &dst)?;
    let len = input.len()?;
    // Blocks of a few chunks, several in flight: reads of block i+1 overlap writes of block i.
    let block = (chunk * 4).max(1 << 20);
    let blocks = len.div_ceil(block);
    let pb = progress(len);
    let start = Instant::now();
    let mut stream = futures::stream::iter(0..blocks)
        .map(|i| {
            let (input, output) = (&input, &output);
            async move {
                let off = i * block;
                let n = block.min(len - off) as usize;
                let mut buf = vec![0u8; n];
                let got = input.read_into(&mut buf, off).await?;
                if got != n {
                    return Err(gpuio::Error::UnexpectedEof {
                        ctx: Box::new(gpuio::Context::op(gpuio::OpKind::Read)),
                        wanted: n as u64,
                        got: got as u64,
                    });
                }
                output.write_from(&buf, off).await?;
                Ok::<u64, gpuio::Error>(n as u64)
            }
        })
        .buffer_unordered(4);
    while let Some(r) = stream.next().await {
        pb.inc(r?);
    }
    drop(stream);
    output.sync_all().await?;
    pb.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    println!(
        "copied {} in {secs:.3} s: {:.3} GB/s via {}",
        fmt_bytes(len),
        len as f64 / secs / 1e9,
        engine.backend().name
    );
    Ok(())
}

async fn read(path: PathBuf, direct: bool, to: bench::Target, backend: Backend) -> CliResult {
    if let Some(ctx) = to.cuda()? {
        return read_gpu(path, direct, ctx, backend).await;
    }
    let engine = Engine::builder().backend(backend).build()?;
    let file = OpenOptions::new()
        .read(true)
        .direct(direct)
        .open(&engine, &path)?;
    let len = file.len()?;
    let mut data = vec![0u8; len as usize];
    const WINDOW: usize = 64 << 20;
    let pb = progress(len);
    let start = Instant::now();
    let mut total = 0usize;
    {
        let mut stream = futures::stream::iter(data.chunks_mut(WINDOW).enumerate())
            .map(|(i, part)| {
                let file = &file;
                async move { file.read_into(part, (i * WINDOW) as u64).await }
            })
            .buffer_unordered(4);
        while let Some(r) = stream.next().await {
            let n = r?;
            total += n;
            pb.inc(n as u64);
        }
    }
    pb.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    let sum = data.chunks(8).fold(0u64, |a, c| {
        a.wrapping_add(c.iter().fold(0u64, |x, &b| (x << 8) | b as u64))
    });
    println!(
        "read {} in {secs:.3} s: {:.3} GB/s via {} ({}), sum64 {sum:016x}",
        fmt_bytes(total as u64),
        total as f64 / secs / 1e9,
        engine.backend().name,
        if direct { "O_DIRECT" } else { "buffered" },
    );
    Ok(())
}

/// `gpuio read --to gpu`: the whole file into one device buffer, timed until the copies land.
async fn read_gpu(
    path: PathBuf,
    direct: bool,
    ctx: std::sync::Arc<gpuio::cuda::cudarc::driver::CudaContext>,
    backend: Backend,
) -> CliResult {
    let engine = Engine::builder().backend(backend).build()?;
    let file = OpenOptions::new()
        .read(true)
        .direct(direct)
        .open(&engine, &path)?;
    let len = file.len()? as usize;
    let stream = ctx
        .new_stream()
        .map_err(|e| format!("CUDA stream: {e:?}"))?;
    let mut dst = stream
        .alloc_zeros::<u8>(len.max(1))
        .map_err(|e| format!("CUDA alloc of {len} bytes: {e:?}"))?;
    let mut view = dst.slice_mut(..len);
    let start = Instant::now();
    let n = file.read_into(&mut view, 0).await?;
    stream
        .synchronize()
        .map_err(|e| format!("CUDA synchronize: {e:?}"))?;
    let secs = start.elapsed().as_secs_f64();
    println!(
        "read {} into gpu:{} in {secs:.3} s: {:.3} GB/s via {} ({}), bounce pool pinned: {}",
        fmt_bytes(n as u64),
        ctx.ordinal(),
        n as f64 / secs / 1e9,
        engine.backend().name,
        if direct { "O_DIRECT" } else { "buffered" },
        engine.bounce_pool_pinned(),
    );
    Ok(())
}
