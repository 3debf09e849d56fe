//! Lines to stdout that survive a reader who stops reading (`gpuio check | head -4`).
//!
//! `println!` panics when stdout is a pipe whose reader has gone (Rust ignores SIGPIPE, so the
//! write fails with EPIPE and `println!` turns that into a panic). The CLI writes its lines
//! with [`outln!`] instead, which hands back an error the commands propagate with `?`; `main`
//! ends quietly, with success, on [`StdoutClosed`]. Going up the stack (rather than exiting on
//! the spot, or restoring SIGPIPE's default action, which kills the process) runs every
//! destructor on the way: temporary files are removed and engines shut down. Leaving SIGPIPE
//! ignored also keeps it from killing the process for a socket write (NVMe/TCP through SPDK
//! runs in this process).

use std::io::Write;

/// Stdout's reader has gone: nobody wants the rest of the output.
#[derive(Debug)]
pub struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stdout was closed by its reader")
    }
}

impl std::error::Error for StdoutClosed {}

/// Writes one line to stdout. A broken pipe comes back as [`StdoutClosed`]; any other failure
/// (a full disk behind a redirection, say) as the I/O error, which the command reports.
pub fn line(args: std::fmt::Arguments<'_>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut out = std::io::stdout().lock();
    // Stdout is line-buffered, so the newline flushes: the failure shows up at this line.
    match out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(Box::new(StdoutClosed)),
        Err(e) => Err(format!("writing to stdout: {e}").into()),
    }
}

/// Whether `e` says stdout's reader went away (the command then ends quietly).
pub fn is_closed(e: &(dyn std::error::Error + 'static)) -> bool {
    e.is::<StdoutClosed>()
}

/// `println!` that returns `Err(StdoutClosed)` instead of panicking on a broken pipe.
macro_rules! outln {
    () => {
        $crate::stdout::line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::stdout::line(format_args!($($arg)*))
    };
}
pub(crate) use outln;
