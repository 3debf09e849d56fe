//! The settings an [`EngineBuilder`] refuses, checked before anything starts: each by name,
//! with the range it wants.

use super::{EngineBuilder, MAX_PREAD_THREADS};
use crate::buf::arena::MIN_SLOT;
use crate::error::{Context, Error, OpKind, Result};
use crate::plan::sizing::Sizing;

/// What the checks computed, for `build` to start with.
pub(super) struct Checked {
    pub(super) sizing: Sizing,
    /// Bytes of one bounce block.
    pub(super) block: usize,
    /// Blocks in the bounce pool.
    pub(super) slots: usize,
    /// Blocks the pool may grow by.
    pub(super) growth: usize,
}

impl EngineBuilder {
    /// Refuses a setting that cannot be meant ([`Error::InvalidInput`], naming it); sizes the
    /// engine otherwise.
    pub(super) fn check(&self) -> Result<Checked> {
        let ctx = || Context::op(OpKind::Setup);
        for chunk in [self.buffered_chunk, self.direct_chunk]
            .into_iter()
            .flatten()
        {
            if chunk < MIN_SLOT || chunk % MIN_SLOT != 0 || chunk > 1 << 30 {
                return Err(Error::invalid(
                    ctx(),
                    format!(
                        "chunk size {chunk} must be a multiple of 4096 between 4 KiB and 1 GiB"
                    ),
                ));
            }
        }
        if let Some(q) = self.queue_depth
            && !(1..=32768).contains(&q)
        {
            return Err(Error::invalid(ctx(), "queue depth must be 1..=32768"));
        }
        if let Some(n) = self.pread_threads
            && !(1..=MAX_PREAD_THREADS).contains(&n)
        {
            // Each is an OS thread with its own stack: a mistyped count fails later with a
            // bare EAGAIN from the thread limit, naming nothing.
            return Err(Error::invalid(
                ctx(),
                format!("pread_threads {n}: want 1..={MAX_PREAD_THREADS}"),
            ));
        }
        if let Some(n) = self.bounce_slots
            && !(1..=u16::MAX as usize).contains(&n)
        {
            return Err(Error::invalid(ctx(), "bounce slots must be 1..=65535"));
        }
        // Zero copies at once would stall every buffered read (the sizing used to raise it to
        // one without a word); a setting that cannot be meant is refused by name.
        for (n, what) in [
            (self.page_cache_copies, "page_cache_copies"),
            (self.copies_per_device, "copies_per_device"),
        ] {
            if n == Some(0) {
                return Err(Error::invalid(
                    ctx(),
                    format!("{what} 0: want at least 1 (or leave it unset for the default)"),
                ));
            }
        }
        let sizing = self.sizing();
        let block = sizing.block();
        let slots = sizing.bounce_bytes / block;
        if !(1..=u16::MAX as usize).contains(&slots) {
            return Err(Error::invalid(ctx(), "bounce slots must be 1..=65535"));
        }
        if !(1..=64).contains(&sizing.reactors) || sizing.reactors > slots {
            return Err(Error::invalid(
                ctx(),
                format!(
                    "reactors {}: want 1..=64, and no more than the bounce slots ({slots}): \
                     each reactor has its own share of the pool",
                    sizing.reactors
                ),
            ));
        }
        if self.pool_wait_limit < std::time::Duration::from_millis(10) {
            // Growth comes after a tenth of the limit: below a millisecond, ordinary waits
            // for live futures would grow the pool and then fail requests.
            return Err(Error::invalid(
                ctx(),
                format!(
                    "pool wait limit {:?} is below 10 ms: live futures would be taken for leaks",
                    self.pool_wait_limit
                ),
            ));
        }
        let growth = self.bounce_growth.unwrap_or(slots);
        if growth > u16::MAX as usize {
            return Err(Error::invalid(
                ctx(),
                "bounce growth must be 0..=65535 blocks",
            ));
        }
        Ok(Checked {
            sizing,
            block,
            slots,
            growth,
        })
    }
}
