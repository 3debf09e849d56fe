//! Engines: settings, creation and freeing, the executor that drives asynchronous requests,
//! and the eventfd that tells an epoll loop a request finished.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::executor::{Executor, on_executor};
use crate::options::{self, gpuio_engine_option};
use crate::registry::Registry;
use crate::request::RequestState;
use crate::status::{Failure, gpuio_status, guard};
use crate::{GPUIO_BACKEND_AUTO, GPUIO_BACKEND_GDS, GPUIO_BACKEND_PREAD, GPUIO_BACKEND_URING};

/// An engine: one reactor thread and its bounce pool, plus the threads that run asynchronous
/// requests. Opaque; create with `gpuio_engine_create`, free with `gpuio_engine_free`.
pub struct gpuio_engine {
    _opaque: [u8; 0],
}

/// Settings for `gpuio_engine_create`. **A zeroed struct means the defaults** (the library's
/// measured best); set only the fields you want to change. Passing NULL is the same as a
/// zeroed struct.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct gpuio_engine_settings {
    /// Kernel interface: `GPUIO_BACKEND_AUTO` (0: io_uring, else the pread pool; cuFile per
    /// file where it serves), `GPUIO_BACKEND_URING`, `GPUIO_BACKEND_PREAD`, `GPUIO_BACKEND_GDS`.
    pub backend: u32,
    /// Most I/Os in the kernel at once (0: sized from the machine, see `gpuio_engine_sizing`).
    pub queue_depth: u32,
    /// Largest piece one I/O moves on every path, a multiple of 4096 (0: the defaults below).
    pub chunk_size: u64,
    /// Largest piece of a buffered (page-cache) I/O (0: `chunk_size`, else the library's
    /// default, 2 MiB).
    pub buffered_chunk_size: u64,
    /// Largest piece of an O_DIRECT, cuFile or NVMe I/O (0: `chunk_size`, else the library's
    /// default, 4 MiB).
    pub direct_chunk_size: u64,
    /// Bounce pool size in blocks of the larger chunk rounded up to a power of two (0: sized
    /// from the machine).
    pub bounce_slots: u32,
    /// Threads of the pread pool where it serves, at most 4096 (0: the queue depth, at most
    /// 64).
    pub pread_threads: u32,
    /// Threads that run asynchronous requests and their callbacks; copies from bounce memory
    /// into host buffers run on them, at most 4096 (0: one per CPU core).
    pub executor_threads: u32,
    /// How long the reactor spins after its last work, in microseconds (0: no spin).
    pub reactor_spin_us: u32,
    /// Buffered pieces of at least this many bytes go to io_uring's worker pool (0: 64 KiB;
    /// `UINT64_MAX`: none, every copy inline on the reactor).
    pub async_copy_threshold: u64,
    /// Nonzero: every read of a buffered file goes through the page cache. 0 (the default):
    /// reads of 256 KiB or more ask the kernel what the page cache holds and read the ranges
    /// it mostly lacks with O_DIRECT (cold files at the disk's direct rate, leaving the page
    /// cache as it was).
    pub no_residency: u32,
    /// Ignored: device leases (the reactor copying reads into device memory itself) were
    /// removed after measuring 1.02x at 16 MiB, 0.87x at 1 MiB and a hang at 4 KiB
    /// (docs/device-leases.md). The field stays so that the struct's layout and callers that
    /// set it keep working.
    pub lease_min: u64,
}

/// What an engine handle holds.
pub(crate) struct EngineHandle {
    pub(crate) engine: gpuio::Engine,
    executor: Executor,
    /// Signalled (incremented) each time a request of this engine completes, once someone
    /// has asked for it (`gpuio_engine_eventfd`): a write per request otherwise.
    pub(crate) eventfd: OwnedFd,
    eventfd_wanted: std::sync::atomic::AtomicBool,
    /// Requests running, and whether the engine is being freed (then nothing new starts).
    pub(crate) requests: Mutex<Requests>,
    /// CUDA contexts by device index, retained on first use.
    pub(crate) contexts: crate::memory::Contexts,
}

pub(crate) struct Requests {
    pub(crate) closed: bool,
    pub(crate) running: HashMap<u64, Arc<RequestState>>,
}

pub(crate) static ENGINES: Registry<EngineHandle> = Registry::new("gpuio_engine");

/// Fails with `GPUIO_ERR_WOULD_BLOCK` on an executor thread (inside a completion callback).
pub(crate) fn refuse_on_executor(what: &str) -> Result<(), Failure> {
    if on_executor() {
        return Err(Failure::new(
            gpuio_status::GPUIO_ERR_WOULD_BLOCK,
            format!(
                "{what} blocks, and this thread is a gpuio executor thread (inside a completion \
                 callback, which must not block): use gpuio_request_test or the async calls"
            ),
        ));
    }
    Ok(())
}

/// Most threads a setting may ask for (`pread_threads`, `executor_threads`). Past a few
/// thousand, threads only cost memory and scheduling; a value like `UINT32_MAX` is a mistake,
/// which used to start threads (a stack each) until the OS refused.
const MAX_THREADS: u32 = 4096;

fn builder(s: &gpuio_engine_settings) -> Result<gpuio::EngineBuilder, Failure> {
    for (n, what) in [
        (s.pread_threads, "pread_threads"),
        (s.executor_threads, "executor_threads"),
    ] {
        if n > MAX_THREADS {
            return Err(Failure::invalid(format!(
                "gpuio_engine_settings.{what} {n} is more than the {MAX_THREADS} threads a \
                 setting may ask for"
            )));
        }
    }
    let mut b = gpuio::Engine::builder();
    b = b.backend(match s.backend {
        GPUIO_BACKEND_AUTO => gpuio::Backend::Auto,
        GPUIO_BACKEND_URING => gpuio::Backend::Uring,
        GPUIO_BACKEND_PREAD => gpuio::Backend::Pread,
        GPUIO_BACKEND_GDS => gpuio::Backend::Gds,
        other => {
            return Err(Failure::invalid(format!(
                "gpuio_engine_settings.backend {other} is not a GPUIO_BACKEND_* value"
            )));
        }
    });
    if s.queue_depth != 0 {
        b = b.queue_depth(s.queue_depth as usize);
    }
    let size = |v: u64, what: &str| {
        usize::try_from(v)
            .map_err(|_| Failure::invalid(format!("gpuio_engine_settings.{what} is too large")))
    };
    if s.chunk_size != 0 {
        b = b.chunk_size(size(s.chunk_size, "chunk_size")?);
    }
    if s.buffered_chunk_size != 0 {
        b = b.buffered_chunk_size(size(s.buffered_chunk_size, "buffered_chunk_size")?);
    }
    if s.direct_chunk_size != 0 {
        b = b.direct_chunk_size(size(s.direct_chunk_size, "direct_chunk_size")?);
    }
    if s.bounce_slots != 0 {
        b = b.bounce_slots(s.bounce_slots as usize);
    }
    if s.pread_threads != 0 {
        b = b.pread_threads(s.pread_threads as usize);
    }
    if s.reactor_spin_us != 0 {
        b = b.reactor_spin(Duration::from_micros(s.reactor_spin_us.into()));
    }
    match s.async_copy_threshold {
        0 => {}
        u64::MAX => b = b.async_copy_threshold(None),
        n => b = b.async_copy_threshold(Some(usize::try_from(n).unwrap_or(usize::MAX))),
    }
    if s.no_residency != 0 {
        b = b.residency_aware(false);
    }
    Ok(b)
}

/// Creates an engine with `settings` (NULL or a zeroed struct: the defaults) and stores its
/// handle in `*out`. Fails with `GPUIO_ERR_INVALID` for an unknown backend or a bad value, and
/// `GPUIO_ERR_UNSUPPORTED` where the backend asked for is not available.
///
/// # Safety
/// `settings` is NULL or points to a readable `gpuio_engine_settings`; `out` is NULL (an
/// error) or points to writable storage for one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engine_create(
    settings: *const gpuio_engine_settings,
    out: *mut *mut gpuio_engine,
) -> gpuio_status {
    // SAFETY: forwarded from this function's contract; no options.
    unsafe { gpuio_engine_create_with_options(settings, std::ptr::null(), 0, out) }
}

/// `gpuio_engine_create` with settings beyond `gpuio_engine_settings`: `n_options` entries of
/// `options`, each a `GPUIO_OPTION_*` key and its value (NULL with 0: none, which is
/// `gpuio_engine_create`). Each key at most once. An unknown key (a program built against a
/// newer header), a key given twice, a nonzero `reserved` or a flag other than 0 or 1 is
/// `GPUIO_ERR_INVALID` naming the entry; a value out of its setting's range is
/// `GPUIO_ERR_INVALID` naming the setting. Either way no engine is made.
///
/// # Safety
/// `settings` is NULL or points to a readable `gpuio_engine_settings`; `options` is NULL with
/// `n_options` 0, or points to `n_options` readable `gpuio_engine_option`s; `out` is NULL (an
/// error) or points to writable storage for one pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engine_create_with_options(
    settings: *const gpuio_engine_settings,
    options: *const gpuio_engine_option,
    n_options: usize,
    out: *mut *mut gpuio_engine,
) -> gpuio_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid(
                "gpuio_engine_create: out is a null pointer",
            ));
        }
        // SAFETY: the caller passes NULL or a readable settings struct; every bit pattern of
        // its integer fields is a valid value.
        let settings = unsafe { settings.as_ref() }.copied().unwrap_or_default();
        // SAFETY: forwarded from this function's contract.
        let options =
            unsafe { options::slice(options, n_options, "gpuio_engine_create: options") }?;
        let engine = options::apply(builder(&settings)?, options)?.build()?;
        let threads = match settings.executor_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n as usize,
        };
        // SAFETY: eventfd has no memory preconditions; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            return Err(Failure {
                errno: e.raw_os_error().unwrap_or(0),
                ..Failure::new(gpuio_status::GPUIO_ERR_IO, format!("eventfd: {e}"))
            });
        }
        // SAFETY: `fd` is a new descriptor this function owns.
        let eventfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let executor = Executor::new(threads).map_err(|e| {
            Failure::new(gpuio_status::GPUIO_ERR_IO, format!("executor threads: {e}"))
        })?;
        let handle = Arc::new(EngineHandle {
            engine,
            executor,
            eventfd,
            eventfd_wanted: Default::default(),
            requests: Mutex::new(Requests {
                closed: false,
                running: HashMap::new(),
            }),
            contexts: Default::default(),
        });
        let token = ENGINES.insert(handle);
        // SAFETY: `out` was checked non-null and the caller made it writable.
        unsafe { *out = std::ptr::without_provenance_mut(token as usize) };
        Ok(())
    })
}

/// Frees an engine. **Requests still running are cancelled**: each completes with
/// `GPUIO_ERR_CANCELED` (its callback runs, its eventfd signal is sent) and, by the time this
/// returns, none of them touches its buffer again (for device memory: no copy is queued after
/// this returns; copies already queued run in stream order). Request handles stay valid until
/// `gpuio_request_free`. Then the reactor and the executor threads stop. Files opened on the
/// engine fail every later call with `GPUIO_ERR_SHUTDOWN`; close them to free their memory.
/// Refused (`GPUIO_ERR_WOULD_BLOCK`) inside a completion callback.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engine_free(engine: *mut gpuio_engine) -> gpuio_status {
    guard(|| {
        refuse_on_executor("gpuio_engine_free")?;
        let handle = ENGINES.get(engine)?;
        if handle.engine.inherited_across_fork() {
            // A forked child: the requests, reactor and executor threads are the parent's
            // (none runs here), so nothing can be cancelled, waited for or joined; the
            // executor's drop leaves its threads alone in a child.
            ENGINES.remove(engine)?;
            return Ok(());
        }
        // Nothing new starts and everything running is cancelled before the handle goes, so
        // that whoever sees it gone knows no request of it will be polled again.
        let running = handle.cancel_all();
        ENGINES.remove(engine)?;
        handle.close(running);
        Ok(())
    })
}

impl EngineHandle {
    /// Whether `gpuio_engine_free` has begun on this engine.
    pub(crate) fn is_closed(&self) -> bool {
        self.requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .closed
    }

    /// Refuses new requests and cancels the running ones; returns them.
    fn cancel_all(&self) -> Vec<Arc<RequestState>> {
        let running: Vec<Arc<RequestState>> = {
            let mut r = self.requests.lock().unwrap_or_else(|p| p.into_inner());
            r.closed = true;
            r.running.drain().map(|(_, s)| s).collect()
        };
        for request in &running {
            request.cancel();
        }
        running
    }

    /// Waits until the cancelled requests are done (callbacks returned), then stops the
    /// reactor.
    fn close(&self, running: Vec<Arc<RequestState>>) {
        for request in &running {
            request.wait_finished();
        }
        // Files still hold the library's engine: shut its reactor down now. The executor
        // threads stop (and are joined) when the last reference to this handle goes.
        let _ = futures::executor::block_on(self.engine.shutdown());
    }

    /// Runs `task` on the executor threads.
    pub(crate) fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.executor.spawn(task);
    }

    /// Counts one completion on the eventfd.
    pub(crate) fn signal(&self) {
        if !self
            .eventfd_wanted
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return;
        }
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local to a descriptor this handle owns. The only
        // failure is EAGAIN at a counter of 2^64-2, which still leaves the fd readable.
        let _ = unsafe {
            libc::write(
                self.eventfd.as_raw_fd(),
                (&raw const one).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// The engine's eventfd: readable once any of its requests has completed since the count was
/// last read (read 8 bytes to reset it, then `gpuio_request_test` your requests). Completions
/// are counted from the first call of this function on (an engine nobody watches this way
/// saves a system call per request), so call it before starting the requests to watch. The engine
/// owns the descriptor: do not close it; it is closed by `gpuio_engine_free`. Returns -1 (with
/// the last error set) for a bad handle.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engine_eventfd(engine: *const gpuio_engine) -> i32 {
    let mut fd = -1;
    guard(|| {
        let handle = ENGINES.get(engine)?;
        handle
            .eventfd_wanted
            .store(true, std::sync::atomic::Ordering::Release);
        fd = handle.eventfd.as_raw_fd();
        Ok(())
    });
    fd
}

/// Writes which backend serves the engine and why (for example `io_uring: ...`) into `buf`
/// (NUL-terminated, at most `len` bytes). `*needed` (if not NULL) gets the bytes the full text
/// needs, NUL included; a `len` below that is `GPUIO_ERR_RANGE` with as much as fits written.
///
/// # Safety
/// `buf` points to `len` writable bytes (or is NULL with `len` 0); `needed` is NULL or
/// writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engine_backend(
    engine: *const gpuio_engine,
    buf: *mut libc::c_char,
    len: usize,
    needed: *mut usize,
) -> gpuio_status {
    guard(|| {
        let handle = ENGINES.get(engine)?;
        let info = handle.engine.backend();
        let text = if info.detail.is_empty() {
            info.name.to_string()
        } else {
            format!("{}: {}", info.name, info.detail)
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { crate::text::copy_out(&text, buf, len, needed) }
    })
}

/// What an engine created with given settings runs with on this machine
/// (filled by `gpuio_engine_sizing`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct gpuio_sizing {
    /// Bytes per piece of buffered I/O.
    pub buffered_chunk: u64,
    /// Bytes per piece of O_DIRECT, cuFile and NVMe I/O.
    pub direct_chunk: u64,
    /// Bytes of one bounce block: the larger chunk rounded up to a power of two.
    pub bounce_block: u64,
    /// Bytes of bounce memory.
    pub bounce_bytes: u64,
    /// Most pieces in the kernel at once.
    pub queue_depth: u32,
}

/// Stores in `*out` what `gpuio_engine_create(settings)` would run with on this machine (the
/// defaults are sized from its cores and memory; `gpuio_check` prints why). `settings` NULL
/// or zeroed: the defaults.
///
/// # Safety
/// `settings` is NULL or readable; `out` is NULL (an error) or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_engine_sizing(
    settings: *const gpuio_engine_settings,
    out: *mut gpuio_sizing,
) -> gpuio_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid(
                "gpuio_engine_sizing: out is a null pointer",
            ));
        }
        // SAFETY: NULL or a readable settings struct (this function's contract).
        let settings = unsafe { settings.as_ref() }.copied().unwrap_or_default();
        let sizing = builder(&settings)?.sizing();
        let sized = gpuio_sizing {
            buffered_chunk: sizing.buffered_chunk as u64,
            direct_chunk: sizing.direct_chunk as u64,
            bounce_block: sizing.block() as u64,
            bounce_bytes: sizing.bounce_bytes as u64,
            queue_depth: u32::try_from(sizing.queue_depth).unwrap_or(u32::MAX),
        };
        // SAFETY: checked non-null; writable by this function's contract.
        unsafe { *out = sized };
        Ok(())
    })
}
