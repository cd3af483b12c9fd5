//! Snapshots of a replica (replica protocol version 5): SNAPSHOT and
//! SNAPSHOT_LIST on the chain of layers its data is
//! (`lull_bdev::chain`: `DIR/data.img` and `DIR/data.img.lull/`).
//!
//! ```ignore
//! // On a connection, for SNAPSHOT {create, "s1"} (counted in the fence):
//! let rx = shared.snapshot_async(SnapshotJob::Run(req), store, thread, poller)?;
//! // ... the connection reads no frames until `rx` answers, then replies:
//! match rx.try_recv() {
//!     Ok(Ok(SnapshotDone::Ran)) => { /* status 0: the record is durable */ }
//!     Ok(Err(e)) => { /* status e.errno(), logged */ }
//!     _ => {}
//! }
//! ```
//!
//! The chain's control operations block (a quiesce of every channel, an
//! fsync of the head, the record's write and directory fsync), so each
//! runs on a short-lived helper thread, as the metadata jobs do, and
//! wakes the connection's poller when done; no reactor waits. They are
//! serialised per replica by [`Control`], which a replica that stops or
//! is deleted closes (stopping a merge in the background first), so no
//! operation touches its files afterwards.
//!
//! What each operation answers after (the record is replaced atomically,
//! see `lull_bdev::chain::FileStore`):
//! - create: the frozen head synced and the record naming the new head
//!   durable (`ChainDev::snapshot`);
//! - revert: every change record noted the whole volume and every
//!   write-intent region is set durably (the replicas of a volume differ
//!   everywhere until each has reverted: an engine crash in between must
//!   find every region to repair), then the record naming the new head is
//!   durable;
//! - delete: the merge has started (it runs in the background, I/O goes
//!   on; SNAPSHOT_LIST shows its progress, and the snapshot is gone from
//!   the list once it is done). A merge cut by a stop or a crash leaves
//!   the snapshot in place: deleting it again starts over.

use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};

use lull_bdev::chain::{check_snapshot_name, SnapshotInfo, MAX_CHAIN_LAYERS};
use lull_bdev::BlockDevice as _;
use lull_proto::replica::{
    self as proto, SnapshotOp, SnapshotRecord, SnapshotRequest, MAX_SNAPSHOT_NAME_BYTES,
    MAX_SNAPSHOT_RECORDS,
};
use lull_reactor::{PollerId, ThreadHandle};

use crate::store::Index;

use crate::{ReplicaError, Shared, SnapshotError};

// The wire's bounds are the chain's: a name the chain takes fits a
// request, and a chain's snapshots fit one SNAPSHOT_LIST reply.
const _: () = assert!(MAX_SNAPSHOT_NAME_BYTES == lull_bdev::chain::MAX_SNAPSHOT_NAME_LEN);
const _: () = assert!(MAX_SNAPSHOT_RECORDS >= MAX_CHAIN_LAYERS);

/// A snapshot request run on a helper thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SnapshotJob {
    /// SNAPSHOT: create, delete or revert.
    Run(SnapshotRequest),
    /// SNAPSHOT_LIST. Off the reactor too: a layer's allocated bytes are
    /// a count over its bitmap (32 KiB per GiB of volume per layer).
    List,
    /// CLONE on a view of `snapshot`: a new replica `name` of the store.
    Clone { snapshot: String, name: String },
    /// GROW to this many bytes (`crate::grow`): a chain control operation
    /// too, serialised with the others.
    Grow(u64),
}

/// What a job answers.
#[derive(Debug)]
pub(crate) enum SnapshotDone {
    /// The operation is durable (create, revert) or started (delete).
    Ran,
    /// The encoded SNAPSHOT_LIST payload.
    List(Vec<u8>),
}

/// Serialises a replica's chain control operations, and closes them for
/// good when the replica stops or is deleted.
#[derive(Default)]
pub(crate) struct Control {
    closed: Mutex<bool>,
}

impl Control {
    /// Held across one operation; refused once closed.
    pub(crate) fn enter(&self) -> Result<MutexGuard<'_, bool>, SnapshotError> {
        let guard = self.closed.lock().unwrap_or_else(|p| p.into_inner());
        if *guard {
            return Err(SnapshotError::Closed);
        }
        Ok(guard)
    }
}

impl Shared {
    /// Starts `job` on a helper thread ("lull-replica-snap"). The result
    /// arrives on the returned channel, and then `poller` on `thread` is
    /// woken (as [`Shared::meta_async`]).
    ///
    /// `store` is the node's store this replica is in (`None` for `lull
    /// replica`): a clone is made there, and a flatten tells the origin
    /// there once done.
    pub(crate) fn snapshot_async(
        self: &Arc<Self>,
        job: SnapshotJob,
        store: Option<Arc<Index>>,
        thread: ThreadHandle,
        poller: PollerId,
    ) -> Result<mpsc::Receiver<Result<SnapshotDone, SnapshotError>>, ReplicaError> {
        let shared = self.clone();
        crate::on_helper_thread("lull-replica-snap", thread, poller, move || match job {
            SnapshotJob::Run(req) => shared.snapshot_run(&req, store).map(|()| SnapshotDone::Ran),
            SnapshotJob::List => Ok(SnapshotDone::List(shared.snapshot_list())),
            SnapshotJob::Clone { snapshot, name } => {
                let (Some(store), Some(origin)) = (store, shared.name.as_deref()) else {
                    return Err(SnapshotError::NotAStore);
                };
                store.clone_replica(&name, origin, &snapshot)?;
                Ok(SnapshotDone::Ran)
            }
            SnapshotJob::Grow(size) => shared.grow(size).map(|()| SnapshotDone::Ran),
        })
    }

    /// Blocking: one SNAPSHOT operation (module doc).
    pub(crate) fn snapshot_run(
        &self,
        req: &SnapshotRequest,
        store: Option<Arc<Index>>,
    ) -> Result<(), SnapshotError> {
        let name = req.name.as_str();
        check_snapshot_name(name).map_err(|e| SnapshotError::BadName(e.to_string()))?;
        let _one = self.control.enter()?;
        let chain = &self.chain;
        match req.op {
            SnapshotOp::Create => {
                if chain.has_snapshot(name) {
                    return Err(SnapshotError::Exists(name.into()));
                }
                if chain.layer_count() >= MAX_CHAIN_LAYERS {
                    return Err(SnapshotError::ChainFull);
                }
                chain
                    .snapshot(name)
                    .map_err(|e| SnapshotError::of_chain(e, name))?;
            }
            SnapshotOp::Delete => chain
                .delete_snapshot(name)
                .map_err(|e| SnapshotError::of_chain(e, name))?,
            SnapshotOp::Flatten => {
                match chain.base_snapshot() {
                    // Stands alone already (a flatten asked again).
                    None => return Ok(()),
                    Some(base) if base != name => {
                        return Err(SnapshotError::NotFound(name.into()));
                    }
                    Some(_) => {}
                }
                // Once the base has left the chain, the origin may delete
                // the snapshots it shared (a crash before that is mended
                // when the store opens: `Store::open`).
                let me = self.name.clone();
                let done: Box<dyn FnOnce() + Send> = Box::new(move || {
                    if let (Some(store), Some(me)) = (store, me) {
                        store.forget_clone(&me);
                    }
                });
                chain
                    .start_flatten(done)
                    .map_err(|e| SnapshotError::of_chain(e, name))?;
                tracing::info!(dir = %self.dir.display(), base = name, "flatten started: the base is copied in the background");
            }
            SnapshotOp::Revert => {
                if !chain.has_snapshot(name) {
                    return Err(SnapshotError::NotFound(name.into()));
                }
                if let Some(m) = chain.snapshots().iter().find(|s| s.merging.is_some()) {
                    return Err(SnapshotError::Busy(format!(
                        "snapshot {:?} is being merged; try again when it is gone",
                        m.name
                    )));
                }
                // Every byte may change: noted in every change record (a
                // replica away gets it all back) and in the write-intent
                // record, durably, before the chain changes.
                self.intent.note_write(0, self.size_bytes());
                let seq = self.intent.mark(0, self.regions())?;
                self.intent.wait_durable(seq)?;
                let dropped = chain
                    .revert(name)
                    .map_err(|e| SnapshotError::of_chain(e, name))?;
                if !dropped.is_empty() {
                    tracing::info!(dir = %self.dir.display(), snapshot = name, ?dropped,
                        "revert dropped the newer snapshots");
                }
            }
        }
        Ok(())
    }

    /// The SNAPSHOT_LIST payload: the chain's snapshots, oldest first.
    pub(crate) fn snapshot_list(&self) -> Vec<u8> {
        let records: Vec<SnapshotRecord> = self
            .chain
            .snapshots()
            .into_iter()
            .take(MAX_SNAPSHOT_RECORDS)
            .map(record_of)
            .collect();
        // Names are checked by the chain (1 to MAX_SNAPSHOT_NAME_LEN
        // bytes) and the count is bounded above, so this cannot fail.
        proto::encode_snapshot_list(&records).unwrap_or_else(|e| {
            tracing::error!(dir = %self.dir.display(), error = %e, "cannot encode the snapshot list");
            Vec::new()
        })
    }

    /// Closes the chain's control operations for good: waits for one
    /// running, stops a merge in the background. Blocking (at most one
    /// operation and one merge step); for a replica that stops or is
    /// deleted.
    pub(crate) fn close_chain(&self) {
        let mut closed = self
            .control
            .closed
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        *closed = true;
        if self.chain.stop_merge() {
            tracing::info!(dir = %self.dir.display(),
                "a snapshot's merge was stopped: the snapshot stays (delete it again to merge it)");
        }
    }

    /// Bytes the replica's layers occupy on disk (its files are sparse).
    pub(crate) fn allocated_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.blocks() * 512);
        let mut total = size(&self.dir.join(crate::DATA_FILE));
        if let Ok(entries) = std::fs::read_dir(self.layers.dir()) {
            for e in entries.flatten() {
                if e.file_name().to_string_lossy().ends_with(".img") {
                    total += size(&e.path());
                }
            }
        }
        total
    }
}

fn record_of(s: SnapshotInfo) -> SnapshotRecord {
    let (merge_done, merge_total) = s.merging.unwrap_or((0, 0));
    SnapshotRecord {
        name: s.name,
        created_unix: s.created_unix,
        allocated_bytes: s.allocated_bytes,
        merge_done,
        merge_total,
        inherited: s.inherited,
    }
}
