//! Snapshots and clones against real node daemons: CreateSnapshot through
//! the engine of a staged volume and on the stores of one staged nowhere,
//! volumes made from a snapshot and from a volume read what their source
//! held then (ext4 mounted through the fuse attach), ListSnapshots
//! filters and pages, GetSnapshot finds what it lists (NOT_FOUND once
//! deleted), and what is refused while clones use a snapshot; snapshots
//! that are backups (the `backupTarget` parameter, a directory target)
//! restored by a second cluster of daemons that never held the volume.

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::Nodes;
use lull_csi::attach::Method;
use lull_csi::controller::ControllerPlugin;
use lull_csi::node::{NodeConfig, NodePlugin};
use lull_csi::pb::controller_server::Controller;
use lull_csi::pb::node_server::Node;
use lull_csi::pb::volume_capability::access_mode::Mode;
use lull_csi::pb::volume_capability::{AccessMode, AccessType, MountVolume};
use lull_csi::pb::*;
use lull_csi::volume_id::VolumeId;
use serde_json::{json, Value};
use tonic::{Code, Request};

const VOLUME_BYTES: u64 = 64 << 20;

fn mount_cap() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            ..Default::default()
        })),
    }
}

fn plugins(nodes: &Nodes) -> (ControllerPlugin, NodePlugin) {
    (
        ControllerPlugin::new(nodes.cluster.clone()),
        NodePlugin::new(
            nodes.cluster.clone(),
            NodeConfig {
                node_id: "node1".into(),
                state_dir: nodes.work.join("state"),
                attach: Method::Fuse,
            },
        ),
    )
}

async fn create(
    c: &ControllerPlugin,
    name: &str,
    required: u64,
    source: Option<volume_content_source::Type>,
) -> Result<Volume, tonic::Status> {
    c.create_volume(Request::new(CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: required as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![mount_cap()],
        parameters: HashMap::from([("replicas".to_string(), "2".to_string())]),
        volume_content_source: source.map(|t| VolumeContentSource { r#type: Some(t) }),
        ..Default::default()
    }))
    .await
    .map(|r| r.into_inner().volume.unwrap())
}

fn from_snapshot(id: &str) -> Option<volume_content_source::Type> {
    Some(volume_content_source::Type::Snapshot(
        volume_content_source::SnapshotSource {
            snapshot_id: id.into(),
        },
    ))
}

fn from_volume(id: &str) -> Option<volume_content_source::Type> {
    Some(volume_content_source::Type::Volume(
        volume_content_source::VolumeSource {
            volume_id: id.into(),
        },
    ))
}

async fn snapshot(
    c: &ControllerPlugin,
    name: &str,
    volume_id: &str,
) -> Result<Snapshot, tonic::Status> {
    snapshot_with(c, name, volume_id, HashMap::new()).await
}

async fn snapshot_with(
    c: &ControllerPlugin,
    name: &str,
    volume_id: &str,
    parameters: HashMap<String, String>,
) -> Result<Snapshot, tonic::Status> {
    c.create_snapshot(Request::new(CreateSnapshotRequest {
        name: name.into(),
        source_volume_id: volume_id.into(),
        parameters,
        ..Default::default()
    }))
    .await
    .map(|r| r.into_inner().snapshot.unwrap())
}

async fn delete_snapshot(c: &ControllerPlugin, id: &str) -> Result<(), tonic::Status> {
    c.delete_snapshot(Request::new(DeleteSnapshotRequest {
        snapshot_id: id.into(),
        ..Default::default()
    }))
    .await
    .map(|_| ())
}

async fn delete_volume(c: &ControllerPlugin, id: &str) -> Result<(), tonic::Status> {
    c.delete_volume(Request::new(DeleteVolumeRequest {
        volume_id: id.into(),
        ..Default::default()
    }))
    .await
    .map(|_| ())
}

async fn list(c: &ControllerPlugin, req: ListSnapshotsRequest) -> ListSnapshotsResponse {
    c.list_snapshots(Request::new(req))
        .await
        .expect("ListSnapshots")
        .into_inner()
}

async fn get_snapshot(c: &ControllerPlugin, id: &str) -> Result<Snapshot, tonic::Status> {
    c.get_snapshot(Request::new(GetSnapshotRequest {
        snapshot_id: id.into(),
        ..Default::default()
    }))
    .await
    .map(|r| {
        r.into_inner()
            .snapshot
            .expect("GetSnapshot answers a snapshot")
    })
}

fn ids(r: &ListSnapshotsResponse) -> Vec<String> {
    r.entries
        .iter()
        .map(|e| e.snapshot.as_ref().unwrap().snapshot_id.clone())
        .collect()
}

async fn stage(n: &NodePlugin, volume_id: &str, staging: &Path, target: &Path) {
    n.node_stage_volume(Request::new(NodeStageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
        volume_capability: Some(mount_cap()),
        ..Default::default()
    }))
    .await
    .expect("NodeStageVolume");
    n.node_publish_volume(Request::new(NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
        target_path: target.to_string_lossy().into_owned(),
        volume_capability: Some(mount_cap()),
        ..Default::default()
    }))
    .await
    .expect("NodePublishVolume");
}

async fn unstage(n: &NodePlugin, volume_id: &str, staging: &Path, target: &Path) {
    n.node_unpublish_volume(Request::new(NodeUnpublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.to_string_lossy().into_owned(),
    }))
    .await
    .expect("NodeUnpublishVolume");
    n.node_unstage_volume(Request::new(NodeUnstageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
    }))
    .await
    .expect("NodeUnstageVolume");
}

fn write_synced(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap();
    std::fs::File::open(path).unwrap().sync_all().unwrap();
    std::fs::File::open(path.parent().unwrap())
        .unwrap()
        .sync_all()
        .unwrap();
}

/// `replica_get` of the volume's replicas.
async fn replicas(nodes: &Nodes, volume_id: &str) -> Vec<Value> {
    let id = VolumeId::parse(volume_id).unwrap();
    let mut out = Vec::new();
    for node in &id.nodes {
        out.push(
            nodes
                .cluster
                .call(node, "replica_get", json!({ "name": id.name }))
                .await
                .expect("replica_get"),
        );
    }
    out
}

/// The names of a replica's own snapshots not being deleted.
fn snapshot_names(replica: &Value) -> Vec<String> {
    replica["snapshots"]
        .as_array()
        .expect("replica_get lists snapshots")
        .iter()
        .filter(|s| !s["inherited"].as_bool().unwrap() && !s["merging"].as_bool().unwrap())
        .map(|s| s["name"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_volume_snapshots_through_its_engine_and_a_clone_reads_what_it_held() {
    common::require_fuse().await;
    let nodes = Nodes::start("snap-staged", Default::default()).await;
    let (c, n) = plugins(&nodes);
    let source = create(&c, "src", VOLUME_BYTES, None)
        .await
        .expect("CreateVolume")
        .volume_id;
    let (staging, target) = (nodes.work.join("staging"), nodes.work.join("target"));
    stage(&n, &source, &staging, &target).await;
    write_synced(&target.join("before.txt"), b"written before the snapshot");

    // Staged on node1: a store refuses a snapshot of the replica its
    // engine holds (the engine takes them, on every replica at once).
    let id = VolumeId::parse(&source).unwrap();
    let held = nodes
        .cluster
        .call(
            &id.nodes[0],
            "replica_snapshot",
            json!({ "name": id.name, "snapshot": "by-hand", "op": "create" }),
        )
        .await
        .expect_err("a store snapshot of a held replica");
    assert!(
        held.refusal().is_some_and(|m| m.contains("held by engine")),
        "{held}"
    );

    let snap = snapshot(&c, "snap-1", &source)
        .await
        .expect("CreateSnapshot");
    assert!(snap.ready_to_use);
    assert_eq!(snap.source_volume_id, source);
    assert_eq!(snap.size_bytes as u64, VOLUME_BYTES);
    assert!(snap.creation_time.is_some_and(|t| t.seconds > 0));
    for r in replicas(&nodes, &source).await {
        assert_eq!(snapshot_names(&r), ["snap-1"], "{r}");
    }
    // Idempotent by name and source; the name on another source is taken.
    let again = snapshot(&c, "snap-1", &source)
        .await
        .expect("the same again");
    assert_eq!(again.snapshot_id, snap.snapshot_id);
    let other = create(&c, "other", VOLUME_BYTES, None)
        .await
        .expect("CreateVolume")
        .volume_id;
    let taken = snapshot(&c, "snap-1", &other)
        .await
        .expect_err("name taken");
    assert_eq!(taken.code(), Code::AlreadyExists, "{taken:?}");

    write_synced(&target.join("after.txt"), b"written after the snapshot");

    // A clone keeps its source's size: a larger one is refused.
    let larger = create(
        &c,
        "too-big",
        2 * VOLUME_BYTES,
        from_snapshot(&snap.snapshot_id),
    )
    .await
    .expect_err("a larger clone");
    assert_eq!(larger.code(), Code::OutOfRange, "{larger:?}");
    let missing = create(
        &c,
        "nothing",
        VOLUME_BYTES,
        from_snapshot("src@node1+node2/nope"),
    )
    .await
    .expect_err("no such snapshot");
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");

    let clone = create(&c, "clone", VOLUME_BYTES, from_snapshot(&snap.snapshot_id))
        .await
        .expect("CreateVolume from a snapshot");
    assert_eq!(clone.capacity_bytes as u64, VOLUME_BYTES);
    assert!(clone.content_source.is_some());
    assert_eq!(
        VolumeId::parse(&clone.volume_id).unwrap().nodes,
        id.nodes,
        "a clone is on its source's nodes"
    );
    let (cstaging, ctarget) = (nodes.work.join("cstaging"), nodes.work.join("ctarget"));
    stage(&n, &clone.volume_id, &cstaging, &ctarget).await;
    assert_eq!(
        std::fs::read(ctarget.join("before.txt")).unwrap(),
        b"written before the snapshot"
    );
    assert!(
        !ctarget.join("after.txt").exists(),
        "the clone holds a write made after its snapshot"
    );
    // The clone is its own volume: its writes stay in it.
    write_synced(&ctarget.join("clone.txt"), b"the clone's own");
    assert!(!target.join("clone.txt").exists());

    // Refused while the clone stands on the snapshot (and the source).
    let busy = delete_snapshot(&c, &snap.snapshot_id)
        .await
        .expect_err("DeleteSnapshot with a clone");
    assert_eq!(busy.code(), Code::FailedPrecondition, "{busy:?}");
    assert!(busy.message().contains("clone"), "{busy:?}");

    // ListSnapshots: by source, by id, paged.
    let snap2 = snapshot(&c, "snap-2", &source)
        .await
        .expect("a second snapshot");
    let by_source = list(
        &c,
        ListSnapshotsRequest {
            source_volume_id: source.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        ids(&by_source),
        [snap.snapshot_id.as_str(), snap2.snapshot_id.as_str()]
    );
    let by_id = list(
        &c,
        ListSnapshotsRequest {
            snapshot_id: snap2.snapshot_id.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&by_id), [snap2.snapshot_id.as_str()]);
    assert!(by_id.entries[0].snapshot.as_ref().unwrap().ready_to_use);
    // GetSnapshot: what ListSnapshots by id lists; NOT_FOUND for an id
    // of this plugin's form that names no snapshot, INVALID_ARGUMENT
    // for none.
    let got = get_snapshot(&c, &snap2.snapshot_id)
        .await
        .expect("GetSnapshot after CreateSnapshot");
    assert_eq!(Some(&got), by_id.entries[0].snapshot.as_ref());
    assert_eq!(got.source_volume_id, source);
    let unknown = format!("{source}/no-such-snapshot");
    let e = get_snapshot(&c, &unknown).await.expect_err("an unknown id");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = get_snapshot(&c, "").await.expect_err("no id");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let page = list(
        &c,
        ListSnapshotsRequest {
            max_entries: 1,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&page), [snap.snapshot_id.as_str()]);
    let rest = list(
        &c,
        ListSnapshotsRequest {
            starting_token: page.next_token.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(ids(&rest), [snap2.snapshot_id.as_str()]);
    assert!(rest.next_token.is_empty());
    let none = list(
        &c,
        ListSnapshotsRequest {
            source_volume_id: other.clone(),
            ..Default::default()
        },
    )
    .await;
    assert!(none.entries.is_empty());

    // Staged: snap-2 goes through the engine; a gone one is fine.
    delete_snapshot(&c, &snap2.snapshot_id)
        .await
        .expect("DeleteSnapshot");
    delete_snapshot(&c, &snap2.snapshot_id)
        .await
        .expect("DeleteSnapshot again");
    let left = list(&c, ListSnapshotsRequest::default()).await;
    assert_eq!(ids(&left), [snap.snapshot_id.as_str()]);
    let e = get_snapshot(&c, &snap2.snapshot_id)
        .await
        .expect_err("GetSnapshot of a deleted snapshot");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");

    unstage(&n, &clone.volume_id, &cstaging, &ctarget).await;
    unstage(&n, &source, &staging, &target).await;
    let base = delete_volume(&c, &source)
        .await
        .expect_err("DeleteVolume of a clone's source");
    assert_eq!(base.code(), Code::FailedPrecondition, "{base:?}");
    delete_volume(&c, &clone.volume_id)
        .await
        .expect("DeleteVolume of the clone");
    delete_snapshot(&c, &snap.snapshot_id)
        .await
        .expect("DeleteSnapshot once its clone is gone");
    delete_volume(&c, &source).await.expect("DeleteVolume");
    delete_volume(&c, &other).await.expect("DeleteVolume");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_staged_nowhere_snapshots_on_its_stores_and_clones_from_a_volume() {
    common::require_fuse().await;
    let nodes = Nodes::start("snap-stores", Default::default()).await;
    let (c, n) = plugins(&nodes);
    let source = create(&c, "src", VOLUME_BYTES, None)
        .await
        .expect("CreateVolume")
        .volume_id;
    let (staging, target) = (nodes.work.join("staging"), nodes.work.join("target"));
    stage(&n, &source, &staging, &target).await;
    write_synced(&target.join("first.txt"), b"first");
    unstage(&n, &source, &staging, &target).await;

    // Staged nowhere: every replica is clean at one generation, and the
    // stores take it.
    let before = replicas(&nodes, &source).await;
    for r in &before {
        assert!(r["clean"].as_bool().unwrap(), "{r}");
        assert!(r["held_by_session"].is_null(), "{r}");
        assert_eq!(r["generation"], before[0]["generation"]);
    }
    let snap = snapshot(&c, "s1", &source)
        .await
        .expect("CreateSnapshot on the stores");
    for r in replicas(&nodes, &source).await {
        assert_eq!(snapshot_names(&r), ["s1"], "{r}");
    }
    let again = snapshot(&c, "s1", &source).await.expect("the same again");
    assert_eq!(again.snapshot_id, snap.snapshot_id);

    stage(&n, &source, &staging, &target).await;
    write_synced(&target.join("second.txt"), b"second");
    unstage(&n, &source, &staging, &target).await;

    // From the snapshot: the first file only.
    let from_snap = create(
        &c,
        "from-snap",
        VOLUME_BYTES,
        from_snapshot(&snap.snapshot_id),
    )
    .await
    .expect("CreateVolume from a snapshot");
    // Nor does it grow later: its replicas refuse (flatten first).
    let grow = c
        .controller_expand_volume(Request::new(ControllerExpandVolumeRequest {
            volume_id: from_snap.volume_id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: (2 * VOLUME_BYTES) as i64,
                limit_bytes: 0,
            }),
            volume_capability: Some(mount_cap()),
            ..Default::default()
        }))
        .await
        .expect_err("ControllerExpandVolume of a clone");
    assert_eq!(grow.code(), Code::FailedPrecondition, "{grow:?}");
    assert!(grow.message().contains("flatten"), "{grow:?}");
    // From the volume: both (a snapshot of it now, then clones).
    let from_vol = create(&c, "from-vol", VOLUME_BYTES, from_volume(&source))
        .await
        .expect("CreateVolume from a volume");
    assert!(matches!(
        from_vol
            .content_source
            .as_ref()
            .and_then(|s| s.r#type.as_ref()),
        Some(volume_content_source::Type::Volume(_))
    ));
    let again = create(&c, "from-vol", VOLUME_BYTES, from_volume(&source))
        .await
        .expect("the same CreateVolume again");
    assert_eq!(again.volume_id, from_vol.volume_id);
    // The snapshot taken for it is not a CSI snapshot.
    let listed = list(&c, ListSnapshotsRequest::default()).await;
    assert_eq!(ids(&listed), [snap.snapshot_id.as_str()]);

    let (cstaging, ctarget) = (nodes.work.join("cstaging"), nodes.work.join("ctarget"));
    stage(&n, &from_snap.volume_id, &cstaging, &ctarget).await;
    assert_eq!(std::fs::read(ctarget.join("first.txt")).unwrap(), b"first");
    assert!(!ctarget.join("second.txt").exists());
    unstage(&n, &from_snap.volume_id, &cstaging, &ctarget).await;
    stage(&n, &from_vol.volume_id, &cstaging, &ctarget).await;
    assert_eq!(std::fs::read(ctarget.join("first.txt")).unwrap(), b"first");
    assert_eq!(
        std::fs::read(ctarget.join("second.txt")).unwrap(),
        b"second"
    );
    unstage(&n, &from_vol.volume_id, &cstaging, &ctarget).await;

    // Deleting the volume cloned from a volume deletes the snapshot taken
    // for it.
    delete_volume(&c, &from_vol.volume_id)
        .await
        .expect("DeleteVolume");
    for r in replicas(&nodes, &source).await {
        assert_eq!(snapshot_names(&r), ["s1"], "{r}");
    }
    let busy = delete_snapshot(&c, &snap.snapshot_id)
        .await
        .expect_err("DeleteSnapshot with a clone");
    assert_eq!(busy.code(), Code::FailedPrecondition, "{busy:?}");
    delete_volume(&c, &from_snap.volume_id)
        .await
        .expect("DeleteVolume");
    // On the stores now (staged nowhere).
    delete_snapshot(&c, &snap.snapshot_id)
        .await
        .expect("DeleteSnapshot");
    for r in replicas(&nodes, &source).await {
        assert!(snapshot_names(&r).is_empty(), "{r}");
    }
    assert!(list(&c, ListSnapshotsRequest::default())
        .await
        .entries
        .is_empty());
    delete_volume(&c, &source).await.expect("DeleteVolume");
}

fn backup_class(target: &str) -> HashMap<String, String> {
    HashMap::from([("backupTarget".to_string(), target.to_string())])
}

/// ListSnapshots of one id: the snapshot once it is ready.
async fn ready(c: &ControllerPlugin, id: &str) -> Snapshot {
    common::wait_for("the backup snapshot to be ready", || async {
        let r = list(
            c,
            ListSnapshotsRequest {
                snapshot_id: id.into(),
                ..Default::default()
            },
        )
        .await;
        r.entries
            .into_iter()
            .find_map(|e| e.snapshot)
            .filter(|s| s.ready_to_use)
    })
    .await
}

/// `backup_list` of volume `name` on target "bk", through node1.
async fn backups_of(nodes: &Nodes, name: &str) -> Vec<Value> {
    let v = nodes
        .cluster
        .call(
            "node1",
            "backup_list",
            json!({"target": "bk", "volume": name}),
        )
        .await
        .expect("backup_list");
    v.as_array().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_snapshot_restores_on_a_cluster_that_never_held_its_volume() {
    common::require_fuse().await;
    let nodes = Nodes::start("snap-backup", Default::default()).await;
    let dr = Nodes::start("snap-backup-dr", Default::default()).await;
    // One target directory, added on every node of both clusters (the
    // second stands for another site reading the same bucket).
    let dir = nodes.work.join("backups");
    std::fs::create_dir_all(&dir).unwrap();
    for cluster in [&nodes, &dr] {
        for n in 1..=3 {
            cluster
                .cluster
                .call(
                    &format!("node{n}"),
                    "backup_target_add",
                    json!({"name": "bk", "url": format!("file://{}", dir.display())}),
                )
                .await
                .expect("backup_target_add");
        }
    }
    let (c, n) = plugins(&nodes);
    let source = create(&c, "src", VOLUME_BYTES, None)
        .await
        .expect("CreateVolume")
        .volume_id;
    let (staging, target) = (nodes.work.join("staging"), nodes.work.join("target"));
    stage(&n, &source, &staging, &target).await;
    write_synced(&target.join("before.txt"), b"written before the backup");

    // Refused before anything is taken: a name that is no target's, a
    // target no node has.
    let bad = snapshot_with(&c, "bad", &source, backup_class("a/b"))
        .await
        .expect_err("a bad target name");
    assert_eq!(bad.code(), Code::InvalidArgument, "{bad:?}");
    let none = snapshot_with(&c, "none", &source, backup_class("nowhere"))
        .await
        .expect_err("a target no node has");
    assert_eq!(none.code(), Code::FailedPrecondition, "{none:?}");
    for r in replicas(&nodes, &source).await {
        assert!(snapshot_names(&r).is_empty(), "a refused backup left {r}");
    }

    // Staged on node1: the lull snapshot through the engine, its backup
    // read from a replica's files.
    let snap = snapshot_with(&c, "snap-b", &source, backup_class("bk"))
        .await
        .expect("CreateSnapshot with backupTarget");
    assert_eq!(snap.snapshot_id, "backup:bk/src/snap-b");
    assert_eq!(snap.source_volume_id, source);
    write_synced(&target.join("after.txt"), b"written after the backup");
    let done = ready(&c, &snap.snapshot_id).await;
    assert_eq!(done.size_bytes as u64, VOLUME_BYTES);
    let again = snapshot_with(&c, "snap-b", &source, backup_class("bk"))
        .await
        .expect("the same again");
    assert!(again.ready_to_use);
    assert_eq!(again.snapshot_id, snap.snapshot_id);
    let first = backups_of(&nodes, "src").await;
    assert_eq!(first.len(), 1, "{first:?}");
    // The replica forms refuse what they cannot do safely: a replica's
    // backup names its snapshot; a restore fills only a new replica
    // (this one is attached and has snapshots).
    let holder = VolumeId::parse(&source).unwrap().nodes[0].clone();
    let unnamed = nodes
        .cluster
        .call(
            &holder,
            "backup_create",
            json!({"volume": "src", "target": "bk", "replica": true}),
        )
        .await
        .expect_err("a replica's backup with no snapshot");
    assert!(
        unnamed.to_string().contains("names its snapshot"),
        "{unnamed}"
    );
    let over = nodes
        .cluster
        .call(
            &holder,
            "backup_restore",
            json!({"target": "bk", "backup": first[0]["id"], "name": "src", "replica": true}),
        )
        .await
        .expect_err("a restore over a replica in use");
    assert!(over.to_string().contains("is not new"), "{over}");
    for r in replicas(&nodes, &source).await {
        assert_eq!(
            snapshot_names(&r),
            ["snap-b"],
            "the backup's base stays: {r}"
        );
    }

    // The next backup is an incremental of the first (its snapshot kept
    // as the base): only what changed since is read.
    let snap2 = snapshot_with(&c, "snap-c", &source, backup_class("bk"))
        .await
        .expect("a second backup snapshot");
    ready(&c, &snap2.snapshot_id).await;
    let both = backups_of(&nodes, "src").await;
    let second = both
        .iter()
        .find(|b| b["snapshot"] == "snap-c")
        .expect("the second backup");
    assert_eq!(second["parent"], first[0]["id"], "{second}");
    assert!(
        second["stats"]["bytes_read"].as_u64().unwrap() < VOLUME_BYTES / 2,
        "an incremental reads what changed: {second}"
    );

    // The other cluster: no volume, no snapshot, the same target.
    let (c2, n2) = plugins(&dr);
    let found = get_snapshot(&c2, &snap.snapshot_id)
        .await
        .expect("GetSnapshot of a backup on another cluster");
    assert!(found.ready_to_use);
    let too_small = c2
        .create_volume(Request::new(CreateVolumeRequest {
            name: "small".into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 0,
                limit_bytes: (VOLUME_BYTES / 2) as i64,
            }),
            volume_capabilities: vec![mount_cap()],
            volume_content_source: Some(VolumeContentSource {
                r#type: from_snapshot(&snap.snapshot_id),
            }),
            ..Default::default()
        }))
        .await
        .expect_err("a limit under the backup's size");
    assert_eq!(too_small.code(), Code::OutOfRange, "{too_small:?}");
    let restored = common::wait_for("the restore", || async {
        match create(
            &c2,
            "restored",
            VOLUME_BYTES,
            from_snapshot(&snap.snapshot_id),
        )
        .await
        {
            Ok(v) => Some(v),
            Err(e) if e.code() == Code::Aborted => None,
            Err(e) => panic!("CreateVolume from a backup: {e:?}"),
        }
    })
    .await;
    assert_eq!(restored.capacity_bytes as u64, VOLUME_BYTES);
    assert!(restored.content_source.is_some());
    let (rstaging, rtarget) = (dr.work.join("staging"), dr.work.join("target"));
    stage(&n2, &restored.volume_id, &rstaging, &rtarget).await;
    assert_eq!(
        std::fs::read(rtarget.join("before.txt")).unwrap(),
        b"written before the backup"
    );
    assert!(
        !rtarget.join("after.txt").exists(),
        "the restore holds a write made after its backup's snapshot"
    );
    unstage(&n2, &restored.volume_id, &rstaging, &rtarget).await;
    delete_volume(&c2, &restored.volume_id)
        .await
        .expect("DeleteVolume");

    // DeleteSnapshot: the backup off the target, the snapshot off the
    // replicas; again is a no-op.
    delete_snapshot(&c, &snap.snapshot_id)
        .await
        .expect("DeleteSnapshot of a backup snapshot");
    let left = backups_of(&nodes, "src").await;
    assert!(left.iter().all(|b| b["snapshot"] != "snap-b"), "{left:?}");
    for r in replicas(&nodes, &source).await {
        assert_eq!(snapshot_names(&r), ["snap-c"], "{r}");
    }
    delete_snapshot(&c, &snap.snapshot_id)
        .await
        .expect("DeleteSnapshot again");
    assert!(get_snapshot(&c, &snap.snapshot_id).await.is_err());
    // The first's snapshot may still be merging: the engine refuses
    // another delete until it is done (FAILED_PRECONDITION, the CO
    // retries), and the retry finds the backup gone already.
    common::wait_for("DeleteSnapshot of the second", || async {
        match delete_snapshot(&c, &snap2.snapshot_id).await {
            Ok(()) => Some(()),
            Err(e) if e.code() == Code::FailedPrecondition => None,
            Err(e) => panic!("DeleteSnapshot of the second: {e:?}"),
        }
    })
    .await;
    assert!(backups_of(&nodes, "src").await.is_empty());
    unstage(&n, &source, &staging, &target).await;
    delete_volume(&c, &source).await.expect("DeleteVolume");
}
