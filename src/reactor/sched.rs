//! Scheduling: which pieces start, within the queue depth, the slot pools and each op's window
//! (round-robin between ops), the range fence, and which lane each piece goes to.

use super::entry::{Queue, Reader};
use super::{InflightIo, Reactor};
use crate::buf::arena::BounceSlot;
use crate::error::{Error, OpKind};
use crate::lane::{Completion, IoKind, Lane, LaneIo, LaneMem};
use crate::op::ReadyPiece;
use crate::plan::{Piece, Via, residency};
use crate::target::Target;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;

/// Which descriptor a piece of a residency-aware read goes through: the O_DIRECT twin where
/// the page cache lacks a quarter or more of it, else the buffered descriptor (also when the
/// kernel cannot say).
fn residency_via(file: &Target, piece: Piece) -> Via {
    let Some(fd) = file.fd.as_ref() else {
        return Via::Main;
    };
    match residency::estimate(fd.as_fd(), piece.pos, piece.len as u64) {
        Ok(r) if r.prefers_direct() => Via::Direct,
        _ => Via::Main,
    }
}

/// Whether `piece` of `file` goes to io-wq as a buffered copy (`IOSQE_ASYNC`): buffered, and
/// at least `punt_min` bytes. Small ones stay inline (a punt costs a switch).
fn punts(punt_min: Option<usize>, file: &Target, piece: &Piece) -> bool {
    let buffered = match piece.via {
        Via::Buffered => true,
        Via::Main => file.align == 1,
        Via::Direct => false,
    };
    buffered && punt_min.is_some_and(|m| piece.len >= m)
}

/// Whether a piece counts against the cap on page-cache copies: a read punted to io-wq into
/// host memory (a bounce slot or an owned buffer; cuFile's device staging slots do not count).
fn page_cache_copy(
    punt_min: Option<usize>,
    file: &Target,
    piece: &Piece,
    kind: OpKind,
    on_device: bool,
) -> bool {
    kind == OpKind::Read && !on_device && punts(punt_min, file, piece)
}

/// How many open reads land in host memory and in each GPU's: what the cap on page-cache
/// copies follows ([`Reactor::page_cache_cap`]).
#[derive(Debug, Default)]
pub(super) struct Readers {
    host: usize,
    /// (GPU number, open reads into it); a handful of GPUs at most.
    devices: Vec<(u32, usize)>,
}

impl Readers {
    pub(super) fn add(&mut self, r: Reader) {
        match r {
            Reader::Host => self.host += 1,
            Reader::Device(d) => match self.devices.iter_mut().find(|(n, _)| *n == d) {
                Some((_, c)) => *c += 1,
                None => self.devices.push((d, 1)),
            },
        }
    }

    /// Whether no read is open.
    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.host == 0 && self.devices.is_empty()
    }

    pub(super) fn remove(&mut self, r: Reader) {
        match r {
            Reader::Host => self.host -= 1,
            Reader::Device(d) => {
                if let Some(i) = self.devices.iter().position(|(n, _)| *n == d) {
                    self.devices[i].1 -= 1;
                    if self.devices[i].1 == 0 {
                        self.devices.swap_remove(i);
                    }
                }
            }
        }
    }
}

impl Reactor {
    /// Most page-cache copies at once now. Where every open read lands in GPU memory, a GPU's
    /// host-to-device link is what the copies feed, and it fills with a dozen of them
    /// (`ReactorConfig::copies_per_device`): more only fight over memory bandwidth and the
    /// cores the device copies and the callers need (measured on the 32-core host: one GPU
    /// ran at 48.6–49.8 GB/s with 12 copies, 39.8–41.3 with 24). So the cap is that many per
    /// GPU in use, within the machine's own cap; with host reads open, the machine's cap.
    pub(super) fn page_cache_cap(&self) -> usize {
        let gpus = self.readers.devices.len();
        if gpus == 0 || self.readers.host > 0 {
            return self.cfg.page_cache_copies;
        }
        self.cfg
            .page_cache_copies
            .min(self.cfg.copies_per_device.saturating_mul(gpus))
            .max(1)
    }

    /// Page-cache copies this reactor may start now. The cap is the engine's: each of its
    /// reactors may always run its share (the cap over the reactors, rounded up), and past it
    /// borrows what the others leave of the cap (`EngineShared::page_cache_copies`), so one
    /// large read on one reactor copies as widely as with one reactor. An op parks only where
    /// this reactor holds its share in copies of its own, whose end unparks it: no reactor
    /// waits for another. With one reactor, the cap less the copies in flight.
    ///
    /// The cap is a target, not a hard bound: a reactor below its share starts copies whatever
    /// the others hold, so while one has borrowed the whole cap the engine may run up to
    /// `cap + (reactors - 1) * share` until the borrowed copies end (and borrowers that look
    /// at once may each take the last free copy). Each reactor computes the cap from the reads
    /// open on it (`page_cache_cap`), so the per-GPU cap follows its own reads.
    pub(super) fn copies_free(&self) -> usize {
        let cap = self.page_cache_cap();
        let own = cap
            .div_ceil(self.cfg.reactors.max(1))
            .saturating_sub(self.page_cache_copies_in_flight);
        let engine = self.engine.page_cache_copies.load(Ordering::Relaxed);
        own.max(cap.saturating_sub(engine))
    }

    /// Counts a page-cache copy started (`up`) or ended, here and engine-wide.
    pub(super) fn count_copy(&mut self, up: bool) {
        if up {
            self.page_cache_copies_in_flight += 1;
            self.engine
                .page_cache_copies
                .fetch_add(1, Ordering::Relaxed);
        } else {
            self.page_cache_copies_in_flight -= 1;
            self.engine
                .page_cache_copies
                .fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Starts pieces while the queue depth, the bounce pool and the page-cache copies allow.
    /// Ops parked for a copy are woken while copies are free, before and after each pass: a
    /// woken op may start no copy at all (its next pieces go O_DIRECT, lie past the end of
    /// the file, or it was cancelled), and the free copy then goes to the next parked op.
    pub(super) fn schedule(&mut self) {
        loop {
            self.wake_parked();
            self.schedule_pass();
            if !self.may_wake_parked() {
                break;
            }
        }
    }

    /// Whether a copy is free and an op waits for one (stale keys at the front are dropped).
    fn may_wake_parked(&mut self) -> bool {
        while let Some(&key) = self.page_cache_parked.front() {
            if self
                .ops
                .get(key)
                .is_some_and(|op| op.queue == Queue::PageCacheParked)
            {
                return self.copies_free() > 0;
            }
            self.page_cache_parked.pop_front();
        }
        false
    }

    /// Puts parked ops back in the run queue, oldest first, one per free copy.
    fn wake_parked(&mut self) {
        let mut free = self.copies_free();
        while free > 0 && self.may_wake_parked() {
            let Some(key) = self.page_cache_parked.pop_front() else {
                break;
            };
            self.ops[key].queue = Queue::Runnable;
            self.runnable.push_back(key);
            free -= 1;
        }
    }

    /// One pass of [`schedule`](Self::schedule).
    fn schedule_pass(&mut self) {
        self.unfence();
        let qd = self.cfg.queue_depth;
        while self.ios.len() < qd {
            let Some((key, p)) = self.to_submit.pop_front() else {
                break;
            };
            if self.ops[key].stopped() {
                self.ops[key].busy -= 1;
                self.free_op_slot(key, p.slot);
                self.maybe_finish(key);
                continue;
            }
            self.submit_io(key, IoKind::Write, p.piece, Some(p.slot));
        }
        let mut starved = false;
        let mut starved_on_device = false;
        while let Some(&key) = self.runnable.front() {
            let copy_free = self.copies_free() > 0;
            let op = &mut self.ops[key];
            if op.all_started() {
                self.runnable.pop_front();
                op.queue = Queue::Idle;
                self.maybe_finish(key);
                continue;
            }
            let (mut piece, retried) = match op.retry.last() {
                Some(p) => (*p, true),
                None => (op.plan.piece(op.next), false),
            };
            if op.residency && !retried {
                piece.via = residency_via(&op.file, piece);
            }
            if !retried && op.kind == OpKind::Read && op.eof_at.is_some_and(|e| piece.pos >= e) {
                // Past a known end of file: nothing to read.
                op.next += 1;
                continue;
            }
            // Writes also count filled pieces waiting for the kernel. Pieces out for filling
            // are bounded per op by the window instead: a leaked write holds them forever,
            // and must not stop other ops.
            let room = match op.kind {
                OpKind::Write => self.ios.len() + self.to_submit.len() < qd,
                _ => self.ios.len() < qd,
            };
            if !room {
                break;
            }
            let on_device = op.device_staged() && piece.via == Via::Main;
            if !copy_free
                && page_cache_copy(self.cfg.punt_min, &op.file, &piece, op.kind, on_device)
            {
                // Every page-cache copy is taken: this op waits for one to end, and ops
                // behind it (small reads, direct ones) go on.
                op.queue = Queue::PageCacheParked;
                self.runnable.pop_front();
                self.page_cache_parked.push_back(key);
                continue;
            }
            let slot = if op.kind == OpKind::Sync || op.owned.is_some() {
                // Fsync needs no memory; an owned read lands in the caller's buffer.
                None
            } else {
                if op.held_bytes > 0 && op.held_bytes + piece.len > self.op_window {
                    // This op holds its share of the pool; let others run until it gives
                    // slots back (free_op_slot re-queues it).
                    op.queue = Queue::WindowBlocked;
                    self.window_blocked_ops += 1;
                    self.runnable.pop_front();
                    continue;
                }
                let op = &mut self.ops[key];
                match self.slots.alloc(on_device, piece.len) {
                    Some(s) => {
                        op.held_bytes += s.size();
                        Some(s)
                    }
                    None => {
                        let fits = self.slots.fits(on_device, piece.len);
                        if !fits {
                            // Waiting would never end: no slot of this size exists. The
                            // planner never makes such pieces (its fuzz target checks that);
                            // if one ever appears, fail the op rather than hang.
                            let why = format!(
                                "a {}-byte piece exceeds the largest bounce slot",
                                piece.len
                            );
                            op.fail(Error::invalid(op.ctx(piece.pos), why));
                            continue;
                        }
                        starved = true;
                        starved_on_device = on_device;
                        break;
                    }
                }
            };
            let op = &mut self.ops[key];
            if retried {
                op.retry.pop();
            } else {
                op.next += 1;
            }
            op.busy += 1;
            // Round-robin between ops so one huge request cannot starve small ones.
            self.runnable.pop_front();
            if !op.all_started() {
                self.runnable.push_back(key);
            } else {
                op.queue = Queue::Idle;
            }
            match (op.kind, slot) {
                (OpKind::Write, Some(slot)) => {
                    op.shared.push_ready(ReadyPiece {
                        piece,
                        valid: piece.len,
                        slot,
                    });
                }
                (OpKind::Sync, _) => self.submit_io(key, IoKind::Fsync, piece, None),
                (_, slot) => self.submit_io(key, IoKind::Read, piece, slot),
            }
        }
        self.short_of_slots = starved || self.window_blocked_ops > 0;
        self.pool_starved = starved;
        self.doorbell.set_starved(self.short_of_slots);
        if starved {
            if self.check_pool_stall(starved_on_device) {
                // New memory: start what waited for it (growth is bounded, so is this).
                self.schedule();
            }
        } else {
            self.stall = None;
        }
    }

    fn submit_io(&mut self, key: usize, kind: IoKind, piece: Piece, slot: Option<BounceSlot>) {
        let op = &self.ops[key];
        let ticket = (kind != IoKind::Fsync).then(|| {
            // Widened to the file's grain: a page for O_DIRECT files (whose buffered write
            // edges must not share a page with another op's direct piece), a sector for NVMe.
            let grain = op.align.max(op.file.write_align);
            self.fence.start(
                op.file.fence_key,
                piece.pos,
                piece.len as u64,
                grain,
                key,
                kind == IoKind::Write,
            )
        });
        let blocked = ticket.as_ref().is_some_and(|t| self.fence.blocked(t));
        // Owned reads (no slot) copy out of the page cache too; cuFile's staging slots do not.
        let by_copy = kind == IoKind::Read
            && page_cache_copy(
                self.cfg.punt_min,
                &op.file,
                &piece,
                op.kind,
                slot.as_ref().is_some_and(|s| s.on_device),
            );
        if by_copy {
            self.count_copy(true);
        }
        let token = self.ios.insert(InflightIo {
            op: key,
            kind,
            piece,
            slot,
            done: 0,
            ticket,
            page_cache_copy: by_copy,
            lane: None,
        });
        if blocked {
            self.fenced.push_back(token);
        } else {
            self.push_io(token);
        }
    }

    /// Sends fenced pieces whose earlier overlapping writes have completed to the kernel, and
    /// drops those of cancelled ops (they never reach the kernel). Pieces of ops that failed
    /// still run: every piece below the failing offset is then written, so the offset the
    /// error names is the first byte not transferred.
    fn unfence(&mut self) {
        let mut i = 0;
        while i < self.fenced.len() {
            let token = self.fenced[i];
            let io = &self.ios[token];
            if self.ops[io.op].cancelled() {
                self.fenced.remove(i);
                self.drop_unstarted(token);
                continue;
            }
            if io.ticket.as_ref().is_some_and(|t| self.fence.blocked(t)) {
                i += 1;
                continue;
            }
            self.fenced.remove(i);
            self.push_io(token);
        }
    }

    /// Takes a piece out of `ios`, done or never started: its place in the fence and in the
    /// count of page-cache copies go with it.
    pub(super) fn retire_io(&mut self, token: usize) -> InflightIo {
        let io = self.ios.remove(token);
        if let Some(t) = &io.ticket {
            self.fence.release(t);
        }
        // A parked op takes the freed copy at the next `schedule`.
        if io.page_cache_copy {
            self.count_copy(false);
        }
        io
    }

    /// Forgets a piece that never reached the kernel.
    fn drop_unstarted(&mut self, token: usize) {
        let io = self.retire_io(token);
        self.ops[io.op].busy -= 1;
        if let Some(slot) = io.slot {
            self.free_op_slot(io.op, slot);
        }
        self.maybe_finish(io.op);
    }

    /// (Re)submits the unfinished remainder of in-flight I/O `token` to its lane: the side lane
    /// that took its op (`Lane::route`), or the main lane.
    pub(super) fn push_io(&mut self, token: usize) {
        let io = &self.ios[token];
        let op = &self.ops[io.op];
        let file = &op.file;
        let (pos, len) = (io.piece.pos + io.done as u64, io.piece.len - io.done);
        let mem = match (&io.slot, &op.owned) {
            (Some(s), _) if s.on_device => LaneMem::Device {
                offset: s.offset + io.done,
            },
            (Some(s), _) => LaneMem::Host {
                // SAFETY: `done <= piece.len <= slot size`, so the pointer stays in the slot.
                ptr: unsafe { self.arena.slot_ptr(s).add(io.done) },
                fixed: self
                    .main
                    .as_ref()
                    .is_some_and(|l| l.uses_fixed_buffers())
                    .then(|| self.slots.fixed_index(s, &self.arena))
                    .flatten(),
            },
            // `accept` checked that the pieces cover exactly `[offset, offset + len)`, the
            // buffer's bytes, so `pos - offset + done < len`: the address stays inside the
            // buffer, which the op owns until every piece has completed. The kernel is the
            // only writer meanwhile (the future holds no access to it).
            (None, Some(o)) => LaneMem::Host {
                ptr: (o.addr + (io.piece.pos - op.offset) as usize + io.done) as *mut u8,
                fixed: None,
            },
            (None, None) => LaneMem::None,
        };
        // Buffered pieces large enough to be worth a kernel worker go to io-wq, so page-cache
        // hits are copied by many threads. The remainder of a short read is judged by its own
        // length.
        let rest = Piece { len, ..io.piece };
        let punt = io.kind != IoKind::Fsync && punts(self.cfg.punt_min, file, &rest);
        let lane_io = LaneIo {
            token: token as u64,
            kind: io.kind,
            target: file,
            via: io.piece.via,
            pos,
            len,
            mem,
            punt,
        };
        // The op's side lane takes its pieces, except a staging lane's pieces that are not in
        // its staging memory (an O_DIRECT write's unaligned edges): those go to the main lane.
        let side = op
            .side
            .filter(|r| !r.staged || matches!(lane_io.mem, LaneMem::Device { .. }))
            .map(|r| r.lane);
        self.ios[token].lane = side;
        let lane: &mut dyn Lane = match side {
            Some(i) => &mut *self.side[i],
            None => self
                .main
                .as_deref_mut()
                .expect("main lane present while running"),
        };
        if let Err(e) = lane.push(lane_io) {
            let res = -e.raw_os_error().unwrap_or(libc::EIO);
            self.on_completion(Completion {
                token: token as u64,
                res,
            });
        }
    }
}
