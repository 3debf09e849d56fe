//! Peers in other processes and on other hosts, over UCX: one progress thread per agent owns
//! the UCX worker, its endpoints and remote keys (a worker is single-threaded), takes
//! commands from the agent's handles through a channel and a doorbell, and sleeps on the
//! worker's event fd and the doorbell when nothing is in flight (no spinning while idle).
//!
//! A transfer is a put or get per descriptor and then an endpoint flush; the flush completing
//! means every byte landed (in the peer's memory for a WRITE, here for a READ). Only then are
//! the transfer's registrations released, its notification sent (an active message on the
//! same endpoint, so the peer sees it after the data) and its future woken. A peer whose
//! endpoint fails (its process died, its host is gone) fails its transfers through UCX's
//! peer-failure handling.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::desc::{Desc, MemType};
use super::meta::Metadata;
use super::notif::{NotifQueue, Notification};
use super::xfer::{Completion, RemoteRef, XferOp, XferRequest};
use crate::error::{Context, Error, OpKind, Result};
use crate::ucx;

/// Whether an agent reaches other processes through UCX.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum UcxMode {
    /// Where UCX loads; without it the agent serves peers in its own process only (and says
    /// why when asked for another).
    #[default]
    Auto,
    /// Never: peers in this process only.
    Off,
    /// Always: creating the agent fails where UCX is missing.
    Required,
}

/// The active message id of notifications.
const AM_NOTIFY: u16 = 0x6e1;

/// How long the progress thread keeps polling after activity before it sleeps on the event
/// fd: a notification or a small transfer answered within this window skips a wake-up.
const SPIN: Duration = Duration::from_micros(50);

/// Why an agent has no UCX, for error messages.
pub(crate) fn why_no_ucx() -> String {
    match ucx::probe() {
        Ok(i) => format!(
            "UCX {} is present but the agent was made without it",
            i.version
        ),
        Err(e) => e,
    }
}

/// A registration's UCX handle and packed remote key.
pub(crate) struct RemoteAccess {
    _memh: ucx::MemHandle,
    pub(crate) rkey: Vec<u8>,
}

enum Cmd {
    Connect {
        id: u64,
        address: Vec<u8>,
        rkeys: Vec<Vec<u8>>,
        reply: mpsc::Sender<std::result::Result<(), String>>,
    },
    Disconnect(u64),
    Xfer {
        peer: u64,
        op: XferOp,
        /// (local address, remote address, length, index of the remote key)
        segs: Vec<(u64, u64, u64, usize)>,
        done: Completion,
    },
    Notify {
        peer: u64,
        from: String,
        msg: Vec<u8>,
    },
    Stop,
}

/// The agent's side of the progress thread.
pub(crate) struct RemoteTransport {
    ctx: Arc<ucx::Context>,
    address: Vec<u8>,
    cmds: mpsc::Sender<Cmd>,
    doorbell: Arc<OwnedFd>,
    next_peer: std::sync::atomic::AtomicU64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    describe: String,
    cuda: bool,
}

/// A connected peer, as the agent's handles hold it; dropping it closes the endpoint.
pub(crate) struct RemotePeer {
    id: u64,
    cmds: mpsc::Sender<Cmd>,
    doorbell: Arc<OwnedFd>,
}

fn ring(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes from a live u64 to an eventfd we own.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

impl RemotePeer {
    fn send(&self, c: Cmd) -> std::result::Result<(), String> {
        self.cmds
            .send(c)
            .map_err(|_| "the agent's UCX progress thread has stopped".to_string())?;
        ring(&self.doorbell);
        Ok(())
    }

    /// Sends a notification on its own.
    pub(crate) fn notify(&self, n: Notification) -> std::result::Result<(), String> {
        self.send(Cmd::Notify {
            peer: self.id,
            from: n.from,
            msg: n.msg,
        })
    }

    /// Posts `req`'s transfer; `done` runs on the progress thread once it finished.
    pub(crate) fn post(&self, req: &XferRequest, done: Completion) {
        let segs = req
            .local
            .iter()
            .zip(&req.remote)
            .map(|((l, _), (r, at))| (l.addr, r.addr, l.len, remote_index(at)))
            .collect();
        self.post_segs(req.op, segs, done);
    }

    /// Posts a transfer given as `(local address, remote address, length, remote
    /// registration index)`; every local range must stay valid until `done` runs.
    pub(crate) fn post_segs(
        &self,
        op: XferOp,
        segs: Vec<(u64, u64, u64, usize)>,
        done: Completion,
    ) {
        let c = Cmd::Xfer {
            peer: self.id,
            op,
            segs,
            done,
        };
        if let Err(mpsc::SendError(Cmd::Xfer { done, .. })) = self.cmds.send(c) {
            done.finish(Err("the agent's UCX progress thread has stopped".into()));
            return;
        }
        ring(&self.doorbell);
    }
}

/// The index of the peer's registration a remote descriptor lies in (`usize::MAX`, which
/// names none, for a registration in this process).
pub(crate) fn remote_index(at: &RemoteRef) -> usize {
    match at {
        RemoteRef::Ucx(k) => *k,
        RemoteRef::Local(_) => usize::MAX,
    }
}

impl Drop for RemotePeer {
    fn drop(&mut self) {
        let _ = self.send(Cmd::Disconnect(self.id));
    }
}

impl RemoteTransport {
    /// Starts the progress thread, or `None` where `mode` allows going without UCX.
    pub(crate) fn start(
        mode: UcxMode,
        name: &str,
        notifs: Arc<NotifQueue>,
    ) -> Result<Option<RemoteTransport>> {
        if mode == UcxMode::Off {
            return Ok(None);
        }
        let ctx = || Context::op(OpKind::Agent).with_backend("ucx");
        let started = Self::try_start(name, notifs);
        match (started, mode) {
            (Ok(t), _) => Ok(Some(t)),
            (Err(e), UcxMode::Required) => Err(Error::unsupported(ctx(), e)),
            (Err(e), _) => {
                tracing::info!("agent {name:?} without UCX (peers in this process only): {e}");
                Ok(None)
            }
        }
    }

    fn try_start(
        name: &str,
        notifs: Arc<NotifQueue>,
    ) -> std::result::Result<RemoteTransport, String> {
        let info = ucx::probe()?;
        let ctx = Arc::new(ucx::Context::new().map_err(|e| e.to_string())?);
        let cuda = ctx.supports_cuda();
        // SAFETY: eventfd with valid flags; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let doorbell = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = {
            let ctx = ctx.clone();
            let doorbell = doorbell.clone();
            std::thread::Builder::new()
                .name(format!("gpuio-agent-{name}"))
                .spawn(move || {
                    let worker = match ucx::Worker::new(&ctx) {
                        Ok(w) => w,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e.to_string()));
                            return;
                        }
                    };
                    let setup = worker
                        .address()
                        .map(|a| (a, worker.event_fd().unwrap_or(-1)))
                        .map_err(|e| e.to_string());
                    let (address, efd) = match setup {
                        Ok(x) => x,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let handler = worker.set_am_handler(
                        AM_NOTIFY,
                        Box::new(move |header: &[u8], data: &[u8]| {
                            notifs.push(Notification {
                                from: String::from_utf8_lossy(header).into_owned(),
                                msg: data.to_vec(),
                            });
                        }),
                    );
                    if let Err(e) = handler {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                    let _ = ready_tx.send(Ok(address));
                    Driver {
                        worker,
                        efd,
                        doorbell,
                        cmds: rx,
                        peers: HashMap::new(),
                        flushing: Vec::new(),
                        sending: Vec::new(),
                        stopping: false,
                    }
                    .run();
                })
                .map_err(|e| format!("spawning the UCX progress thread: {e}"))?
        };
        let address = ready_rx
            .recv()
            .map_err(|_| "the UCX progress thread exited while starting".to_string())??;
        Ok(RemoteTransport {
            ctx,
            address,
            cmds: tx,
            doorbell,
            next_peer: std::sync::atomic::AtomicU64::new(1),
            thread: Mutex::new(Some(thread)),
            describe: format!(
                "UCX {} ({}{})",
                info.version,
                info.library,
                if info.cuda { ", CUDA" } else { ", no CUDA" }
            ),
            cuda: cuda && info.cuda,
        })
    }

    pub(crate) fn describe(&self) -> String {
        self.describe.clone()
    }

    pub(crate) fn address(&self) -> Vec<u8> {
        self.address.clone()
    }

    /// Whether UCX can move device memory (its CUDA transports are present).
    pub(crate) fn has_cuda(&self) -> bool {
        self.cuda
    }

    /// Maps a registration for peers, or `None` where UCX cannot (device memory without its
    /// CUDA support): in-process peers can still use it.
    pub(crate) fn map(&self, mem: MemType, d: Desc) -> Option<RemoteAccess> {
        if mem == MemType::Device && !self.cuda {
            return None;
        }
        let kind = match mem {
            MemType::Host => ucx::MemType::Host,
            MemType::Device => ucx::MemType::Cuda,
        };
        // SAFETY: the registration owns (or its creator vouches for) this memory until it is
        // released, and releasing drops this handle only after every transfer here that
        // touches it has finished. Peers' own transfers are the caller's protocol (NIXL's
        // model; see the agent module's docs).
        let mapped = unsafe { self.ctx.mem_map(d.addr as *mut u8, d.len as usize, kind) }
            .and_then(|m| m.pack_rkey().map(|k| (m, k)));
        match mapped {
            Ok((memh, rkey)) => Some(RemoteAccess { _memh: memh, rkey }),
            Err(e) => {
                tracing::warn!("UCX cannot map {} bytes of {mem} memory: {e}", d.len);
                None
            }
        }
    }

    /// Connects to the peer `meta` describes.
    pub(crate) fn connect(&self, meta: &Metadata) -> std::result::Result<RemotePeer, String> {
        if meta.address.is_empty() {
            return Err(format!(
                "agent {:?} has no UCX address (it runs without UCX)",
                meta.name
            ));
        }
        let id = self
            .next_peer
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (reply, answer) = mpsc::channel();
        let peer = RemotePeer {
            id,
            cmds: self.cmds.clone(),
            doorbell: self.doorbell.clone(),
        };
        peer.send(Cmd::Connect {
            id,
            address: meta.address.clone(),
            rkeys: meta.regs.iter().map(|r| r.rkey.clone()).collect(),
            reply,
        })?;
        answer
            .recv()
            .map_err(|_| "the agent's UCX progress thread has stopped".to_string())??;
        Ok(peer)
    }
}

impl Drop for RemoteTransport {
    fn drop(&mut self) {
        let _ = self.cmds.send(Cmd::Stop);
        ring(&self.doorbell);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// A connected peer on the progress thread.
struct DriverPeer {
    /// Remote keys, by the index of the registration in the peer's metadata (`None` where it
    /// had none or UCX refused it).
    rkeys: Vec<Option<ucx::RKey>>,
    /// The endpoint's failure, once UCX reported one.
    failed: std::rc::Rc<std::cell::RefCell<Option<String>>>,
    ep: ucx::Endpoint,
}

/// Fields drop in order: endpoints (and their keys) before the worker.
struct Driver {
    peers: HashMap<u64, DriverPeer>,
    worker: ucx::Worker,
    efd: RawFd,
    doorbell: Arc<OwnedFd>,
    cmds: mpsc::Receiver<Cmd>,
    /// Flushes in flight, each ending a transfer.
    flushing: Vec<(ucx::Request, Completion, u64)>,
    /// Active messages in flight with the bytes they send.
    sending: Vec<(ucx::Request, Vec<u8>, Vec<u8>)>,
    stopping: bool,
}

impl Driver {
    fn run(mut self) {
        let mut last_activity = Instant::now();
        loop {
            let mut busy = self.take_commands();
            while self.worker.progress() > 0 {
                busy = true;
            }
            busy |= self.reap();
            if self.stopping && self.flushing.is_empty() && self.sending.is_empty() {
                break;
            }
            if busy {
                last_activity = Instant::now();
                continue;
            }
            // While transfers are out, keep progressing: UCX's TCP transport pushes a large
            // put or get along only as it is progressed, and its event fd does not fire for a
            // socket that has room to send again (sleeping there cost 5x on 16 MiB transfers).
            // Idle, spin a moment, then sleep on the event fd.
            if !self.flushing.is_empty() || !self.sending.is_empty() {
                std::hint::spin_loop();
                continue;
            }
            if last_activity.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            if self.efd < 0 {
                self.sleep_for(1);
                continue;
            }
            match self.worker.arm() {
                Ok(true) => self.sleep(),
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!("ucp_worker_arm: {e}");
                    self.sleep_for(1);
                }
            }
            last_activity = Instant::now() - SPIN;
        }
        self.peers.clear();
    }

    fn sleep(&self) {
        // While transfers are out, wake now and then even without an event: a peer that
        // died without a word is noticed by UCX's keepalive, which needs progress.
        let ms = if self.flushing.is_empty() { -1 } else { 100 };
        self.sleep_for(ms);
    }

    fn sleep_for(&self, ms: i32) {
        let mut fds = [
            libc::pollfd {
                fd: self.efd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.doorbell.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfds for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
        if fds[1].revents != 0 {
            let mut v = 0u64;
            // SAFETY: reading 8 bytes into a live u64 from our own non-blocking eventfd.
            unsafe { libc::read(self.doorbell.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        }
    }

    fn take_commands(&mut self) -> bool {
        let mut any = false;
        while let Ok(c) = self.cmds.try_recv() {
            any = true;
            match c {
                Cmd::Connect {
                    id,
                    address,
                    rkeys,
                    reply,
                } => {
                    let _ = reply.send(self.connect(id, &address, &rkeys));
                }
                Cmd::Disconnect(id) => {
                    self.peers.remove(&id);
                }
                Cmd::Xfer {
                    peer,
                    op,
                    segs,
                    done,
                } => self.transfer(peer, op, segs, done),
                Cmd::Notify { peer, from, msg } => {
                    if let Err(e) = self.send_notification(peer, from, msg) {
                        tracing::warn!("notification lost: {e}");
                    }
                }
                Cmd::Stop => self.stopping = true,
            }
        }
        any
    }

    fn connect(
        &mut self,
        id: u64,
        address: &[u8],
        rkeys: &[Vec<u8>],
    ) -> std::result::Result<(), String> {
        let failed = std::rc::Rc::new(std::cell::RefCell::new(None));
        let f = failed.clone();
        // SAFETY: the address comes from metadata whose checksum matched (`meta`), made by a
        // peer's `Worker::address`.
        let ep = unsafe {
            self.worker.connect(
                address,
                Box::new(move |e: ucx::UcsError| {
                    *f.borrow_mut() = Some(e.to_string());
                }),
            )
        }
        .map_err(|e| e.to_string())?;
        let rkeys = rkeys
            .iter()
            .map(|k| {
                if k.is_empty() {
                    None
                } else {
                    // SAFETY: the key was packed by the peer's UCX (`MemHandle::pack_rkey`)
                    // and arrived in checksummed metadata.
                    unsafe { ep.unpack_rkey(k) }.ok()
                }
            })
            .collect();
        self.peers.insert(id, DriverPeer { rkeys, failed, ep });
        Ok(())
    }

    fn transfer(
        &mut self,
        peer: u64,
        op: XferOp,
        segs: Vec<(u64, u64, u64, usize)>,
        done: Completion,
    ) {
        let Some(p) = self.peers.get(&peer) else {
            return done.finish(Err("the peer was removed".into()));
        };
        if let Some(why) = p.failed.borrow().clone() {
            return done.finish(Err(format!("the peer's endpoint failed: {why}")));
        }
        for (i, &(local, remote, len, k)) in segs.iter().enumerate() {
            let Some(Some(rkey)) = p.rkeys.get(k) else {
                return self.fail_after_flush(peer, done, format!("descriptor {i}: no remote key"));
            };
            // SAFETY: `local` lies in a registration `done` pins until the flush below has
            // completed (or failed), which is when UCX is done with it.
            let r = unsafe {
                match op {
                    XferOp::Read => p.ep.get(local as *mut u8, len as usize, remote, rkey),
                    XferOp::Write => p.ep.put(local as *const u8, len as usize, remote, rkey),
                }
            };
            // A request still running is freed: the flush below covers its completion.
            if let Err(e) = r {
                return self.fail_after_flush(peer, done, format!("descriptor {i}: {e}"));
            }
        }
        self.flush(peer, done, None);
    }

    /// Fails `done`, but only once what was issued before on the endpoint has finished.
    fn fail_after_flush(&mut self, peer: u64, done: Completion, why: String) {
        self.flush(peer, done, Some(why));
    }

    fn flush(&mut self, peer: u64, done: Completion, fail: Option<String>) {
        let Some(p) = self.peers.get(&peer) else {
            return done.finish(Err(fail.unwrap_or_else(|| "the peer was removed".into())));
        };
        match p.ep.flush() {
            Ok(Some(req)) => {
                let done = match fail {
                    Some(why) => {
                        // Parked with the failure; `reap` reports it after the flush.
                        self.flushing.push((req, done, peer));
                        return self.mark_failed_last(why);
                    }
                    None => done,
                };
                self.flushing.push((req, done, peer));
            }
            Ok(None) => self.finish(peer, done, fail.map_or(Ok(()), Err)),
            Err(e) => {
                // The endpoint is gone: nothing it issued can still run.
                self.finish(peer, done, Err(fail.unwrap_or_else(|| e.to_string())))
            }
        }
    }

    fn mark_failed_last(&mut self, why: String) {
        if let Some((_, done, _)) = self.flushing.last_mut() {
            done.set_failure(why);
        }
    }

    /// Completes the transfers whose flush finished; whether anything happened.
    fn reap(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.flushing.len() {
            match self.flushing[i].0.check() {
                None => i += 1,
                Some(r) => {
                    any = true;
                    let (_req, done, peer) = self.flushing.swap_remove(i);
                    self.finish(peer, done, r.map_err(|e| e.to_string()));
                }
            }
        }
        self.sending.retain(|(req, _, _)| {
            let running = req.check().is_none();
            any |= !running;
            running
        });
        any
    }

    fn finish(&mut self, peer: u64, mut done: Completion, r: std::result::Result<(), String>) {
        let r = match done.take_failure() {
            Some(why) => Err(why),
            None => r,
        };
        if r.is_ok() {
            if let Some(n) = done.take_notification() {
                if let Err(e) = self.send_notification(peer, n.from, n.msg) {
                    return done.finish(Err(format!("the data landed; its notification: {e}")));
                }
            }
        }
        done.finish(r);
    }

    fn send_notification(
        &mut self,
        peer: u64,
        from: String,
        msg: Vec<u8>,
    ) -> std::result::Result<(), String> {
        let Some(p) = self.peers.get(&peer) else {
            return Err("the peer was removed".into());
        };
        let header = from.into_bytes();
        // SAFETY: `header` and `msg` move into `sending` with the request and stay there
        // until it completes.
        match unsafe { p.ep.am_send(AM_NOTIFY, &header, &msg) } {
            Ok(Some(req)) => {
                self.sending.push((req, header, msg));
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }
}
