//! A streaming pipeline that overlaps file reads with kernels: K device buffers and K CUDA
//! streams; while a kernel (compiled at run time with NVRTC) checksums chunk i on its stream,
//! chunk i+1 is already being read. Every chunk's checksum is verified against the CPU.
//!
//!     cargo run --release --example pipeline [FILE] [CHUNK_MIB] [K]
//!
//! Prints I/O time, compute time, wall time and the overlap achieved. Without a GPU it runs
//! the same pipeline in host memory with the checksum on a blocking thread, and says so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuio::Engine;
use gpuio::cuda::cudarc::driver::sys::CUevent_flags;
use gpuio::cuda::cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

#[path = "common/checksum.rs"]
mod checksum;
use checksum::{KERNEL, weighted_sum};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = match args.next() {
        Some(p) => std::path::PathBuf::from(p),
        None => sample_file(512 << 20)?,
    };
    let chunk: usize = args.next().map_or(Ok(64), |s| s.parse())? << 20;
    let k: usize = args.next().map_or(Ok(2), |s| s.parse())?;
    if chunk == 0 || k == 0 {
        return Err("CHUNK_MIB and K must be positive".into());
    }
    let engine = Engine::new()?;
    let file = engine.open(&path)?;
    let len = file.len()? as usize;
    let chunks = len.div_ceil(chunk);
    println!(
        "{}: {len} bytes in {chunks} chunks of {} MiB, {k} buffers",
        path.display(),
        chunk >> 20
    );
    let (sums, t) = match gpuio::cuda::context(0) {
        Ok(ctx) => gpu_pipeline(&file, &ctx, len, chunk, k).await?,
        Err(no_gpu) => {
            println!("no GPU ({no_gpu}); running the pipeline in host memory");
            host_pipeline(&file, len, chunk, k).await?
        }
    };
    // Verify every chunk against the CPU.
    let data = std::fs::read(&path)?;
    for (i, got) in sums.iter().enumerate() {
        let want = weighted_sum(
            &data[i * chunk..((i + 1) * chunk).min(len)],
            (i * chunk) as u64,
        );
        if *got != want {
            return Err(format!("chunk {i}: checksum {got} != CPU {want}").into());
        }
    }
    let (io, compute, wall) = (
        t.io.as_secs_f64(),
        t.compute.as_secs_f64(),
        t.wall.as_secs_f64(),
    );
    let overlap = ((io + compute - wall) / io.min(compute)).clamp(0.0, 1.0);
    println!(
        "verified {chunks} chunk checksums against the CPU\n\
         I/O {io:.3} s ({:.2} GB/s), compute {compute:.3} s, wall {wall:.3} s, \
         sum {:.3} s: overlap {:.0}% of the shorter stage hidden",
        len as f64 / io / 1e9,
        io + compute,
        overlap * 100.0
    );
    Ok(())
}

#[derive(Default)]
struct Timing {
    io: Duration,
    compute: Duration,
    wall: Duration,
}

async fn gpu_pipeline(
    file: &gpuio::File,
    ctx: &Arc<gpuio::cuda::cudarc::driver::CudaContext>,
    len: usize,
    chunk: usize,
    k: usize,
) -> Result<(Vec<u64>, Timing), Box<dyn std::error::Error>> {
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL)?;
    let f = ctx.load_module(ptx)?.load_function("weighted_sum")?;
    let streams: Vec<Arc<CudaStream>> =
        (0..k).map(|_| ctx.new_stream()).collect::<Result<_, _>>()?;
    let mut bufs: Vec<CudaSlice<u8>> = streams
        .iter()
        .map(|s| s.alloc_zeros::<u8>(chunk))
        .collect::<Result<_, _>>()?;
    let chunks = len.div_ceil(chunk);
    let mut outs: Vec<CudaSlice<u64>> = (0..chunks)
        .map(|i| streams[i % k].alloc_zeros::<u64>(1))
        .collect::<Result<_, _>>()?;
    let timed = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut t = Timing::default();
    let mut kernel_events = Vec::new();
    let start = Instant::now();
    for i in 0..chunks {
        let (s, off) = (&streams[i % k], i * chunk);
        let n = chunk.min(len - off);
        // Copies land on stream s after the kernel that last used this buffer (same stream),
        // so the buffer is refilled only once that kernel is done; meanwhile the other
        // buffers' kernels run.
        let io_start = Instant::now();
        let mut view = bufs[i % k].slice_mut(0..n);
        let got = file.read_into(&mut view, off as u64).on_stream(s).await?;
        t.io += io_start.elapsed();
        assert_eq!(got, n);
        let before = s.record_event(timed)?;
        let mut b = s.launch_builder(&f);
        let (n64, base) = (n as u64, off as u64);
        b.arg(&bufs[i % k]).arg(&n64).arg(&base).arg(&mut outs[i]);
        // SAFETY: the kernel reads n bytes of a buffer of at least n and adds into one u64.
        unsafe { b.launch(LaunchConfig::for_num_elems((n as u32).min(1 << 20)))? };
        kernel_events.push((before, s.record_event(timed)?));
    }
    for s in &streams {
        s.synchronize()?;
    }
    t.wall = start.elapsed();
    for (a, b) in &kernel_events {
        t.compute += Duration::from_secs_f32(a.elapsed_ms(b)? / 1e3);
    }
    let sums = outs
        .iter()
        .enumerate()
        .map(|(i, o)| streams[i % k].clone_dtoh(o).map(|v| v[0]))
        .collect::<Result<_, _>>()?;
    Ok((sums, t))
}

async fn host_pipeline(
    file: &gpuio::File,
    len: usize,
    chunk: usize,
    k: usize,
) -> Result<(Vec<u64>, Timing), Box<dyn std::error::Error>> {
    let mut free: Vec<Vec<u8>> = (0..k).map(|_| vec![0u8; chunk]).collect();
    let mut running = std::collections::VecDeque::new();
    let mut sums = Vec::new();
    let mut t = Timing::default();
    let start = Instant::now();
    for off in (0..len).step_by(chunk) {
        if free.is_empty() {
            let (sum, busy, buf) = running.pop_front().expect("k buffers in use").await?;
            sums.push(sum);
            t.compute += busy;
            free.push(buf);
        }
        let mut buf = free.pop().expect("a free buffer");
        buf.truncate(chunk.min(len - off));
        let io_start = Instant::now();
        file.read_exact_at(&mut buf, off as u64).await?;
        t.io += io_start.elapsed();
        running.push_back(tokio::task::spawn_blocking(move || {
            let c = Instant::now();
            let sum = weighted_sum(&buf, off as u64);
            (sum, c.elapsed(), buf)
        }));
    }
    for r in running {
        let (sum, busy, _) = r.await?;
        sums.push(sum);
        t.compute += busy;
    }
    t.wall = start.elapsed();
    Ok((sums, t))
}

fn sample_file(len: usize) -> std::io::Result<std::path::PathBuf> {
    let p = std::env::temp_dir().join("gpuio-pipeline.bin");
    let data: Vec<u8> = (0..len as u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    std::fs::write(&p, data)?;
    Ok(p)
}
