//! The adaptive policy (`lull_reactor::adaptive`) in a simulated reactor:
//! a stream of work arrives, the reactor spins for the window the policy
//! chooses or sleeps and wakes a wake-up later, serves what has arrived,
//! and goes idle again. Each steady case runs from 100 seeds (a seed draws
//! the start-up wake-cost measurement ±15% around the machine's, as
//! measured from one start to the next here, each wake-up's latency
//! ±10%, and the stream's jitter or where a recorded stream starts) and
//! must make one decision: the same regime at the end from every seed,
//! reached with at most one switch. A step of load (25 seeds each) must
//! switch exactly once more.
//!
//! Streams: fio 4 KiB randread QD4 at 5,000, 20,000 and 50,000 IOPS as
//! recorded against a poll-mode reactor on the development VM
//! (`tests/data/fio-randread-qd4-*.txt`: time between the works found and
//! each work's busy time), replayed open-loop; synthetic paced streams at
//! the same rates; and ping-pong clients (the next request a think time
//! after each reply, so a sleep delays the client too). Machines: this VM
//! (wake-ups 19 µs of latency and 9 µs of CPU, as measured by the
//! reactor) and a fast one (4 µs and 2 µs).
//!
//! ```text
//! cargo test -p lull-reactor --test adaptive_sim
//! ```

use lull_reactor::adaptive::{Adaptive, Regime, WakeCost};

const SEEDS: u64 = 100;

/// Steps are run from fewer seeds: each is a run of seconds at up to
/// 200,000 events a second (a debug build runs the file in ~20 s).
const STEP_SEEDS: u64 = 25;
const SECOND: u64 = 1_000_000_000;

/// This VM: a wake-up as the reactor measures it here.
const SLOW: WakeCost = WakeCost {
    latency_ns: 19_000,
    cpu_ns: 9_000,
};
/// A machine with fast wake-ups (bare metal, no deep C-states).
const FAST: WakeCost = WakeCost {
    latency_ns: 4_000,
    cpu_ns: 2_000,
};

/// splitmix64: a seeded stream of numbers, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// `x` scaled by a uniform factor in [1 - spread, 1 + spread].
    fn jitter(&mut self, x: u64, spread: f64) -> u64 {
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (x as f64 * (1.0 + spread * (2.0 * u - 1.0))) as u64
    }
}

/// An open-loop stream: the time since the last work and this one's busy
/// time, drawn from the seed's numbers.
type Stream = Box<dyn FnMut(&mut Rng) -> (u64, u64)>;

/// Where the next work comes from.
enum Client {
    /// Open loop: works at times of their own, whatever the reactor does.
    Open(Stream),
    /// Closed loop: the next request `think_ns` after the last reply,
    /// `busy_ns` to serve.
    PingPong { think_ns: u64, busy_ns: u64 },
}

/// What a run did.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    regime: Regime,
    switches: u64,
}

/// Run `phases` (a client for a while each) on a reactor whose wake-ups
/// really cost `machine`, from `seed`. Returns the outcome at the end of
/// each phase.
fn simulate(machine: WakeCost, seed: u64, phases: Vec<(Client, u64)>) -> Vec<Outcome> {
    let mut rng = Rng(seed);
    // The start-up measurement, off by up to ±15%.
    let measured = WakeCost {
        latency_ns: rng.jitter(machine.latency_ns, 0.15),
        cpu_ns: rng.jitter(machine.cpu_ns, 0.15),
    };
    let mut a = Adaptive::new(measured);
    let mut now = 1_000_000u64;
    let mut outcomes = Vec::new();
    let mut end = now;
    for (mut client, length) in phases {
        end += length;
        // Open loop: the next work's arrival and busy time.
        let mut next: Option<(u64, u64)> = None;
        while now < end {
            let window = a.went_idle(now);
            let (arrival, busy) = match &mut client {
                Client::Open(gen) => *next.get_or_insert_with(|| {
                    let (gap, busy) = gen(&mut rng);
                    (now.max(end - length) + gap, busy)
                }),
                Client::PingPong { think_ns, busy_ns } => {
                    (now + rng.jitter(*think_ns, 0.1), rng.jitter(*busy_ns, 0.1))
                }
            };
            let arrival = arrival.max(now);
            if arrival - now <= window {
                now = arrival;
                a.found_work(now, false);
            } else {
                now = arrival + rng.jitter(machine.latency_ns, 0.1);
                a.found_work(now, true);
            }
            // Serve it, and in open loop whatever arrived meanwhile.
            now += busy;
            if let Client::Open(gen) = &mut client {
                let mut last = arrival;
                loop {
                    let (gap, busy) = gen(&mut rng);
                    last += gap;
                    if last > now {
                        next = Some((last, busy));
                        break;
                    }
                    now += busy;
                }
            }
            if now % 4096 < 64 {
                a.check_invariants();
            }
        }
        a.check_invariants();
        let s = a.status();
        outcomes.push(Outcome {
            regime: s.regime,
            switches: s.switches,
        });
    }
    outcomes
}

/// A recorded stream, replayed from a seeded point, round and round.
fn recorded(rate: u32) -> Client {
    let path = format!(
        "{}/tests/data/fio-randread-qd4-{rate}.txt",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let works: Vec<(u64, u64)> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let mut f = l
                .split_whitespace()
                .map(|x| x.parse::<u64>().expect(l) * 100);
            (f.next().expect(l), f.next().expect(l))
        })
        .collect();
    assert!(works.len() >= 1_000, "{path}: {} works", works.len());
    let mut at: Option<usize> = None;
    Client::Open(Box::new(move |rng| {
        let i = at.get_or_insert_with(|| (rng.next() % works.len() as u64) as usize);
        *i = (*i + 1) % works.len();
        works[*i]
    }))
}

/// A paced stream: one request every `1/rate`, ±20%, each `busy_ns` ±10%.
fn paced(rate: u64, busy_ns: u64) -> Client {
    let period = SECOND / rate;
    Client::Open(Box::new(move |rng| {
        (rng.jitter(period, 0.2), rng.jitter(busy_ns, 0.1))
    }))
}

/// Run a case from every seed; all must end in the same regime with at
/// most `max_switches` switches. Returns that regime.
fn one_decision(
    what: &str,
    machine: WakeCost,
    client: impl Fn() -> Client,
    length: u64,
    max_switches: u64,
) -> Regime {
    let outcomes: Vec<Outcome> = (0..SEEDS)
        .map(|seed| simulate(machine, seed, vec![(client(), length)]).remove(0))
        .collect();
    let first = outcomes[0].regime;
    for (seed, o) in outcomes.iter().enumerate() {
        assert_eq!(
            o.regime, first,
            "{what}: seed {seed} ended in {o:?}, seed 0 in {first:?}"
        );
        assert!(
            o.switches <= max_switches,
            "{what}: seed {seed} switched {} times",
            o.switches
        );
    }
    first
}

/// Steady streams run this long: the first decision comes within
/// milliseconds (a probe after `MIN_SAMPLES` idle periods and its
/// confirmation), and the periodic probe a second later checks it.
const STEADY: u64 = 1_300_000_000;

/// How often each regime ended a case, from every seed, and the most
/// switches any seed made.
fn tally(machine: WakeCost, client: impl Fn() -> Client, length: u64) -> (u64, u64) {
    let mut spin = 0;
    let mut most = 0;
    for seed in 0..SEEDS {
        let o = simulate(machine, seed, vec![(client(), length)]).remove(0);
        spin += u64::from(o.regime == Regime::Spin);
        most = most.max(o.switches);
    }
    (spin, most)
}

#[test]
fn recorded_fio_streams_make_one_decision_per_stream_and_machine() {
    // Open loop. Medians: idle 190, 41 and 24 µs, busy 9, 9 and 16 µs
    // (at 50,000 IOPS fio's requests come in pairs) against a wake-up of
    // 28 µs here and 6 µs on the fast machine.
    for (rate, machine, want) in [
        (5_000, SLOW, Regime::Sleep),
        (20_000, SLOW, Regime::Sleep),
        (5_000, FAST, Regime::Sleep),
        (20_000, FAST, Regime::Sleep),
        (50_000, FAST, Regime::Sleep),
    ] {
        let what = format!("recorded {rate} IOPS, {machine:?}");
        assert_eq!(
            one_decision(&what, machine, || recorded(rate), STEADY, 1),
            want,
            "{what}"
        );
    }
}

#[test]
fn recorded_50k_on_this_vm_is_near_the_boundary_and_decides_once() {
    // Spinning costs ~1.3x the work, sleeping ~1.5x: the ratio, 0.87, is
    // within the start-up measurement's ±15% of the 0.75 that switches,
    // so which regime a start gets depends on that measurement (19 of 100
    // seeds spin). What holds from every seed: one decision, no flapping.
    let (spin, most) = tally(SLOW, || recorded(50_000), STEADY);
    assert!(most <= 1, "a seed switched {most} times");
    assert!(
        (1..SEEDS).contains(&spin),
        "{spin} of {SEEDS} seeds spin: not near the boundary?"
    );
}

#[test]
fn synthetic_paced_streams_make_one_decision_per_stream_and_machine() {
    // 9 µs of work per request, as recorded. At 50,000 IOPS this VM's
    // 19 µs wake-up makes every sleep delay two requests: spin.
    for (rate, slow, fast) in [
        (5_000, Regime::Sleep, Regime::Sleep),
        (20_000, Regime::Sleep, Regime::Sleep),
        (50_000, Regime::Spin, Regime::Sleep),
    ] {
        for (machine, want) in [(SLOW, slow), (FAST, fast)] {
            let what = format!("paced {rate} IOPS, {machine:?}");
            let got = one_decision(&what, machine, || paced(rate, 9_000), STEADY, 1);
            assert_eq!(got, want, "{what}");
        }
    }
}

#[test]
fn ping_pong_clients_spin_when_their_think_time_is_below_x() {
    // Every reply waits for the next request's wake-up: spinning pays when
    // the think time is below 3/4 of a wake-up (21 µs here, 4.5 µs on the
    // fast machine), sleeping above 4/3 (37 µs, 8 µs).
    for (think_ns, slow, fast) in [
        (3_000, Regime::Spin, Regime::Spin),
        (10_000, Regime::Spin, Regime::Sleep),
        (60_000, Regime::Sleep, Regime::Sleep),
    ] {
        for (machine, want) in [(SLOW, slow), (FAST, fast)] {
            let client = || Client::PingPong {
                think_ns,
                busy_ns: 9_000,
            };
            let what = format!("ping-pong, think {think_ns} ns, {machine:?}");
            assert_eq!(
                one_decision(&what, machine, client, STEADY, 1),
                want,
                "{what}"
            );
        }
    }
}

#[test]
fn a_step_of_load_switches_once() {
    let slow = || Client::PingPong {
        think_ns: 200_000,
        busy_ns: 9_000,
    };
    let fast = || Client::PingPong {
        think_ns: 1_000,
        busy_ns: 9_000,
    };
    let outcome = |regime, switches| Outcome { regime, switches };
    for machine in [SLOW, FAST] {
        for seed in 0..STEP_SEEDS {
            let up = simulate(machine, seed, vec![(slow(), STEADY), (fast(), STEADY)]);
            let want = vec![outcome(Regime::Sleep, 0), outcome(Regime::Spin, 1)];
            assert_eq!(up, want, "step up, {machine:?}, seed {seed}");
            let down = simulate(machine, seed, vec![(fast(), STEADY), (slow(), STEADY)]);
            let want = vec![outcome(Regime::Spin, 1), outcome(Regime::Sleep, 2)];
            assert_eq!(down, want, "step down, {machine:?}, seed {seed}");
        }
    }
}

#[test]
fn an_open_stream_stepping_from_5k_to_75_percent_busy_switches_once() {
    // One request every 5 µs ± 20%, 3.75 µs of work each: a sleep delays
    // the whole backlog its wake-up finds, so spinning pays even where
    // each wake-up finds many requests. (The 5,000 IOPS phase is short:
    // its first probe comes after 13 ms, the next one in the second
    // phase.)
    for machine in [SLOW, FAST] {
        for seed in 0..STEP_SEEDS {
            let got = simulate(
                machine,
                seed,
                vec![
                    (paced(5_000, 9_000), STEADY / 4),
                    (paced(200_000, 3_750), STEADY),
                ],
            );
            assert_eq!(got[0].regime, Regime::Sleep, "{machine:?}, seed {seed}");
            let want = Outcome {
                regime: Regime::Spin,
                switches: 1,
            };
            assert_eq!(got[1], want, "{machine:?}, seed {seed}");
        }
    }
}
