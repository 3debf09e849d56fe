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
pub(crate) unsafe fn copy(
    segs: Vec<Seg>,
    how: Mover,
    done: Box<dyn FnOnce(Result<(), String>) + Send>,
) {
    let total: u64 = segs.iter().map(|s| s.len).sum();
    let p = pool();
    let shares = (total / MIN_SHARE).clamp(1, p.threads as u64) as usize;
    // Small transfers copy here; larger ones go to the copy threads even where there is one,
    // so that posting never blocks for a large copy.
    if total < INLINE_BYTES {
        // SAFETY: the caller's contract.
        done(unsafe { run(&segs, how) });
        return;
    }
    let parts = split(&segs, shares);
    let left = Arc::new(AtomicUsize::new(parts.len()));
    let done = Arc::new(Mutex::new(Some(done)));
    let failed: Arc<Mutex<Option<String>>> = Arc::default();
    let tx = p.tx.lock().unwrap_or_else(|e| e.into_inner()).clone();
    for part in parts {
        let left = left.clone();
        let done = done.clone();
        let failed = failed.clone();
        let job: Job = Box::new(move || {
            // SAFETY: the caller keeps the ranges valid until `done`, which runs only after
            // the last part has been copied.
            if let Err(e) = unsafe { run(&part, how) } {
                failed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(e);
            }
            if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                if let Some(d) = done.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    let r = failed.lock().unwrap_or_else(|e| e.into_inner()).take();
                    d(r.map_or(Ok(()), Err));
                }
            }
        });
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            job(); // No copy thread: copy here.
        }
    }
}

/// How a copy moves bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Mover {
    /// Both ranges in this process: `memmove`.
    Local,
    /// The remote side in process `pid` on this host: `process_vm_readv` (READ: remote
    /// sources) or `process_vm_writev` (WRITE: remote destinations).
    Process { pid: i32, read: bool },
}

/// # Safety
/// As [`copy`].
unsafe fn run(segs: &[Seg], how: Mover) -> Result<(), String> {
    match how {
        Mover::Local => {
            for s in segs {
                // SAFETY: the caller's contract; `copy` (memmove) allows overlap.
                unsafe { std::ptr::copy(s.src as *const u8, s.dst as *mut u8, s.len as usize) };
            }
            Ok(())
        }
        Mover::Process { pid, read } => {
            let iov = |addr: u64, len: u64| libc::iovec {
                iov_base: addr as *mut libc::c_void,
                iov_len: len as usize,
            };
            // (this process's range, the peer's range) of each segment.
            let pair = |s: &Seg, skip: u64| {
                let (here, there) = if read { (s.dst, s.src) } else { (s.src, s.dst) };
                (
                    iov(here + skip, s.len - skip),
                    iov(there + skip, s.len - skip),
                )
            };
            // Up to IOV_MAX pairs per call.
            for group in segs.chunks(1024) {
                let (local, remote): (Vec<_>, Vec<_>) = group.iter().map(|s| pair(s, 0)).unzip();
                // SAFETY: the local ranges lie in registrations the caller keeps valid; the
                // remote ones are the peer's, which the kernel checks against its mappings.
                let n = unsafe { process_vm(pid, read, &local, &remote) };
                if n < 0 {
                    return Err(cross_process_error(pid));
                }
                // A short count: go on from where it stopped, segment by segment (the bytes
                // before it are not copied again).
                let mut moved = n as u64;
                for s in group {
                    let mut done = moved.min(s.len);
                    moved -= done;
                    while done < s.len {
                        let (l, r) = pair(s, done);
                        // SAFETY: as above, a sub-range of the same segment.
                        let n = unsafe { process_vm(pid, read, &[l], &[r]) };
                        if n <= 0 {
                            return Err(cross_process_error(pid));
                        }
                        done += n as u64;
                    }
                }
            }
            Ok(())
        }
    }
}

/// `process_vm_readv` (`read`: into `local` from the peer's `remote`) or `process_vm_writev`.
///
/// # Safety
/// `local` must be valid for the direction's access.
unsafe fn process_vm(pid: i32, read: bool, local: &[libc::iovec], remote: &[libc::iovec]) -> isize {
    let call = if read {
        libc::process_vm_readv
    } else {
        libc::process_vm_writev
    };
    // SAFETY: both iovec arrays are valid for their lengths; the caller vouches for `local`.
    unsafe {
        call(
            pid,
            local.as_ptr(),
            local.len() as _,
            remote.as_ptr(),
            remote.len() as _,
            0,
        )
    }
}

fn cross_process_error(pid: i32) -> String {
    let e = std::io::Error::last_os_error();
    format!("copying with process {pid}'s memory (process_vm_readv/writev): {e}")
}

/// Whether this process may copy from process `pid`'s memory at `addr` (ptrace permission:
/// the same user, and Yama's `ptrace_scope` allowing it).
pub(crate) fn can_reach(pid: i32, addr: u64) -> bool {
    let mut b = 0u8;
    let l = [libc::iovec {
        iov_base: (&mut b as *mut u8).cast(),
        iov_len: 1,
    }];
    let r = [libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: 1,
    }];
    // SAFETY: `l` is one valid byte of ours; the kernel checks the remote one.
    unsafe { process_vm(pid, true, &l, &r) == 1 }
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

    /// Cross-memory attach with this process as the peer: more segments than one call takes
    /// (IOV_MAX), both directions, every byte where it belongs; an unmapped peer range is an
    /// error, not a partial success.
    #[test]
    fn process_copies_move_every_segment_both_ways() {
        let pid = std::process::id() as i32;
        let n = 2500usize;
        let src: Vec<u8> = (0..n * 8).map(|i| (i * 7 % 251) as u8).collect();
        for read in [true, false] {
            let mut dst = vec![0u8; n * 8];
            // Every other 8-byte segment, reversed, so no two calls could merge them.
            let segs: Vec<Seg> = (0..n)
                .rev()
                .map(|k| Seg {
                    dst: dst.as_mut_ptr() as u64 + (k * 8) as u64,
                    src: src.as_ptr() as u64 + (k * 8) as u64,
                    len: if k % 2 == 0 { 8 } else { 0 },
                })
                .collect();
            if !can_reach(pid, src.as_ptr() as u64) {
                println!("SKIPPED: process_vm_readv on this process is not allowed here");
                return;
            }
            // SAFETY: both buffers outlive the call; nothing else touches them.
            unsafe { run(&segs, Mover::Process { pid, read }) }.unwrap();
            for k in 0..n {
                let want: &[u8] = if k % 2 == 0 {
                    &src[k * 8..k * 8 + 8]
                } else {
                    &[0; 8]
                };
                assert_eq!(&dst[k * 8..k * 8 + 8], want, "segment {k}");
            }
        }
        let mut b = [0u8; 8];
        let bad = [Seg {
            dst: b.as_mut_ptr() as u64,
            src: 8, // the zero page: never mapped
            len: 8,
        }];
        // SAFETY: `b` outlives the call; the remote range is checked by the kernel.
        let r = unsafe { run(&bad, Mover::Process { pid, read: true }) };
        assert!(r.is_err(), "{r:?}");
    }
}
