//! Real faults under I/O: a file truncated while a large read runs, a filesystem that fills
//! up during writes. (A reactor panic is injected in the crate's own tests, SPDK targets are
//! killed in `tests/spdk.rs`, cuFile faults are in `tests/gds.rs`.)

mod common;

use std::path::{Path, PathBuf};

use common::*;
use gpuio::{Error, OpenOptions};

/// The count a read reports is a prefix of the file as it was: never bytes the file no
/// longer had, never zeros standing in for data. Some trials must actually come back short,
/// else the test proved nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_while_a_large_read_runs() {
    const LEN: usize = 32 << 20;
    let dir = tmpdir();
    let data = pattern(LEN, 11);
    for (name, engine) in slow_engines("the fault tests") {
        let mut short = 0;
        let mut trials = 0;
        for direct in [false, true] {
            for trial in 0..6u64 {
                let path = dir.path().join(format!("t-{name}-{direct}-{trial}"));
                std::fs::write(&path, &data).unwrap();
                let f = match OpenOptions::new()
                    .read(true)
                    .direct(direct)
                    .open(&engine, &path)
                {
                    Ok(f) => f,
                    Err(e) if direct => {
                        skipped(format!("truncation with O_DIRECT: {e}"));
                        break;
                    }
                    Err(e) => panic!("{e}"),
                };
                // Unaligned, somewhere in the first half.
                let cut = 1_000_003 * (trial + 1) + 17;
                let mut buf = vec![0xEEu8; LEN];
                let mut read = Box::pin(f.read_into(&mut buf, 0));
                // The first poll hands the read to the reactor; truncate right after.
                let first = futures::poll!(read.as_mut());
                let truncater = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                truncater.set_len(cut).unwrap();
                let n = match first {
                    std::task::Poll::Ready(r) => r,
                    std::task::Poll::Pending => within(read.as_mut()).await,
                }
                .unwrap_or_else(|e| panic!("{name} direct={direct}: {e}"));
                drop(read);
                trials += 1;
                assert!(n <= LEN, "{name}: count {n} past the request");
                assert_eq!(
                    &buf[..n],
                    &data[..n],
                    "{name} direct={direct} trial {trial}: reported bytes differ from the file"
                );
                if n < LEN {
                    short += 1;
                    // Pieces can finish before the truncation lands (a loaded machine may
                    // run the reactor well ahead of this thread), so a count past the cut
                    // is a true answer: those bytes were in the file when they were read,
                    // and the comparison above proves they are the file's. But such a
                    // read can only have stopped where a later piece or page found the new
                    // end, which is page-aligned: anything else means a count that does
                    // not match what the pieces returned.
                    assert!(
                        n as u64 <= cut || n % 4096 == 0,
                        "{name} direct={direct}: short count {n} past the truncation point \
                         {cut} and not where a piece or page ends"
                    );
                }
                // A read after the truncation sees exactly the new length.
                let mut after = vec![0u8; 2 << 20];
                let m = within(f.read_into(&mut after, cut - 1000)).await.unwrap();
                assert_eq!(m, 1000, "{name} direct={direct}");
                assert_eq!(&after[..m], &data[cut as usize - 1000..cut as usize]);
            }
        }
        assert!(
            short > 0,
            "{name}: none of {trials} reads overlapped its truncation; the test proved nothing"
        );
    }
}

/// A small tmpfs mounted for one test and unmounted (lazily) when dropped.
struct SmallFs {
    dir: tempfile::TempDir,
    mounted: PathBuf,
}

impl SmallFs {
    fn mount(bytes: usize) -> Result<Self, String> {
        let dir = tmpdir();
        let mounted = dir.path().join("mnt");
        std::fs::create_dir(&mounted).map_err(|e| e.to_string())?;
        let target = std::ffi::CString::new(mounted.to_str().unwrap()).unwrap();
        let opts = std::ffi::CString::new(format!("size={bytes},mode=0777")).unwrap();
        // SAFETY: every pointer is a NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::mount(
                c"gpuio-test".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return Err(format!(
                "mounting a {bytes}-byte tmpfs failed ({}); needs CAP_SYS_ADMIN",
                std::io::Error::last_os_error()
            ));
        }
        Ok(SmallFs { dir, mounted })
    }

    fn path(&self) -> &Path {
        &self.mounted
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        use std::os::unix::ffi::OsStrExt;
        if let Ok(target) = std::ffi::CString::new(self.mounted.as_os_str().as_bytes()) {
            // SAFETY: NUL-terminated path that outlives the call.
            unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = &self.dir;
    }
}

/// Writes until the filesystem is full: every failure is ENOSPC (never a success that did not
/// land), and every write reported done reads back byte for byte. Eight writers at once, some
/// unaligned, buffered and O_DIRECT, so the filesystem fills in the middle of writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_filesystem_during_writes() {
    const FS: usize = 24 << 20;
    let fs = match SmallFs::mount(FS) {
        Ok(fs) => fs,
        Err(why) => {
            skipped(format!("full_filesystem_during_writes: {why}"));
            return;
        }
    };
    for (name, engine) in slow_engines("the fault tests") {
        for direct in [false, true] {
            let path = fs.path().join(format!("w-{name}-{direct}"));
            let f = match OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .direct(direct)
                .open(&engine, &path)
            {
                Ok(f) => f,
                Err(e) if direct => {
                    skipped(format!("full filesystem with O_DIRECT: {e}"));
                    continue;
                }
                Err(e) => panic!("{e}"),
            };
            // Writer w writes blocks w, w+8, w+16, ... of 1 MiB + w*1000 bytes each (some
            // unaligned) at distinct offsets, until its first error.
            let writers = (0..8u64).map(|w| {
                let f = &f;
                async move {
                    let mut done = Vec::new();
                    for k in 0.. {
                        let block = w + 8 * k;
                        let len = (1 << 20) + (w as usize) * 1000;
                        let off = block * (2 << 20) + w * 513;
                        let src = pattern(len, block);
                        match f.write_from(&src, off).await {
                            Ok(n) => {
                                assert_eq!(n, len, "{name}: write count");
                                done.push((off, src));
                            }
                            Err(e) => return (done, e),
                        }
                        assert!(k < 64, "{name}: {FS} bytes never filled up");
                    }
                    unreachable!()
                }
            });
            let results = within(futures::future::join_all(writers)).await;
            let mut reported = 0usize;
            for (done, e) in &results {
                assert_eq!(
                    e.raw_os_error(),
                    Some(libc::ENOSPC),
                    "{name} direct={direct}: {e}"
                );
                assert!(matches!(e, Error::Io { .. }), "{e}");
                assert!(e.to_string().starts_with("write "), "{e}");
                reported += done.len();
            }
            assert!(reported > 0, "{name}: nothing fit");
            // What was reported written is in the file, through gpuio and through std.
            let on_disk = std::fs::read(&path).unwrap();
            for (done, _) in &results {
                for (off, src) in done {
                    let at = *off as usize;
                    assert_eq!(
                        &on_disk[at..at + src.len()],
                        &src[..],
                        "{name} direct={direct}: write at {off} reported done but not on disk"
                    );
                    let mut back = vec![0u8; src.len()];
                    let n = within(f.read_into(&mut back, *off)).await.unwrap();
                    assert_eq!(n, src.len());
                    assert!(back == *src, "{name}: read back at {off} differs");
                }
            }
            // The engine keeps serving; freeing space makes writes succeed again.
            drop(f);
            std::fs::remove_file(&path).unwrap();
            let g = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .open(&engine, fs.path().join("after"))
                .unwrap();
            let src = pattern(3 << 20, 5);
            assert_eq!(within(g.write_from(&src, 0)).await.unwrap(), src.len());
            within(g.sync_all()).await.unwrap();
            std::fs::remove_file(fs.path().join("after")).unwrap();
        }
    }
}
