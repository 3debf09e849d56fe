//! `gpuio`: check what a machine offers, copy and read files through the engine, and measure
//! throughput fio-style.

mod bench;
mod check;
mod cleanup;
mod cp;
mod load;
mod plot;
mod read;
mod size;
mod soak;
mod stdout;
mod validate;
mod xfer;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "gpuio",
    version,
    about = "Async storage I/O into GPU and host memory"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// What this machine offers for gpuio, and why.
    Check {
        /// A file or directory whose filesystem to examine (default: current directory).
        path: Option<PathBuf>,
    },
    /// Copy SRC to DST through the engine (reads and writes both go through gpuio).
    Cp(cp::CpArgs),
    /// Read a whole file and report throughput and a checksum.
    Read(read::ReadArgs),
    /// Load a checkpoint (a .safetensors file, a model directory or an index file) into GPU
    /// or host memory, whole or across tensor-parallel ranks.
    Load(load::LoadArgs),
    /// Measure read or write throughput, fio-style.
    Bench(Box<bench::BenchArgs>),
    /// Mixed reads and writes checked against a model of the file, on every backend.
    Soak(soak::SoakArgs),
    /// Transfers between two agents (in this process or two), nixlbench-style.
    Xfer(xfer::XferArgs),
}

fn main() -> ExitCode {
    let cli = parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpuio: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(async {
        match cli.cmd {
            Cmd::Check { path } => check::run(path),
            Cmd::Cp(args) => cp::run(args).await,
            Cmd::Read(args) => read::run(args).await,
            Cmd::Load(args) => load::run(args).await,
            Cmd::Bench(args) => bench::run(*args).await,
            Cmd::Soak(args) => soak::run(args).await,
            Cmd::Xfer(args) => xfer::run(args).await,
        }
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout has gone (`gpuio check | head -4`): nothing left to say.
        Err(e) if stdout::is_closed(&*e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuio: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Parses the command line (exits with clap's message on a bad one). Every option that takes
/// a value may take a negative number: otherwise clap reads `--seconds -1` as an unknown flag
/// `-1` ("unexpected argument '-1'"), and the flag's own parser, which names the flag and
/// says the value cannot be negative, never sees it. A value that is not a number but starts
/// with `-` is still read as a flag (`--dir --size` is "a value is required for --dir").
fn parse() -> Cli {
    let cmd = Cli::command().mut_subcommands(|sub| {
        sub.mut_args(|arg| {
            if arg.get_long().is_some() && arg.get_action().takes_values() {
                arg.allow_negative_numbers(true)
            } else {
                arg
            }
        })
    });
    let matches = cmd.get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

type CliResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

fn progress(total: u64) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb
}
