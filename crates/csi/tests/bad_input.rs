//! Bad input gets the gRPC code the CSI spec gives it, before any node
//! is asked: every service in this process, on a node list whose one node
//! does not answer (so a request that got as far as a node call would
//! come back UNAVAILABLE, not the code asserted).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use lull_csi::attach::Method;
use lull_csi::cluster::Cluster;
use lull_csi::controller::ControllerPlugin;
use lull_csi::node::{NodeConfig, NodePlugin};
use lull_csi::pb::controller_server::Controller;
use lull_csi::pb::node_server::Node;
use lull_csi::pb::volume_capability::access_mode::Mode;
use lull_csi::pb::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use lull_csi::pb::*;
use tonic::{Code, Request};

fn plugins(dir: &Path) -> (ControllerPlugin, NodePlugin) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("rpc.psk"), format!("admin:{}\n", "5a".repeat(32))).unwrap();
    // Port 1 on loopback: nothing listens there.
    std::fs::write(
        dir.join("nodes.json"),
        r#"{"nodes": [{"id": "n1", "rpc": "127.0.0.1:1", "tls_psk": "rpc.psk", "nbd": "127.0.0.1:1"}]}"#,
    )
    .unwrap();
    let nodes = lull_csi::nodes::load(&dir.join("nodes.json")).unwrap();
    let cluster = Arc::new(Cluster::new(nodes).unwrap());
    let node = NodePlugin::new(
        Arc::clone(&cluster),
        NodeConfig {
            node_id: "n1".into(),
            state_dir: dir.join("state"),
            attach: Method::Fuse,
        },
    );
    (ControllerPlugin::new(cluster), node)
}

fn cap(mode: Mode, access: AccessType) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(access),
    }
}

fn block() -> VolumeCapability {
    cap(Mode::SingleNodeWriter, AccessType::Block(BlockVolume {}))
}

fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> Code {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(s) => s.code(),
    }
}

/// An id this plugin could have written (placement on n1), of a volume
/// that no node holds.
const SOME_ID: &str = "v@n1";

#[tokio::test]
async fn controller_requests() {
    let dir = std::env::temp_dir().join(format!("lull-csi-bad-input-c-{}", std::process::id()));
    let (c, _) = plugins(&dir);
    let create = |f: &dyn Fn(&mut CreateVolumeRequest)| {
        let mut req = CreateVolumeRequest {
            name: "v".into(),
            volume_capabilities: vec![block()],
            ..Default::default()
        };
        f(&mut req);
        Request::new(req)
    };
    let cases: Vec<(&str, Request<CreateVolumeRequest>, Code)> = vec![
        (
            "no name",
            create(&|r| r.name.clear()),
            Code::InvalidArgument,
        ),
        (
            "no capabilities",
            create(&|r| r.volume_capabilities.clear()),
            Code::InvalidArgument,
        ),
        (
            "a capability without access type",
            create(&|r| r.volume_capabilities[0].access_type = None),
            Code::InvalidArgument,
        ),
        (
            "a multi-node mode",
            create(&|r| {
                r.volume_capabilities = vec![cap(
                    Mode::MultiNodeMultiWriter,
                    AccessType::Block(BlockVolume {}),
                )]
            }),
            Code::InvalidArgument,
        ),
        (
            "a filesystem not made",
            create(&|r| {
                r.volume_capabilities = vec![cap(
                    Mode::SingleNodeWriter,
                    AccessType::Mount(MountVolume {
                        fs_type: "zfs".into(),
                        ..Default::default()
                    }),
                )]
            }),
            Code::InvalidArgument,
        ),
        (
            "replicas=0",
            create(&|r| r.parameters = HashMap::from([("replicas".into(), "0".into())])),
            Code::InvalidArgument,
        ),
        (
            "replicas=x",
            create(&|r| r.parameters = HashMap::from([("replicas".into(), "x".into())])),
            Code::InvalidArgument,
        ),
        (
            "an unknown parameter",
            create(&|r| r.parameters = HashMap::from([("replica".into(), "2".into())])),
            Code::InvalidArgument,
        ),
        (
            "limit below required",
            create(&|r| {
                r.capacity_range = Some(CapacityRange {
                    required_bytes: 10 << 20,
                    limit_bytes: 1 << 20,
                })
            }),
            Code::InvalidArgument,
        ),
        (
            "no whole block in the range",
            create(&|r| {
                r.capacity_range = Some(CapacityRange {
                    required_bytes: 5000,
                    limit_bytes: 6000,
                })
            }),
            Code::OutOfRange,
        ),
        (
            "a content source of no type",
            create(&|r| r.volume_content_source = Some(VolumeContentSource::default())),
            Code::InvalidArgument,
        ),
    ];
    for (what, req, want) in cases {
        assert_eq!(
            code(c.create_volume(req).await),
            want,
            "CreateVolume: {what}"
        );
    }
    // A well-formed request reaches the nodes: the one node is down.
    assert_eq!(
        code(c.create_volume(create(&|_| {})).await),
        Code::Unavailable,
        "CreateVolume with no node answering"
    );

    assert_eq!(
        code(
            c.delete_volume(Request::new(DeleteVolumeRequest::default()))
                .await
        ),
        Code::InvalidArgument
    );
    // An id this plugin never wrote names no volume: deleted already.
    c.delete_volume(Request::new(DeleteVolumeRequest {
        volume_id: "fake-vol-id".into(),
        ..Default::default()
    }))
    .await
    .expect("DeleteVolume of a foreign id");

    let validate = |id: &str, caps: Vec<VolumeCapability>| {
        Request::new(ValidateVolumeCapabilitiesRequest {
            volume_id: id.into(),
            volume_capabilities: caps,
            ..Default::default()
        })
    };
    assert_eq!(
        code(
            c.validate_volume_capabilities(validate("", vec![block()]))
                .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.validate_volume_capabilities(validate(SOME_ID, vec![]))
                .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.validate_volume_capabilities(validate("fake", vec![block()]))
                .await
        ),
        Code::NotFound
    );

    assert_eq!(
        code(
            c.list_volumes(Request::new(ListVolumesRequest {
                max_entries: -1,
                ..Default::default()
            }))
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.list_volumes(Request::new(ListVolumesRequest {
                starting_token: "invalid-token".into(),
                ..Default::default()
            }))
            .await
        ),
        Code::Aborted
    );
    // Listing with a node down would report its volumes gone: refused.
    assert_eq!(
        code(
            c.list_volumes(Request::new(ListVolumesRequest::default()))
                .await
        ),
        Code::Unavailable
    );

    for id in ["", "fake"] {
        let want = if id.is_empty() {
            Code::InvalidArgument
        } else {
            Code::NotFound
        };
        assert_eq!(
            code(
                c.controller_get_volume(Request::new(ControllerGetVolumeRequest {
                    volume_id: id.into()
                }))
                .await
            ),
            want
        );
        assert_eq!(
            code(
                c.controller_get_volume_health(Request::new(ControllerGetVolumeHealthRequest {
                    volume_id: id.into(),
                    ..Default::default()
                }))
                .await
            ),
            want
        );
    }
    assert_eq!(
        code(
            c.get_capacity(Request::new(GetCapacityRequest {
                parameters: HashMap::from([("replicas".into(), "9".into())]),
                ..Default::default()
            }))
            .await
        ),
        Code::InvalidArgument
    );
    // What is not advertised is UNIMPLEMENTED.
    assert_eq!(
        code(
            c.controller_publish_volume(Request::new(Default::default()))
                .await
        ),
        Code::Unimplemented
    );
    // GetSnapshot: the id, then an id of this plugin.
    assert_eq!(
        code(c.get_snapshot(Request::new(Default::default())).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.get_snapshot(Request::new(GetSnapshotRequest {
                snapshot_id: "none-exist-id".into(),
                ..Default::default()
            }))
            .await
        ),
        Code::NotFound
    );
    // Snapshots: the name and the source, then ids of this plugin.
    assert_eq!(
        code(c.create_snapshot(Request::new(Default::default())).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.create_snapshot(Request::new(CreateSnapshotRequest {
                name: "s".into(),
                ..Default::default()
            }))
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.create_snapshot(Request::new(CreateSnapshotRequest {
                name: "s".into(),
                source_volume_id: "not-an-id".into(),
                ..Default::default()
            }))
            .await
        ),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.create_snapshot(Request::new(CreateSnapshotRequest {
                name: "s".into(),
                source_volume_id: "v@node1".into(),
                parameters: HashMap::from([("color".into(), "blue".into())]),
                ..Default::default()
            }))
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.delete_snapshot(Request::new(Default::default())).await),
        Code::InvalidArgument
    );
    // An id this plugin never wrote is deleted already.
    c.delete_snapshot(Request::new(DeleteSnapshotRequest {
        snapshot_id: "not-an-id".into(),
        ..Default::default()
    }))
    .await
    .expect("DeleteSnapshot of a foreign id");
    assert_eq!(
        code(
            c.list_snapshots(Request::new(ListSnapshotsRequest {
                max_entries: -1,
                ..Default::default()
            }))
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            c.list_snapshots(Request::new(ListSnapshotsRequest {
                starting_token: "bogus".into(),
                ..Default::default()
            }))
            .await
        ),
        Code::Aborted
    );
    // Expansion: the id, then the range, then an id of this plugin.
    let expand = |id: &str, range: Option<CapacityRange>| {
        Request::new(ControllerExpandVolumeRequest {
            volume_id: id.into(),
            capacity_range: range,
            ..Default::default()
        })
    };
    let range = || {
        Some(CapacityRange {
            required_bytes: 1 << 30,
            limit_bytes: 0,
        })
    };
    assert_eq!(
        code(c.controller_expand_volume(expand("", range())).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.controller_expand_volume(expand(SOME_ID, None)).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(c.controller_expand_volume(expand("fake", range())).await),
        Code::NotFound
    );
    assert_eq!(
        code(
            c.controller_expand_volume(expand(
                SOME_ID,
                Some(CapacityRange {
                    required_bytes: 2 << 30,
                    limit_bytes: 1 << 30,
                })
            ))
            .await
        ),
        Code::InvalidArgument
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn node_requests() {
    let dir = std::env::temp_dir().join(format!("lull-csi-bad-input-n-{}", std::process::id()));
    let (_, n) = plugins(&dir);
    let stage = |f: &dyn Fn(&mut NodeStageVolumeRequest)| {
        let mut req = NodeStageVolumeRequest {
            volume_id: SOME_ID.into(),
            staging_target_path: "/nonexistent/staging".into(),
            volume_capability: Some(block()),
            ..Default::default()
        };
        f(&mut req);
        Request::new(req)
    };
    for (what, req, want) in [
        (
            "no id",
            stage(&|r| r.volume_id.clear()),
            Code::InvalidArgument,
        ),
        (
            "no staging path",
            stage(&|r| r.staging_target_path.clear()),
            Code::InvalidArgument,
        ),
        (
            "no capability",
            stage(&|r| r.volume_capability = None),
            Code::InvalidArgument,
        ),
        (
            "a multi-node mode",
            stage(&|r| {
                r.volume_capability = Some(cap(
                    Mode::MultiNodeReaderOnly,
                    AccessType::Block(BlockVolume {}),
                ))
            }),
            Code::InvalidArgument,
        ),
        (
            "a foreign id",
            stage(&|r| r.volume_id = "fake".into()),
            Code::NotFound,
        ),
    ] {
        assert_eq!(
            code(n.node_stage_volume(req).await),
            want,
            "NodeStageVolume: {what}"
        );
    }

    let publish = |f: &dyn Fn(&mut NodePublishVolumeRequest)| {
        let mut req = NodePublishVolumeRequest {
            volume_id: SOME_ID.into(),
            staging_target_path: "/nonexistent/staging".into(),
            target_path: "/nonexistent/target".into(),
            volume_capability: Some(block()),
            ..Default::default()
        };
        f(&mut req);
        Request::new(req)
    };
    for (what, req, want) in [
        (
            "no id",
            publish(&|r| r.volume_id.clear()),
            Code::InvalidArgument,
        ),
        (
            "no target",
            publish(&|r| r.target_path.clear()),
            Code::InvalidArgument,
        ),
        (
            "no capability",
            publish(&|r| r.volume_capability = None),
            Code::InvalidArgument,
        ),
        (
            "a foreign id",
            publish(&|r| r.volume_id = "fake".into()),
            Code::NotFound,
        ),
        (
            "not staged",
            publish(&|r| r.target_path = dir.join("t").to_string_lossy().into_owned()),
            Code::FailedPrecondition,
        ),
    ] {
        assert_eq!(
            code(n.node_publish_volume(req).await),
            want,
            "NodePublishVolume: {what}"
        );
    }

    assert_eq!(
        code(
            n.node_unpublish_volume(Request::new(NodeUnpublishVolumeRequest {
                volume_id: SOME_ID.into(),
                ..Default::default()
            }))
            .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            n.node_unstage_volume(Request::new(NodeUnstageVolumeRequest {
                volume_id: String::new(),
                staging_target_path: "/x".into(),
            }))
            .await
        ),
        Code::InvalidArgument
    );
    // Unpublishing what is not published succeeds (idempotent).
    n.node_unpublish_volume(Request::new(NodeUnpublishVolumeRequest {
        volume_id: SOME_ID.into(),
        target_path: dir.join("never").to_string_lossy().into_owned(),
    }))
    .await
    .expect("NodeUnpublishVolume of a target never published");

    let stats = |id: &str, path: &str| {
        Request::new(NodeGetVolumeStatsRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            ..Default::default()
        })
    };
    assert_eq!(
        code(n.node_get_volume_stats(stats("", "/")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(n.node_get_volume_stats(stats(SOME_ID, "")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(n.node_get_volume_stats(stats("fake", "/")).await),
        Code::NotFound
    );
    assert_eq!(
        code(n.node_get_volume_stats(stats(SOME_ID, "some/path")).await),
        Code::NotFound
    );
    assert_eq!(
        code(
            n.node_get_volume_health(Request::new(NodeGetVolumeHealthRequest::default()))
                .await
        ),
        Code::InvalidArgument
    );
    let expand = |id: &str, path: &str| {
        Request::new(NodeExpandVolumeRequest {
            volume_id: id.into(),
            volume_path: path.into(),
            ..Default::default()
        })
    };
    assert_eq!(
        code(n.node_expand_volume(expand("", "/")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(n.node_expand_volume(expand(SOME_ID, "")).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(n.node_expand_volume(expand("fake", "/")).await),
        Code::NotFound
    );
    assert_eq!(
        code(n.node_expand_volume(expand(SOME_ID, "some/path")).await),
        Code::NotFound
    );
    let info = n
        .node_get_info(Request::new(NodeGetInfoRequest {}))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.node_id, "n1");
    assert_eq!(
        info.accessible_topology.unwrap().segments[lull_csi::nodes::TOPOLOGY_NODE_KEY],
        "n1"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
