//! Where an engine's pieces spend their time, for tuning: how many pieces the kernel (or a pool
//! worker) held on average, how many slot releases waited behind CUDA events, and how much of
//! the time work waited for bounce memory. The reactor adds its counts once per pass of its
//! loop, weighted by the time since the last pass ([`OccupancySampler`]), and publishes them
//! about once a millisecond; [`Engine::occupancy`](crate::Engine::occupancy) reads them.
//! Only time with work in the engine counts: averages are over the time it was busy.
//!
//! Throughput of page-cache-warm reads is set by how many copies run at once: when the
//! kernel holds fewer pieces than the queue depth, slots are held elsewhere (by futures yet
//! to copy, or behind events), and when work waits for memory, the pool is the limit.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Running totals, in microseconds (weighted by counts), that the reactor publishes.
#[derive(Debug, Default)]
pub(crate) struct OccupancyTotals {
    micros: AtomicU64,
    in_kernel: AtomicU64,
    gated: AtomicU64,
    starved: AtomicU64,
}

impl OccupancyTotals {
    /// The totals so far.
    pub(crate) fn snapshot(&self) -> Occupancy {
        Occupancy {
            micros: self.micros.load(Relaxed),
            in_kernel: self.in_kernel.load(Relaxed),
            gated: self.gated.load(Relaxed),
            starved: self.starved.load(Relaxed),
        }
    }
}

/// An engine's occupancy totals at one moment; the difference of two
/// ([`since`](Occupancy::since)) gives averages over the time between them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Occupancy {
    micros: u64,
    in_kernel: u64,
    gated: u64,
    starved: u64,
}

impl Occupancy {
    /// Two reactors' totals as one engine's ([`EngineBuilder::reactors`](crate::EngineBuilder::reactors)):
    /// the engine had work while either had (the longer time), the pieces in the kernel and
    /// the releases behind events add up, and the time waiting for bounce memory is the longer
    /// (each reactor has its own pool: it says how long some work waited).
    pub fn merge(&self, other: &Occupancy) -> Occupancy {
        Occupancy {
            micros: self.micros.max(other.micros),
            in_kernel: self.in_kernel + other.in_kernel,
            gated: self.gated + other.gated,
            starved: self.starved.max(other.starved),
        }
    }

    /// The totals accumulated between `earlier` and `self`.
    pub fn since(&self, earlier: &Occupancy) -> Occupancy {
        Occupancy {
            micros: self.micros.saturating_sub(earlier.micros),
            in_kernel: self.in_kernel.saturating_sub(earlier.in_kernel),
            gated: self.gated.saturating_sub(earlier.gated),
            starved: self.starved.saturating_sub(earlier.starved),
        }
    }

    /// Seconds the reactor accounted for: those in which the engine had work (an operation in
    /// its table, a piece out or a release behind an event).
    pub fn seconds(&self) -> f64 {
        self.micros as f64 / 1e6
    }

    fn mean(&self, total: u64) -> f64 {
        if self.micros == 0 {
            0.0
        } else {
            total as f64 / self.micros as f64
        }
    }

    /// Pieces in the kernel (or the pread pool, cuFile, SPDK) on average.
    pub fn mean_in_kernel(&self) -> f64 {
        self.mean(self.in_kernel)
    }

    /// Slot releases waiting behind CUDA events on average (each frees one or more slots once
    /// the copies out of them have run).
    pub fn mean_gated(&self) -> f64 {
        self.mean(self.gated)
    }

    /// Share of the time (0 to 1) that work waited for bounce memory.
    pub fn starved_share(&self) -> f64 {
        self.mean(self.starved)
    }
}

/// One line for logs and tools: `12.3 pieces in the kernel on average, 0.4 slot releases
/// behind CUDA events, short of bounce memory 0% of the time`.
impl std::fmt::Display for Occupancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} pieces in the kernel on average, {:.1} slot releases behind CUDA events, \
             short of bounce memory {:.0}% of the time",
            self.mean_in_kernel(),
            self.mean_gated(),
            self.starved_share() * 100.0
        )
    }
}

/// The reactor's side: counts added up locally and published now and then, so the loop pays a
/// clock read and a few additions per call. The time between two calls is counted at the
/// state the earlier call gave (the state holds until the reactor changes it), and only if
/// the engine had work then: an idle stretch is counted when the reactor wakes from it, after
/// a snapshot taken during it, so counting it would charge a program's pauses (its CUDA
/// start-up, allocating a destination) to the next read's averages.
pub(crate) struct OccupancySampler {
    last: Instant,
    published: Instant,
    /// `(in_kernel, gated, starved, busy)` since the last call.
    state: (u64, u64, bool, bool),
    local: [u64; 4],
}

/// How often the local sums go out to the shared totals.
const PUBLISH_EVERY: Duration = Duration::from_millis(1);

impl OccupancySampler {
    pub(crate) fn new() -> Self {
        let now = Instant::now();
        OccupancySampler {
            last: now,
            published: now,
            state: (0, 0, false, false),
            local: [0; 4],
        }
    }

    /// Counts the time since the last call at the state that call gave, and notes the state
    /// from now on: `in_kernel` pieces out in the lanes, `gated` releases behind events,
    /// whether work waits for memory, and whether the engine has any work at all (`busy`:
    /// time without is not counted).
    pub(crate) fn sample(
        &mut self,
        to: &OccupancyTotals,
        in_kernel: usize,
        gated: usize,
        starved: bool,
        busy: bool,
    ) {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_micros() as u64;
        if dt > 0 {
            // A gap under a microsecond is not lost: it is counted with the next interval
            // (at that interval's state).
            self.last = now;
            let (k, g, s, b) = self.state;
            if b {
                self.local[0] += dt;
                self.local[1] += dt * k;
                self.local[2] += dt * g;
                self.local[3] += if s { dt } else { 0 };
            }
        }
        self.state = (in_kernel as u64, gated as u64, starved, busy);
        if now.duration_since(self.published) >= PUBLISH_EVERY {
            self.publish(to);
            self.published = now;
        }
    }

    /// Sends the local sums out.
    pub(crate) fn publish(&mut self, to: &OccupancyTotals) {
        let [m, k, g, s] = std::mem::take(&mut self.local);
        to.micros.fetch_add(m, Relaxed);
        to.in_kernel.fetch_add(k, Relaxed);
        to.gated.fetch_add(g, Relaxed);
        to.starved.fetch_add(s, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averages_weight_each_state_by_its_time() {
        let totals = OccupancyTotals::default();
        let before = totals.snapshot();
        let mut s = OccupancySampler::new();
        // Fixed sums rather than the clock: 3 ms with 8 pieces out, then 1 ms with 0 and
        // 2 releases gated while short of memory.
        s.local = [3000 + 1000, 3000 * 8, 1000 * 2, 1000];
        s.publish(&totals);
        let d = totals.snapshot().since(&before);
        assert_eq!(d.seconds(), 0.004);
        assert_eq!(d.mean_in_kernel(), 6.0);
        assert_eq!(d.mean_gated(), 0.5);
        assert_eq!(d.starved_share(), 0.25);
        assert_eq!(Occupancy::default().mean_in_kernel(), 0.0);
        assert_eq!(
            d.to_string(),
            "6.0 pieces in the kernel on average, 0.5 slot releases behind CUDA events, \
             short of bounce memory 25% of the time"
        );
    }

    #[test]
    fn idle_time_counts_for_nothing() {
        let totals = OccupancyTotals::default();
        let mut s = OccupancySampler::new();
        // Idle (the engine has no work) for 3 ms, then 2 ms with 4 pieces out.
        s.sample(&totals, 0, 0, false, false);
        std::thread::sleep(Duration::from_millis(3));
        s.sample(&totals, 4, 0, false, true);
        std::thread::sleep(Duration::from_millis(2));
        s.sample(&totals, 0, 0, false, false);
        s.publish(&totals);
        let d = totals.snapshot();
        // Only the busy stretch is counted, so the average is the 4 pieces it had out; with
        // the idle 3 ms counted it would be at most 1.6.
        assert!(d.micros >= 2000, "{d:?}");
        assert_eq!(d.mean_in_kernel(), 4.0, "{d:?}");
    }

    #[test]
    fn sampling_counts_each_interval_at_the_state_before_it() {
        let totals = OccupancyTotals::default();
        let mut s = OccupancySampler::new();
        s.sample(&totals, 5, 1, true, true);
        std::thread::sleep(Duration::from_millis(2));
        s.sample(&totals, 0, 0, false, true);
        s.publish(&totals);
        let d = totals.snapshot();
        assert!(d.micros >= 2000, "{d:?}");
        // Nearly all of the time was spent at (5, 1, starved): the first interval, before
        // any state was given, is at most what the first call took to be made.
        assert!(
            d.in_kernel >= 5 * 2000 && d.in_kernel <= 5 * d.micros,
            "{d:?}"
        );
        assert!(d.gated >= 2000 && d.starved >= 2000, "{d:?}");
    }
}
