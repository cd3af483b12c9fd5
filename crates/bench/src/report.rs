//! The report: raw samples, per-cell medians with ratios, the environment,
//! and its markdown rendering. Everything here is pure data in, data out.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::args::{Mode, Settings, VolumeKind};
use crate::fio::{FioMetrics, JobKind, Primary};
use crate::plan::Target;
use crate::stats::{self, CellMedians, Ratio, ServerCost, Spread};

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
pub struct Environment {
    /// UTC, RFC 3339.
    pub date_utc: String,
    pub nproc: usize,
    pub cpu_model: String,
    pub kernel: String,
    /// The exact command line of this run.
    pub command: String,
    pub clk_tck: u64,
    /// Tool name → first line of its version output.
    pub tools: BTreeMap<String, String>,
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
    /// Against lull's poll mode (same volume kind when measured).
    pub vs_poll: Option<Ratio>,
    /// Against the peer with the best figure of merit for this job.
    pub vs_best_peer: Option<Ratio>,
}

impl JobResult {
    fn medians(&self) -> Option<CellMedians> {
        Some(CellMedians {
            iops: self.iops?.median,
            bw_bytes_per_sec: self.bw_bytes_per_sec?.median,
            lat_mean_us: self.lat_mean_us?.median,
            cpu_us_per_io: self.cpu_us_per_io.map(|s| s.median).unwrap_or(f64::NAN),
        })
    }
}

/// Builds the per-cell results with ratios from the raw samples.
pub fn aggregate(jobs: &[JobKind], targets: &[TargetReport], samples: &[Sample]) -> Vec<JobResult> {
    let mut out = Vec::new();
    for &job in jobs {
        let first = out.len();
        for t in targets {
            let mine: Vec<&Sample> = samples
                .iter()
                .filter(|s| s.job == job && s.target == t.name)
                .collect();
            let ok: Vec<(&FioMetrics, &ServerCost)> = mine
                .iter()
                .filter_map(|s| Some((s.fio.as_ref()?, s.server.as_ref()?)))
                .collect();
            let col = |f: &dyn Fn(&FioMetrics, &ServerCost) -> Option<f64>| {
                stats::spread(&ok.iter().filter_map(|(m, c)| f(m, c)).collect::<Vec<_>>())
            };
            out.push(JobResult {
                job,
                target: t.name.clone(),
                runs_ok: ok.len(),
                failures: mine.iter().filter_map(|s| s.error.clone()).collect(),
                iops: col(&|m, _| Some(m.iops)),
                bw_bytes_per_sec: col(&|m, _| Some(m.bw_bytes_per_sec)),
                lat_mean_us: col(&|m, _| Some(stats::lat_us(m).0)),
                lat_p50_us: col(&|m, _| stats::lat_us(m).1),
                lat_p99_us: col(&|m, _| stats::lat_us(m).2),
                cpu_pct: col(&|_, c| Some(c.cpu_pct)),
                cpu_us_per_io: col(&|_, c| Some(c.cpu_us_per_io)),
                ctxt_switches_per_io: col(&|_, c| Some(c.ctxt_switches_per_io)),
                faults_per_io: col(&|_, c| Some(c.faults_per_io)),
                vs_poll: None,
                vs_best_peer: None,
            });
        }
        add_ratios(job, targets, &mut out[first..]);
    }
    out
}

/// The lull poll-mode cell a target is compared with: same volume kind
/// (memory peers ↔ malloc, file peers ↔ file), else any poll-mode cell.
fn poll_baseline(
    target: &Target,
    targets: &[TargetReport],
    medians: &[Option<CellMedians>],
) -> Option<usize> {
    let want = match target {
        Target::Lull { volume, .. } => *volume,
        Target::Nbdkit => VolumeKind::Malloc,
        Target::QemuNbd => VolumeKind::File,
    };
    let polls: Vec<(usize, VolumeKind)> = targets
        .iter()
        .enumerate()
        .filter_map(|(i, t)| match t.target {
            Target::Lull {
                mode: Mode::Poll,
                volume,
                ..
            } if medians[i].is_some() => Some((i, volume)),
            _ => None,
        })
        .collect();
    polls
        .iter()
        .find(|(_, v)| *v == want)
        .or(polls.first())
        .map(|(i, _)| *i)
}

fn add_ratios(job: JobKind, targets: &[TargetReport], cells: &mut [JobResult]) {
    let medians: Vec<Option<CellMedians>> = cells.iter().map(JobResult::medians).collect();
    let best_peer = stats::best(
        job,
        targets
            .iter()
            .enumerate()
            .filter(|(_, t)| t.is_peer)
            .filter_map(|(i, _)| Some((i, medians[i].as_ref()?))),
    );
    for (i, t) in targets.iter().enumerate() {
        let Some(mine) = medians[i] else { continue };
        if let Some(b) = poll_baseline(&t.target, targets, &medians) {
            if let Some(base) = &medians[b] {
                cells[i].vs_poll = Some(stats::ratio(job, &mine, &targets[b].name, base));
            }
        }
        if let Some(b) = best_peer {
            if let Some(base) = &medians[b] {
                cells[i].vs_best_peer = Some(stats::ratio(job, &mine, &targets[b].name, base));
            }
        }
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

/// Builds the modes summary from the per-cell medians; one row per target
/// in report order.
pub fn modes_summary(
    jobs: &[JobKind],
    targets: &[TargetReport],
    results: &[JobResult],
) -> Vec<ModeSummaryRow> {
    let cell = |job: JobKind, name: &str| {
        if !jobs.contains(&job) {
            return None;
        }
        results.iter().find(|c| c.job == job && c.target == name)
    };
    let median = |s: Option<Spread>| s.map(|s| s.median);
    targets
        .iter()
        .map(|t| {
            let (mode, volume, hybrid_period_us) = match t.target {
                Target::Lull {
                    mode,
                    volume,
                    hybrid_period_us,
                } => (Some(mode), Some(volume), hybrid_period_us),
                _ => (None, None, None),
            };
            let lat = cell(JobKind::RandreadLat, &t.name);
            let iops = cell(JobKind::RandreadIops, &t.name);
            ModeSummaryRow {
                target: t.name.clone(),
                is_peer: t.is_peer,
                skipped: t.status != TargetStatus::Ok,
                mode,
                volume,
                hybrid_period_us,
                idle_cpu_pct: median(t.idle_cpu_pct),
                qd1_randread_lat_mean_us: lat.and_then(|c| median(c.lat_mean_us)),
                qd1_randread_lat_p99_us: lat.and_then(|c| median(c.lat_p99_us)),
                qd64_randread_iops: iops.and_then(|c| median(c.iops)),
                cpu_us_per_io_qd1: lat.and_then(|c| median(c.cpu_us_per_io)),
                cpu_us_per_io_qd64: iops.and_then(|c| median(c.cpu_us_per_io)),
            }
        })
        .collect()
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

/// Per-repeat ratios `metric(adaptive) / metric(poll)` of one job, over the
/// repeats in which both ran; `lower_is_better` orients `adaptive_better`.
fn paired_ratio(
    samples: &[Sample],
    job: JobKind,
    adaptive: &str,
    poll: &str,
    metric: fn(&Sample) -> Option<f64>,
    lower_is_better: bool,
) -> Option<PairedRatio> {
    let value = |target: &str, repeat: u32| {
        samples
            .iter()
            .find(|s| s.job == job && s.repeat == repeat && s.target == target)
            .and_then(metric)
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    let mut ratios = Vec::new();
    for s in samples
        .iter()
        .filter(|s| s.job == job && s.target == adaptive)
    {
        if let (Some(a), Some(p)) = (value(adaptive, s.repeat), value(poll, s.repeat)) {
            ratios.push(a / p);
        }
    }
    let adaptive_better = ratios
        .iter()
        .filter(|&&r| if lower_is_better { r < 1.0 } else { r > 1.0 })
        .count();
    stats::spread(&ratios).map(|spread| PairedRatio {
        spread,
        adaptive_better,
    })
}

/// One entry per volume kind that has both a poll and an adaptive row, in
/// row order; targets that were skipped do not count. `samples` give the
/// per-repeat (paired) ratios.
pub fn adaptive_vs_poll(rows: &[ModeSummaryRow], samples: &[Sample]) -> Vec<AdaptiveVsPoll> {
    let find = |mode: Mode, volume: VolumeKind| {
        rows.iter()
            .find(|r| !r.skipped && r.mode == Some(mode) && r.volume == Some(volume))
    };
    let div = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if a.is_finite() && b.is_finite() && b > 0.0 => Some(a / b),
        _ => None,
    };
    let mut out: Vec<AdaptiveVsPoll> = Vec::new();
    for volume in rows.iter().filter_map(|r| r.volume) {
        if out.iter().any(|o| o.volume == volume) {
            continue;
        }
        let (Some(a), Some(p)) = (find(Mode::Adaptive, volume), find(Mode::Poll, volume)) else {
            continue;
        };
        out.push(AdaptiveVsPoll {
            volume,
            adaptive: a.target.clone(),
            poll: p.target.clone(),
            qd1_lat_mean: div(a.qd1_randread_lat_mean_us, p.qd1_randread_lat_mean_us),
            qd64_iops: div(a.qd64_randread_iops, p.qd64_randread_iops),
            cpu_us_per_io_qd1: div(a.cpu_us_per_io_qd1, p.cpu_us_per_io_qd1),
            adaptive_idle_cpu_pct: a.idle_cpu_pct,
            paired_qd1_lat_mean: paired_ratio(
                samples,
                JobKind::RandreadLat,
                &a.target,
                &p.target,
                |s| s.fio.as_ref().map(|f| f.lat_mean_ns),
                true,
            ),
            paired_qd64_iops: paired_ratio(
                samples,
                JobKind::RandreadIops,
                &a.target,
                &p.target,
                |s| s.fio.as_ref().map(|f| f.iops),
                false,
            ),
            paired_cpu_us_per_io_qd1: paired_ratio(
                samples,
                JobKind::RandreadLat,
                &a.target,
                &p.target,
                |s| s.server.as_ref().map(|c| c.cpu_us_per_io),
                true,
            ),
        });
    }
    out
}

/// The "Modes summary" section of report.md: the table, then one
/// adaptive/poll line per volume kind. Cells of a job that was not run are
/// blank; "–" means it ran without a number (skipped or failed).
pub fn render_modes_summary(r: &Report) -> String {
    let mut md = String::new();
    let jobs = &r.settings.jobs;
    let num = |job: Option<JobKind>, v: Option<f64>, f: fn(f64) -> String| match (job, v) {
        (Some(j), _) if !jobs.contains(&j) => String::new(),
        (_, Some(v)) => f(v),
        (_, None) => "–".into(),
    };
    let _ = writeln!(
        md,
        "## Modes summary
"
    );
    let _ = writeln!(
        md,
        "| target | idle CPU % | QD1 4k randread mean µs | QD1 4k randread p99 µs | QD64 4k randread IOPS | CPU-µs/IO at QD1 | CPU-µs/IO at QD64 |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    let lat = Some(JobKind::RandreadLat);
    let iops = Some(JobKind::RandreadIops);
    for row in &r.modes_summary {
        let _ = writeln!(
            md,
            "| {}{} | {} | {} | {} | {} | {} | {} |",
            row.target,
            if row.skipped { " (skipped)" } else { "" },
            num(None, row.idle_cpu_pct, sig3),
            num(lat, row.qd1_randread_lat_mean_us, sig3),
            num(lat, row.qd1_randread_lat_p99_us, sig3),
            num(iops, row.qd64_randread_iops, si),
            num(lat, row.cpu_us_per_io_qd1, sig3),
            num(iops, row.cpu_us_per_io_qd64, sig3),
        );
    }
    let _ = writeln!(md);
    let times = |v: Option<f64>| {
        v.map(|v| format!("{}×", sig3(v)))
            .unwrap_or_else(|| "–".into())
    };
    for a in &r.adaptive_vs_poll {
        let _ = writeln!(
            md,
            "adaptive/poll ({}): QD1 mean latency {}, QD64 IOPS {}, CPU-µs/IO at QD1 {}; idle CPU of adaptive {}
",
            a.volume.as_str(),
            times(a.qd1_lat_mean),
            times(a.qd64_iops),
            times(a.cpu_us_per_io_qd1),
            a.adaptive_idle_cpu_pct
                .map(|v| format!("{} %", sig3(v)))
                .unwrap_or_else(|| "–".into()),
        );
        let paired = |p: &Option<PairedRatio>| match p {
            Some(p) if p.spread.n > 1 => format!(
                "median {}× (range {}–{}×; adaptive better in {} of {})",
                sig3(p.spread.median),
                sig3(p.spread.min),
                sig3(p.spread.max),
                p.adaptive_better,
                p.spread.n
            ),
            _ => String::new(),
        };
        let lines = [
            ("QD1 mean latency", paired(&a.paired_qd1_lat_mean)),
            ("QD64 IOPS", paired(&a.paired_qd64_iops)),
            ("CPU-µs/IO at QD1", paired(&a.paired_cpu_us_per_io_qd1)),
        ];
        if lines.iter().any(|(_, l)| !l.is_empty()) {
            let _ = writeln!(md, "Per repeat, adaptive/poll ({}):\n", a.volume.as_str());
            for (name, line) in lines.iter().filter(|(_, l)| !l.is_empty()) {
                let _ = writeln!(md, "- {name}: {line}");
            }
            let _ = writeln!(md);
        }
    }
    md
}

/// Value with three significant digits and a k/M/G suffix.
pub fn si(x: f64) -> String {
    if !x.is_finite() {
        return "–".into();
    }
    let (v, suffix) = match x.abs() {
        a if a >= 1e9 => (x / 1e9, "G"),
        a if a >= 1e6 => (x / 1e6, "M"),
        a if a >= 1e3 => (x / 1e3, "k"),
        _ => (x, ""),
    };
    format!("{}{suffix}", sig3(v))
}

/// Three significant digits without a suffix.
pub fn sig3(v: f64) -> String {
    if !v.is_finite() {
        return "–".into();
    }
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 || a == 0.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn cell(s: Option<Spread>, f: fn(f64) -> String, with_range: bool) -> String {
    match s {
        None => "–".into(),
        Some(s) if with_range && s.n > 1 => format!("{} ({}–{})", f(s.median), f(s.min), f(s.max)),
        Some(s) => f(s.median),
    }
}

fn mib(x: f64) -> String {
    sig3(x / (1u64 << 20) as f64)
}

fn ratio_cell(r: &Option<Ratio>, speed: bool) -> String {
    match r {
        None => "–".into(),
        Some(r) => format!("{}×", sig3(if speed { r.speed } else { r.cpu_per_io })),
    }
}

/// Quotes a command-line word for a POSIX shell when needed.
pub fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        word.into()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

fn job_title(job: JobKind) -> String {
    let what = match job.rw() {
        "randread" => "random read",
        "randwrite" => "random write",
        "read" => "sequential read",
        _ => "sequential write",
    };
    format!(
        "{} — {} KiB {what}, QD{}",
        job.as_str(),
        job.block_size_bytes() >> 10,
        job.iodepth()
    )
}

/// The markdown report.
pub fn render_markdown(r: &Report) -> String {
    let mut md = String::new();
    let e = &r.environment;
    let s = &r.settings;
    let _ = writeln!(md, "# lull bench\n");
    let _ = writeln!(md, "- date: {}", e.date_utc);
    let _ = writeln!(
        md,
        "- machine: {} cores, {}, kernel {}",
        e.nproc, e.cpu_model, e.kernel
    );
    let _ = writeln!(md, "- command: `{}`", e.command);
    let _ = writeln!(
        md,
        "- settings: {} s per job after {} s ramp, idle window {} s, {} repeat(s), volume {} MiB, server on core {}, fio on core {}",
        s.runtime_secs,
        s.ramp_secs,
        s.idle_secs,
        s.repeat,
        s.size_bytes >> 20,
        s.server_cpu,
        s.client_cpu
    );
    if !e.tools.is_empty() {
        let tools: Vec<String> = e.tools.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        let _ = writeln!(md, "- tools: {}", tools.join("; "));
    }
    let _ = writeln!(md);
    let _ = writeln!(
        md,
        "Numbers are medians over repeats{}. Server CPU is utime+stime of all the server's threads (and its replica processes) from /proc over the measured window; \
         CPU µs/IO, context switches/IO and faults/IO divide that window's counts by the I/Os fio completed after its ramp. \
         Speed × > 1 means faster than the baseline (IOPS or bandwidth ratio; for QD1 jobs baseline latency ÷ latency); CPU/IO × < 1 means cheaper. \
         The poll baseline is lull's poll mode on the same volume kind (nbdkit ↔ malloc, qemu-nbd ↔ file).\n",
        if s.repeat > 1 { " (range min–max in parentheses)" } else { "" }
    );

    let _ = writeln!(md, "## Targets\n");
    let _ = writeln!(md, "| target | status | idle CPU % | command |");
    let _ = writeln!(md, "|---|---|---|---|");
    for t in &r.targets {
        let status = match &t.status {
            TargetStatus::Ok => "ok".to_string(),
            TargetStatus::Skipped { reason } => format!("skipped: {}", md_escape(reason)),
        };
        let cmd = t
            .command
            .as_deref()
            .map(|c| format!("`{}`", c.replace('`', "'")))
            .unwrap_or_else(|| "–".into());
        let _ = writeln!(
            md,
            "| {} | {status} | {} | {cmd} |",
            t.name,
            cell(t.idle_cpu_pct, sig3, true)
        );
    }
    let _ = writeln!(md);
    md.push_str(&render_modes_summary(r));

    let _ = writeln!(md, "## Results\n");
    for &job in &s.jobs {
        let _ = writeln!(md, "### {}\n", job_title(job));
        let _ = writeln!(
            md,
            "| target | IOPS | MiB/s | lat mean µs | p50 µs | p99 µs | CPU % | CPU µs/IO | ctx sw/IO | faults/IO | speed × poll | CPU/IO × poll | speed × best peer | CPU/IO × best peer |"
        );
        let _ = writeln!(
            md,
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        let primary = job.primary();
        for t in &r.targets {
            if let TargetStatus::Skipped { reason } = &t.status {
                let _ = writeln!(
                    md,
                    "| {} | skipped: {} |{}",
                    t.name,
                    md_escape(reason),
                    " |".repeat(12)
                );
                continue;
            }
            let Some(c) = r
                .results
                .iter()
                .find(|c| c.job == job && c.target == t.name)
            else {
                continue;
            };
            if c.runs_ok == 0 {
                let why = c
                    .failures
                    .first()
                    .map(|f| md_escape(f))
                    .unwrap_or_else(|| "not run".into());
                let _ = writeln!(md, "| {} | failed: {why} |{}", t.name, " |".repeat(12));
                continue;
            }
            let _ = writeln!(
                md,
                "| {}{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                t.name,
                if c.failures.is_empty() {
                    String::new()
                } else {
                    format!(" ({} failed)", c.failures.len())
                },
                cell(c.iops, si, primary == Primary::Iops),
                cell(c.bw_bytes_per_sec, mib, primary == Primary::Bandwidth),
                cell(c.lat_mean_us, sig3, primary == Primary::Latency),
                cell(c.lat_p50_us, sig3, false),
                cell(c.lat_p99_us, sig3, false),
                cell(c.cpu_pct, sig3, true),
                cell(c.cpu_us_per_io, sig3, false),
                cell(c.ctxt_switches_per_io, sig3, false),
                cell(c.faults_per_io, sig3, false),
                ratio_cell(&c.vs_poll, true),
                ratio_cell(&c.vs_poll, false),
                ratio_cell(&c.vs_best_peer, true),
                ratio_cell(&c.vs_best_peer, false),
            );
        }
        let _ = writeln!(md);
    }
    if !r.plots.is_empty() {
        let _ = writeln!(md, "## Plots\n");
        for p in &r.plots {
            let _ = writeln!(md, "![{p}]({p})\n");
        }
    }
    md
}

/// Keeps a free-text reason from breaking a table row.
fn md_escape(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// The "model name" of the first CPU in /proc/cpuinfo text.
pub fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == "model name").then(|| v.trim().to_string())
    })
}

/// Seconds since the Unix epoch as RFC 3339 UTC (Howard Hinnant's
/// days-to-civil algorithm; no date crate needed).
pub fn rfc3339_utc(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::args::Settings;
    use crate::procstat::ProcCounters;

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

    fn sample(
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
        let server = ServerCost::new(delta, 1.0, 100, fio.ios);
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
    fn aggregate_medians_and_ratios() {
        let r = fake_report(3);
        assert_eq!(r.results.len(), 8);
        let get = |job, name: &str| {
            r.results
                .iter()
                .find(|c| c.job == job && c.target == name)
                .unwrap()
        };
        let a = get(JobKind::RandreadIops, "lull-adaptive-malloc");
        assert_eq!(a.runs_ok, 3);
        let iops = a.iops.unwrap();
        assert!((iops.median - 99_000.0).abs() < 1e-6 && iops.n == 3);
        let vp = a.vs_poll.as_ref().unwrap();
        assert_eq!(vp.baseline, "lull-poll-malloc");
        assert!((vp.speed - 0.9).abs() < 1e-9);
        let vb = a.vs_best_peer.as_ref().unwrap();
        assert_eq!(vb.baseline, "nbdkit-memory");
        assert!((vb.speed - 1.8).abs() < 1e-9);
        // QD1: nbdkit failed every run, so no best peer; poll is its own baseline.
        let p = get(JobKind::RandreadLat, "lull-poll-malloc");
        assert!(p.vs_best_peer.is_none());
        assert!((p.vs_poll.as_ref().unwrap().speed - 1.0).abs() < 1e-12);
        let n = get(JobKind::RandreadLat, "nbdkit-memory");
        assert_eq!((n.runs_ok, n.failures.len()), (0, 3));
        // The skipped target has an empty cell.
        let i = get(JobKind::RandreadIops, "lull-interrupt-malloc");
        assert!(i.iops.is_none() && i.vs_poll.is_none());
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
                cells == 5 || cells == 8 || cells == 15,
                "{cells} in {table_line}"
            );
        }
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

    #[test]
    fn paired_ratios_pair_each_repeat() {
        let poll = Target::lull(Mode::Poll, VolumeKind::Malloc, None);
        let adaptive = Target::lull(Mode::Adaptive, VolumeKind::Malloc, None);
        let iops = JobKind::RandreadIops;
        // The machine slows down from repeat to repeat; adaptive is ahead of
        // poll in two repeats of three. Repeat 3 has no poll number.
        let mut samples = vec![
            sample(0, iops, &poll, 100_000.0, 600.0, 100),
            sample(0, iops, &adaptive, 110_000.0, 600.0, 100),
            sample(1, iops, &poll, 80_000.0, 600.0, 100),
            sample(1, iops, &adaptive, 72_000.0, 600.0, 100),
            sample(2, iops, &poll, 50_000.0, 600.0, 100),
            sample(2, iops, &adaptive, 60_000.0, 600.0, 100),
            sample(3, iops, &adaptive, 1.0, 600.0, 100),
        ];
        samples.push(Sample {
            fio: None,
            error: Some("fio failed".into()),
            ..sample(3, iops, &poll, 1.0, 1.0, 1)
        });
        let p = paired_ratio(
            &samples,
            iops,
            &adaptive.name(),
            &poll.name(),
            |s| s.fio.as_ref().map(|f| f.iops),
            false,
        )
        .unwrap();
        assert_eq!(p.spread.n, 3);
        assert!((p.spread.median - 1.1).abs() < 1e-9);
        assert!((p.spread.min - 0.9).abs() < 1e-9 && (p.spread.max - 1.2).abs() < 1e-9);
        assert_eq!(p.adaptive_better, 2);
        // Oriented the other way (a latency), the same ratios count once.
        let q = paired_ratio(
            &samples,
            iops,
            &adaptive.name(),
            &poll.name(),
            |s| s.fio.as_ref().map(|f| f.iops),
            true,
        )
        .unwrap();
        assert_eq!(q.adaptive_better, 1);
        // No sample of the job: no ratio.
        assert!(paired_ratio(
            &samples,
            JobKind::RandreadLat,
            &adaptive.name(),
            &poll.name(),
            |_| Some(1.0),
            true
        )
        .is_none());
    }

    #[test]
    fn adaptive_vs_poll_per_volume() {
        let row = |mode: Mode, volume: VolumeKind, lat: f64| ModeSummaryRow {
            target: Target::lull(mode, volume, Some(10)).name(),
            is_peer: false,
            skipped: false,
            mode: Some(mode),
            volume: Some(volume),
            hybrid_period_us: (mode == Mode::Hybrid).then_some(10),
            idle_cpu_pct: Some(if mode == Mode::Poll { 100.0 } else { 0.5 }),
            qd1_randread_lat_mean_us: Some(lat),
            qd1_randread_lat_p99_us: None,
            qd64_randread_iops: Some(0.0),
            cpu_us_per_io_qd1: None,
            cpu_us_per_io_qd64: None,
        };
        let rows = vec![
            row(Mode::Poll, VolumeKind::Malloc, 20.0),
            row(Mode::Hybrid, VolumeKind::Malloc, 22.0),
            row(Mode::Adaptive, VolumeKind::Malloc, 30.0),
            row(Mode::Adaptive, VolumeKind::Replica1, 30.0),
            row(Mode::Adaptive, VolumeKind::Replica2, 80.0),
            row(Mode::Poll, VolumeKind::Replica2, 40.0),
        ];
        assert_eq!(rows[1].target, "lull-hybrid@10-malloc");
        let a = adaptive_vs_poll(&rows, &[]);
        assert_eq!(
            a.iter().map(|a| a.volume).collect::<Vec<_>>(),
            [VolumeKind::Malloc, VolumeKind::Replica2]
        );
        assert_eq!(a[0].qd1_lat_mean, Some(1.5));
        assert_eq!(a[1].qd1_lat_mean, Some(2.0));
        assert_eq!(a[1].poll, "lull-poll-replica2");
        // A zero or missing denominator gives no ratio.
        assert_eq!(a[0].qd64_iops, None);
        assert_eq!(a[0].cpu_us_per_io_qd1, None);
        assert_eq!(a[0].adaptive_idle_cpu_pct, Some(0.5));
    }

    #[test]
    fn formatting_helpers() {
        assert_eq!(si(82257.7), "82.3k");
        assert_eq!(si(1.5e6), "1.50M");
        assert_eq!(si(12.0), "12.0");
        assert_eq!(si(f64::NAN), "–");
        assert_eq!(sig3(0.01234), "0.012");
        assert_eq!(shell_quote("--jobs=a,b"), "--jobs=a,b");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(1_795_303_855), "2026-11-21T23:30:55Z");
        assert_eq!(
            cpu_model("processor\t: 0\nmodel name\t: AMD EPYC 7B13\n"),
            Some("AMD EPYC 7B13".into())
        );
        assert_eq!(cpu_model("processor: 0\n"), None);
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
