//! Standby volumes (Longhorn's disaster-recovery volumes): a volume
//! restored from a source volume's newest backup on a target, that
//! follows the source's backups as they appear (each new one applied as
//! the chunks that differ from the last applied), read-only until it is
//! activated; activation applies the newest complete backup and makes it
//! writable.
//!
//! ```text
//! lull rpc backup_standby_create '{"name": "vol0-dr", "target": "s3", "volume": "vol0"}'
//! lull rpc backup_standby_activate '{"name": "vol0-dr"}'   # writable at the last complete backup
//! ```
//!
//! While a backup is being applied a reader may see blocks of both the
//! backup before and the one being applied; between applies the volume
//! holds exactly the last applied backup.

use std::sync::Arc;

use lull_bdev::{BdevError, BlockDevice, Channel, IoCompletion, IoOp, IoRequest};
use serde::{Deserialize, Serialize};

use crate::catalog::{self, now_unix_ms};
use crate::chunks::fetch_chunk;
use crate::devio::DevIo;
use crate::format::Manifest;
use crate::job::{storage_dev, JobState, RestoreRequest};
use crate::{lock, BackupError, Backups};

/// The file under the node's state directory that records standbys.
pub const STANDBY_FILE: &str = "backup-standbys.json";

/// How often a standby looks for a new backup of its source, unless
/// given: Longhorn's DR volumes poll their backup target every 5 min by
/// default; 10 s keeps a standby close behind frequent backups, and one
/// LIST of manifests every 10 s is cheap for any object store.
pub const DEFAULT_STANDBY_POLL_SECS: u64 = 10;

/// Standbys per node.
pub const MAX_STANDBYS: usize = 64;

/// A standby as recorded.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Standby {
    pub name: String,
    pub target: String,
    /// The source volume whose backups it follows.
    pub volume: String,
    pub poll_secs: u64,
    /// The backup it holds; `None` while its first restore runs.
    pub applied: Option<String>,
    #[serde(default)]
    pub checked_unix_ms: u64,
}

/// What the registry serves for a standby: its volume's device, read-only.
pub(crate) struct ReadOnlyDev(pub(crate) Arc<dyn BlockDevice>);

impl BlockDevice for ReadOnlyDev {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn describe(&self) -> String {
        format!("standby (read-only) of {}", self.0.describe())
    }
    fn read_only(&self) -> bool {
        true
    }
    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        Ok(Box::new(ReadOnlyChannel(self.0.open_channel()?)))
    }
    fn extents(
        &self,
        offset: u64,
        len: u64,
        max: usize,
    ) -> Result<Vec<lull_bdev::Extent>, BdevError> {
        self.0.extents(offset, len, max)
    }
    fn extents_by_channel(&self) -> bool {
        self.0.extents_by_channel()
    }
}

struct ReadOnlyChannel(Box<dyn Channel>);

impl Channel for ReadOnlyChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        match req.op {
            IoOp::Write { .. } | IoOp::Trim | IoOp::WriteZeroes { .. } => {
                Err((req, BdevError::ReadOnly))
            }
            _ => self.0.submit(req),
        }
    }
    fn flush_submissions(&mut self) {
        self.0.flush_submissions()
    }
    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        self.0.reap(done)
    }
    fn event_fd(&self) -> Option<std::os::fd::RawFd> {
        self.0.event_fd()
    }
    fn in_flight(&self) -> usize {
        self.0.in_flight()
    }
    fn polled(&self) -> bool {
        self.0.polled()
    }
}

impl Backups {
    pub(crate) fn load_standbys(&self) -> Result<(), BackupError> {
        let list: Vec<Standby> = self.read_state(STANDBY_FILE)?;
        for s in list {
            // The volume came back from the node's state, writable: it is
            // a standby again.
            if s.applied.is_some() {
                if let Err(e) = self.make_read_only(&s.name) {
                    tracing::error!(volume = s.name, error = %e, "standby volume not found at start");
                }
            }
            lock(&self.standbys).insert(s.name.clone(), s);
        }
        Ok(())
    }

    fn save_standbys(&self) -> Result<(), BackupError> {
        let list: Vec<Standby> = lock(&self.standbys).values().cloned().collect();
        self.write_state(
            STANDBY_FILE,
            &serde_json::to_vec_pretty(&list).expect("standbys serialize"),
        )
    }

    /// Swaps the registry's volume `name` for its read-only view.
    fn make_read_only(&self, name: &str) -> Result<(), BackupError> {
        let v = self
            .volumes
            .named(name)
            .map_err(|e| BackupError::Volume(e.to_string()))?;
        if v.dev().read_only() {
            return Ok(());
        }
        let inner = storage_dev(&v.storage);
        lock(&self.standby_devs).insert(name.to_string(), v.storage.clone());
        self.volumes
            .remove(name)
            .map_err(|e| BackupError::Volume(e.to_string()))?;
        self.volumes
            .add(lull_volume::Volume::new(
                name,
                lull_volume::Storage::Local(Arc::new(ReadOnlyDev(inner))),
            ))
            .map_err(|e| BackupError::Volume(e.to_string()))?;
        Ok(())
    }

    /// Starts a standby of `volume`'s backups on `target`: restored now
    /// from the newest, read-only once restored, following new backups.
    pub fn standby_create(
        self: &Arc<Self>,
        name: &str,
        target: &str,
        volume: &str,
        backend: &str,
        poll_secs: Option<u64>,
    ) -> Result<Standby, BackupError> {
        let t = self.target(target)?;
        if lock(&self.standbys).len() >= MAX_STANDBYS {
            return Err(BackupError::Config(format!(
                "this node has {MAX_STANDBYS} standbys already"
            )));
        }
        let newest = self.newest(&t, volume)?.ok_or_else(|| {
            BackupError::NoSuchBackup(format!("of volume {volume:?} on target {target}"))
        })?;
        let poll_secs = poll_secs
            .unwrap_or(DEFAULT_STANDBY_POLL_SECS)
            .clamp(1, 24 * 3600);
        let job = self.restore(RestoreRequest {
            target: target.to_string(),
            backup: newest.id.clone(),
            name: name.to_string(),
            backend: backend.to_string(),
            persist: true,
            replica: false,
        })?;
        let s = Standby {
            name: name.to_string(),
            target: target.to_string(),
            volume: volume.to_string(),
            poll_secs,
            applied: None,
            checked_unix_ms: now_unix_ms(),
        };
        lock(&self.standbys).insert(name.to_string(), s.clone());
        let me = Arc::downgrade(self);
        let (name, id) = (name.to_string(), newest.id.clone());
        std::thread::Builder::new()
            .name("lull-standby".into())
            .spawn(move || {
                let Some(b) = me.upgrade() else { return };
                let j = b.wait_job(&job.id, crate::rpc::MAX_WAIT);
                let done = j.is_some_and(|j| matches!(j.state, JobState::Done));
                if !done {
                    tracing::warn!(volume = name, "standby's first restore failed: no standby");
                    lock(&b.standbys).remove(&name);
                    return;
                }
                if let Some(s) = lock(&b.standbys).get_mut(&name) {
                    s.applied = Some(id);
                }
                if let Err(e) = b.make_read_only(&name).and_then(|()| b.save_standbys()) {
                    tracing::error!(volume = name, error = %e, "standby not set up");
                }
            })
            .map_err(|e| BackupError::Failed(format!("standby thread: {e}")))?;
        Ok(s)
    }

    fn newest(
        &self,
        t: &crate::target::Target,
        volume: &str,
    ) -> Result<Option<Manifest>, BackupError> {
        let all = self.rt.block_on(catalog::manifests(t))?;
        Ok(all
            .into_iter()
            .filter(|m| m.volume == volume)
            .max_by_key(|m| m.created_unix_ms))
    }

    pub fn standby_list(&self) -> Vec<Standby> {
        lock(&self.standbys).values().cloned().collect()
    }

    /// Applies the source's newest backup if it is not the one applied.
    /// Returns the backup the standby holds after.
    fn catch_up(&self, name: &str) -> Result<Option<String>, BackupError> {
        let Some(s) = lock(&self.standbys).get(name).cloned() else {
            return Err(BackupError::Volume(format!("no standby {name:?}")));
        };
        let Some(applied) = s.applied.clone() else {
            return Ok(None); // the first restore still runs
        };
        let t = self.target(&s.target)?;
        let Some(newest) = self.newest(&t, &s.volume)? else {
            return Ok(Some(applied));
        };
        if newest.id == applied {
            return Ok(Some(applied));
        }
        let old = self.rt.block_on(catalog::manifest(&t, &applied)).ok();
        let storage = lock(&self.standby_devs)
            .get(name)
            .cloned()
            .ok_or_else(|| BackupError::Volume(format!("standby {name:?} has no volume")))?;
        let dev = storage_dev(&storage);
        if newest.size_bytes > dev.size_bytes() {
            dev.grow(newest.size_bytes)
                .map_err(|e| BackupError::Volume(format!("standby {name:?}: grow: {e}")))?;
        }
        let mut io = DevIo::open(dev)?;
        let mut written = 0u64;
        for (i, c) in newest.chunks.iter().enumerate() {
            let before = old
                .as_ref()
                .and_then(|o| o.chunks.get(i).cloned().flatten());
            if old.as_ref().is_some_and(|o| i < o.chunks.len()) && before == *c {
                continue;
            }
            let (off, len) = newest.chunk_range(i);
            match self.rt.block_on(fetch_chunk(&t, &newest, i))? {
                Some(data) => io.write(off, &data)?,
                None => io.zero(off, len)?,
            }
            written += len;
        }
        io.flush()?;
        if let Some(s) = lock(&self.standbys).get_mut(name) {
            s.applied = Some(newest.id.clone());
            s.checked_unix_ms = now_unix_ms();
        }
        self.save_standbys()?;
        tracing::info!(
            volume = name,
            backup = newest.id,
            bytes = written,
            "standby caught up"
        );
        Ok(Some(newest.id))
    }

    /// Every standby due a look (called by the schedule thread).
    pub(crate) fn follow_standbys(&self) {
        let now = now_unix_ms();
        let due: Vec<String> = lock(&self.standbys)
            .values()
            .filter(|s| s.applied.is_some() && now >= s.checked_unix_ms + s.poll_secs * 1000)
            .map(|s| s.name.clone())
            .collect();
        for name in due {
            if let Some(s) = lock(&self.standbys).get_mut(&name) {
                s.checked_unix_ms = now;
            }
            // Not while it is being activated (nor after: it is gone then).
            let _one = lock(&self.standby_activation);
            if !lock(&self.standbys).contains_key(&name) {
                continue;
            }
            if let Err(e) = self.catch_up(&name) {
                tracing::warn!(volume = name, error = %e, "standby did not catch up; next look later");
            }
        }
    }

    /// Activates a standby: the newest complete backup applied, then the
    /// volume writable and no longer following. Returns the backup it
    /// holds.
    pub fn standby_activate(&self, name: &str) -> Result<String, BackupError> {
        let _one = lock(&self.standby_activation);
        let Some(applied) = self.catch_up(name)? else {
            return Err(BackupError::Busy(format!(
                "standby {name:?} is still being restored; activate it when it is done"
            )));
        };
        let storage = lock(&self.standby_devs)
            .remove(name)
            .ok_or_else(|| BackupError::Volume(format!("standby {name:?} has no volume")))?;
        self.volumes
            .remove(name)
            .map_err(|e| BackupError::Volume(e.to_string()))?;
        self.volumes
            .add(lull_volume::Volume::new(name, storage))
            .map_err(|e| BackupError::Volume(e.to_string()))?;
        lock(&self.standbys).remove(name);
        self.save_standbys()?;
        tracing::info!(
            volume = name,
            backup = applied,
            "standby activated: writable"
        );
        Ok(applied)
    }
}
