//! Residency-aware reads of buffered files: ranges the page cache lacks are read with O_DIRECT
//! (so they stay out of the page cache afterwards: that is how these tests see which way a
//! range went), ranges it holds are copied from it, and every byte read is the file's, dirty
//! pages included.

mod common;

use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::path::Path;

use common::{skipped, tmpdir};
use gpuio::plan::residency::{Residency, residency};
use gpuio::{Backend, Engine};

const PAGE: u64 = 4096;

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Writes `data` to `path`, syncs it and drops its pages from the page cache. `None` (with the
/// reason printed) where this filesystem keeps its pages (tmpfs) or takes no O_DIRECT.
fn cold_file(path: &Path, data: &[u8]) -> Option<std::fs::File> {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(data).unwrap();
    evict(&f, 0, data.len() as u64);
    let r = residency(f.as_fd(), 0, data.len() as u64).unwrap();
    if r.cached != 0 {
        skipped(format!(
            "the filesystem under {} keeps its pages after POSIX_FADV_DONTNEED ({r:?}); \
             residency-aware reads need a disk-backed filesystem (set GPUIO_TEST_DIR)",
            path.display()
        ));
        return None;
    }
    use std::os::unix::fs::OpenOptionsExt;
    if std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .is_err()
    {
        skipped(format!("{} takes no O_DIRECT", path.display()));
        return None;
    }
    Some(f)
}

fn evict(f: &std::fs::File, pos: u64, len: u64) {
    f.sync_all().unwrap();
    // SAFETY: advice on an open descriptor; no memory is passed.
    let rc = unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            pos as i64,
            len as i64,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    assert_eq!(rc, 0);
}

fn cached(f: &std::fs::File, pos: u64, len: u64) -> Residency {
    residency(f.as_fd(), pos, len).unwrap()
}

fn engines() -> Vec<(&'static str, Engine)> {
    let mut v = vec![(
        "pread",
        Engine::builder().backend(Backend::Pread).build().unwrap(),
    )];
    match Engine::builder().backend(Backend::Uring).build() {
        Ok(e) => v.push(("uring", e)),
        Err(e) => skipped(format!("io_uring engine: {e}")),
    }
    v
}

#[tokio::test]
async fn a_cold_file_is_read_direct_and_stays_out_of_the_cache() {
    let dir = tmpdir();
    // Not a multiple of the page: the tail is read past end of file and cut short.
    let data = pattern((9 << 20) + 1234, 1);
    for (name, engine) in engines() {
        let path = dir.path().join(format!("cold-{name}"));
        let Some(f) = cold_file(&path, &data) else {
            return;
        };
        let file = engine.open(&path).unwrap();
        assert!(!file.is_direct());
        // An unaligned start: the direct pieces widen to the alignment, the caller gets its
        // bytes only.
        let mut buf = vec![0u8; data.len() - 777 + 4096];
        let n = file.read_into(&mut buf[..], 777).await.unwrap();
        assert_eq!(n, data.len() - 777, "{name}");
        assert!(buf[..n] == data[777..], "{name}: wrong bytes");
        let r = cached(&f, 0, data.len() as u64);
        assert!(
            r.cached * 10 < r.pages,
            "{name}: a cold read went through the page cache ({r:?})"
        );
    }
}

#[tokio::test]
async fn with_residency_off_a_cold_file_fills_the_cache() {
    let dir = tmpdir();
    let data = pattern(4 << 20, 2);
    let path = dir.path().join("off");
    let Some(f) = cold_file(&path, &data) else {
        return;
    };
    let engine = Engine::builder().residency_aware(false).build().unwrap();
    let file = engine.open(&path).unwrap();
    let mut buf = vec![0u8; data.len()];
    assert_eq!(file.read_into(&mut buf[..], 0).await.unwrap(), data.len());
    assert!(buf == data);
    let r = cached(&f, 0, data.len() as u64);
    assert!(r.all_cached(), "{r:?}");
}

#[tokio::test]
async fn a_half_cached_file_reads_the_cached_half_buffered_and_the_rest_direct() {
    let dir = tmpdir();
    let data = pattern(16 << 20, 3);
    for (name, engine) in engines() {
        let path = dir.path().join(format!("half-{name}"));
        let Some(f) = cold_file(&path, &data) else {
            return;
        };
        // Warm the first half the ordinary way.
        let half = data.len() / 2;
        let mut warm = vec![0u8; half];
        let reader = std::fs::File::open(&path).unwrap();
        std::os::unix::fs::FileExt::read_exact_at(&reader, &mut warm, 0).unwrap();
        // Readahead (8 MiB on some VMs) may have pulled in the second half too.
        evict(&f, half as u64, half as u64);
        assert!(cached(&f, 0, half as u64).all_cached());
        assert_eq!(cached(&f, half as u64, half as u64).cached, 0);
        let file = engine.open(&path).unwrap();
        let mut buf = vec![0u8; data.len()];
        assert_eq!(file.read_into(&mut buf[..], 0).await.unwrap(), data.len());
        assert!(buf == data, "{name}: wrong bytes");
        assert!(cached(&f, 0, half as u64).all_cached(), "{name}");
        let r = cached(&f, half as u64, half as u64);
        assert!(
            r.cached * 10 < r.pages,
            "{name}: the cold half went through the page cache ({r:?})"
        );
    }
}

#[tokio::test]
async fn dirty_pages_in_a_cold_range_are_read_as_written() {
    let dir = tmpdir();
    let data = pattern(8 << 20, 4);
    let path = dir.path().join("dirty");
    let Some(f) = cold_file(&path, &data) else {
        return;
    };
    // A few dirty pages inside otherwise uncached 4 MiB pieces: the pieces go direct, and the
    // kernel must write the dirty pages back before it reads them.
    let mut expect = data.clone();
    for at in [5 * PAGE + 17, (3 << 20) + 100, (6 << 20) + 4095] {
        let new = pattern(3000, at);
        std::os::unix::fs::FileExt::write_all_at(&f, &new, at).unwrap();
        expect[at as usize..at as usize + new.len()].copy_from_slice(&new);
    }
    let r = cached(&f, 0, data.len() as u64);
    assert!(r.prefers_direct(), "{r:?}");
    for (name, engine) in engines() {
        let file = engine.open(&path).unwrap();
        let mut buf = vec![0u8; data.len()];
        assert_eq!(file.read_into(&mut buf[..], 0).await.unwrap(), data.len());
        assert!(
            buf == expect,
            "{name}: a direct read missed dirty page-cache data"
        );
    }
}

#[tokio::test]
async fn small_reads_and_owned_reads_stay_buffered() {
    let dir = tmpdir();
    let data = pattern(2 << 20, 5);
    let path = dir.path().join("small");
    let Some(f) = cold_file(&path, &data) else {
        return;
    };
    let engine = Engine::new().unwrap();
    let file = engine.open(&path).unwrap();
    // Below the threshold: buffered, so its pages are cached afterwards.
    let mut small = vec![0u8; 64 << 10];
    assert_eq!(
        file.read_into(&mut small[..], 0).await.unwrap(),
        small.len()
    );
    assert!(small[..] == data[..64 << 10]);
    assert!(cached(&f, 0, 64 << 10).all_cached());
    // Owned reads land in place, exactly the caller's range: never widened for O_DIRECT.
    let (n, owned) = file.read_owned(vec![0u8; 1 << 20], (1 << 20) + 3).await;
    let n = n.unwrap();
    assert_eq!(n, (1 << 20) - 3);
    assert!(owned[..n] == data[(1 << 20) + 3..]);
}

#[tokio::test]
async fn a_batch_of_a_cold_file_reads_direct() {
    let dir = tmpdir();
    let data = pattern(6 << 20, 6);
    let path = dir.path().join("batch");
    let Some(f) = cold_file(&path, &data) else {
        return;
    };
    let engine = Engine::new().unwrap();
    let file = engine.open(&path).unwrap();
    // Two large contiguous descriptors merge into one read; a small one far away stays small.
    let descs = vec![
        gpuio::batch::ReadDesc::new(&file, 0, 2 << 20, 0),
        gpuio::batch::ReadDesc::new(&file, 2 << 20, 2 << 20, 2 << 20),
        gpuio::batch::ReadDesc::new(&file, 5 << 20, 4096, 4 << 20),
    ];
    let plan = gpuio::batch::BatchPlan::new(descs);
    let mut buf = vec![0u8; (4 << 20) + 4096];
    let done = plan.read_into(&mut buf[..]).await;
    done.exact(plan.descs()).unwrap();
    assert!(buf[..4 << 20] == data[..4 << 20]);
    assert!(buf[4 << 20..] == data[5 << 20..(5 << 20) + 4096]);
    let r = cached(&f, 0, 4 << 20);
    assert!(r.cached * 10 < r.pages, "{r:?}");
}
