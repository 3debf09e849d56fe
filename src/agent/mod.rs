//! Agents: memory moved between processes and hosts, NIXL's model, as futures.
//!
//! An [`Agent`] has a name and registrations: host or device memory it exposes to peers or
//! moves data through ([`Agent::register`]). Its [`metadata`](Agent::metadata) (its address
//! and the keys of its registrations) is what a peer loads ([`Agent::add_peer`]) to reach it.
//! A transfer is a READ or WRITE between a local and a remote [`DescList`], checked once
//! ([`Agent::request`], NIXL's transfer handle; prepared lists with index selection through
//! [`Agent::prepare`]) and posted as a [`Transfer`] future. It may carry a notification that
//! the peer receives ([`Agent::notifications`]) only after the transfer's data has landed.
//!
//! Paths, reported per transfer ([`XferRequest::path`]):
//! - two agents in one process: straight copies between their memory, `memmove` on copy
//!   threads for host memory and the CUDA driver's copies where device memory is involved
//!   (device to device, GPU to GPU over NVLink, host to device), never a network stack;
//! - a peer in another process or on another host: UCX (ucp), loaded at run time
//!   (`crate::ucx`), its RMA puts and gets driven by the agent's progress thread.
//!
//! Soundness: memory a peer may write stays owned by its registration, and releasing a
//! registration waits for every transfer that touches it (see `mem`), so a dropped or
//! leaked [`Transfer`] never lets a write land in memory its owner got back.
//!
//! ```no_run
//! # async fn f() -> gpuio::Result<()> {
//! use gpuio::agent::{Agent, XferOp};
//! let engine = gpuio::Engine::new()?;
//! let target = Agent::new(&engine, "target")?;
//! let initiator = Agent::new(&engine, "initiator")?;
//! let theirs = target.register(vec![7u8; 1 << 20])?;
//! let mine = initiator.register(vec![0u8; 1 << 20])?;
//! initiator.add_peer(&target.metadata())?;
//! let xfer = initiator.request(XferOp::Read, &mine.descs(), "target", &theirs.descs(), Some(b"done"))?;
//! xfer.post()?.await?;
//! assert_eq!(mine.release().await[0], 7);
//! # Ok(()) }
//! ```

mod desc;
mod hostcopy;
mod mem;
mod meta;
mod notif;
mod peer;
mod reg;
mod remote;
mod staged;
mod wire;
mod xfer;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock, Weak};

pub use desc::{Desc, DescList, MemType};
#[cfg(feature = "cuda")]
pub use mem::DeviceBuffer;
pub use mem::{AgentMemory, RawMemory};
pub use notif::{Notification, Notifications};
pub use reg::Registration;
pub use remote::UcxMode;
pub use xfer::{PreparedList, Transfer, XferOp, XferPath, XferRequest, XferStatus};

use crate::engine::Engine;
use crate::error::{Context, Error, OpKind, Result};
use mem::RegTable;
use meta::Metadata;
use notif::NotifQueue;
use peer::{Link, Peer};
use xfer::RemoteRef;

/// How an agent is set up.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Whether the agent reaches peers in other processes through UCX.
    pub ucx: UcxMode,
    /// A peer process on the same host is reached directly (the default), instead of through
    /// UCX: its device memory through CUDA IPC, its host memory with cross-memory attach
    /// (`process_vm_readv`/`writev`, where ptrace permission allows).
    pub same_host_ipc: bool,
    /// Device memory moved over UCX passes through host memory even where UCX could move it
    /// itself ([`XferPath::UcxStaged`]); a UCX without CUDA support always stages. For
    /// networks where the GPU cannot be reached directly, and for testing the staged path.
    pub stage_device_memory: bool,
}

impl Default for AgentConfig {
    fn default() -> AgentConfig {
        AgentConfig {
            ucx: UcxMode::Auto,
            same_host_ipc: true,
            stage_device_memory: false,
        }
    }
}

/// An agent: registrations, peers, transfers and notifications. Cheap to clone (a handle).
#[derive(Clone)]
pub struct Agent {
    shared: Arc<AgentShared>,
}

pub(crate) struct AgentShared {
    pub(crate) name: String,
    pub(crate) config: AgentConfig,
    token: u64,
    pid: u32,
    host: u64,
    /// The engine the agent belongs to, kept alive with it.
    _engine: Engine,
    regs: RwLock<RegTable>,
    next_reg: AtomicU64,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    pub(crate) notifs: Arc<NotifQueue>,
    #[cfg(feature = "cuda")]
    gpus: Mutex<HashMap<usize, Arc<crate::cuda::xfer::CopyQueue>>>,
    pub(crate) remote: Option<remote::RemoteTransport>,
}

/// Agents alive in this process, by instance token: metadata naming one of them is served
/// by straight copies.
fn local_agents() -> &'static Mutex<HashMap<u64, Weak<AgentShared>>> {
    static AGENTS: std::sync::OnceLock<Mutex<HashMap<u64, Weak<AgentShared>>>> =
        std::sync::OnceLock::new();
    AGENTS.get_or_init(Default::default)
}

pub(crate) fn err(op: OpKind, peer: &str) -> Context {
    let c = Context::op(op);
    if peer.is_empty() {
        c
    } else {
        c.with_peer(peer)
    }
}

impl Agent {
    /// An agent named `name` on `engine`, reaching other processes through UCX where UCX
    /// loads ([`UcxMode::Auto`]).
    pub fn new(engine: &Engine, name: &str) -> Result<Agent> {
        Agent::with_config(engine, name, AgentConfig::default())
    }

    /// An agent set up as `config` says.
    pub fn with_config(engine: &Engine, name: &str, config: AgentConfig) -> Result<Agent> {
        if name.is_empty() {
            return Err(Error::invalid(
                Context::op(OpKind::Agent),
                "an agent needs a name",
            ));
        }
        let notifs = Arc::new(NotifQueue::default());
        let remote = remote::RemoteTransport::start(config.ucx, name, notifs.clone())?;
        let shared = Arc::new(AgentShared {
            name: name.to_string(),
            config,
            token: meta::new_token(),
            pid: std::process::id(),
            host: meta::host_id(),
            _engine: engine.clone(),
            regs: RwLock::new(RegTable::default()),
            next_reg: AtomicU64::new(1),
            peers: Mutex::new(HashMap::new()),
            notifs,
            #[cfg(feature = "cuda")]
            gpus: Mutex::new(HashMap::new()),
            remote,
        });
        local_agents()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(shared.token, Arc::downgrade(&shared));
        Ok(Agent { shared })
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The transport that reaches other processes, in words (`UCX 1.13.1 …`), or why there
    /// is none.
    pub fn transport(&self) -> String {
        match &self.shared.remote {
            Some(r) => r.describe(),
            None => "none: peers in this process only".into(),
        }
    }

    /// The agent's metadata: what a peer passes to [`add_peer`](Self::add_peer). It lists the
    /// registrations live now; fetch it again after registering more.
    pub fn metadata(&self) -> Vec<u8> {
        let s = &self.shared;
        let regs = s
            .regs
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .live()
            .map(|r| meta::RemoteReg {
                id: r.id,
                mem: r.mem,
                desc: r.desc,
                rkey: r.rkey().unwrap_or_default(),
                ipc: r.ipc.clone(),
            })
            .collect();
        Metadata {
            name: s.name.clone(),
            token: s.token,
            pid: s.pid,
            host: s.host,
            address: s.remote.as_ref().map(|r| r.address()).unwrap_or_default(),
            regs,
        }
        .encode()
    }

    /// Loads a peer's metadata and returns its name (NIXL's `add_remote_agent`). Loading an
    /// agent's metadata again replaces what was loaded (a peer that registered more memory,
    /// or restarted).
    pub fn add_peer(&self, metadata: &[u8]) -> Result<String> {
        let s = &self.shared;
        let bad = |why: String| Error::invalid(Context::op(OpKind::Agent), why);
        let meta = Metadata::decode(metadata).map_err(bad)?;
        let ctx = || err(OpKind::Agent, &meta.name);
        if meta.token == s.token {
            return Err(Error::invalid(ctx(), "this is the agent's own metadata"));
        }
        let link = if meta.host == s.host && meta.pid == s.pid {
            let found = local_agents()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&meta.token)
                .and_then(Weak::upgrade);
            let Some(peer) = found else {
                return Err(Error::invalid(
                    ctx(),
                    "stale metadata: that agent no longer exists in this process",
                ));
            };
            Link::Local {
                agent: Arc::downgrade(&peer),
                notifs: peer.notifs.clone(),
            }
        } else {
            let Some(remote) = &s.remote else {
                return Err(Error::unsupported(
                    ctx(),
                    format!(
                        "agent {:?} runs in another process (pid {}{}); reaching it needs \
                         UCX, which this agent has not got ({})",
                        meta.name,
                        meta.pid,
                        if meta.host == s.host {
                            ""
                        } else {
                            ", another host"
                        },
                        remote::why_no_ucx()
                    ),
                ));
            };
            Link::Remote(
                remote
                    .connect(&meta)
                    .map_err(|e| Error::io(ctx().with_backend("ucx"), std::io::Error::other(e)))?,
            )
        };
        let ipc = match &link {
            Link::Remote(_) if meta.host == s.host && s.config.same_host_ipc => {
                peer::open_ipc(&meta)
            }
            _ => Vec::new(),
        };
        let cross_memory = matches!(link, Link::Remote(_))
            && meta.host == s.host
            && s.config.same_host_ipc
            && meta
                .regs
                .iter()
                .find(|r| r.mem == MemType::Host)
                .is_some_and(|r| hostcopy::can_reach(meta.pid as i32, r.desc.addr));
        let name = meta.name.clone();
        let peer = Arc::new(Peer {
            name: name.clone(),
            meta,
            link,
            ipc,
            cross_memory,
        });
        s.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), peer);
        Ok(name)
    }

    /// Forgets a peer (NIXL's `remove_remote_agent`). Transfers already posted to it run on;
    /// new ones fail.
    pub fn remove_peer(&self, name: &str) -> Result<()> {
        let gone = self
            .shared
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        match gone {
            Some(_) => Ok(()),
            None => Err(self.shared.unknown_peer(name)),
        }
    }

    /// The names of the peers loaded.
    pub fn peers(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .shared
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// Checks `list` once for reuse (NIXL's `prep_xfer_dlist`): this agent's own memory where
    /// `peer` is `None`, else the peer's.
    pub fn prepare(&self, peer: Option<&str>, list: &DescList) -> Result<PreparedList> {
        let s = &self.shared;
        match peer {
            None => Ok(PreparedList {
                owner: Arc::downgrade(s),
                mem: list.mem,
                peer: None,
                local: s.resolve_local(list, "")?,
                remote: Vec::new(),
            }),
            Some(name) => {
                let peer = s.peer(name)?;
                Ok(PreparedList {
                    owner: Arc::downgrade(s),
                    mem: list.mem,
                    remote: s.resolve_remote(&peer, list)?,
                    peer: Some(peer),
                    local: Vec::new(),
                })
            }
        }
    }

    /// A transfer between `local` (this agent's memory) and `remote` (`peer`'s), checked:
    /// both lists as long, each pair of descriptors as long, every range inside a live
    /// registration of the right memory. `notif` goes to the peer after the data landed.
    pub fn request(
        &self,
        op: XferOp,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<&[u8]>,
    ) -> Result<XferRequest> {
        let s = &self.shared;
        let peer = s.peer(peer)?;
        let l = s.resolve_local(local, &peer.name)?;
        let r = s.resolve_remote(&peer, remote)?;
        s.make_request(op, peer, local.mem, l, remote.mem, r, notif)
    }

    /// A transfer between entries of two prepared lists (NIXL's `make_prepped_xfer`): the
    /// `i`-th local index pairs with the `i`-th remote one.
    pub fn request_prepared(
        &self,
        op: XferOp,
        local: &PreparedList,
        local_indices: &[usize],
        remote: &PreparedList,
        remote_indices: &[usize],
        notif: Option<&[u8]>,
    ) -> Result<XferRequest> {
        let s = &self.shared;
        let (Some(peer), None) = (&remote.peer, &local.peer) else {
            return Err(Error::invalid(
                Context::op(OpKind::Transfer),
                "the local list must be prepared without a peer and the remote one with one",
            ));
        };
        let mine = |p: &PreparedList| std::ptr::eq(p.owner.as_ptr(), Arc::as_ptr(s));
        if !mine(local) || !mine(remote) {
            return Err(Error::invalid(
                err(OpKind::Transfer, &peer.name),
                format!("a list prepared by another agent than {:?}", s.name),
            ));
        }
        let pick = |n: usize, idx: &[usize], side: &str| -> Result<()> {
            match idx.iter().find(|&&i| i >= n) {
                Some(i) => Err(Error::invalid(
                    err(OpKind::Transfer, &peer.name),
                    format!("{side} index {i} is past the prepared list's {n} entries"),
                )),
                None => Ok(()),
            }
        };
        pick(local.local.len(), local_indices, "local")?;
        pick(remote.remote.len(), remote_indices, "remote")?;
        let l = local_indices
            .iter()
            .map(|&i| local.local[i].clone())
            .collect();
        let r = remote_indices
            .iter()
            .map(|&i| remote.remote[i].clone())
            .collect();
        s.make_request(op, peer.clone(), local.mem, l, remote.mem, r, notif)
    }

    /// [`request`](Self::request) and [`post`](XferRequest::post) in one.
    pub fn transfer(
        &self,
        op: XferOp,
        local: &DescList,
        peer: &str,
        remote: &DescList,
        notif: Option<&[u8]>,
    ) -> Result<Transfer> {
        self.request(op, local, peer, remote, notif)?.post()
    }

    /// Sends `msg` to `peer` on its own (NIXL's `send_notif`).
    pub fn send_notification(&self, peer: &str, msg: &[u8]) -> Result<()> {
        let s = &self.shared;
        let peer = s.peer(peer)?;
        let n = Notification {
            from: s.name.clone(),
            msg: msg.to_vec(),
        };
        match &peer.link {
            Link::Local { notifs, .. } => {
                notifs.push(n);
                Ok(())
            }
            Link::Remote(r) => r.notify(n).map_err(|e| {
                Error::io(
                    err(OpKind::Agent, &peer.name).with_backend("ucx"),
                    std::io::Error::other(e),
                )
            }),
        }
    }

    /// The agent's incoming notifications as a stream.
    pub fn notifications(&self) -> Notifications {
        Notifications {
            queue: self.shared.notifs.clone(),
        }
    }

    /// Every notification received and not yet taken (NIXL's `get_new_notifs`).
    pub fn take_notifications(&self) -> Vec<Notification> {
        self.shared.notifs.take_all()
    }

    /// The next notification, waiting up to `timeout` (for sync callers).
    pub fn wait_notification(&self, timeout: std::time::Duration) -> Option<Notification> {
        self.shared.notifs.wait_next(timeout)
    }
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("name", &self.shared.name)
            .field("peers", &self.peers())
            .field("transport", &self.transport())
            .finish()
    }
}

impl Drop for AgentShared {
    fn drop(&mut self) {
        local_agents()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.token);
    }
}

impl AgentShared {
    fn unknown_peer(&self, name: &str) -> Error {
        Error::invalid(
            err(OpKind::Agent, name),
            format!(
                "{:?} knows no agent {name:?}: load its metadata first (add_peer)",
                self.name
            ),
        )
    }

    fn peer(&self, name: &str) -> Result<Arc<Peer>> {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| self.unknown_peer(name))
    }

    pub(crate) fn peer_is_current(&self, p: &Arc<Peer>) -> bool {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&p.name)
            .is_some_and(|q| Arc::ptr_eq(p, q))
    }

    fn resolve_local(
        &self,
        list: &DescList,
        peer: &str,
    ) -> Result<Vec<(Desc, Arc<mem::RegState>)>> {
        let regs = self.regs.read().unwrap_or_else(|e| e.into_inner());
        list.descs
            .iter()
            .enumerate()
            .map(|(i, d)| match regs.find(list.mem, d) {
                Some(r) => Ok((*d, r.clone())),
                None => Err(Error::invalid(
                    err(OpKind::Transfer, peer),
                    format!(
                        "local descriptor {i} ({} {} bytes at {:#x}, dev {}) lies in no \
                         registration of agent {:?}",
                        list.mem, d.len, d.addr, d.dev, self.name
                    ),
                )),
            })
            .collect()
    }

    fn resolve_remote(&self, peer: &Arc<Peer>, list: &DescList) -> Result<Vec<(Desc, RemoteRef)>> {
        let bad = |i: usize, d: &Desc, why: &str| {
            Error::invalid(
                err(OpKind::Transfer, &peer.name),
                format!(
                    "remote descriptor {i} ({} {} bytes at {:#x}, dev {}) {why}",
                    list.mem, d.len, d.addr, d.dev
                ),
            )
        };
        match &peer.link {
            Link::Local { agent, .. } => {
                let Some(agent) = agent.upgrade() else {
                    return Err(Error::invalid(
                        err(OpKind::Transfer, &peer.name),
                        "that agent has been dropped",
                    ));
                };
                let regs = agent.regs.read().unwrap_or_else(|e| e.into_inner());
                list.descs
                    .iter()
                    .enumerate()
                    .map(|(i, d)| match regs.find(list.mem, d) {
                        Some(r) => Ok((*d, RemoteRef::Local(r.clone()))),
                        None => Err(bad(i, d, "lies in none of the peer's registrations")),
                    })
                    .collect()
            }
            Link::Remote(_) => list
                .descs
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let at = peer
                        .meta
                        .regs
                        .iter()
                        .position(|r| mem::range_covers(r.mem, &r.desc, list.mem, d));
                    match at {
                        None => Err(bad(
                            i,
                            d,
                            "lies in none of the registrations in the peer's metadata",
                        )),
                        Some(k)
                            if peer.meta.regs[k].rkey.is_empty()
                                && peer.ipc_mapping(k).is_none() =>
                        {
                            Err(bad(
                                i,
                                d,
                                "lies in a registration the peer's UCX could not map \
                             (device memory with a UCX built without CUDA)",
                            ))
                        }
                        Some(k) => Ok((*d, RemoteRef::Ucx(k))),
                    }
                })
                .collect(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn make_request(
        self: &Arc<Self>,
        op: XferOp,
        peer: Arc<Peer>,
        local_mem: MemType,
        local: Vec<(Desc, Arc<mem::RegState>)>,
        remote_mem: MemType,
        remote: Vec<(Desc, RemoteRef)>,
        notif: Option<&[u8]>,
    ) -> Result<XferRequest> {
        let bad = |why: String| Error::invalid(err(OpKind::Transfer, &peer.name), why);
        if local.len() != remote.len() {
            return Err(bad(format!(
                "{} local descriptors against {} remote ones",
                local.len(),
                remote.len()
            )));
        }
        if local.is_empty() {
            return Err(bad("no descriptors".into()));
        }
        if let Some(i) = (0..local.len()).find(|&i| local[i].0.len != remote[i].0.len) {
            return Err(bad(format!(
                "descriptor pair {i}: {} local bytes against {} remote",
                local[i].0.len, remote[i].0.len
            )));
        }
        for (side, mem, list) in [
            (
                "local",
                local_mem,
                local.iter().map(|d| d.0).collect::<Vec<_>>(),
            ),
            ("remote", remote_mem, remote.iter().map(|d| d.0).collect()),
        ] {
            if mem == MemType::Device && list.iter().any(|d| d.dev != list[0].dev) {
                return Err(bad(format!(
                    "the {side} descriptors lie on several GPUs; one transfer copies between \
                     one GPU on each side (split it)"
                )));
            }
        }
        let by_ipc = remote_mem == MemType::Device
            && remote.iter().all(|(_, r)| match r {
                RemoteRef::Ucx(k) => peer.ipc_mapping(*k).is_some(),
                RemoteRef::Local(_) => false,
            });
        let path = match &peer.link {
            Link::Remote(_) if by_ipc => XferPath::CudaIpc,
            Link::Remote(_)
                if peer.cross_memory
                    && local_mem == MemType::Host
                    && remote_mem == MemType::Host =>
            {
                XferPath::ProcessCopy
            }
            Link::Remote(_)
                if local_mem == MemType::Device
                    && (!self.remote_has_cuda() || self.config.stage_device_memory) =>
            {
                XferPath::UcxStaged
            }
            Link::Remote(_) => XferPath::Ucx,
            Link::Local { .. } if local_mem == MemType::Host && remote_mem == MemType::Host => {
                XferPath::HostCopy
            }
            Link::Local { .. } => XferPath::CudaCopy,
        };
        Ok(XferRequest {
            agent: self.clone(),
            op,
            peer,
            local_mem,
            remote_mem,
            local,
            remote,
            notif: notif.map(Arc::from),
            path,
        })
    }

    fn remote_has_cuda(&self) -> bool {
        self.remote.as_ref().is_some_and(|r| r.has_cuda())
    }

    /// The copy queue on GPU `gpu`, with peer access to GPU `other` turned on where given.
    #[cfg(feature = "cuda")]
    pub(crate) fn copy_queue(
        &self,
        gpu: usize,
        other: Option<usize>,
    ) -> std::result::Result<Arc<crate::cuda::xfer::CopyQueue>, String> {
        let mut gpus = self.gpus.lock().unwrap_or_else(|e| e.into_inner());
        let q = match gpus.get(&gpu) {
            Some(q) => q.clone(),
            None => {
                let q = Arc::new(crate::cuda::xfer::CopyQueue::new(gpu)?);
                gpus.insert(gpu, q.clone());
                q
            }
        };
        if let Some(o) = other {
            static ENABLED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
            let mut done = ENABLED.lock().unwrap_or_else(|e| e.into_inner());
            let pair = (gpu.min(o), gpu.max(o));
            if !done.contains(&pair) {
                let oc = crate::cuda::context(o).map_err(|e| e.to_string())?;
                if let Err(e) = crate::cuda::peer::enable(q.context(), &oc) {
                    // Copies between the two still work, staged through host memory.
                    tracing::warn!("agent copies between GPUs {gpu} and {o}: {e}");
                }
                done.push(pair);
            }
        }
        Ok(q)
    }
}
