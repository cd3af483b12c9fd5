//! The binary's side of the control plane: what the RPC methods and the
//! metrics endpoint do to (and read from) the running server.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lull_proto::replica::SnapshotOp;
use lull_reactor::FrameworkHandle;
use lull_rpc::{
    ControlError, ControlPlane, MetricsSnapshot, MetricsSource, NewVolume, Options, OptionsChange,
    ReplicaAddr, ReplicaVolume, VolumeInfo, VolumeMetrics, VolumeName, VolumeResize,
};
use lull_volume::{
    bucket_le_ns, Cloned, Flattened, Snapshot, SnapshotError, Storage, Volume, Volumes,
    LATENCY_BUCKETS,
};
use serde_json::{json, Value};

use lull_config as config;

/// Default keep-alive poll period of replica connections (Longhorn's
/// `nvme_adminq_poll_period_us` default, 10 ms).
pub const DEFAULT_ADMINQ_POLL_PERIOD_US: u64 = 10_000;

/// How long `volume_create` with `resume` waits for the new engine's
/// first election (every replica answered), whose session it records:
/// within the CSI plugin's 30 s call timeout, with room for the rest of
/// the call. Past it nothing is created and the caller retries.
pub const RESUME_ELECTION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// How often the watch on a resumed engine lets go of it to see whether
/// the volume still exists (a volume deleted before its engine was
/// elected or fenced ends its watch within this).
const RESUME_WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

pub struct Control {
    pub fw: FrameworkHandle,
    pub volumes: Arc<Volumes>,
    pub engine: lull_engine::EngineOptions,
    /// How engines of volumes created over RPC reach their replicas.
    links: crate::storage::ReplicaLinks,
    pub adminq_poll_period_us: AtomicU64,
    /// The NVMe/TCP target's per-volume options, when it runs.
    pub nvmf: Option<lull_nvmf::Subsystems>,
    /// Serializes volume_create and volume_delete (RPC connections run
    /// on threads of their own): a volume's NVMe/TCP options and its
    /// place in the registry change together.
    volume_changes: std::sync::Mutex<()>,
    /// This node's replica store (`--store`).
    store: Option<Arc<lull_replica::Store>>,
    /// Volumes created over RPC, written under the store and restored at
    /// start (with `--store`).
    node: Option<Arc<crate::node::NodeState>>,
    /// `volume_set_rebuild_limit` without a name: the limit (bytes/s) of
    /// replicated volumes created from then on.
    rebuild_limit_default: AtomicU64,
    /// `node_set_rebuild_limit`: the budget every replicated volume's
    /// copies take from (given to each at its creation).
    node_rebuild: lull_engine::NodeRebuildLimit,
    /// Replicated clones made by this process (clone volume to
    /// `VOLUME@SNAPSHOT`), until flattened or deleted: a node records
    /// them in its state too (`VolumeEntry::clone_of`), a daemon without
    /// `--store` only here. They name the clones when a snapshot's delete
    /// or a revert is refused.
    clones: std::sync::Mutex<std::collections::BTreeMap<String, String>>,
}

impl Control {
    pub fn new(
        fw: FrameworkHandle,
        volumes: Arc<Volumes>,
        engine: lull_engine::EngineOptions,
        links: crate::storage::ReplicaLinks,
    ) -> Control {
        Control {
            fw,
            volumes,
            engine,
            links,
            adminq_poll_period_us: AtomicU64::new(DEFAULT_ADMINQ_POLL_PERIOD_US),
            nvmf: None,
            volume_changes: std::sync::Mutex::new(()),
            store: None,
            node: None,
            rebuild_limit_default: AtomicU64::new(0),
            node_rebuild: lull_engine::NodeRebuildLimit::default(),
            clones: Default::default(),
        }
    }

    /// Records (`Some`) or forgets (`None`) what clone `volume` stands on.
    fn note_clone(&self, volume: &str, origin: Option<&str>) {
        let mut c = self.clones.lock().unwrap_or_else(|p| p.into_inner());
        match origin {
            Some(o) => {
                c.insert(volume.to_string(), o.to_string());
            }
            None => {
                c.remove(volume);
            }
        }
    }

    /// The node's rebuild budget, the one the volumes opened at start
    /// were given, and the per-volume limit of volumes created from now
    /// on (bytes/s, 0: none), as restored at start.
    pub fn with_node_rebuild(
        mut self,
        node_rebuild: lull_engine::NodeRebuildLimit,
        volume_default: u64,
    ) -> Control {
        self.node_rebuild = node_rebuild;
        self.rebuild_limit_default = AtomicU64::new(volume_default);
        self
    }

    /// The node's store and the record of its RPC-created volumes.
    pub fn with_store(
        mut self,
        store: Option<Arc<lull_replica::Store>>,
        node: Option<Arc<crate::node::NodeState>>,
    ) -> Control {
        self.store = store;
        self.node = node;
        self
    }

    /// Watches a volume whose engine resumed its recorded session at
    /// start: once it is elected, nothing more; when a replica says
    /// another engine took the volume over meanwhile, the volume is
    /// dropped from the registry and the node state (the engine must not
    /// come back at the next start either), with a log line saying why.
    /// One thread per resumed volume, asleep on the engine's status until
    /// it decides, and gone within `RESUME_WATCH_INTERVAL` of a delete.
    pub fn watch_resumed(self: &Arc<Self>, name: &str) {
        let Some(dev) = self
            .volumes
            .named(name)
            .ok()
            .and_then(|v| v.storage.replicated().cloned())
        else {
            return;
        };
        let control = self.clone();
        let volume = name.to_string();
        // A weak reference between looks: a volume deleted before its
        // engine decided (a replica gone for good) must not be kept alive,
        // reconnecting for ever, by its watch.
        let engine = Arc::downgrade(&dev);
        drop(dev);
        let spawned = std::thread::Builder::new()
            .name(format!("resume-{name}"))
            .spawn(move || loop {
                let Some(dev) = engine.upgrade() else {
                    return;
                };
                match dev.wait_session(Some(RESUME_WATCH_INTERVAL)) {
                    lull_engine::SessionOutcome::Final(s) => {
                        tracing::info!(volume = %volume, session = format!("{s:#x}"), "engine resumed its recorded session: the replicas were not taken over");
                        return;
                    }
                    lull_engine::SessionOutcome::Fenced(s) => {
                        control.drop_fenced(&volume, &dev, s);
                        return;
                    }
                    lull_engine::SessionOutcome::Ended => return,
                    lull_engine::SessionOutcome::TimedOut => {}
                }
            });
        if let Err(e) = spawned {
            tracing::error!(volume = name, error = %e,
                "cannot watch the resumed engine: a failover while this daemon was away would not be noticed here (the replicas still refuse its writes)");
        }
    }

    /// Drops a resumed volume whose engine another engine fenced.
    fn drop_fenced(&self, name: &str, dev: &Arc<lull_engine::ReplicatedDev>, by: u64) {
        let _one = self
            .volume_changes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Only this very engine: the volume may have been deleted and
        // created again meanwhile.
        let same = self
            .volumes
            .named(name)
            .ok()
            .is_some_and(|v| v.storage.replicated().is_some_and(|d| Arc::ptr_eq(d, dev)));
        if !same {
            return;
        }
        if let Err(e) = self.volumes.remove(name) {
            tracing::error!(volume = name, error = %e, "cannot drop the fenced volume");
            return;
        }
        if let Err(e) = self.persist(|m| {
            m.remove(name);
        }) {
            tracing::error!(volume = name, error = %e, "fenced volume dropped, and the node state still lists it (its engine will be fenced again at the next start)");
        }
        tracing::error!(
            volume = name,
            newer_session = format!("{by:#x}"),
            "volume dropped: its replicas were taken over by a newer engine while this daemon was away \
             (the volume failed over to another node); this node's engine stood down and its record is removed"
        );
    }

    /// Waits (at most `RESUME_ELECTION_TIMEOUT`) for a new resumable
    /// engine's first election: its session is final then, and is what
    /// the node records.
    fn final_session(
        &self,
        name: &str,
        dev: &lull_engine::ReplicatedDev,
    ) -> Result<u64, ControlError> {
        use lull_engine::SessionOutcome;
        match dev.wait_session(Some(RESUME_ELECTION_TIMEOUT)) {
            SessionOutcome::Final(s) => Ok(s),
            SessionOutcome::Fenced(s) => Err(ControlError::Refused(format!(
                "volume {name}: fenced by engine session {s:#x} before its first election"
            ))),
            SessionOutcome::Ended => Err(ControlError::Refused(format!(
                "volume {name}: its engine stopped before its first election (the log says why)"
            ))),
            SessionOutcome::TimedOut => Err(ControlError::Refused(format!(
                "volume {name}: not every replica answered within {RESUME_ELECTION_TIMEOUT:?} \
                 (replica_list says which), so the engine has no final session to record; nothing was created"
            ))),
        }
    }

    fn store(&self) -> Result<&lull_replica::Store, ControlError> {
        self.store.as_deref().ok_or_else(|| {
            ControlError::Refused(
                "this daemon has no replica store: start lull serve with --store DIR".into(),
            )
        })
    }

    /// Records a change of the RPC-created volumes (with a store; without
    /// one, nothing is kept across restarts).
    fn persist(
        &self,
        change: impl FnOnce(&mut std::collections::BTreeMap<String, crate::node::VolumeEntry>),
    ) -> Result<(), ControlError> {
        match &self.node {
            Some(node) => node.update(change).map_err(|e| {
                tracing::error!(error = %e, "cannot write the node state");
                ControlError::Failed(e.into())
            }),
            None => Ok(()),
        }
    }

    /// As `persist`, for the node's own limits.
    fn persist_limits(
        &self,
        change: impl FnOnce(&mut crate::node::NodeLimits),
    ) -> Result<(), ControlError> {
        match &self.node {
            Some(node) => node.update_limits(change).map_err(|e| {
                tracing::error!(error = %e, "cannot write the node state");
                ControlError::Failed(e.into())
            }),
            None => Ok(()),
        }
    }

    /// After a replica of `volume` was added or removed: the record's
    /// backend names the replicas the engine has now.
    fn persist_replicas(&self, volume: &str) -> Result<(), ControlError> {
        let Some(node) = &self.node else {
            return Ok(());
        };
        if !node.holds(volume) {
            return Ok(());
        }
        let dev = self.replicated(volume)?;
        let backend = replicas_backend(&dev.replica_targets());
        self.persist(|m| {
            if let Some(v) = m.get_mut(volume) {
                v.backend = backend;
            }
        })
    }

    /// The volumes of this node that are clones of one of `snapshots` of
    /// `volume` (as recorded: a node without `--store` records none).
    fn clones_of(&self, volume: &str, snapshots: &[String]) -> Vec<String> {
        let on = |c: &str| {
            c.rsplit_once(lull_volume::SNAPSHOT_SEPARATOR)
                .is_some_and(|(o, s)| o == volume && snapshots.iter().any(|n| n == s))
        };
        let mut out: std::collections::BTreeSet<String> = self
            .clones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, c)| on(c))
            .map(|(v, _)| v.clone())
            .collect();
        if let Some(node) = &self.node {
            out.extend(
                node.volumes()
                    .into_iter()
                    .filter(|v| v.clone_of.as_deref().is_some_and(on))
                    .map(|v| v.name),
            );
        }
        out.into_iter().collect()
    }

    /// What the clone `name` of a snapshot of `origin` writes to, from
    /// `volume_clone`'s `backend`, checked before anything is made for
    /// it: a chain's clone a head of the origin's kind unless told (a file
    /// next to the origin's file); a replicated volume's clone has its
    /// writes on its own replicas, made beside the snapshot, and takes no
    /// backend (`None`).
    fn clone_head(
        &self,
        origin: &Volume,
        name: &str,
        backend: Option<&str>,
    ) -> Result<Option<CloneHead>, ControlError> {
        let size = origin.dev().size_bytes();
        let Some(chain) = origin.storage.layered() else {
            if backend.is_some() {
                return Err(ControlError::InvalidParams(format!(
                    "volume {:?} is replicated: its clone's replicas are made on the stores of its replicas, sharing the snapshot, and backend does not apply",
                    origin.name
                )));
            }
            // The name is checked before any replica is made for it.
            config::parse_volume(&format!("{name}:{size}:malloc"))
                .map_err(|e| ControlError::InvalidParams(e.to_string()))?;
            if self.volumes.named(name).is_ok() {
                return Err(lull_volume::VolumeError::DuplicateVolume(name.into()).into());
            }
            return Ok(None);
        };
        if self.volumes.named(name).is_ok() {
            return Err(lull_volume::VolumeError::DuplicateVolume(name.into()).into());
        }
        let backend = match (backend, chain.volume_path()) {
            (Some(b), _) => b.to_string(),
            (None, Some(path)) => {
                let dir = path.parent().unwrap_or(std::path::Path::new("."));
                format!("file={}", dir.join(format!("{name}.img")).display())
            }
            (None, None) => "malloc".to_string(),
        };
        let spec = config::parse_volume(&format!("{name}:{size}:{backend}"))
            .map_err(|e| ControlError::Refused(e.to_string()))?;
        if let config::Backend::File { path, .. } = &spec.backend {
            if path.exists() {
                return Err(ControlError::Refused(format!(
                    "{}: exists already; a clone starts from an empty file",
                    path.display()
                )));
            }
        }
        let store =
            crate::storage::chain_store(&spec.backend, size).map_err(ControlError::Refused)?;
        Ok(Some(CloneHead { backend, store }))
    }

    /// Adds a chain's clone `name` of `snapshot` to the registry and the
    /// node's record (the caller holds `volume_changes`); a clone that
    /// cannot be recorded is not made.
    fn add_chain_clone(
        &self,
        origin: &Volume,
        clone: Arc<lull_bdev::ChainDev>,
        snapshot: &str,
        name: &str,
        backend: String,
    ) -> Result<Arc<Volume>, ControlError> {
        let size = origin.dev().size_bytes();
        let v = self
            .volumes
            .add(Volume::new(name, Storage::Layered(clone)))?;
        let entry = crate::node::VolumeEntry {
            name: name.to_string(),
            size_bytes: size,
            backend,
            nvmf_nqn: None,
            nvmf_lba: None,
            nvmf_allow_hosts: Vec::new(),
            qos: None,
            rebuild_mbytes_per_sec: None,
            clone_of: Some(snapshot.to_string()),
            session: None,
        };
        if let Err(e) = self.persist(|m| {
            m.insert(entry.name.clone(), entry);
        }) {
            let _ = self.volumes.remove(name);
            if let Some(chain) = origin.storage.layered() {
                chain.forget_clone(name);
            }
            return Err(e);
        }
        Ok(v)
    }

    /// Creates the replicated volume `name` of `backend` (the clone of
    /// `snapshot` made on its origin's replicas' stores) as any new
    /// volume, and records what it is a clone of.
    fn add_replicated_clone(
        &self,
        origin: &Volume,
        snapshot: &str,
        name: &str,
        backend: &str,
    ) -> Result<VolumeInfo, ControlError> {
        let info = self.volume_create(&NewVolume {
            name: name.to_string(),
            size_bytes: origin.dev().size_bytes(),
            backend: backend.to_string(),
            nvmf_nqn: None,
            nvmf_lba: None,
            nvmf_allow_hosts: Vec::new(),
            persist: true,
            resume: false,
        })?;
        self.note_clone(name, Some(snapshot));
        self.persist(|m| {
            if let Some(e) = m.get_mut(name) {
                e.clone_of = Some(snapshot.to_string());
            }
        })?;
        Ok(info)
    }

    /// RPC-created volumes may bring NVMe/TCP options to this target.
    pub fn with_nvmf(mut self, nvmf: Option<lull_nvmf::Subsystems>) -> Control {
        self.nvmf = nvmf;
        self
    }

    /// `volume_create`'s NVMe/TCP options, checked as the configuration's
    /// are; `None` when none was given.
    fn nvmf_options(
        &self,
        volume: &NewVolume,
        size_bytes: u64,
    ) -> Result<Option<lull_nvmf::SubsystemOptions>, ControlError> {
        if !volume.has_nvmf_options() {
            return Ok(None);
        }
        if self.nvmf.is_none() {
            return Err(ControlError::Refused(
                "nvmf_nqn, nvmf_lba and nvmf_allow_hosts need the NVMe/TCP target: start lull serve with --nvmf-listen".into(),
            ));
        }
        let n = config::NvmfVolume {
            nqn: volume.nvmf_nqn.clone(),
            lba_bytes: volume.nvmf_lba,
            allow_hosts: volume.nvmf_allow_hosts.clone(),
        };
        config::check_nvmf_volume(&volume.name, size_bytes, &n)
            .map_err(|e| ControlError::Refused(e.to_string()))?;
        Ok(Some(lull_nvmf::SubsystemOptions {
            nqn: n.nqn,
            lba_shift: match n.lba_bytes {
                Some(4096) => lull_nvmf::LBA_SHIFT_4K,
                _ => lull_nvmf::LBA_SHIFT,
            },
            allowed_hosts: n.allow_hosts,
        }))
    }

    /// Hybrid mode sends replica keep-alives every
    /// `nvme_adminq_poll_period_us` (Longhorn's admin-queue poll); the other
    /// modes at the engine's own keep-alive interval.
    pub fn apply_keepalive(&self, mode: lull_reactor::Mode) {
        let period_us = if mode == lull_reactor::Mode::Hybrid {
            self.adminq_poll_period_us.load(Ordering::Relaxed)
        } else {
            self.engine.keepalive_interval_ms * 1000
        };
        for v in self.volumes.list() {
            if let Some(dev) = v.storage.replicated() {
                if let Err(e) = dev.set_keepalive_period_us(period_us) {
                    tracing::warn!(volume = %v.name, error = %e, "cannot set the keep-alive period");
                }
            }
        }
    }

    fn replicated(&self, volume: &str) -> Result<Arc<lull_engine::ReplicatedDev>, ControlError> {
        match &self.volumes.named(volume)?.storage {
            Storage::Replicated(dev) => Ok(dev.clone()),
            Storage::Local(_) | Storage::Layered(_) => {
                Err(ControlError::NotReplicated(volume.into()))
            }
        }
    }
}

impl ControlPlane for Control {
    fn get_options(&self) -> Options {
        let reactors = self.fw.reactor_stats();
        let (mode, period) = reactors
            .first()
            .map(|r| (r.mode, r.ioq_poll_period_us))
            .unwrap_or((
                config::DEFAULT_MODE,
                lull_reactor::DEFAULT_IOQ_POLL_PERIOD_US,
            ));
        Options {
            mode: mode.as_str().into(),
            nvme_ioq_poll_period_us: period,
            nvme_adminq_poll_period_us: self.adminq_poll_period_us.load(Ordering::Relaxed),
            interrupt_mode_enabled: reactors.iter().all(|r| r.interrupt_mode_enabled()),
        }
    }

    fn set_options(&self, change: &OptionsChange) -> Result<Options, ControlError> {
        let current = self.get_options();
        let mode = config::parse_mode(change.mode.as_deref().unwrap_or(&current.mode))
            .map_err(|e| ControlError::Refused(e.to_string()))?;
        let period = change
            .nvme_ioq_poll_period_us
            .unwrap_or(current.nvme_ioq_poll_period_us);
        if let Some(a) = change.nvme_adminq_poll_period_us {
            self.adminq_poll_period_us.store(a, Ordering::Relaxed);
        }
        self.fw
            .set_mode_all(mode, period)
            .map_err(|e| ControlError::Failed(e.into()))?;
        self.apply_keepalive(mode);
        tracing::info!(
            mode = mode.as_str(),
            nvme_ioq_poll_period_us = period,
            "engine options set over RPC"
        );
        Ok(self.get_options())
    }

    fn volume_create(&self, volume: &NewVolume) -> Result<VolumeInfo, ControlError> {
        let NewVolume {
            name,
            size_bytes,
            backend,
            ..
        } = volume;
        let spec = config::parse_volume(&format!("{name}:{size_bytes}:{backend}"))
            .map_err(|e| ControlError::Refused(e.to_string()))?;
        let nvmf = self.nvmf_options(volume, spec.size_bytes)?;
        if volume.resume && !matches!(spec.backend, config::Backend::Replicas { .. }) {
            return Err(ControlError::Refused(format!(
                "volume {}: resume is for a replicated volume (backend replicas=...): only an engine has a session to resume",
                spec.name
            )));
        }
        if volume.resume && self.node.is_none() {
            return Err(ControlError::Refused(
                "resume needs the node state, kept under the store: start lull serve with --store DIR".into(),
            ));
        }
        let _one = self
            .volume_changes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Refused before a device is opened (a file created, replicas
        // attached) for nothing.
        if self.volumes.named(&spec.name).is_ok() {
            return Err(lull_volume::VolumeError::DuplicateVolume(spec.name).into());
        }
        // The options go in first, so that no host reaches the new
        // volume under the defaults.
        if let (Some(o), Some(subsystems)) = (nvmf.clone(), &self.nvmf) {
            subsystems
                .set(&spec.name, o)
                .map_err(|e| ControlError::Refused(e.to_string()))?;
        }
        let forget = || {
            if let (Some(_), Some(subsystems)) = (&nvmf, &self.nvmf) {
                subsystems.forget(&spec.name);
            }
        };
        let dev = crate::storage::open_device(
            &spec,
            &self.fw,
            &self.engine,
            &self.links,
            &self.node_rebuild,
            None,
        )
        .map_err(|e| {
            forget();
            ControlError::Failed(e.into())
        })?;
        let v = self
            .volumes
            .add(Volume::new(&spec.name, dev))
            .inspect_err(|_| forget())?;
        if let (Some(o), Some(subsystems)) = (&nvmf, &self.nvmf) {
            tracing::info!(volume = %v.name, nqn = %subsystems.nqn_of(&v.name),
                lba_bytes = 1u32 << o.lba_shift, allowed_hosts = o.allowed_hosts.len(),
                "NVMe/TCP options of the new volume");
        }
        if let Some(r) = self.fw.reactor_stats().first() {
            self.apply_keepalive(r.mode);
        }
        let limit = self.rebuild_limit_default.load(Ordering::Relaxed);
        if let (Some(dev), true) = (v.storage.replicated(), limit > 0) {
            if let Err(e) = dev.set_rebuild_limit(limit) {
                tracing::warn!(volume = %v.name, error = %e, "cannot apply the rebuild limit");
            }
        }
        // A resumed volume's record carries its engine's final session,
        // known once the engine is elected (before that a fresh engine
        // may still take one past a replica's owner).
        let session = match (volume.resume, v.storage.replicated()) {
            (true, Some(dev)) => self.final_session(&v.name, dev).map(Some),
            _ => Ok(None),
        };
        let recorded = session.and_then(|session| {
            let entry = crate::node::VolumeEntry {
                name: v.name.clone(),
                size_bytes: spec.size_bytes,
                backend: backend.clone(),
                nvmf_nqn: volume.nvmf_nqn.clone(),
                nvmf_lba: volume.nvmf_lba,
                nvmf_allow_hosts: volume.nvmf_allow_hosts.clone(),
                qos: None,
                rebuild_mbytes_per_sec: None,
                clone_of: None,
                session,
            };
            if volume.persist {
                self.persist(|m| {
                    m.insert(entry.name.clone(), entry);
                })
            } else {
                Ok(())
            }
        });
        if let Err(e) = recorded {
            // Not kept (or, resumed, no final session to keep), so not
            // created: a volume must not vanish at the next restart after
            // the RPC said it exists.
            if let Ok(gone) = self.volumes.remove(&v.name) {
                if let Some(dev) = gone.storage.replicated() {
                    let _ = dev.detach(std::time::Duration::from_secs(5));
                }
            }
            forget();
            return Err(e);
        }
        tracing::info!(volume = %v.name, size_bytes, backend, persist = volume.persist,
            "volume created over RPC");
        Ok(VolumeInfo::of(&v))
    }

    fn volume_delete(&self, volume: &VolumeName) -> Result<(), ControlError> {
        let name = volume.name.as_str();
        // The NVMe/TCP target forgets the volume's options as it is told
        // of the removal.
        let v = {
            let _one = self
                .volume_changes
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let v = self.volumes.remove(name)?;
            self.note_clone(name, None);
            // A record that cannot be written leaves the volume in it: it
            // comes back at the next start, where it can be deleted again.
            if let Err(e) = self.persist(|m| {
                m.remove(name);
            }) {
                tracing::error!(volume = name, error = %e, "volume deleted, and the node state still lists it");
            }
            v
        };
        // A deleted clone no longer holds its origin's snapshot.
        if v.storage.layered().is_some_and(|c| c.has_base()) {
            for other in self.volumes.list() {
                if let Some(c) = other.storage.layered() {
                    c.forget_clone(name);
                }
            }
        }
        // Connected clients keep the device until they disconnect; flush
        // what is there now.
        if let Err(e) = v.dev().sync() {
            tracing::warn!(volume = name, error = %e, "flush of a deleted volume failed");
        }
        // A replicated volume's engine detaches cleanly (as at `lull
        // serve`'s stop): its replicas are then clean at one generation,
        // which the next engine trusts without reconciling and a cluster
        // manager needs to snapshot them on their stores
        // (`replica_snapshot`). Clients still connected get errors from
        // now on: the volume is gone.
        if let Some(dev) = v.storage.replicated() {
            match dev.detach(DELETE_DETACH_TIMEOUT) {
                Ok(true) => tracing::info!(volume = name, "detached from its replicas cleanly"),
                Ok(false) => {
                    tracing::warn!(volume = name, timeout = ?DELETE_DETACH_TIMEOUT, "clean detach did not finish: the replicas stay dirty (the next engine reconciles them)")
                }
                Err(e) => {
                    tracing::warn!(volume = name, error = %e, "clean detach failed: the replicas stay dirty (the next engine reconciles them)")
                }
            }
        }
        tracing::info!(volume = name, "volume deleted over RPC");
        Ok(())
    }

    fn volume_resize(&self, resize: &VolumeResize) -> Result<VolumeInfo, ControlError> {
        let VolumeResize { name, size_bytes } = resize;
        let before = self.volumes.named(name)?.dev().size_bytes();
        let v = self.volumes.resize(name, *size_bytes).inspect_err(|e| {
            tracing::warn!(volume = %name, size_bytes, error = %e, "volume_resize refused");
        })?;
        self.persist(|m| {
            if let Some(v) = m.get_mut(name.as_str()) {
                v.size_bytes = *size_bytes;
            }
        })?;
        tracing::info!(volume = %name, from = before, to = size_bytes,
            "volume grown over RPC (NVMe/TCP hosts are told; NBD clients see the new size on their next connection)");
        Ok(VolumeInfo::of(&v))
    }

    fn volume_stats(&self, volume: &VolumeName) -> Result<Value, ControlError> {
        let v = self.volumes.named(&volume.name)?;
        let s = v.stats.snapshot();
        Ok(json!({
            "name": v.name,
            "reads": s.reads,
            "writes": s.writes,
            "flushes": s.flushes,
            "trims": s.trims,
            "write_zeroes": s.write_zeroes,
            "read_bytes": s.read_bytes,
            "write_bytes": s.write_bytes,
            "errors": s.errors,
            // Connections (NBD, NVMe/TCP I/O queues) and requests in flight
            // now, and how often a request waited for the volume's cap
            // (`--max-in-flight-per-volume`).
            "connections": v.connections(),
            "in_flight": v.in_flight(),
            "in_flight_waits": v.in_flight_waits(),
            // io_uring_enter calls of the volume's file channels (null:
            // the volume does not use io_uring). Page faults and context
            // switches are per reactor (framework_get_reactors), not per
            // volume: several volumes share a reactor thread.
            "io_uring_enters": v.dev().io_uring_enters(),
            // Reads and writes of those channels from registered buffers
            // (READ_FIXED/WRITE_FIXED) and from others (null likewise).
            "fixed_buffer_ios": v.dev().buffer_ios().map(|b| b.fixed),
            "plain_buffer_ios": v.dev().buffer_ios().map(|b| b.plain),
            // Reads and writes done inline, without a ring (a file on a
            // memory filesystem; null likewise).
            "inline_ios": v.dev().buffer_ios().map(|b| b.inline),
            // Reads whose data went from a replica's socket to the
            // client's with splice, never copied into memory.
            "spliced_reads": s.spliced_reads,
            // Reads sent from the volume's memory, lent, never copied
            // into a buffer first (memory volumes).
            "lent_reads": s.lent_reads,
            // Reads sent from the volume's file with sendfile, never
            // copied into a buffer first (file volumes on a memory
            // filesystem).
            "sendfile_reads": s.sendfile_reads,
            "qos": qos_json(&v),
            // Replicated volumes: the rebuild bandwidth limit (0: none).
            "rebuild_limit_bytes_per_sec": v.storage.replicated().map(|d| d.rebuild_limit()),
            // The node's total over every copy (0: none), which this
            // volume's copies share with the others'.
            "node_rebuild_limit_bytes_per_sec": v
                .storage
                .replicated()
                .map(|_| self.node_rebuild.bytes_per_sec()),
            "latency_ns": {
                "mean": s.latency_mean_ns(),
                "p50_le": s.latency_quantile_le_ns(0.5),
                "p99_le": s.latency_quantile_le_ns(0.99),
                "max": s.latency_max_ns,
            },
        }))
    }

    fn replica_list(&self, volume: &ReplicaVolume) -> Result<Value, ControlError> {
        let dev = self.replicated(&volume.volume)?;
        Ok(Value::Array(
            dev.replica_status().iter().map(replica_json).collect(),
        ))
    }

    fn replica_add(&self, replica: &ReplicaAddr) -> Result<(), ControlError> {
        let dev = self.replicated(&replica.volume)?;
        let addr = parse_addr(&replica.addr)?;
        dev.add_replica(addr)
            .map_err(|e| ControlError::Failed(e.into()))?;
        self.persist_replicas(&replica.volume)
    }

    fn replica_remove(&self, replica: &ReplicaAddr) -> Result<(), ControlError> {
        let dev = self.replicated(&replica.volume)?;
        let addr = parse_addr(&replica.addr)?;
        dev.remove_replica(addr)
            .map_err(|e| ControlError::Failed(e.into()))?;
        self.persist_replicas(&replica.volume)
    }

    fn replica_create(&self, name: &str, size_bytes: u64) -> Result<Value, ControlError> {
        let info = self
            .store()?
            .create(name, size_bytes)
            .map_err(store_error)?;
        Ok(json!(info))
    }

    fn replica_delete(&self, name: &str) -> Result<(), ControlError> {
        self.store()?.delete(name).map_err(store_error)
    }

    fn replica_get(&self, name: &str) -> Result<Value, ControlError> {
        Ok(json!(self.store()?.get(name).map_err(store_error)?))
    }

    fn replica_resize(&self, name: &str, size_bytes: u64) -> Result<Value, ControlError> {
        let info = self
            .store()?
            .grow(name, size_bytes)
            .inspect_err(|e| {
                tracing::warn!(replica = name, size_bytes, error = %e, "replica_resize refused");
            })
            .map_err(store_error)?;
        Ok(json!(info))
    }

    fn replica_device(&self, name: &str) -> Result<Arc<dyn lull_bdev::BlockDevice>, ControlError> {
        self.store()?.chain(name).map_err(store_error)
    }

    fn replica_import(&self, name: &str, dir: &str) -> Result<Value, ControlError> {
        let info = self
            .store()?
            .import(name, std::path::Path::new(dir))
            .map_err(store_error)?;
        Ok(json!(info))
    }

    fn replica_clone(
        &self,
        name: &str,
        origin: &str,
        snapshot: &str,
    ) -> Result<Value, ControlError> {
        let info = self
            .store()?
            .clone_replica(name, origin, snapshot)
            .map_err(store_error)?;
        tracing::info!(replica = name, origin, snapshot, "replica cloned over RPC");
        Ok(json!(info))
    }

    fn replica_snapshot(
        &self,
        name: &str,
        snapshot: &str,
        create: bool,
    ) -> Result<Value, ControlError> {
        let op = if create {
            SnapshotOp::Create
        } else {
            SnapshotOp::Delete
        };
        let info = self
            .store()?
            .snapshot(name, snapshot, op)
            .inspect_err(|e| {
                tracing::warn!(replica = name, snapshot, ?op, error = %e, "replica_snapshot refused");
            })
            .map_err(store_error)?;
        Ok(json!(info))
    }

    fn store_get(&self) -> Result<Value, ControlError> {
        Ok(json!(self.store()?.info().map_err(store_error)?))
    }

    fn snapshot_create(&self, volume: &str, name: &str) -> Result<Value, ControlError> {
        let v = self.volumes.named(volume)?;
        let snapshots = v.storage.snapshots(volume).map_err(snapshot_error)?;
        let start = std::time::Instant::now();
        let s = snapshots.create(name).map_err(snapshot_error)?;
        tracing::info!(
            volume,
            snapshot = name,
            storage = v.storage.kind(),
            took_us = start.elapsed().as_micros() as u64,
            "snapshot created over RPC"
        );
        Ok(snapshot_json(volume, &s))
    }

    fn snapshot_list(&self, volume: &str) -> Result<Value, ControlError> {
        let v = self.volumes.named(volume)?;
        let list = v
            .storage
            .snapshots(volume)
            .and_then(|s| s.list(&|names| self.clones_of(volume, names)))
            .map_err(snapshot_error)?;
        Ok(Value::Array(
            list.iter().map(|s| snapshot_json(volume, s)).collect(),
        ))
    }

    fn snapshot_delete(&self, volume: &str, name: &str) -> Result<(), ControlError> {
        let v = self.volumes.named(volume)?;
        v.storage
            .snapshots(volume)
            .and_then(|s| s.delete(volume, name, &|names| self.clones_of(volume, names)))
            .map_err(snapshot_error)?;
        tracing::info!(
            volume,
            snapshot = name,
            storage = v.storage.kind(),
            "snapshot delete started over RPC (merging into its child in the background)"
        );
        Ok(())
    }

    fn volume_revert(
        &self,
        volume: &str,
        snapshot: &str,
        force: bool,
    ) -> Result<Value, ControlError> {
        let v = self.volumes.named(volume)?;
        let connected = v.connections();
        if connected > 0 && !force {
            return Err(ControlError::Refused(format!(
                "volume {volume:?} has {connected} connected clients: disconnect them first, or pass force (they see the data change under them)"
            )));
        }
        let dropped = v
            .storage
            .snapshots(volume)
            .and_then(|s| s.revert(snapshot, &|names| self.clones_of(volume, names)))
            .map_err(snapshot_error)?;
        tracing::warn!(volume, snapshot, connected, dropped = ?dropped,
            storage = v.storage.kind(), "volume reverted over RPC");
        Ok(json!({ "volume": volume, "snapshot": snapshot, "dropped_snapshots": dropped }))
    }

    fn volume_clone(
        &self,
        snapshot: &str,
        name: &str,
        backend: Option<&str>,
    ) -> Result<VolumeInfo, ControlError> {
        let Some((origin, snap)) = snapshot.rsplit_once(lull_volume::SNAPSHOT_SEPARATOR) else {
            return Err(ControlError::InvalidParams(format!(
                "snapshot must be VOLUME@SNAPSHOT, not {snapshot:?}"
            )));
        };
        let ov = self.volumes.named(origin)?;
        let snapshots = ov.storage.snapshots(origin).map_err(snapshot_error)?;
        // A chain's clone is made and added under the lock; a replicated
        // volume's replicas are made first (on the stores, over the
        // network), and its volume then created as any other.
        let one = ov.storage.layered().map(|_| {
            self.volume_changes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
        });
        let head = self.clone_head(&ov, name, backend)?;
        let made = snapshots
            .make_clone(snap, name, head.as_ref().map(|h| h.store.clone()))
            .map_err(snapshot_error)?;
        let (info, backend) = match (made, head) {
            (Cloned::Chain(clone), Some(head)) => {
                let v = self.add_chain_clone(&ov, clone, snapshot, name, head.backend.clone())?;
                (VolumeInfo::of(&v), head.backend)
            }
            (Cloned::Replicas(replicas), _) => {
                drop(one);
                let backend = replicas_backend(&replicas);
                let info = self.add_replicated_clone(&ov, snapshot, name, &backend)?;
                (info, backend)
            }
            (Cloned::Chain(_), None) => unreachable!("a chain's clone is made over a head"),
        };
        tracing::info!(
            volume = name,
            snapshot,
            backend,
            storage = ov.storage.kind(),
            "clone created over RPC"
        );
        Ok(info)
    }

    fn volume_set_qos(
        &self,
        name: &str,
        limits: lull_volume::QosLimits,
    ) -> Result<Value, ControlError> {
        use lull_reactor::Clock;
        let v = self.volumes.named(name)?;
        // Recorded first where volumes are: a limit must not vanish at the
        // next start after the RPC said it is set.
        self.persist(|m| {
            if let Some(e) = m.get_mut(name) {
                e.qos = (!limits.is_unlimited()).then_some(limits);
            }
        })?;
        v.qos.set(limits, lull_reactor::MonotonicClock.now_ns());
        tracing::info!(volume = name, ?limits, "QoS limits set over RPC");
        Ok(qos_json(&v))
    }

    fn node_set_rebuild_limit(&self, mbytes_per_sec: u64) -> Result<Value, ControlError> {
        // Recorded first: the limit must not vanish at the next start
        // after the RPC said it is set.
        self.persist_limits(|l| {
            l.rebuild_mbytes_per_sec = (mbytes_per_sec > 0).then_some(mbytes_per_sec)
        })?;
        self.node_rebuild.set(mbytes_per_sec * 1_000_000);
        tracing::info!(
            mbytes_per_sec,
            "node rebuild bandwidth limit (the total of every copy) set over RPC"
        );
        Ok(json!({
            "mbytes_per_sec": mbytes_per_sec,
            "copies_running": self.node_rebuild.copies(),
        }))
    }

    fn volume_set_rebuild_limit(
        &self,
        name: Option<&str>,
        mbytes_per_sec: u64,
    ) -> Result<Value, ControlError> {
        let bytes = mbytes_per_sec * 1_000_000;
        let targets: Vec<Arc<Volume>> = match name {
            Some(n) => {
                self.replicated(n)?;
                vec![self.volumes.named(n)?]
            }
            None => {
                self.persist_limits(|l| {
                    l.volume_rebuild_mbytes_per_sec = (mbytes_per_sec > 0).then_some(mbytes_per_sec)
                })?;
                self.rebuild_limit_default.store(bytes, Ordering::Relaxed);
                self.volumes
                    .list()
                    .into_iter()
                    .filter(|v| v.storage.replicated().is_some())
                    .collect()
            }
        };
        let mut names = Vec::new();
        for v in &targets {
            if let Some(dev) = v.storage.replicated() {
                dev.set_rebuild_limit(bytes)
                    .map_err(|e| ControlError::Failed(e.into()))?;
                names.push(v.name.clone());
            }
        }
        if let Some(n) = name {
            self.persist(|m| {
                if let Some(e) = m.get_mut(n) {
                    e.rebuild_mbytes_per_sec = (mbytes_per_sec > 0).then_some(mbytes_per_sec);
                }
            })?;
        }
        tracing::info!(
            volume = name.unwrap_or("(every replicated volume)"),
            mbytes_per_sec,
            "rebuild bandwidth limit set over RPC"
        );
        Ok(json!({ "mbytes_per_sec": mbytes_per_sec, "volumes": names }))
    }

    fn snapshot_expose(&self, volume: &str, name: &str) -> Result<VolumeInfo, ControlError> {
        let v = self.volumes.named(volume)?;
        // The names its snapshots are served under, fresh.
        v.storage
            .snapshots(volume)
            .and_then(|s| s.refresh_views())
            .map_err(snapshot_error)?;
        let export = lull_volume::snapshot_export(volume, name);
        let view = v.dev().snapshot_view(name).ok_or_else(|| {
            ControlError::Refused(format!("volume {volume:?} has no snapshot {name:?}"))
        })?;
        let _one = self
            .volume_changes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let exposed = self
            .volumes
            .add(Volume::new(&export, Storage::Local(view)))?;
        tracing::info!(volume, snapshot = name, export = %export,
            "snapshot exposed as a read-only volume (NVMe/TCP subsystem; not recorded: gone at restart)");
        Ok(VolumeInfo::of(&exposed))
    }

    fn snapshot_unexpose(&self, volume: &str, name: &str) -> Result<(), ControlError> {
        let export = lull_volume::snapshot_export(volume, name);
        let _one = self
            .volume_changes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let v = self.volumes.named(&export)?;
        if !v.dev().read_only() {
            return Err(ControlError::Refused(format!(
                "{export:?} is a volume, not an exposed snapshot"
            )));
        }
        self.volumes.remove(&export)?;
        tracing::info!(export = %export, "exposed snapshot removed (connected hosts keep it until they disconnect)");
        Ok(())
    }

    fn nvmf_host_psk_add(
        &self,
        volume: &str,
        hostnqn: &str,
        key_file: &str,
    ) -> Result<Value, ControlError> {
        let subsystems = self.nvmf.as_ref().ok_or_else(no_nvmf)?;
        self.volumes.named(volume)?;
        let key = lull_nvmf::psk::load_key_file(std::path::Path::new(key_file))
            .map_err(|e| ControlError::InvalidParams(e.to_string()))?;
        subsystems
            .set_host_psk(volume, hostnqn, &key)
            .map_err(|e| ControlError::Refused(e.to_string()))?;
        tracing::info!(
            volume,
            hostnqn,
            key_file,
            "NVMe/TCP host key set over RPC: the volume takes TLS only"
        );
        Ok(json!({
            "volume": volume,
            "hostnqn": hostnqn,
            "secure_channel_required": subsystems.secure_channel_required(volume),
        }))
    }

    fn nvmf_host_psk_remove(&self, volume: &str, hostnqn: &str) -> Result<Value, ControlError> {
        let subsystems = self.nvmf.as_ref().ok_or_else(no_nvmf)?;
        if !subsystems.remove_host_psk(volume, hostnqn) {
            return Err(ControlError::Refused(format!(
                "volume {volume:?} has no key for host {hostnqn:?}"
            )));
        }
        tracing::info!(volume, hostnqn, "NVMe/TCP host key removed over RPC");
        Ok(json!({
            "volume": volume,
            "hostnqn": hostnqn,
            "secure_channel_required": subsystems.secure_channel_required(volume),
        }))
    }

    fn volume_flatten(&self, volume: &str) -> Result<(), ControlError> {
        let v = self.volumes.named(volume)?;
        let flattened = v
            .storage
            .snapshots(volume)
            .and_then(|s| s.flatten())
            .map_err(snapshot_error)?;
        if flattened == Flattened::NotAClone {
            return Err(ControlError::Refused(format!(
                "volume {volume:?} is not a clone (it has no base to copy in)"
            )));
        }
        // Its origin no longer holds a base for it: a chain records its
        // clones, this node the replicated ones.
        self.note_clone(volume, None);
        for other in self.volumes.list() {
            if let Some(c) = other.storage.layered() {
                c.forget_clone(volume);
            }
        }
        self.persist(|m| {
            if let Some(e) = m.get_mut(volume) {
                e.clone_of = None;
            }
        })?;
        match flattened {
            Flattened::Started { base } => tracing::info!(volume, base = %base,
                "flatten of a replicated clone started over RPC: every replica copies its base in the background (snapshot_list shows it merging)"),
            _ => tracing::info!(volume, "clone flattened over RPC: it stands alone"),
        }
        Ok(())
    }
}

fn no_nvmf() -> ControlError {
    ControlError::Refused("this server serves no NVMe/TCP (start it with --nvmf-listen)".into())
}

/// A volume's QoS: its limits (0: unlimited), the requests the limits
/// held and how long they waited in all.
fn qos_json(v: &Volume) -> Value {
    let (throttled, throttled_ns) = v.qos.throttled();
    json!({
        "limits": v.qos.limits(),
        "throttled_requests": throttled,
        "throttled_seconds": throttled_ns as f64 / 1e9,
    })
}

/// A snapshot operation's refusal as the RPC says it: names and states
/// are the caller's to fix, I/O failures the server's.
fn snapshot_error(e: SnapshotError) -> ControlError {
    use lull_bdev::BdevError as E;
    match e {
        SnapshotError::Bdev(
            e @ (E::BadName(_) | E::NoSuchSnapshot(_) | E::InUse(_) | E::Unsupported(_)),
        ) => ControlError::Refused(e.to_string()),
        SnapshotError::Bdev(E::Failed(m)) if m.contains("maximum") => {
            ControlError::Refused(E::Failed(m).to_string())
        }
        SnapshotError::Bdev(e) => ControlError::Failed(e.into()),
        SnapshotError::Refused(m) => ControlError::Refused(m),
        SnapshotError::Failed(m) => ControlError::Failed(m.into()),
    }
}

/// How long `volume_delete` waits for a replicated volume's clean detach
/// (writes in flight finish, every healthy replica syncs and records
/// clean). A sync takes milliseconds to a few seconds; past 10 s the
/// replicas stay dirty, which costs the next engine a reconcile, not
/// data, and the RPC (a CSI unstage) answers.
const DELETE_DETACH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A chain's clone's own writes: its backend as the node records it, and
/// the store its head is made in.
struct CloneHead {
    backend: String,
    store: Arc<dyn lull_bdev::chain::LayerStore>,
}

/// A replicated volume's backend over `replicas` (`replicas=A+B`).
fn replicas_backend(replicas: &[lull_engine::ReplicaTarget]) -> String {
    format!(
        "replicas={}",
        replicas
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join("+")
    )
}

fn snapshot_json(volume: &str, s: &Snapshot) -> Value {
    let i = &s.info;
    let mut j = json!({
        "volume": volume,
        "name": i.name,
        // Served read-only over NBD (a replicated volume's from a replica
        // that holds it, `lull_engine::ReplicatedSnapshotView`).
        "export": lull_volume::snapshot_export(volume, &i.name),
        "created_unix": i.created_unix,
        "size_bytes": i.size_bytes,
        "allocated_bytes": i.allocated_bytes,
        "parent": i.parent,
        "clones": i.clones,
        "inherited": i.inherited,
        "merging": i.merging.map(|(done, total)| json!({ "bytes_done": done, "bytes_total": total })),
    });
    if let Some(r) = &s.replicas {
        j["replicas"] = json!(r.addrs);
        j["complete"] = json!(r.complete);
    }
    j
}

/// A store error as the RPC reports it: bad parameters as -32602, other
/// refusals with their reason, failures logged in full first.
fn store_error(e: lull_replica::StoreError) -> ControlError {
    use lull_replica::StoreError;
    match e {
        StoreError::BadName { .. } | StoreError::BadSize(_) => {
            ControlError::InvalidParams(e.to_string())
        }
        e if e.is_refusal() => ControlError::Refused(e.to_string()),
        e => {
            tracing::error!(error = %e, "store operation failed");
            ControlError::Failed(e.into())
        }
    }
}

fn parse_addr(addr: &str) -> Result<lull_engine::ReplicaTarget, ControlError> {
    let addrs =
        lull_engine::parse_replicas(addr).map_err(|e| ControlError::Refused(e.to_string()))?;
    match addrs.as_slice() {
        [one] => Ok(one.clone()),
        _ => Err(ControlError::Refused(format!(
            "expected one HOST:PORT or HOST:PORT/NAME, got {addr:?}"
        ))),
    }
}

fn replica_json(r: &lull_engine::ReplicaStatus) -> Value {
    let (state, mut progress) = match r.state {
        lull_engine::ReplicaState::Connecting => ("connecting", Value::Null),
        lull_engine::ReplicaState::Healthy => ("healthy", Value::Null),
        lull_engine::ReplicaState::Failed => ("failed", Value::Null),
        lull_engine::ReplicaState::Rebuilding {
            done_bytes,
            total_bytes,
        } => (
            "rebuilding",
            json!({"done_bytes": done_bytes, "total_bytes": total_bytes}),
        ),
        lull_engine::ReplicaState::Reconciling {
            done_bytes,
            total_bytes,
        } => (
            "reconciling",
            json!({"done_bytes": done_bytes, "total_bytes": total_bytes}),
        ),
    };
    if let (Some(p), Some(obj)) = (&r.rebuild, progress.as_object_mut()) {
        obj.insert("kind".into(), json!(p.kind.as_str()));
        obj.insert("bytes_total".into(), json!(p.bytes_total));
        obj.insert("bytes_done".into(), json!(p.bytes_done));
        obj.insert("rate_bytes_per_sec".into(), json!(p.rate_bytes_per_sec));
        // At the rate so far; null until a byte is done.
        let eta = (p.rate_bytes_per_sec > 0).then(|| {
            p.bytes_total.saturating_sub(p.bytes_done) as f64 / p.rate_bytes_per_sec as f64
        });
        obj.insert("eta_secs".into(), json!(eta));
    }
    let last_rebuild = r.last_rebuild.map_or(Value::Null, |l| {
        json!({
            "kind": l.kind.as_str(),
            "bytes": l.bytes,
            "bytes_copied": l.bytes_copied,
            "secs": l.duration_ns as f64 / 1e9,
        })
    });
    json!({
        "addr": r.addr.to_string(),
        "state": state,
        "rebuild": progress,
        "last_rebuild": last_rebuild,
        "generation": r.generation,
        "in_flight": r.in_flight,
        "errors": r.errors,
        "last_error": r.last_error,
    })
}

impl MetricsSource for Control {
    fn snapshot(&self) -> MetricsSnapshot {
        let volumes = self
            .volumes
            .list()
            .iter()
            .map(|v| {
                let s = v.stats.snapshot();
                VolumeMetrics {
                    name: v.name.clone(),
                    reads: s.reads,
                    writes: s.writes,
                    read_bytes: s.read_bytes,
                    write_bytes: s.write_bytes,
                    latency_buckets: (0..LATENCY_BUCKETS)
                        .map(|i| (bucket_le_ns(i) as f64, s.buckets[i]))
                        .collect(),
                    latency_sum_ns: s.latency_sum_ns,
                    latency_count: s.buckets.iter().sum(),
                    io_uring_enters: v.dev().io_uring_enters(),
                    fixed_buffer_ios: v.dev().buffer_ios().map(|b| b.fixed),
                    plain_buffer_ios: v.dev().buffer_ios().map(|b| b.plain),
                    inline_ios: v.dev().buffer_ios().map(|b| b.inline),
                    spliced_reads: s.spliced_reads,
                    lent_reads: s.lent_reads,
                    sendfile_reads: s.sendfile_reads,
                    qos_throttled: v.qos.throttled().0,
                    qos_throttled_seconds: v.qos.throttled().1 as f64 / 1e9,
                    qos_rw_ios_per_sec: v.qos.limits().rw_ios_per_sec,
                }
            })
            .collect();
        let mut replicas = Vec::new();
        for v in self.volumes.list() {
            if let Some(dev) = v.storage.replicated() {
                for r in dev.replica_status() {
                    let p = r.rebuild.as_ref();
                    replicas.push(lull_rpc::ReplicaMetrics {
                        volume: v.name.clone(),
                        addr: r.addr.to_string(),
                        healthy: r.state == lull_engine::ReplicaState::Healthy,
                        rebuild_bytes_total: p.map_or(0, |p| p.bytes_total),
                        rebuild_bytes_done: p.map_or(0, |p| p.bytes_done),
                        rebuild_rate_bytes_per_sec: p.map_or(0, |p| p.rate_bytes_per_sec),
                    });
                }
            }
        }
        let store = self.store.as_ref().and_then(|st| match st.info() {
            Ok(i) => Some(lull_rpc::StoreMetrics {
                capacity_bytes: i.capacity_bytes,
                free_bytes: i.free_bytes,
                allocated_bytes: i.allocated_bytes,
                provisioned_bytes: i.provisioned_bytes,
                replicas: i.replicas.len() as u64,
            }),
            Err(e) => {
                tracing::warn!(error = %e, "store metrics unavailable");
                None
            }
        });
        MetricsSnapshot {
            reactors: lull_rpc::reactor_metrics(&self.fw),
            volumes,
            replicas,
            store,
        }
    }
}
