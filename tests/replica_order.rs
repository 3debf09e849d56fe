//! Replicated shards read once and copied between ranks (`Replicas::ReadOnce`) keep their
//! order with cudarc's event tracking off, where cudarc orders nothing between two streams of
//! one context: rank 0's stream is held by a kernel while its reads' copies wait behind it,
//! and rank 1's copies out of rank 0's buffer must wait for them. A binary of its own, because
//! event tracking is a switch on the (shared) primary context.

mod common;

use common::*;
use gpuio::safetensors::{Replicas, SafetensorsFile, Shard};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replica_copies_wait_for_the_owner_without_event_tracking() {
    const T: &str = "replica_copies_wait_for_the_owner_without_event_tracking";
    if !gpuio::cuda::available() {
        skipped(format!("{T}: no usable CUDA device"));
        return;
    }
    let ctx = gpuio::cuda::context(0).unwrap();
    // SAFETY: every buffer below is used on the stream it was made on, or ordered across
    // streams by the load itself (what this test checks), and synchronised before it drops.
    unsafe { ctx.disable_event_tracking() };
    let dir = tmpdir();
    let path = dir.path().join("replica.safetensors");
    let mut rng = fastrand::Rng::with_seed(31);
    let tensors: Vec<(String, Vec<u8>)> = (0..8)
        .map(|i| {
            (
                format!("t{i}"),
                (0..(48 << 10)).map(|_| rng.u8(..)).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![b.len()], b)
                .unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let engine = gpuio::Engine::new().unwrap();
    let st = SafetensorsFile::open(&engine, &path).await.unwrap();
    let streams = [ctx.new_stream().unwrap(), ctx.new_stream().unwrap()];
    let mut spinner = Spinner::new(&streams[0]);
    for round in 0..3 {
        // Rank 0 reads the first half of the bytes, rank 1 the second; each copies the other's.
        spinner.hold(&streams[0], 300_000_000);
        let ranks = st
            .load_shards_device_with(&streams, |_| Some(Shard::Replicate), Replicas::ReadOnce)
            .await
            .unwrap();
        for (r, ck) in ranks.iter().enumerate() {
            streams[r].synchronize().unwrap();
            let back = streams[r].clone_dtoh(ck.buffer()).unwrap();
            for (name, bytes) in &tensors {
                let t = ck.tensor(name).unwrap();
                assert!(
                    back[t.buffer_range.clone()] == bytes[..],
                    "round {round}, rank {r}, {name}: a copy ran before its source landed"
                );
            }
        }
        for s in &streams {
            s.synchronize().unwrap();
        }
    }
    // SAFETY: as above; nothing made after this depends on the switch.
    unsafe { ctx.enable_event_tracking() };
}
