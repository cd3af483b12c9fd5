//! Many idle connections against the real binary: 2,000 clients that
//! finish the NBD handshake and then sit idle, while fio writes and
//! verifies on one more connection. The server must serve fio correctly,
//! grow its resident memory by less than 40 MiB for the 2,000, survive all
//! of them vanishing at once with a reset, and serve normal clients after.
//!
//! Each event mode gets its own server, one after the other:
//!
//! ```text
//! cargo test -p lull --profile ci --test system scale:: -- --nocapture
//! ```
//!
//! The per-connection memory figure is printed (`--nocapture` shows it).
//! fio (Debian package fio) must be installed; the test fails, naming the
//! package, when it is not.

use std::io;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{assert_good_client_works, pattern, require, NbdClient, Server, IO_TIMEOUT};
use lull_proto::nbd;

/// The issue's figure: enough connections that a per-connection cost of a
/// few tens of KiB shows up as tens of MiB.
const IDLE_CONNECTIONS: usize = 2_000;

/// The issue's bound on the server's RSS growth for all idle connections:
/// about 20 KiB each.
const RSS_GROWTH_LIMIT_BYTES: u64 = 40 << 20;

/// Descriptors the test process needs besides the idle sockets: stdio, the
/// warm-up and later clients, fio's pipes, the server's pipes and files.
const FD_HEADROOM: u64 = 100;

/// The volume: a memory volume large enough for fio's region and the good
/// clients' blocks after it.
const EXPORT: &str = "vol0";
const VOLUME_ARG: &str = "vol0:64M";

/// fio's region at the start of the volume. The volume is sparse (chunks
/// are allocated on first write), so the warm-up writes this whole region
/// before the memory baseline: otherwise fio's data would count as memory
/// the idle connections cost.
const FIO_REGION_BYTES: u64 = 16 << 20;

/// The write size of the warm-up fill.
const FILL_WRITE_BYTES: usize = 256 << 10;

/// Where the good clients write, past fio's region.
const GOOD_CLIENT_OFFSET: u64 = 32 << 20;

/// Longest a fio run may take (a few seconds when healthy): a hung server
/// fails the test instead of hanging it.
const FIO_DEADLINE: Duration = Duration::from_secs(60);

/// Descriptors the server may hold above its baseline once every idle
/// connection is gone (a good client's socket not yet reaped, and so on).
const SERVER_FD_SLACK: usize = 16;

/// Threads opening the idle connections.
const OPENERS: usize = 4;

/// Lines of each kind a failure message quotes from the server's log.
const LOG_DIGEST_LINES: usize = 20;

/// Every mode, one server each; each takes a few seconds.
const MODES: [&str; 3] = ["poll", "interrupt", "adaptive"];

/// Runs `cmd` to completion within `limit`, its output in files under
/// `dir`; panics when it fails or overruns. Returns its stdout.
fn run_bounded(cmd: &mut Command, dir: &Path, name: &str, limit: Duration) -> String {
    let out_path = dir.join(format!("{name}.stdout"));
    let err_path = dir.join(format!("{name}.stderr"));
    let out = std::fs::File::create(&out_path).expect("create the stdout file");
    let err = std::fs::File::create(&err_path).expect("create the stderr file");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let deadline = Instant::now() + limit;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => break None,
            Err(e) => panic!("cannot wait for {cmd:?}: {e}"),
        }
    };
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stdout = std::fs::read_to_string(&out_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&err_path).unwrap_or_default();
    match status {
        Some(s) if s.success() => stdout,
        Some(s) => panic!("{cmd:?} failed with {s}\nstdout:\n{stdout}\nstderr:\n{stderr}"),
        None => panic!("{cmd:?} still ran after {limit:?}\nstdout:\n{stdout}\nstderr:\n{stderr}"),
    }
}

/// fio's nbd engine writes fio's region at random, 4 KiB at a time, and
/// reads it all back checking each block's crc32c. With `verify_only` it
/// writes nothing and checks what the same job wrote before.
fn fio_verify(server: &Server, name: &str, verify_only: bool) {
    require("fio", "fio");
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri=nbd://{}/{EXPORT}", server.addr()),
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        &format!("--size={FIO_REGION_BYTES}"),
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--verify_state_save=0",
        "--output-format=json",
    ]);
    if verify_only {
        cmd.arg("--verify_only");
    }
    let text = run_bounded(&mut cmd, server.dir(), name, FIO_DEADLINE);
    let json: serde_json::Value = serde_json::from_str(
        &text[text
            .find('{')
            .unwrap_or_else(|| panic!("no fio JSON:\n{text}"))..],
    )
    .unwrap_or_else(|e| panic!("fio JSON: {e}\n{text}"));
    let job = &json["jobs"][0];
    let blocks = FIO_REGION_BYTES / 4096;
    assert_eq!(job["error"], 0, "fio error: {job}");
    if !verify_only {
        assert!(
            job["write"]["total_ios"].as_u64().unwrap_or(0) >= blocks,
            "fio wrote fewer than {blocks} blocks: {job}"
        );
    }
    assert!(
        job["read"]["total_ios"].as_u64().unwrap_or(0) >= blocks,
        "fio verified fewer than {blocks} blocks: {job}"
    );
}

/// The process's resident memory, from `VmRSS` in /proc/PID/status.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/status: {e}"));
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status:\n{status}"));
    kib * 1024
}

/// Descriptors the process holds, from /proc/PID/fd.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/fd: {e}"))
        .count()
}

/// The server's warnings and errors and its last lines, for failure
/// messages (the whole log has a line or two per connection).
fn log_digest(server: &Server) -> String {
    let log = server.stderr();
    let lines: Vec<&str> = log.lines().collect();
    let problems: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .take(LOG_DIGEST_LINES)
        .collect();
    let tail = &lines[lines.len().saturating_sub(LOG_DIGEST_LINES)..];
    format!(
        "server warnings and errors (first {LOG_DIGEST_LINES}):\n{}\nserver log (last {LOG_DIGEST_LINES} lines):\n{}",
        problems.join("\n"),
        tail.join("\n")
    )
}

/// Raises this process's descriptor limit to its hard limit and fails when
/// even that is too few for the idle connections.
fn raise_own_fd_limit() {
    let needed = IDLE_CONNECTIONS as u64 + FD_HEADROOM;
    let (_, now) = lull_reactor::sys::raise_nofile_limit()
        .unwrap_or_else(|e| panic!("cannot raise RLIMIT_NOFILE: {e}"));
    assert!(
        now >= needed,
        "the test needs {needed} file descriptors but the hard limit is {now}: \
         raise it (ulimit -Hn, or LimitNOFILE= for a service) and rerun"
    );
}

/// Fills fio's region with one client, so the sparse volume's chunks exist
/// before the memory baseline, and checks the last write reads back.
fn fill_fio_region(server: &Server) {
    let mut client = NbdClient::connect(server.addr(), EXPORT).expect("warm-up handshake");
    let data = pattern(0xf111, FILL_WRITE_BYTES);
    let mut offset = 0;
    while offset < FIO_REGION_BYTES {
        assert_eq!(
            client.write(offset, &data).expect("warm-up write"),
            nbd::NBD_SUCCESS,
            "warm-up write at {offset}"
        );
        offset += FILL_WRITE_BYTES as u64;
    }
    let last = offset - FILL_WRITE_BYTES as u64;
    let back = client
        .read(last, FILL_WRITE_BYTES as u32)
        .expect("warm-up read")
        .expect("warm-up read error");
    assert!(back == data, "warm-up read back different data at {last}");
    client.disconnect();
}

/// Opens the idle connections, each through the fixed-newstyle handshake
/// with NBD_OPT_GO, so each is in the transmission phase. A few threads
/// open them side by side, so a server that handles several handshakes per
/// wake-up gets several at once.
fn open_idle(server: &Server) -> Vec<NbdClient> {
    let per_thread = IDLE_CONNECTIONS.div_ceil(OPENERS);
    // Each opener returns what it opened and, if a handshake failed, why.
    let opened: Vec<(Vec<NbdClient>, Option<io::Error>)> = std::thread::scope(|s| {
        let openers: Vec<_> = (0..OPENERS)
            .map(|t| {
                s.spawn(move || {
                    let count = per_thread.min(IDLE_CONNECTIONS.saturating_sub(t * per_thread));
                    let mut idle = Vec::with_capacity(count);
                    for _ in 0..count {
                        match NbdClient::connect(server.addr(), EXPORT) {
                            Ok(c) => idle.push(c),
                            Err(e) => return (idle, Some(e)),
                        }
                    }
                    (idle, None)
                })
            })
            .collect();
        openers
            .into_iter()
            .map(|h| h.join().expect("opener thread"))
            .collect()
    });
    let mut idle = Vec::with_capacity(IDLE_CONNECTIONS);
    let mut failure = None;
    for (mut some, error) in opened {
        idle.append(&mut some);
        failure = failure.or(error);
    }
    if let Some(e) = failure {
        panic!(
            "an idle connection's handshake failed ({e}) with {} of {IDLE_CONNECTIONS} open\n{}",
            idle.len(),
            log_digest(server)
        );
    }
    idle
}

/// Closes every idle connection abruptly, with a reset. Each first sends a
/// 4 KiB read and waits for the reply to arrive, unread: the reply header
/// (peeked, not consumed) proves the connection was still served after
/// sitting idle, and closing a socket with unread input makes Linux send
/// RST instead of FIN (the same as SO_LINGER with a zero timeout, which
/// std cannot set on stable Rust without unsafe code).
fn close_abruptly(server: &Server, mut idle: Vec<NbdClient>) {
    let mut cookies = Vec::with_capacity(idle.len());
    for (i, c) in idle.iter_mut().enumerate() {
        let offset = (i as u64 * 4096) % FIO_REGION_BYTES;
        let cookie = c
            .send(nbd::Command::Read, 0, offset, 4096, &[])
            .unwrap_or_else(|e| panic!("idle connection {i}: send a read: {e}"));
        cookies.push(cookie);
    }
    for (i, (c, cookie)) in idle.iter().zip(cookies).enumerate() {
        let mut header = [0u8; nbd::SIMPLE_REPLY_LEN];
        let deadline = Instant::now() + IO_TIMEOUT;
        loop {
            match c.sock.peek(&mut header) {
                Ok(n) if n == header.len() => break,
                Ok(0) => panic!(
                    "idle connection {i}: closed by the server after sitting idle\n{}",
                    log_digest(server)
                ),
                // Part of the header: wait for the rest.
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => panic!("idle connection {i}: no reply to its read: {e}"),
            }
            assert!(
                Instant::now() < deadline,
                "idle connection {i}: the reply header never arrived in full"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            nbd::decode_simple_reply(&header),
            Some((nbd::NBD_SUCCESS, cookie)),
            "idle connection {i}: reply to its read"
        );
    }
    // Every socket holds its unread 4 KiB: each close is a reset.
    drop(idle);
}

/// Waits until the server holds no more descriptors than `limit`: it has
/// seen every reset and released every connection.
fn wait_fds_released(server: &Server, limit: usize) {
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        let fds = open_fds(server.pid());
        if fds <= limit {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the server still holds {fds} descriptors (at most {limit} expected) \
             {IO_TIMEOUT:?} after the idle connections reset\n{}",
            log_digest(server)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn idle_connections_in_mode(mode: &str) {
    let t0 = Instant::now();
    let mut server = Server::start(&["--mode", mode, "--volume", VOLUME_ARG]);
    let pid = server.pid();

    // Warm-up: fio's region allocated, one handshake done, then the
    // baselines.
    fill_fio_region(&server);
    assert_good_client_works(server.addr(), EXPORT, GOOD_CLIENT_OFFSET);
    let rss_before = rss_bytes(pid);
    let fds_before = open_fds(pid);

    let t_open = Instant::now();
    let idle = open_idle(&server);
    let open_time = t_open.elapsed();

    fio_verify(&server, &format!("fio-{mode}"), false);
    server.assert_healthy();

    let rss_after = rss_bytes(pid);
    let growth = rss_after.saturating_sub(rss_before);
    eprintln!(
        "scale [{mode}]: {IDLE_CONNECTIONS} idle connections opened in {open_time:.2?}; \
         RSS {} KiB -> {} KiB: +{} KiB, {:.1} KiB per connection; \
         server fds {fds_before} -> {}",
        rss_before >> 10,
        rss_after >> 10,
        growth >> 10,
        growth as f64 / 1024.0 / IDLE_CONNECTIONS as f64,
        open_fds(pid),
    );
    assert!(
        growth < RSS_GROWTH_LIMIT_BYTES,
        "[{mode}] {IDLE_CONNECTIONS} idle connections grew the server's RSS by {} KiB \
         ({:.1} KiB each); the limit is {} KiB",
        growth >> 10,
        growth as f64 / 1024.0 / IDLE_CONNECTIONS as f64,
        RSS_GROWTH_LIMIT_BYTES >> 10
    );

    close_abruptly(&server, idle);
    wait_fds_released(&server, fds_before + SERVER_FD_SLACK);
    server.assert_healthy();

    // Normal clients after: fio's data is intact, and a new client writes
    // and reads back.
    fio_verify(&server, &format!("fio-{mode}-after"), true);
    assert_good_client_works(server.addr(), EXPORT, GOOD_CLIENT_OFFSET + 4096);
    server.assert_healthy();
    eprintln!(
        "scale [{mode}]: done in {:.2?}; RSS after the resets {} KiB",
        t0.elapsed(),
        rss_bytes(pid) >> 10
    );
}

#[test]
fn two_thousand_idle_connections_cost_little_and_reset_cleanly() {
    raise_own_fd_limit();
    for mode in MODES {
        idle_connections_in_mode(mode);
    }
}
