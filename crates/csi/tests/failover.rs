//! The plugin against real node daemons: three `lull serve --store`
//! processes on loopback (the `lull` binary the workspace built), the
//! controller and two node services in this process, the fuse attach
//! method (nbdfuse and loop devices: needs root and /dev/fuse).
//!
//! Failover: a volume staged on node A (which holds none of its replicas)
//! is written and flushed; A's daemon is killed; staging on node B (a
//! replica node) creates a new engine there that reads back every
//! acknowledged byte. Two ways A comes back:
//!
//! - its daemon restarted: it recreates the engine it recorded (the
//!   plugin creates engines with `"resume": true`), with the session it
//!   had; the replicas, taken over by B's newer engine, fence it, and A
//!   drops the volume and its record: it holds nothing of the volume;
//! - its daemon frozen (SIGSTOP) while B took over, then thawed: its old
//!   engine comes back to life, and the replicas fence it (B's engine has a
//!   newer session): no healthy replica, no write, B's data as it was.

mod common;

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{wait_for, Nodes, DEADLINE};
use lull_csi::attach::{self, FuseDirs, Method};
use lull_csi::controller::ControllerPlugin;
use lull_csi::node::{NodeConfig, NodePlugin};
use lull_csi::pb::controller_server::Controller;
use lull_csi::pb::node_server::Node as _;
use lull_csi::pb::volume_capability::access_mode::Mode;
use lull_csi::pb::volume_capability::{AccessMode, AccessType, BlockVolume};
use lull_csi::pb::*;
use lull_csi::volume_id::VolumeId;
use serde_json::{json, Value};
use tonic::Request;

/// Bytes written through node A and read back through node B.
const DATA_BYTES: usize = 4 << 20;

fn block_cap() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

fn pattern() -> Vec<u8> {
    (0..DATA_BYTES)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1])
        .collect()
}

/// How node A goes away and comes back.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Away {
    /// Killed, not brought back.
    Killed,
    /// Killed, then its daemon started again.
    Restarted,
    /// Frozen (SIGSTOP) while B takes over, then thawed (SIGCONT).
    Frozen,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_fails_over_to_another_node() {
    failover(Away::Killed).await;
}

/// A restarted daemon's resumed engine is fenced and dropped: the volume
/// is B's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_does_not_take_the_volume_back() {
    failover(Away::Restarted).await;
}

/// An engine that comes back to life after B took over is fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_nodes_old_engine_is_fenced_when_it_thaws() {
    failover(Away::Frozen).await;
}

/// Creates `name`, 64 MiB with two replicas on two of the three nodes;
/// its id, parsed, and node A: the node that holds none of its replicas
/// (where the engine goes), with its index among the daemons.
async fn two_replica_volume(
    controller: &ControllerPlugin,
    name: &str,
) -> (String, VolumeId, String, usize) {
    let created = controller
        .create_volume(Request::new(CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: 64 << 20,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![block_cap()],
            parameters: HashMap::from([("replicas".to_string(), "2".to_string())]),
            ..Default::default()
        }))
        .await
        .expect("CreateVolume")
        .into_inner();
    let volume_id = created.volume.unwrap().volume_id;
    let id = VolumeId::parse(&volume_id).unwrap();
    assert_eq!(id.nodes.len(), 2);
    assert_ne!(id.nodes[0], id.nodes[1], "two replicas on one node");
    let a = ["node1", "node2", "node3"]
        .into_iter()
        .find(|n| !id.nodes.iter().any(|r| r == n))
        .unwrap()
        .to_string();
    let a_index: usize = a[4..].parse::<usize>().unwrap() - 1;
    (volume_id, id, a, a_index)
}

/// Stages the volume on node `a` through its plugin (the fuse method),
/// writes [`pattern`] to its loop device and flushes it: every byte
/// acknowledged by A's engine. The attachment's directories and the data.
async fn stage_and_write(
    node_a: &NodePlugin,
    stage: NodeStageVolumeRequest,
    work: &std::path::Path,
    a: &str,
    volume: &str,
) -> (FuseDirs, Vec<u8>) {
    node_a
        .node_stage_volume(Request::new(stage))
        .await
        .expect("NodeStageVolume on A");
    let dirs_a = FuseDirs::new(&work.join(format!("state-{a}")), volume);
    let dev_a = attach::loops_of(&dirs_a.file).await.unwrap().remove(0);
    let data = pattern();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(&dev_a)
        .unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().expect("flush through A's engine");
    (dirs_a, data)
}

/// A daemon killed and started again with no failover meanwhile brings
/// the engine it staged back with its recorded session: the replicas take
/// it (no other engine owns them), every acknowledged byte reads back
/// through A's export, and a write after the restart is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_resumes_the_engine_it_staged() {
    common::require_fuse().await;
    let mut nodes = Nodes::start("resume", Default::default()).await;
    let (work, cluster) = (nodes.work.clone(), Arc::clone(&nodes.cluster));
    let controller = ControllerPlugin::new(Arc::clone(&cluster));
    let (volume_id, id, a, a_index) = two_replica_volume(&controller, "resume").await;
    let node_a = NodePlugin::new(
        Arc::clone(&cluster),
        NodeConfig {
            node_id: a.clone(),
            state_dir: work.join(format!("state-{a}")),
            attach: Method::Fuse,
        },
    );
    let stage = NodeStageVolumeRequest {
        volume_id: volume_id.clone(),
        staging_target_path: work.join("stage-a").to_string_lossy().into_owned(),
        volume_capability: Some(block_cap()),
        ..Default::default()
    };
    let (dirs_a, data) = stage_and_write(&node_a, stage, &work, &a, &id.name).await;
    // The FUSE attachment dies with the daemon's NBD connection (nbdfuse
    // does not reconnect: the kernel tier tests a kernel initiator that
    // does); the engine itself must come back.
    nodes.daemons[a_index].kill();
    attach::fuse_detach(&dirs_a)
        .await
        .expect("detach A's dead attachment");
    nodes.daemons[a_index].start(&work);
    wait_for("A's resumed engine to be healthy on both replicas", || {
        let (c, a, name) = (Arc::clone(&cluster), a.clone(), id.name.clone());
        async move {
            let list = c
                .call(&a, "replica_list", json!({ "volume": name }))
                .await
                .ok()?;
            let all = list.as_array()?;
            (all.len() == 2 && all.iter().all(|r| r["state"] == "healthy")).then_some(())
        }
    })
    .await;
    let export = format!(
        "nbd://127.0.0.1:{}/{}",
        nodes.daemons[a_index].nbd_port, id.name
    );
    let back = work.join("back.bin");
    let out = Command::new("nbdcopy")
        .args([&export, &back.to_string_lossy().into_owned()])
        .output()
        .expect("nbdcopy (Debian package libnbd-bin)");
    assert!(out.status.success(), "nbdcopy from A: {out:?}");
    let back = std::fs::read(&back).unwrap();
    assert!(
        back[..DATA_BYTES] == data[..],
        "A's resumed engine does not read back what it acknowledged before the restart"
    );
    let out = Command::new("nbdcopy")
        .args(["--", "[", "nbdkit", "pattern", "1M", "]", &export])
        .output()
        .expect("nbdcopy (Debian package libnbd-bin) and nbdkit");
    assert!(
        out.status.success(),
        "a write through A's resumed engine failed: {out:?}"
    );
    node_a
        .node_unstage_volume(Request::new(NodeUnstageVolumeRequest {
            volume_id: volume_id.clone(),
            staging_target_path: work.join("stage-a").to_string_lossy().into_owned(),
        }))
        .await
        .expect("NodeUnstageVolume on A");
    let list = cluster
        .call(&a, "volume_list", json!({}))
        .await
        .expect("volume_list on A");
    assert!(
        !list.to_string().contains(&format!("\"{}\"", id.name)),
        "the engine outlived its unstage: {list}"
    );
    controller
        .delete_volume(Request::new(DeleteVolumeRequest {
            volume_id,
            ..Default::default()
        }))
        .await
        .expect("DeleteVolume");
}

/// Stages on A, writes, takes A away (as `away` says), stages on B and
/// reads back; then checks what A holds when it comes back.
async fn failover(away: Away) {
    common::require_fuse().await;
    let mut nodes = Nodes::start(
        match away {
            Away::Killed => "failover",
            Away::Restarted => "failover-restart",
            Away::Frozen => "failover-frozen",
        },
        Default::default(),
    )
    .await;
    let (work, cluster) = (nodes.work.clone(), Arc::clone(&nodes.cluster));
    let controller = ControllerPlugin::new(Arc::clone(&cluster));
    let node_plugin = |id: &str| {
        NodePlugin::new(
            Arc::clone(&cluster),
            NodeConfig {
                node_id: id.to_string(),
                state_dir: work.join(format!("state-{id}")),
                attach: Method::Fuse,
            },
        )
    };

    // Two replicas on two of the three nodes; the engine goes on the third.
    let (volume_id, id, a, a_index) = two_replica_volume(&controller, "failover").await;
    let b = id.nodes[0].clone();
    let (node_a, node_b) = (node_plugin(&a), node_plugin(&b));
    let stage = |path: PathBuf| NodeStageVolumeRequest {
        volume_id: volume_id.clone(),
        staging_target_path: path.to_string_lossy().into_owned(),
        volume_capability: Some(block_cap()),
        ..Default::default()
    };

    // Stage on A, write and flush: every byte acknowledged.
    let (dirs_a, data) =
        stage_and_write(&node_a, stage(work.join("stage-a")), &work, &a, &id.name).await;

    // A's daemon dies (or freezes); staging on B makes a new engine on the
    // same replicas.
    if away == Away::Frozen {
        nodes.daemons[a_index].signal("-STOP");
    } else {
        nodes.daemons[a_index].kill();
    }
    node_b
        .node_stage_volume(Request::new(stage(work.join("stage-b"))))
        .await
        .expect("NodeStageVolume on B after A died");
    let dirs_b = FuseDirs::new(&work.join(format!("state-{b}")), &id.name);
    let dev_b = attach::loops_of(&dirs_b.file).await.unwrap().remove(0);
    // Each read drops the device's page cache first (BLKFLSBUF), so that
    // it shows the volume, not what B read before.
    let read_b = |dev: String| {
        let flushed = Command::new("blockdev")
            .args(["--flushbufs", &dev])
            .status()
            .expect("blockdev (Debian package util-linux)");
        assert!(flushed.success(), "blockdev --flushbufs {dev}");
        let mut f = std::fs::File::open(&dev).unwrap();
        let mut back = vec![0u8; DATA_BYTES];
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_exact(&mut back).unwrap();
        back
    };
    assert!(
        read_b(dev_b.clone()) == data,
        "B does not read back what A acknowledged"
    );

    if away == Away::Restarted {
        // A comes back with the engine it recorded, resuming its old
        // session: the replicas (B's now) fence it, and A drops the
        // volume and its record. B's engine keeps the volume and writes.
        nodes.daemons[a_index].start(&work);
        let name = format!("\"{}\"", id.name);
        wait_for("A to drop its fenced engine", || {
            let (c, a, name) = (Arc::clone(&cluster), a.clone(), name.clone());
            async move {
                let list = c.call(&a, "volume_list", json!({})).await.ok()?;
                (!list.to_string().contains(&name)).then_some(())
            }
        })
        .await;
        let state = std::fs::read_to_string(nodes.daemons[a_index].dir.join("store/volumes.json"))
            .unwrap_or_default();
        assert!(
            !state.contains(&name),
            "A's node state still records the fenced volume: {state}"
        );
        // The operator's line: why a volume this node staged is gone.
        let log = nodes.daemons[a_index].log();
        assert!(
            log.contains("volume dropped: its replicas were taken over by a newer engine"),
            "A's log does not say why it dropped the volume:\n{log}"
        );
        let more: Vec<u8> = data.iter().map(|b| b ^ 0x5a).collect();
        {
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(&dev_b)
                .unwrap();
            f.write_all(&more).unwrap();
            f.sync_all()
                .expect("flush through B's engine after A is back");
        }
        assert!(read_b(dev_b.clone()) == more, "B lost its writes");
    }
    if away == Away::Frozen {
        // A thaws with its old engine: the replicas, held by B's engine,
        // fence it.
        nodes.daemons[a_index].signal("-CONT");
        let deadline = Instant::now() + DEADLINE;
        let mut last = Value::Null;
        let states = loop {
            if let Ok(list) = cluster
                .call(&a, "replica_list", json!({ "volume": id.name }))
                .await
            {
                let states: Vec<(String, u64)> = list
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|r| {
                        (
                            r["state"].as_str().unwrap_or("?").to_string(),
                            r["errors"].as_u64().unwrap_or(0),
                        )
                    })
                    .collect();
                last = list;
                if !states.is_empty()
                    && states
                        .iter()
                        .all(|(s, errors)| s == "failed" && *errors > 0)
                {
                    break states;
                }
            }
            assert!(
                Instant::now() < deadline,
                "A's old engine did not give up on its replicas: {last:#}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(states.len(), 2, "{states:?}");
        // A write through A's export must fail: its engine has no replica.
        let a_export = format!(
            "nbd://127.0.0.1:{}/{}",
            nodes.daemons[a_index].nbd_port, id.name
        );
        let out = Command::new("nbdcopy")
            .args(["--", "[", "nbdkit", "pattern", "1M", "]", &a_export])
            .output()
            .expect("nbdcopy (Debian package libnbd-bin) and nbdkit");
        assert!(
            !out.status.success(),
            "a write through A's fenced engine succeeded"
        );
        // Refused by the volume, not by the copy's own set-up.
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("Input/output error"),
            "nbdcopy failed for another reason than the fenced volume's EIO: {err}"
        );
        assert!(
            read_b(dev_b) == data,
            "B's data changed after A's engine came back"
        );
    }

    // Undo: B unstages cleanly; A's attachment (its engine was killed
    // under it) is detached by hand, its engine deleted; then the volume.
    node_b
        .node_unstage_volume(Request::new(NodeUnstageVolumeRequest {
            volume_id: volume_id.clone(),
            staging_target_path: work.join("stage-b").to_string_lossy().into_owned(),
        }))
        .await
        .expect("NodeUnstageVolume on B");
    attach::fuse_detach(&dirs_a)
        .await
        .expect("detach A's dead attachment");
    if away == Away::Frozen {
        cluster
            .call(&a, "volume_delete", json!({ "name": id.name }))
            .await
            .expect("delete A's old engine");
    }
    let c = Arc::clone(&cluster);
    let vid = volume_id.clone();
    wait_for("DeleteVolume to be accepted", || {
        let (c, vid) = (Arc::clone(&c), vid.clone());
        async move {
            ControllerPlugin::new(c)
                .delete_volume(Request::new(DeleteVolumeRequest {
                    volume_id: vid,
                    ..Default::default()
                }))
                .await
                .ok()
        }
    })
    .await;
}
