//! Helpers for the integration tests: start the real `lull` binary on
//! loopback and talk NBD to it with a small blocking client.
//!
//! ```ignore
//! let server = Server::start(&["--volume", "vol0:16M"]);
//! let mut client = NbdClient::connect(server.addr(), "vol0").unwrap();
//! assert_eq!(client.write(0, &[7; 4096]).unwrap(), 0);
//! assert_eq!(client.read(0, 4096).unwrap().unwrap(), vec![7; 4096]);
//! server.assert_healthy();
//! ```
//!
//! Every socket has read and write timeouts of [`IO_TIMEOUT`], so a server
//! that hangs fails the test instead of hanging it.
//!
//! Every tier's binary (tests/fast, tests/clients, tests/replication,
//! tests/spdk, tests/system; docs/TESTING.md) holds this module once, as
//! `mod common`; its files use `crate::common`. Beside this file:
//! [`replica`] (the test replica: a `lull replica` process or a replica
//! in a store daemon), [`state`] (waiting on what the server reports:
//! `replica_list`, the kernel's socket table) and [`tools`] (the real
//! clients and SPDK's tools, run and read).

// Each binary uses only some of the helpers.
#![allow(dead_code)]

pub mod pki;
pub mod replica;
pub mod state;
pub mod tools;

// Not every binary starts replicas.
// Not every binary makes certificates.
#[allow(unused_imports)]
pub use pki::make_pki;
#[allow(unused_imports)]
pub use replica::{Kind, Replica};
pub use state::{wait_until, ReplicaStatus};

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lull_proto::nbd::{self, Request};

/// Read and write timeout of every test socket: long enough for a loaded
/// CI machine, short enough that a hang is a failure within a test's budget.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the server may take to print "listening on".
pub const START_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the server may take to exit after SIGTERM before it is killed.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A fresh scratch directory under `CARGO_TARGET_TMPDIR`, named after the
/// test, the process and a count (tests of one binary run side by side).
/// A passing test removes it when the value drops; a failing one (the drop
/// runs while panicking) keeps it and prints where, so its files can be
/// looked at. Declare it before the server that uses it: values drop in
/// reverse order, so the server stops first.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        Scratch::under(Path::new(env!("CARGO_TARGET_TMPDIR")), name)
    }

    /// A scratch directory on tmpfs (/dev/shm), for what a memory
    /// filesystem does differently (inline I/O, no ZERO_RANGE). Fails the
    /// test, saying so, where /dev/shm is missing or not tmpfs (Debian and
    /// containers have it): the test does not pass without it.
    pub fn on_tmpfs(name: &str) -> Scratch {
        let mounts = std::fs::read_to_string("/proc/mounts").expect("read /proc/mounts");
        assert!(
            mounts.lines().any(|l| {
                let mut f = l.split_whitespace().skip(1);
                (f.next(), f.next()) == (Some("/dev/shm"), Some("tmpfs"))
            }),
            "this test needs /dev/shm mounted as tmpfs"
        );
        Scratch::under(Path::new("/dev/shm"), &format!("lull-{name}"))
    }

    fn under(base: &Path, name: &str) -> Scratch {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = base.join(format!(
            "{name}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the scratch directory");
        Scratch(dir)
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        remove_unless_panicking(&self.0);
    }
}

/// Removes a test's directory, or, while the test panics, keeps it and
/// says where it is.
pub fn remove_unless_panicking(dir: &Path) {
    if std::thread::panicking() {
        eprintln!("test files kept in {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// A running `lull serve`, stopped (SIGTERM, then SIGKILL) when dropped.
/// Its stderr (the log) goes to a file in a fresh directory under
/// `CARGO_TARGET_TMPDIR`, and so does its JSON-RPC socket unless the
/// arguments name one (or a config file): tests ask the server for its
/// state there, and no two servers share the default socket.
pub struct Server {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
    stderr_path: PathBuf,
    /// The JSON-RPC socket: `--rpc-socket` from the arguments, or one in
    /// `dir`; `None` when a config file chooses.
    rpc_socket: Option<PathBuf>,
    /// What the server printed before its NBD address (volumes, the
    /// NVMe/TCP address).
    startup: Vec<String>,
}

impl Server {
    /// Starts `lull serve --listen 127.0.0.1:0 <args>` and waits until it
    /// prints the address it listens on. Port 0 lets the kernel pick a free
    /// port, so parallel tests never race for one.
    pub fn start(args: &[&str]) -> Server {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "lull-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the test directory");
        let stderr_path = dir.join("stderr.log");
        let stderr = File::create(&stderr_path).expect("create the stderr log");
        let named = args
            .iter()
            .position(|a| *a == "--rpc-socket")
            .map(|i| PathBuf::from(args[i + 1]));
        let by_config = args.contains(&"--config");
        let own = (named.is_none() && !by_config).then(|| dir.join("rpc.sock"));
        let mut command = Command::new(env!("CARGO_BIN_EXE_lull"));
        command
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args);
        if let Some(sock) = &own {
            command.arg("--rpc-socket").arg(sock);
        }
        let (mut child, rx) = spawn_with_stdout(&mut command, stderr);
        let deadline = Instant::now() + START_TIMEOUT;
        let mut startup = Vec::new();
        let addr = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(a) = line.strip_prefix("listening on ") {
                        if let Ok(addr) = a.trim().parse::<SocketAddr>() {
                            break addr;
                        }
                    }
                    startup.push(line);
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let log = std::fs::read_to_string(&stderr_path).unwrap_or_default();
                    panic!("lull serve did not start ({e}); stderr:\n{log}");
                }
            }
        };
        let server = Server {
            child,
            addr,
            dir,
            stderr_path,
            rpc_socket: named.or(own),
            startup,
        };
        server.wait_until_connectable();
        server
    }

    fn wait_until_connectable(&self) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(mut probe) = TcpStream::connect_timeout(&self.addr, IO_TIMEOUT) {
                // Take the greeting, so the probe ends with a clean close
                // rather than a reset over unread bytes.
                let _ = probe.set_read_timeout(Some(IO_TIMEOUT));
                let _ = read_greeting(&mut probe);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "nothing accepts on {}",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The NVMe/TCP target's address, when started with `--nvmf-listen`.
    pub fn nvmf_addr(&self) -> Option<SocketAddr> {
        self.startup
            .iter()
            .find_map(|l| l.strip_prefix("nvmf listening on ")?.trim().parse().ok())
    }

    /// A scratch directory that lives as long as the test's build.
    pub fn dir(&self) -> &PathBuf {
        &self.dir
    }

    /// The server's JSON-RPC socket.
    pub fn rpc_socket(&self) -> &Path {
        self.rpc_socket
            .as_deref()
            .expect("test bug: a server started with --config has the socket its file names")
    }

    /// `lull rpc METHOD PARAMS` on the server's socket: the JSON result.
    pub fn rpc(&self, method: &str, params: &str) -> serde_json::Value {
        rpc(self.rpc_socket(), method, params)
    }

    /// The replicas of `volume`, as `replica_list` reports them.
    pub fn replicas(&self, volume: &str) -> Vec<ReplicaStatus> {
        state::replica_states(self.rpc_socket(), volume)
    }

    /// Waits up to `timeout` until `pred` holds for `replica_list` of
    /// `volume`, and returns that list; fails the test naming `what`, the
    /// last list and the log.
    pub fn wait_replicas(
        &self,
        volume: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&[ReplicaStatus]) -> bool,
    ) -> Vec<ReplicaStatus> {
        let mut last = Vec::new();
        if wait_until(timeout, || {
            last = self.replicas(volume);
            pred(&last)
        }) {
            return last;
        }
        panic!(
            "{what}: not within {timeout:?}; replica_list {volume}: {last:#?}\nlog:\n{}",
            self.stderr()
        );
    }

    /// Waits until the replica `target` of `volume` is in a state `pred`
    /// accepts; returns its status.
    pub fn wait_replica(
        &self,
        volume: &str,
        target: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&ReplicaStatus) -> bool,
    ) -> ReplicaStatus {
        let list = self.wait_replicas(volume, timeout, what, |l| {
            l.iter().any(|r| r.addr == target && pred(r))
        });
        list.into_iter()
            .find(|r| r.addr == target)
            .expect("the replica just seen")
    }

    /// Everything the server has logged so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Asserts the log holds a line with every one of `needles` (waiting
    /// briefly: a line about a client that went away may trail the test's
    /// last socket call). Only for a line that is itself the feature: a
    /// warning an operator must see, or a refusal whose reason nothing
    /// but the log carries (docs/TESTING.md); a test waits on state.
    pub fn assert_logged(&self, needles: &[&str]) {
        assert!(
            wait_until(IO_TIMEOUT, || log_has(&self.stderr(), needles)),
            "expected a log line with {needles:?}; stderr:\n{}",
            self.stderr()
        );
    }

    /// Asserts the server process is alive and has not logged a panic (a
    /// panic in a reactor thread need not end the process).
    pub fn assert_healthy(&mut self) {
        match self.child.try_wait() {
            Ok(None) => {}
            Ok(Some(status)) => panic!("lull exited with {status}; stderr:\n{}", self.stderr()),
            Err(e) => panic!("cannot poll the lull process: {e}"),
        }
        let log = self.stderr();
        assert!(!log.contains("panicked"), "lull panicked; stderr:\n{log}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        // A failing test keeps the log for a look; a passing one cleans up.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("lull log kept in {}", self.stderr_path.display());
        }
    }
}

impl Server {
    /// SIGTERM, a wait of up to [`STOP_TIMEOUT`], then SIGKILL.
    fn stop(&mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill")
            .args(["-TERM", &pid])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => break,
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether one line of `log` holds every one of `needles`.
pub fn log_has(log: &str, needles: &[&str]) -> bool {
    log.lines().any(|l| needles.iter().all(|n| l.contains(n)))
}

/// A loopback port free at the time of the call (for a process that must
/// come back on the same address, and for addresses nothing listens on).
pub fn free_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr")
}

/// Spawns `cmd` (the lull binary, logging at info) with its stderr into
/// `log` and its stdout drained by a thread for the life of the process,
/// so the process never blocks on a full pipe: the lines come on the
/// receiver (what it says it serves, the address it bound).
pub fn spawn_with_stdout(cmd: &mut Command, log: File) -> (Child, mpsc::Receiver<String>) {
    let mut child = cmd
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // Once nobody listens, the lines are dropped: keep draining.
            let _ = tx.send(line);
        }
    });
    (child, rx)
}

/// A TCP connection to `addr` with the test timeouts set.
pub fn connect_raw(addr: SocketAddr) -> TcpStream {
    let sock = TcpStream::connect_timeout(&addr, IO_TIMEOUT).expect("connect to lull");
    sock.set_read_timeout(Some(IO_TIMEOUT))
        .expect("set read timeout");
    sock.set_write_timeout(Some(IO_TIMEOUT))
        .expect("set write timeout");
    sock.set_nodelay(true).expect("set nodelay");
    sock
}

/// Reads and checks the 18-byte server greeting; returns its handshake flags.
pub fn read_greeting(sock: &mut impl Read) -> io::Result<u16> {
    let mut greeting = [0u8; nbd::SERVER_GREETING_LEN];
    sock.read_exact(&mut greeting)?;
    let (magic, rest) = greeting.split_at(8);
    let (opt_magic, flags) = rest.split_at(8);
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    if magic != nbd::NBDMAGIC.to_be_bytes() {
        return Err(bad("greeting does not start with NBDMAGIC"));
    }
    if opt_magic != nbd::IHAVEOPT.to_be_bytes() {
        return Err(bad("greeting is not newstyle (no IHAVEOPT)"));
    }
    Ok(u16::from_be_bytes([flags[0], flags[1]]))
}

/// The client flags every test client sends.
pub const CLIENT_FLAGS: u32 = nbd::NBD_FLAG_C_FIXED_NEWSTYLE | nbd::NBD_FLAG_C_NO_ZEROES;

/// An option on the wire: IHAVEOPT, option, length, payload.
pub fn encode_option(option: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(nbd::OPTION_HEADER_LEN + payload.len());
    out.extend_from_slice(&nbd::IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

/// `NBD_OPT_GO` for `export` with no information requests.
pub fn encode_go(export: &str) -> Vec<u8> {
    let mut payload = Vec::new();
    payload.extend_from_slice(&(export.len() as u32).to_be_bytes());
    payload.extend_from_slice(export.as_bytes());
    payload.extend_from_slice(&0u16.to_be_bytes());
    encode_option(nbd::NBD_OPT_GO, &payload)
}

/// One option reply: `(option, reply type, payload)`.
pub fn read_option_reply(sock: &mut impl Read) -> io::Result<(u32, u32, Vec<u8>)> {
    let mut header = [0u8; nbd::OPTION_REPLY_HEADER_LEN];
    sock.read_exact(&mut header)?;
    let word = |at: usize| {
        u32::from_be_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    if header[..8] != nbd::NBD_REP_MAGIC.to_be_bytes() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "option reply without NBD_REP_MAGIC",
        ));
    }
    let (option, reply_type, len) = (word(8), word(12), word(16));
    if len as usize > nbd::MAX_STRING_LEN + 64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("option reply of {len} bytes"),
        ));
    }
    let mut payload = vec![0u8; len as usize];
    sock.read_exact(&mut payload)?;
    Ok((option, reply_type, payload))
}

/// How a connection ended when the test expected the server to close it.
#[derive(Debug, PartialEq, Eq)]
pub enum Closed {
    /// Orderly EOF after this many further bytes.
    Eof(usize),
    /// Connection reset after this many further bytes (the server closed
    /// with unread input in its receive buffer).
    Reset(usize),
}

/// Reads until the server closes the connection, discarding what arrives.
/// A timeout (the server kept the connection open) is an error.
pub fn wait_closed(sock: &mut impl Read) -> io::Result<Closed> {
    let mut buf = [0u8; 64 * 1024];
    let mut seen = 0;
    let deadline = Instant::now() + IO_TIMEOUT;
    loop {
        match sock.read(&mut buf) {
            Ok(0) => return Ok(Closed::Eof(seen)),
            Ok(n) => seen += n,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(Closed::Reset(seen)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "server kept sending and never closed",
            ));
        }
    }
}

/// Asserts the server closes `sock` within [`IO_TIMEOUT`].
pub fn assert_closed(sock: &mut TcpStream, what: &str) {
    match wait_closed(sock) {
        Ok(_) => {}
        Err(e) => panic!("{what}: expected the server to close the connection, got {e}"),
    }
}

/// A blocking NBD client in the transmission phase (simple replies only).
pub struct NbdClient {
    pub sock: TcpStream,
    pub size_bytes: u64,
    pub transmission_flags: u16,
    next_cookie: u64,
}

impl NbdClient {
    /// Fixed newstyle handshake with `NBD_OPT_GO` for `export`.
    pub fn connect(addr: SocketAddr, export: &str) -> io::Result<NbdClient> {
        let mut sock = connect_raw(addr);
        read_greeting(&mut sock)?;
        let mut hello = CLIENT_FLAGS.to_be_bytes().to_vec();
        hello.extend_from_slice(&encode_go(export));
        sock.write_all(&hello)?;
        let mut export_info = None;
        loop {
            let (option, reply_type, payload) = read_option_reply(&mut sock)?;
            if option != nbd::NBD_OPT_GO {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("reply for option {option}"),
                ));
            }
            match reply_type {
                nbd::NBD_REP_ACK => break,
                nbd::NBD_REP_INFO
                    if payload.len() == 12
                        && payload[..2] == nbd::NBD_INFO_EXPORT.to_be_bytes() =>
                {
                    let mut size = [0u8; 8];
                    size.copy_from_slice(&payload[2..10]);
                    export_info = Some((
                        u64::from_be_bytes(size),
                        u16::from_be_bytes([payload[10], payload[11]]),
                    ));
                }
                nbd::NBD_REP_INFO => {}
                other => {
                    let text = String::from_utf8_lossy(&payload);
                    return Err(io::Error::other(format!(
                        "NBD_OPT_GO refused: {other:#x} {text}"
                    )));
                }
            }
        }
        let (size_bytes, transmission_flags) = export_info.ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "ACK without NBD_INFO_EXPORT")
        })?;
        Ok(NbdClient {
            sock,
            size_bytes,
            transmission_flags,
            next_cookie: 1,
        })
    }

    pub fn cookie(&mut self) -> u64 {
        self.next_cookie += 1;
        self.next_cookie
    }

    /// Sends a request header and its payload, returning the cookie.
    pub fn send(
        &mut self,
        command: nbd::Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> io::Result<u64> {
        let cookie = self.cookie();
        let header = nbd::encode_request(&Request {
            flags,
            command,
            cookie,
            offset,
            length,
        });
        self.sock.write_all(&header)?;
        self.sock.write_all(payload)?;
        Ok(cookie)
    }

    /// Reads one simple reply header: `(error, cookie)`.
    pub fn reply(&mut self) -> io::Result<(u32, u64)> {
        let mut header = [0u8; nbd::SIMPLE_REPLY_LEN];
        self.sock.read_exact(&mut header)?;
        nbd::decode_simple_reply(&header).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "simple reply with a bad magic")
        })
    }

    /// Reads the reply to `cookie`, checking it is the one that came.
    pub fn reply_to(&mut self, cookie: u64) -> io::Result<u32> {
        let (error, got) = self.reply()?;
        if got != cookie {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("reply cookie {got}, expected {cookie}"),
            ));
        }
        Ok(error)
    }

    /// `NBD_CMD_READ`: `Ok(Ok(data))` or `Ok(Err(nbd_error))`.
    pub fn read(&mut self, offset: u64, length: u32) -> io::Result<Result<Vec<u8>, u32>> {
        let cookie = self.send(nbd::Command::Read, 0, offset, length, &[])?;
        let error = self.reply_to(cookie)?;
        if error != nbd::NBD_SUCCESS {
            return Ok(Err(error));
        }
        let mut data = vec![0u8; length as usize];
        self.sock.read_exact(&mut data)?;
        Ok(Ok(data))
    }

    /// `NBD_CMD_WRITE`: returns the reply's error (0 on success).
    pub fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<u32> {
        let cookie = self.send(nbd::Command::Write, 0, offset, data.len() as u32, data)?;
        self.reply_to(cookie)
    }

    /// `NBD_CMD_DISC`, then close.
    pub fn disconnect(mut self) {
        let _ = self.send(nbd::Command::Disc, 0, 0, 0, &[]);
    }
}

/// Reads `[offset, offset + len)` of `export` with a fresh connection,
/// retrying until the volume answers (a replicated volume may still be
/// electing its replicas); fails the test after `timeout`.
pub fn read_when_ready(
    server: &Server,
    export: &str,
    offset: u64,
    len: u32,
    timeout: Duration,
) -> Vec<u8> {
    let deadline = Instant::now() + timeout;
    loop {
        let data = NbdClient::connect(server.addr(), export)
            .ok()
            .and_then(|mut c| c.read(offset, len).ok()?.ok());
        if let Some(data) = data {
            return data;
        }
        assert!(
            Instant::now() < deadline,
            "volume {export} never became readable in {timeout:?}; log:\n{}",
            server.stderr()
        );
        // Each try is a new connection: not too many of them.
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Deterministic non-zero test data: `len` bytes derived from `seed`.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            // xorshift64: cheap, and different seeds give different bytes.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8 | 1
        })
        .collect()
}

/// A fresh well-behaved client writes 4 KiB at `offset`, reads it back and
/// compares, then disconnects: the server still serves after whatever the
/// test did to it.
pub fn assert_good_client_works(addr: SocketAddr, export: &str, offset: u64) {
    let mut client =
        NbdClient::connect(addr, export).expect("a good client completes the handshake");
    let data = pattern(offset ^ 0x5eed, 4096);
    assert_eq!(
        client.write(offset, &data).expect("write"),
        nbd::NBD_SUCCESS,
        "good client's write"
    );
    let back = client
        .read(offset, 4096)
        .expect("read")
        .expect("good client's read");
    assert!(
        back == data,
        "good client read back different data at {offset}"
    );
    client.disconnect();
}

impl Server {
    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: a crash, nothing flushed, detached or logged.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for the exit (a clean stop); `None` if it did not
    /// exit within `timeout` (it is killed then).
    pub fn terminate(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    self.kill();
                    return None;
                }
            }
        }
    }
}

/// Fails the test, naming the Debian package to install, when `tool` is
/// not on the PATH (scripts/test installs them all).
pub fn require(tool: &str, package: &str) {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        found,
        "{tool} not found: install the Debian package {package} (scripts/test does)"
    );
}

/// The system Python, after checking it has libnbd's bindings (`import
/// nbd`): fails the test, naming the package, when it does not.
pub fn python_with_nbd() -> &'static str {
    let python = "/usr/bin/python3";
    let has_nbd = Command::new(python)
        .args(["-c", "import nbd"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_nbd,
        "libnbd's Python bindings are missing: install the python3-libnbd package (scripts/test does)"
    );
    python
}

/// CPU time (utime + stime, all threads) of a process, in clock ticks
/// (USER_HZ, 100 per second on Linux).
pub fn process_cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    // The command name may hold spaces and parentheses: fields start after
    // the last ')'.
    let fields: Vec<&str> = stat[stat.rfind(')').expect("stat comm") + 2..]
        .split_whitespace()
        .collect();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// `lull rpc --socket SOCK METHOD [PARAMS]`, run to its end.
pub fn rpc_output(sock: &Path, method: &str, params: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lull"))
        .args(["rpc", "--socket"])
        .arg(sock)
        .arg(method)
        .args((!params.is_empty()).then_some(params))
        .output()
        .expect("run lull rpc")
}

/// `lull rpc --socket SOCK METHOD [PARAMS]`: its JSON result; panics with
/// the command's stderr when it fails.
pub fn rpc(sock: &Path, method: &str, params: &str) -> serde_json::Value {
    let out = rpc_output(sock, method, params);
    assert!(
        out.status.success(),
        "lull rpc {method} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("rpc JSON")
}

/// `lull rpc --socket SOCK METHOD PARAMS` that may fail: (exit success,
/// stdout + stderr).
pub fn rpc_outcome(sock: &Path, method: &str, params: &str) -> (bool, String) {
    let out = rpc_output(sock, method, params);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// fio's JSON output (`--output-format=json`); panics with its output when
/// fio failed.
pub fn fio_json(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "fio failed with {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&text[text.find('{').expect("fio JSON")..]).expect("fio JSON")
}

/// GET /metrics from the Prometheus endpoint on `port`: the body of a
/// 200 reply (panics with the reply otherwise).
pub fn scrape_metrics(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to metrics");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    resp[resp.find("\r\n\r\n").expect("headers end") + 4..].to_string()
}

/// Mounts a tmpfs of `size` at `dir` (root only), unmounted on drop.
pub struct Tmpfs(pub PathBuf);

impl Tmpfs {
    pub fn mount(dir: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(dir).expect("mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "this test fills a small tmpfs and needs root to mount one: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}
