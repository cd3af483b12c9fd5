//! lull's RPC methods, named after SPDK's where one exists.
//!
//! ```ignore
//! let mut reg = MethodRegistry::new();
//! register_lull_methods(&mut reg, LullContext { fw: fw.handle().clone(), volumes, engine })?;
//! // lull rpc engine_set_options '{"data-engine-interrupt-mode-enabled": false}'
//! ```
//!
//! Parameters are validated here, at the edge, with `deny_unknown_fields`
//! structs (bad → -32602 naming the field); what the engine does with valid
//! ones is behind [`EngineControl`], which the binary implements.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::server::{no_params, parse_params, MethodRegistry, RpcMethodError};
use crate::RpcError;

/// Longest volume name accepted: the NBD export name limit (the name is the
/// export name).
pub const MAX_VOLUME_NAME_LEN: usize = 4096;

/// Longest replica address ("host:port"; a bracketed IPv6 address with a
/// zone is under 64 bytes, a DNS name under 254).
pub const MAX_REPLICA_ADDR_LEN: usize = 256;

/// Longest backend spec ("malloc", "file=PATH[,direct]"; PATH_MAX is 4096).
pub const MAX_BACKEND_LEN: usize = 4096 + 16;

/// Longest mode name; real ones are single words.
pub const MAX_MODE_NAME_LEN: usize = 32;

/// Largest poll period accepted. A queue polled less often than every 10 s
/// would let I/O sit near the NVMe default command timeout (30 s); nothing
/// useful is slower.
pub const MAX_POLL_PERIOD_US: u64 = 10_000_000;

/// Counters in these outputs are nanoseconds; SPDK reports ticks with the
/// tick rate beside them, so tools that divide by `tick_rate` get seconds.
pub const TICK_RATE_HZ: u64 = 1_000_000_000;

/// What the RPC layer asks of the engine. Errors are messages for the
/// operator; they become JSON-RPC -32603 errors.
pub trait EngineControl: Send + Sync {
    /// `{"mode": "...", "nvme_ioq_poll_period_us": 100,
    /// "nvme_adminq_poll_period_us": 10000, "interrupt_mode_enabled": bool}`
    fn get_options(&self) -> Value;
    /// Apply options. `params` is already validated and normalized: an object
    /// with any of `mode` (string), `nvme_ioq_poll_period_us` and
    /// `nvme_adminq_poll_period_us` (1..=`MAX_POLL_PERIOD_US`); Longhorn's
    /// aliases have been mapped onto these names. Returns the new options.
    fn set_options(&self, params: &Value) -> Result<Value, String>;
    fn volume_create(&self, name: &str, size_bytes: u64, backend: &str) -> Result<Value, String>;
    fn volume_delete(&self, name: &str) -> Result<(), String>;
    /// Ops, bytes, latency summary.
    fn volume_stats(&self, name: &str) -> Result<Value, String>;
    fn replica_list(&self, volume: &str) -> Result<Value, String>;
    fn replica_add(&self, volume: &str, addr: &str) -> Result<(), String>;
    fn replica_remove(&self, volume: &str, addr: &str) -> Result<(), String>;
}

/// What the lull methods act on.
#[derive(Clone)]
pub struct LullContext {
    pub fw: lull_reactor::FrameworkHandle,
    pub volumes: Arc<lull_volume::Volumes>,
    pub engine: Arc<dyn EngineControl>,
}

impl std::fmt::Debug for LullContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LullContext")
            .field("fw", &self.fw)
            .field("volumes", &self.volumes)
            .finish()
    }
}

/// The methods `register_lull_methods` adds.
pub const LULL_METHODS: &[&str] = &[
    "framework_get_reactors",
    "thread_get_stats",
    "engine_get_options",
    "engine_set_options",
    "volume_list",
    "volume_create",
    "volume_delete",
    "volume_get_stats",
    "replica_list",
    "replica_add",
    "replica_remove",
];

/// Register every lull method (see [`LULL_METHODS`]).
pub fn register_lull_methods(
    registry: &mut MethodRegistry,
    ctx: LullContext,
) -> Result<(), RpcError> {
    let c = ctx.clone();
    registry.register(
        "framework_get_reactors",
        Box::new(move |p| {
            no_params(p)?;
            Ok(framework_get_reactors(&c.fw))
        }),
    )?;
    let c = ctx.clone();
    registry.register(
        "thread_get_stats",
        Box::new(move |p| {
            no_params(p)?;
            Ok(thread_get_stats(&c.fw))
        }),
    )?;
    let c = ctx.clone();
    registry.register(
        "engine_get_options",
        Box::new(move |p| {
            no_params(p)?;
            Ok(c.engine.get_options())
        }),
    )?;
    let c = ctx.clone();
    registry.register(
        "engine_set_options",
        Box::new(move |p| {
            let normalized = normalize_options(parse_params(p)?)?;
            c.engine
                .set_options(&normalized)
                .map_err(RpcMethodError::Internal)
        }),
    )?;
    let c = ctx.clone();
    registry.register(
        "volume_list",
        Box::new(move |p| {
            no_params(p)?;
            let list: Vec<Value> = c
                .volumes
                .list()
                .iter()
                .map(|v| json!({"name": v.name, "size_bytes": v.dev().size_bytes(), "backend": v.dev().describe()}))
                .collect();
            Ok(Value::Array(list))
        }),
    )?;
    let c = ctx.clone();
    registry.register(
        "volume_create",
        Box::new(move |p| {
            let p: VolumeCreate = parse_params(p)?;
            check_name("name", &p.name, MAX_VOLUME_NAME_LEN)?;
            let backend = p.backend.as_deref().unwrap_or("malloc");
            check_name("backend", backend, MAX_BACKEND_LEN)?;
            let size_bytes = parse_size(&p.size).map_err(RpcMethodError::InvalidParams)?;
            c.engine
                .volume_create(&p.name, size_bytes, backend)
                .map_err(RpcMethodError::Internal)
        }),
    )?;
    let c = ctx.clone();
    registry.register(
        "volume_delete",
        Box::new(move |p| {
            let p: VolumeName = parse_params(p)?;
            check_name("name", &p.name, MAX_VOLUME_NAME_LEN)?;
            c.engine
                .volume_delete(&p.name)
                .map_err(RpcMethodError::Internal)?;
            Ok(Value::Bool(true))
        }),
    )?;
    let c = ctx.clone();
    registry.register(
        "volume_get_stats",
        Box::new(move |p| {
            let p: VolumeName = parse_params(p)?;
            check_name("name", &p.name, MAX_VOLUME_NAME_LEN)?;
            c.engine
                .volume_stats(&p.name)
                .map_err(RpcMethodError::Internal)
        }),
    )?;
    let c = ctx.clone();
    registry.register(
        "replica_list",
        Box::new(move |p| {
            let p: ReplicaVolume = parse_params(p)?;
            check_name("volume", &p.volume, MAX_VOLUME_NAME_LEN)?;
            c.engine
                .replica_list(&p.volume)
                .map_err(RpcMethodError::Internal)
        }),
    )?;
    let c = ctx.clone();
    registry.register(
        "replica_add",
        Box::new(move |p| {
            let p: ReplicaAddr = parse_params(p)?;
            p.check()?;
            c.engine
                .replica_add(&p.volume, &p.addr)
                .map_err(RpcMethodError::Internal)?;
            Ok(Value::Bool(true))
        }),
    )?;
    let c = ctx;
    registry.register(
        "replica_remove",
        Box::new(move |p| {
            let p: ReplicaAddr = parse_params(p)?;
            p.check()?;
            c.engine
                .replica_remove(&p.volume, &p.addr)
                .map_err(RpcMethodError::Internal)?;
            Ok(Value::Bool(true))
        }),
    )?;
    Ok(())
}

/// SPDK's `framework_get_reactors` shape (`lcore`, `busy`, `idle`,
/// `in_interrupt`, `lw_threads`), plus lull's own counters.
pub fn framework_get_reactors(fw: &lull_reactor::FrameworkHandle) -> Value {
    let threads = fw.thread_stats();
    let reactors: Vec<Value> = fw
        .reactor_stats()
        .iter()
        .map(|r| {
            let lw_threads: Vec<Value> = threads
                .iter()
                .filter(|t| t.reactor == r.index)
                .map(|t| json!({"name": t.name, "id": t.id, "elapsed": t.busy_ns + t.idle_ns}))
                .collect();
            json!({
                "index": r.index,
                "lcore": r.core,
                "core": r.core,
                "tid": r.tid,
                "mode": r.mode.as_str(),
                "in_interrupt": r.interrupt_mode_enabled(),
                "interrupt_mode_enabled": r.interrupt_mode_enabled(),
                "busy": r.busy_ns,
                "idle": r.idle_ns,
                "iterations": r.iterations,
                "wakeups": r.wakeups,
                "ioq_poll_period_us": r.ioq_poll_period_us,
                "spins_with_work": r.spins_with_work,
                "spins_idle": r.spins_idle,
                "spin_ns": r.spin_ns,
                "spin_ns_with_work": r.spin_ns_with_work,
                "spin_ns_idle": r.spin_ns_idle,
                "spin_window_ns": r.spin_window_ns,
                "wake_latency_ns": r.wake_latency_ns,
                "wake_cpu_ns": r.wake_cpu_ns,
                "ready_events": r.ready_events,
                "usr": r.user_ns,
                "sys": r.system_ns,
                "voluntary_ctxsw": r.voluntary_ctxsw,
                "involuntary_ctxsw": r.involuntary_ctxsw,
                "minor_faults": r.minor_faults,
                "major_faults": r.major_faults,
                "lw_threads": lw_threads,
            })
        })
        .collect();
    json!({"tick_rate": TICK_RATE_HZ, "pid": std::process::id(), "reactors": reactors})
}

/// SPDK's `thread_get_stats` shape, plus the reactor and lull's counters.
pub fn thread_get_stats(fw: &lull_reactor::FrameworkHandle) -> Value {
    let threads: Vec<Value> = fw
        .thread_stats()
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "id": t.id,
                "reactor": t.reactor,
                "busy": t.busy_ns,
                "idle": t.idle_ns,
                "iterations": t.iterations,
                "wakeups": t.wakeups,
                "messages": t.messages,
                "active_pollers_count": t.pollers_active,
                "timed_pollers_count": t.pollers_timed,
                "paused_pollers_count": t.pollers_paused,
                // Event sources: a poll group's connections.
                "sources": t.pollers_active,
                "ready_events": t.ready_events,
            })
        })
        .collect();
    json!({"tick_rate": TICK_RATE_HZ, "threads": threads})
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VolumeCreate {
    name: String,
    /// Bytes, or a string with a binary suffix ("1G").
    size: Value,
    backend: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VolumeName {
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplicaVolume {
    volume: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReplicaAddr {
    volume: String,
    addr: String,
}

impl ReplicaAddr {
    fn check(&self) -> Result<(), RpcMethodError> {
        check_name("volume", &self.volume, MAX_VOLUME_NAME_LEN)?;
        check_name("addr", &self.addr, MAX_REPLICA_ADDR_LEN)
    }
}

fn check_name(field: &str, value: &str, max: usize) -> Result<(), RpcMethodError> {
    if value.is_empty() || value.len() > max || value.contains('\0') {
        return Err(RpcMethodError::InvalidParams(format!(
            "{field} must be 1 to {max} bytes, without NUL"
        )));
    }
    Ok(())
}

/// `engine_set_options` parameters: lull's names and Longhorn's aliases.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct SetOptions {
    mode: Option<String>,
    /// Longhorn's `data-engine-interrupt-mode-enabled`: true = interrupt,
    /// false = poll.
    #[serde(
        rename = "data-engine-interrupt-mode-enabled",
        alias = "interrupt_mode_enabled"
    )]
    interrupt_mode_enabled: Option<bool>,
    /// Longhorn's `data-engine-nvme-ioq-poll-period-us`.
    #[serde(rename = "data-engine-nvme-ioq-poll-period-us")]
    longhorn_ioq_poll_period_us: Option<u64>,
    nvme_ioq_poll_period_us: Option<u64>,
    nvme_adminq_poll_period_us: Option<u64>,
}

/// Check `engine_set_options` parameters and map them onto lull's names.
fn normalize_options(o: SetOptions) -> Result<Value, RpcMethodError> {
    let bad = |m: String| Err(RpcMethodError::InvalidParams(m));
    let mut out = Map::new();
    let implied = o
        .interrupt_mode_enabled
        .map(|on| if on { "interrupt" } else { "poll" });
    match (o.mode, implied) {
        (Some(m), Some(i)) if m != i => {
            return bad(format!(
                "mode {m:?} contradicts data-engine-interrupt-mode-enabled={}; give one of them",
                i == "interrupt"
            ))
        }
        (Some(m), _) => {
            let ok = !m.is_empty()
                && m.len() <= MAX_MODE_NAME_LEN
                && m.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                });
            if !ok {
                return bad(format!(
                    "mode must be a mode name such as \"poll\" or \"interrupt\", got {m:?}"
                ));
            }
            out.insert("mode".into(), Value::String(m));
        }
        (None, Some(i)) => {
            out.insert("mode".into(), Value::String(i.into()));
        }
        (None, None) => {}
    }
    let ioq = match (o.nvme_ioq_poll_period_us, o.longhorn_ioq_poll_period_us) {
        (Some(a), Some(b)) if a != b => {
            return bad(format!(
                "nvme_ioq_poll_period_us={a} contradicts data-engine-nvme-ioq-poll-period-us={b}; give one of them"
            ))
        }
        (a, b) => a.or(b),
    };
    for (name, v) in [
        ("nvme_ioq_poll_period_us", ioq),
        ("nvme_adminq_poll_period_us", o.nvme_adminq_poll_period_us),
    ] {
        if let Some(us) = v {
            if !(1..=MAX_POLL_PERIOD_US).contains(&us) {
                return bad(format!(
                    "{name} must be 1 to {MAX_POLL_PERIOD_US}, got {us}"
                ));
            }
            out.insert(name.into(), json!(us));
        }
    }
    if out.is_empty() {
        return bad(
            "no options given (mode, nvme_ioq_poll_period_us, nvme_adminq_poll_period_us, \
                    data-engine-interrupt-mode-enabled, data-engine-nvme-ioq-poll-period-us)"
                .into(),
        );
    }
    Ok(Value::Object(out))
}

/// A size in bytes: a positive integer, or a string of digits with an
/// optional binary suffix K, M, G or T (also KiB, KB, ... ; any case), as
/// `lull_bdev::parse_size_bytes` accepts.
pub fn parse_size(v: &Value) -> Result<u64, String> {
    let bytes = match v {
        Value::Number(n) => n
            .as_u64()
            .ok_or_else(|| format!("size must be a positive integer, got {n}"))?,
        Value::String(s) => lull_bdev::parse_size_bytes(s)?,
        other => {
            return Err(format!(
                "size must be a number of bytes or a string such as \"1G\", got {other}"
            ))
        }
    };
    if bytes == 0 {
        return Err("size must be greater than 0".into());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size(&json!(4096)), Ok(4096));
        assert_eq!(parse_size(&json!("1G")), Ok(1 << 30));
        assert_eq!(parse_size(&json!("64MiB")), Ok(64 << 20));
        assert_eq!(parse_size(&json!("512")), Ok(512));
        assert_eq!(parse_size(&json!(" 2k ")), Ok(2048));
        for bad in [
            json!(0),
            json!(-1),
            json!(1.5),
            json!("0G"),
            json!("G"),
            json!("1X"),
            json!("99999999P"),
            json!(null),
            json!([1]),
        ] {
            assert!(parse_size(&bad).is_err(), "{bad}");
        }
    }

    fn norm(v: Value) -> Result<Value, RpcMethodError> {
        normalize_options(
            serde_json::from_value(v).map_err(|e| RpcMethodError::InvalidParams(e.to_string()))?,
        )
    }

    #[test]
    fn options() {
        assert_eq!(
            norm(json!({"data-engine-interrupt-mode-enabled": false})),
            Ok(json!({"mode": "poll"}))
        );
        assert_eq!(
            norm(json!({"interrupt_mode_enabled": true})),
            Ok(json!({"mode": "interrupt"}))
        );
        assert_eq!(
            norm(
                json!({"data-engine-nvme-ioq-poll-period-us": 50, "nvme_adminq_poll_period_us": 1000})
            ),
            Ok(json!({"nvme_ioq_poll_period_us": 50, "nvme_adminq_poll_period_us": 1000}))
        );
        assert_eq!(
            norm(json!({"mode": "interrupt", "interrupt_mode_enabled": true})),
            Ok(json!({"mode": "interrupt"}))
        );
        for bad in [
            json!({}),
            json!({"mode": "poll", "data-engine-interrupt-mode-enabled": true}),
            json!({"nvme_ioq_poll_period_us": 0}),
            json!({"nvme_ioq_poll_period_us": 20_000_000}),
            json!({"nvme_ioq_poll_period_us": 10, "data-engine-nvme-ioq-poll-period-us": 20}),
            json!({"mode": "Poll Mode"}),
            json!({"mode": ""}),
        ] {
            assert!(
                matches!(norm(bad.clone()), Err(RpcMethodError::InvalidParams(_))),
                "{bad}"
            );
        }
        assert!(norm(json!({"frobnicate": 1})).is_err());
        assert!(norm(json!({"nvme_ioq_poll_period_us": "100"})).is_err());
    }
}
