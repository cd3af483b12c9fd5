//! A lull server's `io_uring_enter` calls, read over its JSON-RPC socket.
//!
//! Two counters exist, and one contains the other:
//! - every reactor counts the calls made on its OS thread through lull's
//!   rings (`framework_get_reactors`, field `io_uring_enters`);
//! - a file volume counts the calls of its own channels
//!   (`volume_get_stats`, field `io_uring_enters`; null for volumes without
//!   a ring).
//!
//! Both are bumped by the same call (`lull_uring::Ring::count_enter`), and a
//! volume's channels run on reactor threads, so the volume's count is part
//! of the reactors' sum: adding them would count file I/O twice. The
//! server's total is therefore the reactors' sum; the volume's count is
//! recorded beside it to show how much of the total is file I/O. Reactors
//! publish their counters every 50 ms, so over a window of seconds the sum
//! is exact to a few percent.
//!
//! Syscalls in general are not counted: /proc/PID/syscall shows only the
//! call a thread is in now, and counting them all needs tracing (strace,
//! perf, BPF), which costs more than the I/O it measures.
//!
//! ```
//! use lull_bench::env::uring_enters::{parse, UringEnters};
//! let reactors = serde_json::json!({"reactors": [{"io_uring_enters": 7}, {"io_uring_enters": 5}]});
//! let volume = serde_json::json!({"name": "bench", "io_uring_enters": 9});
//! assert_eq!(parse(&reactors, &volume), Ok(UringEnters { reactors: 12, volume: Some(9) }));
//! ```

use std::path::Path;
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};

/// How long one RPC call may take. The server answers on its own RPC
/// thread in well under a millisecond; a call that takes seconds means the
/// server is wedged, and the run records the failure instead of waiting.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(2);

/// `io_uring_enter` counts of one server at one instant, or their change
/// over a window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UringEnters {
    /// Sum over the server's reactors: every call made on a reactor thread,
    /// the volume's included. The server's total.
    pub reactors: u64,
    /// The measured volume's file channels (`None`: the volume has no ring,
    /// e.g. memory or replicated). A part of `reactors`, not an addition.
    pub volume: Option<u64>,
}

impl UringEnters {
    /// `self - earlier`, saturating (a counter never goes backwards while
    /// the server lives; a restart between the reads would).
    pub fn since(&self, earlier: &UringEnters) -> UringEnters {
        UringEnters {
            reactors: self.reactors.saturating_sub(earlier.reactors),
            volume: match (self.volume, earlier.volume) {
                (Some(a), Some(b)) => Some(a.saturating_sub(b)),
                _ => None,
            },
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum UringEntersError {
    #[error("framework_get_reactors has no reactors array")]
    NoReactors,
    #[error("reactor {0} has no io_uring_enters count (a lull build without it?)")]
    NoReactorCount(usize),
    #[error("volume_get_stats: io_uring_enters is neither a count nor null")]
    BadVolumeCount,
    #[error("RPC {method}: {message}")]
    Rpc {
        method: &'static str,
        message: String,
    },
}

/// The counts from a `framework_get_reactors` result and a
/// `volume_get_stats` result.
pub fn parse(reactors: &Value, volume: &Value) -> Result<UringEnters, UringEntersError> {
    let list = reactors["reactors"]
        .as_array()
        .ok_or(UringEntersError::NoReactors)?;
    let mut sum = 0u64;
    for (i, r) in list.iter().enumerate() {
        sum += r["io_uring_enters"]
            .as_u64()
            .ok_or(UringEntersError::NoReactorCount(i))?;
    }
    let volume = match &volume["io_uring_enters"] {
        Value::Null => None,
        v => Some(v.as_u64().ok_or(UringEntersError::BadVolumeCount)?),
    };
    Ok(UringEnters {
        reactors: sum,
        volume,
    })
}

/// Reads the counts of the server listening on `socket`, for volume
/// `volume`.
pub fn read(socket: &Path, volume: &str) -> Result<UringEnters, UringEntersError> {
    let call = |method: &'static str, params: Option<Value>| {
        lull_rpc::call(socket, method, params, RPC_TIMEOUT).map_err(|e| UringEntersError::Rpc {
            method,
            message: e.to_string(),
        })
    };
    let reactors = call("framework_get_reactors", None)?;
    let vol = call("volume_get_stats", Some(json!({ "name": volume })))?;
    parse(&reactors, &vol)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_cases() {
        let reactors = json!({"tick_rate": 1, "reactors": [{"io_uring_enters": 3}]});
        assert_eq!(
            parse(&reactors, &json!({"io_uring_enters": null})),
            Ok(UringEnters {
                reactors: 3,
                volume: None
            })
        );
        assert_eq!(
            parse(&json!({}), &json!({})),
            Err(UringEntersError::NoReactors)
        );
        assert_eq!(
            parse(
                &json!({"reactors": [{"io_uring_enters": 1}, {}]}),
                &json!({})
            ),
            Err(UringEntersError::NoReactorCount(1))
        );
        assert_eq!(
            parse(&reactors, &json!({"io_uring_enters": "x"})),
            Err(UringEntersError::BadVolumeCount)
        );
    }

    #[test]
    fn deltas() {
        let a = UringEnters {
            reactors: 100,
            volume: Some(40),
        };
        let b = UringEnters {
            reactors: 1100,
            volume: Some(940),
        };
        assert_eq!(
            b.since(&a),
            UringEnters {
                reactors: 1000,
                volume: Some(900)
            }
        );
        assert_eq!(a.since(&b).reactors, 0);
        let no_vol = UringEnters {
            reactors: 5,
            volume: None,
        };
        assert_eq!(b.since(&no_vol).volume, None);
    }

    #[test]
    fn no_server_is_an_error() {
        let e = read(Path::new("/nonexistent/lull-bench.sock"), "bench").unwrap_err();
        assert!(matches!(
            e,
            UringEntersError::Rpc {
                method: "framework_get_reactors",
                ..
            }
        ));
    }
}
