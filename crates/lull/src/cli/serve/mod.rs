//! `lull serve`: the process around a node daemon's run. It resolves
//! the settings (`args`), opens the store and the volumes (the `Storage`
//! factory is `crate::storage`), starts the frontends, the control plane
//! (`crate::control`) and its servers, and at a stop signal takes them
//! down in order.
//!
//! # Layout
//!
//! - `args`: the flags (`ServeArgs`) and their resolution into
//!   `ServeSettings`.

mod args;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use lull_nbd::{ListenAddr, NbdServer, NbdTls};
use lull_net::link::LinkAuth;
use lull_net::tls::{Role, TlsContext};
use lull_reactor::{Framework, FrameworkConfig};
use lull_volume::{Volume, VolumeLimits, Volumes};

use lull_config as config;
use lull_config::ServeSettings;

pub(crate) use args::ServeArgs;
use args::{settings, store_faults};

use super::{init_fixed_buffers, usage_error};
use crate::storage::{open_device, ReplicaLinks};

/// How long a stop waits for connections to finish their in-flight I/O.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

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

const _: () = assert!(config::MAX_SERVER_CONNECTIONS == lull_nbd::MAX_CONNECTIONS);

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

/// The JSON-RPC servers: the Unix socket and, with `--rpc-listen`, TCP
/// with TLS.
struct RpcServers {
    local: Option<lull_rpc::RpcServer>,
    tcp: Option<lull_rpc::RpcTcpServer>,
}

/// Start the JSON-RPC server. The default socket being held by another
/// live server is not fatal (several servers on one machine are normal in
/// tests and benchmarks): RPC is then off, with a warning. An explicit
/// `--rpc-socket` that cannot be served is an error.
fn start_rpc(
    s: &ServeSettings,
    fw: &Framework,
    volumes: &Arc<Volumes>,
    control: &Arc<crate::control::Control>,
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

/// A node's store and its record of RPC-created volumes (both `None`
/// without `--store`).
type NodeParts = (
    Option<Arc<lull_replica::Store>>,
    Option<Arc<crate::node::NodeState>>,
);

/// Opens the node's store and its record of RPC-created volumes, and
/// checks that no volume is declared both there and by `--volume` or the
/// config file.
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
    let node = crate::node::NodeState::load(&st.dir)?;
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
fn recorded_nvmf(v: &crate::node::VolumeEntry) -> Result<Option<config::NvmfVolume>, String> {
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

/// `lull serve`: starts everything, serves until a stop signal, stops it
/// in order (frontends, engines, store, reactors) and flushes.
pub(crate) fn run(args: ServeArgs) -> ExitCode {
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
    let mut signals = match super::signals::stop_signals() {
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
        crate::control::Control::new(
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
