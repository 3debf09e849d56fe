//! CUDA, probed at run time, and device memory as read destinations and write sources.
//!
//! gpuio builds and its host paths run on machines without a GPU or CUDA libraries. cudarc's
//! loader panics when a library is missing, so nothing here touches cudarc before
//! [`probe`] has found the driver: [`context`] returns [`Error::Unsupported`](crate::Error::Unsupported) instead.
//!
//! # Device destinations: the soundness argument
//! A read into device memory lands in reactor-owned bounce slots first (pinned with
//! `cuMemHostRegister` where the driver allows). The future's own `poll` then issues
//! `cuMemcpyHtoDAsync` from the slot into the destination **on the destination's stream** (or
//! the stream given with [`ReadInto::on_stream`](crate::ReadInto::on_stream)), and right after
//! issuing records cudarc's write event for that memory, so cudarc orders every later use of
//! it, on any stream, after the copies. Hence:
//! - the copy engine writes the destination only through copies already queued on a stream
//!   before `poll` returned; a dropped or `mem::forget`-ten future issues no more;
//! - freeing the destination (`CudaSlice` drop) or reusing it through cudarc is stream-ordered
//!   after those copies, so the copy engine never writes memory the caller got back;
//! - the reactor recycles a slot only after a CUDA event recorded behind its copy has
//!   completed, polled without blocking; if a context dies with copies queued, their slots (and
//!   the pool) are leaked rather than reused.
//!
//! Small reads that reach the reactor (O_DIRECT, cold, or with the page-cache fast path off;
//! at most 64 KiB) copy out of their slots the same way, with one difference: the copy is a
//! `cuMemcpyBatchAsync` whose sources the driver reads during the call (see below), so the
//! slots go back to the reactor straight away instead of behind an event.
//!
//! Memory used on the NULL or legacy default stream is the one exception to "on the
//! destination's stream" for these staged copies (the batched call takes no such stream):
//! they go on a side stream of gpuio's that first waits for an event the legacy stream records
//! and then records one the legacy stream waits for (`side`), which is the same order.
//!
//! A batch of reads into one device buffer (`BatchPlan::read_into`) issues the copies of all
//! its reads together, from the batch future's own `poll` (`op::combine`): every piece that
//! landed since the last poll, in one batched driver call on the buffer's stream, behind one
//! event, before the batch records cudarc's write event. The three points hold as for one
//! read: nothing is queued between polls, so a dropped or leaked batch queues nothing more.
//!
//! Small reads of cached bytes (`op::cached`, at most 64 KiB) skip the slots: `poll` reads
//! them with `preadv2(RWF_NOWAIT)` into a pageable stage of the polling thread's and queues the
//! copy out of it in the same `poll`, as a `cuMemcpyBatchAsync` whose source the driver reads
//! during the call (`CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL`; no weaker promise is
//! documented for pageable sources), then records cudarc's write event. The first two points
//! hold as above; the third needs no event, because the stage is free when the call returns.
//! A batch stages all of one poll's small reads and copies them in one such call before it
//! records the write event. Where the driver refuses that call, the copies go one by one and
//! the stream is synchronised before the stage is reused.
//!
//! (Device leases, where the reactor copied every piece itself behind a stream wait on a word
//! it wrote, were built and measured: 1.02x at 16 MiB, 0.87x at 1 MiB, a hang at 4 KiB. They
//! were removed; `docs/device-leases.md` keeps the design and the measurements.)
//!
//! Writes from device memory run the same way in reverse: `cuMemcpyDtoHAsync` into a slot
//! (recording cudarc's read event on the source), and the reactor writes the slot to the file
//! once the copy's event has completed.

mod sys;

pub use sys::CudaProbe;

/// The CUDA context of a transfer's device memory, as lanes and ops pass it around.
#[cfg(feature = "cuda")]
pub(crate) type DeviceCtx = std::sync::Arc<cudarc::driver::CudaContext>;
/// Without CUDA no transfer has device memory.
#[cfg(not(feature = "cuda"))]
pub(crate) type DeviceCtx = std::convert::Infallible;

/// The GPU a transfer's device memory is on, as a number the reactor can count by (it knows
/// nothing else of CUDA).
#[cfg(feature = "cuda")]
pub(crate) fn device_number(d: &DeviceCtx) -> u32 {
    d.ordinal() as u32
}

/// Without CUDA there is no device to number.
#[cfg(not(feature = "cuda"))]
pub(crate) fn device_number(d: &DeviceCtx) -> u32 {
    match *d {}
}
pub mod topology;

#[cfg(feature = "cuda")]
pub(crate) mod copylist;
#[cfg(feature = "cuda")]
pub(crate) mod device;
#[cfg(feature = "cuda")]
pub(crate) mod event;
#[cfg(feature = "cuda")]
pub(crate) mod mapped;
#[cfg(feature = "cuda")]
pub(crate) mod memops;
#[cfg(all(feature = "cuda", feature = "safetensors"))]
pub(crate) use memops::copy_rows;
#[cfg(feature = "cuda")]
pub(crate) mod ipc;
#[cfg(feature = "cuda")]
pub mod peer;
#[cfg(feature = "cuda")]
pub(crate) mod pinned;
#[cfg(feature = "cuda")]
pub(crate) mod side;
#[cfg(feature = "cuda")]
pub(crate) mod stage;
#[cfg(feature = "cuda")]
pub(crate) mod xfer;

#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
pub use device::{DeviceDst, DeviceSrc, Pod};
/// Ranges registered for mapped reads in this process now (every engine's). For tests.
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub use mapped::registrations_live as mapped_registrations_live;

/// Looks for the CUDA driver library and asks it for its version and devices.
pub fn probe() -> CudaProbe {
    sys::probe()
}

#[cfg(feature = "cuda")]
fn cached_probe() -> &'static CudaProbe {
    static PROBE: std::sync::OnceLock<CudaProbe> = std::sync::OnceLock::new();
    PROBE.get_or_init(sys::probe)
}

/// The CUDA context of device `ordinal`, or [`Error::Unsupported`](crate::Error::Unsupported) (never a panic) where no
/// usable driver or device exists.
#[cfg(feature = "cuda")]
pub fn context(
    ordinal: usize,
) -> crate::error::Result<std::sync::Arc<cudarc::driver::CudaContext>> {
    use crate::error::{Context, Error, OpKind};
    let ctx = || Context::op(OpKind::DeviceMemory).with_backend("cuda");
    let p = cached_probe();
    if let Some(e) = &p.error {
        return Err(Error::unsupported(ctx(), e.clone()));
    }
    if ordinal >= p.devices.len() {
        return Err(Error::unsupported(
            ctx(),
            format!("no GPU {ordinal}: this machine has {}", p.devices.len()),
        ));
    }
    cudarc::driver::CudaContext::new(ordinal).map_err(|e| Error::cuda(ctx(), e))
}

/// Whether a usable CUDA device exists (cached; cheap after the first call).
pub fn available() -> bool {
    #[cfg(feature = "cuda")]
    {
        cached_probe().available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}
