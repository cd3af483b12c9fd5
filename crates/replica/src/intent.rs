//! The write-intent record (md's write-intent bitmap): one bit per region
//! of [`intent_region_bytes`] saying "an engine may have written here
//! without every replica having it", kept in `DIR/intent.bin`, and the
//! group-commit thread that makes INTENT_MARKs durable.
//!
//! ```ignore
//! let (file, loaded) = IntentFile::open(dir, size_bytes, missing_is_empty)?; // blocking
//! let persister = Persister::start(file, loaded, changes)?; // "lull-replica-intent"
//! let seq = persister.mark(3, 2)?;                     // regions 3 and 4, in memory
//! persister.wait_durable(seq)?;                        // a reactor polls instead
//! persister.stop();
//! ```
//!
//! # File layout
//!
//! Two fixed slots of [`INTENT_SLOT_BYTES`], A at offset 0 and B right
//! after it. Each slot, big-endian:
//!
//! ```text
//! magic u32 "LULI" | version u32 | seq u64 | region_bytes u64 | regions u32 | crc32 u32 | bitmap | zeros
//! ```
//!
//! The crc (crc32fast) covers the first 28 bytes of the slot followed by
//! the bitmap ([`intent_bitmap_bytes`] bytes; bit `i` of byte `i / 8`,
//! least significant first, is region `i`). A store writes the whole slot
//! that does *not* hold the newest seq, with the next seq, then
//! fdatasyncs: a torn write leaves the other slot, one store older, valid.
//! A load takes the valid slot with the highest seq.
//!
//! # Lost records
//!
//! A record that cannot be trusted is **lost**: in memory every region is
//! set (the engine then compares and repairs the whole volume) and the
//! replica reports [`lull_proto::replica::HELLO_FLAG_INTENT_LOST`] and
//! never clean. That is: a file shorter than two slots, unreadable, or
//! with no valid slot, or no file at all on a replica whose metadata says
//! dirty (a replica an engine left dirty before records existed). A
//! missing file on a new or clean replica is an empty record. Only a clean
//! DETACH (an empty record made durable) ends the lost state; any store
//! before that writes the all-ones bitmap (minus clears), which says the
//! same thing.
//!
//! # Group commit
//!
//! Marks and clears change the bitmap in memory and bump `changed_seq`.
//! The persister thread stores a snapshot whenever `changed_seq` is past
//! `durable_seq`, then raises `durable_seq` to the snapshot's and wakes
//! every waiting connection, so all marks that arrive while a store runs
//! share the next fdatasync. A mark is answered once `durable_seq` reaches
//! the `changed_seq` it saw; clears are never waited for (a lost clear
//! costs a needless resync, never a missed one).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;

use lull_proto::replica::{
    intent_bitmap_bytes, intent_region_bytes, intent_regions, ChangeKey, MAX_INTENT_BITMAP_BYTES,
};
use lull_reactor::{PollerId, ThreadHandle};

use crate::changes::{self, set_range, Changes, StartError};

/// File name of the record inside the replica directory.
pub const INTENT_FILE: &str = "intent.bin";

/// Layout version of a slot; a slot with another version is invalid (so a
/// record from a future lull is lost, never misread).
pub const INTENT_FORMAT_VERSION: u32 = 1;

/// Bytes per slot: one page, so a store is one aligned page write.
pub const INTENT_SLOT_BYTES: usize = 4096;

/// Slots in the file (A and B, written alternately).
const SLOTS: usize = 2;

/// "LULI": opens every valid slot.
const INTENT_MAGIC: u32 = u32::from_be_bytes(*b"LULI");

/// Bytes of the slot covered by the crc before the bitmap: magic, version,
/// seq, region_bytes, regions.
const CRC_COVERED_BYTES: usize = 4 + 4 + 8 + 8 + 4;

/// Slot header: the covered bytes plus the crc itself; the bitmap follows.
const SLOT_HEADER_BYTES: usize = CRC_COVERED_BYTES + 4;

const _: () = assert!(SLOT_HEADER_BYTES + MAX_INTENT_BITMAP_BYTES <= INTENT_SLOT_BYTES);

/// Errors of the record and its persister. Clone: one failed store is
/// reported to every mark that waited for it.
#[derive(Debug, Clone, thiserror::Error)]
pub enum IntentError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: Arc<io::Error>,
    },
    #[error("cannot start the write-intent thread: {0}")]
    Spawn(Arc<io::Error>),
    #[error("the write-intent persister has stopped")]
    Stopped,
    #[error("{path}: cannot store the change records: {source}")]
    Changes {
        path: PathBuf,
        source: Arc<io::Error>,
    },
}

impl IntentError {
    /// The errno a peer is told.
    pub fn errno(&self) -> i32 {
        match self {
            IntentError::Io { source, .. }
            | IntentError::Spawn(source)
            | IntentError::Changes { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            IntentError::Stopped => libc::ESHUTDOWN,
        }
    }

    fn io(path: &Path) -> impl FnOnce(io::Error) -> IntentError + '_ {
        move |source| IntentError::Io {
            path: path.to_path_buf(),
            source: Arc::new(source),
        }
    }
}

/// Why a record was found lost (for the warning at startup).
#[derive(Debug, thiserror::Error)]
pub enum Lost {
    #[error("missing while the replica is dirty (an engine attached before write-intent records existed, or the file was removed)")]
    MissingWhileDirty,
    #[error("{len} bytes, shorter than its two {INTENT_SLOT_BYTES}-byte slots")]
    Short { len: u64 },
    #[error("unreadable: {0}")]
    Unreadable(io::Error),
    #[error("no valid slot (bad magic, version, crc or region geometry in both)")]
    NoValidSlot,
}

/// What [`IntentFile::open`] found.
#[derive(Debug)]
pub struct Loaded {
    /// [`intent_bitmap_bytes`] bytes; all regions set when lost.
    pub bitmap: Vec<u8>,
    /// `Some` when the record is lost, with the reason.
    pub lost: Option<Lost>,
}

/// The record file, open for stores. Blocking: used at startup and by the
/// persister thread, never on a reactor.
#[derive(Debug)]
pub struct IntentFile {
    file: File,
    path: PathBuf,
    region_bytes: u64,
    regions: u32,
    /// Seq of the newest valid slot (0 when none), and which slot holds it.
    seq: u64,
    newest: Option<usize>,
    /// The bitmap the file holds (loaded or last stored; all set when the
    /// record was lost).
    held: Vec<u8>,
}

impl IntentFile {
    /// Opens (or creates) `dir/intent.bin` for a volume of `size_bytes`.
    /// `missing_is_empty`: a missing file is an empty record (a new or
    /// clean replica), created durably; otherwise a missing file is lost.
    /// Errors only when the file cannot be opened or created at all; a bad
    /// file is a lost record, not an error.
    pub fn open(
        dir: &Path,
        size_bytes: u64,
        missing_is_empty: bool,
    ) -> Result<(IntentFile, Loaded), IntentError> {
        let path = dir.join(INTENT_FILE);
        let region_bytes = intent_region_bytes(size_bytes);
        let regions = intent_regions(size_bytes);
        let bitmap_bytes = intent_bitmap_bytes(size_bytes);
        let opened = OpenOptions::new().read(true).write(true).open(&path);
        let (file, created) = match opened {
            Ok(f) => (f, false),
            Err(e) if e.kind() == io::ErrorKind::NotFound => (create(dir, &path)?, true),
            Err(e) => return Err(IntentError::io(&path)(e)),
        };
        let mut me = IntentFile {
            file,
            path,
            region_bytes,
            regions,
            seq: 0,
            newest: None,
            held: all_set(regions),
        };
        if created {
            if missing_is_empty {
                let empty = vec![0u8; bitmap_bytes];
                me.store(&empty)?;
                return Ok((
                    me,
                    Loaded {
                        bitmap: empty,
                        lost: None,
                    },
                ));
            }
            let lost = Some(Lost::MissingWhileDirty);
            return Ok((
                me,
                Loaded {
                    bitmap: all_set(regions),
                    lost,
                },
            ));
        }
        let lost = match me.read_slots() {
            Ok(Some((slot, seq, bitmap))) => {
                me.seq = seq;
                me.newest = Some(slot);
                me.held = bitmap.clone();
                return Ok((me, Loaded { bitmap, lost: None }));
            }
            Ok(None) => Lost::NoValidSlot,
            Err(lost) => lost,
        };
        Ok((
            me,
            Loaded {
                bitmap: all_set(regions),
                lost: Some(lost),
            },
        ))
    }

    /// The newest valid slot as (slot, seq, bitmap); `Ok(None)` when no
    /// slot is valid.
    fn read_slots(&self) -> Result<Option<(usize, u64, Vec<u8>)>, Lost> {
        let len = self.file.metadata().map_err(Lost::Unreadable)?.len();
        if len < (SLOTS * INTENT_SLOT_BYTES) as u64 {
            return Err(Lost::Short { len });
        }
        let mut raw = vec![0u8; SLOTS * INTENT_SLOT_BYTES];
        self.file
            .read_exact_at(&mut raw, 0)
            .map_err(Lost::Unreadable)?;
        let best = raw
            .chunks_exact(INTENT_SLOT_BYTES)
            .enumerate()
            .filter_map(|(i, s)| {
                decode_slot(s, self.region_bytes, self.regions).map(|(seq, bm)| (i, seq, bm))
            })
            .max_by_key(|&(_, seq, _)| seq);
        Ok(best)
    }

    /// Writes `bitmap` durably into the slot not holding the newest seq,
    /// with the next seq. Blocking (one page write and an fdatasync).
    pub fn store(&mut self, bitmap: &[u8]) -> Result<(), IntentError> {
        debug_assert_eq!(bitmap.len(), (self.regions as usize).div_ceil(8));
        let seq = self.seq + 1;
        let slot = match self.newest {
            Some(s) => 1 - s,
            None => 0,
        };
        let raw = encode_slot(seq, self.region_bytes, self.regions, bitmap);
        let io = IntentError::io(&self.path);
        let offset = (slot * INTENT_SLOT_BYTES) as u64;
        // The file is two slots long from creation on, so the data sync
        // needs no size update.
        self.file
            .write_all_at(&raw, offset)
            .and_then(|()| self.file.sync_data())
            .map_err(io)?;
        self.seq = seq;
        self.newest = Some(slot);
        self.held = bitmap.to_vec();
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Seq of the newest slot written or loaded (0 when none).
    pub fn seq(&self) -> u64 {
        self.seq
    }
}

/// Creates the record file two slots long (zeros: no valid slot yet),
/// durably, directory entry included.
fn create(dir: &Path, path: &Path) -> Result<File, IntentError> {
    let io = IntentError::io(path);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(IntentError::io(path))?;
    file.set_len((SLOTS * INTENT_SLOT_BYTES) as u64)
        .and_then(|()| file.sync_all())
        .map_err(io)?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(IntentError::io(dir))?;
    Ok(file)
}

/// A bitmap of `regions` bits, all set (bits past `regions` stay zero).
pub fn all_set(regions: u32) -> Vec<u8> {
    let mut b = vec![0u8; (regions as usize).div_ceil(8)];
    set_range(&mut b, 0, regions, true);
    b
}

fn crc(covered: &[u8], bitmap: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(covered);
    h.update(bitmap);
    h.finalize()
}

fn encode_slot(seq: u64, region_bytes: u64, regions: u32, bitmap: &[u8]) -> Vec<u8> {
    let mut s = vec![0u8; INTENT_SLOT_BYTES];
    s[0..4].copy_from_slice(&INTENT_MAGIC.to_be_bytes());
    s[4..8].copy_from_slice(&INTENT_FORMAT_VERSION.to_be_bytes());
    s[8..16].copy_from_slice(&seq.to_be_bytes());
    s[16..24].copy_from_slice(&region_bytes.to_be_bytes());
    s[24..28].copy_from_slice(&regions.to_be_bytes());
    let sum = crc(&s[..CRC_COVERED_BYTES], bitmap);
    s[28..32].copy_from_slice(&sum.to_be_bytes());
    s[SLOT_HEADER_BYTES..SLOT_HEADER_BYTES + bitmap.len()].copy_from_slice(bitmap);
    s
}

/// (seq, bitmap) of a valid slot for this geometry; `None` otherwise.
fn decode_slot(s: &[u8], region_bytes: u64, regions: u32) -> Option<(u64, Vec<u8>)> {
    let word = |at: usize, n: usize| {
        s[at..at + n]
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b))
    };
    let bitmap_bytes = (regions as usize).div_ceil(8);
    if s.len() != INTENT_SLOT_BYTES
        || word(0, 4) != u64::from(INTENT_MAGIC)
        || word(4, 4) != u64::from(INTENT_FORMAT_VERSION)
        || word(16, 8) != region_bytes
        || word(24, 4) != u64::from(regions)
    {
        return None;
    }
    let bitmap = &s[SLOT_HEADER_BYTES..SLOT_HEADER_BYTES + bitmap_bytes];
    if word(28, 4) != u64::from(crc(&s[..CRC_COVERED_BYTES], bitmap)) {
        return None;
    }
    let mut bitmap = bitmap.to_vec();
    // Bits past the last region are zero by construction; keep them so in
    // memory whatever a (crc-valid) slot says.
    if !regions.is_multiple_of(8) {
        if let Some(last) = bitmap.last_mut() {
            *last &= (1u8 << (regions % 8)) - 1;
        }
    }
    Some((word(8, 8), bitmap))
}

/// A reactor poller to wake when a store finishes.
pub(crate) type Waiter = (ThreadHandle, PollerId);

fn wake(waiters: Vec<Waiter>) {
    for (thread, poller) in waiters {
        if let Err(e) = thread.send(move |t| {
            t.wake_poller(poller);
        }) {
            // An exited thread has nothing to wake; a full mailbox means
            // that thread is busy and runs its pollers anyway.
            tracing::debug!(thread = thread.name(), error = %e, "cannot wake a connection");
        }
    }
}

struct State {
    bitmap: Vec<u8>,
    regions: u32,
    /// The change records (`crate::changes`), stored before each store of
    /// `bitmap` when they changed.
    changes: Changes,
    /// Bumped on every change of `bitmap`.
    changed_seq: u64,
    /// The `changed_seq` of the last snapshot made durable.
    durable_seq: u64,
    /// Set by the first failed store; every later mark and wait fails.
    failed: Option<IntentError>,
    stop: bool,
    /// The thread has exited: nothing more becomes durable.
    exited: bool,
    waiters: Vec<Waiter>,
}

impl State {
    /// Seqs ordered, bitmap sized to the regions (debug builds, after
    /// every store, and tests).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    fn check_invariants(&self) {
        assert!(self.durable_seq <= self.changed_seq, "durable past changed");
        assert_eq!(self.bitmap.len(), (self.regions as usize).div_ceil(8));
        if !self.regions.is_multiple_of(8) {
            let spare = !((1u8 << (self.regions % 8)) - 1);
            assert_eq!(
                self.bitmap.last().copied().unwrap_or(0) & spare,
                0,
                "bits past the last region"
            );
        }
    }

    fn broken(&self) -> Option<IntentError> {
        match &self.failed {
            Some(e) => Some(e.clone()),
            None if self.exited => Some(IntentError::Stopped),
            None => None,
        }
    }
}

/// Makes the replica's data durable (blocking): whatever layer of its
/// chain takes writes now, and every layer frozen before it already is
/// (a snapshot syncs the head it freezes before its record names it).
pub(crate) type DataSync = Box<dyn Fn() -> io::Result<()> + Send + Sync>;

/// The in-memory record and its group-commit thread (see the module doc).
pub(crate) struct Persister {
    state: Mutex<State>,
    /// Signals the thread (changes, stop) and blocking waiters (stores).
    cv: Condvar,
    /// Mirror of the lost state, readable without the lock.
    lost: AtomicBool,
    /// Some change record is kept: modifying requests are noted.
    tracking: AtomicBool,
    path: PathBuf,
    /// The replica directory (where the change records are stored).
    dir: PathBuf,
    /// Makes the replica's data durable, before a store clears a bit
    /// (see `run`).
    data: Option<DataSync>,
    /// The record file until the thread starts and takes it: the thread
    /// starts at the first change, so a replica no engine writes to (most
    /// of a node's store, most of the time) costs no thread.
    file: Mutex<Option<IntentFile>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// This persister, for the thread it starts.
    me: Weak<Persister>,
}

impl Persister {
    /// The record of `file`; the thread "lull-replica-intent", which owns
    /// the file from then on, starts at the first change.
    pub(crate) fn start(
        file: IntentFile,
        loaded: Loaded,
        changes: Changes,
        data: Option<DataSync>,
    ) -> Result<Arc<Persister>, IntentError> {
        let dir = file
            .path
            .parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
        Ok(Arc::new_cyclic(|me| Persister {
            tracking: AtomicBool::new(!changes.is_empty()),
            data,
            dir,
            state: Mutex::new(State {
                bitmap: loaded.bitmap,
                regions: file.regions,
                changes,
                changed_seq: 0,
                durable_seq: 0,
                failed: None,
                stop: false,
                exited: false,
                waiters: Vec::new(),
            }),
            cv: Condvar::new(),
            lost: AtomicBool::new(loaded.lost.is_some()),
            path: file.path.clone(),
            file: Mutex::new(Some(file)),
            thread: Mutex::new(None),
            me: me.clone(),
        }))
    }

    /// Starts the thread if it has not started (called after a change is
    /// made, with the state unlocked). A thread that cannot start fails
    /// the record as a failed store does: marks fail from then on.
    fn ensure_running(&self) -> Result<(), IntentError> {
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        let Some(f) = file.take() else {
            return Ok(());
        };
        let Some(me) = self.me.upgrade() else {
            // Only reachable while the last Arc is being dropped.
            return Err(IntentError::Stopped);
        };
        match std::thread::Builder::new()
            .name("lull-replica-intent".into())
            .spawn(move || me.run(f))
        {
            Ok(handle) => {
                *self.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
                Ok(())
            }
            Err(e) => {
                let e = IntentError::Spawn(Arc::new(e));
                tracing::error!(path = %self.path.display(), error = %e,
                    "cannot start the write-intent thread: INTENT_MARK fails from now on");
                let waiters = {
                    let mut s = self.lock();
                    s.failed = Some(e.clone());
                    std::mem::take(&mut s.waiters)
                };
                self.cv.notify_all();
                wake(waiters);
                Err(e)
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not take the record down with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&self, mut file: IntentFile) {
        loop {
            let snapshot = {
                let mut s = self.lock();
                while s.failed.is_none() && s.changed_seq == s.durable_seq && !s.stop {
                    s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
                }
                // Pending changes are stored even when stopping.
                if s.failed.is_some() || s.changed_seq == s.durable_seq {
                    break;
                }
                (
                    s.bitmap.clone(),
                    s.changes.take_changed(),
                    s.changed_seq,
                    s.regions,
                )
            };
            let (snapshot, changed, seq, regions) = snapshot;
            // The volume grew (GROW): the file's slots take the new
            // region count from this store on, and this store happens.
            let relayout = regions != file.regions;
            if relayout {
                file.regions = regions;
                file.held.resize((regions as usize).div_ceil(8), 0);
            }
            // Two steps. First the marks (the bits set, none cleared) and
            // the change records, which marks and starts wait for. Then,
            // if bits were cleared, the data (the chain's head; layers
            // frozen earlier were synced by their snapshot) is synced
            // before the clears are stored: a bit cleared on disk means
            // the writes under it are on disk too, so a crash of this
            // replica loses nothing its record does not name (what a delta
            // rebuild of it relies on). The change records go before both:
            // an intent bit is cleared on disk only after the change bits
            // set before its clear are (`crate::changes`).
            let marks: Vec<u8> = file
                .held
                .iter()
                .zip(&snapshot)
                .map(|(o, n)| o | n)
                .collect();
            let mut result = match changed {
                Some(bytes) => {
                    changes::store(&self.dir, &bytes).map_err(|e| IntentError::Changes {
                        path: self.dir.join(changes::CHANGES_FILE),
                        source: Arc::new(e),
                    })
                }
                None => Ok(()),
            };
            if result.is_ok()
                && (relayout
                    || marks != file.held
                    || file.seq == 0
                    || self.lost.load(Ordering::SeqCst))
            {
                result = file.store(&marks);
            }
            if result.is_ok() && marks != snapshot {
                result = match &self.data {
                    Some(data) => data().map_err(IntentError::io(&self.path)),
                    None => Ok(()),
                }
                .and_then(|()| file.store(&snapshot));
            }
            let waiters = {
                let mut s = self.lock();
                match result {
                    Ok(()) => s.durable_seq = seq,
                    Err(e) => {
                        tracing::error!(path = %self.path.display(), error = %e,
                            "cannot persist the write-intent record: INTENT_MARK fails from now on");
                        s.failed = Some(e);
                    }
                }
                #[cfg(debug_assertions)]
                s.check_invariants();
                std::mem::take(&mut s.waiters)
            };
            self.cv.notify_all();
            wake(waiters);
        }
        let waiters = {
            let mut s = self.lock();
            s.exited = true;
            std::mem::take(&mut s.waiters)
        };
        self.cv.notify_all();
        wake(waiters);
    }

    /// Sets regions `[first, first + count)` in memory (the caller checked
    /// the range). Returns the seq to wait for: the mark is durable once
    /// `durable_seq` reaches it (which also covers a store in flight that
    /// snapshotted before these bits were set by someone else).
    pub(crate) fn mark(&self, first: u32, count: u32) -> Result<u64, IntentError> {
        self.update(first, count, true)
    }

    /// Clears regions `[first, first + count)` in memory; the thread
    /// persists it lazily.
    pub(crate) fn clear(&self, first: u32, count: u32) -> Result<(), IntentError> {
        self.update(first, count, false).map(drop)
    }

    fn update(&self, first: u32, count: u32, value: bool) -> Result<u64, IntentError> {
        let mut s = self.lock();
        if let Some(e) = s.broken() {
            return Err(e);
        }
        assert!(
            u64::from(first) + u64::from(count) <= u64::from(s.regions),
            "intent range checked by the caller"
        );
        let changed = set_range(&mut s.bitmap, first, count, value);
        if changed {
            s.changed_seq += 1;
            self.cv.notify_all();
        }
        let seq = s.changed_seq;
        drop(s);
        if changed {
            self.ensure_running()?;
        }
        Ok(seq)
    }

    /// A modifying request over `[offset, offset + len)` arrived (checked
    /// against the volume): noted in every change record, in memory (a
    /// load and nothing else while no record is kept).
    pub(crate) fn note_write(&self, offset: u64, len: u64) {
        if self.tracking.load(Ordering::SeqCst) {
            self.lock().changes.note(offset, len);
        }
    }

    /// CHANGES_START: a record for `key`, seeded with its seed. Returns
    /// the seq to wait for (durable as marks are).
    pub(crate) fn changes_start(
        &self,
        key: &ChangeKey,
    ) -> Result<Result<u64, StartError>, IntentError> {
        let mut s = self.lock();
        if let Some(e) = s.broken() {
            return Err(e);
        }
        if let Err(e) = s.changes.start(key) {
            return Ok(Err(e));
        }
        self.tracking.store(true, Ordering::SeqCst);
        s.changed_seq += 1;
        self.cv.notify_all();
        let seq = s.changed_seq;
        drop(s);
        self.ensure_running()?;
        Ok(Ok(seq))
    }

    /// CHANGES_DROP: ends the record of `peer`, persisted lazily. A drop
    /// lost in a crash brings the record back, which costs only the noting
    /// of writes until the next START or DROP for that peer: the peer was
    /// healthy again, at a later generation, so the record never matches
    /// it. Whether there was one.
    pub(crate) fn changes_drop(&self, peer: &str) -> Result<bool, IntentError> {
        let mut s = self.lock();
        if let Some(e) = s.broken() {
            return Err(e);
        }
        let dropped = s.changes.drop_peer(peer);
        self.tracking.store(!s.changes.is_empty(), Ordering::SeqCst);
        if dropped {
            s.changed_seq += 1;
            self.cv.notify_all();
        }
        drop(s);
        if dropped {
            self.ensure_running()?;
        }
        Ok(dropped)
    }

    /// CHANGES_GET: (generation, bitmap) of `peer`'s record, and the
    /// region size.
    pub(crate) fn changes_get(&self, peer: &str) -> (Option<(u64, Vec<u8>)>, u64) {
        let s = self.lock();
        let record = s
            .changes
            .get(peer)
            .map(|r| (r.generation, r.bitmap.clone()));
        (record, s.changes.region_bytes())
    }

    /// Whether everything up to `seq` is durable: `Some(Ok)` yes,
    /// `Some(Err)` never (a store failed or the thread stopped), `None`
    /// not yet, and `waiter` is woken after the next store.
    pub(crate) fn poll_durable(
        &self,
        seq: u64,
        waiter: &Waiter,
    ) -> Option<Result<(), IntentError>> {
        let mut s = self.lock();
        if s.durable_seq >= seq {
            return Some(Ok(()));
        }
        if let Some(e) = s.broken() {
            return Some(Err(e));
        }
        let known = s
            .waiters
            .iter()
            .any(|(t, p)| t.id() == waiter.0.id() && *p == waiter.1);
        if !known {
            s.waiters.push(waiter.clone());
        }
        None
    }

    /// Blocking: waits until everything up to `seq` is durable. Never on a
    /// reactor.
    pub(crate) fn wait_durable(&self, seq: u64) -> Result<(), IntentError> {
        let mut s = self.lock();
        loop {
            if s.durable_seq >= seq {
                return Ok(());
            }
            if let Some(e) = s.broken() {
                return Err(e);
            }
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Blocking: persists every change made so far (shutdown).
    pub(crate) fn flush(&self) -> Result<(), IntentError> {
        let seq = self.lock().changed_seq;
        self.wait_durable(seq)
    }

    /// Blocking: empties the record durably and ends the lost state (a
    /// clean DETACH).
    pub(crate) fn clear_all_durably(&self) -> Result<(), IntentError> {
        let seq = {
            let mut s = self.lock();
            if let Some(e) = s.broken() {
                return Err(e);
            }
            s.bitmap.fill(0);
            // Bumped even when the bitmap was empty: a lost record must be
            // overwritten by a valid one before the lost state ends.
            s.changed_seq += 1;
            self.cv.notify_all();
            s.changed_seq
        };
        self.ensure_running()?;
        self.wait_durable(seq)?;
        self.lost.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Blocking: the volume grew to `size_bytes` with the same region
    /// sizes (GROW, `crate::grow`): the record and the change records get
    /// the new regions, none set, and are stored with the new geometry
    /// before this returns. A lost record stays lost (all set).
    pub(crate) fn grow(&self, size_bytes: u64) -> Result<(), IntentError> {
        let seq = {
            let mut s = self.lock();
            if let Some(e) = s.broken() {
                return Err(e);
            }
            debug_assert!(intent_regions(size_bytes) >= s.regions);
            s.regions = intent_regions(size_bytes).max(s.regions);
            let bytes = (s.regions as usize).div_ceil(8);
            let fill = if self.lost.load(Ordering::SeqCst) {
                0xFF
            } else {
                0
            };
            s.bitmap.resize(bytes, fill);
            let regions = s.regions;
            if !regions.is_multiple_of(8) {
                if let Some(last) = s.bitmap.last_mut() {
                    *last &= (1u8 << (regions % 8)) - 1;
                }
            }
            s.changes.grow(size_bytes);
            s.changed_seq += 1;
            self.cv.notify_all();
            s.changed_seq
        };
        self.ensure_running()?;
        self.wait_durable(seq)
    }

    /// (lost, bitmap) now.
    pub(crate) fn snapshot(&self) -> (bool, Vec<u8>) {
        let s = self.lock();
        (self.lost.load(Ordering::SeqCst), s.bitmap.clone())
    }

    pub(crate) fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Stops the thread after it stored pending changes, and joins it.
    /// Idempotent.
    pub(crate) fn stop(&self) {
        self.lock().stop = true;
        self.cv.notify_all();
        let never_started = self
            .file
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .is_some();
        if never_started {
            // Nothing changed, so nothing is pending; no thread will start.
            self.lock().exited = true;
        }
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = handle {
            if h.join().is_err() {
                tracing::error!(path = %self.path.display(), "the write-intent thread panicked");
            }
        }
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        self.lock().check_invariants();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    /// 1 GiB: 256 regions of 4 MiB, 32 bitmap bytes.
    const SIZE: u64 = 1 << 30;

    fn tmpdir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("lull-replica-intent-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn flip(path: &Path, at: u64) {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        f.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
    }

    fn bits(bitmap: &[u8]) -> Vec<usize> {
        (0..bitmap.len() * 8)
            .filter(|&i| bitmap[i / 8] & (1 << (i % 8)) != 0)
            .collect()
    }

    #[test]
    fn round_trip_and_slots_alternate() {
        let d = tmpdir("rt");
        let (mut f, loaded) = IntentFile::open(&d, SIZE, true).unwrap();
        assert!(loaded.lost.is_none());
        assert_eq!(loaded.bitmap, vec![0u8; 32]);
        assert_eq!(
            (f.seq(), f.newest),
            (1, Some(0)),
            "creation stores an empty slot A"
        );
        let mut bm = vec![0u8; 32];
        set_range(&mut bm, 3, 2, true);
        set_range(&mut bm, 255, 1, true);
        f.store(&bm).unwrap();
        assert_eq!((f.seq(), f.newest), (2, Some(1)));
        drop(f);
        let (mut f, loaded) = IntentFile::open(&d, SIZE, false).unwrap();
        assert!(loaded.lost.is_none());
        assert_eq!(bits(&loaded.bitmap), vec![3, 4, 255]);
        set_range(&mut bm, 3, 1, false);
        f.store(&bm).unwrap();
        assert_eq!(
            (f.seq(), f.newest),
            (3, Some(0)),
            "the older slot is overwritten"
        );
        drop(f);
        let (f, loaded) = IntentFile::open(&d, SIZE, false).unwrap();
        assert_eq!(bits(&loaded.bitmap), vec![4, 255]);
        assert_eq!(f.seq(), 3);
        let raw = std::fs::read(d.join(INTENT_FILE)).unwrap();
        assert_eq!(raw.len(), 2 * INTENT_SLOT_BYTES);
        assert_eq!(&raw[0..4], b"LULI");
        assert_eq!(&raw[8..16], &3u64.to_be_bytes());
        assert_eq!(
            &raw[INTENT_SLOT_BYTES + 8..INTENT_SLOT_BYTES + 16],
            &2u64.to_be_bytes()
        );
        assert_eq!(&raw[24..28], &256u32.to_be_bytes());
        assert_eq!(&raw[16..24], &(4 * MIB).to_be_bytes());
        assert_eq!(
            raw[SLOT_HEADER_BYTES], 0b0001_0000,
            "region 4: bit 4 of byte 0"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_torn_slot_falls_back_to_the_other() {
        let d = tmpdir("torn");
        let (mut f, _) = IntentFile::open(&d, SIZE, true).unwrap();
        let mut bm = vec![0u8; 32];
        set_range(&mut bm, 7, 1, true);
        f.store(&bm).unwrap(); // seq 2 in slot B
        drop(f);
        // The newest slot (B) torn in its bitmap: the crc catches it and
        // slot A (seq 1, empty) is used.
        flip(
            &d.join(INTENT_FILE),
            (INTENT_SLOT_BYTES + SLOT_HEADER_BYTES + 1) as u64,
        );
        let (mut f, loaded) = IntentFile::open(&d, SIZE, false).unwrap();
        assert!(loaded.lost.is_none());
        assert_eq!(bits(&loaded.bitmap), Vec::<usize>::new());
        assert_eq!((f.seq(), f.newest), (1, Some(0)));
        // The next store goes over the broken slot, not the good one.
        f.store(&bm).unwrap();
        assert_eq!(f.newest, Some(1));
        drop(f);
        // The older slot corrupt (its magic): the newer one is used.
        flip(&d.join(INTENT_FILE), 0);
        let (_, loaded) = IntentFile::open(&d, SIZE, false).unwrap();
        assert!(loaded.lost.is_none());
        assert_eq!(bits(&loaded.bitmap), vec![7]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn both_slots_corrupt_or_short_is_lost() {
        let d = tmpdir("lost");
        let (f, _) = IntentFile::open(&d, SIZE, true).unwrap();
        drop(f);
        let path = d.join(INTENT_FILE);
        // Slot A's crc, slot B never written (zeros).
        flip(&path, 29);
        let (mut f, loaded) = IntentFile::open(&d, SIZE, true).unwrap();
        assert!(
            matches!(loaded.lost, Some(Lost::NoValidSlot)),
            "{:?}",
            loaded.lost
        );
        assert_eq!(loaded.bitmap, vec![0xff; 32]);
        // A store makes the record valid again (with what memory says).
        f.store(&loaded.bitmap).unwrap();
        drop(f);
        let (_, loaded) = IntentFile::open(&d, SIZE, false).unwrap();
        assert!(loaded.lost.is_none());
        assert_eq!(loaded.bitmap, vec![0xff; 32]);
        // Truncated.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(5000)
            .unwrap();
        let (_, loaded) = IntentFile::open(&d, SIZE, true).unwrap();
        assert!(
            matches!(loaded.lost, Some(Lost::Short { len: 5000 })),
            "{:?}",
            loaded.lost
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn other_geometry_is_lost() {
        let d = tmpdir("geometry");
        let (f, _) = IntentFile::open(&d, SIZE, true).unwrap();
        drop(f);
        // Valid slots for 1 GiB are not valid for 2 GiB (256 vs 512 regions).
        let (_, loaded) = IntentFile::open(&d, 2 * SIZE, true).unwrap();
        assert!(matches!(loaded.lost, Some(Lost::NoValidSlot)));
        assert_eq!(loaded.bitmap.len(), 64);
        // Nor for 100 GiB (regions of 8 MiB, not 4 MiB).
        let (_, loaded) = IntentFile::open(&d, 100 << 30, true).unwrap();
        assert!(loaded.lost.is_some());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn missing_file_rules() {
        let d = tmpdir("missing");
        // New or clean: an empty record, created durably.
        let (f, loaded) = IntentFile::open(&d, SIZE, true).unwrap();
        assert!(loaded.lost.is_none() && loaded.bitmap.iter().all(|&b| b == 0));
        assert_eq!(f.seq(), 1);
        drop(f);
        std::fs::remove_file(d.join(INTENT_FILE)).unwrap();
        // Dirty: lost, every region set; the file exists (for stores) but
        // holds no valid slot, so a restart before any store is lost again.
        let (f, loaded) = IntentFile::open(&d, 10 * MIB, false).unwrap();
        assert!(matches!(loaded.lost, Some(Lost::MissingWhileDirty)));
        assert_eq!(
            loaded.bitmap,
            vec![0b0000_0111],
            "3 regions, bits past them zero"
        );
        assert_eq!(f.seq(), 0);
        drop(f);
        let (_, loaded) = IntentFile::open(&d, 10 * MIB, true).unwrap();
        assert!(matches!(loaded.lost, Some(Lost::NoValidSlot)));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn set_range_reports_changes() {
        let mut b = vec![0u8; 2];
        assert!(set_range(&mut b, 6, 4, true));
        assert_eq!(b, vec![0b1100_0000, 0b0000_0011]);
        assert!(!set_range(&mut b, 7, 2, true));
        assert!(set_range(&mut b, 0, 16, false));
        assert!(!set_range(&mut b, 0, 0, true));
        assert_eq!(all_set(11), vec![0xff, 0b0000_0111]);
    }

    #[test]
    fn persister_group_commits_and_survives_restart() {
        let d = tmpdir("persister");
        let (f, loaded) = IntentFile::open(&d, SIZE, true).unwrap();
        let p = Persister::start(f, loaded, Changes::new(SIZE), None).unwrap();
        let s1 = p.mark(0, 2).unwrap();
        let s2 = p.mark(10, 1).unwrap();
        assert!(s2 > s1);
        // Same bits again: nothing changes, and the seq to wait for is
        // still covered by the pending store.
        assert_eq!(p.mark(0, 1).unwrap(), s2);
        p.wait_durable(s2).unwrap();
        p.clear(0, 1).unwrap();
        p.check_invariants();
        p.flush().unwrap();
        assert_eq!(bits(&p.snapshot().1), vec![1, 10]);
        p.stop();
        p.stop();
        assert!(matches!(p.mark(3, 1), Err(IntentError::Stopped)));
        let (f, loaded) = IntentFile::open(&d, SIZE, false).unwrap();
        assert_eq!(bits(&loaded.bitmap), vec![1, 10]);
        // Stores: 1 at creation, then at most one per change (fewer when
        // changes arrived while a store ran).
        assert!(f.seq() >= 2 && f.seq() <= 4, "{}", f.seq());
        // Lost, then emptied durably: the lost state ends.
        drop(f);
        flip(&d.join(INTENT_FILE), 1);
        flip(&d.join(INTENT_FILE), INTENT_SLOT_BYTES as u64 + 1);
        let (f, loaded) = IntentFile::open(&d, SIZE, false).unwrap();
        let p = Persister::start(f, loaded, Changes::new(SIZE), None).unwrap();
        assert!(p.lost());
        assert_eq!(p.snapshot().1, vec![0xff; 32]);
        p.clear_all_durably().unwrap();
        assert_eq!(p.snapshot(), (false, vec![0; 32]));
        p.stop();
        let (_, loaded) = IntentFile::open(&d, SIZE, false).unwrap();
        assert!(loaded.lost.is_none() && bits(&loaded.bitmap).is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_failed_store_fails_every_later_mark() {
        let d = tmpdir("fail");
        let (mut f, loaded) = IntentFile::open(&d, SIZE, true).unwrap();
        // A read-only descriptor: the next store fails with EBADF.
        f.file = File::open(d.join(INTENT_FILE)).unwrap();
        let p = Persister::start(f, loaded, Changes::new(SIZE), None).unwrap();
        let seq = p.mark(1, 1).unwrap();
        let err = p.wait_durable(seq).unwrap_err();
        assert!(matches!(err, IntentError::Io { .. }), "{err}");
        assert_eq!(err.errno(), libc::EBADF);
        assert!(p.mark(2, 1).is_err());
        assert!(p.clear_all_durably().is_err());
        p.stop();
        let _ = std::fs::remove_dir_all(&d);
    }
}
