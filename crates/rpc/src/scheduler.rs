//! `framework_set_scheduler` and `framework_get_scheduler` (SPDK's names
//! and parameters).
//!
//! ```text
//! $ lull rpc framework_set_scheduler '{"name": "dynamic", "period_us": 1000000, "core_limit": 70}'
//! $ lull rpc framework_get_scheduler
//! {"scheduler_name": "dynamic", "scheduler_period": 1000000, "load_limit": 20,
//!  "core_limit": 70, "core_busy": 95, "governor_name": "unsupported: ...", ...}
//! ```

use lull_reactor::scheduler::{DynamicParams, Policy};
use lull_reactor::{FrameworkHandle, SchedulerConfig};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::server::{no_params, parse_params, MethodRegistry, RpcMethodError};
use crate::RpcError;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SetScheduler {
    name: String,
    /// Microseconds; SPDK calls it `period`.
    #[serde(alias = "period")]
    period_us: Option<u64>,
    load_limit: Option<u8>,
    core_limit: Option<u8>,
    core_busy: Option<u8>,
}

/// Register the scheduler methods.
pub fn register_scheduler_methods(
    registry: &mut MethodRegistry,
    fw: FrameworkHandle,
) -> Result<(), RpcError> {
    let f = fw.clone();
    registry.register(
        "framework_get_scheduler",
        Box::new(move |p| {
            no_params(p)?;
            Ok(framework_get_scheduler(&f))
        }),
    )?;
    registry.register(
        "framework_set_scheduler",
        Box::new(move |p| {
            let p: SetScheduler = parse_params(p)?;
            let current = fw.scheduler_info();
            let tunables =
                p.load_limit.is_some() || p.core_limit.is_some() || p.core_busy.is_some();
            let policy = match p.name.as_str() {
                "static" if tunables => {
                    return Err(RpcMethodError::InvalidParams(
                        "load_limit, core_limit and core_busy belong to the dynamic scheduler"
                            .into(),
                    ))
                }
                "static" => Policy::Static,
                "dynamic" => {
                    let d = current.dynamic;
                    Policy::Dynamic(DynamicParams {
                        load_limit: p.load_limit.unwrap_or(d.load_limit),
                        core_limit: p.core_limit.unwrap_or(d.core_limit),
                        core_busy: p.core_busy.unwrap_or(d.core_busy),
                    })
                }
                other => {
                    return Err(RpcMethodError::InvalidParams(format!(
                        "unknown scheduler {other:?} (expected static or dynamic)"
                    )))
                }
            };
            let config = SchedulerConfig {
                policy,
                period_us: p.period_us.unwrap_or(current.config.period_us),
            };
            fw.set_scheduler(config)
                .map_err(|e| RpcMethodError::InvalidParams(e.to_string()))?;
            Ok(Value::Bool(true))
        }),
    )?;
    Ok(())
}

/// SPDK's `framework_get_scheduler` shape, plus lull's counters.
pub fn framework_get_scheduler(fw: &FrameworkHandle) -> Value {
    let info = fw.scheduler_info();
    json!({
        "scheduler_name": info.config.policy.name(),
        "scheduler_period": info.config.period_us,
        "load_limit": info.dynamic.load_limit,
        "core_limit": info.dynamic.core_limit,
        "core_busy": info.dynamic.core_busy,
        "governor_name": info.governor,
        "rounds": info.rounds,
        "threads_moved": info.moves,
    })
}
