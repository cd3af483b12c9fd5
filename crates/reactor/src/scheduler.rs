//! The scheduler's decision: where each lull thread should run next period.
//!
//! Every scheduling period the framework gathers each thread's load (the
//! share of one core it was busy, over the period) and each reactor's, calls
//! [`balance`], moves the threads whose target changed, and lets reactors
//! left without threads sleep. This module is the pure part: no clock, no
//! reactor, so it is tested by simulation (the tests below run synthetic
//! load traces over up to 256 reactors and 10,000 threads).
//!
//! `dynamic` follows SPDK's dynamic scheduler (`scheduler_dynamic.c`):
//! threads under `load_limit` go to the main reactor; a reactor over
//! `core_limit` sheds busy threads to the first reactor (main first, then
//! by index) that fits them, else to an empty one; threads consolidate
//! onto lower-numbered reactors so the others can sleep; a reactor
//! measured at or above `core_busy` takes no thread from others in that
//! round (its threads' loads understate what they would use). It differs
//! from SPDK in changing as little as it can each period (a thread moves
//! only to relieve an overload, to join an idle main reactor, or to empty
//! a whole reactor), so wobbling load does not reshuffle threads.
//! Beyond SPDK:
//!
//! - **No ping-pong.** A thread's class has a hysteresis band: one on the
//!   main reactor counts as busy only from `load_limit` + [`LOAD_HYSTERESIS`],
//!   one elsewhere as idle only under `load_limit` − [`LOAD_HYSTERESIS`]; a
//!   thread moved in the last [`MOVE_COOLDOWN_PERIODS`] periods stays put
//!   (its load was partly measured on the old reactor); consolidation
//!   needs [`CONSOLIDATE_MARGIN`] of room under `core_limit`, so a
//!   measurement error of a few points does not send it back; and when
//!   the machine is overloaded whatever the placement, threads move only
//!   if that cuts the overload by more than the same margin. Under steady
//!   load a placement is reached and kept (tested: no A → B → A).
//! - **Packing that holds.** When the placement-keeping pass leaves a
//!   reactor projected over `core_limit`, a first-fit-decreasing packing
//!   of every movable thread is tried, and kept if it overloads less.
//!   First fit never overloads when every thread fits in half a core's
//!   limit and the total fits in half of all cores' limits (two reactors
//!   under half full would have been merged), nor when there are no more
//!   busy threads than reactors.
//! - **Tunables at run time** (`framework_set_scheduler`).

/// Default scheduling period (SPDK's default, 1 s).
pub const DEFAULT_PERIOD_US: u64 = 1_000_000;

/// Shortest period accepted: each period reads every thread's counters and
/// may move threads; below 10 ms the busy times are too short to mean much
/// (a thread's few iterations), and moves would churn.
pub const MIN_PERIOD_US: u64 = 10_000;

/// Longest period accepted (an hour): beyond it the scheduler is off in
/// all but name; use `static`.
pub const MAX_PERIOD_US: u64 = 3_600_000_000;

/// SPDK's defaults for the dynamic scheduler's tunables (percent).
pub const DEFAULT_LOAD_LIMIT: u8 = 20;
pub const DEFAULT_CORE_LIMIT: u8 = 80;
pub const DEFAULT_CORE_BUSY: u8 = 95;

/// Half-width of the band around `load_limit` (percentage points) inside
/// which a thread keeps its class (idle on the main reactor, busy
/// elsewhere): a thread whose load wobbles around the limit does not move
/// every period. At most half of `load_limit`.
pub const LOAD_HYSTERESIS: f64 = 5.0;

/// Periods after a move during which a thread is not consolidated again:
/// its load was measured partly on the old reactor, and one more period
/// tells whether the new placement holds.
pub const MOVE_COOLDOWN_PERIODS: u32 = 2;

/// Room (percentage points) a consolidation must leave under `core_limit`
/// on the target, so that a few points of measurement noise do not undo it
/// next period.
pub const CONSOLIDATE_MARGIN: f64 = 10.0;

/// The dynamic scheduler's tunables, in percent of one core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DynamicParams {
    /// Threads busy less than this are idle: they go to the main reactor.
    pub load_limit: u8,
    /// A reactor is not loaded above this by placing threads on it.
    pub core_limit: u8,
    /// A reactor measured at or above this is saturated: its threads'
    /// loads are underestimates, so no thread moves onto it this round.
    pub core_busy: u8,
}

impl Default for DynamicParams {
    fn default() -> Self {
        DynamicParams {
            load_limit: DEFAULT_LOAD_LIMIT,
            core_limit: DEFAULT_CORE_LIMIT,
            core_busy: DEFAULT_CORE_BUSY,
        }
    }
}

impl DynamicParams {
    /// Reject tunables that make no sense together.
    pub fn validate(&self) -> Result<(), String> {
        let DynamicParams {
            load_limit,
            core_limit,
            core_busy,
        } = *self;
        if load_limit > 100 || core_limit > 100 || core_busy > 100 {
            return Err("load_limit, core_limit and core_busy are percentages (0-100)".into());
        }
        if core_limit == 0 {
            return Err("core_limit must be at least 1".into());
        }
        if load_limit > core_limit {
            return Err(format!(
                "load_limit ({load_limit}) must not exceed core_limit ({core_limit})"
            ));
        }
        if core_busy < core_limit {
            return Err(format!(
                "core_busy ({core_busy}) must be at least core_limit ({core_limit})"
            ));
        }
        Ok(())
    }
}

/// Which scheduler runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Threads stay where they were created.
    Static,
    /// SPDK's dynamic scheduler, with the additions above.
    Dynamic(DynamicParams),
}

impl Policy {
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Static => "static",
            Policy::Dynamic(_) => "dynamic",
        }
    }
}

/// One thread as `balance` sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ThreadLoad {
    /// Where it runs now.
    pub reactor: usize,
    /// Busy share of one core over the last period, in percent.
    pub load: f64,
    /// Never moved.
    pub pinned: bool,
    /// Periods since it last moved (`u32::MAX`: never).
    pub periods_since_move: u32,
}

/// One reactor as `balance` sees it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CoreLoad {
    /// Busy share of its core over the last period, in percent, as the
    /// reactor measured it (its threads' work and its own).
    pub busy: f64,
}

/// The outcome of one round.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The reactor each thread should run on (same order as the input).
    pub targets: Vec<usize>,
    /// The projected load of each reactor under `targets`, in percent.
    pub projected: Vec<f64>,
}

impl Plan {
    /// Reactors with no thread under the plan: they sleep.
    pub fn empty_reactors(&self) -> Vec<bool> {
        let mut empty = vec![true; self.projected.len()];
        for &t in &self.targets {
            empty[t] = false;
        }
        empty
    }

    /// Threads whose target differs from where they are.
    pub fn moves(&self, threads: &[ThreadLoad]) -> usize {
        threads
            .iter()
            .zip(&self.targets)
            .filter(|(t, &to)| t.reactor != to)
            .count()
    }
}

/// Where each thread should run next period (SPDK's `balance`, with the
/// hysteresis and packing described in the module doc). `main` is the main
/// reactor; `cores[i]` is reactor `i`. A thread whose reactor is out of
/// range is left where it is.
///
/// The first pass changes as little as it can, so that load that wobbles
/// from period to period does not reshuffle threads: idle threads join
/// the main reactor while it has room; a reactor over the limit sheds its
/// largest movable threads to the first reactor that fits them; a reactor
/// whose threads all fit on lower-numbered ones (with margin) is emptied,
/// so it can sleep. Only when that leaves an avoidable overload does a
/// first-fit-decreasing packing replace it.
pub fn balance(
    params: &DynamicParams,
    main: usize,
    cores: &[CoreLoad],
    threads: &[ThreadLoad],
) -> Plan {
    let n = cores.len();
    let stay = Plan {
        targets: threads.iter().map(|t| t.reactor).collect(),
        projected: {
            let mut p = vec![0.0; n];
            for t in threads.iter().filter(|t| t.reactor < n) {
                p[t.reactor] += t.load.max(0.0);
            }
            p
        },
    };
    if n == 0 || main >= n {
        return stay;
    }
    let limit = f64::from(params.core_limit);
    let saturated: Vec<bool> = cores
        .iter()
        .map(|c| c.busy >= f64::from(params.core_busy))
        .collect();
    // Main first, then the others in index order: the consolidation order.
    let order: Vec<usize> = std::iter::once(main)
        .chain((0..n).filter(|&c| c != main))
        .collect();
    let rank = {
        let mut r = vec![0; n];
        for (i, &c) in order.iter().enumerate() {
            r[c] = i;
        }
        r
    };
    let load = |i: usize| threads[i].load.max(0.0);
    // A thread moved in the last periods stays put (never back and forth
    // on one period's guess), like a pinned one.
    let movable = |i: usize| {
        let t = &threads[i];
        !t.pinned && t.reactor < n && t.periods_since_move >= MOVE_COOLDOWN_PERIODS
    };
    let idle = |i: usize| {
        let t = &threads[i];
        let ll = f64::from(params.load_limit);
        // The band narrows for small limits, so that a thread can still
        // count as idle away from main.
        let band = LOAD_HYSTERESIS.min(ll / 2.0);
        if t.reactor == main {
            t.load < ll + band
        } else {
            t.load < ll - band
        }
    };
    // Threads by decreasing load (ties by input order: deterministic).
    let mut by_load: Vec<usize> = (0..threads.len()).collect();
    by_load.sort_by(|&a, &b| load(b).total_cmp(&load(a)).then(a.cmp(&b)));

    // Pass 1, starting from where every thread is.
    let mut plan = stay.clone();
    let mut count = vec![0usize; n];
    for t in threads.iter().filter(|t| t.reactor < n) {
        count[t.reactor] += 1;
    }
    let mv = |plan: &mut Plan, count: &mut [usize], i: usize, to: usize| {
        let from = plan.targets[i];
        let l = load(i);
        plan.projected[from] -= l;
        count[from] -= 1;
        plan.projected[to] += l;
        count[to] += 1;
        plan.targets[i] = to;
    };
    // a. Idle threads join the main reactor while it has room.
    for &i in by_load.iter().rev() {
        if movable(i)
            && idle(i)
            && threads[i].reactor != main
            && !saturated[main]
            && plan.projected[main] + load(i) <= limit
        {
            mv(&mut plan, &mut count, i, main);
        }
    }
    // b. A reactor over the limit sheds its largest movable threads.
    for c in 0..n {
        for &i in &by_load {
            if plan.projected[c] <= limit || count[c] <= 1 {
                break;
            }
            if plan.targets[i] != c || !movable(i) {
                continue;
            }
            let l = load(i);
            let fit = order
                .iter()
                .copied()
                .find(|&d| d != c && !saturated[d] && plan.projected[d] + l <= limit);
            let to = fit.unwrap_or_else(|| {
                // Fits nowhere: alone on an empty reactor it delays no one.
                order
                    .iter()
                    .copied()
                    .find(|&d| count[d] == 0 && !saturated[d])
                    .unwrap_or(c)
            });
            if to != c {
                mv(&mut plan, &mut count, i, to);
            }
        }
    }
    // c. Empty the highest reactors whose threads fit lower down.
    for &c in order.iter().skip(1).rev() {
        let on_c: Vec<usize> = by_load
            .iter()
            .copied()
            .filter(|&i| plan.targets[i] == c)
            .collect();
        if on_c.is_empty() || !on_c.iter().all(|&i| movable(i)) {
            continue;
        }
        let mut trial = plan.clone();
        let mut trial_count = count.clone();
        let emptied =
            on_c.iter().all(|&i| {
                let l = load(i);
                match order[..rank[c]].iter().copied().find(|&d| {
                    !saturated[d] && trial.projected[d] + l <= limit - CONSOLIDATE_MARGIN
                }) {
                    Some(d) => {
                        mv(&mut trial, &mut trial_count, i, d);
                        true
                    }
                    None => false,
                }
            });
        if emptied {
            plan = trial;
            count = trial_count;
        }
    }
    let over_of = |p: &Plan| overload(&p.projected, &largest(n, threads, &p.targets), limit);
    let over = over_of(&plan);
    if over <= 0.0 {
        return plan;
    }

    // Pass 2: first fit decreasing from scratch, placement-blind (no
    // current reactor, no saturation) so that the packing is the same
    // whatever placement it starts from; fixed threads stay.
    let mut packed = Plan {
        targets: vec![usize::MAX; threads.len()],
        projected: vec![0.0; n],
    };
    let mut count = vec![0usize; n];
    for i in (0..threads.len()).filter(|&i| !movable(i)) {
        packed.targets[i] = threads[i].reactor;
        if threads[i].reactor < n {
            packed.projected[threads[i].reactor] += load(i);
            count[threads[i].reactor] += 1;
        }
    }
    for &i in by_load.iter().filter(|&&i| movable(i)) {
        let l = load(i);
        let to = order
            .iter()
            .copied()
            .find(|&c| packed.projected[c] + l <= limit)
            .or_else(|| order.iter().copied().find(|&c| count[c] == 0))
            .unwrap_or_else(|| least_loaded(&packed.projected, main));
        packed.projected[to] += l;
        count[to] += 1;
        packed.targets[i] = to;
    }
    let best = if over_of(&packed) < over {
        packed
    } else {
        plan
    };
    // An avoidable overload is avoided; an unavoidable one (the machine is
    // full whatever the placement) moves threads only for a clear gain
    // over staying put: shuffling a full machine only adds churn.
    if over_of(&best) <= 0.0 || over_of(&best) < over_of(&stay) - CONSOLIDATE_MARGIN {
        best
    } else {
        stay
    }
}

/// How far, summed over reactors, projections pass the limit, not
/// counting what no placement can avoid: a reactor whose largest thread is
/// over the limit alone is over only by what it holds besides.
fn overload(projected: &[f64], largest: &[f64], limit: f64) -> f64 {
    projected
        .iter()
        .zip(largest)
        .map(|(p, l)| (p - limit.max(*l)).max(0.0))
        .sum()
}

/// The largest load placed on each reactor by `targets`.
fn largest(n: usize, threads: &[ThreadLoad], targets: &[usize]) -> Vec<f64> {
    let mut big = vec![0.0f64; n];
    for (t, &to) in threads.iter().zip(targets) {
        if to < n {
            big[to] = big[to].max(t.load);
        }
    }
    big
}

/// The least loaded reactor (`pref` wins ties).
fn least_loaded(proj: &[f64], pref: usize) -> usize {
    let mut best = pref.min(proj.len() - 1);
    for (c, &p) in proj.iter().enumerate() {
        if p < proj[best] {
            best = c;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t(reactor: usize, load: f64) -> ThreadLoad {
        ThreadLoad {
            reactor,
            load,
            pinned: false,
            periods_since_move: u32::MAX,
        }
    }

    fn cores(n: usize) -> Vec<CoreLoad> {
        vec![CoreLoad::default(); n]
    }

    /// Run `periods` rounds with fixed per-thread loads, applying each
    /// plan; returns the placements after each round.
    fn run(
        params: &DynamicParams,
        n: usize,
        mut threads: Vec<ThreadLoad>,
        periods: usize,
    ) -> Vec<Vec<usize>> {
        let mut history = Vec::new();
        for _ in 0..periods {
            let mut busy = vec![0.0; n];
            for t in &threads {
                busy[t.reactor] += t.load;
            }
            let cl: Vec<CoreLoad> = busy
                .iter()
                .map(|&b| CoreLoad { busy: b.min(100.0) })
                .collect();
            let plan = balance(params, 0, &cl, &threads);
            for (t, &to) in threads.iter_mut().zip(&plan.targets) {
                if t.reactor != to {
                    t.reactor = to;
                    t.periods_since_move = 0;
                } else {
                    t.periods_since_move = t.periods_since_move.saturating_add(1);
                }
            }
            history.push(threads.iter().map(|t| t.reactor).collect());
        }
        history
    }

    #[test]
    fn idle_threads_gather_on_main_and_the_rest_sleep() {
        let p = DynamicParams::default();
        let threads: Vec<_> = (0..40).map(|i| t(i % 4, 0.5)).collect();
        let plan = balance(&p, 0, &cores(4), &threads);
        assert!(plan.targets.iter().all(|&r| r == 0));
        assert_eq!(plan.empty_reactors(), vec![false, true, true, true]);
    }

    #[test]
    fn busy_thread_leaves_an_overloaded_main_and_stays_away() {
        let p = DynamicParams::default();
        let mut threads = vec![t(0, 90.0)];
        threads.extend((0..7).map(|_| t(0, 1.0)));
        let h = run(&p, 2, threads, 6);
        assert_eq!(h[0][0], 1, "the busy thread moves off main");
        assert!(h.iter().all(|p| p[1..].iter().all(|&r| r == 0)));
        assert!(h.iter().all(|p| p[0] == 1), "and does not come back");
    }

    #[test]
    fn a_thread_over_the_limit_alone_leaves_threads_that_read_as_zero() {
        let p = DynamicParams::default();
        let mut threads = vec![t(0, 100.0)];
        threads.extend((0..4).map(|_| t(0, 0.0)));
        let h = run(&p, 2, threads, 4);
        assert!(h.iter().all(|p| p == &vec![1, 0, 0, 0, 0]), "{h:?}");
    }

    #[test]
    fn a_busy_thread_that_fits_on_main_stays_there() {
        let p = DynamicParams::default();
        let plan = balance(&p, 0, &cores(2), &[t(0, 60.0), t(0, 2.0)]);
        assert_eq!(plan.targets, vec![0, 0]);
    }

    #[test]
    fn consolidates_when_load_drops() {
        let p = DynamicParams::default();
        // Two threads at 30 % on reactors 1 and 2 fit together on main.
        let h = run(&p, 3, vec![t(1, 30.0), t(2, 30.0)], 4);
        assert_eq!(h.last().unwrap(), &vec![0, 0]);
    }

    #[test]
    fn saturated_core_takes_no_newcomer() {
        let p = DynamicParams::default();
        // Reactor 1 measured at 99 % with one thread that reads as 50 %:
        // a 20 % thread from an overloaded main must not go there.
        let cl = vec![
            CoreLoad { busy: 100.0 },
            CoreLoad { busy: 99.0 },
            CoreLoad { busy: 0.0 },
        ];
        let threads = vec![t(0, 70.0), t(0, 25.0), t(1, 50.0)];
        let plan = balance(&p, 0, &cl, &threads);
        assert_eq!(plan.targets[2], 1);
        assert_ne!(plan.targets[1], 1);
    }

    #[test]
    fn pinned_threads_never_move() {
        let p = DynamicParams::default();
        let mut pinned = t(3, 0.0);
        pinned.pinned = true;
        let plan = balance(&p, 0, &cores(4), &[pinned, t(2, 0.0)]);
        assert_eq!(plan.targets, vec![3, 0]);
    }

    #[test]
    fn hysteresis_keeps_a_thread_near_the_limit_in_place() {
        let p = DynamicParams::default();
        // 22 % on main: above load_limit but inside the band: still idle.
        let plan = balance(&p, 0, &cores(2), &[t(0, 22.0)]);
        assert_eq!(plan.targets, vec![0]);
        // 18 % away from main: inside the band, stays busy (and main,
        // at 70 %, has no room to consolidate it).
        let away = t(1, 18.0);
        let plan = balance(&p, 0, &cores(2), &[away, t(0, 70.0)]);
        assert_eq!(plan.targets[0], 1);
    }

    #[test]
    fn validate_rejects_nonsense() {
        let ok = DynamicParams::default();
        assert!(ok.validate().is_ok());
        for bad in [
            DynamicParams {
                load_limit: 90,
                ..ok
            },
            DynamicParams {
                core_limit: 0,
                ..ok
            },
            DynamicParams {
                core_busy: 50,
                ..ok
            },
            DynamicParams {
                core_busy: 101,
                ..ok
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    fn params() -> impl Strategy<Value = DynamicParams> {
        (0u8..=40, 50u8..=95).prop_flat_map(|(ll, cl)| {
            (Just(ll), Just(cl), cl..=100).prop_map(|(load_limit, core_limit, core_busy)| {
                DynamicParams {
                    load_limit,
                    core_limit,
                    core_busy,
                }
            })
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// No reactor projected over core_limit when first fit provably
        /// avoids it (module doc), whatever the starting placement: every
        /// thread within half the limit and the total within half of all
        /// reactors' limits, or no more threads than reactors.
        #[test]
        fn no_avoidable_overload(
            p in params(),
            n in 2usize..=256,
            raw in prop::collection::vec((0usize..256, 0.0f64..1.0), 0..2000),
            small in any::<bool>(),
        ) {
            let limit = f64::from(p.core_limit);
            let mut threads: Vec<_> = if small {
                raw.iter().map(|&(r, f)| t(r % n, f * limit / 2.0)).collect()
            } else {
                raw.iter().take(n).map(|&(r, f)| t(r % n, f * limit)).collect()
            };
            let total: f64 = threads.iter().map(|t| t.load).sum();
            let room = n as f64 * limit / 2.0;
            if small && total > room {
                for th in &mut threads {
                    th.load *= room / total;
                }
            }
            let plan = balance(&p, 0, &cores(n), &threads);
            for (c, &l) in plan.projected.iter().enumerate() {
                prop_assert!(l <= limit + 1e-6, "reactor {} projected {} > {}", c, l, limit);
            }
            // Projections are the sum of the loads placed.
            let mut sum = vec![0.0; n];
            for (th, &to) in threads.iter().zip(&plan.targets) {
                sum[to] += th.load;
            }
            for (s, p) in sum.iter().zip(&plan.projected) {
                prop_assert!((s - p).abs() < 1e-6);
            }
        }

        /// An idle system ends with every thread on main.
        #[test]
        fn idle_system_packs_onto_main(
            p in params(),
            n in 2usize..=256,
            placement in prop::collection::vec(0usize..256, 1..10_000),
        ) {
            let threads: Vec<_> = placement.iter().map(|&r| t(r % n, 0.0)).collect();
            let plan = balance(&p, 0, &cores(n), &threads);
            prop_assert!(plan.targets.iter().all(|&r| r == 0));
            let empty = plan.empty_reactors();
            prop_assert!(!empty[0] && empty[1..].iter().all(|&e| e));
        }

        /// Under steady load no thread goes back and forth (A → B → A in
        /// consecutive periods), and a placement is reached and kept
        /// (consolidation moves a thread at most every cooldown and one may
        /// make room for the next, so allow time: the last 5 of 40
        /// periods are the same).
        #[test]
        fn steady_load_settles_without_ping_pong(
            p in params(),
            n in 2usize..=64,
            raw in prop::collection::vec((0usize..64, 0.0f64..100.0), 1..300),
        ) {
            let threads: Vec<_> = raw.iter().map(|&(r, l)| t(r % n, l)).collect();
            let mut h = vec![threads.iter().map(|t| t.reactor).collect::<Vec<_>>()];
            h.extend(run(&p, n, threads, 40));
            for w in h.windows(3) {
                for (i, ((a, b), c)) in w[0].iter().zip(&w[1]).zip(&w[2]).enumerate() {
                    prop_assert!(!(a != b && c == a), "thread {} went {} -> {} -> {}", i, a, b, c);
                }
            }
            for w in h[h.len() - 5..].windows(2) {
                prop_assert_eq!(&w[0], &w[1]);
            }
        }

        /// A step of load (all idle, then some threads busy) spreads
        /// within 2 periods: after them, no reactor is over the limit
        /// when one thread per reactor would do.
        #[test]
        fn load_step_spreads_within_two_periods(
            p in params(),
            (n, busy) in (2usize..=64).prop_flat_map(|n| {
                (Just(n), prop::collection::vec(0.0f64..1.0, 1..n))
            }),
            idle in 1usize..500,
        ) {
            let limit = f64::from(p.core_limit);
            let mut threads: Vec<_> = (0..idle).map(|_| t(0, 0.0)).collect();
            threads.extend(busy.iter().map(|&f| t(0, f64::from(p.load_limit) + f * (limit - f64::from(p.load_limit)))));
            // Idle load is 0, so the n-1 busy threads and the idle ones fit.
            let h = run(&p, n, threads.clone(), 2);
            let mut proj = vec![0.0; n];
            for (th, &r) in threads.iter().zip(&h[1]) {
                proj[r] += th.load;
            }
            for l in proj {
                prop_assert!(l <= limit + 1e-9);
            }
        }
    }
}
