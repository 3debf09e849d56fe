//! Raw UCX (ucp) symbols, loaded at run time.
//!
//! gpuio builds and runs without UCX, so nothing links against it: [`load`] opens `libucp.so.0`
//! (from `GPUIO_UCX_DIR` where set) with `RTLD_NOW | RTLD_GLOBAL`, which UCX's own module
//! loader needs to find its transports (`ucx/libuct_*.so` beside libucs), and `libucs.so.0`
//! from the same directory for `ucs_status_string`.
//!
//! # Layouts
//! The structures below are UCX 1.13's (`ucp/api/ucp.h`, `ucp_def.h`), field for field. UCX
//! keeps its ABI by *appending* fields to these structures and naming the valid ones in a
//! `field_mask` (`op_attr_mask` for request parameters); 1.22 (the CUDA-enabled UCX of the GPU
//! machines) has the same offsets for every 1.13 field and only adds fields at the end
//! (`ucp_params_t.node_local_id`, `ucp_context_attr_t.device_counter_size`,
//! `ucp_mem_map_params_t.exported_memh_buffer`, `ucp_request_param_t.remote_*`). gpuio sets
//! no mask bit past 1.13's, so UCX never reads or writes beyond these declarations. The tests
//! at the end pin the offsets, which were printed with `offsetof` by a C program compiled
//! against both versions' headers.
//!
//! Every value that comes *from* UCX and is a C enum is a plain integer here: a newer UCX may
//! return one gpuio does not know. `ucs_status_t` is declared `__attribute__((packed))` in
//! `ucs/type/status.h`, so it is **one byte** (`i8`) in every signature and callback.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};

use libloading::Library;
use libloading::os::unix::{Library as UnixLibrary, RTLD_GLOBAL, RTLD_NOW};

/// `ucs_status_t`: a packed enum, one signed byte.
pub(crate) type Status = i8;
/// `ucs_status_ptr_t`: a request pointer, `NULL` (`UCS_OK`) or an error code cast to a pointer.
pub(crate) type StatusPtr = *mut c_void;
/// `ucp_context_h`.
pub(crate) type RawContext = *mut c_void;
/// `ucp_config_t *`.
pub(crate) type RawConfig = *mut c_void;
/// `ucp_worker_h`.
pub(crate) type RawWorker = *mut c_void;
/// `ucp_ep_h`.
pub(crate) type RawEp = *mut c_void;
/// `ucp_mem_h`.
pub(crate) type RawMem = *mut c_void;
/// `ucp_rkey_h`.
pub(crate) type RawRkey = *mut c_void;
/// `ucp_address_t *`.
pub(crate) type RawAddress = *mut c_void;

// ---- ucs_status_t values gpuio looks at (ucs/type/status.h).
/// `UCS_OK`.
pub(crate) const UCS_OK: Status = 0;
/// `UCS_INPROGRESS`.
pub(crate) const UCS_INPROGRESS: Status = 1;
/// `UCS_ERR_INVALID_PARAM`.
pub(crate) const UCS_ERR_INVALID_PARAM: Status = -5;
/// `UCS_ERR_UNSUPPORTED`.
pub(crate) const UCS_ERR_UNSUPPORTED: Status = -22;
/// `UCS_ERR_BUSY`.
pub(crate) const UCS_ERR_BUSY: Status = -15;
/// `UCS_ERR_CANCELED`.
pub(crate) const UCS_ERR_CANCELED: Status = -16;
/// `UCS_ERR_LAST`: error codes are above it; `UCS_PTR_IS_ERR` compares against it.
pub(crate) const UCS_ERR_LAST: isize = -100;

// ---- ucp_params_t.field_mask and features (ucp.h).
pub(crate) const UCP_PARAM_FIELD_FEATURES: u64 = 1 << 0;
pub(crate) const UCP_PARAM_FIELD_MT_WORKERS_SHARED: u64 = 1 << 5;
pub(crate) const UCP_FEATURE_RMA: u64 = 1 << 1;
pub(crate) const UCP_FEATURE_WAKEUP: u64 = 1 << 4;
pub(crate) const UCP_FEATURE_AM: u64 = 1 << 6;

// ---- ucp_context_attr_t.field_mask.
pub(crate) const UCP_ATTR_FIELD_MEMORY_TYPES: u64 = 1 << 2;

// ---- ucs_memory_type_t (ucs/memory/memory_type.h).
pub(crate) const UCS_MEMORY_TYPE_HOST: c_uint = 0;
pub(crate) const UCS_MEMORY_TYPE_CUDA: c_uint = 1;

// ---- ucs_thread_mode_t.
pub(crate) const UCS_THREAD_MODE_SINGLE: c_uint = 0;

// ---- ucp_worker_params_t.field_mask and wake-up events (ucp_def.h).
pub(crate) const UCP_WORKER_PARAM_FIELD_THREAD_MODE: u64 = 1 << 0;
pub(crate) const UCP_WORKER_PARAM_FIELD_EVENTS: u64 = 1 << 2;
pub(crate) const UCP_WAKEUP_RMA: c_uint = 1 << 0;
pub(crate) const UCP_WAKEUP_TX: c_uint = 1 << 10;
pub(crate) const UCP_WAKEUP_RX: c_uint = 1 << 11;

// ---- ucp_mem_map_params_t.field_mask.
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_LENGTH: u64 = 1 << 1;
pub(crate) const UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE: u64 = 1 << 4;

// ---- ucp_ep_params_t.field_mask and error handling.
pub(crate) const UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: u64 = 1 << 0;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: u64 = 1 << 1;
pub(crate) const UCP_EP_PARAM_FIELD_ERR_HANDLER: u64 = 1 << 2;
/// `UCP_ERR_HANDLING_MODE_PEER`.
pub(crate) const UCP_ERR_HANDLING_MODE_PEER: c_uint = 1;
/// `UCP_EP_CLOSE_FLAG_FORCE`.
pub(crate) const UCP_EP_CLOSE_FLAG_FORCE: u32 = 1 << 0;

// ---- ucp_request_param_t.op_attr_mask.
pub(crate) const UCP_OP_ATTR_FIELD_FLAGS: u32 = 1 << 4;

// ---- Active messages.
pub(crate) const UCP_AM_HANDLER_PARAM_FIELD_ID: u64 = 1 << 0;
pub(crate) const UCP_AM_HANDLER_PARAM_FIELD_FLAGS: u64 = 1 << 1;
pub(crate) const UCP_AM_HANDLER_PARAM_FIELD_CB: u64 = 1 << 2;
pub(crate) const UCP_AM_HANDLER_PARAM_FIELD_ARG: u64 = 1 << 3;
/// `UCP_AM_FLAG_WHOLE_MSG`: the handler sees each message in one call.
pub(crate) const UCP_AM_FLAG_WHOLE_MSG: u32 = 1 << 0;
/// `UCP_AM_SEND_FLAG_EAGER`.
pub(crate) const UCP_AM_SEND_FLAG_EAGER: u32 = 1 << 1;
/// `UCP_AM_SEND_FLAG_COPY_HEADER`: not in 1.13's header (1.22 has it); passed only to
/// libraries that know it.
pub(crate) const UCP_AM_SEND_FLAG_COPY_HEADER: u32 = 1 << 3;
/// `UCP_AM_RECV_ATTR_FLAG_RNDV` in `ucp_am_recv_param_t.recv_attr`.
pub(crate) const UCP_AM_RECV_ATTR_FLAG_RNDV: u64 = 1 << 17;

/// `UCP_ENTITY_NAME_MAX`.
pub(crate) const ENTITY_NAME_MAX: usize = 32;

/// `ucp_params_t` (1.13).
#[repr(C)]
pub(crate) struct RawParams {
    pub(crate) field_mask: u64,
    pub(crate) features: u64,
    pub(crate) request_size: usize,
    pub(crate) request_init: Option<unsafe extern "C" fn(*mut c_void)>,
    pub(crate) request_cleanup: Option<unsafe extern "C" fn(*mut c_void)>,
    pub(crate) tag_sender_mask: u64,
    pub(crate) mt_workers_shared: c_int,
    pub(crate) estimated_num_eps: usize,
    pub(crate) estimated_num_ppn: usize,
    pub(crate) name: *const c_char,
}

/// `ucp_context_attr_t` (1.13).
#[repr(C)]
pub(crate) struct RawContextAttr {
    pub(crate) field_mask: u64,
    pub(crate) request_size: usize,
    pub(crate) thread_mode: c_uint,
    pub(crate) memory_types: u64,
    pub(crate) name: [c_char; ENTITY_NAME_MAX],
}

/// `ucs_cpu_set_t`: 1024 bits.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawCpuSet {
    pub(crate) ucs_bits: [u64; 16],
}

/// `ucp_worker_params_t` (1.13).
#[repr(C)]
pub(crate) struct RawWorkerParams {
    pub(crate) field_mask: u64,
    pub(crate) thread_mode: c_uint,
    pub(crate) cpu_mask: RawCpuSet,
    pub(crate) events: c_uint,
    pub(crate) user_data: *mut c_void,
    pub(crate) event_fd: c_int,
    pub(crate) flags: u64,
    pub(crate) name: *const c_char,
    pub(crate) am_alignment: usize,
    pub(crate) client_id: u64,
}

/// `ucp_mem_map_params_t` (1.13).
#[repr(C)]
pub(crate) struct RawMemMapParams {
    pub(crate) field_mask: u64,
    pub(crate) address: *mut c_void,
    pub(crate) length: usize,
    pub(crate) flags: c_uint,
    pub(crate) prot: c_uint,
    pub(crate) memory_type: c_uint,
}

/// `ucp_err_handler_cb_t`.
pub(crate) type ErrHandlerCb = unsafe extern "C" fn(arg: *mut c_void, ep: RawEp, status: Status);

/// `ucp_err_handler_t`.
#[repr(C)]
pub(crate) struct RawErrHandler {
    pub(crate) cb: Option<ErrHandlerCb>,
    pub(crate) arg: *mut c_void,
}

/// `ucs_sock_addr_t`.
#[repr(C)]
pub(crate) struct RawSockAddr {
    pub(crate) addr: *const c_void,
    pub(crate) addrlen: u32,
}

/// `ucp_ep_params_t` (1.13).
#[repr(C)]
pub(crate) struct RawEpParams {
    pub(crate) field_mask: u64,
    pub(crate) address: *const c_void,
    pub(crate) err_mode: c_uint,
    pub(crate) err_handler: RawErrHandler,
    pub(crate) user_data: *mut c_void,
    pub(crate) flags: c_uint,
    pub(crate) sockaddr: RawSockAddr,
    pub(crate) conn_request: *mut c_void,
    pub(crate) name: *const c_char,
    pub(crate) local_sockaddr: RawSockAddr,
}

/// `ucp_request_param_t` (1.13). gpuio passes no callback, request, datatype or memory handle:
/// requests are polled with `ucp_request_check_status`.
#[repr(C)]
pub(crate) struct RawRequestParam {
    pub(crate) op_attr_mask: u32,
    pub(crate) flags: u32,
    pub(crate) request: *mut c_void,
    /// The callback union: all members are function pointers.
    pub(crate) cb: *mut c_void,
    /// `ucp_datatype_t`.
    pub(crate) datatype: u64,
    pub(crate) user_data: *mut c_void,
    pub(crate) reply_buffer: *mut c_void,
    pub(crate) memory_type: c_uint,
    /// The `recv_info` union: two pointers.
    pub(crate) recv_info: *mut c_void,
    pub(crate) memh: RawMem,
}

/// `ucp_am_recv_param_t`.
#[repr(C)]
pub(crate) struct RawAmRecvParam {
    pub(crate) recv_attr: u64,
    pub(crate) reply_ep: RawEp,
}

/// `ucp_am_recv_callback_t`.
pub(crate) type AmRecvCb = unsafe extern "C" fn(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const RawAmRecvParam,
) -> Status;

/// `ucp_am_handler_param_t`.
#[repr(C)]
pub(crate) struct RawAmHandlerParam {
    pub(crate) field_mask: u64,
    pub(crate) id: c_uint,
    pub(crate) flags: u32,
    pub(crate) cb: Option<AmRecvCb>,
    pub(crate) arg: *mut c_void,
}

impl RawParams {
    pub(crate) fn zeroed() -> Self {
        RawParams {
            field_mask: 0,
            features: 0,
            request_size: 0,
            request_init: None,
            request_cleanup: None,
            tag_sender_mask: 0,
            mt_workers_shared: 0,
            estimated_num_eps: 0,
            estimated_num_ppn: 0,
            name: std::ptr::null(),
        }
    }
}

impl RawContextAttr {
    pub(crate) fn zeroed() -> Self {
        RawContextAttr {
            field_mask: 0,
            request_size: 0,
            thread_mode: 0,
            memory_types: 0,
            name: [0; ENTITY_NAME_MAX],
        }
    }
}

impl RawWorkerParams {
    pub(crate) fn zeroed() -> Self {
        RawWorkerParams {
            field_mask: 0,
            thread_mode: 0,
            cpu_mask: RawCpuSet { ucs_bits: [0; 16] },
            events: 0,
            user_data: std::ptr::null_mut(),
            event_fd: -1,
            flags: 0,
            name: std::ptr::null(),
            am_alignment: 0,
            client_id: 0,
        }
    }
}

impl RawEpParams {
    pub(crate) fn zeroed() -> Self {
        RawEpParams {
            field_mask: 0,
            address: std::ptr::null(),
            err_mode: 0,
            err_handler: RawErrHandler {
                cb: None,
                arg: std::ptr::null_mut(),
            },
            user_data: std::ptr::null_mut(),
            flags: 0,
            sockaddr: RawSockAddr {
                addr: std::ptr::null(),
                addrlen: 0,
            },
            conn_request: std::ptr::null_mut(),
            name: std::ptr::null(),
            local_sockaddr: RawSockAddr {
                addr: std::ptr::null(),
                addrlen: 0,
            },
        }
    }
}

impl RawRequestParam {
    /// No fields, no flags.
    pub(crate) fn empty() -> Self {
        RawRequestParam {
            op_attr_mask: 0,
            flags: 0,
            request: std::ptr::null_mut(),
            cb: std::ptr::null_mut(),
            datatype: 0,
            user_data: std::ptr::null_mut(),
            reply_buffer: std::ptr::null_mut(),
            memory_type: 0,
            recv_info: std::ptr::null_mut(),
            memh: std::ptr::null_mut(),
        }
    }

    /// Only operation-specific `flags`.
    pub(crate) fn with_flags(flags: u32) -> Self {
        RawRequestParam {
            op_attr_mask: UCP_OP_ATTR_FIELD_FLAGS,
            flags,
            ..Self::empty()
        }
    }
}

macro_rules! symbols {
    ($( $name:ident : fn($($arg:ty),*) $(-> $ret:ty)? ;)*) => {
        /// The ucp entry points gpuio uses, resolved once, with `ucs_status_string` from
        /// libucs.
        pub(crate) struct UcpFns {
            $( pub(crate) $name: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            pub(crate) ucs_status_string: unsafe extern "C" fn(Status) -> *const c_char,
            /// The path libucp was loaded from (as the dynamic loader resolved it).
            pub(crate) path: PathBuf,
            _ucp: Library,
            _ucs: Library,
        }

        impl UcpFns {
            fn resolve(ucp: Library, ucs: Library, path: PathBuf) -> Result<Self, String> {
                // SAFETY: each symbol is declared with its C signature in UCX 1.13's ucp.h and
                // ucs/type/status.h (unchanged in 1.22; `ucs_status_t` is one byte); the
                // libraries stay loaded as long as the pointers, because they move into the
                // struct that holds them.
                unsafe {
                    Ok(UcpFns {
                        $( $name: *ucp
                            .get(concat!(stringify!($name), "\0").as_bytes())
                            .map_err(|e| format!("{}: missing {}: {e}", path.display(), stringify!($name)))?, )*
                        ucs_status_string: *ucs
                            .get(b"ucs_status_string\0")
                            .map_err(|e| format!("libucs: missing ucs_status_string: {e}"))?,
                        path,
                        _ucp: ucp,
                        _ucs: ucs,
                    })
                }
            }
        }
    };
}

symbols! {
    ucp_get_version: fn(*mut c_uint, *mut c_uint, *mut c_uint);
    ucp_get_version_string: fn() -> *const c_char;
    ucp_config_read: fn(*const c_char, *const c_char, *mut RawConfig) -> Status;
    ucp_config_release: fn(RawConfig);
    ucp_config_modify: fn(RawConfig, *const c_char, *const c_char) -> Status;
    ucp_init_version: fn(c_uint, c_uint, *const RawParams, RawConfig, *mut RawContext) -> Status;
    ucp_cleanup: fn(RawContext);
    ucp_context_query: fn(RawContext, *mut RawContextAttr) -> Status;
    ucp_mem_map: fn(RawContext, *const RawMemMapParams, *mut RawMem) -> Status;
    ucp_mem_unmap: fn(RawContext, RawMem) -> Status;
    ucp_rkey_pack: fn(RawContext, RawMem, *mut *mut c_void, *mut usize) -> Status;
    ucp_rkey_buffer_release: fn(*mut c_void);
    ucp_ep_rkey_unpack: fn(RawEp, *const c_void, *mut RawRkey) -> Status;
    ucp_rkey_destroy: fn(RawRkey);
    ucp_worker_create: fn(RawContext, *const RawWorkerParams, *mut RawWorker) -> Status;
    ucp_worker_destroy: fn(RawWorker);
    ucp_worker_get_address: fn(RawWorker, *mut RawAddress, *mut usize) -> Status;
    ucp_worker_release_address: fn(RawWorker, RawAddress);
    ucp_worker_progress: fn(RawWorker) -> c_uint;
    ucp_worker_get_efd: fn(RawWorker, *mut c_int) -> Status;
    ucp_worker_arm: fn(RawWorker) -> Status;
    ucp_worker_set_am_recv_handler: fn(RawWorker, *const RawAmHandlerParam) -> Status;
    ucp_ep_create: fn(RawWorker, *const RawEpParams, *mut RawEp) -> Status;
    ucp_ep_close_nbx: fn(RawEp, *const RawRequestParam) -> StatusPtr;
    ucp_ep_flush_nbx: fn(RawEp, *const RawRequestParam) -> StatusPtr;
    ucp_ep_print_info: fn(RawEp, *mut libc::FILE);
    ucp_put_nbx: fn(RawEp, *const c_void, usize, u64, RawRkey, *const RawRequestParam) -> StatusPtr;
    ucp_get_nbx: fn(RawEp, *mut c_void, usize, u64, RawRkey, *const RawRequestParam) -> StatusPtr;
    ucp_am_send_nbx: fn(RawEp, c_uint, *const c_void, usize, *const c_void, usize, *const RawRequestParam) -> StatusPtr;
    ucp_request_check_status: fn(*mut c_void) -> Status;
    ucp_request_free: fn(*mut c_void);
    ucp_request_cancel: fn(RawWorker, *mut c_void);
}

// SAFETY: function pointers and library handles. Which UCX object may be used from which
// thread is decided by the safe tier (a context is created thread-shared; workers, endpoints
// and requests are confined to one thread), not by this table.
unsafe impl Send for UcpFns {}
// SAFETY: as above.
unsafe impl Sync for UcpFns {}

/// The environment variable naming a directory that holds `libucp.so.0` (and libucs beside
/// it), such as the lib directory of the `libucx-cu13` wheel.
pub(crate) const DIR_ENV: &str = "GPUIO_UCX_DIR";

/// Opens `name` with `RTLD_NOW | RTLD_GLOBAL`.
fn open(name: &Path) -> Result<Library, String> {
    // SAFETY: loading UCX runs its constructors, which initialise UCX's global state (logging,
    // memory hooks in libucm, module lists) and need nothing from the caller.
    unsafe { UnixLibrary::open(Some(name), RTLD_NOW | RTLD_GLOBAL) }
        .map(Library::from)
        .map_err(|e| e.to_string())
}

/// The file an already-loaded symbol lives in, as the dynamic loader names it.
fn file_of(sym: *const c_void) -> Option<PathBuf> {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: `info` is writable; dladdr only inspects the loader's tables.
    let found = unsafe { libc::dladdr(sym, &mut info) } != 0;
    if !found || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, valid while the
    // object stays loaded (it does: the caller holds it).
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(name.to_string_lossy().into_owned()))
}

/// Loads libucp (and libucs beside it) and resolves the symbols: `$GPUIO_UCX_DIR/libucp.so.0`
/// where that is set, else `libucp.so.0`, else `libucp.so` from the loader's search path.
pub(crate) fn load() -> Result<UcpFns, String> {
    let dir = std::env::var_os(DIR_ENV).map(PathBuf::from);
    let candidates: Vec<PathBuf> = match &dir {
        Some(d) => vec![d.join("libucp.so.0")],
        None => vec![PathBuf::from("libucp.so.0"), PathBuf::from("libucp.so")],
    };
    let mut errors = Vec::new();
    let mut loaded = None;
    for c in &candidates {
        match open(c) {
            Ok(lib) => {
                loaded = Some((lib, c.clone()));
                break;
            }
            Err(e) => errors.push(e),
        }
    }
    let Some((ucp, asked)) = loaded else {
        return Err(format!(
            "UCX (libucp.so.0) not found: install libucx0 (Debian/Ubuntu) or point {DIR_ENV} \
             at a UCX lib directory, e.g. the libucx-cu13 wheel's ({})",
            errors.join("; ")
        ));
    };
    // SAFETY: `ucp_get_version` is a function in libucp; only its address is taken here.
    let probe: *const c_void = unsafe {
        ucp.get::<unsafe extern "C" fn()>(b"ucp_get_version\0")
            .map(|s| *s as *const c_void)
            .map_err(|e| format!("{}: missing ucp_get_version: {e}", asked.display()))?
    };
    let path = file_of(probe).unwrap_or(asked);
    // libucs from the directory libucp came from (the dynamic loader already has it: libucp
    // needs it, so this opens the same object); by soname where the directory is unknown.
    let ucs_path = match (&dir, path.parent()) {
        (Some(d), _) => d.join("libucs.so.0"),
        (None, Some(p)) if p.is_absolute() => p.join("libucs.so.0"),
        _ => PathBuf::from("libucs.so.0"),
    };
    let ucs = open(&ucs_path)
        .or_else(|first| open(Path::new("libucs.so.0")).map_err(|_| first))
        .map_err(|e| format!("libucs.so.0 (beside {}): {e}", path.display()))?;
    UcpFns::resolve(ucp, ucs, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Offsets printed by `offsetof` from UCX 1.13's headers (Debian's libucx-dev) and 1.22's
    /// (the libucx-cu13 wheel): identical for every field declared here; 1.22's structures are
    /// longer only by fields appended after these.
    #[test]
    fn layouts_match_ucx_1_13_and_1_22() {
        assert_eq!(size_of::<RawParams>(), 80);
        assert_eq!(offset_of!(RawParams, features), 8);
        assert_eq!(offset_of!(RawParams, mt_workers_shared), 48);
        assert_eq!(offset_of!(RawParams, name), 72);

        assert_eq!(size_of::<RawContextAttr>(), 64);
        assert_eq!(offset_of!(RawContextAttr, thread_mode), 16);
        assert_eq!(offset_of!(RawContextAttr, memory_types), 24);
        assert_eq!(offset_of!(RawContextAttr, name), 32);

        assert_eq!(size_of::<RawWorkerParams>(), 200);
        assert_eq!(offset_of!(RawWorkerParams, thread_mode), 8);
        assert_eq!(offset_of!(RawWorkerParams, cpu_mask), 16);
        assert_eq!(offset_of!(RawWorkerParams, events), 144);
        assert_eq!(offset_of!(RawWorkerParams, user_data), 152);
        assert_eq!(offset_of!(RawWorkerParams, event_fd), 160);
        assert_eq!(offset_of!(RawWorkerParams, flags), 168);
        assert_eq!(offset_of!(RawWorkerParams, client_id), 192);

        assert_eq!(size_of::<RawMemMapParams>(), 40);
        assert_eq!(offset_of!(RawMemMapParams, address), 8);
        assert_eq!(offset_of!(RawMemMapParams, length), 16);
        assert_eq!(offset_of!(RawMemMapParams, flags), 24);
        assert_eq!(offset_of!(RawMemMapParams, prot), 28);
        assert_eq!(offset_of!(RawMemMapParams, memory_type), 32);

        assert_eq!(size_of::<RawRequestParam>(), 72);
        assert_eq!(offset_of!(RawRequestParam, flags), 4);
        assert_eq!(offset_of!(RawRequestParam, request), 8);
        assert_eq!(offset_of!(RawRequestParam, cb), 16);
        assert_eq!(offset_of!(RawRequestParam, datatype), 24);
        assert_eq!(offset_of!(RawRequestParam, memory_type), 48);
        assert_eq!(offset_of!(RawRequestParam, recv_info), 56);
        assert_eq!(offset_of!(RawRequestParam, memh), 64);

        assert_eq!(size_of::<RawAmHandlerParam>(), 32);
        assert_eq!(offset_of!(RawAmHandlerParam, id), 8);
        assert_eq!(offset_of!(RawAmHandlerParam, flags), 12);
        assert_eq!(offset_of!(RawAmHandlerParam, cb), 16);
        assert_eq!(offset_of!(RawAmHandlerParam, arg), 24);

        assert_eq!(size_of::<RawAmRecvParam>(), 16);
        assert_eq!(offset_of!(RawAmRecvParam, reply_ep), 8);

        assert_eq!(size_of::<RawEpParams>(), 104);
        assert_eq!(offset_of!(RawEpParams, address), 8);
        assert_eq!(offset_of!(RawEpParams, err_mode), 16);
        assert_eq!(offset_of!(RawEpParams, err_handler), 24);
        assert_eq!(offset_of!(RawEpParams, user_data), 40);
        assert_eq!(offset_of!(RawEpParams, flags), 48);
        assert_eq!(offset_of!(RawEpParams, sockaddr), 56);
        assert_eq!(offset_of!(RawEpParams, conn_request), 72);
        assert_eq!(offset_of!(RawEpParams, name), 80);
        assert_eq!(offset_of!(RawEpParams, local_sockaddr), 88);

        assert_eq!(size_of::<Status>(), 1);
    }
}
