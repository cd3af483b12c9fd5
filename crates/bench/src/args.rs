//! Command-line arguments of `lull bench` and the resolved settings derived
//! from them (quick-mode defaults, core choice, sizes).

use std::path::PathBuf;

use clap::ValueEnum;
use serde::Serialize;

use crate::fio::JobKind;
use crate::BenchError;

/// Port range the harness walks through: one fresh port per server start, so a
/// port left in TIME_WAIT by the previous server is never reused at once.
pub const PORT_SPAN: u16 = 1000;

/// Default first port; far from 10809 so a real NBD server on the box is left
/// alone.
pub const DEFAULT_PORT_BASE: u16 = 20900;

/// Default replica-connection poll period of the hybrid mode, µs (lull's own
/// default for `--nvme-ioq-poll-period-us`).
pub const DEFAULT_HYBRID_PERIOD_US: u32 = 100;

/// Largest hybrid poll period accepted: 10 s. Anything longer would starve
/// the replica connections for a whole job.
pub const HYBRID_PERIOD_US_MAX: u32 = 10_000_000;

/// `lull bench`: fio's nbd engine with the kbench profile against lull in each
/// event mode and against peer NBD servers.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Short jobs (1 s, small volume, short idle window) for smoke runs.
    #[arg(long)]
    pub quick: bool,

    /// Jobs to run, comma separated.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = JobKind::ALL.to_vec())]
    pub jobs: Vec<JobKind>,

    /// lull event modes to measure, run in this order within each repeat; a
    /// mode the server refuses is reported as skipped with the server's
    /// error line.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Mode::DEFAULT_ORDER.to_vec())]
    pub modes: Vec<Mode>,

    /// Replica-connection poll periods of the hybrid mode, in µs, comma
    /// separated: hybrid is measured once per period, as
    /// `lull-hybrid@<period>-<volume>`, with `--nvme-ioq-poll-period-us`.
    #[arg(long, value_delimiter = ',', default_values_t = vec![DEFAULT_HYBRID_PERIOD_US],
          value_parser = clap::value_parser!(u32).range(1..=HYBRID_PERIOD_US_MAX as i64))]
    pub hybrid_periods: Vec<u32>,

    /// lull volume kinds to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = vec![VolumeKind::Malloc])]
    pub volumes: Vec<VolumeKind>,

    /// Peer servers to measure beside lull (`none` for lull only). A peer
    /// whose binary is missing is reported as skipped.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = vec![PeerChoice::Nbdkit, PeerChoice::QemuNbd])]
    pub peers: Vec<PeerChoice>,

    /// Skip lull itself (peers only); useful to check the harness.
    #[arg(long)]
    pub no_lull: bool,

    /// Repeat the whole interleaved schedule N times; the report gives the
    /// median and the min–max spread.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeat: u32,

    /// Measured seconds per job [default: 10, quick: 1].
    #[arg(long)]
    pub runtime_secs: Option<u64>,

    /// Warm-up seconds per job before measuring [default: 2, quick: 0.5].
    #[arg(long)]
    pub ramp_secs: Option<f64>,

    /// Idle window for the server's idle CPU, in seconds [default: 2, quick: 1].
    #[arg(long)]
    pub idle_secs: Option<f64>,

    /// Core the server under test is pinned to [default: the last core].
    #[arg(long)]
    pub server_cpu: Option<usize>,

    /// Core fio is pinned to [default: 0].
    #[arg(long)]
    pub client_cpu: Option<usize>,

    /// Volume size, e.g. 1G, 256M [default: 1G, quick: 256M].
    #[arg(long)]
    pub size: Option<String>,

    /// Directory for report.md, report.json and the plots.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,

    /// First TCP port used for servers; each start takes the next free one.
    #[arg(long, default_value_t = DEFAULT_PORT_BASE)]
    pub port_base: u16,
}

/// A lull reactor event mode (DESIGN §2).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Poll,
    Interrupt,
    Hybrid,
    Adaptive,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Poll, Mode::Interrupt, Mode::Hybrid, Mode::Adaptive];

    /// The default run order: poll and adaptive back to back, so that their
    /// per-repeat (paired) ratio compares runs a few seconds apart.
    pub const DEFAULT_ORDER: [Mode; 4] =
        [Mode::Poll, Mode::Adaptive, Mode::Interrupt, Mode::Hybrid];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Poll => "poll",
            Mode::Interrupt => "interrupt",
            Mode::Hybrid => "hybrid",
            Mode::Adaptive => "adaptive",
        }
    }
}

/// The kind of volume lull serves.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
pub enum VolumeKind {
    /// Memory backend.
    Malloc,
    /// File backend (io_uring) on a preallocated file in a temp dir.
    File,
    /// One local replica server on its own directory.
    Replica1,
    /// Two local replica servers, each on its own directory.
    Replica2,
}

impl VolumeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            VolumeKind::Malloc => "malloc",
            VolumeKind::File => "file",
            VolumeKind::Replica1 => "replica1",
            VolumeKind::Replica2 => "replica2",
        }
    }

    /// How many `lull replica` processes the volume needs.
    pub fn replica_count(self) -> usize {
        match self {
            VolumeKind::Malloc | VolumeKind::File => 0,
            VolumeKind::Replica1 => 1,
            VolumeKind::Replica2 => 2,
        }
    }
}

/// A peer NBD server the harness can start itself.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PeerChoice {
    /// `nbdkit memory`.
    Nbdkit,
    /// `qemu-nbd` on a raw file with io_uring.
    QemuNbd,
    /// No peers.
    None,
}

/// Settings after quick-mode defaults and core detection are applied.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub jobs: Vec<JobKind>,
    /// Hybrid-mode poll periods, µs, deduplicated in the given order.
    pub hybrid_periods_us: Vec<u32>,
    pub runtime_secs: u64,
    pub ramp_secs: f64,
    pub idle_secs: f64,
    pub repeat: u32,
    pub size_bytes: u64,
    pub server_cpu: usize,
    pub client_cpu: usize,
    pub port_base: u16,
    pub quick: bool,
}

impl Settings {
    /// Resolves defaults; `nproc` is the number of usable cores.
    pub fn resolve(args: &BenchArgs, nproc: usize) -> Result<Settings, BenchError> {
        let quick = args.quick;
        let size_text = args
            .size
            .clone()
            .unwrap_or_else(|| if quick { "256M" } else { "1G" }.into());
        let size_bytes = parse_size(&size_text).ok_or_else(|| {
            BenchError::BadArgs(format!(
                "bad --size {size_text:?} (want e.g. 1G, 256M, 4096)"
            ))
        })?;
        // fio's 128k jobs need at least one block, and the file backend wants
        // whole 4 KiB blocks.
        if size_bytes < 1 << 20 || size_bytes % 4096 != 0 {
            return Err(BenchError::BadArgs(format!(
                "--size {size_text} must be at least 1M and a multiple of 4K"
            )));
        }
        let last = nproc.saturating_sub(1);
        let server_cpu = args.server_cpu.unwrap_or(last);
        let client_cpu = args.client_cpu.unwrap_or(0);
        for (name, cpu) in [("--server-cpu", server_cpu), ("--client-cpu", client_cpu)] {
            if cpu >= nproc {
                return Err(BenchError::BadArgs(format!(
                    "{name} {cpu} but only {nproc} cores"
                )));
            }
        }
        let runtime_secs = args.runtime_secs.unwrap_or(if quick { 1 } else { 10 });
        if runtime_secs == 0 {
            return Err(BenchError::BadArgs(
                "--runtime-secs must be at least 1".into(),
            ));
        }
        let ramp_secs = args.ramp_secs.unwrap_or(if quick { 0.5 } else { 2.0 });
        let idle_secs = args.idle_secs.unwrap_or(if quick { 1.0 } else { 2.0 });
        for (name, v) in [("--ramp-secs", ramp_secs), ("--idle-secs", idle_secs)] {
            if !(0.0..=3600.0).contains(&v) {
                return Err(BenchError::BadArgs(format!(
                    "{name} {v} out of range 0..=3600"
                )));
            }
        }
        let mut jobs = Vec::new();
        for j in &args.jobs {
            if !jobs.contains(j) {
                jobs.push(*j);
            }
        }
        if jobs.is_empty() {
            return Err(BenchError::BadArgs("--jobs is empty".into()));
        }
        let mut hybrid_periods_us = Vec::new();
        for &p in &args.hybrid_periods {
            if !(1..=HYBRID_PERIOD_US_MAX).contains(&p) {
                return Err(BenchError::BadArgs(format!(
                    "--hybrid-periods {p} out of range 1..={HYBRID_PERIOD_US_MAX}"
                )));
            }
            if !hybrid_periods_us.contains(&p) {
                hybrid_periods_us.push(p);
            }
        }
        if hybrid_periods_us.is_empty() {
            return Err(BenchError::BadArgs("--hybrid-periods is empty".into()));
        }
        if args.port_base == 0 || args.port_base > u16::MAX - PORT_SPAN {
            return Err(BenchError::BadArgs(format!(
                "--port-base must be in 1..={}",
                u16::MAX - PORT_SPAN
            )));
        }
        Ok(Settings {
            jobs,
            hybrid_periods_us,
            runtime_secs,
            ramp_secs,
            idle_secs,
            repeat: args.repeat,
            size_bytes,
            server_cpu,
            client_cpu,
            port_base: args.port_base,
            quick,
        })
    }
}

/// Parses `1G`, `256M`, `512K`, `4096`, `1GiB`, `1g` (binary units).
pub fn parse_size(text: &str) -> Option<u64> {
    lull_bdev::parse_size_bytes(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("256M"), Some(256 << 20));
        assert_eq!(parse_size("256MiB"), Some(256 << 20));
        assert_eq!(parse_size("4k"), Some(4096));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("G"), None);
        assert_eq!(parse_size("x1G"), None);
        assert_eq!(parse_size("99999999999T"), None);
    }

    #[test]
    fn defaults_and_quick() {
        let cli = Cli::parse_from(["bench"]);
        let s = Settings::resolve(&cli.bench, 2).unwrap();
        assert_eq!(s.jobs.len(), 6);
        assert_eq!(s.size_bytes, 1 << 30);
        assert_eq!((s.server_cpu, s.client_cpu), (1, 0));
        assert_eq!(cli.bench.modes, Mode::DEFAULT_ORDER);
        assert_eq!(cli.bench.volumes, vec![VolumeKind::Malloc]);
        assert_eq!(s.hybrid_periods_us, vec![DEFAULT_HYBRID_PERIOD_US]);
        assert_eq!(
            cli.bench.peers,
            vec![PeerChoice::Nbdkit, PeerChoice::QemuNbd]
        );

        let cli = Cli::parse_from([
            "bench",
            "--quick",
            "--jobs",
            "randread-lat,randread-lat",
            "--peers",
            "none",
            "--modes",
            "poll",
        ]);
        let s = Settings::resolve(&cli.bench, 2).unwrap();
        assert_eq!(s.jobs, vec![JobKind::RandreadLat]);
        assert_eq!(s.runtime_secs, 1);
        assert_eq!(s.size_bytes, 256 << 20);
        assert_eq!(cli.bench.peers, vec![PeerChoice::None]);
    }

    #[test]
    fn rejects_bad_cores_and_sizes() {
        let cli = Cli::parse_from(["bench", "--server-cpu", "5"]);
        assert!(Settings::resolve(&cli.bench, 2).is_err());
        let cli = Cli::parse_from(["bench", "--size", "1000"]);
        assert!(Settings::resolve(&cli.bench, 2).is_err());
        assert!(Cli::try_parse_from(["bench", "--jobs", "nope"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--repeat", "0"]).is_err());
    }

    #[test]
    fn hybrid_periods_and_replica1() {
        let cli = Cli::parse_from([
            "bench",
            "--hybrid-periods",
            "10,1000,10",
            "--volumes",
            "replica1,replica2",
        ]);
        assert_eq!(cli.bench.hybrid_periods, vec![10, 1000, 10]);
        let s = Settings::resolve(&cli.bench, 2).unwrap();
        assert_eq!(s.hybrid_periods_us, vec![10, 1000]);
        assert_eq!(
            cli.bench.volumes,
            vec![VolumeKind::Replica1, VolumeKind::Replica2]
        );
        assert_eq!(
            cli.bench
                .volumes
                .iter()
                .map(|v| v.replica_count())
                .collect::<Vec<_>>(),
            [1, 2]
        );
        let cli = Cli::parse_from(["bench", "--hybrid-periods", "1"]);
        assert_eq!(cli.bench.hybrid_periods, vec![1]);
        for bad in ["0", "-5", "x", "10,", "10000001"] {
            assert!(
                Cli::try_parse_from(["bench", "--hybrid-periods", bad]).is_err(),
                "{bad}"
            );
        }
        // Built without clap (as a library caller may): still checked.
        let mut args = Cli::parse_from(["bench"]).bench;
        args.hybrid_periods = vec![];
        assert!(Settings::resolve(&args, 2).is_err());
        args.hybrid_periods = vec![0];
        assert!(Settings::resolve(&args, 2).is_err());
    }
}
