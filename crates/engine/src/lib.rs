//! lull's volume engine: replicates every write to replica servers over TCP,
//! reads from one healthy replica, tracks in-flight requests in a fixed slot
//! table per connection, fails replicas that err or go silent, and rebuilds
//! them online when they come back.
//!
//! ```ignore
//! use lull_engine::{EngineOptions, ReplicatedDev};
//! let replicas = lull_engine::parse_replicas("127.0.0.1:7001+127.0.0.1:7002")?;
//! // Replica links over TLS with a PSK (`None` for plain links).
//! let tls = LinkAuth::Tls(Creds::Psk("replica.psk".into())).context(Role::Client)?;
//! let dev = ReplicatedDev::start(fw.handle(), 0, "vol0", replicas, 1 << 30, EngineOptions::default(), tls)?;
//! dev.wait_ready(std::time::Duration::from_secs(10)); // main thread only
//! volumes.add(Volume::new("vol0", Storage::Replicated(dev.clone())))?;   // lull_volume
//! for r in dev.replica_status() { println!("{} {:?}", r.addr, r.state); }
//! ```
//!
//! Layout: `lull_net::slots` is the slot table; [`core`] the engine as a pure state
//! machine (events in, actions out, time an argument); [`shell`] runs it on
//! one lull thread per volume (sockets, timers, channels); `sim` (tests)
//! drives the core against in-memory replicas from a seed.

#![forbid(unsafe_code)]

mod client;
pub mod core;
mod shell;
mod view;

#[cfg(test)]
mod sim;

use std::net::SocketAddr;

pub use core::ids::MAX_CONNECTIONS_PER_REPLICA;
pub use core::{
    CopyDone, CopyKind, CopyProgress, EngineOptions, NodeRebuildLimit, ReplicaState, ReplicaStatus,
    ReplicaTarget, CHANNEL_DEPTH, MAX_CHANNELS, SNAPSHOT_EXTRA_TIMEOUT_NS,
};
pub use shell::{ReplicatedDev, SessionOutcome, CONTROL_RETRY_WINDOW, GROW_TIMEOUT};
pub use view::{ReplicatedSnapshotView, MAX_VIEW_CHANNELS, VIEW_CHANNEL_DEPTH};

/// Upper bounds on the options, checked by `EngineOptions::validate`.
/// Connections: [`MAX_CONNECTIONS_PER_REPLICA`] (kept with the typed
/// connection ids it bounds, `core::ids`).
/// Slots: 4096 per connection keeps a slot table (and the timeout scan over
/// it) small while exceeding any useful queue depth.
pub const MAX_SLOTS_PER_CONNECTION: usize = 4096;

/// The options are defined in the core, which holds them; their check is
/// here, beside the crate's error type.
impl EngineOptions {
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: &str| Err(EngineError::BadOption(m.to_string()));
        if self.replica_timeout_ms == 0 {
            return bad("replica_timeout_ms must be at least 1");
        }
        if self.connections_per_replica == 0
            || self.connections_per_replica > MAX_CONNECTIONS_PER_REPLICA
        {
            return bad("connections_per_replica must be 1..=16");
        }
        if self.slots_per_connection == 0 || self.slots_per_connection > MAX_SLOTS_PER_CONNECTION {
            return bad("slots_per_connection must be 1..=4096");
        }
        if self.reconnect_interval_ms == 0 || self.keepalive_interval_ms == 0 {
            return bad("reconnect_interval_ms and keepalive_interval_ms must be at least 1");
        }
        if self.keepalive_interval_ms >= self.replica_timeout_ms {
            return bad(
                "keepalive_interval_ms must be below replica_timeout_ms, or idle replicas time out",
            );
        }
        Ok(())
    }
}

/// Errors of the engine's control path (the data path reports
/// `lull_bdev::BdevError`).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("bad replica list {0:?}: {1}")]
    BadReplicaList(String, String),
    #[error("bad engine option: {0}")]
    BadOption(String),
    #[error("a volume needs 1 to {max} replicas, got {got}", max = core::MAX_REPLICAS)]
    ReplicaCount { got: usize },
    #[error("volume size must be a positive multiple of 512 bytes, got {0}")]
    BadSize(u64),
    #[error("cannot start the engine thread: {0}")]
    Reactor(#[from] lull_reactor::ReactorError),
    #[error("the engine thread has stopped")]
    Stopped,
}

/// Parse `REPLICA+REPLICA[+...]` (the `replicas=` backend option), where
/// a replica is `HOST:PORT` (a `lull replica` process) or `HOST:PORT/NAME`
/// (replica NAME in the store of the node daemon at HOST:PORT). Host names
/// are resolved here, once, at configuration time.
pub fn parse_replicas(spec: &str) -> Result<Vec<ReplicaTarget>, EngineError> {
    let bad = |m: String| EngineError::BadReplicaList(spec.to_string(), m);
    let mut out: Vec<ReplicaTarget> = Vec::new();
    for part in spec.split('+') {
        let target = parse_replica(part.trim()).map_err(bad)?;
        if out.contains(&target) {
            return Err(bad(format!("{target} listed twice")));
        }
        out.push(target);
    }
    if out.is_empty() || out.len() > core::MAX_REPLICAS {
        return Err(EngineError::ReplicaCount { got: out.len() });
    }
    Ok(out)
}

/// Parse one `HOST:PORT` or `HOST:PORT/NAME`.
pub fn parse_replica(part: &str) -> Result<ReplicaTarget, String> {
    use std::net::ToSocketAddrs;
    if part.is_empty() {
        return Err("empty replica address".into());
    }
    let (host, name) = ReplicaTarget::split_name(part)?;
    let addr: SocketAddr = host
        .to_socket_addrs()
        .map_err(|e| format!("{part}: {e}"))?
        .next()
        .ok_or_else(|| format!("{part}: no address"))?;
    Ok(ReplicaTarget { addr, name })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_lists() {
        let v = parse_replicas("127.0.0.1:7001+127.0.0.1:7002").unwrap();
        let named = parse_replicas("127.0.0.1:7001/r0+127.0.0.1:7001/r1").unwrap();
        assert_eq!(named[1].to_string(), "127.0.0.1:7001/r1");
        assert_eq!(named[0].hello_name(), "r0");
        assert!(parse_replicas("127.0.0.1:7001/r0+127.0.0.1:7001/r0").is_err());
        assert!(parse_replicas("127.0.0.1:7001/..").is_err());
        assert!(parse_replicas("127.0.0.1:7001/a/b").is_err());
        assert!(parse_replicas("127.0.0.1:7001/").is_err());
        assert_eq!(v.len(), 2);
        assert!(parse_replicas("127.0.0.1:7001+").is_err());
        assert!(parse_replicas("127.0.0.1:7001+127.0.0.1:7001").is_err());
        assert!(parse_replicas("nonsense").is_err());
        assert!(EngineOptions::default().validate().is_ok());
        assert!(EngineOptions {
            keepalive_interval_ms: 9000,
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
