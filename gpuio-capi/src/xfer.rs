//! Agent transfers (NIXL's transfer handles): made from descriptor lists or from entries of
//! prepared lists, checked once, posted (again after each completes), polled or waited for,
//! freed while running if wanted (the transfer runs on; its memory stays held by the
//! registrations, whose deregistration waits for it). And descriptor lists in their
//! serialised form.

use std::sync::{Arc, Mutex, Weak};

use gpuio::agent::{DescList, PreparedList, Transfer, XferOp, XferRequest, XferStatus};

use crate::agent::{AGENTS, AgentHandle, desc_list, gpuio_agent, gpuio_desc, hand_out, lock};
use crate::engine::refuse_on_executor;
use crate::registry::Registry;
use crate::status::{Failure, gpuio_status, guard};
use crate::text::{bytes_out, c_bytes, c_str};
use crate::{GPUIO_MEMORY_DEVICE, GPUIO_MEMORY_HOST, GPUIO_XFER_READ, GPUIO_XFER_WRITE};

/// A transfer: a READ or WRITE between this agent's memory and a peer's, checked when made,
/// posted with `gpuio_xfer_post`. Opaque; free with `gpuio_xfer_free`.
pub struct gpuio_xfer {
    _opaque: [u8; 0],
}

/// A descriptor list checked once against this agent's registrations or a peer's, for
/// transfers that pick its entries by index (NIXL's prepared lists). Opaque;
/// `gpuio_prep_create`, `gpuio_prep_free`.
pub struct gpuio_prep {
    _opaque: [u8; 0],
}

/// What a transfer handle holds: the checked request and its latest posting.
struct XferHandle {
    request: XferRequest,
    posted: Mutex<Option<Arc<Transfer>>>,
}

/// What a prepared-list handle holds, and the agent it was made on.
struct PrepHandle {
    list: PreparedList,
    agent: Weak<AgentHandle>,
}

static XFERS: Registry<XferHandle> = Registry::new("gpuio_xfer");
static PREPS: Registry<PrepHandle> = Registry::new("gpuio_prep");

fn xfer_op(op: u32, call: &str) -> Result<XferOp, Failure> {
    match op {
        GPUIO_XFER_READ => Ok(XferOp::Read),
        GPUIO_XFER_WRITE => Ok(XferOp::Write),
        other => Err(Failure::invalid(format!(
            "{call}: operation {other} is not GPUIO_XFER_READ or GPUIO_XFER_WRITE"
        ))),
    }
}

/// The notification a transfer carries: none for NULL (with `len` 0), else `len` bytes (an
/// empty message for a non-NULL pointer and 0).
///
/// # Safety
/// `ptr` is NULL or has `len` readable bytes.
unsafe fn notification<'a>(
    ptr: *const u8,
    len: usize,
    call: &str,
) -> Result<Option<&'a [u8]>, Failure> {
    if ptr.is_null() && len == 0 {
        return Ok(None);
    }
    // SAFETY: forwarded from this function's contract.
    unsafe { c_bytes(ptr, len, &format!("{call}: notif")) }.map(Some)
}

/// The `n` indices at `ptr` (NULL with `n` 0: none).
///
/// # Safety
/// `ptr` is NULL or has `n` readable elements.
unsafe fn indices<'a>(ptr: *const usize, n: usize, what: &str) -> Result<&'a [usize], Failure> {
    // SAFETY: forwarded from this function's contract; any usize is valid.
    unsafe { crate::text::c_array(ptr, n, usize::MAX, what, "count") }
}

fn insert_xfer(request: XferRequest) -> u64 {
    XFERS.insert(Arc::new(XferHandle {
        request,
        posted: Mutex::new(None),
    }))
}

/// Makes a transfer (NIXL's `createXferReq`): `op` `GPUIO_XFER_READ` (the peer's `remote`
/// ranges into this agent's `local` ones) or `GPUIO_XFER_WRITE` (the other way), between
/// `nlocal` descriptors of memory `mem_local` and as many of `mem_remote` on the peer named
/// `peer`, pairwise (each pair as long). Every local range must lie in a live registration of
/// this agent, every remote one in one of the peer's (as its loaded metadata lists them, or
/// live for a peer in this process); else `GPUIO_ERR_INVALID` saying which. `notif` (`notif_len`
/// bytes; NULL with 0 for none) goes to the peer after each posting's data has landed. The
/// arrays may go once this returns.
///
/// # Safety
/// `local` and `remote` are NULL or have `nlocal` and `nremote` readable elements; `peer` is
/// NULL (an error) or NUL-terminated; `notif` is NULL or has `notif_len` readable bytes; `out`
/// is NULL (an error) or writable.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpuio_xfer_create(
    agent: *const gpuio_agent,
    op: u32,
    mem_local: u32,
    local: *const gpuio_desc,
    nlocal: usize,
    peer: *const libc::c_char,
    mem_remote: u32,
    remote: *const gpuio_desc,
    nremote: usize,
    notif: *const u8,
    notif_len: usize,
    out: *mut *mut gpuio_xfer,
) -> gpuio_status {
    guard(|| {
        let call = "gpuio_xfer_create";
        if out.is_null() {
            return Err(Failure::invalid(format!("{call}: out is a null pointer")));
        }
        let handle = AGENTS.get(agent)?;
        let op = xfer_op(op, call)?;
        // SAFETY: forwarded from this function's contract (as the three calls below).
        let local = unsafe { desc_list(mem_local, local, nlocal, "gpuio_xfer_create: local") }?;
        // SAFETY: as above.
        let remote =
            unsafe { desc_list(mem_remote, remote, nremote, "gpuio_xfer_create: remote") }?;
        // SAFETY: as above.
        let peer = unsafe { c_str(peer, "gpuio_xfer_create: peer") }?;
        // SAFETY: as above.
        let notif = unsafe { notification(notif, notif_len, call) }?;
        let request = handle.agent.request(op, &local, peer, &remote, notif)?;
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { hand_out(out, insert_xfer(request)) };
        Ok(())
    })
}

/// Checks `n` descriptors of memory `mem` once for transfers that pick entries by index
/// (NIXL's `prepXferDlist`): this agent's own registrations where `peer` is NULL, else those
/// of the peer named `peer`. A range in none of them is `GPUIO_ERR_INVALID`.
///
/// # Safety
/// `peer` is NULL or NUL-terminated; `descs` is NULL or has `n` readable elements; `out` is
/// NULL (an error) or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_prep_create(
    agent: *const gpuio_agent,
    peer: *const libc::c_char,
    mem: u32,
    descs: *const gpuio_desc,
    n: usize,
    out: *mut *mut gpuio_prep,
) -> gpuio_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid("gpuio_prep_create: out is a null pointer"));
        }
        let handle = AGENTS.get(agent)?;
        let peer = if peer.is_null() {
            None
        } else {
            // SAFETY: non-null and NUL-terminated (this function's contract).
            Some(unsafe { c_str(peer, "gpuio_prep_create: peer") }?)
        };
        // SAFETY: forwarded from this function's contract.
        let list = unsafe { desc_list(mem, descs, n, "gpuio_prep_create") }?;
        let list = handle.agent.prepare(peer, &list)?;
        let token = PREPS.insert(Arc::new(PrepHandle {
            list,
            agent: Arc::downgrade(&handle),
        }));
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { hand_out(out, token) };
        Ok(())
    })
}

/// Frees a prepared list. Transfers made from it are unaffected.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_prep_free(prep: *mut gpuio_prep) -> gpuio_status {
    guard(|| PREPS.remove(prep).map(drop))
}

/// Makes a transfer from entries of two prepared lists (NIXL's `makeXferReq`): `local_prep`
/// made without a peer, `remote_prep` with one, both on this agent; the i-th of the `nli`
/// local indices `li` pairs with the i-th of the `nri` remote indices `ri` (so `{0, 1}`
/// against `{1, 0}` swaps two ranges). An index past its list is `GPUIO_ERR_INVALID`.
/// `notif` as for `gpuio_xfer_create`.
///
/// # Safety
/// `li` and `ri` are NULL or have `nli` and `nri` readable elements; `notif` is NULL or has
/// `notif_len` readable bytes; `out` is NULL (an error) or writable.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpuio_xfer_create_prepped(
    agent: *const gpuio_agent,
    op: u32,
    local_prep: *const gpuio_prep,
    li: *const usize,
    nli: usize,
    remote_prep: *const gpuio_prep,
    ri: *const usize,
    nri: usize,
    notif: *const u8,
    notif_len: usize,
    out: *mut *mut gpuio_xfer,
) -> gpuio_status {
    guard(|| {
        let call = "gpuio_xfer_create_prepped";
        if out.is_null() {
            return Err(Failure::invalid(format!("{call}: out is a null pointer")));
        }
        let handle = AGENTS.get(agent)?;
        let op = xfer_op(op, call)?;
        let local = PREPS.get(local_prep)?;
        let remote = PREPS.get(remote_prep)?;
        for (p, side) in [(&local, "local"), (&remote, "remote")] {
            if !std::ptr::eq(p.agent.as_ptr(), Arc::as_ptr(&handle)) {
                return Err(Failure::invalid(format!(
                    "{call}: the {side} prepared list was made on another agent"
                )));
            }
        }
        // SAFETY: forwarded from this function's contract (as the two calls below).
        let li = unsafe { indices(li, nli, "gpuio_xfer_create_prepped: li") }?;
        // SAFETY: as above.
        let ri = unsafe { indices(ri, nri, "gpuio_xfer_create_prepped: ri") }?;
        // SAFETY: as above.
        let notif = unsafe { notification(notif, notif_len, call) }?;
        let request =
            handle
                .agent
                .request_prepared(op, &local.list, li, &remote.list, ri, notif)?;
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { hand_out(out, insert_xfer(request)) };
        Ok(())
    })
}

/// Starts the transfer (NIXL's `postXferReq`); it runs on its own, watched with
/// `gpuio_xfer_status` or `gpuio_xfer_wait`. A transfer may be posted again once its last
/// posting has finished (`GPUIO_ERR_INVALID` while it runs). Fails (`GPUIO_ERR_INVALID`) if
/// the peer was removed or reloaded since the transfer was made, or a registration it uses
/// was deregistered.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_xfer_post(xfer: *const gpuio_xfer) -> gpuio_status {
    guard(|| {
        let handle = XFERS.get(xfer)?;
        let mut posted = lock(&handle.posted);
        if posted
            .as_ref()
            .is_some_and(|t| matches!(t.status(), XferStatus::InProgress))
        {
            return Err(Failure::invalid(format!(
                "gpuio_xfer_post: transfer {xfer:p} is still in progress; wait for it before \
                 posting it again"
            )));
        }
        // A posting that fails leaves none: the status calls then say so rather than report
        // the previous posting's result.
        *posted = None;
        *posted = Some(Arc::new(handle.request.post()?));
        Ok(())
    })
}

/// The latest posting, or why there is none.
fn posting(xfer: *const gpuio_xfer, call: &str) -> Result<Arc<Transfer>, Failure> {
    lock(&XFERS.get(xfer)?.posted)
        .clone()
        .ok_or_else(|| Failure::invalid(format!("{call}: transfer {xfer:p} has not been posted")))
}

fn result(status: XferStatus, xfer: *const gpuio_xfer) -> Result<(), Failure> {
    match status {
        XferStatus::Done => Ok(()),
        XferStatus::InProgress => Err(Failure::new(
            gpuio_status::GPUIO_PENDING,
            format!("transfer {xfer:p} is still in progress"),
        )),
        XferStatus::Failed(e) => Err(e.into()),
    }
}

/// Where the latest posting stands, without waiting (NIXL's `getXferStatus`): `GPUIO_OK` once
/// every byte has landed (and the notification was delivered or sent), `GPUIO_PENDING` while
/// it runs, else its failure. Never posted: `GPUIO_ERR_INVALID`.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_xfer_status(xfer: *const gpuio_xfer) -> gpuio_status {
    guard(|| result(posting(xfer, "gpuio_xfer_status")?.status(), xfer))
}

/// Waits until the latest posting finishes and returns its status (as `gpuio_xfer_status`,
/// never `GPUIO_PENDING`). Refused (`GPUIO_ERR_WOULD_BLOCK`) inside a completion callback
/// unless it has finished.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_xfer_wait(xfer: *const gpuio_xfer) -> gpuio_status {
    guard(|| {
        let transfer = posting(xfer, "gpuio_xfer_wait")?;
        match transfer.status() {
            XferStatus::InProgress => {
                refuse_on_executor("gpuio_xfer_wait on a running transfer")?;
                transfer.wait().map_err(Failure::from)
            }
            done => result(done, xfer),
        }
    })
}

/// Frees a transfer (NIXL's `releaseXferReq`). **A posting still running runs on** to
/// completion (its notification is still sent): its memory stays held by the registrations,
/// whose `gpuio_agent_deregister` waits for it.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_xfer_free(xfer: *mut gpuio_xfer) -> gpuio_status {
    guard(|| XFERS.remove(xfer).map(drop))
}

/// Serialises `n` descriptors of memory `mem` for a peer (NIXL's serialised descriptor lists,
/// gpuio's versioned format) into `buf`; `*len` gets the size. `buf` NULL (with `cap` 0) or
/// smaller: `GPUIO_ERR_RANGE`, nothing written, `*len` the size needed.
///
/// # Safety
/// `descs` is NULL or has `n` readable elements; `buf` is NULL or has `cap` writable bytes;
/// `len` is NULL (an error) or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_descs_serialize(
    mem: u32,
    descs: *const gpuio_desc,
    n: usize,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> gpuio_status {
    guard(|| {
        // SAFETY: forwarded from this function's contract.
        let list = unsafe { desc_list(mem, descs, n, "gpuio_descs_serialize") }?;
        // SAFETY: forwarded from this function's contract.
        unsafe { bytes_out(&list.serialize(), buf, cap, len, "gpuio_descs_serialize") }
    })
}

/// Reads `len` bytes from `gpuio_descs_serialize` back: `*mem` gets the memory
/// (`GPUIO_MEMORY_*`), `*count` the number of descriptors, and `descs` (room for `cap`) the
/// descriptors. `descs` NULL (with `cap` 0) or too small: `GPUIO_ERR_RANGE`, none written,
/// `*count` the number needed. Bytes that are not such a list: `GPUIO_ERR_INVALID`.
///
/// # Safety
/// `bytes` is NULL (an error) or has `len` readable bytes; `mem` and `count` are NULL (an
/// error) or writable; `descs` is NULL or has `cap` writable elements.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_descs_deserialize(
    bytes: *const u8,
    len: usize,
    mem: *mut u32,
    descs: *mut gpuio_desc,
    cap: usize,
    count: *mut usize,
) -> gpuio_status {
    guard(|| {
        let call = "gpuio_descs_deserialize";
        if bytes.is_null() || mem.is_null() || count.is_null() {
            return Err(Failure::invalid(format!(
                "{call}: bytes, mem and count must not be null pointers"
            )));
        }
        if descs.is_null() && cap > 0 {
            return Err(Failure::invalid(format!(
                "{call}: descs is a null pointer with a capacity of {cap}"
            )));
        }
        // SAFETY: non-null with `len` readable bytes (this function's contract).
        let bytes = unsafe { c_bytes(bytes, len, call) }?;
        let list = DescList::deserialize(bytes)
            .map_err(|why| Failure::invalid(format!("{call}: {why}")))?;
        let code = match list.mem {
            gpuio::agent::MemType::Host => GPUIO_MEMORY_HOST,
            gpuio::agent::MemType::Device => GPUIO_MEMORY_DEVICE,
        };
        // SAFETY: both checked non-null; writable by this function's contract.
        unsafe {
            *mem = code;
            *count = list.len();
        }
        if list.len() > cap {
            return Err(Failure::new(
                gpuio_status::GPUIO_ERR_RANGE,
                format!(
                    "{call}: {} descriptors do not fit an array of {cap}: *count has the \
                     number needed",
                    list.len()
                ),
            ));
        }
        for (i, d) in list.descs.iter().enumerate() {
            // SAFETY: `i < list.len() <= cap`, and `descs` has `cap` writable elements (non-null
            // since `cap > 0` here).
            unsafe {
                descs.add(i).write(gpuio_desc {
                    addr: d.addr,
                    len: d.len,
                    dev: d.dev,
                })
            };
        }
        Ok(())
    })
}
