//! Prometheus metrics: a plain snapshot the engine fills, encoded at scrape
//! time in the OpenMetrics text format, served over HTTP.
//!
//! ```ignore
//! struct Source { fw: FrameworkHandle }
//! impl MetricsSource for Source {
//!     fn snapshot(&self) -> MetricsSnapshot {
//!         MetricsSnapshot { reactors: reactor_metrics(&self.fw), ..Default::default() }
//!     }
//! }
//! let server = MetricsServer::start("127.0.0.1:9555".parse()?, Arc::new(Source { fw }))?;
//! // curl http://127.0.0.1:9555/metrics
//! ```
//!
//! The snapshot is a plain struct rather than live prometheus-client metrics
//! so that the data path keeps its own counters (atomics it already has) and
//! pays nothing until a scrape; a scrape builds a fresh registry from it.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lull_reactor::adaptive::{AdaptiveStatus, Regime};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeLabelValue, LabelValueEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::conns::{ConnSet, Slot};
use crate::http::{self, HttpError};

/// Scrapers served at once: one or two Prometheus servers and an operator's
/// curl. Past this a connection gets 503.
pub const MAX_METRICS_CONNECTIONS: usize = 16;

/// Largest request head (request line + headers). A Prometheus scrape's head
/// is under 1 KiB; 8 KiB is the common server default (nginx, Go's
/// net/http per-line). Larger gets 431.
pub const MAX_HTTP_REQUEST_BYTES: usize = 8 * 1024;

/// A request must arrive, and the response be taken, within this time, so a
/// slow client cannot hold a connection thread. Prometheus' default scrape
/// timeout is 10 s.
pub const HTTP_IO_TIMEOUT: Duration = Duration::from_secs(10);

/// Lingering close bounds: how long and how much input to drop after the
/// response; a well-behaved client closes at once.
const LINGER_TIMEOUT: Duration = Duration::from_secs(1);
const LINGER_MAX_BYTES: usize = 64 * 1024;

/// Refused connections waiting for their 503; past this they are closed
/// without one (a flood must not queue without bound).
const REJECT_QUEUE_LEN: usize = 16;

/// How long a stop waits for scrapes in progress.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// The content type of what `encode_snapshot` writes.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The path served.
pub const METRICS_PATH: &str = "/metrics";

/// Errors of the metrics server.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: io::Error },
    #[error("cannot start the metrics thread: {0}")]
    Thread(io::Error),
    #[error("cannot encode metrics")]
    Encode,
}

/// One reactor's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReactorMetrics {
    pub index: usize,
    pub core: usize,
    /// The mode's name ("poll", "interrupt", ...).
    pub mode: String,
    pub interrupt_mode_enabled: bool,
    pub busy_ns: u64,
    pub idle_ns: u64,
    pub iterations: u64,
    pub wakeups: u64,
    /// Adaptive mode: spins that found work, spins that found none, and the
    /// time spent spinning.
    pub spins_with_work: u64,
    pub spins_idle: u64,
    pub spin_ns: u64,
    /// Of `spin_ns`, the time in spins that found work.
    pub spin_ns_with_work: u64,
    /// The spin window last chosen, and the measured cost of a wake-up.
    pub spin_window_ns: u64,
    pub wake_latency_ns: u64,
    pub wake_cpu_ns: u64,
    /// The adaptive decision (adaptive mode only): the regime, the median
    /// gap and the band it is weighed against, switches by the reason of
    /// the last, and probes.
    pub adaptive: Option<AdaptiveStatus>,
    /// Lull threads reported ready by the reactor's epoll.
    pub ready_events: u64,
    /// The reactor thread's getrusage (refreshed every 50 ms) ...
    pub minor_faults: u64,
    pub major_faults: u64,
    pub voluntary_ctxsw: u64,
    pub involuntary_ctxsw: u64,
    /// ... and its io_uring_enter calls.
    pub io_uring_enters: u64,
    /// The reactor's fixed I/O buffer arena: bytes mapped (0: none),
    /// bytes in buffers handed out, and whether it is mlocked.
    pub fixed_buffer_bytes: u64,
    pub fixed_buffer_in_use_bytes: u64,
    pub fixed_buffer_locked: bool,
    /// Stalls the watchdog reported, and how long the current one lasts
    /// (0: not stalled).
    pub stalls: u64,
    pub stalled_ms: u64,
}

impl ReactorMetrics {
    pub fn from_stats(s: &lull_reactor::ReactorStats) -> ReactorMetrics {
        ReactorMetrics {
            index: s.index,
            core: s.core,
            mode: s.mode.as_str().to_string(),
            interrupt_mode_enabled: s.interrupt_mode_enabled(),
            busy_ns: s.busy_ns,
            idle_ns: s.idle_ns,
            iterations: s.iterations,
            wakeups: s.wakeups,
            spins_with_work: s.spins_with_work,
            spins_idle: s.spins_idle,
            spin_ns: s.spin_ns,
            spin_ns_with_work: s.spin_ns_with_work,
            spin_window_ns: s.spin_window_ns,
            wake_latency_ns: s.wake_latency_ns,
            wake_cpu_ns: s.wake_cpu_ns,
            adaptive: s.adaptive_regime().map(|_| s.adaptive),
            ready_events: s.ready_events,
            minor_faults: s.minor_faults,
            major_faults: s.major_faults,
            voluntary_ctxsw: s.voluntary_ctxsw,
            involuntary_ctxsw: s.involuntary_ctxsw,
            io_uring_enters: s.io_uring_enters,
            fixed_buffer_bytes: s.fixed_buffers.bytes,
            fixed_buffer_in_use_bytes: s.fixed_buffers.in_use_bytes,
            fixed_buffer_locked: s.fixed_buffers.locked,
            stalls: s.stalls,
            stalled_ms: s.stalled_ms,
        }
    }
}

/// `ReactorMetrics::from_stats` for every reactor of a framework.
pub fn reactor_metrics(fw: &lull_reactor::FrameworkHandle) -> Vec<ReactorMetrics> {
    fw.reactor_stats()
        .iter()
        .map(ReactorMetrics::from_stats)
        .collect()
}

/// One volume's I/O counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VolumeMetrics {
    pub name: String,
    pub reads: u64,
    pub writes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Latency histogram: (upper bound in ns, requests in this bucket — NOT
    /// cumulative). Requests above the last bound are
    /// `latency_count - sum(counts)`; the +Inf bucket is added here.
    pub latency_buckets: Vec<(f64, u64)>,
    pub latency_sum_ns: u64,
    pub latency_count: u64,
    /// io_uring_enter calls of the volume's file channels; `None` when the
    /// volume does not use io_uring (memory, replicated).
    pub io_uring_enters: Option<u64>,
    /// Reads and writes its file channels sent from registered (fixed)
    /// buffers and from plain ones; `None` as for `io_uring_enters`.
    pub fixed_buffer_ios: Option<u64>,
    pub plain_buffer_ios: Option<u64>,
    /// Reads and writes its file channels did inline (`pread`/`pwrite`,
    /// a file on a memory filesystem); `None` as above.
    pub inline_ios: Option<u64>,
    /// Reads whose data went from a replica's socket to the client's with
    /// splice, never copied into memory (replicated volumes; 0 elsewhere).
    pub spliced_reads: u64,
    /// Reads sent from the device's memory, lent, not copied into a
    /// buffer first (memory volumes; 0 elsewhere).
    pub lent_reads: u64,
    /// Reads sent from the volume's file with `sendfile`, not copied into
    /// a buffer first (file volumes on a memory filesystem; 0 elsewhere).
    pub sendfile_reads: u64,
    /// Requests its QoS limits held, and how long they waited in all.
    pub qos_throttled: u64,
    pub qos_throttled_seconds: f64,
    /// Its `rw_ios_per_sec` limit (0: unlimited).
    pub qos_rw_ios_per_sec: u64,
}

/// One replica's state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaMetrics {
    pub volume: String,
    pub addr: String,
    pub healthy: bool,
    /// While a rebuild or reconcile copies to it: bytes to copy, copied,
    /// and the copy's rate (bytes per second); 0 otherwise.
    pub rebuild_bytes_total: u64,
    pub rebuild_bytes_done: u64,
    pub rebuild_rate_bytes_per_sec: u64,
}

/// A node's replica store (`lull serve --store`): its filesystem's space
/// and what its replicas use and promise.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreMetrics {
    pub capacity_bytes: u64,
    pub free_bytes: u64,
    /// Bytes the replicas' data files occupy.
    pub allocated_bytes: u64,
    /// Sum of the replicas' sizes.
    pub provisioned_bytes: u64,
    pub replicas: u64,
}

/// Everything a scrape shows, read at scrape time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsSnapshot {
    pub reactors: Vec<ReactorMetrics>,
    pub volumes: Vec<VolumeMetrics>,
    pub replicas: Vec<ReplicaMetrics>,
    /// `None` without a store.
    pub store: Option<StoreMetrics>,
}

/// Where a scrape gets its numbers. Called on the metrics thread, never on
/// a reactor; it should only read counters.
pub trait MetricsSource: Send + Sync {
    fn snapshot(&self) -> MetricsSnapshot;
}

/// A label value, escaped as the exposition format requires (prometheus-client
/// 0.22 writes label values verbatim, and volume names may hold `"`, `\` or
/// newlines).
#[derive(Debug, Clone)]
struct Label(String);

impl EncodeLabelValue for Label {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        for c in self.0.chars() {
            match c {
                '\\' => encoder.write_str("\\\\")?,
                '"' => encoder.write_str("\\\"")?,
                '\n' => encoder.write_str("\\n")?,
                c => encoder.write_char(c)?,
            }
        }
        Ok(())
    }
}

type Labels = Vec<(&'static str, Label)>;

fn reactor_labels(r: &ReactorMetrics) -> Labels {
    vec![
        ("reactor", Label(r.index.to_string())),
        ("core", Label(r.core.to_string())),
    ]
}

fn volume_labels(v: &VolumeMetrics) -> Labels {
    vec![("volume", Label(v.name.clone()))]
}

fn ns_to_s(ns: u64) -> f64 {
    ns as f64 / 1e9
}

#[derive(Debug)]
struct SnapshotCollector(MetricsSnapshot);

/// One counter family: a descriptor, then a sample per item.
fn counters<T, V: EncodeCounterValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    items: &[T],
    labels: impl Fn(&T) -> Labels,
    value: impl Fn(&T) -> V,
) -> std::fmt::Result {
    let mut family = enc.encode_descriptor(name, help, unit, MetricType::Counter)?;
    for item in items {
        let l = labels(item);
        family
            .encode_family(&l)?
            .encode_counter::<(), V, u64>(&value(item), None)?;
    }
    Ok(())
}

fn gauges<T>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    items: &[T],
    labels: impl Fn(&T) -> Labels,
    value: impl Fn(&T) -> i64,
) -> std::fmt::Result {
    let mut family = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for item in items {
        let l = labels(item);
        family.encode_family(&l)?.encode_gauge(&value(item))?;
    }
    Ok(())
}

/// The adaptive decision's families (`ReactorMetrics::adaptive`).
fn adaptive_families(
    enc: &mut DescriptorEncoder,
    adaptive: &[(&ReactorMetrics, AdaptiveStatus)],
) -> std::fmt::Result {
    gauges(
        enc,
        "lull_reactor_adaptive_regime",
        "Adaptive reactors: 1 for the current regime label (spin or sleep); last_switch: why it was entered (none, spin_cheaper, sleep_cheaper, gaps_long).",
        adaptive,
        |(x, a)| {
            let mut l = reactor_labels(x);
            l.push(("regime", Label(a.regime.as_str().into())));
            let why = a.last_switch.map_or("none", |s| s.reason.as_str());
            l.push(("last_switch", Label(why.into())));
            l
        },
        |_| 1,
    )?;
    gauges(
        enc,
        "lull_reactor_adaptive_cost_percent",
        "Adaptive reactors: what each regime's idle periods cost per unit of work, in percent of the busy time (CPU spun, each sleep's CPU and latency); the own regime's as it goes, the other's from the last probe.",
        &adaptive
            .iter()
            .flat_map(|&(x, a)| {
                [(Regime::Spin, a.spin_cost_pct), (Regime::Sleep, a.sleep_cost_pct)]
                    .into_iter()
                    .filter_map(move |(regime, c)| c.map(|c| (x, regime, c)))
            })
            .collect::<Vec<_>>(),
        |(x, regime, _)| {
            let mut l = reactor_labels(x);
            l.push(("regime", Label(regime.as_str().into())));
            l
        },
        |(_, _, c)| *c as i64,
    )?;
    gauges(
        enc,
        "lull_reactor_adaptive_gap_ns",
        "Adaptive reactors: the median idle period while spinning (the spin window's basis).",
        adaptive,
        |(x, _)| reactor_labels(x),
        |(_, a)| a.gap_ns as i64,
    )?;
    gauges(
        enc,
        "lull_reactor_adaptive_spin_below_ns",
        "Adaptive reactors: gaps of one length below this make a sleeping reactor spin (3/4 of a wake-up's cost).",
        adaptive,
        |(x, _)| reactor_labels(x),
        |(_, a)| a.spin_below_ns as i64,
    )?;
    gauges(
        enc,
        "lull_reactor_adaptive_sleep_above_ns",
        "Adaptive reactors: gaps of one length above this make a spinning reactor sleep (4/3 of a wake-up's cost).",
        adaptive,
        |(x, _)| reactor_labels(x),
        |(_, a)| a.sleep_above_ns as i64,
    )?;
    counters(
        enc,
        "lull_reactor_adaptive_switches",
        "Adaptive reactors: regime switches.",
        None,
        adaptive,
        |(x, _)| reactor_labels(x),
        |(_, a)| a.switches,
    )?;
    counters(
        enc,
        "lull_reactor_adaptive_probes",
            "Adaptive reactors: probes of the other regime that kept the regime (one that did not is a switch).",
        None,
        adaptive,
        |(x, _)| reactor_labels(x),
        |(_, a)| a.probes,
    )?;
    Ok(())
}

/// Histogram buckets for prometheus-client: ascending finite bounds in
/// seconds, non-cumulative counts, ending with the +Inf bucket (`f64::MAX`).
/// Returns them with the total count (never below the buckets' sum, so the
/// +Inf bucket equals `_count` as OpenMetrics requires).
fn histogram_buckets(v: &VolumeMetrics) -> (Vec<(f64, u64)>, u64) {
    let mut b: Vec<(f64, u64)> = v
        .latency_buckets
        .iter()
        .filter(|(le, _)| le.is_finite() && *le >= 0.0)
        .copied()
        .collect();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    let mut out: Vec<(f64, u64)> = Vec::with_capacity(b.len() + 1);
    for (le_ns, n) in b {
        match out.last_mut() {
            Some(last) if last.0 == le_ns / 1e9 => last.1 = last.1.saturating_add(n),
            _ => out.push((le_ns / 1e9, n)),
        }
    }
    let in_buckets = out.iter().fold(0u64, |a, (_, n)| a.saturating_add(*n));
    let count = v.latency_count.max(in_buckets);
    out.push((f64::MAX, count - in_buckets));
    (out, count)
}

impl Collector for SnapshotCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let s = &self.0;
        let r = &s.reactors[..];
        let secs = Unit::Seconds;
        counters(
            &mut enc,
            "lull_reactor_busy",
            "Time reactors spent on iterations that found work.",
            Some(&secs),
            r,
            reactor_labels,
            |x| ns_to_s(x.busy_ns),
        )?;
        counters(
            &mut enc,
            "lull_reactor_idle",
            "Time reactors spent idle (polling nothing, or asleep).",
            Some(&secs),
            r,
            reactor_labels,
            |x| ns_to_s(x.idle_ns),
        )?;
        counters(
            &mut enc,
            "lull_reactor_iterations",
            "Reactor loop iterations.",
            None,
            r,
            reactor_labels,
            |x| x.iterations,
        )?;
        counters(
            &mut enc,
            "lull_reactor_wakeups",
            "Times a reactor woke from an event wait.",
            None,
            r,
            reactor_labels,
            |x| x.wakeups,
        )?;
        counters(
            &mut enc,
            "lull_reactor_spins_with_work",
            "Adaptive-mode spins that found work.",
            None,
            r,
            reactor_labels,
            |x| x.spins_with_work,
        )?;
        counters(
            &mut enc,
            "lull_reactor_spins_idle",
            "Adaptive-mode spins that found no work.",
            None,
            r,
            reactor_labels,
            |x| x.spins_idle,
        )?;
        counters(
            &mut enc,
            "lull_reactor_spin",
            "Time spent spinning before sleeping (adaptive mode).",
            Some(&secs),
            r,
            reactor_labels,
            |x| ns_to_s(x.spin_ns),
        )?;
        counters(
            &mut enc,
            "lull_reactor_spin_with_work",
            "Time spent in adaptive spins that found work (the rest found none).",
            Some(&secs),
            r,
            reactor_labels,
            |x| ns_to_s(x.spin_ns_with_work),
        )?;
        counters(
            &mut enc,
            "lull_reactor_ready_events",
            "Lull threads the reactor's epoll reported ready.",
            None,
            r,
            reactor_labels,
            |x| x.ready_events,
        )?;
        gauges(
            &mut enc,
            "lull_reactor_spin_window_ns",
            "The adaptive spin window last chosen (0: sleep at once).",
            r,
            reactor_labels,
            |x| x.spin_window_ns as i64,
        )?;
        gauges(
            &mut enc,
            "lull_reactor_wake_latency_ns",
            "Measured latency of a sleep-and-wake on the reactor's core.",
            r,
            reactor_labels,
            |x| x.wake_latency_ns as i64,
        )?;
        gauges(
            &mut enc,
            "lull_reactor_wake_cpu_ns",
            "Measured CPU cost of a sleep-and-wake on the reactor's core.",
            r,
            reactor_labels,
            |x| x.wake_cpu_ns as i64,
        )?;
        let adaptive: Vec<(&ReactorMetrics, AdaptiveStatus)> = r
            .iter()
            .filter_map(|x| x.adaptive.map(|a| (x, a)))
            .collect();
        // The adaptive families only where a reactor is adaptive.
        if !adaptive.is_empty() {
            adaptive_families(&mut enc, &adaptive)?;
        }
        counters(
            &mut enc,
            "lull_reactor_minor_faults",
            "Minor page faults of the reactor thread (getrusage, every 50 ms).",
            None,
            r,
            reactor_labels,
            |x| x.minor_faults,
        )?;
        counters(
            &mut enc,
            "lull_reactor_major_faults",
            "Major page faults of the reactor thread.",
            None,
            r,
            reactor_labels,
            |x| x.major_faults,
        )?;
        counters(
            &mut enc,
            "lull_reactor_voluntary_ctxsw",
            "Voluntary context switches of the reactor thread (sleeps, blocking).",
            None,
            r,
            reactor_labels,
            |x| x.voluntary_ctxsw,
        )?;
        counters(
            &mut enc,
            "lull_reactor_involuntary_ctxsw",
            "Involuntary context switches of the reactor thread (preemption).",
            None,
            r,
            reactor_labels,
            |x| x.involuntary_ctxsw,
        )?;
        counters(
            &mut enc,
            "lull_reactor_io_uring_enters",
            "io_uring_enter calls made on the reactor thread.",
            None,
            r,
            reactor_labels,
            |x| x.io_uring_enters,
        )?;
        gauges(
            &mut enc,
            "lull_reactor_fixed_buffer_bytes",
            "Bytes of the reactor's fixed I/O buffer arena (prefaulted, registered with io_uring; 0: none).",
            r,
            reactor_labels,
            |x| x.fixed_buffer_bytes as i64,
        )?;
        gauges(
            &mut enc,
            "lull_reactor_fixed_buffer_in_use_bytes",
            "Bytes of the reactor's fixed arena in buffers handed out now.",
            r,
            reactor_labels,
            |x| x.fixed_buffer_in_use_bytes as i64,
        )?;
        gauges(
            &mut enc,
            "lull_reactor_fixed_buffer_locked",
            "1 when the reactor's fixed arena is locked in memory (mlock).",
            r,
            reactor_labels,
            |x| i64::from(x.fixed_buffer_locked),
        )?;
        gauges(
            &mut enc,
            "lull_reactor_mode",
            "The reactor's event mode (1 for the current mode label).",
            r,
            |x| {
                let mut l = reactor_labels(x);
                l.push(("mode", Label(x.mode.clone())));
                l
            },
            |_| 1,
        )?;
        gauges(
            &mut enc,
            "lull_reactor_interrupt_mode_enabled",
            "1 when the reactor sleeps on events (Longhorn's InterruptModeEnabled).",
            r,
            reactor_labels,
            |x| i64::from(x.interrupt_mode_enabled),
        )?;
        counters(
            &mut enc,
            "lull_reactor_stalls",
            "Stalls the watchdog reported: the reactor did not answer its heartbeat within the stall threshold.",
            None,
            r,
            reactor_labels,
            |x| x.stalls,
        )?;
        gauges(
            &mut enc,
            "lull_reactor_stalled_ms",
            "How long the reactor has not answered its heartbeat, while it is stalled (0: not stalled).",
            r,
            reactor_labels,
            |x| i64::try_from(x.stalled_ms).unwrap_or(i64::MAX),
        )?;

        let v = &s.volumes[..];
        counters(
            &mut enc,
            "lull_volume_reads",
            "Read requests completed.",
            None,
            v,
            volume_labels,
            |x| x.reads,
        )?;
        counters(
            &mut enc,
            "lull_volume_writes",
            "Write requests completed.",
            None,
            v,
            volume_labels,
            |x| x.writes,
        )?;
        let bytes = Unit::Bytes;
        counters(
            &mut enc,
            "lull_volume_read",
            "Bytes read.",
            Some(&bytes),
            v,
            volume_labels,
            |x| x.read_bytes,
        )?;
        counters(
            &mut enc,
            "lull_volume_written",
            "Bytes written.",
            Some(&bytes),
            v,
            volume_labels,
            |x| x.write_bytes,
        )?;
        counters(
            &mut enc,
            "lull_volume_spliced_reads",
            "Reads whose data went from a replica's socket to the client's with splice, not copied.",
            None,
            v,
            volume_labels,
            |x| x.spliced_reads,
        )?;
        counters(
            &mut enc,
            "lull_volume_lent_reads",
            "Reads whose data was sent from the volume's memory, lent, not copied into a buffer first.",
            None,
            v,
            volume_labels,
            |x| x.lent_reads,
        )?;
        counters(
            &mut enc,
            "lull_volume_sendfile_reads",
            "Reads whose data was sent from the volume's file with sendfile, not copied into a buffer first.",
            None,
            v,
            volume_labels,
            |x| x.sendfile_reads,
        )?;
        counters(
            &mut enc,
            "lull_volume_qos_throttled",
            "Requests the volume's QoS limits held (they waited, none failed).",
            None,
            v,
            volume_labels,
            |x| x.qos_throttled,
        )?;
        counters(
            &mut enc,
            "lull_volume_qos_throttled",
            "Time requests waited for the volume's QoS limits, summed.",
            Some(&Unit::Seconds),
            v,
            volume_labels,
            |x| x.qos_throttled_seconds,
        )?;
        let uring_volumes: Vec<&VolumeMetrics> =
            v.iter().filter(|x| x.io_uring_enters.is_some()).collect();
        counters(
            &mut enc,
            "lull_volume_io_uring_enters",
            "io_uring_enter calls of the volume's file channels (file volumes only).",
            None,
            &uring_volumes,
            |x| volume_labels(x),
            |x| x.io_uring_enters.unwrap_or(0),
        )?;
        counters(
            &mut enc,
            "lull_volume_fixed_buffer_ios",
            "Reads and writes of the volume's file channels from registered buffers (READ_FIXED/WRITE_FIXED).",
            None,
            &uring_volumes,
            |x| volume_labels(x),
            |x| x.fixed_buffer_ios.unwrap_or(0),
        )?;
        counters(
            &mut enc,
            "lull_volume_plain_buffer_ios",
            "Reads and writes of the volume's file channels from unregistered buffers (plain READ/WRITE).",
            None,
            &uring_volumes,
            |x| volume_labels(x),
            |x| x.plain_buffer_ios.unwrap_or(0),
        )?;
        counters(
            &mut enc,
            "lull_volume_inline_ios",
            "Reads and writes of the volume's file channels done inline, without io_uring (a file on a memory filesystem).",
            None,
            &uring_volumes,
            |x| volume_labels(x),
            |x| x.inline_ios.unwrap_or(0),
        )?;
        let mut family = enc.encode_descriptor(
            "lull_volume_latency",
            "Request latency, submission to completion.",
            Some(&secs),
            MetricType::Histogram,
        )?;
        for x in v {
            let (buckets, count) = histogram_buckets(x);
            let l = volume_labels(x);
            family.encode_family(&l)?.encode_histogram::<()>(
                ns_to_s(x.latency_sum_ns),
                count,
                &buckets,
                None,
            )?;
        }

        gauges(
            &mut enc,
            "lull_replica_healthy",
            "1 when the replica is in sync and serving, 0 otherwise.",
            &s.replicas,
            |x| {
                vec![
                    ("volume", Label(x.volume.clone())),
                    ("replica", Label(x.addr.clone())),
                ]
            },
            |x| i64::from(x.healthy),
        )?;
        let replica_labels = |x: &ReplicaMetrics| {
            vec![
                ("volume", Label(x.volume.clone())),
                ("replica", Label(x.addr.clone())),
            ]
        };
        let clamp_u = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        gauges(
            &mut enc,
            "lull_replica_rebuild_total_bytes",
            "Bytes the running rebuild or reconcile of the replica copies in all (0: none runs).",
            &s.replicas,
            replica_labels,
            |x| clamp_u(x.rebuild_bytes_total),
        )?;
        gauges(
            &mut enc,
            "lull_replica_rebuild_done_bytes",
            "Bytes the running rebuild or reconcile of the replica has done.",
            &s.replicas,
            replica_labels,
            |x| clamp_u(x.rebuild_bytes_done),
        )?;
        gauges(
            &mut enc,
            "lull_replica_rebuild_rate_bytes_per_second",
            "The running copy's rate (under volume_set_rebuild_limit when one is set).",
            &s.replicas,
            replica_labels,
            |x| clamp_u(x.rebuild_rate_bytes_per_sec),
        )?;
        let store: &[StoreMetrics] = s.store.as_slice();
        let no_labels = |_: &StoreMetrics| Vec::new();
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        gauges(
            &mut enc,
            "lull_store_capacity_bytes",
            "Size of the filesystem under the node's replica store.",
            store,
            no_labels,
            |x| clamp(x.capacity_bytes),
        )?;
        gauges(
            &mut enc,
            "lull_store_free_bytes",
            "Free bytes of the filesystem under the node's replica store: writes to its replicas fail with ENOSPC at 0.",
            store,
            no_labels,
            |x| clamp(x.free_bytes),
        )?;
        gauges(
            &mut enc,
            "lull_store_allocated_bytes",
            "Bytes the store's replicas occupy on disk (they are sparse).",
            store,
            no_labels,
            |x| clamp(x.allocated_bytes),
        )?;
        gauges(
            &mut enc,
            "lull_store_provisioned_bytes",
            "Sum of the store's replica sizes (what they may grow to).",
            store,
            no_labels,
            |x| clamp(x.provisioned_bytes),
        )?;
        gauges(
            &mut enc,
            "lull_store_replicas",
            "Replicas the store holds.",
            store,
            no_labels,
            |x| clamp(x.replicas),
        )?;
        Ok(())
    }
}

/// Encode a snapshot in the OpenMetrics text format (ends with `# EOF`).
pub fn encode_snapshot(snapshot: MetricsSnapshot) -> Result<String, MetricsError> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(SnapshotCollector(snapshot)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .map_err(|_| MetricsError::Encode)?;
    Ok(out)
}

/// A running HTTP server for `GET /metrics`.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    conns: Arc<ConnSet<TcpStream>>,
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MetricsServer({})", self.addr)
    }
}

impl MetricsServer {
    /// Listen on `addr` (port 0 picks one; see `local_addr`).
    pub fn start(
        addr: SocketAddr,
        source: Arc<dyn MetricsSource>,
    ) -> Result<MetricsServer, MetricsError> {
        let listener =
            TcpListener::bind(addr).map_err(|source| MetricsError::Listen { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| MetricsError::Listen { addr, source })?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = ConnSet::new(MAX_METRICS_CONNECTIONS);
        let accept = {
            let stop = stop.clone();
            let conns = conns.clone();
            std::thread::Builder::new()
                .name("metrics-accept".into())
                .spawn(move || accept_loop(listener, source, stop, conns))
                .map_err(MetricsError::Thread)?
        };
        tracing::info!(addr = %local, "metrics server listening");
        Ok(MetricsServer {
            addr: local,
            stop,
            accept: Some(accept),
            conns,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop accepting and close every connection.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        crate::tcp::stop_accept(self.addr, &self.stop, accept, "metrics");
        self.conns.close_all(SHUTDOWN_WAIT);
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn accept_loop(
    listener: TcpListener,
    source: Arc<dyn MetricsSource>,
    stop: Arc<AtomicBool>,
    conns: Arc<ConnSet<TcpStream>>,
) {
    // Refusals need a lingering close too (else the 503 may be lost to a
    // reset), which must not stall accepting: one thread does them, from a
    // bounded queue. It ends when this loop drops the sender.
    let (tx, rx) = std::sync::mpsc::sync_channel::<TcpStream>(REJECT_QUEUE_LEN);
    let reject = std::thread::Builder::new()
        .name("metrics-reject".into())
        .spawn(move || {
            let busy = http::response(
                503,
                "Service Unavailable",
                &[],
                "text/plain; charset=utf-8",
                b"too many connections\n",
                true,
            );
            for stream in rx {
                if stream.set_write_timeout(Some(LINGER_TIMEOUT)).is_ok() {
                    let _ = (&stream).write_all(&busy);
                    linger(&stream);
                }
            }
        })
        .ok()
        .map(|_| tx);
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "metrics accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let slot = stream.try_clone().ok().and_then(|h| conns.admit(h));
        let Some(slot) = slot else {
            // Past the cap: the reject thread answers 503 if it keeps up;
            // otherwise the connection is just closed.
            if let Some(tx) = &reject {
                let _ = tx.try_send(stream);
            }
            continue;
        };
        let source = source.clone();
        let spawned = std::thread::Builder::new()
            .name("metrics-conn".into())
            .spawn(move || serve_connection(stream, &*source, slot));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a metrics connection thread");
        }
    }
}

/// Read one request head within `HTTP_IO_TIMEOUT` in total.
fn read_head(stream: &TcpStream) -> Result<http::RequestHead, HttpError> {
    let deadline = Instant::now() + HTTP_IO_TIMEOUT;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(head) = http::parse_head(&buf, MAX_HTTP_REQUEST_BYTES)? {
            return Ok(head);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HttpError::Timeout);
        }
        stream
            .set_read_timeout(Some(left))
            .map_err(|_| HttpError::Closed)?;
        match (&*stream).read(&mut chunk) {
            Ok(0) => return Err(HttpError::Closed),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(HttpError::Timeout)
            }
            Err(_) => return Err(HttpError::Closed),
        }
    }
}

/// One request per connection (`Connection: close`).
fn serve_connection(stream: TcpStream, source: &dyn MetricsSource, _slot: Slot<TcpStream>) {
    if stream.set_write_timeout(Some(HTTP_IO_TIMEOUT)).is_err() {
        return;
    }
    let Some(response) = respond(read_head(&stream), source) else {
        return;
    };
    let _ = (&stream).write_all(&response);
    linger(&stream);
}

/// The response to a request whose head is `buf` (the bytes read so far),
/// as a connection would send it: `None` while the head is incomplete.
/// Parses with [`http::parse_head`] and answers like the server does.
pub fn metrics_response(buf: &[u8], source: &dyn MetricsSource) -> Option<Vec<u8>> {
    http::parse_head(buf, MAX_HTTP_REQUEST_BYTES)
        .transpose()
        .and_then(|head| respond(head, source))
}

/// The response to a request head, or to why none could be read; `None`:
/// close without one (the client left or stalled).
fn respond(
    head: Result<http::RequestHead, HttpError>,
    source: &dyn MetricsSource,
) -> Option<Vec<u8>> {
    let text = |code: u16, reason: &str, extra: &[(&str, &str)], body: &str| {
        http::response(
            code,
            reason,
            extra,
            "text/plain; charset=utf-8",
            body.as_bytes(),
            true,
        )
    };
    Some(match head {
        Err(HttpError::Closed | HttpError::Timeout) => return None,
        Err(HttpError::TooLarge) => text(
            431,
            "Request Header Fields Too Large",
            &[],
            "request head too large\n",
        ),
        Err(HttpError::Malformed(why)) => text(400, "Bad Request", &[], &format!("{why}\n")),
        Ok(head) if head.method != "GET" && head.method != "HEAD" => text(
            405,
            "Method Not Allowed",
            &[("Allow", "GET, HEAD")],
            "only GET and HEAD\n",
        ),
        Ok(head) if head.path() != METRICS_PATH => text(404, "Not Found", &[], "try /metrics\n"),
        Ok(head) => {
            let with_body = head.method == "GET";
            match catch_unwind(AssertUnwindSafe(|| encode_snapshot(source.snapshot()))) {
                Ok(Ok(body)) => http::response(
                    200,
                    "OK",
                    &[],
                    OPENMETRICS_CONTENT_TYPE,
                    body.as_bytes(),
                    with_body,
                ),
                Ok(Err(e)) => {
                    tracing::error!(error = %e, "metrics scrape failed");
                    text(500, "Internal Server Error", &[], "cannot encode metrics\n")
                }
                Err(_) => {
                    tracing::error!("metrics source panicked");
                    text(500, "Internal Server Error", &[], "metrics source failed\n")
                }
            }
        }
    })
}

/// Close gracefully: a TCP close with unread input sends a reset, which can
/// destroy the response before the client reads it (a 431 to a client still
/// sending headers). So half-close, then read and drop input until the
/// client closes, bounded in bytes and time (Apache's "lingering close").
fn linger(stream: &TcpStream) {
    if stream.shutdown(std::net::Shutdown::Write).is_err()
        || stream.set_read_timeout(Some(LINGER_TIMEOUT)).is_err()
    {
        return;
    }
    let mut chunk = [0u8; 4096];
    let mut left = LINGER_MAX_BYTES;
    while left > 0 {
        match (&*stream).read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_sane() {
        let v = VolumeMetrics {
            latency_buckets: vec![
                (2000.0, 3),
                (1000.0, 1),
                (f64::NAN, 9),
                (1000.0, 1),
                (-5.0, 1),
            ],
            latency_count: 4,
            ..Default::default()
        };
        // Buckets say 5, count says 4: count is raised, +Inf bucket empty.
        let (b, count) = histogram_buckets(&v);
        assert_eq!(count, 5);
        assert_eq!(b, vec![(1e-6, 2), (2e-6, 3), (f64::MAX, 0)]);
        let v = VolumeMetrics {
            latency_buckets: vec![(1000.0, 1)],
            latency_count: 10,
            ..Default::default()
        };
        assert_eq!(histogram_buckets(&v), (vec![(1e-6, 1), (f64::MAX, 9)], 10));
    }

    #[test]
    fn label_values_are_escaped() {
        let s = MetricsSnapshot {
            volumes: vec![VolumeMetrics {
                name: "a\"b\\c\nd".into(),
                reads: 1,
                ..Default::default()
            }],
            ..Default::default()
        };
        let text = encode_snapshot(s).unwrap();
        assert!(
            text.contains("lull_volume_reads_total{volume=\"a\\\"b\\\\c\\nd\"} 1\n"),
            "{text}"
        );
    }
}
