//! The system tier: the process as a whole, measured from outside: its
//! memory and descriptors under 2,000 idle connections, where the dynamic
//! scheduler puts its threads, its page faults and io_uring options per
//! I/O, and a short crash and fault campaign. Functional bounds only; speed
//! is the benchmarks' (docs/BENCHMARKS.md). docs/TESTING.md has every tier.
//!
//! ```text
//! cargo test -p lull --profile ci --test system
//! cargo test -p lull --profile ci --test system scale:: -- --nocapture
//! ```

#[path = "../common/mod.rs"]
mod common;

mod campaign;
mod per_io;
mod qos;
mod scale;
mod scheduler;
mod snapshot_crash;
