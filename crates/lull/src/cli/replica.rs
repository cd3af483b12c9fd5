//! `lull replica`: its flags, their resolution into a
//! [`lull_replica::ReplicaConfig`], and the process around a
//! [`ReplicaServer`] (reactors, signals, clean stop, exit codes).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use lull_net::link::LinkAuth;
use lull_reactor::{Framework, FrameworkConfig, Mode};
use lull_replica::{ReplicaConfig, ReplicaError, ReplicaFaults, ReplicaServer};

use crate::cli::{signals, EXIT_USAGE};

/// How long `run` waits at shutdown for connections to finish their
/// in-flight I/O before giving up (with an error; the data file is then
/// not synced by the stop).
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// `lull replica` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct ReplicaArgs {
    /// TCP address to serve the replica protocol on.
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: String,
    /// Directory holding data.img and meta.json (created if missing).
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
    /// Volume size, with an optional K/M/G/T (binary) suffix; must match an
    /// existing replica's size.
    #[arg(long, value_name = "SIZE")]
    pub size: String,
    /// Reactor cores, e.g. "1" or "0,2-3" [default: the last allowed core].
    #[arg(long, value_name = "LIST")]
    pub cores: Option<String>,
    /// Event mode of the reactors: poll, interrupt, hybrid or adaptive.
    #[arg(long, value_name = "MODE", default_value = "adaptive")]
    pub mode: String,
    /// Open the data file with O_DIRECT.
    #[arg(long)]
    pub direct: bool,
    /// Fault injection: close the engine's connection at a data request,
    /// with this probability per request (0 to 1).
    #[arg(long, value_name = "P", default_value = "0")]
    pub fault_drop: String,
    /// Fault injection: fail data requests with EIO with this probability.
    #[arg(long, value_name = "P", default_value = "0")]
    pub fault_error: String,
    /// Fault injection: hold every data reply back this many microseconds.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub fault_delay_us: u64,
    /// Seed of the fault draws [default: from the clock, logged].
    #[arg(long, value_name = "N")]
    pub fault_seed: Option<u64>,
    /// I/O options of the data file, comma-separated: sqpoll[=IDLE_MS],
    /// iopoll, iopoll=auto, hybrid_iopoll, fixed=off, inline[=on|off|auto]
    /// (as a file volume's flags; a data file on tmpfs is inline by
    /// default).
    #[arg(long, value_name = "OPTIONS")]
    pub uring: Option<String>,
    /// MiB of fixed I/O buffers (prefaulted, registered with io_uring)
    /// each reactor maps at start; 0: off.
    #[arg(long, value_name = "MIB", default_value_t = lull_config::FIXED_BUFFERS_MIB_DEFAULT)]
    pub fixed_buffers_mib: u64,
    /// Engines must authenticate with TLS and this PSK file (username:hexkey
    /// lines, the format of nbdkit --tls-psk; the engine's
    /// --replica-tls-psk file). One of --tls-psk, --tls-certs, --insecure
    /// is required.
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,
    /// Engines must authenticate with TLS certificates: a directory with
    /// server-cert.pem, server-key.pem and ca-cert.pem (qemu's
    /// tls-creds-x509 layout); engines need a client certificate signed by
    /// that CA.
    #[arg(long, value_name = "DIR")]
    pub tls_certs: Option<PathBuf>,
    /// Plain TCP: any peer that reaches the port may read and write the
    /// replica (logged at start).
    #[arg(long)]
    pub insecure: bool,
    /// Copy READ replies through a buffer instead of sending them from the
    /// data file's page cache with sendfile (which plain links with a
    /// buffered data file use for reads of 32 KiB or more).
    #[arg(long)]
    pub no_sendfile: bool,
}

/// Resolved `lull replica` settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSettings {
    pub config: ReplicaConfig,
    pub cores: Vec<usize>,
    pub mode: Mode,
    /// Fixed I/O buffers per reactor (0: none).
    pub fixed_buffers_mib: u64,
}

impl ReplicaArgs {
    /// Checks the arguments; `allowed_cpus` gives the default core. The
    /// error is the message for a usage error (exit code 2).
    pub fn resolve(&self, allowed_cpus: &[usize]) -> Result<ReplicaSettings, String> {
        let listen = self.listen.parse().map_err(|_| {
            format!(
                "invalid listen address {:?}: expected ADDR:PORT",
                self.listen
            )
        })?;
        let size_bytes = lull_bdev::parse_size_bytes(&self.size)?;
        let cores = match &self.cores {
            Some(c) => lull_reactor::parse_core_list(c)?,
            // The last core: core 0 takes most interrupts and housekeeping.
            None => vec![*allowed_cpus.last().ok_or("no CPU available")?],
        };
        if let Some(bad) = cores.iter().find(|c| !allowed_cpus.contains(c)) {
            return Err(format!(
                "core {bad} is not available to this process (allowed: {allowed_cpus:?})"
            ));
        }
        let link = LinkAuth::from_flags(
            self.tls_psk.clone(),
            self.tls_certs.clone(),
            self.insecure,
            LinkAuth::REPLICA_FLAGS,
        )?
        .ok_or_else(|| LinkAuth::missing(LinkAuth::REPLICA_FLAGS))?;
        let mode = self.mode.parse::<Mode>()?;
        if self.dir.as_os_str().is_empty() {
            return Err("--dir must not be empty".into());
        }
        let faults = parse_faults(
            "--fault",
            &self.fault_drop,
            &self.fault_error,
            self.fault_delay_us,
            self.fault_seed,
        )?;
        let mut direct = self.direct;
        let ring = match &self.uring {
            Some(list) => lull_bdev::RingOptions::parse_list(list, &mut direct)
                .map_err(|e| format!("--uring: {e}"))?,
            None => lull_bdev::RingOptions::default(),
        };
        Ok(ReplicaSettings {
            config: ReplicaConfig {
                listen,
                dir: self.dir.clone(),
                size_bytes,
                direct,
                ring,
                faults,
                link,
                sendfile: !self.no_sendfile,
            },
            cores,
            mode,
            fixed_buffers_mib: lull_config::check_fixed_buffers_mib(self.fixed_buffers_mib)
                .map_err(|e| format!("--fixed-buffers-mib: {e}"))?,
        })
    }
}

/// Process exit code for a replica server that failed: 2 for a directory
/// or credentials that do not match the arguments (as clap for bad
/// arguments), 1 else.
fn exit_code(e: &ReplicaError) -> ExitCode {
    match e {
        ReplicaError::SizeMismatch { .. } | ReplicaError::Tls(_) => ExitCode::from(EXIT_USAGE),
        _ => ExitCode::FAILURE,
    }
}

/// `lull replica`: serve until SIGINT/SIGTERM, then stop cleanly (stop
/// accepting, finish in-flight I/O, fdatasync, persist the write-intent
/// record). The replica is clean afterwards only if it was: the last
/// engine attached to it detached (DETACH); with an engine still attached
/// it stays dirty, since that engine may have written to other replicas
/// what this one has not. Exit code 0 on a clean stop, 2 for bad arguments
/// (or a directory that does not match them), 1 for other failures.
///
/// Its log lines keep the `lull_replica` target they had when this lived
/// in that crate, so `RUST_LOG` filters and log readers see no change.
pub fn run(args: &ReplicaArgs) -> ExitCode {
    let allowed = match lull_reactor::sys::allowed_cpus() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lull: error: cannot read CPU affinity: {e}");
            return ExitCode::FAILURE;
        }
    };
    let settings = match args.resolve(&allowed) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lull: error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    // The credentials are checked before anything starts (the server
    // loads them again): a wrong key file is a usage error.
    if let Err(e) = settings.config.link.context(lull_net::tls::Role::Server) {
        eprintln!("lull: error: replica link TLS: {e}");
        return ExitCode::from(EXIT_USAGE);
    }
    let mut signals = match signals::stop_signals() {
        Ok(s) => s,
        Err(code) => return code,
    };
    lull_net::server::raise_fd_limit("replica");
    let mut fw = match Framework::start(super::init_fixed_buffers(
        settings.fixed_buffers_mib,
        FrameworkConfig::new(settings.cores.clone(), settings.mode),
    )) {
        Ok(fw) => fw,
        Err(e) => {
            eprintln!("lull: error: cannot start reactors: {e}");
            return ExitCode::FAILURE;
        }
    };
    let server = match ReplicaServer::start(fw.handle(), &settings.config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lull: error: {e}");
            fw.stop();
            return exit_code(&e);
        }
    };
    println!(
        "replica listening on {} (size {}, generation {}, dir {})",
        server.local_addr(),
        lull_bdev::human_bytes(settings.config.size_bytes),
        server.generation(),
        settings.config.dir.display()
    );
    let signal = signals.forever().next();
    tracing::info!(
        target: "lull_replica",
        ?signal,
        "stopping: no new connections, finishing in-flight I/O"
    );
    let result = server.shutdown(SHUTDOWN_TIMEOUT);
    fw.stop();
    match result {
        Ok(()) => {
            tracing::info!(target: "lull_replica", "stopped cleanly");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(target: "lull_replica", error = %e, "unclean stop");
            eprintln!("lull: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Fault-injection flags (`{flag}-drop P`, `{flag}-error P`,
/// `{flag}-delay-us N`, `{flag}-seed N`), checked: `lull replica`'s
/// `--fault-*` and `lull serve`'s `--store-fault-*`. Without a seed, one
/// from the clock.
pub(crate) fn parse_faults(
    flag: &str,
    drop: &str,
    error: &str,
    delay_us: u64,
    seed: Option<u64>,
) -> Result<ReplicaFaults, String> {
    let probability = |what: &str, v: &str| {
        v.parse::<lull_bdev::Probability>()
            .map_err(|e| format!("{flag}-{what}: {e}"))
    };
    if delay_us > lull_bdev::MAX_FAULT_DELAY_US {
        return Err(format!(
            "{flag}-delay-us: at most {} (10 s)",
            lull_bdev::MAX_FAULT_DELAY_US
        ));
    }
    Ok(ReplicaFaults {
        drop: probability("drop", drop)?,
        error: probability("error", error)?,
        delay_us,
        seed: seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_args() {
        let args = ReplicaArgs {
            listen: "127.0.0.1:0".into(),
            dir: "/tmp/x".into(),
            size: "1M".into(),
            cores: None,
            mode: "adaptive".into(),
            direct: false,
            fault_drop: "0".into(),
            fault_error: "0".into(),
            fault_delay_us: 0,
            fault_seed: None,
            uring: None,
            fixed_buffers_mib: lull_config::FIXED_BUFFERS_MIB_DEFAULT,
            tls_psk: None,
            tls_certs: None,
            insecure: true,
            no_sendfile: false,
        };
        let s = args.resolve(&[0, 1]).unwrap();
        assert!(!s.config.faults.any());
        let faulty = ReplicaArgs {
            fault_drop: "0.01".into(),
            fault_error: "0.5".into(),
            fault_delay_us: 100,
            fault_seed: Some(4),
            ..args.clone()
        };
        let f = faulty.resolve(&[0]).unwrap().config.faults;
        assert_eq!(
            (f.drop.get(), f.error.get(), f.delay_us, f.seed),
            (0.01, 0.5, 100, 4)
        );
        for bad in [
            ReplicaArgs {
                fault_drop: "2".into(),
                ..args.clone()
            },
            ReplicaArgs {
                fault_error: "-1".into(),
                ..args.clone()
            },
            ReplicaArgs {
                fault_delay_us: 10_000_001,
                ..args.clone()
            },
        ] {
            assert!(bad.resolve(&[0]).unwrap_err().contains("--fault-"));
        }
        assert_eq!(s.config.link, LinkAuth::Insecure);
        let psk = ReplicaArgs {
            tls_psk: Some("r.psk".into()),
            insecure: false,
            ..args.clone()
        };
        assert_eq!(
            psk.resolve(&[0]).unwrap().config.link,
            LinkAuth::Tls(lull_net::tls::Creds::Psk("r.psk".into()))
        );
        let none = ReplicaArgs {
            insecure: false,
            ..args.clone()
        };
        let e = none.resolve(&[0]).unwrap_err();
        assert!(
            e.contains("--tls-psk") && e.contains("--tls-certs") && e.contains("--insecure"),
            "{e}"
        );
        let two = ReplicaArgs {
            tls_certs: Some("pki".into()),
            ..args.clone()
        };
        assert!(two.resolve(&[0]).unwrap_err().contains("only one"));
        assert_eq!(s.cores, vec![1]);
        assert_eq!(s.mode, Mode::Adaptive);
        assert_eq!(s.config.size_bytes, 1 << 20);
        let bad = ReplicaArgs {
            mode: "spin".into(),
            ..args.clone()
        };
        assert!(bad.resolve(&[0]).unwrap_err().contains("unknown mode"));
        let bad = ReplicaArgs {
            listen: "nowhere".into(),
            ..args.clone()
        };
        assert!(bad.resolve(&[0]).is_err());
        let bad = ReplicaArgs {
            cores: Some("7".into()),
            ..args.clone()
        };
        assert!(bad.resolve(&[0]).is_err());
        let uring = ReplicaArgs {
            uring: Some("direct,sqpoll=7".into()),
            ..args.clone()
        };
        let s = uring.resolve(&[0]).unwrap();
        assert!(s.config.direct);
        assert_eq!(s.config.ring.sqpoll_idle_ms, Some(7));
        let fixed = ReplicaArgs {
            uring: Some("fixed=off".into()),
            fixed_buffers_mib: 0,
            ..args.clone()
        };
        let s = fixed.resolve(&[0]).unwrap();
        assert!(!s.config.ring.fixed_buffers);
        assert_eq!(s.fixed_buffers_mib, 0);
        let big = ReplicaArgs {
            fixed_buffers_mib: lull_config::FIXED_BUFFERS_MIB_MAX + 1,
            ..args.clone()
        };
        assert!(big
            .resolve(&[0])
            .unwrap_err()
            .contains("--fixed-buffers-mib"));
        let bad = ReplicaArgs {
            uring: Some("iopoll=sometimes".into()),
            ..args
        };
        assert!(bad
            .resolve(&[0])
            .unwrap_err()
            .contains("--uring: iopoll=sometimes"));
    }

    #[test]
    fn run_rejects_bad_arguments_with_exit_2() {
        let args = ReplicaArgs {
            listen: "not-an-address".into(),
            dir: "/nonexistent".into(),
            size: "1G".into(),
            cores: None,
            mode: "interrupt".into(),
            direct: false,
            fault_drop: "0".into(),
            fault_error: "0".into(),
            fault_delay_us: 0,
            fault_seed: None,
            uring: None,
            fixed_buffers_mib: lull_config::FIXED_BUFFERS_MIB_DEFAULT,
            tls_psk: None,
            tls_certs: None,
            insecure: true,
            no_sendfile: false,
        };
        assert_eq!(run(&args), ExitCode::from(2));
        let args = ReplicaArgs {
            listen: "127.0.0.1:0".into(),
            size: "12Q".into(),
            ..args
        };
        assert_eq!(run(&args), ExitCode::from(2));
        let no_link_choice = ReplicaArgs {
            size: "1M".into(),
            insecure: false,
            ..args.clone()
        };
        assert_eq!(run(&no_link_choice), ExitCode::from(2));
        let missing_key = ReplicaArgs {
            size: "1M".into(),
            insecure: false,
            tls_psk: Some("/nonexistent/replica.psk".into()),
            ..args
        };
        assert_eq!(run(&missing_key), ExitCode::from(2));
    }

    #[test]
    fn a_directory_that_does_not_match_exits_2() {
        let mismatch = ReplicaError::SizeMismatch {
            dir: "/tmp/x".into(),
            meta_size: 1 << 20,
            size: 2 << 20,
        };
        assert_eq!(exit_code(&mismatch), ExitCode::from(2));
        assert_eq!(exit_code(&ReplicaError::ShuttingDown), ExitCode::FAILURE);
        let bad_key = ReplicaError::Tls(lull_net::tls::TlsError::Creds {
            path: "k.psk".into(),
            reason: "bad".into(),
        });
        assert_eq!(exit_code(&bad_key), ExitCode::from(2));
    }
}
