//! The test replica: a `lull replica` process ([`Kind::Process`]) or a
//! replica named "r" in a `lull serve --store` daemon ([`Kind::Store`]),
//! on loopback, killed and restarted on the same address and data as a
//! test likes. The engine names it by [`Replica::target`].
//!
//! ```ignore
//! let dir = Scratch::new("mytest");
//! let mut a = Replica::start(Kind::Process, &dir.join("a"), "64M");
//! let b = Replica::start(Kind::Store, &dir.join("b"), "64M");
//! let spec = format!("v:64M:replicas={}+{}", a.target(), b.target());
//! let server = Server::start(&["--replica-insecure", "--volume", &spec]);
//! a.kill();    // SIGKILL
//! a.restart(); // same address, same data
//! ```
//!
//! A replica's links are plain (`--insecure`) unless its flags choose TLS
//! (tests/replication/replica_tls.rs). Its process's stderr goes to
//! `replica.log` in its directory, across restarts.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use super::{remove_unless_panicking, rpc, spawn_with_stdout, START_TIMEOUT};

/// How long a replica may take to stop after SIGTERM: `lull replica`
/// waits up to 30 s for in-flight I/O (its SHUTDOWN_TIMEOUT).
const REPLICA_STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// The `lull replica` flags that choose how links authenticate; without
/// one the helper adds `--insecure`.
const LINK_FLAGS: [&str; 3] = ["--tls-psk", "--tls-certs", "--insecure"];

/// What serves a test replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A `lull replica --dir` process: one replica, fault injection and
    /// `--uring` options available.
    Process,
    /// A `lull serve --store` daemon holding one replica named "r"
    /// (created with `replica_create`), addressed as `HOST:PORT/r`.
    Store,
}

impl Kind {
    /// Short, for the names of a test's files: the two kinds of one test
    /// run side by side.
    pub fn tag(self) -> &'static str {
        match self {
            Kind::Process => "proc",
            Kind::Store => "store",
        }
    }
}

/// The name of the one replica a [`Kind::Store`] daemon holds.
pub const STORE_REPLICA: &str = "r";

/// A running replica, killed when dropped (its directory is removed then
/// if the test passed; a failing test keeps it, with the log).
pub struct Replica {
    kind: Kind,
    child: Option<Child>,
    /// Port 0 until the first start has bound one; the same one after.
    addr: SocketAddr,
    dir: PathBuf,
    size: String,
    /// `lull replica` flags besides `--listen`, `--size` and `--dir`.
    flags: Vec<String>,
}

impl Replica {
    /// A replica of `kind` and `size` in `dir` (made afresh), plain links.
    pub fn start(kind: Kind, dir: &Path, size: &str) -> Replica {
        Replica::start_with(kind, dir, size, &[])
    }

    /// A replica with more `lull replica` flags ([`Kind::Process`] only):
    /// link authentication, fault injection, `--uring`.
    pub fn start_with(kind: Kind, dir: &Path, size: &str, flags: &[&str]) -> Replica {
        Replica::try_start_with(kind, dir, size, flags)
            .unwrap_or_else(|log| panic!("replica in {} did not start; log:\n{log}", dir.display()))
    }

    /// [`Replica::start_with`], or `Err(log)` when the process exits
    /// before it listens (a refused flag).
    pub fn try_start_with(
        kind: Kind,
        dir: &Path,
        size: &str,
        flags: &[&str],
    ) -> Result<Replica, String> {
        assert!(
            kind == Kind::Process || flags.is_empty(),
            "test bug: {flags:?} are `lull replica` flags, a store replica has none"
        );
        // Fresh: a test's replica starts empty.
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).expect("create the replica directory");
        let mut r = Replica {
            kind,
            child: None,
            addr: "127.0.0.1:0".parse().expect("an address"),
            dir: dir.to_path_buf(),
            size: size.to_string(),
            flags: with_link(flags),
        };
        r.try_restart()?;
        if kind == Kind::Store {
            // Once: a restarted store restores its replicas.
            rpc(
                &r.rpc_socket(),
                "replica_create",
                &format!(r#"{{"name": "{STORE_REPLICA}", "size": "{size}"}}"#),
            );
        }
        Ok(r)
    }

    /// Starts the process again on the same address and data (after
    /// [`Replica::kill`], or killing it first).
    pub fn restart(&mut self) {
        if let Err(log) = self.try_restart() {
            panic!("replica on {} did not restart; log:\n{log}", self.addr);
        }
    }

    /// [`Replica::restart`] with other flags (a link's key, say).
    pub fn restart_with(&mut self, flags: &[&str]) {
        self.flags = with_link(flags);
        self.restart();
    }

    /// Starts the process and waits until it serves, which it says on
    /// stdout (`replica listening on ADDR`; a store daemon `replica store
    /// DIR on ADDR`, then `listening on` once everything serves). `Err`
    /// with this start's log when the process exits first.
    fn try_restart(&mut self) -> Result<(), String> {
        self.kill();
        let log_path = self.log_path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("open the replica log");
        let log_start = log.metadata().map(|m| m.len() as usize).unwrap_or(0);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lull"));
        match self.kind {
            Kind::Process => {
                cmd.args(["replica", "--listen", &self.addr.to_string()])
                    .args(["--size", &self.size])
                    .arg("--dir")
                    .arg(self.dir.join("data"))
                    .args(&self.flags);
            }
            Kind::Store => {
                cmd.args(["serve", "--listen", "127.0.0.1:0", "--store"])
                    .arg(self.dir.join("store"))
                    .args(["--replica-listen", &self.addr.to_string()])
                    .arg("--replica-insecure")
                    .arg("--rpc-socket")
                    .arg(self.rpc_socket());
            }
        }
        let (mut child, rx) = spawn_with_stdout(&mut cmd, log);
        let deadline = Instant::now() + START_TIMEOUT;
        let mut bound = None;
        loop {
            if let Some(status) = child.try_wait().expect("poll the replica") {
                assert!(!status.success(), "the replica exited 0 at start");
                let text = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(text.get(log_start..).unwrap_or(&text).to_string());
            }
            if let Ok(line) = rx.recv_timeout(Duration::from_millis(50)) {
                match self.kind {
                    Kind::Process => {
                        if let Some(rest) = line.strip_prefix("replica listening on ") {
                            bound = rest.split_whitespace().next().and_then(|a| a.parse().ok());
                            if bound.is_some() {
                                break;
                            }
                        }
                    }
                    Kind::Store => {
                        // "replica store DIR on ADDR: N replica(s)"
                        if line.starts_with("replica store ") {
                            bound = line
                                .rsplit_once(" on ")
                                .and_then(|(_, a)| a.split_once(": "))
                                .and_then(|(a, _)| a.parse().ok());
                        }
                        if line.starts_with("listening on ") && bound.is_some() {
                            break;
                        }
                    }
                }
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "replica in {} neither served nor exited in {START_TIMEOUT:?}; log:\n{}",
                    self.dir.display(),
                    self.log()
                );
            }
        }
        self.addr = bound.expect("the address it listens on");
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: a crash, nothing flushed or detached.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait for the exit: a clean stop.
    pub fn stop(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("the replica runs");
        let ok = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -TERM {}", child.id());
        let deadline = Instant::now() + REPLICA_STOP_TIMEOUT;
        loop {
            if let Some(status) = child.try_wait().expect("poll the replica") {
                return status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "replica on {} did not stop in {REPLICA_STOP_TIMEOUT:?}; log:\n{}",
                    self.addr,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How the engine names this replica: `ADDR`, or `ADDR/r` in a store.
    pub fn target(&self) -> String {
        match self.kind {
            Kind::Process => self.addr.to_string(),
            Kind::Store => format!("{}/{STORE_REPLICA}", self.addr),
        }
    }

    /// The process id (the replica runs).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the replica runs").id()
    }

    /// The store daemon's JSON-RPC socket ([`Kind::Store`]).
    pub fn rpc_socket(&self) -> PathBuf {
        self.dir.join("store.sock")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("replica.log")
    }

    /// Everything the process logged, across restarts.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The directory with `data.img`, `meta.json` and `intent.bin`.
    pub fn replica_dir(&self) -> PathBuf {
        match self.kind {
            Kind::Process => self.dir.join("data"),
            Kind::Store => self.dir.join("store").join("replicas").join(STORE_REPLICA),
        }
    }

    pub fn data_file(&self) -> PathBuf {
        self.replica_dir().join("data.img")
    }

    pub fn intent_file(&self) -> PathBuf {
        self.replica_dir().join("intent.bin")
    }

    /// The replica's record (`meta.json`): whether the last engine
    /// detached cleanly and nothing was written since.
    pub fn clean(&self) -> bool {
        let path = self.replica_dir().join("meta.json");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let meta: serde_json::Value = serde_json::from_str(&text).expect("meta.json is JSON");
        meta["clean"].as_bool().expect("meta.json has clean")
    }

    /// A counter (`KEY=N`) of the last stop line of a `lull replica`
    /// process, which reports its data file's I/O as it stops (it has no
    /// RPC to ask while it runs).
    pub fn stop_counter(&self, key: &str) -> u64 {
        let log = self.log();
        let at = log
            .rfind(&format!("{key}="))
            .unwrap_or_else(|| panic!("no {key} in the replica's log:\n{log}"));
        log[at + key.len() + 1..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .expect("a count")
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
        remove_unless_panicking(&self.dir);
    }
}

/// `flags` with `--insecure` first unless they choose a link themselves.
fn with_link(flags: &[&str]) -> Vec<String> {
    let chosen = flags.iter().any(|f| LINK_FLAGS.contains(f));
    (!chosen)
        .then_some("--insecure")
        .into_iter()
        .chain(flags.iter().copied())
        .map(str::to_string)
        .collect()
}
