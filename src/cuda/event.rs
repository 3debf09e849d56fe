//! CUDA events as the reactor sees them: [`EventGate`], an event it polls (never waits on)
//! before acting on the message behind it, and [`EVENT_POOL`], completed events kept for reuse.

use cudarc::driver::result::event;
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

/// A CUDA event the reactor polls (never waits on) before acting on the message behind it.
/// An event seen complete goes back to [`EVENT_POOL`] when the gate is dropped.
pub(crate) struct EventGate {
    event: Option<CudaEvent>,
    passed: std::sync::atomic::AtomicBool,
}

impl EventGate {
    pub(crate) fn new(event: CudaEvent) -> Self {
        EventGate {
            event: Some(event),
            passed: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

impl EventGate {
    /// Whether the event has completed (`Err`: the event or its context failed).
    pub(crate) fn query(&self) -> Result<bool, String> {
        let Some(ev) = self.event.as_ref() else {
            return Err("event gone".into());
        };
        if let Err(e) = ev.context().bind_to_thread() {
            return Err(format!("{e:?}"));
        }
        // SAFETY: the event is alive (owned by self) and belongs to the bound context.
        match unsafe { event::query(ev.cu_event()) } {
            Ok(()) => {
                self.passed
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(true)
            }
            Err(e) if e.0 == CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(format!("cuEventQuery: {e}")),
        }
    }
}

impl EventGate {
    /// Blocks until the event has completed (`Err`: the event or its context failed).
    pub(crate) fn wait(&self) -> Result<(), String> {
        let Some(ev) = self.event.as_ref() else {
            return Err("event gone".into());
        };
        ev.synchronize().map_err(|e| format!("{e:?}"))?;
        self.passed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

impl Drop for EventGate {
    fn drop(&mut self) {
        // Only an event known to have completed is reused: re-recording a pending one is legal
        // but would hide nothing worth the risk.
        if let Some(ev) = self.event.take() {
            if self.passed.load(std::sync::atomic::Ordering::Relaxed) {
                EVENT_POOL.put(ev);
            }
        }
    }
}

/// Completed CUDA events kept for reuse, per context: each small copy needs an event, and
/// creating and destroying one per piece cost two driver calls on the context lock that the
/// copies themselves need (BENCHMARKS.md, 4 KiB reads into GPU memory: 2.1x with the pool).
/// Kept events hold their context (as any cudarc event does), so a context gpuio has copied
/// into stays retained for the process's life; a context that was reset is forgotten at the
/// first failed record.
pub(crate) static EVENT_POOL: EventPool = EventPool {
    free: std::sync::Mutex::new(Vec::new()),
};

/// See [`EVENT_POOL`].
pub(crate) struct EventPool {
    /// `(CUcontext as usize, events of that context)`; one entry per context used.
    free: std::sync::Mutex<Vec<(usize, Vec<CudaEvent>)>>,
}

/// Events kept per context at most (about as many as copies in flight).
const EVENT_POOL_MAX: usize = 4096;

impl EventPool {
    /// An event recorded on `stream` now: a kept one of the stream's context, or a new one.
    pub(crate) fn record(
        &self,
        stream: &CudaStream,
    ) -> Result<CudaEvent, cudarc::driver::DriverError> {
        // SAFETY: `stream` is a live stream of its own context.
        unsafe { self.record_raw(stream.context(), stream.cu_stream()) }
    }

    /// An event recorded on the raw stream `raw` of `ctx` now (a side stream of gpuio's).
    ///
    /// # Safety
    /// `raw` must be a live stream of `ctx`.
    pub(crate) unsafe fn record_raw(
        &self,
        ctx: &std::sync::Arc<CudaContext>,
        raw: sys::CUstream,
    ) -> Result<CudaEvent, cudarc::driver::DriverError> {
        let key = ctx.cu_ctx() as usize;
        let kept = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            free.iter_mut()
                .find(|(k, _)| *k == key)
                .and_then(|(_, v)| v.pop())
        };
        let ev = match kept {
            Some(ev) => ev,
            None => ctx.new_event(None)?,
        };
        let recorded = ctx.bind_to_thread().and_then(|()| {
            // SAFETY: the event belongs to `ctx`, now current; the caller guarantees `raw`
            // is a live stream of it.
            unsafe { event::record(ev.cu_event(), raw) }
        });
        match recorded {
            Ok(()) => Ok(ev),
            Err(e) => {
                // The context may be gone (reset): none of its kept events is usable.
                let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
                free.retain(|(k, _)| *k != key);
                Err(e)
            }
        }
    }

    /// Keeps `ev`, which must have completed, for reuse.
    pub(crate) fn put(&self, ev: CudaEvent) {
        let key = ev.context().cu_ctx() as usize;
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let slot = match free.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                free.push((key, Vec::new()));
                free.len() - 1
            }
        };
        let list = &mut free[slot].1;
        if list.len() < EVENT_POOL_MAX {
            list.push(ev);
        }
    }
}
