//! Blocking reads that land in the caller's own memory ([`File::read_into_blocking`],
//! [`BatchPlan::read_into_blocking`]).
//!
//! An async read into borrowed memory cannot let the kernel write that memory: its future may
//! be dropped, or leaked with `mem::forget`, while a read is in the kernel, and the borrow
//! ends either way. So `read_into` lands every piece in a bounce slot and copies it out on
//! the polling thread. A call that blocks its thread has no such escape: the memory stays lent
//! until the call returns, and it returns (or unwinds) only once no read holds the memory. The
//! kernel then reads straight into it, as it does into owned buffers (`File::read_owned`):
//! io_uring's workers copy out of the page cache, several at once, and no copy is left for
//! the calling thread.
//!
//! [`File::read_into_blocking`]: crate::File::read_into_blocking
//! [`BatchPlan::read_into_blocking`]: crate::BatchPlan::read_into_blocking

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use crate::buf::region::{Hold, HostRegion, Released};

/// How often a blocked read asks its caller whether to go on.
pub(crate) const ASK_EVERY: Duration = Duration::from_millis(100);

/// Lends `dst` to the reads `read` starts with the region over it (each read holding a clone
/// for as long as the kernel may write its range), has `drive` run them on this thread
/// ([`block_on`] or [`run_asking`]), and returns what it gave once no read holds `dst`: after
/// they end, or after `drive` dropped them (cancelled as any gpuio future is). Once `drive`
/// has stopped the reads, the wait for the pieces already in the kernel asks no one (a cold
/// read on slow storage may take a while to let go).
///
/// If a reactor dies with one of these reads in the kernel, the kernel may write `dst` at any
/// time from then on and nothing will say when it has stopped: returning would hand the
/// caller memory the kernel still writes, and waiting would never end, so the process aborts
/// with a message. That takes a reactor panic or a failed io_uring call while the read runs.
pub(crate) fn lend<F: Future, R>(
    dst: &mut [u8],
    read: impl FnOnce(Arc<HostRegion>) -> F,
    drive: impl FnOnce(F) -> R,
) -> R {
    // SAFETY: `dst` is neither read, written nor freed by this function after this point, and
    // its borrow lasts until this function returns. `region` moves into `read` and the reads
    // into `drive`, which drops them before it returns or while it unwinds, so this frame holds
    // no clone; `_returned` drops after that (unwinding included) and returns only once
    // `released` reads `Released` (it aborts on `KeptByKernel`). `R` holds no clone: it is
    // what `drive` made of the reads' outputs, and no read outputs its region.
    let (region, released) = unsafe { HostRegion::borrowed(dst) };
    let _returned = WaitForRelease(released);
    drive(read(region))
}

/// Polls `fut` to its end on this thread.
pub(crate) fn block_on<T>(fut: impl Future<Output = T>) -> T {
    futures::executor::block_on(fut)
}

/// Polls `fut` to its end on this thread, asking `keep_going` once it has started and every
/// [`ASK_EVERY`] after; `None` (and `fut` dropped) once it says no.
pub(crate) fn run_asking<T>(
    fut: impl Future<Output = T>,
    keep_going: &mut dyn FnMut() -> bool,
) -> Option<T> {
    let mut fut = std::pin::pin!(fut);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    // The first ask comes as soon as the reads are under way (a progress report of nothing
    // done yet, with the total), then one every `ASK_EVERY`.
    let mut ask_at = Instant::now();
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return Some(v);
        }
        let now = Instant::now();
        if now >= ask_at {
            if !keep_going() {
                return None;
            }
            ask_at = Instant::now() + ASK_EVERY;
            continue;
        }
        // A wake that came before this park makes it return at once (the thread's token).
        std::thread::park_timeout(ask_at - now);
    }
}

/// Wakes the thread blocked in [`run_asking`].
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Blocks its drop until no read holds the lent memory.
struct WaitForRelease(Arc<Released>);

impl Drop for WaitForRelease {
    fn drop(&mut self) {
        loop {
            match self.0.wait(Duration::from_secs(1)) {
                Hold::Released => return,
                Hold::Held => continue,
                Hold::KeptByKernel => {
                    // Printed rather than logged only: the process ends on the next line.
                    tracing::error!("gpuio: a reactor died with a read into lent memory in flight");
                    eprintln!(
                        "gpuio: a reactor died with a blocking read in the kernel, into memory \
                         the caller lent; the kernel may still write that memory and nothing \
                         will say when it stops, so the process aborts rather than return it"
                    );
                    std::process::abort();
                }
            }
        }
    }
}
