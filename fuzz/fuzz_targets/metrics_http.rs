//! The metrics endpoint's HTTP request head (see lull_fuzzcheck::metrics_http).
//! The check lives in `crates/fuzzcheck` so that `cargo test` replays this
//! target's corpus on stable; its docs give the input layout.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| lull_fuzzcheck::metrics_http(data));
