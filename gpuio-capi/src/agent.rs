//! Agents, NIXL's model in C: registrations of host or device memory, peers loaded from
//! metadata, notifications, and descriptor lists (`gpuio_desc` arrays) with their serialised
//! form. Transfers and prepared lists are in `xfer.rs`.
//!
//! Memory: `gpuio_agent_register` registers the caller's range as it is (the library's
//! `RawMemory`); the caller keeps it valid until `gpuio_agent_deregister` (or
//! `gpuio_agent_free`, which deregisters what is left) returns, and both wait for every
//! transfer that touches it. The registration handles are tracked per agent for that.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use gpuio::agent::{
    Agent, AgentConfig, Desc, DescList, MemType, Notification, RawMemory, Registration, UcxMode,
};

use crate::engine::{ENGINES, refuse_on_executor};
use crate::registry::Registry;
use crate::status::{Failure, gpuio_status, guard};
use crate::text::{bytes_out, c_bytes, c_str};
use crate::{
    GPUIO_AGENT_NO_IPC, GPUIO_AGENT_STAGE_DEVICE, GPUIO_AGENT_UCX_OFF, GPUIO_AGENT_UCX_REQUIRED,
    GPUIO_MEMORY_DEVICE, GPUIO_MEMORY_HOST,
};

/// An agent: a name, registrations, peers, transfers and notifications. Opaque;
/// `gpuio_agent_create`, `gpuio_agent_free`.
pub struct gpuio_agent {
    _opaque: [u8; 0],
}

/// Memory registered with an agent. Opaque; `gpuio_agent_register`,
/// `gpuio_agent_deregister`.
pub struct gpuio_registration {
    _opaque: [u8; 0],
}

/// One range of a descriptor list (NIXL's `(addr, len, dev)`): lists are passed as an array
/// of these, a count and the memory they all lie in (`GPUIO_MEMORY_HOST` or
/// `GPUIO_MEMORY_DEVICE`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct gpuio_desc {
    /// Start address: a host pointer, or a `CUdeviceptr` for device memory.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
    /// Device memory: the CUDA device index. Ignored for host memory.
    pub dev: u32,
}

/// What an agent handle holds.
pub(crate) struct AgentHandle {
    pub(crate) agent: Agent,
    regs: Mutex<AgentRegs>,
    /// Notifications taken from the library's queue and not yet handed out: one too large
    /// for the caller's buffers waits here for a call with larger ones.
    held: Mutex<VecDeque<Notification>>,
}

/// The live registration handles of an agent, deregistered by `gpuio_agent_free`.
struct AgentRegs {
    closed: bool,
    tokens: HashSet<u64>,
}

/// What a registration handle holds (the registration, until it is released).
struct RegHandle {
    reg: Mutex<Option<Registration<RawMemory>>>,
    agent: Weak<AgentHandle>,
}

pub(crate) static AGENTS: Registry<AgentHandle> = Registry::new("gpuio_agent");
static REGISTRATIONS: Registry<RegHandle> = Registry::new("gpuio_registration");

/// Locks `m`; a poisoned lock only means a panic elsewhere while it was held.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The memory a `GPUIO_MEMORY_*` value names.
pub(crate) fn mem_type(mem: u32, what: &str) -> Result<MemType, Failure> {
    match mem {
        GPUIO_MEMORY_HOST => Ok(MemType::Host),
        GPUIO_MEMORY_DEVICE => Ok(MemType::Device),
        other => Err(Failure::invalid(format!(
            "{what}: memory {other} is not GPUIO_MEMORY_HOST or GPUIO_MEMORY_DEVICE"
        ))),
    }
}

/// Most descriptors a list may have: the most a C array of them can hold.
const MAX_DESCS: usize = isize::MAX as usize / size_of::<gpuio_desc>();

/// The list `descs[..n]` of memory `mem` describes (NULL with `n` 0: an empty list).
///
/// # Safety
/// `descs` is NULL or has `n` readable elements.
pub(crate) unsafe fn desc_list(
    mem: u32,
    descs: *const gpuio_desc,
    n: usize,
    what: &str,
) -> Result<DescList, Failure> {
    let mem = mem_type(mem, what)?;
    if n > MAX_DESCS {
        return Err(Failure::invalid(format!(
            "{what}: a list of {n} descriptors is more than any array holds"
        )));
    }
    if n > 0 && descs.is_null() {
        return Err(Failure::invalid(format!(
            "{what}: descriptors is a null pointer with a count of {n}"
        )));
    }
    let descs = if n == 0 {
        &[][..]
    } else {
        // SAFETY: non-null with `n` readable elements (this function's contract), at most
        // isize::MAX bytes (checked); every bit pattern of the struct's integers is valid.
        unsafe { std::slice::from_raw_parts(descs, n) }
    };
    let dev = |d: &gpuio_desc| if mem == MemType::Host { 0 } else { d.dev };
    Ok(DescList::new(
        mem,
        descs
            .iter()
            .map(|d| Desc::new(d.addr, d.len, dev(d)))
            .collect(),
    ))
}

/// Stores a new handle's token in `*out`.
///
/// # Safety
/// `out` is non-null and writable.
pub(crate) unsafe fn hand_out<H>(out: *mut *mut H, token: u64) {
    // SAFETY: this function's contract.
    unsafe { *out = std::ptr::without_provenance_mut(token as usize) };
}

/// Creates an agent named `name` (NUL-terminated UTF-8, not empty: what peers call it) on
/// `engine` and stores its handle in `*out`. `flags`: 0, or `GPUIO_AGENT_UCX_OFF` (peers in
/// this process only) or `GPUIO_AGENT_UCX_REQUIRED` (fail without UCX), or-ed with
/// `GPUIO_AGENT_NO_IPC` and `GPUIO_AGENT_STAGE_DEVICE`. Without a UCX flag, peers in other processes are reached through UCX
/// where it loads (run time; nothing to link). Two agents in one process need no UCX: their
/// transfers are straight copies. Free agents before their engine.
///
/// # Safety
/// `name` is NULL (an error) or NUL-terminated; `out` is NULL (an error) or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_agent_create(
    engine: *const crate::engine::gpuio_engine,
    name: *const libc::c_char,
    flags: u32,
    out: *mut *mut gpuio_agent,
) -> gpuio_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid(
                "gpuio_agent_create: out is a null pointer",
            ));
        }
        let engine = ENGINES.get(engine)?;
        // SAFETY: forwarded from this function's contract; the text is copied below.
        let name = unsafe { c_str(name, "gpuio_agent_create: name") }?;
        let all = GPUIO_AGENT_UCX_OFF
            | GPUIO_AGENT_UCX_REQUIRED
            | GPUIO_AGENT_NO_IPC
            | GPUIO_AGENT_STAGE_DEVICE;
        if flags & !all != 0 {
            return Err(Failure::invalid(format!(
                "gpuio_agent_create {name:?}: unknown flag bits {:#x} (GPUIO_AGENT_UCX_OFF, \
                 UCX_REQUIRED, NO_IPC, STAGE_DEVICE)",
                flags & !all
            )));
        }
        let ucx = match (
            flags & GPUIO_AGENT_UCX_OFF != 0,
            flags & GPUIO_AGENT_UCX_REQUIRED != 0,
        ) {
            (false, false) => UcxMode::Auto,
            (true, false) => UcxMode::Off,
            (false, true) => UcxMode::Required,
            (true, true) => {
                return Err(Failure::invalid(format!(
                    "gpuio_agent_create {name:?}: GPUIO_AGENT_UCX_OFF and \
                     GPUIO_AGENT_UCX_REQUIRED contradict each other"
                )));
            }
        };
        let config = AgentConfig {
            ucx,
            same_host_ipc: flags & GPUIO_AGENT_NO_IPC == 0,
            stage_device_memory: flags & GPUIO_AGENT_STAGE_DEVICE != 0,
        };
        let agent = Agent::with_config(&engine.engine, name, config)?;
        let token = AGENTS.insert(Arc::new(AgentHandle {
            agent,
            regs: Mutex::new(AgentRegs {
                closed: false,
                tokens: HashSet::new(),
            }),
            held: Mutex::new(VecDeque::new()),
        }));
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { hand_out(out, token) };
        Ok(())
    })
}

/// Frees an agent. **Its registrations still live are deregistered first** (waiting, as
/// `gpuio_agent_deregister` does, for the transfers that touch them; their handles die), so
/// that once this returns none of its memory is touched again and the caller may free it.
/// Transfer and prepared-list handles made on it stay valid until freed, but posting them
/// fails. Notifications not yet taken are dropped. Refused (`GPUIO_ERR_WOULD_BLOCK`) inside a
/// completion callback.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_agent_free(agent: *mut gpuio_agent) -> gpuio_status {
    guard(|| {
        refuse_on_executor("gpuio_agent_free")?;
        let handle = AGENTS.remove(agent)?;
        let tokens = {
            let mut regs = lock(&handle.regs);
            regs.closed = true;
            std::mem::take(&mut regs.tokens)
        };
        for token in tokens {
            let reg = std::ptr::without_provenance::<gpuio_registration>(token as usize);
            // A deregistration racing this one may have taken the handle first.
            if let Ok(r) = REGISTRATIONS.remove(reg) {
                release(&r);
            }
        }
        Ok(())
    })
}

/// Deregisters `r`'s memory once no transfer touches it.
fn release(r: &RegHandle) {
    if let Some(reg) = lock(&r.reg).take() {
        reg.release_blocking();
    }
}

/// Writes the agent's metadata (what a peer passes to `gpuio_agent_add_peer`: its address
/// and the registrations live now) into `buf` and its size into `*len`. `buf` NULL (with
/// `cap` 0) or smaller than the metadata: `GPUIO_ERR_RANGE`, nothing written, `*len` the size
/// needed. Registering or deregistering changes it: fetch it again afterwards.
///
/// # Safety
/// `buf` is NULL or has `cap` writable bytes; `len` is NULL (an error) or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_agent_metadata(
    agent: *const gpuio_agent,
    buf: *mut u8,
    cap: usize,
    len: *mut usize,
) -> gpuio_status {
    guard(|| {
        let handle = AGENTS.get(agent)?;
        let meta = handle.agent.metadata();
        // SAFETY: forwarded from this function's contract.
        unsafe { bytes_out(&meta, buf, cap, len, "gpuio_agent_metadata") }
    })
}

/// Loads a peer's metadata (`len` bytes from its `gpuio_agent_metadata`; NIXL's
/// `loadRemoteMD`) and writes the peer's name into `name_out` (NUL-terminated; NULL with
/// `name_cap` 0 when not wanted). Loading an agent's metadata again replaces what was loaded.
/// A `name_cap` too small for the name is `GPUIO_ERR_RANGE` **with the peer loaded**: the
/// name is truncated and the message gives it whole. Metadata that is not gpuio's, or that
/// names an agent of this process that no longer exists, is `GPUIO_ERR_INVALID`; a peer in
/// another process without UCX is `GPUIO_ERR_UNSUPPORTED`.
///
/// # Safety
/// `meta` is NULL (an error) or has `len` readable bytes; `name_out` is NULL or has
/// `name_cap` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_agent_add_peer(
    agent: *const gpuio_agent,
    meta: *const u8,
    len: usize,
    name_out: *mut libc::c_char,
    name_cap: usize,
) -> gpuio_status {
    guard(|| {
        let handle = AGENTS.get(agent)?;
        if meta.is_null() {
            return Err(Failure::invalid(
                "gpuio_agent_add_peer: metadata is a null pointer",
            ));
        }
        if name_out.is_null() && name_cap > 0 {
            return Err(Failure::invalid(format!(
                "gpuio_agent_add_peer: name_out is a null pointer with a capacity of {name_cap}"
            )));
        }
        // SAFETY: non-null with `len` readable bytes (this function's contract).
        let meta = unsafe { c_bytes(meta, len, "gpuio_agent_add_peer: metadata") }?;
        let name = handle.agent.add_peer(meta)?;
        if name_out.is_null() {
            return Ok(());
        }
        // SAFETY: `name_out` has `name_cap` writable bytes (this function's contract).
        unsafe { crate::text::copy_out(&name, name_out, name_cap, std::ptr::null_mut()) }.map_err(
            |f| {
                Failure::new(
                    f.status,
                    format!(
                        "gpuio_agent_add_peer: peer {name:?} was loaded, but its name needs {} \
                         bytes and name_out holds {name_cap}",
                        name.len() + 1
                    ),
                )
            },
        )
    })
}

/// Forgets the peer `name` (NIXL's `invalidateRemoteMD`). Transfers already posted to it run
/// on; posting a transfer made for it, or making a new one, fails until it is loaded again.
///
/// # Safety
/// `name` is NULL (an error) or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_agent_remove_peer(
    agent: *const gpuio_agent,
    name: *const libc::c_char,
) -> gpuio_status {
    guard(|| {
        let handle = AGENTS.get(agent)?;
        // SAFETY: forwarded from this function's contract.
        let name = unsafe { c_str(name, "gpuio_agent_remove_peer: name") }?;
        handle.agent.remove_peer(name)?;
        Ok(())
    })
}

/// Registers `len` bytes at `addr` (NIXL's `registerMem`): `mem` `GPUIO_MEMORY_HOST` (a host
/// pointer; `dev` ignored) or `GPUIO_MEMORY_DEVICE` (a `CUdeviceptr` on CUDA device `dev`).
/// This agent's transfers may then use the range, and peers that load its metadata
/// afterwards may read and write it. **The memory must stay valid until
/// `gpuio_agent_deregister` (or `gpuio_agent_free`) returns**, and its contents are not to be
/// relied on while transfers may touch it. Registrations of one memory and device may not
/// overlap (`GPUIO_ERR_INVALID`).
///
/// # Safety
/// The memory as above; `out` is NULL (an error) or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_agent_register(
    agent: *const gpuio_agent,
    mem: u32,
    addr: u64,
    len: u64,
    dev: u32,
    out: *mut *mut gpuio_registration,
) -> gpuio_status {
    guard(|| {
        if out.is_null() {
            return Err(Failure::invalid(
                "gpuio_agent_register: out is a null pointer",
            ));
        }
        let handle = AGENTS.get(agent)?;
        let mem = mem_type(mem, "gpuio_agent_register")?;
        if addr == 0 {
            return Err(Failure::invalid(format!(
                "gpuio_agent_register: {len} bytes at a null address"
            )));
        }
        let dev = if mem == MemType::Host { 0 } else { dev };
        // SAFETY: the caller keeps the range valid until it is deregistered (this function's
        // contract); the registration is released by gpuio_agent_deregister or
        // gpuio_agent_free, never while the handle is live.
        let raw = unsafe { RawMemory::new(mem, Desc::new(addr, len, dev)) };
        // Under the lock, so that an agent being freed cannot miss the new handle.
        let mut regs = lock(&handle.regs);
        if regs.closed {
            return Err(Failure::new(
                gpuio_status::GPUIO_ERR_BAD_HANDLE,
                "gpuio_agent_register: the agent was freed meanwhile",
            ));
        }
        let reg = handle.agent.register(raw)?;
        let token = REGISTRATIONS.insert(Arc::new(RegHandle {
            reg: Mutex::new(Some(reg)),
            agent: Arc::downgrade(&handle),
        }));
        regs.tokens.insert(token);
        // SAFETY: checked non-null; the caller made it writable.
        unsafe { hand_out(out, token) };
        Ok(())
    })
}

/// Deregisters memory (NIXL's `deregisterMem`): no new transfer may touch it, then this waits
/// for those in flight (posted by this agent or by peers in this process, including freed
/// transfer handles); when it returns the caller may free the memory. Peers that loaded the
/// metadata before see the range gone. Refused (`GPUIO_ERR_WOULD_BLOCK`) inside a completion
/// callback.
///
/// # Safety
/// None beyond the C contract: any pointer value is accepted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_agent_deregister(reg: *mut gpuio_registration) -> gpuio_status {
    guard(|| {
        refuse_on_executor("gpuio_agent_deregister")?;
        let handle = REGISTRATIONS.remove(reg)?;
        if let Some(agent) = handle.agent.upgrade() {
            lock(&agent.regs).tokens.remove(&(reg.addr() as u64));
        }
        release(&handle);
        Ok(())
    })
}

/// Sends `msg` (`len` bytes; NULL with 0 for an empty one) to the peer `peer` on its own
/// (NIXL's `genNotif`).
///
/// # Safety
/// `peer` is NULL (an error) or NUL-terminated; `msg` is NULL or has `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gpuio_agent_send_notif(
    agent: *const gpuio_agent,
    peer: *const libc::c_char,
    msg: *const u8,
    len: usize,
) -> gpuio_status {
    guard(|| {
        let handle = AGENTS.get(agent)?;
        // SAFETY: forwarded from this function's contract.
        let peer = unsafe { c_str(peer, "gpuio_agent_send_notif: peer") }?;
        // SAFETY: forwarded from this function's contract.
        let msg = unsafe { c_bytes(msg, len, "gpuio_agent_send_notif: msg") }?;
        handle.agent.send_notification(peer, msg)?;
        Ok(())
    })
}

/// The next notification, waiting `timeout_ms` milliseconds for one (0: not at all; negative:
/// for good); NIXL's `getNotifs`, one at a time, in arrival order. A transfer's notification
/// arrives only after its data has landed. The sender's name goes into `from`
/// (NUL-terminated, `from_cap` bytes), the message into `msg` (`msg_cap` bytes);
/// `*from_len` (if not NULL) gets the name's size with its NUL and `*msg_len` the message's.
/// None within the timeout: `GPUIO_ERR_TIMEOUT`. A buffer too small (or NULL with 0: the size
/// query) is `GPUIO_ERR_RANGE`, nothing written, **the notification kept** for the next call.
/// Refused (`GPUIO_ERR_WOULD_BLOCK`) inside a completion callback unless `timeout_ms` is 0.
/// A wait ends with `GPUIO_ERR_BAD_HANDLE` (within 100 ms) if another thread frees the agent.
///
/// # Safety
/// `from` is NULL or has `from_cap` writable bytes; `msg` is NULL or has `msg_cap` writable
/// bytes; `from_len` is NULL or writable; `msg_len` is NULL (an error) or writable.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gpuio_agent_get_notif(
    agent: *const gpuio_agent,
    timeout_ms: i32,
    from: *mut libc::c_char,
    from_cap: usize,
    from_len: *mut usize,
    msg: *mut u8,
    msg_cap: usize,
    msg_len: *mut usize,
) -> gpuio_status {
    guard(|| {
        let handle = AGENTS.get(agent)?;
        let call = "gpuio_agent_get_notif";
        if msg_len.is_null() {
            return Err(Failure::invalid(format!(
                "{call}: msg_len is a null pointer"
            )));
        }
        for (null, cap, what) in [
            (from.is_null(), from_cap, "from"),
            (msg.is_null(), msg_cap, "msg"),
        ] {
            if null && cap > 0 {
                return Err(Failure::invalid(format!(
                    "{call}: {what} is a null pointer with a capacity of {cap}"
                )));
            }
        }
        let mut held = lock(&handle.held);
        if held.is_empty() {
            drop(held);
            if timeout_ms != 0 {
                refuse_on_executor("gpuio_agent_get_notif with a timeout")?;
            }
            let got = next_notification(&handle, timeout_ms)?;
            held = lock(&handle.held);
            // Behind any kept by another call meanwhile: those were taken from the queue
            // earlier.
            held.extend(got);
        }
        let Some(n) = held.front() else {
            return Err(Failure::new(
                gpuio_status::GPUIO_ERR_TIMEOUT,
                format!("{call}: no notification within {timeout_ms} ms"),
            ));
        };
        let name_size = n.from.len() + 1;
        if !from_len.is_null() {
            // SAFETY: non-null, and writable by this function's contract.
            unsafe { *from_len = name_size };
        }
        // SAFETY: checked non-null; writable by this function's contract.
        unsafe { *msg_len = n.msg.len() };
        if from.is_null() || from_cap < name_size || msg_cap < n.msg.len() {
            return Err(Failure::new(
                gpuio_status::GPUIO_ERR_RANGE,
                format!(
                    "{call}: a notification from {:?} needs {name_size} bytes for the name \
                     (from holds {from_cap}) and {} for the message (msg holds {msg_cap}); \
                     it stays queued",
                    n.from,
                    n.msg.len()
                ),
            ));
        }
        // SAFETY: `from` has `from_cap >= name_size` writable bytes and `msg` (non-null when
        // the message is not empty, since then `msg_cap > 0`) has `msg_cap >= n.msg.len()`
        // (checked above, by this function's contract); the sources are gpuio's own memory.
        unsafe {
            std::ptr::copy_nonoverlapping(n.from.as_ptr(), from.cast::<u8>(), n.from.len());
            *from.add(n.from.len()) = 0;
            if !n.msg.is_empty() {
                std::ptr::copy_nonoverlapping(n.msg.as_ptr(), msg, n.msg.len());
            }
        }
        held.pop_front();
        Ok(())
    })
}

/// How long one wait for a notification lasts before checking that the agent still exists.
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// The next notification from the library's queue within `timeout_ms` (negative: for good),
/// or `GPUIO_ERR_BAD_HANDLE` once the agent is freed meanwhile (a waiter for good would
/// otherwise wait on a queue nothing can fill).
fn next_notification(
    handle: &AgentHandle,
    timeout_ms: i32,
) -> Result<Option<Notification>, Failure> {
    let deadline = u64::try_from(timeout_ms)
        .ok()
        .map(|ms| Instant::now() + Duration::from_millis(ms));
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(WAIT_SLICE),
            None => WAIT_SLICE,
        };
        if let Some(n) = handle.agent.wait_notification(slice) {
            return Ok(Some(n));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        if lock(&handle.regs).closed {
            return Err(Failure::new(
                gpuio_status::GPUIO_ERR_BAD_HANDLE,
                "gpuio_agent_get_notif: the agent was freed while this call waited",
            ));
        }
    }
}
