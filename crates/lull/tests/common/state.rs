//! Waiting on state, not on words: what the server reports over JSON-RPC
//! (`replica_list`) and what the kernel reports about its sockets
//! (`/proc/net/tcp`), polled until a condition holds.
//!
//! ```ignore
//! // A replica is failed once the engine counts an error on it; it is
//! // back once every replica is healthy again.
//! server.wait_replica("vol0", &rb.target(), WAIT, "rb failed", |r| r.errors >= 1);
//! server.wait_replicas("vol0", WAIT, "rebuilt", common::state::all_healthy);
//! // The server has closed every connection on its NBD port.
//! assert!(common::wait_until(IO_TIMEOUT, || state::open_connections(port).is_empty()));
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

/// How often a condition is polled.
const POLL: Duration = Duration::from_millis(20);

/// Polls `cond` every 20 ms until it holds (`true`) or `timeout` has
/// passed (`false`); it is asked at least once.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// One replica of a volume as `replica_list` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// How the engine names it: `HOST:PORT`, or `HOST:PORT/NAME` in a store.
    pub addr: String,
    /// connecting, healthy, failed, rebuilding or reconciling.
    pub state: String,
    pub generation: u64,
    /// Times the engine failed it.
    pub errors: u64,
    /// Why it was last failed.
    pub last_error: Option<String>,
}

impl ReplicaStatus {
    fn from_json(r: &Value) -> ReplicaStatus {
        ReplicaStatus {
            addr: r["addr"].as_str().expect("addr").to_string(),
            state: r["state"].as_str().expect("state").to_string(),
            generation: r["generation"].as_u64().expect("generation"),
            errors: r["errors"].as_u64().expect("errors"),
            last_error: r["last_error"].as_str().map(str::to_string),
        }
    }

    pub fn is(&self, state: &str) -> bool {
        self.state == state
    }

    /// Whether the last failure's reason holds every one of `words`.
    pub fn failed_because(&self, words: &[&str]) -> bool {
        self.last_error
            .as_deref()
            .is_some_and(|e| words.iter().all(|w| e.contains(w)))
    }
}

/// The replicas of `volume` on the server at `sock` (`replica_list`).
pub fn replica_states(sock: &Path, volume: &str) -> Vec<ReplicaStatus> {
    let list = super::rpc(
        sock,
        "replica_list",
        &format!(r#"{{"volume": "{volume}"}}"#),
    );
    list.as_array()
        .expect("replica_list returns a list")
        .iter()
        .map(ReplicaStatus::from_json)
        .collect()
}

/// Every replica healthy (and there is one).
pub fn all_healthy(list: &[ReplicaStatus]) -> bool {
    !list.is_empty() && list.iter().all(|r| r.is("healthy"))
}

/// No replica healthy: the volume fails its I/O.
pub fn none_healthy(list: &[ReplicaStatus]) -> bool {
    !list.iter().any(|r| r.is("healthy"))
}

/// Kernel TCP states in `/proc/net/tcp`: a connection the process owning
/// the local end has not closed yet.
const TCP_ESTABLISHED: &str = "01";
const TCP_SYN_RECV: &str = "03";
const TCP_CLOSE_WAIT: &str = "08";

/// The peer ports of the connections on loopback whose local end is `port`
/// and still open: established, or closed by the peer only (CLOSE_WAIT).
/// For a server's port: the connections it has not closed yet, whatever
/// the clients did.
pub fn open_connections(port: u16) -> Vec<u16> {
    let mut peers = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(remote), Some(st)) = (f.get(1), f.get(2), f.get(3)) else {
                continue;
            };
            if ![TCP_ESTABLISHED, TCP_SYN_RECV, TCP_CLOSE_WAIT].contains(st) {
                continue;
            }
            let port_of = |a: &str| {
                a.rsplit(':')
                    .next()
                    .and_then(|p| u16::from_str_radix(p, 16).ok())
            };
            if port_of(local) == Some(port) {
                peers.extend(port_of(remote));
            }
        }
    }
    peers
}

/// Waits until the server listening on `port` has closed its end of the
/// connection from the client port `peer` (after the client went away:
/// the server saw it and cleaned up). Fails the test after `timeout`.
pub fn wait_server_closed(port: u16, peer: u16, timeout: Duration) {
    assert!(
        wait_until(timeout, || !open_connections(port).contains(&peer)),
        "the server on port {port} kept the connection from port {peer} open for {timeout:?}"
    );
}

/// Waits until the server listening on `port` holds no connection open.
pub fn wait_no_connections(port: u16, timeout: Duration) {
    let mut left = Vec::new();
    assert!(
        wait_until(timeout, || {
            left = open_connections(port);
            left.is_empty()
        }),
        "the server on port {port} still holds connections from ports {left:?} after {timeout:?}"
    );
}
