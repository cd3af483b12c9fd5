//! The node daemons as the plugin reaches them: one JSON-RPC call per
//! request over TCP with TLS ([`lull_rpc::call_tcp`]), run on tokio's
//! blocking pool so that a slow node holds no gRPC worker.
//!
//! ```ignore
//! let cluster = Cluster::new(nodes::load(path)?)?;
//! let store = cluster.call("node-a", "store_get", json!({})).await?;
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use lull_net::tls::TlsContext;
use lull_rpc::{call_tcp, RpcClientError, RpcTlsError};
use serde_json::Value;
use tonic::Status;

use crate::nodes::Node;

/// How long one call to a node daemon may take, connect and TLS
/// handshake included. Store methods write and fsync a small record
/// (milliseconds); 30 s is far above that and still answers a CSI caller
/// (whose own timeouts are usually 60 s or more) before it gives up.
pub const NODE_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a call to a node failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("node {0:?} is not in the node list")]
    UnknownNode(String),
    /// The node could not be reached or did not answer.
    #[error("node {node:?} ({addr}): {source}")]
    Unreachable {
        node: String,
        addr: String,
        // Boxed: the client's error is large, and every call returns it.
        source: Box<RpcClientError>,
    },
    /// The node answered with an error.
    #[error("node {node:?}: {method}: {message}")]
    Refused {
        node: String,
        method: &'static str,
        message: String,
    },
    #[error("the blocking call to node {0:?} did not finish: {1}")]
    Join(String, String),
}

impl CallError {
    /// The node's own error message, for the callers that tell a
    /// harmless refusal ("already exists", "no replica") from a real one.
    pub fn refusal(&self) -> Option<&str> {
        match self {
            CallError::Refused { message, .. } => Some(message),
            _ => None,
        }
    }

    /// The gRPC status of a failure the caller has no better code for:
    /// an unreachable node is UNAVAILABLE (the CO retries), a refusal is
    /// INTERNAL with the node's message.
    pub fn status(&self) -> Status {
        match self {
            CallError::Unreachable { .. } | CallError::UnknownNode(_) => {
                Status::unavailable(self.to_string())
            }
            CallError::Refused { .. } | CallError::Join(..) => Status::internal(self.to_string()),
        }
    }
}

/// The node list with each node's TLS client context, loaded once.
#[derive(Debug)]
pub struct Cluster {
    nodes: Vec<Node>,
    tls: HashMap<String, Arc<TlsContext>>,
}

impl Cluster {
    /// Loads every node's TLS material (a missing key file stops the
    /// plugin at start, not at the first volume).
    pub fn new(nodes: Vec<Node>) -> Result<Cluster, (String, RpcTlsError)> {
        let mut tls = HashMap::new();
        for n in &nodes {
            let ctx = n.tls.client().map_err(|e| (n.id.clone(), e))?;
            tls.insert(n.id.clone(), Arc::new(ctx));
        }
        Ok(Cluster { nodes, tls })
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// Calls `method` on node `id`.
    pub async fn call(
        &self,
        id: &str,
        method: &'static str,
        params: Value,
    ) -> Result<Value, CallError> {
        let node = self
            .node(id)
            .ok_or_else(|| CallError::UnknownNode(id.to_string()))?;
        let tls = Arc::clone(&self.tls[id]);
        let addr = node.rpc.clone();
        let node_id = id.to_string();
        let outcome = tokio::task::spawn_blocking(move || {
            call_tcp(&addr, &tls, method, Some(params), NODE_CALL_TIMEOUT).map_err(|e| match e {
                RpcClientError::Rpc { message, .. } => CallError::Refused {
                    node: node_id.clone(),
                    method,
                    message,
                },
                source => CallError::Unreachable {
                    node: node_id.clone(),
                    addr: addr.clone(),
                    source: Box::new(source),
                },
            })
        })
        .await;
        match outcome {
            Ok(result) => result,
            Err(e) => Err(CallError::Join(id.to_string(), e.to_string())),
        }
    }

    /// `store_get` on every node at once; each node's answer or error,
    /// in node list order.
    pub async fn stores(&self) -> Vec<(String, Result<Store, CallError>)> {
        let calls = self.nodes.iter().map(|n| async move {
            let out = self
                .call(&n.id, "store_get", serde_json::json!({}))
                .await
                .and_then(|v| {
                    serde_json::from_value::<Store>(v).map_err(|e| CallError::Refused {
                        node: n.id.clone(),
                        method: "store_get",
                        message: format!("unexpected answer: {e}"),
                    })
                });
            (n.id.clone(), out)
        });
        futures::future::join_all(calls).await
    }
}

/// What the plugin reads of `store_get` (docs/NODE.md).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Store {
    pub replica_addr: String,
    pub free_bytes: u64,
    pub allocated_bytes: u64,
    pub provisioned_bytes: u64,
    pub overcommit_percent: u64,
    pub replicas: Vec<StoreReplica>,
}

/// One replica in a `store_get` answer.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct StoreReplica {
    pub name: String,
    pub size_bytes: u64,
}

impl Store {
    pub fn replica(&self, name: &str) -> Option<&StoreReplica> {
        self.replicas.iter().find(|r| r.name == name)
    }

    /// Bytes of new replicas this store takes.
    pub fn room_bytes(&self) -> u64 {
        crate::placement::room_bytes(
            self.free_bytes,
            self.allocated_bytes,
            self.provisioned_bytes,
            self.overcommit_percent,
        )
    }
}
