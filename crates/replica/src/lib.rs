//! The replica server: owns one volume's copy (a sparse data file plus a
//! small metadata record) and serves the replica protocol
//! ([`lull_proto::replica`]) to the engine over TCP.
//!
//! ```ignore
//! let fw = Framework::start(FrameworkConfig::new(vec![3], Mode::Interrupt))?;
//! let config = ReplicaConfig {
//!     listen: "127.0.0.1:10900".parse()?,
//!     dir: "/var/lib/lull/r0".into(),
//!     size_bytes: 1 << 30,
//!     direct: false,
//! };
//! let server = ReplicaServer::start(fw.handle(), &config)?;
//! println!("replica on {}", server.local_addr());
//! // ... until SIGTERM:
//! server.shutdown(Duration::from_secs(30))?; // drains, fdatasyncs, marks clean
//! ```
//!
//! Layout of `DIR`: `data.img` (the volume, sparse, through io_uring),
//! `meta.json` ([`Meta`]: size, generation, clean flag) and `lock` (an
//! exclusive advisory lock, so two replicas never share a directory).
//!
//! Threads: one acceptor thread on the main reactor; each connection gets
//! its own lull thread (round-robin over the reactors) with one poller that
//! owns the socket and the connection's file channel (the scaffolding is
//! `lull_net::server`, shared with `lull-nbd`).
//! Metadata writes (two fsyncs) run on short-lived helper OS threads and
//! report back with a message, so no reactor ever blocks on them.
//!
//! Protocol rules on top of the codec: the first frame of a connection is
//! HELLO; more may follow (the engine probes with a plain HELLO, then
//! attaches on any connection). A HELLO with `HELLO_FLAG_ATTACH` marks the
//! replica dirty and raises its generation to the one sent (durably,
//! before the reply). The first WRITE/TRIM/WRITE_ZEROES on a replica whose
//! record says clean (a rebuild target is written before any attach)
//! first marks it dirty, durably. The HELLO reply reports the current
//! generation and whether the replica was clean when it started.

#![forbid(unsafe_code)]

mod conn;
pub mod meta;

use std::fs::{File, OpenOptions};
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use lull_bdev::{BdevError, BlockDevice, FileDev, FileOptions};
use lull_net::server::{Acceptor, Connections, Limits};
use lull_reactor::{Framework, FrameworkConfig, FrameworkHandle, Mode, PollerId, ReactorError, ThreadHandle};

pub use conn::{MAX_IN_FLIGHT, MAX_REPLY_QUEUE_BYTES};
pub use meta::{Meta, MetaError, META_FILE, META_FORMAT_VERSION};

use crate::conn::Conn;

/// File name of the volume data inside the replica directory.
pub const DATA_FILE: &str = "data.img";
/// File name of the lock file inside the replica directory.
pub const LOCK_FILE: &str = "lock";

/// Connections held at once. The engine opens a few per volume; each costs
/// a lull thread, an io_uring ring and up to `MAX_IN_FLIGHT` buffers, so
/// past this a new connection is closed at once (with a log line).
pub const MAX_CONNECTIONS: usize = 256;

/// A peer must send its HELLO within this time or be disconnected: a
/// silent connection must not hold a slot forever. The engine sends it at
/// once; 10 s matches the NBD handshake limit.
pub const HELLO_TIMEOUT_US: u64 = 10_000_000;

/// How long `run` waits at shutdown for connections to finish their
/// in-flight I/O before giving up (and leaving the replica dirty).
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(30);

/// Exit code for bad arguments or a directory that does not match them.
const EXIT_USAGE: u8 = 2;

/// Errors of the replica server.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("{0}")]
    BadArgs(String),
    #[error("{dir}: holds a volume of {meta_size} bytes, not the {size} bytes asked for (refusing to resize a replica)")]
    SizeMismatch {
        dir: PathBuf,
        meta_size: u64,
        size: u64,
    },
    #[error("{0}")]
    Meta(#[from] MetaError),
    #[error("{dir}: in use by another replica process")]
    Locked { dir: PathBuf },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("data file: {0}")]
    Bdev(#[from] BdevError),
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: io::Error },
    #[error(transparent)]
    Reactor(#[from] ReactorError),
    #[error("the replica is shutting down")]
    ShuttingDown,
    #[error("cannot start a metadata writer thread: {0}")]
    Helper(io::Error),
    #[error("{open} connection(s) still open after the shutdown timeout; the replica stays dirty")]
    Unclean { open: usize },
}

impl ReplicaError {
    /// The errno a peer is told (HELLO reply status) for this error.
    pub fn errno(&self) -> i32 {
        match self {
            ReplicaError::BadArgs(_) | ReplicaError::SizeMismatch { .. } => libc::EINVAL,
            ReplicaError::Meta(e) => e.errno(),
            ReplicaError::Locked { .. } => libc::EBUSY,
            ReplicaError::Io { source, .. }
            | ReplicaError::Listen { source, .. }
            | ReplicaError::Helper(source) => source.raw_os_error().unwrap_or(libc::EIO),
            ReplicaError::Bdev(e) => e.errno(),
            ReplicaError::Reactor(_) | ReplicaError::Unclean { .. } => libc::EIO,
            ReplicaError::ShuttingDown => libc::ESHUTDOWN,
        }
    }

    /// Process exit code: 2 for arguments that do not fit (as clap), 1 else.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            ReplicaError::BadArgs(_) | ReplicaError::SizeMismatch { .. } => {
                ExitCode::from(EXIT_USAGE)
            }
            _ => ExitCode::FAILURE,
        }
    }
}

/// `lull replica` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct ReplicaArgs {
    /// TCP address to serve the replica protocol on.
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: String,
    /// Directory holding data.img and meta.json (created if missing).
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
    /// Volume size, with an optional K/M/G/T (binary) suffix; must match an
    /// existing replica's size.
    #[arg(long, value_name = "SIZE")]
    pub size: String,
    /// Reactor cores, e.g. "1" or "0,2-3" [default: the last allowed core].
    #[arg(long, value_name = "LIST")]
    pub cores: Option<String>,
    /// Event mode of the reactors: poll, interrupt, hybrid or adaptive.
    #[arg(long, value_name = "MODE", default_value = "adaptive")]
    pub mode: String,
    /// Open the data file with O_DIRECT.
    #[arg(long)]
    pub direct: bool,
}

/// What a replica server needs, resolved and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaConfig {
    pub listen: SocketAddr,
    pub dir: PathBuf,
    pub size_bytes: u64,
    pub direct: bool,
}

/// Resolved `lull replica` settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaSettings {
    pub config: ReplicaConfig,
    pub cores: Vec<usize>,
    pub mode: Mode,
}

impl ReplicaArgs {
    /// Checks the arguments; `allowed_cpus` gives the default core.
    pub fn resolve(&self, allowed_cpus: &[usize]) -> Result<ReplicaSettings, ReplicaError> {
        let listen = self.listen.parse().map_err(|_| {
            ReplicaError::BadArgs(format!(
                "invalid listen address {:?}: expected ADDR:PORT",
                self.listen
            ))
        })?;
        let size_bytes = parse_size(&self.size)?;
        let cores = match &self.cores {
            Some(c) => parse_cores(c)?,
            // The last core: core 0 takes most interrupts and housekeeping.
            None => vec![*allowed_cpus
                .last()
                .ok_or_else(|| ReplicaError::BadArgs("no CPU available".into()))?],
        };
        if let Some(bad) = cores.iter().find(|c| !allowed_cpus.contains(c)) {
            return Err(ReplicaError::BadArgs(format!(
                "core {bad} is not available to this process (allowed: {allowed_cpus:?})"
            )));
        }
        let mode = self.mode.parse::<Mode>().map_err(ReplicaError::BadArgs)?;
        if self.dir.as_os_str().is_empty() {
            return Err(ReplicaError::BadArgs("--dir must not be empty".into()));
        }
        Ok(ReplicaSettings {
            config: ReplicaConfig {
                listen,
                dir: self.dir.clone(),
                size_bytes,
                direct: self.direct,
            },
            cores,
            mode,
        })
    }
}

/// Parses a size with an optional binary suffix: `4096`, `64K`, `1G`, `2TiB`.
pub fn parse_size(s: &str) -> Result<u64, ReplicaError> {
    lull_bdev::parse_size_bytes(s).map_err(ReplicaError::BadArgs)
}

/// Parses a core list: `3`, `0,2`, `0-3`, `0-1,4`.
pub fn parse_cores(s: &str) -> Result<Vec<usize>, ReplicaError> {
    lull_reactor::parse_core_list(s).map_err(ReplicaError::BadArgs)
}

/// `lull replica`: serve until SIGINT/SIGTERM, then stop cleanly (stop
/// accepting, finish in-flight I/O, fdatasync, mark clean). Exit code 0 on
/// a clean stop, 2 for bad arguments (or a directory that does not match
/// them), 1 for other failures.
pub fn run(args: &ReplicaArgs) -> ExitCode {
    let allowed = match lull_reactor::sys::allowed_cpus() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lull: error: cannot read CPU affinity: {e}");
            return ExitCode::FAILURE;
        }
    };
    let settings = match args.resolve(&allowed) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lull: error: {e}");
            return e.exit_code();
        }
    };
    // Block the stop signals before any thread starts, so every thread
    // inherits the mask and only the waiter below sees them.
    let mut signals = match signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
    ]) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lull: error: cannot install signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut fw = match Framework::start(FrameworkConfig::new(settings.cores.clone(), settings.mode))
    {
        Ok(fw) => fw,
        Err(e) => {
            eprintln!("lull: error: cannot start reactors: {e}");
            return ExitCode::FAILURE;
        }
    };
    let server = match ReplicaServer::start(fw.handle(), &settings.config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lull: error: {e}");
            fw.stop();
            return e.exit_code();
        }
    };
    println!(
        "replica listening on {} (size {}, generation {}, dir {})",
        server.local_addr(),
        lull_bdev::human_bytes(settings.config.size_bytes),
        server.generation(),
        settings.config.dir.display()
    );
    let signal = signals.forever().next();
    tracing::info!(
        ?signal,
        "stopping: no new connections, finishing in-flight I/O"
    );
    let result = server.shutdown(SHUTDOWN_TIMEOUT);
    fw.stop();
    match result {
        Ok(()) => {
            tracing::info!("stopped cleanly");
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %e, "unclean stop");
            eprintln!("lull: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The metadata record as the server knows it, behind one lock that the
/// helper threads hold across a write (writes are serialised).
struct MetaState {
    meta: Meta,
    /// Set when shutdown has written the clean record: no attach after it.
    sealed: bool,
}

/// State shared by the acceptor, the connections and the server handle.
pub(crate) struct Shared {
    pub(crate) dir: PathBuf,
    pub(crate) size_bytes: u64,
    pub(crate) dev: Arc<FileDev>,
    /// A descriptor on the data file for SEEK_DATA/SEEK_HOLE only (its file
    /// offset is moved by those calls; no I/O goes through it).
    pub(crate) scan: File,
    pub(crate) conns: Arc<Connections>,
    /// Whether the replica was clean when this server started (reported in
    /// every HELLO reply).
    pub(crate) clean_at_start: bool,
    /// The durable generation, readable without the metadata lock.
    pub(crate) generation: AtomicU64,
    /// The durable record says dirty: data may change. False while the
    /// record still claims a clean stop.
    pub(crate) dirty: AtomicBool,
    meta: Mutex<MetaState>,
}

impl Shared {
    /// Starts marking the replica dirty at `generation` (or higher; 0 only
    /// marks it dirty) on a helper thread. The result arrives on the returned channel, and then
    /// `poller` on `thread` is woken.
    pub(crate) fn attach_async(
        self: &Arc<Self>,
        generation: u64,
        thread: ThreadHandle,
        poller: PollerId,
    ) -> Result<mpsc::Receiver<Result<u64, ReplicaError>>, ReplicaError> {
        let (tx, rx) = mpsc::sync_channel(1);
        let shared = self.clone();
        std::thread::Builder::new()
            .name("lull-replica-meta".into())
            .spawn(move || {
                let result = shared.attach(generation);
                let _ = tx.send(result);
                let _ = thread.send(move |t| {
                    t.wake_poller(poller);
                });
            })
            .map_err(ReplicaError::Helper)?;
        Ok(rx)
    }

    /// Blocking: persists `clean = false` and `generation = max(current,
    /// generation)` when either changes. Returns the durable generation.
    fn attach(&self, generation: u64) -> Result<u64, ReplicaError> {
        let mut state = self.meta.lock().unwrap_or_else(|p| p.into_inner());
        if state.sealed || self.conns.stopping() {
            return Err(ReplicaError::ShuttingDown);
        }
        let next = Meta {
            clean: false,
            generation: state.meta.generation.max(generation),
            ..state.meta
        };
        if next != state.meta {
            next.store(&self.dir)?;
            tracing::info!(dir = %self.dir.display(), generation = next.generation, "engine attached: replica marked dirty");
            state.meta = next;
            self.generation.store(next.generation, Ordering::SeqCst);
        }
        self.dirty.store(true, Ordering::SeqCst);
        Ok(next.generation)
    }
}

/// A running replica server.
pub struct ReplicaServer {
    shared: Arc<Shared>,
    acceptor: Acceptor,
    addr: SocketAddr,
    /// Holds the directory's advisory lock until the server is dropped.
    _lock: File,
}

impl std::fmt::Debug for ReplicaServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ReplicaServer({}, {})",
            self.addr,
            self.shared.dir.display()
        )
    }
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ReplicaError + '_ {
    move |source| ReplicaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl ReplicaServer {
    /// Opens (or creates) the replica in `config.dir`, checks its size,
    /// binds the listener (errors are reported here, synchronously) and
    /// starts accepting on the main reactor.
    pub fn start(
        fw: &FrameworkHandle,
        config: &ReplicaConfig,
    ) -> Result<ReplicaServer, ReplicaError> {
        let dir = config.dir.clone();
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(io_err(&lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(ReplicaError::Locked { dir }),
            Err(std::fs::TryLockError::Error(e)) => return Err(io_err(&lock_path)(e)),
        }

        let data_path = dir.join(DATA_FILE);
        let meta = match Meta::load(&dir)? {
            Some(m) if m.volume_size != config.size_bytes => {
                return Err(ReplicaError::SizeMismatch {
                    dir,
                    meta_size: m.volume_size,
                    size: config.size_bytes,
                });
            }
            Some(m) => m,
            None => {
                // Data without metadata: an initialisation that crashed, or
                // files put there by hand. Its content is unknown, so it
                // starts dirty at generation 0 (the least fresh).
                let mut m = Meta::new(config.size_bytes);
                if data_path.exists() {
                    tracing::warn!(dir = %dir.display(), "data file without metadata: starting dirty at generation 0");
                    m.clean = false;
                }
                m
            }
        };
        // The data file first, then the record: a record always describes
        // a data file that exists.
        let dev = Arc::new(FileDev::open(
            &data_path,
            config.size_bytes,
            FileOptions {
                direct: config.direct,
                create: true,
            },
        )?);
        if Meta::load(&dir)?.is_none() {
            meta.store(&dir)?;
        }
        let scan = File::open(&data_path).map_err(io_err(&data_path))?;

        let listener = TcpListener::bind(config.listen).map_err(|source| ReplicaError::Listen {
            addr: config.listen,
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| ReplicaError::Listen {
                addr: config.listen,
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| ReplicaError::Listen {
                addr: config.listen,
                source,
            })?;

        let conns = Arc::new(Connections::new(Limits {
            name: "replica",
            max_connections: MAX_CONNECTIONS,
            greeting_timeout_us: HELLO_TIMEOUT_US,
        }));
        let shared = Arc::new(Shared {
            dir,
            size_bytes: config.size_bytes,
            dev,
            scan,
            conns: conns.clone(),
            clean_at_start: meta.clean,
            generation: AtomicU64::new(meta.generation),
            dirty: AtomicBool::new(!meta.clean),
            meta: Mutex::new(MetaState {
                meta,
                sealed: false,
            }),
        });
        let s = shared.clone();
        let acceptor = Acceptor::start(fw, &conns, vec![listener], move |stream| Conn::new(stream, s.clone()))?;
        tracing::info!(
            addr = %addr, dir = %shared.dir.display(), size_bytes = shared.size_bytes,
            generation = meta.generation, clean = meta.clean, data = %shared.dev.describe(),
            "replica serving"
        );
        Ok(ReplicaServer {
            shared,
            acceptor,
            addr,
            _lock: lock,
        })
    }

    /// The bound address (with the real port for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The durable generation now.
    pub fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::SeqCst)
    }

    /// Whether the replica was clean when this server started.
    pub fn was_clean_at_start(&self) -> bool {
        self.shared.clean_at_start
    }

    pub fn size_bytes(&self) -> u64 {
        self.shared.size_bytes
    }

    pub fn connection_count(&self) -> usize {
        self.shared.conns.len()
    }

    /// Stops cleanly: no new connections; every connection finishes its
    /// in-flight requests, sends their replies and closes; the data file is
    /// fdatasynced; the record is marked clean. If connections are still
    /// open after `timeout`, or the sync fails, the replica stays dirty and
    /// the error says why.
    pub fn shutdown(self, timeout: Duration) -> Result<(), ReplicaError> {
        self.acceptor.stop();
        let open = self.acceptor.drain(timeout);
        if open > 0 {
            return Err(ReplicaError::Unclean { open });
        }
        self.shared.dev.sync()?;
        let mut state = self.shared.meta.lock().unwrap_or_else(|p| p.into_inner());
        let clean = Meta {
            clean: true,
            ..state.meta
        };
        if clean != state.meta {
            clean.store(&self.shared.dir)?;
            state.meta = clean;
        }
        state.sealed = true;
        tracing::info!(dir = %self.shared.dir.display(), generation = clean.generation, "replica marked clean");
        Ok(())
    }
}

impl Drop for ReplicaServer {
    /// Without `shutdown`, connections are told to close but the replica
    /// stays dirty.
    fn drop(&mut self) {
        self.acceptor.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_args() {
        let args = ReplicaArgs {
            listen: "127.0.0.1:0".into(),
            dir: "/tmp/x".into(),
            size: "1M".into(),
            cores: None,
            mode: "adaptive".into(),
            direct: false,
        };
        let s = args.resolve(&[0, 1]).unwrap();
        assert_eq!(s.cores, vec![1]);
        assert_eq!(s.mode, Mode::Adaptive);
        assert_eq!(s.config.size_bytes, 1 << 20);
        let bad = ReplicaArgs {
            mode: "spin".into(),
            ..args.clone()
        };
        assert!(matches!(bad.resolve(&[0]), Err(ReplicaError::BadArgs(_))));
        let bad = ReplicaArgs {
            listen: "nowhere".into(),
            ..args.clone()
        };
        assert!(bad.resolve(&[0]).is_err());
        let bad = ReplicaArgs {
            cores: Some("7".into()),
            ..args
        };
        assert!(bad.resolve(&[0]).is_err());
    }
}
