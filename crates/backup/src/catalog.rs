//! What a target lists: manifests, chunks, locks. Every read of a
//! manifest is checked ([`Manifest::check`]) before it is used.

use std::collections::BTreeSet;

use futures::StreamExt;
use object_store::{ObjectStoreExt, PutPayload};
use serde::{Deserialize, Serialize};

use crate::format::{self, Manifest};
use crate::target::Target;
use crate::BackupError;

/// A lock not refreshed for this long belongs to a job that is gone (its
/// process killed, its node cut off): collections go ahead despite it.
/// Ten refreshes missed.
pub const LOCK_STALE_MS: u64 = 10 * 60 * 1000;

/// How often a running backup refreshes its lock.
pub const LOCK_REFRESH: std::time::Duration = std::time::Duration::from_secs(60);

/// Objects a collection deletes at once.
pub const GC_DELETES_IN_FLIGHT: usize = 16;

pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Every manifest on the target (checked), oldest first. A manifest that
/// does not parse is skipped with a warning, never trusted; one deleted
/// between the listing and its read (a schedule's retention, another
/// node's `backup_delete`) is not there any more, and is left out.
pub async fn manifests(t: &Target) -> Result<Vec<Manifest>, BackupError> {
    let mut ids = Vec::new();
    let prefix = t.path(format::MANIFEST_DIR);
    let mut list = t.store.list(Some(&prefix));
    while let Some(meta) = list.next().await {
        let meta = meta.map_err(|e| t.error(e))?;
        let name = meta.location.filename().unwrap_or_default();
        if let Some(id) = name.strip_suffix(".json") {
            if format::valid_backup_id(id) {
                ids.push(id.to_string());
            }
        }
    }
    ids.sort();
    let mut out = Vec::with_capacity(ids.len());
    for id in ids {
        match manifest(t, &id).await {
            Ok(m) => out.push(m),
            Err(BackupError::NoSuchBackup(_)) => {
                tracing::debug!(target = %t.config.name, backup = id, "manifest deleted since the listing");
            }
            Err(e @ BackupError::Corrupt(_)) => {
                tracing::warn!(target = %t.config.name, backup = id, error = %e, "manifest skipped")
            }
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// One manifest, checked.
pub async fn manifest(t: &Target, id: &str) -> Result<Manifest, BackupError> {
    if !format::valid_backup_id(id) {
        return Err(BackupError::NoSuchBackup(id.to_string()));
    }
    let r = match t.store.get(&t.path(&format::manifest_path(id))).await {
        Ok(r) => r,
        Err(object_store::Error::NotFound { .. }) => {
            return Err(BackupError::NoSuchBackup(id.to_string()))
        }
        Err(e) => return Err(t.error(e)),
    };
    if r.meta.size > format::MAX_MANIFEST_BYTES {
        return Err(BackupError::Corrupt(format!(
            "manifest {id}: {} bytes",
            r.meta.size
        )));
    }
    let bytes = r.bytes().await.map_err(|e| t.error(e))?;
    let m: Manifest = serde_json::from_slice(&bytes)
        .map_err(|e| BackupError::Corrupt(format!("manifest {id}: {e}")))?;
    if m.id != id {
        return Err(BackupError::Corrupt(format!(
            "manifest {id} names itself {}",
            m.id
        )));
    }
    m.check()?;
    Ok(m)
}

/// Writes a manifest: one PUT, which object stores and the directory
/// target (a rename) make atomic, so it is there whole or not at all.
pub async fn put_manifest(t: &Target, m: &Manifest) -> Result<(), BackupError> {
    let body = serde_json::to_vec(m).expect("manifest serializes");
    t.store
        .put(
            &t.path(&format::manifest_path(&m.id)),
            PutPayload::from(body),
        )
        .await
        .map_err(|e| t.error(e))?;
    Ok(())
}

/// A job's lock on a target: backups and collections exclude each other
/// with them (a collection would otherwise delete a chunk a running
/// backup found present and counts on).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Lock {
    pub id: String,
    /// `backup` or `gc`.
    pub kind: String,
    pub host: String,
    pub pid: u32,
    pub refreshed_unix_ms: u64,
}

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

impl Lock {
    pub fn new(id: &str, kind: &str) -> Lock {
        Lock {
            id: id.to_string(),
            kind: kind.to_string(),
            host: host(),
            pid: std::process::id(),
            refreshed_unix_ms: now_unix_ms(),
        }
    }

    /// A lock whose job is gone: not refreshed within [`LOCK_STALE_MS`],
    /// or taken on this host by a process that no longer runs (a killed
    /// daemon's, seen at once after its restart).
    pub fn stale(&self, now_ms: u64) -> bool {
        if now_ms.saturating_sub(self.refreshed_unix_ms) > LOCK_STALE_MS {
            return true;
        }
        self.host == host()
            && self.pid != std::process::id()
            && !std::path::Path::new(&format!("/proc/{}", self.pid)).exists()
    }
}

fn lock_path(t: &Target, id: &str) -> object_store::path::Path {
    t.path(&format!("{}/{id}.json", format::LOCK_DIR))
}

pub async fn put_lock(t: &Target, lock: &Lock) -> Result<(), BackupError> {
    let body = serde_json::to_vec(lock).expect("lock serializes");
    t.store
        .put(&lock_path(t, &lock.id), PutPayload::from(body))
        .await
        .map_err(|e| t.error(e))?;
    Ok(())
}

pub async fn drop_lock(t: &Target, id: &str) {
    match t.store.delete(&lock_path(t, id)).await {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
        Err(e) => {
            tracing::warn!(target = %t.config.name, lock = id, error = %e, "lock not removed (it goes stale)")
        }
    }
}

/// The live locks on the target other than `except`.
pub async fn live_locks(t: &Target, except: &str) -> Result<Vec<Lock>, BackupError> {
    let mut out = Vec::new();
    let now = now_unix_ms();
    let mut list = t.store.list(Some(&t.path(format::LOCK_DIR)));
    while let Some(meta) = list.next().await {
        let meta = meta.map_err(|e| t.error(e))?;
        let bytes = match t.store.get(&meta.location).await {
            Ok(r) => r.bytes().await.map_err(|e| t.error(e))?,
            Err(object_store::Error::NotFound { .. }) => continue,
            Err(e) => return Err(t.error(e)),
        };
        match serde_json::from_slice::<Lock>(&bytes) {
            Ok(l) if l.id != except && !l.stale(now) => out.push(l),
            Ok(_) => {}
            Err(e) => tracing::warn!(lock = %meta.location, error = %e, "unreadable lock ignored"),
        }
    }
    Ok(out)
}

/// What a collection did.
#[derive(Serialize, Debug, Default, Clone, PartialEq, Eq)]
pub struct GcStats {
    pub chunks_kept: u64,
    pub chunks_deleted: u64,
    pub bytes_freed: u64,
    pub stale_locks_removed: u64,
}

/// Deletes every chunk no manifest names, under a `gc` lock; refused
/// while a backup runs on the target (from any node).
pub async fn collect(t: &Target) -> Result<GcStats, BackupError> {
    let lock = Lock::new(
        &format::new_backup_id(now_unix_ms()).replacen("bk-", "gc-", 1),
        "gc",
    );
    put_lock(t, &lock).await?;
    let result = collect_locked(t, &lock).await;
    drop_lock(t, &lock.id).await;
    result
}

async fn collect_locked(t: &Target, lock: &Lock) -> Result<GcStats, BackupError> {
    let others = live_locks(t, &lock.id).await?;
    if let Some(o) = others.first() {
        return Err(BackupError::Busy(format!(
            "target {}: a {} runs ({} on {}, pid {}); collect garbage when it is done",
            t.config.name, o.kind, o.id, o.host, o.pid
        )));
    }
    let mut referenced = BTreeSet::new();
    for m in manifests(t).await? {
        referenced.extend(m.stored_objects().map(str::to_string));
    }
    let mut stats = GcStats::default();
    let mut doomed = Vec::new();
    let mut list = t.store.list(Some(&t.path(format::CHUNK_DIR)));
    while let Some(meta) = list.next().await {
        let meta = meta.map_err(|e| t.error(e))?;
        let name = meta.location.filename().unwrap_or_default().to_string();
        if referenced.contains(&name) {
            stats.chunks_kept += 1;
        } else {
            stats.bytes_freed += meta.size;
            doomed.push(meta.location);
        }
    }
    let results: Vec<_> = futures::stream::iter(doomed)
        .map(|p| async move { t.store.delete(&p).await })
        .buffer_unordered(GC_DELETES_IN_FLIGHT)
        .collect()
        .await;
    for r in results {
        match r {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => stats.chunks_deleted += 1,
            Err(e) => return Err(t.error(e)),
        }
    }
    // Stale locks (killed jobs) go too.
    let now = now_unix_ms();
    let mut list = t.store.list(Some(&t.path(format::LOCK_DIR)));
    let mut stale = Vec::new();
    while let Some(meta) = list.next().await {
        let meta = meta.map_err(|e| t.error(e))?;
        if let Ok(r) = t.store.get(&meta.location).await {
            if let Ok(b) = r.bytes().await {
                if serde_json::from_slice::<Lock>(&b).is_ok_and(|l| l.id != lock.id && l.stale(now))
                {
                    stale.push(meta.location);
                }
            }
        }
    }
    for p in stale {
        if t.store.delete(&p).await.is_ok() {
            stats.stale_locks_removed += 1;
        }
    }
    tracing::info!(target = %t.config.name, kept = stats.chunks_kept, deleted = stats.chunks_deleted,
        bytes_freed = stats.bytes_freed, "garbage collected");
    Ok(stats)
}
