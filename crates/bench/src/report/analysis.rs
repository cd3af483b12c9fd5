//! From raw samples to the report's numbers: per-cell medians and spreads,
//! ratios against lull's poll mode and the best peer, the modes summary
//! and adaptive ÷ poll. The statistics themselves are in [`super::stats`].

use lull_reactor::Mode;

use crate::config::VolumeKind;
use crate::fio::{FioMetrics, JobKind};
use crate::plan::Target;
use crate::report::stats::{self, CellMedians, ServerCost, Spread};
use crate::report::{
    AdaptiveVsPoll, JobResult, ModeSummaryRow, PairedRatio, Sample, TargetReport, TargetStatus,
};

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
                io_uring_enters_per_io: col(&|_, c| c.io_uring_enters_per_io),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::{fake_report, sample};

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
}
