//! `lull serve`'s settings: embedded defaults, then a TOML file, then
//! command-line flags. Pure parsing and merging (no clap, no file I/O), in
//! a crate of its own so the fuzz targets and their corpus replay reach the
//! same `ConfigFile::parse` and `resolve` the binary calls.
//!
//! ```toml
//! listen = "127.0.0.1:10809"
//! socket = "/run/lull/nbd.sock"   # optional Unix socket
//! cores = "1"                      # reactor cores: "0,2-3"
//! mode = "adaptive"                # poll | interrupt | hybrid | adaptive
//! nvme_ioq_poll_period_us = 100    # hybrid mode's replica-connection poll
//! rpc_socket = "/var/tmp/lull.sock"
//! replica_timeout_ms = 8000        # replicated volumes (Longhorn's default)
//! connections_per_replica = 2
//! max_connections = 16384          # NBD connections held at once
//! max_connections_per_volume = 4096 # NBD connections per volume
//! max_in_flight_per_volume = 4096 # requests in flight per volume
//! metrics = "127.0.0.1:9555"      # Prometheus endpoint; off when absent
//! nvmf_listen = "127.0.0.1:4420"   # NVMe/TCP target; off when absent
//! tls = "require"                  # NBD TLS: off | on | require
//! tls_psk = "/etc/lull/keys.psk"   # username:hexkey lines, or
//! # tls_certs = "/etc/lull/pki"    # server-cert.pem, server-key.pem[, ca-cert.pem]
//! # Replica links (engine -> lull replica), one of the three when a
//! # volume is replicated:
//! replica_tls_psk = "/etc/lull/replica.psk"  # the replicas' --tls-psk file, or
//! # replica_tls_certs = "/etc/lull/replica-pki" # ca-cert.pem, client-cert.pem, client-key.pem
//! # replica_insecure = true        # plain TCP: no authentication (logged at start)
//! # A storage node: replicas kept under `store`, served on one port to
//! # any engine (the replica-link choice above secures that port too):
//! # store = "/var/lib/lull/store"
//! # replica_listen = "0.0.0.0:10900" # default 127.0.0.1:10900
//! # store_overcommit = 1.0         # sum of replica sizes / what the disk can hold
//! # JSON-RPC over TCP, TLS only (mutual certificates or a PSK file):
//! # rpc_listen = "0.0.0.0:10910"
//! # rpc_tls_certs = "/etc/lull/rpc-pki"  # ca-cert.pem, server-cert.pem, server-key.pem
//! # rpc_tls_psk = "/etc/lull/rpc.psk"
//! stall_threshold_ms = 1000        # a reactor silent this long is reported stalled; 0 = off
//! fixed_buffers_mib = 16           # per reactor: prefaulted, registered I/O buffers; 0 = off
//! scheduler = "static"             # static | dynamic (moves threads between cores)
//! scheduler_period_us = 1000000    # how often the scheduler balances
//! # dynamic's tunables (SPDK's, percent): scheduler_load_limit = 20,
//! # scheduler_core_limit = 80, scheduler_core_busy = 95
//! # Longhorn's names are accepted as aliases:
//! # data-engine-interrupt-mode-enabled = true   (true = interrupt, false = poll)
//! # data-engine-nvme-ioq-poll-period-us = 100
//!
//! [[volume]]
//! name = "vol0"
//! size = "1G"
//! backend = "malloc"               # or "file=/var/lib/lull/vol0.img,direct"
//! # NVMe/TCP only (NBD ignores them):
//! nvmf_lba = 4096                  # LBA size: 512 (default) or 4096
//! nvmf_nqn = "nqn.2026-11.io.example:vol0"  # default nqn.2026-11.io.lull:vol0
//! nvmf_allow_hosts = ["nqn.2014-08.org.nvmexpress:uuid:..."]  # default: any host
//! # NVMe/TCP over TLS 1.3: a host's key file (PSK interchange format,
//! # NVMeTLSkey-1:01:...:); a volume with any key refuses plaintext hosts.
//! # nvmf_psk = [{ host = "nqn.2014-08.org.nvmexpress:uuid:...", key_file = "/etc/lull/vol0-host1.key" }]
//! # Fault injection, to rehearse failures (any setting may be left out):
//! # backend = "faulty=malloc,read_err=0.01,write_err=0.01,flush_err=0,delay_us=500,seed=1"
//! # file flags: direct, sqpoll[=IDLE_MS], iopoll, iopoll=auto, hybrid_iopoll, fixed=off, inline[=on|off|auto]
//! ```

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use lull_net::link::LinkAuth;
use lull_net::tls::Creds;
use lull_proto::nbd::TlsPolicy;
use lull_reactor::scheduler::{DynamicParams, Policy};
use lull_reactor::{Mode, SchedulerConfig};
use serde::Deserialize;

/// A configuration error: the message names the setting.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError(msg.into()))
}

/// Where a volume's data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    Malloc,
    File {
        path: PathBuf,
        direct: bool,
        /// `sqpoll[=IDLE_MS]`, `iopoll`, `iopoll=auto`, `hybrid_iopoll`.
        ring: lull_bdev::RingOptions,
    },
    /// Replicas (`replicas=HOST:PORT+HOST:PORT/NAME...`): `lull replica`
    /// processes, or named replicas in node daemons' stores.
    Replicas {
        addrs: Vec<lull_engine::ReplicaTarget>,
    },
    /// A memory or file backend with faults injected
    /// (`faulty=INNER,read_err=P,write_err=P,flush_err=P,delay_us=N,seed=N`).
    /// `seed` is `None` when not given: the server picks one and logs it.
    Faulty {
        inner: Box<Backend>,
        faults: lull_bdev::Faults,
        seed: Option<u64>,
    },
}

/// Parse `faulty=`'s value: `INNER` then `,KEY=VALUE` settings. The
/// settings are taken off the end, so a file path may itself contain commas.
fn parse_faulty(spec: &str, rest: &str) -> Result<Backend, ConfigError> {
    let mut faults = lull_bdev::Faults::default();
    let mut seed = None;
    let mut inner = rest;
    while let Some((head, setting)) = inner.rsplit_once(',') {
        let Some((key, value)) = setting.split_once('=') else {
            break;
        };
        let bad = |e: String| ConfigError(format!("backend {spec:?}: {key}: {e}"));
        match key {
            "read_err" => faults.read_err = value.parse().map_err(bad)?,
            "write_err" => faults.write_err = value.parse().map_err(bad)?,
            "flush_err" => faults.flush_err = value.parse().map_err(bad)?,
            "delay_us" => {
                let d: u64 = value
                    .parse()
                    .map_err(|_| bad(format!("{value:?} is not a number of microseconds")))?;
                if d > lull_bdev::MAX_FAULT_DELAY_US {
                    return Err(bad(format!("at most {} us", lull_bdev::MAX_FAULT_DELAY_US)));
                }
                faults.delay_us = d;
            }
            "seed" => {
                seed = Some(
                    value
                        .parse()
                        .map_err(|_| bad(format!("{value:?} is not a number")))?,
                )
            }
            _ => break,
        }
        inner = head;
    }
    let inner = parse_backend(inner)?;
    if !matches!(inner, Backend::Malloc | Backend::File { .. }) {
        return err(format!(
            "backend {spec:?}: faulty= wraps malloc or file=PATH[,direct] only"
        ));
    }
    Ok(Backend::Faulty {
        inner: Box::new(inner),
        faults,
        seed,
    })
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeSpec {
    pub name: String,
    pub size_bytes: u64,
    pub backend: Backend,
}

/// How a volume is served over NVMe/TCP, where it differs from the
/// defaults (NQN from its name, 512-byte LBAs, any host).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvmfVolume {
    /// The subsystem's NQN; `None`: `nqn.2026-11.io.lull:<volume>`.
    pub nqn: Option<String>,
    /// LBA size in bytes: 512 or 4096; `None`: 512.
    pub lba_bytes: Option<u32>,
    /// Host NQNs allowed to connect; empty: any host.
    pub allow_hosts: Vec<String>,
}

/// A host's NVMe/TCP TLS key for a volume (`--nvmf-psk
/// VOLUME=HOSTNQN=KEYFILE`, or a volume's `nvmf_psk` table). The file is
/// read when the target starts, not here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NvmfPsk {
    pub volume: String,
    pub hostnqn: String,
    pub key_file: PathBuf,
}

/// LBA sizes the NVMe/TCP target offers: 512 B (what every host handles)
/// and 4 KiB (what 4K-native filesystems and databases prefer).
pub const NVMF_LBA_SIZES: [u32; 2] = [512, 4096];

/// Longest NQN, in bytes (NVMe base spec: 223 bytes, UTF-8).
pub const MAX_NQN_LEN: usize = 223;

fn check_nqn(what: &str, nqn: &str) -> Result<(), ConfigError> {
    if !nqn.starts_with("nqn.") || nqn.len() > MAX_NQN_LEN || nqn.chars().any(char::is_control) {
        return err(format!(
            "{what} {nqn:?}: an NQN starts with \"nqn.\" and has at most {MAX_NQN_LEN} bytes"
        ));
    }
    Ok(())
}

/// The settings `lull serve` runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeSettings {
    pub listen: Option<SocketAddr>,
    pub socket: Option<PathBuf>,
    pub cores: Vec<usize>,
    pub mode: Mode,
    pub ioq_poll_period_us: u64,
    pub volumes: Vec<VolumeSpec>,
    pub rpc_socket: Option<PathBuf>,
    pub metrics: Option<SocketAddr>,
    /// The NVMe/TCP target's address; off when `None`.
    pub nvmf_listen: Option<SocketAddr>,
    /// Per-volume NVMe/TCP settings (volumes not named use the defaults).
    pub nvmf_volumes: std::collections::BTreeMap<String, NvmfVolume>,
    /// NVMe/TCP TLS keys, per volume and host.
    pub nvmf_psks: Vec<NvmfPsk>,
    /// TLS on the NBD server.
    pub tls: NbdTlsSettings,
    /// How the engines' links to replicas are secured; `None` when not
    /// configured (then no replicated volume may be served or created).
    pub replica_link: Option<LinkAuth>,
    pub engine: lull_engine::EngineOptions,
    pub scheduler: SchedulerConfig,
    /// NBD connections the server holds at once (1 to [`MAX_SERVER_CONNECTIONS`]).
    pub max_connections: usize,
    /// NBD connections one volume serves at once (1 to
    /// `lull_volume::MAX_CONNECTIONS_PER_VOLUME`).
    pub max_connections_per_volume: usize,
    /// Requests in flight on one volume over all its connections (1 to
    /// `lull_volume::MAX_IN_FLIGHT_PER_VOLUME`).
    pub max_in_flight_per_volume: usize,
    /// MiB of fixed I/O buffers (prefaulted, registered with io_uring)
    /// each reactor maps at start; 0: none, buffers come from the heap.
    pub fixed_buffers_mib: u64,
    /// The replica store, when this daemon is a storage node (`--store`).
    pub store: Option<StoreSettings>,
    /// JSON-RPC over TCP with TLS (`--rpc-listen`); off when `None`.
    pub rpc_listen: Option<RpcListen>,
    /// A reactor that does not answer the watchdog this long is reported
    /// as stalled (`--stall-threshold-ms`; 0: no watchdog).
    pub stall_threshold_ms: u64,
}

/// Largest `stall_threshold_ms`: a reactor silent for a minute is long
/// past stalled; a larger value is a typo for "off" (0).
pub const MAX_STALL_THRESHOLD_MS: u64 = 60_000;

/// `--store DIR` and its settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreSettings {
    pub dir: PathBuf,
    /// Where engines reach the store's replicas (`--replica-listen`).
    pub replica_listen: SocketAddr,
    /// How far the sum of replica sizes may exceed what the filesystem
    /// can hold, in percent (`store_overcommit` × 100; 100: never, every
    /// replica can be written in full).
    pub overcommit_percent: u32,
}

/// `--rpc-listen ADDR:PORT` with its credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcListen {
    pub addr: SocketAddr,
    /// `--rpc-tls-certs DIR` (mutual certificates) or `--rpc-tls-psk FILE`.
    pub creds: Creds,
}

/// Where a store serves its replicas when `--replica-listen` is not given:
/// loopback (other nodes' engines need an address set on purpose).
pub const DEFAULT_REPLICA_LISTEN: &str = "127.0.0.1:10900";
/// `store_overcommit` by default: no overcommit (Longhorn's
/// `storage-over-provisioning-percentage` of 100).
pub const DEFAULT_STORE_OVERCOMMIT: f64 = 1.0;
/// Largest `store_overcommit`: past 100x thin provisioning is a typo, not a
/// plan (Longhorn's setting is a percentage with no bound; a ratio this
/// high already promises a hundred disks' worth of space).
pub const MAX_STORE_OVERCOMMIT: f64 = 100.0;

/// `fixed_buffers_mib` by default: lull_uring's `ARENA_BYTES_DEFAULT`
/// (16 MiB: a queue of 64 requests of any size up to 128 KiB per reactor;
/// the binary asserts they agree).
pub const FIXED_BUFFERS_MIB_DEFAULT: u64 = 16;
/// Largest `fixed_buffers_mib`: lull_uring's `ARENA_BYTES_MAX` (io_uring
/// registers an arena as one buffer, at most 1 GiB).
pub const FIXED_BUFFERS_MIB_MAX: u64 = 1024;

/// Checks a `fixed_buffers_mib` / `--fixed-buffers-mib` value.
pub fn check_fixed_buffers_mib(mib: u64) -> Result<u64, ConfigError> {
    if mib > FIXED_BUFFERS_MIB_MAX {
        return err(format!(
            "fixed_buffers_mib = {mib}: must be 0 (off) to {FIXED_BUFFERS_MIB_MAX}"
        ));
    }
    Ok(mib)
}

/// The most NBD connections a server may be configured to hold: the NBD
/// server's own cap, `lull_nbd::MAX_CONNECTIONS` (the binary asserts they
/// agree), which is also the default.
pub const MAX_SERVER_CONNECTIONS: usize = 16_384;
/// `--tls`, `--tls-certs`, `--tls-psk` resolved: credentials whenever
/// the policy is not `Off`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NbdTlsSettings {
    pub policy: TlsPolicy,
    pub creds: Option<Creds>,
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:10809";
pub const DEFAULT_VOLUME: &str = "vol0:1G:malloc";
/// Adaptive: poll-mode latency under load, interrupt-mode CPU when idle
/// (docs/BENCHMARKS.md has the run that made it the default).
pub const DEFAULT_MODE: Mode = Mode::Adaptive;

/// The config file's shape. Unknown keys are errors: a typo must not be
/// silently ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub listen: Option<String>,
    pub socket: Option<PathBuf>,
    pub cores: Option<String>,
    pub mode: Option<String>,
    /// Longhorn's `data-engine-interrupt-mode-enabled`: true = interrupt,
    /// false = poll.
    #[serde(rename = "data-engine-interrupt-mode-enabled")]
    pub interrupt_mode_enabled: Option<bool>,
    #[serde(alias = "data-engine-nvme-ioq-poll-period-us")]
    pub nvme_ioq_poll_period_us: Option<u64>,
    pub rpc_socket: Option<PathBuf>,
    pub metrics: Option<String>,
    /// The NVMe/TCP target's ADDR:PORT (4420 is the usual port).
    pub nvmf_listen: Option<String>,
    /// NBD TLS: off, on or require.
    pub tls: Option<String>,
    /// NBD TLS X.509 directory (qemu's tls-creds-x509 layout).
    pub tls_certs: Option<PathBuf>,
    /// NBD TLS-PSK file (`username:hexkey` lines).
    pub tls_psk: Option<PathBuf>,
    /// Replica links: the PSK file the replicas were given.
    pub replica_tls_psk: Option<PathBuf>,
    /// Replica links: ca-cert.pem, client-cert.pem, client-key.pem.
    pub replica_tls_certs: Option<PathBuf>,
    /// Replica links: plain TCP, unauthenticated.
    pub replica_insecure: Option<bool>,
    /// Replicated volumes: a replica silent this long is failed.
    pub replica_timeout_ms: Option<u64>,
    /// Replicated volumes: TCP connections per replica.
    pub connections_per_replica: Option<usize>,
    /// NBD connections held at once.
    pub max_connections: Option<usize>,
    /// NBD connections per volume.
    pub max_connections_per_volume: Option<usize>,
    /// Requests in flight per volume.
    pub max_in_flight_per_volume: Option<usize>,
    /// MiB of fixed I/O buffers per reactor (0: off).
    pub fixed_buffers_mib: Option<u64>,
    /// A storage node's replica store directory.
    pub store: Option<PathBuf>,
    /// The store's replica port.
    pub replica_listen: Option<String>,
    /// Sum of replica sizes over what the store's filesystem holds.
    pub store_overcommit: Option<f64>,
    /// JSON-RPC over TCP (TLS only).
    pub rpc_listen: Option<String>,
    pub rpc_tls_certs: Option<PathBuf>,
    pub rpc_tls_psk: Option<PathBuf>,
    /// The reactor watchdog's stall threshold (0: off).
    pub stall_threshold_ms: Option<u64>,
    pub scheduler: Option<String>,
    pub scheduler_period_us: Option<u64>,
    pub scheduler_load_limit: Option<u8>,
    pub scheduler_core_limit: Option<u8>,
    pub scheduler_core_busy: Option<u8>,
    #[serde(default)]
    pub volume: Vec<VolumeTable>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeTable {
    pub name: String,
    pub size: String,
    #[serde(default)]
    pub backend: Option<String>,
    /// NVMe/TCP LBA size: 512 or 4096.
    pub nvmf_lba: Option<u32>,
    /// NVMe/TCP subsystem NQN.
    pub nvmf_nqn: Option<String>,
    /// NVMe/TCP host NQNs allowed to connect (absent or empty: any).
    #[serde(default)]
    pub nvmf_allow_hosts: Vec<String>,
    /// NVMe/TCP TLS keys of hosts (a volume with any requires TLS).
    #[serde(default)]
    pub nvmf_psk: Vec<NvmfPskTable>,
}

/// One `nvmf_psk` entry of a volume table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmfPskTable {
    /// The host's NQN.
    pub host: String,
    /// A file holding the host's key in the PSK interchange format.
    pub key_file: PathBuf,
}

impl ConfigFile {
    pub fn parse(text: &str) -> Result<ConfigFile, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError(format!("config: {e}")))
    }
}

/// Command-line overrides (each `None`/empty means "not given").
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub listen: Option<String>,
    pub socket: Option<PathBuf>,
    pub cores: Option<String>,
    pub mode: Option<String>,
    pub ioq_poll_period_us: Option<u64>,
    pub volumes: Vec<String>,
    pub rpc_socket: Option<PathBuf>,
    pub metrics: Option<String>,
    pub nvmf_listen: Option<String>,
    /// `VOLUME=BYTES`: the LBA size a volume has over NVMe/TCP.
    pub nvmf_lba: Vec<String>,
    /// `VOLUME=NQN`: a volume's subsystem NQN.
    pub nvmf_nqn: Vec<String>,
    /// `VOLUME=HOSTNQN`, repeatable: hosts allowed to connect to a
    /// volume's subsystem (replacing the config file's list for it).
    pub nvmf_allow_host: Vec<String>,
    /// `VOLUME=HOSTNQN=KEYFILE`, repeatable: a host's TLS key for a
    /// volume (replacing the config file's keys for that volume).
    pub nvmf_psk: Vec<String>,
    pub tls: Option<String>,
    pub tls_certs: Option<PathBuf>,
    pub tls_psk: Option<PathBuf>,
    pub replica_tls_psk: Option<PathBuf>,
    pub replica_tls_certs: Option<PathBuf>,
    /// `--replica-insecure` (false: not given).
    pub replica_insecure: bool,
    pub replica_timeout_ms: Option<u64>,
    pub connections_per_replica: Option<usize>,
    pub max_connections: Option<usize>,
    pub max_connections_per_volume: Option<usize>,
    pub max_in_flight_per_volume: Option<usize>,
    pub fixed_buffers_mib: Option<u64>,
    pub store: Option<PathBuf>,
    pub replica_listen: Option<String>,
    pub store_overcommit: Option<f64>,
    pub rpc_listen: Option<String>,
    pub rpc_tls_certs: Option<PathBuf>,
    pub rpc_tls_psk: Option<PathBuf>,
    pub stall_threshold_ms: Option<u64>,
    pub scheduler: Option<String>,
    pub scheduler_period_us: Option<u64>,
}

/// Parse a size with an optional binary suffix: `4096`, `64K`, `1G`, `2TiB`.
pub fn parse_size(s: &str) -> Result<u64, ConfigError> {
    lull_bdev::parse_size_bytes(s).map_err(ConfigError)
}

/// Parse a backend: `malloc`, `file=PATH[,FLAG...]` (flags: `direct`,
/// `sqpoll[=IDLE_MS]`, `iopoll`, `iopoll=auto`, `hybrid_iopoll`,
/// `fixed=on|off`),
/// `replicas=...` or `faulty=INNER,read_err=P,...`.
pub fn parse_backend(s: &str) -> Result<Backend, ConfigError> {
    if let Some(rest) = s.strip_prefix("faulty=") {
        return parse_faulty(s, rest);
    }
    if s == "malloc" {
        return Ok(Backend::Malloc);
    }
    if let Some(rest) = s.strip_prefix("file=") {
        // Flags are taken from the end while they are flags, so a path
        // may itself contain a comma.
        let (mut path, mut direct, mut ring) = (rest, false, lull_bdev::RingOptions::default());
        while let Some((head, flag)) = path.rsplit_once(',') {
            let known = ring
                .parse_flag(flag, &mut direct)
                .map_err(|e| ConfigError(format!("backend {s:?}: {e}")))?;
            if !known {
                break;
            }
            path = head;
        }
        if path.is_empty() {
            return err(format!("backend {s:?}: file= needs a path"));
        }
        return Ok(Backend::File {
            path: PathBuf::from(path),
            direct,
            ring,
        });
    }
    if let Some(rest) = s.strip_prefix("replicas=") {
        let addrs = lull_engine::parse_replicas(rest).map_err(|e| ConfigError(e.to_string()))?;
        return Ok(Backend::Replicas { addrs });
    }
    err(format!("unknown backend {s:?}: expected malloc, file=PATH[,direct][,sqpoll[=IDLE_MS]][,iopoll|iopoll=auto|hybrid_iopoll][,fixed=off][,inline[=on|off|auto]], replicas=HOST:PORT[+HOST:PORT...] or faulty=INNER,read_err=P,write_err=P,flush_err=P,delay_us=N,seed=N"))
}

/// Parse `NAME:SIZE[:BACKEND]`.
pub fn parse_volume(s: &str) -> Result<VolumeSpec, ConfigError> {
    let mut parts = s.splitn(3, ':');
    let name = parts.next().unwrap_or_default();
    let Some(size) = parts.next() else {
        return err(format!("volume {s:?}: expected NAME:SIZE[:BACKEND]"));
    };
    let backend = parts
        .next()
        .map(parse_backend)
        .transpose()?
        .unwrap_or(Backend::Malloc);
    volume(name, size, backend)
}

fn volume(name: &str, size: &str, backend: Backend) -> Result<VolumeSpec, ConfigError> {
    if name.is_empty()
        || name.len() > 255
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return err(format!(
            "volume name {name:?}: use 1-255 characters of A-Z a-z 0-9 - _ ."
        ));
    }
    Ok(VolumeSpec {
        name: name.to_string(),
        size_bytes: parse_size(size)?,
        backend,
    })
}

/// Parse a core list: `3`, `0,2`, `0-3`, `0-1,4`.
pub fn parse_cores(s: &str) -> Result<Vec<usize>, ConfigError> {
    lull_reactor::parse_core_list(s).map_err(ConfigError)
}

/// Resolve the NBD TLS settings. Credentials without a policy mean
/// `require` (as qemu-nbd's `--tls-creds`): a server given keys should not
/// serve in plaintext unless told to.
pub fn resolve_tls(
    policy: Option<&str>,
    certs: Option<PathBuf>,
    psk: Option<PathBuf>,
) -> Result<NbdTlsSettings, ConfigError> {
    let creds = match (certs, psk) {
        (Some(_), Some(_)) => return err("tls_certs and tls_psk: give one of them"),
        (Some(dir), None) => Some(Creds::X509(dir)),
        (None, Some(file)) => Some(Creds::Psk(file)),
        (None, None) => None,
    };
    let policy = match (policy, &creds) {
        (None, None) | (Some("off"), _) => TlsPolicy::Off,
        (None, Some(_)) | (Some("require"), _) => TlsPolicy::Require,
        (Some("on"), _) => TlsPolicy::On,
        (Some(other), _) => {
            return err(format!(
                "unknown tls setting {other:?} (expected off, on or require)"
            ))
        }
    };
    if policy != TlsPolicy::Off && creds.is_none() {
        return err(
            "tls = on/require needs tls_certs (--tls-certs DIR) or tls_psk (--tls-psk FILE)",
        );
    }
    Ok(NbdTlsSettings {
        creds: creds.filter(|_| policy != TlsPolicy::Off),
        policy,
    })
}

pub fn parse_mode(s: &str) -> Result<Mode, ConfigError> {
    s.parse::<Mode>().map_err(ConfigError)
}

/// Merge defaults, the config file and the flags.
pub fn resolve(
    file: ConfigFile,
    flags: Overrides,
    allowed_cpus: &[usize],
) -> Result<ServeSettings, ConfigError> {
    let replica_link = resolve_replica_link(&flags, &file)?;
    let store = resolve_store(&flags, &file)?;
    let rpc_listen = resolve_rpc_listen(&flags, &file)?;
    let stall_threshold_ms = flags
        .stall_threshold_ms
        .or(file.stall_threshold_ms)
        .unwrap_or(lull_reactor::watchdog::DEFAULT_STALL_THRESHOLD_MS);
    if stall_threshold_ms > MAX_STALL_THRESHOLD_MS {
        return err(format!(
            "stall_threshold_ms = {stall_threshold_ms}: must be 0 (off) to {MAX_STALL_THRESHOLD_MS}"
        ));
    }
    let listen_s = flags.listen.or(file.listen);
    let socket = flags.socket.or(file.socket);
    // A socket alone serves instead of TCP; with --listen too, as well.
    let listen = match (&listen_s, &socket) {
        (Some(l), _) => Some(l.parse().map_err(|_| {
            ConfigError(format!("invalid listen address {l:?}: expected ADDR:PORT"))
        })?),
        (None, Some(_)) => None,
        (None, None) => Some(DEFAULT_LISTEN.parse().expect("default address")),
    };
    let cores = match flags.cores.or(file.cores) {
        Some(c) => parse_cores(&c)?,
        // One reactor on the last core: core 0 takes most interrupts and
        // housekeeping, and a client pinned there does not compete with it.
        None => vec![*allowed_cpus
            .last()
            .ok_or_else(|| ConfigError("no CPU available".into()))?],
    };
    if let Some(bad) = cores.iter().find(|c| !allowed_cpus.contains(c)) {
        return err(format!(
            "core {bad} is not available to this process (allowed: {allowed_cpus:?})"
        ));
    }
    let file_mode = match (file.mode.as_deref().map(parse_mode).transpose()?, file.interrupt_mode_enabled) {
        (Some(m), Some(alias)) if (m == Mode::Interrupt) != alias || !matches!(m, Mode::Interrupt | Mode::Poll) => {
            return err(format!(
                "mode = {:?} contradicts data-engine-interrupt-mode-enabled = {alias}; set one of them",
                m.as_str()
            ))
        }
        (Some(m), _) => Some(m),
        (None, Some(true)) => Some(Mode::Interrupt),
        (None, Some(false)) => Some(Mode::Poll),
        (None, None) => None,
    };
    let mode = match flags.mode {
        Some(m) => parse_mode(&m)?,
        None => file_mode.unwrap_or(DEFAULT_MODE),
    };
    let ioq_poll_period_us = flags
        .ioq_poll_period_us
        .or(file.nvme_ioq_poll_period_us)
        .unwrap_or(lull_reactor::DEFAULT_IOQ_POLL_PERIOD_US);
    if ioq_poll_period_us == 0 {
        return err(
            "nvme_ioq_poll_period_us (data-engine-nvme-ioq-poll-period-us) must be at least 1",
        );
    }
    let mut nvmf_volumes = std::collections::BTreeMap::new();
    let mut nvmf_psks = Vec::new();
    if flags.volumes.is_empty() {
        for v in &file.volume {
            for p in &v.nvmf_psk {
                nvmf_psks.push(NvmfPsk {
                    volume: v.name.clone(),
                    hostnqn: p.host.clone(),
                    key_file: p.key_file.clone(),
                });
            }
        }
        for v in &file.volume {
            if v.nvmf_lba.is_some() || v.nvmf_nqn.is_some() || !v.nvmf_allow_hosts.is_empty() {
                nvmf_volumes.insert(
                    v.name.clone(),
                    NvmfVolume {
                        nqn: v.nvmf_nqn.clone(),
                        lba_bytes: v.nvmf_lba,
                        allow_hosts: v.nvmf_allow_hosts.clone(),
                    },
                );
            }
        }
    }
    let volumes = if !flags.volumes.is_empty() {
        flags
            .volumes
            .iter()
            .map(|v| parse_volume(v))
            .collect::<Result<Vec<_>, _>>()?
    } else if !file.volume.is_empty() {
        file.volume
            .iter()
            .map(|v| {
                volume(
                    &v.name,
                    &v.size,
                    v.backend
                        .as_deref()
                        .map(parse_backend)
                        .transpose()?
                        .unwrap_or(Backend::Malloc),
                )
            })
            .collect::<Result<Vec<_>, _>>()?
    } else if store.is_some() {
        // A storage node starts with the volumes its store recorded, not
        // a memory volume nobody asked for.
        Vec::new()
    } else {
        vec![parse_volume(DEFAULT_VOLUME)?]
    };
    let mut names = std::collections::HashSet::new();
    if let Some(d) = volumes.iter().find(|v| !names.insert(v.name.clone())) {
        return err(format!("volume {:?} is defined twice", d.name));
    }
    apply_nvmf_flags(
        &flags.nvmf_lba,
        &flags.nvmf_nqn,
        &flags.nvmf_allow_host,
        &mut nvmf_volumes,
    )?;
    check_nvmf_volumes(&nvmf_volumes, &volumes)?;
    apply_nvmf_psk_flags(&flags.nvmf_psk, &mut nvmf_psks)?;
    check_nvmf_psks(&nvmf_psks, &volumes)?;
    let metrics = match flags.metrics.or(file.metrics) {
        Some(m) => Some(m.parse().map_err(|_| {
            ConfigError(format!("invalid metrics address {m:?}: expected ADDR:PORT"))
        })?),
        None => None,
    };
    let nvmf_listen = match flags.nvmf_listen.or(file.nvmf_listen) {
        Some(a) => Some(a.parse().map_err(|_| {
            ConfigError(format!(
                "invalid nvmf_listen address {a:?}: expected ADDR:PORT"
            ))
        })?),
        None => None,
    };
    if nvmf_listen.is_none() && !nvmf_psks.is_empty() {
        tracing::warn!(
            "NVMe/TCP PSKs are configured and NVMe/TCP is off (no nvmf_listen): they are not used"
        );
    }
    let tls = resolve_tls(
        flags.tls.or(file.tls).as_deref(),
        flags.tls_certs.or(file.tls_certs),
        flags.tls_psk.or(file.tls_psk),
    )?;
    if replica_link.is_none() && store.is_some() {
        return err(format!(
            "a store serves replicas to engines: {}",
            LinkAuth::missing(LinkAuth::SERVE_FLAGS)
        ));
    }
    if replica_link.is_none() {
        if let Some(v) = volumes
            .iter()
            .find(|v| matches!(v.backend, Backend::Replicas { .. }))
        {
            return err(format!(
                "volume {:?} is replicated: {}",
                v.name,
                LinkAuth::missing(LinkAuth::SERVE_FLAGS)
            ));
        }
    }
    let rpc_socket = flags.rpc_socket.or(file.rpc_socket);
    let mut engine = lull_engine::EngineOptions::default();
    if let Some(t) = flags.replica_timeout_ms.or(file.replica_timeout_ms) {
        engine.replica_timeout_ms = t;
    }
    if let Some(c) = flags
        .connections_per_replica
        .or(file.connections_per_replica)
    {
        engine.connections_per_replica = c;
    }
    engine.validate().map_err(|e| ConfigError(e.to_string()))?;
    let max_connections = flags
        .max_connections
        .or(file.max_connections)
        .unwrap_or(MAX_SERVER_CONNECTIONS);
    if !(1..=MAX_SERVER_CONNECTIONS).contains(&max_connections) {
        return err(format!(
            "max_connections = {max_connections}: must be 1 to {MAX_SERVER_CONNECTIONS}"
        ));
    }
    let max_connections_per_volume = flags
        .max_connections_per_volume
        .or(file.max_connections_per_volume)
        .unwrap_or(lull_volume::DEFAULT_MAX_CONNECTIONS_PER_VOLUME);
    if !(1..=lull_volume::MAX_CONNECTIONS_PER_VOLUME).contains(&max_connections_per_volume) {
        return err(format!(
            "max_connections_per_volume = {max_connections_per_volume}: must be 1 to {}",
            lull_volume::MAX_CONNECTIONS_PER_VOLUME
        ));
    }
    let max_in_flight_per_volume = flags
        .max_in_flight_per_volume
        .or(file.max_in_flight_per_volume)
        .unwrap_or(lull_volume::DEFAULT_MAX_IN_FLIGHT_PER_VOLUME);
    if !(1..=lull_volume::MAX_IN_FLIGHT_PER_VOLUME).contains(&max_in_flight_per_volume) {
        return err(format!(
            "max_in_flight_per_volume = {max_in_flight_per_volume}: must be 1 to {}",
            lull_volume::MAX_IN_FLIGHT_PER_VOLUME
        ));
    }
    let fixed_buffers_mib = check_fixed_buffers_mib(
        flags
            .fixed_buffers_mib
            .or(file.fixed_buffers_mib)
            .unwrap_or(FIXED_BUFFERS_MIB_DEFAULT),
    )?;
    let dynamic = DynamicParams {
        load_limit: file
            .scheduler_load_limit
            .unwrap_or(lull_reactor::scheduler::DEFAULT_LOAD_LIMIT),
        core_limit: file
            .scheduler_core_limit
            .unwrap_or(lull_reactor::scheduler::DEFAULT_CORE_LIMIT),
        core_busy: file
            .scheduler_core_busy
            .unwrap_or(lull_reactor::scheduler::DEFAULT_CORE_BUSY),
    };
    let scheduler = SchedulerConfig {
        policy: match flags.scheduler.or(file.scheduler).as_deref() {
            None | Some("static") => Policy::Static,
            Some("dynamic") => Policy::Dynamic(dynamic),
            Some(other) => {
                return err(format!(
                    "unknown scheduler {other:?} (expected static or dynamic)"
                ))
            }
        },
        period_us: flags
            .scheduler_period_us
            .or(file.scheduler_period_us)
            .unwrap_or(lull_reactor::scheduler::DEFAULT_PERIOD_US),
    };
    scheduler
        .validate()
        .map_err(|e| ConfigError(e.to_string()))?;
    if matches!(scheduler.policy, Policy::Dynamic(_)) && cores.len() < 2 {
        tracing::warn!(
            "scheduler = dynamic with one reactor core: nothing to move; give --cores a list"
        );
    }
    Ok(ServeSettings {
        listen,
        socket,
        cores,
        mode,
        ioq_poll_period_us,
        volumes,
        rpc_socket,
        metrics,
        nvmf_listen,
        nvmf_volumes,
        nvmf_psks,
        tls,
        replica_link,
        engine,
        scheduler,
        max_connections,
        max_connections_per_volume,
        max_in_flight_per_volume,
        fixed_buffers_mib,
        store,
        rpc_listen,
        stall_threshold_ms,
    })
}

/// `--store`, `--replica-listen` and `store_overcommit`: a replica port or
/// an overcommit without a store is a mistake worth saying.
fn resolve_store(
    flags: &Overrides,
    file: &ConfigFile,
) -> Result<Option<StoreSettings>, ConfigError> {
    let dir = flags.store.clone().or(file.store.clone());
    let listen = flags.replica_listen.clone().or(file.replica_listen.clone());
    let overcommit = flags.store_overcommit.or(file.store_overcommit);
    let Some(dir) = dir else {
        if listen.is_some() || overcommit.is_some() {
            return err("replica_listen and store_overcommit need a store (--store DIR)");
        }
        return Ok(None);
    };
    if dir.as_os_str().is_empty() {
        return err("store: an empty path");
    }
    let listen = listen.unwrap_or_else(|| DEFAULT_REPLICA_LISTEN.into());
    let replica_listen = listen.parse().map_err(|_| {
        ConfigError(format!(
            "invalid replica_listen address {listen:?}: expected ADDR:PORT"
        ))
    })?;
    let overcommit = overcommit.unwrap_or(DEFAULT_STORE_OVERCOMMIT);
    if !(overcommit.is_finite() && (1.0..=MAX_STORE_OVERCOMMIT).contains(&overcommit)) {
        return err(format!(
            "store_overcommit = {overcommit}: must be 1.0 (no overcommit) to {MAX_STORE_OVERCOMMIT}"
        ));
    }
    Ok(Some(StoreSettings {
        dir,
        replica_listen,
        overcommit_percent: (overcommit * 100.0).round() as u32,
    }))
}

/// `--rpc-listen` needs exactly one of `--rpc-tls-certs` and
/// `--rpc-tls-psk`: the network RPC is never plaintext.
fn resolve_rpc_listen(
    flags: &Overrides,
    file: &ConfigFile,
) -> Result<Option<RpcListen>, ConfigError> {
    let addr = flags.rpc_listen.clone().or(file.rpc_listen.clone());
    let certs = flags.rpc_tls_certs.clone().or(file.rpc_tls_certs.clone());
    let psk = flags.rpc_tls_psk.clone().or(file.rpc_tls_psk.clone());
    let Some(addr) = addr else {
        if certs.is_some() || psk.is_some() {
            return err("rpc_tls_certs and rpc_tls_psk need rpc_listen (--rpc-listen ADDR:PORT)");
        }
        return Ok(None);
    };
    let addr = addr.parse().map_err(|_| {
        ConfigError(format!(
            "invalid rpc_listen address {addr:?}: expected ADDR:PORT"
        ))
    })?;
    let creds = match (certs, psk) {
        (Some(dir), None) => Creds::X509(dir),
        (None, Some(file)) => Creds::Psk(file),
        (None, None) => {
            return err(
                "rpc_listen serves JSON-RPC over TLS only: give --rpc-tls-certs DIR (mutual certificates) or --rpc-tls-psk FILE",
            )
        }
        (Some(_), Some(_)) => return err("rpc_listen: give only one of --rpc-tls-certs and --rpc-tls-psk"),
    };
    Ok(Some(RpcListen { addr, creds }))
}

/// The replica-link choice: the flags' if any is given (they replace the
/// file's choice as a whole, so `--replica-insecure` can override a
/// file's key for a test run), else the file's; at most one of the three
/// in either.
fn resolve_replica_link(
    flags: &Overrides,
    file: &ConfigFile,
) -> Result<Option<LinkAuth>, ConfigError> {
    let from_flags = LinkAuth::from_flags(
        flags.replica_tls_psk.clone(),
        flags.replica_tls_certs.clone(),
        flags.replica_insecure,
        LinkAuth::SERVE_FLAGS,
    )
    .map_err(ConfigError)?;
    if from_flags.is_some() {
        return Ok(from_flags);
    }
    LinkAuth::from_flags(
        file.replica_tls_psk.clone(),
        file.replica_tls_certs.clone(),
        file.replica_insecure.unwrap_or(false),
        [
            "replica_tls_psk",
            "replica_tls_certs",
            "replica_insecure = true",
        ],
    )
    .map_err(ConfigError)
}

/// `VOLUME=VALUE` of an `--nvmf-*` flag.
fn volume_value<'a>(flag: &str, s: &'a str) -> Result<(&'a str, &'a str), ConfigError> {
    match s.split_once('=') {
        Some((v, value)) if !v.is_empty() && !value.is_empty() => Ok((v, value)),
        _ => err(format!("--{flag} {s:?}: expected VOLUME=VALUE")),
    }
}

/// The `--nvmf-*` flags, over what the config file said.
fn apply_nvmf_flags(
    lba: &[String],
    nqn: &[String],
    allow_host: &[String],
    nvmf: &mut std::collections::BTreeMap<String, NvmfVolume>,
) -> Result<(), ConfigError> {
    for s in lba {
        let (v, bytes) = volume_value("nvmf-lba", s)?;
        let bytes = bytes
            .parse()
            .map_err(|_| ConfigError(format!("--nvmf-lba {s:?}: the LBA size is 512 or 4096")))?;
        nvmf.entry(v.into()).or_default().lba_bytes = Some(bytes);
    }
    for s in nqn {
        let (v, nqn) = volume_value("nvmf-nqn", s)?;
        nvmf.entry(v.into()).or_default().nqn = Some(nqn.into());
    }
    let mut replaced = std::collections::HashSet::new();
    for s in allow_host {
        let (v, host) = volume_value("nvmf-allow-host", s)?;
        let e = nvmf.entry(v.into()).or_default();
        if replaced.insert(v.to_string()) {
            e.allow_hosts.clear();
        }
        e.allow_hosts.push(host.into());
    }
    Ok(())
}

/// `--nvmf-psk VOLUME=HOSTNQN=KEYFILE` flags: the keys they give a
/// volume replace the config file's keys for it.
fn apply_nvmf_psk_flags(flags: &[String], psks: &mut Vec<NvmfPsk>) -> Result<(), ConfigError> {
    let mut from_flags = Vec::new();
    for s in flags {
        let parsed = s.split_once('=').and_then(|(v, rest)| {
            let (host, file) = rest.split_once('=')?;
            (!v.is_empty() && !host.is_empty() && !file.is_empty()).then_some((v, host, file))
        });
        let Some((volume, host, file)) = parsed else {
            return err(format!("--nvmf-psk {s:?}: expected VOLUME=HOSTNQN=KEYFILE"));
        };
        from_flags.push(NvmfPsk {
            volume: volume.into(),
            hostnqn: host.into(),
            key_file: file.into(),
        });
    }
    psks.retain(|p| !from_flags.iter().any(|f| f.volume == p.volume));
    psks.extend(from_flags);
    Ok(())
}

/// Most NVMe/TCP TLS keys configured: each is a few dozen bytes held for
/// the life of the target; more than this is rather a generated mistake.
pub const MAX_NVMF_PSKS: usize = 4096;

/// Every key names a volume and a valid host NQN, once per pair.
fn check_nvmf_psks(psks: &[NvmfPsk], volumes: &[VolumeSpec]) -> Result<(), ConfigError> {
    if psks.len() > MAX_NVMF_PSKS {
        return err(format!(
            "{} NVMe/TCP PSKs: at most {MAX_NVMF_PSKS}",
            psks.len()
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for p in psks {
        if !volumes.iter().any(|v| v.name == p.volume) {
            return err(format!(
                "NVMe/TCP PSK for {:?}, which is not a volume",
                p.volume
            ));
        }
        check_nqn(&format!("volume {:?}: PSK host", p.volume), &p.hostnqn)?;
        if p.hostnqn.contains(' ') {
            return err(format!(
                "volume {:?}: PSK host {:?}: an NQN in a PSK identity holds no space",
                p.volume, p.hostnqn
            ));
        }
        if !seen.insert((p.volume.clone(), p.hostnqn.clone())) {
            return err(format!(
                "volume {:?}: two PSKs for host {:?}",
                p.volume, p.hostnqn
            ));
        }
    }
    Ok(())
}

/// Every NVMe/TCP setting names a volume, with a size its LBA size
/// divides, valid NQNs, and no NQN twice.
fn check_nvmf_volumes(
    nvmf: &std::collections::BTreeMap<String, NvmfVolume>,
    volumes: &[VolumeSpec],
) -> Result<(), ConfigError> {
    let mut nqns = std::collections::HashSet::new();
    for (name, n) in nvmf {
        let Some(v) = volumes.iter().find(|v| &v.name == name) else {
            return err(format!(
                "NVMe/TCP settings for {name:?}, which is not a volume"
            ));
        };
        check_nvmf_volume(name, v.size_bytes, n)?;
        if let Some(nqn) = &n.nqn {
            if !nqns.insert(nqn.clone()) {
                return err(format!("NQN {nqn:?} is given to two volumes"));
            }
        }
    }
    Ok(())
}

/// One volume's NVMe/TCP settings: an LBA size of [`NVMF_LBA_SIZES`]
/// that divides the volume's size, and valid NQNs (its own and the
/// allowed hosts'). For the configuration and for `volume_create` over
/// RPC alike.
pub fn check_nvmf_volume(name: &str, size_bytes: u64, n: &NvmfVolume) -> Result<(), ConfigError> {
    if let Some(lba) = n.lba_bytes {
        if !NVMF_LBA_SIZES.contains(&lba) {
            return err(format!(
                "volume {name:?}: NVMe/TCP LBA size {lba}: use 512 or 4096"
            ));
        }
        if !size_bytes.is_multiple_of(u64::from(lba)) {
            return err(format!(
                "volume {name:?}: size {size_bytes} is not a multiple of its {lba}-byte LBAs"
            ));
        }
    }
    if let Some(nqn) = &n.nqn {
        check_nqn(&format!("volume {name:?}: NQN"), nqn)?;
    }
    for h in &n.allow_hosts {
        check_nqn(&format!("volume {name:?}: allowed host"), h)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volumes_and_backends() {
        assert_eq!(
            parse_volume("a:1M").unwrap(),
            VolumeSpec {
                name: "a".into(),
                size_bytes: 1 << 20,
                backend: Backend::Malloc
            }
        );
        assert_eq!(
            parse_volume("b:2G:file=/tmp/x.img,direct").unwrap().backend,
            Backend::File {
                path: "/tmp/x.img".into(),
                direct: true,
                ring: Default::default(),
            }
        );
        assert_eq!(
            parse_volume("c:1G:file=/a:b").unwrap().backend,
            Backend::File {
                path: "/a:b".into(),
                direct: false,
                ring: Default::default(),
            }
        );
        assert_eq!(
            parse_volume("d:1G:file=/a,b.img,direct,sqpoll=20,iopoll=auto")
                .unwrap()
                .backend,
            Backend::File {
                path: "/a,b.img".into(),
                direct: true,
                ring: lull_bdev::RingOptions {
                    sqpoll_idle_ms: Some(20),
                    iopoll: lull_bdev::IoPoll::Auto,
                    ..Default::default()
                },
            }
        );
        let bad = parse_volume("e:1G:file=/x,sqpoll=forever").unwrap_err();
        assert!(bad.0.contains("sqpoll=forever"), "{bad}");
        assert_eq!(
            parse_volume("r:1G:replicas=127.0.0.1:7001+127.0.0.1:7002")
                .unwrap()
                .backend,
            Backend::Replicas {
                addrs: vec![
                    "127.0.0.1:7001".parse().unwrap(),
                    "127.0.0.1:7002".parse().unwrap()
                ]
            }
        );
        assert!(parse_volume("r:1G:replicas=").is_err());
        let p = |x: f64| lull_bdev::Probability::new(x).unwrap();
        assert_eq!(
            parse_volume("f:1G:faulty=file=/a,b,direct,read_err=0.5,delay_us=20,seed=9")
                .unwrap()
                .backend,
            Backend::Faulty {
                inner: Box::new(Backend::File {
                    path: PathBuf::from("/a,b"),
                    direct: true,
                    ring: Default::default(),
                }),
                faults: lull_bdev::Faults {
                    read_err: p(0.5),
                    delay_us: 20,
                    ..Default::default()
                },
                seed: Some(9),
            }
        );
        assert_eq!(
            parse_volume("f:1G:faulty=malloc,write_err=1,flush_err=0.25")
                .unwrap()
                .backend,
            Backend::Faulty {
                inner: Box::new(Backend::Malloc),
                faults: lull_bdev::Faults {
                    write_err: p(1.0),
                    flush_err: p(0.25),
                    ..Default::default()
                },
                seed: None,
            }
        );
        for bad in [
            "f:1G:faulty=",
            "f:1G:faulty=malloc,read_err=2",
            "f:1G:faulty=malloc,read_err=x",
            "f:1G:faulty=malloc,delay_us=-1",
            "f:1G:faulty=malloc,delay_us=10000001",
            "f:1G:faulty=malloc,bogus=1",
            "f:1G:faulty=replicas=127.0.0.1:7001",
            "f:1G:faulty=faulty=malloc",
        ] {
            assert!(parse_volume(bad).is_err(), "{bad}");
        }
        assert!(parse_volume("r:1G:replicas=nowhere").is_err());
        for bad in ["a", ":1G", "a:1G:disk", "a:1G:file=", "a b:1G", "a:zero"] {
            assert!(parse_volume(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn nvmf_psks_from_the_file_and_flags() {
        let file = || {
            ConfigFile::parse(
            "[[volume]]\nname = \"a\"\nsize = \"1M\"\nnvmf_psk = [{ host = \"nqn.h1\", key_file = \"/k/a1\" }, { host = \"nqn.h2\", key_file = \"/k/a2\" }]\n[[volume]]\nname = \"b\"\nsize = \"1M\"\nnvmf_psk = [{ host = \"nqn.h1\", key_file = \"/k/b1\" }]\n",
        )
        .unwrap()
        };
        let s = resolve(file(), Overrides::default(), &[0]).unwrap();
        assert_eq!(s.nvmf_psks.len(), 3);
        assert_eq!(s.nvmf_psks[2].key_file, PathBuf::from("/k/b1"));
        // A flag for "a" replaces the file's keys for "a", not for "b".
        let flags = Overrides {
            nvmf_psk: vec!["a=nqn.h3=/k/a3".into()],
            ..Overrides::default()
        };
        let s = resolve(file(), flags, &[0]).unwrap();
        let hosts: Vec<_> = s
            .nvmf_psks
            .iter()
            .map(|p| (p.volume.as_str(), p.hostnqn.as_str()))
            .collect();
        assert_eq!(hosts, vec![("b", "nqn.h1"), ("a", "nqn.h3")]);
        for bad in [
            "a=nqn.h3",
            "zz=nqn.h3=/k",
            "a=host=/k",
            "=nqn.h3=/k",
            "a=nqn.h3=",
        ] {
            let flags = Overrides {
                nvmf_psk: vec![bad.into()],
                ..Overrides::default()
            };
            assert!(resolve(file(), flags, &[0]).is_err(), "{bad}");
        }
        let twice = Overrides {
            nvmf_psk: vec!["a=nqn.h3=/k/1".into(), "a=nqn.h3=/k/2".into()],
            ..Overrides::default()
        };
        assert!(resolve(file(), twice, &[0]).is_err());
    }

    #[test]
    fn nvmf_volume_settings_from_the_file_and_flags() {
        let file = ConfigFile::parse(
            "[[volume]]\nname = \"a\"\nsize = \"1M\"\nnvmf_lba = 4096\nnvmf_nqn = \"nqn.2026-11.test:a\"\nnvmf_allow_hosts = [\"nqn.h1\"]\n[[volume]]\nname = \"b\"\nsize = \"1M\"\n",
        )
        .unwrap();
        let s = resolve(file, Overrides::default(), &[0]).unwrap();
        assert_eq!(
            s.nvmf_volumes.get("a"),
            Some(&NvmfVolume {
                nqn: Some("nqn.2026-11.test:a".into()),
                lba_bytes: Some(4096),
                allow_hosts: vec!["nqn.h1".into()],
            })
        );
        assert!(!s.nvmf_volumes.contains_key("b"));

        let flags = Overrides {
            volumes: vec!["a:1M".into(), "b:1M".into()],
            nvmf_lba: vec!["b=4096".into()],
            nvmf_allow_host: vec!["a=nqn.h2".into(), "a=nqn.h3".into()],
            ..Default::default()
        };
        let s = resolve(ConfigFile::default(), flags, &[0]).unwrap();
        assert_eq!(s.nvmf_volumes["b"].lba_bytes, Some(4096));
        assert_eq!(s.nvmf_volumes["a"].allow_hosts, vec!["nqn.h2", "nqn.h3"]);

        for (what, flags) in [
            (
                "no such volume",
                Overrides {
                    nvmf_lba: vec!["zz=512".into()],
                    ..Default::default()
                },
            ),
            (
                "bad size",
                Overrides {
                    nvmf_lba: vec!["vol0=1024".into()],
                    ..Default::default()
                },
            ),
            (
                "no =",
                Overrides {
                    nvmf_nqn: vec!["vol0".into()],
                    ..Default::default()
                },
            ),
            (
                "not an NQN",
                Overrides {
                    nvmf_nqn: vec!["vol0=iqn.x".into()],
                    ..Default::default()
                },
            ),
            (
                "bad host",
                Overrides {
                    nvmf_allow_host: vec!["vol0=host".into()],
                    ..Default::default()
                },
            ),
            (
                "size not a multiple",
                Overrides {
                    volumes: vec!["v:6K".into()],
                    nvmf_lba: vec!["v=4096".into()],
                    ..Default::default()
                },
            ),
            (
                "NQN twice",
                Overrides {
                    volumes: vec!["a:1M".into(), "b:1M".into()],
                    nvmf_nqn: vec!["a=nqn.x".into(), "b=nqn.x".into()],
                    ..Default::default()
                },
            ),
        ] {
            assert!(
                resolve(ConfigFile::default(), flags, &[0]).is_err(),
                "{what}"
            );
        }
    }

    #[test]
    fn scheduler_settings() {
        let s = resolve(ConfigFile::default(), Overrides::default(), &[0, 1]).unwrap();
        assert_eq!(s.scheduler, SchedulerConfig::default());
        let file = ConfigFile::parse(
            "cores = \"0-1\"\nscheduler = \"dynamic\"\nscheduler_period_us = 500000\nscheduler_core_limit = 70\n",
        )
        .unwrap();
        let s = resolve(file, Overrides::default(), &[0, 1]).unwrap();
        assert_eq!(s.scheduler.period_us, 500_000);
        assert_eq!(
            s.scheduler.policy,
            Policy::Dynamic(DynamicParams {
                core_limit: 70,
                ..DynamicParams::default()
            })
        );
        let flags = Overrides {
            scheduler: Some("static".into()),
            ..Default::default()
        };
        let file = ConfigFile::parse("scheduler = \"dynamic\"\n").unwrap();
        assert_eq!(
            resolve(file, flags, &[0, 1]).unwrap().scheduler.policy,
            Policy::Static
        );
        for bad in [
            "scheduler = \"fair\"\n",
            "scheduler_period_us = 5\n",
            "scheduler = \"dynamic\"\nscheduler_load_limit = 90\n",
        ] {
            let file = ConfigFile::parse(bad).unwrap();
            assert!(
                resolve(file, Overrides::default(), &[0, 1]).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn defaults_file_then_flags() {
        let s = resolve(ConfigFile::default(), Overrides::default(), &[0, 1]).unwrap();
        assert_eq!(s.listen, Some(DEFAULT_LISTEN.parse().unwrap()));
        assert_eq!(s.cores, vec![1]);
        assert_eq!(s.mode, Mode::Adaptive);
        assert_eq!(s.volumes, vec![parse_volume(DEFAULT_VOLUME).unwrap()]);

        let file = ConfigFile::parse(
            "listen = \"127.0.0.1:9000\"\nmode = \"poll\"\ncores = \"0\"\n[[volume]]\nname = \"x\"\nsize = \"8M\"\n",
        )
        .unwrap();
        let flags = Overrides {
            mode: Some("interrupt".into()),
            ..Default::default()
        };
        let s = resolve(file, flags, &[0, 1]).unwrap();
        assert_eq!(s.listen, Some("127.0.0.1:9000".parse().unwrap()));
        assert_eq!(s.mode, Mode::Interrupt, "flags override the file");
        assert_eq!(s.cores, vec![0]);
        assert_eq!(s.volumes[0].name, "x");

        let s = resolve(
            ConfigFile::default(),
            Overrides {
                socket: Some("/tmp/s".into()),
                ..Default::default()
            },
            &[0],
        )
        .unwrap();
        assert_eq!(s.listen, None, "a socket alone replaces TCP");
    }

    #[test]
    fn fixed_buffers_from_the_file_the_flags_and_the_backend() {
        let s = resolve(ConfigFile::default(), Overrides::default(), &[0]).unwrap();
        assert_eq!(s.fixed_buffers_mib, FIXED_BUFFERS_MIB_DEFAULT);
        let file = || ConfigFile::parse("fixed_buffers_mib = 64").unwrap();
        assert_eq!(
            resolve(file(), Overrides::default(), &[0])
                .unwrap()
                .fixed_buffers_mib,
            64
        );
        let off = Overrides {
            fixed_buffers_mib: Some(0),
            ..Default::default()
        };
        assert_eq!(resolve(file(), off, &[0]).unwrap().fixed_buffers_mib, 0);
        let big = Overrides {
            fixed_buffers_mib: Some(FIXED_BUFFERS_MIB_MAX + 1),
            ..Default::default()
        };
        let e = resolve(ConfigFile::default(), big, &[0]).unwrap_err();
        assert!(e.0.contains("fixed_buffers_mib"), "{e}");
        let Backend::File { ring, direct, .. } =
            parse_backend("file=/x.img,direct,fixed=off").unwrap()
        else {
            panic!("a file backend");
        };
        assert!(direct && !ring.fixed_buffers);
        let Backend::File { ring, .. } = parse_backend("file=/x.img").unwrap() else {
            panic!("a file backend");
        };
        assert!(ring.fixed_buffers, "on by default");
        assert!(parse_backend("file=/x.img,fixed=no").is_err());
    }

    #[test]
    fn connection_caps_from_the_file_and_flags() {
        let s = resolve(ConfigFile::default(), Overrides::default(), &[0]).unwrap();
        assert_eq!(s.max_connections, MAX_SERVER_CONNECTIONS);
        assert_eq!(
            s.max_connections_per_volume,
            lull_volume::DEFAULT_MAX_CONNECTIONS_PER_VOLUME
        );
        assert_eq!(
            s.max_in_flight_per_volume,
            lull_volume::DEFAULT_MAX_IN_FLIGHT_PER_VOLUME
        );
        let s = resolve(
            ConfigFile::parse("max_in_flight_per_volume = 64").unwrap(),
            Overrides::default(),
            &[0],
        )
        .unwrap();
        assert_eq!(s.max_in_flight_per_volume, 64);
        let file =
            || ConfigFile::parse("max_connections = 100\nmax_connections_per_volume = 8").unwrap();
        let s = resolve(file(), Overrides::default(), &[0]).unwrap();
        assert_eq!((s.max_connections, s.max_connections_per_volume), (100, 8));
        let flags = Overrides {
            max_connections_per_volume: Some(3),
            ..Default::default()
        };
        let s = resolve(file(), flags, &[0]).unwrap();
        assert_eq!((s.max_connections, s.max_connections_per_volume), (100, 3));
        for text in [
            "max_connections = 0",
            "max_connections = 16385",
            "max_connections_per_volume = 0",
            "max_connections_per_volume = 16385",
        ] {
            let e = resolve(ConfigFile::parse(text).unwrap(), Overrides::default(), &[0]);
            assert!(e.unwrap_err().0.contains("max_connections"), "{text}");
        }
        for text in [
            "max_in_flight_per_volume = 0",
            "max_in_flight_per_volume = 2097153",
        ] {
            let e = resolve(ConfigFile::parse(text).unwrap(), Overrides::default(), &[0]);
            assert!(
                e.unwrap_err().0.contains("max_in_flight_per_volume"),
                "{text}"
            );
        }
    }

    #[test]
    fn config_errors_are_clear() {
        assert!(ConfigFile::parse("lisen = \"x\"")
            .unwrap_err()
            .0
            .contains("lisen"));
        let e = resolve(
            ConfigFile::default(),
            Overrides {
                cores: Some("7".into()),
                ..Default::default()
            },
            &[0, 1],
        );
        assert!(e.unwrap_err().0.contains("core 7"));
        let e = resolve(
            ConfigFile::default(),
            Overrides {
                volumes: vec!["a:1M".into(), "a:2M".into()],
                ..Default::default()
            },
            &[0],
        );
        assert!(e.unwrap_err().0.contains("twice"));
        let e = resolve(
            ConfigFile::default(),
            Overrides {
                mode: Some("turbo".into()),
                ..Default::default()
            },
            &[0],
        );
        assert!(e.is_err());
        let e = resolve(
            ConfigFile::default(),
            Overrides {
                ioq_poll_period_us: Some(0),
                ..Default::default()
            },
            &[0],
        );
        assert!(e.unwrap_err().0.contains("at least 1"));
        let file =
            ConfigFile::parse("mode = \"poll\"\ndata-engine-interrupt-mode-enabled = true\n")
                .unwrap();
        assert!(resolve(file, Overrides::default(), &[0])
            .unwrap_err()
            .0
            .contains("contradicts"));
    }

    #[test]
    fn tls_settings() {
        let off = resolve_tls(None, None, None).unwrap();
        assert_eq!(off.policy, TlsPolicy::Off);
        let psk = resolve_tls(None, None, Some("k.psk".into())).unwrap();
        assert_eq!(psk.policy, TlsPolicy::Require, "keys alone mean require");
        assert_eq!(psk.creds, Some(Creds::Psk("k.psk".into())));
        let on = resolve_tls(Some("on"), Some("pki".into()), None).unwrap();
        assert_eq!(on.policy, TlsPolicy::On);
        assert_eq!(on.creds, Some(Creds::X509("pki".into())));
        assert!(resolve_tls(Some("require"), None, None).is_err());
        assert!(resolve_tls(None, Some("a".into()), Some("b".into())).is_err());
        assert!(resolve_tls(Some("yes"), None, Some("b".into())).is_err());
        let file = ConfigFile::parse("tls = \"on\"\ntls_psk = \"x.psk\"\n").unwrap();
        let s = resolve(file, Overrides::default(), &[0]).unwrap();
        assert_eq!(s.tls.policy, TlsPolicy::On);
        let flags = Overrides {
            tls: Some("off".into()),
            ..Overrides::default()
        };
        let file = ConfigFile::parse("tls_psk = \"x.psk\"\n").unwrap();
        assert_eq!(
            resolve(file, flags, &[0]).unwrap().tls.policy,
            TlsPolicy::Off
        );
    }

    #[test]
    fn replica_links_must_be_chosen_for_replicated_volumes() {
        let replicated = || Overrides {
            volumes: vec!["r:1G:replicas=127.0.0.1:7001".into()],
            ..Overrides::default()
        };
        let e = resolve(ConfigFile::default(), replicated(), &[0]).unwrap_err();
        assert!(
            e.0.contains("--replica-tls-psk")
                && e.0.contains("--replica-tls-certs")
                && e.0.contains("--replica-insecure"),
            "{e}"
        );
        // No replicated volume: nothing to choose.
        let s = resolve(ConfigFile::default(), Overrides::default(), &[0]).unwrap();
        assert_eq!(s.replica_link, None);
        let s = resolve(
            ConfigFile::default(),
            Overrides {
                replica_insecure: true,
                ..replicated()
            },
            &[0],
        )
        .unwrap();
        assert_eq!(s.replica_link, Some(LinkAuth::Insecure));
        let file = ConfigFile::parse("replica_tls_psk = \"r.psk\"\n").unwrap();
        let s = resolve(file, replicated(), &[0]).unwrap();
        assert_eq!(
            s.replica_link,
            Some(LinkAuth::Tls(Creds::Psk("r.psk".into())))
        );
        // The flags replace the file's choice.
        let file = ConfigFile::parse("replica_tls_psk = \"r.psk\"\n").unwrap();
        let flags = Overrides {
            replica_tls_certs: Some("pki".into()),
            ..replicated()
        };
        let s = resolve(file, flags, &[0]).unwrap();
        assert_eq!(
            s.replica_link,
            Some(LinkAuth::Tls(Creds::X509("pki".into())))
        );
        let both = Overrides {
            replica_tls_psk: Some("r.psk".into()),
            replica_insecure: true,
            ..replicated()
        };
        assert!(resolve(ConfigFile::default(), both, &[0])
            .unwrap_err()
            .0
            .contains("only one"));
        let file =
            ConfigFile::parse("replica_insecure = true\nreplica_tls_certs = \"pki\"\n").unwrap();
        assert!(resolve(file, replicated(), &[0])
            .unwrap_err()
            .0
            .contains("replica_tls_certs"));
    }

    #[test]
    fn nvmf_listen_is_off_unless_given() {
        let s = resolve(ConfigFile::default(), Overrides::default(), &[0]).unwrap();
        assert_eq!(s.nvmf_listen, None);
        let file = ConfigFile::parse("nvmf_listen = \"127.0.0.1:4420\"\n").unwrap();
        let s = resolve(file, Overrides::default(), &[0]).unwrap();
        assert_eq!(s.nvmf_listen, Some("127.0.0.1:4420".parse().unwrap()));
        let flags = Overrides {
            nvmf_listen: Some("127.0.0.1:4421".into()),
            ..Default::default()
        };
        let file = ConfigFile::parse("nvmf_listen = \"127.0.0.1:4420\"\n").unwrap();
        let s = resolve(file, flags, &[0]).unwrap();
        assert_eq!(s.nvmf_listen, Some("127.0.0.1:4421".parse().unwrap()));
        let flags = Overrides {
            nvmf_listen: Some("4420".into()),
            ..Default::default()
        };
        assert!(resolve(ConfigFile::default(), flags, &[0])
            .unwrap_err()
            .0
            .contains("nvmf_listen"));
    }

    #[test]
    fn longhorn_aliases() {
        let file = ConfigFile::parse(
            "data-engine-interrupt-mode-enabled = false\ndata-engine-nvme-ioq-poll-period-us = 250\n",
        )
        .unwrap();
        let s = resolve(file, Overrides::default(), &[0]).unwrap();
        assert_eq!(s.mode, Mode::Poll);
        assert_eq!(s.ioq_poll_period_us, 250);
        let file = ConfigFile::parse("data-engine-interrupt-mode-enabled = true\n").unwrap();
        assert_eq!(
            resolve(file, Overrides::default(), &[0]).unwrap().mode,
            Mode::Interrupt
        );
        let file = ConfigFile::parse("mode = \"hybrid\"\nnvme_ioq_poll_period_us = 10\n").unwrap();
        let s = resolve(file, Overrides::default(), &[0]).unwrap();
        assert_eq!((s.mode, s.ioq_poll_period_us), (Mode::Hybrid, 10));
    }
}
