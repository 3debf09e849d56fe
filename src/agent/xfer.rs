//! Transfers: a READ or WRITE between a local and a remote descriptor list, checked once
//! ([`XferRequest`], NIXL's transfer handle), posted as often as wanted, each posting a
//! [`Transfer`] future.

use std::future::Future;
use std::pin::Pin as StdPin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context as TaskCx, Poll};

use super::desc::{Desc, MemType};
use super::hostcopy::Seg;
use super::mem::{Pin, RegState};
use super::notif::Notification;
use super::peer::{Link, Peer};
use super::{AgentShared, err};
use crate::error::{Error, OpKind, Result};

/// Which way a transfer moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferOp {
    /// From the remote descriptors into the local ones.
    Read,
    /// From the local descriptors into the remote ones.
    Write,
}

impl std::str::FromStr for XferOp {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<XferOp, String> {
        match s.to_ascii_uppercase().as_str() {
            "READ" => Ok(XferOp::Read),
            "WRITE" => Ok(XferOp::Write),
            other => Err(format!(
                "unknown transfer operation {other:?} (READ or WRITE)"
            )),
        }
    }
}

/// The path that moves a transfer's bytes, as reported by [`XferRequest::path`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferPath {
    /// Both agents in this process, host memory on both sides: `memmove` on copy threads.
    HostCopy,
    /// Both agents in this process, device memory on a side: the CUDA driver's copies
    /// (device to device, GPU to GPU peer copies, host to device).
    CudaCopy,
    /// Device memory of a peer process on the same host: CUDA IPC, then the driver's copies.
    CudaIpc,
    /// Host memory of a peer process on the same host: `process_vm_readv`/`writev` (cross
    /// memory attach) on copy threads.
    ProcessCopy,
    /// A peer in another process or on another host: UCX.
    Ucx,
    /// Local device memory and a peer reached through UCX that cannot move device memory
    /// (no CUDA support in it, or [`AgentConfig::stage_device_memory`](super::AgentConfig)):
    /// the bytes pass through host memory of the transfer's own (`agent::staged`).
    UcxStaged,
}

impl std::fmt::Display for XferPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            XferPath::HostCopy => "memcpy (in process)",
            XferPath::CudaCopy => "CUDA copy (in process)",
            XferPath::CudaIpc => "CUDA IPC (same host)",
            XferPath::ProcessCopy => "cross-memory attach (same host)",
            XferPath::Ucx => "UCX",
            XferPath::UcxStaged => "UCX, device memory staged through host memory",
        })
    }
}

impl XferPath {
    /// The short name errors give as the backend (`via memcpy`, `via cuda-ipc`).
    pub fn backend(self) -> &'static str {
        match self {
            XferPath::HostCopy => "memcpy",
            XferPath::CudaCopy => "cuda",
            XferPath::CudaIpc => "cuda-ipc",
            XferPath::ProcessCopy => "process_vm",
            XferPath::Ucx | XferPath::UcxStaged => "ucx",
        }
    }
}

/// Where a remote descriptor lies.
#[derive(Clone)]
pub(crate) enum RemoteRef {
    /// In a registration of an agent in this process.
    Local(Arc<RegState>),
    /// In the peer's registration at this index of its metadata.
    Ucx(usize),
}

/// A checked descriptor list, reusable with index selection (NIXL's `prep_xfer_dlist`).
pub struct PreparedList {
    /// The agent that prepared it: only that agent's requests may use it.
    pub(crate) owner: std::sync::Weak<AgentShared>,
    pub(crate) mem: MemType,
    /// `None`: this agent's own memory; else the peer it belongs to.
    pub(crate) peer: Option<Arc<Peer>>,
    pub(crate) local: Vec<(Desc, Arc<RegState>)>,
    pub(crate) remote: Vec<(Desc, RemoteRef)>,
}

impl PreparedList {
    /// Number of descriptors.
    pub fn len(&self) -> usize {
        self.local.len().max(self.remote.len())
    }
    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A checked transfer, ready to post (NIXL's transfer handle). Posting it again repeats it.
pub struct XferRequest {
    pub(crate) agent: Arc<AgentShared>,
    pub(crate) op: XferOp,
    pub(crate) peer: Arc<Peer>,
    pub(crate) local_mem: MemType,
    pub(crate) remote_mem: MemType,
    pub(crate) local: Vec<(Desc, Arc<RegState>)>,
    pub(crate) remote: Vec<(Desc, RemoteRef)>,
    pub(crate) notif: Option<Arc<[u8]>>,
    pub(crate) path: XferPath,
}

impl XferRequest {
    /// The path that moves this transfer's bytes.
    pub fn path(&self) -> XferPath {
        self.path
    }
    /// Bytes one posting moves.
    pub fn bytes(&self) -> u64 {
        self.local.iter().map(|(d, _)| d.len).sum()
    }
    /// Descriptors one posting moves.
    pub fn descs(&self) -> usize {
        self.local.len()
    }
    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer.name
    }
    /// Replaces the notification later postings carry.
    pub fn set_notification(&mut self, msg: Option<&[u8]>) {
        self.notif = msg.map(Arc::from);
    }

    fn error(&self, reason: impl Into<String>) -> Error {
        Error::invalid(
            err(OpKind::Transfer, &self.peer.name).with_backend(self.path.backend()),
            reason,
        )
    }

    /// Starts the transfer. It runs to completion whatever happens to the returned future;
    /// the memory it touches stays registered until it has finished (see `agent::mem`).
    pub fn post(&self) -> Result<Transfer> {
        if !self.agent.peer_is_current(&self.peer) {
            return Err(self.error(format!(
                "agent {:?} was removed or reloaded since this transfer was prepared",
                self.peer.name
            )));
        }
        let mut pins: Vec<Pin> = Vec::with_capacity(4);
        let mut pin = |r: &Arc<RegState>, side: &str| -> Result<()> {
            if pins.last().is_some_and(|p| Arc::ptr_eq(p.state(), r)) {
                return Ok(());
            }
            match r.pin() {
                Some(p) => {
                    pins.push(p);
                    Ok(())
                }
                None => Err(self.error(format!(
                    "the {side} registration {} ({} bytes at {:#x}) was deregistered",
                    r.id, r.desc.len, r.desc.addr
                ))),
            }
        };
        for (_, r) in &self.local {
            pin(r, "local")?;
        }
        for (_, r) in &self.remote {
            if let RemoteRef::Local(r) = r {
                pin(r, "remote")?;
            }
        }
        let state = Arc::new(XferState::default());
        let done = Completion {
            state: state.clone(),
            pins,
            _peer: self.peer.clone(),
            notify: self.notif.as_ref().map(|m| {
                (
                    self.peer.clone(),
                    Notification {
                        from: self.agent.name.clone(),
                        msg: m.to_vec(),
                    },
                )
            }),
            ctx_peer: self.peer.name.clone(),
            backend: self.path.backend(),
            failure: None,
            after: None,
            settled: false,
        };
        match (&self.peer.link, self.path) {
            (_, XferPath::CudaIpc) => self.run_ipc(done),
            (Link::Remote(_), XferPath::UcxStaged) => super::staged::post(self, done),
            (_, XferPath::ProcessCopy) => {
                let how = super::hostcopy::Mover::Process {
                    pid: self.peer.meta.pid as i32,
                    read: self.op == XferOp::Read,
                };
                let done = Box::new(move |r| done.finish(r));
                // SAFETY: the local ranges lie in registrations `done` pins until the copy
                // threads have finished; the remote ones the kernel checks.
                unsafe { super::hostcopy::copy(self.segs(), how, done) };
            }
            (Link::Local { .. }, _) => self.run_local(done),
            (Link::Remote(remote), _) => remote.post(self, done),
        }
        Ok(Transfer {
            state,
            path: self.path,
        })
    }

    /// The (destination, source) ranges, in descriptor order.
    pub(crate) fn segs(&self) -> Vec<Seg> {
        self.local
            .iter()
            .zip(&self.remote)
            .map(|((l, _), (r, _))| {
                let (dst, src) = match self.op {
                    XferOp::Read => (l.addr, r.addr),
                    XferOp::Write => (r.addr, l.addr),
                };
                Seg {
                    dst,
                    src,
                    len: l.len,
                }
            })
            .collect()
    }

    fn run_local(&self, done: Completion) {
        let segs = self.segs();
        match self.path {
            XferPath::HostCopy => {
                let done = Box::new(move |r| done.finish(r));
                // SAFETY: every range lies in a registration pinned by `done` (checked when
                // the request was made, pinned above), and pinned registrations keep their
                // memory until `done` runs, which `copy` calls after the last byte.
                unsafe { super::hostcopy::copy(segs, super::hostcopy::Mover::Local, done) };
            }
            XferPath::CudaCopy => {
                let side = |d: &Desc, m: MemType| (m, d.dev);
                let local = side(&self.local[0].0, self.local_mem);
                let remote = side(&self.remote[0].0, self.remote_mem);
                self.run_cuda(segs, local, remote, done)
            }
            XferPath::CudaIpc | XferPath::ProcessCopy | XferPath::Ucx | XferPath::UcxStaged => {
                done.finish(Err("an in-process peer on an inter-process path".into()))
            }
        }
    }

    /// Device memory of a peer process on this host, through its CUDA IPC mappings: the
    /// remote addresses are translated into this process's mappings, then copied as for a
    /// peer in this process. `done` holds the peer (and so the mappings) until it finishes.
    #[cfg(feature = "cuda")]
    fn run_ipc(&self, done: Completion) {
        let mut segs = self.segs();
        let mut remote_dev = None;
        for (s, (d, r)) in segs.iter_mut().zip(&self.remote) {
            let RemoteRef::Ucx(k) = r else {
                return done.finish(Err("a local registration on the IPC path".into()));
            };
            let (Some(m), Some(reg)) = (self.peer.ipc_mapping(*k), self.peer.meta.regs.get(*k))
            else {
                return done.finish(Err("a registration without an IPC mapping".into()));
            };
            let here = m.ptr + (d.addr - reg.desc.addr);
            match self.op {
                XferOp::Read => s.src = here,
                XferOp::Write => s.dst = here,
            }
            remote_dev.get_or_insert(m.ordinal() as u32);
        }
        let local = (self.local_mem, self.local[0].0.dev);
        let remote = (MemType::Device, remote_dev.unwrap_or(0));
        self.run_cuda(segs, local, remote, done)
    }

    #[cfg(not(feature = "cuda"))]
    fn run_ipc(&self, done: Completion) {
        done.finish(Err(
            "CUDA IPC needs gpuio built with its cuda feature".into()
        ))
    }

    /// Copies `segs` with the CUDA driver: `local` and `remote` are each side's memory and
    /// GPU (in this process's numbering).
    #[cfg(feature = "cuda")]
    fn run_cuda(
        &self,
        segs: Vec<Seg>,
        local: (MemType, u32),
        remote: (MemType, u32),
        done: Completion,
    ) {
        let (dst, src) = match self.op {
            XferOp::Read => (local, remote),
            XferOp::Write => (remote, local),
        };
        // The copy runs on the destination GPU's queue where the destination is device
        // memory, else on the source's.
        let gpu = if dst.0 == MemType::Device {
            dst.1
        } else {
            src.1
        } as usize;
        let other = (dst.0 == MemType::Device && src.0 == MemType::Device && dst.1 != src.1)
            .then_some(src.1 as usize);
        let queue = match self.agent.copy_queue(gpu, other) {
            Ok(q) => q,
            Err(e) => return done.finish(Err(e)),
        };
        for s in &merge_adjacent(segs) {
            // SAFETY: both ranges lie in registrations (or a peer's IPC mappings) that `done`
            // holds until the queue reports these copies complete.
            if let Err(e) = unsafe { queue.copy(s.dst, s.src, s.len as usize) } {
                // Copies already queued still run: finish only behind them.
                return queue.then(Box::new(move |_| done.finish(Err(e))));
            }
        }
        queue.then(Box::new(move |r| done.finish(r)));
    }

    #[cfg(not(feature = "cuda"))]
    fn run_cuda(&self, _: Vec<Seg>, _: (MemType, u32), _: (MemType, u32), done: Completion) {
        done.finish(Err(
            "device memory needs gpuio built with its cuda feature".into()
        ))
    }
}

/// `segs` with each run of pieces that continue one another on both sides (the next piece's
/// source and destination start where this one's end) joined into one piece: the same bytes
/// move, in fewer copies. Descriptor lists carved out of one buffer on each side (KV-cache
/// pages, nixlbench's layout) become a single copy; on the device paths each copy costs the
/// driver a few microseconds and the link a ramp (64 copies of 16 MiB took 3.3 ms GPU to GPU
/// where one 1 GiB copy took 2.7).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn merge_adjacent(segs: Vec<Seg>) -> Vec<Seg> {
    let mut out: Vec<Seg> = Vec::with_capacity(segs.len());
    for s in segs {
        match out.last_mut() {
            Some(p)
                if p.dst.checked_add(p.len) == Some(s.dst)
                    && p.src.checked_add(p.len) == Some(s.src) =>
            {
                p.len += s.len
            }
            _ => out.push(s),
        }
    }
    out
}

/// What finishing a transfer does, once its last byte has landed or it has failed: release
/// the registrations, deliver the notification (only on success, and only once the data has
/// landed where it goes: a staged READ's after its copy into the GPU), then wake the future. A completion dropped
/// without finishing (a transfer whose posting was lost with its agent's UCX thread before
/// anything was issued) fails the transfer, so no future waits for ever.
pub(crate) struct Completion {
    state: Arc<XferState>,
    pins: Vec<Pin>,
    /// Keeps the peer's IPC mappings (and its endpoint) while the transfer runs.
    _peer: Arc<Peer>,
    notify: Option<(Arc<Peer>, Notification)>,
    ctx_peer: String,
    backend: &'static str,
    /// A failure found while issuing, reported once what was issued has finished.
    failure: Option<String>,
    /// What is left to do once the transport's part succeeded (a staged transfer's copy into
    /// device memory, or its staging memory to free): it takes the completion and finishes it
    /// when done. Dropped unrun when the transport's part failed.
    after: Option<After>,
    /// Set once the transfer's result is out.
    settled: bool,
}

/// The rest of a transfer after its transport's part, given the completion to finish.
pub(crate) type After = Box<dyn FnOnce(Completion) + Send>;

impl Completion {
    pub(crate) fn set_failure(&mut self, why: String) {
        self.failure.get_or_insert(why);
    }

    pub(crate) fn take_failure(&mut self) -> Option<String> {
        self.failure.take()
    }

    /// The notification for the transport to send once its part is done (remote peers); none
    /// while a continuation is left (a staged transfer's copy): the data has not landed where
    /// it goes until that has run, so the notification goes when the completion settles.
    pub(crate) fn take_notification(&mut self) -> Option<Notification> {
        if self.after.is_some() {
            return None;
        }
        self.notify.take().map(|(_, n)| n)
    }

    /// Sets what runs once the transport's part has succeeded (see the field).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn set_after(&mut self, after: After) {
        self.after = Some(after);
    }

    pub(crate) fn finish(mut self, r: std::result::Result<(), String>) {
        if r.is_ok() && self.failure.is_none() {
            if let Some(after) = self.after.take() {
                return after(self);
            }
        }
        self.settle(r);
    }

    /// Delivers the result: the notification on success, the future's result, then the
    /// registrations.
    fn settle(&mut self, r: std::result::Result<(), String>) {
        self.settled = true;
        let r = match self.failure.take() {
            Some(why) => Err(why),
            None => r,
        };
        let r = match (r, self.notify.take()) {
            (Ok(()), Some((peer, n))) => match &peer.link {
                Link::Local { notifs, .. } => {
                    notifs.push(n);
                    Ok(())
                }
                // After copies over CUDA IPC, or a staged transfer's last part: the data has
                // landed, now the message.
                Link::Remote(remote) => remote
                    .notify(n)
                    .map_err(|e| format!("the data landed; its notification: {e}")),
            },
            (r, _) => r,
        };
        let r = r.map_err(|why| {
            Error::io(
                err(OpKind::Transfer, &self.ctx_peer).with_backend(self.backend),
                std::io::Error::other(why),
            )
        });
        // Done before the registrations go: whoever sees one released sees the transfer done.
        self.state.set(r);
        drop(std::mem::take(&mut self.pins));
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if !self.settled {
            // Unrun continuations go first: what they own (staging memory) is no longer used.
            drop(self.after.take());
            self.settle(Err(
                "the transfer was lost before it was issued (its agent's UCX thread stopped)"
                    .into(),
            ));
        }
    }
}

/// What a transfer's futures (clones of one [`Transfer`]) and its completion share.
#[derive(Default)]
pub(crate) struct XferState {
    result: Mutex<Option<Result<()>>>,
    cv: Condvar,
    /// Every clone polled while the transfer ran: each is woken.
    wakers: Mutex<Vec<std::task::Waker>>,
}

impl XferState {
    fn set(&self, r: Result<()>) {
        *self.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        self.cv.notify_all();
        let wakers = std::mem::take(&mut *self.wakers.lock().unwrap_or_else(|e| e.into_inner()));
        for w in wakers {
            w.wake();
        }
    }

    fn register(&self, w: &std::task::Waker) {
        let mut ws = self.wakers.lock().unwrap_or_else(|e| e.into_inner());
        if !ws.iter().any(|x| x.will_wake(w)) {
            ws.push(w.clone());
        }
    }

    fn peek(&self) -> Option<Result<()>> {
        self.result
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|r| r.as_ref().map(|_| ()).map_err(Error::duplicate))
    }
}

/// Where a transfer stands (NIXL's `check_xfer_state`).
#[derive(Debug)]
pub enum XferStatus {
    /// Still moving data.
    InProgress,
    /// Every byte landed (and the notification, if any, was delivered or sent).
    Done,
    /// It failed; the error says why.
    Failed(Error),
}

/// A posted transfer: a future of its result. Dropping or leaking it leaves the transfer
/// running to completion; the memory it touches stays registered until then.
#[must_use = "a transfer runs anyway; await it (or check its status) to learn its result"]
#[derive(Clone)]
pub struct Transfer {
    state: Arc<XferState>,
    path: XferPath,
}

impl Transfer {
    /// The path that moves the bytes.
    pub fn path(&self) -> XferPath {
        self.path
    }

    /// Where it stands, without waiting.
    pub fn status(&self) -> XferStatus {
        match self.state.peek() {
            None => XferStatus::InProgress,
            Some(Ok(())) => XferStatus::Done,
            Some(Err(e)) => XferStatus::Failed(e),
        }
    }

    /// Blocks the calling thread until it finishes or `timeout` passes (`None`).
    pub fn wait_timeout(&self, timeout: std::time::Duration) -> Option<Result<()>> {
        let deadline = std::time::Instant::now().checked_add(timeout);
        let mut g = self.state.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = g.as_ref() {
                return Some(r.as_ref().map(|_| ()).map_err(Error::duplicate));
            }
            let now = std::time::Instant::now();
            g = match deadline {
                Some(d) if now >= d => return None,
                Some(d) => {
                    self.state
                        .cv
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.state.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    /// Blocks the calling thread until it finishes (for bindings and sync callers).
    pub fn wait(&self) -> Result<()> {
        let mut g = self.state.result.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = g.as_ref() {
                return r.as_ref().map(|_| ()).map_err(Error::duplicate);
            }
            g = self.state.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Future for Transfer {
    type Output = Result<()>;
    fn poll(self: StdPin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Result<()>> {
        if let Some(r) = self.state.peek() {
            return Poll::Ready(r);
        }
        self.state.register(cx.waker());
        match self.state.peek() {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("path", &self.path)
            .field("status", &self.status())
            .finish()
    }
}

impl std::fmt::Debug for XferRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XferRequest")
            .field("op", &self.op)
            .field("peer", &self.peer.name)
            .field("descs", &self.local.len())
            .field("bytes", &self.bytes())
            .field("path", &self.path)
            .finish()
    }
}

impl std::fmt::Debug for PreparedList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedList")
            .field("mem", &self.mem)
            .field("peer", &self.peer.as_ref().map(|p| p.name.as_str()))
            .field("len", &self.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::{Seg, merge_adjacent};

    fn seg(dst: u64, src: u64, len: u64) -> Seg {
        Seg { dst, src, len }
    }

    fn triples(v: &[Seg]) -> Vec<(u64, u64, u64)> {
        v.iter().map(|s| (s.dst, s.src, s.len)).collect()
    }

    #[test]
    fn merges_only_pieces_adjacent_on_both_sides() {
        let segs = vec![
            seg(0x1000, 0x9000, 0x100),
            seg(0x1100, 0x9100, 0x100), // continues both sides: joined
            seg(0x1200, 0x9300, 0x100), // source skips: new piece
            seg(0x1300, 0x9400, 0x100), // continues: joined
            seg(0x2000, 0x9500, 0x100), // destination skips: new piece
            seg(0x1F00, 0x9600, 0x100), // destination goes back: new piece
        ];
        let merged = merge_adjacent(segs);
        assert_eq!(
            triples(&merged),
            vec![
                (0x1000, 0x9000, 0x200),
                (0x1200, 0x9300, 0x200),
                (0x2000, 0x9500, 0x100),
                (0x1F00, 0x9600, 0x100),
            ]
        );
        let total: u64 = merged.iter().map(|s| s.len).sum();
        assert_eq!(total, 0x600);
        assert!(merge_adjacent(Vec::new()).is_empty());
        // An end at the top of the address space does not wrap into address 0.
        let top = vec![seg(u64::MAX - 0xFF, 0, 0x100), seg(0, 0x100, 0x10)];
        assert_eq!(merge_adjacent(top).len(), 2);
    }
}
