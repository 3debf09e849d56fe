//! `gpuio soak` passes only when it checked something (issue 40, item 11): parameters that
//! leave nothing to check are refused up front, naming the flag; one region with no
//! cancellations is checked like any other; `--leak-percent 0` leaks nothing.

mod cli_util;

use std::path::Path;

use cli_util::{Ran, gpuio, run};

/// Runs `gpuio soak --dir DIR ARGS` to the end.
fn soak(dir: &Path, args: &[&str]) -> Ran {
    run(gpuio()
        .arg("soak")
        .arg("--dir")
        .arg(dir)
        .args(args)
        .env("RUST_BACKTRACE", "0"))
}

/// The counters of the soak's last report line (`12 s: 5 reads, 3 writes, 1 dropped, 0
/// leaked, ...`): `name` -> its number.
fn counter(r: &Ran, name: &str) -> u64 {
    let line = r
        .stdout
        .lines()
        .rev()
        .find(|l| l.contains(" reads, "))
        .unwrap_or_else(|| panic!("no report line:\n{r:?}"));
    line.split([':', ','])
        .map(str::trim)
        .find_map(|part| part.strip_suffix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name:?} count in {line:?}"))
}

#[test]
fn a_soak_with_no_room_to_check_anything_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // One region of 4 KiB: with cancelled writes on (the defaults), it would be their scratch
    // region, leaving no region to check. This run did 0 reads and 0 writes and printed
    // "soak passed".
    let r = soak(
        dir.path(),
        &["--size", "4K", "--regions", "1", "--minutes", "0.01"],
    );
    assert!(!r.ok(), "{r:?}");
    assert!(!r.stdout.contains("soak passed"), "{r:?}");
    for part in ["--regions 1", "at least 2 regions", "--leak-percent 0"] {
        assert!(r.stderr.contains(part), "stderr lacks {part:?}: {r:?}");
    }
    assert!(!r.stderr.contains("panicked"), "{r:?}");
    // Every read cancelled: nothing would be checked either.
    let r = soak(
        dir.path(),
        &[
            "--size",
            "1M",
            "--drop-percent",
            "60",
            "--leak-percent",
            "40",
            "--minutes",
            "0.01",
        ],
    );
    assert!(!r.ok(), "{r:?}");
    assert!(
        r.stderr.contains("--drop-percent") && r.stderr.contains("no read would be checked"),
        "{r:?}"
    );
    assert!(
        cli_util::names(dir.path()).is_empty(),
        "a refused soak made files"
    );
}

#[test]
fn one_region_without_cancellations_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let r = soak(
        dir.path(),
        &[
            "--size",
            "4K",
            "--regions",
            "1",
            "--drop-percent",
            "0",
            "--leak-percent",
            "0",
            "--minutes",
            "0.01",
        ],
    );
    assert!(r.ok(), "{r:?}");
    assert!(r.stdout.contains("soak passed"), "{r:?}");
    assert!(counter(&r, "reads") > 0, "nothing was read: {r:?}");
    assert!(counter(&r, "writes") > 0, "nothing was written: {r:?}");
    assert_eq!(counter(&r, "dropped") + counter(&r, "leaked"), 0, "{r:?}");
}

#[test]
fn leak_percent_zero_leaks_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // Scratch-region writes used to leak half the time whatever --leak-percent said
    // (thousands in a second).
    let r = soak(
        dir.path(),
        &[
            "--size",
            "1M",
            "--regions",
            "16",
            "--leak-percent",
            "0",
            "--drop-percent",
            "20",
            "--minutes",
            "0.02",
        ],
    );
    assert!(r.ok(), "{r:?}");
    assert_eq!(counter(&r, "leaked"), 0, "{r:?}");
    assert!(counter(&r, "dropped") > 0, "{r:?}");
    assert!(counter(&r, "reads") > 0, "{r:?}");
}
