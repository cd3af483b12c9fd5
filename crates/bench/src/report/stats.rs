//! Median and spread over repeats, per-run derived metrics and ratios.
//!
//! ```
//! use lull_bench::report::stats::spread;
//! let s = spread(&[3.0, 1.0, 10.0, 2.0]).unwrap();
//! assert_eq!((s.median, s.min, s.max, s.n), (2.5, 1.0, 10.0, 4));
//! ```

use serde::Serialize;

use crate::env::procstat::ProcCounters;
use crate::env::uring_enters::UringEnters;
use crate::fio::{FioMetrics, JobKind, Primary};

/// Median and range of one metric over the repeats.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// Number of values (repeats that measured it).
    pub n: usize,
}

/// Median (mean of the middle two for an even count) and min–max, ignoring
/// non-finite values; `None` when nothing is left.
pub fn spread(values: &[f64]) -> Option<Spread> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Some(Spread {
        median,
        min: v[0],
        max: v[n - 1],
        n,
    })
}

/// Server-side cost of one fio run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ServerCost {
    /// Wall time of the CPU window, seconds.
    pub window_secs: f64,
    pub cpu_secs: f64,
    pub cpu_pct: f64,
    pub cpu_us_per_io: f64,
    pub ctxt_switches_per_io: f64,
    pub faults_per_io: f64,
    /// The server's `io_uring_enter` calls per I/O (its reactors' count);
    /// `None` for peers, and for a lull server whose RPC socket did not
    /// answer.
    pub io_uring_enters_per_io: Option<f64>,
    /// Raw counter deltas over the window.
    pub delta: ProcCounters,
    /// Raw `io_uring_enter` deltas over the window (lull only).
    pub io_uring_enters: Option<UringEnters>,
}

impl ServerCost {
    /// Derives the per-I/O costs. With `ios == 0` or an empty window the
    /// ratios are NaN, which [`spread`] drops and JSON writes as `null`.
    pub fn new(delta: ProcCounters, window_secs: f64, clk_tck: u64, ios: u64) -> ServerCost {
        let cpu_secs = delta.cpu_ticks() as f64 / clk_tck.max(1) as f64;
        let per_io = |x: f64| if ios == 0 { f64::NAN } else { x / ios as f64 };
        ServerCost {
            window_secs,
            cpu_secs,
            cpu_pct: if window_secs > 0.0 {
                cpu_secs / window_secs * 100.0
            } else {
                f64::NAN
            },
            cpu_us_per_io: per_io(cpu_secs * 1e6),
            ctxt_switches_per_io: per_io(delta.ctxt_switches() as f64),
            faults_per_io: per_io(delta.faults() as f64),
            io_uring_enters_per_io: None,
            delta,
            io_uring_enters: None,
        }
    }

    /// Adds the server's `io_uring_enter` deltas over the same window.
    pub fn with_uring_enters(mut self, enters: UringEnters, ios: u64) -> ServerCost {
        self.io_uring_enters = Some(enters);
        self.io_uring_enters_per_io = (ios > 0).then(|| enters.reactors as f64 / ios as f64);
        self
    }
}

/// CPU% of a server over an idle window.
pub fn idle_cpu_pct(delta: &ProcCounters, window_secs: f64, clk_tck: u64) -> f64 {
    ServerCost::new(*delta, window_secs, clk_tck, 0).cpu_pct
}

/// Medians of one (job, target) cell, the inputs of the ratios.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CellMedians {
    pub iops: f64,
    pub bw_bytes_per_sec: f64,
    pub lat_mean_us: f64,
    pub cpu_us_per_io: f64,
}

impl CellMedians {
    /// The job's figure of merit, oriented so that bigger is better: IOPS,
    /// bandwidth, or 1/latency for the QD1 jobs.
    pub fn merit(&self, job: JobKind) -> f64 {
        match job.primary() {
            Primary::Iops => self.iops,
            Primary::Bandwidth => self.bw_bytes_per_sec,
            Primary::Latency => 1.0 / self.lat_mean_us,
        }
    }
}

/// A cell measured against a baseline cell of the same job.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Ratio {
    /// Target name of the baseline.
    pub baseline: String,
    /// Above 1: faster than the baseline (IOPS or bandwidth ratio; for the
    /// QD1 jobs baseline latency / latency).
    pub speed: f64,
    /// Below 1: cheaper than the baseline (CPU-µs per I/O ratio).
    pub cpu_per_io: f64,
}

pub fn ratio(
    job: JobKind,
    cell: &CellMedians,
    baseline_name: &str,
    baseline: &CellMedians,
) -> Ratio {
    Ratio {
        baseline: baseline_name.into(),
        speed: cell.merit(job) / baseline.merit(job),
        cpu_per_io: cell.cpu_us_per_io / baseline.cpu_us_per_io,
    }
}

/// Index of the best cell by merit among `candidates` (index, medians).
pub fn best<'a>(
    job: JobKind,
    candidates: impl IntoIterator<Item = (usize, &'a CellMedians)>,
) -> Option<usize> {
    candidates
        .into_iter()
        .filter(|(_, c)| c.merit(job).is_finite())
        .max_by(|a, b| a.1.merit(job).total_cmp(&b.1.merit(job)))
        .map(|(i, _)| i)
}

/// Metrics of one fio run in report units.
pub fn lat_us(fio: &FioMetrics) -> (f64, Option<f64>, Option<f64>) {
    (
        fio.lat_mean_ns / 1e3,
        fio.lat_p50_ns.map(|v| v / 1e3),
        fio.lat_p99_ns.map(|v| v / 1e3),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_cases() {
        assert_eq!(spread(&[]), None);
        assert_eq!(spread(&[f64::NAN]), None);
        assert_eq!(
            spread(&[5.0]),
            Some(Spread {
                median: 5.0,
                min: 5.0,
                max: 5.0,
                n: 1
            })
        );
        assert_eq!(spread(&[9.0, 1.0, 5.0]).unwrap().median, 5.0);
        assert_eq!(spread(&[9.0, f64::NAN, 1.0, 5.0]).unwrap().n, 3);
        assert_eq!(spread(&[4.0, 1.0]).unwrap().median, 2.5);
    }

    #[test]
    fn server_cost() {
        let delta = ProcCounters {
            utime_ticks: 60,
            stime_ticks: 40,
            voluntary_ctxt_switches: 500,
            nonvoluntary_ctxt_switches: 500,
            minor_faults: 10,
            major_faults: 0,
        };
        let c = ServerCost::new(delta, 2.0, 100, 100_000);
        assert_eq!(c.cpu_secs, 1.0);
        assert_eq!(c.cpu_pct, 50.0);
        assert_eq!(c.cpu_us_per_io, 10.0);
        assert_eq!(c.ctxt_switches_per_io, 0.01);
        assert_eq!(c.faults_per_io, 0.0001);
        assert!(ServerCost::new(delta, 2.0, 100, 0).cpu_us_per_io.is_nan());
        assert_eq!(c.io_uring_enters_per_io, None);
        let enters = UringEnters {
            reactors: 50_000,
            volume: Some(49_000),
        };
        let u = c.with_uring_enters(enters, 100_000);
        assert_eq!(u.io_uring_enters_per_io, Some(0.5));
        assert_eq!(u.io_uring_enters, Some(enters));
        assert_eq!(
            ServerCost::new(delta, 2.0, 100, 0)
                .with_uring_enters(enters, 0)
                .io_uring_enters_per_io,
            None
        );
        assert!(idle_cpu_pct(&delta, 0.0, 100).is_nan());
        assert_eq!(idle_cpu_pct(&ProcCounters::default(), 1.0, 100), 0.0);
    }

    #[test]
    fn ratios_and_best() {
        let poll = CellMedians {
            iops: 100.0,
            bw_bytes_per_sec: 400.0,
            lat_mean_us: 20.0,
            cpu_us_per_io: 10.0,
        };
        let adaptive = CellMedians {
            iops: 90.0,
            bw_bytes_per_sec: 360.0,
            lat_mean_us: 25.0,
            cpu_us_per_io: 5.0,
        };
        let r = ratio(JobKind::RandreadIops, &adaptive, "lull-poll-malloc", &poll);
        assert!((r.speed - 0.9).abs() < 1e-12);
        assert_eq!(r.cpu_per_io, 0.5);
        let r = ratio(JobKind::RandreadLat, &adaptive, "p", &poll);
        assert!((r.speed - 0.8).abs() < 1e-12);
        assert_eq!(
            best(JobKind::SeqreadBw, [(3, &adaptive), (7, &poll)]),
            Some(7)
        );
        assert_eq!(
            best(JobKind::RandreadLat, [(3, &adaptive), (7, &poll)]),
            Some(7)
        );
        assert_eq!(best(JobKind::RandreadLat, []), None);
    }
}
