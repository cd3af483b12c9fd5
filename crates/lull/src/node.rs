//! Node state: the volumes created over RPC on a daemon with a store
//! (`lull serve --store DIR`), kept in `DIR/volumes.json` and restored at
//! start, so a node comes back with every engine it held. Volumes from
//! `--volume` flags and the config file are the operator's and are not
//! written here; a name declared both ways is an error at start.
//!
//! ```json
//! {"format_version": 1, "volumes": [
//!   {"name": "pvc-1", "size_bytes": 1073741824,
//!    "backend": "replicas=10.0.0.7:10900/pvc-1.r0+10.0.0.8:10900/pvc-1.r1",
//!    "nvmf_nqn": null, "nvmf_lba": null, "nvmf_allow_hosts": []}]}
//! ```
//!
//! The node's own rebuild limits (`node_set_rebuild_limit`, and
//! `volume_set_rebuild_limit` without a name) are kept beside the volumes
//! as `"limits": {"rebuild_mbytes_per_sec", "volume_rebuild_mbytes_per_sec"}`.
//!
//! Every change (create, delete, resize, a replica added or removed) writes
//! the whole record atomically (`lull_replica::durable`: temporary file,
//! fsync, rename, directory fsync) before the RPC answers; a change whose
//! record cannot be written is undone and reported. A record that does not
//! parse stops the daemon, naming the file and the byte.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use lull_replica::durable::{self, RecordError};
use serde::{Deserialize, Serialize};

/// File name of the record inside the store directory.
pub const VOLUMES_FILE: &str = "volumes.json";
/// Version of the record's layout; another is refused, not guessed at.
pub const VOLUMES_FORMAT_VERSION: u32 = 1;
/// Largest record read. A volume's entry is under 6 KiB even with the
/// longest backend (4 KiB path) and 256 allowed hosts of 223 bytes would
/// be 57 KiB; 64 MiB holds a thousand such volumes and is still read in a
/// blink.
pub const VOLUMES_RECORD_MAX_BYTES: u64 = 64 << 20;

/// One volume as it is recreated at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeEntry {
    pub name: String,
    pub size_bytes: u64,
    /// As `--volume`'s BACKEND: `malloc`, `file=...`, `replicas=...`.
    pub backend: String,
    #[serde(default)]
    pub nvmf_nqn: Option<String>,
    #[serde(default)]
    pub nvmf_lba: Option<u32>,
    #[serde(default)]
    pub nvmf_allow_hosts: Vec<String>,
    /// `volume_set_qos` limits; `None`: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qos: Option<lull_volume::QosLimits>,
    /// `volume_set_rebuild_limit` of this volume, MB/s; `None`: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild_mbytes_per_sec: Option<u64>,
    /// `VOLUME@SNAPSHOT` this volume is a clone of, until it is
    /// flattened: names it when that snapshot's delete is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone_of: Option<String>,
    /// A resumed engine's session (`volume_create`'s `resume`): at a
    /// restart the engine comes back with it, so the replicas refuse it
    /// if another engine took the volume over meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<u64>,
}

/// The node's own rebuild limits, MB/s; `None`: none set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeLimits {
    /// `node_set_rebuild_limit`: the total of every copy on the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild_mbytes_per_sec: Option<u64>,
    /// `volume_set_rebuild_limit` without a name: every replicated
    /// volume's own limit, those created later included.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_rebuild_mbytes_per_sec: Option<u64>,
}

impl NodeLimits {
    fn is_empty(&self) -> bool {
        *self == NodeLimits::default()
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct VolumesRecord {
    format_version: u32,
    volumes: Vec<VolumeEntry>,
    #[serde(default, skip_serializing_if = "NodeLimits::is_empty")]
    limits: NodeLimits,
}

/// The record and what it holds now.
#[derive(Debug)]
pub struct NodeState {
    path: PathBuf,
    volumes: Mutex<BTreeMap<String, VolumeEntry>>,
    /// Written under the `volumes` lock, with the volumes.
    limits: Mutex<NodeLimits>,
}

impl NodeState {
    /// Reads `dir/volumes.json` (none yet: no volumes). A record that cannot
    /// be read, of another version, or naming a volume twice is an error
    /// that names the file.
    pub fn load(dir: &Path) -> Result<NodeState, String> {
        let path = dir.join(VOLUMES_FILE);
        let record: Option<VolumesRecord> = durable::load_json(&path, VOLUMES_RECORD_MAX_BYTES)
            .map_err(|e| format!("node state: {e}"))?;
        let mut volumes = BTreeMap::new();
        let mut limits = NodeLimits::default();
        if let Some(r) = record {
            limits = r.limits;
            if r.format_version != VOLUMES_FORMAT_VERSION {
                return Err(format!(
                    "node state: {}: format version {}, this lull reads {VOLUMES_FORMAT_VERSION}",
                    path.display(),
                    r.format_version
                ));
            }
            for v in r.volumes {
                if let Some(old) = volumes.insert(v.name.clone(), v) {
                    return Err(format!(
                        "node state: {}: volume {:?} is listed twice",
                        path.display(),
                        old.name
                    ));
                }
            }
        }
        Ok(NodeState {
            path,
            volumes: Mutex::new(volumes),
            limits: Mutex::new(limits),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The volumes to recreate, by name.
    pub fn volumes(&self) -> Vec<VolumeEntry> {
        self.lock().values().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, VolumeEntry>> {
        self.volumes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `change` to the volumes and writes the record; when the
    /// write fails the volumes are left as they were. Blocking (fsyncs):
    /// from an RPC thread or at start, never a reactor.
    pub fn update(
        &self,
        change: impl FnOnce(&mut BTreeMap<String, VolumeEntry>),
    ) -> Result<(), RecordError> {
        let mut volumes = self.lock();
        let mut next = volumes.clone();
        change(&mut next);
        if next == *volumes {
            return Ok(());
        }
        let record = VolumesRecord {
            format_version: VOLUMES_FORMAT_VERSION,
            volumes: next.values().cloned().collect(),
            limits: self.limits(),
        };
        durable::store_json(&self.path, &record)?;
        *volumes = next;
        Ok(())
    }

    /// The node's rebuild limits as recorded.
    pub fn limits(&self) -> NodeLimits {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `change` to the node's limits and writes the record; when
    /// the write fails the limits are left as they were. Blocking, as
    /// [`NodeState::update`].
    pub fn update_limits(&self, change: impl FnOnce(&mut NodeLimits)) -> Result<(), RecordError> {
        let volumes = self.lock();
        let mut next = self.limits();
        change(&mut next);
        if next == self.limits() {
            return Ok(());
        }
        let record = VolumesRecord {
            format_version: VOLUMES_FORMAT_VERSION,
            volumes: volumes.values().cloned().collect(),
            limits: next,
        };
        durable::store_json(&self.path, &record)?;
        *self.limits.lock().unwrap_or_else(|p| p.into_inner()) = next;
        Ok(())
    }

    /// The QoS limits recorded for a volume.
    pub fn volume_qos(&self, name: &str) -> Option<lull_volume::QosLimits> {
        self.lock().get(name).and_then(|v| v.qos)
    }

    /// The rebuild limit recorded for a volume, MB/s.
    pub fn volume_rebuild_limit(&self, name: &str) -> Option<u64> {
        self.lock().get(name).and_then(|v| v.rebuild_mbytes_per_sec)
    }

    /// Whether `name` is a volume of the record.
    pub fn holds(&self, name: &str) -> bool {
        self.lock().contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survives_a_reload_and_refuses_a_corrupt_record() {
        let dir = std::env::temp_dir().join(format!("lull-node-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let state = NodeState::load(&dir).unwrap();
        assert!(state.volumes().is_empty());
        let v = VolumeEntry {
            name: "v1".into(),
            size_bytes: 1 << 30,
            backend: "replicas=127.0.0.1:10900/v1.r0".into(),
            nvmf_nqn: None,
            nvmf_lba: Some(4096),
            nvmf_allow_hosts: vec![],
            qos: Some(lull_volume::QosLimits {
                rw_ios_per_sec: 100,
                ..Default::default()
            }),
            rebuild_mbytes_per_sec: Some(50),
            clone_of: Some("v0@s1".into()),
            session: Some(0x1234),
        };
        state
            .update(|m| {
                m.insert(v.name.clone(), v.clone());
            })
            .unwrap();
        assert_eq!(NodeState::load(&dir).unwrap().volumes(), vec![v.clone()]);
        let limits = NodeLimits {
            rebuild_mbytes_per_sec: Some(200),
            volume_rebuild_mbytes_per_sec: Some(40),
        };
        state.update_limits(|l| *l = limits).unwrap();
        let back = NodeState::load(&dir).unwrap();
        assert_eq!((back.volumes(), back.limits()), (vec![v.clone()], limits));
        state
            .update_limits(|l| l.rebuild_mbytes_per_sec = None)
            .unwrap();
        assert_eq!(
            NodeState::load(&dir)
                .unwrap()
                .limits()
                .rebuild_mbytes_per_sec,
            None
        );
        state.update_limits(|l| *l = limits).unwrap();

        let text = std::fs::read_to_string(state.path()).unwrap();
        std::fs::write(state.path(), &text[..text.len() / 2]).unwrap();
        let e = NodeState::load(&dir).unwrap_err();
        assert!(e.contains("volumes.json: corrupt at byte"), "{e}");
        // The corrupt file is left for the operator, not replaced.
        assert_eq!(
            std::fs::read_to_string(state.path()).unwrap(),
            text[..text.len() / 2]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
