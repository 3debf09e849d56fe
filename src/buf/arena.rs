//! Bounce memory: one anonymous mapping, carved into [`BounceSlot`]s by a buddy allocator.
//!
//! The reactor owns the allocator and is the only party that hands out or takes back slots;
//! the kernel, a pread worker or a copy engine writes only into slots, never into caller
//! memory. The mapping itself lives in an `Arc` shared with every operation, so a future that
//! is still copying out of a slot keeps the memory mapped even if the engine shuts down.
//!
//! Sizes are powers of two from 4 KiB up to the block size (the chunk size rounded up to a
//! power of two); a slot never crosses a block, so each block can be registered with io_uring
//! as one fixed buffer and a slot's buffer index is `offset / block_size`.

use std::collections::BTreeSet;
use std::io;
use std::ptr::NonNull;

/// Smallest slot: one page, which also satisfies every O_DIRECT memory alignment seen in
/// practice (statx reports 4 or 512 on ext4/xfs/nvme).
pub(crate) const MIN_SLOT: usize = 4096;
const MIN_SHIFT: u32 = MIN_SLOT.trailing_zeros();

/// Page-aligned anonymous memory for bounce slots.
pub(crate) struct BounceArena {
    base: NonNull<u8>,
    /// Bytes mapped: the pool and its growth reserve.
    len: usize,
    /// Bytes of the pool proper (registered with io_uring, pinned with CUDA); the rest of the
    /// mapping is reserve, handed out only when leaked futures hold the pool (see
    /// `Reactor::check_pool_stall`), and costs no memory until touched.
    pool_len: usize,
    block_size: usize,
    /// The memory, when it comes from SPDK's DMA heap instead of an anonymous mapping.
    dma: Option<crate::spdk::env::DmaRegion>,
    /// CUDA page-locking of the whole mapping, done on first use by a device transfer.
    #[cfg(feature = "cuda")]
    pinned: std::sync::OnceLock<Result<crate::cuda::pinned::PinnedRegion, String>>,
}

// SAFETY: the arena is plain memory; who may touch which bytes is decided by slot ownership
// (the reactor hands a slot to exactly one party at a time), not by the arena.
unsafe impl Send for BounceArena {}
// SAFETY: as above; `&BounceArena` only exposes raw pointers, whose use is `unsafe`.
unsafe impl Sync for BounceArena {}

impl BounceArena {
    /// Maps `blocks` blocks of `block_size` bytes (a power of two, at least [`MIN_SLOT`]), and
    /// `reserve` more blocks of address space behind them for growth.
    pub(crate) fn new(block_size: usize, blocks: usize, reserve: usize) -> io::Result<Self> {
        if !block_size.is_power_of_two() || block_size < MIN_SLOT || blocks == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "bounce block size must be a power of two >= 4096 and blocks > 0",
            ));
        }
        let too_large = || io::Error::new(io::ErrorKind::InvalidInput, "bounce pool too large");
        let pool_len = block_size.checked_mul(blocks).ok_or_else(too_large)?;
        let len = blocks
            .checked_add(reserve)
            .and_then(|b| b.checked_mul(block_size))
            .ok_or_else(too_large)?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is affected. The
        // reserve is never touched unless the pool grows (MAP_NORESERVE: no commit charge).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // Transparent huge pages where the kernel gives them (`madvise` mode): the bounce
        // slots are copied into by the kernel and read by the GPUs' DMA, 2 MiB at a time,
        // and 4 KiB pages cost both sides a TLB entry each. A hint: refused, nothing changes.
        // SAFETY: `p` is the start of the `len`-byte mapping made above.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        let base = NonNull::new(p.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        Ok(BounceArena {
            base,
            len,
            pool_len,
            block_size,
            dma: None,
            #[cfg(feature = "cuda")]
            pinned: std::sync::OnceLock::new(),
        })
    }

    /// Like [`new`](Self::new), in DMA-able memory from SPDK's hugepage heap, which every NVMe
    /// transport (local PCIe included) can move data into and out of.
    pub(crate) fn new_dma(block_size: usize, blocks: usize) -> Result<Self, String> {
        if !block_size.is_power_of_two() || block_size < MIN_SLOT || blocks == 0 {
            return Err("bounce block size must be a power of two >= 4096 and blocks > 0".into());
        }
        let len = block_size
            .checked_mul(blocks)
            .ok_or_else(|| "bounce pool too large".to_string())?;
        let dma = crate::spdk::env::DmaRegion::new(len, MIN_SLOT)?;
        let base = NonNull::new(dma.as_ptr()).ok_or_else(|| "null DMA region".to_string())?;
        debug_assert_eq!(dma.len(), len);
        Ok(BounceArena {
            base,
            len,
            // SPDK's DMA heap has no room to grow into: its pool is all there is.
            pool_len: len,
            block_size,
            dma: Some(dma),
            #[cfg(feature = "cuda")]
            pinned: std::sync::OnceLock::new(),
        })
    }

    /// Whether the memory is SPDK DMA memory.
    pub(crate) fn is_dma(&self) -> bool {
        self.dma.is_some()
    }

    /// Page-locks the arena with CUDA (once per arena; portable across contexts). Returns
    /// whether it is pinned; where the driver refuses, copies still work from pageable memory,
    /// only slower, and the reason is logged once.
    #[cfg(feature = "cuda")]
    pub(crate) fn ensure_pinned(&self, ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> bool {
        self.pinned
            .get_or_init(|| {
                // SAFETY: the mapping stays mapped until Drop, which unregisters first.
                let r = unsafe { crate::cuda::pinned::PinnedRegion::register(ctx, self.base.as_ptr(), self.pool_len) };
                match &r {
                    Ok(_) => tracing::debug!(bytes = self.len, "bounce pool pinned with CUDA"),
                    Err(e) => tracing::warn!(reason = %e, "bounce pool not pinned; device copies will be slower"),
                }
                r
            })
            .is_ok()
    }

    /// Whether the arena is page-locked with CUDA.
    #[cfg(feature = "cuda")]
    pub(crate) fn is_pinned(&self) -> bool {
        matches!(self.pinned.get(), Some(Ok(_)))
    }

    /// Whether `slot` lies in the part of the pool pinned with CUDA (grown blocks are not).
    #[cfg(feature = "cuda")]
    pub(crate) fn slot_is_pinned(&self, slot: &BounceSlot) -> bool {
        self.is_pinned() && !slot.on_device && slot.offset + slot.size() <= self.pool_len
    }

    /// Size of one block (the largest slot).
    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks of the pool proper (registered with io_uring, pinned with CUDA).
    pub(crate) fn blocks(&self) -> usize {
        self.pool_len / self.block_size
    }

    /// Blocks mapped: the pool and its growth reserve. Reserve blocks are plain pageable
    /// memory: read and written without registered buffers, copied to devices unpinned.
    pub(crate) fn capacity_blocks(&self) -> usize {
        self.len / self.block_size
    }

    /// One iovec per block, for `io_uring_register_buffers` (and host registration with CUDA).
    pub(crate) fn block_iovecs(&self) -> Vec<libc::iovec> {
        (0..self.blocks())
            .map(|i| libc::iovec {
                iov_base: self.ptr_at(i * self.block_size).cast(),
                iov_len: self.block_size,
            })
            .collect()
    }

    /// Start of the mapping.
    #[cfg(test)]
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    fn ptr_at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len);
        // SAFETY: offset is within the mapping (checked by callers, asserted in debug).
        unsafe { self.base.as_ptr().add(offset) }
    }

    /// Raw pointer to the start of `slot`.
    pub(crate) fn slot_ptr(&self, slot: &BounceSlot) -> *mut u8 {
        assert!(slot.offset + slot.size() <= self.len, "slot outside arena");
        self.ptr_at(slot.offset)
    }

    /// The first `len` bytes of `slot`.
    ///
    /// # Safety
    /// The caller must own `slot` (it was handed to it by the reactor and not yet returned),
    /// so that no I/O or other party writes the slot while the slice lives.
    pub(crate) unsafe fn slot_bytes(&self, slot: &BounceSlot, len: usize) -> &[u8] {
        assert!(len <= slot.size());
        // SAFETY: the slot lies inside the mapping (slot_ptr asserts it), `len` fits in it,
        // and the caller guarantees exclusive ownership of the slot for the slice's life.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(slot), len) }
    }

    /// The first `len` bytes of `slot`, writable.
    ///
    /// # Safety
    /// As [`slot_bytes`](Self::slot_bytes): the caller owns `slot` exclusively.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slot_bytes_mut(&self, slot: &BounceSlot, len: usize) -> &mut [u8] {
        assert!(len <= slot.size());
        // SAFETY: as in slot_bytes; exclusive ownership makes the &mut unique.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr(slot), len) }
    }
}

impl Drop for BounceArena {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if self.dma.is_none() {
            if let Some(Ok(pinned)) = self.pinned.take() {
                // `cuMemHostUnregister` waits for all work on the device, on streams that never
                // touched this memory too (H100: 1.7 s behind a 2 s kernel on another stream,
                // 4 ms idle). An engine's drop must not wait for the application's kernels, so
                // the pool is unpinned, then unmapped, on a thread of its own. If no thread can
                // be started, the closure is dropped unrun and `DeferredUnmap`'s drop does both
                // here instead.
                let job = DeferredUnmap {
                    pinned: Some(pinned),
                    base: self.base,
                    len: self.len,
                };
                let _ = std::thread::Builder::new()
                    .name("gpuio-unpin".into())
                    .spawn(move || drop(job));
                return;
            }
        }
        // Unregister from CUDA before the memory goes away.
        #[cfg(feature = "cuda")]
        drop(self.pinned.take());
        if self.dma.take().is_some() {
            // SPDK memory went back to SPDK's heap with the region.
            return;
        }
        // SAFETY: base/len are exactly what mmap returned; the last Arc is gone, so no slot
        // (and no in-flight I/O: the reactor drains or leaks the arena) refers to it.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// A pinned anonymous mapping whose last user is gone: unpinned, then unmapped, when dropped.
#[cfg(feature = "cuda")]
struct DeferredUnmap {
    pinned: Option<crate::cuda::pinned::PinnedRegion>,
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: it owns the mapping outright (the arena's last `Arc` is gone) and only unregisters and
// unmaps it; the pointer is never dereferenced.
#[cfg(feature = "cuda")]
unsafe impl Send for DeferredUnmap {}

#[cfg(feature = "cuda")]
impl Drop for DeferredUnmap {
    fn drop(&mut self) {
        drop(self.pinned.take());
        // SAFETY: base/len are exactly what the arena's mmap returned; the arena is gone, so no
        // slot (and no in-flight I/O: the reactor drains or leaks the arena) refers to it, and
        // CUDA has just been told to forget it.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// A piece of the bounce arena: `4 KiB << order` bytes at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BounceSlot {
    pub(crate) offset: usize,
    pub(crate) order: u8,
    /// A slot of the device staging pool (cuFile batch I/O), not of the host arena.
    pub(crate) on_device: bool,
}

impl BounceSlot {
    /// Bytes in the slot.
    pub(crate) fn size(&self) -> usize {
        MIN_SLOT << self.order
    }
}

/// Buddy allocator over the arena's offsets. Reactor-local: not thread-safe by design.
pub(crate) struct SlotAllocator {
    free: Vec<BTreeSet<usize>>,
    max_order: u8,
    block_size: usize,
    total: usize,
    in_use: usize,
    on_device: bool,
}

impl SlotAllocator {
    pub(crate) fn new(block_size: usize, blocks: usize) -> Self {
        let max_order = (block_size.trailing_zeros() - MIN_SHIFT) as u8;
        let mut free = vec![BTreeSet::new(); max_order as usize + 1];
        free[max_order as usize].extend((0..blocks).map(|i| i * block_size));
        SlotAllocator {
            free,
            max_order,
            block_size,
            total: block_size * blocks,
            in_use: 0,
            on_device: false,
        }
    }

    /// An allocator over a device staging pool of the same shape.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn for_device(block_size: usize, blocks: usize) -> Self {
        SlotAllocator {
            on_device: true,
            ..Self::new(block_size, blocks)
        }
    }

    /// Order of the smallest slot holding `len` bytes, or `None` if larger than a block.
    pub(crate) fn order_for(&self, len: usize) -> Option<u8> {
        let size = len.max(MIN_SLOT).checked_next_power_of_two()?;
        let order = (size.trailing_zeros() - MIN_SHIFT) as u8;
        (order <= self.max_order).then_some(order)
    }

    /// A slot of at least `len` bytes, or `None` if no free piece is big enough now.
    pub(crate) fn alloc(&mut self, len: usize) -> Option<BounceSlot> {
        let want = self.order_for(len)?;
        let have = (want..=self.max_order).find(|&o| !self.free[o as usize].is_empty())?;
        let offset = self.free[have as usize].pop_first()?;
        // Split down: keep the lower half, free the upper half at each level.
        for o in (want..have).rev() {
            self.free[o as usize].insert(offset + (MIN_SLOT << o));
        }
        let slot = BounceSlot {
            offset,
            order: want,
            on_device: self.on_device,
        };
        self.in_use += slot.size();
        Some(slot)
    }

    /// Returns `slot`, merging it with its buddy while the buddy is free.
    pub(crate) fn free(&mut self, slot: BounceSlot) {
        debug_assert_eq!(
            slot.on_device, self.on_device,
            "slot freed into the wrong pool"
        );
        self.in_use -= slot.size();
        let (mut offset, mut order) = (slot.offset, slot.order);
        while order < self.max_order {
            let buddy = offset ^ (MIN_SLOT << order);
            if !self.free[order as usize].remove(&buddy) {
                break;
            }
            offset = offset.min(buddy);
            order += 1;
        }
        let fresh = self.free[order as usize].insert(offset);
        debug_assert!(fresh, "double free of bounce slot at {offset}");
    }

    /// Which registered buffer (block) holds `slot`.
    pub(crate) fn block_of(&self, slot: &BounceSlot) -> usize {
        slot.offset / self.block_size
    }

    /// Bytes handed out now.
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> usize {
        self.in_use
    }

    /// Bytes the allocator manages (the pool and any growth).
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Adds `blocks` whole blocks at the end of the managed range (the arena's reserve).
    pub(crate) fn grow(&mut self, blocks: usize) {
        let first = self.total;
        self.free[self.max_order as usize].extend((0..blocks).map(|i| first + i * self.block_size));
        self.total += blocks * self.block_size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buddy_splits_and_merges_back_to_whole_blocks() {
        let mut a = SlotAllocator::new(1 << 20, 2);
        let mut slots = Vec::new();
        // Fill both blocks with 4 KiB slots: 512 of them.
        while let Some(s) = a.alloc(1) {
            assert_eq!(s.size(), 4096);
            slots.push(s);
        }
        assert_eq!(slots.len(), 512);
        assert_eq!(a.in_use(), a.total());
        let mut offs: Vec<_> = slots.iter().map(|s| s.offset).collect();
        offs.sort_unstable();
        offs.dedup();
        assert_eq!(offs.len(), 512, "slots overlap");
        // Free in a scrambled order; the allocator must merge back to two 1 MiB blocks.
        let mut rng = fastrand::Rng::with_seed(7);
        rng.shuffle(&mut slots);
        for s in slots {
            a.free(s);
        }
        assert_eq!(a.in_use(), 0);
        let b1 = a.alloc(1 << 20).unwrap();
        let b2 = a.alloc(1 << 20).unwrap();
        assert!(a.alloc(1).is_none());
        assert_ne!(a.block_of(&b1), a.block_of(&b2));
    }

    #[test]
    fn sizes_round_up_and_never_exceed_a_block() {
        let mut a = SlotAllocator::new(1 << 16, 1);
        assert_eq!(a.alloc(4097).unwrap().size(), 8192);
        assert!(a.alloc((1 << 16) + 1).is_none());
        assert_eq!(a.order_for(0), Some(0));
    }

    #[test]
    fn random_alloc_free_never_overlaps() {
        let mut a = SlotAllocator::new(1 << 18, 3);
        let mut rng = fastrand::Rng::with_seed(11);
        let mut live: Vec<BounceSlot> = Vec::new();
        for _ in 0..20_000 {
            if rng.bool() && !live.is_empty() {
                let i = rng.usize(..live.len());
                a.free(live.swap_remove(i));
            } else if let Some(s) = a.alloc(rng.usize(1..=1 << 18)) {
                for l in &live {
                    let disjoint =
                        s.offset + s.size() <= l.offset || l.offset + l.size() <= s.offset;
                    assert!(disjoint, "{s:?} overlaps {l:?}");
                }
                assert_eq!(s.offset % s.size(), 0, "slot not naturally aligned");
                live.push(s);
            }
        }
        for s in live {
            a.free(s);
        }
        assert_eq!(a.in_use(), 0);
    }

    #[test]
    fn arena_maps_page_aligned_memory() {
        let arena = BounceArena::new(1 << 16, 4, 0).unwrap();
        assert_eq!(arena.base_ptr() as usize % 4096, 0);
        assert_eq!(arena.block_iovecs().len(), 4);
        assert!(BounceArena::new(3000, 1, 0).is_err());
    }
}
