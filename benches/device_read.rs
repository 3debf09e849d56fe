//! Read throughput into GPU memory: gpuio's bounce path (io_uring into pinned slots, then
//! async copies) and gpuio through cuFile, against the plain way: `pread` into pinned host
//! memory on a thread per request in flight, then `cuMemcpyHtoD`.
//!
//! `cargo bench --bench device_read` (or `bin/device_read --bench` from the GPU bundle). The
//! file is page-cache warm, so this measures the software path and the copy engine; on a
//! machine without a GPU it prints why it skipped and measures nothing. cuFile is measured only
//! where it can register the file (`gpuio check` says why not).

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use gpuio::cuda::cudarc::driver::{CudaContext, CudaSlice, CudaStream};

const FILE_LEN: usize = 512 << 20;

fn make_file() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = match std::env::var_os("GPUIO_TEST_DIR") {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .expect("tempdir");
    let p = dir.path().join("bench.bin");
    let mut data = vec![0u8; FILE_LEN];
    fastrand::Rng::with_seed(1).fill(&mut data);
    std::fs::write(&p, &data).expect("write bench file");
    (dir, p)
}

/// `qd` workers, each with its own device buffer and stream, take block offsets from a shared
/// counter until the file is covered.
struct Workers {
    streams: Vec<Arc<CudaStream>>,
    bufs: Vec<CudaSlice<u8>>,
}

impl Workers {
    fn new(ctx: &Arc<CudaContext>, qd: usize, bs: usize) -> Self {
        let streams: Vec<_> = (0..qd).map(|_| ctx.new_stream().expect("stream")).collect();
        let bufs = streams
            .iter()
            .map(|s| s.alloc_zeros::<u8>(bs).expect("device buffer"))
            .collect();
        Workers { streams, bufs }
    }
}

/// The next block's offset, while any are left.
fn next_block(next: &AtomicUsize, blocks: usize, bs: usize) -> Option<u64> {
    let i = next.fetch_add(1, Ordering::Relaxed);
    (i < blocks).then_some((i * bs) as u64)
}

fn bench(c: &mut Criterion) {
    let ctx = match gpuio::cuda::context(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("SKIPPED device_read: no usable GPU ({e})");
            return;
        }
    };
    let (_dir, path) = make_file();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mut g = c.benchmark_group("device_read");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Bytes(FILE_LEN as u64));

    let mut engines = vec![(
        "gpuio-bounce",
        gpuio::Engine::builder()
            .backend(gpuio::Backend::Uring)
            .build()
            .expect("engine"),
    )];
    match gpuio::Engine::builder()
        .backend(gpuio::Backend::Gds)
        .build()
    {
        Ok(e) => match e.open(&path) {
            Ok(_) => engines.push(("gpuio-cufile", e)),
            Err(why) => eprintln!("SKIPPED gpuio-cufile: {why}"),
        },
        Err(why) => eprintln!("SKIPPED gpuio-cufile: {why}"),
    }

    for &(bs, qd) in &[(1usize << 20, 8usize), (16 << 20, 4)] {
        let param = format!("bs{}M-qd{qd}", bs >> 20);
        let blocks = FILE_LEN / bs;
        for (name, engine) in &engines {
            let file = Arc::new(engine.open(&path).expect("open"));
            let mut w = Workers::new(&ctx, qd, bs);
            g.bench_function(BenchmarkId::new(*name, &param), |b| {
                b.iter_custom(|iters| {
                    rt.block_on(async {
                        let start = Instant::now();
                        for _ in 0..iters {
                            let next = AtomicUsize::new(0);
                            let work = w.bufs.iter_mut().zip(&w.streams).map(|(buf, s)| {
                                let (file, next) = (&file, &next);
                                async move {
                                    while let Some(off) = next_block(next, blocks, bs) {
                                        file.read_into(buf, off).on_stream(s).await.expect("read");
                                    }
                                }
                            });
                            futures::future::join_all(work).await;
                            // The clock stops when every copy has landed.
                            for s in &w.streams {
                                engine.synchronize(s).await.expect("synchronize");
                            }
                        }
                        start.elapsed()
                    })
                })
            });
        }

        // The plain way: a thread per request in flight, pread into pinned memory, then copy.
        let file = Arc::new(std::fs::File::open(&path).expect("open"));
        let mut w = Workers::new(&ctx, qd, bs);
        let mut pinned: Vec<_> = (0..qd)
            // SAFETY: the pinned buffers are only read after pread has filled them.
            .map(|_| unsafe { ctx.alloc_pinned::<u8>(bs) }.expect("pinned"))
            .collect();
        g.bench_function(BenchmarkId::new("pread+pinned-htod", &param), |b| {
            b.iter(|| {
                let next = AtomicUsize::new(0);
                std::thread::scope(|scope| {
                    for ((buf, s), host) in w.bufs.iter_mut().zip(&w.streams).zip(&mut pinned) {
                        let (file, next) = (&file, &next);
                        scope.spawn(move || {
                            while let Some(off) = next_block(next, blocks, bs) {
                                let h = host.as_mut_slice().expect("pinned slice");
                                file.read_exact_at(h, off).expect("pread");
                                s.memcpy_htod(&*host, buf).expect("htod");
                                // The pinned buffer is refilled next: wait for the copy.
                                s.synchronize().expect("synchronize");
                            }
                        });
                    }
                });
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
