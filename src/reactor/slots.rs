//! The slot pools: host bounce memory and (with a cuFile lane) device staging memory, one
//! allocator each, told apart by the slot itself; and what happens when ops wait for memory
//! that only futures which stopped polling could give back.

use std::time::Instant;

use super::Reactor;
use crate::buf::arena::{BounceArena, BounceSlot, SlotAllocator};
use crate::error::{Error, OpKind};

/// Both pools of one reactor.
pub(super) struct Slots {
    pub(super) host: SlotAllocator,
    /// The device staging pool's slots, made with the cuFile lane.
    device: Option<SlotAllocator>,
    /// Slots given back so far (both pools): tells a stalled pool from a busy one.
    pub(super) returned: u64,
}

impl Slots {
    pub(super) fn new(arena: &BounceArena) -> Self {
        Slots {
            host: SlotAllocator::new(arena.block_size(), arena.blocks()),
            device: None,
            returned: 0,
        }
    }

    /// Adds the device staging pool's slots (shaped like the host pool), once.
    pub(super) fn ensure_device(&mut self, block: usize, blocks: usize) {
        if self.device.is_none() {
            self.device = Some(SlotAllocator::for_device(block, blocks));
        }
    }

    fn pool(&self, on_device: bool) -> Option<&SlotAllocator> {
        if on_device {
            self.device.as_ref()
        } else {
            Some(&self.host)
        }
    }

    /// A slot of at least `len` bytes from the host or device pool, if one is free.
    pub(super) fn alloc(&mut self, on_device: bool, len: usize) -> Option<BounceSlot> {
        if on_device {
            self.device.as_mut()?.alloc(len)
        } else {
            self.host.alloc(len)
        }
    }

    /// Whether a slot of `len` bytes can exist in that pool at all (waiting for one that
    /// cannot would never end).
    pub(super) fn fits(&self, on_device: bool, len: usize) -> bool {
        self.pool(on_device)
            .is_none_or(|p| p.order_for(len).is_some())
    }

    /// Returns a slot to the pool it came from.
    pub(super) fn free(&mut self, slot: BounceSlot) {
        self.returned += 1;
        if slot.on_device {
            match self.device.as_mut() {
                Some(d) => d.free(slot),
                None => debug_assert!(false, "device slot freed without a device pool"),
            }
        } else {
            self.host.free(slot);
        }
    }

    /// Bytes in that pool.
    pub(super) fn total(&self, on_device: bool) -> usize {
        self.pool(on_device).map_or(0, SlotAllocator::total)
    }

    /// The registered-buffer index of a host slot's block, where the main lane has the pool
    /// registered: only the pool proper is, growth blocks are plain memory.
    pub(super) fn fixed_index(&self, slot: &BounceSlot, arena: &BounceArena) -> Option<u16> {
        let block = self.host.block_of(slot);
        (block < arena.blocks()).then_some(block as u16)
    }
}

/// Ops have waited for bounce memory, with nothing in flight that could return any, since
/// `since`; `returned` is the count of slots given back then (any return restarts the wait).
#[derive(Clone, Copy)]
pub(super) struct PoolStall {
    since: Instant,
    returned: u64,
    /// Which pool the waiting op needs (device staging or host bounce memory).
    on_device: bool,
}

impl Reactor {
    /// Ops wait for bounce memory: fine while anything in flight (the kernel, a lane, a CUDA
    /// gate, a queued write) will give some back, or while futures keep giving slots back.
    /// When none came back for a while and nothing can, the slots are with futures that do
    /// not poll (leaked, or forgotten by their owner): grow the host pool by an op's window,
    /// and once it cannot grow, fail the waiting ops rather than let them wait for good.
    /// Returns whether the pool grew.
    pub(super) fn check_pool_stall(&mut self, on_device: bool) -> bool {
        let in_flight = !self.ios.is_empty()
            || !self.to_submit.is_empty()
            || !self.gated.is_empty()
            || self.side_outstanding() > 0;
        if in_flight {
            // The common case under load (a busy pool is starved on most passes): memory will
            // come back by itself, and no clock is read.
            self.stall = None;
            return false;
        }
        let now = Instant::now();
        let returned = self.slots.returned;
        let fresh = PoolStall {
            since: now,
            returned,
            on_device,
        };
        let stall = self.stall.get_or_insert(fresh);
        if stall.returned != returned || stall.on_device != on_device {
            *stall = fresh;
            return false;
        }
        let waited = now.duration_since(stall.since);
        let limit = self.cfg.pool_wait_limit;
        if !on_device && waited >= limit / 10 && self.grow_pool() {
            self.stall = None;
            return true;
        }
        if waited >= limit {
            self.stall = None;
            self.fail_starved(on_device);
        }
        false
    }

    /// Adds up to one op window of reserve blocks to the host pool; false at the limit.
    fn grow_pool(&mut self) -> bool {
        let block = self.arena.block_size();
        let have = self.slots.host.total() / block;
        let room = self.arena.capacity_blocks().saturating_sub(have);
        if room == 0 {
            return false;
        }
        let blocks = (self.op_window / block).max(1).min(room);
        self.slots.host.grow(blocks);
        tracing::warn!(
            added = blocks * block,
            total = (have + blocks) * block,
            "gpuio bounce pool held by futures that stopped polling (leaked?); grown"
        );
        true
    }

    /// Fails every op waiting for memory of the stalled pool.
    fn fail_starved(&mut self, on_device: bool) {
        let pool = self.slots.total(on_device);
        tracing::error!(
            pool,
            waiting = self.runnable.len(),
            "gpuio bounce pool held by futures that stopped polling; failing the ops waiting for it"
        );
        let keys: Vec<usize> = self.runnable.iter().copied().collect();
        for key in keys {
            let op = &mut self.ops[key];
            // Only ops that take memory from the stalled pool: host ops behind a cuFile op
            // starved of device staging (which never grows) keep waiting for the host pool.
            if op.kind == OpKind::Sync
                || op.owned.is_some()
                || op.stopped()
                || op.device_staged() != on_device
            {
                continue;
            }
            let ctx = Box::new(op.ctx(op.offset));
            op.fail(Error::PoolExhausted { ctx, pool });
            self.maybe_finish(key);
        }
    }
}
