//! Checked wrappers over [`super::sys`]: every ucp call gpuio makes, each turning UCX's status
//! into a `Result` here and nowhere else. Callers above this tier (the safe types in
//! [`super`]) keep the preconditions; these functions only check.

use std::ffi::{CStr, c_int, c_uint, c_void};
use std::fmt;
use std::path::PathBuf;

use super::sys::{
    self, RawAddress, RawAmHandlerParam, RawConfig, RawContext, RawContextAttr, RawEp, RawEpParams,
    RawMem, RawMemMapParams, RawParams, RawRequestParam, RawRkey, RawWorker, RawWorkerParams,
    Status, StatusPtr, UcpFns,
};

/// A failed UCX call: its `ucs_status_t`, the call, and UCX's words for the status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct UcsError {
    /// The `ucs_status_t` (negative).
    pub(crate) status: i32,
    /// The UCX function that returned it.
    pub(crate) call: &'static str,
    /// `ucs_status_string(status)`, or what gpuio found wrong before calling UCX.
    pub(crate) message: String,
}

impl fmt::Display for UcsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} ({})", self.call, self.message, self.status)
    }
}

impl std::error::Error for UcsError {}

/// `UCS_PTR_IS_ERR`: an error code cast to a pointer (`-100 <= p < 0` as a signed value).
pub(crate) fn ptr_is_err(p: StatusPtr) -> bool {
    (p as usize) >= (sys::UCS_ERR_LAST as usize)
}

/// `UCS_PTR_IS_PTR`: neither `NULL` (`UCS_OK`) nor an error code.
pub(crate) fn ptr_is_ptr(p: StatusPtr) -> bool {
    (p as usize).wrapping_sub(1) < (sys::UCS_ERR_LAST as usize).wrapping_sub(1)
}

/// `UCS_PTR_STATUS`: `UCS_INPROGRESS` for a request, else the code the pointer carries.
pub(crate) fn ptr_status(p: StatusPtr) -> Status {
    if ptr_is_ptr(p) {
        sys::UCS_INPROGRESS
    } else {
        p as isize as Status
    }
}

/// What a non-blocking (`_nbx`) call returned.
#[derive(Debug)]
pub(crate) enum Started {
    /// Completed in place (`UCS_OK`).
    Done,
    /// In progress: a request to poll with [`UcxLib::request_check_status`] and free once.
    Request(*mut c_void),
}

/// The loaded library, its version, and the checked calls.
pub(crate) struct UcxLib {
    pub(crate) lib: UcpFns,
    /// `major.minor.release`.
    pub(crate) version: (u32, u32, u32),
    /// `ucp_get_version_string()`.
    pub(crate) version_string: String,
}

/// The oldest UCX whose layouts and calls gpuio's bindings were checked against.
pub(crate) const MIN_VERSION: (u32, u32) = (1, 13);
/// The API version gpuio asks `ucp_init_version` for.
const API_VERSION: (c_uint, c_uint) = (1, 13);

/// UCX settings gpuio changes from UCX's defaults, each only where the environment does not set
/// it (`UCX_<name>` wins).
///
/// `RNDV_THRESH=inf`: gpuio sends only small active messages (notifications), so rendezvous
/// buys it nothing, and with rendezvous enabled UCX (1.16 and later) asks for memory
/// invalidation from every high-bandwidth lane of an endpoint with peer-failure handling. CMA
/// has none, so host memory between two processes fell back to get/put emulated over TCP
/// (0.56 GB/s for 64 x 16 MiB on this machine with UCX 1.22, 3.09 GB/s with the setting).
const CONFIG_DEFAULTS: [(&CStr, &CStr); 1] = [(c"RNDV_THRESH", c"inf")];

impl UcxLib {
    /// Loads the library (see [`sys::load`]) and refuses versions older than
    /// [`MIN_VERSION`].
    pub(crate) fn load() -> Result<UcxLib, String> {
        let lib = sys::load()?;
        let (mut major, mut minor, mut release) = (0, 0, 0);
        // SAFETY: ucp_get_version writes three unsigned ints through valid pointers.
        unsafe { (lib.ucp_get_version)(&mut major, &mut minor, &mut release) };
        // SAFETY: ucp_get_version_string takes nothing and returns a static string.
        let p = unsafe { (lib.ucp_get_version_string)() };
        let version_string = if p.is_null() {
            format!("{major}.{minor}.{release}")
        } else {
            // SAFETY: a NUL-terminated static string inside libucp.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        };
        if (major, minor) < MIN_VERSION {
            return Err(format!(
                "{} is UCX {version_string}; gpuio needs UCX {}.{} or newer",
                lib.path.display(),
                MIN_VERSION.0,
                MIN_VERSION.1
            ));
        }
        Ok(UcxLib {
            lib,
            version: (major, minor, release),
            version_string,
        })
    }

    /// Where libucp was loaded from.
    pub(crate) fn path(&self) -> &PathBuf {
        &self.lib.path
    }

    /// `ucs_status_string`.
    pub(crate) fn status_string(&self, status: Status) -> String {
        // SAFETY: ucs_status_string takes any status and returns a static string (UCX says
        // "Unknown error" for codes it does not know).
        let p = unsafe { (self.lib.ucs_status_string)(status) };
        if p.is_null() {
            return "unknown status".into();
        }
        // SAFETY: a NUL-terminated static string inside libucs.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// The error for `status` returned by `call`.
    pub(crate) fn error(&self, call: &'static str, status: Status) -> UcsError {
        UcsError {
            status: status.into(),
            call,
            message: self.status_string(status),
        }
    }

    fn check(&self, call: &'static str, status: Status) -> Result<(), UcsError> {
        if status == sys::UCS_OK {
            Ok(())
        } else {
            Err(self.error(call, status))
        }
    }

    fn started(&self, call: &'static str, p: StatusPtr) -> Result<Started, UcsError> {
        if p.is_null() {
            Ok(Started::Done)
        } else if ptr_is_err(p) {
            Err(self.error(call, ptr_status(p)))
        } else {
            Ok(Started::Request(p))
        }
    }

    // ---- Context.

    /// `ucp_config_read` + `ucp_init_version` + `ucp_config_release`: a context with the UCX
    /// configuration from the environment (`UCX_*`).
    pub(crate) fn init(&self, params: &RawParams) -> Result<RawContext, UcsError> {
        let mut config: RawConfig = std::ptr::null_mut();
        // SAFETY: NULL prefix and file mean "UCX_" and no file; `config` is writable.
        self.check("ucp_config_read", unsafe {
            (self.lib.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut config)
        })?;
        for (name, value) in CONFIG_DEFAULTS {
            if std::env::var_os(format!("UCX_{}", name.to_str().unwrap_or_default())).is_some() {
                continue;
            }
            // SAFETY: `config` came from ucp_config_read and is live; both strings are
            // NUL-terminated and outlive the call (UCX copies the value).
            let status =
                unsafe { (self.lib.ucp_config_modify)(config, name.as_ptr(), value.as_ptr()) };
            if status != sys::UCS_OK {
                // An older UCX without the setting keeps its own default; nothing breaks.
                tracing::debug!(
                    "ucp_config_modify({name:?}, {value:?}): {}",
                    self.status_string(status)
                );
            }
        }
        let mut ctx: RawContext = std::ptr::null_mut();
        // SAFETY: `params` is a 1.13 ucp_params_t whose mask names only fields it sets;
        // `config` came from ucp_config_read; `ctx` is writable.
        let status = unsafe {
            (self.lib.ucp_init_version)(API_VERSION.0, API_VERSION.1, params, config, &mut ctx)
        };
        // SAFETY: `config` came from ucp_config_read and is released once; the context keeps
        // its own copy of the settings.
        unsafe { (self.lib.ucp_config_release)(config) };
        self.check("ucp_init", status)?;
        Ok(ctx)
    }

    /// `ucp_cleanup`.
    ///
    /// # Safety
    /// `ctx` came from [`init`](Self::init), is cleaned up once, and has no workers or memory
    /// mappings left.
    pub(crate) unsafe fn cleanup(&self, ctx: RawContext) {
        // SAFETY: the caller's promise.
        unsafe { (self.lib.ucp_cleanup)(ctx) }
    }

    /// `ucp_context_query` for the fields `attr.field_mask` names.
    ///
    /// # Safety
    /// `ctx` is a live context.
    pub(crate) unsafe fn context_query(
        &self,
        ctx: RawContext,
        attr: &mut RawContextAttr,
    ) -> Result<(), UcsError> {
        // SAFETY: `attr` is a writable 1.13 ucp_context_attr_t; the context is the caller's.
        self.check("ucp_context_query", unsafe {
            (self.lib.ucp_context_query)(ctx, attr)
        })
    }

    /// `ucp_mem_map`.
    ///
    /// # Safety
    /// `ctx` is a live context; the range `params` names is memory of the type it names and
    /// stays allocated until [`mem_unmap`](Self::mem_unmap), and longer while a peer may still
    /// reach it.
    pub(crate) unsafe fn mem_map(
        &self,
        ctx: RawContext,
        params: &RawMemMapParams,
    ) -> Result<RawMem, UcsError> {
        let mut memh: RawMem = std::ptr::null_mut();
        // SAFETY: the caller's promise; `memh` is writable.
        self.check("ucp_mem_map", unsafe {
            (self.lib.ucp_mem_map)(ctx, params, &mut memh)
        })?;
        Ok(memh)
    }

    /// `ucp_mem_unmap`.
    ///
    /// # Safety
    /// `memh` was mapped on `ctx` and is unmapped once.
    pub(crate) unsafe fn mem_unmap(&self, ctx: RawContext, memh: RawMem) -> Result<(), UcsError> {
        // SAFETY: the caller's promise.
        self.check("ucp_mem_unmap", unsafe {
            (self.lib.ucp_mem_unmap)(ctx, memh)
        })
    }

    /// `ucp_rkey_pack`, copied out and released.
    ///
    /// # Safety
    /// `memh` is a live mapping on `ctx`.
    pub(crate) unsafe fn rkey_pack(
        &self,
        ctx: RawContext,
        memh: RawMem,
    ) -> Result<Vec<u8>, UcsError> {
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the caller's promise; `buf` and `len` are writable.
        self.check("ucp_rkey_pack", unsafe {
            (self.lib.ucp_rkey_pack)(ctx, memh, &mut buf, &mut len)
        })?;
        let bytes = if buf.is_null() {
            Vec::new()
        } else {
            // SAFETY: UCX returned `len` bytes at `buf`, ours until released below.
            unsafe { std::slice::from_raw_parts(buf as *const u8, len) }.to_vec()
        };
        if !buf.is_null() {
            // SAFETY: `buf` came from ucp_rkey_pack and is released once.
            unsafe { (self.lib.ucp_rkey_buffer_release)(buf) };
        }
        Ok(bytes)
    }

    // ---- Worker.

    /// `ucp_worker_create`.
    ///
    /// # Safety
    /// `ctx` is a live context that outlives the worker.
    pub(crate) unsafe fn worker_create(
        &self,
        ctx: RawContext,
        params: &RawWorkerParams,
    ) -> Result<RawWorker, UcsError> {
        let mut w: RawWorker = std::ptr::null_mut();
        // SAFETY: `params` is a 1.13 ucp_worker_params_t whose mask names only fields it sets;
        // the context is the caller's promise; `w` is writable.
        self.check("ucp_worker_create", unsafe {
            (self.lib.ucp_worker_create)(ctx, params, &mut w)
        })?;
        Ok(w)
    }

    /// `ucp_worker_destroy`.
    ///
    /// # Safety
    /// `w` is a live worker, destroyed once, on the thread that uses it.
    pub(crate) unsafe fn worker_destroy(&self, w: RawWorker) {
        // SAFETY: the caller's promise.
        unsafe { (self.lib.ucp_worker_destroy)(w) }
    }

    /// `ucp_worker_get_address`, copied out and released.
    ///
    /// # Safety
    /// `w` is a live worker, used from this thread only.
    pub(crate) unsafe fn worker_address(&self, w: RawWorker) -> Result<Vec<u8>, UcsError> {
        let mut addr: RawAddress = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the caller's promise; `addr` and `len` are writable.
        self.check("ucp_worker_get_address", unsafe {
            (self.lib.ucp_worker_get_address)(w, &mut addr, &mut len)
        })?;
        // SAFETY: UCX returned `len` bytes at `addr`, ours until released below.
        let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec();
        // SAFETY: `addr` came from ucp_worker_get_address on `w` and is released once.
        unsafe { (self.lib.ucp_worker_release_address)(w, addr) };
        Ok(bytes)
    }

    /// `ucp_worker_progress`: the number of events it handled.
    ///
    /// # Safety
    /// `w` is a live worker, used from this thread only, and this is not called from inside one
    /// of its callbacks.
    pub(crate) unsafe fn worker_progress(&self, w: RawWorker) -> u32 {
        // SAFETY: the caller's promise.
        unsafe { (self.lib.ucp_worker_progress)(w) }
    }

    /// `ucp_worker_get_efd`.
    ///
    /// # Safety
    /// `w` is a live worker of a context created with `UCP_FEATURE_WAKEUP`.
    pub(crate) unsafe fn worker_efd(&self, w: RawWorker) -> Result<c_int, UcsError> {
        let mut fd: c_int = -1;
        // SAFETY: the caller's promise; `fd` is writable.
        self.check("ucp_worker_get_efd", unsafe {
            (self.lib.ucp_worker_get_efd)(w, &mut fd)
        })?;
        Ok(fd)
    }

    /// `ucp_worker_arm`: `Ok(true)` armed, `Ok(false)` for `UCS_ERR_BUSY` (events are pending:
    /// progress again before sleeping).
    ///
    /// # Safety
    /// As [`worker_efd`](Self::worker_efd).
    pub(crate) unsafe fn worker_arm(&self, w: RawWorker) -> Result<bool, UcsError> {
        // SAFETY: the caller's promise.
        match unsafe { (self.lib.ucp_worker_arm)(w) } {
            sys::UCS_OK => Ok(true),
            sys::UCS_ERR_BUSY => Ok(false),
            s => Err(self.error("ucp_worker_arm", s)),
        }
    }

    /// `ucp_worker_set_am_recv_handler`.
    ///
    /// # Safety
    /// `w` is a live worker used from this thread only; the callback and its argument stay
    /// valid until the handler is replaced, cleared or the worker destroyed.
    pub(crate) unsafe fn set_am_recv_handler(
        &self,
        w: RawWorker,
        param: &RawAmHandlerParam,
    ) -> Result<(), UcsError> {
        // SAFETY: the caller's promise; `param` is a valid 1.13 ucp_am_handler_param_t.
        self.check("ucp_worker_set_am_recv_handler", unsafe {
            (self.lib.ucp_worker_set_am_recv_handler)(w, param)
        })
    }

    /// `ucp_request_check_status`.
    ///
    /// # Safety
    /// `req` is a request of a live worker, not yet freed, used from the worker's thread.
    pub(crate) unsafe fn request_check_status(&self, req: *mut c_void) -> Status {
        // SAFETY: the caller's promise.
        unsafe { (self.lib.ucp_request_check_status)(req) }
    }

    /// `ucp_request_free`: releases the request now, or when it completes if it is still in
    /// progress (the memory it uses must stay valid until then).
    ///
    /// # Safety
    /// As [`request_check_status`](Self::request_check_status); `req` is freed once.
    pub(crate) unsafe fn request_free(&self, req: *mut c_void) {
        // SAFETY: the caller's promise.
        unsafe { (self.lib.ucp_request_free)(req) }
    }

    /// `ucp_request_cancel`.
    ///
    /// # Safety
    /// `req` is a live request of the live worker `w`, used from the worker's thread.
    pub(crate) unsafe fn request_cancel(&self, w: RawWorker, req: *mut c_void) {
        // SAFETY: the caller's promise.
        unsafe { (self.lib.ucp_request_cancel)(w, req) }
    }

    // ---- Endpoints.

    /// `ucp_ep_create`.
    ///
    /// # Safety
    /// `w` is a live worker used from this thread only; `params.address` points to a worker
    /// address UCX can parse (it takes no length); the error handler's argument stays valid
    /// until the endpoint is closed and its close has completed.
    pub(crate) unsafe fn ep_create(
        &self,
        w: RawWorker,
        params: &RawEpParams,
    ) -> Result<RawEp, UcsError> {
        let mut ep: RawEp = std::ptr::null_mut();
        // SAFETY: the caller's promise; `ep` is writable.
        self.check("ucp_ep_create", unsafe {
            (self.lib.ucp_ep_create)(w, params, &mut ep)
        })?;
        Ok(ep)
    }

    /// `ucp_ep_close_nbx` with `flags` (`UCP_EP_CLOSE_FLAG_FORCE`).
    ///
    /// # Safety
    /// `ep` is a live endpoint, closed once, with no remote keys left; it is unusable
    /// afterwards, whatever this returns.
    pub(crate) unsafe fn ep_close(&self, ep: RawEp, flags: u32) -> Result<Started, UcsError> {
        let param = RawRequestParam::with_flags(flags);
        // SAFETY: the caller's promise; `param` names only `flags`.
        let p = unsafe { (self.lib.ucp_ep_close_nbx)(ep, &param) };
        self.started("ucp_ep_close_nbx", p)
    }

    /// `ucp_ep_flush_nbx`.
    ///
    /// # Safety
    /// `ep` is a live endpoint used from its worker's thread.
    pub(crate) unsafe fn ep_flush(&self, ep: RawEp) -> Result<Started, UcsError> {
        let param = RawRequestParam::empty();
        // SAFETY: the caller's promise; `param` names no field.
        let p = unsafe { (self.lib.ucp_ep_flush_nbx)(ep, &param) };
        self.started("ucp_ep_flush_nbx", p)
    }

    /// `ucp_ep_print_info` into a string.
    ///
    /// # Safety
    /// `ep` is a live endpoint used from its worker's thread.
    pub(crate) unsafe fn ep_info(&self, ep: RawEp) -> String {
        let mut buf: *mut libc::c_char = std::ptr::null_mut();
        let mut len: libc::size_t = 0;
        // SAFETY: open_memstream with writable out-pointers; the stream is closed below.
        let f = unsafe { libc::open_memstream(&mut buf, &mut len) };
        if f.is_null() {
            return String::new();
        }
        // SAFETY: `ep` is the caller's promise; `f` is an open stream.
        unsafe { (self.lib.ucp_ep_print_info)(ep, f) };
        // SAFETY: `f` is open and closed once; afterwards `buf` holds `len` bytes (malloc'ed).
        unsafe { libc::fclose(f) };
        if buf.is_null() {
            return String::new();
        }
        // SAFETY: after fclose, `buf` holds `len` bytes plus a NUL, owned by us.
        let s = unsafe { std::slice::from_raw_parts(buf as *const u8, len) };
        let text = String::from_utf8_lossy(s).into_owned();
        // SAFETY: open_memstream's buffer is malloc'ed and ours to free, once.
        unsafe { libc::free(buf.cast()) };
        text
    }

    /// `ucp_ep_rkey_unpack`.
    ///
    /// # Safety
    /// `ep` is a live endpoint used from its worker's thread; `buf` points to a packed remote
    /// key UCX can parse (it takes no length).
    pub(crate) unsafe fn rkey_unpack(
        &self,
        ep: RawEp,
        buf: *const c_void,
    ) -> Result<RawRkey, UcsError> {
        let mut rkey: RawRkey = std::ptr::null_mut();
        // SAFETY: the caller's promise; `rkey` is writable.
        self.check("ucp_ep_rkey_unpack", unsafe {
            (self.lib.ucp_ep_rkey_unpack)(ep, buf, &mut rkey)
        })?;
        Ok(rkey)
    }

    /// `ucp_rkey_destroy`.
    ///
    /// # Safety
    /// `rkey` came from [`rkey_unpack`](Self::rkey_unpack), is destroyed once, no operation
    /// using it is outstanding, and its endpoint is still open.
    pub(crate) unsafe fn rkey_destroy(&self, rkey: RawRkey) {
        // SAFETY: the caller's promise.
        unsafe { (self.lib.ucp_rkey_destroy)(rkey) }
    }

    /// `ucp_put_nbx` of `len` bytes at `local` to `remote` (no callback).
    ///
    /// # Safety
    /// `ep` is a live endpoint used from its worker's thread; `rkey` was unpacked on it and
    /// stays alive until the operation completes; `local` is readable for `len` bytes until
    /// then.
    pub(crate) unsafe fn put(
        &self,
        ep: RawEp,
        local: *const c_void,
        len: usize,
        remote: u64,
        rkey: RawRkey,
    ) -> Result<Started, UcsError> {
        let param = RawRequestParam::empty();
        // SAFETY: the caller's promise; `param` names no field (contiguous bytes, no callback).
        let p = unsafe { (self.lib.ucp_put_nbx)(ep, local, len, remote, rkey, &param) };
        self.started("ucp_put_nbx", p)
    }

    /// `ucp_get_nbx` of `len` bytes from `remote` into `local` (no callback).
    ///
    /// # Safety
    /// As [`put`](Self::put), with `local` writable (and not otherwise accessed) until the
    /// operation completes.
    pub(crate) unsafe fn get(
        &self,
        ep: RawEp,
        local: *mut c_void,
        len: usize,
        remote: u64,
        rkey: RawRkey,
    ) -> Result<Started, UcsError> {
        let param = RawRequestParam::empty();
        // SAFETY: the caller's promise; `param` names no field.
        let p = unsafe { (self.lib.ucp_get_nbx)(ep, local, len, remote, rkey, &param) };
        self.started("ucp_get_nbx", p)
    }

    /// `ucp_am_send_nbx` with operation `flags` (no callback).
    ///
    /// # Safety
    /// `ep` is a live endpoint used from its worker's thread; `header` and `data` are readable
    /// for their lengths until the operation completes (the header only until this returns
    /// where `flags` has `UCP_AM_SEND_FLAG_COPY_HEADER` and the library knows it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn am_send(
        &self,
        ep: RawEp,
        id: u16,
        header: *const c_void,
        header_len: usize,
        data: *const c_void,
        data_len: usize,
        flags: u32,
    ) -> Result<Started, UcsError> {
        let param = RawRequestParam::with_flags(flags);
        // SAFETY: the caller's promise; `param` names only `flags`.
        let p = unsafe {
            (self.lib.ucp_am_send_nbx)(
                ep,
                c_uint::from(id),
                header,
                header_len,
                data,
                data_len,
                &param,
            )
        };
        self.started("ucp_am_send_nbx", p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_pointer_macros() {
        let null: StatusPtr = std::ptr::null_mut();
        assert!(!ptr_is_err(null));
        assert!(!ptr_is_ptr(null));
        assert_eq!(ptr_status(null), sys::UCS_OK);

        for code in [-1isize, -6, -16, -100] {
            let p = code as StatusPtr;
            assert!(ptr_is_err(p), "{code}");
            assert!(!ptr_is_ptr(p), "{code}");
            assert_eq!(ptr_status(p) as isize, code);
        }
        // Below UCS_ERR_LAST is a pointer (in the top of the address space), not an error.
        let p = -101isize as StatusPtr;
        assert!(!ptr_is_err(p));
        assert!(ptr_is_ptr(p));

        let mut x = 0u64;
        let p: StatusPtr = (&raw mut x).cast();
        assert!(!ptr_is_err(p));
        assert!(ptr_is_ptr(p));
        assert_eq!(ptr_status(p), sys::UCS_INPROGRESS);
    }

    #[test]
    fn error_display() {
        let e = UcsError {
            status: -6,
            call: "ucp_ep_create",
            message: "Destination is unreachable".into(),
        };
        assert_eq!(
            e.to_string(),
            "ucp_ep_create: Destination is unreachable (-6)"
        );
    }
}
