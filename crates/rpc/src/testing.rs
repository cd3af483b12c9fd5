//! Stand-ins for the engine and the metrics source, for tests of this crate
//! and of the binary's wiring.
//!
//! ```ignore
//! let volumes = Arc::new(Volumes::default());
//! let engine = Arc::new(FakeEngine::new(volumes.clone()));
//! register_lull_methods(&mut reg, LullContext { fw, volumes, engine })?;
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use crate::methods::EngineControl;
use crate::metrics::{MetricsSnapshot, MetricsSource};

#[derive(Debug)]
struct State {
    mode: String,
    ioq_poll_period_us: u64,
    adminq_poll_period_us: u64,
    replicas: BTreeMap<String, Vec<String>>,
}

/// An engine that keeps options and replicas in memory and creates `malloc`
/// volumes in a `Volumes` registry.
#[derive(Debug)]
pub struct FakeEngine {
    volumes: Arc<lull_volume::Volumes>,
    state: Mutex<State>,
}

impl FakeEngine {
    /// Starts in interrupt mode with Longhorn's default periods.
    pub fn new(volumes: Arc<lull_volume::Volumes>) -> FakeEngine {
        FakeEngine {
            volumes,
            state: Mutex::new(State {
                mode: "interrupt".into(),
                ioq_poll_period_us: 100,
                adminq_poll_period_us: 10_000,
                replicas: BTreeMap::new(),
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn options(s: &State) -> Value {
        json!({
            "mode": s.mode,
            "nvme_ioq_poll_period_us": s.ioq_poll_period_us,
            "nvme_adminq_poll_period_us": s.adminq_poll_period_us,
            "interrupt_mode_enabled": s.mode == "interrupt",
        })
    }

    fn has_volume(&self, name: &str) -> Result<(), String> {
        if name.is_empty() || self.volumes.get(name).is_none() {
            return Err(format!("no volume {name:?}"));
        }
        Ok(())
    }
}

impl EngineControl for FakeEngine {
    fn get_options(&self) -> Value {
        Self::options(&self.state())
    }

    fn set_options(&self, params: &Value) -> Result<Value, String> {
        let mut s = self.state();
        if let Some(m) = params.get("mode").and_then(Value::as_str) {
            if m != "poll" && m != "interrupt" {
                return Err(format!("unknown mode {m:?}"));
            }
            s.mode = m.into();
        }
        if let Some(us) = params
            .get("nvme_ioq_poll_period_us")
            .and_then(Value::as_u64)
        {
            s.ioq_poll_period_us = us;
        }
        if let Some(us) = params
            .get("nvme_adminq_poll_period_us")
            .and_then(Value::as_u64)
        {
            s.adminq_poll_period_us = us;
        }
        Ok(Self::options(&s))
    }

    fn volume_create(&self, name: &str, size_bytes: u64, backend: &str) -> Result<Value, String> {
        if backend != "malloc" {
            return Err(format!("unsupported backend {backend:?}"));
        }
        let dev = lull_bdev::MallocDev::new(size_bytes).map_err(|e| e.to_string())?;
        self.volumes
            .add(lull_volume::Volume::new(
                name,
                lull_volume::Storage::Local(Arc::new(dev)),
            ))
            .map_err(|e| e.to_string())?;
        Ok(json!({"name": name, "size_bytes": size_bytes, "backend": backend}))
    }

    fn volume_delete(&self, name: &str) -> Result<(), String> {
        self.volumes.remove(name).map_err(|e| e.to_string())?;
        self.state().replicas.remove(name);
        Ok(())
    }

    fn volume_stats(&self, name: &str) -> Result<Value, String> {
        self.has_volume(name)?;
        Ok(
            json!({"name": name, "reads": 0, "writes": 0, "read_bytes": 0, "write_bytes": 0,
                  "latency_ns": {"count": 0, "mean": 0, "p99": 0}}),
        )
    }

    fn replica_list(&self, volume: &str) -> Result<Value, String> {
        self.has_volume(volume)?;
        let s = self.state();
        let list = s.replicas.get(volume).cloned().unwrap_or_default();
        Ok(Value::Array(
            list.into_iter()
                .map(|a| json!({"addr": a, "healthy": true}))
                .collect(),
        ))
    }

    fn replica_add(&self, volume: &str, addr: &str) -> Result<(), String> {
        self.has_volume(volume)?;
        let mut s = self.state();
        let list = s.replicas.entry(volume.to_string()).or_default();
        if list.iter().any(|a| a == addr) {
            return Err(format!("replica {addr} is already in {volume}"));
        }
        list.push(addr.to_string());
        Ok(())
    }

    fn replica_remove(&self, volume: &str, addr: &str) -> Result<(), String> {
        self.has_volume(volume)?;
        let mut s = self.state();
        let list = s.replicas.entry(volume.to_string()).or_default();
        let Some(pos) = list.iter().position(|a| a == addr) else {
            return Err(format!("no replica {addr} in {volume}"));
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
