//! GPUDirect Storage through cuFile: the probe behind `Backend::Auto`, file handle and buffer
//! registration, batch I/O driven by the reactor, and stream-ordered reads and writes.
//!
//! # When cuFile serves a file
//! [`Backend::Auto`](crate::Backend::Auto) tries cuFile per file, for device-memory transfers
//! only: where libcufile loads, a CUDA device exists, and `cuFileHandleRegister` accepts an
//! O_DIRECT descriptor of the file. Otherwise the file is served by the bounce path and the
//! reason is logged once (`tracing`) and kept ([`File::gds_status`](crate::File::gds_status)).
//! A cuFile error that means "not here" (handle not registered, internal error, registration
//! failures) turns the file over to the bounce path at run time, again saying so once; the
//! read that hit it is finished there, not failed. [`Backend::Gds`](crate::Backend::Gds)
//! forces cuFile and reports those errors instead.
//!
//! Without the nvidia-fs kernel module cuFile runs in *compatibility mode* (POSIX I/O on the
//! O_DIRECT descriptor, through its own host buffers). gpuio reports that as `cufile-compat`,
//! never as GPUDirect, and AUTO then keeps the bounce path: it does the same work faster
//! (BENCHMARKS.md: 4 KiB random reads 0.70x, cold 4 MiB 0.97x, warm 0.08x through cuFile).
//! [`EngineBuilder::cufile_compat`](crate::EngineBuilder::cufile_compat) lets AUTO use it for
//! files opened with `direct` (never for buffered files: it would trade page-cache hits for
//! disk reads).
//!
//! # Soundness
//! cuFile batch I/O is not ordered on a CUDA stream, so it only ever targets the reactor's
//! device staging pool (`DeviceStagingPool`); the future's `poll` copies staged data into
//! the caller's memory on its stream, with the same argument as host bounce slots
//! (see [`crate::cuda`]). Stream-ordered reads (`cuFileReadAsync`) write the caller's memory
//! directly, but only as work queued on a stream, like a kernel launch, with cudarc's event
//! recorded behind it; their size/offset/result parameters live in the reactor until the
//! stream has passed them.

pub(crate) mod batch;
pub(crate) mod handle;
pub(crate) mod lane;
pub(crate) mod pool;
pub(crate) mod result;
pub(crate) mod sys;

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

pub use pool::RegisteredBuffer;

/// How a file is served for device memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GdsStatus {
    /// cuFile with true GPUDirect DMA (nvidia-fs loaded).
    Gds,
    /// cuFile in compatibility mode: POSIX I/O inside cuFile, no peer-to-peer DMA.
    CufileCompat,
    /// The bounce path, and why cuFile does not serve this file.
    Bounce(String),
}

impl GdsStatus {
    /// Short name: `gds`, `cufile-compat` or `bounce`.
    pub fn name(&self) -> &'static str {
        match self {
            GdsStatus::Gds => "gds",
            GdsStatus::CufileCompat => "cufile-compat",
            GdsStatus::Bounce(_) => "bounce",
        }
    }
}

impl GdsStatus {
    /// The backend name error contexts carry for transfers served this way.
    pub(crate) fn backend_name(&self) -> &'static str {
        match self {
            GdsStatus::Gds => "cufile",
            GdsStatus::CufileCompat => "cufile-compat",
            GdsStatus::Bounce(_) => "bounce",
        }
    }
}

impl std::fmt::Display for GdsStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GdsStatus::Bounce(why) => write!(f, "bounce ({why})"),
            other => f.write_str(other.name()),
        }
    }
}

/// A file's cuFile registration and whether it still serves.
pub(crate) struct FileGds {
    pub(crate) handle: handle::GdsHandle,
    /// Alignment cuFile pieces are planned on.
    pub(crate) align: u64,
    compat: bool,
    forced: bool,
    broken: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl FileGds {
    pub(crate) fn new(handle: handle::GdsHandle, align: u64, forced: bool) -> Self {
        FileGds {
            handle,
            align,
            compat: !result::nvidia_fs_loaded(),
            forced,
            broken: AtomicBool::new(false),
            reason: Mutex::new(None),
        }
    }

    /// Whether new device transfers should use cuFile.
    pub(crate) fn serves(&self) -> bool {
        !self.broken.load(Ordering::Acquire)
    }

    /// Whether errors must be reported instead of falling back (`Backend::Gds`).
    pub(crate) fn forced(&self) -> bool {
        self.forced
    }

    /// Turns the file over to the bounce path; says so once.
    pub(crate) fn fall_back(&self, path: &std::path::Path, reason: String) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            tracing::warn!(path = %path.display(), %reason, "cuFile failed; gpuio serves this file through the bounce path from now on");
            *self.reason.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason);
        }
    }

    pub(crate) fn status(&self) -> GdsStatus {
        if let Some(r) = self
            .reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return GdsStatus::Bounce(r);
        }
        if self.compat {
            GdsStatus::CufileCompat
        } else {
            GdsStatus::Gds
        }
    }
}

/// What `gpuio check` reports about cuFile on this machine.
#[derive(Debug, Clone)]
pub struct GdsProbe {
    /// The library that loaded and its version (`major.minor`), or why none did.
    pub library: Result<String, String>,
    /// Whether `cuFileDriverOpen` succeeded (or why not).
    pub driver: Result<(), String>,
    /// Whether the nvidia-fs kernel module is loaded (true GPUDirect DMA).
    pub nvidia_fs: bool,
    /// Whether `/run/udev/data` is readable (cuFile reads filesystem types from it).
    pub udev_data: bool,
}

/// Looks for libcufile, opens its driver (once per process) and checks the platform pieces.
pub fn probe() -> GdsProbe {
    let library = sys::load().map(|l| match result::version(&l) {
        Some(v) => format!("{} (version {}.{})", l.soname, v / 1000, (v % 1000) / 10),
        None => l.soname.clone(),
    });
    let driver = result::cufile().map(|_| ());
    GdsProbe {
        library,
        driver,
        nvidia_fs: result::nvidia_fs_loaded(),
        udev_data: std::fs::read_dir("/run/udev/data").is_ok(),
    }
}

/// Registers `path` (through a fresh O_DIRECT descriptor) the way `Backend::Auto` would, and
/// says what serves it. For `gpuio check PATH`.
pub fn check_file(path: &std::path::Path) -> GdsStatus {
    use std::os::unix::fs::OpenOptionsExt;
    let fd = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => std::os::fd::OwnedFd::from(f),
        Err(e) => return GdsStatus::Bounce(format!("cannot open with O_DIRECT: {e}")),
    };
    match handle::GdsHandle::register(fd) {
        Ok(h) => FileGds::new(h, 4096, false).status(),
        Err(e) => GdsStatus::Bounce(e.to_string()),
    }
}
