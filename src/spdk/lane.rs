//! The reactor's SPDK lane: one I/O queue pair per namespace in use, commands submitted from
//! bounce slots, completions polled while any are outstanding.
//!
//! Everything here runs on the reactor thread, which is what SPDK requires of a qpair.
//! Commands that find the request pool full wait in a queue and go out as completions free
//! requests. A qpair that fails (the target went away) is freed, which completes its
//! commands as aborted, so every op in flight gets an error; the next command tries to
//! reconnect (at most once a second), and fails at once while the target is unreachable.
//! A qpair that makes no progress for `GPUIO_SPDK_TIMEOUT_SECS` (default 30) with commands
//! outstanding is treated as failed the same way: nothing waits forever.
//!
//! Writes that do not cover whole sectors (the unaligned head or tail of a write) are done as
//! read-modify-write of that one sector in DMA memory; such writes to the same sector are
//! serialised, so concurrent writers of different bytes of one sector never lose each other's
//! bytes.

use std::collections::{HashSet, VecDeque};
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use slab::Slab;

use crate::lane::{Completion, IoKind, Lane, LaneIo, LaneMem, Route, RouteAsk, Routed, WaitHint};
use crate::spdk::cmd::{Cmd, DONE, Opcode, on_complete, status_errno};
use crate::spdk::ctrlr::{Namespace, NvmeCmd, Qpair, SectorIo};
use crate::spdk::env::DmaRegion;

/// One namespace's queue on this reactor.
struct NsQueue {
    ns: Arc<Namespace>,
    qpair: Option<Qpair>,
    /// Commands inside SPDK.
    outstanding: usize,
    /// Commands waiting for a free request (SPDK said -ENOMEM).
    waiting: VecDeque<Box<Cmd>>,
    /// Sectors under read-modify-write, and partial writes waiting for one of them.
    rmw_locked: HashSet<u64>,
    rmw_waiting: VecDeque<Box<Cmd>>,
    /// Why the qpair is down, and when to try again.
    down: Option<(String, Instant)>,
    last_progress: Instant,
}

/// One I/O the reactor hands the lane: `len` bytes at namespace position `pos` through slot
/// memory `buf` (null for a flush).
pub(crate) struct NvmeIo {
    pub(crate) token: u64,
    pub(crate) kind: IoKind,
    /// A write that covers only part of its sectors (read-modify-write).
    pub(crate) partial: bool,
    pub(crate) buf: *mut u8,
    pub(crate) pos: u64,
    pub(crate) len: usize,
}

/// The reactor's SPDK lane.
pub(crate) struct SpdkLane {
    queues: Slab<NsQueue>,
    /// Completions decided without SPDK (end of namespace, submit errors).
    ready: Vec<Completion>,
    stall: Duration,
    /// Queue keys to visit in one `reap` (kept to avoid an allocation per poll).
    keys: Vec<usize>,
}

/// How long a down qpair waits before the next reconnect attempt.
const RECONNECT_EVERY: Duration = Duration::from_secs(1);

impl SpdkLane {
    pub(crate) fn new() -> Self {
        let stall = std::env::var("GPUIO_SPDK_TIMEOUT_SECS")
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map_or(Duration::from_secs(30), Duration::from_secs_f64);
        SpdkLane {
            queues: Slab::new(),
            ready: Vec::new(),
            stall,
            keys: Vec::new(),
        }
    }

    /// Commands inside SPDK or waiting, on every queue.
    pub(crate) fn outstanding(&self) -> usize {
        self.queues
            .iter()
            .map(|(_, q)| q.outstanding + q.waiting.len() + q.rmw_waiting.len())
            .sum()
    }

    /// Whether the reactor must not sleep: completions to hand over or commands to poll.
    pub(crate) fn busy(&self) -> bool {
        !self.ready.is_empty() || self.outstanding() > 0
    }

    fn queue_of(&mut self, ns: &Arc<Namespace>) -> usize {
        if let Some((i, _)) = self.queues.iter().find(|(_, q)| Arc::ptr_eq(&q.ns, ns)) {
            return i;
        }
        self.queues.insert(NsQueue {
            ns: ns.clone(),
            qpair: None,
            outstanding: 0,
            waiting: VecDeque::new(),
            rmw_locked: HashSet::new(),
            rmw_waiting: VecDeque::new(),
            down: None,
            last_progress: Instant::now(),
        })
    }

    /// Starts `io` on `ns`. The result arrives as a [`Completion`] for `io.token` from
    /// [`reap`](Self::reap).
    pub(crate) fn submit(&mut self, ns: &Arc<Namespace>, io: NvmeIo) {
        let NvmeIo {
            token,
            kind,
            partial,
            buf,
            pos,
            len,
        } = io;
        let q = self.queue_of(ns);
        let opcode = match kind {
            IoKind::Read => Opcode::Read,
            IoKind::Fsync => Opcode::Flush,
            IoKind::Write if partial => Opcode::RmwRead,
            IoKind::Write => Opcode::Write,
        };
        let mut len = len;
        if kind == IoKind::Read {
            // Past the end of the namespace reads as end of file, like a file's.
            if pos >= ns.size {
                self.ready.push(Completion { token, res: 0 });
                return;
            }
            len = len.min((ns.size - pos) as usize);
        } else if kind == IoKind::Write && pos.checked_add(len as u64).is_none_or(|e| e > ns.size) {
            self.ready.push(Completion {
                token,
                res: -libc::ENOSPC,
            });
            return;
        }
        let cmd = Box::new(Cmd {
            token,
            opcode,
            buf,
            pos,
            len,
            rmw: None,
            queue: q,
        });
        if opcode == Opcode::RmwRead {
            self.start_rmw(cmd);
        } else {
            self.issue(cmd);
        }
    }

    /// Takes the sector lock of a partial write and reads the sector, or queues it behind the
    /// write holding the lock.
    fn start_rmw(&mut self, mut cmd: Box<Cmd>) {
        let q = &mut self.queues[cmd.queue];
        let sector = q.ns.sector;
        let (first, count) = cmd.rmw_span(sector);
        if (first..first + count).any(|l| q.rmw_locked.contains(&l)) {
            q.rmw_waiting.push_back(cmd);
            return;
        }
        q.rmw_locked.extend(first..first + count);
        match DmaRegion::new((count * sector) as usize, sector.max(64) as usize) {
            Ok(r) => {
                cmd.rmw = Some(r);
                self.issue(cmd);
            }
            Err(why) => {
                tracing::warn!(%why, "no DMA memory for a partial-sector write");
                for l in first..first + count {
                    q.rmw_locked.remove(&l);
                }
                self.ready.push(Completion {
                    token: cmd.token,
                    res: -libc::ENOMEM,
                });
            }
        }
    }

    /// Gives a command to SPDK, connecting the qpair first if needed.
    fn issue(&mut self, cmd: Box<Cmd>) {
        let qi = cmd.queue;
        if let Err(res) = self.ensure_connected(qi) {
            self.finish(cmd, res);
            return;
        }
        let q = &mut self.queues[qi];
        if !q.waiting.is_empty() {
            // Keep order behind commands already waiting for requests.
            q.waiting.push_back(cmd);
            return;
        }
        if let Err((cmd, res)) = Self::send(q, cmd) {
            if res == -libc::ENOMEM {
                self.queues[qi].waiting.push_back(cmd);
            } else if res == -libc::ENXIO {
                self.finish(cmd, -libc::ECONNRESET);
                self.fail_queue(qi, "the queue pair failed".into());
            } else {
                self.finish(cmd, res);
            }
        }
    }

    /// One submission to SPDK. On refusal, the command comes back with the errno.
    fn send(q: &mut NsQueue, cmd: Box<Cmd>) -> Result<(), (Box<Cmd>, i32)> {
        let sector = q.ns.sector;
        let Some(qp) = q.qpair.as_mut() else {
            return Err((cmd, -libc::ENOTCONN));
        };
        let (buf, lba, count) = match (cmd.opcode, &cmd.rmw) {
            (Opcode::RmwRead | Opcode::RmwWrite, Some(r)) => {
                let (first, count) = cmd.rmw_span(sector);
                (r.as_ptr(), first, count as u32)
            }
            _ => (
                cmd.buf,
                cmd.pos / sector,
                (cmd.len as u64).div_ceil(sector) as u32,
            ),
        };
        let opcode = cmd.opcode;
        let arg = Box::into_raw(cmd).cast::<c_void>();
        let io = SectorIo {
            cmd: match opcode {
                Opcode::Flush => NvmeCmd::Flush,
                Opcode::Read | Opcode::RmwRead => NvmeCmd::Read,
                Opcode::Write | Opcode::RmwWrite => NvmeCmd::Write,
            },
            buf: buf.cast(),
            lba,
            count,
        };
        // SAFETY: `ns` and the qpair belong to the same attached controller (the queue holds
        // both); the qpair is used only on this thread; `buf` points to at least
        // `count * sector` bytes the reactor owns until the callback runs (a bounce slot sized
        // and aligned for the sector, or the RMW sector buffer); `arg` is reclaimed exactly
        // once, by the callback, or below when SPDK refuses the command.
        let rc = unsafe { qp.submit(&q.ns, io, on_complete, arg) };
        if rc != 0 {
            // SAFETY: SPDK refused the command, so it never calls back with `arg`.
            let cmd = unsafe { Box::from_raw(arg.cast::<Cmd>()) };
            return Err((cmd, if rc < 0 { rc } else { -libc::EIO }));
        }
        if q.outstanding == 0 {
            q.last_progress = Instant::now();
        }
        q.outstanding += 1;
        Ok(())
    }

    /// Makes sure queue `qi` has a connected qpair, reconnecting if it is down and the last
    /// attempt is old enough. Returns the errno to fail commands with otherwise.
    fn ensure_connected(&mut self, qi: usize) -> Result<(), i32> {
        let q = &mut self.queues[qi];
        if q.qpair.is_some() {
            return Ok(());
        }
        if let Some((why, at)) = &q.down {
            if at.elapsed() < RECONNECT_EVERY {
                tracing::debug!(trid = %q.ns.ctrlr.trid, %why, "NVMe queue down");
                return Err(-libc::ENOTCONN);
            }
        }
        let was_down = q.down.is_some();
        let attempt = if was_down {
            // The admin connection died with the target: reset reconnects it.
            q.ns.ctrlr.reset().and_then(|()| q.ns.ctrlr.alloc_qpair())
        } else {
            q.ns.ctrlr.alloc_qpair()
        };
        match attempt {
            Ok(qp) => {
                if was_down {
                    tracing::info!(trid = %q.ns.ctrlr.trid, "NVMe queue reconnected");
                }
                q.qpair = Some(qp);
                q.down = None;
                Ok(())
            }
            Err(why) => {
                tracing::warn!(trid = %q.ns.ctrlr.trid, %why, "NVMe queue cannot connect");
                q.down = Some((why, Instant::now()));
                Err(-libc::ENOTCONN)
            }
        }
    }

    /// The qpair of queue `qi` failed: free it (SPDK completes its commands as aborted), fail
    /// everything waiting, and leave it down until the next command reconnects.
    fn fail_queue(&mut self, qi: usize, why: String) {
        let q = &mut self.queues[qi];
        tracing::warn!(trid = %q.ns.ctrlr.trid, %why, outstanding = q.outstanding, "NVMe queue failed");
        // Dropping the qpair runs the callbacks of everything it held (into DONE).
        q.qpair = None;
        q.down = Some((why, Instant::now()));
        let waiting: Vec<_> = q.waiting.drain(..).chain(q.rmw_waiting.drain(..)).collect();
        for cmd in waiting {
            self.finish(cmd, -libc::ECONNRESET);
        }
        self.drain_done();
        let q = &mut self.queues[qi];
        if q.outstanding != 0 {
            // SPDK did not complete some command: its memory may still be written. Keep the
            // count so the engine never reuses what it cannot account for.
            tracing::error!(
                left = q.outstanding,
                "NVMe commands lost with their queue pair"
            );
        }
    }

    /// Ends a command with `res` (bytes or negative errno), following up a read-modify-write.
    fn finish(&mut self, mut cmd: Box<Cmd>, res: i32) {
        match cmd.opcode {
            Opcode::RmwRead if res >= 0 => {
                let sector = self.queues[cmd.queue].ns.sector;
                let (first, count) = cmd.rmw_span(sector);
                let at = (cmd.pos - first * sector) as usize;
                let r = cmd
                    .rmw
                    .as_ref()
                    .expect("RMW commands carry their sector buffer");
                debug_assert!(at + cmd.len <= (count * sector) as usize && r.len() >= at + cmd.len);
                // SAFETY: `r` holds `count * sector` bytes covering `[pos, pos + len)` (that is
                // how `rmw_span` sized it), so `at + len` stays inside; `cmd.buf` holds `len`
                // bytes of the caller's data in a slot the reactor owns until this command
                // completes.
                unsafe { std::ptr::copy_nonoverlapping(cmd.buf, r.as_ptr().add(at), cmd.len) };
                cmd.opcode = Opcode::RmwWrite;
                self.issue(cmd);
            }
            Opcode::RmwRead | Opcode::RmwWrite => {
                let q = &mut self.queues[cmd.queue];
                let (first, count) = cmd.rmw_span(q.ns.sector);
                for l in first..first + count {
                    q.rmw_locked.remove(&l);
                }
                // Waiting partial writes may now find their sectors free; retry them all
                // (start_rmw queues again any that still conflict).
                let waiting: Vec<_> = q.rmw_waiting.drain(..).collect();
                self.ready.push(Completion {
                    token: cmd.token,
                    res: if res >= 0 { cmd.len as i32 } else { res },
                });
                drop(cmd);
                for n in waiting {
                    self.start_rmw(n);
                }
            }
            Opcode::Read | Opcode::Write | Opcode::Flush => self.ready.push(Completion {
                token: cmd.token,
                res: if res >= 0 && cmd.opcode != Opcode::Flush {
                    cmd.len as i32
                } else if res >= 0 {
                    0
                } else {
                    res
                },
            }),
        }
    }

    /// Handles what SPDK's callbacks collected.
    fn drain_done(&mut self) {
        loop {
            let done = DONE.with(|d| d.take());
            if done.is_empty() {
                return;
            }
            for (cmd, sct, sc) in done {
                let q = &mut self.queues[cmd.queue];
                q.outstanding -= 1;
                q.last_progress = Instant::now();
                let res = status_errno(sct, sc);
                if res != 0 {
                    tracing::debug!(sct, sc, pos = cmd.pos, "NVMe command failed");
                }
                self.finish(cmd, res);
            }
        }
    }

    /// Polls every queue with commands outstanding, retries waiting commands, fails stalled or
    /// broken qpairs, and moves finished I/O into `out`.
    pub(crate) fn reap(&mut self, out: &mut Vec<Completion>) {
        let mut keys = std::mem::take(&mut self.keys);
        keys.clear();
        keys.extend(self.queues.iter().map(|(k, _)| k));
        for &qi in &keys {
            let q = &mut self.queues[qi];
            if q.outstanding == 0 && q.waiting.is_empty() {
                continue;
            }
            let rc = match q.qpair.as_mut() {
                Some(qp) => qp.process_completions(),
                None => -libc::ENXIO,
            };
            self.drain_done();
            if rc < 0 {
                self.fail_queue(
                    qi,
                    format!(
                        "the connection failed ({})",
                        crate::spdk::ctrlr::errno_name(-rc)
                    ),
                );
                continue;
            }
            let q = &mut self.queues[qi];
            if q.outstanding > 0 && q.last_progress.elapsed() > self.stall {
                let why = format!("no completion for {:?}", self.stall);
                self.fail_queue(qi, why);
                continue;
            }
            // Requests were freed: send what waits for them, in order.
            while let Some(cmd) = self.queues[qi].waiting.pop_front() {
                match Self::send(&mut self.queues[qi], cmd) {
                    Ok(()) => {}
                    Err((cmd, e)) if e == -libc::ENOMEM => {
                        self.queues[qi].waiting.push_front(cmd);
                        break;
                    }
                    Err((cmd, e)) => self.finish(cmd, e),
                }
            }
        }
        self.keys = keys;
        self.drop_unused();
        out.append(&mut self.ready);
    }

    /// Frees the qpairs of namespaces nobody has open any more (and so their controllers).
    fn drop_unused(&mut self) {
        self.queues.retain(|_, q| {
            Arc::strong_count(&q.ns) > 1
                || q.outstanding > 0
                || !q.waiting.is_empty()
                || !q.rmw_waiting.is_empty()
        });
    }
}

impl Lane for SpdkLane {
    fn name(&self) -> &'static str {
        "spdk"
    }

    fn push(&mut self, io: LaneIo<'_>) -> std::io::Result<()> {
        let Some(ns) = io.target.nvme.as_ref() else {
            return Err(std::io::Error::other("not an NVMe namespace"));
        };
        let buf = match io.mem {
            LaneMem::Host { ptr, .. } => ptr,
            _ => std::ptr::null_mut(),
        };
        let nvme = NvmeIo {
            token: io.token,
            kind: io.kind,
            partial: io.via == crate::plan::Via::Buffered,
            buf,
            pos: io.pos,
            len: io.len,
        };
        self.submit(&ns.clone(), nvme);
        Ok(())
    }

    fn wait(
        &mut self,
        _block: bool,
        _timeout: Option<Duration>,
        out: &mut Vec<Completion>,
    ) -> std::io::Result<()> {
        let before = out.len();
        self.reap(out);
        if out.len() == before && self.busy() {
            // Nothing yet: let the threads that consume completions (often on the same core)
            // run before polling again.
            std::thread::yield_now();
        }
        Ok(())
    }

    fn outstanding(&self) -> usize {
        SpdkLane::outstanding(self)
    }

    fn wait_hint(&self) -> WaitHint {
        // NVMe completions are found only by polling: spin while commands are out.
        if self.busy() {
            WaitHint::Spin
        } else {
            WaitHint::Sleep
        }
    }

    /// Every op on an NVMe namespace, in pieces its queue pairs take.
    fn route(&mut self, ask: &RouteAsk<'_>) -> Routed {
        match &ask.target.nvme {
            Some(ns) => Routed::Take(Route {
                align: 1,
                chunk: ns.chunk(ask.direct_chunk),
                backend: "spdk",
                staging: None,
            }),
            None => Routed::No,
        }
    }
}

impl Drop for SpdkLane {
    fn drop(&mut self) {
        // Freeing the qpairs completes anything left (as aborted) into DONE; drop those boxes.
        self.queues.clear();
        drop(DONE.with(|d| d.take()));
    }
}
