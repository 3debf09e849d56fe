//! The crate's one error type.
//!
//! Every error carries a [`Context`]: the operation, the path, the byte offset and the
//! backend that served it, so a log line alone says what failed where.

use std::fmt;
use std::io;
use std::path::Path;
use std::sync::Arc;

/// Result alias used throughout gpuio.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The operation an error belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpKind {
    /// Opening or creating a file.
    Open,
    /// A read.
    Read,
    /// A write.
    Write,
    /// `fsync`.
    Sync,
    /// A metadata query (`len`, alignment).
    Stat,
    /// Starting the engine.
    Setup,
    /// Stopping the engine.
    Shutdown,
    /// Examining the machine and a path (`gpuio check`).
    Check,
    /// Preparing device memory for a transfer (the CUDA context, the range's allocation).
    DeviceMemory,
    /// An agent's own work: registering memory, metadata, peers, notifications.
    Agent,
    /// A transfer between agents' memory.
    Transfer,
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OpKind::Open => "open",
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Sync => "sync",
            OpKind::Stat => "stat",
            OpKind::Setup => "engine setup",
            OpKind::Shutdown => "engine shutdown",
            OpKind::Check => "check",
            OpKind::DeviceMemory => "device memory",
            OpKind::Agent => "agent",
            OpKind::Transfer => "transfer",
        })
    }
}

/// Where an error happened: operation, path, offset and backend.
#[derive(Debug, Clone)]
pub struct Context {
    /// The operation.
    pub op: OpKind,
    /// The file, where there is one.
    pub path: Option<Arc<Path>>,
    /// The byte offset of the request, where there is one.
    pub offset: Option<u64>,
    /// The backend that served (or would have served) the request, e.g. `io_uring`.
    pub backend: Option<&'static str>,
    /// The peer agent, for transfers and notifications between agents.
    pub peer: Option<Arc<str>>,
}

impl Context {
    /// A context naming only the operation.
    pub fn op(op: OpKind) -> Self {
        Context {
            op,
            path: None,
            offset: None,
            backend: None,
            peer: None,
        }
    }

    pub(crate) fn with_path(mut self, path: &Arc<Path>) -> Self {
        self.path = Some(path.clone());
        self
    }

    pub(crate) fn with_offset(mut self, offset: u64) -> Self {
        self.offset = Some(offset);
        self
    }

    pub(crate) fn with_backend(mut self, backend: &'static str) -> Self {
        self.backend = Some(backend);
        self
    }

    pub(crate) fn with_peer(mut self, peer: &str) -> Self {
        self.peer = Some(peer.into());
        self
    }
}

impl fmt::Display for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.op)?;
        if let Some(p) = &self.path {
            write!(f, " {}", p.display())?;
        }
        if let Some(o) = self.offset {
            write!(f, " at offset {o}")?;
        }
        if let Some(p) = &self.peer {
            write!(f, " (peer {p:?})")?;
        }
        if let Some(b) = self.backend {
            write!(f, " via {b}")?;
        }
        Ok(())
    }
}

/// Everything that can go wrong in gpuio.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The operating system (or the kernel, through an io_uring completion) reported an error.
    #[error("{ctx}: {source}")]
    Io {
        /// Where.
        ctx: Box<Context>,
        /// The OS error; negative completion results become `from_raw_os_error(-res)`.
        #[source]
        source: io::Error,
    },
    /// The request itself is invalid (overflowing range, wrong access mode, bad setting).
    #[error("{ctx}: invalid input: {reason}")]
    InvalidInput {
        /// Where.
        ctx: Box<Context>,
        /// What is wrong with it.
        reason: String,
    },
    /// A read that needed every byte (`read_exact_at`, `BatchResult::exact`) reached the end
    /// of the file first. Reads as "read PATH at offset O via B: unexpected end of file:
    /// wanted N bytes, got M".
    #[error("{ctx}: unexpected end of file: wanted {wanted} bytes, got {got}")]
    UnexpectedEof {
        /// Where: the file and the offset the read started at.
        ctx: Box<Context>,
        /// Bytes requested from that offset.
        wanted: u64,
        /// Bytes read from that offset before the file ended (not the file's size).
        got: u64,
    },
    /// The machine, the file or the build does not offer what was asked for.
    #[error("{ctx}: unsupported: {reason}")]
    Unsupported {
        /// Where.
        ctx: Box<Context>,
        /// Why, and what to do about it where known.
        reason: String,
    },
    /// The engine was shut down before or while the operation ran.
    #[error("{ctx}: the engine has shut down")]
    Shutdown {
        /// Where.
        ctx: Box<Context>,
    },
    /// A CUDA driver call failed.
    #[error("{ctx}: CUDA: {reason}")]
    Cuda {
        /// Where.
        ctx: Box<Context>,
        /// The driver's error.
        reason: String,
    },
    /// No bounce memory came free for [`EngineBuilder::pool_wait_limit`] while nothing in flight
    /// could return any: futures that stopped polling (leaked with `mem::forget`, or never
    /// polled again) hold the whole pool, grown to its limit. The request would otherwise
    /// wait for good; the engine keeps serving once memory comes back.
    ///
    /// [`EngineBuilder::pool_wait_limit`]: crate::EngineBuilder::pool_wait_limit
    #[error(
        "{ctx}: no bounce memory came free within the engine's pool_wait_limit: all {pool} \
         bytes of the pool are held by operations whose data landed but whose futures did \
         not take it in that time (leaked with mem::forget, never polled again, or polled \
         more slowly than the limit allows); drop or poll them, raise pool_wait_limit, or \
         build the engine with a larger bounce_slots/bounce_growth"
    )]
    PoolExhausted {
        /// Where.
        ctx: Box<Context>,
        /// Bytes of bounce memory the engine has (the pool and its growth).
        pool: usize,
    },
    /// The reactor thread died (panicked); the engine is unusable.
    #[error("{ctx}: the reactor thread died: {reason}")]
    ReactorDied {
        /// Where.
        ctx: Box<Context>,
        /// The panic message, where there was one.
        reason: String,
    },
}

impl Error {
    pub(crate) fn io(ctx: Context, source: io::Error) -> Self {
        Error::Io {
            ctx: Box::new(ctx),
            source,
        }
    }

    /// An error from a negative io_uring completion result (`-errno`).
    pub(crate) fn from_cqe(ctx: Context, res: i32) -> Self {
        Error::io(ctx, io::Error::from_raw_os_error(-res))
    }

    pub(crate) fn invalid(ctx: Context, reason: impl Into<String>) -> Self {
        Error::InvalidInput {
            ctx: Box::new(ctx),
            reason: reason.into(),
        }
    }

    pub(crate) fn unsupported(ctx: Context, reason: impl Into<String>) -> Self {
        Error::Unsupported {
            ctx: Box::new(ctx),
            reason: reason.into(),
        }
    }

    /// An error from the CUDA driver.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda(ctx: Context, e: cudarc::driver::DriverError) -> Self {
        Error::cuda_msg(ctx, format!("{e:?}"))
    }

    pub(crate) fn cuda_msg(ctx: Context, reason: impl Into<String>) -> Self {
        Error::Cuda {
            ctx: Box::new(ctx),
            reason: reason.into(),
        }
    }

    pub(crate) fn shutdown(ctx: Context) -> Self {
        Error::Shutdown { ctx: Box::new(ctx) }
    }

    /// The same error for another party (one failed read shared by several batch items):
    /// same variant, context and message; an OS error keeps its errno.
    pub(crate) fn duplicate(&self) -> Self {
        match self {
            Error::Io { ctx, source } => Error::Io {
                ctx: ctx.clone(),
                source: match source.raw_os_error() {
                    Some(errno) => io::Error::from_raw_os_error(errno),
                    None => io::Error::new(source.kind(), source.to_string()),
                },
            },
            Error::InvalidInput { ctx, reason } => Error::InvalidInput {
                ctx: ctx.clone(),
                reason: reason.clone(),
            },
            Error::UnexpectedEof { ctx, wanted, got } => Error::UnexpectedEof {
                ctx: ctx.clone(),
                wanted: *wanted,
                got: *got,
            },
            Error::Unsupported { ctx, reason } => Error::Unsupported {
                ctx: ctx.clone(),
                reason: reason.clone(),
            },
            Error::Shutdown { ctx } => Error::Shutdown { ctx: ctx.clone() },
            Error::PoolExhausted { ctx, pool } => Error::PoolExhausted {
                ctx: ctx.clone(),
                pool: *pool,
            },
            Error::Cuda { ctx, reason } => Error::Cuda {
                ctx: ctx.clone(),
                reason: reason.clone(),
            },
            Error::ReactorDied { ctx, reason } => Error::ReactorDied {
                ctx: ctx.clone(),
                reason: reason.clone(),
            },
        }
    }

    /// The context of this error.
    pub fn context(&self) -> &Context {
        match self {
            Error::Io { ctx, .. }
            | Error::InvalidInput { ctx, .. }
            | Error::UnexpectedEof { ctx, .. }
            | Error::Unsupported { ctx, .. }
            | Error::Shutdown { ctx }
            | Error::PoolExhausted { ctx, .. }
            | Error::Cuda { ctx, .. }
            | Error::ReactorDied { ctx, .. } => ctx,
        }
    }

    /// The `errno` behind an [`Error::Io`], if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// The [`io::ErrorKind`] this error maps to.
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            Error::Io { source, .. } => source.kind(),
            Error::InvalidInput { .. } => io::ErrorKind::InvalidInput,
            Error::UnexpectedEof { .. } => io::ErrorKind::UnexpectedEof,
            Error::Unsupported { .. } => io::ErrorKind::Unsupported,
            Error::Shutdown { .. } | Error::ReactorDied { .. } => io::ErrorKind::BrokenPipe,
            Error::Cuda { .. } => io::ErrorKind::Other,
            Error::PoolExhausted { .. } => io::ErrorKind::OutOfMemory,
        }
    }
}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        io::Error::new(e.kind(), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_op_path_offset_backend() {
        let path: Arc<Path> = Arc::from(Path::new("/data/x.bin"));
        let e = Error::from_cqe(
            Context::op(OpKind::Read)
                .with_path(&path)
                .with_offset(4096)
                .with_backend("io_uring"),
            -libc::EIO,
        );
        let s = e.to_string();
        assert!(
            s.starts_with("read /data/x.bin at offset 4096 via io_uring: "),
            "{s}"
        );
        assert_eq!(e.raw_os_error(), Some(libc::EIO));
        let io: io::Error = e.into();
        assert_eq!(io.kind(), io::Error::from_raw_os_error(libc::EIO).kind());
        assert!(io.to_string().contains("/data/x.bin"));
    }

    #[test]
    fn kinds_map_to_io_kinds() {
        let ctx = || Context::op(OpKind::Read);
        assert_eq!(
            io::Error::from(Error::invalid(ctx(), "x")).kind(),
            io::ErrorKind::InvalidInput
        );
        assert_eq!(
            io::Error::from(Error::unsupported(ctx(), "x")).kind(),
            io::ErrorKind::Unsupported
        );
        assert_eq!(
            io::Error::from(Error::shutdown(ctx())).kind(),
            io::ErrorKind::BrokenPipe
        );
    }
}
