//! lull's execution core, after SPDK's thread library: **reactors** (pinned OS
//! threads) run **lull threads** (single-threaded contexts), which own
//! **pollers** (functions that look for work and say Busy or Idle) and receive
//! **messages** (closures sent from any thread).
//!
//! ```ignore
//! use lull_reactor::{Framework, FrameworkConfig, Mode, PollerKind, PollStatus};
//! let fw = Framework::start(FrameworkConfig::new(vec![1], Mode::Interrupt))?;
//! let t = fw.handle().spawn_thread(0, "ticker", |t| {
//!     t.register_poller("tick", PollerKind::every_us(1000), &[], Box::new(|_t, _now| PollStatus::Busy)).unwrap();
//! })?;
//! t.send(|t| println!("on {}", t.name()))?;
//! ```
//!
//! Each reactor runs in an event mode: `poll` never sleeps; `interrupt`
//! blocks in `epoll_wait` on the fds its pollers name; `adaptive` spins
//! while spinning pays ([`adaptive`]) and sleeps otherwise. In every mode
//! only sources with work run: each lull thread has its own epoll set,
//! nested in its reactor's (so a thread can later move between reactors by
//! moving one fd), and an iteration visits the threads the reactor's epoll
//! reports ready and, in them, the pollers whose fds are ready. Timed
//! pollers sit in a heap per thread, driven by a timerfd when the reactor
//! sleeps, and a message rings its target's eventfd only when the target
//! may be asleep.
//!
//! A connection is not a lull thread: servers put connections as pollers
//! into *poll groups*, one lull thread per reactor (`lull_net::server`).

// Unsafe only in `sys`, the fence around Linux syscalls (docs/STYLE.md
// habit 8).
#![deny(unsafe_code)]

pub mod adaptive;
mod clock;
mod cores;
pub mod governor;
pub mod rate;
mod reactor;
pub mod scheduler;
#[allow(unsafe_code)]
pub mod sys;
mod thread;
pub mod watchdog;

pub use clock::{Clock, FakeClock, MonotonicClock};
pub use cores::{parse_core_list, MAX_CORE};
pub use reactor::{
    FixedBufferUsage, Framework, FrameworkConfig, FrameworkHandle, Mode, ReactorStats,
    SchedulerConfig, SchedulerInfo, DEFAULT_IOQ_POLL_PERIOD_US,
};
pub use sys::Interest;
pub use thread::{
    DetachedPoller, Message, PollFn, PollStatus, PollerId, PollerKind, Scope, SendError, Thread,
    ThreadHandle, ThreadStats, MAX_POLLERS_PER_THREAD, MSG_BATCH, MSG_QUEUE_CAPACITY,
};

/// A mode serializes as its name (`"poll"`, `"adaptive"`, ...), as
/// `lull bench` writes it in report.json.
#[cfg(feature = "serde")]
impl serde::Serialize for Mode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// Errors of the reactor framework.
#[derive(Debug, thiserror::Error)]
pub enum ReactorError {
    #[error("system call failed: {0}")]
    Sys(#[from] std::io::Error),
    #[error("active poller(s) without an fd cannot run on an event-driven reactor: {0}")]
    NoEventSource(String),
    #[error("thread {0} has too many pollers (limit {MAX_POLLERS_PER_THREAD})")]
    TooManyPollers(String),
    #[error("no such poller")]
    NoSuchPoller,
    #[error("no reactor {0}")]
    NoSuchReactor(usize),
    #[error("control queue of reactor {0} is full")]
    ControlQueueFull(usize),
    #[error("cannot spawn thread: {0}")]
    Spawn(String),
    #[error("thread is not attached to a framework")]
    Detached,
    #[error("framework configuration: {0}")]
    Config(String),
    #[error("the framework has stopped")]
    Stopped,
}

#[cfg(test)]
mod tests;
