//! The bench's requests: each keeps one request (or one batch) in flight, in a loop, until
//! the deadline. `--jobs` decides how many runtime tasks poll them: one task per request (the
//! default), or a few tasks each polling its share together, as one fio job keeps its
//! `iodepth` in flight from one thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use gpuio::File;
use gpuio::batch::{BatchPlan, ReadDesc};
use hdrhistogram::Histogram;

use super::args::{Pattern, Rw};

/// A destination buffer in host or device memory.
pub(super) enum Buffer {
    Host(Vec<u8>),
    /// `--owned`: read through `File::read_owned`.
    Aligned(gpuio::AlignedBuf),
    /// `--blocking`: lent to `read_into_blocking` for each call.
    Blocking(Vec<u8>),
    Gpu(gpuio::cuda::cudarc::driver::CudaSlice<u8>),
}

/// Bytes, requests and latencies of one request loop, or of several merged.
pub(super) struct TaskStats {
    pub(super) bytes: u64,
    pub(super) ops: u64,
    /// Request latencies in microseconds.
    pub(super) lat_us: Histogram<u64>,
}

impl TaskStats {
    pub(super) fn new() -> TaskStats {
        TaskStats {
            bytes: 0,
            ops: 0,
            // 1 us to an hour at 3 significant digits (percentiles within 0.1%); longer
            // requests count as an hour.
            lat_us: Histogram::new_with_bounds(1, 3_600_000_000, 3)
                .expect("constant histogram bounds are valid"),
        }
    }

    fn record(&mut self, since: Instant) {
        let us = since.elapsed().as_micros();
        self.lat_us
            .saturating_record(u64::try_from(us).unwrap_or(u64::MAX));
    }

    /// Adds another loop's figures to these.
    pub(super) fn merge(&mut self, other: &TaskStats) -> Result<(), String> {
        self.bytes += other.bytes;
        self.ops += other.ops;
        self.lat_us
            .add(&other.lat_us)
            .map_err(|e| format!("merging latency histograms: {e}"))
    }
}

/// What every request loop of a point shares.
pub(super) struct Workload {
    pub(super) file: Arc<File>,
    pub(super) rw: Rw,
    pub(super) pattern: Pattern,
    pub(super) bs: u64,
    /// Blocks per batch with `--pattern batch`.
    pub(super) batch: usize,
    /// Blocks per destination slot in a batch: 2 leaves a block's room between neighbours.
    pub(super) gap: usize,
    /// Block-aligned offsets the file's span holds.
    pub(super) slots_in_span: u64,
    /// The next sequential block, shared by all loops.
    pub(super) cursor: AtomicU64,
    /// Bytes done so far, for the progress line (each loop adds a mebibyte or more at a time,
    /// `Progress`).
    pub(super) bytes_done: Arc<AtomicU64>,
    pub(super) start: Instant,
    pub(super) deadline: Duration,
}

/// One request loop: request `index`'s buffer, read or written again as soon as the last
/// request completes, until the deadline.
pub(super) async fn request_loop(
    w: Arc<Workload>,
    index: usize,
    mut buf: Buffer,
) -> Result<TaskStats, gpuio::Error> {
    let file = &*w.file;
    let mut rng = fastrand::Rng::with_seed(0x9e37_79b9 ^ index as u64);
    let mut st = TaskStats::new();
    let mut progress = Progress::new(&w.bytes_done);
    while w.start.elapsed() < w.deadline {
        if w.pattern == Pattern::Batch {
            // A fresh plan per batch: preparing it is part of the cost measured.
            let descs = (0..w.batch)
                .map(|i| {
                    let off = rng.u64(0..w.slots_in_span) * w.bs;
                    ReadDesc::new(file, off, w.bs as usize, i * w.bs as usize * w.gap)
                })
                .collect();
            let plan = BatchPlan::new(descs);
            let t0 = Instant::now();
            let n = match &mut buf {
                Buffer::Host(b) => plan.read_into(b).await.total()?,
                Buffer::Aligned(b) => plan.read_into(b).await.total()?,
                Buffer::Blocking(b) => {
                    tokio::task::block_in_place(|| plan.read_into_blocking(b)).total()?
                }
                Buffer::Gpu(b) => plan.read_into(b).await.total()?,
            };
            st.record(t0);
            st.bytes += n as u64;
            st.ops += w.batch as u64;
            progress.add(n as u64);
            continue;
        }
        let slot = match w.pattern {
            Pattern::Rand => rng.u64(0..w.slots_in_span),
            _ => w.cursor.fetch_add(1, Ordering::Relaxed) % w.slots_in_span,
        };
        let off = slot * w.bs;
        let t0 = Instant::now();
        let n = match (w.rw, &mut buf) {
            (Rw::Read, Buffer::Aligned(b)) => {
                let (r, back) = file.read_owned(std::mem::take(b), off).await;
                *b = back;
                r?
            }
            (Rw::Write, Buffer::Aligned(b)) => file.write_from(b, off).await?,
            (Rw::Read, Buffer::Blocking(b)) => {
                tokio::task::block_in_place(|| file.read_into_blocking(b, off))?
            }
            (Rw::Write, Buffer::Blocking(b)) => file.write_from(b, off).await?,
            (Rw::Read, Buffer::Host(b)) => file.read_into(b, off).await?,
            (Rw::Write, Buffer::Host(b)) => file.write_from(b, off).await?,
            (Rw::Read, Buffer::Gpu(b)) => file.read_into(b, off).await?,
            (Rw::Write, Buffer::Gpu(b)) => file.write_from(b, off).await?,
        };
        st.record(t0);
        st.bytes += n as u64;
        st.ops += 1;
        progress.add(n as u64);
    }
    Ok(st)
}

/// A loop's bytes for the progress line, added to the shared count a mebibyte or more at a
/// time: one count written by every runtime thread on each 4 KiB request is a cache line that
/// moves between cores at every request, a cost fio's jobs (which count on their own) do
/// not pay.
struct Progress<'a> {
    shared: &'a AtomicU64,
    pending: u64,
}

impl<'a> Progress<'a> {
    const FLUSH: u64 = 1 << 20;

    fn new(shared: &'a AtomicU64) -> Self {
        Progress { shared, pending: 0 }
    }

    fn add(&mut self, n: u64) {
        self.pending += n;
        if self.pending >= Self::FLUSH {
            self.shared
                .fetch_add(std::mem::take(&mut self.pending), Ordering::Relaxed);
        }
    }
}

impl Drop for Progress<'_> {
    fn drop(&mut self) {
        self.shared.fetch_add(self.pending, Ordering::Relaxed);
    }
}

/// One runtime task's loops, polled together: each loop's figures with its request index.
pub(super) async fn job(
    w: Arc<Workload>,
    requests: Vec<(usize, Buffer)>,
) -> Result<Vec<(usize, TaskStats)>, gpuio::Error> {
    let loops = requests.into_iter().map(|(index, buf)| {
        let w = Arc::clone(&w);
        async move { request_loop(w, index, buf).await.map(|st| (index, st)) }
    });
    futures::future::try_join_all(loops).await
}
