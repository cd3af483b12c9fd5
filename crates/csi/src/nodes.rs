//! The node list (`lull csi --nodes FILE`): every storage node the plugin
//! may place replicas on or stage volumes on, with how to reach its
//! daemon's JSON-RPC (TCP, TLS only), its NBD port (attach methods `fuse`
//! and `nbd`) and its NVMe/TCP port (`nvme-tcp`). In a cluster the file
//! comes from a ConfigMap; the TLS material from a Secret.
//!
//! ```json
//! {"nodes": [
//!   {"id": "node-a", "rpc": "10.0.0.7:10910", "tls_psk": "/etc/lull/rpc.psk",
//!    "nbd": "127.0.0.1:10809", "nvmf": "127.0.0.1:4420",
//!    "topology": {"topology.kubernetes.io/zone": "z1"}}
//! ]}
//! ```
//!
//! `nbd` and `nvmf` are optional: a node needs the one its plugin's
//! attach method connects to (a list without `nvmf`, written before it
//! existed, still loads).
//!
//! A relative TLS path is taken from the node list's directory.
//!
//! In place of the list, the file may say where in Kubernetes the nodes
//! are (`{"kubernetes": {...}}`, [`crate::discovery`]): the node
//! DaemonSet's running pods, read again while the plugin runs.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use lull_rpc::RpcTls;
use serde::Deserialize;

use crate::volume_id::valid_node_id;

/// The topology key every node carries: the node's own id. A
/// `TopologyRequirement` naming it asks for a volume reachable from that
/// node.
pub const TOPOLOGY_NODE_KEY: &str = "topology.lull.io/node";

/// Most nodes in a list. A controller call may ask every node for its
/// store (`store_get`, one TLS connection each): 256 bounds that fan-out
/// and is far above the clusters a node list written by hand describes.
pub const MAX_NODES: usize = 256;

/// Most topology segments per node (the CSI spec's own bound on a
/// `Topology` is 128 segments; a node has a handful).
pub const MAX_TOPOLOGY_SEGMENTS: usize = 16;

/// Largest node list file read: 256 nodes of a few hundred bytes each.
pub const MAX_NODES_FILE_BYTES: u64 = 1 << 20;

/// One storage node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub id: String,
    /// `HOST:PORT` of the daemon's `--rpc-listen`.
    pub rpc: String,
    pub tls: RpcTls,
    /// `HOST:PORT` of the daemon's NBD `--listen`, as seen from the node
    /// plugin on that same node (the `fuse` and `nbd` attach methods
    /// connect there).
    pub nbd: Option<String>,
    /// `HOST:PORT` of the daemon's `--nvmf-listen`, as seen from the node
    /// plugin on that same node (the `nvme-tcp` attach method connects
    /// there).
    pub nvmf: Option<String>,
    /// Topology segments (besides [`TOPOLOGY_NODE_KEY`], always added).
    pub topology: BTreeMap<String, String>,
}

impl Node {
    /// The node's topology segments, its id under [`TOPOLOGY_NODE_KEY`]
    /// included.
    pub fn segments(&self) -> BTreeMap<String, String> {
        let mut segments = self.topology.clone();
        segments.insert(TOPOLOGY_NODE_KEY.to_string(), self.id.clone());
        segments
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NodesError {
    #[error("{path}: {source}", path = path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: larger than {MAX_NODES_FILE_BYTES} bytes", path = path.display())]
    TooLarge { path: PathBuf },
    #[error("{path}: {source}", path = path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {reason}", path = path.display())]
    Invalid { path: PathBuf, reason: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileNodes {
    nodes: Vec<FileNode>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileNode {
    id: String,
    rpc: String,
    #[serde(default)]
    tls_psk: Option<PathBuf>,
    #[serde(default)]
    tls_certs: Option<PathBuf>,
    #[serde(default)]
    nbd: Option<String>,
    #[serde(default)]
    nvmf: Option<String>,
    #[serde(default)]
    topology: BTreeMap<String, String>,
}

/// The `kubernetes` form of the node list file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubeNodes {
    pub namespace: String,
    /// A label selector of the node DaemonSet's pods.
    pub pods: String,
    pub rpc_port: u16,
    #[serde(default)]
    pub tls_psk: Option<PathBuf>,
    #[serde(default)]
    pub tls_certs: Option<PathBuf>,
    #[serde(default)]
    pub nbd: Option<String>,
    #[serde(default)]
    pub nvmf: Option<String>,
    /// Node labels copied into each node's topology segments.
    #[serde(default)]
    pub topology_labels: Vec<String>,
}

impl KubeNodes {
    /// Checks what can be checked without the cluster; relative TLS
    /// paths are joined to `base` (the file's directory).
    pub fn checked(mut self, base: &Path) -> Result<KubeNodes, String> {
        match (&self.tls_psk, &self.tls_certs) {
            (Some(_), None) | (None, Some(_)) => {}
            _ => return Err("kubernetes: give exactly one of tls_psk and tls_certs (the daemons' JSON-RPC over TCP is TLS only)".into()),
        }
        self.tls_psk = self.tls_psk.map(|p| base.join(p));
        self.tls_certs = self.tls_certs.map(|p| base.join(p));
        if self.rpc_port == 0 {
            return Err("kubernetes: rpc_port 0".into());
        }
        if self.topology_labels.len() > MAX_TOPOLOGY_SEGMENTS {
            return Err(format!(
                "kubernetes: more than {MAX_TOPOLOGY_SEGMENTS} topology_labels"
            ));
        }
        if self.topology_labels.iter().any(|l| l == TOPOLOGY_NODE_KEY) {
            return Err(format!(
                "kubernetes: {TOPOLOGY_NODE_KEY} is set from the node id, not a label"
            ));
        }
        Ok(self)
    }

    pub(crate) fn tls(&self) -> RpcTls {
        match (&self.tls_psk, &self.tls_certs) {
            (Some(p), _) => RpcTls::Psk(p.clone()),
            (None, Some(d)) => RpcTls::Certs(d.clone()),
            (None, None) => unreachable!("checked"),
        }
    }
}

/// Where the node list comes from: the file's own list, or Kubernetes
/// (the file's `kubernetes` form, read by `crate::discovery`).
#[derive(Debug, Clone)]
pub enum NodeSource {
    List(Vec<Node>),
    Kubernetes(KubeNodes),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileKube {
    kubernetes: KubeNodes,
}

/// Reads and checks a node list file of either form.
pub fn load_source(path: &Path) -> Result<NodeSource, NodesError> {
    let text = read(path)?;
    let base = path.parent().unwrap_or(Path::new("."));
    let is_kube = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .is_some_and(|v| v.get("kubernetes").is_some());
    if !is_kube {
        return load(path).map(NodeSource::List);
    }
    let file: FileKube = serde_json::from_str(&text).map_err(|source| NodesError::Parse {
        path: path.to_path_buf(),
        source,
    })?;
    file.kubernetes
        .checked(base)
        .map(NodeSource::Kubernetes)
        .map_err(|reason| NodesError::Invalid {
            path: path.to_path_buf(),
            reason,
        })
}

/// The text of a node list file, within [`MAX_NODES_FILE_BYTES`].
fn read(path: &Path) -> Result<String, NodesError> {
    let read = |source| NodesError::Read {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(read)?.len();
    if len > MAX_NODES_FILE_BYTES {
        return Err(NodesError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    std::fs::read_to_string(path).map_err(read)
}

/// Reads and checks a node list file (the list form).
pub fn load(path: &Path) -> Result<Vec<Node>, NodesError> {
    let text = read(path)?;
    let base = path.parent().unwrap_or(Path::new("."));
    parse(&text, base).map_err(|e| match e {
        ParseError::Json(source) => NodesError::Parse {
            path: path.to_path_buf(),
            source,
        },
        ParseError::Invalid(reason) => NodesError::Invalid {
            path: path.to_path_buf(),
            reason,
        },
    })
}

#[derive(Debug)]
enum ParseError {
    Json(serde_json::Error),
    Invalid(String),
}

/// Parses the node list's text; relative TLS paths are joined to `base`.
fn parse(text: &str, base: &Path) -> Result<Vec<Node>, ParseError> {
    let file: FileNodes = serde_json::from_str(text).map_err(ParseError::Json)?;
    let invalid = |reason: String| Err(ParseError::Invalid(reason));
    if file.nodes.is_empty() {
        return invalid("no nodes".into());
    }
    if file.nodes.len() > MAX_NODES {
        return invalid(format!("{} nodes, at most {MAX_NODES}", file.nodes.len()));
    }
    let mut seen = HashSet::new();
    let mut nodes = Vec::with_capacity(file.nodes.len());
    for n in file.nodes {
        if !valid_node_id(&n.id) {
            return invalid(format!(
                "node id {:?}: 1 to {} bytes of A-Z a-z 0-9 - _ ., starting with a letter or digit",
                n.id,
                crate::volume_id::MAX_NODE_ID_BYTES
            ));
        }
        if !seen.insert(n.id.clone()) {
            return invalid(format!("node id {:?} appears twice", n.id));
        }
        let tls = match (n.tls_psk, n.tls_certs) {
            (Some(f), None) => RpcTls::Psk(base.join(f)),
            (None, Some(d)) => RpcTls::Certs(base.join(d)),
            _ => {
                return invalid(format!(
                    "node {:?}: give exactly one of tls_psk and tls_certs (the daemons' JSON-RPC over TCP is TLS only)",
                    n.id
                ))
            }
        };
        if n.topology.len() > MAX_TOPOLOGY_SEGMENTS {
            return invalid(format!(
                "node {:?}: more than {MAX_TOPOLOGY_SEGMENTS} topology segments",
                n.id
            ));
        }
        if n.topology.contains_key(TOPOLOGY_NODE_KEY) {
            return invalid(format!(
                "node {:?}: {TOPOLOGY_NODE_KEY} is set from the node id, not the file",
                n.id
            ));
        }
        if let Some(addr) = &n.nvmf {
            if !host_port(addr) {
                return invalid(format!(
                    "node {:?}: nvmf {addr:?}: HOST:PORT of the daemon's --nvmf-listen",
                    n.id
                ));
            }
        }
        nodes.push(Node {
            id: n.id,
            rpc: n.rpc,
            tls,
            nbd: n.nbd,
            nvmf: n.nvmf,
            topology: n.topology,
        });
    }
    Ok(nodes)
}

/// Whether `addr` is `HOST:PORT` (`[V6]:PORT` too) with a port 1 to 65535.
fn host_port(addr: &str) -> bool {
    addr.rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_list_and_joins_relative_paths() {
        let text = r#"{"nodes": [
            {"id": "a", "rpc": "127.0.0.1:1", "tls_psk": "rpc.psk", "nbd": "127.0.0.1:2"},
            {"id": "b", "rpc": "127.0.0.1:3", "tls_certs": "/etc/certs", "topology": {"zone": "z"},
             "nvmf": "127.0.0.1:4420"}
        ]}"#;
        let nodes = parse(text, Path::new("/cfg")).unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0].nvmf, None);
        assert_eq!(nodes[1].nvmf.as_deref(), Some("127.0.0.1:4420"));
        assert_eq!(nodes[1].nbd, None);
        assert!(matches!(&nodes[0].tls, RpcTls::Psk(p) if p == Path::new("/cfg/rpc.psk")));
        assert!(matches!(&nodes[1].tls, RpcTls::Certs(p) if p == Path::new("/etc/certs")));
        assert_eq!(nodes[1].segments()["zone"], "z");
        assert_eq!(nodes[1].segments()[TOPOLOGY_NODE_KEY], "b");
    }

    #[test]
    fn refuses_what_cannot_work() {
        let bad = |text: &str| match parse(text, Path::new("/")) {
            Err(ParseError::Invalid(r)) => r,
            other => panic!("{other:?}"),
        };
        assert!(bad(r#"{"nodes": []}"#).contains("no nodes"));
        assert!(bad(r#"{"nodes": [{"id": "a", "rpc": "x:1"}]}"#).contains("TLS only"));
        assert!(bad(
            r#"{"nodes": [{"id": "a", "rpc": "x:1", "tls_psk": "k"}, {"id": "a", "rpc": "y:1", "tls_psk": "k"}]}"#
        )
        .contains("twice"));
        assert!(
            bad(r#"{"nodes": [{"id": "a+b", "rpc": "x:1", "tls_psk": "k"}]}"#).contains("node id")
        );
        for addr in ["127.0.0.1", "h:0", ":4420", "h:port"] {
            let text = format!(
                r#"{{"nodes": [{{"id": "a", "rpc": "x:1", "tls_psk": "k", "nvmf": "{addr}"}}]}}"#
            );
            assert!(bad(&text).contains("--nvmf-listen"), "{addr}");
        }
        assert!(matches!(
            parse(
                r#"{"nodes": [{"id": "a", "rpc": "x:1", "tls_psk": "k", "typo": 1}]}"#,
                Path::new("/")
            ),
            Err(ParseError::Json(_))
        ));
    }
}
