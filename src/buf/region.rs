//! [`HostRegion`]: one host allocation that several in-place reads land in, each in a range of
//! its own (`BatchPlan::read_owned`, and the blocking reads of `op::blocking`).
//!
//! An in-place read hands the kernel the caller's memory instead of a bounce slot, so the
//! memory must outlive the read whatever happens to its future. Each read's op holds a clone
//! of the region's `Arc` (the op's owned buffer, `OwnedTarget::keep`) until its last piece has
//! completed, and the reactor leaks, never drops, what it holds for a read still in the kernel
//! when it dies. The allocation is freed only with the last clone, and goes back to the caller
//! as a `Vec` only when no read holds one ([`HostRegion::into_vec`]): a dropped or leaked
//! batch future never frees or hands out memory the kernel may still write.
//!
//! A region may instead borrow memory a blocked caller owns ([`HostRegion::borrowed`]): its
//! last clone's drop then tells the caller ([`Released`]) that no read holds the memory any
//! more, and a dying reactor that keeps a clone for good says so instead
//! ([`HostRegion::kept_by_kernel`]).

use std::mem::ManuallyDrop;
use std::sync::{Arc, Condvar, Mutex};

/// Host memory shared by the reads that land in it: a `Vec<u8>`'s allocation, or memory a
/// blocked caller lends.
#[derive(Debug)]
pub(crate) struct HostRegion {
    ptr: *mut u8,
    len: usize,
    owner: Owner,
}

#[derive(Debug)]
enum Owner {
    /// The region owns the allocation of a `Vec` of this capacity.
    Vec { cap: usize },
    /// The caller owns the memory and waits on this until no read holds it.
    Borrowed(Arc<Released>),
}

/// Where the last hold on a borrowed region stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// Reads may still hold it.
    Held,
    /// No read holds it: the kernel writes it no more.
    Released,
    /// A reactor died with a read of it in the kernel and keeps its clone for good: the kernel
    /// may write the memory at any time, and nothing will say when it has stopped.
    KeptByKernel,
}

/// What a caller lending memory to a [`HostRegion`] waits on.
#[derive(Debug)]
pub(crate) struct Released {
    hold: Mutex<Hold>,
    changed: Condvar,
}

impl Released {
    fn set(&self, to: Hold) {
        let mut hold = self.hold.lock().unwrap_or_else(|p| p.into_inner());
        if *hold == Hold::Held {
            *hold = to;
        }
        self.changed.notify_all();
    }

    /// Waits until the region is no longer [`Hold::Held`], or `timeout` has passed; the hold.
    pub(crate) fn wait(&self, timeout: std::time::Duration) -> Hold {
        let hold = self.hold.lock().unwrap_or_else(|p| p.into_inner());
        let (hold, _) = self
            .changed
            .wait_timeout_while(hold, timeout, |h| *h == Hold::Held)
            .unwrap_or_else(|p| p.into_inner());
        *hold
    }
}

// SAFETY: a region owns its allocation as the `Vec` it came from did, or holds memory its
// caller lent it and does not touch until the region is gone (`borrowed`). Nothing reads through a
// shared reference to it; writes come from the kernel and from `range_mut`'s callers, each into
// a range no other writer has (its callers' contract), so sharing it between threads adds no
// data race.
unsafe impl Send for HostRegion {}
// SAFETY: as for `Send`.
unsafe impl Sync for HostRegion {}

/// A zeroed buffer of `len` bytes for reads to land in, backed by transparent huge pages
/// where the kernel gives them (`madvise` mode): the reads then take a page fault (and zero a
/// page) per 2 MiB rather than per 4 KiB. A large `vec![0; len]` is fresh anonymous memory, so
/// the advice reaches every page before its first touch.
pub(crate) fn zeroed_for_reads(len: usize) -> Vec<u8> {
    const HUGE: usize = 2 << 20;
    let buf = vec![0u8; len];
    let start = (buf.as_ptr() as usize).next_multiple_of(HUGE);
    let end = (buf.as_ptr() as usize + len) & !(HUGE - 1);
    if end > start {
        // SAFETY: `start..end` lies inside `buf`'s allocation, which this function owns; the
        // advice changes how the kernel backs the pages, never their contents (zero).
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    buf
}

impl HostRegion {
    /// Takes `buf`'s allocation (its length is the region's).
    pub(crate) fn new(buf: Vec<u8>) -> Arc<Self> {
        let mut buf = ManuallyDrop::new(buf);
        Arc::new(HostRegion {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            owner: Owner::Vec {
                cap: buf.capacity(),
            },
        })
    }

    /// A region over `dst`, which its caller lends until the returned [`Released`] reads
    /// anything but [`Hold::Held`].
    ///
    /// # Safety
    /// The caller neither reads, writes nor frees `dst` (nor lets its borrow end) until then,
    /// whatever happens, unwinding included; `Hold::KeptByKernel` means never.
    pub(crate) unsafe fn borrowed(dst: &mut [u8]) -> (Arc<Self>, Arc<Released>) {
        let released = Arc::new(Released {
            hold: Mutex::new(Hold::Held),
            changed: Condvar::new(),
        });
        let region = Arc::new(HostRegion {
            ptr: dst.as_mut_ptr(),
            len: dst.len(),
            owner: Owner::Borrowed(released.clone()),
        });
        (region, released)
    }

    /// Told by a dying reactor that keeps `keep` (an op's owned buffer) for good because the
    /// kernel may still write it: a borrowed region's caller learns it can never have the
    /// memory back.
    pub(crate) fn kept_by_kernel(keep: &(dyn std::any::Any + Send)) {
        if let Some(region) = keep.downcast_ref::<Arc<HostRegion>>()
            && let Owner::Borrowed(released) = &region.owner
        {
            released.set(Hold::KeptByKernel);
        }
    }

    /// The address of byte `at` (at most the region's length).
    pub(crate) fn addr(&self, at: usize) -> usize {
        debug_assert!(at <= self.len);
        self.ptr as usize + at
    }

    /// Bytes `at..at + len` as a slice, for a read through bounce memory.
    ///
    /// # Safety
    /// The range lies inside the region; no in-place read that may still run lands in it, and
    /// no other slice of it is alive while the returned one is.
    #[allow(clippy::mut_from_ref)] // Disjoint ranges are the callers' contract, as above.
    pub(crate) unsafe fn range_mut(&self, at: usize, len: usize) -> &mut [u8] {
        debug_assert!(at.checked_add(len).is_some_and(|end| end <= self.len));
        // SAFETY: the memory holds `len` initialized bytes from `at` (it came from a `Vec<u8>`
        // or a `&mut [u8]` of the region's length, which stays lent while the region lives),
        // and the caller guarantees nothing else reads or writes them while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), len) }
    }

    /// The allocation as a `Vec` again, if no read holds the region any more (and it owns
    /// one: a borrowed region never becomes a `Vec`).
    pub(crate) fn into_vec(this: Arc<Self>) -> Result<Vec<u8>, Arc<Self>> {
        let Owner::Vec { cap } = this.owner else {
            return Err(this);
        };
        let region = ManuallyDrop::new(Arc::try_unwrap(this)?);
        // SAFETY: pointer, length and capacity came from a `Vec<u8>` in `new`; this was the
        // last owner, so no read holds the region and the kernel writes it no more (a read the
        // kernel may still write keeps its clone for good), and `ManuallyDrop` keeps the
        // region's own drop from freeing the allocation the `Vec` now owns.
        Ok(unsafe { Vec::from_raw_parts(region.ptr, region.len, cap) })
    }
}

/// Regions at least this large are freed on a thread of their own when dropped.
const FREE_ASIDE: usize = 64 << 20;

impl Drop for HostRegion {
    fn drop(&mut self) {
        let cap = match &self.owner {
            Owner::Vec { cap } => *cap,
            Owner::Borrowed(released) => return released.set(Hold::Released),
        };
        // SAFETY: as in `into_vec`: the last owner is gone, so nothing writes the allocation.
        let buf = unsafe { Vec::from_raw_parts(self.ptr, self.len, cap) };
        // A region is dropped rather than handed back only when its batch was abandoned; its
        // last owner may then be the reactor, finishing the last read, and unmapping
        // gigabytes there would stall every other op of the engine.
        if buf.capacity() >= FREE_ASIDE {
            let spawned = std::thread::Builder::new()
                .name("gpuio-free".into())
                .spawn(move || drop(buf));
            // No thread: the closure, and the buffer in it, was dropped here after all.
            if let Err(e) = spawned {
                tracing::debug!(error = %e, "freeing an abandoned batch's buffer inline");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allocation_comes_back_only_from_its_last_owner() {
        let region = HostRegion::new(vec![7u8; 4096]);
        let base = region.addr(0);
        let held = region.clone();
        let region = HostRegion::into_vec(region).expect_err("a read still holds it");
        drop(held);
        let back = HostRegion::into_vec(region).expect("no read holds it");
        assert_eq!(
            back.as_ptr() as usize,
            base,
            "the same allocation, not a copy"
        );
        assert_eq!((back.len(), back[4095]), (4096, 7));
    }

    #[test]
    fn disjoint_ranges_are_written_where_they_lie() {
        let region = HostRegion::new(vec![0u8; 64]);
        // SAFETY: inside the region, disjoint, and no read lands in either.
        let (a, b) = unsafe { (region.range_mut(0, 32), region.range_mut(32, 32)) };
        a.fill(1);
        b.fill(2);
        let back = HostRegion::into_vec(region).unwrap();
        assert!(back[..32].iter().all(|&x| x == 1) && back[32..].iter().all(|&x| x == 2));
    }

    #[test]
    fn a_borrowed_region_is_released_with_its_last_clone() {
        let mut mem = vec![0u8; 64];
        // SAFETY: `mem` is not touched until the region reads released (asserted below).
        let (region, released) = unsafe { HostRegion::borrowed(&mut mem) };
        let held = region.clone();
        drop(region);
        let short = std::time::Duration::from_millis(1);
        assert_eq!(released.wait(short), Hold::Held);
        assert!(HostRegion::into_vec(held.clone()).is_err(), "never a Vec");
        drop(held);
        assert_eq!(released.wait(short), Hold::Released);
        assert_eq!(mem.len(), 64, "the memory stays the caller's");
    }

    #[test]
    fn a_region_a_dead_reactor_keeps_says_so() {
        let mut mem = vec![0u8; 64];
        // SAFETY: `mem` is never touched again while the region is alive; it is leaked below,
        // as a reactor that dies with a read in the kernel leaks it.
        let (region, released) = unsafe { HostRegion::borrowed(&mut mem) };
        let keep: Box<dyn std::any::Any + Send> = Box::new(region);
        HostRegion::kept_by_kernel(keep.as_ref());
        assert_eq!(released.wait(std::time::Duration::ZERO), Hold::KeptByKernel);
        std::mem::forget(keep);
        // A later drop (none happens here) could not change what the caller was told.
        std::mem::forget(mem);
    }
}
