//! Running the library's futures for Python: blocking calls on the caller's thread with the
//! GIL released, and asyncio awaitables driven on the binding's own thread pool.
//!
//! Why not pyo3-async-runtimes: the library's futures are runtime-agnostic and woken by its
//! reactor, so they need no tokio or async-std runtime, only a thread to poll them; and the
//! binding must decide itself when the Python memory an operation uses is released (after
//! the operation's future is dropped, and for device memory after its stream has passed the
//! copies), which a generic bridge does not know about. The bridge here is small:
//! - the operation lives in an [`OpCell`] that the pool polls (the reactor wakes it; each
//!   poll copies landed data into the caller's memory or queues device copies);
//! - its result reaches the asyncio loop through `loop.call_soon_threadsafe`, which never
//!   blocks the loop;
//! - cancelling the asyncio future (`gpuio._aio.OpFuture.cancel`) takes the operation out of
//!   its cell and drops it **on the cancelling thread, before `cancel` returns**: the
//!   library's cancel path (no copy into host memory after the drop; a write's pieces still
//!   in the kernel fenced against every later operation on the file) has run before the task
//!   sees `CancelledError`, and the Python memory is released then (device memory once the
//!   stream has passed the copies already queued, see `memory::DeviceMemory`). Dropping it
//!   later on a pool thread, as this binding once did, let a cancelled write land after a
//!   later one and a cancelled read write a buffer its caller had refilled (issue 40).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use futures::executor::ThreadPool;
use pyo3::IntoPyObjectExt;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::IntoPyErr;
use crate::exit;

/// The binding's pool of this process: polls asyncio operations and waits out device memory
/// releases. `None` where the OS refused to start its threads (then awaitables fail with the
/// reason and device memory is released after a blocking stream synchronisation instead).
///
/// One per process: a child made by `fork()` inherits the parent's pool without its threads,
/// where work would only queue, so a child makes its own on first use. No lock is taken (a
/// lock held by another thread of the parent at the fork would never be released in the
/// child): the pool of the current process is published through an atomic pointer, and the
/// few bytes of an entry a forked child replaces are leaked.
pub fn pool() -> Option<&'static ThreadPool> {
    struct Entry {
        pid: u32,
        pool: Option<ThreadPool>,
    }
    static CURRENT: AtomicPtr<Entry> = AtomicPtr::new(std::ptr::null_mut());
    let pid = std::process::id();
    let seen = CURRENT.load(Ordering::Acquire);
    // SAFETY: entries are leaked boxes, never freed, so a non-null pointer stays valid.
    if let Some(e) = unsafe { seen.as_ref() }.filter(|e| e.pid == pid) {
        return e.pool.as_ref();
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
    let pool = ThreadPool::builder()
        .pool_size(threads)
        .name_prefix("gpuio-py-")
        .create()
        .ok();
    let mine: &'static Entry = Box::leak(Box::new(Entry { pid, pool }));
    let mine_ptr = (mine as *const Entry).cast_mut();
    match CURRENT.compare_exchange(seen, mine_ptr, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => mine.pool.as_ref(),
        // Another thread of this process published a pool first: use it (ours stays idle).
        // SAFETY: as above.
        Err(won) => unsafe { won.as_ref() }.and_then(|e| e.pool.as_ref()),
    }
}

/// Runs `fut` to completion on this thread with the GIL released.
pub fn block<T: Send>(py: Python<'_>, fut: impl Future<Output = T> + Send) -> T {
    exit::detach(py, || futures::executor::block_on(fut))
}

/// How often [`block_with_progress`] hands the thread back to Python for a progress callback.
const REPORT_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Wakes a thread parked in [`block_with_progress`].
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// [`block`], and where `callback` is given, `callback(done, total)` from `counter` with the
/// GIL held every [`REPORT_EVERY`] while `fut` runs and once when it has finished. An error
/// from the callback drops `fut` before it returns (cancelling it as dropping any gpuio future
/// does: nothing is written into the caller's memory afterwards) and is raised.
pub fn block_with_progress<T: Send, F: Future<Output = T> + Send>(
    py: Python<'_>,
    fut: F,
    counter: &Arc<gpuio::Progress>,
    callback: Option<&Bound<'_, PyAny>>,
) -> PyResult<T> {
    let Some(callback) = callback else {
        return Ok(block(py, fut));
    };
    let mut fut = std::pin::pin!(fut);
    loop {
        let out = exit::detach(py, || {
            let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
            let mut cx = Context::from_waker(&waker);
            let until = std::time::Instant::now() + REPORT_EVERY;
            loop {
                if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                    return Some(v);
                }
                let now = std::time::Instant::now();
                if now >= until {
                    return None;
                }
                std::thread::park_timeout(until - now);
            }
        });
        callback.call1((counter.done(), counter.total()))?;
        if let Some(v) = out {
            return Ok(v);
        }
    }
}

/// Runs a blocking call of the library that asks its caller whether to go on
/// (`BatchPlan::read_into_blocking_with_progress`) with the GIL released, and where
/// `callback` is given, `callback(done, total)` from `counter` with the GIL held each time it
/// asks and once when it has finished. An error from the callback stops the call (which
/// returns only once the library is done with the caller's memory) and is raised.
pub fn block_asking<T: Send>(
    py: Python<'_>,
    counter: &Arc<gpuio::Progress>,
    callback: Option<&Bound<'_, PyAny>>,
    call: impl Send + FnOnce(&mut dyn FnMut() -> bool) -> Option<T>,
) -> PyResult<T> {
    let report = |py: Python<'_>, cb: &Py<PyAny>| -> PyResult<()> {
        cb.bind(py)
            .call1((counter.done(), counter.total()))
            .map(drop)
    };
    let cb = callback.map(|c| c.clone().unbind());
    let mut raised = None;
    let out = exit::detach(py, || {
        call(&mut || {
            let Some(cb) = &cb else { return true };
            // `None`: the interpreter is gone (a thread that attaches while it exits parks
            // for good instead), so nobody is left to report to.
            match exit::attach(|py| report(py, cb)) {
                Some(Ok(())) => true,
                Some(Err(e)) => {
                    raised = Some(e);
                    false
                }
                None => false,
            }
        })
    });
    if let Some(e) = raised {
        return Err(e);
    }
    let out = out.ok_or_else(|| {
        pyo3::exceptions::PyRuntimeError::new_err("the read stopped: the interpreter is exiting")
    })?;
    if let Some(cb) = &cb {
        report(py, cb)?;
    }
    Ok(out)
}

type BoxedOp<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;
/// A completed operation's result, with what is left of the operation (dropped after).
type Finished<T, E> = (Result<T, E>, BoxedOp<T, E>);

/// One asyncio operation, shared by the pool task that polls it and the asyncio future that
/// may cancel it: whoever takes it out ends it (completion on the pool, or the cancel).
struct OpCell<T, E> {
    op: Mutex<Option<BoxedOp<T, E>>>,
}

impl<T, E> OpCell<T, E> {
    fn take(&self) -> Option<BoxedOp<T, E>> {
        self.op
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Polls the operation; `Ready(None)` once a cancel took it. When it completes, it is
    /// taken out and returned with its result, to be dropped by the caller outside the lock.
    fn poll(&self, cx: &mut Context<'_>) -> Poll<Option<Finished<T, E>>> {
        let mut slot = self.op.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(op) = slot.as_mut() else {
            return Poll::Ready(None);
        };
        match op.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(out) => Poll::Ready(slot.take().map(|op| (out, op))),
        }
    }
}

/// Type-erased [`OpCell::take`] for the cancel hook.
trait Stop: Send + Sync {
    /// Takes the operation out (waiting for a poll in progress to return) and drops it.
    fn stop(&self, py: Python<'_>);
}

impl<T: Send, E: Send> Stop for OpCell<T, E> {
    fn stop(&self, py: Python<'_>) {
        // The lock is held only while the pool polls (a poll copies at most a few pieces);
        // waiting for it without the GIL lets that poll's thread attach if it must.
        let op = exit::detach(py, || self.take());
        // Dropped here, attached: the library's cancel path runs now, and the Python memory
        // the operation held (a buffer export, an object reference) is released now.
        drop(op);
    }
}

/// The asyncio future's `_gpuio_stop`: ends the operation (see the module docs).
#[pyclass(frozen)]
struct StopOp {
    cell: Arc<dyn Stop>,
}

#[pymethods]
impl StopOp {
    fn __call__(&self, py: Python<'_>) {
        self.cell.stop(py);
    }
}

/// An asyncio future (a `gpuio._aio.OpFuture` on the running loop) that completes with `op`'s
/// result. `op` runs on the binding's pool; it owns the Python memory it uses. Cancelling the
/// future drops `op` before `cancel()` returns (module docs). `op`'s error becomes its `gpuio`
/// exception on the thread that delivers it ([`IntoPyErr`]).
pub fn spawn<'py, T, E>(
    py: Python<'py>,
    op: impl Future<Output = Result<T, E>> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>>
where
    T: for<'a> IntoPyObject<'a> + Send + 'static,
    E: IntoPyErr,
{
    let pool = pool().ok_or_else(|| {
        pyo3::exceptions::PyRuntimeError::new_err("gpuio: the OS refused to start gpuio's threads")
    })?;
    let aio = py.import("gpuio._aio")?;
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let cell: Arc<OpCell<T, E>> = Arc::new(OpCell {
        op: Mutex::new(Some(Box::pin(op))),
    });
    let kwargs = PyDict::new(py);
    kwargs.set_item("loop", &event_loop)?;
    kwargs.set_item("stop", Bound::new(py, StopOp { cell: cell.clone() })?)?;
    let fut = aio.getattr("OpFuture")?.call((), Some(&kwargs))?;
    let resolve = aio.getattr("resolve")?.unbind();
    let (event_loop, target) = (event_loop.unbind(), fut.clone().unbind());
    pool.spawn_ok(async move {
        let Some((outcome, op)) = futures::future::poll_fn(|cx| cell.poll(cx)).await else {
            // Cancelled: the cancelling thread dropped the operation.
            return;
        };
        exit::attach(move |py| {
            // What is left of the operation goes first; the memory it held was released when it
            // completed (a detached drop, deferred by PyO3 and carried out by this attach,
            // before the result reaches the loop).
            drop(op);
            let (ok, value) = match outcome {
                Ok(v) => match v.into_bound_py_any(py) {
                    Ok(v) => (true, v),
                    Err(e) => (false, e.into_value(py).into_bound(py).into_any()),
                },
                // Converted here, attached through `exit::attach`: never inside a poll.
                Err(e) => (
                    false,
                    e.into_py_err().into_value(py).into_bound(py).into_any(),
                ),
            };
            // Fails only if the loop was closed meanwhile: nobody awaits the result then.
            let _ = event_loop.bind(py).call_method1(
                "call_soon_threadsafe",
                (resolve.bind(py), target.bind(py), ok, value),
            );
        });
    });
    Ok(fut)
}
