//! `lull bench`: fio's nbd engine with the kbench profile against lull in
//! each event mode and against peer NBD servers, with the server's CPU cost
//! sampled from /proc (DESIGN §7). The NVMe/TCP profile
//! (`--profile nvmf`: spdk_nvme_perf against lull and SPDK's nvmf_tgt) is
//! [`nvmf`].
//!
//! ```no_run
//! use lull_bench::{BenchConfig, PeerChoice};
//! use lull_reactor::Mode;
//! let config = BenchConfig {
//!     quick: true,
//!     modes: vec![Mode::Poll],
//!     peers: vec![PeerChoice::None],
//!     ..BenchConfig::default()
//! };
//! let report = lull_bench::run(&config, &std::env::current_exe().unwrap()).unwrap();
//! println!("{} cells", report.results.len());
//! ```
//!
//! How a run goes (see [`plan`] for the order): for every step the target's
//! processes are started pinned to the server core and waited for until they
//! accept TCP; on the first step of a repeat the idle CPU is measured over
//! `--idle-secs`; then fio runs pinned to the client core. The server's
//! counters are read `--ramp-secs` after fio starts and again `--runtime-secs`
//! later, so the CPU window is fio's measured window shifted by fio's
//! start-up (a few ms), with both edges under load.
//!
//! Output: `report.json` (the [`Report`]), `report.md` and PNG plots in
//! `--out`.

#![forbid(unsafe_code)]

pub mod config;
pub mod env;
pub mod fio;
pub mod nvmf;
pub mod plan;
pub mod plot;
pub mod report;
pub mod server;

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::thread::sleep;
use std::time::{Duration, Instant};

pub use config::{BenchConfig, PeerChoice, Profile, Settings, SpdkPeer, VolumeKind};
pub use fio::JobKind;
pub use report::Report;

use env::{procstat, uring_enters};
use plan::Target;
use report::{analysis, render, stats, Sample, TargetReport, TargetStatus};
use server::{Group, Ports, Proc, WorkDir};
use stats::ServerCost;

/// Pause between "accepts connections" and measuring, so start-up work
/// (prefaulting pools, spawning reactors) is not counted as idle or load.
pub const SETTLE: Duration = Duration::from_millis(300);
/// Extra time fio gets beyond ramp + runtime before it is killed.
pub const FIO_GRACE: Duration = Duration::from_secs(30);
/// The name of the volume every lull target serves (the NBD export fio
/// opens, and the volume whose stats are read over RPC).
const BENCH_VOLUME: &str = "bench";
/// Chunk used to fill the shared data file.
const FILL_CHUNK_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("bad arguments: {0}")]
    BadArgs(String),
    #[error("{tool} not found on PATH (install package {package})")]
    MissingTool {
        tool: &'static str,
        package: &'static str,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("writing report.json: {0}")]
    Json(#[from] serde_json::Error),
    #[error(
        "SPDK tools not found at {} (need bin/spdk_nvme_perf and bin/nvmf_tgt): pass --spdk-tools DIR \
         or set LULL_SPDK_TOOLS; they need the packages libssl3 libnuma1 libuuid1 libkeyutils1 libaio1",
        dir.display()
    )]
    MissingSpdk { dir: PathBuf },
    #[error("no free TCP port in {base}..{base}+{span}", span = config::PORT_SPAN)]
    NoPort { base: u16 },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> BenchError {
    let what = what.into();
    move |source| BenchError::Io { what, source }
}

/// Runs the kbench profile (fio over NBD) and writes the report files into
/// `config.out`. `lull_exe` is the lull binary (`std::env::current_exe()`
/// from `lull`). The NVMe/TCP profile is [`nvmf::run`].
pub fn run(config: &BenchConfig, lull_exe: &Path) -> Result<Report, BenchError> {
    if config.profile != Profile::Kbench {
        return Err(BenchError::BadArgs(format!(
            "profile {} is run by lull_bench::nvmf::run",
            config.profile.as_str()
        )));
    }
    let nproc = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let settings = Settings::resolve(config, nproc)?;
    if nproc < 2 || settings.server_cpu == settings.client_cpu {
        tracing::warn!(
            server_cpu = settings.server_cpu,
            client_cpu = settings.client_cpu,
            "server and fio share a core; numbers will be pessimistic"
        );
    }
    for (tool, package) in [
        ("fio", "fio"),
        ("taskset", "util-linux"),
        ("kill", "procps"),
    ] {
        if server::which(tool).is_none() {
            return Err(BenchError::MissingTool { tool, package });
        }
    }
    let targets = plan::targets(
        !config.no_lull,
        &config.modes,
        &settings.hybrid_periods_us,
        &config.volumes,
        &config.peers,
    );
    if targets.is_empty() {
        return Err(BenchError::BadArgs(
            "nothing to measure: no lull targets and no peers".into(),
        ));
    }
    std::fs::create_dir_all(&config.out)
        .map_err(io_err(format!("creating {}", config.out.display())))?;
    let work = WorkDir::new(&std::env::temp_dir()).map_err(io_err("creating a work dir"))?;

    let mut reports: Vec<TargetReport> = targets
        .iter()
        .map(|t| TargetReport {
            name: t.name(),
            target: *t,
            is_peer: t.is_peer(),
            command: None,
            status: initial_status(t, lull_exe),
            idle_cpu_pct_samples: Vec::new(),
            idle_cpu_pct: None,
        })
        .collect();
    for r in reports.iter().filter(|r| r.status != TargetStatus::Ok) {
        tracing::warn!(target = %r.name, status = ?r.status, "skipped");
    }

    let data_file = work.path.join("data.raw");
    if targets
        .iter()
        .zip(&reports)
        .any(|(t, r)| t.uses_data_file() && r.status == TargetStatus::Ok)
    {
        fill_file(&data_file, settings.size_bytes)
            .map_err(io_err(format!("writing {}", data_file.display())))?;
    }

    let mut ctx = Ctx {
        settings: &settings,
        lull_exe,
        work: &work.path,
        data_file,
        ports: Ports::new(settings.port_base),
        clk_tck: procstat::clk_tck(),
    };
    let steps = plan::schedule(settings.repeat, &settings.jobs, targets.len());
    let bar = progress_bar(steps.len() as u64);
    let mut started_once = vec![false; targets.len()];
    let mut samples = Vec::new();
    for step in &steps {
        let t = &targets[step.target];
        bar.set_message(format!(
            "{} {} r{}",
            step.job.as_str(),
            t.name(),
            step.repeat + 1
        ));
        if reports[step.target].status != TargetStatus::Ok {
            bar.inc(1);
            continue;
        }
        match ctx.run_step(t, step.job, step.measure_idle)? {
            StepOutcome::NotStarted(reason) if !started_once[step.target] => {
                tracing::warn!(target = %t.name(), %reason, "skipped: server did not start");
                reports[step.target].status = TargetStatus::Skipped { reason };
            }
            StepOutcome::NotStarted(reason) => {
                samples.push(Sample {
                    repeat: step.repeat,
                    job: step.job,
                    target: t.name(),
                    fio: None,
                    server: None,
                    error: Some(format!("server did not start: {reason}")),
                });
            }
            StepOutcome::Ran {
                command,
                idle_cpu_pct,
                fio,
                server,
                error,
            } => {
                started_once[step.target] = true;
                let tr = &mut reports[step.target];
                tr.command.get_or_insert(command);
                if let Some(idle) = idle_cpu_pct {
                    tr.idle_cpu_pct_samples.push(idle);
                }
                if let Some(e) = &error {
                    tracing::warn!(target = %t.name(), job = step.job.as_str(), error = %e, "run failed");
                }
                samples.push(Sample {
                    repeat: step.repeat,
                    job: step.job,
                    target: t.name(),
                    fio,
                    server,
                    error,
                });
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    drop(work);

    for r in &mut reports {
        r.idle_cpu_pct = stats::spread(&r.idle_cpu_pct_samples);
    }
    let results = analysis::aggregate(&settings.jobs, &reports, &samples);
    let modes_summary = analysis::modes_summary(&settings.jobs, &reports, &results);
    let adaptive_vs_poll = analysis::adaptive_vs_poll(&modes_summary, &samples);
    let mut report = Report {
        environment: env::environment(&targets),
        settings,
        targets: reports,
        results,
        modes_summary,
        adaptive_vs_poll,
        samples,
        plots: Vec::new(),
    };
    match plot::write_plots(&report, &config.out, plot::font_available()) {
        Ok(files) => report.plots = files,
        // The numbers matter more than the pictures: keep going.
        Err(e) => tracing::error!(error = %e, "plotting failed"),
    }
    write_reports(&report, &config.out)?;
    Ok(report)
}

/// Writes report.json and report.md into `dir`.
pub fn write_reports(report: &Report, dir: &Path) -> Result<(), BenchError> {
    let json = serde_json::to_string_pretty(report)?;
    let path = dir.join("report.json");
    std::fs::write(&path, json + "\n").map_err(io_err(format!("writing {}", path.display())))?;
    let path = dir.join("report.md");
    std::fs::write(&path, render::render_markdown(report))
        .map_err(io_err(format!("writing {}", path.display())))?;
    Ok(())
}

fn initial_status(t: &Target, lull_exe: &Path) -> TargetStatus {
    match t.peer_binary() {
        Some((bin, package)) if server::which(bin).is_none() => TargetStatus::Skipped {
            reason: format!("{bin} not installed (package {package})"),
        },
        Some(_) => TargetStatus::Ok,
        None if !lull_exe.is_file() => TargetStatus::Skipped {
            reason: format!("lull executable {} not found", lull_exe.display()),
        },
        None => TargetStatus::Ok,
    }
}

fn progress_bar(len: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30}] {pos}/{len} eta {eta} {msg}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Writes `size_bytes` of zeros for real (not a sparse file), so reads hit
/// allocated blocks for both lull's file backend and qemu-nbd.
fn fill_file(path: &Path, size_bytes: u64) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    let chunk = vec![0u8; FILL_CHUNK_BYTES];
    let mut left = size_bytes;
    while left > 0 {
        let n = left.min(FILL_CHUNK_BYTES as u64) as usize;
        f.write_all(&chunk[..n])?;
        left -= n as u64;
    }
    f.sync_all()
}

/// Size as lull's `--volume`/`--size` take it: `1G`, `256M`, or bytes.
pub fn size_arg(bytes: u64) -> String {
    for (shift, suffix) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes & ((1 << shift) - 1) == 0 {
            return format!("{}{suffix}", bytes >> shift);
        }
    }
    bytes.to_string()
}

// One value per step, moved once: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum StepOutcome {
    /// The target's processes did not come up; the reason is the server's
    /// last stderr line.
    NotStarted(String),
    Ran {
        command: String,
        idle_cpu_pct: Option<f64>,
        fio: Option<fio::FioMetrics>,
        server: Option<ServerCost>,
        error: Option<String>,
    },
}

struct Ctx<'a> {
    settings: &'a Settings,
    lull_exe: &'a Path,
    work: &'a Path,
    data_file: PathBuf,
    ports: Ports,
    clk_tck: u64,
}

impl Ctx<'_> {
    fn port(&mut self) -> Result<u16, BenchError> {
        self.ports.take().ok_or(BenchError::NoPort {
            base: self.settings.port_base,
        })
    }

    /// Starts the target's processes; returns them and the NBD port.
    fn start(&mut self, target: &Target) -> Result<Result<(Group, u16), String>, BenchError> {
        let s = self.settings;
        let cpu = Some(s.server_cpu);
        let size = size_arg(s.size_bytes);
        let mut group = Group::default();
        let port = self.port()?;
        let lull = self.lull_exe.to_string_lossy().into_owned();
        let (name, program, args): (&str, String, Vec<String>) = match target {
            Target::Lull {
                mode,
                volume,
                hybrid_period_us,
            } => {
                let backend = match volume {
                    VolumeKind::Malloc => String::new(),
                    VolumeKind::File => format!(":file={}", self.data_file.display()),
                    VolumeKind::Replica1 | VolumeKind::Replica2 => {
                        let mut addrs = Vec::new();
                        for k in 0..volume.replica_count() {
                            let p = self.port()?;
                            let dir = self.work.join(format!("replica{k}"));
                            // Fresh replica state for every start.
                            let _ = std::fs::remove_dir_all(&dir);
                            std::fs::create_dir_all(&dir)
                                .map_err(io_err(format!("creating {}", dir.display())))?;
                            let a = vec![
                                "replica".into(),
                                "--listen".into(),
                                format!("127.0.0.1:{p}"),
                                "--dir".into(),
                                dir.display().to_string(),
                                "--size".into(),
                                size.clone(),
                                // Plain links on loopback: the runs compare
                                // engines, not ciphers.
                                "--insecure".into(),
                            ];
                            let proc =
                                Proc::spawn(&format!("replica{k}"), &lull, &a, cpu, self.work)
                                    .map_err(io_err("starting a lull replica"))?;
                            group.procs.push(proc);
                            if let Some(last) = group.procs.last_mut() {
                                if let Err(reason) = last.wait_listening(p, server::READY_TIMEOUT) {
                                    return Ok(Err(format!("replica: {reason}")));
                                }
                            }
                            addrs.push(format!("127.0.0.1:{p}"));
                        }
                        format!(":replicas={}", addrs.join("+"))
                    }
                };
                let mut a = vec![
                    "serve".into(),
                    "--listen".into(),
                    format!("127.0.0.1:{port}"),
                    "--mode".into(),
                    mode.as_str().into(),
                    "--cores".into(),
                    s.server_cpu.to_string(),
                    "--volume".into(),
                    format!("{BENCH_VOLUME}:{size}{backend}"),
                ];
                if let Some(period) = hybrid_period_us {
                    a.extend(["--nvme-ioq-poll-period-us".into(), period.to_string()]);
                }
                if volume.replica_count() > 0 {
                    a.push("--replica-insecure".into());
                }
                // Where run_fio reads the server's io_uring_enter counts.
                let socket = self.work.join(format!("rpc-{port}.sock"));
                let _ = std::fs::remove_file(&socket);
                a.extend(["--rpc-socket".into(), socket.display().to_string()]);
                group.rpc_socket = Some(socket);
                ("lull", lull.clone(), a)
            }
            Target::Nbdkit => {
                let a = [
                    "-f",
                    "--exit-with-parent",
                    "-i",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "memory",
                    &format!("size={}", s.size_bytes),
                ]
                .map(String::from)
                .to_vec();
                ("nbdkit", "nbdkit".into(), a)
            }
            Target::QemuNbd => {
                let a = [
                    "-f",
                    "raw",
                    "--aio=io_uring",
                    "--cache=none",
                    "-x",
                    BENCH_VOLUME,
                    "-b",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "--persistent",
                    "--shared=8",
                    &self.data_file.display().to_string(),
                ]
                .map(String::from)
                .to_vec();
                ("qemu-nbd", "qemu-nbd".into(), a)
            }
        };
        let proc = Proc::spawn(name, &program, &args, cpu, self.work)
            .map_err(io_err(format!("starting {program}")))?;
        group.procs.push(proc);
        if let Some(last) = group.procs.last_mut() {
            if let Err(reason) = last.wait_listening(port, server::READY_TIMEOUT) {
                return Ok(Err(reason));
            }
        }
        Ok(Ok((group, port)))
    }

    fn sample(&self, group: &Group) -> Result<procstat::ProcCounters, String> {
        procstat::sample_pids(Path::new("/proc"), &group.pids()).map_err(|e| e.to_string())
    }

    /// The server's `io_uring_enter` counts over its RPC socket; `None`
    /// for targets without one (peers).
    fn uring_enters(
        &self,
        group: &Group,
    ) -> Option<Result<uring_enters::UringEnters, uring_enters::UringEntersError>> {
        let socket = group.rpc_socket.as_deref()?;
        Some(uring_enters::read(socket, BENCH_VOLUME))
    }

    fn run_step(
        &mut self,
        target: &Target,
        job: JobKind,
        measure_idle: bool,
    ) -> Result<StepOutcome, BenchError> {
        let (group, port) = match self.start(target)? {
            Ok(g) => g,
            Err(reason) => return Ok(StepOutcome::NotStarted(reason)),
        };
        let command = group
            .procs
            .iter()
            .map(|p| p.command.clone())
            .collect::<Vec<_>>()
            .join(" & ");
        sleep(SETTLE);
        let idle = if measure_idle {
            Some(self.measure_idle(&group))
        } else {
            None
        };
        let idle_cpu_pct = idle.as_ref().and_then(|r| r.as_ref().ok().copied());
        let measured = match idle {
            Some(Err(e)) => Err(e),
            _ => self.run_fio(group, port, job)?,
        };
        Ok(match measured {
            Ok((fio, server)) => StepOutcome::Ran {
                command,
                idle_cpu_pct,
                fio: Some(fio),
                server: Some(server),
                error: None,
            },
            Err(e) => StepOutcome::Ran {
                command,
                idle_cpu_pct,
                fio: None,
                server: None,
                error: Some(e),
            },
        })
    }

    /// One fio run against a started group; the group is stopped on return.
    /// The inner `Err` is a failed run (recorded), the outer one a harness
    /// failure (fatal).
    fn run_fio(
        &mut self,
        mut group: Group,
        port: u16,
        job: JobKind,
    ) -> Result<Result<(fio::FioMetrics, ServerCost), String>, BenchError> {
        let s = self.settings;
        let uri = format!("nbd://127.0.0.1:{port}/{BENCH_VOLUME}");
        let fio_args = job.fio_args(&uri, s.size_bytes, s.runtime_secs, s.ramp_secs);
        let mut fio_proc = Proc::spawn(
            &format!("fio-{}", job.as_str()),
            "fio",
            &fio_args,
            Some(s.client_cpu),
            self.work,
        )
        .map_err(io_err("starting fio"))?;
        let t0 = Instant::now();
        let ramp = Duration::from_secs_f64(s.ramp_secs);
        // Wait out the ramp, unless fio exits during it.
        let early = fio_proc.wait_timeout(ramp);
        // The RPC reads bracket the /proc window rather than fall inside
        // it, so the server's work answering them (a thread per call) is
        // not counted as I/O cost.
        let enters_before = self.uring_enters(&group);
        let before = self.sample(&group);
        let w0 = Instant::now();
        // Close the window at ramp + runtime after the start, while fio is
        // still connected: a server that runs a thread per connection
        // (nbdkit) loses that thread's context-switch counts when fio
        // disconnects. fio starts measuring a few ms after we spawn it, so
        // the window is its measured window shifted by its start-up, and
        // both edges fall under load.
        let runtime = Duration::from_secs(s.runtime_secs);
        let early = if early.is_some() {
            early
        } else {
            fio_proc.wait_timeout((ramp + runtime).saturating_sub(t0.elapsed()))
        };
        let after = self.sample(&group);
        let window_secs = w0.elapsed().as_secs_f64();
        let enters_after = self.uring_enters(&group);
        let limit = ramp + runtime + FIO_GRACE;
        let status = if early.is_some() {
            early
        } else {
            fio_proc.wait_timeout(limit.saturating_sub(t0.elapsed()))
        };

        if let Some(dead) = group.dead() {
            return Ok(Err(format!("server died during the job: {dead}")));
        }
        let Some(status) = status else {
            fio_proc.stop();
            return Ok(Err(format!(
                "fio did not finish within {} s",
                limit.as_secs()
            )));
        };
        if !status.success() {
            return Ok(Err(format!("fio failed ({status}): {}", fio_proc.reason())));
        }
        let metrics = match fio::parse_fio_json(&fio_proc.stdout()) {
            Ok(m) => m,
            Err(e) => return Ok(Err(format!("fio output: {e}"))),
        };
        let (before, after) = match (before, after) {
            (Ok(b), Ok(a)) => (b, a),
            (Err(e), _) | (_, Err(e)) => return Ok(Err(format!("sampling the server: {e}"))),
        };
        let mut cost =
            ServerCost::new(after.since(&before), window_secs, self.clk_tck, metrics.ios);
        match (enters_before, enters_after) {
            (Some(Ok(b)), Some(Ok(a))) => cost = cost.with_uring_enters(a.since(&b), metrics.ios),
            // The numbers from /proc and fio stand without this one.
            (Some(Err(e)), _) | (_, Some(Err(e))) => {
                tracing::warn!(error = %e, "io_uring_enter counts not read");
            }
            _ => {}
        }
        Ok(Ok((metrics.clone(), cost)))
    }

    fn measure_idle(&self, group: &Group) -> Result<f64, String> {
        let c0 = self.sample(group)?;
        let t0 = Instant::now();
        sleep(Duration::from_secs_f64(self.settings.idle_secs));
        let c1 = self.sample(group)?;
        Ok(stats::idle_cpu_pct(
            &c1.since(&c0),
            t0.elapsed().as_secs_f64(),
            self.clk_tck,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lull_reactor::Mode;

    #[test]
    fn size_args() {
        assert_eq!(size_arg(1 << 30), "1G");
        assert_eq!(size_arg(256 << 20), "256M");
        assert_eq!(size_arg(1536 << 20), "1536M");
        assert_eq!(size_arg(4096 * 3), "12K");
        assert_eq!(size_arg(1000), "1000");
    }

    #[test]
    fn missing_lull_is_skipped_not_dropped() {
        let t = Target::lull(Mode::Poll, VolumeKind::Malloc, None);
        assert!(matches!(
            initial_status(&t, Path::new("/nonexistent/lull")),
            TargetStatus::Skipped { .. }
        ));
    }
}
