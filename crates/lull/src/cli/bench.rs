//! `lull bench`: its flags, turned into a [`lull_bench::BenchConfig`], and
//! the exit code of a run.

use std::path::PathBuf;
use std::process::ExitCode;

use lull_bench::config::{
    BenchConfig, DEFAULT_HYBRID_PERIOD_US, DEFAULT_MODE_ORDER, DEFAULT_OUT_DIR, DEFAULT_PEERS,
    DEFAULT_PORT_BASE, DEFAULT_REPEAT, DEFAULT_SPDK_PEERS, DEFAULT_VOLUMES, HYBRID_PERIOD_US_MAX,
    REPEAT_MAX,
};
use lull_bench::nvmf::perf::NvmfJob;
use lull_bench::{JobKind, PeerChoice, Profile, SpdkPeer, VolumeKind};
use lull_reactor::Mode;

use crate::cli::choice::{self, names};
use crate::cli::usage_error;

/// `lull bench`: fio's nbd engine with the kbench profile against lull in each
/// event mode and against peer NBD servers; or, with `--profile nvmf`,
/// SPDK's spdk_nvme_perf over NVMe/TCP against lull and SPDK's nvmf_tgt.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Which benchmark: `kbench` (fio over NBD; --jobs, --volumes, --peers,
    /// --hybrid-periods) or `nvmf` (spdk_nvme_perf over NVMe/TCP against a
    /// memory volume; --nvmf-jobs, --spdk-peers, --spdk-tools).
    #[arg(long, value_parser = choice::parser::<Profile>(), default_value = "kbench")]
    pub profile: Profile,

    /// Short jobs (1 s, small volume, short idle window) for smoke runs.
    #[arg(long)]
    pub quick: bool,

    /// Jobs to run, comma separated.
    #[arg(long, value_parser = choice::parser::<JobKind>(), value_delimiter = ',',
          default_values = names(&JobKind::ALL))]
    pub jobs: Vec<JobKind>,

    /// lull event modes to measure, run in this order within each repeat; a
    /// mode the server refuses is reported as skipped with the server's
    /// error line.
    #[arg(long, value_parser = choice::parser::<Mode>(), value_delimiter = ',',
          default_values = names(&DEFAULT_MODE_ORDER))]
    pub modes: Vec<Mode>,

    /// Replica-connection poll periods of the hybrid mode, in µs, comma
    /// separated: hybrid is measured once per period, as
    /// `lull-hybrid@<period>-<volume>`, with `--nvme-ioq-poll-period-us`.
    #[arg(long, value_delimiter = ',', default_values_t = vec![DEFAULT_HYBRID_PERIOD_US],
          value_parser = clap::value_parser!(u32).range(1..=HYBRID_PERIOD_US_MAX as i64))]
    pub hybrid_periods: Vec<u32>,

    /// lull volume kinds to measure.
    #[arg(long, value_parser = choice::parser::<VolumeKind>(), value_delimiter = ',',
          default_values = names(&DEFAULT_VOLUMES))]
    pub volumes: Vec<VolumeKind>,

    /// Peer servers to measure beside lull (`none` for lull only). A peer
    /// whose binary is missing is reported as skipped.
    #[arg(long, value_parser = choice::parser::<PeerChoice>(), value_delimiter = ',',
          default_values = names(&DEFAULT_PEERS))]
    pub peers: Vec<PeerChoice>,

    /// Skip lull itself (peers only); useful to check the harness.
    #[arg(long)]
    pub no_lull: bool,

    /// Repeat the whole interleaved schedule N times; the report gives the
    /// median and the min–max spread.
    #[arg(long, default_value_t = DEFAULT_REPEAT,
          value_parser = clap::value_parser!(u32).range(1..=REPEAT_MAX as i64))]
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
    #[arg(long, default_value = DEFAULT_OUT_DIR)]
    pub out: PathBuf,

    /// First TCP port used for servers; each start takes the next free one.
    #[arg(long, default_value_t = DEFAULT_PORT_BASE)]
    pub port_base: u16,

    /// `--profile nvmf`: directory of SPDK's prebuilt tools (bin/spdk_nvme_perf,
    /// bin/nvmf_tgt) [default: $LULL_SPDK_TOOLS, else ../shared/tools/spdk
    /// from the current directory or from the repository lull was built in].
    #[arg(long)]
    pub spdk_tools: Option<PathBuf>,

    /// `--profile nvmf`: spdk_nvme_perf jobs to run, comma separated.
    #[arg(long, value_parser = choice::parser::<NvmfJob>(), value_delimiter = ',',
          default_values = names(&NvmfJob::ALL))]
    pub nvmf_jobs: Vec<NvmfJob>,

    /// `--profile nvmf`: SPDK nvmf_tgt modes measured beside lull (malloc
    /// bdev, same core as lull), or `none`.
    #[arg(long, value_parser = choice::parser::<SpdkPeer>(), value_delimiter = ',',
          default_values = names(&DEFAULT_SPDK_PEERS))]
    pub spdk_peers: Vec<SpdkPeer>,
}

impl BenchArgs {
    /// The library's configuration: the flags as they are (defaults and
    /// checks are [`lull_bench::Settings::resolve`]'s).
    pub fn config(&self) -> BenchConfig {
        BenchConfig {
            profile: self.profile,
            quick: self.quick,
            jobs: self.jobs.clone(),
            modes: self.modes.clone(),
            hybrid_periods: self.hybrid_periods.clone(),
            volumes: self.volumes.clone(),
            peers: self.peers.clone(),
            no_lull: self.no_lull,
            repeat: self.repeat,
            runtime_secs: self.runtime_secs,
            ramp_secs: self.ramp_secs,
            idle_secs: self.idle_secs,
            server_cpu: self.server_cpu,
            client_cpu: self.client_cpu,
            size: self.size.clone(),
            out: self.out.clone(),
            port_base: self.port_base,
            spdk_tools: self.spdk_tools.clone(),
            nvmf_jobs: self.nvmf_jobs.clone(),
            spdk_peers: self.spdk_peers.clone(),
        }
    }
}

/// `lull bench`: exit 0 with a one-line summary, 2 for arguments the
/// harness refuses, 1 for other failures.
pub fn run(args: &BenchArgs) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("lull: error: cannot find the lull binary: {e}");
            return ExitCode::FAILURE;
        }
    };
    let config = args.config();
    let outcome = match config.profile {
        Profile::Kbench => {
            lull_bench::run(&config, &exe).map(|r| (r.targets.len(), r.results.len()))
        }
        Profile::Nvmf => {
            lull_bench::nvmf::run(&config, &exe).map(|r| (r.targets.len(), r.results.len()))
        }
    };
    match outcome {
        Ok((targets, results)) => {
            println!(
                "bench: {targets} targets, {results} results, report in {}",
                args.out.display()
            );
            ExitCode::SUCCESS
        }
        Err(lull_bench::BenchError::BadArgs(m)) => usage_error(m),
        Err(e) => {
            eprintln!("lull: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use lull_bench::Settings;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn flag_defaults_are_the_library_defaults() {
        let cli = Cli::parse_from(["bench"]);
        assert_eq!(cli.bench.config(), BenchConfig::default());
        assert_eq!(cli.bench.modes, DEFAULT_MODE_ORDER);
        assert_eq!(cli.bench.jobs, JobKind::ALL);
    }

    #[test]
    fn defaults_and_quick() {
        let cli = Cli::parse_from(["bench"]);
        let s = Settings::resolve(&cli.bench.config(), 2).unwrap();
        assert_eq!(s.jobs.len(), 6);
        assert_eq!(s.size_bytes, 1 << 30);
        assert_eq!((s.server_cpu, s.client_cpu), (1, 0));
        assert_eq!(cli.bench.modes, DEFAULT_MODE_ORDER);
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
        let s = Settings::resolve(&cli.bench.config(), 2).unwrap();
        assert_eq!(s.jobs, vec![JobKind::RandreadLat]);
        assert_eq!(s.runtime_secs, 1);
        assert_eq!(s.size_bytes, 256 << 20);
        assert_eq!(cli.bench.peers, vec![PeerChoice::None]);
        assert_eq!(cli.bench.modes, vec![Mode::Poll]);
    }

    #[test]
    fn nvmf_profile_flags() {
        let cli = Cli::parse_from(["bench"]);
        assert_eq!(cli.bench.profile, Profile::Kbench);
        assert_eq!(cli.bench.nvmf_jobs, NvmfJob::ALL);
        assert_eq!(cli.bench.spdk_peers, DEFAULT_SPDK_PEERS);
        let cli = Cli::parse_from([
            "bench",
            "--profile",
            "nvmf",
            "--nvmf-jobs",
            "randread-qd1,read128k-qd32",
            "--spdk-peers",
            "interrupt",
            "--spdk-tools",
            "tools/spdk",
        ]);
        let c = cli.bench.config();
        assert_eq!(c.profile, Profile::Nvmf);
        assert_eq!(c.nvmf_jobs, [NvmfJob::RandreadQd1, NvmfJob::Read128kQd32]);
        assert_eq!(c.spdk_peers, [SpdkPeer::Interrupt]);
        assert_eq!(
            c.spdk_tools.as_deref(),
            Some(std::path::Path::new("tools/spdk"))
        );
        assert!(Cli::try_parse_from(["bench", "--profile", "iscsi"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--nvmf-jobs", "randread-qd64"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--spdk-peers", "hybrid"]).is_err());
    }

    #[test]
    fn rejects_bad_values() {
        let cli = Cli::parse_from(["bench", "--server-cpu", "5"]);
        assert!(Settings::resolve(&cli.bench.config(), 2).is_err());
        let cli = Cli::parse_from(["bench", "--size", "1000"]);
        assert!(Settings::resolve(&cli.bench.config(), 2).is_err());
        assert!(Cli::try_parse_from(["bench", "--jobs", "nope"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--modes", "spin"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--repeat", "0"]).is_err());
    }

    #[test]
    fn hybrid_periods_and_volumes() {
        let cli = Cli::parse_from([
            "bench",
            "--hybrid-periods",
            "10,1000,10",
            "--volumes",
            "replica1,replica2",
        ]);
        assert_eq!(cli.bench.hybrid_periods, vec![10, 1000, 10]);
        let s = Settings::resolve(&cli.bench.config(), 2).unwrap();
        assert_eq!(s.hybrid_periods_us, vec![10, 1000]);
        assert_eq!(
            cli.bench.volumes,
            vec![VolumeKind::Replica1, VolumeKind::Replica2]
        );
        let cli = Cli::parse_from(["bench", "--hybrid-periods", "1"]);
        assert_eq!(cli.bench.hybrid_periods, vec![1]);
        for bad in ["0", "-5", "x", "10,", "10000001"] {
            assert!(
                Cli::try_parse_from(["bench", "--hybrid-periods", bad]).is_err(),
                "{bad}"
            );
        }
    }
}
