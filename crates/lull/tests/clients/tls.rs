//! TLS on the NBD port (issue 12), proven with real clients: libnbd's
//! `nbdinfo` with a PSK URI, qemu-io with `tls-creds-psk` and
//! `tls-creds-x509`; a plain client against `--tls require` learns nothing
//! about the exports; wrong keys and broken handshakes end in a clean
//! close and a log line.
//!
//! ```text
//! cargo test -p lull --profile ci --test clients tls::
//! ```
//!
//! Certificates are made in the test with the `openssl` command (Debian
//! package openssl; scripts/test installs it).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::common::{
    self, assert_good_client_works, connect_raw, encode_go, encode_option, read_greeting,
    read_option_reply, require, wait_closed, Scratch, Server, CLIENT_FLAGS,
};
use lull_net::tls::{Creds, Role, TlsContext, TlsStream};
use lull_proto::nbd::{self, Command as Cmd};

const KEY_HEX: &str = "2b7e151628aed2a6abf7158809cf4f3c8a1e0b2c3d4e5f60718293a4b5c6d7e8";
const WRONG_KEY_HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// A PSK file `keys.psk` (qemu's tls-creds-psk reads that name) in a
/// directory `sub` of its own under `dir`.
fn psk(dir: &Path, sub: &str, user: &str, key_hex: &str) -> PathBuf {
    let dir = dir.join(sub);
    std::fs::create_dir_all(&dir).expect("psk dir");
    let file = dir.join("keys.psk");
    std::fs::write(&file, format!("{user}:{key_hex}\n")).expect("write psk");
    file
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn nbdinfo(args: &[&str]) -> Output {
    require("nbdinfo", "libnbd-bin");
    run(Command::new("nbdinfo").args(args))
}

fn psk_uri(addr: SocketAddr, psk: &Path, user: &str) -> String {
    // The user in the authority too: libnbd 1.14 otherwise asks
    // getlogin_r, which fails without a login terminal.
    format!(
        "nbds://{user}@{addr}/vol0?tls-psk-file={}&tls-username={user}",
        psk.display()
    )
}

/// qemu-io against `vol0` over TLS with the credentials `object` (an
/// `--object` string whose id is tls0); returns its output.
fn qemu_io(addr: SocketAddr, object: &str, cmds: &[&str]) -> Output {
    require("qemu-io", "qemu-utils");
    let image = format!(
        "driver=nbd,server.type=inet,server.host={},server.port={},export=vol0,tls-creds=tls0",
        addr.ip(),
        addr.port()
    );
    let mut cmd = Command::new("qemu-io");
    cmd.args(["--object", object, "--image-opts", &image]);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    run(&mut cmd)
}

fn assert_qemu_io_ok(out: &Output) {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("fail") && !text.contains("Pattern verification"),
        "qemu-io failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn psk_clients_work_and_plain_clients_learn_nothing() {
    let scratch = Scratch::new("psk");
    let keys = psk(&scratch, "server", "alice", KEY_HEX);
    // Keys alone mean --tls require.
    let mut server = Server::start(&["--volume", "vol0:16M", "--tls-psk", keys.to_str().unwrap()]);
    let addr = server.addr();

    // libnbd's PSK URI.
    let out = nbdinfo(&[&psk_uri(addr, &keys, "alice")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("16777216"),
        "nbdinfo over TLS-PSK failed: {text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Data both ways through qemu's tls-creds-psk.
    let object = format!(
        "tls-creds-psk,id=tls0,dir={},username=alice,endpoint=client",
        keys.parent().unwrap().display()
    );
    let out = qemu_io(
        addr,
        &object,
        &[
            "write -P 0x5a 4096 1M",
            "read -P 0x5a 4096 1M",
            "read -P 0 0 4096",
        ],
    );
    assert_qemu_io_ok(&out);

    // A plain libnbd client is refused and lists nothing.
    let out = nbdinfo(&["--list", &format!("nbd://{addr}")]);
    assert!(!out.status.success(), "a plain --list succeeded");
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("vol0"),
        "a plain client learned the export name"
    );

    // The same from a raw socket: every option before STARTTLS gets
    // TLS_REQD, with no export name or size in the reply.
    let mut sock = connect_raw(addr);
    read_greeting(&mut sock).expect("greeting");
    sock.write_all(&CLIENT_FLAGS.to_be_bytes()).unwrap();
    let mut info = encode_go("vol0");
    info[8..12].copy_from_slice(&nbd::NBD_OPT_INFO.to_be_bytes());
    for (option, bytes) in [
        (nbd::NBD_OPT_LIST, encode_option(nbd::NBD_OPT_LIST, &[])),
        (nbd::NBD_OPT_INFO, info),
        (
            nbd::NBD_OPT_STRUCTURED_REPLY,
            encode_option(nbd::NBD_OPT_STRUCTURED_REPLY, &[]),
        ),
        (nbd::NBD_OPT_GO, encode_go("vol0")),
    ] {
        sock.write_all(&bytes).unwrap();
        let (opt, reply_type, payload) = read_option_reply(&mut sock).expect("option reply");
        assert_eq!((opt, reply_type), (option, nbd::NBD_REP_ERR_TLS_REQD));
        let text = String::from_utf8_lossy(&payload);
        assert!(!text.contains("vol0"), "export name leaked: {text}");
        assert!(
            payload.len() < 100,
            "a TLS_REQD reply carries only a message"
        );
    }
    // NBD_OPT_EXPORT_NAME cannot be refused with an error: closed.
    sock.write_all(&encode_option(nbd::NBD_OPT_EXPORT_NAME, b"vol0"))
        .unwrap();
    let closed = wait_closed(&mut sock).expect("closed after EXPORT_NAME");
    let _ = closed;
    // The close carries no reason: the log line is the only one.
    server.assert_logged(&["TLS is required"]);
    server.assert_healthy();
}

#[test]
fn wrong_psk_and_broken_handshakes_are_closed_with_a_log_line() {
    let scratch = Scratch::new("wrong");
    let keys = psk(&scratch, "server", "alice", KEY_HEX);
    let wrong = psk(&scratch, "wrong", "alice", WRONG_KEY_HEX);
    let stranger = psk(&scratch, "stranger", "mallory", KEY_HEX);
    let mut server = Server::start(&[
        "--volume",
        "vol0:16M",
        "--tls",
        "require",
        "--tls-psk",
        keys.to_str().unwrap(),
    ]);
    let addr = server.addr();

    for (file, user) in [(&wrong, "alice"), (&stranger, "mallory")] {
        let out = nbdinfo(&[&psk_uri(addr, file, user)]);
        assert!(
            !out.status.success(),
            "nbdinfo with a wrong key ({user}) succeeded"
        );
    }
    // A failed authentication: a warning an operator must see.
    server.assert_logged(&["TLS handshake failed"]);

    // STARTTLS, then plaintext garbage instead of a ClientHello.
    let mut sock = connect_raw(addr);
    read_greeting(&mut sock).expect("greeting");
    sock.write_all(&CLIENT_FLAGS.to_be_bytes()).unwrap();
    sock.write_all(&encode_option(nbd::NBD_OPT_STARTTLS, &[]))
        .unwrap();
    let (opt, reply_type, _) = read_option_reply(&mut sock).expect("STARTTLS reply");
    assert_eq!((opt, reply_type), (nbd::NBD_OPT_STARTTLS, nbd::NBD_REP_ACK));
    sock.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    wait_closed(&mut sock).expect("closed after a bad ClientHello");

    // Options injected in plaintext behind STARTTLS (nbdkit's
    // CVE-2021-3716): refused, not carried into the TLS session.
    let mut sock = connect_raw(addr);
    read_greeting(&mut sock).expect("greeting");
    let mut bytes = CLIENT_FLAGS.to_be_bytes().to_vec();
    bytes.extend(encode_option(nbd::NBD_OPT_STARTTLS, &[]));
    bytes.extend(encode_option(nbd::NBD_OPT_STRUCTURED_REPLY, &[]));
    sock.write_all(&bytes).unwrap();
    wait_closed(&mut sock).expect("closed after injected plaintext");
    // Closed without a reply: the log line is the only reason given.
    server.assert_logged(&["plaintext after NBD_OPT_STARTTLS"]);

    // STARTTLS twice without TLS in between is not a thing; STARTTLS with
    // data is invalid and negotiation goes on.
    let mut sock = connect_raw(addr);
    read_greeting(&mut sock).expect("greeting");
    sock.write_all(&CLIENT_FLAGS.to_be_bytes()).unwrap();
    sock.write_all(&encode_option(nbd::NBD_OPT_STARTTLS, b"x"))
        .unwrap();
    let (_, reply_type, _) = read_option_reply(&mut sock).expect("reply");
    assert_eq!(reply_type, nbd::NBD_REP_ERR_INVALID);
    drop(sock);

    // The right key still works after all that.
    let out = nbdinfo(&[&psk_uri(addr, &keys, "alice")]);
    assert!(
        out.status.success(),
        "nbdinfo with the right key failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    server.assert_healthy();
}

#[test]
fn x509_qemu_io_works_and_on_still_serves_plain_clients() {
    let scratch = Scratch::new("x509");
    let pki = scratch.join("pki");
    std::fs::create_dir_all(&pki).unwrap();
    common::make_pki(&pki);
    let mut server = Server::start(&[
        "--volume",
        "vol0:16M",
        "--tls",
        "on",
        "--tls-certs",
        pki.to_str().unwrap(),
    ]);
    let addr = server.addr();
    let object = format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        pki.display()
    );
    let out = qemu_io(
        addr,
        &object,
        &["write -P 0xa5 0 2M", "read -P 0xa5 0 2M", "flush"],
    );
    // qemu's client with tls-creds talks TLS or nothing: it worked, so
    // the session was TLS.
    assert_qemu_io_ok(&out);

    // --tls on: a plain client is served too, and sees the data.
    assert_good_client_works(addr, "vol0", 8 << 20);

    // A client without a certificate is refused (the CA is present, so
    // client certificates are required).
    let no_cert = scratch.join("no-cert");
    std::fs::create_dir_all(&no_cert).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), no_cert.join("ca-cert.pem")).unwrap();
    let out = nbdinfo(&[&format!(
        "nbds://{addr}/vol0?tls-certificates={}",
        no_cert.display()
    )]);
    assert!(
        !out.status.success(),
        "a client without a certificate was served"
    );
    server.assert_healthy();
}

// ---------------------------------------------------------------------------
// The adversarial cases of nbd_bad_input.rs, inside a TLS session: the
// same answers (an error reply or a clean close, a log line, no effect on
// other clients) whether the bytes come in plaintext or through TLS.

/// A blocking TLS-PSK session on the NBD port, negotiated up to the
/// point where options go through TLS.
fn tls_session(addr: SocketAddr, keys: &Path) -> TlsStream<TcpStream> {
    let mut sock = connect_raw(addr);
    read_greeting(&mut sock).expect("greeting");
    sock.write_all(&CLIENT_FLAGS.to_be_bytes()).unwrap();
    sock.write_all(&encode_option(nbd::NBD_OPT_STARTTLS, &[]))
        .unwrap();
    let (_, reply_type, _) = read_option_reply(&mut sock).expect("STARTTLS reply");
    assert_eq!(reply_type, nbd::NBD_REP_ACK);
    let ctx = TlsContext::new(&Creds::Psk(keys.to_path_buf()), Role::Client).expect("client keys");
    let mut tls = TlsStream::new(&ctx, sock).expect("TLS session");
    // A blocking socket: the handshake finishes or fails in one call.
    assert!(
        tls.handshake().expect("TLS handshake"),
        "blocking handshake"
    );
    tls
}

/// A TLS session that finished `NBD_OPT_GO` for vol0 (simple replies).
fn tls_transmission(addr: SocketAddr, keys: &Path) -> TlsStream<TcpStream> {
    let mut tls = tls_session(addr, keys);
    tls.write_all(&encode_go("vol0")).unwrap();
    loop {
        let (_, reply_type, _) = read_option_reply(&mut tls).expect("GO reply");
        if reply_type == nbd::NBD_REP_ACK {
            return tls;
        }
        assert_eq!(reply_type, nbd::NBD_REP_INFO, "GO refused");
    }
}

fn request(command: Cmd, cookie: u64, offset: u64, length: u32) -> [u8; nbd::REQUEST_LEN] {
    nbd::encode_request(&nbd::Request {
        flags: 0,
        command,
        cookie,
        offset,
        length,
    })
}

fn simple_reply(tls: &mut impl Read) -> (u32, u64) {
    let mut reply = [0u8; nbd::SIMPLE_REPLY_LEN];
    tls.read_exact(&mut reply).expect("simple reply");
    nbd::decode_simple_reply(&reply).expect("simple reply magic")
}

/// The good TLS client the bad ones must not disturb: write, read back.
fn assert_good_tls_client_works(addr: SocketAddr, keys: &Path, offset: u64) {
    let mut tls = tls_transmission(addr, keys);
    let data = common::pattern(offset, 64 * 1024);
    tls.write_all(&request(Cmd::Write, 1, offset, data.len() as u32))
        .unwrap();
    tls.write_all(&data).unwrap();
    assert_eq!(simple_reply(&mut tls), (0, 1));
    tls.write_all(&request(Cmd::Read, 2, offset, data.len() as u32))
        .unwrap();
    assert_eq!(simple_reply(&mut tls), (0, 2));
    let mut back = vec![0u8; data.len()];
    tls.read_exact(&mut back).unwrap();
    assert!(back == data, "read back other data than written over TLS");
    tls.write_all(&request(Cmd::Disc, 3, 0, 0)).unwrap();
}

#[test]
fn bad_input_inside_tls_gets_the_same_answers() {
    let scratch = Scratch::new("bad");
    let keys = psk(&scratch, "server", "alice", KEY_HEX);
    let mut server = Server::start(&["--volume", "vol0:16M", "--tls-psk", keys.to_str().unwrap()]);
    let addr = server.addr();
    assert_good_tls_client_works(addr, &keys, 0);

    // A bad option magic: closed.
    let mut tls = tls_session(addr, &keys);
    tls.write_all(b"NOTMAGIC\x00\x00\x00\x07\x00\x00\x00\x00")
        .unwrap();
    wait_closed(&mut tls).expect("closed after a bad option magic");

    // An over-long option: closed from its header.
    let mut tls = tls_session(addr, &keys);
    let mut header = nbd::IHAVEOPT.to_be_bytes().to_vec();
    header.extend_from_slice(&nbd::NBD_OPT_GO.to_be_bytes());
    header.extend_from_slice(&(nbd::MAX_OPTION_LEN + 1).to_be_bytes());
    tls.write_all(&header).unwrap();
    wait_closed(&mut tls).expect("closed after an over-long option");

    // An option flood: the STARTTLS counted, 31 more answered, then closed.
    let mut tls = tls_session(addr, &keys);
    let mut flood = Vec::new();
    for _ in 0..nbd::MAX_OPTIONS + 8 {
        flood.extend(encode_option(0xdead_beef, b"x"));
    }
    tls.write_all(&flood).unwrap();
    let mut answered = 0;
    while let Ok((_, reply_type, _)) = read_option_reply(&mut tls) {
        assert_eq!(reply_type, nbd::NBD_REP_ERR_UNSUP);
        answered += 1;
    }
    assert_eq!(
        answered,
        nbd::MAX_OPTIONS - 1,
        "options answered before the close"
    );

    // A request with a bad magic after GO: closed.
    let mut tls = tls_transmission(addr, &keys);
    let mut bad = request(Cmd::Read, 9, 0, 512);
    bad[0] ^= 0xff;
    tls.write_all(&bad).unwrap();
    wait_closed(&mut tls).expect("closed after a bad request magic");

    // A write past the end: ENOSPC after its payload is drained; the
    // session stays in sync and serves the next request.
    let mut tls = tls_transmission(addr, &keys);
    tls.write_all(&request(Cmd::Write, 5, 16 << 20, 4096))
        .unwrap();
    tls.write_all(&[0xee; 4096]).unwrap();
    assert_eq!(simple_reply(&mut tls), (nbd::NBD_ENOSPC, 5));
    tls.write_all(&request(Cmd::Read, 6, 0, 4096)).unwrap();
    assert_eq!(simple_reply(&mut tls), (0, 6));
    let mut data = vec![0u8; 4096];
    tls.read_exact(&mut data).unwrap();
    drop(tls);

    // A connection flood that never finishes its TLS handshake: the good
    // client is still served while they hang.
    let stalled: Vec<TcpStream> = (0..64)
        .map(|_| {
            let mut sock = connect_raw(addr);
            read_greeting(&mut sock).expect("greeting");
            sock.write_all(&CLIENT_FLAGS.to_be_bytes()).unwrap();
            sock.write_all(&encode_option(nbd::NBD_OPT_STARTTLS, &[]))
                .unwrap();
            sock
        })
        .collect();
    assert_good_tls_client_works(addr, &keys, 1 << 20);
    drop(stalled);

    server.assert_healthy();
}

#[test]
fn a_client_that_stops_mid_tls_handshake_is_closed_at_the_handshake_deadline() {
    let scratch = Scratch::new("stall");
    let keys = psk(&scratch, "server", "alice", KEY_HEX);
    let mut server = Server::start(&["--volume", "vol0:16M", "--tls-psk", keys.to_str().unwrap()]);
    let mut sock = connect_raw(server.addr());
    read_greeting(&mut sock).expect("greeting");
    sock.write_all(&CLIENT_FLAGS.to_be_bytes()).unwrap();
    sock.write_all(&encode_option(nbd::NBD_OPT_STARTTLS, &[]))
        .unwrap();
    let (_, reply_type, _) = read_option_reply(&mut sock).expect("STARTTLS reply");
    assert_eq!(reply_type, nbd::NBD_REP_ACK);
    // Half a TLS record header, then silence.
    sock.write_all(&[0x16, 0x03]).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut buf = [0u8; 4096];
    let started = std::time::Instant::now();
    loop {
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => panic!(
                "the server kept a stalled TLS handshake open ({:?} after {:?}): {e}",
                e.kind(),
                started.elapsed()
            ),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(20));
    // The close carries no reason: the log line is the only one.
    server.assert_logged(&["handshake timed out"]);
    server.assert_healthy();
}

/// The rest of nbd_bad_input.rs's request cases inside TLS: unknown
/// commands and flags get EINVAL, over-long lengths are drained and
/// refused (or, past what can be drained, closed), and a client that
/// vanishes in the middle of a write payload writes nothing.
#[test]
fn bad_requests_inside_tls_get_the_same_answers() {
    let scratch = Scratch::new("badreq");
    let keys = psk(&scratch, "server", "alice", KEY_HEX);
    let mut server = Server::start(&["--volume", "vol0:64M", "--tls-psk", keys.to_str().unwrap()]);
    let addr = server.addr();
    let mut tls = tls_transmission(addr, &keys);
    let before = common::pattern(4, 4096);
    tls.write_all(&request(Cmd::Write, 1, 0, 4096)).unwrap();
    tls.write_all(&before).unwrap();
    assert_eq!(simple_reply(&mut tls), (0, 1));

    // An unknown command, a command lull does not advertise, and an
    // undefined flag on a read: EINVAL each, no data follows.
    tls.write_all(&request(Cmd::Unknown(0x55), 2, 0, 4096))
        .unwrap();
    assert_eq!(simple_reply(&mut tls), (nbd::NBD_EINVAL, 2));
    tls.write_all(&request(
        Cmd::Unknown(nbd::NBD_CMD_BLOCK_STATUS),
        3,
        0,
        4096,
    ))
    .unwrap();
    assert_eq!(simple_reply(&mut tls), (nbd::NBD_EINVAL, 3));
    let mut flagged = request(Cmd::Read, 4, 0, 4096);
    flagged[4..6].copy_from_slice(&(1u16 << 15).to_be_bytes());
    tls.write_all(&flagged).unwrap();
    assert_eq!(simple_reply(&mut tls), (nbd::NBD_EINVAL, 4));

    // A write 1 MiB past the maximum with its whole payload: drained,
    // then EINVAL; the volume is unchanged.
    let over = nbd::MAX_PAYLOAD_BYTES + (1 << 20);
    tls.write_all(&request(Cmd::Write, 5, 0, over)).unwrap();
    tls.write_all(&vec![0xee; over as usize]).unwrap();
    assert_eq!(simple_reply(&mut tls), (nbd::NBD_EINVAL, 5));
    // Reads one byte past the maximum and of zero length: EINVAL, no data.
    tls.write_all(&request(Cmd::Read, 6, 0, nbd::MAX_PAYLOAD_BYTES + 1))
        .unwrap();
    assert_eq!(simple_reply(&mut tls), (nbd::NBD_EINVAL, 6));
    tls.write_all(&request(Cmd::Read, 7, 0, 0)).unwrap();
    assert_eq!(simple_reply(&mut tls), (nbd::NBD_EINVAL, 7));
    // The session is still in sync.
    tls.write_all(&request(Cmd::Read, 8, 0, 4096)).unwrap();
    assert_eq!(simple_reply(&mut tls), (0, 8));
    let mut back = vec![0u8; 4096];
    tls.read_exact(&mut back).unwrap();
    assert!(back == before, "a refused write changed the volume");

    // A 4 GiB write cannot be drained: closed, with a log line.
    tls.write_all(&request(Cmd::Write, 9, 0, u32::MAX)).unwrap();
    let _ = tls.write_all(&[0xee; 4096]);
    wait_closed(&mut tls).expect("closed after a 4 GiB write");
    server.assert_logged(&["too large to drain"]);

    // Vanishing in the middle of a 1 MiB write payload writes nothing.
    let (offset, length) = (1u64 << 20, 1u32 << 20);
    let mut tls = tls_transmission(addr, &keys);
    tls.write_all(&request(Cmd::Write, 10, offset, length))
        .unwrap();
    tls.write_all(&[0xee; 1000]).unwrap();
    let peer = tls.get_ref().local_addr().expect("local address").port();
    drop(tls);
    // The server has seen the client go and closed its end: whatever it
    // did with the partial write is done before the read below.
    common::state::wait_server_closed(addr.port(), peer, common::IO_TIMEOUT);
    let mut tls = tls_transmission(addr, &keys);
    tls.write_all(&request(Cmd::Read, 11, offset, length))
        .unwrap();
    assert_eq!(simple_reply(&mut tls), (0, 11));
    let mut back = vec![0u8; length as usize];
    tls.read_exact(&mut back).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "a write without its full payload reached the volume"
    );
    drop(tls);
    assert_good_tls_client_works(addr, &keys, 4 << 20);
    server.assert_healthy();
}
