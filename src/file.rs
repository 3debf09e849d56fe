//! [`File`]: an open file (or block device) bound to an [`Engine`], and its async operations.

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;

use crate::buf::{IoBuf, IoBufMut, ReadDst, ReadTarget, WriteSource, WriteSrc};
use crate::engine::Engine;
use crate::error::{Context, Error, OpKind, Result};
use crate::op::future::{Either, NoTransfer, OpFuture, Transfer};
use crate::op::read::{HostCopyOut, ReadInto};
use crate::op::request::{DeviceHint, OpRequest};
use crate::op::write::{HostFill, WriteFrom};
use crate::plan::MAX_POS;
use crate::plan::align::{self, DirectAlignment};
#[cfg(feature = "cuda")]
use crate::target::GdsMode;
use crate::target::{Access, Target};

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
            .map(crate::op::to_usize)
    }
}

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

/// An open file on an [`Engine`]. Cheap to clone; `Send + Sync`; all I/O methods take `&self`,
/// so one file can serve many concurrent operations.
#[derive(Clone)]
pub struct File {
    inner: Arc<Target>,
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
        // A forked child refuses here, before any cuFile registration or stream work starts.
        if self.engine.shared().reactor.refuses_work() {
            return Err(self.engine.shared().reactor.refusal(self.ctx(op, offset)));
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
                        pending: crate::op::request::PendingWrite::new(
                            &shared.writes_pending,
                            &self.inner.fence_key,
                        ),
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
                Either::Device(crate::op::device::DeviceCopyOut {
                    dst,
                    offset,
                    stream: None,
                    error: None,
                    combine: None,
                })
            }
        };
        let inner = self.start(OpKind::Read, offset, len, device, transfer);
        // A small read of a buffered file may be served from the page cache at first poll
        // (`op::cached`): only a valid request the reactor would otherwise take.
        let t = &self.inner;
        let shared = self.engine.shared();
        let cached = (inner.is_unsent()
            && len <= crate::op::cached::CACHED_READ_MAX
            && shared.policy.cached_fast_path
            && t.nvme.is_none()
            && t.dio.is_none()
            && t.fd.is_some())
        .then_some(&**t);
        ReadInto { inner, cached }
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
        use crate::op::OpShared;
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
            crate::op::stream::enqueue(
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
        // cudarc frees on the memory's own stream: make it wait for the operation too.
        crate::cuda::memops::order_after(stream, own, None).map_err(|e| Error::cuda(ctx(), e))?;
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
                Either::Device(crate::op::device::DeviceFill {
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
            owned: Some(crate::op::request::OwnedTarget {
                addr,
                keep: owned.into_any(),
            }),
        };
        let mut fut = OpFuture::new(
            self.engine.shared().clone(),
            req,
            crate::op::read::OwnedReturn::default(),
        );
        let r = (&mut fut).await;
        let back = fut.transfer_mut().back.take();
        let owned = back
            .and_then(|b| crate::buf::owned::OwnedHostBuf::<B>::from_any(b, kind))
            // The reactor kept the buffer because the kernel may still write it (it died
            // with the read in flight): an empty buffer of the same kind comes back.
            .unwrap_or_else(|| crate::buf::owned::OwnedHostBuf::empty(kind));
        (crate::op::to_usize(r), owned)
    }

    /// Writes an owned buffer (its whole length) and hands it back with the result.
    pub async fn write_owned<B: IoBuf>(&self, buf: B, offset: u64) -> (Result<usize>, B) {
        let r = self.write_from(&buf, offset).await;
        (r, buf)
    }

    /// Flushes data and metadata to stable storage (`fsync`).
    pub async fn sync_all(&self) -> Result<()> {
        if self.engine.shared().reactor.refuses_work() {
            return Err(self
                .engine
                .shared()
                .reactor
                .refusal(self.ctx(OpKind::Sync, 0)));
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
