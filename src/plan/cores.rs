//! Which CPUs the engine's own threads run on: a core kept for the reactor, away from the
//! io_uring workers that copy page-cache pieces.
//!
//! With as many page-cache copies in flight as the host has cores, the copying workers take
//! every core, and the reactor (which hands each finished copy its next piece) and the
//! runtime's threads (which start each piece's copy to the GPU) wait in the run queue behind
//! them: each copy then ends later, and throughput falls (the 16-core host at 16 copies, the
//! 32-core host at 32). Keeping a few cores away from io-wq (`IORING_REGISTER_IOWQ_AFF`), the
//! reactor on one of them, keeps those threads running.

use std::io;

/// A set of CPUs, as the kernel's scheduler takes it.
#[derive(Clone, Copy)]
pub(crate) struct CpuSet(libc::cpu_set_t);

impl std::fmt::Debug for CpuSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cpus: Vec<usize> = (0..Self::capacity())
            .filter(|&c| self.contains(c))
            .collect();
        f.debug_tuple("CpuSet").field(&cpus).finish()
    }
}

impl CpuSet {
    /// An empty set.
    fn empty() -> CpuSet {
        // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
        CpuSet(unsafe { std::mem::zeroed() })
    }

    /// The CPUs the calling thread may run on.
    pub(crate) fn of_this_thread() -> io::Result<CpuSet> {
        let mut set = CpuSet::empty();
        // SAFETY: `set.0` is a writable cpu_set_t of the size passed; pid 0 is this thread.
        let r = unsafe {
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set.0)
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(set)
    }

    /// The set holding `cpu` alone.
    pub(crate) fn only(cpu: usize) -> CpuSet {
        let mut set = CpuSet::empty();
        set.insert(cpu);
        set
    }

    fn insert(&mut self, cpu: usize) {
        if cpu < Self::capacity() {
            // SAFETY: `cpu` is below the set's capacity (checked above).
            unsafe { libc::CPU_SET(cpu, &mut self.0) }
        }
    }

    /// The set without `cpu`.
    pub(crate) fn without(mut self, cpu: usize) -> CpuSet {
        if cpu < Self::capacity() {
            // SAFETY: `cpu` is below the set's capacity (checked above).
            unsafe { libc::CPU_CLR(cpu, &mut self.0) }
        }
        self
    }

    /// Whether `cpu` is in the set.
    pub(crate) fn contains(&self, cpu: usize) -> bool {
        // SAFETY: `cpu` is below the set's capacity (checked first).
        cpu < Self::capacity() && unsafe { libc::CPU_ISSET(cpu, &self.0) }
    }

    fn capacity() -> usize {
        8 * std::mem::size_of::<libc::cpu_set_t>()
    }

    /// How many CPUs the set holds.
    pub(crate) fn count(&self) -> usize {
        (0..Self::capacity()).filter(|&c| self.contains(c)).count()
    }

    /// The highest-numbered CPU in the set.
    pub(crate) fn last(&self) -> Option<usize> {
        (0..Self::capacity()).rev().find(|&c| self.contains(c))
    }

    /// Restricts the calling thread to this set.
    pub(crate) fn pin_this_thread(&self) -> io::Result<()> {
        // SAFETY: `self.0` is a valid cpu_set_t of the size passed; pid 0 is this thread.
        let r =
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &self.0) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// The kernel's form, for `IORING_REGISTER_IOWQ_AFF`.
    pub(crate) fn as_raw(&self) -> &libc::cpu_set_t {
        &self.0
    }
}

/// Fewest CPUs an engine must be allowed before it keeps any for its own threads: below
/// this, a core taken from the copies costs more than a waiting reactor does.
pub(crate) const RESERVE_MIN_CORES: usize = 8;

/// Where the reactor runs when the engine keeps `n` CPUs away from io_uring's copying workers:
/// the calling thread's highest-numbered allowed CPU (the one other pinned work least often
/// picks first), and the CPUs left for io-wq (the allowed ones without the last `n`). `None`
/// where `n` is 0, or fewer than [`RESERVE_MIN_CORES`] would be left.
pub(crate) fn reactor_core(allowed: &CpuSet, n: usize) -> Option<(usize, CpuSet)> {
    if n == 0 || allowed.count() < RESERVE_MIN_CORES + n {
        return None;
    }
    let core = allowed.last()?;
    let mut rest = *allowed;
    for _ in 0..n {
        rest = rest.without(rest.last()?);
    }
    Some((core, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reactor_runs_on_the_last_allowed_core_and_io_wq_gets_the_rest() {
        let mut allowed = CpuSet::empty();
        for c in [0, 1, 2, 3, 4, 5, 6, 9] {
            allowed.insert(c);
        }
        for c in [10, 12] {
            allowed.insert(c);
        }
        let (core, rest) = reactor_core(&allowed, 1).expect("ten CPUs keep one");
        assert_eq!(core, 12);
        assert_eq!(rest.count(), 9);
        assert!(!rest.contains(12) && rest.contains(0) && rest.contains(10));
        assert!(!rest.contains(7), "a CPU never allowed stays out");
        let (core, rest) = reactor_core(&allowed, 2).expect("ten CPUs keep two");
        assert_eq!(core, 12);
        assert_eq!(rest.count(), 8);
        assert!(!rest.contains(10) && rest.contains(9));
    }

    #[test]
    fn small_sets_keep_no_core() {
        let mut allowed = CpuSet::empty();
        for c in 0..RESERVE_MIN_CORES {
            allowed.insert(c);
        }
        assert!(reactor_core(&allowed, 1).is_none(), "seven would be left");
        assert!(reactor_core(&allowed, 0).is_none(), "none asked for");
        assert_eq!(CpuSet::only(3).count(), 1);
        assert!(CpuSet::only(3).contains(3));
    }

    #[test]
    fn this_thread_has_a_cpu() {
        let set = CpuSet::of_this_thread().expect("sched_getaffinity");
        assert!(set.count() >= 1);
        assert!(set.last().is_some());
    }
}
