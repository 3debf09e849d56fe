//! What an op reads or writes: a file's descriptors (and the buffered twin of an O_DIRECT
//! file), its alignment, the NVMe namespace behind an SPDK "file", its identity for the range
//! fence, and its cuFile registration state. Opening and validating these is done here, once;
//! the reactor and the lanes only read them.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use crate::buf::arena::MIN_SLOT;
use crate::error::{Context, Error, OpKind, Result};
use crate::plan::align::{self, DirectAlignment};

/// The identity of what a file's pieces read and write: device and inode for files and block
/// devices; a hash of the canonical name for NVMe namespaces reached through SPDK.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct FileKey {
    pub(crate) dev: u64,
    pub(crate) ino: u64,
}

/// Whether and how an engine uses cuFile for device transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GdsMode {
    Off,
    Auto,
    Forced,
}

/// The access a file is opened with (the checked form of [`crate::OpenOptions`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Access {
    pub(crate) read: bool,
    pub(crate) write: bool,
    pub(crate) create: bool,
    pub(crate) truncate: bool,
    pub(crate) direct: bool,
}

/// An O_DIRECT descriptor of a buffered file, for reads the page cache cannot serve.
pub(crate) struct DirectTwin {
    fd: OwnedFd,
    /// Its alignment: direct pieces are planned on `align.offset`.
    pub(crate) align: DirectAlignment,
}

/// Whether bounce slots (aligned to `MIN_SLOT`, pieces of up to `chunk` bytes) satisfy a
/// direct-I/O alignment.
fn bounce_pool_serves(a: &DirectAlignment, chunk: usize) -> bool {
    a.memory as usize <= MIN_SLOT
        && (a.offset as u64).is_power_of_two()
        && a.offset as usize <= chunk.next_power_of_two()
}

/// What the reactor needs of a file; kept alive by every op until its I/O has completed.
/// Aligned to a cache line: the `Arc`'s counts, which every `File` clone changes, share no
/// line with the fields every read looks at.
#[repr(align(64))]
pub(crate) struct Target {
    /// The kernel descriptor (`None` for an NVMe namespace, whose I/O goes through SPDK).
    pub(crate) fd: Option<OwnedFd>,
    /// What the reactor orders this file's overlapping pieces by (device and inode).
    pub(crate) fence_key: FileKey,
    /// The NVMe namespace this "file" is, when opened with [`Engine::open_nvme`].
    pub(crate) nvme: Option<Arc<crate::spdk::ctrlr::Namespace>>,
    buffered: Option<OwnedFd>,
    /// The O_DIRECT twin of a buffered file, opened on the first large read whose range the
    /// page cache lacks (`None` inside: the filesystem refuses O_DIRECT or its alignment).
    direct: std::sync::OnceLock<Option<DirectTwin>>,
    /// The cuFile registration (or why there is none), made on the first device transfer.
    #[cfg(feature = "cuda")]
    gds: std::sync::OnceLock<std::result::Result<crate::gds::FileGds, String>>,
    pub(crate) path: Arc<Path>,
    /// Offset alignment for planning reads: the O_DIRECT alignment, or 1.
    pub(crate) align: u64,
    /// Offset alignment for planning writes: O_DIRECT alignment rounded up to a page, or 1.
    pub(crate) write_align: u64,
    pub(crate) dio: Option<DirectAlignment>,
    pub(crate) readable: bool,
    pub(crate) writable: bool,
    /// Set once the kernel refused `RWF_NOWAIT` reads of this file (`op::cached`).
    pub(crate) nowait_refused: std::sync::atomic::AtomicBool,
    /// Set once the driver refused to register a mapping of this file (`op::mapped`): its
    /// reads take the bounce path from then on.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) mapped_refused: std::sync::atomic::AtomicBool,
}

impl Target {
    /// Opens `path` as `how` says, for an engine whose kernel path is `backend` and whose
    /// largest piece is `chunk_size` bytes.
    pub(crate) fn open(
        path: Arc<Path>,
        how: &Access,
        backend: &'static str,
        chunk_size: usize,
    ) -> Result<Target> {
        let ctx = || {
            Context::op(OpKind::Open)
                .with_path(&path)
                .with_backend(backend)
        };
        if !how.read && !how.write {
            return Err(Error::invalid(ctx(), "open needs read and/or write access"));
        }
        if (how.create || how.truncate) && !how.write {
            return Err(Error::invalid(ctx(), "create/truncate need write access"));
        }
        let mut flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        if how.direct {
            flags |= libc::O_DIRECT;
        }
        // O_NONBLOCK so that opening a FIFO cannot hang; it is cleared below for files we serve.
        let file = std::fs::OpenOptions::new()
            .read(how.read)
            .write(how.write)
            .create(how.create)
            .truncate(how.truncate)
            .custom_flags(flags)
            .open(&path)
            .map_err(|e| {
                if how.direct && e.raw_os_error() == Some(libc::EINVAL) {
                    // A device node lives on devtmpfs, whose statfs magic is tmpfs's: name
                    // what the path is before blaming its filesystem.
                    use std::os::unix::fs::FileTypeExt;
                    let special = std::fs::metadata(&path).ok().and_then(|m| {
                        let t = m.file_type();
                        (t.is_char_device() || t.is_fifo() || t.is_socket())
                            .then_some("a character device, FIFO or socket")
                    });
                    let who = match special {
                        Some(what) => format!("{} is {what}, which", path.display()),
                        None => align::filesystem_name_of_path(&path)
                            .unwrap_or_else(|_| "the filesystem".into()),
                    };
                    Error::unsupported(
                        ctx(),
                        format!("{who} refuses O_DIRECT here; open without `direct`"),
                    )
                } else {
                    Error::io(ctx(), e)
                }
            })?;
        let fd: OwnedFd = file.into();
        let (ftype, fence_key) = file_type_and_key(fd.as_fd()).map_err(|e| Error::io(ctx(), e))?;
        if ftype != libc::S_IFREG && ftype != libc::S_IFBLK {
            let what = match ftype {
                libc::S_IFDIR => "a directory",
                libc::S_IFIFO => "a FIFO",
                libc::S_IFSOCK => "a socket",
                libc::S_IFCHR => "a character device",
                _ => "not a regular file",
            };
            return Err(Error::invalid(
                ctx(),
                format!("{what}: gpuio reads regular files and block devices"),
            ));
        }
        if let Some(fs) = align::pseudo_filesystem(fd.as_fd()).map_err(|e| Error::io(ctx(), e))? {
            return Err(Error::invalid(
                ctx(),
                format!(
                    "a {fs} pseudo-file: its contents are generated on each read and have no \
                     stable size, so gpuio cannot split it into parallel reads; use std::fs"
                ),
            ));
        }
        clear_nonblock(&fd).map_err(|e| Error::io(ctx(), e))?;
        let (align, dio) = if how.direct {
            let a = align::query(fd.as_fd())
                .map_err(|e| Error::io(ctx(), e))?
                .ok_or_else(|| {
                    Error::unsupported(ctx(), "the filesystem reports no direct-I/O support")
                })?;
            if !bounce_pool_serves(&a, chunk_size) {
                return Err(Error::unsupported(
                    ctx(),
                    format!(
                        "direct-I/O alignment (memory {}, offset {}) exceeds what the bounce pool \
                         provides; raise the chunk size or open without `direct`",
                        a.memory, a.offset
                    ),
                ));
            }
            (a.offset as u64, Some(a))
        } else {
            (1, None)
        };
        // Unaligned write edges of an O_DIRECT file go through a buffered twin descriptor.
        let buffered = if how.direct && how.write {
            let twin = std::fs::OpenOptions::new()
                .read(how.read)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .or_else(|_| {
                    std::fs::OpenOptions::new()
                        .read(how.read)
                        .write(true)
                        .custom_flags(libc::O_CLOEXEC)
                        .open(&path)
                })
                .map_err(|e| Error::io(ctx(), e))?;
            Some(OwnedFd::from(twin))
        } else {
            None
        };
        Ok(Target {
            fd: Some(fd),
            fence_key,
            nvme: None,
            buffered,
            direct: std::sync::OnceLock::new(),
            #[cfg(feature = "cuda")]
            gds: std::sync::OnceLock::new(),
            path,
            align,
            // Direct writes send unaligned edges through the page cache; planning their
            // direct middle on whole pages keeps the two from ever sharing a page, which
            // would make the kernel fail page-cache invalidation after the direct write
            // (and report EIO at the next fsync).
            write_align: if align > 1 { align.max(page_size()) } else { 1 },
            dio,
            readable: how.read,
            writable: how.write,
            nowait_refused: std::sync::atomic::AtomicBool::new(false),
            mapped_refused: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Opens NVMe namespace `trid` through SPDK; `dma` says whether the engine's bounce pool
    /// is DMA-able memory (local PCIe controllers need it).
    pub(crate) fn open_nvme(trid: &str, dma: bool) -> Result<Target> {
        let name = format!(
            "nvme://{}",
            trid.split_whitespace().collect::<Vec<_>>().join(" ")
        );
        let path: Arc<Path> = Arc::from(Path::new(&name));
        let ctx = || {
            Context::op(OpKind::Open)
                .with_path(&path)
                .with_backend("spdk")
        };
        let id = crate::spdk::TransportId::parse(trid)
            .map_err(|why| Error::invalid(ctx(), format!("invalid SPDK transport ID: {why}")))?;
        if id.is_pcie() && !dma {
            return Err(Error::unsupported(
                ctx(),
                "local PCIe NVMe needs DMA-able bounce memory: build the engine with \
                 EngineBuilder::spdk_memory(true)",
            ));
        }
        let ctrlr = crate::spdk::ctrlr::Controller::attach(&id).map_err(|why| {
            if crate::spdk::env::spdk().is_err() {
                Error::unsupported(ctx(), why)
            } else {
                Error::io(
                    ctx(),
                    std::io::Error::new(std::io::ErrorKind::ConnectionRefused, why),
                )
            }
        })?;
        let ns = ctrlr
            .namespace(id.nsid())
            .map_err(|why| Error::invalid(ctx(), why))?;
        let sector = ns.sector;
        // Name the namespace in error contexts the way a user would open it again.
        let path: Arc<Path> = Arc::from(Path::new(&format!(
            "nvme://{} ns:{}",
            id.controller_string(),
            ns.nsid
        )));
        Ok(Target {
            fd: None,
            fence_key: nvme_fence_key(&path),
            nvme: Some(Arc::new(ns)),
            buffered: None,
            direct: std::sync::OnceLock::new(),
            #[cfg(feature = "cuda")]
            gds: std::sync::OnceLock::new(),
            path,
            align: sector,
            // Unaligned write edges are read-modify-written one sector at a time.
            write_align: sector,
            dio: None,
            readable: true,
            writable: true,
            nowait_refused: std::sync::atomic::AtomicBool::new(false),
            mapped_refused: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The descriptor for the kernel (-1 for an NVMe namespace, whose pieces the reactor
    /// sends to SPDK and never to the kernel).
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_ref().map_or(-1, AsRawFd::as_raw_fd)
    }

    /// The O_DIRECT twin of this buffered file, opened on first use, if the filesystem takes
    /// O_DIRECT with an alignment the bounce pool serves for pieces of `chunk` bytes. Reads
    /// only: the twin is opened read-only, and only for readable, buffered regular files and
    /// block devices.
    pub(crate) fn direct_twin(&self, chunk: usize) -> Option<&DirectTwin> {
        if self.dio.is_some() || !self.readable {
            return None;
        }
        let fd = self.fd.as_ref()?;
        self.direct
            .get_or_init(|| {
                // Through /proc/self/fd: the same inode even if the path was renamed or
                // replaced since the open.
                let twin = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_CLOEXEC | libc::O_DIRECT)
                    .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                    .ok()?;
                let twin = OwnedFd::from(twin);
                let (_, key) = file_type_and_key(twin.as_fd()).ok()?;
                let align = align::query(twin.as_fd()).ok()??;
                (key == self.fence_key && bounce_pool_serves(&align, chunk))
                    .then_some(DirectTwin { fd: twin, align })
            })
            .as_ref()
    }

    pub(crate) fn direct_raw_fd(&self) -> RawFd {
        self.direct
            .get()
            .and_then(Option::as_ref)
            .map_or_else(|| self.raw_fd(), |t| t.fd.as_raw_fd())
    }

    pub(crate) fn buffered_raw_fd(&self) -> RawFd {
        self.buffered
            .as_ref()
            .map_or_else(|| self.raw_fd(), AsRawFd::as_raw_fd)
    }

    /// The cuFile registration, if one was made and succeeded.
    #[cfg(feature = "cuda")]
    pub(crate) fn gds(&self) -> Option<&crate::gds::FileGds> {
        self.gds.get().and_then(|r| r.as_ref().ok())
    }

    /// Registers the file with cuFile once (through an O_DIRECT descriptor of its own), or
    /// says why it cannot be.
    #[cfg(feature = "cuda")]
    pub(crate) fn gds_registration(
        &self,
        mode: GdsMode,
        compat_allowed: bool,
    ) -> std::result::Result<&crate::gds::FileGds, String> {
        if mode == GdsMode::Off {
            return Err("the engine's backend does not use cuFile".into());
        }
        if self.nvme.is_some() {
            return Err(
                "an NVMe namespace opened through SPDK is not a file cuFile can register".into(),
            );
        }
        let r = self.gds.get_or_init(|| {
            let compat = !crate::gds::result::nvidia_fs_loaded();
            let r = if mode == GdsMode::Auto && compat && !compat_allowed {
                // Compatibility-mode cuFile does what the bounce path does (POSIX reads, host
                // copies), slower in every measurement (EngineBuilder::cufile_compat).
                Err("cuFile runs in compatibility mode (no nvidia-fs): POSIX reads and host \
                     copies inside libcufile, slower than gpuio's bounce path, which serves \
                     this file (EngineBuilder::cufile_compat(true) or Backend::Gds to use it)"
                    .to_string())
            } else if mode == GdsMode::Auto && compat && self.dio.is_none() {
                // Compatibility-mode cuFile is POSIX I/O on an O_DIRECT descriptor: for a
                // buffered file it would throw the page cache away and buy nothing.
                Err("cuFile runs in compatibility mode (no nvidia-fs) and would bypass the page \
                     cache: buffered files keep the bounce path (open with `direct`, or use \
                     Backend::Gds, to read them through cuFile)"
                    .to_string())
            } else {
                self.register_gds(mode == GdsMode::Forced)
            };
            if let Err(why) = &r {
                tracing::info!(path = %self.path.display(), %why, "cuFile does not serve this file; device transfers use the bounce path");
            }
            r
        });
        r.as_ref().map_err(|e| e.clone())
    }

    #[cfg(feature = "cuda")]
    fn register_gds(&self, forced: bool) -> std::result::Result<crate::gds::FileGds, String> {
        use crate::gds::handle::GdsHandle;
        let mut opts = std::fs::OpenOptions::new();
        opts.read(self.readable)
            .write(self.writable)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC);
        let direct = opts
            .open(format!("/proc/self/fd/{}", self.raw_fd()))
            .or_else(|_| opts.open(&self.path))
            .map_err(|e| format!("cannot reopen the file with O_DIRECT for cuFile: {e}"))?;
        let fd = OwnedFd::from(direct);
        let dio = align::query(fd.as_fd())
            .map_err(|e| format!("statx: {e}"))?
            .ok_or("the filesystem reports no direct-I/O support, which cuFile needs")?;
        // DeviceStaging slots are 4 KiB-aligned and cuFile pieces are planned on 4 KiB.
        if dio.offset as usize > MIN_SLOT || dio.memory as usize > MIN_SLOT {
            return Err(format!(
                "direct-I/O alignment (memory {}, offset {}) exceeds the 4 KiB staging granularity",
                dio.memory, dio.offset
            ));
        }
        let handle = GdsHandle::register(fd).map_err(|e| e.to_string())?;
        Ok(crate::gds::FileGds::new(handle, MIN_SLOT as u64, forced))
    }
}

/// The fence identity of an NVMe namespace: a hash of its canonical name (controller and
/// namespace ID), so two opens of one namespace on an engine are ordered against each other.
/// A collision would only order pieces that need no ordering.
fn nvme_fence_key(name: &Path) -> FileKey {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut h);
    FileKey {
        dev: u64::MAX - 1,
        ino: h.finish(),
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as u64 } else { 4096 }
}

fn clear_nonblock(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own; no memory is passed.
    unsafe {
        let fl = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
        if fl < 0 || libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The file type (`S_IFMT` bits) of `fd` and the identity its I/O is ordered by (see
/// `reactor::fence`): device and inode for a file; the device number for a block device, so
/// that every node of one disk is the same key.
fn file_type_and_key(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<(u32, FileKey)> {
    let stx = align::statx_fd(fd, libc::STATX_TYPE | libc::STATX_INO)?;
    let ftype = u32::from(stx.stx_mode) & libc::S_IFMT;
    let key = if ftype == libc::S_IFBLK {
        FileKey {
            dev: u64::MAX,
            ino: libc::makedev(stx.stx_rdev_major, stx.stx_rdev_minor),
        }
    } else {
        FileKey {
            dev: libc::makedev(stx.stx_dev_major, stx.stx_dev_minor),
            ino: stx.stx_ino,
        }
    };
    Ok((ftype, key))
}

impl Target {
    /// No file: what an op that only waits on a CUDA stream (`Engine::synchronize`) names in
    /// its table entry.
    pub(crate) fn unnamed() -> Target {
        Target {
            fd: None,
            fence_key: FileKey { dev: 0, ino: 0 },
            nvme: None,
            buffered: None,
            direct: std::sync::OnceLock::new(),
            #[cfg(feature = "cuda")]
            gds: std::sync::OnceLock::new(),
            path: Arc::from(Path::new("")),
            align: 1,
            write_align: 1,
            dio: None,
            readable: false,
            writable: false,
            nowait_refused: std::sync::atomic::AtomicBool::new(false),
            mapped_refused: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

#[cfg(test)]
impl Target {
    /// A target with no descriptor, for reactor tests whose fake lane never touches a file.
    /// `ino` tells targets apart in the range fence.
    pub(crate) fn fake(ino: u64) -> Target {
        Target {
            fd: None,
            fence_key: FileKey { dev: u64::MAX, ino },
            nvme: None,
            buffered: None,
            direct: std::sync::OnceLock::new(),
            #[cfg(feature = "cuda")]
            gds: std::sync::OnceLock::new(),
            path: Arc::from(Path::new("fake")),
            align: 1,
            write_align: 1,
            dio: None,
            readable: true,
            writable: true,
            nowait_refused: std::sync::atomic::AtomicBool::new(false),
            mapped_refused: std::sync::atomic::AtomicBool::new(false),
        }
    }
}
