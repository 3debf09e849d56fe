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
