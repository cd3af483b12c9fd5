//! The reactor shell around [`Engine`]: one lull thread per volume owns the
//! replica sockets (one poller each), a timed tick poller, and the request
//! queues of the volume's channels. It only collects events for the core and
//! performs the actions it returns.
//!
//! ```ignore
//! // `tls`: the client credentials of replica links (`None`: plain links).
//! let dev = ReplicatedDev::start(fw.handle(), 0, "vol0", addrs, size, EngineOptions::default(), tls)?;
//! let mut ch = dev.open_channel()?;           // on an NBD connection thread
//! ch.submit(req)?; ch.flush_submissions();     // one wake-up per batch
//! // ... ch.event_fd() becomes readable ...
//! ch.reap(&mut |c| reply(c));
//! ```
//!
//! Channel → engine: submissions go into the channel's bounded queue; once
//! per batch (not per request) the channel lists itself in the engine's
//! doorbell and wakes the engine thread's submission poller, which drains
//! the listed channels. A wake-up carries no closure, so submitting
//! allocates nothing (until the poller is registered, a message does it).
//! Engine → channel: completions go into the channel's bounded completion
//! queue, and its eventfd is rung once per batch.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use lull_bdev::{BdevError, BlockDevice, BufPool, Channel, IoBuf, IoCompletion, IoRequest};
use lull_net::link::{self as replica_link, LinkStream};
use lull_net::slots::SlotTable;
use lull_net::tls::TlsContext;
use lull_net::wire::{Ended, Wire};
use lull_net::OutPayload;
use lull_proto::replica::{self as proto, Header, HEADER_LEN};
use lull_reactor::sys::EventFd;
use lull_reactor::{FrameworkHandle, PollStatus, PollerId, PollerKind, Thread, ThreadHandle};
use lull_uring::pipes::SplicePipe;
use lull_uring::splice::PIPE_PAYLOAD_BYTES_MAX;

use crate::core::ids::{ConnData, ReplicaData, ReplicaTarget};
use crate::core::{
    Action, ClientReq, ConnRef, Engine, Event, LogLevel, Payload, CHANNEL_DEPTH, MAX_CHANNELS,
    MAX_CLIENT_IOS,
};
use crate::{EngineError, EngineOptions, ReplicaState, ReplicaStatus};

/// Entries in the shell's channel table: each open channel
/// (`MAX_CHANNELS`) plus each closed one that still has requests in the
/// engine (every such entry holds at least one of `MAX_CLIENT_IOS`).
/// Closed, drained entries are reclaimed every tick, and at once when the
/// table is full, so the bound is not reached in practice.
const CHANNEL_ENTRIES_MAX: usize = MAX_CHANNELS + MAX_CLIENT_IOS;

/// Tick period: the resolution of timeouts, keep-alives and reconnects.
/// 100 ms is fine against second-scale timeouts and costs ~10 wake-ups/s.
const TICK_US: u64 = 100_000;

/// Why a replica connection ended when the replica closed it.
const REPLICA_CLOSED: &str = "replica closed the connection";

/// Socket input buffer: many small replies per read syscall; large read
/// payloads go straight from the socket into their buffer.
const READ_BUFFER_BYTES: usize = 256 * 1024;

/// Bytes read per socket per poller run, so one busy replica connection
/// cannot hold the engine thread from the others.
const READ_BUDGET_BYTES: usize = 8 << 20;

/// While a READ of at least this many bytes is in flight on a replica
/// connection, its headers are read alone: one more `recv` of 32 bytes per
/// frame, so that a large payload goes from the socket straight into the
/// buffer the client's reply is sent from, instead of into the input
/// buffer and then copied (docs/PER_IO.md: without it, nearly every byte
/// of a 128 KiB read was copied). 32 KiB: the extra `recv` costs about a
/// microsecond, what copying a few KiB does, well below the 32 KiB or more
/// it saves; with only smaller reads and writes in flight
/// (acknowledgements, 4 KiB reads) replies are batched into the input
/// buffer as before.
const HEADER_ALONE_READ_BYTES: u32 = 32 * 1024;

/// A connect attempt gives up after this long (or the replica timeout, if
/// shorter): it runs on its own short-lived OS thread.
const CONNECT_TIMEOUT_MS_MAX: u64 = 10_000;

// ---- channels ----------------------------------------------------------

/// Channels listed in the doorbell at once: each open channel at most once
/// (its `scheduled` flag), plus as many closed ones still listed. A full
/// doorbell falls back to a message, so the bound costs only speed.
const DOORBELL_CHANNELS: usize = 2 * MAX_CHANNELS;

/// How channels tell the engine thread they have submissions: they list
/// themselves in `ready` and wake `poller` (a `PollerKind::Woken` poller on
/// the engine thread, registered when the thread starts).
struct Doorbell {
    ready: ArrayQueue<Arc<ChannelShared>>,
    poller: OnceLock<PollerId>,
}

struct ChannelShared {
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
    /// The channel's owner takes READ data in a pipe
    /// ([`Channel::allow_splice`]).
    splice: AtomicBool,
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
struct EngineChannel {
    shared: Arc<ChannelShared>,
    engine: ThreadHandle,
    doorbell: Arc<Doorbell>,
    shell: Arc<Mutex<Shell>>,
    in_flight: usize,
    open: Arc<AtomicUsize>,
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
        match self.shared.submissions.push(ClientReq {
            channel: 0,
            io: req,
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
                    spliced: None,
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
        self.shared.splice.store(true, Ordering::Relaxed);
    }
}

impl EngineChannel {
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

impl Drop for EngineChannel {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

struct ChanEntry {
    shared: Arc<ChannelShared>,
    /// Requests of this channel inside the engine.
    in_engine: usize,
    notify: bool,
}

// ---- sockets -------------------------------------------------------------

enum Recv {
    Header,
    Payload {
        header: Header,
        buf: IoBuf,
        filled: usize,
    },
    /// A client READ's data spliced from the socket into a pipe, for a
    /// channel that takes it so (docs/PER_IO.md, "Spliced reads"). `buf`
    /// is the client's buffer, passed through the core untouched (its
    /// completion finds the pipe by it, `Shell::splice_pending`).
    Spliced {
        header: Header,
        buf: IoBuf,
        pipe: SplicePipe,
    },
}

/// A frame read from a replica: its header, its payload in a buffer, and
/// for a spliced READ reply the data in a pipe (the buffer then holds none).
type FrameIn = (Header, Option<IoBuf>, Option<SplicePipe>);

/// A replica connection: the transport half is the servers' [`Wire`] (input
/// buffer, framed output, interest, closing state) carrying the core's
/// payloads; the frames it reads are events for the core, which decides
/// about failures and reconnects (so it is not run by `lull_net::wire::pump`).
struct Sock {
    wire: Wire<LinkStream, Payload>,
    poller: PollerId,
    recv: Recv,
    /// READs of at least `HEADER_ALONE_READ_BYTES` sent and not answered:
    /// while there are any, headers are read alone.
    large_reads: usize,
}

/// The engine's frames carry shared write buffers or inline bytes: once
/// written they are only dropped (the core returns client buffers on
/// completion).
impl OutPayload for Payload {
    fn recycle(self, _: &mut BufPool) {}
}

/// Where a buffer's bytes are: the identity of a client's buffer while it
/// travels through the core.
fn buf_addr(b: &IoBuf) -> usize {
    b.as_slice().as_ptr() as usize
}

/// A READ request or reply of at least `HEADER_ALONE_READ_BYTES` (a reply
/// names the request's kind and length, whatever its status).
fn is_large_read(h: &Header) -> bool {
    h.kind == proto::Kind::Read && h.length >= HEADER_ALONE_READ_BYTES
}

impl Sock {
    /// Whether the read failure `reason` is the replica refusing this
    /// engine's credentials: with TLS 1.3 the client's handshake is over
    /// before the server has checked the client's certificate, so that
    /// refusal arrives as a TLS alert on the first read, not in
    /// `client_handshake`.
    fn tls_refused(&self, reason: &str) -> bool {
        self.wire.stream.is_tls() && reason.contains("alert")
    }

    /// The reason this connection failed, once it has.
    fn failed(&self) -> Option<String> {
        self.wire.closing_reason().map(str::to_string)
    }

    /// A pipe to splice a reply's `n` payload bytes into instead of
    /// receiving them, when everything allows it: a plain link with
    /// nothing of the payload buffered yet, a successful reply to a client
    /// READ (received into the buffer of the client on `channel`) of at
    /// least `HEADER_ALONE_READ_BYTES` that fits a pipe, a channel that
    /// takes pipes, and a pipe to be had.
    fn splice_pipe(
        &self,
        header: &Header,
        n: usize,
        channel: Option<u64>,
        channels: &SlotTable<ChanEntry>,
    ) -> Option<SplicePipe> {
        if !self.wire.splices()
            || !is_large_read(header)
            || n > PIPE_PAYLOAD_BYTES_MAX
            || self.wire.inb.buffered() > 0
        {
            return None;
        }
        if !channels
            .get(channel?)?
            .shared
            .splice
            .load(Ordering::Relaxed)
        {
            return None;
        }
        lull_uring::pipes::get()
    }

    /// Read and decode what the socket has, within the budget. Frames go to
    /// `frames`; an error (EOF, bad frame) ends the connection.
    fn read_frames(
        &mut self,
        engine: &mut Engine,
        conn: ConnRef,
        channels: &SlotTable<ChanEntry>,
        frames: &mut Vec<FrameIn>,
    ) -> Result<bool, String> {
        if let Some(reason) = self.failed() {
            return Err(reason);
        }
        let mut budget = READ_BUDGET_BYTES;
        let mut progress = false;
        loop {
            // Decode what is buffered.
            loop {
                match &mut self.recv {
                    Recv::Header => {
                        let Some(bytes) = self.wire.inb.take(HEADER_LEN) else {
                            break;
                        };
                        let mut raw = [0u8; HEADER_LEN];
                        raw.copy_from_slice(bytes);
                        let header = proto::decode_header(&raw).map_err(|e| match e {
                            proto::FrameError::BadVersion(v) => format!(
                                "replica speaks protocol version {v}, this engine speaks {}",
                                proto::PROTOCOL_VERSION
                            ),
                            e => format!("undecodable frame: {e}"),
                        })?;
                        if is_large_read(&header) {
                            self.large_reads = self.large_reads.saturating_sub(1);
                        }
                        let n = proto::payload_len(&header);
                        if n == 0 {
                            frames.push((header, None, None));
                        } else {
                            let (buf, channel) = engine.reply_buf(conn, &header, n);
                            self.recv = match self.splice_pipe(&header, n, channel, channels) {
                                Some(pipe) => Recv::Spliced { header, buf, pipe },
                                None => Recv::Payload {
                                    header,
                                    buf,
                                    filled: 0,
                                },
                            };
                        }
                    }
                    Recv::Payload { buf, filled, .. } => {
                        // Buffered bytes first, then large payloads straight
                        // from the socket; only the latter count against the
                        // budget (buffered ones did when they were read).
                        let len = buf.len();
                        let direct = *filled + self.wire.inb.buffered().min(len - *filled);
                        match self.wire.receive(buf.as_mut_slice(), filled) {
                            Ok(_) if *filled > direct => {
                                progress = true;
                                budget = budget.saturating_sub(*filled - direct);
                            }
                            Ok(_) => {}
                            Err(Ended::Eof) => return Err(REPLICA_CLOSED.into()),
                            Err(Ended::Failed(e)) => return Err(format!("read failed: {e}")),
                        }
                        if *filled < len {
                            break;
                        }
                        if let Recv::Payload { header, buf, .. } =
                            std::mem::replace(&mut self.recv, Recv::Header)
                        {
                            frames.push((header, Some(buf), None));
                        }
                    }
                    Recv::Spliced { buf, pipe, .. } => {
                        let fd = self.wire.fd();
                        let len = buf.len();
                        while pipe.held() < len {
                            let left = len - pipe.held();
                            match pipe.fill_from(fd, left) {
                                Ok(0) => return Err(REPLICA_CLOSED.into()),
                                Ok(k) => {
                                    progress = true;
                                    budget = budget.saturating_sub(k);
                                }
                                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                                Err(e) => return Err(format!("read failed: {e}")),
                            }
                        }
                        if pipe.held() < len {
                            if lull_uring::splice::readable_bytes(fd).unwrap_or(0) == 0 {
                                // The rest has not arrived: the socket's
                                // readiness brings us back.
                                return Ok(progress);
                            }
                            // The socket has more but the pipe took no
                            // more: its slots are full (the payload came
                            // in more pieces than pages). Receive the rest
                            // into the buffer, after what the pipe holds.
                            let held = pipe.held();
                            let copied = pipe
                                .read_into(&mut buf.as_mut_slice()[..held])
                                .map_err(|e| format!("read failed: {e}"))?;
                            if let Recv::Spliced { header, buf, pipe } =
                                std::mem::replace(&mut self.recv, Recv::Header)
                            {
                                lull_uring::pipes::put(pipe);
                                self.recv = Recv::Payload {
                                    header,
                                    buf,
                                    filled: copied,
                                };
                            }
                            continue;
                        }
                        if let Recv::Spliced { header, buf, pipe } =
                            std::mem::replace(&mut self.recv, Recv::Header)
                        {
                            frames.push((header, Some(buf), Some(pipe)));
                        }
                    }
                }
            }
            if budget == 0 {
                return Ok(progress);
            }
            let n = if self.large_reads > 0 && matches!(self.recv, Recv::Header) {
                let missing = HEADER_LEN.saturating_sub(self.wire.inb.buffered());
                self.wire.fill_at_most(missing, 0, REPLICA_CLOSED)
            } else {
                self.wire.fill(0, REPLICA_CLOSED)
            };
            if let Some(reason) = self.failed() {
                return Err(reason);
            }
            if n == 0 {
                return Ok(progress);
            }
            progress = true;
            budget = budget.saturating_sub(n);
        }
    }

    /// Write queued frames; an error ends the connection. Then wait for
    /// writability only while output is queued.
    fn flush(&mut self, t: &mut Thread) -> Result<bool, String> {
        let moved = lull_net::bufs::with_pool(|pool| self.wire.flush(pool));
        let wants_write = self.wire.stream.wants_write();
        self.wire.update_interest(t, self.poller, None, wants_write);
        match self.failed() {
            Some(reason) if self.wire.is_broken() => Err(self.pending_alert().unwrap_or(reason)),
            _ => Ok(moved),
        }
    }

    /// After a failed write on a TLS link: the TLS alert the replica sent
    /// before it closed, if it is still in the socket. A replica that
    /// refuses this engine's certificate (checked after the TLS 1.3 client
    /// is done with its handshake) sends an alert and closes; a write
    /// racing the close fails with EPIPE before any read saw the alert,
    /// and "broken pipe" would hide why.
    fn pending_alert(&mut self) -> Option<String> {
        use std::io::Read;
        if !self.wire.stream.is_tls() {
            return None;
        }
        let mut scratch = [0u8; 64];
        match self.wire.stream.read(&mut scratch) {
            Err(e) if e.to_string().contains("alert") => Some(format!("read failed: {e}")),
            _ => None,
        }
    }
}

// ---- the shell -------------------------------------------------------------

struct StatusShared {
    snapshot: Mutex<Vec<ReplicaStatus>>,
    /// Set (under `snapshot`'s lock) once a clean detach has finished.
    detached: AtomicBool,
    ready: Condvar,
}

struct Shell {
    volume: String,
    core: Engine,
    opts: EngineOptions,
    /// The credentials replica links authenticate with; `None`: plain.
    tls: Option<TlsContext>,
    me: Option<ThreadHandle>,
    /// The timed poller driving timeouts, keep-alives and reconnects.
    tick: Option<PollerId>,
    /// Channels with submissions, and the poller that drains them.
    doorbell: Arc<Doorbell>,
    this: std::sync::Weak<Mutex<Shell>>,
    /// Each replica connection's socket, once connected.
    socks: ReplicaData<ConnData<Option<Sock>>>,
    channels: SlotTable<ChanEntry>,
    to_notify: Vec<u64>,
    dirty: Vec<ConnRef>,
    actions: Vec<Action>,
    followups: VecDeque<Event>,
    frames: Vec<FrameIn>,
    /// The pipe of the spliced READ reply being applied, and the address
    /// of the buffer its completion carries (`on_socket`, `perform`).
    splice_pending: Option<(usize, SplicePipe)>,
    status: Arc<StatusShared>,
    status_dirty: bool,
}

fn lock(m: &Mutex<Shell>) -> MutexGuard<'_, Shell> {
    // Only the engine thread locks it; a poisoned lock means a panic there,
    // and the state is still the engine's to judge.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shell {
    fn sock(&mut self, c: ConnRef) -> Option<&mut Sock> {
        self.socks.get_mut(c.replica)?.get_mut(c.conn)?.as_mut()
    }

    /// Feed one event to the core and perform everything that follows.
    /// Apply `event` (and the follow-ups it causes) to the core and perform
    /// the actions. Returns whether there was any action (work done).
    fn run(&mut self, t: &mut Thread, event: Event, now: u64) -> bool {
        let mut acted = false;
        self.followups.push_back(event);
        while let Some(ev) = self.followups.pop_front() {
            self.core.apply(ev, now, &mut self.actions);
            acted |= !self.actions.is_empty();
            let mut actions = std::mem::take(&mut self.actions);
            for a in actions.drain(..) {
                self.perform(t, a);
            }
            self.actions = actions;
            self.flush_dirty(t);
        }
        for ch in self.to_notify.drain(..) {
            if let Some(e) = self.channels.get_mut(ch) {
                e.notify = false;
                e.shared.ring();
            }
        }
        if self.status_dirty {
            self.publish_status();
        }
        acted
    }

    fn perform(&mut self, t: &mut Thread, a: Action) {
        match a {
            Action::Send {
                conn,
                header,
                payload,
            } => {
                let Some(sock) = self.sock(conn) else { return };
                if proto::decode_header(&header).is_ok_and(|h| is_large_read(&h)) {
                    sock.large_reads += 1;
                }
                sock.wire.push(&header, payload);
                if !self.dirty.contains(&conn) {
                    self.dirty.push(conn);
                }
            }
            Action::Complete {
                channel,
                tag,
                result,
                buf,
            } => {
                let Some(e) = self.channels.get_mut(channel) else {
                    debug_assert!(false, "completion for an unknown channel");
                    return;
                };
                e.in_engine = e.in_engine.saturating_sub(1);
                let spliced = match (&self.splice_pending, &buf) {
                    (Some((addr, _)), Some(b)) if result.is_ok() && buf_addr(b) == *addr => {
                        self.splice_pending.take().map(|(_, p)| p)
                    }
                    _ => None,
                };
                // Cannot overflow: the channel has at most CHANNEL_DEPTH
                // requests between submit and reap.
                if e.shared
                    .completions
                    .push(IoCompletion {
                        tag,
                        result,
                        buf,
                        spliced,
                    })
                    .is_err()
                {
                    tracing::error!(volume = %self.volume, "channel completion queue overflow");
                }
                if !e.notify {
                    e.notify = true;
                    self.to_notify.push(channel);
                }
            }
            Action::Connect { conn, addr } => self.connect(conn, addr),
            Action::Close { conn } => self.close(t, conn),
            Action::Log { level, msg } => {
                self.status_dirty = true;
                match level {
                    LogLevel::Info => tracing::info!("{msg}"),
                    LogLevel::Warn => tracing::warn!("{msg}"),
                    LogLevel::Error => tracing::error!("{msg}"),
                }
            }
            // The log line emitted with it says the same; milestones are
            // for the simulation's checks.
            Action::Milestone(_) => {}
        }
    }

    /// std has no non-blocking connect (and socket2 is not a dependency), so
    /// a short-lived OS thread does the blocking `connect_timeout` (and, with
    /// credentials, the TLS handshake, blocking too, within the same
    /// timeout) and hands the stream to the engine thread as a message. A
    /// replica that cannot be authenticated is a failed connection like a
    /// refused one: the core fails the replica and retries it every
    /// `reconnect_interval_ms`, one log line each time. At most one attempt per
    /// connection is outstanding (the core issues a new one only after this
    /// one is resolved or abandoned, and the timeout bounds it).
    fn connect(&mut self, conn: ConnRef, target: ReplicaTarget) {
        let (Some(me), Some(shell)) = (self.me.clone(), self.this.upgrade()) else {
            return;
        };
        let timeout =
            Duration::from_millis(self.opts.replica_timeout_ms.min(CONNECT_TIMEOUT_MS_MAX));
        let tls = self.tls.clone();
        let spawned = std::thread::Builder::new()
            .name("lull-connect".into())
            .spawn(move || {
                let result = connect_link(target.addr, timeout, tls.as_ref());
                let _ = me.send(move |t| {
                    let now = t.now_ns();
                    lock(&shell).on_connected(t, conn, result, now);
                });
            });
        if let Err(e) = spawned {
            self.followups.push_back(Event::ConnDown {
                conn,
                reason: format!("cannot start a connect thread: {e}"),
            });
        }
    }

    fn on_connected(
        &mut self,
        t: &mut Thread,
        conn: ConnRef,
        result: Result<LinkStream, LinkError>,
        now: u64,
    ) {
        if !self.core.conn_connecting(conn) {
            return; // an attempt the engine gave up on; the stream drops here
        }
        let stream = match result {
            Ok(s) => s,
            Err(LinkError::Connect(reason)) => {
                self.run(t, Event::ConnDown { conn, reason }, now);
                return;
            }
            Err(LinkError::Auth(reason)) => {
                self.run(t, Event::AuthFailed { conn, reason }, now);
                return;
            }
        };
        let Some(shell) = self.this.upgrade() else {
            return;
        };
        let Some(tcp) = stream.tcp() else {
            return; // never: a connected link has its socket
        };
        let fd = tcp.as_raw_fd();
        let name = format!("{}-r{}c{}", self.volume, conn.replica, conn.conn);
        let peer = tcp
            .peer_addr()
            .map_or_else(|_| "-".to_string(), |a| a.to_string());
        let plain = !stream.is_tls();
        let mut wire = Wire::new(stream, fd, READ_BUFFER_BYTES, "replica client", peer);
        wire.set_context(&name);
        if plain {
            // READ replies may be spliced from the socket (`Recv::Spliced`).
            wire.allow_splice();
        }
        let poller = t.register_poller(
            &name,
            PollerKind::Active,
            &[(fd, wire.interest())],
            Box::new(move |t, now| lock(&shell).on_socket(t, conn, now)),
        );
        let poller = match poller {
            Ok(p) => p,
            Err(e) => {
                self.run(
                    t,
                    Event::ConnDown {
                        conn,
                        reason: format!("cannot poll the socket: {e}"),
                    },
                    now,
                );
                return;
            }
        };
        // The initiator side: in hybrid mode drained every
        // nvme_ioq_poll_period_us instead of woken by the socket.
        if let Err(e) = t.mark_initiator(poller) {
            tracing::warn!(volume = %self.volume, error = %e, "cannot mark a replica connection as initiator");
        }
        let (r, c) = (conn.replica, conn.conn);
        while self.socks.len() <= r.get() {
            self.socks.push(ConnData::new());
        }
        while self.socks[r].len() <= c.get() {
            self.socks[r].push(None);
        }
        if let Some(old) = self.socks[r][c].take() {
            t.unregister_poller(old.poller);
        }
        let sock = self.socks[r][c].insert(Sock {
            wire,
            poller,
            recv: Recv::Header,
            large_reads: 0,
        });
        // A new wire waits for writability too; nothing is queued yet.
        sock.wire.update_interest(t, poller, None, false);
        self.run(t, Event::ConnUp(conn), now);
    }

    fn close(&mut self, t: &mut Thread, conn: ConnRef) {
        let (r, c) = (conn.replica, conn.conn);
        let Some(slot) = self.socks.get_mut(r).and_then(|v| v.get_mut(c)) else {
            return;
        };
        if let Some(sock) = slot.take() {
            // Unregister before the fd closes (the stream drops after).
            t.unregister_poller(sock.poller);
            if let Some(tcp) = sock.wire.stream.tcp() {
                let _ = tcp.shutdown(std::net::Shutdown::Both);
            }
            drop(sock);
        }
    }

    /// (Re)register the tick poller with period `period_us`.
    fn register_tick(&mut self, t: &mut Thread, this: &Arc<Mutex<Shell>>, period_us: u64) {
        if let Some(old) = self.tick.take() {
            t.unregister_poller(old);
        }
        let tick_shell = this.clone();
        match t.register_poller(
            "engine-tick",
            PollerKind::every_us(period_us),
            &[],
            Box::new(move |t, now| lock(&tick_shell).on_tick(t, now)),
        ) {
            Ok(id) => self.tick = Some(id),
            Err(e) => {
                tracing::error!(volume = %self.volume, error = %e, "cannot register the engine tick")
            }
        }
    }

    fn flush_dirty(&mut self, t: &mut Thread) {
        let dirty = std::mem::take(&mut self.dirty);
        for conn in &dirty {
            self.flush_sock(t, *conn);
        }
        self.dirty = dirty;
        self.dirty.clear();
    }

    fn flush_sock(&mut self, t: &mut Thread, conn: ConnRef) -> bool {
        let Some(sock) = self.sock(conn) else {
            return false;
        };
        match sock.flush(t) {
            Ok(p) => p,
            Err(reason) => {
                let event = self.down_event(conn, reason);
                self.followups.push_back(event);
                true
            }
        }
    }

    /// The event of a connection that failed for `reason`: an
    /// authentication failure when the replica refused our TLS
    /// credentials (an alert), else a plain disconnection.
    fn down_event(&mut self, conn: ConnRef, reason: String) -> Event {
        match self.sock(conn) {
            Some(sock) if sock.tls_refused(&reason) => Event::AuthFailed {
                conn,
                reason: format!(
                    "replica not authenticated: {reason} ({})",
                    replica_link::handshake_hint(&reason)
                ),
            },
            _ => Event::ConnDown { conn, reason },
        }
    }

    fn on_socket(&mut self, t: &mut Thread, conn: ConnRef, now: u64) -> PollStatus {
        let mut frames = std::mem::take(&mut self.frames);
        let (r, c) = (conn.replica, conn.conn);
        let read = match self
            .socks
            .get_mut(r)
            .and_then(|v| v.get_mut(c))
            .and_then(Option::as_mut)
        {
            Some(sock) => sock.read_frames(&mut self.core, conn, &self.channels, &mut frames),
            None => return PollStatus::Idle,
        };
        let mut busy = !frames.is_empty();
        for (header, payload, pipe) in frames.drain(..) {
            // A spliced READ's completion (in this run: a reply that
            // checks out completes its read at once) takes the pipe along.
            self.splice_pending = pipe.and_then(|p| Some((buf_addr(payload.as_ref()?), p)));
            self.run(
                t,
                Event::Frame {
                    conn,
                    header,
                    payload,
                },
                now,
            );
            if let Some((_, pipe)) = self.splice_pending.take() {
                // The core refused the reply (and counts it a protocol
                // error): its data goes with the pipe. (Its buffer went
                // back to the pool; no other completion of this run can
                // carry that address: those return buffers that were
                // alive beside it, and a retry's new one completes only
                // with a later reply.)
                lull_uring::pipes::put(pipe);
            }
        }
        self.frames = frames;
        match read {
            Ok(p) => busy |= p,
            Err(reason) => {
                let event = self.down_event(conn, reason);
                self.run(t, event, now);
                return PollStatus::Busy;
            }
        }
        // Plaintext a TLS session decrypted and the read budget left: no
        // socket event will announce it, so come back by ourselves.
        if let Some(sock) = self.sock(conn) {
            if sock.wire.stream.pending() > 0 {
                let poller = sock.poller;
                t.wake_poller(poller);
            }
        }
        if self.flush_sock(t, conn) {
            busy = true;
            let evs: Vec<Event> = self.followups.drain(..).collect();
            for ev in evs {
                self.run(t, ev, now);
            }
        }
        if busy {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }

    /// Register the poller that drains the channels listed in the doorbell.
    fn register_doorbell(&mut self, t: &mut Thread, this: &Arc<Mutex<Shell>>) {
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
                        spliced: None,
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

    fn run_actions(&mut self, t: &mut Thread, now: u64) {
        let mut actions = std::mem::take(&mut self.actions);
        for a in actions.drain(..) {
            self.perform(t, a);
        }
        self.actions = actions;
        self.flush_dirty(t);
        let evs: Vec<Event> = self.followups.drain(..).collect();
        for ev in evs {
            self.run(t, ev, now);
        }
        for ch in self.to_notify.drain(..) {
            if let Some(e) = self.channels.get_mut(ch) {
                e.notify = false;
                e.shared.ring();
            }
        }
    }

    /// Busy when the tick made the core act (a keep-alive ping, a
    /// timeout, a reconnect, an intent CLEAR), Idle when it only looked.
    fn on_tick(&mut self, t: &mut Thread, now: u64) -> PollStatus {
        let acted = self.run(t, Event::Tick, now);
        self.reclaim_channels();
        self.publish_status();
        if acted {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }

    /// Free the entries of channels that are closed and drained.
    fn reclaim_channels(&mut self) {
        self.channels
            .retain(|_, e| e.in_engine != 0 || Arc::strong_count(&e.shared) != 1);
    }

    fn publish_status(&mut self) {
        self.status_dirty = false;
        let detached = self.core.detached();
        let mut guard = self
            .status
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        self.core.status_into(&mut guard);
        let ready = guard.iter().any(|s| s.state == ReplicaState::Healthy);
        self.status.detached.store(detached, Ordering::Release);
        drop(guard);
        if ready || detached {
            self.status.ready.notify_all();
        }
    }

    fn shutdown(&mut self, t: &mut Thread) {
        for conns in &mut self.socks {
            for sock in conns.iter_mut().filter_map(Option::take) {
                t.unregister_poller(sock.poller);
            }
        }
        t.exit();
    }
}

// ---- the device ----------------------------------------------------------------

/// Why a replica link could not be made; each carries the reason the
/// core logs.
enum LinkError {
    /// No connection (refused, unreachable, timed out).
    Connect(String),
    /// Connected, but the TLS handshake failed: the replica could not be
    /// authenticated or refused this engine's credentials.
    Auth(String),
}

/// Connect to a replica (blocking, on a connect helper thread) and, with
/// credentials, authenticate before any frame: the whole of it within
/// `timeout`.
fn connect_link(
    addr: SocketAddr,
    timeout: Duration,
    tls: Option<&TlsContext>,
) -> Result<LinkStream, LinkError> {
    let deadline = std::time::Instant::now() + timeout;
    let tcp = TcpStream::connect_timeout(&addr, timeout)
        .and_then(|s| {
            s.set_nodelay(true)?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .map_err(|e| LinkError::Connect(format!("connect failed: {e}")))?;
    let Some(ctx) = tls else {
        return Ok(LinkStream::Plain(tcp));
    };
    match replica_link::client_handshake(ctx, tcp, addr.ip(), deadline) {
        Ok(s) => Ok(LinkStream::Tls(Box::new(s))),
        Err(e) => {
            let hint = replica_link::handshake_hint(&e.to_string());
            Err(LinkError::Auth(format!(
                "replica not authenticated: {e} ({hint})"
            )))
        }
    }
}

/// A session for this engine: the wall clock in nanoseconds, so that a
/// later engine has a larger session and the replicas refuse the frames of
/// an earlier one (see `lull_proto::replica`). Two engines started within
/// the same nanosecond, or a clock behind the last engine's, are handled by
/// the core (it takes a session past the replica's owner before the first
/// election).
fn new_session() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    u64::try_from(t).unwrap_or(u64::MAX).max(1)
}

/// A replicated volume: a `BlockDevice` whose I/O goes to replica servers.
pub struct ReplicatedDev {
    volume: String,
    size_bytes: u64,
    replicas_desc: String,
    /// The replicas as the operator configured them, changed by
    /// `add_replica`/`remove_replica` as the core will (a node records
    /// them; the core's own view is `replica_status`).
    targets: Mutex<Vec<ReplicaTarget>>,
    engine: ThreadHandle,
    doorbell: Arc<Doorbell>,
    shell: Arc<Mutex<Shell>>,
    status: Arc<StatusShared>,
    open_channels: Arc<AtomicUsize>,
}

impl std::fmt::Debug for ReplicatedDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReplicatedDev({}, {})", self.volume, self.replicas_desc)
    }
}

impl ReplicatedDev {
    /// Start the engine of `volume` on a new lull thread on `reactor`. Does
    /// not block: connections are made in the background; see `wait_ready`.
    pub fn start(
        fw: &FrameworkHandle,
        reactor: usize,
        volume: &str,
        replicas: Vec<ReplicaTarget>,
        size_bytes: u64,
        opts: EngineOptions,
        tls: Option<TlsContext>,
    ) -> Result<Arc<ReplicatedDev>, EngineError> {
        opts.validate()?;
        if replicas.is_empty() || replicas.len() > crate::core::MAX_REPLICAS {
            return Err(EngineError::ReplicaCount {
                got: replicas.len(),
            });
        }
        if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
            return Err(EngineError::BadSize(size_bytes));
        }
        let replicas_desc = replicas
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join("+");
        let status = Arc::new(StatusShared {
            snapshot: Mutex::new(Vec::new()),
            detached: AtomicBool::new(false),
            ready: Condvar::new(),
        });
        let doorbell = Arc::new(Doorbell {
            ready: ArrayQueue::new(DOORBELL_CHANNELS),
            poller: OnceLock::new(),
        });
        let shell = Arc::new_cyclic(|weak| {
            Mutex::new(Shell {
                volume: volume.to_string(),
                core: Engine::new(
                    volume,
                    size_bytes,
                    replicas.clone(),
                    opts.clone(),
                    new_session(),
                ),
                opts: opts.clone(),
                tls,
                me: None,
                tick: None,
                doorbell: doorbell.clone(),
                this: weak.clone(),
                socks: ReplicaData::new(),
                channels: SlotTable::new(CHANNEL_ENTRIES_MAX),
                to_notify: Vec::new(),
                dirty: Vec::new(),
                actions: Vec::new(),
                followups: VecDeque::new(),
                frames: Vec::new(),
                splice_pending: None,
                status: status.clone(),
                status_dirty: true,
            })
        });
        let init_shell = shell.clone();
        let engine = fw.spawn_thread(
            reactor,
            &format!("engine-{volume}"),
            move |t: &mut Thread| {
                let mut sh = lock(&init_shell);
                sh.me = Some(t.handle());
                let now = t.now_ns();
                sh.register_tick(t, &init_shell, TICK_US);
                sh.register_doorbell(t, &init_shell);
                let mut out = std::mem::take(&mut sh.actions);
                sh.core.start(now, &mut out);
                sh.actions = out;
                sh.run_actions(t, now);
                sh.publish_status();
            },
        )?;
        Ok(Arc::new(ReplicatedDev {
            volume: volume.to_string(),
            size_bytes,
            replicas_desc,
            targets: Mutex::new(replicas),
            engine,
            doorbell,
            shell,
            status,
            open_channels: Arc::new(AtomicUsize::new(0)),
        }))
    }

    /// Wait until at least one replica is healthy. For the main thread
    /// (start-up, tools), never for a reactor.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut snap = self
            .status
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if snap.iter().any(|s| s.state == ReplicaState::Healthy) {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            snap = match self.status.ready.wait_timeout(snap, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }

    /// Detach cleanly (for `lull serve`'s stop, after the frontends have
    /// drained): new requests are refused, those in flight finish, every
    /// healthy replica is flushed and marked clean, so the next start trusts
    /// them as identical without reconciling. Blocks the calling thread
    /// (never a reactor) up to `timeout`; false if it did not finish (the
    /// replicas then stay dirty and the next start reconciles them).
    pub fn detach(&self, timeout: Duration) -> Result<bool, EngineError> {
        self.event(Event::Detach)?;
        let deadline = std::time::Instant::now() + timeout;
        let mut snap = self
            .status
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if self.status.detached.load(Ordering::Acquire) {
                return Ok(true);
            }
            let now = std::time::Instant::now();
            if now >= deadline || self.engine.has_exited() {
                return Ok(false);
            }
            snap = match self.status.ready.wait_timeout(snap, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }

    /// The replicas as of the engine's last tick (at most 100 ms old) or
    /// state change. Readable from any thread.
    pub fn replica_status(&self) -> Vec<ReplicaStatus> {
        self.status
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Send keep-alives on idle replica connections every `period_us`
    /// (hybrid mode uses Longhorn's `nvme_adminq_poll_period_us`, 10 ms by
    /// default; the other modes the engine's `keepalive_interval_ms`). The
    /// engine's tick runs at least that often.
    pub fn set_keepalive_period_us(&self, period_us: u64) -> Result<(), EngineError> {
        let shell = self.shell.clone();
        self.engine
            .send(move |t| {
                let mut sh = lock(&shell);
                sh.core.set_keepalive_interval_ms(period_us.div_ceil(1000));
                sh.register_tick(t, &shell, period_us.clamp(1, TICK_US));
            })
            .map_err(|_| EngineError::Stopped)
    }

    /// Add a replica (it is rebuilt, then joins the healthy set).
    pub fn add_replica(&self, addr: ReplicaTarget) -> Result<(), EngineError> {
        {
            let mut targets = self.targets.lock().unwrap_or_else(|e| e.into_inner());
            if !targets.contains(&addr) && targets.len() < crate::core::MAX_REPLICAS {
                targets.push(addr.clone());
            }
        }
        self.event(Event::AddReplica(addr))
    }

    /// Remove a replica from the volume (its connections close now).
    pub fn remove_replica(&self, addr: ReplicaTarget) -> Result<(), EngineError> {
        self.targets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|t| *t != addr);
        self.event(Event::RemoveReplica(addr))
    }

    /// The replicas configured now (the volume's `replicas=`, with those
    /// added and removed since).
    pub fn replica_targets(&self) -> Vec<ReplicaTarget> {
        self.targets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn event(&self, ev: Event) -> Result<(), EngineError> {
        let shell = self.shell.clone();
        self.engine
            .send(move |t| {
                let now = t.now_ns();
                lock(&shell).run(t, ev, now);
            })
            .map_err(|_| EngineError::Stopped)
    }

    pub fn volume(&self) -> &str {
        &self.volume
    }
}

impl BlockDevice for ReplicatedDev {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn describe(&self) -> String {
        format!("replicas={}", self.replicas_desc)
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        if self.engine.has_exited() {
            return Err(BdevError::Failed("volume engine stopped".into()));
        }
        let n = self.open_channels.fetch_add(1, Ordering::AcqRel);
        if n >= MAX_CHANNELS {
            self.open_channels.fetch_sub(1, Ordering::AcqRel);
            return Err(BdevError::Full {
                capacity: MAX_CHANNELS,
            });
        }
        let shared = Arc::new(ChannelShared {
            submissions: ArrayQueue::new(CHANNEL_DEPTH),
            completions: ArrayQueue::new(CHANNEL_DEPTH),
            scheduled: AtomicBool::new(false),
            splice: AtomicBool::new(false),
            rung: AtomicBool::new(false),
            event: EventFd::new().map_err(BdevError::Io)?,
            slot: AtomicU64::new(NO_SLOT),
        });
        Ok(Box::new(EngineChannel {
            shared,
            engine: self.engine.clone(),
            doorbell: self.doorbell.clone(),
            shell: self.shell.clone(),
            in_flight: 0,
            open: self.open_channels.clone(),
        }))
    }

    /// Block status is a BLOCK_STATUS request to one healthy replica, sent
    /// like a read (`IoOp::BlockStatus` on a channel); `extents` keeps the
    /// default "all data", which is true but tells a client nothing.
    fn extents_by_channel(&self) -> bool {
        true
    }

    /// Acknowledged FLUSHes are durable on every healthy replica already;
    /// each replica also syncs on its own clean shutdown. At process exit
    /// the reactors (and this engine's thread) are gone, so there is nothing
    /// left to send.
    fn sync(&self) -> Result<(), BdevError> {
        Ok(())
    }
}

impl Drop for ReplicatedDev {
    fn drop(&mut self) {
        let shell = self.shell.clone();
        let _ = self.engine.send(move |t| lock(&shell).shutdown(t));
    }
}
