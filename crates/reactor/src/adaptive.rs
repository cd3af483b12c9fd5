//! The adaptive mode's spin-or-sleep decision, as a pure unit: events in
//! (the reactor went idle, found work, measured a timer wake-up), a
//! decision out (spin until some time, or sleep now). It never reads a
//! clock, so the tests below and `tests/adaptive_sim.rs` drive it on
//! made-up and recorded times.
//!
//! ```
//! use lull_reactor::adaptive::{Adaptive, Regime, WakeCost};
//! let mut a = Adaptive::new(WakeCost { latency_ns: 30_000, cpu_ns: 3_000 });
//! // A client that sends its next request 10 µs after each reply (5 µs
//! // of work each), for a second.
//! let mut now = 0;
//! while now < 1_000_000_000 {
//!     let window = a.went_idle(now);
//!     // Caught by a spin, or seen a wake-up late after a sleep.
//!     let slept = window < 10_000;
//!     now += if slept { 40_000 } else { 10_000 };
//!     a.found_work(now, slept);
//!     now += 5_000;
//! }
//! // Spinning 10 µs per request costs less than a 33 µs wake-up: spin.
//! assert_eq!(a.status().regime, Regime::Spin);
//! assert!(a.went_idle(now) >= 10_000);
//! ```
//!
//! **What a sleep costs.** Blocking in `epoll_wait` and being woken costs
//! the request that wakes the reactor a wake-up latency (`latency_ns`: the
//! interrupt, the scheduler, the context switch; on a VM also the exit
//! from the halted vCPU) and costs the reactor some CPU (`cpu_ns`: the
//! syscall and two context switches). Both are measured with timer
//! wake-ups (at start, `calibrate_wake_cost` in `reactor.rs`, and
//! whenever a timer ends a sleep of the same kind in service) and kept as
//! running medians. A sleep an fd ends is not a sample: what it costs
//! depends on how long it lasted, so on the regime.
//!
//! **What a spin costs** is the time spent polling.
//!
//! **Two regimes, each priced by what it costs.** An adaptive reactor is
//! in one of two [`Regime`]s: `Sleep` (sleep as soon as it is idle:
//! interrupt mode's CPU) or `Spin` (spin for a window, then sleep: poll
//! mode's latency). For each it keeps what its idle periods cost per unit
//! of work, as measured while in it:
//!
//! ```text
//! cost = (time spun + sleeps * cpu_ns
//!         + LATENCY_WEIGHT * latency_ns * events delayed) / busy time
//! ```
//!
//! A sleep delays the work its wake-up finds and the work queued behind
//! it: the busy period after it, counted in the work one event brings
//! while spinning. Its own regime's cost is kept up to date; the other's
//! is measured by a *probe*: [`MIN_SAMPLES`] idle periods after start,
//! then every [`PROBE_EVERY_NS`] (or at once when its own cost has
//! changed [`DRIFT_FACTOR`]-fold: the load changed), the reactor runs the
//! other regime for [`PROBE_WARMUP`] + [`PROBE_SAMPLES`] idle periods. It
//! switches when the other regime cost less than 3/4 of its own
//! ([`HYSTERESIS_PERCENT`]) in two probes in a row (the second after
//! another `MIN_SAMPLES` periods of its own: one probe may land on a
//! lucky stretch of the load). A spin probe that caught work in under a
//! quarter of its periods is not a candidate (spinning that never
//! catches anything is sleeping under another name). Spinning that costs
//! under [`SPIN_COST_FLOOR_PERCENT`] of the work is taken when it costs
//! less than sleeping by any margin, and is never left for sleeping (a
//! nearly saturated reactor spins, as poll mode does). A fresh reactor
//! starts asleep.
//!
//! Why measure both instead of predicting one from the other: the gaps a
//! client leaves depend on the regime, in ways that differ by client. A
//! rate-limited fio at QD4 and 20,000 IOPS sends one request every 50 µs
//! while the reactor spins (idle periods of 31-41 µs), and while it
//! sleeps either the same (arrivals keep the client's clock, so the idle
//! period seen is 34 µs, of which the wake-up was part) or pairs (seen
//! idle periods of 77 µs, one wake-up per two requests); a ping-pong
//! client instead waits a wake-up longer for every reply. Predicting the
//! spinning gaps from the sleeping ones (seen minus a wake-up, as this
//! module did) is biased one way or the other: judged on its own gaps,
//! each regime kept itself, and which one a fresh server fell into
//! depended on its first moments (issue 34).
//!
//! **The rule, for gaps of one length.** A load that leaves one gap `g`
//! per request while spinning and costs one wake-up per request while
//! sleeping costs `g` per request spinning and `saved = cpu_ns +
//! LATENCY_WEIGHT * latency_ns` sleeping. So it spins below `X = 3/4
//! saved`, sleeps above `Y = 4/3 saved`, and between keeps the regime it
//! is in. A load that bunches up while the reactor sleeps (fio's pairs)
//! makes sleeping cheaper than that, and the measured costs show it.
//!
//! **The window.** Spinning, the reactor spins for the window `s` that
//! maximises
//!
//! ```text
//! gain(s) = P(I <= s) * v - E[min(I, s)],  v = Y * events a sleep delays
//! ```
//!
//! over a decaying histogram of the idle periods `I` seen while spinning
//! (√2-spaced bucket bounds; a period that ended after a sleep counts as
//! seen minus the wake-up, at least the window it outlasted), or up to
//! two buckets longer where the gain is about the same (past the longest
//! gap seen it is flat). This is competitive spinning (Karlin, Li,
//! Manasse and Owicki, SOSP 1991) with the gap distribution known: gaps
//! longer than `Y` get no window, a bimodal stream gets a window for its
//! short mode only. When no window gains for [`MIN_SAMPLES`] idle periods
//! in a row, the spinning reactor is not spinning at all, and goes back
//! to `Sleep` without a probe.
//!
//! **Sources.** The histogram and the costs are the reactor's, not a
//! source's: an idle period ends with the first event of any source, so
//! a slow source (a far replica, a slow disk) only ever shortens idle
//! periods and can never switch spinning off for a fast one. The
//! decision is O(buckets) per idle period, independent of connections.
//!
//! **Saturated.** Decisions are made when the reactor goes idle; a
//! reactor that finds work on every look never does, so it neither
//! decides, nor sleeps, nor reads the clock more than poll mode does.

/// Histogram buckets: bound `k` is `2^(k/2)` µs, from 1 µs to 2 ms in
/// steps of √2 (precise enough to choose a window within ~40%), plus an
/// overflow bucket for longer gaps.
const BUCKETS: usize = 23;

/// One ns of a request's latency is worth this many ns of CPU. 1: a
/// wake-up saved is worth spinning for about as long as it lasts, the
/// ski-rental balance. Raise it to favour latency, lower it to favour CPU.
pub const LATENCY_WEIGHT: u64 = 1;

/// The longest spin ever chosen, whatever the histogram says: bounds the
/// CPU one end of load can cost.
pub const MAX_SPIN_NS: u64 = 1_000_000;

/// When the histogram holds this many samples' weight, every count is
/// halved: recent behaviour dominates, and a change of load (a client
/// stops, a new one starts) changes the window within a few hundred idle
/// periods. The regimes' costs decay the same way.
const DECAY_AT: f64 = 512.0;

/// The hysteresis: the reactor switches to the other regime when that
/// cost less than (100 - this)% of its own. 25: wider than the noise of
/// the wake-up cost measured at start (16.7-24.4 µs latency and 8.6-10.9
/// µs CPU over ten starts on the development VM: their sum within ±16%),
/// so a steady load's regime does not depend on the start; a probe's own
/// noise is met by asking two probes in a row.
pub const HYSTERESIS_PERCENT: u64 = 25;

/// Idle periods a regime has seen before the reactor probes the other or
/// leaves it (a fresh reactor's first probe included): a handful of
/// periods (the NBD handshake, the first requests) is no evidence of a
/// load. 64 is 3 ms at 20,000 IOPS.
pub const MIN_SAMPLES: u32 = 64;

/// How often the reactor measures the other regime. A probe costs
/// `PROBE_WARMUP + PROBE_SAMPLES` idle periods in the worse regime (about
/// 3.6 ms of a second at 20,000 IOPS).
pub const PROBE_EVERY_NS: u64 = 1_000_000_000;

/// Idle periods at the start of a probe that are not counted: the client
/// still answers the regime before (fio's pacing followed the reactor
/// within a few requests in the recordings).
pub const PROBE_WARMUP: u32 = 8;

/// Idle periods a probe measures.
pub const PROBE_SAMPLES: u32 = 64;

/// The own regime's cost having grown or shrunk this many times since the
/// last comparison means the load changed: probe now, not at the next
/// period.
pub const DRIFT_FACTOR: f64 = 2.0;

/// The spinning window is computed again after this many idle periods
/// (or a new wake-up cost): the histogram moves little in a few samples,
/// and an idle period then costs one bucket lookup, not a scan.
const WINDOW_REFRESH: u32 = 8;

/// Spinning that costs less than this share of the work (percent) is
/// taken when it costs less than sleeping, by any margin, and is not
/// given up for sleeping: there is little CPU to save, and a reactor that
/// is almost never idle (QD64) spins, as steady as poll mode. Measured at
/// QD64 here: 1-5% for either regime, where the ratio of two such small
/// numbers is noise.
pub const SPIN_COST_FLOOR_PERCENT: u64 = 10;

/// A busy period longer than this counts as this long in the costs: a
/// reactor thread preempted by another on its core must not make one
/// period outweigh a probe's 64.
const BUSY_SAMPLE_MAX_NS: u64 = 2_000_000;

/// A running median moves by 1/2^this of itself per sample: a sample
/// above the estimate raises it by ~3%, one below lowers it, so one
/// outlier (a preempted sleep) moves it little, and it settles on the
/// median, not the mean, of a bimodal cost.
const WAKE_STEP_SHIFT: u32 = 5;

/// What one sleep-and-wake costs on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WakeCost {
    /// From the event to the reactor running again.
    pub latency_ns: u64,
    /// CPU the reactor spends going to sleep and coming back.
    pub cpu_ns: u64,
}

impl WakeCost {
    /// What a sleep costs, latency weighted as CPU: what catching an
    /// event by spinning saves.
    pub fn saved_ns(&self) -> u64 {
        LATENCY_WEIGHT * self.latency_ns + self.cpu_ns
    }

    /// `X`: gaps of one length below this make a sleeping reactor spin.
    pub fn spin_below_ns(&self) -> u64 {
        self.saved_ns() * (100 - HYSTERESIS_PERCENT) / 100
    }

    /// `Y`: gaps of one length above this make a spinning reactor sleep.
    pub fn sleep_above_ns(&self) -> u64 {
        self.saved_ns() * 100 / (100 - HYSTERESIS_PERCENT)
    }
}

/// What an adaptive reactor does with an idle period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Regime {
    /// Sleep at once.
    #[default]
    Sleep,
    /// Spin for the chosen window, then sleep.
    Spin,
}

impl Regime {
    pub fn as_str(self) -> &'static str {
        match self {
            Regime::Sleep => "sleep",
            Regime::Spin => "spin",
        }
    }

    fn other(self) -> Regime {
        match self {
            Regime::Sleep => Regime::Spin,
            Regime::Spin => Regime::Sleep,
        }
    }

    fn index(self) -> usize {
        match self {
            Regime::Sleep => 0,
            Regime::Spin => 1,
        }
    }
}

/// Why the regime last changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwitchReason {
    /// A probe of spinning cost less than 3/4 of sleeping.
    SpinCheaper,
    /// A probe of sleeping cost less than 3/4 of spinning.
    SleepCheaper,
    /// Spinning, no window paid for `MIN_SAMPLES` idle periods in a row
    /// (gaps above `Y`).
    GapsLong,
}

impl SwitchReason {
    pub fn as_str(self) -> &'static str {
        match self {
            SwitchReason::SpinCheaper => "spin_cheaper",
            SwitchReason::SleepCheaper => "sleep_cheaper",
            SwitchReason::GapsLong => "gaps_long",
        }
    }

    /// Its code in an atomic (`Reactor` publishes the last switch); 0 is
    /// "none".
    pub fn code(self) -> u8 {
        match self {
            SwitchReason::SpinCheaper => 1,
            SwitchReason::SleepCheaper => 2,
            SwitchReason::GapsLong => 3,
        }
    }

    pub fn from_code(code: u8) -> Option<SwitchReason> {
        match code {
            1 => Some(SwitchReason::SpinCheaper),
            2 => Some(SwitchReason::SleepCheaper),
            3 => Some(SwitchReason::GapsLong),
            _ => None,
        }
    }

    /// The regime a switch for this reason enters.
    pub fn to(self) -> Regime {
        match self {
            SwitchReason::SpinCheaper => Regime::Spin,
            SwitchReason::SleepCheaper | SwitchReason::GapsLong => Regime::Sleep,
        }
    }
}

/// A regime switch, with the figures it was decided on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Switch {
    pub reason: SwitchReason,
    /// When (the time given to `went_idle`).
    pub at_ns: u64,
    /// The regimes' costs then, in percent of the busy time (see
    /// [`AdaptiveStatus::spin_cost_pct`]).
    pub spin_cost_pct: Option<u64>,
    pub sleep_cost_pct: Option<u64>,
    /// The median gap seen while spinning then.
    pub gap_ns: u64,
}

/// What the decision is and what it rests on, for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AdaptiveStatus {
    pub regime: Regime,
    /// The regime a probe is trying now, if one is.
    pub probing: Option<Regime>,
    /// The last probe found the other regime cheaper: the next one, after
    /// `MIN_SAMPLES` idle periods of the own regime, confirms it (a
    /// switch) or not.
    pub confirming: bool,
    /// What each regime's idle periods cost per unit of work, in percent
    /// of the busy time (CPU spun, and each sleep's CPU and weighted
    /// latency): the own regime's as it goes, the other's from the last
    /// probe; `None` before it was measured.
    pub spin_cost_pct: Option<u64>,
    pub sleep_cost_pct: Option<u64>,
    /// The median idle period seen while spinning (0: none yet).
    pub gap_ns: u64,
    /// The wake-up cost ...
    pub wake: WakeCost,
    /// ... and the band it gives for gaps of one length: spin below `X`,
    /// sleep above `Y` (see the module's rule).
    pub spin_below_ns: u64,
    pub sleep_above_ns: u64,
    /// The window of the current (or last) idle period (0: sleep at once).
    pub window_ns: u64,
    pub switches: u64,
    /// Probes that kept the regime (one that did not is a switch).
    pub probes: u64,
    pub last_switch: Option<Switch>,
}

fn bound_ns(k: usize) -> u64 {
    // 1000 * 2^(k/2): even k exact powers of two, odd k times √2.
    let base = 1_000u64 << (k / 2);
    if k.is_multiple_of(2) {
        base
    } else {
        base * 1_414 / 1_000
    }
}

/// A decaying histogram of idle-period lengths.
#[derive(Debug, Clone)]
struct GapHistogram {
    counts: [f64; BUCKETS + 1],
    /// Sum of the gaps in each bucket, for `E[min(I, s)]`.
    sums_ns: [f64; BUCKETS + 1],
    total: f64,
}

impl GapHistogram {
    fn new() -> GapHistogram {
        GapHistogram {
            counts: [0.0; BUCKETS + 1],
            sums_ns: [0.0; BUCKETS + 1],
            total: 0.0,
        }
    }

    /// The first bucket whose bound holds `gap_ns`: from the power of two
    /// below it, at most three steps.
    fn bucket(gap_ns: u64) -> usize {
        let from = match gap_ns / 1_000 {
            0 => 0,
            us => 2 * us.ilog2() as usize,
        };
        (from..BUCKETS)
            .find(|&k| gap_ns <= bound_ns(k))
            .unwrap_or(BUCKETS)
    }

    fn add(&mut self, gap_ns: u64) {
        let k = GapHistogram::bucket(gap_ns);
        self.counts[k] += 1.0;
        self.sums_ns[k] += gap_ns as f64;
        self.total += 1.0;
        if self.total >= DECAY_AT {
            for k in 0..=BUCKETS {
                self.counts[k] *= 0.5;
                self.sums_ns[k] *= 0.5;
            }
            self.total *= 0.5;
        }
    }

    /// The median gap: the mean of the bucket that holds the median.
    fn median_ns(&self) -> u64 {
        let mut seen = 0.0;
        for k in 0..=BUCKETS {
            seen += self.counts[k];
            if seen * 2.0 >= self.total && self.counts[k] > 0.0 {
                return (self.sums_ns[k] / self.counts[k]) as u64;
            }
        }
        0
    }

    /// The window that maximises the expected gain of spinning when a
    /// wake-up saved is worth `value_ns`; 0 when no window gains. Where
    /// longer windows gain about as much (past the longest gap seen, the
    /// gain is flat: no sample says a longer window would miss), up to
    /// two buckets longer: a gap just past the ones seen so far is then
    /// caught, not slept through.
    fn best_window(&self, value_ns: u64) -> u64 {
        if self.total <= 0.0 {
            return 0;
        }
        let value = value_ns as f64;
        let mut gains = [0.0f64; BUCKETS];
        let mut best: Option<usize> = None;
        let (mut caught, mut caught_sum) = (0.0f64, 0.0f64);
        for k in 0..BUCKETS {
            if bound_ns(k) > MAX_SPIN_NS {
                break;
            }
            caught += self.counts[k];
            caught_sum += self.sums_ns[k];
            let p = caught / self.total;
            let missed = (self.total - caught) / self.total;
            let spent = caught_sum / self.total + missed * bound_ns(k) as f64;
            gains[k] = p * value - spent;
            if gains[k] > best.map_or(0.0, |b| gains[b]) {
                best = Some(k);
            }
        }
        let Some(b) = best else {
            return 0;
        };
        let near = gains[b] - value / 64.0;
        let mut k = b;
        while k < b + 2 && k + 1 < BUCKETS && bound_ns(k + 1) <= MAX_SPIN_NS {
            if gains[k + 1] < near {
                break;
            }
            k += 1;
        }
        bound_ns(k)
    }
}

/// What a regime's idle periods cost and the work around them, decaying.
#[derive(Debug, Clone, Copy, Default)]
struct Costs {
    /// CPU: spun, and each sleep's.
    cpu_ns: f64,
    /// Latency the sleeps added to the work they found.
    latency_ns: f64,
    busy_ns: f64,
    periods: f64,
    /// Periods ended by a spin that caught the work.
    caught: f64,
    /// Periods that ended after a sleep, and the events (in the work one
    /// event brings while spinning) their wake-ups delayed.
    sleeps: f64,
    delayed: f64,
}

impl Costs {
    /// One idle period and the busy period after it; `delayed`: the
    /// events a sleep's wake-up delayed (None: it did not sleep).
    fn add(&mut self, cpu_ns: u64, latency_ns: u64, busy_ns: u64, delayed: Option<f64>) {
        self.cpu_ns += cpu_ns as f64;
        self.latency_ns += latency_ns as f64;
        self.busy_ns += busy_ns as f64;
        self.periods += 1.0;
        match delayed {
            None => self.caught += 1.0,
            Some(events) => {
                self.sleeps += 1.0;
                self.delayed += events;
            }
        }
        if self.periods >= DECAY_AT {
            for x in [
                &mut self.cpu_ns,
                &mut self.latency_ns,
                &mut self.busy_ns,
                &mut self.periods,
                &mut self.caught,
                &mut self.sleeps,
                &mut self.delayed,
            ] {
                *x *= 0.5;
            }
        }
    }

    /// The events a sleep delays, on average (`None` before a sleep).
    fn delayed_per_sleep(&self) -> Option<f64> {
        (self.sleeps > 0.0).then(|| self.delayed / self.sleeps)
    }

    /// Idle cost (CPU, and latency weighted) per ns of work; `None`
    /// before any.
    fn per_work(&self) -> Option<f64> {
        (self.periods > 0.0 && self.busy_ns > 0.0)
            .then(|| (self.cpu_ns + LATENCY_WEIGHT as f64 * self.latency_ns) / self.busy_ns)
    }

    /// The mean busy period: while spinning, the work one event brings.
    fn busy_per_period_ns(&self) -> Option<f64> {
        (self.periods > 0.0 && self.busy_ns > 0.0).then(|| self.busy_ns / self.periods)
    }
}

fn pct(per_work: Option<f64>) -> Option<u64> {
    per_work.map(|c| (c * 100.0).round() as u64)
}

/// An idle period that ended, waiting for the busy period after it.
#[derive(Debug, Clone, Copy)]
struct Period {
    regime: Regime,
    cpu_ns: u64,
    slept: bool,
}

/// A probe in progress: the other regime, and the idle periods it has
/// ended (the warm-up included).
#[derive(Debug, Clone, Copy)]
struct Probe {
    regime: Regime,
    seen: u32,
}

/// The adaptive mode's state for one reactor.
#[derive(Debug, Clone)]
pub struct Adaptive {
    wake: WakeCost,
    /// Idle periods while spinning (the window's basis).
    gaps: GapHistogram,
    /// The spinning window `gaps` gives, and the samples added since it
    /// was computed (`None`: compute it at the next decision).
    spin_window: Option<(u64, u32)>,
    regime: Regime,
    /// Per regime (`Regime::index`).
    costs: [Costs; 2],
    /// Idle periods since the regime began or was last compared.
    since_check: u32,
    /// Spinning: idle periods in a row for which no window paid.
    no_window_streak: u32,
    probe: Option<Probe>,
    next_probe_ns: u64,
    /// The last probe found the other regime cheaper: the next one, as
    /// soon as the own regime has `MIN_SAMPLES` periods again, confirms
    /// or not.
    confirming: bool,
    /// The own regime's cost at the last comparison (drift is measured
    /// from it).
    anchor: Option<f64>,
    /// When the current idle period began (None while busy).
    idle_since_ns: Option<u64>,
    /// When the current busy period began, and the regime and cost of the
    /// idle period before it (counted once the busy period ends).
    busy_since_ns: Option<u64>,
    pending: Option<Period>,
    /// The window chosen for the current idle period, cached.
    window_ns: u64,
    switches: u64,
    probes: u64,
    last_switch: Option<Switch>,
}

impl Adaptive {
    pub fn new(wake: WakeCost) -> Adaptive {
        Adaptive {
            wake,
            gaps: GapHistogram::new(),
            spin_window: None,
            regime: Regime::Sleep,
            costs: [Costs::default(); 2],
            since_check: 0,
            no_window_streak: 0,
            probe: None,
            next_probe_ns: 0,
            confirming: false,
            anchor: None,
            idle_since_ns: None,
            busy_since_ns: None,
            pending: None,
            window_ns: 0,
            switches: 0,
            probes: 0,
            last_switch: None,
        }
    }

    pub fn wake_cost(&self) -> WakeCost {
        self.wake
    }

    pub fn regime(&self) -> Regime {
        self.regime
    }

    /// The regime the current idle period runs in (a probe's, if any).
    fn active(&self) -> Regime {
        self.probe.map_or(self.regime, |p| p.regime)
    }

    /// Whether an idle period is open (`went_idle` without `found_work`).
    pub fn is_idle(&self) -> bool {
        self.idle_since_ns.is_some()
    }

    /// The reactor found no work at `now` after an iteration that did: an
    /// idle period starts. Returns the spin window for it (0: sleep now).
    /// Further calls in the same idle period return the same window.
    pub fn went_idle(&mut self, now: u64) -> u64 {
        if self.idle_since_ns.is_none() {
            if let (Some(since), Some(p)) = (self.busy_since_ns.take(), self.pending.take()) {
                let busy_ns = now.saturating_sub(since).min(BUSY_SAMPLE_MAX_NS);
                // A sleep delayed all the work its wake-up found, and the
                // work queued behind it: the busy period after it, counted
                // in the work one event brings while spinning (one event
                // before spinning was measured).
                let delayed = p.slept.then(|| {
                    self.costs[Regime::Spin.index()]
                        .busy_per_period_ns()
                        .map_or(1.0, |per| (busy_ns as f64 / per).max(1.0))
                });
                let latency_ns =
                    delayed.map_or(0, |events| (self.wake.latency_ns as f64 * events) as u64);
                self.costs[p.regime.index()].add(p.cpu_ns, latency_ns, busy_ns, delayed);
                if self.probe.is_none() {
                    self.since_check = self.since_check.saturating_add(1);
                }
            }
            self.idle_since_ns = Some(now);
            self.window_ns = self.decide(now);
        }
        self.window_ns
    }

    /// The window for an idle period in `regime`.
    fn window_for(&mut self, regime: Regime) -> u64 {
        match regime {
            Regime::Sleep => 0,
            // A probe's first periods, before the histogram knows the
            // gaps: spin as long as spinning could pay.
            Regime::Spin if self.gaps.total < f64::from(PROBE_WARMUP) => {
                self.wake.sleep_above_ns().min(MAX_SPIN_NS)
            }
            Regime::Spin => match self.spin_window {
                Some((window, added)) if added < WINDOW_REFRESH => window,
                _ => {
                    // A miss costs a sleep, and its wake-up delays every
                    // event it finds: at high load, many.
                    let delayed = self.costs[Regime::Sleep.index()]
                        .delayed_per_sleep()
                        .or(self.costs[Regime::Spin.index()].delayed_per_sleep())
                        .unwrap_or(1.0)
                        .max(1.0);
                    let value = self.wake.sleep_above_ns() as f64 * delayed;
                    let window = self.gaps.best_window(value as u64);
                    self.spin_window = Some((window, 0));
                    window
                }
            },
        }
    }

    fn decide(&mut self, now: u64) -> u64 {
        if let Some(p) = self.probe {
            if p.seen < PROBE_WARMUP + PROBE_SAMPLES {
                return self.window_for(p.regime);
            }
            self.probe = None;
            self.next_probe_ns = now.saturating_add(PROBE_EVERY_NS);
            self.since_check = 0;
            let own = self.costs[self.regime.index()].per_work();
            let other = self.costs[p.regime.index()].per_work();
            // Spinning that caught (almost) nothing is sleeping under
            // another name; its cost differs from sleeping's by noise.
            let probed = self.costs[p.regime.index()];
            let spun = p.regime == Regime::Sleep || probed.caught * 4.0 >= probed.periods;
            // Sleep only where spinning costs something worth saving.
            let spin_cost = self.costs[Regime::Spin.index()].per_work().unwrap_or(0.0);
            let worth =
                p.regime == Regime::Spin || spin_cost * 100.0 >= SPIN_COST_FLOOR_PERCENT as f64;
            if let (Some(own), Some(other), true, true) = (own, other, spun, worth) {
                let cheaper = other * 100.0 < own * (100 - HYSTERESIS_PERCENT) as f64;
                // Spinning that costs under the floor is taken without the
                // margin: a nearly saturated reactor spins, as poll does.
                let cheap_spin = p.regime == Regime::Spin
                    && other * 100.0 < SPIN_COST_FLOOR_PERCENT as f64
                    && other < own;
                if cheaper || cheap_spin {
                    if !self.confirming {
                        // Once may be a lucky stretch of the load: look
                        // again after MIN_SAMPLES periods of the own regime.
                        self.confirming = true;
                        self.next_probe_ns = now;
                        self.probes += 1;
                        self.anchor = Some(own);
                        return self.window_for(self.regime);
                    }
                    let reason = match p.regime {
                        Regime::Spin => SwitchReason::SpinCheaper,
                        Regime::Sleep => SwitchReason::SleepCheaper,
                    };
                    self.switch(now, reason);
                    self.anchor = Some(other);
                    return self.window_for(self.regime);
                }
            }
            self.confirming = false;
            self.probes += 1;
            self.anchor = own;
            return self.window_for(self.regime);
        }
        if self.since_check < MIN_SAMPLES {
            return self.window_for(self.regime);
        }
        let window = self.window_for(self.regime);
        if self.regime == Regime::Spin {
            if window == 0 {
                self.no_window_streak += 1;
                if self.no_window_streak >= MIN_SAMPLES {
                    self.switch(now, SwitchReason::GapsLong);
                    self.anchor = None;
                    return 0;
                }
            } else {
                self.no_window_streak = 0;
            }
        }
        let own = self.costs[self.regime.index()].per_work();
        let drifted = match (self.anchor, own) {
            (Some(a), Some(c)) => c > a * DRIFT_FACTOR || c * DRIFT_FACTOR < a,
            _ => false,
        };
        if now >= self.next_probe_ns || drifted {
            let other = self.regime.other();
            self.costs[other.index()] = Costs::default();
            if other == Regime::Spin {
                // The gaps while spinning now, not at the last probe.
                self.gaps = GapHistogram::new();
                self.spin_window = None;
            }
            self.probe = Some(Probe {
                regime: other,
                seen: 0,
            });
            return self.window_for(other);
        }
        window
    }

    fn switch(&mut self, now: u64, reason: SwitchReason) {
        self.last_switch = Some(Switch {
            reason,
            at_ns: now,
            spin_cost_pct: pct(self.costs[Regime::Spin.index()].per_work()),
            sleep_cost_pct: pct(self.costs[Regime::Sleep.index()].per_work()),
            gap_ns: self.gaps.median_ns(),
        });
        self.regime = reason.to();
        self.confirming = false;
        self.since_check = 0;
        self.no_window_streak = 0;
        self.switches += 1;
    }

    /// The spin window `went_idle` chose last (0: it chose to sleep).
    pub fn spin_window_ns(&self) -> u64 {
        self.window_ns
    }

    /// Whether to keep spinning at `now` in the current idle period.
    pub fn keep_spinning(&self, now: u64) -> bool {
        self.idle_since_ns
            .is_some_and(|since| now < since.saturating_add(self.window_ns))
    }

    /// Work was found at `now`, ending the idle period (if any). `slept`:
    /// the reactor slept in between (after spinning its window).
    pub fn found_work(&mut self, now: u64, slept: bool) {
        let Some(since) = self.idle_since_ns.take() else {
            return;
        };
        let seen = now.saturating_sub(since);
        let active = self.active();
        let (cpu_ns, gap) = if slept {
            (
                self.window_ns.min(seen) + self.wake.cpu_ns,
                // It outlasted the window; it came about a wake-up before
                // it was seen.
                seen.saturating_sub(self.wake.latency_ns)
                    .max(self.window_ns + 1),
            )
        } else {
            (seen, seen)
        };
        if active == Regime::Spin {
            self.gaps.add(gap);
            match self.spin_window.as_mut() {
                // A miss: fit the window again at once.
                Some(_) if slept => self.spin_window = None,
                Some((_, added)) => *added += 1,
                None => {}
            }
        }
        let counted = match self.probe.as_mut() {
            Some(p) => {
                p.seen += 1;
                p.seen > PROBE_WARMUP
            }
            None => true,
        };
        self.pending = counted.then_some(Period {
            regime: active,
            cpu_ns,
            slept,
        });
        self.busy_since_ns = Some(now);
    }

    /// A measured sleep-and-wake, as at start: a sleep ended by its timer
    /// (`latency_ns` from the deadline to running again, `cpu_ns` the CPU
    /// the sleep cost). Each estimate is a running median.
    pub fn measured_wake(&mut self, sample: WakeCost) {
        // A step of 1/32 of the estimate towards the sample: a preempted
        // or interrupted sleep (a softirq charged to the thread, a
        // migration) moves it by one step, however dear it read.
        let track = |old: u64, new: u64| -> u64 {
            let step = (old >> WAKE_STEP_SHIFT).max(1);
            if old == 0 {
                new
            } else if new > old {
                old + step
            } else if new < old {
                old - step
            } else {
                old
            }
        };
        self.wake.latency_ns = track(self.wake.latency_ns, sample.latency_ns);
        self.wake.cpu_ns = track(self.wake.cpu_ns, sample.cpu_ns);
        self.spin_window = None;
    }

    /// The decision and what it rests on.
    pub fn status(&self) -> AdaptiveStatus {
        AdaptiveStatus {
            regime: self.regime,
            probing: self.probe.map(|p| p.regime),
            confirming: self.confirming,
            spin_cost_pct: pct(self.costs[Regime::Spin.index()].per_work()),
            sleep_cost_pct: pct(self.costs[Regime::Sleep.index()].per_work()),
            gap_ns: self.gaps.median_ns(),
            wake: self.wake,
            spin_below_ns: self.wake.spin_below_ns(),
            sleep_above_ns: self.wake.sleep_above_ns(),
            window_ns: self.window_ns,
            switches: self.switches,
            probes: self.probes,
            last_switch: self.last_switch,
        }
    }

    /// Check the internal bookkeeping (tests).
    pub fn check_invariants(&self) {
        let sum: f64 = self.gaps.counts.iter().sum();
        assert!(
            (sum - self.gaps.total).abs() <= 1e-6 * self.gaps.total.max(1.0),
            "histogram total {} != sum of counts {sum}",
            self.gaps.total
        );
        assert!(self.window_ns <= MAX_SPIN_NS);
        for c in &self.costs {
            assert!(c.periods < DECAY_AT && c.caught + c.sleeps <= c.periods + 1e-6);
            assert!(
                c.delayed >= c.sleeps - 1e-6,
                "a sleep delays at least one event"
            );
            assert!(c.cpu_ns >= 0.0 && c.latency_ns >= 0.0 && c.busy_ns >= 0.0);
        }
        if let Some(p) = self.probe {
            assert_ne!(p.regime, self.regime, "a probe tries the other regime");
            assert!(p.seen <= PROBE_WARMUP + PROBE_SAMPLES);
        }
        if let Some(s) = self.last_switch {
            assert_eq!(
                s.reason.to(),
                self.regime,
                "the last switch entered the regime"
            );
        }
        assert!(self.idle_since_ns.is_none() || self.busy_since_ns.is_none());
        for k in 1..BUCKETS {
            assert!(bound_ns(k) > bound_ns(k - 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VM: WakeCost = WakeCost {
        latency_ns: 30_000,
        cpu_ns: 3_000,
    };

    /// A client that sends its next request `gap(i)` after the reactor
    /// went idle the i-th time (a ping-pong client: a sleep delays it by a
    /// wake-up), each taking `busy` to serve. Runs until `until`.
    fn pingpong(
        a: &mut Adaptive,
        now: &mut u64,
        until: u64,
        busy: u64,
        mut gap: impl FnMut(u64) -> u64,
    ) {
        let mut i = 0;
        while *now < until {
            let window = a.went_idle(*now);
            let g = gap(i);
            let slept = g > window;
            *now += if slept {
                g + a.wake_cost().latency_ns
            } else {
                g
            };
            a.found_work(*now, slept);
            *now += busy;
            a.check_invariants();
            i += 1;
        }
    }

    const SECOND: u64 = 1_000_000_000;

    #[test]
    fn no_history_sleeps() {
        let mut a = Adaptive::new(VM);
        assert_eq!(a.went_idle(0), 0);
        assert!(!a.keep_spinning(1));
        let s = a.status();
        assert_eq!(
            (s.regime, s.last_switch, s.probing),
            (Regime::Sleep, None, None)
        );
    }

    #[test]
    fn the_band_is_three_quarters_to_four_thirds_of_a_wake_up() {
        let s = Adaptive::new(VM).status();
        assert_eq!((s.spin_below_ns, s.sleep_above_ns), (24_750, 44_000));
    }

    #[test]
    fn a_few_short_gaps_are_no_evidence() {
        // The handshake's few quick round trips do not start a spin.
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        for _ in 0..MIN_SAMPLES {
            assert_eq!(a.went_idle(now), 0);
            now += 2_000 + VM.latency_ns;
            a.found_work(now, true);
            now += 5_000;
        }
        assert!(a.went_idle(now) > 0, "then a probe of spinning starts");
        assert_eq!(a.status().probing, Some(Regime::Spin));
    }

    #[test]
    fn a_steady_short_gap_stream_spins() {
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        pingpong(&mut a, &mut now, SECOND / 10, 5_000, |_| 12_000);
        let w = a.went_idle(now);
        assert!(w >= 12_000, "window {w} catches a 12 µs gap");
        // The bucket that holds 12 µs (16 µs), and two more: no gap seen
        // says a longer window would cost anything.
        assert!(w <= 32_000, "window {w} is not much longer than needed");
        assert!(a.keep_spinning(now + 11_000));
        assert!(!a.keep_spinning(now + w));
        let s = a.status();
        assert_eq!(s.regime, Regime::Spin);
        assert_eq!(s.switches, 1);
        assert_eq!(
            s.last_switch.map(|s| s.reason),
            Some(SwitchReason::SpinCheaper)
        );
        // 12 µs spun per 5 µs of work against 33 µs of wake-up.
        assert_eq!(s.spin_cost_pct, Some(240));
        assert_eq!(s.sleep_cost_pct, Some(660));
    }

    #[test]
    fn a_long_gap_stream_sleeps() {
        // 200 µs between events: spinning for them costs far more CPU than
        // the 30 µs of latency it would save.
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        pingpong(&mut a, &mut now, 3 * SECOND, 5_000, |_| 200_000);
        assert_eq!(a.went_idle(now), 0);
        let s = a.status();
        assert_eq!((s.regime, s.switches), (Regime::Sleep, 0));
        assert!(s.probes >= 3, "{s:?}");
    }

    #[test]
    fn gaps_between_x_and_y_keep_the_regime() {
        // 33 µs wake-ups: X = 24.75 µs, Y = 44 µs. 35 µs gaps: a sleeping
        // reactor keeps sleeping ...
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        pingpong(&mut a, &mut now, 3 * SECOND, 5_000, |_| 35_000);
        assert_eq!(a.status().regime, Regime::Sleep);
        assert_eq!(a.status().switches, 0);
        // ... and one brought to spinning by 10 µs gaps keeps spinning.
        let mut b = Adaptive::new(VM);
        let mut now = 1_000;
        pingpong(&mut b, &mut now, SECOND / 10, 5_000, |_| 10_000);
        pingpong(&mut b, &mut now, 3 * SECOND, 5_000, |_| 35_000);
        let s = b.status();
        assert_eq!((s.regime, s.switches), (Regime::Spin, 1), "{s:?}");
        assert!(b.went_idle(now) >= 35_000);
    }

    #[test]
    fn a_slow_source_does_not_switch_spinning_off_for_a_fast_one() {
        // A fast source (every 10 µs) and a slow one (every ~5 ms)
        // multiplexed: the slow one's events land inside the fast one's
        // gaps; most idle periods stay short, so the reactor spins.
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        pingpong(&mut a, &mut now, 2 * SECOND, 5_000, |i| {
            if i % 50 == 49 {
                4_000
            } else {
                10_000
            }
        });
        assert!(a.went_idle(now) >= 10_000);
        assert_eq!(a.status().regime, Regime::Spin);

        // The fast source alone after a pause of the load keeps spinning:
        // one long gap (the end of a burst) does not undo it.
        now += 3_000_000;
        a.found_work(now, true);
        now += 5_000;
        assert!(a.went_idle(now) >= 10_000);
    }

    #[test]
    fn the_measured_wake_up_cost_changes_the_decision() {
        // 40 µs gaps: not worth a spin when a wake-up costs 33 µs ...
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        pingpong(&mut a, &mut now, 2 * SECOND, 5_000, |_| 40_000);
        assert_eq!(a.status().regime, Regime::Sleep);
        // ... but worth it once timer wake-ups are measured at 80 µs (a
        // slower machine, a deep C-state): 3/4 of 85 is above 40.
        for _ in 0..64 {
            a.measured_wake(WakeCost {
                latency_ns: 80_000,
                cpu_ns: 5_000,
            });
        }
        assert!(a.wake_cost().latency_ns > 70_000);
        pingpong(&mut a, &mut now, 4 * SECOND, 5_000, |_| 40_000);
        assert_eq!(a.status().regime, Regime::Spin);
        assert!(a.went_idle(now) >= 40_000);
    }

    #[test]
    fn one_dear_wake_up_moves_the_estimate_one_step() {
        // A single timer sleep that read as 500 µs (preempted, a softirq
        // charged to it) moves each estimate by 1/32.
        let mut a = Adaptive::new(VM);
        a.measured_wake(WakeCost {
            latency_ns: 500_000,
            cpu_ns: 500_000,
        });
        let w = a.wake_cost();
        assert_eq!(w.latency_ns, VM.latency_ns + VM.latency_ns / 32);
        assert_eq!(w.cpu_ns, VM.cpu_ns + VM.cpu_ns / 32);
    }

    #[test]
    fn the_wake_cost_tracks_the_median_of_a_bimodal_cost() {
        // Wake-ups costing 4 µs one time in five and 13 µs otherwise (as
        // measured here): the median, 13 µs, whatever the start.
        for start in [2_000, 9_000, 40_000] {
            let mut a = Adaptive::new(WakeCost {
                latency_ns: 18_000,
                cpu_ns: start,
            });
            for i in 0..2_000 {
                let cpu_ns = if i % 5 == 0 { 4_000 } else { 13_000 };
                a.measured_wake(WakeCost {
                    latency_ns: 18_000,
                    cpu_ns,
                });
            }
            let c = a.wake_cost().cpu_ns;
            assert!((12_000..=14_000).contains(&c), "from {start}: {c}");
        }
    }

    #[test]
    fn the_decision_follows_a_change_of_load() {
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        pingpong(&mut a, &mut now, SECOND / 10, 5_000, |_| 8_000);
        assert_eq!(a.status().regime, Regime::Spin);
        // The client slows down to one request every 500 µs.
        pingpong(&mut a, &mut now, SECOND, 5_000, |_| 500_000);
        assert_eq!(a.went_idle(now), 0);
        let s = a.status();
        assert_eq!((s.regime, s.switches), (Regime::Sleep, 2));
        let last = s.last_switch.expect("a switch");
        assert!(
            matches!(
                last.reason,
                SwitchReason::GapsLong | SwitchReason::SleepCheaper
            ),
            "{last:?}"
        );
    }

    #[test]
    fn a_client_that_bunches_up_while_the_reactor_sleeps_gets_sleep() {
        // fio at 20,000 IOPS QD4 as recorded on an idle machine here:
        // spinning, 41 µs idle and 11 µs busy per request; sleeping, one
        // wake-up per pair of requests, 77 µs apart (seen) and 23 µs busy.
        // Spinning costs 41/11 = 373% of the work, sleeping (9 + 19 * 2.1
        // delayed) / 23 = 212%.
        fn fio_20k(a: &mut Adaptive, now: &mut u64, until: u64) {
            while *now < until {
                if a.went_idle(*now) >= 41_000 {
                    *now += 41_000;
                    a.found_work(*now, false);
                    *now += 11_000;
                } else {
                    *now += 77_000;
                    a.found_work(*now, true);
                    *now += 23_000;
                }
                a.check_invariants();
            }
        }
        let slow = WakeCost {
            latency_ns: 19_000,
            cpu_ns: 9_000,
        };
        let mut a = Adaptive::new(slow);
        let mut now = 1_000;
        fio_20k(&mut a, &mut now, 5 * SECOND);
        let s = a.status();
        assert_eq!((s.regime, s.switches), (Regime::Sleep, 0), "{s:?}");
        assert!(s.probes >= 4);
        // ... and one that was spinning (a burst before) goes to sleep too:
        // its window, fitted to the burst, misses the 41 µs gaps (no
        // window pays: gaps_long), or its next probe finds sleeping
        // cheaper.
        let mut b = Adaptive::new(slow);
        let mut now = 1_000;
        pingpong(&mut b, &mut now, SECOND / 10, 5_000, |_| 3_000);
        assert_eq!(b.regime(), Regime::Spin);
        let from = now;
        fio_20k(&mut b, &mut now, from + 2 * SECOND);
        let s = b.status();
        assert_eq!((s.regime, s.switches), (Regime::Sleep, 2), "{s:?}");
        assert!(
            matches!(
                s.last_switch.map(|s| s.reason),
                Some(SwitchReason::SleepCheaper | SwitchReason::GapsLong)
            ),
            "{s:?}"
        );
    }

    #[test]
    fn a_nearly_saturated_reactor_spins() {
        // QD64-like: long busy periods (600 µs) with short gaps (4 µs)
        // between. Spinning costs 0.7% of the work, sleeping (wake-ups of
        // 19 µs and 9 µs) 4.7%: the reactor spins, and with spinning under
        // the floor no probe's noise can send it back to sleep.
        let slow = WakeCost {
            latency_ns: 19_000,
            cpu_ns: 9_000,
        };
        let mut a = Adaptive::new(slow);
        let mut now = 1_000;
        pingpong(&mut a, &mut now, 3 * SECOND, 600_000, |_| 4_000);
        let s = a.status();
        assert_eq!((s.regime, s.switches), (Regime::Spin, 1), "{s:?}");
        assert!(
            s.spin_cost_pct.is_some_and(|c| c < SPIN_COST_FLOOR_PERCENT),
            "{s:?}"
        );
    }

    #[test]
    fn bimodal_gaps_spin_for_the_short_mode_only() {
        // Half the gaps are 3 µs (the next request of a batch), half 2 ms
        // (think time): spin ~3 µs, not 2 ms.
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        pingpong(&mut a, &mut now, 2 * SECOND, 5_000, |i| {
            if i % 2 == 0 {
                3_000
            } else {
                2_000_000
            }
        });
        assert_eq!(a.status().regime, Regime::Spin);
        let w = a.went_idle(now);
        assert!((3_000..=6_000).contains(&w), "window {w}");
    }

    #[test]
    fn windows_are_bounded() {
        let mut a = Adaptive::new(WakeCost {
            latency_ns: 10_000_000,
            cpu_ns: 0,
        });
        let mut now = 1_000;
        pingpong(&mut a, &mut now, 2 * SECOND, 5_000, |_| 900_000);
        assert!(a.went_idle(now) <= MAX_SPIN_NS);
    }
}
