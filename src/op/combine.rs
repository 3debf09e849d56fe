//! The device copies of many reads issued together: a batch of reads into one device buffer
//! (`Batch::read_into`) hands every landed piece of every read to one [`CopyCombiner`], which
//! queues them on the buffer's stream in as few driver calls as the driver allows, behind one
//! event, and gives the slots back with one message.
//!
//! Issued one op at a time, a 4 KiB piece costs a copy, an event and an event query, all
//! driver calls that take the context's lock, from whichever runtime thread polls the op;
//! combined, a poll of the batch costs one batched copy call and one event for every piece
//! that landed since the last poll.
//!
//! Soundness is that of the per-op path (`crate::cuda`): the copies are queued inside the
//! batch future's own `poll`, on the destination's stream, before the batch re-records
//! cudarc's write event for the buffer; nothing is queued between polls, so a dropped or leaked
//! batch queues no more copies, and every slot goes back only behind the event.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaStream;

use super::cached::{BATCH_STAGE_LEN, keep_batch_stage, take_batch_stage, try_read};
use super::device::{read_copy_specs, stageable};
use super::engine_shared::EngineShared;
use super::engine_shared::StripedCounter;
use super::gate::Gated;
use super::msg::Msg;
use super::{OpShared, ReadyPieces};
use crate::buf::arena::BounceArena;
use crate::cuda::copylist::{self, CopySpec};
use crate::cuda::event::{EVENT_POOL, EventGate};
use crate::cuda::side;
use crate::cuda::stage::{PINNED_STAGE_LEN, PageableStage, PinnedStage, StagePool};

/// Flushes that queued copies, and the copies they queued, process-wide (for tests and
/// `gpuio bench`: how many copies one driver call carried). Striped: every batch's poll adds
/// to them, from every runtime thread.
pub(crate) static FLUSHES: StripedCounter = StripedCounter::new();
/// See [`FLUSHES`].
pub(crate) static COPIES: StripedCounter = StripedCounter::new();

/// Landed pieces of one read, waiting for the batch's next flush.
pub(crate) struct Combined {
    pub(crate) engine: Arc<EngineShared>,
    pub(crate) arena: Arc<BounceArena>,
    pub(crate) shared: Arc<OpShared>,
    pub(crate) pieces: ReadyPieces,
    /// Device address of the read's destination, which stands for file bytes
    /// `[offset, offset + len)`.
    pub(crate) dptr: u64,
    pub(crate) offset: u64,
    pub(crate) len: usize,
}

/// Reads of a batch served from the page cache (`op::cached`) during one poll: their bytes
/// wait in a stage, and their copies for the batch's next flush (or until the stage is full).
#[derive(Default)]
struct StagedReads {
    stage: Option<Stage>,
    used: usize,
    copies: Vec<CopySpec>,
    /// Whether the destination's stream takes staged copies (`device::stageable`), asked
    /// once per poll.
    usable: Option<bool>,
    /// Why copies queued when a stage filled up during this poll failed: the flush reports
    /// it, and the batch fails its reads.
    failed: Option<String>,
}

/// Host memory staged reads land in.
enum Stage {
    /// Lent by the process's pool of pinned stages (`cuda::stage`): the copy engine reads it
    /// in stream order, and it is busy until the event behind the copies completes.
    Pinned(PinnedStage),
    /// The polling thread's pageable stage (where no pinned one is free): the driver has read
    /// it when the copy call returns.
    Pageable(PageableStage),
}

impl Stage {
    /// A free stage for copies to `stream`'s device: pinned (from `stages`) where one can be
    /// had.
    fn take(stream: &CudaStream, stages: &Arc<StagePool>) -> Option<Stage> {
        stages
            .take(stream.context())
            .map(Stage::Pinned)
            .or_else(|| take_batch_stage().map(Stage::Pageable))
    }

    fn len(&self) -> usize {
        match self {
            Stage::Pinned(_) => PINNED_STAGE_LEN,
            Stage::Pageable(_) => BATCH_STAGE_LEN,
        }
    }

    fn addr(&self) -> u64 {
        match self {
            Stage::Pinned(s) => s.addr(),
            Stage::Pageable(s) => s.addr(),
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Stage::Pinned(s) => s.bytes(),
            Stage::Pageable(s) => s.bytes(),
        }
    }
}

impl StagedReads {
    /// Queues the copies out of the stage on `stream` and gives the stage back: a pinned one
    /// busy behind an event recorded after them, a pageable one free (the driver read it during
    /// the call). However this ends, nothing reads the stage afterwards except copies that
    /// event stands behind.
    fn queue(&mut self, stream: &Arc<CudaStream>) -> Result<(), String> {
        let copies = std::mem::take(&mut self.copies);
        self.used = 0;
        let Some(stage) = self.stage.take() else {
            return Ok(());
        };
        let ctx = stream.context();
        if copies.is_empty() {
            stage.give_back(None);
            return Ok(());
        }
        if let Err(e) = ctx.bind_to_thread() {
            stage.give_back(None);
            return Err(format!("binding the context: {e}"));
        }
        let mut busy = None;
        // Set where copies may be queued out of the stage and could not be waited for.
        let mut unaccounted = false;
        // In the destination stream's order: on it, or on the side stream for the legacy one
        // (`stageable` accepted it when this poll's first read was staged).
        let queued = side::queue_in_order(stream, |raw| match &stage {
            Stage::Pinned(_) => {
                // SAFETY: `raw` is a live stream of the context bound above. Every source lies
                // in the stage, pinned for every context, which nothing writes until the event
                // recorded below has completed, or the stream has been drained below, or never
                // again (`unaccounted`: the stage is retired). Every destination lies inside
                // the batch's destination (a joined copy spans neighbouring reads' ranges, all
                // inside it), which the batch holds exclusively and which stays allocated
                // until the stream has passed the copies (cudarc's write event is recorded
                // behind them); the reads' ranges are disjoint, so no two copies' are.
                let queued = unsafe { copylist::queue(raw, &copies) }.and_then(|()| {
                    // SAFETY: `raw` is a live stream of `ctx`.
                    unsafe { EVENT_POOL.record_raw(ctx, raw) }
                        .map_err(|e| format!("recording the stage's event: {e:?}"))
                });
                match queued {
                    Ok(ev) => {
                        busy = Some(ev);
                        Ok(())
                    }
                    Err(why) => {
                        // Some copies may be queued with no event behind them: let them finish,
                        // so the stage is free when it goes back.
                        // SAFETY: `raw` is a live stream of the current context.
                        unaccounted = unsafe { crate::cuda::memops::synchronize(raw) }.is_err();
                        Err(why)
                    }
                }
            }
            // SAFETY: `raw` is a live stream of the context bound above, one `staged_ok`
            // accepts (`stageable` accepted the destination's stream this poll, and the side
            // stream stands in for the legacy one); every source lies in pageable memory of our
            // own mapping that `queue_staged` has read when it returns; the destinations are as
            // above.
            Stage::Pageable(_) => unsafe { copylist::queue_staged(raw, &copies) },
        })
        .map_err(|e| e.to_string());
        match stage {
            Stage::Pinned(s) if unaccounted => s.retire(),
            stage => stage.give_back(busy),
        }
        queued
    }
}

impl Stage {
    /// Returns the stage to where it came from, busy until `busy` completes.
    fn give_back(self, busy: Option<cudarc::driver::CudaEvent>) {
        match self {
            Stage::Pinned(s) => s.set_busy(busy),
            Stage::Pageable(s) => keep_batch_stage(s),
        }
    }
}

/// A read of a batch the page cache may serve: `len` bytes at file `offset`, for device
/// address `dptr`.
pub(crate) struct CachedRead {
    pub(crate) dptr: u64,
    pub(crate) offset: u64,
    pub(crate) len: usize,
}

/// Collects landed pieces during one poll of a batch; [`flush`](Self::flush) copies them.
#[derive(Default)]
pub(crate) struct CopyCombiner {
    pending: Mutex<Vec<Combined>>,
    staged: Mutex<StagedReads>,
}

/// One engine's share of a flush: its slots go back behind one event.
struct EngineShare {
    engine: Arc<EngineShared>,
    arena: Arc<BounceArena>,
    keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
    releases: Vec<Msg>,
}

impl CopyCombiner {
    fn take(&self) -> Vec<Combined> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub(crate) fn push(&self, c: Combined) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(c);
    }

    /// Reads `len` bytes at `offset` of `fd` into the batch's stage if the page cache holds
    /// every one of them (`op::cached::try_read`), and keeps their copy to `dptr` for the next
    /// flush; a full stage has its copies queued first and the read goes into another. `None`:
    /// not served (not cached, no stage to be had, any error); the read goes through the
    /// reactor.
    pub(crate) fn read_cached(
        &self,
        fd: std::os::fd::RawFd,
        refused: &std::sync::atomic::AtomicBool,
        stream: &Arc<CudaStream>,
        stages: &Arc<StagePool>,
        read: CachedRead,
    ) -> Option<usize> {
        let CachedRead { dptr, offset, len } = read;
        let mut st = self.staged.lock().unwrap_or_else(|p| p.into_inner());
        if !*st.usable.get_or_insert_with(|| stageable(stream)) || len > PINNED_STAGE_LEN {
            return None;
        }
        if st.stage.as_ref().is_some_and(|s| st.used + len > s.len()) {
            if let Err(why) = st.queue(stream) {
                st.failed.get_or_insert(why);
            }
        }
        if st.stage.is_none() {
            st.stage = Stage::take(stream, stages);
        }
        let StagedReads {
            stage,
            used,
            copies,
            ..
        } = &mut *st;
        let stage = stage.as_mut()?;
        let src = stage.addr() + *used as u64;
        let direct = matches!(stage, Stage::Pinned(_));
        let n = try_read(fd, refused, &mut stage.bytes()[*used..*used + len], offset)?;
        if n > 0 {
            push_copy(
                copies,
                CopySpec {
                    dst: dptr,
                    src,
                    n,
                    direct,
                },
            );
            *used += n;
        }
        Some(n)
    }

    /// Queues the staged reads' copies on `stream`; the stage goes back busy behind them.
    fn flush_staged(&self, stream: &Arc<CudaStream>) -> Result<(), String> {
        let mut st = self.staged.lock().unwrap_or_else(|p| p.into_inner());
        st.usable = None;
        let queued = st.queue(stream);
        match st.failed.take() {
            Some(why) => Err(why),
            None => queued,
        }
    }

    /// Queues on `stream` (the destination's own) every copy handed over since the last
    /// flush, and sends each engine one message that gives its slots back once an event
    /// recorded behind the copies has completed. On failure the reads' pieces are abandoned
    /// (copies may be queued with nothing to say when they end) and the reason returned: the
    /// batch then fails its reads.
    pub(crate) fn flush(&self, stream: &Arc<CudaStream>) -> Result<(), String> {
        let staged = self.flush_staged(stream);
        let pending = self.take();
        if pending.is_empty() {
            return staged;
        }
        match Self::issue(&pending, stream) {
            Ok(events) => {
                let mut shares: Vec<EngineShare> = Vec::new();
                for c in pending {
                    let i = match shares
                        .iter()
                        .position(|s| Arc::ptr_eq(&s.engine, &c.engine))
                    {
                        Some(i) => i,
                        None => {
                            shares.push(EngineShare {
                                engine: c.engine.clone(),
                                arena: c.arena.clone(),
                                keep: None,
                                releases: Vec::new(),
                            });
                            shares.len() - 1
                        }
                    };
                    let share = &mut shares[i];
                    if let Some(st) = c.shared.staging.get() {
                        share.keep.get_or_insert_with(|| st.keep.clone());
                    }
                    share.releases.push(Msg::release(&c.shared, c.pieces));
                }
                for (share, ev) in shares.into_iter().zip(events) {
                    let gated = Gated::new(
                        Box::new(EventGate::new(ev)),
                        Msg::Many(share.releases),
                        &share.arena,
                    )
                    .keeping(share.keep);
                    share.engine.reactor.send(Msg::Gated(gated));
                }
                staged
            }
            Err(why) => {
                for c in pending {
                    c.engine.reactor.send(Msg::Abandon(c.shared, c.pieces));
                }
                Err(why)
            }
        }
    }

    /// Queues the copies, then records one event per engine behind them (in the order the
    /// engines first appear in `pending`).
    fn issue(
        pending: &[Combined],
        stream: &Arc<CudaStream>,
    ) -> Result<Vec<cudarc::driver::CudaEvent>, String> {
        let ctx = stream.context();
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the context: {e}"))?;
        let mut copies = Vec::with_capacity(pending.len());
        let mut engines: Vec<&Arc<EngineShared>> = Vec::new();
        for c in pending {
            c.arena.ensure_pinned(ctx);
            let staging = c.shared.staging.get();
            read_copy_specs(
                &c.pieces,
                &c.arena,
                staging,
                c.dptr,
                c.offset,
                c.len,
                &mut copies,
            )
            .map_err(|e| e.to_string())?;
            if !engines.iter().any(|e| Arc::ptr_eq(e, &c.engine)) {
                engines.push(&c.engine);
            }
        }
        // SAFETY: each source lies inside a bounce or staging slot the read's op owns until
        // the reactor sees the event recorded below complete (its slots go back only behind
        // it, or are abandoned); each destination lies inside that read's range of the
        // batch's destination (`read_copy_specs` clips to it), which the batch holds exclusively
        // and whose runs are disjoint; `stream` is the destination's live stream, its context
        // bound above.
        unsafe { copylist::queue(stream.cu_stream(), &copies) }?;
        FLUSHES.add(1);
        COPIES.add(copies.len() as u64);
        engines
            .iter()
            .map(|_| {
                EVENT_POOL
                    .record(stream)
                    .map_err(|e| format!("recording the copies' event: {e}"))
            })
            .collect()
    }
}

/// Adds `c` to `copies`, as part of the last copy where it continues it in both the stage and
/// the destination: a batch's reads land in the stage in the order they are polled, so reads
/// into neighbouring places of the destination (pages of a KV cache, a checkpoint's tensors)
/// go as one copy. The copy engine moves one 256 KiB copy far faster than 64 of 4 KiB.
fn push_copy(copies: &mut Vec<CopySpec>, c: CopySpec) {
    if let Some(last) = copies.last_mut() {
        if last.direct == c.direct
            && last.src + last.n as u64 == c.src
            && last.dst + last.n as u64 == c.dst
        {
            last.n += c.n;
            return;
        }
    }
    copies.push(c);
}

impl Drop for CopyCombiner {
    fn drop(&mut self) {
        // Pieces never flushed were never copied: their slots go straight back.
        for c in self.take() {
            c.engine.reactor.send(Msg::release(&c.shared, c.pieces));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{CopySpec, push_copy};

    fn copy(dst: u64, src: u64, n: usize) -> CopySpec {
        CopySpec {
            dst,
            src,
            n,
            direct: true,
        }
    }

    #[test]
    fn staged_reads_next_to_each_other_go_as_one_copy() {
        let mut copies = Vec::new();
        // Three reads into neighbouring places, then one elsewhere, then one that continues
        // it in the destination but not in the stage (a short read came between).
        push_copy(&mut copies, copy(1 << 20, 0, 4096));
        push_copy(&mut copies, copy((1 << 20) + 4096, 4096, 4096));
        push_copy(&mut copies, copy((1 << 20) + 8192, 8192, 100));
        push_copy(&mut copies, copy(5 << 20, 8292, 4096));
        push_copy(&mut copies, copy((5 << 20) + 4096, 16384, 4096));
        let got: Vec<(u64, u64, usize)> = copies.iter().map(|c| (c.dst, c.src, c.n)).collect();
        assert_eq!(
            got,
            vec![
                (1 << 20, 0, 8292),
                (5 << 20, 8292, 4096),
                ((5 << 20) + 4096, 16384, 4096)
            ]
        );
        // A pinned source never merges with a pageable one.
        let mut mixed = vec![copy(0, 0, 4096)];
        push_copy(
            &mut mixed,
            CopySpec {
                direct: false,
                ..copy(4096, 4096, 4096)
            },
        );
        assert_eq!(mixed.len(), 2);
    }
}
