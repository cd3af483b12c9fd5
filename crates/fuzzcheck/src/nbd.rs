//! The NBD targets: the server handshake and transmission requests.

use lull_proto::nbd::{
    self, Command, ExportInfo, Exports, HandshakeError, HandshakeStatus, ServerHandshake,
    TlsPolicy, Verdict,
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
    NeedMore {
        consumed: usize,
    },
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
    let (outcome, out, _) = drive_tls(input, sizes, TlsPolicy::Off);
    (outcome, out)
}

/// [`drive`] for a server with a TLS policy. At `StartTls` the TLS session
/// is taken to come up at once and carry the rest of the input (a real
/// server refuses plaintext already buffered behind STARTTLS; here the
/// rest is what the client sends through TLS). Also returns how many
/// bytes of `out` were sent before TLS.
fn drive_tls(input: &[u8], sizes: &[usize], policy: TlsPolicy) -> (Outcome, Vec<u8>, usize) {
    let mut out = Vec::new();
    let mut handshake = ServerHandshake::with_tls(&mut out, policy);
    out.clear();
    let mut plaintext_out = None;
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
                    let plain = plaintext_out.unwrap_or(out.len());
                    return (
                        Outcome::NeedMore {
                            consumed: pending_start,
                        },
                        out,
                        plain,
                    );
                }
            }
            Ok((used, HandshakeStatus::StartTls)) => {
                assert_ne!(policy, TlsPolicy::Off, "STARTTLS accepted without TLS");
                assert!(plaintext_out.is_none(), "STARTTLS accepted twice");
                assert!(!handshake.tls_active());
                pending.drain(..used);
                pending_start += used;
                plaintext_out = Some(out.len());
                handshake.tls_started();
                assert_eq!(
                    handshake.negotiated(),
                    nbd::Negotiated::default(),
                    "state negotiated in plaintext survived STARTTLS"
                );
            }
            Ok((used, status)) => {
                assert!(used <= pending.len());
                if policy == TlsPolicy::Require && matches!(status, HandshakeStatus::Done { .. }) {
                    assert!(handshake.tls_active(), "an export chosen without TLS");
                }
                let plain = plaintext_out.unwrap_or(out.len());
                return (
                    Outcome::Ended {
                        end: pending_start + used,
                        status,
                        negotiated: handshake.negotiated(),
                    },
                    out,
                    plain,
                );
            }
            Err(error) => {
                let plain = plaintext_out.unwrap_or(out.len());
                return (Outcome::Failed(error), out, plain);
            }
        }
    }
}

/// Feeds arbitrary client bytes to the NBD server handshake in arbitrary
/// chunks and checks that chunking never changes the result.
///
/// Input layout: byte 0 (low 3 bits) says how many chunk-size bytes follow;
/// the rest is the client stream. No chunk sizes means one byte at a time.
/// The corpus in `corpus/nbd_handshake/` starts with 0x00 and real streams.
pub fn nbd_handshake(data: &[u8]) {
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
}

/// Feeds arbitrary client bytes to a TLS-enabled server handshake
/// (STARTTLS, `NBD_REP_ERR_TLS_REQD`), in arbitrary chunks: chunking never
/// changes the result, and with TLS required nothing but refusals and the
/// STARTTLS/ABORT acknowledgements leaves in plaintext (no export name,
/// size or flags) and no export is chosen before TLS.
///
/// Input layout: byte 0's low 2 bits pick the policy (0 off, 1 on, 2 and
/// 3 require), bits 2-4 how many chunk-size bytes follow; the rest is the
/// client stream, read as flowing through TLS once STARTTLS is acknowledged.
pub fn nbd_starttls(data: &[u8]) {
    let Some((&control, rest)) = data.split_first() else {
        return;
    };
    let policy = match control & 3 {
        0 => TlsPolicy::Off,
        1 => TlsPolicy::On,
        _ => TlsPolicy::Require,
    };
    let count = usize::from((control >> 2) & 7).min(rest.len());
    let (size_bytes, input) = rest.split_at(count);
    let mut sizes: Vec<usize> = size_bytes.iter().map(|&size| usize::from(size)).collect();
    if sizes.is_empty() {
        sizes.push(1);
    }
    let whole = drive_tls(input, &[], policy);
    let chunked = drive_tls(input, &sizes, policy);
    assert_eq!(whole, chunked);
    if policy == TlsPolicy::Require {
        let (_, out, plain) = whole;
        let mut bytes = &out[..plain];
        while !bytes.is_empty() {
            // Option replies only: magic, option, type, length, payload.
            assert!(bytes.len() >= 20, "a cut reply in plaintext");
            let option = u32::from_be_bytes(bytes[8..12].try_into().expect("4 bytes"));
            let reply_type = u32::from_be_bytes(bytes[12..16].try_into().expect("4 bytes"));
            let len = u32::from_be_bytes(bytes[16..20].try_into().expect("4 bytes")) as usize;
            let allowed = match option {
                nbd::NBD_OPT_STARTTLS => {
                    reply_type == nbd::NBD_REP_ACK || reply_type == nbd::NBD_REP_ERR_INVALID
                }
                nbd::NBD_OPT_ABORT => reply_type == nbd::NBD_REP_ACK,
                _ => reply_type == nbd::NBD_REP_ERR_TLS_REQD,
            };
            assert!(allowed, "option {option} got {reply_type:#x} before TLS");
            let payload = &bytes[20..20 + len];
            assert!(
                !payload.windows(4).any(|w| w == b"disk"),
                "an export name before TLS"
            );
            bytes = &bytes[20 + len..];
        }
    }
}

/// Decodes arbitrary request headers and validates them against an
/// arbitrary export, checking the verdict's promises.
///
/// Input layout: 28 bytes of request header, then optionally 8 bytes of
/// export size and 2 bytes of transmission flags (big-endian).
pub fn nbd_request(data: &[u8]) {
    let Some((header, rest)) = data.split_first_chunk::<{ nbd::REQUEST_LEN }>() else {
        return;
    };
    let (size, rest) = match rest.split_first_chunk::<8>() {
        Some((size, rest)) => (u64::from_be_bytes(*size), rest),
        None => (1 << 30, rest),
    };
    let tflags = match rest.split_first_chunk::<2>() {
        Some((tflags, _)) => u16::from_be_bytes(*tflags),
        None => !nbd::NBD_FLAG_READ_ONLY,
    };

    let Ok(request) = nbd::decode_request(header) else {
        return;
    };
    assert_eq!(&nbd::encode_request(&request), header);

    match nbd::validate(&request, size, tflags) {
        Verdict::Ok => match request.command {
            Command::Read
            | Command::Write
            | Command::Trim
            | Command::WriteZeroes
            | Command::Cache
            | Command::BlockStatus => {
                assert!(request.length > 0);
                let end = request.offset.checked_add(u64::from(request.length));
                assert!(end.is_some_and(|end| end <= size));
                if matches!(request.command, Command::Read | Command::Write) {
                    assert!(request.length <= nbd::MAX_PAYLOAD_BYTES);
                }
            }
            Command::Flush => assert_eq!((request.offset, request.length), (0, 0)),
            Command::Disc => {}
            Command::Unknown(_) => panic!("unknown command passed validation"),
        },
        Verdict::Error { drain_bytes, .. } => {
            if request.command == Command::Write {
                assert_eq!(drain_bytes, request.length);
                assert!(drain_bytes <= nbd::MAX_WRITE_DRAIN_BYTES);
            } else {
                assert_eq!(drain_bytes, 0);
            }
        }
        Verdict::Disconnect(_) => {
            assert_eq!(request.command, Command::Write);
            assert!(request.length > nbd::MAX_WRITE_DRAIN_BYTES);
        }
    }

    let mut reply = [0; nbd::SIMPLE_REPLY_LEN];
    nbd::encode_simple_reply(&mut reply, nbd::NBD_EINVAL, request.cookie);
    assert_eq!(
        nbd::decode_simple_reply(&reply),
        Some((nbd::NBD_EINVAL, request.cookie))
    );
}
