//! Opening files on an engine: [`OpenOptions`], `Engine::open`/`create`/`open_nvme`.

use std::path::Path;
use std::sync::Arc;

use super::File;
use crate::engine::Engine;
use crate::error::{Context, Error, OpKind, Result};
#[cfg(feature = "cuda")]
use crate::target::GdsMode;
use crate::target::{Access, Target};

/// Opening files on an engine (here rather than in `engine.rs`: a file knows its engine, the
/// engine knows nothing of files).
impl Engine {
    /// Opens `path` read-only.
    pub fn open(&self, path: impl AsRef<Path>) -> Result<File> {
        OpenOptions::new().read(true).open(self, path)
    }

    /// Creates (or truncates) `path` for reading and writing.
    pub fn create(&self, path: impl AsRef<Path>) -> Result<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(self, path)
    }

    /// Opens NVMe namespace `trid` through SPDK as a [`File`]: an SPDK transport ID such as
    /// `trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.2016-06.io.spdk:cnode1`
    /// or `trtype:PCIe traddr:0000:04:00.0`, optionally with `ns:N` (default: the first active
    /// namespace). Reads and writes take any byte offset and length; reads past the end of the
    /// namespace are short, writes past it are refused. Blocks while SPDK connects.
    ///
    /// Fails with [`Error::Unsupported`](crate::Error::Unsupported) where SPDK is not
    /// available (the reason names what is missing), with an I/O error where the target does
    /// not answer, and with `InvalidInput` for a malformed transport ID.
    pub fn open_nvme(&self, trid: &str) -> Result<File> {
        File::open_nvme(self, trid)
    }
}

/// How to open a file; like `std::fs::OpenOptions`, plus `direct` for O_DIRECT.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    read: bool,
    write: bool,
    create: bool,
    truncate: bool,
    direct: bool,
}

impl OpenOptions {
    /// All options off.
    pub fn new() -> Self {
        Self::default()
    }
    /// Open for reading.
    pub fn read(mut self, on: bool) -> Self {
        self.read = on;
        self
    }
    /// Open for writing.
    pub fn write(mut self, on: bool) -> Self {
        self.write = on;
        self
    }
    /// Create the file if missing (needs `write`).
    pub fn create(mut self, on: bool) -> Self {
        self.create = on;
        self
    }
    /// Truncate to zero length (needs `write`).
    pub fn truncate(mut self, on: bool) -> Self {
        self.truncate = on;
        self
    }
    /// Bypass the page cache (O_DIRECT). Any offset and length still work: gpuio aligns.
    pub fn direct(mut self, on: bool) -> Self {
        self.direct = on;
        self
    }

    /// Opens `path` on `engine`.
    pub fn open(&self, engine: &Engine, path: impl AsRef<Path>) -> Result<File> {
        let path: Arc<Path> = Arc::from(path.as_ref());
        let ctx = || {
            Context::op(OpKind::Open)
                .with_path(&path)
                .with_backend(engine.backend().name)
        };
        let shared = engine.shared();
        if shared.reactor.refuses_work() {
            // A file on a stopped (or forked-away) engine could serve nothing: say so at the
            // open, not at the first read.
            return Err(shared.reactor.refusal(ctx()));
        }
        if !self.read && !self.write {
            return Err(Error::invalid(ctx(), "open needs read and/or write access"));
        }
        if (self.create || self.truncate) && !self.write {
            return Err(Error::invalid(ctx(), "create/truncate need write access"));
        }
        let how = Access {
            read: self.read,
            write: self.write,
            create: self.create,
            truncate: self.truncate,
            direct: self.direct,
        };
        let target = Target::open(
            path.clone(),
            &how,
            engine.backend().name,
            engine.chunk_size(),
        )?;
        let file = File {
            inner: Arc::new(target),
            engine: engine.clone(),
        };
        // `Backend::Gds` promises cuFile for device transfers: find out now, not mid-read.
        #[cfg(feature = "cuda")]
        if engine.gds_mode() == GdsMode::Forced {
            if let Err(why) = file.inner.gds_registration(GdsMode::Forced, true) {
                return Err(Error::unsupported(ctx().with_backend("cufile"), why));
            }
        }
        Ok(file)
    }
}

impl File {
    /// Opens NVMe namespace `trid` through SPDK (see [`Engine::open_nvme`]).
    pub(crate) fn open_nvme(engine: &Engine, trid: &str) -> Result<File> {
        let target = Target::open_nvme(trid, engine.bounce_pool_is_dma())?;
        Ok(File {
            inner: Arc::new(target),
            engine: engine.clone(),
        })
    }

    /// Whether this is an NVMe namespace opened through SPDK.
    pub fn is_nvme(&self) -> bool {
        self.inner.nvme.is_some()
    }

    /// For an NVMe namespace: its logical block (sector) size in bytes.
    pub fn sector_size(&self) -> Option<u64> {
        self.inner.nvme.as_ref().map(|n| n.sector)
    }
}
