//! The Controller service: stateless. It asks the node daemons what they
//! hold (`store_get`), places a new volume's replicas on distinct nodes
//! with room (`replica_create` on each), and writes the placement into the
//! volume id ([`crate::volume_id`]). Nothing is recorded anywhere else.
//!
//! ```text
//! CreateVolume "pvc-1", 2 replicas, 10 GiB
//!   store_get on every node        -> rooms, and whether "pvc-1" exists already
//!   place (most room, preferred topology first, distinct nodes)
//!   replica_create pvc-1 on node-b and node-a   (undone if either fails)
//!   -> volume id "pvc-1@node-b+node-a"
//! ```

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use serde_json::json;
use tonic::{Request, Response, Status};

use crate::capability;
use crate::cluster::{CallError, Cluster, Store};
use crate::health::{self, ReplicaSeen};
use crate::pb::controller_server::Controller;
use crate::pb::*;
use crate::placement::{self, Candidate};
use crate::volume_id::{lull_name, VolumeId, MAX_REPLICAS};
use crate::Busy;

/// Replicas of a volume whose StorageClass does not say (`replicas`).
pub const DEFAULT_REPLICAS: usize = 2;

/// Size of a volume whose request names none: small enough to fit a
/// test node, as large as a CO asking for "some" space expects.
pub const DEFAULT_VOLUME_BYTES: u64 = 1 << 30;

/// Replicas are whole 4 KiB blocks (the store's rule).
pub const VOLUME_ALIGN_BYTES: u64 = 4096;

/// Largest replica a store takes (docs/NODE.md: 1 PiB).
pub const MAX_VOLUME_BYTES: u64 = 1 << 50;

/// Most entries in one ListVolumes page when the CO sets no
/// `max_entries`: the stores hold at most 4,096 replicas each, and a
/// page of 1,000 ids (~100 KiB) stays far below gRPC's 4 MiB message.
pub const MAX_LIST_ENTRIES: usize = 1000;

/// The StorageClass parameter for the replica count.
pub const PARAM_REPLICAS: &str = "replicas";

/// Parameters the CO adds itself (external-provisioner's
/// `--extra-create-metadata`): read by nobody, accepted.
pub(crate) const CO_PARAM_PREFIX: &str = "csi.storage.k8s.io/";

#[derive(Debug)]
pub struct ControllerPlugin {
    pub(crate) cluster: Arc<Cluster>,
    pub(crate) busy: Busy,
}

impl ControllerPlugin {
    pub fn new(cluster: Arc<Cluster>) -> ControllerPlugin {
        ControllerPlugin {
            cluster,
            busy: Busy::default(),
        }
    }

    pub(crate) async fn create(
        &self,
        req: CreateVolumeRequest,
    ) -> Result<CreateVolumeResponse, Status> {
        if req.name.is_empty() {
            return Err(Status::invalid_argument("name is required"));
        }
        capability::check_all(&req.volume_capabilities).map_err(Status::invalid_argument)?;
        let replicas = replicas_param(&req.parameters)?;
        let name = lull_name(&req.name);
        if let Some(source) = Self::backup_source(req.volume_content_source.as_ref()) {
            return self.create_from_backup(req, source).await;
        }
        if let Some(source) = &req.volume_content_source {
            let _busy = self.busy.take(&name)?;
            let explicit = req
                .parameters
                .contains_key(PARAM_REPLICAS)
                .then_some(replicas);
            let (mut nodes, size_bytes) = self
                .create_from_source(&name, source, explicit, req.capacity_range.as_ref())
                .await?;
            self.sort_nodes(&mut nodes);
            let id = VolumeId {
                name: name.clone(),
                nodes,
            };
            let accessible =
                accessible_topology(&self.cluster, req.accessibility_requirements.as_ref())?;
            tracing::info!(volume = %req.name, id = %id.format(), size_bytes, "volume created from a content source");
            return Ok(CreateVolumeResponse {
                volume: Some(Volume {
                    capacity_bytes: size_bytes as i64,
                    volume_context: HashMap::from([(
                        PARAM_REPLICAS.to_string(),
                        id.nodes.len().to_string(),
                    )]),
                    volume_id: id.format(),
                    content_source: Some(source.clone()),
                    accessible_topology: accessible,
                }),
            });
        }
        let size_bytes = size_from_range(req.capacity_range.as_ref())?;
        let _busy = self.busy.take(&name)?;
        let stores = self.cluster.stores().await;
        let accessible =
            accessible_topology(&self.cluster, req.accessibility_requirements.as_ref())?;

        // Idempotent by name: the nodes that already hold a replica of it.
        let holders: Vec<(&String, &Store)> = stores
            .iter()
            .filter_map(|(id, s)| s.as_ref().ok().map(|s| (id, s)))
            .filter(|(_, s)| s.replica(&name).is_some())
            .collect();
        if let Some((_, s)) = holders.first() {
            let existing = s.replica(&name).map_or(0, |r| r.size_bytes);
            if existing != size_bytes {
                return Err(Status::already_exists(format!(
                    "volume {:?} exists with {existing} bytes, not {size_bytes}",
                    req.name
                )));
            }
        }
        let mut chosen: Vec<String> = holders.iter().map(|(id, _)| (*id).clone()).collect();
        if chosen.len() > replicas {
            return Err(Status::already_exists(format!(
                "volume {:?} exists with {} replicas, not {replicas}",
                req.name,
                chosen.len()
            )));
        }
        let unreachable: Vec<String> = stores
            .iter()
            .filter_map(|(_, s)| s.as_ref().err().map(|e| e.to_string()))
            .collect();
        if !chosen.is_empty() && chosen.len() < replicas && !unreachable.is_empty() {
            // Part of the volume is found: the rest may be on a node that
            // does not answer, and placing it again would make one too many.
            return Err(Status::unavailable(format!(
                "volume {:?}: {} of its {replicas} replicas found; unreachable: {}",
                req.name,
                chosen.len(),
                unreachable.join("; ")
            )));
        }
        if chosen.len() < replicas {
            // A new volume, or one whose creation was cut short: place
            // the missing replicas on other nodes.
            let preferred = req
                .accessibility_requirements
                .as_ref()
                .map(|r| r.preferred.clone())
                .unwrap_or_default();
            let candidates: Vec<Candidate> = stores
                .iter()
                .filter(|(id, _)| !chosen.contains(id))
                .filter_map(|(id, s)| {
                    let s = s.as_ref().ok()?;
                    let node = self.cluster.node(id)?;
                    let segments = node.segments();
                    Some(Candidate {
                        id: id.clone(),
                        room_bytes: s.room_bytes(),
                        preferred_rank: preferred
                            .iter()
                            .position(|t| matches(&t.segments, &segments)),
                    })
                })
                .collect();
            let more =
                placement::place(&candidates, replicas - chosen.len(), size_bytes, &req.name)
                    .map_err(|e| {
                        if unreachable.is_empty() {
                            Status::resource_exhausted(format!("volume {:?}: {e}", req.name))
                        } else {
                            // Nodes that did not answer may have the room:
                            // the CO retries rather than give up on the claim.
                            Status::unavailable(format!(
                                "volume {:?}: {e}; unreachable: {}",
                                req.name,
                                unreachable.join("; ")
                            ))
                        }
                    })?;
            let made = futures::future::join_all(more.iter().map(|node| {
                self.cluster.call(
                    node,
                    "replica_create",
                    json!({ "name": name, "size": size_bytes }),
                )
            }))
            .await;
            let failed: Vec<&CallError> = made.iter().filter_map(|r| r.as_ref().err()).collect();
            if let Some(first) = failed.first() {
                // Undo this call's replicas so that a retry starts clean.
                for (node, r) in more.iter().zip(&made) {
                    if r.is_ok() {
                        if let Err(e) = self
                            .cluster
                            .call(node, "replica_delete", json!({ "name": name }))
                            .await
                        {
                            tracing::warn!(volume = %name, node = %node, error = %e, "could not undo a replica of a failed CreateVolume");
                        }
                    }
                }
                return Err(match first.refusal() {
                    Some(m)
                        if m.contains("not enough space") || m.contains("replicas, its most") =>
                    {
                        Status::resource_exhausted(first.to_string())
                    }
                    _ => first.status(),
                });
            }
            chosen.extend(more);
        }
        self.sort_nodes(&mut chosen);
        let id = VolumeId {
            name: name.clone(),
            nodes: chosen,
        };
        tracing::info!(volume = %req.name, id = %id.format(), size_bytes, "volume created");
        Ok(CreateVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: size_bytes as i64,
                volume_id: id.format(),
                volume_context: HashMap::from([(PARAM_REPLICAS.to_string(), replicas.to_string())]),
                content_source: None,
                accessible_topology: accessible,
            }),
        })
    }

    /// The id lists the nodes in node list order, so the same volume
    /// always has the same id.
    fn sort_nodes(&self, nodes: &mut [String]) {
        let list = self.cluster.nodes();
        let order: HashMap<&str, usize> = list
            .iter()
            .enumerate()
            .map(|(i, n)| (n.id.as_str(), i))
            .collect();
        nodes.sort_by_key(|n| order.get(n.as_str()).copied().unwrap_or(usize::MAX));
    }

    async fn delete(&self, req: DeleteVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        // An id this plugin never wrote names no volume: deleted already.
        let Some(id) = VolumeId::parse(&req.volume_id) else {
            return Ok(());
        };
        let _busy = self.busy.take(&id.name)?;
        for node in &id.nodes {
            if self.cluster.node(node).is_none() {
                tracing::warn!(volume = %id.name, node = %node, "DeleteVolume: the node is no longer in the node list; its replica is not deleted");
                continue;
            }
            match self
                .cluster
                .call(node, "replica_delete", json!({ "name": id.name }))
                .await
            {
                Ok(_) => {}
                Err(e) if e.refusal().is_some_and(|m| m.contains("no replica")) => {}
                Err(e) if e.refusal().is_some_and(|m| m.contains("held by engine")) => {
                    return Err(Status::failed_precondition(format!(
                        "volume {} is in use (staged on a node): {e}",
                        id.name
                    )))
                }
                Err(e) if e.refusal().is_some_and(|m| m.contains("base of clones")) => {
                    tracing::warn!(volume = %id.name, node = %node, error = %e, "DeleteVolume refused: volumes were created from its snapshots");
                    return Err(Status::failed_precondition(format!(
                        "volume {}: volumes created from it read its snapshots' files; delete them first: {e}",
                        id.name
                    )));
                }
                Err(e) => return Err(e.status()),
            }
        }
        // A volume cloned from a volume leaves the snapshot taken for it
        // (still under this volume's busy mark: a CreateVolume of the same
        // name must not take that snapshot meanwhile).
        self.delete_clone_snapshot(&id).await;
        tracing::info!(id = %req.volume_id, "volume deleted");
        Ok(())
    }

    /// ControllerExpandVolume. A volume staged somewhere grows through
    /// its engine (`volume_resize` on the node running it: every replica
    /// at once, online); a volume staged nowhere grows replica by replica
    /// on its stores (`replica_resize`, which a store refuses while an
    /// engine holds the replica, so the two never race silently).
    async fn expand(
        &self,
        req: ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpandVolumeResponse, Status> {
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        let range = req
            .capacity_range
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("capacity_range is required"))?;
        let id = VolumeId::parse(&req.volume_id).ok_or_else(|| {
            Status::not_found(format!(
                "no volume {:?} (not an id of this plugin)",
                req.volume_id
            ))
        })?;
        if let Some(cap) = &req.volume_capability {
            capability::check(cap).map_err(Status::invalid_argument)?;
        }
        let size_bytes = size_from_range(Some(range))?;
        // A filesystem grows on the node (NodeExpandVolume); a block
        // volume is its device, grown here.
        let node_expansion_required = !matches!(
            req.volume_capability.as_ref().map(capability::check),
            Some(Ok((capability::Access::Block, _)))
        );
        let _busy = self.busy.take(&id.name)?;
        let name = id.name.as_str();

        // Every replica's size and holder: all must answer, since all
        // must grow.
        let replicas = futures::future::join_all(id.nodes.iter().map(|node| async move {
            let r = self
                .cluster
                .call(node, "replica_get", json!({ "name": name }))
                .await;
            (node.clone(), r)
        }))
        .await;
        let mut sizes = Vec::with_capacity(replicas.len());
        let mut held = false;
        let mut missing = Vec::new();
        for (node, r) in &replicas {
            match r {
                Ok(r) => {
                    sizes.push(r["size_bytes"].as_u64().unwrap_or(0));
                    held |= !r["held_by_session"].is_null();
                }
                Err(e) if e.refusal().is_some_and(|m| m.contains("no replica")) => {
                    missing.push(node.clone())
                }
                Err(e) => return Err(e.status()),
            }
        }
        if sizes.is_empty() {
            return Err(Status::not_found(format!("no volume {}", req.volume_id)));
        }
        if !missing.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {}: no replica on node(s) {missing:?}: every replica must grow (replace the missing ones first)",
                id.name
            )));
        }
        let current = sizes.iter().copied().max().unwrap_or(0);
        let limit = range.limit_bytes.max(0) as u64;
        // Larger than asked already is fine (nothing to grow but the
        // laggards), unless the range excludes that size: no shrink.
        if current > size_bytes && limit != 0 && current > limit {
            return Err(Status::out_of_range(format!(
                "volume {} has {current} bytes, above limit_bytes {limit}: a volume never shrinks",
                id.name
            )));
        }
        let target = current.max(size_bytes);

        // Where an engine of the volume runs (where it is staged).
        let engines = self.engine_nodes(name).await;
        match engines.as_slice() {
            [node] => {
                match self
                    .cluster
                    .call(
                        node,
                        "volume_resize",
                        json!({ "name": name, "size": target }),
                    )
                    .await
                {
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(volume = %id.name, node = %node, size_bytes = target, error = %e, "ControllerExpandVolume: the engine refused to grow");
                        return Err(grow_refusal(&e));
                    }
                }
                tracing::info!(volume = %id.name, node = %node, from = current, to = target, "volume grown through its engine (staged there)");
            }
            [] if held => {
                // A replica is held by an engine on a node that did not
                // answer (or that is going away): it must grow there.
                return Err(Status::unavailable(format!(
                    "volume {}: a replica is held by an engine, and no node of the list answers as running it; retry once its node answers",
                    id.name
                )));
            }
            [] => {
                if sizes.iter().all(|s| *s == target) {
                    return Ok(ControllerExpandVolumeResponse {
                        capacity_bytes: target as i64,
                        node_expansion_required,
                    });
                }
                let grown = futures::future::join_all(id.nodes.iter().map(|node| async move {
                    self.cluster
                        .call(
                            node,
                            "replica_resize",
                            json!({ "name": name, "size": target }),
                        )
                        .await
                }))
                .await;
                if let Some(e) = grown.iter().find_map(|r| r.as_ref().err()) {
                    // A partial grow is completed by the CO's retry: the
                    // grown replicas answer the same size again at once.
                    tracing::warn!(volume = %id.name, size_bytes = target, error = %e, "ControllerExpandVolume: a store did not grow its replica");
                    return Err(grow_refusal(e));
                }
                tracing::info!(volume = %id.name, from = current, to = target, replicas = id.nodes.len(), "volume grown on its stores (staged nowhere)");
            }
            _ => {
                return Err(Status::failed_precondition(format!(
                    "volume {}: engines on several nodes ({}): it grows through one engine; unstage it where it is not used",
                    id.name,
                    engines.join(", ")
                )))
            }
        }
        Ok(ControllerExpandVolumeResponse {
            capacity_bytes: target as i64,
            node_expansion_required,
        })
    }

    /// The volume's size if its replicas exist; NotFound if none of its
    /// nodes holds one.
    async fn existing_size(&self, id: &VolumeId) -> Result<u64, Status> {
        let mut unreachable = None;
        for node in &id.nodes {
            match self
                .cluster
                .call(node, "replica_get", json!({ "name": id.name }))
                .await
            {
                Ok(r) => return Ok(r["size_bytes"].as_u64().unwrap_or(0)),
                Err(e) if e.refusal().is_some_and(|m| m.contains("no replica")) => {}
                Err(e) => unreachable = Some(e),
            }
        }
        match unreachable {
            Some(e) => Err(e.status()),
            None => Err(Status::not_found(format!("no volume {}", id.format()))),
        }
    }

    /// What the volume's replica nodes and every engine of it say, for
    /// ControllerGetVolume and ControllerGetVolumeHealth; NOT_FOUND when
    /// every replica node answers that it holds no replica of it.
    async fn observe(&self, volume_id: &str) -> Result<Observed, Status> {
        if volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        let id = VolumeId::parse(volume_id).ok_or_else(|| {
            Status::not_found(format!(
                "no volume {volume_id:?} (not an id of this plugin)"
            ))
        })?;
        let replica_calls = id.nodes.iter().map(|node| async {
            let seen = match self
                .cluster
                .call(node, "replica_get", json!({ "name": id.name }))
                .await
            {
                Ok(r) => (ReplicaSeen::Present, r["size_bytes"].as_u64()),
                Err(e) if e.refusal().is_some_and(|m| m.contains("no replica")) => {
                    (ReplicaSeen::Missing, None)
                }
                Err(e) => (ReplicaSeen::Unreachable(e.to_string()), None),
            };
            (node.clone(), seen)
        });
        let list = self.cluster.nodes();
        let engine_calls = list.iter().map(|n| async {
            let states = self
                .cluster
                .call(&n.id, "replica_list", json!({ "volume": id.name }))
                .await
                .ok()?;
            let states: Vec<(String, String)> = states
                .as_array()?
                .iter()
                .map(|r| {
                    (
                        r["addr"].as_str().unwrap_or("?").to_string(),
                        r["state"].as_str().unwrap_or("?").to_string(),
                    )
                })
                .collect();
            Some((n.id.clone(), states))
        });
        let (replicas, engines) = futures::future::join(
            futures::future::join_all(replica_calls),
            futures::future::join_all(engine_calls),
        )
        .await;
        if replicas
            .iter()
            .all(|(_, (seen, _))| *seen == ReplicaSeen::Missing)
        {
            return Err(Status::not_found(format!("no volume {volume_id}")));
        }
        let size_bytes = replicas
            .iter()
            .find_map(|(_, (_, size))| *size)
            .unwrap_or(0);
        Ok(Observed {
            volume_id: volume_id.to_string(),
            size_bytes,
            replicas: replicas
                .into_iter()
                .map(|(n, (seen, _))| (n, seen))
                .collect(),
            engines: engines.into_iter().flatten().collect(),
        })
    }

    async fn list(&self, req: ListVolumesRequest) -> Result<ListVolumesResponse, Status> {
        let max = match req.max_entries {
            n if n < 0 => return Err(Status::invalid_argument("max_entries must not be negative")),
            0 => MAX_LIST_ENTRIES,
            n => (n as usize).min(MAX_LIST_ENTRIES),
        };
        if !req.starting_token.is_empty() && VolumeId::parse(&req.starting_token).is_none() {
            return Err(Status::aborted(format!(
                "starting_token {:?} is not a token of this plugin",
                req.starting_token
            )));
        }
        let stores = self.cluster.stores().await;
        if let Some(e) = stores.iter().find_map(|(_, s)| s.as_ref().err()) {
            // A partial list would tell the CO volumes are gone.
            return Err(e.status());
        }
        let mut volumes: BTreeMap<String, (Vec<String>, u64)> = BTreeMap::new();
        for (node, store) in &stores {
            for r in &store.as_ref().expect("errors returned above").replicas {
                let v = volumes.entry(r.name.clone()).or_default();
                v.0.push(node.clone());
                v.1 = r.size_bytes;
            }
        }
        let mut entries: Vec<(String, u64)> = volumes
            .into_iter()
            .map(|(name, (nodes, size))| (VolumeId { name, nodes }.format(), size))
            .collect();
        entries.sort();
        // The token is the last id of the previous page: the next page
        // starts after it, whatever was created or deleted since.
        let start = if req.starting_token.is_empty() {
            0
        } else {
            entries.partition_point(|(id, _)| id.as_str() <= req.starting_token.as_str())
        };
        let page: Vec<(String, u64)> = entries[start..].iter().take(max).cloned().collect();
        let next_token = if start + page.len() < entries.len() {
            page.last().map(|(id, _)| id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        Ok(ListVolumesResponse {
            entries: page
                .into_iter()
                .map(|(volume_id, size)| list_volumes_response::Entry {
                    volume: Some(Volume {
                        capacity_bytes: size as i64,
                        volume_id,
                        ..Default::default()
                    }),
                    status: None,
                })
                .collect(),
            next_token,
        })
    }

    async fn capacity(&self, req: GetCapacityRequest) -> Result<GetCapacityResponse, Status> {
        let replicas = replicas_param(&req.parameters)?;
        if req
            .volume_capabilities
            .iter()
            .any(|c| capability::check(c).is_err())
        {
            // Nothing can be provisioned for a capability not served.
            return Ok(GetCapacityResponse::default());
        }
        let stores = self.cluster.stores().await;
        let mut rooms: Vec<u64> = stores
            .iter()
            .filter_map(|(id, s)| {
                let s = s.as_ref().ok()?;
                let node = self.cluster.node(id)?;
                let inside = req
                    .accessible_topology
                    .as_ref()
                    .is_none_or(|t| matches(&t.segments, &node.segments()));
                inside.then(|| s.room_bytes())
            })
            .collect();
        rooms.sort_unstable_by(|a, b| b.cmp(a));
        // The largest volume: its smallest replica goes on the node with
        // the replicas-th most room. The total: each byte is kept
        // `replicas` times.
        let largest = rooms.get(replicas - 1).copied().unwrap_or(0);
        let total: u64 = if rooms.len() >= replicas {
            rooms.iter().sum::<u64>() / replicas as u64
        } else {
            0
        };
        let align = |v: u64| v / VOLUME_ALIGN_BYTES * VOLUME_ALIGN_BYTES;
        Ok(GetCapacityResponse {
            available_capacity: align(total).min(i64::MAX as u64) as i64,
            maximum_volume_size: Some(align(largest).min(MAX_VOLUME_BYTES) as i64),
            minimum_volume_size: Some(VOLUME_ALIGN_BYTES as i64),
        })
    }
}

/// A volume as its nodes describe it.
#[derive(Debug)]
struct Observed {
    volume_id: String,
    size_bytes: u64,
    replicas: Vec<(String, ReplicaSeen)>,
    /// The nodes running an engine of the volume, with its replicas' states.
    engines: Vec<(String, Vec<(String, String)>)>,
}

/// The CSI code of a grow a node refused or failed: sizes the engine or
/// store will not take are OUT_OF_RANGE, a replica not healthy (the
/// engine grows only with all of them) FAILED_PRECONDITION, a volume
/// staged while its stores grew it ABORTED (the CO's retry goes through
/// the engine); the rest as any call.
fn grow_refusal(e: &CallError) -> Status {
    match e.refusal() {
        Some(m)
            if m.contains("shrink")
                || m.contains("region size")
                || m.contains("not enough space")
                || m.contains("at most") =>
        {
            Status::out_of_range(e.to_string())
        }
        Some(m) if m.contains("held by engine session") => Status::aborted(format!(
            "{e} (the volume was staged while it grew; the retry grows it through its engine)"
        )),
        Some(m) if m.contains("healthy") || m.contains("flatten") => {
            Status::failed_precondition(e.to_string())
        }
        _ => e.status(),
    }
}

/// Whether a node with `node` segments is inside a topology.
fn matches(want: &HashMap<String, String>, node: &BTreeMap<String, String>) -> bool {
    want.iter().all(|(k, v)| node.get(k) == Some(v))
}

/// The volume is reachable from every node (its engine can run on any of
/// them). With a requirement, the answer is the requisite (or, without
/// one, the preferred) topologies some known node is in; none such is
/// RESOURCE_EXHAUSTED, as the spec asks.
fn accessible_topology(
    cluster: &Cluster,
    req: Option<&TopologyRequirement>,
) -> Result<Vec<Topology>, Status> {
    let Some(req) = req else {
        return Ok(Vec::new());
    };
    let wanted = if req.requisite.is_empty() {
        &req.preferred
    } else {
        &req.requisite
    };
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let inside: Vec<Topology> = wanted
        .iter()
        .filter(|t| {
            cluster
                .nodes()
                .iter()
                .any(|n| matches(&t.segments, &n.segments()))
        })
        .cloned()
        .collect();
    if inside.is_empty() && !req.requisite.is_empty() {
        return Err(Status::resource_exhausted(
            "no node of the node list is in any requisite topology",
        ));
    }
    Ok(inside)
}

/// The `replicas` parameter, and a refusal of any parameter unknown.
fn replicas_param(params: &HashMap<String, String>) -> Result<usize, Status> {
    let mut replicas = DEFAULT_REPLICAS;
    for (k, v) in params {
        if k == PARAM_REPLICAS {
            replicas = match v.parse::<usize>() {
                Ok(n) if (1..=MAX_REPLICAS).contains(&n) => n,
                _ => {
                    return Err(Status::invalid_argument(format!(
                        "parameter {PARAM_REPLICAS}={v:?}: 1 to {MAX_REPLICAS}"
                    )))
                }
            };
        } else if !k.starts_with(CO_PARAM_PREFIX) {
            return Err(Status::invalid_argument(format!(
                "unknown parameter {k:?} (this plugin takes {PARAM_REPLICAS})"
            )));
        }
    }
    Ok(replicas)
}

/// The size to create from a capacity range: the required bytes rounded
/// up to whole 4 KiB blocks, within the limit.
fn size_from_range(range: Option<&CapacityRange>) -> Result<u64, Status> {
    let (required, limit) = match range {
        None => (0, 0),
        Some(r) => (r.required_bytes, r.limit_bytes),
    };
    if required < 0 || limit < 0 {
        return Err(Status::invalid_argument("capacity_range: negative bytes"));
    }
    let (required, limit) = (required as u64, limit as u64);
    if limit != 0 && limit < required {
        return Err(Status::invalid_argument(format!(
            "capacity_range: limit_bytes {limit} is below required_bytes {required}"
        )));
    }
    let want = if required == 0 {
        if limit == 0 {
            DEFAULT_VOLUME_BYTES
        } else {
            DEFAULT_VOLUME_BYTES.min(limit)
        }
    } else {
        required
    };
    let size = want.div_ceil(VOLUME_ALIGN_BYTES) * VOLUME_ALIGN_BYTES;
    if size == 0 || (limit != 0 && size > limit) {
        return Err(Status::out_of_range(format!(
            "capacity_range: no whole number of {VOLUME_ALIGN_BYTES}-byte blocks between required_bytes {required} and limit_bytes {limit}"
        )));
    }
    if size > MAX_VOLUME_BYTES {
        return Err(Status::out_of_range(format!(
            "capacity_range: {size} bytes, at most {MAX_VOLUME_BYTES}"
        )));
    }
    Ok(size)
}

#[tonic::async_trait]
impl Controller for ControllerPlugin {
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        Ok(Response::new(self.create(request.into_inner()).await?))
    }

    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        self.delete(request.into_inner()).await?;
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        _request: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "ControllerPublishVolume: not offered (no PUBLISH_UNPUBLISH_VOLUME capability; NodeStageVolume attaches)",
        ))
    }

    async fn controller_unpublish_volume(
        &self,
        _request: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "ControllerUnpublishVolume: not offered (no PUBLISH_UNPUBLISH_VOLUME capability)",
        ))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities is required"));
        }
        let id = VolumeId::parse(&req.volume_id).ok_or_else(|| {
            Status::not_found(format!(
                "no volume {:?} (not an id of this plugin)",
                req.volume_id
            ))
        })?;
        self.existing_size(&id).await?;
        if let Err(why) = replicas_param(&req.parameters) {
            return Ok(Response::new(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: why.message().to_string(),
            }));
        }
        Ok(Response::new(
            match capability::check_all(&req.volume_capabilities) {
                Ok(()) => ValidateVolumeCapabilitiesResponse {
                    confirmed: Some(validate_volume_capabilities_response::Confirmed {
                        volume_context: req.volume_context,
                        volume_capabilities: req.volume_capabilities,
                        parameters: req.parameters,
                        mutable_parameters: HashMap::new(),
                    }),
                    message: String::new(),
                },
                Err(why) => ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: why,
                },
            },
        ))
    }

    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        Ok(Response::new(self.list(request.into_inner()).await?))
    }

    async fn controller_list_volume_health(
        &self,
        _request: Request<ControllerListVolumeHealthRequest>,
    ) -> Result<Response<ControllerListVolumeHealthResponse>, Status> {
        Err(Status::unimplemented(
            "ControllerListVolumeHealth: not offered",
        ))
    }

    async fn controller_get_volume_health(
        &self,
        request: Request<ControllerGetVolumeHealthRequest>,
    ) -> Result<Response<ControllerGetVolumeHealthResponse>, Status> {
        let seen = self.observe(&request.into_inner().volume_id).await?;
        Ok(Response::new(ControllerGetVolumeHealthResponse {
            volume_health: Some(VolumeHealth {
                health_statuses: health::entries(&seen.replicas, &seen.engines),
                volume_id: seen.volume_id,
            }),
        }))
    }

    async fn get_capacity(
        &self,
        request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        Ok(Response::new(self.capacity(request.into_inner()).await?))
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        use controller_service_capability::rpc::Type;
        let capabilities = [
            Type::CreateDeleteVolume,
            Type::ListVolumes,
            Type::GetCapacity,
            Type::GetVolume,
            Type::GetVolumeHealth,
            Type::ExpandVolume,
            Type::CreateDeleteSnapshot,
            Type::ListSnapshots,
            Type::GetSnapshot,
            Type::CloneVolume,
        ]
        .into_iter()
        .map(|t| ControllerServiceCapability {
            r#type: Some(controller_service_capability::Type::Rpc(
                controller_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect();
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities,
        }))
    }

    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        Ok(Response::new(
            self.create_snapshot_op(request.into_inner()).await?,
        ))
    }

    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        self.delete_snapshot_op(request.into_inner()).await?;
        Ok(Response::new(DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        Ok(Response::new(
            self.list_snapshots_op(request.into_inner()).await?,
        ))
    }

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        Ok(Response::new(
            self.get_snapshot_op(request.into_inner()).await?,
        ))
    }

    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        Ok(Response::new(self.expand(request.into_inner()).await?))
    }

    async fn controller_get_volume(
        &self,
        request: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        let seen = self.observe(&request.into_inner().volume_id).await?;
        Ok(Response::new(ControllerGetVolumeResponse {
            volume: Some(Volume {
                capacity_bytes: seen.size_bytes as i64,
                volume_id: seen.volume_id,
                ..Default::default()
            }),
            status: Some(controller_get_volume_response::VolumeStatus {
                // The nodes running an engine of it: where it is staged.
                published_node_ids: seen.engines.into_iter().map(|(n, _)| n).collect(),
            }),
        }))
    }

    async fn controller_modify_volume(
        &self,
        _request: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        Err(Status::unimplemented(
            "ControllerModifyVolume: not offered (no MODIFY_VOLUME capability)",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_up_within_the_limit() {
        let r = |required, limit| {
            size_from_range(Some(&CapacityRange {
                required_bytes: required,
                limit_bytes: limit,
            }))
        };
        assert_eq!(size_from_range(None).unwrap(), DEFAULT_VOLUME_BYTES);
        assert_eq!(r(1, 0).unwrap(), 4096);
        assert_eq!(r(8192, 8192).unwrap(), 8192);
        assert_eq!(r(0, 1 << 20).unwrap(), 1 << 20);
        assert_eq!(r(5000, 6000).unwrap_err().code(), tonic::Code::OutOfRange);
        assert_eq!(r(10, 5).unwrap_err().code(), tonic::Code::InvalidArgument);
        assert_eq!(r(-1, 0).unwrap_err().code(), tonic::Code::InvalidArgument);
        assert_eq!(
            r(MAX_VOLUME_BYTES as i64 + 1, 0).unwrap_err().code(),
            tonic::Code::OutOfRange
        );
    }

    #[test]
    fn parameters_are_checked() {
        let p = |pairs: &[(&str, &str)]| {
            replicas_param(
                &pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        assert_eq!(p(&[]).unwrap(), DEFAULT_REPLICAS);
        assert_eq!(p(&[("replicas", "3")]).unwrap(), 3);
        assert_eq!(
            p(&[("csi.storage.k8s.io/pvc/name", "x")]).unwrap(),
            DEFAULT_REPLICAS
        );
        assert!(p(&[("replicas", "0")]).is_err());
        assert!(p(&[("replicas", "4")]).is_err());
        assert!(p(&[("replica", "2")]).is_err());
    }
}
