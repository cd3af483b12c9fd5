//! The `nvme-tcp` and `nbd` attach methods on a real Linux kernel: the
//! node plugin with the real [`Host`] (/sys, /dev, nvme-cli, nbd-client,
//! modprobe), against real node daemons (`lull serve --store
//! --nvmf-listen`, three on loopback as in the other tests), with the
//! kernel's NVMe/TCP initiator and NBD client making the devices.
//!
//! Every test here is `#[ignore]`: this needs the `nvme_tcp` and `nbd`
//! modules, which the machines the suite runs on lack, and a test that
//! cannot attach must not pass. The kernel VM tier runs them
//! (scripts/kernel-vm.d/tests/60-csi.sh: Debian's kernel in qemu, the host's
//! files over 9p, this test binary run with `--ignored`); run on a
//! kernel without the modules they fail with the method's refusal.
//!
//! What each asserts, per method and per access type (block, ext4,
//! xfs): NodeStage, NodePublish, NodeUnpublish, NodeUnstage and
//! NodeExpand on the kernel's device; the data (a file's SHA-256, or the
//! first bytes of the block device written through the published device
//! file) after unstage and stage again and after the grow; the kernel's
//! view (the device in /sys/block at the volume's size, its controller
//! live at the daemon's address and the subsystem in
//! /sys/class/nvme-subsystem for nvme-tcp, `pid` for nbd; all of it gone
//! after unstage; the grown size after NodeExpandVolume). The tier's
//! script checks dmesg for I/O errors after the run.

mod common;

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::Nodes;
use lull_csi::attach::{self, Host, Method};
use lull_csi::controller::ControllerPlugin;
use lull_csi::node::{NodeConfig, NodePlugin};
use lull_csi::pb::controller_server::Controller;
use lull_csi::pb::node_server::Node;
use lull_csi::pb::volume_capability::access_mode::Mode;
use lull_csi::pb::volume_capability::{AccessMode, AccessType, BlockVolume, MountVolume};
use lull_csi::pb::*;
use lull_csi::volume_id::VolumeId;
use sha2::{Digest, Sha256};
use tonic::{Code, Request};

/// A volume's size at creation: xfs refuses a filesystem below 300 MB
/// (mkfs.xfs of xfsprogs 5.19 and later: "Filesystem must be larger
/// than 300MB"), and every access type uses the same size.
const OLD_BYTES: u64 = 320 << 20;
/// Its size after ControllerExpandVolume: a grow the filesystems see
/// (more than an allocation group of xfs, several ext4 block groups).
const NEW_BYTES: u64 = 448 << 20;
/// The data written through a device or into a file and read back:
/// large enough to cross many requests, small enough for TCG.
const DATA_BYTES: usize = 4 << 20;

/// How an access type is asked for and named in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Block,
    Ext4,
    Xfs,
}

impl Access {
    const ALL: [Access; 3] = [Access::Block, Access::Ext4, Access::Xfs];

    fn name(self) -> &'static str {
        match self {
            Access::Block => "block",
            Access::Ext4 => "ext4",
            Access::Xfs => "xfs",
        }
    }

    fn cap(self) -> VolumeCapability {
        let access_type = match self {
            Access::Block => AccessType::Block(BlockVolume {}),
            Access::Ext4 | Access::Xfs => AccessType::Mount(MountVolume {
                fs_type: self.name().into(),
                ..Default::default()
            }),
        };
        VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(access_type),
        }
    }
}

/// Panics unless this kernel can attach with `method`: run where the
/// modules are missing, a test fails with the plugin's own reason.
async fn require_kernel(method: Method) {
    if let Err(reason) = method.check(&Host::default()).await {
        panic!("this test needs a kernel that attaches with {}: {reason} (the kernel VM tier runs it: scripts/kernel-vm.d/tests/60-csi.sh)", method.name());
    }
}

fn config(nodes: &Nodes, node: &str, attach: Method) -> NodeConfig {
    NodeConfig {
        node_id: node.into(),
        state_dir: nodes.work.join(format!("state-{node}")),
        attach,
    }
}

async fn create(c: &ControllerPlugin, name: &str, access: Access) -> String {
    c.create_volume(Request::new(CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: OLD_BYTES as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![access.cap()],
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

async fn delete(c: &ControllerPlugin, volume_id: &str) {
    c.delete_volume(Request::new(DeleteVolumeRequest {
        volume_id: volume_id.into(),
        ..Default::default()
    }))
    .await
    .expect("DeleteVolume");
}

async fn stage(
    n: &NodePlugin,
    volume_id: &str,
    staging: &Path,
    access: Access,
) -> Result<(), tonic::Status> {
    n.node_stage_volume(Request::new(NodeStageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
        volume_capability: Some(access.cap()),
        ..Default::default()
    }))
    .await
    .map(|_| ())
}

async fn unstage(n: &NodePlugin, volume_id: &str, staging: &Path) {
    n.node_unstage_volume(Request::new(NodeUnstageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
    }))
    .await
    .expect("NodeUnstageVolume");
}

async fn publish(n: &NodePlugin, volume_id: &str, staging: &Path, target: &Path, access: Access) {
    n.node_publish_volume(Request::new(NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.to_string_lossy().into_owned(),
        target_path: target.to_string_lossy().into_owned(),
        volume_capability: Some(access.cap()),
        ..Default::default()
    }))
    .await
    .expect("NodePublishVolume");
}

async fn unpublish(n: &NodePlugin, volume_id: &str, target: &Path) {
    n.node_unpublish_volume(Request::new(NodeUnpublishVolumeRequest {
        volume_id: volume_id.into(),
        target_path: target.to_string_lossy().into_owned(),
    }))
    .await
    .expect("NodeUnpublishVolume");
}

async fn controller_expand(c: &ControllerPlugin, volume_id: &str, access: Access) {
    c.controller_expand_volume(Request::new(ControllerExpandVolumeRequest {
        volume_id: volume_id.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: NEW_BYTES as i64,
            limit_bytes: 0,
        }),
        volume_capability: Some(access.cap()),
        ..Default::default()
    }))
    .await
    .expect("ControllerExpandVolume");
}

async fn node_expand(
    n: &NodePlugin,
    volume_id: &str,
    path: &Path,
    access: Access,
) -> Result<NodeExpandVolumeResponse, tonic::Status> {
    n.node_expand_volume(Request::new(NodeExpandVolumeRequest {
        volume_id: volume_id.into(),
        volume_path: path.to_string_lossy().into_owned(),
        capacity_range: Some(CapacityRange {
            required_bytes: NEW_BYTES as i64,
            limit_bytes: 0,
        }),
        volume_capability: Some(access.cap()),
        ..Default::default()
    }))
    .await
    .map(|r| r.into_inner())
}

/// The bytes written: the same for every volume, different in every
/// 4 KiB block.
fn pattern() -> Vec<u8> {
    (0..DATA_BYTES)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ (i >> 12) as u8)
        .collect()
}

fn sha256(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What the kernel shows of a device (`nvme0n1`, `nbd2`).
fn sys_block(name: &str) -> PathBuf {
    Path::new("/sys/block").join(name)
}

/// The device's size as the kernel has it (`/sys/block/NAME/size`, in
/// 512-byte sectors whatever the logical block size).
fn kernel_bytes(name: &str) -> u64 {
    let path = sys_block(name).join("size");
    let s = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    s.trim().parse::<u64>().unwrap() * 512
}

/// The NVMe subsystems the kernel has with this NQN (their sysfs
/// directories), read without the plugin.
fn nvme_subsystems(nqn: &str) -> Vec<PathBuf> {
    let Ok(read) = std::fs::read_dir("/sys/class/nvme-subsystem") else {
        return Vec::new();
    };
    read.flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read_to_string(p.join("subsysnqn")).is_ok_and(|s| s.trim() == nqn))
        .collect()
}

/// The controllers of the subsystems with this NQN: (name, `address`,
/// `state`), from /sys/class/nvme/NAME.
fn nvme_controllers(nqn: &str) -> Vec<(String, String, String)> {
    let Ok(read) = std::fs::read_dir("/sys/class/nvme") else {
        return Vec::new();
    };
    let mut found: Vec<(String, String, String)> = read
        .flatten()
        .map(|e| e.path())
        .filter(|p| std::fs::read_to_string(p.join("subsysnqn")).is_ok_and(|s| s.trim() == nqn))
        .map(|p| {
            let read = |f: &str| {
                std::fs::read_to_string(p.join(f))
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            };
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                read("address"),
                read("state"),
            )
        })
        .collect();
    found.sort();
    found
}

/// The namespace block devices (`nvme0n1`, not the hidden per-path
/// `nvme0c0n1`) whose subsystem has this NQN, as /sys/block lists them
/// (`device` is the subsystem for a multipath head, the controller
/// otherwise; both have `subsysnqn`).
fn nvme_namespaces(nqn: &str) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir("/sys/block")
        .expect("/sys/block")
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix("nvme")
                .and_then(|r| r.split_once('n'))
                .is_some_and(|(c, ns)| {
                    !c.is_empty()
                        && c.bytes().all(|b| b.is_ascii_digit())
                        && !ns.is_empty()
                        && ns.bytes().all(|b| b.is_ascii_digit())
                })
        })
        .filter(|n| {
            std::fs::read_to_string(sys_block(n).join("device/subsysnqn"))
                .is_ok_and(|s| s.trim() == nqn)
        })
        .collect();
    found.sort();
    found
}

/// The nbd device the plugin recorded for the volume (`nbd.json`).
fn nbd_recorded(state: &Path, volume: &str) -> Option<String> {
    let bytes = std::fs::read(state.join(volume).join("nbd.json")).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    Some(v["device"].as_str().unwrap().to_string())
}

/// What one volume is attached as, for the kernel's view.
struct Kernel {
    method: Method,
    /// The plugin's state directory of this node.
    state: PathBuf,
    volume: String,
    /// The daemon's NVMe/TCP port (`nvme-tcp`).
    nvmf_port: u16,
}

impl Kernel {
    fn nqn(&self) -> String {
        attach::nqn_of(&self.volume)
    }

    /// The device the kernel attached for the volume, asserted as the
    /// kernel shows it: in /sys/block at `bytes`; for nvme-tcp one
    /// subsystem of the volume's NQN, its controllers live at the
    /// daemon's address, one namespace device; for nbd the recorded
    /// device connected (`pid`). Returns its name (`nvme0n1`).
    fn attached(&self, bytes: u64) -> String {
        let name = match self.method {
            Method::NvmeTcp => {
                let nqn = self.nqn();
                let subs = nvme_subsystems(&nqn);
                assert_eq!(
                    subs.len(),
                    1,
                    "one subsystem {nqn} in /sys/class/nvme-subsystem: {subs:?}"
                );
                let ctrls = nvme_controllers(&nqn);
                assert!(!ctrls.is_empty(), "no controller of {nqn}");
                let at = format!("trsvcid={}", self.nvmf_port);
                for (c, address, state) in &ctrls {
                    assert_eq!(state, "live", "controller {c} of {nqn}: {ctrls:?}");
                    assert!(
                        address.split(',').any(|kv| kv == at)
                            && address.contains("traddr=127.0.0.1"),
                        "controller {c} of {nqn} is at {address}, not the daemon's 127.0.0.1 {at}"
                    );
                }
                let ns = nvme_namespaces(&nqn);
                assert_eq!(ns.len(), 1, "one namespace device of {nqn}: {ns:?}");
                // The layout the plugin reads, for the record: the
                // subsystem's entries (controllers, a multipath head).
                let mut entries: Vec<String> = std::fs::read_dir(&subs[0])
                    .unwrap()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with("nvme"))
                    .collect();
                entries.sort();
                eprintln!(
                    "kernel: {} in {} (nvme entries {entries:?}), controllers {ctrls:?}, namespace /dev/{}",
                    nqn,
                    subs[0].display(),
                    ns[0]
                );
                ns[0].clone()
            }
            Method::Nbd => {
                let dev = nbd_recorded(&self.state, &self.volume).expect("an nbd record");
                assert!(
                    sys_block(&dev).join("pid").exists(),
                    "/sys/block/{dev}/pid: not connected"
                );
                eprintln!(
                    "kernel: /dev/{dev} connected (pid {})",
                    std::fs::read_to_string(sys_block(&dev).join("pid"))
                        .unwrap()
                        .trim()
                );
                dev
            }
            Method::Fuse => unreachable!("the kernel tests attach with nvme-tcp and nbd"),
        };
        assert!(sys_block(&name).exists(), "no /sys/block/{name}");
        assert!(
            Path::new("/dev").join(&name).exists(),
            "no /dev/{name} for /sys/block/{name}"
        );
        assert_eq!(kernel_bytes(&name), bytes, "/sys/block/{name}/size");
        name
    }

    /// Asserts that the kernel holds nothing of the volume any more:
    /// for nvme-tcp no subsystem, controller or namespace device of its
    /// NQN and `device` gone from /sys/block; for nbd the device not
    /// connected (an nbd device itself stays: `nbds_max` of them) and
    /// no record left.
    fn gone(&self, device: &str) {
        match self.method {
            Method::NvmeTcp => {
                let nqn = self.nqn();
                assert!(
                    nvme_subsystems(&nqn).is_empty(),
                    "subsystem {nqn} left after unstage"
                );
                assert!(
                    nvme_controllers(&nqn).is_empty(),
                    "controllers of {nqn} left: {:?}",
                    nvme_controllers(&nqn)
                );
                assert!(nvme_namespaces(&nqn).is_empty(), "namespace of {nqn} left");
                assert!(
                    !sys_block(device).exists(),
                    "/sys/block/{device} left after unstage"
                );
            }
            Method::Nbd => {
                assert!(
                    !sys_block(device).join("pid").exists(),
                    "/sys/block/{device} still connected after unstage"
                );
                assert_eq!(
                    kernel_bytes(device),
                    0,
                    "/sys/block/{device}/size after disconnect"
                );
                assert_eq!(nbd_recorded(&self.state, &self.volume), None);
            }
            Method::Fuse => unreachable!(),
        }
        assert!(
            !self.state.join(&self.volume).exists(),
            "the plugin's state of {} is left",
            self.volume
        );
    }
}

/// Writes the data: into a file on the mounted filesystem at `target`,
/// or onto the published block device file at `target`; flushed.
fn write_data(target: &Path, access: Access) -> String {
    let data = pattern();
    match access {
        Access::Block => {
            let meta = std::fs::metadata(target).unwrap();
            assert!(
                meta.file_type().is_block_device(),
                "{} is not a block device",
                target.display()
            );
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .open(target)
                .unwrap();
            f.write_all(&data).unwrap();
            f.sync_all().expect("flush through the kernel's device");
        }
        Access::Ext4 | Access::Xfs => {
            let file = target.join("data.bin");
            std::fs::write(&file, &data).unwrap();
            std::fs::File::open(&file).unwrap().sync_all().unwrap();
            std::fs::File::open(target).unwrap().sync_all().unwrap();
        }
    }
    sha256(&data)
}

/// The SHA-256 of what [`write_data`] wrote, read back at `target`.
fn read_data(target: &Path, access: Access) -> String {
    let back = match access {
        Access::Block => {
            let mut f = std::fs::File::open(target).unwrap();
            let mut back = vec![0u8; DATA_BYTES];
            f.seek(SeekFrom::Start(0)).unwrap();
            f.read_exact(&mut back).unwrap();
            back
        }
        Access::Ext4 | Access::Xfs => std::fs::read(target.join("data.bin")).unwrap(),
    };
    sha256(&back)
}

/// The published target is the kernel's device: a block device file
/// with its device number (block), or a mount of the filesystem on it.
fn assert_published_on(target: &Path, device: &str, access: Access) {
    let want = std::fs::read_to_string(sys_block(device).join("dev")).unwrap();
    match access {
        Access::Block => {
            let rdev = std::fs::metadata(target).unwrap().rdev();
            let got = format!("{}:{}", rustix::fs::major(rdev), rustix::fs::minor(rdev));
            assert_eq!(
                got,
                want.trim(),
                "{} is not /dev/{device}",
                target.display()
            );
        }
        Access::Ext4 | Access::Xfs => {
            let m = lull_csi::mounts::mounted_at(target)
                .unwrap()
                .unwrap_or_else(|| panic!("nothing mounted at {}", target.display()));
            assert_eq!(m.fs_type, access.name(), "{m:?}");
            // A bind mount of the staging mount: same device.
            let dev = std::fs::metadata(target).unwrap().dev();
            let got = format!("{}:{}", rustix::fs::major(dev), rustix::fs::minor(dev));
            assert_eq!(
                got,
                want.trim(),
                "{} is not on /dev/{device}",
                target.display()
            );
        }
    }
}

fn fs_bytes(path: &Path) -> u64 {
    let st = rustix::fs::statvfs(path).expect("statvfs");
    st.f_blocks * st.f_frsize
}

/// Every access type with `method` on node1: stage, publish, data in,
/// unpublish, unstage (the kernel lets go), stage again (the data is
/// there), grow (online for nvme-tcp; at the next stage for nbd), the
/// data still there, unstage.
async fn round_trip(method: Method) {
    require_kernel(method).await;
    let test = format!("kernel-{}", method.name());
    let nodes = Nodes::start_with_nvmf(&test, Default::default(), [true; 3]).await;
    let c = ControllerPlugin::new(Arc::clone(&nodes.cluster));
    let cfg = config(&nodes, "node1", method);
    let state = cfg.state_dir.clone();
    // The real node: /sys, /dev, the tools on the PATH.
    let n = NodePlugin::new(Arc::clone(&nodes.cluster), cfg);
    for access in Access::ALL {
        let what = format!("{} {}", method.name(), access.name());
        eprintln!("==> {what}");
        let volume_id = create(
            &c,
            &format!("k-{}-{}", method.name(), access.name()),
            access,
        )
        .await;
        let k = Kernel {
            method,
            state: state.clone(),
            volume: VolumeId::parse(&volume_id).unwrap().name,
            nvmf_port: nodes.daemons[0].nvmf_port,
        };
        let staging = nodes.work.join(format!("staging-{}", access.name()));
        let target = nodes.work.join(format!("target-{}", access.name()));

        stage(&n, &volume_id, &staging, access)
            .await
            .unwrap_or_else(|e| panic!("{what}: NodeStageVolume: {e:?}"));
        let dev = k.attached(OLD_BYTES);
        // Again: the same device, nothing more attached.
        stage(&n, &volume_id, &staging, access)
            .await
            .unwrap_or_else(|e| panic!("{what}: NodeStageVolume again: {e:?}"));
        assert_eq!(k.attached(OLD_BYTES), dev, "{what}: a second device");
        publish(&n, &volume_id, &staging, &target, access).await;
        assert_published_on(&target, &dev, access);
        let sum = write_data(&target, access);
        eprintln!("{what}: wrote {DATA_BYTES} bytes through /dev/{dev}, sha256 {sum}");
        unpublish(&n, &volume_id, &target).await;
        assert!(!target.exists(), "{what}: the target is left");
        unstage(&n, &volume_id, &staging).await;
        k.gone(&dev);
        // Unstage again: nothing to do.
        unstage(&n, &volume_id, &staging).await;

        // Staged again: a new attachment reads what the first wrote.
        stage(&n, &volume_id, &staging, access)
            .await
            .unwrap_or_else(|e| panic!("{what}: NodeStageVolume after unstage: {e:?}"));
        let dev = k.attached(OLD_BYTES);
        publish(&n, &volume_id, &staging, &target, access).await;
        assert_published_on(&target, &dev, access);
        assert_eq!(
            read_data(&target, access),
            sum,
            "{what}: the data after unstage and stage"
        );

        // Grown: the engine and the replicas, then the node.
        controller_expand(&c, &volume_id, access).await;
        let fs_before = (access != Access::Block).then(|| fs_bytes(&target));
        let dev = match method {
            Method::NvmeTcp => {
                let grown = node_expand(&n, &volume_id, &target, access)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: NodeExpandVolume: {e:?}"));
                assert_eq!(grown.capacity_bytes, NEW_BYTES as i64, "{what}");
                // The same device, at the new size, as the kernel has it.
                assert_eq!(
                    k.attached(NEW_BYTES),
                    dev,
                    "{what}: another device after the grow"
                );
                dev
            }
            Method::Nbd => {
                let e = node_expand(&n, &volume_id, &target, access)
                    .await
                    .expect_err("NodeExpandVolume while staged with nbd");
                assert_eq!(e.code(), Code::FailedPrecondition, "{what}: {e:?}");
                assert!(e.message().contains("nbd attach method"), "{what}: {e:?}");
                assert_eq!(kernel_bytes(&dev), OLD_BYTES, "{what}: the device changed");
                if let Some(before) = fs_before {
                    assert_eq!(fs_bytes(&target), before, "{what}: the filesystem changed");
                }
                // The next stage connects at the new size.
                unpublish(&n, &volume_id, &target).await;
                unstage(&n, &volume_id, &staging).await;
                k.gone(&dev);
                stage(&n, &volume_id, &staging, access)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: NodeStageVolume after the grow: {e:?}"));
                let dev = k.attached(NEW_BYTES);
                publish(&n, &volume_id, &staging, &target, access).await;
                let grown = node_expand(&n, &volume_id, &target, access)
                    .await
                    .unwrap_or_else(|e| panic!("{what}: NodeExpandVolume after the stage: {e:?}"));
                assert_eq!(grown.capacity_bytes, NEW_BYTES as i64, "{what}");
                dev
            }
            Method::Fuse => unreachable!(),
        };
        if let Some(before) = fs_before {
            let after = fs_bytes(&target);
            assert!(
                after >= before + (NEW_BYTES - OLD_BYTES) * 3 / 4,
                "{what}: the filesystem did not grow: {before} -> {after} bytes"
            );
            eprintln!("{what}: filesystem {before} -> {after} bytes");
        }
        assert_eq!(
            read_data(&target, access),
            sum,
            "{what}: the data after the grow"
        );
        unpublish(&n, &volume_id, &target).await;
        unstage(&n, &volume_id, &staging).await;
        k.gone(&dev);
        delete(&c, &volume_id).await;
        eprintln!("PASS {what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs in the kernel VM tier (needs the nvme_tcp module): scripts/kernel-vm.d/tests/60-csi.sh"]
async fn nvme_tcp_stages_publishes_and_grows_on_the_kernel() {
    round_trip(Method::NvmeTcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs in the kernel VM tier (needs the nbd module): scripts/kernel-vm.d/tests/60-csi.sh"]
async fn nbd_stages_publishes_and_grows_at_the_next_stage_on_the_kernel() {
    round_trip(Method::Nbd).await;
}

/// Failover by restaging, with the kernel's initiator: a volume staged
/// through node A's plugin (A holds none of its replicas) is written and
/// flushed; A's daemon is killed, and A's host goes with it (its
/// kernel's controller, left reconnecting to the dead daemon, is
/// disconnected, as a dead host holds nothing); node B's plugin stages
/// the same volume on B's daemon and reads back every acknowledged byte.
/// Before A's controller goes, B's stage is refused: the kernel has the
/// volume's subsystem connected to A's daemon, not B's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs in the kernel VM tier (needs the nvme_tcp module): scripts/kernel-vm.d/tests/60-csi.sh"]
async fn nvme_tcp_fails_over_by_restaging_on_another_node() {
    require_kernel(Method::NvmeTcp).await;
    let mut nodes = Nodes::start_with_nvmf("kernel-failover", Default::default(), [true; 3]).await;
    let c = ControllerPlugin::new(Arc::clone(&nodes.cluster));
    let access = Access::Block;
    let volume_id = create(&c, "k-failover", access).await;
    let id = VolumeId::parse(&volume_id).unwrap();
    let a = ["node1", "node2", "node3"]
        .into_iter()
        .find(|n| !id.nodes.iter().any(|r| r == n))
        .unwrap()
        .to_string();
    let b = id.nodes[0].clone();
    let index = |n: &str| n[4..].parse::<usize>().unwrap() - 1;
    let (cfg_a, cfg_b) = (
        config(&nodes, &a, Method::NvmeTcp),
        config(&nodes, &b, Method::NvmeTcp),
    );
    let ka = Kernel {
        method: Method::NvmeTcp,
        state: cfg_a.state_dir.clone(),
        volume: id.name.clone(),
        nvmf_port: nodes.daemons[index(&a)].nvmf_port,
    };
    let kb = Kernel {
        method: Method::NvmeTcp,
        state: cfg_b.state_dir.clone(),
        volume: id.name.clone(),
        nvmf_port: nodes.daemons[index(&b)].nvmf_port,
    };
    let node_a = NodePlugin::new(Arc::clone(&nodes.cluster), cfg_a);
    let node_b = NodePlugin::new(Arc::clone(&nodes.cluster), cfg_b);
    let (stage_a, stage_b) = (nodes.work.join("stage-a"), nodes.work.join("stage-b"));
    let (target_a, target_b) = (nodes.work.join("target-a"), nodes.work.join("target-b"));

    stage(&node_a, &volume_id, &stage_a, access)
        .await
        .expect("NodeStageVolume on A");
    let dev_a = ka.attached(OLD_BYTES);
    publish(&node_a, &volume_id, &stage_a, &target_a, access).await;
    let sum = write_data(&target_a, access);
    eprintln!("A ({a}): wrote {DATA_BYTES} bytes through /dev/{dev_a}, sha256 {sum}");

    // A's daemon dies: its engine with it. The kernel's controller goes
    // on trying to reconnect to it.
    nodes.daemons[index(&a)].kill();
    let nqn = ka.nqn();
    let lost = common::wait_for("A's controller to lose its daemon", || {
        let nqn = nqn.clone();
        async move {
            let c = nvme_controllers(&nqn);
            (!c.is_empty() && c.iter().all(|(_, _, s)| s != "live")).then_some(c)
        }
    })
    .await;
    eprintln!("A's daemon killed: the kernel keeps its controller {lost:?}");
    let e = stage(&node_b, &volume_id, &stage_b, access)
        .await
        .expect_err("B's stage while the kernel has the subsystem connected to A's daemon");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains(&format!("trsvcid={}", ka.nvmf_port)),
        "the refusal names where the subsystem is connected: {e:?}"
    );
    eprintln!("B refused while A's controller is left: {}", e.message());
    assert!(
        !kb.state.join(&id.name).exists(),
        "B's refused stage left its state"
    );

    // A's host goes: its kernel lets go of the volume (unpublished
    // first: nothing holds the device).
    unpublish(&node_a, &volume_id, &target_a).await;
    let out = std::process::Command::new("nvme")
        .args(["disconnect", "-n", &nqn])
        .output()
        .expect("nvme (Debian package nvme-cli)");
    assert!(out.status.success(), "nvme disconnect: {out:?}");
    common::wait_for("A's controller to go", || {
        let nqn = nqn.clone();
        async move { nvme_controllers(&nqn).is_empty().then_some(()) }
    })
    .await;

    stage(&node_b, &volume_id, &stage_b, access)
        .await
        .expect("NodeStageVolume on B after A died");
    let dev_b = kb.attached(OLD_BYTES);
    publish(&node_b, &volume_id, &stage_b, &target_b, access).await;
    assert_published_on(&target_b, &dev_b, access);
    assert_eq!(
        read_data(&target_b, access),
        sum,
        "B does not read back what A acknowledged"
    );
    eprintln!("B ({b}): read back sha256 {sum} through /dev/{dev_b}");
    unpublish(&node_b, &volume_id, &target_b).await;
    unstage(&node_b, &volume_id, &stage_b).await;
    kb.gone(&dev_b);
    delete(&c, &volume_id).await;
}
