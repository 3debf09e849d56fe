//! Byte sizes with suffixes: `4K`, `1M`, `2G`, `512` (binary multiples, like fio).

use std::str::FromStr;

/// A byte count parsed from `4K`-style text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let lower = t.to_ascii_lowercase();
        let body = lower
            .strip_suffix("ib")
            .or_else(|| lower.strip_suffix('b'))
            .unwrap_or(&lower);
        let (num, shift) = match body.chars().last() {
            Some('k') => (&body[..body.len() - 1], 10),
            Some('m') => (&body[..body.len() - 1], 20),
            Some('g') => (&body[..body.len() - 1], 30),
            Some('t') => (&body[..body.len() - 1], 40),
            _ => (body, 0),
        };
        let n: u64 = num
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a size (examples: 4096, 4K, 1M, 2G)"))?;
        n.checked_mul(1u64 << shift)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

/// `n` in the largest binary unit (index into a 5-unit table, bytes to TiB) that keeps it >= 1.
fn scaled(n: u64) -> (f64, usize) {
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < 4 {
        v /= 1024.0;
        u += 1;
    }
    (v, u)
}

/// `1.50 GiB`-style text.
pub fn fmt_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (v, u) = scaled(n);
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// `4K`, `1M`, `1.5M`: the short form axis labels and tables use (binary multiples).
pub fn short_size(n: u64) -> String {
    const UNITS: [&str; 5] = ["", "K", "M", "G", "T"];
    let (v, u) = scaled(n);
    if v.fract() == 0.0 {
        format!("{v}{}", UNITS[u])
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes() {
        assert_eq!("4K".parse::<ByteSize>().unwrap().0, 4096);
        assert_eq!("1m".parse::<ByteSize>().unwrap().0, 1 << 20);
        assert_eq!("2GiB".parse::<ByteSize>().unwrap().0, 2 << 30);
        assert_eq!("512".parse::<ByteSize>().unwrap().0, 512);
        assert!("x".parse::<ByteSize>().is_err());
        assert!("99999999999T".parse::<ByteSize>().is_err());
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(short_size(4096), "4K");
        assert_eq!(short_size(1 << 20), "1M");
        assert_eq!(short_size(1536 << 10), "1.5M");
        assert_eq!(short_size(512), "512");
    }
}
