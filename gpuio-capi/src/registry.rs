//! Live handles. A C handle (`gpuio_engine*`, `gpuio_file*`, `gpuio_request*`) is an opaque
//! token, never dereferenced: each kind has a table from token to object, so a closed or freed
//! handle, a handle of another kind or a stray pointer is found missing (an error, not a crash),
//! and a call racing a free on another thread keeps the object alive until it returns.
//!
//! Tokens come from one counter and are never reused, so a freed handle stays detectably dead
//! for the life of the process; they are multiples of 16 so that they look like the aligned
//! pointers C code expects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::status::{Failure, gpuio_status};

/// The next token (times 16); starts at 1 so that no token is null.
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// One kind of handle: `name` is its C type, for messages.
pub(crate) struct Registry<T> {
    name: &'static str,
    live: RwLock<Option<HashMap<u64, Arc<T>>>>,
}

impl<T> Registry<T> {
    pub(crate) const fn new(name: &'static str) -> Self {
        Registry {
            name,
            live: RwLock::new(None),
        }
    }

    /// Registers `object` and returns its token.
    pub(crate) fn insert(&self, object: Arc<T>) -> u64 {
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed) << 4;
        // A poisoned lock only means a panic elsewhere while it was held; the map is intact.
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        live.get_or_insert_with(HashMap::new).insert(token, object);
        token
    }

    /// The object behind `handle`, or why there is none.
    pub(crate) fn get<H>(&self, handle: *const H) -> Result<Arc<T>, Failure> {
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        live.as_ref()
            .and_then(|m| m.get(&(handle.addr() as u64)))
            .cloned()
            .ok_or_else(|| self.missing(handle))
    }

    /// Unregisters `handle` and returns its object (the caller finishes it).
    pub(crate) fn remove<H>(&self, handle: *const H) -> Result<Arc<T>, Failure> {
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        live.as_mut()
            .and_then(|m| m.remove(&(handle.addr() as u64)))
            .ok_or_else(|| self.missing(handle))
    }

    fn missing<H>(&self, handle: *const H) -> Failure {
        if handle.is_null() {
            Failure::new(
                gpuio_status::GPUIO_ERR_INVALID,
                format!("{} is a null pointer", self.name),
            )
        } else {
            Failure::new(
                gpuio_status::GPUIO_ERR_BAD_HANDLE,
                format!(
                    "{handle:p} is not a live {}: closed, freed, or never returned by gpuio",
                    self.name
                ),
            )
        }
    }
}
