//! The reactor's doorbell: an eventfd rung only when the reactor is asleep.
//!
//! Producers (futures sending messages, pread workers posting completions) push first and
//! then ring if `sleeping` is set; the reactor sets `sleeping`, looks at its queues once more
//! and only then blocks. This is the store-buffering pattern (each side writes one location,
//! then reads the other's), and SeqCst on the flag alone would not order it: the queue push and
//! the queue re-check are not SeqCst operations, so a producer's push could still sit in its
//! store buffer when it reads `sleeping == false`, while the reactor, having set the flag,
//! reads an empty queue and sleeps with work pending. A SeqCst fence on each side, between its
//! write and its read, forbids that outcome: of the two fences one comes first in their total
//! order, and the side after it sees the other side's write. A busy reactor still costs
//! producers no system call.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering, fence};

/// eventfd + "reactor is asleep" flag.
pub(crate) struct Doorbell {
    fd: OwnedFd,
    sleeping: AtomicBool,
    /// The reactor waits for bounce slots to come back; slot returns must wake it.
    starved: AtomicBool,
}

impl Doorbell {
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: eventfd has no memory preconditions; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Doorbell {
            // SAFETY: fd is a fresh descriptor we own.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            sleeping: AtomicBool::new(false),
            starved: AtomicBool::new(false),
        })
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Wakes the reactor if it is (about to be) asleep. Call after publishing work.
    pub(crate) fn ring(&self) {
        // Orders the caller's publication of work before the read of the flag (see the module
        // docs; pairs with the fence in `prepare_sleep`).
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) && self.sleeping.swap(false, Ordering::SeqCst) {
            self.ring_always();
        }
    }

    /// Like [`ring`](Self::ring), but only while the reactor is starved for bounce slots: slot
    /// returns and cancellations need not wake a reactor that has nothing waiting on them
    /// (it picks them up on its next turn), which saves a system call per small read.
    pub(crate) fn ring_if_starved(&self) {
        // As in `ring`: the slot return is published before `starved` is read.
        fence(Ordering::SeqCst);
        if self.starved.load(Ordering::SeqCst) {
            self.ring();
        }
    }

    /// Reactor side: whether work is waiting for slots to be given back.
    pub(crate) fn set_starved(&self, on: bool) {
        if self.starved.load(Ordering::Relaxed) != on {
            self.starved.store(on, Ordering::SeqCst);
        }
    }

    /// Writes the eventfd unconditionally.
    pub(crate) fn ring_always(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd. A failure (counter overflow,
        // impossible in practice) only means the reactor is already due to wake.
        unsafe {
            libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8);
        }
    }

    /// Reactor side: announce the intent to sleep. Re-check queues after this.
    pub(crate) fn prepare_sleep(&self) {
        self.sleeping.store(true, Ordering::SeqCst);
        // Orders the flag (and `starved`, set earlier in the turn) before the queue re-check
        // that follows; pairs with the fences in `ring` and `ring_if_starved`.
        fence(Ordering::SeqCst);
    }

    /// Reactor side: awake again.
    pub(crate) fn awake(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
    }

    /// Blocks until the eventfd is rung or `timeout` passes (used by the pread driver; io_uring
    /// reads the eventfd itself).
    pub(crate) fn wait_blocking(&self, timeout: Option<std::time::Duration>) {
        if let Some(t) = timeout {
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = t.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n <= 0 {
                return;
            }
        }
        let mut v: u64 = 0;
        loop {
            // SAFETY: reads 8 bytes into a live u64 from our eventfd.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
            if n >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return;
            }
        }
    }
}
