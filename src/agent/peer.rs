//! Peers: agents whose metadata this agent has loaded, and how it reaches them.

use std::sync::{Arc, Weak};

use super::AgentShared;
use super::meta::Metadata;
use super::notif::NotifQueue;

/// A loaded peer. Replacing or removing it leaves transfers already posted to it running;
/// requests prepared against it fail when posted again.
pub(crate) struct Peer {
    pub(crate) name: String,
    pub(crate) meta: Metadata,
    pub(crate) link: Link,
    /// The peer's device registrations mapped through CUDA IPC (a peer process on this
    /// host), by their index in its metadata; empty otherwise.
    pub(crate) ipc: Vec<Option<IpcMap>>,
    /// A peer process on this host whose host memory this process may copy with
    /// `process_vm_readv`/`writev` (probed once, at `add_peer`).
    pub(crate) cross_memory: bool,
}

/// A peer's device registration mapped into this process.
#[cfg(feature = "cuda")]
pub(crate) type IpcMap = crate::cuda::ipc::IpcMapping;
/// Without CUDA nothing is mapped.
#[cfg(not(feature = "cuda"))]
pub(crate) type IpcMap = std::convert::Infallible;

impl Peer {
    pub(crate) fn ipc_mapping(&self, k: usize) -> Option<&IpcMap> {
        self.ipc.get(k).and_then(Option::as_ref)
    }
}

/// Maps every device registration in `meta` that exports a CUDA IPC handle; one that cannot
/// be opened (a GPU this process cannot see) is reached through UCX instead.
pub(crate) fn open_ipc(meta: &Metadata) -> Vec<Option<IpcMap>> {
    #[cfg(feature = "cuda")]
    {
        meta.regs
            .iter()
            .map(|r| {
                if r.ipc.is_empty() {
                    return None;
                }
                match crate::cuda::ipc::IpcMapping::open(&r.ipc) {
                    Ok(m) => Some(m),
                    Err(e) => {
                        tracing::info!(
                            "agent {:?} registration {}: no CUDA IPC: {e}",
                            meta.name,
                            r.id
                        );
                        None
                    }
                }
            })
            .collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = meta;
        Vec::new()
    }
}

/// How bytes reach a peer.
pub(crate) enum Link {
    /// An agent in this process: its registrations are checked live, copies go straight
    /// between the two agents' memory, notifications straight into its queue.
    Local {
        agent: Weak<AgentShared>,
        notifs: Arc<NotifQueue>,
    },
    /// An agent in another process or on another host, over UCX.
    Remote(super::remote::RemotePeer),
}
