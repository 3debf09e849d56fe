//! Raw cuFile symbols, loaded at run time.
//!
//! cudarc ships cuFile bindings, but its loader panics when the library is missing and does
//! not try the runtime soname `libcufile.so.0` (the only name the CUDA runtime packages
//! install), and its bindings return Rust enums, which would be undefined behaviour for any
//! status code a newer libcufile adds. So gpuio loads the library itself with libloading and
//! declares every value that comes *from* cuFile as a plain integer. The struct layouts match
//! cudarc's (`cudarc::cufile::sys`), checked by the tests below.

use std::ffi::{c_int, c_uint, c_void};

use libloading::Library;

/// `CUfileHandle_t`.
pub(crate) type RawHandle = *mut c_void;
/// `CUfileBatchHandle_t`.
pub(crate) type RawBatch = *mut c_void;
/// `CUstream`.
pub(crate) type RawStream = *mut c_void;

/// `CUfileError_t`: a cuFile status (`CUfileOpError`) and, for 5011, the CUDA result.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawError {
    pub(crate) err: c_int,
    pub(crate) cu_err: c_int,
}

/// `CU_FILE_HANDLE_TYPE_OPAQUE_FD`.
pub(crate) const HANDLE_TYPE_FD: c_uint = 1;
/// `CUFILE_BATCH`.
pub(crate) const BATCH_MODE: c_uint = 1;
/// `CUFILE_READ` / `CUFILE_WRITE`.
pub(crate) const OP_READ: c_uint = 0;
pub(crate) const OP_WRITE: c_uint = 1;

/// `CUfileStatus_t` values.
pub(crate) const STATUS_INVALID: c_uint = 4;
pub(crate) const STATUS_CANCELED: c_uint = 8;
pub(crate) const STATUS_COMPLETE: c_uint = 16;
pub(crate) const STATUS_TIMEOUT: c_uint = 32;
pub(crate) const STATUS_FAILED: c_uint = 64;

/// `CUfileDescr_t`.
#[repr(C)]
pub(crate) struct RawDescr {
    pub(crate) kind: c_uint,
    /// The union `{ int fd; void *handle; }`, as the wider member.
    pub(crate) handle: usize,
    pub(crate) fs_ops: *const c_void,
}

/// `CUfileIOParams_t` (batch mode).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawIoParams {
    pub(crate) mode: c_uint,
    pub(crate) dev_ptr_base: *mut c_void,
    pub(crate) file_offset: i64,
    pub(crate) dev_ptr_offset: i64,
    pub(crate) size: usize,
    pub(crate) fh: RawHandle,
    pub(crate) opcode: c_uint,
    pub(crate) cookie: *mut c_void,
}

/// `CUfileIOEvents_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawIoEvent {
    pub(crate) cookie: *mut c_void,
    pub(crate) status: c_uint,
    pub(crate) ret: usize,
}

impl RawIoEvent {
    pub(crate) const EMPTY: RawIoEvent = RawIoEvent {
        cookie: std::ptr::null_mut(),
        status: 0,
        ret: 0,
    };
}

macro_rules! symbols {
    ($( $(#[$m:meta])* $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// The cuFile entry points gpuio uses, resolved once.
        #[allow(non_snake_case)]
        pub(crate) struct CufileLib {
            $( $(#[$m])* pub(crate) $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            pub(crate) cuFileGetVersion: Option<unsafe extern "C" fn(*mut c_int) -> RawError>,
            pub(crate) soname: String,
            _lib: Library,
        }

        impl CufileLib {
            fn resolve(lib: Library, soname: String) -> Result<Self, String> {
                // SAFETY: each symbol is declared with the C signature of cufile.h (CUDA 12/13);
                // the library stays loaded for as long as the pointers (it is moved into the
                // struct that holds them).
                unsafe {
                    Ok(CufileLib {
                        $( $name: *lib
                            .get(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|e| format!("{soname}: missing {}: {e}", stringify!($name)))?, )*
                        cuFileGetVersion: lib.get(b"cuFileGetVersion\0").ok().map(|s| *s),
                        soname,
                        _lib: lib,
                    })
                }
            }
        }
    };
}

symbols! {
    cuFileDriverOpen: fn() -> RawError;
    cuFileHandleRegister: fn(*mut RawHandle, *mut RawDescr) -> RawError;
    cuFileHandleDeregister: fn(RawHandle);
    cuFileBufRegister: fn(*const c_void, usize, c_int) -> RawError;
    cuFileBufDeregister: fn(*const c_void) -> RawError;
    cuFileBatchIOSetUp: fn(*mut RawBatch, c_uint) -> RawError;
    cuFileBatchIOSubmit: fn(RawBatch, c_uint, *mut RawIoParams, c_uint) -> RawError;
    cuFileBatchIOGetStatus: fn(RawBatch, c_uint, *mut c_uint, *mut RawIoEvent, *mut libc::timespec) -> RawError;
    cuFileBatchIOCancel: fn(RawBatch) -> RawError;
    cuFileBatchIODestroy: fn(RawBatch);
    cuFileReadAsync: fn(RawHandle, *mut c_void, *mut usize, *mut i64, *mut i64, *mut isize, RawStream) -> RawError;
    cuFileWriteAsync: fn(RawHandle, *mut c_void, *mut usize, *mut i64, *mut i64, *mut isize, RawStream) -> RawError;
}

// SAFETY: function pointers and a loaded library handle; cuFile's API is thread-safe.
unsafe impl Send for CufileLib {}
// SAFETY: as above.
unsafe impl Sync for CufileLib {}

/// Sonames to try, the runtime one first.
const CANDIDATES: &[&str] = &["libcufile.so.0", "libcufile.so", "libcufile.so.1"];

/// Loads libcufile and resolves its symbols.
pub(crate) fn load() -> Result<CufileLib, String> {
    let mut errors = Vec::new();
    for name in CANDIDATES {
        // SAFETY: loading libcufile runs its initialisers, which need nothing from us.
        match unsafe { Library::new(*name) } {
            Ok(lib) => return CufileLib::resolve(lib, (*name).to_string()),
            Err(e) => errors.push(format!("{name}: {e}")),
        }
    }
    Err(format!("libcufile not found ({})", errors.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::cufile::sys as cu;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn layouts_match_cudarc() {
        assert_eq!(size_of::<RawDescr>(), size_of::<cu::CUfileDescr_t>());
        assert_eq!(size_of::<RawIoParams>(), size_of::<cu::CUfileIOParams_t>());
        assert_eq!(
            align_of::<RawIoParams>(),
            align_of::<cu::CUfileIOParams_t>()
        );
        assert_eq!(
            offset_of!(RawIoParams, fh),
            offset_of!(cu::CUfileIOParams_t, fh)
        );
        assert_eq!(
            offset_of!(RawIoParams, cookie),
            offset_of!(cu::CUfileIOParams_t, cookie)
        );
        assert_eq!(size_of::<RawIoEvent>(), size_of::<cu::CUfileIOEvents_t>());
        assert_eq!(
            offset_of!(RawIoEvent, ret),
            offset_of!(cu::CUfileIOEvents_t, ret)
        );
        assert_eq!(size_of::<RawError>(), size_of::<cu::CUfileError_t>());
        assert_eq!(cu::CUfileStatus_t::CUFILE_COMPLETE as u32, STATUS_COMPLETE);
        assert_eq!(cu::CUfileStatus_t::CUFILE_FAILED as u32, STATUS_FAILED);
        assert_eq!(cu::CUfileOpcode_t::CUFILE_WRITE as u32, OP_WRITE);
    }
}
