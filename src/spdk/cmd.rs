//! One SPDK command as the lane tracks it ([`Cmd`], boxed; its pointer is SPDK's callback
//! argument), the completion callback that collects finished commands for the lane, and the
//! mapping of NVMe status codes to errnos.

use std::cell::Cell;
use std::ffi::c_void;

use crate::spdk::env::DmaRegion;
use crate::spdk::sys::RawCpl;

/// What one command does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Opcode {
    Read,
    Write,
    Flush,
    /// Read of the sector under a partial write.
    RmwRead,
    /// Write of that sector with the caller's bytes merged in.
    RmwWrite,
}

/// A command on its way through SPDK. Boxed; its pointer is the callback argument.
pub(crate) struct Cmd {
    pub(crate) token: u64,
    pub(crate) opcode: Opcode,
    /// Slot memory (reads: destination; writes: source), `len` bytes at file position `pos`.
    pub(crate) buf: *mut u8,
    pub(crate) pos: u64,
    pub(crate) len: usize,
    /// The sector buffer of a read-modify-write.
    pub(crate) rmw: Option<DmaRegion>,
    /// Which queue (key in the lane) it belongs to.
    pub(crate) queue: usize,
}

impl Cmd {
    /// The sectors a partial write touches: first LBA and count (at most two: a range with no
    /// whole sector inside).
    pub(crate) fn rmw_span(&self, sector: u64) -> (u64, u64) {
        let first = self.pos / sector;
        let last = (self.pos + self.len.max(1) as u64 - 1) / sector;
        (first, last - first + 1)
    }
}

// SAFETY: the raw pointer is a bounce-slot address the reactor owns until the command ends;
// commands never leave the reactor thread (Send is needed only because the lane lives in the
// reactor, which is created on another thread before it runs).
unsafe impl Send for Cmd {}

thread_local! {
    /// Commands SPDK completed during the current poll (filled by the callback).
    pub(crate) static DONE: Cell<Vec<(Box<Cmd>, u8, u8)>> = const { Cell::new(Vec::new()) };
}

/// SPDK's completion callback.
///
/// # Safety
/// `arg` is a pointer from `Box::into_raw(Box<Cmd>)` given to exactly one command; `cpl` is a
/// valid completion for the duration of the call.
pub(crate) unsafe extern "C" fn on_complete(arg: *mut c_void, cpl: *const RawCpl) {
    // SAFETY: per the contract above, each command's box is reclaimed once, here.
    let cmd = unsafe { Box::from_raw(arg.cast::<Cmd>()) };
    // SAFETY: `cpl` is valid during the call (or null, treated as an abort).
    let (sct, sc) = unsafe { cpl.as_ref() }.map_or((0, 0x08), RawCpl::sct_sc);
    // `try_with`: a panic must not cross into C. Only on a thread already tearing down its
    // thread-locals could it fail, and then nobody waits for the command any more.
    let _ = DONE.try_with(|d| {
        let mut v = d.take();
        v.push((cmd, sct, sc));
        d.set(v);
    });
}

/// Maps an NVMe status to the negative errno gpuio reports.
pub(crate) fn status_errno(sct: u8, sc: u8) -> i32 {
    match (sct, sc) {
        (0, 0) => 0,
        // Aborted by SQ deletion: the qpair went away under the command.
        (0, 0x07) | (0, 0x08) => -libc::ECONNRESET,
        // LBA out of range, capacity exceeded.
        (0, 0x80) | (0, 0x81) => -libc::EINVAL,
        // Namespace not ready / write to read-only.
        (0, 0x82) => -libc::EAGAIN,
        (1, 0x82) | (2, 0x82) => -libc::EROFS,
        _ => -libc::EIO,
    }
}
