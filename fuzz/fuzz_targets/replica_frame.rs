//! Decodes arbitrary replica frames the way a replica or engine reads its
//! socket: a 32-byte header, then the payload it announces, which for
//! HELLO and EXTENTS replies is parsed too.
//!
//! Input layout: 32 bytes of header, then payload bytes (as many as given).
//! Checks: no panic; a header that decodes re-encodes to the same bytes;
//! the announced payload never exceeds the protocol limits; a parsed
//! HELLO / EXTENTS payload re-encodes to the same bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use lull_proto::replica::{self, Kind};

fuzz_target!(|data: &[u8]| {
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
        Kind::Hello => {
            if let Ok(hello) = replica::decode_hello(payload) {
                assert_eq!(&replica::encode_hello(&hello)[..24], &payload[..24]);
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
        _ => {}
    }
});
