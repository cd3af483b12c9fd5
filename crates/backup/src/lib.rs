//! Backups off the node: a volume's snapshot copied to a backup target
//! (S3-compatible object storage or a directory) as content-addressed,
//! compressed, optionally encrypted chunks and a manifest written last;
//! restored to a new volume, verified, deleted with garbage collection,
//! and served read-only before it is restored (`expose`). The layout on
//! the target is in [`format`] and docs/BACKUPS.md.
//!
//! ```ignore
//! let backups = Backups::new(volumes, control, Some(state_dir))?;
//! backups.target_add(TargetConfig { name: "s3".into(), url: "s3://bk?endpoint=http://127.0.0.1:7070".into(), .. })?;
//! let job = backups.create(BackupRequest { volume: "vol0".into(), target: "s3".into(), ..Default::default() })?;
//! // lull rpc backup_get '{"target": "s3", "id": "bk-..."}' shows its progress, then its manifest
//! ```
//!
//! Everything that talks to a target runs on this crate's own small
//! tokio runtime ([`RUNTIME_THREADS`]); everything that reads or writes a
//! volume runs on a job's own thread through a channel of the volume's
//! device ([`devio`]), never on a reactor.

#![forbid(unsafe_code)]

pub mod catalog;
mod chunks;
pub mod devio;
pub mod expose;
pub mod format;
mod job;
pub mod rpc;
pub mod schedule;
pub mod standby;
pub mod target;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub use job::{BackupRequest, JobInfo, RestoreRequest};
use lull_rpc::ControlPlane;
use lull_volume::Volumes;
use object_store::ObjectStoreExt;
use target::{Target, TargetConfig};

/// Threads of the backup runtime (HTTP requests, compression and hashing
/// of chunks): two, so that backups take at most two cores from the
/// volumes' reactors whatever the node's size.
pub const RUNTIME_THREADS: usize = 2;

/// Targets one node keeps.
pub const MAX_TARGETS: usize = 64;

/// Backup, restore and verify jobs running at once on a node: each holds
/// up to [`job::CHUNKS_IN_FLIGHT`] chunks (about 4 MiB each, plaintext
/// and stored) in memory, so 4 jobs are at most ~130 MiB.
pub const MAX_RUNNING_JOBS: usize = 4;

/// Finished jobs remembered for `backup_job_list` (the oldest forgotten
/// first); a backup's result is on its target anyway.
pub const MAX_FINISHED_JOBS: usize = 256;

/// The file under the node's state directory that records targets.
pub const STATE_FILE: &str = "backup-targets.json";

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    /// A target, key or URL that cannot be used as given.
    #[error("{0}")]
    Config(String),
    #[error("no backup target {0:?}")]
    NoSuchTarget(String),
    #[error("no backup {0:?} on the target")]
    NoSuchBackup(String),
    /// The target's answer to a request.
    #[error("target {target}: {source}")]
    Target {
        target: String,
        #[source]
        source: Box<object_store::Error>,
    },
    /// Something on the target is not what lull wrote.
    #[error("{0}")]
    Corrupt(String),
    /// A chunk that does not decode to its name.
    #[error("chunk {chunk} is bad: {why}")]
    BadChunk { chunk: String, why: String },
    /// Another job holds what this one needs.
    #[error("{0}")]
    Busy(String),
    /// The volume side: no such volume, no snapshots, an I/O error.
    #[error("{0}")]
    Volume(String),
    #[error("{0}")]
    Failed(String),
}

impl From<devio::DevIoError> for BackupError {
    fn from(e: devio::DevIoError) -> BackupError {
        BackupError::Volume(format!("volume I/O: {e}"))
    }
}

impl From<BackupError> for lull_rpc::ControlError {
    fn from(e: BackupError) -> lull_rpc::ControlError {
        match e {
            BackupError::Config(m) => lull_rpc::ControlError::InvalidParams(m),
            BackupError::Failed(m) => lull_rpc::ControlError::Failed(m.into()),
            e @ BackupError::Target { .. } => {
                tracing::warn!(error = ?e, "backup target request failed");
                lull_rpc::ControlError::Refused(e.to_string())
            }
            e => lull_rpc::ControlError::Refused(e.to_string()),
        }
    }
}

/// A node's backups: its targets, its jobs, its exposed backups.
pub struct Backups {
    rt: tokio::runtime::Runtime,
    volumes: Arc<Volumes>,
    control: Arc<dyn ControlPlane>,
    state_dir: Option<PathBuf>,
    targets: Mutex<BTreeMap<String, Target>>,
    jobs: Mutex<job::Jobs>,
    exposed: Mutex<BTreeMap<String, expose::Exposed>>,
    schedules: Mutex<BTreeMap<(String, String), schedule::Scheduled>>,
    standbys: Mutex<BTreeMap<String, standby::Standby>>,
    /// A standby's own (writable) storage, behind its read-only view.
    standby_devs: Mutex<BTreeMap<String, lull_volume::Storage>>,
    /// One activation at a time.
    standby_activation: Mutex<()>,
}

impl std::fmt::Debug for Backups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backups")
            .field("state_dir", &self.state_dir)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Backups {
    /// The node's backups; with `state_dir` its targets are recorded there
    /// ([`STATE_FILE`]) and restored now. A recorded target that no longer
    /// opens (its key file gone) is logged and skipped, not fatal.
    pub fn new(
        volumes: Arc<Volumes>,
        control: Arc<dyn ControlPlane>,
        state_dir: Option<PathBuf>,
    ) -> Result<Arc<Backups>, BackupError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_THREADS)
            .thread_name("lull-backup-rt")
            .enable_all()
            .build()
            .map_err(|e| BackupError::Failed(format!("backup runtime: {e}")))?;
        let b = Arc::new(Backups {
            rt,
            volumes,
            control,
            state_dir,
            targets: Mutex::new(BTreeMap::new()),
            jobs: Mutex::new(job::Jobs::default()),
            exposed: Mutex::new(BTreeMap::new()),
            schedules: Mutex::new(BTreeMap::new()),
            standbys: Mutex::new(BTreeMap::new()),
            standby_devs: Mutex::new(BTreeMap::new()),
            standby_activation: Mutex::new(()),
        });
        b.load_targets()?;
        b.load_schedules()?;
        b.load_standbys()?;
        b.start_cron()?;
        Ok(b)
    }

    /// The records of a state file (none when it does not exist yet).
    fn read_state<T: serde::de::DeserializeOwned>(
        &self,
        file: &str,
    ) -> Result<Vec<T>, BackupError> {
        let Some(f) = self.state_path(file) else {
            return Ok(Vec::new());
        };
        match std::fs::read(&f) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| BackupError::Config(format!("{}: {e}", f.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(BackupError::Config(format!("{}: {e}", f.display()))),
        }
    }

    fn state_path(&self, file: &str) -> Option<PathBuf> {
        self.state_dir.as_ref().map(|d| d.join(file))
    }

    /// Writes a state file whole (a temporary file renamed over it, both
    /// synced): the old contents or the new, never neither.
    fn write_state(&self, file: &str, body: &[u8]) -> Result<(), BackupError> {
        let Some(f) = self.state_path(file) else {
            return Ok(());
        };
        let tmp = f.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(body)?;
            file.sync_all()?;
            std::fs::rename(&tmp, &f)?;
            if let Some(dir) = f.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| BackupError::Failed(format!("{}: {e}", f.display())))
    }

    /// The recorded targets; one that no longer opens (its key file
    /// gone) is logged and skipped, not fatal.
    fn load_targets(&self) -> Result<(), BackupError> {
        let configs: Vec<TargetConfig> = self.read_state(STATE_FILE)?;
        let mut targets = lock(&self.targets);
        for c in configs {
            let name = c.name.clone();
            match Target::open(c) {
                Ok(t) => {
                    targets.insert(name, t);
                }
                Err(e) => tracing::error!(target = name, error = %e, "backup target not opened"),
            }
        }
        Ok(())
    }

    fn save_targets(&self, targets: &BTreeMap<String, Target>) -> Result<(), BackupError> {
        let configs: Vec<&TargetConfig> = targets.values().map(|t| &t.config).collect();
        self.write_state(
            STATE_FILE,
            &serde_json::to_vec_pretty(&configs).expect("targets serialize"),
        )
    }

    /// Adds a target after checking it answers and holds lull's format
    /// with this key (or is empty: its marker is written).
    pub fn target_add(&self, config: TargetConfig) -> Result<(), BackupError> {
        let name = config.name.clone();
        if lock(&self.targets).contains_key(&name) {
            return Err(BackupError::Config(format!(
                "backup target {name:?} exists already"
            )));
        }
        let t = Target::open(config)?;
        self.rt.block_on(t.check())?;
        let mut targets = lock(&self.targets);
        if targets.len() >= MAX_TARGETS {
            return Err(BackupError::Config(format!(
                "this node has {MAX_TARGETS} backup targets already"
            )));
        }
        if targets.contains_key(&name) {
            return Err(BackupError::Config(format!(
                "backup target {name:?} exists already"
            )));
        }
        targets.insert(name.clone(), t);
        if let Err(e) = self.save_targets(&targets) {
            targets.remove(&name);
            return Err(e);
        }
        tracing::info!(target = name, "backup target added");
        Ok(())
    }

    pub fn target_remove(&self, name: &str) -> Result<(), BackupError> {
        let mut targets = lock(&self.targets);
        let Some(t) = targets.remove(name) else {
            return Err(BackupError::NoSuchTarget(name.to_string()));
        };
        if let Err(e) = self.save_targets(&targets) {
            targets.insert(name.to_string(), t);
            return Err(e);
        }
        tracing::info!(
            target = name,
            "backup target removed (its backups stay where they are)"
        );
        Ok(())
    }

    /// The targets: names, URLs and which files they take secrets from
    /// (never the secrets).
    pub fn target_list(&self) -> Vec<TargetConfig> {
        lock(&self.targets)
            .values()
            .map(|t| t.config.clone())
            .collect()
    }

    pub fn target(&self, name: &str) -> Result<Target, BackupError> {
        lock(&self.targets)
            .get(name)
            .cloned()
            .ok_or_else(|| BackupError::NoSuchTarget(name.to_string()))
    }

    /// The backups on a target, oldest first, of one volume or all.
    pub fn list(
        &self,
        target: &str,
        volume: Option<&str>,
    ) -> Result<Vec<format::Manifest>, BackupError> {
        let t = self.target(target)?;
        let all = self.rt.block_on(catalog::manifests(&t))?;
        Ok(all
            .into_iter()
            .filter(|m| volume.is_none_or(|v| m.volume == v))
            .collect())
    }

    pub fn get(&self, target: &str, id: &str) -> Result<format::Manifest, BackupError> {
        let t = self.target(target)?;
        self.rt.block_on(catalog::manifest(&t, id))
    }

    /// Deletes a backup's manifest, then (with `gc`) every chunk no other
    /// manifest names.
    pub fn delete(
        &self,
        target: &str,
        id: &str,
        gc: bool,
    ) -> Result<Option<catalog::GcStats>, BackupError> {
        let t = self.target(target)?;
        self.rt.block_on(async {
            catalog::manifest(&t, id).await?;
            t.store
                .delete(&t.path(&format::manifest_path(id)))
                .await
                .map_err(|e| t.error(e))?;
            tracing::info!(target = %t.config.name, backup = id, "backup deleted");
            if gc {
                catalog::collect(&t).await.map(Some)
            } else {
                Ok(None)
            }
        })
    }

    /// Collects garbage on a target.
    pub fn gc(&self, target: &str) -> Result<catalog::GcStats, BackupError> {
        let t = self.target(target)?;
        self.rt.block_on(catalog::collect(&t))
    }
}
