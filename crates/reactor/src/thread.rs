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

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;

use crate::clock::Clock;
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

/// Pollers one thread may own. A poll group holds two per connection (the
/// connection and, until the greeting is done, its deadline), and serves
/// up to a few thousand connections; an iteration costs only the pollers
/// with work, so the bound is about memory (~150 bytes a poller) and about
/// catching a registration leak.
pub const MAX_POLLERS_PER_THREAD: usize = 32_768;

/// Epoll events taken per `epoll_wait` of a thread's own set: the sources
/// served in one iteration. More stay ready (epoll is level-triggered)
/// and are served next iteration, so a burst of connections cannot hold
/// the reactor for long.
const THREAD_EVENT_BATCH: usize = 128;

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
    /// Only when woken ([`Thread::wake_poller`], or from another thread
    /// [`ThreadHandle::wake_poller`]), in every mode: for work that other
    /// threads leave in a shared queue and announce, with no fd of its own
    /// and no closure to allocate per announcement.
    Woken,
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

/// What a thread's mailbox carries: a message, or a wake-up of one of its
/// pollers (which needs no box, so announcing work allocates nothing).
pub(crate) enum Letter {
    Run(Message),
    Wake(PollerId),
}

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
        // `ArrayQueue::pop` on an empty queue ends in a SeqCst fence (an
        // `mfence` on x86, tens of cycles), and the reactor asks every
        // iteration, mostly of an empty queue; `is_empty` is two plain
        // loads. A push it misses is seen on the next look, as one that
        // lands just after `pop` would be.
        if self.queue.is_empty() {
            return None;
        }
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
    pub ready_events: AtomicU64,
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
    /// Fds its epoll set reported ready (sources with work), in total.
    pub ready_events: u64,
    /// Never moved by the scheduler.
    pub pinned: bool,
}

pub(crate) struct ThreadShared {
    pub id: u64,
    pub name: String,
    pub mailbox: Mailbox<Letter>,
    pub counters: ThreadCounters,
    pub exited: AtomicBool,
    pub pinned: AtomicBool,
    /// The poller running now (its slot index + 1; 0: none), for the
    /// framework's stall report, read from another OS thread.
    pub running_poller: AtomicU64,
    /// Every live poller's name by slot index: a copy the stall report can
    /// read (the pollers themselves belong to the reactor running the
    /// thread). Changed at registration, never per run.
    pub poller_names: std::sync::Mutex<std::collections::HashMap<u32, String>>,
}

impl ThreadShared {
    /// The name of the poller running now, if one is.
    pub(crate) fn running_poller_name(&self) -> Option<String> {
        let index = self.running_poller.load(Ordering::Relaxed).checked_sub(1)?;
        self.poller_names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&(index as u32))
            .cloned()
    }
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
        match self.shared.mailbox.push(Letter::Run(msg)) {
            Ok(()) => Ok(()),
            Err(Letter::Run(m)) => Err((m, SendError::Full(self.shared.name.clone()))),
            Err(Letter::Wake(_)) => unreachable!("pushed a message"),
        }
    }

    /// Run poller `id` of the thread in its next iteration, as
    /// [`Thread::wake_poller`] does from the thread itself. Through the
    /// mailbox, in order with messages, and with no allocation: for
    /// announcing work left in a queue the poller drains (a
    /// [`PollerKind::Woken`] poller). A stale id wakes nothing.
    pub fn wake_poller(&self, id: PollerId) -> Result<(), SendError> {
        if self.shared.exited.load(Ordering::Acquire) {
            return Err(SendError::Exited(self.shared.name.clone()));
        }
        self.shared
            .mailbox
            .push(Letter::Wake(id))
            .map_err(|_| SendError::Full(self.shared.name.clone()))
    }

    pub fn send_boxed(&self, msg: Message) -> Result<(), SendError> {
        self.try_send_boxed(msg).map_err(|(_, e)| e)
    }

    pub fn has_exited(&self) -> bool {
        self.shared.exited.load(Ordering::Acquire)
    }

    /// Keep the thread on its reactor: the scheduler never moves a pinned
    /// thread (SPDK: a thread whose cpumask holds one core).
    pub fn set_pinned(&self, pinned: bool) {
        self.shared.pinned.store(pinned, Ordering::Relaxed);
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
            ready_events: r(&c.ready_events),
            pinned: self.shared.pinned.load(Ordering::Relaxed),
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
    /// A timed poller's entry in the timer heap (heap items with another
    /// sequence number are stale).
    timer_seq: u64,
    /// An untimed poller with a one-shot wake-up in the timer heap
    /// ([`Thread::wake_poller_at`]).
    deadline: bool,
    /// `None` while the poller runs (it is out of its slot) .
    f: Option<PollFn>,
}

struct PollerSlot {
    generation: u32,
    entry: Option<PollerEntry>,
}

/// What a thread asks of the framework that runs it (the reactor module's
/// `FrameworkHandle` implements it): a trait here, so that this module
/// does not depend on the reactor's, which depends on it.
pub(crate) trait Host: Send + Sync {
    fn spawn(
        &self,
        reactor: usize,
        name: &str,
        init: Message,
    ) -> Result<ThreadHandle, ReactorError>;
}

/// A poller between two threads ([`Thread::detach_poller`]); dropping it
/// drops its closure (and what the closure owns).
pub struct DetachedPoller {
    name: String,
    kind: PollerKind,
    fds: Vec<(RawFd, Interest)>,
    f: PollFn,
}

impl std::fmt::Debug for DetachedPoller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DetachedPoller({})", self.name)
    }
}

/// Which pollers an iteration runs. In both, a poller with fds runs only
/// when one of its fds is ready or it was woken: the cost of an iteration
/// is the sources with work, not the sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Poll mode: also every active poller without an fd, every iteration.
    All,
    /// Event-driven modes: only pollers whose fd is ready or that were woken.
    Ready,
}

/// A timed poller's place in the heap: due time, sequence number, slot.
type TimerItem = Reverse<(u64, u64, u32)>;

/// A lull thread. Pollers and messages receive `&mut Thread` to register,
/// pause, resume and unregister pollers (their own included), wake pollers,
/// spawn threads and send messages.
pub struct Thread {
    shared: Arc<ThreadShared>,
    host: Option<Arc<dyn Host>>,
    pollers: Vec<PollerSlot>,
    free: Vec<u32>,
    epoll: Epoll,
    timer: TimerFd,
    timer_armed_ns: Option<u64>,
    events: Vec<libc::epoll_event>,
    /// Pollers with `woken` set (and possibly stale ids: each is checked
    /// when its turn comes); `woken` counts the set flags.
    woken_list: Vec<PollerId>,
    woken: usize,
    /// Active pollers without an fd, run every iteration in poll mode.
    fdless: Vec<PollerId>,
    /// Initiator pollers, drained on a period in hybrid mode.
    initiators: Vec<PollerId>,
    /// Timed pollers by due time (SPDK keeps an RB tree and caches its
    /// first element; a heap with lazy deletion does the same job).
    timers: BinaryHeap<TimerItem>,
    next_timer_seq: u64,
    /// Reused lists, so an iteration does not allocate.
    scratch_ids: Vec<PollerId>,
    scratch_due: Vec<TimerItem>,
    n_active: u64,
    n_timed: u64,
    /// Untimed pollers with a wake-up armed in the timer heap.
    n_deadlines: u64,
    n_paused: u64,
    ready_events: u64,
    current: Option<PollerId>,
    event_driven: bool,
    /// Hybrid mode: initiator pollers run every this many ns.
    initiator_period_ns: Option<u64>,
    next_initiator_ns: u64,
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
            pinned: AtomicBool::new(false),
            running_poller: AtomicU64::new(0),
            poller_names: std::sync::Mutex::new(std::collections::HashMap::new()),
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
            host: None,
            pollers: Vec::new(),
            free: Vec::new(),
            epoll,
            timer,
            timer_armed_ns: None,
            events: event_buffer(THREAD_EVENT_BATCH),
            woken_list: Vec::new(),
            woken: 0,
            fdless: Vec::new(),
            initiators: Vec::new(),
            timers: BinaryHeap::new(),
            next_timer_seq: 0,
            scratch_ids: Vec::new(),
            scratch_due: Vec::new(),
            n_active: 0,
            n_timed: 0,
            n_deadlines: 0,
            n_paused: 0,
            ready_events: 0,
            current: None,
            event_driven: false,
            initiator_period_ns: None,
            next_initiator_ns: 0,
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

    /// Join the framework that runs it (a detached test thread has none).
    pub(crate) fn attach(&mut self, host: Arc<dyn Host>) {
        self.host = Some(host);
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
            PollerKind::Active | PollerKind::Woken => 0,
            PollerKind::Timed { period_ns } => self.now_ns.saturating_add(period_ns),
        };
        self.shared
            .poller_names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(index, name.to_string());
        self.pollers[index as usize].entry = Some(PollerEntry {
            name: name.to_string(),
            kind,
            next_ns,
            paused: false,
            woken: false,
            fds: fds.to_vec(),
            initiator: false,
            timer_seq: 0,
            deadline: false,
            f: Some(f),
        });
        match kind {
            PollerKind::Active => {
                self.n_active += 1;
                if fds.is_empty() {
                    self.fdless.push(id);
                }
            }
            PollerKind::Woken => self.n_active += 1,
            PollerKind::Timed { .. } => {
                self.n_timed += 1;
                self.schedule_timer(id, next_ns);
            }
        }
        self.publish_poller_counts();
        Ok(id)
    }

    /// (Re)place a timed poller in the heap, due at `due_ns`.
    fn schedule_timer(&mut self, id: PollerId, due_ns: u64) {
        let seq = self.next_timer_seq;
        self.next_timer_seq += 1;
        if let Some(e) = self.entry_mut(id) {
            e.next_ns = due_ns;
            e.timer_seq = seq;
            self.timers.push(Reverse((due_ns, seq, id.index)));
        }
    }

    /// Whether a heap item still stands for a live, unpaused timed poller.
    fn timer_item_live(&self, item: &TimerItem) -> bool {
        let Reverse((_, seq, index)) = *item;
        self.pollers
            .get(index as usize)
            .and_then(|s| s.entry.as_ref())
            .is_some_and(|e| !e.paused && e.timer_seq == seq)
    }

    /// Drop stale items from the top of the heap, so that its first item is
    /// the next due timer (SPDK's cached `first_timed_poller`).
    fn prune_timers(&mut self) {
        while let Some(top) = self.timers.peek() {
            if self.timer_item_live(top) {
                break;
            }
            self.timers.pop();
        }
        // Stale items deeper in the heap are dropped as they surface; if
        // churn lets them pile up, rebuild from the live ones.
        if self.timers.len() > 2 * (self.n_timed + self.n_deadlines) as usize + 64 {
            let items = std::mem::take(&mut self.timers).into_vec();
            let live = items.into_iter().filter(|i| self.timer_item_live(i));
            self.timers = live.collect();
        }
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
        self.shared
            .poller_names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id.index);
        if let Some(entry) = entry {
            for (fd, _) in &entry.fds {
                let _ = self.epoll.delete(*fd);
            }
            if entry.woken {
                self.woken -= 1;
            }
            if entry.deadline {
                self.n_deadlines -= 1;
            }
            if entry.paused {
                self.n_paused -= 1;
            } else if matches!(entry.kind, PollerKind::Timed { .. }) {
                self.n_timed -= 1;
            } else {
                self.n_active -= 1;
            }
            if entry.kind == PollerKind::Active && entry.fds.is_empty() {
                self.fdless.retain(|&p| p != id);
            }
            if entry.initiator {
                self.initiators.retain(|&p| p != id);
            }
            if matches!(entry.kind, PollerKind::Timed { .. }) {
                self.prune_timers();
            }
        }
        if self.woken == 0 {
            self.woken_list.clear();
        }
        self.publish_poller_counts();
        true
    }

    /// Take a poller out of this thread, with its closure and its fds'
    /// registrations, to [`Thread::attach_poller`] it to another (a
    /// connection moving between poll groups). Not while it runs, is
    /// paused or is an initiator: `None` then (and for a stale id).
    pub fn detach_poller(&mut self, id: PollerId) -> Option<DetachedPoller> {
        let e = self.entry_mut(id)?;
        if e.f.is_none() || e.paused || e.initiator {
            return None;
        }
        let f = e.f.take()?;
        let detached = DetachedPoller {
            name: std::mem::take(&mut e.name),
            kind: e.kind,
            fds: e.fds.clone(),
            f,
        };
        self.unregister_poller(id);
        Some(detached)
    }

    /// Whether `id` names a live poller of this thread.
    pub fn has_poller(&self, id: PollerId) -> bool {
        self.pollers
            .get(id.index as usize)
            .is_some_and(|s| s.generation == id.generation && s.entry.is_some())
    }

    /// Register a poller taken from another thread; it runs at once (work
    /// may have arrived while it moved).
    pub fn attach_poller(&mut self, p: DetachedPoller) -> Result<PollerId, ReactorError> {
        let id = self.register_poller(&p.name, p.kind, &p.fds, p.f)?;
        self.wake_poller(id);
        Ok(id)
    }

    /// The poller now running, for a callback that needs its own id (to wake
    /// itself, change its interest or unregister itself).
    pub fn current_poller(&self) -> Option<PollerId> {
        self.current
    }

    /// Stop running a poller until `resume_poller`. A wake-up it had is
    /// dropped (resuming runs it once).
    pub fn pause_poller(&mut self, id: PollerId) -> bool {
        let Some(e) = self.entry_mut(id) else {
            return false;
        };
        if e.paused {
            return true;
        }
        e.paused = true;
        let (kind, woken) = (e.kind, std::mem::take(&mut e.woken));
        // A one-shot wake-up goes (its heap item is stale from now on); a
        // resumed poller runs at once anyway.
        if std::mem::take(&mut e.deadline) {
            self.n_deadlines -= 1;
        }
        if woken {
            self.woken -= 1;
        }
        // Its fds stop waking the thread: a ready fd nobody reads would
        // otherwise keep an event-driven reactor from sleeping.
        self.apply_interest(id);
        if matches!(kind, PollerKind::Timed { .. }) {
            self.n_timed -= 1;
            self.prune_timers();
        } else {
            self.n_active -= 1;
        }
        self.n_paused += 1;
        self.publish_poller_counts();
        true
    }

    /// Resume a paused poller: an active one with fds runs in the next
    /// iteration (it may have missed events while paused); a timed one a full period from
    /// now, as in SPDK.
    pub fn resume_poller(&mut self, id: PollerId) -> bool {
        let now = self.now_ns;
        let Some(e) = self.entry_mut(id) else {
            return false;
        };
        if !e.paused {
            return true;
        }
        e.paused = false;
        let (kind, fdless) = (e.kind, e.fds.is_empty());
        self.n_paused -= 1;
        self.apply_interest(id);
        match kind {
            PollerKind::Active => {
                self.n_active += 1;
                // One without an fd runs every poll-mode iteration anyway.
                if !fdless {
                    self.wake_poller(id);
                }
            }
            // Wake-ups that came while it was paused were dropped.
            PollerKind::Woken => {
                self.n_active += 1;
                self.wake_poller(id);
            }
            PollerKind::Timed { period_ns } => {
                self.n_timed += 1;
                self.schedule_timer(id, now.saturating_add(period_ns));
            }
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
        if e.woken || e.paused {
            return true;
        }
        e.woken = true;
        self.woken += 1;
        self.woken_list.push(id);
        true
    }

    /// Run an untimed poller once at `due_ns` (the thread's clock) even if
    /// none of its fds is ready: a connection held by a rate limit waits
    /// for the time its tokens come back, not for an fd and not spinning.
    /// One wake-up per poller: an earlier one armed already stays; a later
    /// one replaces nothing. False for a stale id or a timed poller (it
    /// runs on its period anyway).
    pub fn wake_poller_at(&mut self, id: PollerId, due_ns: u64) -> bool {
        let Some(e) = self.entry_mut(id) else {
            return false;
        };
        if matches!(e.kind, PollerKind::Timed { .. }) {
            return false;
        }
        if e.deadline && e.next_ns <= due_ns {
            return true;
        }
        if !e.deadline {
            e.deadline = true;
            self.n_deadlines += 1;
        }
        self.schedule_timer(id, due_ns);
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
        let (initiator, paused) = (e.initiator, e.paused);
        let Some(slot) = e.fds.iter_mut().find(|(f, _)| *f == fd) else {
            return Err(ReactorError::NoSuchPoller);
        };
        if slot.1 == interest {
            return Ok(());
        }
        slot.1 = interest;
        // In hybrid mode an initiator's fds stay silent, and a paused
        // poller's; the interest is remembered for later.
        let effective = if (initiator && hybrid) || paused {
            Interest::NONE
        } else {
            interest
        };
        self.epoll
            .modify(fd, effective, token)
            .map_err(ReactorError::Sys)
    }

    /// Set a poller's fds in the epoll set to what they should wait for
    /// now: nothing while paused or (an initiator) in hybrid mode, else
    /// their interest.
    fn apply_interest(&mut self, id: PollerId) {
        let hybrid = self.initiator_period_ns.is_some();
        let Some(e) = self.entry_mut(id) else {
            return;
        };
        let silent = e.paused || (e.initiator && hybrid);
        let fds = e.fds.clone();
        for (fd, interest) in fds {
            let want = if silent { Interest::NONE } else { interest };
            if let Err(err) = self.epoll.modify(fd, want, id.token()) {
                tracing::error!(thread = %self.shared.name, fd, error = %err, "cannot change fd interest");
            }
        }
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
            let was_fdless = e.kind == PollerKind::Active && e.fds.is_empty();
            e.fds.push((fd, interest));
            if was_fdless {
                self.fdless.retain(|&p| p != id);
            }
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
        match &self.host {
            Some(host) => host.spawn(reactor, name, Box::new(init)),
            None => Err(ReactorError::Detached),
        }
    }

    /// Whether the next iteration has work without any fd becoming ready:
    /// queued messages, woken pollers or a due timed poller.
    /// O(1): a queue check, a counter and the first timer.
    pub fn has_immediate_work(&self, now: u64) -> bool {
        !self.shared.mailbox.is_empty()
            || self.woken > 0
            || self.next_deadline().is_some_and(|d| d <= now)
    }

    /// Whether poll mode must run this thread every iteration (it has
    /// active pollers without an fd).
    pub fn has_fdless_pollers(&self) -> bool {
        !self.fdless.is_empty()
    }

    /// The earliest time a timed poller (or hybrid mode's initiator poll)
    /// is due. O(1): the heap's first item (pruned of stale items whenever
    /// a timer is removed).
    pub fn next_deadline(&self) -> Option<u64> {
        let timed = self.timers.peek().map(|Reverse((due, _, _))| *due);
        let initiator = self
            .initiator_period_ns
            .filter(|_| !self.initiators.is_empty())
            .map(|_| self.next_initiator_ns);
        match (timed, initiator) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
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
        if e.initiator {
            return Ok(());
        }
        e.initiator = true;
        let fds = e.fds.clone();
        self.initiators.push(id);
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
                let want = if period_ns.is_some() || e.paused {
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

    /// One iteration: up to `MSG_BATCH` messages, then the active pollers in
    /// `scope`, then the due timed pollers. `now` drives every decision;
    /// `clock` is read once at the end to account the iteration as busy or
    /// idle. The thread's epoll set is asked which fds are ready.
    pub fn poll(&mut self, now: u64, scope: Scope, clock: &dyn Clock) -> PollStatus {
        self.poll_ready(now, scope, true, clock)
    }

    /// `poll`, told whether the thread's epoll set may have ready fds (the
    /// reactor's own epoll said so): when not, no syscall is made for it.
    pub(crate) fn poll_ready(
        &mut self,
        now: u64,
        scope: Scope,
        epoll_ready: bool,
        clock: &dyn Clock,
    ) -> PollStatus {
        self.poll_ready_timed(now, scope, epoll_ready, clock).0
    }

    /// `poll_ready`, also returning the clock read that ended the
    /// iteration: the reactor starts the next thread's iteration (or ends
    /// its own) there instead of reading the clock again.
    pub(crate) fn poll_ready_timed(
        &mut self,
        now: u64,
        scope: Scope,
        epoll_ready: bool,
        clock: &dyn Clock,
    ) -> (PollStatus, u64) {
        let status = self.run_iteration(now, scope, epoll_ready);
        let end = clock.now_ns();
        self.account(status, end.saturating_sub(now));
        (status, end)
    }

    fn run_iteration(&mut self, now: u64, scope: Scope, epoll_ready: bool) -> PollStatus {
        self.now_ns = now;
        let mut status = PollStatus::Idle;

        for _ in 0..MSG_BATCH {
            let Some(letter) = self.shared.mailbox.pop() else {
                break;
            };
            self.open(letter);
            status = PollStatus::Busy;
        }

        if epoll_ready {
            self.collect_ready();
        }

        // Poll mode: the pollers no fd can wake, every iteration.
        if scope == Scope::All && !self.fdless.is_empty() {
            let mut ids = std::mem::take(&mut self.scratch_ids);
            ids.extend_from_slice(&self.fdless);
            status = status.or(self.run_each(&ids, false));
            ids.clear();
            self.scratch_ids = ids;
        }

        // Hybrid mode: initiator sources are drained on a period.
        let initiators_due = self.initiator_period_ns.is_some()
            && !self.initiators.is_empty()
            && self.next_initiator_ns <= now;
        if initiators_due {
            self.next_initiator_ns = now.saturating_add(self.initiator_period_ns.unwrap_or(0));
            // (`wake_poller` leaves paused ones alone.)
            for i in 0..self.initiators.len() {
                let id = self.initiators[i];
                self.wake_poller(id);
            }
        }

        // The woken pollers (by their fds or by `wake_poller`). Those woken
        // while these run go in the next iteration.
        if self.woken > 0 {
            let mut ids =
                std::mem::replace(&mut self.woken_list, std::mem::take(&mut self.scratch_ids));
            status = status.or(self.run_each(&ids, true));
            ids.clear();
            self.scratch_ids = ids;
        } else {
            self.woken_list.clear();
        }

        // The due timed pollers, each once per iteration.
        let mut due = std::mem::take(&mut self.scratch_due);
        while let Some(&top) = self.timers.peek() {
            let Reverse((at, _, _)) = top;
            if at > now {
                break;
            }
            self.timers.pop();
            if self.timer_item_live(&top) {
                due.push(top);
            }
        }
        for &Reverse((_, _, index)) in &due {
            let slot = &self.pollers[index as usize];
            let id = PollerId {
                index,
                generation: slot.generation,
            };
            let Some(kind) = slot.entry.as_ref().map(|e| e.kind) else {
                continue;
            };
            match kind {
                PollerKind::Timed { period_ns } => {
                    self.schedule_timer(id, now.saturating_add(period_ns.max(1)));
                }
                // A one-shot wake-up of an untimed poller.
                _ => {
                    if let Some(e) = self.entry_mut(id) {
                        e.deadline = false;
                    }
                    self.n_deadlines -= 1;
                }
            }
            status = status.or(self.run_poller(id));
        }
        due.clear();
        self.scratch_due = due;
        self.prune_timers();
        status
    }

    /// Run each listed poller that is live and not paused (with
    /// `woken_only`, that is still woken: the list may hold stale ids),
    /// clearing its wake-up.
    fn run_each(&mut self, ids: &[PollerId], woken_only: bool) -> PollStatus {
        let mut status = PollStatus::Idle;
        for &id in ids {
            let runnable = match self.entry_mut(id) {
                Some(e) if !e.paused && (e.woken || !woken_only) => {
                    if std::mem::take(&mut e.woken) {
                        self.woken -= 1;
                    }
                    true
                }
                _ => false,
            };
            if runnable {
                status = status.or(self.run_poller(id));
            }
        }
        status
    }

    /// Mark the pollers whose fds are ready as woken, and reset the doorbell
    /// and timer fds. Returns the number of ready fds. The reactor calls it
    /// directly while it spins on this thread's set (then a ready fd shows
    /// as [`Thread::has_immediate_work`], and the iteration that runs the
    /// pollers makes no second `epoll_wait`).
    pub(crate) fn collect_ready(&mut self) -> usize {
        let n = self.epoll.wait(&mut self.events, 0).unwrap_or(0);
        self.ready_events += n as u64;
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
        n
    }

    fn run_poller(&mut self, id: PollerId) -> PollStatus {
        let now = self.now_ns;
        let Some(mut f) = self.entry_mut(id).and_then(|e| e.f.take()) else {
            return PollStatus::Idle;
        };
        let previous = self.current.replace(id);
        self.shared
            .running_poller
            .store(u64::from(id.index) + 1, Ordering::Relaxed);
        let status = f(self, now);
        self.shared.running_poller.store(
            previous.map_or(0, |p| u64::from(p.index) + 1),
            Ordering::Relaxed,
        );
        self.current = previous;
        // The poller may have unregistered itself (and its slot been reused).
        if let Some(e) = self.entry_mut(id) {
            e.f = Some(f);
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
        c.ready_events.store(self.ready_events, Ordering::Relaxed);
    }

    fn publish_poller_counts(&self) {
        let c = &self.shared.counters;
        c.pollers_active.store(self.n_active, Ordering::Relaxed);
        c.pollers_timed.store(self.n_timed, Ordering::Relaxed);
        c.pollers_paused.store(self.n_paused, Ordering::Relaxed);
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
            let Some(letter) = self.shared.mailbox.pop() else {
                break;
            };
            self.open(letter);
            n += 1;
        }
        n
    }

    /// Act on one letter of the mailbox: run a message (counted), or mark
    /// a poller woken (it runs in this iteration's woken pass).
    fn open(&mut self, letter: Letter) {
        match letter {
            Letter::Run(msg) => {
                msg(self);
                self.messages += 1;
            }
            Letter::Wake(id) => {
                self.wake_poller(id);
            }
        }
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
        for e in self.pollers.iter().filter_map(|s| s.entry.as_ref()) {
            if e.woken {
                assert!(!e.paused, "{}: paused and woken", e.name);
            }
        }
        let deadlines = self
            .pollers
            .iter()
            .filter_map(|s| s.entry.as_ref())
            .filter(|e| e.deadline)
            .count() as u64;
        assert_eq!(deadlines, self.n_deadlines, "armed wake-up count");
        let (mut active, mut timed, mut paused) = (0, 0, 0);
        for (i, e) in self.pollers.iter().enumerate() {
            let Some(e) = e.entry.as_ref() else { continue };
            let id = PollerId {
                index: i as u32,
                generation: self.pollers[i].generation,
            };
            if e.woken {
                assert!(
                    self.woken_list.contains(&id),
                    "{}: woken but not listed",
                    e.name
                );
            }
            if e.kind == PollerKind::Active && e.fds.is_empty() {
                assert!(self.fdless.contains(&id), "{}: fdless not listed", e.name);
            }
            if e.paused {
                paused += 1;
            } else if matches!(e.kind, PollerKind::Active | PollerKind::Woken) {
                active += 1;
            } else {
                timed += 1;
                assert!(
                    self.timers
                        .iter()
                        .any(|Reverse((at, seq, idx))| *idx == id.index
                            && *seq == e.timer_seq
                            && *at == e.next_ns),
                    "{}: timed poller not in the heap",
                    e.name
                );
            }
        }
        assert_eq!(
            (active, timed, paused),
            (self.n_active, self.n_timed, self.n_paused),
            "poller counts"
        );
        if let Some(top) = self.timers.peek() {
            assert!(self.timer_item_live(top), "stale first timer");
        }
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
