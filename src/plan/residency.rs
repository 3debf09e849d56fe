//! Page-cache residency: how much of a file range the page cache holds, asked of the kernel.
//!
//! A buffered read of data the page cache holds is a memory copy (GB/s per core); one of data
//! it does not hold goes through readahead, one page-cache fill after another, and on the
//! machines measured here runs at a quarter to a half of the same disk read with O_DIRECT at
//! depth. So the reactor asks before it reads a large range of a buffered file: pieces the
//! cache holds stay buffered, pieces it mostly lacks go through an O_DIRECT twin descriptor
//! (`Via::Direct`). The kernel keeps the two coherent: a direct read writes back dirty pages of
//! its range before it reads, so it never returns data older than the page cache's.
//!
//! `cachestat(2)` (Linux 6.5+) answers for a range in one call without touching the pages.
//! Older kernels get `mincore(2)` over a read-only shared mapping of the range that is never
//! touched, so nothing is faulted in. Either way the answer is a snapshot: pages can be evicted or
//! read in a moment later, which costs speed, never correctness.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicU8, Ordering};

/// Reads shorter than this stay buffered without asking: a residency check and an aligned,
/// widened direct read cost more than they can save on a small read, and small buffered reads
/// benefit from readahead when they come in sequence.
pub const RESIDENCY_MIN_READ: u64 = 256 << 10;

/// How much of a range the page cache holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Residency {
    /// Pages of the range in the page cache.
    pub cached: u64,
    /// Pages the range spans.
    pub pages: u64,
}

impl Residency {
    /// Whether the page cache holds every page of the range.
    pub fn all_cached(&self) -> bool {
        self.cached >= self.pages
    }

    /// Whether reading the range with O_DIRECT beats reading it through the page cache: a
    /// quarter or more of it is missing. (Direct re-reads the cached part from the disk;
    /// buffered reads the missing part at readahead speed, a fraction of direct's. Past a
    /// quarter missing, the disk time of a buffered read dominates.)
    pub fn prefers_direct(&self) -> bool {
        (self.pages - self.cached.min(self.pages)) * 4 >= self.pages && self.pages > 0
    }
}

/// Which system call answers residency questions on this kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResidencyProbe {
    /// `cachestat(2)`, Linux 6.5+.
    Cachestat,
    /// `mincore(2)` over a shared mapping of the range.
    Mincore,
}

impl std::fmt::Display for ResidencyProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ResidencyProbe::Cachestat => "cachestat(2)",
            ResidencyProbe::Mincore => "mincore(2) (no cachestat: kernel before 6.5)",
        })
    }
}

/// 0: not yet known; 1: cachestat works; 2: cachestat missing (ENOSYS), use mincore.
static PROBE: AtomicU8 = AtomicU8::new(0);

/// The probe this kernel supports (asked once, then remembered).
pub fn probe() -> ResidencyProbe {
    match PROBE.load(Ordering::Relaxed) {
        1 => ResidencyProbe::Cachestat,
        2 => ResidencyProbe::Mincore,
        _ => {
            // Any descriptor answers whether the call exists: ENOSYS comes before the fd is
            // looked at. stdin may be closed, so ask about an fd that is surely not open.
            let range = CachestatRange { off: 0, len: 0 };
            let mut out = CachestatOut::default();
            // SAFETY: `range` and `out` are valid for the call; fd -1 makes it fail (EBADF)
            // where the call exists and ENOSYS where not; nothing else is touched.
            let rc = unsafe { sys_cachestat(-1, &range, &mut out) };
            let missing =
                rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS);
            PROBE.store(if missing { 2 } else { 1 }, Ordering::Relaxed);
            probe()
        }
    }
}

/// How much of `[pos, pos + len)` of the file behind `fd` the page cache holds, counted page
/// by page. The range is widened to whole pages; past the end of the file nothing is cached
/// (so a range past EOF reads as missing, which costs a direct read that returns early).
///
/// The kernel walks every page of the range: about 60 ns a page measured on the CPU VM
/// (250 µs for 16 MiB), too slow for the reactor's per-read question; [`estimate`] samples.
pub fn residency(fd: BorrowedFd<'_>, pos: u64, len: u64) -> io::Result<Residency> {
    let page = page_size();
    let start = pos - pos % page;
    let end = pos.saturating_add(len).next_multiple_of(page);
    let pages = (end - start) / page;
    if pages == 0 {
        return Ok(Residency { cached: 0, pages });
    }
    let cached = match probe() {
        ResidencyProbe::Cachestat => cachestat_count(fd, start, end - start)?,
        ResidencyProbe::Mincore => {
            let (map, _) = FileMapping::covering(fd, start, end - start, page)?;
            map.resident(0, pages as usize, page)?
        }
    };
    Ok(Residency {
        cached: cached.min(pages),
        pages,
    })
}

/// Windows [`estimate`] looks at, spread evenly over the range (first and last page included).
const SAMPLE_WINDOWS: u64 = 8;
/// Pages per window.
const SAMPLE_PAGES: u64 = 2;

/// [`residency`] estimated from [`SAMPLE_WINDOWS`] windows of [`SAMPLE_PAGES`] pages spread
/// over the range (the whole range where it is no larger): a few system calls of a microsecond
/// each, whatever the range's size. The page cache fills and empties in runs (readahead,
/// reclaim of whole LRU batches), so evenly spaced samples find a range that is mostly
/// missing; one that a few scattered pages are missing from reads as cached, and is read
/// through the page cache: slower for those pages, never wrong. The counts are of the sampled
/// pages.
pub fn estimate(fd: BorrowedFd<'_>, pos: u64, len: u64) -> io::Result<Residency> {
    let page = page_size();
    let start = pos - pos % page;
    let end = pos.saturating_add(len).next_multiple_of(page);
    let pages = (end - start) / page;
    if pages <= SAMPLE_WINDOWS * SAMPLE_PAGES {
        return residency(fd, pos, len);
    }
    // Window i starts at page i * (pages - SAMPLE_PAGES) / (SAMPLE_WINDOWS - 1): the first at
    // page 0, the last ending at the range's last page.
    let at = |i: u64| i * (pages - SAMPLE_PAGES) / (SAMPLE_WINDOWS - 1);
    let mut cached = 0;
    match probe() {
        ResidencyProbe::Cachestat => {
            for i in 0..SAMPLE_WINDOWS {
                cached += cachestat_count(fd, start + at(i) * page, SAMPLE_PAGES * page)?;
            }
        }
        ResidencyProbe::Mincore => {
            // One mapping of the range (nothing is faulted in), asked about the windows only.
            let (map, _) = FileMapping::covering(fd, start, end - start, page)?;
            for i in 0..SAMPLE_WINDOWS {
                cached += map.resident(at(i) as usize, SAMPLE_PAGES as usize, page)?;
            }
        }
    }
    Ok(Residency {
        cached: cached.min(SAMPLE_WINDOWS * SAMPLE_PAGES),
        pages: SAMPLE_WINDOWS * SAMPLE_PAGES,
    })
}

/// Cached pages of `[start, start + len)` (page-aligned) by `cachestat`.
fn cachestat_count(fd: BorrowedFd<'_>, start: u64, len: u64) -> io::Result<u64> {
    let range = CachestatRange { off: start, len };
    let mut out = CachestatOut::default();
    // SAFETY: `fd` is open for the call; `range` and `out` are valid for reads and writes of
    // their `#[repr(C)]` layouts, which match the kernel's structs.
    let rc = unsafe { sys_cachestat(fd.as_raw_fd(), &range, &mut out) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(out.nr_cache)
}

/// The kernel's `struct cachestat_range`.
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// The kernel's `struct cachestat`.
#[repr(C)]
#[derive(Default)]
struct CachestatOut {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// `cachestat` has number 451 on every architecture Linux numbers through the generic table
/// (x86_64 and aarch64 included).
const SYS_CACHESTAT: libc::c_long = 451;

/// # Safety
/// `range` and `out` must be valid for the call (they are references here, so they are);
/// `fd` may be anything (the kernel checks it).
unsafe fn sys_cachestat(fd: i32, range: &CachestatRange, out: &mut CachestatOut) -> libc::c_long {
    // SAFETY: the kernel reads one cachestat_range and writes one cachestat, both valid for
    // the call; flags must be 0.
    unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            fd,
            range as *const CachestatRange,
            out as *mut CachestatOut,
            0u32,
        )
    }
}

/// A read-only shared mapping of the pages of a file that hold a byte range, unmapped on drop.
/// The CPU never reads through it: `mincore` asks about it (nothing is faulted in), and mapped
/// reads hand it to the driver, which pins the page-cache pages behind it and lets the GPU DMA
/// from them (`cuda::mapped`). So a file truncated under it cannot raise `SIGBUS` here.
pub(crate) struct FileMapping {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the address is only handed to the kernel (mincore, munmap) and to the driver
// (register, copy, unregister), never dereferenced, so which thread holds it does not matter.
unsafe impl Send for FileMapping {}
// SAFETY: as above; no method reads through the pointer.
unsafe impl Sync for FileMapping {}

impl FileMapping {
    /// Maps the pages (of `page` bytes) of the file behind `fd` that hold bytes
    /// `[pos, pos + len)`; returns the mapping and where byte `pos` sits in it. Nothing is
    /// faulted in. The descriptor must be open for reading.
    pub(crate) fn covering(
        fd: BorrowedFd<'_>,
        pos: u64,
        len: u64,
        page: u64,
    ) -> io::Result<(FileMapping, usize)> {
        let too_big = || io::Error::from_raw_os_error(libc::EOVERFLOW);
        let start = pos - pos % page;
        let in_page = (pos - start) as usize;
        let map_len = usize::try_from(len)
            .ok()
            .and_then(|n| n.checked_add(in_page))
            .and_then(|n| n.checked_next_multiple_of(page as usize))
            .ok_or_else(too_big)?;
        let off = libc::off_t::try_from(start).map_err(|_| too_big())?;
        // SAFETY: a new shared read-only mapping of the file at an address the kernel chooses;
        // it aliases no Rust memory and is only ever passed to the kernel and the driver.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok((FileMapping { addr, len: map_len }, in_page))
    }

    /// Where the mapping starts. Never to be dereferenced by the CPU.
    // Mapped reads (built with `cuda`) are the only users of the address and length.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn addr(&self) -> *mut libc::c_void {
        self.addr
    }

    /// The mapping's length in bytes, whole pages.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Resident pages among `count` pages from page `first` of the mapping.
    fn resident(&self, first: usize, count: usize, page: u64) -> io::Result<u64> {
        let page = page as usize;
        let count = count.min((self.len / page).saturating_sub(first));
        let mut vec = vec![0u8; count];
        // SAFETY: pages `first..first + count` lie inside the mapping (clamped above); `vec`
        // has one byte per page for the kernel to write.
        let rc = unsafe {
            libc::mincore(
                self.addr.cast::<u8>().add(first * page).cast(),
                count * page,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(vec.iter().filter(|b| **b & 1 != 0).count() as u64)
    }
}

impl Drop for FileMapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `covering` made, only here. A mapped read's
        // registrar drops its mapping only after unregistering it, and keeps for good one it
        // could not unregister (`cuda::mapped`), so no pin or copy outlives it.
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as u64 } else { 4096 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    fn evict(f: &std::fs::File) {
        f.sync_all().unwrap();
        // SAFETY: plain advice on an open descriptor.
        let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(rc, 0);
    }

    #[test]
    fn a_written_file_is_cached_an_evicted_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&vec![7u8; 1 << 20]).unwrap();
        let r = residency(f.as_fd(), 0, 1 << 20).unwrap();
        assert_eq!(r.pages, (1 << 20) / page_size());
        assert!(r.all_cached(), "{r:?}");
        assert!(!r.prefers_direct());
        evict(&f);
        let r = residency(f.as_fd(), 0, 1 << 20).unwrap();
        if r.cached == r.pages {
            // tmpfs and similar keep their pages (they are the file): nothing to evict.
            println!("SKIPPED eviction half: the filesystem keeps its pages ({r:?})");
            return;
        }
        assert_eq!(r.cached, 0, "{r:?}");
        assert!(r.prefers_direct());
    }

    #[test]
    fn both_probes_agree() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&vec![1u8; 64 << 10]).unwrap();
        // The mapping needs a readable descriptor (the reactor's always are, for reads).
        let f = std::fs::File::open(&path).unwrap();
        let page = page_size();
        let by_mincore = FileMapping::covering(f.as_fd(), 0, 64 << 10, page)
            .unwrap()
            .0
            .resident(0, ((64 << 10) / page) as usize, page)
            .unwrap();
        let by_probe = residency(f.as_fd(), 0, 64 << 10).unwrap();
        assert_eq!(by_mincore, by_probe.cached);
        assert_eq!(by_probe.pages, (64 << 10) / page);
    }

    #[test]
    fn unaligned_and_empty_ranges_count_whole_pages() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = std::fs::File::create(dir.path().join("f")).unwrap();
        f.write_all(&vec![1u8; 3 * 4096]).unwrap();
        let page = page_size();
        let r = residency(f.as_fd(), 100, 10).unwrap();
        assert_eq!(r.pages, 1);
        assert_eq!(residency(f.as_fd(), 0, 0).unwrap().pages, 0);
        assert!(
            !Residency {
                cached: 0,
                pages: 0
            }
            .prefers_direct()
        );
        let r = residency(f.as_fd(), page - 1, 2).unwrap();
        assert_eq!(r.pages, 2);
    }

    #[test]
    fn an_estimate_samples_large_ranges_and_counts_small_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = std::fs::File::create(&path).unwrap();
        let page = page_size();
        f.write_all(&vec![3u8; (4 << 20) + 5]).unwrap();
        let r = estimate(f.as_fd(), 0, (4 << 20) + 5).unwrap();
        assert_eq!(r.pages, SAMPLE_WINDOWS * SAMPLE_PAGES);
        assert!(r.all_cached(), "{r:?}");
        let r = estimate(f.as_fd(), page, 3 * page).unwrap();
        assert_eq!(r.pages, 3);
        evict(&f);
        if residency(f.as_fd(), 0, 4 << 20).unwrap().cached > 0 {
            println!("SKIPPED eviction half: the filesystem keeps its pages");
            return;
        }
        assert!(estimate(f.as_fd(), 0, 4 << 20).unwrap().prefers_direct());
        // The second half read back in: half the windows find it.
        let reader = std::fs::File::open(&path).unwrap();
        let mut half = vec![0u8; 2 << 20];
        std::os::unix::fs::FileExt::read_exact_at(&reader, &mut half, 2 << 20).unwrap();
        let r = estimate(f.as_fd(), 0, 4 << 20).unwrap();
        assert!(r.cached >= r.pages / 2 && !r.all_cached(), "{r:?}");
        assert!(r.prefers_direct(), "{r:?}");
    }

    #[test]
    fn a_quarter_missing_prefers_direct() {
        assert!(
            !Residency {
                cached: 4,
                pages: 4
            }
            .prefers_direct()
        );
        assert!(
            !Residency {
                cached: 7,
                pages: 8
            }
            .prefers_direct()
        );
        assert!(
            Residency {
                cached: 6,
                pages: 8
            }
            .prefers_direct()
        );
        assert!(
            Residency {
                cached: 0,
                pages: 8
            }
            .prefers_direct()
        );
    }
}
