//! Tensor-parallel loading (`SafetensorsFile::plan_shards`, `load_shards_host`,
//! `load_shards_device`): every rank's shard of every tensor checked byte for byte against the
//! tensor sliced here, splits along every dimension, replication (each rank reading it, or
//! one rank reading it and the others copying), one-rank tensors, and rules that do not fit a
//! tensor. The device part runs where a GPU exists (ranks spread over the
//! GPUs there are) and says loudly where it does not.

mod common;

use std::collections::HashMap;

use common::*;
use gpuio::Error;
use gpuio::safetensors::{Dtype, Replicas, SafetensorsFile, Shard};

/// Name, dtype, element size in bytes, shape.
const TENSORS: &[(&str, Dtype, usize, &[usize])] = &[
    ("embed", Dtype::F32, 4, &[12, 6]),
    ("attn.qkv", Dtype::BF16, 2, &[6, 4, 12]),
    ("mlp.up", Dtype::F32, 4, &[5, 12]),
    ("norm", Dtype::F32, 4, &[12]),
    ("head", Dtype::U8, 1, &[3, 7]),
    ("empty", Dtype::F32, 4, &[0, 6]),
];

/// Writes the checkpoint; returns its path and each tensor's bytes.
fn checkpoint(dir: &std::path::Path) -> (std::path::PathBuf, HashMap<String, Vec<u8>>) {
    let mut rng = fastrand::Rng::with_seed(77);
    let bytes: HashMap<String, Vec<u8>> = TENSORS
        .iter()
        .map(|(name, _, size, shape)| {
            let n = shape.iter().product::<usize>() * size;
            (name.to_string(), (0..n).map(|_| rng.u8(..)).collect())
        })
        .collect();
    let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = TENSORS
        .iter()
        .map(|(name, dtype, _, shape)| {
            let v = safetensors::tensor::TensorView::new(*dtype, shape.to_vec(), &bytes[*name])
                .unwrap();
            (*name, v)
        })
        .collect();
    let path = dir.join("tp.safetensors");
    safetensors::serialize_to_file(views, None, &path).unwrap();
    (path, bytes)
}

/// Rank `rank`'s part of a tensor of `shape` (elements of `size` bytes) split along `d`.
fn slice(
    bytes: &[u8],
    shape: &[usize],
    size: usize,
    d: usize,
    rank: usize,
    ranks: usize,
) -> Vec<u8> {
    let outer: usize = shape[..d].iter().product();
    let inner: usize = shape[d + 1..].iter().product::<usize>() * size;
    let part = shape[d] / ranks;
    (0..outer)
        .flat_map(|o| {
            let at = (o * shape[d] + rank * part) * inner;
            bytes[at..at + part * inner].to_vec()
        })
        .collect()
}

/// The rule the tests load with: qkv split along its last dimension (strided), embed along
/// its first (contiguous), mlp.up along its second, the norm replicated, the head on the last
/// rank only, the empty tensor split, and nothing else.
fn rule(ranks: usize) -> impl FnMut(&gpuio::safetensors::FileTensor) -> Option<Shard> {
    move |t| match t.name.as_str() {
        "embed" => Some(Shard::Split(0)),
        "attn.qkv" => Some(Shard::Split(2)),
        "mlp.up" => Some(Shard::Split(1)),
        "norm" => Some(Shard::Replicate),
        "head" => Some(Shard::Only(ranks - 1)),
        "empty" => Some(Shard::Split(1)),
        _ => None,
    }
}

/// What rank `rank` should hold for `name`: its shape and bytes (`None`: nothing).
fn expected(
    bytes: &HashMap<String, Vec<u8>>,
    name: &str,
    rank: usize,
    ranks: usize,
) -> Option<(Vec<usize>, Vec<u8>)> {
    let &(_, _, size, shape) = TENSORS.iter().find(|t| t.0 == name)?;
    let b = &bytes[name];
    let split = |d: usize| {
        let mut s = shape.to_vec();
        s[d] /= ranks;
        Some((s, slice(b, shape, size, d, rank, ranks)))
    };
    match name {
        "embed" => split(0),
        "attn.qkv" => split(2),
        "mlp.up" | "empty" => split(1),
        "norm" => Some((shape.to_vec(), b.clone())),
        "head" => (rank == ranks - 1).then(|| (shape.to_vec(), b.clone())),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_match_the_tensors_sliced_by_hand() {
    let dir = tmpdir();
    let (path, bytes) = checkpoint(dir.path());
    for (label, engine) in engines() {
        let st = SafetensorsFile::open(&engine, &path).await.unwrap();
        for ranks in [1, 2, 3, 6] {
            let shards = st.load_shards_host(ranks, rule(ranks)).await.unwrap();
            assert_eq!(shards.len(), ranks);
            for (rank, ckpt) in shards.iter().enumerate() {
                for (name, ..) in TENSORS {
                    let want = expected(&bytes, name, rank, ranks);
                    match (ckpt.tensor(name), want) {
                        (None, None) => {}
                        (Some(t), Some((shape, data))) => {
                            assert_eq!(
                                t.shape, shape,
                                "{label} {ranks} ranks, rank {rank}, {name}"
                            );
                            if !data.is_empty() {
                                assert_eq!(t.buffer_range.start % 256, 0, "{name} aligned");
                            }
                            assert!(
                                ckpt.bytes(name).unwrap() == &data[..],
                                "{label} {ranks} ranks, rank {rank}, {name}: bytes differ"
                            );
                        }
                        (got, want) => panic!(
                            "{label} {ranks} ranks, rank {rank}, {name}: got {got:?}, want {}",
                            if want.is_some() { "a shard" } else { "none" }
                        ),
                    }
                }
            }
            // A split tensor's parts add up to the whole: the ranks' batches ask for every
            // byte once.
            let plans = st
                .plan_shards(ranks, |t| (t.name == "attn.qkv").then_some(Shard::Split(2)))
                .unwrap();
            let asked: u64 = plans.iter().map(|(p, _)| p.bytes()).sum();
            assert_eq!(asked, bytes["attn.qkv"].len() as u64);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_that_do_not_fit_are_clear_errors() {
    let dir = tmpdir();
    let (path, _) = checkpoint(dir.path());
    let engine = gpuio::Engine::new().unwrap();
    let st = SafetensorsFile::open(&engine, &path).await.unwrap();
    let cases: Vec<(usize, Shard, &str, &str)> = vec![
        (
            4,
            Shard::Split(1),
            "embed",
            "does not split into 4 equal parts",
        ),
        (2, Shard::Split(2), "embed", "cannot split dimension 2"),
        (2, Shard::Split(0), "norm", ""),
        (
            2,
            Shard::Only(2),
            "norm",
            "rank 2 is not one of the 2 ranks",
        ),
        (
            3,
            Shard::Split(0),
            "mlp.up",
            "does not split into 3 equal parts",
        ),
    ];
    for (ranks, shard, name, msg) in cases {
        let r = st.plan_shards(ranks, |t| (t.name == name).then_some(shard));
        if msg.is_empty() {
            assert!(r.is_ok(), "{name} {shard:?} over {ranks}: {:?}", r.err());
            continue;
        }
        let e = r
            .err()
            .unwrap_or_else(|| panic!("{name} {shard:?} over {ranks} planned"));
        assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
        let text = e.to_string();
        assert!(text.contains(msg) && text.contains(name), "{text}");
    }
    assert!(st.plan_shards(0, |_| Some(Shard::Replicate)).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_shards_on_every_gpu() {
    const T: &str = "device_shards_on_every_gpu";
    if !gpuio::cuda::available() {
        skipped(format!("{T}: no usable CUDA device"));
        return;
    }
    let n = gpuio::cuda::probe().devices.len();
    let dir = tmpdir();
    let (path, bytes) = checkpoint(dir.path());
    let engine = gpuio::Engine::new().unwrap();
    let st = SafetensorsFile::open(&engine, &path).await.unwrap();
    // A rank count every split dimension divides (12 and 6), at least two so one GPU can
    // hold several ranks, spread over as many GPUs as it reaches.
    let ranks = [6, 3, 2].into_iter().find(|&r| r <= n.max(2)).unwrap_or(2);
    let streams: Vec<_> = (0..ranks)
        .map(|r| gpuio::cuda::context(r % n).unwrap().new_stream().unwrap())
        .collect();
    for how in [Replicas::Auto, Replicas::ReadOnce, Replicas::ReadEach] {
        for everything in [false, true] {
            let shards = if everything {
                st.load_shards_device_with(&streams, |_| Some(Shard::Replicate), how)
                    .await
            } else {
                st.load_shards_device_with(&streams, rule(ranks), how).await
            }
            .unwrap();
            for (rank, ckpt) in shards.iter().enumerate() {
                let back = streams[rank].clone_dtoh(ckpt.buffer()).unwrap();
                for (name, ..) in TENSORS {
                    let want = if everything {
                        let &(.., shape) = TENSORS.iter().find(|t| t.0 == *name).unwrap();
                        Some((shape.to_vec(), bytes[*name].clone()))
                    } else {
                        expected(&bytes, name, rank, ranks)
                    };
                    let at = format!(
                        "{how:?}, all replicated {everything}, rank {rank} (GPU {}), {name}",
                        rank % n
                    );
                    match (ckpt.tensor(name), want) {
                        (None, None) => {}
                        (Some(t), Some((shape, data))) => {
                            assert_eq!(t.shape, shape, "{at}");
                            assert!(
                                back[t.buffer_range.clone()] == data[..],
                                "{at}: bytes differ"
                            );
                        }
                        (got, _) => panic!("{at}: got {got:?}"),
                    }
                }
            }
        }
    }
    eprintln!("{T}: {ranks} ranks over {n} GPU(s) checked");
}

/// An empty tensor last in a rank's buffer, and shapes whose dimensions after a zero one are
/// huge (the header's byte count bounds nothing past a zero): planned without a panic, an
/// overflow or a loop over the huge dimension; loaded, their views are empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_and_hostile_shapes() {
    let dir = tmpdir();
    let path = dir.path().join("odd.safetensors");
    let huge = 1usize << 62;
    let header = format!(
        r#"{{"a":{{"dtype":"F32","shape":[3],"data_offsets":[0,12]}},"z":{{"dtype":"F32","shape":[0],"data_offsets":[12,12]}},"h":{{"dtype":"F32","shape":[0,{huge},{huge}],"data_offsets":[12,12]}},"w":{{"dtype":"F32","shape":[{huge},0],"data_offsets":[12,12]}}}}"#
    );
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&[1u8; 12]);
    std::fs::write(&path, file).unwrap();
    let engine = gpuio::Engine::new().unwrap();
    let st = match SafetensorsFile::open(&engine, &path).await {
        Ok(st) => st,
        Err(e) => {
            // The safetensors crate may refuse such a header outright: also a clear error.
            assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
            eprintln!("empty_and_hostile_shapes: the header was refused at open: {e}");
            return;
        }
    };
    let shards = st
        .load_shards_host(2, |t| match t.name.as_str() {
            "a" | "z" => Some(Shard::Replicate),
            "h" => Some(Shard::Split(1)),
            "w" => Some(Shard::Split(0)),
            _ => None,
        })
        .await
        .unwrap();
    for ckpt in &shards {
        assert_eq!(ckpt.bytes("a").unwrap(), &[1u8; 12]);
        assert!(ckpt.bytes("z").unwrap().is_empty());
        assert!(ckpt.bytes("h").unwrap().is_empty());
        assert!(ckpt.bytes("w").unwrap().is_empty());
        assert!(ckpt.tensor("z").unwrap().buffer_range.end <= ckpt.buffer().len());
    }
}

/// Read once: every replicated byte is read from the file by exactly one rank, the ranks take
/// near-equal shares, and the planned copies complete every other rank. Run here on the host
/// (each rank's batch into a `Vec`, the copies as `copy_from_slice`), so it needs no GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_once_plans_read_each_replicated_byte_once() {
    let dir = tmpdir();
    let (path, bytes) = checkpoint(dir.path());
    let engine = gpuio::Engine::new().unwrap();
    let st = SafetensorsFile::open(&engine, &path).await.unwrap();
    let replicated: usize = bytes.values().map(Vec::len).sum();
    for ranks in [1, 2, 3, 6] {
        let (plans, copies) = st
            .plan_shards_read_once(ranks, |_| Some(Shard::Replicate))
            .unwrap();
        let each: Vec<u64> = plans.iter().map(|(p, _)| p.bytes()).collect();
        assert_eq!(
            each.iter().sum::<u64>(),
            replicated as u64,
            "{ranks} ranks: {each:?}"
        );
        // Whole tensors go to owners, so shares differ by at most the largest tensor.
        let largest = bytes.values().map(Vec::len).max().unwrap() as u64;
        let fair = replicated as u64 / ranks as u64;
        assert!(
            each.iter().all(|&b| b.abs_diff(fair) <= largest),
            "{each:?}"
        );
        let copied: usize = copies.iter().map(|c| c.src.len()).sum();
        assert_eq!(
            copied,
            replicated * (ranks - 1),
            "{ranks} ranks: {copies:?}"
        );
        let mut bufs: Vec<Vec<u8>> = plans.iter().map(|(p, _)| vec![0u8; p.dst_len()]).collect();
        for ((plan, _), buf) in plans.iter().zip(bufs.iter_mut()) {
            plan.read_into(buf).await.exact(plan.descs()).unwrap();
        }
        for c in &copies {
            assert_ne!(c.from, c.to);
            let src = bufs[c.from][c.src.clone()].to_vec();
            bufs[c.to][c.dst_start..c.dst_start + src.len()].copy_from_slice(&src);
        }
        for ((_, placed), buf) in plans.iter().zip(&bufs) {
            for t in placed {
                assert!(
                    buf[t.buffer_range.clone()] == bytes[&t.name][..],
                    "{ranks} ranks, {}",
                    t.name
                );
            }
        }
    }
    // Split and one-rank tensors are untouched by read-once: the same batches as plan_shards.
    let (split, copies) = st
        .plan_shards_read_once(3, |t| {
            (t.name != "norm")
                .then_some(Shard::Split(0))
                .filter(|_| t.name == "embed")
        })
        .unwrap();
    assert!(copies.is_empty());
    let plain = st
        .plan_shards(3, |t| (t.name == "embed").then_some(Shard::Split(0)))
        .unwrap();
    for ((a, _), (b, _)) in split.iter().zip(&plain) {
        assert_eq!(a.bytes(), b.bytes());
    }
}
