//! # gpuio: async storage I/O into GPU and host memory
//!
//! A dedicated reactor thread turns io_uring completions (or, where io_uring is unavailable,
//! a pread/pwrite thread pool's) into `Send` futures that work under any executor: tokio's
//! multi-thread and current-thread runtimes, `futures::executor`, or your own.
//!
//! ## Quick start
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let path = dir.path().join("weights.bin");
//! # std::fs::write(&path, vec![7u8; 1 << 20])?;
//! # let rt = tokio::runtime::Runtime::new()?;
//! # rt.block_on(async {
//! let engine = gpuio::Engine::new()?;               // io_uring, or the pread pool
//! let file = engine.open(&path)?;
//! let mut buf = vec![0u8; file.len()? as usize];
//! let n = file.read_into(&mut buf, 0).await?;        // chunked, many I/Os in flight
//! assert_eq!(n, buf.len());
//! println!("read {n} bytes via {}", engine.backend().name);
//! # Ok::<_, gpuio::Error>(()) })?;
//! # Ok(()) }
//! ```
//!
//! ## What it guarantees
//! - **Cancel- and leak-safety.** The kernel only ever writes reactor-owned memory: bounce
//!   slots, or an owned buffer you handed over ([`File::read_owned`]) until it comes back; data
//!   crosses into or out of a borrowed buffer only inside the future's own `poll`. Dropping or
//!   `mem::forget`-ting a future mid-flight never lets anything write your buffer afterwards
//!   ([`reactor`] explains the argument).
//! - **Any offset, any length, even with O_DIRECT.** Alignment comes from `statx` and is the
//!   library's job ([`plan::align`]).
//! - **Honest errors.** One [`Error`] type naming operation, path, offset and backend; reads past
//!   end of file return the short count; invalid input is an error, never a panic or a hang.
//! - **No GPU needed.** CUDA is probed at run time ([`cuda::probe`]); host paths work anywhere.
//!
//! ## Where to look
//! - [`File::read_into`] / [`File::write_from`]: one range, host or device memory.
//! - [`File::read_owned`] with a `Vec<u8>`, `BytesMut` or [`AlignedBuf`] (O_DIRECT): the
//!   kernel reads straight into the buffer, no bounce copy.
//! - [`batch`]: many ranges as one operation, prepared plans, named extents ([`batch::Catalog`]).
//! - `safetensors` (feature `safetensors`): checkpoints into one host or device allocation.
//! - [`gds`]: cuFile (GPUDirect Storage), used per file where it serves; [`Engine::synchronize`]
//!   (feature `cuda`) awaits a CUDA stream without parking a thread.
//! - `RawDeviceSlice` (feature `cuda`): device memory another library allocated (torch, cupy,
//!   a C caller), known by GPU, address and length, as a destination or source on its stream.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod agent;
pub mod batch;
pub mod buf;
pub mod check;
pub mod cuda;
mod engine;
mod error;
mod file;
#[cfg(feature = "cuda")]
pub mod gds;
pub mod lane;
mod op;
pub mod plan;
pub mod reactor;
#[cfg(feature = "safetensors")]
pub mod safetensors;
pub mod spdk;
mod target;
pub mod ucx;
pub mod uring;

pub use buf::aligned::AlignedBuf;
pub use buf::quarantine::quarantined;
#[cfg(feature = "cuda")]
pub use buf::raw_device::RawDeviceSlice;
pub use buf::{IoBuf, IoBufMut, ReadDst, WriteSrc};
pub use engine::{
    Backend, BackendInfo, DEFAULT_POOL_WAIT_LIMIT, DEFAULT_REACTOR_TICK, Engine, EngineBuilder,
};
pub use error::{Context, Error, OpKind, Result};
#[cfg(feature = "cuda")]
pub use file::StreamIo;
pub use file::{File, OpenOptions};
pub use op::cached::{CACHED_READ_MAX, HOST_CACHED_READ_MAX};
#[cfg(feature = "cuda")]
#[doc(hidden)]
pub use op::device::small_reads_released_early;
pub use op::occupancy::Occupancy;
pub use op::progress::Progress;
pub use op::read::ReadInto;
#[cfg(feature = "cuda")]
pub use op::sync::StreamSync;
pub use op::write::WriteFrom;

/// Checks that the `cargo fuzz` targets in `fuzz/` run against the request planner (built only
/// under `--cfg fuzzing`; not part of the API).
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::plan::{check_read_plan, check_write_plan};
}
