//! Completions: what a finished piece means for its op. Interrupted or short transfers are
//! pushed again for the rest; a short read not a multiple of the alignment (or zero bytes) is
//! the end of the file; a failure keeps the error at the lowest failing offset; a cuFile entry
//! cuFile could not serve falls back to the bounce path (or fails, where cuFile is forced).

use super::Reactor;
use crate::error::Error;
use crate::lane::{Completion, IoKind};
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
        let res = c.res;
        #[cfg(feature = "cuda")]
        if io.slot.is_some_and(|s| s.on_device)
            && (res == crate::gds::lane::RES_LOST
                || crate::gds::lane::cufile_code_of(res).is_some())
        {
            self.on_cufile_failure(token, res);
            return;
        }
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
            let earlier = op.error_at.is_some_and(|at| pos < at);
            if op.error.is_none() || earlier {
                op.error = Some(Error::from_cqe(op.ctx(pos), res));
                op.error_at = Some(pos);
            }
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
                let _wake = op.shared.stage_ready(ready);
                self.maybe_finish(key);
                return;
            } else {
                self.free_op_slot(key, slot);
            }
        }
        self.maybe_finish(key);
    }

    /// A cuFile batch entry failed with a cuFile status (or was lost): fall back to the bounce
    /// path for the file where the status says cuFile cannot serve it (unless forced), else fail.
    #[cfg(feature = "cuda")]
    fn on_cufile_failure(&mut self, token: usize, res: i32) {
        use crate::gds::driver::CufileCode;
        use crate::gds::lane::{RES_LOST, cufile_code_of};
        let io = self.retire_io(token);
        let key = io.op;
        let slot = io.slot.expect("cuFile entries carry a device slot");
        let pos = io.piece.pos + io.done as u64;
        let op = &mut self.ops[key];
        op.busy -= 1;
        let lost = res == RES_LOST;
        let (why, fallback) = if lost {
            // cuFile cannot say whether the DMA still runs: never reuse that memory.
            self.compromised = true;
            op.held_bytes -= slot.size();
            (
                "cuFile lost track of a batch I/O (status query failed or stalled)".to_string(),
                true,
            )
        } else {
            let code = CufileCode {
                err: cufile_code_of(res).unwrap_or(5030),
                cu_err: 0,
            };
            (
                format!("cuFile batch I/O failed: {code}"),
                code.calls_for_fallback(),
            )
        };
        let fg = op.file.gds().expect("cuFile ops have a registered file");
        if !fg.forced() && fallback && !op.stopped() {
            // AUTO: the piece is read again through the bounce path (a new slot), and the file
            // stays there from now on.
            fg.fall_back(&op.file.path, why);
            op.gds = false;
            op.backend = self.backend;
            op.retry.push(io.piece);
            if !op.in_runnable && !op.window_blocked {
                op.in_runnable = true;
                self.runnable.push_back(key);
            }
        } else if op.error.is_none() {
            op.error = Some(Error::cuda_msg(op.ctx(pos), why));
            op.error_at = Some(pos);
        }
        if !lost {
            self.free_op_slot(key, slot);
        }
        self.maybe_finish(key);
    }
}
