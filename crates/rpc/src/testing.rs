//! Stand-ins for the control plane and the metrics source, for tests of
//! this crate and of the binary's wiring.
//!
//! ```ignore
//! let volumes = Arc::new(Volumes::default());
//! let control = Arc::new(FakeControl::new(volumes.clone()));
//! register_lull_methods(&mut reg, LullContext { fw, volumes, control })?;
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use lull_volume::{Storage, Volume, Volumes};
use serde_json::{json, Value};

use crate::methods::{
    ControlError, ControlPlane, NewVolume, Options, OptionsChange, ReplicaAddr, ReplicaVolume,
    VolumeInfo, VolumeName, VolumeResize,
};
use crate::metrics::{MetricsSnapshot, MetricsSource};

#[derive(Debug)]
struct State {
    options: Options,
    replicas: BTreeMap<String, Vec<String>>,
}

/// A control plane that keeps options and replicas in memory and creates
/// `malloc` volumes in a `Volumes` registry.
#[derive(Debug)]
pub struct FakeControl {
    volumes: Arc<Volumes>,
    state: Mutex<State>,
}

impl FakeControl {
    /// Starts in interrupt mode with Longhorn's default periods.
    pub fn new(volumes: Arc<Volumes>) -> FakeControl {
        FakeControl {
            volumes,
            state: Mutex::new(State {
                options: Options {
                    mode: "interrupt".into(),
                    nvme_ioq_poll_period_us: 100,
                    nvme_adminq_poll_period_us: 10_000,
                    interrupt_mode_enabled: true,
                },
                replicas: BTreeMap::new(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn has_volume(&self, name: &str) -> Result<(), ControlError> {
        self.volumes.named(name)?;
        Ok(())
    }
}

impl ControlPlane for FakeControl {
    fn get_options(&self) -> Options {
        self.state().options.clone()
    }

    fn set_options(&self, change: &OptionsChange) -> Result<Options, ControlError> {
        let mut s = self.state();
        if let Some(m) = &change.mode {
            if m != "poll" && m != "interrupt" {
                return Err(ControlError::Refused(format!("unknown mode {m:?}")));
            }
            s.options.mode = m.clone();
            s.options.interrupt_mode_enabled = m == "interrupt";
        }
        if let Some(us) = change.nvme_ioq_poll_period_us {
            s.options.nvme_ioq_poll_period_us = us;
        }
        if let Some(us) = change.nvme_adminq_poll_period_us {
            s.options.nvme_adminq_poll_period_us = us;
        }
        Ok(s.options.clone())
    }

    fn volume_create(&self, volume: &NewVolume) -> Result<VolumeInfo, ControlError> {
        if volume.backend != "malloc" {
            return Err(ControlError::Refused(format!(
                "unsupported backend {:?}",
                volume.backend
            )));
        }
        let dev = lull_bdev::MallocDev::new(volume.size_bytes)
            .map_err(|e| ControlError::Failed(e.into()))?;
        let v = self
            .volumes
            .add(Volume::new(&volume.name, Storage::Local(Arc::new(dev))))?;
        Ok(VolumeInfo::of(&v))
    }

    fn volume_resize(&self, r: &VolumeResize) -> Result<VolumeInfo, ControlError> {
        let v = self.volumes.resize(&r.name, r.size_bytes)?;
        Ok(VolumeInfo::of(&v))
    }

    fn volume_delete(&self, volume: &VolumeName) -> Result<(), ControlError> {
        self.volumes.remove(&volume.name)?;
        self.state().replicas.remove(&volume.name);
        Ok(())
    }

    fn volume_stats(&self, volume: &VolumeName) -> Result<Value, ControlError> {
        self.has_volume(&volume.name)?;
        Ok(
            json!({"name": volume.name, "reads": 0, "writes": 0, "read_bytes": 0, "write_bytes": 0,
                  "latency_ns": {"count": 0, "mean": 0, "p99": 0}}),
        )
    }

    fn replica_list(&self, volume: &ReplicaVolume) -> Result<Value, ControlError> {
        self.has_volume(&volume.volume)?;
        let s = self.state();
        let list = s.replicas.get(&volume.volume).cloned().unwrap_or_default();
        Ok(Value::Array(
            list.into_iter()
                .map(|a| json!({"addr": a, "healthy": true}))
                .collect(),
        ))
    }

    fn replica_add(&self, r: &ReplicaAddr) -> Result<(), ControlError> {
        self.has_volume(&r.volume)?;
        let mut s = self.state();
        let list = s.replicas.entry(r.volume.clone()).or_default();
        if list.contains(&r.addr) {
            return Err(ControlError::DuplicateReplica {
                volume: r.volume.clone(),
                addr: r.addr.clone(),
            });
        }
        list.push(r.addr.clone());
        Ok(())
    }

    fn replica_remove(&self, r: &ReplicaAddr) -> Result<(), ControlError> {
        self.has_volume(&r.volume)?;
        let mut s = self.state();
        let list = s.replicas.entry(r.volume.clone()).or_default();
        let Some(pos) = list.iter().position(|a| *a == r.addr) else {
            return Err(ControlError::NoSuchReplica {
                volume: r.volume.clone(),
                addr: r.addr.clone(),
            });
        };
        list.remove(pos);
        Ok(())
    }
}

/// A metrics source returning a fixed snapshot (replaceable).
#[derive(Debug, Default)]
pub struct FakeSource {
    snapshot: Mutex<MetricsSnapshot>,
}

impl FakeSource {
    pub fn new(snapshot: MetricsSnapshot) -> FakeSource {
        FakeSource {
            snapshot: Mutex::new(snapshot),
        }
    }

    pub fn set(&self, snapshot: MetricsSnapshot) {
        *self.snapshot.lock().unwrap_or_else(|p| p.into_inner()) = snapshot;
    }
}

impl MetricsSource for FakeSource {
    fn snapshot(&self) -> MetricsSnapshot {
        self.snapshot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
