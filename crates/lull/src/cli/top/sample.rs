//! One sample of a running server: the JSON-RPC calls `lull top` makes
//! each period, decoded into plain structs. The counters stay as the
//! server reports them (totals since it started); [`super::model`] turns
//! two samples into rates.
//!
//! ```ignore
//! let mut sampler = Sampler::new(Source::Socket("/var/tmp/lull.sock".into()));
//! let sample = sampler.sample(Instant::now())?;
//! println!("{} volumes", sample.volumes.len());
//! ```
//!
//! A sample is `framework_get_reactors`, `thread_get_stats`,
//! `volume_list`, then `volume_get_stats` for each volume, `replica_list`
//! for each replicated one, and `store_get`. A connection that fails is the
//! server gone ([`SampleError::Gone`]); an error response to one of the
//! first three is a server top cannot read; an error response for one
//! volume (deleted between the list and its stats) drops that volume from
//! the sample; `store_get` that answers with an error (a daemon without a
//! store) is not asked again.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use lull_net::tls::TlsContext;
use lull_rpc::{call, call_tcp, RpcClientError};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

/// How long one call may take. A local server answers a read-only call in
/// well under a millisecond and a remote one in a round trip; a server
/// that takes seconds is hung, and top reports it gone rather than show
/// numbers that stopped moving.
pub(crate) const RPC_TIMEOUT: Duration = Duration::from_secs(5);

/// Most volumes one sample reads. Each is a `volume_get_stats` call (one
/// connection, about 0.1 ms on the Unix socket), so 1024 volumes keep a
/// sample near 0.1 s, inside the shortest period; no screen shows more
/// rows. Past it the sample says how many it left out.
pub(crate) const MAX_VOLUMES_SAMPLED: usize = 1024;

/// Where the server's JSON-RPC is.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    /// `lull serve --rpc-socket PATH`.
    Socket(PathBuf),
    /// `lull serve --rpc-listen HOST:PORT`, TLS with this client context.
    Tcp { addr: String, tls: TlsContext },
}

impl Source {
    /// The socket path or address, as messages name the server.
    pub(crate) fn name(&self) -> String {
        match self {
            Source::Socket(path) => path.display().to_string(),
            Source::Tcp { addr, .. } => addr.clone(),
        }
    }
}

/// One JSON-RPC call: the seam the unit tests replace.
pub(crate) trait Rpc {
    fn call(&self, method: &str, params: Option<Value>) -> Result<Value, RpcClientError>;
}

impl Rpc for Source {
    fn call(&self, method: &str, params: Option<Value>) -> Result<Value, RpcClientError> {
        match self {
            Source::Socket(path) => call(path, method, params, RPC_TIMEOUT),
            Source::Tcp { addr, tls } => call_tcp(addr, tls, method, params, RPC_TIMEOUT),
        }
    }
}

/// Why a sample could not be taken.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SampleError {
    /// The connection failed: the server stopped, or never ran there.
    #[error("{0}")]
    Gone(RpcClientError),
    /// The server answered a method every lull server has with an error
    /// (or is not a lull server).
    #[error("{method}: {source}")]
    Refused {
        method: &'static str,
        source: RpcClientError,
    },
    /// The answer is not the shape top reads.
    #[error("{method}: unexpected answer: {source}")]
    Malformed {
        method: &'static str,
        source: serde_json::Error,
    },
}

/// A reactor as `framework_get_reactors` reports it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct Reactor {
    pub index: usize,
    pub core: usize,
    pub mode: String,
    #[serde(rename = "busy")]
    pub busy_ns: u64,
    #[serde(rename = "usr")]
    pub user_ns: u64,
    #[serde(rename = "sys")]
    pub system_ns: u64,
    pub sleeping: bool,
    pub interrupt_mode_enabled: bool,
    pub wakeups: u64,
    pub threads_moved_in: u64,
    pub threads_moved_out: u64,
    pub lw_threads: Vec<serde::de::IgnoredAny>,
}

/// A lull thread (a poll group, an acceptor, an engine) as
/// `thread_get_stats` reports it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct Thread {
    pub id: u64,
    pub name: String,
    pub reactor: usize,
    #[serde(rename = "busy")]
    pub busy_ns: u64,
    pub wakeups: u64,
    pub messages: u64,
    /// Event sources: a poll group's connections.
    pub sources: u64,
}

/// `volume_get_stats`'s latency summary: quantiles of the histogram since
/// the server started, as the bucket bound each falls under.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct Latency {
    #[serde(rename = "p50_le")]
    pub p50_ns: u64,
    #[serde(rename = "p99_le")]
    pub p99_ns: u64,
}

/// `volume_get_stats` for one volume.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct VolumeStats {
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    pub connections: u64,
    pub in_flight: u64,
    #[serde(rename = "latency_ns")]
    pub latency: Latency,
    pub qos: Qos,
}

/// `volume_get_stats`'s QoS: the limits (0: unlimited) and what they held.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct Qos {
    pub limits: QosLimits,
    pub throttled_requests: u64,
    pub throttled_seconds: f64,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct QosLimits {
    pub rw_ios_per_sec: u64,
    pub rw_mbytes_per_sec: u64,
    pub r_mbytes_per_sec: u64,
    pub w_mbytes_per_sec: u64,
}

impl QosLimits {
    /// `2000io` / `100MB` / `r50MB+w20MB`, `-` when unlimited: what fits
    /// a column.
    pub(crate) fn short(&self) -> String {
        let mut parts = Vec::new();
        if self.rw_ios_per_sec > 0 {
            parts.push(format!("{}io", self.rw_ios_per_sec));
        }
        if self.rw_mbytes_per_sec > 0 {
            parts.push(format!("{}MB", self.rw_mbytes_per_sec));
        }
        if self.r_mbytes_per_sec > 0 {
            parts.push(format!("r{}MB", self.r_mbytes_per_sec));
        }
        if self.w_mbytes_per_sec > 0 {
            parts.push(format!("w{}MB", self.w_mbytes_per_sec));
        }
        if parts.is_empty() {
            "-".into()
        } else {
            parts.join("+")
        }
    }
}

/// Rebuild or reconcile progress of a replica.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct Progress {
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// One replica of a replicated volume as `replica_list` reports it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct Replica {
    pub addr: String,
    /// connecting, healthy, failed, rebuilding or reconciling.
    pub state: String,
    pub rebuild: Option<Progress>,
    pub generation: u64,
    pub in_flight: u64,
    pub errors: u64,
    pub last_error: Option<String>,
}

/// A volume: `volume_list`'s entry, its stats, and its replicas when it
/// is replicated.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Volume {
    pub name: String,
    pub backend: String,
    pub stats: VolumeStats,
    pub replicas: Option<Vec<Replica>>,
}

#[derive(Debug, Deserialize)]
struct VolumeEntry {
    name: String,
    #[serde(default)]
    backend: String,
}

/// A replica kept in this daemon's store (`store_get`).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct StoreReplica {
    pub name: String,
    pub size_bytes: u64,
    pub allocated_bytes: u64,
    pub generation: u64,
    pub clean: bool,
    pub intent_lost: bool,
    pub intent_bits_set: u64,
    pub held_by_session: Option<String>,
    pub connections: u64,
}

/// `store_get`: the node's replica store.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct Store {
    pub dir: String,
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    pub allocated_bytes: u64,
    pub provisioned_bytes: u64,
    pub overcommit_percent: u64,
    pub replicas: Vec<StoreReplica>,
}

/// Everything one period reads.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    /// When the sample was started; rates divide by the difference.
    pub at: Instant,
    /// The server's process: another pid is another server, whose
    /// counters start again.
    pub pid: u64,
    pub reactors: Vec<Reactor>,
    pub threads: Vec<Thread>,
    pub volumes: Vec<Volume>,
    /// Volumes past [`MAX_VOLUMES_SAMPLED`], not read.
    pub volumes_left_out: usize,
    pub store: Option<Store>,
}

#[derive(Debug, Deserialize)]
struct ReactorsAnswer {
    #[serde(default)]
    pid: u64,
    reactors: Vec<Reactor>,
}

#[derive(Debug, Deserialize)]
struct ThreadsAnswer {
    threads: Vec<Thread>,
}

/// Whether the server has a store, once known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StoreKnown {
    Unknown,
    Present,
    Absent,
}

/// Takes samples from one server.
#[derive(Debug)]
pub(crate) struct Sampler<R> {
    rpc: R,
    store: StoreKnown,
}

impl<R: Rpc> Sampler<R> {
    pub(crate) fn new(rpc: R) -> Sampler<R> {
        Sampler {
            rpc,
            store: StoreKnown::Unknown,
        }
    }

    /// One sample, stamped `at` (the caller reads the clock).
    pub(crate) fn sample(&mut self, at: Instant) -> Result<Sample, SampleError> {
        let reactors: ReactorsAnswer = self.required("framework_get_reactors")?;
        let threads: ThreadsAnswer = self.required("thread_get_stats")?;
        let mut list: Vec<VolumeEntry> = self.required("volume_list")?;
        list.sort_by(|a, b| a.name.cmp(&b.name));
        let volumes_left_out = list.len().saturating_sub(MAX_VOLUMES_SAMPLED);
        list.truncate(MAX_VOLUMES_SAMPLED);
        let mut volumes = Vec::with_capacity(list.len());
        for entry in list {
            let Some(stats) = self.optional("volume_get_stats", json!({"name": entry.name}))?
            else {
                continue; // deleted since the list
            };
            let replicas = if entry.backend.starts_with("replicas=") {
                self.optional("replica_list", json!({"volume": entry.name}))?
            } else {
                None
            };
            volumes.push(Volume {
                name: entry.name,
                backend: entry.backend,
                stats,
                replicas,
            });
        }
        let store = self.store()?;
        Ok(Sample {
            at,
            pid: reactors.pid,
            reactors: reactors.reactors,
            threads: threads.threads,
            volumes,
            volumes_left_out,
            store,
        })
    }

    /// A method without which there is no view: any error ends top.
    fn required<T: DeserializeOwned>(&self, method: &'static str) -> Result<T, SampleError> {
        let value = self.rpc.call(method, None).map_err(|e| match e {
            RpcClientError::Rpc { .. } => SampleError::Refused { method, source: e },
            e => SampleError::Gone(e),
        })?;
        serde_json::from_value(value).map_err(|source| SampleError::Malformed { method, source })
    }

    /// A method whose error response leaves its part out (`None`); a
    /// failed connection is still the server gone.
    fn optional<T: DeserializeOwned>(
        &self,
        method: &'static str,
        params: Value,
    ) -> Result<Option<T>, SampleError> {
        match self.rpc.call(method, Some(params)) {
            Ok(value) => serde_json::from_value(value)
                .map(Some)
                .map_err(|source| SampleError::Malformed { method, source }),
            Err(RpcClientError::Rpc { .. }) => Ok(None),
            Err(e) => Err(SampleError::Gone(e)),
        }
    }

    fn store(&mut self) -> Result<Option<Store>, SampleError> {
        if self.store == StoreKnown::Absent {
            return Ok(None);
        }
        match self.rpc.call("store_get", None) {
            Ok(value) => {
                self.store = StoreKnown::Present;
                serde_json::from_value(value)
                    .map(Some)
                    .map_err(|source| SampleError::Malformed {
                        method: "store_get",
                        source,
                    })
            }
            // "this daemon has no replica store" (or a server without the
            // method): a daemon does not gain a store while it runs.
            Err(RpcClientError::Rpc { .. }) if self.store == StoreKnown::Unknown => {
                self.store = StoreKnown::Absent;
                Ok(None)
            }
            Err(RpcClientError::Rpc { .. }) => Ok(None),
            Err(e) => Err(SampleError::Gone(e)),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::cell::RefCell;
    use std::collections::HashMap;

    use super::*;

    /// A server made of canned answers, keyed by method and the `name` or
    /// `volume` parameter; it counts the calls.
    #[derive(Default)]
    pub(crate) struct Canned {
        pub answers: HashMap<String, Result<Value, (i64, String)>>,
        pub gone: bool,
        pub calls: RefCell<Vec<String>>,
    }

    impl Canned {
        pub(crate) fn answer(&mut self, key: &str, value: Value) {
            self.answers.insert(key.into(), Ok(value));
        }

        pub(crate) fn refuse(&mut self, key: &str, message: &str) {
            self.answers
                .insert(key.into(), Err((-32603, message.to_string())));
        }
    }

    impl Rpc for Canned {
        fn call(&self, method: &str, params: Option<Value>) -> Result<Value, RpcClientError> {
            if self.gone {
                return Err(RpcClientError::Closed);
            }
            let arg = params
                .as_ref()
                .and_then(|p| p.get("name").or_else(|| p.get("volume")))
                .and_then(Value::as_str);
            let key = match arg {
                Some(a) => format!("{method} {a}"),
                None => method.to_string(),
            };
            self.calls.borrow_mut().push(key.clone());
            match self.answers.get(&key) {
                Some(Ok(v)) => Ok(v.clone()),
                Some(Err((code, message))) => Err(RpcClientError::Rpc {
                    code: *code,
                    message: message.clone(),
                    data: None,
                }),
                None => Err(RpcClientError::Rpc {
                    code: -32601,
                    message: "Method not found".into(),
                    data: None,
                }),
            }
        }
    }

    /// A server with one reactor, two threads and the given volumes (name,
    /// backend, reads so far), as `lull serve` answers.
    pub(crate) fn server(volumes: &[(&str, &str, u64)]) -> Canned {
        let mut c = Canned::default();
        c.answer(
            "framework_get_reactors",
            json!({"pid": 7, "tick_rate": 1_000_000_000u64, "reactors": [{
                "index": 0, "core": 1, "mode": "adaptive", "busy": 1000, "idle": 5,
                "usr": 0, "sys": 0, "sleeping": true, "interrupt_mode_enabled": true,
                "wakeups": 2, "threads_moved_in": 0, "threads_moved_out": 0,
                "lw_threads": [{"name": "nbd-group-0", "id": 1, "elapsed": 1}],
                "spin_ns": 0
            }]}),
        );
        c.answer(
            "thread_get_stats",
            json!({"threads": [
                {"id": 1, "name": "nbd-group-0", "reactor": 0, "busy": 10, "idle": 0,
                 "wakeups": 0, "messages": 1, "sources": 2, "pinned": false},
            ]}),
        );
        let list: Vec<Value> = volumes
            .iter()
            .map(|(name, backend, _)| json!({"name": name, "backend": backend, "size_bytes": 1}))
            .collect();
        c.answer("volume_list", Value::Array(list));
        for (name, _, reads) in volumes {
            c.answer(
                &format!("volume_get_stats {name}"),
                json!({"name": name, "reads": reads, "writes": 0, "read_bytes": reads * 4096,
                       "write_bytes": 0, "errors": 0, "connections": 1, "in_flight": 0,
                       "latency_ns": {"mean": 0, "p50_le": 8192, "p99_le": 65536, "max": 0}}),
            );
        }
        c.refuse(
            "store_get",
            "this daemon has no replica store: start lull serve with --store DIR",
        );
        c
    }

    #[test]
    fn reads_a_server_without_a_store_and_asks_store_get_once() {
        let mut sampler = Sampler::new(server(&[("b", "malloc", 5), ("a", "malloc", 9)]));
        let s = sampler.sample(Instant::now()).unwrap();
        assert_eq!(s.pid, 7);
        assert_eq!(s.reactors.len(), 1);
        assert_eq!(s.reactors[0].lw_threads.len(), 1);
        assert!(s.reactors[0].sleeping);
        assert_eq!(s.threads[0].sources, 2);
        let names: Vec<&str> = s.volumes.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["a", "b"], "volumes come sorted by name");
        assert_eq!(s.volumes[0].stats.reads, 9);
        assert_eq!(s.volumes[0].stats.latency.p99_ns, 65536);
        assert!(s.store.is_none());
        sampler.sample(Instant::now()).unwrap();
        let asked = |m: &str| {
            sampler
                .rpc
                .calls
                .borrow()
                .iter()
                .filter(|c| *c == m)
                .count()
        };
        assert_eq!(asked("store_get"), 1);
        assert_eq!(asked("volume_list"), 2);
    }

    #[test]
    fn a_volume_deleted_since_the_list_is_left_out() {
        let mut rpc = server(&[("a", "malloc", 1), ("b", "malloc", 1)]);
        rpc.refuse("volume_get_stats a", "volume not found: a");
        let s = Sampler::new(rpc).sample(Instant::now()).unwrap();
        assert_eq!(s.volumes.len(), 1);
        assert_eq!(s.volumes[0].name, "b");
    }

    #[test]
    fn replicated_volumes_and_a_store() {
        let mut rpc = server(&[("r", "replicas=10.0.0.1:10900+10.0.0.2:10900", 0)]);
        rpc.answer(
            "replica_list r",
            json!([
                {"addr": "10.0.0.1:10900", "state": "healthy", "rebuild": null,
                 "generation": 3, "in_flight": 1, "errors": 0, "last_error": null},
                {"addr": "10.0.0.2:10900", "state": "rebuilding",
                 "rebuild": {"done_bytes": 1024, "total_bytes": 4096},
                 "generation": 3, "in_flight": 0, "errors": 1, "last_error": "reset"},
            ]),
        );
        rpc.answer(
            "store_get",
            json!({"dir": "/srv/lull", "replica_addr": "0.0.0.0:10900",
                   "capacity_bytes": 100, "free_bytes": 50, "allocated_bytes": 10,
                   "provisioned_bytes": 20, "overcommit_percent": 100,
                   "replicas": [{"name": "r1", "size_bytes": 20, "allocated_bytes": 10,
                                 "generation": 1, "clean": true, "intent_lost": false,
                                 "intent_bits_set": 0, "held_by_session": null,
                                 "connections": 0}]}),
        );
        let s = Sampler::new(rpc).sample(Instant::now()).unwrap();
        let replicas = s.volumes[0].replicas.as_ref().unwrap();
        assert_eq!(replicas[1].state, "rebuilding");
        assert_eq!(replicas[1].rebuild.unwrap().done_bytes, 1024);
        assert_eq!(replicas[1].last_error.as_deref(), Some("reset"));
        let store = s.store.unwrap();
        assert_eq!(store.dir, "/srv/lull");
        assert_eq!(store.replicas[0].name, "r1");
    }

    #[test]
    fn a_closed_connection_is_the_server_gone_and_an_error_answer_is_not() {
        let mut rpc = server(&[]);
        rpc.gone = true;
        let err = Sampler::new(rpc).sample(Instant::now()).unwrap_err();
        assert!(matches!(err, SampleError::Gone(_)), "{err:?}");
        let mut rpc = server(&[]);
        rpc.answers.remove("thread_get_stats");
        let err = Sampler::new(rpc).sample(Instant::now()).unwrap_err();
        assert!(
            matches!(
                err,
                SampleError::Refused {
                    method: "thread_get_stats",
                    ..
                }
            ),
            "{err:?}"
        );
        let mut rpc = server(&[]);
        rpc.answer("volume_list", json!({"not": "a list"}));
        let err = Sampler::new(rpc).sample(Instant::now()).unwrap_err();
        assert!(
            matches!(
                err,
                SampleError::Malformed {
                    method: "volume_list",
                    ..
                }
            ),
            "{err:?}"
        );
    }
}
