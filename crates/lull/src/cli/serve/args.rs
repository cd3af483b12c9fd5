//! `lull serve`'s flags, and their resolution (with the configuration
//! file) into the `config` crate's `ServeSettings`.

use std::path::PathBuf;

use lull_config as config;
use lull_config::{ConfigFile, Overrides, ServeSettings};

#[derive(clap::Args, Debug)]
pub(crate) struct ServeArgs {
    /// TCP address to listen on [default: 127.0.0.1:10809; none when only --socket is given].
    #[arg(long, value_name = "ADDR:PORT")]
    listen: Option<String>,
    /// Unix socket to listen on (instead of TCP, or as well with --listen).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Reactor cores, e.g. "1" or "0,2-3" [default: the last core].
    #[arg(long, value_name = "LIST")]
    cores: Option<String>,
    /// Event mode of the reactors: poll, interrupt, hybrid or adaptive [default: adaptive].
    #[arg(long, value_name = "MODE")]
    mode: Option<String>,
    /// Hybrid mode: how often replica connections are drained, in µs
    /// (Longhorn's data-engine-nvme-ioq-poll-period-us) [default: 100].
    #[arg(long = "nvme-ioq-poll-period-us", value_name = "US")]
    ioq_poll_period_us: Option<u64>,
    /// A volume NAME:SIZE[:BACKEND], repeatable; BACKEND is malloc (default),
    /// file=PATH[,direct], replicas=HOST:PORT+HOST:PORT or (fault injection)
    /// faulty=INNER,read_err=P,write_err=P,flush_err=P,delay_us=N,seed=N.
    /// Sizes take K/M/G/T (binary) suffixes.
    #[arg(long = "volume", value_name = "NAME:SIZE[:BACKEND]")]
    volumes: Vec<String>,
    /// JSON-RPC socket [default: /var/tmp/lull.sock; when that one is taken
    /// by another server, RPC is off with a warning].
    #[arg(long, value_name = "PATH")]
    rpc_socket: Option<PathBuf>,
    /// Serve the volumes over NVMe/TCP at ADDR:PORT too (4420 is the usual
    /// port); subsystem NQN nqn.2026-11.io.lull:<volume> [default: off].
    #[arg(long, value_name = "ADDR:PORT")]
    nvmf_listen: Option<String>,
    /// NVMe/TCP LBA size of a volume: 512 (default) or 4096; repeatable.
    #[arg(long, value_name = "VOLUME=BYTES")]
    nvmf_lba: Vec<String>,
    /// NVMe/TCP subsystem NQN of a volume [default: nqn.2026-11.io.lull:<volume>]; repeatable.
    #[arg(long, value_name = "VOLUME=NQN")]
    nvmf_nqn: Vec<String>,
    /// A host NQN allowed to connect to a volume's NVMe/TCP subsystem;
    /// repeatable (a volume with none allows any host) [default: any host].
    #[arg(long, value_name = "VOLUME=HOSTNQN")]
    nvmf_allow_host: Vec<String>,
    /// A host's NVMe/TCP TLS key for a volume: a file in the PSK
    /// interchange format (NVMeTLSkey-1:01:...:); repeatable. A volume
    /// with a key takes TLS 1.3 connections only (docs/NVMF.md).
    #[arg(long, value_name = "VOLUME=HOSTNQN=KEYFILE")]
    nvmf_psk: Vec<String>,
    /// Serve Prometheus metrics over HTTP at ADDR:PORT/metrics [default: off].
    #[arg(long, value_name = "ADDR:PORT")]
    metrics: Option<String>,
    /// NBD TLS: off, on (clients may use NBD_OPT_STARTTLS) or require
    /// (they must; nothing about the exports is told before) [default:
    /// require when credentials are given, else off].
    #[arg(long, value_name = "off|on|require")]
    tls: Option<String>,
    /// NBD TLS with X.509: a directory with server-cert.pem and
    /// server-key.pem (qemu's tls-creds-x509 layout); with ca-cert.pem too,
    /// clients must present a certificate it signed.
    #[arg(long, value_name = "DIR")]
    tls_certs: Option<PathBuf>,
    /// NBD TLS with pre-shared keys: a file of username:hexkey lines (the
    /// format of nbdkit --tls-psk and libnbd's tls-psk-file).
    #[arg(long, value_name = "FILE")]
    tls_psk: Option<PathBuf>,
    /// Replica links: TLS with this PSK file (username:hexkey lines; the
    /// replicas' --tls-psk file). One of the three replica-link flags is
    /// needed when a volume is replicated.
    #[arg(long, value_name = "FILE")]
    replica_tls_psk: Option<PathBuf>,
    /// Replica links: TLS with certificates, a directory with ca-cert.pem,
    /// client-cert.pem and client-key.pem (qemu's tls-creds-x509 layout);
    /// the replicas' certificates must be signed by that CA and name
    /// their IP address.
    #[arg(long, value_name = "DIR")]
    replica_tls_certs: Option<PathBuf>,
    /// Replica links: plain TCP, not authenticated (logged at start).
    #[arg(long)]
    replica_insecure: bool,
    /// Replicated volumes: fail a replica silent this long [default: 8000].
    #[arg(long, value_name = "MS")]
    replica_timeout_ms: Option<u64>,
    /// Replicated volumes: TCP connections per replica [default: 2].
    #[arg(long, value_name = "N")]
    connections_per_replica: Option<usize>,
    /// NBD connections held at once; past it a new one is closed at once
    /// [default: 16384, the most].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// NBD connections one volume serves at once; past it NBD_OPT_GO gets
    /// NBD_REP_ERR_POLICY [default: 4096].
    #[arg(long, value_name = "N")]
    max_connections_per_volume: Option<usize>,
    /// Requests in flight on one volume over all its connections; past it
    /// a connection stops reading until some complete [default: 4096].
    #[arg(long, value_name = "N")]
    max_in_flight_per_volume: Option<usize>,
    /// Scheduler: static (threads stay where they start) or dynamic (idle
    /// work packed onto the first core, busy work spread; use with
    /// several --cores) [default: static].
    #[arg(long, value_name = "NAME")]
    scheduler: Option<String>,
    /// How often the scheduler balances, in µs [default: 1000000].
    #[arg(long, value_name = "US")]
    scheduler_period_us: Option<u64>,
    /// MiB of I/O buffers each reactor maps at start, prefaulted, locked
    /// where RLIMIT_MEMLOCK allows and registered with io_uring (file
    /// volumes use READ_FIXED/WRITE_FIXED on them); 0: off, heap buffers
    /// [default: 16, at most 1024].
    #[arg(long, value_name = "MIB")]
    fixed_buffers_mib: Option<u64>,
    /// Make this daemon a storage node: keep replicas under DIR (created
    /// over RPC with replica_create), serve them to engines on
    /// --replica-listen, and keep the volumes created over RPC in DIR
    /// across restarts [default: off].
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// Where the store serves its replicas to engines (the replica-link
    /// flags secure it) [default: 127.0.0.1:10900].
    #[arg(long, value_name = "ADDR:PORT")]
    replica_listen: Option<String>,
    /// Thin provisioning: how far the sum of replica sizes may exceed what
    /// the store's filesystem can hold (1.0: not at all) [default: 1.0].
    #[arg(long, value_name = "RATIO")]
    store_overcommit: Option<f64>,
    /// Fault injection for tests, on every replica of the store (as `lull
    /// replica`'s --fault-drop): each data request closes its connection
    /// with probability P [default: 0].
    #[arg(long, value_name = "P", default_value = "0")]
    store_fault_drop: String,
    /// Fault injection: each data request of the store's replicas fails
    /// with EIO with probability P [default: 0].
    #[arg(long, value_name = "P", default_value = "0")]
    store_fault_error: String,
    /// Fault injection: every data reply of the store's replicas is held
    /// back N microseconds [default: 0].
    #[arg(long, value_name = "N", default_value_t = 0)]
    store_fault_delay_us: u64,
    /// Seed of the store's fault draws [default: from the clock].
    #[arg(long, value_name = "N")]
    store_fault_seed: Option<u64>,
    /// Serve JSON-RPC over TCP at ADDR:PORT too, TLS only (with
    /// --rpc-tls-certs or --rpc-tls-psk) [default: off].
    #[arg(long, value_name = "ADDR:PORT")]
    rpc_listen: Option<String>,
    /// JSON-RPC over TCP with mutual certificates: a directory with
    /// server-cert.pem, server-key.pem and ca-cert.pem (clients' CA).
    #[arg(long, value_name = "DIR")]
    rpc_tls_certs: Option<PathBuf>,
    /// JSON-RPC over TCP with pre-shared keys (username:hexkey lines).
    #[arg(long, value_name = "FILE")]
    rpc_tls_psk: Option<PathBuf>,
    /// Report a reactor that does not answer its heartbeat this long as
    /// stalled (a WARN line naming what it runs; framework_get_reactors'
    /// stalled_ms); 0: no watchdog [default: 1000].
    #[arg(long, value_name = "MS")]
    stall_threshold_ms: Option<u64>,
    /// TOML configuration file; flags override it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

pub(super) fn settings(args: ServeArgs) -> Result<ServeSettings, String> {
    let file = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read config {}: {e}", path.display()))?;
            ConfigFile::parse(&text).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => ConfigFile::default(),
    };
    let flags = Overrides {
        listen: args.listen,
        socket: args.socket,
        cores: args.cores,
        mode: args.mode,
        ioq_poll_period_us: args.ioq_poll_period_us,
        volumes: args.volumes,
        rpc_socket: args.rpc_socket,
        metrics: args.metrics,
        nvmf_listen: args.nvmf_listen,
        nvmf_lba: args.nvmf_lba,
        nvmf_nqn: args.nvmf_nqn,
        nvmf_allow_host: args.nvmf_allow_host,
        nvmf_psk: args.nvmf_psk,
        tls: args.tls,
        tls_certs: args.tls_certs,
        tls_psk: args.tls_psk,
        replica_tls_psk: args.replica_tls_psk,
        replica_tls_certs: args.replica_tls_certs,
        replica_insecure: args.replica_insecure,
        replica_timeout_ms: args.replica_timeout_ms,
        connections_per_replica: args.connections_per_replica,
        max_connections: args.max_connections,
        max_connections_per_volume: args.max_connections_per_volume,
        max_in_flight_per_volume: args.max_in_flight_per_volume,
        scheduler: args.scheduler,
        scheduler_period_us: args.scheduler_period_us,
        fixed_buffers_mib: args.fixed_buffers_mib,
        store: args.store,
        replica_listen: args.replica_listen,
        store_overcommit: args.store_overcommit,
        rpc_listen: args.rpc_listen,
        rpc_tls_certs: args.rpc_tls_certs,
        rpc_tls_psk: args.rpc_tls_psk,
        stall_threshold_ms: args.stall_threshold_ms,
    };
    let allowed =
        lull_reactor::sys::allowed_cpus().map_err(|e| format!("cannot read CPU affinity: {e}"))?;
    config::resolve(file, flags, &allowed).map_err(|e| e.to_string())
}

/// `--store-fault-*`: the store's replicas' fault injection, checked.
pub(super) fn store_faults(args: &ServeArgs) -> Result<lull_replica::ReplicaFaults, String> {
    let faults = crate::cli::replica::parse_faults(
        "--store-fault",
        &args.store_fault_drop,
        &args.store_fault_error,
        args.store_fault_delay_us,
        args.store_fault_seed,
    )?;
    if args.store.is_none()
        && (faults.drop.get() > 0.0 || faults.error.get() > 0.0 || faults.delay_us > 0)
    {
        return Err("--store-fault-* need a store (--store DIR)".into());
    }
    Ok(faults)
}
