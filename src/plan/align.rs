//! O_DIRECT alignment, asked of the kernel rather than assumed.
//!
//! `statx(STATX_DIOALIGN)` (Linux 6.1+) reports the memory and file-offset alignment a file
//! needs for direct I/O, or that it supports none. Where the kernel or filesystem does not say,
//! the block device's logical block size is used, and failing that the page size, which every
//! Linux filesystem that supports O_DIRECT accepts.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Direct-I/O alignment requirements of one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectAlignment {
    /// Required alignment of memory buffers, in bytes.
    pub memory: u32,
    /// Required alignment of file offsets and lengths, in bytes.
    pub offset: u32,
    /// Where the figures came from.
    pub source: AlignmentSource,
}

/// How a [`DirectAlignment`] was learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlignmentSource {
    /// `statx` with `STATX_DIOALIGN`.
    Statx,
    /// The block device's logical sector size (`BLKSSZGET`).
    BlockDevice,
    /// Nothing reported it: assumed the page size.
    Assumed,
}

impl std::fmt::Display for AlignmentSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AlignmentSource::Statx => "statx STATX_DIOALIGN",
            AlignmentSource::BlockDevice => "block device logical sector size",
            AlignmentSource::Assumed => "assumed page size (kernel reported nothing)",
        })
    }
}

/// Raw `statx` of an open descriptor.
pub(crate) fn statx_fd(fd: BorrowedFd<'_>, mask: u32) -> io::Result<libc::statx> {
    let empty: &CStr = c"";
    // SAFETY: statx is a plain output struct; zeroed is a valid initial value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: fd is a live descriptor for the call's duration, `empty` is NUL-terminated and
    // AT_EMPTY_PATH makes the kernel stat the descriptor itself; stx is valid for writes.
    let rc = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH,
            mask,
            &mut stx,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(stx)
}

/// Direct-I/O alignment of the file behind `fd`; `Ok(None)` when the filesystem says the file
/// supports no direct I/O.
pub fn query(fd: BorrowedFd<'_>) -> io::Result<Option<DirectAlignment>> {
    let stx = statx_fd(fd, libc::STATX_DIOALIGN | libc::STATX_TYPE)?;
    let is_blk = u32::from(stx.stx_mode) & libc::S_IFMT == libc::S_IFBLK;
    if stx.stx_mask & libc::STATX_DIOALIGN != 0 && !is_blk {
        if stx.stx_dio_offset_align == 0 {
            return Ok(None);
        }
        return Ok(Some(DirectAlignment {
            memory: stx.stx_dio_mem_align.max(1),
            offset: stx.stx_dio_offset_align,
            source: AlignmentSource::Statx,
        }));
    }
    if is_blk {
        let mut sector: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int through the pointer, which is valid.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::BLKSSZGET, &mut sector) };
        if rc == 0 && sector > 0 {
            return Ok(Some(DirectAlignment {
                memory: sector as u32,
                offset: sector as u32,
                source: AlignmentSource::BlockDevice,
            }));
        }
    }
    Ok(Some(DirectAlignment {
        memory: 4096,
        offset: 4096,
        source: AlignmentSource::Assumed,
    }))
}

/// `_IOR(0x12, 114, size_t)`: block device size in bytes (not exported by the libc crate).
const BLKGETSIZE64: libc::Ioctl = 0x8008_1272;

/// Size in bytes of the file or block device behind `fd`.
pub fn file_len(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let stx = statx_fd(fd, libc::STATX_SIZE | libc::STATX_TYPE)?;
    if u32::from(stx.stx_mode) & libc::S_IFMT == libc::S_IFBLK {
        let mut bytes: u64 = 0;
        // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which is valid.
        let rc = unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64, &mut bytes) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        return Ok(bytes);
    }
    Ok(stx.stx_size)
}

/// `statfs` magic of the filesystem behind `fd`.
fn filesystem_magic(fd: BorrowedFd<'_>) -> io::Result<u64> {
    // SAFETY: plain output struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fd is live, st is valid for writes.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as u64)
}

/// Filesystems whose files are generated on each read (no stable size, contents that change
/// between two reads of the same offset): nothing gpuio can split into parallel pieces.
const PSEUDO_FILESYSTEMS: &[(u64, &str)] = &[
    (0x9FA0, "proc"),
    (0x6265_6572, "sysfs"),
    (0x6462_6720, "debugfs"),
    (0x7472_6163, "tracefs"),
    (0x7363_6673, "securityfs"),
    (0x0027_E0EB, "cgroup"),
    (0x6367_7270, "cgroup2"),
    (0x6265_6570, "configfs"),
    (0xCAFE_4A11, "bpf"),
    (0xDE5E_81E4, "efivarfs"),
];

/// The name of the pseudo-filesystem behind `fd`, where it is one (`proc`, `sysfs`, ...).
pub(crate) fn pseudo_filesystem(fd: BorrowedFd<'_>) -> io::Result<Option<&'static str>> {
    let magic = filesystem_magic(fd)?;
    Ok(PSEUDO_FILESYSTEMS
        .iter()
        .find(|(m, _)| *m == magic)
        .map(|(_, name)| *name))
}

/// Whether `name` (as [`filesystem_name`] gives it) is a pseudo-filesystem whose files are
/// generated when read (`proc`, `sysfs`, ...): nothing to split into parallel reads.
pub fn is_pseudo_filesystem(name: &str) -> bool {
    PSEUDO_FILESYSTEMS.iter().any(|(_, n)| *n == name)
}

/// The filesystem type of `path` (which is not opened: it may be a FIFO), as
/// [`filesystem_name`] names it.
pub(crate) fn filesystem_name_of_path(path: &std::path::Path) -> io::Result<String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: plain output struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a NUL-terminated path, st is valid for writes.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(name_of_magic(st.f_type as u64))
}

/// The filesystem type behind `fd`, by name where known (`statfs` magic otherwise).
pub fn filesystem_name(fd: BorrowedFd<'_>) -> io::Result<String> {
    Ok(name_of_magic(filesystem_magic(fd)?))
}

fn name_of_magic(magic: u64) -> String {
    if let Some((_, name)) = PSEUDO_FILESYSTEMS.iter().find(|(m, _)| *m == magic) {
        return name.to_string();
    }
    let name = match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlayfs",
        0x6969 => "nfs",
        0xFF53_4D42 => "cifs",
        0x6573_5546 => "fuse",
        0x2FC1_2FC1 => "zfs",
        0x0BD0_0BD0 => "lustre",
        0x4244 => "hfs",
        0x5346_544E => "ntfs",
        0x4d44 => "vfat",
        0x1CD1 => "devpts",
        _ => return format!("unknown (statfs magic {magic:#x})"),
    };
    name.to_string()
}
