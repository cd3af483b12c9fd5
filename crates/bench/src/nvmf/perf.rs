//! The NVMe/TCP job profile and `spdk_nvme_perf`'s text output.
//!
//! perf prints a table with one row per namespace and a `Total` row (IOPS,
//! MiB/s, then the average, minimum and maximum latency in µs) and, with
//! `-L`, a "Summary latency data" block of percentiles read off its latency
//! histogram (`99.00000% :    45.643us`: the upper edge of the histogram
//! bucket that holds the 99th percentile; the buckets are ~1% wide).
//!
//! ```
//! use lull_bench::nvmf::perf::parse_perf_output;
//! let text = "Initialization complete. Launching workers.\n\
//!     Total                 :   22039.95      86.09      45.35      14.87   20106.01\n\
//!     \n\
//!     Summary latency data for TCP (addr:127.0.0.1 subnqn:x) from core 0:\n\
//!     =====\n\
//!      50.00000% :    16.122us\n\
//!      99.00000% :    45.643us\n";
//! let m = parse_perf_output(text).unwrap();
//! assert_eq!((m.iops, m.lat_mean_us, m.lat_p99_us), (22039.95, 45.35, Some(45.643)));
//! ```

use serde::{Deserialize, Serialize};

/// Largest perf output parsed: a `-LL` histogram is tens of KiB; anything
/// far bigger is a runaway log, not a report.
pub const PERF_OUTPUT_BYTES_MAX: usize = 16 << 20;

/// The line perf prints once the controllers are attached, just before its
/// workers start: the measured run (after `-a` warm-up seconds) begins here.
pub const PERF_LAUNCH_LINE: &str = "Initialization complete. Launching workers.";

/// One job of the NVMe/TCP profile (issue 16's benchmark).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum NvmfJob {
    /// 4 KiB random read at QD1.
    RandreadQd1,
    /// 4 KiB random write at QD1.
    RandwriteQd1,
    /// 4 KiB random read at QD32.
    RandreadQd32,
    /// 4 KiB random write at QD32.
    RandwriteQd32,
    /// 128 KiB sequential read at QD32.
    Read128kQd32,
}

impl NvmfJob {
    pub const ALL: [NvmfJob; 5] = [
        NvmfJob::RandreadQd1,
        NvmfJob::RandwriteQd1,
        NvmfJob::RandreadQd32,
        NvmfJob::RandwriteQd32,
        NvmfJob::Read128kQd32,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NvmfJob::RandreadQd1 => "randread-qd1",
            NvmfJob::RandwriteQd1 => "randwrite-qd1",
            NvmfJob::RandreadQd32 => "randread-qd32",
            NvmfJob::RandwriteQd32 => "randwrite-qd32",
            NvmfJob::Read128kQd32 => "read128k-qd32",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            NvmfJob::RandreadQd1 => "4 KiB random read, QD1",
            NvmfJob::RandwriteQd1 => "4 KiB random write, QD1",
            NvmfJob::RandreadQd32 => "4 KiB random read, QD32",
            NvmfJob::RandwriteQd32 => "4 KiB random write, QD32",
            NvmfJob::Read128kQd32 => "128 KiB sequential read, QD32",
        }
    }

    /// perf's `-w`.
    pub fn pattern(self) -> &'static str {
        match self {
            NvmfJob::RandreadQd1 | NvmfJob::RandreadQd32 => "randread",
            NvmfJob::RandwriteQd1 | NvmfJob::RandwriteQd32 => "randwrite",
            NvmfJob::Read128kQd32 => "read",
        }
    }

    pub fn block_size_bytes(self) -> u64 {
        match self {
            NvmfJob::Read128kQd32 => 128 << 10,
            _ => 4 << 10,
        }
    }

    pub fn queue_depth(self) -> u32 {
        match self {
            NvmfJob::RandreadQd1 | NvmfJob::RandwriteQd1 => 1,
            _ => 32,
        }
    }

    /// perf's arguments for this job against the transport id `trid`:
    /// `warmup_secs` of unmeasured I/O (`-a`), then `runtime_secs`
    /// measured (`-t`); `-L` for the latency percentiles. No hugepages
    /// (`--no-huge -s MB`), as the tools' README says.
    pub fn perf_args(
        self,
        trid: &str,
        client_cpu: usize,
        mem_mb: u32,
        runtime_secs: u64,
        warmup_secs: u64,
    ) -> Vec<String> {
        let mut args = vec![
            "--no-huge".into(),
            "-s".into(),
            mem_mb.to_string(),
            "-c".into(),
            format!("{:#x}", 1u128 << client_cpu.min(127)),
            "-q".into(),
            self.queue_depth().to_string(),
            "-o".into(),
            self.block_size_bytes().to_string(),
            "-w".into(),
            self.pattern().into(),
            "-t".into(),
            runtime_secs.to_string(),
        ];
        if warmup_secs > 0 {
            args.extend(["-a".into(), warmup_secs.to_string()]);
        }
        args.extend(["-L".into(), "-r".into(), trid.into()]);
        args
    }
}

/// What one perf run measured (its `Total` row and `-L` percentiles).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PerfMetrics {
    pub iops: f64,
    pub mib_per_sec: f64,
    pub lat_mean_us: f64,
    pub lat_min_us: f64,
    pub lat_max_us: f64,
    /// `None` when perf ran without `-L`.
    pub lat_p50_us: Option<f64>,
    pub lat_p99_us: Option<f64>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PerfParseError {
    #[error("spdk_nvme_perf printed no Total row (output starts {0:?})")]
    NoTotal(String),
    #[error("spdk_nvme_perf Total row is malformed: {0:?}")]
    BadTotal(String),
    #[error("spdk_nvme_perf completed no I/O")]
    NoIo,
    #[error("spdk_nvme_perf output is {0} bytes, over the limit")]
    TooLarge(usize),
}

/// Parses perf's standard output. Lines that are neither the `Total` row
/// nor a percentile of the first summary block (log lines, the per-namespace
/// rows, a `-LL` histogram) are ignored.
pub fn parse_perf_output(text: &str) -> Result<PerfMetrics, PerfParseError> {
    if text.len() > PERF_OUTPUT_BYTES_MAX {
        return Err(PerfParseError::TooLarge(text.len()));
    }
    let total = text
        .lines()
        .find_map(|l| {
            let (head, rest) = l.split_once(':')?;
            (head.trim() == "Total").then_some(rest)
        })
        .ok_or_else(|| PerfParseError::NoTotal(text.chars().take(80).collect()))?;
    let numbers: Vec<f64> = total
        .split_ascii_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|_| PerfParseError::BadTotal(total.trim().into()))?;
    let [iops, mib_per_sec, lat_mean_us, lat_min_us, lat_max_us] = numbers[..] else {
        return Err(PerfParseError::BadTotal(total.trim().into()));
    };
    if numbers.iter().any(|v| !v.is_finite() || *v < 0.0) {
        return Err(PerfParseError::BadTotal(total.trim().into()));
    }
    if iops == 0.0 {
        return Err(PerfParseError::NoIo);
    }
    let percentiles = summary_percentiles(text);
    let pick = |p: f64| {
        percentiles
            .iter()
            .find(|(q, _)| (q - p).abs() < 1e-9)
            .map(|(_, v)| *v)
    };
    Ok(PerfMetrics {
        iops,
        mib_per_sec,
        lat_mean_us,
        lat_min_us,
        lat_max_us,
        lat_p50_us: pick(50.0),
        lat_p99_us: pick(99.0),
    })
}

/// `(percent, µs)` pairs of the first "Summary latency data" block.
fn summary_percentiles(text: &str) -> Vec<(f64, f64)> {
    let mut lines = text
        .lines()
        .skip_while(|l| !l.starts_with("Summary latency data"))
        .skip(1)
        .skip_while(|l| l.starts_with('='));
    let mut out = Vec::new();
    for line in lines.by_ref() {
        let Some((pct, value)) = line.split_once("% :") else {
            break;
        };
        let parsed = (
            pct.trim().parse::<f64>(),
            value.trim().trim_end_matches("us").parse::<f64>(),
        );
        match parsed {
            (Ok(p), Ok(v)) => out.push((p, v)),
            _ => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Recorded against `lull serve --nvmf-listen` (perf's stdout and
    // stderr together, as a terminal shows them), SPDK v26.05.
    const RANDREAD_QD1_LL: &str =
        include_str!("../../tests/data/spdk_nvme_perf_randread_qd1_LL.txt");
    const RANDWRITE_QD32_L: &str =
        include_str!("../../tests/data/spdk_nvme_perf_randwrite_qd32_L.txt");
    const READ128K_QD32: &str = include_str!("../../tests/data/spdk_nvme_perf_read128k_qd32.txt");

    #[test]
    fn recorded_randread_qd1_with_histogram() {
        let m = parse_perf_output(RANDREAD_QD1_LL).unwrap();
        assert_eq!(
            m,
            PerfMetrics {
                iops: 22039.95,
                mib_per_sec: 86.09,
                lat_mean_us: 45.35,
                lat_min_us: 14.87,
                lat_max_us: 20106.01,
                lat_p50_us: Some(16.122),
                lat_p99_us: Some(45.643),
            }
        );
    }

    #[test]
    fn recorded_randwrite_qd32_summary_only() {
        let m = parse_perf_output(RANDWRITE_QD32_L).unwrap();
        assert_eq!((m.iops, m.mib_per_sec), (54857.00, 214.29));
        assert_eq!((m.lat_mean_us, m.lat_max_us), (584.57, 14775.61));
        assert_eq!(
            (m.lat_p50_us, m.lat_p99_us),
            (Some(214.398), Some(6967.923))
        );
    }

    #[test]
    fn recorded_read128k_without_percentiles() {
        let m = parse_perf_output(READ128K_QD32).unwrap();
        assert_eq!(
            (m.iops, m.mib_per_sec, m.lat_mean_us),
            (10391.86, 1298.98, 3072.15)
        );
        assert_eq!((m.lat_p50_us, m.lat_p99_us), (None, None));
    }

    #[test]
    fn odd_output_is_an_error_not_a_panic() {
        assert!(matches!(
            parse_perf_output(""),
            Err(PerfParseError::NoTotal(_))
        ));
        assert!(matches!(
            parse_perf_output("spdk_nvme_perf: connect failed\n"),
            Err(PerfParseError::NoTotal(_))
        ));
        for bad in [
            "Total : 1 2 3\n",
            "Total : 1 2 3 4 5 6\n",
            "Total : x 2 3 4 5\n",
            "Total : -1 2 3 4 5\n",
            "Total : NaN 2 3 4 5\n",
        ] {
            assert!(
                matches!(parse_perf_output(bad), Err(PerfParseError::BadTotal(_))),
                "{bad}"
            );
        }
        assert_eq!(
            parse_perf_output("Total : 0.00 0.00 0.00 0.00 0.00\n"),
            Err(PerfParseError::NoIo)
        );
        // A run cut short before the Total row.
        let cut = &RANDREAD_QD1_LL[..RANDREAD_QD1_LL.find("Total").unwrap()];
        assert!(matches!(
            parse_perf_output(cut),
            Err(PerfParseError::NoTotal(_))
        ));
        // A summary block cut inside a line keeps what came before it.
        let end = RANDREAD_QD1_LL.find(" 99.00000%").unwrap() + 5;
        let m = parse_perf_output(&RANDREAD_QD1_LL[..end]).unwrap();
        assert_eq!((m.lat_p50_us, m.lat_p99_us), (Some(16.122), None));
        let huge = "x".repeat(PERF_OUTPUT_BYTES_MAX + 1);
        assert!(matches!(
            parse_perf_output(&huge),
            Err(PerfParseError::TooLarge(_))
        ));
    }

    #[test]
    fn job_profile_and_args() {
        assert_eq!(NvmfJob::Read128kQd32.block_size_bytes(), 131072);
        assert_eq!(NvmfJob::RandwriteQd1.queue_depth(), 1);
        assert_eq!(NvmfJob::RandreadQd32.queue_depth(), 32);
        let args = NvmfJob::RandwriteQd32.perf_args("trtype:TCP x", 0, 256, 10, 2);
        assert_eq!(
            args.join(" "),
            "--no-huge -s 256 -c 0x1 -q 32 -o 4096 -w randwrite -t 10 -a 2 -L -r trtype:TCP x"
        );
        let args = NvmfJob::RandreadQd1.perf_args("t", 3, 64, 1, 0);
        assert!(!args.contains(&"-a".to_string()));
        assert!(args.contains(&"0x8".to_string()));
    }
}
