//! `gpuio soak`'s arguments.

use std::path::PathBuf;

use clap::Args;
use gpuio::Backend;

use crate::bench::Target;
use crate::size::ByteSize;

#[derive(Args, Debug)]
pub struct SoakArgs {
    /// Minutes to run.
    #[arg(long, default_value_t = 1.0)]
    pub(super) minutes: f64,
    /// Directory for the soak file (default: the system temp dir).
    #[arg(long)]
    pub(super) dir: Option<PathBuf>,
    /// Size of the soak file (and of the part of an NVMe namespace used).
    #[arg(long, default_value = "256M")]
    pub(super) size: ByteSize,
    /// Concurrent tasks (thousands make a cancellation storm).
    #[arg(long, default_value_t = 32)]
    pub(super) tasks: usize,
    /// Regions the file is cut into; a write holds its region alone, reads share it.
    #[arg(long, default_value_t = 64)]
    pub(super) regions: usize,
    /// Largest request.
    #[arg(long, default_value = "2M")]
    pub(super) max_len: ByteSize,
    /// Where reads land: host, gpu, gpu:N (writes come from host memory).
    #[arg(long, default_value = "host")]
    pub(super) to: Target,
    /// Backends to use (default: uring and pread; with a GPU, auto too).
    #[arg(long, value_delimiter = ',')]
    pub(super) backend: Vec<Backend>,
    /// Percent of operations dropped mid-flight.
    #[arg(long, default_value_t = 10)]
    pub(super) drop_percent: u8,
    /// Percent of operations leaked (`mem::forget`) mid-flight, within each engine's budget.
    #[arg(long, default_value_t = 1)]
    pub(super) leak_percent: u8,
    /// Open modes: buffered, direct, or both.
    #[arg(long, value_delimiter = ',', default_value = "buffered,direct")]
    pub(super) modes: Vec<String>,
    /// Also soak this NVMe namespace through SPDK (a transport ID; its first --size bytes are
    /// overwritten).
    #[arg(long)]
    pub(super) nvme: Option<String>,
    /// Seed of the random choices.
    #[arg(long, default_value_t = 1)]
    pub(super) seed: u64,
}
