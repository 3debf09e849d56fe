//! Byte sizes on the command line and in what the CLI prints.
//!
//! Parsing is `parse-size`'s with binary prefixes, like fio: `4K`, `4KB`, `4KiB` and `4k` are
//! all 4096; `1M`, `2G`, `1T` are MiB, GiB, TiB; fractions (`1.5G`) round to the nearest
//! byte; a bare number is bytes. Printing is `bytesize`'s IEC units.

use std::str::FromStr;

use parse_size::Config;

/// `K`, `M`, `G`, `T` (with or without `B`, any case) are powers of 1024.
const UNITS: Config = Config::new().with_binary();

/// A byte count parsed from `4K`-style text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        // Said plainly: parse-size would call it "not a size".
        if s.trim().starts_with('-') {
            return Err(format!(
                "{} is negative: a size is 0 or more bytes",
                s.trim()
            ));
        }
        match UNITS.parse_size(s) {
            Ok(n) => Ok(ByteSize(n)),
            Err(parse_size::Error::PosOverflow) => Err(format!("{s:?} is too large")),
            Err(_) => Err(format!(
                "{s:?} is not a size (examples: 4096, 4K, 1M, 1.5G)"
            )),
        }
    }
}

/// `1.50 GiB`-style text (`512 B` below a KiB).
pub fn fmt_bytes(n: u64) -> String {
    format!("{:.2}", bytesize::ByteSize(n).display().iec())
}

/// `4K`, `1M`, `1.5M`: the short form axis labels and tables use, as `--bs` spells it
/// (`512B` below a KiB).
pub fn short_size(n: u64) -> String {
    // One decimal place, and none where it is 0: the only `.` is the decimal point.
    format!("{:.1}", bytesize::ByteSize(n).display().iec_short()).replace(".0", "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes() {
        let parse = |s: &str| s.parse::<ByteSize>().map(|b| b.0);
        assert_eq!(parse("4K"), Ok(4096));
        assert_eq!(parse("4k"), Ok(4096));
        assert_eq!(parse("4KB"), Ok(4096));
        assert_eq!(parse("1m"), Ok(1 << 20));
        assert_eq!(parse("2GiB"), Ok(2 << 30));
        assert_eq!(parse("1T"), Ok(1 << 40));
        assert_eq!(parse("1.5G"), Ok(3 << 29));
        assert_eq!(parse("512"), Ok(512));
        assert_eq!(parse("512b"), Ok(512));
        assert!(parse("x").unwrap_err().contains("not a size"));
        assert!(parse("").unwrap_err().contains("not a size"));
        assert!(parse("-1").unwrap_err().contains("is negative"));
        assert!(parse("99999999999T").unwrap_err().contains("too large"));
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_bytes(4 << 30), "4.00 GiB");
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(short_size(4096), "4K");
        assert_eq!(short_size(1 << 20), "1M");
        assert_eq!(short_size(16 << 20), "16M");
        assert_eq!(short_size(1536 << 10), "1.5M");
        assert_eq!(short_size(512), "512B");
    }
}
