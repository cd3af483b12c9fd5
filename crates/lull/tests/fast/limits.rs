//! Configurable limits, each hit by a real client or a raw socket: the
//! server's connection cap (`--max-connections`) and the per-volume cap
//! (`--max-connections-per-volume`), refused in the handshake
//! (`NBD_REP_ERR_POLICY` to `NBD_OPT_GO`, a close for
//! `NBD_OPT_EXPORT_NAME`); and the per-volume in-flight cap
//! (`--max-in-flight-per-volume`), which holds requests back instead.
//! (NVMe/TCP I/O queues against the connection cap: tests/spdk/nvmf.rs.)

use std::io::Write;
use std::process::Command;

use crate::common::{self, require, NbdClient, Scratch, Server};
use lull_proto::nbd;

/// A raw handshake that sends `NBD_OPT_GO` for `export`; the first reply
/// that is not `NBD_REP_INFO`: (reply type, message).
fn go_reply(server: &Server, export: &str) -> (u32, String) {
    let mut sock = common::connect_raw(server.addr());
    common::read_greeting(&mut sock).expect("greeting");
    let mut hello = common::CLIENT_FLAGS.to_be_bytes().to_vec();
    hello.extend_from_slice(&common::encode_go(export));
    sock.write_all(&hello).expect("send GO");
    loop {
        let (option, reply_type, payload) = common::read_option_reply(&mut sock).expect("GO reply");
        assert_eq!(option, nbd::NBD_OPT_GO);
        if reply_type != nbd::NBD_REP_INFO {
            return (reply_type, String::from_utf8_lossy(&payload).into_owned());
        }
    }
}

#[test]
fn the_per_volume_cap_refuses_go_in_the_handshake_and_frees_on_disconnect() {
    let mut server = Server::start(&[
        "--volume",
        "a:1M",
        "--volume",
        "b:1M",
        "--max-connections-per-volume",
        "2",
    ]);
    let one = NbdClient::connect(server.addr(), "a").expect("first connection");
    let mut two = NbdClient::connect(server.addr(), "a").expect("second connection");
    let (reply, message) = go_reply(&server, "a");
    assert_eq!(reply, nbd::NBD_REP_ERR_POLICY, "the third GO: {message}");
    assert!(message.contains("maximum of 2 connections"), "{message}");
    // Another volume is not affected; nor are the admitted connections.
    let _b = NbdClient::connect(server.addr(), "b").expect("volume b");
    assert_eq!(two.write(0, &[9; 4096]).expect("write"), 0);
    // A real client is refused with a message, not a hang.
    common::require("qemu-io", "qemu-utils");
    let out = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "read 0 4k",
            &format!("nbd://{}/a", server.addr()),
        ])
        .output()
        .expect("run qemu-io");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !said.contains("read 4096/4096"),
        "qemu-io got through past the cap: {said}"
    );
    assert!(
        said.contains("maximum of 2 connections"),
        "qemu-io did not show why: {said}"
    );
    // A disconnect gives the place back.
    one.disconnect();
    let deadline = std::time::Instant::now() + common::IO_TIMEOUT;
    let mut three = loop {
        match NbdClient::connect(server.addr(), "a") {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the place never came back: {e}"
                );
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    };
    assert_eq!(
        three.read(0, 4096).expect("read").expect("status"),
        vec![9; 4096]
    );
    server.assert_healthy();
}

#[test]
fn the_per_volume_cap_closes_export_name() {
    let mut server = Server::start(&["--volume", "a:1M", "--max-connections-per-volume", "1"]);
    let _one = NbdClient::connect(server.addr(), "a").expect("first connection");
    let mut sock = common::connect_raw(server.addr());
    common::read_greeting(&mut sock).expect("greeting");
    let mut hello = common::CLIENT_FLAGS.to_be_bytes().to_vec();
    hello.extend_from_slice(&common::encode_option(nbd::NBD_OPT_EXPORT_NAME, b"a"));
    sock.write_all(&hello).expect("send EXPORT_NAME");
    common::assert_closed(&mut sock, "EXPORT_NAME past the per-volume cap");
    // EXPORT_NAME has no error reply: the close carries no reason, so the
    // log line is the only place an operator learns it.
    server.assert_logged(&["refused a connection", "maximum of connections"]);
    server.assert_healthy();
}

#[test]
fn the_server_connection_cap_closes_new_connections() {
    let mut server = Server::start(&["--volume", "a:1M", "--max-connections", "2"]);
    let _one = NbdClient::connect(server.addr(), "a").expect("first");
    let _two = NbdClient::connect(server.addr(), "a").expect("second");
    let mut third = common::connect_raw(server.addr());
    common::assert_closed(&mut third, "a connection past --max-connections");
    // Closed before the greeting: the log line is the only reason given.
    server.assert_logged(&["too many connections"]);
    server.assert_healthy();
}

#[test]
fn limits_out_of_range_are_refused_at_start() {
    for args in [
        ["--max-connections", "0"],
        ["--max-connections", "16385"],
        ["--max-connections-per-volume", "0"],
        ["--max-connections-per-volume", "16385"],
        ["--max-in-flight-per-volume", "0"],
        ["--max-in-flight-per-volume", "2097153"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_lull"))
            .arg("serve")
            .args(args)
            .output()
            .expect("run lull serve");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(&args[0][2..].replace('-', "_")),
            "{args:?}: {err}"
        );
    }
}

/// Two fio connections at depth 16 on a file volume (its requests stay in
/// the kernel a while) capped at 2 requests in flight for the whole volume,
/// in interrupt mode: the connections hold requests back (one of them often
/// with nothing of its own in flight, which only polling gets out of), and
/// every block still verifies; nothing is left counted at the end.
#[test]
fn the_per_volume_in_flight_cap_holds_requests_back_and_loses_none() {
    require("fio", "fio");
    let dir = Scratch::new("in-flight-cap");
    let spec = format!("vol:32M:file={}", dir.join("vol.img").display());
    let mut server = Server::start(&[
        "--volume",
        &spec,
        "--mode",
        "interrupt",
        "--max-in-flight-per-volume",
        "2",
    ]);
    let out = Command::new("fio")
        .args([
            "--name=cap",
            "--ioengine=nbd",
            &format!("--uri=nbd://{}/vol", server.addr()),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--numjobs=2",
            "--size=8M",
            "--offset_increment=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--output-format=json",
        ])
        .output()
        .expect("run fio");
    let json = common::fio_json(&out);
    let jobs = json["jobs"].as_array().expect("fio jobs");
    assert_eq!(jobs.len(), 2, "{json}");
    for job in jobs {
        assert_eq!(job["error"], 0, "fio error: {job}");
        assert!(
            job["read"]["total_ios"].as_u64().unwrap_or(0) >= 2048,
            "verify reads ran: {job}"
        );
    }
    // fio's connections are gone once the volume counts none.
    let mut stats = serde_json::Value::Null;
    common::wait_until(common::IO_TIMEOUT, || {
        stats = server.rpc("volume_get_stats", r#"{"name":"vol"}"#);
        stats["connections"] == 0
    });
    assert!(
        stats["in_flight_waits"].as_u64().unwrap_or(0) > 0,
        "the cap of 2 was never reached at depth 16: {stats}"
    );
    assert_eq!(stats["in_flight"], 0, "{stats}");
    assert_eq!(stats["connections"], 0, "{stats}");
    server.assert_healthy();
}
