//! Workers, active-message handlers and requests.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::os::fd::RawFd;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Arc;

use super::Context;
use super::endpoint::{Endpoint, ErrSlot};
use super::result::{UcsError, UcxLib};
use super::sys::{self, RawWorker, Status};

/// A heap value whose address UCX holds (a callback's `arg`): allocated once, never moved or
/// reborrowed uniquely while UCX may use the pointer, freed by [`Drop`].
pub(crate) struct CbBox<T>(NonNull<T>);

impl<T> CbBox<T> {
    pub(crate) fn new(v: T) -> Self {
        CbBox(NonNull::from(Box::leak(Box::new(v))))
    }

    /// The pointer to hand to UCX.
    pub(crate) fn as_ptr(&self) -> *mut c_void {
        self.0.as_ptr().cast()
    }
}

impl<T> Drop for CbBox<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by `Box` in `new` and freed once, here; whoever drops a `CbBox`
        // has made sure UCX no longer calls with its pointer and no callback is running on it.
        drop(unsafe { Box::from_raw(self.0.as_ptr()) });
    }
}

thread_local! {
    /// How many UCX callbacks (active-message or error handlers) are running on this thread.
    /// UCX runs them inside `ucp_worker_progress`, but may run an error handler inside other
    /// calls too: while one runs, no progress is made and no callback box is freed.
    static IN_CALLBACK: Cell<u32> = const { Cell::new(0) };
}

/// Marks a UCX callback as running on this thread until dropped.
struct InCallback;

impl InCallback {
    fn enter() -> InCallback {
        IN_CALLBACK.with(|c| c.set(c.get() + 1));
        InCallback
    }
}

impl Drop for InCallback {
    fn drop(&mut self) {
        IN_CALLBACK.with(|c| c.set(c.get().saturating_sub(1)));
    }
}

/// A request UCX still works on that nobody waits for any more, with what it must keep alive
/// until it is done (a remote key, an endpoint's error handler).
struct Orphan {
    raw: *mut c_void,
    _keep: Option<Box<dyn Any>>,
}

/// The handler parameters that clear the handler for `id` (a NULL callback).
fn clearing(id: u16) -> sys::RawAmHandlerParam {
    sys::RawAmHandlerParam {
        field_mask: sys::UCP_AM_HANDLER_PARAM_FIELD_ID
            | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
            | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
        id: id.into(),
        flags: 0,
        cb: None,
        arg: std::ptr::null_mut(),
    }
}

/// An active-message handler: called with the message's header and data.
pub(crate) type AmHandler = Box<dyn FnMut(&[u8], &[u8])>;

/// An active-message handler's slot, called from inside `ucp_worker_progress`.
struct AmSlot {
    id: u16,
    f: RefCell<AmHandler>,
}

/// The worker proper, shared by the [`Worker`] handle and everything made from it.
pub(crate) struct WorkerShared {
    pub(crate) raw: RawWorker,
    pub(crate) lib: &'static UcxLib,
    _ctx: Arc<Context>,
    /// Inside `ucp_worker_progress`, where callbacks run: no second progress, no freeing of
    /// callback boxes.
    in_progress: Cell<bool>,
    handlers: RefCell<HashMap<u16, CbBox<AmSlot>>>,
    orphans: RefCell<Vec<Orphan>>,
    /// Callback boxes UCX has let go of, freed after the current progress call (or with the
    /// worker).
    retired: RefCell<Vec<Box<dyn Any>>>,
}

impl WorkerShared {
    /// Inside `ucp_worker_progress` or a UCX callback.
    fn busy(&self) -> bool {
        self.in_progress.get() || IN_CALLBACK.with(|c| c.get() > 0)
    }

    /// Frees `b` now, or after the current progress call or callback, either of which may be
    /// running on it (an endpoint dropped from its own error handler, a handler replaced from
    /// inside itself).
    pub(crate) fn retire(&self, b: Box<dyn Any>) {
        self.retired.borrow_mut().push(b);
        if !self.busy() {
            self.free_retired();
        }
    }

    fn free_retired(&self) {
        loop {
            let batch = std::mem::take(&mut *self.retired.borrow_mut());
            if batch.is_empty() {
                return;
            }
            drop(batch); // may retire more (closures holding endpoints)
        }
    }

    /// Takes over a request nobody waits for: freed (with `keep`) by a later progress call
    /// once UCX has finished it.
    pub(crate) fn adopt(&self, raw: *mut c_void, keep: Option<Box<dyn Any>>) {
        self.orphans.borrow_mut().push(Orphan { raw, _keep: keep });
    }

    /// Frees the orphans UCX has finished.
    fn reap(&self) {
        let list = std::mem::take(&mut *self.orphans.borrow_mut());
        if list.is_empty() {
            return;
        }
        let mut pending = Vec::new();
        for o in list {
            // SAFETY: an orphan is a live request of this worker, not yet freed.
            let status = unsafe { self.lib.request_check_status(o.raw) };
            if status == sys::UCS_INPROGRESS {
                pending.push(o);
            } else {
                // SAFETY: complete, freed once; what it kept goes with it.
                unsafe { self.lib.request_free(o.raw) };
                drop(o); // may close an endpoint, which may adopt its close request
            }
        }
        self.orphans.borrow_mut().extend(pending);
    }
}

impl Drop for WorkerShared {
    fn drop(&mut self) {
        // Everything that held this worker is gone: endpoints (so their remote keys and puts
        // too), requests. What is left: orphaned flushes, sends and closes, and the handlers.
        let orphans = std::mem::take(self.orphans.get_mut());
        for o in &orphans {
            // SAFETY: a live request of this worker; freeing a request in progress lets UCX
            // finish (here: discard) it with the worker.
            unsafe { self.lib.request_free(o.raw) };
        }
        for (&id, _) in self.handlers.get_mut().iter() {
            let param = clearing(id);
            // SAFETY: the worker is live; a NULL callback clears the handler.
            if let Err(e) = unsafe { self.lib.set_am_recv_handler(self.raw, &param) } {
                tracing::debug!(%e, id, "clearing a UCX active-message handler");
            }
        }
        // SAFETY: the worker is destroyed once, on the thread that owns it (`WorkerShared` is
        // neither Send nor Sync), after everything made from it; the context outlives it (we
        // hold it until after this).
        unsafe { self.lib.worker_destroy(self.raw) };
        // Only now may the callback boxes and what the orphans kept go.
        drop(orphans);
        self.handlers.get_mut().clear();
        self.retired.get_mut().clear();
        // `_ctx` goes last, with the fields: the context outlives the worker.
    }
}

/// A UCX worker (`UCS_THREAD_MODE_SINGLE`): progress, wake-up, active-message handlers, and
/// endpoints to other workers. Neither `Send` nor `Sync`: create it on the thread that drives
/// it. Dropping it is fine while endpoints, keys or requests made from it live; the worker
/// goes with the last of them.
pub(crate) struct Worker {
    pub(crate) shared: Rc<WorkerShared>,
}

impl Worker {
    /// `ucp_worker_create` on `ctx`, single-threaded, waking up for RMA, send and receive
    /// events.
    pub(crate) fn new(ctx: &Arc<Context>) -> Result<Worker, UcsError> {
        let lib = ctx.lib();
        let mut params = sys::RawWorkerParams::zeroed();
        params.field_mask =
            sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE | sys::UCP_WORKER_PARAM_FIELD_EVENTS;
        params.thread_mode = sys::UCS_THREAD_MODE_SINGLE;
        params.events = sys::UCP_WAKEUP_RMA | sys::UCP_WAKEUP_TX | sys::UCP_WAKEUP_RX;
        // SAFETY: the context is live and outlives the worker (WorkerShared holds it).
        let raw = unsafe { lib.worker_create(ctx.raw(), &params) }?;
        Ok(Worker {
            shared: Rc::new(WorkerShared {
                raw,
                lib,
                _ctx: ctx.clone(),
                in_progress: Cell::new(false),
                handlers: RefCell::new(HashMap::new()),
                orphans: RefCell::new(Vec::new()),
                retired: RefCell::new(Vec::new()),
            }),
        })
    }

    /// The worker's address, for a peer's [`connect`](Self::connect).
    pub(crate) fn address(&self) -> Result<Vec<u8>, UcsError> {
        // SAFETY: the worker is live and used from this thread only (not Send).
        unsafe { self.shared.lib.worker_address(self.shared.raw) }
    }

    /// Progresses the worker once: runs due callbacks (active-message and error handlers),
    /// completes requests, then frees dropped requests UCX has finished. Returns the number
    /// of events UCX handled. Called from inside a handler it does nothing and returns 0 (UCX
    /// forbids progress from its callbacks).
    pub(crate) fn progress(&self) -> u32 {
        let s = &*self.shared;
        if s.busy() {
            return 0;
        }
        s.in_progress.set(true);
        // SAFETY: the worker is live and used from this thread only; not re-entered (checked
        // above).
        let n = unsafe { s.lib.worker_progress(s.raw) };
        s.in_progress.set(false);
        s.reap();
        s.free_retired();
        n
    }

    /// The file descriptor that becomes readable when the worker has events, once armed.
    /// Owned by the worker: do not close it.
    pub(crate) fn event_fd(&self) -> Result<RawFd, UcsError> {
        // SAFETY: the worker is live, of a context created with UCP_FEATURE_WAKEUP.
        unsafe { self.shared.lib.worker_efd(self.shared.raw) }
    }

    /// Arms the event fd: `Ok(true)` when armed (safe to sleep on the fd), `Ok(false)` when
    /// events are pending (progress again first).
    pub(crate) fn arm(&self) -> Result<bool, UcsError> {
        // SAFETY: as in `event_fd`.
        unsafe { self.shared.lib.worker_arm(self.shared.raw) }
    }

    /// Sets the handler for active messages with `id`, replacing any earlier one. It runs
    /// inside [`progress`](Self::progress) with the message's header and data, which are valid
    /// only during the call. Messages sent with the rendezvous protocol are dropped with a
    /// warning (gpuio sends eagerly). A handler that panics loses that message (logged).
    /// Handlers may send (an endpoint's calls are allowed inside them) but not progress.
    pub(crate) fn set_am_handler(&self, id: u16, handler: AmHandler) -> Result<(), UcsError> {
        let slot = CbBox::new(AmSlot {
            id,
            f: RefCell::new(handler),
        });
        let param = sys::RawAmHandlerParam {
            field_mask: sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG,
            id: id.into(),
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(am_recv),
            arg: slot.as_ptr(),
        };
        // SAFETY: the worker is live; the slot stays allocated until UCX has replaced or
        // cleared this handler (it moves into `handlers`, whose entries are retired or freed
        // only after that).
        unsafe { self.shared.lib.set_am_recv_handler(self.shared.raw, &param) }?;
        let old = self.shared.handlers.borrow_mut().insert(id, slot);
        if let Some(old) = old {
            self.shared.retire(Box::new(old));
        }
        Ok(())
    }

    /// Clears the handler for `id` (messages for it are then dropped by UCX).
    pub(crate) fn clear_am_handler(&self, id: u16) -> Result<(), UcsError> {
        let param = clearing(id);
        // SAFETY: the worker is live; a NULL callback clears the handler.
        unsafe { self.shared.lib.set_am_recv_handler(self.shared.raw, &param) }?;
        let old = self.shared.handlers.borrow_mut().remove(&id);
        if let Some(old) = old {
            self.shared.retire(Box::new(old));
        }
        Ok(())
    }

    /// Connects to the worker whose [`address`](Self::address) is `remote_address`, with
    /// peer error handling (`UCP_ERR_HANDLING_MODE_PEER`): when UCX finds the peer or the
    /// connection failed, `on_error` runs (inside a later [`progress`](Self::progress)) and
    /// the endpoint's operations fail from then on; drop the endpoint then.
    ///
    /// # Safety
    /// `remote_address` is a worker address made by [`Worker::address`] of a compatible UCX,
    /// delivered intact (checksummed, or from a trusted peer). UCX parses it without a length
    /// and checks little: gpuio hands it a zero-padded copy, so a truncated address fails
    /// with `UCS_ERR_INVALID_PARAM` (tested), but a garbled one can fail an assertion inside
    /// UCX and abort the process (1.13 does for a wrong version byte).
    pub(crate) unsafe fn connect(
        &self,
        remote_address: &[u8],
        on_error: Box<dyn FnMut(UcsError)>,
    ) -> Result<Endpoint, UcsError> {
        // SAFETY: the caller's promise.
        unsafe { Endpoint::connect(&self.shared, remote_address, on_error) }
    }

    /// The number of dropped requests still waiting for UCX to finish them.
    pub(crate) fn orphans(&self) -> usize {
        self.shared.orphans.borrow().len()
    }
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("raw", &self.shared.raw)
            .finish()
    }
}

/// `ucp_am_recv_callback_t` for every handler: `arg` is the handler's [`AmSlot`].
unsafe extern "C" fn am_recv(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::RawAmRecvParam,
) -> Status {
    // SAFETY: `arg` is the slot registered with this callback, kept allocated until UCX has
    // let go of it (see `set_am_handler`); only shared references are made to it.
    let slot = unsafe { &*(arg as *const AmSlot) };
    let attr = if param.is_null() {
        0
    } else {
        // SAFETY: UCX passes a valid parameter block for the duration of the call.
        unsafe { (*param).recv_attr }
    };
    if attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV != 0 {
        tracing::warn!(
            id = slot.id,
            length,
            "dropping a UCX active message sent with the rendezvous protocol"
        );
        return sys::UCS_OK;
    }
    let header: &[u8] = if header_length == 0 || header.is_null() {
        &[]
    } else {
        // SAFETY: UCX's header, `header_length` bytes valid during the call.
        unsafe { std::slice::from_raw_parts(header as *const u8, header_length) }
    };
    let data: &[u8] = if length == 0 || data.is_null() {
        &[]
    } else {
        // SAFETY: eager data (not rendezvous: checked above), `length` bytes valid during the
        // call; returning UCS_OK gives it back to UCX.
        unsafe { std::slice::from_raw_parts(data as *const u8, length) }
    };
    let _running = InCallback::enter();
    match slot.f.try_borrow_mut() {
        Ok(mut f) => {
            if catch_unwind(AssertUnwindSafe(|| f(header, data))).is_err() {
                tracing::error!(id = slot.id, "a UCX active-message handler panicked");
            }
        }
        Err(_) => tracing::error!(id = slot.id, "UCX active-message handler re-entered"),
    }
    sys::UCS_OK
}

/// `ucp_err_handler_cb_t` for every endpoint: `arg` is the endpoint's [`ErrSlot`].
pub(crate) unsafe extern "C" fn ep_error(arg: *mut c_void, _ep: sys::RawEp, status: Status) {
    // SAFETY: `arg` is the slot registered with the endpoint, kept allocated until the
    // endpoint's close has completed; only shared references are made to it.
    let slot = unsafe { &*(arg as *const ErrSlot) };
    let err = slot.lib.error("ucp_ep (peer error)", status);
    let _running = InCallback::enter();
    match slot.f.try_borrow_mut() {
        Ok(mut f) => {
            if catch_unwind(AssertUnwindSafe(|| f(err))).is_err() {
                tracing::error!("a UCX endpoint error handler panicked");
            }
        }
        Err(_) => tracing::error!(%err, "UCX endpoint error handler re-entered"),
    }
}

/// An operation UCX is still working on. Poll it with [`check`](Self::check) after
/// progressing the worker.
///
/// Dropping a request releases it (`ucp_request_free`). One still in progress then finishes
/// inside UCX: what gpuio owns (the remote key of a put or get, an endpoint's error handler)
/// stays alive until the worker sees it done, but the caller's memory (a put's source, a get's
/// destination, a send's data) must stay valid until then too — flush the endpoint and wait
/// for the flush before reusing it.
#[must_use = "a request in progress keeps its memory in use"]
pub(crate) struct Request {
    raw: *mut c_void,
    call: &'static str,
    worker: Rc<WorkerShared>,
    keep: Option<Box<dyn Any>>,
}

impl Request {
    pub(crate) fn new(
        raw: *mut c_void,
        call: &'static str,
        worker: Rc<WorkerShared>,
        keep: Option<Box<dyn Any>>,
    ) -> Request {
        Request {
            raw,
            call,
            worker,
            keep,
        }
    }

    fn status(&self) -> Status {
        // SAFETY: a live request of a live worker (we hold it), not yet freed, on the worker's
        // thread (not Send).
        unsafe { self.worker.lib.request_check_status(self.raw) }
    }

    /// `None` while in progress; then the operation's result.
    pub(crate) fn check(&self) -> Option<Result<(), UcsError>> {
        match self.status() {
            sys::UCS_INPROGRESS => None,
            sys::UCS_OK => Some(Ok(())),
            s => Some(Err(self.worker.lib.error(self.call, s))),
        }
    }

    /// Asks UCX to cancel the operation (it completes with `UCS_ERR_CANCELED` where it can be
    /// cancelled; RMA operations generally cannot).
    pub(crate) fn cancel(&self) {
        // SAFETY: a live request of this live worker, on its thread.
        unsafe { self.worker.lib.request_cancel(self.worker.raw, self.raw) }
    }

    /// The UCX call that started it.
    pub(crate) fn call(&self) -> &'static str {
        self.call
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("call", &self.call)
            .field("raw", &self.raw)
            .finish()
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        if self.status() == sys::UCS_INPROGRESS {
            self.worker.adopt(self.raw, self.keep.take());
        } else {
            // SAFETY: complete, freed once.
            unsafe { self.worker.lib.request_free(self.raw) };
            // Nothing uses what it kept any more, but an endpoint's error handler may be the
            // callback running now (an endpoint dropped from its own error handler).
            if let Some(k) = self.keep.take() {
                self.worker.retire(k);
            }
        }
    }
}
