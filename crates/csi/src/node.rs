//! The Node service: on the node a volume is used on, stage creates the
//! volume's engine in this node's daemon (its replicas stay where the
//! volume id says) and attaches it; publish hands it to the workload.
//!
//! ```text
//! NodeStageVolume   volume_create NAME replicas=A/NAME+B/NAME   (this node's daemon;
//!                     nvme-tcp: nvmf_nqn, and nvmf_allow_hosts = this host's NQN)
//!                   attach (crate::attach):
//!                     fuse      nbdfuse + losetup      -> /dev/loopN
//!                     nbd       nbd-client             -> /dev/nbdN
//!                     nvme-tcp  nvme connect           -> /dev/nvmeXnY
//!                   mount: mkfs on first use, mount at the staging path
//! NodePublishVolume block: bind-mount the device on the target file
//!                   mount: bind-mount the staging path on the target directory
//! NodeUnpublish / NodeUnstage undo exactly that; each call can be repeated.
//! ```
//!
//! What is staged is read back from the kernel (mountinfo, `losetup -j`,
//! sysfs) and the daemon; the plugin's own records (the attach method's,
//! under the state directory) say only what it attached, so that it is
//! undone exactly.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;
use tonic::{Request, Response, Status};

use crate::attach::{self, Attached, Attacher, Export, Host, Method};
use crate::capability::{self, Access};
use crate::cluster::Cluster;
use crate::cmd;
use crate::health;
use crate::mounts;
use crate::nodes::Node;
use crate::pb::node_server::Node as NodeService;
use crate::pb::*;
use crate::volume_id::VolumeId;
use crate::Busy;

/// The xfs mount option that skips xfs's check against a second mount of
/// the same filesystem UUID on the node, which a clone of a volume (or a
/// claim restored from its snapshot) would fail beside its origin.
const XFS_NO_UUID_CHECK: &str = "nouuid";

/// How long a new engine may take to reach its replicas (TCP, TLS, HELLO
/// and the election): well under a second on a healthy network; a
/// replica's own connect timeout is 8 s, so 30 s lets a slow one be
/// retried a few times.
pub const ENGINE_READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a deleted engine may take to let go of its replicas (a
/// clean detach: in-flight I/O drained, the clean flag written).
pub const ENGINE_RELEASE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The longest wait between two looks at the engine's `replica_list`
/// (the first looks come sooner: `crate::Backoff`).
const ENGINE_POLL_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// The node plugin's settings.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// This node's id in the node list.
    pub node_id: String,
    /// Where the attach method keeps its per-volume files.
    pub state_dir: PathBuf,
    pub attach: Method,
}

#[derive(Debug)]
pub struct NodePlugin {
    cluster: Arc<Cluster>,
    config: NodeConfig,
    attacher: Attacher,
    busy: Busy,
}

impl NodePlugin {
    /// The node plugin on this machine ([`Host::default`]: /sys, /dev,
    /// the tools on the PATH).
    pub fn new(cluster: Arc<Cluster>, config: NodeConfig) -> NodePlugin {
        NodePlugin::with_host(cluster, config, Host::default())
    }

    /// The node plugin with its attach reading and running what `host`
    /// says (tests: a fake sysfs and fake tools).
    pub fn with_host(cluster: Arc<Cluster>, config: NodeConfig, host: Host) -> NodePlugin {
        NodePlugin {
            attacher: Attacher::new(config.attach, host, config.state_dir.clone()),
            cluster,
            config,
            busy: Busy::default(),
        }
    }

    /// This node's entry in the node list: checked at start for a list
    /// from a file; with discovery from Kubernetes it is there once this
    /// node's daemon pod runs (UNAVAILABLE until then: the CO retries).
    fn me(&self) -> Result<Node, Status> {
        self.cluster.node(&self.config.node_id).ok_or_else(|| {
            Status::unavailable(format!(
                "node {:?} is not in the node list (yet): its lull daemon is not known to be running",
                self.config.node_id
            ))
        })
    }

    /// Where the attach method connects to the volume's engine on this
    /// node's daemon: its NBD server (`fuse`, `nbd`) or its NVMe/TCP
    /// target (`nvme-tcp`, with this host's NQN when it has one).
    fn export(&self, id: &VolumeId) -> Result<Export, Status> {
        let method = self.config.attach;
        let missing = |field: &str, flag: &str| {
            Status::failed_precondition(format!(
                "node {:?} has no \"{field}\" address in the node list (its daemon's {flag}): the attach method {} connects there",
                self.config.node_id,
                method.name()
            ))
        };
        match method {
            Method::Fuse | Method::Nbd => Ok(Export::Nbd {
                addr: self.me()?.nbd.ok_or_else(|| missing("nbd", "--listen"))?,
            }),
            Method::NvmeTcp => Ok(Export::Nvmf {
                addr: self
                    .me()?
                    .nvmf
                    .ok_or_else(|| missing("nvmf", "--nvmf-listen"))?,
                nqn: attach::nqn_of(&id.name),
                hostnqn: self
                    .attacher
                    .host
                    .host_nqn()
                    .map_err(|e| Status::failed_precondition(e.to_string()))?,
            }),
        }
    }

    /// The volume's engine on this node's daemon, created if missing;
    /// whether this call created it. For the `nvme-tcp` export the
    /// engine is created with the volume's NQN and, when the host has
    /// one, only this host's NQN allowed (docs/NVMF.md): a daemon that
    /// serves no NVMe/TCP refuses it, and nothing is created.
    async fn ensure_engine(&self, id: &VolumeId, export: &Export) -> Result<bool, Status> {
        let me = &self.config.node_id;
        let mut links = Vec::with_capacity(id.nodes.len());
        for node in &id.nodes {
            if self.cluster.node(node).is_none() {
                return Err(Status::failed_precondition(format!(
                    "volume {}: its replica node {node:?} is not in the node list",
                    id.name
                )));
            }
            let store = self
                .cluster
                .call(node, "store_get", json!({}))
                .await
                .map_err(|e| e.status())?;
            let addr = store["replica_addr"].as_str().ok_or_else(|| {
                Status::internal(format!("node {node:?}: store_get has no replica_addr"))
            })?;
            links.push(format!("{addr}/{}", id.name));
        }
        let size = self.replica_size(id).await?;
        // Recorded on the node, with its engine's session: a daemon that
        // restarts (a crash, an upgrade) re-creates the engine, so the
        // kernel's controller reconnects and the pod's I/O resumes; an
        // engine another node has taken over since (a failover by
        // restaging) is refused by the replicas' fencing and dropped
        // there (`resume`, docs/KUBERNETES.md).
        let mut params = json!({
            "name": id.name,
            "size": size,
            "backend": format!("replicas={}", links.join("+")),
            "persist": true,
            "resume": true,
        });
        if let Export::Nvmf { nqn, hostnqn, .. } = export {
            params["nvmf_nqn"] = json!(nqn);
            if let Some(h) = hostnqn {
                params["nvmf_allow_hosts"] = json!([h]);
            }
        }
        let created = match self.cluster.call(me, "volume_create", params).await {
            Ok(_) => true,
            Err(e) if e.refusal().is_some_and(|m| m.contains("already exists")) => false,
            Err(e) if e.refusal().is_some_and(|m| m.contains("--nvmf-listen")) => {
                return Err(Status::failed_precondition(format!(
                    "volume {}: attach method nvme-tcp: node {me:?}'s daemon serves no NVMe/TCP (start lull serve with --nvmf-listen): {e}",
                    id.name
                )))
            }
            Err(e) => return Err(e.status()),
        };
        if let Err(e) = self.wait_engine_ready(id).await {
            if created {
                self.delete_engine(id).await;
            }
            return Err(e);
        }
        Ok(created)
    }

    /// Deletes the volume's engine on this node, undoing a stage that
    /// failed; a failure here is logged (the stage's own error is the
    /// one the CO sees).
    async fn delete_engine(&self, id: &VolumeId) {
        if let Err(e) = self
            .cluster
            .call(
                &self.config.node_id,
                "volume_delete",
                json!({ "name": id.name }),
            )
            .await
        {
            tracing::warn!(volume = %id.name, error = %e, "could not delete the engine of a failed stage");
        }
    }

    /// Waits until the engine's replicas are out of "connecting" and one
    /// is healthy: I/O before that would fail (no healthy replica). A
    /// replica still failed at the deadline (its node down) leaves the
    /// volume degraded, which serves.
    async fn wait_engine_ready(&self, id: &VolumeId) -> Result<(), Status> {
        let deadline = std::time::Instant::now() + ENGINE_READY_TIMEOUT;
        let mut backoff = crate::Backoff::new(ENGINE_POLL_INTERVAL);
        loop {
            let list = self
                .cluster
                .call(
                    &self.config.node_id,
                    "replica_list",
                    json!({ "volume": id.name }),
                )
                .await
                .map_err(|e| e.status())?;
            let states: Vec<&str> = list
                .as_array()
                .map(|a| a.iter().filter_map(|r| r["state"].as_str()).collect())
                .unwrap_or_default();
            let healthy = states.contains(&"healthy");
            let settled = !states.contains(&"connecting");
            if healthy && settled {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                if healthy {
                    tracing::warn!(volume = %id.name, ?states, "staging degraded: not every replica answered");
                    return Ok(());
                }
                return Err(Status::unavailable(format!(
                    "volume {}: no healthy replica within {ENGINE_READY_TIMEOUT:?} (replica states: {states:?})",
                    id.name
                )));
            }
            backoff.wait().await;
        }
    }

    /// The volume's size, from the first replica node that answers.
    async fn replica_size(&self, id: &VolumeId) -> Result<u64, Status> {
        let mut last = None;
        for node in &id.nodes {
            match self
                .cluster
                .call(node, "replica_get", json!({ "name": id.name }))
                .await
            {
                Ok(r) => {
                    return r["size_bytes"].as_u64().ok_or_else(|| {
                        Status::internal(format!("node {node:?}: replica_get has no size_bytes"))
                    })
                }
                Err(e) if e.refusal().is_some_and(|m| m.contains("no replica")) => {
                    return Err(Status::not_found(format!(
                        "volume {}: no replica on node {node:?}",
                        id.name
                    )))
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or_else(
            || Status::internal("volume id names no node"),
            |e| e.status(),
        ))
    }

    async fn stage(&self, req: NodeStageVolumeRequest) -> Result<(), Status> {
        // Every missing field is INVALID_ARGUMENT before an unknown
        // volume is NOT_FOUND.
        require("volume_id", &req.volume_id)?;
        require("staging_target_path", &req.staging_target_path)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        let (access, _) = capability::check(cap).map_err(Status::invalid_argument)?;
        let id = parse_id(&req.volume_id)?;
        // Before anything is created: a method this node cannot do, or
        // an address the node list lacks, leaves the node untouched.
        self.attacher
            .check()
            .await
            .map_err(Status::failed_precondition)?;
        let export = self.export(&id)?;
        let _busy = self.busy.take(&id.name)?;
        let staging = PathBuf::from(&req.staging_target_path);
        if let Access::Mount { .. } = access {
            if mounted(&staging)?.is_some() {
                return Ok(());
            }
        }
        let engine_created = self.ensure_engine(&id, &export).await?;
        let was_attached = self
            .attacher
            .attached(&id.name)
            .await
            .ok()
            .flatten()
            .is_some();
        let outcome = self.attach_and_mount(&id, &export, access, &staging).await;
        if outcome.is_err() {
            // Never half-staged: undo what this call set up, so that the
            // node is as it was (a retry starts again from there): the
            // attach and its records (the volume's state directory), then
            // the engine.
            if !was_attached {
                if let Err(e) = self.attacher.detach(&id.name).await {
                    tracing::warn!(volume = %id.name, error = %e, "could not detach after a failed stage");
                }
            }
            if engine_created {
                self.delete_engine(&id).await;
            }
        }
        outcome
    }

    /// Attaches the volume's engine and, for the mount access type, makes
    /// its filesystem on first use and mounts it at the staging path.
    async fn attach_and_mount(
        &self,
        id: &VolumeId,
        export: &Export,
        access: Access,
        staging: &Path,
    ) -> Result<(), Status> {
        let dev = self
            .attacher
            .attach(&id.name, export)
            .await
            .map_err(|e| e.status(&id.name, "attach"))?;
        if let Access::Mount { fs_type, flags } = access {
            format_if_blank(&dev, &fs_type).await?;
            if fs_type == "ext4" {
                grow_ext4_unmounted(&id.name, &dev).await?;
            }
            std::fs::create_dir_all(staging).map_err(|e| io_status(staging, e))?;
            let mut options = flags;
            // A clone or a claim restored from a snapshot holds its
            // origin's xfs, UUID and all, and xfs refuses a second mount
            // of a UUID on one node ("Filesystem has duplicate UUID"):
            // the e2e suite's clone on the origin's node hit it. A staged
            // volume is mounted once per node (this plugin's staging), so
            // the check guards nothing here.
            if fs_type == "xfs" && !options.iter().any(|o| o == XFS_NO_UUID_CHECK) {
                options.push(XFS_NO_UUID_CHECK.to_string());
            }
            let mut args = vec!["-t".to_string(), fs_type];
            if !options.is_empty() {
                args.push("-o".into());
                args.push(options.join(","));
            }
            args.push(dev);
            args.push(staging.to_string_lossy().into_owned());
            cmd::run("mount", &args).await.map_err(tool_status)?;
        }
        Ok(())
    }

    async fn unstage(&self, req: NodeUnstageVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        if req.staging_target_path.is_empty() {
            return Err(Status::invalid_argument("staging_target_path is required"));
        }
        let Some(id) = VolumeId::parse(&req.volume_id) else {
            return Err(Status::not_found(format!(
                "no volume {:?} (not an id of this plugin)",
                req.volume_id
            )));
        };
        let _busy = self.busy.take(&id.name)?;
        let staging = PathBuf::from(&req.staging_target_path);
        if mounted(&staging)?.is_some() {
            cmd::run("umount", &[staging.as_os_str()])
                .await
                .map_err(tool_status)?;
        }
        self.attacher
            .detach(&id.name)
            .await
            .map_err(|e| e.status(&id.name, "detach"))?;
        match self
            .cluster
            .call(
                &self.config.node_id,
                "volume_delete",
                json!({ "name": id.name }),
            )
            .await
        {
            Ok(_) => {}
            Err(e) if e.refusal().is_some_and(|m| m.contains("no volume")) => {}
            Err(e) => return Err(e.status()),
        }
        self.wait_replicas_released(&id).await;
        Ok(())
    }

    /// Waits until no engine holds the volume's replicas any more: the
    /// engine's detach finishes after `volume_delete` answers, and a
    /// DeleteVolume right after the unstage would be refused while it
    /// runs. A node that does not answer is not waited for.
    async fn wait_replicas_released(&self, id: &VolumeId) {
        let deadline = std::time::Instant::now() + ENGINE_RELEASE_TIMEOUT;
        for node in &id.nodes {
            let mut backoff = crate::Backoff::new(ENGINE_POLL_INTERVAL);
            loop {
                let held = match self
                    .cluster
                    .call(node, "replica_get", json!({ "name": id.name }))
                    .await
                {
                    Ok(r) => !r["held_by_session"].is_null(),
                    Err(_) => false,
                };
                if !held {
                    break;
                }
                if std::time::Instant::now() >= deadline {
                    tracing::warn!(volume = %id.name, node = %node, "unstaged, but the replica is still held by an engine session");
                    return;
                }
                backoff.wait().await;
            }
        }
    }

    async fn publish(&self, req: NodePublishVolumeRequest) -> Result<(), Status> {
        require("volume_id", &req.volume_id)?;
        require("target_path", &req.target_path)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        let (access, cap_read_only) = capability::check(cap).map_err(Status::invalid_argument)?;
        let id = parse_id(&req.volume_id)?;
        if req.staging_target_path.is_empty() {
            return Err(Status::failed_precondition(
                "staging_target_path is required: this plugin stages volumes (STAGE_UNSTAGE_VOLUME)",
            ));
        }
        let _busy = self.busy.take(&id.name)?;
        let target = PathBuf::from(&req.target_path);
        if mounted(&target)?.is_some() {
            return Ok(());
        }
        let source = match access {
            Access::Block => {
                let dev = self
                    .attacher
                    .attached(&id.name)
                    .await
                    .ok()
                    .flatten()
                    .map(|a| a.device)
                    .ok_or_else(|| {
                        Status::failed_precondition(format!(
                            "volume {} is not staged on this node",
                            id.name
                        ))
                    })?;
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| io_status(parent, e))?;
                }
                std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&target)
                    .map_err(|e| io_status(&target, e))?;
                dev
            }
            Access::Mount { .. } => {
                let staging = PathBuf::from(&req.staging_target_path);
                if mounted(&staging)?.is_none() {
                    return Err(Status::failed_precondition(format!(
                        "volume {} is not staged at {}",
                        id.name, req.staging_target_path
                    )));
                }
                std::fs::create_dir_all(&target).map_err(|e| io_status(&target, e))?;
                req.staging_target_path.clone()
            }
        };
        cmd::run("mount", &["--bind", &source, &req.target_path])
            .await
            .map_err(tool_status)?;
        if req.readonly || cap_read_only {
            if let Err(e) = cmd::run("mount", &["-o", "remount,bind,ro", &req.target_path]).await {
                // Never leave a writable mount where a read-only one was asked for.
                let _ = cmd::run("umount", &[&req.target_path]).await;
                return Err(tool_status(e));
            }
        }
        Ok(())
    }

    async fn unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<(), Status> {
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        if req.target_path.is_empty() {
            return Err(Status::invalid_argument("target_path is required"));
        }
        let name = VolumeId::parse(&req.volume_id).map_or(req.volume_id.clone(), |id| id.name);
        let _busy = self.busy.take(&name)?;
        let target = PathBuf::from(&req.target_path);
        if mounted(&target)?.is_some() {
            cmd::run("umount", &[target.as_os_str()])
                .await
                .map_err(tool_status)?;
        }
        // The plugin created the target (a file for block, a directory
        // for mount): it removes it.
        match std::fs::symlink_metadata(&target) {
            Ok(m) if m.is_dir() => std::fs::remove_dir(&target),
            Ok(_) => std::fs::remove_file(&target),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
        .map_err(|e| io_status(&target, e))?;
        Ok(())
    }

    /// The size of the volume's engine on this node (`volume_list`);
    /// NOT_FOUND when no engine of it runs here.
    async fn engine_size(&self, id: &VolumeId) -> Result<u64, Status> {
        let list = self
            .cluster
            .call(&self.config.node_id, "volume_list", json!({}))
            .await
            .map_err(|e| e.status())?;
        list.as_array()
            .and_then(|a| a.iter().find(|v| v["name"] == id.name.as_str()))
            .and_then(|v| v["size_bytes"].as_u64())
            .ok_or_else(|| {
                Status::not_found(format!("volume {} is not staged on this node", id.name))
            })
    }

    /// NodeExpandVolume: the attach's device takes the engine's size,
    /// then a mounted filesystem grows to the device. `nvme-tcp`: `nvme
    /// ns-rescan`, and a wait (up to [`attach::NVME_RESCAN_TIMEOUT`]) for
    /// the kernel to read the namespace's new size. With `fuse` and `nbd`
    /// the device keeps the size its NBD connection started with and
    /// takes the new one at the next stage: [`FUSE_GROWS_ONLY_AT_STAGE`],
    /// [`NBD_GROWS_ONLY_AT_STAGE`].
    async fn expand(
        &self,
        req: NodeExpandVolumeRequest,
    ) -> Result<NodeExpandVolumeResponse, Status> {
        require("volume_id", &req.volume_id)?;
        require("volume_path", &req.volume_path)?;
        let id = parse_id(&req.volume_id)?;
        let access = match &req.volume_capability {
            Some(cap) => Some(capability::check(cap).map_err(Status::invalid_argument)?.0),
            None => None,
        };
        let _busy = self.busy.take(&id.name)?;
        let path = PathBuf::from(&req.volume_path);
        let meta = match std::fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Status::not_found(format!(
                    "volume {}: no volume_path {}",
                    id.name, req.volume_path
                )))
            }
            Err(e) => return Err(io_status(&path, e)),
        };
        // Without a capability (it is optional), the path says: a
        // directory is a published filesystem, a file a block device.
        let is_mount = match access {
            Some(Access::Mount { .. }) => true,
            Some(Access::Block) => false,
            None => meta.is_dir(),
        };
        let attached = self
            .attacher
            .attached(&id.name)
            .await
            .map_err(|e| Status::internal(format!("volume {}: {e}", id.name)))?
            .ok_or_else(|| {
                Status::not_found(format!("volume {} is not staged on this node", id.name))
            })?;
        let dev = attached.device.clone();
        let engine_bytes = self.engine_size(&id).await?;
        if let Some(range) = &req.capacity_range {
            let required = u64::try_from(range.required_bytes).unwrap_or(0);
            if required > engine_bytes {
                return Err(Status::failed_precondition(format!(
                    "volume {} has {engine_bytes} bytes, less than the {required} asked: ControllerExpandVolume grows it first",
                    id.name
                )));
            }
        }
        let mut dev_bytes = device_size(&dev).await?;
        if dev_bytes < engine_bytes {
            dev_bytes = self.grow_device(&id, &attached, engine_bytes).await?;
        }
        if is_mount {
            let mount = mounted(&path)?.ok_or_else(|| {
                Status::not_found(format!(
                    "volume {} is not mounted at {}",
                    id.name, req.volume_path
                ))
            })?;
            let grown = match mount.fs_type.as_str() {
                // Online growth of a mounted ext4: resize2fs takes the
                // device; run again on a grown filesystem it does nothing.
                "ext4" => cmd::run("resize2fs", &[dev.as_str()]).await,
                "xfs" => cmd::run("xfs_growfs", &[req.volume_path.as_str()]).await,
                other => {
                    return Err(Status::failed_precondition(format!(
                        "volume {}: cannot grow a {other} filesystem (ext4 and xfs grow)",
                        id.name
                    )))
                }
            };
            match grown {
                Ok(_) => {}
                // The kernel refuses an online ext4 grow to a process
                // without CAP_SYS_RESOURCE (resize2fs: "Permission denied
                // to resize filesystem").
                Err(e @ cmd::CmdError::Failed { .. })
                    if mount.fs_type == "ext4" && e.to_string().contains("Permission denied") =>
                {
                    tracing::warn!(volume = %id.name, device = %dev, error = %e, "online ext4 grow refused: the node plugin lacks CAP_SYS_RESOURCE");
                    return Err(Status::failed_precondition(format!(
                        "volume {}: {e}: an online ext4 grow needs CAP_SYS_RESOURCE (run the node plugin privileged); without it the filesystem grows at its next stage",
                        id.name
                    )));
                }
                Err(e) => return Err(tool_status(e)),
            }
            tracing::info!(volume = %id.name, device = %dev, bytes = dev_bytes, fs = %mount.fs_type, "filesystem grown to its device");
        }
        Ok(NodeExpandVolumeResponse {
            capacity_bytes: clamp_i64(dev_bytes),
        })
    }

    /// Asks the attached device to take the volume's size
    /// ([`Attacher::refresh_size`]) and answers its size then; a device
    /// that cannot grow while attached is FAILED_PRECONDITION with the
    /// reason, one that did not within the rescan's time UNAVAILABLE
    /// (the CO retries).
    async fn grow_device(
        &self,
        id: &VolumeId,
        attached: &Attached,
        engine_bytes: u64,
    ) -> Result<u64, Status> {
        let dev = attached.device.as_str();
        self.attacher
            .refresh_size(&id.name, attached)
            .await
            .map_err(|e| e.status(&id.name, "grow the device"))?;
        let mut dev_bytes = device_size(dev).await?;
        if attached.method == Method::NvmeTcp {
            // The kernel reads the namespace again in the background.
            let deadline = std::time::Instant::now() + attach::NVME_RESCAN_TIMEOUT;
            let mut backoff = crate::Backoff::new(ENGINE_POLL_INTERVAL);
            while dev_bytes < engine_bytes && std::time::Instant::now() < deadline {
                backoff.wait().await;
                dev_bytes = device_size(dev).await?;
            }
        }
        if dev_bytes >= engine_bytes {
            return Ok(dev_bytes);
        }
        tracing::warn!(volume = %id.name, device = %dev, method = attached.method.name(), device_bytes = dev_bytes, volume_bytes = engine_bytes,
            "NodeExpandVolume: the device did not take the volume's size");
        let short = format!(
            "volume {}: {dev} has {dev_bytes} bytes of the volume's {engine_bytes}",
            id.name
        );
        Err(match attached.method {
            Method::Fuse => {
                Status::failed_precondition(format!("{short}: {FUSE_GROWS_ONLY_AT_STAGE}"))
            }
            Method::Nbd => {
                Status::failed_precondition(format!("{short}: {NBD_GROWS_ONLY_AT_STAGE}"))
            }
            Method::NvmeTcp => Status::unavailable(format!(
                "{short} {:?} after nvme ns-rescan (the retry rescans again)",
                attach::NVME_RESCAN_TIMEOUT
            )),
        })
    }

    async fn stats(
        &self,
        req: NodeGetVolumeStatsRequest,
    ) -> Result<NodeGetVolumeStatsResponse, Status> {
        if req.volume_id.is_empty() {
            return Err(Status::invalid_argument("volume_id is required"));
        }
        if req.volume_path.is_empty() {
            return Err(Status::invalid_argument("volume_path is required"));
        }
        let id = VolumeId::parse(&req.volume_id).ok_or_else(|| {
            Status::not_found(format!(
                "no volume {:?} (not an id of this plugin)",
                req.volume_id
            ))
        })?;
        let path = PathBuf::from(&req.volume_path);
        if mounted(&path)?.is_none() {
            return Err(Status::not_found(format!(
                "volume {} is not published at {}",
                id.name, req.volume_path
            )));
        }
        let meta = std::fs::metadata(&path).map_err(|e| io_status(&path, e))?;
        use volume_usage::Unit;
        let usage = if meta.is_dir() {
            let st = rustix::fs::statvfs(&path)
                .map_err(|e| io_status(&path, std::io::Error::from(e)))?;
            let block = st.f_frsize;
            vec![
                VolumeUsage {
                    available: clamp_i64(st.f_bavail.saturating_mul(block)),
                    total: clamp_i64(st.f_blocks.saturating_mul(block)),
                    used: clamp_i64(st.f_blocks.saturating_sub(st.f_bfree).saturating_mul(block)),
                    unit: Unit::Bytes as i32,
                },
                VolumeUsage {
                    available: clamp_i64(st.f_favail),
                    total: clamp_i64(st.f_files),
                    used: clamp_i64(st.f_files.saturating_sub(st.f_ffree)),
                    unit: Unit::Inodes as i32,
                },
            ]
        } else {
            // A published block device (the device bind-mounted on a
            // file): its size is all there is to say.
            let out = cmd::run("blockdev", &["--getsize64", &req.volume_path])
                .await
                .map_err(tool_status)?;
            let total: i64 = out.trim().parse().map_err(|_| {
                Status::internal(format!("blockdev --getsize64 {}: {out:?}", req.volume_path))
            })?;
            vec![VolumeUsage {
                available: 0,
                total,
                used: 0,
                unit: Unit::Bytes as i32,
            }]
        };
        Ok(NodeGetVolumeStatsResponse { usage })
    }
}

/// Why the `fuse` attach does not grow a staged volume, for the error
/// of NodeExpandVolume (docs/KUBERNETES.md, "Expansion"). Found by
/// experiment with libnbd 1.14's nbdfuse: its file keeps the size the
/// NBD handshake gave after the export grew (a new connection sees the
/// new size); and a read-write loop device cannot move to another file
/// (LOOP_CHANGE_FD is for read-only devices only).
pub const FUSE_GROWS_ONLY_AT_STAGE: &str = "the fuse attach method cannot grow a staged volume: nbdfuse serves the size the NBD handshake gave when it connected (NBD has no resize notice), and the loop device (with the filesystem or the workload on it) cannot move to a new nbdfuse file while in use; the volume grew, and its device and filesystem take the new size when it is staged again (NodeExpandVolume after the next NodeStageVolume, e.g. when the pod restarts)";

/// Why the `nbd` attach does not grow a staged volume, for the error of
/// NodeExpandVolume (docs/KUBERNETES.md, "Expansion"): the kernel's nbd
/// device has the size nbd-client gave it at connect, from the NBD
/// handshake; NBD has no resize notice, and the netlink interface
/// nbd-client configures the device with takes no new size for a
/// connected device (drivers/block/nbd.c; not tried on a kernel here:
/// no nbd module).
pub const NBD_GROWS_ONLY_AT_STAGE: &str = "the nbd attach method cannot grow a staged volume: the kernel's nbd device keeps the size the NBD handshake gave when nbd-client connected (NBD has no resize notice); the volume grew, and its device and filesystem take the new size when it is staged again (NodeExpandVolume after the next NodeStageVolume, e.g. when the pod restarts)";

/// Grows an unmounted ext4 filesystem to its device when the volume
/// grew since it was last mounted (the stage after an expansion): an
/// offline grow needs no capability beyond the device, where an online
/// one (NodeExpandVolume's) needs CAP_SYS_RESOURCE. resize2fs asks for a
/// forced check first; `e2fsck -p` fixes only what is safe unattended
/// and exits 4 or more otherwise, which fails the stage.
async fn grow_ext4_unmounted(volume: &str, dev: &str) -> Result<(), Status> {
    let header = cmd::run("dumpe2fs", &["-h", dev])
        .await
        .map_err(tool_status)?;
    let field = |name: &str| -> Option<u64> {
        header
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
    };
    let (Some(blocks), Some(block_bytes)) = (field("Block count:"), field("Block size:")) else {
        return Err(Status::internal(format!(
            "dumpe2fs -h {dev}: no block count or block size"
        )));
    };
    let dev_bytes = device_size(dev).await?;
    if blocks.saturating_mul(block_bytes) + block_bytes > dev_bytes {
        return Ok(());
    }
    match cmd::run("e2fsck", &["-f", "-p", dev]).await {
        Ok(_) => {}
        // 1: errors corrected.
        Err(e) if e.exit_code() == Some(1) => {
            tracing::warn!(volume, device = dev, error = %e, "e2fsck corrected errors before the filesystem grew");
        }
        Err(e) => return Err(tool_status(e)),
    }
    cmd::run("resize2fs", &[dev]).await.map_err(tool_status)?;
    tracing::info!(
        volume,
        device = dev,
        from = blocks * block_bytes,
        to = dev_bytes,
        "ext4 grown to its device before mounting"
    );
    Ok(())
}

/// A block device's size in bytes (`blockdev --getsize64`).
async fn device_size(dev: &str) -> Result<u64, Status> {
    let out = cmd::run("blockdev", &["--getsize64", dev])
        .await
        .map_err(tool_status)?;
    out.trim()
        .parse()
        .map_err(|_| Status::internal(format!("blockdev --getsize64 {dev}: {out:?}")))
}

fn clamp_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A required string field: INVALID_ARGUMENT naming it when empty.
fn require(field: &str, value: &str) -> Result<(), Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    Ok(())
}

/// A volume id the node can act on: required, and one this plugin wrote.
fn parse_id(id: &str) -> Result<VolumeId, Status> {
    if id.is_empty() {
        return Err(Status::invalid_argument("volume_id is required"));
    }
    VolumeId::parse(id)
        .ok_or_else(|| Status::not_found(format!("no volume {id:?} (not an id of this plugin)")))
}

fn mounted(path: &Path) -> Result<Option<mounts::Mount>, Status> {
    mounts::mounted_at(path).map_err(|e| io_status(path, e))
}

fn io_status(path: &Path, e: std::io::Error) -> Status {
    Status::internal(format!("{}: {e}", path.display()))
}

fn tool_status(e: cmd::CmdError) -> Status {
    match e {
        cmd::CmdError::Missing { .. } => Status::failed_precondition(e.to_string()),
        _ => Status::internal(e.to_string()),
    }
}

/// Makes `fs_type` on `dev` unless it already holds a filesystem (of any
/// type: a volume is never formatted twice).
async fn format_if_blank(dev: &str, fs_type: &str) -> Result<(), Status> {
    // blkid -p exits 2 when it finds no filesystem signature.
    match cmd::run("blkid", &["-p", "-o", "value", "-s", "TYPE", dev]).await {
        Ok(found) => {
            let found = found.trim();
            if !found.is_empty() && found != fs_type {
                return Err(Status::failed_precondition(format!(
                    "{dev} already holds a {found} filesystem, not {fs_type}"
                )));
            }
            Ok(())
        }
        Err(e) if e.exit_code() == Some(2) => {
            let mkfs = format!("mkfs.{fs_type}");
            let args: &[&str] = if fs_type == "ext4" {
                &["-q", "-F", dev]
            } else {
                &["-q", "-f", dev]
            };
            cmd::run(&mkfs, args).await.map_err(tool_status)?;
            Ok(())
        }
        Err(e) => Err(tool_status(e)),
    }
}

#[tonic::async_trait]
impl NodeService for NodePlugin {
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        self.stage(request.into_inner()).await?;
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        self.unstage(request.into_inner()).await?;
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        self.publish(request.into_inner()).await?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        self.unpublish(request.into_inner()).await?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        Ok(Response::new(self.stats(request.into_inner()).await?))
    }

    async fn node_get_volume_health(
        &self,
        request: Request<NodeGetVolumeHealthRequest>,
    ) -> Result<Response<NodeGetVolumeHealthResponse>, Status> {
        let req = request.into_inner();
        let id = parse_id(&req.volume_id)?;
        let states = match self
            .cluster
            .call(
                &self.config.node_id,
                "replica_list",
                json!({ "volume": id.name }),
            )
            .await
        {
            Ok(list) => list,
            Err(e) if e.refusal().is_some_and(|m| m.contains("no volume")) => {
                return Err(Status::not_found(format!(
                    "volume {} is not staged on this node",
                    id.name
                )))
            }
            Err(e) => return Err(e.status()),
        };
        let states: Vec<(String, String)> = states
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|r| {
                        (
                            r["addr"].as_str().unwrap_or("?").to_string(),
                            r["state"].as_str().unwrap_or("?").to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut health_statuses = health::engine_only(&[(self.config.node_id.clone(), states)]);
        if self
            .attacher
            .attached(&id.name)
            .await
            .map_or(true, |a| a.is_none())
        {
            health_statuses.push(volume_health::VolumeHealthEntry {
                status: VolumeHealthErrorType::Inaccessible as i32,
                reason: "NotAttached".into(),
                message: format!(
                    "the engine runs, but no device is attached on {}",
                    self.config.node_id
                ),
            });
        }
        Ok(Response::new(NodeGetVolumeHealthResponse {
            volume_health: Some(VolumeHealth {
                volume_id: req.volume_id,
                health_statuses,
            }),
        }))
    }

    async fn node_get_storage_health(
        &self,
        _request: Request<NodeGetStorageHealthRequest>,
    ) -> Result<Response<NodeGetStorageHealthResponse>, Status> {
        Err(Status::unimplemented(
            "NodeGetStorageHealth: not offered (no GET_STORAGE_HEALTH capability)",
        ))
    }

    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        Ok(Response::new(self.expand(request.into_inner()).await?))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        use node_service_capability::rpc::Type;
        let capabilities = [
            Type::StageUnstageVolume,
            Type::GetVolumeStats,
            Type::GetVolumeHealth,
            Type::ExpandVolume,
        ]
        .into_iter()
        .map(|t| NodeServiceCapability {
            r#type: Some(node_service_capability::Type::Rpc(
                node_service_capability::Rpc { r#type: t as i32 },
            )),
        })
        .collect();
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _request: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.config.node_id.clone(),
            // nbd: the devices the module made (nbds_max). Loop devices
            // (fuse) are created on demand, and NVMe/TCP controllers are
            // not counted: no limit of the plugin's own.
            max_volumes_per_node: self.attacher.max_volumes(),
            // Before discovery has seen this node: its id alone (the
            // segment every volume's topology names).
            accessible_topology: Some(Topology {
                segments: match self.me() {
                    Ok(me) => me.segments().into_iter().collect(),
                    Err(_) => [(
                        crate::nodes::TOPOLOGY_NODE_KEY.to_string(),
                        self.config.node_id.clone(),
                    )]
                    .into_iter()
                    .collect(),
                },
            }),
        }))
    }
}
