//! What `gpuio bench` prints about its points: the JSON line of `--json`, the comparison with
//! the peers and the summary table of a sweep.

use serde::Serialize;
use serde_with::with_prefix;

use super::{Measurement, Pattern, Peer, PeerResult, PointOutput, Rw};
use crate::CliResult;
use crate::size::short_size;
use crate::stdout::outln;

/// Where an engine's pieces spent a point's time (see `gpuio::Occupancy`).
#[derive(Debug, Serialize)]
pub(super) struct OccupancyJson {
    /// Pieces in the kernel on average.
    pub in_kernel: f64,
    /// Slot releases waiting behind CUDA events on average.
    pub gated: f64,
    /// Share of the time work waited for bounce memory.
    pub starved_share: f64,
}

/// One point's `--json` line. Scripts read these names (.ci/run, scripts/gpu-bundle.sh,
/// scripts/ab-bench.sh, scripts/compare-fio.sh): keep them.
#[derive(Debug, Serialize)]
pub(super) struct PointJson {
    pub bytes: u64,
    pub seconds: f64,
    pub gbps: f64,
    pub iops: f64,
    /// Requests (a batch counts as its blocks).
    pub ops: u64,
    pub lat_p50_us: u64,
    pub lat_p99_us: u64,
    /// CPU cores the process kept busy, CPU seconds per GB moved, and CPU seconds per
    /// million requests (what small reads cost).
    pub cpu_cores: f64,
    pub cpu_s_per_gb: f64,
    pub cpu_s_per_mreq: f64,
    /// Cores the engine's reactor thread kept busy (near 1: it was the limit); absent where
    /// `/proc` could not say.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reactor_cores: Option<f64>,
    /// The path that served the point (`io_uring`, `cufile-compat`, `io_uring+bounce`, ...).
    pub backend: String,
    /// What --backend asked for.
    pub backend_requested: String,
    pub backend_detail: String,
    pub bounce_pinned: bool,
    pub rw: Rw,
    pub pattern: Pattern,
    pub bs: u64,
    pub qd: usize,
    pub direct: bool,
    pub to: String,
    /// With several GPUs (`--to gpu:0,1`): each one's rate, in the order `to` lists them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_gpu_gbps: Option<Vec<f64>>,
    /// Share of requests the polling thread served from the page cache (0 to 1).
    pub cached_share: f64,
    /// Share of requests copied straight from registered page-cache mappings
    /// (`--mapped-reads`; absent when off).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mapped_share: Option<f64>,
    /// Runtime tasks that polled the requests (`--jobs`; absent: one per request).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jobs: Option<usize>,
    /// Where the engine's pieces spent the measured time (`Engine::occupancy`).
    pub occupancy: OccupancyJson,
    pub inline_copies: bool,
    pub reactor_spin_us: Option<u64>,
    /// Reactor threads of the engine (`--reactors`).
    pub reactors: usize,
    pub reactor_tick_us: Option<u64>,
    /// The file, or the NVMe transport ID.
    pub file: String,
    /// Under --compare: the first peer (fio, or SPDK's perf) and gpuio's ratios to it.
    #[serde(flatten)]
    pub vs: Option<Versus>,
    /// Under --compare: every peer's figures and gpuio's ratios to them.
    #[serde(flatten)]
    pub peers: PeerFields,
}

/// `peer`, `ratio_gbps`, `ratio_iops`.
#[derive(Debug, Serialize)]
pub(super) struct Versus {
    peer: &'static str,
    ratio_gbps: f64,
    ratio_iops: f64,
}

/// A peer's medians: `fio_gbps`, `fio_iops`, `fio_cores`, `fio_detail` (and so on per peer).
#[derive(Debug, Serialize)]
struct Figures {
    gbps: f64,
    iops: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    cores: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

/// gpuio over a peer: `ratio_fio_gbps`, `ratio_fio_iops` (and so on per peer).
#[derive(Debug, Serialize)]
struct Ratios {
    gbps: f64,
    iops: f64,
}

with_prefix!(fio "fio_");
with_prefix!(ratio_fio "ratio_fio_");
with_prefix!(spdk_perf "spdk_perf_");
with_prefix!(ratio_spdk_perf "ratio_spdk_perf_");
with_prefix!(kvikio "kvikio_");
with_prefix!(ratio_kvikio "ratio_kvikio_");

/// Each peer's figures, where it ran, under names with the peer's prefix.
#[derive(Debug, Default, Serialize)]
pub(super) struct PeerFields {
    #[serde(flatten, with = "fio")]
    fio: Option<Figures>,
    #[serde(flatten, with = "ratio_fio")]
    ratio_fio: Option<Ratios>,
    #[serde(flatten, with = "spdk_perf")]
    spdk_perf: Option<Figures>,
    #[serde(flatten, with = "ratio_spdk_perf")]
    ratio_spdk_perf: Option<Ratios>,
    #[serde(flatten, with = "kvikio")]
    kvikio: Option<Figures>,
    #[serde(flatten, with = "ratio_kvikio")]
    ratio_kvikio: Option<Ratios>,
}

impl PeerFields {
    fn set(&mut self, peer: Peer, figures: Figures, ratios: Ratios) {
        let (f, r) = match peer {
            Peer::Fio => (&mut self.fio, &mut self.ratio_fio),
            Peer::SpdkPerf => (&mut self.spdk_perf, &mut self.ratio_spdk_perf),
            Peer::Kvikio => (&mut self.kvikio, &mut self.ratio_kvikio),
        };
        *f = Some(figures);
        *r = Some(ratios);
    }
}

/// One line per peer comparing the point with it (medians of `rounds`), and the peer's
/// figures added to the point's JSON.
pub(super) fn against_peers(m: &mut PointOutput, peers: &[PeerResult], rounds: usize) -> CliResult {
    for (i, p) in peers.iter().enumerate() {
        let name = p.peer;
        // CPU seconds per unit moved: cores divided by the rate (GB/s, or millions of
        // requests a second).
        let per_unit = |cores: f64, rate: f64| {
            if rate > 0.0 {
                format!("{:.3}", cores / rate)
            } else {
                "-".to_string()
            }
        };
        outln!(
            "  vs {name} (medians of {rounds}{}): gpuio {:.3} GB/s {:.0} IOPS, {name} \
             {:.3} GB/s {:.0} IOPS: gpuio/{name} {:.2} (GB/s), {:.2} (IOPS); \
             CPU cores gpuio {:.2}, {name} {}; CPU s/GB gpuio {}, {name} {}; \
             CPU s per million requests gpuio {}, {name} {}",
            p.detail
                .as_ref()
                .map_or_else(String::new, |d| format!(", {d}")),
            m.result.gbps,
            m.result.iops,
            p.gbps,
            p.iops,
            m.result.gbps / p.gbps,
            m.result.iops / p.iops,
            m.result.cores,
            p.cores
                .map_or_else(|| "-".to_string(), |c| format!("{c:.2}")),
            per_unit(m.result.cores, m.result.gbps),
            p.cores
                .map_or_else(|| "-".to_string(), |c| per_unit(c, p.gbps)),
            per_unit(m.result.cores, m.result.iops / 1e6),
            p.cores
                .map_or_else(|| "-".to_string(), |c| per_unit(c, p.iops / 1e6)),
        )?;
        let ratios = Ratios {
            gbps: m.result.gbps / p.gbps,
            iops: m.result.iops / p.iops,
        };
        if i == 0 {
            m.json.vs = Some(Versus {
                peer: name.name(),
                ratio_gbps: ratios.gbps,
                ratio_iops: ratios.iops,
            });
        }
        let figures = Figures {
            gbps: p.gbps,
            iops: p.iops,
            cores: p.cores,
            detail: p.detail.clone(),
        };
        m.json.peers.set(name, figures, ratios);
    }
    Ok(())
}

/// The table of a sweep (or of one point with peers): a row per point and peer.
pub(super) fn summary(results: &[Measurement]) -> CliResult {
    if results.len() <= 1 && results.iter().all(|m| m.peers.is_empty()) {
        return Ok(());
    }
    outln!(
        "{:<8} {:>8} {:>5} {:>9} {:>10} {:>8} {:>8}  {:>9} {:>10} {:>7}  served by (peer)",
        "backend",
        "bs",
        "qd",
        "GB/s",
        "IOPS",
        "p50 us",
        "p99 us",
        "peer GB/s",
        "peer IOPS",
        "ratio"
    )?;
    for m in results {
        // One row per peer (the gpuio columns repeat), or one without a peer.
        let rows: Vec<(String, String, String, String)> = if m.peers.is_empty() {
            vec![("-".into(), "-".into(), "-".into(), String::new())]
        } else {
            m.peers
                .iter()
                .map(|f| {
                    (
                        format!("{:.3}", f.gbps),
                        format!("{:.0}", f.iops),
                        format!("{:.2}", m.gbps / f.gbps),
                        format!(" ({})", f.peer),
                    )
                })
                .collect()
        };
        for (fg, fi, ratio, who) in rows {
            outln!(
                "{:<8} {:>8} {:>5} {:>9.3} {:>10.0} {:>8} {:>8}  {fg:>9} {fi:>10} {ratio:>7}  {}{who}",
                m.point.backend.to_string(),
                short_size(m.point.bs),
                m.point.qd,
                m.gbps,
                m.iops,
                m.lat_p50_us,
                m.lat_p99_us,
                m.served_by
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names scripts read stay what they were when the JSON was built by hand.
    #[test]
    fn the_json_line_keeps_its_field_names() {
        let mut j = PointJson {
            bytes: 1,
            seconds: 1.0,
            gbps: 1.0,
            iops: 1.0,
            ops: 1,
            lat_p50_us: 1,
            lat_p99_us: 2,
            cpu_cores: 1.0,
            cpu_s_per_gb: 1.0,
            cpu_s_per_mreq: 1.0,
            reactor_cores: None,
            backend: "io_uring".into(),
            backend_requested: "auto".into(),
            backend_detail: String::new(),
            bounce_pinned: false,
            rw: Rw::Write,
            pattern: Pattern::Rand,
            bs: 4096,
            qd: 1,
            direct: true,
            to: "gpu:0".into(),
            per_gpu_gbps: None,
            cached_share: 0.0,
            mapped_share: None,
            jobs: None,
            occupancy: OccupancyJson {
                in_kernel: 0.0,
                gated: 0.0,
                starved_share: 0.0,
            },
            inline_copies: false,
            reactor_spin_us: None,
            reactor_tick_us: Some(100),
            reactors: 1,
            file: "f".into(),
            vs: None,
            peers: PeerFields::default(),
        };
        let keys = |j: &PointJson| -> Vec<String> {
            let v = serde_json::to_value(j).unwrap();
            let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
            k.sort();
            k
        };
        let base = [
            "backend",
            "backend_detail",
            "backend_requested",
            "bounce_pinned",
            "bs",
            "bytes",
            "cached_share",
            "cpu_cores",
            "cpu_s_per_gb",
            "cpu_s_per_mreq",
            "direct",
            "file",
            "gbps",
            "inline_copies",
            "iops",
            "lat_p50_us",
            "lat_p99_us",
            "occupancy",
            "ops",
            "pattern",
            "qd",
            "reactor_spin_us",
            "reactor_tick_us",
            "reactors",
            "rw",
            "seconds",
            "to",
        ];
        assert_eq!(keys(&j), base);
        let v = serde_json::to_value(&j).unwrap();
        assert_eq!(
            (&v["rw"], &v["pattern"], &v["reactor_spin_us"]),
            (&"write".into(), &"rand".into(), &serde_json::Value::Null)
        );

        j.vs = Some(Versus {
            peer: Peer::SpdkPerf.name(),
            ratio_gbps: 0.5,
            ratio_iops: 0.5,
        });
        let figures = |cores, detail| Figures {
            gbps: 2.0,
            iops: 2.0,
            cores,
            detail,
        };
        let ratios = || Ratios {
            gbps: 0.5,
            iops: 0.5,
        };
        j.peers.set(Peer::SpdkPerf, figures(None, None), ratios());
        j.peers.set(
            Peer::Kvikio,
            figures(Some(3.0), Some("KvikIO best at 8 threads".into())),
            ratios(),
        );
        let mut want: Vec<&str> = base.to_vec();
        want.extend([
            "peer",
            "ratio_gbps",
            "ratio_iops",
            "spdk_perf_gbps",
            "spdk_perf_iops",
            "ratio_spdk_perf_gbps",
            "ratio_spdk_perf_iops",
            "kvikio_gbps",
            "kvikio_iops",
            "kvikio_cores",
            "kvikio_detail",
            "ratio_kvikio_gbps",
            "ratio_kvikio_iops",
        ]);
        want.sort();
        assert_eq!(keys(&j), want);
        assert_eq!(serde_json::to_value(&j).unwrap()["peer"], "spdk-perf");
    }
}
