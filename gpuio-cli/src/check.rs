//! `gpuio check`: what this machine offers, and why.

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use gpuio::{Engine, OpenOptions};

use crate::CliResult;
use crate::stdout::outln;
use crate::validate;

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
    } else {
        crate::size::fmt_bytes(r.rlim_cur)
    }
}

pub fn run(path: Option<PathBuf>) -> CliResult {
    let path = path.unwrap_or_else(|| PathBuf::from("."));
    // `stat` opens nothing, so a FIFO cannot block here; what is not a file, a block device
    // or a directory is refused before anything opens it (opening some character devices
    // has effects of their own).
    let meta = std::fs::metadata(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let ft = meta.file_type();
    if !(ft.is_dir() || ft.is_file() || ft.is_block_device()) {
        return Err(format!(
            "{} is {}: gpuio check examines regular files, block devices and directories \
             (and the filesystems they are on)",
            path.display(),
            validate::kind_name(ft)
        )
        .into());
    }
    outln!("gpuio {}", env!("CARGO_PKG_VERSION"))?;

    let u = gpuio::lane::uring::probe();
    match u.flags {
        Some(f) => outln!("io_uring: available, setup flags {f}")?,
        None => outln!("io_uring: UNAVAILABLE")?,
    }
    if let Some(d) = &u.disabled_sysctl {
        outln!("  kernel.io_uring_disabled = {d}")?;
    }
    for n in &u.notes {
        outln!("  {n}")?;
    }
    outln!(
        "  RLIMIT_MEMLOCK (bounds fixed-buffer registration): {}",
        memlock()
    )?;

    match Engine::builder().bounce_slots(1).build() {
        Ok(e) => outln!("engine with default backend: {}", e.backend().detail)?,
        Err(e) => outln!("engine with default backend: FAILED: {e}")?,
    }

    let probe = Probe::new(&path, &meta);
    report_path(&path, &probe)?;

    let c = gpuio::cuda::probe();
    match (&c.error, c.devices.is_empty()) {
        (None, false) => {
            outln!(
                "CUDA: driver {} ({}), {} device(s)",
                c.driver_version.as_deref().unwrap_or("?"),
                c.library.as_deref().unwrap_or("?"),
                c.devices.len()
            )?;
            for (i, d) in c.devices.iter().enumerate() {
                outln!("  gpu:{i} {d}")?;
            }
            outln!(
                "  pinned host memory: the bounce pool is page-locked with cuMemHostRegister on \
                 first use (RLIMIT_MEMLOCK {}; the driver may refuse above it for non-root)",
                memlock()
            )?;
        }
        (err, _) => outln!(
            "CUDA: not usable: {} (host-memory paths work; device destinations need a GPU)",
            err.as_deref().unwrap_or("no devices")
        )?,
    }
    report_gds(&path, &meta, &probe)?;
    report_spdk()?;
    Ok(())
}

/// Whether NVMe namespaces can be opened through SPDK here, and what is missing if not.
fn report_spdk() -> CliResult {
    let p = gpuio::spdk::probe();
    outln!("SPDK (NVMe over PCIe or NVMe/TCP):")?;
    match &p.library {
        Ok((path, version)) => outln!("  library: {version} at {path}")?,
        Err(why) => outln!("  library: NOT USABLE ({why})")?,
    }
    match p.hugepages {
        Some((0, _)) | None => {
            outln!("  hugepages: none reserved -> SPDK cannot start (`scripts/spdk.sh hugepages`)")?
        }
        Some((total, free)) => outln!("  hugepages: {total} x 2 MiB reserved, {free} free")?,
    }
    if p.library.is_ok() {
        outln!(
            "  open a namespace with Engine::open_nvme(TRID) or `gpuio bench --backend spdk --target TRID`"
        )?;
    }
    Ok(())
}

/// The GPUDirect Storage verdict for `path`, in the spirit of NVIDIA's gdscheck: each piece
/// cuFile needs, whether it is there, and what to do about it.
fn report_gds(path: &Path, meta: &std::fs::Metadata, probe: &Probe) -> CliResult {
    let p = gpuio::gds::probe();
    outln!("GPUDirect Storage (cuFile):")?;
    match &p.library {
        Ok(lib) => outln!("  library: {lib}")?,
        Err(e) => {
            outln!("  library: NOT FOUND ({e})")?;
            outln!(
                "    -> install the CUDA runtime's libcufile (cuda-toolkit or libcufile-<ver>)"
            )?;
        }
    }
    match &p.driver {
        Ok(()) => outln!("  driver: opened (cuFileDriverOpen)")?,
        Err(e) => outln!("  driver: NOT USABLE ({e})")?,
    }
    if p.nvidia_fs {
        outln!("  nvidia-fs: loaded (true peer-to-peer DMA possible)")?;
    } else {
        outln!("  nvidia-fs: NOT loaded -> cuFile runs in compatibility mode (POSIX I/O through")?;
        outln!(
            "    its own host buffers; no DMA from storage to GPU). Load nvidia-fs (MLNX_OFED /"
        )?;
        outln!("    nvidia-gds package) on a supported NVMe/RDMA setup for true GDS.")?;
    }
    let (maj, min) = (libc::major(meta.dev()), libc::minor(meta.dev()));
    let udev = format!("/run/udev/data/b{maj}:{min}");
    if !p.udev_data {
        outln!("  udev database: /run/udev/data NOT readable (typical in containers)")?;
    }
    match std::fs::read_to_string(&udev) {
        Ok(d) if d.contains("ID_FS_USAGE") => {
            outln!("  udev data for the backing device {maj}:{min}: present")?
        }
        Ok(_) => outln!("  udev data for {maj}:{min}: present but without ID_FS_USAGE")?,
        Err(_) => {
            outln!("  udev data for the backing device {maj}:{min}: MISSING ({udev})")?;
            outln!(
                "    -> cuFile refuses to register files here (CU_FILE_HANDLE_NOT_REGISTERED);"
            )?;
            outln!("       run with the host's /run/udev mounted, or as root create it:")?;
            outln!(
                "       mkdir -p /run/udev/data; printf 'E:ID_FS_TYPE=<fs>\\nE:ID_FS_USAGE=filesystem\\n' > {udev}"
            )?;
        }
    }
    let verdict = match (probe.file(), &p.driver) {
        (Err(why), _) => {
            outln!("  verdict for {}: not probed ({why})", path.display())?;
            return Ok(());
        }
        (Ok(f), Ok(())) => gpuio::gds::check_file(f),
        (Ok(_), Err(_)) => {
            gpuio::gds::GdsStatus::Bounce("cuFile is not usable on this machine".into())
        }
    };
    outln!("  verdict for {}: {verdict}", path.display())?;
    match verdict {
        gpuio::gds::GdsStatus::Gds => {
            outln!("    Backend::Auto reads into GPU memory with GPUDirect DMA")?
        }
        gpuio::gds::GdsStatus::CufileCompat => outln!(
            "    cuFile would run in compatibility mode (cufile-compat): Backend::Auto keeps gpuio's bounce path, which is faster there; EngineBuilder::cufile_compat(true) lets AUTO use cuFile for files opened with `direct`, Backend::Gds always does"
        )?,
        gpuio::gds::GdsStatus::Bounce(_) => outln!(
            "    Backend::Auto uses gpuio's bounce path (io_uring + pinned copies); Backend::Gds would refuse the file"
        )?,
    }
    Ok(())
}

/// The regular file the O_DIRECT and cuFile probes look at: the path itself, or for a
/// directory a scratch file made there (removed when the check ends) or, where none can be
/// made, a file already there (only read); or why there is none.
enum Probe {
    Path(PathBuf),
    Scratch(tempfile::NamedTempFile),
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
            Ok((fs, _)) if gpuio::plan::align::is_pseudo_filesystem(&fs) => {
                return Probe::None(format!(
                    "{fs} is a pseudo filesystem: its files are generated when read, and gpuio \
                     does not read them"
                ));
            }
            Ok((_, true)) => return Probe::existing(path, "a read-only filesystem".into()),
            _ => {}
        }
        let made = tempfile::Builder::new()
            .prefix(".gpuio-check")
            .tempfile_in(path)
            .and_then(|mut t| {
                // A block of data, so that cuFile has something to register and read.
                std::io::Write::write_all(&mut t, &[0u8; 4096])?;
                Ok(t)
            });
        match made {
            Ok(t) => Probe::Scratch(t),
            Err(e) => Probe::existing(
                path,
                format!(
                    "a probe file could not be created in {}: {}",
                    path.display(),
                    validate::scratch_error(&e)
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
                .filter_map(Result::ok)
                .find(|e| e.metadata().is_ok_and(|m| m.is_file() && m.len() > 0))
                .map(|e| e.path())
        });
        match found {
            Some(f) => Probe::Existing(f, why),
            None => Probe::None(format!("{why}, and no file in it to read")),
        }
    }

    /// The file to probe, or why there is none.
    fn file(&self) -> Result<&Path, &str> {
        match self {
            Probe::Path(p) => Ok(p),
            Probe::Scratch(t) => Ok(t.path()),
            Probe::Existing(p, _) => Ok(p),
            Probe::None(why) => Err(why),
        }
    }
}

/// The filesystem a directory is on, by name, and whether it is mounted read-only.
fn fs_of_dir(dir: &Path) -> std::io::Result<(String, bool)> {
    let d = std::fs::File::open(dir)?;
    let fs = gpuio::plan::align::filesystem_name(d.as_fd())?;
    // SAFETY: plain output struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: the descriptor is live and `st` is valid for writes.
    let ro =
        unsafe { libc::fstatvfs(d.as_raw_fd(), &mut st) } == 0 && st.f_flag & libc::ST_RDONLY != 0;
    Ok((fs, ro))
}

fn report_path(path: &Path, probe: &Probe) -> CliResult {
    let name = path.display();
    // The path's own filesystem, from a descriptor opened without blocking (the path was
    // checked to be a file, block device or directory; O_NONBLOCK covers a swap since).
    let own = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("{name}: {e}"))?;
    let fs =
        gpuio::plan::align::filesystem_name(own.as_fd()).map_err(|e| format!("{name}: {e}"))?;
    outln!("path {name}: filesystem {fs}")?;
    let probe_path = match probe.file() {
        Ok(p) => p,
        Err(why) => {
            outln!("  O_DIRECT: not probed ({why})")?;
            return Ok(());
        }
    };
    if let Probe::Existing(p, why) = probe {
        outln!("  probing {} ({why}; it is only read)", p.display())?;
    }
    // Direct-I/O alignment is a property of regular files (and block devices).
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(probe_path)
        .map_err(|e| format!("{}: {e}", probe_path.display()))?;
    match gpuio::plan::align::query(f.as_fd()).map_err(|e| format!("{name}: {e}"))? {
        Some(a) => outln!(
            "  O_DIRECT alignment: memory {} B, offset {} B ({})",
            a.memory,
            a.offset,
            a.source
        )?,
        None => outln!("  O_DIRECT: the filesystem reports no direct-I/O support")?,
    }
    let engine = Engine::builder().bounce_slots(1).build()?;
    match OpenOptions::new()
        .read(true)
        .direct(true)
        .open(&engine, probe_path)
    {
        Ok(_) => outln!("  O_DIRECT open: ok (gpuio aligns any offset and length for you)")?,
        Err(e) => outln!("  O_DIRECT open: refused: {e}")?,
    }
    Ok(())
}
