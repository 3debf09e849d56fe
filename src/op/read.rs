//! Reads into borrowed host memory: the future copies landed slots into the caller's buffer,
//! or (small reads of cached bytes, `op::cached`) reads straight into it at first poll.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

#[cfg(not(feature = "cuda"))]
use super::future::NoTransfer;
use super::future::{Either, OpFuture, Transfer};
use super::msg::Msg;
use super::{OpShared, ReadyPieces};
use crate::buf::arena::BounceArena;
use crate::error::Result;

/// Copies read pieces into `dst`, which stands for file bytes `[offset, offset + dst.len())`.
pub(crate) struct HostCopyOut<'a> {
    pub(crate) dst: &'a mut [u8],
    pub(crate) offset: u64,
}

impl Transfer for HostCopyOut<'_> {
    fn transfer(
        &mut self,
        pieces: ReadyPieces,
        arena: &Arc<BounceArena>,
        shared: &Arc<OpShared>,
    ) -> Option<Msg> {
        let mut slots = super::SlotList::with_capacity(pieces.len());
        for p in pieces {
            if let Some((from, to, n)) = p.overlap(self.offset, self.dst.len()) {
                let to = to as usize;
                // SAFETY: the reactor handed this slot to this future and takes it back only
                // through the Release message sent below, so nothing writes it meanwhile; the
                // arena stays mapped because the engine (and this future's Arc) holds it.
                let src = unsafe { arena.slot_bytes(&p.slot, p.valid) };
                self.dst[to..to + n].copy_from_slice(&src[from..from + n]);
            }
            slots.push(p.slot);
        }
        Some(Msg::Release(shared.op_ref(), slots))
    }
}

/// An in-place read into an owned buffer (`File::read_owned`): no pieces come to the future
/// (the kernel writes the buffer the reactor holds), only the buffer, handed back with the
/// result.
#[derive(Default)]
pub(crate) struct OwnedReturn {
    pub(crate) back: Option<Box<dyn std::any::Any + Send>>,
}

impl Transfer for OwnedReturn {
    fn finish(&mut self, shared: &Arc<OpShared>) {
        self.back = shared.take_back();
    }
}

/// Where read bytes go: host memory, or device memory through a copy engine.
#[cfg(feature = "cuda")]
pub(crate) type CopyOut<'a> = Either<HostCopyOut<'a>, crate::op::device::DeviceCopyOut<'a>>;
#[cfg(not(feature = "cuda"))]
pub(crate) type CopyOut<'a> = Either<HostCopyOut<'a>, NoTransfer>;

/// Future of [`File::read_into`](crate::File::read_into): bytes read, short only at end of file.
///
/// `Send`, runtime-agnostic and cancel-safe: dropping or leaking it mid-flight never lets
/// anything write into the destination afterwards (see [`crate::reactor`]).
///
/// For device destinations the future resolves once every copy is queued on the stream:
/// work issued afterwards on that stream (or through cudarc on any stream) sees the data;
/// synchronize the stream before reading it from the host by other means.
#[must_use = "futures do nothing unless polled"]
pub struct ReadInto<'a> {
    pub(crate) inner: OpFuture<CopyOut<'a>>,
    /// The file, when the first poll may serve the read from the page cache.
    pub(crate) cached: Option<&'a crate::target::Target>,
}

impl ReadInto<'_> {
    /// Orders the device copies on `stream` instead of the destination's own stream, so that
    /// kernels the caller launches on `stream` afterwards see the data. No effect for host
    /// destinations. Call before the first poll.
    #[cfg(feature = "cuda")]
    pub fn on_stream(mut self, stream: &Arc<cudarc::driver::CudaStream>) -> Self {
        if let Either::Device(d) = self.inner.transfer_mut() {
            d.stream = Some(stream.clone());
        }
        self
    }
}

impl ReadInto<'_> {
    /// Reports the bytes this read moves to `progress` (its `done`; the caller plans its
    /// `total`). Call before the first poll.
    pub fn with_progress(mut self, progress: &Arc<super::progress::Progress>) -> Self {
        let len = match self.inner.transfer_mut() {
            Either::Host(h) => h.dst.len(),
            #[cfg(feature = "cuda")]
            Either::Device(d) => d.dst.byte_len(),
            #[cfg(not(feature = "cuda"))]
            Either::Device(_) => 0,
        };
        self.inner.track(progress, len as u64);
        self
    }

    /// Hands the device copies to `combiner` (a batch's), which queues them with the batch's
    /// other reads'. No effect for host destinations. Call before the first poll.
    #[cfg(feature = "cuda")]
    pub(crate) fn combined(mut self, combiner: &Arc<super::combine::CopyCombiner>) -> Self {
        let engine = self.inner.engine().clone();
        if let Either::Device(d) = self.inner.transfer_mut() {
            d.combine = Some(super::combine::Combine {
                combiner: combiner.clone(),
                engine,
            });
        }
        self
    }
}

impl Future for ReadInto<'_> {
    type Output = Result<usize>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<usize>> {
        if let Some(file) = self.cached.take() {
            let this = &mut *self;
            // No write of this file unfinished: the reactor's range fence orders reads after
            // overlapping write pieces in the kernel, which this read would not wait for.
            let engine = this.inner.engine();
            let open = !engine.reactor.is_dead() && !engine.writes_pending.any(&file.fence_key);
            if open {
                let (fd, refused) = (file.raw_fd(), &file.nowait_refused);
                let served = match this.inner.transfer_mut() {
                    Either::Host(h) => {
                        super::cached::try_read(fd, refused, h.dst, h.offset).map(Ok)
                    }
                    #[cfg(feature = "cuda")]
                    Either::Device(d) => d.read_cached(fd, refused),
                    #[cfg(not(feature = "cuda"))]
                    Either::Device(_) => None,
                };
                if let Some(result) = served {
                    if let Ok(n) = &result {
                        this.inner.count(*n as u64);
                        this.inner
                            .engine()
                            .stats
                            .cached_reads
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    this.inner.finish_unsent();
                    return Poll::Ready(result);
                }
            }
        }
        Pin::new(&mut self.inner).poll(cx).map(super::to_usize)
    }
}
