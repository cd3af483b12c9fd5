//! lull's RPC methods, named after SPDK's where one exists.
//!
//! ```ignore
//! let mut reg = MethodRegistry::new();
//! register_lull_methods(&mut reg, LullContext { fw: fw.handle().clone(), volumes, control })?;
//! // lull rpc engine_set_options '{"data-engine-interrupt-mode-enabled": false}'
//! ```
//!
//! Parameters are validated here, at the edge, with `deny_unknown_fields`
//! structs (bad → -32602 naming the field); what the server does with valid
//! ones is behind [`ControlPlane`], which the binary implements. Its
//! errors are [`ControlError`]s, and [`ControlError::code`] is the one
//! place that gives each a JSON-RPC code.

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::server::{parse_params, MethodRegistry, RpcMethodError, INTERNAL_ERROR, INVALID_PARAMS};
use crate::RpcError;

/// Longest volume name accepted: the volume registry's limit (a volume's
/// name is its NBD export name).
pub const MAX_VOLUME_NAME_LEN: usize = lull_volume::MAX_VOLUME_NAME_LEN;

/// Longest replica address ("host:port"; a bracketed IPv6 address with a
/// zone is under 64 bytes, a DNS name under 254).
pub const MAX_REPLICA_ADDR_LEN: usize = 256;

/// Longest backend spec ("malloc", "file=PATH[,direct]"; PATH_MAX is 4096).
pub const MAX_BACKEND_LEN: usize = 4096 + 16;

/// Longest NQN accepted (NVMe base spec: 223 bytes); the server checks
/// the rest of its syntax.
pub const MAX_NQN_LEN: usize = 223;

/// Most host NQNs one `volume_create` may allow over NVMe/TCP. A
/// subsystem's allowlist is searched at each Connect; a few hundred
/// hosts is more than a volume is ever attached from, and 256 NQNs of
/// 223 bytes stay well inside the RPC request limit.
pub const MAX_NVMF_ALLOWED_HOSTS: usize = 256;

/// LBA sizes `volume_create` accepts for NVMe/TCP (the target's two
/// formats).
pub const NVMF_LBA_SIZES: [u32; 2] = [512, 4096];

/// Longest mode name; real ones are single words.
pub const MAX_MODE_NAME_LEN: usize = 32;

/// Largest poll period accepted. A queue polled less often than every 10 s
/// would let I/O sit near the NVMe default command timeout (30 s); nothing
/// useful is slower.
pub const MAX_POLL_PERIOD_US: u64 = 10_000_000;

/// Counters in these outputs are nanoseconds; SPDK reports ticks with the
/// tick rate beside them, so tools that divide by `tick_rate` get seconds.
pub const TICK_RATE_HZ: u64 = 1_000_000_000;

/// The server's control plane: what the RPC methods ask of the running
/// server (event modes, volumes, replicas). Parameters arrive checked
/// (names within their limits, sizes parsed, options normalized); what
/// only the server can judge (a mode it does not know, a backend it does
/// not have, a volume that does not exist) is its to refuse.
pub trait ControlPlane: Send + Sync {
    /// `engine_get_options`.
    fn get_options(&self) -> Options;
    /// `engine_set_options`: apply the given options, return the new ones.
    fn set_options(&self, change: &OptionsChange) -> Result<Options, ControlError>;
    /// `volume_create`.
    fn volume_create(&self, volume: &NewVolume) -> Result<VolumeInfo, ControlError>;
    /// `volume_delete`.
    fn volume_delete(&self, volume: &VolumeName) -> Result<(), ControlError>;
    /// `volume_resize`: grow a volume online; the volume as it is now.
    fn volume_resize(&self, resize: &VolumeResize) -> Result<VolumeInfo, ControlError>;
    /// `volume_get_stats`: ops, bytes, latency summary (the shape is the
    /// implementation's).
    fn volume_stats(&self, volume: &VolumeName) -> Result<Value, ControlError>;
    /// `replica_list`: one object per replica (the shape is the
    /// implementation's).
    fn replica_list(&self, volume: &ReplicaVolume) -> Result<Value, ControlError>;
    /// `replica_add`.
    fn replica_add(&self, replica: &ReplicaAddr) -> Result<(), ControlError>;
    /// `replica_remove`.
    fn replica_remove(&self, replica: &ReplicaAddr) -> Result<(), ControlError>;
    /// `replica_create`: a new, empty replica in this node's store (the
    /// replica as `replica_get` reports it).
    fn replica_create(&self, name: &str, size_bytes: u64) -> Result<Value, ControlError> {
        let _ = (name, size_bytes);
        Err(no_store())
    }
    /// `replica_delete`: a replica of the store and its data.
    fn replica_delete(&self, name: &str) -> Result<(), ControlError> {
        let _ = name;
        Err(no_store())
    }
    /// `replica_get`: one replica of the store.
    fn replica_get(&self, name: &str) -> Result<Value, ControlError> {
        let _ = name;
        Err(no_store())
    }
    /// `replica_resize`: grow a replica of the store that no engine
    /// holds (a volume not attached anywhere); the replica as
    /// `replica_get` reports it.
    fn replica_resize(&self, name: &str, size_bytes: u64) -> Result<Value, ControlError> {
        let _ = (name, size_bytes);
        Err(no_store())
    }
    /// Replica `name` of the store as a device of this process (its chain:
    /// the live data and its snapshots' views), for the backups of a
    /// replica's snapshot and the restores into a new replica that run
    /// with no engine (lull_backup).
    fn replica_device(&self, name: &str) -> Result<Arc<dyn lull_bdev::BlockDevice>, ControlError> {
        let _ = name;
        Err(no_store())
    }
    /// `replica_import`: adopt a `lull replica --dir` directory as `name`.
    fn replica_import(&self, name: &str, dir: &str) -> Result<Value, ControlError> {
        let _ = (name, dir);
        Err(no_store())
    }
    /// `replica_clone`: a new replica of the store whose base is snapshot
    /// `snapshot` of replica `origin` of the store (shared, not copied).
    fn replica_clone(
        &self,
        name: &str,
        origin: &str,
        snapshot: &str,
    ) -> Result<Value, ControlError> {
        let _ = (name, origin, snapshot);
        Err(no_store())
    }
    /// `replica_snapshot`: create (`create: true`) or delete snapshot
    /// `snapshot` of a replica of the store that no engine holds.
    fn replica_snapshot(
        &self,
        name: &str,
        snapshot: &str,
        create: bool,
    ) -> Result<Value, ControlError> {
        let _ = (name, snapshot, create);
        Err(no_store())
    }
    /// `store_get`: the store's space and every replica in it.
    fn store_get(&self) -> Result<Value, ControlError> {
        Err(no_store())
    }
    /// `snapshot_create`: the new snapshot as `snapshot_list` shows it.
    fn snapshot_create(&self, volume: &str, name: &str) -> Result<Value, ControlError> {
        let _ = (volume, name);
        Err(no_snapshots())
    }
    /// `snapshot_list`: the volume's snapshots, oldest first.
    fn snapshot_list(&self, volume: &str) -> Result<Value, ControlError> {
        let _ = volume;
        Err(no_snapshots())
    }
    /// `snapshot_delete`: starts merging the snapshot into its child.
    fn snapshot_delete(&self, volume: &str, name: &str) -> Result<(), ControlError> {
        let _ = (volume, name);
        Err(no_snapshots())
    }
    /// `volume_revert`: the volume's data back to a snapshot (refused
    /// while clients are connected unless `force`); what was dropped.
    fn volume_revert(
        &self,
        volume: &str,
        snapshot: &str,
        force: bool,
    ) -> Result<Value, ControlError> {
        let _ = (volume, snapshot, force);
        Err(no_snapshots())
    }
    /// `volume_clone`: a new volume `name` over `VOLUME@SNAPSHOT`.
    fn volume_clone(
        &self,
        snapshot: &str,
        name: &str,
        backend: Option<&str>,
    ) -> Result<VolumeInfo, ControlError> {
        let _ = (snapshot, name, backend);
        Err(no_snapshots())
    }
    /// `volume_set_qos`: the volume's rate limits (0: unlimited), in force
    /// for its next request; the volume's QoS as `volume_get_stats` shows it.
    fn volume_set_qos(
        &self,
        name: &str,
        limits: lull_volume::QosLimits,
    ) -> Result<Value, ControlError> {
        let _ = (name, limits);
        Err(ControlError::Refused("this server has no QoS".into()))
    }
    /// `volume_set_rebuild_limit`: the rebuild bandwidth limit of one
    /// replicated volume, or (no name) of every replicated volume now and
    /// created later; the volumes it applies to.
    fn volume_set_rebuild_limit(
        &self,
        name: Option<&str>,
        mbytes_per_sec: u64,
    ) -> Result<Value, ControlError> {
        let _ = (name, mbytes_per_sec);
        Err(ControlError::Refused(
            "this server has no rebuild limit".into(),
        ))
    }
    /// `node_set_rebuild_limit`: the total of every rebuild and reconcile
    /// copy of this node's volumes (0: none), besides each volume's own.
    fn node_set_rebuild_limit(&self, mbytes_per_sec: u64) -> Result<Value, ControlError> {
        let _ = mbytes_per_sec;
        Err(ControlError::Refused(
            "this server has no rebuild limit".into(),
        ))
    }
    /// `snapshot_expose`: serves `VOLUME@SNAPSHOT` as a read-only volume
    /// of its own (an NVMe/TCP subsystem with a write-protected
    /// namespace; NBD serves the name anyway) until `snapshot_unexpose`.
    fn snapshot_expose(&self, volume: &str, name: &str) -> Result<VolumeInfo, ControlError> {
        let _ = (volume, name);
        Err(no_snapshots())
    }
    /// `snapshot_unexpose`: stops serving it as a volume of its own.
    fn snapshot_unexpose(&self, volume: &str, name: &str) -> Result<(), ControlError> {
        let _ = (volume, name);
        Err(no_snapshots())
    }
    /// `nvmf_host_psk_add`: a host's NVMe/TCP TLS key for a volume, from
    /// a key file (PSK interchange format) on the server's filesystem; the
    /// volume then takes TLS connections only. Never echoes the key.
    fn nvmf_host_psk_add(
        &self,
        volume: &str,
        hostnqn: &str,
        key_file: &str,
    ) -> Result<Value, ControlError> {
        let _ = (volume, hostnqn, key_file);
        Err(ControlError::Refused(
            "this server serves no NVMe/TCP".into(),
        ))
    }
    /// `nvmf_host_psk_remove`: forgets a host's key for a volume.
    fn nvmf_host_psk_remove(&self, volume: &str, hostnqn: &str) -> Result<Value, ControlError> {
        let _ = (volume, hostnqn);
        Err(ControlError::Refused(
            "this server serves no NVMe/TCP".into(),
        ))
    }
    /// `volume_flatten`: copies a clone's base into it so it stands alone.
    fn volume_flatten(&self, volume: &str) -> Result<(), ControlError> {
        let _ = volume;
        Err(no_snapshots())
    }
}

fn no_snapshots() -> ControlError {
    ControlError::Refused("this server does not take snapshots".into())
}

/// The refusal of a store method on a daemon without a store.
fn no_store() -> ControlError {
    ControlError::Refused(
        "this daemon has no replica store: start lull serve with --store DIR".into(),
    )
}

/// Longest replica name in a store (the replica protocol's
/// `MAX_REPLICA_NAME_BYTES`; the store checks the characters).
pub const MAX_REPLICA_NAME_LEN: usize = 253;

/// Longest directory `replica_import` takes (PATH_MAX).
pub const MAX_IMPORT_DIR_LEN: usize = 4096;

/// Why a control-plane request failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The parameters do not fit the method (the edge checks here).
    #[error("{0}")]
    InvalidParams(String),
    /// The volume registry refused: no such volume, a name taken, a bad
    /// name.
    #[error(transparent)]
    Volume(#[from] lull_volume::VolumeError),
    /// A replica method on a volume that has no replicas.
    #[error("volume {0:?} is not replicated")]
    NotReplicated(String),
    #[error("replica {addr} is already in {volume}")]
    DuplicateReplica { volume: String, addr: String },
    #[error("no replica {addr} in {volume}")]
    NoSuchReplica { volume: String, addr: String },
    /// Well-formed parameters this server does not accept: a mode it does
    /// not know, a backend it does not have, an address that is not one
    /// HOST:PORT. The message is for the operator.
    #[error("{0}")]
    Refused(String),
    /// The server could not carry out a valid request (reactors, engine,
    /// device).
    #[error(transparent)]
    Failed(Box<dyn std::error::Error + Send + Sync>),
}

impl ControlError {
    /// The JSON-RPC error code: the one place that decides it.
    pub fn code(&self) -> i64 {
        match self {
            ControlError::InvalidParams(_) => INVALID_PARAMS,
            // A well-formed request the server refused or could not carry
            // out. Not-found and conflicts answer -32603 as well: clients
            // (and the tests) have seen that code since these methods
            // exist, and a code of their own in -32000..-32099 would change
            // the wire.
            ControlError::Volume(_)
            | ControlError::NotReplicated(_)
            | ControlError::DuplicateReplica { .. }
            | ControlError::NoSuchReplica { .. }
            | ControlError::Refused(_)
            | ControlError::Failed(_) => INTERNAL_ERROR,
        }
    }
}

impl From<ControlError> for RpcMethodError {
    fn from(e: ControlError) -> RpcMethodError {
        if let ControlError::Failed(source) = &e {
            // The reply carries the message only; keep the whole error here.
            tracing::warn!(error = ?source, "control request failed");
        }
        match (e.code(), e) {
            (_, ControlError::InvalidParams(m)) => RpcMethodError::InvalidParams(m),
            (INTERNAL_ERROR, e) => RpcMethodError::Internal(e.to_string()),
            (code, e) => RpcMethodError::Custom {
                code,
                message: e.to_string(),
            },
        }
    }
}

/// `engine_get_options` and `engine_set_options` results.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Options {
    pub mode: String,
    pub nvme_ioq_poll_period_us: u64,
    pub nvme_adminq_poll_period_us: u64,
    /// Longhorn's `InterruptModeEnabled`: every reactor is in interrupt mode.
    pub interrupt_mode_enabled: bool,
}

/// `engine_set_options` parameters, checked and with Longhorn's aliases
/// mapped onto lull's names; at least one is set. The mode is a word, not
/// yet known to be a mode; the periods are 1..=[`MAX_POLL_PERIOD_US`].
#[derive(Serialize, Debug, Clone, Default, PartialEq, Eq)]
pub struct OptionsChange {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme_ioq_poll_period_us: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme_adminq_poll_period_us: Option<u64>,
}

/// `volume_create` parameters, checked: the size parsed, the backend
/// defaulted to `malloc`, the NVMe/TCP options within their limits (the
/// NQNs' syntax is the server's to check).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NewVolume {
    pub name: String,
    pub size_bytes: u64,
    pub backend: String,
    /// The NVMe/TCP subsystem NQN; `None`: the default one.
    pub nvmf_nqn: Option<String>,
    /// The NVMe/TCP LBA size, one of [`NVMF_LBA_SIZES`]; `None`: 512.
    pub nvmf_lba: Option<u32>,
    /// Host NQNs allowed over NVMe/TCP; empty: any host.
    pub nvmf_allow_hosts: Vec<String>,
    /// Recorded in the node's state (`--store`) and recreated at its
    /// restart (the default). `false`: a volume a cluster manager owns
    /// (the CSI plugin's engines), which it creates again where it wants
    /// it; a daemon coming back must not recreate an engine that another
    /// node has taken over since.
    pub persist: bool,
    /// A replicated volume whose engine, at a restart of the daemon,
    /// resumes the session it ran with (recorded with the volume) instead
    /// of taking its replicas over: a volume another engine took over
    /// meanwhile (it failed over to another node) is not taken back, and
    /// its record is dropped. What the CSI plugin's engines are created
    /// with. Needs `persist`.
    pub resume: bool,
}

impl NewVolume {
    /// Whether any NVMe/TCP option was given.
    pub fn has_nvmf_options(&self) -> bool {
        self.nvmf_nqn.is_some() || self.nvmf_lba.is_some() || !self.nvmf_allow_hosts.is_empty()
    }
}

/// `volume_resize` parameters, checked: the size parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeResize {
    pub name: String,
    pub size_bytes: u64,
}

/// A volume as `volume_list` and `volume_create` show it.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub name: String,
    pub size_bytes: u64,
    pub backend: String,
}

impl VolumeInfo {
    pub fn of(v: &lull_volume::Volume) -> VolumeInfo {
        VolumeInfo {
            name: v.name.clone(),
            size_bytes: v.dev().size_bytes(),
            backend: v.dev().describe(),
        }
    }
}

/// What the lull methods act on.
#[derive(Clone)]
pub struct LullContext {
    pub fw: lull_reactor::FrameworkHandle,
    pub volumes: Arc<lull_volume::Volumes>,
    pub control: Arc<dyn ControlPlane>,
}

impl std::fmt::Debug for LullContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LullContext")
            .field("fw", &self.fw)
            .field("volumes", &self.volumes)
            .finish()
    }
}

/// The methods `register_lull_methods` adds.
pub const LULL_METHODS: &[&str] = &[
    "framework_set_scheduler",
    "framework_get_scheduler",
    "framework_get_reactors",
    "thread_get_stats",
    "engine_get_options",
    "engine_set_options",
    "volume_list",
    "volume_create",
    "volume_delete",
    "volume_resize",
    "volume_get_stats",
    "replica_list",
    "replica_add",
    "replica_remove",
    "replica_create",
    "replica_delete",
    "replica_get",
    "replica_resize",
    "replica_import",
    "replica_clone",
    "replica_snapshot",
    "store_get",
    "snapshot_create",
    "snapshot_list",
    "snapshot_delete",
    "volume_revert",
    "volume_clone",
    "volume_flatten",
    "volume_set_qos",
    "volume_set_rebuild_limit",
    "node_set_rebuild_limit",
    "snapshot_expose",
    "snapshot_unexpose",
    "nvmf_host_psk_add",
    "nvmf_host_psk_remove",
];

/// Register one method: its parameters decode into `P` (bad → -32602),
/// its errors become JSON-RPC errors through [`ControlError::code`].
fn method<P, F>(registry: &mut MethodRegistry, name: &str, f: F) -> Result<(), RpcError>
where
    P: DeserializeOwned,
    F: Fn(P) -> Result<Value, ControlError> + Send + Sync + 'static,
{
    registry.register(name, Box::new(move |p| Ok(f(parse_params(p)?)?)))
}

/// Register every lull method (see [`LULL_METHODS`]).
pub fn register_lull_methods(
    registry: &mut MethodRegistry,
    ctx: LullContext,
) -> Result<(), RpcError> {
    crate::register_scheduler_methods(registry, ctx.fw.clone())?;
    let c = ctx.clone();
    method(registry, "framework_get_reactors", move |NoParams {}| {
        Ok(framework_get_reactors(&c.fw))
    })?;
    let c = ctx.clone();
    method(registry, "thread_get_stats", move |NoParams {}| {
        Ok(thread_get_stats(&c.fw))
    })?;
    let c = ctx.clone();
    method(registry, "engine_get_options", move |NoParams {}| {
        Ok(json!(c.control.get_options()))
    })?;
    let c = ctx.clone();
    method(registry, "engine_set_options", move |p: SetOptions| {
        let change = normalize_options(p)?;
        Ok(json!(c.control.set_options(&change)?))
    })?;
    let c = ctx.clone();
    method(registry, "volume_list", move |NoParams {}| {
        let list: Vec<VolumeInfo> = c.volumes.list().iter().map(|v| VolumeInfo::of(v)).collect();
        Ok(json!(list))
    })?;
    let c = ctx.clone();
    method(registry, "volume_create", move |p: VolumeCreate| {
        let volume = p.check()?;
        Ok(json!(c.control.volume_create(&volume)?))
    })?;
    let c = ctx.clone();
    method(registry, "volume_delete", move |p: VolumeName| {
        p.check()?;
        c.control.volume_delete(&p)?;
        Ok(Value::Bool(true))
    })?;
    let c = ctx.clone();
    method(registry, "volume_resize", move |p: ResizeParams| {
        let resize = p.check()?;
        Ok(json!(c.control.volume_resize(&resize)?))
    })?;
    let c = ctx.clone();
    method(registry, "volume_get_stats", move |p: VolumeName| {
        p.check()?;
        c.control.volume_stats(&p)
    })?;
    let c = ctx.clone();
    method(registry, "replica_list", move |p: ReplicaVolume| {
        check_name("volume", &p.volume, MAX_VOLUME_NAME_LEN)?;
        c.control.replica_list(&p)
    })?;
    let c = ctx.clone();
    method(registry, "replica_add", move |p: ReplicaAddr| {
        p.check()?;
        c.control.replica_add(&p)?;
        Ok(Value::Bool(true))
    })?;
    let c = ctx.clone();
    method(registry, "replica_remove", move |p: ReplicaAddr| {
        p.check()?;
        c.control.replica_remove(&p)?;
        Ok(Value::Bool(true))
    })?;
    let c = ctx.clone();
    method(registry, "replica_create", move |p: ReplicaCreate| {
        check_name("name", &p.name, MAX_REPLICA_NAME_LEN)?;
        let size_bytes = parse_size(&p.size).map_err(ControlError::InvalidParams)?;
        c.control.replica_create(&p.name, size_bytes)
    })?;
    let c = ctx.clone();
    method(registry, "replica_delete", move |p: ReplicaName| {
        check_name("name", &p.name, MAX_REPLICA_NAME_LEN)?;
        c.control.replica_delete(&p.name)?;
        Ok(Value::Bool(true))
    })?;
    let c = ctx.clone();
    method(registry, "replica_get", move |p: ReplicaName| {
        check_name("name", &p.name, MAX_REPLICA_NAME_LEN)?;
        c.control.replica_get(&p.name)
    })?;
    let c = ctx.clone();
    method(registry, "replica_resize", move |p: ReplicaCreate| {
        check_name("name", &p.name, MAX_REPLICA_NAME_LEN)?;
        let size_bytes = parse_size(&p.size).map_err(ControlError::InvalidParams)?;
        c.control.replica_resize(&p.name, size_bytes)
    })?;
    let c = ctx.clone();
    method(registry, "replica_clone", move |p: ReplicaClone| {
        check_name("name", &p.name, MAX_REPLICA_NAME_LEN)?;
        let Some((origin, snapshot)) = p.snapshot.rsplit_once('@') else {
            return Err(ControlError::InvalidParams(format!(
                "snapshot must be REPLICA@SNAPSHOT, not {:?}",
                p.snapshot
            )));
        };
        check_name("snapshot", origin, MAX_REPLICA_NAME_LEN)?;
        c.control.replica_clone(&p.name, origin, snapshot)
    })?;
    let c = ctx.clone();
    method(
        registry,
        "replica_snapshot",
        move |p: ReplicaSnapshotParams| {
            check_name("name", &p.name, MAX_REPLICA_NAME_LEN)?;
            let create = match p.op.as_str() {
                "create" => true,
                "delete" => false,
                other => {
                    return Err(ControlError::InvalidParams(format!(
                        "op must be \"create\" or \"delete\", not {other:?}"
                    )))
                }
            };
            c.control.replica_snapshot(&p.name, &p.snapshot, create)
        },
    )?;
    let c = ctx.clone();
    method(registry, "replica_import", move |p: ReplicaImport| {
        check_name("name", &p.name, MAX_REPLICA_NAME_LEN)?;
        check_name("dir", &p.dir, MAX_IMPORT_DIR_LEN)?;
        c.control.replica_import(&p.name, &p.dir)
    })?;
    let c = ctx.clone();
    method(registry, "store_get", move |NoParams {}| {
        c.control.store_get()
    })?;
    let c = ctx.clone();
    method(registry, "snapshot_create", move |p: SnapshotName| {
        p.check()?;
        c.control.snapshot_create(&p.volume, &p.name)
    })?;
    let c = ctx.clone();
    method(registry, "snapshot_list", move |p: ReplicaVolume| {
        check_name("volume", &p.volume, MAX_VOLUME_NAME_LEN)?;
        c.control.snapshot_list(&p.volume)
    })?;
    let c = ctx.clone();
    method(registry, "snapshot_delete", move |p: SnapshotName| {
        p.check()?;
        c.control.snapshot_delete(&p.volume, &p.name)?;
        Ok(Value::Bool(true))
    })?;
    let c = ctx.clone();
    method(registry, "snapshot_expose", move |p: SnapshotName| {
        p.check()?;
        Ok(json!(c.control.snapshot_expose(&p.volume, &p.name)?))
    })?;
    let c = ctx.clone();
    method(registry, "snapshot_unexpose", move |p: SnapshotName| {
        p.check()?;
        c.control.snapshot_unexpose(&p.volume, &p.name)?;
        Ok(Value::Bool(true))
    })?;
    let c = ctx.clone();
    method(registry, "nvmf_host_psk_add", move |p: HostPsk| {
        check_name("volume", &p.volume, MAX_VOLUME_NAME_LEN)?;
        check_name("hostnqn", &p.hostnqn, MAX_NQN_LEN)?;
        let key_file = p
            .key_file
            .ok_or_else(|| ControlError::InvalidParams("key_file is required".into()))?;
        check_name("key_file", &key_file, MAX_IMPORT_DIR_LEN)?;
        c.control
            .nvmf_host_psk_add(&p.volume, &p.hostnqn, &key_file)
    })?;
    let c = ctx.clone();
    method(registry, "nvmf_host_psk_remove", move |p: HostPsk| {
        check_name("volume", &p.volume, MAX_VOLUME_NAME_LEN)?;
        check_name("hostnqn", &p.hostnqn, MAX_NQN_LEN)?;
        if p.key_file.is_some() {
            return Err(ControlError::InvalidParams(
                "nvmf_host_psk_remove takes volume and hostnqn only".into(),
            ));
        }
        c.control.nvmf_host_psk_remove(&p.volume, &p.hostnqn)
    })?;
    let c = ctx.clone();
    method(registry, "volume_revert", move |p: VolumeRevert| {
        check_name("volume", &p.volume, MAX_VOLUME_NAME_LEN)?;
        check_name("snapshot", &p.snapshot, MAX_SNAPSHOT_NAME_LEN)?;
        c.control.volume_revert(&p.volume, &p.snapshot, p.force)
    })?;
    let c = ctx.clone();
    method(registry, "volume_clone", move |p: VolumeClone| {
        check_name(
            "snapshot",
            &p.snapshot,
            MAX_VOLUME_NAME_LEN + 1 + MAX_SNAPSHOT_NAME_LEN,
        )?;
        check_name("name", &p.name, MAX_VOLUME_NAME_LEN)?;
        if let Some(b) = &p.backend {
            check_name("backend", b, MAX_BACKEND_LEN)?;
        }
        Ok(json!(c.control.volume_clone(
            &p.snapshot,
            &p.name,
            p.backend.as_deref()
        )?))
    })?;
    let c = ctx.clone();
    method(registry, "volume_set_qos", move |p: SetQos| {
        check_name("name", &p.name, MAX_VOLUME_NAME_LEN)?;
        let limits = lull_volume::QosLimits {
            rw_ios_per_sec: p.rw_ios_per_sec,
            rw_mbytes_per_sec: p.rw_mbytes_per_sec,
            r_mbytes_per_sec: p.r_mbytes_per_sec,
            w_mbytes_per_sec: p.w_mbytes_per_sec,
        };
        limits.check().map_err(ControlError::InvalidParams)?;
        c.control.volume_set_qos(&p.name, limits)
    })?;
    let c = ctx.clone();
    method(
        registry,
        "volume_set_rebuild_limit",
        move |p: SetRebuildLimit| {
            if let Some(n) = &p.name {
                check_name("name", n, MAX_VOLUME_NAME_LEN)?;
            }
            if p.mbytes_per_sec > MAX_REBUILD_MBYTES_PER_SEC {
                return Err(ControlError::InvalidParams(format!(
                    "mbytes_per_sec: at most {MAX_REBUILD_MBYTES_PER_SEC}"
                )));
            }
            c.control
                .volume_set_rebuild_limit(p.name.as_deref(), p.mbytes_per_sec)
        },
    )?;
    let c = ctx.clone();
    method(
        registry,
        "node_set_rebuild_limit",
        move |p: NodeRebuildLimit| {
            if p.mbytes_per_sec > MAX_REBUILD_MBYTES_PER_SEC {
                return Err(ControlError::InvalidParams(format!(
                    "mbytes_per_sec: at most {MAX_REBUILD_MBYTES_PER_SEC}"
                )));
            }
            c.control.node_set_rebuild_limit(p.mbytes_per_sec)
        },
    )?;
    let c = ctx;
    method(registry, "volume_flatten", move |p: VolumeName| {
        p.check()?;
        c.control.volume_flatten(&p.name)?;
        Ok(Value::Bool(true))
    })?;
    Ok(())
}

/// SPDK's `framework_get_reactors` shape (`lcore`, `busy`, `idle`,
/// `in_interrupt`, `lw_threads`), plus lull's own counters.
pub fn framework_get_reactors(fw: &lull_reactor::FrameworkHandle) -> Value {
    let threads = fw.thread_stats();
    let reactors: Vec<Value> = fw
        .reactor_stats()
        .iter()
        .map(|r| {
            let lw_threads: Vec<Value> = threads
                .iter()
                .filter(|t| t.reactor == r.index)
                .map(|t| json!({"name": t.name, "id": t.id, "elapsed": t.busy_ns + t.idle_ns}))
                .collect();
            json!({
                "index": r.index,
                "lcore": r.core,
                "core": r.core,
                "tid": r.tid,
                "mode": r.mode.as_str(),
                "in_interrupt": r.interrupt_mode_enabled(),
                "interrupt_mode_enabled": r.interrupt_mode_enabled(),
                "busy": r.busy_ns,
                "idle": r.idle_ns,
                "iterations": r.iterations,
                "wakeups": r.wakeups,
                "ioq_poll_period_us": r.ioq_poll_period_us,
                "spins_with_work": r.spins_with_work,
                "spins_idle": r.spins_idle,
                "spin_ns": r.spin_ns,
                "spin_ns_with_work": r.spin_ns_with_work,
                "spin_ns_idle": r.spin_ns_idle,
                "spin_window_ns": r.spin_window_ns,
                "wake_latency_ns": r.wake_latency_ns,
                "wake_cpu_ns": r.wake_cpu_ns,
                // The adaptive decision (null outside adaptive mode): the
                // regime, the gaps and band it rests on, the last switch.
                "adaptive": adaptive_json(r, fw.clock().now_ns()),
                "ready_events": r.ready_events,
                "usr": r.user_ns,
                "sys": r.system_ns,
                "voluntary_ctxsw": r.voluntary_ctxsw,
                "involuntary_ctxsw": r.involuntary_ctxsw,
                "minor_faults": r.minor_faults,
                "major_faults": r.major_faults,
                "io_uring_enters": r.io_uring_enters,
                // The reactor's fixed I/O buffer arena (0 bytes: none).
                "fixed_buffer_bytes": r.fixed_buffers.bytes,
                "fixed_buffer_in_use_bytes": r.fixed_buffers.in_use_bytes,
                "fixed_buffer_locked": r.fixed_buffers.locked,
                "sleeping": r.sleeping,
                "threads_moved_in": r.threads_moved_in,
                "threads_moved_out": r.threads_moved_out,
                // The watchdog: how long the reactor has not answered its
                // heartbeat while that is past the threshold (0: fine), and
                // the stalls reported since start.
                "stalled_ms": r.stalled_ms,
                "stalls": r.stalls,
                "lw_threads": lw_threads,
            })
        })
        .collect();
    json!({"tick_rate": TICK_RATE_HZ, "pid": std::process::id(), "reactors": reactors})
}

/// A reactor's adaptive decision (lull-reactor's `adaptive` module):
/// `regime` "spin" or "sleep", `probing` (the regime a probe tries now),
/// `spin_cost_pct` and `sleep_cost_pct` (what each regime's idle periods
/// cost per unit of work, in percent of the busy time: CPU spun, each
/// sleep's CPU and latency), `gap_ns` (the median idle period while
/// spinning), `saved_ns` (a wake-up's latency and CPU), `spin_below_ns`
/// and `sleep_above_ns` (the band for gaps of one length), and the last
/// switch with its reason and the costs it was decided on. Null outside
/// adaptive mode.
fn adaptive_json(r: &lull_reactor::ReactorStats, now_ns: u64) -> Value {
    if r.adaptive_regime().is_none() {
        return Value::Null;
    }
    let a = &r.adaptive;
    let last = a.last_switch.map(|s| {
        json!({
            "reason": s.reason.as_str(),
            "to": s.reason.to().as_str(),
            "spin_cost_pct": s.spin_cost_pct,
            "sleep_cost_pct": s.sleep_cost_pct,
            "gap_ns": s.gap_ns,
            "ago_ms": now_ns.saturating_sub(s.at_ns) / 1_000_000,
        })
    });
    json!({
        "regime": a.regime.as_str(),
        "probing": a.probing.map(|p| p.as_str()),
        "confirming": a.confirming,
        "spin_cost_pct": a.spin_cost_pct,
        "sleep_cost_pct": a.sleep_cost_pct,
        "gap_ns": a.gap_ns,
        "saved_ns": a.wake.saved_ns(),
        "spin_below_ns": a.spin_below_ns,
        "sleep_above_ns": a.sleep_above_ns,
        "window_ns": a.window_ns,
        "switches": a.switches,
        "probes": a.probes,
        "last_switch": last,
    })
}

/// SPDK's `thread_get_stats` shape, plus the reactor and lull's counters.
pub fn thread_get_stats(fw: &lull_reactor::FrameworkHandle) -> Value {
    let threads: Vec<Value> = fw
        .thread_stats()
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "id": t.id,
                "reactor": t.reactor,
                "busy": t.busy_ns,
                "idle": t.idle_ns,
                "iterations": t.iterations,
                "wakeups": t.wakeups,
                "messages": t.messages,
                "active_pollers_count": t.pollers_active,
                "timed_pollers_count": t.pollers_timed,
                "paused_pollers_count": t.pollers_paused,
                // Event sources: a poll group's connections.
                "sources": t.pollers_active,
                "ready_events": t.ready_events,
                "pinned": t.pinned,
            })
        })
        .collect();
    json!({"tick_rate": TICK_RATE_HZ, "threads": threads})
}

/// The parameters of a method that takes none (absent, `null` or `{}`).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// `volume_create` parameters as they come.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct VolumeCreate {
    name: String,
    /// Bytes, or a string with a binary suffix ("1G").
    size: Value,
    backend: Option<String>,
    nvmf_nqn: Option<String>,
    nvmf_lba: Option<u32>,
    #[serde(default)]
    nvmf_allow_hosts: Vec<String>,
    persist: Option<bool>,
    resume: Option<bool>,
}

impl VolumeCreate {
    fn check(self) -> Result<NewVolume, ControlError> {
        check_name("name", &self.name, MAX_VOLUME_NAME_LEN)?;
        let backend = self.backend.unwrap_or_else(|| "malloc".into());
        check_name("backend", &backend, MAX_BACKEND_LEN)?;
        let size_bytes = parse_size(&self.size).map_err(ControlError::InvalidParams)?;
        if let Some(nqn) = &self.nvmf_nqn {
            check_name("nvmf_nqn", nqn, MAX_NQN_LEN)?;
        }
        if let Some(lba) = self.nvmf_lba {
            if !NVMF_LBA_SIZES.contains(&lba) {
                return Err(ControlError::InvalidParams(format!(
                    "nvmf_lba must be 512 or 4096, got {lba}"
                )));
            }
        }
        if self.nvmf_allow_hosts.len() > MAX_NVMF_ALLOWED_HOSTS {
            return Err(ControlError::InvalidParams(format!(
                "nvmf_allow_hosts: at most {MAX_NVMF_ALLOWED_HOSTS} hosts"
            )));
        }
        for h in &self.nvmf_allow_hosts {
            check_name("nvmf_allow_hosts entry", h, MAX_NQN_LEN)?;
        }
        let persist = self.persist.unwrap_or(true);
        let resume = self.resume.unwrap_or(false);
        if resume && !persist {
            return Err(ControlError::InvalidParams(
                "resume needs persist: a volume not recorded is not re-created at a restart".into(),
            ));
        }
        Ok(NewVolume {
            name: self.name,
            size_bytes,
            backend,
            nvmf_nqn: self.nvmf_nqn,
            nvmf_lba: self.nvmf_lba,
            nvmf_allow_hosts: self.nvmf_allow_hosts,
            persist,
            resume,
        })
    }
}

/// `volume_resize` parameters as they come.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ResizeParams {
    name: String,
    /// The new size: bytes, or a string with a binary suffix ("2G").
    size: Value,
}

impl ResizeParams {
    fn check(self) -> Result<VolumeResize, ControlError> {
        check_name("name", &self.name, MAX_VOLUME_NAME_LEN)?;
        let size_bytes = parse_size(&self.size).map_err(ControlError::InvalidParams)?;
        Ok(VolumeResize {
            name: self.name,
            size_bytes,
        })
    }
}

/// `volume_delete` and `volume_get_stats` parameters.
#[derive(Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct VolumeName {
    pub name: String,
}

impl VolumeName {
    fn check(&self) -> Result<(), ControlError> {
        check_name("name", &self.name, MAX_VOLUME_NAME_LEN)
    }
}

/// Longest snapshot name the RPC passes on (the server checks the rest:
/// `lull_bdev::chain::check_snapshot_name`).
pub const MAX_SNAPSHOT_NAME_LEN: usize = lull_bdev::chain::MAX_SNAPSHOT_NAME_LEN;

/// `snapshot_create` and `snapshot_delete` parameters.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct SnapshotName {
    volume: String,
    name: String,
}

impl SnapshotName {
    fn check(&self) -> Result<(), ControlError> {
        check_name("volume", &self.volume, MAX_VOLUME_NAME_LEN)?;
        check_name("name", &self.name, MAX_SNAPSHOT_NAME_LEN)
    }
}

/// `volume_revert` parameters.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct VolumeRevert {
    volume: String,
    snapshot: String,
    /// Revert although clients are connected (they see the data change
    /// under them, as after a disk swap).
    #[serde(default)]
    force: bool,
}

/// `volume_set_qos` parameters: SPDK's `bdev_set_qos_limit` names,
/// each 0 (unlimited) when left out.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct SetQos {
    name: String,
    #[serde(default)]
    rw_ios_per_sec: u64,
    #[serde(default)]
    rw_mbytes_per_sec: u64,
    #[serde(default)]
    r_mbytes_per_sec: u64,
    #[serde(default)]
    w_mbytes_per_sec: u64,
}

/// Largest rebuild bandwidth limit taken, MB/s: far above any link
/// (100 GB/s); a larger value is a mistake.
pub const MAX_REBUILD_MBYTES_PER_SEC: u64 = 100_000;

/// `volume_set_rebuild_limit` parameters (Longhorn's
/// `replica-rebuilding-bandwidth-limit`, in MB = 10^6 bytes per second;
/// 0: no limit).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct SetRebuildLimit {
    #[serde(default)]
    name: Option<String>,
    mbytes_per_sec: u64,
}

/// `node_set_rebuild_limit` parameters (MB = 10^6 bytes per second, the
/// total over the node's copies; 0: no limit).
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct NodeRebuildLimit {
    mbytes_per_sec: u64,
}

/// `nvmf_host_psk_add` and `nvmf_host_psk_remove` parameters.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct HostPsk {
    volume: String,
    hostnqn: String,
    /// A file in the PSK interchange format (`NVMeTLSkey-1:01:...:`);
    /// the key itself never travels over the RPC.
    #[serde(default)]
    key_file: Option<String>,
}

/// `volume_clone` parameters.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct VolumeClone {
    /// `VOLUME@SNAPSHOT`.
    snapshot: String,
    name: String,
    /// Where the clone's own writes go: `malloc`, or `file=PATH`. Default:
    /// the origin's kind (a file next to the origin's file).
    #[serde(default)]
    backend: Option<String>,
}

/// `replica_create` and `replica_resize` parameters.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ReplicaCreate {
    name: String,
    /// Bytes, or a string with a binary suffix ("10G").
    size: Value,
}

/// `replica_delete` and `replica_get` parameters.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ReplicaName {
    name: String,
}

/// `replica_clone` parameters.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ReplicaClone {
    /// The new replica.
    name: String,
    /// `REPLICA@SNAPSHOT`: a snapshot of a replica of this store.
    snapshot: String,
}

/// `replica_snapshot` parameters.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ReplicaSnapshotParams {
    /// A replica of the store.
    name: String,
    /// The snapshot's name (the chain checks it).
    snapshot: String,
    /// `create` or `delete`.
    op: String,
}

/// `replica_import` parameters.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct ReplicaImport {
    name: String,
    /// The `lull replica --dir` directory, on the store's filesystem.
    dir: String,
}

/// `replica_list` parameters.
#[derive(Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ReplicaVolume {
    pub volume: String,
}

/// `replica_add` and `replica_remove` parameters.
#[derive(Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ReplicaAddr {
    pub volume: String,
    /// HOST:PORT, as the operator wrote it (the server resolves it).
    pub addr: String,
}

impl ReplicaAddr {
    fn check(&self) -> Result<(), ControlError> {
        check_name("volume", &self.volume, MAX_VOLUME_NAME_LEN)?;
        check_name("addr", &self.addr, MAX_REPLICA_ADDR_LEN)
    }
}

fn check_name(field: &str, value: &str, max: usize) -> Result<(), ControlError> {
    if value.is_empty() || value.len() > max || value.contains('\0') {
        return Err(ControlError::InvalidParams(format!(
            "{field} must be 1 to {max} bytes, without NUL"
        )));
    }
    Ok(())
}

/// `engine_set_options` parameters as they come: lull's names and
/// Longhorn's aliases.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct SetOptions {
    mode: Option<String>,
    /// Longhorn's `data-engine-interrupt-mode-enabled`: true = interrupt,
    /// false = poll.
    #[serde(
        rename = "data-engine-interrupt-mode-enabled",
        alias = "interrupt_mode_enabled"
    )]
    interrupt_mode_enabled: Option<bool>,
    /// Longhorn's `data-engine-nvme-ioq-poll-period-us`.
    #[serde(rename = "data-engine-nvme-ioq-poll-period-us")]
    longhorn_ioq_poll_period_us: Option<u64>,
    nvme_ioq_poll_period_us: Option<u64>,
    nvme_adminq_poll_period_us: Option<u64>,
}

/// Check `engine_set_options` parameters and map them onto lull's names.
fn normalize_options(o: SetOptions) -> Result<OptionsChange, ControlError> {
    let bad = |m: String| Err(ControlError::InvalidParams(m));
    let mut out = OptionsChange::default();
    let implied = o
        .interrupt_mode_enabled
        .map(|on| if on { "interrupt" } else { "poll" });
    match (o.mode, implied) {
        (Some(m), Some(i)) if m != i => {
            return bad(format!(
                "mode {m:?} contradicts data-engine-interrupt-mode-enabled={}; give one of them",
                i == "interrupt"
            ))
        }
        (Some(m), _) => {
            let ok = !m.is_empty()
                && m.len() <= MAX_MODE_NAME_LEN
                && m.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                });
            if !ok {
                return bad(format!(
                    "mode must be a mode name such as \"poll\" or \"interrupt\", got {m:?}"
                ));
            }
            out.mode = Some(m);
        }
        (None, Some(i)) => out.mode = Some(i.into()),
        (None, None) => {}
    }
    let ioq = match (o.nvme_ioq_poll_period_us, o.longhorn_ioq_poll_period_us) {
        (Some(a), Some(b)) if a != b => {
            return bad(format!(
                "nvme_ioq_poll_period_us={a} contradicts data-engine-nvme-ioq-poll-period-us={b}; give one of them"
            ))
        }
        (a, b) => a.or(b),
    };
    for (name, v, field) in [
        (
            "nvme_ioq_poll_period_us",
            ioq,
            &mut out.nvme_ioq_poll_period_us,
        ),
        (
            "nvme_adminq_poll_period_us",
            o.nvme_adminq_poll_period_us,
            &mut out.nvme_adminq_poll_period_us,
        ),
    ] {
        if let Some(us) = v {
            if !(1..=MAX_POLL_PERIOD_US).contains(&us) {
                return bad(format!(
                    "{name} must be 1 to {MAX_POLL_PERIOD_US}, got {us}"
                ));
            }
            *field = Some(us);
        }
    }
    if out == OptionsChange::default() {
        return bad(
            "no options given (mode, nvme_ioq_poll_period_us, nvme_adminq_poll_period_us, \
                    data-engine-interrupt-mode-enabled, data-engine-nvme-ioq-poll-period-us)"
                .into(),
        );
    }
    Ok(out)
}

/// A size in bytes: a positive integer, or a string of digits with an
/// optional binary suffix K, M, G or T (also KiB, KB, ... ; any case), as
/// `lull_bdev::parse_size_bytes` accepts.
pub fn parse_size(v: &Value) -> Result<u64, String> {
    let bytes = match v {
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| format!("size must be a positive integer, got {n}"))?,
        Value::String(s) => lull_bdev::parse_size_bytes(s)?,
        other => {
            return Err(format!(
                "size must be a number of bytes or a string such as \"1G\", got {other}"
            ))
        }
    };
    if bytes == 0 {
        return Err("size must be greater than 0".into());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size(&json!(4096)), Ok(4096));
        assert_eq!(parse_size(&json!("1G")), Ok(1 << 30));
        assert_eq!(parse_size(&json!("64MiB")), Ok(64 << 20));
        assert_eq!(parse_size(&json!("512")), Ok(512));
        assert_eq!(parse_size(&json!(" 2k ")), Ok(2048));
        for bad in [
            json!(0),
            json!(-1),
            json!(1.5),
            json!("0G"),
            json!("G"),
            json!("1X"),
            json!("99999999P"),
            json!(null),
            json!([1]),
        ] {
            assert!(parse_size(&bad).is_err(), "{bad}");
        }
    }

    /// The normalized options as JSON, errors as the client sees them.
    fn norm(v: Value) -> Result<Value, RpcMethodError> {
        normalize_options(
            serde_json::from_value(v).map_err(|e| ControlError::InvalidParams(e.to_string()))?,
        )
        .map(|o| json!(o))
        .map_err(RpcMethodError::from)
    }

    #[test]
    fn options() {
        assert_eq!(
            norm(json!({"data-engine-interrupt-mode-enabled": false})),
            Ok(json!({"mode": "poll"}))
        );
        assert_eq!(
            norm(json!({"interrupt_mode_enabled": true})),
            Ok(json!({"mode": "interrupt"}))
        );
        assert_eq!(
            norm(
                json!({"data-engine-nvme-ioq-poll-period-us": 50, "nvme_adminq_poll_period_us": 1000})
            ),
            Ok(json!({"nvme_ioq_poll_period_us": 50, "nvme_adminq_poll_period_us": 1000}))
        );
        assert_eq!(
            norm(json!({"mode": "interrupt", "interrupt_mode_enabled": true})),
            Ok(json!({"mode": "interrupt"}))
        );
        for bad in [
            json!({}),
            json!({"mode": "poll", "data-engine-interrupt-mode-enabled": true}),
            json!({"nvme_ioq_poll_period_us": 0}),
            json!({"nvme_ioq_poll_period_us": 20_000_000}),
            json!({"nvme_ioq_poll_period_us": 10, "data-engine-nvme-ioq-poll-period-us": 20}),
            json!({"mode": "Poll Mode"}),
            json!({"mode": ""}),
        ] {
            assert!(
                matches!(norm(bad.clone()), Err(RpcMethodError::InvalidParams(_))),
                "{bad}"
            );
        }
        assert!(norm(json!({"frobnicate": 1})).is_err());
        assert!(norm(json!({"nvme_ioq_poll_period_us": "100"})).is_err());
    }
}
