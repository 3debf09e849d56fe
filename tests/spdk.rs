//! NVMe namespaces through SPDK, against real NVMe/TCP targets (SPDK's `nvmf_tgt` serving a
//! malloc bdev on 127.0.0.1), each test starting its own target with `scripts/spdk.sh`.
//!
//! Without SPDK (`scripts/spdk.sh build` not run) every test says SKIPPED and why; with
//! `GPUIO_SPDK_REQUIRED=1` (CI, the GPU bundle) a missing SPDK fails instead.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{abandon_mid_flight, abandon_write_then_rewrite, differing, pattern, skipped};
use gpuio::{Engine, Error};

/// Where scripts/spdk.sh is: `GPUIO_SPDK_SCRIPT`, the source tree, or ./scripts.
fn script() -> PathBuf {
    if let Some(p) = std::env::var_os("GPUIO_SPDK_SCRIPT") {
        return p.into();
    }
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/spdk.sh");
    if src.exists() {
        src
    } else {
        PathBuf::from("scripts/spdk.sh")
    }
}

/// Whether SPDK can be used; prints SKIPPED (or panics when required) if not.
fn spdk_ready(test: &str) -> bool {
    match gpuio::spdk::probe().library {
        Ok(_) => {
            reserve_hugepages();
            true
        }
        Err(why) => {
            if std::env::var("GPUIO_SPDK_REQUIRED").is_ok_and(|v| v == "1") {
                panic!("{test}: SPDK is required (GPUIO_SPDK_REQUIRED=1) but unusable: {why}");
            }
            skipped(format!("{test}: SPDK not available: {why}"));
            false
        }
    }
}

/// SPDK's environment starts once per process and needs hugepages then: reserve them before
/// any test can start it (a failed start is final for the process).
fn reserve_hugepages() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mib = std::env::var("GPUIO_SPDK_HUGE_MIB").unwrap_or_else(|_| "2048".into());
        let out = Command::new("bash")
            .arg(script())
            .args(["hugepages", &mib])
            .output()
            .expect("run scripts/spdk.sh hugepages");
        assert!(
            out.status.success(),
            "scripts/spdk.sh hugepages failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
}

/// An nvmf_tgt on its own port, stopped on drop.
struct Target {
    port: u16,
    size_mib: u64,
    trid: String,
}

impl Target {
    fn start(port: u16, size_mib: u64) -> Target {
        let mut t = Target {
            port,
            size_mib,
            trid: String::new(),
        };
        t.run("start").expect("scripts/spdk.sh start");
        t.trid = t.run("trid").expect("scripts/spdk.sh trid");
        t
    }

    fn run(&self, cmd: &str) -> Result<String, String> {
        let out = Command::new("bash")
            .arg(script())
            .arg(cmd)
            .args(["--port", &self.port.to_string()])
            .args(if cmd == "start" {
                vec!["--size".to_string(), self.size_mib.to_string()]
            } else {
                vec![]
            })
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "spdk.sh {cmd} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    fn size(&self) -> u64 {
        self.size_mib << 20
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.run("stop");
    }
}

fn engine(qd: usize) -> Engine {
    Engine::builder()
        .queue_depth(qd)
        .chunk_size(1 << 20)
        .bounce_slots(16)
        .build()
        .expect("engine")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn random_ranges_read_back_what_was_written() {
    if !spdk_ready("random_ranges_read_back_what_was_written") {
        return;
    }
    let t = Target::start(4431, 64);
    let rt = runtime();
    rt.block_on(async {
        let engine = engine(64);
        let f = engine.open_nvme(&t.trid).expect("open namespace");
        assert!(f.is_nvme());
        assert_eq!(f.len().unwrap(), t.size());
        assert_eq!(f.sector_size(), Some(512));
        let size = t.size() as usize;
        // The whole namespace through one aligned write, then random unaligned rewrites.
        let mut model = pattern(size, 7);
        assert_eq!(f.write_from(&model[..], 0).await.unwrap(), size);
        let mut rng = fastrand::Rng::with_seed(11);
        for i in 0..300 {
            let len = if i % 3 == 0 {
                rng.usize(1..=1100)
            } else {
                rng.usize(1..=300_000)
            };
            let off = rng.usize(0..size - len);
            let data = pattern(len, 1000 + i);
            assert_eq!(f.write_from(&data[..], off as u64).await.unwrap(), len);
            model[off..off + len].copy_from_slice(&data);
        }
        for i in 0..300 {
            let len = if i % 2 == 0 {
                rng.usize(1..=4097)
            } else {
                rng.usize(1..=2_000_000)
            };
            let off = rng.usize(0..size - len);
            let mut buf = vec![0u8; len];
            assert_eq!(f.read_into(&mut buf[..], off as u64).await.unwrap(), len);
            assert!(buf == model[off..off + len], "read {len} at {off} differs");
        }
        // Past the end: short, then empty; writes past it are refused whole.
        let mut buf = vec![0u8; 10_000];
        let n = f
            .read_into(&mut buf[..], (size - 1234) as u64)
            .await
            .unwrap();
        assert_eq!(n, 1234);
        assert!(buf[..n] == model[size - 1234..]);
        assert_eq!(f.read_into(&mut buf[..], size as u64 + 5).await.unwrap(), 0);
        let e = f
            .write_from(&buf[..], (size - 100) as u64)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
        assert!(e.to_string().contains("end of the namespace"), "{e}");
        // Nothing was written by the refused write.
        let mut tail = vec![0u8; 100];
        f.read_exact_at(&mut tail[..], (size - 100) as u64)
            .await
            .unwrap();
        assert!(tail == model[size - 100..]);
        f.sync_all().await.unwrap();
    });
}

#[test]
fn concurrent_partial_sector_writes_keep_each_others_bytes() {
    if !spdk_ready("concurrent_partial_sector_writes_keep_each_others_bytes") {
        return;
    }
    let t = Target::start(4432, 16);
    let rt = runtime();
    rt.block_on(async {
        let engine = engine(256);
        let f = engine.open_nvme(&t.trid).expect("open namespace");
        let region = 64 * 512;
        let mut model = pattern(region, 3);
        f.write_from(&model[..], 0).await.unwrap();
        // Many writers of small disjoint byte ranges that share sectors (and straddle sector
        // boundaries), all at once: each is a read-modify-write of its sectors.
        let mut rng = fastrand::Rng::with_seed(5);
        let mut cuts: Vec<usize> = (0..400).map(|_| rng.usize(1..region)).collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut ranges = Vec::new();
        let mut start = 0;
        for c in cuts {
            if rng.bool() {
                ranges.push((start, c - start));
            }
            start = c;
        }
        let writes = ranges.iter().enumerate().map(|(i, &(off, len))| {
            let data = pattern(len, 500 + i as u64);
            model[off..off + len].copy_from_slice(&data);
            let f = f.clone();
            async move { f.write_from(&data[..], off as u64).await }
        });
        for r in futures::future::join_all(writes).await {
            r.expect("partial write");
        }
        let mut back = vec![0u8; region];
        f.read_exact_at(&mut back[..], 0).await.unwrap();
        assert!(
            back == model,
            "a concurrent partial-sector write lost bytes"
        );
    });
}

#[test]
fn more_ops_than_the_queue_and_request_pool_hold() {
    if !spdk_ready("more_ops_than_the_queue_and_request_pool_hold") {
        return;
    }
    let t = Target::start(4433, 32);
    let rt = runtime();
    rt.block_on(async {
        // Queue depth above SPDK's request pool (512) and the target's queue (128): commands
        // wait for requests and go out as others complete.
        let engine = Engine::builder()
            .queue_depth(2048)
            .chunk_size(64 << 10)
            .bounce_slots(256)
            .build()
            .unwrap();
        let f = engine.open_nvme(&t.trid).unwrap();
        let size = t.size() as usize;
        let data = pattern(size, 9);
        f.write_from(&data[..], 0).await.unwrap();
        let reads = (0..3000u64).map(|i| {
            let f = f.clone();
            let off = (i * 7919 * 512 + i * 13) % (size as u64 - 8192);
            let len = 1 + (i as usize * 31) % 8192;
            async move {
                let mut b = vec![0u8; len];
                let n = f.read_into(&mut b[..], off).await?;
                Ok::<_, Error>((off as usize, b, n))
            }
        });
        let t0 = Instant::now();
        for r in futures::future::join_all(reads).await {
            let (off, b, n) = r.expect("read");
            assert_eq!(n, b.len());
            assert!(b == data[off..off + n]);
        }
        eprintln!("3000 concurrent reads in {:?}", t0.elapsed());
    });
}

#[test]
fn dropped_and_leaked_reads_leave_the_engine_usable() {
    if !spdk_ready("dropped_and_leaked_reads_leave_the_engine_usable") {
        return;
    }
    let t = Target::start(4434, 32);
    // A leaked read keeps its slots (up to 3 MiB here) for good: the pool has room for all ten
    // leaks below and the reads after them.
    let engine = Engine::builder()
        .queue_depth(64)
        .chunk_size(1 << 20)
        .bounce_slots(64)
        .build()
        .unwrap();
    let f = engine.open_nvme(&t.trid).unwrap();
    let rt = runtime();
    let size = t.size() as usize;
    let data = pattern(size, 21);
    rt.block_on(f.write_from(&data[..], 0)).unwrap();
    for i in 0..40 {
        let mut buf = vec![0u8; 3 << 20];
        abandon_mid_flight(f.read_into(&mut buf[..], 100 + i), i % 3, i % 4 == 0);
        // The buffer is free again: nothing writes into it after the future is gone.
        buf.fill(0xAB);
        std::thread::sleep(Duration::from_millis(2));
        assert!(
            buf.iter().all(|&b| b == 0xAB),
            "bytes landed after the future was dropped"
        );
    }
    rt.block_on(async {
        let mut b = vec![0u8; 5 << 20];
        f.read_exact_at(&mut b[..], 333).await.unwrap();
        assert!(b == data[333..333 + (5 << 20)]);
    });
}

/// A dropped or leaked write's commands still in the NVMe queue never land after a later
/// write of the same range has completed (the reactor's range fence; issue 18, item 2).
#[test]
fn abandoned_writes_never_land_after_a_later_write() {
    if !spdk_ready("abandoned_writes_never_land_after_a_later_write") {
        return;
    }
    let t = Target::start(4438, 32);
    // Leaks keep up to a quarter of the pool each: 64 MiB holds the four below and the rest.
    let engine = Engine::builder()
        .queue_depth(64)
        .chunk_size(256 << 10)
        .bounce_slots(256)
        .build()
        .unwrap();
    let f = engine.open_nvme(&t.trid).unwrap();
    let rt = runtime();
    const LEN: usize = 8 << 20;
    let first = vec![0x11u8; LEN];
    let mut failures = Vec::new();
    for round in 0..40u64 {
        let leak = round % 10 == 9;
        // Unaligned offsets too: partial sectors are read-modify-written.
        let off = (round % 3) * 1000;
        let second = pattern(LEN, round);
        rt.block_on(async {
            abandon_write_then_rewrite(&f, off, &first[..], &second[..], round % 3, leak).await;
            let mut back = vec![0u8; LEN];
            f.read_exact_at(&mut back[..], off).await.unwrap();
            let bad = differing(&back, &second);
            if bad > 0 {
                failures.push(format!("round {round} (leak={leak}): {bad} bytes stale"));
            }
        });
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn bad_transport_ids_and_unreachable_targets_are_clear_errors() {
    if !spdk_ready("bad_transport_ids_and_unreachable_targets_are_clear_errors") {
        return;
    }
    let engine = engine(8);
    for bad in [
        "",
        "trtype:TCP traddr:127.0.0.1",
        "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:notaport subnqn:x",
        "trtype:XYZ traddr:1",
        "hello world",
    ] {
        let e = engine.open_nvme(bad).unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{bad:?}: {e}");
        assert!(e.to_string().contains("transport ID"), "{bad:?}: {e}");
    }
    // A well-formed ID where nothing listens: an I/O error, quickly.
    let t0 = Instant::now();
    let e = engine
        .open_nvme(
            "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:4499 subnqn:nqn.2016-06.io.spdk:nobody",
        )
        .unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    // PCIe needs DMA bounce memory, which this engine does not have.
    let e = engine
        .open_nvme("trtype:PCIe traddr:0000:00:00.0")
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e}");
    // A namespace that does not exist.
    let t = Target::start(4435, 8);
    let e = engine.open_nvme(&format!("{} ns:9", t.trid)).unwrap_err();
    assert!(e.to_string().contains("namespace 9"), "{e}");
}

#[test]
fn target_killed_mid_io_fails_ops_then_reconnects_after_restart() {
    if !spdk_ready("target_killed_mid_io_fails_ops_then_reconnects_after_restart") {
        return;
    }
    let t = Target::start(4436, 64);
    let rt = runtime();
    rt.block_on(async {
        let engine = engine(64);
        let f = engine.open_nvme(&t.trid).unwrap();
        let size = t.size() as usize;
        f.write_from(&pattern(size, 1)[..], 0).await.unwrap();
        // Readers in a loop; the target dies under them.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..16)
            .map(|i| {
                let f = f.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    let (mut ok, mut err) = (0u64, Vec::new());
                    let mut buf = vec![0u8; 1 << 20];
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let off = (i * 997 * 4096 + ok * 65536) % (size as u64 - (1 << 20));
                        match f.read_into(&mut buf[..], off).await {
                            Ok(_) => ok += 1,
                            Err(e) => {
                                err.push(e.to_string());
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                        }
                    }
                    (ok, err)
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        t.run("kill").unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut errors = Vec::new();
        for r in readers {
            let (ok, err) = tokio::time::timeout(Duration::from_secs(40), r)
                .await
                .expect("a read hung after the target died")
                .unwrap();
            assert!(ok > 0, "no read succeeded before the kill");
            errors.extend(err);
        }
        assert!(
            !errors.is_empty(),
            "no read failed after the target was killed"
        );
        eprintln!("after kill: {} errors, e.g. {}", errors.len(), errors[0]);
        // While it is down, ops fail fast.
        let mut b = vec![0u8; 4096];
        let t0 = Instant::now();
        assert!(f.read_into(&mut b[..], 0).await.is_err());
        assert!(t0.elapsed() < Duration::from_secs(10));
        // Restarted (a fresh malloc bdev: zeros), the same File works again.
        t.run("start").unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let data = pattern(1 << 20, 77);
        loop {
            match f.write_from(&data[..], 4096).await {
                Ok(_) => break,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("waiting for reconnect: {e}");
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                Err(e) => panic!("no reconnect within 30 s: {e}"),
            }
        }
        let mut back = vec![0u8; 1 << 20];
        f.read_exact_at(&mut back[..], 4096).await.unwrap();
        assert!(back == data);
    });
}

#[cfg(feature = "cuda")]
#[test]
fn device_memory_reads_and_writes_through_spdk() {
    if !spdk_ready("device_memory_reads_and_writes_through_spdk") {
        return;
    }
    if !gpuio::cuda::available() {
        let p = gpuio::cuda::probe();
        skipped(format!(
            "device_memory_reads_and_writes_through_spdk: no usable CUDA device ({})",
            p.error.as_deref().unwrap_or("no devices")
        ));
        return;
    }
    let ctx = gpuio::cuda::context(0).expect("CUDA context");
    let stream = ctx.default_stream();
    let t = Target::start(4437, 64);
    let rt = runtime();
    rt.block_on(async {
        // DMA bounce memory, as a local PCIe drive needs.
        let engine = Engine::builder()
            .spdk_memory(true)
            .chunk_size(1 << 20)
            .bounce_slots(32)
            .build()
            .expect("engine with SPDK memory");
        assert!(engine.bounce_pool_is_dma());
        let f = engine.open_nvme(&t.trid).unwrap();
        let size = t.size() as usize;
        let model = pattern(size, 41);
        f.write_from(&model[..], 0).await.unwrap();
        let mut rng = fastrand::Rng::with_seed(3);
        for i in 0..60 {
            let len = if i % 2 == 0 {
                rng.usize(1..=9000)
            } else {
                rng.usize(1..=6_000_000)
            };
            let off = rng.usize(0..size - len);
            let mut d = stream.alloc_zeros::<u8>(len).unwrap();
            assert_eq!(f.read_into(&mut d, off as u64).await.unwrap(), len);
            let back = stream.clone_dtoh(&d).unwrap();
            assert!(
                back == model[off..off + len],
                "device read {len} at {off} differs"
            );
        }
        // From device memory to the namespace, at an unaligned offset.
        let data = pattern(3_000_001, 99);
        let d = stream.clone_htod(&data).unwrap();
        assert_eq!(f.write_from(&d, 12_345).await.unwrap(), data.len());
        let mut back = vec![0u8; data.len()];
        f.read_exact_at(&mut back[..], 12_345).await.unwrap();
        assert!(back == data);
    });
}
