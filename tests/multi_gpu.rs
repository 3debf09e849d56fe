//! Several GPUs behind one engine: reads into each GPU's memory at once, and reads abandoned
//! mid-flight on every device. Skipped loudly on machines with fewer than two GPUs.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use gpuio::Engine;
use gpuio::cuda::cudarc::driver::{CudaContext, CudaSlice};

/// Contexts of every GPU, or `None` (said loudly) where there are fewer than two.
fn gpus(test: &str) -> Option<Vec<Arc<CudaContext>>> {
    let n = if gpuio::cuda::available() {
        gpuio::cuda::probe().devices.len()
    } else {
        0
    };
    if n < 2 {
        skipped(format!("{test}: needs two GPUs, this machine has {n}"));
        return None;
    }
    Some((0..n).map(|i| gpuio::cuda::context(i).unwrap()).collect())
}

/// Every GPU gets eight tasks at once, each on its own stream, reading random ranges (small
/// ones served from the page cache on the polling thread, large ones through the bounce pool)
/// into its own memory; every byte is checked on the device it landed on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reads_into_every_gpu_at_once() {
    let Some(ctxs) = gpus("reads_into_every_gpu_at_once") else {
        return;
    };
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "many", 64 << 20, 71);
    let data = Arc::new(data);
    let engine = Engine::new().unwrap();
    let f = Arc::new(engine.open(&path).unwrap());
    let mut set = tokio::task::JoinSet::new();
    for (g, ctx) in ctxs.iter().enumerate() {
        for t in 0..8u64 {
            let (f, data, ctx) = (f.clone(), data.clone(), ctx.clone());
            set.spawn(async move {
                let stream = ctx.new_stream().unwrap();
                let mut rng = fastrand::Rng::with_seed(t * 31 + g as u64);
                for i in 0..24 {
                    let len = if i % 3 == 0 {
                        rng.usize(1..=gpuio::CACHED_READ_MAX)
                    } else {
                        rng.usize(1..6 << 20)
                    };
                    let off = rng.usize(0..data.len() - len);
                    let mut d = stream.alloc_zeros::<u8>(len).unwrap();
                    let n = f.read_into(&mut d, off as u64).await.unwrap();
                    assert_eq!(n, len);
                    let got = stream.clone_dtoh(&d).unwrap();
                    assert!(
                        got == data[off..off + len],
                        "GPU {g}: {len} bytes at {off}: {} differ",
                        differing(&got, &data[off..off + len])
                    );
                }
            });
        }
    }
    while let Some(r) = set.join_next().await {
        r.unwrap();
    }
}

/// A large read into each GPU's memory, dropped or leaked mid-flight; the memory is then
/// freed and allocated again on that GPU: nothing may land in it afterwards. The engine then
/// still reads into every GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn abandoned_reads_on_every_gpu_write_nothing_after() {
    let Some(ctxs) = gpus("abandoned_reads_on_every_gpu_write_nothing_after") else {
        return;
    };
    const LEN: usize = 128 << 20;
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "big", LEN, 72);
    let (full, _) = test_file(dir.path(), "full", 16 << 20, 73);
    let engine = Engine::builder()
        .chunk_size(1 << 20)
        .queue_depth(8)
        .bounce_slots(64)
        .build()
        .unwrap();
    let f = engine.open(&path).unwrap();
    for leak in [false, true] {
        for (g, ctx) in ctxs.iter().enumerate() {
            let stream = ctx.new_stream().unwrap();
            let mut doomed = stream.alloc_zeros::<u8>(LEN).unwrap();
            abandon_mid_flight(Box::pin(f.read_into(&mut doomed, 0)), 2, leak);
            drop(doomed);
            let fresh: Vec<CudaSlice<u8>> = (0..4)
                .map(|_| stream.clone_htod(&vec![0x77u8; LEN / 4]).unwrap())
                .collect();
            // Let whatever the abandoned read left in flight drain through the engine.
            let g2 = engine.open(&full).unwrap();
            let mut b = vec![0u8; 16 << 20];
            g2.read_into(&mut b, 0).await.unwrap();
            tokio::time::sleep(Duration::from_millis(30)).await;
            ctx.synchronize().unwrap();
            for d in &fresh {
                assert!(
                    stream.clone_dtoh(d).unwrap().iter().all(|&b| b == 0x77),
                    "GPU {g} leak={leak}: freed memory written by an abandoned read"
                );
            }
        }
    }
    for (g, ctx) in ctxs.iter().enumerate() {
        let stream = ctx.new_stream().unwrap();
        let mut d = stream.alloc_zeros::<u8>(3 << 20).unwrap();
        assert_eq!(f.read_into(&mut d, 12345).await.unwrap(), 3 << 20);
        assert!(
            stream.clone_dtoh(&d).unwrap() == data[12345..12345 + (3 << 20)],
            "GPU {g} after the abandoned reads"
        );
    }
    tokio::time::timeout(Duration::from_secs(30), engine.shutdown())
        .await
        .expect("shutdown hung")
        .unwrap();
}

/// One batch spread over every GPU (`SpreadPlan`): small and large descriptors interleaved,
/// each into a buffer on the GPU it names, all at once; every byte is checked on its device.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_batch_spread_over_every_gpu() {
    let Some(ctxs) = gpus("one_batch_spread_over_every_gpu") else {
        return;
    };
    use gpuio::batch::{ReadDesc, SpreadPlan};
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "spread", 32 << 20, 73);
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    let mut rng = fastrand::Rng::with_seed(9);
    let mut at = vec![0usize; ctxs.len()];
    let descs: Vec<(usize, ReadDesc)> = (0..96)
        .map(|i| {
            let to = i % ctxs.len();
            let len = if i % 4 == 0 {
                rng.usize(1 << 20..4 << 20)
            } else {
                rng.usize(1..16 << 10)
            };
            let off = rng.usize(0..data.len() - len);
            let d = ReadDesc::new(&f, off as u64, len, at[to]);
            at[to] += len + 512;
            (to, d)
        })
        .collect();
    let plan = SpreadPlan::new(ctxs.len(), descs.clone());
    let streams: Vec<_> = ctxs.iter().map(|c| c.new_stream().unwrap()).collect();
    let mut bufs: Vec<CudaSlice<u8>> = streams
        .iter()
        .enumerate()
        .map(|(g, s)| s.alloc_zeros::<u8>(plan.dst_len(g)).unwrap())
        .collect();
    let total = plan
        .read_into(&mut bufs)
        .await
        .exact(&plan.descs())
        .unwrap();
    assert_eq!(total, descs.iter().map(|(_, d)| d.len).sum::<usize>());
    for (g, (s, buf)) in streams.iter().zip(&bufs).enumerate() {
        let got = s.clone_dtoh(buf).unwrap();
        for (i, (_, d)) in descs.iter().enumerate().filter(|(_, (to, _))| *to == g) {
            let want = &data[d.offset as usize..d.offset as usize + d.len];
            assert!(
                &got[d.dst_offset..d.dst_offset + d.len] == want,
                "GPU {g}, descriptor {i}: {} bytes differ",
                differing(&got[d.dst_offset..d.dst_offset + d.len], want)
            );
        }
    }
}
