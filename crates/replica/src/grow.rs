//! GROW (replica protocol version 7): a replica's volume grows online.
//!
//! ```ignore
//! // On a connection, for GROW with offset = 2 GiB (counted in the fence),
//! // as a snapshot job on a helper thread (`crate::snapshots`):
//! let rx = shared.snapshot_async(SnapshotJob::Grow(2 << 30), thread, poller)?;
//! ```
//!
//! The steps, each durable before the next, so a crash anywhere leaves a
//! replica that opens at one size and never one that serves stale bytes
//! as the peers' (the engine sends GROW only with every replica healthy
//! and nothing in flight):
//!
//! 1. the chain grows (`ChainDev::grow`: every layer's file is extended
//!    sparsely, so the new range reads as zeros from the head and every
//!    snapshot);
//! 2. the write-intent record and the change records take the new
//!    regions (same region sizes: [`grow_keeps_regions`]) and are stored;
//! 3. the metadata record takes the new size.
//!
//! A crash after 1 opens at the old size (the files are only longer). A
//! crash after 2 and before 3 opens at the old size with a write-intent
//! record of the new regions: the record is lost (every region counts as
//! set, a full compare-and-repair) and so are the change records (full
//! rebuilds), which is safe. From 3 on it opens at the new size; the size
//! in a store's record (`store.json`) follows right after (a store
//! opening a replica whose own record is larger takes that).
//!
//! Only then do requests see the new size: the chain and the records
//! have it already, so a request checked against it finds room.

use std::sync::atomic::Ordering;

use lull_bdev::{BdevError, BlockDevice as _};
use lull_proto::replica::{grow_keeps_regions, intent_regions, GROW_ALIGN_BYTES, MAX_GROW_BYTES};

use crate::intent::IntentError;
use crate::meta::{Meta, MetaError};
use crate::Shared;
use crate::SnapshotError;

/// What a store runs once a replica's GROW is durable: it writes its
/// record with the new size. Its error is logged (the replica's own
/// record has the size, and a store that opens it takes that).
pub(crate) type GrownHook = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Why a GROW was refused or failed; each maps to the errno of its reply.
#[derive(Debug, thiserror::Error)]
pub enum GrowError {
    #[error("cannot shrink a replica from {size} to {requested} bytes (replicas only grow)")]
    Shrink { size: u64, requested: u64 },
    #[error("cannot grow to {requested} bytes: the size must be a multiple of {GROW_ALIGN_BYTES} and at most {MAX_GROW_BYTES}")]
    BadSize { requested: u64 },
    #[error("cannot grow from {size} to {requested} bytes: the write-intent or change-record region size would change (grow within 64 GiB, or within the power of two above it)")]
    Regions { size: u64, requested: u64 },
    #[error("{0}")]
    Busy(String),
    #[error("the chain cannot grow: {0}")]
    Chain(BdevError),
    #[error("write-intent record: {0}")]
    Intent(#[from] IntentError),
    #[error("metadata record: {0}")]
    Meta(#[from] MetaError),
    #[error("the replica is stopping")]
    ShuttingDown,
}

impl GrowError {
    pub fn errno(&self) -> i32 {
        match self {
            GrowError::Shrink { .. } | GrowError::BadSize { .. } | GrowError::Regions { .. } => {
                libc::EINVAL
            }
            GrowError::Busy(_) => libc::EBUSY,
            GrowError::Chain(BdevError::Unsupported(_)) => libc::EOPNOTSUPP,
            GrowError::Chain(BdevError::TooLarge { .. }) => libc::EFBIG,
            GrowError::Chain(_) | GrowError::Intent(_) | GrowError::Meta(_) => libc::EIO,
            GrowError::ShuttingDown => libc::ESHUTDOWN,
        }
    }

    /// A refusal of what was asked (logged as a warning), as opposed to a
    /// failure of the replica.
    pub fn is_refusal(&self) -> bool {
        !matches!(
            self,
            GrowError::Chain(BdevError::Io(_) | BdevError::Failed(_))
                | GrowError::Intent(_)
                | GrowError::Meta(_)
                | GrowError::ShuttingDown
        )
    }
}

/// The checks of a GROW from `size` to `requested` bytes, before anything
/// changes. `Ok(false)`: the replica has that size already.
pub fn check_grow(size: u64, requested: u64) -> Result<bool, GrowError> {
    if requested < size {
        return Err(GrowError::Shrink { size, requested });
    }
    if requested == size {
        return Ok(false);
    }
    if !requested.is_multiple_of(GROW_ALIGN_BYTES) || requested > MAX_GROW_BYTES {
        return Err(GrowError::BadSize { requested });
    }
    if !grow_keeps_regions(size, requested) {
        return Err(GrowError::Regions { size, requested });
    }
    Ok(true)
}

impl Shared {
    /// Blocking: one GROW (module doc). Serialised with the snapshot
    /// operations (`Control`).
    pub(crate) fn grow(&self, requested: u64) -> Result<(), SnapshotError> {
        self.grow_durable(requested)?;
        // Outside the control lock: a store's record lock is taken before
        // a replica's control lock elsewhere (a delete closes the chain).
        if let Some(hook) = self.grown_hook.get() {
            if let Err(e) = hook() {
                tracing::error!(dir = %self.dir.display(), error = %e,
                    "the store's record still has the replica's old size (its own record has the new one, which the store takes when it opens it)");
            }
        }
        Ok(())
    }

    /// Blocking: the steps of a GROW (module doc) without the store's
    /// hook; `Ok(false)` when the replica had that size already. A store
    /// growing a replica no engine holds (`Store::grow`) calls this under
    /// its record lock and writes its record itself.
    pub(crate) fn grow_durable(&self, requested: u64) -> Result<bool, SnapshotError> {
        {
            let _one = self.control.enter()?;
            let size = self.size_bytes();
            if !check_grow(size, requested)? {
                return Ok(false);
            }
            self.chain.grow(requested).map_err(|e| match e {
                BdevError::InUse(why) => GrowError::Busy(why),
                e => GrowError::Chain(e),
            })?;
            self.intent.grow(requested)?;
            self.store_size(requested)?;
            self.regions
                .store(intent_regions(requested), Ordering::Release);
            self.size_bytes.store(requested, Ordering::Release);
            tracing::info!(dir = %self.dir.display(), replica = self.name.as_deref().unwrap_or(""),
                from = size, to = requested, "replica grown");
        }
        Ok(true)
    }

    /// Blocking: the metadata record with `size_bytes`.
    fn store_size(&self, size_bytes: u64) -> Result<(), GrowError> {
        let mut state = self.lock_meta();
        if state.sealed || self.conns.stopping() {
            return Err(GrowError::ShuttingDown);
        }
        let next = Meta {
            volume_size: size_bytes,
            ..state.meta
        };
        next.store(&self.dir)?;
        state.meta = next;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grow_checks() {
        assert!(matches!(
            check_grow(1 << 30, 1 << 29),
            Err(GrowError::Shrink { .. })
        ));
        assert!(matches!(check_grow(1 << 30, 1 << 30), Ok(false)));
        assert!(matches!(check_grow(1 << 30, 2 << 30), Ok(true)));
        assert!(matches!(
            check_grow(1 << 30, (1 << 30) + 512),
            Err(GrowError::BadSize { .. })
        ));
        assert!(matches!(
            check_grow(1 << 30, 128 << 30),
            Err(GrowError::Regions { .. })
        ));
        for e in [
            GrowError::Shrink {
                size: 2,
                requested: 1,
            },
            GrowError::Busy("merge".into()),
        ] {
            assert!(e.is_refusal() && e.errno() > 0);
        }
    }
}
