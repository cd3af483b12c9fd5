//! The quiet tier: tests whose outcome depends on how the machine
//! schedules the server (the adaptive mode's regime under a steady load).
//! They need the machine to themselves: cargo runs test binaries one after
//! another, so no other tier's tests share the cores with these, and the
//! tests of this tier take [`QUIET`] so that they do not share them with
//! each other either. The server and its client run pinned to different
//! cores where there are two. docs/TESTING.md has every tier.
//!
//! ```text
//! cargo test -p lull --profile ci --test quiet
//! ```

use std::sync::{Mutex, MutexGuard};

#[path = "../common/mod.rs"]
mod common;

mod adaptive_regime;

/// Held by each test of this tier for its whole run: one at a time.
static QUIET: Mutex<()> = Mutex::new(());

/// The machine to this test alone (among this tier's), even after another
/// test of the tier failed while holding it.
pub fn quiet() -> MutexGuard<'static, ()> {
    QUIET
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
