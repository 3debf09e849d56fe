//! `File::read_into_blocking` and `BatchPlan::read_into_blocking`: the caller's memory lent
//! to the kernel for the call, read in place where the file allows (buffered files past the
//! in-poll size, O_DIRECT with aligned memory), through bounce slots where it does not; warm
//! and cold; against `read_into` and `pread`; and a stopped batch lets go of the memory before
//! it returns.

mod common;

use common::*;
use gpuio::batch::{BatchPlan, ReadDesc};
use gpuio::{AlignedBuf, Engine, Error, Progress};

/// Every engine of the suite (whose buffered reads land in place on hosts with at least
/// `LEND_MIN_COPIES` page-cache copies, and through bounce slots on smaller ones, such as CI's),
/// and one that lends whatever the host: three copies, no read served in poll past 64 KiB (so
/// reads of a few MiB of a buffered file land in place), a 4 MiB pool (1 MiB parts).
fn engines_and_in_place_ones() -> Vec<(&'static str, Engine)> {
    let mut v = engines();
    let lending = Engine::builder()
        .chunk_size(256 << 10)
        .bounce_slots(16)
        .page_cache_read_max(64 << 10)
        .page_cache_copies(gpuio::plan::sizing::LEND_MIN_COPIES)
        .build()
        .unwrap();
    v.push(("io_uring, in place past 64 KiB, 4 MiB pool", lending));
    v
}

#[test]
fn buffered_reads_land_in_place_from_three_page_cache_copies() {
    let lends = |n| {
        Engine::builder()
            .page_cache_copies(n)
            .sizing()
            .lends_buffered_reads()
    };
    let (two, why) = lends(2);
    assert!(!two && why.contains("bounce slots"), "{why}");
    let (three, why) = lends(3);
    assert!(three && why.contains("land in place"), "{why}");
}

#[test]
fn blocking_reads_give_what_pread_gives() {
    let dir = tmpdir();
    let flen = 20 << 20;
    let (path, data) = test_file(dir.path(), "b.bin", flen, 41);
    let cases: [(u64, usize); 7] = [
        (0, flen),                           // the whole file: in place past every in-poll limit
        (4097, (5 << 20) + 3),               // unaligned
        (8192, 1 << 20),                     // aligned
        (flen as u64 - 100, 4000),           // short at the end of the file
        (flen as u64 + 10, 4096),            // past the end: nothing
        (77, 0),                             // empty
        ((3 << 20) + 512, (17 << 20) - 512), // to the end exactly
    ];
    for (name, engine) in engines_and_in_place_ones() {
        for (direct, f) in buffered_and_direct(&engine, &path) {
            for cold in [false, true] {
                for &(offset, len) in &cases {
                    let what = format!("{name}, direct {direct}, cold {cold}, {offset}+{len}");
                    let want = pread_ref(&path, offset, len);
                    if cold {
                        evict(&path);
                    }
                    // Canaries around the destination: nothing lands outside it.
                    let mut c = Canaried::new(len, 4096);
                    let n = f.read_into_blocking(c.inner(), offset).unwrap_or_else(|e| {
                        panic!("{what}: {e}");
                    });
                    assert_eq!(n, want.len(), "{what}: bytes read");
                    assert!(c.inner()[..n] == want[..], "{what}: the bytes");
                    c.check_guards();
                    // Aligned memory: an O_DIRECT read lands in place too.
                    let mut a = AlignedBuf::zeroed(len);
                    if direct && offset % 4096 == 0 && len % 4096 == 0 {
                        let n = f.read_into_blocking(&mut a, offset).unwrap();
                        assert_eq!(n, want.len(), "{what}: aligned, bytes read");
                        assert!(a[..n] == want[..], "{what}: aligned, the bytes");
                    }
                }
            }
        }
        // The data is the file's, once more after all the reads above.
        let f = engine.open(&path).unwrap();
        let mut all = vec![0u8; flen];
        assert_eq!(f.read_into_blocking(&mut all, 0).unwrap(), flen, "{name}");
        assert!(all == data, "{name}: the whole file");
    }
}

#[test]
fn blocking_reads_refuse_bad_input_and_touch_nothing() {
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "bad.bin", 1 << 20, 5);
    let engine = Engine::builder().build().unwrap();
    let f = engine.open(&path).unwrap();
    let mut buf = vec![0x3Cu8; 8 << 20];
    let e = f.read_into_blocking(&mut buf, u64::MAX - 10).unwrap_err();
    assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
    assert!(buf.iter().all(|&b| b == 0x3C), "nothing written");
    let w = gpuio::OpenOptions::new()
        .write(true)
        .open(&engine, &path)
        .unwrap();
    let e = w.read_into_blocking(&mut buf, 0).unwrap_err();
    assert!(
        matches!(e, Error::InvalidInput { .. } | Error::Io { .. }),
        "a file not opened for reading: {e}"
    );
    assert!(buf.iter().all(|&b| b == 0x3C), "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_batches_give_what_async_batches_give() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "bb.bin", 9 << 20, 43);
    for (name, engine) in engines_and_in_place_ones() {
        for (direct, f) in buffered_and_direct(&engine, &path) {
            for cold in [false, true] {
                let what = format!("{name}, direct {direct}, cold {cold}");
                let plan = BatchPlan::new(mixed_batch(&f));
                let len = MIXED_BATCH_DST;
                if cold {
                    evict(&path);
                }
                let mut got_buf = Canaried::new(len, 4096);
                let got = tokio::task::block_in_place(|| plan.read_into_blocking(got_buf.inner()));
                got_buf.check_guards();
                let mut want_buf = vec![0xC5u8; len];
                let want = within(plan.read_into(&mut want_buf[..])).await;
                let (got, want) = (got.results(), want.results());
                check_mixed_batch(&what, got, got_buf.inner(), want, &want_buf, &data);
            }
        }
    }
}

#[test]
fn a_stopped_blocking_batch_lets_go_before_it_returns() {
    let dir = tmpdir();
    let flen = 64 << 20;
    let (path, data) = test_file(dir.path(), "s.bin", flen, 47);
    for (name, engine) in engines_and_in_place_ones() {
        let f = engine.open(&path).unwrap();
        let plan = BatchPlan::new(vec![ReadDesc::new(&f, 0, flen, 0)]);
        evict(&path);
        let mut buf = vec![0u8; flen];
        let progress = Progress::new();
        let mut asked = 0;
        let out = plan.read_into_blocking_with_progress(&mut buf, &progress, &mut || {
            asked += 1;
            false
        });
        // The first ask comes once the reads are under way, and a cold 64 MiB read is not
        // done by then.
        assert_eq!(asked, 1, "{name}: asked once, then stopped");
        assert!(out.is_none(), "{name}: a stopped batch gives no result");
        assert_eq!(
            progress.total(),
            flen as u64,
            "{name}: the total was known at once"
        );
        // Nothing writes the buffer once the call has returned: it stays as it was left.
        let left = buf.clone();
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(buf == left, "{name}: written after the call returned");
        // What landed is the file's, and the engine reads on.
        let landed = buf
            .iter()
            .zip(&data)
            .filter(|(a, b)| a != b && **a != 0)
            .count();
        assert_eq!(landed, 0, "{name}: only the file's bytes landed");
        let mut again = vec![0u8; flen];
        assert_eq!(f.read_into_blocking(&mut again, 0).unwrap(), flen, "{name}");
        assert!(again == data, "{name}: read again after the stop");
    }
}

/// A reactor that dies (an injected panic) with a blocking read of lent memory in the kernel:
/// the kernel may write that memory at any time and nothing would say when it stops, so the
/// process aborts with a message rather than return. Runs in a child process of this test
/// binary.
#[test]
fn a_reactor_death_with_a_lent_read_in_the_kernel_aborts() {
    const CHILD: &str = "GPUIO_TEST_LENT_READ_DEATH";
    const NAME: &str = "a_reactor_death_with_a_lent_read_in_the_kernel_aborts";
    if std::env::var_os(CHILD).is_some() {
        // No core file from the abort to come (the engine's pool would be in it).
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: a valid rlimit; lowering this process's own core size changes no memory.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &none) };
        let dir = tmpdir();
        let (path, _) = test_file(dir.path(), "d.bin", 8 << 20, 3);
        let engine = Engine::builder()
            .page_cache_read_max(64 << 10)
            .page_cache_copies(gpuio::plan::sizing::LEND_MIN_COPIES)
            .build()
            .unwrap();
        let f = engine.open(&path).unwrap();
        // Armed before the read is sent: its first completion panics the reactor, with that
        // piece (and any others) still the kernel's as far as the reactor knows.
        engine.inject_reactor_panic();
        let mut buf = vec![0u8; 8 << 20];
        let r = f.read_into_blocking(&mut buf, 0);
        println!("RETURNED: {r:?}");
        std::process::exit(3);
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGABRT),
        "the child should abort ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stderr.contains("so the process aborts rather than return it"),
        "{stderr}"
    );
    assert!(!stdout.contains("RETURNED"), "{stdout}");
}
