//! Safetensors checkpoints: the coordinates a loaded checkpoint hands out.

mod common;

use common::*;
use gpuio::Error;
use gpuio::safetensors::{Dtype, SafetensorsFile};

fn le<const N: usize, T: Copy>(v: &[T], to: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| to(x)).collect()
}

/// A file's listing ([`gpuio::safetensors::FileTensor`]) says where a tensor is in the file; a
/// checkpoint's [`gpuio::safetensors::Tensor`] says where it is in that checkpoint's buffer,
/// which depends on the subset loaded. Checkpoint accessors take names, so neither can pick
/// the wrong bytes (a file listing's range used to be accepted by `Checkpoint::bytes` and
/// gave another tensor's bytes, or a panic past the buffer's end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_bytes_are_found_by_name_in_its_own_buffer() {
    use safetensors::tensor::TensorView;
    let dir = tmpdir();
    let path = dir.path().join("model.safetensors");
    let ids: Vec<i64> = (0..40).map(|i| i * i - 7).collect();
    // Every tensor is at least 256 bytes, so leaving out the first one moves the others in
    // the buffer (placement keeps file offsets modulo 256). The crate's writer picks the
    // file order; the test follows the listing rather than assume one.
    let tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = vec![
        ("embed", Dtype::U8, vec![1000], pattern(1000, 1)),
        ("w", Dtype::F32, vec![8, 8], pattern(256, 2)),
        ("ids", Dtype::I64, vec![40], le(&ids, i64::to_le_bytes)),
    ];
    let views = tensors
        .iter()
        .map(|(n, dt, shape, b)| (*n, TensorView::new(*dt, shape.clone(), b).unwrap()));
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let want = |n: &str| &tensors.iter().find(|t| t.0 == n).unwrap().3[..];
    let file = std::fs::read(&path).unwrap();
    let at = |r: &std::ops::Range<u64>| &file[r.start as usize..r.end as usize];
    for (name, engine) in engines() {
        let st = SafetensorsFile::open(&engine, &path).await.unwrap();
        let listed = st.tensors();
        assert_eq!(listed.len(), 3, "{name}");
        for ft in listed {
            assert_eq!(at(&ft.file_range), want(&ft.name), "{name}: {}", ft.name);
            assert_eq!(ft.byte_len(), want(&ft.name).len(), "{name}: {}", ft.name);
        }
        let (first, last) = (&listed[0].name, &listed[2].name);
        let all = st.load_host(|_| true).await.unwrap();
        for ck in [
            st.load_host(|_| true).await.unwrap(),
            st.load_host(|n| n != first).await.unwrap(),
            st.load_host(|n| n == last).await.unwrap(),
        ] {
            let loaded: Vec<&str> = ck.tensors().iter().map(|t| t.name.as_str()).collect();
            let what = format!("{name}, loaded {loaded:?}");
            for ft in listed {
                let Some(t) = ck.tensor(&ft.name) else {
                    let e = ck.bytes(&ft.name).unwrap_err();
                    assert!(matches!(e, Error::InvalidInput { .. }), "{what}: {e}");
                    let msg = e.to_string();
                    assert!(msg.contains(&format!("{:?}", ft.name)), "{what}: {msg}");
                    assert!(msg.contains(&path.display().to_string()), "{what}: {msg}");
                    continue;
                };
                let bytes = ck.bytes(&ft.name).unwrap();
                assert_eq!(bytes, want(&ft.name), "{what}: {}", ft.name);
                assert_eq!(t.file_range, ft.file_range, "{what}: {}", ft.name);
                assert_eq!(&ck.buffer()[t.buffer_range.clone()], bytes, "{what}");
            }
            let by_iter: Vec<(&str, &[u8])> =
                ck.iter().map(|(t, b)| (t.name.as_str(), b)).collect();
            assert_eq!(by_iter.len(), loaded.len(), "{what}");
            for (n, b) in by_iter {
                assert_eq!(b, want(n), "{what}: {n}");
            }
            // The same tensor sits elsewhere in a checkpoint of another subset: a buffer
            // range only means something to the checkpoint that handed it out.
            if ck.tensor(first).is_none() {
                let (here, there) = (ck.tensor(last).unwrap(), all.tensor(last).unwrap());
                assert_ne!(here.buffer_range, there.buffer_range, "{what}");
                assert_eq!(here.file_range, there.file_range, "{what}");
            }
            if ck.tensor("ids").is_some() {
                assert_eq!(ck.to_vec::<i64>("ids").unwrap(), ids, "{what}");
            }
        }
    }
}
