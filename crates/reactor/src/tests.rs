//! Single-thread tests on a fake clock: no reactor, no real time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::{
    Clock, FakeClock, PollStatus, PollerId, PollerKind, ReactorError, Scope, Thread, MSG_BATCH,
};

fn thread() -> Thread {
    Thread::new(1, "test").expect("thread")
}

#[test]
fn timed_poller_fires_exactly_at_its_period() {
    let clock = FakeClock::new(0);
    let mut t = thread();
    let fired = Arc::new(Mutex::new(Vec::new()));
    let f = fired.clone();
    t.register_poller(
        "timer",
        PollerKind::every_us(100),
        &[],
        Box::new(move |_t, now| {
            f.lock().unwrap().push(now);
            PollStatus::Busy
        }),
    )
    .unwrap();
    for step in 0..=100u64 {
        clock.set(step * 10_000);
        t.poll(clock.now_ns(), Scope::All, &clock);
    }
    let expected: Vec<u64> = (1..=10).map(|k| k * 100_000).collect();
    assert_eq!(*fired.lock().unwrap(), expected);
    t.check_invariants();
}

#[test]
fn busy_idle_accounting_is_exact_for_a_script() {
    let clock = FakeClock::new(1_000);
    let mut t = thread();
    // (status, ns of work) per iteration.
    let script = [
        (PollStatus::Busy, 300),
        (PollStatus::Idle, 50),
        (PollStatus::Busy, 1_000),
        (PollStatus::Idle, 7),
    ];
    let step = Arc::new(AtomicUsize::new(0));
    let (c, s) = (clock.clone(), step.clone());
    t.register_poller(
        "scripted",
        PollerKind::Active,
        &[],
        Box::new(move |_t, _now| {
            let (status, ns) = script[s.fetch_add(1, Ordering::SeqCst)];
            c.advance(ns);
            status
        }),
    )
    .unwrap();
    for _ in 0..script.len() {
        t.poll(clock.now_ns(), Scope::All, &clock);
    }
    let stats = t.handle().stats();
    assert_eq!(stats.busy_ns, 1_300);
    assert_eq!(stats.idle_ns, 57);
    assert_eq!(stats.iterations, 4);
}

#[test]
fn messages_arrive_in_order_in_bounded_batches() {
    let clock = FakeClock::new(0);
    let mut t = thread();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let h = t.handle();
    for i in 0..100u32 {
        let s = seen.clone();
        h.send(move |_t| s.lock().unwrap().push(i)).unwrap();
    }
    assert_eq!(t.poll(0, Scope::All, &clock), PollStatus::Busy);
    assert_eq!(seen.lock().unwrap().len(), MSG_BATCH);
    while t.poll(0, Scope::All, &clock).is_busy() {}
    assert_eq!(*seen.lock().unwrap(), (0..100).collect::<Vec<_>>());
    assert_eq!(t.poll(0, Scope::All, &clock), PollStatus::Idle);
}

#[test]
fn pollers_unregister_pause_and_resume_from_inside_callbacks() {
    let clock = FakeClock::new(0);
    let mut t = thread();
    let runs_a = Arc::new(AtomicUsize::new(0));
    let runs_c = Arc::new(AtomicUsize::new(0));

    let ra = runs_a.clone();
    let id_a = Arc::new(Mutex::new(None::<PollerId>));
    let ia = id_a.clone();
    let a = t
        .register_poller(
            "a",
            PollerKind::Active,
            &[],
            Box::new(move |t, _| {
                // Unregister itself on its third run, and register a
                // replacement that reuses the slot.
                if ra.fetch_add(1, Ordering::SeqCst) == 2 {
                    let me = ia.lock().unwrap().expect("id");
                    assert!(t.unregister_poller(me));
                    t.register_poller(
                        "a2",
                        PollerKind::Active,
                        &[],
                        Box::new(|_, _| PollStatus::Idle),
                    )
                    .unwrap();
                }
                PollStatus::Busy
            }),
        )
        .unwrap();
    *id_a.lock().unwrap() = Some(a);

    let rc = runs_c.clone();
    let c = t
        .register_poller(
            "c",
            PollerKind::Active,
            &[],
            Box::new(move |_, _| {
                rc.fetch_add(1, Ordering::SeqCst);
                PollStatus::Busy
            }),
        )
        .unwrap();
    let b_runs = Arc::new(AtomicUsize::new(0));
    let br = b_runs.clone();
    t.register_poller(
        "b",
        PollerKind::Active,
        &[],
        Box::new(move |t, _| {
            match br.fetch_add(1, Ordering::SeqCst) {
                0 => assert!(t.pause_poller(c)),
                4 => assert!(t.resume_poller(c)),
                _ => {}
            }
            PollStatus::Idle
        }),
    )
    .unwrap();

    for _ in 0..10 {
        t.poll(0, Scope::All, &clock);
        t.check_invariants();
    }
    assert_eq!(
        runs_a.load(Ordering::SeqCst),
        3,
        "a ran until it unregistered itself"
    );
    // c ran in iteration 0 (before b paused it), was paused in iterations 1..=4,
    // resumed by b in iteration 4 (after c's turn), then ran in 5..=9.
    assert_eq!(runs_c.load(Ordering::SeqCst), 1 + 5);
    assert!(!t.unregister_poller(a), "a stale id is harmless");
    let s = t.handle().stats();
    assert_eq!((s.pollers_active, s.pollers_paused), (3, 0));
}

#[test]
fn event_driven_thread_refuses_active_poller_without_fd() {
    let mut t = thread();
    t.set_event_driven(true);
    let r = t.register_poller(
        "spin",
        PollerKind::Active,
        &[],
        Box::new(|_, _| PollStatus::Idle),
    );
    assert!(matches!(r, Err(ReactorError::NoEventSource(_))));
    // Timed pollers need no fd: the thread's timerfd drives them.
    assert!(t
        .register_poller(
            "tick",
            PollerKind::every_us(10),
            &[],
            Box::new(|_, _| PollStatus::Idle)
        )
        .is_ok());
    t.check_invariants();
}

#[test]
fn ready_scope_runs_only_woken_pollers() {
    let clock = FakeClock::new(0);
    let mut t = thread();
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let id = t
        .register_poller(
            "p",
            PollerKind::Active,
            &[],
            Box::new(move |_, _| {
                r.fetch_add(1, Ordering::SeqCst);
                PollStatus::Busy
            }),
        )
        .unwrap();
    t.poll(0, Scope::Ready, &clock);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert!(!t.has_immediate_work(0));
    t.wake_poller(id);
    assert!(t.has_immediate_work(0));
    t.poll(0, Scope::Ready, &clock);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    t.poll(0, Scope::Ready, &clock);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    t.check_invariants();
}

/// A poller whose readiness the test controls through an eventfd.
fn evented(t: &mut Thread, name: &str) -> (PollerId, Arc<crate::sys::EventFd>) {
    evented_counted(t, name, Arc::new(AtomicUsize::new(0)))
}

/// `evented`, counting its runs in `runs`.
fn evented_counted(
    t: &mut Thread,
    name: &str,
    runs: Arc<AtomicUsize>,
) -> (PollerId, Arc<crate::sys::EventFd>) {
    use std::os::fd::AsRawFd;
    let efd = Arc::new(crate::sys::EventFd::new().unwrap());
    let e = efd.clone();
    let id = t
        .register_poller(
            name,
            PollerKind::Active,
            &[(efd.as_raw_fd(), crate::Interest::READABLE)],
            Box::new(move |_, _| {
                runs.fetch_add(1, Ordering::SeqCst);
                if e.drain() {
                    PollStatus::Busy
                } else {
                    PollStatus::Idle
                }
            }),
        )
        .unwrap();
    (id, efd)
}

#[test]
fn hybrid_drains_initiators_on_a_period_not_on_their_fds() {
    let clock = FakeClock::new(0);
    let mut t = thread();
    t.set_event_driven(true);
    let (id, fd) = evented(&mut t, "replica");
    t.mark_initiator(id).unwrap();
    t.set_initiator_period(Some(100_000));
    fd.notify();
    // The period starts at the switch (now 0): due at once, then every 100 µs.
    assert!(t.poll(0, Scope::Ready, &clock).is_busy());
    fd.notify();
    assert!(
        !t.poll(50_000, Scope::Ready, &clock).is_busy(),
        "its fd does not wake it in hybrid mode"
    );
    assert!(t.has_immediate_work(100_000));
    assert!(
        t.poll(100_000, Scope::Ready, &clock).is_busy(),
        "drained by the periodic poll"
    );
    // Back to interrupt: the fd drives it again.
    t.set_initiator_period(None);
    fd.notify();
    assert!(t.poll(110_000, Scope::Ready, &clock).is_busy());
    t.check_invariants();
}

#[test]
fn an_iteration_runs_only_the_sources_with_work() {
    // A poll group: 1,000 connections, three of which have bytes to read,
    // and one fd-less poller (poll mode runs it every iteration).
    let clock = FakeClock::new(0);
    let mut t = thread();
    let runs = Arc::new(AtomicUsize::new(0));
    let mut fds = Vec::new();
    for i in 0..1_000 {
        let (_, efd) = evented_counted(&mut t, &format!("conn-{i}"), runs.clone());
        fds.push(efd);
    }
    let spins = Arc::new(AtomicUsize::new(0));
    let s = spins.clone();
    t.register_poller(
        "fdless",
        PollerKind::Active,
        &[],
        Box::new(move |_, _| {
            s.fetch_add(1, Ordering::SeqCst);
            PollStatus::Idle
        }),
    )
    .unwrap();
    for scope in [Scope::All, Scope::Ready] {
        runs.store(0, Ordering::SeqCst);
        spins.store(0, Ordering::SeqCst);
        assert!(!t.poll(0, scope, &clock).is_busy());
        assert_eq!(runs.load(Ordering::SeqCst), 0, "{scope:?}: nothing ready");
        for i in [3, 500, 999] {
            fds[i].notify();
        }
        assert!(t.poll(0, scope, &clock).is_busy());
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{scope:?}: the ready ones");
        assert!(!t.poll(0, scope, &clock).is_busy());
        assert_eq!(runs.load(Ordering::SeqCst), 3, "{scope:?}: drained");
        let want = if scope == Scope::All { 3 } else { 0 };
        assert_eq!(spins.load(Ordering::SeqCst), want, "{scope:?}: fd-less");
        t.check_invariants();
    }
    assert_eq!(t.handle().stats().ready_events, 3 * 2);
}

#[test]
fn timers_fire_on_time_through_pause_resume_and_unregister_churn() {
    // 64 timed pollers with periods of 10..=640 µs; a deterministic script
    // pauses, resumes, unregisters and re-registers them while the clock
    // steps by 10 µs. Each must fire exactly when due: at `next`, then
    // every period, never while paused or after unregistering.
    struct Timer {
        id: Option<PollerId>,
        period_ns: u64,
        next_ns: u64,
        paused: bool,
        fired: Arc<Mutex<Vec<u64>>>,
    }
    let clock = FakeClock::new(0);
    let mut t = thread();
    let register = |t: &mut Thread, period_ns: u64, fired: &Arc<Mutex<Vec<u64>>>| {
        let f = fired.clone();
        t.register_poller(
            "timer",
            PollerKind::Timed { period_ns },
            &[],
            Box::new(move |_, now| {
                f.lock().unwrap().push(now);
                PollStatus::Busy
            }),
        )
        .unwrap()
    };
    let mut timers: Vec<Timer> = (0..64u64)
        .map(|i| {
            let period_ns = (i % 64 + 1) * 10_000;
            let fired = Arc::new(Mutex::new(Vec::new()));
            Timer {
                id: Some(register(&mut t, period_ns, &fired)),
                period_ns,
                next_ns: period_ns,
                paused: false,
                fired,
            }
        })
        .collect();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut now = 0;
    for _ in 0..2_000 {
        now += 10_000;
        clock.set(now);
        t.poll(now, Scope::Ready, &clock);
        for tm in &mut timers {
            let fired = std::mem::take(&mut *tm.fired.lock().unwrap());
            let due = tm.id.is_some() && !tm.paused && tm.next_ns <= now;
            assert_eq!(fired, if due { vec![now] } else { vec![] }, "at {now}");
            if due {
                tm.next_ns = now + tm.period_ns;
            }
        }
        // Churn: one random action on one random timer.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let tm = &mut timers[(rng % 64) as usize];
        match (rng >> 8) % 4 {
            0 if tm.id.is_some() && !tm.paused => {
                assert!(t.pause_poller(tm.id.unwrap()));
                tm.paused = true;
            }
            1 if tm.paused => {
                assert!(t.resume_poller(tm.id.unwrap()));
                tm.paused = false;
                tm.next_ns = now + tm.period_ns;
            }
            2 if tm.id.is_some() => {
                assert!(t.unregister_poller(tm.id.take().unwrap()));
                tm.paused = false;
            }
            3 if tm.id.is_none() => {
                tm.id = Some(register(&mut t, tm.period_ns, &tm.fired));
                tm.next_ns = now + tm.period_ns;
            }
            _ => {}
        }
        t.check_invariants();
        let next = timers
            .iter()
            .filter(|tm| tm.id.is_some() && !tm.paused)
            .map(|tm| tm.next_ns)
            .min();
        assert_eq!(t.next_deadline(), next, "the first timer is the next due");
    }
}

#[test]
fn a_paused_pollers_ready_fd_does_not_keep_the_thread_awake() {
    let clock = FakeClock::new(0);
    let mut t = thread();
    t.set_event_driven(true);
    let (id, fd) = evented(&mut t, "paused");
    fd.notify();
    assert!(t.pause_poller(id));
    // Its fd is ready, but the thread's epoll set does not report it.
    let probe = crate::sys::Epoll::new().unwrap();
    probe
        .add(t.epoll_fd(), crate::Interest::READABLE, 0)
        .unwrap();
    let mut events = crate::sys::event_buffer(4);
    t.poll(0, Scope::Ready, &clock);
    assert_eq!(probe.wait(&mut events, 0).unwrap(), 0, "paused: silent");
    assert!(t.resume_poller(id));
    assert_eq!(
        probe.wait(&mut events, 0).unwrap(),
        1,
        "resumed: ready again"
    );
    assert!(t.poll(0, Scope::Ready, &clock).is_busy(), "and it runs");
    t.check_invariants();
}

#[test]
fn a_detached_poller_runs_in_its_new_thread_on_its_fd() {
    let clock = FakeClock::new(0);
    let mut a = thread();
    let mut b = Thread::new(2, "other").expect("thread");
    for t in [&mut a, &mut b] {
        t.set_event_driven(true);
    }
    let runs = Arc::new(AtomicUsize::new(0));
    let (id, fd) = evented_counted(&mut a, "conn", runs.clone());
    let p = a.detach_poller(id).expect("detachable");
    assert!(!a.has_poller(id));
    assert!(a.detach_poller(id).is_none(), "stale id");
    // Its fd left `a`'s epoll set: a ready fd does not run anything there.
    fd.notify();
    assert_eq!(
        a.poll_ready(0, Scope::Ready, true, &clock),
        PollStatus::Idle
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    let new_id = b.attach_poller(p).expect("attach");
    assert!(b.has_poller(new_id));
    // It runs at once in `b` (work may have arrived while it moved) and
    // then on its fd.
    assert_eq!(
        b.poll_ready(0, Scope::Ready, false, &clock),
        PollStatus::Busy
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    fd.notify();
    assert_eq!(
        b.poll_ready(0, Scope::Ready, true, &clock),
        PollStatus::Busy
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    a.check_invariants();
    b.check_invariants();
}

#[test]
fn a_woken_poller_runs_only_when_woken_from_any_thread() {
    let clock = FakeClock::new(0);
    let mut t = thread();
    // Refused as an fd-less active poller would be: it is not one.
    t.set_event_driven(true);
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let id = t
        .register_poller(
            "doorbell",
            PollerKind::Woken,
            &[],
            Box::new(move |_, _| {
                r.fetch_add(1, Ordering::SeqCst);
                PollStatus::Busy
            }),
        )
        .unwrap();
    // Never spun, not even in poll mode's every-iteration pass.
    t.set_event_driven(false);
    for _ in 0..3 {
        assert_eq!(t.poll(0, Scope::All, &clock), PollStatus::Idle);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Woken from another thread: through the mailbox, run in the same
    // iteration, once for two wake-ups.
    let h = t.handle();
    std::thread::spawn(move || {
        h.wake_poller(id).unwrap();
        h.wake_poller(id).unwrap();
    })
    .join()
    .unwrap();
    assert!(t.has_immediate_work(0));
    assert_eq!(t.poll(0, Scope::All, &clock), PollStatus::Busy);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(t.poll(0, Scope::All, &clock), PollStatus::Idle);
    // A wake-up is not a message.
    assert_eq!(t.handle().stats().messages, 0);
    // Paused, a wake-up is dropped; resuming runs it once.
    t.wake_poller(id);
    assert!(t.pause_poller(id));
    assert_eq!(t.poll(0, Scope::All, &clock), PollStatus::Idle);
    assert!(t.resume_poller(id));
    assert_eq!(t.poll(0, Scope::All, &clock), PollStatus::Busy);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    t.check_invariants();
    // A stale id wakes nothing.
    assert!(t.unregister_poller(id));
    t.handle().wake_poller(id).unwrap();
    assert_eq!(t.poll(0, Scope::All, &clock), PollStatus::Busy);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    t.check_invariants();
}

#[test]
fn a_poller_woken_at_a_time_runs_once_then_and_not_before() {
    let clock = FakeClock::new(0);
    let mut t = thread();
    let runs = Arc::new(AtomicUsize::new(0));
    let (id, _efd) = evented_counted(&mut t, "held", runs.clone());
    assert!(t.wake_poller_at(id, 1_000));
    // A later wake-up does not push the armed one back; an earlier wins.
    assert!(t.wake_poller_at(id, 5_000));
    assert_eq!(t.next_deadline(), Some(1_000));
    t.poll(999, Scope::Ready, &clock);
    assert_eq!(runs.load(Ordering::SeqCst), 0, "not before its time");
    assert!(t.has_immediate_work(1_000));
    t.poll(1_000, Scope::Ready, &clock);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    t.poll(10_000, Scope::Ready, &clock);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "one-shot");
    assert_eq!(t.next_deadline(), None);
    // Paused with a wake-up armed: it does not run, and the count of
    // armed wake-ups stays right through pause, re-arm and unregister.
    assert!(t.wake_poller_at(id, 20_000));
    t.pause_poller(id);
    t.poll(30_000, Scope::Ready, &clock);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    t.resume_poller(id);
    assert!(t.wake_poller_at(id, 40_000));
    assert!(t.unregister_poller(id));
    t.poll(50_000, Scope::Ready, &clock);
    assert!(!t.wake_poller_at(id, 60_000), "a stale id");
    t.check_invariants();
}
