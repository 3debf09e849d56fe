//! Endpoints and remote keys.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use super::result::{Started, UcsError, UcxLib};
use super::sys::{self, RawEp, RawRkey};
use super::worker::{CbBox, Request, WorkerShared, ep_error};

/// Zero bytes after a copied worker address or remote key. UCX parses both without a length;
/// a packed key is at most 64 memory domains of at most 255 bytes each after its 9-byte
/// header, so this much padding keeps a truncated one from being read past the copy (a
/// truncated address then fails with `UCS_ERR_INVALID_PARAM`: tested).
const PARSE_PADDING: usize = 64 * 256 + 64;

/// An endpoint's error handler, called from inside `ucp_worker_progress`.
pub(crate) struct ErrSlot {
    pub(crate) lib: &'static UcxLib,
    pub(crate) f: RefCell<Box<dyn FnMut(UcsError)>>,
}

/// The endpoint proper, shared by the [`Endpoint`] handle and its remote keys (UCX wants keys
/// destroyed before their endpoint).
pub(crate) struct EpInner {
    /// Null once closed.
    raw: Cell<RawEp>,
    worker: Rc<WorkerShared>,
    /// The error handler's box; UCX holds its pointer until the endpoint's close completes.
    err: Cell<Option<CbBox<ErrSlot>>>,
}

impl EpInner {
    /// Force-closes the endpoint (no goodbye to the peer); what UCX still does for it runs to
    /// completion in the worker, which frees the error handler after that. Returns the close
    /// request for a caller that wants to wait for it.
    fn close_now(&self) -> Result<Option<Request>, UcsError> {
        let raw = self.raw.replace(std::ptr::null_mut());
        if raw.is_null() {
            return Ok(None);
        }
        let err = self
            .err
            .take()
            .map(|b| Box::new(b) as Box<dyn std::any::Any>);
        let w = &self.worker;
        // SAFETY: a live endpoint of this live worker, on its thread, closed once (`raw` is
        // now null); no remote key is left (each holds this `EpInner`, which is being closed
        // from `Endpoint::close` as the only holder, or dropped).
        match unsafe { w.lib.ep_close(raw, sys::UCP_EP_CLOSE_FLAG_FORCE) } {
            Ok(Started::Done) => {
                if let Some(b) = err {
                    w.retire(b);
                }
                Ok(None)
            }
            Ok(Started::Request(req)) => {
                Ok(Some(Request::new(req, "ucp_ep_close_nbx", w.clone(), err)))
            }
            Err(e) => {
                if let Some(b) = err {
                    w.retire(b);
                }
                Err(e)
            }
        }
    }

    fn raw(&self, call: &'static str) -> Result<RawEp, UcsError> {
        let raw = self.raw.get();
        if raw.is_null() {
            Err(UcsError {
                status: sys::UCS_ERR_CANCELED.into(),
                call,
                message: "the endpoint is closed".into(),
            })
        } else {
            Ok(raw)
        }
    }
}

impl Drop for EpInner {
    fn drop(&mut self) {
        match self.close_now() {
            Ok(None) => {}
            Ok(Some(req)) => drop(req), // adopted by the worker until UCX finishes the close
            Err(e) => tracing::debug!(%e, "closing a UCX endpoint"),
        }
    }
}

/// A connection to a remote worker, made by [`Worker::connect`](super::Worker::connect).
/// Neither `Send` nor `Sync`. Dropping it force-closes it without waiting (also when the peer
/// is gone); [`close`](Self::close) returns the close request to wait for.
pub(crate) struct Endpoint {
    inner: Rc<EpInner>,
}

impl Endpoint {
    /// See [`Worker::connect`](super::Worker::connect).
    ///
    /// # Safety
    /// As there.
    pub(crate) unsafe fn connect(
        worker: &Rc<WorkerShared>,
        remote_address: &[u8],
        on_error: Box<dyn FnMut(UcsError)>,
    ) -> Result<Endpoint, UcsError> {
        let lib = worker.lib;
        if remote_address.is_empty() {
            return Err(UcsError {
                status: sys::UCS_ERR_INVALID_PARAM.into(),
                call: "ucp_ep_create",
                message: "empty worker address".into(),
            });
        }
        let mut addr = remote_address.to_vec();
        addr.resize(remote_address.len() + PARSE_PADDING, 0);
        let slot = CbBox::new(ErrSlot {
            lib,
            f: RefCell::new(on_error),
        });
        let mut params = sys::RawEpParams::zeroed();
        params.field_mask = sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params.address = addr.as_ptr().cast();
        params.err_mode = sys::UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler.cb = Some(ep_error);
        params.err_handler.arg = slot.as_ptr();
        // SAFETY: the worker is live and on this thread; the address is the caller's promise
        // (padded copy, read during the call only); the handler's slot lives until the
        // endpoint's close completes (it moves into `EpInner`, which hands it to the close
        // request or retires it).
        match unsafe { lib.ep_create(worker.raw, &params) } {
            Ok(raw) => Ok(Endpoint {
                inner: Rc::new(EpInner {
                    raw: Cell::new(raw),
                    worker: worker.clone(),
                    err: Cell::new(Some(slot)),
                }),
            }),
            Err(e) => {
                worker.retire(Box::new(slot));
                Err(e)
            }
        }
    }

    fn lib(&self) -> &'static UcxLib {
        self.inner.worker.lib
    }

    /// Unpacks a remote key a peer packed with `MemHandle::pack_rkey`, for puts and gets on
    /// this endpoint. The key keeps the endpoint open while it lives.
    ///
    /// # Safety
    /// `packed` is a key packed by a compatible UCX (`MemHandle::pack_rkey`), delivered
    /// intact. UCX parses it without a length and does not validate it: UCX 1.13 accepts
    /// most garbage (then misdirects or hangs the puts and gets that use it) and crashes on
    /// some (a key naming shared-memory domains with bad segment ids: SIGSEGV while cleaning
    /// up). gpuio only refuses an empty key and reads a zero-padded copy.
    pub(crate) unsafe fn unpack_rkey(&self, packed: &[u8]) -> Result<RKey, UcsError> {
        let raw_ep = self.inner.raw("ucp_ep_rkey_unpack")?;
        if packed.is_empty() {
            return Err(UcsError {
                status: sys::UCS_ERR_INVALID_PARAM.into(),
                call: "ucp_ep_rkey_unpack",
                message: "empty remote key".into(),
            });
        }
        let mut buf = packed.to_vec();
        buf.resize(packed.len() + PARSE_PADDING, 0);
        // SAFETY: a live endpoint on its worker's thread; the key is the caller's promise
        // (padded copy, read during the call only).
        let raw = unsafe { self.lib().rkey_unpack(raw_ep, buf.as_ptr().cast()) }?;
        Ok(RKey {
            inner: Rc::new(RKeyInner {
                raw,
                ep: self.inner.clone(),
            }),
        })
    }

    fn checked_rkey(&self, rkey: &RKey, call: &'static str) -> Result<RawEp, UcsError> {
        let raw = self.inner.raw(call)?;
        if !Rc::ptr_eq(&rkey.inner.ep, &self.inner) {
            return Err(UcsError {
                status: sys::UCS_ERR_INVALID_PARAM.into(),
                call,
                message: "the remote key was unpacked on another endpoint".into(),
            });
        }
        Ok(raw)
    }

    fn request(
        &self,
        started: Started,
        call: &'static str,
        rkey: Option<&RKey>,
    ) -> Option<Request> {
        match started {
            Started::Done => None,
            Started::Request(req) => Some(Request::new(
                req,
                call,
                self.inner.worker.clone(),
                rkey.map(|k| Box::new(k.inner.clone()) as Box<dyn std::any::Any>),
            )),
        }
    }

    /// Writes `len` bytes at `local` to `remote_addr` in the peer's range that `rkey` names.
    /// `None`: done already (the source may be reused); else a request to wait for.
    ///
    /// # Safety
    /// `local` is readable for `len` bytes, and not written, until the operation completes:
    /// until the returned request completes, or a flush of this endpoint started after this
    /// call completes. (Dropping the request does not end the operation.)
    pub(crate) unsafe fn put(
        &self,
        local: *const u8,
        len: usize,
        remote_addr: u64,
        rkey: &RKey,
    ) -> Result<Option<Request>, UcsError> {
        let ep = self.checked_rkey(rkey, "ucp_put_nbx")?;
        // SAFETY: a live endpoint on its worker's thread; the key was unpacked on it and is
        // kept alive by the request (or by the worker once the request is dropped) until the
        // operation completes; `local` is the caller's promise.
        let started = unsafe {
            self.lib()
                .put(ep, local.cast(), len, remote_addr, rkey.inner.raw)
        }?;
        Ok(self.request(started, "ucp_put_nbx", Some(rkey)))
    }

    /// Reads `len` bytes at `remote_addr` in the peer's range that `rkey` names into `local`.
    /// `None`: done already; else a request to wait for.
    ///
    /// # Safety
    /// `local` is writable for `len` bytes, and neither read nor written by anyone else, until
    /// the operation completes (as for [`put`](Self::put)).
    pub(crate) unsafe fn get(
        &self,
        local: *mut u8,
        len: usize,
        remote_addr: u64,
        rkey: &RKey,
    ) -> Result<Option<Request>, UcsError> {
        let ep = self.checked_rkey(rkey, "ucp_get_nbx")?;
        // SAFETY: as in `put`, with `local` writable (the caller's promise).
        let started = unsafe {
            self.lib()
                .get(ep, local.cast(), len, remote_addr, rkey.inner.raw)
        }?;
        Ok(self.request(started, "ucp_get_nbx", Some(rkey)))
    }

    /// Flushes the endpoint: the request completes once every operation started on it before
    /// has completed at the peer. `None`: nothing was outstanding.
    pub(crate) fn flush(&self) -> Result<Option<Request>, UcsError> {
        let ep = self.inner.raw("ucp_ep_flush_nbx")?;
        // SAFETY: a live endpoint on its worker's thread.
        let started = unsafe { self.lib().ep_flush(ep) }?;
        Ok(self.request(started, "ucp_ep_flush_nbx", None))
    }

    /// Sends an active message `id` with `header` and `data`, eagerly (the receiver's handler
    /// gets the bytes in its callback). `None`: sent already (both may be reused).
    ///
    /// # Safety
    /// `header` and `data` stay valid and unchanged until the operation completes (as for
    /// [`put`](Self::put)). Borrowed slices make that true only when this returns `None`, or
    /// when the caller keeps them until the request or a later flush completes.
    pub(crate) unsafe fn am_send(
        &self,
        id: u16,
        header: &[u8],
        data: &[u8],
    ) -> Result<Option<Request>, UcsError> {
        let ep = self.inner.raw("ucp_am_send_nbx")?;
        let mut flags = sys::UCP_AM_SEND_FLAG_EAGER;
        if self.lib().version >= (1, 14, 0) {
            flags |= sys::UCP_AM_SEND_FLAG_COPY_HEADER;
        }
        // SAFETY: a live endpoint on its worker's thread; the buffers are the caller's
        // promise.
        let started = unsafe {
            self.lib().am_send(
                ep,
                id,
                header.as_ptr().cast(),
                header.len(),
                data.as_ptr().cast(),
                data.len(),
                flags,
            )
        }?;
        Ok(self.request(started, "ucp_am_send_nbx", None))
    }

    /// UCX's description of the endpoint (`ucp_ep_print_info`): its lanes and the transport
    /// and device of each, to report which path serves a peer.
    pub(crate) fn describe(&self) -> String {
        match self.inner.raw("ucp_ep_print_info") {
            // SAFETY: a live endpoint on its worker's thread.
            Ok(ep) => unsafe { self.lib().ep_info(ep) },
            Err(e) => e.to_string(),
        }
    }

    /// Force-closes the endpoint (`UCP_EP_CLOSE_FLAG_FORCE`: outstanding operations fail with
    /// `UCS_ERR_CANCELED`, the peer is not told). `Some`: UCX finishes the close in the
    /// worker; wait for the request where that matters. If remote keys unpacked on it are
    /// still alive, the close happens when the last of them is dropped, and this returns
    /// `Ok(None)`.
    pub(crate) fn close(self) -> Result<Option<Request>, UcsError> {
        match Rc::try_unwrap(self.inner) {
            Ok(inner) => inner.close_now(),
            Err(shared) => {
                tracing::debug!("UCX endpoint closed while remote keys live: deferred");
                drop(shared);
                Ok(None)
            }
        }
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("raw", &self.inner.raw.get())
            .finish()
    }
}

/// A remote key unpacked on an endpoint: the right to put and get in one of the peer's mapped
/// ranges. Keeps its endpoint open; destroyed on drop, once no operation uses it.
pub(crate) struct RKey {
    inner: Rc<RKeyInner>,
}

struct RKeyInner {
    raw: RawRkey,
    ep: Rc<EpInner>,
}

impl Drop for RKeyInner {
    fn drop(&mut self) {
        // SAFETY: unpacked on `ep`, which is still open (this key holds it, and an endpoint is
        // closed only by its last holder); destroyed once; no operation uses it any more
        // (requests hold this `RKeyInner` until they are done).
        unsafe { self.ep.worker.lib.rkey_destroy(self.raw) }
    }
}

impl std::fmt::Debug for RKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RKey")
            .field("raw", &self.inner.raw)
            .finish()
    }
}
