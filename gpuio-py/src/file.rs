//! `gpuio.Engine` and `gpuio.File`: thin wrappers over the library's types. Each operation
//! extracts its Python memory (`memory::extract`), runs the library's future (blocking with
//! the GIL released, or on the binding's pool for the `a*` forms) and maps errors.

use std::time::Duration;

use gpuio::batch::{BatchPlan, ReadDesc};
use pyo3::prelude::*;

use crate::context::KeepCurrentContext;
use crate::errors::{int_arg, opt_int_arg, to_py};
use crate::memory::{Access, Memory, extract};
use crate::runner::{block, spawn};

/// A gpuio engine: a reactor thread (io_uring, or a pread pool) and its pinned bounce
/// pool; open files with ``open``. The keyword arguments are the library's builder settings
/// (sizes in bytes, times in seconds; unset ones are sized from the machine, as
/// ``gpuio.check()`` shows): ``backend`` ("auto", "uring", "pread", "gds"), ``chunk_size``,
/// ``buffered_chunk_size``, ``direct_chunk_size``, ``queue_depth``, ``iowq_workers``,
/// ``page_cache_copies`` (most buffered reads copied out of the page cache at once),
/// ``copies_per_device`` (most of them per GPU while every read lands in GPU memory),
/// ``bounce_slots``, ``bounce_growth``, ``pool_wait_limit``, ``pread_threads``,
/// ``async_copy_threshold`` (-1: default, None: all copies inline), ``spdk_memory``,
/// ``cufile_compat``, ``reactor_spin``, ``reactor_tick``, ``submission_polling`` (SQPOLL's idle
/// time; default off), ``reactors`` (reactor threads, each with its own ring and share of the
/// pool; default 1: two lift small O_DIRECT reads at high depth), ``page_cache_fast_path`` (default True: small reads first try the page
/// cache on the polling thread), ``mapped_reads``, ``page_cache_read_max``,
/// ``residency_aware`` (default True:
/// reads of 256 KiB or more of buffered files read what the page cache lacks with O_DIRECT;
/// False sends everything through the page cache). Bad settings raise ``gpuio.InvalidInput``. A context manager: leaving it shuts the engine down.
#[pyclass(frozen, module = "gpuio._native")]
pub struct Engine {
    pub(crate) inner: gpuio::Engine,
}

fn seconds(s: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("{what}: {s} seconds: {e}")))
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (*, backend = "auto", chunk_size = None, buffered_chunk_size = None,
        direct_chunk_size = None, queue_depth = None, iowq_workers = None,
        page_cache_copies = None, copies_per_device = None, bounce_slots = None, bounce_growth = None, pool_wait_limit = None, pread_threads = None,
        async_copy_threshold = -1, spdk_memory = false, cufile_compat = false,
        reactor_spin = None, reactor_tick = None, residency_aware = true, mapped_reads = false,
        page_cache_read_max = None, page_cache_fast_path = true, submission_polling = None,
        reactors = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: &str,
        chunk_size: Option<i128>,
        buffered_chunk_size: Option<i128>,
        direct_chunk_size: Option<i128>,
        queue_depth: Option<i128>,
        iowq_workers: Option<i128>,
        page_cache_copies: Option<i128>,
        copies_per_device: Option<i128>,
        bounce_slots: Option<i128>,
        bounce_growth: Option<i128>,
        pool_wait_limit: Option<f64>,
        pread_threads: Option<i128>,
        async_copy_threshold: Option<i64>,
        spdk_memory: bool,
        cufile_compat: bool,
        reactor_spin: Option<f64>,
        reactor_tick: Option<f64>,
        residency_aware: bool,
        mapped_reads: bool,
        page_cache_read_max: Option<i128>,
        page_cache_fast_path: bool,
        submission_polling: Option<f64>,
        reactors: Option<i128>,
    ) -> PyResult<Self> {
        let chunk_size: Option<usize> = opt_int_arg(py, "chunk_size", chunk_size)?;
        let buffered_chunk_size: Option<usize> =
            opt_int_arg(py, "buffered_chunk_size", buffered_chunk_size)?;
        let direct_chunk_size: Option<usize> =
            opt_int_arg(py, "direct_chunk_size", direct_chunk_size)?;
        let queue_depth: Option<usize> = opt_int_arg(py, "queue_depth", queue_depth)?;
        let iowq_workers: Option<u32> = opt_int_arg(py, "iowq_workers", iowq_workers)?;
        let page_cache_copies: Option<usize> =
            opt_int_arg(py, "page_cache_copies", page_cache_copies)?;
        let copies_per_device: Option<usize> =
            opt_int_arg(py, "copies_per_device", copies_per_device)?;
        let bounce_slots: Option<usize> = opt_int_arg(py, "bounce_slots", bounce_slots)?;
        let bounce_growth: Option<usize> = opt_int_arg(py, "bounce_growth", bounce_growth)?;
        let pread_threads: Option<usize> = opt_int_arg(py, "pread_threads", pread_threads)?;
        let reactors: Option<usize> = opt_int_arg(py, "reactors", reactors)?;
        let page_cache_read_max: Option<usize> =
            opt_int_arg(py, "page_cache_read_max", page_cache_read_max)?;
        let backend: gpuio::Backend = backend
            .parse()
            .map_err(|e: String| crate::errors::invalid(py, e))?;
        let mut b = gpuio::Engine::builder()
            .backend(backend)
            .spdk_memory(spdk_memory)
            .cufile_compat(cufile_compat)
            .residency_aware(residency_aware)
            .mapped_reads(mapped_reads)
            .page_cache_fast_path(page_cache_fast_path);
        if let Some(v) = chunk_size {
            b = b.chunk_size(v);
        }
        if let Some(v) = buffered_chunk_size {
            b = b.buffered_chunk_size(v);
        }
        if let Some(v) = direct_chunk_size {
            b = b.direct_chunk_size(v);
        }
        if let Some(v) = queue_depth {
            b = b.queue_depth(v);
        }
        if let Some(v) = iowq_workers {
            b = b.iowq_workers(v);
        }
        // Zero is the library's to refuse (`EngineBuilder::build`), as for every binding.
        if let Some(v) = page_cache_copies {
            b = b.page_cache_copies(v);
        }
        if let Some(v) = copies_per_device {
            b = b.copies_per_device(v);
        }
        if let Some(v) = bounce_slots {
            b = b.bounce_slots(v);
        }
        if let Some(v) = bounce_growth {
            b = b.bounce_growth(v);
        }
        if let Some(v) = pool_wait_limit {
            b = b.pool_wait_limit(seconds(v, "pool_wait_limit")?);
        }
        if let Some(v) = pread_threads {
            b = b.pread_threads(v);
        }
        if let Some(v) = page_cache_read_max {
            b = b.page_cache_read_max(v);
        }
        // -1 (the default) keeps the library's threshold; None keeps everything inline.
        match async_copy_threshold {
            Some(-1) => {}
            Some(v) => {
                let v = usize::try_from(v).map_err(|_| {
                    crate::errors::invalid(py, format!("async_copy_threshold {v} is negative"))
                })?;
                b = b.async_copy_threshold(Some(v));
            }
            None => b = b.async_copy_threshold(None),
        }
        if let Some(v) = reactor_spin {
            b = b.reactor_spin(seconds(v, "reactor_spin")?);
        }
        if let Some(v) = reactor_tick {
            b = b.reactor_tick(seconds(v, "reactor_tick")?);
        }
        if let Some(v) = submission_polling {
            b = b.submission_polling(seconds(v, "submission_polling")?);
        }
        if let Some(v) = reactors {
            b = b.reactors(v);
        }
        let inner = crate::exit::detach(py, || b.build()).map_err(to_py)?;
        Ok(Engine { inner })
    }

    /// Opens ``path``: read-only by default; ``write=True`` opens it for reading and
    /// writing (``create``/``truncate`` as for ``open(2)``); ``direct=True`` bypasses the
    /// page cache (O_DIRECT; any offset and length still work).
    #[pyo3(signature = (path, direct = false, write = false, create = false, truncate = false))]
    fn open(
        &self,
        py: Python<'_>,
        path: std::path::PathBuf,
        direct: bool,
        write: bool,
        create: bool,
        truncate: bool,
    ) -> PyResult<File> {
        let opts = gpuio::OpenOptions::new()
            .read(true)
            .write(write)
            .create(create)
            .truncate(truncate)
            .direct(direct);
        let inner = crate::exit::detach(py, || opts.open(&self.inner, &path)).map_err(to_py)?;
        Ok(File { inner })
    }

    /// The backend serving this engine (``io_uring`` or ``pread``).
    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.backend().name
    }

    /// Why that backend: flags, buffer registration, or the reason for a fallback.
    #[getter]
    fn backend_detail(&self) -> String {
        self.inner.backend().detail.clone()
    }

    /// Largest piece one I/O moves, in bytes.
    #[getter]
    fn chunk_size(&self) -> usize {
        self.inner.chunk_size()
    }

    /// Most I/Os in the kernel at once.
    #[getter]
    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    /// Reads into device memory so far copied straight from the page cache (``mapped_reads``).
    #[getter]
    fn mapped_reads(&self) -> u64 {
        self.inner.mapped_reads()
    }

    /// Reads so far served from the page cache by the thread running them, straight into the
    /// destination: small ones, and host reads up to ``page_cache_read_max`` bytes.
    #[getter]
    fn cached_reads(&self) -> u64 {
        self.inner.cached_reads()
    }

    /// Stops the reactor: operations in flight are cancelled and drained; later ones fail
    /// with ``gpuio.ShutDown``. Blocks (without the GIL) until done.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let engine = self.inner.clone();
        block(py, async move { engine.shutdown().await }).map_err(to_py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<Bound<'_, PyAny>>,
        _v: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.shutdown(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!(
            "gpuio.Engine(backend={:?}, chunk_size={}, queue_depth={})",
            self.inner.backend().name,
            self.inner.chunk_size(),
            self.inner.queue_depth()
        )
    }
}

/// An open file on an engine (``Engine.open``). Sync methods release the GIL while the I/O
/// runs; the ``a*`` methods return awaitables completing on the running asyncio loop, safe to
/// cancel. Any offset and length work, also with ``direct=True`` (gpuio aligns).
#[pyclass(frozen, module = "gpuio._native")]
pub struct File {
    pub(crate) inner: gpuio::File,
}

/// The batch `descs` (``(offset, length, dst_offset)`` tuples) describe, on `file`.
fn batch_plan(
    py: Python<'_>,
    file: &gpuio::File,
    descs: Vec<(i128, i128, i128)>,
) -> PyResult<BatchPlan> {
    let descs = descs
        .into_iter()
        .enumerate()
        .map(|(i, (offset, len, at))| {
            Ok(ReadDesc::new(
                file,
                int_arg(py, &format!("descs[{i}] offset"), offset)?,
                int_arg(py, &format!("descs[{i}] length"), len)?,
                int_arg(py, &format!("descs[{i}] dst_offset"), at)?,
            ))
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok(BatchPlan::new(descs))
}

/// Runs `plan` into `mem`: bytes per descriptor, or the first descriptor's error.
async fn run_batch(plan: BatchPlan, mut mem: Memory) -> gpuio::Result<Vec<usize>> {
    let done = match &mut mem {
        Memory::Host(h) => plan.read_into(h.bytes_mut()).await,
        Memory::Device(d) => plan.read_into(&mut d.slice).await,
    };
    done.into_results().into_iter().collect()
}

async fn read(file: gpuio::File, mut mem: Memory, offset: u64) -> gpuio::Result<usize> {
    match &mut mem {
        Memory::Host(h) => file.read_into(h.bytes_mut(), offset).await,
        Memory::Device(d) => file.read_into(&mut d.slice, offset).await,
    }
}

async fn write(file: gpuio::File, mem: Memory, offset: u64) -> gpuio::Result<usize> {
    match &mem {
        Memory::Host(h) => file.write_from(h.bytes(), offset).await,
        Memory::Device(d) => file.write_from(&d.slice, offset).await,
    }
}

#[pymethods]
impl File {
    /// Reads ``len(dst)`` bytes (its whole size) of the file at ``offset`` into ``dst`` and
    /// returns the bytes read: fewer only at the end of the file. Releases the GIL.
    ///
    /// ``dst``: host memory through the buffer protocol (numpy array, bytearray, memoryview:
    /// writable and C-contiguous), or device memory with ``__cuda_array_interface__`` (v3) or
    /// ``__dlpack__`` (torch and cupy tensors), or a DLPack capsule.
    ///
    /// Stream semantics (device memory): the copies into ``dst`` are queued on ``stream``
    /// (an int handle, ``torch.cuda.Stream``, ``cupy.cuda.Stream``, or any object with
    /// ``__cuda_stream__``); without one, on the object's stream: the one its
    /// ``__cuda_array_interface__`` names (v3, e.g. cupy's current stream), for a torch
    /// tensor torch's current stream on its device (torch's interface is v2 and names none),
    /// else the legacy default stream. Where ``stream`` is given and differs from the
    /// object's, ``stream`` first waits for the object's pending work. DLPack producers are
    /// asked (``__dlpack__(stream=...)``) to order their pending work before the stream used.
    /// The call returns once every copy is **queued**: kernels launched afterwards on that
    /// stream see the data; synchronize the stream before looking at the memory any other
    /// way. gpuio keeps a reference to ``dst`` until the stream has passed the copies.
    ///
    /// Raises ``gpuio.InvalidInput`` for a read-only or non-contiguous ``dst``,
    /// ``gpuio.IoError`` (an ``OSError``) for I/O errors, and so on (``gpuio.Error``).
    #[pyo3(signature = (dst, offset = 0, *, stream = None))]
    fn read_into(
        &self,
        py: Python<'_>,
        dst: &Bound<'_, PyAny>,
        offset: i128,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let _keep_context = KeepCurrentContext::save();
        let offset = int_arg(py, "offset", offset)?;
        let mem = extract(self.inner.engine(), dst, stream, Access::Dst)?;
        if let Memory::Host(mut h) = mem {
            // Lent to the library for the call: the kernel may read into it in place.
            let file = &self.inner;
            return crate::exit::detach(py, || file.read_into_blocking(h.bytes_mut(), offset))
                .map_err(to_py);
        }
        block(py, read(self.inner.clone(), mem, offset)).map_err(to_py)
    }

    /// ``read_into`` as an awaitable: the read runs on gpuio's threads and the result comes
    /// back on the asyncio loop without blocking it. Cancelling (the task, or the future
    /// itself) ends the read inside ``cancel()``: once the caller sees ``CancelledError``,
    /// nothing more is written into host memory and ``dst`` is no longer exported (a
    /// ``bytearray`` can resize); into device memory no further copy is queued, and copies
    /// already queued run on the stream before anything queued there later (gpuio keeps
    /// ``dst`` alive until they have run). Same stream semantics as ``read_into``.
    #[pyo3(signature = (dst, offset = 0, *, stream = None))]
    fn aread_into<'py>(
        &self,
        py: Python<'py>,
        dst: &Bound<'py, PyAny>,
        offset: i128,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _keep_context = KeepCurrentContext::save();
        let offset = int_arg(py, "offset", offset)?;
        let mem = extract(self.inner.engine(), dst, stream, Access::Dst)?;
        let op = read(self.inner.clone(), mem, offset);
        spawn(py, op)
    }

    /// Writes all of ``src`` (host or device memory, as for ``read_into``) to the file at
    /// ``offset`` and returns ``len(src)``; a short write is an error, never reported as
    /// success. The file must be opened with ``write=True``. Releases the GIL.
    ///
    /// Device memory: the copies out of ``src`` are queued on ``stream`` (or the object's
    /// stream) after the work already queued there, so a kernel that produced ``src`` on that
    /// stream is finished before its bytes are read.
    #[pyo3(signature = (src, offset = 0, *, stream = None))]
    fn write_from(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        offset: i128,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let _keep_context = KeepCurrentContext::save();
        let offset = int_arg(py, "offset", offset)?;
        let mem = extract(self.inner.engine(), src, stream, Access::Src)?;
        block(py, write(self.inner.clone(), mem, offset)).map_err(to_py)
    }

    /// ``write_from`` as an awaitable. Cancelling it ends the write inside ``cancel()``: some
    /// of the bytes may have reached the file, none is reported as written, nothing more is
    /// read from ``src``, and pieces still in the kernel are ordered before every later
    /// operation on the file, so a later write always lands last.
    #[pyo3(signature = (src, offset = 0, *, stream = None))]
    fn awrite_from<'py>(
        &self,
        py: Python<'py>,
        src: &Bound<'py, PyAny>,
        offset: i128,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _keep_context = KeepCurrentContext::save();
        let offset = int_arg(py, "offset", offset)?;
        let mem = extract(self.inner.engine(), src, stream, Access::Src)?;
        let op = write(self.inner.clone(), mem, offset);
        spawn(py, op)
    }

    /// Reads many ranges of this file into one destination in one operation: ``descs`` is a
    /// list of ``(offset, length, dst_offset)``; each range lands at ``dst_offset`` bytes into
    /// ``dst`` (host or device memory, as for ``read_into``). Neighbouring ranges are merged
    /// into one read. Returns the bytes read per descriptor (short only at the end of the
    /// file) or raises the first descriptor's error (overlapping destination ranges, a range
    /// past ``dst``'s end, an I/O error). Same stream semantics as ``read_into``.
    #[pyo3(signature = (descs, dst, *, stream = None))]
    fn read_batch(
        &self,
        py: Python<'_>,
        descs: Vec<(i128, i128, i128)>,
        dst: &Bound<'_, PyAny>,
        stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<usize>> {
        let _keep_context = KeepCurrentContext::save();
        let mem = extract(self.inner.engine(), dst, stream, Access::Dst)?;
        let plan = batch_plan(py, &self.inner, descs)?;
        block(py, run_batch(plan, mem)).map_err(to_py)
    }

    /// ``read_batch`` as an awaitable (cancellation as for ``aread_into``).
    #[pyo3(signature = (descs, dst, *, stream = None))]
    fn aread_batch<'py>(
        &self,
        py: Python<'py>,
        descs: Vec<(i128, i128, i128)>,
        dst: &Bound<'py, PyAny>,
        stream: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _keep_context = KeepCurrentContext::save();
        let mem = extract(self.inner.engine(), dst, stream, Access::Dst)?;
        let op = run_batch(batch_plan(py, &self.inner, descs)?, mem);
        spawn(py, op)
    }

    /// Flushes data and metadata to stable storage (``fsync``).
    fn sync_all(&self, py: Python<'_>) -> PyResult<()> {
        let file = self.inner.clone();
        block(py, async move { file.sync_all().await }).map_err(to_py)
    }

    /// Current size in bytes.
    fn size(&self) -> PyResult<u64> {
        self.inner.len().map_err(to_py)
    }

    /// The path the file was opened with.
    #[getter]
    fn path(&self) -> std::path::PathBuf {
        self.inner.path().to_path_buf()
    }

    /// Whether the file was opened with O_DIRECT.
    #[getter]
    fn direct(&self) -> bool {
        self.inner.is_direct()
    }

    /// What serves this file's device-memory transfers: ``"gds"``, ``"cufile-compat"`` or
    /// ``"bounce (why)"``.
    fn gds_status(&self, py: Python<'_>) -> String {
        let file = self.inner.clone();
        crate::exit::detach(py, move || file.gds_status().to_string())
    }

    fn __repr__(&self) -> String {
        format!(
            "gpuio.File({:?}, direct={})",
            self.inner.path(),
            if self.inner.is_direct() {
                "True"
            } else {
                "False"
            }
        )
    }
}
