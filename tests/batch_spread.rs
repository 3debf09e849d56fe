//! One batch spread over several host buffers (`SpreadPlan`) on every backend; over several
//! GPUs in `multi_gpu.rs`.

mod common;

use common::*;
use gpuio::Error;
use gpuio::batch::{ReadDesc, SpreadPlan};

/// The bytes a descriptor should give: the file's, clipped at its end.
fn expected(data: &[u8], d: &ReadDesc) -> Vec<u8> {
    let start = (d.offset as usize).min(data.len());
    data[start..(start + d.len).min(data.len())].to_vec()
}

/// One batch over three host buffers: each descriptor lands in the buffer it names, results
/// come back in the order given, and the errors (a destination that does not exist, an overlap
/// within one buffer, a wrong number of buffers) name descriptors by their place in that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spread_batches_land_in_the_buffer_each_descriptor_names() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "s.bin", 1 << 20, 11);
    for (name, engine) in engines() {
        let f = engine.open(&path).unwrap();
        let descs = vec![
            (2, ReadDesc::new(&f, 0, 5000, 0)),               // 0
            (0, ReadDesc::new(&f, 9000, 300 << 10, 0)),       // 1: large, pieces in parallel
            (1, ReadDesc::new(&f, 7, 10, 100)),               // 2
            (3, ReadDesc::new(&f, 0, 10, 0)),                 // 3: no destination 3
            (2, ReadDesc::new(&f, 100, 10, 4000)),            // 4: overlaps 0's range in buffer 2
            (0, ReadDesc::new(&f, 500_000, 4096, 300 << 10)), // 5
            (1, ReadDesc::new(&f, (1 << 20) - 4, 8, 0)),      // 6: short at end of file
        ];
        let plan = SpreadPlan::new(3, descs.clone());
        assert_eq!(plan.destinations(), 3);
        assert_eq!(
            (
                plan.dst_len(0),
                plan.dst_len(1),
                plan.dst_len(2),
                plan.dst_len(9)
            ),
            ((300 << 10) + 4096, 110, 5000, 0),
            "{name}"
        );
        let mut bufs: Vec<Vec<u8>> = (0..3).map(|d| vec![0u8; plan.dst_len(d)]).collect();
        let r = plan.read_into(&mut bufs).await.into_results();
        assert_eq!(r.len(), descs.len());
        let given: Vec<(u64, usize)> = plan
            .descs()
            .iter()
            .map(|d| (d.offset, d.dst_offset))
            .collect();
        let want: Vec<(u64, usize)> = descs
            .iter()
            .map(|(_, d)| (d.offset, d.dst_offset))
            .collect();
        assert_eq!(given, want, "{name}: descriptors in the order given");
        for (i, (to, d)) in descs.iter().enumerate() {
            match (i, &r[i]) {
                (3, Err(Error::InvalidInput { .. })) => {
                    assert!(
                        r[i].as_ref()
                            .unwrap_err()
                            .to_string()
                            .contains("descriptor 3")
                    )
                }
                (4, Err(e @ Error::InvalidInput { .. })) => {
                    let why = e.to_string();
                    assert!(
                        why.contains("descriptor 4") && why.contains("descriptor 0"),
                        "{why}"
                    )
                }
                (3 | 4, other) => panic!("{name}: descriptor {i}: {other:?}"),
                (_, Ok(n)) => {
                    let want = expected(&data, d);
                    assert_eq!(*n, want.len(), "{name}: descriptor {i}");
                    assert_eq!(
                        &bufs[*to][d.dst_offset..d.dst_offset + n],
                        &want[..],
                        "{name}: {i}"
                    );
                }
                (_, Err(e)) => panic!("{name}: descriptor {i}: {e}"),
            }
        }
        // Two buffers for a three-destination plan: every descriptor fails, nothing is read.
        let mut two: Vec<Vec<u8>> = (0..2).map(|_| vec![0xEEu8; 8]).collect();
        let r = plan.read_into(&mut two).await.into_results();
        assert!(
            r.iter()
                .all(|x| matches!(x, Err(Error::InvalidInput { .. }))),
            "{name}: {r:?}"
        );
        assert!(two.iter().all(|b| b.iter().all(|&x| x == 0xEE)));
    }
}
