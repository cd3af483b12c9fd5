//! Staging against real node daemons: a filesystem is made once and
//! found again at the next stage; a stage that fails undoes what it set
//! up (no engine, no device, no FUSE mount left).

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::Nodes;
use lull_csi::attach::{self, FuseDirs, Method};
use lull_csi::controller::ControllerPlugin;
use lull_csi::node::{NodeConfig, NodePlugin};
use lull_csi::pb::controller_server::Controller;
use lull_csi::pb::node_server::Node;
use lull_csi::pb::volume_capability::access_mode::Mode;
use lull_csi::pb::volume_capability::{AccessMode, AccessType, MountVolume};
use lull_csi::pb::*;
use lull_csi::volume_id::VolumeId;
use serde_json::json;
use tonic::Request;

fn mount_cap(flags: &[&str]) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: "ext4".into(),
            mount_flags: flags.iter().map(|f| f.to_string()).collect(),
            ..Default::default()
        })),
    }
}

async fn create(nodes: &Nodes, name: &str) -> String {
    ControllerPlugin::new(nodes.cluster.clone())
        .create_volume(Request::new(CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![mount_cap(&[])],
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

fn stage_req(volume_id: &str, staging: &Path, flags: &[&str]) -> Request<NodeStageVolumeRequest> {
    Request::new(NodeStageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
        volume_capability: Some(mount_cap(flags)),
        ..Default::default()
    })
}

fn unstage_req(volume_id: &str, staging: &Path) -> Request<NodeUnstageVolumeRequest> {
    Request::new(NodeUnstageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filesystem_is_made_once_and_its_files_stay() {
    common::require_fuse().await;
    let nodes = Nodes::start("stage-mkfs", Default::default()).await;
    let volume_id = create(&nodes, "keep").await;
    let node = NodePlugin::new(
        nodes.cluster.clone(),
        NodeConfig {
            node_id: "node1".into(),
            state_dir: nodes.work.join("state"),
            attach: Method::Fuse,
        },
    );
    let staging = nodes.work.join("staging");
    node.node_stage_volume(stage_req(&volume_id, &staging, &[]))
        .await
        .expect("first stage: mkfs and mount");
    // A second stage is the same stage (idempotent).
    node.node_stage_volume(stage_req(&volume_id, &staging, &[]))
        .await
        .expect("the stage again");
    let file = staging.join("kept.txt");
    std::fs::write(&file, b"acknowledged").unwrap();
    sync_file(&file);
    std::fs::File::open(&staging).unwrap().sync_all().unwrap();
    node.node_unstage_volume(unstage_req(&volume_id, &staging))
        .await
        .expect("unstage");
    node.node_unstage_volume(unstage_req(&volume_id, &staging))
        .await
        .expect("unstage again");
    assert!(!file.exists(), "unstaged, yet the file is still there");
    node.node_stage_volume(stage_req(&volume_id, &staging, &[]))
        .await
        .expect("second stage: no mkfs");
    assert_eq!(
        std::fs::read(&file).expect("the file after a new stage"),
        b"acknowledged"
    );
    node.node_unstage_volume(unstage_req(&volume_id, &staging))
        .await
        .expect("unstage");
}

/// fsync of the file itself: its data reaches the device before unstage.
fn sync_file(path: &Path) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .sync_all()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_stage_leaves_nothing_behind() {
    common::require_fuse().await;
    let nodes = Nodes::start("stage-fail", Default::default()).await;
    let volume_id = create(&nodes, "undone").await;
    let id = VolumeId::parse(&volume_id).unwrap();
    let state = nodes.work.join("state");
    let node = NodePlugin::new(
        nodes.cluster.clone(),
        NodeConfig {
            node_id: "node1".into(),
            state_dir: state.clone(),
            attach: Method::Fuse,
        },
    );
    let staging = nodes.work.join("staging");
    // mkfs works, then mount refuses an option it does not know.
    let err = node
        .node_stage_volume(stage_req(&volume_id, &staging, &["no-such-option"]))
        .await
        .expect_err("a stage with a bad mount option");
    assert!(err.message().contains("mount"), "{err:?}");
    let dirs = FuseDirs::new(&state, &id.name);
    assert!(!dirs.mount.exists(), "the FUSE mount point is left");
    assert!(
        attach::loops_of(&dirs.file)
            .await
            .unwrap_or_default()
            .is_empty(),
        "a loop device is left"
    );
    let engine = nodes
        .cluster
        .call("node1", "replica_list", json!({ "volume": id.name }))
        .await;
    assert!(
        engine
            .as_ref()
            .err()
            .and_then(|e| e.refusal())
            .is_some_and(|m| m.contains("no volume")),
        "the engine is left: {engine:?}"
    );
    // And the volume stages once the request is right.
    node.node_stage_volume(stage_req(&volume_id, &staging, &[]))
        .await
        .expect("a good stage after the failed one");
    node.node_unstage_volume(unstage_req(&volume_id, &staging))
        .await
        .expect("unstage");
}
