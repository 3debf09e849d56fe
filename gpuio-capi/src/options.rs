//! Engine options beyond `gpuio_engine_settings`: a list of `{key, value}` pairs passed to
//! `gpuio_engine_create_with_options`.
//!
//! Why a list and not more fields: `gpuio_engine_settings` is part of the ABI (callers
//! allocate it, so a field added at its end would be read past the end of an older caller's
//! struct). A key the library does not know is refused by name, so a program built against a
//! newer header fails clearly on an older library instead of silently running without the
//! setting, and new settings never change a struct's size (the pattern of CUDA's launch
//! attributes and UCX's field masks).

use std::time::Duration;

use crate::status::Failure;

/// One engine option: a `GPUIO_OPTION_*` key and its value. `reserved` must be 0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct gpuio_engine_option {
    /// Which setting: a `GPUIO_OPTION_*` value.
    pub key: u32,
    /// Must be 0 (room for per-option flags).
    pub reserved: u32,
    /// The setting's value; each key says its unit.
    pub value: u64,
}

/// Bytes: the largest read into host memory that the thread running it copies straight from
/// the page cache (where the page cache holds the whole range; 2 MiB per step). Default 16
/// MiB; values below 64 KiB count as 64 KiB. Larger reads take the bounce path.
pub const GPUIO_OPTION_PAGE_CACHE_READ_MAX: u32 = 1;
/// 0 or 1: large warm reads into device memory copied by the GPU straight from the page cache
/// (the range mapped and registered with the driver), about a fifth of the CPU time per GB
/// at a rate the driver caps. Default 0.
pub const GPUIO_OPTION_MAPPED_READS: u32 = 2;
/// Count, at least 1: most buffered reads copied out of the page cache at once (default:
/// sized from the machine; `gpuio_check` says what and why). Alone it also sets the per-GPU
/// cap to the same number.
pub const GPUIO_OPTION_PAGE_CACHE_COPIES: u32 = 3;
/// Count, at least 1: most page-cache copies per GPU while every open read lands in GPU
/// memory (default 14).
pub const GPUIO_OPTION_COPIES_PER_DEVICE: u32 = 4;
/// 0 or 1: small reads (and host reads up to `GPUIO_OPTION_PAGE_CACHE_READ_MAX`) first try
/// the page cache on the thread that runs them. Default 1; 0 sends every read through the
/// reactor.
pub const GPUIO_OPTION_PAGE_CACHE_FAST_PATH: u32 = 5;
/// Microseconds: the longest the reactor sleeps while I/O is in the kernel before it looks
/// again on its own (default 100; 0: until woken).
pub const GPUIO_OPTION_REACTOR_TICK_US: u32 = 6;
/// Milliseconds (0 counts as 1): a kernel thread polls io_uring's submission queue, sleeping
/// after this long without work (`IORING_SETUP_SQPOLL`; default off: a full core while I/O
/// flows, measured slower on the hosts here).
pub const GPUIO_OPTION_SUBMISSION_POLLING_MS: u32 = 7;
/// Count: most io_uring worker threads copying buffered pieces at once, per ring (default
/// two per core; 0: the kernel's limit).
pub const GPUIO_OPTION_IOWQ_WORKERS: u32 = 8;
/// 0 or 1: `GPUIO_BACKEND_AUTO` may use cuFile in compatibility mode (without nvidia-fs) for
/// files opened `GPUIO_OPEN_DIRECT`. Default 0: measured slower than the bounce path.
pub const GPUIO_OPTION_CUFILE_COMPAT: u32 = 9;
/// Milliseconds, at least 10: how long a request may wait for bounce memory while everything
/// that holds it has stopped running, before the pool grows or the request fails with
/// `GPUIO_ERR_NO_MEMORY` (default 5 s).
pub const GPUIO_OPTION_POOL_WAIT_LIMIT_MS: u32 = 10;
/// Blocks, at most 65535: how far the bounce pool may grow while stalled requests hold it all
/// (default: as many as the pool has; 0: never grow).
pub const GPUIO_OPTION_BOUNCE_GROWTH: u32 = 11;
/// 1 to 64: reactor threads, each with its own io_uring ring and an equal share of the bounce
/// pool (default 1). Small O_DIRECT reads at high depth are bound by one reactor's core: two
/// gave 11-13% more 4 KiB IOPS at depth 64 on a 16-core host, for about 0.7 more cores.
pub const GPUIO_OPTION_REACTORS: u32 = 12;

/// Every key with its name (for messages and for checking that none is given twice).
const KEYS: [(u32, &str); 12] = [
    (
        GPUIO_OPTION_PAGE_CACHE_READ_MAX,
        "GPUIO_OPTION_PAGE_CACHE_READ_MAX",
    ),
    (GPUIO_OPTION_MAPPED_READS, "GPUIO_OPTION_MAPPED_READS"),
    (
        GPUIO_OPTION_PAGE_CACHE_COPIES,
        "GPUIO_OPTION_PAGE_CACHE_COPIES",
    ),
    (
        GPUIO_OPTION_COPIES_PER_DEVICE,
        "GPUIO_OPTION_COPIES_PER_DEVICE",
    ),
    (
        GPUIO_OPTION_PAGE_CACHE_FAST_PATH,
        "GPUIO_OPTION_PAGE_CACHE_FAST_PATH",
    ),
    (GPUIO_OPTION_REACTOR_TICK_US, "GPUIO_OPTION_REACTOR_TICK_US"),
    (
        GPUIO_OPTION_SUBMISSION_POLLING_MS,
        "GPUIO_OPTION_SUBMISSION_POLLING_MS",
    ),
    (GPUIO_OPTION_IOWQ_WORKERS, "GPUIO_OPTION_IOWQ_WORKERS"),
    (GPUIO_OPTION_CUFILE_COMPAT, "GPUIO_OPTION_CUFILE_COMPAT"),
    (
        GPUIO_OPTION_POOL_WAIT_LIMIT_MS,
        "GPUIO_OPTION_POOL_WAIT_LIMIT_MS",
    ),
    (GPUIO_OPTION_BOUNCE_GROWTH, "GPUIO_OPTION_BOUNCE_GROWTH"),
    (GPUIO_OPTION_REACTORS, "GPUIO_OPTION_REACTORS"),
];

/// Applies `options` to `b`, in order. Each key at most once; an unknown key, a nonzero
/// `reserved`, a flag other than 0 or 1 or a count this machine cannot hold is
/// `GPUIO_ERR_INVALID` naming the entry. Values out of a setting's range pass here and are
/// refused, by the setting's name, when the engine is built (`EngineBuilder::build`).
pub(crate) fn apply(
    mut b: gpuio::EngineBuilder,
    options: &[gpuio_engine_option],
) -> Result<gpuio::EngineBuilder, Failure> {
    let mut seen = [false; KEYS.len()];
    for (i, o) in options.iter().enumerate() {
        let Some(k) = KEYS.iter().position(|&(key, _)| key == o.key) else {
            return Err(Failure::invalid(format!(
                "options[{i}].key {} is not a GPUIO_OPTION_* this library knows",
                o.key
            )));
        };
        let name = KEYS[k].1;
        if std::mem::replace(&mut seen[k], true) {
            return Err(Failure::invalid(format!(
                "options[{i}]: {name} is given twice"
            )));
        }
        if o.reserved != 0 {
            return Err(Failure::invalid(format!(
                "options[{i}] ({name}): reserved is {}, must be 0",
                o.reserved
            )));
        }
        let v = o.value;
        let bad =
            |want: &str| Failure::invalid(format!("options[{i}] ({name}): value {v}, want {want}"));
        let flag = || match v {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(bad("0 or 1")),
        };
        // Ranges are the library's to check (`EngineBuilder::build` names the setting); here
        // only what the value's C type cannot say: a flag's two values, a count that fits.
        let count = || usize::try_from(v).map_err(|_| bad("a count or size this machine holds"));
        b = match o.key {
            GPUIO_OPTION_PAGE_CACHE_READ_MAX => b.page_cache_read_max(count()?),
            GPUIO_OPTION_MAPPED_READS => b.mapped_reads(flag()?),
            GPUIO_OPTION_PAGE_CACHE_COPIES => b.page_cache_copies(count()?),
            GPUIO_OPTION_COPIES_PER_DEVICE => b.copies_per_device(count()?),
            GPUIO_OPTION_PAGE_CACHE_FAST_PATH => b.page_cache_fast_path(flag()?),
            GPUIO_OPTION_REACTOR_TICK_US => b.reactor_tick(Duration::from_micros(v)),
            GPUIO_OPTION_SUBMISSION_POLLING_MS => {
                b.submission_polling(Duration::from_millis(v.max(1)))
            }
            GPUIO_OPTION_IOWQ_WORKERS => {
                b.iowq_workers(u32::try_from(v).map_err(|_| bad("at most 4294967295"))?)
            }
            GPUIO_OPTION_CUFILE_COMPAT => b.cufile_compat(flag()?),
            GPUIO_OPTION_POOL_WAIT_LIMIT_MS => b.pool_wait_limit(Duration::from_millis(v)),
            GPUIO_OPTION_BOUNCE_GROWTH => b.bounce_growth(count()?),
            GPUIO_OPTION_REACTORS => b.reactors(count()?),
            // Every key in KEYS has an arm (a test runs each); this names one that lacks it.
            _ => return Err(bad("a key this library has no setting for")),
        };
    }
    Ok(b)
}

/// Longest option list accepted: far more than there are keys, which each come once, so a
/// longer list is a wrong count, not a setting.
const MAX_OPTIONS: usize = 1024;

/// Reads `n` options at `options` (NULL with `n` 0: none).
///
/// # Safety
/// `options` is NULL with `n` 0, or points to `n` readable `gpuio_engine_option`s.
pub(crate) unsafe fn slice<'a>(
    options: *const gpuio_engine_option,
    n: usize,
    what: &str,
) -> Result<&'a [gpuio_engine_option], Failure> {
    // SAFETY: forwarded from this function's contract; every bit pattern of the struct's
    // integer fields is a valid value.
    unsafe { crate::text::c_array(options, n, MAX_OPTIONS, what, "count") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opt(key: u32, value: u64) -> gpuio_engine_option {
        gpuio_engine_option {
            key,
            reserved: 0,
            value,
        }
    }

    fn refused(options: &[gpuio_engine_option]) -> String {
        match apply(gpuio::Engine::builder(), options) {
            Ok(_) => panic!("{options:?} was accepted"),
            Err(f) => f.message,
        }
    }

    #[test]
    fn every_key_is_named_once_and_has_an_arm() {
        for (i, &(key, name)) in KEYS.iter().enumerate() {
            assert_eq!(KEYS.iter().filter(|k| k.0 == key).count(), 1, "{name}");
            assert_eq!(key as usize, i + 1, "{name}: keys are numbered in order");
        }
        // A value every key takes: each has an arm (none reaches the catch-all).
        let all: Vec<_> = KEYS
            .iter()
            .map(|&(key, _)| {
                let v = match key {
                    GPUIO_OPTION_POOL_WAIT_LIMIT_MS => 10,
                    GPUIO_OPTION_PAGE_CACHE_READ_MAX => 1 << 20,
                    _ => 1,
                };
                opt(key, v)
            })
            .collect();
        assert!(apply(gpuio::Engine::builder(), &all).is_ok());
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        assert!(refused(&[opt(0, 1)]).contains("options[0].key 0"));
        assert!(refused(&[opt(99, 1)]).contains("99"));
        let twice = refused(&[
            opt(GPUIO_OPTION_MAPPED_READS, 1),
            opt(GPUIO_OPTION_MAPPED_READS, 0),
        ]);
        assert!(
            twice.contains("options[1]: GPUIO_OPTION_MAPPED_READS is given twice"),
            "{twice}"
        );
        let reserved = refused(&[gpuio_engine_option {
            key: GPUIO_OPTION_MAPPED_READS,
            reserved: 3,
            value: 1,
        }]);
        assert!(reserved.contains("reserved is 3"), "{reserved}");
        let flag = refused(&[opt(GPUIO_OPTION_PAGE_CACHE_FAST_PATH, 2)]);
        assert!(flag.contains("want 0 or 1"), "{flag}");
        let workers = refused(&[opt(GPUIO_OPTION_IOWQ_WORKERS, 1 << 40)]);
        assert!(workers.contains("at most 4294967295"), "{workers}");
    }

    /// Values the C types allow but the library refuses fail at build, named by the library.
    #[test]
    fn out_of_range_values_are_refused_when_the_engine_is_built() {
        for (o, says) in [
            (
                opt(GPUIO_OPTION_PAGE_CACHE_COPIES, 0),
                "page_cache_copies 0",
            ),
            (
                opt(GPUIO_OPTION_COPIES_PER_DEVICE, 0),
                "copies_per_device 0",
            ),
            (opt(GPUIO_OPTION_POOL_WAIT_LIMIT_MS, 9), "below 10 ms"),
            (opt(GPUIO_OPTION_BOUNCE_GROWTH, 70_000), "bounce growth"),
            (opt(GPUIO_OPTION_REACTORS, 0), "reactors 0"),
            (opt(GPUIO_OPTION_REACTORS, 65), "reactors 65"),
        ] {
            let b = apply(gpuio::Engine::builder(), &[o]).expect("the C types allow it");
            match b.build() {
                Ok(_) => panic!("{o:?} built an engine"),
                Err(e) => assert!(e.to_string().contains(says), "{o:?}: {e}"),
            }
        }
    }
}
