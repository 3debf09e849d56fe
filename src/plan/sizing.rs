//! Engine settings sized from the machine: how large a piece each path moves, how much bounce
//! memory keeps the copies busy, how many pieces are in flight and how many io_uring workers
//! copy out of the page cache at once.
//!
//! The numbers follow the performance model in the repository's DESIGN.md: a page-cache-warm
//! read is a CPU copy (about 3.5–4 GB/s per core) into a pinned slot, so throughput is set by
//! how many copies run at once and how soon a slot comes back; a cold O_DIRECT read is the
//! disk, which wants a few large requests in flight. Every choice carries its reason, which
//! `gpuio check` prints, and every one can be overridden on
//! [`EngineBuilder`](crate::EngineBuilder).

/// What the sizing looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    /// CPUs this process may run on (its affinity mask, not the machine's total).
    pub cores: usize,
    /// Physical memory in bytes (0 where it could not be read).
    pub memory: u64,
}

impl Machine {
    /// The machine this process runs on.
    pub fn probe() -> Machine {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        // SAFETY: sysinfo fills the struct it is given; a zeroed one is a valid input.
        let mut si: libc::sysinfo = unsafe { std::mem::zeroed() };
        // SAFETY: `si` is a valid, writable sysinfo struct.
        let memory = if unsafe { libc::sysinfo(&mut si) } == 0 {
            si.totalram as u64 * si.mem_unit.max(1) as u64
        } else {
            0
        };
        Machine { cores, memory }
    }
}

/// Bytes one buffered (page-cache) read piece moves by default. Measured on the H100 machine
/// (BENCHMARKS.md): page-cache-warm 16 MiB reads into GPU memory ran at 43.2 GB/s with 2 MiB
/// pieces and 33–35 GB/s with 4 MiB ones: a smaller piece frees its slot sooner and spreads
/// one request over more copying workers.
pub const BUFFERED_CHUNK: usize = 2 << 20;
/// Bytes one O_DIRECT (or cuFile, or NVMe) piece moves by default: the disks measured reach
/// their sequential rate at 1–4 MiB requests, 4 MiB with the fewest in flight.
pub const DIRECT_CHUNK: usize = 4 << 20;
/// Bounce memory at least this large whatever the core count (the pre-sizing default).
pub const MIN_BOUNCE_BYTES: usize = 128 << 20;
/// Direct pieces one op should keep in flight: the depth at which the disks measured reach
/// their sequential rate (4 MiB at QD16 on the H100 VM's disk). One op may hold a quarter of
/// the pool (the reactor's per-op window, which bounds what a leaked future can take), so the
/// pool is at least four times this many direct pieces: one large read (a checkpoint's data
/// section, a whole file) then reads at the disk's depth on its own.
pub const DIRECT_DEPTH_PER_OP: usize = 16;
/// Page-cache copies per GPU while every open read lands in GPU memory: a GPU's host-to-device
/// link (≈55 GB/s pinned, H100/H200 hosts) fills at about a dozen concurrent copies of ≈4 GB/s
/// each. Measured (issue 39, warm 16 MiB reads into one GPU): 12 copies ran best on the 16-core
/// host and on the 32-core host (48.6–49.8 GB/s there, against 39.8–41.3 with 24), and 14 as
/// well as 12 there (46.11 against 46.53 GB/s). Two GPUs fed at once share the memory's
/// bandwidth, each copy runs slower, and each link then needs a few more: 14 per GPU (28 in
/// all) ran at 1.05–1.10x the 12 per GPU (24) on the 2x H100 host (BENCHMARKS, fifteenth
/// session).
pub const COPIES_PER_DEVICE: usize = 14;
/// Fewest page-cache copies at which a blocking read of a buffered file lands in the caller's
/// memory (`File::read_into_blocking`). In place, only io_uring's workers copy, each byte once;
/// through bounce slots they copy into slots and the calling thread copies out, so the
/// calling thread is one copier more. Measured, warm 64 MiB reads at QD1: on the 2-core VM
/// with 2 copies in place gave 0.84x the bounce path, with 3 1.15x; on the 16-core H200 host
/// (12 copies) 256 MiB reads 5.7-6.9x (BENCHMARKS.md, "Twenty-second session").
pub const LEND_MIN_COPIES: usize = 3;
/// Bounce memory at most this large by default (pinned memory is the machine's to share).
pub const MAX_BOUNCE_BYTES: usize = 1 << 30;

/// What an engine runs with, and why. Built by [`Sizing::for_machine`] and overridden by the
/// builder's explicit settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sizing {
    /// The machine the defaults were chosen for.
    pub machine: Machine,
    /// Bytes per piece for buffered reads and writes.
    pub buffered_chunk: usize,
    /// Bytes per piece for O_DIRECT, cuFile and NVMe I/O.
    pub direct_chunk: usize,
    /// Bytes of bounce memory (rounded to whole blocks of the larger chunk when built).
    pub bounce_bytes: usize,
    /// Most pieces in the kernel at once.
    pub queue_depth: usize,
    /// Most buffered reads copied out of the page cache at once (punted to io-wq).
    pub page_cache_copies: usize,
    /// Most page-cache copies per GPU in use while every open read lands in GPU memory
    /// (within `page_cache_copies`).
    pub copies_per_device: usize,
    /// Most io_uring workers copying buffered pieces at once (`IORING_REGISTER_IOWQ_MAX_WORKERS`,
    /// bounded class; `None`: the kernel's own limit).
    pub iowq_workers: Option<u32>,
    /// Reactor threads, each with its own ring and its share of the bounce pool
    /// (`EngineBuilder::reactors`).
    pub reactors: usize,
    /// One line per setting: its value and why (what `gpuio check` prints).
    pub reasons: Vec<String>,
}

impl Sizing {
    /// Whether blocking reads of buffered files land in place in the caller's memory (at
    /// least [`LEND_MIN_COPIES`] page-cache copies), and why, for `gpuio check`.
    pub fn lends_buffered_reads(&self) -> (bool, String) {
        let yes = self.page_cache_copies >= LEND_MIN_COPIES;
        let why = format!(
            "blocking reads of buffered files {} the caller's memory: {} page-cache copies {} \
             than the bounce path's copiers and the calling thread (at least {LEND_MIN_COPIES} \
             to pay); aligned O_DIRECT reads always land in place",
            if yes {
                "land in place in"
            } else {
                "copy through bounce slots into"
            },
            self.page_cache_copies,
            if yes { "copy faster" } else { "copy slower" },
        );
        (yes, why)
    }

    /// The defaults for `m`.
    pub fn for_machine(m: Machine) -> Sizing {
        let cores = m.cores.max(1);
        // Each copying core wants two pieces: one being copied, one whose slot is on its way
        // back (device copy in flight, or the future about to copy it out).
        let wanted = (4 * cores * BUFFERED_CHUNK).max(4 * DIRECT_DEPTH_PER_OP * DIRECT_CHUNK);
        let mem_cap = if m.memory == 0 {
            MAX_BOUNCE_BYTES
        } else {
            ((m.memory / 32) as usize).clamp(MIN_BOUNCE_BYTES, MAX_BOUNCE_BYTES)
        };
        let bounce_bytes = wanted.clamp(MIN_BOUNCE_BYTES, mem_cap);
        let queue_depth = (4 * cores).clamp(64, 1024);
        // io-wq's default bound is four workers per CPU (and the ring size): for copies, which
        // are CPU-bound, more workers than cores only take turns on them. Two per core leaves
        // room for workers blocked on a page that is still being read in.
        let iowq = (2 * cores).clamp(4, 512) as u32;
        // Measured (BENCHMARKS.md): warm 16 MiB reads into GPU memory peaked at 12 copies on
        // 16 cores and 28 on 32 (into two GPUs: 1.05-1.10x the 24 of three per four cores),
        // and fell off past that (16 cores: 16 copies ran at 0.73x of 12; 32 cores: 32 copies
        // at 0.75-0.80x of 24): the copies then take the cores the copies out to the GPU, the
        // reactor and the runtime need. So every core but four, and three per four cores on
        // small machines (two on two cores: host reads measured best there).
        let page_cache_copies = (3 * cores / 4).max(cores.saturating_sub(4)).max(2);
        let reasons = vec![
            format!(
                "machine: {cores} usable core(s), {} of memory",
                if m.memory == 0 {
                    "an unknown amount".to_string()
                } else {
                    format!("{} MiB", m.memory >> 20)
                }
            ),
            format!(
                "buffered chunk {} KiB: page-cache copies, smaller pieces free their slots sooner \
                 (measured best on the H100 machine)",
                BUFFERED_CHUNK >> 10
            ),
            format!(
                "direct chunk {} KiB: O_DIRECT, cuFile and NVMe requests, where disks reach their \
                 sequential rate with few in flight",
                DIRECT_CHUNK >> 10
            ),
            format!(
                "bounce pool {} MiB: two buffered pieces in flight per core and two more on their \
                 way back (4 x {cores} x {} KiB), and room for one op's quarter of the pool to \
                 hold {DIRECT_DEPTH_PER_OP} direct pieces (4 x {DIRECT_DEPTH_PER_OP} x {} KiB), \
                 at least {} MiB, at most {} MiB or 1/32 of memory",
                bounce_bytes >> 20,
                BUFFERED_CHUNK >> 10,
                DIRECT_CHUNK >> 10,
                MIN_BOUNCE_BYTES >> 20,
                MAX_BOUNCE_BYTES >> 20
            ),
            format!("queue depth {queue_depth}: four pieces per core, at least 64"),
            format!(
                "page-cache copies at most {page_cache_copies}: every core but four (three per \
                 four cores below 16, at least two): four are left for the copies to the GPU, \
                 the reactor and the runtime (measured best on 16 and 32 cores)"
            ),
            format!(
                "page-cache copies per GPU at most {COPIES_PER_DEVICE} while every open read \
                 lands in GPU memory: a GPU's host-to-device link fills at about a dozen \
                 copies, a few more while two GPUs share the memory's bandwidth (measured on \
                 16 and 32 cores); two GPUs take twice as many, within the cap above"
            ),
            format!(
                "io_uring workers {iowq}: two per core copy out of the page cache (the kernel's \
                 default allows four per CPU)"
            ),
            "reactors 1: one thread submits and completes every piece; two lift small O_DIRECT \
             reads at depth (0.86x to 0.97x fio at 4 KiB QD64 on 16 cores) for about 0.7 cores, \
             each with half the pool (EngineBuilder::reactors)"
                .to_string(),
        ];
        Sizing {
            machine: m,
            buffered_chunk: BUFFERED_CHUNK,
            direct_chunk: DIRECT_CHUNK,
            bounce_bytes,
            queue_depth,
            page_cache_copies,
            copies_per_device: COPIES_PER_DEVICE,
            iowq_workers: Some(iowq),
            reactors: 1,
            reasons,
        }
    }

    /// Bytes of one bounce block: the larger chunk, rounded up to a power of two (a piece
    /// never spans blocks).
    pub fn block(&self) -> usize {
        self.buffered_chunk
            .max(self.direct_chunk)
            .next_power_of_two()
    }
}

impl std::fmt::Display for Sizing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, r) in self.reasons.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            f.write_str(r)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_machines_keep_the_measured_floor() {
        let s = Sizing::for_machine(Machine {
            cores: 2,
            memory: 24 << 30,
        });
        // One op's quarter of the pool holds the direct depth.
        assert_eq!(s.bounce_bytes, 4 * DIRECT_DEPTH_PER_OP * DIRECT_CHUNK);
        assert_eq!(s.queue_depth, 64);
        assert_eq!(s.iowq_workers, Some(4));
        assert_eq!(s.page_cache_copies, 2);
        assert_eq!(s.block(), DIRECT_CHUNK);
    }

    /// The measured hosts: 12 copies on 16 cores (as before), 28 on 32; three per four cores
    /// on 8.
    #[test]
    fn page_cache_copies_leave_four_cores() {
        let copies = |cores| {
            Sizing::for_machine(Machine {
                cores,
                memory: 128 << 30,
            })
            .page_cache_copies
        };
        assert_eq!(copies(8), 6);
        assert_eq!(copies(16), 12);
        assert_eq!(copies(32), 28);
    }

    #[test]
    fn large_machines_get_more_in_flight_within_memory() {
        let s = Sizing::for_machine(Machine {
            cores: 64,
            memory: 512 << 30,
        });
        assert_eq!(s.bounce_bytes, 512 << 20);
        assert_eq!(s.queue_depth, 256);
        assert_eq!(s.iowq_workers, Some(128));
        assert_eq!(s.page_cache_copies, 60);
        // Memory bounds the pool: 8 GiB of RAM allows 256 MiB.
        let small = Sizing::for_machine(Machine {
            cores: 64,
            memory: 8 << 30,
        });
        assert_eq!(small.bounce_bytes, 256 << 20);
    }

    #[test]
    fn every_setting_says_why() {
        let s = Sizing::for_machine(Machine::probe());
        let text = s.to_string();
        for word in [
            "buffered chunk",
            "direct chunk",
            "bounce pool",
            "queue depth",
            "page-cache copies",
            "io_uring workers",
        ] {
            assert!(text.contains(word), "{word} missing from {text}");
        }
    }
}
