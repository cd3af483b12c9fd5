//! PNG plots of a report: server CPU against QD1 latency per target, and per
//! job the figure of merit and the server CPU per target.
//!
//! Text needs a TrueType font (plotters' `ab_glyph` backend has none built
//! in). The first font found at [`FONT_PATHS`] (Debian: `fonts-dejavu-core`)
//! is registered; without one the plots are drawn without any text, so
//! nothing here depends on a font being installed.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;

use crate::fio::{JobKind, Primary};
use crate::report::{JobResult, Report};

/// Fonts tried in order, by distribution layout.
pub const FONT_PATHS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

const FONT: &str = "sans-serif";
const SIZE_PX: (u32, u32) = (1100, 520);

/// Registers a font once per process; `true` if text can be drawn.
pub fn font_available() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| {
        for p in FONT_PATHS {
            if let Ok(bytes) = std::fs::read(p) {
                // plotters keeps fonts for the life of the process; one
                // leak of a few hundred KiB per run.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        tracing::warn!("no TrueType font found (install fonts-dejavu-core); plots have no text");
        false
    })
}

#[derive(Debug, thiserror::Error)]
#[error("plot {file}: {message}")]
pub struct PlotError {
    pub file: String,
    pub message: String,
}

fn err(file: &str) -> impl Fn(String) -> PlotError + '_ {
    move |message| PlotError {
        file: file.into(),
        message,
    }
}

/// Writes every plot the report has data for into `dir`; returns the file
/// names written. `text` draws labels (needs [`font_available`]).
pub fn write_plots(report: &Report, dir: &Path, text: bool) -> Result<Vec<String>, PlotError> {
    let mut written = Vec::new();
    let name = "cpu_vs_latency.png";
    if cpu_vs_latency(report, &dir.join(name), text).map_err(err(name))? {
        written.push(name.to_string());
    }
    for &job in &report.settings.jobs {
        let name = format!("job_{}.png", job.as_str());
        if job_plot(report, job, &dir.join(&name), text).map_err(err(&name))? {
            written.push(name);
        }
    }
    Ok(written)
}

fn color(i: usize, peer: bool) -> RGBColor {
    const LULL: [RGBColor; 6] = [
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(23, 190, 207),
        RGBColor(188, 189, 34),
        RGBColor(140, 86, 75),
    ];
    const PEER: [RGBColor; 3] = [
        RGBColor(255, 127, 14),
        RGBColor(214, 39, 40),
        RGBColor(127, 127, 127),
    ];
    if peer {
        PEER[i % PEER.len()]
    } else {
        LULL[i % LULL.len()]
    }
}

fn cells_for(report: &Report, job: JobKind) -> Vec<(usize, &JobResult)> {
    report
        .targets
        .iter()
        .enumerate()
        .filter_map(|(i, t)| {
            report
                .results
                .iter()
                .find(|c| c.job == job && c.target == t.name && c.runs_ok > 0)
                .map(|c| (i, c))
        })
        .collect()
}

/// Server CPU % (y) against QD1 mean latency µs (x), one point per target and
/// QD1 job. `Ok(false)` when no QD1 job has data.
fn cpu_vs_latency(report: &Report, path: &Path, text: bool) -> Result<bool, String> {
    let mut points = Vec::new(); // (target index, job, lat µs, cpu %)
    for &job in report
        .settings
        .jobs
        .iter()
        .filter(|j| j.primary() == Primary::Latency)
    {
        for (i, c) in cells_for(report, job) {
            if let (Some(l), Some(cpu)) = (c.lat_mean_us, c.cpu_pct) {
                points.push((i, job, l.median, cpu.median));
            }
        }
    }
    if points.is_empty() {
        return Ok(false);
    }
    let x_max = points.iter().map(|p| p.2).fold(1.0, f64::max) * 1.25;
    let y_max = points.iter().map(|p| p.3).fold(10.0, f64::max) * 1.15;
    let root = BitMapBackend::new(path, SIZE_PX).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut b = ChartBuilder::on(&root);
    b.margin(15)
        .x_label_area_size(if text { 45 } else { 5 })
        .y_label_area_size(if text { 60 } else { 5 });
    if text {
        b.caption(
            "server CPU vs QD1 latency (o randread, ^ randwrite)",
            (FONT, 22),
        );
    }
    let mut chart = b
        .build_cartesian_2d(0f64..x_max, 0f64..y_max)
        .map_err(|e| e.to_string())?;
    // Without a font there is no mesh at all: plotters' label code would
    // need one even for zero labels.
    if text {
        chart
            .configure_mesh()
            .x_desc("mean latency, µs")
            .y_desc("server CPU, %")
            .label_style((FONT, 14))
            .axis_desc_style((FONT, 15))
            .draw()
            .map_err(|e| e.to_string())?;
    }
    for &(i, job, x, y) in &points {
        let t = &report.targets[i];
        let c = color(i, t.is_peer);
        let style = c.filled();
        if job == JobKind::RandreadLat {
            chart
                .draw_series(std::iter::once(Circle::new((x, y), 6, style)))
                .map_err(|e| e.to_string())?;
        } else {
            chart
                .draw_series(std::iter::once(TriangleMarker::new((x, y), 7, style)))
                .map_err(|e| e.to_string())?;
        }
        if text {
            // Offset in pixels so the name does not cover the marker.
            let label = EmptyElement::at((x, y))
                + Text::new(t.name.clone(), (9, -16), (FONT, 13).into_font().color(&c));
            chart
                .draw_series(std::iter::once(label))
                .map_err(|e| e.to_string())?;
        }
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(true)
}

/// Two panels: the job's figure of merit and the server CPU %, one
/// horizontal bar per target, min–max whiskers when repeated.
fn job_plot(report: &Report, job: JobKind, path: &Path, text: bool) -> Result<bool, String> {
    let cells = cells_for(report, job);
    if cells.is_empty() {
        return Ok(false);
    }
    let (merit_name, merit): (&str, fn(&JobResult) -> Option<crate::report::stats::Spread>) =
        match job.primary() {
            Primary::Iops => ("IOPS", |c| c.iops),
            Primary::Bandwidth => ("MiB/s", |c| {
                c.bw_bytes_per_sec.map(|s| crate::report::stats::Spread {
                    median: s.median / 1048576.0,
                    min: s.min / 1048576.0,
                    max: s.max / 1048576.0,
                    n: s.n,
                })
            }),
            Primary::Latency => ("mean latency, µs", |c| c.lat_mean_us),
        };
    let root = BitMapBackend::new(path, SIZE_PX).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = if text {
        root.titled(job.as_str(), (FONT, 22))
            .map_err(|e| e.to_string())?
    } else {
        root
    };
    let panels = root.split_evenly((1, 2));
    let n = cells.len() as u32;
    let top = n.saturating_sub(1).max(1);
    let names: Vec<String> = cells
        .iter()
        .map(|(i, _)| report.targets[*i].name.clone())
        .collect();
    let cpu = |c: &JobResult| c.cpu_pct;
    for (panel, (desc, value)) in panels.iter().zip([
        (merit_name, merit),
        ("server CPU, %", cpu as fn(&JobResult) -> _),
    ]) {
        let vals: Vec<Option<crate::report::stats::Spread>> =
            cells.iter().map(|(_, c)| value(c)).collect();
        let x_max = vals.iter().flatten().map(|s| s.max).fold(1e-9, f64::max) * 1.1;
        let mut b = ChartBuilder::on(panel);
        b.margin(12)
            .x_label_area_size(if text { 40 } else { 5 })
            .y_label_area_size(if text { 175 } else { 5 });
        let mut chart = b
            // plotters' integer ranges are inclusive: 0..=top is top+1
            // segments. One target still gets two (one left empty).
            .build_cartesian_2d(0f64..x_max, (0u32..top).into_segmented())
            .map_err(|e| e.to_string())?;
        if text {
            let mut mesh = chart.configure_mesh();
            mesh.disable_y_mesh();
            // Row `top - k` holds target k, so the first target is on top.
            let label = |v: &SegmentValue<u32>| match v {
                SegmentValue::CenterOf(row) => top
                    .checked_sub(*row)
                    .and_then(|k| names.get(k as usize))
                    .cloned()
                    .unwrap_or_default(),
                _ => String::new(),
            };
            let x_label = |v: &f64| crate::report::render::si(*v);
            mesh.x_desc(desc)
                .y_labels(n as usize)
                .y_label_formatter(&label)
                .x_labels(6)
                .x_label_formatter(&x_label)
                .label_style((FONT, 13))
                .axis_desc_style((FONT, 14));
            mesh.draw().map_err(|e| e.to_string())?;
        }
        for (k, ((i, _), v)) in cells.iter().zip(&vals).enumerate() {
            let Some(v) = v else { continue };
            let k = top - k as u32;
            let c = color(*i, report.targets[*i].is_peer);
            let bar = Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(k)),
                    (v.median, SegmentValue::Exact(k + 1)),
                ],
                c.mix(0.8).filled(),
            );
            chart
                .draw_series(std::iter::once(bar))
                .map_err(|e| e.to_string())?;
            if v.n > 1 {
                let whisker = PathElement::new(
                    vec![
                        (v.min, SegmentValue::CenterOf(k)),
                        (v.max, SegmentValue::CenterOf(k)),
                    ],
                    BLACK.stroke_width(2),
                );
                chart
                    .draw_series(std::iter::once(whisker))
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::fake_report;

    fn check_pngs(dir: &Path, files: &[String]) {
        for f in files {
            let bytes = std::fs::read(dir.join(f)).unwrap();
            assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{f} is not a PNG");
        }
    }

    #[test]
    fn plots_with_and_without_text() {
        let dir = std::env::temp_dir().join(format!("lull-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let report = fake_report(3);
        // Without text: never needs a font.
        let files = write_plots(&report, &dir, false).unwrap();
        assert_eq!(
            files,
            [
                "cpu_vs_latency.png",
                "job_randread-iops.png",
                "job_randread-lat.png"
            ]
        );
        check_pngs(&dir, &files);
        // With text only where a font is installed.
        if font_available() {
            let files = write_plots(&report, &dir, true).unwrap();
            check_pngs(&dir, &files);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
