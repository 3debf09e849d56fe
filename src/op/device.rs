//! Moving bytes between bounce slots and device memory inside the future's `poll`.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaEvent, CudaStream};

use super::future::Transfer;
use super::gate::Gated;
use super::msg::Msg;
use super::{OpShared, ReadyPiece, Staging};
use crate::buf::arena::BounceArena;
use crate::cuda::event::{EVENT_POOL, EventGate};
use crate::cuda::{DeviceDst, DeviceSrc};
use crate::error::{Context, Error, OpKind};

/// Queues copies on the caller's stream (`chosen`) or else on the memory's own stream:
/// binds the context, makes sure the pool is pinned, runs `issue(stream)`, and records the
/// event the reactor polls before reusing the slots. When the copies ran on another stream, the
/// memory's own stream also waits for that event, so whatever is queued there later (cudarc
/// frees a buffer on its own stream) follows the copies even where cudarc tracks no events.
fn queue_copies(
    arena: &BounceArena,
    chosen: Option<&Arc<CudaStream>>,
    own: &Arc<CudaStream>,
    issue: impl FnOnce(&Arc<CudaStream>) -> Result<(), String>,
) -> Result<CudaEvent, String> {
    let stream = chosen.unwrap_or(own);
    let ctx = stream.context();
    ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
    arena.ensure_pinned(ctx);
    issue(stream)?;
    let ev = EVENT_POOL.record(stream).map_err(|e| format!("{e:?}"))?;
    if stream.cu_stream() != own.cu_stream() {
        own.wait(&ev).map_err(|e| format!("{e:?}"))?;
    }
    Ok(ev)
}

/// The device address of a piece's staging slot, for pieces cuFile moved (`None`: host slot).
fn staged(staging: Option<&Staging>, p: &ReadyPiece) -> Result<Option<u64>, String> {
    if !p.slot.on_device {
        return Ok(None);
    }
    staging
        .map(|s| Some(s.base + p.slot.offset as u64))
        .ok_or_else(|| "a staging slot arrived without its staging pool".to_string())
}

fn check(rc: CUresult, what: &str) -> Result<(), String> {
    if rc == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {rc:?}"))
    }
}

/// Copies read pieces into device memory standing for file bytes `[offset, offset + len)`.
pub(crate) struct DeviceCopyOut<'a> {
    pub(crate) dst: &'a mut dyn DeviceDst,
    pub(crate) offset: u64,
    pub(crate) stream: Option<Arc<CudaStream>>,
    pub(crate) error: Option<Error>,
}

impl Transfer for DeviceCopyOut<'_> {
    fn transfer(
        &mut self,
        pieces: Vec<ReadyPiece>,
        arena: &Arc<BounceArena>,
        shared: &Arc<OpShared>,
    ) -> Option<Msg> {
        let (offset, len) = (self.offset, self.dst.byte_len());
        let own = self.dst.own_stream().clone();
        let staging = shared.staging.get();
        let dst = &mut *self.dst;
        let issued = queue_copies(arena, self.stream.as_ref(), &own, |stream| {
            let (dptr, write_guard) = dst.write_ptr(stream);
            for p in &pieces {
                let Some((from, to, n)) = p.overlap(offset, len) else {
                    continue;
                };
                let rc = match staged(staging, p)? {
                    // SAFETY: the source lies inside a staging slot this future owns until the
                    // reactor sees the copies' event complete; the destination range
                    // [to, to + n) lies inside the device buffer (overlap clips it to `len`),
                    // whose pointer cudarc gave us for writing on `stream`; both are on the
                    // staging pool's device and the copy is ordered on `stream`.
                    Some(src) => unsafe {
                        sys::cuMemcpyDtoDAsync_v2(
                            dptr + to,
                            src + from as u64,
                            n,
                            stream.cu_stream(),
                        )
                    },
                    // SAFETY: as above, with the source in a host bounce slot.
                    None => unsafe {
                        sys::cuMemcpyHtoDAsync_v2(
                            dptr + to,
                            arena.slot_ptr(&p.slot).add(from).cast(),
                            n,
                            stream.cu_stream(),
                        )
                    },
                };
                check(rc, "cuMemcpyAsync into device memory")?;
            }
            // Record cudarc's write event now (not when the future finishes): any later use of
            // the buffer through cudarc, on any stream, is then ordered after these copies,
            // even if this future is leaked.
            drop(write_guard);
            Ok(())
        });
        let release =
            |s, p: Vec<ReadyPiece>| Msg::Release(s, p.into_iter().map(|p| p.slot).collect());
        gate_or_abandon(
            issued,
            pieces,
            arena,
            shared,
            &mut self.error,
            OpKind::Read,
            offset,
            release,
        )
    }

    fn take_error(&mut self) -> Option<Error> {
        self.error.take()
    }
}

/// After queuing copies: on success, the message `then` builds waits behind the copies' event;
/// on failure the op fails with the reason, and the pieces are abandoned (copies may be queued
/// with no event to say when they end, so their slots stay out of service for good).
#[allow(clippy::too_many_arguments)]
fn gate_or_abandon(
    issued: Result<CudaEvent, String>,
    pieces: Vec<ReadyPiece>,
    arena: &Arc<BounceArena>,
    shared: &Arc<OpShared>,
    error: &mut Option<Error>,
    op: OpKind,
    offset: u64,
    then: impl FnOnce(Arc<OpShared>, Vec<ReadyPiece>) -> Msg,
) -> Option<Msg> {
    let staging = shared.staging.get().map(|s| s.keep.clone());
    match issued {
        Ok(ev) => Some(Msg::Gated(
            Gated::new(
                Box::new(EventGate::new(ev)),
                then(shared.clone(), pieces),
                arena,
            )
            .keeping(staging),
        )),
        Err(reason) => {
            let at = pieces.first().map_or(offset, |p| p.piece.pos);
            *error = Some(Error::cuda_msg(
                Context::op(op).with_offset(at).with_backend("cuda"),
                reason,
            ));
            Some(Msg::Abandon(shared.clone(), pieces))
        }
    }
}

/// Fills write pieces from device memory standing for file bytes `[offset, offset + len)`.
pub(crate) struct DeviceFill<'a> {
    pub(crate) src: &'a dyn DeviceSrc,
    pub(crate) offset: u64,
    pub(crate) stream: Option<Arc<CudaStream>>,
    pub(crate) error: Option<Error>,
}

impl Transfer for DeviceFill<'_> {
    fn transfer(
        &mut self,
        pieces: Vec<ReadyPiece>,
        arena: &Arc<BounceArena>,
        shared: &Arc<OpShared>,
    ) -> Option<Msg> {
        let (offset, src) = (self.offset, self.src);
        let staging = shared.staging.get();
        let issued = queue_copies(arena, self.stream.as_ref(), src.own_stream(), |stream| {
            let (sptr, read_guard) = src.read_ptr(stream);
            for p in &pieces {
                let from = p.piece.pos - offset;
                let rc = match staged(staging, p)? {
                    // SAFETY: the staging slot is owned by this future until the reactor sees
                    // the copies' event complete; [from, from + valid) lies inside the source
                    // (pieces cover exactly the requested range); both are on the staging
                    // pool's device; the copy is ordered on `stream`.
                    Some(dst) => unsafe {
                        sys::cuMemcpyDtoDAsync_v2(dst, sptr + from, p.valid, stream.cu_stream())
                    },
                    // SAFETY: as above, into a host bounce slot.
                    None => unsafe {
                        sys::cuMemcpyDtoHAsync_v2(
                            arena.slot_ptr(&p.slot).cast(),
                            sptr + from,
                            p.valid,
                            stream.cu_stream(),
                        )
                    },
                };
                check(rc, "cuMemcpyAsync out of device memory")?;
            }
            // cudarc's read event now: later writes to the source wait for these copies.
            drop(read_guard);
            Ok(())
        });
        gate_or_abandon(
            issued,
            pieces,
            arena,
            shared,
            &mut self.error,
            OpKind::Write,
            offset,
            Msg::Filled,
        )
    }

    fn take_error(&mut self) -> Option<Error> {
        self.error.take()
    }
}
