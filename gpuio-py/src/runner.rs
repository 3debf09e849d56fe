//! Running the library's futures for Python: blocking calls on the caller's thread with the
//! GIL released, and asyncio awaitables driven on the binding's own thread pool.
//!
//! Why not pyo3-async-runtimes: the library's futures are runtime-agnostic and woken by its
//! reactor, so they need no tokio or async-std runtime, only a thread to poll them; and the
//! binding must decide itself when the Python memory an operation uses is released (after
//! the operation's future is dropped, and for device memory after its stream has passed the
//! copies), which a generic bridge does not know about. The bridge here is small:
//! - the operation runs on a `futures` thread pool (the reactor wakes it; each poll copies
//!   landed data into the caller's memory or queues device copies);
//! - its result reaches the asyncio loop through `loop.call_soon_threadsafe`, which never
//!   blocks the loop;
//! - cancelling the asyncio future aborts the operation: the pool drops its future (the
//!   library's cancel path), then the Python memory it held (see `memory::DeviceMemory`).

use std::future::Future;
use std::sync::OnceLock;

use futures::executor::ThreadPool;
use futures::future::{AbortHandle, Abortable};
use pyo3::IntoPyObjectExt;
use pyo3::prelude::*;

/// The binding's pool: polls asyncio operations and waits out device memory releases.
/// `None` where the OS refused to start its threads (then awaitables fail with the reason and
/// device memory is released after a blocking stream synchronisation instead).
pub fn pool() -> Option<&'static ThreadPool> {
    static POOL: OnceLock<Option<ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
        ThreadPool::builder()
            .pool_size(threads)
            .name_prefix("gpuio-py-")
            .create()
            .ok()
    })
    .as_ref()
}

/// Runs `fut` to completion on this thread with the GIL released.
pub fn block<T: Send>(py: Python<'_>, fut: impl Future<Output = T> + Send) -> T {
    py.detach(|| futures::executor::block_on(fut))
}

/// The done-callback of an asyncio future: aborts the operation when the future was
/// cancelled.
#[pyclass(frozen)]
struct AbortOnCancel {
    handle: AbortHandle,
}

#[pymethods]
impl AbortOnCancel {
    fn __call__(&self, fut: &Bound<'_, PyAny>) -> PyResult<()> {
        if fut.call_method0("cancelled")?.extract::<bool>()? {
            self.handle.abort();
        }
        Ok(())
    }
}

/// An asyncio future (on the running loop) that completes with `op`'s result. `op` runs on
/// the binding's pool; it owns the Python memory it uses, so that memory lives until the
/// pool has dropped it, whether `op` finished or was aborted by a cancellation.
pub fn spawn<'py, T>(
    py: Python<'py>,
    op: impl Future<Output = PyResult<T>> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>>
where
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    let pool = pool().ok_or_else(|| {
        pyo3::exceptions::PyRuntimeError::new_err("gpuio: the OS refused to start gpuio's threads")
    })?;
    let asyncio = py.import("asyncio")?;
    let event_loop = asyncio.call_method0("get_running_loop")?;
    let fut = event_loop.call_method0("create_future")?;
    let (handle, registration) = AbortHandle::new_pair();
    fut.call_method1(
        "add_done_callback",
        (Bound::new(py, AbortOnCancel { handle })?,),
    )?;
    let resolve = py.import("gpuio._aio")?.getattr("resolve")?.unbind();
    let (event_loop, target) = (event_loop.unbind(), fut.clone().unbind());
    pool.spawn_ok(async move {
        let outcome = Abortable::new(op, registration).await;
        // The operation (and the memory it owned) is dropped by now.
        let Ok(outcome) = outcome else { return };
        let _ = Python::try_attach(|py| -> PyResult<()> {
            let (ok, value) = match outcome {
                Ok(v) => (true, v.into_bound_py_any(py)?),
                Err(e) => (false, e.into_value(py).into_bound(py).into_any()),
            };
            // Fails only if the loop was closed meanwhile: nobody awaits the result then.
            let _ = event_loop.bind(py).call_method1(
                "call_soon_threadsafe",
                (resolve.bind(py), target.bind(py), ok, value),
            );
            Ok(())
        });
    });
    Ok(fut)
}
