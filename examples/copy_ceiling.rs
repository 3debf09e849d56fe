//! Host-to-device copy ceilings on this machine: pinned and pageable `cuMemcpyHtoDAsync`
//! bandwidth, the numbers gpuio's bounce path is measured against.
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
    Ok(())
}
