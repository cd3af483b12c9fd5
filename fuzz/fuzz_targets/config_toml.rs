//! lull serve's TOML config file, parsed and resolved (see lull_fuzzcheck::config_toml).
//! The check lives in `crates/fuzzcheck` so that `cargo test` replays this
//! target's corpus on stable; its docs give the input layout.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| lull_fuzzcheck::config_toml(data));
