//! `BatchPlan::read_owned`: batches into a host buffer the batch owns while it runs, read in
//! place where the file allows (in parts), through bounce slots where it does not (O_DIRECT
//! files with unaligned runs); warm and cold; against `read_into` on the same plan, and with
//! the future dropped or leaked mid-flight.

mod common;

use std::os::fd::AsRawFd;

use common::*;
use gpuio::batch::{BatchPlan, ReadDesc};
use gpuio::{Engine, Error};

/// Drops `path`'s pages from the page cache, so the next reads of it find it cold.
fn evict(path: &std::path::Path) {
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: a valid descriptor; the advice changes no memory of this process.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "posix_fadvise(DONTNEED)");
}

/// Every engine of the suite, and one with a 4 MiB pool (a 1 MiB window: runs in 1 MiB parts,
/// one at a time).
fn engines_and_a_small_pool() -> Vec<(&'static str, Engine)> {
    let mut v = engines();
    let small = Engine::builder()
        .chunk_size(256 << 10)
        .bounce_slots(16)
        .build()
        .unwrap();
    v.push(("io_uring, 4 MiB pool", small));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_batches_give_what_borrowed_ones_give() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "o.bin", 9 << 20, 31);
    for (name, engine) in engines_and_a_small_pool() {
        for (direct, f) in buffered_and_direct(&engine, &path) {
            for cold in [false, true] {
                let descs = vec![
                    ReadDesc::new(&f, 4097, 5 << 20, 0),       // 0 large, unaligned
                    ReadDesc::new(&f, 6 << 20, 3000, 5 << 20), // 1 small
                    ReadDesc::new(&f, 8 << 20, 8192, (5 << 20) + 4096), // 2 aligned
                    ReadDesc::new(&f, (9 << 20) - 100, 4000, 6 << 20), // 3 short at EOF
                    ReadDesc::new(&f, 5, 0, 100),              // 4 empty
                    ReadDesc::new(&f, 0, 4096, 7 << 20),       // 5 past the buffer's end
                    ReadDesc::new(&f, 2 << 20, (1 << 20) + 5, 3 << 20), // 6 overlaps 0's dst
                ];
                let what = format!("{name}, direct {direct}, cold {cold}");
                let plan = BatchPlan::new(descs.clone());
                let len = (6 << 20) + 8192;
                if cold {
                    evict(&path);
                }
                let (owned, buf) = within(plan.read_owned(vec![0xA5u8; len])).await;
                let mut want_buf = vec![0xA5u8; len];
                let want = within(plan.read_into(&mut want_buf[..])).await;
                let (owned, want) = (owned.into_results(), want.into_results());
                assert_eq!(buf.len(), len, "{what}: the buffer comes back whole");
                for (i, (a, b)) in owned.iter().zip(&want).enumerate() {
                    match (a, b) {
                        (Ok(x), Ok(y)) => assert_eq!(x, y, "{what}: descriptor {i}"),
                        (Err(Error::InvalidInput { .. }), Err(Error::InvalidInput { .. })) => {}
                        _ => panic!("{what}: descriptor {i}: {a:?} against {b:?}"),
                    }
                }
                assert!(
                    matches!(owned[5], Err(Error::InvalidInput { .. })),
                    "{what}"
                );
                assert_eq!(owned[3].as_ref().ok(), Some(&100), "{what}: short at EOF");
                let d0 = &descs[0];
                assert!(
                    buf[..d0.len] == data[4097..4097 + d0.len],
                    "{what}: the large run's bytes"
                );
                assert!(buf == want_buf, "{what}: the same bytes as read_into");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_batch_dropped_or_leaked_mid_flight_then_engine_still_works() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "d.bin", 24 << 20, 32);
    for (name, engine) in engines_and_a_small_pool() {
        let f = engine.open(&path).unwrap();
        for leak in [false, true] {
            for cold in [false, true] {
                if cold {
                    evict(&path);
                }
                let plan = BatchPlan::new(vec![
                    ReadDesc::new(&f, 0, 20 << 20, 0),
                    ReadDesc::new(&f, 21 << 20, 1 << 20, 20 << 20),
                ]);
                let fut = Box::pin(plan.read_owned(vec![0u8; 21 << 20]));
                abandon_mid_flight(fut, 2, leak);
                // The engine still serves reads, and they give the file's bytes.
                let (r, buf) = within(plan.read_owned(vec![0u8; 21 << 20])).await;
                assert_eq!(r.total().unwrap(), 21 << 20, "{name}, leak {leak}");
                assert!(buf[..20 << 20] == data[..20 << 20], "{name}, leak {leak}");
            }
        }
    }
}
