//! Checkpoints of several shards ([`SafetensorsModel`]): a directory with a hub index, a
//! directory without one, an index file, a list of files; every way an index can be wrong is
//! refused before any tensor byte is read; the loaded bytes equal those of one file holding the
//! same tensors.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use gpuio::Engine;
use gpuio::safetensors::{SafetensorsFile, SafetensorsModel};
use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// Tensor `i`'s bytes: `4 * (i + 1) * 16` bytes of a pattern seeded by `i`.
fn data(i: usize) -> Vec<u8> {
    pattern(4 * (i + 1) * 16, i as u64 + 7)
}

fn name(i: usize) -> String {
    format!("layers.{i}.weight")
}

/// Writes tensors `range` into `path` with the safetensors crate.
fn write_shard(path: &Path, range: std::ops::Range<usize>) {
    let bufs: Vec<(String, Vec<u8>)> = range.map(|i| (name(i), data(i))).collect();
    let views: Vec<(String, TensorView<'_>)> = bufs
        .iter()
        .map(|(n, d)| {
            let view = TensorView::new(Dtype::F32, vec![d.len() / 64, 16], d).unwrap();
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A hub-style model: `shards` files of 3 tensors each, and the index naming them.
fn model_dir(dir: &Path, shards: usize) -> Vec<PathBuf> {
    let mut paths = Vec::new();
    let mut map = Vec::new();
    for s in 0..shards {
        let file = format!("model-{:05}-of-{:05}.safetensors", s + 1, shards);
        write_shard(&dir.join(&file), 3 * s..3 * s + 3);
        for i in 3 * s..3 * s + 3 {
            map.push(format!("\"{}\": \"{file}\"", name(i)));
        }
        paths.push(dir.join(file));
    }
    write_index(dir, &map.join(", "));
    paths
}

fn write_index(dir: &Path, weight_map: &str) {
    let text = format!(
        "{{\"metadata\": {{\"total_size\": 1234, \"format\": \"pt\"}}, \"weight_map\": {{{weight_map}}}}}"
    );
    std::fs::write(dir.join("model.safetensors.index.json"), text).unwrap();
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn open_err(engine: &Engine, path: &Path) -> String {
    rt().block_on(SafetensorsModel::open(engine, path))
        .expect_err("must be refused")
        .to_string()
}

#[test]
fn a_directory_with_an_index_loads_every_tensor_of_every_shard() {
    let dir = tmpdir();
    model_dir(dir.path(), 4);
    let engine = Engine::new().unwrap();
    rt().block_on(async {
        let model = SafetensorsModel::open(&engine, dir.path()).await.unwrap();
        assert_eq!(model.shards().len(), 4);
        assert_eq!(model.len(), 12);
        assert_eq!(model.metadata()["total_size"], "1234");
        assert_eq!(model.metadata()["format"], "pt");
        let ckpt = model.load_host(|_| true).await.unwrap();
        for i in 0..12 {
            assert_eq!(ckpt.bytes(&name(i)).unwrap(), &data(i)[..], "tensor {i}");
        }
        // A subset, from two shards.
        let some = model
            .load_host(|n| n == name(1) || n == name(10))
            .await
            .unwrap();
        assert_eq!(some.tensors().len(), 2);
        assert_eq!(some.bytes(&name(10)).unwrap(), &data(10)[..]);
        let (shard, t) = model.tensor(&name(7)).unwrap();
        assert!(
            shard
                .file()
                .path()
                .ends_with("model-00003-of-00004.safetensors")
        );
        assert_eq!(t.byte_len(), data(7).len());
        // The index file itself opens the same checkpoint.
        let by_index =
            SafetensorsModel::open(&engine, dir.path().join("model.safetensors.index.json"))
                .await
                .unwrap();
        assert_eq!(by_index.len(), 12);
    });
}

#[test]
fn a_model_loads_the_same_bytes_as_one_file_of_the_same_tensors() {
    let dir = tmpdir();
    let one = dir.path().join("one.safetensors");
    write_shard(&one, 0..12);
    let sharded = dir.path().join("sharded");
    std::fs::create_dir(&sharded).unwrap();
    model_dir(&sharded, 4);
    let engine = Engine::new().unwrap();
    rt().block_on(async {
        let single = SafetensorsFile::open(&engine, &one).await.unwrap();
        let a = single.load_host(|_| true).await.unwrap();
        let model = SafetensorsModel::open(&engine, &sharded).await.unwrap();
        let b = model.load_host(|_| true).await.unwrap();
        assert_eq!(a.tensors().len(), b.tensors().len());
        for t in a.tensors() {
            assert_eq!(
                a.bytes(&t.name).unwrap(),
                b.bytes(&t.name).unwrap(),
                "{}",
                t.name
            );
            assert_eq!(Some(&t.shape), b.tensor(&t.name).map(|x| &x.shape));
        }
    });
}

#[test]
fn a_directory_without_an_index_and_a_list_of_files_load_as_one() {
    let dir = tmpdir();
    write_shard(&dir.path().join("b.safetensors"), 3..6);
    write_shard(&dir.path().join("a.safetensors"), 0..3);
    std::fs::write(dir.path().join("README.md"), "not a shard").unwrap();
    let engine = Engine::new().unwrap();
    rt().block_on(async {
        let model = SafetensorsModel::open(&engine, dir.path()).await.unwrap();
        assert_eq!(model.shards().len(), 2);
        assert!(model.shards()[0].file().path().ends_with("a.safetensors"));
        let ckpt = model.load_host(|_| true).await.unwrap();
        for i in 0..6 {
            assert_eq!(ckpt.bytes(&name(i)).unwrap(), &data(i)[..]);
        }
        let files = [
            dir.path().join("b.safetensors"),
            dir.path().join("a.safetensors"),
        ];
        let listed = SafetensorsModel::open_files(&engine, &files).await.unwrap();
        assert!(listed.shards()[0].file().path().ends_with("b.safetensors"));
        assert_eq!(
            listed.load_host(|_| true).await.unwrap().byte_len(),
            ckpt.byte_len()
        );
        // One file opens as a checkpoint of one shard, with its header's metadata.
        let single = SafetensorsModel::open(&engine, &files[0]).await.unwrap();
        assert_eq!(single.len(), 3);
    });
}

#[test]
fn a_tensor_in_two_files_is_refused() {
    let dir = tmpdir();
    write_shard(&dir.path().join("a.safetensors"), 0..3);
    write_shard(&dir.path().join("b.safetensors"), 2..5);
    let engine = Engine::new().unwrap();
    let e = open_err(&engine, dir.path());
    assert!(e.contains("is in both") && e.contains(&name(2)), "{e}");
}

/// What spoils a good model directory.
type Spoil = Box<dyn Fn(&Path)>;

#[test]
fn every_wrong_index_is_refused_before_any_tensor_is_read() {
    let engine = Engine::new().unwrap();
    let cases: Vec<(&str, Spoil, &str)> = vec![
        (
            "a shard the index names is missing",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("model-00002-of-00003.safetensors")).unwrap();
            }),
            "which is missing",
        ),
        (
            "the index names a tensor its shard lacks",
            Box::new(|d: &Path| {
                let mut map = index_map(3);
                map.push("\"ghost\": \"model-00001-of-00003.safetensors\"".to_string());
                write_index(d, &map.join(", "));
            }),
            "which does not hold it",
        ),
        (
            "a shard holds a tensor the index does not name",
            Box::new(|d: &Path| {
                let mut map = index_map(3);
                map.retain(|e| !e.contains(&name(4)));
                write_index(d, &map.join(", "));
            }),
            "which the index does not name",
        ),
        (
            "the index puts a tensor in another shard than the one holding it",
            Box::new(|d: &Path| {
                let map: Vec<String> = index_map(3)
                    .into_iter()
                    .map(|e| {
                        if e.contains(&format!("\"{}\"", name(0))) {
                            format!("\"{}\": \"model-00002-of-00003.safetensors\"", name(0))
                        } else {
                            e
                        }
                    })
                    .collect();
                write_index(d, &map.join(", "));
            }),
            "but the index puts it in",
        ),
        (
            "the index reaches outside its directory",
            Box::new(|d: &Path| {
                let mut map = index_map(3);
                map.push("\"x\": \"../elsewhere.safetensors\"".to_string());
                write_index(d, &map.join(", "));
            }),
            "not a file name in its directory",
        ),
        (
            "the index is not JSON",
            Box::new(|d: &Path| {
                std::fs::write(d.join("model.safetensors.index.json"), "{\"weight_map\": ")
                    .unwrap();
            }),
            "safetensors index",
        ),
        (
            "the index has no weight_map",
            Box::new(|d: &Path| {
                std::fs::write(d.join("model.safetensors.index.json"), "{\"metadata\": {}}")
                    .unwrap();
            }),
            "no weight_map",
        ),
    ];
    for (what, spoil, want) in cases {
        let dir = tmpdir();
        model_dir(dir.path(), 3);
        spoil(dir.path());
        let e = open_err(&engine, dir.path());
        assert!(e.contains(want), "{what}: {e}");
        assert!(
            e.contains("model.safetensors.index.json"),
            "{what}: names the index: {e}"
        );
    }
}

/// The weight_map entries `model_dir(_, shards)` writes.
fn index_map(shards: usize) -> Vec<String> {
    (0..3 * shards)
        .map(|i| {
            format!(
                "\"{}\": \"model-{:05}-of-{:05}.safetensors\"",
                name(i),
                i / 3 + 1,
                shards
            )
        })
        .collect()
}

#[test]
fn an_empty_directory_and_two_indices_are_refused() {
    let engine = Engine::new().unwrap();
    let dir = tmpdir();
    let e = open_err(&engine, dir.path());
    assert!(e.contains("no .safetensors file"), "{e}");
    std::fs::write(dir.path().join("a.safetensors.index.json"), "{}").unwrap();
    std::fs::write(dir.path().join("b.safetensors.index.json"), "{}").unwrap();
    let e = open_err(&engine, dir.path());
    assert!(e.contains("several safetensors indices"), "{e}");
}

#[test]
fn tensor_parallel_loads_of_a_model_match_those_of_one_file() {
    use gpuio::safetensors::Shard;
    let dir = tmpdir();
    let one = dir.path().join("one.safetensors");
    write_shard(&one, 0..12);
    let sharded = dir.path().join("sharded");
    std::fs::create_dir(&sharded).unwrap();
    model_dir(&sharded, 4);
    let engine = Engine::new().unwrap();
    // Split by rows, by columns, one rank only, replicated: across every shard.
    let rule = |t: &gpuio::safetensors::FileTensor| {
        if t.shape[0] % 2 == 0 {
            return Some(Shard::Split(0));
        }
        match t.shape[0] % 3 {
            0 => Some(Shard::Split(1)),
            1 => Some(Shard::Only(1)),
            _ => Some(Shard::Replicate),
        }
    };
    rt().block_on(async {
        let single = SafetensorsFile::open(&engine, &one).await.unwrap();
        let model = SafetensorsModel::open(&engine, &sharded).await.unwrap();
        let a = single.load_shards_host(2, rule).await.unwrap();
        let b = model.load_shards_host(2, rule).await.unwrap();
        for (rank, (a, b)) in a.iter().zip(&b).enumerate() {
            assert_eq!(a.tensors().len(), b.tensors().len(), "rank {rank}");
            for t in a.tensors() {
                assert_eq!(
                    a.bytes(&t.name).unwrap(),
                    b.bytes(&t.name).unwrap(),
                    "rank {rank} {}",
                    t.name
                );
                assert_eq!(Some(&t.shape), b.tensor(&t.name).map(|x| &x.shape));
            }
        }
        assert!(model.plan_shards(0, rule).is_err(), "0 ranks refused");
    });
}
