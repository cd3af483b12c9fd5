//! `lull bench --profile nvmf`: SPDK's `spdk_nvme_perf` over NVMe/TCP
//! against `lull serve --nvmf-listen` in each event mode and against SPDK's
//! own `nvmf_tgt` (poll and interrupt mode, malloc bdev), the server's CPU
//! sampled from `/proc/PID/task/*/schedstat` (issue 16).
//!
//! ```no_run
//! use lull_bench::config::{BenchConfig, Profile};
//! let config = BenchConfig { profile: Profile::Nvmf, quick: true, ..BenchConfig::default() };
//! let report = lull_bench::nvmf::run(&config, std::path::Path::new("target/release/lull")).unwrap();
//! println!("{} cells", report.results.len());
//! ```
//!
//! How a run goes: the targets run one at a time, each started afresh
//! pinned to `--server-cpu` (one reactor: lull `--cores N`, nvmf_tgt
//! `-m 1<<N`) with a memory volume of `--size` (nvmf_tgt: `bdev_malloc` with
//! 4 KiB blocks). On a target's first job of each repeat its idle CPU is
//! measured over `--idle-secs` before any host connects. Then every block of
//! the volume is written once ([`Ctx::fill`]: 1 s of sequential 128 KiB
//! writes at depth 32, checked to cover the volume), so that no target
//! reads never-written memory (lull's memory volume answers those from no
//! memory at all, nvmf_tgt's malloc bdev from zeroed memory) or takes the
//! first-touch page faults of a fresh volume inside the measured window.
//! perf runs pinned to
//! `--client-cpu` (`-c 1<<N`): `-a` warm-up seconds (`--ramp-secs` rounded
//! up), then `-t --runtime-secs` measured. The server's CPU window opens
//! [`WINDOW_MARGIN`] after the warm-up ends (counted from perf's
//! "Launching workers" line) and closes `WINDOW_MARGIN` before the measured
//! run ends, so it lies inside perf's measured window. CPU-µs per I/O is the
//! window's CPU time over (perf's IOPS × the window's length).
//!
//! Output in `--out`: report.json ([`report::NvmfReport`], every run's
//! numbers), report.md, and perf's own output of every run in `raw/`.
//!
//! Order: within a repeat, job by job, every target once; the target order
//! is reversed in every other repeat, so no target always runs first.
//!
//! # Layout
//!
//! - `perf`: the NVMe/TCP job profile and `spdk_nvme_perf`'s output.
//! - `report`: report.json and report.md of a `--profile nvmf` run.

pub mod perf;
pub mod report;

use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

use lull_reactor::Mode;
use serde::Serialize;

use crate::config::{BenchConfig, Profile, Settings, SpdkPeer, VolumeKind};
use crate::env::procstat;
use crate::server::{self, Group, Ports, Proc, WorkDir};
use crate::{io_err, size_arg, BenchError, SETTLE};
use perf::{NvmfJob, PerfMetrics, PERF_LAUNCH_LINE};
use report::{CpuWindow, NvmfReport, NvmfSample, NvmfSettings, NvmfTargetReport};

/// Environment variable naming the SPDK tools directory (as the tests use).
pub const SPDK_TOOLS_ENV: &str = "LULL_SPDK_TOOLS";
/// Where the SPDK tools are when neither `--spdk-tools` nor the environment
/// says: beside the repository, as the project's machines lay it out.
pub const DEFAULT_SPDK_TOOLS: &str = "../shared/tools/spdk";
/// Volume size of the profile unless `--size` says: nvmf_tgt's malloc bdev
/// must fit in its DPDK memory (the tools' README: 128 MiB fits `-s 1024`,
/// 256 MiB did not).
pub const DEFAULT_NVMF_SIZE: &str = "128M";
/// DPDK memory of nvmf_tgt besides its malloc bdev, MiB: its buffer pools
/// (the tools' README ran it with `-s 1024` and a 128 MiB bdev).
pub const TGT_MEM_BASE_MB: u64 = 1024;
/// DPDK memory of perf, MiB (README: 32–256 worked); its QD32 × 128 KiB
/// buffers need 4 MiB.
pub const PERF_MEM_MB: u32 = 256;
/// How long perf may take to attach the controller and print its
/// [`PERF_LAUNCH_LINE`]: DPDK initialisation without hugepages takes ~1 s
/// on an idle machine.
pub const PERF_START_TIMEOUT: Duration = Duration::from_secs(30);
/// How far inside perf's measured window the server's CPU window starts and
/// ends: perf starts its workers a few ms after printing the launch line.
pub const WINDOW_MARGIN: Duration = Duration::from_millis(100);
/// The fill before each job ([`Ctx::fill`]): seconds of sequential
/// writes. At the slowest target's ~500 MiB/s this writes a 128 MiB
/// volume about four times over; the fill checks that it covered it.
pub const FILL_SECS: u64 = 1;
/// A fill that did not cover the volume (a loaded machine, a slow target)
/// runs again for as long as its measured rate says covering takes, twice
/// over, at most this long: the fill is set-up, not the measurement.
pub const FILL_SECS_MAX: u64 = 20;
/// The fill's I/O size: large writes fill fast.
pub const FILL_IO_BYTES: u64 = 128 * 1024;
/// The fill's queue depth, as the QD32 jobs'.
pub const FILL_QUEUE_DEPTH: u32 = 32;
/// How long a fill may take beyond its own seconds (perf's start-up).
pub const FILL_TIMEOUT: Duration = Duration::from_secs(30);

/// Extra time perf gets beyond warm-up + runtime before it is killed.
pub const PERF_GRACE: Duration = Duration::from_secs(30);
/// The NQN nvmf_tgt serves its malloc bdev under.
pub const SPDK_NQN: &str = "nqn.2016-06.io.spdk:bench";
/// Where DPDK, run as root, makes each SPDK process's runtime directory
/// (`spdk_pid<PID>`); without hugepages it stays empty and is left behind.
pub const DPDK_RUNTIME_DIR: &str = "/var/run/dpdk";
/// Subdirectory of `--out` that keeps each perf run's standard output, as
/// `r<repeat>-<job>-<target>.txt`.
pub const RAW_DIR: &str = "raw";
/// The volume name lull serves (its NQN is `nqn.2026-11.io.lull:bench`).
pub const VOLUME_NAME: &str = "bench";

/// A target of the NVMe/TCP profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum NvmfTarget {
    /// `lull serve --nvmf-listen` with a memory volume.
    Lull { mode: Mode },
    /// SPDK's `nvmf_tgt` with a malloc bdev; `c2h_success`: its TCP
    /// transport's option of that name (true by default: a read's data
    /// PDU marked SUCCESS, no CapsuleResp, whatever the host's SQ flow
    /// control).
    Spdk { interrupt: bool, c2h_success: bool },
}

impl NvmfTarget {
    /// `lull-poll`, `spdk-interrupt`, …
    pub fn name(&self) -> String {
        match self {
            NvmfTarget::Lull { mode } => format!("lull-{}", mode.as_str()),
            NvmfTarget::Spdk {
                interrupt: false,
                c2h_success: true,
            } => "spdk-poll".into(),
            NvmfTarget::Spdk {
                interrupt: false,
                c2h_success: false,
            } => "spdk-poll-resp".into(),
            NvmfTarget::Spdk {
                interrupt: true,
                c2h_success: true,
            } => "spdk-interrupt".into(),
            NvmfTarget::Spdk {
                interrupt: true,
                c2h_success: false,
            } => "spdk-interrupt-resp".into(),
        }
    }

    pub fn is_spdk(&self) -> bool {
        matches!(self, NvmfTarget::Spdk { .. })
    }
}

/// Targets in report order: lull's modes as given, then SPDK's.
pub fn targets(modes: &[Mode], spdk: &[SpdkPeer]) -> Vec<NvmfTarget> {
    let mut out = Vec::new();
    let all = modes
        .iter()
        .map(|&mode| Some(NvmfTarget::Lull { mode }))
        .chain(spdk.iter().map(|p| match p {
            SpdkPeer::Poll => Some(NvmfTarget::Spdk {
                interrupt: false,
                c2h_success: true,
            }),
            SpdkPeer::Interrupt => Some(NvmfTarget::Spdk {
                interrupt: true,
                c2h_success: true,
            }),
            SpdkPeer::PollResp => Some(NvmfTarget::Spdk {
                interrupt: false,
                c2h_success: false,
            }),
            SpdkPeer::None => None,
        }));
    for t in all.flatten() {
        if !out.contains(&t) {
            out.push(t);
        }
    }
    out
}

/// One server start + one perf run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub repeat: u32,
    pub job: NvmfJob,
    pub target: usize,
    pub measure_idle: bool,
}

/// The run order: per repeat, per job, every target; targets forward in
/// even repeats, reversed in odd ones.
///
/// ```
/// use lull_bench::nvmf::{schedule, perf::NvmfJob};
/// let s = schedule(2, &[NvmfJob::RandreadQd1], 3);
/// let order: Vec<usize> = s.iter().map(|s| s.target).collect();
/// assert_eq!(order, [0, 1, 2, 2, 1, 0]);
/// ```
pub fn schedule(repeats: u32, jobs: &[NvmfJob], target_count: usize) -> Vec<Step> {
    let mut steps = Vec::with_capacity(repeats as usize * jobs.len() * target_count);
    for repeat in 0..repeats {
        for (j, &job) in jobs.iter().enumerate() {
            for k in 0..target_count {
                let target = if repeat % 2 == 0 {
                    k
                } else {
                    target_count - 1 - k
                };
                steps.push(Step {
                    repeat,
                    job,
                    target,
                    measure_idle: j == 0,
                });
            }
        }
    }
    steps
}

/// The SPDK tools directory: `--spdk-tools`, else `$LULL_SPDK_TOOLS`, else
/// [`DEFAULT_SPDK_TOOLS`] from the current directory or, failing that, from
/// the repository `lull_exe` was built in (`<repo>/target/<profile>/lull`);
/// an error naming the directory unless it holds `bin/spdk_nvme_perf`.
pub fn spdk_tools_dir(flag: Option<&Path>, lull_exe: &Path) -> Result<PathBuf, BenchError> {
    let has_perf = |d: &Path| d.join("bin/spdk_nvme_perf").is_file();
    let given = flag
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(SPDK_TOOLS_ENV).map(PathBuf::from));
    let dir = match given {
        Some(dir) => dir,
        None => {
            let from_repo = lull_exe
                .ancestors()
                .nth(3)
                .map(|repo| repo.join(DEFAULT_SPDK_TOOLS))
                .filter(|d| !has_perf(Path::new(DEFAULT_SPDK_TOOLS)) && has_perf(d));
            from_repo.unwrap_or_else(|| PathBuf::from(DEFAULT_SPDK_TOOLS))
        }
    };
    if has_perf(&dir) {
        Ok(dir)
    } else {
        Err(BenchError::MissingSpdk { dir })
    }
}

/// nvmf_tgt's configuration: the same RPCs as the tools' README sends with
/// rpc.py (TCP transport, malloc bdev, subsystem allowing any host,
/// namespace, listener), loaded at start-up with `-c`, so the target is
/// fully configured once it listens. `c2h_success`: the TCP transport's
/// option of that name (SPDK's default is true).
pub fn spdk_config_json(size_bytes: u64, port: u16, c2h_success: bool) -> String {
    let config = serde_json::json!({
        "subsystems": [
            {"subsystem": "bdev", "config": [
                {"method": "bdev_malloc_create", "params": {
                    "name": "Malloc0", "num_blocks": size_bytes / 4096, "block_size": 4096}}
            ]},
            {"subsystem": "nvmf", "config": [
                {"method": "nvmf_create_transport", "params": {
                    "trtype": "TCP", "c2h_success": c2h_success}},
                {"method": "nvmf_create_subsystem", "params": {
                    "nqn": SPDK_NQN, "allow_any_host": true, "serial_number": "SPDK1"}},
                {"method": "nvmf_subsystem_add_ns", "params": {
                    "nqn": SPDK_NQN, "namespace": {"bdev_name": "Malloc0"}}},
                {"method": "nvmf_subsystem_add_listener", "params": {
                    "nqn": SPDK_NQN, "listen_address": {
                        "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
                        "trsvcid": port.to_string()}}}
            ]}
        ]
    });
    serde_json::to_string_pretty(&config).unwrap_or_default()
}

/// perf's transport id for a target listening on `port`.
pub fn trid(target: &NvmfTarget, port: u16) -> String {
    let nqn = match target {
        NvmfTarget::Lull { .. } => format!("nqn.2026-11.io.lull:{VOLUME_NAME}"),
        NvmfTarget::Spdk { .. } => SPDK_NQN.into(),
    };
    format!("trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:{port} subnqn:{nqn}")
}

/// Runs the NVMe/TCP profile; called by [`crate::run`].
pub fn run(config: &BenchConfig, lull_exe: &Path) -> Result<NvmfReport, BenchError> {
    debug_assert_eq!(config.profile, Profile::Nvmf);
    if config.volumes != [VolumeKind::Malloc] {
        return Err(BenchError::BadArgs(
            "--profile nvmf measures a memory volume only (--volumes malloc)".into(),
        ));
    }
    let nproc = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let mut sized = config.clone();
    sized.size.get_or_insert_with(|| DEFAULT_NVMF_SIZE.into());
    let settings = Settings::resolve(&sized, nproc)?;
    if nproc < 2 || settings.server_cpu == settings.client_cpu {
        tracing::warn!(
            server_cpu = settings.server_cpu,
            client_cpu = settings.client_cpu,
            "server and perf share a core; numbers will be pessimistic"
        );
    }
    let mut jobs = Vec::new();
    for j in &config.nvmf_jobs {
        if !jobs.contains(j) {
            jobs.push(*j);
        }
    }
    if jobs.is_empty() {
        return Err(BenchError::BadArgs("--nvmf-jobs is empty".into()));
    }
    let tools = spdk_tools_dir(config.spdk_tools.as_deref(), lull_exe)?;
    for (tool, package) in [
        ("taskset", "util-linux"),
        ("kill", "procps"),
        ("stdbuf", "coreutils"),
    ] {
        if server::which(tool).is_none() {
            return Err(BenchError::MissingTool { tool, package });
        }
    }
    let modes = if config.no_lull {
        Vec::new()
    } else {
        config.modes.clone()
    };
    let targets = targets(&modes, &config.spdk_peers);
    if targets.is_empty() {
        return Err(BenchError::BadArgs(
            "nothing to measure: no lull modes and no SPDK peers".into(),
        ));
    }
    std::fs::create_dir_all(&config.out)
        .map_err(io_err(format!("creating {}", config.out.display())))?;
    let raw_dir = config.out.join(RAW_DIR);
    std::fs::create_dir_all(&raw_dir).map_err(io_err(format!("creating {}", raw_dir.display())))?;
    let work = WorkDir::new(&std::env::temp_dir()).map_err(io_err("creating a work dir"))?;
    let nvmf_tgt = tools.join("bin/nvmf_tgt");
    let mut reports: Vec<NvmfTargetReport> = targets
        .iter()
        .map(|t| NvmfTargetReport {
            name: t.name(),
            target: *t,
            command: None,
            skipped: match t {
                NvmfTarget::Spdk { .. } if !nvmf_tgt.is_file() => {
                    Some(format!("{} not found", nvmf_tgt.display()))
                }
                NvmfTarget::Lull { .. } if !lull_exe.is_file() => {
                    Some(format!("lull executable {} not found", lull_exe.display()))
                }
                _ => None,
            },
            idle_cpu_pct_samples: Vec::new(),
            idle_cpu_pct: None,
        })
        .collect();
    let warmup_secs = settings.ramp_secs.ceil() as u64;
    let nvmf_settings = NvmfSettings {
        jobs: jobs.clone(),
        runtime_secs: settings.runtime_secs,
        warmup_secs,
        idle_secs: settings.idle_secs,
        repeat: settings.repeat,
        size_bytes: settings.size_bytes,
        server_cpu: settings.server_cpu,
        client_cpu: settings.client_cpu,
        perf_mem_mb: PERF_MEM_MB,
        tgt_mem_mb: tgt_mem_mb(settings.size_bytes),
        quick: settings.quick,
    };
    let mut ctx = Ctx {
        settings: &nvmf_settings,
        lull_exe,
        tools: &tools,
        work: &work.path,
        raw_dir: &raw_dir,
        ports: Ports::new(settings.port_base),
        port_base: settings.port_base,
    };
    let steps = schedule(settings.repeat, &jobs, targets.len());
    let bar = crate::progress_bar(steps.len() as u64);
    let mut samples = Vec::new();
    for step in &steps {
        let t = &targets[step.target];
        bar.set_message(format!(
            "{} {} r{}",
            step.job.as_str(),
            t.name(),
            step.repeat + 1
        ));
        if reports[step.target].skipped.is_some() {
            bar.inc(1);
            continue;
        }
        let outcome = ctx.run_step(t, step, step.measure_idle)?;
        let tr = &mut reports[step.target];
        if let Some(c) = outcome.command {
            tr.command.get_or_insert(c);
        }
        if let Some(idle) = outcome.idle_cpu_pct {
            tr.idle_cpu_pct_samples.push(idle);
        }
        if let Some(e) = &outcome.error {
            tracing::warn!(target = %t.name(), job = step.job.as_str(), error = %e, "run failed");
        }
        samples.push(NvmfSample {
            repeat: step.repeat,
            job: step.job,
            target: t.name(),
            perf: outcome.perf,
            server: outcome.server,
            error: outcome.error,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    drop(work);
    let report = report::build(report::environment(&tools), nvmf_settings, reports, samples);
    report::write(&report, &config.out)?;
    Ok(report)
}

/// nvmf_tgt's DPDK memory for a malloc bdev of `size_bytes`, MiB.
pub fn tgt_mem_mb(size_bytes: u64) -> u64 {
    TGT_MEM_BASE_MB + size_bytes.div_ceil(1 << 20)
}

/// Removes the empty DPDK runtime directories of the SPDK processes it
/// names when dropped: declared before the processes, it drops after them.
#[derive(Default)]
struct DpdkRuntimeDirs(Vec<u32>);

impl Drop for DpdkRuntimeDirs {
    fn drop(&mut self) {
        for pid in &self.0 {
            // remove_dir only removes an empty directory: anything a live
            // process still uses stays.
            let _ = std::fs::remove_dir(Path::new(DPDK_RUNTIME_DIR).join(format!("spdk_pid{pid}")));
        }
    }
}

/// What one step produced.
struct StepOutcome {
    command: Option<String>,
    idle_cpu_pct: Option<f64>,
    perf: Option<PerfMetrics>,
    server: Option<CpuWindow>,
    error: Option<String>,
}

struct Ctx<'a> {
    settings: &'a NvmfSettings,
    lull_exe: &'a Path,
    tools: &'a Path,
    work: &'a Path,
    raw_dir: &'a Path,
    ports: Ports,
    port_base: u16,
}

impl Ctx<'_> {
    /// Starts the target; `Ok(Err(reason))` when it did not come up.
    fn start(&mut self, target: &NvmfTarget) -> Result<Result<(Group, u16), String>, BenchError> {
        let s = self.settings;
        let port = self.ports.take().ok_or(BenchError::NoPort {
            base: self.port_base,
        })?;
        let (name, program, args) = match target {
            NvmfTarget::Lull { mode } => {
                let args = vec![
                    "serve".into(),
                    "--nvmf-listen".into(),
                    format!("127.0.0.1:{port}"),
                    // NBD stays on (it cannot be turned off) on a port of the
                    // kernel's choosing, so it never collides.
                    "--listen".into(),
                    "127.0.0.1:0".into(),
                    "--rpc-socket".into(),
                    self.work.join("lull.sock").display().to_string(),
                    "--mode".into(),
                    mode.as_str().into(),
                    "--cores".into(),
                    s.server_cpu.to_string(),
                    "--volume".into(),
                    format!("{VOLUME_NAME}:{}", size_arg(s.size_bytes)),
                ];
                ("lull", self.lull_exe.display().to_string(), args)
            }
            NvmfTarget::Spdk {
                interrupt,
                c2h_success,
            } => {
                let json = self.work.join("nvmf_tgt.json");
                std::fs::write(&json, spdk_config_json(s.size_bytes, port, *c2h_success))
                    .map_err(io_err(format!("writing {}", json.display())))?;
                let mut args = vec![
                    "--no-huge".into(),
                    "-s".into(),
                    tgt_mem_mb(s.size_bytes).to_string(),
                    "-m".into(),
                    format!("{:#x}", 1u128 << s.server_cpu.min(127)),
                    "-r".into(),
                    self.work.join("spdk.sock").display().to_string(),
                    "-c".into(),
                    json.display().to_string(),
                    // The core locks in /var/tmp would make a target that is
                    // still shutting down, or someone else's SPDK app on the
                    // core, fail this start.
                    "--disable-cpumask-locks".into(),
                ];
                if *interrupt {
                    args.push("--interrupt-mode".into());
                }
                (
                    "nvmf_tgt",
                    self.tools.join("bin/nvmf_tgt").display().to_string(),
                    args,
                )
            }
        };
        let proc = Proc::spawn(name, &program, &args, Some(s.server_cpu), self.work)
            .map_err(io_err(format!("starting {program}")))?;
        let mut group = Group::default();
        group.procs.push(proc);
        if let Some(p) = group.procs.last_mut() {
            if let Err(reason) = p.wait_listening(port, server::READY_TIMEOUT) {
                return Ok(Err(reason));
            }
        }
        Ok(Ok((group, port)))
    }

    fn run_step(
        &mut self,
        target: &NvmfTarget,
        step: &Step,
        measure_idle: bool,
    ) -> Result<StepOutcome, BenchError> {
        let mut out = StepOutcome {
            command: None,
            idle_cpu_pct: None,
            perf: None,
            server: None,
            error: None,
        };
        let mut dirs = DpdkRuntimeDirs::default();
        let (group, port) = match self.start(target)? {
            Ok(g) => g,
            Err(reason) => {
                out.error = Some(format!("server did not start: {reason}"));
                return Ok(out);
            }
        };
        if target.is_spdk() {
            dirs.0.extend(group.pids());
        }
        out.command = Some(
            group
                .procs
                .iter()
                .map(|p| p.command.clone())
                .collect::<Vec<_>>()
                .join(" & "),
        );
        sleep(SETTLE);
        if measure_idle {
            match self.measure_idle(&group) {
                Ok(pct) => out.idle_cpu_pct = Some(pct),
                Err(e) => {
                    out.error = Some(e);
                    return Ok(out);
                }
            }
        }
        if let Err(e) = self.fill(target, port, step)? {
            out.error = Some(e);
            return Ok(out);
        }
        match self.run_perf(group, target, port, step)? {
            Ok((perf, cpu)) => {
                out.perf = Some(perf);
                out.server = Some(cpu);
            }
            Err(e) => out.error = Some(e),
        }
        Ok(out)
    }

    fn run_ns(&self, group: &Group) -> Result<u64, String> {
        procstat::run_ns_pids(Path::new("/proc"), &group.pids()).map_err(|e| e.to_string())
    }

    fn measure_idle(&self, group: &Group) -> Result<f64, String> {
        let a = self.run_ns(group)?;
        let t0 = Instant::now();
        sleep(Duration::from_secs_f64(self.settings.idle_secs));
        let b = self.run_ns(group)?;
        let secs = t0.elapsed().as_secs_f64();
        Ok(b.saturating_sub(a) as f64 / 1e9 / secs * 100.0)
    }

    /// Writes every block of the target's volume once before a job (see
    /// the module docs): `FILL_SECS` of sequential `FILL_IO_BYTES` writes
    /// at depth `FILL_QUEUE_DEPTH`, which perf wraps around the namespace,
    /// again for longer (at most `FILL_SECS_MAX`) when the rate it measured
    /// did not cover the volume; refused (`Ok(Err)`) when even that does not.
    fn fill(
        &mut self,
        target: &NvmfTarget,
        port: u16,
        step: &Step,
    ) -> Result<Result<(), String>, BenchError> {
        let size_mib = self.settings.size_bytes as f64 / (1u64 << 20) as f64;
        let mut secs = FILL_SECS;
        loop {
            let rate_mib_per_sec = match self.fill_for(target, port, step, secs)? {
                Ok(rate) => rate,
                Err(e) => return Ok(Err(e)),
            };
            let written_mib = rate_mib_per_sec * secs as f64;
            if written_mib >= size_mib {
                return Ok(Ok(()));
            }
            // Twice what the measured rate needs, in whole seconds.
            let needed = (2.0 * size_mib / rate_mib_per_sec.max(1.0)).ceil() as u64;
            if secs >= FILL_SECS_MAX || needed <= secs {
                return Ok(Err(format!(
                    "the fill before the job wrote {written_mib:.0} MiB in {secs} s, less than the volume's {size_mib:.0} MiB"
                )));
            }
            tracing::info!(
                target = target.name(),
                written_mib,
                size_mib,
                next_secs = needed.min(FILL_SECS_MAX),
                "the fill did not cover the volume; filling again for longer"
            );
            secs = needed.min(FILL_SECS_MAX);
        }
    }

    /// One fill run of `secs` seconds; its write rate in MiB/s.
    fn fill_for(
        &mut self,
        target: &NvmfTarget,
        port: u16,
        step: &Step,
        secs: u64,
    ) -> Result<Result<f64, String>, BenchError> {
        let s = self.settings;
        let perf_bin = self.tools.join("bin/spdk_nvme_perf").display().to_string();
        let args = vec![
            perf_bin,
            "--no-huge".into(),
            "-s".into(),
            s.perf_mem_mb.to_string(),
            "-c".into(),
            format!("{:#x}", 1u128 << s.client_cpu.min(127)),
            "-q".into(),
            FILL_QUEUE_DEPTH.to_string(),
            "-o".into(),
            FILL_IO_BYTES.to_string(),
            "-w".into(),
            "write".into(),
            "-t".into(),
            secs.to_string(),
            "-r".into(),
            trid(target, port),
        ];
        let mut dirs = DpdkRuntimeDirs::default();
        let mut perf = Proc::spawn(
            "perf-fill",
            "stdbuf",
            &[vec!["-oL".into()], args].concat(),
            Some(s.client_cpu),
            self.work,
        )
        .map_err(io_err("starting spdk_nvme_perf (fill)"))?;
        dirs.0.push(perf.pid());
        let status = perf.wait_timeout(FILL_TIMEOUT + Duration::from_secs(secs));
        let raw = self.raw_dir.join(format!(
            "r{}-{}-{}-fill.txt",
            step.repeat + 1,
            step.job.as_str(),
            target.name()
        ));
        std::fs::write(&raw, perf.stdout())
            .map_err(io_err(format!("writing {}", raw.display())))?;
        let Some(status) = status else {
            perf.stop();
            return Ok(Err(format!(
                "the fill before the job did not finish within {} s",
                (FILL_TIMEOUT + Duration::from_secs(secs)).as_secs()
            )));
        };
        if !status.success() {
            return Ok(Err(format!(
                "the fill before the job failed ({status}): {}",
                perf.reason()
            )));
        }
        match perf::parse_perf_output(&perf.stdout()) {
            Ok(m) => Ok(Ok(m.mib_per_sec)),
            Err(e) => Ok(Err(format!("the fill before the job: {e}"))),
        }
    }

    /// One perf run against a started target, stopped on return. The inner
    /// `Err` is a failed run (recorded), the outer one a harness failure.
    fn run_perf(
        &mut self,
        mut group: Group,
        target: &NvmfTarget,
        port: u16,
        step: &Step,
    ) -> Result<Result<(PerfMetrics, CpuWindow), String>, BenchError> {
        let s = self.settings;
        let job = step.job;
        let perf_bin = self.tools.join("bin/spdk_nvme_perf").display().to_string();
        // Line-buffered stdout, so the launch line reaches the file at once.
        let mut args = vec!["-oL".to_string(), perf_bin];
        args.extend(job.perf_args(
            &trid(target, port),
            s.client_cpu,
            s.perf_mem_mb,
            s.runtime_secs,
            s.warmup_secs,
        ));
        let mut dirs = DpdkRuntimeDirs::default();
        let mut perf = Proc::spawn(
            &format!("perf-{}", job.as_str()),
            "stdbuf",
            &args,
            Some(s.client_cpu),
            self.work,
        )
        .map_err(io_err("starting spdk_nvme_perf"))?;
        // taskset and stdbuf exec: the pid is perf's.
        dirs.0.push(perf.pid());
        let launched = wait_for_line(&mut perf, PERF_LAUNCH_LINE, PERF_START_TIMEOUT);
        let Some(t0) = launched else {
            let reason = perf.reason();
            perf.stop();
            return Ok(Err(format!(
                "spdk_nvme_perf did not start its workers within {} s: {reason}",
                PERF_START_TIMEOUT.as_secs()
            )));
        };
        let warmup = Duration::from_secs(s.warmup_secs);
        let runtime = Duration::from_secs(s.runtime_secs);
        let open = warmup + WINDOW_MARGIN;
        let close = warmup + runtime.saturating_sub(WINDOW_MARGIN);
        let mut early = perf.wait_timeout(open.saturating_sub(t0.elapsed()));
        let before = self.run_ns(&group);
        let w0 = Instant::now();
        if early.is_none() {
            early = perf.wait_timeout(close.saturating_sub(t0.elapsed()));
        }
        let after = self.run_ns(&group);
        let window_secs = w0.elapsed().as_secs_f64();
        let limit = warmup + runtime + PERF_GRACE;
        let status = early.or_else(|| perf.wait_timeout(limit.saturating_sub(t0.elapsed())));
        if let Some(dead) = group.dead() {
            return Ok(Err(format!("server died during the job: {dead}")));
        }
        let Some(status) = status else {
            perf.stop();
            return Ok(Err(format!(
                "spdk_nvme_perf did not finish within {} s",
                limit.as_secs()
            )));
        };
        let raw = self.raw_dir.join(format!(
            "r{}-{}-{}.txt",
            step.repeat + 1,
            job.as_str(),
            target.name()
        ));
        std::fs::write(&raw, perf.stdout())
            .map_err(io_err(format!("writing {}", raw.display())))?;
        if !status.success() {
            return Ok(Err(format!(
                "spdk_nvme_perf failed ({status}): {}",
                perf.reason()
            )));
        }
        let metrics = match perf::parse_perf_output(&perf.stdout()) {
            Ok(m) => m,
            Err(e) => return Ok(Err(e.to_string())),
        };
        let (before, after) = match (before, after) {
            (Ok(b), Ok(a)) => (b, a),
            (Err(e), _) | (_, Err(e)) => return Ok(Err(format!("sampling the server: {e}"))),
        };
        let cpu = CpuWindow::new(after.saturating_sub(before), window_secs, metrics.iops);
        Ok(Ok((metrics, cpu)))
    }
}

/// Waits until `proc`'s stdout holds `line`; the instant it was seen, or
/// `None` if the process exits or `timeout` passes first.
fn wait_for_line(proc: &mut Proc, line: &str, timeout: Duration) -> Option<Instant> {
    let deadline = Instant::now() + timeout;
    loop {
        if proc.stdout().contains(line) {
            return Some(Instant::now());
        }
        if proc.exit_status().is_some() || Instant::now() >= deadline {
            return None;
        }
        sleep(server::WAIT_POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_names_and_order() {
        let t = targets(
            &[Mode::Poll, Mode::Adaptive, Mode::Poll],
            &[SpdkPeer::Interrupt, SpdkPeer::None, SpdkPeer::Poll],
        );
        let names: Vec<String> = t.iter().map(NvmfTarget::name).collect();
        assert_eq!(
            names,
            ["lull-poll", "lull-adaptive", "spdk-interrupt", "spdk-poll"]
        );
        assert!(t[2].is_spdk() && !t[0].is_spdk());
        assert!(targets(&[], &[SpdkPeer::None]).is_empty());
    }

    #[test]
    fn schedule_alternates_and_measures_idle_once_per_repeat() {
        let jobs = [NvmfJob::RandreadQd1, NvmfJob::Read128kQd32];
        let s = schedule(3, &jobs, 2);
        let order: Vec<(u32, NvmfJob, usize)> =
            s.iter().map(|s| (s.repeat, s.job, s.target)).collect();
        assert_eq!(
            order,
            [
                (0, jobs[0], 0),
                (0, jobs[0], 1),
                (0, jobs[1], 0),
                (0, jobs[1], 1),
                (1, jobs[0], 1),
                (1, jobs[0], 0),
                (1, jobs[1], 1),
                (1, jobs[1], 0),
                (2, jobs[0], 0),
                (2, jobs[0], 1),
                (2, jobs[1], 0),
                (2, jobs[1], 1),
            ]
        );
        // Every target's idle CPU once per repeat.
        for r in 0..3 {
            for t in 0..2 {
                let n = s
                    .iter()
                    .filter(|x| x.repeat == r && x.target == t && x.measure_idle)
                    .count();
                assert_eq!(n, 1);
            }
        }
    }

    #[test]
    fn spdk_config_and_trid() {
        let v: serde_json::Value =
            serde_json::from_str(&spdk_config_json(128 << 20, 24421, true)).unwrap();
        let bdev = &v["subsystems"][0]["config"][0];
        assert_eq!(bdev["method"], "bdev_malloc_create");
        assert_eq!(bdev["params"]["num_blocks"], 32768);
        let nvmf = v["subsystems"][1]["config"].as_array().unwrap();
        let methods: Vec<&str> = nvmf.iter().map(|m| m["method"].as_str().unwrap()).collect();
        assert_eq!(
            methods,
            [
                "nvmf_create_transport",
                "nvmf_create_subsystem",
                "nvmf_subsystem_add_ns",
                "nvmf_subsystem_add_listener"
            ]
        );
        assert_eq!(nvmf[3]["params"]["listen_address"]["trsvcid"], "24421");
        assert_eq!(
            trid(&NvmfTarget::Lull { mode: Mode::Poll }, 5),
            "trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:5 subnqn:nqn.2026-11.io.lull:bench"
        );
        assert!(trid(
            &NvmfTarget::Spdk {
                interrupt: true,
                c2h_success: true
            },
            5
        )
        .ends_with(SPDK_NQN));
        assert_eq!(tgt_mem_mb(128 << 20), 1152);
    }

    #[test]
    fn missing_tools_are_an_error_naming_the_dir() {
        let dir = Path::new("/nonexistent/spdk-tools");
        let err = spdk_tools_dir(Some(dir), Path::new("lull")).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("/nonexistent/spdk-tools"), "{text}");
        assert!(text.contains("--spdk-tools"), "{text}");
    }
}
