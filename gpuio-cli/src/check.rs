//! `gpuio check`: what this machine offers, and why (the library's `gpuio::check` report).

use std::path::PathBuf;

use crate::CliResult;
use crate::stdout::outln;

pub fn run(path: Option<PathBuf>) -> CliResult {
    let path = path.unwrap_or_else(|| PathBuf::from("."));
    let report = gpuio::check::report(&path)?;
    outln!("{report}")?;
    Ok(())
}
