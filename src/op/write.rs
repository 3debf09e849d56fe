//! Writes from borrowed host memory: the future fills empty slots from the caller's buffer,
//! the reactor writes the slots.

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

/// Fills write pieces from `src`, which stands for file bytes `[offset, offset + src.len())`.
pub(crate) struct HostFill<'a> {
    pub(crate) src: &'a [u8],
    pub(crate) offset: u64,
}

impl Transfer for HostFill<'_> {
    fn transfer(
        &mut self,
        pieces: ReadyPieces,
        engine: &Arc<EngineShared>,
        shared: &Arc<OpShared>,
    ) -> Option<Msg> {
        let arena = &engine.arena;
        for p in &pieces {
            let from = (p.piece.pos - self.offset) as usize;
            // SAFETY: the slot was handed to this future and comes back to the reactor only
            // through the Filled message below; nothing else touches it until then.
            let dst = unsafe { arena.slot_bytes_mut(&p.slot, p.valid) };
            dst.copy_from_slice(&self.src[from..from + p.valid]);
        }
        Some(Msg::Filled(shared.clone(), pieces))
    }
}

/// Where written bytes come from: host memory, or device memory through a copy engine.
#[cfg(feature = "cuda")]
pub(crate) type Fill<'a> = Either<HostFill<'a>, crate::op::device::DeviceFill<'a>>;
#[cfg(not(feature = "cuda"))]
pub(crate) type Fill<'a> = Either<HostFill<'a>, NoTransfer>;

/// Future of [`File::write_from`](crate::File::write_from): the whole source is written, or an
/// error is returned. Cancel-safe in the same sense as [`ReadInto`](crate::ReadInto); a write
/// dropped mid-flight may have written part of its range.
#[must_use = "futures do nothing unless polled"]
pub struct WriteFrom<'a> {
    pub(crate) inner: OpFuture<Fill<'a>>,
}

impl WriteFrom<'_> {
    /// Orders the device-to-host copies on `stream` instead of the source's own stream, so
    /// they follow the kernels the caller queued there. No effect for host sources.
    #[cfg(feature = "cuda")]
    pub fn on_stream(mut self, stream: &Arc<cudarc::driver::CudaStream>) -> Self {
        if let Either::Device(d) = self.inner.transfer_mut() {
            d.stream = Some(stream.clone());
        }
        self
    }
}

impl WriteFrom<'_> {
    /// Reports the bytes this write moves to `progress` (its `done`; the caller plans its
    /// `total`). Call before the first poll.
    pub fn with_progress(mut self, progress: &Arc<super::progress::Progress>) -> Self {
        let len = match self.inner.transfer_mut() {
            Either::Host(h) => h.src.len(),
            #[cfg(feature = "cuda")]
            Either::Device(d) => d.src.byte_len(),
            #[cfg(not(feature = "cuda"))]
            Either::Device(_) => 0,
        };
        self.inner.track(progress, len as u64);
        self
    }
}

impl Future for WriteFrom<'_> {
    type Output = Result<usize>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<usize>> {
        Pin::new(&mut self.inner).poll(cx).map(super::to_usize)
    }
}
