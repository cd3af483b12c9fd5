//! `lull csi`: lull's Kubernetes CSI plugin, the bridge between
//! Kubernetes (which keeps the desired state) and the node daemons
//! (`lull serve --store`, which keep the replicas and run the engines).
//! gRPC with tonic over a Unix socket, from the official CSI v1 proto
//! (`proto/csi.proto`).
//!
//! ```text
//! lull csi --endpoint unix:///csi/csi.sock --nodes /etc/lull/nodes.json \
//!          --role all --node-id node-a --attach nvme-tcp
//! ```
//!
//! | module | what |
//! |---|---|
//! | [`identity`] | plugin name, capabilities, probe |
//! | [`controller`] | stateless placement: CreateVolume, DeleteVolume, ListVolumes, GetCapacity, ControllerGetVolume, ControllerGetVolumeHealth ([`health`]) |
//! | [`node`] | stage (engine + attach), publish (bind mounts), stats |
//! | [`volume_id`] | the placement written into the volume id |
//! | [`placement`] | the pure choice of distinct nodes with room |
//! | [`cluster`], [`nodes`], [`discovery`] | the node list (a file, or the node DaemonSet's pods in Kubernetes) and the calls to the daemons |
//! | [`attach`], [`mounts`], [`cmd`] | the node's tools and what the kernel says is mounted |
//! | [`registration`] | the kubelet's plugin-registration API, served by the node plugin |

#![forbid(unsafe_code)]

pub mod attach;
pub mod capability;
pub mod cluster;
pub mod cmd;
pub mod controller;
pub mod discovery;
pub mod health;
pub mod identity;
pub mod mounts;
pub mod node;
pub mod nodes;
pub mod placement;
pub mod registration;
pub mod snapshot_id;
pub mod snapshots;
pub mod volume_id;

/// The CSI v1 messages and services, generated from `proto/csi.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("csi.v1");
}

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::net::UnixListener;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::Status;

use crate::attach::Method;
use crate::cluster::Cluster;
use crate::controller::ControllerPlugin;
use crate::identity::IdentityPlugin;
use crate::node::{NodeConfig, NodePlugin};

/// Which services a plugin process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Controller,
    Node,
    /// Both, in one process (a single-node set-up, csi-sanity).
    All,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "controller" => Some(Role::Controller),
            "node" => Some(Role::Node),
            "all" => Some(Role::All),
            _ => None,
        }
    }
}

/// Everything `lull csi` needs, resolved from its flags.
#[derive(Debug, Clone)]
pub struct CsiConfig {
    /// `unix:///PATH` (or `unix:PATH`): where the CO connects.
    pub endpoint: String,
    pub nodes_file: PathBuf,
    pub role: Role,
    /// This node's id in the node list (the node role needs it).
    pub node_id: Option<String>,
    pub state_dir: PathBuf,
    pub attach: Method,
    /// Register with the kubelet (the node role): serve its
    /// plugin-registration API on a socket in this directory.
    pub registration: Option<registration::RegistrationConfig>,
}

#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    #[error("--endpoint {0:?}: a Unix socket, unix:///PATH")]
    Endpoint(String),
    #[error("node list: {0}")]
    Nodes(#[from] nodes::NodesError),
    #[error("node {0:?}: {1}")]
    Tls(String, lull_rpc::RpcTlsError),
    #[error("registration with the kubelet is for the node role (--role node or all)")]
    RegistrationRole,
    #[error("node discovery from Kubernetes: {0}")]
    Discovery(String),
    #[error("the node role needs --node-id, one of the node list's ids")]
    NoNodeId,
    #[error("--node-id {0:?} is not in the node list")]
    UnknownNodeId(String),
    #[error("{path}: {source}", path = path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// The socket path of a `unix://` endpoint.
pub fn endpoint_path(endpoint: &str) -> Result<PathBuf, CsiError> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .ok_or_else(|| CsiError::Endpoint(endpoint.to_string()))?;
    if !path.starts_with('/') {
        return Err(CsiError::Endpoint(endpoint.to_string()));
    }
    Ok(PathBuf::from(path))
}

/// Serves the plugin until `shutdown` completes.
pub async fn serve(
    config: CsiConfig,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), CsiError> {
    let path = endpoint_path(&config.endpoint)?;
    let source = nodes::load_source(&config.nodes_file)?;
    let (cluster, discovered) = match source {
        nodes::NodeSource::List(nodes) => (
            Cluster::new(nodes).map_err(|(n, e)| CsiError::Tls(n, e))?,
            None,
        ),
        nodes::NodeSource::Kubernetes(kube) => (
            Cluster::new(Vec::new()).map_err(|(n, e)| CsiError::Tls(n, e))?,
            Some(kube),
        ),
    };
    let cluster = Arc::new(cluster);
    // Discovery runs for as long as the plugin serves (the guard ends it).
    let _discovery = match discovered {
        None => None,
        Some(kube) => {
            let api = Arc::new(discovery::ApiServer::in_cluster().map_err(CsiError::Discovery)?);
            let (tx, rx) = tokio::sync::oneshot::channel();
            let task = tokio::spawn(discovery::run(api, kube, Arc::clone(&cluster), tx));
            // Served after the first read, so that the first calls (the
            // kubelet's NodeGetInfo) see the nodes; a failed read is
            // retried by the task, the plugin serves meanwhile.
            match tokio::time::timeout(FIRST_DISCOVERY_WAIT, rx).await {
                Ok(Ok(Ok(n))) => tracing::info!(nodes = n, "node list from Kubernetes"),
                Ok(Ok(Err(e))) => tracing::warn!("node discovery from Kubernetes: {e}; retrying every {:?}", discovery::DISCOVERY_INTERVAL),
                _ => tracing::warn!("node discovery from Kubernetes: no answer in {FIRST_DISCOVERY_WAIT:?}; retrying"),
            }
            Some(AbortOnDrop(task))
        }
    };
    let serves_node = matches!(config.role, Role::Node | Role::All);
    let serves_controller = matches!(config.role, Role::Controller | Role::All);
    let node = if serves_node {
        let node_id = config.node_id.clone().ok_or(CsiError::NoNodeId)?;
        if cluster.node(&node_id).is_none() {
            if _discovery.is_none() {
                return Err(CsiError::UnknownNodeId(node_id));
            }
            // Discovered: this node's daemon pod may not run yet.
            tracing::warn!(node = %node_id, "this node is not among the discovered nodes yet: its volumes are UNAVAILABLE until its lull daemon pod runs");
        }
        if let Err(reason) = config.attach.check(&attach::Host::default()).await {
            // Served all the same: NodeStageVolume answers with the
            // reason, and the CO shows it on the workload.
            tracing::warn!("{reason}");
        }
        std::fs::create_dir_all(&config.state_dir).map_err(|source| CsiError::Io {
            path: config.state_dir.clone(),
            source,
        })?;
        Some(NodePlugin::new(
            Arc::clone(&cluster),
            NodeConfig {
                node_id,
                state_dir: config.state_dir.clone(),
                attach: config.attach,
            },
        ))
    } else {
        None
    };
    if config.registration.is_some() && !serves_node {
        return Err(CsiError::RegistrationRole);
    }
    let listener = bind_unix(&path)?;
    let router = tonic::transport::Server::builder().add_service(
        pb::identity_server::IdentityServer::new(IdentityPlugin {
            controller: serves_controller,
        }),
    );
    let router = {
        let r = router.add_optional_service(serves_controller.then(|| {
            pb::controller_server::ControllerServer::new(ControllerPlugin::new(Arc::clone(
                &cluster,
            )))
        }));
        r.add_optional_service(node.map(pb::node_server::NodeServer::new))
    };
    tracing::info!(endpoint = %path.display(), role = ?config.role, nodes = cluster.nodes().len(), "lull csi listening on {}", path.display());
    let shutdown = futures::FutureExt::shared(Box::pin(shutdown));
    let csi =
        router.serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown.clone());
    let result = match &config.registration {
        None => csi.await,
        Some(reg) => {
            // After the CSI socket: the kubelet calls NodeGetInfo as soon
            // as it sees the registration socket.
            let reg_path = reg.socket();
            let reg_listener = bind_unix(&reg_path)?;
            let plugin = Arc::new(registration::RegistrationPlugin::new(
                reg.kubelet_endpoint.clone(),
            ));
            tracing::info!(socket = %reg_path.display(), endpoint = %reg.kubelet_endpoint, "serving the kubelet's plugin registration");
            let reg_server = tonic::transport::Server::builder()
                .add_service(registration::pb::registration_server::RegistrationServer::new(plugin))
                .serve_with_incoming_shutdown(registration::incoming(reg_listener), shutdown);
            let (a, b) = tokio::join!(csi, reg_server);
            // The kubelet deregisters the driver when its socket goes.
            let _ = std::fs::remove_file(&reg_path);
            a.and(b)
        }
    };
    let _ = std::fs::remove_file(&path);
    result?;
    Ok(())
}

/// Binds a Unix socket at `path`, removing one a previous run left (it
/// would refuse the bind) and making its directory.
fn bind_unix(path: &std::path::Path) -> Result<UnixListener, CsiError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(CsiError::Io {
                path: path.to_path_buf(),
                source: e,
            })
        }
        _ => {}
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| CsiError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    UnixListener::bind(path).map_err(|source| CsiError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Runs the plugin on its own tokio runtime until `wait_for_stop`
/// returns (the binary passes a wait for SIGINT/SIGTERM; it runs on a
/// thread of its own, so it may block).
pub fn run(
    config: CsiConfig,
    wait_for_stop: impl FnOnce() + Send + 'static,
) -> Result<(), CsiError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CSI_WORKER_THREADS)
        .enable_all()
        .build()
        .map_err(|source| CsiError::Io {
            path: PathBuf::from("(tokio runtime)"),
            source,
        })?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name("csi-stop".into())
        .spawn(move || {
            wait_for_stop();
            let _ = stop_tx.send(());
        })
        .map_err(|source| CsiError::Io {
            path: PathBuf::from("(stop thread)"),
            source,
        })?;
    runtime.block_on(serve(config, async {
        let _ = stop_rx.await;
        tracing::info!("lull csi stopping");
    }))
}

/// How long the plugin waits for the first node list from Kubernetes
/// before it serves: the API server answers in milliseconds; past this
/// the plugin serves and the list comes with a later read.
pub const FIRST_DISCOVERY_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// A task aborted when this is dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Worker threads of the plugin's runtime: calls spend their time waiting
/// on node daemons and tools (on the blocking pool), so two are plenty on
/// any node and leave the cores to the data path.
pub const CSI_WORKER_THREADS: usize = 2;

/// Volumes with a call in progress. CSI asks a plugin to answer ABORTED
/// to a second call for a volume while one is running; each call takes
/// its volume's name for its duration.
#[derive(Debug, Default, Clone)]
pub struct Busy(Arc<Mutex<HashSet<String>>>);

/// A volume taken by [`Busy::take`], given back when dropped.
#[derive(Debug)]
pub struct BusyGuard {
    set: Arc<Mutex<HashSet<String>>>,
    name: String,
}

impl Busy {
    pub fn take(&self, name: &str) -> Result<BusyGuard, Status> {
        let mut set = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if !set.insert(name.to_string()) {
            return Err(Status::aborted(format!(
                "an operation on volume {name} is in progress"
            )));
        }
        Ok(BusyGuard {
            set: Arc::clone(&self.0),
            name: name.to_string(),
        })
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.name);
    }
}

/// Waits between looks at a state that settles in milliseconds (an
/// engine's replicas, a FUSE mount): 2 ms first, doubling up to `max`, so
/// a quick change is seen quickly (a stage took 170 ms against 16 of work
/// when every wait was the full interval) and a slow one costs few looks.
pub(crate) struct Backoff {
    next: std::time::Duration,
    max: std::time::Duration,
}

impl Backoff {
    /// The first wait of a backoff.
    const FIRST: std::time::Duration = std::time::Duration::from_millis(2);

    pub(crate) fn new(max: std::time::Duration) -> Backoff {
        Backoff {
            next: Backoff::FIRST.min(max),
            max,
        }
    }

    pub(crate) async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            endpoint_path("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            endpoint_path("unix:/x.sock").unwrap(),
            PathBuf::from("/x.sock")
        );
        assert!(endpoint_path("tcp://127.0.0.1:1").is_err());
        assert!(endpoint_path("unix://relative.sock").is_err());
    }

    #[test]
    fn a_busy_volume_is_aborted_until_released() {
        let busy = Busy::default();
        let guard = busy.take("v").unwrap();
        assert_eq!(busy.take("v").unwrap_err().code(), tonic::Code::Aborted);
        assert!(busy.take("w").is_ok());
        drop(guard);
        assert!(busy.take("v").is_ok());
    }
}
