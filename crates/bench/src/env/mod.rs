//! What the report records about the machine and the run (date, CPU
//! model, kernel, command line, tool versions), and the per-process
//! counters of [`procstat`]: everything bench reads from the system
//! besides fio's output, and a lull server's `io_uring_enter` counts over
//! its RPC socket ([`uring_enters`]).
//!
//! # Layout
//!
//! - `procstat`: a server's CPU time, context switches and page faults from /proc.
//! - `uring_enters`: a lull server's `io_uring_enter` calls, over its JSON-RPC socket.

pub mod procstat;
pub mod uring_enters;

use crate::plan::Target;
use crate::server;
use serde::Serialize;
use std::collections::BTreeMap;

/// The machine and tools a report was made on (the report's
/// `environment`).
#[derive(Clone, Debug, Serialize)]
pub struct Environment {
    /// UTC, RFC 3339.
    pub date_utc: String,
    pub nproc: usize,
    pub cpu_model: String,
    pub kernel: String,
    /// The exact command line of this run.
    pub command: String,
    pub clk_tck: u64,
    /// Tool name → first line of its version output.
    pub tools: BTreeMap<String, String>,
}

/// The machine and the run, for the report.
pub fn environment(targets: &[Target]) -> Environment {
    let mut tools = std::collections::BTreeMap::new();
    let mut names = vec!["fio"];
    for t in targets {
        if let Some((bin, _)) = t.peer_binary() {
            if !names.contains(&bin) {
                names.push(bin);
            }
        }
    }
    for name in names {
        if let Some(v) = server::tool_version(name) {
            tools.insert(name.to_string(), v);
        }
    }
    let unix_secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Environment {
        date_utc: rfc3339_utc(unix_secs),
        nproc: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        cpu_model: std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| cpu_model(&c))
            .unwrap_or_else(|| "unknown".into()),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into()),
        command: std::env::args()
            .map(|a| server::shell_quote(&a))
            .collect::<Vec<_>>()
            .join(" "),
        clk_tck: procstat::clk_tck(),
        tools,
    }
}

/// The "model name" of the first CPU in /proc/cpuinfo text.
pub fn cpu_model(cpuinfo: &str) -> Option<String> {
    cpuinfo.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == "model name").then(|| v.trim().to_string())
    })
}

/// Seconds since the Unix epoch as RFC 3339 UTC (Howard Hinnant's
/// days-to-civil algorithm; no date crate needed).
pub fn rfc3339_utc(unix_secs: u64) -> String {
    let days = (unix_secs / 86_400) as i64;
    let rem = unix_secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_cpu_model() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(1_795_303_855), "2026-11-21T23:30:55Z");
        assert_eq!(
            cpu_model("processor\t: 0\nmodel name\t: AMD EPYC 7B13\n"),
            Some("AMD EPYC 7B13".into())
        );
        assert_eq!(cpu_model("processor: 0\n"), None);
    }
}
