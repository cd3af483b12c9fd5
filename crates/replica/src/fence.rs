//! Engine sessions and the fence that keeps a dead engine's writes from
//! landing after a new engine has its HELLO reply.
//!
//! ```ignore
//! let fences = Fences::new();
//! let mine = fences.register();                 // one per connection
//! mine.set_session(0x10);
//! fences.enter(&mine)?;                         // before taking a WRITE
//! // ... the write completes and its reply is queued:
//! fences.exit(&mine);
//! // A newer engine's HELLO:
//! if let Claim::Owner { previous } = fences.claim(0x20) { /* wake the others */ }
//! while !fences.drained(0x20, Some(&waiter)) { /* the poller is woken; try again */ }
//! ```
//!
//! Every connection counts its modifying requests in flight (WRITE, TRIM,
//! WRITE_ZEROES, INTENT_MARK/CLEAR, and the metadata changes ATTACH and
//! DETACH) from the moment it decodes the frame until the reply is queued.
//! It increments the count *before* it reads the owner and backs out if
//! the owner is not its session; a takeover stores the new owner *before*
//! it reads the counts (both sequentially consistent). So either the
//! request sees the new owner and is refused, or the takeover sees it
//! counted and waits for it (Dekker's pattern): no request that passed the
//! check can complete after the new owner's HELLO reply.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use crate::intent::Waiter;

/// One connection's side of the fence.
#[derive(Debug, Default)]
pub(crate) struct ConnFence {
    /// The session of the connection's HELLO (0 until then, and for tools).
    session: AtomicU64,
    /// Modifying requests taken and not yet answered.
    modifying: AtomicUsize,
    /// The connection's poller, to wake it when it is fenced.
    me: OnceLock<Waiter>,
}

impl ConnFence {
    pub(crate) fn set_session(&self, session: u64) {
        self.session.store(session, Ordering::SeqCst);
    }

    pub(crate) fn set_waiter(&self, w: Waiter) {
        let _ = self.me.set(w);
    }

    pub(crate) fn modifying(&self) -> usize {
        self.modifying.load(Ordering::SeqCst)
    }
}

/// What a HELLO with a non-zero session found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// A newer session owns the replica: the HELLO is refused.
    Stale { owner: u64 },
    /// The session owns the replica now; `previous` is who did before (the
    /// session itself when it already did).
    Owner { previous: u64 },
}

/// The replica's owner and every connection's fence.
#[derive(Debug, Default)]
pub(crate) struct Fences {
    /// The session of the newest engine that said HELLO (0: none since the
    /// replica started).
    owner: AtomicU64,
    conns: Mutex<Vec<Weak<ConnFence>>>,
    /// HELLOs waiting for other sessions to drain.
    waiters: Mutex<Vec<Waiter>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic on one connection must not take the others down with it.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Fences {
    pub(crate) fn new() -> Fences {
        Fences::default()
    }

    pub(crate) fn owner(&self) -> u64 {
        self.owner.load(Ordering::SeqCst)
    }

    /// A new connection's fence (session 0 until its HELLO).
    #[cfg(test)]
    pub(crate) fn register(&self) -> Arc<ConnFence> {
        let f = Arc::new(ConnFence::default());
        self.adopt(&f);
        f
    }

    /// Counts a connection's fence in this replica's (at its first HELLO:
    /// on a store, that is when the connection learns its replica).
    pub(crate) fn adopt(&self, f: &Arc<ConnFence>) {
        let mut conns = lock(&self.conns);
        conns.retain(|w| w.strong_count() > 0);
        conns.push(Arc::downgrade(f));
    }

    /// The engine session that holds the replica: the owner, while one of
    /// its connections is open (`None` when no engine is connected).
    pub(crate) fn holder(&self) -> Option<u64> {
        let owner = self.owner();
        if owner == 0 {
            return None;
        }
        lock(&self.conns)
            .iter()
            .filter_map(Weak::upgrade)
            .any(|f| f.session.load(Ordering::SeqCst) == owner)
            .then_some(owner)
    }

    /// Connections open on this replica (any session).
    pub(crate) fn connections(&self) -> usize {
        lock(&self.conns)
            .iter()
            .filter(|w| w.strong_count() > 0)
            .count()
    }

    /// Before taking a modifying request: counts it, or returns the owner
    /// when the connection's session does not own the replica.
    pub(crate) fn enter(&self, f: &ConnFence) -> Result<(), u64> {
        f.modifying.fetch_add(1, Ordering::SeqCst);
        let owner = self.owner.load(Ordering::SeqCst);
        if owner != f.session.load(Ordering::SeqCst) {
            self.exit(f);
            return Err(owner);
        }
        Ok(())
    }

    /// A request counted by [`Fences::enter`] is answered (or abandoned).
    pub(crate) fn exit(&self, f: &ConnFence) {
        let before = f.modifying.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "fence exit without enter");
        if before == 1 && self.owner.load(Ordering::SeqCst) != f.session.load(Ordering::SeqCst) {
            // The last request of a fenced session: a takeover may wait.
            self.wake_waiters();
        }
    }

    /// A HELLO of `session` (non-zero): takes the replica over when it is
    /// newer than the owner.
    pub(crate) fn claim(&self, session: u64) -> Claim {
        debug_assert_ne!(session, 0, "session 0 never claims");
        let previous = self.owner.fetch_max(session, Ordering::SeqCst);
        if previous > session {
            Claim::Stale { owner: previous }
        } else {
            Claim::Owner { previous }
        }
    }

    /// Wakes every connection of a non-zero session other than `session`,
    /// so an idle one sees that it is fenced and closes.
    pub(crate) fn wake_others(&self, session: u64) {
        for f in lock(&self.conns).iter().filter_map(Weak::upgrade) {
            let s = f.session.load(Ordering::SeqCst);
            if s != 0 && s != session {
                if let Some((thread, poller)) = f.me.get().cloned() {
                    let _ = thread.send(move |t| {
                        t.wake_poller(poller);
                    });
                }
            }
        }
    }

    /// Whether no connection of another session has a modifying request
    /// in flight. When not, `waiter` is woken once one of them drains (or
    /// goes away); call again then.
    pub(crate) fn drained(&self, session: u64, waiter: Option<&Waiter>) -> bool {
        // Registered before the counts are read, so a drain that happens
        // right after the read finds it.
        if let Some(w) = waiter {
            let mut waiters = lock(&self.waiters);
            if !waiters.iter().any(|(t, p)| t.id() == w.0.id() && *p == w.1) {
                waiters.push(w.clone());
            }
        }
        let busy = lock(&self.conns).iter().filter_map(Weak::upgrade).any(|f| {
            f.session.load(Ordering::SeqCst) != session && f.modifying.load(Ordering::SeqCst) > 0
        });
        if !busy {
            if let Some(w) = waiter {
                lock(&self.waiters).retain(|(t, p)| !(t.id() == w.0.id() && *p == w.1));
            }
        }
        !busy
    }

    /// Forgets a waiter that gave up (its connection is closing).
    pub(crate) fn forget(&self, w: &Waiter) {
        lock(&self.waiters).retain(|(t, p)| !(t.id() == w.0.id() && *p == w.1));
    }

    /// Modifying requests in flight over every connection.
    pub(crate) fn modifying_total(&self) -> usize {
        lock(&self.conns)
            .iter()
            .filter_map(Weak::upgrade)
            .map(|f| f.modifying())
            .sum()
    }

    /// A connection went away: a takeover waiting for it looks again.
    pub(crate) fn conn_gone(&self) {
        self.wake_waiters();
    }

    fn wake_waiters(&self) {
        let waiters = std::mem::take(&mut *lock(&self.waiters));
        for (thread, poller) in waiters {
            let _ = thread.send(move |t| {
                t.wake_poller(poller);
            });
        }
    }

    #[cfg(test)]
    fn waiting(&self) -> usize {
        lock(&self.waiters).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lull_reactor::{PollStatus, PollerKind, Thread};

    fn waiter(t: &mut Thread) -> Waiter {
        let id = t
            .register_poller(
                "w",
                PollerKind::Active,
                &[],
                Box::new(|_, _| PollStatus::Idle),
            )
            .unwrap();
        (t.handle(), id)
    }

    #[test]
    fn owner_session_enters_others_are_refused() {
        let f = Fences::new();
        let tool = f.register();
        let a = f.register();
        a.set_session(5);
        // No engine yet: a tool may modify; the engine may not until its
        // HELLO claimed the replica.
        assert_eq!(f.enter(&tool), Ok(()));
        f.exit(&tool);
        assert_eq!(f.enter(&a), Err(0));
        assert_eq!(a.modifying(), 0, "a refused enter backs out");
        assert_eq!(f.claim(5), Claim::Owner { previous: 0 });
        assert_eq!(f.claim(5), Claim::Owner { previous: 5 });
        assert_eq!(f.enter(&a), Ok(()));
        assert_eq!(f.enter(&tool), Err(5));
        assert_eq!(
            f.claim(4),
            Claim::Stale { owner: 5 },
            "an older session never takes it back"
        );
        assert_eq!(f.owner(), 5);
        assert_eq!(f.modifying_total(), 1);
        f.exit(&a);
        assert_eq!(f.modifying_total(), 0);
    }

    #[test]
    fn takeover_waits_for_the_old_session_to_drain() {
        let mut t = Thread::new(1, "fence-test").unwrap();
        let w = waiter(&mut t);
        let f = Fences::new();
        let a = f.register();
        let b = f.register();
        a.set_session(1);
        b.set_session(2);
        assert_eq!(f.claim(1), Claim::Owner { previous: 0 });
        f.enter(&a).unwrap();
        f.enter(&a).unwrap();
        assert_eq!(f.claim(2), Claim::Owner { previous: 1 });
        // A takes nothing new, and B waits for what A already took.
        assert_eq!(f.enter(&a), Err(2));
        assert!(!f.drained(2, Some(&w)));
        assert_eq!(f.waiting(), 1);
        assert!(!f.drained(2, Some(&w)), "waiting twice registers once");
        assert_eq!(f.waiting(), 1);
        f.exit(&a);
        assert_eq!(f.waiting(), 1, "still one in flight: nobody woken");
        f.exit(&a);
        assert_eq!(f.waiting(), 0, "the last one wakes the waiter");
        assert!(f.drained(2, Some(&w)));
        assert_eq!(f.waiting(), 0);
        // B's own requests never hold B back.
        f.enter(&b).unwrap();
        assert!(f.drained(2, None));
        f.exit(&b);
    }

    #[test]
    fn a_connection_going_away_releases_the_wait() {
        let mut t = Thread::new(1, "fence-test").unwrap();
        let w = waiter(&mut t);
        let f = Fences::new();
        let a = f.register();
        a.set_session(1);
        f.claim(1);
        f.enter(&a).unwrap();
        f.claim(2);
        assert!(!f.drained(2, Some(&w)));
        drop(a);
        f.conn_gone();
        assert_eq!(f.waiting(), 0);
        assert!(f.drained(2, Some(&w)));
        f.forget(&w);
        // Dead fences are pruned at the next registration.
        let _c = f.register();
        assert_eq!(lock(&f.conns).len(), 1);
    }
}
