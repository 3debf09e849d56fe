//! Reads into borrowed host memory: the future copies landed slots into the caller's buffer,
//! or (cached bytes, `op::cached`) reads straight into it in its polls: a small read at the
//! first, a larger one a piece per poll.

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
    /// Bytes served from the page cache before the rest went to the reactor: the op's count
    /// starts after them.
    served: usize,
}

enum ReadStage<'a> {
    /// A read of a buffered file that the page cache may serve in poll (`op::cached`: a small
    /// one at the first poll, a larger host one a piece per poll), or, into device memory, the
    /// mapped reads may take; the op is built only where neither does.
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
    /// Bytes of a larger host read already copied from the page cache by earlier polls.
    served: usize,
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
                served: 0,
            }),
            served: 0,
        }
    }

    /// A read that goes to the reactor.
    pub(crate) fn op(op: OpFuture<CopyOut<'a>>) -> Self {
        ReadInto {
            stage: ReadStage::Op(op),
            served: 0,
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

    /// Sends what `first` has not served to the reactor: the op becomes this read's stage,
    /// and its count will start after the bytes already served.
    fn send_to_reactor(&mut self, first: FirstPoll<'a>) {
        let (op, served) = first.into_op();
        self.stage = ReadStage::Op(op);
        self.served = served;
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
    /// Serves the read from the page cache: `Ready` once it is all copied, `Pending` where a
    /// larger host read has copied one piece and yields (the caller wakes itself), `None`
    /// where the rest (all of it, unless earlier polls copied pieces) must go through the
    /// reactor.
    fn serve_cached(&mut self) -> Option<Poll<Result<usize>>> {
        let (file, target) = (self.file, self.file.target());
        let engine = file.engine_shared();
        let len = match &self.transfer {
            Either::Host(h) => h.dst.len(),
            #[cfg(feature = "cuda")]
            Either::Device(d) => d.dst.byte_len(),
            #[cfg(not(feature = "cuda"))]
            Either::Device(_) => return None,
        };
        let max = engine
            .policy
            .cached_read_max(matches!(self.transfer, Either::Host(_)));
        // A large device read gets here only to be offered to the mapped reads
        // (`op::mapped`).
        if len > max || !engine.policy.cached_fast_path {
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
            Either::Host(h) if len > super::cached::CACHED_READ_MAX => {
                // In pieces, yielding between them: one poll copies at most
                // `HOST_POLL_PIECE`, so a long read holds the runtime's thread no longer than
                // a bounce read's copy of one piece does. A piece the page cache does not hold
                // whole (or the end of the file) sends the read to the reactor.
                let at = self.served;
                // Only where the page cache holds the range (a sampled estimate, as the
                // reactor's own): `RWF_NOWAIT` on a missing page starts readahead before it
                // refuses, which a cold read that the reactor sends O_DIRECT must not pay.
                if at == 0
                    && !crate::plan::residency::estimate(
                        std::os::fd::AsFd::as_fd(target.fd.as_ref()?),
                        h.offset,
                        len as u64,
                    )
                    .ok()?
                    .all_cached()
                {
                    return None;
                }
                let n = (len - at).min(super::cached::HOST_POLL_PIECE);
                let got = super::cached::try_read(
                    fd,
                    refused,
                    &mut h.dst[at..at + n],
                    h.offset + at as u64,
                )?;
                if got != n {
                    return None;
                }
                self.served += n;
                if self.served < len {
                    return Some(Poll::Pending);
                }
                Ok(len)
            }
            Either::Host(h) => super::cached::try_read(fd, refused, h.dst, h.offset).map(Ok)?,
            #[cfg(feature = "cuda")]
            Either::Device(d) => d.read_cached(fd, refused, &engine.stages)?,
            #[cfg(not(feature = "cuda"))]
            Either::Device(_) => return None,
        };
        if let Ok(n) = &served {
            if let Some(p) = &mut self.progress {
                p.add(*n as u64);
            }
            engine.stats.cached_reads.add(1);
        }
        Some(Poll::Ready(served))
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

    /// The op for the bytes not yet served (all of them unless a host read copied some from
    /// the page cache in earlier polls), sent to the reactor at its first poll; and how many
    /// were served.
    fn into_op(mut self) -> (OpFuture<CopyOut<'a>>, usize) {
        let served = self.served;
        if served > 0 {
            if let Either::Host(h) = &mut self.transfer {
                let dst = std::mem::take(&mut h.dst);
                h.dst = &mut dst[served..];
                h.offset += served as u64;
            }
            if let Some(p) = &mut self.progress {
                p.add(served as u64);
            }
        }
        let mut op = self
            .file
            .start_read(self.offset + served as u64, self.transfer);
        op.set_progress(self.progress);
        (op, served)
    }
}

impl Future for ReadInto<'_> {
    type Output = Result<usize>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<usize>> {
        let this = &mut *self;
        if let ReadStage::FirstPoll(first) = &mut this.stage {
            match first.serve_cached() {
                Some(Poll::Ready(result)) => {
                    this.stage = ReadStage::Done;
                    return Poll::Ready(result);
                }
                Some(Poll::Pending) => {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                None => {}
            }
            let ReadStage::FirstPoll(first) = std::mem::replace(&mut this.stage, ReadStage::Done)
            else {
                unreachable!()
            };
            #[cfg(feature = "cuda")]
            if let Some(m) = first.start_mapped() {
                this.stage = ReadStage::Mapped(first, m);
            } else {
                this.send_to_reactor(first);
            }
            #[cfg(not(feature = "cuda"))]
            {
                this.send_to_reactor(first);
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
                    this.send_to_reactor(first);
                }
            }
        }
        match &mut this.stage {
            ReadStage::Op(op) => {
                let served = this.served;
                Pin::new(op)
                    .poll(cx)
                    .map(|r| super::to_usize(r).map(|n| n + served))
            }
            _ => Poll::Ready(Err(crate::error::Error::invalid(
                crate::error::Context::op(crate::error::OpKind::Read),
                "future polled after it completed",
            ))),
        }
    }
}
