//! The adaptive mode's spin-or-sleep decision, as a pure unit: events in
//! (the reactor went idle, found work, woke from a sleep), a decision out
//! (spin until some time, or sleep now). It never reads a clock, so the
//! tests below drive it on made-up times.
//!
//! ```
//! use lull_reactor::adaptive::{Adaptive, WakeCost};
//! let mut a = Adaptive::new(WakeCost { latency_ns: 30_000, cpu_ns: 3_000 });
//! // A client that sends its next request 10 µs after each reply.
//! let mut now = 0;
//! for _ in 0..100 {
//!     a.went_idle(now);
//!     now += 10_000;
//!     a.found_work(now, false);
//!     now += 5_000;
//! }
//! // Waiting 10 µs on a CPU beats paying a 30 µs wake-up: spin.
//! assert!(a.went_idle(now) >= 10_000);
//! ```
//!
//! **What a sleep costs.** Blocking in `epoll_wait` and being woken costs
//! the request that wakes the reactor a wake-up latency (`latency_ns`: the
//! interrupt, the scheduler, the context switch; on a VM also the exit
//! from the halted vCPU) and costs the reactor some CPU (`cpu_ns`: the
//! syscall and two context switches). Both are measured on the machine
//! (see [`WakeCost`] and `Reactor::calibrate`), not assumed.
//!
//! **What a spin costs.** Polling for `s` ns costs `s` ns of a core if no
//! event comes, or the time until the event if one does.
//!
//! **The decision.** The reactor's idle periods (from going idle to the
//! next work, whichever source brings it) are kept as a decaying histogram.
//! Spinning for `s` catches the next event with probability `P(I <= s)`,
//! saving its wake-up (latency and CPU), and costs `E[min(I, s)]` of CPU.
//! The window chosen maximises
//!
//! ```text
//! gain(s) = P(I <= s) * (LATENCY_WEIGHT * latency_ns + cpu_ns) - E[min(I, s)]
//! ```
//!
//! over the histogram's bucket bounds; when no window gains, the reactor
//! sleeps at once. This is competitive spinning (Karlin, Li, Manasse and
//! Owicki, SOSP 1991) with the gap distribution known: where the
//! distribution-free rule spins for one wake-up cost and is within 2x of
//! the optimum, knowing the distribution picks the window that is optimal
//! for it: long gaps make adaptive behave like interrupt mode (no spin),
//! gaps shorter than a wake-up make it behave like poll mode.
//!
//! **Sources.** The histogram is the reactor's, not a source's: an idle
//! period ends with the first event of any source, so a slow source (a
//! far replica, a slow disk) only ever shortens idle periods and can never
//! switch spinning off for a fast one; a fast source among many idle ones
//! makes the idle periods short, and spinning pays. Keeping one histogram
//! makes the decision O(buckets), independent of connections.

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
/// stops, a new one starts) changes the decision within a few hundred
/// idle periods.
const DECAY_AT: f32 = 512.0;

/// Weight of a new wake-up measurement in the running estimate (1/8: a
/// few samples move it, one outlier does not).
const WAKE_EWMA_SHIFT: u32 = 3;

/// What one sleep-and-wake costs on this machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WakeCost {
    /// From the event to the reactor running again.
    pub latency_ns: u64,
    /// CPU the reactor spends going to sleep and coming back.
    pub cpu_ns: u64,
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
    counts: [f32; BUCKETS + 1],
    /// Sum of the gaps in each bucket, for `E[min(I, s)]`.
    sums_ns: [f32; BUCKETS + 1],
    total: f32,
}

impl GapHistogram {
    fn new() -> GapHistogram {
        GapHistogram {
            counts: [0.0; BUCKETS + 1],
            sums_ns: [0.0; BUCKETS + 1],
            total: 0.0,
        }
    }

    fn bucket(gap_ns: u64) -> usize {
        (0..BUCKETS)
            .find(|&k| gap_ns <= bound_ns(k))
            .unwrap_or(BUCKETS)
    }

    fn add(&mut self, gap_ns: u64) {
        let k = GapHistogram::bucket(gap_ns);
        self.counts[k] += 1.0;
        self.sums_ns[k] += gap_ns as f32;
        self.total += 1.0;
        if self.total >= DECAY_AT {
            for k in 0..=BUCKETS {
                self.counts[k] *= 0.5;
                self.sums_ns[k] *= 0.5;
            }
            self.total *= 0.5;
        }
    }

    /// The window that maximises the expected gain of spinning, and the
    /// gain; (0, 0) when no window gains.
    fn best_window(&self, saved_ns: u64) -> (u64, f32) {
        if self.total <= 0.0 {
            return (0, 0.0);
        }
        let saved = saved_ns as f32;
        let mut best = (0, 0.0f32);
        let (mut caught, mut caught_sum) = (0.0f32, 0.0f32);
        for k in 0..BUCKETS {
            let s = bound_ns(k);
            if s > MAX_SPIN_NS {
                break;
            }
            caught += self.counts[k];
            caught_sum += self.sums_ns[k];
            let p = caught / self.total;
            let missed = (self.total - caught) / self.total;
            let spent = caught_sum / self.total + missed * s as f32;
            let gain = p * saved - spent;
            if gain > best.1 {
                best = (s, gain);
            }
        }
        best
    }
}

/// The adaptive mode's state for one reactor.
#[derive(Debug, Clone)]
pub struct Adaptive {
    wake: WakeCost,
    gaps: GapHistogram,
    /// When the current idle period began (None while busy).
    idle_since_ns: Option<u64>,
    /// The window chosen for the current idle period, cached.
    window_ns: u64,
}

impl Adaptive {
    pub fn new(wake: WakeCost) -> Adaptive {
        Adaptive {
            wake,
            gaps: GapHistogram::new(),
            idle_since_ns: None,
            window_ns: 0,
        }
    }

    pub fn wake_cost(&self) -> WakeCost {
        self.wake
    }

    /// What catching an event by spinning saves.
    fn saved_ns(&self) -> u64 {
        LATENCY_WEIGHT * self.wake.latency_ns + self.wake.cpu_ns
    }

    /// The reactor found no work at `now` after an iteration that did: an
    /// idle period starts. Returns the spin window for it (0: sleep now).
    pub fn went_idle(&mut self, now: u64) -> u64 {
        if self.idle_since_ns.is_none() {
            self.idle_since_ns = Some(now);
            self.window_ns = self.gaps.best_window(self.saved_ns()).0;
        }
        self.window_ns
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
    /// the reactor slept in between, so the event came a wake-up earlier
    /// than it was seen.
    pub fn found_work(&mut self, now: u64, slept: bool) {
        let Some(since) = self.idle_since_ns.take() else {
            return;
        };
        let seen = now.saturating_sub(since);
        let gap = if slept {
            // It was not caught by the spin, so it came after the window.
            seen.saturating_sub(self.wake.latency_ns)
                .max(self.window_ns + 1)
        } else {
            seen
        };
        self.gaps.add(gap);
    }

    /// A measured sleep-and-wake: `latency_ns` from the armed deadline to
    /// running again (a timer wake-up), `cpu_ns` the CPU the sleep cost.
    /// Either may be unknown for a given sleep.
    pub fn measured_wake(&mut self, latency_ns: Option<u64>, cpu_ns: Option<u64>) {
        // One sample moves the estimate by at most 1/8 of the way to at
        // most twice (or half) of it: a preempted or interrupted sleep (a
        // softirq charged to the thread, a migration) reads as a wake-up
        // several times too dear, and must not flip the decision alone.
        let ewma = |old: u64, new: u64| -> u64 {
            if old == 0 {
                new
            } else {
                let new = new.clamp(old / 2, old.saturating_mul(2));
                old - (old >> WAKE_EWMA_SHIFT) + (new >> WAKE_EWMA_SHIFT)
            }
        };
        if let Some(l) = latency_ns {
            self.wake.latency_ns = ewma(self.wake.latency_ns, l);
        }
        if let Some(c) = cpu_ns {
            self.wake.cpu_ns = ewma(self.wake.cpu_ns, c);
        }
    }

    /// Check the internal bookkeeping (tests).
    pub fn check_invariants(&self) {
        let sum: f32 = self.gaps.counts.iter().sum();
        assert!(
            (sum - self.gaps.total).abs() <= 1e-2 * self.gaps.total.max(1.0),
            "histogram total {} != sum of counts {sum}",
            self.gaps.total
        );
        assert!(self.window_ns <= MAX_SPIN_NS);
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

    /// Feed idle periods of the given lengths, each followed by 5 µs of
    /// work; `caught(gap, window)` says whether a spin would have caught
    /// it (else the reactor slept and saw it a wake-up late).
    fn feed(a: &mut Adaptive, now: &mut u64, gaps: impl IntoIterator<Item = u64>) {
        for gap in gaps {
            let window = a.went_idle(*now);
            let slept = gap > window;
            let seen = if slept {
                gap + a.wake_cost().latency_ns
            } else {
                gap
            };
            *now += seen;
            a.found_work(*now, slept);
            *now += 5_000;
        }
        a.check_invariants();
    }

    #[test]
    fn no_history_sleeps() {
        let mut a = Adaptive::new(VM);
        assert_eq!(a.went_idle(0), 0);
        assert!(!a.keep_spinning(1));
    }

    #[test]
    fn a_steady_short_gap_stream_spins() {
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        feed(&mut a, &mut now, std::iter::repeat_n(12_000, 200));
        let w = a.went_idle(now);
        assert!(w >= 12_000, "window {w} catches a 12 µs gap");
        assert!(w <= 2 * 12_000, "window {w} is not much longer than needed");
        assert!(a.keep_spinning(now + 11_000));
        assert!(!a.keep_spinning(now + w));
    }

    #[test]
    fn a_long_gap_stream_sleeps() {
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        // 200 µs between events: spinning for them costs far more CPU than
        // the 30 µs of latency it would save.
        feed(&mut a, &mut now, std::iter::repeat_n(200_000, 200));
        assert_eq!(a.went_idle(now), 0);
    }

    #[test]
    fn gaps_just_above_the_wake_cost_do_not_pay() {
        // 40 µs gaps, wake-up 30+3 µs: spinning 40 µs to save 33 loses.
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        feed(&mut a, &mut now, std::iter::repeat_n(40_000, 200));
        assert_eq!(a.went_idle(now), 0);
    }

    #[test]
    fn a_slow_source_does_not_switch_spinning_off_for_a_fast_one() {
        // A fast source (every 10 µs) and a slow one (every ~5 ms)
        // multiplexed: the slow one's events land inside the fast one's
        // gaps; most idle periods stay short, so the reactor spins.
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        let mixed = (0..400u64).map(|i| if i % 50 == 49 { 4_000 } else { 10_000 });
        feed(&mut a, &mut now, mixed);
        assert!(a.went_idle(now) >= 10_000);

        // The fast source alone after a pause of the load keeps spinning:
        // one long gap (the end of a burst) does not undo it.
        a.found_work(now + 3_000_000, true);
        now += 3_000_005;
        assert!(a.went_idle(now) >= 10_000);
    }

    #[test]
    fn the_measured_wake_up_cost_changes_the_decision() {
        // 40 µs gaps: not worth a spin when a wake-up costs 33 µs ...
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        feed(&mut a, &mut now, std::iter::repeat_n(40_000, 200));
        assert_eq!(a.went_idle(now), 0);
        a.found_work(now, false);
        // ... but worth it once wake-ups are measured at 80 µs (a slower
        // machine, a deep C-state).
        for _ in 0..64 {
            a.measured_wake(Some(80_000), Some(5_000));
        }
        assert!(a.wake_cost().latency_ns > 70_000);
        now += 1_000;
        assert!(a.went_idle(now) >= 40_000);
    }

    #[test]
    fn one_dear_wake_up_does_not_flip_the_decision() {
        // 40 µs gaps do not pay for a 33 µs wake-up; a single sleep that
        // read as 500 µs of CPU (preempted, a softirq charged to it) moves
        // the estimate by at most an eighth of a doubling.
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        feed(&mut a, &mut now, std::iter::repeat_n(40_000, 200));
        a.measured_wake(Some(500_000), Some(500_000));
        let w = a.wake_cost();
        assert!(w.latency_ns <= VM.latency_ns * 9 / 8 + 1, "{w:?}");
        assert!(w.cpu_ns <= VM.cpu_ns * 9 / 8 + 1, "{w:?}");
        a.found_work(now, false);
        assert_eq!(a.went_idle(now + 1), 0);
    }

    #[test]
    fn the_decision_follows_a_change_of_load() {
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        feed(&mut a, &mut now, std::iter::repeat_n(8_000, 300));
        assert!(a.went_idle(now) > 0);
        a.found_work(now, false);
        // The client slows down to one request every 500 µs.
        feed(&mut a, &mut now, std::iter::repeat_n(500_000, 1_000));
        assert_eq!(a.went_idle(now), 0, "the old fast samples have decayed");
    }

    #[test]
    fn bimodal_gaps_spin_for_the_short_mode_only() {
        // Half the gaps are 3 µs (the next request of a batch), half 2 ms
        // (think time): spin ~3 µs, not 2 ms.
        let mut a = Adaptive::new(VM);
        let mut now = 1_000;
        let gaps = (0..400u64).map(|i| if i % 2 == 0 { 3_000 } else { 2_000_000 });
        feed(&mut a, &mut now, gaps);
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
        feed(&mut a, &mut now, std::iter::repeat_n(900_000, 100));
        assert!(a.went_idle(now) <= MAX_SPIN_NS);
    }
}
