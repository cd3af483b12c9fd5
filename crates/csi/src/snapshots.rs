//! The Controller's snapshots and clones, stateless as its volumes: a
//! snapshot id names the source volume's placement and the snapshot
//! ([`crate::snapshot_id`]); what exists is asked of the node daemons.
//!
//! ```text
//! CreateSnapshot "snap-1" of "pvc-1@node-a+node-b"
//!   staged on node-b:  snapshot_create {pvc-1, snap-1} on node-b's engine
//!                      (every replica at once, writes held)
//!   staged nowhere:    replica_get on node-a and node-b: clean, one generation
//!                      replica_snapshot {pvc-1, snap-1, create} on each
//!                      replica_get again: the same generation, still clean
//!   -> snapshot id "pvc-1@node-a+node-b/snap-1"
//! CreateVolume "pvc-2" from that snapshot
//!   replica_clone {pvc-2, "pvc-1@snap-1"} on node-a and node-b
//!   -> volume id "pvc-2@node-a+node-b" (its replicas share the snapshot's files)
//! ```
//!
//! # Layout
//!
//! - `backups`: snapshots that are backups (the `backupTarget` parameter)
//!   and volumes restored from them.

pub(crate) mod backups;

use std::collections::{BTreeMap, HashMap};

use serde_json::json;
use tonic::Status;

use crate::cluster::{CallError, StoreReplica};
use crate::controller::{ControllerPlugin, CO_PARAM_PREFIX, MAX_LIST_ENTRIES};
use crate::pb::*;
use crate::snapshot_id::{
    clone_snapshot_name, lull_snapshot_name, SnapshotId, CLONE_SNAPSHOT_PREFIX,
    MAX_SNAPSHOT_ID_BYTES,
};
use crate::volume_id::VolumeId;
use backups::BackupSnapshotId;

/// How a volume's replicas are reached for a snapshot operation.
#[derive(Debug)]
enum Route {
    /// The node running the volume's engine (where it is staged).
    Engine(String),
    /// No engine: each replica's store.
    Stores,
}

/// Each node of a volume id with its replica (`None`: the node answered
/// that it holds none).
type Replicas = Vec<(String, Option<StoreReplica>)>;

impl ControllerPlugin {
    /// The nodes running an engine of volume `name`: those whose
    /// `replica_list` of it answers.
    pub(crate) async fn engine_nodes(&self, name: &str) -> Vec<String> {
        futures::future::join_all(self.cluster.nodes().iter().map(|n| async move {
            self.cluster
                .call(&n.id, "replica_list", json!({ "volume": name }))
                .await
                .ok()
                .map(|_| n.id.clone())
        }))
        .await
        .into_iter()
        .flatten()
        .collect()
    }

    /// `replica_get` of the volume on each node of its id. A node that
    /// does not answer is UNAVAILABLE: every replica counts here.
    async fn replicas_of(&self, id: &VolumeId) -> Result<Replicas, Status> {
        let answers = futures::future::join_all(id.nodes.iter().map(|node| async move {
            let r = self
                .cluster
                .call(node, "replica_get", json!({ "name": id.name }))
                .await;
            (node.clone(), r)
        }))
        .await;
        let mut out = Vec::with_capacity(answers.len());
        for (node, r) in answers {
            match r {
                Ok(v) => {
                    let replica = serde_json::from_value::<StoreReplica>(v).map_err(|e| {
                        Status::internal(format!(
                            "node {node:?}: replica_get: unexpected answer: {e}"
                        ))
                    })?;
                    out.push((node, Some(replica)));
                }
                Err(e) if is_no_replica(&e) => out.push((node, None)),
                Err(e) => return Err(e.status()),
            }
        }
        Ok(out)
    }

    /// Where a snapshot operation on the volume goes.
    async fn route(&self, id: &VolumeId, replicas: &Replicas) -> Result<Route, Status> {
        let engines = self.engine_nodes(&id.name).await;
        match engines.as_slice() {
            [node] => Ok(Route::Engine(node.clone())),
            [] if replicas
                .iter()
                .any(|(_, r)| r.as_ref().is_some_and(|r| r.held_by_session.is_some())) =>
            {
                Err(Status::unavailable(format!(
                    "volume {}: a replica is held by an engine, and no node of the list answers as running it; retry once its node answers",
                    id.name
                )))
            }
            [] => Ok(Route::Stores),
            _ => Err(Status::failed_precondition(format!(
                "volume {}: engines on several nodes ({}); unstage it where it is not used",
                id.name,
                engines.join(", ")
            ))),
        }
    }

    /// CreateSnapshot.
    pub(crate) async fn create_snapshot_op(
        &self,
        req: CreateSnapshotRequest,
    ) -> Result<CreateSnapshotResponse, Status> {
        if req.name.is_empty() {
            return Err(Status::invalid_argument("name is required"));
        }
        if req.source_volume_id.is_empty() {
            return Err(Status::invalid_argument("source_volume_id is required"));
        }
        for k in req.parameters.keys() {
            if !k.starts_with(CO_PARAM_PREFIX) && k != backups::PARAM_BACKUP_TARGET {
                return Err(Status::invalid_argument(format!(
                    "unknown parameter {k:?} (snapshots take only {})",
                    backups::PARAM_BACKUP_TARGET
                )));
            }
        }
        let backup_target = backups::target_param(&req.parameters)?;
        let volume = VolumeId::parse(&req.source_volume_id).ok_or_else(|| {
            Status::not_found(format!(
                "no volume {:?} (not an id of this plugin)",
                req.source_volume_id
            ))
        })?;
        let name = lull_snapshot_name(&req.name);
        let id = SnapshotId {
            volume: volume.clone(),
            name: name.clone(),
        };
        if !id.fits() {
            return Err(Status::invalid_argument(format!(
                "snapshot id {:?} would be {} bytes, over the CSI limit of {MAX_SNAPSHOT_ID_BYTES} (the source volume's id is long: shorter node ids make room)",
                id.format(),
                id.format().len()
            )));
        }
        let _busy = self.busy.take(&volume.name)?;
        // Idempotent by name: the same name on another volume is taken.
        let stores = self.cluster.stores().await;
        for (node, store) in &stores {
            let Ok(store) = store else { continue };
            if let Some(r) = store
                .replicas
                .iter()
                .find(|r| r.name != volume.name && r.snapshot(&name).is_some())
            {
                return Err(Status::already_exists(format!(
                    "snapshot {:?} exists already, of volume {} (on node {node}), not of {}",
                    req.name, r.name, volume.name
                )));
            }
        }
        if let Some(target) = &backup_target {
            // Before the snapshot: a target the volume's nodes cannot
            // reach leaves nothing behind.
            self.check_backup_target(target, &id).await?;
        }
        let mut snapshot = self.take_snapshot(&id).await?;
        if let Some(target) = backup_target {
            snapshot = self.backup_snapshot(&id, &target, snapshot).await?;
        }
        tracing::info!(snapshot = %req.name, id = %snapshot.snapshot_id, ready = snapshot.ready_to_use, "snapshot created");
        Ok(CreateSnapshotResponse {
            snapshot: Some(snapshot),
        })
    }

    /// Takes snapshot `id` of its volume (the caller holds the volume's
    /// busy mark), or answers the one there.
    async fn take_snapshot(&self, id: &SnapshotId) -> Result<Snapshot, Status> {
        let vol = &id.volume;
        let name = id.name.as_str();
        let replicas = self.replicas_of(vol).await?;
        let missing: Vec<&String> = replicas
            .iter()
            .filter(|(_, r)| r.is_none())
            .map(|(n, _)| n)
            .collect();
        if missing.len() == replicas.len() {
            return Err(Status::not_found(format!("no volume {}", vol.format())));
        }
        if !missing.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {}: no replica on node(s) {missing:?}: a snapshot is taken on every replica (replace the missing ones first)",
                vol.name
            )));
        }
        let held_by: Vec<&String> = replicas
            .iter()
            .filter(|(_, r)| r.as_ref().is_some_and(|r| r.snapshot(name).is_some()))
            .map(|(n, _)| n)
            .collect();
        if held_by.len() == replicas.len() {
            return self.snapshot_of(id, &replicas);
        }
        if replicas.iter().any(|(_, r)| {
            r.as_ref()
                .is_some_and(|r| r.snapshots.iter().any(|s| s.name == name && s.merging))
        }) {
            return Err(Status::aborted(format!(
                "snapshot {name} of volume {} is being deleted (merged away); retry once it is gone",
                vol.name
            )));
        }
        match self.route(vol, &replicas).await? {
            Route::Engine(node) => {
                if !held_by.is_empty() {
                    // A snapshot an earlier call left on some replicas
                    // only: gone first, so that every replica takes it
                    // at the same instant.
                    tracing::warn!(volume = %vol.name, snapshot = name, on = ?held_by, "a partial snapshot is deleted before it is taken again");
                    match self
                        .cluster
                        .call(
                            &node,
                            "snapshot_delete",
                            json!({ "volume": vol.name, "name": name }),
                        )
                        .await
                    {
                        Ok(_) => {}
                        Err(e) => return Err(snapshot_refusal(&e)),
                    }
                    return Err(Status::aborted(format!(
                        "snapshot {name} of volume {} was on {held_by:?} only: it is being deleted; the retry takes it again",
                        vol.name
                    )));
                }
                if let Err(e) = self
                    .cluster
                    .call(
                        &node,
                        "snapshot_create",
                        json!({ "volume": vol.name, "name": name }),
                    )
                    .await
                {
                    tracing::warn!(volume = %vol.name, snapshot = name, node = %node, error = %e, "CreateSnapshot: the engine refused");
                    return Err(snapshot_refusal(&e));
                }
                tracing::info!(volume = %vol.name, snapshot = name, node = %node, "snapshot taken through the volume's engine (staged there)");
            }
            Route::Stores => {
                let seen: Vec<(&String, &StoreReplica)> = replicas
                    .iter()
                    .filter_map(|(n, r)| r.as_ref().map(|r| (n, r)))
                    .collect();
                let stale: Vec<String> = seen
                    .iter()
                    .filter(|(_, r)| !r.clean || r.generation != seen[0].1.generation)
                    .map(|(n, r)| format!("{n} (generation {}, clean {})", r.generation, r.clean))
                    .collect();
                if !stale.is_empty() {
                    return Err(Status::failed_precondition(format!(
                        "volume {}: its replicas are not all clean at one generation (first: {} at generation {}; differing: {}): a snapshot of a stale replica would hold other bytes than its peers'; stage the volume once so that its engine brings them in step",
                        vol.name,
                        seen[0].0,
                        seen[0].1.generation,
                        stale.join(", ")
                    )));
                }
                if !held_by.is_empty() {
                    // Partial (a call cut short): deleted, and the retry
                    // takes it on every replica.
                    tracing::warn!(volume = %vol.name, snapshot = name, on = ?held_by, "a partial snapshot is deleted before it is taken again");
                    self.store_snapshot_undo(vol, name, &held_by).await;
                    return Err(Status::aborted(format!(
                        "snapshot {name} of volume {} was on {held_by:?} only: it is being deleted; the retry takes it again",
                        vol.name
                    )));
                }
                let made = futures::future::join_all(seen.iter().map(|(node, _)| {
                    self.cluster.call(
                        node,
                        "replica_snapshot",
                        json!({ "name": vol.name, "snapshot": name, "op": "create" }),
                    )
                }))
                .await;
                let ok: Vec<&String> = seen
                    .iter()
                    .zip(&made)
                    .filter(|(_, r)| r.is_ok())
                    .map(|((n, _), _)| *n)
                    .collect();
                if let Some(e) = made.iter().find_map(|r| r.as_ref().err()) {
                    tracing::warn!(volume = %vol.name, snapshot = name, error = %e, "CreateSnapshot: a store did not take the snapshot; undoing the others");
                    self.store_snapshot_undo(vol, name, &ok).await;
                    return Err(snapshot_refusal(e));
                }
                // No engine wrote between the replicas' snapshots: each is
                // still clean at the generation seen before.
                let after = self.replicas_of(vol).await?;
                let moved: Vec<&String> = after
                    .iter()
                    .filter(|(n, r)| {
                        let before = seen.iter().find(|(m, _)| m == &n).map(|(_, r)| *r);
                        match (r, before) {
                            (Some(r), Some(b)) => !r.clean || r.generation != b.generation,
                            _ => true,
                        }
                    })
                    .map(|(n, _)| n)
                    .collect();
                if !moved.is_empty() {
                    tracing::warn!(volume = %vol.name, snapshot = name, ?moved, "CreateSnapshot: an engine took the volume while its stores took the snapshot; undoing it");
                    self.store_snapshot_undo(vol, name, &ok).await;
                    return Err(Status::aborted(format!(
                        "volume {}: an engine took replicas {moved:?} while the snapshot was taken replica by replica; the retry takes it through the engine",
                        vol.name
                    )));
                }
                tracing::info!(volume = %vol.name, snapshot = name, replicas = seen.len(), "snapshot taken on the stores (staged nowhere)");
            }
        }
        let replicas = self.replicas_of(vol).await?;
        self.snapshot_of(id, &replicas)
    }

    /// Deletes snapshot `name` of the volume on the stores of `nodes`
    /// (an undo: failures are logged).
    async fn store_snapshot_undo(&self, vol: &VolumeId, name: &str, nodes: &[&String]) {
        for node in nodes {
            if let Err(e) = self
                .cluster
                .call(
                    node,
                    "replica_snapshot",
                    json!({ "name": vol.name, "snapshot": name, "op": "delete" }),
                )
                .await
            {
                tracing::warn!(volume = %vol.name, snapshot = name, node = %node, error = %e, "could not delete a snapshot not wanted");
            }
        }
    }

    /// The CSI snapshot, from its replicas (each must hold it).
    fn snapshot_of(&self, id: &SnapshotId, replicas: &Replicas) -> Result<Snapshot, Status> {
        let mut size_bytes = 0;
        let mut created = 0;
        for (node, r) in replicas {
            let Some(s) = r.as_ref().and_then(|r| r.snapshot(&id.name)) else {
                return Err(Status::internal(format!(
                    "snapshot {} of volume {} is missing on node {node} after it was taken",
                    id.name, id.volume.name
                )));
            };
            size_bytes = r.as_ref().map_or(0, |r| r.size_bytes).max(size_bytes);
            created = created.max(s.created_unix);
        }
        Ok(csi_snapshot(id, size_bytes, created))
    }

    /// DeleteSnapshot.
    pub(crate) async fn delete_snapshot_op(
        &self,
        req: DeleteSnapshotRequest,
    ) -> Result<(), Status> {
        if req.snapshot_id.is_empty() {
            return Err(Status::invalid_argument("snapshot_id is required"));
        }
        if let Some(b) = BackupSnapshotId::parse(&req.snapshot_id) {
            return self.backup_snapshot_delete(&b).await;
        }
        // An id this plugin never wrote names nothing: deleted already.
        let Some(id) = SnapshotId::parse(&req.snapshot_id) else {
            return Ok(());
        };
        let vol = &id.volume;
        let name = id.name.as_str();
        let _busy = self.busy.take(&vol.name)?;
        let replicas = self.replicas_of(vol).await?;
        let mut clones: Vec<String> = Vec::new();
        let mut held_by: Vec<&String> = Vec::new();
        for (node, r) in &replicas {
            if let Some(s) = r.as_ref().and_then(|r| r.snapshot(name)) {
                held_by.push(node);
                for c in &s.clones {
                    if !clones.contains(c) {
                        clones.push(c.clone());
                    }
                }
            }
        }
        if !clones.is_empty() {
            tracing::warn!(snapshot = %req.snapshot_id, ?clones, "DeleteSnapshot refused: volumes were created from it");
            return Err(Status::failed_precondition(format!(
                "snapshot {} is the base of volume(s) {}: their replicas read its files; delete them first",
                req.snapshot_id,
                clones.join(", ")
            )));
        }
        if held_by.is_empty() {
            return Ok(());
        }
        match self.route(vol, &replicas).await? {
            Route::Engine(node) => {
                if let Err(e) = self
                    .cluster
                    .call(
                        &node,
                        "snapshot_delete",
                        json!({ "volume": vol.name, "name": name }),
                    )
                    .await
                {
                    if !e.refusal().is_some_and(|m| m.contains("no snapshot")) {
                        tracing::warn!(snapshot = %req.snapshot_id, node = %node, error = %e, "DeleteSnapshot: the engine refused");
                        return Err(snapshot_refusal(&e));
                    }
                }
            }
            Route::Stores => {
                for node in &held_by {
                    if let Err(e) = self
                        .cluster
                        .call(
                            node,
                            "replica_snapshot",
                            json!({ "name": vol.name, "snapshot": name, "op": "delete" }),
                        )
                        .await
                    {
                        if !e.refusal().is_some_and(|m| m.contains("no snapshot")) {
                            tracing::warn!(snapshot = %req.snapshot_id, node = %node, error = %e, "DeleteSnapshot: a store refused");
                            return Err(snapshot_refusal(&e));
                        }
                    }
                }
            }
        }
        tracing::info!(snapshot = %req.snapshot_id, "snapshot deleted (its blocks merge into the volume in the background)");
        Ok(())
    }

    /// ListSnapshots: every store's replicas' own snapshots, a snapshot
    /// listed once every replica of its volume holds it (a partial one is
    /// not a snapshot yet, or is being cleaned up), by id, paged as
    /// ListVolumes.
    pub(crate) async fn list_snapshots_op(
        &self,
        req: ListSnapshotsRequest,
    ) -> Result<ListSnapshotsResponse, Status> {
        let max = match req.max_entries {
            n if n < 0 => return Err(Status::invalid_argument("max_entries must not be negative")),
            0 => MAX_LIST_ENTRIES,
            n => (n as usize).min(MAX_LIST_ENTRIES),
        };
        if !req.starting_token.is_empty() && SnapshotId::parse(&req.starting_token).is_none() {
            return Err(Status::aborted(format!(
                "starting_token {:?} is not a token of this plugin",
                req.starting_token
            )));
        }
        if let Some(b) = BackupSnapshotId::parse(&req.snapshot_id) {
            let entries = self.backup_snapshot_get(&b).await?.into_iter();
            return Ok(ListSnapshotsResponse {
                entries: entries
                    .map(|s| list_snapshots_response::Entry { snapshot: Some(s) })
                    .collect(),
                next_token: String::new(),
            });
        }
        // Filters naming nothing of this plugin's match nothing.
        if (!req.snapshot_id.is_empty() && SnapshotId::parse(&req.snapshot_id).is_none())
            || (!req.source_volume_id.is_empty()
                && VolumeId::parse(&req.source_volume_id).is_none())
        {
            return Ok(ListSnapshotsResponse::default());
        }
        let stores = self.cluster.stores().await;
        if let Some(e) = stores.iter().find_map(|(_, s)| s.as_ref().err()) {
            // A partial list would tell the CO snapshots are gone.
            return Err(e.status());
        }
        // Per volume: its nodes (node list order) and size; per snapshot
        // of it: the nodes holding it and its creation time.
        type Held = BTreeMap<String, (Vec<String>, u64)>;
        let mut volumes: BTreeMap<String, (Vec<String>, u64, Held)> = BTreeMap::new();
        for (node, store) in &stores {
            for r in &store.as_ref().expect("errors returned above").replicas {
                let v = volumes.entry(r.name.clone()).or_default();
                v.0.push(node.clone());
                v.1 = v.1.max(r.size_bytes);
                for s in &r.snapshots {
                    if s.inherited || s.merging || s.name.starts_with(CLONE_SNAPSHOT_PREFIX) {
                        continue;
                    }
                    let h = v.2.entry(s.name.clone()).or_default();
                    h.0.push(node.clone());
                    h.1 = h.1.max(s.created_unix);
                }
            }
        }
        let mut entries: Vec<Snapshot> = Vec::new();
        for (vname, (nodes, size_bytes, held)) in volumes {
            for (sname, (on, created)) in held {
                if on.len() != nodes.len() {
                    continue;
                }
                let id = SnapshotId {
                    volume: VolumeId {
                        name: vname.clone(),
                        nodes: nodes.clone(),
                    },
                    name: sname,
                };
                if !id.fits() || SnapshotId::parse(&id.format()).is_none() {
                    // Not one of this plugin's (taken by hand, a name it
                    // would not give).
                    continue;
                }
                entries.push(csi_snapshot(&id, size_bytes, created));
            }
        }
        entries.retain(|s| {
            (req.snapshot_id.is_empty() || s.snapshot_id == req.snapshot_id)
                && (req.source_volume_id.is_empty() || s.source_volume_id == req.source_volume_id)
        });
        entries.sort_by(|a, b| a.snapshot_id.cmp(&b.snapshot_id));
        // The token is the last id of the previous page.
        let start = if req.starting_token.is_empty() {
            0
        } else {
            entries.partition_point(|s| s.snapshot_id.as_str() <= req.starting_token.as_str())
        };
        let page: Vec<Snapshot> = entries[start..].iter().take(max).cloned().collect();
        let next_token = if start + page.len() < entries.len() {
            page.last()
                .map(|s| s.snapshot_id.clone())
                .unwrap_or_default()
        } else {
            String::new()
        };
        Ok(ListSnapshotsResponse {
            entries: page
                .into_iter()
                .map(|s| list_snapshots_response::Entry { snapshot: Some(s) })
                .collect(),
            next_token,
        })
    }

    /// GetSnapshot: ListSnapshots by id (the same rule: listed once
    /// every replica of its volume holds it), one entry or NOT_FOUND.
    /// Like ListSnapshots it asks every node of the list, so a node that
    /// does not answer makes it UNAVAILABLE.
    pub(crate) async fn get_snapshot_op(
        &self,
        req: GetSnapshotRequest,
    ) -> Result<GetSnapshotResponse, Status> {
        if req.snapshot_id.is_empty() {
            return Err(Status::invalid_argument("snapshot_id is required"));
        }
        if SnapshotId::parse(&req.snapshot_id).is_none()
            && BackupSnapshotId::parse(&req.snapshot_id).is_none()
        {
            return Err(Status::not_found(format!(
                "no snapshot {:?} (not an id of this plugin)",
                req.snapshot_id
            )));
        }
        let list = self
            .list_snapshots_op(ListSnapshotsRequest {
                snapshot_id: req.snapshot_id.clone(),
                ..Default::default()
            })
            .await?;
        list.entries
            .into_iter()
            .find_map(|e| e.snapshot)
            .map(|snapshot| GetSnapshotResponse {
                snapshot: Some(snapshot),
            })
            .ok_or_else(|| Status::not_found(format!("no snapshot {}", req.snapshot_id)))
    }

    /// CreateVolume's content: the new volume `name` (lull name) as clones
    /// of a snapshot of the source on the source's nodes. Returns its
    /// nodes and size. The caller holds `name`'s busy mark.
    pub(crate) async fn create_from_source(
        &self,
        name: &str,
        source: &VolumeContentSource,
        replicas_wanted: Option<usize>,
        range: Option<&CapacityRange>,
    ) -> Result<(Vec<String>, u64), Status> {
        use volume_content_source::Type;
        let snap = match &source.r#type {
            Some(Type::Snapshot(s)) => {
                let id = SnapshotId::parse(&s.snapshot_id).ok_or_else(|| {
                    Status::not_found(format!(
                        "no snapshot {:?} (not an id of this plugin)",
                        s.snapshot_id
                    ))
                })?;
                let replicas = self.replicas_of(&id.volume).await?;
                if !replicas
                    .iter()
                    .all(|(_, r)| r.as_ref().is_some_and(|r| r.snapshot(&id.name).is_some()))
                {
                    return Err(Status::not_found(format!(
                        "no snapshot {} (not on every replica of its volume)",
                        s.snapshot_id
                    )));
                }
                id
            }
            Some(Type::Volume(v)) => {
                let volume = VolumeId::parse(&v.volume_id).ok_or_else(|| {
                    Status::not_found(format!(
                        "no volume {:?} (not an id of this plugin)",
                        v.volume_id
                    ))
                })?;
                if volume.name == name {
                    return Err(Status::invalid_argument(
                        "a volume cannot be created from itself",
                    ));
                }
                let _source_busy = self.busy.take(&volume.name)?;
                // The intermediate snapshot is named after the new volume:
                // a retry finds it, and it stays as the clone's base until
                // the clone is deleted (DeleteVolume removes it then).
                let id = SnapshotId {
                    volume,
                    name: clone_snapshot_name(name),
                };
                self.take_snapshot(&id).await?;
                id
            }
            None => return Err(Status::invalid_argument("volume_content_source: no type")),
        };
        let nodes = snap.volume.nodes.clone();
        if let Some(n) = replicas_wanted {
            if n != nodes.len() {
                return Err(Status::invalid_argument(format!(
                    "a volume made from {} has its {} replica(s), on the same nodes (its replicas share the snapshot's files), not {n}",
                    snap.volume.format(),
                    nodes.len()
                )));
            }
        }
        let replicas = self.replicas_of(&snap.volume).await?;
        let size_bytes = replicas
            .iter()
            .filter_map(|(_, r)| r.as_ref().map(|r| r.size_bytes))
            .max()
            .unwrap_or(0);
        let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
        if required < 0 || limit < 0 {
            return Err(Status::invalid_argument("capacity_range: negative bytes"));
        }
        if required as u64 > size_bytes || (limit != 0 && (limit as u64) < size_bytes) {
            return Err(Status::out_of_range(format!(
                "a volume made from {} has its {size_bytes} bytes: a clone keeps its source's size while it shares the source's snapshot (a replica refuses to grow a clone until it is flattened); asked {required} to {limit} bytes",
                snap.volume.format()
            )));
        }
        let origin = format!("{}@{}", snap.volume.name, snap.name);
        let made = futures::future::join_all(nodes.iter().map(|node| {
            self.cluster.call(
                node,
                "replica_clone",
                json!({ "name": name, "snapshot": origin }),
            )
        }))
        .await;
        if let Some((node, e)) = nodes
            .iter()
            .zip(&made)
            .find_map(|(n, r)| r.as_ref().err().map(|e| (n, e)))
        {
            tracing::warn!(volume = name, origin = %origin, node = %node, error = %e, "CreateVolume: a store did not make its clone; undoing the others");
            for (node, r) in nodes.iter().zip(&made) {
                if r.is_ok() {
                    if let Err(e) = self
                        .cluster
                        .call(node, "replica_delete", json!({ "name": name }))
                        .await
                    {
                        tracing::warn!(volume = name, node = %node, error = %e, "could not undo a clone of a failed CreateVolume");
                    }
                }
            }
            return Err(match e.refusal() {
                Some(m) if m.contains("already exists") => Status::already_exists(format!(
                    "volume {name} exists and is not a clone of {origin}: {e}"
                )),
                Some(m) if m.contains("not enough space") || m.contains("replicas, its most") => {
                    Status::resource_exhausted(e.to_string())
                }
                Some(m) if m.contains("layers") => Status::resource_exhausted(e.to_string()),
                _ => e.status(),
            });
        }
        tracing::info!(volume = name, origin = %origin, nodes = ?nodes, size_bytes, "volume created as clones of a snapshot");
        Ok((nodes, size_bytes))
    }

    /// After DeleteVolume of `id`: the snapshot a clone-from-volume took
    /// of its source for it (`csi-clone.NAME`, on the same nodes), which
    /// no clone uses now. Failures are logged: the snapshot goes with
    /// its source volume at the latest.
    pub(crate) async fn delete_clone_snapshot(&self, id: &VolumeId) {
        let snap = clone_snapshot_name(&id.name);
        let stores = self.cluster.stores().await;
        let mut sources: HashMap<String, Vec<String>> = HashMap::new();
        for (node, store) in &stores {
            let Ok(store) = store else { continue };
            if !id.nodes.contains(node) {
                continue;
            }
            for r in &store.replicas {
                if r.snapshot(&snap).is_some_and(|s| s.clones.is_empty()) {
                    sources
                        .entry(r.name.clone())
                        .or_default()
                        .push(node.clone());
                }
            }
        }
        for (source, nodes) in sources {
            let vol = VolumeId {
                name: source.clone(),
                nodes,
            };
            let req = DeleteSnapshotRequest {
                snapshot_id: SnapshotId {
                    volume: vol,
                    name: snap.clone(),
                }
                .format(),
                ..Default::default()
            };
            match self.delete_snapshot_op(req).await {
                Ok(()) => {
                    tracing::info!(volume = %source, snapshot = %snap, "the snapshot a deleted clone was made from is deleted")
                }
                Err(e) => {
                    tracing::warn!(volume = %source, snapshot = %snap, error = %e, "could not delete the snapshot a deleted clone was made from (it goes with its source)")
                }
            }
        }
    }
}

/// A CSI snapshot, ready: lull's snapshots are whole once taken.
fn csi_snapshot(id: &SnapshotId, size_bytes: u64, created_unix: u64) -> Snapshot {
    Snapshot {
        size_bytes: size_bytes as i64,
        snapshot_id: id.format(),
        source_volume_id: id.volume.format(),
        creation_time: Some(prost_types::Timestamp {
            seconds: created_unix as i64,
            nanos: 0,
        }),
        ready_to_use: true,
        ..Default::default()
    }
}

fn is_no_replica(e: &CallError) -> bool {
    e.refusal().is_some_and(|m| m.contains("no replica"))
}

/// The CSI code of a snapshot operation a node refused: a replica not
/// healthy or held elsewhere FAILED_PRECONDITION (the engine takes one
/// only on every healthy replica), a full chain RESOURCE_EXHAUSTED, a
/// busy one ABORTED (the CO retries); the rest as any call.
fn snapshot_refusal(e: &CallError) -> Status {
    match e.refusal() {
        Some(m) if m.contains("layers") => Status::resource_exhausted(e.to_string()),
        Some(m) if m.contains("clones") => Status::failed_precondition(e.to_string()),
        Some(m) if m.contains("healthy") || m.contains("held by engine") => {
            Status::failed_precondition(e.to_string())
        }
        Some(m) if m.contains("merged") || m.contains("in progress") => {
            Status::aborted(e.to_string())
        }
        _ => e.status(),
    }
}
