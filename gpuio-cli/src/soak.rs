//! `gpuio soak`: mixed reads and writes of random sizes at random offsets, on every backend
//! and open mode this machine has (and NVMe namespaces through SPDK with `--nvme`), checked
//! against an in-memory model; a share of reads and writes (`--drop-percent`,
//! `--leak-percent`; with both 0, none) is dropped or leaked mid-flight. Reports ops, bytes,
//! errors and mismatches; any error or mismatch makes the command fail, and so does a soak
//! that checked nothing (no read completed and was compared with the model). Parameters that
//! leave nothing to check are refused before the run (see `SoakArgs::layout`).
//!
//! With many tasks and regions (`--tasks 2048 --regions 4096`) it is the cancellation storm:
//! thousands of operations in flight at once, many abandoned at random points.
//!
//! What is checked:
//! - every completed read equals the model (reads share a region; writes take it alone);
//! - a dropped or leaked read never writes its buffer after the drop (the buffer is scribbled
//!   right after and must keep the scribble; device buffers are scribbled on their stream);
//! - host reads of even length go through `read_owned` (in place where the read needs no
//!   widening), the others through `read_into`: completed ones equal the model like any read,
//!   and dropped or leaked ones must leave the engine (and every other check) intact;
//! - a dropped or leaked write never reads its source after the drop: such writes go to
//!   scratch regions (an eighth of the regions, at least one, when anything may be
//!   cancelled; none otherwise) with bytes 0x01..=0x7F, the source is then filled with 0xFF,
//!   and no 0xFF may ever reach the file;
//! - at the end, with every engine shut down, the file (read with std) or the namespace (read
//!   by a fresh engine) equals the model, scratch regions hold no 0xFF.
//!
//! Leaked operations keep their bounce slots by contract, so leaks stop at a budget of an
//! eighth of each engine's pool (later would-be leaks are drops) and the engines keep serving.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpuio::cuda::cudarc::driver::CudaStream;
use gpuio::{Backend, Engine, File, OpenOptions};
use tokio::sync::RwLock;

use crate::CliResult;
use crate::size::fmt_bytes;
use crate::stdout::outln;

mod args;
mod task;

use args::Mode;
pub use args::SoakArgs;
use task::{TaskPlan, soak_task};

/// Bytes a cancelled write writes: never 0xFF, which the source turns into after the cancel.
const SCRATCH_MAX: u8 = 0x7F;
const SCRIBBLE: u8 = 0xFF;

/// The expected bytes of one file or namespace, a lock per region. The last regions (if
/// anything may be cancelled) are scratch: only cancelled writes go there, and only "no
/// 0xFF" is known of them; the others are checked.
struct Model {
    regions: Vec<RwLock<Vec<u8>>>,
    region_len: usize,
    scratch_from: usize,
}

/// A file or namespace under soak with the handles that reach it.
struct SoakTarget {
    name: String,
    model: Model,
    handles: Vec<Handle>,
}

struct Handle {
    name: String,
    file: File,
    /// Bytes this handle's engine may still leak.
    leak_budget: Arc<AtomicI64>,
}

/// What one task is doing and since when.
type TaskState = std::sync::Mutex<Option<(String, Instant)>>;

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    dropped: AtomicU64,
    leaked: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    mismatches: AtomicU64,
}

pub async fn run(a: SoakArgs) -> CliResult {
    let (region_len, max_len) = a.layout()?;
    let cancels = a.drop_percent > 0 || a.leak_percent > 0;
    let cuda = a.to.cuda()?;
    let dir = a.dir.clone().unwrap_or_else(std::env::temp_dir);
    // Refuse a file the filesystem cannot hold before writing any of it; register it so that
    // Ctrl-C or SIGTERM removes it too (the guard's Drop covers errors and the normal end).
    crate::cleanup::check_room(
        &dir,
        a.regions.saturating_mul(region_len) as u64,
        "soak: the file of --size",
    )?;
    let (tmp, _) = crate::cleanup::TempPath::create(&dir, "gpuio-soak-")?;
    let path = tmp.path().to_path_buf();
    let mut rng = fastrand::Rng::with_seed(a.seed);

    // The file: random contents written with std, so the model starts from known bytes.
    let model = new_model(&mut rng, a.regions, region_len, cancels);
    std::fs::write(&path, model_bytes(&model).await)?;
    let mut backends = a.backend.clone();
    if backends.is_empty() {
        backends = vec![Backend::Uring, Backend::Pread];
        if cuda.is_some() {
            // With a GPU, AUTO too: O_DIRECT files go into device memory through cuFile
            // where cuFile registers them.
            backends.push(Backend::Auto);
        }
    }
    let mut engines = Vec::new();
    let mut handles = Vec::new();
    for backend in backends {
        // AUTO here also uses compatibility-mode cuFile where that is all cuFile offers, so
        // the soak covers cuFile on machines without nvidia-fs too.
        let engine = match Engine::builder()
            .backend(backend)
            .cufile_compat(true)
            .reactors(a.reactors)
            .build()
        {
            Ok(e) => e,
            Err(e) => {
                outln!("skipping backend {backend}: {e}")?;
                continue;
            }
        };
        let budget = leak_budget(&engine);
        for &mode in &a.modes {
            let direct = mode == Mode::Direct;
            match rw_open(&engine, &path, direct) {
                Ok(file) => handles.push(Handle {
                    name: format!("{backend} {}", if direct { "O_DIRECT" } else { "buffered" }),
                    file,
                    leak_budget: budget.clone(),
                }),
                Err(e) => outln!(
                    "skipping {backend} {}: {e}",
                    if direct { "direct" } else { "buffered" }
                )?,
            }
        }
        engines.push(engine);
    }
    let mut targets = vec![SoakTarget {
        name: path.display().to_string(),
        model,
        handles,
    }];
    if let Some(trid) = &a.nvme {
        let layout = (a.regions, region_len, cancels);
        targets.push(nvme_target(trid, &mut rng, layout, &mut engines).await?);
    }
    targets.retain(|t| !t.handles.is_empty());
    if targets.is_empty() {
        return Err("no backend and open mode to soak".into());
    }
    outln!(
        "soak: {} regions of {} for {} min, {} tasks, requests up to {}, reads into {}, \
         {}% dropped, {}% leaked, over: {}",
        a.regions,
        fmt_bytes(region_len as u64),
        a.minutes,
        a.tasks,
        fmt_bytes(max_len as u64),
        a.to,
        a.drop_percent,
        a.leak_percent,
        targets
            .iter()
            .flat_map(|t| t.handles.iter().map(|h| h.name.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    let targets = Arc::new(targets);
    // A few CUDA streams shared by all tasks (thousands of streams would cost more than the
    // I/O they carry).
    let streams: Vec<Arc<CudaStream>> = match &cuda {
        Some(ctx) => (0..16)
            .map(|_| ctx.new_stream())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("CUDA stream: {e:?}"))?,
        None => Vec::new(),
    };
    let streams = Arc::new(streams);
    // What each task is doing, so a stuck operation can be named.
    let doing: Arc<Vec<TaskState>> =
        Arc::new((0..a.tasks).map(|_| std::sync::Mutex::new(None)).collect());
    let counters = Arc::new(Counters::default());
    let deadline = Instant::now() + Duration::from_secs_f64(a.minutes * 60.0);
    let plan = TaskPlan {
        max_len,
        drop_percent: a.drop_percent,
        leak_percent: a.leak_percent,
        deadline,
    };
    let mut tasks = Vec::new();
    for t in 0..a.tasks {
        let (targets, counters, streams, doing) = (
            targets.clone(),
            counters.clone(),
            streams.clone(),
            doing.clone(),
        );
        let rng = fastrand::Rng::with_seed(a.seed ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9));
        let stream = (!streams.is_empty()).then(|| streams[t % streams.len()].clone());
        tasks.push(tokio::spawn(async move {
            soak_task(t, rng, plan, &targets, stream, &counters, &doing).await
        }));
    }
    let start = Instant::now();
    let ticker = {
        let counters = counters.clone();
        let doing = doing.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(10)).await;
                // A closed stdout ends the reports, not the soak: its verdict is the exit status.
                if outln!("{}", report(&counters, start.elapsed())).is_err() {
                    return;
                }
                let stuck: Vec<String> = doing
                    .iter()
                    .enumerate()
                    .filter_map(|(t, d)| {
                        let d = d.lock().ok()?;
                        let (what, since) = d.as_ref()?;
                        (!what.contains("waiting for region")
                            && since.elapsed() > Duration::from_secs(5))
                        .then(|| {
                            format!(
                                "task {t} stuck for {:.0} s in {what}",
                                since.elapsed().as_secs_f64()
                            )
                        })
                    })
                    .collect();
                for s in stuck.iter().take(10) {
                    let _ = outln!("  {s}");
                }
                if stuck.len() > 10 {
                    let _ = outln!("  ... and {} more", stuck.len() - 10);
                }
            }
        })
    };
    for t in tasks {
        t.await?;
    }
    ticker.abort();
    // Stop every engine: whatever cancelled work was still in flight lands (or not) now.
    for e in &engines {
        e.shutdown().await?;
    }
    // Last word: the file read with std, the namespace read by a fresh engine.
    for t in targets.iter() {
        let on_disk = if t.handles[0].file.is_nvme() {
            let trid = a.nvme.as_deref().unwrap_or_default();
            let fresh = crate::bench::nvme_engine(Engine::builder(), "--nvme", trid)?;
            let f = fresh.open_nvme(trid)?;
            let mut b = vec![0u8; t.model.regions.len() * region_len];
            let n = f.read_into(&mut b, 0).await?;
            if n != b.len() {
                return Err(format!("{}: read back {n} of {} bytes", t.name, b.len()).into());
            }
            fresh.shutdown().await?;
            b
        } else {
            std::fs::read(&path)?
        };
        for (i, r) in t.model.regions.iter().enumerate() {
            let want = r.read().await;
            let got = &on_disk[i * region_len..(i + 1) * region_len];
            let bad = if i >= t.model.scratch_from {
                got.contains(&SCRIBBLE)
            } else {
                got != &want[..]
            };
            if bad {
                counters.mismatches.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "MISMATCH: {}: region {i} at the end differs from the model",
                    t.name
                );
            }
        }
    }
    // The verdict does not depend on stdout: a failed soak fails even if nobody reads.
    let shown = outln!("{}", report(&counters, start.elapsed()));
    verdict(&counters)?;
    shown?;
    outln!("soak passed: every read and the final contents matched the model")?;
    Ok(())
}

/// The soak's verdict from its counters: any error or mismatch fails it, and so does a soak
/// that checked nothing (it used to pass with 0 reads and 0 writes).
fn verdict(c: &Counters) -> Result<(), String> {
    let bad = c.errors.load(Ordering::Relaxed) + c.mismatches.load(Ordering::Relaxed);
    if bad > 0 {
        return Err(format!("soak failed: {bad} errors or mismatches"));
    }
    if c.reads.load(Ordering::Relaxed) == 0 {
        return Err(
            "soak failed: it checked nothing: no read completed to be compared with \
                    the model (a run too short for one, or every read cancelled); raise \
                    --minutes or lower --drop-percent and --leak-percent"
                .into(),
        );
    }
    Ok(())
}

/// A model of `regions` regions of random bytes; with `cancels`, the last eighth (at least
/// one region) is scratch for cancelled writes.
fn new_model(rng: &mut fastrand::Rng, regions: usize, region_len: usize, cancels: bool) -> Model {
    let v = (0..regions)
        .map(|_| {
            let mut r = vec![0u8; region_len];
            rng.fill(&mut r);
            // No 0xFF anywhere, so that scratch regions start clean.
            for b in r.iter_mut().filter(|b| **b == SCRIBBLE) {
                *b = 0;
            }
            RwLock::new(r)
        })
        .collect();
    Model {
        regions: v,
        region_len,
        scratch_from: regions - if cancels { (regions / 8).max(1) } else { 0 },
    }
}

async fn model_bytes(m: &Model) -> Vec<u8> {
    let mut out = Vec::with_capacity(m.regions.len() * m.region_len);
    for r in &m.regions {
        out.extend_from_slice(&r.read().await);
    }
    out
}

/// An NVMe namespace through SPDK, its first regions written with the model's bytes and read
/// back before the soak starts.
async fn nvme_target(
    trid: &str,
    rng: &mut fastrand::Rng,
    (regions, region_len, cancels): (usize, usize, bool),
    engines: &mut Vec<Engine>,
) -> Result<SoakTarget, Box<dyn std::error::Error + Send + Sync>> {
    let engine = crate::bench::nvme_engine(Engine::builder(), "--nvme", trid)?;
    let file = engine.open_nvme(trid)?;
    let ns_len = file.len()?;
    let regions = regions.min((ns_len / region_len as u64) as usize);
    if regions < 2 {
        return Err(format!("{trid}: namespace of {ns_len} bytes is too small").into());
    }
    // At least two regions, so that one is checked beside the scratch one.
    let model = new_model(rng, regions, region_len, cancels);
    let bytes = model_bytes(&model).await;
    let n = file.write_from(&bytes, 0).await?;
    let mut back = vec![0u8; bytes.len()];
    let m = file.read_into(&mut back, 0).await?;
    if n != bytes.len() || m != bytes.len() || back != bytes {
        return Err(format!("{trid}: initial contents did not read back").into());
    }
    let handle = Handle {
        name: "spdk nvme".into(),
        file,
        leak_budget: leak_budget(&engine),
    };
    engines.push(engine);
    Ok(SoakTarget {
        name: trid.to_string(),
        model,
        handles: vec![handle],
    })
}

fn leak_budget(engine: &Engine) -> Arc<AtomicI64> {
    Arc::new(AtomicI64::new((engine.bounce_bytes() / 8) as i64))
}

fn rw_open(engine: &Engine, path: &std::path::Path, direct: bool) -> gpuio::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .direct(direct)
        .open(engine, path)
}

fn report(c: &Counters, t: Duration) -> String {
    format!(
        "{:.0} s: {} reads, {} writes, {} dropped, {} leaked, {} moved, {} errors, {} mismatches",
        t.as_secs_f64(),
        c.reads.load(Ordering::Relaxed),
        c.writes.load(Ordering::Relaxed),
        c.dropped.load(Ordering::Relaxed),
        c.leaked.load(Ordering::Relaxed),
        fmt_bytes(c.bytes.load(Ordering::Relaxed)),
        c.errors.load(Ordering::Relaxed),
        c.mismatches.load(Ordering::Relaxed),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_soak_that_checked_nothing_fails() {
        let c = Counters::default();
        c.writes.store(10, Ordering::Relaxed);
        c.dropped.store(5, Ordering::Relaxed);
        let err = verdict(&c).expect_err("no read was checked");
        assert!(err.contains("checked nothing"), "{err}");
        c.reads.store(1, Ordering::Relaxed);
        assert_eq!(verdict(&c), Ok(()));
        c.mismatches.store(1, Ordering::Relaxed);
        assert!(verdict(&c).is_err());
    }

    #[test]
    fn scratch_regions_only_when_something_is_cancelled() {
        let mut rng = fastrand::Rng::with_seed(1);
        assert_eq!(new_model(&mut rng, 1, 4096, false).scratch_from, 1);
        assert_eq!(new_model(&mut rng, 2, 4096, true).scratch_from, 1);
        assert_eq!(new_model(&mut rng, 64, 4096, true).scratch_from, 56);
    }
}
