//! Local device memory moved over a UCX that cannot move it itself (built without CUDA, or
//! told not to: `AgentConfig::stage_device_memory`): the bytes pass through host memory the
//! transfer owns.
//!
//! A READ gets the peer's bytes into the staging memory over UCX, then copies them to the GPU
//! on the agent's copy queue for that GPU; a WRITE copies from the GPU into the staging memory
//! first, then puts from it. The transfer is done, and its registrations released, only
//! after the last copy into device memory has completed, so what the caller sees is the same
//! as on the direct path; so is its notification (sent through the peer's link when the
//! completion settles, as after CUDA IPC copies), so it never overtakes the data.
//!
//! The staging memory is one allocation per posting, as large as the transfer: this path is
//! for transports where the GPU cannot be reached directly, where the network, not a host
//! copy, is the limit.

#![cfg_attr(not(feature = "cuda"), allow(dead_code, unused_imports))]

use std::sync::{Arc, Mutex};

use super::xfer::{Completion, XferOp, XferRequest};

/// Where one descriptor's bytes sit: its device address, its offset in the staging memory
/// and its length.
struct Place {
    device: u64,
    at: usize,
    len: usize,
}

/// A posting's staging memory and the device ranges it stands for.
struct Staging {
    host: Box<[u8]>,
    places: Vec<Place>,
    gpu: usize,
}

impl Staging {
    /// Host memory for every local descriptor of `req`, or why there is none.
    fn new(req: &XferRequest) -> Result<Staging, String> {
        let mut places = Vec::with_capacity(req.local.len());
        let mut total = 0usize;
        for (i, (d, _)) in req.local.iter().enumerate() {
            let len = usize::try_from(d.len)
                .map_err(|_| format!("descriptor {i}: {} bytes cannot be staged", d.len))?;
            places.push(Place {
                device: d.addr,
                at: total,
                len,
            });
            total = total
                .checked_add(len)
                .ok_or_else(|| "descriptors too large to stage".to_string())?;
        }
        Ok(Staging {
            host: zeroed(total)?,
            places,
            gpu: req.local.first().map_or(0, |(d, _)| d.dev as usize),
        })
    }

    /// The UCX transfer over the staging memory: `(local, remote, length, registration)`.
    fn segs(&mut self, req: &XferRequest) -> Vec<(u64, u64, u64, usize)> {
        let base = self.base();
        self.places
            .iter()
            .zip(&req.remote)
            .map(|(p, (r, at))| {
                (
                    base + p.at as u64,
                    r.addr,
                    p.len as u64,
                    super::remote::remote_index(at),
                )
            })
            .collect()
    }

    /// The staging memory's address, for UCX and the GPU copies to write and read through.
    fn base(&mut self) -> u64 {
        self.host.as_mut_ptr() as u64
    }
}

/// `len` zeroed bytes, from the allocator's zeroed path (fresh pages for large sizes, so
/// nothing is written here that UCX or the GPU copy writes again), or why there are none.
fn zeroed(len: usize) -> Result<Box<[u8]>, String> {
    if len == 0 {
        return Ok(Box::default());
    }
    let layout = std::alloc::Layout::array::<u8>(len)
        .map_err(|_| format!("{len} bytes cannot be staged"))?;
    // SAFETY: `layout` has a non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    if p.is_null() {
        return Err(format!(
            "no {len} bytes of host memory to stage device memory in"
        ));
    }
    // SAFETY: `p` is a live allocation of the global allocator with `layout` (an array of
    // `len` bytes), every byte initialised (zeroed), owned by nothing else: the box takes it
    // and frees it with the same layout.
    Ok(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, len)) })
}

/// Posts `req` (a transfer on [`XferPath::UcxStaged`](super::XferPath::UcxStaged)) through
/// staging memory; `done` finishes it.
#[cfg(feature = "cuda")]
pub(super) fn post(req: &XferRequest, mut done: Completion) {
    let mut staging = match Staging::new(req) {
        Ok(s) => s,
        Err(e) => return done.finish(Err(e)),
    };
    let segs = staging.segs(req);
    let queue = match req.agent.copy_queue(staging.gpu, None) {
        Ok(q) => q,
        Err(e) => return done.finish(Err(e)),
    };
    let peer = req.peer.clone();
    match req.op {
        XferOp::Read => {
            // The staging memory lives in the continuation, which the completion keeps until
            // the UCX part has finished, however it finishes.
            done.set_after(Box::new(move |done| {
                off_thread(move || to_device(&queue, staging, done))
            }));
            post_remote(&peer, XferOp::Read, segs, done);
        }
        XferOp::Write => off_thread(move || {
            from_device(&queue, staging, done, move |done| {
                post_remote(&peer, XferOp::Write, segs, done)
            })
        }),
    }
}

#[cfg(not(feature = "cuda"))]
pub(super) fn post(_: &XferRequest, done: Completion) {
    done.finish(Err(
        "device memory needs gpuio built with its cuda feature".into()
    ))
}

/// Hands the UCX part to the peer's progress thread.
fn post_remote(
    peer: &Arc<super::peer::Peer>,
    op: XferOp,
    segs: Vec<(u64, u64, u64, usize)>,
    done: Completion,
) {
    match &peer.link {
        super::peer::Link::Remote(remote) => remote.post_segs(op, segs, done),
        super::peer::Link::Local { .. } => {
            done.finish(Err("a staged transfer to a peer in this process".into()))
        }
    }
}

/// Runs `job` on a thread of its own: a copy from or into pageable memory takes as long as
/// its bytes do, too long for the caller's thread (`post` returns a future) or UCX's progress
/// thread (every peer's transfers wait behind it). Where no thread can be had, here.
#[cfg(feature = "cuda")]
fn off_thread(job: impl FnOnce() + Send + 'static) {
    let slot = Arc::new(Mutex::new(Some(job)));
    let take = |s: &Mutex<Option<_>>| s.lock().unwrap_or_else(|p| p.into_inner()).take();
    let theirs = slot.clone();
    let spawned = std::thread::Builder::new()
        .name("gpuio-agent-stage".into())
        .spawn(move || {
            if let Some(job) = take(&theirs) {
                job()
            }
        });
    if spawned.is_err() {
        if let Some(job) = take(&slot) {
            job()
        }
    }
}

/// Queues one copy per descriptor between the staging memory and the GPU, into the GPU when
/// `into_gpu`; why the first that could not be queued failed (those queued before it still
/// run: the caller finishes only behind the queue's completion).
///
/// # Safety
/// The device ranges must lie in local registrations, and the staging memory must stay
/// allocated, until a later [`then`](crate::cuda::xfer::CopyQueue::then) on `queue` has
/// reported completion.
#[cfg(feature = "cuda")]
unsafe fn queue_copies(
    queue: &crate::cuda::xfer::CopyQueue,
    staging: &mut Staging,
    into_gpu: bool,
) -> Result<(), String> {
    let base = staging.base();
    for (i, p) in staging.places.iter().enumerate() {
        let host = base + p.at as u64;
        let (dst, src, way) = if into_gpu {
            (p.device, host, "into")
        } else {
            (host, p.device, "out of")
        };
        // SAFETY: both ranges stay valid until the queue's completion (this function's
        // contract); the staging range lies inside the staging memory (`Staging::new` laid the
        // places out within its length).
        unsafe { queue.copy(dst, src, p.len) }
            .map_err(|e| format!("staged descriptor {i} {way} the GPU: {e}"))?;
    }
    Ok(())
}

/// A staged READ's last part: the staging memory's bytes into the device ranges, then done.
#[cfg(feature = "cuda")]
fn to_device(queue: &crate::cuda::xfer::CopyQueue, mut staging: Staging, done: Completion) {
    // SAFETY: the device ranges lie in local registrations `done` pins until it finishes, and
    // the staging memory moves into the closure that finishes it, after the queue's completion.
    let queued = unsafe { queue_copies(queue, &mut staging, true) };
    queue.then(Box::new(move |r| {
        drop(staging);
        done.finish(queued.and(r.map_err(|e| format!("staged copies into the GPU: {e}"))))
    }));
}

/// A staged WRITE's first part: the device ranges into the staging memory, then `then` with
/// the completion, which from then on owns the staging memory (freed when the transfer ends).
#[cfg(feature = "cuda")]
fn from_device(
    queue: &crate::cuda::xfer::CopyQueue,
    mut staging: Staging,
    mut done: Completion,
    then: impl FnOnce(Completion) + Send + 'static,
) {
    // SAFETY: as in `to_device`: `done` pins the device ranges, and the staging memory moves
    // into the closure below, which runs after the queue's completion.
    let queued = unsafe { queue_copies(queue, &mut staging, false) };
    queue.then(Box::new(move |r| {
        match queued.and(r.map_err(|e| format!("staged copies out of the GPU: {e}"))) {
            Ok(()) => {
                // UCX reads the staging memory until the completion runs: it frees it then.
                done.set_after(Box::new(move |done| {
                    drop(staging);
                    done.finish(Ok(()))
                }));
                then(done)
            }
            Err(e) => {
                drop(staging);
                done.finish(Err(e))
            }
        }
    }));
}
