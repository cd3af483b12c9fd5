//! The replication tier: replicated volumes end to end, with real
//! replicas (`lull replica` processes and replicas in `lull serve --store`
//! daemons) killed and restarted under a real engine: failover, rebuild,
//! crash reconcile, authenticated replica links, block status across
//! replicas, and a node of 500 replicas. The longest tier (about a minute
//! and a half). docs/TESTING.md has every tier.
//!
//! ```text
//! cargo test -p lull --profile ci --test replication
//! cargo test -p lull --profile ci --test replication replica_tls::
//! ```

#[path = "../common/mod.rs"]
mod common;

mod delta;
mod grow;
mod large_requests;
mod node;
mod replica_tls;
mod replication;
mod snapshots;
mod sparse_replicated;
