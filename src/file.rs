//! [`File`]: an open file (or block device) bound to an [`Engine`], and its async operations.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Arc;

use crate::buf::arena::MIN_SLOT;
use crate::buf::{IoBuf, IoBufMut, ReadDst, ReadTarget, WriteSource, WriteSrc};
use crate::engine::Engine;
#[cfg(feature = "cuda")]
use crate::engine::GdsMode;
use crate::error::{Context, Error, OpKind, Result};
use crate::reactor::fence::FileKey;
use crate::reactor::op::{Either, NoTransfer, OpFuture, Transfer};
use crate::reactor::read::{HostCopyOut, ReadInto};
use crate::reactor::write::{HostFill, WriteFrom};
use crate::reactor::{DeviceHint, OpRequest};
use crate::uring::align::{self, DirectAlignment};
use crate::uring::plan::MAX_POS;

/// Future of a stream-ordered cuFile operation ([`File::read_on_stream`],
/// [`File::write_on_stream`]): bytes moved, once the stream has passed the operation.
#[cfg(feature = "cuda")]
#[must_use = "the operation runs anyway; the future only reports its result"]
pub struct StreamIo {
    inner: OpFuture<NoTransfer>,
}

#[cfg(feature = "cuda")]
impl std::future::Future for StreamIo {
    type Output = Result<usize>;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<usize>> {
        std::pin::Pin::new(&mut self.inner)
            .poll(cx)
            .map(crate::reactor::to_usize)
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
        if !self.read && !self.write {
            return Err(Error::invalid(ctx(), "open needs read and/or write access"));
        }
        if (self.create || self.truncate) && !self.write {
            return Err(Error::invalid(ctx(), "create/truncate need write access"));
        }
        let mut flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        if self.direct {
            flags |= libc::O_DIRECT;
        }
        // O_NONBLOCK so that opening a FIFO cannot hang; it is cleared below for files we serve.
        let file = std::fs::OpenOptions::new()
            .read(self.read)
            .write(self.write)
            .create(self.create)
            .truncate(self.truncate)
            .custom_flags(flags)
            .open(&path)
            .map_err(|e| {
                if self.direct && e.raw_os_error() == Some(libc::EINVAL) {
                    let fs = align::filesystem_name_of_path(&path)
                        .unwrap_or_else(|_| "the filesystem".into());
                    Error::unsupported(
                        ctx(),
                        format!("{fs} refuses O_DIRECT here; open without `direct`"),
                    )
                } else {
                    Error::io(ctx(), e)
                }
            })?;
        let fd: OwnedFd = file.into();
        let (ftype, fence_key) =
            align::file_type_and_key(fd.as_fd()).map_err(|e| Error::io(ctx(), e))?;
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
        let (align, dio) = if self.direct {
            let a = align::query(fd.as_fd())
                .map_err(|e| Error::io(ctx(), e))?
                .ok_or_else(|| {
                    Error::unsupported(ctx(), "the filesystem reports no direct-I/O support")
                })?;
            if a.memory as usize > MIN_SLOT
                || !(a.offset as u64).is_power_of_two()
                || a.offset as usize > engine.chunk_size().next_power_of_two()
            {
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
        let buffered = if self.direct && self.write {
            let twin = std::fs::OpenOptions::new()
                .read(self.read)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .or_else(|_| {
                    std::fs::OpenOptions::new()
                        .read(self.read)
                        .write(true)
                        .custom_flags(libc::O_CLOEXEC)
                        .open(&path)
                })
                .map_err(|e| Error::io(ctx(), e))?;
            Some(OwnedFd::from(twin))
        } else {
            None
        };
        let file_path = path.clone();
        let file = File {
            inner: Arc::new(FileInner {
                fd: Some(fd),
                fence_key,
                nvme: None,
                buffered,
                #[cfg(feature = "cuda")]
                gds: std::sync::OnceLock::new(),
                path: file_path,
                align,
                // Direct writes send unaligned edges through the page cache; planning their
                // direct middle on whole pages keeps the two from ever sharing a page, which
                // would make the kernel fail page-cache invalidation after the direct write
                // (and report EIO at the next fsync).
                write_align: if align > 1 { align.max(page_size()) } else { 1 },
                dio,
                readable: self.read,
                writable: self.write,
            }),
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
        if id.is_pcie() && !engine.bounce_pool_is_dma() {
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
        Ok(File {
            inner: Arc::new(FileInner {
                fd: None,
                fence_key: nvme_fence_key(&path),
                nvme: Some(Arc::new(ns)),
                buffered: None,
                #[cfg(feature = "cuda")]
                gds: std::sync::OnceLock::new(),
                path,
                align: sector,
                // Unaligned write edges are read-modify-written one sector at a time.
                write_align: sector,
                dio: None,
                readable: true,
                writable: true,
            }),
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

/// What the reactor needs of a file; kept alive by every op until its I/O has completed.
pub(crate) struct FileInner {
    /// The kernel descriptor (`None` for an NVMe namespace, whose I/O goes through SPDK).
    fd: Option<OwnedFd>,
    /// What the reactor orders this file's overlapping pieces by (device and inode).
    pub(crate) fence_key: FileKey,
    /// The NVMe namespace this "file" is, when opened with [`Engine::open_nvme`].
    pub(crate) nvme: Option<Arc<crate::spdk::ctrlr::Namespace>>,
    buffered: Option<OwnedFd>,
    /// The cuFile registration (or why there is none), made on the first device transfer.
    #[cfg(feature = "cuda")]
    gds: std::sync::OnceLock<std::result::Result<crate::gds::FileGds, String>>,
    pub(crate) path: Arc<Path>,
    /// Offset alignment for planning reads: the O_DIRECT alignment, or 1.
    pub(crate) align: u64,
    /// Offset alignment for planning writes: O_DIRECT alignment rounded up to a page, or 1.
    pub(crate) write_align: u64,
    dio: Option<DirectAlignment>,
    readable: bool,
    writable: bool,
}

impl FileInner {
    /// The descriptor for the kernel (-1 for an NVMe namespace, whose pieces the reactor
    /// sends to SPDK and never to the kernel).
    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd.as_ref().map_or(-1, AsRawFd::as_raw_fd)
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
            let compat = !crate::gds::driver::nvidia_fs_loaded();
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
        // Staging slots are 4 KiB-aligned and cuFile pieces are planned on 4 KiB.
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

/// An open file on an [`Engine`]. Cheap to clone; `Send + Sync`; all I/O methods take `&self`,
/// so one file can serve many concurrent operations.
#[derive(Clone)]
pub struct File {
    inner: Arc<FileInner>,
    engine: Engine,
}

impl std::fmt::Debug for File {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("File")
            .field("path", &self.inner.path)
            .field("direct", &self.inner.dio.is_some())
            .finish()
    }
}

impl File {
    /// The path the file was opened with.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Whether the file was opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.inner.dio.is_some()
    }

    /// The O_DIRECT alignment in force (for `direct` files).
    pub fn direct_alignment(&self) -> Option<DirectAlignment> {
        self.inner.dio
    }

    /// The engine serving this file.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// What serves this file's device-memory transfers: cuFile (true GDS or compatibility
    /// mode) or the bounce path, with the reason. Registers the file with cuFile if the
    /// engine's backend allows and that was not tried yet.
    #[cfg(feature = "cuda")]
    pub fn gds_status(&self) -> crate::gds::GdsStatus {
        match self
            .inner
            .gds_registration(self.engine.gds_mode(), self.engine.cufile_compat())
        {
            Ok(g) => g.status(),
            Err(why) => crate::gds::GdsStatus::Bounce(why),
        }
    }

    /// Whether `other` is a handle to the same open file (clones of one `File`).
    pub fn same_file(&self, other: &File) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    pub(crate) fn ctx(&self, op: OpKind, offset: u64) -> Context {
        let backend = if self.inner.nvme.is_some() {
            "spdk"
        } else {
            self.engine.backend().name
        };
        Context::op(op)
            .with_path(&self.inner.path)
            .with_offset(offset)
            .with_backend(backend)
    }

    /// Current size in bytes (block devices: device size).
    pub fn len(&self) -> Result<u64> {
        match (&self.inner.nvme, &self.inner.fd) {
            (Some(ns), _) => Ok(ns.size),
            (None, Some(fd)) => {
                align::file_len(fd.as_fd()).map_err(|e| Error::io(self.ctx(OpKind::Stat, 0), e))
            }
            (None, None) => Ok(0),
        }
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    fn check(&self, op: OpKind, offset: u64, len: usize) -> Result<()> {
        let (ok, what) = match op {
            OpKind::Read => (self.inner.readable, "read"),
            _ => (self.inner.writable, "write"),
        };
        if !ok {
            return Err(Error::invalid(
                self.ctx(op, offset),
                format!("file was opened without {what} access"),
            ));
        }
        if offset.checked_add(len as u64).is_none_or(|e| e > MAX_POS) {
            return Err(Error::invalid(
                self.ctx(op, offset),
                format!("offset {offset} + length {len} passes the largest file offset"),
            ));
        }
        if let Some(ns) = self.inner.nvme.as_ref().filter(|_| op == OpKind::Write) {
            if offset + len as u64 > ns.size {
                return Err(Error::invalid(
                    self.ctx(op, offset),
                    format!(
                        "write of {len} bytes at {offset} passes the end of the namespace ({} bytes)",
                        ns.size
                    ),
                ));
            }
        }
        if self.engine.is_shut_down() {
            return Err(self.engine.shared().refusal(self.ctx(op, offset)));
        }
        Ok(())
    }

    /// The future of a read or write of `len` bytes at `offset`: finished at once when the
    /// request is invalid or empty, otherwise sent to the reactor on first poll.
    fn start<T: Transfer>(
        &self,
        op: OpKind,
        offset: u64,
        len: usize,
        device: DeviceHint,
        transfer: T,
    ) -> OpFuture<T> {
        let shared = self.engine.shared().clone();
        match self.check(op, offset, len) {
            Err(e) => OpFuture::ready(shared, op, transfer, Err(e)),
            Ok(()) if len == 0 => OpFuture::ready(shared, op, transfer, Ok(0)),
            Ok(()) => {
                // Device transfers find out (once per file) whether cuFile serves the file.
                #[cfg(feature = "cuda")]
                if device.is_some() {
                    let _ = self
                        .inner
                        .gds_registration(self.engine.gds_mode(), self.engine.cufile_compat());
                }
                let (file, len) = (self.inner.clone(), len as u64);
                let req = match op {
                    OpKind::Read => OpRequest::Read {
                        file,
                        offset,
                        len,
                        device,
                        owned: None,
                    },
                    _ => OpRequest::Write {
                        file,
                        offset,
                        len,
                        device,
                    },
                };
                OpFuture::new(shared, req, transfer)
            }
        }
    }

    /// Reads `dst.len()` bytes at `offset` into `dst`; returns the bytes read, fewer only at
    /// end of file. Large requests run as several chunk I/Os in flight at once.
    ///
    /// Cancel-safe: dropping (or leaking) the future mid-flight leaves `dst` untouched from
    /// then on.
    pub fn read_into<'a, D: ReadDst + ?Sized>(
        &'a self,
        dst: &'a mut D,
        offset: u64,
    ) -> ReadInto<'a> {
        let target = dst.target();
        let len = target.len();
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut device = None;
        let transfer = match target {
            ReadTarget::Host(dst) => Either::Host(HostCopyOut { dst, offset }),
            #[cfg(feature = "cuda")]
            ReadTarget::Device(dst) => {
                device = Some(dst.own_stream().context().clone());
                Either::Device(crate::cuda::copy::DeviceCopyOut {
                    dst,
                    offset,
                    stream: None,
                    error: None,
                })
            }
        };
        let inner = self.start(OpKind::Read, offset, len, device, transfer);
        ReadInto { inner }
    }

    /// Reads `dst`'s length in bytes at `offset` into device memory **as work on `stream`**
    /// (`cuFileReadAsync`): the read is queued now, runs when the stream reaches it, and
    /// kernels queued on `stream` afterwards see the data. The returned future resolves to the
    /// bytes read once the stream has passed the read (await it, or drop it: the read still
    /// happens). Needs a file cuFile serves ([`File::gds_status`]); otherwise
    /// [`Error::Unsupported`] says why. `dst` may be borrowed again as soon as this returns:
    /// every later use of it through cudarc is ordered after the read.
    #[cfg(feature = "cuda")]
    pub fn read_on_stream<D: ReadDst + ?Sized>(
        &self,
        dst: &mut D,
        offset: u64,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<StreamIo> {
        let ReadTarget::Device(dst) = dst.target() else {
            return Err(Error::invalid(
                self.ctx(OpKind::Read, offset),
                "stream-ordered reads need device memory",
            ));
        };
        let len = dst.byte_len();
        let own = dst.own_stream().clone();
        self.on_stream(OpKind::Read, offset, len, stream, &own, |s| {
            dst.write_ptr(s)
        })
    }

    /// Writes `src`'s bytes from device memory to the file at `offset` **as work on `stream`**
    /// (`cuFileWriteAsync`), after everything queued on `stream` before it. The future
    /// resolves to the bytes written once the stream has passed the write; a short write is an
    /// error. Same requirements as [`File::read_on_stream`].
    #[cfg(feature = "cuda")]
    pub fn write_on_stream<S: WriteSrc + ?Sized>(
        &self,
        src: &S,
        offset: u64,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<StreamIo> {
        let WriteSource::Device(src) = src.source() else {
            return Err(Error::invalid(
                self.ctx(OpKind::Write, offset),
                "stream-ordered writes need device memory",
            ));
        };
        let len = src.byte_len();
        let own = src.own_stream().clone();
        self.on_stream(OpKind::Write, offset, len, stream, &own, |s| {
            src.read_ptr(s)
        })
    }

    #[cfg(feature = "cuda")]
    fn on_stream<'g>(
        &self,
        op: OpKind,
        offset: u64,
        len: usize,
        stream: &'g Arc<cudarc::driver::CudaStream>,
        own: &Arc<cudarc::driver::CudaStream>,
        ptr: impl FnOnce(&'g cudarc::driver::CudaStream) -> (u64, cudarc::driver::SyncOnDrop<'g>),
    ) -> Result<StreamIo> {
        use crate::reactor::op::OpShared;
        self.check(op, offset, len)?;
        let engine = self.engine.shared().clone();
        if len == 0 {
            return Ok(StreamIo {
                inner: OpFuture::ready(engine, op, NoTransfer, Ok(0)),
            });
        }
        let ctx = || self.ctx(op, offset).with_backend("cufile-stream");
        self.inner
            .gds_registration(self.engine.gds_mode(), self.engine.cufile_compat())
            .map_err(|why| Error::unsupported(ctx(), why))?;
        let shared = OpShared::new();
        let (dptr, guard) = ptr(stream);
        // SAFETY: `dptr` covers `len` bytes of the caller's device memory, which cudarc handed
        // out for use on `stream`; dropping `guard` right after records cudarc's event for it
        // behind the queued operation, so every later use (and the free) follows it.
        let queued = unsafe {
            crate::gds::stream::enqueue(
                &engine,
                &self.inner,
                stream,
                dptr,
                len,
                offset,
                op == OpKind::Write,
                &shared,
            )
        };
        drop(guard);
        if stream.cu_stream() != own.cu_stream() {
            // cudarc frees on the memory's own stream: make it wait for the operation too.
            let ev = stream
                .record_event(None)
                .map_err(|e| Error::cuda(ctx(), e))?;
            own.wait(&ev).map_err(|e| Error::cuda(ctx(), e))?;
        }
        queued?;
        Ok(StreamIo {
            inner: OpFuture::running(engine, op, NoTransfer, shared),
        })
    }

    /// Reads exactly `dst.len()` bytes at `offset`, or fails with [`Error::UnexpectedEof`]
    /// naming this file and `offset`, the bytes wanted and the bytes read before the file
    /// ended.
    pub async fn read_exact_at<D: ReadDst + ?Sized>(&self, dst: &mut D, offset: u64) -> Result<()> {
        let wanted = dst.target().len() as u64;
        let got = self.read_into(dst, offset).await? as u64;
        if got < wanted {
            return Err(Error::UnexpectedEof {
                ctx: Box::new(self.ctx(OpKind::Read, offset)),
                wanted,
                got,
            });
        }
        Ok(())
    }

    /// Writes all of `src` at `offset`; returns `src.len()` or an error (never a silent short
    /// write). O_DIRECT files accept any offset and length.
    pub fn write_from<'a, S: WriteSrc + ?Sized>(
        &'a self,
        src: &'a S,
        offset: u64,
    ) -> WriteFrom<'a> {
        let source = src.source();
        let len = source.len();
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut device = None;
        let transfer = match source {
            WriteSource::Host(src) => Either::Host(HostFill { src, offset }),
            #[cfg(feature = "cuda")]
            WriteSource::Device(src) => {
                device = Some(src.own_stream().context().clone());
                Either::Device(crate::cuda::copy::DeviceFill {
                    src,
                    offset,
                    stream: None,
                    error: None,
                })
            }
        };
        let inner = self.start(OpKind::Write, offset, len, device, transfer);
        WriteFrom { inner }
    }

    /// Reads into an owned buffer (its whole length) and hands it back with the result.
    ///
    /// For `Vec<u8>`, `bytes::BytesMut` and [`AlignedBuf`](crate::AlignedBuf) (host memory),
    /// where the read needs no widening (buffered files; O_DIRECT with offset, length and
    /// buffer address aligned to the file's [`File::direct_alignment`]: use an `AlignedBuf`
    /// for that) and the file is not an NVMe namespace, the kernel reads straight into the
    /// buffer: no bounce slot, no copy. The engine owns the buffer until the
    /// kernel is done with it, so dropping or leaking this future mid-flight stays sound (a
    /// dropped future's buffer is freed after the read lands; if the engine dies with the read
    /// in the kernel the buffer is leaked and an empty one comes back with the error). Every
    /// other buffer is read through bounce slots like [`File::read_into`].
    pub async fn read_owned<B: IoBufMut>(&self, buf: B, offset: u64) -> (Result<usize>, B) {
        match crate::buf::owned::OwnedHostBuf::take(buf) {
            Ok(mut owned) => {
                let (addr, len) = owned.addr_len();
                let a = self.inner.align.max(1);
                let in_place = self.inner.nvme.is_none()
                    && (a == 1 || (offset % a == 0 && len as u64 % a == 0 && addr as u64 % a == 0));
                if !in_place {
                    let r = self.read_into(owned.as_mut_slice(), offset).await;
                    return (r, owned.into_original());
                }
                let r = self.read_in_place(owned, offset, len, addr).await;
                (r.0, r.1.into_original())
            }
            Err(mut buf) => {
                let r = self.read_into(&mut buf, offset).await;
                (r, buf)
            }
        }
    }

    /// The in-place half of [`File::read_owned`]: the reactor reads into `owned` directly.
    async fn read_in_place<B: 'static>(
        &self,
        owned: crate::buf::owned::OwnedHostBuf<B>,
        offset: u64,
        len: usize,
        addr: usize,
    ) -> (Result<usize>, crate::buf::owned::OwnedHostBuf<B>) {
        if let Err(e) = self.check(OpKind::Read, offset, len) {
            return (Err(e), owned);
        }
        if len == 0 {
            return (Ok(0), owned);
        }
        let kind = owned.kind();
        let req = OpRequest::Read {
            file: self.inner.clone(),
            offset,
            len: len as u64,
            device: None,
            owned: Some(crate::reactor::OwnedTarget {
                addr,
                keep: owned.into_any(),
            }),
        };
        let mut fut = OpFuture::new(
            self.engine.shared().clone(),
            req,
            crate::reactor::read::OwnedReturn::default(),
        );
        let r = (&mut fut).await;
        let back = fut.transfer_mut().back.take();
        let owned = back
            .and_then(|b| crate::buf::owned::OwnedHostBuf::<B>::from_any(b, kind))
            // The reactor kept the buffer because the kernel may still write it (it died
            // with the read in flight): an empty buffer of the same kind comes back.
            .unwrap_or_else(|| crate::buf::owned::OwnedHostBuf::empty(kind));
        (crate::reactor::to_usize(r), owned)
    }

    /// Writes an owned buffer (its whole length) and hands it back with the result.
    pub async fn write_owned<B: IoBuf>(&self, buf: B, offset: u64) -> (Result<usize>, B) {
        let r = self.write_from(&buf, offset).await;
        (r, buf)
    }

    /// Flushes data and metadata to stable storage (`fsync`).
    pub async fn sync_all(&self) -> Result<()> {
        if self.engine.is_shut_down() {
            return Err(self.engine.shared().refusal(self.ctx(OpKind::Sync, 0)));
        }
        OpFuture::new(
            self.engine.shared().clone(),
            OpRequest::Sync {
                file: self.inner.clone(),
            },
            NoTransfer,
        )
        .await
        .map(|_| ())
    }
}
