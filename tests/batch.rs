//! Batches, prepared plans, the catalog and safetensors loading, into host memory on every
//! backend and into device memory where a GPU exists (skipped loudly otherwise).

mod common;

use std::sync::Arc;

use common::*;
use gpuio::batch::{BatchPlan, Catalog, Extent, ReadDesc, RecordKind};
use gpuio::safetensors::{Dtype, SafetensorsFile};
use gpuio::{Engine, Error};

/// What a descriptor should give, from the file's bytes: `Ok(bytes)` or `Err(())`.
fn expected(data: &[u8], d: &ReadDesc) -> Vec<u8> {
    let start = (d.offset as usize).min(data.len());
    let end = (d.offset as usize).saturating_add(d.len).min(data.len());
    data[start..end].to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_items_overlapping_adjacent_unaligned_out_of_range() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "b.bin", 1 << 20, 7);
    for (name, engine) in engines() {
        let f = engine.open(&path).unwrap();
        let other = engine.open(&path).unwrap();
        let descs = vec![
            ReadDesc::new(&f, 100, 1000, 0),                // 0 unaligned
            ReadDesc::new(&f, 1100, 500, 1000), // 1 adjacent to 0 in file and dst: merged
            ReadDesc::new(&f, 4096, 4096, 1200), // 2 overlaps 1's destination
            ReadDesc::new(&other, 1600, 10, 1500), // 3 adjacent, but another File: own read
            ReadDesc::new(&f, u64::MAX - 5, 10, 2000), // 4 file range overflows
            ReadDesc::new(&f, (1 << 20) - 300, 1000, 3000), // 5 past EOF: short
            ReadDesc::new(&f, 2 << 20, 100, 5000), // 6 wholly past EOF: 0
            ReadDesc::new(&f, 5, 0, 5100),      // 7 empty
            ReadDesc::new(&f, 0, 64, usize::MAX - 10), // 8 destination range overflows
            ReadDesc::new(&f, 77, 4000, 9000),  // 9 past the destination (8000 bytes)
            ReadDesc::new(&f, 3, 1, 4000),      // 10 same file bytes as nobody: fine
        ];
        let plan = BatchPlan::new(descs.clone());
        assert_eq!(plan.reads(), 6, "{name}: runs after merging");
        let mut buf = Canaried::new(8000, 4096);
        let r = plan.read_into(buf.inner()).await.into_results();
        buf.check_guards();
        let out = &buf.buf[4096..4096 + 8000];
        for (i, d) in descs.iter().enumerate() {
            match (i, &r[i]) {
                (2 | 4 | 8 | 9, Err(Error::InvalidInput { .. })) => {}
                (2 | 4 | 8 | 9, other) => panic!("{name}: descriptor {i}: {other:?}"),
                (_, Ok(n)) => {
                    let want = expected(&data, d);
                    assert_eq!(*n, want.len(), "{name}: descriptor {i} count");
                    assert_eq!(
                        &out[d.dst_offset..d.dst_offset + n],
                        &want[..],
                        "{name}: {i}"
                    );
                }
                (_, Err(e)) => panic!("{name}: descriptor {i}: {e}"),
            }
        }
        let msg = r[2].as_ref().unwrap_err().to_string();
        assert!(msg.contains("overlaps descriptor 1"), "{msg}");
        let msg = r[9].as_ref().unwrap_err().to_string();
        assert!(msg.contains("past the destination"), "{msg}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_batches_match_pread_buffered_and_direct() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "r.bin", (3 << 20) + 333, 11);
    let mut rng = fastrand::Rng::with_seed(5);
    for (name, engine) in engines() {
        for (direct, f) in buffered_and_direct(&engine, &path) {
            for round in 0..10 {
                // Random lengths, packed in a random order with random gaps.
                let n = rng.usize(1..200);
                let mut at = 0;
                let descs: Vec<ReadDesc> = (0..n)
                    .map(|_| {
                        let len = rng.usize(0..70_000);
                        let off = rng.u64(0..data.len() as u64 + 1000);
                        at += rng.usize(0..3000);
                        let d = ReadDesc::new(&f, off, len, at);
                        at += len;
                        d
                    })
                    .collect();
                let plan = BatchPlan::new(descs.clone());
                let mut buf = vec![0xEEu8; plan.dst_len()];
                let r = plan.read_into(&mut buf).await.into_results();
                for (i, d) in descs.iter().enumerate() {
                    let want = expected(&data, d);
                    let got = *r[i].as_ref().unwrap_or_else(|e| panic!("{name} {i}: {e}"));
                    assert_eq!(
                        got,
                        want.len(),
                        "{name} direct={direct} round {round} desc {i}"
                    );
                    assert_eq!(&buf[d.dst_offset..d.dst_offset + got], &want[..]);
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_plan_runs_many_times_into_rotating_buffers() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "p.bin", 1 << 20, 3);
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    // 64 pages of 4 KiB in a scattered order; runs of neighbours merge.
    let pages: Vec<u64> = (0..64u64).map(|i| (i * 37) % 256).collect();
    let descs: Vec<ReadDesc> = pages
        .iter()
        .enumerate()
        .map(|(i, &p)| ReadDesc::new(&f, p * 4096, 4096, i * 4096))
        .collect();
    let plan = Arc::new(BatchPlan::new(descs));
    let mut bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; plan.dst_len()]).collect();
    for round in 0..30 {
        let buf = &mut bufs[round % 3];
        buf.fill(0);
        assert_eq!(plan.read_into(buf).await.total().unwrap(), 64 * 4096);
        for (i, &p) in pages.iter().enumerate() {
            let p = p as usize * 4096;
            assert_eq!(
                &buf[i * 4096..(i + 1) * 4096],
                &data[p..p + 4096],
                "round {round}"
            );
        }
    }
    // Concurrent executions of one plan into different buffers.
    let (mut a, mut b) = (vec![0u8; plan.dst_len()], vec![0u8; plan.dst_len()]);
    let (ra, rb) = tokio::join!(plan.read_into(&mut a), plan.read_into(&mut b));
    assert_eq!(ra.total().unwrap(), rb.total().unwrap());
    assert_eq!(a, b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_dropped_or_leaked_mid_flight_then_engine_still_works() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "d.bin", 8 << 20, 9);
    for (name, engine) in engines() {
        let f = engine.open(&path).unwrap();
        let descs: Vec<ReadDesc> = (0..32)
            .map(|i| ReadDesc::new(&f, i * 200_000 + 13, 150_000, i as usize * 160_000))
            .collect();
        let plan = BatchPlan::new(descs);
        for leak in [false, true] {
            let mut buf = Canaried::new(plan.dst_len(), 4096);
            abandon_mid_flight(Box::pin(plan.read_into(buf.inner())), 1, leak);
            // Whatever was in flight only wrote bounce slots: the buffer's canaries hold and
            // later reuse of the buffer is never overwritten.
            buf.inner().fill(0x11);
            std::thread::sleep(std::time::Duration::from_millis(50));
            buf.check_guards();
            assert!(
                buf.inner().iter().all(|&b| b == 0x11),
                "{name}: written after drop"
            );
        }
        let mut out = vec![0u8; 1000];
        f.read_exact_at(&mut out, 5).await.unwrap();
        assert_eq!(&out[..], &data[5..1005], "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_names_kinds_and_plans() {
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "c.bin", 1 << 20, 21);
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    let mut cat = Catalog::new();
    cat.insert("header", Extent::new(&f, 0, 512)).unwrap();
    cat.insert("blob", Extent::new(&f, 1000, 3000)).unwrap();
    cat.insert("tail", Extent::new(&f, (1 << 20) - 100, 200))
        .unwrap(); // ends past EOF
    assert!(
        cat.insert("huge", Extent::new(&f, u64::MAX - 1, 10))
            .is_err()
    );
    cat.insert_kind(
        "page",
        RecordKind {
            file: f.clone(),
            offset: 65536,
            record_len: 4096,
            count: 100,
        },
    )
    .unwrap();
    assert!(
        cat.insert_kind(
            "bad",
            RecordKind {
                file: f.clone(),
                offset: 0,
                record_len: 0,
                count: 1
            }
        )
        .is_err()
    );

    let mut h = vec![0u8; 512];
    assert_eq!(cat.read("header", &mut h).await.unwrap(), 512);
    assert_eq!(&h[..], &data[..512]);
    let mut t = vec![0u8; 200];
    assert_eq!(cat.read("tail", &mut t).await.unwrap(), 100);
    assert_eq!(&t[..100], &data[(1 << 20) - 100..]);
    let e = cat.read("nope", &mut h).await.unwrap_err();
    assert!(e.to_string().contains("no extent named \"nope\""), "{e}");
    let e = cat.read("blob", &mut h).await.unwrap_err();
    assert!(e.to_string().contains("3000 bytes"), "{e}");

    let mut pages = vec![0u8; 3 * 4096];
    assert_eq!(
        cat.read_records("page", 7, 3, &mut pages).await.unwrap(),
        3 * 4096
    );
    let at = 65536 + 7 * 4096;
    assert_eq!(&pages[..], &data[at..at + 3 * 4096]);
    assert!(cat.read_records("page", 98, 3, &mut pages).await.is_err());
    assert!(
        cat.read_records("page", u64::MAX, 2, &mut pages)
            .await
            .is_err()
    );
    assert!(cat.read_records("page", 0, 2, &mut pages).await.is_err()); // wrong dst length
    assert!(cat.read_records("frame", 0, 3, &mut pages).await.is_err());

    let plan = cat.plan_records("page", &[5, 6, 7, 50, 2]).unwrap();
    assert_eq!(plan.reads(), 3);
    let mut buf = vec![0u8; plan.dst_len()];
    assert_eq!(plan.read_into(&mut buf).await.total().unwrap(), 5 * 4096);
    for (i, p) in [5usize, 6, 7, 50, 2].into_iter().enumerate() {
        let at = 65536 + p * 4096;
        assert_eq!(&buf[i * 4096..(i + 1) * 4096], &data[at..at + 4096]);
    }
    assert!(cat.plan_records("page", &[100]).is_err());

    let plan = cat.plan(&["blob", "header"]).unwrap();
    let mut buf = vec![0u8; plan.dst_len()];
    assert_eq!(plan.read_into(&mut buf).await.total().unwrap(), 3512);
    assert_eq!(&buf[..3000], &data[1000..4000]);
    assert_eq!(&buf[3000..], &data[..512]);
    assert!(cat.plan(&["blob", "missing"]).is_err());
}

/// A tensor written to a test checkpoint: name, dtype, shape, bytes.
type TestTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// A safetensors file with several dtypes and shapes (scalar, empty, odd sizes), written with
/// the `safetensors` crate itself; returns the path and each tensor's bytes.
fn checkpoint(dir: &std::path::Path) -> (std::path::PathBuf, Vec<TestTensor>) {
    use safetensors::tensor::TensorView;
    let mut rng = fastrand::Rng::with_seed(99);
    let specs: Vec<(&str, Dtype, Vec<usize>)> = vec![
        ("embed.weight", Dtype::F32, vec![300, 64]),
        ("layer.0.bias", Dtype::F16, vec![777]),
        ("layer.0.scale", Dtype::BF16, vec![3, 5, 7]),
        ("layer.1.ids", Dtype::I64, vec![129]),
        ("layer.1.mask", Dtype::U8, vec![1001]),
        ("layer.1.count", Dtype::I32, vec![]),
        ("empty", Dtype::F32, vec![0, 3]),
        ("head.weight", Dtype::F64, vec![50, 33]),
    ];
    let tensors: Vec<TestTensor> = specs
        .into_iter()
        .map(|(n, dt, shape)| {
            let elems: usize = shape.iter().product();
            let mut b = vec![0u8; elems * dt.bitsize() / 8];
            rng.fill(&mut b);
            (n.to_string(), dt, shape, b)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, dt, shape, b)| (n.clone(), TensorView::new(*dt, shape.clone(), b).unwrap()))
        .collect();
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path).unwrap();
    (path, tensors)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safetensors_load_all_and_subsets_into_host_memory() {
    let dir = tmpdir();
    let (path, tensors) = checkpoint(dir.path());
    for (name, engine) in engines() {
        let st = SafetensorsFile::open(&engine, &path).await.unwrap();
        assert_eq!(st.tensors().len(), tensors.len());
        let all = st.load_host(|_| true).await.unwrap();
        for (n, dt, shape, bytes) in &tensors {
            let t = all
                .tensor(n)
                .unwrap_or_else(|| panic!("{name}: {n} missing"));
            assert_eq!((t.dtype, &t.shape), (*dt, shape), "{name}: {n}");
            assert_eq!(all.bytes(n).unwrap(), &bytes[..], "{name}: {n} bytes");
            // Placement keeps the file offset's remainder modulo 256.
            assert_eq!(t.buffer_range.start as u64 % 256, t.file_range.start % 256);
        }
        let (plan, _) = st.plan(|_| true);
        assert_eq!(plan.reads(), 1, "{name}: a whole checkpoint is one read");
        let f32s: Vec<f32> = all.to_vec("embed.weight").unwrap();
        let raw = &tensors[0].3;
        assert_eq!(f32s[5].to_le_bytes(), raw[20..24]);
        assert!(
            all.to_vec::<f64>("embed.weight").is_err(),
            "wrong element size"
        );
        assert!(all.to_vec::<f32>("nope").is_err());

        let sub = st.load_host(|n| n.starts_with("layer.1")).await.unwrap();
        assert_eq!(sub.tensors().len(), 3);
        for (n, _, _, bytes) in tensors.iter().filter(|t| t.0.starts_with("layer.1")) {
            assert_eq!(sub.bytes(n).unwrap(), &bytes[..], "{name}: {n}");
        }
        assert!(sub.tensor("embed.weight").is_none());
        assert!(sub.buffer().len() < all.buffer().len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safetensors_bad_files_are_clear_errors() {
    let dir = tmpdir();
    let (path, _) = checkpoint(dir.path());
    let engine = Engine::new().unwrap();
    let good = std::fs::read(&path).unwrap();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("short", vec![1, 2, 3], "too short"),
        (
            "huge header",
            [u64::MAX.to_le_bytes().to_vec(), vec![b'{'; 16]].concat(),
            "header length",
        ),
        (
            "not json",
            [8u64.to_le_bytes().to_vec(), b"notjson!".to_vec()].concat(),
            "safetensors header",
        ),
        ("truncated", good[..good.len() - 10].to_vec(), "past the"),
    ];
    for (what, bytes, needle) in cases {
        let p = dir
            .path()
            .join(format!("{}.safetensors", what.replace(' ', "_")));
        std::fs::write(&p, bytes).unwrap();
        let e = SafetensorsFile::open(&engine, &p).await.unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{what}: {e}");
        assert!(e.to_string().contains(needle), "{what}: {e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_batches_and_safetensors_views() {
    if !gpuio::cuda::available() {
        skipped("device_batches_and_safetensors_views: no usable CUDA device");
        return;
    }
    let ctx = gpuio::cuda::context(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "g.bin", (5 << 20) + 77, 31);
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    let mut rng = fastrand::Rng::with_seed(8);
    for _ in 0..5 {
        let mut at = 0;
        let descs: Vec<ReadDesc> = (0..rng.usize(1..300))
            .map(|_| {
                let len = rng.usize(0..50_000);
                at += rng.usize(0..100);
                let d = ReadDesc::new(&f, rng.u64(0..data.len() as u64), len, at);
                at += len;
                d
            })
            .collect();
        let plan = BatchPlan::new(descs.clone());
        let mut dev = stream.alloc_zeros::<u8>(plan.dst_len().max(1)).unwrap();
        let r = plan.read_into(&mut dev).await.into_results();
        let back = stream.clone_dtoh(&dev).unwrap();
        for (i, d) in descs.iter().enumerate() {
            let want = expected(&data, d);
            assert_eq!(*r[i].as_ref().unwrap(), want.len());
            assert_eq!(
                &back[d.dst_offset..d.dst_offset + want.len()],
                &want[..],
                "desc {i}"
            );
        }
    }
    // Dropped and leaked device batches: nothing lands in the buffer afterwards.
    let descs: Vec<ReadDesc> = (0..16)
        .map(|i| ReadDesc::new(&f, i * 300_000, 250_000, i as usize * 250_000))
        .collect();
    let plan = BatchPlan::new(descs);
    for leak in [false, true] {
        let mut dev = stream.alloc_zeros::<u8>(plan.dst_len()).unwrap();
        abandon_mid_flight(Box::pin(plan.read_into(&mut dev)), 1, leak);
        stream.memset_zeros(&mut dev).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            stream.clone_dtoh(&dev).unwrap().iter().all(|&b| b == 0),
            "leak={leak}"
        );
    }

    let (path, tensors) = checkpoint(dir.path());
    let st = SafetensorsFile::open(&engine, &path).await.unwrap();
    let ck = st.load_device(&stream, |_| true).await.unwrap();
    for (n, _, _, bytes) in &tensors {
        let t = ck.tensor(n).unwrap();
        let got = stream
            .clone_dtoh(&ck.buffer().slice(t.buffer_range.clone()))
            .unwrap();
        assert_eq!(&got[..], &bytes[..], "{n}");
    }
    let w = ck.view::<f32>("embed.weight").unwrap();
    let host: Vec<f32> = stream.clone_dtoh(&w).unwrap();
    assert_eq!(host[5].to_le_bytes(), tensors[0].3[20..24]);
    assert!(ck.view::<u16>("layer.0.bias").is_ok(), "f16 viewed as u16");
    assert!(ck.view::<f32>("layer.0.bias").is_err());
}

/// Many small reads into one device buffer: every piece's copy goes through the batch's
/// combined flushes (one driver call for all that landed since the last poll), the data is
/// right, and a batch dropped or leaked mid-flight writes nothing into memory freed and
/// allocated again after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_batches_of_small_reads_combine_their_copies() {
    const T: &str = "device_batches_of_small_reads_combine_their_copies";
    if !gpuio::cuda::available() {
        skipped(format!("{T}: no usable CUDA device"));
        return;
    }
    let ctx = gpuio::cuda::context(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "small.bin", 16 << 20, 47);
    // The page-cache fast path would serve these cached pages on the polling thread instead.
    let engine = Engine::builder()
        .page_cache_fast_path(false)
        .build()
        .unwrap();
    let f = engine.open(&path).unwrap();
    let mut rng = fastrand::Rng::with_seed(21);
    let pages = data.len() / 4096;
    // 4 KiB reads at page offsets no two of which touch (so none merge into a run).
    let mut offsets: Vec<usize> = (0..pages / 2).map(|p| p * 2 * 4096).collect();
    rng.shuffle(&mut offsets);
    let descs: Vec<ReadDesc> = offsets[..1024]
        .iter()
        .enumerate()
        .map(|(i, &off)| ReadDesc::new(&f, off as u64, 4096, i * 4096))
        .collect();
    let plan = BatchPlan::new(descs.clone());
    let (flushes0, copies0) = gpuio::batch::combined_copies();
    let mut dev = stream.alloc_zeros::<u8>(plan.dst_len()).unwrap();
    let r = plan.read_into(&mut dev).await.exact(&descs).unwrap();
    assert_eq!(r, 1024 * 4096);
    let back = stream.clone_dtoh(&dev).unwrap();
    for (i, d) in descs.iter().enumerate() {
        assert_eq!(
            &back[i * 4096..(i + 1) * 4096],
            &expected(&data, d)[..],
            "desc {i}"
        );
    }
    let (flushes, copies) = gpuio::batch::combined_copies();
    assert!(
        copies - copies0 >= 1024,
        "every piece is copied by the batch: {} copies",
        copies - copies0
    );
    eprintln!(
        "{T}: 1024 reads copied in {} flushes ({} copies)",
        flushes - flushes0,
        copies - copies0
    );
    drop(dev);
    // Abandoned at different points: before any piece landed, and with copies queued.
    for ms in [0, 1, 3] {
        for leak in [false, true] {
            let mut dev = stream.alloc_zeros::<u8>(plan.dst_len()).unwrap();
            abandon_mid_flight(Box::pin(plan.read_into(&mut dev)), ms, leak);
            drop(dev);
            let fresh = stream.alloc_zeros::<u8>(plan.dst_len()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(30));
            assert!(
                stream.clone_dtoh(&fresh).unwrap().iter().all(|&b| b == 0),
                "ms={ms} leak={leak}: a copy landed in memory freed and allocated again"
            );
        }
    }
    // The engine still serves reads after the abandoned batches.
    let mut dev = stream.alloc_zeros::<u8>(plan.dst_len()).unwrap();
    let r = plan.read_into(&mut dev).await.exact(&descs).unwrap();
    assert_eq!(r, 1024 * 4096);
}

/// Batches of small reads served from the page cache (`op::cached` through the batch's
/// stage): every batch borrows the polling thread's pageable stage, and its flush copies from
/// it in one call that reads the stage before returning (or one copy each, which stages it),
/// so the next batch may reuse it at once. The destination's stream is held up by a kernel
/// while eight batches queue their copies behind it: had the driver read the stage when the
/// stream got there, every batch would find the last one's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_batches_served_from_the_page_cache() {
    const T: &str = "device_batches_served_from_the_page_cache";
    const ROUNDS: usize = 40;
    if !gpuio::cuda::available() {
        skipped(format!("{T}: no usable CUDA device"));
        return;
    }
    let ctx = gpuio::cuda::context(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let dir = tmpdir();
    let (path, data) = test_file(dir.path(), "small.bin", 16 << 20, 48);
    let engine = Engine::new().unwrap();
    let f = engine.open(&path).unwrap();
    Spinner::new(&stream).hold(&stream, 200_000_000);
    let mut rng = fastrand::Rng::with_seed(22);
    let before = engine.cached_reads();
    let mut results = Vec::new();
    // 40 batches of about 1.1 MiB each, all queued behind the spinner: each fills more than
    // one pinned stage (1 MiB), none of those stages is free again before the spinner ends, and
    // past the pool's 32 stages the rest stage in pageable memory. A stage written again
    // before its copies ran would show as wrong bytes below.
    for round in 0..ROUNDS {
        // 4 KiB-aligned reads two pages apart (none merge), plus odd sizes and offsets.
        let descs: Vec<ReadDesc> = (0..256)
            .map(|i| {
                let len = if i % 4 == 0 {
                    rng.usize(1..=8192)
                } else {
                    4096
                };
                let off = rng.usize(0..data.len() / 8192 - 2) * 8192 + rng.usize(0..64);
                ReadDesc::new(&f, off as u64, len, i * 8192)
            })
            .collect();
        let plan = BatchPlan::new(descs.clone());
        let mut dev = stream.alloc_zeros::<u8>(plan.dst_len()).unwrap();
        let r = plan.read_into(&mut dev).await.exact(&descs);
        assert!(r.is_ok(), "round {round}: {r:?}");
        results.push((descs, dev));
    }
    let served = engine.cached_reads() - before;
    stream.synchronize().unwrap();
    for (round, (descs, dev)) in results.iter().enumerate() {
        let back = stream.clone_dtoh(dev).unwrap();
        for (i, d) in descs.iter().enumerate() {
            let want = expected(&data, d);
            assert!(
                back[d.dst_offset..d.dst_offset + want.len()] == want[..],
                "round {round}, desc {i}: {} bytes differ",
                differing(&back[d.dst_offset..d.dst_offset + want.len()], &want)
            );
        }
    }
    if served == 0 {
        skipped(format!(
            "{T}: no read was served from the page cache here (RWF_NOWAIT refused?)"
        ));
    } else {
        let all = ROUNDS * 256;
        eprintln!("{T}: {served} of {all} reads served from the page cache");
        assert!(served as usize >= all / 2, "only {served} of {all} served");
    }
}
