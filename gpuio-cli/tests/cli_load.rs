//! `gpuio load` run as the real binary, on a model directory of two shards with an index.

mod cli_util;

use std::path::Path;

use cli_util::*;

/// A safetensors file of `tensors` (name, rows of 8 f32 each), every byte a function of the
/// tensor's name and position, written byte by byte.
fn shard(path: &Path, tensors: &[(&str, usize)]) {
    let mut header = Vec::new();
    let mut data = Vec::new();
    for (name, rows) in tensors {
        let len = rows * 8 * 4;
        header.push(format!(
            r#""{name}":{{"dtype":"F32","shape":[{rows},8],"data_offsets":[{},{}]}}"#,
            data.len(),
            data.len() + len
        ));
        data.extend((0..len).map(|i| (i as u8).wrapping_mul(7) ^ name.len() as u8));
    }
    let mut json = format!("{{{}}}", header.join(",")).into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend(json);
    file.extend(data);
    std::fs::write(path, file).unwrap();
}

fn model(dir: &Path) {
    shard(
        &dir.join("model-00001-of-00002.safetensors"),
        &[("a", 4), ("bb", 6)],
    );
    shard(
        &dir.join("model-00002-of-00002.safetensors"),
        &[("ccc", 2), ("dddd", 1)],
    );
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        r#"{"metadata":{"total_size":416},"weight_map":{
            "a":"model-00001-of-00002.safetensors","bb":"model-00001-of-00002.safetensors",
            "ccc":"model-00002-of-00002.safetensors","dddd":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
}

#[test]
fn load_reads_a_model_directory_and_verifies_it() {
    let dir = tempfile::tempdir().unwrap();
    model(dir.path());
    let r = run(gpuio()
        .args(["load", "--to", "host", "--verify"])
        .arg(dir.path()));
    assert!(r.ok(), "{r:?}");
    assert!(
        r.stdout.contains("4 tensors") && r.stdout.contains("2 file(s)"),
        "{r:?}"
    );
    assert!(r.stdout.contains("verified 4 tensors"), "{r:?}");
    assert!(r.stdout.contains("host memory: peak resident"), "{r:?}");
    assert!(r.stdout.contains(" cores ("), "no CPU figure: {r:?}");
    // Mapped reads on: into host memory nothing is mapped, and the load is the same.
    let r = run(gpuio()
        .args(["load", "--to", "host", "--verify", "--mapped-reads"])
        .arg(dir.path()));
    assert!(r.ok(), "{r:?}");
    assert!(
        r.stdout.contains("verified 4 tensors") && r.stdout.contains(", 0 runs mapped"),
        "{r:?}"
    );
    // Tensor-parallel over the shards: "a" and "bb" split (rows divide by 2), the rest
    // replicated.
    let r = run(gpuio()
        .args(["load", "--to", "host", "--tp", "2"])
        .arg(dir.path()));
    assert!(r.ok(), "{r:?}");
    assert!(r.stdout.contains("(2 ranks)"), "{r:?}");
    // Whole copies on 3 ranks, with the progress bar forced on (stderr is not a terminal
    // here): it ends at the checkpoint's 416 bytes and clears its line.
    let r = run(gpuio()
        .args(["load", "--to", "host", "--replicas", "3", "--progress"])
        .arg(dir.path()));
    assert!(r.ok(), "{r:?}");
    assert!(r.stdout.contains("(3 replicas)"), "{r:?}");
    // Three replicas of 416 bytes each: the bar's last frame shows them all.
    assert!(r.stderr.contains("] 1.22 KiB / 1.22 KiB"), "{r:?}");
}

#[test]
fn load_refuses_a_bad_index_and_bad_arguments() {
    let dir = tempfile::tempdir().unwrap();
    model(dir.path());
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let r = run(gpuio().args(["load", "--to", "host"]).arg(dir.path()));
    assert!(!r.ok(), "{r:?}");
    assert!(r.stderr.contains("which is missing"), "{r:?}");
    for bad in [["--tp", "0"], ["--repeat", "0"], ["--replicas", "0"]] {
        let r = run(gpuio()
            .args(["load", "--to", "host"])
            .args(bad)
            .arg(dir.path()));
        assert!(!r.ok() && r.stderr.contains(bad[0]), "{bad:?}: {r:?}");
    }
}
