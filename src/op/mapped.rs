//! Reads into device memory straight from the page cache, without a CPU copy (opt-in,
//! [`EngineBuilder::mapped_reads`](crate::EngineBuilder::mapped_reads)): the future maps the
//! read's range, the engine's registrar (`cuda::mapped`) registers the mapping, and the
//! future's own `poll` queues one copy from it on the destination's stream and hands the
//! registration back behind that copy's event. A read that does not qualify, or whose
//! registration the driver refuses, goes the bounce way as any other.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context as TaskContext, Poll};

use super::device::DeviceCopyOut;
use super::engine_shared::EngineShared;
use crate::cuda::event::{EVENT_POOL, EventGate};
use crate::cuda::mapped::{FileMapping, JobState, MAPPED_READ_MIN, MappedJob, Registrar};
use crate::cuda::memops::{is_capturing, order_after};
use crate::error::{Context, Error, OpKind};
use crate::target::Target;

/// A read handed to the registrar, from its first poll until its copy is queued.
pub(crate) struct MappedRead {
    job: Arc<MappedJob>,
    registrar: Arc<Registrar>,
    /// Where the read's first byte sits in the mapping.
    in_page: usize,
}

/// How a mapped read's poll ended.
pub(crate) enum MappedOutcome {
    /// The copy is queued: the read's bytes.
    Done(Result<usize, Error>),
    /// Not served this way (refused, revoked, or the stream began a graph capture): the read
    /// takes the bounce path.
    Fallback,
}

/// Hands a read of `d`'s length at `offset` to the registrar where it qualifies: the engine
/// has mapped reads on, the read is a lone one (not a batch's) of at least
/// [`MAPPED_READ_MIN`] bytes into device memory of a buffered file, wholly inside the file and
/// (by a sampled estimate) in the page cache, and its stream is not capturing a graph.
pub(crate) fn try_start(
    engine: &Arc<EngineShared>,
    target: &Target,
    d: &DeviceCopyOut<'_>,
) -> Option<MappedRead> {
    let len = d.dst.byte_len();
    if !engine.policy.mapped_reads
        || len < MAPPED_READ_MIN
        || d.combine.is_some()
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
    let page = crate::plan::residency::page_size();
    let (map, in_page) = FileMapping::new(fd, d.offset, len, page).ok()?;
    let job = MappedJob::new(stream.context().clone(), map);
    if !registrar.submit(job.clone()) {
        return None;
    }
    Some(MappedRead {
        job,
        registrar: registrar.clone(),
        in_page,
    })
}

impl MappedRead {
    /// Queues the copy once the registrar has registered the range.
    pub(crate) fn poll(
        &mut self,
        d: &mut DeviceCopyOut<'_>,
        target: &Target,
        cx: &mut TaskContext<'_>,
    ) -> Poll<MappedOutcome> {
        let registrar = &self.registrar;
        let mut g = self.job.lock();
        match &g.0 {
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
                return Poll::Ready(MappedOutcome::Fallback);
            }
            JobState::Revoked => return Poll::Ready(MappedOutcome::Fallback),
            JobState::Gated(_) | JobState::Stuck | JobState::Abandoned => {
                return Poll::Ready(MappedOutcome::Done(Err(Error::invalid(
                    Context::op(OpKind::Read),
                    "future polled after it completed",
                ))));
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
            registrar.poke();
            return Poll::Ready(MappedOutcome::Fallback);
        }
        let len = d.dst.byte_len();
        let (dptr, write_guard) = d.dst.write_ptr(&stream);
        // SAFETY: the job is `Registered` and this lock keeps the registrar from revoking it
        // before it leaves `Gated` behind the event recorded below (or kept for good); the
        // destination [dptr, dptr + len) is the whole device buffer, whose pointer cudarc
        // gave us for writing on `stream`, a live stream of the context bound above.
        let rc = unsafe {
            self.job
                .queue_copy(dptr, self.in_page, len, stream.cu_stream())
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
                    .with_offset(d.offset)
                    .with_backend("cuda"),
                why,
            )
        };
        let result = match queued {
            Ok(ev) => {
                g.0 = JobState::Gated(EventGate::new(ev));
                match (rc, ordered) {
                    (Ok(()), Ok(())) => Ok(len),
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
        registrar.poke();
        if result.is_ok() {
            registrar.counts().served.fetch_add(1, Ordering::Relaxed);
        }
        Poll::Ready(MappedOutcome::Done(result))
    }
}

impl Drop for MappedRead {
    fn drop(&mut self) {
        let mut g = self.job.lock();
        if matches!(
            g.0,
            JobState::Queued | JobState::Registering | JobState::Registered
        ) {
            // No copy was queued: the registrar unregisters (or skips) it.
            g.0 = JobState::Abandoned;
            g.1 = None;
            drop(g);
            self.registrar.poke();
        }
    }
}
