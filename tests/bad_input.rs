//! Bad input gets a clear error: no panic, no hang.

mod common;

use std::time::Duration;

use common::*;
use gpuio::batch::{BatchPlan, ReadDesc};
use gpuio::{Error, OpenOptions};

/// Every case must finish well within this.
const LIMIT: Duration = Duration::from_secs(20);

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    within_limit(LIMIT, f).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_errors_name_the_cause() {
    let dir = tmpdir();
    for (name, engine) in engines() {
        let missing = engine.open(dir.path().join("nope")).unwrap_err();
        assert_eq!(
            missing.raw_os_error(),
            Some(libc::ENOENT),
            "{name}: {missing}"
        );
        assert!(missing.to_string().contains("nope"), "{missing}");

        let e = engine.open(dir.path()).unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
        assert!(e.to_string().contains("directory"), "{e}");

        let fifo = dir.path().join(format!("fifo-{name}"));
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = within(async { engine.open(&fifo) }).await.unwrap_err();
        assert!(e.to_string().contains("FIFO"), "{e}");

        let e = OpenOptions::new()
            .open(&engine, dir.path().join("x"))
            .unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
        let e = OpenOptions::new()
            .read(true)
            .create(true)
            .open(&engine, dir.path().join("x"))
            .unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
    }
}

/// Makes `path` unwritable even for root where possible (immutable flag), else by mode bits.
fn make_unwritable(path: &std::path::Path) -> bool {
    const FS_IOC_GETFLAGS: libc::Ioctl = 0x8008_6601;
    const FS_IOC_SETFLAGS: libc::Ioctl = 0x4008_6602;
    const FS_IMMUTABLE_FL: libc::c_long = 0x10;
    if unsafe { libc::geteuid() } != 0 {
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o400))
            .unwrap();
        return true;
    }
    let f = std::fs::File::open(path).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let mut flags: libc::c_long = 0;
    if unsafe { libc::ioctl(fd, FS_IOC_GETFLAGS, &mut flags) } != 0 {
        return false;
    }
    flags |= FS_IMMUTABLE_FL;
    unsafe { libc::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0 }
}

fn clear_immutable(path: &std::path::Path) {
    const FS_IOC_SETFLAGS: libc::Ioctl = 0x4008_6602;
    if let Ok(f) = std::fs::File::open(path) {
        let zero: libc::c_long = 0;
        unsafe { libc::ioctl(std::os::fd::AsRawFd::as_raw_fd(&f), FS_IOC_SETFLAGS, &zero) };
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_permission() {
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "ro", 100, 1);
    if !make_unwritable(&path) {
        skipped("no_permission: cannot make a file unwritable here (no immutable flag support)");
        return;
    }
    let engine = gpuio::Engine::builder()
        .chunk_size(1 << 16)
        .bounce_slots(2)
        .build()
        .unwrap();
    let e = OpenOptions::new()
        .write(true)
        .open(&engine, &path)
        .unwrap_err();
    clear_immutable(&path);
    assert!(
        matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)),
        "{e}"
    );
    assert!(e.to_string().starts_with("open "), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_access_and_overflow() {
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "d", 10_000, 1);
    for (name, engine) in engines() {
        let wo = OpenOptions::new().write(true).open(&engine, &path).unwrap();
        let mut buf = vec![0u8; 10];
        let e = within(wo.read_into(&mut buf, 0)).await.unwrap_err();
        assert!(e.to_string().contains("without read access"), "{name}: {e}");
        let ro = engine.open(&path).unwrap();
        let e = within(ro.write_from(&buf, 0)).await.unwrap_err();
        assert!(
            e.to_string().contains("without write access"),
            "{name}: {e}"
        );
        for off in [u64::MAX, u64::MAX - 5, i64::MAX as u64] {
            let e = within(ro.read_into(&mut buf, off)).await.unwrap_err();
            assert!(matches!(e, Error::InvalidInput { .. }), "{name}: {e}");
            let e = within(wo.write_from(&buf, off)).await.unwrap_err();
            assert!(matches!(e, Error::InvalidInput { .. }), "{name}: {e}");
        }
        // Large but legal offsets read nothing.
        assert_eq!(within(ro.read_into(&mut buf, 1 << 50)).await.unwrap(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_shut_down() {
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "d", 10_000, 1);
    for (name, engine) in engines() {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&engine, &path)
            .unwrap();
        within(engine.shutdown()).await.unwrap();
        assert!(engine.is_shut_down());
        let mut buf = vec![0u8; 10];
        let e = within(f.read_into(&mut buf, 0)).await.unwrap_err();
        assert!(matches!(e, Error::Shutdown { .. }), "{name}: {e}");
        let e = within(f.write_from(&buf, 0)).await.unwrap_err();
        assert!(matches!(e, Error::Shutdown { .. }), "{name}: {e}");
        assert!(within(f.sync_all()).await.is_err());
        // A second shutdown is fine.
        within(engine.shutdown()).await.unwrap();
        let io: std::io::Error = e.into();
        assert_eq!(io.kind(), std::io::ErrorKind::BrokenPipe);
    }
}

#[test]
fn bad_engine_settings() {
    for b in [
        gpuio::Engine::builder().chunk_size(1000),
        gpuio::Engine::builder().chunk_size(0),
        gpuio::Engine::builder().queue_depth(0),
        gpuio::Engine::builder().bounce_slots(0),
        gpuio::Engine::builder().page_cache_copies(0),
        gpuio::Engine::builder().copies_per_device(0),
    ] {
        let e = b.build().unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
    }
    // Reactors: at least one, at most 64, and each needs a bounce slot of its own.
    for b in [
        gpuio::Engine::builder().reactors(0),
        gpuio::Engine::builder().reactors(65),
        gpuio::Engine::builder().bounce_slots(2).reactors(3),
    ] {
        let e = b.build().unwrap_err();
        assert!(matches!(e, Error::InvalidInput { .. }), "{e}");
        assert!(e.to_string().contains("reactors"), "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_io_in_flight_fails_it_cleanly() {
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "d", 8 << 20, 1);
    for (name, engine) in engines() {
        let f = engine.open(&path).unwrap();
        let mut bufs: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; 1 << 20]).collect();
        let futs: Vec<_> = bufs.iter_mut().map(|b| f.read_into(b, 0)).collect();
        let (results, shut) =
            within(async { tokio::join!(futures::future::join_all(futs), engine.shutdown()) })
                .await;
        shut.unwrap();
        for r in results {
            match r {
                Ok(n) => assert_eq!(n, 1 << 20),
                Err(e) => assert!(matches!(e, Error::Shutdown { .. }), "{name}: {e}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pseudo_files_are_refused_naming_the_filesystem() {
    for (name, engine) in engines() {
        for (path, fs) in [
            ("/proc/self/status", "proc"),
            ("/proc/cpuinfo", "proc"),
            ("/sys/kernel/mm/transparent_hugepage/enabled", "sysfs"),
        ] {
            if !std::path::Path::new(path).exists() {
                skipped(format!("pseudo-file row: {path} does not exist here"));
                continue;
            }
            let e = engine.open(path).unwrap_err();
            assert!(matches!(e, Error::InvalidInput { .. }), "{name}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("a {fs} pseudo-file")),
                "{name}: {msg}"
            );
            assert!(msg.contains(path), "{name}: {msg}");
        }
    }
}

/// tmpfs takes O_DIRECT on Linux 6.6 and later; before that the open must fail naming tmpfs
/// and O_DIRECT. Either way nothing is lost: where it opens, bytes round-trip exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tmpfs_with_direct_works_or_says_why() {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() {
        skipped("tmpfs + direct row: no /dev/shm on this machine");
        return;
    }
    let dir = tempfile::tempdir_in(shm).unwrap();
    let (path, mut model) = test_file(dir.path(), "t", 300_000, 4);
    for (name, engine) in engines() {
        let f = match OpenOptions::new()
            .read(true)
            .write(true)
            .direct(true)
            .open(&engine, &path)
        {
            Ok(f) => f,
            Err(e) => {
                assert!(matches!(e, Error::Unsupported { .. }), "{name}: {e}");
                assert!(e.to_string().contains("tmpfs refuses O_DIRECT"), "{e}");
                continue;
            }
        };
        let src = pattern(12_345, 9);
        assert_eq!(within(f.write_from(&src, 4097)).await.unwrap(), src.len());
        model[4097..4097 + src.len()].copy_from_slice(&src);
        let mut buf = vec![0u8; 100_001];
        assert_eq!(within(f.read_into(&mut buf, 3)).await.unwrap(), buf.len());
        assert_eq!(&buf[..], &model[3..100_004], "{name}");
        assert_eq!(std::fs::read(&path).unwrap(), model, "{name}");
    }
}

/// Checks an end-of-file error names the file and the offset and says how many bytes were
/// wanted and how many were read before the file ended.
fn says_wanted_and_got(
    what: &str,
    e: &Error,
    path: &std::path::Path,
    offset: u64,
    wanted: u64,
    got: u64,
) {
    assert!(
        matches!(e, Error::UnexpectedEof { wanted: w, got: g, .. } if (*w, *g) == (wanted, got)),
        "{what}: {e:?}"
    );
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    assert_eq!(e.context().path.as_deref(), Some(path), "{what}: {e}");
    assert_eq!(e.context().offset, Some(offset), "{what}: {e}");
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{what}: {msg}");
    assert!(
        msg.contains(&format!("at offset {offset}")),
        "{what}: {msg}"
    );
    assert!(
        msg.contains(&format!("wanted {wanted} bytes, got {got}")),
        "{what}: {msg}"
    );
}

/// `read_exact_at` and `BatchResult::exact` past the end of a 1000-byte file: the error says
/// which file, where, wanted N, got M (it used to say "file had M", which reads as the file's
/// size).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_of_file_errors_say_where_wanted_and_got() {
    let dir = tmpdir();
    let (path, _) = test_file(dir.path(), "short", 1000, 5);
    for (name, engine) in engines() {
        let f = engine.open(&path).unwrap();
        let mut buf = vec![0u8; 100];
        let e = within(f.read_exact_at(&mut buf, 950)).await.unwrap_err();
        says_wanted_and_got(name, &e, &path, 950, 100, 50);
        let e = within(f.read_exact_at(&mut buf, 5000)).await.unwrap_err();
        says_wanted_and_got(name, &e, &path, 5000, 100, 0);

        let plan = BatchPlan::new(vec![
            ReadDesc::new(&f, 0, 10, 0),
            ReadDesc::new(&f, 980, 100, 10),
        ]);
        let mut buf = vec![0u8; plan.dst_len()];
        let r = within(plan.read_into(&mut buf)).await;
        let e = r.exact(plan.descs()).unwrap_err();
        says_wanted_and_got(name, &e, &path, 980, 100, 20);
    }
}
