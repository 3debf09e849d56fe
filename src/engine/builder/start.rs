//! Starting one reactor thread of an engine: its bounce pool, doorbell, queue and lanes.

use std::sync::Arc;
use std::sync::mpsc::{channel, sync_channel};

use super::super::reactors::ReactorThread;
use super::super::{Backend, BackendInfo};
use crate::buf::arena::BounceArena;
use crate::error::{Context, Error, OpKind, Result};
use crate::lane::Lane;
use crate::lane::doorbell::Doorbell;
use crate::lane::pread::PreadLane;
use crate::op::engine_shared::{EngineShared, OpPolicy};
use crate::op::msg::{Msg, ReactorHandle};
use crate::reactor::{Reactor, ReactorConfig};
use crate::uring::{UringLane, UringOptions};

/// What each reactor of an engine starts with (its share where the engine's settings are
/// divided between reactors).
pub(super) struct ReactorPlan {
    pub(super) backend: Backend,
    pub(super) spdk_memory: bool,
    /// Bytes of one bounce block.
    pub(super) block: usize,
    /// Blocks in this reactor's pool, and those it may grow by.
    pub(super) slots: usize,
    pub(super) growth: usize,
    pub(super) queue_depth: usize,
    /// Reactors of the engine (side lanes share limits between them).
    pub(super) reactors: usize,
    pub(super) iowq: Option<u32>,
    pub(super) pread_threads: usize,
    pub(super) uring: UringOptions,
    pub(super) cfg: ReactorConfig,
}

impl ReactorPlan {
    /// Starts reactor `index`; a reactor after the first shares the first's registry of
    /// unfinished writes and device stages (`primary`), which the routing relies on.
    pub(super) fn start(
        &self,
        index: usize,
        policy: OpPolicy,
        primary: Option<&Arc<EngineShared>>,
    ) -> Result<(ReactorThread, BackendInfo)> {
        let ctx = || Context::op(OpKind::Setup);
        let arena = Arc::new(if self.spdk_memory {
            BounceArena::new_dma(self.block, self.slots)
                .map_err(|why| Error::unsupported(ctx().with_backend("spdk"), why))?
        } else {
            BounceArena::new(self.block, self.slots, self.growth)
                .map_err(|e| Error::io(ctx().with_backend("bounce pool"), e))?
        });
        let doorbell =
            Arc::new(Doorbell::new().map_err(|e| Error::io(ctx().with_backend("eventfd"), e))?);
        let (tx, rx) = channel::<Msg>();
        let handle = ReactorHandle::new(tx, doorbell.clone());
        let shared = Arc::new(match primary {
            None => EngineShared::new(handle, arena.clone(), policy),
            Some(p) => p.sibling(handle, arena.clone()),
        });
        let (setup_tx, setup_rx) = sync_channel::<Result<BackendInfo>>(1);
        let (backend, qd, iowq, threads, uring) = (
            self.backend,
            self.queue_depth,
            self.iowq,
            self.pread_threads,
            self.uring,
        );
        let cfg = self.cfg.clone();
        let reactors = self.reactors;
        let reactor_shared = shared.clone();
        // Dropped when the reactor thread ends (however it ends): what the engine's drop waits on.
        let (exit_tx, exit_rx) = sync_channel::<()>(0);
        let name = match index {
            0 => "gpuio-reactor".to_string(),
            i => format!("gpuio-reactor{i}"),
        };
        let spawned = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                let _exit = exit_tx;
                let main = match make_main_lane(backend, qd, iowq, threads, &arena, &doorbell, uring)
                {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = setup_tx.send(Err(e));
                        return;
                    }
                };
                let info = BackendInfo {
                    name: main.name(),
                    detail: main.describe(),
                };
                if index == 0 {
                    tracing::info!(backend = info.name, detail = %info.detail, "gpuio engine started");
                }
                let _ = setup_tx.send(Ok(info));
                Reactor::new(rx, main, side_lanes(reactors), reactor_shared, cfg).run_to_end();
            })
            .map_err(|e| Error::io(ctx(), e))?;
        let info = match setup_rx.recv() {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => {
                let _ = spawned.join();
                return Err(e);
            }
            Err(_) => {
                let _ = spawned.join();
                return Err(Error::ReactorDied {
                    ctx: Box::new(ctx()),
                    reason: "reactor thread exited during setup".into(),
                });
            }
        };
        Ok((
            ReactorThread {
                shared,
                thread: Some(spawned),
                exit: std::sync::Mutex::new(exit_rx),
            },
            info,
        ))
    }
}

/// The lanes beside the main one, from the backends this build has: each takes the ops it
/// serves when the reactor asks (`Lane::route`); an unused one costs nothing (cuFile sets its
/// staging pool up on its first op, SPDK its queue pairs on a namespace's first op).
fn side_lanes(
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] reactors: usize,
) -> Vec<Box<dyn crate::lane::Lane>> {
    vec![
        #[cfg(feature = "cuda")]
        Box::new(crate::gds::lane::CufileLane::for_reactor_of(reactors)),
        Box::new(crate::spdk::lane::SpdkLane::new()),
    ]
}

/// The main lane for `backend`: io_uring, or the pread pool (with the reason, where io_uring
/// was wanted but could not be set up).
fn make_main_lane(
    backend: Backend,
    qd: usize,
    iowq: Option<u32>,
    threads: usize,
    arena: &BounceArena,
    doorbell: &Arc<Doorbell>,
    uring_opts: UringOptions,
) -> Result<Box<dyn Lane>> {
    let ctx = || Context::op(OpKind::Setup);
    let uring = || {
        // SAFETY: the arena is kept alive by the reactor (and every op) for longer than the
        // lane, which the reactor drops first.
        unsafe {
            UringLane::new(
                qd as u32,
                iowq,
                &arena.block_iovecs(),
                doorbell.raw_fd(),
                uring_opts,
            )
        }
        .map(|l| Box::new(l) as Box<dyn Lane>)
    };
    let pool = |reason: String| {
        PreadLane::new(threads, doorbell.clone(), reason)
            .map(|l| Box::new(l) as Box<dyn Lane>)
            .map_err(|e| Error::io(ctx().with_backend("pread"), e))
    };
    match backend {
        Backend::Uring => uring().map_err(|e| {
            Error::unsupported(
                ctx().with_backend("io_uring"),
                format!("{e}; use Backend::Auto or Backend::Pread to fall back"),
            )
        }),
        Backend::Pread => pool(String::new()),
        Backend::Auto | Backend::Gds => match uring() {
            Ok(l) => Ok(l),
            Err(e) => {
                let reason = format!("io_uring unavailable: {e}");
                tracing::warn!(%reason, "gpuio falls back to the pread pool");
                pool(reason)
            }
        },
    }
}
