//! Safetensors files the `safetensors` crate's own writer never produces but the format
//! allows, and the coordinates a loaded checkpoint hands out.

mod common;

use common::*;
use gpuio::Error;
use gpuio::safetensors::{Dtype, SafetensorsFile};

/// One hand-built tensor: name, dtype as the header spells it, shape, little-endian bytes.
type Spec<'a> = (&'a str, &'a str, Vec<usize>, Vec<u8>);

/// A safetensors file built byte by byte: the 8-byte little-endian header length, the JSON
/// header padded with spaces to exactly `header_len` bytes, then the tensors' data back to
/// back. The format allows a header of any length; the `safetensors` crate's writer pads it
/// to a multiple of 8, so files it writes always start their data 8-aligned and never show
/// what an odd length does to the data's alignment.
fn hand_built(header_len: usize, tensors: &[Spec<'_>]) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut at = 0;
    for (name, dtype, shape, data) in tensors {
        let shape: Vec<String> = shape.iter().map(usize::to_string).collect();
        entries.push(format!(
            r#""{name}":{{"dtype":"{dtype}","shape":[{}],"data_offsets":[{at},{}]}}"#,
            shape.join(","),
            at + data.len()
        ));
        at += data.len();
    }
    let mut header = format!("{{{}}}", entries.join(",")).into_bytes();
    assert!(
        header.len() <= header_len,
        "header needs {} bytes",
        header.len()
    );
    header.resize(header_len, b' ');
    let mut file = (header_len as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    for (_, _, _, data) in tensors {
        file.extend_from_slice(data);
    }
    file
}

fn le<const N: usize, T: Copy>(v: &[T], to: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| to(x)).collect()
}

const F32S: [f32; 4] = [1.5, -2.25, 3.0e-3, f32::MAX];
const F64S: [f64; 2] = [std::f64::consts::PI, -0.0];
const I16S: [i16; 3] = [-1, 2, i16::MIN];

/// Legal files whose tensors start at odd file offsets. A 115-byte header (the case in the
/// bug report) puts the data at file byte 123: `a` at 123, the f32 tensor `b` at 125. With
/// a 227-byte header the data starts at 235: f32 at 237, f64 at 253, i16 at 269.
fn odd_offset_files() -> Vec<(&'static str, Vec<u8>)> {
    let specs: Vec<Spec<'_>> = vec![
        ("a", "U8", vec![2], vec![7, 9]),
        ("b", "F32", vec![2, 2], le(&F32S, f32::to_le_bytes)),
        ("c", "F64", vec![2], le(&F64S, f64::to_le_bytes)),
        ("d", "I16", vec![3], le(&I16S, i16::to_le_bytes)),
    ];
    let files = vec![
        ("header115", hand_built(115, &specs[..2])),
        ("header227", hand_built(227, &specs)),
    ];
    for (_, bytes) in &files {
        // The reference implementation takes them: the files are legal.
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        assert_eq!(st.tensor("b").unwrap().data(), le(&F32S, f32::to_le_bytes));
    }
    files
}

/// Host decoding copies into a `Vec<T>`, so it works wherever the tensor's bytes sit: a
/// legal file whose data starts at an odd offset decodes like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn to_vec_decodes_tensors_at_odd_file_offsets() {
    let dir = tmpdir();
    for (file, bytes) in odd_offset_files() {
        let path = dir.path().join(format!("{file}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        for (name, engine) in engines() {
            let st = SafetensorsFile::open(&engine, &path).await.unwrap();
            for ck in [
                st.load_host(|_| true).await.unwrap(),
                st.load_host(|n| n != "a").await.unwrap(),
                st.load_host(|n| n == "b").await.unwrap(),
            ] {
                let loaded: Vec<&str> = ck.tensors().iter().map(|t| t.name.as_str()).collect();
                let what = format!("{file} on {name}, loaded {loaded:?}");
                if ck.tensor("a").is_some() {
                    assert_eq!(ck.to_vec::<u8>("a").unwrap(), [7, 9], "{what}");
                }
                assert_eq!(ck.to_vec::<f32>("b").unwrap(), F32S, "{what}");
                // The element size still has to match the dtype.
                let e = ck.to_vec::<f64>("b").unwrap_err();
                assert!(matches!(e, Error::InvalidInput { .. }), "{what}: {e}");
                assert!(e.to_string().contains("32 bits"), "{what}: {e}");
                if ck.tensor("c").is_some() {
                    let c = ck.to_vec::<f64>("c").unwrap();
                    assert_eq!(c[0], F64S[0], "{what}");
                    assert!(c[1] == 0.0 && c[1].is_sign_negative(), "{what}: {c:?}");
                }
                if ck.tensor("d").is_some() {
                    assert_eq!(ck.to_vec::<i16>("d").unwrap(), I16S, "{what}");
                }
            }
        }
    }
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

/// A typed device view reinterprets the buffer in place, so it still needs aligned data:
/// a tensor at an odd file offset is refused with an error that says so and points at
/// `to_vec`; aligned ones in the same file view fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_view_refuses_misaligned_tensors_saying_why() {
    if !gpuio::cuda::available() {
        skipped("device_view_refuses_misaligned_tensors_saying_why: no usable CUDA device");
        return;
    }
    let stream = gpuio::cuda::context(0).unwrap().new_stream().unwrap();
    let dir = tmpdir();
    let engine = gpuio::Engine::new().unwrap();
    for (file, bytes) in odd_offset_files() {
        let path = dir.path().join(format!("{file}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        let st = SafetensorsFile::open(&engine, &path).await.unwrap();
        let ck = st.load_device(&stream, |_| true).await.unwrap();
        let a: Vec<u8> = stream.clone_dtoh(&ck.view::<u8>("a").unwrap()).unwrap();
        assert_eq!(a, [7, 9], "{file}");
        let e = ck.view::<f32>("b").unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{file}: {e}");
        let msg = e.to_string();
        for needle in ["aligned to 4 bytes", "to_vec", &path.display().to_string()] {
            assert!(msg.contains(needle), "{file}: {msg}");
        }
    }
}
