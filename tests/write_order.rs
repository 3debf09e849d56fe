//! Ordering after cancellation: pieces that a dropped or leaked operation left in the kernel
//! must never land after a later overlapping operation has completed. A completed write's
//! bytes are what the file holds; a later read sees them, not a mixture.
//!
//! Each round starts a large write of one pattern, lets some of its pieces reach the kernel,
//! drops (or leaks) it, then writes a second pattern over the same range and reads it back.
//! Before the range fence, 1-4 MiB of the first pattern showed up in a few rounds of a hundred.

mod common;

use common::*;
use gpuio::{Backend, Engine};

const LEN: usize = 16 << 20;
const ROUNDS: usize = 48;

/// Engines with many small pieces in flight at once, so a dropped write has plenty in the
/// kernel: 512 KiB chunks, depth 32, a 32 MiB pool (8 MiB per op).
fn engines() -> Vec<(&'static str, Engine)> {
    let mut v = Vec::new();
    for (name, b, reactors, slots) in [
        ("io_uring", Backend::Uring, 1, 64),
        ("pread", Backend::Pread, 1, 64),
        // Each reactor with the pool of the others: the writes keep to the file's reactor,
        // and the reads after them may go to any.
        ("io_uring, 3 reactors", Backend::Uring, 3, 192),
    ] {
        match Engine::builder()
            .backend(b)
            .chunk_size(512 << 10)
            .queue_depth(32)
            .bounce_slots(slots)
            .reactors(reactors)
            .build()
        {
            Ok(e) => v.push((name, e)),
            Err(e) => skipped(format!("{name} in write-order tests: {e}")),
        }
    }
    v
}

/// Abandons (drops or leaks) writes of one pattern mid-flight and writes another over them,
/// on every backend, buffered and O_DIRECT; checks through the engine and through std that
/// the file holds the later pattern only.
async fn abandoned_then_rewritten_everywhere(leak: bool) {
    let dir = tmpdir();
    let first = vec![0x11u8; LEN];
    let second = vec![0x22u8; LEN];
    let mut failures = Vec::new();
    // One engine per open mode: a leaked write keeps up to a quarter of its engine's pool.
    for mode in [false, true] {
        for (name, engine) in engines() {
            for (direct, path, f) in fresh_rw_files(&engine, dir.path(), name) {
                if direct != mode {
                    continue;
                }
                // A leaked write keeps up to a quarter of the pool for good: three leaks per
                // engine leave room for the rewrites.
                let rounds = if leak { 3 } else { ROUNDS };
                for round in 0..rounds {
                    // Vary how long the abandoned write runs: 0-3 ms after it was filled.
                    let ms = (round % 4) as u64;
                    abandon_write_then_rewrite(&f, 0, &first[..], &second[..], ms, leak).await;
                    let on_disk = differing(&std::fs::read(&path).unwrap(), &second);
                    let mut back = vec![0u8; LEN];
                    assert_eq!(within(f.read_into(&mut back, 0)).await.unwrap(), LEN);
                    let read = differing(&back, &second);
                    if on_disk > 0 {
                        failures.push(format!(
                            "{name} direct={direct} round {round}: {on_disk} bytes of the \
                             abandoned write landed after the later write completed"
                        ));
                    } else if read > 0 {
                        failures.push(format!(
                            "{name} direct={direct} round {round}: a read after the completed \
                             write saw {read} bytes of the abandoned one"
                        ));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_write_never_lands_after_a_later_write() {
    abandoned_then_rewritten_everywhere(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaked_write_never_lands_after_a_later_write() {
    abandoned_then_rewritten_everywhere(true).await;
}

/// Overlapping O_DIRECT writes running at once (issue 18, item 12): one write's buffered edge
/// must never dirty a page that another's direct piece covers at the same time, which the
/// kernel reports as a page-cache invalidation failure (EIO at the next fsync).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_direct_writers_do_not_fail_fsync() {
    let dir = tmpdir();
    let mut ran = false;
    for (name, engine) in engines() {
        let path = dir.path().join(format!("overlap-{name}"));
        std::fs::write(&path, vec![0u8; 4 << 20]).unwrap();
        if !direct_ok(&engine, &path) {
            continue;
        }
        ran = true;
        let f = gpuio::OpenOptions::new()
            .read(true)
            .write(true)
            .direct(true)
            .open(&engine, &path)
            .unwrap();
        for round in 0..64u64 {
            // Unaligned ranges whose edges fall inside pages the other write covers directly.
            let a_off = 1000 + round * 37;
            let b_off = 4096 * 3 + 100 + round * 11;
            let a = vec![0xA0u8 | (round as u8 & 0xF); (1 << 20) + 3000];
            let b = vec![0xB0u8 | (round as u8 & 0xF); (1 << 20) + 5000];
            let (ra, rb) = tokio::join!(f.write_from(&a, a_off), f.write_from(&b, b_off));
            ra.unwrap();
            rb.unwrap();
            within(f.sync_all()).await.unwrap_or_else(|e| {
                panic!("{name} round {round}: fsync after overlapping direct writes: {e}")
            });
        }
    }
    if !ran {
        skipped("overlapping O_DIRECT writers: this filesystem refuses O_DIRECT");
    }
}

/// A filesystem of `mib` MiB mounted on a fresh directory (tmpfs), unmounted on drop; `None`
/// (said loudly) where this machine does not let the test mount one.
struct SmallFs(tempfile::TempDir);

impl SmallFs {
    fn new(mib: u64) -> Option<SmallFs> {
        let dir = tmpdir();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            skipped("ENOSPC test: cannot mount a small tmpfs here (needs root)");
            return None;
        }
        Some(SmallFs(dir))
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.0.path())
            .status();
    }
}

/// A write that runs out of space fails, and its error names the first byte it did not
/// write (issue 18, item 11): everything before that offset holds the new data. Pieces
/// complete out of order, so the first failure to arrive is often a later one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enospc_names_the_first_byte_not_written() {
    let Some(fs) = SmallFs::new(4) else {
        return;
    };
    let data = pattern(16 << 20, 9);
    for (name, engine) in engines() {
        for direct in [false, true] {
            let path = fs.0.path().join(format!("full-{name}-{direct}"));
            std::fs::write(&path, b"").unwrap();
            if direct && !direct_ok(&engine, &path) {
                skipped(format!("ENOSPC test {name}: tmpfs refuses O_DIRECT here"));
                continue;
            }
            let f = gpuio::OpenOptions::new()
                .read(true)
                .write(true)
                .direct(direct)
                .open(&engine, &path)
                .unwrap();
            let e = within(f.write_from(&data, 0))
                .await
                .expect_err("16 MiB cannot fit in a 4 MiB filesystem");
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{name} {direct}: {e}");
            let at = e.context().offset.expect("the error names an offset") as usize;
            assert!(at < data.len(), "{name} direct={direct}: {e}");
            let back = std::fs::read(&path).unwrap();
            assert!(
                back.len() >= at && back[..at] == data[..at],
                "{name} direct={direct}: the error names offset {at}, but bytes before it \
                 were not written (file holds {} bytes): {e}",
                back.len()
            );
            drop(f);
            std::fs::remove_file(&path).unwrap();
        }
    }
}
