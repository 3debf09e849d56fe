//! A small O_DIRECT read on its polling thread's ring (`uring::local`): started at the read's
//! first poll, copied out of the ring's slot in the poll that finds it complete. Anything the
//! ring cannot serve (no ring or free slot, a short count, an error, a device copy the stream
//! cannot take) goes through the reactor instead, which reads again and reports it with the
//! op's own context.

use std::task::{Context as TaskContext, Poll};

use super::engine_shared::LocalDevice;
use super::future::Either;
use super::progress::OpProgress;
use super::read::{CopyOut, ReadSource};
use crate::error::Result;
use crate::uring::local::{LOCAL_READ_MAX, LocalRead};

/// A read in the kernel on a polling thread's ring, with what its copy out needs.
pub(crate) struct LocalStage<'a> {
    pub(super) file: &'a dyn ReadSource,
    pub(super) offset: u64,
    pub(super) transfer: CopyOut<'a>,
    pub(super) progress: Option<OpProgress>,
    read: LocalRead,
    len: usize,
}

/// Starts the read on this thread's ring where the read qualifies: an O_DIRECT file of an
/// engine with rings, offset and length aligned for it, at most [`LOCAL_READ_MAX`] bytes, a
/// valid request, no unfinished write of the file (the reactor's fence orders reads after
/// those), and for device memory a file cuFile does not serve and a single staged copy.
/// `Err` gives the parts back, for the reactor.
#[allow(clippy::type_complexity)]
pub(super) fn start<'a>(
    file: &'a dyn ReadSource,
    offset: u64,
    mut transfer: CopyOut<'a>,
    progress: Option<OpProgress>,
    cx: &TaskContext<'_>,
) -> std::result::Result<LocalStage<'a>, (CopyOut<'a>, Option<OpProgress>)> {
    let Some(len) = qualifies(file, offset, &mut transfer) else {
        return Err((transfer, progress));
    };
    let target = file.target();
    let ring = file
        .engine_shared()
        .local
        .get()
        .and_then(|l| l.rings.for_this_thread());
    match ring.and_then(|r| r.start(target.raw_fd(), offset, len, cx.waker())) {
        Some(read) => Ok(LocalStage {
            file,
            offset,
            transfer,
            progress,
            read,
            len,
        }),
        None => Err((transfer, progress)),
    }
}

/// The read's length where it qualifies for a ring (see [`start`]).
fn qualifies(file: &dyn ReadSource, offset: u64, transfer: &mut CopyOut<'_>) -> Option<usize> {
    let target = file.target();
    let engine = file.engine_shared();
    let local = engine.local.get()?;
    let dio = target.dio?;
    let len = match transfer {
        Either::Host(h) => h.dst.len(),
        #[cfg(feature = "cuda")]
        Either::Device(d) => {
            let cufile_may_serve = match local.device {
                LocalDevice::All => false,
                LocalDevice::WithoutCufile => !target.gds_declined(),
                LocalDevice::None => true,
            };
            if cufile_may_serve || d.copy_plan() != super::device::DeviceCopyPlan::Staged {
                return None;
            }
            d.dst.byte_len()
        }
        #[cfg(not(feature = "cuda"))]
        Either::Device(_) => return None,
    };
    let align = u64::from(dio.offset.max(1));
    let ok = len > 0
        && len <= LOCAL_READ_MAX
        && offset % align == 0
        && len as u64 % align == 0
        && target.nvme.is_none()
        && file.check_read(offset, len).is_ok()
        && !engine.reactor.refuses_work()
        && !engine.writes_pending.any(&target.fence_key);
    ok.then_some(len)
}

impl<'a> LocalStage<'a> {
    /// Ready once the read has completed: `Ok` with the read's result where its bytes went to
    /// the destination, `Err` with the parts for the reactor where they could not.
    #[allow(clippy::type_complexity)]
    pub(super) fn poll(
        &mut self,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::result::Result<Result<usize>, ()>> {
        let Poll::Ready(res) = self.read.poll(cx) else {
            return Poll::Pending;
        };
        if usize::try_from(res).ok() != Some(self.len) {
            // A short count (end of file, or a range the device split) or an error: the
            // reactor's read tells which, with the op's context.
            return Poll::Ready(Err(()));
        }
        let bytes = self.read.bytes(self.len);
        let served = match &mut self.transfer {
            Either::Host(h) => {
                h.dst.copy_from_slice(bytes);
                Some(Ok(bytes.len()))
            }
            #[cfg(feature = "cuda")]
            Either::Device(d) => d.copy_landed(bytes),
            #[cfg(not(feature = "cuda"))]
            Either::Device(_) => None,
        };
        let Some(served) = served else {
            return Poll::Ready(Err(()));
        };
        if let Ok(n) = &served {
            if let Some(p) = &mut self.progress {
                p.add(*n as u64);
            }
            self.file.engine_shared().stats.local_reads.add(1);
        }
        Poll::Ready(Ok(served))
    }

    /// The parts the reactor's op needs, for a read the ring could not serve.
    pub(super) fn into_parts(self) -> (&'a dyn ReadSource, u64, CopyOut<'a>, Option<OpProgress>) {
        (self.file, self.offset, self.transfer, self.progress)
    }
}
