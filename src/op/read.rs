//! Reads into borrowed host memory: the future copies landed slots into the caller's buffer,
//! or (small reads of cached bytes, `op::cached`) reads straight into it at first poll.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use super::engine_shared::EngineShared;
#[cfg(not(feature = "cuda"))]
use super::future::NoTransfer;
use super::future::{Either, OpFuture, Transfer};
use super::msg::Msg;
use super::{OpShared, ReadyPieces};
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
        engine: &Arc<EngineShared>,
        shared: &Arc<OpShared>,
    ) -> Option<Msg> {
        let arena = &engine.arena;
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
    stage: ReadStage<'a>,
}

enum ReadStage<'a> {
    /// A small read of a buffered file, not polled yet: the first poll tries the page cache
    /// (`op::cached`) and builds the op only where that fails.
    FirstPoll(FirstPoll<'a>),
    /// The op, sent to the reactor at its first poll.
    Op(OpFuture<CopyOut<'a>>),
    /// A large warm read into device memory, handed to the engine's registrar at its first
    /// poll (`op::mapped`); the read itself is kept to fall back to the reactor.
    #[cfg(feature = "cuda")]
    Mapped(FirstPoll<'a>, super::mapped::MappedRead),
    /// Served from the page cache and returned.
    Done,
}

/// What a read's first poll needs of its file: `File` (a module above this one) implements it.
pub(crate) trait ReadSource: Sync {
    /// The file's shared state.
    fn target(&self) -> &crate::target::Target;
    /// The engine the file is bound to.
    fn engine_shared(&self) -> &Arc<EngineShared>;
    /// Whether a read of `len` bytes at `offset` is a valid request now (the op's own check).
    fn check_read(&self, offset: u64, len: usize) -> Result<()>;
    /// The op of a read into `transfer`'s destination at `offset`.
    fn start_read<'a>(&self, offset: u64, transfer: CopyOut<'a>) -> OpFuture<CopyOut<'a>>;
}

/// What a read served from the page cache needs, borrowed. The op's request holds the file,
/// the engine and the device's context by `Arc`: handles every runtime thread shares, whose
/// counts each clone and drop would move between the cores' caches, several times per 4 KiB
/// read (measured in `BENCHMARKS.md`, thirteenth session). A read the page cache serves never
/// takes them.
struct FirstPoll<'a> {
    file: &'a dyn ReadSource,
    offset: u64,
    transfer: CopyOut<'a>,
    progress: Option<super::progress::OpProgress>,
}

impl<'a> ReadInto<'a> {
    /// A read whose first poll may serve it from the page cache.
    pub(crate) fn first_poll(file: &'a dyn ReadSource, offset: u64, transfer: CopyOut<'a>) -> Self {
        ReadInto {
            stage: ReadStage::FirstPoll(FirstPoll {
                file,
                offset,
                transfer,
                progress: None,
            }),
        }
    }

    /// A read that goes to the reactor.
    pub(crate) fn op(op: OpFuture<CopyOut<'a>>) -> Self {
        ReadInto {
            stage: ReadStage::Op(op),
        }
    }

    /// The transfer, before the first poll (`None` once served).
    fn transfer_mut(&mut self) -> Option<&mut CopyOut<'a>> {
        match &mut self.stage {
            ReadStage::FirstPoll(f) => Some(&mut f.transfer),
            ReadStage::Op(op) => Some(op.transfer_mut()),
            #[cfg(feature = "cuda")]
            ReadStage::Mapped(f, _) => Some(&mut f.transfer),
            ReadStage::Done => None,
        }
    }

    /// Orders the device copies on `stream` instead of the destination's own stream, so that
    /// kernels the caller launches on `stream` afterwards see the data. No effect for host
    /// destinations. Call before the first poll.
    #[cfg(feature = "cuda")]
    pub fn on_stream(mut self, stream: &Arc<cudarc::driver::CudaStream>) -> Self {
        if let Some(Either::Device(d)) = self.transfer_mut() {
            d.stream = Some(stream.clone());
        }
        self
    }

    /// Reports the bytes this read moves to `progress` (its `done`; the caller plans its
    /// `total`). Call before the first poll.
    pub fn with_progress(mut self, progress: &Arc<super::progress::Progress>) -> Self {
        let len = match self.transfer_mut() {
            Some(Either::Host(h)) => h.dst.len(),
            #[cfg(feature = "cuda")]
            Some(Either::Device(d)) => d.dst.byte_len(),
            _ => 0,
        } as u64;
        match &mut self.stage {
            ReadStage::FirstPoll(f) => {
                f.progress = Some(super::progress::OpProgress::new(progress, len));
            }
            ReadStage::Op(op) => op.track(progress, len),
            #[cfg(feature = "cuda")]
            ReadStage::Mapped(f, _) => {
                f.progress = Some(super::progress::OpProgress::new(progress, len));
            }
            ReadStage::Done => {}
        }
        self
    }

    /// Hands the device copies to `combiner` (a batch's), which queues them with the batch's
    /// other reads'. No effect for host destinations. Call before the first poll.
    #[cfg(feature = "cuda")]
    pub(crate) fn combined(mut self, combiner: &Arc<super::combine::CopyCombiner>) -> Self {
        if let Some(Either::Device(d)) = self.transfer_mut() {
            d.combine = Some(combiner.clone());
        }
        self
    }
}

impl FirstPoll<'_> {
    /// Serves the read from the page cache, or `None` where it must go through the reactor.
    fn serve_cached(&mut self) -> Option<Result<usize>> {
        let (file, target) = (self.file, self.file.target());
        let engine = file.engine_shared();
        let len = match &self.transfer {
            Either::Host(h) => h.dst.len(),
            #[cfg(feature = "cuda")]
            Either::Device(d) => d.dst.byte_len(),
            #[cfg(not(feature = "cuda"))]
            Either::Device(_) => return None,
        };
        // A large read gets here only to be offered to the mapped reads (`op::mapped`).
        if len > super::cached::CACHED_READ_MAX || !engine.policy.cached_fast_path {
            return None;
        }
        // An invalid request gets its error from the op; and with a write of this file
        // unfinished the reactor's range fence must order the read after overlapping write
        // pieces in the kernel, which this read would not wait for.
        if file.check_read(self.offset, len).is_err()
            || engine.reactor.is_dead()
            || engine.writes_pending.any(&target.fence_key)
        {
            return None;
        }
        let (fd, refused) = (target.raw_fd(), &target.nowait_refused);
        let served = match &mut self.transfer {
            Either::Host(h) => super::cached::try_read(fd, refused, h.dst, h.offset).map(Ok),
            #[cfg(feature = "cuda")]
            Either::Device(d) => d.read_cached(fd, refused, &engine.stages),
            #[cfg(not(feature = "cuda"))]
            Either::Device(_) => None,
        }?;
        if let Ok(n) = &served {
            if let Some(p) = &mut self.progress {
                p.add(*n as u64);
            }
            engine.stats.cached_reads.add(1);
        }
        Some(served)
    }
}

impl<'a> FirstPoll<'a> {
    /// Hands a large warm read into device memory to the engine's registrar where it
    /// qualifies (`op::mapped::try_start`).
    #[cfg(feature = "cuda")]
    fn start_mapped(&self) -> Option<super::mapped::MappedRead> {
        match &self.transfer {
            Either::Device(d) => {
                super::mapped::try_start(self.file.engine_shared(), self.file.target(), d)
            }
            Either::Host(_) => None,
        }
    }

    /// The read's op, sent to the reactor at its first poll.
    fn into_op(self) -> OpFuture<CopyOut<'a>> {
        let mut op = self.file.start_read(self.offset, self.transfer);
        op.set_progress(self.progress);
        op
    }
}

impl Future for ReadInto<'_> {
    type Output = Result<usize>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<usize>> {
        let this = &mut *self;
        if let ReadStage::FirstPoll(first) = &mut this.stage {
            if let Some(result) = first.serve_cached() {
                this.stage = ReadStage::Done;
                return Poll::Ready(result);
            }
            let ReadStage::FirstPoll(first) = std::mem::replace(&mut this.stage, ReadStage::Done)
            else {
                unreachable!()
            };
            #[cfg(feature = "cuda")]
            if let Some(m) = first.start_mapped() {
                this.stage = ReadStage::Mapped(first, m);
            } else {
                this.stage = ReadStage::Op(first.into_op());
            }
            #[cfg(not(feature = "cuda"))]
            {
                this.stage = ReadStage::Op(first.into_op());
            }
        }
        #[cfg(feature = "cuda")]
        if let ReadStage::Mapped(first, m) = &mut this.stage {
            let Either::Device(d) = &mut first.transfer else {
                unreachable!("only device reads are mapped")
            };
            match m.poll(d, first.file.target(), cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(super::mapped::MappedOutcome::Done(result)) => {
                    if let (Ok(n), Some(p)) = (&result, &mut first.progress) {
                        p.add(*n as u64);
                    }
                    this.stage = ReadStage::Done;
                    return Poll::Ready(result);
                }
                Poll::Ready(super::mapped::MappedOutcome::Fallback) => {
                    let ReadStage::Mapped(first, m) =
                        std::mem::replace(&mut this.stage, ReadStage::Done)
                    else {
                        unreachable!()
                    };
                    drop(m);
                    this.stage = ReadStage::Op(first.into_op());
                }
            }
        }
        match &mut this.stage {
            ReadStage::Op(op) => Pin::new(op).poll(cx).map(super::to_usize),
            _ => Poll::Ready(Err(crate::error::Error::invalid(
                crate::error::Context::op(crate::error::OpKind::Read),
                "future polled after it completed",
            ))),
        }
    }
}
