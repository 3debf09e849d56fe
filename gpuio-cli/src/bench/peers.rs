//! The peers `gpuio bench --compare` runs on the same target with the same settings: fio on
//! files, SPDK's perf on NVMe namespaces, KvikIO where its peer program is found.

use std::path::PathBuf;

use serde::Deserialize;

use super::{BenchArgs, Pattern, Point, Rw, Target};

/// A program gpuio is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Fio,
    SpdkPerf,
    Kvikio,
}

impl Peer {
    /// `fio`, `spdk-perf` or `kvikio`.
    pub fn name(self) -> &'static str {
        match self {
            Peer::Fio => "fio",
            Peer::SpdkPerf => "spdk-perf",
            Peer::Kvikio => "kvikio",
        }
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A peer's throughput at one point.
#[derive(Debug, Clone)]
pub struct PeerResult {
    pub peer: Peer,
    /// Bytes per second / 1e9.
    pub gbps: f64,
    /// Requests per second.
    pub iops: f64,
    /// CPU cores the peer kept busy (user + system), where it reports them.
    pub cores: Option<f64>,
    /// How the peer ran, where it chose (KvikIO's best thread count).
    pub detail: Option<String>,
}

/// The median of a peer's rounds (each figure separately), standing for the point.
pub(super) fn median_peer(rounds: &[PeerResult]) -> PeerResult {
    let med = |f: &dyn Fn(&PeerResult) -> f64| {
        let mut v: Vec<f64> = rounds.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    // The detail of the median round by throughput.
    let mut by_gbps: Vec<&PeerResult> = rounds.iter().collect();
    by_gbps.sort_by(|x, y| x.gbps.total_cmp(&y.gbps));
    PeerResult {
        peer: rounds[0].peer,
        gbps: med(&|p| p.gbps),
        iops: med(&|p| p.iops),
        cores: rounds
            .iter()
            .all(|p| p.cores.is_some())
            .then(|| med(&|p| p.cores.unwrap_or(0.0))),
        detail: by_gbps[by_gbps.len() / 2].detail.clone(),
    }
}

/// A peer's name for the point's workload (fio's and perf's agree) and its depth: a batch
/// counts as its blocks.
fn peer_workload(a: &BenchArgs, point: Point) -> (&'static str, usize) {
    let rw = match (a.rw, a.pattern) {
        (Rw::Read, Pattern::Seq) => "read",
        (Rw::Read, _) => "randread",
        (Rw::Write, Pattern::Seq) => "write",
        (Rw::Write, _) => "randwrite",
    };
    let depth = point.qd
        * if a.pattern == Pattern::Batch {
            a.batch
        } else {
            1
        };
    (rw, depth)
}

pub(super) fn fio_available() -> bool {
    std::process::Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// fio with the point's settings on the same file: io_uring engine, one job `qd` deep (a
/// batch counts as its blocks), or `--jobs` jobs sharing that depth, for `--seconds`. Reads
/// go to host memory (fio has no GPU target): for device points it stands for the storage
/// side's ceiling.
pub(super) async fn fio(
    a: &BenchArgs,
    point: Point,
    path: &std::path::Path,
    span: u64,
) -> Result<PeerResult, Box<dyn std::error::Error + Send + Sync>> {
    let (rw, depth) = peer_workload(a, point);
    // `BenchArgs::check` made sure the jobs split the depth evenly.
    let jobs = a.jobs.unwrap_or(1).max(1);
    let args = vec![
        "--name=gpuio-peer".to_string(),
        format!("--numjobs={jobs}"),
        format!("--filename={}", path.display()),
        format!("--size={span}"),
        format!("--rw={rw}"),
        format!("--bs={}", point.bs),
        format!("--iodepth={}", (depth / jobs).max(1)),
        "--ioengine=io_uring".to_string(),
        format!("--direct={}", u8::from(a.direct)),
        // fio drops the file's page cache before it starts unless told not to: a buffered
        // point would then measure fio cold (and leave gpuio's next round cold too).
        "--invalidate=0".to_string(),
        "--time_based".to_string(),
        format!("--runtime={}", a.seconds.ceil().max(1.0) as u64),
        "--output-format=json".to_string(),
    ];
    let out =
        tokio::task::spawn_blocking(move || std::process::Command::new("fio").args(&args).output())
            .await??;
    if !out.status.success() {
        return Err(format!(
            "fio failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    parse_fio(&out.stdout, a.rw)
}

/// fio's `--output-format=json`: the parts read from it.
#[derive(Debug, Deserialize)]
struct FioOutput {
    jobs: Vec<FioJob>,
}

#[derive(Debug, Deserialize)]
struct FioJob {
    read: FioDirection,
    write: FioDirection,
    /// Percent of one core, user and system.
    usr_cpu: Option<f64>,
    sys_cpu: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct FioDirection {
    bw_bytes: f64,
    iops: f64,
}

/// The figures for the direction measured, summed over fio's jobs (cores too: each job
/// reports its share of one core).
fn parse_fio(json: &[u8], rw: Rw) -> Result<PeerResult, Box<dyn std::error::Error + Send + Sync>> {
    let out: FioOutput =
        serde_json::from_slice(json).map_err(|e| format!("fio's JSON output: {e}"))?;
    if out.jobs.is_empty() {
        return Err("fio's JSON output has no job".into());
    }
    let (mut gbps, mut iops, mut cores) = (0.0, 0.0, Some(0.0));
    for job in out.jobs {
        let dir = match rw {
            Rw::Read => job.read,
            Rw::Write => job.write,
        };
        gbps += dir.bw_bytes / 1e9;
        iops += dir.iops;
        cores = cores
            .zip(job.usr_cpu.zip(job.sys_cpu))
            .map(|(c, (u, s))| c + (u + s) / 100.0);
    }
    Ok(PeerResult {
        peer: Peer::Fio,
        gbps,
        iops,
        cores,
        detail: None,
    })
}

/// The KvikIO peer program (`scripts/kvikio-peer.sh` builds it): GPUIO_KVIKIO_PEER, else
/// `kvikio-peer` on PATH; or why there is none.
pub(super) fn kvikio_peer_binary() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("GPUIO_KVIKIO_PEER") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("GPUIO_KVIKIO_PEER={} is not a file", p.display()))
        };
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join("kvikio-peer"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "no KvikIO peer (kvikio-peer on PATH or GPUIO_KVIKIO_PEER; \
             scripts/kvikio-peer.sh builds it)"
                .to_string()
        })
}

/// KvikIO with the point's settings on the same file: `qd` requests of `bs` bytes in flight
/// through `FileHandle::pread`/`pwrite` (KvikIO splits each over its thread pool), into the
/// same kind of memory, for `--seconds` per thread count of `--kvikio-threads`; the best
/// thread count stands for KvikIO. KvikIO runs in its POSIX (compatibility) mode, its fastest
/// path on machines without nvidia-fs (ENVIRONMENT.md).
pub(super) async fn kvikio_peer(
    a: &BenchArgs,
    point: Point,
    bin: &std::path::Path,
    path: &std::path::Path,
    span: u64,
) -> Result<PeerResult, Box<dyn std::error::Error + Send + Sync>> {
    let threads: Vec<String> = a.kvikio_threads.iter().map(|t| t.to_string()).collect();
    let mut args = vec![
        "--file".to_string(),
        path.display().to_string(),
        "--span".into(),
        span.to_string(),
        "--bs".into(),
        point.bs.to_string(),
        "--qd".into(),
        point.qd.to_string(),
        "--seconds".into(),
        a.seconds.to_string(),
        "--pattern".into(),
        if a.pattern == Pattern::Seq {
            "seq"
        } else {
            "rand"
        }
        .into(),
        "--rw".into(),
        if a.rw == Rw::Read { "read" } else { "write" }.into(),
        "--threads".into(),
        threads.join(","),
    ];
    if a.direct {
        args.push("--direct".into());
    }
    if let Target::Gpu(n) = a.to {
        args.extend(["--gpu".into(), "--device".into(), n.to_string()]);
    }
    let bin = bin.to_path_buf();
    let out =
        tokio::task::spawn_blocking(move || std::process::Command::new(&bin).args(&args).output())
            .await??;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr)
            .trim()
            .to_string()
            .into());
    }
    Ok(parse_kvikio_peer(&String::from_utf8_lossy(&out.stdout))?)
}

/// A line of the KvikIO peer's output: one per thread count tried, then the best again with
/// `"best":true`.
#[derive(Debug, Deserialize)]
struct KvikioLine {
    #[serde(default)]
    best: bool,
}

/// The KvikIO peer's `"best":true` line.
#[derive(Debug, Deserialize)]
struct KvikioBest {
    threads: u64,
    gbps: f64,
    iops: f64,
    cores: Option<f64>,
}

/// The KvikIO peer's result: its `{"best":true,...}` line (one line per thread count before).
fn parse_kvikio_peer(text: &str) -> Result<PeerResult, String> {
    let line = text
        .lines()
        .find(|l| serde_json::from_str::<KvikioLine>(l).is_ok_and(|l| l.best))
        .ok_or_else(|| {
            format!(
                "no result line in the KvikIO peer's output: {}",
                text.trim()
            )
        })?;
    let best: KvikioBest = serde_json::from_str(line)
        .map_err(|e| format!("the KvikIO peer's result line lacks figures ({e}): {line}"))?;
    Ok(PeerResult {
        peer: Peer::Kvikio,
        gbps: best.gbps,
        iops: best.iops,
        cores: best.cores,
        detail: Some(format!("KvikIO best at {} threads", best.threads)),
    })
}

/// SPDK's own `perf` example from the build `scripts/spdk.sh` made (next to the library gpuio
/// loads), or why it cannot be run.
pub(super) fn spdk_perf_binary() -> Result<PathBuf, String> {
    let (lib, _) = gpuio::spdk::probe().library?;
    let home = std::path::Path::new(&lib)
        .parent()
        .and_then(|p| p.parent())
        .ok_or("no SPDK home")?;
    let bin = home.join("bin/perf");
    if bin.exists() {
        Ok(bin)
    } else {
        Err(format!("SPDK's perf is not at {}", bin.display()))
    }
}

/// SPDK's `perf` with the point's settings against the same namespace: one core (the machine's
/// last), `qd` deep (a batch counts as its blocks), for `--seconds`, reads or writes into its
/// own DMA memory (it has no GPU target).
pub(super) async fn spdk_perf(
    a: &BenchArgs,
    point: Point,
    bin: &std::path::Path,
) -> Result<PeerResult, Box<dyn std::error::Error + Send + Sync>> {
    let (rw, depth) = peer_workload(a, point);
    let trid = a.nvme.clone().unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let lib_dir = bin
        .parent()
        .and_then(|p| p.parent())
        .map(|h| h.join("lib"))
        .unwrap_or_default();
    let args = vec![
        "-q".to_string(),
        depth.to_string(),
        "-o".to_string(),
        point.bs.to_string(),
        "-w".to_string(),
        rw.to_string(),
        "-t".to_string(),
        (a.seconds.ceil().max(1.0) as u64).to_string(),
        "-c".to_string(),
        format!("{:#x}", 1u64 << (cores - 1).min(63)),
        "-r".to_string(),
        trid,
    ];
    let bin = bin.to_path_buf();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&bin)
            .args(&args)
            .env("LD_LIBRARY_PATH", &lib_dir)
            .output()
    })
    .await??;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "SPDK perf failed: {}{}",
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    // "Total : <IOPS> <MiB/s> <avg us> <min> <max>"
    let nums: Vec<f64> = text
        .lines()
        .find(|l| l.trim_start().starts_with("Total"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, r)| {
            r.split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    let [iops, mibs, ..] = nums[..] else {
        return Err(format!("no Total line in SPDK perf's output: {}", text.trim()).into());
    };
    Ok(PeerResult {
        peer: Peer::SpdkPerf,
        gbps: mibs * 1048576.0 / 1e9,
        iops,
        // perf does not report it (it busy-polls its one core by design).
        cores: None,
        detail: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(gbps: f64, cores: Option<f64>, detail: &str) -> PeerResult {
        PeerResult {
            peer: Peer::Kvikio,
            gbps,
            iops: gbps * 1000.0,
            cores,
            detail: Some(detail.to_string()),
        }
    }

    #[test]
    fn a_peer_point_is_the_median_of_its_rounds() {
        let m = median_peer(&[
            peer(47.0, Some(2.0), "8"),
            peer(31.0, Some(1.0), "4"),
            peer(46.0, Some(3.0), "16"),
        ]);
        assert_eq!(m.gbps, 46.0);
        assert_eq!(m.iops, 46000.0);
        assert_eq!(m.cores, Some(2.0));
        // The detail comes from the median round by throughput.
        assert_eq!(m.detail.as_deref(), Some("16"));
        // One round without a CPU figure: no CPU figure for the point.
        let m = median_peer(&[peer(1.0, Some(1.0), "a"), peer(2.0, None, "b")]);
        assert_eq!(m.cores, None);
    }

    #[test]
    fn fio_figures_come_from_the_direction_measured() {
        // fio 3.33's output, cut down (the real one has dozens more fields per job).
        let out = br#"{"fio version":"fio-3.33","jobs":[{"jobname":"gpuio-peer","error":0,
            "read":{"io_bytes":1048576000,"bw_bytes":1048576000,"iops":16000.0,"runtime":1000},
            "write":{"io_bytes":0,"bw_bytes":0,"iops":0.000000,"runtime":0},
            "usr_cpu":10.5,"sys_cpu":33.5,"ctx":1}],"disk_util":[]}"#;
        let p = parse_fio(out, Rw::Read).unwrap();
        assert_eq!(
            (p.peer, p.gbps, p.iops, p.cores),
            (Peer::Fio, 1.048576, 16000.0, Some(0.44))
        );
        assert_eq!(parse_fio(out, Rw::Write).unwrap().iops, 0.0);
        let err = parse_fio(br#"{"jobs":[]}"#, Rw::Read).unwrap_err();
        assert!(err.to_string().contains("no job"), "{err}");
        let err = parse_fio(br#"{"jobs":[{"read":{"iops":1.0}}]}"#, Rw::Read).unwrap_err();
        assert!(err.to_string().contains("bw_bytes"), "{err}");
    }

    #[test]
    fn several_fio_jobs_are_summed() {
        let job = |iops: f64| {
            format!(
                r#"{{"read":{{"bw_bytes":{},"iops":{iops}}},"write":{{"bw_bytes":0,"iops":0}},
                "usr_cpu":20.0,"sys_cpu":60.0}}"#,
                iops * 4096.0
            )
        };
        let out = format!(r#"{{"jobs":[{},{}]}}"#, job(100.0), job(300.0));
        let p = parse_fio(out.as_bytes(), Rw::Read).unwrap();
        assert_eq!(p.iops, 400.0);
        assert_eq!(p.gbps, 400.0 * 4096.0 / 1e9);
        assert_eq!(p.cores, Some(1.6));
    }

    #[test]
    fn the_kvikio_peer_reports_its_best_thread_count() {
        let out = concat!(
            r#"{"threads":8,"gbps":47.1,"iops":2807.0,"cores":3.2}"#,
            "\n",
            r#"{"threads":16,"gbps":46.5,"iops":2771.0,"cores":5.0}"#,
            "\n",
            r#"{"best":true,"threads":8,"gbps":47.1,"iops":2807.0,"cores":3.2,"memory":"device"}"#,
            "\n"
        );
        let p = parse_kvikio_peer(out).unwrap();
        assert_eq!(
            (p.peer, p.gbps, p.iops, p.cores),
            (Peer::Kvikio, 47.1, 2807.0, Some(3.2))
        );
        assert_eq!(p.detail.as_deref(), Some("KvikIO best at 8 threads"));
        let err = parse_kvikio_peer(r#"{"threads":8,"gbps":1.0}"#).unwrap_err();
        assert!(err.contains("no result line"), "{err}");
        let err = parse_kvikio_peer(r#"{"best":true,"gbps":1.0}"#).unwrap_err();
        assert!(err.contains("lacks figures"), "{err}");
    }
}
