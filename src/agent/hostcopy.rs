//! Host-to-host copies between registrations of agents in one process: `memmove` on the
//! calling thread for small transfers, spread over a few copy threads for large ones (one
//! core copies ≈10 GB/s; a host's memory bandwidth needs several).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};

/// One range to copy, as addresses.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seg {
    pub(crate) dst: u64,
    pub(crate) src: u64,
    pub(crate) len: u64,
}

/// Below this many bytes a transfer copies on the thread that posts it: handing it to a
/// thread would cost more than the copy.
pub(crate) const INLINE_BYTES: u64 = 1 << 20;
/// The least a copy thread is given (splitting finer only adds hand-offs).
const MIN_SHARE: u64 = 1 << 20;

type Job = Box<dyn FnOnce() + Send>;

/// The process's copy threads, started on first use.
struct Pool {
    tx: Mutex<mpsc::Sender<Job>>,
    threads: usize,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::env::var("GPUIO_AGENT_COPY_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| {
                let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
                (cores / 2).clamp(1, 8)
            });
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads {
            let rx = rx.clone();
            // A thread that fails to start leaves fewer; the first always runs jobs inline
            // below if none started.
            let _ = std::thread::Builder::new()
                .name(format!("gpuio-agent-copy{i}"))
                .spawn(move || {
                    loop {
                        let job = {
                            let g = rx.lock().unwrap_or_else(|e| e.into_inner());
                            g.recv()
                        };
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    }
                });
        }
        Pool {
            tx: Mutex::new(tx),
            threads,
        }
    })
}

/// Copies `segs`, then calls `done` (on the calling thread for small transfers, else on the
/// copy thread that finishes last).
///
/// # Safety
/// Every segment's `src` must be readable and `dst` writable for `len` bytes until `done`
/// has been called.
pub(crate) unsafe fn copy(segs: Vec<Seg>, done: Box<dyn FnOnce() + Send>) {
    let total: u64 = segs.iter().map(|s| s.len).sum();
    let p = pool();
    let shares = (total / MIN_SHARE).clamp(1, p.threads as u64) as usize;
    // Small transfers copy here; larger ones go to the copy threads even where there is one,
    // so that posting never blocks for a large copy.
    if total < INLINE_BYTES {
        // SAFETY: the caller's contract.
        unsafe { run(&segs) };
        done();
        return;
    }
    let parts = split(&segs, shares);
    let left = Arc::new(AtomicUsize::new(parts.len()));
    let done = Arc::new(Mutex::new(Some(done)));
    let tx = p.tx.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for part in parts {
        let left = left.clone();
        let done = done.clone();
        let job: Job = Box::new(move || {
            // SAFETY: the caller keeps the ranges valid until `done`, which runs only after
            // the last part has been copied.
            unsafe { run(&part) };
            if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                if let Some(d) = done.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    d();
                }
            }
        });
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            job(); // No copy thread: copy here.
        }
    }
}

/// # Safety
/// As [`copy`].
unsafe fn run(segs: &[Seg]) {
    for s in segs {
        // SAFETY: the caller's contract; `copy` (memmove) allows the ranges to overlap.
        unsafe { std::ptr::copy(s.src as *const u8, s.dst as *mut u8, s.len as usize) };
    }
}

/// `segs` cut into `n` parts of about equal bytes (segments split where a part ends).
fn split(segs: &[Seg], n: usize) -> Vec<Vec<Seg>> {
    let total: u64 = segs.iter().map(|s| s.len).sum();
    let share = total.div_ceil(n as u64);
    let mut parts = Vec::with_capacity(n);
    let mut cur = Vec::new();
    let mut room = share;
    for s in segs {
        let mut s = *s;
        while s.len > 0 {
            if room == 0 {
                parts.push(std::mem::take(&mut cur));
                room = share;
            }
            let take = s.len.min(room);
            cur.push(Seg {
                dst: s.dst,
                src: s.src,
                len: take,
            });
            s.dst += take;
            s.src += take;
            s.len -= take;
            room -= take;
        }
    }
    if !cur.is_empty() {
        parts.push(cur);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_covers_every_byte_once() {
        let segs = vec![
            Seg {
                dst: 0,
                src: 1000,
                len: 5,
            },
            Seg {
                dst: 100,
                src: 2000,
                len: 12,
            },
        ];
        let parts = split(&segs, 3);
        assert_eq!(parts.len(), 3);
        let flat: Vec<Seg> = parts.concat();
        assert_eq!(flat.iter().map(|s| s.len).sum::<u64>(), 17);
        assert_eq!(flat[0].len, 5);
        assert_eq!((flat[1].dst, flat[1].src, flat[1].len), (100, 2000, 1));
        assert_eq!((flat[2].dst, flat[2].len), (101, 6));
        assert_eq!((flat[3].dst, flat[3].src, flat[3].len), (107, 2007, 5));
    }
}
