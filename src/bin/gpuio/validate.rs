//! Checks the CLI makes on argument values before it starts work: clap value parsers, so a
//! bad value is refused with its flag before anything runs, and whether buffers fit in memory.

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

/// A parser for a count in `1..=max` (queue depths, tasks, batch sizes: past `max` only the
/// memory and threads they cost grow, not what they measure).
pub fn count(max: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync {
    move |s: &str| {
        let n: usize = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a whole number"))?;
        if !(1..=max).contains(&n) {
            return Err(format!("{n} is outside 1..={max}"));
        }
        Ok(n)
    }
}

/// A count of at least one, bounded elsewhere (`soak --regions`, by --size).
pub fn positive_count(s: &str) -> Result<usize, String> {
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
    }

    #[test]
    fn memory_checks_refuse_overflow_and_excess() {
        assert!(fits_in_memory(Some(1), "one byte").is_ok());
        assert!(fits_in_memory(None, "overflow").is_err());
        let err = fits_in_memory(Some(u64::MAX), "--bs").unwrap_err();
        assert!(err.starts_with("--bs: "), "{err}");
    }
}
