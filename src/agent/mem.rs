//! Registrations: memory an agent exposes to peers or moves data through, held for as long as
//! a transfer may touch it.
//!
//! # Why a transfer never writes memory its owner got back
//! Every transfer *pins* each registration it touches (local ones, and a peer's in the same
//! process) before its first byte moves and unpins them after its last byte landed (the copy
//! queue's event, the copy threads' counter, or the UCX flush reported it). Deregistering
//! first *revokes* (no new pin succeeds), then waits until no pin is left, and only then
//! gives the memory back. Pin and revoke are a store and a load on two `SeqCst` atomics each,
//! in opposite orders, so one of the two always sees the other: a pin that lands before the
//! revoke is waited for, one that lands after it backs out. Dropping or leaking a transfer's
//! future changes nothing here: the pins belong to the transfer, not to its future.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context as TaskCx, Poll};

use futures::task::AtomicWaker;

use super::desc::{Desc, MemType};

/// Memory an agent can register. It stays at one address while registered, whatever happens
/// to the value that owns it (a `Vec`'s heap block, a `CudaSlice`'s allocation).
///
/// # Safety
/// [`desc`](Self::desc) must describe memory that is valid for reads and writes (host memory
/// for [`MemType::Host`], device memory of GPU `desc().dev` for [`MemType::Device`]) for as
/// long as the value lives, must return the same range every time, and moving the value must
/// not move that memory. Nothing else may access it while it is registered, except through
/// the agent.
pub unsafe trait AgentMemory: Send + 'static {
    /// Host or device memory.
    fn mem_type(&self) -> MemType;
    /// The range: address, length and device.
    fn desc(&self) -> Desc;
}

// SAFETY: a Vec's elements live in one heap block that moving the Vec does not move; the
// registration owns the Vec, so nothing else touches it while registered.
unsafe impl AgentMemory for Vec<u8> {
    fn mem_type(&self) -> MemType {
        MemType::Host
    }
    fn desc(&self) -> Desc {
        Desc::new(self.as_ptr() as u64, self.len() as u64, 0)
    }
}

// SAFETY: as for `Vec<u8>`.
unsafe impl AgentMemory for Box<[u8]> {
    fn mem_type(&self) -> MemType {
        MemType::Host
    }
    fn desc(&self) -> Desc {
        Desc::new(self.as_ptr() as u64, self.len() as u64, 0)
    }
}

#[cfg(feature = "cuda")]
// SAFETY: a CudaSlice owns one device allocation that moving the slice does not move; the
// registration owns the slice. Transfers finish (their copies synchronised) before the slice
// is handed back, so cudarc's own stream ordering never races them.
unsafe impl<T: crate::cuda::Pod> AgentMemory for cudarc::driver::CudaSlice<T> {
    fn mem_type(&self) -> MemType {
        MemType::Device
    }
    fn desc(&self) -> Desc {
        use cudarc::driver::DevicePtr;
        let (ptr, _record) = self.device_ptr(self.stream());
        Desc::new(
            ptr,
            (self.len() * std::mem::size_of::<T>()) as u64,
            self.context().ordinal() as u32,
        )
    }
}

/// Device memory from `cuMemAlloc`, which CUDA IPC can export to peer processes on the same
/// host (memory from a stream-ordered pool, as cudarc's allocations may be, cannot be, and
/// such registrations are reached through UCX instead).
#[cfg(feature = "cuda")]
pub struct DeviceBuffer(crate::cuda::xfer::DeviceAlloc);

#[cfg(feature = "cuda")]
impl DeviceBuffer {
    /// `len` zeroed bytes on GPU `ordinal`.
    pub fn new(ordinal: usize, len: usize) -> crate::error::Result<DeviceBuffer> {
        if len == 0 {
            return Err(crate::error::Error::invalid(
                crate::error::Context::op(crate::error::OpKind::DeviceMemory),
                "a device buffer of zero bytes",
            ));
        }
        crate::cuda::xfer::DeviceAlloc::new(ordinal, len)
            .map(DeviceBuffer)
            .map_err(|e| {
                crate::error::Error::cuda_msg(
                    crate::error::Context::op(crate::error::OpKind::DeviceMemory),
                    e,
                )
            })
    }
    /// Copies `src` to the start of the buffer (synchronously).
    pub fn write(&self, src: &[u8]) -> crate::error::Result<()> {
        self.0.write(src).map_err(|e| {
            crate::error::Error::cuda_msg(
                crate::error::Context::op(crate::error::OpKind::DeviceMemory),
                e,
            )
        })
    }
    /// The buffer's bytes, copied to host memory (synchronously).
    pub fn to_vec(&self) -> crate::error::Result<Vec<u8>> {
        self.0.read().map_err(|e| {
            crate::error::Error::cuda_msg(
                crate::error::Context::op(crate::error::OpKind::DeviceMemory),
                e,
            )
        })
    }
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }
    /// Whether it is empty (never: zero-byte buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }
}

#[cfg(feature = "cuda")]
// SAFETY: the allocation stays at one address until the buffer is dropped, which needs the
// registration to have been released first (it owns the buffer).
unsafe impl AgentMemory for DeviceBuffer {
    fn mem_type(&self) -> MemType {
        MemType::Device
    }
    fn desc(&self) -> Desc {
        Desc::new(self.0.ptr, self.0.len as u64, self.0.ordinal() as u32)
    }
}

/// Memory described by its address alone, for bindings whose callers keep it valid
/// (NIXL's `(addr, len, dev)` registrations; the C contract).
#[derive(Debug, Clone, Copy)]
pub struct RawMemory {
    mem: MemType,
    desc: Desc,
}

impl RawMemory {
    /// Memory at `desc`.
    ///
    /// # Safety
    /// The range must stay valid for reads and writes (device memory of GPU `desc.dev` for
    /// [`MemType::Device`]) until its registration has been deregistered (or dropped), and
    /// the caller must not rely on its contents while transfers may touch it.
    pub unsafe fn new(mem: MemType, desc: Desc) -> RawMemory {
        RawMemory { mem, desc }
    }
}

// SAFETY: `RawMemory::new`'s contract is this trait's.
unsafe impl AgentMemory for RawMemory {
    fn mem_type(&self) -> MemType {
        self.mem
    }
    fn desc(&self) -> Desc {
        self.desc
    }
}

/// One registration's state, shared by the agent's table, its handle and the transfers
/// that pin it.
pub(crate) struct RegState {
    pub(crate) id: u64,
    pub(crate) mem: MemType,
    pub(crate) desc: Desc,
    pins: AtomicUsize,
    revoked: AtomicBool,
    idle: Mutex<()>,
    idle_cv: Condvar,
    idle_waker: AtomicWaker,
    /// The CUDA IPC export of device memory (empty where none), for peers on this host.
    pub(crate) ipc: Vec<u8>,
    /// The transport's handle for this memory (UCX memory handle and packed key), where the
    /// agent has a transport for other processes; unmapped when the registration is released.
    remote_access: Mutex<Option<super::remote::RemoteAccess>>,
}

impl RegState {
    pub(crate) fn new(
        id: u64,
        mem: MemType,
        desc: Desc,
        remote_access: Option<super::remote::RemoteAccess>,
        ipc: Vec<u8>,
    ) -> RegState {
        RegState {
            id,
            mem,
            desc,
            pins: AtomicUsize::new(0),
            revoked: AtomicBool::new(false),
            idle: Mutex::new(()),
            idle_cv: Condvar::new(),
            idle_waker: AtomicWaker::new(),
            ipc,
            remote_access: Mutex::new(remote_access),
        }
    }

    /// The packed remote key peers use, where the transport mapped the memory.
    pub(crate) fn rkey(&self) -> Option<Vec<u8>> {
        let g = self.remote_access.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().map(|a| a.rkey.clone())
    }

    /// Unmaps the memory from the transport (at release, once no transfer holds it).
    pub(crate) fn unmap(&self) {
        drop(
            self.remote_access
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
    }

    /// Whether `d` (of memory `mem`) lies inside this registration.
    pub(crate) fn covers(&self, mem: MemType, d: &Desc) -> bool {
        range_covers(self.mem, &self.desc, mem, d)
    }

    pub(crate) fn is_revoked(&self) -> bool {
        self.revoked.load(Ordering::SeqCst)
    }

    /// Holds the registration for a transfer, or `None` once it has been revoked.
    pub(crate) fn pin(self: &Arc<Self>) -> Option<Pin> {
        self.pins.fetch_add(1, Ordering::SeqCst);
        let pin = Pin(self.clone());
        if self.revoked.load(Ordering::SeqCst) {
            return None; // `pin` drops here, waking a revoker that saw it.
        }
        Some(pin)
    }

    /// No new pin succeeds from now on.
    pub(crate) fn revoke(&self) {
        self.revoked.store(true, Ordering::SeqCst);
    }

    /// Blocks until no transfer holds the registration (after [`revoke`](Self::revoke)).
    pub(crate) fn wait_idle(&self) {
        let mut g = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while self.pins.load(Ordering::SeqCst) != 0 {
            g = self.idle_cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Ready once no transfer holds the registration (after [`revoke`](Self::revoke)).
    pub(crate) fn poll_idle(&self, cx: &mut TaskCx<'_>) -> Poll<()> {
        self.idle_waker.register(cx.waker());
        if self.pins.load(Ordering::SeqCst) == 0 {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// Whether `d` (of memory `mem`) lies inside `outer` (of memory `outer_mem`).
pub(crate) fn range_covers(outer_mem: MemType, outer: &Desc, mem: MemType, d: &Desc) -> bool {
    let (Some(end), Some(outer_end)) = (d.end(), outer.end()) else {
        return false;
    };
    mem == outer_mem
        && (mem == MemType::Host || d.dev == outer.dev)
        && d.addr >= outer.addr
        && end <= outer_end
}

/// A transfer's hold on a registration; dropping it lets a revoked registration go.
pub(crate) struct Pin(Arc<RegState>);

impl Pin {
    pub(crate) fn state(&self) -> &Arc<RegState> {
        &self.0
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        if self.0.pins.fetch_sub(1, Ordering::SeqCst) == 1 && self.0.is_revoked() {
            // Under the lock, so a waiter between its check and its wait cannot miss this.
            drop(self.0.idle.lock().unwrap_or_else(|e| e.into_inner()));
            self.0.idle_cv.notify_all();
            self.0.idle_waker.wake();
        }
    }
}

/// An agent's registrations, looked up by the range a descriptor names.
#[derive(Default)]
pub(crate) struct RegTable {
    regs: Vec<Arc<RegState>>,
}

impl RegTable {
    /// Adds `r`; registrations of one memory type and device may not overlap.
    pub(crate) fn insert(&mut self, r: Arc<RegState>) -> Result<(), String> {
        let end = r.desc.end().ok_or("the range wraps the address space")?;
        if let Some(o) = self.regs.iter().find(|o| {
            o.mem == r.mem
                && o.desc.dev == r.desc.dev
                && o.desc.addr < end
                && r.desc.addr < o.desc.addr + o.desc.len
        }) {
            return Err(format!(
                "{} bytes at {:#x} overlap registration {} ({} bytes at {:#x})",
                r.desc.len, r.desc.addr, o.id, o.desc.len, o.desc.addr
            ));
        }
        let at = self
            .regs
            .partition_point(|o| (o.desc.addr, o.id) < (r.desc.addr, r.id));
        self.regs.insert(at, r);
        Ok(())
    }

    pub(crate) fn remove(&mut self, id: u64) {
        self.regs.retain(|r| r.id != id);
    }

    /// The live registration holding all of `d`.
    pub(crate) fn find(&self, mem: MemType, d: &Desc) -> Option<&Arc<RegState>> {
        // Registrations are sorted by address; the candidates start at or before `d.addr`.
        let upto = self.regs.partition_point(|r| r.desc.addr <= d.addr);
        self.regs[..upto]
            .iter()
            .rev()
            .find(|r| !r.is_revoked() && r.covers(mem, d))
    }

    pub(crate) fn live(&self) -> impl Iterator<Item = &Arc<RegState>> {
        self.regs.iter().filter(|r| !r.is_revoked())
    }
}
