//! UCX (ucp), loaded at run time: the transport under agents (`src/agent/`).
//!
//! Three tiers, as for cuFile and SPDK: `sys` declares the C structures and loads the
//! function table, `result` makes every call and turns its status into a
//! `Result<_, UcsError>`, and this module wraps UCX's objects in types that keep UCX's rules:
//!
//! - `Context` (`ucp_context_h`, features RMA, AM and WAKEUP, shared by workers of several
//!   threads): `Send + Sync`, behind an `Arc`; it maps memory (`MemHandle`).
//! - `Worker` (`UCS_THREAD_MODE_SINGLE`) and everything made from it — `Endpoint`,
//!   `RKey`, `Request` — share one reference-counted worker and are neither `Send` nor
//!   `Sync`: a worker and its objects live on one driver thread, which creates the worker.
//!   The reference counts give the order UCX needs whatever order the caller drops things in:
//!   a remote key keeps its endpoint open, an endpoint and a request keep the worker alive,
//!   a put or get keeps its remote key alive until it completes (a request dropped while in
//!   progress is handed to the worker and freed by a later `Worker::progress` once done).
//! - Callbacks (active-message handlers, endpoint error handlers) are boxed closures the
//!   worker owns; they are freed only outside UCX's callbacks and after UCX has let go of them.
//!
//! Requests carry no completion callback: callers poll `Request::check` after progressing
//! the worker (or sleep on `Worker::event_fd` after `Worker::arm`).

#![allow(dead_code)] // the crate-private API serves src/agent; the tests use the rest

pub(crate) mod endpoint;
pub(crate) mod result;
pub(crate) mod sys;
pub(crate) mod worker;

#[cfg(test)]
mod tests;

use std::sync::{Arc, OnceLock};

#[allow(unused_imports)] // the names src/agent uses
pub(crate) use endpoint::{Endpoint, RKey};
pub(crate) use result::{UcsError, UcxLib};
#[allow(unused_imports)]
pub(crate) use worker::{Request, Worker};

use sys::{RawContext, RawMem};

/// What `gpuio check` reports about UCX.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxInfo {
    /// UCX's version string (`ucp_get_version_string`).
    pub version: String,
    /// The libucp file that was loaded.
    pub library: String,
    /// Whether UCX handles CUDA device memory: a context reports `UCS_MEMORY_TYPE_CUDA` among
    /// its memory types (UCX built with CUDA, and the CUDA driver found).
    pub cuda: bool,
}

/// Loads UCX (once per process) and creates a context to see what it supports; the answer is
/// cached. `Err` says what is missing: UCX is looked for as `$GPUIO_UCX_DIR/libucp.so.0` where
/// that variable is set, else as `libucp.so.0` on the loader's search path.
pub fn probe() -> Result<UcxInfo, String> {
    static PROBE: OnceLock<Result<UcxInfo, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let lib = library()?;
            let ctx = Context::with_lib(lib).map_err(|e| e.to_string())?;
            Ok(UcxInfo {
                version: lib.version_string.clone(),
                library: lib.path().display().to_string(),
                cuda: ctx.supports_cuda(),
            })
        })
        .clone()
}

/// The process-wide UCX library, loaded on first use; `Err` says why it is unusable (the same
/// answer every time).
pub(crate) fn library() -> Result<&'static UcxLib, String> {
    static LIB: OnceLock<Result<UcxLib, String>> = OnceLock::new();
    LIB.get_or_init(UcxLib::load)
        .as_ref()
        .map_err(|e| e.clone())
}

/// A UCX context: features RMA, AM and WAKEUP (no tag matching, no streams), created
/// thread-shared (`mt_workers_shared`), so its memory mappings may be made and dropped on any
/// thread while workers run on theirs. Cleaned up when the last `Arc` goes, which is after
/// every worker and mapping made from it (they hold one).
pub(crate) struct Context {
    raw: RawContext,
    lib: &'static UcxLib,
    memory_types: u64,
}

// SAFETY: the context is created with `mt_workers_shared = 1`, so UCX guards its own state
// (memory mappings, key packing) with the context's lock; nothing else here is mutable.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// `ucp_init` with the UCX settings of the environment (`UCX_*`), on the process-wide
    /// library ([`library`]; where it cannot be loaded, the error says why, with status
    /// `UCS_ERR_UNSUPPORTED`). Put it in an `Arc` to map memory or create workers.
    pub(crate) fn new() -> Result<Context, UcsError> {
        let lib = library().map_err(|message| UcsError {
            status: sys::UCS_ERR_UNSUPPORTED.into(),
            call: "dlopen(libucp.so.0)",
            message,
        })?;
        Self::with_lib(lib)
    }

    /// As [`new`](Self::new), on `lib`.
    pub(crate) fn with_lib(lib: &'static UcxLib) -> Result<Context, UcsError> {
        let mut params = sys::RawParams::zeroed();
        params.field_mask = sys::UCP_PARAM_FIELD_FEATURES | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED;
        params.features = sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP;
        params.mt_workers_shared = 1;
        let raw = lib.init(&params)?;
        let mut ctx = Context {
            raw,
            lib,
            memory_types: 0,
        };
        let mut attr = sys::RawContextAttr::zeroed();
        attr.field_mask = sys::UCP_ATTR_FIELD_MEMORY_TYPES;
        // SAFETY: `raw` is the live context just created (dropping `ctx` cleans it up).
        unsafe { lib.context_query(raw, &mut attr) }?;
        ctx.memory_types = attr.memory_types;
        Ok(ctx)
    }

    /// The library this context came from.
    pub(crate) fn lib(&self) -> &'static UcxLib {
        self.lib
    }

    /// The raw handle, for workers.
    pub(crate) fn raw(&self) -> RawContext {
        self.raw
    }

    /// Whether the context handles CUDA memory (`UCS_MEMORY_TYPE_CUDA` in its memory types).
    pub(crate) fn supports_cuda(&self) -> bool {
        self.memory_types & (1 << sys::UCS_MEMORY_TYPE_CUDA) != 0
    }

    /// Maps (registers) `len` bytes at `addr` for remote access; UCX allocates nothing. Peers
    /// reach the range through the key [`MemHandle::pack_rkey`] returns.
    ///
    /// # Safety
    /// `[addr, addr + len)` is memory of type `kind` (host memory, or CUDA device memory of a
    /// device UCX can see) that stays allocated while the handle lives — and for as long after
    /// as any peer holding its key may still read or write it: unmapping need not revoke a
    /// peer's access (CMA, for one, reads and writes the target process's memory with no
    /// registration there at all), so the caller's protocol must stop peers first.
    pub(crate) unsafe fn mem_map(
        self: &Arc<Self>,
        addr: *mut u8,
        len: usize,
        kind: MemType,
    ) -> Result<MemHandle, UcsError> {
        let params = sys::RawMemMapParams {
            field_mask: sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
            address: addr.cast(),
            length: len,
            flags: 0,
            prot: 0,
            memory_type: match kind {
                MemType::Host => sys::UCS_MEMORY_TYPE_HOST,
                MemType::Cuda => sys::UCS_MEMORY_TYPE_CUDA,
            },
        };
        // SAFETY: the context is live (we hold it); the range is the caller's promise; no
        // ALLOCATE flag, so UCX maps the caller's memory.
        let raw = unsafe { self.lib.mem_map(self.raw, &params) }?;
        Ok(MemHandle {
            ctx: self.clone(),
            raw,
            addr: addr as u64,
            len,
            kind,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the last reference: every worker and mapping made from this context held an
        // `Arc` to it and is gone.
        unsafe { self.lib.cleanup(self.raw) }
    }
}

/// Where a mapped range lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemType {
    /// Host memory.
    Host,
    /// CUDA device memory.
    Cuda,
}

/// A mapped range; unmapped on drop.
pub(crate) struct MemHandle {
    ctx: Arc<Context>,
    raw: RawMem,
    addr: u64,
    len: usize,
    kind: MemType,
}

// SAFETY: a memory handle is used only through its context's calls (`ucp_rkey_pack`,
// `ucp_mem_unmap`), which the thread-shared context serializes.
unsafe impl Send for MemHandle {}
// SAFETY: as above.
unsafe impl Sync for MemHandle {}

impl MemHandle {
    /// The packed remote key a peer unpacks ([`Endpoint::unpack_rkey`]) to reach this range.
    pub(crate) fn pack_rkey(&self) -> Result<Vec<u8>, UcsError> {
        // SAFETY: `raw` is live on `ctx` until this handle drops.
        unsafe { self.ctx.lib.rkey_pack(self.ctx.raw, self.raw) }
    }

    /// The range's address, as peers name it in puts and gets.
    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }

    /// The range's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// What memory it is.
    pub(crate) fn kind(&self) -> MemType {
        self.kind
    }
}

impl std::fmt::Debug for MemHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemHandle")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("kind", &self.kind)
            .finish()
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: mapped on `ctx` (alive: we hold it) and unmapped once, here.
        if let Err(e) = unsafe { self.ctx.lib.mem_unmap(self.ctx.raw, self.raw) } {
            tracing::warn!(%e, "UCX could not unmap a memory range");
        }
    }
}
