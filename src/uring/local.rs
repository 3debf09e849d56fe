//! Polling-thread rings: small O_DIRECT reads submitted by the thread that polls them, into
//! memory the ring owns, and reaped by whichever thread polls next.
//!
//! A 4 KiB O_DIRECT read through the reactor crosses threads twice (the message and doorbell
//! to the reactor, the completion's wake back), and the reactor thread pays every read's
//! submission: on a RAM-backed loop device that thread is the ceiling, and the round trip
//! keeps a fifth of the queue depth out of the kernel (`BENCHMARKS.md`, twelfth session).
//! Here a read's first poll pushes one SQE to a ring of its thread's and enters the kernel;
//! each later poll of any read on that ring reaps every completion there and wakes their
//! futures (on the same thread, mostly: a local wake). Where nobody polls, one waiter
//! thread per engine, in `epoll_wait` on every ring, reaps and wakes instead, so a read
//! never waits for a poll that is not coming.
//!
//! # Soundness under cancellation and leaks
//! The kernel writes only into the ring's own slots, never into caller memory; bytes go to
//! the caller inside the future's `poll`, after its completion, as for the reactor's slots.
//! - A future dropped mid-flight marks its slot abandoned; the thread that reaps its
//!   completion frees it.
//! - A future leaked mid-flight keeps its slot forever (bounded: a ring has [`SLOTS`];
//!   when none is free, reads go through the reactor).
//! - The ring's memory is unmapped only after every read the kernel holds has completed
//!   (`LocalRing`'s drop waits, up to a limit past which the memory is leaked instead).
//! - The file descriptor is the caller's: the SQE is submitted, and the kernel takes its own
//!   reference to the file, inside the poll that borrows the file.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, types};

use crate::buf::aligned::AlignedBuf;

/// Largest read a polling-thread ring takes (bytes): the small reads whose cost is the
/// round trip, not the bytes.
pub(crate) const LOCAL_READ_MAX: usize = 64 << 10;

/// Slots (reads in flight) per ring.
pub(crate) const SLOTS: usize = 128;

/// How long a ring's drop waits for reads still in the kernel before leaking its memory.
const DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// The rings of one engine: one per thread slot, made at a thread's first read.
pub(crate) struct LocalRings {
    set: Arc<RingSet>,
}

/// What the waiter thread shares with the engine.
struct RingSet {
    rings: Box<[OnceLock<Option<Arc<LocalRing>>>]>,
    /// The waiter's epoll set: every ring's descriptor, and `stop`.
    epoll: OwnedFd,
    /// Written when the engine goes: the waiter then exits.
    stop: OwnedFd,
    /// Whether the waiter thread was started (`None` inside: it could not be).
    waiter: OnceLock<bool>,
}

/// Numbers the threads that poll reads, in the order of their first read.
static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD_SLOT: usize = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

/// `epoll_event.u64` of the stop eventfd (rings use their index).
const STOP_TOKEN: u64 = u64::MAX;

impl LocalRings {
    /// Up to `rings` rings (threads beyond that share them). Fails where epoll or eventfd
    /// cannot be had; rings themselves are made at first use.
    pub(crate) fn new(rings: usize) -> io::Result<LocalRings> {
        // SAFETY: plain system calls; each result is checked before it is owned.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `epoll` is a new descriptor nothing else owns.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        // SAFETY: as above.
        let stop = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if stop < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `stop` is a new descriptor nothing else owns.
        let stop = unsafe { OwnedFd::from_raw_fd(stop) };
        watch(epoll.as_raw_fd(), stop.as_raw_fd(), STOP_TOKEN)?;
        Ok(LocalRings {
            set: Arc::new(RingSet {
                rings: (0..rings.max(1)).map(|_| OnceLock::new()).collect(),
                epoll,
                stop,
                waiter: OnceLock::new(),
            }),
        })
    }

    /// The calling thread's ring, made (and the waiter started) at first use. `None`: the
    /// kernel refused a ring, or no waiter thread could be started; reads go through the
    /// reactor.
    pub(crate) fn for_this_thread(&self) -> Option<&Arc<LocalRing>> {
        let set = &self.set;
        let i = THREAD_SLOT.with(|s| *s) % set.rings.len();
        let ring = set.rings[i]
            .get_or_init(|| {
                let ring = LocalRing::new().ok()?;
                if std::env::var_os("GPUIO_LOCAL_TIMER").is_none() {
                    watch(set.epoll.as_raw_fd(), ring.fd, i as u64).ok()?;
                }
                Some(Arc::new(ring))
            })
            .as_ref()?;
        set.waiter
            .get_or_init(|| {
                let waiter_set = Arc::clone(set);
                std::thread::Builder::new()
                    .name("gpuio-ring-waiter".into())
                    .spawn(move || waiter_set.wait_loop())
                    .is_ok()
            })
            .then_some(ring)
    }
}

impl Drop for LocalRings {
    fn drop(&mut self) {
        // The waiter may be the thread dropping the engine (a waker it dropped held the last
        // handle): it is told to stop, never joined. Rings stay alive while reads hold them.
        let one: u64 = 1;
        // SAFETY: `stop` is our open eventfd; the write reads 8 bytes from `one`.
        unsafe {
            libc::write(
                self.set.stop.as_raw_fd(),
                (&raw const one).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

/// Adds `fd` to the epoll set `epoll`, level-triggered, readable, tagged `token`.
fn watch(epoll: RawFd, fd: RawFd, token: u64) -> io::Result<()> {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: token,
    };
    // SAFETY: both descriptors are open; `ev` is a valid event the kernel copies.
    if unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl RingSet {
    /// The waiter: reaps every ring that has completions nobody polled for, until `stop`.
    fn wait_loop(&self) {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        loop {
            // SAFETY: `events` is writable for its length; `epoll` is open while `self` is.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as i32,
                    timer_ms(),
                )
            };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            if n == 0 {
                for ring in self.rings.iter().filter_map(|r| r.get()).flatten() {
                    ring.reap(None);
                }
            }
            for ev in &events[..n as usize] {
                let token = ev.u64;
                if token == STOP_TOKEN {
                    return;
                }
                if let Some(Some(ring)) = self.rings.get(token as usize).and_then(OnceLock::get) {
                    ring.reap(None);
                }
            }
        }
    }
}

fn timer_ms() -> i32 {
    std::env::var("GPUIO_LOCAL_TIMER")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1)
}

/// One slot's state.
enum SlotState {
    Free,
    /// In the kernel; the waker of the future that waits for it.
    InFlight(Option<Waker>),
    /// Completed with this result (bytes, or a negative errno); the future has not looked yet.
    Done(i32),
    /// In the kernel, its future gone: freed when it completes.
    Abandoned,
}

struct RingState {
    ring: IoUring,
    slots: Vec<SlotState>,
    free: Vec<u16>,
    /// Reads pushed and not yet reaped.
    in_kernel: usize,
}

/// A ring and the slots its reads land in.
pub(crate) struct LocalRing {
    state: Mutex<RingState>,
    fd: RawFd,
    /// `SLOTS` × `LOCAL_READ_MAX` bytes, 4 KiB-aligned; only touched through `base`.
    _mem: AlignedBuf,
    base: NonNull<u8>,
}

// SAFETY: `base` points into `_mem`, which the ring owns for its whole life; each slot is
// written by the kernel only while its read is in flight and read only by the one
// `LocalRead` that owns the slot after completion (`SlotState` under the mutex says which).
unsafe impl Send for LocalRing {}
// SAFETY: as above; all other state is behind the mutex.
unsafe impl Sync for LocalRing {}

impl LocalRing {
    fn new() -> io::Result<LocalRing> {
        // No SINGLE_ISSUER (several threads may share a ring) and no deferred task work: a
        // completion is posted on the submitting thread even while it sleeps, so the waiter
        // sees it.
        let ring = match std::env::var("GPUIO_LOCAL_FLAGS").as_deref() {
            Ok("coop") => IoUring::builder()
                .setup_coop_taskrun()
                .setup_taskrun_flag()
                .build(SLOTS as u32)?,
            Ok("sqpoll") => IoUring::builder().setup_sqpoll(10).build(SLOTS as u32)?,
            _ => IoUring::builder().build(SLOTS as u32)?,
        };
        let fd = ring.as_raw_fd();
        let mut mem = AlignedBuf::zeroed(SLOTS * LOCAL_READ_MAX);
        let base = NonNull::new(mem.as_mut_ptr()).ok_or_else(|| io::Error::other("null"))?;
        Ok(LocalRing {
            state: Mutex::new(RingState {
                ring,
                slots: (0..SLOTS).map(|_| SlotState::Free).collect(),
                free: (0..SLOTS as u16).rev().collect(),
                in_kernel: 0,
            }),
            fd,
            _mem: mem,
            base,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RingState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a read of `len` bytes (at most [`LOCAL_READ_MAX`]) at `offset` of `fd` into a
    /// free slot, submitted before this returns. `None`: no slot is free, or the kernel took
    /// nothing; the caller reads through the reactor.
    pub(crate) fn start(
        self: &Arc<Self>,
        fd: RawFd,
        offset: u64,
        len: usize,
        waker: &Waker,
    ) -> Option<LocalRead> {
        if len == 0 || len > LOCAL_READ_MAX {
            return None;
        }
        let mut st = self.lock();
        let slot = st.free.pop()?;
        // SAFETY: `slot` < SLOTS, so the slot's LOCAL_READ_MAX bytes lie inside `_mem`.
        let buf = unsafe { self.base.as_ptr().add(slot as usize * LOCAL_READ_MAX) };
        let sqe = opcode::Read::new(types::Fd(fd), buf, len as u32)
            .offset(offset)
            .build()
            .user_data(u64::from(slot));
        // SAFETY: the slot's memory stays mapped until the read completes (the ring owns it
        // and its drop waits for reads in the kernel); nothing else touches it meanwhile
        // (the slot is off the free list). `fd` is open: the caller borrows its file for
        // this call, and the submission below takes the kernel's own reference.
        let pushed = unsafe { st.ring.submission().push(&sqe) }.is_ok();
        if !pushed {
            st.free.push(slot);
            return None;
        }
        st.in_kernel += 1;
        let submitted = st.ring.submit();
        if submitted.is_err() || !st.ring.submission().is_empty() {
            // The kernel did not take the SQE (submission runs in order, so the last one
            // pushed is among those left). It stays queued and goes in with a later
            // submission, maybe after the caller's descriptor is closed: the slot is
            // abandoned, so whatever that read returns is thrown away when it is reaped.
            st.slots[slot as usize] = SlotState::Abandoned;
            return None;
        }
        st.slots[slot as usize] = SlotState::InFlight(Some(waker.clone()));
        drop(st);
        Some(LocalRead {
            ring: Arc::clone(self),
            slot,
            len,
            landed: None,
        })
    }

    /// Reaps every completion in the ring: marks their slots done (or frees abandoned ones)
    /// and wakes their futures, except the one `mine` names, whose result this returns where
    /// its read has completed, and whose waker is kept for when it does.
    fn reap(&self, mine: Option<(u16, &Waker)>) -> Option<i32> {
        let mut wake: smallvec::SmallVec<[Waker; 16]> = smallvec::SmallVec::new();
        let done = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let mut reaped = 0;
            for cqe in st.ring.completion() {
                reaped += 1;
                let slot = cqe.user_data() as usize;
                let Some(state) = st.slots.get_mut(slot) else {
                    continue;
                };
                match std::mem::replace(state, SlotState::Done(cqe.result())) {
                    SlotState::InFlight(w) => {
                        if mine.map(|(m, _)| m as usize) != Some(slot) {
                            wake.extend(w);
                        }
                    }
                    SlotState::Abandoned => {
                        *state = SlotState::Free;
                        st.free.push(slot as u16);
                    }
                    // One SQE per slot in flight: no other state gets a completion.
                    other => *state = other,
                }
            }
            st.in_kernel -= reaped.min(st.in_kernel);
            match mine {
                Some((m, waker)) => match &mut st.slots[m as usize] {
                    SlotState::Done(res) => Some(*res),
                    SlotState::InFlight(w) => {
                        if !w.as_ref().is_some_and(|w| w.will_wake(waker)) {
                            *w = Some(waker.clone());
                        }
                        None
                    }
                    SlotState::Free | SlotState::Abandoned => None,
                },
                None => None,
            }
        };
        // Outside the lock: a waker may run code that polls this ring.
        for w in wake {
            w.wake();
        }
        done
    }
}

impl Drop for LocalRing {
    fn drop(&mut self) {
        let deadline = Instant::now() + DRAIN_LIMIT;
        loop {
            let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
            let reaped = st.ring.completion().count();
            st.in_kernel -= reaped.min(st.in_kernel);
            if st.in_kernel == 0 {
                return;
            }
            if Instant::now() >= deadline || st.ring.submit_and_wait(1).is_err() {
                break;
            }
        }
        // Reads still in the kernel after the limit: their memory must outlive them.
        let mem = std::mem::take(&mut self._mem);
        std::mem::forget(mem);
    }
}

/// A read in flight on a [`LocalRing`], owning its slot until dropped.
pub(crate) struct LocalRead {
    ring: Arc<LocalRing>,
    slot: u16,
    len: usize,
    /// The kernel's result, once reaped.
    landed: Option<i32>,
}

impl LocalRead {
    /// Reaps the ring; ready with the kernel's result (bytes read, or a negative errno) once
    /// this read has completed.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<i32> {
        if self.landed.is_none() {
            self.landed = self.ring.reap(Some((self.slot, cx.waker())));
        }
        match self.landed {
            Some(res) => Poll::Ready(res),
            None => Poll::Pending,
        }
    }

    /// The bytes the kernel read: `n` of them, at most the read's length. Empty before the
    /// read has completed.
    pub(crate) fn bytes(&self, n: usize) -> &[u8] {
        match self.landed {
            // SAFETY: the read completed (reaped under the lock), so the kernel no longer
            // writes the slot, and this `LocalRead` owns it until dropped: no one else reads
            // or writes it. The slot lies inside the ring's memory, which `self.ring` keeps.
            Some(res) if res >= 0 => unsafe {
                std::slice::from_raw_parts(
                    self.ring
                        .base
                        .as_ptr()
                        .add(self.slot as usize * LOCAL_READ_MAX),
                    n.min(self.len).min(res as usize),
                )
            },
            _ => &[],
        }
    }
}

impl Drop for LocalRead {
    fn drop(&mut self) {
        let mut st = self.ring.lock();
        let st = &mut *st;
        let state = &mut st.slots[self.slot as usize];
        match state {
            SlotState::InFlight(_) => *state = SlotState::Abandoned,
            SlotState::Done(_) => {
                *state = SlotState::Free;
                st.free.push(self.slot);
            }
            SlotState::Free | SlotState::Abandoned => {}
        }
    }
}
