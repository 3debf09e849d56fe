//! `gpuio check`: what this machine offers, and why.

use std::os::fd::AsFd;
use std::path::PathBuf;

use gpuio::{Engine, OpenOptions};

use crate::CliResult;
use crate::stdout::outln;

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
    outln!("gpuio {}", env!("CARGO_PKG_VERSION"))?;

    let u = gpuio::uring::probe();
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

    let path = path.unwrap_or_else(|| PathBuf::from("."));
    report_path(&path)?;

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
    report_gds(&path)?;
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
fn report_gds(path: &std::path::Path) -> CliResult {
    use std::os::unix::fs::MetadataExt;
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
    let meta = std::fs::metadata(path)?;
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
    // Probe a regular file: the path itself, or a scratch file in the directory.
    let (probe_path, _scratch) = if meta.is_dir() {
        let mut t = tempfile::Builder::new()
            .prefix(".gpuio-gds")
            .tempfile_in(path)?;
        std::io::Write::write_all(&mut t, &[0u8; 4096])?;
        (t.path().to_path_buf(), Some(t))
    } else {
        (path.to_path_buf(), None)
    };
    let verdict = if p.driver.is_ok() {
        gpuio::gds::check_file(&probe_path)
    } else {
        gpuio::gds::GdsStatus::Bounce("cuFile is not usable on this machine".into())
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

fn report_path(path: &std::path::Path) -> CliResult {
    let meta = std::fs::metadata(path)?;
    // Direct-I/O alignment is reported for regular files: probe a scratch file in a directory.
    let (probe_path, _scratch) = if meta.is_dir() {
        let t = tempfile::Builder::new()
            .prefix(".gpuio-check")
            .tempfile_in(path)?;
        (t.path().to_path_buf(), Some(t))
    } else {
        (path.to_path_buf(), None)
    };
    let f = std::fs::File::open(&probe_path)?;
    let fs = gpuio::uring::align::filesystem_name(f.as_fd())?;
    outln!("path {}: filesystem {fs}", path.display())?;
    match gpuio::uring::align::query(f.as_fd())? {
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
        .open(&engine, &probe_path)
    {
        Ok(_) => outln!("  O_DIRECT open: ok (gpuio aligns any offset and length for you)")?,
        Err(e) => outln!("  O_DIRECT open: refused: {e}")?,
    }
    Ok(())
}
