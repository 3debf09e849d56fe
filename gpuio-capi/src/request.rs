//! Asynchronous requests: started on an engine's executor threads, completed through
//! `gpuio_request_wait`, `gpuio_request_test`, a callback, or the engine's eventfd.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::{AbortHandle, Abortable};

use crate::engine::EngineHandle;
use crate::executor::on_executor;
use crate::file::{FILES, store};
use crate::registry::Registry;
use crate::status::{Failure, gpuio_status, guard, panic_message};
use crate::{memory, memory::gpuio_buffer};

/// A running or finished asynchronous operation. Opaque; free with `gpuio_request_free`.
pub struct gpuio_request {
    _opaque: [u8; 0],
}

/// Called once when a request completes, with its status (`GPUIO_OK` or the failure, also
/// `GPUIO_ERR_CANCELED` when its engine is freed first), the bytes moved, and the `user_data`
/// given when it started. **Runs on one of the engine's executor threads and must not block**:
/// no waiting, no synchronous gpuio calls (they fail with `GPUIO_ERR_WOULD_BLOCK` there), no
/// long work; signal your own thread instead. `gpuio_request_test`, `gpuio_last_error` and
/// `gpuio_request_free` of this request are fine inside it. Not called for a request freed
/// before it completed.
pub type gpuio_callback = Option<
    unsafe extern "C" fn(
        request: *mut gpuio_request,
        status: gpuio_status,
        bytes: u64,
        user_data: *mut libc::c_void,
    ),
>;

pub(crate) static REQUESTS: Registry<RequestState> = Registry::new("gpuio_request");

/// What a request handle holds.
pub(crate) struct RequestState {
    progress: Mutex<Progress>,
    changed: Condvar,
    /// Taken when the operation ends (nothing is left to cancel).
    abort: Mutex<Option<AbortHandle>>,
    /// Freed by the caller: no callback, no eventfd signal.
    detached: AtomicBool,
    /// The process that started it: in a child made by `fork()` no thread of the engine
    /// exists, so a request still running at the fork never ends there.
    pid: u32,
}

struct Progress {
    /// The result, once the operation's future is gone (so nothing touches the buffer).
    result: Option<Result<usize, Failure>>,
    /// The callback has returned and the eventfd was signalled.
    finished: bool,
    /// Threads waiting on `changed`: a completion with none skips the notify (a system call
    /// per request otherwise).
    waiters: usize,
}

/// The caller's `user_data`, handed back to the callback on an executor thread.
struct UserData(*mut libc::c_void);
// SAFETY: gpuio never dereferences the pointer; it only passes it back to the caller's
// callback, whose contract says it runs on a gpuio thread.
unsafe impl Send for UserData {}

impl RequestState {
    fn new(abort: AbortHandle) -> Self {
        RequestState {
            progress: Mutex::new(Progress {
                result: None,
                finished: false,
                waiters: 0,
            }),
            changed: Condvar::new(),
            abort: Mutex::new(Some(abort)),
            detached: AtomicBool::new(false),
            pid: std::process::id(),
        }
    }

    /// The refusal for waiting on (or freeing) a request that was running at a `fork()`, in
    /// the child.
    fn orphaned(&self) -> Option<Failure> {
        (std::process::id() != self.pid).then(|| {
            Failure::new(
                gpuio_status::GPUIO_ERR_UNSUPPORTED,
                "this request was running in the parent when the process forked; it cannot \
                 complete in the child (the engine's threads do not exist here)",
            )
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops the operation at its next poll (its future is then dropped).
    pub(crate) fn cancel(&self) {
        if let Some(a) = &*self.abort.lock().unwrap_or_else(|p| p.into_inner()) {
            a.abort();
        }
    }

    /// Waits until the callback (if any) has returned.
    pub(crate) fn wait_finished(&self) {
        let mut p = self.lock();
        p.waiters += 1;
        let mut p = self
            .changed
            .wait_while(p, |p| !p.finished)
            .unwrap_or_else(|p| p.into_inner());
        p.waiters -= 1;
    }

    /// The result, waiting at most `timeout` (`None`: for good).
    fn wait_result(&self, timeout: Option<Duration>) -> Option<Result<usize, Failure>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut p = self.lock();
        loop {
            if let Some(r) = &p.result {
                return Some(r.clone());
            }
            let left = match deadline {
                None => None,
                Some(d) => match d.saturating_duration_since(Instant::now()) {
                    left if left.is_zero() => return None,
                    left => Some(left),
                },
            };
            p.waiters += 1;
            p = match left {
                None => self.changed.wait(p).unwrap_or_else(|p| p.into_inner()),
                Some(left) => {
                    self.changed
                        .wait_timeout(p, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
            p.waiters -= 1;
        }
    }

    /// Updates the progress and wakes the waiters, if any.
    fn update(&self, change: impl FnOnce(&mut Progress)) {
        let mut p = self.lock();
        change(&mut p);
        if p.waiters > 0 {
            self.changed.notify_all();
        }
    }
}

/// Starts `op` on `engine`'s executor; returns the request's token.
pub(crate) fn submit(
    engine: &Arc<EngineHandle>,
    op: impl Future<Output = Result<usize, Failure>> + Send + 'static,
    callback: gpuio_callback,
    user_data: *mut libc::c_void,
) -> Result<u64, Failure> {
    if engine.engine.inherited_across_fork() {
        // A forked child has none of the engine's threads (reactor, executor): the request
        // would never complete.
        return Err(Failure::new(
            gpuio_status::GPUIO_ERR_UNSUPPORTED,
            "this engine was created before fork() in a parent process and cannot be used in \
             the child (its threads do not exist here): create a new engine in the child",
        ));
    }
    let (abort, registration) = AbortHandle::new_pair();
    let state = Arc::new(RequestState::new(abort));
    let token = {
        let mut requests = engine.requests.lock().unwrap_or_else(|p| p.into_inner());
        if requests.closed {
            return Err(Failure::new(
                gpuio_status::GPUIO_ERR_SHUTDOWN,
                "the engine is being freed: no new requests start",
            ));
        }
        let token = REQUESTS.insert(state.clone());
        requests.running.insert(token, state.clone());
        token
    };
    let user = UserData(user_data);
    let weak_engine = Arc::downgrade(engine);
    engine.spawn(async move {
        let user = user;
        // The operation's future (and its borrow of the caller's buffer) is gone when this
        // block ends, before the result is published.
        let outcome = {
            let guarded = AssertUnwindSafe(op).catch_unwind();
            Abortable::new(guarded, registration).await
        };
        let result = match outcome {
            Ok(Ok(r)) => r,
            Ok(Err(panic)) => Err(Failure::new(
                gpuio_status::GPUIO_ERR_INTERNAL,
                format!("internal error in gpuio: {}", panic_message(&*panic)),
            )),
            Err(_aborted) => Err(Failure::new(
                gpuio_status::GPUIO_ERR_CANCELED,
                "request cancelled: its engine was freed while it ran",
            )),
        };
        let engine = weak_engine.upgrade();
        let (status, bytes) = match &result {
            Ok(n) => (gpuio_status::GPUIO_OK, *n as u64),
            Err(f) => (f.status, 0),
        };
        drop(state.abort.lock().unwrap_or_else(|p| p.into_inner()).take());
        state.update(|p| p.result = Some(result));
        if !state.detached.load(Ordering::SeqCst) {
            if let Some(cb) = callback {
                let handle = std::ptr::without_provenance_mut(token as usize);
                // A panic cannot come from C; a C++ exception escaping the callback is the
                // caller's undefined behaviour, as for any C callback.
                // SAFETY: the caller supplied this function for this purpose, with this
                // signature; `user.0` is its own pointer, passed back untouched.
                unsafe { cb(handle, status, bytes, user.0) };
            }
            if let Some(e) = &engine {
                e.signal();
            }
        }
        state.update(|p| p.finished = true);
        // Only now: `gpuio_engine_free` waits for the requests it finds running, callbacks
        // included.
        if let Some(e) = &engine {
            let mut requests = e.requests.lock().unwrap_or_else(|p| p.into_inner());
            requests.running.remove(&token);
        }
    });
    Ok(token)
}

/// Starts reading `dst->len` bytes at `offset` into `dst` (host or device memory) and stores
/// the request in `*out`. **`dst`'s memory must stay valid, and untouched, until the request
/// completes** (the `gpuio_buffer` struct itself may go at once). `callback` (or NULL) runs when
/// it completes, with `user_data`.
///
/// # Safety
/// `dst` is NULL (an error) or readable; its memory as above; `out` NULL (an error) or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_read_async(
    file: *const crate::file::gpuio_file,
    dst: *const gpuio_buffer,
    offset: u64,
    callback: gpuio_callback,
    user_data: *mut libc::c_void,
    out: *mut *mut gpuio_request,
) -> gpuio_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid("gpuio_read_async: out is a null pointer"));
        }
        let handle = FILES.get(file)?;
        let engine = handle.engine()?;
        // SAFETY: forwarded from this function's contract (valid until completion).
        let dst = unsafe { memory::dst(&engine, dst) }?;
        let op = async move { dst.read(&handle.file, offset).await.map_err(Failure::from) };
        let token = submit(&engine, op, callback, user_data)?;
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { *out = std::ptr::without_provenance_mut(token as usize) };
        Ok(())
    })
}

/// Starts writing all of `src` at `offset`; as `gpuio_read_async`, with `src`'s memory valid
/// and unchanged until the request completes.
///
/// # Safety
/// As for `gpuio_read_async`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_write_async(
    file: *const crate::file::gpuio_file,
    src: *const gpuio_buffer,
    offset: u64,
    callback: gpuio_callback,
    user_data: *mut libc::c_void,
    out: *mut *mut gpuio_request,
) -> gpuio_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid("gpuio_write_async: out is a null pointer"));
        }
        let handle = FILES.get(file)?;
        let engine = handle.engine()?;
        // SAFETY: forwarded from this function's contract (valid until completion).
        let src = unsafe { memory::src(&engine, src) }?;
        let op = async move { src.write(&handle.file, offset).await.map_err(Failure::from) };
        let token = submit(&engine, op, callback, user_data)?;
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { *out = std::ptr::without_provenance_mut(token as usize) };
        Ok(())
    })
}

/// Reports a finished request's result: its status, its message as the last error, its bytes.
///
/// # Safety
/// `bytes` is NULL or writable.
unsafe fn report(result: Result<usize, Failure>, bytes: *mut u64) -> Result<(), Failure> {
    let n = result?;
    // SAFETY: forwarded from this function's contract.
    unsafe { store(bytes, n) };
    Ok(())
}

/// Waits until `request` completes, at most `timeout_ns` nanoseconds (negative: for good; 0:
/// not at all), and returns its status (its message as the last error), with the bytes moved
/// in `*bytes` (if not NULL). `GPUIO_ERR_TIMEOUT` if it is still running. May be called any
/// number of times. Refused (`GPUIO_ERR_WOULD_BLOCK`) inside a callback unless the request has
/// already completed.
///
/// # Safety
/// `bytes` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_request_wait(
    request: *const gpuio_request,
    timeout_ns: i64,
    bytes: *mut u64,
) -> gpuio_status {
    guard(|| {
        let state = REQUESTS.get(request)?;
        let timeout = u64::try_from(timeout_ns).ok().map(Duration::from_nanos);
        if let Some(r) = state.wait_result(Some(Duration::ZERO)) {
            // SAFETY: forwarded from this function's contract.
            return unsafe { report(r, bytes) };
        }
        if let Some(refused) = state.orphaned() {
            return Err(refused);
        }
        if on_executor() && timeout != Some(Duration::ZERO) {
            if let Some(r) = state.wait_result(Some(Duration::ZERO)) {
                // SAFETY: forwarded from this function's contract.
                return unsafe { report(r, bytes) };
            }
            crate::engine::refuse_on_executor("gpuio_request_wait on a running request")?;
        }
        match state.wait_result(timeout) {
            // SAFETY: forwarded from this function's contract.
            Some(r) => unsafe { report(r, bytes) },
            None => Err(Failure::new(
                gpuio_status::GPUIO_ERR_TIMEOUT,
                format!("request {request:p} is still running after {timeout_ns} ns"),
            )),
        }
    })
}

/// Returns `GPUIO_PENDING` while `request` runs, else its status (as `gpuio_request_wait`).
/// Never blocks.
///
/// # Safety
/// `bytes` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_request_test(
    request: *const gpuio_request,
    bytes: *mut u64,
) -> gpuio_status {
    guard(|| {
        let state = REQUESTS.get(request)?;
        match state.wait_result(Some(Duration::ZERO)) {
            // SAFETY: forwarded from this function's contract.
            Some(r) => unsafe { report(r, bytes) },
            None => Err(Failure::new(
                gpuio_status::GPUIO_PENDING,
                format!("request {request:p} is still running"),
            )),
        }
    })
}

/// Frees a request. **A request still running is cancelled and waited for**: when this returns
/// nothing touches its buffer any more (device memory: no copy is queued after this returns;
/// copies already queued run in stream order), a cancelled write may have written part of its
/// range, and its callback does not run. A completed request's callback has returned by the
/// time this returns, so its user data may go too. Inside a callback, freeing a request of
/// another still running operation is refused (`GPUIO_ERR_WOULD_BLOCK`); freeing the
/// callback's own request is fine.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_request_free(request: *mut gpuio_request) -> gpuio_status {
    guard(|| {
        let state = REQUESTS.get(request)?;
        let done = state.wait_result(Some(Duration::ZERO)).is_some();
        if !done && state.orphaned().is_some() {
            // Nothing runs it in this child: forget it (its buffer is the parent's concern).
            REQUESTS.remove(request)?;
            return Ok(());
        }
        if !done {
            crate::engine::refuse_on_executor("gpuio_request_free of a running request")?;
        }
        // Detach and cancel before the handle goes, so that whoever sees it gone knows the
        // operation will not be polled again.
        if !done {
            state.detached.store(true, Ordering::SeqCst);
            state.cancel();
        }
        REQUESTS.remove(request)?;
        // Until the operation is gone and its callback (if it runs) has returned, so that the
        // caller may free the buffer and the callback's user data. Not inside a callback: it
        // may be this request's own, and other callbacks are short.
        if !on_executor() {
            state.wait_finished();
        }
        Ok(())
    })
}
