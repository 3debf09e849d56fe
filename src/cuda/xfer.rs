//! Copies between registered memory of agents in one process (`crate::agent`): the CUDA
//! driver's own copies (device to device, GPU to GPU over NVLink or PCIe, host to device),
//! queued on a stream of one GPU and reported done by a waiter thread.
//!
//! Why a waiter thread and not `cuLaunchHostFunc`: a host function is never called once the
//! context has failed, so a transfer queued behind a failed copy would wait for good. The
//! waiter synchronises a blocking-sync event recorded behind each transfer's copies (it sleeps
//! in the driver, no spinning) and reports the driver's error, if any, with the transfer.

use std::sync::Arc;
use std::sync::mpsc;

use cudarc::driver::sys::{self, CUevent_flags, CUresult};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

/// What a [`CopyQueue`] calls once a transfer's copies are done (or failed).
pub(crate) type CopyDone = Box<dyn FnOnce(Result<(), String>) + Send>;

/// A stream on one GPU for agent copies, and the thread that reports their completions.
pub(crate) struct CopyQueue {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Events recorded behind transfers, in stream order, with what to call when each passes.
    /// Dropping the sender ends the waiter once it has reported everything queued.
    waiter: Option<mpsc::Sender<(CudaEvent, CopyDone)>>,
}

impl CopyQueue {
    /// A queue on GPU `ordinal`'s primary context.
    pub(crate) fn new(ordinal: usize) -> Result<CopyQueue, String> {
        let ctx = super::context(ordinal).map_err(|e| e.to_string())?;
        let stream = ctx
            .new_stream()
            .map_err(|e| format!("cuStreamCreate: {e:?}"))?;
        let (tx, rx) = mpsc::channel::<(CudaEvent, CopyDone)>();
        std::thread::Builder::new()
            .name(format!("gpuio-agent-gpu{ordinal}"))
            .spawn(move || {
                for (event, done) in rx {
                    let r = event
                        .synchronize()
                        .map_err(|e| format!("copy between registrations: {e:?}"));
                    done(r);
                }
            })
            .map_err(|e| format!("spawning the copy waiter: {e}"))?;
        Ok(CopyQueue {
            ctx,
            stream,
            waiter: Some(tx),
        })
    }

    /// The GPU this queue copies on.
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The context, for turning on peer access.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Queues a copy of `len` bytes from `src` to `dst`, either of which may be host or device
    /// memory (unified addressing tells the driver which).
    ///
    /// # Safety
    /// `src` must be readable and `dst` writable for `len` bytes until the completion of a
    /// later [`then`](Self::then) on this queue has been reported.
    pub(crate) unsafe fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| format!("binding GPU {}: {e:?}", self.ordinal()))?;
        // SAFETY: the caller keeps both ranges valid until the queue reports completion; the
        // stream belongs to the bound context.
        let rc = unsafe { sys::cuMemcpyAsync(dst, src, len, self.stream.cu_stream()) };
        if rc == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("cuMemcpyAsync of {len} bytes: {rc:?}"))
        }
    }

    /// Calls `done` once every copy queued so far has completed: from the waiter thread,
    /// behind an event; or, where no event can be recorded or the waiter is gone, here, after
    /// synchronising the stream. Either way `done` runs only once the copies have ended (an
    /// error from the driver's wait means the context failed and runs no more work).
    pub(crate) fn then(&self, done: CopyDone) {
        // Blocking sync: the waiter sleeps in the driver instead of spinning on a core. (Timing
        // stays on: cudarc's flags are an enum, which cannot hold two flags ORed.)
        let flags = CUevent_flags::CU_EVENT_BLOCKING_SYNC;
        let recorded = self
            .ctx
            .new_event(Some(flags))
            .and_then(|event| event.record(&self.stream).map(|()| event));
        let done = match (recorded, &self.waiter) {
            (Ok(event), Some(tx)) => match tx.send((event, done)) {
                Ok(()) => return,
                Err(mpsc::SendError((_, done))) => done,
            },
            (_, _) => done,
        };
        let r = self
            .stream
            .synchronize()
            .map_err(|e| format!("copy between registrations: {e:?}"));
        done(r);
    }
}

impl Drop for CopyQueue {
    fn drop(&mut self) {
        // The waiter drains what is queued, then sees the channel closed and exits.
        self.waiter = None;
    }
}

/// Device memory from `cuMemAlloc` (not a stream-ordered pool), so that CUDA IPC can export
/// it to peer processes; freed on drop after the device has finished with it.
pub(crate) struct DeviceAlloc {
    ctx: Arc<CudaContext>,
    pub(crate) ptr: u64,
    pub(crate) len: usize,
}

impl DeviceAlloc {
    /// `len` zeroed bytes on GPU `ordinal`.
    pub(crate) fn new(ordinal: usize, len: usize) -> Result<DeviceAlloc, String> {
        let ctx = super::context(ordinal).map_err(|e| e.to_string())?;
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let mut ptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the context is bound.
        let rc = unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemAlloc of {len} bytes: {rc:?}"));
        }
        let a = DeviceAlloc { ctx, ptr, len };
        // SAFETY: `ptr` is `len` bytes of device memory just allocated.
        let rc = unsafe { sys::cuMemsetD8_v2(a.ptr, 0, len) };
        if rc != CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemsetD8: {rc:?}"));
        }
        Ok(a)
    }

    /// The GPU's ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Copies `src` to the start of the buffer (synchronously).
    pub(crate) fn write(&self, src: &[u8]) -> Result<(), String> {
        if src.len() > self.len {
            return Err(format!(
                "{} bytes into a {}-byte buffer",
                src.len(),
                self.len
            ));
        }
        self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        // SAFETY: `src` is readable for its length and the buffer is at least as long.
        let rc = unsafe { sys::cuMemcpyHtoD_v2(self.ptr, src.as_ptr().cast(), src.len()) };
        if rc == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("cuMemcpyHtoD: {rc:?}"))
        }
    }

    /// The buffer's bytes (synchronously).
    pub(crate) fn read(&self) -> Result<Vec<u8>, String> {
        let mut v = vec![0u8; self.len];
        self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        // SAFETY: `v` is writable for `len` bytes, the buffer readable for as many.
        let rc = unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), self.ptr, self.len) };
        if rc == CUresult::CUDA_SUCCESS {
            Ok(v)
        } else {
            Err(format!("cuMemcpyDtoH: {rc:?}"))
        }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuMemAlloc and is freed once; cuMemFree waits for work
            // on the memory already queued (it synchronises the device's streams using it).
            unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}
