//! NBD transmission request headers against an export (see lull_fuzzcheck::nbd_request).
//! The check lives in `crates/fuzzcheck` so that `cargo test` replays this
//! target's corpus on stable; its docs give the input layout.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| lull_fuzzcheck::nbd_request(data));
