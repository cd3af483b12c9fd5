//! Node discovery from Kubernetes: the node list made from the cluster
//! instead of a file written by hand. A node list file of the form
//!
//! ```json
//! {"kubernetes": {"namespace": "lull-system", "pods": "app=lull-node",
//!   "rpc_port": 10910, "tls_psk": "/etc/lull/secret/rpc.psk",
//!   "nbd": "127.0.0.1:10809", "nvmf": "127.0.0.1:4420",
//!   "topology_labels": ["topology.kubernetes.io/zone"]}}
//! ```
//!
//! makes every running pod of the node DaemonSet (the pods matching
//! `pods` in `namespace`) a node: its id is the pod's Kubernetes node
//! name (`spec.nodeName`, which the node plugin is given as `--node-id`),
//! its JSON-RPC address the pod's host IP (the daemon listens on the
//! host network) and `rpc_port`; TLS, `nbd` and `nvmf` are the same for
//! every node (each plugin reaches its own node's daemon on loopback);
//! its topology the values of `topology_labels` on its Kubernetes Node.
//! The list is read from the API server at start and every
//! [`DISCOVERY_INTERVAL`] after: a node that joins (its daemon pod
//! running) is placed on without a restart, one whose pod is gone is no
//! longer chosen for new replicas (the volumes placed on it keep its id
//! and reach it again when its pod is back).
//!
//! The plugin reads the API with its pod's service account (the token
//! and CA that Kubernetes mounts, the address in KUBERNETES_SERVICE_HOST
//! and _PORT): it needs `list` on pods in the namespace and `get` on
//! nodes (deploy/kubernetes/rbac.yaml).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::cluster::Cluster;
use crate::nodes::{KubeNodes, Node, MAX_NODES};
use crate::volume_id::valid_node_id;

/// How often the node list is read again. A pod that starts takes
/// seconds to be running; 10 s makes a joining node usable about as soon
/// as it is up, at one small list request per plugin process every 10 s
/// (the API server serves thousands a second).
pub const DISCOVERY_INTERVAL: Duration = Duration::from_secs(10);

/// How long one request to the API server may take: a list of a few
/// hundred pods answers in milliseconds.
pub const API_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest API answer read (a pod list of [`MAX_NODES`] pods is a few
/// MiB at most).
pub const MAX_API_RESPONSE_BYTES: usize = 16 << 20;

/// Where Kubernetes mounts a pod's service account.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

impl KubeNodes {
    /// The nodes of a pod list and the labels of their Kubernetes Nodes
    /// (`labels` gives a node's labels by name).
    pub fn nodes(
        &self,
        pods: &PodList,
        mut labels: impl FnMut(&str) -> Result<BTreeMap<String, String>, String>,
    ) -> Result<Vec<Node>, String> {
        let mut nodes: Vec<Node> = Vec::new();
        for pod in &pods.items {
            let (Some(name), Some(ip)) = (&pod.spec.node_name, &pod.status.host_ip) else {
                continue;
            };
            if pod.metadata.deletion_timestamp.is_some()
                || pod.status.phase.as_deref() != Some("Running")
            {
                continue;
            }
            if !valid_node_id(name) {
                tracing::warn!(node = %name, "a Kubernetes node name that is not a valid lull node id (at most 20 bytes of A-Z a-z 0-9 - _ .): not used");
                continue;
            }
            if nodes.iter().any(|n| &n.id == name) {
                continue;
            }
            if nodes.len() == MAX_NODES {
                tracing::warn!("more than {MAX_NODES} node daemon pods: the rest are not used");
                break;
            }
            let mut topology = BTreeMap::new();
            if !self.topology_labels.is_empty() {
                let all = labels(name)?;
                for key in &self.topology_labels {
                    if let Some(v) = all.get(key) {
                        topology.insert(key.clone(), v.clone());
                    }
                }
            }
            let rpc = if ip.contains(':') {
                format!("[{ip}]:{}", self.rpc_port)
            } else {
                format!("{ip}:{}", self.rpc_port)
            };
            nodes.push(Node {
                id: name.clone(),
                rpc,
                tls: self.tls(),
                nbd: self.nbd.clone(),
                nvmf: self.nvmf.clone(),
                topology,
            });
        }
        nodes.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(nodes)
    }
}

/// The fields of a pod list that discovery reads.
#[derive(Debug, Default, Deserialize)]
pub struct PodList {
    #[serde(default)]
    pub items: Vec<Pod>,
}

#[derive(Debug, Default, Deserialize)]
pub struct Pod {
    #[serde(default)]
    pub metadata: Meta,
    #[serde(default)]
    pub spec: PodSpec,
    #[serde(default)]
    pub status: PodStatus,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Meta {
    #[serde(default)]
    pub deletion_timestamp: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    #[serde(default)]
    pub node_name: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    #[serde(default)]
    pub phase: Option<String>,
    #[serde(default, rename = "hostIP")]
    pub host_ip: Option<String>,
}

#[derive(Debug, Deserialize)]
struct KubeNode {
    #[serde(default)]
    metadata: Meta,
}

/// The API server, as a pod's service account reaches it.
#[derive(Debug)]
pub struct ApiServer {
    base: String,
    token_file: PathBuf,
    client: reqwest::Client,
}

impl ApiServer {
    /// From the environment Kubernetes gives every pod.
    pub fn in_cluster() -> Result<ApiServer, String> {
        let host = std::env::var("KUBERNETES_SERVICE_HOST").map_err(|_| {
            "KUBERNETES_SERVICE_HOST is not set: not in a Kubernetes pod".to_string()
        })?;
        let port = std::env::var("KUBERNETES_SERVICE_PORT").unwrap_or_else(|_| "443".into());
        let dir = Path::new(SERVICE_ACCOUNT_DIR);
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        ApiServer::new(
            &format!("https://{host}:{port}"),
            &dir.join("ca.crt"),
            dir.join("token"),
        )
    }

    pub fn new(base: &str, ca_file: &Path, token_file: PathBuf) -> Result<ApiServer, String> {
        let pem = std::fs::read(ca_file).map_err(|e| format!("{}: {e}", ca_file.display()))?;
        let ca = reqwest::Certificate::from_pem(&pem)
            .map_err(|e| format!("{}: {e}", ca_file.display()))?;
        let client = reqwest::Client::builder()
            .add_root_certificate(ca)
            .timeout(API_TIMEOUT)
            .build()
            .map_err(|e| format!("HTTPS client: {e}"))?;
        Ok(ApiServer {
            base: base.trim_end_matches('/').to_string(),
            token_file,
            client,
        })
    }

    /// GET of an API path, its JSON body decoded.
    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, &str)],
    ) -> Result<T, String> {
        // Read at every request: Kubernetes rotates the token.
        let token = std::fs::read_to_string(&self.token_file)
            .map_err(|e| format!("{}: {e}", self.token_file.display()))?;
        let mut url = reqwest::Url::parse(&format!("{}{path}", self.base))
            .map_err(|e| format!("{}{path}: {e}", self.base))?;
        for (k, v) in query {
            url.query_pairs_mut().append_pair(k, v);
        }
        let mut resp = self
            .client
            .get(url)
            .bearer_auth(token.trim())
            .header("Accept", "application/json")
            .send()
            .await
            .map_err(|e| format!("GET {path}: {e}"))?;
        let status = resp.status();
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| format!("GET {path}: {e}"))? {
            if body.len() + chunk.len() > MAX_API_RESPONSE_BYTES {
                return Err(format!(
                    "GET {path}: larger than {MAX_API_RESPONSE_BYTES} bytes"
                ));
            }
            body.extend_from_slice(&chunk);
        }
        if !status.is_success() {
            let text = String::from_utf8_lossy(&body);
            return Err(format!(
                "GET {path}: {status}: {}",
                text.chars().take(300).collect::<String>()
            ));
        }
        serde_json::from_slice(&body).map_err(|e| format!("GET {path}: {e}"))
    }

    /// The node list now.
    pub async fn discover(&self, kube: &KubeNodes) -> Result<Vec<Node>, String> {
        let pods: PodList = self
            .get(
                &format!("/api/v1/namespaces/{}/pods", kube.namespace),
                &[("labelSelector", &kube.pods)],
            )
            .await?;
        let mut labels = BTreeMap::new();
        if !kube.topology_labels.is_empty() {
            for name in pods.items.iter().filter_map(|p| p.spec.node_name.as_ref()) {
                if !labels.contains_key(name) {
                    let node: KubeNode = self.get(&format!("/api/v1/nodes/{name}"), &[]).await?;
                    labels.insert(name.clone(), node.metadata.labels);
                }
            }
        }
        kube.nodes(&pods, |name| {
            Ok(labels.get(name).cloned().unwrap_or_default())
        })
    }
}

/// Reads the node list from the API server into `cluster` now and every
/// [`DISCOVERY_INTERVAL`], until the task is dropped. The first read's
/// outcome is sent on `first` (the plugin waits for it before it serves).
pub async fn run(
    api: Arc<ApiServer>,
    kube: KubeNodes,
    cluster: Arc<Cluster>,
    first: tokio::sync::oneshot::Sender<Result<usize, String>>,
) {
    let mut first = Some(first);
    loop {
        let found = api.discover(&kube).await;
        let outcome = match found {
            Ok(nodes) => {
                let ids: Vec<String> = nodes.iter().map(|n| n.id.clone()).collect();
                match cluster.replace(nodes) {
                    Ok(true) => {
                        tracing::info!(nodes = ?ids, "node list from Kubernetes changed");
                        Ok(ids.len())
                    }
                    Ok(false) => Ok(ids.len()),
                    Err((node, e)) => Err(format!("node {node:?}: {e}")),
                }
            }
            Err(e) => Err(e),
        };
        if let Err(e) = &outcome {
            // The list stays as it was: a passing API outage does not
            // empty it.
            tracing::warn!("node discovery from Kubernetes: {e}");
        }
        if let Some(tx) = first.take() {
            let _ = tx.send(outcome);
        }
        tokio::time::sleep(DISCOVERY_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodes::TOPOLOGY_NODE_KEY;
    use lull_rpc::RpcTls;

    fn kube() -> KubeNodes {
        serde_json::from_str::<KubeNodes>(
            r#"{"namespace": "lull-system", "pods": "app=lull-node", "rpc_port": 10910,
                "tls_psk": "secret/rpc.psk", "nbd": "127.0.0.1:10809",
                "topology_labels": ["topology.kubernetes.io/zone"]}"#,
        )
        .unwrap()
        .checked(Path::new("/etc/lull"))
        .unwrap()
    }

    #[test]
    fn running_daemon_pods_become_nodes_with_their_node_labels() {
        // The fields as the API server writes them (a trimmed pod list).
        let pods: PodList = serde_json::from_str(
            r#"{"kind": "PodList", "items": [
              {"metadata": {"name": "lull-node-b"}, "spec": {"nodeName": "worker-2"},
               "status": {"phase": "Running", "hostIP": "10.0.0.12"}},
              {"metadata": {"name": "lull-node-a"}, "spec": {"nodeName": "worker-1"},
               "status": {"phase": "Running", "hostIP": "10.0.0.11"}},
              {"metadata": {"name": "pending"}, "spec": {"nodeName": "worker-3"},
               "status": {"phase": "Pending", "hostIP": "10.0.0.13"}},
              {"metadata": {"name": "going", "deletionTimestamp": "2026-12-02T00:00:00Z"},
               "spec": {"nodeName": "worker-4"}, "status": {"phase": "Running", "hostIP": "10.0.0.14"}},
              {"metadata": {"name": "v6"}, "spec": {"nodeName": "worker-6"},
               "status": {"phase": "Running", "hostIP": "fd00::6"}},
              {"metadata": {"name": "unscheduled"}, "spec": {}, "status": {"phase": "Pending"}}
            ]}"#,
        )
        .unwrap();
        let nodes = kube()
            .nodes(&pods, |name| {
                Ok([(
                    "topology.kubernetes.io/zone".to_string(),
                    format!("zone-{name}"),
                )]
                .into_iter()
                .collect())
            })
            .unwrap();
        let ids: Vec<&str> = nodes.iter().map(|n| n.id.as_str()).collect();
        assert_eq!(ids, ["worker-1", "worker-2", "worker-6"]);
        assert_eq!(nodes[0].rpc, "10.0.0.11:10910");
        assert_eq!(nodes[2].rpc, "[fd00::6]:10910");
        assert_eq!(nodes[0].nbd.as_deref(), Some("127.0.0.1:10809"));
        assert_eq!(
            nodes[0].tls,
            RpcTls::Psk(PathBuf::from("/etc/lull/secret/rpc.psk"))
        );
        assert_eq!(
            nodes[1].segments()["topology.kubernetes.io/zone"],
            "zone-worker-2"
        );
        assert_eq!(nodes[1].segments()[TOPOLOGY_NODE_KEY], "worker-2");
    }

    #[test]
    fn refuses_what_cannot_work() {
        let bad = |text: &str| {
            serde_json::from_str::<KubeNodes>(text)
                .map_err(|e| e.to_string())
                .and_then(|k| k.checked(Path::new("/")))
                .unwrap_err()
        };
        assert!(bad(r#"{"namespace": "n", "pods": "a=b", "rpc_port": 1}"#).contains("TLS only"));
        assert!(
            bad(r#"{"namespace": "n", "pods": "a=b", "rpc_port": 0, "tls_psk": "k"}"#)
                .contains("rpc_port")
        );
        assert!(bad(
            r#"{"namespace": "n", "pods": "a=b", "rpc_port": 1, "tls_psk": "k", "topology_labels": ["topology.lull.io/node"]}"#
        )
        .contains("node id"));
        assert!(bad(
            r#"{"namespace": "n", "pods": "a=b", "rpc_port": 1, "tls_psk": "k", "typo": 1}"#
        )
        .contains("unknown field"));
    }
}
