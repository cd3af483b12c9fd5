//! A node's replica store: any number of named replicas under one
//! directory, served to every engine on one replica port (`lull serve
//! --store DIR --replica-listen ADDR:PORT`). A HELLO names the replica it
//! is for; each replica is exactly what `lull replica` serves (a sparse data
//! file, its metadata record, its write-intent record), and they share the
//! daemon's reactors, buffer pools and the port's poll groups, so an idle
//! replica costs its metadata and a few descriptors, no thread.
//!
//! ```ignore
//! let store = Store::open(fw.handle(), &StoreConfig {
//!     dir: "/var/lib/lull/store".into(),
//!     listen: "0.0.0.0:10900".parse()?,
//!     link: LinkAuth::Tls(Creds::Psk("/etc/lull/replica.psk".into())),
//!     overcommit_percent: 100,
//!     ..StoreConfig::default()
//! })?;
//! store.create("pvc-1.r0", 1 << 30)?;      // blocking: an RPC thread
//! // an engine: --volume pvc-1:1G:replicas=node-a:10900/pvc-1.r0+node-b:10900/pvc-1.r1
//! println!("{:?}", store.info()?);          // capacity, free, every replica
//! store.shutdown(Duration::from_secs(30))?;
//! ```
//!
//! Layout of `DIR`: `store.json` (the replicas this store holds: name and
//! size; replaced atomically, see [`crate::durable`]), `lock` (one daemon
//! per store), and `replicas/NAME/` for each replica, laid out as a `lull
//! replica --dir` directory (`data.img` and, once it took a snapshot,
//! `data.img.lull/` with its other layers; `meta.json`, `intent.bin`).
//!
//! Rules:
//! - A replica exists once `store.json` names it: `replica_create` makes
//!   its directory and files first and writes the record last, and undoes
//!   the directory when a step fails. A directory the record does not name
//!   (a create cut short by a crash) is left alone and named in a warning at
//!   start: `replica_import` adopts it, or the operator removes it.
//! - Thin provisioning with a guard: replicas are sparse, and a create is
//!   refused when the sizes of every replica (the new one included) would
//!   exceed `overcommit_percent` of what the filesystem can hold for them
//!   (its free space plus what the store's replicas already use). At 100
//!   every replica can be written in full.
//! - Deleting a replica an engine holds (its session owns the replica and
//!   has a connection open) is refused, naming the session.
//! - A write that finds the filesystem full fails on that replica with
//!   ENOSPC (the engine fails the replica and goes on degraded); nothing
//!   else changes.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use lull_bdev::BlockDevice;
use lull_net::link::LinkAuth;
use lull_net::server::Acceptor;
use lull_net::tls::Role;
use lull_proto::replica::check_replica_name;
use lull_reactor::FrameworkHandle;
use serde::{Deserialize, Serialize};

use crate::durable::{self, RecordError};
use crate::{
    bind, lock_dir, log_link_choice, open_replica, port_connections, DataOptions, Meta,
    ReplicaError, ReplicaFaults, Served, Shared, DATA_FILE, META_FILE,
};

/// File name of the store's record inside its directory.
pub const STORE_FILE: &str = "store.json";
/// Folder of the replicas' directories inside the store's.
pub const REPLICAS_DIR: &str = "replicas";
/// Version of the store record's layout; another is refused, not guessed.
pub const STORE_FORMAT_VERSION: u32 = 1;
/// Replicas one store holds. Each open replica holds three or four file
/// descriptors (data file, its scan descriptor, write-intent record) and
/// ~2 KiB of metadata; 4,096 keeps a store within 16k descriptors and a
/// record of ~1.3 MB, ten times the hundreds a node of ours is sized for.
pub const MAX_STORE_REPLICAS: usize = 4096;
/// Largest store record read: 4,096 entries of the longest name and size
/// are ~1.3 MB; a file much larger is not ours.
pub const STORE_RECORD_MAX_BYTES: u64 = 4 << 20;
/// Replica sizes are whole 4 KiB blocks: the unit of the data file's
/// allocation and of every client's block size.
pub const REPLICA_SIZE_ALIGN_BYTES: u64 = 4096;
/// Largest replica: 2^50 bytes (1 PiB) keeps every offset arithmetic far
/// from overflow and is beyond any disk a store sits on.
pub const MAX_REPLICA_SIZE_BYTES: u64 = 1 << 50;

/// What a store needs, resolved and checked.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub dir: PathBuf,
    pub listen: SocketAddr,
    /// How engines authenticate (the daemon's replica-link choice).
    pub link: LinkAuth,
    /// Sum of replica sizes allowed, in percent of what the filesystem can
    /// hold for them (100: no overcommit).
    pub overcommit_percent: u32,
    /// io_uring options of the data files.
    pub ring: lull_bdev::RingOptions,
    /// O_DIRECT data files.
    pub direct: bool,
    /// `sendfile` large READ replies on plain links (as `lull replica`).
    pub sendfile: bool,
    /// Fault injection on every replica (tests: `lull serve
    /// --store-fault-*`, as `lull replica --fault-*`).
    pub faults: ReplicaFaults,
}

impl Default for StoreConfig {
    fn default() -> StoreConfig {
        StoreConfig {
            dir: PathBuf::new(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            link: LinkAuth::Insecure,
            overcommit_percent: 100,
            ring: Default::default(),
            direct: false,
            sendfile: true,
            faults: ReplicaFaults::default(),
        }
    }
}

/// Errors of the store's operations, each with an errno for RPC.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("replica name {name:?}: {reason}")]
    BadName { name: String, reason: &'static str },
    #[error("replica size {0}: must be a positive multiple of 4096 bytes, at most 1 PiB")]
    BadSize(u64),
    #[error("replica {0:?} already exists")]
    Exists(String),
    #[error("no replica {0:?} in this store")]
    NotFound(String),
    #[error("replica {name:?} is held by engine session {session:#x} (it has connections open): detach or delete its volume first")]
    Held { name: String, session: u64 },
    #[error("replica {name:?} is held by engine session {session:#x}: a replica in use grows through its engine (volume_resize on the node running it), which grows every replica at once")]
    GrowHeld { name: String, session: u64 },
    #[error("replica {name:?}: {source}")]
    Grow {
        name: String,
        source: Box<crate::SnapshotError>,
    },
    #[error("replica {name:?} is held by engine session {session:#x}: a replica in use takes its snapshots through its engine (snapshot_create on the node running it), on every replica at once")]
    SnapshotHeld { name: String, session: u64 },
    #[error("replica {name:?}: {source}")]
    Snapshot {
        name: String,
        source: Box<crate::SnapshotError>,
    },
    #[error("the store holds {MAX_STORE_REPLICAS} replicas, its most")]
    Full,
    #[error("not enough space for a {size_bytes}-byte replica: replicas would total {committed_bytes} bytes, and the filesystem holds {room_bytes} bytes for them (x{overcommit_percent}% overcommit); raise store_overcommit to thin-provision more")]
    NoSpace {
        size_bytes: u64,
        committed_bytes: u64,
        room_bytes: u64,
        overcommit_percent: u32,
    },
    #[error("{path}: {reason}")]
    Leftover { path: PathBuf, reason: String },
    #[error("cannot import {path}: {reason}")]
    Import { path: PathBuf, reason: String },
    #[error("store record: {0}")]
    Record(#[from] RecordError),
    #[error("{path}: store record format version {found}, this lull reads {STORE_FORMAT_VERSION}")]
    Version { path: PathBuf, found: u32 },
    #[error("{path}: names replica {name:?} twice (or a name that is not valid): fix the record")]
    BadRecord { path: PathBuf, name: String },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("replica {name:?}: {source}")]
    Replica { name: String, source: ReplicaError },
    #[error("replica {replica:?} has no snapshot {snapshot:?}")]
    NoSnapshot { replica: String, snapshot: String },
    #[error("replica {name:?} is the base of clones {clones}: flatten or delete them first")]
    HasClones { name: String, clones: String },
    #[error("clone {name:?}: {source}")]
    Clone {
        name: String,
        source: lull_bdev::BdevError,
    },
    #[error(transparent)]
    Server(#[from] ReplicaError),
}

impl StoreError {
    /// The errno an RPC error reports.
    pub fn errno(&self) -> i32 {
        match self {
            StoreError::BadName { .. } | StoreError::BadSize(_) => libc::EINVAL,
            StoreError::Exists(_) | StoreError::Leftover { .. } => libc::EEXIST,
            StoreError::NotFound(_) => libc::ENOENT,
            StoreError::Held { .. }
            | StoreError::GrowHeld { .. }
            | StoreError::SnapshotHeld { .. } => libc::EBUSY,
            StoreError::Grow { source, .. } | StoreError::Snapshot { source, .. } => source.errno(),
            StoreError::Full => libc::EMFILE,
            StoreError::NoSpace { .. } => libc::ENOSPC,
            StoreError::Import { .. } => libc::EINVAL,
            StoreError::Record(e) => e.errno(),
            StoreError::Version { .. } | StoreError::BadRecord { .. } => libc::EINVAL,
            StoreError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            StoreError::Replica { source, .. } | StoreError::Server(source) => source.errno(),
            StoreError::NoSnapshot { .. } => libc::ENOENT,
            StoreError::HasClones { .. } => libc::EBUSY,
            StoreError::Clone { source, .. } => match source {
                lull_bdev::BdevError::Failed(m) if m.contains("layers") => libc::EMLINK,
                lull_bdev::BdevError::InUse(_) => libc::EBUSY,
                e => e.errno(),
            },
        }
    }

    /// Whether the caller asked for something this store refuses (a bad
    /// name or size, a name taken, no room), as opposed to a failure.
    pub fn is_refusal(&self) -> bool {
        if let StoreError::Grow { source, .. } | StoreError::Snapshot { source, .. } = self {
            return source.is_refusal();
        }
        matches!(
            self,
            StoreError::BadName { .. }
                | StoreError::BadSize(_)
                | StoreError::Exists(_)
                | StoreError::NotFound(_)
                | StoreError::Held { .. }
                | StoreError::GrowHeld { .. }
                | StoreError::SnapshotHeld { .. }
                | StoreError::Full
                | StoreError::NoSpace { .. }
                | StoreError::Leftover { .. }
                | StoreError::Import { .. }
                | StoreError::NoSnapshot { .. }
                | StoreError::HasClones { .. }
        )
    }
}

/// One replica as `replica_get` and `store_get` report it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaInfo {
    pub name: String,
    pub size_bytes: u64,
    /// Bytes the data files (every layer) occupy on disk (they are sparse).
    pub allocated_bytes: u64,
    pub generation: u64,
    /// The last engine detached cleanly and nothing wrote since.
    pub clean: bool,
    /// The write-intent record was lost (every region counts as set).
    pub intent_lost: bool,
    /// Write-intent regions set (regions that may differ from the peers).
    pub intent_bits_set: u64,
    /// The engine session holding the replica, in hex as logs print it
    /// (`None`: no engine connected). A string: a session is a u64, past
    /// what a JSON number keeps exactly in most clients.
    pub held_by_session: Option<String>,
    /// Connections open on the replica now.
    pub connections: usize,
    /// The replica's snapshots, oldest first (those it inherits as a
    /// clone included, marked so).
    pub snapshots: Vec<ReplicaSnapshot>,
}

/// One snapshot of a replica as `replica_get` and `store_get` report it:
/// what a cluster manager needs to find, compare and delete snapshots
/// with no engine running (the CSI controller's snapshots).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaSnapshot {
    pub name: String,
    pub created_unix: u64,
    /// Replicas of this store whose base it is (`replica_clone`).
    pub clones: Vec<String>,
    /// It belongs to the replica this one was cloned from.
    pub inherited: bool,
    /// A delete is merging it away (it leaves the list once done).
    pub merging: bool,
}

/// The store as `store_get` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoreInfo {
    pub dir: PathBuf,
    pub replica_addr: String,
    /// Size of the filesystem under the store.
    pub capacity_bytes: u64,
    /// Free bytes of that filesystem (for unprivileged writers).
    pub free_bytes: u64,
    /// Bytes the replicas' data files occupy.
    pub allocated_bytes: u64,
    /// Sum of the replicas' sizes (what they promise).
    pub provisioned_bytes: u64,
    pub overcommit_percent: u32,
    pub replicas: Vec<ReplicaInfo>,
}

/// The record in `DIR/store.json`.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoreRecord {
    format_version: u32,
    replicas: Vec<RecordEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordEntry {
    name: String,
    size_bytes: u64,
}

/// The store's replicas by name, read by connections at HELLO.
pub(crate) struct Index {
    /// Itself, for what a replica calls back (a grow's record write).
    me: std::sync::Weak<Index>,
    replicas: RwLock<BTreeMap<String, Arc<Shared>>>,
    dir: PathBuf,
    data: DataOptions,
    overcommit_percent: u32,
    conns: Arc<lull_net::server::Connections>,
    /// Serialises create, clone, delete and import: the record and the
    /// index change together, one change at a time.
    changes: Mutex<()>,
    /// Replica operations done (for the log's totals).
    created: AtomicU64,
}

impl Index {
    pub(crate) fn find(&self, name: &str) -> Option<Arc<Shared>> {
        self.read().get(name).cloned()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<String, Arc<Shared>>> {
        self.replicas.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<String, Arc<Shared>>> {
        self.replicas.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Refuses a new replica of `size_bytes` past the store's room (see
    /// the module doc: thin provisioning with a guard).
    fn check_room(
        &self,
        current: &BTreeMap<String, Arc<Shared>>,
        size_bytes: u64,
    ) -> Result<(), StoreError> {
        let (_, free) = fs_space(&self.dir)?;
        let allocated: u64 = current.values().map(|r| r.allocated_bytes()).sum();
        let provisioned: u64 = current.values().map(|r| r.size_bytes()).sum();
        let room = (u128::from(free + allocated) * u128::from(self.overcommit_percent) / 100)
            .min(u128::from(u64::MAX)) as u64;
        let committed = provisioned.saturating_add(size_bytes);
        if committed > room {
            return Err(StoreError::NoSpace {
                size_bytes,
                committed_bytes: committed,
                room_bytes: room,
                overcommit_percent: self.overcommit_percent,
            });
        }
        Ok(())
    }

    /// Makes the directory of new replica `name`; one already there is a
    /// create cut short, not overwritten.
    fn new_replica_dir(&self, name: &str) -> Result<PathBuf, StoreError> {
        let rdir = self.replica_dir(name);
        if let Err(e) = std::fs::create_dir(&rdir) {
            return Err(if e.kind() == std::io::ErrorKind::AlreadyExists {
                StoreError::Leftover {
                    path: rdir,
                    reason: "exists but the store record does not name it (a create cut short?): replica_import it or remove it".into(),
                }
            } else {
                io_err(&rdir)(e)
            });
        }
        Ok(rdir)
    }

    /// Creates replica `name` as a clone of snapshot `snapshot` of
    /// replica `origin`: its base is that snapshot and those below it
    /// (the origin's layer files, shared), its head a new empty layer in
    /// its own directory; it starts clean at generation 0, as a created
    /// replica (`lull_proto::replica`'s "Clones"). A replica of that name
    /// that is already a clone of the same snapshot is answered as made
    /// (a retry). Blocking (file creation and fsyncs).
    pub(crate) fn clone_replica(
        &self,
        name: &str,
        origin: &str,
        snapshot: &str,
    ) -> Result<ReplicaInfo, StoreError> {
        check_name(name)?;
        let _one = self.lock_changes();
        let current = self.read().clone();
        let from = current
            .get(origin)
            .ok_or_else(|| StoreError::NotFound(origin.into()))?
            .clone();
        if let Some(existing) = current.get(name) {
            if from.chain.has_clone(name, snapshot) {
                return Ok(info_of(name, existing));
            }
            return Err(StoreError::Exists(name.into()));
        }
        if !from.chain.has_snapshot(snapshot) {
            return Err(StoreError::NoSnapshot {
                replica: origin.into(),
                snapshot: snapshot.into(),
            });
        }
        if current.len() >= MAX_STORE_REPLICAS {
            return Err(StoreError::Full);
        }
        let size_bytes = from.size_bytes();
        self.check_room(&current, size_bytes)?;
        let rdir = self.new_replica_dir(name)?;
        let undo = |r: Option<&Arc<Shared>>| {
            if let Some(r) = r {
                r.intent.stop();
                r.close_chain();
            }
            from.chain.forget_clone(name);
            if let Err(e) = std::fs::remove_dir_all(&rdir) {
                tracing::warn!(path = %rdir.display(), error = %e, "cannot remove the directory of a clone not made");
            }
        };
        // The clone's chain record (its base and an empty head) and its
        // metadata first: `add` opens it as any replica's directory.
        let layers = Arc::new(lull_bdev::chain::FileStore::new(
            rdir.join(DATA_FILE),
            lull_bdev::FileOptions {
                direct: self.data.direct,
                create: true,
                ring: self.data.ring,
            },
        ));
        let made = from
            .chain
            .clone_snapshot(snapshot, name, layers)
            .map_err(|source| StoreError::Clone {
                name: name.into(),
                source,
            })
            .and_then(|chain| {
                drop(chain);
                Meta::new(size_bytes)
                    .store(&rdir)
                    .map_err(|e| StoreError::Replica {
                        name: name.into(),
                        source: e.into(),
                    })
            });
        if let Err(e) = made {
            undo(None);
            return Err(e);
        }
        let replica = self.add(name, &rdir, size_bytes, current, undo)?;
        self.created.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            replica = name,
            origin,
            snapshot,
            size_bytes,
            "replica cloned from a snapshot"
        );
        Ok(info_of(name, &replica))
    }

    /// Every replica forgets that clone `name` stands on it (the clone was
    /// flattened or deleted).
    pub(crate) fn forget_clone(&self, name: &str) {
        for (origin, r) in self.read().iter() {
            if r.chain.forget_clone(name) {
                tracing::info!(replica = %origin, clone = name, "a clone let go of its base");
            }
        }
    }

    fn replica_dir(&self, name: &str) -> PathBuf {
        self.dir.join(REPLICAS_DIR).join(name)
    }

    fn lock_changes(&self) -> std::sync::MutexGuard<'_, ()> {
        self.changes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Writes the record for `replicas` (blocking).
    fn store_record(&self, replicas: &BTreeMap<String, Arc<Shared>>) -> Result<(), StoreError> {
        write_record(&self.dir, replicas)
    }

    /// What `replica` runs once a GROW of it is durable: the record
    /// again, with its new size (under the store's change lock, from the
    /// index as it is then; the index is held weakly, as it holds the
    /// replica).
    fn watch_growth(&self, replica: &Shared) {
        let index = self.me.clone();
        let _ = replica.grown_hook.set(Box::new(move || {
            let Some(index) = index.upgrade() else {
                return Ok(());
            };
            let _one = index.lock_changes();
            let replicas = index.read().clone();
            write_record(&index.dir, &replicas).map_err(|e| e.to_string())
        }));
    }

    /// The last steps of a create or an import, with the replica's files
    /// in place under `rdir`: open it, write the record naming it, then
    /// serve it. A failed step calls `undo` (with the replica once it is
    /// open) and nothing of it stays in the store.
    fn add(
        &self,
        name: &str,
        rdir: &Path,
        size_bytes: u64,
        current: BTreeMap<String, Arc<Shared>>,
        undo: impl Fn(Option<&Arc<Shared>>),
    ) -> Result<Arc<Shared>, StoreError> {
        let opened = open_replica(
            rdir,
            Some(name.to_string()),
            size_bytes,
            &self.data,
            self.conns.clone(),
        );
        let replica = opened.map_err(|source| {
            undo(None);
            StoreError::Replica {
                name: name.into(),
                source,
            }
        })?;
        let mut next = current;
        next.insert(name.to_string(), replica.clone());
        if let Err(e) = self.store_record(&next) {
            undo(Some(&replica));
            return Err(e);
        }
        self.watch_growth(&replica);
        self.write().insert(name.to_string(), replica.clone());
        Ok(replica)
    }
}

/// A running store.
pub struct Store {
    index: Arc<Index>,
    acceptor: Acceptor,
    addr: SocketAddr,
    /// Holds the store's advisory lock until the store is dropped.
    _lock: File,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Store({}, {})", self.addr, self.index.dir.display())
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// (capacity, free) bytes of the filesystem holding `dir`.
fn fs_space(dir: &Path) -> Result<(u64, u64), StoreError> {
    let st = rustix::fs::statvfs(dir).map_err(|e| StoreError::Io {
        path: dir.to_path_buf(),
        source: e.into(),
    })?;
    let unit = st.f_frsize.max(1);
    Ok((st.f_blocks * unit, st.f_bavail * unit))
}

fn check_name(name: &str) -> Result<(), StoreError> {
    check_replica_name(name).map_err(|reason| StoreError::BadName {
        name: name.chars().take(64).collect(),
        reason,
    })
}

/// Writes `dir/store.json` naming `replicas` with their sizes now
/// (blocking).
fn write_record(dir: &Path, replicas: &BTreeMap<String, Arc<Shared>>) -> Result<(), StoreError> {
    let record = StoreRecord {
        format_version: STORE_FORMAT_VERSION,
        replicas: replicas
            .iter()
            .map(|(name, r)| RecordEntry {
                name: name.clone(),
                size_bytes: r.size_bytes(),
            })
            .collect(),
    };
    durable::store_json(&dir.join(STORE_FILE), &record)?;
    Ok(())
}

fn check_size(size_bytes: u64) -> Result<(), StoreError> {
    if size_bytes == 0
        || !size_bytes.is_multiple_of(REPLICA_SIZE_ALIGN_BYTES)
        || size_bytes > MAX_REPLICA_SIZE_BYTES
    {
        return Err(StoreError::BadSize(size_bytes));
    }
    Ok(())
}

fn info_of(name: &str, r: &Shared) -> ReplicaInfo {
    let (lost, bitmap) = r.intent.snapshot();
    ReplicaInfo {
        name: name.to_string(),
        size_bytes: r.size_bytes(),
        allocated_bytes: r.allocated_bytes(),
        generation: r.generation.load(Ordering::SeqCst),
        clean: r.hello_flags() & lull_proto::replica::HELLO_FLAG_CLEAN != 0,
        intent_lost: lost,
        intent_bits_set: if lost {
            u64::from(r.regions())
        } else {
            bitmap.iter().map(|b| u64::from(b.count_ones())).sum()
        },
        held_by_session: r.fences.holder().map(|s| format!("{s:#x}")),
        connections: r.fences.connections(),
        snapshots: r
            .chain
            .snapshots()
            .into_iter()
            .map(|s| ReplicaSnapshot {
                name: s.name,
                created_unix: s.created_unix,
                clones: s.clones,
                inherited: s.inherited,
                merging: s.merging.is_some(),
            })
            .collect(),
    }
}

impl Store {
    /// Opens the store in `config.dir` (creating it when new), opens every
    /// replica its record names, binds the replica port and starts
    /// accepting on the main reactor. A record that cannot be read, or a
    /// replica that cannot be opened, is an error: a node never starts
    /// without replicas it holds.
    pub fn open(fw: &FrameworkHandle, config: &StoreConfig) -> Result<Store, StoreError> {
        let tls = config
            .link
            .context(Role::Server)
            .map_err(ReplicaError::from)?;
        let dir = config.dir.clone();
        std::fs::create_dir_all(dir.join(REPLICAS_DIR)).map_err(io_err(&dir))?;
        let lock = lock_dir(&dir)?;
        let record_path = dir.join(STORE_FILE);
        let record: StoreRecord = durable::load_json(&record_path, STORE_RECORD_MAX_BYTES)?
            .unwrap_or(StoreRecord {
                format_version: STORE_FORMAT_VERSION,
                replicas: Vec::new(),
            });
        if record.format_version != STORE_FORMAT_VERSION {
            return Err(StoreError::Version {
                path: record_path,
                found: record.format_version,
            });
        }
        let conns = port_connections(crate::MAX_STORE_CONNECTIONS);
        let data = DataOptions {
            direct: config.direct,
            ring: config.ring,
            faults: config.faults,
            // Plain links only: a TLS session encrypts in user space.
            sendfile: config.sendfile && tls.is_none(),
        };
        let mut replicas = BTreeMap::new();
        let stop_all = |replicas: &BTreeMap<String, Arc<Shared>>| {
            for r in replicas.values() {
                r.intent.stop();
            }
        };
        for e in &record.replicas {
            if check_replica_name(&e.name).is_err() || replicas.contains_key(&e.name) {
                stop_all(&replicas);
                return Err(StoreError::BadRecord {
                    path: record_path,
                    name: e.name.clone(),
                });
            }
            let rdir = dir.join(REPLICAS_DIR).join(&e.name);
            match open_replica(
                &rdir,
                Some(e.name.clone()),
                e.size_bytes,
                &data,
                conns.clone(),
            ) {
                Ok(r) => {
                    replicas.insert(e.name.clone(), r);
                }
                Err(source) => {
                    stop_all(&replicas);
                    return Err(StoreError::Replica {
                        name: e.name.clone(),
                        source,
                    });
                }
            }
        }
        // A clone reference whose clone is gone, or stands alone, is what
        // a crash between a clone's delete or flatten and its origin's
        // record left: the snapshot it names is free again.
        for (origin, r) in &replicas {
            for clone in r.chain.clone_names() {
                if !replicas.get(&clone).is_some_and(|c| c.chain.has_base()) {
                    tracing::info!(replica = %origin, clone, "a clone that is gone or flattened let go of its base");
                    r.chain.forget_clone(&clone);
                }
            }
        }
        if let Ok(entries) = std::fs::read_dir(dir.join(REPLICAS_DIR)) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if !replicas.contains_key(&name) {
                    tracing::warn!(path = %entry.path().display(),
                        "a replica directory the store record does not name (a create cut short?): not served; adopt it with replica_import or remove it");
                }
            }
        }
        let index = Arc::new_cyclic(|me| Index {
            me: me.clone(),
            replicas: RwLock::new(replicas),
            dir: dir.clone(),
            data,
            overcommit_percent: config.overcommit_percent,
            conns: conns.clone(),
            changes: Mutex::new(()),
            created: AtomicU64::new(0),
        });
        let (listener, addr) = match bind(config.listen) {
            Ok(l) => l,
            Err(e) => {
                stop_all(&index.read());
                return Err(e.into());
            }
        };
        let port = Arc::new(crate::Port {
            tls,
            conns: conns.clone(),
            faults: config.faults,
            conns_accepted: AtomicU64::new(0),
            served: Served::Store(index.clone()),
        });
        let acceptor = match crate::accept(fw, port, listener) {
            Ok(a) => a,
            Err(e) => {
                stop_all(&index.read());
                return Err(ReplicaError::from(e).into());
            }
        };
        log_link_choice(&config.link);
        let count = index.read().len();
        tracing::info!(addr = %addr, dir = %dir.display(), replicas = count,
            overcommit_percent = config.overcommit_percent, "replica store serving");
        let store = Store {
            index,
            acceptor,
            addr,
            _lock: lock,
        };
        let opened: Vec<(String, Arc<Shared>)> = store
            .index
            .read()
            .iter()
            .map(|(n, r)| (n.clone(), r.clone()))
            .collect();
        for (_, r) in &opened {
            store.index.watch_growth(r);
        }
        // A replica grown online whose GROW's record write did not happen
        // (a crash right after it): its own record was taken at open.
        if record.replicas.iter().any(|e| {
            opened
                .iter()
                .any(|(n, r)| *n == e.name && r.size_bytes() != e.size_bytes)
        }) {
            let _one = store.index.lock_changes();
            store.index.store_record(&store.index.read())?;
            tracing::info!(dir = %store.index.dir.display(), "store record updated with the sizes of replicas grown online");
        }
        Ok(store)
    }

    /// The replica port's address (with the real port for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn dir(&self) -> &Path {
        &self.index.dir
    }

    /// Creates an empty replica of `size_bytes` (sparse). Blocking (file
    /// creation and fsyncs): from an RPC thread, never a reactor.
    pub fn create(&self, name: &str, size_bytes: u64) -> Result<ReplicaInfo, StoreError> {
        check_name(name)?;
        check_size(size_bytes)?;
        let _one = self.index.lock_changes();
        let current = self.index.read().clone();
        if current.contains_key(name) {
            return Err(StoreError::Exists(name.into()));
        }
        if current.len() >= MAX_STORE_REPLICAS {
            return Err(StoreError::Full);
        }
        self.index.check_room(&current, size_bytes)?;
        let rdir = self.index.new_replica_dir(name)?;
        let undo = |r: Option<&Arc<Shared>>| {
            if let Some(r) = r {
                r.intent.stop();
            }
            if let Err(e) = std::fs::remove_dir_all(&rdir) {
                tracing::warn!(path = %rdir.display(), error = %e, "cannot remove the directory of a replica not created");
            }
        };
        let replica = self.index.add(name, &rdir, size_bytes, current, undo)?;
        self.index.created.fetch_add(1, Ordering::Relaxed);
        tracing::info!(replica = name, size_bytes, "replica created");
        Ok(info_of(name, &replica))
    }

    /// Deletes a replica and its data. Refused while an engine holds it.
    /// Blocking (an fsync, the removal of its files).
    pub fn delete(&self, name: &str) -> Result<(), StoreError> {
        check_name(name)?;
        let _one = self.index.lock_changes();
        let Some(replica) = self.index.find(name) else {
            return Err(StoreError::NotFound(name.into()));
        };
        // Its files are the base of these: they would read files gone.
        let clones = replica.chain.clone_names();
        if !clones.is_empty() {
            return Err(StoreError::HasClones {
                name: name.into(),
                clones: clones.join(", "),
            });
        }
        if let Some(session) = replica.fences.holder() {
            return Err(StoreError::Held {
                name: name.into(),
                session,
            });
        }
        let mut next = self.index.read().clone();
        next.remove(name);
        self.index.store_record(&next)?;
        // From here the replica is gone: new HELLOs find nothing, and the
        // connections it still has (tools, a closing engine) close.
        self.index.write().remove(name);
        replica.deleted.store(true, Ordering::SeqCst);
        replica.intent.stop();
        // No snapshot operation or merge writes under the directory once
        // it is removed (a merge's record would make it again).
        replica.close_chain();
        if let Err(e) = std::fs::remove_dir_all(&replica.dir) {
            tracing::warn!(replica = name, path = %replica.dir.display(), error = %e,
                "replica deleted from the store, and its directory could not be removed");
        }
        // A deleted clone no longer holds its origin's snapshots.
        if replica.chain.has_base() {
            self.index.forget_clone(name);
        }
        tracing::info!(replica = name, "replica deleted");
        Ok(())
    }

    /// Grows replica `name`, which no engine holds, to `size_bytes` (a
    /// GROW done by the store: `crate::grow`); the same size again
    /// changes nothing. Refused while an engine holds the replica: an
    /// engine grows its replicas together (GROW, under its own hold of
    /// writes), and a replica grown under it alone would leave the
    /// others behind. Blocking (fsyncs): an RPC thread.
    ///
    /// An engine that connects while this runs either meets the old size
    /// (its volume is that size; a later grow through it takes every
    /// replica to the new one) or the new size, and then its HELLO is
    /// refused (size mismatch) like any engine of another size.
    pub fn grow(&self, name: &str, size_bytes: u64) -> Result<ReplicaInfo, StoreError> {
        check_name(name)?;
        check_size(size_bytes)?;
        let _one = self.index.lock_changes();
        let Some(replica) = self.index.find(name) else {
            return Err(StoreError::NotFound(name.into()));
        };
        let size = replica.size_bytes();
        if size_bytes != size {
            if let Some(session) = replica.fences.holder() {
                return Err(StoreError::GrowHeld {
                    name: name.into(),
                    session,
                });
            }
            if size_bytes > size {
                // Thin provisioning counts the new bytes like a new
                // replica of that many.
                let current = self.index.read().clone();
                self.index.check_room(&current, size_bytes - size)?;
            }
            let grown = replica
                .grow_durable(size_bytes)
                .map_err(|e| StoreError::Grow {
                    name: name.into(),
                    source: Box::new(e),
                })?;
            if grown {
                // The replica's own record has the new size already; the
                // store's follows (a store opening a replica whose own
                // record is larger takes that, so a crash here is safe).
                let current = self.index.read().clone();
                self.index.store_record(&current)?;
                tracing::info!(
                    replica = name,
                    from = size,
                    to = size_bytes,
                    "replica grown by its store (no engine holds it)"
                );
            }
        }
        Ok(info_of(name, &replica))
    }

    /// Creates or deletes snapshot `snapshot` of replica `name`, which no
    /// engine holds (`replica_snapshot`: a volume attached nowhere, whose
    /// snapshots a cluster manager takes replica by replica); a delete
    /// starts the merge and returns, as SNAPSHOT does. Refused while an
    /// engine holds the replica: an engine takes a snapshot on every
    /// replica at once with writes held, and one taken under it on one
    /// replica alone would hold other bytes than its peers'. Only create
    /// and delete: a revert or flatten goes through an engine. Blocking
    /// (fsyncs): an RPC thread.
    ///
    /// The holder is checked under the store's change lock and the chain
    /// operation is serialised with the engine's, but an engine may
    /// connect and write between two replicas' calls: the caller compares
    /// each replica's `generation` and `clean` before and after (as the
    /// CSI controller does) to know that no write came between.
    pub fn snapshot(
        &self,
        name: &str,
        snapshot: &str,
        op: lull_proto::replica::SnapshotOp,
    ) -> Result<ReplicaInfo, StoreError> {
        use lull_proto::replica::SnapshotOp;
        check_name(name)?;
        let _one = self.index.lock_changes();
        let Some(replica) = self.index.find(name) else {
            return Err(StoreError::NotFound(name.into()));
        };
        if let Some(session) = replica.fences.holder() {
            return Err(StoreError::SnapshotHeld {
                name: name.into(),
                session,
            });
        }
        if !matches!(op, SnapshotOp::Create | SnapshotOp::Delete) {
            return Err(StoreError::Snapshot {
                name: name.into(),
                source: Box::new(crate::SnapshotError::Busy(
                    "a store takes and deletes snapshots only; a revert or flatten goes through an engine".into(),
                )),
            });
        }
        let req = lull_proto::replica::SnapshotRequest {
            op,
            name: snapshot.to_string(),
        };
        replica
            .snapshot_run(&req, self.index.me.upgrade())
            .map_err(|e| StoreError::Snapshot {
                name: name.into(),
                source: Box::new(e),
            })?;
        tracing::info!(
            replica = name,
            snapshot,
            ?op,
            "snapshot operation by the store (no engine holds the replica)"
        );
        Ok(info_of(name, &replica))
    }

    /// Creates replica `name` as a clone of snapshot `snapshot` of replica
    /// `origin` of this store (shared, not copied; see
    /// `lull_proto::replica`'s "Clones"). Blocking: an RPC thread.
    pub fn clone_replica(
        &self,
        name: &str,
        origin: &str,
        snapshot: &str,
    ) -> Result<ReplicaInfo, StoreError> {
        check_name(origin)?;
        self.index.clone_replica(name, origin, snapshot)
    }

    /// One replica's state.
    pub fn get(&self, name: &str) -> Result<ReplicaInfo, StoreError> {
        check_name(name)?;
        let replica = self
            .index
            .find(name)
            .ok_or_else(|| StoreError::NotFound(name.into()))?;
        Ok(info_of(name, &replica))
    }

    /// Replica `name`'s data as a device of this process: its chain (the
    /// live head and its snapshots' read-only views), for work that reads
    /// or fills a replica with no engine (a backup of one of its
    /// snapshots, a restore into a new replica). Writes through it bypass
    /// the replica protocol's generation and write-intent record: the
    /// caller writes only a replica no engine has attached yet.
    pub fn chain(&self, name: &str) -> Result<Arc<dyn BlockDevice>, StoreError> {
        check_name(name)?;
        let replica = self
            .index
            .find(name)
            .ok_or_else(|| StoreError::NotFound(name.into()))?;
        Ok(replica.chain.clone())
    }

    /// The store's space and every replica.
    pub fn info(&self) -> Result<StoreInfo, StoreError> {
        let (capacity, free) = fs_space(&self.index.dir)?;
        let replicas: Vec<ReplicaInfo> = self
            .index
            .read()
            .iter()
            .map(|(name, r)| info_of(name, r))
            .collect();
        Ok(StoreInfo {
            dir: self.index.dir.clone(),
            replica_addr: self.addr.to_string(),
            capacity_bytes: capacity,
            free_bytes: free,
            allocated_bytes: replicas.iter().map(|r| r.allocated_bytes).sum(),
            provisioned_bytes: replicas.iter().map(|r| r.size_bytes).sum(),
            overcommit_percent: self.index.overcommit_percent,
            replicas,
        })
    }

    /// Replicas held now.
    pub fn len(&self) -> usize {
        self.index.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Adopts the directory of a `lull replica --dir` as replica `name`:
    /// moves it under the store (a rename, so it must be on the store's
    /// filesystem; nothing is copied) and serves it with its generation,
    /// clean flag and write-intent record as they were. The directory must
    /// not be in use (its lock is taken first).
    pub fn import(&self, name: &str, from: &Path) -> Result<ReplicaInfo, StoreError> {
        check_name(name)?;
        let bad = |reason: String| StoreError::Import {
            path: from.to_path_buf(),
            reason,
        };
        let meta = Meta::load(from)
            .map_err(|e| bad(e.to_string()))?
            .ok_or_else(|| bad(format!("no {META_FILE}: not a lull replica directory")))?;
        // `data.img` is the first layer; a replica whose first layer was
        // merged away (its oldest snapshot deleted) lives in
        // `data.img.lull/`, named by the chain's record there.
        let layers = lull_bdev::chain::FileStore::new(from.join(DATA_FILE), Default::default());
        if !from.join(DATA_FILE).is_file()
            && !layers
                .dir()
                .join(lull_bdev::chain::CHAIN_RECORD_FILE)
                .is_file()
        {
            return Err(bad(format!("no {DATA_FILE}: not a lull replica directory")));
        }
        check_size(meta.volume_size)?;
        let _one = self.index.lock_changes();
        let current = self.index.read().clone();
        if current.contains_key(name) {
            return Err(StoreError::Exists(name.into()));
        }
        if current.len() >= MAX_STORE_REPLICAS {
            return Err(StoreError::Full);
        }
        // A running `lull replica` holds this lock: refuse rather than
        // serve one data file from two processes.
        let lock = lock_dir(from).map_err(|e| bad(e.to_string()))?;
        let rdir = self.index.replica_dir(name);
        if rdir.exists() {
            return Err(StoreError::Leftover {
                path: rdir,
                reason: "exists already: remove it or pick another name".into(),
            });
        }
        std::fs::rename(from, &rdir).map_err(|e| {
            if e.raw_os_error() == Some(libc::EXDEV) {
                bad(format!(
                    "it is on another filesystem than the store ({}): move it there first",
                    self.index.dir.display()
                ))
            } else {
                bad(e.to_string())
            }
        })?;
        drop(lock);
        let _ = std::fs::remove_file(rdir.join(crate::LOCK_FILE));
        let move_back = || {
            if let Err(e) = std::fs::rename(&rdir, from) {
                tracing::error!(from = %rdir.display(), to = %from.display(), error = %e,
                    "import failed and the directory could not be moved back: it is left under the store");
            }
        };
        let undo = |r: Option<&Arc<Shared>>| {
            if let Some(r) = r {
                r.intent.stop();
            }
            move_back();
        };
        let replica = self
            .index
            .add(name, &rdir, meta.volume_size, current, undo)?;
        tracing::info!(replica = name, from = %from.display(), size_bytes = meta.volume_size,
            generation = meta.generation, clean = meta.clean, "replica imported");
        Ok(info_of(name, &replica))
    }

    /// Stops cleanly: no new connections; every connection finishes its
    /// in-flight requests and closes; every replica's data is synced and
    /// its pending write-intent changes stored. Clean flags stay as they
    /// are (as `lull replica`'s stop).
    pub fn shutdown(&self, timeout: Duration) -> Result<(), StoreError> {
        self.acceptor.stop();
        let open = self.acceptor.drain(timeout);
        let replicas = self.index.read().clone();
        let mut first_err = None;
        for (name, r) in &replicas {
            r.close_chain();
            let result = r
                .chain
                .sync()
                .map_err(ReplicaError::from)
                .and_then(|()| r.intent.flush().map_err(ReplicaError::from));
            r.intent.stop();
            r.lock_meta().sealed = true;
            if let Err(source) = result {
                tracing::error!(replica = %name, error = %source, "replica sync at stop failed");
                first_err.get_or_insert(StoreError::Replica {
                    name: name.clone(),
                    source,
                });
            }
        }
        tracing::info!(
            replicas = replicas.len(),
            created = self.index.created.load(Ordering::Relaxed),
            "replica store stopped"
        );
        if open > 0 {
            return Err(ReplicaError::Unclean { open }.into());
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Store {
    /// Without `shutdown`, connections are told to close, and the
    /// write-intent threads store what is pending and stop.
    fn drop(&mut self) {
        self.acceptor.stop();
        for r in self.index.read().values() {
            r.intent.stop();
            r.close_chain();
        }
    }
}
