//! A replica's reply stream as the engine reads it (see lull_fuzzcheck::replica_reply).
//! The check lives in `crates/fuzzcheck` so that `cargo test` replays this
//! target's corpus on stable; its docs give the input layout.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| lull_fuzzcheck::replica_reply(data));
