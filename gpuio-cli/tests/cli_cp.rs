//! `gpuio cp` run as the real binary: what a careless or hostile user does to it.

mod cli_util;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use cli_util::*;

/// `gpuio cp SRC DST` with the umask pinned, so modes are predictable.
fn cp(src: &Path, dst: &Path, extra: &[&str]) -> Ran {
    run(std::process::Command::new("sh")
        .arg("-c")
        .arg(r#"umask 022; exec "$0" cp "$@""#)
        .arg(cli_util::bin())
        .args(extra)
        .arg(src)
        .arg(dst))
}

fn temp_files(dir: &Path) -> Vec<String> {
    names(dir)
        .into_iter()
        .filter(|n| n.contains(".gpuio-tmp-"))
        .collect()
}

#[test]
fn cp_refuses_a_file_onto_itself_in_every_spelling() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = random_bytes(3 << 20, 1);
    std::fs::write(d.join("a.bin"), &data).unwrap();
    std::os::unix::fs::symlink("a.bin", d.join("link")).unwrap();
    std::fs::hard_link(d.join("a.bin"), d.join("hard")).unwrap();
    for dst in ["a.bin", "./a.bin", "link", "hard", "."] {
        let r = run(gpuio().current_dir(d).args(["cp", "a.bin", dst]));
        assert!(!r.ok(), "cp a.bin {dst}: {r:?}");
        assert!(
            r.stderr.contains("are the same file"),
            "cp a.bin {dst}: {r:?}"
        );
        assert!(r.stderr.contains("'a.bin'"), "{r:?}");
        assert_eq!(
            std::fs::read(d.join("a.bin")).unwrap(),
            data,
            "cp a.bin {dst} changed the file"
        );
    }
    assert!(temp_files(d).is_empty(), "{:?}", names(d));
}

#[test]
fn cp_gives_a_new_file_the_source_mode_and_keeps_an_existing_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = random_bytes(1 << 20, 2);
    for mode in [0o600, 0o755, 0o640] {
        let src = d.join(format!("key{mode:o}"));
        std::fs::write(&src, &data).unwrap();
        std::fs::set_permissions(&src, std::fs::Permissions::from_mode(mode)).unwrap();
        let dst = d.join(format!("copy{mode:o}"));
        let r = cp(&src, &dst, &[]);
        assert!(r.ok(), "{r:?}");
        let got = std::fs::metadata(&dst).unwrap().permissions().mode() & 0o777;
        assert_eq!(got, mode, "a new copy of a {mode:o} file");
        assert_eq!(std::fs::read(&dst).unwrap(), data);
    }
    // An existing destination keeps its own mode, as with coreutils (which writes in place).
    let dst = d.join("existing");
    std::fs::write(&dst, b"old").unwrap();
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o604)).unwrap();
    let r = cp(&d.join("key600"), &dst, &[]);
    assert!(r.ok(), "{r:?}");
    assert_eq!(
        std::fs::metadata(&dst).unwrap().permissions().mode() & 0o777,
        0o604
    );
    assert_eq!(std::fs::read(&dst).unwrap(), data);
    assert!(temp_files(d).is_empty(), "{:?}", names(d));
}

#[test]
fn a_failed_cp_leaves_no_temporary_file_and_the_old_destination() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = d.join("src");
    std::fs::write(&src, random_bytes(4 << 20, 3)).unwrap();
    let dst = d.join("dst");
    std::fs::write(&dst, b"old contents").unwrap();
    // A file-size limit of well under 4 MiB (sh counts 512- or 1024-byte blocks): the
    // writes fail midway with EFBIG.
    let r = run(std::process::Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -f 1024; exec "$0" cp "$1" "$2""#)
        .arg(cli_util::bin())
        .arg(&src)
        .arg(&dst));
    assert!(!r.ok(), "{r:?}");
    assert!(r.stderr.contains(&*dst.to_string_lossy()), "{r:?}");
    assert!(r.stderr.contains("File too large"), "{r:?}");
    assert_eq!(std::fs::read(&dst).unwrap(), b"old contents");
    assert!(temp_files(d).is_empty(), "{:?}", names(d));

    // A destination directory that does not exist: the message names it.
    let r = cp(&src, &d.join("nodir/x"), &[]);
    assert!(!r.ok(), "{r:?}");
    assert!(r.stderr.contains("nodir"), "{r:?}");
    // A source that is a directory: refused by name, the destination untouched.
    let r = cp(d, &dst, &[]);
    assert!(!r.ok(), "{r:?}");
    assert!(r.stderr.contains("is a directory"), "{r:?}");
    assert_eq!(std::fs::read(&dst).unwrap(), b"old contents");
    assert_eq!(names(d), ["dst", "src"]);
}

#[test]
fn cp_refuses_special_destinations_by_name_and_copies_into_a_directory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = d.join("src");
    let data = random_bytes(1 << 20, 4);
    std::fs::write(&src, &data).unwrap();
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.to_string_lossy().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    // No reader: this used to fail with a bare "No such device or address".
    let r = cp(&src, &fifo, &[]);
    assert!(!r.ok(), "{r:?}");
    assert!(
        r.stderr.contains("'") && r.stderr.contains("fifo' is a FIFO"),
        "{r:?}"
    );
    let r = cp(&src, Path::new("/dev/null"), &[]);
    assert!(!r.ok(), "{r:?}");
    assert!(
        r.stderr.contains("'/dev/null' is a character device"),
        "{r:?}"
    );
    std::os::unix::fs::symlink("nowhere", d.join("dangling")).unwrap();
    let r = cp(&src, &d.join("dangling"), &[]);
    assert!(!r.ok(), "{r:?}");
    assert!(r.stderr.contains("dangling symlink"), "{r:?}");
    assert!(!d.join("nowhere").exists());

    // An existing directory: copy into it under the source's name, like coreutils.
    let sub = d.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let r = cp(&src, &sub, &[]);
    assert!(r.ok(), "{r:?}");
    assert_eq!(std::fs::read(sub.join("src")).unwrap(), data);
    // ...but never over a directory of that name.
    std::fs::create_dir(d.join("sub2")).unwrap();
    std::fs::create_dir(d.join("sub2/src")).unwrap();
    let r = cp(&src, &d.join("sub2"), &[]);
    assert!(!r.ok(), "{r:?}");
    assert!(r.stderr.contains("cannot overwrite directory"), "{r:?}");
    assert!(temp_files(d).is_empty() && temp_files(&sub).is_empty());
}

/// A copy slow enough to interrupt: 128 MiB of data in 4 KiB pieces, one at a time.
fn slow_copy(src: &Path, dst: &Path) -> Running {
    Running::spawn(
        gpuio()
            .args(["cp", "--chunk", "4K", "--qd", "1"])
            .arg(src)
            .arg(dst),
    )
}

#[test]
fn a_signal_during_cp_leaves_neither_a_temporary_file_nor_a_partial_destination() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = d.join("src");
    std::fs::write(&src, random_bytes(128 << 20, 5)).unwrap();

    // SIGTERM over an existing destination: it stays as it was.
    let dst = d.join("dst");
    std::fs::write(&dst, b"old contents").unwrap();
    let mut c = slow_copy(&src, &dst);
    wait_for_file(d, ".dst.gpuio-tmp-", &mut c);
    c.signal(libc::SIGTERM);
    let r = c.wait();
    assert_eq!(std::fs::read(&dst).unwrap(), b"old contents");
    assert_eq!(names(d), ["dst", "src"]);
    assert_eq!(r.status.code(), Some(143), "{r:?}");

    // SIGINT (Ctrl-C) with no destination yet: none afterwards.
    let new = d.join("new");
    let mut c = slow_copy(&src, &new);
    wait_for_file(d, ".new.gpuio-tmp-", &mut c);
    c.signal(libc::SIGINT);
    let r = c.wait();
    assert_eq!(names(d), ["dst", "src"]);
    assert_eq!(r.status.code(), Some(130), "{r:?}");
}

#[test]
fn a_source_that_shrinks_during_cp_is_reported_with_its_path_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = d.join("src");
    std::fs::write(&src, random_bytes(128 << 20, 6)).unwrap();
    let dst = d.join("dst");
    let mut c = slow_copy(&src, &dst);
    wait_for_file(d, ".dst.gpuio-tmp-", &mut c);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&src)
        .unwrap()
        .set_len(0)
        .unwrap();
    let r = c.wait();
    assert!(!r.ok(), "{r:?}");
    let src_s = src.to_string_lossy();
    assert!(
        r.stderr
            .contains(&format!("'{src_s}' shrank during the copy")),
        "{r:?}"
    );
    // "reading N bytes at offset O got G bytes"
    let tail = r.stderr.split(" at offset ").nth(1).unwrap_or("");
    let (offset, rest) = tail.split_once(" got ").unwrap_or(("", ""));
    assert!(offset.parse::<u64>().is_ok(), "{r:?}");
    assert!(rest.trim_end().ends_with(" bytes"), "{r:?}");
    assert_eq!(names(d), ["src"]);
}

#[test]
fn cp_keeps_the_holes_of_a_sparse_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let src = d.join("sparse");
    let data = random_bytes(1 << 20, 7);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&data, 30 << 20).unwrap();
    }
    let dst = d.join("copy");
    let r = cp(&src, &dst, &[]);
    assert!(r.ok(), "{r:?}");
    let m = std::fs::metadata(&dst).unwrap();
    assert_eq!(m.len(), 64 << 20);
    assert!(
        m.blocks() * 512 < 8 << 20,
        "the copy allocates {} bytes",
        m.blocks() * 512
    );
    assert!(std::fs::read(&src).unwrap() == std::fs::read(&dst).unwrap());

    // A sparse file with a trailing hole and one that is all hole.
    let tail = d.join("tail");
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(&tail).unwrap();
        f.write_all_at(&data, 0).unwrap();
        f.set_len(16 << 20).unwrap();
    }
    let hole = d.join("hole");
    std::fs::File::create(&hole)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    for s in [&tail, &hole] {
        let out = d.join("out");
        let r = cp(s, &out, &[]);
        assert!(r.ok(), "{r:?}");
        assert!(std::fs::read(s).unwrap() == std::fs::read(&out).unwrap());
    }
}

/// A block device destination is written in place (it cannot be renamed over). Needs root
/// and losetup; skipped without them.
#[test]
fn cp_writes_a_block_device_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = d.join("img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let out = std::process::Command::new("losetup")
        .args(["-f", "--show"])
        .arg(&img)
        .output();
    let dev = match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => {
            eprintln!("skipped: no loop device (needs root and losetup)");
            return;
        }
    };
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .args(["-d", &self.0])
                .status();
        }
    }
    let _detach = Detach(dev.clone());
    let src = d.join("src");
    let data = random_bytes(3 << 20, 8);
    std::fs::write(&src, &data).unwrap();
    let r = cp(&src, Path::new(&dev), &[]);
    assert!(r.ok(), "{r:?}");
    let mut back = vec![0u8; data.len()];
    std::io::Read::read_exact(&mut std::fs::File::open(&dev).unwrap(), &mut back).unwrap();
    assert!(back == data);
    // Too large for the device: refused up front, naming both.
    std::fs::write(&src, random_bytes(9 << 20, 9)).unwrap();
    let r = cp(&src, Path::new(&dev), &[]);
    assert!(!r.ok(), "{r:?}");
    assert!(
        r.stderr.contains("does not fit") && r.stderr.contains(&dev),
        "{r:?}"
    );
}
