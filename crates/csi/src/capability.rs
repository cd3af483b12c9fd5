//! Which volume capabilities a lull volume serves: a single node's reader
//! or writer (one engine per volume: a second node staging it would be a
//! second engine, fenced by the replicas), as a raw block device or as an
//! ext4 or xfs filesystem.
//!
//! ```text
//! block,  SINGLE_NODE_WRITER        -> Access::Block
//! mount(""), SINGLE_NODE_READER_ONLY -> Access::Mount { fs_type: "ext4", .. }
//! mount("btrfs")                    -> refused: "filesystem btrfs: ext4 or xfs"
//! MULTI_NODE_MULTI_WRITER           -> refused: one engine per volume
//! ```

use crate::pb::volume_capability::access_mode::Mode;
use crate::pb::volume_capability::AccessType;
use crate::pb::VolumeCapability;

/// The filesystem made on first use when the capability names none.
pub const DEFAULT_FS_TYPE: &str = "ext4";

/// Filesystems the node makes and mounts.
pub const FS_TYPES: [&str; 2] = ["ext4", "xfs"];

/// Most mount flags taken from one capability: each becomes one mount
/// option, and a real StorageClass names a few.
pub const MAX_MOUNT_FLAGS: usize = 32;

/// How a volume is handed to its user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    Block,
    Mount { fs_type: String, flags: Vec<String> },
}

/// Checks one capability; the error says what is not served and why.
pub fn check(cap: &VolumeCapability) -> Result<(Access, bool), String> {
    let mode = cap
        .access_mode
        .as_ref()
        .ok_or("a volume capability without an access mode")?
        .mode;
    let read_only = match Mode::try_from(mode) {
        Ok(Mode::SingleNodeWriter) => false,
        Ok(Mode::SingleNodeReaderOnly) => true,
        Ok(other) => {
            return Err(format!(
                "access mode {}: a lull volume has one engine, on the one node that stages it (SINGLE_NODE_WRITER or SINGLE_NODE_READER_ONLY)",
                other.as_str_name()
            ))
        }
        Err(_) => return Err(format!("access mode {mode}: unknown")),
    };
    let access = match &cap.access_type {
        Some(AccessType::Block(_)) => Access::Block,
        Some(AccessType::Mount(m)) => {
            let fs_type = if m.fs_type.is_empty() {
                DEFAULT_FS_TYPE.to_string()
            } else {
                m.fs_type.clone()
            };
            if !FS_TYPES.contains(&fs_type.as_str()) {
                return Err(format!(
                    "filesystem {fs_type:?}: the node makes {}",
                    FS_TYPES.join(" or ")
                ));
            }
            if m.mount_flags.len() > MAX_MOUNT_FLAGS {
                return Err(format!("more than {MAX_MOUNT_FLAGS} mount flags"));
            }
            if let Some(bad) = m
                .mount_flags
                .iter()
                .find(|f| f.is_empty() || f.contains(',') || f.contains('\0'))
            {
                return Err(format!(
                    "mount flag {bad:?}: one option per flag, no commas"
                ));
            }
            if !m.volume_mount_group.is_empty() {
                return Err(
                    "volume_mount_group: not supported (no VOLUME_MOUNT_GROUP capability)".into(),
                );
            }
            Access::Mount {
                fs_type,
                flags: m.mount_flags.clone(),
            }
        }
        None => return Err("a volume capability without an access type (block or mount)".into()),
    };
    Ok((access, read_only))
}

/// Checks a request's capabilities: at least one, each served.
pub fn check_all(caps: &[VolumeCapability]) -> Result<(), String> {
    if caps.is_empty() {
        return Err("no volume capabilities".into());
    }
    caps.iter().try_for_each(|c| check(c).map(|_| ()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(mode: Mode, access: AccessType) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(access),
        }
    }

    fn mount(fs: &str, flags: &[&str]) -> AccessType {
        AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: flags.iter().map(|s| s.to_string()).collect(),
            volume_mount_group: String::new(),
        })
    }

    #[test]
    fn serves_single_node_block_and_filesystems() {
        let block = cap(Mode::SingleNodeWriter, AccessType::Block(BlockVolume {}));
        assert_eq!(check(&block).unwrap(), (Access::Block, false));
        let ro = cap(Mode::SingleNodeReaderOnly, mount("", &["noatime"]));
        assert_eq!(
            check(&ro).unwrap(),
            (
                Access::Mount {
                    fs_type: "ext4".into(),
                    flags: vec!["noatime".into()]
                },
                true
            )
        );
        assert!(check(&cap(Mode::SingleNodeWriter, mount("xfs", &[]))).is_ok());
    }

    #[test]
    fn refuses_what_it_cannot_do_with_the_reason() {
        let multi = cap(
            Mode::MultiNodeMultiWriter,
            AccessType::Block(BlockVolume {}),
        );
        assert!(check(&multi).unwrap_err().contains("one engine"));
        let btrfs = cap(Mode::SingleNodeWriter, mount("btrfs", &[]));
        assert!(check(&btrfs).unwrap_err().contains("ext4 or xfs"));
        let comma = cap(Mode::SingleNodeWriter, mount("", &["ro,exec"]));
        assert!(check(&comma).unwrap_err().contains("no commas"));
        let none = VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: None,
        };
        assert!(check(&none).is_err());
        assert!(check_all(&[]).is_err());
    }
}
