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
//!     faults: ReplicaFaults::default(),
//!     ring: Default::default(),
//!     link: LinkAuth::Tls(Creds::Psk("/etc/lull/replica.psk".into())),
//!     sendfile: true,
//! };
//! let server = ReplicaServer::start(fw.handle(), &config)?;
//! println!("replica on {}", server.local_addr());
//! // ... until SIGTERM: drains, fdatasyncs, persists the write-intent
//! // record; the replica stays dirty unless the last engine detached.
//! server.shutdown(Duration::from_secs(30))?;
//! ```
//!
//! Layout of `DIR`: `data.img` (the volume, sparse, through io_uring; the
//! first layer of its chain, see below), `data.img.lull/` (the later
//! layers and the chain's record, once a snapshot was taken),
//! `meta.json` ([`Meta`]: size, generation, clean flag), `intent.bin` (the
//! write-intent record, see [`intent`]), `changes.bin` (the change records
//! for replicas away, see [`changes`]) and `lock` (an exclusive advisory
//! lock, so two replicas never share a directory).
//!
//! The data is a chain of layers (`lull_bdev::chain::ChainDev` over a
//! `FileStore` on `data.img`), as a file volume of `lull serve` is: a
//! replica that never took a snapshot is one layer, `data.img`, every
//! request passing straight to it (a directory from before snapshots
//! opens as it is). SNAPSHOT and SNAPSHOT_LIST (version 5) are the
//! [`snapshots`] module's; snapshot views and CHANGED (version 6) the
//! connection's (see the rules below).
//!
//! Threads: one acceptor thread on the main reactor; each connection is a
//! poller in one of the server's poll groups (one lull thread per reactor,
//! connections round-robin), owning the socket and the connection's file
//! channel (the scaffolding is `lull_net::server`, shared with `lull-nbd`).
//! Metadata writes (two fsyncs) run on short-lived helper OS threads and
//! report back with a message; write-intent stores run on one long-lived
//! thread ("lull-replica-intent") that group-commits them. No reactor ever
//! blocks on a disk sync.
//!
//! Protocol rules on top of the codec (versions 2 to 6, see
//! [`lull_proto::replica`]):
//!
//! - The first frame of a connection is HELLO; more may follow (the engine
//!   probes with a plain HELLO, then attaches on any connection), all with
//!   the session of the first.
//! - **Sessions** (the `fence` module): a HELLO with a session newer than the
//!   owner's takes the replica over; it is answered only once every
//!   modifying request of other sessions already taken has completed, and
//!   their connections are closed. An older session's HELLO gets `ESTALE`;
//!   session 0 (a tool) gets `ESTALE` for modifying requests, ATTACH and
//!   DETACH while an engine owns the replica.
//! - **Clean** means the last engine attached detached cleanly and nothing
//!   has modified the replica since. A HELLO with `HELLO_FLAG_ATTACH` marks
//!   the replica dirty and raises its generation to the one sent (durably,
//!   before the reply). The first modifying request ([`Kind::modifies`]) on
//!   a replica whose record says clean (a rebuild target is written before
//!   any attach) first marks it dirty, durably. DETACH (sent by the engine
//!   once all its I/O completed and a FLUSH was answered) syncs the data,
//!   empties the write-intent record and marks the replica clean. Stopping
//!   the replica process changes none of this.
//! - The HELLO reply reports the current generation, the owner session,
//!   `HELLO_FLAG_CLEAN` when the durable record says clean now and the
//!   write-intent record is not lost, and `HELLO_FLAG_INTENT_LOST` when it
//!   is.
//! - **Views** (version 6): a first HELLO naming `REPLICA@SNAPSHOT`
//!   (`@SNAPSHOT` on a `lull replica` process) opens the connection on
//!   the snapshot's read-only view (`BlockDevice::snapshot_view`) instead
//!   of the live chain. It must carry session 0 and no attach flag
//!   (`EINVAL`), and name a snapshot the replica holds (`ENOENT`); both
//!   refusals close. READ, BLOCK_STATUS, EXTENTS, CHANGED and PING read
//!   the snapshot; everything else gets `EROFS` before it is counted in
//!   the fence, marks the replica dirty or touches a record. The view
//!   holds its layers: a delete of the snapshot merges meanwhile and the
//!   view reads on. **CHANGED** (any connection) answers which 4 KiB
//!   blocks of a range were written since a snapshot (on a view: up to
//!   the view's), from the chain's maps; it modifies nothing.
//!
//! [`Kind::modifies`]: lull_proto::replica::Kind::modifies

#![forbid(unsafe_code)]

pub mod changes;
mod conn;
pub mod durable;
mod fence;
pub mod grow;
pub mod intent;
pub mod meta;
pub mod snapshots;
pub mod store;

use std::fs::{File, OpenOptions};
use std::io;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use lull_bdev::chain::{ChainDev, FileStore};
use lull_bdev::{BdevError, BlockDevice, Faults, FaultyDev, FileOptions, Probability};
use lull_net::link::LinkAuth;
use lull_net::server::{Acceptor, Connections, Limits};
use lull_net::tls::{Role, TlsContext, TlsError};
use lull_reactor::{FrameworkHandle, PollerId, ReactorError, ThreadHandle};

pub use conn::{MAX_IN_FLIGHT, MAX_REPLY_QUEUE_BYTES};
pub use intent::{IntentError, INTENT_FILE, INTENT_FORMAT_VERSION, INTENT_SLOT_BYTES};
pub use meta::{Meta, MetaError, META_FILE, META_FORMAT_VERSION, META_MAX_BYTES};
pub use store::{ReplicaInfo, ReplicaSnapshot, Store, StoreConfig, StoreError, StoreInfo};

use crate::conn::Conn;
use crate::fence::Fences;
use crate::intent::{DataSync, IntentFile, Persister};
use crate::snapshots::Control;
use lull_proto::replica::{GROW_ALIGN_BYTES, HELLO_FLAG_CLEAN, HELLO_FLAG_INTENT_LOST};

/// File name of the volume data inside the replica directory.
pub const DATA_FILE: &str = "data.img";
/// File name of the lock file inside the replica directory.
pub const LOCK_FILE: &str = "lock";

/// Connections held at once. The engine opens a few per volume; each costs
/// a lull thread, an io_uring ring and up to `MAX_IN_FLIGHT` buffers, so
/// past this a new connection is closed at once (with a log line).
pub const MAX_CONNECTIONS: usize = 256;

/// Connections a store's port holds at once: two per replica (the
/// engine's default `connections_per_replica`) for the most replicas a
/// store holds (`store::MAX_STORE_REPLICAS`). A connection is a poller in
/// a poll group, not a thread: idle, it holds its socket and a slot table;
/// buffers are taken only while requests are in flight.
pub const MAX_STORE_CONNECTIONS: usize = 2 * store::MAX_STORE_REPLICAS;

/// A peer must send its HELLO within this time or be disconnected: a
/// silent connection must not hold a slot forever. The engine sends it at
/// once; 10 s matches the NBD handshake limit.
pub const HELLO_TIMEOUT_US: u64 = 10_000_000;

/// Why a snapshot request (`snapshots`) was refused or failed; each maps
/// to the errno of its reply. Here, not in `snapshots`, because the
/// store's and a grow's errors hold it and it holds theirs.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{0}")]
    BadName(String),
    #[error("snapshot {0:?} exists already")]
    Exists(String),
    #[error("no snapshot {0:?}")]
    NotFound(String),
    #[error(
        "the chain has its maximum of {} layers: delete a snapshot first",
        lull_bdev::chain::MAX_CHAIN_LAYERS
    )]
    ChainFull,
    #[error("{0}")]
    Busy(String),
    #[error("the replica is stopping or was deleted")]
    Closed,
    #[error("write-intent record: {0}")]
    Intent(#[from] crate::intent::IntentError),
    #[error("{0}")]
    Failed(BdevError),
    #[error("{0}")]
    Store(#[from] crate::store::StoreError),
    #[error("a clone is made by a node's replica store (lull serve --store), not by lull replica")]
    NotAStore,
    #[error("{0}")]
    Grow(#[from] crate::grow::GrowError),
}

impl SnapshotError {
    /// The errno of the reply.
    pub fn errno(&self) -> i32 {
        match self {
            SnapshotError::BadName(_) => libc::EINVAL,
            SnapshotError::Exists(_) => libc::EEXIST,
            SnapshotError::NotFound(_) => libc::ENOENT,
            SnapshotError::ChainFull => libc::EMLINK,
            SnapshotError::Busy(_) => libc::EBUSY,
            SnapshotError::Closed => libc::ESHUTDOWN,
            SnapshotError::Intent(_) | SnapshotError::Failed(_) => libc::EIO,
            SnapshotError::Store(e) => e.errno(),
            SnapshotError::NotAStore => libc::EOPNOTSUPP,
            SnapshotError::Grow(e) => e.errno(),
        }
    }

    /// A refusal of what was asked (logged as a warning), as opposed to a
    /// failure of the replica (an error).
    pub fn is_refusal(&self) -> bool {
        match self {
            SnapshotError::Store(e) => e.is_refusal(),
            SnapshotError::Grow(e) => e.is_refusal(),
            e => !matches!(
                e,
                SnapshotError::Intent(_) | SnapshotError::Failed(_) | SnapshotError::Closed
            ),
        }
    }

    /// A chain error of an operation on snapshot `name`, whose name was
    /// checked and (for create) not taken when it started.
    fn of_chain(e: BdevError, name: &str) -> SnapshotError {
        match e {
            BdevError::NoSuchSnapshot(n) => SnapshotError::NotFound(n),
            BdevError::InUse(why) => SnapshotError::Busy(why),
            // Checked above, so only "exists already" is left.
            BdevError::BadName(_) => SnapshotError::Exists(name.to_string()),
            e => SnapshotError::Failed(e),
        }
    }
}

/// Errors of the replica server.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
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
    #[error(
        "{open} connection(s) still open after the shutdown timeout; the data file was not synced"
    )]
    Unclean { open: usize },
    #[error("write-intent record: {0}")]
    Intent(#[from] IntentError),
    #[error("replica link TLS: {0}")]
    Tls(#[from] TlsError),
    #[error("DETACH while {in_flight} other modifying request(s) are in flight: the engine detaches only after its I/O completed and a FLUSH")]
    DetachBusy { in_flight: usize },
}

impl ReplicaError {
    /// The errno a peer is told (HELLO reply status) for this error.
    pub fn errno(&self) -> i32 {
        match self {
            ReplicaError::SizeMismatch { .. } => libc::EINVAL,
            ReplicaError::Meta(e) => e.errno(),
            ReplicaError::Locked { .. } => libc::EBUSY,
            ReplicaError::Io { source, .. }
            | ReplicaError::Listen { source, .. }
            | ReplicaError::Helper(source) => source.raw_os_error().unwrap_or(libc::EIO),
            ReplicaError::Bdev(e) => e.errno(),
            ReplicaError::Reactor(_) | ReplicaError::Unclean { .. } => libc::EIO,
            ReplicaError::ShuttingDown => libc::ESHUTDOWN,
            ReplicaError::Intent(e) => e.errno(),
            ReplicaError::DetachBusy { .. } => libc::EBUSY,
            ReplicaError::Tls(_) => libc::EACCES,
        }
    }
}

/// What a replica server needs, resolved and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaConfig {
    pub listen: SocketAddr,
    pub dir: PathBuf,
    pub size_bytes: u64,
    pub direct: bool,
    /// io_uring options of the data file (`sqpoll`, `iopoll`, ...).
    pub ring: lull_bdev::RingOptions,
    /// Faults to inject, for rehearsals and tests; none by default.
    pub faults: ReplicaFaults,
    /// How engines must authenticate (`--tls-psk`, `--tls-certs`), or
    /// plain links (`--insecure`).
    pub link: LinkAuth,
    /// Send READ replies of at least `SENDFILE_READ_BYTES_MIN` straight
    /// from the data file's page cache with `sendfile` (no copy through a
    /// buffer), where the link is plain, the data file buffered and no
    /// I/O fault is injected. On by default; `--no-sendfile` turns it off.
    pub sendfile: bool,
}

/// Faults a replica injects on purpose (`lull replica --fault-*`), so
/// operators and tests can watch the engine cope.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaFaults {
    /// Each data request (after HELLO) closes its connection instead of
    /// being served, with this probability.
    pub drop: Probability,
    /// Each data request fails with EIO with this probability (the data
    /// file goes through a [`FaultyDev`]).
    pub error: Probability,
    /// Every data completion is held back this long before its reply.
    pub delay_us: u64,
    /// Seed of the draws; connection `n` draws drops from `seed + n`.
    pub seed: u64,
}

impl ReplicaFaults {
    pub fn any(&self) -> bool {
        self.drop.get() > 0.0 || self.error.get() > 0.0 || self.delay_us > 0
    }
}

/// The metadata record as the server knows it, behind one lock that the
/// helper threads hold across a write (writes are serialised).
struct MetaState {
    meta: Meta,
    /// Set when shutdown has synced everything: no attach or detach after it.
    sealed: bool,
}

/// A metadata change run on a helper thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MetaJob {
    /// Mark dirty and raise the generation to at least this (0 only
    /// marks dirty).
    Attach(u64),
    /// A clean detach (see [`Shared::detach`]).
    Detach,
}

/// What one listening port serves: its connections, how they
/// authenticate, and the replica (a `lull replica` process) or the store of
/// replicas (a node daemon) a HELLO picks from.
pub(crate) struct Port {
    /// TLS credentials every connection must authenticate with; `None`
    /// for plain links (`--insecure`).
    pub(crate) tls: Option<TlsContext>,
    pub(crate) conns: Arc<Connections>,
    /// `--fault-drop` and its seed (the other faults live in each
    /// replica's data path).
    pub(crate) faults: ReplicaFaults,
    /// Connections accepted so far (each one's drop draws are seeded apart).
    pub(crate) conns_accepted: AtomicU64,
    pub(crate) served: Served,
}

/// The replicas a port serves.
pub(crate) enum Served {
    /// One unnamed replica (`lull replica`).
    One(Arc<Shared>),
    /// A node's store: the HELLO names the replica.
    Store(Arc<store::Index>),
}

impl Port {
    /// The replica a HELLO naming `name` (`""`: none) is for, or the errno
    /// and reason to refuse it with.
    pub(crate) fn find(&self, name: &str) -> Result<Arc<Shared>, (i32, String)> {
        match (&self.served, name) {
            (Served::One(shared), "") => Ok(shared.clone()),
            (Served::One(_), name) => Err((
                libc::ENOENT,
                format!("HELLO names replica {name:?}, and this is a lull replica process serving one unnamed replica (name replicas only on a node's store)"),
            )),
            (Served::Store(_), "") => Err((
                libc::ENOENT,
                "HELLO names no replica, and this port serves a store: name it (HOST:PORT/NAME)"
                    .into(),
            )),
            (Served::Store(index), name) => index.find(name).ok_or_else(|| {
                (
                    libc::ENOENT,
                    format!("HELLO names replica {name:?}, which this store does not hold"),
                )
            }),
        }
    }
}

/// State shared by the acceptor, the connections and the server handle.
pub(crate) struct Shared {
    /// The replica's name in a store (`None` for `lull replica`).
    pub(crate) name: Option<String>,
    /// Set when the store deletes the replica: its connections close.
    pub(crate) deleted: AtomicBool,
    pub(crate) dir: PathBuf,
    /// The volume's size: raised by GROW (`crate::grow`), never lowered.
    size_bytes: AtomicU64,
    /// The data: a chain of layers, `data.img` first (one layer until a
    /// snapshot is taken: every request passes straight to it).
    pub(crate) chain: Arc<ChainDev>,
    /// Where the chain's layers live (`data.img`, `data.img.lull/`).
    pub(crate) layers: Arc<FileStore>,
    /// Serialises the chain's control operations (SNAPSHOT), closed
    /// when the replica stops or is deleted.
    pub(crate) control: Control,
    /// With `--fault-error`/`--fault-delay-us`: the chain behind the
    /// fault injector, where connections open their channels.
    pub(crate) faulty: Option<FaultyDev>,
    pub(crate) conns: Arc<Connections>,
    /// The durable generation, readable without the metadata lock.
    pub(crate) generation: AtomicU64,
    /// The durable record says dirty, so data may change without a
    /// metadata write first. Cleared by a DETACH *before* it checks for
    /// requests in flight and writes the clean record (see
    /// [`Shared::detach`]), so it may be false while the record is still
    /// dirty, never the other way round.
    pub(crate) dirty: AtomicBool,
    /// The durable record says clean (a mirror, for HELLO replies).
    clean: AtomicBool,
    /// Write-intent regions of the volume (raised by GROW with the size).
    regions: AtomicU32,
    /// Called after a GROW is durable (a store records the new size).
    pub(crate) grown_hook: std::sync::OnceLock<grow::GrownHook>,
    pub(crate) intent: Arc<Persister>,
    pub(crate) fences: Fences,
    /// READ replies may be sent with `sendfile` from the page cache of
    /// the chain's only layer ([`ReplicaConfig::sendfile`], plain links,
    /// no fault injected); each connection decides per request whether
    /// the chain has one layer now (`Conn::sendfile_file`).
    pub(crate) sendfile: bool,
    /// READ replies sent with `sendfile` (counted in the stop line).
    pub(crate) sendfile_reads: AtomicU64,
    meta: Mutex<MetaState>,
}

impl Shared {
    /// The volume's size now (requests are checked against it).
    pub(crate) fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// Write-intent regions of the volume now.
    pub(crate) fn regions(&self) -> u32 {
        self.regions.load(Ordering::Acquire)
    }

    /// Starts `job` on a helper thread. The result (the durable generation)
    /// arrives on the returned channel, and then `poller` on `thread` is
    /// woken.
    pub(crate) fn meta_async(
        self: &Arc<Self>,
        job: MetaJob,
        thread: ThreadHandle,
        poller: PollerId,
    ) -> Result<mpsc::Receiver<Result<u64, ReplicaError>>, ReplicaError> {
        let shared = self.clone();
        on_helper_thread("lull-replica-meta", thread, poller, move || match job {
            MetaJob::Attach(generation) => shared.attach(generation),
            MetaJob::Detach => shared.detach(),
        })
    }

    /// The HELLO reply flags now.
    pub(crate) fn hello_flags(&self) -> u64 {
        let lost = self.intent.lost();
        let mut flags = 0;
        if self.clean.load(Ordering::SeqCst) && !lost {
            flags |= HELLO_FLAG_CLEAN;
        }
        if lost {
            flags |= HELLO_FLAG_INTENT_LOST;
        }
        flags
    }

    fn lock_meta(&self) -> std::sync::MutexGuard<'_, MetaState> {
        self.meta.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocking: persists `clean = false` and `generation = max(current,
    /// generation)` when either changes. Returns the durable generation.
    fn attach(&self, generation: u64) -> Result<u64, ReplicaError> {
        let mut state = self.lock_meta();
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
            tracing::info!(dir = %self.dir.display(), generation = next.generation, "replica marked dirty");
            state.meta = next;
            self.generation.store(next.generation, Ordering::SeqCst);
        }
        self.clean.store(false, Ordering::SeqCst);
        self.dirty.store(true, Ordering::SeqCst);
        Ok(next.generation)
    }

    /// Blocking: a clean detach. The engine sends DETACH only once all its
    /// I/O has completed and a FLUSH was answered, so every replica it
    /// detaches holds the same bytes; this makes the data durable, empties
    /// the write-intent record (durably, ending a lost state) and writes
    /// `clean = true`. Any later modifying request makes it dirty again.
    ///
    /// Other modifying requests in flight break that promise: refused
    /// with [`ReplicaError::DetachBusy`]. The check is exact: `dirty` is
    /// cleared first, then the counts are read (both sequentially
    /// consistent), while a request counts itself first and reads `dirty`
    /// after; so a request either is counted here or marks the record dirty
    /// again through [`Shared::attach`], which waits for this lock.
    fn detach(&self) -> Result<u64, ReplicaError> {
        let mut state = self.lock_meta();
        if state.sealed || self.conns.stopping() {
            return Err(ReplicaError::ShuttingDown);
        }
        self.dirty.store(false, Ordering::SeqCst);
        // The DETACH itself is one of them.
        let in_flight = self.fences.modifying_total().saturating_sub(1);
        if in_flight > 0 {
            // The record is still durably dirty: nothing to redo.
            self.dirty.store(true, Ordering::SeqCst);
            return Err(ReplicaError::DetachBusy { in_flight });
        }
        let clean = Meta {
            clean: true,
            ..state.meta
        };
        let result = self
            .chain
            .sync()
            .map_err(ReplicaError::from)
            .and_then(|()| self.intent.clear_all_durably().map_err(ReplicaError::from))
            .and_then(|()| clean.store(&self.dir).map_err(ReplicaError::from));
        // Success or not, the record may say clean now (a failed store may
        // have renamed before its directory sync failed): the next
        // modifying request must write dirty again, which it does when the
        // known record says clean and `dirty` is false.
        state.meta = clean;
        self.clean.store(result.is_ok(), Ordering::SeqCst);
        result?;
        tracing::info!(dir = %self.dir.display(), generation = clean.generation,
            "engine detached cleanly: replica marked clean, write-intent record empty");
        Ok(clean.generation)
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

/// How one replica's data is opened (what `lull replica`'s flags or a
/// store's settings say).
#[derive(Debug, Clone)]
pub(crate) struct DataOptions {
    pub(crate) direct: bool,
    pub(crate) ring: lull_bdev::RingOptions,
    pub(crate) faults: ReplicaFaults,
    /// `sendfile` READ replies where the port's links are plain.
    pub(crate) sendfile: bool,
}

/// Runs blocking `work` (a disk sync, a chain's control operation) on a
/// short-lived OS thread named `name`, so no reactor waits: its result
/// arrives on the returned channel, and then `poller` on `thread` is woken
/// to take it.
pub(crate) fn on_helper_thread<T: Send + 'static>(
    name: &str,
    thread: ThreadHandle,
    poller: PollerId,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<mpsc::Receiver<T>, ReplicaError> {
    let (tx, rx) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(work());
            let _ = thread.send(move |t| {
                t.wake_poller(poller);
            });
        })
        .map_err(ReplicaError::Helper)?;
    Ok(rx)
}

/// Opens (or creates) the replica in `dir`: its data file, metadata record
/// and write-intent record, checked against `size_bytes`. Blocking (file
/// creation, fsyncs): at start or on an RPC thread, never on a reactor. No
/// thread starts here (the write-intent thread starts at the first mark).
pub(crate) fn open_replica(
    dir: &Path,
    name: Option<String>,
    size_bytes: u64,
    data: &DataOptions,
    conns: Arc<Connections>,
) -> Result<Arc<Shared>, ReplicaError> {
    let dir = dir.to_path_buf();
    let data_path = dir.join(DATA_FILE);
    let layers = Arc::new(FileStore::new(
        &data_path,
        FileOptions {
            direct: data.direct,
            create: true,
            ring: data.ring,
        },
    ));
    let meta = match Meta::load(&dir)? {
        // Grown online (GROW) since whoever opens it recorded its size:
        // the replica's own record is the truth, and it is never smaller.
        Some(m) if m.volume_size > size_bytes && m.volume_size % GROW_ALIGN_BYTES == 0 => {
            tracing::info!(dir = %dir.display(), recorded = m.volume_size, asked = size_bytes,
                "replica was grown online: opening it at its recorded size");
            m
        }
        Some(m) if m.volume_size != size_bytes => {
            return Err(ReplicaError::SizeMismatch {
                dir,
                meta_size: m.volume_size,
                size: size_bytes,
            });
        }
        Some(m) => m,
        None => {
            // Data without metadata: an initialisation that crashed, or
            // files put there by hand. Its content is unknown, so it
            // starts dirty at generation 0 (the least fresh).
            let mut m = Meta::new(size_bytes);
            if data_path.exists() || layers.dir().exists() {
                tracing::warn!(dir = %dir.display(), "data file without metadata: starting dirty at generation 0");
                m.clean = false;
            }
            m
        }
    };
    let size_bytes = meta.volume_size;
    // The data file first, then the record: a record always describes
    // a data file that exists. The chain's record (if a snapshot was ever
    // taken) says which layers there are; without one, `data.img` alone.
    let chain = Arc::new(ChainDev::open(layers.clone(), size_bytes)?);
    if Meta::load(&dir)?.is_none() {
        meta.store(&dir)?;
    }
    // A missing record is empty only where nothing can differ: a new
    // replica, or one whose last engine detached cleanly.
    let (intent_file, loaded) = IntentFile::open(&dir, size_bytes, meta.clean)?;
    if let Some(why) = &loaded.lost {
        tracing::warn!(path = %intent_file.path().display(), reason = %why,
            "write-intent record lost: every region is reported as possibly different, and the replica as not clean");
    }
    let regions = lull_proto::replica::intent_regions(size_bytes);
    let changes = changes::load(
        &dir,
        size_bytes,
        &loaded.bitmap,
        lull_proto::replica::intent_region_bytes(size_bytes),
        loaded.lost.is_some(),
    );
    // Syncs the head, whichever layer it is when the persister asks.
    let head = chain.clone();
    let data_sync: DataSync = Box::new(move || {
        head.sync().map_err(|e| match e {
            BdevError::Io(e) => e,
            e => io::Error::other(e.to_string()),
        })
    });
    let intent = Persister::start(intent_file, loaded, changes, Some(data_sync))?;
    let f = data.faults;
    let faulty = (f.error.get() > 0.0 || f.delay_us > 0).then(|| {
        let faults = Faults {
            read_err: f.error,
            write_err: f.error,
            flush_err: f.error,
            delay_us: f.delay_us,
            seed: f.seed,
        };
        FaultyDev::new(chain.clone(), faults)
    });
    // Not through the fault injector (its read errors and delays must
    // apply); the caller said whether links are plain.
    let sendfile = data.sendfile && faulty.is_none();
    Ok(Arc::new(Shared {
        name,
        deleted: AtomicBool::new(false),
        dir,
        size_bytes: AtomicU64::new(size_bytes),
        chain,
        layers,
        control: Control::default(),
        faulty,
        conns,
        generation: AtomicU64::new(meta.generation),
        dirty: AtomicBool::new(!meta.clean),
        clean: AtomicBool::new(meta.clean),
        regions: AtomicU32::new(regions),
        grown_hook: std::sync::OnceLock::new(),
        intent,
        fences: Fences::new(),
        sendfile,
        sendfile_reads: AtomicU64::new(0),
        meta: Mutex::new(MetaState {
            meta,
            sealed: false,
        }),
    }))
}

/// Binds a replica port's listener, non-blocking, and reports the real
/// address (port 0 picks one).
pub(crate) fn bind(listen: SocketAddr) -> Result<(TcpListener, SocketAddr), ReplicaError> {
    let e = |source| ReplicaError::Listen {
        addr: listen,
        source,
    };
    let listener = TcpListener::bind(listen).map_err(e)?;
    listener.set_nonblocking(true).map_err(e)?;
    let addr = listener.local_addr().map_err(e)?;
    Ok((listener, addr))
}

/// Takes the exclusive advisory lock of `dir/lock`, so two servers never
/// share a replica directory (or a store).
pub(crate) fn lock_dir(dir: &Path) -> Result<File, ReplicaError> {
    let lock_path = dir.join(LOCK_FILE);
    let lock = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(io_err(&lock_path))?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(std::fs::TryLockError::WouldBlock) => Err(ReplicaError::Locked {
            dir: dir.to_path_buf(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io_err(&lock_path)(e)),
    }
}

/// Starts the acceptor of a replica port, a `lull replica`'s or a node
/// store's: each accepted stream becomes a replica connection (`conn`),
/// served from `port`. The crate's entry point makes the connections, so
/// the store has no path to `conn`.
pub(crate) fn accept(
    fw: &FrameworkHandle,
    port: Arc<Port>,
    listener: TcpListener,
) -> Result<Acceptor, ReactorError> {
    let conns = port.conns.clone();
    Acceptor::start(fw, &conns, vec![listener], move |stream| {
        Conn::new(stream, port.clone())
    })
}

/// The connections' limits on a replica port.
pub(crate) fn port_connections(max_connections: usize) -> Arc<Connections> {
    Arc::new(Connections::new(Limits {
        name: "replica",
        max_connections,
        greeting_timeout_us: HELLO_TIMEOUT_US,
    }))
}

pub(crate) fn log_link_choice(link: &LinkAuth) {
    match link {
        LinkAuth::Insecure => tracing::warn!("{}", lull_net::link::INSECURE_WARNING),
        LinkAuth::Tls(creds) => {
            tracing::info!(
                ?creds,
                "replica links: TLS required, engines must authenticate"
            )
        }
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
        // Credentials first: a bad key file is the operator's to fix before
        // anything is created on disk.
        let tls = config.link.context(Role::Server)?;
        let dir = config.dir.clone();
        std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let lock = lock_dir(&dir)?;
        let conns = port_connections(MAX_CONNECTIONS);
        let data = DataOptions {
            direct: config.direct,
            ring: config.ring,
            faults: config.faults,
            // Plain links only: a TLS session encrypts in user space.
            sendfile: config.sendfile && tls.is_none(),
        };
        let shared = open_replica(&dir, None, config.size_bytes, &data, conns.clone())?;
        let (listener, addr) = match bind(config.listen) {
            Ok(l) => l,
            Err(e) => {
                shared.intent.stop();
                return Err(e);
            }
        };
        let f = config.faults;
        if f.any() {
            tracing::warn!(
                drop = f.drop.get(),
                error = f.error.get(),
                delay_us = f.delay_us,
                seed = f.seed,
                "FAULT INJECTION ENABLED: this replica drops connections, fails I/O and delays replies on purpose"
            );
        }
        let port = Arc::new(Port {
            tls,
            conns: conns.clone(),
            faults: f,
            conns_accepted: AtomicU64::new(0),
            served: Served::One(shared.clone()),
        });
        let acceptor = match accept(fw, port, listener) {
            Ok(a) => a,
            Err(e) => {
                shared.intent.stop();
                return Err(e.into());
            }
        };
        log_link_choice(&config.link);
        let (generation, clean) = {
            let m = shared.lock_meta();
            (m.meta.generation, m.meta.clean)
        };
        tracing::info!(
            addr = %addr, dir = %shared.dir.display(), size_bytes = shared.size_bytes(),
            generation, clean, intent_lost = shared.intent.lost(), data = %shared.chain.describe(),
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

    /// Whether the replica reports clean now: the durable record says
    /// clean (the last engine detached) and the write-intent record is not
    /// lost.
    pub fn is_clean(&self) -> bool {
        self.shared.hello_flags() & HELLO_FLAG_CLEAN != 0
    }

    /// Whether the write-intent record was lost (until a clean DETACH).
    pub fn intent_lost(&self) -> bool {
        self.shared.intent.lost()
    }

    /// The engine session that owns the replica (0: none since start).
    pub fn owner_session(&self) -> u64 {
        self.shared.fences.owner()
    }

    pub fn size_bytes(&self) -> u64 {
        self.shared.size_bytes()
    }

    pub fn connection_count(&self) -> usize {
        self.shared.conns.len()
    }

    /// READ replies sent with `sendfile` so far (also in the stop line).
    pub fn sendfile_reads(&self) -> u64 {
        self.shared.sendfile_reads.load(Ordering::Relaxed)
    }

    /// Stops cleanly: no new connections; every connection finishes its
    /// in-flight requests, sends their replies and closes; the data file is
    /// fdatasynced and pending write-intent changes are persisted. The
    /// clean flag is left as it is: clean only if the last engine detached
    /// (an engine still attached may have written to its other replicas
    /// what this one never got, so a stop cannot vouch for it). If
    /// connections are still open after `timeout`, or a sync fails, the
    /// error says why.
    pub fn shutdown(self, timeout: Duration) -> Result<(), ReplicaError> {
        self.acceptor.stop();
        let open = self.acceptor.drain(timeout);
        if open > 0 {
            return Err(ReplicaError::Unclean { open });
        }
        // No snapshot operation or merge touches the files from here.
        self.shared.close_chain();
        self.shared.chain.sync()?;
        self.shared.intent.flush()?;
        self.shared.intent.stop();
        let mut state = self.shared.lock_meta();
        state.sealed = true;
        let dir = self.shared.dir.display();
        let generation = state.meta.generation;
        // How the data file's reads and writes named their buffers
        // (registered arenas vs not): the replica's only I/O counters.
        if let Some(ios) = self.shared.chain.buffer_ios() {
            tracing::info!(%dir, fixed_buffer_ios = ios.fixed, plain_buffer_ios = ios.plain,
                inline_ios = ios.inline, sendfile_reads = self.shared.sendfile_reads.load(Ordering::Relaxed),
                "data file I/O by buffer kind");
        }
        if self.shared.clean.load(Ordering::SeqCst) {
            tracing::info!(%dir, generation, "replica stopped clean: the last engine detached");
        } else {
            tracing::info!(%dir, generation, "replica stopped dirty: an engine attached (or wrote) and did not detach");
        }
        Ok(())
    }
}

impl Drop for ReplicaServer {
    /// Without `shutdown`, connections are told to close, the
    /// write-intent thread stores what is pending and stops, and a merge
    /// in the background stops (after its current step).
    fn drop(&mut self) {
        self.acceptor.stop();
        self.shared.intent.stop();
        // A merge in the background must not outlive the server (the
        // directory may be opened again at once).
        self.shared.close_chain();
    }
}
