//! Moving bytes between bounce slots and device memory inside the future's `poll`.

use std::sync::Arc;

use cudarc::driver::result::{memcpy_dtod_async, memcpy_dtoh_async, memcpy_htod_async};
use cudarc::driver::{CudaEvent, CudaStream, DriverError};

use super::combine::{CachedRead, Combined, CopyCombiner};
use super::engine_shared::EngineShared;
use super::engine_shared::StripedCounter;
use super::future::Transfer;
use super::gate::Gated;
use super::msg::Msg;
use super::{DeviceStaging, OpShared, ReadyPiece, ReadyPieces};
use crate::buf::arena::BounceArena;
use crate::cuda::copylist::{self, CopySpec};
use crate::cuda::event::{EVENT_POOL, EventGate};
use crate::cuda::memops::{is_capturing, order_after};
use crate::cuda::side;
use crate::cuda::{DeviceDst, DeviceSrc};
use crate::error::{Context, Error, OpKind};

/// Small reads whose slots went back to the reactor as soon as their copies were queued
/// ([`DeviceCopyOut::copy_small`]), process-wide: for tests. Striped: every runtime thread
/// adds to it once per small read, and one shared line would move between their caches.
static SMALL_RELEASED_EARLY: StripedCounter = StripedCounter::new();

/// How many small reads into device memory so far handed their bounce slots back as soon as
/// their copies were queued (the driver had read the slots during the call), process-wide:
/// for tests.
#[doc(hidden)]
pub fn small_reads_released_early() -> u64 {
    SMALL_RELEASED_EARLY.load()
}

/// Queues copies on the caller's stream (`chosen`) or else on the memory's own stream:
/// binds the context, makes sure the pool is pinned, runs `issue(stream)`, and records the
/// event the reactor polls before reusing the slots. When the copies ran on another stream, the
/// memory's own stream also waits for that event, so whatever is queued there later (cudarc
/// frees a buffer on its own stream) follows the copies even where cudarc tracks no events.
fn queue_device_copies(
    arena: &BounceArena,
    chosen: Option<&Arc<CudaStream>>,
    own: &Arc<CudaStream>,
    issue: impl FnOnce(&Arc<CudaStream>) -> Result<(), CopyError>,
) -> Result<CudaEvent, CopyError> {
    let stream = chosen.unwrap_or(own);
    let ctx = stream.context();
    ctx.bind_to_thread()
        .map_err(CopyError::driver("binding the context"))?;
    arena.ensure_pinned(ctx);
    issue(stream)?;
    let ev = EVENT_POOL
        .record(stream)
        .map_err(CopyError::driver("recording the copies' event"))?;
    order_after(stream, own, Some(&ev)).map_err(CopyError::driver(
        "ordering the memory's stream after the copies",
    ))?;
    Ok(ev)
}

/// Why queuing device copies failed: a driver call (with cudarc's error), or a staging slot
/// without its pool (a bug, reported rather than acted on).
#[derive(Debug)]
pub(super) enum CopyError {
    Driver(&'static str, DriverError),
    NoStaging,
}

impl CopyError {
    fn driver(what: &'static str) -> impl FnOnce(DriverError) -> CopyError {
        move |e| CopyError::Driver(what, e)
    }
}

impl std::fmt::Display for CopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CopyError::Driver(what, e) => write!(f, "{what}: {e}"),
            CopyError::NoStaging => f.write_str("a staging slot arrived without its staging pool"),
        }
    }
}

/// The device address of a piece's staging slot, for pieces cuFile moved (`None`: host slot).
fn staged(staging: Option<&DeviceStaging>, p: &ReadyPiece) -> Result<Option<u64>, CopyError> {
    if !p.slot.on_device {
        return Ok(None);
    }
    staging
        .map(|s| Some(s.base + p.slot.offset as u64))
        .ok_or(CopyError::NoStaging)
}

/// The copies that move read `pieces` into device memory at `dptr`, which stands for file
/// bytes `[offset, offset + len)`: each piece's valid bytes clipped to that range, from its
/// host bounce slot or device staging slot. The destinations are disjoint, as batched copies
/// need: an op's pieces cover disjoint file ranges (a short read is resubmitted into its own
/// slot), and the runs of a batch are disjoint ranges of its buffer (the plan refuses overlap).
pub(super) fn read_copy_specs(
    pieces: &[ReadyPiece],
    arena: &BounceArena,
    staging: Option<&DeviceStaging>,
    dptr: u64,
    offset: u64,
    len: usize,
    out: &mut Vec<CopySpec>,
) -> Result<(), CopyError> {
    for p in pieces {
        let Some((from, to, n)) = p.overlap(offset, len) else {
            continue;
        };
        let (src, direct) = match staged(staging, p)? {
            Some(src) => (src, true),
            None => (
                arena.slot_ptr(&p.slot) as u64,
                arena.slot_is_pinned(&p.slot),
            ),
        };
        out.push(CopySpec {
            dst: dptr + to,
            src: src + from as u64,
            n,
            direct,
        });
    }
    Ok(())
}

/// How a read's bytes move into device memory: chosen once per read, by
/// [`DeviceCopyOut::copy_plan`] at its first poll (when the stream it runs on is known), and
/// followed by every poll after. Where the pieces land first (host bounce slots, or cuFile's
/// device staging) is the router's choice (`Lane::route`), and whether the page cache is
/// tried before the reactor is `File::read_into`'s; docs/device-paths.md has the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DeviceCopyPlan {
    /// A batch's run: the batch's page-cache stage, or its combined copies (`op::combine`).
    Combined,
    /// A small read (at most `CACHED_READ_MAX` bytes): where the stream takes copies whose
    /// sources the driver reads during the call ([`stageable`], checked before each such
    /// call), the page-cache stage, else one such call for the landed pieces, whose slots then
    /// go straight back; otherwise a copy per piece.
    Staged,
    /// One copy per piece, the slots held behind an event.
    PerPiece,
}

/// Copies read pieces into device memory standing for file bytes `[offset, offset + len)`.
pub(crate) struct DeviceCopyOut<'a> {
    pub(crate) dst: &'a mut dyn DeviceDst,
    pub(crate) offset: u64,
    pub(crate) stream: Option<Arc<CudaStream>>,
    pub(crate) error: Option<Error>,
    /// Hand the pieces to a batch that copies them with its other reads' (`op::combine`).
    pub(crate) combine: Option<Arc<CopyCombiner>>,
    /// The plan, once chosen.
    plan: Option<DeviceCopyPlan>,
}

impl<'a> DeviceCopyOut<'a> {
    /// A read into `dst` of file bytes from `offset`, on the memory's own stream, not part of
    /// a batch, its plan not yet chosen.
    pub(crate) fn new(dst: &'a mut dyn DeviceDst, offset: u64) -> Self {
        DeviceCopyOut {
            dst,
            offset,
            stream: None,
            error: None,
            combine: None,
            plan: None,
        }
    }
}

/// Whether small reads may stage their bytes in pageable memory and copy them in `stream`'s
/// order (`op::cached`): the driver reads such a source during the copy call, which it takes
/// on `stream` or, for the NULL and legacy streams, on gpuio's side stream
/// (`cuda::side`); and the stream is not being captured into a graph (a captured copy would
/// read the stage when the graph runs).
pub(super) fn stageable(stream: &CudaStream) -> bool {
    let accepted = copylist::staged_ok(stream.cu_stream())
        || (side::needs_side(stream) && copylist::staged_available());
    if !accepted || stream.context().bind_to_thread().is_err() {
        return false;
    }
    // SAFETY: `stream` is a live stream (we hold it) of the context bound just above.
    matches!(unsafe { is_capturing(stream.cu_stream()) }, Ok(false))
}

impl DeviceCopyOut<'_> {
    /// The stream the copies go on: the caller's, else the memory's own.
    pub(super) fn copy_stream(&self) -> Arc<CudaStream> {
        self.stream
            .clone()
            .unwrap_or_else(|| self.dst.own_stream().clone())
    }

    /// The read's copy plan: chosen at the first call, the same at every later one. The one
    /// place that decides how a read's bytes reach device memory.
    pub(crate) fn copy_plan(&mut self) -> DeviceCopyPlan {
        if let Some(plan) = self.plan {
            return plan;
        }
        // The stream's part (`stageable`) is a precondition checked before each staged call,
        // not here: checking it here too would cost the first poll of every small read a
        // second context bind and capture query.
        let plan = if self.combine.is_some() {
            DeviceCopyPlan::Combined
        } else if self.dst.byte_len() <= super::cached::CACHED_READ_MAX {
            DeviceCopyPlan::Staged
        } else {
            DeviceCopyPlan::PerPiece
        };
        self.plan = Some(plan);
        plan
    }

    /// Serves the read from the page cache if it holds every byte (`op::cached`): through
    /// this thread's pageable stage and one copy, or, for a batch's read, through the batch's
    /// stage (a pinned one of `stages` where one is free), whose copies are queued together
    /// when it fills or at the batch's flush. `None`: not served.
    pub(crate) fn read_cached(
        &mut self,
        fd: std::os::fd::RawFd,
        refused: &std::sync::atomic::AtomicBool,
        stages: &Arc<crate::cuda::stage::StagePool>,
    ) -> Option<Result<usize, Error>> {
        let len = self.dst.byte_len();
        let own = self.dst.own_stream().clone();
        match self.copy_plan() {
            DeviceCopyPlan::Combined => {
                let c = self.combine.as_ref()?; // always there: the plan is chosen from it
                // A batch's range: the pointer only (the batch records cudarc's event itself).
                let (dptr, _range) = self.dst.write_ptr(&own);
                let read = CachedRead {
                    dptr,
                    offset: self.offset,
                    len,
                };
                return c.read_cached(fd, refused, &own, stages, read).map(Ok);
            }
            DeviceCopyPlan::Staged => {}
            DeviceCopyPlan::PerPiece => return None,
        }
        let stream = self.copy_stream();
        // The plan holds for the read, but this poll may run on another thread, or the stream
        // may have begun a graph capture since: the conditions are checked again (and the
        // context bound) before each staged call.
        if !stageable(&stream) {
            return None;
        }
        super::cached::with_stage(|stage| {
            let n = super::cached::try_read(fd, refused, &mut stage.bytes()[..len], self.offset)?;
            Some(
                self.copy_staged(stage.addr(), n, &stream, &own)?
                    .map(|()| n),
            )
        })
    }

    /// Copies `n` bytes at `src`, in this thread's pageable stage, to the start of the
    /// destination on `stream` (which [`stageable`] accepted), in front of cudarc's write
    /// event; the stage is free again when this returns. When `stream` is not the memory's own,
    /// the own stream is ordered after the copy (cudarc frees memory there). `None`: nothing
    /// was queued (the legacy stream's side stream could not be had); the read goes through
    /// the reactor instead.
    fn copy_staged(
        &mut self,
        src: u64,
        n: usize,
        stream: &Arc<CudaStream>,
        own: &Arc<CudaStream>,
    ) -> Option<Result<(), Error>> {
        let offset = self.offset;
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            Error::cuda_msg(
                Context::op(OpKind::Read)
                    .with_offset(offset)
                    .with_backend("cuda"),
                format!("{what}: {e}"),
            )
        };
        if n == 0 {
            return Some(Ok(()));
        }
        debug_assert!(n <= self.dst.byte_len());
        let (dptr, write_guard) = self.dst.write_ptr(stream);
        let copy = CopySpec {
            dst: dptr,
            src,
            n,
            direct: false,
        };
        let queued = side::queue_in_order(stream, |raw| {
            // SAFETY: `raw` is a live stream of the context `stageable` bound, one `staged_ok`
            // accepts (`stream`, or the side stream ordered with it); the source is the
            // caller's stage, pageable memory of our own mapping that `queue_staged` has read
            // when it returns; the destination [dptr, dptr + n) lies inside the device buffer
            // (n is at most its length), whose pointer cudarc gave us for writing on `stream`.
            unsafe { copylist::queue_staged(raw, &[copy]) }
        });
        drop(write_guard);
        match queued {
            Err(side::StagedError::NotQueued(_)) => return None,
            Err(e) => return Some(Err(fail("copying into device memory", &e))),
            Ok(()) => {}
        }
        if let Err(e) = order_after(stream, own, None) {
            return Some(Err(fail("ordering the memory's stream after the copy", &e)));
        }
        Some(Ok(()))
    }
}

impl DeviceCopyOut<'_> {
    /// A small read's pieces (at most [`CACHED_READ_MAX`](super::cached::CACHED_READ_MAX)
    /// bytes, all in host slots) copied in one call whose sources the driver reads before it
    /// returns (`copylist::queue_staged`), so the slots go straight back to the reactor: no
    /// event to record, and none for the reactor to poll before it can reuse them. O_DIRECT
    /// and cold small reads take this; cached ones are served before they reach the reactor
    /// (`read_cached`). Taken under [`DeviceCopyPlan::Staged`]. `Err` gives the pieces back:
    /// they landed in cuFile's staging slots (the router's choice), or the stream no longer
    /// takes such calls; the caller copies them.
    fn copy_small(
        &mut self,
        pieces: ReadyPieces,
        arena: &Arc<BounceArena>,
        shared: &Arc<OpShared>,
        own: &Arc<CudaStream>,
    ) -> Result<Option<Msg>, ReadyPieces> {
        let (offset, len) = (self.offset, self.dst.byte_len());
        if pieces.iter().any(|p| p.slot.on_device) {
            return Err(pieces);
        }
        let stream = self.copy_stream();
        if !stageable(&stream) {
            return Err(pieces);
        }
        let (dptr, write_guard) = self.dst.write_ptr(&stream);
        let mut copies = Vec::with_capacity(pieces.len());
        // Host slots only (checked above), so no staging pool is consulted and this cannot
        // fail; were it to, the copies are left to the caller.
        if read_copy_specs(&pieces, arena, None, dptr, offset, len, &mut copies).is_err() {
            return Err(pieces);
        }
        let queued = side::queue_in_order(&stream, |raw| {
            // SAFETY: `raw` is a live stream of the context `stageable` bound, one `staged_ok`
            // accepts (`stream`, or the side stream ordered with it); each source lies in a
            // host bounce slot this future holds until the Release below, which
            // `queue_staged` has finished reading when it returns (however it returns, unless
            // a stream's synchronisation itself failed: then the slots are abandoned below);
            // each destination lies inside the device buffer (`read_copy_specs` clips to `len`),
            // whose pointer cudarc gave us for writing on `stream`, and an op's pieces cover
            // disjoint ranges.
            unsafe { copylist::queue_staged(raw, &copies) }
        });
        // cudarc's write event, behind the copies, before the caller can act again.
        drop(write_guard);
        if let Err(side::StagedError::NotQueued(_)) = queued {
            return Err(pieces);
        }
        let ordered = match &queued {
            Ok(()) => order_after(&stream, own, None),
            Err(_) => Ok(()),
        };
        let fail = |why: String| {
            let at = pieces.first().map_or(offset, |p| p.piece.pos);
            Error::cuda_msg(
                Context::op(OpKind::Read)
                    .with_offset(at)
                    .with_backend("cuda"),
                why,
            )
        };
        Ok(Some(match (queued, ordered) {
            (Ok(()), Ok(())) => {
                SMALL_RELEASED_EARLY.add(1);
                Msg::release(shared, pieces)
            }
            (Ok(()), Err(e)) => {
                // The copies have finished (`order_after` synchronised): the slots are free.
                self.error = Some(fail(format!(
                    "ordering the memory's stream after the copies: {e}"
                )));
                Msg::release(shared, pieces)
            }
            (Err(why), _) => {
                self.error = Some(fail(format!("copying into device memory: {why}")));
                Msg::Abandon(shared.clone(), pieces)
            }
        }))
    }
}

impl Transfer for DeviceCopyOut<'_> {
    fn transfer(
        &mut self,
        pieces: ReadyPieces,
        engine: &Arc<EngineShared>,
        shared: &Arc<OpShared>,
    ) -> Option<Msg> {
        let arena = &engine.arena;
        let (offset, len) = (self.offset, self.dst.byte_len());
        let own = self.dst.own_stream().clone();
        let plan = self.copy_plan();
        let pieces = match (plan, &self.combine) {
            (DeviceCopyPlan::Combined, Some(c)) => {
                // The batch issues these copies with its other reads' before this poll returns.
                let (dptr, _noop) = self.dst.write_ptr(&own);
                c.push(Combined {
                    engine: engine.clone(),
                    arena: arena.clone(),
                    shared: shared.clone(),
                    pieces,
                    dptr,
                    offset,
                    len,
                });
                return None;
            }
            (DeviceCopyPlan::Staged, _) => match self.copy_small(pieces, arena, shared, &own) {
                Ok(msg) => return msg,
                Err(pieces) => pieces,
            },
            // (`Combined` always has its batch: the plan is chosen from it.)
            (DeviceCopyPlan::PerPiece | DeviceCopyPlan::Combined, _) => pieces,
        };
        let staging = shared.staging.get();
        let dst = &mut *self.dst;
        let issued = queue_device_copies(arena, self.stream.as_ref(), &own, |stream| {
            let (dptr, write_guard) = dst.write_ptr(stream);
            // One call per piece, each the typed copy for its source: a read's pieces are few
            // and large, or one small one (batches of small reads go through `combine`).
            for p in &pieces {
                let Some((from, to, n)) = p.overlap(offset, len) else {
                    continue;
                };
                let queued = match staged(staging, p)? {
                    // SAFETY: the source lies inside a staging slot this future owns until the
                    // reactor sees the copies' event complete; the destination range
                    // [to, to + n) lies inside the device buffer (overlap clips it to `len`),
                    // whose pointer cudarc gave us for writing on `stream`; both are on the
                    // staging pool's device and the copy is ordered on `stream`.
                    Some(src) => unsafe {
                        memcpy_dtod_async(dptr + to, src + from as u64, n, stream.cu_stream())
                    },
                    // SAFETY: as above, with the source in a host bounce slot: the slice is
                    // read by the copy engine after this call returns, which is sound because
                    // the slot stays this future's (and mapped) until the event completes.
                    None => unsafe {
                        let bytes = arena.slot_bytes(&p.slot, p.valid);
                        memcpy_htod_async(dptr + to, &bytes[from..from + n], stream.cu_stream())
                    },
                };
                queued.map_err(CopyError::driver("copying into device memory"))?;
            }
            // Record cudarc's write event now (not when the future finishes): any later use of
            // the buffer through cudarc, on any stream, is then ordered after these copies,
            // even if this future is leaked.
            drop(write_guard);
            Ok(())
        });
        let release = |s: Arc<OpShared>, p: ReadyPieces| Msg::release(&s, p);
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
    issued: Result<CudaEvent, CopyError>,
    pieces: ReadyPieces,
    arena: &Arc<BounceArena>,
    shared: &Arc<OpShared>,
    error: &mut Option<Error>,
    op: OpKind,
    offset: u64,
    then: impl FnOnce(Arc<OpShared>, ReadyPieces) -> Msg,
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
                reason.to_string(),
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
        pieces: ReadyPieces,
        engine: &Arc<EngineShared>,
        shared: &Arc<OpShared>,
    ) -> Option<Msg> {
        let arena = &engine.arena;
        let (offset, src) = (self.offset, self.src);
        let staging = shared.staging.get();
        let issued = queue_device_copies(arena, self.stream.as_ref(), src.own_stream(), |stream| {
            let (sptr, read_guard) = src.read_ptr(stream);
            for p in &pieces {
                let from = p.piece.pos - offset;
                let queued = match staged(staging, p)? {
                    // SAFETY: the staging slot is owned by this future until the reactor sees
                    // the copies' event complete; [from, from + valid) lies inside the source
                    // (pieces cover exactly the requested range); both are on the staging
                    // pool's device; the copy is ordered on `stream`.
                    Some(dst) => unsafe {
                        memcpy_dtod_async(dst, sptr + from, p.valid, stream.cu_stream())
                    },
                    // SAFETY: as above, into a host bounce slot: the copy engine writes the
                    // slot after this returns; nothing else touches it until the event has
                    // completed (the slot goes back to the reactor only behind that gate).
                    None => unsafe {
                        let bytes = arena.slot_bytes_mut(&p.slot, p.valid);
                        memcpy_dtoh_async(bytes, sptr + from, stream.cu_stream())
                    },
                };
                queued.map_err(CopyError::driver("copying out of device memory"))?;
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
