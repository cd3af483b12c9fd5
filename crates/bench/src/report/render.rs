//! report.md: the markdown rendering of a [`Report`], and the number
//! formats it (and the plots) use.

use std::fmt::Write as _;

use crate::fio::{JobKind, Primary};
use crate::report::stats::{Ratio, Spread};
use crate::report::{PairedRatio, Report, TargetStatus};

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
         CPU µs/IO, context switches/IO (voluntary + involuntary) and faults/IO (minor + major) divide that window's counts by the I/Os fio completed after its ramp. \
         uring enters/IO (lull only) is the server's io_uring_enter calls over the same window, the sum of its reactors' counters read over its RPC socket \
         (not the replica processes', which have no RPC socket; a file volume's own count is part of that sum, so it is not added again), divided the same way; peers show –. \
         Syscalls in general are not counted: /proc has no cheap per-process count (/proc/PID/syscall shows only the call in progress). \
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
            "| target | IOPS | MiB/s | lat mean µs | p50 µs | p99 µs | CPU % | CPU µs/IO | ctx sw/IO | faults/IO | uring enters/IO | speed × poll | CPU/IO × poll | speed × best peer | CPU/IO × best peer |"
        );
        let _ = writeln!(
            md,
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        );
        let primary = job.primary();
        for t in &r.targets {
            if let TargetStatus::Skipped { reason } = &t.status {
                let _ = writeln!(
                    md,
                    "| {} | skipped: {} |{}",
                    t.name,
                    md_escape(reason),
                    " |".repeat(13)
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
                let _ = writeln!(md, "| {} | failed: {why} |{}", t.name, " |".repeat(13));
                continue;
            }
            let _ = writeln!(
                md,
                "| {}{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
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
                cell(c.io_uring_enters_per_io, sig3, false),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formatting_helpers() {
        assert_eq!(si(82257.7), "82.3k");
        assert_eq!(si(1.5e6), "1.50M");
        assert_eq!(si(12.0), "12.0");
        assert_eq!(si(f64::NAN), "–");
        assert_eq!(sig3(0.01234), "0.012");
    }
}
