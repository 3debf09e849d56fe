//! Completions: what a finished piece means for its op. Interrupted or short transfers are
//! pushed again for the rest; a short read not a multiple of the alignment (or zero bytes) is
//! the end of the file; a failure keeps the error at the lowest failing offset; a piece a side
//! lane failed in its own terms (`Lane::classify`: a cuFile status, a lost entry) falls back
//! to the main lane where the lane allows it, or fails the op.

use super::Reactor;
use super::entry::Queue;
use crate::error::Error;
use crate::lane::{Completion, IoKind, Outcome};
use crate::op::ReadyPiece;

impl Reactor {
    pub(super) fn on_completion(&mut self, c: Completion) {
        if self.panic_armed {
            panic!("injected reactor panic (test)");
        }
        let token = c.token as usize;
        let Some(io) = self.ios.get_mut(token) else {
            debug_assert!(false, "completion for unknown token {token}");
            return;
        };
        let key = io.op;
        let mut res = c.res;
        if let Some(lane) = io.lane {
            // A side lane reads its own results (cuFile's status codes, a lost entry).
            match self.side[lane].classify(res, &self.ops[key].file) {
                Outcome::Res(r) => res = r,
                Outcome::Failed {
                    why,
                    fallback,
                    lost,
                } => {
                    self.on_lane_failure(token, lane, why, fallback, lost);
                    return;
                }
            }
        }
        let io = &mut self.ios[token];
        if res == -libc::EINTR || res == -libc::EAGAIN {
            self.push_io(token);
            return;
        }
        let align = self.ops[key].align;
        let mut failure = None;
        let mut eof = false;
        if res < 0 {
            failure = Some(res);
        } else {
            let n = res as usize;
            io.done += n;
            match io.kind {
                IoKind::Read => {
                    // Zero bytes, or a partial block under O_DIRECT, means end of file.
                    eof = n == 0 || (n as u64 % align != 0);
                }
                IoKind::Write if n == 0 => failure = Some(-libc::EIO),
                _ => {}
            }
            if failure.is_none() && !eof && io.done < io.piece.len && io.kind != IoKind::Fsync {
                self.push_io(token);
                return;
            }
        }
        let io = self.retire_io(token);
        let op = &mut self.ops[key];
        op.busy -= 1;
        if let Some(res) = failure {
            let pos = io.piece.pos + io.done as u64;
            op.fail_at(pos, |ctx| Error::from_cqe(ctx, res));
        }
        if io.kind == IoKind::Read && io.done < io.piece.len && failure.is_none() {
            let at = io.piece.pos + io.done as u64;
            op.eof_at = Some(op.eof_at.map_or(at, |e| e.min(at)));
        }
        if let Some(slot) = io.slot {
            if io.kind == IoKind::Read && !op.stopped() && io.done > 0 {
                let ready = ReadyPiece {
                    piece: io.piece,
                    valid: io.done,
                    slot,
                };
                // Woken after `maybe_finish`, which sets the result if this was the last piece.
                let _wake = op.shared.hand_ready(ready);
                self.maybe_finish(key);
                return;
            } else {
                self.free_op_slot(key, slot);
            }
        }
        self.maybe_finish(key);
    }

    /// A side lane failed a piece in its own terms (`Outcome::Failed`). With `fallback`, the
    /// piece runs again on the main lane (a new slot) and the op stays there, as the file does
    /// from now on (`Lane::fall_back`); without, the op fails with the lane's error. A `lost`
    /// piece's memory may still be written: it is never reused (the pools are quarantined).
    fn on_lane_failure(
        &mut self,
        token: usize,
        lane: usize,
        why: String,
        fallback: bool,
        lost: bool,
    ) {
        let io = self.retire_io(token);
        let key = io.op;
        let pos = io.piece.pos + io.done as u64;
        let op = &mut self.ops[key];
        op.busy -= 1;
        if lost {
            self.compromised = true;
            if let Some(slot) = io.slot {
                op.held_bytes -= slot.size();
            }
        }
        if fallback && !op.stopped() {
            self.side[lane].fall_back(&op.file, why);
            op.side = None;
            op.backend = self.backend;
            op.retry.push(io.piece);
            // An idle op goes back in the run queue for the retry; a blocked or parked one
            // is put back when its slots or a page-cache copy come free.
            if op.queue == Queue::Idle {
                op.queue = Queue::Runnable;
                self.runnable.push_back(key);
            }
        } else {
            let side = &mut self.side[lane];
            op.fail_at(pos, |ctx| side.failure(ctx, why));
        }
        if let (false, Some(slot)) = (lost, io.slot) {
            self.free_op_slot(key, slot);
        }
        self.maybe_finish(key);
    }
}
