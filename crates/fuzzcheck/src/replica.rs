//! The replica targets: frames in both directions (engine to replica and
//! replica to engine) and the replica's metadata record.

use std::path::Path;

use lull_proto::replica::{self, Kind};
use lull_replica::{Meta, META_FORMAT_VERSION, META_MAX_BYTES};

/// Decodes arbitrary replica frames the way a replica or engine reads its
/// socket: a 32-byte header, then the payload it announces, which for
/// HELLO, EXTENTS, BLOCK_STATUS, CHANGED and SNAPSHOT_LIST replies and
/// HELLO, SNAPSHOT and CHANGED requests is parsed too.
///
/// Input layout: 32 bytes of header, then payload bytes (as many as given).
/// Checks: no panic; a header that decodes re-encodes to the same bytes;
/// the announced payload never exceeds the protocol limits; a parsed
/// HELLO (a replica's name or a view's `REPLICA@SNAPSHOT`) / EXTENTS /
/// BLOCK_STATUS / CHANGED / SNAPSHOT_LIST / SNAPSHOT payload re-encodes to
/// the same bytes.
pub fn replica_frame(data: &[u8]) {
    let Some((raw, rest)) = data.split_first_chunk::<{ replica::HEADER_LEN }>() else {
        return;
    };
    let header = match replica::decode_header(raw) {
        Ok(header) => header,
        Err(e) => {
            assert!(e.errno() > 0);
            // A refusal addressed to any id must itself decode.
            let mut refusal = [0; replica::HEADER_LEN];
            replica::encode_refusal(replica::raw_id(raw), e.errno() as u32, &mut refusal);
            assert!(replica::decode_header(&refusal).is_ok());
            return;
        }
    };
    let mut again = [0; replica::HEADER_LEN];
    replica::encode_header(&header, &mut again).expect("decoded header must re-encode");
    assert_eq!(&again, raw);

    let len = replica::payload_len(&header);
    assert!(len <= replica::MAX_IO_BYTES as usize);
    let payload = &rest[..len.min(rest.len())];
    match header.kind {
        Kind::Hello if header.reply => {
            if let Ok(hello) = replica::decode_hello(payload) {
                assert_eq!(&replica::encode_hello(&hello)[..24], &payload[..24]);
            }
        }
        Kind::Hello => {
            // A request: the record, then the replica's name (maybe none).
            assert!(len <= replica::MAX_HELLO_REQUEST_LEN);
            if let Ok((hello, name)) = replica::decode_hello_request(payload) {
                let (replica_name, snapshot) = replica::split_hello_name(name);
                assert!(
                    replica_name.is_empty() || replica::check_replica_name(replica_name).is_ok()
                );
                assert!(snapshot.is_none_or(|s| replica::check_snapshot_name(s).is_ok()));
                if let Some(snapshot) = snapshot {
                    assert_eq!(replica::view_hello_name(replica_name, snapshot), name);
                }
                assert_eq!(replica::encode_hello_request(&hello, name), payload);
            }
        }
        Kind::Extents if header.reply => {
            assert!(len <= replica::MAX_EXTENTS_BYTES as usize);
            if let Ok(ext) = replica::decode_extents(payload) {
                let mut out = Vec::new();
                replica::encode_extents(&ext, &mut out).expect("decoded extents must re-encode");
                assert_eq!(out, payload);
            }
        }
        Kind::BlockStatus | Kind::Changed if header.reply => {
            assert!(len <= replica::MAX_BLOCK_STATUS_BYTES as usize);
            if let Ok(ext) = replica::decode_block_status(payload) {
                let mut out = Vec::new();
                replica::encode_block_status(&ext, &mut out)
                    .expect("decoded block status must re-encode");
                assert_eq!(out, payload);
            }
        }
        Kind::Changed => {
            assert!(len <= replica::MAX_CHANGED_REQUEST_LEN);
            if let Ok(request) = replica::decode_changed_request(payload) {
                let out = replica::encode_changed_request(&request)
                    .expect("a decoded CHANGED request must re-encode");
                assert_eq!(out, payload);
            }
        }
        Kind::SnapshotList if header.reply => {
            assert!(len <= replica::MAX_SNAPSHOT_LIST_BYTES as usize);
            if let Ok(list) = replica::decode_snapshot_list(payload) {
                let out = replica::encode_snapshot_list(&list)
                    .expect("a decoded snapshot list must re-encode");
                assert_eq!(out, payload);
            }
        }
        Kind::Snapshot if !header.reply => {
            assert!(len <= replica::MAX_SNAPSHOT_REQUEST_LEN);
            if let Ok(request) = replica::decode_snapshot_request(payload) {
                let out = replica::encode_snapshot_request(&request)
                    .expect("a decoded SNAPSHOT request must re-encode");
                assert_eq!(out, payload);
            }
        }
        _ => {}
    }
}

/// Frames an engine decodes from one replica connection, at most this many
/// per input (a stream of tiny frames must not make one run slow).
const MAX_REPLY_FRAMES: usize = 256;

/// Decodes a stream of frames the way the engine reads a replica's socket
/// (`engine/src/shell/socket.rs`: header, then `payload_len` bytes, frame after
/// frame) and parses each reply payload the engine parses: HELLO
/// (`core/replicas.rs`), EXTENTS (`core/rebuild.rs`), INTENT_GET
/// (`core/intent.rs`), BLOCK_STATUS (`core/io.rs`), SNAPSHOT_LIST
/// (`core/snapshot.rs`), CHANGED (BLOCK_STATUS-shaped records).
///
/// Input layout: the replica's byte stream, frames back to back.
/// Checks: no panic; every header that decodes re-encodes to the same
/// bytes and announces at most `MAX_IO_BYTES`; each parsed payload
/// re-encodes to the same bytes; an error reply carries no payload except
/// HELLO's. The stream stops at the first undecodable header (the engine
/// fails the replica) or where bytes run out.
pub fn replica_reply(data: &[u8]) {
    let mut rest = data;
    for _ in 0..MAX_REPLY_FRAMES {
        let Some((raw, after)) = rest.split_first_chunk::<{ replica::HEADER_LEN }>() else {
            return;
        };
        let Ok(header) = replica::decode_header(raw) else {
            return;
        };
        let mut again = [0; replica::HEADER_LEN];
        replica::encode_header(&header, &mut again).expect("decoded header must re-encode");
        assert_eq!(&again, raw);
        let len = replica::payload_len(&header);
        assert!(len <= replica::MAX_IO_BYTES as usize);
        if header.reply && header.status != 0 && header.kind != Kind::Hello {
            assert_eq!(len, 0, "error replies carry no payload: {header:?}");
        }
        let Some(payload) = after.get(..len) else {
            return;
        };
        rest = &after[len..];
        if !header.reply {
            continue;
        }
        match header.kind {
            Kind::Hello => {
                let hello = replica::decode_hello(payload).expect("HELLO_LEN bytes decode");
                assert_eq!(&replica::encode_hello(&hello)[..], payload);
            }
            Kind::Extents if header.status == 0 => {
                assert!(len <= replica::MAX_EXTENTS_BYTES as usize);
                if let Ok(ext) = replica::decode_extents(payload) {
                    assert!(ext.len() <= replica::MAX_EXTENTS_PER_REPLY);
                    let mut out = Vec::new();
                    replica::encode_extents(&ext, &mut out)
                        .expect("decoded extents must re-encode");
                    assert_eq!(out, payload);
                }
            }
            Kind::BlockStatus | Kind::Changed if header.status == 0 => {
                assert!(len <= replica::MAX_BLOCK_STATUS_BYTES as usize);
                if let Ok(ext) = replica::decode_block_status(payload) {
                    assert!(!ext.is_empty() && ext.len() <= replica::MAX_BLOCK_STATUS_PER_REPLY);
                    let mut out = Vec::new();
                    replica::encode_block_status(&ext, &mut out)
                        .expect("decoded block status must re-encode");
                    assert_eq!(out, payload);
                }
            }
            Kind::IntentGet if header.status == 0 => {
                let (flags, bitmap) =
                    replica::decode_intent(payload).expect("a checked INTENT_GET reply decodes");
                assert!(bitmap.len() <= replica::MAX_INTENT_BITMAP_BYTES);
                let mut out = Vec::new();
                replica::encode_intent(flags, bitmap, &mut out)
                    .expect("decoded intent must re-encode");
                assert_eq!(out, payload);
            }
            Kind::SnapshotList if header.status == 0 => {
                assert!(len <= replica::MAX_SNAPSHOT_LIST_BYTES as usize);
                if let Ok(list) = replica::decode_snapshot_list(payload) {
                    assert!(list.len() <= replica::MAX_SNAPSHOT_RECORDS);
                    let out = replica::encode_snapshot_list(&list)
                        .expect("a decoded snapshot list must re-encode");
                    assert_eq!(out, payload);
                }
            }
            _ => {}
        }
    }
}

/// Parses arbitrary bytes as a replica's `meta.json` the way
/// `Meta::load` does once it has read the file (non-UTF-8 text is an I/O
/// error there, before parsing).
///
/// Input layout: the file's bytes.
/// Checks: no panic; only records of this format version and at most
/// `META_MAX_BYTES` are accepted; a refusal is EINVAL; an accepted record
/// re-encodes to text that parses to the same record and re-encodes to the
/// same text.
pub fn replica_meta(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("meta.json");
    let meta = match Meta::parse(path, text) {
        Ok(meta) => meta,
        Err(e) => {
            assert_eq!(e.errno(), libc::EINVAL);
            return;
        }
    };
    assert_eq!(meta.format_version, META_FORMAT_VERSION);
    assert!(text.len() as u64 <= META_MAX_BYTES);
    let encoded = meta.encode().expect("a record encodes");
    let again = Meta::parse(path, &encoded).expect("an encoded record parses");
    assert_eq!(again, meta);
    assert_eq!(again.encode().expect("a record encodes"), encoded);
}

#[cfg(test)]
mod tests {
    use super::*;
    use lull_proto::replica::{ChangedRequest, Header, Hello, StatusExtent};

    /// A frame: `h`'s header, then `payload`.
    fn frame(h: &Header, payload: &[u8]) -> Vec<u8> {
        let mut raw = [0; replica::HEADER_LEN];
        replica::encode_header(h, &mut raw).expect("encodable");
        let mut out = raw.to_vec();
        out.extend_from_slice(payload);
        out
    }

    /// The version 6 frames the corpora do not hold yet pass both checks:
    /// view HELLOs (with and without a replica's name), CHANGED requests
    /// and their replies.
    #[test]
    fn view_hellos_and_changed_frames_pass() {
        let hello = Hello {
            volume_size: 1 << 30,
            generation: 3,
            flags: 0,
            session: 0,
        };
        for name in ["", "r1", "@s1", "r1@s1", "r1@2024-01-01T00:00"] {
            let body = replica::encode_hello_request(&hello, name);
            let h = Header::request(Kind::Hello, 1, 0, body.len() as u32);
            replica_frame(&frame(&h, &body));
        }
        let body = replica::encode_changed_request(&ChangedRequest {
            length: 1 << 20,
            since: "s1".into(),
        })
        .expect("encodable");
        let request = Header::request(Kind::Changed, 2, 4096, body.len() as u32);
        replica_frame(&frame(&request, &body));
        // A bad name in a well-framed request is no finding.
        replica_frame(&frame(&request, b"\0\0\0\x01a b"));

        let mut records = Vec::new();
        replica::encode_block_status(
            &[
                StatusExtent {
                    length: 4096,
                    flags: replica::STATUS_CHANGED,
                },
                StatusExtent {
                    length: 8192,
                    flags: 0,
                },
            ],
            &mut records,
        )
        .expect("encodable");
        let mut reply = request.reply_with(0);
        reply.length = records.len() as u32;
        let reply = frame(&reply, &records);
        replica_frame(&reply);
        let refused = frame(&request.reply_with(libc::ENOENT as u32), &[]);
        let mut stream = reply.clone();
        stream.extend_from_slice(&refused);
        replica_reply(&stream);
    }
}
