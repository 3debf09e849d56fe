//! The kernel I/O paths: io_uring (preferred) and a pread/pwrite thread pool (fallback), behind
//! one `Driver` the reactor submits chunk I/O to; request planning and O_DIRECT alignment.

pub mod align;
pub(crate) mod plan;
pub(crate) mod pread;
pub(crate) mod ring;

use std::io;
use std::os::fd::RawFd;

pub use ring::RingFlags;

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
    Uring(ring::UringDriver),
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

/// What `gpuio check` reports about io_uring on this machine.
#[derive(Debug, Clone)]
pub struct UringProbe {
    /// Whether a ring could be created.
    pub available: bool,
    /// The setup flags the kernel accepted.
    pub flags: Option<RingFlags>,
    /// Refused flag sets and other notes.
    pub notes: Vec<String>,
    /// `kernel.io_uring_disabled`, where readable.
    pub disabled_sysctl: Option<String>,
}

/// Tries to set up a small ring the way the engine would.
pub fn probe() -> UringProbe {
    let disabled_sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .map(|s| s.trim().to_string());
    match ring::setup_ring(8) {
        Ok((_ring, flags, notes)) => UringProbe {
            available: true,
            flags: Some(flags),
            notes,
            disabled_sysctl,
        },
        Err(e) => UringProbe {
            available: false,
            flags: None,
            notes: vec![e.to_string()],
            disabled_sysctl,
        },
    }
}
