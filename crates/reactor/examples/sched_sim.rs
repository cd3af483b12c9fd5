//! The dynamic scheduler's decision, simulated at a scale this machine
//! cannot run: 64 reactors, 1,000 threads, three synthetic load traces.
//! Prints, per trace, the cores kept awake (reactors holding a thread)
//! under `static` (threads stay where round-robin placement put them) and
//! under `dynamic`, the reactors over `core_limit`, and the moves per
//! period.
//!
//! ```text
//! cargo run --release -p lull-reactor --example sched_sim
//! ```
//!
//! Each thread has a base load; every period its measured load is the base
//! ±20 % (uniform), as on a real node where load wobbles. 40 periods; the
//! figures are over the last 30 (after the first placement settles).

use lull_reactor::scheduler::{balance, CoreLoad, DynamicParams, ThreadLoad};

const REACTORS: usize = 64;
const THREADS: usize = 1_000;
const PERIODS: usize = 40;
const WARMUP: usize = 10;

/// xorshift64*: enough randomness for a synthetic trace, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next()
    }
}

struct Outcome {
    awake: Vec<usize>,
    over: Vec<usize>,
    moves: Vec<usize>,
}

fn median(mut v: Vec<usize>) -> usize {
    v.sort_unstable();
    v[v.len() / 2]
}

fn simulate(bases: &[f64], dynamic: bool, seed: u64) -> Outcome {
    let p = DynamicParams::default();
    let mut rng = Rng(seed);
    let mut threads: Vec<ThreadLoad> = (0..bases.len())
        .map(|i| ThreadLoad {
            reactor: i % REACTORS,
            load: 0.0,
            pinned: false,
            periods_since_move: u32::MAX,
        })
        .collect();
    let mut out = Outcome {
        awake: Vec::new(),
        over: Vec::new(),
        moves: Vec::new(),
    };
    for period in 0..PERIODS {
        for (t, &b) in threads.iter_mut().zip(bases) {
            t.load = b * rng.range(0.8, 1.2);
        }
        let mut busy = vec![0.0f64; REACTORS];
        for t in &threads {
            busy[t.reactor] += t.load;
        }
        let mut moves = 0;
        if dynamic {
            let cores: Vec<CoreLoad> = busy
                .iter()
                .map(|&b| CoreLoad { busy: b.min(100.0) })
                .collect();
            let plan = balance(&p, 0, &cores, &threads);
            for (t, &to) in threads.iter_mut().zip(&plan.targets) {
                if t.reactor != to {
                    t.reactor = to;
                    t.periods_since_move = 0;
                    moves += 1;
                } else {
                    t.periods_since_move = t.periods_since_move.saturating_add(1);
                }
            }
        }
        if period >= WARMUP {
            let mut load = vec![0.0f64; REACTORS];
            let mut held = [false; REACTORS];
            for t in &threads {
                load[t.reactor] += t.load;
                held[t.reactor] = true;
            }
            out.awake.push(held.iter().filter(|&&h| h).count());
            out.over.push(
                load.iter()
                    .filter(|&&l| l > f64::from(p.core_limit))
                    .count(),
            );
            out.moves.push(moves);
        }
    }
    out
}

fn main() {
    let mut rng = Rng(0x6c75_6c6c);
    let traces: [(&str, Vec<f64>); 3] = [
        // Idle volumes: every thread under 1 % of a core (~5 cores in all).
        ("low", (0..THREADS).map(|_| rng.range(0.0, 1.0)).collect()),
        // Most idle, one in twenty busy (20-60 %): ~25 cores.
        (
            "mixed",
            (0..THREADS)
                .map(|i| {
                    if i % 20 == 0 {
                        rng.range(20.0, 60.0)
                    } else {
                        rng.range(0.0, 1.0)
                    }
                })
                .collect(),
        ),
        // A busy node: every thread 2-7 % (~45 cores, of 51 under core_limit).
        ("high", (0..THREADS).map(|_| rng.range(2.0, 7.0)).collect()),
    ];
    println!("{REACTORS} reactors, {THREADS} threads, periods {WARMUP}..{PERIODS}; medians (max)");
    println!("| trace | total load (cores) | static: awake / over limit | dynamic: awake / over limit | dynamic moves per period |");
    println!("|---|---|---|---|---|");
    for (name, bases) in &traces {
        let total: f64 = bases.iter().sum::<f64>() / 100.0;
        let s = simulate(bases, false, 7);
        let d = simulate(bases, true, 7);
        println!(
            "| {name} | {total:.1} | {} / {} ({}) | {} / {} ({}) | {} ({}) |",
            median(s.awake.clone()),
            median(s.over.clone()),
            s.over.iter().max().unwrap(),
            median(d.awake.clone()),
            median(d.over.clone()),
            d.over.iter().max().unwrap(),
            median(d.moves.clone()),
            d.moves.iter().max().unwrap(),
        );
    }
}
