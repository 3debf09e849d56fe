//! [`StreamSync`]: waiting for a CUDA stream without blocking a thread.
//!
//! `cuStreamSynchronize` parks the calling thread; on a tokio worker that stalls every task
//! scheduled there. Here an event is recorded on the stream and the engine's reactor polls it
//! (`cuEventQuery`, alongside its other CUDA events) and wakes the future when it completes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use cudarc::driver::CudaStream;

use super::OpShared;
use super::engine_shared::EngineShared;
use super::future::{NoTransfer, OpFuture};
use super::gate::Gated;
use super::msg::{Awaited, Msg, SubmitMsg};
use super::request::OpRequest;
use crate::cuda::event::EventGate;
use crate::error::{Context, Error, OpKind, Result};

/// Future of [`Engine::synchronize`](crate::Engine::synchronize): resolves once the stream has
/// finished everything queued on it before the call. Dropping it only stops the waiting.
#[must_use = "futures do nothing unless awaited"]
pub struct StreamSync {
    inner: OpFuture<NoTransfer>,
}

impl Future for StreamSync {
    type Output = Result<()>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Result<()>> {
        Pin::new(&mut self.inner).poll(cx).map(|r| r.map(drop))
    }
}

/// Records an event on `stream` and hands it to the reactor.
pub(crate) fn start(engine: &Arc<EngineShared>, stream: &CudaStream) -> StreamSync {
    let ctx = || Context::op(OpKind::Sync).with_backend("cuda");
    if engine.reactor.inherited() {
        // A forked child: no CUDA call on the parent's context, no reactor to poll an event.
        let refused = engine.reactor.refusal(ctx());
        return StreamSync {
            inner: OpFuture::ready(engine.clone(), OpKind::Sync, NoTransfer, Err(refused)),
        };
    }
    let ev = stream
        .context()
        .bind_to_thread()
        .and_then(|()| stream.record_event(None));
    let inner = match ev {
        Err(e) => OpFuture::ready(
            engine.clone(),
            OpKind::Sync,
            NoTransfer,
            Err(Error::cuda(ctx(), e)),
        ),
        Ok(ev) => {
            let shared = OpShared::new();
            let gated = Gated::stream_work(
                Box::new(EventGate::new(ev)),
                Msg::Awaited(shared.clone(), Awaited::Idle),
            );
            engine.reactor.send(Msg::Submit(SubmitMsg {
                shared: Some(shared.clone()),
                req: Some(OpRequest::Await {
                    kind: OpKind::Sync,
                    file: None,
                    offset: 0,
                    gated,
                }),
            }));
            OpFuture::running(engine.clone(), OpKind::Sync, NoTransfer, shared)
        }
    };
    StreamSync { inner }
}
