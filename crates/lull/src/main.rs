//! `lull`: the binary. `lull serve` with no argument serves a 1 GiB memory
//! volume `vol0` on 127.0.0.1:10809.

#![forbid(unsafe_code)]

mod cli;
mod control;
mod node;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use lull_bdev::{BlockDevice, FileDev, FileOptions, MallocDev};
use lull_nbd::{ListenAddr, NbdServer, NbdTls};
use lull_net::link::LinkAuth;
use lull_net::tls::{Role, TlsContext};
use lull_reactor::{Framework, FrameworkConfig};
use lull_volume::{Storage, Volume, VolumeLimits, Volumes};

use lull_config as config;
use lull_config::{Backend, ConfigFile, Overrides, ServeSettings};

use crate::cli::usage_error;

/// How long a stop waits for connections to finish their in-flight I/O.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Parser, Debug)]
#[command(
    name = "lull",
    version,
    about = "A user-space, replicated block storage engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve volumes over NBD (and NVMe/TCP with --nvmf-listen).
    // Boxed: its many flags make it far larger than the other variants.
    Serve(Box<ServeArgs>),
    /// Serve one replica of a replicated volume.
    Replica(cli::replica::ReplicaArgs),
    /// Call a JSON-RPC method of a running server.
    Rpc(cli::rpc::RpcArgs),
    /// Measure lull in each mode against peer NBD servers with fio, or
    /// (--profile nvmf) against SPDK's nvmf_tgt with spdk_nvme_perf.
    Bench(cli::bench::BenchArgs),
    /// A live terminal view of a running server: reactors, threads,
    /// volumes, replicas (--once: a plain-text snapshot).
    Top(cli::top::TopArgs),
    /// The Kubernetes CSI plugin: Identity, Controller and Node services
    /// over gRPC on a Unix socket (docs/KUBERNETES.md).
    Csi(cli::csi::CsiArgs),
    /// Backups of a running server's volumes: targets, create, list,
    /// restore, verify, delete, expose (the backup_* RPC methods).
    Backup(cli::backup::BackupArgs),
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Serve(args) => serve(*args),
        Command::Replica(args) => cli::replica::run(&args),
        Command::Rpc(args) => cli::rpc::run(&args),
        Command::Bench(args) => cli::bench::run(&args),
        Command::Top(args) => cli::top::run(&args),
        Command::Csi(args) => cli::csi::run(&args),
        Command::Backup(args) => cli::backup::run(&args),
    }
}

fn settings(args: ServeArgs) -> Result<ServeSettings, String> {
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

/// How long `serve` waits at start for replicated volumes to get a healthy
/// replica before serving them anyway (I/O fails with EIO until one is).
/// Replicas on a network answer in milliseconds; a missing one must not
/// hold every other volume back for long.
const REPLICA_READY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a replicated volume may take at stop to drain, flush and mark
/// its replicas clean. The frontends have drained already, so this is the
/// replicas' FLUSH (page cache to disk) and two metadata writes; past it
/// the replicas stay dirty, which is safe (the next start reconciles).
const DETACH_TIMEOUT: Duration = Duration::from_secs(30);

/// How this server's engines reach their replicas, loaded once at start.
#[derive(Debug, Clone)]
pub(crate) enum ReplicaLinks {
    /// No choice was made (no replicated volume at start): replicated
    /// volumes are refused, also over RPC.
    NotConfigured,
    Plain,
    Tls(TlsContext),
}

impl ReplicaLinks {
    /// Load the credentials (an error is the operator's: exit 2), and
    /// warn about plain links.
    fn load(auth: Option<&LinkAuth>) -> Result<ReplicaLinks, String> {
        let Some(auth) = auth else {
            return Ok(ReplicaLinks::NotConfigured);
        };
        match auth.context(Role::Client) {
            Ok(Some(ctx)) => {
                tracing::info!(creds = ?ctx.creds(), "replica links: TLS, replicas must authenticate");
                Ok(ReplicaLinks::Tls(ctx))
            }
            Ok(None) => {
                tracing::warn!("{}", lull_net::link::INSECURE_WARNING);
                Ok(ReplicaLinks::Plain)
            }
            Err(e) => Err(format!("replica links: {e}")),
        }
    }
}

pub(crate) fn open_device(
    spec: &config::VolumeSpec,
    fw: &lull_reactor::FrameworkHandle,
    engine: &lull_engine::EngineOptions,
    links: &ReplicaLinks,
    node_rebuild: &lull_engine::NodeRebuildLimit,
    resume: Option<u64>,
) -> Result<Storage, String> {
    let dev: Arc<dyn BlockDevice> = match &spec.backend {
        Backend::Replicas { addrs } => {
            let tls = match links {
                ReplicaLinks::NotConfigured => {
                    return Err(format!(
                        "a replicated volume, and this server was started without a replica-link choice: {}",
                        LinkAuth::missing(LinkAuth::SERVE_FLAGS)
                    ))
                }
                ReplicaLinks::Plain => None,
                ReplicaLinks::Tls(ctx) => Some(ctx.clone()),
            };
            // Engines are spread over the reactors at start (round robin);
            // the dynamic scheduler moves them later as their load asks.
            let reactor = fw.next_reactor();
            return lull_engine::ReplicatedDev::start_with(
                fw,
                reactor,
                &spec.name,
                addrs.clone(),
                spec.size_bytes,
                engine.clone(),
                tls,
                resume,
            )
            .and_then(|dev| {
                dev.set_node_rebuild_limit(node_rebuild.clone())?;
                Ok(dev)
            })
            .map(Storage::Replicated)
            .map_err(|e| e.to_string());
        }
        Backend::Malloc | Backend::File { .. } => {
            return open_chain(&spec.backend, spec.size_bytes).map(Storage::Layered)
        }
        local => open_local(&spec.name, local, spec.size_bytes)?,
    };
    Ok(Storage::Local(dev))
}

const _: () = assert!(config::MAX_SERVER_CONNECTIONS == lull_nbd::MAX_CONNECTIONS);
const _: () =
    assert!(config::FIXED_BUFFERS_MIB_DEFAULT << 20 == lull_uring::ARENA_BYTES_DEFAULT as u64);
const _: () = assert!(config::FIXED_BUFFERS_MIB_MAX << 20 == lull_uring::ARENA_BYTES_MAX as u64);

/// `framework` with the io_uring hooks filled in: every reactor maps
/// `mib` MiB of fixed I/O buffers on its own thread when it starts (none
/// with 0), and reports them and the io_uring_enter calls made on its
/// thread in its stats. Pass the result to `Framework::start`.
pub(crate) fn init_fixed_buffers(mib: u64, framework: FrameworkConfig) -> FrameworkConfig {
    lull_uring::set_reactor_arena_bytes((mib << 20) as usize);
    let framework = FrameworkConfig {
        io_uring_enter_source: Some(lull_uring::thread_enter_calls),
        reactor_start_hook: Some(|_reactor| {
            let _ = lull_uring::init_thread_arena();
        }),
        fixed_buffer_source: Some(|| {
            lull_uring::thread_arena_stats().map_or(Default::default(), |a| {
                lull_reactor::FixedBufferUsage {
                    bytes: a.bytes as u64,
                    in_use_bytes: a.in_use_bytes as u64,
                    locked: a.locked,
                }
            })
        }),
        ..framework
    };
    if mib > 0 {
        tracing::info!(
            mib_per_reactor = mib,
            memlock_limit_bytes = ?lull_uring::memlock_limit_bytes(),
            "fixed I/O buffers: prefaulted, registered with io_uring"
        );
    }
    framework
}

/// A memory or file volume as a chain of layers, so it can take
/// snapshots (`lull_bdev::chain`): a file volume finds its snapshots
/// again in `PATH.lull/`.
pub(crate) fn open_chain(
    backend: &Backend,
    size_bytes: u64,
) -> Result<Arc<lull_bdev::ChainDev>, String> {
    let store = chain_store(backend, size_bytes)?;
    let describe = store.describe();
    lull_bdev::ChainDev::open(store, size_bytes)
        .map(Arc::new)
        .map_err(|e| format!("{describe}: {e}"))
}

/// Where a chain of `backend` keeps its layers: memory, or files next to
/// the volume's file. Also a clone's head (`volume_clone`).
pub(crate) fn chain_store(
    backend: &Backend,
    size_bytes: u64,
) -> Result<Arc<dyn lull_bdev::chain::LayerStore>, String> {
    Ok(match backend {
        Backend::Malloc => Arc::new(lull_bdev::chain::MemoryStore::new(Arc::new(
            MallocDev::new(size_bytes).map_err(|e| e.to_string())?,
        ))),
        Backend::File { path, direct, ring } => Arc::new(lull_bdev::chain::FileStore::new(
            path,
            FileOptions {
                direct: *direct,
                create: true,
                ring: *ring,
            },
        )),
        _ => return Err("only memory and file volumes take snapshots".into()),
    })
}

/// A device in this process: memory, a file, or either with faults injected.
fn open_local(
    volume: &str,
    backend: &Backend,
    size_bytes: u64,
) -> Result<Arc<dyn BlockDevice>, String> {
    Ok(match backend {
        Backend::Malloc => Arc::new(MallocDev::new(size_bytes).map_err(|e| e.to_string())?),
        Backend::File { path, direct, ring } => Arc::new(
            FileDev::open(
                path,
                size_bytes,
                FileOptions {
                    direct: *direct,
                    create: true,
                    ring: *ring,
                },
            )
            .map_err(|e| format!("{}: {e}", path.display()))?,
        ),
        Backend::Faulty {
            inner,
            faults,
            seed,
        } => {
            // No seed given: one from the clock, logged so the run can be repeated.
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64)
            });
            let faults = lull_bdev::Faults { seed, ..*faults };
            let dev = lull_bdev::FaultyDev::new(open_local(volume, inner, size_bytes)?, faults);
            tracing::warn!(
                volume,
                seed,
                read_err = faults.read_err.get(),
                write_err = faults.write_err.get(),
                flush_err = faults.flush_err.get(),
                delay_us = faults.delay_us,
                "FAULT INJECTION ENABLED on this volume: {}",
                dev.describe()
            );
            Arc::new(dev)
        }
        Backend::Replicas { .. } => return Err("a replicated volume is not a local device".into()),
    })
}

/// Wait (all volumes together, bounded) for replicated volumes to have a
/// healthy replica, then log each replica's state.
fn wait_for_replicas(volumes: &Volumes) {
    let deadline = std::time::Instant::now() + REPLICA_READY_TIMEOUT;
    for v in volumes.list() {
        let Some(dev) = v.storage.replicated() else {
            continue;
        };
        if !dev.wait_ready(deadline.saturating_duration_since(std::time::Instant::now())) {
            if dev.fenced_by().is_some() {
                // Dropped by its watch (`Control::watch_resumed`), which
                // says why.
                continue;
            }
            tracing::warn!(volume = %v.name, "no healthy replica yet; I/O fails with EIO until one is");
        }
        for r in dev.replica_status() {
            tracing::info!(volume = %v.name, replica = %r.addr, state = ?r.state, generation = r.generation, "replica");
        }
    }
}

/// Start the JSON-RPC server. The default socket being held by another
/// live server is not fatal (several servers on one machine are normal in
/// tests and benchmarks): RPC is then off, with a warning. An explicit
/// `--rpc-socket` that cannot be served is an error.
/// The JSON-RPC servers: the Unix socket and, with `--rpc-listen`, TCP
/// with TLS.
struct RpcServers {
    local: Option<lull_rpc::RpcServer>,
    tcp: Option<lull_rpc::RpcTcpServer>,
}

fn start_rpc(
    s: &ServeSettings,
    fw: &Framework,
    volumes: &Arc<Volumes>,
    control: &Arc<control::Control>,
) -> Result<RpcServers, String> {
    let mut registry = lull_rpc::MethodRegistry::new();
    let ctx = lull_rpc::LullContext {
        fw: fw.handle().clone(),
        volumes: volumes.clone(),
        control: control.clone(),
    };
    lull_rpc::register_lull_methods(&mut registry, ctx).map_err(|e| e.to_string())?;
    // Backup targets are recorded with the node's state, under its store.
    let backups = lull_backup::Backups::new(
        volumes.clone(),
        control.clone(),
        s.store.as_ref().map(|st| st.dir.clone()),
    )
    .map_err(|e| format!("backups: {e}"))?;
    lull_backup::rpc::register_backup_methods(&mut registry, backups).map_err(|e| e.to_string())?;
    let registry = Arc::new(registry);
    // The network listener first: its credentials are the likelier mistake,
    // and nothing is bound yet when they are refused.
    let tcp = match &s.rpc_listen {
        Some(l) => {
            let tls = match &l.creds {
                lull_net::tls::Creds::Psk(f) => lull_rpc::RpcTls::Psk(f.clone()),
                lull_net::tls::Creds::X509(d) => lull_rpc::RpcTls::Certs(d.clone()),
            };
            let tls = tls.server().map_err(|e| e.to_string())?;
            Some(
                lull_rpc::RpcTcpServer::start(l.addr, tls, registry.clone())
                    .map_err(|e| format!("JSON-RPC on {}: {e}", l.addr))?,
            )
        }
        None => None,
    };
    let (path, explicit) = match &s.rpc_socket {
        Some(p) => (p.clone(), true),
        None => (PathBuf::from(lull_rpc::DEFAULT_RPC_SOCKET), false),
    };
    let local = match lull_rpc::RpcServer::start(&path, registry) {
        Ok(r) => Some(r),
        Err(e) if !explicit => {
            tracing::warn!(socket = %path.display(), error = %e, "JSON-RPC is off: pass --rpc-socket PATH to enable it");
            None
        }
        Err(e) => return Err(format!("JSON-RPC socket {}: {e}", path.display())),
    };
    Ok(RpcServers { local, tcp })
}

/// Opens the node's store and its record of RPC-created volumes, and
/// checks that no volume is declared both there and by `--volume` or the
/// config file.
/// A node's store and its record of RPC-created volumes (both `None`
/// without `--store`).
type NodeParts = (
    Option<Arc<lull_replica::Store>>,
    Option<Arc<node::NodeState>>,
);

fn open_node(
    s: &ServeSettings,
    faults: lull_replica::ReplicaFaults,
    fw: &lull_reactor::FrameworkHandle,
) -> Result<NodeParts, String> {
    let Some(st) = &s.store else {
        return Ok((None, None));
    };
    let link = s
        .replica_link
        .clone()
        .ok_or_else(|| LinkAuth::missing(LinkAuth::SERVE_FLAGS))?;
    if faults.drop.get() > 0.0 || faults.error.get() > 0.0 || faults.delay_us > 0 {
        tracing::warn!(
            drop = faults.drop.get(),
            error = faults.error.get(),
            delay_us = faults.delay_us,
            seed = faults.seed,
            "FAULT INJECTION ENABLED on every replica of the store (--store-fault-*)"
        );
    }
    let store = lull_replica::Store::open(
        fw,
        &lull_replica::StoreConfig {
            dir: st.dir.clone(),
            listen: st.replica_listen,
            link,
            overcommit_percent: st.overcommit_percent,
            faults,
            ..Default::default()
        },
    )
    .map_err(|e| format!("store {}: {e}", st.dir.display()))?;
    let node = node::NodeState::load(&st.dir)?;
    for v in node.volumes() {
        if s.volumes.iter().any(|d| d.name == v.name) {
            return Err(format!(
                "volume {:?} is declared by --volume (or the config file) and recorded in {} (created over RPC): remove one of the two",
                v.name,
                node.path().display()
            ));
        }
    }
    Ok((Some(Arc::new(store)), Some(Arc::new(node))))
}

/// The NVMe/TCP options of a recorded volume, checked as
/// `volume_create`'s were.
fn recorded_nvmf(v: &node::VolumeEntry) -> Result<Option<config::NvmfVolume>, String> {
    if v.nvmf_nqn.is_none() && v.nvmf_lba.is_none() && v.nvmf_allow_hosts.is_empty() {
        return Ok(None);
    }
    let n = config::NvmfVolume {
        nqn: v.nvmf_nqn.clone(),
        lba_bytes: v.nvmf_lba,
        allow_hosts: v.nvmf_allow_hosts.clone(),
    };
    config::check_nvmf_volume(&v.name, v.size_bytes, &n).map_err(|e| e.to_string())?;
    Ok(Some(n))
}

/// `--store-fault-*`: the store's replicas' fault injection, checked.
fn store_faults(args: &ServeArgs) -> Result<lull_replica::ReplicaFaults, String> {
    let faults = cli::replica::parse_faults(
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

fn serve(args: ServeArgs) -> ExitCode {
    let started = std::time::Instant::now();
    let faults = match store_faults(&args) {
        Ok(f) => f,
        Err(e) => return usage_error(e),
    };
    let mut s = match settings(args) {
        Ok(s) => s,
        Err(e) => return usage_error(e),
    };
    let mut listen = Vec::new();
    if let Some(a) = s.listen {
        listen.push(ListenAddr::Tcp(a));
    }
    if let Some(p) = &s.socket {
        listen.push(ListenAddr::Unix(p.clone()));
    }
    let tls = match &s.tls.creds {
        Some(creds) => match TlsContext::new(creds, Role::Server) {
            Ok(ctx) => Some(NbdTls {
                policy: s.tls.policy,
                ctx,
            }),
            Err(e) => return usage_error(format!("NBD TLS: {e}")),
        },
        None => None,
    };
    let links = match ReplicaLinks::load(s.replica_link.as_ref()) {
        Ok(l) => l,
        Err(e) => return usage_error(e),
    };
    let mut signals = match cli::signals::stop_signals() {
        Ok(s) => s,
        Err(code) => return code,
    };
    lull_net::server::raise_fd_limit("nbd");
    let mut fw = match Framework::start(init_fixed_buffers(
        s.fixed_buffers_mib,
        FrameworkConfig {
            ioq_poll_period_us: s.ioq_poll_period_us,
            stall_threshold_ms: s.stall_threshold_ms,
            scheduler: s.scheduler,
            ..FrameworkConfig::new(s.cores.clone(), s.mode)
        },
    )) {
        Ok(fw) => fw,
        Err(e) => {
            eprintln!("lull: error: cannot start reactors: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (store, node) = match open_node(&s, faults, fw.handle()) {
        Ok(n) => n,
        Err(e) => {
            eprintln!("lull: error: {e}");
            fw.stop();
            return ExitCode::FAILURE;
        }
    };
    let volumes = Arc::new(Volumes::with_limits(VolumeLimits {
        connections: s.max_connections_per_volume,
        in_flight: s.max_in_flight_per_volume,
    }));
    // Volumes the node recorded come back as they were created; a
    // resumed one (`volume_create`'s `resume`) with its engine's session.
    let mut recorded = Vec::new();
    let mut resumed: std::collections::BTreeMap<String, u64> = Default::default();
    for v in node.as_ref().map(|n| n.volumes()).unwrap_or_default() {
        let spec = config::parse_volume(&format!("{}:{}:{}", v.name, v.size_bytes, v.backend))
            .map_err(|e| e.to_string())
            .and_then(|spec| recorded_nvmf(&v).map(|n| (spec, n)));
        match spec {
            Ok((spec, nvmf)) => {
                if let Some(n) = nvmf {
                    if s.nvmf_listen.is_none() {
                        tracing::warn!(volume = %v.name, "recorded with NVMe/TCP options, and this daemon serves no NVMe/TCP (--nvmf-listen): NBD only");
                    }
                    s.nvmf_volumes.insert(v.name.clone(), n);
                }
                if let Some(session) = v.session {
                    resumed.insert(v.name.clone(), session);
                }
                recorded.push(spec);
            }
            Err(e) => {
                eprintln!(
                    "lull: error: node state {}: volume {:?}: {e}",
                    node.as_ref()
                        .map_or_else(String::new, |n| n.path().display().to_string()),
                    v.name
                );
                fw.stop();
                return ExitCode::FAILURE;
            }
        }
    }
    // One rebuild budget for the node (`node_set_rebuild_limit`), shared
    // by every replicated volume's engine; no limit until set, or as the
    // node recorded it.
    let node_rebuild = lull_engine::NodeRebuildLimit::default();
    let limits = node.as_ref().map(|n| n.limits()).unwrap_or_default();
    if let Some(mb) = limits.rebuild_mbytes_per_sec {
        node_rebuild.set(mb * 1_000_000);
        tracing::info!(mbytes_per_sec = mb, "node rebuild bandwidth limit restored");
    }
    for spec in s.volumes.iter().chain(&recorded) {
        let resume = resumed.get(&spec.name).copied();
        let dev = match open_device(spec, fw.handle(), &s.engine, &links, &node_rebuild, resume) {
            Ok(d) => d,
            Err(e) => {
                fw.stop();
                return usage_error(format!("volume {}: {e}", spec.name));
            }
        };
        match volumes.add(Volume::new(&spec.name, dev)) {
            Ok(v) => {
                let qos = node.as_ref().and_then(|n| n.volume_qos(&spec.name));
                if let Some(limits) = qos {
                    use lull_reactor::Clock;
                    v.qos.set(limits, lull_reactor::MonotonicClock.now_ns());
                    tracing::info!(volume = %spec.name, ?limits, "QoS limits restored");
                }
                // The volume's own limit, else the one set for every
                // volume.
                let rebuild = node
                    .as_ref()
                    .and_then(|n| n.volume_rebuild_limit(&spec.name))
                    .or(limits.volume_rebuild_mbytes_per_sec);
                if let (Some(mb), Some(dev)) = (rebuild, v.storage.replicated()) {
                    match dev.set_rebuild_limit(mb * 1_000_000) {
                        Ok(()) => tracing::info!(volume = %spec.name, mbytes_per_sec = mb,
                            "rebuild bandwidth limit restored"),
                        Err(e) => tracing::warn!(volume = %spec.name, error = %e,
                            "cannot restore the rebuild bandwidth limit"),
                    }
                }
            }
            Err(e) => {
                fw.stop();
                return usage_error(e);
            }
        }
    }
    wait_for_replicas(&volumes);
    let server = match NbdServer::start_with(
        fw.handle(),
        volumes.clone(),
        &listen,
        tls,
        s.max_connections,
    ) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lull: error: {e}");
            fw.stop();
            return ExitCode::FAILURE;
        }
    };
    let subsystems = s
        .nvmf_volumes
        .iter()
        .map(|(name, n)| {
            let options = lull_nvmf::SubsystemOptions {
                nqn: n.nqn.clone(),
                lba_shift: match n.lba_bytes {
                    Some(4096) => lull_nvmf::LBA_SHIFT_4K,
                    _ => lull_nvmf::LBA_SHIFT,
                },
                allowed_hosts: n.allow_hosts.clone(),
            };
            (name.clone(), options)
        })
        .collect();
    let psks: Vec<_> = s
        .nvmf_psks
        .iter()
        .map(|p| lull_nvmf::PskEntry {
            volume: p.volume.clone(),
            hostnqn: p.hostnqn.clone(),
            key_file: p.key_file.clone(),
        })
        .collect();
    let nvmf = match s.nvmf_listen {
        Some(addr) => {
            let started = lull_nvmf::NvmfServer::start_with_psks(
                fw.handle(),
                volumes.clone(),
                addr,
                subsystems,
                &psks,
            );
            match started {
                Ok(n) => Some(n),
                Err(e) => {
                    eprintln!("lull: error: {e}");
                    server.shutdown(SHUTDOWN_TIMEOUT);
                    fw.stop();
                    return ExitCode::FAILURE;
                }
            }
        }
        None => None,
    };
    // Both frontends stop the same way: no new connections, in-flight
    // I/O finished, then closed.
    let stop_frontends = |server: &NbdServer, nvmf: &Option<lull_nvmf::NvmfServer>| {
        let mut left = server.shutdown(SHUTDOWN_TIMEOUT);
        if let Some(n) = nvmf {
            left += n.shutdown(SHUTDOWN_TIMEOUT);
        }
        left
    };
    let control = Arc::new(
        control::Control::new(
            fw.handle().clone(),
            volumes.clone(),
            s.engine.clone(),
            links,
        )
        .with_nvmf(nvmf.as_ref().map(|n| n.subsystems()))
        .with_store(store.clone(), node.clone())
        .with_node_rebuild(
            node_rebuild,
            limits.volume_rebuild_mbytes_per_sec.unwrap_or(0) * 1_000_000,
        ),
    );
    control.apply_keepalive(s.mode);
    for name in resumed.keys() {
        control.watch_resumed(name);
    }
    let rpc = match start_rpc(&s, &fw, &volumes, &control) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("lull: error: {e}");
            stop_frontends(&server, &nvmf);
            fw.stop();
            return ExitCode::FAILURE;
        }
    };
    let metrics = match s.metrics {
        Some(addr) => match lull_rpc::MetricsServer::start(addr, control.clone()) {
            Ok(m) => Some(m),
            Err(e) => {
                eprintln!("lull: error: metrics on {addr}: {e}");
                stop_frontends(&server, &nvmf);
                fw.stop();
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    println!(
        "lull {}: {} reactor(s) on core(s) {:?}, {} mode",
        env!("CARGO_PKG_VERSION"),
        s.cores.len(),
        s.cores,
        s.mode
    );
    for v in volumes.list() {
        println!(
            "volume {}: {} ({})",
            v.name,
            lull_bdev::human_bytes(v.dev().size_bytes()),
            v.dev().describe()
        );
    }
    // Before NBD's "listening on": tools that wait for that line have
    // seen everything else by then.
    if let Some(n) = &nvmf {
        println!("nvmf listening on {}", n.local_addr());
        for v in volumes.list() {
            println!(
                "try: spdk_nvme_identify -r 'trtype:TCP adrfam:IPv4 traddr:{} trsvcid:{} subnqn:{}'",
                n.local_addr().ip(),
                n.local_addr().port(),
                n.nqn_of(&v.name)
            );
        }
    }
    if let Some(st) = &store {
        println!(
            "replica store {} on {}: {} replica(s)",
            st.dir().display(),
            st.local_addr(),
            st.len()
        );
    }
    if let Some(t) = &rpc.tcp {
        println!("rpc on tcp {} (TLS)", t.local_addr());
    }
    // Everything above serves once this line is printed: the start-up time
    // an operator (and the benchmark) reads.
    let ready_ms = started.elapsed().as_millis();
    tracing::info!(
        ready_ms,
        volumes = volumes.list().len(),
        replicas = store.as_ref().map_or(0, |st| st.len()),
        "serving"
    );
    println!("ready in {ready_ms} ms");
    for a in server.local_addrs() {
        println!("listening on {a}");
    }
    if let Some(v) = volumes.list().first() {
        for a in server.local_addrs() {
            match a {
                ListenAddr::Tcp(addr) => println!("try: nbdinfo nbd://{addr}/{}", v.name),
                ListenAddr::Unix(p) => println!(
                    "try: nbdinfo 'nbd+unix:///{}?socket={}'",
                    v.name,
                    p.display()
                ),
            }
        }
    }
    if let Some(r) = &rpc.local {
        println!("rpc on {}", r.path().display());
    }
    if let Some(m) = &metrics {
        println!("metrics on http://{}/metrics", m.local_addr());
    }
    let signal = signals.forever().next();
    tracing::info!(
        ?signal,
        "stopping: no new connections, finishing in-flight I/O"
    );
    drop(rpc);
    drop(metrics);
    let left = stop_frontends(&server, &nvmf);
    if left > 0 {
        tracing::warn!(
            connections = left,
            "connections still open after the shutdown timeout"
        );
    }
    // Replicated volumes detach cleanly while the reactors still run, so
    // their replicas are clean and the next start reconciles nothing.
    // (Replicas in this node's own store are still served meanwhile.)
    let mut code = ExitCode::SUCCESS;
    for v in volumes.list() {
        let Some(dev) = v.storage.replicated() else {
            continue;
        };
        match dev.detach(DETACH_TIMEOUT) {
            Ok(true) => tracing::info!(volume = %v.name, "detached from its replicas cleanly"),
            Ok(false) => {
                tracing::error!(volume = %v.name, "clean detach did not finish: the replicas stay dirty and are reconciled at the next start");
                code = ExitCode::FAILURE;
            }
            Err(e) => {
                tracing::error!(volume = %v.name, error = %e, "clean detach failed: the replicas stay dirty and are reconciled at the next start");
                code = ExitCode::FAILURE;
            }
        }
    }
    if let Some(st) = &store {
        if let Err(e) = st.shutdown(SHUTDOWN_TIMEOUT) {
            tracing::error!(error = %e, "replica store did not stop cleanly");
            code = ExitCode::FAILURE;
        }
    }
    for r in fw.handle().reactor_stats() {
        tracing::info!(
            reactor = r.index,
            core = r.core,
            mode = %r.mode,
            busy_ms = r.busy_ns / 1_000_000,
            idle_ms = r.idle_ns / 1_000_000,
            wakeups = r.wakeups,
            spins_with_work = r.spins_with_work,
            spins_idle = r.spins_idle,
            spin_ms = r.spin_ns / 1_000_000,
            "reactor totals"
        );
    }
    fw.stop();
    for v in volumes.list() {
        if let Err(e) = v.dev().sync() {
            tracing::error!(volume = %v.name, error = %e, "flush at shutdown failed");
            code = ExitCode::FAILURE;
        }
    }
    tracing::info!("stopped");
    code
}
