//! Placement against real node daemons: 20 volumes of 2 replicas on 3
//! nodes never put two replicas of a volume on one node and spread them;
//! a node without room is passed over, and a volume that cannot be
//! placed is RESOURCE_EXHAUSTED with the numbers.

mod common;

use std::collections::HashMap;

use common::Nodes;
use lull_csi::controller::ControllerPlugin;
use lull_csi::pb::controller_server::Controller;
use lull_csi::pb::volume_capability::access_mode::Mode;
use lull_csi::pb::volume_capability::{AccessMode, AccessType, BlockVolume};
use lull_csi::pb::*;
use lull_csi::volume_id::VolumeId;
use serde_json::json;
use tonic::{Code, Request};

fn request(name: &str, size_bytes: u64, replicas: usize) -> Request<CreateVolumeRequest> {
    Request::new(CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: size_bytes as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Block(BlockVolume {})),
        }],
        parameters: HashMap::from([("replicas".to_string(), replicas.to_string())]),
        ..Default::default()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_volumes_of_two_replicas_on_three_nodes() {
    let nodes = Nodes::start("placement", Default::default()).await;
    let c = ControllerPlugin::new(nodes.cluster.clone());
    let mut per_node: HashMap<String, usize> = HashMap::new();
    for i in 0..20 {
        let v = c
            .create_volume(request(&format!("pvc-{i}"), 16 << 20, 2))
            .await
            .expect("CreateVolume")
            .into_inner()
            .volume
            .unwrap();
        let id = VolumeId::parse(&v.volume_id).unwrap();
        assert_eq!(id.nodes.len(), 2, "{}", v.volume_id);
        assert_ne!(
            id.nodes[0], id.nodes[1],
            "two replicas on one node: {}",
            v.volume_id
        );
        for n in id.nodes {
            *per_node.entry(n).or_default() += 1;
        }
        // The same request again: the same volume (idempotent by name).
        let again = c
            .create_volume(request(&format!("pvc-{i}"), 16 << 20, 2))
            .await
            .expect("CreateVolume again")
            .into_inner()
            .volume
            .unwrap();
        assert_eq!(again.volume_id, v.volume_id);
    }
    // What the stores hold is what the ids say: 40 replicas, spread.
    let mut held = 0;
    for n in 1..=3 {
        let node = format!("node{n}");
        let store = nodes
            .cluster
            .call(&node, "store_get", json!({}))
            .await
            .unwrap();
        let count = store["replicas"].as_array().unwrap().len();
        assert_eq!(count, per_node.get(&node).copied().unwrap_or(0), "{node}");
        assert!(
            (12..=15).contains(&count),
            "{node} holds {count} of 40: not spread"
        );
        held += count;
    }
    assert_eq!(held, 40);
    let listed = c
        .list_volumes(Request::new(ListVolumesRequest::default()))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.entries.len(), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_is_passed_over_and_too_few_is_resource_exhausted() {
    // node3 takes no thin provisioning: a replica larger than its disk's
    // free space does not fit there, and does on the other two.
    let thin = || vec!["--store-overcommit".to_string(), "100".to_string()];
    let thick = vec!["--store-overcommit".to_string(), "1".to_string()];
    let nodes = Nodes::start("placement-full", [thin(), thin(), thick]).await;
    let c = ControllerPlugin::new(nodes.cluster.clone());
    let store = nodes
        .cluster
        .call("node3", "store_get", json!({}))
        .await
        .unwrap();
    let free = store["free_bytes"].as_u64().unwrap();
    let size = (free * 2).div_ceil(4096) * 4096;
    let v = c
        .create_volume(request("big", size, 2))
        .await
        .expect("CreateVolume past node3's room")
        .into_inner()
        .volume
        .unwrap();
    let id = VolumeId::parse(&v.volume_id).unwrap();
    assert_eq!(id.nodes, ["node1", "node2"]);
    let err = c
        .create_volume(request("bigger", size, 3))
        .await
        .expect_err("3 replicas with 2 nodes of room");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message()
            .contains("need 3 distinct nodes with room: 2 of the 3"),
        "{}",
        err.message()
    );
    // Nothing of the refused volume is left on any store.
    for n in 1..=3 {
        let store = nodes
            .cluster
            .call(&format!("node{n}"), "store_get", json!({}))
            .await
            .unwrap();
        assert!(
            store["replicas"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["name"] != "bigger"),
            "node{n}"
        );
    }
}

/// A retried CreateVolume that finds part of its volume while a node is
/// down does not place the rest again (that node may hold it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_with_a_node_down_does_not_place_twice() {
    let mut nodes = Nodes::start("placement-retry", Default::default()).await;
    let c = ControllerPlugin::new(nodes.cluster.clone());
    let v = c
        .create_volume(request("retried", 16 << 20, 2))
        .await
        .expect("CreateVolume")
        .into_inner()
        .volume
        .unwrap();
    let id = VolumeId::parse(&v.volume_id).unwrap();
    let down: usize = id.nodes[1][4..].parse::<usize>().unwrap() - 1;
    nodes.daemons[down].kill();
    let err = c
        .create_volume(request("retried", 16 << 20, 2))
        .await
        .expect_err("a retry with a replica's node down");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("1 of its 2 replicas found"),
        "{}",
        err.message()
    );
    let third = ["node1", "node2", "node3"]
        .into_iter()
        .find(|n| !id.nodes.iter().any(|r| r == n))
        .unwrap();
    let store = nodes
        .cluster
        .call(third, "store_get", json!({}))
        .await
        .unwrap();
    assert!(
        store["replicas"].as_array().unwrap().is_empty(),
        "a replica was placed again on {third}"
    );
}
