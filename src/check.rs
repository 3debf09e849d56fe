//! What this machine offers gpuio for a path, and why: io_uring, the engine's sizing, O_DIRECT,
//! CUDA, GPUDirect Storage and SPDK. `gpuio check`, `gpuio.check()` (Python) and
//! `gpuio_check()` (C) all print this one [`Report`].

use std::os::fd::{AsFd, AsRawFd};
#[cfg(feature = "cuda")]
use std::os::unix::fs::MetadataExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::engine::Engine;
use crate::error::{Context, Error, OpKind, Result};
use crate::file::OpenOptions;

/// One part of a [`Report`]: a name to find it by and the lines it prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// `gpuio`, `io_uring`, `engine`, `path`, `cuda`, `gds`, `spdk` or `ucx`.
    pub name: &'static str,
    /// The lines as printed (details indented by two spaces).
    pub lines: Vec<String>,
}

/// What [`report`] found, section by section. `Display` prints it as `gpuio check` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// In printing order.
    pub sections: Vec<Section>,
}

impl Report {
    /// The section called `name`, if the report has one.
    pub fn section(&self, name: &str) -> Option<&Section> {
        self.sections.iter().find(|s| s.name == name)
    }

    fn push(&mut self, name: &'static str) -> &mut Vec<String> {
        self.sections.push(Section {
            name,
            lines: Vec::new(),
        });
        &mut self.sections.last_mut().expect("just pushed").lines
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut first = true;
        for line in self.sections.iter().flat_map(|s| &s.lines) {
            if !first {
                f.write_str("\n")?;
            }
            first = false;
            f.write_str(line)?;
        }
        Ok(())
    }
}

/// Examines the machine and `path` (a regular file, a block device or a directory, whose
/// filesystem is probed with a scratch file that is removed again; a read-only or pseudo
/// filesystem is only read). Anything else is refused before it is opened: opening a FIFO
/// would block, and opening some character devices has effects of its own.
pub fn report(path: &Path) -> Result<Report> {
    let arc: std::sync::Arc<Path> = path.into();
    let ctx = || Context::op(OpKind::Check).with_path(&arc);
    let meta = std::fs::metadata(path).map_err(|e| Error::io(ctx(), e))?;
    let ft = meta.file_type();
    if !(ft.is_dir() || ft.is_file() || ft.is_block_device()) {
        return Err(Error::invalid(
            ctx(),
            format!(
                "{} is {}: gpuio check examines regular files, block devices and directories \
                 (and the filesystems they are on)",
                path.display(),
                kind_name(ft)
            ),
        ));
    }
    let mut r = Report {
        sections: Vec::new(),
    };
    r.push("gpuio")
        .push(format!("gpuio {}", env!("CARGO_PKG_VERSION")));

    let u = crate::uring::probe();
    let lines = r.push("io_uring");
    lines.push(match u.flags {
        Some(f) => format!("io_uring: available, setup flags {f}"),
        None => "io_uring: UNAVAILABLE".into(),
    });
    if let Some(d) = &u.disabled_sysctl {
        lines.push(format!("  kernel.io_uring_disabled = {d}"));
    }
    lines.extend(u.notes.iter().map(|n| format!("  {n}")));
    lines.push(format!(
        "  RLIMIT_MEMLOCK (bounds fixed-buffer registration): {}",
        memlock()
    ));

    let lines = r.push("engine");
    match Engine::builder().bounce_slots(1).build() {
        Ok(e) => lines.push(format!(
            "engine with default backend: {}",
            e.backend().detail
        )),
        Err(e) => lines.push(format!("engine with default backend: FAILED: {e}")),
    }
    lines.push("engine defaults, sized from this machine (EngineBuilder overrides each):".into());
    let sizing = Engine::builder().sizing();
    lines.extend(sizing.reasons.iter().map(|l| format!("  {l}")));
    lines.push(format!("  {}", sizing.lends_buffered_reads().1));
    lines.push(format!(
        "  residency-aware reads: on (EngineBuilder::residency_aware); reads of {} KiB or more \
         of buffered files ask {} what the page cache holds, and read the ranges it lacks \
         with O_DIRECT",
        crate::plan::residency::RESIDENCY_MIN_READ >> 10,
        crate::plan::residency::probe()
    ));

    let probe = Probe::new(path, &meta);
    report_path(r.push("path"), path, &probe)?;
    report_cuda(r.push("cuda"));
    #[cfg(feature = "cuda")]
    report_gds(r.push("gds"), path, &meta, &probe);
    report_spdk(r.push("spdk"));
    report_ucx(r.push("ucx"));
    Ok(r)
}

fn kind_name(ft: std::fs::FileType) -> &'static str {
    if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

fn memlock() -> String {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one struct through a valid pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return "unknown".into();
    }
    if r.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".into()
    } else if r.rlim_cur >= 1 << 20 {
        format!("{} MiB", r.rlim_cur >> 20)
    } else {
        format!("{} KiB", r.rlim_cur >> 10)
    }
}

fn report_cuda(lines: &mut Vec<String>) {
    let c = crate::cuda::probe();
    match (&c.error, c.devices.is_empty()) {
        (None, false) => {
            lines.push(format!(
                "CUDA: driver {} ({}), {} device(s)",
                c.driver_version.as_deref().unwrap_or("?"),
                c.library.as_deref().unwrap_or("?"),
                c.devices.len()
            ));
            for place in crate::cuda::topology::gpus().iter() {
                lines.push(format!("  {place}"));
            }
            #[cfg(feature = "cuda")]
            report_peers(lines, c.devices.len());
            lines.push(format!(
                "  pinned host memory: the bounce pool is page-locked with cuMemHostRegister on \
                 first use (RLIMIT_MEMLOCK {}; the driver may refuse above it for non-root)",
                memlock()
            ));
        }
        (err, _) => lines.push(format!(
            "CUDA: not usable: {} (host-memory paths work; device destinations need a GPU)",
            err.as_deref().unwrap_or("no devices")
        )),
    }
}

/// Which GPUs reach each other directly, and so how replicated checkpoint tensors are loaded
/// (`safetensors::Replicas::Auto`).
#[cfg(feature = "cuda")]
fn report_peers(lines: &mut Vec<String>, n: usize) {
    if n < 2 {
        return;
    }
    let ctxs: Vec<_> = (0..n)
        .filter_map(|i| crate::cuda::context(i).ok())
        .collect();
    let mut direct = true;
    for (i, a) in ctxs.iter().enumerate() {
        for b in &ctxs[i + 1..] {
            let yes = crate::cuda::peer::can_access(a, b);
            direct &= yes;
            lines.push(format!(
                "  gpu:{} <-> gpu:{}: {}",
                a.ordinal(),
                b.ordinal(),
                if yes {
                    "peer access (NVLink or PCIe peer-to-peer)"
                } else {
                    "no peer access: copies between them go through host memory"
                }
            ));
        }
    }
    lines.push(format!(
        "  replicated checkpoint tensors: {}",
        if direct {
            "read once, then copied GPU to GPU (every pair reaches each other directly)"
        } else {
            "read by every GPU from the file (not every pair reaches each other directly)"
        }
    ));
}

/// Whether agents can reach other processes and hosts (UCX), and with device memory.
fn report_ucx(lines: &mut Vec<String>) {
    lines.push("UCX (agents in other processes and on other hosts):".into());
    match crate::ucx::probe() {
        Ok(i) => {
            lines.push(format!("  library: UCX {} at {}", i.version, i.library));
            lines.push(if i.cuda {
                "  CUDA: yes (device memory moves over UCX's CUDA transports)".into()
            } else {
                "  CUDA: no (host memory only to other processes; for device memory point \
                 GPUIO_UCX_DIR at a UCX built with CUDA, e.g. the libucx-cu13 wheel's lib/)"
                    .into()
            });
        }
        Err(e) => lines.push(format!("  library: NOT USABLE ({e})")),
    }
    lines.push(
        "  agents in one process copy directly (memcpy threads, CUDA copies) and need no UCX"
            .into(),
    );
}

/// Whether NVMe namespaces can be opened through SPDK here, and what is missing if not.
fn report_spdk(lines: &mut Vec<String>) {
    let p = crate::spdk::probe();
    lines.push("SPDK (NVMe over PCIe or NVMe/TCP):".into());
    match &p.library {
        Ok((path, version)) => lines.push(format!("  library: {version} at {path}")),
        Err(why) => lines.push(format!("  library: NOT USABLE ({why})")),
    }
    lines.push(match p.hugepages {
        Some((0, _)) | None => {
            "  hugepages: none reserved -> SPDK cannot start (`scripts/spdk.sh hugepages`)".into()
        }
        Some((total, free)) => format!("  hugepages: {total} x 2 MiB reserved, {free} free"),
    });
    if p.library.is_ok() {
        lines.push(
            "  open a namespace with Engine::open_nvme(TRID) or `gpuio bench --backend spdk --target TRID`"
                .into(),
        );
    }
}

/// The GPUDirect Storage verdict for `path`, in the spirit of NVIDIA's gdscheck: each piece
/// cuFile needs, whether it is there, and what to do about it.
#[cfg(feature = "cuda")]
fn report_gds(lines: &mut Vec<String>, path: &Path, meta: &std::fs::Metadata, probe: &Probe) {
    let p = crate::gds::probe();
    lines.push("GPUDirect Storage (cuFile):".into());
    match &p.library {
        Ok(lib) => lines.push(format!("  library: {lib}")),
        Err(e) => {
            lines.push(format!("  library: NOT FOUND ({e})"));
            lines.push(
                "    -> install the CUDA runtime's libcufile (cuda-toolkit or libcufile-<ver>)"
                    .into(),
            );
        }
    }
    match &p.driver {
        Ok(()) => lines.push("  driver: opened (cuFileDriverOpen)".into()),
        Err(e) => lines.push(format!("  driver: NOT USABLE ({e})")),
    }
    if p.nvidia_fs {
        lines.push("  nvidia-fs: loaded (true peer-to-peer DMA possible)".into());
    } else {
        lines.push(
            "  nvidia-fs: NOT loaded -> cuFile runs in compatibility mode (POSIX I/O through"
                .into(),
        );
        lines.push(
            "    its own host buffers; no DMA from storage to GPU). Load nvidia-fs (MLNX_OFED /"
                .into(),
        );
        lines.push("    nvidia-gds package) on a supported NVMe/RDMA setup for true GDS.".into());
    }
    let (maj, min) = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let udev = format!("/run/udev/data/b{maj}:{min}");
    if !p.udev_data {
        lines.push("  udev database: /run/udev/data NOT readable (typical in containers)".into());
    }
    match std::fs::read_to_string(&udev) {
        Ok(d) if d.contains("ID_FS_USAGE") => lines.push(format!(
            "  udev data for the backing device {maj}:{min}: present"
        )),
        Ok(_) => lines.push(format!(
            "  udev data for {maj}:{min}: present but without ID_FS_USAGE"
        )),
        Err(_) => {
            lines.push(format!(
                "  udev data for the backing device {maj}:{min}: MISSING ({udev})"
            ));
            lines.push(
                "    -> cuFile refuses to register files here (CU_FILE_HANDLE_NOT_REGISTERED);"
                    .into(),
            );
            lines
                .push("       run with the host's /run/udev mounted, or as root create it:".into());
            lines.push(format!(
                "       mkdir -p /run/udev/data; printf 'E:ID_FS_TYPE=<fs>\\nE:ID_FS_USAGE=filesystem\\n' > {udev}"
            ));
        }
    }
    let verdict = match (probe.file(), &p.driver) {
        (Err(why), _) => {
            lines.push(format!(
                "  verdict for {}: not probed ({why})",
                path.display()
            ));
            return;
        }
        (Ok(f), Ok(())) => crate::gds::check_file(f),
        (Ok(_), Err(_)) => {
            crate::gds::GdsStatus::Bounce("cuFile is not usable on this machine".into())
        }
    };
    lines.push(format!("  verdict for {}: {verdict}", path.display()));
    lines.push(match verdict {
        crate::gds::GdsStatus::Gds => {
            "    Backend::Auto reads into GPU memory with GPUDirect DMA".into()
        }
        crate::gds::GdsStatus::CufileCompat => "    cuFile would run in compatibility mode (cufile-compat): Backend::Auto keeps gpuio's bounce path, which is faster there; EngineBuilder::cufile_compat(true) lets AUTO use cuFile for files opened with `direct`, Backend::Gds always does".into(),
        crate::gds::GdsStatus::Bounce(_) => "    Backend::Auto uses gpuio's bounce path (io_uring + pinned copies); Backend::Gds would refuse the file".into(),
    });
}

/// A scratch file the check made (removed when dropped).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

impl Scratch {
    /// A new file in `dir` with one block of data, so that cuFile has something to register and
    /// read.
    fn new(dir: &Path) -> std::io::Result<Scratch> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let name = dir.join(format!(
            ".gpuio-check-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&name)?;
        let made = Scratch(name);
        std::io::Write::write_all(&mut f, &[0u8; 4096])?;
        Ok(made)
    }
}

/// The regular file the O_DIRECT and cuFile probes look at: the path itself, or for a
/// directory a scratch file made there or, where none can be made, a file already there (only
/// read); or why there is none.
enum Probe {
    Path(PathBuf),
    Scratch(Scratch),
    Existing(PathBuf, String),
    None(String),
}

impl Probe {
    fn new(path: &Path, meta: &std::fs::Metadata) -> Probe {
        if !meta.is_dir() {
            return Probe::Path(path.to_path_buf());
        }
        // Files are not created where they cannot be (a read-only mount) or mean nothing (a
        // pseudo filesystem such as /proc or /sys, where gpuio reads no files anyway).
        match fs_of_dir(path) {
            Ok((fs, _)) if crate::plan::align::is_pseudo_filesystem(&fs) => {
                return Probe::None(format!(
                    "{fs} is a pseudo filesystem: its files are generated when read, and gpuio \
                     does not read them"
                ));
            }
            Ok((_, true)) => return Probe::existing(path, "a read-only filesystem".into()),
            _ => {}
        }
        match Scratch::new(path) {
            Ok(t) => Probe::Scratch(t),
            Err(e) => Probe::existing(
                path,
                format!(
                    "a probe file could not be created in {}: {e}",
                    path.display()
                ),
            ),
        }
    }

    /// A regular file already in `dir` to probe instead of a scratch file (`why` says why
    /// there is none), or `why` alone.
    fn existing(dir: &Path, why: String) -> Probe {
        // DirEntry::metadata does not follow links: only plain files of this directory, and
        // a bounded look (a huge directory is not worth listing for this).
        let found = std::fs::read_dir(dir).ok().and_then(|entries| {
            entries
                .take(256)
                .filter_map(std::result::Result::ok)
                .find(|e| e.metadata().is_ok_and(|m| m.is_file() && m.len() > 0))
                .map(|e| e.path())
        });
        match found {
            Some(f) => Probe::Existing(f, why),
            None => Probe::None(format!("{why}, and no file in it to read")),
        }
    }

    /// The file to probe, or why there is none.
    fn file(&self) -> std::result::Result<&Path, &str> {
        match self {
            Probe::Path(p) => Ok(p),
            Probe::Scratch(t) => Ok(&t.0),
            Probe::Existing(p, _) => Ok(p),
            Probe::None(why) => Err(why),
        }
    }
}

/// The filesystem a directory is on, by name, and whether it is mounted read-only.
fn fs_of_dir(dir: &Path) -> std::io::Result<(String, bool)> {
    let d = std::fs::File::open(dir)?;
    let fs = crate::plan::align::filesystem_name(d.as_fd())?;
    // SAFETY: plain output struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is live and `st` is valid for writes.
    let ro =
        unsafe { libc::fstatvfs(d.as_raw_fd(), &mut st) } == 0 && st.f_flag & libc::ST_RDONLY != 0;
    Ok((fs, ro))
}

fn report_path(lines: &mut Vec<String>, path: &Path, probe: &Probe) -> Result<()> {
    let name = path.display();
    let arc: std::sync::Arc<Path> = path.into();
    let ctx = || Context::op(OpKind::Check).with_path(&arc);
    // The path's own filesystem, from a descriptor opened without blocking (the path was
    // checked to be a file, block device or directory; O_NONBLOCK covers a swap since).
    let own = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io(ctx(), e))?;
    let fs = crate::plan::align::filesystem_name(own.as_fd()).map_err(|e| Error::io(ctx(), e))?;
    lines.push(format!("path {name}: filesystem {fs}"));
    let probe_path = match probe.file() {
        Ok(p) => p,
        Err(why) => {
            lines.push(format!("  O_DIRECT: not probed ({why})"));
            return Ok(());
        }
    };
    if let Probe::Existing(p, why) = probe {
        lines.push(format!(
            "  probing {} ({why}; it is only read)",
            p.display()
        ));
    }
    // Direct-I/O alignment is a property of regular files (and block devices).
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(probe_path)
        .map_err(|e| Error::io(Context::op(OpKind::Check).with_path(&probe_path.into()), e))?;
    match crate::plan::align::query(f.as_fd()).map_err(|e| Error::io(ctx(), e))? {
        Some(a) => lines.push(format!(
            "  O_DIRECT alignment: memory {} B, offset {} B ({})",
            a.memory, a.offset, a.source
        )),
        None => lines.push("  O_DIRECT: the filesystem reports no direct-I/O support".into()),
    }
    let engine = Engine::builder().bounce_slots(1).build()?;
    match OpenOptions::new()
        .read(true)
        .direct(true)
        .open(&engine, probe_path)
    {
        Ok(_) => {
            lines.push("  O_DIRECT open: ok (gpuio aligns any offset and length for you)".into())
        }
        Err(e) => lines.push(format!("  O_DIRECT open: refused: {e}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_probed_and_left_clean() {
        let dir = std::env::temp_dir().join(format!("gpuio-check-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let r = report(&dir).unwrap();
        for name in ["gpuio", "io_uring", "engine", "path", "cuda", "spdk"] {
            assert!(r.section(name).is_some(), "no {name} section in\n{r}");
        }
        let text = r.to_string();
        assert!(text.contains("O_DIRECT"), "{text}");
        assert!(text.contains("bounce pool"), "{text}");
        // The scratch file is gone again.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir(&dir).unwrap();
    }

    #[test]
    fn a_fifo_is_refused_without_opening_it() {
        let dir = std::env::temp_dir().join(format!("gpuio-check-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = report(&fifo).unwrap_err().to_string();
        assert!(e.contains("is a FIFO"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
