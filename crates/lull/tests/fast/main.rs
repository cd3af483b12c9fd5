//! The fast tier: the server alone on loopback, seconds in all. The
//! control plane (`lull rpc`, mode switches, the Prometheus scrape), fault
//! injection, the configured limits, the event modes, and bad input on
//! the NBD socket. (The adaptive mode's regime under a steady load needs
//! the machine to itself: the quiet tier.)
//! docs/TESTING.md has every tier.
//!
//! ```text
//! cargo test -p lull --profile ci --test fast
//! cargo test -p lull --profile ci --test fast nbd_bad_input::
//! ```

#[path = "../common/mod.rs"]
mod common;

mod control_plane;
mod faults;
mod limits;
mod modes;
mod nbd_bad_input;
