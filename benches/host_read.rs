//! Async read throughput into host memory: gpuio (io_uring and pread backends) against
//! tokio::fs, tokio-uring and std's positional read, across block sizes and queue depths.
//!
//! `cargo bench --bench host_read`. The file is page-cache warm (it is written just before),
//! so this measures the software path, not the disk; `gpuio bench` and
//! `scripts/compare-fio.sh` measure O_DIRECT against the device.

use std::os::unix::fs::FileExt;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const FILE_LEN: usize = 64 << 20;

fn make_file() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join("bench.bin");
    let mut data = vec![0u8; FILE_LEN];
    fastrand::Rng::with_seed(1).fill(&mut data);
    std::fs::write(&p, &data).expect("write bench file");
    (dir, p)
}

/// Offsets of one pass over the file in `bs` blocks.
fn offsets(bs: usize) -> Vec<u64> {
    (0..FILE_LEN / bs).map(|i| (i * bs) as u64).collect()
}

fn bench(c: &mut Criterion) {
    let (_dir, path) = make_file();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mut g = c.benchmark_group("host_read");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Bytes(FILE_LEN as u64));

    let engines: Vec<(&str, gpuio::Engine)> = [
        ("gpuio-uring", gpuio::Backend::Uring),
        ("gpuio-pread", gpuio::Backend::Pread),
    ]
    .into_iter()
    .filter_map(|(n, b)| match gpuio::Engine::builder().backend(b).build() {
        Ok(e) => Some((n, e)),
        Err(e) => {
            eprintln!("SKIPPED {n}: {e}");
            None
        }
    })
    .collect();

    for &(bs, qd) in &[(4096usize, 64usize), (65536, 16), (1 << 20, 8)] {
        let param = format!("bs{}k-qd{qd}", bs / 1024);
        let offs = Arc::new(offsets(bs));
        // Every peer runs `qd` workers, each reusing one buffer and taking the next offset from
        // a shared counter, so the comparison measures I/O paths, not allocation and page faults.
        for (name, engine) in &engines {
            let file = Arc::new(engine.open(&path).expect("open"));
            g.bench_with_input(BenchmarkId::new(*name, &param), &offs, |b, offs| {
                b.to_async(&rt).iter(|| {
                    let next = Arc::new(AtomicUsize::new(0));
                    futures::future::join_all((0..qd).map(|_| {
                        let (file, offs, next) = (file.clone(), offs.clone(), next.clone());
                        async move {
                            let mut buf = vec![0u8; bs];
                            loop {
                                let i = next.fetch_add(1, Ordering::Relaxed);
                                let Some(&o) = offs.get(i) else { break };
                                file.read_into(&mut buf, o).await.expect("read");
                            }
                        }
                    }))
                })
            });
        }
        g.bench_with_input(BenchmarkId::new("tokio-fs", &param), &offs, |b, offs| {
            b.to_async(&rt).iter(|| {
                let next = Arc::new(AtomicUsize::new(0));
                futures::future::join_all((0..qd).map(|_| {
                    let (path, offs, next) = (path.clone(), offs.clone(), next.clone());
                    async move {
                        use tokio::io::{AsyncReadExt, AsyncSeekExt};
                        let mut f = tokio::fs::File::open(&path).await.expect("open");
                        let mut buf = vec![0u8; bs];
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&o) = offs.get(i) else { break };
                            f.seek(std::io::SeekFrom::Start(o)).await.expect("seek");
                            f.read_exact(&mut buf).await.expect("read");
                        }
                    }
                }))
            })
        });
        g.bench_with_input(
            BenchmarkId::new("std-pread-1thread", &param),
            &offs,
            |b, offs| {
                let f = std::fs::File::open(&path).expect("open");
                let mut buf = vec![0u8; bs];
                b.iter(|| {
                    for &o in offs.iter() {
                        f.read_exact_at(&mut buf, o).expect("read");
                    }
                })
            },
        );
        g.bench_with_input(BenchmarkId::new("tokio-uring", &param), &offs, |b, offs| {
            b.iter(|| {
                tokio_uring::start(async {
                    let f = Rc::new(tokio_uring::fs::File::open(&path).await.expect("open"));
                    let next = Rc::new(std::cell::Cell::new(0usize));
                    futures::future::join_all((0..qd).map(|_| {
                        let (f, offs, next) = (f.clone(), offs.clone(), next.clone());
                        async move {
                            let mut buf = vec![0u8; bs];
                            loop {
                                let i = next.get();
                                next.set(i + 1);
                                let Some(&o) = offs.get(i) else { break };
                                let (r, b) = f.read_at(buf, o).await;
                                r.expect("read");
                                buf = b;
                            }
                        }
                    }))
                    .await
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
