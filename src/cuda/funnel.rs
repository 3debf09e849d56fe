//! Staged copies from many threads onto one stream, issued by one thread at a time in one
//! batched call (flat combining).
//!
//! Small reads into device memory each queue one staged copy (`copylist::queue_staged`: the
//! source is read during the call). When every read's memory is on one stream, as under a
//! framework's current stream, sixteen runtime threads calling the driver for that stream at
//! once ran at 103–107 k copies a second on a 16-core H100, against 184–190 k from one
//! thread: they contend inside the driver for the stream (BENCHMARKS, fourteenth session).
//! Here a thread with copies for a stream leaves them in that stream's [`Funnel`]; whichever
//! thread finds no call in progress takes everything left there and issues it as one batch,
//! while the others wait for their batch on a condition variable instead of inside the driver.
//!
//! Each caller returns only once its own copies are queued and their sources read, with its
//! batch's result: the same promise `queue_staged` makes, so a caller's source (its thread's
//! stage, or a bounce slot it holds) is untouched by anyone else while it waits, and free when
//! it returns. No caller returns with its copies still waiting, so a future dropped or leaked
//! afterwards has nothing left here.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};

use cudarc::driver::sys::CUstream;

use super::copylist::{self, CopySpec};

/// Funnels in the table: streams hash to one; two streams on one funnel take turns.
const FUNNELS: usize = 256;

/// Failed batches remembered for callers that have not looked yet.
const FAILURES_KEPT: usize = 64;

/// One stream's waiting copies and the batch in progress.
struct Funnel {
    state: Mutex<FunnelState>,
    issued: Condvar,
}

#[derive(Default)]
struct FunnelState {
    /// The stream the waiting copies are for (a funnel serves one stream at a time).
    stream: usize,
    /// Copies left here and not yet taken by an issuer.
    waiting: Vec<CopySpec>,
    /// Whether a thread is issuing a batch now.
    issuing: bool,
    /// The number of the batch the waiting copies will go in.
    next: u64,
    /// Every batch numbered below this has been issued.
    issued_below: u64,
    /// Recent failed batches and why.
    failures: VecDeque<(u64, String)>,
}

static TABLE: [Funnel; FUNNELS] = [const {
    Funnel {
        state: Mutex::new(FunnelState {
            stream: 0,
            waiting: Vec::new(),
            issuing: false,
            next: 0,
            issued_below: 0,
            failures: VecDeque::new(),
        }),
        issued: Condvar::new(),
    }
}; FUNNELS];

fn funnel_of(raw: CUstream) -> &'static Funnel {
    // Stream handles are pointers: drop the low bits, which alignment keeps equal.
    let h = (raw as usize >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15usize);
    &TABLE[(h >> 32) % FUNNELS]
}

/// Queues `copies` on `raw` as [`copylist::queue_staged`] does, batched with other threads'
/// copies for the same stream.
///
/// # Safety
/// As [`copylist::queue_staged`], and the stream's context must be the one current on every
/// thread that leaves copies for `raw` (it is: a live stream handle names one stream of one
/// context, and each caller has bound that stream's context).
pub(crate) unsafe fn queue_staged(raw: CUstream, copies: &[CopySpec]) -> Result<(), String> {
    // SAFETY: the caller's preconditions, passed on to every batch `through` issues.
    through(raw, copies, &|raw, batch| unsafe {
        copylist::queue_staged(raw, batch)
    })
}

/// The funnel's protocol, with the call that issues a batch as a parameter (tests give it a
/// stand-in): `issue` gets every waiting copy for `raw`, ours included, or only ours where
/// another stream holds the funnel.
fn through(
    raw: CUstream,
    copies: &[CopySpec],
    issue: &dyn Fn(CUstream, &[CopySpec]) -> Result<(), String>,
) -> Result<(), String> {
    let funnel = funnel_of(raw);
    let mut st = lock(funnel);
    if st.stream != raw as usize && (st.issuing || !st.waiting.is_empty()) {
        // Another stream holds this funnel: no combining for this call.
        drop(st);
        return issue(raw, copies);
    }
    st.stream = raw as usize;
    st.waiting.extend_from_slice(copies);
    let mine = st.next;
    loop {
        if st.issued_below > mine {
            let failed = st.failures.iter().find(|(b, _)| *b == mine);
            return failed.map_or(Ok(()), |(_, why)| Err(why.clone()));
        }
        if !st.issuing {
            // Issue everything waiting, ours included.
            let batch = std::mem::take(&mut st.waiting);
            let number = st.next;
            st.next += 1;
            st.issuing = true;
            drop(st);
            // Every copy in `batch` was left by a caller that met `queue_staged`'s
            // preconditions for `raw` and waits, its source untouched, until this batch is
            // marked issued below; this thread has `raw`'s context current.
            let result = issue(raw, &batch);
            st = lock(funnel);
            if let Err(why) = &result {
                if st.failures.len() == FAILURES_KEPT {
                    st.failures.pop_front();
                }
                st.failures.push_back((number, why.clone()));
            }
            st.issuing = false;
            st.issued_below = number + 1;
            // Reuse the batch's allocation for the next one.
            let mut batch = batch;
            batch.clear();
            if st.waiting.is_empty() && st.waiting.capacity() < batch.capacity() {
                st.waiting = batch;
            }
            funnel.issued.notify_all();
            continue;
        }
        st = funnel.issued.wait(st).unwrap_or_else(|p| p.into_inner());
    }
}

fn lock(f: &Funnel) -> MutexGuard<'_, FunnelState> {
    f.state.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn copy(dst: u64) -> CopySpec {
        CopySpec {
            dst,
            src: dst,
            n: 4096,
            direct: false,
        }
    }

    #[test]
    fn every_copy_is_issued_once_and_callers_share_batches() {
        // A made-up stream handle of this test's own: no other test uses its funnel.
        let id = 0x5000_0000usize;
        let calls = AtomicUsize::new(0);
        let seen = Mutex::new(Vec::new());
        let issue = |r: CUstream, batch: &[CopySpec]| {
            assert_eq!(r as usize, id);
            calls.fetch_add(1, Ordering::Relaxed);
            // Long enough for the other threads to leave copies meanwhile.
            std::thread::sleep(std::time::Duration::from_millis(2));
            seen.lock().unwrap().extend(batch.iter().map(|c| c.dst));
            Ok(())
        };
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let issue = &issue;
                s.spawn(move || {
                    for i in 0..20u64 {
                        through(id as CUstream, &[copy(t * 1000 + i)], issue).unwrap();
                    }
                });
            }
        });
        let mut seen = seen.into_inner().unwrap();
        seen.sort_unstable();
        let want: Vec<u64> = (0..8u64)
            .flat_map(|t| (0..20u64).map(move |i| t * 1000 + i))
            .collect();
        assert_eq!(seen, want, "each copy issued exactly once");
        let calls = calls.into_inner();
        assert!(
            calls < 160,
            "no batch held two callers' copies: {calls} calls"
        );
    }

    #[test]
    fn a_failed_batch_fails_every_caller_in_it_and_no_other() {
        let raw = 0x6000_0000usize as CUstream;
        let issue = |_: CUstream, batch: &[CopySpec]| {
            if batch.iter().any(|c| c.dst == 13) {
                Err("refused".to_string())
            } else {
                Ok(())
            }
        };
        assert_eq!(through(raw, &[copy(13)], &issue), Err("refused".into()));
        assert_eq!(through(raw, &[copy(14)], &issue), Ok(()));
    }
}
