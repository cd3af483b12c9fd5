//! Authenticated replica links (issue 12): real `lull replica` processes
//! and a real `lull serve` on loopback, the engine ↔ replica links over TLS
//! with a PSK or mutual certificates, qemu-io as the client. A replica
//! refuses an engine without its key (a wrong key, or plain links) with a
//! log line (it has no RPC); an engine fails a replica it cannot
//! authenticate, which `replica_list` shows with the reason; and the volume
//! goes on serving from the replicas that authenticated.
//!
//! ```text
//! cargo test -p lull --profile ci --test replication replica_tls::
//! ```
//!
//! Needs qemu-io (package qemu-utils) and, for certificates, the `openssl`
//! command (package openssl); scripts/test installs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::common::{self, require, Kind, Replica, Scratch, Server};

const SIZE: &str = "64M";
/// How long a replica state (or a replica's log line) may take to appear
/// on a loaded 2-core machine (reconnects are tried every 2 s).
const WAIT: Duration = Duration::from_secs(30);
/// How long a rebuild of the test volume may take.
const REBUILD_TIMEOUT: Duration = Duration::from_secs(120);

/// A fresh `username:hexkey` file.
fn psk_file(dir: &Path, name: &str, key_hex: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("lull:{key_hex}\n")).expect("write the PSK file");
    path
}

const KEY_HEX: &str = "2b7e151628aed2a6abf7158809cf4f3c8a1e0b2c3d4e5f60718293a4b5c6d7e8";
const WRONG_KEY_HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// A `lull replica` process with the link flags `link`, in `dir`.
fn replica(dir: &Path, link: &[&str]) -> Replica {
    Replica::start_with(Kind::Process, dir, SIZE, link)
}

/// Waits for a line of the replica's log holding every one of `needles`:
/// the replica's own words, for what only it can say (its refusal of an
/// engine, its warning about plain links); it has no RPC.
fn assert_replica_logged(r: &Replica, needles: &[&str]) {
    assert!(
        common::wait_until(WAIT, || common::log_has(&r.log(), needles)),
        "replica {} never logged a line with {needles:?}; log:\n{}",
        r.addr(),
        r.log()
    );
}

/// Lines of the replica's log holding `needle`.
fn replica_log_count(r: &Replica, needle: &str) -> usize {
    r.log().matches(needle).count()
}

/// `lull serve` with the replicated volume `v` on `replicas` and the link
/// flags `link`.
fn serve(replicas: &[&Replica], link: &[&str]) -> Server {
    let list: Vec<String> = replicas.iter().map(|r| r.target()).collect();
    let volume = format!("v:{SIZE}:replicas={}", list.join("+"));
    let mut args = link.to_vec();
    args.extend(["--volume", &volume]);
    Server::start(&args)
}

/// Waits until the engine reports `replica` in `state`.
fn wait_state(server: &Server, replica: &Replica, state: &str, timeout: Duration) {
    server.wait_replica("v", &replica.target(), timeout, state, |r| r.is(state));
}

/// Waits until the engine has failed `replica` (more than `errors_before`
/// times) for a reason holding every one of `why`.
fn wait_failed(server: &Server, replica: &Replica, errors_before: u64, why: &[&str]) -> u64 {
    let r = server.wait_replica("v", &replica.target(), WAIT, "failed", |r| {
        r.errors > errors_before && r.failed_because(why)
    });
    r.errors
}

/// qemu-io commands against the volume over plain NBD.
fn qemu_io(server: &Server, cmds: &[&str]) -> Output {
    require("qemu-io", "qemu-utils");
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    cmd.arg(format!("nbd://{}/v", server.addr()));
    cmd.output().expect("run qemu-io")
}

fn assert_qemu_io_ok(server: &Server, cmds: &[&str]) {
    let out = qemu_io(server, cmds);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && !text.contains("fail")
            && !text.contains("Pattern verification")
            && !text.contains("error"),
        "qemu-io {cmds:?} failed: {text}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.stderr()
    );
}

#[test]
fn psk_links_carry_a_replicated_volume() {
    let scratch = Scratch::new("rtls-psk");
    let key = psk_file(&scratch, "replica.psk", KEY_HEX);
    let key = key.to_str().expect("utf-8 path");
    let a = replica(&scratch.join("a"), &["--tls-psk", key]);
    let b = replica(&scratch.join("b"), &["--tls-psk", key]);
    let mut server = serve(&[&a, &b], &["--replica-tls-psk", key]);
    // The replicas require TLS: healthy means the links authenticated.
    wait_state(&server, &a, "healthy", WAIT);
    wait_state(&server, &b, "healthy", WAIT);
    assert_qemu_io_ok(
        &server,
        &[
            "write -P 0x5a 0 4M",
            "write -P 0xa5 60M 1M",
            "read -P 0x5a 0 4M",
            "read -P 0xa5 60M 1M",
            "read -P 0 4M 1M",
        ],
    );
    // Never failed on the way.
    for r in server.replicas("v") {
        assert_eq!(r.errors, 0, "{r:?}");
    }
    // Both copies got the writes: the engine wrote them through TLS.
    for r in [&a, &b] {
        let data = std::fs::read(r.data_file()).expect("data file");
        assert!(
            data[..4 << 20].iter().all(|&x| x == 0x5a),
            "replica {}",
            r.addr()
        );
    }
    server.assert_healthy();
}

#[test]
fn unauthenticated_peers_are_refused_and_the_volume_serves_from_the_authenticated() {
    let scratch = Scratch::new("rtls-refuse");
    let key = psk_file(&scratch, "replica.psk", KEY_HEX);
    let key = key.to_str().expect("utf-8 path");
    let wrong = psk_file(&scratch, "wrong.psk", WRONG_KEY_HEX);
    let wrong = wrong.to_str().expect("utf-8 path");
    let a = replica(&scratch.join("a"), &["--tls-psk", key]);
    let mut b = replica(&scratch.join("b"), &["--tls-psk", key]);
    let mut server = serve(&[&a, &b], &["--replica-tls-psk", key]);
    wait_state(&server, &a, "healthy", WAIT);
    wait_state(&server, &b, "healthy", WAIT);
    assert_qemu_io_ok(&server, &["write -P 0x11 0 1M"]);

    // B comes back with another key: it refuses the engine (saying why in
    // its log), and the engine fails it; the volume serves from A.
    b.restart_with(&["--tls-psk", wrong]);
    assert_replica_logged(
        &b,
        &["refusing connection", "not authenticated", "pre-shared key"],
    );
    let errors = wait_failed(&server, &b, 0, &["replica not authenticated"]);
    wait_state(&server, &b, "failed", WAIT);
    assert_qemu_io_ok(
        &server,
        &[
            "write -P 0x22 1M 1M",
            "read -P 0x11 0 1M",
            "read -P 0x22 1M 1M",
        ],
    );

    // B comes back with plain links (warning its operator): it refuses the
    // engine's TLS handshake, and the engine cannot authenticate it.
    b.restart_with(&["--insecure"]);
    assert_replica_logged(&b, &["replica links are not authenticated (--insecure)"]);
    assert_replica_logged(&b, &["refusing connection", "opens a TLS handshake"]);
    wait_failed(&server, &b, errors, &["replica not authenticated"]);
    wait_state(&server, &b, "failed", WAIT);
    assert_qemu_io_ok(&server, &["read -P 0x11 0 1M", "read -P 0x22 1M 1M"]);

    // An engine with plain links against A (which requires the key): A
    // refuses it before any frame, so it cannot take A over from the
    // running engine, which goes on serving.
    let plain = serve(&[&a], &["--replica-insecure"]);
    // The warning an operator must see.
    plain.assert_logged(&["replica links are not authenticated (--insecure)"]);
    assert_replica_logged(
        &a,
        &["refusing connection", "speaks plain replica protocol"],
    );
    wait_failed(
        &plain,
        &a,
        0,
        &["replica refused this engine: it requires TLS"],
    );
    drop(plain);
    assert_qemu_io_ok(&server, &["write -P 0x33 2M 1M", "read -P 0x33 2M 1M"]);
    wait_state(&server, &a, "healthy", WAIT);

    // B comes back with the right key: rebuilt over TLS, then healthy.
    b.restart_with(&["--tls-psk", key]);
    wait_state(&server, &b, "healthy", REBUILD_TIMEOUT);
    // Without A, B alone serves everything the volume acknowledged.
    let mut a = a;
    a.kill();
    wait_state(&server, &a, "failed", WAIT);
    assert_qemu_io_ok(
        &server,
        &[
            "read -P 0x11 0 1M",
            "read -P 0x22 1M 1M",
            "read -P 0x33 2M 1M",
        ],
    );
    server.assert_healthy();
}

#[test]
fn certificate_links_are_mutual() {
    let scratch = Scratch::new("rtls-x509");
    let pki = scratch.join("pki");
    common::make_pki(&pki);
    let pki = pki.to_str().expect("utf-8 path");
    let a = replica(&scratch.join("a"), &["--tls-certs", pki]);
    let b = replica(&scratch.join("b"), &["--tls-certs", pki]);
    let mut server = serve(&[&a, &b], &["--replica-tls-certs", pki]);
    // The replicas require TLS: healthy means the links authenticated.
    wait_state(&server, &a, "healthy", WAIT);
    wait_state(&server, &b, "healthy", WAIT);
    assert_qemu_io_ok(
        &server,
        &["write -P 0x5a 0 4M", "read -P 0x5a 0 4M", "read -P 0 4M 1M"],
    );
    server.assert_healthy();

    // Another CA on each side: the replica does not trust the engine's
    // certificate, nor the engine the replica's.
    let other = scratch.join("other-pki");
    common::make_pki(&other);
    let other = other.to_str().expect("utf-8 path");
    let stranger = replica(&scratch.join("stranger"), &["--tls-certs", other]);
    let engine = serve(&[&stranger], &["--replica-tls-certs", pki]);
    assert_replica_logged(&stranger, &["refusing connection", "not authenticated"]);
    wait_failed(
        &engine,
        &stranger,
        0,
        &["replica not authenticated", "certificate"],
    );
    // The engine trusts the stranger's CA, but its own certificate is
    // signed by another: the stranger refuses it (with TLS 1.3, after the
    // engine's side of the handshake is over).
    let mixed = scratch.join("mixed-pki");
    std::fs::create_dir_all(&mixed).expect("dir");
    std::fs::copy(
        Path::new(other).join("ca-cert.pem"),
        mixed.join("ca-cert.pem"),
    )
    .expect("copy");
    for f in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(Path::new(pki).join(f), mixed.join(f)).expect("copy");
    }
    drop(engine);
    let before = replica_log_count(&stranger, "refusing connection");
    let mixed = mixed.to_str().expect("utf-8 path");
    let engine = serve(&[&stranger], &["--replica-tls-certs", mixed]);
    // The engine sees the stranger's alert; the stranger says why it
    // refused.
    wait_failed(
        &engine,
        &stranger,
        0,
        &["replica not authenticated", "alert"],
    );
    assert!(
        common::wait_until(WAIT, || replica_log_count(&stranger, "refusing connection")
            > before),
        "the stranger never refused the engine's certificate; log:\n{}",
        stranger.log()
    );
    drop(engine);

    // A directory without the CA cannot check engines: refused at start.
    let no_ca = scratch.join("no-ca");
    std::fs::create_dir_all(&no_ca).expect("dir");
    for f in ["server-cert.pem", "server-key.pem"] {
        std::fs::copy(Path::new(pki).join(f), no_ca.join(f)).expect("copy");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_lull"))
        .args([
            "replica",
            "--listen",
            "127.0.0.1:0",
            "--size",
            SIZE,
            "--tls-certs",
        ])
        .arg(&no_ca)
        .arg("--dir")
        .arg(scratch.join("no-ca-data"))
        .output()
        .expect("run lull replica");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("ca-cert.pem"), "{err}");
}

#[test]
fn a_link_choice_is_required() {
    let scratch = Scratch::new("rtls-flags");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_lull"))
            .args(args)
            .output()
            .expect("run lull");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let data = scratch.join("r");
    let data = data.to_str().expect("utf-8 path");
    let replica = [
        "replica",
        "--listen",
        "127.0.0.1:0",
        "--size",
        SIZE,
        "--dir",
        data,
    ];
    let (code, err) = run(&replica);
    assert_eq!(code, Some(2), "{err}");
    for flag in ["--tls-psk", "--tls-certs", "--insecure"] {
        assert!(err.contains(flag), "{flag} not named: {err}");
    }
    assert!(
        !Path::new(data).exists(),
        "nothing is created without a choice"
    );
    let (code, err) = run(&[&replica[..], &["--insecure", "--tls-psk", "k.psk"]].concat());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("only one"), "{err}");
    let (code, err) = run(&[&replica[..], &["--tls-psk", "/nonexistent/k.psk"]].concat());
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("/nonexistent/k.psk"), "{err}");

    let (code, err) = run(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--volume",
        "v:64M:replicas=127.0.0.1:9",
    ]);
    assert_eq!(code, Some(2), "{err}");
    for flag in [
        "--replica-tls-psk",
        "--replica-tls-certs",
        "--replica-insecure",
    ] {
        assert!(err.contains(flag), "{flag} not named: {err}");
    }

    // Without a choice at start, a replicated volume cannot be created
    // over RPC either.
    let sock = scratch.join("rpc.sock");
    let server = Server::start(&["--rpc-socket", sock.to_str().expect("utf-8 path")]);
    let out = Command::new(env!("CARGO_BIN_EXE_lull"))
        .args(["rpc", "-s"])
        .arg(&sock)
        .args([
            "volume_create",
            r#"{"name": "r", "size": "64M", "backend": "replicas=127.0.0.1:9"}"#,
        ])
        .output()
        .expect("run lull rpc");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--replica-tls-psk"), "{err}");
    drop(server);
}
