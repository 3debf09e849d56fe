//! CPU time of this process's threads by name (`/proc/self/task/*/stat`): how busy the
//! engine's reactor thread was during a point. On small O_DIRECT reads it is the limit
//! (BENCHMARKS.md, nineteenth session: 85–94% of a core at QD64), and a figure near one core
//! says so where the process's total cannot.

use std::collections::HashMap;

/// The engine's reactor threads: `gpuio-reactor`, then `gpuio-reactor1`, `gpuio-reactor2`...
pub(crate) const REACTOR: &str = "gpuio-reactor";

/// CPU seconds so far of each live thread named `name`, or `name` and a number, by thread id.
pub(crate) fn cpu_by_thread(name: &str) -> HashMap<u32, f64> {
    let mut out = HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    // SAFETY: sysconf has no memory preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = if ticks > 0 { ticks as f64 } else { 100.0 };
    for entry in dir.flatten() {
        let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some(secs) = parse_stat(&stat, name, ticks) {
            out.insert(tid, secs);
        }
    }
    out
}

/// User + system seconds from one `stat` line if its thread is named `name`. The name sits
/// in parentheses and may hold spaces or parentheses itself, so the fields are counted from
/// the last `)`.
fn parse_stat(stat: &str, name: &str, ticks: f64) -> Option<f64> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let numbered = stat.get(open + 1..close)?.strip_prefix(name)?;
    if !numbered.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // After ") ": state, ppid, pgrp, session, tty_nr, tpgid, flags, minflt, cminflt, majflt,
    // cmajflt, utime, stime.
    let mut fields = stat.get(close + 2..)?.split_ascii_whitespace();
    let utime: f64 = fields.nth(11)?.parse().ok()?;
    let stime: f64 = fields.next()?.parse().ok()?;
    Some((utime + stime) / ticks)
}

/// How busy some threads were between two `cpu_by_thread` snapshots.
#[derive(Debug, PartialEq)]
pub(crate) struct Busy {
    /// Threads seen at both ends.
    pub(crate) threads: usize,
    /// Cores they kept busy together, and the busiest one alone.
    pub(crate) total: f64,
    pub(crate) busiest: f64,
}

/// Cores the threads named like this kept busy between two `cpu_by_thread` snapshots, over
/// `secs`: threads present in both only (`None` if none was).
pub(crate) fn cores_between(
    before: &HashMap<u32, f64>,
    after: &HashMap<u32, f64>,
    secs: f64,
) -> Option<Busy> {
    if secs <= 0.0 {
        return None;
    }
    let mut busy = Busy {
        threads: 0,
        total: 0.0,
        busiest: 0.0,
    };
    for (tid, end) in after {
        if let Some(start) = before.get(tid) {
            let cores = (end - start).max(0.0) / secs;
            busy.threads += 1;
            busy.total += cores;
            busy.busiest = busy.busiest.max(cores);
        }
    }
    (busy.threads > 0).then_some(busy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_are_read_by_name_from_the_last_parenthesis() {
        let line = "4242 (gpuio-reactor) S 1 1 1 0 -1 4194368 10 0 0 0 250 50 0 0 20 0 1 0";
        assert_eq!(parse_stat(line, "gpuio-reactor", 100.0), Some(3.0));
        assert_eq!(parse_stat(line, "tokio-rt-worker", 100.0), None);
        let second = "4243 (gpuio-reactor1) S 1 1 1 0 -1 4194368 10 0 0 0 100 0 0 0 20 0 1 0";
        assert_eq!(parse_stat(second, REACTOR, 100.0), Some(1.0));
        let other = "4244 (gpuio-reactorx) S 1 1 1 0 -1 4194368 10 0 0 0 100 0 0 0 20 0 1 0";
        assert_eq!(parse_stat(other, REACTOR, 100.0), None);
        let odd = "7 (a) b (c)) R 1 1 1 0 -1 0 0 0 0 0 7 3 0 0";
        assert_eq!(parse_stat(odd, "a) b (c)", 10.0), Some(1.0));
        assert_eq!(parse_stat("garbage", "x", 100.0), None);
    }

    #[test]
    fn cores_count_threads_seen_at_both_ends_only() {
        let before = HashMap::from([(1, 1.0), (2, 5.0)]);
        let after = HashMap::from([(1, 2.5), (3, 9.0)]);
        let busy = cores_between(&before, &after, 1.5).expect("thread 1 at both ends");
        assert_eq!((busy.threads, busy.total, busy.busiest), (1, 1.0, 1.0));
        let two = HashMap::from([(1, 2.5), (2, 5.75)]);
        let busy = cores_between(&before, &two, 1.5).expect("both at both ends");
        assert_eq!((busy.threads, busy.total, busy.busiest), (2, 1.5, 1.0));
        assert_eq!(cores_between(&before, &HashMap::new(), 1.0), None);
    }

    #[test]
    fn this_threads_own_time_is_found() {
        let name = "gpuio-cpu-test";
        let t = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let end = std::time::Instant::now() + std::time::Duration::from_millis(50);
                while std::time::Instant::now() < end {
                    std::hint::spin_loop();
                }
                cpu_by_thread(name)
            })
            .expect("a thread starts");
        let seen = t.join().expect("the thread ends");
        assert_eq!(seen.len(), 1, "{seen:?}");
    }
}
