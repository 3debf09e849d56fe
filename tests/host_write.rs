//! Writes from host memory, read back through pread and through gpuio.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_writes_match_a_model() {
    let dir = tmpdir();
    for (name, engine) in engines() {
        for (direct, path, f) in fresh_rw_files(&engine, dir.path(), &format!("w-{name}")) {
            let mut model: Vec<u8> = Vec::new();
            let mut rng = fastrand::Rng::with_seed(9);
            for i in 0..120u64 {
                let off = rng.usize(0..2_000_000);
                let len = match i % 3 {
                    0 => rng.usize(1..100),
                    1 => rng.usize(1..20_000),
                    _ => rng.usize(1..1_500_000),
                };
                let src = pattern(len, i);
                let n = f.write_from(&src, off as u64).await.unwrap();
                assert_eq!(n, len);
                if model.len() < off + len {
                    model.resize(off + len, 0);
                }
                model[off..off + len].copy_from_slice(&src);
                if i % 10 == 0 {
                    let mut back = vec![0u8; model.len() + 100];
                    let got = f.read_into(&mut back, 0).await.unwrap();
                    assert_eq!(
                        got,
                        model.len(),
                        "{name} direct={direct} size after write {i}"
                    );
                    assert!(
                        back[..got] == model[..],
                        "{name} direct={direct} after write {i}"
                    );
                }
            }
            f.sync_all().await.unwrap();
            assert_eq!(f.len().unwrap(), model.len() as u64);
            assert!(
                std::fs::read(&path).unwrap() == model,
                "{name} direct={direct} final"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_write_and_create_truncate() {
    let dir = tmpdir();
    for (name, engine) in engines() {
        let path = dir.path().join(format!("o-{name}"));
        std::fs::write(&path, vec![1u8; 50_000]).unwrap();
        let f = engine.create(&path).unwrap();
        assert_eq!(f.len().unwrap(), 0, "create truncates");
        let (r, buf) = f
            .write_owned(bytes::Bytes::from_static(b"hello gpuio"), 5)
            .await;
        assert_eq!(r.unwrap(), 11);
        assert_eq!(&buf[..], b"hello gpuio");
        let (r, _) = f.write_owned(String::from("!"), 16).await;
        assert_eq!(r.unwrap(), 1);
        assert_eq!(f.write_from(&[] as &[u8], 1000).await.unwrap(), 0);
        f.sync_all().await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"\0\0\0\0\0hello gpuio!");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_disjoint_writes() {
    let dir = tmpdir();
    for (name, engine) in engines() {
        let path = dir.path().join(format!("c-{name}"));
        let f = std::sync::Arc::new(engine.create(&path).unwrap());
        let mut set = tokio::task::JoinSet::new();
        const PIECE: usize = 300_001;
        for t in 0..32u64 {
            let f = f.clone();
            set.spawn(async move {
                let src = pattern(PIECE, t);
                f.write_from(&src, t * PIECE as u64).await.unwrap();
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        let back = std::fs::read(&path).unwrap();
        assert_eq!(back.len(), 32 * PIECE, "{name}");
        for t in 0..32usize {
            assert!(
                back[t * PIECE..(t + 1) * PIECE] == pattern(PIECE, t as u64)[..],
                "{name} piece {t}"
            );
        }
    }
}

/// O_DIRECT writes with the smallest chunk (one 4 KiB block): a write that contains no whole
/// block but crosses a block boundary used to become one buffered piece larger than any
/// bounce slot, and waited for a slot forever (found by the planner fuzz target's checker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_writes_with_one_block_chunks() {
    let dir = tmpdir();
    let engine = gpuio::Engine::builder()
        .chunk_size(4096)
        .bounce_slots(4)
        .build()
        .unwrap();
    for (direct, path, f) in fresh_rw_files(&engine, dir.path(), "small-chunk") {
        let mut model = vec![0u8; 64 << 10];
        for (off, len) in [
            (1u64, 8000usize),
            (4000, 200),
            (4095, 4098),
            (9000, 30_000),
            (0, 4096),
        ] {
            let src = pattern(len, off);
            let n =
                tokio::time::timeout(std::time::Duration::from_secs(20), f.write_from(&src, off))
                    .await
                    .unwrap_or_else(|_| panic!("direct={direct}: write of {len} at {off} hung"))
                    .unwrap();
            assert_eq!(n, len);
            model[off as usize..off as usize + len].copy_from_slice(&src);
        }
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(&on_disk[..], &model[..on_disk.len()], "direct={direct}");
    }
}

/// The machine-sized pool with the smallest chunk: 256 MiB of 4 KiB blocks would be 65 536
/// slots, one more than the slot table indexes; the default pool stops at the table's size
/// instead of refusing to build (found by `gpuio cp --chunk 4K`).
#[tokio::test]
async fn the_default_pool_fits_the_slot_table_with_one_block_chunks() {
    let builder = gpuio::Engine::builder().chunk_size(4096);
    let sizing = builder.sizing();
    assert!(sizing.bounce_bytes / sizing.block() <= u16::MAX as usize);
    let engine = builder.build().unwrap();
    let dir = tmpdir();
    let path = dir.path().join("f");
    std::fs::write(&path, pattern(1 << 20, 3)).unwrap();
    let f = engine.open(&path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    assert_eq!(f.read_into(&mut buf[..], 0).await.unwrap(), 1 << 20);
    assert!(buf == pattern(1 << 20, 3));
}
