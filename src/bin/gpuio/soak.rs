//! `gpuio soak`: mixed reads and writes of random sizes at random offsets, on every backend
//! and open mode this machine has, checked against an in-memory model of the file; some reads
//! are dropped mid-flight. Reports ops, bytes, errors and mismatches; any error or mismatch
//! makes the command fail.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use gpuio::{Backend, Engine, File, OpenOptions};
use tokio::sync::Mutex;

use crate::CliResult;
use crate::bench::Target;
use crate::size::{ByteSize, fmt_bytes};

#[derive(Args, Debug)]
pub struct SoakArgs {
    /// Minutes to run.
    #[arg(long, default_value_t = 1.0)]
    minutes: f64,
    /// Directory for the soak file (default: the system temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Size of the soak file.
    #[arg(long, default_value = "256M")]
    size: ByteSize,
    /// Concurrent tasks.
    #[arg(long, default_value_t = 32)]
    tasks: usize,
    /// Largest request.
    #[arg(long, default_value = "2M")]
    max_len: ByteSize,
    /// Where reads land: host, gpu, gpu:N (writes come from host memory).
    #[arg(long, default_value = "host")]
    to: Target,
    /// Backends to use (default: uring and pread; with a GPU, auto too).
    #[arg(long, value_delimiter = ',')]
    backend: Vec<Backend>,
    /// Percent of reads dropped mid-flight.
    #[arg(long, default_value_t = 10)]
    drop_percent: u8,
    /// Open modes: buffered, direct, or both.
    #[arg(long, value_delimiter = ',', default_value = "buffered,direct")]
    modes: Vec<String>,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// The file's expected bytes, one lock per region so a write and the reads that check it
/// never overlap.
struct Model {
    regions: Vec<Mutex<Vec<u8>>>,
    region_len: usize,
}

/// What one task is doing and since when.
type TaskState = std::sync::Mutex<Option<(String, Instant)>>;

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    dropped: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    mismatches: AtomicU64,
}

pub async fn run(a: SoakArgs) -> CliResult {
    const REGIONS: usize = 64;
    let size = a.size.0 as usize;
    let region_len = (size / REGIONS).max(4096) / 4096 * 4096;
    if a.tasks == 0 || a.max_len.0 == 0 || !a.minutes.is_finite() || a.minutes <= 0.0 {
        return Err("--tasks, --max-len and --minutes must be positive".into());
    }
    let max_len = (a.max_len.0 as usize).min(region_len);
    let cuda = a.to.cuda()?;
    let dir = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    let tmp = tempfile::Builder::new()
        .prefix("gpuio-soak")
        .tempfile_in(&dir)?;
    let path = tmp.path().to_path_buf();

    // Start from random contents, written with std so the model starts from known bytes.
    let mut rng = fastrand::Rng::with_seed(a.seed);
    let mut regions = Vec::with_capacity(REGIONS);
    for _ in 0..REGIONS {
        let mut r = vec![0u8; region_len];
        rng.fill(&mut r);
        regions.push(r);
    }
    std::fs::write(&path, regions.concat())?;
    let model = Arc::new(Model {
        regions: regions.into_iter().map(Mutex::new).collect(),
        region_len,
    });

    // Every backend and open mode this machine offers.
    let mut handles: Vec<(String, File)> = Vec::new();
    // With a GPU, AUTO too: it reads O_DIRECT files into device memory through cuFile where
    // cuFile registers them.
    let mut backends = a.backend.clone();
    if backends.is_empty() {
        backends = vec![Backend::Uring, Backend::Pread];
        if cuda.is_some() {
            backends.push(Backend::Auto);
        }
    }
    for backend in backends {
        let engine = match Engine::builder().backend(backend).build() {
            Ok(e) => e,
            Err(e) => {
                println!("skipping backend {backend}: {e}");
                continue;
            }
        };
        handles.push((
            format!("{backend} buffered"),
            rw_open(&engine, &path, false)?,
        ));
        match rw_open(&engine, &path, true) {
            Ok(f) => handles.push((format!("{backend} O_DIRECT"), f)),
            Err(e) => println!("skipping {backend} O_DIRECT: {e}"),
        }
    }
    println!(
        "soak: {} for {:.1} min, {} tasks, requests up to {}, reads into {}, over: {}",
        fmt_bytes(size as u64),
        a.minutes,
        a.tasks,
        fmt_bytes(max_len as u64),
        a.to,
        handles
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    if handles.is_empty() {
        return Err("no backend and open mode to soak".into());
    }
    let handles = Arc::new(handles);
    // What each task is doing, so a stuck operation can be named.
    let doing: Arc<Vec<TaskState>> =
        Arc::new((0..a.tasks).map(|_| std::sync::Mutex::new(None)).collect());
    let counters = Arc::new(Counters::default());
    let deadline = Instant::now() + Duration::from_secs_f64(a.minutes * 60.0);
    let mut tasks = Vec::new();
    for t in 0..a.tasks {
        let (model, handles, counters, cuda, doing) = (
            model.clone(),
            handles.clone(),
            counters.clone(),
            cuda.clone(),
            doing.clone(),
        );
        let mut rng = fastrand::Rng::with_seed(a.seed ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9));
        let drop_percent = a.drop_percent;
        tasks.push(tokio::spawn(async move {
            let stream = match &cuda {
                Some(ctx) => Some(
                    ctx.new_stream()
                        .map_err(|e| format!("CUDA stream: {e:?}"))?,
                ),
                None => None,
            };
            while Instant::now() < deadline {
                let (name, file) = &handles[rng.usize(0..handles.len())];
                let r = rng.usize(0..model.regions.len());
                let len = rng.usize(1..=max_len);
                let within = rng.usize(0..=model.region_len - len);
                let off = (r * model.region_len + within) as u64;
                let what = if rng.u8(0..3) == 0 { "write" } else { "read" };
                if let Ok(mut d) = doing[t].lock() {
                    *d = Some((format!("{name}: waiting for region {r}"), Instant::now()));
                }
                let mut expect = model.regions[r].lock().await;
                if let Ok(mut d) = doing[t].lock() {
                    *d = Some((format!("{name}: {what} {off}+{len}"), Instant::now()));
                }
                let outcome = if what == "write" {
                    let mut data = vec![0u8; len];
                    rng.fill(&mut data);
                    match file.write_from(&data, off).await {
                        Ok(n) if n == len => {
                            expect[within..within + len].copy_from_slice(&data);
                            counters.writes.fetch_add(1, Ordering::Relaxed);
                            Ok(len)
                        }
                        Ok(n) => Err(format!("short write: {n} of {len}")),
                        Err(e) => Err(e.to_string()),
                    }
                } else if rng.u8(0..100) < drop_percent {
                    counters.dropped.fetch_add(1, Ordering::Relaxed);
                    if drop_mid_flight(file, len, off).await {
                        Ok(0)
                    } else {
                        counters.mismatches.fetch_add(1, Ordering::Relaxed);
                        Err("MISMATCH: a dropped read wrote its buffer afterwards".to_string())
                    }
                } else {
                    let got = read(file, stream.as_ref(), len, off).await;
                    match got {
                        Ok(b) if b[..] == expect[within..within + len] => {
                            counters.reads.fetch_add(1, Ordering::Relaxed);
                            Ok(len)
                        }
                        Ok(_) => {
                            counters.mismatches.fetch_add(1, Ordering::Relaxed);
                            Err("MISMATCH: read bytes differ from the model".to_string())
                        }
                        Err(e) => Err(e),
                    }
                };
                drop(expect);
                match outcome {
                    Ok(moved) => {
                        counters.bytes.fetch_add(moved as u64, Ordering::Relaxed);
                    }
                    Err(e) => {
                        counters.errors.fetch_add(1, Ordering::Relaxed);
                        eprintln!("{name}: {what} {off}+{len}: {e}");
                    }
                }
            }
            Ok::<(), String>(())
        }));
    }
    let start = Instant::now();
    let ticker = {
        let counters = counters.clone();
        let doing = doing.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                println!("{}", report(&counters, start.elapsed()));
                for (t, d) in doing.iter().enumerate() {
                    if let Ok(d) = d.lock() {
                        if let Some((what, since)) = d.as_ref().filter(|(w, s)| {
                            !w.contains("waiting for region")
                                && s.elapsed() > Duration::from_secs(5)
                        }) {
                            println!(
                                "  task {t} stuck for {:.0} s in {what}",
                                since.elapsed().as_secs_f64()
                            );
                        }
                    }
                }
            }
        })
    };
    for t in tasks {
        t.await?.map_err(|e| format!("soak task: {e}"))?;
    }
    ticker.abort();
    // Last word: the file itself, read with std, equals the model.
    let on_disk = std::fs::read(&path)?;
    for (i, r) in model.regions.iter().enumerate() {
        let want = r.lock().await;
        if on_disk[i * region_len..(i + 1) * region_len] != want[..] {
            counters.mismatches.fetch_add(1, Ordering::Relaxed);
            eprintln!("MISMATCH: region {i} on disk differs from the model");
        }
    }
    println!("{}", report(&counters, start.elapsed()));
    let bad = counters.errors.load(Ordering::Relaxed) + counters.mismatches.load(Ordering::Relaxed);
    if bad > 0 {
        return Err(format!("soak failed: {bad} errors or mismatches").into());
    }
    println!("soak passed: every read and the final file matched the model");
    Ok(())
}

fn rw_open(engine: &Engine, path: &std::path::Path, direct: bool) -> gpuio::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .direct(direct)
        .open(engine, path)
}

/// Reads `len` bytes at `off` into host or device memory and returns them (device bytes are
/// copied back to compare).
async fn read(
    file: &File,
    stream: Option<&Arc<gpuio::cuda::cudarc::driver::CudaStream>>,
    len: usize,
    off: u64,
) -> Result<Vec<u8>, String> {
    match stream {
        None => {
            let mut b = vec![0u8; len];
            let n = file
                .read_into(&mut b, off)
                .await
                .map_err(|e| e.to_string())?;
            if n != len {
                return Err(format!("short read: {n} of {len}"));
            }
            Ok(b)
        }
        Some(s) => {
            let mut d = s
                .alloc_zeros::<u8>(len)
                .map_err(|e| format!("CUDA alloc: {e:?}"))?;
            let n = file
                .read_into(&mut d, off)
                .await
                .map_err(|e| e.to_string())?;
            if n != len {
                return Err(format!("short read: {n} of {len}"));
            }
            s.clone_dtoh(&d)
                .map_err(|e| format!("CUDA copy back: {e:?}"))
        }
    }
}

/// Starts a read, lets it run a little, drops it, and says whether the buffer was left alone.
async fn drop_mid_flight(file: &File, len: usize, off: u64) -> bool {
    let mut b = vec![0xC5u8; len];
    {
        let fut = file.read_into(&mut b, off);
        let _ = tokio::time::timeout(Duration::from_micros(50), fut).await;
    }
    b.fill(0x3C);
    tokio::time::sleep(Duration::from_millis(1)).await;
    b.iter().all(|&x| x == 0x3C)
}

fn report(c: &Counters, t: Duration) -> String {
    format!(
        "{:.0} s: {} reads, {} writes, {} dropped reads, {} moved, {} errors, {} mismatches",
        t.as_secs_f64(),
        c.reads.load(Ordering::Relaxed),
        c.writes.load(Ordering::Relaxed),
        c.dropped.load(Ordering::Relaxed),
        fmt_bytes(c.bytes.load(Ordering::Relaxed)),
        c.errors.load(Ordering::Relaxed),
        c.mismatches.load(Ordering::Relaxed),
    )
}
