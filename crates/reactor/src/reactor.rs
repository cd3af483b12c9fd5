//! Reactors: one pinned OS thread per core, each running the lull threads
//! placed on it, in one of the event modes.
//!
//! ```ignore
//! let fw = Framework::start(FrameworkConfig::new(vec![0, 1], Mode::Interrupt))?;
//! let t = fw.handle().spawn_thread(1, "worker", |t| { /* register pollers */ })?;
//! t.send(|t| tracing::info!("hello from {}", t.name()))?;
//! fw.stop();
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::adaptive::{Adaptive, AdaptiveStatus, Regime, Switch, SwitchReason, WakeCost};
use crate::clock::{Clock, MonotonicClock};
use crate::governor::{Cpufreq, Governor};
use crate::scheduler::{self, CoreLoad, DynamicParams, Policy, ThreadLoad};
use crate::sys::{self, event_buffer, Epoll, Interest, ThreadUsage};
use crate::thread::{
    Host, Mailbox, Message, PollStatus, Scope, Thread, ThreadHandle, ThreadShared, ThreadStats,
};
use crate::ReactorError;

/// Control commands queued per reactor. Few are ever in flight (spawns, mode
/// switches, stop); the bound only guards against a runaway producer.
const CONTROL_QUEUE_CAPACITY: usize = 4096;

/// Control commands handled per iteration, for the same reason as
/// `thread::MSG_BATCH`: control traffic must not starve I/O.
const CONTROL_BATCH: usize = 8;

/// Epoll events taken per reactor wait: one per ready lull thread.
const REACTOR_EVENT_BATCH: usize = 128;

/// How often a reactor refreshes its getrusage counters. A syscall per
/// iteration would cost more than the iteration; 50 ms keeps stats fresh for
/// a 1 s scheduling period.
const USAGE_REFRESH_NS: u64 = 50_000_000;

/// A reactor thread's fixed I/O buffer arena, as
/// [`FrameworkConfig::fixed_buffer_source`] reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FixedBufferUsage {
    /// Bytes mapped and prefaulted (0: the reactor has no arena).
    pub bytes: u64,
    /// Of them, in buffers handed out now.
    pub in_use_bytes: u64,
    /// Locked in memory (mlock succeeded).
    pub locked: bool,
}

/// Messages still run per thread at shutdown, so that a stop does not lose
/// work that was already accepted; a bound so a self-feeding thread cannot
/// hold the stop forever.
const SHUTDOWN_MESSAGE_LIMIT: usize = 1 << 20;

const TOKEN_CONTROL: u64 = u64::MAX;

/// Default period of the hybrid mode's initiator poll (Longhorn's
/// `data-engine-nvme-ioq-poll-period-us` default).
pub const DEFAULT_IOQ_POLL_PERIOD_US: u64 = 100;

/// What a reactor does when it has no work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Never sleep: every iteration looks for ready fds (`epoll_wait(0)`)
    /// and runs the pollers that have no fd (lowest latency, a full core).
    Poll,
    /// Block in epoll_wait on the fds of its threads' pollers.
    Interrupt,
    /// Interrupt for target-side sources; initiator-side sources (replica
    /// connections) drained by a timed poll every `ioq_poll_period_us`.
    Hybrid,
    /// Poll while polling pays, sleep when it does not (see
    /// [`crate::adaptive`]).
    Adaptive,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Poll, Mode::Interrupt, Mode::Hybrid, Mode::Adaptive];

    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Poll => "poll",
            Mode::Interrupt => "interrupt",
            Mode::Hybrid => "hybrid",
            Mode::Adaptive => "adaptive",
        }
    }

    /// Whether the reactor may sleep (so every active poller needs an fd).
    pub fn event_driven(self) -> bool {
        self != Mode::Poll
    }

    fn to_u8(self) -> u8 {
        match self {
            Mode::Poll => 0,
            Mode::Interrupt => 1,
            Mode::Hybrid => 2,
            Mode::Adaptive => 3,
        }
    }

    fn from_u8(v: u8) -> Mode {
        match v {
            1 => Mode::Interrupt,
            2 => Mode::Hybrid,
            3 => Mode::Adaptive,
            _ => Mode::Poll,
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        Mode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| {
                format!("unknown mode {s:?} (expected poll, interrupt, hybrid or adaptive)")
            })
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Framework settings.
#[derive(Debug, Clone)]
pub struct FrameworkConfig {
    /// One reactor per entry; the first is the main reactor.
    pub cores: Vec<usize>,
    pub mode: Mode,
    /// Pin each reactor to its core (tests on a busy machine may turn it off).
    pub pin: bool,
    /// Hybrid mode's initiator poll period (≥ 1).
    pub ioq_poll_period_us: u64,
    /// Which scheduler runs, and how often.
    pub scheduler: SchedulerConfig,
    /// Where a reactor reads its OS thread's `io_uring_enter` count for
    /// `ReactorStats::io_uring_enters`, called on the reactor's own thread
    /// when it publishes its getrusage counters (the binary passes
    /// `lull_uring::thread_enter_calls`: this crate sits below the one that
    /// owns the rings, so the count comes in as a function). `None`: the
    /// counter stays 0.
    pub io_uring_enter_source: Option<fn() -> u64>,
    /// Run once on every reactor thread with its index, after pinning and
    /// before it takes any lull thread (and before `Framework::start`
    /// returns). The binary maps the thread's fixed I/O buffer arena there,
    /// so its pages come from the core's memory node.
    pub reactor_start_hook: Option<fn(usize)>,
    /// Where a reactor reads its thread's fixed buffer arena for
    /// `ReactorStats::fixed_buffers`, called on the reactor's own thread as
    /// `io_uring_enter_source` is (the binary reports
    /// `lull_uring::thread_arena_stats`). `None`: the figures stay zero.
    pub fixed_buffer_source: Option<fn() -> FixedBufferUsage>,
    /// A reactor that does not answer the watchdog's heartbeat this long is
    /// reported as stalled (`crate::watchdog`); 0: no watchdog.
    pub stall_threshold_ms: u64,
}

/// The scheduler and its period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub policy: Policy,
    pub period_us: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            policy: Policy::Static,
            period_us: scheduler::DEFAULT_PERIOD_US,
        }
    }
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<(), ReactorError> {
        if !(scheduler::MIN_PERIOD_US..=scheduler::MAX_PERIOD_US).contains(&self.period_us) {
            return Err(ReactorError::Config(format!(
                "scheduler period {} µs is outside {}..={} µs",
                self.period_us,
                scheduler::MIN_PERIOD_US,
                scheduler::MAX_PERIOD_US
            )));
        }
        if let Policy::Dynamic(p) = &self.policy {
            p.validate().map_err(ReactorError::Config)?;
        }
        Ok(())
    }
}

/// What `framework_get_scheduler` reports.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerInfo {
    pub config: SchedulerConfig,
    /// The dynamic scheduler's tunables (kept while `static` runs, so a
    /// switch back finds them).
    pub dynamic: DynamicParams,
    /// "cpufreq", or "unsupported: why".
    pub governor: String,
    /// Scheduling periods completed, and threads moved in total.
    pub rounds: u64,
    pub moves: u64,
}

impl FrameworkConfig {
    pub fn new(cores: Vec<usize>, mode: Mode) -> FrameworkConfig {
        FrameworkConfig {
            cores,
            mode,
            pin: true,
            ioq_poll_period_us: DEFAULT_IOQ_POLL_PERIOD_US,
            scheduler: SchedulerConfig::default(),
            io_uring_enter_source: None,
            reactor_start_hook: None,
            fixed_buffer_source: None,
            stall_threshold_ms: crate::watchdog::DEFAULT_STALL_THRESHOLD_MS,
        }
    }
}

type ModeReply = Box<dyn FnOnce(Result<(), ReactorError>) + Send>;

enum Control {
    AddThread(Box<Thread>),
    /// The scheduler's decision: hand thread `id` to reactor `to`.
    MoveThread {
        id: u64,
        to: usize,
    },
    SetMode(Mode, u64, ModeReply),
    /// The watchdog's heartbeat: answered by storing its sequence number.
    Heartbeat(u64),
    Stop,
}

#[derive(Default)]
struct ReactorCounters {
    busy_ns: AtomicU64,
    idle_ns: AtomicU64,
    iterations: AtomicU64,
    wakeups: AtomicU64,
    threads: AtomicU64,
    mode: AtomicU8,
    ioq_poll_period_us: AtomicU64,
    spins_with_work: AtomicU64,
    spins_idle: AtomicU64,
    spin_ns_with_work: AtomicU64,
    spin_ns_idle: AtomicU64,
    spin_window_ns: AtomicU64,
    wake_latency_ns: AtomicU64,
    wake_cpu_ns: AtomicU64,
    adaptive: AdaptiveCounters,
    ready_events: AtomicU64,
    tid: AtomicU64,
    user_ns: AtomicU64,
    system_ns: AtomicU64,
    voluntary_ctxsw: AtomicU64,
    involuntary_ctxsw: AtomicU64,
    minor_faults: AtomicU64,
    major_faults: AtomicU64,
    io_uring_enters: AtomicU64,
    fixed_buffer_bytes: AtomicU64,
    fixed_buffer_in_use_bytes: AtomicU64,
    fixed_buffer_locked: AtomicBool,
    sleeping: AtomicBool,
    threads_moved_in: AtomicU64,
    threads_moved_out: AtomicU64,
    /// The last heartbeat answered (`crate::watchdog`).
    heartbeat_answered: AtomicU64,
    /// Blocked in `epoll_wait`: idle, so not stalled.
    waiting: AtomicBool,
    /// The lull thread running now (its id; 0: none) and since when.
    running_thread: AtomicU64,
    running_since_ns: AtomicU64,
    /// When the stall being reported began (0: none), and stalls so far.
    stalled_since_ns: AtomicU64,
    stalls: AtomicU64,
}

/// The adaptive decision as a reactor publishes it (`AdaptiveStatus` in
/// atomics), after each decision: once per idle period, never while work
/// is found on every look.
#[derive(Default)]
struct AdaptiveCounters {
    spinning: AtomicBool,
    /// The regime a probe tries (`regime_code`; 0: none).
    probing: AtomicU8,
    /// A probe found the other regime cheaper; the next confirms or not.
    confirming: AtomicBool,
    /// Costs in percent of the busy time; `NONE` before measured.
    spin_cost_pct: AtomicU64,
    sleep_cost_pct: AtomicU64,
    gap_ns: AtomicU64,
    switches: AtomicU64,
    probes: AtomicU64,
    /// `SwitchReason::code` (0: none yet) and the switch's figures.
    last_reason: AtomicU8,
    last_at_ns: AtomicU64,
    last_spin_cost_pct: AtomicU64,
    last_sleep_cost_pct: AtomicU64,
    last_gap_ns: AtomicU64,
}

/// An unmeasured cost in `AdaptiveCounters`.
const NONE: u64 = u64::MAX;

fn regime_code(r: Option<Regime>) -> u8 {
    match r {
        None => 0,
        Some(Regime::Sleep) => 1,
        Some(Regime::Spin) => 2,
    }
}

fn regime_from_code(c: u8) -> Option<Regime> {
    match c {
        1 => Some(Regime::Sleep),
        2 => Some(Regime::Spin),
        _ => None,
    }
}

impl AdaptiveCounters {
    fn store(&self, s: &AdaptiveStatus) {
        let r = Ordering::Relaxed;
        self.spinning.store(s.regime == Regime::Spin, r);
        self.probing.store(regime_code(s.probing), r);
        self.confirming.store(s.confirming, r);
        self.spin_cost_pct.store(s.spin_cost_pct.unwrap_or(NONE), r);
        self.sleep_cost_pct
            .store(s.sleep_cost_pct.unwrap_or(NONE), r);
        self.gap_ns.store(s.gap_ns, r);
        self.switches.store(s.switches, r);
        self.probes.store(s.probes, r);
        if let Some(w) = s.last_switch {
            self.last_at_ns.store(w.at_ns, r);
            self.last_spin_cost_pct
                .store(w.spin_cost_pct.unwrap_or(NONE), r);
            self.last_sleep_cost_pct
                .store(w.sleep_cost_pct.unwrap_or(NONE), r);
            self.last_gap_ns.store(w.gap_ns, r);
            self.last_reason.store(w.reason.code(), r);
        }
    }

    fn load(&self, wake: WakeCost, window_ns: u64) -> AdaptiveStatus {
        let r = Ordering::Relaxed;
        let opt = |a: &AtomicU64| Some(a.load(r)).filter(|&v| v != NONE);
        AdaptiveStatus {
            regime: if self.spinning.load(r) {
                Regime::Spin
            } else {
                Regime::Sleep
            },
            probing: regime_from_code(self.probing.load(r)),
            confirming: self.confirming.load(r),
            spin_cost_pct: opt(&self.spin_cost_pct),
            sleep_cost_pct: opt(&self.sleep_cost_pct),
            gap_ns: self.gap_ns.load(r),
            wake,
            spin_below_ns: wake.spin_below_ns(),
            sleep_above_ns: wake.sleep_above_ns(),
            window_ns,
            switches: self.switches.load(r),
            probes: self.probes.load(r),
            last_switch: SwitchReason::from_code(self.last_reason.load(r)).map(|reason| Switch {
                reason,
                at_ns: self.last_at_ns.load(r),
                spin_cost_pct: opt(&self.last_spin_cost_pct),
                sleep_cost_pct: opt(&self.last_sleep_cost_pct),
                gap_ns: self.last_gap_ns.load(r),
            }),
        }
    }
}

/// A snapshot of one reactor's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReactorStats {
    pub index: usize,
    pub core: usize,
    pub tid: u64,
    pub mode: Mode,
    pub ioq_poll_period_us: u64,
    pub threads: u64,
    /// Adaptive mode: spins ended by an event (a wake-up saved) ...
    pub spins_with_work: u64,
    /// ... and spins that found nothing before the window closed.
    pub spins_idle: u64,
    /// Time spent spinning in the adaptive mode (both kinds).
    pub spin_ns: u64,
    /// Time spent in spins that found work ...
    pub spin_ns_with_work: u64,
    /// ... and in spins that found none (the CPU adaptive paid for nothing).
    pub spin_ns_idle: u64,
    /// The spin window the adaptive decision chose last (0: sleep at once).
    pub spin_window_ns: u64,
    /// What a sleep-and-wake costs on this reactor's core, as measured:
    /// latency to the event ...
    pub wake_latency_ns: u64,
    /// ... and CPU.
    pub wake_cpu_ns: u64,
    /// The adaptive decision: its regime, the gaps and wake-up cost it
    /// rests on, and the last switch (meaningful in adaptive mode; see
    /// [`ReactorStats::adaptive_regime`]).
    pub adaptive: AdaptiveStatus,
    /// Lull threads the reactor's epoll reported ready, in total (divide by
    /// `iterations` for ready threads per iteration).
    pub ready_events: u64,
    pub busy_ns: u64,
    pub idle_ns: u64,
    pub iterations: u64,
    pub wakeups: u64,
    pub user_ns: u64,
    pub system_ns: u64,
    pub voluntary_ctxsw: u64,
    pub involuntary_ctxsw: u64,
    pub minor_faults: u64,
    pub major_faults: u64,
    /// `io_uring_enter` calls made on this reactor's OS thread through
    /// lull's rings (file channels: submits, and polls of IOPOLL rings).
    pub io_uring_enters: u64,
    /// The reactor thread's fixed I/O buffer arena (refreshed with the
    /// getrusage counters).
    pub fixed_buffers: FixedBufferUsage,
    /// No thread: blocked until one arrives (≈ 0 CPU, in any mode).
    pub sleeping: bool,
    /// Threads the scheduler moved here and away.
    pub threads_moved_in: u64,
    pub threads_moved_out: u64,
    /// How long the reactor has not answered the watchdog's heartbeat,
    /// while that is longer than the stall threshold (0: not stalled).
    pub stalled_ms: u64,
    /// Stalls reported since start.
    pub stalls: u64,
}

impl ReactorStats {
    /// Longhorn's `InterruptModeEnabled`.
    pub fn interrupt_mode_enabled(&self) -> bool {
        self.mode.event_driven()
    }

    /// The adaptive regime, in adaptive mode only.
    pub fn adaptive_regime(&self) -> Option<Regime> {
        (self.mode == Mode::Adaptive).then_some(self.adaptive.regime)
    }
}

struct ReactorShared {
    index: usize,
    core: usize,
    control: Mailbox<Control>,
    counters: ReactorCounters,
}

struct FrameworkShared {
    reactors: Vec<Arc<ReactorShared>>,
    next_thread_id: AtomicU64,
    /// Round-robin placement of new threads ([`FrameworkHandle::next_reactor`]).
    next_placement: AtomicU64,
    threads: Mutex<HashMap<u64, Arc<ThreadShared>>>,
    clock: Arc<dyn Clock>,
    sched: Mutex<SchedState>,
    sched_wake: Condvar,
    /// Set at stop: the watchdog exits (woken through `watchdog_wake`; a
    /// condvar serves one mutex).
    watchdog_stop: Mutex<bool>,
    watchdog_wake: Condvar,
}

struct SchedState {
    config: SchedulerConfig,
    dynamic: DynamicParams,
    governor: String,
    rounds: u64,
    moves: u64,
    /// The config changed: start a new period.
    changed: bool,
    stop: bool,
}

/// A cloneable reference to the running framework, for spawning threads,
/// switching modes and reading stats from any thread.
#[derive(Clone)]
pub struct FrameworkHandle {
    shared: Arc<FrameworkShared>,
}

impl std::fmt::Debug for FrameworkHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FrameworkHandle({} reactors)",
            self.shared.reactors.len()
        )
    }
}

impl FrameworkHandle {
    pub fn reactor_count(&self) -> usize {
        self.shared.reactors.len()
    }

    /// Where to start the next thread that may go anywhere: the reactors
    /// in turn (SPDK places new threads round robin too).
    pub fn next_reactor(&self) -> usize {
        let n = self.shared.reactors.len() as u64;
        (self.shared.next_placement.fetch_add(1, Ordering::Relaxed) % n) as usize
    }

    pub fn clock(&self) -> Arc<dyn Clock> {
        self.shared.clock.clone()
    }

    /// Create a lull thread on reactor `reactor`; `init` is its first message.
    pub fn spawn_thread(
        &self,
        reactor: usize,
        name: &str,
        init: impl FnOnce(&mut Thread) + Send + 'static,
    ) -> Result<ThreadHandle, ReactorError> {
        self.spawn_thread_with_mailbox(reactor, name, crate::thread::MSG_QUEUE_CAPACITY, init)
    }

    /// `spawn_thread` with a message queue of `capacity` messages: for
    /// threads that receive only a few wake-ups (a connection), so they do
    /// not carry the default queue's 1.5 MiB.
    pub fn spawn_thread_with_mailbox(
        &self,
        reactor: usize,
        name: &str,
        capacity: usize,
        init: impl FnOnce(&mut Thread) + Send + 'static,
    ) -> Result<ThreadHandle, ReactorError> {
        let target = self
            .shared
            .reactors
            .get(reactor)
            .ok_or(ReactorError::NoSuchReactor(reactor))?;
        let id = self.shared.next_thread_id.fetch_add(1, Ordering::Relaxed);
        let mut thread = Thread::with_mailbox(id, name, capacity)?;
        thread.attach(Arc::new(self.clone()));
        let handle = thread.handle();
        handle
            .send(init)
            .map_err(|e| ReactorError::Spawn(e.to_string()))?;
        self.shared
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, handle.shared.clone());
        if target
            .control
            .push(Control::AddThread(Box::new(thread)))
            .is_err()
        {
            self.forget_thread(id);
            return Err(ReactorError::ControlQueueFull(reactor));
        }
        Ok(handle)
    }

    fn forget_thread(&self, id: u64) {
        self.shared
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }

    /// Switch one reactor's mode (and the hybrid poll period); `done` runs
    /// on that reactor with the result.
    pub fn set_mode_async(
        &self,
        reactor: usize,
        mode: Mode,
        ioq_poll_period_us: u64,
        done: impl FnOnce(Result<(), ReactorError>) + Send + 'static,
    ) -> Result<(), ReactorError> {
        if ioq_poll_period_us == 0 {
            return Err(ReactorError::Config(
                "nvme_ioq_poll_period_us must be at least 1".into(),
            ));
        }
        let target = self
            .shared
            .reactors
            .get(reactor)
            .ok_or(ReactorError::NoSuchReactor(reactor))?;
        target
            .control
            .push(Control::SetMode(mode, ioq_poll_period_us, Box::new(done)))
            .map_err(|_| ReactorError::ControlQueueFull(reactor))
    }

    /// Switch one reactor's mode, keeping its poll period, and wait for it
    /// (never call on a reactor).
    pub fn set_mode(&self, reactor: usize, mode: Mode) -> Result<(), ReactorError> {
        let period = self
            .shared
            .reactors
            .get(reactor)
            .ok_or(ReactorError::NoSuchReactor(reactor))?
            .counters
            .ioq_poll_period_us
            .load(Ordering::Relaxed);
        self.set_mode_with_period(reactor, mode, period)
    }

    /// Switch one reactor's mode and hybrid poll period, and wait for it.
    pub fn set_mode_with_period(
        &self,
        reactor: usize,
        mode: Mode,
        ioq_poll_period_us: u64,
    ) -> Result<(), ReactorError> {
        let (tx, rx) = mpsc::channel();
        self.set_mode_async(reactor, mode, ioq_poll_period_us, move |r| {
            let _ = tx.send(r);
        })?;
        rx.recv_timeout(Duration::from_secs(10))
            .map_err(|_| ReactorError::Stopped)?
    }

    /// Switch every reactor; stops at the first refusal.
    pub fn set_mode_all(&self, mode: Mode, ioq_poll_period_us: u64) -> Result<(), ReactorError> {
        (0..self.reactor_count())
            .try_for_each(|r| self.set_mode_with_period(r, mode, ioq_poll_period_us))
    }

    pub fn reactor_stats(&self) -> Vec<ReactorStats> {
        self.shared
            .reactors
            .iter()
            .map(|r| {
                let c = &r.counters;
                let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
                ReactorStats {
                    index: r.index,
                    core: r.core,
                    tid: g(&c.tid),
                    mode: Mode::from_u8(c.mode.load(Ordering::Relaxed)),
                    ioq_poll_period_us: g(&c.ioq_poll_period_us),
                    threads: g(&c.threads),
                    spins_with_work: g(&c.spins_with_work),
                    spins_idle: g(&c.spins_idle),
                    spin_ns: g(&c.spin_ns_with_work) + g(&c.spin_ns_idle),
                    spin_ns_with_work: g(&c.spin_ns_with_work),
                    spin_ns_idle: g(&c.spin_ns_idle),
                    spin_window_ns: g(&c.spin_window_ns),
                    wake_latency_ns: g(&c.wake_latency_ns),
                    wake_cpu_ns: g(&c.wake_cpu_ns),
                    adaptive: c.adaptive.load(
                        WakeCost {
                            latency_ns: g(&c.wake_latency_ns),
                            cpu_ns: g(&c.wake_cpu_ns),
                        },
                        g(&c.spin_window_ns),
                    ),
                    ready_events: g(&c.ready_events),
                    busy_ns: g(&c.busy_ns),
                    idle_ns: g(&c.idle_ns),
                    iterations: g(&c.iterations),
                    wakeups: g(&c.wakeups),
                    user_ns: g(&c.user_ns),
                    system_ns: g(&c.system_ns),
                    voluntary_ctxsw: g(&c.voluntary_ctxsw),
                    involuntary_ctxsw: g(&c.involuntary_ctxsw),
                    minor_faults: g(&c.minor_faults),
                    major_faults: g(&c.major_faults),
                    io_uring_enters: g(&c.io_uring_enters),
                    fixed_buffers: FixedBufferUsage {
                        bytes: g(&c.fixed_buffer_bytes),
                        in_use_bytes: g(&c.fixed_buffer_in_use_bytes),
                        locked: c.fixed_buffer_locked.load(Ordering::Relaxed),
                    },
                    sleeping: c.sleeping.load(Ordering::Relaxed),
                    threads_moved_in: g(&c.threads_moved_in),
                    threads_moved_out: g(&c.threads_moved_out),
                    stalled_ms: match g(&c.stalled_since_ns) {
                        0 => 0,
                        since => self.shared.clock.now_ns().saturating_sub(since) / 1_000_000,
                    },
                    stalls: g(&c.stalls),
                }
            })
            .collect()
    }

    /// Switch the scheduler or its period (at once: a new period starts).
    pub fn set_scheduler(&self, config: SchedulerConfig) -> Result<(), ReactorError> {
        config.validate()?;
        let mut st = lock(&self.shared.sched);
        if let Policy::Dynamic(p) = config.policy {
            st.dynamic = p;
        }
        st.config = config;
        st.changed = true;
        drop(st);
        self.shared.sched_wake.notify_all();
        tracing::info!(
            scheduler = config.policy.name(),
            period_us = config.period_us,
            "scheduler set"
        );
        Ok(())
    }

    pub fn scheduler_info(&self) -> SchedulerInfo {
        let st = lock(&self.shared.sched);
        SchedulerInfo {
            config: st.config,
            dynamic: st.dynamic,
            governor: st.governor.clone(),
            rounds: st.rounds,
            moves: st.moves,
        }
    }

    pub fn thread_stats(&self) -> Vec<ThreadStats> {
        let threads = self
            .shared
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<ThreadStats> = threads
            .values()
            .map(|s| ThreadHandle { shared: s.clone() }.stats())
            .collect();
        out.sort_by_key(|s| s.id);
        out
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Host for FrameworkHandle {
    fn spawn(
        &self,
        reactor: usize,
        name: &str,
        init: Message,
    ) -> Result<ThreadHandle, ReactorError> {
        self.spawn_thread(reactor, name, init)
    }
}

/// The running framework: owns the reactor OS threads and the scheduler's.
pub struct Framework {
    handle: FrameworkHandle,
    watchdog: Option<std::thread::JoinHandle<()>>,
    joins: Vec<JoinHandle<()>>,
    scheduler: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Framework {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.handle.fmt(f)
    }
}

impl Framework {
    /// Start one reactor per configured core and wait until all run.
    pub fn start(config: FrameworkConfig) -> Result<Framework, ReactorError> {
        Self::start_with_clock(config, Arc::new(MonotonicClock))
    }

    pub fn start_with_clock(
        config: FrameworkConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Framework, ReactorError> {
        if config.cores.is_empty() {
            return Err(ReactorError::Config("at least one core is needed".into()));
        }
        if config.ioq_poll_period_us == 0 {
            return Err(ReactorError::Config(
                "nvme_ioq_poll_period_us must be at least 1".into(),
            ));
        }
        config.scheduler.validate()?;
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = config.cores.iter().find(|c| !seen.insert(**c)) {
            return Err(ReactorError::Config(format!("core {dup} is listed twice")));
        }
        if config.pin {
            let allowed = sys::allowed_cpus().map_err(ReactorError::Sys)?;
            if let Some(bad) = config.cores.iter().find(|c| !allowed.contains(c)) {
                return Err(ReactorError::Config(format!(
                    "core {bad} is not available (allowed: {allowed:?})"
                )));
            }
        }
        let mut reactors = Vec::new();
        for (index, &core) in config.cores.iter().enumerate() {
            let shared = Arc::new(ReactorShared {
                index,
                core,
                control: Mailbox::new(CONTROL_QUEUE_CAPACITY).map_err(ReactorError::Sys)?,
                counters: ReactorCounters::default(),
            });
            shared
                .counters
                .mode
                .store(config.mode.to_u8(), Ordering::Relaxed);
            shared
                .counters
                .ioq_poll_period_us
                .store(config.ioq_poll_period_us, Ordering::Relaxed);
            reactors.push(shared);
        }
        let handle = FrameworkHandle {
            shared: Arc::new(FrameworkShared {
                reactors,
                next_thread_id: AtomicU64::new(1),
                next_placement: AtomicU64::new(0),
                threads: Mutex::new(HashMap::new()),
                clock,
                sched: Mutex::new(SchedState {
                    config: config.scheduler,
                    dynamic: match config.scheduler.policy {
                        Policy::Dynamic(p) => p,
                        Policy::Static => DynamicParams::default(),
                    },
                    governor: String::new(),
                    rounds: 0,
                    moves: 0,
                    changed: false,
                    stop: false,
                }),
                sched_wake: Condvar::new(),
                watchdog_stop: Mutex::new(false),
                watchdog_wake: Condvar::new(),
            }),
        };
        let mut joins = Vec::new();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), ReactorError>>();
        for shared in handle.shared.reactors.clone() {
            let fw = handle.clone();
            let ready = ready_tx.clone();
            let mode = config.mode;
            let period_us = config.ioq_poll_period_us;
            let pin = config.pin;
            let start_hook = config.reactor_start_hook;
            let sources = UsageSources {
                io_uring_enters: config.io_uring_enter_source,
                fixed_buffers: config.fixed_buffer_source,
            };
            let join = std::thread::Builder::new()
                .name(format!("reactor_{}", shared.index))
                .spawn(move || {
                    let setup = (|| {
                        if pin {
                            sys::pin_current_thread(shared.core).map_err(ReactorError::Sys)?;
                        }
                        if let Some(hook) = start_hook {
                            hook(shared.index);
                        }
                        Reactor::new(shared, fw, mode, period_us, sources)
                    })();
                    match setup {
                        Ok(mut reactor) => {
                            let _ = ready.send(Ok(()));
                            reactor.run();
                        }
                        Err(e) => {
                            let _ = ready.send(Err(e));
                        }
                    }
                })
                .map_err(ReactorError::Sys)?;
            joins.push(join);
        }
        drop(ready_tx);
        let mut fw = Framework {
            handle,
            watchdog: None,
            joins,
            scheduler: None,
        };
        for _ in 0..fw.joins.len() {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    fw.stop();
                    return Err(e);
                }
                Err(_) => {
                    fw.stop();
                    return Err(ReactorError::Stopped);
                }
            }
        }
        if config.stall_threshold_ms > 0 {
            let watch_fw = fw.handle.clone();
            let threshold_ms = config.stall_threshold_ms;
            match std::thread::Builder::new()
                .name("lull_watchdog".into())
                .spawn(move || run_watchdog(watch_fw, threshold_ms))
            {
                Ok(j) => fw.watchdog = Some(j),
                Err(e) => {
                    fw.stop();
                    return Err(ReactorError::Sys(e));
                }
            }
        }
        let sched_fw = fw.handle.clone();
        match std::thread::Builder::new()
            .name("lull_scheduler".into())
            .spawn(move || run_scheduler(sched_fw))
        {
            Ok(j) => fw.scheduler = Some(j),
            Err(e) => {
                fw.stop();
                return Err(ReactorError::Sys(e));
            }
        }
        Ok(fw)
    }

    pub fn handle(&self) -> &FrameworkHandle {
        &self.handle
    }

    /// Stop every reactor: queued messages run, threads are destroyed, the
    /// OS threads joined.
    pub fn stop(&mut self) {
        // The scheduler first, so that no thread is in flight between two
        // reactors when they stop.
        lock(&self.handle.shared.sched).stop = true;
        *lock(&self.handle.shared.watchdog_stop) = true;
        self.handle.shared.watchdog_wake.notify_all();
        self.handle.shared.sched_wake.notify_all();
        if let Some(j) = self.scheduler.take() {
            let _ = j.join();
        }
        if let Some(j) = self.watchdog.take() {
            let _ = j.join();
        }
        for r in &self.handle.shared.reactors {
            // A full control queue still drains; retry until Stop fits.
            let mut cmd = Control::Stop;
            loop {
                match r.control.push(cmd) {
                    Ok(()) => break,
                    Err(back) => {
                        cmd = back;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }
        for j in self.joins.drain(..) {
            let _ = j.join();
        }
    }
}

impl Drop for Framework {
    fn drop(&mut self) {
        self.stop();
    }
}

/// An adaptive-mode spin in progress.
#[derive(Debug, Clone, Copy)]
struct Spin {
    start_ns: u64,
}

/// The functions a reactor reads its thread's figures from that this
/// crate cannot see (`FrameworkConfig::io_uring_enter_source`,
/// `FrameworkConfig::fixed_buffer_source`).
#[derive(Clone, Copy)]
struct UsageSources {
    io_uring_enters: Option<fn() -> u64>,
    fixed_buffers: Option<fn() -> FixedBufferUsage>,
}

struct Reactor {
    shared: Arc<ReactorShared>,
    framework: FrameworkHandle,
    mode: Mode,
    ioq_poll_period_us: u64,
    sources: UsageSources,
    /// The adaptive mode's decision (kept in every mode, so that the
    /// measured wake-up cost is known before a switch to adaptive).
    adaptive: Adaptive,
    spin: Option<Spin>,
    /// The earliest timer of any thread, found once while no thread runs
    /// (a spin looks at it every iteration); forgotten when one runs.
    idle_deadline: Option<Option<u64>>,
    /// The reactor slept in the current idle period.
    slept_while_idle: bool,
    spins_with_work: u64,
    spins_idle: u64,
    spin_ns_with_work: u64,
    spin_ns_idle: u64,
    /// The lull thread (slot) whose work the last spins caught, and how
    /// many spins in a row caught it: with a streak, a spin looks at that
    /// thread's epoll set instead of the reactor's (see `spin_look`).
    hot: Option<usize>,
    hot_streak: u32,
    spin_looks: u32,
    ready_events: u64,
    epoll: Epoll,
    threads: Vec<Option<Box<Thread>>>,
    /// Threads in `threads` (none: the reactor sleeps, in any mode).
    n_threads: usize,
    ready: Vec<bool>,
    events: Vec<libc::epoll_event>,
    stopping: bool,
    last_busy: bool,
    usage_next_ns: u64,
    busy_ns: u64,
    idle_ns: u64,
    iterations: u64,
    wakeups: u64,
}

/// Sleeps timed at start to measure what a wake-up costs on this machine
/// (the median is kept): ~3 ms per reactor at start. Fewer gave medians
/// from 7 to 30 µs on the same VM from one start to the next, enough to
/// flip the adaptive decision at moderate load.
const CALIBRATION_SLEEPS: usize = 21;

/// Sleeps done first and not counted: the first wake-ups of a new thread
/// (its stack and the timer's pages faulting in, the core leaving a deep
/// idle state) are not what later ones cost.
const CALIBRATION_WARMUP: usize = 3;

/// The timer delay of each calibration sleep: long enough that the CPU is
/// really idle (halted) when the timer fires, as it is in service.
const CALIBRATION_DELAY_NS: u64 = 100_000;

/// A timer wake-up later than this after its deadline is not a wake-up
/// cost but a preemption (the core was busy with something else); it is
/// not learned from.
const WAKE_SAMPLE_MAX_NS: u64 = 2_000_000;

/// While a spin looks only at the hot thread's epoll set, every this many
/// looks is the reactor's own, so that another thread's ready fd waits at
/// most this many looks (a few µs) during a spin, and not at all outside
/// one.
const SPIN_FULL_LOOK_EVERY: u32 = 8;

/// Spins catch work of the same thread this many times in a row before
/// they look at that thread alone: one catch of another thread (a replica
/// reply for the engine after a request for the poll group) puts the
/// reactor's own look back, so alternating sources are not kept waiting.
const HOT_STREAK_MIN: u32 = 2;

/// Measure what a sleep-and-wake costs on this core: sleep on a timerfd
/// in an epoll set (as the reactor does) and see how late and at what CPU
/// cost the thread runs again. The medians of a few sleeps.
fn calibrate_wake_cost() -> WakeCost {
    let measure = || -> std::io::Result<(u64, u64)> {
        let epoll = Epoll::new()?;
        let timer = sys::TimerFd::new()?;
        epoll.add(
            std::os::fd::AsRawFd::as_raw_fd(&timer),
            Interest::READABLE,
            0,
        )?;
        let mut events = event_buffer(1);
        let start = std::time::Instant::now();
        timer.arm(CALIBRATION_DELAY_NS)?;
        // As in service: the CPU of the wait itself, not of arming.
        let cpu0 = sys::thread_cpu_ns();
        epoll.wait(&mut events, -1)?;
        let late = (start.elapsed().as_nanos() as u64).saturating_sub(CALIBRATION_DELAY_NS);
        let cpu = sys::thread_cpu_ns().saturating_sub(cpu0);
        timer.drain();
        Ok((late, cpu))
    };
    let mut lat = Vec::new();
    let mut cpu = Vec::new();
    for _ in 0..CALIBRATION_WARMUP {
        let _ = measure();
    }
    for _ in 0..CALIBRATION_SLEEPS {
        if let Ok((l, c)) = measure() {
            lat.push(l);
            cpu.push(c);
        }
    }
    lat.sort_unstable();
    cpu.sort_unstable();
    WakeCost {
        latency_ns: lat
            .get(lat.len() / 2)
            .copied()
            .unwrap_or(DEFAULT_WAKE_LATENCY_NS),
        cpu_ns: cpu.get(cpu.len() / 2).copied().unwrap_or(0),
    }
}

/// The wake-up latency assumed if it cannot be measured: what it was on the
/// VMs lull is developed on.
const DEFAULT_WAKE_LATENCY_NS: u64 = 30_000;

impl Reactor {
    fn new(
        shared: Arc<ReactorShared>,
        framework: FrameworkHandle,
        mode: Mode,
        ioq_poll_period_us: u64,
        sources: UsageSources,
    ) -> Result<Reactor, ReactorError> {
        let epoll = Epoll::new().map_err(ReactorError::Sys)?;
        epoll
            .add(
                shared.control.doorbell_fd(),
                Interest::READABLE,
                TOKEN_CONTROL,
            )
            .map_err(ReactorError::Sys)?;
        shared
            .counters
            .tid
            .store(sys::gettid() as u64, Ordering::Relaxed);
        let wake = calibrate_wake_cost();
        tracing::info!(
            reactor = shared.index,
            core = shared.core,
            wake_latency_us = wake.latency_ns as f64 / 1000.0,
            wake_cpu_us = wake.cpu_ns as f64 / 1000.0,
            "measured what a sleep and wake-up costs"
        );
        Ok(Reactor {
            shared,
            framework,
            mode,
            ioq_poll_period_us,
            sources,
            adaptive: Adaptive::new(wake),
            spin: None,
            idle_deadline: None,
            slept_while_idle: false,
            spins_with_work: 0,
            spins_idle: 0,
            spin_ns_with_work: 0,
            spin_ns_idle: 0,
            hot: None,
            hot_streak: 0,
            spin_looks: 0,
            ready_events: 0,
            epoll,
            threads: Vec::new(),
            n_threads: 0,
            ready: Vec::new(),
            events: event_buffer(REACTOR_EVENT_BATCH),
            stopping: false,
            last_busy: true,
            usage_next_ns: 0,
            busy_ns: 0,
            idle_ns: 0,
            iterations: 0,
            wakeups: 0,
        })
    }

    fn clock_now(&self) -> u64 {
        self.framework.shared.clock.now_ns()
    }

    /// One iteration: control commands, readiness (an `epoll_wait` on the
    /// reactor's set, which holds each thread's set: without blocking while
    /// there is work or a spin, blocking otherwise), then the threads with
    /// work. Its cost is the sources with work plus an O(1) check per
    /// thread; connections are sources inside poll-group threads, so it
    /// does not grow with idle connections.
    ///
    /// Clock reads: one after the look for events, then one per thread
    /// run (each thread starts where the one before ended); the read that
    /// ends an iteration starts the next (only the counters' stores lie
    /// between them). A quiet spin look thus costs one read.
    fn run(&mut self) {
        self.shared.counters.adaptive.store(&self.adaptive.status());
        let mut now = self.clock_now();
        loop {
            let mut busy = self.handle_control();
            if self.stopping {
                self.shutdown();
                return;
            }
            busy |= self.wait_events(now);
            let start = self.clock_now();
            let (threads_busy, mut end) = self.poll_threads(start);
            busy |= threads_busy;
            if self.reap_exited() {
                end = self.clock_now();
            }
            if busy {
                if let Some(spin) = self.spin.take() {
                    self.spins_with_work += 1;
                    self.spin_ns_with_work += start.saturating_sub(spin.start_ns);
                }
                self.adaptive.found_work(start, self.slept_while_idle);
                self.slept_while_idle = false;
            } else if self.mode == Mode::Adaptive && !self.adaptive.is_idle() {
                // One decision per idle period, published at once.
                self.adaptive.went_idle(end);
                self.shared.counters.adaptive.store(&self.adaptive.status());
            }
            self.account(busy, end.saturating_sub(start), end);
            self.last_busy = busy;
            now = end;
        }
    }

    /// Run each thread that has work: ready fds (seen through the
    /// reactor's epoll), messages, woken pollers, due timers; in poll mode
    /// also the threads with fd-less pollers. Returns whether one was busy,
    /// and when the last one ended (`now` if none ran).
    fn poll_threads(&mut self, now: u64) -> (bool, u64) {
        let clock = &*self.framework.shared.clock;
        let scope = if self.mode == Mode::Poll {
            Scope::All
        } else {
            Scope::Ready
        };
        let mut busy = false;
        let mut at = now;
        for i in 0..self.threads.len() {
            let ready = std::mem::take(&mut self.ready[i]);
            let Some(t) = self.threads[i].as_mut() else {
                continue;
            };
            let run = ready
                || t.has_immediate_work(at)
                || (scope == Scope::All && t.has_fdless_pollers());
            if !run {
                continue;
            }
            // Its timers may have moved.
            self.idle_deadline = None;
            let c = &self.shared.counters;
            c.running_since_ns.store(at, Ordering::Relaxed);
            c.running_thread.store(t.id(), Ordering::Relaxed);
            let (status, end) = t.poll_ready_timed(at, scope, ready, clock);
            c.running_thread.store(0, Ordering::Relaxed);
            busy |= status == PollStatus::Busy;
            at = end;
        }
        (busy, at)
    }

    /// Ask the reactor's epoll set which threads have ready fds: without
    /// blocking while work keeps coming (and in poll mode, and during an
    /// adaptive spin); when the last iteration found nothing, arm every
    /// doorbell and timer and block until an fd is ready. Returns whether
    /// control work ran.
    fn wait_events(&mut self, now: u64) -> bool {
        let mut timeout = 0;
        let mut deadline = None;
        // A reactor without threads sleeps in every mode (poll too): the
        // scheduler emptied it, and a thread moved here wakes it.
        let empty = self.n_threads == 0;
        let mut spinning = false;
        if !self.last_busy && (self.mode != Mode::Poll || empty) {
            if !empty && self.keep_spinning(now) {
                spinning = true;
            } else if let Some(d) = self.prepare_sleep(now) {
                timeout = -1;
                deadline = d;
            }
        }
        if spinning && self.spin_look() {
            // A spin look is idle time: without this, a reactor that has
            // only spun since it started would report no idle time at all.
            self.idle_ns += self.clock_now().saturating_sub(now);
            return false;
        }
        let sleeping = timeout == -1;
        self.publish_usage(now, sleeping);
        if empty && sleeping {
            self.shared.counters.sleeping.store(true, Ordering::Relaxed);
        }
        // A sleep its timer is due to end in between the calibration's
        // delay and the longest sample is measured as at start
        // (`Adaptive::measured_wake`): the CPU clock (a syscall) is read
        // around that kind of sleep only, not around every sleep of a
        // loaded reactor that an fd ends.
        let sample = sleeping
            && deadline.is_some_and(|d| {
                (CALIBRATION_DELAY_NS..=WAKE_SAMPLE_MAX_NS).contains(&d.saturating_sub(now))
            });
        let cpu_before = if sample { sys::thread_cpu_ns() } else { 0 };
        if sleeping {
            self.shared.counters.waiting.store(true, Ordering::Relaxed);
        }
        let n = self
            .epoll
            .wait(&mut self.events, timeout)
            .unwrap_or_else(|e| {
                tracing::error!(reactor = self.shared.index, error = %e, "epoll_wait failed");
                0
            });
        if sleeping {
            self.shared.counters.waiting.store(false, Ordering::Relaxed);
            self.shared
                .counters
                .sleeping
                .store(false, Ordering::Relaxed);
            let woke_at = self.clock_now();
            let cpu_after = if sample { sys::thread_cpu_ns() } else { 0 };
            self.finish_sleep(n > 0);
            // A wake-up by the timer tells how late a sleeper runs after its
            // event (the wake-up latency) and what the sleep cost. A sleep
            // an fd ended is not a sample: its cost depends on how long it
            // lasted, so on the regime (see `crate::adaptive`).
            let latency = deadline
                .filter(|&d| sample && woke_at >= d)
                .map(|d| woke_at - d)
                .filter(|&l| l <= WAKE_SAMPLE_MAX_NS);
            // (A thread CPU clock that failed reads 0: no sample.)
            if let (Some(latency_ns), true) = (latency, cpu_before > 0) {
                let cpu_ns = cpu_after.saturating_sub(cpu_before);
                self.adaptive.measured_wake(WakeCost { latency_ns, cpu_ns });
            }
            self.slept_while_idle = true;
            self.idle_ns += woke_at.saturating_sub(now);
        } else if spinning {
            // A full look while spinning (epoll without sleeping): idle too.
            self.idle_ns += self.clock_now().saturating_sub(now);
        }
        self.ready_events += n as u64;
        let mut control = false;
        for i in 0..n {
            let token = self.events[i].u64;
            if token == TOKEN_CONTROL {
                self.shared.control.drain_doorbell();
                control = true;
            } else if let Some(r) = self.ready.get_mut(token as usize) {
                *r = true;
                if spinning {
                    self.spin_caught(token as usize);
                }
            }
        }
        control && self.handle_control()
    }

    /// A spin's look at the hot thread's epoll set alone, in place of the
    /// reactor's: the reactor's set holds each thread's set, so a ready
    /// socket seen there costs a second `epoll_wait` on the thread's set;
    /// looked at directly, the thread's ready pollers are marked woken
    /// (`Thread::has_immediate_work`) and the iteration runs them with no
    /// other syscall. Only while spins keep catching that thread's work,
    /// and every `SPIN_FULL_LOOK_EVERY`th look is the reactor's. Returns
    /// false when this look must be the reactor's.
    fn spin_look(&mut self) -> bool {
        let Some(slot) = self.hot.filter(|_| self.hot_streak >= HOT_STREAK_MIN) else {
            return false;
        };
        self.spin_looks = self.spin_looks.wrapping_add(1);
        if self.spin_looks.is_multiple_of(SPIN_FULL_LOOK_EVERY) {
            return false;
        }
        let Some(t) = self.threads.get_mut(slot).and_then(Option::as_mut) else {
            self.hot = None;
            return false;
        };
        if t.collect_ready() > 0 {
            self.ready_events += 1;
            self.spin_caught(slot);
        }
        true
    }

    /// A spin look found thread `slot` ready: the hot thread's streak
    /// grows, or `slot` becomes the hot thread with none.
    fn spin_caught(&mut self, slot: usize) {
        if self.hot == Some(slot) {
            self.hot_streak = (self.hot_streak + 1).min(HOT_STREAK_MIN);
        } else {
            self.hot = Some(slot);
            self.hot_streak = 0;
        }
    }

    /// Adaptive mode: whether to look for events once more without
    /// sleeping. The window comes from [`Adaptive::went_idle`]; a timer due
    /// sooner than a wake-up would take is waited for spinning too.
    fn keep_spinning(&mut self, now: u64) -> bool {
        if self.mode != Mode::Adaptive {
            return false;
        }
        let wake = self.adaptive.wake_cost();
        let deadline = match self.idle_deadline {
            Some(d) => d,
            None => *self.idle_deadline.insert(self.next_deadline()),
        };
        let timer_soon =
            deadline.is_some_and(|d| d.saturating_sub(now) <= wake.latency_ns + wake.cpu_ns);
        let spin = timer_soon || self.adaptive.keep_spinning(now);
        match (spin, self.spin) {
            (true, None) => self.spin = Some(Spin { start_ns: now }),
            (false, Some(s)) => {
                self.spin = None;
                self.spins_idle += 1;
                self.spin_ns_idle += now.saturating_sub(s.start_ns);
            }
            _ => {}
        }
        spin
    }

    /// The earliest timer of any thread (O(threads), when going idle).
    fn next_deadline(&self) -> Option<u64> {
        self.threads
            .iter()
            .flatten()
            .filter_map(|t| t.next_deadline())
            .min()
    }

    /// Arm doorbells and timers. `Some(deadline)` when the reactor may
    /// sleep (until `deadline`, or an fd); `None` when work arrived.
    fn prepare_sleep(&mut self, now: u64) -> Option<Option<u64>> {
        self.shared.control.arm();
        let mut sleep = self.shared.control.is_empty();
        for t in self.threads.iter_mut().flatten() {
            if sleep && !t.prepare_sleep(now) {
                sleep = false;
            }
        }
        if !sleep {
            self.finish_sleep(false);
            return None;
        }
        Some(self.next_deadline())
    }

    fn finish_sleep(&mut self, woke: bool) {
        self.shared.control.disarm();
        for t in self.threads.iter_mut().flatten() {
            t.finish_sleep(woke);
        }
        if woke {
            self.wakeups += 1;
        }
    }

    fn handle_control(&mut self) -> bool {
        let mut did = false;
        for _ in 0..CONTROL_BATCH {
            let Some(cmd) = self.shared.control.pop() else {
                break;
            };
            did = true;
            match cmd {
                Control::AddThread(t) => self.add_thread(t),
                Control::MoveThread { id, to } => self.move_thread(id, to),
                Control::SetMode(mode, period, reply) => reply(self.set_mode(mode, period)),
                Control::Heartbeat(seq) => self
                    .shared
                    .counters
                    .heartbeat_answered
                    .store(seq, Ordering::Relaxed),
                Control::Stop => self.stopping = true,
            }
        }
        did
    }

    fn configure_thread(&self, t: &mut Thread) {
        t.set_event_driven(self.mode.event_driven());
        let hybrid = (self.mode == Mode::Hybrid).then_some(self.ioq_poll_period_us * 1000);
        t.set_initiator_period(hybrid);
    }

    fn add_thread(&mut self, mut t: Box<Thread>) {
        self.configure_thread(&mut t);
        t.set_reactor(self.shared.index);
        let slot = match self.threads.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.threads.push(None);
                self.ready.push(false);
                self.threads.len() - 1
            }
        };
        if let Err(e) = self
            .epoll
            .add(t.epoll_fd(), Interest::READABLE, slot as u64)
        {
            tracing::error!(thread = t.name(), error = %e, "cannot add thread to reactor epoll; thread dropped");
            self.framework.forget_thread(t.id());
            return;
        }
        // Its first message (init) is queued, or it arrived from another
        // reactor with work pending: run it promptly.
        self.ready[slot] = true;
        self.threads[slot] = Some(t);
        self.n_threads += 1;
        self.shared
            .counters
            .threads
            .store(self.n_threads as u64, Ordering::Relaxed);
    }

    /// Hand thread `id` to reactor `to` between two iterations: out of this
    /// reactor's epoll set and slots, into `to`'s control queue. Its
    /// pollers, fds, timers, queued messages and in-flight I/O (rings and
    /// eventfds are the thread's) go with it; `to` runs it at once.
    fn move_thread(&mut self, id: u64, to: usize) {
        let Some(slot) = self
            .threads
            .iter()
            .position(|t| t.as_ref().is_some_and(|t| t.id() == id))
        else {
            // Exited, or moved already: the scheduler's view was a period old.
            tracing::debug!(
                reactor = self.shared.index,
                thread = id,
                "thread to move is not here"
            );
            return;
        };
        let reactors = &self.framework.shared.reactors;
        let Some(target) = reactors.get(to).cloned() else {
            return;
        };
        if to == self.shared.index || self.stopping {
            return;
        }
        let target_mode = Mode::from_u8(target.counters.mode.load(Ordering::Relaxed));
        if let Some(t) = self.threads[slot].as_ref() {
            let bad = t.pollers_without_event_source();
            if target_mode.event_driven() && !bad.is_empty() {
                tracing::warn!(
                    thread = t.name(),
                    to,
                    pollers = %bad.join(", "),
                    "not moving thread: pollers without an fd cannot run on an event-driven reactor"
                );
                return;
            }
        }
        let Some(t) = self.threads[slot].take() else {
            return;
        };
        let _ = self.epoll.delete(t.epoll_fd());
        self.ready[slot] = false;
        self.forget_hot(slot);
        self.n_threads -= 1;
        // Its timers were in the cached earliest deadline.
        self.idle_deadline = None;
        let name = t.name().to_string();
        match target.control.push(Control::AddThread(t)) {
            Ok(()) => {
                self.shared
                    .counters
                    .threads_moved_out
                    .fetch_add(1, Ordering::Relaxed);
                target
                    .counters
                    .threads_moved_in
                    .fetch_add(1, Ordering::Relaxed);
                tracing::debug!(thread = %name, from = self.shared.index, to, "thread moved");
            }
            Err(Control::AddThread(t)) => {
                tracing::warn!(thread = %name, to, "not moving thread: target's control queue is full");
                self.add_thread(t);
            }
            Err(_) => {}
        }
        self.shared
            .counters
            .threads
            .store(self.n_threads as u64, Ordering::Relaxed);
    }

    fn set_mode(&mut self, mode: Mode, ioq_poll_period_us: u64) -> Result<(), ReactorError> {
        if mode.event_driven() {
            for t in self.threads.iter().flatten() {
                let bad = t.pollers_without_event_source();
                if !bad.is_empty() {
                    return Err(ReactorError::NoEventSource(format!(
                        "{}: {}",
                        t.name(),
                        bad.join(", ")
                    )));
                }
            }
        }
        self.mode = mode;
        self.ioq_poll_period_us = ioq_poll_period_us;
        let mut threads = std::mem::take(&mut self.threads);
        for t in threads.iter_mut().flatten() {
            self.configure_thread(t);
        }
        self.threads = threads;
        if let Some(spin) = self.spin.take() {
            self.spins_idle += 1;
            self.spin_ns_idle += self.clock_now().saturating_sub(spin.start_ns);
        }
        self.shared.counters.adaptive.store(&self.adaptive.status());
        // Every thread runs on the next iteration, so nothing that was ready
        // under the old mode is left waiting.
        self.last_busy = true;
        for r in &mut self.ready {
            *r = true;
        }
        self.shared
            .counters
            .mode
            .store(mode.to_u8(), Ordering::Relaxed);
        self.shared
            .counters
            .ioq_poll_period_us
            .store(ioq_poll_period_us, Ordering::Relaxed);
        tracing::info!(
            reactor = self.shared.index,
            mode = mode.as_str(),
            ioq_poll_period_us,
            "reactor mode set"
        );
        Ok(())
    }

    /// Remove the threads that asked to exit; returns whether there were any.
    fn reap_exited(&mut self) -> bool {
        let mut reaped = false;
        for i in 0..self.threads.len() {
            if self.threads[i].as_ref().is_some_and(|t| t.exit_requested()) {
                if let Some(mut t) = self.threads[i].take() {
                    self.forget_hot(i);
                    self.remove_thread(&mut t);
                    reaped = true;
                }
            }
        }
        reaped
    }

    /// The thread in `slot` left: spins stop looking at its set alone.
    fn forget_hot(&mut self, slot: usize) {
        if self.hot == Some(slot) {
            self.hot = None;
            self.hot_streak = 0;
        }
    }

    fn remove_thread(&mut self, t: &mut Thread) {
        let _ = self.epoll.delete(t.epoll_fd());
        self.n_threads = self.n_threads.saturating_sub(1);
        let dropped = t.destroy();
        if dropped > 0 {
            tracing::warn!(
                thread = t.name(),
                dropped,
                "thread exited with queued messages"
            );
        }
        self.framework.forget_thread(t.id());
        self.shared
            .counters
            .threads
            .store(self.n_threads as u64, Ordering::Relaxed);
    }

    fn shutdown(&mut self) {
        for i in 0..self.threads.len() {
            if let Some(mut t) = self.threads[i].take() {
                t.drain_messages(SHUTDOWN_MESSAGE_LIMIT);
                if t.pending_messages() > 0 {
                    tracing::warn!(thread = t.name(), "messages still queued at shutdown");
                }
                self.remove_thread(&mut t);
            }
        }
        let now = self.clock_now();
        self.publish_usage(now, true);
    }

    fn account(&mut self, busy: bool, elapsed_ns: u64, now: u64) {
        if busy {
            self.busy_ns += elapsed_ns;
        } else {
            self.idle_ns += elapsed_ns;
        }
        self.iterations += 1;
        let c = &self.shared.counters;
        c.busy_ns.store(self.busy_ns, Ordering::Relaxed);
        c.idle_ns.store(self.idle_ns, Ordering::Relaxed);
        c.iterations.store(self.iterations, Ordering::Relaxed);
        c.wakeups.store(self.wakeups, Ordering::Relaxed);
        c.spins_with_work
            .store(self.spins_with_work, Ordering::Relaxed);
        c.spins_idle.store(self.spins_idle, Ordering::Relaxed);
        c.spin_ns_with_work
            .store(self.spin_ns_with_work, Ordering::Relaxed);
        c.spin_ns_idle.store(self.spin_ns_idle, Ordering::Relaxed);
        c.spin_window_ns
            .store(self.adaptive.spin_window_ns(), Ordering::Relaxed);
        let wake = self.adaptive.wake_cost();
        c.wake_latency_ns.store(wake.latency_ns, Ordering::Relaxed);
        c.wake_cpu_ns.store(wake.cpu_ns, Ordering::Relaxed);
        c.ready_events.store(self.ready_events, Ordering::Relaxed);
        self.publish_usage(now, false);
    }

    fn publish_usage(&mut self, now: u64, force: bool) {
        if !force && now < self.usage_next_ns {
            return;
        }
        self.usage_next_ns = now + USAGE_REFRESH_NS;
        let u: ThreadUsage = sys::thread_usage();
        let c = &self.shared.counters;
        c.user_ns.store(u.user_ns, Ordering::Relaxed);
        c.system_ns.store(u.system_ns, Ordering::Relaxed);
        c.voluntary_ctxsw
            .store(u.voluntary_ctxsw, Ordering::Relaxed);
        c.involuntary_ctxsw
            .store(u.involuntary_ctxsw, Ordering::Relaxed);
        c.minor_faults.store(u.minor_faults, Ordering::Relaxed);
        c.major_faults.store(u.major_faults, Ordering::Relaxed);
        // A thread-local read, no syscall.
        let enters = self.sources.io_uring_enters.map_or(0, |count| count());
        c.io_uring_enters.store(enters, Ordering::Relaxed);
        // A thread-local read too.
        let arena = self
            .sources
            .fixed_buffers
            .map_or(FixedBufferUsage::default(), |usage| usage());
        c.fixed_buffer_bytes.store(arena.bytes, Ordering::Relaxed);
        c.fixed_buffer_in_use_bytes
            .store(arena.in_use_bytes, Ordering::Relaxed);
        c.fixed_buffer_locked.store(arena.locked, Ordering::Relaxed);
    }
}

/// What the scheduler remembers of a thread between periods.
struct Seen {
    busy_ns: u64,
    periods_since_move: u32,
}

/// The scheduler's OS thread: every period, gather, balance, apply (SPDK
/// runs this on the main reactor; here it is a thread of its own that
/// sleeps between periods, so no reactor blocks or carries it). Reads
/// only the counters threads and reactors publish; moves go through the
/// reactors' control queues.
/// The watchdog's loop (see `crate::watchdog`): every period, each
/// reactor's heartbeat is checked and the next one sent; stalls and
/// recoveries are logged and published in the reactor's counters.
fn run_watchdog(fw: FrameworkHandle, threshold_ms: u64) {
    use crate::watchdog::{watch_period_ms, Verdict, Watch};
    let period = Duration::from_millis(watch_period_ms(threshold_ms));
    let threshold_ns = threshold_ms * 1_000_000;
    let mut watches = vec![Watch::default(); fw.shared.reactors.len()];
    loop {
        {
            let stop = lock(&fw.shared.watchdog_stop);
            if *stop {
                return;
            }
            let (stop, _) = fw
                .shared
                .watchdog_wake
                .wait_timeout(stop, period)
                .unwrap_or_else(|p| p.into_inner());
            if *stop {
                return;
            }
        }
        let now = fw.shared.clock.now_ns();
        for (r, w) in fw.shared.reactors.iter().zip(watches.iter_mut()) {
            let c = &r.counters;
            let answered = c.heartbeat_answered.load(Ordering::Relaxed);
            let waiting = c.waiting.load(Ordering::Relaxed);
            let seq = match w.observe(now, answered, waiting, threshold_ns) {
                Verdict::Nothing => continue,
                Verdict::Send(seq) => seq,
                Verdict::Stalled { for_ns } => {
                    c.stalled_since_ns
                        .store(w.stalled_since_ns.unwrap_or(now).max(1), Ordering::Relaxed);
                    c.stalls.fetch_add(1, Ordering::Relaxed);
                    report_stall(&fw, r, now, for_ns);
                    continue;
                }
                Verdict::Recovered { lasted_ns, seq } => {
                    c.stalled_since_ns.store(0, Ordering::Relaxed);
                    tracing::info!(
                        reactor = r.index,
                        core = r.core,
                        stalled_ms = lasted_ns / 1_000_000,
                        "reactor recovered: it answers its heartbeat again"
                    );
                    seq
                }
            };
            // A full control queue: the reactor has plenty to read already
            // and will answer the next one.
            let _ = r.control.push(Control::Heartbeat(seq));
        }
    }
}

/// The WARN line of a stall: the reactor, what it runs and for how long.
fn report_stall(fw: &FrameworkHandle, r: &ReactorShared, now: u64, for_ns: u64) {
    let c = &r.counters;
    let thread_id = c.running_thread.load(Ordering::Relaxed);
    let since = c.running_since_ns.load(Ordering::Relaxed);
    let thread = (thread_id != 0)
        .then(|| lock(&fw.shared.threads).get(&thread_id).cloned())
        .flatten();
    let (thread_name, poller) = match &thread {
        Some(t) => (
            t.name.clone(),
            t.running_poller_name()
                .unwrap_or_else(|| "(between pollers: messages or timers)".into()),
        ),
        None => ("(none: the reactor's own loop)".into(), "(none)".into()),
    };
    let in_it_ms = if thread.is_some() {
        now.saturating_sub(since) / 1_000_000
    } else {
        0
    };
    tracing::warn!(
        reactor = r.index,
        core = r.core,
        thread = %thread_name,
        poller = %poller,
        in_it_ms,
        no_answer_ms = for_ns / 1_000_000,
        "reactor stalled: it has not answered its heartbeat; every source on it waits (a poller that loops or blocks?)"
    );
}

fn run_scheduler(fw: FrameworkHandle) {
    let shared = &fw.shared;
    let main = 0;
    let main_core = shared.reactors[main].core;
    let mut governor: Option<Box<dyn Governor>> = match Cpufreq::probe(&[main_core]) {
        Ok(g) => {
            lock(&shared.sched).governor = g.name().to_string();
            Some(Box::new(g))
        }
        Err(why) => {
            tracing::info!(core = main_core, reason = %why, "scheduler: frequency governor unsupported; scheduling without it");
            lock(&shared.sched).governor = format!("unsupported: {why}");
            None
        }
    };
    let mut seen: HashMap<u64, Seen> = HashMap::new();
    let mut reactor_busy: Vec<u64> = Vec::new();
    let mut since = Instant::now();
    loop {
        let config = {
            let mut st = lock(&shared.sched);
            let period = Duration::from_micros(st.config.period_us);
            let deadline = Instant::now() + period;
            while !st.stop && !st.changed {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                st = shared
                    .sched_wake
                    .wait_timeout(st, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            if st.stop {
                return;
            }
            let changed = std::mem::take(&mut st.changed);
            (st.config, changed)
        };
        let (config, changed) = config;
        if changed {
            // A new config: measure a whole period under it (threads keep
            // their move history).
            for (id, t) in lock(&shared.threads).iter() {
                if let Some(s) = seen.get_mut(id) {
                    s.busy_ns = t.counters.busy_ns.load(Ordering::Relaxed);
                }
            }
            reactor_busy.clear();
            since = Instant::now();
            continue;
        }
        let elapsed_ns = (since.elapsed().as_nanos() as u64).max(1);
        since = Instant::now();
        let pct = |ns: u64| ns as f64 * 100.0 / elapsed_ns as f64;

        // Gather.
        let stats = fw.reactor_stats();
        let cores: Vec<CoreLoad> = stats
            .iter()
            .enumerate()
            .map(|(i, r)| CoreLoad {
                busy: pct(r
                    .busy_ns
                    .saturating_sub(reactor_busy.get(i).copied().unwrap_or(r.busy_ns))),
            })
            .collect();
        reactor_busy = stats.iter().map(|r| r.busy_ns).collect();
        let threads: Vec<(u64, Arc<ThreadShared>)> = lock(&shared.threads)
            .iter()
            .map(|(id, t)| (*id, t.clone()))
            .collect();
        let mut ids = Vec::with_capacity(threads.len());
        let mut loads = Vec::with_capacity(threads.len());
        for (id, t) in &threads {
            if t.exited.load(Ordering::Acquire) {
                continue;
            }
            let busy_ns = t.counters.busy_ns.load(Ordering::Relaxed);
            let entry = seen.entry(*id).or_insert(Seen {
                busy_ns,
                // New: its load is not known yet, so it stays this round
                // (and may move from the next).
                periods_since_move: scheduler::MOVE_COOLDOWN_PERIODS - 1,
            });
            loads.push(ThreadLoad {
                reactor: t.counters.reactor.load(Ordering::Relaxed) as usize,
                load: pct(busy_ns.saturating_sub(entry.busy_ns)),
                pinned: t.pinned.load(Ordering::Relaxed),
                periods_since_move: entry.periods_since_move,
            });
            entry.busy_ns = busy_ns;
            ids.push(*id);
        }
        let live: std::collections::HashSet<u64> = ids.iter().copied().collect();
        seen.retain(|id, _| live.contains(id));

        // Balance and apply.
        let mut moves = 0;
        if let Policy::Dynamic(params) = config.policy {
            let plan = scheduler::balance(&params, main, &cores, &loads);
            for ((id, t), &to) in ids.iter().zip(&loads).zip(&plan.targets) {
                let s = seen.get_mut(id).expect("seen holds every gathered thread");
                if to != t.reactor && t.reactor < shared.reactors.len() {
                    let cmd = Control::MoveThread { id: *id, to };
                    if shared.reactors[t.reactor].control.push(cmd).is_ok() {
                        moves += 1;
                        s.periods_since_move = 0;
                        continue;
                    }
                }
                s.periods_since_move = s.periods_since_move.saturating_add(1);
            }
            if let Some(g) = governor.as_mut() {
                // SPDK's policy: full speed while busy threads run off the
                // main core; otherwise step the main core up when it is
                // busier than idle, down when not.
                let busy_elsewhere = plan.targets.iter().any(|&r| r != main);
                let main_busy = cores.get(main).map_or(0.0, |c| c.busy);
                let r = if busy_elsewhere {
                    g.core_freq_max(main_core)
                } else if main_busy > 50.0 {
                    g.core_freq_up(main_core)
                } else {
                    g.core_freq_down(main_core)
                };
                if let Err(e) = r {
                    tracing::warn!(core = main_core, error = %e, "scheduler: governor failed; turning it off");
                    lock(&shared.sched).governor = format!("unsupported: {e}");
                    governor = None;
                }
            }
        } else {
            for id in &ids {
                if let Some(s) = seen.get_mut(id) {
                    s.periods_since_move = s.periods_since_move.saturating_add(1);
                }
            }
        }
        let mut st = lock(&shared.sched);
        st.rounds += 1;
        st.moves += moves;
        if moves > 0 {
            tracing::debug!(moves, round = st.rounds, "scheduler moved threads");
        }
    }
}
