//! Expansion against real node daemons: ControllerExpandVolume grows a
//! staged volume through its engine and an unstaged one on its stores;
//! NodeExpandVolume grows the device and the filesystem where the
//! attach can (with `fuse`: at the next stage, and says so while staged);
//! a shrink is refused.

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
use lull_csi::pb::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use lull_csi::pb::*;
use lull_csi::volume_id::VolumeId;
use serde_json::json;
use tonic::{Code, Request};

const OLD_BYTES: u64 = 64 << 20;
const NEW_BYTES: u64 = 128 << 20;

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

fn block_cap() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
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

async fn create(c: &ControllerPlugin, name: &str, cap: VolumeCapability) -> String {
    c.create_volume(Request::new(CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: OLD_BYTES as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap],
        parameters: HashMap::from([("replicas".to_string(), "2".to_string())]),
        ..Default::default()
    }))
    .await
    .expect("CreateVolume")
    .into_inner()
    .volume
    .unwrap()
    .volume_id
}

async fn controller_expand(
    c: &ControllerPlugin,
    volume_id: &str,
    required: u64,
    limit: u64,
    cap: VolumeCapability,
) -> Result<ControllerExpandVolumeResponse, tonic::Status> {
    c.controller_expand_volume(Request::new(ControllerExpandVolumeRequest {
        volume_id: volume_id.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: required as i64,
            limit_bytes: limit as i64,
        }),
        volume_capability: Some(cap),
        ..Default::default()
    }))
    .await
    .map(|r| r.into_inner())
}

async fn node_expand(
    n: &NodePlugin,
    volume_id: &str,
    path: &Path,
    staging: &Path,
    cap: Option<VolumeCapability>,
) -> Result<NodeExpandVolumeResponse, tonic::Status> {
    n.node_expand_volume(Request::new(NodeExpandVolumeRequest {
        volume_id: volume_id.into(),
        volume_path: path.to_string_lossy().into_owned(),
        staging_target_path: staging.to_string_lossy().into_owned(),
        capacity_range: Some(CapacityRange {
            required_bytes: NEW_BYTES as i64,
            limit_bytes: 0,
        }),
        volume_capability: cap,
        ..Default::default()
    }))
    .await
    .map(|r| r.into_inner())
}

async fn stage_and_publish(
    n: &NodePlugin,
    volume_id: &str,
    staging: &Path,
    target: &Path,
    cap: VolumeCapability,
) {
    n.node_stage_volume(Request::new(NodeStageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    }))
    .await
    .expect("NodeStageVolume");
    n.node_publish_volume(Request::new(NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
        target_path: target.to_string_lossy().into_owned(),
        volume_capability: Some(cap),
        ..Default::default()
    }))
    .await
    .expect("NodePublishVolume");
}

async fn unpublish_and_unstage(n: &NodePlugin, volume_id: &str, staging: &Path, target: &Path) {
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

/// Every replica's size on its store (`replica_get`).
async fn replica_sizes(nodes: &Nodes, volume_id: &str) -> Vec<u64> {
    let id = VolumeId::parse(volume_id).unwrap();
    let mut sizes = Vec::new();
    for node in &id.nodes {
        let r = nodes
            .cluster
            .call(node, "replica_get", json!({ "name": id.name }))
            .await
            .expect("replica_get");
        sizes.push(r["size_bytes"].as_u64().unwrap());
    }
    sizes
}

/// Bytes of the filesystem mounted at `path` (statvfs).
fn fs_bytes(path: &Path) -> u64 {
    let st = rustix::fs::statvfs(path).expect("statvfs");
    st.f_blocks * st.f_frsize
}

fn device_bytes(path: &Path) -> u64 {
    let out = std::process::Command::new("blockdev")
        .arg("--getsize64")
        .arg(path)
        .output()
        .expect("blockdev (util-linux)");
    assert!(out.status.success(), "blockdev: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mounted_volume_grows_online_and_its_filesystem_at_the_next_stage() {
    common::require_fuse().await;
    let nodes = Nodes::start("expand-mount", Default::default()).await;
    let (c, n) = plugins(&nodes);
    let volume_id = create(&c, "grow-fs", mount_cap()).await;
    let staging = nodes.work.join("staging");
    let target = nodes.work.join("target");
    stage_and_publish(&n, &volume_id, &staging, &target, mount_cap()).await;
    let file = target.join("kept.txt");
    std::fs::write(&file, b"written before the grow").unwrap();
    std::fs::File::open(&file).unwrap().sync_all().unwrap();
    let before = fs_bytes(&target);
    assert!(before < OLD_BYTES, "{before}");

    // A shrink is refused, and so is a range the volume is already past.
    let shrink = controller_expand(&c, &volume_id, OLD_BYTES / 2, OLD_BYTES / 2, mount_cap())
        .await
        .expect_err("a shrink");
    assert_eq!(shrink.code(), Code::OutOfRange, "{shrink:?}");
    // Staged on node1: the engine there grows every replica, online.
    let r = controller_expand(&c, &volume_id, NEW_BYTES, 0, mount_cap())
        .await
        .expect("ControllerExpandVolume of a staged volume");
    assert_eq!(r.capacity_bytes as u64, NEW_BYTES);
    assert!(r.node_expansion_required, "a filesystem grows on the node");
    assert_eq!(replica_sizes(&nodes, &volume_id).await, [NEW_BYTES; 2]);
    // Idempotent: the size reached answers OK with that size.
    let again = controller_expand(&c, &volume_id, NEW_BYTES - 4096, 0, mount_cap())
        .await
        .expect("the same expand again");
    assert_eq!(again.capacity_bytes as u64, NEW_BYTES);

    // The fuse attach cannot grow while staged: said, not faked.
    let err = node_expand(&n, &volume_id, &target, &staging, Some(mount_cap()))
        .await
        .expect_err("NodeExpandVolume of a staged fuse attach");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("fuse attach method"), "{err:?}");
    assert_eq!(fs_bytes(&target), before, "the filesystem changed anyway");
    assert_eq!(std::fs::read(&file).unwrap(), b"written before the grow");

    // Staged again (the pod restarted): the device has the new size and
    // the stage grows the ext4 before mounting it (offline: no
    // CAP_SYS_RESOURCE needed, which this machine's root may lack).
    unpublish_and_unstage(&n, &volume_id, &staging, &target).await;
    stage_and_publish(&n, &volume_id, &staging, &target, mount_cap()).await;
    assert!(
        fs_bytes(&target) > before + (NEW_BYTES - OLD_BYTES) * 9 / 10,
        "the stage did not grow the filesystem: {before} -> {} bytes",
        fs_bytes(&target)
    );
    let grown = node_expand(&n, &volume_id, &target, &staging, Some(mount_cap()))
        .await
        .expect("NodeExpandVolume after the next stage");
    assert_eq!(grown.capacity_bytes as u64, NEW_BYTES);
    let after = fs_bytes(&target);
    assert!(
        after > before + (NEW_BYTES - OLD_BYTES) * 9 / 10,
        "the filesystem did not grow: {before} -> {after} bytes"
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"written before the grow");
    // Idempotent, and without a capability (the path says mount).
    node_expand(&n, &volume_id, &target, &staging, None)
        .await
        .expect("NodeExpandVolume again");
    assert_eq!(fs_bytes(&target), after);
    // A file larger than the old filesystem fits now.
    let big = target.join("big");
    std::fs::write(&big, vec![7u8; (OLD_BYTES + (8 << 20)) as usize]).unwrap();
    std::fs::File::open(&big).unwrap().sync_all().unwrap();
    unpublish_and_unstage(&n, &volume_id, &staging, &target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_volume_grows_on_its_stores_when_staged_nowhere() {
    common::require_fuse().await;
    let nodes = Nodes::start("expand-block", Default::default()).await;
    let (c, n) = plugins(&nodes);
    let volume_id = create(&c, "grow-block", block_cap()).await;
    // Staged nowhere: the stores grow their replicas.
    let r = controller_expand(&c, &volume_id, NEW_BYTES, 0, block_cap())
        .await
        .expect("ControllerExpandVolume of a volume staged nowhere");
    assert_eq!(r.capacity_bytes as u64, NEW_BYTES);
    assert!(!r.node_expansion_required, "a block volume is its device");
    assert_eq!(replica_sizes(&nodes, &volume_id).await, [NEW_BYTES; 2]);
    let again = controller_expand(&c, &volume_id, NEW_BYTES, NEW_BYTES, block_cap())
        .await
        .expect("the same expand again");
    assert_eq!(again.capacity_bytes as u64, NEW_BYTES);
    let shrink = controller_expand(&c, &volume_id, OLD_BYTES, OLD_BYTES, block_cap())
        .await
        .expect_err("a shrink");
    assert_eq!(shrink.code(), Code::OutOfRange, "{shrink:?}");
    let got = c
        .controller_get_volume(Request::new(ControllerGetVolumeRequest {
            volume_id: volume_id.clone(),
        }))
        .await
        .expect("ControllerGetVolume")
        .into_inner();
    assert_eq!(got.volume.unwrap().capacity_bytes as u64, NEW_BYTES);

    // Staged: the engine and the device have the new size.
    let staging = nodes.work.join("staging");
    let target = nodes.work.join("dev");
    stage_and_publish(&n, &volume_id, &staging, &target, block_cap()).await;
    assert_eq!(device_bytes(&target), NEW_BYTES);
    let grown = node_expand(&n, &volume_id, &target, &staging, Some(block_cap()))
        .await
        .expect("NodeExpandVolume of a block volume");
    assert_eq!(grown.capacity_bytes as u64, NEW_BYTES);
    // Without a capability: the path (a device file) says block.
    node_expand(&n, &volume_id, &target, &staging, None)
        .await
        .expect("NodeExpandVolume without a capability");
    // Asking the node for more than the volume has is refused.
    let err = n
        .node_expand_volume(Request::new(NodeExpandVolumeRequest {
            volume_id: volume_id.clone(),
            volume_path: target.to_string_lossy().into_owned(),
            capacity_range: Some(CapacityRange {
                required_bytes: (2 * NEW_BYTES) as i64,
                limit_bytes: 0,
            }),
            ..Default::default()
        }))
        .await
        .expect_err("more than the volume has");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    unpublish_and_unstage(&n, &volume_id, &staging, &target).await;
}
