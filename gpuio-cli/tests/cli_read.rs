//! `gpuio read` run as the real binary.

mod cli_util;

use cli_util::*;

/// The checksum `gpuio read` prints: the wrapping sum of the file's 8-byte big-endian words.
fn sum64(data: &[u8]) -> u64 {
    data.chunks(8).fold(0u64, |a, c| {
        a.wrapping_add(c.iter().fold(0u64, |x, &b| (x << 8) | b as u64))
    })
}

#[test]
fn read_of_a_file_larger_than_the_address_space_limit_streams_through() {
    // AddressSanitizer reserves terabytes of shadow address space up front, so a binary
    // built with it cannot start under `ulimit -v` at all: nothing to learn there.
    if std::env::var_os("ASAN_OPTIONS").is_some() {
        eprintln!("skipped under AddressSanitizer");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sparse");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(4 << 30)
        .unwrap();
    // 1 GiB of address space for a 4 GiB file: a whole-file buffer cannot exist. Threads
    // and malloc arenas are pinned so the address space used does not grow with the cores.
    let r = run(std::process::Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -v 1048576; exec "$0" read "$1""#)
        .arg(cli_util::bin())
        .arg(&path)
        .env("TOKIO_WORKER_THREADS", "2")
        .env("MALLOC_ARENA_MAX", "2"));
    if r.stderr.contains("AddressSanitizer") {
        eprintln!("skipped: an AddressSanitizer build cannot run under ulimit -v");
        return;
    }
    assert!(r.ok(), "{r:?}");
    // The result is the last line (an `engine:` line on where the pieces waited comes first).
    let last = r.stdout.lines().last().unwrap_or("");
    assert!(last.starts_with("read 4.00 GiB in "), "{r:?}");
    assert!(r.stdout.contains("sum64 0000000000000000"), "{r:?}");
}

#[test]
fn read_prints_the_whole_file_checksum() {
    let dir = tempfile::tempdir().unwrap();
    // Longer than one 64 MiB window, and not a multiple of 8: the last word is short.
    let data = random_bytes((64 << 20) + 4099, 11);
    let path = dir.path().join("f");
    std::fs::write(&path, &data).unwrap();
    let r = run(gpuio().arg("read").arg(&path));
    assert!(r.ok(), "{r:?}");
    assert!(
        r.stdout.contains(&format!("sum64 {:016x}", sum64(&data))),
        "{r:?}"
    );
}
