//! What `gpuio bench` prints about its points: the comparison with the peers and the summary
//! table of a sweep.

use super::{Measurement, PeerResult, PointOutput};
use crate::CliResult;
use crate::size::short_size;
use crate::stdout::outln;

/// One line per peer comparing the point with it (medians of `rounds`), and the peer's
/// figures added to the point's JSON.
pub(super) fn against_peers(m: &mut PointOutput, peers: &[PeerResult], rounds: usize) -> CliResult {
    for (i, p) in peers.iter().enumerate() {
        let name = p.name;
        let per_gb = |cores: f64, gbps: f64| {
            if gbps > 0.0 {
                format!("{:.3}", cores / gbps)
            } else {
                "-".to_string()
            }
        };
        outln!(
            "  vs {name} (medians of {rounds}{}): gpuio {:.3} GB/s {:.0} IOPS, {name} \
             {:.3} GB/s {:.0} IOPS: gpuio/{name} {:.2} (GB/s), {:.2} (IOPS); \
             CPU cores gpuio {:.2}, {name} {}; CPU s/GB gpuio {}, {name} {}",
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
            per_gb(m.result.cores, m.result.gbps),
            p.cores
                .map_or_else(|| "-".to_string(), |c| per_gb(c, p.gbps)),
        )?;
        let key = name.replace('-', "_");
        if i == 0 {
            m.json["peer"] = name.into();
            m.json["ratio_gbps"] = (m.result.gbps / p.gbps).into();
            m.json["ratio_iops"] = (m.result.iops / p.iops).into();
        }
        m.json[format!("{key}_gbps")] = p.gbps.into();
        m.json[format!("{key}_iops")] = p.iops.into();
        m.json[format!("ratio_{key}_gbps")] = (m.result.gbps / p.gbps).into();
        m.json[format!("ratio_{key}_iops")] = (m.result.iops / p.iops).into();
        if let Some(c) = p.cores {
            m.json[format!("{key}_cores")] = c.into();
        }
        if let Some(d) = &p.detail {
            m.json[format!("{key}_detail")] = d.clone().into();
        }
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
                        format!(" ({})", f.name),
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
