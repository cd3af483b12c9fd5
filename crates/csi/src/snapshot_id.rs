//! Snapshot ids: the source volume's id (its placement) and the lull
//! snapshot name, so that a snapshot is found again with nothing recorded
//! outside Kubernetes (the VolumeSnapshotContent's snapshot handle), as
//! volume ids are ([`crate::volume_id`]).
//!
//! ```text
//! CreateSnapshot "snapshot-7f3e..." of "pvc-1@node-a+node-b"
//!   -> lull snapshot "snapshot-7f3e..." on replica pvc-1 of node-a and node-b
//!   -> snapshot id "pvc-1@node-a+node-b/snapshot-7f3e..."
//! ```
//!
//! Each replica of the volume holds the snapshot under that name (the
//! engine takes it on every replica at once, or the controller on each
//! store while no engine runs).

use crate::volume_id::{hashed_name, looks_hashed, VolumeId};

/// The CSI spec's general size limit on a string field (spec "Size
/// Limits"): a snapshot id must fit.
pub const MAX_SNAPSHOT_ID_BYTES: usize = 128;

/// Longest CSI snapshot name kept as the lull snapshot name; longer ones
/// are hashed (34 bytes). external-snapshotter's names (`snapshot-` and
/// a UUID, 45 bytes) fit, and with a PV's volume id (`pvc-` and a UUID,
/// 40 bytes, and two node ids) the id stays within
/// [`MAX_SNAPSHOT_ID_BYTES`].
pub const MAX_SNAPSHOT_NAME_BYTES: usize = 48;

/// Prefix of the snapshots the controller takes itself to clone a volume
/// from a volume (`csi-clone.NEWVOLUME`): not CSI snapshots, so
/// ListSnapshots leaves them out, and a CSI name starting so is hashed.
pub const CLONE_SNAPSHOT_PREFIX: &str = "csi-clone.";

/// Separates the volume id from the snapshot name: in neither.
const SEPARATOR: char = '/';

/// A snapshot: its source volume and its lull name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotId {
    pub volume: VolumeId,
    pub name: String,
}

impl SnapshotId {
    /// Parses an id; `None` for anything this plugin did not write.
    pub fn parse(id: &str) -> Option<SnapshotId> {
        if id.len() > MAX_SNAPSHOT_ID_BYTES {
            return None;
        }
        let (volume, name) = id.rsplit_once(SEPARATOR)?;
        if !valid_snapshot_name(name) {
            return None;
        }
        Some(SnapshotId {
            volume: VolumeId::parse(volume)?,
            name: name.to_string(),
        })
    }

    /// The id's text (it may exceed [`MAX_SNAPSHOT_ID_BYTES`]: the caller
    /// checks, see [`SnapshotId::fits`]).
    pub fn format(&self) -> String {
        format!("{}{SEPARATOR}{}", self.volume.format(), self.name)
    }

    /// Whether the id fits the CSI limit.
    pub fn fits(&self) -> bool {
        self.format().len() <= MAX_SNAPSHOT_ID_BYTES
    }
}

/// The lull snapshot name of a CSI snapshot name: the name itself when
/// it is a valid snapshot name of at most [`MAX_SNAPSHOT_NAME_BYTES`]
/// that cannot be taken for a hashed one or the controller's own; else
/// `h-` and 32 hex digits of its SHA-256.
pub fn lull_snapshot_name(csi_name: &str) -> String {
    if valid_snapshot_name(csi_name)
        && csi_name.len() <= MAX_SNAPSHOT_NAME_BYTES
        && !looks_hashed(csi_name)
        && !csi_name.starts_with(CLONE_SNAPSHOT_PREFIX)
    {
        return csi_name.to_string();
    }
    hashed_name(csi_name)
}

/// The snapshot the controller takes of a source volume to clone it into
/// volume `clone` (lull name).
pub fn clone_snapshot_name(clone: &str) -> String {
    format!("{CLONE_SNAPSHOT_PREFIX}{clone}")
}

/// A snapshot name the replicas take (`lull_bdev::chain`'s rule: letters,
/// digits, `-`, `_`, `.`, `:`, not starting with `.`), within the id's
/// room.
pub fn valid_snapshot_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes[0] != b'.'
        && name.len() <= MAX_SNAPSHOT_ID_BYTES
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume_id::HASH_PREFIX;

    #[test]
    fn ids_round_trip() {
        let id = SnapshotId {
            volume: VolumeId {
                name: "pvc-1".into(),
                nodes: vec!["a".into(), "b".into()],
            },
            name: "snap-1".into(),
        };
        assert_eq!(id.format(), "pvc-1@a+b/snap-1");
        assert_eq!(SnapshotId::parse("pvc-1@a+b/snap-1"), Some(id));
    }

    #[test]
    fn foreign_ids_do_not_parse() {
        for bad in [
            "non-existing-snapshot-id",
            "",
            "pvc-1@a+b",
            "pvc-1@a+b/",
            "pvc-1@a+b/.x",
            "pvc-1@a+b/x/y",
            "pvc-1/x",
            &format!("pvc-1@a/{}", "x".repeat(MAX_SNAPSHOT_ID_BYTES)),
        ] {
            assert_eq!(SnapshotId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn names_are_kept_or_hashed() {
        assert_eq!(lull_snapshot_name("snap-1"), "snap-1");
        let long = "s".repeat(MAX_SNAPSHOT_NAME_BYTES + 1);
        let hashed = lull_snapshot_name(&long);
        assert!(looks_hashed(&hashed));
        assert_eq!(hashed, lull_snapshot_name(&long));
        assert_ne!(lull_snapshot_name(&hashed), hashed);
        assert!(lull_snapshot_name("a b").starts_with(HASH_PREFIX));
        let own = clone_snapshot_name("pvc-2");
        assert!(lull_snapshot_name(&own).starts_with(HASH_PREFIX));
        // A PV's id and an external-snapshotter name fit.
        let id = SnapshotId {
            volume: VolumeId {
                name: format!("pvc-{}", "0".repeat(36)),
                nodes: vec!["node-a".into(), "node-b".into(), "node-c".into()],
            },
            name: lull_snapshot_name(&format!("snapshot-{}", "0".repeat(36))),
        };
        assert!(id.fits(), "{}", id.format());
        assert_eq!(SnapshotId::parse(&id.format()), Some(id));
    }
}
