//! Checked wrappers over [`super::sys`]: the process-wide cuFile driver and its error codes.

use std::sync::OnceLock;

use super::sys::{CufileLib, RawError};

/// A cuFile status code with its name, as cuFile reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CufileCode {
    pub(crate) err: i32,
    pub(crate) cu_err: i32,
}

impl CufileCode {
    pub(crate) fn name(&self) -> &'static str {
        code_name(self.err)
    }

    /// Errors that mean "this file or buffer cannot use cuFile here": AUTO falls back to the
    /// bounce path on them instead of failing the read.
    pub(crate) fn calls_for_fallback(&self) -> bool {
        matches!(
            self.err,
            5007..=5009 | 5013 | 5016..=5020 | 5024 | 5027 | 5029 | 5030 | 5031 | 5033 | 5034
        )
    }
}

impl std::fmt::Display for CufileCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.err)?;
        if self.err == 5011 {
            write!(f, ", CUresult {}", self.cu_err)?;
        }
        Ok(())
    }
}

/// Name of a `CUfileOpError` value (cufile.h).
pub(crate) fn code_name(err: i32) -> &'static str {
    match err {
        0 => "CU_FILE_SUCCESS",
        5001 => "CU_FILE_DRIVER_NOT_INITIALIZED",
        5002 => "CU_FILE_DRIVER_INVALID_PROPS",
        5003 => "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
        5004 => "CU_FILE_DRIVER_VERSION_MISMATCH",
        5005 => "CU_FILE_DRIVER_VERSION_READ_ERROR",
        5006 => "CU_FILE_DRIVER_CLOSING",
        5007 => "CU_FILE_PLATFORM_NOT_SUPPORTED",
        5008 => "CU_FILE_IO_NOT_SUPPORTED",
        5009 => "CU_FILE_DEVICE_NOT_SUPPORTED",
        5010 => "CU_FILE_NVFS_DRIVER_ERROR",
        5011 => "CU_FILE_CUDA_DRIVER_ERROR",
        5012 => "CU_FILE_CUDA_POINTER_INVALID",
        5013 => "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
        5014 => "CU_FILE_CUDA_POINTER_RANGE_ERROR",
        5015 => "CU_FILE_CUDA_CONTEXT_MISMATCH",
        5016 => "CU_FILE_INVALID_MAPPING_SIZE",
        5017 => "CU_FILE_INVALID_MAPPING_RANGE",
        5018 => "CU_FILE_INVALID_FILE_TYPE",
        5019 => "CU_FILE_INVALID_FILE_OPEN_FLAG",
        5020 => "CU_FILE_DIO_NOT_SET",
        5022 => "CU_FILE_INVALID_VALUE",
        5023 => "CU_FILE_MEMORY_ALREADY_REGISTERED",
        5024 => "CU_FILE_MEMORY_NOT_REGISTERED",
        5025 => "CU_FILE_PERMISSION_DENIED",
        5026 => "CU_FILE_DRIVER_ALREADY_OPEN",
        5027 => "CU_FILE_HANDLE_NOT_REGISTERED",
        5028 => "CU_FILE_HANDLE_ALREADY_REGISTERED",
        5029 => "CU_FILE_DEVICE_NOT_FOUND",
        5030 => "CU_FILE_INTERNAL_ERROR",
        5031 => "CU_FILE_GETNEWFD_FAILED",
        5033 => "CU_FILE_NVFS_SETUP_ERROR",
        5034 => "CU_FILE_IO_DISABLED",
        5035 => "CU_FILE_BATCH_SUBMIT_FAILED",
        5036 => "CU_FILE_GPU_MEMORY_PINNING_FAILED",
        5037 => "CU_FILE_BATCH_FULL",
        5038 => "CU_FILE_ASYNC_NOT_SUPPORTED",
        5048 => "CU_FILE_GPU_MEMORY_REGISTRATION_FAILED",
        _ => "unknown cuFile status",
    }
}

/// `Ok` for `CU_FILE_SUCCESS`, else the code.
pub(crate) fn check(e: RawError) -> Result<(), CufileCode> {
    if e.err == 0 {
        Ok(())
    } else {
        Err(CufileCode {
            err: e.err,
            cu_err: e.cu_err,
        })
    }
}

/// The library's version (`cuFileGetVersion`, 1000 × major + 10 × minor), where it has the
/// call (older libraries do not).
pub(crate) fn version(lib: &CufileLib) -> Option<i32> {
    let f = lib.cuFileGetVersion?;
    let mut v = 0;
    // SAFETY: cuFileGetVersion(int*) with a valid int; it needs no open driver.
    check(unsafe { f(&mut v) }).ok().map(|_| v)
}

/// The loaded library with its driver open. cuFile fails I/O that runs while its driver
/// closes, and gpuio cannot know when the last user in the process is done, so the driver is
/// opened once per process and never closed (the OS tears it down at exit).
pub(crate) struct Cufile {
    pub(crate) lib: CufileLib,
}

/// The process-wide cuFile driver, opened on first use; `Err` says why it is unusable (the
/// same answer every time).
pub(crate) fn cufile() -> Result<&'static Cufile, String> {
    static DRIVER: OnceLock<Result<Cufile, String>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            if !crate::cuda::available() {
                return Err(format!(
                    "no usable CUDA device ({})",
                    crate::cuda::probe()
                        .error
                        .unwrap_or_else(|| "none found".into())
                ));
            }
            let lib = super::sys::load()?;
            // SAFETY: cuFileDriverOpen takes no arguments; it is safe to call at any time.
            check(unsafe { (lib.cuFileDriverOpen)() })
                .or_else(|c| if c.err == 5026 { Ok(()) } else { Err(c) })
                .map_err(|c| format!("cuFileDriverOpen failed: {c}"))?;
            Ok(Cufile { lib })
        })
        .as_ref()
        .map_err(|e| e.clone())
}

/// Whether the nvidia-fs kernel module (true GPUDirect DMA) is loaded. Without it cuFile runs
/// in compatibility mode: POSIX I/O through its own host bounce buffers.
pub(crate) fn nvidia_fs_loaded() -> bool {
    std::path::Path::new("/proc/driver/nvidia-fs/version").exists()
        || std::path::Path::new("/sys/module/nvidia_fs").exists()
}

// ---- Calls: every cuFile entry point the library uses, each checked here and nowhere else.
// Callers above this tier (handles, pools, the batch queue, stream-ordered I/O) keep the
// preconditions; these functions only turn cuFile's status into a `Result`.

use std::ffi::{c_uint, c_void};
use std::os::fd::RawFd;

use super::sys::{HANDLE_TYPE_FD, RawBatch, RawDescr, RawHandle, RawIoEvent, RawIoParams};

impl Cufile {
    /// `cuFileHandleRegister` for an open descriptor.
    ///
    /// # Safety
    /// `fd` must stay open until [`handle_deregister`](Self::handle_deregister) of the handle
    /// returned.
    pub(crate) unsafe fn handle_register(&self, fd: RawFd) -> Result<RawHandle, CufileCode> {
        let mut descr = RawDescr {
            kind: HANDLE_TYPE_FD,
            handle: fd as usize,
            fs_ops: std::ptr::null(),
        };
        let mut raw: RawHandle = std::ptr::null_mut();
        // SAFETY: `descr` and `raw` are valid for the call; the descriptor's lifetime is the
        // caller's promise.
        check(unsafe { (self.lib.cuFileHandleRegister)(&mut raw, &mut descr) })?;
        Ok(raw)
    }

    /// `cuFileHandleDeregister`.
    ///
    /// # Safety
    /// `raw` came from [`handle_register`](Self::handle_register), is deregistered once, and
    /// no I/O uses it any more.
    pub(crate) unsafe fn handle_deregister(&self, raw: RawHandle) {
        // SAFETY: the caller's promise.
        unsafe { (self.lib.cuFileHandleDeregister)(raw) }
    }

    /// `cuFileBufRegister` for `len` bytes of device memory at `base`.
    ///
    /// # Safety
    /// `[base, base + len)` is device memory that stays allocated until
    /// [`buf_deregister`](Self::buf_deregister).
    pub(crate) unsafe fn buf_register(&self, base: u64, len: usize) -> Result<(), CufileCode> {
        // SAFETY: the caller's promise.
        check(unsafe { (self.lib.cuFileBufRegister)(base as *const c_void, len, 0) })
    }

    /// `cuFileBufDeregister`.
    ///
    /// # Safety
    /// `base` was registered by [`buf_register`](Self::buf_register), and no I/O into it is
    /// outstanding.
    pub(crate) unsafe fn buf_deregister(&self, base: u64) -> Result<(), CufileCode> {
        // SAFETY: the caller's promise.
        check(unsafe { (self.lib.cuFileBufDeregister)(base as *const c_void) })
    }

    /// `cuFileBatchIOSetUp` for up to `max` entries per submission.
    pub(crate) fn batch_setup(&self, max: u32) -> Result<RawBatch, CufileCode> {
        let mut raw: RawBatch = std::ptr::null_mut();
        // SAFETY: `raw` is writable; cuFile checks `max` against its own limit.
        check(unsafe { (self.lib.cuFileBatchIOSetUp)(&mut raw, max as c_uint) })?;
        Ok(raw)
    }

    /// `cuFileBatchIOSubmit` of every entry in `params`.
    ///
    /// # Safety
    /// `raw` is a batch handle with no submission outstanding; each entry's file handle is
    /// registered and its device range registered memory, both kept until the entry completes.
    pub(crate) unsafe fn batch_submit(
        &self,
        raw: RawBatch,
        params: &mut [RawIoParams],
    ) -> Result<(), CufileCode> {
        let n = params.len() as c_uint;
        // SAFETY: `params` holds `n` entries; the rest is the caller's promise.
        check(unsafe { (self.lib.cuFileBatchIOSubmit)(raw, n, params.as_mut_ptr(), 0) })
    }

    /// `cuFileBatchIOGetStatus` without waiting (`min_nr` 0, zero timeout): the number of
    /// events written to the front of `events`.
    ///
    /// # Safety
    /// `raw` is a live batch handle with a submission outstanding.
    pub(crate) unsafe fn batch_status(
        &self,
        raw: RawBatch,
        events: &mut [RawIoEvent],
    ) -> Result<usize, CufileCode> {
        let mut nr = events.len() as c_uint;
        let mut zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `events` has room for `nr` events; a zero timeout returns at once; the
        // handle is the caller's promise.
        let rc = unsafe {
            (self.lib.cuFileBatchIOGetStatus)(raw, 0, &mut nr, events.as_mut_ptr(), &mut zero)
        };
        check(rc)?;
        Ok((nr as usize).min(events.len()))
    }

    /// `cuFileBatchIOCancel`.
    ///
    /// # Safety
    /// `raw` is a live batch handle.
    pub(crate) unsafe fn batch_cancel(&self, raw: RawBatch) -> Result<(), CufileCode> {
        // SAFETY: the caller's promise.
        check(unsafe { (self.lib.cuFileBatchIOCancel)(raw) })
    }

    /// `cuFileBatchIODestroy`.
    ///
    /// # Safety
    /// `raw` is a batch handle with nothing outstanding, destroyed once.
    pub(crate) unsafe fn batch_destroy(&self, raw: RawBatch) {
        // SAFETY: the caller's promise.
        unsafe { (self.lib.cuFileBatchIODestroy)(raw) }
    }

    /// `cuFileReadAsync` or `cuFileWriteAsync` (`write`) on `stream`, with its parameters in
    /// the block at `params`.
    ///
    /// # Safety
    /// `handle` is registered and kept until the stream has passed the operation; `dptr` is
    /// device memory valid for `params.size` bytes until then; `params` points to a block that
    /// lives (unmoved) until then too.
    pub(crate) unsafe fn stream_io(
        &self,
        write: bool,
        handle: RawHandle,
        dptr: u64,
        params: *mut StreamParams,
        stream: super::sys::RawStream,
    ) -> Result<(), CufileCode> {
        let f = if write {
            self.lib.cuFileWriteAsync
        } else {
            self.lib.cuFileReadAsync
        };
        // SAFETY: the caller's promise; the field pointers lie inside the block.
        check(unsafe {
            f(
                handle,
                dptr as *mut c_void,
                &raw mut (*params).size,
                &raw mut (*params).file_offset,
                &raw mut (*params).buf_offset,
                &raw mut (*params).bytes_done,
                stream,
            )
        })
    }
}

/// The parameter block of a stream-ordered cuFile read or write: cuFile reads the sizes and
/// writes `bytes_done` when the stream reaches the operation, so the block must outlive it.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct StreamParams {
    pub(crate) size: usize,
    pub(crate) file_offset: i64,
    pub(crate) buf_offset: i64,
    pub(crate) bytes_done: isize,
}
