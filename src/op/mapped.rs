//! Reads into device memory straight from the page cache, without a CPU copy (opt-in,
//! [`EngineBuilder::mapped_reads`](crate::EngineBuilder::mapped_reads)): the future maps the
//! read's range in pieces, the engine's registrar (`cuda::mapped`) registers each mapping,
//! and the future's own `poll` queues one copy per registered piece on the destination's
//! stream and hands the registration back behind that copy's event. A read that does not
//! qualify, or any of whose registrations the driver refuses, goes the bounce way as any other.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context as TaskContext, Poll};

use super::device::DeviceCopyOut;
use super::engine_shared::EngineShared;
use crate::cuda::event::{EVENT_POOL, EventGate};
use crate::cuda::mapped::{JobState, MAPPED_READ_MIN, MappedJob, PinnableRange, Registrar};
use crate::cuda::memops::{is_capturing, order_after};
use crate::error::{Context, Error, OpKind};
use crate::plan::residency::FileMapping;
use crate::target::Target;

/// The most bytes one registration covers. A larger read is registered in pieces, so the
/// registrar registers the next piece while the copy engine reads the last; and registration
/// costs grow with size (docs/mapped-reads.md: 64 MiB took 1.6 ms to register, 2.4 ms to
/// unregister), so one huge registration would leave the copy engine idle that long.
pub const MAPPED_PIECE: usize = 64 << 20;

// SAFETY: a `FileMapping` is one mapping made by `mmap` at its creation and unmapped only in
// its `Drop`; its address and length never change, and no method reads through the address.
unsafe impl PinnableRange for FileMapping {
    fn addr(&self) -> *mut std::ffi::c_void {
        FileMapping::addr(self)
    }
    fn len(&self) -> usize {
        FileMapping::len(self)
    }
}

/// One piece of a mapped read: its registration job and where it goes.
struct MappedPiece {
    job: Arc<MappedJob>,
    /// Where the piece's first byte sits in its mapping.
    in_page: usize,
    /// Where the piece goes in the destination.
    at: usize,
    len: usize,
    /// Its copy is queued.
    copied: bool,
}

/// Pieces of one read handed to the registrar and not yet copied, at most. Each is registered
/// (its page-cache pages pinned) as soon as the registrar gets to it, so this bounds what one
/// read pins ahead of its copies (256 MiB) however large it is; a batch of runs or a
/// checkpoint load pins at most this per run in flight.
const MAPPED_WINDOW: usize = 4;

/// A read handed to the registrar, from its first poll until every piece's copy is queued.
pub(crate) struct MappedRead {
    /// Pieces handed over so far, in order; copied ones stay (their jobs are the registrar's).
    pieces: Vec<MappedPiece>,
    /// The read's bytes from here on are not handed over yet.
    next: usize,
    /// The read's file offset and length.
    offset: u64,
    len: usize,
    ctx: Arc<cudarc::driver::CudaContext>,
    registrar: Arc<Registrar>,
}

/// How a mapped read's poll ended.
pub(crate) enum MappedOutcome {
    /// Every copy is queued: the read's bytes.
    Done(Result<usize, Error>),
    /// Not served this way (refused, revoked, or the stream began a graph capture): the read
    /// takes the bounce path, all of it (copies already queued stay ahead of its own on the
    /// same stream and carry the same bytes).
    Fallback,
}

/// Hands a read of `d`'s length at `offset` to the registrar where it qualifies: the engine
/// has mapped reads on, the read is at least [`MAPPED_READ_MIN`] bytes into device memory of a
/// buffered file, wholly inside the file and (by a sampled estimate) in the page cache, and its
/// stream is not capturing a graph. A batch's run qualifies as a lone read does: its copies go
/// on the batch buffer's own stream inside the batch's poll, before the batch records cudarc's
/// write event.
pub(crate) fn try_start(
    engine: &Arc<EngineShared>,
    target: &Target,
    d: &DeviceCopyOut<'_>,
) -> Option<MappedRead> {
    let len = d.dst.byte_len();
    if !engine.policy.mapped_reads
        || len < MAPPED_READ_MIN
        || target.dio.is_some()
        || target.nvme.is_some()
        || target.mapped_refused.load(Ordering::Relaxed)
        || engine.reactor.refuses_work()
        || engine.reactor.is_closed()
        || engine.writes_pending.any(&target.fence_key)
    {
        return None;
    }
    let fd = target.fd.as_ref()?;
    use std::os::fd::AsFd;
    let fd = fd.as_fd();
    let end = d.offset.checked_add(len as u64)?;
    if crate::plan::align::file_len(fd).ok()? < end {
        return None;
    }
    if !crate::plan::residency::estimate(fd, d.offset, len as u64)
        .ok()?
        .all_cached()
    {
        return None;
    }
    let stream = d.copy_stream();
    stream.context().bind_to_thread().ok()?;
    // SAFETY: `stream` is a live stream of the context bound just above.
    if !matches!(unsafe { is_capturing(stream.cu_stream()) }, Ok(false)) {
        return None;
    }
    let registrar = engine.registrar()?;
    let mut read = MappedRead {
        pieces: Vec::with_capacity(len.div_ceil(MAPPED_PIECE)),
        next: 0,
        offset: d.offset,
        len,
        ctx: stream.context().clone(),
        registrar: registrar.clone(),
    };
    // A piece that cannot be mapped or handed over drops the read (and with it the pieces
    // handed over before, which the registrar then skips or undoes).
    read.top_up(target).ok()?;
    Some(read)
}

impl MappedRead {
    /// Maps and hands over the read's next pieces until [`MAPPED_WINDOW`] wait uncopied or the
    /// read is all handed over. `Err`: a mapping failed or the registrar has gone.
    fn top_up(&mut self, target: &Target) -> Result<(), ()> {
        use std::os::fd::AsFd;
        let fd = target.fd.as_ref().ok_or(())?;
        let page = crate::plan::residency::page_size();
        let mut uncopied = self.pieces.iter().filter(|p| !p.copied).count();
        while uncopied < MAPPED_WINDOW && self.next < self.len {
            let (at, n) = (self.next, MAPPED_PIECE.min(self.len - self.next));
            let (map, in_page) =
                FileMapping::covering(fd.as_fd(), self.offset + at as u64, n as u64, page)
                    .map_err(|_| ())?;
            let job = MappedJob::new(self.ctx.clone(), Box::new(map));
            if !self.registrar.submit(job.clone()) {
                return Err(());
            }
            self.pieces.push(MappedPiece {
                job,
                in_page,
                at,
                len: n,
                copied: false,
            });
            self.next += n;
            uncopied += 1;
        }
        Ok(())
    }

    /// Queues each piece's copy once the registrar has registered it, handing over more as
    /// copies are queued; done when every piece's is queued.
    pub(crate) fn poll(
        &mut self,
        d: &mut DeviceCopyOut<'_>,
        target: &Target,
        cx: &mut TaskContext<'_>,
    ) -> Poll<MappedOutcome> {
        loop {
            if self.top_up(target).is_err() {
                return Poll::Ready(MappedOutcome::Fallback);
            }
            let (mut waiting, mut copied_now) = (false, false);
            for i in 0..self.pieces.len() {
                if self.pieces[i].copied {
                    continue;
                }
                match self.poll_piece(i, d, target, cx) {
                    Poll::Pending => waiting = true,
                    Poll::Ready(Ok(())) => {
                        self.pieces[i].copied = true;
                        copied_now = true;
                    }
                    Poll::Ready(Err(outcome)) => return Poll::Ready(outcome),
                }
            }
            let more = self.next < self.len;
            if !waiting && !more {
                self.registrar
                    .counts()
                    .served
                    .fetch_add(1, Ordering::Relaxed);
                return Poll::Ready(MappedOutcome::Done(Ok(self.len)));
            }
            // Copies queued this turn make room for more pieces: hand them over and look again
            // (their waker is set then); otherwise wait for the registrar.
            if !(copied_now && more) && waiting {
                return Poll::Pending;
            }
        }
    }

    /// Queues piece `i`'s copy if it is registered. `Err`: the read ends here (an error, or
    /// the bounce path takes it).
    fn poll_piece(
        &mut self,
        i: usize,
        d: &mut DeviceCopyOut<'_>,
        target: &Target,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Result<(), MappedOutcome>> {
        let piece = &self.pieces[i];
        let mut g = piece.job.lock();
        match &g.0 {
            JobState::Queued if self.registrar.counts().gone.load(Ordering::SeqCst) => {
                // Sent after the registrar took its last job: it will never move.
                return Poll::Ready(Err(MappedOutcome::Fallback));
            }
            JobState::Queued | JobState::Registering => {
                g.1 = Some(cx.waker().clone());
                return Poll::Pending;
            }
            JobState::Registered => {}
            JobState::Refused(why, for_good) => {
                tracing::debug!(%why, for_good, path = %target.path.display(),
                    "mapped read refused; it takes the bounce path");
                if *for_good {
                    target.mapped_refused.store(true, Ordering::Relaxed);
                }
                return Poll::Ready(Err(MappedOutcome::Fallback));
            }
            JobState::Revoked => return Poll::Ready(Err(MappedOutcome::Fallback)),
            JobState::Gated(_) | JobState::Stuck | JobState::Abandoned => {
                return Poll::Ready(Err(MappedOutcome::Done(Err(Error::invalid(
                    Context::op(OpKind::Read),
                    "future polled after it completed",
                )))));
            }
        }
        let stream = d.copy_stream();
        let own = d.dst.own_stream().clone();
        let capturing = stream
            .context()
            .bind_to_thread()
            .map_err(|e| e.to_string())
            // SAFETY: `stream` is a live stream of the context bound just above.
            .and_then(|()| unsafe { is_capturing(stream.cu_stream()) });
        if !matches!(capturing, Ok(false)) {
            // No copy queued: the registrar unregisters it.
            g.0 = JobState::Abandoned;
            drop(g);
            self.registrar.poke();
            return Poll::Ready(Err(MappedOutcome::Fallback));
        }
        let (dptr, write_guard) = d.dst.write_ptr(&stream);
        // SAFETY: the job is `Registered` and this lock keeps the registrar from revoking it
        // before it leaves `Gated` behind the event recorded below (or kept for good); the
        // destination [dptr + at, dptr + at + len) lies inside the device buffer (the pieces
        // tile `[0, byte_len)`), whose pointer cudarc gave us for writing on `stream`, a live
        // stream of the context bound above.
        let rc = unsafe {
            piece.job.queue_copy(
                dptr + piece.at as u64,
                piece.in_page,
                piece.len,
                stream.cu_stream(),
            )
        };
        // cudarc's write event, behind the copy, before the caller can act again.
        drop(write_guard);
        let queued = EVENT_POOL.record(&stream);
        // A capture another thread began on the stream since the check above would have
        // captured the copy or the event instead of running it: then the event says nothing
        // about when the pages are free, and the read did not happen.
        // SAFETY: `stream` is a live stream of the context bound above.
        let captured = !matches!(unsafe { is_capturing(stream.cu_stream()) }, Ok(false));
        let queued = match queued {
            Ok(_) if captured => Err(None),
            Ok(ev) => Ok(ev),
            Err(e) => Err(Some(e)),
        };
        let ordered = match &queued {
            Ok(ev) => order_after(&stream, &own, Some(ev)),
            Err(_) => Ok(()),
        };
        let fail = |why: String| {
            Error::cuda_msg(
                Context::op(OpKind::Read)
                    .with_path(&target.path)
                    .with_offset(d.offset + piece.at as u64)
                    .with_backend("cuda"),
                why,
            )
        };
        let result = match queued {
            Ok(ev) => {
                g.0 = JobState::Gated(EventGate::new(ev));
                match (rc, ordered) {
                    (Ok(()), Ok(())) => Ok(()),
                    (Ok(()), Err(e)) => Err(fail(format!(
                        "ordering the memory's stream after the copy: {e}"
                    ))),
                    (Err(rc), _) => Err(fail(format!(
                        "copying a registered page-cache range into device memory: {rc:?}"
                    ))),
                }
            }
            Err(e) => {
                // Whether a copy is queued cannot be known, nor when it ends.
                g.0 = JobState::Stuck;
                Err(fail(match e {
                    Some(e) => format!("recording the copy's event: {e}"),
                    None => "the stream began a graph capture while the read queued its copy"
                        .to_string(),
                }))
            }
        };
        drop(g);
        self.registrar.poke();
        Poll::Ready(result.map_err(|e| MappedOutcome::Done(Err(e))))
    }
}

impl Drop for MappedRead {
    fn drop(&mut self) {
        let mut poke = false;
        for piece in &self.pieces {
            let mut g = piece.job.lock();
            if matches!(
                g.0,
                JobState::Queued | JobState::Registering | JobState::Registered
            ) {
                // No copy was queued from it: the registrar unregisters (or skips) it.
                g.0 = JobState::Abandoned;
                g.1 = None;
                poke = true;
            }
        }
        if poke {
            self.registrar.poke();
        }
    }
}
