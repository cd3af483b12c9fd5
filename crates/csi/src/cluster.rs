//! The node daemons as the plugin reaches them: JSON-RPC over TCP with
//! TLS, on a few persistent connections per node
//! ([`lull_rpc::RpcTcpConnection`]), each call run on tokio's blocking
//! pool so that a slow node holds no gRPC worker.
//!
//! ```ignore
//! let cluster = Cluster::new(nodes::load(path)?)?;
//! let store = cluster.call("node-a", "store_get", json!({})).await?;
//! ```
//!
//! A call takes one of its node's [`MAX_NODE_CONNECTIONS`] permits,
//! waiting in its task (not on a thread) while all are taken, then the
//! node's most recently used idle connection, or dials one. A connection
//! that carried its call to the end goes back idle; one idle for
//! [`NODE_IDLE_TIMEOUT`] is closed. A daemon serves any number of calls
//! on one connection, so a burst costs it at most
//! [`MAX_NODE_CONNECTIONS`] of its `MAX_RPC_CONNECTIONS` (64) per plugin
//! process, instead of one per call in flight.
//!
//! A request is never sent twice if the daemon may have run it: it is
//! sent again, once and on a new connection, only when
//! [`RpcTcpConnection::send`] failed on an idle connection, which means
//! the daemon never had all of it (the daemon closed that connection
//! while it was idle: a restart or a stop).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use lull_net::tls::TlsContext;
use lull_rpc::{RpcClientError, RpcTcpConnection, RpcTlsError};
use serde_json::Value;
use tokio::sync::Semaphore;
use tonic::Status;

use crate::nodes::Node;

/// How long one call to a node daemon may take, the wait for a free
/// connection, connect and TLS handshake included. Store methods write
/// and fsync a small record (milliseconds); 30 s is far above that and
/// still answers a CSI caller (whose own timeouts are usually 60 s or
/// more) before it gives up.
pub const NODE_CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Connections to one node daemon open at once, per plugin process;
/// calls beyond wait for one to be free. A daemon takes at most 64 RPC
/// connections (`lull_rpc::MAX_RPC_CONNECTIONS`) from all its clients:
/// the controller and the node plugins of the nodes staging its volumes,
/// `lull top` and the operator. 8 leaves room for seven such processes
/// in a burst, and is plenty for throughput: a store method takes about
/// a millisecond, so 8 connections carry thousands of calls a second,
/// far above what a CO sends.
pub const MAX_NODE_CONNECTIONS: usize = 8;

/// An idle connection is closed after this long unused. CSI calls come
/// in bursts (a StatefulSet scaling up, a node drained) whose calls
/// follow each other within seconds; a connection unused for longer is
/// likely unused for minutes, and meanwhile holds one of the daemon's 64
/// RPC connections and a thread there.
pub const NODE_IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often idle connections are looked over for [`NODE_IDLE_TIMEOUT`]:
/// a connection is closed within 1.5 times the timeout.
const IDLE_SWEEP_INTERVAL: Duration = Duration::from_secs(5);

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
    /// Every connection to the node stayed taken by other calls until
    /// the call's deadline.
    #[error("node {node:?} ({addr}): all {MAX_NODE_CONNECTIONS} of the plugin's connections to it stayed busy for {NODE_CALL_TIMEOUT:?} (its calls are slow or stuck)")]
    Busy { node: String, addr: String },
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
    /// an unreachable or busy node is UNAVAILABLE (the CO retries), a
    /// refusal is INTERNAL with the node's message.
    pub fn status(&self) -> Status {
        match self {
            CallError::Unreachable { .. } | CallError::Busy { .. } | CallError::UnknownNode(_) => {
                Status::unavailable(self.to_string())
            }
            CallError::Refused { .. } | CallError::Join(..) => Status::internal(self.to_string()),
        }
    }
}

/// The node list with each node's connections, their TLS material
/// loaded once. The list may change while the plugin runs (node
/// discovery from Kubernetes, [`crate::discovery`]): [`Cluster::replace`]
/// swaps it whole, keeping the connections of the nodes that stayed the
/// same; a call already under way finishes on the list it started with.
#[derive(Debug)]
pub struct Cluster {
    members: Arc<RwLock<Arc<Members>>>,
    /// The task that closes connections idle past [`NODE_IDLE_TIMEOUT`],
    /// started by the first call (a runtime is needed) and again should
    /// its runtime have ended; it ends with the cluster.
    sweeper: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// One version of the node list and each node's connections.
#[derive(Debug, Default)]
pub struct Members {
    nodes: Vec<Node>,
    pools: HashMap<String, Arc<NodePool>>,
}

/// The node list as it was when [`Cluster::nodes`] was called (a later
/// [`Cluster::replace`] does not change it).
#[derive(Debug, Clone)]
pub struct NodeList(Arc<Members>);

impl std::ops::Deref for NodeList {
    type Target = [Node];
    fn deref(&self) -> &[Node] {
        &self.0.nodes
    }
}

impl Cluster {
    /// Loads every node's TLS material (a missing key file stops the
    /// plugin at start, not at the first volume).
    pub fn new(nodes: Vec<Node>) -> Result<Cluster, (String, RpcTlsError)> {
        let members = Members::build(nodes, &Members::default())?;
        Ok(Cluster {
            members: Arc::new(RwLock::new(Arc::new(members))),
            sweeper: Mutex::new(None),
        })
    }

    fn members(&self) -> Arc<Members> {
        Arc::clone(&self.members.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The node list now.
    pub fn nodes(&self) -> NodeList {
        NodeList(self.members())
    }

    pub fn node(&self, id: &str) -> Option<Node> {
        self.members().nodes.iter().find(|n| n.id == id).cloned()
    }

    /// Makes `nodes` the node list; whether it changed. A node whose entry
    /// is unchanged keeps its connections; a new or changed one has its
    /// TLS material loaded here (an error leaves the list as it was).
    pub fn replace(&self, nodes: Vec<Node>) -> Result<bool, (String, RpcTlsError)> {
        let mut members = self.members.write().unwrap_or_else(|p| p.into_inner());
        if members.nodes == nodes {
            return Ok(false);
        }
        let next = Members::build(nodes, &members)?;
        *members = Arc::new(next);
        Ok(true)
    }

    /// Calls `method` on node `id`, within [`NODE_CALL_TIMEOUT`].
    pub async fn call(
        &self,
        id: &str,
        method: &'static str,
        params: Value,
    ) -> Result<Value, CallError> {
        let deadline = Instant::now() + NODE_CALL_TIMEOUT;
        let members = self.members();
        let pool = members
            .pools
            .get(id)
            .ok_or_else(|| CallError::UnknownNode(id.to_string()))?;
        self.start_sweeper();
        let permit =
            tokio::time::timeout_at(deadline.into(), Arc::clone(&pool.permits).acquire_owned())
                .await;
        let permit = match permit {
            Ok(Ok(p)) => p,
            // The semaphore is never closed.
            Ok(Err(_)) | Err(_) => {
                return Err(CallError::Busy {
                    node: id.to_string(),
                    addr: pool.addr.clone(),
                })
            }
        };
        let idle = pool.take_idle(Instant::now());
        let pool = Arc::clone(pool);
        // The permit and the connection go with the blocking call: a
        // caller that gives up (its gRPC request cancelled) frees neither
        // while the call still uses them.
        let outcome = tokio::task::spawn_blocking(move || {
            let outcome = pool.call_blocking(idle, method, &params, deadline);
            drop(permit);
            outcome
        })
        .await;
        match outcome {
            Ok(result) => result,
            Err(e) => Err(CallError::Join(id.to_string(), e.to_string())),
        }
    }

    fn start_sweeper(&self) {
        let mut sweeper = self.sweeper.lock().unwrap_or_else(|p| p.into_inner());
        if sweeper.as_ref().is_some_and(|t| !t.is_finished()) {
            return;
        }
        let members = Arc::downgrade(&self.members);
        *sweeper = Some(tokio::spawn(sweep_idle(members)));
    }

    /// `store_get` on every node at once; each node's answer or error,
    /// in node list order.
    pub async fn stores(&self) -> Vec<(String, Result<Store, CallError>)> {
        let nodes = self.nodes();
        let calls = nodes.iter().map(|n| async move {
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

impl Drop for Cluster {
    fn drop(&mut self) {
        let sweeper = self.sweeper.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = sweeper.take() {
            t.abort();
        }
    }
}

/// Closes idle connections past [`NODE_IDLE_TIMEOUT`] every
/// [`IDLE_SWEEP_INTERVAL`], until the cluster is gone.
async fn sweep_idle(members: Weak<RwLock<Arc<Members>>>) {
    loop {
        tokio::time::sleep(IDLE_SWEEP_INTERVAL).await;
        let Some(members) = members.upgrade() else {
            return;
        };
        let current = Arc::clone(&members.read().unwrap_or_else(|p| p.into_inner()));
        drop(members);
        let now = Instant::now();
        for pool in current.pools.values() {
            pool.close_expired(now);
        }
    }
}

impl Members {
    /// The pools of `nodes`: `previous`'s for a node whose entry is the
    /// same, new ones (TLS material loaded) for the others.
    fn build(nodes: Vec<Node>, previous: &Members) -> Result<Members, (String, RpcTlsError)> {
        let mut pools = HashMap::with_capacity(nodes.len());
        for n in &nodes {
            let same = previous.nodes.iter().any(|p| p == n);
            let pool = match previous.pools.get(&n.id) {
                Some(pool) if same => Arc::clone(pool),
                _ => {
                    let tls = n.tls.client().map_err(|e| (n.id.clone(), e))?;
                    Arc::new(NodePool::new(n, tls))
                }
            };
            pools.insert(n.id.clone(), pool);
        }
        Ok(Members { nodes, pools })
    }
}

/// One node's connections: at most [`MAX_NODE_CONNECTIONS`] open, idle
/// or carrying a call (a call holds a permit while it holds a connection,
/// and dials only when none is idle).
#[derive(Debug)]
struct NodePool {
    id: String,
    addr: String,
    tls: TlsContext,
    permits: Arc<Semaphore>,
    /// Most recently used last: calls take from the end, so the surplus
    /// of a burst ages out at the front.
    idle: Mutex<Vec<Idle>>,
}

#[derive(Debug)]
struct Idle {
    conn: RpcTcpConnection,
    since: Instant,
}

impl NodePool {
    fn new(node: &Node, tls: TlsContext) -> NodePool {
        NodePool {
            id: node.id.clone(),
            addr: node.rpc.clone(),
            tls,
            permits: Arc::new(Semaphore::new(MAX_NODE_CONNECTIONS)),
            idle: Mutex::new(Vec::with_capacity(MAX_NODE_CONNECTIONS)),
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The most recently used idle connection not past its timeout.
    fn take_idle(&self, now: Instant) -> Option<RpcTcpConnection> {
        let mut idle = self.idle();
        retain_fresh(&mut idle, now);
        idle.pop().map(|i| i.conn)
    }

    fn put_idle(&self, conn: RpcTcpConnection) {
        let mut idle = self.idle();
        idle.push(Idle {
            conn,
            since: Instant::now(),
        });
        debug_assert!(idle.len() <= MAX_NODE_CONNECTIONS);
    }

    fn close_expired(&self, now: Instant) {
        retain_fresh(&mut self.idle(), now);
    }

    /// One call on `idle` (or a new connection), by the rule in the
    /// module doc; blocking, within `deadline`.
    fn call_blocking(
        &self,
        idle: Option<RpcTcpConnection>,
        method: &'static str,
        params: &Value,
        deadline: Instant,
    ) -> Result<Value, CallError> {
        let reused = idle.is_some();
        let mut conn = match idle {
            Some(c) => c,
            None => self.dial(deadline)?,
        };
        let sent = match conn.send(method, Some(params), left(deadline)) {
            Ok(sent) => sent,
            Err(e) if reused => {
                // The daemon never had the whole request (see
                // `RpcTcpConnection::send`): a new connection may carry it.
                tracing::debug!(node = %self.id, error = %e, "idle connection to the node daemon is gone; dialling again");
                conn = self.dial(deadline)?;
                conn.send(method, Some(params), left(deadline))
                    .map_err(|e| self.error(method, e))?
            }
            Err(e) => return Err(self.error(method, e)),
        };
        let result = conn.receive(sent, left(deadline));
        if conn.is_usable() {
            self.put_idle(conn);
        }
        result.map_err(|e| self.error(method, e))
    }

    fn dial(&self, deadline: Instant) -> Result<RpcTcpConnection, CallError> {
        RpcTcpConnection::connect(&self.addr, &self.tls, left(deadline))
            .map_err(|e| self.error("connect", e))
    }

    fn error(&self, method: &'static str, e: RpcClientError) -> CallError {
        match e {
            RpcClientError::Rpc { message, .. } => CallError::Refused {
                node: self.id.clone(),
                method,
                message,
            },
            source => CallError::Unreachable {
                node: self.id.clone(),
                addr: self.addr.clone(),
                source: Box::new(source),
            },
        }
    }
}

/// Drops (closes) the idle connections unused for [`NODE_IDLE_TIMEOUT`].
fn retain_fresh(idle: &mut Vec<Idle>, now: Instant) {
    idle.retain(|i| now.saturating_duration_since(i.since) < NODE_IDLE_TIMEOUT);
}

/// What is left of a call's time (zero once past: the client then
/// reports a timeout without waiting).
fn left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
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
    /// The store's generation of the replica: an engine taking it over
    /// raises it.
    #[serde(default)]
    pub generation: u64,
    /// The last engine detached cleanly and nothing wrote since.
    #[serde(default)]
    pub clean: bool,
    /// The engine session holding it (`None`: no engine connected).
    #[serde(default)]
    pub held_by_session: Option<String>,
    /// Its snapshots, oldest first (a store older than `replica_snapshot`
    /// reports none).
    #[serde(default)]
    pub snapshots: Vec<StoreSnapshot>,
}

/// One snapshot of a replica in a `store_get` or `replica_get` answer.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct StoreSnapshot {
    pub name: String,
    #[serde(default)]
    pub created_unix: u64,
    /// Replicas of the store whose base it is.
    #[serde(default)]
    pub clones: Vec<String>,
    /// It belongs to the replica this one was cloned from.
    #[serde(default)]
    pub inherited: bool,
    /// Being deleted (merged away).
    #[serde(default)]
    pub merging: bool,
}

impl StoreReplica {
    /// Its own snapshot `name` (not one it inherits as a clone), unless a
    /// delete is merging it away.
    pub fn snapshot(&self, name: &str) -> Option<&StoreSnapshot> {
        self.snapshots
            .iter()
            .find(|s| s.name == name && !s.inherited && !s.merging)
    }
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

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use lull_rpc::{MethodRegistry, RpcTcpServer, RpcTls};
    use serde_json::json;

    use super::*;

    const KEY: &str = "admin:2b7e151628aed2a6abf7158809cf4f3c8a1e0b2c3d4e5f60718293a4b5c6d7e8";

    /// A PSK file, removed on drop.
    struct KeyFile(PathBuf);

    impl KeyFile {
        fn new() -> KeyFile {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "lull-csi-cluster-{}-{}.psk",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::write(&path, format!("{KEY}\n")).unwrap();
            KeyFile(path)
        }
    }

    impl Drop for KeyFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// What a test daemon saw: the calls it ran, and the connections
    /// they came on (the server runs each connection on a thread of its
    /// own, and a method on its connection's thread).
    #[derive(Default)]
    struct Seen {
        calls: AtomicUsize,
        connections: Mutex<HashSet<std::thread::ThreadId>>,
    }

    /// A daemon on `port` (0: any) whose `work` method takes a few
    /// milliseconds, as a store method does.
    fn daemon(key: &KeyFile, port: u16) -> (RpcTcpServer, Arc<Seen>) {
        let seen = Arc::new(Seen::default());
        let mut reg = MethodRegistry::new();
        let s = Arc::clone(&seen);
        reg.register(
            "work",
            Box::new(move |_| {
                s.connections
                    .lock()
                    .unwrap()
                    .insert(std::thread::current().id());
                std::thread::sleep(Duration::from_millis(5));
                Ok(json!(s.calls.fetch_add(1, Ordering::SeqCst) + 1))
            }),
        )
        .unwrap();
        let tls = RpcTls::Psk(key.0.clone()).server().unwrap();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let server = RpcTcpServer::start(addr, tls, Arc::new(reg)).unwrap();
        (server, seen)
    }

    fn cluster(key: &KeyFile, server: &RpcTcpServer) -> Cluster {
        Cluster::new(vec![Node {
            id: "n1".into(),
            rpc: server.local_addr().to_string(),
            tls: RpcTls::Psk(key.0.clone()),
            nbd: None,
            nvmf: None,
            topology: Default::default(),
        }])
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_of_calls_shares_a_few_connections() {
        let key = KeyFile::new();
        let (server, seen) = daemon(&key, 0);
        let cluster = cluster(&key, &server);
        const CALLS: usize = 100;
        let calls = (0..CALLS).map(|_| cluster.call("n1", "work", json!({})));
        for r in futures::future::join_all(calls).await {
            r.unwrap();
        }
        assert_eq!(seen.calls.load(Ordering::SeqCst), CALLS);
        let connections = seen.connections.lock().unwrap().len();
        assert!(
            (1..=MAX_NODE_CONNECTIONS).contains(&connections),
            "{connections} connections"
        );
        // They stay open for the next calls, on the same connections.
        assert_eq!(cluster.members().pools["n1"].idle().len(), connections);
        cluster.call("n1", "work", json!({})).await.unwrap();
        assert_eq!(seen.connections.lock().unwrap().len(), connections);
        // Until unused for the idle timeout.
        let later = Instant::now() + NODE_IDLE_TIMEOUT;
        assert!(cluster.members().pools["n1"].take_idle(later).is_none());
        assert!(cluster.members().pools["n1"].idle().is_empty());
    }

    /// A daemon restarted: the idle connection to the old one fails
    /// before its request is written, and the call goes to the new one,
    /// run once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restarted_daemon_is_dialled_again_and_runs_the_call_once() {
        let key = KeyFile::new();
        let (old, old_seen) = daemon(&key, 0);
        let cluster = cluster(&key, &old);
        assert_eq!(
            cluster.call("n1", "work", json!({})).await.unwrap(),
            json!(1)
        );
        assert_eq!(cluster.members().pools["n1"].idle().len(), 1);
        let port = old.local_addr().port();
        // The stop closes the connection (on loopback its end of stream
        // is with the client before the stop returns).
        old.shutdown();
        let (new, new_seen) = daemon(&key, port);
        assert_eq!(
            cluster.call("n1", "work", json!({})).await.unwrap(),
            json!(1)
        );
        assert_eq!(old_seen.calls.load(Ordering::SeqCst), 1);
        assert_eq!(new_seen.calls.load(Ordering::SeqCst), 1);
        drop(new);
        // A daemon gone for good: unreachable (UNAVAILABLE), not retried
        // past the one new connection.
        let err = cluster.call("n1", "work", json!({})).await.unwrap_err();
        assert!(matches!(err, CallError::Unreachable { .. }), "{err}");
        assert_eq!(err.status().code(), tonic::Code::Unavailable);
        assert!(cluster.members().pools["n1"].idle().is_empty());
    }

    #[tokio::test]
    async fn an_unknown_node_is_named() {
        let key = KeyFile::new();
        let (server, _) = daemon(&key, 0);
        let cluster = cluster(&key, &server);
        let err = cluster.call("n9", "work", json!({})).await.unwrap_err();
        assert!(
            matches!(err, CallError::UnknownNode(ref n) if n == "n9"),
            "{err}"
        );
    }
}
