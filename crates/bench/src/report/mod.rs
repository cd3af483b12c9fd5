//! The report of one `lull bench` run: the data model (this module,
//! written as report.json), [`analysis`] (raw samples to per-cell medians,
//! ratios and summaries, over the statistics in [`stats`]) and [`render`]
//! (report.md). Everything here is pure data in, data out; the machine
//! facts come from [`crate::env`].
//!
//! # Layout
//!
//! - `analysis`: raw samples to the report's numbers (medians, spreads, ratios).
//! - `stats`: median and spread over repeats, per-run derived metrics.
//! - `render`: report.md, the markdown rendering.

pub mod analysis;
pub mod render;
pub mod stats;

use serde::Serialize;

use lull_reactor::Mode;

use crate::config::{Settings, VolumeKind};
pub use crate::env::Environment;
use crate::fio::{FioMetrics, JobKind};
use crate::plan::Target;
use stats::{CellMedians, Ratio, ServerCost, Spread};

/// Everything one `lull bench` run measured; written as report.json.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub environment: Environment,
    pub settings: Settings,
    pub targets: Vec<TargetReport>,
    /// Medians over repeats, one per (job, target) in job-major order.
    pub results: Vec<JobResult>,
    /// One row per target (lull first, then peers): idle CPU and the
    /// randread-lat / randread-iops medians side by side.
    pub modes_summary: Vec<ModeSummaryRow>,
    /// adaptive ÷ poll per volume kind where both ran.
    pub adaptive_vs_poll: Vec<AdaptiveVsPoll>,
    /// Every fio run, in run order.
    pub samples: Vec<Sample>,
    /// PNG files written beside the report.
    pub plots: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct TargetReport {
    pub name: String,
    pub target: Target,
    pub is_peer: bool,
    /// How the server is started (first start), for the record.
    pub command: Option<String>,
    pub status: TargetStatus,
    pub idle_cpu_pct_samples: Vec<f64>,
    pub idle_cpu_pct: Option<Spread>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum TargetStatus {
    Ok,
    Skipped { reason: String },
}

/// One fio run against one server.
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    pub repeat: u32,
    pub job: JobKind,
    pub target: String,
    pub fio: Option<FioMetrics>,
    pub server: Option<ServerCost>,
    /// Why the run produced no numbers.
    pub error: Option<String>,
}

/// Medians and spreads of one (job, target) cell.
#[derive(Clone, Debug, Serialize)]
pub struct JobResult {
    pub job: JobKind,
    pub target: String,
    pub runs_ok: usize,
    pub failures: Vec<String>,
    pub iops: Option<Spread>,
    pub bw_bytes_per_sec: Option<Spread>,
    pub lat_mean_us: Option<Spread>,
    pub lat_p50_us: Option<Spread>,
    pub lat_p99_us: Option<Spread>,
    pub cpu_pct: Option<Spread>,
    pub cpu_us_per_io: Option<Spread>,
    pub ctxt_switches_per_io: Option<Spread>,
    pub faults_per_io: Option<Spread>,
    /// lull only: the server's `io_uring_enter` calls per I/O.
    pub io_uring_enters_per_io: Option<Spread>,
    /// Against lull's poll mode (same volume kind when measured).
    pub vs_poll: Option<Ratio>,
    /// Against the peer with the best figure of merit for this job.
    pub vs_best_peer: Option<Ratio>,
}

impl JobResult {
    pub(crate) fn medians(&self) -> Option<CellMedians> {
        Some(CellMedians {
            iops: self.iops?.median,
            bw_bytes_per_sec: self.bw_bytes_per_sec?.median,
            lat_mean_us: self.lat_mean_us?.median,
            cpu_us_per_io: self.cpu_us_per_io.map(|s| s.median).unwrap_or(f64::NAN),
        })
    }
}

/// One row of the modes summary: a target's idle CPU and its randread
/// medians over repeats. `None` when the job was not run, the target was
/// skipped, or every run of it failed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModeSummaryRow {
    pub target: String,
    pub is_peer: bool,
    pub skipped: bool,
    /// lull only.
    pub mode: Option<Mode>,
    /// lull only.
    pub volume: Option<VolumeKind>,
    /// lull's hybrid mode only.
    pub hybrid_period_us: Option<u32>,
    pub idle_cpu_pct: Option<f64>,
    /// randread-lat: 4 KiB random read at QD1.
    pub qd1_randread_lat_mean_us: Option<f64>,
    pub qd1_randread_lat_p99_us: Option<f64>,
    /// randread-iops: 4 KiB random read at QD64.
    pub qd64_randread_iops: Option<f64>,
    pub cpu_us_per_io_qd1: Option<f64>,
    pub cpu_us_per_io_qd64: Option<f64>,
}

/// lull's adaptive mode against its poll mode on one volume kind. The
/// ratios are adaptive ÷ poll of the medians; `None` when either side has
/// no number.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AdaptiveVsPoll {
    pub volume: VolumeKind,
    pub adaptive: String,
    pub poll: String,
    /// Below 1: adaptive answers faster at QD1.
    pub qd1_lat_mean: Option<f64>,
    /// Below 1: adaptive does fewer IOPS at QD64.
    pub qd64_iops: Option<f64>,
    /// Below 1: adaptive spends less CPU per I/O at QD1.
    pub cpu_us_per_io_qd1: Option<f64>,
    /// Idle CPU % of the adaptive server (not a ratio: poll's is ~100 %).
    pub adaptive_idle_cpu_pct: Option<f64>,
    /// The same three ratios taken per repeat (adaptive and poll of the
    /// same repeat, which ran minutes apart at most), then their median and
    /// range: on a machine whose speed drifts between repeats this is the
    /// steadier comparison.
    pub paired_qd1_lat_mean: Option<PairedRatio>,
    pub paired_qd64_iops: Option<PairedRatio>,
    pub paired_cpu_us_per_io_qd1: Option<PairedRatio>,
}

/// Ratios of adaptive to poll taken repeat by repeat.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PairedRatio {
    /// Median, range and count of the per-repeat ratios.
    pub spread: Spread,
    /// Repeats in which adaptive did better (lower latency or CPU, more
    /// IOPS) than poll.
    pub adaptive_better: usize,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::analysis::{adaptive_vs_poll, aggregate, modes_summary};
    use super::render::render_markdown;
    use super::*;
    use crate::config::Settings;
    use crate::env::procstat::ProcCounters;
    use crate::env::rfc3339_utc;
    use crate::env::uring_enters::UringEnters;
    use std::collections::BTreeMap;

    pub(crate) fn settings(jobs: Vec<JobKind>, repeat: u32) -> Settings {
        Settings {
            jobs,
            hybrid_periods_us: vec![100],
            runtime_secs: 1,
            ramp_secs: 0.5,
            idle_secs: 1.0,
            repeat,
            size_bytes: 256 << 20,
            server_cpu: 1,
            client_cpu: 0,
            port_base: 20900,
            quick: true,
        }
    }

    fn tr(target: Target, status: TargetStatus) -> TargetReport {
        TargetReport {
            name: target.name(),
            target,
            is_peer: target.is_peer(),
            command: Some("x --y".into()),
            status,
            idle_cpu_pct: stats::spread(&[1.0]),
            idle_cpu_pct_samples: vec![1.0],
        }
    }

    pub(crate) fn sample(
        repeat: u32,
        job: JobKind,
        target: &Target,
        iops: f64,
        lat_us: f64,
        cpu_ticks: u64,
    ) -> Sample {
        let fio = FioMetrics {
            iops,
            bw_bytes_per_sec: iops * 4096.0,
            ios: iops as u64,
            lat_mean_ns: lat_us * 1e3,
            lat_p50_ns: Some(lat_us * 900.0),
            lat_p99_ns: Some(lat_us * 2e3),
        };
        let delta = ProcCounters {
            utime_ticks: cpu_ticks,
            voluntary_ctxt_switches: iops as u64 / 2,
            ..Default::default()
        };
        let mut server = ServerCost::new(delta, 1.0, 100, fio.ios);
        if !target.is_peer() {
            // Only lull servers answer over RPC; peers keep `None`.
            let enters = UringEnters {
                reactors: fio.ios / 4,
                volume: None,
            };
            server = server.with_uring_enters(enters, fio.ios);
        }
        Sample {
            repeat,
            job,
            target: target.name(),
            fio: Some(fio),
            server: Some(server),
            error: None,
        }
    }

    /// A small report: poll, adaptive, a skipped interrupt, and nbdkit.
    pub(crate) fn fake_report(repeat: u32) -> Report {
        let poll = Target::lull(Mode::Poll, VolumeKind::Malloc, None);
        let adaptive = Target::lull(Mode::Adaptive, VolumeKind::Malloc, None);
        let interrupt = Target::lull(Mode::Interrupt, VolumeKind::Malloc, None);
        let targets = vec![
            tr(poll, TargetStatus::Ok),
            tr(
                interrupt,
                TargetStatus::Skipped {
                    reason: "error: unknown mode | interrupt".into(),
                },
            ),
            tr(adaptive, TargetStatus::Ok),
            tr(Target::Nbdkit, TargetStatus::Ok),
        ];
        let jobs = vec![JobKind::RandreadIops, JobKind::RandreadLat];
        let mut samples = Vec::new();
        for r in 0..repeat {
            let k = 1.0 + r as f64 * 0.1;
            samples.push(sample(r, jobs[0], &poll, 100_000.0 * k, 600.0, 100));
            samples.push(sample(r, jobs[0], &adaptive, 90_000.0 * k, 700.0, 60));
            samples.push(sample(
                r,
                jobs[0],
                &Target::Nbdkit,
                50_000.0 * k,
                1200.0,
                90,
            ));
            samples.push(sample(r, jobs[1], &poll, 20_000.0, 50.0 / k, 100));
            samples.push(sample(r, jobs[1], &adaptive, 18_000.0, 55.0 / k, 40));
            samples.push(Sample {
                repeat: r,
                job: jobs[1],
                target: Target::Nbdkit.name(),
                fio: None,
                server: None,
                error: Some("fio: connection refused".into()),
            });
        }
        let results = aggregate(&jobs, &targets, &samples);
        let modes_summary = modes_summary(&jobs, &targets, &results);
        let adaptive_vs_poll = adaptive_vs_poll(&modes_summary, &samples);
        Report {
            environment: Environment {
                date_utc: rfc3339_utc(0),
                nproc: 2,
                cpu_model: "Test CPU".into(),
                kernel: "6.1.0".into(),
                command: "lull bench --quick".into(),
                clk_tck: 100,
                tools: BTreeMap::from([("fio".into(), "fio-3.33".into())]),
            },
            settings: settings(jobs, repeat),
            targets,
            results,
            modes_summary,
            adaptive_vs_poll,
            samples,
            plots: vec!["cpu_vs_latency.png".into()],
        }
    }

    #[test]
    fn markdown_has_every_target_and_job() {
        let r = fake_report(2);
        let md = render_markdown(&r);
        for needle in [
            "lull-poll-malloc",
            "lull-adaptive-malloc",
            "skipped: error: unknown mode \\| interrupt",
            "failed: fio: connection refused",
            "randread-iops — 4 KiB random read, QD64",
            "randread-lat — 4 KiB random read, QD1",
            "`lull bench --quick`",
            "Test CPU",
            "![cpu_vs_latency.png](cpu_vs_latency.png)",
            "0.900×",
        ] {
            assert!(md.contains(needle), "missing {needle:?} in\n{md}");
        }
        // Every table row has the same number of cells as its header.
        for table_line in md
            .lines()
            .filter(|l| l.starts_with("| lull") || l.starts_with("| nbdkit"))
        {
            let cells = table_line.replace("\\|", "").matches('|').count();
            // 8: the modes summary.
            assert!(
                cells == 5 || cells == 8 || cells == 16,
                "{cells} in {table_line}"
            );
        }
        // io_uring_enter calls per I/O: lull's from its RPC counts, "–"
        // for the peer.
        let header = md
            .lines()
            .find(|l| l.starts_with("| target | IOPS |"))
            .unwrap();
        let col = header
            .split('|')
            .position(|c| c.trim() == "uring enters/IO")
            .expect("uring enters/IO column");
        let cell_of = |target: &str| {
            let row = md
                .lines()
                .find(|l| l.starts_with(&format!("| {target} | ")) && l.matches('|').count() == 16)
                .unwrap();
            row.split('|').nth(col).unwrap().trim().to_string()
        };
        assert_eq!(cell_of("lull-poll-malloc"), "0.250");
        assert_eq!(cell_of("nbdkit-memory"), "–");
        // JSON round-trips through serde_json::Value, NaN as null.
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(v["results"].as_array().unwrap().len(), 8);
        assert_eq!(v["targets"][1]["status"]["state"], "skipped");
    }

    /// The summary section of `md`: from its heading to the next one.
    fn summary_section(md: &str) -> &str {
        let start = md.find("## Modes summary").expect("no modes summary");
        let end = md[start + 3..]
            .find("\n## ")
            .map_or(md.len(), |e| start + 3 + e);
        &md[start..end]
    }

    #[test]
    fn modes_summary_from_recorded_report() {
        let r = fake_report(2);
        let names: Vec<&str> = r.modes_summary.iter().map(|m| m.target.as_str()).collect();
        assert_eq!(
            names,
            [
                "lull-poll-malloc",
                "lull-interrupt-malloc",
                "lull-adaptive-malloc",
                "nbdkit-memory"
            ]
        );
        let poll = &r.modes_summary[0];
        assert_eq!(poll.mode, Some(Mode::Poll));
        assert_eq!(poll.idle_cpu_pct, Some(1.0));
        assert!((poll.qd64_randread_iops.unwrap() - 105_000.0).abs() < 1e-6);
        // Medians over the two repeats: 50 and 50/1.1 µs.
        assert!((poll.qd1_randread_lat_mean_us.unwrap() - 47.727_272).abs() < 1e-3);
        assert!((poll.cpu_us_per_io_qd1.unwrap() - 50.0).abs() < 1e-9);
        assert!(r.modes_summary[1].skipped && r.modes_summary[1].qd64_randread_iops.is_none());
        let peer = &r.modes_summary[3];
        assert!(peer.is_peer && peer.mode.is_none() && peer.qd1_randread_lat_mean_us.is_none());

        assert_eq!(r.adaptive_vs_poll.len(), 1);
        let a = &r.adaptive_vs_poll[0];
        assert_eq!(
            (a.volume, a.adaptive.as_str()),
            (VolumeKind::Malloc, "lull-adaptive-malloc")
        );
        assert!((a.qd1_lat_mean.unwrap() - 1.1).abs() < 1e-9);
        assert!((a.qd64_iops.unwrap() - 0.9).abs() < 1e-9);
        assert!((a.cpu_us_per_io_qd1.unwrap() - 0.4 / 0.9).abs() < 1e-9);
        assert_eq!(a.adaptive_idle_cpu_pct, Some(1.0));
        let paired = a.paired_qd64_iops.unwrap();
        assert_eq!((paired.spread.n, paired.adaptive_better), (2, 0));
        assert!((paired.spread.median - 0.9).abs() < 1e-9);

        let md = render_markdown(&r);
        assert!(
            md.contains(
                "- QD64 IOPS: median 0.900× (range 0.900–0.900×; adaptive better in 0 of 2)"
            ),
            "{md}"
        );
        let sec = summary_section(&md);
        assert!(md.find("## Modes summary") < md.find("## Results"));
        let header = "| target | idle CPU % | QD1 4k randread mean µs | QD1 4k randread p99 µs | QD64 4k randread IOPS | CPU-µs/IO at QD1 | CPU-µs/IO at QD64 |";
        assert!(sec.contains(header), "{sec}");
        for row in [
            "| lull-poll-malloc | 1.00 | 47.7 | 95.5 | 105k | 50.0 | 9.55 |",
            "| lull-interrupt-malloc (skipped) | 1.00 | – | – | – | – | – |",
            "| lull-adaptive-malloc | 1.00 | 52.5 | 105 | 94.5k | 22.2 | 6.36 |",
            "| nbdkit-memory | 1.00 | – | – | 52.5k | – | 17.2 |",
            "adaptive/poll (malloc): QD1 mean latency 1.10×, QD64 IOPS 0.900×, CPU-µs/IO at QD1 0.444×; idle CPU of adaptive 1.00 %",
        ] {
            assert!(sec.contains(row), "missing {row:?} in\n{sec}");
        }
        let rows: Vec<&str> = sec.lines().filter(|l| l.starts_with("| ")).collect();
        assert_eq!(rows.len(), 1 + 4);
        assert!(rows.iter().all(|l| l.matches('|').count() == 8), "{sec}");

        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        let ms = v["modes_summary"].as_array().unwrap();
        assert_eq!(ms.len(), 4);
        assert_eq!(ms[0]["target"], "lull-poll-malloc");
        assert_eq!(ms[0]["mode"], "poll");
        assert_eq!(ms[0]["qd64_randread_iops"], 105_000.0);
        assert!(ms[3]["qd1_randread_lat_mean_us"].is_null());
        assert_eq!(v["adaptive_vs_poll"][0]["volume"], "malloc");
    }

    #[test]
    fn modes_summary_blank_when_job_not_run() {
        let mut r = fake_report(1);
        // Keep only the QD64 job, as `--jobs randread-iops` would.
        r.settings.jobs = vec![JobKind::RandreadIops];
        r.results.retain(|c| c.job == JobKind::RandreadIops);
        r.samples.retain(|c| c.job == JobKind::RandreadIops);
        r.modes_summary = modes_summary(&r.settings.jobs, &r.targets, &r.results);
        r.adaptive_vs_poll = adaptive_vs_poll(&r.modes_summary, &r.samples);
        assert!(r.modes_summary[0].qd1_randread_lat_mean_us.is_none());
        let md = render_markdown(&r);
        let sec = summary_section(&md);
        assert!(
            sec.contains("| lull-poll-malloc | 1.00 |  |  | 100k |  | 10.0 |"),
            "{sec}"
        );
        assert!(
            sec.contains("QD1 mean latency –, QD64 IOPS 0.900×"),
            "{sec}"
        );

        // No adaptive target (or a skipped one) → no ratio line.
        r.targets[2].status = TargetStatus::Skipped {
            reason: "nope".into(),
        };
        r.modes_summary = modes_summary(&r.settings.jobs, &r.targets, &r.results);
        r.adaptive_vs_poll = adaptive_vs_poll(&r.modes_summary, &r.samples);
        assert!(r.adaptive_vs_poll.is_empty());
        assert!(!render_markdown(&r).contains("adaptive/poll"));
    }

    /// report.md and report.json of a fixed report, byte for byte, so that
    /// the rendering does not change by accident (`LULL_BLESS=1` rewrites
    /// the files after a change meant to show).
    #[test]
    fn golden_report() {
        let r = fake_report(3);
        let md = render_markdown(&r);
        let json = serde_json::to_string_pretty(&r).unwrap();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
        for (file, text) in [("report_golden.md", &md), ("report_golden.json", &json)] {
            let path = dir.join(file);
            if std::env::var_os("LULL_BLESS").is_some() {
                std::fs::write(&path, text).unwrap();
            }
            let want = std::fs::read_to_string(&path).unwrap();
            assert!(
                want == *text,
                "{} differs from the rendering:\n{text}",
                path.display()
            );
        }
    }
}
