//! Lull threads: single-threaded execution contexts that own pollers, a
//! message queue and an epoll set of the file descriptors that signal their
//! work.
//!
//! ```ignore
//! let t = framework.spawn_thread(0, "conn", |t: &mut Thread| {
//!     let sock = ...; // an fd the poller reads
//!     t.register_poller("rx", PollerKind::Active, &[(sock_fd, Interest::READABLE)],
//!         Box::new(move |_t, _now| if read_some(&sock) { PollStatus::Busy } else { PollStatus::Idle }))
//!         .expect("poller");
//! })?;
//! t.send(|_t| println!("runs on the lull thread"))?;
//! ```
//!
//! A thread is only ever touched by the reactor that currently runs it, so
//! nothing inside needs a lock. Everything it holds is `Send`, so the thread
//! can later move between reactors whole (its epoll set is one fd in the
//! reactor's epoll set).

use std::collections::HashSet;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;

use crate::clock::Clock;
use crate::reactor::FrameworkHandle;
use crate::sys::{event_buffer, Epoll, EventFd, Interest, TimerFd};
use crate::ReactorError;

/// Messages drained per thread per iteration. SPDK drains 8
/// (SPDK_MSG_BATCH_SIZE): enough to amortise the queue check, few enough that
/// a message flood cannot starve the thread's pollers (and their I/O).
pub const MSG_BATCH: usize = 8;

/// Capacity of a thread's message queue by default. SPDK's per-thread ring
/// holds 65536; a full queue is reported to the sender (back-pressure)
/// instead of growing. The queue is allocated and initialised whole (24
/// bytes a slot, 1.5 MiB resident at this size), so threads that only ever
/// receive a few wake-ups ask for less ([`Thread::with_mailbox`]).
pub const MSG_QUEUE_CAPACITY: usize = 65536;

/// Pollers one thread may own. A connection needs one or two; this bound
/// catches a registration leak long before it hurts the iteration time.
pub const MAX_POLLERS_PER_THREAD: usize = 1024;

/// Epoll events taken per `epoll_wait` of a thread's own set.
const THREAD_EVENT_BATCH: usize = 64;

const TOKEN_DOORBELL: u64 = u64::MAX;
const TOKEN_TIMER: u64 = u64::MAX - 1;

/// What a poller reports: it did work, or found none. That one bit feeds
/// busy/idle accounting, the adaptive mode and the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollStatus {
    Busy,
    Idle,
}

impl PollStatus {
    pub fn is_busy(self) -> bool {
        self == PollStatus::Busy
    }
    pub fn or(self, other: PollStatus) -> PollStatus {
        if self.is_busy() || other.is_busy() {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }
}

/// When a poller runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollerKind {
    /// Every iteration in poll mode; when one of its fds is ready (or it was
    /// woken with [`Thread::wake_poller`]) in event-driven modes.
    Active,
    /// Every `period_ns`, in every mode (a timerfd wakes a sleeping reactor).
    Timed { period_ns: u64 },
}

impl PollerKind {
    pub fn every_us(period_us: u64) -> PollerKind {
        PollerKind::Timed {
            period_ns: period_us.max(1) * 1000,
        }
    }
}

/// A poller function: runs on its thread with the iteration's `now`.
pub type PollFn = Box<dyn FnMut(&mut Thread, u64) -> PollStatus + Send>;
/// A message: runs once on its target thread.
pub type Message = Box<dyn FnOnce(&mut Thread) + Send>;

/// Names a poller within its thread. The generation makes a stale id (of an
/// unregistered poller whose slot was reused) harmless.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PollerId {
    index: u32,
    generation: u32,
}

impl PollerId {
    fn token(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.index)
    }
    fn from_token(token: u64) -> PollerId {
        PollerId {
            index: token as u32,
            generation: (token >> 32) as u32,
        }
    }
}

/// A bounded multi-producer queue with a doorbell that is rung only when the
/// consumer may be asleep.
///
/// The wake protocol is Dekker's: the producer pushes, then (SeqCst) reads
/// `wake_needed`; the consumer sets `wake_needed`, then (SeqCst) looks at the
/// queue once more before it sleeps. One of the two always sees the other, so
/// no message is left behind a sleeping consumer, and a polling consumer
/// costs producers no syscall.
pub(crate) struct Mailbox<T> {
    queue: ArrayQueue<T>,
    wake_needed: AtomicBool,
    doorbell: EventFd,
}

impl<T> Mailbox<T> {
    pub(crate) fn new(capacity: usize) -> std::io::Result<Mailbox<T>> {
        Ok(Mailbox {
            queue: ArrayQueue::new(capacity),
            wake_needed: AtomicBool::new(false),
            doorbell: EventFd::new()?,
        })
    }

    pub(crate) fn push(&self, item: T) -> Result<(), T> {
        self.queue.push(item)?;
        fence(Ordering::SeqCst);
        if self.wake_needed.load(Ordering::SeqCst) {
            self.doorbell.notify();
        }
        Ok(())
    }

    pub(crate) fn pop(&self) -> Option<T> {
        self.queue.pop()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Ask producers to ring; the caller must check `is_empty` afterwards.
    pub(crate) fn arm(&self) {
        self.wake_needed.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
    }

    pub(crate) fn disarm(&self) {
        self.wake_needed.store(false, Ordering::Relaxed);
    }

    pub(crate) fn drain_doorbell(&self) {
        self.doorbell.drain();
    }

    pub(crate) fn doorbell_fd(&self) -> RawFd {
        self.doorbell.as_raw_fd()
    }
}

/// Counters of one thread, readable from any thread.
#[derive(Debug, Default)]
pub(crate) struct ThreadCounters {
    pub busy_ns: AtomicU64,
    pub idle_ns: AtomicU64,
    pub iterations: AtomicU64,
    pub wakeups: AtomicU64,
    pub messages: AtomicU64,
    pub pollers_active: AtomicU64,
    pub pollers_timed: AtomicU64,
    pub pollers_paused: AtomicU64,
    pub reactor: AtomicU64,
}

/// A snapshot of a thread's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadStats {
    pub id: u64,
    pub name: String,
    pub reactor: usize,
    pub busy_ns: u64,
    pub idle_ns: u64,
    pub iterations: u64,
    pub wakeups: u64,
    pub messages: u64,
    pub pollers_active: u64,
    pub pollers_timed: u64,
    pub pollers_paused: u64,
}

pub(crate) struct ThreadShared {
    pub id: u64,
    pub name: String,
    pub mailbox: Mailbox<Message>,
    pub counters: ThreadCounters,
    pub exited: AtomicBool,
}

/// Why a message could not be sent.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("thread {0} has exited")]
    Exited(String),
    #[error("message queue of thread {0} is full ({MSG_QUEUE_CAPACITY} messages)")]
    Full(String),
}

/// A cheap, cloneable, `Send + Sync` reference to a lull thread, for sending
/// it messages from anywhere.
#[derive(Clone)]
pub struct ThreadHandle {
    pub(crate) shared: Arc<ThreadShared>,
}

impl std::fmt::Debug for ThreadHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadHandle({}:{})", self.shared.id, self.shared.name)
    }
}

impl ThreadHandle {
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Run `f` on the thread. Messages from one sender arrive in order.
    pub fn send(&self, f: impl FnOnce(&mut Thread) + Send + 'static) -> Result<(), SendError> {
        self.send_boxed(Box::new(f))
    }

    /// As `send`, but hands the message back when the queue is full so the
    /// caller can retry without re-boxing.
    pub fn try_send_boxed(&self, msg: Message) -> Result<(), (Message, SendError)> {
        if self.shared.exited.load(Ordering::Acquire) {
            return Err((msg, SendError::Exited(self.shared.name.clone())));
        }
        self.shared
            .mailbox
            .push(msg)
            .map_err(|m| (m, SendError::Full(self.shared.name.clone())))
    }

    pub fn send_boxed(&self, msg: Message) -> Result<(), SendError> {
        self.try_send_boxed(msg).map_err(|(_, e)| e)
    }

    pub fn has_exited(&self) -> bool {
        self.shared.exited.load(Ordering::Acquire)
    }

    pub fn stats(&self) -> ThreadStats {
        let c = &self.shared.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ThreadStats {
            id: self.shared.id,
            name: self.shared.name.clone(),
            reactor: r(&c.reactor) as usize,
            busy_ns: r(&c.busy_ns),
            idle_ns: r(&c.idle_ns),
            iterations: r(&c.iterations),
            wakeups: r(&c.wakeups),
            messages: r(&c.messages),
            pollers_active: r(&c.pollers_active),
            pollers_timed: r(&c.pollers_timed),
            pollers_paused: r(&c.pollers_paused),
        }
    }
}

struct PollerEntry {
    name: String,
    kind: PollerKind,
    next_ns: u64,
    paused: bool,
    woken: bool,
    fds: Vec<(RawFd, Interest)>,
    /// An initiator-side source (replica connections): in hybrid mode it is
    /// drained by the thread's periodic initiator poll, not by its fds.
    initiator: bool,
    /// The adaptive mode's spin window for this event source.
    gap: SpinWindow,
    /// `None` while the poller runs (it is out of its slot) .
    f: Option<PollFn>,
}

/// After a sleep, an event's observed gap includes the wake-up latency
/// (~30 µs on the VMs lull is measured on, with a longer tail), so a gap
/// up to `cap + WAKE_ALLOWANCE_NS` is a near miss: a spin of the full cap
/// would probably have caught it.
pub const WAKE_ALLOWANCE_NS: u64 = 50_000;

/// The smallest non-zero spin window (QEMU starts its window at 4 µs).
pub const MIN_SPIN_WINDOW_NS: u64 = 4_000;

/// The adaptive mode's spin window for one event source, adapted the way
/// QEMU adapts its poll-ns (grow on a near miss, shrink when events come
/// much later) but kept per source, so that a slow source (a far replica,
/// a slow disk) shrinks only its own window and never switches spinning
/// off for a fast one (the problem QEMU met in 2025 with one window per
/// AioContext).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpinWindow {
    last_busy_ns: u64,
    window_ns: u64,
}

impl SpinWindow {
    /// The source did work at `now`.
    pub fn busy(&mut self, now: u64) {
        self.last_busy_ns = now;
    }

    /// The source's next event was seen at `now`; `slept` says whether the
    /// reactor slept since the source last did work (so the event was not
    /// caught by spinning).
    pub fn event(&mut self, now: u64, slept: bool, cap_ns: u64) {
        if self.last_busy_ns == 0 {
            return;
        }
        let gap = now.saturating_sub(self.last_busy_ns);
        if !slept {
            // Caught while spinning (or busy): the window works; keep it.
            // Shrinking it here would make a busy source (many events per
            // window) oscillate between spinning and sleeping; the price
            // of keeping it is one spin of at most the cap when the source
            // stops.
        } else if gap <= cap_ns + WAKE_ALLOWANCE_NS {
            // A near miss: grow, as QEMU does, up to the cap.
            self.window_ns = (self.window_ns * 2).clamp(MIN_SPIN_WINDOW_NS, cap_ns);
        } else {
            // The source is slow (or stopped): halve, and let go below the
            // minimum.
            self.window_ns /= 2;
            if self.window_ns < MIN_SPIN_WINDOW_NS {
                self.window_ns = 0;
            }
        }
    }

    pub fn window_ns(&self) -> u64 {
        self.window_ns
    }

    pub fn last_busy_ns(&self) -> u64 {
        self.last_busy_ns
    }
}

struct PollerSlot {
    generation: u32,
    entry: Option<PollerEntry>,
}

/// Which pollers an iteration runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every active poller (poll mode, and the spinning phase of adaptive).
    All,
    /// Only pollers whose fd is ready or that were woken (event-driven modes).
    Ready,
    /// The adaptive mode's spin: the hot pollers (a spin window > 0) and the
    /// woken ones, polled directly; with `epoll` the thread's fds were
    /// reported ready too.
    Spin { epoll: bool },
}

/// A lull thread. Pollers and messages receive `&mut Thread` to register,
/// pause, resume and unregister pollers (their own included), wake pollers,
/// spawn threads and send messages.
pub struct Thread {
    shared: Arc<ThreadShared>,
    framework: Option<FrameworkHandle>,
    pollers: Vec<PollerSlot>,
    free: Vec<u32>,
    epoll: Epoll,
    timer: TimerFd,
    timer_armed_ns: Option<u64>,
    events: Vec<libc::epoll_event>,
    woken: usize,
    current: Option<PollerId>,
    event_driven: bool,
    /// Hybrid mode: initiator pollers run every this many ns.
    initiator_period_ns: Option<u64>,
    next_initiator_ns: u64,
    /// The adaptive mode's cap on spinning.
    spin_cap_ns: u64,
    /// When the reactor last woke from a sleep.
    last_wake_ns: u64,
    /// The message queue is an event source too (cross-reactor traffic,
    /// e.g. NBD connections and their volume's engine).
    mailbox_window: SpinWindow,
    exit_requested: bool,
    now_ns: u64,
    // Local accumulators, published to `shared.counters` after each iteration.
    busy_ns: u64,
    idle_ns: u64,
    iterations: u64,
    wakeups: u64,
    messages: u64,
}

impl std::fmt::Debug for Thread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Thread({}:{})", self.shared.id, self.shared.name)
    }
}

impl Thread {
    /// A thread not yet on any reactor (tests drive it with `poll` directly).
    pub fn new(id: u64, name: &str) -> Result<Thread, ReactorError> {
        Thread::with_mailbox(id, name, MSG_QUEUE_CAPACITY)
    }

    /// A thread whose message queue holds `capacity` messages (at least 1).
    pub fn with_mailbox(id: u64, name: &str, capacity: usize) -> Result<Thread, ReactorError> {
        let shared = Arc::new(ThreadShared {
            id,
            name: name.to_string(),
            mailbox: Mailbox::new(capacity.max(1)).map_err(ReactorError::Sys)?,
            counters: ThreadCounters::default(),
            exited: AtomicBool::new(false),
        });
        let epoll = Epoll::new().map_err(ReactorError::Sys)?;
        let timer = TimerFd::new().map_err(ReactorError::Sys)?;
        epoll
            .add(
                shared.mailbox.doorbell_fd(),
                Interest::READABLE,
                TOKEN_DOORBELL,
            )
            .map_err(ReactorError::Sys)?;
        epoll
            .add(timer.as_raw_fd(), Interest::READABLE, TOKEN_TIMER)
            .map_err(ReactorError::Sys)?;
        Ok(Thread {
            shared,
            framework: None,
            pollers: Vec::new(),
            free: Vec::new(),
            epoll,
            timer,
            timer_armed_ns: None,
            events: event_buffer(THREAD_EVENT_BATCH),
            woken: 0,
            current: None,
            event_driven: false,
            initiator_period_ns: None,
            next_initiator_ns: 0,
            spin_cap_ns: crate::reactor::ADAPTIVE_SPIN_CAP_NS,
            last_wake_ns: 0,
            mailbox_window: SpinWindow::default(),
            exit_requested: false,
            now_ns: 0,
            busy_ns: 0,
            idle_ns: 0,
            iterations: 0,
            wakeups: 0,
            messages: 0,
        })
    }

    pub fn id(&self) -> u64 {
        self.shared.id
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    pub fn handle(&self) -> ThreadHandle {
        ThreadHandle {
            shared: self.shared.clone(),
        }
    }

    /// The framework this thread runs in (`None` for a detached test thread).
    pub fn framework(&self) -> Option<&FrameworkHandle> {
        self.framework.as_ref()
    }

    pub(crate) fn attach(&mut self, framework: FrameworkHandle) {
        self.framework = Some(framework);
    }

    /// The `now` of the current (or last) iteration.
    pub fn now_ns(&self) -> u64 {
        self.now_ns
    }

    /// Whether this thread runs on an event-driven reactor (every active
    /// poller needs an fd there).
    pub fn is_event_driven(&self) -> bool {
        self.event_driven
    }

    /// Ask the reactor to destroy this thread after the current iteration:
    /// its pollers are unregistered (their closures, and the fds they own,
    /// dropped) and messages still queued are dropped.
    pub fn exit(&mut self) {
        self.exit_requested = true;
    }

    pub fn exit_requested(&self) -> bool {
        self.exit_requested
    }

    pub(crate) fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    pub(crate) fn set_reactor(&mut self, index: usize) {
        self.shared
            .counters
            .reactor
            .store(index as u64, Ordering::Relaxed);
    }

    /// Register a poller. `fds` name the file descriptors that signal its
    /// work; an active poller without one is refused on an event-driven
    /// reactor, where it could never run without a hidden spin.
    ///
    /// Unregister a poller before closing its fds: the epoll set holds the
    /// fd numbers.
    pub fn register_poller(
        &mut self,
        name: &str,
        kind: PollerKind,
        fds: &[(RawFd, Interest)],
        f: PollFn,
    ) -> Result<PollerId, ReactorError> {
        if self.event_driven && kind == PollerKind::Active && fds.is_empty() {
            return Err(ReactorError::NoEventSource(name.to_string()));
        }
        if self.live_pollers() >= MAX_POLLERS_PER_THREAD {
            return Err(ReactorError::TooManyPollers(self.name().to_string()));
        }
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.pollers.push(PollerSlot {
                    generation: 0,
                    entry: None,
                });
                (self.pollers.len() - 1) as u32
            }
        };
        let id = PollerId {
            index,
            generation: self.pollers[index as usize].generation,
        };
        for (n, &(fd, interest)) in fds.iter().enumerate() {
            if let Err(e) = self.epoll.add(fd, interest, id.token()) {
                for &(fd, _) in &fds[..n] {
                    let _ = self.epoll.delete(fd);
                }
                self.free.push(index);
                return Err(ReactorError::Sys(e));
            }
        }
        let next_ns = match kind {
            PollerKind::Active => 0,
            PollerKind::Timed { period_ns } => self.now_ns.saturating_add(period_ns),
        };
        self.pollers[index as usize].entry = Some(PollerEntry {
            name: name.to_string(),
            kind,
            next_ns,
            paused: false,
            woken: false,
            fds: fds.to_vec(),
            initiator: false,
            gap: SpinWindow::default(),
            f: Some(f),
        });
        self.publish_poller_counts();
        Ok(id)
    }

    fn entry_mut(&mut self, id: PollerId) -> Option<&mut PollerEntry> {
        let slot = self.pollers.get_mut(id.index as usize)?;
        if slot.generation != id.generation {
            return None;
        }
        slot.entry.as_mut()
    }

    fn live_pollers(&self) -> usize {
        self.pollers.len() - self.free.len()
    }

    /// Unregister a poller (its own callback may do this). Its closure is
    /// dropped now, or right after it returns if it is running. Returns
    /// whether the poller existed.
    pub fn unregister_poller(&mut self, id: PollerId) -> bool {
        let Some(slot) = self.pollers.get_mut(id.index as usize) else {
            return false;
        };
        if slot.generation != id.generation || slot.entry.is_none() {
            return false;
        }
        let entry = slot.entry.take();
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(id.index);
        if let Some(entry) = entry {
            for (fd, _) in &entry.fds {
                let _ = self.epoll.delete(*fd);
            }
            if entry.woken {
                self.woken -= 1;
            }
        }
        self.publish_poller_counts();
        true
    }

    /// The poller now running, for a callback that needs its own id (to wake
    /// itself, change its interest or unregister itself).
    pub fn current_poller(&self) -> Option<PollerId> {
        self.current
    }

    /// Stop running a poller until `resume_poller`.
    pub fn pause_poller(&mut self, id: PollerId) -> bool {
        let Some(e) = self.entry_mut(id) else {
            return false;
        };
        e.paused = true;
        self.publish_poller_counts();
        true
    }

    /// Resume a paused poller. A timed poller's next run is a full period
    /// from now, as in SPDK.
    pub fn resume_poller(&mut self, id: PollerId) -> bool {
        let now = self.now_ns;
        let Some(e) = self.entry_mut(id) else {
            return false;
        };
        e.paused = false;
        if let PollerKind::Timed { period_ns } = e.kind {
            e.next_ns = now.saturating_add(period_ns);
        }
        self.publish_poller_counts();
        true
    }

    /// Run an active poller in the next iteration even if none of its fds is
    /// ready: for work a poller left in user space (a bounded batch, a
    /// completion that needs no fd).
    pub fn wake_poller(&mut self, id: PollerId) -> bool {
        let Some(e) = self.entry_mut(id) else {
            return false;
        };
        if e.woken {
            return true;
        }
        e.woken = true;
        self.woken += 1;
        true
    }

    /// Change what a poller waits for on one of its fds (e.g. add writable
    /// while output is queued).
    pub fn set_interest(
        &mut self,
        id: PollerId,
        fd: RawFd,
        interest: Interest,
    ) -> Result<(), ReactorError> {
        let token = id.token();
        let hybrid = self.initiator_period_ns.is_some();
        let Some(e) = self.entry_mut(id) else {
            return Err(ReactorError::NoSuchPoller);
        };
        let initiator = e.initiator;
        let Some(slot) = e.fds.iter_mut().find(|(f, _)| *f == fd) else {
            return Err(ReactorError::NoSuchPoller);
        };
        if slot.1 == interest {
            return Ok(());
        }
        slot.1 = interest;
        // In hybrid mode an initiator's fds stay silent; the interest is
        // remembered for when the mode changes.
        let effective = if initiator && hybrid {
            Interest::NONE
        } else {
            interest
        };
        self.epoll
            .modify(fd, effective, token)
            .map_err(ReactorError::Sys)
    }

    /// Add another fd that signals this poller's work.
    pub fn add_poller_fd(
        &mut self,
        id: PollerId,
        fd: RawFd,
        interest: Interest,
    ) -> Result<(), ReactorError> {
        let token = id.token();
        if self.entry_mut(id).is_none() {
            return Err(ReactorError::NoSuchPoller);
        }
        self.epoll
            .add(fd, interest, token)
            .map_err(ReactorError::Sys)?;
        if let Some(e) = self.entry_mut(id) {
            e.fds.push((fd, interest));
        }
        Ok(())
    }

    /// Spawn a lull thread on reactor `reactor` of this thread's framework.
    pub fn spawn_thread(
        &self,
        reactor: usize,
        name: &str,
        init: impl FnOnce(&mut Thread) + Send + 'static,
    ) -> Result<ThreadHandle, ReactorError> {
        match &self.framework {
            Some(fw) => fw.spawn_thread(reactor, name, init),
            None => Err(ReactorError::Detached),
        }
    }

    /// Whether the next iteration has work without any fd becoming ready:
    /// queued messages, woken pollers or a due timed poller.
    pub fn has_immediate_work(&self, now: u64) -> bool {
        !self.shared.mailbox.is_empty()
            || self.woken > 0
            || self.next_deadline().is_some_and(|d| d <= now)
    }

    fn next_deadline(&self) -> Option<u64> {
        let timed = self
            .pollers
            .iter()
            .filter_map(|s| s.entry.as_ref())
            .filter(|e| !e.paused && matches!(e.kind, PollerKind::Timed { .. }))
            .map(|e| e.next_ns)
            .min();
        let initiator = self
            .initiator_period_ns
            .filter(|_| self.has_initiators())
            .map(|_| self.next_initiator_ns);
        match (timed, initiator) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn has_initiators(&self) -> bool {
        self.pollers
            .iter()
            .filter_map(|s| s.entry.as_ref())
            .any(|e| e.initiator && !e.paused)
    }

    /// Mark a poller as an initiator-side event source (a connection to a
    /// replica). In hybrid mode such pollers are not woken by their fds but
    /// drained every `nvme_ioq_poll_period_us`, as Longhorn's V2 engine does.
    pub fn mark_initiator(&mut self, id: PollerId) -> Result<(), ReactorError> {
        let hybrid = self.initiator_period_ns.is_some();
        let token = id.token();
        let Some(e) = self.entry_mut(id) else {
            return Err(ReactorError::NoSuchPoller);
        };
        e.initiator = true;
        let fds = e.fds.clone();
        if hybrid {
            for (fd, _) in fds {
                self.epoll
                    .modify(fd, Interest::NONE, token)
                    .map_err(ReactorError::Sys)?;
            }
        }
        Ok(())
    }

    /// Enter or leave hybrid mode: initiator pollers stop (or resume)
    /// waking the thread through their fds.
    pub(crate) fn set_initiator_period(&mut self, period_ns: Option<u64>) {
        if self.initiator_period_ns == period_ns {
            return;
        }
        let was_hybrid = self.initiator_period_ns.is_some();
        self.initiator_period_ns = period_ns;
        self.next_initiator_ns = self.now_ns;
        if was_hybrid == period_ns.is_some() {
            return;
        }
        for (index, slot) in self.pollers.iter().enumerate() {
            let Some(e) = slot.entry.as_ref() else {
                continue;
            };
            if !e.initiator {
                continue;
            }
            let token = PollerId {
                index: index as u32,
                generation: slot.generation,
            }
            .token();
            for &(fd, interest) in &e.fds {
                let want = if period_ns.is_some() {
                    Interest::NONE
                } else {
                    interest
                };
                if let Err(err) = self.epoll.modify(fd, want, token) {
                    tracing::error!(thread = %self.shared.name, fd, error = %err, "cannot change initiator fd interest");
                }
            }
        }
    }

    pub(crate) fn set_spin_cap(&mut self, cap_ns: u64) {
        self.spin_cap_ns = cap_ns;
    }

    /// How long the adaptive mode should spin before sleeping, for this
    /// thread: the longest window of any of its event sources (see
    /// [`SpinWindow`]), at most `cap_ns`. A timed poller due within the cap
    /// counts too: spinning until it is cheaper than a timer wake-up.
    pub fn spin_window_ns(&self, now: u64, cap_ns: u64) -> u64 {
        let mut window = self.mailbox_window.window_ns().min(cap_ns);
        for e in self.pollers.iter().filter_map(|s| s.entry.as_ref()) {
            if e.paused {
                continue;
            }
            match e.kind {
                PollerKind::Active => {
                    if e.initiator && self.initiator_period_ns.is_some() {
                        continue;
                    }
                    window = window.max(e.gap.window_ns().min(cap_ns));
                }
                PollerKind::Timed { .. } => {
                    let due = e.next_ns.saturating_sub(now);
                    if due <= cap_ns {
                        window = window.max(due);
                    }
                }
            }
        }
        window
    }

    /// Whether some active poller has a spin window (the adaptive spin
    /// polls it directly).
    pub fn has_hot_pollers(&self) -> bool {
        self.pollers
            .iter()
            .filter_map(|s| s.entry.as_ref())
            .any(|e| e.kind == PollerKind::Active && !e.paused && e.gap.window_ns() > 0)
    }

    /// Active pollers that have no fd (they make event-driven mode impossible).
    pub(crate) fn pollers_without_event_source(&self) -> Vec<String> {
        self.pollers
            .iter()
            .filter_map(|s| s.entry.as_ref())
            .filter(|e| e.kind == PollerKind::Active && e.fds.is_empty())
            .map(|e| e.name.clone())
            .collect()
    }

    pub(crate) fn set_event_driven(&mut self, on: bool) {
        self.event_driven = on;
    }

    /// Prepare to sleep: ask senders to ring, and arm the timerfd for the
    /// earliest timed poller. Returns false when work arrived meanwhile.
    pub(crate) fn prepare_sleep(&mut self, now: u64) -> bool {
        self.shared.mailbox.arm();
        if self.has_immediate_work(now) {
            self.shared.mailbox.disarm();
            return false;
        }
        let deadline = self.next_deadline();
        if deadline != self.timer_armed_ns {
            // `arm(0)` disarms; a deadline in the past was caught above.
            let delay = deadline.map_or(0, |d| d.saturating_sub(now).max(1));
            if self.timer.arm(delay).is_ok() {
                self.timer_armed_ns = deadline;
            }
        }
        true
    }

    pub(crate) fn finish_sleep(&mut self, woke: bool) {
        self.shared.mailbox.disarm();
        if woke {
            self.wakeups += 1;
        }
    }

    /// The reactor woke from a sleep at `now`: events seen from here on were
    /// not caught by spinning.
    pub(crate) fn note_wake(&mut self, now: u64) {
        self.last_wake_ns = now;
    }

    /// One iteration: up to `MSG_BATCH` messages, then the active pollers in
    /// `scope`, then the due timed pollers. `now` drives every decision;
    /// `clock` is read once at the end to account the iteration as busy or
    /// idle.
    pub fn poll(&mut self, now: u64, scope: Scope, clock: &dyn Clock) -> PollStatus {
        let status = self.run_iteration(now, scope);
        let end = clock.now_ns();
        self.account(status, end.saturating_sub(now));
        status
    }

    fn run_iteration(&mut self, now: u64, scope: Scope) -> PollStatus {
        self.now_ns = now;
        let mut status = PollStatus::Idle;

        for i in 0..MSG_BATCH {
            let Some(msg) = self.shared.mailbox.pop() else {
                break;
            };
            if i == 0 {
                let slept = self.last_wake_ns > self.mailbox_window.last_busy_ns();
                self.mailbox_window.event(now, slept, self.spin_cap_ns);
                self.mailbox_window.busy(now);
            }
            msg(self);
            self.messages += 1;
            status = PollStatus::Busy;
        }

        if matches!(scope, Scope::Ready | Scope::Spin { epoll: true }) {
            self.collect_ready();
        }
        let hot = matches!(scope, Scope::Spin { .. });
        let initiators_due = scope != Scope::All
            && self.initiator_period_ns.is_some()
            && self.next_initiator_ns <= now;
        if initiators_due {
            self.next_initiator_ns = now.saturating_add(self.initiator_period_ns.unwrap_or(0));
        }
        for index in 0..self.pollers.len() {
            let run = match &mut self.pollers[index].entry {
                Some(e) if e.kind == PollerKind::Active && !e.paused => {
                    let run = scope == Scope::All
                        || e.woken
                        || (initiators_due && e.initiator)
                        || (hot
                            && e.gap.window_ns() > 0
                            && !(e.initiator && self.initiator_period_ns.is_some()));
                    if e.woken {
                        e.woken = false;
                        self.woken -= 1;
                    }
                    run
                }
                _ => false,
            };
            if run {
                status = status.or(self.run_poller(index, now));
            }
        }

        for index in 0..self.pollers.len() {
            let due = match &mut self.pollers[index].entry {
                Some(e) if !e.paused => match e.kind {
                    PollerKind::Timed { period_ns } if e.next_ns <= now => {
                        e.next_ns = now.saturating_add(period_ns);
                        true
                    }
                    _ => false,
                },
                _ => false,
            };
            if due {
                status = status.or(self.run_poller(index, now));
            }
        }
        status
    }

    /// Mark the pollers whose fds are ready as woken, and reset the doorbell
    /// and timer fds.
    fn collect_ready(&mut self) {
        let n = self.epoll.wait(&mut self.events, 0).unwrap_or(0);
        for i in 0..n {
            let token = self.events[i].u64;
            match token {
                TOKEN_DOORBELL => self.shared.mailbox.drain_doorbell(),
                TOKEN_TIMER => {
                    self.timer.drain();
                    self.timer_armed_ns = None;
                }
                _ => {
                    self.wake_poller(PollerId::from_token(token));
                }
            }
        }
    }

    fn run_poller(&mut self, index: usize, now: u64) -> PollStatus {
        let slot = &mut self.pollers[index];
        let generation = slot.generation;
        let Some(mut f) = slot.entry.as_mut().and_then(|e| e.f.take()) else {
            return PollStatus::Idle;
        };
        let previous = self.current.replace(PollerId {
            index: index as u32,
            generation,
        });
        let status = f(self, now);
        self.current = previous;
        if status.is_busy() {
            // Work found is the source's next event: learn the gap since
            // its last work, and whether a sleep came in between.
            let (cap, last_wake) = (self.spin_cap_ns, self.last_wake_ns);
            if let Some(e) = self
                .pollers
                .get_mut(index)
                .filter(|s| s.generation == generation)
                .and_then(|s| s.entry.as_mut())
            {
                let slept = last_wake > e.gap.last_busy_ns();
                e.gap.event(now, slept, cap);
                e.gap.busy(now);
            }
        }
        // The poller may have unregistered itself (and its slot been reused).
        if let Some(slot) = self.pollers.get_mut(index) {
            if slot.generation == generation {
                if let Some(e) = slot.entry.as_mut() {
                    e.f = Some(f);
                }
            }
        }
        status
    }

    pub(crate) fn account(&mut self, status: PollStatus, elapsed_ns: u64) {
        match status {
            PollStatus::Busy => self.busy_ns += elapsed_ns,
            PollStatus::Idle => self.idle_ns += elapsed_ns,
        }
        self.iterations += 1;
        let c = &self.shared.counters;
        c.busy_ns.store(self.busy_ns, Ordering::Relaxed);
        c.idle_ns.store(self.idle_ns, Ordering::Relaxed);
        c.iterations.store(self.iterations, Ordering::Relaxed);
        c.wakeups.store(self.wakeups, Ordering::Relaxed);
        c.messages.store(self.messages, Ordering::Relaxed);
    }

    fn publish_poller_counts(&self) {
        let (mut active, mut timed, mut paused) = (0, 0, 0);
        for e in self.pollers.iter().filter_map(|s| s.entry.as_ref()) {
            if e.paused {
                paused += 1;
            } else if e.kind == PollerKind::Active {
                active += 1;
            } else {
                timed += 1;
            }
        }
        let c = &self.shared.counters;
        c.pollers_active.store(active, Ordering::Relaxed);
        c.pollers_timed.store(timed, Ordering::Relaxed);
        c.pollers_paused.store(paused, Ordering::Relaxed);
    }

    /// Tear down: run nothing more, drop every poller and queued message.
    pub(crate) fn destroy(&mut self) -> usize {
        self.shared.exited.store(true, Ordering::Release);
        let ids: Vec<PollerId> = self
            .pollers
            .iter()
            .enumerate()
            .filter(|(_, s)| s.entry.is_some())
            .map(|(i, s)| PollerId {
                index: i as u32,
                generation: s.generation,
            })
            .collect();
        for id in ids {
            self.unregister_poller(id);
        }
        let mut dropped = 0;
        while self.shared.mailbox.pop().is_some() {
            dropped += 1;
        }
        dropped
    }

    /// Run queued messages (at most `limit`) before a shutdown.
    pub(crate) fn drain_messages(&mut self, limit: usize) -> usize {
        let mut n = 0;
        while n < limit {
            let Some(msg) = self.shared.mailbox.pop() else {
                break;
            };
            msg(self);
            n += 1;
        }
        self.messages += n as u64;
        n
    }

    pub(crate) fn pending_messages(&self) -> usize {
        self.shared.mailbox.len()
    }

    /// Check the internal bookkeeping (debug builds and tests).
    pub fn check_invariants(&self) {
        let woken = self
            .pollers
            .iter()
            .filter_map(|s| s.entry.as_ref())
            .filter(|e| e.woken)
            .count();
        assert_eq!(woken, self.woken, "woken count");
        let free: HashSet<u32> = self.free.iter().copied().collect();
        assert_eq!(free.len(), self.free.len(), "free list has duplicates");
        for (i, s) in self.pollers.iter().enumerate() {
            assert_eq!(
                s.entry.is_none(),
                free.contains(&(i as u32)),
                "slot {i} free-list mismatch"
            );
        }
    }
}

impl Drop for Thread {
    fn drop(&mut self) {
        self.destroy();
    }
}
