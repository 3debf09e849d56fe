//! Host-to-device copy ceilings on this machine: pinned and pageable `cuMemcpyHtoDAsync`
//! bandwidth, the numbers gpuio's bounce path is measured against; and the rate of small
//! (4 KiB) copies, each followed by an event record as gpuio's bounce path issues them, from
//! 1, 4 and 16 threads: the ceiling of 4 KiB random reads into GPU memory for any path that
//! copies each block on its own.
//!
//! `cargo run --release --example copy_ceiling [MiB]` (default 1024). Prints
//! "SKIPPED" and exits 0 where no GPU exists.

use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let ctx = match gpuio::cuda::context(0) {
        Ok(c) => c,
        Err(e) => {
            println!("SKIPPED copy_ceiling: {e}");
            return Ok(());
        }
    };
    let len = mib << 20;
    let stream = ctx.new_stream()?;
    let mut dst = stream.alloc_zeros::<u8>(len)?;
    // SAFETY: the pinned buffer is fully written before any copy reads it.
    let mut pinned = unsafe { ctx.alloc_pinned::<u8>(len)? };
    pinned.as_mut_slice()?.fill(7);
    let pageable = vec![7u8; len];
    let mut results = Vec::new();
    for (name, rounds) in [("pinned", 5), ("pageable", 3)] {
        let mut best = 0.0f64;
        for _ in 0..rounds {
            let t = Instant::now();
            if name == "pinned" {
                stream.memcpy_htod(&pinned, &mut dst)?;
            } else {
                stream.memcpy_htod(&pageable, &mut dst)?;
            }
            stream.synchronize()?;
            best = best.max(len as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        results.push((name, best));
    }
    for (name, gbps) in &results {
        println!("host-to-device {name:8} {mib} MiB: best {gbps:.1} GB/s");
    }
    for threads in [1usize, 4, 16] {
        let rate = small_copy_rate(&ctx, threads, 4096, std::time::Duration::from_secs(1))?;
        println!(
            "host-to-device 4 KiB copies + event, {threads:2} threads: {:.1} k copies/s",
            rate / 1e3
        );
    }
    Ok(())
}

/// Copies of `len` pinned bytes to the device per second, each followed by an event record
/// (what the bounce path does per piece), from `threads` threads with a stream each.
fn small_copy_rate(
    ctx: &std::sync::Arc<gpuio::cuda::cudarc::driver::CudaContext>,
    threads: usize,
    len: usize,
    run: std::time::Duration,
) -> Result<f64, Box<dyn std::error::Error>> {
    let total = std::thread::scope(|s| -> Result<u64, String> {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(move || -> Result<u64, String> {
                    let e = |e: gpuio::cuda::cudarc::driver::DriverError| format!("{e:?}");
                    ctx.bind_to_thread().map_err(e)?;
                    let stream = ctx.new_stream().map_err(e)?;
                    let mut dst = stream.alloc_zeros::<u8>(len).map_err(e)?;
                    // SAFETY: written in full before any copy reads it.
                    let mut src = unsafe { ctx.alloc_pinned::<u8>(len) }.map_err(e)?;
                    src.as_mut_slice().map_err(e)?.fill(1);
                    let start = Instant::now();
                    let mut n = 0u64;
                    while start.elapsed() < run {
                        stream.memcpy_htod(&src, &mut dst).map_err(e)?;
                        let _event = stream.record_event(None).map_err(e)?;
                        n += 1;
                    }
                    stream.synchronize().map_err(e)?;
                    Ok(n)
                })
            })
            .collect();
        let mut total = 0;
        for w in workers {
            total += w.join().map_err(|_| "copy thread panicked".to_string())??;
        }
        Ok(total)
    })?;
    Ok(total as f64 / run.as_secs_f64())
}
