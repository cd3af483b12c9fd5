//! `lull csi`: the Kubernetes CSI plugin ([`lull_csi::run`]) with its
//! flags; SIGINT and SIGTERM stop it.
//!
//! ```text
//! $ lull csi --endpoint unix:///csi/csi.sock --nodes /etc/lull/nodes.json \
//!       --role node --node-id node-a --attach nvme-tcp
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use lull_csi::attach::Method;
use lull_csi::registration::RegistrationConfig;
use lull_csi::{CsiConfig, Role};

use crate::cli::{signals, usage_error};

/// `lull csi`: serve the CSI Identity, Controller and Node services.
#[derive(clap::Args, Debug, Clone)]
pub struct CsiArgs {
    /// Where the container orchestrator connects: unix:///PATH.
    #[arg(long, value_name = "unix:///PATH")]
    pub endpoint: String,
    /// The node list: a JSON file of nodes (id, rpc address, TLS
    /// material, nbd address, topology); docs/KUBERNETES.md.
    #[arg(long, value_name = "FILE")]
    pub nodes: PathBuf,
    /// Which services to serve: controller, node or all.
    #[arg(long, default_value = "all", value_name = "ROLE")]
    pub role: String,
    /// This node's id in the node list (the node role needs it).
    #[arg(long, value_name = "ID")]
    pub node_id: Option<String>,
    /// How a staged volume becomes a block device on this node:
    /// nvme-tcp (the kernel's NVMe/TCP initiator, the nvme_tcp module),
    /// nbd (the nbd module) or fuse (nbdfuse and a loop device: the
    /// fallback for kernels without those modules).
    #[arg(long, default_value = "nvme-tcp", value_name = "METHOD")]
    pub attach: String,
    /// Where the node plugin keeps its per-volume files (FUSE mounts).
    #[arg(long, default_value = "/var/lib/lull-csi", value_name = "DIR")]
    pub state_dir: PathBuf,
    /// Register the node plugin with the kubelet: serve its
    /// plugin-registration API on a socket in DIR (the host's
    /// /var/lib/kubelet/plugins_registry as the container mounts it), in
    /// place of the node-driver-registrar sidecar. Needs
    /// --kubelet-registration-path.
    #[arg(long, value_name = "DIR", requires = "kubelet_registration_path")]
    pub registration_dir: Option<PathBuf>,
    /// The CSI socket's path on the host, as the kubelet dials it (e.g.
    /// /var/lib/kubelet/plugins/csi.lull.io/csi.sock).
    #[arg(long, value_name = "PATH", requires = "registration_dir")]
    pub kubelet_registration_path: Option<String>,
}

/// Runs the plugin until SIGINT or SIGTERM; exit 2 for bad flags, 1 when
/// the plugin cannot start or stops with an error.
pub fn run(args: &CsiArgs) -> ExitCode {
    let Some(role) = Role::parse(&args.role) else {
        return usage_error(format!("--role {:?}: controller, node or all", args.role));
    };
    let Some(attach) = Method::parse(&args.attach) else {
        return usage_error(format!("--attach {:?}: fuse, nbd or nvme-tcp", args.attach));
    };
    let mut stop = match signals::stop_signals() {
        Ok(s) => s,
        Err(code) => return code,
    };
    let config = CsiConfig {
        endpoint: args.endpoint.clone(),
        nodes_file: args.nodes.clone(),
        role,
        node_id: args.node_id.clone(),
        state_dir: args.state_dir.clone(),
        attach,
        registration: args
            .registration_dir
            .clone()
            .zip(args.kubelet_registration_path.clone())
            .map(|(dir, kubelet_endpoint)| RegistrationConfig {
                dir,
                kubelet_endpoint,
            }),
    };
    match lull_csi::run(config, move || {
        stop.forever().next();
    }) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lull csi: error: {e}");
            ExitCode::FAILURE
        }
    }
}
