//! Tests for the NBD codec: hand-built byte layouts from the spec, every
//! handshake and validation path, and properties over arbitrary bytes.

use super::*;
use proptest::prelude::*;

const DISK_SIZE: u64 = 1 << 20;
/// HAS_FLAGS | SEND_FLUSH | SEND_FUA.
const DISK_FLAGS: u16 = 0x000d;
const REP_MAGIC: &[u8] = b"\x00\x03\xe8\x89\x04\x55\x65\xa9";

/// "disk" (also the default export ""), and "ro", whose flags lack
/// HAS_FLAGS so the codec has to add it.
struct TestExports;

impl Exports for TestExports {
    fn names(&self) -> Vec<String> {
        vec!["disk".to_string(), "ro".to_string()]
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        match name {
            "disk" | "" => Some(ExportInfo {
                size_bytes: DISK_SIZE,
                transmission_flags: DISK_FLAGS,
                description: Some("test disk".to_string()),
            }),
            "ro" => Some(ExportInfo {
                size_bytes: 4096,
                transmission_flags: NBD_FLAG_READ_ONLY,
                description: None,
            }),
            _ => None,
        }
    }
}

fn option(option: u32, payload: &[u8]) -> Vec<u8> {
    let mut bytes = IHAVEOPT.to_be_bytes().to_vec();
    bytes.extend_from_slice(&option.to_be_bytes());
    bytes.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

fn info_payload(name: &[u8], infos: &[u16]) -> Vec<u8> {
    let mut bytes = (name.len() as u32).to_be_bytes().to_vec();
    bytes.extend_from_slice(name);
    bytes.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for info in infos {
        bytes.extend_from_slice(&info.to_be_bytes());
    }
    bytes
}

fn client(flags: u32, options: &[Vec<u8>]) -> Vec<u8> {
    let mut bytes = flags.to_be_bytes().to_vec();
    for option in options {
        bytes.extend_from_slice(option);
    }
    bytes
}

/// Feeds a whole client stream at once; returns the result and the replies
/// (greeting left out).
fn run(input: &[u8]) -> (Result<(usize, HandshakeStatus), HandshakeError>, Vec<u8>) {
    let mut out = Vec::new();
    let mut handshake = ServerHandshake::new(&mut out);
    out.clear();
    let result = handshake.feed(input, &TestExports, &mut out);
    (result, out)
}

#[derive(Debug, PartialEq)]
struct Reply {
    option: u32,
    reply_type: u32,
    payload: Vec<u8>,
}

/// Splits server output into option replies; panics on bad framing.
fn replies(mut bytes: &[u8]) -> Vec<Reply> {
    let mut parsed = Vec::new();
    while !bytes.is_empty() {
        let mut reader = Reader::new(bytes);
        assert_eq!(reader.u64(), Some(NBD_REP_MAGIC), "reply magic");
        let option = reader.u32().unwrap();
        let reply_type = reader.u32().unwrap();
        let len = reader.u32().unwrap() as usize;
        let payload = reader.bytes(len).expect("reply payload present").to_vec();
        bytes = reader.rest();
        parsed.push(Reply {
            option,
            reply_type,
            payload,
        });
    }
    parsed
}

fn reply_types(bytes: &[u8]) -> Vec<u32> {
    replies(bytes)
        .iter()
        .map(|reply| reply.reply_type)
        .collect()
}

fn disk_info() -> ExportInfo {
    TestExports.lookup("disk").unwrap()
}

// ---------------------------------------------------------------------------
// Greeting and client flags.

#[test]
fn greeting_is_nbdmagic_ihaveopt_fixed_newstyle_no_zeroes() {
    let mut out = Vec::new();
    let _ = ServerHandshake::new(&mut out);
    assert_eq!(out, b"NBDMAGICIHAVEOPT\x00\x03");
    assert_eq!(out.len(), SERVER_GREETING_LEN);
}

#[test]
fn client_without_fixed_newstyle_is_refused() {
    let (result, out) = run(&0u32.to_be_bytes());
    assert_eq!(result, Err(HandshakeError::NotFixedNewstyle { flags: 0 }));
    assert!(out.is_empty());
    let (result, _) = run(&NBD_FLAG_C_NO_ZEROES.to_be_bytes());
    assert_eq!(result, Err(HandshakeError::NotFixedNewstyle { flags: 2 }));
}

#[test]
fn client_with_unknown_flags_is_refused() {
    let (result, _) = run(&5u32.to_be_bytes());
    assert_eq!(result, Err(HandshakeError::UnknownClientFlags { flags: 5 }));
    let (result, _) = run(&0x8000_0001u32.to_be_bytes());
    assert!(matches!(
        result,
        Err(HandshakeError::UnknownClientFlags { .. })
    ));
}

#[test]
fn client_flags_alone_need_more() {
    assert_eq!(run(&[0, 0, 0]).0, Ok((0, HandshakeStatus::NeedMore)));
    assert_eq!(run(&[0, 0, 0, 1]).0, Ok((4, HandshakeStatus::NeedMore)));
}

// ---------------------------------------------------------------------------
// NBD_OPT_EXPORT_NAME.

#[test]
fn export_name_reply_has_size_flags_and_zeroes() {
    let input = b"\x00\x00\x00\x01IHAVEOPT\x00\x00\x00\x01\x00\x00\x00\x04disk";
    let (result, out) = run(input);
    let mut expected = b"\x00\x00\x00\x00\x00\x10\x00\x00\x00\x0d".to_vec();
    expected.extend_from_slice(&[0; 124]);
    assert_eq!(out, expected);
    let status = HandshakeStatus::Done {
        export_name: "disk".to_string(),
        info: disk_info(),
    };
    assert_eq!(result, Ok((input.len(), status)));
}

#[test]
fn export_name_with_no_zeroes_omits_padding() {
    let input = client(3, &[option(NBD_OPT_EXPORT_NAME, b"disk")]);
    let (result, out) = run(&input);
    assert_eq!(out, b"\x00\x00\x00\x00\x00\x10\x00\x00\x00\x0d");
    assert!(matches!(result, Ok((_, HandshakeStatus::Done { .. }))));
}

#[test]
fn export_name_empty_is_the_default_export() {
    let input = client(3, &[option(NBD_OPT_EXPORT_NAME, b"")]);
    let (result, _) = run(&input);
    let status = HandshakeStatus::Done {
        export_name: String::new(),
        info: disk_info(),
    };
    assert_eq!(result, Ok((input.len(), status)));
}

#[test]
fn export_name_unknown_disconnects() {
    let input = client(1, &[option(NBD_OPT_EXPORT_NAME, b"nope")]);
    let (result, out) = run(&input);
    assert_eq!(
        result,
        Err(HandshakeError::UnknownExport {
            name: "nope".to_string()
        })
    );
    assert!(out.is_empty());
}

#[test]
fn export_name_invalid_disconnects() {
    for name in [&b"a\0b"[..], &b"\xff\xfe"[..]] {
        let (result, _) = run(&client(1, &[option(NBD_OPT_EXPORT_NAME, name)]));
        assert!(
            matches!(result, Err(HandshakeError::InvalidExportName { .. })),
            "{name:?}"
        );
    }
    let long = vec![b'a'; MAX_EXPORT_NAME_LEN + 1];
    let (result, _) = run(&client(1, &[option(NBD_OPT_EXPORT_NAME, &long)]));
    assert!(matches!(
        result,
        Err(HandshakeError::InvalidExportName { .. })
    ));
}

#[test]
fn export_name_adds_has_flags() {
    let input = client(3, &[option(NBD_OPT_EXPORT_NAME, b"ro")]);
    let (result, out) = run(&input);
    assert_eq!(out, b"\x00\x00\x00\x00\x00\x00\x10\x00\x00\x03");
    let Ok((_, HandshakeStatus::Done { info, .. })) = result else {
        panic!("{result:?}")
    };
    assert_eq!(
        info.transmission_flags,
        NBD_FLAG_HAS_FLAGS | NBD_FLAG_READ_ONLY
    );
}

// ---------------------------------------------------------------------------
// NBD_OPT_GO and NBD_OPT_INFO.

#[test]
fn go_reply_bytes_match_the_spec_layout() {
    let input = client(1, &[option(NBD_OPT_GO, &info_payload(b"disk", &[]))]);
    let (result, out) = run(&input);
    let mut expected = Vec::new();
    // NBD_REP_INFO, NBD_INFO_EXPORT: size 1 MiB, flags 0x000d.
    expected.extend_from_slice(REP_MAGIC);
    expected.extend_from_slice(b"\x00\x00\x00\x07\x00\x00\x00\x03\x00\x00\x00\x0c");
    expected.extend_from_slice(b"\x00\x00\x00\x00\x00\x00\x00\x10\x00\x00\x00\x0d");
    // NBD_REP_INFO, NBD_INFO_BLOCK_SIZE: 1, 4096, 64 MiB.
    expected.extend_from_slice(REP_MAGIC);
    expected.extend_from_slice(b"\x00\x00\x00\x07\x00\x00\x00\x03\x00\x00\x00\x0e");
    expected.extend_from_slice(b"\x00\x03\x00\x00\x00\x01\x00\x00\x10\x00\x04\x00\x00\x00");
    // NBD_REP_ACK.
    expected.extend_from_slice(REP_MAGIC);
    expected.extend_from_slice(b"\x00\x00\x00\x07\x00\x00\x00\x01\x00\x00\x00\x00");
    assert_eq!(out, expected);
    let status = HandshakeStatus::Done {
        export_name: "disk".to_string(),
        info: disk_info(),
    };
    assert_eq!(result, Ok((input.len(), status)));
}

#[test]
fn go_answers_requested_name_and_description() {
    let infos = [NBD_INFO_NAME, NBD_INFO_DESCRIPTION, NBD_INFO_BLOCK_SIZE, 77];
    let input = client(1, &[option(NBD_OPT_GO, &info_payload(b"disk", &infos))]);
    let (result, out) = run(&input);
    let replies = replies(&out);
    let info_payloads: Vec<&[u8]> = replies
        .iter()
        .filter(|reply| reply.reply_type == NBD_REP_INFO)
        .map(|reply| reply.payload.as_slice())
        .collect();
    assert_eq!(info_payloads.len(), 4);
    assert!(info_payloads.contains(&&b"\x00\x01disk"[..]));
    assert!(info_payloads.contains(&&b"\x00\x02test disk"[..]));
    assert_eq!(
        replies.last().map(|reply| reply.reply_type),
        Some(NBD_REP_ACK)
    );
    assert!(replies.iter().all(|reply| reply.option == NBD_OPT_GO));
    assert!(matches!(result, Ok((_, HandshakeStatus::Done { .. }))));
}

#[test]
fn go_skips_description_the_export_lacks() {
    let input = client(
        1,
        &[option(
            NBD_OPT_GO,
            &info_payload(b"ro", &[NBD_INFO_DESCRIPTION]),
        )],
    );
    let (_, out) = run(&input);
    assert_eq!(reply_types(&out), [NBD_REP_INFO, NBD_REP_INFO, NBD_REP_ACK]);
}

#[test]
fn info_answers_then_negotiation_goes_on() {
    let input = client(
        1,
        &[
            option(NBD_OPT_INFO, &info_payload(b"disk", &[NBD_INFO_BLOCK_SIZE])),
            option(NBD_OPT_GO, &info_payload(b"", &[])),
        ],
    );
    let (result, out) = run(&input);
    let replies = replies(&out);
    let options: Vec<u32> = replies.iter().map(|reply| reply.option).collect();
    assert_eq!(options, [6, 6, 6, 7, 7, 7]);
    assert_eq!(replies[2].reply_type, NBD_REP_ACK);
    let status = HandshakeStatus::Done {
        export_name: String::new(),
        info: disk_info(),
    };
    assert_eq!(result, Ok((input.len(), status)));
}

#[test]
fn info_alone_needs_more() {
    let input = client(1, &[option(NBD_OPT_INFO, &info_payload(b"disk", &[]))]);
    let (result, out) = run(&input);
    assert_eq!(result, Ok((input.len(), HandshakeStatus::NeedMore)));
    assert_eq!(reply_types(&out), [NBD_REP_INFO, NBD_REP_INFO, NBD_REP_ACK]);
}

#[test]
fn go_unknown_export_errors_and_negotiation_goes_on() {
    let input = client(
        1,
        &[
            option(NBD_OPT_GO, &info_payload(b"nope", &[])),
            option(NBD_OPT_GO, &info_payload(b"disk", &[])),
        ],
    );
    let (result, out) = run(&input);
    let types = reply_types(&out);
    assert_eq!(
        types,
        [NBD_REP_ERR_UNKNOWN, NBD_REP_INFO, NBD_REP_INFO, NBD_REP_ACK]
    );
    assert!(matches!(result, Ok((_, HandshakeStatus::Done { .. }))));
}

#[test]
fn malformed_go_payloads_get_err_invalid_and_stay_in_sync() {
    let mut name_overruns = info_payload(b"disk", &[]);
    name_overruns[3] = 5;
    let mut count_mismatch = info_payload(b"disk", &[NBD_INFO_NAME]);
    count_mismatch.push(0);
    let mut count_short = info_payload(b"disk", &[NBD_INFO_NAME]);
    count_short.truncate(count_short.len() - 1);
    let cases: [Vec<u8>; 7] = [
        Vec::new(),
        vec![0, 0, 0, 0, 0],
        name_overruns,
        count_mismatch,
        count_short,
        info_payload(b"d\0sk", &[]),
        info_payload(b"\xc3\x28", &[]),
    ];
    for payload in cases {
        let input = client(
            1,
            &[option(NBD_OPT_GO, &payload), option(NBD_OPT_LIST, &[])],
        );
        let (result, out) = run(&input);
        let types = reply_types(&out);
        assert_eq!(types[0], NBD_REP_ERR_INVALID, "{payload:?}");
        assert_eq!(
            types[1..],
            [NBD_REP_SERVER, NBD_REP_SERVER, NBD_REP_ACK],
            "{payload:?}"
        );
        assert_eq!(result, Ok((input.len(), HandshakeStatus::NeedMore)));
    }
}

#[test]
fn go_with_too_many_info_requests_is_too_big() {
    let infos = vec![NBD_INFO_NAME; usize::from(MAX_INFO_REQUESTS) + 1];
    let input = client(1, &[option(NBD_OPT_GO, &info_payload(b"disk", &infos))]);
    let (result, out) = run(&input);
    assert_eq!(reply_types(&out), [NBD_REP_ERR_TOO_BIG]);
    assert_eq!(result, Ok((input.len(), HandshakeStatus::NeedMore)));
}

#[test]
fn go_with_largest_name_and_requests_fits() {
    let name = vec![b'x'; MAX_EXPORT_NAME_LEN];
    let infos = vec![NBD_INFO_NAME; usize::from(MAX_INFO_REQUESTS)];
    let payload = info_payload(&name, &infos);
    assert_eq!(payload.len(), MAX_OPTION_LEN as usize);
    let (result, out) = run(&client(1, &[option(NBD_OPT_GO, &payload)]));
    assert_eq!(reply_types(&out), [NBD_REP_ERR_UNKNOWN]);
    assert!(result.is_ok());
}

#[test]
fn go_description_is_cut_to_the_string_limit() {
    struct Wordy;
    impl Exports for Wordy {
        fn names(&self) -> Vec<String> {
            Vec::new()
        }
        fn lookup(&self, _: &str) -> Option<ExportInfo> {
            Some(ExportInfo {
                size_bytes: 0,
                transmission_flags: NBD_FLAG_HAS_FLAGS,
                description: Some("é".repeat(MAX_STRING_LEN)),
            })
        }
    }
    let mut out = Vec::new();
    let mut handshake = ServerHandshake::new(&mut out);
    out.clear();
    let input = client(
        1,
        &[option(
            NBD_OPT_GO,
            &info_payload(b"", &[NBD_INFO_DESCRIPTION]),
        )],
    );
    handshake.feed(&input, &Wordy, &mut out).unwrap();
    let description = replies(&out)
        .into_iter()
        .find(|reply| {
            reply
                .payload
                .starts_with(&NBD_INFO_DESCRIPTION.to_be_bytes())
        })
        .unwrap();
    let text = std::str::from_utf8(&description.payload[2..]).unwrap();
    assert_eq!(text.len(), MAX_STRING_LEN);
}

// ---------------------------------------------------------------------------
// NBD_OPT_LIST, NBD_OPT_ABORT, unsupported options.

#[test]
fn list_sends_one_server_reply_per_export_then_ack() {
    let (result, out) = run(&client(1, &[option(NBD_OPT_LIST, &[])]));
    let mut expected = Vec::new();
    for name in [&b"disk"[..], b"ro"] {
        expected.extend_from_slice(REP_MAGIC);
        expected.extend_from_slice(b"\x00\x00\x00\x03\x00\x00\x00\x02");
        expected.extend_from_slice(&(4 + name.len() as u32).to_be_bytes());
        expected.extend_from_slice(&(name.len() as u32).to_be_bytes());
        expected.extend_from_slice(name);
    }
    expected.extend_from_slice(REP_MAGIC);
    expected.extend_from_slice(b"\x00\x00\x00\x03\x00\x00\x00\x01\x00\x00\x00\x00");
    assert_eq!(out, expected);
    assert_eq!(result, Ok((4 + 16, HandshakeStatus::NeedMore)));
}

#[test]
fn list_with_data_is_invalid() {
    let (result, out) = run(&client(1, &[option(NBD_OPT_LIST, b"x")]));
    assert_eq!(reply_types(&out), [NBD_REP_ERR_INVALID]);
    assert_eq!(result, Ok((4 + 17, HandshakeStatus::NeedMore)));
}

#[test]
fn abort_acks_and_ends() {
    let input = client(1, &[option(NBD_OPT_ABORT, &[])]);
    let (result, out) = run(&input);
    let mut expected = REP_MAGIC.to_vec();
    expected.extend_from_slice(b"\x00\x00\x00\x02\x00\x00\x00\x01\x00\x00\x00\x00");
    assert_eq!(out, expected);
    assert_eq!(result, Ok((input.len(), HandshakeStatus::Aborted)));
}

#[test]
fn abort_ignores_its_data() {
    let input = client(1, &[option(NBD_OPT_ABORT, b"bye")]);
    assert_eq!(run(&input).0, Ok((input.len(), HandshakeStatus::Aborted)));
}

#[test]
fn unsupported_and_malformed_options_get_errors() {
    let input = client(
        1,
        &[
            option(NBD_OPT_STRUCTURED_REPLY, &[]),
            option(NBD_OPT_STARTTLS, &[]),
            option(NBD_OPT_SET_META_CONTEXT, b"\x00\x00\x00\x00"),
            option(0xdead_beef, b"payload"),
        ],
    );
    let (result, out) = run(&input);
    let replies = replies(&out);
    let pairs: Vec<(u32, u32)> = replies.iter().map(|r| (r.option, r.reply_type)).collect();
    assert_eq!(
        pairs,
        [
            (NBD_OPT_STRUCTURED_REPLY, NBD_REP_ACK),
            (NBD_OPT_STARTTLS, NBD_REP_ERR_UNSUP),
            // Structured replies are on, but the option is cut short.
            (NBD_OPT_SET_META_CONTEXT, NBD_REP_ERR_INVALID),
            (0xdead_beef, NBD_REP_ERR_UNSUP),
        ]
    );
    assert_eq!(result, Ok((input.len(), HandshakeStatus::NeedMore)));
}

// ---------------------------------------------------------------------------
// Framing errors and limits.

#[test]
fn bad_option_magic_is_seen_after_eight_bytes() {
    let mut input = client(1, &[]);
    input.extend_from_slice(b"IHAVEOPS");
    let (result, _) = run(&input);
    assert_eq!(
        result,
        Err(HandshakeError::BadOptionMagic {
            magic: u64::from_be_bytes(*b"IHAVEOPS")
        })
    );
    assert_eq!(
        run(&input[..input.len() - 1]).0,
        Ok((4, HandshakeStatus::NeedMore))
    );
}

#[test]
fn over_long_option_is_refused_from_its_header() {
    let mut input = client(1, &[]);
    input.extend_from_slice(&IHAVEOPT.to_be_bytes());
    input.extend_from_slice(&NBD_OPT_GO.to_be_bytes());
    input.extend_from_slice(&(MAX_OPTION_LEN + 1).to_be_bytes());
    let (result, _) = run(&input);
    let error = HandshakeError::OptionTooLong {
        option: NBD_OPT_GO,
        length_bytes: MAX_OPTION_LEN + 1,
    };
    assert_eq!(result, Err(error));
}

#[test]
fn thirty_two_options_are_allowed_and_the_thirty_third_is_not() {
    let mut options = vec![option(NBD_OPT_STRUCTURED_REPLY, &[]); MAX_OPTIONS as usize - 1];
    options.push(option(NBD_OPT_GO, &info_payload(b"disk", &[])));
    let (result, _) = run(&client(1, &options));
    assert!(matches!(result, Ok((_, HandshakeStatus::Done { .. }))));

    let options = vec![option(NBD_OPT_LIST, &[]); MAX_OPTIONS as usize + 1];
    let (result, out) = run(&client(1, &options));
    assert_eq!(result, Err(HandshakeError::TooManyOptions));
    // Replies to the options before the refused one stay queued.
    assert_eq!(reply_types(&out).len(), MAX_OPTIONS as usize * 3);
}

#[test]
fn bytes_after_go_are_left_for_transmission() {
    let mut input = client(1, &[option(NBD_OPT_GO, &info_payload(b"disk", &[]))]);
    let end = input.len();
    input.extend_from_slice(&encode_request(&Request {
        flags: 0,
        command: Command::Read,
        cookie: 1,
        offset: 0,
        length: 512,
    }));
    let (result, _) = run(&input);
    assert!(matches!(result, Ok((used, HandshakeStatus::Done { .. })) if used == end));
}

#[test]
fn feeding_after_the_end_is_an_error() {
    let mut out = Vec::new();
    let mut handshake = ServerHandshake::new(&mut out);
    let input = client(1, &[option(NBD_OPT_ABORT, &[])]);
    assert!(handshake.feed(&input, &TestExports, &mut out).is_ok());
    assert_eq!(
        handshake.feed(&[], &TestExports, &mut out),
        Err(HandshakeError::Finished)
    );

    let mut handshake = ServerHandshake::new(&mut out);
    assert!(handshake
        .feed(&[0, 0, 0, 0], &TestExports, &mut out)
        .is_err());
    assert_eq!(
        handshake.feed(&[], &TestExports, &mut out),
        Err(HandshakeError::Finished)
    );
}

#[test]
fn handshake_errors_map_to_errnos() {
    assert_eq!(HandshakeError::TooManyOptions.errno(), libc::EPROTO);
    assert_eq!(
        HandshakeError::UnknownExport {
            name: String::new()
        }
        .errno(),
        libc::ENOENT
    );
    assert_eq!(RequestError::BadMagic { magic: 0 }.errno(), libc::EPROTO);
}

// ---------------------------------------------------------------------------
// Transmission: request and reply layouts.

#[test]
fn decode_request_reads_the_spec_layout() {
    let bytes: [u8; REQUEST_LEN] = *b"\x25\x60\x95\x13\x00\x01\x00\x00\
        \x01\x02\x03\x04\x05\x06\x07\x08\
        \x00\x00\x00\x00\x00\x00\x10\x00\
        \x00\x00\x02\x00";
    let request = Request {
        flags: NBD_CMD_FLAG_FUA,
        command: Command::Read,
        cookie: 0x0102_0304_0506_0708,
        offset: 4096,
        length: 512,
    };
    assert_eq!(decode_request(&bytes), Ok(request));
    assert_eq!(encode_request(&request), bytes);
}

#[test]
fn decode_request_rejects_bad_magic() {
    let mut bytes = encode_request(&Request {
        flags: 0,
        command: Command::Write,
        cookie: 0,
        offset: 0,
        length: 0,
    });
    bytes[3] ^= 1;
    assert_eq!(
        decode_request(&bytes),
        Err(RequestError::BadMagic { magic: 0x2560_9512 })
    );
}

#[test]
fn decode_request_keeps_unknown_commands() {
    for (wire, command) in [
        (0, Command::Read),
        (1, Command::Write),
        (2, Command::Disc),
        (3, Command::Flush),
        (4, Command::Trim),
        (5, Command::Cache),
        (6, Command::WriteZeroes),
        (7, Command::BlockStatus),
        (0xffff, Command::Unknown(0xffff)),
    ] {
        assert_eq!(Command::from_wire(wire), command);
        assert_eq!(command.to_wire(), wire);
    }
}

#[test]
fn simple_reply_layout() {
    let mut reply = [0xaa; SIMPLE_REPLY_LEN];
    encode_simple_reply(&mut reply, NBD_EINVAL, 0x0102_0304_0506_0708);
    assert_eq!(
        &reply,
        b"\x67\x44\x66\x98\x00\x00\x00\x16\x01\x02\x03\x04\x05\x06\x07\x08"
    );
    assert_eq!(
        decode_simple_reply(&reply),
        Some((22, 0x0102_0304_0506_0708))
    );
    reply[0] = 0;
    assert_eq!(decode_simple_reply(&reply), None);
}

#[test]
fn errno_mapping() {
    let table = [
        (0, NBD_SUCCESS),
        (libc::EPERM, NBD_EPERM),
        (libc::EACCES, NBD_EPERM),
        (libc::EROFS, NBD_EPERM),
        (libc::EIO, NBD_EIO),
        (libc::ENOMEM, NBD_ENOMEM),
        (libc::EINVAL, NBD_EINVAL),
        (libc::EOPNOTSUPP, NBD_EINVAL),
        (libc::EOVERFLOW, NBD_EINVAL),
        (libc::ENOSPC, NBD_ENOSPC),
        (libc::EDQUOT, NBD_ENOSPC),
        (libc::EFBIG, NBD_ENOSPC),
        (libc::ESHUTDOWN, NBD_ESHUTDOWN),
        (libc::ETIMEDOUT, NBD_EIO),
        (libc::EBADF, NBD_EIO),
    ];
    for (errno, nbd) in table {
        assert_eq!(errno_to_nbd(errno), nbd, "errno {errno}");
        assert_eq!(errno_to_nbd(-errno), nbd, "errno -{errno}");
    }
    assert_eq!(errno_to_nbd(i32::MIN), NBD_EIO);
    assert_eq!((NBD_EPERM, NBD_EIO, NBD_ENOMEM, NBD_EINVAL), (1, 5, 12, 22));
    assert_eq!(
        (NBD_ENOSPC, NBD_EOVERFLOW, NBD_ENOTSUP, NBD_ESHUTDOWN),
        (28, 75, 95, 108)
    );
}

// ---------------------------------------------------------------------------
// Transmission: validation.

/// Everything but READ_ONLY, DF and FAST_ZERO.
const ALL: u16 = NBD_FLAG_HAS_FLAGS
    | NBD_FLAG_SEND_FLUSH
    | NBD_FLAG_SEND_FUA
    | NBD_FLAG_SEND_TRIM
    | NBD_FLAG_SEND_WRITE_ZEROES;
const SIZE: u64 = 1 << 30;

fn req(command: Command, flags: u16, offset: u64, length: u32) -> Request {
    Request {
        flags,
        command,
        cookie: 9,
        offset,
        length,
    }
}

fn error(nbd_error: u32) -> Verdict {
    Verdict::Error {
        nbd_error,
        drain_bytes: 0,
    }
}

fn drain(nbd_error: u32, drain_bytes: u32) -> Verdict {
    Verdict::Error {
        nbd_error,
        drain_bytes,
    }
}

#[test]
fn read_range_rules() {
    assert_eq!(
        validate(&req(Command::Read, 0, 0, 4096), SIZE, ALL),
        Verdict::Ok
    );
    assert_eq!(
        validate(&req(Command::Read, 0, SIZE - 1, 1), SIZE, ALL),
        Verdict::Ok
    );
    assert_eq!(
        validate(&req(Command::Read, 0, SIZE - 1, 2), SIZE, ALL),
        error(NBD_EINVAL)
    );
    assert_eq!(
        validate(&req(Command::Read, 0, SIZE, 1), SIZE, ALL),
        error(NBD_EINVAL)
    );
    assert_eq!(
        validate(&req(Command::Read, 0, u64::MAX, 1), SIZE, ALL),
        error(NBD_EINVAL)
    );
    assert_eq!(
        validate(&req(Command::Read, 0, u64::MAX, 1), u64::MAX, ALL),
        error(NBD_EINVAL)
    );
    assert_eq!(
        validate(&req(Command::Read, 0, 0, 0), SIZE, ALL),
        error(NBD_EINVAL)
    );
}

#[test]
fn read_larger_than_the_payload_cap_is_einval() {
    let at_cap = req(Command::Read, 0, 0, MAX_PAYLOAD_BYTES);
    assert_eq!(validate(&at_cap, SIZE, ALL), Verdict::Ok);
    let over = req(Command::Read, 0, 0, MAX_PAYLOAD_BYTES + 1);
    assert_eq!(validate(&over, SIZE, ALL), error(NBD_EINVAL));
    assert_eq!(
        validate(&req(Command::Read, 0, 0, u32::MAX), SIZE, ALL),
        error(NBD_EINVAL)
    );
}

#[test]
fn write_errors_drain_the_payload() {
    assert_eq!(
        validate(&req(Command::Write, 0, 0, 4096), SIZE, ALL),
        Verdict::Ok
    );
    let past_end = req(Command::Write, 0, SIZE - 512, 4096);
    assert_eq!(validate(&past_end, SIZE, ALL), drain(NBD_ENOSPC, 4096));
    let overflow = req(Command::Write, 0, u64::MAX - 10, 4096);
    assert_eq!(validate(&overflow, u64::MAX, ALL), drain(NBD_ENOSPC, 4096));
    assert_eq!(
        validate(&req(Command::Write, 0, 0, 0), SIZE, ALL),
        drain(NBD_EINVAL, 0)
    );
    let read_only = req(Command::Write, 0, 0, 4096);
    assert_eq!(
        validate(&read_only, SIZE, ALL | NBD_FLAG_READ_ONLY),
        drain(NBD_EPERM, 4096)
    );
    let no_hole = req(Command::Write, NBD_CMD_FLAG_NO_HOLE, 0, 4096);
    assert_eq!(validate(&no_hole, SIZE, ALL), drain(NBD_EINVAL, 4096));
}

#[test]
fn oversized_write_drains_up_to_the_limit_then_disconnects() {
    let over = req(Command::Write, 0, 0, MAX_PAYLOAD_BYTES + 1);
    assert_eq!(
        validate(&over, SIZE, ALL),
        drain(NBD_EINVAL, MAX_PAYLOAD_BYTES + 1)
    );
    let at_limit = req(Command::Write, 0, 0, MAX_WRITE_DRAIN_BYTES);
    assert_eq!(
        validate(&at_limit, SIZE, ALL),
        drain(NBD_EINVAL, MAX_WRITE_DRAIN_BYTES)
    );
    let beyond = req(Command::Write, 0, 0, MAX_WRITE_DRAIN_BYTES + 1);
    assert!(matches!(
        validate(&beyond, SIZE, ALL),
        Verdict::Disconnect(_)
    ));
    // Even when the refusal is for another reason.
    let bad_flag = req(Command::Write, 0x8000, 0, u32::MAX);
    assert!(matches!(
        validate(&bad_flag, SIZE, ALL),
        Verdict::Disconnect(_)
    ));
}

#[test]
fn flush_rules() {
    assert_eq!(
        validate(&req(Command::Flush, 0, 0, 0), SIZE, ALL),
        Verdict::Ok
    );
    let fua = req(Command::Flush, NBD_CMD_FLAG_FUA, 0, 0);
    assert_eq!(validate(&fua, SIZE, ALL), Verdict::Ok);
    let not_advertised = ALL & !NBD_FLAG_SEND_FLUSH;
    assert_eq!(
        validate(&req(Command::Flush, 0, 0, 0), SIZE, not_advertised),
        error(NBD_EINVAL)
    );
    assert_eq!(
        validate(&req(Command::Flush, 0, 1, 0), SIZE, ALL),
        error(NBD_EINVAL)
    );
    assert_eq!(
        validate(&req(Command::Flush, 0, 0, 1), SIZE, ALL),
        error(NBD_EINVAL)
    );
    // Flushing a read-only export is harmless.
    let read_only = ALL | NBD_FLAG_READ_ONLY;
    assert_eq!(
        validate(&req(Command::Flush, 0, 0, 0), SIZE, read_only),
        Verdict::Ok
    );
}

#[test]
fn trim_rules() {
    let whole = req(Command::Trim, 0, 0, u32::MAX);
    assert_eq!(validate(&whole, SIZE * 8, ALL), Verdict::Ok);
    assert_eq!(validate(&whole, SIZE, ALL), error(NBD_EINVAL));
    let not_advertised = ALL & !NBD_FLAG_SEND_TRIM;
    assert_eq!(
        validate(&req(Command::Trim, 0, 0, 1), SIZE, not_advertised),
        error(NBD_EINVAL)
    );
    let read_only = ALL | NBD_FLAG_READ_ONLY;
    assert_eq!(
        validate(&req(Command::Trim, 0, 0, 1), SIZE, read_only),
        error(NBD_EPERM)
    );
    assert_eq!(
        validate(&req(Command::Trim, 0, 0, 0), SIZE, ALL),
        error(NBD_EINVAL)
    );
    let fua = req(Command::Trim, NBD_CMD_FLAG_FUA, 0, 1);
    assert_eq!(validate(&fua, SIZE, ALL), Verdict::Ok);
}

#[test]
fn write_zeroes_rules() {
    let big = req(
        Command::WriteZeroes,
        NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FUA,
        0,
        u32::MAX,
    );
    assert_eq!(validate(&big, SIZE * 8, ALL), Verdict::Ok);
    assert_eq!(validate(&big, SIZE, ALL), error(NBD_ENOSPC));
    let not_advertised = ALL & !NBD_FLAG_SEND_WRITE_ZEROES;
    let small = req(Command::WriteZeroes, 0, 0, 1);
    assert_eq!(validate(&small, SIZE, not_advertised), error(NBD_EINVAL));
    assert_eq!(
        validate(&small, SIZE, ALL | NBD_FLAG_READ_ONLY),
        error(NBD_EPERM)
    );
    let fast = req(Command::WriteZeroes, NBD_CMD_FLAG_FAST_ZERO, 0, 1);
    assert_eq!(validate(&fast, SIZE, ALL), error(NBD_EINVAL));
    assert_eq!(
        validate(&fast, SIZE, ALL | NBD_FLAG_SEND_FAST_ZERO),
        Verdict::Ok
    );
}

#[test]
fn flag_rules() {
    let fua_read = req(Command::Read, NBD_CMD_FLAG_FUA, 0, 1);
    assert_eq!(validate(&fua_read, SIZE, ALL), Verdict::Ok);
    assert_eq!(
        validate(&fua_read, SIZE, ALL & !NBD_FLAG_SEND_FUA),
        error(NBD_EINVAL)
    );
    let df = req(Command::Read, NBD_CMD_FLAG_DF, 0, 1);
    assert_eq!(validate(&df, SIZE, ALL), error(NBD_EINVAL));
    assert_eq!(validate(&df, SIZE, ALL | NBD_FLAG_SEND_DF), Verdict::Ok);
    let no_hole_read = req(Command::Read, NBD_CMD_FLAG_NO_HOLE, 0, 1);
    assert_eq!(validate(&no_hole_read, SIZE, ALL), error(NBD_EINVAL));
    let req_one = req(Command::Trim, NBD_CMD_FLAG_REQ_ONE, 0, 1);
    assert_eq!(validate(&req_one, SIZE, ALL), error(NBD_EINVAL));
    for bit in 5..16 {
        let unknown = req(Command::Read, 1 << bit, 0, 1);
        assert_eq!(
            validate(&unknown, SIZE, u16::MAX),
            error(NBD_EINVAL),
            "bit {bit}"
        );
    }
}

#[test]
fn unknown_commands_are_einval_and_disc_is_ok() {
    for wire in [NBD_CMD_RESIZE, 0xffff] {
        let unknown = req(Command::Unknown(wire), 0, 0, 1);
        assert_eq!(validate(&unknown, SIZE, u16::MAX), error(NBD_EINVAL));
    }
    assert_eq!(
        validate(&req(Command::Disc, 0, 0, 0), SIZE, ALL),
        Verdict::Ok
    );
    let odd_disc = req(Command::Disc, 0xffff, u64::MAX, u32::MAX);
    assert_eq!(validate(&odd_disc, 0, 0), Verdict::Ok);
}

// ---------------------------------------------------------------------------
// Properties.

#[derive(Debug, PartialEq)]
enum Outcome {
    /// Input ran out; `consumed` bytes were whole messages.
    NeedMore {
        consumed: usize,
    },
    /// The handshake ended at byte `end` of the input.
    Ended {
        end: usize,
        status: HandshakeStatus,
    },
    Failed(HandshakeError),
}

/// Feeds `input` the way a server would: append what arrives (in chunks of
/// the given sizes, cycled; everything at once if none), feed, drop what
/// was consumed. Returns the outcome and all output after the greeting.
fn drive(input: &[u8], chunk_sizes: &[usize]) -> (Outcome, Vec<u8>) {
    let mut out = Vec::new();
    let mut handshake = ServerHandshake::new(&mut out);
    out.clear();
    let mut pending: Vec<u8> = Vec::new();
    let mut pending_start = 0;
    let mut arrived = 0;
    let mut sizes = chunk_sizes.iter().copied().cycle();
    loop {
        let size = sizes.next().unwrap_or(input.len()).max(1);
        let end = (arrived + size).min(input.len());
        pending.extend_from_slice(&input[arrived..end]);
        arrived = end;
        match handshake.feed(&pending, &TestExports, &mut out) {
            Ok((used, HandshakeStatus::NeedMore)) => {
                pending.drain(..used);
                pending_start += used;
                assert!(
                    pending.len() < MAX_HANDSHAKE_MESSAGE_LEN,
                    "held {} bytes",
                    pending.len()
                );
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
                return (
                    Outcome::Ended {
                        end: pending_start + used,
                        status,
                    },
                    out,
                )
            }
            Err(error) => return (Outcome::Failed(error), out),
        }
    }
}

fn arb_name() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        Just(b"disk".to_vec()),
        Just(Vec::new()),
        Just(b"ro".to_vec()),
        Just(b"nope".to_vec()),
        prop::collection::vec(any::<u8>(), 0..8),
    ]
    .boxed()
}

fn arb_option() -> BoxedStrategy<Vec<u8>> {
    let infos = || prop::collection::vec(0u16..6, 0..5);
    prop_oneof![
        3 => (arb_name(), infos()).prop_map(|(n, i)| option(NBD_OPT_INFO, &info_payload(&n, &i))),
        1 => (arb_name(), infos()).prop_map(|(n, i)| option(NBD_OPT_GO, &info_payload(&n, &i))),
        1 => arb_name().prop_map(|name| option(NBD_OPT_EXPORT_NAME, &name)),
        2 => prop_oneof![Just(Vec::new()), Just(b"x".to_vec())]
            .prop_map(|payload| option(NBD_OPT_LIST, &payload)),
        1 => Just(option(NBD_OPT_ABORT, &[])),
        3 => (any::<u32>(), prop::collection::vec(any::<u8>(), 0..16))
            .prop_map(|(o, payload)| option(o, &payload)),
        // A header with any length (often too long), and no payload.
        1 => (any::<u32>(), any::<u32>()).prop_map(|(o, len)| {
            let mut bytes = option(o, &[]);
            bytes[12..16].copy_from_slice(&len.to_be_bytes());
            bytes
        }),
        1 => prop::collection::vec(any::<u8>(), 0..24),
    ]
    .boxed()
}

fn arb_client_stream() -> impl Strategy<Value = Vec<u8>> {
    let flags = prop_oneof![4 => Just(1u32), 4 => Just(3u32), 1 => any::<u32>()];
    (flags, prop::collection::vec(arb_option(), 0..8))
        .prop_map(|(flags, options)| client(flags, &options))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn handshake_byte_at_a_time_equals_all_at_once(input in arb_client_stream()) {
        let whole = drive(&input, &[]);
        prop_assert_eq!(&drive(&input, &[1]), &whole);
    }

    #[test]
    fn handshake_any_chunking_equals_all_at_once(
        input in arb_client_stream(),
        chunks in prop::collection::vec(1usize..40, 1..8),
    ) {
        let whole = drive(&input, &[]);
        prop_assert_eq!(&drive(&input, &chunks), &whole);
    }

    #[test]
    fn handshake_survives_arbitrary_bytes(tail in prop::collection::vec(any::<u8>(), 0..256)) {
        let input = client(1, &[tail]);
        let whole = drive(&input, &[]);
        prop_assert_eq!(&drive(&input, &[1]), &whole);
    }

    #[test]
    fn decode_request_never_panics(bytes in prop::array::uniform28(any::<u8>())) {
        match decode_request(&bytes) {
            Ok(request) => prop_assert_eq!(encode_request(&request), bytes),
            Err(RequestError::BadMagic { magic }) => prop_assert_ne!(magic, NBD_REQUEST_MAGIC),
        }
    }

    #[test]
    fn request_encode_decode_roundtrip(
        flags in any::<u16>(),
        wire in any::<u16>(),
        cookie in any::<u64>(),
        offset in any::<u64>(),
        length in any::<u32>(),
    ) {
        let request = Request { flags, command: Command::from_wire(wire), cookie, offset, length };
        prop_assert_eq!(request.command.to_wire(), wire);
        prop_assert_eq!(decode_request(&encode_request(&request)), Ok(request));
    }

    #[test]
    fn validate_never_passes_an_out_of_range_request(
        flags in prop_oneof![Just(0u16), Just(NBD_CMD_FLAG_FUA), any::<u16>()],
        wire in prop_oneof![0u16..9, any::<u16>()],
        offset in prop_oneof![0u64..(1 << 22), any::<u64>(), (u64::MAX - (1 << 22))..=u64::MAX],
        length in prop_oneof![0u32..(1 << 22), any::<u32>()],
        size in prop_oneof![0u64..(1 << 22), any::<u64>(), Just(u64::MAX)],
        tflags in any::<u16>(),
    ) {
        let request = Request { flags, command: Command::from_wire(wire), cookie: 0, offset, length };
        let command = request.command;
        match validate(&request, size, tflags) {
            Verdict::Ok => match command {
                Command::Read | Command::Write | Command::Trim | Command::WriteZeroes
                | Command::Cache | Command::BlockStatus => {
                    prop_assert!(length > 0);
                    let end = offset.checked_add(u64::from(length));
                    prop_assert!(end.is_some_and(|end| end <= size));
                    if matches!(command, Command::Read | Command::Write) {
                        prop_assert!(length <= MAX_PAYLOAD_BYTES);
                    }
                    if command.modifies() {
                        prop_assert_eq!(tflags & NBD_FLAG_READ_ONLY, 0);
                    }
                }
                Command::Flush => prop_assert_eq!((offset, length), (0, 0)),
                Command::Disc => {}
                Command::Unknown(_) => prop_assert!(false, "unknown command passed"),
            },
            Verdict::Error { nbd_error, drain_bytes } => {
                prop_assert!([NBD_EPERM, NBD_EINVAL, NBD_ENOSPC].contains(&nbd_error));
                if command == Command::Write {
                    prop_assert_eq!(drain_bytes, length);
                    prop_assert!(drain_bytes <= MAX_WRITE_DRAIN_BYTES);
                } else {
                    prop_assert_eq!(drain_bytes, 0);
                }
            }
            Verdict::Disconnect(_) => {
                prop_assert_eq!(command, Command::Write);
                prop_assert!(length > MAX_WRITE_DRAIN_BYTES);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Structured replies and metadata contexts.

fn meta_payload(export: &[u8], queries: &[&str]) -> Vec<u8> {
    let mut p = (export.len() as u32).to_be_bytes().to_vec();
    p.extend_from_slice(export);
    p.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        p.extend_from_slice(&(q.len() as u32).to_be_bytes());
        p.extend_from_slice(q.as_bytes());
    }
    p
}

fn negotiate(options: &[Vec<u8>]) -> (Vec<(u32, u32)>, Negotiated, bool) {
    let input = client(1, options);
    let mut out = Vec::new();
    let mut hs = ServerHandshake::new(&mut out);
    out.clear();
    let (_, status) = hs.feed(&input, &TestExports, &mut out).expect("handshake");
    let pairs = replies(&out)
        .iter()
        .map(|r| (r.option, r.reply_type))
        .collect();
    let done = matches!(status, HandshakeStatus::Done { .. });
    (pairs, hs.negotiated(), done)
}

#[test]
fn base_allocation_is_negotiated_after_structured_replies() {
    let (pairs, negotiated, done) = negotiate(&[
        option(NBD_OPT_STRUCTURED_REPLY, &[]),
        option(
            NBD_OPT_SET_META_CONTEXT,
            &meta_payload(b"disk", &["qemu:dirty-bitmap:a", "base:allocation"]),
        ),
        option(NBD_OPT_GO, &info_payload(b"disk", &[])),
    ]);
    assert!(done);
    assert_eq!(
        &pairs[..3],
        &[
            (NBD_OPT_STRUCTURED_REPLY, NBD_REP_ACK),
            (NBD_OPT_SET_META_CONTEXT, NBD_REP_META_CONTEXT),
            (NBD_OPT_SET_META_CONTEXT, NBD_REP_ACK),
        ]
    );
    assert_eq!(
        negotiated,
        Negotiated {
            structured_replies: true,
            base_allocation: true,
            changed: None,
        }
    );
}

#[test]
fn meta_context_needs_structured_replies_and_the_same_export() {
    // SET before STRUCTURED_REPLY is invalid.
    let (pairs, negotiated, _) = negotiate(&[
        option(
            NBD_OPT_SET_META_CONTEXT,
            &meta_payload(b"disk", &["base:allocation"]),
        ),
        option(NBD_OPT_STRUCTURED_REPLY, &[]),
        option(NBD_OPT_GO, &info_payload(b"disk", &[])),
    ]);
    assert_eq!(pairs[0], (NBD_OPT_SET_META_CONTEXT, NBD_REP_ERR_INVALID));
    assert!(negotiated.structured_replies && !negotiated.base_allocation);
    // Selected for one export, GO for another: no context.
    let (_, negotiated, _) = negotiate(&[
        option(NBD_OPT_STRUCTURED_REPLY, &[]),
        option(
            NBD_OPT_SET_META_CONTEXT,
            &meta_payload(b"disk", &["base:allocation"]),
        ),
        option(NBD_OPT_GO, &info_payload(b"", &[])),
    ]);
    assert!(!negotiated.base_allocation);
    // Unknown export.
    let (pairs, _, _) = negotiate(&[
        option(NBD_OPT_STRUCTURED_REPLY, &[]),
        option(
            NBD_OPT_SET_META_CONTEXT,
            &meta_payload(b"nope", &["base:allocation"]),
        ),
    ]);
    assert_eq!(pairs[1], (NBD_OPT_SET_META_CONTEXT, NBD_REP_ERR_UNKNOWN));
    // A later SET with no queries clears the selection.
    let (_, negotiated, _) = negotiate(&[
        option(NBD_OPT_STRUCTURED_REPLY, &[]),
        option(
            NBD_OPT_SET_META_CONTEXT,
            &meta_payload(b"disk", &["base:allocation"]),
        ),
        option(NBD_OPT_SET_META_CONTEXT, &meta_payload(b"disk", &[])),
        option(NBD_OPT_GO, &info_payload(b"disk", &[])),
    ]);
    assert!(!negotiated.base_allocation);
}

#[test]
fn list_meta_context_lists_base_allocation() {
    for queries in [&[][..], &["base:"][..], &["base:allocation"][..]] {
        let (pairs, _, _) = negotiate(&[option(
            NBD_OPT_LIST_META_CONTEXT,
            &meta_payload(b"disk", queries),
        )]);
        assert_eq!(
            pairs,
            [
                (NBD_OPT_LIST_META_CONTEXT, NBD_REP_META_CONTEXT),
                (NBD_OPT_LIST_META_CONTEXT, NBD_REP_ACK)
            ],
            "{queries:?}"
        );
    }
    let (pairs, _, _) = negotiate(&[option(
        NBD_OPT_LIST_META_CONTEXT,
        &meta_payload(b"disk", &["qemu:"]),
    )]);
    assert_eq!(pairs, [(NBD_OPT_LIST_META_CONTEXT, NBD_REP_ACK)]);
}

#[test]
fn block_status_and_cache_validate() {
    let bs = req(Command::BlockStatus, NBD_CMD_FLAG_REQ_ONE, 0, SIZE as u32);
    assert_eq!(validate(&bs, SIZE, ALL), Verdict::Ok);
    assert_eq!(
        validate(&req(Command::BlockStatus, 0, SIZE - 1, 2), SIZE, ALL),
        error(NBD_EINVAL)
    );
    assert_eq!(
        validate(&req(Command::Read, NBD_CMD_FLAG_REQ_ONE, 0, 1), SIZE, ALL),
        error(NBD_EINVAL)
    );
    let cache = req(Command::Cache, 0, 0, SIZE as u32);
    assert_eq!(validate(&cache, SIZE, ALL), error(NBD_EINVAL));
    assert_eq!(
        validate(&cache, SIZE, ALL | NBD_FLAG_SEND_CACHE),
        Verdict::Ok
    );
    // Cache reads, so a read-only export serves it.
    assert_eq!(
        validate(&cache, SIZE, ALL | NBD_FLAG_SEND_CACHE | NBD_FLAG_READ_ONLY),
        Verdict::Ok
    );
}

/// Exports whose "ro" export refuses every client (`admit`).
struct RefusingExports;

impl Exports for RefusingExports {
    fn names(&self) -> Vec<String> {
        TestExports.names()
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        TestExports.lookup(name)
    }

    fn admit(&self, name: &str) -> Result<(), String> {
        match name {
            "ro" => Err("full".to_string()),
            _ => Ok(()),
        }
    }
}

#[test]
fn a_refused_go_gets_err_policy_before_any_info_and_negotiation_goes_on() {
    let input = client(
        1,
        &[
            option(NBD_OPT_INFO, &info_payload(b"ro", &[])),
            option(NBD_OPT_GO, &info_payload(b"ro", &[])),
            option(NBD_OPT_GO, &info_payload(b"disk", &[])),
        ],
    );
    let mut out = Vec::new();
    let mut handshake = ServerHandshake::new(&mut out);
    out.clear();
    let result = handshake.feed(&input, &RefusingExports, &mut out);
    let all = replies(&out);
    let types: Vec<u32> = all.iter().map(|r| r.reply_type).collect();
    // INFO is not admission; the refused GO sends no INFO, only the error.
    assert_eq!(
        types,
        [
            NBD_REP_INFO,
            NBD_REP_INFO,
            NBD_REP_ACK,
            NBD_REP_ERR_POLICY,
            NBD_REP_INFO,
            NBD_REP_INFO,
            NBD_REP_ACK
        ]
    );
    assert_eq!(all[3].payload, b"full");
    assert!(
        matches!(result, Ok((_, HandshakeStatus::Done { export_name, .. })) if export_name == "disk")
    );
}

#[test]
fn a_refused_export_name_ends_the_handshake() {
    let input = client(1, &[option(NBD_OPT_EXPORT_NAME, b"ro")]);
    let mut out = Vec::new();
    let mut handshake = ServerHandshake::new(&mut out);
    out.clear();
    let result = handshake.feed(&input, &RefusingExports, &mut out);
    assert!(out.is_empty(), "no reply bytes for a refused EXPORT_NAME");
    assert_eq!(
        result.map(|_| ()),
        Err(HandshakeError::Refused {
            name: "ro".into(),
            reason: "full".into()
        })
    );
}

// ---------------------------------------------------------------------------
// STARTTLS and TLS policies.

fn run_tls(
    policy: TlsPolicy,
    input: &[u8],
) -> (
    ServerHandshake,
    Result<(usize, HandshakeStatus), HandshakeError>,
    Vec<u8>,
) {
    let mut out = Vec::new();
    let mut handshake = ServerHandshake::with_tls(&mut out, policy);
    out.clear();
    let result = handshake.feed(input, &TestExports, &mut out);
    (handshake, result, out)
}

#[test]
fn require_refuses_every_option_before_starttls_and_tells_nothing() {
    let input = client(
        1,
        &[
            option(NBD_OPT_LIST, &[]),
            option(NBD_OPT_INFO, &info_payload(b"disk", &[NBD_INFO_NAME])),
            option(NBD_OPT_GO, &info_payload(b"disk", &[])),
            option(NBD_OPT_STRUCTURED_REPLY, &[]),
            option(
                NBD_OPT_LIST_META_CONTEXT,
                b"\x00\x00\x00\x04disk\x00\x00\x00\x00",
            ),
            option(0xdead_beef, b"payload"),
        ],
    );
    let (hs, result, out) = run_tls(TlsPolicy::Require, &input);
    assert_eq!(result, Ok((input.len(), HandshakeStatus::NeedMore)));
    let replies = replies(&out);
    assert_eq!(replies.len(), 6);
    for r in &replies {
        assert_eq!(r.reply_type, NBD_REP_ERR_TLS_REQD, "option {}", r.option);
        let text = String::from_utf8_lossy(&r.payload);
        assert!(!text.contains("disk") && !text.contains("ro"), "{text}");
    }
    assert!(!hs.tls_active());
    assert_eq!(hs.negotiated(), Negotiated::default(), "nothing negotiated");
}

#[test]
fn require_closes_on_export_name_before_tls() {
    let input = client(1, &[option(NBD_OPT_EXPORT_NAME, b"disk")]);
    let (_, result, out) = run_tls(TlsPolicy::Require, &input);
    assert_eq!(result, Err(HandshakeError::TlsRequired));
    assert!(out.is_empty(), "no size or flags before TLS");
}

#[test]
fn starttls_acks_then_negotiation_goes_on_inside_and_plaintext_state_is_forgotten() {
    let input = client(
        1,
        &[
            option(NBD_OPT_STRUCTURED_REPLY, &[]),
            option(NBD_OPT_STARTTLS, &[]),
            option(NBD_OPT_GO, &info_payload(b"disk", &[])),
        ],
    );
    let starttls_end = 4 + 2 * OPTION_HEADER_LEN;
    for policy in [TlsPolicy::On, TlsPolicy::Require] {
        let (mut hs, result, out) = run_tls(policy, &input);
        // STRUCTURED_REPLY: ACK with On, TLS_REQD with Require.
        assert_eq!(result, Ok((starttls_end, HandshakeStatus::StartTls)));
        let types = reply_types(&out);
        assert_eq!(types[1], NBD_REP_ACK);
        hs.tls_started();
        let mut more = Vec::new();
        assert!(hs.tls_active());
        let result = hs.feed(&input[starttls_end..], &TestExports, &mut more);
        assert!(matches!(result, Ok((_, HandshakeStatus::Done { .. }))));
        assert!(
            !hs.negotiated().structured_replies,
            "structured replies negotiated in plaintext do not survive STARTTLS"
        );
    }
}

#[test]
fn starttls_refusals() {
    // Off: unsupported. With data: invalid. Inside TLS: invalid.
    let input = client(1, &[option(NBD_OPT_STARTTLS, &[])]);
    let (_, _, out) = run_tls(TlsPolicy::Off, &input);
    assert_eq!(reply_types(&out), [NBD_REP_ERR_UNSUP]);
    let input = client(1, &[option(NBD_OPT_STARTTLS, b"x")]);
    let (_, result, out) = run_tls(TlsPolicy::Require, &input);
    assert_eq!(reply_types(&out), [NBD_REP_ERR_INVALID]);
    assert_eq!(result, Ok((input.len(), HandshakeStatus::NeedMore)));
    let input = client(1, &[option(NBD_OPT_STARTTLS, &[])]);
    let (mut hs, _, _) = run_tls(TlsPolicy::On, &input);
    hs.tls_started();
    let mut out = Vec::new();
    let again = option(NBD_OPT_STARTTLS, &[]);
    let result = hs.feed(&again, &TestExports, &mut out);
    assert_eq!(result, Ok((again.len(), HandshakeStatus::NeedMore)));
    assert_eq!(reply_types(&out), [NBD_REP_ERR_INVALID]);
    // ABORT is honoured before TLS even when TLS is required.
    let input = client(1, &[option(NBD_OPT_ABORT, &[])]);
    let (_, result, _) = run_tls(TlsPolicy::Require, &input);
    assert_eq!(result, Ok((input.len(), HandshakeStatus::Aborted)));
}

#[test]
fn on_serves_plain_clients() {
    let input = client(1, &[option(NBD_OPT_GO, &info_payload(b"disk", &[]))]);
    let (_, result, _) = run_tls(TlsPolicy::On, &input);
    assert!(matches!(result, Ok((_, HandshakeStatus::Done { .. }))));
}

// ---------------------------------------------------------------------------
// Snapshot exports and the `lull:changed:` metadata context.

/// "vol" with the snapshots s1 and s2, and "vol@s2", s2's read-only
/// view, which has s1 (the snapshots older than it).
struct SnapExports {
    /// Extra snapshots of "vol" named `many{i}`, for the listing cap.
    many: usize,
}

impl SnapExports {
    fn snapshots(&self, export: &str) -> Vec<String> {
        match export {
            "vol" => ["s1", "s2"]
                .iter()
                .map(|s| s.to_string())
                .chain((0..self.many).map(|i| format!("many{i}")))
                .collect(),
            "vol@s2" => vec!["s1".to_string()],
            _ => Vec::new(),
        }
    }
}

impl Exports for SnapExports {
    fn names(&self) -> Vec<String> {
        vec!["vol".to_string(), "vol@s2".to_string()]
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        match name {
            "vol" => Some(ExportInfo {
                size_bytes: DISK_SIZE,
                transmission_flags: DISK_FLAGS,
                description: None,
            }),
            "vol@s2" => Some(ExportInfo {
                size_bytes: DISK_SIZE,
                transmission_flags: NBD_FLAG_HAS_FLAGS | NBD_FLAG_READ_ONLY,
                description: None,
            }),
            _ => None,
        }
    }

    fn snapshot_names(&self, export: &str) -> Vec<String> {
        self.snapshots(export)
    }

    fn has_snapshot(&self, export: &str, snapshot: &str) -> bool {
        self.snapshots(export).iter().any(|s| s == snapshot)
    }
}

/// Runs `options` against `exports` (structured replies first unless
/// `plain`); returns the replies, what was negotiated and whether a GO
/// finished the handshake.
fn negotiate_with(
    exports: &dyn Exports,
    options: &[Vec<u8>],
    plain: bool,
) -> (Vec<Reply>, Negotiated, bool) {
    let mut all = Vec::new();
    if !plain {
        all.push(option(NBD_OPT_STRUCTURED_REPLY, &[]));
    }
    all.extend_from_slice(options);
    let input = client(1, &all);
    let mut out = Vec::new();
    let mut hs = ServerHandshake::new(&mut out);
    out.clear();
    let (used, status) = hs.feed(&input, exports, &mut out).expect("handshake");
    assert_eq!(used, input.len());
    let mut replies = replies(&out);
    if !plain {
        assert_eq!(replies[0].reply_type, NBD_REP_ACK);
        replies.remove(0);
    }
    let done = matches!(status, HandshakeStatus::Done { .. });
    (replies, hs.negotiated(), done)
}

/// The `(id, name)` of each `NBD_REP_META_CONTEXT` reply, in order.
fn contexts(replies: &[Reply]) -> Vec<(u32, String)> {
    replies
        .iter()
        .filter(|r| r.reply_type == NBD_REP_META_CONTEXT)
        .map(|r| {
            let id = u32::from_be_bytes(r.payload[..4].try_into().unwrap());
            (id, String::from_utf8(r.payload[4..].to_vec()).unwrap())
        })
        .collect()
}

fn list_meta(export: &[u8], queries: &[&str]) -> Vec<u8> {
    option(NBD_OPT_LIST_META_CONTEXT, &meta_payload(export, queries))
}

fn set_meta(export: &[u8], queries: &[&str]) -> Vec<u8> {
    option(NBD_OPT_SET_META_CONTEXT, &meta_payload(export, queries))
}

fn named(list: &[(u32, String)]) -> Vec<&str> {
    list.iter().map(|(_, name)| name.as_str()).collect()
}

#[test]
fn list_meta_context_lists_each_snapshots_changed_context() {
    let exports = SnapExports { many: 0 };
    for queries in [&["lull:"][..], &["lull:changed:"][..]] {
        let (replies, _, _) = negotiate_with(&exports, &[list_meta(b"vol", queries)], false);
        assert_eq!(
            contexts(&replies),
            [(0, "lull:changed:s1".into()), (0, "lull:changed:s2".into())],
            "{queries:?}"
        );
        assert_eq!(replies.last().unwrap().reply_type, NBD_REP_ACK);
    }
    // No query: every context, base:allocation first.
    let (replies, _, _) = negotiate_with(&exports, &[list_meta(b"vol", &[])], false);
    assert_eq!(
        named(&contexts(&replies)),
        ["base:allocation", "lull:changed:s1", "lull:changed:s2"]
    );
    // A snapshot's export lists the snapshots older than it.
    let (replies, _, _) = negotiate_with(&exports, &[list_meta(b"vol@s2", &["lull:"])], false);
    assert_eq!(named(&contexts(&replies)), ["lull:changed:s1"]);
    // Exact names: listed when the export has the snapshot, once.
    let queries = [
        "lull:changed:s2",
        "lull:changed:nope",
        "lull:changed:s2",
        "lull:other",
        "base:allocation",
    ];
    let (replies, _, _) = negotiate_with(&exports, &[list_meta(b"vol", &queries)], false);
    assert_eq!(
        named(&contexts(&replies)),
        ["base:allocation", "lull:changed:s2"]
    );
    let (replies, _, _) = negotiate_with(
        &exports,
        &[list_meta(b"vol", &["lull:", "lull:changed:s1"])],
        false,
    );
    assert_eq!(
        named(&contexts(&replies)),
        ["lull:changed:s1", "lull:changed:s2"]
    );
    // An export without snapshots lists none; LIST works without
    // structured replies, as before.
    let (replies, _, _) = negotiate_with(&TestExports, &[list_meta(b"disk", &["lull:"])], true);
    assert_eq!(reply_types(&replies_bytes(&replies)), [NBD_REP_ACK]);
}

/// Re-encodes parsed replies, for `reply_types`.
fn replies_bytes(replies: &[Reply]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in replies {
        put_reply(&mut out, r.option, r.reply_type, &[&r.payload]);
    }
    out
}

#[test]
fn list_meta_context_stops_at_the_listing_cap() {
    let exports = SnapExports {
        many: structured::MAX_LISTED_CHANGED_CONTEXTS + 10,
    };
    let (replies, _, _) = negotiate_with(&exports, &[list_meta(b"vol", &["lull:"])], false);
    let listed = contexts(&replies);
    assert_eq!(listed.len(), structured::MAX_LISTED_CHANGED_CONTEXTS);
    assert_eq!(replies.last().unwrap().reply_type, NBD_REP_ACK);
    // A snapshot past the cap is still listed by name, and selectable.
    let last = format!(
        "lull:changed:many{}",
        structured::MAX_LISTED_CHANGED_CONTEXTS + 9
    );
    assert!(!named(&listed).contains(&last.as_str()));
    let (replies, _, _) = negotiate_with(&exports, &[list_meta(b"vol", &["lull:", &last])], false);
    assert_eq!(
        contexts(&replies).len(),
        structured::MAX_LISTED_CHANGED_CONTEXTS + 1
    );
}

#[test]
fn set_meta_context_selects_both_contexts_with_distinct_ids() {
    let exports = SnapExports { many: 0 };
    let (replies, negotiated, done) = negotiate_with(
        &exports,
        &[
            set_meta(b"vol@s2", &["lull:changed:s1", "base:allocation"]),
            option(NBD_OPT_GO, &info_payload(b"vol@s2", &[])),
        ],
        false,
    );
    assert!(done);
    let selected = contexts(&replies);
    assert_eq!(
        selected,
        [
            (structured::BASE_ALLOCATION_ID, "base:allocation".into()),
            (structured::LULL_CHANGED_ID, "lull:changed:s1".into()),
        ]
    );
    assert_ne!(selected[0].0, selected[1].0);
    let changed = ChangedContext {
        snapshot: "s1".into(),
        id: structured::LULL_CHANGED_ID,
    };
    assert_eq!(changed.name(), "lull:changed:s1");
    assert_eq!(
        negotiated,
        Negotiated {
            structured_replies: true,
            base_allocation: true,
            changed: Some(changed),
        }
    );
    // The changed context alone.
    let (_, negotiated, _) = negotiate_with(
        &exports,
        &[
            set_meta(b"vol", &["lull:changed:s2"]),
            option(NBD_OPT_GO, &info_payload(b"vol", &[])),
        ],
        false,
    );
    assert!(!negotiated.base_allocation);
    assert_eq!(negotiated.changed.unwrap().snapshot, "s2");
}

#[test]
fn set_meta_context_selects_one_changed_context_the_export_has() {
    let exports = SnapExports { many: 0 };
    // Unknown snapshots are not selected, and that is no error; of
    // several, the first the export has.
    let queries = [
        "lull:changed:nope",
        "lull:changed:s2",
        "lull:changed:s1",
        "qemu:dirty-bitmap:x",
    ];
    let (replies, negotiated, _) = negotiate_with(
        &exports,
        &[
            set_meta(b"vol", &queries),
            option(NBD_OPT_GO, &info_payload(b"vol", &[])),
        ],
        false,
    );
    assert_eq!(
        contexts(&replies),
        [(structured::LULL_CHANGED_ID, "lull:changed:s2".into())]
    );
    assert_eq!(negotiated.changed.unwrap().snapshot, "s2");
    // Only an unknown snapshot: nothing selected, just the ACK.
    let (replies, negotiated, _) = negotiate_with(
        &exports,
        &[
            set_meta(b"vol@s2", &["lull:changed:s2"]),
            option(NBD_OPT_GO, &info_payload(b"vol@s2", &[])),
        ],
        false,
    );
    assert_eq!(replies[0].reply_type, NBD_REP_ACK);
    assert_eq!(
        negotiated,
        Negotiated {
            structured_replies: true,
            ..Negotiated::default()
        }
    );
    // Wildcards select nothing in SET.
    let (replies, negotiated, _) = negotiate_with(
        &exports,
        &[
            set_meta(b"vol", &["lull:", "lull:changed:", "base:"]),
            option(NBD_OPT_GO, &info_payload(b"vol", &[])),
        ],
        false,
    );
    assert!(contexts(&replies).is_empty());
    assert_eq!(negotiated.changed, None);
    assert!(!negotiated.base_allocation);
}

#[test]
fn changed_context_holds_only_for_its_export_and_with_structured_replies() {
    let exports = SnapExports { many: 0 };
    // Selected on "vol", GO on "vol@s2": nothing holds.
    let (_, negotiated, done) = negotiate_with(
        &exports,
        &[
            set_meta(b"vol", &["lull:changed:s1", "base:allocation"]),
            option(NBD_OPT_GO, &info_payload(b"vol@s2", &[])),
        ],
        false,
    );
    assert!(done);
    assert_eq!(negotiated.changed, None);
    assert!(!negotiated.base_allocation);
    // SET without structured replies is refused and selects nothing.
    let (replies, negotiated, _) = negotiate_with(
        &exports,
        &[
            set_meta(b"vol", &["lull:changed:s1"]),
            option(NBD_OPT_GO, &info_payload(b"vol", &[])),
        ],
        true,
    );
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_INVALID);
    assert_eq!(negotiated, Negotiated::default());
    // A later SET replaces the selection.
    let (_, negotiated, _) = negotiate_with(
        &exports,
        &[
            set_meta(b"vol", &["lull:changed:s1"]),
            set_meta(b"vol", &["base:allocation"]),
            option(NBD_OPT_GO, &info_payload(b"vol", &[])),
        ],
        false,
    );
    assert!(negotiated.base_allocation);
    assert_eq!(negotiated.changed, None);
}

#[test]
fn malformed_changed_queries_are_invalid() {
    let exports = SnapExports { many: 0 };
    for bad in ["lull:changed:vol@s1", "lull:changed:a/b"] {
        for opt in [
            list_meta(b"vol", &["base:allocation", bad]),
            set_meta(b"vol", &[bad]),
        ] {
            let (replies, _, _) = negotiate_with(&exports, &[opt], false);
            assert_eq!(replies.len(), 1, "{bad}: an error and nothing else");
            assert_eq!(replies[0].reply_type, NBD_REP_ERR_INVALID, "{bad}");
        }
    }
    // A failed SET still clears what an earlier one selected.
    let (replies, negotiated, done) = negotiate_with(
        &exports,
        &[
            set_meta(b"vol", &["lull:changed:s1"]),
            set_meta(b"vol", &["lull:changed:a/b"]),
            option(NBD_OPT_GO, &info_payload(b"vol", &[])),
        ],
        false,
    );
    assert!(done);
    assert_eq!(replies[2].reply_type, NBD_REP_ERR_INVALID);
    assert_eq!(negotiated.changed, None);
    // A query longer than an NBD string: invalid, and negotiation goes on.
    let long = format!("lull:changed:{}", "s".repeat(MAX_STRING_LEN));
    let (replies, _, done) = negotiate_with(
        &exports,
        &[
            list_meta(b"", &[&long]),
            option(NBD_OPT_GO, &info_payload(b"vol", &[])),
        ],
        false,
    );
    assert_eq!(replies[0].reply_type, NBD_REP_ERR_INVALID);
    assert!(done);
    // The longest query that fits is fine: an unknown snapshot.
    let longest = format!(
        "lull:changed:{}",
        "s".repeat(structured::MAX_CHANGED_SNAPSHOT_NAME_LEN)
    );
    assert_eq!(longest.len(), MAX_STRING_LEN);
    let (replies, _, _) = negotiate_with(&exports, &[list_meta(b"vol", &[&longest])], false);
    assert_eq!(replies[0].reply_type, NBD_REP_ACK);
}

#[test]
fn starttls_forgets_the_changed_context() {
    let input = client(
        1,
        &[
            option(NBD_OPT_STRUCTURED_REPLY, &[]),
            set_meta(b"vol", &["lull:changed:s1"]),
            option(NBD_OPT_STARTTLS, &[]),
        ],
    );
    let mut out = Vec::new();
    let mut hs = ServerHandshake::with_tls(&mut out, TlsPolicy::On);
    let exports = SnapExports { many: 0 };
    let (_, status) = hs.feed(&input, &exports, &mut out).unwrap();
    assert_eq!(status, HandshakeStatus::StartTls);
    hs.tls_started();
    let inside = client(0, &[option(NBD_OPT_GO, &info_payload(b"vol", &[]))]);
    let (_, status) = hs.feed(&inside[4..], &exports, &mut out).unwrap();
    assert!(matches!(status, HandshakeStatus::Done { .. }));
    assert_eq!(hs.negotiated(), Negotiated::default());
}

#[test]
fn modifying_commands_on_a_read_only_export_are_eperm() {
    // What lull advertises for a snapshot: no trim, no write zeroes.
    let read_only =
        NBD_FLAG_HAS_FLAGS | NBD_FLAG_READ_ONLY | NBD_FLAG_SEND_FLUSH | NBD_FLAG_SEND_FUA;
    assert_eq!(
        validate(&req(Command::Write, 0, 0, 4096), SIZE, read_only),
        drain(NBD_EPERM, 4096)
    );
    assert_eq!(
        validate(
            &req(Command::Write, NBD_CMD_FLAG_FUA, 0, 4096),
            SIZE,
            read_only
        ),
        drain(NBD_EPERM, 4096)
    );
    assert_eq!(
        validate(&req(Command::Trim, 0, 0, 4096), SIZE, read_only),
        error(NBD_EPERM)
    );
    assert_eq!(
        validate(
            &req(Command::WriteZeroes, NBD_CMD_FLAG_NO_HOLE, 0, 4096),
            SIZE,
            read_only
        ),
        error(NBD_EPERM)
    );
    // Reads, flushes and block status are served.
    assert_eq!(
        validate(&req(Command::Read, 0, 0, 4096), SIZE, read_only),
        Verdict::Ok
    );
    assert_eq!(
        validate(&req(Command::Flush, 0, 0, 0), SIZE, read_only),
        Verdict::Ok
    );
    assert_eq!(
        validate(
            &req(Command::BlockStatus, NBD_CMD_FLAG_REQ_ONE, 0, 4096),
            SIZE,
            read_only
        ),
        Verdict::Ok
    );
    // On a writable export without the flags, trim and zeroes stay EINVAL.
    let plain = read_only & !NBD_FLAG_READ_ONLY;
    assert_eq!(
        validate(&req(Command::Trim, 0, 0, 4096), SIZE, plain),
        error(NBD_EINVAL)
    );
}

fn arb_query() -> BoxedStrategy<String> {
    prop_oneof![
        Just("base:allocation".to_string()),
        Just("base:".to_string()),
        Just("lull:".to_string()),
        Just("lull:changed:".to_string()),
        Just("lull:changed:s1".to_string()),
        Just("lull:changed:s2".to_string()),
        Just("lull:changed:nope".to_string()),
        Just("lull:changed:a@b".to_string()),
        "(lull:changed:)?[a-z12:@/]{0,6}",
    ]
    .boxed()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever a SET asks, what it replies is what the GO negotiates: at
    /// most `base:allocation` (id 1) and one `lull:changed:` of a
    /// snapshot the export has (id 2), or an error and nothing.
    #[test]
    fn set_meta_context_replies_match_the_selection(
        on_view in any::<bool>(),
        queries in prop::collection::vec(arb_query(), 0..6),
    ) {
        let exports = SnapExports { many: 0 };
        let export = if on_view { "vol@s2" } else { "vol" };
        let queries: Vec<&str> = queries.iter().map(String::as_str).collect();
        let (replies, negotiated, done) = negotiate_with(
            &exports,
            &[
                set_meta(export.as_bytes(), &queries),
                option(NBD_OPT_GO, &info_payload(export.as_bytes(), &[])),
            ],
            false,
        );
        prop_assert!(done);
        let set_replies: Vec<&Reply> = replies
            .iter()
            .filter(|r| r.option == NBD_OPT_SET_META_CONTEXT)
            .collect();
        let last = set_replies.last().unwrap().reply_type;
        let selected = contexts(&replies);
        if last != NBD_REP_ACK {
            prop_assert_eq!(last, NBD_REP_ERR_INVALID);
            prop_assert!(selected.is_empty());
            prop_assert_eq!(negotiated.changed, None);
            prop_assert!(!negotiated.base_allocation);
            return Ok(());
        }
        let mut ids: Vec<u32> = selected.iter().map(|(id, _)| *id).collect();
        ids.dedup();
        prop_assert_eq!(ids.len(), selected.len(), "ids distinct: {:?}", selected);
        prop_assert!(selected.len() <= 2);
        let base = selected.iter().any(|(id, name)| {
            *id == structured::BASE_ALLOCATION_ID && name == "base:allocation"
        });
        prop_assert_eq!(negotiated.base_allocation, base);
        prop_assert_eq!(base, queries.contains(&"base:allocation"));
        let changed = selected
            .iter()
            .find(|(id, _)| *id == structured::LULL_CHANGED_ID)
            .map(|(_, name)| name.clone());
        prop_assert_eq!(negotiated.changed.as_ref().map(ChangedContext::name), changed);
        if let Some(c) = &negotiated.changed {
            prop_assert!(exports.has_snapshot(export, &c.snapshot));
            prop_assert!(queries.contains(&c.name().as_str()));
        }
    }
}
