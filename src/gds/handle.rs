//! [`GdsHandle`]: a file descriptor registered with cuFile, deregistered exactly once.

use std::os::fd::{AsRawFd, OwnedFd};

use super::result::{CufileCode, cufile};
use super::sys::RawHandle;

/// A cuFile registration of an O_DIRECT descriptor it owns. Kept alive (inside the file) by
/// every operation until that operation's I/O has completed, so deregistration never races
/// with I/O.
pub(crate) struct GdsHandle {
    raw: RawHandle,
    /// Kept open for the registration's life; closed after `Drop` deregisters.
    _fd: OwnedFd,
}

// SAFETY: a cuFile handle may be used from any thread; gpuio only deregisters it in Drop.
unsafe impl Send for GdsHandle {}
// SAFETY: as above; cuFile I/O calls on one handle may run concurrently.
unsafe impl Sync for GdsHandle {}

/// Why a file did not register.
#[derive(Debug, Clone)]
pub(crate) enum RegisterError {
    /// cuFile itself is unusable.
    Unavailable(String),
    /// cuFile refused this descriptor.
    Refused(CufileCode),
}

impl std::fmt::Display for RegisterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegisterError::Unavailable(s) => f.write_str(s),
            RegisterError::Refused(c) => {
                write!(f, "cuFileHandleRegister refused the file: {c}")?;
                if c.err == 5027 || c.err == 5030 {
                    f.write_str(
                        " (cuFile reads the filesystem type from the udev database; without \
                         /run/udev/data for the backing device, as in most containers, it \
                         refuses every file: see `gpuio check PATH`)",
                    )?;
                }
                Ok(())
            }
        }
    }
}

impl GdsHandle {
    /// Registers `fd` (opened with O_DIRECT) with cuFile.
    pub(crate) fn register(fd: OwnedFd) -> Result<Self, RegisterError> {
        let cf = cufile().map_err(RegisterError::Unavailable)?;
        // SAFETY: the descriptor outlives the registration: it is moved into the handle and
        // closed only after deregistration.
        let raw = unsafe { cf.handle_register(fd.as_raw_fd()) }.map_err(RegisterError::Refused)?;
        Ok(GdsHandle { raw, _fd: fd })
    }

    pub(crate) fn raw(&self) -> RawHandle {
        self.raw
    }
}

impl Drop for GdsHandle {
    fn drop(&mut self) {
        if let Ok(cf) = cufile() {
            // SAFETY: `raw` was registered by `register` and is deregistered only here; no I/O
            // uses it any more (every op holds the file, hence this handle, until its I/O is
            // done). The descriptor closes after this, when `_fd` drops.
            unsafe { cf.handle_deregister(self.raw) };
        }
    }
}
