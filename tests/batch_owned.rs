//! `BatchPlan::read_owned`: batches into a host buffer the batch owns while it runs, read in
//! place where the file allows (in parts), through bounce slots where it does not (O_DIRECT
//! files with unaligned runs); warm and cold; against `read_into` on the same plan, and with
//! the future dropped or leaked mid-flight.

mod common;

use common::*;
use gpuio::Engine;
use gpuio::batch::{BatchPlan, ReadDesc};

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
                let what = format!("{name}, direct {direct}, cold {cold}");
                let plan = BatchPlan::new(mixed_batch(&f));
                let len = MIXED_BATCH_DST;
                if cold {
                    evict(&path);
                }
                let (owned, buf) = within(plan.read_owned(vec![0xA5u8; len])).await;
                let mut want_buf = vec![0xA5u8; len];
                let want = within(plan.read_into(&mut want_buf[..])).await;
                assert_eq!(buf.len(), len, "{what}: the buffer comes back whole");
                let (got, want) = (owned.results(), want.results());
                check_mixed_batch(&what, got, &buf, want, &want_buf, &data);
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
