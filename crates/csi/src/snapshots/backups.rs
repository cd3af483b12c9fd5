//! Snapshots that are backups: a VolumeSnapshotClass with the parameter
//! `backupTarget: NAME` makes CreateSnapshot take the lull snapshot as any
//! snapshot is taken ([`crate::snapshots`]) and then back it up to the
//! node daemons' backup target NAME (docs/BACKUPS.md); a volume whose
//! content source is such a snapshot is restored from the backup, on any
//! cluster whose nodes have that target, even one that never held the
//! source volume.
//!
//! ```text
//! CreateSnapshot "snapshot-7f3e" of "pvc-1@node-a+node-b", backupTarget "s3"
//!   the lull snapshot "snapshot-7f3e" on every replica (as without the parameter)
//!   backup_create {volume: pvc-1, snapshot: snapshot-7f3e, target: s3, replica: true}
//!     on node-a: its own replica's snapshot read from its files, no engine
//!   -> snapshot id "backup:s3/pvc-1/snapshot-7f3e", ready_to_use once the
//!      backup's manifest is on the target (the CO asks again: ListSnapshots)
//! CreateVolume "pvc-2" from "backup:s3/pvc-1/snapshot-7f3e"
//!   a new, empty volume placed as any (replica_create on node-c, node-d)
//!   backup_restore {backup: bk-..., name: pvc-2, replica: true} on node-c and node-d
//!     each fills its own new replica from the target
//!   -> ABORTED ("restoring") until every replica is filled, then the volume
//! ```
//!
//! The id names the target, the source volume and the snapshot, not the
//! nodes: the backup is found on the target by its manifest's volume and
//! snapshot, so the id means the same on any cluster. The lull snapshot
//! stays on the source's replicas as the base of the next backup's
//! incremental (only the chunks changed since are read); DeleteSnapshot
//! deletes the backup (its chunks collected) and that snapshot.
//!
//! Every node that may hold a replica must have the target
//! (`lull backup target-add` on each node, or the node's
//! `backup-targets.json`): the controller never sees credentials.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tonic::Status;

use crate::controller::ControllerPlugin;
use crate::pb::*;
use crate::snapshot_id::{SnapshotId, MAX_SNAPSHOT_ID_BYTES};
use crate::volume_id::VolumeId;

/// The VolumeSnapshotClass parameter naming the backup target.
pub const PARAM_BACKUP_TARGET: &str = "backupTarget";

/// Prefix of a backup snapshot's id.
pub const BACKUP_SNAPSHOT_PREFIX: &str = "backup:";

/// How long CreateVolume waits for the replicas' restores before it
/// answers ABORTED (the CO calls again): within external-provisioner's
/// default 10 s call timeout, so the answer reaches it.
pub const RESTORE_WAIT: Duration = Duration::from_secs(5);

/// How often a wait asks the nodes how their jobs stand.
const JOB_POLL: Duration = Duration::from_millis(200);

/// A backup snapshot's id: `backup:TARGET/VOLUME/SNAPSHOT`, the lull
/// names of the source volume and its snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupSnapshotId {
    pub target: String,
    pub volume: String,
    pub snapshot: String,
}

impl BackupSnapshotId {
    /// Parses an id; `None` for anything else (a lull snapshot's id
    /// among them).
    pub fn parse(id: &str) -> Option<BackupSnapshotId> {
        if id.len() > MAX_SNAPSHOT_ID_BYTES {
            return None;
        }
        let rest = id.strip_prefix(BACKUP_SNAPSHOT_PREFIX)?;
        let mut parts = rest.split('/');
        let (target, volume, snapshot) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || [target, volume, snapshot].iter().any(|p| !valid_part(p)) {
            return None;
        }
        Some(BackupSnapshotId {
            target: target.into(),
            volume: volume.into(),
            snapshot: snapshot.into(),
        })
    }

    pub fn format(&self) -> String {
        format!(
            "{BACKUP_SNAPSHOT_PREFIX}{}/{}/{}",
            self.target, self.volume, self.snapshot
        )
    }
}

/// A target, volume or snapshot name as lull gives them: 1 to 64 of
/// `A-Z a-z 0-9 . _ -` (what the daemons check again).
fn valid_part(p: &str) -> bool {
    !p.is_empty()
        && p != "."
        && p != ".."
        && p.len() <= 64
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The target a CreateSnapshot's parameters name, if any.
pub(crate) fn target_param(params: &HashMap<String, String>) -> Result<Option<String>, Status> {
    match params.get(PARAM_BACKUP_TARGET) {
        None => Ok(None),
        Some(t) if valid_part(t) => Ok(Some(t.clone())),
        Some(t) => Err(Status::invalid_argument(format!(
            "{PARAM_BACKUP_TARGET} {t:?}: a backup target's name (1 to 64 of A-Z, a-z, 0-9, '.', '_', '-')"
        ))),
    }
}

/// How a backup of a snapshot stands, from the target and the nodes' jobs.
enum Progress {
    /// Its manifest is on the target (`backup_list`'s summary).
    Done(Value),
    /// A node's job is making it.
    Running,
    /// The last job failed (its error) and none runs.
    Failed(String),
    /// Neither on the target nor being made.
    Absent,
}

impl ControllerPlugin {
    /// The backup snapshot a CreateVolume's content source names, if it is one.
    pub(crate) fn backup_source(source: Option<&VolumeContentSource>) -> Option<BackupSnapshotId> {
        match source?.r#type.as_ref()? {
            volume_content_source::Type::Snapshot(s) => BackupSnapshotId::parse(&s.snapshot_id),
            volume_content_source::Type::Volume(_) => None,
        }
    }

    /// Nodes to ask about target work: `first` (the volume's) then the
    /// rest of the node list.
    fn nodes_first(&self, first: &[String]) -> Vec<String> {
        let mut out: Vec<String> = first.to_vec();
        for n in self.cluster.nodes().iter() {
            if !out.contains(&n.id) {
                out.push(n.id.clone());
            }
        }
        out
    }

    /// `backup_list` of the id's volume on its target through the first
    /// node of `nodes` that has the target; the newest backup of the
    /// snapshot, if any.
    async fn find_backup(
        &self,
        id: &BackupSnapshotId,
        nodes: &[String],
    ) -> Result<Option<Value>, Status> {
        let (node, answer) = self
            .first_answer(
                nodes,
                "backup_list",
                json!({"target": id.target, "volume": id.volume}),
            )
            .await
            .map_err(|why| {
                Status::failed_precondition(format!(
                    "no node reads backup target {:?} ({why}): add it on the nodes (lull backup target-add)",
                    id.target
                ))
            })?;
        match answer {
            Value::Array(list) => Ok(list
                .into_iter()
                .filter(|b| b["snapshot"] == id.snapshot.as_str())
                .max_by_key(|b| b["created_unix_ms"].as_u64())),
            other => Err(Status::internal(format!(
                "node {node}: backup_list: unexpected answer {other}"
            ))),
        }
    }

    /// Calls `method` on each of `nodes` in turn until one answers: that
    /// node and its answer, or every node's refusal (each logged).
    async fn first_answer(
        &self,
        nodes: &[String],
        method: &'static str,
        params: Value,
    ) -> Result<(String, Value), String> {
        let mut why = Vec::new();
        for node in nodes {
            match self.cluster.call(node, method, params.clone()).await {
                Ok(v) => return Ok((node.clone(), v)),
                Err(e) => {
                    tracing::debug!(node, method, error = %e, "refused; the next node is asked");
                    why.push(format!("{node}: {e}"));
                }
            }
        }
        Err(why.join("; "))
    }

    /// The newest job of `kind` for (`replica`, `backup or snapshot`) on
    /// `node`, if the node knows one.
    async fn newest_job(
        &self,
        node: &str,
        kind: &str,
        replica: &str,
        matches: impl Fn(&Value) -> bool,
    ) -> Option<Value> {
        let Ok(Value::Array(jobs)) = self.cluster.call(node, "backup_job_list", json!({})).await
        else {
            return None;
        };
        // Finished jobs come first, oldest first, then the running ones.
        jobs.into_iter()
            .filter(|j| {
                j["kind"] == kind && j["volume"] == replica && j["replica"] == true && matches(j)
            })
            .last()
    }

    async fn backup_progress(
        &self,
        id: &BackupSnapshotId,
        nodes: &[String],
    ) -> Result<Progress, Status> {
        if let Some(b) = self.find_backup(id, &self.nodes_first(nodes)).await? {
            return Ok(Progress::Done(b));
        }
        let mut failed = None;
        for node in nodes {
            let job = self
                .newest_job(node, "backup", &id.volume, |j| {
                    j["target"] == id.target.as_str() && j["snapshot"] == id.snapshot.as_str()
                })
                .await;
            match job {
                Some(j) if j["state"] == "running" => return Ok(Progress::Running),
                Some(j) if j["state"] == "failed" => {
                    failed = Some(format!(
                        "node {node}: {}",
                        j["error"].as_str().unwrap_or("?")
                    ))
                }
                _ => {}
            }
        }
        // A job done whose manifest is not listed: deleted since.
        Ok(failed.map_or(Progress::Absent, Progress::Failed))
    }

    /// Starts the backup of snapshot `id` on the first node of its
    /// volume that takes it (each replica holds the snapshot's bytes).
    async fn start_backup(&self, id: &BackupSnapshotId, nodes: &[String]) -> Result<(), Status> {
        let params = json!({"volume": id.volume, "snapshot": id.snapshot,
            "target": id.target, "replica": true});
        match self.first_answer(nodes, "backup_create", params).await {
            Ok((node, v)) => {
                tracing::info!(snapshot = %id.format(), node, backup = %v["id"], "backup started");
                Ok(())
            }
            Err(why) => {
                tracing::warn!(snapshot = %id.format(), %why, "no node started the backup");
                Err(Status::unavailable(format!(
                    "no node of volume {} started the backup of snapshot {} to {:?}: {why}",
                    id.volume, id.snapshot, id.target
                )))
            }
        }
    }

    /// The CSI snapshot of a backup snapshot, starting its backup when
    /// none is on the target or being made (`nodes`: the volume's, where
    /// the lull snapshot is). A failed attempt is answered as an error
    /// naming it, and a new one started: the CO's retry sees its progress.
    async fn ensure_backup(
        &self,
        id: &BackupSnapshotId,
        source_volume_id: &str,
        nodes: &[String],
        size_bytes: u64,
        created_unix: u64,
    ) -> Result<Snapshot, Status> {
        let snapshot = |ready: bool, size_bytes: u64, created_unix: u64| Snapshot {
            size_bytes: size_bytes as i64,
            snapshot_id: id.format(),
            source_volume_id: source_volume_id.to_string(),
            creation_time: Some(prost_types::Timestamp {
                seconds: created_unix as i64,
                nanos: 0,
            }),
            ready_to_use: ready,
            ..Default::default()
        };
        match self.backup_progress(id, nodes).await? {
            Progress::Done(b) => Ok(snapshot(
                true,
                b["size_bytes"].as_u64().unwrap_or(size_bytes),
                b["created_unix_ms"]
                    .as_u64()
                    .map_or(created_unix, |ms| ms / 1000),
            )),
            Progress::Running => Ok(snapshot(false, size_bytes, created_unix)),
            Progress::Absent if nodes.is_empty() => Err(Status::not_found(format!(
                "no backup {} on target {:?}",
                id.format(),
                id.target
            ))),
            Progress::Absent => {
                self.start_backup(id, nodes).await?;
                Ok(snapshot(false, size_bytes, created_unix))
            }
            Progress::Failed(e) if nodes.is_empty() => Err(Status::internal(format!(
                "the backup of {} failed ({e}), and no node holds its volume to retry",
                id.format()
            ))),
            Progress::Failed(e) => {
                self.start_backup(id, nodes).await?;
                Err(Status::unavailable(format!(
                    "the backup of {} failed ({e}); a new attempt was started",
                    id.format()
                )))
            }
        }
    }

    /// CreateSnapshot's backup step: snapshot `local` was taken (or found)
    /// on every replica; its backup to `target` is started or looked up.
    pub(crate) async fn backup_snapshot(
        &self,
        local: &SnapshotId,
        target: &str,
        taken: Snapshot,
    ) -> Result<Snapshot, Status> {
        let id = BackupSnapshotId {
            target: target.to_string(),
            volume: local.volume.name.clone(),
            snapshot: local.name.clone(),
        };
        if id.format().len() > MAX_SNAPSHOT_ID_BYTES {
            return Err(Status::invalid_argument(format!(
                "backup snapshot id {:?} would be {} bytes, over the CSI limit of {MAX_SNAPSHOT_ID_BYTES} (a shorter target name makes room)",
                id.format(),
                id.format().len()
            )));
        }
        let created = taken.creation_time.as_ref().map_or(0, |t| t.seconds as u64);
        self.ensure_backup(
            &id,
            &taken.source_volume_id,
            &local.volume.nodes,
            taken.size_bytes as u64,
            created,
        )
        .await
    }

    /// Refuses a target no node of the volume reads (the backup runs on
    /// one of them).
    pub(crate) async fn check_backup_target(
        &self,
        target: &str,
        local: &SnapshotId,
    ) -> Result<(), Status> {
        let id = BackupSnapshotId {
            target: target.to_string(),
            volume: local.volume.name.clone(),
            snapshot: local.name.clone(),
        };
        self.find_backup(&id, &local.volume.nodes).await.map(|_| ())
    }

    /// The nodes whose stores hold replica `volume` with snapshot
    /// `snapshot` (this cluster's copy of a backup snapshot's source).
    async fn holders(&self, volume: &str, snapshot: &str) -> Result<Vec<String>, Status> {
        let mut out = Vec::new();
        for (node, store) in self.cluster.stores().await {
            let store = store.map_err(|e| e.status())?;
            if store
                .replica(volume)
                .is_some_and(|r| r.snapshot(snapshot).is_some())
            {
                out.push(node);
            }
        }
        Ok(out)
    }

    /// ListSnapshots and GetSnapshot of a backup snapshot id: the backup
    /// as it stands (none: NOT_FOUND is an empty list to the caller).
    pub(crate) async fn backup_snapshot_get(
        &self,
        id: &BackupSnapshotId,
    ) -> Result<Option<Snapshot>, Status> {
        let nodes = self.holders(&id.volume, &id.snapshot).await?;
        let source = if nodes.is_empty() {
            id.volume.clone()
        } else {
            VolumeId {
                name: id.volume.clone(),
                nodes: nodes.clone(),
            }
            .format()
        };
        match self.ensure_backup(id, &source, &nodes, 0, 0).await {
            Ok(s) => Ok(Some(s)),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(s),
        }
    }

    /// DeleteSnapshot of a backup snapshot id: the lull snapshot on this
    /// cluster's replicas of its volume, if there, then its backups on the
    /// target (chunks no other backup names collected). The snapshot goes
    /// first: a ListSnapshots between the two steps, which starts a backup
    /// again when none is on the target, then finds nothing to back up.
    pub(crate) async fn backup_snapshot_delete(&self, id: &BackupSnapshotId) -> Result<(), Status> {
        let nodes = self.holders(&id.volume, &id.snapshot).await?;
        if matches!(
            self.backup_progress(id, &nodes).await,
            Ok(Progress::Running)
        ) {
            return Err(Status::aborted(format!(
                "the backup of {} is being made; delete it once it is done",
                id.format()
            )));
        }
        let all = self.nodes_first(&nodes);
        if !nodes.is_empty() {
            let local = SnapshotId {
                volume: VolumeId {
                    name: id.volume.clone(),
                    nodes,
                },
                name: id.snapshot.clone(),
            };
            Box::pin(self.delete_snapshot_op(DeleteSnapshotRequest {
                snapshot_id: local.format(),
                ..Default::default()
            }))
            .await?;
        }
        while let Some(b) = self.find_backup(id, &all).await? {
            let bid = b["id"].as_str().unwrap_or_default().to_string();
            let params = json!({"target": id.target, "id": bid, "gc": true});
            match self.first_answer(&all, "backup_delete", params).await {
                Ok((node, _)) => {
                    tracing::info!(snapshot = %id.format(), backup = bid, node, "backup deleted")
                }
                Err(why) => {
                    tracing::warn!(snapshot = %id.format(), backup = bid, %why, "backup_delete refused");
                    return Err(Status::unavailable(format!(
                        "backup {bid} of {} could not be deleted: {why}",
                        id.format()
                    )));
                }
            }
        }
        Ok(())
    }

    /// CreateVolume from a backup snapshot, once volume `id` exists (new
    /// replicas, never attached): each node fills its replica from the
    /// backup; answered once all are full, ABORTED while they fill (the
    /// CO calls again, and finds the jobs).
    pub(crate) async fn restore_backup(
        &self,
        source: &BackupSnapshotId,
        backup: &str,
        id: &VolumeId,
    ) -> Result<(), Status> {
        let deadline = Instant::now() + RESTORE_WAIT;
        loop {
            let mut pending = Vec::new();
            for node in &id.nodes {
                let job = self
                    .newest_job(node, "restore", &id.name, |j| j["backup"] == backup)
                    .await;
                match job {
                    Some(j) if j["state"] == "done" => {}
                    Some(j) if j["state"] == "running" => pending.push(format!(
                        "{node}: {} of {} bytes",
                        j["done_bytes"], j["total_bytes"]
                    )),
                    other => {
                        if let Some(j) = other {
                            tracing::warn!(volume = %id.name, node, error = %j["error"], "a restore failed; starting it again");
                        }
                        self.cluster
                            .call(
                                node,
                                "backup_restore",
                                json!({"target": source.target, "backup": backup,
                                    "name": id.name, "replica": true}),
                            )
                            .await
                            .map_err(|e| {
                                Status::unavailable(format!(
                                    "node {node}: restore of backup {backup} ({}) into {}: {e}",
                                    source.format(),
                                    id.name
                                ))
                            })?;
                        pending.push(format!("{node}: started"));
                    }
                }
            }
            if pending.is_empty() {
                tracing::info!(volume = %id.format(), backup, "volume restored from a backup");
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Status::aborted(format!(
                    "volume {} is being restored from backup {backup} ({}): {}; the retry answers once it is done",
                    id.name,
                    source.format(),
                    pending.join(", ")
                )));
            }
            tokio::time::sleep(JOB_POLL).await;
        }
    }

    /// CreateVolume from a backup snapshot: a new volume of at least the
    /// backup's size, placed as any new volume (the source's nodes play
    /// no part: this cluster may never have held it), then filled from
    /// the backup ([`ControllerPlugin::restore_backup`]).
    pub(crate) async fn create_from_backup(
        &self,
        req: CreateVolumeRequest,
        source: BackupSnapshotId,
    ) -> Result<CreateVolumeResponse, Status> {
        let b = self.backup_of(&source).await?;
        let backup = b["id"].as_str().unwrap_or_default().to_string();
        let size_bytes = b["size_bytes"].as_u64().unwrap_or(0);
        let (required, limit) = req
            .capacity_range
            .as_ref()
            .map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
        if limit > 0 && (limit as u64) < size_bytes {
            return Err(Status::out_of_range(format!(
                "backup {backup} ({}) holds {size_bytes} bytes, past the limit of {limit}",
                source.format()
            )));
        }
        let blank = CreateVolumeRequest {
            capacity_range: Some(CapacityRange {
                required_bytes: required.max(size_bytes as i64),
                limit_bytes: limit,
            }),
            volume_content_source: None,
            ..req.clone()
        };
        let mut made = Box::pin(self.create(blank)).await?;
        let volume = made
            .volume
            .as_mut()
            .ok_or_else(|| Status::internal("CreateVolume answered no volume"))?;
        let id = VolumeId::parse(&volume.volume_id).ok_or_else(|| {
            Status::internal(format!(
                "a volume id of its own not parsed: {}",
                volume.volume_id
            ))
        })?;
        self.restore_backup(&source, &backup, &id).await?;
        volume.content_source = req.volume_content_source;
        Ok(made)
    }

    /// The backup a backup snapshot id names, for CreateVolume: its
    /// manifest's summary (id, size).
    pub(crate) async fn backup_of(&self, source: &BackupSnapshotId) -> Result<Value, Status> {
        self.find_backup(source, &self.nodes_first(&[]))
            .await?
            .ok_or_else(|| {
                Status::not_found(format!(
                    "no backup of snapshot {} of volume {} on target {:?}",
                    source.snapshot, source.volume, source.target
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_refuse_what_is_not_one() {
        let id = BackupSnapshotId {
            target: "s3".into(),
            volume: "pvc-1".into(),
            snapshot: "snapshot-7f3e".into(),
        };
        assert_eq!(id.format(), "backup:s3/pvc-1/snapshot-7f3e");
        assert_eq!(BackupSnapshotId::parse(&id.format()), Some(id));
        for bad in [
            "pvc-1@node-a/snap",
            "backup:s3/pvc-1",
            "backup:s3/pvc-1/snap/x",
            "backup:/pvc-1/snap",
            "backup:s3/pvc 1/snap",
            "backup:s3/../snap",
        ] {
            assert_eq!(BackupSnapshotId::parse(bad), None, "{bad}");
        }
        let long = format!("backup:s3/pvc-1/{}", "a".repeat(MAX_SNAPSHOT_ID_BYTES));
        assert_eq!(BackupSnapshotId::parse(&long), None);
    }

    #[test]
    fn the_target_parameter_is_a_target_name() {
        let p = |v: &str| HashMap::from([(PARAM_BACKUP_TARGET.to_string(), v.to_string())]);
        assert_eq!(target_param(&HashMap::new()).unwrap(), None);
        assert_eq!(target_param(&p("s3")).unwrap(), Some("s3".into()));
        assert!(target_param(&p("")).is_err());
        assert!(target_param(&p("a/b")).is_err());
    }
}
