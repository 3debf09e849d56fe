//! Checks the CLI makes before it starts work: argument values (as clap value parsers, so a
//! bad value is refused with its flag before anything runs), what kind of file a path is
//! (without opening it, so a FIFO cannot block the command), whether buffers fit in memory,
//! and whether a plot can be written where it is asked for.

use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::time::Duration;

use crate::size::{ByteSize, fmt_bytes};

/// The longest a timed run may be asked to last. Longer is a typo (or `1e300`), and would
/// overflow `Duration`/`Instant` arithmetic.
const MAX_RUN: Duration = Duration::from_secs(365 * 24 * 3600);

/// A size of at least one byte (`--bs`, `--size`, `--max-len`).
pub fn positive_size(s: &str) -> Result<ByteSize, String> {
    let b: ByteSize = s.parse()?;
    if b.0 == 0 {
        return Err("must be at least 1 byte".into());
    }
    Ok(b)
}

/// An engine chunk size: what `EngineBuilder::chunk_size` takes, checked before any work.
pub fn chunk_size(s: &str) -> Result<ByteSize, String> {
    let b: ByteSize = s.parse()?;
    if b.0 < 4096 || b.0 % 4096 != 0 || b.0 > 1 << 30 {
        return Err(format!(
            "{} is not a chunk size: a multiple of 4 KiB between 4K and 1G",
            b.0
        ));
    }
    Ok(b)
}

/// Seconds of a timed run: finite, at least a millisecond, at most a year.
pub fn seconds(s: &str) -> Result<f64, String> {
    duration(s, 1.0, "seconds")
}

/// Minutes of a timed run: finite, at least a millisecond, at most a year.
pub fn minutes(s: &str) -> Result<f64, String> {
    duration(s, 60.0, "minutes")
}

fn duration(s: &str, unit_secs: f64, unit: &str) -> Result<f64, String> {
    refuse_negative(s, "a run lasts at least a millisecond")?;
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of {unit}"))?;
    if !v.is_finite() {
        return Err(format!("{s} is not a finite number of {unit}"));
    }
    // Below a millisecond a run measures nothing (it converts to a zero Duration, or ends
    // before its first request).
    if v * unit_secs < 1e-3 {
        return Err(format!("{s} {unit} is less than a millisecond"));
    }
    let max = MAX_RUN.as_secs_f64() / unit_secs;
    if v > max {
        return Err(format!(
            "{s} {unit} is longer than a year ({max:.0} {unit})"
        ));
    }
    // Within a year, so this cannot fail; checked all the same rather than assumed.
    Duration::try_from_secs_f64(v * unit_secs).map_err(|e| format!("{s} {unit}: {e}"))?;
    Ok(v)
}

/// Refuses text that is a negative number, saying what the flag takes instead. clap hands
/// such values to the parsers (main.rs lets options take negative numbers) so that the
/// refusal names the flag; integer parsing alone would only say "invalid digit".
fn refuse_negative(s: &str, want: &str) -> Result<(), String> {
    match s.trim() {
        t if t.starts_with('-') => Err(format!("{t} is negative: {want}")),
        _ => Ok(()),
    }
}

/// A parser for a whole number in `min..=max` of any unsigned type (`u8` percentages, `u64`
/// seeds and microseconds, counts whose 0 means something).
pub fn whole<T>(min: T, max: T) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: std::str::FromStr + PartialOrd + std::fmt::Display + Copy + Send + Sync,
{
    move |s: &str| {
        let t = s.trim();
        refuse_negative(t, &format!("must be a whole number in {min}..={max}"))?;
        let n: T = t.parse().map_err(|_| {
            if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
                format!("{t} is outside {min}..={max}")
            } else {
                format!("{s:?} is not a whole number")
            }
        })?;
        if n < min || n > max {
            return Err(format!("{n} is outside {min}..={max}"));
        }
        Ok(n)
    }
}

/// A parser for a count in `1..=max` (queue depths, tasks, batch sizes: past `max` only the
/// memory and threads they cost grow, not what they measure).
pub fn count(max: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    whole(1, max)
}

/// A count of at least one, bounded elsewhere (`soak --regions`, by --size).
pub fn positive_count(s: &str) -> Result<usize, String> {
    refuse_negative(s, "must be at least 1")?;
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

/// This machine's physical memory in bytes (`None` where the system does not say).
pub fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && page > 0).then(|| (pages as u64).saturating_mul(page as u64))
}

/// Refuses host buffers of `bytes` (what `what` needs) when they exceed this machine's memory:
/// the allocation would abort the process (or draw the OOM killer) instead of failing.
pub fn fits_in_memory(bytes: Option<u64>, what: &str) -> Result<(), String> {
    let mem = physical_memory().map_or_else(|| "memory".to_string(), fmt_bytes);
    match bytes {
        // The product overflowed: more than any machine has.
        None => Err(format!(
            "{what}: over 16 EiB of host memory, more than this machine's {mem}"
        )),
        Some(b) if physical_memory().is_some_and(|m| b > m) => Err(format!(
            "{what}: {} of host memory, more than this machine's {mem}",
            fmt_bytes(b)
        )),
        Some(_) => Ok(()),
    }
}

/// What a file's type is called in messages: `a FIFO`, `a character device`, ...
pub fn kind_name(ft: std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "a regular file"
    }
}

/// Opens `path` read-only without blocking: O_NONBLOCK makes opening a FIFO return at once
/// (it would otherwise wait for a writer), and the file's type is checked on the descriptor,
/// so a path swapped after an earlier `stat` is still caught. Only regular files and block
/// devices come back; `purpose` ends the refusal ("gpuio benchmarks regular files and block
/// devices").
pub fn open_data_file(path: &Path, purpose: &str) -> Result<std::fs::File, String> {
    let name = path.display();
    // `stat` first: opening some character devices has effects of its own (a watchdog arms
    // itself), so they are refused without being opened.
    let meta = std::fs::metadata(path).map_err(|e| format!("{name}: {e}"))?;
    refuse_unless_data(path, meta.file_type(), purpose)?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("{name}: {e}"))?;
    let meta = f.metadata().map_err(|e| format!("{name}: {e}"))?;
    refuse_unless_data(path, meta.file_type(), purpose)?;
    if meta.is_file() {
        let fs =
            gpuio::plan::align::filesystem_name(f.as_fd()).map_err(|e| format!("{name}: {e}"))?;
        if gpuio::plan::align::is_pseudo_filesystem(&fs) {
            return Err(format!(
                "{name} is a file of {fs}, a pseudo filesystem (generated when read, no size \
                 to speak of): {purpose}"
            ));
        }
    }
    Ok(f)
}

/// Refuses every type but regular files and block devices, naming the path and its type.
pub fn refuse_unless_data(path: &Path, ft: std::fs::FileType, purpose: &str) -> Result<(), String> {
    if ft.is_file() || ft.is_block_device() {
        Ok(())
    } else {
        Err(format!(
            "{} is {}: {purpose}",
            path.display(),
            kind_name(ft)
        ))
    }
}

/// A scratch file's creation error without the scratch file's random name (tempfile appends
/// ` at path "..."`): the directory is what the user named, and what the message names.
pub fn scratch_error(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.split_once(" at path ") {
        Some((head, _)) => head.to_string(),
        None => s,
    }
}

/// Checks, before a sweep that may take long, that an SVG can be written at `path`: an
/// existing regular file must open for writing (not truncated here), and a new one must be
/// creatable in its directory (tried with a scratch file, removed at once).
pub fn plot_target(path: &Path) -> Result<(), String> {
    let name = path.display();
    if path.extension().and_then(|e| e.to_str()) != Some("svg") {
        return Err(format!(
            "--plot {name}: only SVG is written (name it *.svg)"
        ));
    }
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => Err(format!(
            "--plot {name}: it is {}, not a file the plot can replace",
            kind_name(m.file_type())
        )),
        Ok(_) => std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map(drop)
            .map_err(|e| format!("--plot {name}: cannot write it: {e}")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let dir = match path.parent() {
                Some(d) if !d.as_os_str().is_empty() => d,
                _ => Path::new("."),
            };
            match std::fs::metadata(dir) {
                Err(e) => {
                    return Err(format!("--plot {name}: directory {}: {e}", dir.display()));
                }
                Ok(m) if !m.is_dir() => {
                    return Err(format!(
                        "--plot {name}: {} is {}, not a directory",
                        dir.display(),
                        kind_name(m.file_type())
                    ));
                }
                Ok(_) => {}
            }
            tempfile::Builder::new()
                .prefix(".gpuio-plot")
                .tempfile_in(dir)
                .map(drop)
                .map_err(|e| {
                    format!(
                        "--plot {name}: cannot create a file in {}: {}",
                        dir.display(),
                        scratch_error(&e)
                    )
                })
        }
        Err(e) => Err(format!("--plot {name}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_positive_and_at_most_a_year() {
        assert_eq!(seconds("1.5"), Ok(1.5));
        assert_eq!(minutes("525600"), Ok(525600.0));
        for bad in [
            "0", "-1", "1e-300", "0.0009", "nan", "inf", "1e300", "31536001", "x", "",
        ] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert!(minutes("525601").is_err());
        assert!(minutes("1e300").is_err());
    }

    #[test]
    fn sizes_and_counts() {
        assert!(positive_size("0").is_err());
        assert_eq!(positive_size("4K"), Ok(ByteSize(4096)));
        for bad in ["0", "1000", "4097", "2G"] {
            assert!(chunk_size(bad).is_err(), "{bad}");
        }
        assert_eq!(chunk_size("1G"), Ok(ByteSize(1 << 30)));
        let qd = count(8);
        assert!(qd("0").is_err() && qd("9").is_err() && qd("x").is_err());
        assert_eq!(qd("8"), Ok(8));
        let percent = whole(0u8, 100);
        assert_eq!(percent("0"), Ok(0));
        assert_eq!(percent("100"), Ok(100));
        for bad in ["101", "300", "x", ""] {
            assert!(percent(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn negative_numbers_are_called_negative() {
        let say = |r: Result<String, String>| r.expect_err("refused");
        for err in [
            say(seconds("-1").map(|v| v.to_string())),
            say(minutes("-0.5").map(|v| v.to_string())),
            say(count(8)("-1").map(|v| v.to_string())),
            say(positive_count("-3").map(|v| v.to_string())),
            say(whole(0u64, u64::MAX)("-1").map(|v| v.to_string())),
            say(positive_size("-4096").map(|v| v.0.to_string())),
            say(chunk_size("-4096").map(|v| v.0.to_string())),
        ] {
            assert!(err.contains("is negative"), "{err}");
        }
    }

    #[test]
    fn memory_checks_refuse_overflow_and_excess() {
        assert!(fits_in_memory(Some(1), "one byte").is_ok());
        assert!(fits_in_memory(None, "overflow").is_err());
        let err = fits_in_memory(Some(u64::MAX), "--bs").unwrap_err();
        assert!(err.starts_with("--bs: "), "{err}");
    }
}
