//! Reactor micro-benchmarks (`cargo bench -p lull-reactor`): cross-reactor
//! message round trip in poll and interrupt mode, and the cost of an empty
//! poll-mode iteration. Prints medians of several runs; no assertions.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use lull_reactor::{sys, Framework, FrameworkConfig, Mode, ThreadHandle};

const RUNS: usize = 5;

fn cores() -> (Vec<usize>, bool) {
    let allowed = sys::allowed_cpus().expect("affinity");
    if allowed.len() >= 2 {
        (vec![allowed[0], allowed[1]], true)
    } else {
        (vec![0, 1], false)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn round_trip_ns(mode: Mode, rounds: u64) -> f64 {
    let (cores, pin) = cores();
    let fw = Framework::start(FrameworkConfig {
        pin,
        ..FrameworkConfig::new(cores, mode)
    })
    .unwrap();
    let h = fw.handle().clone();
    let a = h.spawn_thread(0, "a", |_| {}).unwrap();
    let b = h.spawn_thread(1, "b", |_| {}).unwrap();
    fn ping(a: ThreadHandle, b: ThreadHandle, left: u64, done: mpsc::Sender<Instant>) {
        let a2 = a.clone();
        a.send(move |_| {
            if left == 0 {
                let _ = done.send(Instant::now());
                return;
            }
            let b2 = b.clone();
            b.send(move |_| ping(a2, b2, left - 1, done)).unwrap();
        })
        .unwrap();
    }
    // Warm up, then measure.
    let (tx, rx) = mpsc::channel();
    ping(a.clone(), b.clone(), 1000, tx);
    rx.recv_timeout(Duration::from_secs(30)).unwrap();
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    ping(a, b, rounds, tx);
    let end = rx.recv_timeout(Duration::from_secs(120)).unwrap();
    (end - start).as_nanos() as f64 / rounds as f64
}

fn empty_iteration_ns() -> f64 {
    let (cores, pin) = cores();
    let fw = Framework::start(FrameworkConfig {
        pin,
        ..FrameworkConfig::new(vec![cores[1]], Mode::Poll)
    })
    .unwrap();
    let h = fw.handle().clone();
    h.spawn_thread(0, "empty", |_| {}).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let s0 = h.reactor_stats()[0].clone();
    std::thread::sleep(Duration::from_millis(500));
    let s1 = h.reactor_stats()[0].clone();
    let ns = (s1.busy_ns + s1.idle_ns - s0.busy_ns - s0.idle_ns) as f64;
    ns / (s1.iterations - s0.iterations) as f64
}

fn main() {
    let modes = [Mode::Poll, Mode::Interrupt, Mode::Adaptive];
    let mut rt: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut empty = Vec::new();
    // Interleaved, so drift of the shared machine hits every variant alike.
    for _ in 0..RUNS {
        for (i, &mode) in modes.iter().enumerate() {
            let rounds = if mode == Mode::Interrupt {
                20_000
            } else {
                100_000
            };
            rt[i].push(round_trip_ns(mode, rounds));
        }
        empty.push(empty_iteration_ns());
    }
    let medians: Vec<f64> = rt.into_iter().map(median).collect();
    for (mode, m) in modes.iter().zip(&medians) {
        println!(
            "cross-reactor message round trip, {:<9} mode: {:>8.0} ns (median of {RUNS}; {:.2}x poll)",
            mode.as_str(),
            m,
            m / medians[0]
        );
    }
    println!(
        "empty poll-mode iteration (1 thread, 0 pollers):   {:>8.1} ns (median of {RUNS})",
        median(empty)
    );
}
