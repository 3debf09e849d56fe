//! The threads that run an engine's asynchronous requests: a small pool polling `Send`
//! futures from one queue. The library's futures work under any executor, so C callers need no
//! async runtime of their own.
//!
//! Written here rather than taken from `futures::executor::ThreadPool` because an engine must
//! be able to stop its threads and join them: that pool's threads stop only once every waker
//! of every task it ran is gone, and a waker may stay registered with an operation the
//! library is still tidying up. Here a waker holds its task and a weak reference to the queue,
//! so stopping does not wait on wakers.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::Context;

use futures::task::{ArcWake, waker_ref};

type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send>>;

thread_local! {
    /// Whether this thread is an executor thread (blocking here would stall the requests it
    /// runs, or deadlock waiting for them).
    static ON_EXECUTOR: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is one of an engine's executor threads.
pub(crate) fn on_executor() -> bool {
    ON_EXECUTOR.with(|c| c.get())
}

struct Queue {
    tasks: VecDeque<Arc<Task>>,
    stopping: bool,
    /// Threads waiting for work: a push with none skips the notify (a system call).
    idle: usize,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

struct Task {
    /// `None` once the future has finished.
    future: Mutex<Option<BoxFuture>>,
    /// In the queue (or about to be): a wake-up then adds nothing.
    scheduled: AtomicBool,
    queue: Weak<Shared>,
}

impl ArcWake for Task {
    fn wake_by_ref(task: &Arc<Self>) {
        if task.scheduled.swap(true, Ordering::AcqRel) {
            return;
        }
        // A stopped executor drops late wake-ups: its tasks have all finished (see `Drop`).
        if let Some(shared) = task.queue.upgrade() {
            let mut q = shared.lock();
            q.tasks.push_back(task.clone());
            if q.idle > 0 {
                shared.ready.notify_one();
            }
        }
    }
}

/// An engine's executor threads.
pub(crate) struct Executor {
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// The process that started the threads: a child made by `fork()` has none of them.
    pid: u32,
}

impl Executor {
    /// Starts `threads` threads (at least one).
    pub(crate) fn new(threads: usize) -> std::io::Result<Executor> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                tasks: VecDeque::new(),
                stopping: false,
                idle: 0,
            }),
            ready: Condvar::new(),
        });
        let mut exec = Executor {
            shared,
            threads: Vec::new(),
            pid: std::process::id(),
        };
        for i in 0..threads.max(1) {
            let shared = exec.shared.clone();
            // On failure `exec` drops here, stopping the threads already started.
            let t = std::thread::Builder::new()
                .name(format!("gpuio-capi-{i}"))
                .spawn(move || work(&shared))?;
            exec.threads.push(t);
        }
        Ok(exec)
    }

    /// Runs `future` to completion on the executor threads.
    pub(crate) fn spawn(&self, future: impl Future<Output = ()> + Send + 'static) {
        let task = Arc::new(Task {
            future: Mutex::new(Some(Box::pin(future))),
            scheduled: AtomicBool::new(false),
            queue: Arc::downgrade(&self.shared),
        });
        ArcWake::wake_by_ref(&task);
    }
}

fn work(shared: &Shared) {
    ON_EXECUTOR.with(|c| c.set(true));
    loop {
        let task = {
            let mut q = shared.lock();
            loop {
                if let Some(t) = q.tasks.pop_front() {
                    break t;
                }
                if q.stopping {
                    return;
                }
                q.idle += 1;
                q = shared.ready.wait(q).unwrap_or_else(|p| p.into_inner());
                q.idle -= 1;
            }
        };
        // Cleared before polling, so a wake-up during the poll queues the task again.
        task.scheduled.store(false, Ordering::Release);
        let waker = waker_ref(&task);
        let mut cx = Context::from_waker(&waker);
        let mut slot = task.future.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(fut) = slot.as_mut() {
            // Request bodies catch their own panics; this keeps the thread alive if anything
            // else in a task ever panics (the task is then dropped).
            match catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(&mut cx))) {
                Ok(std::task::Poll::Pending) => {}
                Ok(std::task::Poll::Ready(())) | Err(_) => *slot = None,
            }
        }
    }
}

impl Drop for Executor {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child: these threads do not exist here, and joining one would wait
            // on a thread id that means nothing in this process.
            std::mem::forget(std::mem::take(&mut self.threads));
            return;
        }
        self.shared.lock().stopping = true;
        self.shared.ready.notify_all();
        let me = std::thread::current().id();
        for t in self.threads.drain(..) {
            // The last handle may go on one of these threads (inside a task): it cannot join
            // itself, and ends on its own once its task returns.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}
