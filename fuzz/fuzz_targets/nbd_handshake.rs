//! Feeds arbitrary client bytes to the NBD server handshake in arbitrary
//! chunks and checks that chunking never changes the result (replies,
//! status, and what was negotiated: structured replies, base:allocation).
//!
//! Input layout: byte 0 (low 3 bits) says how many chunk-size bytes follow;
//! the rest is the client stream. No chunk sizes means one byte at a time.
//! The corpus in `corpus/nbd_handshake/` starts with 0x00 and real streams.

#![no_main]

use libfuzzer_sys::fuzz_target;
use lull_proto::nbd::{
    self, ExportInfo, Exports, HandshakeError, HandshakeStatus, ServerHandshake,
};

struct FuzzExports;

impl Exports for FuzzExports {
    fn names(&self) -> Vec<String> {
        vec!["disk".to_string(), "ro".to_string()]
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        match name {
            "disk" | "" => Some(ExportInfo {
                size_bytes: 1 << 30,
                transmission_flags: nbd::NBD_FLAG_HAS_FLAGS
                    | nbd::NBD_FLAG_SEND_FLUSH
                    | nbd::NBD_FLAG_SEND_FUA,
                description: Some("fuzz disk".to_string()),
            }),
            "ro" => Some(ExportInfo {
                size_bytes: 4096,
                transmission_flags: nbd::NBD_FLAG_READ_ONLY,
                description: None,
            }),
            _ => None,
        }
    }
}

#[derive(Debug, PartialEq)]
enum Outcome {
    NeedMore { consumed: usize },
    Ended {
        end: usize,
        status: HandshakeStatus,
        /// Structured replies and metadata contexts agreed on.
        negotiated: nbd::Negotiated,
    },
    Failed(HandshakeError),
}

/// Feeds `input` as a server would: append each chunk to what is pending,
/// feed, drop what was consumed. `sizes` cycle; empty means all at once.
fn drive(input: &[u8], sizes: &[usize]) -> (Outcome, Vec<u8>) {
    let mut out = Vec::new();
    let mut handshake = ServerHandshake::new(&mut out);
    let mut pending: Vec<u8> = Vec::new();
    let mut pending_start = 0;
    let mut arrived = 0;
    let mut sizes = sizes.iter().copied().cycle();
    loop {
        let size = sizes.next().unwrap_or(input.len()).max(1);
        let end = (arrived + size).min(input.len());
        pending.extend_from_slice(&input[arrived..end]);
        arrived = end;
        match handshake.feed(&pending, &FuzzExports, &mut out) {
            Ok((used, HandshakeStatus::NeedMore)) => {
                assert!(used <= pending.len());
                pending.drain(..used);
                pending_start += used;
                assert!(pending.len() < nbd::MAX_HANDSHAKE_MESSAGE_LEN);
                if arrived == input.len() {
                    return (
                        Outcome::NeedMore {
                            consumed: pending_start,
                        },
                        out,
                    );
                }
            }
            Ok((used, status)) => {
                assert!(used <= pending.len());
                return (
                    Outcome::Ended {
                        end: pending_start + used,
                        status,
                        negotiated: handshake.negotiated(),
                    },
                    out,
                );
            }
            Err(error) => return (Outcome::Failed(error), out),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let count = usize::from(control & 7).min(rest.len());
    let (size_bytes, input) = rest.split_at(count);
    let mut sizes: Vec<usize> = size_bytes.iter().map(|&size| usize::from(size)).collect();
    if sizes.is_empty() {
        sizes.push(1);
    }
    let whole = drive(input, &[]);
    let chunked = drive(input, &sizes);
    assert_eq!(whole, chunked);
});
