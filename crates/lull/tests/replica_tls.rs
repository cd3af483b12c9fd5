//! Authenticated replica links (issue 12): real `lull replica` processes
//! and a real `lull serve` on loopback, the engine ↔ replica links over TLS
//! with a PSK or mutual certificates, qemu-io as the client. A replica
//! refuses an engine without its key (a wrong key, or plain links), an
//! engine refuses a replica it cannot authenticate, each with a log line,
//! and the volume goes on serving from the replicas that authenticated.
//!
//! ```text
//! cargo test -p lull --test replica_tls
//! ```
//!
//! Needs qemu-io (package qemu-utils) and, for certificates, the `openssl`
//! command (package openssl); scripts/test installs them.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{require, Scratch, Server};

const SIZE: &str = "64M";
/// How long a log line or a replica state may take to appear on a loaded
/// 2-core machine (reconnects are tried every 2 s).
const WAIT: Duration = Duration::from_secs(30);
/// How long a rebuild of the test volume may take.
const REBUILD_TIMEOUT: Duration = Duration::from_secs(120);

fn free_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr")
}

/// A fresh `username:hexkey` file.
fn psk_file(dir: &Path, name: &str, key_hex: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("lull:{key_hex}\n")).expect("write the PSK file");
    path
}

const KEY_HEX: &str = "2b7e151628aed2a6abf7158809cf4f3c8a1e0b2c3d4e5f60718293a4b5c6d7e8";
const WRONG_KEY_HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// A `lull replica` process, killed when dropped; its log appends to
/// `replica.log` in its directory across restarts.
struct Replica {
    child: Option<Child>,
    addr: SocketAddr,
    dir: PathBuf,
}

impl Replica {
    fn start(dir: &Path, link: &[&str]) -> Replica {
        let mut r = Replica {
            child: None,
            addr: free_port(),
            dir: dir.to_path_buf(),
        };
        std::fs::create_dir_all(dir).expect("replica dir");
        r.restart(link);
        r
    }

    /// (Re)start on the same address and data with the link flags `link`.
    fn restart(&mut self, link: &[&str]) {
        self.kill();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("replica log");
        let child = Command::new(env!("CARGO_BIN_EXE_lull"))
            .args([
                "replica",
                "--listen",
                &self.addr.to_string(),
                "--size",
                SIZE,
            ])
            .arg("--dir")
            .arg(self.dir.join("data"))
            .args(link)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn lull replica");
        self.child = Some(child);
        let deadline = Instant::now() + common::START_TIMEOUT;
        // A probe connection: the replica logs it (refused or timed out at
        // HELLO), which the tests below do not count on.
        while std::net::TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)).is_err() {
            assert!(
                Instant::now() < deadline,
                "replica on {} did not start; log:\n{}",
                self.addr,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("replica.log")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Waits for a log line holding every one of `needles`.
    fn assert_logged(&self, needles: &[&str]) {
        let deadline = Instant::now() + WAIT;
        loop {
            if self
                .log()
                .lines()
                .any(|l| needles.iter().all(|n| l.contains(n)))
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "replica {} never logged a line with {needles:?}; log:\n{}",
                self.addr,
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn count(&self, needle: &str) -> usize {
        self.log().matches(needle).count()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits for a server log line holding every one of `needles`.
fn assert_server_logged(server: &Server, needles: &[&str]) {
    let deadline = Instant::now() + WAIT;
    loop {
        if server
            .stderr()
            .lines()
            .any(|l| needles.iter().all(|n| l.contains(n)))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the server never logged a line with {needles:?}; log:\n{}",
            server.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `lull serve` with the replicated volume `v` on `replicas`, the link
/// flags `link` and an RPC socket in `dir`.
fn serve(dir: &Path, replicas: &[&Replica], link: &[&str]) -> (Server, PathBuf) {
    let sock = dir.join("rpc.sock");
    let list: Vec<String> = replicas.iter().map(|r| r.addr.to_string()).collect();
    let volume = format!("v:{SIZE}:replicas={}", list.join("+"));
    let mut args = vec!["--rpc-socket", sock.to_str().expect("utf-8 path")];
    args.extend_from_slice(link);
    args.extend(["--volume", &volume]);
    (Server::start(&args), sock)
}

/// Each replica's state as `replica_list` reports it.
fn replica_states(sock: &Path) -> Vec<(String, String)> {
    let json = common::rpc(sock, "replica_list", r#"{"volume": "v"}"#);
    json.as_array()
        .expect("a list of replicas")
        .iter()
        .map(|r| {
            (
                r["addr"].as_str().unwrap_or_default().to_string(),
                r["state"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

fn wait_state(sock: &Path, replica: &Replica, state: &str, timeout: Duration) {
    let addr = replica.addr.to_string();
    let deadline = Instant::now() + timeout;
    loop {
        let states = replica_states(sock);
        if states.iter().any(|(a, s)| *a == addr && s == state) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "replica {addr} never became {state}: {states:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
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
    let a = Replica::start(&scratch.join("a"), &["--tls-psk", key]);
    let b = Replica::start(&scratch.join("b"), &["--tls-psk", key]);
    a.assert_logged(&["replica links: TLS required"]);
    let (mut server, sock) = serve(&scratch, &[&a, &b], &["--replica-tls-psk", key]);
    server.assert_logged("replica links: TLS");
    wait_state(&sock, &a, "healthy", WAIT);
    wait_state(&sock, &b, "healthy", WAIT);
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
    for r in [&a, &b] {
        r.assert_logged(&["replica link authenticated (TLS)"]);
        assert_eq!(r.count("refusing connection"), 0, "{}", r.log());
    }
    // Both copies got the writes: the engine wrote them through TLS.
    for r in [&a, &b] {
        let data = std::fs::read(r.dir.join("data").join("data.img")).expect("data file");
        assert!(
            data[..4 << 20].iter().all(|&x| x == 0x5a),
            "replica {}",
            r.addr
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
    let a = Replica::start(&scratch.join("a"), &["--tls-psk", key]);
    let mut b = Replica::start(&scratch.join("b"), &["--tls-psk", key]);
    let (mut server, sock) = serve(&scratch, &[&a, &b], &["--replica-tls-psk", key]);
    wait_state(&sock, &a, "healthy", WAIT);
    wait_state(&sock, &b, "healthy", WAIT);
    assert_qemu_io_ok(&server, &["write -P 0x11 0 1M"]);

    // B comes back with another key: it refuses the engine, and the engine
    // fails it; the volume serves from A.
    b.restart(&["--tls-psk", wrong]);
    b.assert_logged(&["refusing connection", "not authenticated", "pre-shared key"]);
    let b_addr = b.addr.to_string();
    assert_server_logged(
        &server,
        &[
            &format!("replica {b_addr} failed"),
            "replica not authenticated",
        ],
    );
    wait_state(&sock, &b, "failed", WAIT);
    assert_qemu_io_ok(
        &server,
        &[
            "write -P 0x22 1M 1M",
            "read -P 0x11 0 1M",
            "read -P 0x22 1M 1M",
        ],
    );

    // B comes back with plain links: it refuses the engine's TLS
    // handshake, and the engine cannot authenticate it.
    let before = server.stderr().matches("replica not authenticated").count();
    b.restart(&["--insecure"]);
    b.assert_logged(&["replica links are not authenticated (--insecure)"]);
    b.assert_logged(&["refusing connection", "opens a TLS handshake"]);
    let deadline = Instant::now() + WAIT;
    while server.stderr().matches("replica not authenticated").count() == before {
        assert!(
            Instant::now() < deadline,
            "the engine never failed the plain replica; log:\n{}",
            server.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_state(&sock, &b, "failed", WAIT);
    assert_qemu_io_ok(&server, &["read -P 0x11 0 1M", "read -P 0x22 1M 1M"]);

    // An engine with plain links against A (which requires the key): A
    // refuses it before any frame, so it cannot take A over from the
    // running engine, which goes on serving.
    let plain_dir = scratch.join("plain-engine");
    std::fs::create_dir_all(&plain_dir).expect("dir");
    let (plain, _plain_sock) = serve(&plain_dir, &[&a], &["--replica-insecure"]);
    plain.assert_logged("replica links are not authenticated (--insecure)");
    a.assert_logged(&["refusing connection", "speaks plain replica protocol"]);
    assert_server_logged(
        &plain,
        &[
            &format!("replica {} failed", a.addr),
            "replica refused this engine: it requires TLS",
        ],
    );
    drop(plain);
    assert_qemu_io_ok(&server, &["write -P 0x33 2M 1M", "read -P 0x33 2M 1M"]);
    wait_state(&sock, &a, "healthy", WAIT);

    // B comes back with the right key: rebuilt over TLS, then healthy.
    b.restart(&["--tls-psk", key]);
    wait_state(&sock, &b, "healthy", REBUILD_TIMEOUT);
    // Without A, B alone serves everything the volume acknowledged.
    let mut a = a;
    a.kill();
    wait_state(&sock, &a, "failed", WAIT);
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
    let a = Replica::start(&scratch.join("a"), &["--tls-certs", pki]);
    let b = Replica::start(&scratch.join("b"), &["--tls-certs", pki]);
    let (mut server, sock) = serve(&scratch, &[&a, &b], &["--replica-tls-certs", pki]);
    wait_state(&sock, &a, "healthy", WAIT);
    wait_state(&sock, &b, "healthy", WAIT);
    assert_qemu_io_ok(
        &server,
        &["write -P 0x5a 0 4M", "read -P 0x5a 0 4M", "read -P 0 4M 1M"],
    );
    a.assert_logged(&["replica link authenticated (TLS)"]);
    server.assert_healthy();

    // Another CA on each side: the replica does not trust the engine's
    // certificate, nor the engine the replica's.
    let other = scratch.join("other-pki");
    common::make_pki(&other);
    let other = other.to_str().expect("utf-8 path");
    let stranger = Replica::start(&scratch.join("stranger"), &["--tls-certs", other]);
    let e_dir = scratch.join("engine-2");
    std::fs::create_dir_all(&e_dir).expect("dir");
    let (engine, _) = serve(&e_dir, &[&stranger], &["--replica-tls-certs", pki]);
    stranger.assert_logged(&["refusing connection", "not authenticated"]);
    assert_server_logged(
        &engine,
        &[
            &format!("replica {} failed", stranger.addr),
            "replica not authenticated",
            "certificate",
        ],
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
    let before = stranger.count("refusing connection");
    let e_dir = scratch.join("engine-3");
    std::fs::create_dir_all(&e_dir).expect("dir");
    let mixed = mixed.to_str().expect("utf-8 path");
    let (engine, _) = serve(&e_dir, &[&stranger], &["--replica-tls-certs", mixed]);
    let deadline = Instant::now() + WAIT;
    while stranger.count("refusing connection") == before {
        assert!(
            Instant::now() < deadline,
            "the stranger never refused the engine's certificate; log:\n{}",
            stranger.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_server_logged(
        &engine,
        &[
            &format!("replica {} failed", stranger.addr),
            "replica not authenticated",
            "alert",
        ],
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
