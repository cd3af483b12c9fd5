//! The engine's channels: what an NBD or NVMe/TCP connection of a
//! replicated volume submits to (its `Channel`), and how the engine thread
//! hears of it.
//!
//! ```ignore
//! let mut ch = dev.open_channel()?;       // an EngineChannel
//! ch.submit(req)?;                        // into the channel's queue
//! ch.flush_submissions();                 // once per batch: the doorbell
//! // engine thread: on_doorbell → drain_channel → Event::Client per request
//! // ... Action::Complete → complete() → the channel's queue, ring_channels()
//! ch.reap(&mut |c| reply(c));             // after its eventfd rang
//! ```
//!
//! Channel → engine: submissions go into the channel's bounded queue; once
//! per batch (not per request) the channel lists itself in the engine's
//! doorbell and wakes the engine thread's submission poller, which drains
//! the listed channels. A wake-up carries no closure, so submitting
//! allocates nothing (until the poller is registered, a message does it).
//! Engine → channel: completions go into the channel's bounded completion
//! queue, and its eventfd is rung once per batch.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crossbeam_queue::ArrayQueue;
use lull_bdev::{BdevError, Channel, IoCompletion, IoRequest};
use lull_reactor::sys::EventFd;
use lull_reactor::{PollStatus, PollerId, PollerKind, Thread, ThreadHandle};

use super::{lock, Shell};
use crate::core::{ClientReq, Event, CHANNEL_DEPTH, MAX_CHANNELS, MAX_CLIENT_IOS};

/// Entries in the shell's channel table: each open channel
/// (`MAX_CHANNELS`) plus each closed one that still has requests in the
/// engine (every such entry holds at least one of `MAX_CLIENT_IOS`).
/// Closed, drained entries are reclaimed every tick, and at once when the
/// table is full, so the bound is not reached in practice.
pub(super) const CHANNEL_ENTRIES_MAX: usize = MAX_CHANNELS + MAX_CLIENT_IOS;

/// Channels listed in the doorbell at once: each open channel at most once
/// (its `scheduled` flag), plus as many closed ones still listed. A full
/// doorbell falls back to a message, so the bound costs only speed.
const DOORBELL_CHANNELS: usize = 2 * MAX_CHANNELS;

/// How channels tell the engine thread they have submissions: they list
/// themselves in `ready` and wake `poller` (a `PollerKind::Woken` poller on
/// the engine thread, registered when the thread starts).
pub(super) struct Doorbell {
    ready: ArrayQueue<Arc<ChannelShared>>,
    poller: OnceLock<PollerId>,
}

impl Doorbell {
    pub(super) fn new() -> Doorbell {
        Doorbell {
            ready: ArrayQueue::new(DOORBELL_CHANNELS),
            poller: OnceLock::new(),
        }
    }
}

pub(super) struct ChannelShared {
    submissions: ArrayQueue<ClientReq>,
    completions: ArrayQueue<IoCompletion>,
    /// A drain message is on its way to the engine thread.
    scheduled: AtomicBool,
    /// The doorbell: rung (written) by the engine when it pushes
    /// completions, reset by the channel before it pops them. `rung` says
    /// the eventfd was written and not yet reset, so the engine writes it
    /// once per reap at most, and the channel reads it (a syscall) only
    /// when it was written: a spinning reactor reaps without syscalls.
    event: EventFd,
    rung: AtomicBool,
    /// Wire id of the channel's entry in the shell's table (engine thread
    /// only); the core carries it in each request and its completion.
    slot: AtomicU64,
}

/// No entry yet: index `u32::MAX` is beyond any table's capacity, so this
/// is never a wire id.
const NO_SLOT: u64 = u64::MAX;

impl ChannelShared {
    /// After pushing completions: ring the doorbell unless it is already
    /// rung. The engine thread is the one ringer (the channel rings only
    /// itself, from its own thread, when the engine is unreachable).
    ///
    /// Dekker with `unring`: the fence orders the pushes before the load
    /// of `rung`, and `unring` orders its reset before the channel's pops;
    /// so either this load sees the reset and rings, or the channel's pops
    /// see these completions. `rung` is set only after the eventfd write,
    /// so a channel that sees it set always finds the write to reset (a
    /// readable eventfd is never left behind a clear flag, which would
    /// keep an event-driven reactor awake).
    fn ring(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if !self.rung.load(Ordering::Relaxed) {
            self.event.notify();
            self.rung.store(true, Ordering::Release);
        }
    }

    /// Before popping completions: reset the doorbell if it was rung.
    fn unring(&self) {
        if self.rung.load(Ordering::Acquire) {
            self.event.drain();
            self.rung.store(false, Ordering::Relaxed);
            std::sync::atomic::fence(Ordering::SeqCst);
        }
    }
}

/// A frontend connection's channel into the engine thread (an NBD
/// connection's `Channel` for a replicated volume), not a channel to a
/// replica.
pub(super) struct EngineChannel {
    shared: Arc<ChannelShared>,
    engine: ThreadHandle,
    doorbell: Arc<Doorbell>,
    shell: Arc<Mutex<Shell>>,
    in_flight: usize,
    open: Arc<AtomicUsize>,
    /// The owner takes READ data in a pipe ([`Channel::allow_splice`]);
    /// each request says so to the core (`ClientReq::takes_pipe`).
    takes_pipe: bool,
    /// The snapshot `IoOp::ChangedSince` asks about
    /// ([`Channel::set_changed_since`]; `ClientReq::since`).
    since: Option<Arc<str>>,
}

impl EngineChannel {
    /// A channel of the engine on thread `engine`; `open` counts the open
    /// channels (the caller counted this one).
    pub(super) fn new(
        engine: ThreadHandle,
        doorbell: Arc<Doorbell>,
        shell: Arc<Mutex<Shell>>,
        open: Arc<AtomicUsize>,
    ) -> Result<EngineChannel, BdevError> {
        let shared = Arc::new(ChannelShared {
            submissions: ArrayQueue::new(CHANNEL_DEPTH),
            completions: ArrayQueue::new(CHANNEL_DEPTH),
            scheduled: AtomicBool::new(false),
            rung: AtomicBool::new(false),
            event: EventFd::new().map_err(BdevError::Io)?,
            slot: AtomicU64::new(NO_SLOT),
        });
        Ok(EngineChannel {
            shared,
            engine,
            doorbell,
            shell,
            in_flight: 0,
            open,
            takes_pipe: false,
            since: None,
        })
    }

    /// Ask the engine thread to drain this channel with a message: before
    /// its submission poller is registered, or when the doorbell is full.
    fn send_drain(&self) -> Result<(), lull_reactor::SendError> {
        let shared = self.shared.clone();
        let shell = self.shell.clone();
        self.engine.send(move |t: &mut Thread| {
            // Clear first: a submission pushed after the drain starts
            // schedules its own drain.
            shared.scheduled.store(false, Ordering::Release);
            lock(&shell).drain_channel(t, &shared);
        })
    }
}

impl Channel for EngineChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        if self.in_flight >= CHANNEL_DEPTH {
            return Err((
                req,
                BdevError::Full {
                    capacity: CHANNEL_DEPTH,
                },
            ));
        }
        let since = (req.op == lull_bdev::IoOp::ChangedSince)
            .then(|| self.since.clone())
            .flatten();
        match self.shared.submissions.push(ClientReq {
            channel: 0,
            io: req,
            takes_pipe: self.takes_pipe,
            since,
        }) {
            Ok(()) => {
                self.in_flight += 1;
                Ok(())
            }
            Err(c) => Err((
                c.io,
                BdevError::Full {
                    capacity: CHANNEL_DEPTH,
                },
            )),
        }
    }

    fn flush_submissions(&mut self) {
        if self.shared.submissions.is_empty() || self.shared.scheduled.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let sent = match self.doorbell.poller.get() {
            Some(&poller) => match self.doorbell.ready.push(self.shared.clone()) {
                Ok(()) => self.engine.wake_poller(poller),
                Err(_) => self.send_drain(),
            },
            None => self.send_drain(),
        };
        if let Err(e) = sent {
            // The engine thread is gone or flooded: fail what is queued
            // rather than leave it waiting for a message that never comes.
            self.shared.scheduled.store(false, Ordering::Release);
            tracing::error!(error = %e, "cannot reach the volume engine thread");
            while let Some(r) = self.shared.submissions.pop() {
                let err = BdevError::Failed(format!("volume engine unreachable: {e}"));
                let _ = self.shared.completions.push(IoCompletion {
                    tag: r.io.tag,
                    result: Err(err),
                    buf: r.io.buf,
                    data: lull_bdev::Data::Buf,
                });
            }
            self.shared.ring();
        }
    }

    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        // Reset the completion doorbell before popping: a completion pushed
        // after the pops rings again, so none is left behind a quiet
        // eventfd.
        self.shared.unring();
        let mut n = 0;
        while let Some(c) = self.shared.completions.pop() {
            self.in_flight = self.in_flight.saturating_sub(1);
            n += 1;
            done(c);
        }
        n
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.shared.event.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn allow_splice(&mut self) {
        self.takes_pipe = true;
    }

    fn set_changed_since(&mut self, since: &str) {
        self.since = Some(Arc::from(since));
    }
}

impl Drop for EngineChannel {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A channel's entry in the shell's table (`Shell::channels`).
pub(super) struct ChanEntry {
    shared: Arc<ChannelShared>,
    /// Requests of this channel inside the engine.
    in_engine: usize,
    /// Listed in `Shell::to_notify`: its eventfd rings after this batch.
    notify: bool,
}

impl Shell {
    /// Register the poller that drains the channels listed in the doorbell.
    pub(super) fn register_doorbell(&mut self, t: &mut Thread, this: &Arc<Mutex<Shell>>) {
        let shell = this.clone();
        match t.register_poller(
            "engine-submissions",
            PollerKind::Woken,
            &[],
            Box::new(move |t, _now| lock(&shell).on_doorbell(t)),
        ) {
            Ok(id) => {
                let _ = self.doorbell.poller.set(id);
            }
            // Channels keep sending a message per batch.
            Err(e) => {
                tracing::error!(volume = %self.volume, error = %e, "cannot register the engine's submission poller")
            }
        }
    }

    /// Drain every channel listed in the doorbell.
    fn on_doorbell(&mut self, t: &mut Thread) -> PollStatus {
        let mut status = PollStatus::Idle;
        while let Some(shared) = self.doorbell.ready.pop() {
            // Clear first: a submission pushed after the drain starts
            // lists the channel again.
            shared.scheduled.store(false, Ordering::Release);
            self.drain_channel(t, &shared);
            status = PollStatus::Busy;
        }
        status
    }

    /// Feed a channel's submissions to the core as `Event::Client`s, then
    /// perform the whole batch's actions.
    fn drain_channel(&mut self, t: &mut Thread, shared: &Arc<ChannelShared>) {
        let now = t.now_ns();
        let mut slot = shared.slot.load(Ordering::Relaxed);
        if slot == NO_SLOT {
            let entry = ChanEntry {
                shared: shared.clone(),
                in_engine: 0,
                notify: false,
            };
            if self.channels.is_full() {
                self.reclaim_channels();
            }
            let Some(id) = self.channels.insert(entry) else {
                // Cannot happen (see CHANNEL_ENTRIES_MAX); fail the batch
                // rather than leave it waiting.
                debug_assert!(false, "channel table full");
                tracing::error!(volume = %self.volume, "channel table full");
                while let Some(r) = shared.submissions.pop() {
                    let _ = shared.completions.push(IoCompletion {
                        tag: r.io.tag,
                        result: Err(BdevError::Full {
                            capacity: CHANNEL_ENTRIES_MAX,
                        }),
                        buf: r.io.buf,
                        data: lull_bdev::Data::Buf,
                    });
                }
                shared.ring();
                return;
            };
            slot = id.to_wire();
            shared.slot.store(slot, Ordering::Relaxed);
        }
        while let Some(mut req) = shared.submissions.pop() {
            req.channel = slot;
            if let Some(e) = self.channels.get_mut(slot) {
                e.in_engine += 1;
            }
            self.core.apply(Event::Client(req), now, &mut self.actions);
        }
        // Perform the whole batch's actions at once (one doorbell per channel).
        self.run_actions(t, now);
    }

    /// Free the entries of channels that are closed and drained.
    pub(super) fn reclaim_channels(&mut self) {
        self.channels
            .retain(|_, e| e.in_engine != 0 || Arc::strong_count(&e.shared) != 1);
    }

    /// `Action::Complete`: hand a request back to its channel (its
    /// eventfd rings after the batch, `ring_channels`).
    pub(super) fn complete(&mut self, channel: u64, done: IoCompletion) {
        let Some(e) = self.channels.get_mut(channel) else {
            debug_assert!(false, "completion for an unknown channel");
            return;
        };
        e.in_engine = e.in_engine.saturating_sub(1);
        // Cannot overflow: the channel has at most CHANNEL_DEPTH
        // requests between submit and reap.
        if e.shared.completions.push(done).is_err() {
            tracing::error!(volume = %self.volume, "channel completion queue overflow");
        }
        if !e.notify {
            e.notify = true;
            self.to_notify.push(channel);
        }
    }

    /// Ring the eventfd of every channel that got completions.
    pub(super) fn ring_channels(&mut self) {
        for ch in self.to_notify.drain(..) {
            if let Some(e) = self.channels.get_mut(ch) {
                e.notify = false;
                e.shared.ring();
            }
        }
    }
}
