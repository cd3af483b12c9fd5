//! The framework on real OS threads. Functional checks only: nothing here
//! asserts a speed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use lull_reactor::{
    sys, Framework, FrameworkConfig, Interest, Mode, PollStatus, PollerKind, ReactorError, Thread,
    ThreadHandle,
};

fn cores(n: usize) -> Vec<usize> {
    let allowed = sys::allowed_cpus().expect("affinity");
    // On a 1-core runner, run both reactors unpinned on the same core.
    (0..n).map(|i| allowed[i % allowed.len()]).collect()
}

fn framework(n: usize, mode: Mode) -> Framework {
    Framework::start(config(n, mode)).expect("framework")
}

/// `n` reactors, pinned when the machine has `n` cores to pin them to.
fn config(n: usize, mode: Mode) -> FrameworkConfig {
    let cores = cores(n);
    let pin = cores.iter().collect::<std::collections::HashSet<_>>().len() == n;
    let cores = if pin { cores } else { (0..n).collect() };
    FrameworkConfig {
        pin,
        ..FrameworkConfig::new(cores, mode)
    }
}

/// CPU time (utime + stime) of one OS thread of this process, in ms.
fn thread_cpu_ms(tid: u64) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).expect("stat");
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of stat; index 11 and 12 after the comm.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks * 10 // USER_HZ is 100 on Linux.
}

fn ping_pong(mode: Mode, rounds: u64) {
    let fw = framework(2, mode);
    let h = fw.handle().clone();
    let a = h.spawn_thread(0, "ping", |_| {}).unwrap();
    let b = h.spawn_thread(1, "pong", |_| {}).unwrap();
    let (done_tx, done_rx) = mpsc::channel();

    fn ping(a: ThreadHandle, b: ThreadHandle, left: u64, done: mpsc::Sender<u64>) {
        let a2 = a.clone();
        a.send(move |t: &mut Thread| {
            assert_eq!(t.name(), "ping");
            if left == 0 {
                done.send(t.id()).unwrap();
                return;
            }
            let b2 = b.clone();
            b.send(move |t: &mut Thread| {
                assert_eq!(t.name(), "pong");
                ping(a2, b2, left - 1, done);
            })
            .unwrap();
        })
        .unwrap();
    }
    ping(a.clone(), b, rounds, done_tx);
    let id = done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("ping-pong finished");
    assert_eq!(id, a.id());
    let stats = h.thread_stats();
    assert!(stats.iter().all(|s| s.messages >= rounds), "{stats:?}");
}

#[test]
fn ping_pong_in_poll_mode() {
    ping_pong(Mode::Poll, 10_000);
}

#[test]
fn ping_pong_in_interrupt_mode() {
    ping_pong(Mode::Interrupt, 10_000);
}

#[test]
fn ping_pong_in_hybrid_mode() {
    ping_pong(Mode::Hybrid, 10_000);
}

#[test]
fn ping_pong_in_adaptive_mode() {
    ping_pong(Mode::Adaptive, 10_000);
}

#[test]
fn idle_interrupt_reactor_sleeps() {
    idle_reactor_sleeps(Mode::Interrupt);
}

#[test]
fn idle_adaptive_reactor_sleeps() {
    idle_reactor_sleeps(Mode::Adaptive);
}

#[test]
fn idle_hybrid_reactor_sleeps() {
    idle_reactor_sleeps(Mode::Hybrid);
}

fn idle_reactor_sleeps(mode: Mode) {
    let fw = framework(1, mode);
    let h = fw.handle().clone();
    // A thread with an fd-backed poller and a slow timed poller: nothing to do.
    let efd = Arc::new(sys::EventFd::new().unwrap());
    let e = efd.clone();
    h.spawn_thread(0, "idle", move |t| {
        use std::os::fd::AsRawFd;
        let fd = e.as_raw_fd();
        t.register_poller(
            "rx",
            PollerKind::Active,
            &[(fd, Interest::READABLE)],
            Box::new(move |_, _| {
                if e.drain() {
                    PollStatus::Busy
                } else {
                    PollStatus::Idle
                }
            }),
        )
        .unwrap();
        t.register_poller(
            "slow",
            PollerKind::every_us(500_000),
            &[],
            Box::new(|_, _| PollStatus::Idle),
        )
        .unwrap();
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let tid = h.reactor_stats()[0].tid;
    let before = thread_cpu_ms(tid);
    std::thread::sleep(Duration::from_secs(2));
    let after = thread_cpu_ms(tid);
    assert!(
        after - before < 20,
        "idle {mode}-mode reactor used {} ms of CPU in 2 s",
        after - before
    );
    let r = &h.reactor_stats()[0];
    assert!(r.wakeups >= 3, "the timed poller woke it: {r:?}");
    assert!(r.interrupt_mode_enabled());
    assert_eq!(r.mode, mode);
}

#[test]
fn timed_poller_fires_on_interrupt_reactor() {
    let fw = framework(1, Mode::Interrupt);
    let runs = Arc::new(AtomicU64::new(0));
    let r = runs.clone();
    fw.handle()
        .spawn_thread(0, "timer", move |t| {
            t.register_poller(
                "tick",
                PollerKind::every_us(10_000),
                &[],
                Box::new(move |_, _| {
                    r.fetch_add(1, Ordering::Relaxed);
                    PollStatus::Busy
                }),
            )
            .unwrap();
        })
        .unwrap();
    let start = Instant::now();
    while runs.load(Ordering::Relaxed) < 10 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed poller did not fire"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn fd_less_active_poller_is_refused_in_interrupt_mode() {
    let mut fw = framework(1, Mode::Interrupt);
    let (tx, rx) = mpsc::channel();
    fw.handle()
        .spawn_thread(0, "bad", move |t| {
            let r = t.register_poller(
                "spin",
                PollerKind::Active,
                &[],
                Box::new(|_, _| PollStatus::Idle),
            );
            tx.send(matches!(r, Err(ReactorError::NoEventSource(_))))
                .unwrap();
        })
        .unwrap();
    assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());

    // And a reactor whose thread has such a poller cannot switch to interrupt.
    let h = fw.handle().clone();
    h.set_mode(0, Mode::Poll).unwrap();
    let (tx, rx) = mpsc::channel();
    h.spawn_thread(0, "spinner", move |t| {
        t.register_poller(
            "spin",
            PollerKind::Active,
            &[],
            Box::new(|_, _| PollStatus::Idle),
        )
        .unwrap();
        tx.send(()).unwrap();
    })
    .unwrap();
    rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(matches!(
        h.set_mode(0, Mode::Interrupt),
        Err(ReactorError::NoEventSource(_))
    ));
    assert_eq!(h.reactor_stats()[0].mode, Mode::Poll);
    fw.stop();
}

#[test]
fn mode_switching_under_a_message_storm_loses_nothing() {
    const MESSAGES: u64 = 100_000;
    let fw = framework(2, Mode::Interrupt);
    let h = fw.handle().clone();
    let count = Arc::new(AtomicU64::new(0));
    let target = h.spawn_thread(1, "sink", |_| {}).unwrap();
    let sender = {
        let count = count.clone();
        let target = target.clone();
        std::thread::spawn(move || {
            for i in 0..MESSAGES {
                let c = count.clone();
                let mut msg: lull_reactor::Message = Box::new(move |_t| {
                    // Messages from one sender arrive in order.
                    assert_eq!(c.fetch_add(1, Ordering::SeqCst), i);
                });
                loop {
                    match target.try_send_boxed(msg) {
                        Ok(()) => break,
                        Err((back, _full)) => {
                            msg = back;
                            std::thread::yield_now();
                        }
                    }
                }
            }
        })
    };
    let start = Instant::now();
    let mut mode = 0;
    while count.load(Ordering::SeqCst) < MESSAGES {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "stuck at {}",
            count.load(Ordering::SeqCst)
        );
        h.set_mode(1, Mode::ALL[mode]).unwrap();
        mode = (mode + 1) % Mode::ALL.len();
        std::thread::sleep(Duration::from_millis(1));
    }
    sender.join().unwrap();
    assert_eq!(count.load(Ordering::SeqCst), MESSAGES);
}

#[test]
fn stop_runs_queued_messages_and_destroys_threads() {
    let mut fw = framework(1, Mode::Interrupt);
    let h = fw.handle().clone();
    let ran = Arc::new(AtomicU64::new(0));
    let t = h.spawn_thread(0, "worker", |_| {}).unwrap();
    for _ in 0..1000 {
        let r = ran.clone();
        t.send(move |_| {
            r.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap();
    }
    fw.stop();
    assert_eq!(ran.load(Ordering::Relaxed), 1000);
    assert!(t.has_exited());
    assert!(t.send(|_| {}).is_err());
    assert!(h.thread_stats().is_empty());
}

/// Poll until `cond` holds or `secs` pass.
fn wait_for(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// The dynamic scheduler in poll mode: idle threads gather on the main
/// reactor and the other sleeps; a busy thread then moves off the main
/// reactor; messages sent to the threads throughout all run, in order.
#[test]
fn dynamic_scheduler_packs_idle_threads_and_spreads_a_busy_one() {
    use lull_reactor::scheduler::{DynamicParams, Policy};
    use lull_reactor::SchedulerConfig;
    let fw = framework(2, Mode::Poll);
    let h = fw.handle().clone();
    let idle: Vec<ThreadHandle> = (0..4)
        .map(|i| h.spawn_thread(i % 2, &format!("idle{i}"), |_| {}).unwrap())
        .collect();
    // The busy thread: a poller that works ~50 µs per call while `on`.
    let on = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let o = on.clone();
    let busy = h
        .spawn_thread(1, "busy", move |t| {
            t.register_poller(
                "work",
                PollerKind::Active,
                &[],
                Box::new(move |_, _| {
                    if !o.load(Ordering::Relaxed) {
                        return PollStatus::Idle;
                    }
                    let end = Instant::now() + Duration::from_micros(50);
                    while Instant::now() < end {
                        std::hint::spin_loop();
                    }
                    PollStatus::Busy
                }),
            )
            .unwrap();
        })
        .unwrap();
    h.set_scheduler(SchedulerConfig {
        policy: Policy::Dynamic(DynamicParams::default()),
        period_us: 50_000,
    })
    .unwrap();
    // Messages keep flowing to every thread while they move.
    let sent = Arc::new(AtomicU64::new(0));
    let ran = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sender = {
        let targets: Vec<ThreadHandle> = idle.iter().cloned().chain([busy.clone()]).collect();
        let (sent, ran, stop) = (sent.clone(), ran.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut next = vec![0u64; targets.len()];
            let seen = Arc::new(std::sync::Mutex::new(vec![0u64; targets.len()]));
            while !stop.load(Ordering::Relaxed) {
                for (i, t) in targets.iter().enumerate() {
                    let (ran, seen, n) = (ran.clone(), seen.clone(), next[i]);
                    if t.send(move |_| {
                        let mut s = seen.lock().unwrap();
                        assert_eq!(s[i], n, "messages to one thread run in order");
                        s[i] += 1;
                        ran.fetch_add(1, Ordering::Relaxed);
                    })
                    .is_ok()
                    {
                        next[i] += 1;
                        sent.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    let on_reactor = |name: &str| {
        h.thread_stats()
            .into_iter()
            .find(|s| s.name == name)
            .map(|s| s.reactor)
    };
    assert!(
        wait_for(10, || {
            let r = h.reactor_stats();
            r[1].sleeping && h.thread_stats().iter().all(|s| s.reactor == 0)
        }),
        "idle threads gather on reactor 0 and reactor 1 sleeps: {:?} {:?}",
        h.thread_stats(),
        h.reactor_stats()
    );
    on.store(true, Ordering::Relaxed);
    assert!(
        wait_for(10, || on_reactor("busy") == Some(1)),
        "the busy thread leaves the main reactor: {:?}",
        h.thread_stats()
    );
    assert!(!h.reactor_stats()[1].sleeping);
    // Idle threads stay on main.
    for i in 0..4 {
        assert_eq!(on_reactor(&format!("idle{i}")), Some(0));
    }
    on.store(false, Ordering::Relaxed);
    assert!(
        wait_for(10, || on_reactor("busy") == Some(0)
            && h.reactor_stats()[1].sleeping),
        "idle again, it comes back and reactor 1 sleeps: {:?}",
        h.thread_stats()
    );
    stop.store(true, Ordering::Relaxed);
    sender.join().unwrap();
    assert!(
        wait_for(10, || ran.load(Ordering::Relaxed)
            == sent.load(Ordering::Relaxed)),
        "every message ran: sent {} ran {}",
        sent.load(Ordering::Relaxed),
        ran.load(Ordering::Relaxed)
    );
    let info = h.scheduler_info();
    assert!(info.moves >= 4, "{info:?}");
    assert!(h.reactor_stats()[0].threads_moved_in >= 3);
}

#[test]
fn set_scheduler_rejects_bad_settings() {
    use lull_reactor::scheduler::{DynamicParams, Policy};
    use lull_reactor::SchedulerConfig;
    let fw = framework(1, Mode::Interrupt);
    let h = fw.handle();
    let bad_period = SchedulerConfig {
        policy: Policy::Static,
        period_us: 1,
    };
    assert!(h.set_scheduler(bad_period).is_err());
    let bad_limits = SchedulerConfig {
        policy: Policy::Dynamic(DynamicParams {
            load_limit: 90,
            core_limit: 80,
            core_busy: 95,
        }),
        period_us: 1_000_000,
    };
    assert!(h.set_scheduler(bad_limits).is_err());
    assert_eq!(h.scheduler_info().config.policy, Policy::Static);
    assert!(!h.scheduler_info().governor.is_empty() || h.scheduler_info().rounds == 0);
}

/// Reactor threads that ran the start hook, by index bit.
static HOOKED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set by the start hook: this OS thread is a reactor.
    static ON_REACTOR: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The io_uring_enter count the test's source reports on a reactor.
const FAKE_ENTERS: u64 = 7;

/// The start hook runs on every reactor thread before `Framework::start`
/// returns (the binary maps each reactor's fixed buffers there), and the
/// figures of the io_uring_enter and fixed-buffer sources, read on each
/// reactor's own thread, show in its stats. The hooks belong to one
/// framework: a framework started without them reports zeros.
#[test]
fn start_hook_runs_on_each_reactor_and_fixed_buffer_usage_is_reported() {
    let fw = Framework::start(FrameworkConfig {
        reactor_start_hook: Some(|index| {
            ON_REACTOR.with(|r| r.set(true));
            HOOKED.fetch_or(1 << index, Ordering::SeqCst);
        }),
        fixed_buffer_source: Some(|| {
            // Only threads that ran the hook (reactors) have an "arena".
            if ON_REACTOR.with(|r| r.get()) {
                lull_reactor::FixedBufferUsage {
                    bytes: 16 << 20,
                    in_use_bytes: 4096,
                    locked: true,
                }
            } else {
                Default::default()
            }
        }),
        io_uring_enter_source: Some(|| {
            if ON_REACTOR.with(|r| r.get()) {
                FAKE_ENTERS
            } else {
                0
            }
        }),
        ..config(2, Mode::Interrupt)
    })
    .expect("framework");
    assert_eq!(
        HOOKED.load(Ordering::SeqCst) & 0b11,
        0b11,
        "both reactors ran the hook"
    );
    // Reactors publish with their getrusage counters (every 50 ms, and
    // when they wake); a thread on each makes them run.
    let h = fw.handle().clone();
    let _a = h.spawn_thread(0, "a", |_| {}).unwrap();
    let _b = h.spawn_thread(1, "b", |_| {}).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let stats = h.reactor_stats();
        if stats.iter().all(|r| r.fixed_buffers.bytes == 16 << 20) {
            assert!(stats.iter().all(|r| r.fixed_buffers.locked));
            assert!(stats.iter().all(|r| r.fixed_buffers.in_use_bytes == 4096));
            assert!(stats.iter().all(|r| r.io_uring_enters == FAKE_ENTERS));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "fixed buffer usage never published: {stats:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(fw);

    // A second framework in the same process, without hooks: nothing
    // carried over from the first.
    HOOKED.store(0, Ordering::SeqCst);
    let fw = framework(2, Mode::Interrupt);
    let h = fw.handle().clone();
    let _a = h.spawn_thread(0, "a", |_| {}).unwrap();
    let _b = h.spawn_thread(1, "b", |_| {}).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    // Published figures are whole snapshots: wait until both reactors
    // have published once (their getrusage CPU time moves from 0).
    loop {
        let stats = h.reactor_stats();
        if stats.iter().all(|r| r.user_ns + r.system_ns > 0) {
            assert_eq!(HOOKED.load(Ordering::SeqCst), 0, "no hook ran");
            assert!(
                stats
                    .iter()
                    .all(|r| r.fixed_buffers == Default::default() && r.io_uring_enters == 0),
                "{stats:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "reactor usage never published: {stats:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Log lines of every test in this binary, for the one that checks the
/// watchdog's WARN line (the line is what an operator sees).
fn captured_logs() -> Arc<std::sync::Mutex<Vec<u8>>> {
    static LOGS: std::sync::OnceLock<Arc<std::sync::Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        buf
    })
    .clone()
}

struct Sink(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A poller that blocks its reactor for 2 s: the watchdog reports the
/// stall within 2x its threshold, names the thread and the poller, shows
/// it in `stalled_ms` while it lasts, and reports the recovery.
#[test]
fn a_blocking_poller_is_reported_as_a_stall_and_its_recovery() {
    let logs = captured_logs();
    const THRESHOLD_MS: u64 = 400;
    let fw = Framework::start(FrameworkConfig {
        stall_threshold_ms: THRESHOLD_MS,
        ..config(1, Mode::Adaptive)
    })
    .expect("framework");
    let h = fw.handle().clone();
    let (id_tx, id_rx) = mpsc::channel();
    let t = h
        .spawn_thread(0, "stall-test", move |t| {
            let id = t
                .register_poller(
                    "blocks-2s",
                    PollerKind::Woken,
                    &[],
                    Box::new(|_, _| {
                        std::thread::sleep(Duration::from_secs(2));
                        PollStatus::Busy
                    }),
                )
                .unwrap();
            id_tx.send(id).unwrap();
        })
        .unwrap();
    let id = id_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    // Quiet first: nothing stalls while the reactor idles.
    std::thread::sleep(Duration::from_millis(3 * THRESHOLD_MS));
    assert_eq!(h.reactor_stats()[0].stalls, 0);
    let blocked_at = Instant::now();
    t.wake_poller(id).unwrap();
    let seen = loop {
        let r = &h.reactor_stats()[0];
        if r.stalled_ms > 0 {
            break blocked_at.elapsed();
        }
        assert!(
            blocked_at.elapsed() < Duration::from_secs(2),
            "no stall reported while the poller blocks: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        seen <= Duration::from_millis(2 * THRESHOLD_MS),
        "stall reported {seen:?} after the block began (threshold {THRESHOLD_MS} ms)"
    );
    loop {
        let r = &h.reactor_stats()[0];
        if r.stalled_ms == 0 && blocked_at.elapsed() > Duration::from_secs(2) {
            assert_eq!(r.stalls, 1, "{r:?}");
            break;
        }
        assert!(
            blocked_at.elapsed() < Duration::from_secs(10),
            "no recovery: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The recovery line follows the answer; give the watchdog a period.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
        let stall = text
            .lines()
            .find(|l| l.contains("reactor stalled") && l.contains("stall-test"));
        if let Some(line) = stall {
            assert!(
                line.contains("WARN") && line.contains("poller=blocks-2s"),
                "{line}"
            );
            if text.contains("reactor recovered") {
                break;
            }
        }
        assert!(Instant::now() < deadline, "log:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(fw);
}
