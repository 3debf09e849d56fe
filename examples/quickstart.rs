//! gpuio's quick start (README.md shows this file verbatim): read a file into GPU memory with
//! `.await`, print a checksum and the path that served it. Without a GPU it reads into host
//! memory and says so.
//!
//!     cargo run --release --example quickstart [FILE]
//!
//! Without FILE it writes a 64 MiB sample file in the temp directory first.

use gpuio::Engine;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = match std::env::args().nth(1) {
        Some(p) => std::path::PathBuf::from(p),
        None => sample_file()?,
    };
    let engine = Engine::new()?; // io_uring (or the pread pool); cuFile per file where it serves
    let file = engine.open(&path)?;
    let len = file.len()? as usize;

    let (sum, via) = match gpuio::cuda::context(0) {
        Ok(ctx) => {
            let stream = ctx.default_stream();
            let mut dev = stream.alloc_zeros::<u8>(len)?; // GPU memory
            let n = file.read_into(&mut dev, 0).await?; // many chunk I/Os in flight
            let back = stream.clone_dtoh(&dev)?; // only to print a checksum here
            (
                fnv1a(&back[..n]),
                format!("GPU 0 via {}", file.gds_status()),
            )
        }
        Err(no_gpu) => {
            println!("no GPU ({no_gpu}); reading into host memory instead");
            let mut host = vec![0u8; len];
            let n = file.read_into(&mut host, 0).await?;
            (
                fnv1a(&host[..n]),
                format!("host memory via {}", engine.backend().name),
            )
        }
    };
    println!(
        "{}: {len} bytes, fnv1a {sum:016x}, into {via}",
        path.display()
    );
    Ok(())
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

fn sample_file() -> std::io::Result<std::path::PathBuf> {
    let p = std::env::temp_dir().join("gpuio-quickstart.bin");
    let data: Vec<u8> = (0..64u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(&p, data)?;
    Ok(p)
}
