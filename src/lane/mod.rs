//! Lanes: the backends the reactor hands chunk I/O to. The main lane is the kernel interface,
//! io_uring (`uring`, preferred) or a pread/pwrite thread pool (`pread`, fallback); beside it
//! run cuFile batch I/O into device staging slots (`cufile`) and SPDK NVMe queue pairs
//! (`spdk`). A lane sees pieces of I/O (a token, a target, a range, memory) and reports
//! completions by token; it never sees the op table.

#[cfg(feature = "cuda")]
pub(crate) mod cufile;
pub(crate) mod doorbell;
pub(crate) mod pread;
pub(crate) mod spdk;
pub mod uring;

use std::io;
use std::os::fd::RawFd;

/// What one chunk I/O does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IoKind {
    Read,
    Write,
    Fsync,
}

/// One chunk I/O as the reactor hands it to a driver.
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

/// The reactor's kernel interface. One per engine, so the size difference does not matter.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Driver {
    Uring(uring::UringDriver),
    Pread(pread::PreadDriver),
}

impl Driver {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Driver::Uring(_) => "io_uring",
            Driver::Pread(_) => "pread",
        }
    }

    pub(crate) fn describe(&self) -> String {
        match self {
            Driver::Uring(d) => d.describe(),
            Driver::Pread(d) => d.describe(),
        }
    }

    pub(crate) fn uses_fixed_buffers(&self) -> bool {
        matches!(self, Driver::Uring(d) if d.fixed_buffers())
    }

    pub(crate) fn push(&mut self, req: IoRequest) -> io::Result<()> {
        match self {
            Driver::Uring(d) => d.push(req),
            Driver::Pread(d) => d.push(req),
        }
    }

    /// Submits queued I/O and collects completions; with `block`, sleeps until a completion,
    /// the doorbell, or `timeout` (if given).
    pub(crate) fn wait(
        &mut self,
        block: bool,
        timeout: Option<std::time::Duration>,
        out: &mut Vec<Completion>,
    ) -> io::Result<()> {
        match self {
            Driver::Uring(d) => d.wait(block, timeout, out),
            Driver::Pread(d) => d.wait(block, timeout, out),
        }
    }
}
