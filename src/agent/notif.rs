//! Notifications: short messages from peers, queued in arrival order and read as a
//! [`Stream`](futures::Stream) or taken all at once (NIXL's `get_new_notifs`). A transfer's
//! notification is queued only after the transfer's data has landed.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Context as TaskCx, Poll};
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;

/// How long [`NotifQueue::wait_next`] watches the queue before it parks.
const WAIT_SPIN: Duration = Duration::from_micros(50);

/// Whether waiting threads may spin: only with at least 8 cores, where a spinning waiter does
/// not take the core the progress or copy threads need (on 2 cores spinning made the
/// cross-process notification slower, not faster).
fn spin_allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| std::thread::available_parallelism().is_ok_and(|n| n.get() >= 8))
}

/// A message from a peer agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending agent's name.
    pub from: String,
    /// The message.
    pub msg: Vec<u8>,
}

/// An agent's incoming notifications.
#[derive(Default)]
pub(crate) struct NotifQueue {
    q: Mutex<VecDeque<Notification>>,
    /// `q`'s length, changed under its lock, read without it by spinning waiters.
    queued: AtomicUsize,
    cv: Condvar,
    waker: AtomicWaker,
}

impl NotifQueue {
    pub(crate) fn push(&self, n: Notification) {
        self.q
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(n);
        self.queued.fetch_add(1, Ordering::Release);
        self.cv.notify_all();
        self.waker.wake();
    }

    pub(crate) fn take_all(&self) -> Vec<Notification> {
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        self.queued.store(0, Ordering::Relaxed);
        q.drain(..).collect()
    }

    fn pop(&self, q: &mut VecDeque<Notification>) -> Option<Notification> {
        let n = q.pop_front()?;
        self.queued.fetch_sub(1, Ordering::Relaxed);
        Some(n)
    }

    /// The next notification, waiting up to `timeout` for one.
    pub(crate) fn wait_next(&self, timeout: Duration) -> Option<Notification> {
        // A timeout past what the clock can add (`Duration::MAX`) waits for good.
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        // Waking a parked thread costs a few microseconds, a notification's whole budget: where
        // cores are plenty, watch the queue for a moment first.
        if spin_allowed() {
            let until = start + timeout.min(WAIT_SPIN);
            while self.queued.load(Ordering::Acquire) == 0 && Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(n) = self.pop(&mut q) {
                return Some(n);
            }
            let now = Instant::now();
            q = match deadline {
                Some(d) if now >= d => return None,
                Some(d) => {
                    self.cv
                        .wait_timeout(q, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.cv.wait(q).unwrap_or_else(|e| e.into_inner()),
            };
        }
    }

    fn poll_next(&self, cx: &mut TaskCx<'_>) -> Poll<Notification> {
        if let Some(n) = self.pop(&mut self.q.lock().unwrap_or_else(|e| e.into_inner())) {
            return Poll::Ready(n);
        }
        self.waker.register(cx.waker());
        match self.pop(&mut self.q.lock().unwrap_or_else(|e| e.into_inner())) {
            Some(n) => Poll::Ready(n),
            None => Poll::Pending,
        }
    }
}

/// An agent's notifications as a stream that never ends (it lives as long as the agent's
/// queue). Several streams of one agent share the queue: each notification goes to one of
/// them, and only the most recently polled one is woken.
pub struct Notifications {
    pub(crate) queue: Arc<NotifQueue>,
}

impl futures::Stream for Notifications {
    type Item = Notification;
    fn poll_next(self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Option<Notification>> {
        self.queue.poll_next(cx).map(Some)
    }
}
