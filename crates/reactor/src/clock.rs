//! Time as an argument: the reactor reads a `Clock` at the start of an
//! iteration and before each lull thread it runs, and passes `now` down;
//! pollers and state machines take `now` as an argument, so tests drive
//! everything with a `FakeClock`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// A monotonic nanosecond clock.
pub trait Clock: Send + Sync {
    fn now_ns(&self) -> u64;
}

/// The real clock: nanoseconds since the first use in this process
/// (CLOCK_MONOTONIC through the vDSO, ~20 ns a read).
#[derive(Debug, Clone, Copy, Default)]
pub struct MonotonicClock;

fn epoch_ns() -> u64 {
    static EPOCH_NS: OnceLock<u64> = OnceLock::new();
    *EPOCH_NS.get_or_init(crate::sys::monotonic_ns)
}

impl Clock for MonotonicClock {
    fn now_ns(&self) -> u64 {
        // The epoch first: read after it, the clock is never behind it.
        let epoch = epoch_ns();
        crate::sys::monotonic_ns().saturating_sub(epoch)
    }
}

/// A clock that moves only when told to. Cloning shares the time.
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    ns: Arc<AtomicU64>,
}

impl FakeClock {
    pub fn new(start_ns: u64) -> FakeClock {
        FakeClock {
            ns: Arc::new(AtomicU64::new(start_ns)),
        }
    }
    pub fn advance(&self, ns: u64) {
        self.ns.fetch_add(ns, Ordering::SeqCst);
    }
    pub fn set(&self, ns: u64) {
        self.ns.store(ns, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now_ns(&self) -> u64 {
        self.ns.load(Ordering::SeqCst)
    }
}
