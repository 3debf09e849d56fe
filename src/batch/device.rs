//! Batch reads into one device buffer: each run of the plan reads into its own disjoint range
//! of the destination, all in flight at once.
//!
//! The runs' device copies are combined (`crate::op::combine`): every piece that landed since
//! the last poll is copied in one batched driver call behind one event.
//!
//! cudarc hands out one `&mut` view at a time, so the ranges are [`DeviceRange`]s: raw
//! sub-ranges of the destination, valid while the batch holds the destination exclusively.
//! cudarc's write event for the destination is recorded on its own stream (where every copy
//! of the batch is queued) after each poll, so whenever the caller can act (between polls, or
//! after dropping or leaking the future) the event stands behind every copy issued so far.

use std::sync::Arc;
use std::task::Poll;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, SyncOnDrop};

use super::RunOf;
use crate::buf::sealed::Sealed;
use crate::buf::{ReadDst, ReadTarget};
use crate::cuda::DeviceDst;
use crate::error::Result;
use crate::op::combine::CopyCombiner;

/// `len` bytes of device memory at `ptr`, part of a destination a batch holds exclusively.
pub(crate) struct DeviceRange {
    ptr: CUdeviceptr,
    len: usize,
    stream: Arc<CudaStream>,
}

impl DeviceRange {
    /// # Safety
    /// `[ptr, ptr + len)` must lie inside device memory that stays allocated, and that nothing
    /// but this range reads or writes, until every operation given the range has completed or
    /// been dropped; `stream` must be the memory's own stream, and its write event must be
    /// re-recorded after copies into the range are queued (see the module docs).
    unsafe fn new(ptr: CUdeviceptr, len: usize, stream: Arc<CudaStream>) -> Self {
        DeviceRange { ptr, len, stream }
    }
}

impl Sealed for DeviceRange {}

impl DeviceDst for DeviceRange {
    fn byte_len(&self) -> usize {
        self.len
    }
    fn own_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    fn write_ptr<'s>(&'s mut self, _stream: &'s CudaStream) -> (CUdeviceptr, SyncOnDrop<'s>) {
        // The batch records the destination's event itself (see the module docs).
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl ReadDst for DeviceRange {
    fn target(&mut self) -> ReadTarget<'_> {
        ReadTarget::Device(self)
    }
}

/// Runs `runs` (disjoint, in destination order, all inside `dst`) into `dst`.
pub(crate) async fn read_batch_device(
    runs: &[RunOf<'_>],
    dst: &mut dyn DeviceDst,
    progress: Option<&Arc<crate::op::progress::Progress>>,
) -> Vec<Result<usize>> {
    let own = dst.own_stream().clone();
    // Orders the copies after earlier uses of `dst` (cudarc makes `own` wait on its events).
    let base = {
        let (ptr, _record) = dst.write_ptr(&own);
        ptr
    };
    let mut ranges: Vec<DeviceRange> = runs
        .iter()
        .map(|r| {
            // SAFETY: the plan keeps runs disjoint and `read_into` checked they end inside
            // `dst`, which this future borrows mutably until it is done or dropped; the
            // range's stream is `dst`'s own; `poll_fn` below re-records the write event after
            // every poll that may have queued copies.
            unsafe { DeviceRange::new(base + r.dst_offset() as u64, r.len(), own.clone()) }
        })
        .collect();
    // Every run's landed pieces are copied together, once per poll of the batch.
    let combiner = Arc::new(CopyCombiner::default());
    let mut reads = std::pin::pin!(futures::future::join_all(
        runs.iter()
            .zip(ranges.iter_mut())
            .map(|(r, range)| r.read(range, progress).combined(&combiner))
    ));
    std::future::poll_fn(|cx| {
        // Records cudarc's write event for `dst` behind whatever the poll queued, on every way
        // out of it (a stage that filled queues its copies in the middle of the poll).
        let record = RecordWrite {
            dst: &mut *dst,
            own: &own,
        };
        let polled = reads.as_mut().poll(cx);
        let flushed = combiner.flush(&own);
        drop(record);
        match flushed {
            Ok(()) => polled,
            // The runs' ops are cancelled as `reads` drops with this future.
            Err(why) => Poll::Ready(runs.iter().map(|r| Err(r.copy_failed(&why))).collect()),
        }
    })
    .await
}

/// Records cudarc's write event for the destination on its own stream when dropped.
struct RecordWrite<'a> {
    dst: &'a mut dyn DeviceDst,
    own: &'a Arc<CudaStream>,
}

impl Drop for RecordWrite<'_> {
    fn drop(&mut self) {
        drop(self.dst.write_ptr(self.own));
    }
}
