//! Bad input on the NBD socket (issue 3): each gets the protocol's answer
//! or a clean disconnect plus a log line saying why (the close itself says
//! nothing); never a panic, never an effect on other clients, never a write
//! outside the request.
//!
//! Every test starts its own `lull serve` on a kernel-chosen port, sends
//! one kind of bad input from a raw socket, checks the answer, then checks
//! that a well-behaved client still works and that the server neither died
//! nor logged a panic.
//!
//! ```text
//! cargo test -p lull --profile ci --test fast nbd_bad_input::
//! ```

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::common::{
    self, assert_closed, assert_good_client_works, connect_raw, encode_go, encode_option, pattern,
    read_greeting, read_option_reply, state, wait_closed, Closed, NbdClient, Server, CLIENT_FLAGS,
    IO_TIMEOUT,
};
use lull_proto::nbd::{self, Command};

const EXPORT: &str = "vol0";
const VOLUME_BYTES: u64 = 16 * 1024 * 1024;
const VOLUME_ARG: &str = "vol0:16M";

fn start() -> Server {
    Server::start(&["--volume", VOLUME_ARG])
}

/// A raw socket that has read the greeting and sent good client flags.
fn negotiating(server: &Server) -> TcpStream {
    let mut sock = connect_raw(server.addr());
    read_greeting(&mut sock).expect("greeting");
    sock.write_all(&CLIENT_FLAGS.to_be_bytes())
        .expect("client flags");
    sock
}

fn client(server: &Server) -> NbdClient {
    NbdClient::connect(server.addr(), EXPORT).expect("handshake")
}

/// Reads option replies until the server closes; returns them as
/// `(option, reply type)`.
fn replies_until_closed(sock: &mut TcpStream) -> Vec<(u32, u32)> {
    let mut replies = Vec::new();
    loop {
        match read_option_reply(sock) {
            Ok((option, reply_type, _)) => replies.push((option, reply_type)),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                return replies;
            }
            Err(e) => panic!(
                "expected option replies then a close, got {e} after {} replies",
                replies.len()
            ),
        }
    }
}

#[test]
fn garbage_instead_of_client_flags_closes() {
    let mut server = start();

    // An HTTP client on the NBD port, after reading the greeting.
    let mut sock = connect_raw(server.addr());
    read_greeting(&mut sock).expect("greeting");
    sock.write_all(b"GET / HTTP/1.1\r\nHost: lull\r\n\r\n")
        .expect("send garbage");
    assert_closed(&mut sock, "garbage client flags");

    // The same garbage sent before the greeting was even read: the
    // greeting (and nothing else) arrives, then the close.
    let mut sock = connect_raw(server.addr());
    sock.write_all(&[0xa5; 100]).expect("send garbage");
    match wait_closed(&mut sock) {
        Ok(Closed::Eof(n)) => assert_eq!(n, nbd::SERVER_GREETING_LEN, "bytes before the close"),
        Ok(Closed::Reset(n)) => {
            assert!(n <= nbd::SERVER_GREETING_LEN, "{n} bytes before the reset")
        }
        Err(e) => panic!("garbage before the greeting: the server did not close: {e}"),
    }

    // Well-formed flags without FIXED_NEWSTYLE (oldstyle-only client).
    let mut sock = connect_raw(server.addr());
    read_greeting(&mut sock).expect("greeting");
    sock.write_all(&0u32.to_be_bytes()).expect("send flags");
    assert_closed(&mut sock, "client flags without FIXED_NEWSTYLE");

    server.assert_logged(&["bad handshake", "set bits this server did not offer"]);
    server.assert_logged(&["bad handshake", "lack NBD_FLAG_C_FIXED_NEWSTYLE"]);
    assert_good_client_works(server.addr(), EXPORT, 0);
    server.assert_healthy();
}

#[test]
fn garbage_after_a_valid_option_and_bad_option_magic_close() {
    let mut server = start();

    // A valid NBD_OPT_LIST is answered, then the garbage ends the session.
    let mut sock = negotiating(&server);
    let mut bytes = encode_option(nbd::NBD_OPT_LIST, &[]);
    bytes.extend_from_slice(&[0x5a; 32]);
    sock.write_all(&bytes).expect("send");
    let replies = replies_until_closed(&mut sock);
    assert_eq!(
        replies,
        vec![
            (nbd::NBD_OPT_LIST, nbd::NBD_REP_SERVER),
            (nbd::NBD_OPT_LIST, nbd::NBD_REP_ACK)
        ],
        "the valid option is answered before the close"
    );

    // The first option has the wrong magic (the oldstyle magic here).
    let mut sock = negotiating(&server);
    let mut bytes = nbd::NBD_CLISERV_MAGIC.to_be_bytes().to_vec();
    bytes.extend_from_slice(&nbd::NBD_OPT_GO.to_be_bytes());
    bytes.extend_from_slice(&0u32.to_be_bytes());
    sock.write_all(&bytes).expect("send");
    assert_eq!(
        replies_until_closed(&mut sock),
        vec![],
        "no reply to a bad option magic"
    );

    // Garbage in the middle of a GO: a valid header whose payload lies
    // about its lengths gets an error reply, and the session goes on.
    let mut sock = negotiating(&server);
    let mut payload = 1000u32.to_be_bytes().to_vec();
    payload.extend_from_slice(b"vol0");
    sock.write_all(&encode_option(nbd::NBD_OPT_GO, &payload))
        .expect("send");
    let (option, reply_type, _) = read_option_reply(&mut sock).expect("reply to a malformed GO");
    assert_eq!(
        (option, reply_type),
        (nbd::NBD_OPT_GO, nbd::NBD_REP_ERR_INVALID)
    );
    sock.write_all(&encode_go(EXPORT)).expect("send a good GO");
    loop {
        let (option, reply_type, _) = read_option_reply(&mut sock).expect("reply to the good GO");
        assert_eq!(option, nbd::NBD_OPT_GO);
        match reply_type {
            nbd::NBD_REP_INFO => continue,
            nbd::NBD_REP_ACK => break,
            other => panic!("good GO after a malformed one refused: {other:#x}"),
        }
    }

    server.assert_logged(&["bad handshake", "is not IHAVEOPT"]);
    assert_good_client_works(server.addr(), EXPORT, 4096);
    server.assert_healthy();
}

#[test]
fn option_longer_than_its_limit_closes_before_the_payload() {
    let mut server = start();

    // Header only: 1 MiB announced, nothing sent. The server must refuse
    // on the header, not wait for (or buffer) the payload.
    let mut sock = negotiating(&server);
    let mut bytes = nbd::IHAVEOPT.to_be_bytes().to_vec();
    bytes.extend_from_slice(&nbd::NBD_OPT_GO.to_be_bytes());
    bytes.extend_from_slice(&(1u32 << 20).to_be_bytes());
    sock.write_all(&bytes).expect("send");
    assert_eq!(
        replies_until_closed(&mut sock),
        vec![],
        "no reply to an over-long option"
    );

    // One byte over the limit, payload included.
    let mut sock = negotiating(&server);
    let payload = vec![0u8; nbd::MAX_OPTION_LEN as usize + 1];
    let _ = sock.write_all(&encode_option(nbd::NBD_OPT_LIST, &payload));
    assert_closed(&mut sock, "option one byte over MAX_OPTION_LEN");

    // The largest length u32 can hold.
    let mut sock = negotiating(&server);
    let mut bytes = nbd::IHAVEOPT.to_be_bytes().to_vec();
    bytes.extend_from_slice(&nbd::NBD_OPT_INFO.to_be_bytes());
    bytes.extend_from_slice(&u32::MAX.to_be_bytes());
    sock.write_all(&bytes).expect("send");
    assert_closed(&mut sock, "option of 4 GiB");

    server.assert_logged(&["bad handshake", "more than the"]);
    assert_good_client_works(server.addr(), EXPORT, 8192);
    server.assert_healthy();
}

#[test]
fn too_many_options_close_after_the_limit() {
    let mut server = start();

    let mut sock = negotiating(&server);
    let bytes: Vec<u8> = (0..100)
        .flat_map(|_| encode_option(nbd::NBD_OPT_LIST, &[]))
        .collect();
    sock.write_all(&bytes).expect("send 100 options");
    let replies = replies_until_closed(&mut sock);
    let acks = replies
        .iter()
        .filter(|(_, t)| *t == nbd::NBD_REP_ACK)
        .count();
    assert_eq!(
        acks,
        nbd::MAX_OPTIONS as usize,
        "NBD_OPT_LIST answered before the close"
    );

    // Unknown options count too.
    let mut sock = negotiating(&server);
    let bytes: Vec<u8> = (0..100)
        .flat_map(|i| encode_option(0x1000 + i, b"junk"))
        .collect();
    sock.write_all(&bytes).expect("send 100 unknown options");
    let replies = replies_until_closed(&mut sock);
    assert_eq!(
        replies.len(),
        nbd::MAX_OPTIONS as usize,
        "unknown options answered before the close"
    );
    assert!(
        replies.iter().all(|(_, t)| *t == nbd::NBD_REP_ERR_UNSUP),
        "{replies:?}"
    );

    server.assert_logged(&["bad handshake", "client sent more than 32 options"]);
    assert_good_client_works(server.addr(), EXPORT, 0);
    server.assert_healthy();
}

#[test]
fn request_past_the_end_is_refused_and_the_connection_stays_usable() {
    let mut server = start();
    let mut c = client(&server);
    assert_eq!(c.size_bytes, VOLUME_BYTES);
    let tail = VOLUME_BYTES - 4096;
    let tail_data = pattern(1, 4096);
    assert_eq!(c.write(tail, &tail_data).expect("write"), nbd::NBD_SUCCESS);

    // Read past the end: EINVAL, and the next read on the connection works.
    assert_eq!(
        c.read(VOLUME_BYTES - 512, 4096).expect("read"),
        Err(nbd::NBD_EINVAL)
    );
    assert_eq!(c.read(VOLUME_BYTES, 1).expect("read"), Err(nbd::NBD_EINVAL));
    // offset + length overflows u64.
    assert_eq!(
        c.read(u64::MAX - 100, 4096).expect("read"),
        Err(nbd::NBD_EINVAL)
    );
    assert_eq!(c.read(tail, 4096).expect("read"), Ok(tail_data.clone()));

    // Write past the end: ENOSPC (the spec's answer) after the payload is
    // drained; nothing of it lands in the last valid bytes.
    let junk = vec![0xee; 4096];
    assert_eq!(
        c.write(VOLUME_BYTES - 512, &junk).expect("write"),
        nbd::NBD_ENOSPC
    );
    assert_eq!(
        c.write(VOLUME_BYTES, &junk[..512]).expect("write"),
        nbd::NBD_ENOSPC
    );
    let cookie = c
        .send(Command::Write, 0, u64::MAX - 100, 4096, &junk)
        .expect("send");
    assert_eq!(
        c.reply_to(cookie).expect("reply"),
        nbd::NBD_ENOSPC,
        "write whose end overflows u64"
    );
    assert_eq!(
        c.read(tail, 4096).expect("read"),
        Ok(tail_data),
        "a refused write changed the volume"
    );

    // The same connection still writes and reads.
    let data = pattern(2, 4096);
    assert_eq!(c.write(4096, &data).expect("write"), nbd::NBD_SUCCESS);
    assert_eq!(c.read(4096, 4096).expect("read"), Ok(data));
    c.disconnect();
    server.assert_healthy();
}

#[test]
fn unknown_command_gets_einval() {
    let mut server = start();
    let mut c = client(&server);

    let cookie = c
        .send(Command::Unknown(0x55), 0, 0, 4096, &[])
        .expect("send");
    assert_eq!(c.reply_to(cookie).expect("reply"), nbd::NBD_EINVAL);
    // Commands lull does not advertise are unknown to it as well.
    let cookie = c
        .send(Command::Unknown(nbd::NBD_CMD_BLOCK_STATUS), 0, 0, 4096, &[])
        .expect("send");
    assert_eq!(c.reply_to(cookie).expect("reply"), nbd::NBD_EINVAL);
    // A flag nobody defined, on a valid command.
    let cookie = c.send(Command::Read, 1 << 15, 0, 4096, &[]).expect("send");
    assert_eq!(c.reply_to(cookie).expect("reply"), nbd::NBD_EINVAL);

    let data = pattern(3, 4096);
    assert_eq!(c.write(0, &data).expect("write"), nbd::NBD_SUCCESS);
    assert_eq!(c.read(0, 4096).expect("read"), Ok(data));
    c.disconnect();
    server.assert_healthy();
}

#[test]
fn length_over_the_maximum_is_refused_or_disconnects() {
    let mut server = start();
    let mut c = client(&server);
    let before = pattern(4, 4096);
    assert_eq!(c.write(0, &before).expect("write"), nbd::NBD_SUCCESS);

    // 33 MiB write with its whole payload: drained, then EINVAL.
    let over = nbd::MAX_PAYLOAD_BYTES + (1 << 20);
    let junk = vec![0xee; over as usize];
    assert_eq!(
        c.write(0, &junk).expect("write"),
        nbd::NBD_EINVAL,
        "33 MiB write"
    );
    drop(junk);
    assert_eq!(
        c.read(0, 4096).expect("read"),
        Ok(before),
        "a refused write changed the volume"
    );

    // 64 MiB read: EINVAL, no data follows.
    assert_eq!(
        c.read(0, 64 << 20).expect("read"),
        Err(nbd::NBD_EINVAL),
        "64 MiB read"
    );
    // Zero-length read.
    assert_eq!(
        c.read(0, 0).expect("read"),
        Err(nbd::NBD_EINVAL),
        "zero-length read"
    );

    // Still usable.
    let data = pattern(5, 4096);
    assert_eq!(c.write(8192, &data).expect("write"), nbd::NBD_SUCCESS);
    assert_eq!(c.read(8192, 4096).expect("read"), Ok(data));

    // A 4 GiB write cannot be drained: the server disconnects.
    c.send(Command::Write, 0, 0, u32::MAX, &[0xee; 4096])
        .expect("send");
    assert_closed(&mut c.sock, "4 GiB write");

    server.assert_logged(&["too large to drain"]);
    assert_good_client_works(server.addr(), EXPORT, 0);
    server.assert_healthy();
}

#[test]
fn bad_request_magic_disconnects() {
    let mut server = start();

    let mut c = client(&server);
    let data = pattern(6, 4096);
    assert_eq!(c.write(0, &data).expect("write"), nbd::NBD_SUCCESS);
    let mut header = nbd::encode_request(&nbd::Request {
        flags: 0,
        command: Command::Write,
        cookie: 99,
        offset: 0,
        length: 4096,
    });
    header[..4].copy_from_slice(&0xdead_beef_u32.to_be_bytes());
    c.sock.write_all(&header).expect("send");
    let _ = c.sock.write_all(&[0xee; 4096]);
    assert_closed(&mut c.sock, "bad request magic");

    // Extended headers were not negotiated: their magic is just as bad.
    let mut c = client(&server);
    let mut header = nbd::encode_request(&nbd::Request {
        flags: 0,
        command: Command::Read,
        cookie: 100,
        offset: 0,
        length: 4096,
    });
    header[..4].copy_from_slice(&nbd::NBD_EXTENDED_REQUEST_MAGIC.to_be_bytes());
    c.sock.write_all(&header).expect("send");
    assert_closed(&mut c.sock, "extended request magic");

    server.assert_logged(&["bad request header"]);
    let mut c = client(&server);
    assert_eq!(
        c.read(0, 4096).expect("read"),
        Ok(data),
        "the write after the bad header landed"
    );
    c.disconnect();
    assert_good_client_works(server.addr(), EXPORT, 4096);
    server.assert_healthy();
}

#[test]
fn client_vanishing_mid_write_writes_nothing() {
    let mut server = start();
    let offset = 1 << 20;
    let length = 1u32 << 20;

    let mut c = client(&server);
    let peer = c.sock.local_addr().expect("local address").port();
    c.send(Command::Write, 0, offset, length, &[0xee; 1000])
        .expect("send a partial write");
    drop(c);
    // The server has seen the client go and closed its end: whatever it
    // did with the partial write is done before the read below.
    state::wait_server_closed(server.addr().port(), peer, IO_TIMEOUT);

    // Vanishing in the middle of a request header is harmless too.
    let mut c = client(&server);
    let header = nbd::encode_request(&nbd::Request {
        flags: 0,
        command: Command::Write,
        cookie: 1,
        offset,
        length,
    });
    c.sock.write_all(&header[..10]).expect("send half a header");
    drop(c);

    let mut c = client(&server);
    let back = c
        .read(offset, length)
        .expect("read")
        .expect("read the target range");
    assert!(
        back.iter().all(|&b| b == 0),
        "a write without its full payload reached the volume"
    );
    c.disconnect();

    assert_good_client_works(server.addr(), EXPORT, 0);
    server.assert_healthy();
}

#[test]
fn flood_of_silent_connections_does_not_block_a_good_client() {
    let mut server = start();
    let silent: Vec<TcpStream> = (0..200).map(|_| connect_raw(server.addr())).collect();

    assert_good_client_works(server.addr(), EXPORT, 0);

    // The silent ones were served a greeting, not ignored.
    for mut sock in silent.into_iter().step_by(50) {
        sock.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
        let mut greeting = [0u8; nbd::SERVER_GREETING_LEN];
        sock.read_exact(&mut greeting)
            .expect("a silent connection gets the greeting");
    }
    assert_good_client_works(server.addr(), EXPORT, 4096);
    server.assert_healthy();
}

/// One round of misbehaviour, chosen by `round`; each is refused the way
/// the other tests check in detail.
fn misbehave(server: &Server, round: usize) {
    match round % 6 {
        0 => {
            let mut sock = connect_raw(server.addr());
            read_greeting(&mut sock).expect("greeting");
            sock.write_all(b"GET / HTTP/1.1\r\n\r\n").expect("send");
            assert_closed(&mut sock, "garbage flags");
        }
        1 => {
            let mut sock = negotiating(server);
            sock.write_all(&[0x5a; 16]).expect("send");
            assert_closed(&mut sock, "bad option magic");
        }
        2 => {
            let mut sock = negotiating(server);
            let bytes: Vec<u8> = (0..40)
                .flat_map(|_| encode_option(nbd::NBD_OPT_LIST, &[]))
                .collect();
            sock.write_all(&bytes).expect("send");
            assert_closed(&mut sock, "too many options");
        }
        3 => {
            let mut c = client(server);
            let cookie = c
                .send(Command::Write, 0, VOLUME_BYTES - 512, 4096, &[0xee; 4096])
                .expect("send");
            assert_eq!(c.reply_to(cookie).expect("reply"), nbd::NBD_ENOSPC);
            c.sock.write_all(&[0x77; 28]).expect("send");
            assert_closed(&mut c.sock, "bad request magic");
        }
        4 => {
            let mut c = client(server);
            c.send(Command::Write, 0, 0, 1 << 20, &[0xee; 1000])
                .expect("send");
        }
        _ => {
            let mut c = client(server);
            let cookie = c
                .send(Command::Unknown(0x55), 0, 0, 4096, &[])
                .expect("send");
            assert_eq!(c.reply_to(cookie).expect("reply"), nbd::NBD_EINVAL);
            c.send(Command::Write, 0, 0, u32::MAX, &[]).expect("send");
            assert_closed(&mut c.sock, "4 GiB write");
        }
    }
}

#[test]
fn misbehaving_client_does_not_disturb_a_good_one() {
    let mut server = Server::start(&["--volume", VOLUME_ARG, "--cores", "0-1"]);
    let good_finished = Arc::new(AtomicBool::new(false));
    let good_done = good_finished.clone();
    let addr = server.addr();

    std::thread::scope(|scope| {
        let good = scope.spawn(move || {
            let result = std::panic::catch_unwind(|| {
                let mut c = NbdClient::connect(addr, EXPORT).expect("handshake");
                // Above the ranges the misbehaving rounds touch.
                let base = 4 << 20;
                for round in 0..100u64 {
                    let offset = base + (round % 16) * 65536;
                    let data = pattern(100 + round, 65536);
                    assert_eq!(
                        c.write(offset, &data).expect("write"),
                        nbd::NBD_SUCCESS,
                        "round {round}"
                    );
                    let back = c.read(offset, 65536).expect("read").expect("read error");
                    assert!(back == data, "round {round}: read back different data");
                }
                c.disconnect();
            });
            good_done.store(true, Ordering::SeqCst);
            if let Err(panic) = result {
                std::panic::resume_unwind(panic);
            }
        });
        let mut round = 0;
        while !good_finished.load(Ordering::SeqCst) && round < 300 {
            misbehave(&server, round);
            round += 1;
        }
        good.join().expect("the good client saw an error");
        assert!(round > 0, "no misbehaviour ran alongside the good client");
    });

    // Every misbehaving write was refused or cut short: none reached the
    // volume (they aimed at the first MiB and at the last 512 bytes). The
    // server has closed every misbehaving connection before the reads.
    state::wait_no_connections(server.addr().port(), IO_TIMEOUT);
    let mut c = client(&server);
    let head = c
        .read(0, 1 << 20)
        .expect("read")
        .expect("read the first MiB");
    assert!(
        head.iter().all(|&b| b == 0),
        "a refused or partial write reached the first MiB"
    );
    let tail = c
        .read(VOLUME_BYTES - 4096, 4096)
        .expect("read")
        .expect("read the tail");
    assert!(
        tail.iter().all(|&b| b == 0),
        "a write past the end reached the last bytes"
    );
    c.disconnect();
    assert_good_client_works(server.addr(), EXPORT, 0);
    server.assert_healthy();
}

/// Out of file descriptors: the limit is lowered under the running server
/// (`prlimit`) to the descriptors it already holds, so every new connection
/// fails at accept. Connections are then closed at once with a log line,
/// the server does not spin on its readable listener, and once the limit
/// is raised again a normal client works.
#[test]
fn out_of_file_descriptors_closes_new_connections_without_spinning() {
    const FLOOD: usize = 40;
    let found = std::process::Command::new("sh")
        .arg("-c")
        .arg("command -v prlimit")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "prlimit is not installed: install the `util-linux` package"
    );
    let mut server = start();
    let pid = server.pid().to_string();
    // The soft limit only: lowering the hard one could not be undone
    // without CAP_SYS_RESOURCE.
    let prlimit = |n: usize| {
        let st = std::process::Command::new("prlimit")
            .args(["--pid", &pid, &format!("--nofile={n}:")])
            .status()
            .expect("run prlimit");
        assert!(st.success(), "prlimit --nofile={n}: failed");
    };
    let limits =
        std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("read /proc/PID/limits");
    let soft: usize = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok())
        .expect("Max open files in /proc/PID/limits");
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("list /proc/PID/fd")
        .count();
    prlimit(open);
    let mut flood = Vec::with_capacity(FLOOD);
    for _ in 0..FLOOD {
        flood.push(connect_raw(server.addr()));
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let before = common::process_cpu_ticks(server.pid());
    std::thread::sleep(std::time::Duration::from_secs(2));
    let used = common::process_cpu_ticks(server.pid()) - before;
    // A reactor spinning on the readable listener burns ~200 ticks here.
    assert!(
        used < 40,
        "the server used {used} ticks of CPU in 2 s while out of descriptors"
    );
    // Each one is closed at once, or served if descriptors freed up in the
    // meantime (the threads of earlier connections may still be exiting
    // when the limit is read): never left hanging.
    let mut shed = 0;
    for s in flood.iter_mut() {
        match read_greeting(s) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                shed += 1
            }
            Err(e) => {
                panic!("a connection past the descriptor limit was neither closed nor served: {e}")
            }
        }
    }
    assert!(
        shed >= FLOOD / 2,
        "only {shed} of {FLOOD} connections past the limit were closed"
    );
    drop(flood);
    // The warning an operator must see (and act on).
    server.assert_logged(&["out of file descriptors"]);
    prlimit(soft);
    assert_good_client_works(server.addr(), EXPORT, 0);
    server.assert_healthy();
}
