//! The report of a `lull bench --profile nvmf` run: report.json (the
//! [`NvmfReport`]) and report.md (tables of medians with min–max spreads).
//! Pure data in, data out, apart from [`environment`] and [`write`].

use std::path::Path;

use serde::Serialize;

use super::perf::{NvmfJob, PerfMetrics};
use super::NvmfTarget;
use crate::report::stats::{spread, Spread};
use crate::report::Environment;
use crate::{io_err, BenchError};

/// Everything one NVMe/TCP run measured.
#[derive(Clone, Debug, Serialize)]
pub struct NvmfReport {
    pub profile: &'static str,
    pub environment: Environment,
    pub settings: NvmfSettings,
    pub targets: Vec<NvmfTargetReport>,
    /// Medians over repeats, job-major.
    pub results: Vec<NvmfResult>,
    /// Every perf run, in run order.
    pub samples: Vec<NvmfSample>,
}

/// The settings the run used, resolved.
#[derive(Clone, Debug, Serialize)]
pub struct NvmfSettings {
    pub jobs: Vec<NvmfJob>,
    /// perf `-t`.
    pub runtime_secs: u64,
    /// perf `-a`: `--ramp-secs` rounded up to whole seconds.
    pub warmup_secs: u64,
    pub idle_secs: f64,
    pub repeat: u32,
    pub size_bytes: u64,
    pub server_cpu: usize,
    pub client_cpu: usize,
    /// perf's `-s` (DPDK memory without hugepages), MiB.
    pub perf_mem_mb: u32,
    /// nvmf_tgt's `-s`, MiB.
    pub tgt_mem_mb: u64,
    pub quick: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct NvmfTargetReport {
    pub name: String,
    pub target: NvmfTarget,
    /// How the server was started (first start), for the record.
    pub command: Option<String>,
    /// Why the target was not measured at all.
    pub skipped: Option<String>,
    pub idle_cpu_pct_samples: Vec<f64>,
    pub idle_cpu_pct: Option<Spread>,
}

/// The server's CPU over a window inside perf's measured run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CpuWindow {
    pub window_secs: f64,
    /// Sum of the run time of the server's threads (schedstat), ns.
    pub cpu_ns: u64,
    pub cpu_pct: f64,
    /// CPU µs over (perf's IOPS × the window); NaN (JSON null) without I/O.
    pub cpu_us_per_io: f64,
}

impl CpuWindow {
    pub fn new(cpu_ns: u64, window_secs: f64, iops: f64) -> CpuWindow {
        let cpu_secs = cpu_ns as f64 / 1e9;
        let (cpu_pct, cpu_us_per_io) = if window_secs > 0.0 {
            let ios = iops * window_secs;
            let per_io = if ios > 0.0 {
                cpu_secs * 1e6 / ios
            } else {
                f64::NAN
            };
            (cpu_secs / window_secs * 100.0, per_io)
        } else {
            (f64::NAN, f64::NAN)
        };
        CpuWindow {
            window_secs,
            cpu_ns,
            cpu_pct,
            cpu_us_per_io,
        }
    }
}

/// One perf run against one target.
#[derive(Clone, Debug, Serialize)]
pub struct NvmfSample {
    pub repeat: u32,
    pub job: NvmfJob,
    pub target: String,
    pub perf: Option<PerfMetrics>,
    pub server: Option<CpuWindow>,
    /// Why the run produced no numbers.
    pub error: Option<String>,
}

/// Medians and spreads of one (job, target) cell.
#[derive(Clone, Debug, Serialize)]
pub struct NvmfResult {
    pub job: NvmfJob,
    pub target: String,
    pub runs_ok: usize,
    pub failures: Vec<String>,
    pub iops: Option<Spread>,
    pub mib_per_sec: Option<Spread>,
    pub lat_mean_us: Option<Spread>,
    pub lat_p99_us: Option<Spread>,
    pub cpu_pct: Option<Spread>,
    pub cpu_us_per_io: Option<Spread>,
    /// IOPS ÷ spdk-poll's IOPS, taken within each repeat (the two ran
    /// minutes apart at most), then median and range.
    pub iops_vs_spdk_poll: Option<Spread>,
}

/// The spdk-poll target's name, the baseline of the ratios.
pub const BASELINE: &str = "spdk-poll";

/// Aggregates the samples into a report.
pub fn build(
    environment: Environment,
    settings: NvmfSettings,
    mut targets: Vec<NvmfTargetReport>,
    samples: Vec<NvmfSample>,
) -> NvmfReport {
    for t in &mut targets {
        t.idle_cpu_pct = spread(&t.idle_cpu_pct_samples);
    }
    let mut results = Vec::new();
    for &job in &settings.jobs {
        for t in &targets {
            let cell: Vec<&NvmfSample> = samples
                .iter()
                .filter(|s| s.job == job && s.target == t.name)
                .collect();
            let ok: Vec<(&PerfMetrics, &CpuWindow)> = cell
                .iter()
                .filter_map(|s| Some((s.perf.as_ref()?, s.server.as_ref()?)))
                .collect();
            let of = |f: &dyn Fn(&PerfMetrics, &CpuWindow) -> Option<f64>| {
                spread(&ok.iter().filter_map(|(p, c)| f(p, c)).collect::<Vec<_>>())
            };
            let ratios: Vec<f64> = cell
                .iter()
                .filter_map(|s| {
                    let mine = s.perf.as_ref()?.iops;
                    let base = samples
                        .iter()
                        .find(|b| b.job == job && b.repeat == s.repeat && b.target == BASELINE)?
                        .perf
                        .as_ref()?
                        .iops;
                    Some(mine / base)
                })
                .collect();
            results.push(NvmfResult {
                job,
                target: t.name.clone(),
                runs_ok: ok.len(),
                failures: cell.iter().filter_map(|s| s.error.clone()).collect(),
                iops: of(&|p, _| Some(p.iops)),
                mib_per_sec: of(&|p, _| Some(p.mib_per_sec)),
                lat_mean_us: of(&|p, _| Some(p.lat_mean_us)),
                lat_p99_us: of(&|p, _| p.lat_p99_us),
                cpu_pct: of(&|_, c| Some(c.cpu_pct)),
                cpu_us_per_io: of(&|_, c| Some(c.cpu_us_per_io)),
                iops_vs_spdk_poll: if t.name == BASELINE {
                    None
                } else {
                    spread(&ratios)
                },
            });
        }
    }
    NvmfReport {
        profile: "nvmf",
        environment,
        settings,
        targets,
        results,
        samples,
    }
}

/// The machine and the run, with the SPDK build in place of fio.
pub fn environment(tools: &Path) -> Environment {
    let mut env = crate::env::environment(&[]);
    env.tools.clear();
    let version = std::fs::read_to_string(tools.join("VERSION.txt"))
        .ok()
        .and_then(|v| {
            v.lines()
                .find(|l| l.starts_with("SPDK:"))
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_else(|| "unknown (no VERSION.txt)".into());
    env.tools.insert("spdk".into(), version);
    env
}

/// Writes report.json and report.md into `dir`.
pub fn write(report: &NvmfReport, dir: &Path) -> Result<(), BenchError> {
    let json = serde_json::to_string_pretty(report)?;
    let path = dir.join("report.json");
    std::fs::write(&path, json + "\n").map_err(io_err(format!("writing {}", path.display())))?;
    let path = dir.join("report.md");
    std::fs::write(&path, render_markdown(report))
        .map_err(io_err(format!("writing {}", path.display())))?;
    Ok(())
}

fn cell(s: &Option<Spread>, digits: usize) -> String {
    match s {
        Some(s) if s.n > 1 => format!("{:.d$} ({:.d$}–{:.d$})", s.median, s.min, s.max, d = digits),
        Some(s) => format!("{:.d$}", s.median, d = digits),
        None => "–".into(),
    }
}

/// report.md.
pub fn render_markdown(r: &NvmfReport) -> String {
    let s = &r.settings;
    let e = &r.environment;
    let mut md = String::new();
    md.push_str("# lull bench --profile nvmf: NVMe/TCP, spdk_nvme_perf\n\n");
    md.push_str(&format!(
        "- date: {}\n- machine: {} cores, {}, kernel {}\n- command: `{}`\n",
        e.date_utc, e.nproc, e.cpu_model, e.kernel, e.command
    ));
    for (k, v) in &e.tools {
        md.push_str(&format!("- {k}: {v}\n"));
    }
    md.push_str(&format!(
        "- settings: server on core {}, spdk_nvme_perf on core {}; {} MiB memory volume (nvmf_tgt: bdev_malloc, 4 KiB blocks); \
         perf `-a {}` s warm-up then `-t {}` s measured; {} repeat(s), targets reversed every other repeat; idle window {} s\n\n",
        s.server_cpu,
        s.client_cpu,
        s.size_bytes >> 20,
        s.warmup_secs,
        s.runtime_secs,
        s.repeat,
        s.idle_secs
    ));
    md.push_str(
        "Each cell: median over repeats (min–max when more than one). p99 is perf's `-L` summary \
         (the upper edge of the histogram bucket holding the 99th percentile). Server CPU: run time \
         of the server's threads (schedstat) over a window inside perf's measured run; CPU-µs/IO \
         divides it by perf's IOPS × the window. ×spdk-poll: IOPS ÷ spdk-poll's IOPS of the same \
         repeat, median (min–max).\n\n",
    );
    md.push_str(&render_summary(r));
    md.push_str("## Idle CPU\n\n| target | idle CPU % of a core |\n|---|---|\n");
    for t in &r.targets {
        let v = match &t.skipped {
            Some(why) => format!("skipped: {}", why.replace('|', "\\|")),
            None => cell(&t.idle_cpu_pct, 2),
        };
        md.push_str(&format!("| {} | {v} |\n", t.name));
    }
    for &job in &s.jobs {
        md.push_str(&format!("\n## {} — {}\n\n", job.as_str(), job.describe()));
        md.push_str(
            "| target | IOPS | MiB/s | mean µs | p99 µs | server CPU % | CPU-µs/IO | ×spdk-poll | runs ok |\n\
             |---|---|---|---|---|---|---|---|---|\n",
        );
        for res in r.results.iter().filter(|x| x.job == job) {
            md.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                res.target,
                cell(&res.iops, 0),
                cell(&res.mib_per_sec, 1),
                cell(&res.lat_mean_us, 1),
                cell(&res.lat_p99_us, 1),
                cell(&res.cpu_pct, 1),
                cell(&res.cpu_us_per_io, 2),
                cell(&res.iops_vs_spdk_poll, 3),
                res.runs_ok,
            ));
        }
    }
    let failures: Vec<String> = r
        .samples
        .iter()
        .filter_map(|x| {
            let e = x.error.as_ref()?;
            Some(format!(
                "- repeat {}, {}, {}: {e}\n",
                x.repeat + 1,
                x.job.as_str(),
                x.target
            ))
        })
        .collect();
    if !failures.is_empty() {
        md.push_str("\n## Failed runs\n\n");
        md.extend(failures);
    }
    md.push_str("\n## How each target was started\n\n");
    for t in &r.targets {
        if let Some(c) = &t.command {
            md.push_str(&format!("- {}: `{c}`\n", t.name));
        }
    }
    md
}

/// A median, or `–`.
fn median(s: &Option<Spread>, digits: usize) -> String {
    s.map_or("–".into(), |s| format!("{:.d$}", s.median, d = digits))
}

/// The summary table (the layout of docs/BENCHMARKS.md §6) and issue 16's
/// ratios for lull's adaptive mode.
fn render_summary(r: &NvmfReport) -> String {
    let find = |job: NvmfJob, target: &str| {
        r.results
            .iter()
            .find(|x| x.job == job && x.target == target)
    };
    let mut md = String::from(
        "## Summary (medians)\n\n\
         | target | idle CPU % | QD1 randread IOPS | QD1 randread mean / p99 µs | QD1 randwrite IOPS | \
         QD32 randread IOPS | QD32 randwrite IOPS | 128 KiB read QD32 MiB/s | CPU-µs/IO QD1 randread | \
         CPU-µs/IO QD32 randread |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for t in &r.targets {
        let n = t.name.as_str();
        let get = |job, f: &dyn Fn(&NvmfResult) -> String| find(job, n).map_or("–".into(), f);
        let label = if t.skipped.is_some() {
            format!("{n} (skipped)")
        } else {
            n.to_string()
        };
        md.push_str(&format!(
            "| {label} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            median(&t.idle_cpu_pct, 2),
            get(NvmfJob::RandreadQd1, &|x| median(&x.iops, 0)),
            get(NvmfJob::RandreadQd1, &|x| format!(
                "{} / {}",
                median(&x.lat_mean_us, 1),
                median(&x.lat_p99_us, 1)
            )),
            get(NvmfJob::RandwriteQd1, &|x| median(&x.iops, 0)),
            get(NvmfJob::RandreadQd32, &|x| median(&x.iops, 0)),
            get(NvmfJob::RandwriteQd32, &|x| median(&x.iops, 0)),
            get(NvmfJob::Read128kQd32, &|x| median(&x.mib_per_sec, 1)),
            get(NvmfJob::RandreadQd1, &|x| median(&x.cpu_us_per_io, 2)),
            get(NvmfJob::RandreadQd32, &|x| median(&x.cpu_us_per_io, 2)),
        ));
    }
    md.push('\n');
    let adaptive = "lull-adaptive";
    if r.targets.iter().any(|t| t.name == adaptive) && r.targets.iter().any(|t| t.name == BASELINE)
    {
        md.push_str("Issue 16's targets, lull-adaptive against spdk-poll (IOPS ratio, median of the per-repeat ratios, min–max):\n\n");
        for (job, want) in [
            (NvmfJob::RandreadQd1, "≥ 0.95×"),
            (NvmfJob::RandwriteQd1, "≥ 0.95×"),
            (NvmfJob::RandreadQd32, "≥ 0.9×"),
            (NvmfJob::RandwriteQd32, "≥ 0.9×"),
        ] {
            let ratio = find(job, adaptive).and_then(|x| x.iops_vs_spdk_poll);
            md.push_str(&format!(
                "- {} IOPS: {}× (target {want})\n",
                job.as_str(),
                cell(&ratio, 3)
            ));
        }
        let idle = r
            .targets
            .iter()
            .find(|t| t.name == adaptive)
            .and_then(|t| t.idle_cpu_pct);
        md.push_str(&format!(
            "- idle CPU: {} % of a core (target ≤ 0.5 %)\n\n",
            cell(&idle, 2)
        ));
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::rfc3339_utc;
    use lull_reactor::Mode;
    use std::collections::BTreeMap;

    fn perf(iops: f64, lat: f64) -> PerfMetrics {
        PerfMetrics {
            iops,
            mib_per_sec: iops * 4096.0 / (1 << 20) as f64,
            lat_mean_us: lat,
            lat_min_us: lat / 2.0,
            lat_max_us: lat * 10.0,
            lat_p50_us: Some(lat),
            lat_p99_us: Some(lat * 2.0),
        }
    }

    fn sample(repeat: u32, target: &str, iops: f64, cpu_ns: u64) -> NvmfSample {
        NvmfSample {
            repeat,
            job: NvmfJob::RandreadQd1,
            target: target.into(),
            perf: Some(perf(iops, 1e6 / iops)),
            server: Some(CpuWindow::new(cpu_ns, 1.0, iops)),
            error: None,
        }
    }

    fn fake() -> NvmfReport {
        let target = |t: NvmfTarget, skipped: Option<&str>| NvmfTargetReport {
            name: t.name(),
            target: t,
            command: Some("x".into()),
            skipped: skipped.map(String::from),
            idle_cpu_pct_samples: vec![0.0, 0.02],
            idle_cpu_pct: None,
        };
        let targets = vec![
            target(
                NvmfTarget::Lull {
                    mode: Mode::Adaptive,
                },
                None,
            ),
            target(
                NvmfTarget::Spdk {
                    interrupt: false,
                    c2h_success: true,
                },
                None,
            ),
            target(
                NvmfTarget::Spdk {
                    interrupt: true,
                    c2h_success: true,
                },
                Some("nvmf_tgt not found"),
            ),
        ];
        let samples = vec![
            sample(0, "lull-adaptive", 40_000.0, 500_000_000),
            sample(0, "spdk-poll", 50_000.0, 1_000_000_000),
            sample(1, "spdk-poll", 40_000.0, 1_000_000_000),
            NvmfSample {
                repeat: 1,
                job: NvmfJob::RandreadQd1,
                target: "lull-adaptive".into(),
                perf: None,
                server: None,
                error: Some("spdk_nvme_perf failed | x".into()),
            },
        ];
        let settings = NvmfSettings {
            jobs: vec![NvmfJob::RandreadQd1],
            runtime_secs: 1,
            warmup_secs: 1,
            idle_secs: 1.0,
            repeat: 2,
            size_bytes: 128 << 20,
            server_cpu: 1,
            client_cpu: 0,
            perf_mem_mb: 256,
            tgt_mem_mb: 1152,
            quick: true,
        };
        let env = Environment {
            date_utc: rfc3339_utc(0),
            nproc: 2,
            cpu_model: "Test CPU".into(),
            kernel: "6.1".into(),
            command: "lull bench --profile nvmf".into(),
            clk_tck: 100,
            tools: BTreeMap::from([("spdk".into(), "SPDK: v26.05".into())]),
        };
        build(env, settings, targets, samples)
    }

    #[test]
    fn cpu_window() {
        let c = CpuWindow::new(500_000_000, 2.0, 10_000.0);
        assert_eq!(c.cpu_pct, 25.0);
        assert_eq!(c.cpu_us_per_io, 25.0);
        assert!(CpuWindow::new(1, 1.0, 0.0).cpu_us_per_io.is_nan());
        assert!(CpuWindow::new(1, 0.0, 1.0).cpu_pct.is_nan());
    }

    #[test]
    fn aggregates_ratios_and_failures() {
        let r = fake();
        assert_eq!(r.results.len(), 3);
        let lull = &r.results[0];
        assert_eq!((lull.runs_ok, lull.failures.len()), (1, 1));
        assert_eq!(lull.iops.unwrap().median, 40_000.0);
        // Only repeat 0 has both: 40k / 50k.
        let ratio = lull.iops_vs_spdk_poll.unwrap();
        assert_eq!((ratio.median, ratio.n), (0.8, 1));
        assert_eq!(lull.cpu_us_per_io.unwrap().median, 12.5);
        let spdk = &r.results[1];
        assert_eq!(spdk.iops.unwrap().median, 45_000.0);
        assert!(spdk.iops_vs_spdk_poll.is_none());
        assert_eq!(spdk.lat_p99_us.unwrap().n, 2);
        assert_eq!(r.targets[0].idle_cpu_pct.unwrap().median, 0.01);
    }

    #[test]
    fn markdown_has_every_target_and_failure() {
        let md = render_markdown(&fake());
        for needle in [
            "## randread-qd1 — 4 KiB random read, QD1",
            "| lull-adaptive | 40000 | 156.2 | 25.0 | 50.0 | 50.0 | 12.50 | 0.800 | 1 |",
            "| spdk-poll | 45000 (40000–50000) |",
            "| spdk-interrupt | skipped: nvmf_tgt not found |",
            "- repeat 2, randread-qd1, lull-adaptive: spdk_nvme_perf failed | x",
            "`lull bench --profile nvmf`",
            "- spdk: SPDK: v26.05",
            "| lull-adaptive | 0.01 | 40000 | 25.0 / 50.0 | – | – | – | – | 12.50 | – |",
            "| spdk-interrupt (skipped) | 0.01 | – | – / – |",
            "- randread-qd1 IOPS: 0.800× (target ≥ 0.95×)",
            "- randwrite-qd1 IOPS: –× (target ≥ 0.95×)",
            "- idle CPU: 0.01 (0.00–0.02) % of a core (target ≤ 0.5 %)",
        ] {
            assert!(md.contains(needle), "missing {needle:?} in\n{md}");
        }
        for row in md
            .lines()
            .filter(|l| l.starts_with("| lull") || l.starts_with("| spdk-poll |"))
        {
            let cells = row.replace("\\|", "").matches('|').count();
            assert!(cells == 3 || cells == 10 || cells == 11, "{cells} in {row}");
        }
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&fake()).unwrap()).unwrap();
        assert_eq!(v["profile"], "nvmf");
        assert_eq!(v["targets"][2]["target"]["kind"], "spdk");
    }
}
