//! What the view shows, computed from two samples, and the view's state
//! machine: inputs (keys, samples, signals) in, actions (redraw, quit)
//! out. Nothing here reads a clock or touches the terminal.
//!
//! ```ignore
//! let mut top = Top::new(View::default());
//! top.apply(Input::Sample(Ok(first)));
//! top.apply(Input::Sample(Ok(second))); // rates now: (second - first) / elapsed
//! assert_eq!(top.apply(Input::Key(Key::Char('q'))), Action::Quit(Exit::Asked));
//! ```

use std::collections::HashMap;
use std::time::Duration;

use lull_rpc::RpcClientError;

use super::sample::{Progress, Replica, Sample, SampleError, Store};

/// Longest filter text: no volume name is longer, so a longer filter
/// matches nothing.
pub(crate) const MAX_FILTER_LEN: usize = lull_rpc::MAX_VOLUME_NAME_LEN;

const MIB: f64 = (1u64 << 20) as f64;

/// What the volume table is sorted by (`s` cycles, in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum SortKey {
    /// Reads and writes per second.
    Iops,
    /// MiB read and written per second.
    Mibs,
    /// The latency under which 99% of requests completed.
    P99,
    /// Requests in flight now.
    Inflight,
    /// Connections now.
    Conns,
    /// The volume's name.
    Name,
}

impl SortKey {
    pub(crate) const ALL: [SortKey; 6] = [
        SortKey::Iops,
        SortKey::Mibs,
        SortKey::P99,
        SortKey::Inflight,
        SortKey::Conns,
        SortKey::Name,
    ];

    pub(crate) fn next(self) -> SortKey {
        let i = SortKey::ALL.iter().position(|k| *k == self).unwrap_or(0);
        SortKey::ALL[(i + 1) % SortKey::ALL.len()]
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SortKey::Iops => "iops",
            SortKey::Mibs => "mibs",
            SortKey::P99 => "p99",
            SortKey::Inflight => "inflight",
            SortKey::Conns => "conns",
            SortKey::Name => "name",
        }
    }

    /// Names ascend, numbers descend (the busiest first), unless reversed.
    fn descending(self) -> bool {
        self != SortKey::Name
    }
}

/// How the operator looks at the model: sort, order, filter.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct View {
    pub sort: SortKey,
    pub reversed: bool,
    /// Volumes, replicas and store replicas whose name contains it.
    pub filter: String,
    /// The filter being typed (after `/`), with the one to go back to.
    pub editing: Option<String>,
}

impl Default for View {
    fn default() -> View {
        View {
            sort: SortKey::Iops,
            reversed: false,
            filter: String::new(),
            editing: None,
        }
    }
}

impl View {
    /// Whether `name` passes the filter (case-insensitive substring).
    pub(crate) fn keeps(&self, name: &str) -> bool {
        self.filter.is_empty() || name.to_lowercase().contains(&self.filter.to_lowercase())
    }
}

/// A rate over the interval between two samples; `None` when there is
/// no earlier sample of the thing (the first sample, a new volume, a
/// restarted server).
pub(crate) type Rate = Option<f64>;

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ReactorRow {
    pub index: usize,
    pub core: usize,
    pub mode: String,
    /// Time running pollers and messages, of the wall time.
    pub busy_pct: Rate,
    /// CPU time of the reactor's thread (user + system), of the wall time.
    pub cpu_pct: Rate,
    pub sleeping: bool,
    pub interrupt_mode_enabled: bool,
    pub wakeups_per_s: Rate,
    pub threads: usize,
    pub moved_in: u64,
    pub moved_out: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ThreadRow {
    pub id: u64,
    pub name: String,
    pub reactor: usize,
    pub busy_pct: Rate,
    pub connections: u64,
    /// Reactor changes top has seen between its samples.
    pub moves: u64,
    pub wakeups_per_s: Rate,
}

/// A volume's health as one word: its backend kind when it is local.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Health {
    Local(String),
    Healthy,
    Degraded { healthy: usize, total: usize },
    Rebuilding { pct: f64 },
    Reconciling { pct: f64 },
}

impl Health {
    pub(crate) fn is_alert(&self) -> bool {
        !matches!(self, Health::Local(_) | Health::Healthy)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct VolumeRow {
    pub name: String,
    pub iops: Rate,
    pub read_mib_s: Rate,
    pub write_mib_s: Rate,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub in_flight: u64,
    pub connections: u64,
    pub errors: u64,
    pub health: Health,
    /// The QoS limits, short (`-`: none).
    pub qos: String,
    /// Milliseconds of waiting for the QoS limits per second (summed over
    /// the requests held: 500 is half a request held all the time).
    pub throttled_ms_s: Rate,
}

impl VolumeRow {
    pub(crate) fn mib_s(&self) -> Rate {
        Some(self.read_mib_s? + self.write_mib_s?)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ReplicaRow {
    pub volume: String,
    pub addr: String,
    pub state: String,
    pub progress_pct: Option<f64>,
    /// Bytes rebuilt per second, while rebuilding.
    pub rebuild_mib_s: Rate,
    pub generation: u64,
    pub in_flight: u64,
    pub errors: u64,
    pub last_error: Option<String>,
}

/// What one screen shows.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Model {
    pub pid: u64,
    /// Between the two samples; `None` for the first.
    pub interval: Option<Duration>,
    pub reactors: Vec<ReactorRow>,
    pub threads: Vec<ThreadRow>,
    pub volumes: Vec<VolumeRow>,
    pub volumes_left_out: usize,
    pub replicas: Vec<ReplicaRow>,
    pub store: Option<Store>,
}

/// Per-second rate of a counter over `interval`; a counter that went back
/// (a volume deleted and made again) counts from zero.
fn per_s(now: u64, before: Option<u64>, interval: Option<Duration>) -> Rate {
    let secs = interval?.as_secs_f64();
    if secs <= 0.0 {
        return None;
    }
    let before = before?;
    Some(now.checked_sub(before).unwrap_or(now) as f64 / secs)
}

/// Nanoseconds of a counter per nanosecond of wall time, as a percentage.
fn pct_of(now_ns: u64, before_ns: Option<u64>, interval: Option<Duration>) -> Rate {
    per_s(now_ns, before_ns, interval).map(|ns_per_s| ns_per_s / 1e7)
}

fn progress_pct(p: Progress) -> f64 {
    if p.total_bytes == 0 {
        100.0
    } else {
        p.done_bytes as f64 * 100.0 / p.total_bytes as f64
    }
}

fn health(backend: &str, replicas: Option<&[Replica]>) -> Health {
    let Some(replicas) = replicas else {
        let kind = backend.split(['=', ',', ':']).next().unwrap_or(backend);
        return Health::Local(kind.to_string());
    };
    let least = |state: &str| {
        replicas
            .iter()
            .filter(|r| r.state == state)
            .map(|r| r.rebuild.map_or(0.0, progress_pct))
            .reduce(f64::min)
    };
    if let Some(pct) = least("rebuilding") {
        return Health::Rebuilding { pct };
    }
    if let Some(pct) = least("reconciling") {
        return Health::Reconciling { pct };
    }
    let healthy = replicas.iter().filter(|r| r.state == "healthy").count();
    if healthy == replicas.len() && healthy > 0 {
        Health::Healthy
    } else {
        Health::Degraded {
            healthy,
            total: replicas.len(),
        }
    }
}

impl Model {
    /// The screen for `cur`, with rates over the time since `prev` (the
    /// same server's earlier sample, or none). `moves` counts the reactor
    /// changes seen so far per thread id.
    pub(crate) fn between(prev: Option<&Sample>, cur: &Sample, moves: &HashMap<u64, u64>) -> Model {
        let prev = prev.filter(|p| p.pid == cur.pid && p.at <= cur.at);
        let interval = prev.map(|p| cur.at - p.at);
        let reactors = cur
            .reactors
            .iter()
            .map(|r| {
                let before = prev.and_then(|p| p.reactors.iter().find(|b| b.index == r.index));
                ReactorRow {
                    index: r.index,
                    core: r.core,
                    mode: r.mode.clone(),
                    busy_pct: pct_of(r.busy_ns, before.map(|b| b.busy_ns), interval),
                    cpu_pct: pct_of(
                        r.user_ns + r.system_ns,
                        before.map(|b| b.user_ns + b.system_ns),
                        interval,
                    ),
                    sleeping: r.sleeping,
                    interrupt_mode_enabled: r.interrupt_mode_enabled,
                    wakeups_per_s: per_s(r.wakeups, before.map(|b| b.wakeups), interval),
                    threads: r.lw_threads.len(),
                    moved_in: r.threads_moved_in,
                    moved_out: r.threads_moved_out,
                }
            })
            .collect();
        let mut threads: Vec<ThreadRow> = cur
            .threads
            .iter()
            .map(|t| {
                let before = prev.and_then(|p| p.threads.iter().find(|b| b.id == t.id));
                ThreadRow {
                    id: t.id,
                    name: t.name.clone(),
                    reactor: t.reactor,
                    busy_pct: pct_of(t.busy_ns, before.map(|b| b.busy_ns), interval),
                    connections: t.sources,
                    moves: moves.get(&t.id).copied().unwrap_or(0),
                    wakeups_per_s: per_s(t.wakeups, before.map(|b| b.wakeups), interval),
                }
            })
            .collect();
        // The busiest first: they are what the operator looks for.
        threads.sort_by(|a, b| {
            b.busy_pct
                .unwrap_or(0.0)
                .total_cmp(&a.busy_pct.unwrap_or(0.0))
                .then(a.id.cmp(&b.id))
        });
        let mut volumes = Vec::new();
        let mut replicas = Vec::new();
        for v in &cur.volumes {
            let before = prev.and_then(|p| p.volumes.iter().find(|b| b.name == v.name));
            let s = &v.stats;
            let b = before.map(|b| &b.stats);
            volumes.push(VolumeRow {
                name: v.name.clone(),
                iops: per_s(s.reads + s.writes, b.map(|b| b.reads + b.writes), interval),
                read_mib_s: per_s(s.read_bytes, b.map(|b| b.read_bytes), interval).map(|r| r / MIB),
                write_mib_s: per_s(s.write_bytes, b.map(|b| b.write_bytes), interval)
                    .map(|r| r / MIB),
                p50_ns: s.latency.p50_ns,
                p99_ns: s.latency.p99_ns,
                in_flight: s.in_flight,
                connections: s.connections,
                errors: s.errors,
                health: health(&v.backend, v.replicas.as_deref()),
                qos: s.qos.limits.short(),
                throttled_ms_s: interval
                    .filter(|i| i.as_secs_f64() > 0.0)
                    .zip(b)
                    .map(|(i, b)| {
                        (s.qos.throttled_seconds - b.qos.throttled_seconds).max(0.0) * 1000.0
                            / i.as_secs_f64()
                    }),
            });
            for r in v.replicas.iter().flatten() {
                let earlier = before
                    .and_then(|b| b.replicas.as_ref())
                    .and_then(|rs| rs.iter().find(|e| e.addr == r.addr))
                    .and_then(|e| e.rebuild);
                let rebuild_mib_s = match r.rebuild {
                    Some(now) if earlier.is_some_and(|e| e.total_bytes == now.total_bytes) => {
                        per_s(now.done_bytes, earlier.map(|e| e.done_bytes), interval)
                            .map(|r| r / MIB)
                    }
                    _ => None,
                };
                replicas.push(ReplicaRow {
                    volume: v.name.clone(),
                    addr: r.addr.clone(),
                    state: r.state.clone(),
                    progress_pct: r.rebuild.map(progress_pct),
                    rebuild_mib_s,
                    generation: r.generation,
                    in_flight: r.in_flight,
                    errors: r.errors,
                    last_error: r.last_error.clone(),
                });
            }
        }
        Model {
            pid: cur.pid,
            interval,
            reactors,
            threads,
            volumes,
            volumes_left_out: cur.volumes_left_out,
            replicas,
            store: cur.store.clone(),
        }
    }

    /// The volumes that pass the filter, in the view's order.
    pub(crate) fn shown_volumes(&self, view: &View) -> Vec<&VolumeRow> {
        let mut rows: Vec<&VolumeRow> = self
            .volumes
            .iter()
            .filter(|v| view.keeps(&v.name))
            .collect();
        let num = |r: Rate| r.unwrap_or(-1.0);
        rows.sort_by(|a, b| {
            let order = match view.sort {
                SortKey::Iops => num(a.iops).total_cmp(&num(b.iops)),
                SortKey::Mibs => num(a.mib_s()).total_cmp(&num(b.mib_s())),
                SortKey::P99 => a.p99_ns.cmp(&b.p99_ns),
                SortKey::Inflight => a.in_flight.cmp(&b.in_flight),
                SortKey::Conns => a.connections.cmp(&b.connections),
                SortKey::Name => std::cmp::Ordering::Equal,
            };
            let order = if view.sort.descending() {
                order.reverse()
            } else {
                order
            };
            // Ties (and the name key) by name, so rows do not jump.
            let order = order.then_with(|| a.name.cmp(&b.name));
            if view.reversed {
                order.reverse()
            } else {
                order
            }
        });
        rows
    }
}

/// A key, as the view needs it (the terminal layer maps crossterm's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Key {
    Char(char),
    Enter,
    Esc,
    Backspace,
    /// Ctrl-C: raw mode turns it into a key instead of SIGINT.
    Interrupt,
}

/// What reaches the view's loop.
#[derive(Debug)]
pub(crate) enum Input {
    Key(Key),
    Sample(Result<Sample, SampleError>),
    /// The terminal changed size.
    Resize,
    /// SIGINT, SIGTERM or SIGHUP.
    Signal,
    /// The terminal could not be read.
    TerminalLost(String),
}

/// Why the view ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Exit {
    /// `q`, Ctrl-C or a signal: exit 0.
    Asked,
    /// The server or the terminal went away: this line, exit 1.
    Failed(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Action {
    Nothing,
    Redraw,
    Quit(Exit),
}

/// The interactive view's state: the last sample, the model drawn from
/// it, the thread moves seen, and the operator's view.
#[derive(Debug)]
pub(crate) struct Top {
    /// The server, as messages name it.
    pub server: String,
    pub view: View,
    pub model: Option<Model>,
    last: Option<Sample>,
    /// Per thread id: reactor changes seen between samples.
    moves: HashMap<u64, u64>,
}

impl Top {
    pub(crate) fn new(server: String, view: View) -> Top {
        Top {
            server,
            view,
            model: None,
            last: None,
            moves: HashMap::new(),
        }
    }

    pub(crate) fn apply(&mut self, input: Input) -> Action {
        let action = self.step(input);
        if cfg!(debug_assertions) {
            self.check_invariants();
        }
        action
    }

    /// The model is the last sample's; the filter within its bound; the
    /// moves counted only for threads that still exist.
    pub(crate) fn check_invariants(&self) {
        assert!(self.view.filter.chars().count() <= MAX_FILTER_LEN);
        assert_eq!(self.model.is_some(), self.last.is_some());
        if let (Some(model), Some(last)) = (&self.model, &self.last) {
            assert_eq!(model.pid, last.pid);
            assert_eq!(model.volumes.len(), last.volumes.len());
            assert!(self
                .moves
                .keys()
                .all(|id| last.threads.iter().any(|t| t.id == *id)));
        }
    }

    fn step(&mut self, input: Input) -> Action {
        match input {
            Input::Key(key) => self.key(key),
            Input::Sample(Ok(sample)) => {
                self.sampled(sample);
                Action::Redraw
            }
            Input::Sample(Err(e)) => Action::Quit(Exit::Failed(self.failure(&e))),
            Input::Resize => Action::Redraw,
            Input::Signal => Action::Quit(Exit::Asked),
            Input::TerminalLost(e) => Action::Quit(Exit::Failed(format!(
                "lull top: the terminal went away: {e}"
            ))),
        }
    }

    /// The one line printed when a sample fails.
    pub(crate) fn failure(&self, e: &SampleError) -> String {
        match e {
            // The connect error names the path again, with a hint for a
            // server that never ran: the cause alone says it here.
            SampleError::Gone(
                RpcClientError::Connect { source, .. } | RpcClientError::ConnectTcp { source, .. },
            ) if self.last.is_some() => {
                format!(
                    "lull top: the server at {} went away: {source}",
                    self.server
                )
            }
            SampleError::Gone(_) if self.last.is_some() => {
                format!("lull top: the server at {} went away: {e}", self.server)
            }
            SampleError::Gone(_) => {
                format!("lull top: cannot reach the server at {}: {e}", self.server)
            }
            _ => format!("lull top: cannot read the server at {}: {e}", self.server),
        }
    }

    /// Takes a new sample: counts thread moves, makes the model.
    pub(crate) fn sampled(&mut self, sample: Sample) {
        let prev = self.last.take().filter(|p| p.pid == sample.pid);
        if prev.is_none() {
            self.moves.clear();
        }
        if let Some(p) = &prev {
            for t in &sample.threads {
                if p.threads
                    .iter()
                    .any(|b| b.id == t.id && b.reactor != t.reactor)
                {
                    *self.moves.entry(t.id).or_default() += 1;
                }
            }
            // Threads that ended take their count with them.
            self.moves
                .retain(|id, _| sample.threads.iter().any(|t| t.id == *id));
        }
        self.model = Some(Model::between(prev.as_ref(), &sample, &self.moves));
        self.last = Some(sample);
    }

    fn key(&mut self, key: Key) -> Action {
        if key == Key::Interrupt {
            return Action::Quit(Exit::Asked);
        }
        if self.view.editing.is_some() {
            match key {
                Key::Enter => self.view.editing = None,
                Key::Esc => self.view.filter = self.view.editing.take().unwrap_or_default(),
                Key::Backspace => {
                    self.view.filter.pop();
                }
                Key::Char(c) if !c.is_control() => {
                    if self.view.filter.chars().count() < MAX_FILTER_LEN {
                        self.view.filter.push(c);
                    }
                }
                _ => return Action::Nothing,
            }
            return Action::Redraw;
        }
        match key {
            Key::Char('q') => Action::Quit(Exit::Asked),
            Key::Char('s') => {
                self.view.sort = self.view.sort.next();
                Action::Redraw
            }
            Key::Char('r') => {
                self.view.reversed = !self.view.reversed;
                Action::Redraw
            }
            Key::Char('/') => {
                self.view.editing = Some(std::mem::take(&mut self.view.filter));
                Action::Redraw
            }
            Key::Esc if !self.view.filter.is_empty() => {
                self.view.filter.clear();
                Action::Redraw
            }
            _ => Action::Nothing,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::Instant;

    use super::super::sample::{Reactor, Thread, Volume, VolumeStats};
    use super::*;

    /// A sample `secs` after `base`: one reactor busy `busy_ns` so far,
    /// one thread on `reactor`, volumes (name, reads, read bytes).
    pub(crate) fn sample(
        base: Instant,
        secs: u64,
        busy_ns: u64,
        reactor: usize,
        volumes: &[(&str, u64, u64)],
    ) -> Sample {
        Sample {
            at: base + Duration::from_secs(secs),
            pid: 42,
            reactors: vec![Reactor {
                index: 0,
                core: 3,
                mode: "adaptive".into(),
                busy_ns,
                wakeups: busy_ns / 1000,
                ..Reactor::default()
            }],
            threads: vec![Thread {
                id: 1,
                name: "nbd-group-0".into(),
                reactor,
                busy_ns,
                sources: 2,
                ..Thread::default()
            }],
            volumes: volumes
                .iter()
                .map(|(name, reads, read_bytes)| Volume {
                    name: name.to_string(),
                    backend: "malloc".into(),
                    stats: VolumeStats {
                        reads: *reads,
                        read_bytes: *read_bytes,
                        ..VolumeStats::default()
                    },
                    replicas: None,
                })
                .collect(),
            volumes_left_out: 0,
            store: None,
        }
    }

    #[test]
    fn rates_are_deltas_over_the_interval() {
        let t0 = Instant::now();
        let a = sample(t0, 0, 0, 0, &[("v", 100, 0)]);
        let b = sample(t0, 2, 500_000_000, 0, &[("v", 2100, 8 << 20)]);
        let m = Model::between(Some(&a), &b, &HashMap::new());
        assert_eq!(m.interval, Some(Duration::from_secs(2)));
        assert_eq!(m.volumes[0].iops, Some(1000.0));
        assert_eq!(m.volumes[0].read_mib_s, Some(4.0));
        assert_eq!(m.reactors[0].busy_pct, Some(25.0));
        assert_eq!(m.reactors[0].wakeups_per_s, Some(250_000.0));
        assert_eq!(m.threads[0].busy_pct, Some(25.0));
        // No earlier sample, or another server's: no rates.
        let first = Model::between(None, &b, &HashMap::new());
        assert_eq!(first.volumes[0].iops, None);
        let mut restarted = a.clone();
        restarted.pid = 43;
        assert_eq!(
            Model::between(Some(&restarted), &b, &HashMap::new()).volumes[0].iops,
            None
        );
        // A counter that went back (the volume made again) counts from 0.
        let c = sample(t0, 3, 500_000_000, 0, &[("v", 10, 0)]);
        assert_eq!(
            Model::between(Some(&b), &c, &HashMap::new()).volumes[0].iops,
            Some(10.0)
        );
    }

    #[test]
    fn health_of_replicated_volumes() {
        let r = |state: &str, done: Option<u64>| Replica {
            addr: "a".into(),
            state: state.into(),
            rebuild: done.map(|d| Progress {
                done_bytes: d,
                total_bytes: 200,
            }),
            ..Replica::default()
        };
        assert_eq!(health("file=/x,direct", None), Health::Local("file".into()));
        assert_eq!(
            health("r", Some(&[r("healthy", None), r("healthy", None)])),
            Health::Healthy
        );
        assert_eq!(
            health("r", Some(&[r("healthy", None), r("failed", None)])),
            Health::Degraded {
                healthy: 1,
                total: 2
            }
        );
        assert_eq!(
            health("r", Some(&[r("healthy", None), r("rebuilding", Some(50))])),
            Health::Rebuilding { pct: 25.0 }
        );
        assert_eq!(
            health("r", Some(&[])),
            Health::Degraded {
                healthy: 0,
                total: 0
            }
        );
    }

    fn volumes(top: &Top) -> Vec<String> {
        top.model
            .as_ref()
            .unwrap()
            .shown_volumes(&top.view)
            .iter()
            .map(|v| v.name.clone())
            .collect()
    }

    #[test]
    fn keys_sort_reverse_filter_and_quit() {
        let t0 = Instant::now();
        let mut top = Top::new("sock".into(), View::default());
        let vols = |k: u64| [("a", 0, 0), ("b", 300 * k, 0), ("c", 100 * k, k << 30)];
        top.apply(Input::Sample(Ok(sample(t0, 0, 0, 0, &vols(0)))));
        assert_eq!(volumes(&top), ["a", "b", "c"], "no rates yet: by name");
        top.apply(Input::Sample(Ok(sample(t0, 1, 0, 0, &vols(1)))));
        assert_eq!(volumes(&top), ["b", "c", "a"], "iops, busiest first");
        assert_eq!(top.apply(Input::Key(Key::Char('s'))), Action::Redraw);
        assert_eq!(top.view.sort, SortKey::Mibs);
        assert_eq!(volumes(&top), ["c", "a", "b"]);
        top.apply(Input::Key(Key::Char('r')));
        assert_eq!(volumes(&top), ["b", "a", "c"]);
        top.apply(Input::Key(Key::Char('r')));
        for _ in 0..4 {
            top.apply(Input::Key(Key::Char('s')));
        }
        assert_eq!(top.view.sort, SortKey::Name);
        assert_eq!(volumes(&top), ["a", "b", "c"]);
        top.apply(Input::Key(Key::Char('s')));
        assert_eq!(top.view.sort, SortKey::Iops, "the cycle wraps");

        // `/` types a filter, live; Enter keeps it, Esc clears it.
        top.apply(Input::Key(Key::Char('/')));
        for c in "B".chars() {
            top.apply(Input::Key(Key::Char(c)));
        }
        assert_eq!(volumes(&top), ["b"], "case-insensitive, as typed");
        top.apply(Input::Key(Key::Char('q')));
        assert_eq!(top.view.filter, "Bq", "q is text while typing");
        top.apply(Input::Key(Key::Backspace));
        top.apply(Input::Key(Key::Enter));
        assert_eq!(top.view.editing, None);
        assert_eq!(volumes(&top), ["b"]);
        top.apply(Input::Key(Key::Char('/')));
        top.apply(Input::Key(Key::Char('x')));
        top.apply(Input::Key(Key::Esc));
        assert_eq!(top.view.filter, "B", "Esc while typing goes back");
        top.apply(Input::Key(Key::Esc));
        assert_eq!(top.view.filter, "");
        assert_eq!(top.apply(Input::Key(Key::Char('x'))), Action::Nothing);
        assert_eq!(
            top.apply(Input::Key(Key::Char('q'))),
            Action::Quit(Exit::Asked)
        );
        assert_eq!(
            top.apply(Input::Key(Key::Interrupt)),
            Action::Quit(Exit::Asked)
        );
        assert_eq!(top.apply(Input::Signal), Action::Quit(Exit::Asked));
    }

    #[test]
    fn a_failed_sample_ends_with_one_line() {
        let mut top = Top::new("/tmp/x.sock".into(), View::default());
        let gone = || Input::Sample(Err(SampleError::Gone(lull_rpc::RpcClientError::Closed)));
        let Action::Quit(Exit::Failed(line)) = top.apply(gone()) else {
            panic!("a failed first sample quits");
        };
        assert!(line.starts_with("lull top: cannot reach the server at /tmp/x.sock: "));
        top.apply(Input::Sample(Ok(sample(Instant::now(), 0, 0, 0, &[]))));
        let Action::Quit(Exit::Failed(line)) = top.apply(gone()) else {
            panic!("a failed sample quits");
        };
        assert_eq!(
            line,
            "lull top: the server at /tmp/x.sock went away: the server closed the connection without a response"
        );
        assert!(!line.contains('\n'));
    }

    #[test]
    fn thread_moves_are_counted_between_samples() {
        let t0 = Instant::now();
        let mut top = Top::new("s".into(), View::default());
        for (secs, reactor) in [(0, 0), (1, 1), (2, 1), (3, 0)] {
            top.apply(Input::Sample(Ok(sample(t0, secs, 0, reactor, &[]))));
        }
        assert_eq!(top.model.as_ref().unwrap().threads[0].moves, 2);
        let mut other = sample(t0, 4, 0, 1, &[]);
        other.pid = 9;
        top.apply(Input::Sample(Ok(other)));
        assert_eq!(
            top.model.as_ref().unwrap().threads[0].moves,
            0,
            "another server starts again"
        );
    }
}
