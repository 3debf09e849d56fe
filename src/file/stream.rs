//! Stream-ordered cuFile I/O on a file (`cuFileReadAsync`/`cuFileWriteAsync`): the read or
//! write is queued on a CUDA stream, and [`StreamIo`] reports its result once the stream has
//! passed it.

use std::sync::Arc;

use super::File;
use crate::buf::{ReadDst, ReadTarget, WriteSource, WriteSrc};
use crate::error::{Error, OpKind, Result};
use crate::op::future::{NoTransfer, OpFuture};

/// Future of a stream-ordered cuFile operation ([`File::read_on_stream`],
/// [`File::write_on_stream`]): bytes moved, once the stream has passed the operation.
#[must_use = "the operation runs anyway; the future only reports its result"]
pub struct StreamIo {
    inner: OpFuture<NoTransfer>,
}

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

impl File {
    /// Reads `dst`'s length in bytes at `offset` into device memory **as work on `stream`**
    /// (`cuFileReadAsync`): the read is queued now, runs when the stream reaches it, and
    /// kernels queued on `stream` afterwards see the data. The returned future resolves to the
    /// bytes read once the stream has passed the read (await it, or drop it: the read still
    /// happens). Needs a file cuFile serves ([`File::gds_status`]); otherwise
    /// [`Error::Unsupported`] says why. `dst` may be borrowed again as soon as this returns:
    /// every later use of it through cudarc is ordered after the read.
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
        // Stream-ordered ops stay on the file's home reactor, with its writes.
        let engine = self
            .engine
            .reactor_for(&self.inner, crate::engine::Route::Home)
            .0
            .clone();
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
}
