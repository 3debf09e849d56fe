//! A stream of gpuio's own per context, for staged copies (`copylist::queue_staged`) into
//! memory used on the NULL or legacy default stream, which the batched call those copies need
//! does not take. torch's and cupy's default stream is the legacy one, so this is what Python
//! code gets unless it names a stream.
//!
//! The copies go on the side stream between two events: the side stream first waits for an
//! event the caller's stream records (so the copies follow everything queued there before),
//! and the caller's stream then waits for an event recorded behind the copies (so everything
//! queued there afterwards follows them, a stream-ordered free included). That is the order
//! the copies would have had on the caller's stream itself. The side stream is non-blocking,
//! so the legacy stream's implicit synchronisation never involves it; only the two events
//! order it.
//!
//! Side streams, like the event pool's events, keep their context retained for the process's
//! life; one whose use fails (a context reset) is forgotten, not destroyed (its handle may name
//! another stream by then; its two events are leaked with it for the same reason), and the
//! next copy makes another.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, sys};

/// One context's side stream, with the two events that order it with the legacy stream.
struct SideStream {
    /// Keeps the context, and so the stream, alive.
    _ctx: Arc<CudaContext>,
    raw: sys::CUstream,
    /// `(before, after)`, re-recorded by every use. A wait takes the event's most recent
    /// record at the time of the call, so re-recording one whose earlier waits are queued
    /// changes none of them; the lock keeps each use's record and wait together (and the
    /// legacy stream is one stream per context anyway, so uses were serialised by the
    /// driver already). The lock is held while the copies are queued, so a batch's pageable
    /// copies, which may wait for the legacy stream, hold back other threads' copies into this
    /// context's legacy stream: the side stream ran them one after another anyway. Creating
    /// and destroying two events per copy cost four driver calls.
    order: Mutex<(CudaEvent, CudaEvent)>,
}

// SAFETY: the handle is only passed to the driver, whose API is thread-safe; the context it
// belongs to is kept alive with it.
unsafe impl Send for SideStream {}
// SAFETY: as above.
unsafe impl Sync for SideStream {}

static SIDES: Mutex<Vec<(usize, Arc<SideStream>)>> = Mutex::new(Vec::new());

/// Whether staged copies on `stream` go through the side stream: the NULL handle and the
/// legacy default stream (`CU_STREAM_LEGACY`). The per-thread default stream is not taken:
/// its handle means a different stream on each thread.
pub(crate) fn needs_side(stream: &CudaStream) -> bool {
    matches!(stream.cu_stream() as usize, 0 | 1)
}

/// `ctx`'s side stream, made on first use. `ctx` must be current on this thread.
fn side_of(ctx: &Arc<CudaContext>) -> Result<Arc<SideStream>, String> {
    let key = ctx.cu_ctx() as usize;
    let mut sides = SIDES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, s)) = sides.iter().find(|(k, _)| *k == key) {
        return Ok(s.clone());
    }
    let mut raw: sys::CUstream = std::ptr::null_mut();
    // SAFETY: `raw` is a valid out-pointer; the context is current (the caller's promise).
    let rc = unsafe {
        sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(format!("creating gpuio's side stream: {rc:?}"));
    }
    let events = ctx
        .new_event(None)
        .and_then(|b| Ok((b, ctx.new_event(None)?)));
    let order = match events {
        Ok(pair) => Mutex::new(pair),
        Err(e) => {
            // SAFETY: `raw` was just created in the current context and is not used elsewhere.
            let _ = unsafe { sys::cuStreamDestroy_v2(raw) };
            return Err(format!("creating gpuio's side stream's events: {e:?}"));
        }
    };
    let side = Arc::new(SideStream {
        _ctx: ctx.clone(),
        raw,
        order,
    });
    sides.push((key, side.clone()));
    Ok(side)
}

/// Drops `ctx`'s side stream from the map after a call on it failed (the context was reset,
/// most likely). The stream itself is not destroyed: after a reset its handle may already
/// name another stream.
fn forget(ctx: &CudaContext) {
    let key = ctx.cu_ctx() as usize;
    let mut sides = SIDES.lock().unwrap_or_else(|p| p.into_inner());
    while let Some(i) = sides.iter().position(|(k, _)| *k == key) {
        // Leaked, not dropped: dropping the last reference would destroy its events.
        std::mem::forget(sides.swap_remove(i));
    }
}

/// Why [`queue_in_order`] failed.
#[derive(Debug)]
pub(crate) enum StagedError {
    /// Before anything was queued (the side stream or its first event could not be had): the
    /// caller may still copy another way.
    NotQueued(String),
    /// Copies may have been queued; their sources are free all the same.
    Failed(String),
}

impl std::fmt::Display for StagedError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StagedError::NotQueued(why) | StagedError::Failed(why) => f.write_str(why),
        }
    }
}

/// Runs `queue(raw)`, which queues staged copies on stream `raw`, in `stream`'s order: on
/// `stream` itself, or for the NULL and legacy streams ([`needs_side`]) on the context's side
/// stream between two events (see the module docs). `stream`'s context must be current on
/// this thread. On an error after `queue` succeeded, the copies have also finished (the side
/// stream is drained). The sources of copies `queue` reads during the call (`queue_staged`)
/// are free when this returns, however it returns; for stream-ordered copies out of pinned
/// memory, `queue` records the event that says when they are.
pub(crate) fn queue_in_order(
    stream: &CudaStream,
    queue: impl FnOnce(sys::CUstream) -> Result<(), String>,
) -> Result<(), StagedError> {
    if !needs_side(stream) {
        return queue(stream.cu_stream()).map_err(StagedError::Failed);
    }
    let ctx = stream.context();
    let side = side_of(ctx).map_err(StagedError::NotQueued)?;
    let events = side.order.lock().unwrap_or_else(|p| p.into_inner());
    let (before, after) = &*events;
    if let Err(e) = before.record(stream) {
        // Most likely a reset context: its side stream and events are stale for good.
        forget(ctx);
        return Err(StagedError::NotQueued(format!(
            "recording an event on the legacy stream: {e:?}"
        )));
    }
    // SAFETY: the side stream and the event are live handles of the current context.
    let rc = unsafe { sys::cuStreamWaitEvent(side.raw, before.cu_event(), 0) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        forget(ctx);
        return Err(StagedError::NotQueued(format!(
            "ordering the side stream after the legacy stream: {rc:?}"
        )));
    }
    queue(side.raw).map_err(StagedError::Failed)?;
    // SAFETY: as above.
    let recorded = unsafe { sys::cuEventRecord(after.cu_event(), side.raw) }.result();
    if let Err(e) = recorded.and_then(|()| stream.wait(after)) {
        // The caller's stream is not ordered after the copies: let them finish before the
        // caller can reuse or free the memory.
        // SAFETY: the side stream is a live handle of the current context.
        let _ = unsafe { sys::cuStreamSynchronize(side.raw) };
        forget(ctx);
        return Err(StagedError::Failed(format!(
            "ordering the legacy stream after the copies: {e:?}"
        )));
    }
    Ok(())
}
