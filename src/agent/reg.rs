//! [`Registration`]: the handle that owns registered memory and gives it back once no
//! transfer can touch it.

use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::desc::{DescList, MemType};
use super::mem::{AgentMemory, RegState};
use super::{Agent, AgentShared};
use crate::error::{Context, Error, OpKind, Result};

/// Memory registered with an agent. It owns the memory; [`release`](Self::release) (or
/// dropping it, which blocks) first stops new transfers from touching it, then waits for
/// those in flight, then gives it back.
pub struct Registration<M: AgentMemory> {
    mem: Option<M>,
    state: Arc<RegState>,
    agent: Arc<AgentShared>,
}

impl Agent {
    /// Registers `mem` (NIXL's `register_memory`): peers that load this agent's metadata
    /// afterwards may read and write it, and this agent's transfers may use it.
    pub fn register<M: AgentMemory>(&self, mem: M) -> Result<Registration<M>> {
        let s = &self.shared;
        let ctx = || Context::op(OpKind::Agent);
        let kind = mem.mem_type();
        let mut desc = mem.desc();
        if kind == MemType::Host {
            // Host memory has no device: one value, so overlaps are found whatever was given.
            desc.dev = 0;
        }
        if desc.len == 0 {
            return Err(Error::invalid(ctx(), "registering zero bytes"));
        }
        if desc.end().is_none() {
            return Err(Error::invalid(ctx(), "the range wraps the address space"));
        }
        if kind == MemType::Device && !crate::cuda::available() {
            return Err(Error::unsupported(
                ctx(),
                "device memory needs a CUDA driver and GPU, and this machine has none",
            ));
        }
        #[cfg(feature = "cuda")]
        if kind == MemType::Device {
            // The driver confirms the range is device memory of that GPU, all in one
            // allocation (page-locked host memory would pass a looser check).
            // SAFETY: only a check: the slice is dropped at once and used for nothing; the
            // memory's validity is `AgentMemory`'s contract.
            unsafe {
                crate::buf::raw_device::RawDeviceSlice::new(
                    desc.dev as usize,
                    desc.addr,
                    desc.len as usize,
                )
            }?;
        }
        let remote_access = match &s.remote {
            Some(r) => r.map(kind, desc),
            None => None,
        };
        let ipc = match kind {
            MemType::Device if s.config.same_host_ipc => device_export(desc),
            _ => Vec::new(),
        };
        let state = Arc::new(RegState::new(
            s.next_reg.fetch_add(1, Ordering::Relaxed),
            kind,
            desc,
            remote_access,
            ipc,
        ));
        s.regs
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(state.clone())
            .map_err(|why| Error::invalid(ctx(), why))?;
        Ok(Registration {
            mem: Some(mem),
            state,
            agent: s.clone(),
        })
    }
}

/// The CUDA IPC export of a device registration, or nothing (logged) where the allocation
/// cannot be exported: peers on this host then reach it through UCX.
fn device_export(desc: super::desc::Desc) -> Vec<u8> {
    #[cfg(feature = "cuda")]
    match crate::cuda::ipc::export(desc.dev as usize, desc.addr) {
        Ok(v) => v,
        Err(e) => {
            tracing::info!("device registration without CUDA IPC: {e}");
            Vec::new()
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = desc;
        Vec::new()
    }
}

impl<M: AgentMemory> Registration<M> {
    /// The whole registration as a one-descriptor list.
    pub fn descs(&self) -> DescList {
        DescList::new(self.state.mem, vec![self.state.desc])
    }

    /// The registration's number, unique within its agent.
    pub fn id(&self) -> u64 {
        self.state.id
    }

    /// Whether peers in other processes can reach it (the transport mapped it).
    pub fn remote_reachable(&self) -> bool {
        self.state.rkey().is_some()
    }

    /// Deregisters (NIXL's `deregister_memory`) once every transfer touching the memory has
    /// finished, and gives the memory back.
    pub async fn release(mut self) -> M {
        self.state.revoke();
        poll_fn(|cx| self.state.poll_idle(cx)).await;
        self.unlink();
        self.mem.take().expect("memory is taken only once")
    }

    /// [`release`](Self::release), blocking the calling thread.
    pub fn release_blocking(mut self) -> M {
        self.state.revoke();
        self.state.wait_idle();
        self.unlink();
        self.mem.take().expect("memory is taken only once")
    }

    fn unlink(&self) {
        self.agent
            .regs
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(self.state.id);
        self.state.unmap();
    }
}

impl<M: AgentMemory> Drop for Registration<M> {
    fn drop(&mut self) {
        if self.mem.is_some() {
            self.state.revoke();
            self.state.wait_idle();
            self.unlink();
        }
    }
}

impl<M: AgentMemory> std::fmt::Debug for Registration<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("id", &self.state.id)
            .field("mem", &self.state.mem)
            .field("desc", &self.state.desc)
            .finish()
    }
}
