//! Replicated volumes end to end: real replicas and a real `lull serve`
//! on loopback, real clients (fio's nbd engine, the NBD test client),
//! replicas and engines killed with SIGKILL mid-run. The tests wait on
//! what the engine reports (`replica_list`: each replica's state, its
//! error count and last error) and check the data files themselves.
//!
//! ```text
//! cargo test -p lull --profile ci --test replication replication::
//! ```
//!
//! Needs `fio` (package `fio`). The server is started with
//! `--volume NAME:SIZE:replicas=T+T`. A replica ([`common::Replica`]) is
//! either a `lull replica` process (target `ADDR`) or a replica named "r"
//! in a `lull serve --store` daemon (target `ADDR/r`): the failover and
//! crash tests run on both kinds (the `_on_store_replicas` tests), those
//! that inject faults on processes only.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::state::{all_healthy, none_healthy};
use crate::common::{self, require, Kind, NbdClient, Replica, Server};
use lull_proto::nbd::Command as NbdCommand;

/// How long a rebuild of a test volume may take on a loaded 2-core box.
const REBUILD_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the volume may take to have a healthy replica after start.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the engine may take to fail a replica that died or misbehaves
/// (a broken connection at once; a silent one at its timeout).
const FAIL_TIMEOUT: Duration = Duration::from_secs(20);
const VOLUME: &str = "64M";
const VOLUME_BYTES: u64 = 64 << 20;

/// Where a test's replica of `kind` lives: the two kinds of one test run
/// side by side.
fn dir_of(kind: Kind, name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "lull-repl-{}-{name}-{}",
        std::process::id(),
        kind.tag()
    ))
}

/// A replica of `kind` for a test volume, in its [`dir_of`].
fn replica(kind: Kind, name: &str) -> Replica {
    Replica::start(kind, &dir_of(kind, name), VOLUME)
}

/// `lull serve` with these replicated volumes (its own RPC socket, as
/// every test server has).
fn serve(volumes: &[String]) -> Server {
    let mut args = vec!["--replica-insecure"];
    for v in volumes {
        args.extend(["--volume", v.as_str()]);
    }
    Server::start(&args)
}

/// `NAME:SIZE:replicas=T+T` for these replicas (their [`Replica::target`]).
fn spec(name: &str, replicas: &[&Replica]) -> String {
    let targets: Vec<String> = replicas.iter().map(|r| r.target()).collect();
    spec_of(name, &targets)
}

/// `NAME:SIZE:replicas=T+T` for targets as the engine spells them.
fn spec_of(name: &str, targets: &[String]) -> String {
    format!("{name}:{VOLUME}:replicas={}", targets.join("+"))
}

/// Retry a read until the volume answers (it may still be electing).
fn read_when_ready(server: &Server, export: &str, offset: u64, len: u32) -> Vec<u8> {
    common::read_when_ready(server, export, offset, len, READY_TIMEOUT)
}

fn flush(c: &mut NbdClient) -> u32 {
    let cookie = c.send(NbdCommand::Flush, 0, 0, 0, &[]).expect("send flush");
    c.reply_to(cookie).expect("flush reply")
}

fn files_equal(a: &Path, b: &Path, len: u64) -> Result<(), String> {
    let mut fa = std::fs::File::open(a).map_err(|e| format!("{}: {e}", a.display()))?;
    let mut fb = std::fs::File::open(b).map_err(|e| format!("{}: {e}", b.display()))?;
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    let mut off = 0u64;
    while off < len {
        let n = ((len - off) as usize).min(ba.len());
        fa.read_exact(&mut ba[..n])
            .map_err(|e| format!("read {}: {e}", a.display()))?;
        fb.read_exact(&mut bb[..n])
            .map_err(|e| format!("read {}: {e}", b.display()))?;
        if ba[..n] != bb[..n] {
            let i = ba[..n]
                .iter()
                .zip(&bb[..n])
                .position(|(x, y)| x != y)
                .unwrap_or(0);
            return Err(format!("replicas differ at byte {}", off + i as u64));
        }
        off += n as u64;
    }
    Ok(())
}

// Each body in `failover` runs twice: on `lull replica` processes, and
// on replicas in store daemons (`_on_store_replicas`).
#[test]
fn fio_survives_a_killed_replica_and_rebuild_converges() {
    failover::fio_survives_a_killed_replica_and_rebuild_converges(Kind::Process);
}

#[test]
fn fio_survives_a_killed_replica_and_rebuild_converges_on_store_replicas() {
    failover::fio_survives_a_killed_replica_and_rebuild_converges(Kind::Store);
}

#[test]
fn all_replicas_down_is_eio_then_flushed_data_is_back() {
    failover::all_replicas_down_is_eio_then_flushed_data_is_back(Kind::Process);
}

#[test]
fn all_replicas_down_is_eio_then_flushed_data_is_back_on_store_replicas() {
    failover::all_replicas_down_is_eio_then_flushed_data_is_back(Kind::Store);
}

#[test]
fn restart_waits_for_the_replica_with_the_newest_writes() {
    failover::restart_waits_for_the_replica_with_the_newest_writes(Kind::Process);
}

#[test]
fn restart_waits_for_the_replica_with_the_newest_writes_on_store_replicas() {
    failover::restart_waits_for_the_replica_with_the_newest_writes(Kind::Store);
}

/// Replicas killed and restarted under a running engine.
mod failover {
    use super::*;

    pub(super) fn fio_survives_a_killed_replica_and_rebuild_converges(kind: Kind) {
        require("fio", "fio");
        let mut ra = replica(kind, "kill-a");
        let mut rb = replica(kind, "kill-b");
        let server = serve(&[spec("vol0", &[&ra, &rb])]);
        let _ = read_when_ready(&server, "vol0", 0, 4096);

        let fio = Command::new("fio")
            .args([
                "--name=kill",
                "--ioengine=nbd",
                &format!("--uri=nbd://{}/vol0", server.addr()),
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=32",
                "--verify=crc32c",
                "--size=64M",
                "--do_verify=1",
                "--verify_fatal=1",
                "--verify_state_save=0",
                "--loops=3",
                "--output-format=terse",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn fio");
        let mut fio = fio;
        std::thread::sleep(Duration::from_secs(1));
        assert!(
            fio.try_wait().expect("fio status").is_none(),
            "fio finished before the replica was killed"
        );
        rb.kill();
        let out = fio.wait_with_output().expect("fio output");
        assert!(
            out.status.success(),
            "fio failed with a replica killed: {}\n{}\nserver log:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            server.stderr()
        );
        server.wait_replica(
            "vol0",
            &rb.target(),
            FAIL_TIMEOUT,
            "the kill noticed",
            |r| r.errors >= 1,
        );

        // Back, it is rebuilt: healthy again only once the copy is done.
        rb.restart();
        server.wait_replicas("vol0", REBUILD_TIMEOUT, "the rebuild done", all_healthy);
        // Quiesce: a flush makes every replica durable and nothing is in
        // flight. fio wrote on without B, so equal files mean B was
        // rebuilt.
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        assert_eq!(flush(&mut c), 0);
        c.disconnect();
        if let Err(e) = files_equal(&ra.data_file(), &rb.data_file(), VOLUME_BYTES) {
            panic!("{e}; server log:\n{}", server.stderr());
        }
        ra.kill();
    }

    pub(super) fn all_replicas_down_is_eio_then_flushed_data_is_back(kind: Kind) {
        let mut ra = replica(kind, "down-a");
        let mut rb = replica(kind, "down-b");
        let server = serve(&[spec("vol0", &[&ra, &rb])]);
        let _ = read_when_ready(&server, "vol0", 0, 4096);

        let data = common::pattern(11, 64 << 10);
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        assert_eq!(c.write(1 << 20, &data).expect("write"), 0);
        assert_eq!(flush(&mut c), 0);

        ra.kill();
        rb.kill();
        // Each replica is failed by a broken connection (or the timeout);
        // afterwards every request must fail, never return stale bytes.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match c.read(1 << 20, data.len() as u32) {
                Ok(Err(errno)) => {
                    assert_ne!(errno, 0);
                    break;
                }
                Ok(Ok(got)) => {
                    assert_eq!(got, data, "a read with replicas dying returned wrong data")
                }
                Err(e) => panic!("connection broke instead of an EIO reply: {e}"),
            }
            assert!(
                Instant::now() < deadline,
                "reads kept succeeding with every replica dead"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        server.wait_replicas("vol0", FAIL_TIMEOUT, "every replica failed", none_healthy);

        ra.restart();
        rb.restart();
        let got = read_when_ready(&server, "vol0", 1 << 20, data.len() as u32);
        assert_eq!(
            got, data,
            "the volume lost flushed data after both replicas restarted"
        );
    }

    /// The server restarts while the only replica with the newest writes is
    /// away and a stale one is back: the volume must wait for the fresh replica
    /// (I/O fails meanwhile), never serve the stale one's older bytes; once the
    /// fresh replica is back, the newest data reads back.
    pub(super) fn restart_waits_for_the_replica_with_the_newest_writes(kind: Kind) {
        let mut ra = replica(kind, "fresh-a");
        let mut rb = replica(kind, "stale-b");
        let old = common::pattern(21, 64 << 10);
        let new = common::pattern(22, 64 << 10);
        {
            let server = serve(&[spec("vol0", &[&ra, &rb])]);
            let _ = read_when_ready(&server, "vol0", 0, 4096);
            let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
            assert_eq!(c.write(1 << 20, &old).expect("write"), 0);
            assert_eq!(flush(&mut c), 0);
            rb.kill();
            // Acknowledged on replica A alone, at a generation B never saw.
            assert_eq!(c.write(1 << 20, &new).expect("write"), 0);
            assert_eq!(flush(&mut c), 0);
            server.wait_replica("vol0", &rb.target(), FAIL_TIMEOUT, "B failed", |r| {
                r.errors >= 1
            });
        }
        ra.kill();
        rb.restart();
        let server = serve(&[spec("vol0", &[&ra, &rb])]);
        // Longer than any election timeout: still no stale data, only errors.
        let until = Instant::now() + Duration::from_secs(6);
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        while Instant::now() < until {
            match c
                .read(1 << 20, new.len() as u32)
                .expect("a reply, not a broken connection")
            {
                Ok(got) => panic!(
                    "the volume served data without its freshest replica (stale: {})",
                    got == old
                ),
                Err(errno) => assert_ne!(errno, 0),
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        // No replica serves, and the operator is told which one to bring
        // back (or remove).
        assert!(none_healthy(&server.replicas("vol0")));
        server.assert_logged(&["volume not started: waiting for replica(s)", &ra.target()]);
        ra.restart();
        let got = read_when_ready(&server, "vol0", 1 << 20, new.len() as u32);
        assert!(
            got == new,
            "after the fresh replica returned, the volume read back {}",
            if got == old {
                "the stale data"
            } else {
                "wrong data"
            }
        );
    }
}

/// One of two replicas injects faults (`--fault-drop`, `--fault-error`,
/// `--fault-delay-us`): fio's verified writes and reads through the volume
/// still all succeed, since the engine fails the faulty replica and serves
/// from the healthy one; it reconnects to the faulty one as designed.
#[test]
fn a_faulty_replica_does_not_stop_the_volume_serving_correct_data() {
    require("fio", "fio");
    let ra = replica(Kind::Process, "faulty-a");
    let rb = Replica::start_with(
        Kind::Process,
        &dir_of(Kind::Process, "faulty-b"),
        VOLUME,
        &[
            "--fault-drop",
            "0.002",
            "--fault-error",
            "0.01",
            "--fault-delay-us",
            "300",
            "--fault-seed",
            "5",
        ],
    );
    // The warning an operator must see.
    assert!(
        common::log_has(&rb.log(), &["FAULT INJECTION ENABLED"]),
        "the faulty replica did not say so:\n{}",
        rb.log()
    );
    let mut server = serve(&[spec("vol0", &[&ra, &rb])]);
    let _ = read_when_ready(&server, "vol0", 0, 4096);
    let out = Command::new("fio")
        .args([
            "--name=faulty",
            "--ioengine=nbd",
            &format!("--uri=nbd://{}/vol0", server.addr()),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--fsync=32",
            "--loops=2",
            "--randseed=77",
            "--output-format=terse",
        ])
        .output()
        .expect("run fio");
    assert!(
        out.status.success(),
        "fio failed with a faulty replica: {}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        server.stderr()
    );
    // 8192 writes and as many reads at 1 % errors: the engine failed the
    // faulty replica at least once (for what it injected), and connected
    // to it again to rebuild it.
    let failed = server.wait_replica("vol0", &rb.target(), FAIL_TIMEOUT, "failed", |r| {
        r.errors >= 1
    });
    assert!(failed.last_error.is_some(), "{failed:?}");
    server.wait_replica("vol0", &rb.target(), FAIL_TIMEOUT, "reconnected", |r| {
        ["rebuilding", "reconciling", "healthy"].contains(&r.state.as_str())
    });
    server.assert_healthy();
    drop(ra);
}

/// A replicated volume refuses a connection it cannot take in the
/// handshake (`NBD_REP_ERR_POLICY` to `NBD_OPT_GO`), both past the
/// configured per-volume cap and past the engine's `MAX_CHANNELS` when the
/// cap is set higher.
#[test]
fn replicated_volume_refusals_come_in_the_handshake() {
    let ra = replica(Kind::Process, "refuse-a");
    let rb = replica(Kind::Process, "refuse-b");
    let go_refused = |server: &Server, cap: &str| {
        let err = match NbdClient::connect(server.addr(), "vol0") {
            Ok(_) => panic!("a connection past {cap} was admitted"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(&format!("{:#x}", lull_proto::nbd::NBD_REP_ERR_POLICY)),
            "past {cap}: {err}"
        );
        err
    };
    let spec = spec("vol0", &[&ra, &rb]);
    {
        let mut server = Server::start(&[
            "--replica-insecure",
            "--volume",
            &spec,
            "--max-connections-per-volume",
            "1",
        ]);
        let _ = read_when_ready(&server, "vol0", 0, 4096);
        let _one = NbdClient::connect(server.addr(), "vol0").expect("first connection");
        let err = go_refused(&server, "the per-volume cap");
        assert!(err.contains("maximum of 1 connections"), "{err}");
        server.assert_healthy();
    }
    let mut server = Server::start(&[
        "--replica-insecure",
        "--volume",
        &spec,
        "--max-connections-per-volume",
        "100",
    ]);
    let _ = read_when_ready(&server, "vol0", 0, 4096);
    let max = lull_engine::MAX_CHANNELS;
    let held: Vec<NbdClient> = (0..max)
        .map(|i| {
            NbdClient::connect(server.addr(), "vol0")
                .unwrap_or_else(|e| panic!("connection {i}: {e}"))
        })
        .collect();
    let err = go_refused(&server, "MAX_CHANNELS");
    assert!(err.contains("cannot take a connection now"), "{err}");
    drop(held);
    server.assert_healthy();
}

/// After I/O, a replicated volume's server sleeps in the event-driven modes:
/// the engine's completion doorbell must not be left ringing (a readable
/// eventfd with nothing behind it would keep the reactor awake).
#[test]
fn replicated_volume_sleeps_when_idle() {
    let ra = replica(Kind::Process, "idle-a");
    for mode in ["interrupt", "adaptive"] {
        let volume = spec("vol0", &[&ra]);
        let mut server =
            Server::start(&["--replica-insecure", "--mode", mode, "--volume", &volume]);
        let _ = read_when_ready(&server, "vol0", 0, 4096);
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        // Pipelined batches, so completions arrive while the channel is
        // reaping: the doorbell's races get their chance.
        for round in 0..200u64 {
            let data = common::pattern(round, 4096);
            let mut cookies: Vec<u64> = (0..8u64)
                .map(|k| {
                    c.send(
                        NbdCommand::Write,
                        0,
                        ((round * 8 + k) % 4096) * 4096,
                        4096,
                        &data,
                    )
                    .expect("send")
                })
                .collect();
            // Replies come in completion order.
            for _ in 0..8 {
                let (error, cookie) = c.reply().expect("reply");
                assert_eq!(error, 0);
                let i = cookies
                    .iter()
                    .position(|&k| k == cookie)
                    .expect("a reply to a request in flight");
                cookies.swap_remove(i);
            }
        }
        std::thread::sleep(Duration::from_millis(500));
        let before = common::process_cpu_ticks(server.pid());
        std::thread::sleep(Duration::from_secs(3));
        let used = common::process_cpu_ticks(server.pid()) - before;
        // Keep-alives and the engine tick cost a few ms; a spinning reactor
        // would cost ~3000 ms. 150 ms is 5 % of a core.
        assert!(
            used < 15,
            "{mode}: an idle replicated volume cost {} ms of CPU in 3 s",
            used * 10
        );
        c.disconnect();
        server.assert_healthy();
    }
}

/// A fake replica: accepts connections and answers with `reply`.
fn fake_replica(reply: Vec<u8>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind fake replica");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { break };
            let reply = reply.clone();
            std::thread::spawn(move || {
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let mut buf = [0u8; 64];
                let _ = s.read(&mut buf);
                let _ = s.write_all(&reply);
                let _ = s.read(&mut buf);
            });
        }
    });
    addr
}

#[test]
fn bad_replicas_are_refused_cleanly_and_other_volumes_work() {
    // Garbage instead of a HELLO reply.
    let garbage =
        fake_replica(b"HTTP/1.1 400 Bad Request\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxx".to_vec());
    // A well-formed HELLO reply header, but protocol version 2 (a replica
    // from before BLOCK_STATUS).
    let mut v2 = Vec::new();
    v2.extend_from_slice(&0x4C55_4C52u32.to_be_bytes());
    v2.extend_from_slice(&2u16.to_be_bytes());
    v2.extend_from_slice(&(1u16 | 0x8000).to_be_bytes());
    v2.extend_from_slice(&1u64.to_be_bytes());
    v2.extend_from_slice(&0u64.to_be_bytes());
    v2.extend_from_slice(&32u32.to_be_bytes());
    v2.extend_from_slice(&(libc::EPROTO as u32).to_be_bytes());
    v2.extend_from_slice(&[0u8; 32]);
    let wrong_version = fake_replica(v2);
    let rg = replica(Kind::Process, "bad-good");

    let server = serve(&[
        spec_of("bad", &[garbage.to_string()]),
        spec_of("old", &[wrong_version.to_string()]),
        spec("ok", &[&rg]),
    ]);
    // Each bad replica is failed, with the reason.
    server.wait_replica("bad", &garbage.to_string(), FAIL_TIMEOUT, "failed", |r| {
        r.failed_because(&["undecodable frame"])
    });
    server.wait_replica(
        "old",
        &wrong_version.to_string(),
        FAIL_TIMEOUT,
        "failed",
        |r| {
            r.failed_because(&[&format!(
                "replica speaks protocol version 2, this engine speaks {}",
                lull_proto::replica::PROTOCOL_VERSION
            )])
        },
    );

    // The volume with a good replica is unaffected.
    let _ = read_when_ready(&server, "ok", 0, 4096);
    let mut c = NbdClient::connect(server.addr(), "ok").expect("connect");
    let data = common::pattern(5, 8192);
    assert_eq!(c.write(4096, &data).expect("write"), 0);
    assert_eq!(c.read(4096, 8192).expect("read"), Ok(data));
    // The broken volumes answer with errors, not hangs.
    let mut bad = NbdClient::connect(server.addr(), "bad").expect("connect bad");
    assert!(
        matches!(bad.read(0, 4096), Ok(Err(_))),
        "a volume without a healthy replica must fail I/O"
    );
    let mut server = server;
    server.assert_healthy();
}

/// Hybrid mode (Longhorn's design): the replica connections are drained by
/// the periodic initiator poll, not woken by their sockets, and keep-alives
/// follow nvme_adminq_poll_period_us. Data written and read through it is
/// intact, in every period tried.
#[test]
fn hybrid_mode_serves_a_replicated_volume() {
    let ra = replica(Kind::Process, "hybrid-a");
    for period in ["10", "1000"] {
        let mut args: Vec<String> = vec![
            "--replica-insecure".into(),
            "--mode".into(),
            "hybrid".into(),
            "--nvme-ioq-poll-period-us".into(),
            period.into(),
        ];
        args.push("--volume".into());
        args.push(spec("vol0", &[&ra]));
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut server = Server::start(&argv);
        let _ = read_when_ready(&server, "vol0", 0, 4096);
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        for i in 0..32u64 {
            let data = common::pattern(i + period.len() as u64 * 100, 8192);
            assert_eq!(c.write(i * 65536, &data).expect("write"), 0);
            assert_eq!(
                c.read(i * 65536, 8192).expect("read"),
                Ok(data),
                "period {period} µs"
            );
        }
        assert_eq!(flush(&mut c), 0);
        c.disconnect();
        // An idle pause longer than several keep-alive periods: the replica
        // stays healthy (keep-alives keep it from timing out).
        std::thread::sleep(Duration::from_millis(300));
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        assert!(c.read(0, 4096).expect("read").is_ok());
        c.disconnect();
        server.assert_healthy();
    }
}

// ---- engine crashes (issue 17) ---------------------------------------------

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill {sig} {pid} failed");
}

/// Waits for a verifying fio (stdout and stderr piped) and fails the test
/// if it saw bad data (it may have failed otherwise: its server was
/// killed under it).
pub(crate) fn assert_fio_saw_no_bad_data(fio: std::process::Child, what: &str) {
    let out = fio.wait_with_output().expect("fio output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for bad in ["verify failed", "bad magic", "bad header", "crc32c: verify"] {
        assert!(!text.contains(bad), "{what}fio saw bad data:\n{text}");
    }
}

/// When a file was last written.
fn modified(path: &Path) -> std::time::SystemTime {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Bytes `[offset, offset + len)` of a file (what a replica holds, page
/// cache included).
fn file_bytes(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).expect("open a replica data file");
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset)
        .expect("read a replica data file");
    buf
}

/// The whole volume through a real client (qemu-img), as a file.
fn export_image(server: &Server, export: &str, out: &Path) -> Vec<u8> {
    let st = Command::new("qemu-img")
        .args([
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &format!("nbd://{}/{export}", server.addr()),
        ])
        .arg(out)
        .output()
        .expect("run qemu-img");
    assert!(
        st.status.success(),
        "qemu-img convert failed: {}\nserver log:\n{}",
        String::from_utf8_lossy(&st.stderr),
        server.stderr()
    );
    std::fs::read(out).expect("read the exported image")
}

/// A flush with every replica healthy: then nothing is in flight and the
/// data files can be compared.
fn quiesce(server: &Server) {
    let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
    assert_eq!(
        flush(&mut c),
        0,
        "flush failed; server log:\n{}",
        server.stderr()
    );
    c.disconnect();
}

/// After a flush: the replicas' data files are bit-identical, and a real
/// client reads the whole volume twice with the same result. The image.
fn assert_converged(server: &Server, ra: &Replica, rb: &Replica, name: &str) -> Vec<u8> {
    quiesce(server);
    if let Err(e) = files_equal(&ra.data_file(), &rb.data_file(), VOLUME_BYTES) {
        panic!("{e}; server log:\n{}", server.stderr());
    }
    let dir = common::Scratch::new(&format!("lull-repl-image-{name}"));
    let one = export_image(server, "vol0", &dir.join("one.raw"));
    let two = export_image(server, "vol0", &dir.join("two.raw"));
    assert!(one == two, "two full reads of the volume differ");
    one
}

// Each body in `crash` runs twice: on `lull replica` processes, and on
// replicas in store daemons (`_on_store_replicas`).
#[test]
fn unacknowledged_write_and_engine_crash_reconcile_and_reads_never_alternate() {
    crash::unacknowledged_write_and_engine_crash_reconcile_and_reads_never_alternate(Kind::Process);
}

#[test]
fn unacknowledged_write_and_engine_crash_reconcile_and_reads_never_alternate_on_store_replicas() {
    crash::unacknowledged_write_and_engine_crash_reconcile_and_reads_never_alternate(Kind::Store);
}

#[test]
fn fio_verify_across_repeated_engine_kills() {
    crash::fio_verify_across_repeated_engine_kills(Kind::Process);
}

#[test]
fn fio_verify_across_repeated_engine_kills_on_store_replicas() {
    crash::fio_verify_across_repeated_engine_kills(Kind::Store);
}

#[test]
fn a_corrupt_write_intent_record_means_a_full_repair() {
    crash::a_corrupt_write_intent_record_means_a_full_repair(Kind::Process);
}

#[test]
fn a_corrupt_write_intent_record_means_a_full_repair_on_store_replicas() {
    crash::a_corrupt_write_intent_record_means_a_full_repair(Kind::Store);
}

#[test]
fn a_clean_stop_detaches_and_the_next_start_reconciles_nothing() {
    crash::a_clean_stop_detaches_and_the_next_start_reconciles_nothing(Kind::Process);
}

#[test]
fn a_clean_stop_detaches_and_the_next_start_reconciles_nothing_on_store_replicas() {
    crash::a_clean_stop_detaches_and_the_next_start_reconciles_nothing(Kind::Store);
}

/// Engine crashes and clean stops: what the next start reconciles.
mod crash {
    use super::*;

    /// The issue's scenario: a write reaches one replica only (the other is
    /// stopped), the server is SIGKILLed before it completes, the stopped
    /// replica resumes, the server restarts. The restarted engine must see an
    /// unclean stop, reconcile the regions that had writes in flight, and from
    /// then on every read returns the same bytes and the data files are
    /// identical.
    pub(super) fn unacknowledged_write_and_engine_crash_reconcile_and_reads_never_alternate(
        kind: Kind,
    ) {
        require("qemu-img", "qemu-utils");
        let ra = replica(kind, "crash-a");
        let rb = replica(kind, "crash-b");
        let at = 1u64 << 20;
        let old = common::pattern(31, 64 << 10);
        let new = common::pattern(32, 64 << 10);
        let mut server = serve(&[spec("vol0", &[&ra, &rb])]);
        let _ = read_when_ready(&server, "vol0", 0, 4096);
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        assert_eq!(c.write(at, &old).expect("write"), 0);
        assert_eq!(flush(&mut c), 0);

        // B stops: the next write lands on A and is never acknowledged.
        signal(rb.pid(), "-STOP");
        c.send(NbdCommand::Write, 0, at, new.len() as u32, &new)
            .expect("send the write");
        let deadline = Instant::now() + Duration::from_secs(10);
        while file_bytes(&ra.data_file(), at, new.len()) != new {
            assert!(
                Instant::now() < deadline,
                "the write never reached replica A; log:\n{}",
                server.stderr()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        server.kill();
        signal(rb.pid(), "-CONT");

        let server = serve(&[spec("vol0", &[&ra, &rb])]);
        // Until the reconcile completes reads come from the source alone; after
        // it, from either replica. Either way the same bytes, every time.
        let first = read_when_ready(&server, "vol0", at, new.len() as u32);
        assert!(
            first == old || first == new,
            "read back neither the old nor the new data"
        );
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        for i in 0..8 {
            let got = c
                .read(at, new.len() as u32)
                .expect("read")
                .expect("read status");
            assert!(
                got == first,
                "read {i} returned other data than the first read (reads alternate)"
            );
        }
        // B is healthy again once the reconcile is done.
        server.wait_replicas("vol0", REBUILD_TIMEOUT, "the reconcile done", all_healthy);
        // The warning an operator must see: the engine had crashed.
        server.assert_logged(&["unclean stop: reconciling", &rb.target()]);
        for i in 0..8 {
            let got = c
                .read(at, new.len() as u32)
                .expect("read")
                .expect("read status");
            assert!(
                got == first,
                "read {i} after the reconcile returned other data (reads alternate)"
            );
        }
        c.disconnect();
        let image = assert_converged(&server, &ra, &rb, &format!("crash-img-{}", kind.tag()));
        assert!(image[at as usize..at as usize + first.len()] == first[..]);
    }

    /// fio writes with verification (`verify_backlog`) while the server is
    /// SIGKILLed and restarted, three times. No verification may fail while it
    /// runs, and afterwards the replicas converge bit for bit and the volume
    /// reads back the same twice.
    pub(super) fn fio_verify_across_repeated_engine_kills(kind: Kind) {
        require("fio", "fio");
        require("qemu-img", "qemu-utils");
        let ra = replica(kind, "fiokill-a");
        let rb = replica(kind, "fiokill-b");
        for round in 0..3 {
            let mut server = serve(&[spec("vol0", &[&ra, &rb])]);
            let _ = read_when_ready(&server, "vol0", 0, 4096);
            let mut fio = Command::new("fio")
                .args([
                    "--name=crash",
                    "--ioengine=nbd",
                    &format!("--uri=nbd://{}/vol0", server.addr()),
                    "--rw=randwrite",
                    "--bs=4k",
                    "--iodepth=16",
                    "--size=64M",
                    "--time_based",
                    "--runtime=60",
                    "--verify=crc32c",
                    "--verify_backlog=256",
                    "--verify_fatal=1",
                    "--verify_state_save=0",
                    "--fsync=64",
                    &format!("--randseed={}", 100 + round),
                    "--output-format=terse",
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn fio");
            std::thread::sleep(Duration::from_secs(2));
            assert!(
                fio.try_wait().expect("fio status").is_none(),
                "round {round}: fio ended before the kill; log:\n{}",
                server.stderr()
            );
            server.kill();
            // fio fails because its server vanished; it must not have seen
            // bad data before that.
            assert_fio_saw_no_bad_data(fio, &format!("round {round}: "));
        }
        let server = serve(&[spec("vol0", &[&ra, &rb])]);
        let _ = read_when_ready(&server, "vol0", 0, 4096);
        // A kill during the previous round's reconcile leaves its target a
        // generation behind: then it is rebuilt in full instead. Either
        // way both are healthy once the copy is done.
        server.wait_replicas("vol0", REBUILD_TIMEOUT, "the recovery done", all_healthy);
        // The warning an operator must see: the engine had crashed.
        server.assert_logged(&["unclean stop"]);
        assert_converged(&server, &ra, &rb, &format!("fiokill-img-{}", kind.tag()));
    }

    /// A replica whose write-intent record is corrupt must not be trusted: it
    /// reports every region, and the engine repairs the whole volume, even
    /// where no record says a write was in flight (here: bytes put into the
    /// replica's file by hand, in a region nobody wrote).
    pub(super) fn a_corrupt_write_intent_record_means_a_full_repair(kind: Kind) {
        let ra = replica(kind, "lost-a");
        let mut rb = replica(kind, "lost-b");
        let mut server = serve(&[spec("vol0", &[&ra, &rb])]);
        let _ = read_when_ready(&server, "vol0", 0, 4096);
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        assert_eq!(
            c.write(1 << 20, &common::pattern(41, 64 << 10))
                .expect("write"),
            0
        );
        assert_eq!(flush(&mut c), 0);
        server.kill();

        rb.kill();
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(rb.intent_file())
                .expect("open intent.bin");
            // Both record slots (4 KiB each) get a bad checksum.
            f.write_all_at(&[0xA5; 16], 8).expect("corrupt slot A");
            f.write_all_at(&[0xA5; 16], 4096 + 8)
                .expect("corrupt slot B");
            let d = std::fs::OpenOptions::new()
                .write(true)
                .open(rb.data_file())
                .expect("open data.img");
            d.write_all_at(&[0x5A; 4096], 40 << 20)
                .expect("diverge B by hand");
        }
        rb.restart();

        let server = serve(&[spec("vol0", &[&ra, &rb])]);
        server.wait_replicas("vol0", REBUILD_TIMEOUT, "the repair done", all_healthy);
        // The warning an operator must see: a replica's record was lost.
        server.assert_logged(&["write-intent record lost", &rb.target()]);
        quiesce(&server);
        if let Err(e) = files_equal(&ra.data_file(), &rb.data_file(), VOLUME_BYTES) {
            panic!("{e}; server log:\n{}", server.stderr());
        }
    }

    /// A clean stop (SIGTERM) detaches: the replicas are marked clean, and the
    /// next start trusts them as identical without reconciling anything.
    pub(super) fn a_clean_stop_detaches_and_the_next_start_reconciles_nothing(kind: Kind) {
        let ra = replica(kind, "clean-a");
        let rb = replica(kind, "clean-b");
        let data = common::pattern(51, 64 << 10);
        let mut server = serve(&[spec("vol0", &[&ra, &rb])]);
        let _ = read_when_ready(&server, "vol0", 0, 4096);
        let mut c = NbdClient::connect(server.addr(), "vol0").expect("connect");
        assert_eq!(c.write(1 << 20, &data).expect("write"), 0);
        c.disconnect();
        let status = server
            .terminate(Duration::from_secs(30))
            .expect("lull serve did not stop after SIGTERM");
        assert!(
            status.success(),
            "lull serve exited with {status}:\n{}",
            server.stderr()
        );
        // Each replica's record says so.
        assert!(ra.clean() && rb.clean(), "a replica is not marked clean");

        let written = || [&ra, &rb].map(|r| modified(&r.data_file()));
        let before = written();
        let server = serve(&[spec("vol0", &[&ra, &rb])]);
        assert_eq!(
            read_when_ready(&server, "vol0", 1 << 20, data.len() as u32),
            data
        );
        server.wait_replicas("vol0", READY_TIMEOUT, "both healthy", all_healthy);
        // Trusted as identical: nothing was copied onto either data file.
        assert_eq!(
            written(),
            before,
            "a clean restart reconciled or rebuilt (a data file was written); log:\n{}",
            server.stderr()
        );
    }
}

// ---- block status and fast zero on a replicated volume (issue 12) ---------

#[test]
fn replicated_volume_reports_holes_and_refuses_fast_zero() {
    block_status::replicated_volume_reports_holes_and_refuses_fast_zero(Kind::Process);
}

#[test]
fn replicated_volume_reports_holes_and_refuses_fast_zero_on_store_replicas() {
    block_status::replicated_volume_reports_holes_and_refuses_fast_zero(Kind::Store);
}

/// What a replicated volume says about its holes, on either kind of
/// replica.
mod block_status {
    use super::*;

    /// A replicated volume reports its holes (the replica protocol's
    /// BLOCK_STATUS, asked of a healthy replica): a fresh one is one hole, a
    /// write is data, and WRITE_ZEROES punches the hole back on the replica.
    /// Fast zeros are refused with NBD_ENOTSUP (the client writes zeros
    /// itself: the replica protocol has no fast zero), while plain zeros and
    /// structured reads work. replication/sparse_replicated.rs has the
    /// 2-replica maps and copies.
    pub(super) fn replicated_volume_reports_holes_and_refuses_fast_zero(kind: Kind) {
        require("nbdinfo", "libnbd-bin");
        let ra = replica(kind, "bs-a");
        let mut server = serve(&[spec("vol0", &[&ra])]);
        let _ = read_when_ready(&server, "vol0", 0, 4096);
        let uri = format!("nbd://{}/vol0", server.addr());
        let map = || {
            let out = Command::new("nbdinfo")
                .args(["--map", &uri])
                .output()
                .expect("nbdinfo");
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            assert!(out.status.success(), "nbdinfo --map: {text}");
            text.lines()
                .map(|l| l.split_whitespace().map(str::to_string).collect())
                .collect::<Vec<Vec<String>>>()
        };
        let one_hole = [vec![
            "0".to_string(),
            VOLUME_BYTES.to_string(),
            "3".into(),
            "hole,zero".into(),
        ]];
        assert_eq!(map(), one_hole);
        let script = r#"
import sys, nbd
h = nbd.NBD()
h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
h.connect_uri(sys.argv[1])
h.pwrite(b"\x7f" * 65536, 0)
try:
    h.zero(65536, 0, nbd.CMD_FLAG_FAST_ZERO)
    sys.exit("fast zero succeeded on a replicated volume")
except nbd.Error as e:
    assert e.errno in ("ENOTSUP", "EOPNOTSUPP"), e.errno
assert h.pread(65536, 0) == b"\x7f" * 65536
def extents():
    got = []
    def cb(ctx, offset, entries, err):
        got.extend(zip(entries[0::2], entries[1::2]))
        return 0
    h.block_status(65536, 0, cb)
    return got
assert extents() == [(65536, 0)], extents()
h.zero(65536, 0)
assert h.pread_structured(65536, 0, lambda *a: 0) == bytearray(65536)
h.shutdown()
print("ok")
"#;
        let out = Command::new("/usr/bin/python3")
            .args(["-c", script, &uri])
            .output()
            .expect("python3 (install python3-libnbd)");
        assert!(
            out.status.success(),
            "libnbd checks failed (python3-libnbd installed?):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // The zeroed write is a hole again on the replica.
        assert_eq!(map(), one_hole);
        server.assert_healthy();
    }
}

/// The rebuild bandwidth limit (issue 29): a full rebuild of ~250 MB runs
/// at 10 MB/s (+-10% over 10 s), at 20 MB/s once raised at run time, and
/// at full speed without; the replicas are identical after.
#[test]
fn the_rebuild_bandwidth_limit_holds_and_changes_at_run_time() {
    let scratch = common::Scratch::new("rebuild-limit");
    let a = Replica::start(Kind::Process, &scratch.join("a"), "256M");
    let mut b = Replica::start(Kind::Process, &scratch.join("b"), "256M");
    let spec = format!("v:256M:replicas={}+{}", a.target(), b.target());
    let mut server = Server::start(&["--replica-insecure", "--volume", &spec]);
    common::read_when_ready(&server, "v", 0, 4096, Duration::from_secs(30));
    b.kill();
    common::tools::qemu_io(&server, "v", &["write -P 0x5a 0 240M"]);
    let set = |mb: u64| {
        server.rpc(
            "volume_set_rebuild_limit",
            &format!(r#"{{"name":"v","mbytes_per_sec":{mb}}}"#),
        )
    };
    let reply = set(10);
    assert_eq!(reply["volumes"], serde_json::json!(["v"]), "{reply}");
    b.restart();
    let target = b.target();
    let done = |server: &Server| -> Option<u64> {
        let list = server.rpc("replica_list", r#"{"volume":"v"}"#);
        list.as_array()?
            .iter()
            .find(|r| r["addr"] == target.as_str())
            .and_then(|r| r["rebuild"]["bytes_done"].as_u64())
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while done(&server).is_none_or(|d| d == 0) {
        assert!(Instant::now() < deadline, "no rebuild started");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let rate = |server: &Server, secs: u64| -> f64 {
        let (d0, t0) = (done(server).expect("rebuilding"), Instant::now());
        std::thread::sleep(Duration::from_secs(secs));
        let d1 = done(server).expect("still rebuilding");
        (d1 - d0) as f64 / t0.elapsed().as_secs_f64()
    };
    let r10 = rate(&server, 10);
    println!("limit 10 MB/s: {:.2} MB/s", r10 / 1e6);
    assert!((r10 - 10e6).abs() <= 1e6, "10 MB/s +-10%: {r10:.0} B/s");
    set(20);
    std::thread::sleep(Duration::from_secs(1));
    let r20 = rate(&server, 3);
    println!("raised to 20 MB/s: {:.2} MB/s", r20 / 1e6);
    assert!((r20 - 20e6).abs() <= 2e6, "20 MB/s +-10%: {r20:.0} B/s");
    set(0);
    server.wait_replicas("v", Duration::from_secs(60), "both healthy", |rs| {
        rs.iter().all(|r| r.state == "healthy")
    });
    let stats = server.rpc("volume_get_stats", r#"{"name":"v"}"#);
    assert_eq!(stats["rebuild_limit_bytes_per_sec"], 0, "{stats}");
    common::tools::qemu_io(&server, "v", &["read -P 0x5a 0 240M"]);
    server.assert_healthy();
}

/// The node's rebuild limit is a total (issue 29): two volumes rebuilt at
/// once under `node_set_rebuild_limit` 10 MB/s move 10 MB/s between them
/// (+-10% over 6 s), in equal shares; lifted, both finish and the
/// replicas hold the data.
#[test]
fn the_node_rebuild_limit_is_a_total_over_its_volumes() {
    let scratch = common::Scratch::new("node-rebuild-limit");
    let mut pairs = Vec::new();
    for v in ["v1", "v2"] {
        let a = Replica::start(Kind::Process, &scratch.join(format!("{v}a")), "128M");
        let b = Replica::start(Kind::Process, &scratch.join(format!("{v}b")), "128M");
        pairs.push((v, a, b));
    }
    let specs: Vec<String> = pairs
        .iter()
        .map(|(v, a, b)| format!("{v}:128M:replicas={}+{}", a.target(), b.target()))
        .collect();
    let mut args = vec!["--replica-insecure"];
    for s in &specs {
        args.extend(["--volume", s.as_str()]);
    }
    let mut server = Server::start(&args);
    for (v, _, b) in &mut pairs {
        common::read_when_ready(&server, v, 0, 4096, Duration::from_secs(30));
        b.kill();
        common::tools::qemu_io(&server, v, &["write -P 0x5a 0 120M"]);
    }
    let reply = server.rpc("node_set_rebuild_limit", r#"{"mbytes_per_sec":10}"#);
    assert_eq!(reply["mbytes_per_sec"], 10, "{reply}");
    for (_, _, b) in &mut pairs {
        b.restart();
    }
    let done = |server: &Server, v: &str, target: &str| -> Option<u64> {
        let list = server.rpc("replica_list", &format!(r#"{{"volume":"{v}"}}"#));
        list.as_array()?
            .iter()
            .find(|r| r["addr"] == target)
            .and_then(|r| r["rebuild"]["bytes_done"].as_u64())
    };
    let targets: Vec<(&str, String)> = pairs.iter().map(|(v, _, b)| (*v, b.target())).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while targets
        .iter()
        .any(|(v, t)| done(&server, v, t).is_none_or(|d| d == 0))
    {
        assert!(Instant::now() < deadline, "both rebuilds did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let sum = |server: &Server| -> u64 {
        targets
            .iter()
            .map(|(v, t)| done(server, v, t).expect("rebuilding"))
            .sum()
    };
    let (d0, t0) = (sum(&server), Instant::now());
    let each0: Vec<u64> = targets
        .iter()
        .map(|(v, t)| done(&server, v, t).unwrap())
        .collect();
    std::thread::sleep(Duration::from_secs(6));
    let d1 = sum(&server);
    let each1: Vec<u64> = targets
        .iter()
        .map(|(v, t)| done(&server, v, t).unwrap())
        .collect();
    let rate = (d1 - d0) as f64 / t0.elapsed().as_secs_f64();
    println!(
        "node limit 10 MB/s: {:.2} MB/s in total; per volume {:?} bytes",
        rate / 1e6,
        each1
            .iter()
            .zip(&each0)
            .map(|(a, b)| a - b)
            .collect::<Vec<_>>()
    );
    assert!(
        (rate - 10e6).abs() <= 1e6,
        "10 MB/s +-10% in total: {rate:.0} B/s"
    );
    // Equal shares: neither volume below 30% of what moved.
    let moved = d1 - d0;
    assert!(
        each1
            .iter()
            .zip(&each0)
            .all(|(a, b)| (a - b) * 10 >= moved * 3),
        "unequal shares of the node's limit: {each0:?} -> {each1:?}"
    );
    server.rpc("node_set_rebuild_limit", r#"{"mbytes_per_sec":0}"#);
    for (v, _, _) in &pairs {
        server.wait_replicas(v, Duration::from_secs(60), "both healthy", |rs| {
            rs.iter().all(|r| r.state == "healthy")
        });
        common::tools::qemu_io(&server, v, &["read -P 0x5a 0 120M"]);
    }
    server.assert_healthy();
}
