//! The real-clients tier: the data path proven by the clients people use
//! (nbdinfo, qemu-io, qemu-img, nbdcopy, fio's nbd engine, libnbd's Python
//! bindings): plain, sparse (block status, fast zero) and over TLS; and
//! `lull top`, the operator's client, driven in tmux. docs/TESTING.md has
//! every tier.
//!
//! ```text
//! cargo test -p lull --profile ci --test clients
//! cargo test -p lull --profile ci --test clients tls::
//! ```

#[path = "../common/mod.rs"]
mod common;

mod real_clients;
mod snapshots;
mod sparse_clients;
mod tls;
mod top;
