//! Decodes arbitrary request headers and validates them against an
//! arbitrary export, checking the verdict's promises.
//!
//! Input layout: 28 bytes of request header, then optionally 8 bytes of
//! export size and 2 bytes of transmission flags (big-endian).

#![no_main]

use libfuzzer_sys::fuzz_target;
use lull_proto::nbd::{self, Command, Verdict};

fuzz_target!(|data: &[u8]| {
    let Some((header, rest)) = data.split_first_chunk::<{ nbd::REQUEST_LEN }>() else {
        return;
    };
    let (size, rest) = match rest.split_first_chunk::<8>() {
        Some((size, rest)) => (u64::from_be_bytes(*size), rest),
        None => (1 << 30, rest),
    };
    let tflags = match rest.split_first_chunk::<2>() {
        Some((tflags, _)) => u16::from_be_bytes(*tflags),
        None => u16::MAX & !nbd::NBD_FLAG_READ_ONLY,
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
});
