//! Lanes: what the reactor hands chunk I/O to, through `trait Lane`. The main lane is the
//! kernel interface, io_uring (`crate::uring`, preferred) or the portable pread/pwrite thread
//! pool here (`pread`, fallback); beside it run cuFile batch I/O into device staging slots
//! (`crate::gds::lane`) and SPDK NVMe queue pairs (`crate::spdk::lane`). Each backend's lane
//! lives in the backend's own folder with its FFI tiers. A lane sees pieces of I/O (a token, a
//! target, a range, memory) and reports completions by token; it never sees the op table.

pub(crate) mod doorbell;
pub(crate) mod pread;

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use crate::cuda::DeviceCtx;
use crate::error::{Context, Error};
use crate::plan::Via;
use crate::target::Target;

/// What one chunk I/O does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IoKind {
    Read,
    Write,
    Fsync,
}

/// One chunk I/O in the form the kernel lanes (io_uring, pread) submit it.
#[derive(Debug)]
pub(crate) struct IoRequest {
    pub(crate) kind: IoKind,
    pub(crate) fd: RawFd,
    /// Start of the bounce memory to read into / write from (null for fsync).
    pub(crate) buf: *mut u8,
    pub(crate) len: u32,
    pub(crate) pos: u64,
    /// Registered-buffer index of the bounce block holding `buf`.
    pub(crate) fixed: Option<u16>,
    /// Hand to io-wq instead of trying inline (`IOSQE_ASYNC`): large page-cache copies then
    /// run in parallel on kernel workers instead of one after another on the reactor thread.
    pub(crate) punt: bool,
    pub(crate) token: u64,
}

/// A finished chunk I/O: bytes transferred, or `-errno`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Completion {
    pub(crate) token: u64,
    pub(crate) res: i32,
}

/// The memory a piece moves through.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LaneMem {
    /// None (fsync).
    None,
    /// Host memory: a bounce slot (with its registered-buffer index, where the ring has the
    /// pool registered) or an owned buffer the op holds until the piece completes.
    Host { ptr: *mut u8, fixed: Option<u16> },
    /// The cuFile lane's device staging memory, at this byte offset of its pool.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Device { offset: usize },
}

/// One piece of I/O as the reactor hands it to a lane: what the lane needs, nothing of the op.
pub(crate) struct LaneIo<'a> {
    /// Reported back with the piece's [`Completion`].
    pub(crate) token: u64,
    pub(crate) kind: IoKind,
    pub(crate) target: &'a Target,
    /// The file's descriptor, its buffered twin (unaligned edges of O_DIRECT writes; for SPDK:
    /// a write covering part of its sectors, read-modify-written), or its O_DIRECT twin (reads
    /// of a buffered file's ranges the page cache lacks).
    pub(crate) via: Via,
    pub(crate) pos: u64,
    pub(crate) len: usize,
    pub(crate) mem: LaneMem,
    /// Hand to a kernel worker instead of trying inline (`IOSQE_ASYNC`, io_uring only).
    pub(crate) punt: bool,
}

impl LaneIo<'_> {
    /// The piece as the kernel lanes submit it.
    pub(crate) fn kernel_request(&self) -> IoRequest {
        let fd = match self.via {
            Via::Main => self.target.raw_fd(),
            Via::Buffered => self.target.buffered_raw_fd(),
            Via::Direct => self.target.direct_raw_fd(),
        };
        let (buf, fixed) = match self.mem {
            LaneMem::Host { ptr, fixed } => (ptr, fixed),
            _ => (std::ptr::null_mut(), None),
        };
        IoRequest {
            kind: self.kind,
            fd,
            buf,
            len: self.len as u32,
            pos: self.pos,
            fixed,
            punt: self.punt,
            token: self.token,
        }
    }
}

/// How a lane wants the reactor to wait while it has work out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitHint {
    /// Its completions wake the reactor (or it has none out): sleep as long as you like.
    Sleep,
    /// Its completions are found only by asking: look again within this long.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    PollEvery(Duration),
    /// Its completions are found only by polling and come fast: do not sleep.
    Spin,
}

/// What the reactor asks a lane beside the main one about an op it is taking
/// ([`Lane::route`]).
pub(crate) struct RouteAsk<'a> {
    pub(crate) target: &'a Target,
    /// The device context of the op's caller memory, where that is device memory.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) device: Option<&'a DeviceCtx>,
    /// The engine's piece size for O_DIRECT-like transfers.
    pub(crate) direct_chunk: usize,
    /// The host bounce pool's shape (block size, blocks): a device staging pool is shaped
    /// like it.
    pub(crate) pool_shape: (usize, usize),
}

/// How a lane that takes an op moves it.
pub(crate) struct Route {
    /// The op's pieces are aligned to at least this.
    pub(crate) align: u64,
    /// Largest piece.
    pub(crate) chunk: usize,
    /// The backend named in the op's errors and statistics.
    pub(crate) backend: &'static str,
    /// The lane moves the op's main pieces through device staging memory (cuFile): their
    /// slots come from the device pool, shaped like the host pool, and `keep` holds that memory
    /// (at device address `base`) for as long as the op's future may copy out of it.
    pub(crate) staging: Option<(u64, std::sync::Arc<dyn std::any::Any + Send + Sync>)>,
}

/// A lane's answer to [`Lane::route`].
pub(crate) enum Routed {
    /// Not this lane's op.
    No,
    /// This lane serves it.
    Take(Route),
    /// This lane must serve it and cannot: the op fails with `Unsupported` naming `backend`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Refuse { backend: &'static str, why: String },
}

/// What a completion means, as the lane that ran the piece reads it ([`Lane::classify`]).
pub(crate) enum Outcome {
    /// An ordinary result: bytes moved, or `-errno`.
    Res(i32),
    /// The lane failed the piece in its own terms. `fallback`: the piece may be read again
    /// by the main lane (and the file goes there from now on). `lost`: the lane cannot say
    /// whether its transfer still runs, so the piece's memory is never reused.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Failed {
        why: String,
        fallback: bool,
        lost: bool,
    },
}

/// A backend the reactor hands pieces of I/O to. One lane per kind of target memory or
/// device; the reactor picks the lane for each piece and learns the outcome only through
/// [`Completion`]s carrying the piece's token. Lanes never see ops, slots or the table.
///
/// The *main* lane (io_uring or the pread pool) is the one the reactor sleeps in: its
/// [`wait`](Lane::wait) with `block` returns on a completion, the doorbell, or the timeout.
/// Other lanes never block.
pub(crate) trait Lane: Send {
    /// The backend's name, for error context (`io_uring`, `pread`, `cufile`, `spdk`).
    fn name(&self) -> &'static str;
    /// One line for `gpuio check` and logs.
    fn describe(&self) -> String {
        self.name().to_string()
    }
    /// Queues a piece. An error means it never started; the reactor completes it with that
    /// error. The memory in `io.mem` must stay valid until the piece's completion is reaped.
    fn push(&mut self, io: LaneIo<'_>) -> io::Result<()>;
    /// Hands queued pieces to the device without waiting; completions found on the way are
    /// appended to `out`.
    fn flush(&mut self, _out: &mut Vec<Completion>) {}
    /// Collects completions into `out` (after submitting what is queued). Only the main lane
    /// blocks, and only with `block`: until a completion, the doorbell, or `timeout`.
    fn wait(
        &mut self,
        block: bool,
        timeout: Option<Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()>;
    /// Pieces pushed and not yet reported.
    fn outstanding(&self) -> usize;
    /// How the reactor should wait while this lane has work out.
    fn wait_hint(&self) -> WaitHint {
        WaitHint::Sleep
    }
    /// Whether host slots are passed as registered buffers (`LaneMem::Host::fixed` is used).
    fn uses_fixed_buffers(&self) -> bool {
        false
    }
    /// Whether buffered pieces are copied out of the page cache by a pool the kernel sizes
    /// (io_uring's io-wq), which the reactor then caps (`ReactorConfig::page_cache_copies`).
    /// A lane whose own threads are its concurrency (the pread pool) is not capped.
    fn copies_on_kernel_workers(&self) -> bool {
        false
    }
    /// Settles what the lane armed on its own account (the ring's doorbell read) so that it
    /// can be dropped without the kernel ever writing freed memory. Called with no piece out.
    fn retire(&mut self, _wake: &dyn Fn()) -> io::Result<()> {
        Ok(())
    }
    /// For a lane beside the main one: whether it serves the op `ask` describes (asked once,
    /// when the reactor takes the op; the main lane serves what no side lane takes).
    fn route(&mut self, _ask: &RouteAsk<'_>) -> Routed {
        Routed::No
    }
    /// What completion result `res` of a piece on `target` means.
    fn classify(&self, res: i32, _target: &Target) -> Outcome {
        Outcome::Res(res)
    }
    /// After [`Outcome::Failed`] with `fallback`: the lane gives `target` up (AUTO serves it
    /// through the main lane from now on, and says why).
    fn fall_back(&self, _target: &Target, _why: String) {}
    /// The error an op fails with after [`Outcome::Failed`] without a fallback.
    fn failure(&self, ctx: Context, why: String) -> Error {
        Error::io(ctx, io::Error::other(why))
    }
}
