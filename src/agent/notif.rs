//! Notifications: short messages from peers, queued in arrival order and read as a
//! [`Stream`](futures::Stream) or taken all at once (NIXL's `get_new_notifs`). A transfer's
//! notification is queued only after the transfer's data has landed.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context as TaskCx, Poll};
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;

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
    cv: Condvar,
    waker: AtomicWaker,
}

impl NotifQueue {
    pub(crate) fn push(&self, n: Notification) {
        self.q
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(n);
        self.cv.notify_all();
        self.waker.wake();
    }

    pub(crate) fn take_all(&self) -> Vec<Notification> {
        self.q
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect()
    }

    /// The next notification, waiting up to `timeout` for one.
    pub(crate) fn wait_next(&self, timeout: Duration) -> Option<Notification> {
        // A timeout past what the clock can add (`Duration::MAX`) waits for good.
        let deadline = Instant::now().checked_add(timeout);
        let mut q = self.q.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(n) = q.pop_front() {
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
        if let Some(n) = self.q.lock().unwrap_or_else(|e| e.into_inner()).pop_front() {
            return Poll::Ready(n);
        }
        self.waker.register(cx.waker());
        match self.q.lock().unwrap_or_else(|e| e.into_inner()).pop_front() {
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
