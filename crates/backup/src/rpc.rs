//! The backup methods of the JSON-RPC server (`lull rpc backup_...`,
//! `lull backup ...`). Parameters are checked here, at the edge.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lull_rpc::{ControlError, MethodRegistry, RpcError};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::target::TargetConfig;
use crate::{format, job, BackupError, Backups};

/// The methods [`register_backup_methods`] adds.
pub const BACKUP_METHODS: &[&str] = &[
    "backup_target_add",
    "backup_target_list",
    "backup_target_remove",
    "backup_create",
    "backup_list",
    "backup_get",
    "backup_delete",
    "backup_gc",
    "backup_verify",
    "backup_restore",
    "backup_job_list",
    "backup_job_get",
    "backup_expose",
    "backup_unexpose",
    "backup_schedule_set",
    "backup_schedule_list",
    "backup_schedule_remove",
    "backup_standby_create",
    "backup_standby_list",
    "backup_standby_activate",
];

/// Longest a `"wait": true` call holds its RPC connection (the client
/// must wait as long: `lull rpc --timeout 3600`); past it the call
/// returns the job as it stands, still running.
pub const MAX_WAIT: Duration = Duration::from_secs(3600);

/// Longest path parameter (PATH_MAX).
const MAX_PATH_LEN: usize = 4096;

fn check_path(field: &str, p: &Option<PathBuf>) -> Result<(), ControlError> {
    match p {
        Some(p) if p.as_os_str().len() > MAX_PATH_LEN || !p.is_absolute() => {
            Err(ControlError::InvalidParams(format!(
                "{field}: an absolute path of at most {MAX_PATH_LEN} bytes"
            )))
        }
        _ => Ok(()),
    }
}

fn check_id(id: &str) -> Result<(), ControlError> {
    if format::valid_backup_id(id) {
        Ok(())
    } else {
        Err(ControlError::InvalidParams(format!(
            "backup id {id:?}: bk-<13 digits>-<8 hex digits> expected"
        )))
    }
}

fn check_volume(field: &str, name: &str) -> Result<(), ControlError> {
    if name.is_empty() || name.len() > lull_volume::MAX_VOLUME_NAME_LEN || name.contains('\0') {
        return Err(ControlError::InvalidParams(format!(
            "{field}: 1 to 4096 bytes, no NUL"
        )));
    }
    Ok(())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TargetAdd {
    name: String,
    url: String,
    credentials_file: Option<PathBuf>,
    ca_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Name {
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoParams {}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Create {
    volume: String,
    target: String,
    snapshot: Option<String>,
    #[serde(default)]
    bandwidth_mbytes_per_sec: u64,
    #[serde(default)]
    wait: bool,
    /// `volume` is a replica of the store (see `BackupRequest::replica`).
    #[serde(default)]
    replica: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct List {
    target: String,
    volume: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct One {
    target: String,
    id: String,
    #[serde(default)]
    wait: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Delete {
    target: String,
    id: String,
    #[serde(default = "yes")]
    gc: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Target {
    target: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Restore {
    target: String,
    backup: String,
    name: String,
    #[serde(default = "malloc")]
    backend: String,
    #[serde(default = "yes")]
    persist: bool,
    #[serde(default)]
    wait: bool,
    /// `name` is a new replica of the store, filled in place (see
    /// `RestoreRequest::replica`).
    #[serde(default)]
    replica: bool,
}

fn malloc() -> String {
    "malloc".into()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JobId {
    id: String,
    #[serde(default)]
    wait: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Expose {
    target: String,
    backup: String,
    name: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScheduleSet {
    volume: String,
    target: String,
    interval_secs: u64,
    keep_last: Option<u64>,
    keep_within_secs: Option<u64>,
    #[serde(default)]
    bandwidth_mbytes_per_sec: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScheduleKey {
    volume: String,
    target: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StandbyCreate {
    name: String,
    target: String,
    volume: String,
    #[serde(default = "malloc")]
    backend: String,
    poll_secs: Option<u64>,
}

fn method<P, F>(registry: &mut MethodRegistry, name: &str, f: F) -> Result<(), RpcError>
where
    P: serde::de::DeserializeOwned,
    F: Fn(P) -> Result<Value, ControlError> + Send + Sync + 'static,
{
    registry.register(name, Box::new(move |p| Ok(f(lull_rpc::parse_params(p)?)?)))
}

fn job_json(b: &Backups, j: job::JobInfo, wait: bool) -> Value {
    let j = if wait {
        b.wait_job(&j.id, MAX_WAIT).unwrap_or(j)
    } else {
        j
    };
    json!(j)
}

/// Registers the backup methods ([`BACKUP_METHODS`]).
pub fn register_backup_methods(
    registry: &mut MethodRegistry,
    b: Arc<Backups>,
) -> Result<(), RpcError> {
    let c = b.clone();
    method(registry, "backup_target_add", move |p: TargetAdd| {
        for (f, v) in [
            ("credentials_file", &p.credentials_file),
            ("ca_file", &p.ca_file),
            ("key_file", &p.key_file),
        ] {
            check_path(f, v)?;
        }
        c.target_add(TargetConfig {
            name: p.name,
            url: p.url,
            credentials_file: p.credentials_file,
            ca_file: p.ca_file,
            key_file: p.key_file,
        })?;
        Ok(Value::Null)
    })?;
    let c = b.clone();
    method(registry, "backup_target_list", move |NoParams {}| {
        Ok(json!(c.target_list()))
    })?;
    let c = b.clone();
    method(registry, "backup_target_remove", move |p: Name| {
        c.target_remove(&p.name)?;
        Ok(Value::Null)
    })?;
    let c = b.clone();
    method(registry, "backup_create", move |p: Create| {
        check_volume("volume", &p.volume)?;
        let j = c.create(job::BackupRequest {
            volume: p.volume,
            target: p.target,
            snapshot: p.snapshot,
            bandwidth_mbytes_per_sec: p.bandwidth_mbytes_per_sec,
            schedule: None,
            replica: p.replica,
        })?;
        let id = j.backup.clone();
        Ok(json!({"id": id, "job": job_json(&c, j, p.wait)}))
    })?;
    let c = b.clone();
    method(registry, "backup_list", move |p: List| {
        let list = c.list(&p.target, p.volume.as_deref())?;
        Ok(Value::Array(list.iter().map(job::summary).collect()))
    })?;
    let c = b.clone();
    method(registry, "backup_get", move |p: One| {
        check_id(&p.id)?;
        Ok(job::summary(&c.get(&p.target, &p.id)?))
    })?;
    let c = b.clone();
    method(registry, "backup_delete", move |p: Delete| {
        check_id(&p.id)?;
        let gc = c.delete(&p.target, &p.id, p.gc)?;
        Ok(json!({"deleted": p.id, "gc": gc}))
    })?;
    let c = b.clone();
    method(registry, "backup_gc", move |p: Target| {
        Ok(json!(c.gc(&p.target)?))
    })?;
    let c = b.clone();
    method(registry, "backup_verify", move |p: One| {
        check_id(&p.id)?;
        let j = c.verify(&p.target, &p.id)?;
        Ok(job_json(&c, j, p.wait))
    })?;
    let c = b.clone();
    method(registry, "backup_restore", move |p: Restore| {
        check_id(&p.backup)?;
        check_volume("name", &p.name)?;
        let j = c.restore(job::RestoreRequest {
            target: p.target,
            backup: p.backup,
            name: p.name,
            backend: p.backend,
            persist: p.persist,
            replica: p.replica,
        })?;
        Ok(job_json(&c, j, p.wait))
    })?;
    let c = b.clone();
    method(registry, "backup_job_list", move |NoParams {}| {
        Ok(json!(c.jobs()))
    })?;
    let c = b.clone();
    method(registry, "backup_job_get", move |p: JobId| {
        let j = c
            .job(&p.id)
            .ok_or_else(|| BackupError::Volume(format!("no backup job {:?}", p.id)))?;
        Ok(job_json(&c, j, p.wait))
    })?;
    let c = b.clone();
    method(registry, "backup_expose", move |p: Expose| {
        check_id(&p.backup)?;
        if let Some(n) = &p.name {
            check_volume("name", n)?;
        }
        let e = c.expose(&p.target, &p.backup, p.name.as_deref())?;
        Ok(json!({"name": e.name, "target": e.target, "backup": e.backup}))
    })?;
    let c = b.clone();
    method(registry, "backup_unexpose", move |p: Name| {
        c.unexpose(&p.name)?;
        Ok(Value::Null)
    })?;
    let c = b.clone();
    method(registry, "backup_schedule_set", move |p: ScheduleSet| {
        check_volume("volume", &p.volume)?;
        if p.bandwidth_mbytes_per_sec > job::MAX_BANDWIDTH_MBYTES_PER_SEC {
            return Err(ControlError::InvalidParams(format!(
                "bandwidth_mbytes_per_sec: at most {}",
                job::MAX_BANDWIDTH_MBYTES_PER_SEC
            )));
        }
        c.schedule_set(crate::schedule::Schedule {
            volume: p.volume,
            target: p.target,
            interval_secs: p.interval_secs,
            keep_last: p.keep_last,
            keep_within_secs: p.keep_within_secs,
            bandwidth_mbytes_per_sec: p.bandwidth_mbytes_per_sec,
            last_unix_ms: None,
        })?;
        Ok(Value::Null)
    })?;
    let c = b.clone();
    method(registry, "backup_schedule_list", move |NoParams {}| {
        Ok(json!(c.schedule_list()))
    })?;
    let c = b.clone();
    method(
        registry,
        "backup_standby_create",
        move |p: StandbyCreate| {
            check_volume("name", &p.name)?;
            check_volume("volume", &p.volume)?;
            let s = c.standby_create(&p.name, &p.target, &p.volume, &p.backend, p.poll_secs)?;
            Ok(json!(s))
        },
    )?;
    let c = b.clone();
    method(registry, "backup_standby_list", move |NoParams {}| {
        Ok(json!(c.standby_list()))
    })?;
    let c = b.clone();
    method(registry, "backup_standby_activate", move |p: Name| {
        let backup = c.standby_activate(&p.name)?;
        Ok(json!({"name": p.name, "backup": backup}))
    })?;
    let c = b;
    method(registry, "backup_schedule_remove", move |p: ScheduleKey| {
        c.schedule_remove(&p.volume, &p.target)?;
        Ok(Value::Null)
    })?;
    Ok(())
}
