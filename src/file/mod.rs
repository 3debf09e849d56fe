//! [`File`]: an open file (or block device) bound to an [`Engine`], and its async operations.
//! Opening (`OpenOptions`) is in `open.rs`, stream-ordered cuFile I/O in `stream.rs`.

mod open;
#[cfg(feature = "cuda")]
mod stream;

pub use open::OpenOptions;
#[cfg(feature = "cuda")]
pub use stream::StreamIo;

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Arc;

use crate::buf::{IoBuf, IoBufMut, ReadDst, ReadTarget, WriteSource, WriteSrc};
use crate::engine::{Engine, Route};
use crate::error::{Context, Error, OpKind, Result};
use crate::op::future::{Either, NoTransfer, OpFuture, Transfer};
use crate::op::read::{CopyOut, HostCopyOut, ReadInto, ReadSource};
use crate::op::request::{DeviceHint, OpRequest};
use crate::op::write::{HostFill, WriteFrom};
use crate::plan::MAX_POS;
use crate::plan::align::{self, DirectAlignment};
use crate::target::Target;

/// An open file on an [`Engine`]. Cheap to clone; `Send + Sync`; all I/O methods take `&self`,
/// so one file can serve many concurrent operations.
#[derive(Clone)]
pub struct File {
    inner: Arc<Target>,
    engine: Engine,
}

impl File {
    /// What the file reads and writes (tests of the routing between reactors).
    #[cfg(test)]
    pub(crate) fn target_arc(&self) -> &Arc<Target> {
        &self.inner
    }
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
                let route = match op {
                    OpKind::Read => Route::Read,
                    _ => Route::Home,
                };
                let (engine, home) = self.engine.reactor_for(&self.inner, route);
                OpFuture::new(engine.clone(), req, transfer).with_home(home)
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
        let transfer = match target {
            ReadTarget::Host(dst) => Either::Host(HostCopyOut { dst, offset }),
            #[cfg(feature = "cuda")]
            ReadTarget::Device(dst) => {
                Either::Device(crate::op::device::DeviceCopyOut::new(dst, offset))
            }
        };
        // A read of a buffered file may be served from the page cache in poll (`op::cached`:
        // up to 64 KiB into device memory, up to `page_cache_read_max` into host memory), and
        // a large one into device memory may be handed to the mapped reads' registrar
        // (`op::mapped`); the op is built only if neither happens.
        let t = &self.inner;
        let policy = &self.engine.shared().policy;
        let buffered = t.nvme.is_none() && t.dio.is_none() && t.fd.is_some();
        let cached_max = policy.cached_read_max(matches!(transfer, Either::Host(_)));
        let cached = len > 0 && len <= cached_max && policy.cached_fast_path;
        #[cfg(feature = "cuda")]
        let mapped = policy.mapped_reads
            && len >= crate::cuda::mapped::MAPPED_READ_MIN
            && matches!(transfer, Either::Device(_));
        #[cfg(not(feature = "cuda"))]
        let mapped = false;
        if buffered && (cached || mapped) {
            ReadInto::first_poll(self, offset, transfer)
        } else {
            ReadInto::op(self.start_read(offset, transfer))
        }
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
                if !self.lands_in_place(offset, len, addr) {
                    let r = self.read_into(owned.as_mut_slice(), offset).await;
                    return (r, owned.into_original());
                }
                let kind = owned.kind();
                // SAFETY: `owned`'s heap memory is `addr..addr + len`, it moves with the box
                // (moving a `Vec`, `BytesMut` or `AlignedBuf` leaves its memory where it is),
                // and nothing else can reach it while the engine holds the box.
                let (r, back) =
                    unsafe { self.read_in_place(offset, len, addr, owned.into_any()) }.await;
                let owned = back
                    .and_then(|b| crate::buf::owned::OwnedHostBuf::<B>::from_any(b, kind))
                    // The reactor kept the buffer because the kernel may still write it (it
                    // died with the read in flight): an empty buffer of the same kind comes back.
                    .unwrap_or_else(|| crate::buf::owned::OwnedHostBuf::empty(kind));
                (r, owned.into_original())
            }
            Err(mut buf) => {
                let r = self.read_into(&mut buf, offset).await;
                (r, buf)
            }
        }
    }

    /// Reads `dst.len()` bytes at `offset` into host memory `dst`, blocking the calling thread
    /// until they have landed; returns the bytes read, fewer only at end of file.
    ///
    /// Where the read can land in place (see [`read_owned`](Self::read_owned): buffered files,
    /// and O_DIRECT files with offset, length and `dst` aligned), the kernel writes `dst`
    /// itself, as for an owned buffer: the call lends `dst` to the engine and returns only once
    /// no read holds it, so no bounce slot and no copy on this thread are needed, and large
    /// reads are copied out of the page cache by several of io_uring's workers at once. Reads
    /// of a buffered file up to the engine's `page_cache_read_max` take
    /// [`read_into`](Self::read_into)'s path (a cached range is copied in this thread at once),
    /// and so do all reads of buffered files on engines with fewer than
    /// [`LEND_MIN_COPIES`](crate::plan::sizing::LEND_MIN_COPIES) page-cache copies, where the
    /// calling thread's copy out of bounce slots is worth more than the copy it saves.
    ///
    /// For synchronous callers (a C or Python binding, a thread of its own). Do not call it
    /// from an async task: it blocks the runtime's thread until the read is done. If the
    /// engine's reactor dies with this read in the kernel, the process aborts (the kernel may
    /// write `dst` at any time then, and nothing says when it stops).
    pub fn read_into_blocking(&self, dst: &mut [u8], offset: u64) -> Result<usize> {
        let len = dst.len();
        let policy = &self.engine.shared().policy;
        let buffered_by_bounce = self.inner.dio.is_none()
            && (len <= policy.cached_read_max(true) || !policy.lend_buffered);
        if buffered_by_bounce || !self.lands_in_place(offset, len, dst.as_ptr() as usize) {
            return crate::op::blocking::block_on(self.read_into(dst, offset));
        }
        let read = |region: Arc<crate::buf::region::HostRegion>| async move {
            let addr = region.addr(0);
            // SAFETY: the region (moved into the op as its owned buffer) keeps
            // `addr..addr + len`, all of `dst`, lent to the engine until it is given back or
            // dropped (`op::blocking::lend` returns only then); nothing else touches `dst`
            // meanwhile, and `lands_in_place` holds.
            unsafe { self.read_in_place(offset, len, addr, Box::new(region)) }
                .await
                .0
        };
        crate::op::blocking::lend(dst, read, crate::op::blocking::block_on)
    }

    /// Whether a read of `len` bytes at `offset` into host memory at `addr` can land in place
    /// (the kernel writing that memory itself): not on an NVMe namespace, and for O_DIRECT
    /// files with offset, length and address aligned to the file's alignment.
    pub(crate) fn lands_in_place(&self, offset: u64, len: usize, addr: usize) -> bool {
        let a = self.inner.align.max(1);
        self.inner.nvme.is_none()
            && (a == 1 || (offset % a == 0 && len as u64 % a == 0 && addr as u64 % a == 0))
    }

    /// Tells the kernel this file is read in sequence (`POSIX_FADV_SEQUENTIAL`): a larger
    /// readahead window for what the page cache lacks. For loaders that own the file.
    #[cfg(feature = "safetensors")]
    pub(crate) fn advise_sequential(&self) {
        if let Some(fd) = &self.inner.fd {
            use std::os::fd::AsRawFd;
            // SAFETY: a descriptor this file owns; the advice changes no memory.
            unsafe { libc::posix_fadvise(fd.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
        }
    }

    /// Reads `len` bytes at `offset` straight into host memory at `addr`, which `keep` owns:
    /// the engine holds `keep` until the kernel is done with the memory and hands it back with
    /// the result (`None`: the reactor died with the read in flight and keeps it for good).
    ///
    /// # Safety
    /// `keep` keeps `addr..addr + len` allocated for as long as it lives, wherever it moves;
    /// nothing else reads or writes that memory until `keep` comes back or is dropped; and
    /// [`lands_in_place`](Self::lands_in_place) holds for the read.
    pub(crate) async unsafe fn read_in_place(
        &self,
        offset: u64,
        len: usize,
        addr: usize,
        keep: Box<dyn std::any::Any + Send>,
    ) -> (Result<usize>, Option<Box<dyn std::any::Any + Send>>) {
        if let Err(e) = self.check(OpKind::Read, offset, len) {
            return (Err(e), Some(keep));
        }
        if len == 0 {
            return (Ok(0), Some(keep));
        }
        let req = OpRequest::Read {
            file: self.inner.clone(),
            offset,
            len: len as u64,
            device: None,
            owned: Some(crate::op::request::OwnedTarget { addr, keep }),
        };
        let (engine, home) = self.engine.reactor_for(&self.inner, Route::Read);
        let mut fut = OpFuture::new(engine.clone(), req, crate::op::read::OwnedReturn::default())
            .with_home(home);
        let r = (&mut fut).await;
        let back = fut.transfer_mut().back.take();
        (crate::op::to_usize(r), back)
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
            self.engine.reactor_for(&self.inner, Route::Home).0.clone(),
            OpRequest::Sync {
                file: self.inner.clone(),
            },
            NoTransfer,
        )
        .await
        .map(|_| ())
    }
}

impl ReadSource for File {
    fn target(&self) -> &Target {
        &self.inner
    }

    fn engine_shared(&self) -> &Arc<crate::op::engine_shared::EngineShared> {
        self.engine.shared()
    }

    fn check_read(&self, offset: u64, len: usize) -> Result<()> {
        self.check(OpKind::Read, offset, len)
    }

    fn start_read<'a>(&self, offset: u64, transfer: CopyOut<'a>) -> OpFuture<CopyOut<'a>> {
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut device = None;
        let len = match &transfer {
            Either::Host(h) => h.dst.len(),
            #[cfg(feature = "cuda")]
            Either::Device(d) => {
                device = Some(d.dst.own_stream().context().clone());
                d.dst.byte_len()
            }
            #[cfg(not(feature = "cuda"))]
            Either::Device(_) => 0,
        };
        self.start(OpKind::Read, offset, len, device, transfer)
    }
}
