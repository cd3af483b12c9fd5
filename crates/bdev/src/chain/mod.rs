//! Snapshots and clones: a device that is a chain of layers.
//!
//! A chain is a writable head over read-only snapshots, bottom first.
//! Each layer is a device of the volume's size (a sparse file, or memory)
//! and a bitmap of the [`CHAIN_BLOCK_BYTES`] blocks it holds. A read of a
//! block goes to the topmost layer holding it, found with one lookup in
//! the chain's top map (one byte per block), not by walking the layers; a
//! block no layer holds reads as zeros. Writes go to the head; an
//! unaligned write to a block that a lower layer holds and the head does
//! not copies the rest of that block up first. A snapshot freezes the
//! head and starts an empty one: O(1) in data, only the maps are touched.
//! Deleting a snapshot merges its blocks into its child (in the
//! background; I/O continues), then drops the layer. A clone is a new
//! chain whose lower layers are another chain's snapshot and below,
//! shared, not copied.
//!
//! A chain of one layer (no snapshot ever taken) passes every request
//! straight to that layer: a volume without snapshots pays one atomic
//! load per request for the ability to take one.
//!
//! Control operations (snapshot, revert, the end of a merge) quiesce the
//! chain first: new requests are held (`BdevError::Full`, which frontends
//! hold and retry) and the ones in flight complete; so a snapshot holds
//! every write acknowledged before it and none issued after it.
//!
//! Where the layers and the chain's record live is a [`LayerStore`]'s
//! business: memory ([`MemoryStore`]), or files next to the volume's file
//! with a JSON record replaced atomically ([`FileStore`]).
//!
//! Rules a caller of the data path should know:
//! - Trim and zeroing of blocks a lower layer holds write zeros into the
//!   head (a hole in the head would let the snapshot's data show through,
//!   and a punched hole is not told apart from "never written" when the
//!   maps are rebuilt at open).
//! - Two writes in flight at once to the same block, one of them
//!   unaligned and the first to that block since a snapshot, from two
//!   different connections: the unaligned one's copy-up may carry the
//!   snapshot's bytes over the other's bytes of that block outside its
//!   own range. NBD leaves overlapping writes in flight unordered; writes
//!   of one connection are ordered (a copy-up waits for the connection's
//!   own writes to its blocks), and two copy-ups never overlap.
//!
//! # Layout
//!
//! - `channel`: a chain's channel: reads split by layer, writes to the head, copy-ups.
//! - `map`: the allocation maps: one bit per block per layer, and the top map.
//! - `store`: where the layers and the record live: memory ([`MemoryStore`]) or files ([`FileStore`]).

mod channel;
pub(crate) mod map;
mod store;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use crate::{push_change, BdevError, BlockDevice, ChangeRun, Channel, Extent};
use map::{blocks_of, Bitmap, TopMap};

pub use channel::CHAIN_CHANNEL_DEPTH;
pub use store::{
    ChainRecord, CloneRef, FileStore, LayerRecord, LayerStore, MemoryStore, CHAIN_RECORD_FILE,
};

/// The unit of the allocation maps: what a layer holds, what a write
/// copies up. 4 KiB is the page and filesystem block size, so a layer
/// file's SEEK_DATA/SEEK_HOLE map (rebuilt at open) is exact at it, and
/// 4 KiB writes (the common small write) never copy up.
pub const CHAIN_BLOCK_BYTES: u64 = 4096;

/// Layers in one chain: snapshots plus the head (a clone counts the
/// layers it shares). Past it `snapshot_create` is refused until a
/// snapshot is deleted. Reads cost one map lookup whatever the length,
/// but each layer is an open file, a bitmap of 32 KiB per GiB, and a
/// place a merge or a rebuild must visit; qcow2 chains past a few dozen
/// layers are where users are told to commit. 64 is far more than
/// periodic snapshots need (Longhorn caps at 250, most schedules keep
/// 7-30).
pub const MAX_CHAIN_LAYERS: usize = 64;

/// Longest snapshot name, in bytes: it is part of an NBD export name
/// (`VOLUME@SNAPSHOT`) and of a file name.
pub const MAX_SNAPSHOT_NAME_LEN: usize = 200;

/// How long a control operation waits for the requests in flight to
/// complete before it gives up (and resumes I/O): a device that takes
/// longer is failing, and the operation is refused rather than holding
/// clients for longer.
pub const QUIESCE_TIMEOUT: Duration = Duration::from_secs(10);

/// Bytes a merge copies per step. With the head as its target, each
/// step holds the chain's I/O for the copy (a few milliseconds at this
/// size); between steps I/O runs.
pub const MERGE_STEP_BYTES: u64 = 4 << 20;

/// Memory of the maps, per GiB of volume: a bitmap per layer, and the
/// top map once the chain has more than one layer.
pub const BITMAP_BYTES_PER_GIB: u64 = (1 << 30) / CHAIN_BLOCK_BYTES / 8;
pub const TOP_MAP_BYTES_PER_GIB: u64 = (1 << 30) / CHAIN_BLOCK_BYTES;

/// Checks a snapshot name: 1 to [`MAX_SNAPSHOT_NAME_LEN`] bytes of
/// letters, digits, `-`, `_`, `.` and `:`, not starting with `.` (no `@`,
/// which separates it from the volume's name in an export name, no `/`,
/// no spaces).
pub fn check_snapshot_name(name: &str) -> Result<(), BdevError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_SNAPSHOT_NAME_LEN
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.' | b':'));
    if ok {
        Ok(())
    } else {
        Err(BdevError::BadName(format!(
            "invalid snapshot name {name:?}: 1 to {MAX_SNAPSHOT_NAME_LEN} bytes of letters, digits, '-', '_', '.', ':', not starting with '.'"
        )))
    }
}

/// One layer: its device and the blocks it holds.
pub(crate) struct Layer {
    pub(crate) id: u64,
    pub(crate) dev: Arc<dyn BlockDevice>,
    /// Shared by the states that hold this layer (a snapshot freezing the
    /// head keeps its bitmap; a merge into a frozen layer sets bits while
    /// another operation may make a new state).
    pub(crate) held: Arc<Bitmap>,
    /// `None` for the head.
    pub(crate) snapshot: Option<SnapshotMeta>,
    /// The layer belongs to another chain (a clone's base): never written,
    /// merged or discarded by this one.
    pub(crate) foreign: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SnapshotMeta {
    pub(crate) name: String,
    pub(crate) created_unix: u64,
}

/// The layers at one moment. Channels hold an `Arc` of it and take the
/// new one when the generation changes and they have nothing in flight.
pub(crate) struct State {
    pub(crate) layers: Vec<Arc<Layer>>,
    /// `None` for one layer (everything passes through).
    pub(crate) top: Option<Arc<TopMap>>,
    pub(crate) read_only: bool,
}

impl State {
    fn head(&self) -> &Arc<Layer> {
        self.layers.last().expect("a chain has at least one layer")
    }

    fn index_of(&self, snapshot: &str) -> Option<usize> {
        self.layers
            .iter()
            .position(|l| l.snapshot.as_ref().is_some_and(|s| s.name == snapshot))
    }

    fn build_top(layers: &[Arc<Layer>], blocks: u64) -> Option<Arc<TopMap>> {
        (layers.len() > 1).then(|| {
            let maps: Vec<&Bitmap> = layers.iter().map(|l| l.held.as_ref()).collect();
            Arc::new(TopMap::build(blocks, &maps))
        })
    }
}

/// What channels share: the state, the pause, the copy-up locks.
pub(crate) struct Shared {
    /// Raised by `grow` (with one layer, it is the layer's).
    size_bytes: AtomicU64,
    pub(crate) state: RwLock<Arc<State>>,
    pub(crate) generation: AtomicU64,
    /// Quiesces in force (a merge step and a snapshot may overlap): new
    /// requests are held while it is above 0.
    pub(crate) paused: AtomicUsize,
    /// Each channel's count of requests in flight, for the quiesce.
    pub(crate) channels: Mutex<Vec<Weak<AtomicUsize>>>,
    /// Block ranges `[first, end)` under a copy-up, and how many.
    pub(crate) copyups: Mutex<Vec<(u64, u64)>>,
    pub(crate) copyups_active: AtomicUsize,
}

impl Shared {
    fn new(size_bytes: u64, state: State) -> Arc<Shared> {
        Arc::new(Shared {
            size_bytes: AtomicU64::new(size_bytes),
            state: RwLock::new(Arc::new(state)),
            generation: AtomicU64::new(0),
            paused: AtomicUsize::new(0),
            channels: Mutex::default(),
            copyups: Mutex::default(),
            copyups_active: AtomicUsize::new(0),
        })
    }

    pub(crate) fn size(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    pub(crate) fn state(&self) -> Arc<State> {
        self.state.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_state(&self, state: State) {
        *self.state.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(state);
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Allocation from the maps (see [`extents_of`]).
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, BdevError> {
        extents_of(&self.state(), self.size(), offset, len, max)
    }

    /// What changed since `since` up to the top of this state (the head,
    /// or a view's snapshot).
    fn changed_since(
        &self,
        since: &str,
        offset: u64,
        len: u64,
        max: usize,
    ) -> Result<Vec<ChangeRun>, BdevError> {
        changed_of(&self.state(), self.size(), since, offset, len, max)
    }

    /// The snapshots in this state, oldest first.
    fn snapshot_names(&self) -> Vec<String> {
        self.state()
            .layers
            .iter()
            .filter_map(|l| l.snapshot.as_ref().map(|s| s.name.clone()))
            .collect()
    }

    /// Holds new requests and waits for those in flight; I/O resumes when
    /// the guard drops.
    fn quiesce(&self) -> Result<Quiesced<'_>, BdevError> {
        self.paused.fetch_add(1, Ordering::SeqCst);
        let guard = Quiesced { shared: self };
        let start = Instant::now();
        loop {
            let busy: usize = {
                let mut list = self.channels.lock().unwrap_or_else(|p| p.into_inner());
                list.retain(|w| w.strong_count() > 0);
                list.iter()
                    .filter_map(Weak::upgrade)
                    .map(|c| c.load(Ordering::SeqCst))
                    .sum()
            };
            if busy == 0 {
                return Ok(guard);
            }
            if start.elapsed() > QUIESCE_TIMEOUT {
                return Err(BdevError::Failed(format!(
                    "{busy} requests still in flight after {QUIESCE_TIMEOUT:?}; the operation was not done"
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Takes `[first, end)` for a copy-up if no other copy-up has any of it.
    pub(crate) fn lock_blocks(&self, first: u64, end: u64) -> bool {
        let mut l = self.copyups.lock().unwrap_or_else(|p| p.into_inner());
        if l.iter().any(|&(a, b)| a < end && first < b) {
            return false;
        }
        l.push((first, end));
        self.copyups_active.fetch_add(1, Ordering::AcqRel);
        true
    }

    pub(crate) fn unlock_blocks(&self, first: u64, end: u64) {
        let mut l = self.copyups.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = l.iter().position(|&r| r == (first, end)) {
            l.swap_remove(i);
            self.copyups_active.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Whether a copy-up holds any of `[first, end)`.
    pub(crate) fn blocks_locked(&self, first: u64, end: u64) -> bool {
        if self.copyups_active.load(Ordering::Acquire) == 0 {
            return false;
        }
        let l = self.copyups.lock().unwrap_or_else(|p| p.into_inner());
        l.iter().any(|&(a, b)| a < end && first < b)
    }
}

struct Quiesced<'a> {
    shared: &'a Shared,
}

impl Drop for Quiesced<'_> {
    fn drop(&mut self) {
        self.shared.paused.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A snapshot as `snapshot_list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    pub created_unix: u64,
    pub size_bytes: u64,
    /// Bytes of blocks the snapshot's own layer holds (what deleting it
    /// would merge, what it costs beyond its parent).
    pub allocated_bytes: u64,
    /// The snapshot below it, if any.
    pub parent: Option<String>,
    /// Clones whose base it is (volume names).
    pub clones: Vec<String>,
    /// It belongs to the chain this one was cloned from (a layer of the
    /// clone's base): read, never merged or deleted by this chain.
    pub inherited: bool,
    /// A delete is merging it into its child: bytes done of the total.
    pub merging: Option<(u64, u64)>,
}

/// A merge in the background.
struct Merge {
    snapshot: String,
    /// A flatten: the merge copies the clone's base (every inherited
    /// snapshot shows it as merging).
    base: bool,
    done_bytes: Arc<AtomicU64>,
    total_bytes: u64,
    /// Set by [`ChainDev::stop_merge`]: the merge stops before its next step.
    stop: Arc<AtomicBool>,
    /// Set by the merge once the chain no longer holds what it merged: all
    /// that is left is removing the merged layers' files.
    committed: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<Result<(), BdevError>>>,
}

/// A chain of layers as a block device (see the module doc).
pub struct ChainDev {
    shared: Arc<Shared>,
    store: Arc<dyn LayerStore>,
    /// The committed record's clone references (volumes using a snapshot).
    clones: Arc<Mutex<Vec<CloneRef>>>,
    /// Serialises control operations (and a merge's last step).
    control: Arc<Mutex<()>>,
    next_id: AtomicU64,
    merge: Mutex<Option<Merge>>,
}

impl std::fmt::Debug for ChainDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChainDev({})", self.describe())
    }
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The bitmap of what `dev` holds, from its extents (a file's
/// SEEK_DATA/SEEK_HOLE; memory's chunks).
fn held_of(dev: &dyn BlockDevice, size_bytes: u64) -> Result<Bitmap, BdevError> {
    let held = Bitmap::new(blocks_of(size_bytes));
    let mut pos = 0;
    while pos < size_bytes {
        let ext = dev.extents(pos, size_bytes - pos, 1024)?;
        let mut moved = 0;
        for e in ext {
            if !e.hole {
                let (first, end) = map::block_span(pos + moved, e.length_bytes);
                held.set_range(first, end);
            }
            moved += e.length_bytes;
        }
        if moved == 0 {
            break;
        }
        pos += moved;
    }
    Ok(held)
}

impl ChainDev {
    /// Opens the chain `store` keeps (its record, its layers, their maps
    /// rebuilt), or a new chain of one empty layer of `size_bytes` when
    /// the store has no record yet.
    pub fn open(store: Arc<dyn LayerStore>, size_bytes: u64) -> Result<ChainDev, BdevError> {
        let (record, devs) = store.load(size_bytes)?;
        let mut layers = Vec::with_capacity(devs.len());
        for (rec, dev) in record.layers.iter().zip(devs) {
            let held = Arc::new(held_of(dev.as_ref(), size_bytes)?);
            layers.push(Arc::new(Layer {
                id: rec.id,
                dev,
                held,
                snapshot: rec
                    .snapshot
                    .clone()
                    .map(|(name, created_unix)| SnapshotMeta { name, created_unix }),
                foreign: rec.foreign.clone(),
            }));
        }
        if layers.is_empty() {
            return Err(BdevError::Failed(format!(
                "{}: the chain record names no layer",
                store.describe()
            )));
        }
        let next_id = record.layers.iter().map(|l| l.id).max().unwrap_or(0) + 1;
        let top = State::build_top(&layers, blocks_of(size_bytes));
        if layers.len() > 1 {
            tracing::info!(chain = %store.describe(), layers = layers.len(),
                snapshots = layers.iter().filter(|l| l.snapshot.is_some()).count(),
                "chain opened");
        }
        Ok(ChainDev {
            shared: Shared::new(
                size_bytes,
                State {
                    layers,
                    top,
                    read_only: false,
                },
            ),
            store,
            clones: Arc::new(Mutex::new(record.clones)),
            control: Arc::default(),
            next_id: AtomicU64::new(next_id),
            merge: Mutex::default(),
        })
    }

    fn record_of(&self, state: &State) -> ChainRecord {
        record_of(state, &self.clones)
    }

    /// Takes snapshot `name`: every write acknowledged before the call is
    /// in it, none issued after. The head becomes the snapshot (its map
    /// is made exact first) and an empty head starts on top.
    pub fn snapshot(&self, name: &str) -> Result<SnapshotInfo, BdevError> {
        check_snapshot_name(name)?;
        let _one = self.control.lock().unwrap_or_else(|p| p.into_inner());
        let before = self.shared.state();
        if before.index_of(name).is_some() {
            return Err(BdevError::BadName(format!(
                "snapshot {name:?} exists already"
            )));
        }
        if before.layers.len() >= MAX_CHAIN_LAYERS {
            return Err(BdevError::Failed(format!(
                "the chain has its maximum of {MAX_CHAIN_LAYERS} layers: delete a snapshot first"
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let size = self.shared.size();
        let new_head = self.store.create_layer(id, size)?;
        // The head becomes the snapshot: its data must be durable before
        // the record names it one, or a crash could leave a snapshot
        // without writes acknowledged before it. Most of it is synced
        // here, with I/O running; what was written since, under the
        // quiesce below.
        if let Err(e) = before.head().dev.sync() {
            self.store.discard_layer(id);
            return Err(e);
        }
        let quiet = match self.shared.quiesce() {
            Ok(q) => q,
            Err(e) => {
                self.store.discard_layer(id);
                return Err(e);
            }
        };
        let state = self.shared.state();
        let old_head = state.head();
        if let Err(e) = old_head.dev.sync() {
            self.store.discard_layer(id);
            return Err(e);
        }
        // A head of a one-layer chain has the map made at open from its
        // extents, kept current by every write since (`ChainChannel`).
        // Only a chain grown since it opened has blocks past that map:
        // then it is made again from the extents, now that nothing is in
        // flight.
        let held = if state.layers.len() == 1 && old_head.held.blocks() < blocks_of(size) {
            match held_of(old_head.dev.as_ref(), size) {
                Ok(h) => Arc::new(h),
                Err(e) => {
                    self.store.discard_layer(id);
                    return Err(e);
                }
            }
        } else {
            old_head.held.clone()
        };
        let frozen = Arc::new(Layer {
            id: old_head.id,
            dev: old_head.dev.clone(),
            held,
            snapshot: Some(SnapshotMeta {
                name: name.to_string(),
                created_unix: now_unix(),
            }),
            foreign: None,
        });
        let mut layers: Vec<Arc<Layer>> = state.layers[..state.layers.len() - 1].to_vec();
        layers.push(frozen);
        layers.push(Arc::new(Layer {
            id,
            dev: new_head,
            held: Arc::new(Bitmap::new(blocks_of(size))),
            snapshot: None,
            foreign: None,
        }));
        // The top map of the old state stays right (no block moved) when
        // there was one; a first snapshot builds it.
        let top = match &state.top {
            Some(t) => t.clone(),
            None => State::build_top(&layers, blocks_of(size)).expect("two layers"),
        };
        let next = State {
            layers,
            top: Some(top),
            read_only: false,
        };
        if let Err(e) = self.store.commit(&self.record_of(&next)) {
            self.store.discard_layer(id);
            return Err(e);
        }
        self.shared.set_state(next);
        drop(quiet);
        tracing::info!(chain = %self.store.describe(), snapshot = name, layers = state.layers.len() + 1,
            "snapshot taken");
        self.snapshots()
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| BdevError::Failed("the new snapshot vanished".into()))
    }

    /// The snapshots, oldest first.
    pub fn snapshots(&self) -> Vec<SnapshotInfo> {
        let state = self.shared.state();
        let clones = self
            .clones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let merge = self.merge.lock().unwrap_or_else(|p| p.into_inner());
        let mut parent: Option<String> = None;
        let mut out = Vec::new();
        for l in &state.layers {
            let Some(s) = &l.snapshot else { continue };
            out.push(SnapshotInfo {
                name: s.name.clone(),
                created_unix: s.created_unix,
                size_bytes: self.shared.size(),
                allocated_bytes: l.held.count() * CHAIN_BLOCK_BYTES,
                parent: parent.replace(s.name.clone()),
                clones: clones
                    .iter()
                    .filter(|c| c.snapshot == s.name)
                    .map(|c| c.volume.clone())
                    .collect(),
                inherited: l.foreign.is_some(),
                // A merge that failed or was stopped left the snapshot
                // in place: not merging any more (delete it again).
                merging: merge
                    .as_ref()
                    .filter(|m| {
                        (m.snapshot == s.name || (m.base && l.foreign.is_some()))
                            && m.thread.as_ref().is_some_and(|t| !t.is_finished())
                    })
                    .map(|m| (m.done_bytes.load(Ordering::Relaxed), m.total_bytes)),
            });
        }
        out
    }

    /// Reverts the volume to snapshot `name`: the head and every snapshot
    /// newer than `name` are dropped, an empty head starts over `name`.
    /// Returns the snapshots dropped. Refused while a newer snapshot has
    /// clones or a merge runs. The caller checks for connected clients.
    pub fn revert(&self, name: &str) -> Result<Vec<String>, BdevError> {
        let _one = self.control.lock().unwrap_or_else(|p| p.into_inner());
        self.no_merge_running()?;
        let state = self.shared.state();
        let i = state
            .index_of(name)
            .ok_or_else(|| BdevError::NoSuchSnapshot(name.into()))?;
        let dropped: Vec<String> = state.layers[i + 1..]
            .iter()
            .filter_map(|l| l.snapshot.as_ref().map(|s| s.name.clone()))
            .collect();
        let used: Vec<String> = self
            .clones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|c| dropped.contains(&c.snapshot))
            .map(|c| format!("{} (of {})", c.volume, c.snapshot))
            .collect();
        if !used.is_empty() {
            return Err(BdevError::InUse(format!(
                "reverting to {name:?} would drop snapshots that clones use: {}",
                used.join(", ")
            )));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let size = self.shared.size();
        let head = self.store.create_layer(id, size)?;
        let quiet = self.shared.quiesce()?;
        let state = self.shared.state();
        let mut layers: Vec<Arc<Layer>> = state.layers[..=i].to_vec();
        layers.push(Arc::new(Layer {
            id,
            dev: head,
            held: Arc::new(Bitmap::new(blocks_of(size))),
            snapshot: None,
            foreign: None,
        }));
        let top = State::build_top(&layers, blocks_of(size));
        let next = State {
            layers,
            top,
            read_only: false,
        };
        if let Err(e) = self.store.commit(&self.record_of(&next)) {
            self.store.discard_layer(id);
            return Err(e);
        }
        self.shared.set_state(next);
        drop(quiet);
        for l in &state.layers[i + 1..] {
            self.store.discard_layer(l.id);
        }
        tracing::info!(chain = %self.store.describe(), snapshot = name, dropped = ?dropped, "reverted");
        Ok(dropped)
    }

    fn no_merge_running(&self) -> Result<(), BdevError> {
        let mut m = self.merge.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(merge) = m.as_mut() {
            // A merge past its commit has only its files to remove: wait for
            // it rather than refuse (its snapshot is gone from the list
            // already, and a caller that saw that may go on at once).
            let running = merge.thread.as_ref().is_some_and(|t| !t.is_finished());
            if running && !merge.committed.load(Ordering::SeqCst) {
                return Err(BdevError::InUse(format!(
                    "snapshot {:?} is being merged; try again when it is gone",
                    merge.snapshot
                )));
            }
            if let Some(Err(e)) = merge.thread.take().map(|t| t.join()) {
                tracing::error!(snapshot = %merge.snapshot, "a merge thread panicked: {e:?}");
            }
            *m = None;
        }
        Ok(())
    }

    /// A new chain for a clone of snapshot `name`: its lower layers are
    /// this chain's, up to and including the snapshot (shared: the
    /// snapshot cannot be deleted while the clone uses it), and its head
    /// a new layer of `store`. `volume` names the clone in this chain's
    /// record.
    pub fn clone_snapshot(
        &self,
        name: &str,
        volume: &str,
        store: Arc<dyn LayerStore>,
    ) -> Result<ChainDev, BdevError> {
        let _one = self.control.lock().unwrap_or_else(|p| p.into_inner());
        // A merge drops a layer a new clone would stand on.
        self.no_merge_running()?;
        let state = self.shared.state();
        let i = state
            .index_of(name)
            .ok_or_else(|| BdevError::NoSuchSnapshot(name.into()))?;
        if i + 2 > MAX_CHAIN_LAYERS {
            return Err(BdevError::Failed(format!(
                "a clone of {name:?} would have more than {MAX_CHAIN_LAYERS} layers"
            )));
        }
        let size = self.shared.size();
        let mut layers = Vec::with_capacity(i + 2);
        for l in &state.layers[..=i] {
            layers.push(Arc::new(Layer {
                id: l.id,
                dev: l.dev.clone(),
                held: l.held.clone(),
                snapshot: l.snapshot.clone(),
                foreign: Some(
                    l.foreign
                        .clone()
                        .or_else(|| self.store.layer_location(l.id))
                        .unwrap_or_else(|| self.store.describe()),
                ),
            }));
        }
        let head_id = layers.iter().map(|l| l.id).max().unwrap_or(0) + 1;
        layers.push(Arc::new(Layer {
            id: head_id,
            dev: store.create_layer(head_id, size)?,
            held: Arc::new(Bitmap::new(blocks_of(size))),
            snapshot: None,
            foreign: None,
        }));
        let top = State::build_top(&layers, blocks_of(size));
        let clone = ChainDev {
            shared: Shared::new(
                size,
                State {
                    layers,
                    top,
                    read_only: false,
                },
            ),
            store: store.clone(),
            clones: Arc::default(),
            control: Arc::default(),
            next_id: AtomicU64::new(head_id + 1),
            merge: Mutex::default(),
        };
        store.commit(&clone.record_of(&clone.shared.state()))?;
        self.clones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(CloneRef {
                volume: volume.into(),
                snapshot: name.into(),
            });
        if let Err(e) = self.store.commit(&self.record_of(&state)) {
            self.forget_clone(volume);
            return Err(e);
        }
        tracing::info!(chain = %self.store.describe(), snapshot = name, clone = volume, "clone created");
        Ok(clone)
    }

    /// Forgets that `volume` uses one of this chain's snapshots (the clone
    /// was flattened or deleted). Returns whether it was recorded.
    pub fn forget_clone(&self, volume: &str) -> bool {
        let mut c = self.clones.lock().unwrap_or_else(|p| p.into_inner());
        let before = c.len();
        c.retain(|r| r.volume != volume);
        let changed = c.len() != before;
        drop(c);
        if changed {
            let state = self.shared.state();
            if let Err(e) = self.store.commit(&self.record_of(&state)) {
                tracing::error!(chain = %self.store.describe(), clone = volume, error = %e,
                    "could not record that a clone let go of its base");
            }
        }
        changed
    }

    /// Whether this chain stands on another chain's layers (a clone not
    /// flattened yet).
    pub fn has_base(&self) -> bool {
        self.shared
            .state()
            .layers
            .iter()
            .any(|l| l.foreign.is_some())
    }

    /// Deletes snapshot `name`: its blocks are merged into its child in
    /// the background (progress in [`ChainDev::snapshots`]), then the
    /// layer is dropped. Refused while clones use it (the error names
    /// them) or another merge runs.
    pub fn delete_snapshot(&self, name: &str) -> Result<(), BdevError> {
        self.start_merge(MergeWhat::Snapshot(name.to_string()), None)
    }

    /// Copies a clone's base into its head so it stands alone; the base's
    /// layers then leave the chain (the origin is told with
    /// [`ChainDev::forget_clone`] by the caller once this returns Ok: it
    /// waits for the copy). Returns whether there was a base.
    pub fn flatten(&self) -> Result<bool, BdevError> {
        if !self.has_base() {
            return Ok(false);
        }
        self.start_merge(MergeWhat::Base, None)?;
        self.wait_merge()?;
        Ok(true)
    }

    /// Starts copying a clone's base into it in the background (as a
    /// delete's merge: I/O goes on, [`ChainDev::snapshots`] shows every
    /// inherited snapshot merging) and returns; `done` runs on the merge's
    /// thread once the base has left the chain (not when the merge fails
    /// or is stopped: the base is then still in place). Returns whether
    /// there was a base.
    pub fn start_flatten(&self, done: Box<dyn FnOnce() + Send>) -> Result<bool, BdevError> {
        if !self.has_base() {
            return Ok(false);
        }
        self.start_merge(MergeWhat::Base, Some(done))?;
        Ok(true)
    }

    /// The volumes (or replicas) whose base is one of this chain's
    /// snapshots.
    pub fn clone_names(&self) -> Vec<String> {
        self.clones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|c| c.volume.clone())
            .collect()
    }

    /// Whether the clone named `volume` has snapshot `name` of this chain
    /// as its base.
    pub fn has_clone(&self, volume: &str, name: &str) -> bool {
        self.clones
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|c| c.volume == volume && c.snapshot == name)
    }

    /// The name of the top snapshot of this chain's base (the snapshot it
    /// was cloned from); `None` when it stands alone.
    pub fn base_snapshot(&self) -> Option<String> {
        self.shared
            .state()
            .layers
            .iter()
            .rev()
            .find(|l| l.foreign.is_some())
            .and_then(|l| l.snapshot.as_ref().map(|s| s.name.clone()))
    }

    /// Stops a merge in the background, if one runs, and waits for its
    /// thread (at most one step, [`MERGE_STEP_BYTES`] of copy, or its last
    /// record write). The chain is left as it was: the snapshot is still
    /// there, and what was copied is the same data. Whether one was
    /// stopped. For an owner that closes the chain (a replica stopping or
    /// deleted), so no merge writes to its files afterwards.
    pub fn stop_merge(&self) -> bool {
        let running = {
            let m = self.merge.lock().unwrap_or_else(|p| p.into_inner());
            match m.as_ref() {
                Some(merge) if merge.thread.as_ref().is_some_and(|t| !t.is_finished()) => {
                    merge.stop.store(true, Ordering::SeqCst);
                    true
                }
                _ => false,
            }
        };
        let _ = self.wait_merge();
        running
    }

    /// Waits for a merge in the background to finish; its result.
    pub fn wait_merge(&self) -> Result<(), BdevError> {
        let thread = self
            .merge
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .and_then(|m| m.thread.take());
        let result = match thread.map(|t| t.join()) {
            None => Ok(()),
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(BdevError::Failed("the merge thread panicked".into())),
        };
        *self.merge.lock().unwrap_or_else(|p| p.into_inner()) = None;
        result
    }

    fn start_merge(
        &self,
        what: MergeWhat,
        done: Option<Box<dyn FnOnce() + Send>>,
    ) -> Result<(), BdevError> {
        let _one = self.control.lock().unwrap_or_else(|p| p.into_inner());
        self.no_merge_running()?;
        let state = self.shared.state();
        let base = matches!(what, MergeWhat::Base);
        let (range, label) = match &what {
            MergeWhat::Snapshot(name) => {
                let i = state
                    .index_of(name)
                    .ok_or_else(|| BdevError::NoSuchSnapshot(name.clone()))?;
                if state.layers[i].foreign.is_some() {
                    return Err(BdevError::InUse(format!(
                        "snapshot {name:?} belongs to the volume this one was cloned from; flatten the clone instead"
                    )));
                }
                let used: Vec<String> = self
                    .clones
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .iter()
                    .filter(|c| state.index_of(&c.snapshot).is_some_and(|ci| ci >= i))
                    .map(|c| c.volume.clone())
                    .collect();
                if !used.is_empty() {
                    return Err(BdevError::InUse(format!(
                        "snapshot {name:?} is in the base of clones {}: flatten or delete them first",
                        used.join(", ")
                    )));
                }
                (i..i + 1, name.clone())
            }
            MergeWhat::Base => {
                let n = state.layers.iter().filter(|l| l.foreign.is_some()).count();
                (0..n, "the clone's base".to_string())
            }
        };
        let total: u64 = state.layers[range.clone()]
            .iter()
            .map(|l| l.held.count() * CHAIN_BLOCK_BYTES)
            .sum();
        let done_bytes = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let committed = Arc::new(AtomicBool::new(false));
        let job = MergeJob {
            stop: stop.clone(),
            committed: committed.clone(),
            shared: self.shared.clone(),
            store: self.store.clone(),
            clones: self.clones.clone(),
            control: self.control.clone(),
            first: state.layers[range.start].id,
            last: state.layers[range.end - 1].id,
            done: done_bytes.clone(),
            label: label.clone(),
            on_done: done,
        };
        tracing::info!(chain = %self.store.describe(), what = %label, bytes = total, "merge started");
        let thread = std::thread::Builder::new()
            .name("lull-merge".into())
            .spawn(move || job.run())
            .map_err(BdevError::Io)?;
        *self.merge.lock().unwrap_or_else(|p| p.into_inner()) = Some(Merge {
            snapshot: label,
            base,
            done_bytes,
            total_bytes: total,
            stop,
            committed,
            thread: Some(thread),
        });
        Ok(())
    }

    /// Bytes of the maps this chain holds (bitmaps and top map).
    pub fn map_bytes(&self) -> u64 {
        let s = self.shared.state();
        let bitmap = s.layers.len() as u64 * blocks_of(self.shared.size()).div_ceil(8);
        bitmap + s.top.as_ref().map_or(0, |t| t.bytes() as u64)
    }

    /// The volume's own file when its layers are files (a clone's head
    /// goes next to it by default).
    pub fn volume_path(&self) -> Option<std::path::PathBuf> {
        self.store.volume_path()
    }

    /// Layers in the chain now (snapshots, shared base layers and the head).
    pub fn layer_count(&self) -> usize {
        self.shared.state().layers.len()
    }

    /// A number that changes whenever the layers do (a snapshot, a
    /// revert, the end of a merge): one atomic load, so a caller can keep
    /// what it derived from the layers (see [`ChainDev::single_layer_id`])
    /// and look again only when this moved.
    pub fn layers_generation(&self) -> u64 {
        self.shared.generation.load(Ordering::Acquire)
    }

    /// The id of the chain's only layer (its store's name for it) while
    /// the chain has one layer: every request then passes straight to
    /// it, so its file holds the volume's bytes as they are. `None` with
    /// snapshots or a base.
    pub fn single_layer_id(&self) -> Option<u64> {
        match &self.shared.state().layers[..] {
            [only] => Some(only.id),
            _ => None,
        }
    }
}

/// The durable record of `state` with the clone references current now.
fn record_of(state: &State, clones: &Mutex<Vec<CloneRef>>) -> ChainRecord {
    ChainRecord {
        layers: state
            .layers
            .iter()
            .map(|l| LayerRecord {
                id: l.id,
                snapshot: l
                    .snapshot
                    .as_ref()
                    .map(|s| (s.name.clone(), s.created_unix)),
                foreign: l.foreign.clone(),
            })
            .collect(),
        clones: clones.lock().unwrap_or_else(|p| p.into_inner()).clone(),
    }
}

enum MergeWhat {
    Snapshot(String),
    Base,
}

/// A merge of layers `first..=last` (by id, contiguous) into the layer
/// above `last`, run on its own thread.
struct MergeJob {
    shared: Arc<Shared>,
    store: Arc<dyn LayerStore>,
    /// The chain's clone references, read when the record is written.
    clones: Arc<Mutex<Vec<CloneRef>>>,
    /// The chain's control lock, taken for the last step (no other
    /// operation's record may cross this one's).
    control: Arc<Mutex<()>>,
    first: u64,
    last: u64,
    done: Arc<AtomicU64>,
    label: String,
    /// Stop before the next step ([`ChainDev::stop_merge`]).
    stop: Arc<AtomicBool>,
    /// Set once the new state is in place ([`Merge::committed`]).
    committed: Arc<AtomicBool>,
    /// Runs once the merge is done ([`ChainDev::start_flatten`]).
    on_done: Option<Box<dyn FnOnce() + Send>>,
}

/// The error of a merge that [`ChainDev::stop_merge`] stopped.
const MERGE_STOPPED: &str = "merge stopped: the chain is being closed";

impl MergeJob {
    fn run(mut self) -> Result<(), BdevError> {
        let result = self.copy();
        match &result {
            Ok(()) => {
                tracing::info!(chain = %self.store.describe(), what = %self.label, "merge done");
                if let Some(done) = self.on_done.take() {
                    done();
                }
            }
            Err(_) if self.stop.load(Ordering::SeqCst) => {
                tracing::info!(chain = %self.store.describe(), what = %self.label,
                    "merge stopped before its end; the chain is unchanged (delete the snapshot again to merge it)")
            }
            Err(e) => {
                tracing::error!(chain = %self.store.describe(), what = %self.label, error = %e,
                "merge failed; the chain is unchanged (what was copied is the same data)")
            }
        }
        result
    }

    fn indices(state: &State, first: u64, last: u64) -> Option<(usize, usize)> {
        let a = state.layers.iter().position(|l| l.id == first)?;
        let b = state.layers.iter().position(|l| l.id == last)?;
        (a <= b && b + 1 < state.layers.len()).then_some((a, b))
    }

    fn copy(&self) -> Result<(), BdevError> {
        let size = self.shared.size();
        let blocks = blocks_of(size);
        let step = MERGE_STEP_BYTES / CHAIN_BLOCK_BYTES;
        let mut io = channel::SyncIo::default();
        let mut b0 = 0;
        let stopped = || {
            if self.stop.load(Ordering::SeqCst) {
                Err(BdevError::Failed(MERGE_STOPPED.into()))
            } else {
                Ok(())
            }
        };
        while b0 < blocks {
            stopped()?;
            let b1 = (b0 + step).min(blocks);
            let state = self.shared.state();
            let (a, b) = Self::indices(&state, self.first, self.last)
                .ok_or_else(|| BdevError::Failed("the chain changed under the merge".into()))?;
            let target = b + 1;
            let head = target + 1 == state.layers.len();
            // The runs of blocks the target lacks and the merged layers
            // hold, with the topmost merged holder as the source.
            let runs = merge_runs(&state, a, b, target, b0, b1);
            if !runs.is_empty() {
                // Into the head, clients write too: hold them for the step.
                let quiet = if head {
                    Some(self.shared.quiesce()?)
                } else {
                    None
                };
                // The state cannot change under a quiesce held by the
                // chain's control lock; without one (a frozen target)
                // only this merge changes the target.
                for (src, first, end) in runs {
                    let off = first * CHAIN_BLOCK_BYTES;
                    let len = (end * CHAIN_BLOCK_BYTES).min(size) - off;
                    let data = io.read(state.layers[src].dev.as_ref(), off, len)?;
                    io.write(state.layers[target].dev.as_ref(), off, data)?;
                    state.layers[target].held.set_range(first, end);
                    if let Some(top) = &state.top {
                        for blk in first..end {
                            top.replace(blk, src as u8 + 1, target as u8 + 1);
                        }
                    }
                    self.done.fetch_add(len, Ordering::Relaxed);
                }
                drop(quiet);
            }
            b0 = b1;
        }
        // Durable before the record stops naming the merged layers.
        let state = self.shared.state();
        let (a, b) = Self::indices(&state, self.first, self.last)
            .ok_or_else(|| BdevError::Failed("the chain changed under the merge".into()))?;
        io.flush(state.layers[b + 1].dev.as_ref())?;
        let _one = self.control.lock().unwrap_or_else(|p| p.into_inner());
        stopped()?;
        let quiet = self.shared.quiesce()?;
        let state = self.shared.state();
        let (a2, b2) = Self::indices(&state, self.first, self.last)
            .ok_or_else(|| BdevError::Failed("the chain changed under the merge".into()))?;
        debug_assert_eq!((a, b), (a2, b2));
        let mut layers = state.layers.clone();
        let gone: Vec<Arc<Layer>> = layers.drain(a2..=b2).collect();
        let next = State {
            top: State::build_top(&layers, blocks_of(size)),
            layers,
            read_only: false,
        };
        let record = record_of(&next, &self.clones);
        self.store.commit(&record)?;
        self.shared.set_state(next);
        self.committed.store(true, Ordering::SeqCst);
        drop(quiet);
        for l in gone.iter().filter(|l| l.foreign.is_none()) {
            self.store.discard_layer(l.id);
        }
        Ok(())
    }
}

/// Runs `(source index, first block, end block)` in `[b0, b1)`: blocks
/// layer `target` lacks and some layer of `a..=b` holds, the source being
/// the topmost such layer; a run is cut where the source changes.
fn merge_runs(
    state: &State,
    a: usize,
    b: usize,
    target: usize,
    b0: u64,
    b1: u64,
) -> Vec<(usize, u64, u64)> {
    let mut runs: Vec<(usize, u64, u64)> = Vec::new();
    for blk in b0..b1 {
        if state.layers[target].held.get(blk) {
            continue;
        }
        let Some(src) = (a..=b).rev().find(|&i| state.layers[i].held.get(blk)) else {
            continue;
        };
        match runs.last_mut() {
            Some((s, _, end)) if *s == src && *end == blk => *end = blk + 1,
            _ => runs.push((src, blk, blk + 1)),
        }
    }
    runs
}

/// The device over the current state (the live volume).
impl BlockDevice for ChainDev {
    fn size_bytes(&self) -> u64 {
        self.shared.size()
    }

    fn describe(&self) -> String {
        let s = self.shared.state();
        if s.layers.len() == 1 {
            s.head().dev.describe()
        } else {
            format!("{} ({} layers)", s.head().dev.describe(), s.layers.len())
        }
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        Ok(Box::new(channel::ChainChannel::new(self.shared.clone())?))
    }

    fn sync(&self) -> Result<(), BdevError> {
        self.shared.state().head().dev.sync()
    }

    /// A chain of one layer grows as its layer does. With snapshots every
    /// layer grows (its file is extended sparsely: it reads as zeros past
    /// the old end, as the chain must), so each layer stays the volume's
    /// size as [`ChainDev::open`] expects; then, quiesced, every layer's
    /// map and the top map are made again at the new size (a snapshot
    /// holds no block of the new range: it reads as zeros from every
    /// snapshot, and a view or a revert of an older snapshot has the new
    /// size). Refused for a clone that still stands on another chain's
    /// layers (they are that chain's files, at its size: flatten first)
    /// and while a merge runs (it sets bits in the maps being replaced).
    /// A layer that fails to grow leaves the chain at its old size (the
    /// layers grown before it are only longer, sparse files).
    fn grow(&self, size_bytes: u64) -> Result<(), BdevError> {
        let _one = self.control.lock().unwrap_or_else(|p| p.into_inner());
        let s = self.shared.state();
        if s.layers.len() == 1 {
            s.head().dev.grow(size_bytes)?;
            self.shared
                .size_bytes
                .store(s.head().dev.size_bytes(), Ordering::Release);
            return Ok(());
        }
        if s.layers.iter().any(|l| l.foreign.is_some()) {
            return Err(BdevError::Unsupported(
                "a clone keeps its size while it stands on its origin's snapshot: flatten it first",
            ));
        }
        let old = self.shared.size();
        crate::check_grow(old, size_bytes, u64::MAX)?;
        if size_bytes == old {
            return Ok(());
        }
        self.no_merge_running()?;
        // The devices grow with I/O running: nothing is asked past the old
        // end until the chain's size changes below.
        for l in &s.layers {
            l.dev.grow(size_bytes)?;
        }
        let quiet = self.shared.quiesce()?;
        let state = self.shared.state();
        let blocks = blocks_of(size_bytes);
        let layers: Vec<Arc<Layer>> = state
            .layers
            .iter()
            .map(|l| {
                Arc::new(Layer {
                    id: l.id,
                    dev: l.dev.clone(),
                    held: Arc::new(l.held.grown(blocks)),
                    snapshot: l.snapshot.clone(),
                    foreign: None,
                })
            })
            .collect();
        let top = State::build_top(&layers, blocks);
        self.shared.set_state(State {
            layers,
            top,
            read_only: false,
        });
        self.shared.size_bytes.store(size_bytes, Ordering::Release);
        drop(quiet);
        tracing::info!(chain = %self.store.describe(), from = old, to = size_bytes,
            layers = state.layers.len(), "chain grown");
        Ok(())
    }

    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>, BdevError> {
        self.shared.extents(offset, len, max_extents)
    }

    fn zeroes_fast(&self) -> bool {
        let s = self.shared.state();
        s.layers.len() == 1 && s.head().dev.zeroes_fast()
    }

    /// Summed over the chain's own layers (a snapshot's reads go to its
    /// layer; a clone's shared base is counted by its origin). Layers
    /// dropped take their counts with them.
    fn io_uring_enters(&self) -> Option<u64> {
        let s = self.shared.state();
        own_layers(&s)
            .filter_map(|l| l.dev.io_uring_enters())
            .reduce(|a, b| a + b)
    }

    fn buffer_ios(&self) -> Option<crate::BufferIos> {
        let s = self.shared.state();
        own_layers(&s)
            .filter_map(|l| l.dev.buffer_ios())
            .reduce(|a, b| crate::BufferIos {
                fixed: a.fixed + b.fixed,
                plain: a.plain + b.plain,
                inline: a.inline + b.inline,
            })
    }

    fn prefetch(&self, offset: u64, len: u64) -> Result<(), BdevError> {
        let s = self.shared.state();
        if s.layers.len() == 1 {
            return s.head().dev.prefetch(offset, len);
        }
        Ok(())
    }

    fn has_snapshot(&self, name: &str) -> bool {
        self.shared.state().index_of(name).is_some()
    }

    fn snapshot_names(&self) -> Vec<String> {
        self.shared.snapshot_names()
    }

    fn changed_since(
        &self,
        since: &str,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Result<Vec<ChangeRun>, BdevError> {
        self.shared.changed_since(since, offset, len, max_runs)
    }

    fn snapshot_view(&self, name: &str) -> Option<Arc<dyn BlockDevice>> {
        let state = self.shared.state();
        let i = state.index_of(name)?;
        let layers: Vec<Arc<Layer>> = state.layers[..=i].to_vec();
        let size = self.shared.size();
        let top = State::build_top(&layers, blocks_of(size));
        Some(Arc::new(SnapshotView {
            name: name.to_string(),
            describe: self.describe(),
            shared: Shared::new(
                size,
                State {
                    layers,
                    top,
                    read_only: true,
                },
            ),
        }))
    }
}

/// The layers a chain owns (not a clone's shared base).
fn own_layers(state: &State) -> impl Iterator<Item = &Arc<Layer>> {
    state.layers.iter().filter(|l| l.foreign.is_none())
}

fn check_range(offset: u64, len: u64, size: u64) -> Result<u64, BdevError> {
    offset
        .checked_add(len)
        .filter(|&end| end <= size && len > 0)
        .ok_or(BdevError::OutOfRange { offset, len, size })
}

/// Allocation from the maps: a block is data when some layer holds it.
fn extents_of(
    state: &State,
    size: u64,
    offset: u64,
    len: u64,
    max: usize,
) -> Result<Vec<Extent>, BdevError> {
    let end = check_range(offset, len, size)?;
    let Some(top) = &state.top else {
        return state.head().dev.extents(offset, len, max);
    };
    let mut out = Vec::new();
    let mut pos = offset;
    while pos < end {
        let blk = pos / CHAIN_BLOCK_BYTES;
        let stop = ((blk + 1) * CHAIN_BLOCK_BYTES).min(end);
        let e = if top.get(blk) == 0 {
            Extent::hole(stop - pos)
        } else {
            Extent::data(stop - pos)
        };
        if !crate::push_extent(&mut out, e, max.max(1)) {
            break;
        }
        pos = stop;
    }
    Ok(out)
}

/// What changed between snapshot `since` and the top of `state` (the
/// view's snapshot, or the head): blocks some layer above `since` holds.
fn changed_of(
    state: &State,
    size: u64,
    since: &str,
    offset: u64,
    len: u64,
    max: usize,
) -> Result<Vec<ChangeRun>, BdevError> {
    let end = check_range(offset, len, size)?;
    let i = state
        .index_of(since)
        .ok_or_else(|| BdevError::NoSuchSnapshot(since.into()))?;
    let above = &state.layers[i + 1..];
    let mut out = Vec::new();
    let mut pos = offset;
    while pos < end {
        let blk = pos / CHAIN_BLOCK_BYTES;
        let stop = ((blk + 1) * CHAIN_BLOCK_BYTES).min(end);
        let changed = above.iter().any(|l| l.held.get(blk));
        if !push_change(
            &mut out,
            ChangeRun {
                length_bytes: stop - pos,
                changed,
            },
            max.max(1),
        ) {
            break;
        }
        pos = stop;
    }
    Ok(out)
}

/// A snapshot, read-only, as it was taken. It holds its layers: a
/// snapshot deleted while a view is open stays readable through the
/// view (its blocks were merged into the child, which the view does not
/// read past the snapshot; the layer's storage is freed when the last
/// view drops).
struct SnapshotView {
    name: String,
    describe: String,
    shared: Arc<Shared>,
}

impl BlockDevice for SnapshotView {
    fn size_bytes(&self) -> u64 {
        self.shared.size()
    }

    fn describe(&self) -> String {
        format!("snapshot {} of {}", self.name, self.describe)
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        Ok(Box::new(channel::ChainChannel::new(self.shared.clone())?))
    }

    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>, BdevError> {
        self.shared.extents(offset, len, max_extents)
    }

    fn read_only(&self) -> bool {
        true
    }

    fn has_snapshot(&self, name: &str) -> bool {
        self.shared.state().index_of(name).is_some()
    }

    fn snapshot_names(&self) -> Vec<String> {
        self.shared.snapshot_names()
    }

    fn changed_since(
        &self,
        since: &str,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Result<Vec<ChangeRun>, BdevError> {
        self.shared.changed_since(since, offset, len, max_runs)
    }
}

#[cfg(test)]
mod tests;
