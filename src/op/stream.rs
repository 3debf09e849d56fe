//! Stream-ordered cuFile I/O (`cuFileReadAsync` / `cuFileWriteAsync`): the transfer is queued
//! on a CUDA stream like a kernel launch and runs when the stream reaches it.
//!
//! cuFile reads the size, offsets and result slot through pointers when the stream executes
//! the operation, so those live in a heap block the reactor owns until a CUDA event recorded
//! right behind the operation has completed (polled, never waited on); only then is the
//! bytes-done value read (errors arrive there) and the block freed. If that event never
//! completes, the block is leaked, never freed.

use std::sync::Arc;

use cudarc::driver::CudaStream;

use super::OpShared;
use super::engine_shared::EngineShared;
use super::gate::Gated;
use super::msg::{Awaited, Msg, SubmitMsg};
use super::request::OpRequest;
use crate::cuda::event::EventGate;
use crate::error::{Context, Error, OpKind, Result};
use crate::gds::result::{CufileCode, StreamParams, cufile};
use crate::target::Target;

/// A finished stream operation, handed to the reactor behind its event.
pub(crate) struct StreamDone {
    pub(crate) params: Box<StreamParams>,
    pub(crate) file: Arc<Target>,
    pub(crate) op: OpKind,
    pub(crate) offset: u64,
}

impl StreamDone {
    /// The operation's result, read once its event has completed.
    pub(crate) fn result(&self) -> Result<u64> {
        let n = self.params.bytes_done;
        if n >= 0 {
            let n = n as u64;
            if self.op == OpKind::Write && n < self.params.size as u64 {
                return Err(Error::io(
                    self.ctx(),
                    std::io::Error::new(
                        std::io::ErrorKind::WriteZero,
                        format!("cuFileWriteAsync wrote {n} of {} bytes", self.params.size),
                    ),
                ));
            }
            return Ok(n);
        }
        let code = (-n) as i32;
        if code >= 5000 {
            Err(Error::cuda_msg(
                self.ctx(),
                format!(
                    "cuFile stream I/O failed: {}",
                    CufileCode {
                        err: code,
                        cu_err: 0
                    }
                ),
            ))
        } else if n == -1 {
            Err(Error::cuda_msg(self.ctx(), "cuFile stream I/O failed (-1)"))
        } else {
            Err(Error::io(
                self.ctx(),
                std::io::Error::from_raw_os_error(code),
            ))
        }
    }

    fn ctx(&self) -> Context {
        Context::op(self.op)
            .with_path(&self.file.path)
            .with_offset(self.offset)
            .with_backend("cufile-stream")
    }
}

/// Queues a stream-ordered read (`write == false`: file to device) or write of `len` bytes
/// between file offset `offset` and device pointer `dptr` on `stream`, and hands the reactor
/// the message that completes `shared` once the stream has passed it.
///
/// # Safety
/// `[dptr, dptr + len)` must be device memory that every later use is ordered after `stream`'s
/// current position (the caller records cudarc's event for it right after this returns);
/// `file` must carry a registered cuFile handle.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn enqueue(
    engine: &Arc<EngineShared>,
    file: &Arc<Target>,
    stream: &Arc<CudaStream>,
    dptr: u64,
    len: usize,
    offset: u64,
    write: bool,
    shared: &Arc<OpShared>,
) -> Result<()> {
    let op = if write { OpKind::Write } else { OpKind::Read };
    let ctx = || {
        Context::op(op)
            .with_path(&file.path)
            .with_offset(offset)
            .with_backend("cufile-stream")
    };
    let cf = cufile().map_err(|e| Error::unsupported(ctx(), e))?;
    let gds = file
        .gds()
        .ok_or_else(|| Error::unsupported(ctx(), "the file is not registered with cuFile"))?;
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| Error::cuda(ctx(), e))?;
    let mut params = Box::new(StreamParams {
        size: len,
        file_offset: offset as i64,
        buf_offset: 0,
        bytes_done: 0,
    });
    let p: *mut StreamParams = &mut *params;
    // SAFETY: the handle is registered (held by `file`, which the completion message keeps
    // alive); the device range is valid per this function's contract; the parameter block is
    // heap memory that lives until the event behind the operation completes (or is leaked).
    let rc = unsafe {
        cf.stream_io(
            write,
            gds.handle.raw(),
            dptr,
            p,
            stream.cu_stream() as *mut _,
        )
    };
    rc.map_err(|c| Error::cuda_msg(ctx(), format!("cuFile stream I/O: {c}")))?;
    let done = StreamDone {
        params,
        file: file.clone(),
        op,
        offset,
    };
    match stream.record_event(None) {
        Ok(ev) => {
            let gated = Gated::stream_work(
                Box::new(EventGate::new(ev)),
                Msg::Awaited(shared.clone(), Awaited::Stream(done)),
            );
            engine.reactor.send(Msg::Submit(SubmitMsg {
                shared: Some(shared.clone()),
                req: Some(OpRequest::Await {
                    kind: op,
                    file: Some(file.clone()),
                    offset,
                    gated,
                }),
            }));
            Ok(())
        }
        Err(e) => {
            // The operation is queued but nothing can say when it ends: keep its parameters
            // (and the file's registration) forever.
            crate::buf::quarantine::hold(
                "a cuFile stream operation's parameter block (no event could be recorded behind it)",
                done,
            );
            Err(Error::cuda(ctx(), e))
        }
    }
}
