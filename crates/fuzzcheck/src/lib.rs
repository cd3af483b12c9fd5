//! The checks behind lull's fuzz targets, on stable Rust.
//!
//! Each cargo-fuzz target in `fuzz/fuzz_targets/` is one line that calls a
//! function here with libFuzzer's input; `tests/corpus.rs` calls the same
//! function on every file of `fuzz/corpus/<target>/`, so the committed
//! corpora (and every crash reproducer added to them) run in the ordinary
//! test suite, without nightly or libFuzzer.
//!
//! ```ignore
//! // fuzz/fuzz_targets/replica_meta.rs
//! fuzz_target!(|data: &[u8]| lull_fuzzcheck::replica_meta(data));
//! // tests/corpus.rs
//! for input in corpus("replica_meta") { lull_fuzzcheck::replica_meta(&input) }
//! ```
//!
//! Every function calls the real parsing entry point the server uses on
//! bytes from a socket or a file, asserts that it does not panic, and where
//! an encoder exists, that what decodes re-encodes to stable bytes. A
//! failed assertion is a panic, which libFuzzer reports as a crash.

#![forbid(unsafe_code)]

mod config;
mod nbd;
mod nvmf;
mod replica;
mod rpc;

pub use config::config_toml;
pub use nbd::{nbd_handshake, nbd_request, nbd_starttls};
pub use nvmf::nvmf_pdu;
pub use replica::{replica_frame, replica_meta, replica_reply};
pub use rpc::{metrics_http, rpc_request};

/// A target's check: panics on a finding.
pub type Check = fn(&[u8]);

/// Every target: its name (the corpus directory under `fuzz/corpus/`) and
/// its check.
pub const TARGETS: &[(&str, Check)] = &[
    ("nbd_handshake", nbd_handshake),
    ("nbd_request", nbd_request),
    ("nbd_starttls", nbd_starttls),
    ("replica_frame", replica_frame),
    ("replica_reply", replica_reply),
    ("replica_meta", replica_meta),
    ("rpc_request", rpc_request),
    ("metrics_http", metrics_http),
    ("config_toml", config_toml),
    ("nvmf_pdu", nvmf_pdu),
];

/// Chunk sizes taken from the front of an input: byte 0's low 3 bits say how
/// many size bytes follow (each a chunk size, 0 read as 1, cycled); the rest
/// is the stream. No size bytes: one byte at a time.
pub(crate) fn split_chunking(data: &[u8]) -> Option<(Vec<usize>, &[u8])> {
    let (&control, rest) = data.split_first()?;
    let count = usize::from(control & 7).min(rest.len());
    let (size_bytes, input) = rest.split_at(count);
    let mut sizes: Vec<usize> = size_bytes
        .iter()
        .map(|&size| usize::from(size).max(1))
        .collect();
    if sizes.is_empty() {
        sizes.push(1);
    }
    Some((sizes, input))
}

/// `input` cut into pieces of `sizes` (cycled); empty `sizes`: one piece.
pub(crate) fn chunks<'a>(input: &'a [u8], sizes: &[usize]) -> Vec<&'a [u8]> {
    if sizes.is_empty() || input.is_empty() {
        return vec![input];
    }
    let mut out = Vec::new();
    let mut at = 0;
    for size in sizes.iter().copied().cycle() {
        if at >= input.len() {
            break;
        }
        let end = (at + size.max(1)).min(input.len());
        out.push(&input[at..end]);
        at = end;
    }
    out
}
