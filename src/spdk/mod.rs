//! NVMe namespaces through SPDK, locally over PCIe or remotely over NVMe/TCP.
//!
//! SPDK is loaded at run time (libloading) from the initiator library `scripts/spdk.sh build`
//! makes (`GPUIO_SPDK_LIB` or `GPUIO_SPDK_HOME` point elsewhere), so gpuio builds and runs
//! without it; where it is missing, opening a namespace fails with [`Error::Unsupported`]
//! naming what is missing. SPDK's environment (DPDK, hugepages) starts once per process on
//! the first open.
//!
//! A namespace opens as a [`File`] ([`Engine::open_nvme`]) and is read and written with the
//! same calls as any file, at any byte offset and length, into host or device memory: data
//! moves between the NVMe queue and the engine's bounce slots (then, for device memory, the
//! host-to-device copy), so cancellation and leaks are as safe as for files. The engine's
//! reactor owns the I/O queue pairs (SPDK qpairs are single-threaded) and polls them while
//! commands are outstanding. Local PCIe drives need DMA-able bounce memory: build the engine
//! with [`EngineBuilder::spdk_memory`](crate::EngineBuilder::spdk_memory).
//!
//! [`Error::Unsupported`]: crate::Error::Unsupported
//! [`File`]: crate::File
//! [`Engine::open_nvme`]: crate::Engine::open_nvme

pub(crate) mod cmd;
pub(crate) mod ctrlr;
pub(crate) mod env;
pub(crate) mod lane;
pub(crate) mod sys;

pub use ctrlr::TransportId;

/// What `gpuio check` reports about SPDK.
#[derive(Debug, Clone)]
pub struct SpdkProbe {
    /// The initiator library's path and SPDK version, or why it cannot be used.
    pub library: Result<(String, String), String>,
    /// 2 MiB hugepages reserved and free (from /proc/meminfo).
    pub hugepages: Option<(u64, u64)>,
}

/// Looks for SPDK without starting it.
pub fn probe() -> SpdkProbe {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        meminfo
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    SpdkProbe {
        library: env::probe_library(),
        hugepages: field("HugePages_Total:").zip(field("HugePages_Free:")),
    }
}
