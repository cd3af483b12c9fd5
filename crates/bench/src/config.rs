//! What a `lull bench` run is asked to measure ([`BenchConfig`], which the
//! binary fills from its flags) and the settings resolved from it
//! (quick-mode defaults, core choice, sizes).

use std::path::PathBuf;

use lull_reactor::Mode;
use serde::Serialize;

use crate::fio::JobKind;
use crate::nvmf::perf::NvmfJob;
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

/// Default `repeat`: one pass over the schedule.
pub const DEFAULT_REPEAT: u32 = 1;

/// Most repeats a run takes: each repeat runs every job on every target, so
/// 100 already means hours.
pub const REPEAT_MAX: u32 = 100;

/// Default directory for report.md, report.json and the plots.
pub const DEFAULT_OUT_DIR: &str = "bench-out";

/// The default run order of the modes: poll and adaptive back to back, so
/// that their per-repeat (paired) ratio compares runs a few seconds apart.
pub const DEFAULT_MODE_ORDER: [Mode; 4] =
    [Mode::Poll, Mode::Adaptive, Mode::Interrupt, Mode::Hybrid];

/// Default volume kinds measured.
pub const DEFAULT_VOLUMES: [VolumeKind; 1] = [VolumeKind::Malloc];

/// Default peers measured beside lull.
pub const DEFAULT_PEERS: [PeerChoice; 2] = [PeerChoice::Nbdkit, PeerChoice::QemuNbd];

/// Default SPDK peers of the NVMe/TCP profile: nvmf_tgt in both its modes.
pub const DEFAULT_SPDK_PEERS: [SpdkPeer; 2] = [SpdkPeer::Poll, SpdkPeer::Interrupt];

/// What a `lull bench` run measures, as given: [`Settings::resolve`] fills
/// in the quick-mode defaults and checks it. `lull bench`'s flags map one
/// to one onto these fields; [`Default`] is a run with no flag.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchConfig {
    /// Which benchmark: fio over NBD (kbench) or spdk_nvme_perf over
    /// NVMe/TCP.
    pub profile: Profile,
    /// Short jobs (1 s, small volume, short idle window) for smoke runs.
    pub quick: bool,
    /// Jobs to run.
    pub jobs: Vec<JobKind>,
    /// lull event modes to measure, run in this order within each repeat; a
    /// mode the server refuses is reported as skipped with the server's
    /// error line.
    pub modes: Vec<Mode>,
    /// Replica-connection poll periods of the hybrid mode, in µs: hybrid is
    /// measured once per period, as `lull-hybrid@<period>-<volume>`, with
    /// `--nvme-ioq-poll-period-us`.
    pub hybrid_periods: Vec<u32>,
    /// lull volume kinds to measure.
    pub volumes: Vec<VolumeKind>,
    /// Peer servers to measure beside lull. A peer whose binary is missing
    /// is reported as skipped.
    pub peers: Vec<PeerChoice>,
    /// Skip lull itself (peers only); useful to check the harness.
    pub no_lull: bool,
    /// Repeat the whole interleaved schedule N times; the report gives the
    /// median and the min–max spread.
    pub repeat: u32,
    /// Measured seconds per job [default: 10, quick: 1].
    pub runtime_secs: Option<u64>,
    /// Warm-up seconds per job before measuring [default: 2, quick: 0.5].
    pub ramp_secs: Option<f64>,
    /// Idle window for the server's idle CPU, in seconds [default: 2, quick: 1].
    pub idle_secs: Option<f64>,
    /// Core the server under test is pinned to [default: the last core].
    pub server_cpu: Option<usize>,
    /// Core fio is pinned to [default: 0].
    pub client_cpu: Option<usize>,
    /// Volume size, e.g. 1G, 256M [default: 1G, quick: 256M].
    pub size: Option<String>,
    /// Directory for report.md, report.json and the plots.
    pub out: PathBuf,
    /// First TCP port used for servers; each start takes the next free one.
    pub port_base: u16,
    /// NVMe/TCP profile: the directory of SPDK's prebuilt tools (with
    /// `bin/spdk_nvme_perf` and `bin/nvmf_tgt`) [default:
    /// `$LULL_SPDK_TOOLS`, else `../shared/tools/spdk` from the current
    /// directory or from the repository lull was built in].
    pub spdk_tools: Option<PathBuf>,
    /// NVMe/TCP profile: the perf jobs to run.
    pub nvmf_jobs: Vec<NvmfJob>,
    /// NVMe/TCP profile: SPDK nvmf_tgt modes measured beside lull.
    pub spdk_peers: Vec<SpdkPeer>,
}

impl Default for BenchConfig {
    fn default() -> BenchConfig {
        BenchConfig {
            profile: Profile::Kbench,
            quick: false,
            jobs: JobKind::ALL.to_vec(),
            modes: DEFAULT_MODE_ORDER.to_vec(),
            hybrid_periods: vec![DEFAULT_HYBRID_PERIOD_US],
            volumes: DEFAULT_VOLUMES.to_vec(),
            peers: DEFAULT_PEERS.to_vec(),
            no_lull: false,
            repeat: DEFAULT_REPEAT,
            runtime_secs: None,
            ramp_secs: None,
            idle_secs: None,
            server_cpu: None,
            client_cpu: None,
            size: None,
            out: PathBuf::from(DEFAULT_OUT_DIR),
            port_base: DEFAULT_PORT_BASE,
            spdk_tools: None,
            nvmf_jobs: NvmfJob::ALL.to_vec(),
            spdk_peers: DEFAULT_SPDK_PEERS.to_vec(),
        }
    }
}

/// Which benchmark `lull bench` runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// fio's nbd engine, the kbench jobs, against NBD peers.
    Kbench,
    /// spdk_nvme_perf over NVMe/TCP against SPDK's nvmf_tgt (issue 16).
    Nvmf,
}

impl Profile {
    pub const ALL: [Profile; 2] = [Profile::Kbench, Profile::Nvmf];

    pub fn as_str(self) -> &'static str {
        match self {
            Profile::Kbench => "kbench",
            Profile::Nvmf => "nvmf",
        }
    }
}

/// SPDK's nvmf_tgt as a peer of the NVMe/TCP profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SpdkPeer {
    /// nvmf_tgt's default: its reactor polls all the time.
    Poll,
    /// nvmf_tgt `--interrupt-mode`.
    Interrupt,
    /// nvmf_tgt polling, with its TCP transport's `c2h_success` off: a
    /// CapsuleResp after every read's data, as the NVMe/TCP transport
    /// spec asks of a target whose host keeps SQ flow control on (SPDK's
    /// initiator does) and as lull sends. nvmf_tgt's default instead
    /// marks the C2HData PDU SUCCESS and sends no CapsuleResp, one PDU a
    /// read fewer (docs/NVMF.md, "C2HData SUCCESS").
    PollResp,
    /// No SPDK target (lull only).
    None,
}

impl SpdkPeer {
    pub const ALL: [SpdkPeer; 4] = [
        SpdkPeer::Poll,
        SpdkPeer::Interrupt,
        SpdkPeer::PollResp,
        SpdkPeer::None,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SpdkPeer::Poll => "poll",
            SpdkPeer::Interrupt => "interrupt",
            SpdkPeer::PollResp => "poll-resp",
            SpdkPeer::None => "none",
        }
    }
}

/// The kind of volume lull serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, PartialOrd, Ord)]
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
    pub const ALL: [VolumeKind; 4] = [
        VolumeKind::Malloc,
        VolumeKind::File,
        VolumeKind::Replica1,
        VolumeKind::Replica2,
    ];

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
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PeerChoice {
    /// `nbdkit memory`.
    Nbdkit,
    /// `qemu-nbd` on a raw file with io_uring.
    QemuNbd,
    /// No peers.
    None,
}

impl PeerChoice {
    pub const ALL: [PeerChoice; 3] = [PeerChoice::Nbdkit, PeerChoice::QemuNbd, PeerChoice::None];

    pub fn as_str(self) -> &'static str {
        match self {
            PeerChoice::Nbdkit => "nbdkit",
            PeerChoice::QemuNbd => "qemu-nbd",
            PeerChoice::None => "none",
        }
    }
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
    pub fn resolve(args: &BenchConfig, nproc: usize) -> Result<Settings, BenchError> {
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
        let s = Settings::resolve(&BenchConfig::default(), 2).unwrap();
        assert_eq!(s.jobs.len(), 6);
        assert_eq!(s.size_bytes, 1 << 30);
        assert_eq!((s.server_cpu, s.client_cpu), (1, 0));
        assert_eq!(s.hybrid_periods_us, vec![DEFAULT_HYBRID_PERIOD_US]);

        let config = BenchConfig {
            quick: true,
            jobs: vec![JobKind::RandreadLat, JobKind::RandreadLat],
            ..BenchConfig::default()
        };
        let s = Settings::resolve(&config, 2).unwrap();
        assert_eq!(s.jobs, vec![JobKind::RandreadLat]);
        assert_eq!(s.runtime_secs, 1);
        assert_eq!(s.size_bytes, 256 << 20);
    }

    #[test]
    fn rejects_bad_cores_and_sizes() {
        let config = BenchConfig {
            server_cpu: Some(5),
            ..BenchConfig::default()
        };
        assert!(Settings::resolve(&config, 2).is_err());
        let config = BenchConfig {
            size: Some("1000".into()),
            ..BenchConfig::default()
        };
        assert!(Settings::resolve(&config, 2).is_err());
    }

    #[test]
    fn hybrid_periods_and_replica1() {
        let config = BenchConfig {
            hybrid_periods: vec![10, 1000, 10],
            volumes: vec![VolumeKind::Replica1, VolumeKind::Replica2],
            ..BenchConfig::default()
        };
        let s = Settings::resolve(&config, 2).unwrap();
        assert_eq!(s.hybrid_periods_us, vec![10, 1000]);
        assert_eq!(
            config
                .volumes
                .iter()
                .map(|v| v.replica_count())
                .collect::<Vec<_>>(),
            [1, 2]
        );
        // Not parsed from flags (as a library caller may): still checked.
        for bad in [vec![], vec![0]] {
            let config = BenchConfig {
                hybrid_periods: bad,
                ..BenchConfig::default()
            };
            assert!(Settings::resolve(&config, 2).is_err());
        }
    }
}
