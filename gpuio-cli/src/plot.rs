//! `gpuio bench --plot`: throughput against block size and queue depth, one panel per backend.

use std::collections::BTreeSet;
use std::path::Path;

use plotters::prelude::*;

use crate::bench::Measurement;
use crate::size::short_size;

const PANEL_W: u32 = 460;
const PANEL_H: u32 = 380;
/// Distinct on white (Tableau's first ten).
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Writes `results` as an SVG. The x axis (log2) is whichever of block size and queue depth
/// the sweep varied more (block size on a tie); each line is one value of the other.
pub fn write_svg(
    path: &Path,
    title: &str,
    results: &[Measurement],
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut backends: Vec<String> = Vec::new();
    for m in results {
        let b = m.point.backend.to_string();
        if !backends.contains(&b) {
            backends.push(b);
        }
    }
    let bss: BTreeSet<u64> = results.iter().map(|m| m.point.bs).collect();
    let qds: BTreeSet<u64> = results.iter().map(|m| m.point.qd as u64).collect();
    let x_is_bs = bss.len() >= qds.len();
    let (xs, series) = if x_is_bs { (&bss, &qds) } else { (&qds, &bss) };
    let x_of = |m: &Measurement| {
        if x_is_bs {
            m.point.bs
        } else {
            m.point.qd as u64
        }
    };
    let series_of = |m: &Measurement| {
        if x_is_bs {
            m.point.qd as u64
        } else {
            m.point.bs
        }
    };
    let label_x = |v: u64| {
        if x_is_bs {
            short_size(v)
        } else {
            v.to_string()
        }
    };
    let label_series = |v: u64| {
        if x_is_bs {
            format!("qd {v}")
        } else {
            format!("bs {}", short_size(v))
        }
    };
    let (Some(&x_lo), Some(&x_hi)) = (xs.first(), xs.last()) else {
        return Err("nothing measured to plot".into());
    };
    // log2 coordinates, padded by half a step so end points are not on the frame.
    let (lx_lo, lx_hi) = ((x_lo as f64).log2() - 0.5, (x_hi as f64).log2() + 0.5);
    let y_hi = results
        .iter()
        .map(|m| m.gbps)
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.12;

    let width = PANEL_W * backends.len() as u32;
    let root = SVGBackend::new(path, (width, PANEL_H + 40)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let panels = root.split_evenly((1, backends.len()));
    for (panel, backend) in panels.iter().zip(&backends) {
        let here: Vec<&Measurement> = results
            .iter()
            .filter(|m| &m.point.backend.to_string() == backend)
            .collect();
        // What actually served the panel's points (e.g. `auto` -> `io_uring+bounce`).
        let served: BTreeSet<&str> = here.iter().map(|m| m.served_by.as_str()).collect();
        let served = served.into_iter().collect::<Vec<_>>().join(", ");
        let caption = if served == *backend {
            served
        } else {
            format!("{backend} ({served})")
        };
        let mut chart = ChartBuilder::on(panel)
            .caption(caption, ("sans-serif", 15))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(52)
            .build_cartesian_2d(lx_lo..lx_hi, 0.0..y_hi)?;
        let ticks: Vec<f64> = xs.iter().map(|&v| (v as f64).log2()).collect();
        chart
            .configure_mesh()
            .x_desc(if x_is_bs { "block size" } else { "queue depth" })
            .y_desc("GB/s")
            .light_line_style(WHITE)
            .x_labels(ticks.len() * 2 + 1)
            .x_label_formatter(&|lx| {
                // Label only the measured values.
                match ticks.iter().position(|t| (t - lx).abs() < 1e-6) {
                    Some(i) => label_x(*xs.iter().nth(i).unwrap_or(&0)),
                    None => String::new(),
                }
            })
            .draw()?;
        for (i, &s) in series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let mut pts: Vec<(f64, f64)> = here
                .iter()
                .filter(|m| series_of(m) == s)
                .map(|m| ((x_of(m) as f64).log2(), m.gbps))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                .label(label_series(s))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .draw()?;
    }
    root.present()?;
    Ok(())
}
