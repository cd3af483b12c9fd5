//! Feeds client bytes to a TLS-enabled NBD server handshake: STARTTLS and
//! NBD_REP_ERR_TLS_REQD (see lull_fuzzcheck::nbd_starttls). The check lives
//! in `crates/fuzzcheck` so that `cargo test` replays this target's corpus
//! on stable; its docs give the input layout.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| lull_fuzzcheck::nbd_starttls(data));
