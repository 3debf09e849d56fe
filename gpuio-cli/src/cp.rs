//! `gpuio cp SRC DST`: copy one file through the engine, safely.
//!
//! What a plain `open(DST, O_TRUNC)` + parallel writes got wrong, and what this does instead:
//! - `cp a a` (or through a symlink, a hard link, `./a`) emptied the file before reading it:
//!   source and destination are compared by device and inode first, before anything is
//!   opened for writing.
//! - pieces complete out of order, so an interrupted or failed copy left a destination of
//!   the right length with zero-filled holes inside: the copy goes into a temporary file
//!   beside the destination (`.DST.gpuio-tmp-XXXXXXXXXX`), which is fsynced and renamed into
//!   place only when complete, and removed on failure or SIGINT/SIGTERM (see `cleanup`).
//!   A block device destination is written in place: it cannot be renamed over.
//! - the new file got the default mode (a 0600 key became 0644): it gets the source's
//!   permission bits less the umask, as coreutils' `cp` gives a new file; an existing
//!   destination keeps its own mode (and owner, where we may set it), as with coreutils,
//!   whose in-place write never changes them.
//! - a sparse source became dense: only the source's data extents (SEEK_DATA/SEEK_HOLE) are
//!   copied, and the destination's length is set with ftruncate, so holes stay holes.

use crate::stdout::outln;
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use futures::StreamExt;
use gpuio::{Backend, Engine, OpenOptions};

use crate::CliResult;
use crate::cleanup::TempPath;
use crate::size::{ByteSize, fmt_bytes};

#[derive(Args, Debug)]
pub struct CpArgs {
    /// Source file (a regular file or a block device).
    src: PathBuf,
    /// Destination file, replaced only once the copy is complete; or an existing directory
    /// to copy into (DST/basename(SRC)), or a block device to write in place.
    dst: PathBuf,
    /// Use O_DIRECT on both files.
    #[arg(long)]
    direct: bool,
    /// Chunk size of the engine (suffixes K, M, G).
    #[arg(long, default_value = "4M")]
    chunk: ByteSize,
    /// Engine queue depth.
    #[arg(long, default_value_t = 32, value_parser = crate::validate::whole(0, usize::MAX))]
    qd: usize,
    /// Backend.
    #[arg(long, default_value = "auto")]
    backend: Backend,
}

/// `'path'`, the way coreutils quotes file names in messages.
fn q(p: &Path) -> String {
    format!("'{}'", p.display())
}

/// What the destination is, decided before anything is written.
enum Dest {
    /// A new file `path`, created with `mode` (before the umask).
    New { path: PathBuf, mode: u32 },
    /// An existing regular file: `target` is the file itself (symlinks resolved), which the
    /// finished copy replaces, keeping its mode and owner.
    Replace {
        shown: PathBuf,
        target: PathBuf,
        mode: u32,
        uid: u32,
        gid: u32,
    },
    /// An existing block device, written in place.
    Device(PathBuf),
}

/// Checks the source and works out the destination, touching nothing.
fn plan(src: &Path, dst: &Path) -> Result<(fs::Metadata, Dest), String> {
    let sm = fs::metadata(src).map_err(|e| format!("cp: cannot stat {}: {e}", q(src)))?;
    let sft = sm.file_type();
    if !sft.is_file() && !sft.is_block_device() {
        return Err(format!(
            "cp: {} is {}: gpuio cp copies one regular file or block device",
            q(src),
            crate::validate::kind_name(sft)
        ));
    }
    let mut dst = dst.to_path_buf();
    let mut dm = stat_dst(&dst)?;
    if dm.as_ref().is_some_and(|m| m.is_dir()) {
        // Like coreutils: an existing directory means "copy into it, under SRC's name".
        let name = src
            .file_name()
            .ok_or_else(|| format!("cp: {} has no file name to copy into {}", q(src), q(&dst)))?;
        dst = dst.join(name);
        dm = stat_dst(&dst)?;
    }
    let Some(dm) = dm else {
        if dst.as_os_str().as_bytes().ends_with(b"/") {
            return Err(format!("cp: cannot create {}: Not a directory", q(&dst)));
        }
        let mode = sm.mode() & 0o777;
        return Ok((sm, Dest::New { path: dst, mode }));
    };
    if (dm.dev(), dm.ino()) == (sm.dev(), sm.ino()) {
        return Err(format!("cp: {} and {} are the same file", q(src), q(&dst)));
    }
    let dft = dm.file_type();
    if dft.is_block_device() {
        return Ok((sm, Dest::Device(dst)));
    }
    if dft.is_dir() {
        return Err(format!(
            "cp: cannot overwrite directory {} with non-directory",
            q(&dst)
        ));
    }
    if !dft.is_file() {
        return Err(format!(
            "cp: {} is {}: gpuio cp writes regular files and block devices",
            q(&dst),
            crate::validate::kind_name(dft)
        ));
    }
    // Replace the file a symlink points to, not the symlink: what an in-place cp writes.
    let target =
        fs::canonicalize(&dst).map_err(|e| format!("cp: cannot resolve {}: {e}", q(&dst)))?;
    Ok((
        sm,
        Dest::Replace {
            shown: dst,
            target,
            mode: dm.mode() & 0o777,
            uid: dm.uid(),
            gid: dm.gid(),
        },
    ))
}

/// The destination's metadata (through symlinks), `None` if it does not exist; a dangling
/// symlink is refused like coreutils does, since writing "through" it would create a file
/// somewhere the user did not name.
fn stat_dst(dst: &Path) -> Result<Option<fs::Metadata>, String> {
    match fs::metadata(dst) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => match fs::symlink_metadata(dst) {
            Ok(l) if l.file_type().is_symlink() => Err(format!(
                "cp: not writing through dangling symlink {}",
                q(dst)
            )),
            _ => Ok(None),
        },
        Err(e) => Err(format!("cp: cannot stat {}: {e}", q(dst))),
    }
}

pub async fn run(a: CpArgs) -> CliResult {
    if a.chunk.0 == 0 || a.qd == 0 {
        return Err("cp: --chunk and --qd must be positive".into());
    }
    let (sm, dest) = plan(&a.src, &a.dst)?;
    // A file-size limit (ulimit -f) would otherwise kill the process with SIGXFSZ midway,
    // leaving the temporary file behind; ignored, the write fails with EFBIG and the copy is
    // cleaned up and reported like any other failure.
    // SAFETY: setting a signal's disposition to SIG_IGN has no preconditions.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let engine = Engine::builder()
        .chunk_size(a.chunk.0 as usize)
        .queue_depth(a.qd)
        .backend(a.backend)
        .build()?;
    let input = OpenOptions::new()
        .read(true)
        .direct(a.direct)
        .open(&engine, &a.src)
        .map_err(|e| format!("cp: cannot read {}: {e}", q(&a.src)))?;
    let len = input
        .len()
        .map_err(|e| format!("cp: cannot read {}: {e}", q(&a.src)))?;
    // Only a regular file has holes worth keeping; a block device reads as all data, and a
    // device destination keeps its old bytes where the source has holes: copy those too.
    let extents = if sm.file_type().is_file() && !matches!(dest, Dest::Device(_)) {
        data_extents(&a.src, len).map_err(|e| format!("cp: cannot read {}: {e}", q(&a.src)))?
    } else {
        vec![(0, len)]
    };
    let copy = Copy {
        src: &a.src,
        input: &input,
        engine: &engine,
        chunk: a.chunk.0,
        direct: a.direct,
    };

    let start = Instant::now();
    let data = match dest {
        Dest::Device(path) => {
            let fail = |e: &dyn std::fmt::Display| format!("cp: cannot write {}: {e}", q(&path));
            let output = OpenOptions::new()
                .write(true)
                .direct(a.direct)
                .open(&engine, &path)
                .map_err(|e| fail(&e))?;
            let size = output.len().map_err(|e| fail(&e))?;
            if len > size {
                return Err(format!(
                    "cp: {} ({}) does not fit on {} ({})",
                    q(&a.src),
                    fmt_bytes(len),
                    q(&path),
                    fmt_bytes(size)
                )
                .into());
            }
            let data = copy.run(&output, &path, &extents).await?;
            output.sync_all().await.map_err(|e| fail(&e))?;
            data
        }
        Dest::New { path, mode } => {
            let mode = mode & !umask();
            write_replacing(&copy, &path, &path, &extents, len, |f| {
                f.set_permissions(fs::Permissions::from_mode(mode))
            })
            .await?
        }
        Dest::Replace {
            shown,
            target,
            mode,
            uid,
            gid,
        } => {
            write_replacing(&copy, &shown, &target, &extents, len, |f| {
                // Root may give the file back to its owner; anyone else keeps it, as a user
                // cannot give files away (and the old file was theirs to replace).
                let _ = std::os::unix::fs::fchown(f, Some(uid), Some(gid));
                f.set_permissions(fs::Permissions::from_mode(mode))
            })
            .await?
        }
    };
    let secs = start.elapsed().as_secs_f64();
    let holes = if data < len {
        format!(" ({} of data, holes kept)", fmt_bytes(data))
    } else {
        String::new()
    };
    outln!(
        "copied {}{holes} in {secs:.3} s: {:.3} GB/s via {}",
        fmt_bytes(len),
        data as f64 / secs / 1e9,
        engine.backend().name
    )?;
    Ok(())
}

/// Copies into a temporary file beside `target`, gives it its length and `finish`'s
/// metadata, fsyncs it and renames it over `target`; `shown` is the destination as the user
/// named it, for messages. Returns the data bytes copied.
async fn write_replacing(
    copy: &Copy<'_>,
    shown: &Path,
    target: &Path,
    extents: &[(u64, u64)],
    len: u64,
    finish: impl FnOnce(&fs::File) -> io::Result<()>,
) -> Result<u64, String> {
    let fail = |e: &dyn std::fmt::Display| format!("cp: cannot write {}: {e}", q(shown));
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = target
        .file_name()
        .ok_or_else(|| format!("cp: {} names no file", q(shown)))?;
    let prefix = format!(".{}.gpuio-tmp-", name.to_string_lossy());
    let (tmp, file) = TempPath::create(dir, &prefix).map_err(|e| fail(&e))?;
    // From here on every early return drops `tmp`, which removes the temporary file.
    let output = OpenOptions::new()
        .write(true)
        .direct(copy.direct)
        .open(copy.engine, tmp.path())
        .map_err(|e| fail(&e))?;
    let data = copy.run(&output, shown, extents).await?;
    // The length covers a trailing hole, which no write reached.
    file.set_len(len)
        .and_then(|()| finish(&file))
        .map_err(|e| fail(&format!("{}: {e}", tmp.path().display())))?;
    // Data and metadata reach the disk before the name does: after a crash the destination
    // is the old file or the whole new one, never a torn one.
    output.sync_all().await.map_err(|e| fail(&e))?;
    drop(output);
    drop(file);
    let tmp_path = tmp.path().to_path_buf();
    tmp.persist(|p| fs::rename(p, target))
        .map_err(|e| fail(&format!("rename {} into place: {e}", tmp_path.display())))?;
    // Make the rename itself durable.
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| {
            format!(
                "cp: copied to {}, but syncing its directory failed: {e}",
                q(shown)
            )
        })?;
    Ok(data)
}

/// The source side of a copy, and how to open the destination.
struct Copy<'a> {
    src: &'a Path,
    input: &'a gpuio::File,
    engine: &'a Engine,
    chunk: u64,
    direct: bool,
}

impl Copy<'_> {
    /// Copies `extents` of the source to the same offsets of `output`, several blocks in
    /// flight (reads of one overlap writes of another); returns the bytes copied. Messages
    /// name the source, or the destination as `shown` (the engine's own error adds the path
    /// written, a temporary file's, and the offset).
    async fn run(
        &self,
        output: &gpuio::File,
        shown: &Path,
        extents: &[(u64, u64)],
    ) -> Result<u64, String> {
        let block = (self.chunk.saturating_mul(4)).max(1 << 20);
        let total: u64 = extents.iter().map(|(s, e)| e - s).sum();
        let pb = crate::progress(total);
        let blocks = extents.iter().flat_map(|&(s, e)| {
            (s..e)
                .step_by(block as usize)
                .map(move |off| (off, block.min(e - off) as usize))
        });
        let mut stream = futures::stream::iter(blocks)
            .map(|(off, n)| async move {
                let mut buf = vec![0u8; n];
                let got = self
                    .input
                    .read_into(&mut buf, off)
                    .await
                    .map_err(|e| format!("cp: cannot read {}: {e}", q(self.src)))?;
                if got != n {
                    return Err(format!(
                        "cp: {} shrank during the copy: reading {n} bytes at offset {off} \
                         got {got} bytes",
                        q(self.src)
                    ));
                }
                output
                    .write_from(&buf, off)
                    .await
                    .map_err(|e| format!("cp: cannot write {}: {e}", q(shown)))?;
                Ok(n as u64)
            })
            .buffer_unordered(4);
        while let Some(r) = stream.next().await {
            pb.inc(r?);
        }
        pb.finish_and_clear();
        Ok(total)
    }
}

/// The source's data extents `[start, end)` below `len`, from SEEK_DATA/SEEK_HOLE. A
/// filesystem without them reports the whole file as data, which is still correct.
fn data_extents(path: &Path, len: u64) -> io::Result<Vec<(u64, u64)>> {
    let f = fs::File::open(path)?;
    let fd = f.as_raw_fd();
    let seek = |off: u64, whence: libc::c_int| -> io::Result<Option<u64>> {
        // SAFETY: lseek on a descriptor we own; it only moves the file offset.
        let r = unsafe { libc::lseek(fd, off as libc::off_t, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = io::Error::last_os_error();
        // ENXIO: no data at or after `off` (the rest is a hole, or off is past the end).
        if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        }
    };
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < len {
        let Some(start) = seek(pos, libc::SEEK_DATA)? else {
            break;
        };
        if start >= len {
            break;
        }
        let end = seek(start, libc::SEEK_HOLE)?.unwrap_or(len).min(len);
        if end <= start {
            break;
        }
        out.push((start, end));
        pos = end;
    }
    Ok(out)
}

/// The process's umask, read without changing it (Linux 4.7+ lists it in
/// /proc/self/status); where that fails, the usual 022.
fn umask() -> u32 {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        })
        .unwrap_or(0o022)
}
