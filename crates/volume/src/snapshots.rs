//! A volume's snapshots, whatever stands under it: a chain of layers in
//! this process (`lull_bdev::ChainDev`), or the chains of a replicated
//! volume's replicas, reached through its engine
//! (`lull_engine::ReplicatedDev`). The control plane asks
//! [`Storage::snapshots`] for a volume's [`Snapshots`] and calls one
//! method per operation; each kind answers it its own way, and the caller
//! sees one [`Snapshot`] and one [`SnapshotError`] for both.
//!
//! ```
//! use std::sync::Arc;
//! use lull_volume::{Flattened, Storage};
//! let base = Arc::new(lull_bdev::MallocDev::new(1 << 20)?);
//! let store = Arc::new(lull_bdev::chain::MemoryStore::new(base));
//! let storage = Storage::Layered(Arc::new(lull_bdev::ChainDev::open(store, 1 << 20)?));
//! let snapshots = storage.snapshots("vol0")?;
//! let s1 = snapshots.create("s1")?;
//! assert_eq!((s1.info.parent, s1.replicas), (None, None));
//! // The node's record of clones is asked only by storage that does not
//! // keep its own (a chain does).
//! assert_eq!(snapshots.list(&lull_volume::no_clones)?.len(), 1);
//! assert!(matches!(snapshots.flatten()?, Flattened::NotAClone));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;
use std::time::Duration;

use lull_bdev::chain::LayerStore;
use lull_bdev::{BdevError, BlockDevice, ChainDev, SnapshotInfo};
use lull_engine::{ReplicaState, ReplicaTarget, ReplicatedDev};
use lull_proto::replica::{SnapshotOp, SnapshotRecord};

use crate::Storage;

/// How long a snapshot operation of a replicated volume waits for its
/// replicas: the writes in flight finish (each bounded by the replica
/// timeout, 8 s by default), then SNAPSHOT may take that timeout and
/// `lull_engine::SNAPSHOT_EXTRA_TIMEOUT_NS` (20 s) before its replica is
/// failed; past this the caller is told so and the operation may still
/// end.
pub const REPLICATED_SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(60);

/// One snapshot of a volume, oldest first in a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// What any snapshot has (a replicated volume's merged over its
    /// healthy replicas' lists; `clones` from the node's record).
    pub info: SnapshotInfo,
    /// A replicated volume's snapshot: where it is. `None` for a chain's.
    pub replicas: Option<SnapshotReplicas>,
}

/// Which healthy replicas of a replicated volume hold one snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotReplicas {
    /// Their addresses.
    pub addrs: Vec<String>,
    /// Every healthy replica holds it (not so after a crash during its
    /// creation; deleting it cleans up).
    pub complete: bool,
}

impl From<SnapshotInfo> for Snapshot {
    fn from(info: SnapshotInfo) -> Snapshot {
        Snapshot {
            info,
            replicas: None,
        }
    }
}

/// Why a snapshot operation did not happen.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// In `lull_bdev`'s words: a chain's refusal or failure, or a bad
    /// or unknown snapshot name of a replicated volume, said the same way.
    #[error(transparent)]
    Bdev(#[from] BdevError),
    /// The operation does not apply (a volume that takes no snapshots, a
    /// clone in the way) or the replicas refused it; the words say why.
    #[error("{0}")]
    Refused(String),
    /// It was done, and what it made is not where it should be.
    #[error("{0}")]
    Failed(String),
}

/// The node's clones of some snapshots of a volume: volume names, for
/// storage that does not record its clones itself (a replicated volume's
/// replicas do not know the volumes over their clones; a chain records
/// its own and does not ask).
pub type ClonesOf<'a> = &'a dyn Fn(&[String]) -> Vec<String>;

/// A [`ClonesOf`] that knows no clones: for a list read for the
/// snapshots themselves (their names, replicas, the clone's base).
pub fn no_clones(_: &[String]) -> Vec<String> {
    Vec::new()
}

/// What [`Snapshots::flatten`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Flattened {
    /// The volume has no base to copy in.
    NotAClone,
    /// The base is copied in and has left the volume (a chain waits for
    /// its copy).
    Done,
    /// Every replica copies its base, snapshot `base`, in the background
    /// (the snapshot list shows it merging).
    Started { base: String },
}

/// What [`Snapshots::make_clone`] made: what a clone stands on.
pub enum Cloned {
    /// A chain over the snapshot's layers (shared, not copied) with its
    /// own head: the clone's storage, ready to serve.
    Chain(Arc<ChainDev>),
    /// A replica on each of the origin's replicas' stores, over that
    /// replica's copy of the snapshot (shared, not copied): a new engine
    /// over them serves the clone.
    Replicas(Vec<ReplicaTarget>),
}

impl std::fmt::Debug for Cloned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cloned::Chain(c) => write!(f, "Chain({})", c.describe()),
            Cloned::Replicas(r) => f.debug_tuple("Replicas").field(r).finish(),
        }
    }
}

/// The snapshot operations of a volume's storage.
pub trait Snapshots {
    /// Takes snapshot `name`: every write acknowledged before the call is
    /// in it, none issued after.
    fn create(&self, name: &str) -> Result<Snapshot, SnapshotError>;

    /// The snapshots, oldest first.
    fn list(&self, clones_of: ClonesOf<'_>) -> Result<Vec<Snapshot>, SnapshotError>;

    /// Starts deleting snapshot `name` of volume `volume` (merged into its
    /// child in the background). Refused for a snapshot of the volume's
    /// base and while a clone stands on it or on a newer one.
    fn delete(
        &self,
        volume: &str,
        name: &str,
        clones_of: ClonesOf<'_>,
    ) -> Result<(), SnapshotError>;

    /// Makes the live data snapshot `name`'s; the newer snapshots are
    /// dropped, and returned. Refused while a clone stands on one of them.
    /// The caller checks for connected clients.
    fn revert(&self, name: &str, clones_of: ClonesOf<'_>) -> Result<Vec<String>, SnapshotError>;

    /// Copies a clone's base into it, so that it stands alone.
    fn flatten(&self) -> Result<Flattened, SnapshotError>;

    /// Makes what a clone of snapshot `snapshot`, to be volume `name`,
    /// stands on. A chain's clone writes to `head` (the caller makes it,
    /// of the kind the clone's backend names); a replicated volume's to
    /// replicas `{name}.r{i}` made beside the snapshot, and takes no
    /// `head` (refused unless every replica is healthy and holds the
    /// snapshot).
    fn make_clone(
        &self,
        snapshot: &str,
        name: &str,
        head: Option<Arc<dyn LayerStore>>,
    ) -> Result<Cloned, SnapshotError>;

    /// Brings the names the volume serves its snapshots under
    /// ([`BlockDevice::snapshot_view`]) up to date.
    fn refresh_views(&self) -> Result<(), SnapshotError>;
}

impl Storage {
    /// The snapshot operations of `volume`'s storage; refused for a device
    /// that takes none.
    pub fn snapshots(&self, volume: &str) -> Result<&dyn Snapshots, SnapshotError> {
        match self {
            Storage::Layered(chain) => Ok(chain.as_ref()),
            Storage::Replicated(dev) => Ok(dev.as_ref()),
            Storage::Local(_) => Err(SnapshotError::Refused(format!(
                "volume {volume:?} cannot take snapshots (a faulty= test device)"
            ))),
        }
    }
}

impl Snapshots for ChainDev {
    fn create(&self, name: &str) -> Result<Snapshot, SnapshotError> {
        Ok(self.snapshot(name)?.into())
    }

    fn list(&self, _: ClonesOf<'_>) -> Result<Vec<Snapshot>, SnapshotError> {
        Ok(self.snapshots().into_iter().map(Snapshot::from).collect())
    }

    fn delete(&self, _: &str, name: &str, _: ClonesOf<'_>) -> Result<(), SnapshotError> {
        Ok(self.delete_snapshot(name)?)
    }

    fn revert(&self, name: &str, _: ClonesOf<'_>) -> Result<Vec<String>, SnapshotError> {
        Ok(ChainDev::revert(self, name)?)
    }

    fn flatten(&self) -> Result<Flattened, SnapshotError> {
        Ok(if ChainDev::flatten(self)? {
            Flattened::Done
        } else {
            Flattened::NotAClone
        })
    }

    fn make_clone(
        &self,
        snapshot: &str,
        name: &str,
        head: Option<Arc<dyn LayerStore>>,
    ) -> Result<Cloned, SnapshotError> {
        let head = head.ok_or_else(|| {
            SnapshotError::Refused(format!(
                "a clone of snapshot {snapshot:?} of a chain needs a head for its own writes"
            ))
        })?;
        Ok(Cloned::Chain(Arc::new(
            self.clone_snapshot(snapshot, name, head)?,
        )))
    }

    fn refresh_views(&self) -> Result<(), SnapshotError> {
        Ok(())
    }
}

impl Snapshots for ReplicatedDev {
    fn create(&self, name: &str) -> Result<Snapshot, SnapshotError> {
        lull_bdev::chain::check_snapshot_name(name)?;
        if let Some(s) = find(self.list(&no_clones)?, name) {
            let on = s.replicas.map(|r| r.addrs.join(", ")).unwrap_or_default();
            return Err(SnapshotError::Refused(format!(
                "snapshot {name:?} exists already (on {on})"
            )));
        }
        replicated_op(self, SnapshotOp::Create, name)?;
        find(self.list(&no_clones)?, name).ok_or_else(|| {
            SnapshotError::Failed(format!(
                "snapshot {name:?} was taken and is missing from the list"
            ))
        })
    }

    fn list(&self, clones_of: ClonesOf<'_>) -> Result<Vec<Snapshot>, SnapshotError> {
        let lists = self
            .snapshot_lists(REPLICATED_SNAPSHOT_TIMEOUT)
            .map_err(SnapshotError::Refused)?;
        let mut answered = Vec::new();
        for (addr, list) in lists {
            match list {
                Ok(l) => answered.push((addr.to_string(), l)),
                Err(e) => {
                    return Err(SnapshotError::Refused(format!(
                        "replica {addr} did not list its snapshots: {e}"
                    )))
                }
            }
        }
        let mut out = merge_lists(answered, BlockDevice::size_bytes(self));
        for s in &mut out {
            s.info.clones = clones_of(std::slice::from_ref(&s.info.name));
        }
        Ok(out)
    }

    fn delete(
        &self,
        volume: &str,
        name: &str,
        clones_of: ClonesOf<'_>,
    ) -> Result<(), SnapshotError> {
        let list = self.list(&no_clones)?;
        let at = position(&list, name)?;
        if list[at].info.inherited {
            return Err(SnapshotError::Refused(format!(
                "snapshot {name:?} belongs to the volume {volume:?} was cloned from; flatten the clone instead"
            )));
        }
        // Merged into its child, it would change the base of a clone of
        // it or of a newer snapshot (the replicas refuse too).
        let newer: Vec<String> = list[at..].iter().map(|s| s.info.name.clone()).collect();
        let clones = clones_of(&newer);
        if !clones.is_empty() {
            return Err(SnapshotError::Refused(format!(
                "snapshot {name:?} is in the base of clones {}: flatten or delete them first",
                clones.join(", ")
            )));
        }
        replicated_op(self, SnapshotOp::Delete, name)
    }

    fn revert(&self, name: &str, clones_of: ClonesOf<'_>) -> Result<Vec<String>, SnapshotError> {
        let list = self.list(&no_clones)?;
        let at = position(&list, name)?;
        let dropped: Vec<String> = list[at + 1..].iter().map(|s| s.info.name.clone()).collect();
        let clones = clones_of(&dropped);
        if !clones.is_empty() {
            return Err(SnapshotError::Refused(format!(
                "reverting to {name:?} would drop snapshots that clones use: {}",
                clones.join(", ")
            )));
        }
        replicated_op(self, SnapshotOp::Revert, name)?;
        Ok(dropped)
    }

    fn flatten(&self) -> Result<Flattened, SnapshotError> {
        let Some(base) = self
            .list(&no_clones)?
            .into_iter()
            .rev()
            .find(|s| s.info.inherited)
        else {
            return Ok(Flattened::NotAClone);
        };
        replicated_op(self, SnapshotOp::Flatten, &base.info.name)?;
        Ok(Flattened::Started {
            base: base.info.name,
        })
    }

    fn make_clone(
        &self,
        snapshot: &str,
        name: &str,
        _: Option<Arc<dyn LayerStore>>,
    ) -> Result<Cloned, SnapshotError> {
        let Some(s) = find(self.list(&no_clones)?, snapshot) else {
            return Err(BdevError::NoSuchSnapshot(snapshot.to_string()).into());
        };
        let away: Vec<String> = self
            .replica_status()
            .into_iter()
            .filter(|r| r.state != ReplicaState::Healthy)
            .map(|r| format!("{} ({:?})", r.addr, r.state))
            .collect();
        if !away.is_empty() || !s.replicas.is_some_and(|r| r.complete) {
            return Err(SnapshotError::Refused(format!(
                "a clone of a replicated volume is made on every replica, and needs each healthy and holding {snapshot:?}: not so for {}",
                if away.is_empty() { "some replica".to_string() } else { away.join(", ") }
            )));
        }
        self.clone_replicas(snapshot, |i, _| format!("{name}.r{i}"))
            .map(Cloned::Replicas)
            .map_err(SnapshotError::Refused)
    }

    fn refresh_views(&self) -> Result<(), SnapshotError> {
        // A view reads from a replica that holds the snapshot: the lists
        // say which.
        self.snapshot_lists(REPLICATED_SNAPSHOT_TIMEOUT)
            .map(|_| ())
            .map_err(SnapshotError::Refused)
    }
}

/// Runs `op` on every healthy replica of `dev`.
fn replicated_op(dev: &ReplicatedDev, op: SnapshotOp, name: &str) -> Result<(), SnapshotError> {
    dev.snapshot(op, name, REPLICATED_SNAPSHOT_TIMEOUT)
        .map_err(SnapshotError::Refused)
}

fn find(list: Vec<Snapshot>, name: &str) -> Option<Snapshot> {
    list.into_iter().find(|s| s.info.name == name)
}

fn position(list: &[Snapshot], name: &str) -> Result<usize, SnapshotError> {
    list.iter()
        .position(|s| s.info.name == name)
        .ok_or_else(|| BdevError::NoSuchSnapshot(name.to_string()).into())
}

/// The snapshots of a replicated volume of `size_bytes`, oldest first,
/// from each healthy replica's list (`(address, list)`): merged by name in
/// the order of the longest list, with the replicas holding each.
fn merge_lists(mut answered: Vec<(String, Vec<SnapshotRecord>)>, size_bytes: u64) -> Vec<Snapshot> {
    answered.sort_by_key(|(_, l)| std::cmp::Reverse(l.len()));
    let mut out: Vec<Snapshot> = Vec::new();
    for (addr, list) in &answered {
        for (i, rec) in list.iter().enumerate() {
            if let Some(s) = out.iter_mut().find(|s| s.info.name == rec.name) {
                if let Some(r) = &mut s.replicas {
                    r.addrs.push(addr.clone());
                }
                continue;
            }
            out.push(Snapshot {
                info: SnapshotInfo {
                    name: rec.name.clone(),
                    created_unix: rec.created_unix,
                    size_bytes,
                    allocated_bytes: rec.allocated_bytes,
                    parent: i.checked_sub(1).map(|p| list[p].name.clone()),
                    clones: Vec::new(),
                    inherited: rec.inherited,
                    merging: (rec.merge_total > 0).then_some((rec.merge_done, rec.merge_total)),
                },
                replicas: Some(SnapshotReplicas {
                    addrs: vec![addr.clone()],
                    complete: false,
                }),
            });
        }
    }
    for r in out.iter_mut().filter_map(|s| s.replicas.as_mut()) {
        r.complete = r.addrs.len() == answered.len();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, inherited: bool) -> SnapshotRecord {
        SnapshotRecord {
            name: name.into(),
            created_unix: 7,
            allocated_bytes: 4096,
            merge_done: 0,
            merge_total: 0,
            inherited,
        }
    }

    #[test]
    fn replicas_lists_merge_by_name_in_the_longest_order() {
        let a = (
            "a:1".to_string(),
            vec![record("base", true), record("s1", false)],
        );
        let b = (
            "b:1".to_string(),
            vec![
                record("base", true),
                record("s1", false),
                record("s2", false),
            ],
        );
        let merged = merge_lists(vec![a, b], 1 << 20);
        let names: Vec<(&str, Option<&str>, bool, usize)> = merged
            .iter()
            .map(|s| {
                let r = s.replicas.as_ref().expect("replicated");
                (
                    s.info.name.as_str(),
                    s.info.parent.as_deref(),
                    r.complete,
                    r.addrs.len(),
                )
            })
            .collect();
        assert_eq!(
            names,
            [
                ("base", None, true, 2),
                ("s1", Some("base"), true, 2),
                ("s2", Some("s1"), false, 1),
            ]
        );
        assert!(merged[0].info.inherited && !merged[1].info.inherited);
        assert_eq!(merged[2].info.size_bytes, 1 << 20);
        assert_eq!(merged[2].replicas.as_ref().expect("r").addrs, ["b:1"]);
    }

    #[test]
    fn a_chain_answers_every_operation_and_a_plain_device_none() {
        let base = Arc::new(lull_bdev::MallocDev::new(1 << 20).expect("malloc"));
        let plain = Storage::Local(base.clone());
        let err = plain.snapshots("p").err().expect("refused");
        assert!(err.to_string().contains("cannot take snapshots"), "{err}");
        let store = Arc::new(lull_bdev::chain::MemoryStore::new(base));
        let chain = lull_bdev::ChainDev::open(store, 1 << 20).expect("chain");
        let storage = Storage::Layered(Arc::new(chain));
        let s = storage.snapshots("v").expect("a chain takes snapshots");
        let none: ClonesOf<'_> = &no_clones;
        s.create("s1").expect("s1");
        s.create("s2").expect("s2");
        assert!(matches!(
            s.create("s1"),
            Err(SnapshotError::Bdev(BdevError::BadName(_)))
        ));
        assert_eq!(s.revert("s1", none).expect("revert"), ["s2"]);
        assert!(matches!(
            s.revert("nope", none),
            Err(SnapshotError::Bdev(BdevError::NoSuchSnapshot(_)))
        ));
        s.refresh_views().expect("nothing to refresh");
        assert_eq!(s.flatten().expect("flatten"), Flattened::NotAClone);
        let listed = s.list(none).expect("list");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].info.name, "s1");
        s.delete("v", "s1", none).expect("delete");
    }
}
