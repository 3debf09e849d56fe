//! Messages behind gates: work that waits for a CUDA event (a copy into or out of slots, a
//! stream-ordered cuFile operation, a stream sync) before the reactor acts on it. Gates are
//! polled, never waited on; a broken gate, or one still closed at the shutdown deadline, has
//! its pieces abandoned: their slots are never reused.

use std::time::{Duration, Instant};

use super::Reactor;
use crate::error::Error;
use crate::op::gate::GateState;
use crate::op::msg::Msg;

/// How long shutdown waits for gated work (CUDA copies) before leaking it and exiting.
const GATE_SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);
/// How often the reactor looks at gates while any are closed.
pub(super) const GATE_POLL_INTERVAL: Duration = Duration::from_micros(100);
/// Least time between two looks at the gates while slots are not short: each look is a
/// `cuEventQuery` per gate, on the context lock the futures' copies need, and a busy reactor
/// turns many times per gate's life (measured: 4 KiB reads into GPU memory).
pub(super) const GATE_POLL_GAP: Duration = Duration::from_micros(25);

impl Reactor {
    /// Acts on gated messages whose gate opened.
    pub(super) fn poll_gates(&mut self) {
        if self.gated.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.gated.len() {
            let state = self.gated[i].gate.poll();
            if let GateState::Closed = state {
                i += 1;
                continue;
            }
            let Some(msg) = self.gated.swap_remove(i).take() else {
                continue;
            };
            match state {
                GateState::Broken(reason) => {
                    tracing::error!(%reason, "CUDA event failed; leaking its bounce slots");
                    self.abandon_msg(msg);
                }
                _ => self.handle(msg),
            }
        }
    }

    /// Accounts for the pieces in `msg` without ever reusing their slots.
    fn abandon_msg(&mut self, msg: Msg) {
        // Stream work behind a gate touches no pool memory; everything else may.
        if !matches!(msg, Msg::Awaited(..)) {
            self.compromised = true;
        }
        match msg {
            Msg::Filled(shared, pieces) | Msg::Abandon(shared, pieces) => {
                self.handle(Msg::Abandon(shared, pieces));
            }
            Msg::Release(op, slots) => {
                // The slots stay out of the pool, but the op must not wait for them: it fails.
                let key = op.key;
                if self.is_live_ref(op) {
                    for s in slots {
                        self.uncount_op_slot(key, s);
                    }
                    let op = &mut self.ops[key];
                    let ctx = op.ctx(op.offset);
                    op.fail(Error::cuda_msg(
                        ctx,
                        "the event behind the device copies failed: their slots are leaked",
                    ));
                    self.maybe_finish(key);
                }
            }
            Msg::Many(msgs) => {
                for m in msgs {
                    self.abandon_msg(m);
                }
            }
            Msg::Awaited(shared, what) => {
                let key = shared.key();
                if self.is_live(key, &shared) {
                    let op = &mut self.ops[key];
                    op.busy -= 1;
                    let ctx = op.ctx(op.offset);
                    op.fail(Error::cuda_msg(
                        ctx,
                        "the stream's event failed or never completed: the work behind it \
                         cannot be seen to end",
                    ));
                    self.maybe_finish(key);
                }
                // The stream may still write what the op left with it (a cuFile parameter block).
                crate::buf::quarantine::hold(
                    "what a stream-ordered operation left with a stream whose event never completed",
                    what,
                );
            }
            Msg::Gated(mut g) => {
                if let Some(inner) = g.take() {
                    self.abandon_msg(inner);
                }
            }
            other => self.handle(other),
        }
    }

    /// Shutdown must not hang on CUDA work that never finishes: past the deadline, leak it.
    pub(super) fn enforce_shutdown_deadline(&mut self) {
        let started = *self.shutdown_started.get_or_insert_with(Instant::now);
        if self.gated.is_empty() || started.elapsed() < GATE_SHUTDOWN_DEADLINE {
            return;
        }
        tracing::error!(
            pending = self.gated.len(),
            "CUDA copies did not finish within the shutdown deadline; leaking the bounce pool"
        );
        for mut g in std::mem::take(&mut self.gated) {
            if let Some(msg) = g.take() {
                self.abandon_msg(msg);
            }
        }
    }
}
