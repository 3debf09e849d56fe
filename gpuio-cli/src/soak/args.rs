//! `gpuio soak`'s arguments and the checks made on them before any work starts.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use gpuio::Backend;

use crate::bench::Target;
use crate::size::{ByteSize, fmt_bytes};
use crate::validate;

/// Most concurrent tasks: storms run thousands; past a million only memory grows.
const MAX_TASKS: usize = 1 << 20;
/// Smallest region: a page, so that O_DIRECT requests fit in one.
const MIN_REGION: usize = 4096;

#[derive(Args, Debug)]
pub struct SoakArgs {
    /// Minutes to run (at most a year).
    #[arg(long, default_value_t = 1.0, value_parser = validate::minutes)]
    pub(super) minutes: f64,
    /// Directory for the soak file (default: the system temp dir).
    #[arg(long)]
    pub(super) dir: Option<PathBuf>,
    /// Size of the soak file (and of the part of an NVMe namespace used).
    #[arg(long, default_value = "256M", value_parser = validate::positive_size)]
    pub(super) size: ByteSize,
    /// Concurrent tasks (thousands make a cancellation storm).
    #[arg(long, default_value_t = 32, value_parser = validate::count(MAX_TASKS))]
    pub(super) tasks: usize,
    /// Reactor threads per file engine (`EngineBuilder::reactors`): reads take them in turn,
    /// each file's writes keep to one.
    #[arg(long, default_value_t = 1, value_parser = validate::whole(1usize, 64))]
    pub(super) reactors: usize,
    /// Regions the file is cut into, each at least 4K of --size; a write holds its region
    /// alone, reads share it.
    #[arg(long, default_value_t = 64, value_parser = validate::positive_count)]
    pub(super) regions: usize,
    /// Largest request.
    #[arg(long, default_value = "2M", value_parser = validate::positive_size)]
    pub(super) max_len: ByteSize,
    /// Where reads land: host, gpu, gpu:N (writes come from host memory).
    #[arg(long, default_value = "host")]
    pub(super) to: Target,
    /// Backends to use (default: uring and pread; with a GPU, auto too).
    #[arg(long, value_delimiter = ',')]
    pub(super) backend: Vec<Backend>,
    /// Percent of reads and writes dropped mid-flight (dropped writes go to scratch regions).
    #[arg(long, default_value_t = 10, value_parser = validate::whole(0u8, 100))]
    pub(super) drop_percent: u8,
    /// Percent of reads and writes leaked (`mem::forget`) mid-flight, within each engine's
    /// budget (later ones are dropped instead); 0: nothing leaks.
    #[arg(long, default_value_t = 1, value_parser = validate::whole(0u8, 100))]
    pub(super) leak_percent: u8,
    /// Open modes: buffered, direct, or both.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "buffered,direct"
    )]
    pub(super) modes: Vec<Mode>,
    /// Also soak this NVMe namespace through SPDK (a transport ID; its first --size bytes are
    /// overwritten).
    #[arg(long)]
    pub(super) nvme: Option<String>,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 1, value_parser = validate::whole(0, u64::MAX))]
    pub(super) seed: u64,
}

/// How the soak file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum Mode {
    /// Through the page cache.
    Buffered,
    /// O_DIRECT.
    Direct,
}

impl SoakArgs {
    /// Checks what clap's parsers cannot see one value at a time, before any file is made:
    /// returns the region length and the largest request. Refuses parameters that would leave
    /// the soak nothing to check.
    pub(super) fn layout(&self) -> Result<(usize, usize), String> {
        let size = self.size.0 as usize;
        let (drop, leak) = (self.drop_percent, self.leak_percent);
        if drop as u32 + leak as u32 >= 100 {
            return Err(format!(
                "--drop-percent {drop} + --leak-percent {leak} cancels every read, so no read \
                 would be checked: keep the sum below 100"
            ));
        }
        // Regions are at least a page: more of them than --size holds would make the file
        // (and the model held in memory) regions x 4 KiB, whatever --size says.
        if self.regions > size / MIN_REGION {
            return Err(format!(
                "--regions {}: --size {} holds at most {} regions of 4 KiB; raise --size or \
                 lower --regions",
                self.regions,
                fmt_bytes(self.size.0),
                size / MIN_REGION
            ));
        }
        // Cancelled writes go to scratch regions, where only "no 0xFF" is known: at least one
        // more region must remain to be checked against the model. (One region used to become
        // scratch, and the soak passed having checked nothing.)
        if (drop > 0 || leak > 0) && self.regions < 2 {
            return Err(format!(
                "--regions {}: with cancelled operations (--drop-percent {drop}, --leak-percent \
                 {leak}) the soak needs at least 2 regions, one for the cancelled writes and one \
                 to check; raise --regions (each region is at least 4 KiB of --size, which \
                 holds {}) or pass --drop-percent 0 --leak-percent 0",
                self.regions,
                size / MIN_REGION
            ));
        }
        let region_len = (size / self.regions) / MIN_REGION * MIN_REGION;
        let max_len = (self.max_len.0 as usize).min(region_len);
        // The model and the file's bytes are both in memory at the start and at the end, and
        // every task may hold a request's buffer: all of it must fit, or the allocation aborts.
        validate::fits_in_memory(
            (self.regions as u64 * region_len as u64)
                .checked_mul(2)
                .and_then(|m| m.checked_add((self.tasks as u64).checked_mul(max_len as u64)?)),
            &format!(
                "--size {} (held twice) and --tasks {} x requests up to {} need",
                fmt_bytes(self.size.0),
                self.tasks,
                fmt_bytes(max_len as u64)
            ),
        )?;
        Ok((region_len, max_len))
    }
}
