//! One soak task: picks operations at random (what, where, how it ends), runs them against a
//! target and checks what they return; and the helpers that cancel operations mid-flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use gpuio::File;
use gpuio::cuda::cudarc::driver::CudaStream;

use super::{Counters, SCRATCH_MAX, SCRIBBLE, SoakTarget, TaskState};

/// What every task does.
#[derive(Clone, Copy)]
pub(super) struct TaskPlan {
    pub(super) max_len: usize,
    pub(super) drop_percent: u8,
    pub(super) leak_percent: u8,
    pub(super) deadline: Instant,
}

/// How an operation ends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fate {
    Complete,
    Drop,
    Leak,
}

pub(super) async fn soak_task(
    t: usize,
    mut rng: fastrand::Rng,
    plan: TaskPlan,
    targets: &[SoakTarget],
    stream: Option<Arc<CudaStream>>,
    counters: &Counters,
    doing: &[TaskState],
) {
    let set_doing = |what: String| {
        if let Ok(mut d) = doing[t].lock() {
            *d = Some((what, Instant::now()));
        }
    };
    while Instant::now() < plan.deadline {
        let target = &targets[rng.usize(0..targets.len())];
        let h = &target.handles[rng.usize(0..target.handles.len())];
        let model = &target.model;
        let write = rng.u8(0..3) == 0;
        // Reads and writes alike end as --drop-percent and --leak-percent say: with both 0
        // nothing is cancelled, and nothing leaks. (Writes to scratch regions used to leak
        // half the time whatever the flags said.)
        let roll = rng.u8(0..100);
        let mut fate = if roll < plan.drop_percent {
            Fate::Drop
        } else if roll < plan.drop_percent + plan.leak_percent {
            Fate::Leak
        } else {
            Fate::Complete
        };
        // A cancelled write may land in part, or not at all: it goes to a scratch region,
        // where only "no 0xFF" is checked. Everything else goes to checked regions. (The
        // layout leaves at least one checked region, and a scratch region whenever anything
        // may be cancelled.)
        let r = if write && fate != Fate::Complete {
            rng.usize(model.scratch_from..model.regions.len())
        } else {
            rng.usize(0..model.scratch_from)
        };
        let len = rng.usize(1..=plan.max_len);
        let within = rng.usize(0..=model.region_len - len);
        let off = (r * model.region_len + within) as u64;
        if fate == Fate::Leak && !take_leak(&h.leak_budget, len) {
            fate = Fate::Drop;
        }
        let what = match (write, fate) {
            (true, Fate::Complete) => "write",
            (true, Fate::Drop) => "dropped write",
            (true, Fate::Leak) => "leaked write",
            (false, Fate::Complete) => "read",
            (false, Fate::Drop) => "dropped read",
            (false, Fate::Leak) => "leaked read",
        };
        set_doing(format!("{}: waiting for region {r}", h.name));
        // Cancelled work runs with the region released: it may still land later, and only
        // scratch regions (where that is allowed) take cancelled writes.
        let outcome = if write && fate == Fate::Complete {
            let mut expect = model.regions[r].write().await;
            set_doing(format!("{}: {what} {off}+{len}", h.name));
            let mut data = vec![0u8; len];
            rng.fill(&mut data);
            match h.file.write_from(&data, off).await {
                Ok(n) if n == len => {
                    expect[within..within + len].copy_from_slice(&data);
                    counters.writes.fetch_add(1, Ordering::Relaxed);
                    Ok(len)
                }
                Ok(n) => Err(format!("short write: {n} of {len}")),
                Err(e) => Err(e.to_string()),
            }
        } else if write {
            set_doing(format!("{}: {what} {off}+{len}", h.name));
            let data: Vec<u8> = (0..len).map(|_| rng.u8(1..=SCRATCH_MAX)).collect();
            let wait = Duration::from_micros(rng.u64(0..300));
            cancelled_write(&h.file, data, off, wait, fate).await;
            Ok(0)
        } else if fate == Fate::Complete {
            let expect = model.regions[r].read().await;
            set_doing(format!("{}: {what} {off}+{len}", h.name));
            match read(&h.file, stream.as_ref(), len, off).await {
                Ok(b) if b[..] == expect[within..within + len] => Ok(len),
                Ok(_) => {
                    counters.mismatches.fetch_add(1, Ordering::Relaxed);
                    Err("MISMATCH: read bytes differ from the model".to_string())
                }
                Err(e) => Err(e),
            }
            .inspect(|_| {
                counters.reads.fetch_add(1, Ordering::Relaxed);
            })
        } else {
            set_doing(format!("{}: {what} {off}+{len}", h.name));
            let wait = Duration::from_micros(rng.u64(0..300));
            match cancelled_read(&h.file, stream.as_ref(), len, off, wait, fate).await {
                Ok(true) => Ok(0),
                Ok(false) => {
                    counters.mismatches.fetch_add(1, Ordering::Relaxed);
                    Err(format!("MISMATCH: a {what} wrote its buffer afterwards"))
                }
                Err(e) => Err(e),
            }
        };
        match fate {
            Fate::Drop => counters.dropped.fetch_add(1, Ordering::Relaxed),
            Fate::Leak => counters.leaked.fetch_add(1, Ordering::Relaxed),
            Fate::Complete => 0,
        };
        match outcome {
            Ok(moved) => {
                counters.bytes.fetch_add(moved as u64, Ordering::Relaxed);
            }
            Err(e) => {
                counters.errors.fetch_add(1, Ordering::Relaxed);
                eprintln!("{}: {what} {off}+{len}: {e}", h.name);
            }
        }
    }
    set_doing("done".into());
}

/// Takes what a leak of `len` bytes may hold from `budget`, if it is there: slots are powers
/// of two (at least 4 KiB), and an O_DIRECT read widened to its blocks can need the next
/// size up, hence twice the rounded length.
fn take_leak(budget: &AtomicI64, len: usize) -> bool {
    let cost = len.next_power_of_two().max(4096) as i64 * 2;
    budget
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
            (b >= cost).then_some(b - cost)
        })
        .is_ok()
}

/// Reads `len` bytes at `off` into host or device memory and returns them (device bytes are
/// copied back to compare).
async fn read(
    file: &File,
    stream: Option<&Arc<CudaStream>>,
    len: usize,
    off: u64,
) -> Result<Vec<u8>, String> {
    match stream {
        None if len % 2 == 0 => {
            let (r, b) = file.read_owned(vec![0u8; len], off).await;
            let n = r.map_err(|e| e.to_string())?;
            if n != len || b.len() != len {
                return Err(format!("short owned read: {n} of {len} ({} back)", b.len()));
            }
            Ok(b)
        }
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

/// Lets `fut` run for up to `wait`, then drops or leaks it.
async fn cancel<F: std::future::Future>(fut: F, wait: Duration, fate: Fate) {
    let mut fut = Box::pin(fut);
    let _ = tokio::time::timeout(wait, fut.as_mut()).await;
    if fate == Fate::Leak {
        std::mem::forget(fut);
    }
}

/// Starts a read, cancels it, scribbles the buffer and says whether the scribble stayed.
async fn cancelled_read(
    file: &File,
    stream: Option<&Arc<CudaStream>>,
    len: usize,
    off: u64,
    wait: Duration,
    fate: Fate,
) -> Result<bool, String> {
    match stream {
        None if len % 2 == 0 => {
            // The engine owns the buffer until the read lands: nothing of ours to scribble.
            cancel(file.read_owned(vec![0xC5u8; len], off), wait, fate).await;
            Ok(true)
        }
        None => {
            let mut b = vec![0xC5u8; len];
            cancel(file.read_into(&mut b, off), wait, fate).await;
            b.fill(0x3C);
            tokio::time::sleep(Duration::from_millis(2)).await;
            Ok(b.iter().all(|&x| x == 0x3C))
        }
        Some(s) => {
            let mut d = s
                .alloc_zeros::<u8>(len)
                .map_err(|e| format!("CUDA alloc: {e:?}"))?;
            cancel(file.read_into(&mut d, off), wait, fate).await;
            // Ordered after any copy the read put on this stream before it was cancelled.
            s.memset_zeros(&mut d)
                .map_err(|e| format!("CUDA memset: {e:?}"))?;
            tokio::time::sleep(Duration::from_millis(2)).await;
            let back = s
                .clone_dtoh(&d)
                .map_err(|e| format!("CUDA copy back: {e:?}"))?;
            Ok(back.iter().all(|&x| x == 0))
        }
    }
}

/// Starts a write of `data` (bytes 0x01..=0x7F), cancels it, then fills the source with 0xFF:
/// the final check finds any 0xFF that reached the file.
async fn cancelled_write(file: &File, mut data: Vec<u8>, off: u64, wait: Duration, fate: Fate) {
    cancel(file.write_from(&data, off), wait, fate).await;
    data.fill(SCRIBBLE);
    // Keep the scribbled source alive a moment: a write still reading it would see 0xFF.
    tokio::time::sleep(Duration::from_millis(2)).await;
    drop(data);
}
