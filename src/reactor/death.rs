//! How a reactor ends. An orderly stop drains every lane and lets memory go; a death (a panic,
//! or a failed kernel interface) fails every pending op with `Error::ReactorDied` and hands
//! whatever a device or the kernel may still write to the process-wide quarantine
//! (`crate::buf::quarantine`), named, instead of freeing it. This is the only place the reactor
//! decides to leak.

use std::panic::{AssertUnwindSafe, catch_unwind};

use super::Reactor;
use crate::buf::quarantine;
use crate::buf::region::HostRegion;
use crate::error::{Context, Error, OpKind};
use crate::op::msg::Msg;

impl Reactor {
    /// Runs until shutdown; on panic fails everything and leaks what the kernel may still use.
    pub(crate) fn run_to_end(mut self) {
        let outcome = catch_unwind(AssertUnwindSafe(|| self.run()));
        let death = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("kernel interface failed: {e}")),
            Err(panic) => Some(
                panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".to_string()),
            ),
        };
        // The reason is recorded before the engine reads as stopped, so that every refusal
        // from then on names it.
        self.engine.reactor.mark_dead(death.clone());
        match death {
            None => {
                for w in self.shutdown_waiters.drain(..) {
                    w.complete(Ok(0));
                }
            }
            Some(reason) => {
                // A panic here would drop the reactor, and with it what the kernel may still
                // write (owned and lent buffers, the lanes), as if it were free: end the
                // process instead.
                if catch_unwind(AssertUnwindSafe(|| self.die(reason))).is_err() {
                    eprintln!(
                        "gpuio: a dying reactor panicked while it put away what the kernel may \
                         still write; aborting rather than free it"
                    );
                    std::process::abort();
                }
            }
        }
        // Copies this reactor still counted leave the engine's count, so the reactors that
        // live on may use the whole cap (a drained reactor counts none).
        self.engine.page_cache_copies.fetch_sub(
            std::mem::take(&mut self.page_cache_copies_in_flight),
            std::sync::atomic::Ordering::Relaxed,
        );
        // Submissions that raced the close fail now, naming the death where there was one
        // (SubmitMsg's Drop would say only "shut down"). `mark_dead` closed the channel:
        // once the sends that found it open have landed, nothing more arrives (later sends
        // refuse themselves, naming the death).
        self.engine.reactor.settle_sends();
        while let Ok(msg) = self.rx.try_recv() {
            if let Msg::Submit(mut m) | Msg::Shutdown(mut m) = msg {
                m.refuse(|ctx| self.engine.reactor.refusal(ctx));
            }
        }
    }

    /// Fails everything pending with `reason` and quarantines what may still be written.
    pub(super) fn die(&mut self, reason: String) {
        tracing::error!(%reason, "gpuio reactor died");
        // Ops with a piece in a lane (not held back by the fence): the kernel, a device or a
        // side lane may still write their memory.
        let in_kernel: std::collections::HashSet<usize> = self
            .ios
            .iter()
            .filter(|(token, _)| !self.fenced.contains(token))
            .map(|(_, io)| io.op)
            .collect();
        for (key, op) in self.ops.iter_mut() {
            if !in_kernel.contains(&key) {
                // Nothing can land in this op's owned buffer any more: it goes back with the
                // error (a blocking read's lent memory is released).
                if let Some(o) = op.owned.take() {
                    op.shared.give_back(o.keep);
                }
            }
            op.shared.complete(Err(Error::ReactorDied {
                ctx: Box::new(op.ctx(op.offset)),
                reason: reason.clone(),
            }));
        }
        for w in self.shutdown_waiters.drain(..) {
            w.complete(Err(Error::ReactorDied {
                ctx: Box::new(Context::op(OpKind::Shutdown)),
                reason: reason.clone(),
            }));
        }
        // The kernel may still write into bounce slots, owned buffers and the doorbell buffer:
        // unless all of it is accounted for, none of it may be freed. A dead engine leaks; it
        // must not corrupt.
        if !in_kernel.is_empty() || self.retire_main().is_err() {
            let pieces = self.ios.len() - self.fenced.len();
            // Only the ops with pieces in a lane are kept, with their owned buffers; the others
            // gave theirs back above and go (a kept op would keep a buffer it gave back in its
            // `OpShared`, and with it a lent region, for good). Callers blocked until the
            // kernel is done with memory they lent learn that it never will be, rather than
            // waiting for good.
            let mut kept = Vec::with_capacity(in_kernel.len());
            for (key, op) in std::mem::take(&mut self.ops) {
                if in_kernel.contains(&key) {
                    if let Some(o) = &op.owned {
                        HostRegion::kept_by_kernel(o.keep.as_ref());
                    }
                    kept.push(op);
                }
            }
            quarantine::hold(
                format!(
                    "reactor died with {pieces} pieces in its lanes ({reason}): the lanes, \
                     the bounce pool and {} ops' buffers",
                    kept.len()
                ),
                (
                    kept,
                    self.main.take(),
                    std::mem::take(&mut self.side),
                    self.arena.clone(),
                ),
            );
            self.compromised = true;
        }
        self.quarantine_if_compromised();
        // Gated messages still held drop here and quarantine the pool if their copy may run.
    }

    /// Completes what the main lane armed on its own (the doorbell read) so that it can be
    /// dropped without the kernel ever writing its freed buffer.
    fn retire_main(&mut self) -> std::io::Result<()> {
        if let Some(main) = self.main.as_mut() {
            let bell = self.doorbell.clone();
            main.retire(&move || bell.ring_always())?;
        }
        Ok(())
    }

    /// After an orderly drain: retires and drops the lanes (nothing is in flight).
    pub(super) fn close_lanes(&mut self) -> std::io::Result<()> {
        self.retire_main()?;
        // Dropping the main lane closes the ring (or joins the pool) with nothing in flight.
        self.main.take();
        self.quarantine_if_compromised();
        Ok(())
    }

    /// Work the reactor lost track of (a failed CUDA copy, a cuFile entry whose DMA may still
    /// run) may touch the bounce pool or the device staging pool: keep both for good.
    fn quarantine_if_compromised(&mut self) {
        if !self.compromised {
            return;
        }
        // The side lanes own what their transfers may touch (cuFile's device staging pool).
        let staging = std::mem::take(&mut self.side);
        quarantine::hold(
            "bounce pool and device staging pool: a copy or DMA the reactor lost track of may \
             still touch them",
            (self.arena.clone(), staging),
        );
        self.compromised = false;
    }
}
