//! The transport half of a server connection, shared by the NBD server,
//! the NVMe/TCP target and the replica server (nbdkit splits
//! `connections.c` from `protocol.c` the same way): the stream, the bytes
//! read and not yet parsed, the framed output, the poller's interest, and
//! whether the connection is closing or broken. The protocol half parses
//! frames out of [`Wire::inb`], starts requests and pushes replies; it
//! never touches the socket itself. The engine's replica client uses the
//! same wire with its own payload type (request frames sharing the
//! client's write buffer), driven by the engine core rather than by
//! [`pump`] but read by [`read_and_dispatch`] like the servers
//! ([`Transport`] hands the loop a wire of either payload type;
//! [`Receive::fill_at_most`] and [`Wire::splice_in`] let it take a large
//! payload straight into a buffer or a pipe).
//!
//! Both halves of the I/O are here once: [`pump`] writes, and
//! [`read_and_dispatch`] is every server's budgeted read loop (the
//! protocol answers [`Receive`]: take a step, want input?). A protocol
//! whose writes carry a payload after their header (NBD, the replica
//! protocol) keeps a [`Recv`] and lets [`step_frame`] move the payload
//! into its I/O buffer or drain a refused one ([`ReceiveFrames`]: parse a
//! header, a payload is in, a drain is done). [`Submissions`] holds what
//! a device channel refused as full and pushes queued requests once per
//! batch.
//!
//! ```
//! use lull_net::wire::Wire;
//! use lull_net::Payload;
//! // Any Read + Write works; a real connection uses a non-blocking socket.
//! let mut w = Wire::new(std::io::Cursor::new(b"ping".to_vec()), -1, 64, "echo", "test".into());
//! assert_eq!(w.fill(0, "peer left"), 4);
//! assert_eq!(w.inb.take(4), Some(&b"ping"[..]));
//! w.push(&[], Payload::Bytes(b"pong".to_vec()));
//! lull_net::bufs::with_pool(|pool| assert!(w.flush(pool)));
//! assert!(w.out.is_empty());
//! ```
//!
//! States: open → closing (a reason is kept and logged once; no new
//! request is read, what is in flight finishes and its replies are sent)
//! → finished (nothing in flight and nothing to send, or broken). *Broken*
//! means the peer is gone or the stream failed: queued replies are dropped.

use std::io::{Read, Write};
use std::os::fd::RawFd;

use lull_reactor::{Interest, PollStatus, PollerId, Thread};
use lull_uring::{BufPool, IoBuf};

use crate::slots::SlotId;
use crate::{Fill, InBuf, OutPayload, OutQueue, Payload};

/// How a stream ended in the middle of a payload.
#[derive(Debug)]
pub enum Ended {
    Eof,
    Failed(std::io::Error),
}

/// Where [`Wire::splice_in`] stopped.
#[derive(Debug, PartialEq, Eq)]
pub enum SpliceIn {
    /// The pipe holds the whole payload.
    Whole,
    /// The rest has not arrived: the socket's readiness brings the poller
    /// back.
    Waiting,
    /// The socket has more but the pipe took no more: its slots are full
    /// (the payload came in more pieces than the pipe has pages). Receive
    /// the rest another way (into a buffer, after what the pipe holds).
    PipeFull,
}

/// A connection's stream and its buffers; `P` is what follows a frame
/// header in the output (a server's [`Payload`] by default).
pub struct Wire<S, P = Payload> {
    pub stream: S,
    fd: RawFd,
    /// Bytes read and not yet parsed (held only while non-empty).
    pub inb: InBuf,
    /// Frames queued and not yet written.
    pub out: OutQueue<P>,
    closing: Option<String>,
    broken: bool,
    interest: Interest,
    /// The stream is the plain socket `fd`: payloads with descriptor
    /// tails (`Payload::File`, `Payload::Pipe`) may be spliced into it.
    splice: bool,
    /// An extra fd the poller waits on (the device's completions), once
    /// registered.
    extra_fd_added: bool,
    /// For log lines: what this is ("NBD", "replica"), the peer, and a
    /// context the protocol sets (the export).
    kind: &'static str,
    peer: String,
    context: Option<String>,
}

impl<S: Read + Write, P: OutPayload> Wire<S, P> {
    /// A wire over `stream` (whose fd is `fd`), with an input buffer of
    /// `inbuf_bytes`. It starts waiting for both directions, so that a
    /// greeting queued before the first run goes out at once.
    pub fn new(stream: S, fd: RawFd, inbuf_bytes: usize, kind: &'static str, peer: String) -> Self {
        Wire {
            stream,
            fd,
            inb: InBuf::with_capacity(inbuf_bytes),
            out: OutQueue::default(),
            closing: None,
            broken: false,
            interest: Interest::BOTH,
            splice: false,
            extra_fd_added: false,
            kind,
            peer,
            context: None,
        }
    }

    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Let payloads with descriptor tails be spliced into the socket: the
    /// caller says the stream writes straight to the plain socket `fd` (no
    /// TLS session, whose bytes a splice would bypass). Without it such a
    /// payload fails the write and closes the connection.
    pub fn allow_splice(&mut self) {
        self.splice = true;
    }

    /// Whether [`Wire::allow_splice`] was called.
    pub fn splices(&self) -> bool {
        self.splice
    }

    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// What the poller currently waits for on the socket.
    pub fn interest(&self) -> Interest {
        self.interest
    }

    /// Name the connection in later log lines (e.g. its export).
    pub fn set_context(&mut self, context: &str) {
        self.context = Some(context.to_string());
    }

    pub fn is_closing(&self) -> bool {
        self.closing.is_some()
    }

    /// Why the connection is closing (the first reason given).
    pub fn closing_reason(&self) -> Option<&str> {
        self.closing.as_deref()
    }

    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// The stream can no longer carry replies (queued ones are dropped).
    pub fn set_broken(&mut self) {
        self.broken = true;
    }

    /// Start closing, with a log line; later calls keep the first reason.
    pub fn close(&mut self, reason: impl Into<String>) {
        if self.closing.is_none() {
            let reason = reason.into();
            let context = self.context.as_deref().unwrap_or("-");
            tracing::info!(conn = self.kind, peer = %self.peer, context, reason = %reason, "closing connection");
            self.closing = Some(reason);
        }
    }

    /// Close with a warning: the peer was refused (it failed to
    /// authenticate, or speaks the wrong kind of link). What is queued is
    /// still sent unless the stream is also broken ([`Wire::set_broken`]);
    /// later calls keep the first reason.
    pub fn refuse(&mut self, reason: impl Into<String>) {
        if self.closing.is_none() {
            let reason = reason.into();
            let context = self.context.as_deref().unwrap_or("-");
            tracing::warn!(conn = self.kind, peer = %self.peer, context, reason = %reason, "refusing connection");
            self.closing = Some(reason);
        }
    }

    /// Queue a frame, unless the stream is broken (then the payload is
    /// recycled into the thread's buffer cache).
    pub fn push(&mut self, header: &[u8], payload: P) {
        if self.broken {
            crate::bufs::with_pool(|pool| payload.recycle(pool));
            return;
        }
        self.out.push(header, payload);
    }

    /// Write queued output; returns whether anything moved. A write error
    /// breaks the stream and closes the connection.
    pub fn flush(&mut self, pool: &mut BufPool) -> bool {
        if self.broken {
            return false;
        }
        let sock = self.splice.then_some(self.fd);
        match self.out.write_pooled(&mut self.stream, sock, pool) {
            Ok(n) => n > 0,
            Err(e) => {
                self.broken = true;
                self.out.clear_pooled(pool);
                self.close(e.to_string());
                true
            }
        }
    }

    /// Read what the stream has into the input buffer; returns the bytes
    /// read. End of stream closes the connection with `eof_reason` (broken
    /// too if nothing is `in_flight` and nothing is queued: no reply can
    /// be owed); a read error breaks and closes it.
    pub fn fill(&mut self, in_flight: usize, eof_reason: &str) -> usize {
        self.fill_at_most(usize::MAX, in_flight, eof_reason)
    }

    /// [`Wire::fill`], reading at most `max` bytes (a header alone, so that
    /// a large payload after it can go straight into its buffer through
    /// [`Wire::receive`]).
    pub fn fill_at_most(&mut self, max: usize, in_flight: usize, eof_reason: &str) -> usize {
        match self.inb.fill_at_most(&mut self.stream, max) {
            Ok(Fill::Read(n)) => n,
            Ok(Fill::Nothing) => 0,
            Ok(Fill::Eof) => {
                if in_flight == 0 && self.out.is_empty() {
                    self.broken = true;
                }
                self.close(eof_reason);
                0
            }
            Err(e) => {
                self.broken = true;
                self.close(format!("read failed: {e}"));
                0
            }
        }
    }

    /// Move a payload into `dst` (`filled` bytes of it are there): first
    /// what the input buffer holds, then, once it is empty, straight from
    /// the stream (a large write is not copied twice). `Ok(progress)`, or
    /// the stream ended: give the payload's buffer and slot back, then
    /// call [`Wire::ended`].
    pub fn receive(&mut self, dst: &mut [u8], filled: &mut usize) -> Result<bool, Ended> {
        let len = dst.len();
        let copied = self.inb.take_into(&mut dst[*filled..len]);
        *filled += copied;
        let mut progress = copied > 0;
        if *filled < len && self.inb.buffered() == 0 {
            match crate::read_into(&mut self.stream, dst, filled) {
                Ok(Fill::Read(_)) => progress = true,
                Ok(Fill::Nothing) => {}
                Ok(Fill::Eof) => return Err(Ended::Eof),
                Err(e) => return Err(Ended::Failed(e)),
            }
        }
        Ok(progress)
    }

    /// Move a payload of `len` bytes from the socket into `pipe` (it holds
    /// `pipe.held()` of them), without it passing through user space: the
    /// socket's bytes go on as page references (a replicated read's data,
    /// docs/PER_IO.md, "Spliced reads"). Only on a wire that
    /// [`Wire::splices`], with nothing buffered (the payload starts at the
    /// socket: [`Receive::fill_at_most`] kept it out of the input buffer).
    /// `moved` grows by the bytes spliced. Where it stopped, or the stream
    /// ended: then [`Wire::ended`] says so, as for [`Wire::receive`].
    pub fn splice_in(
        &mut self,
        pipe: &mut lull_uring::pipes::SplicePipe,
        len: usize,
        moved: &mut usize,
    ) -> Result<SpliceIn, Ended> {
        debug_assert!(self.splice && self.inb.buffered() == 0);
        while pipe.held() < len {
            let left = len - pipe.held();
            match pipe.fill_from(self.fd, left) {
                Ok(0) => return Err(Ended::Eof),
                Ok(k) => *moved += k,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(Ended::Failed(e)),
            }
        }
        if pipe.held() == len {
            Ok(SpliceIn::Whole)
        } else if lull_uring::splice::readable_bytes(self.fd).unwrap_or(0) == 0 {
            Ok(SpliceIn::Waiting)
        } else {
            Ok(SpliceIn::PipeFull)
        }
    }

    /// The stream ended in the middle of a payload: close (with
    /// `eof_reason` at end of stream) and break it if no reply is owed
    /// (`in_flight` counted after the payload's slot was released) or the
    /// read failed.
    pub fn ended(&mut self, how: Ended, in_flight: usize, eof_reason: &str) {
        match how {
            Ended::Eof => {
                if in_flight == 0 {
                    self.broken = true;
                }
                self.close(eof_reason);
            }
            Ended::Failed(e) => {
                self.broken = true;
                self.close(format!("read failed: {e}"));
            }
        }
    }

    /// Closing, nothing `busy` (in flight, being persisted) and nothing
    /// left to send: the connection can go.
    pub fn finished(&self, busy: bool) -> bool {
        self.closing.is_some() && !busy && (self.out.is_empty() || self.broken)
    }

    /// After a run: give the input buffer back if it is empty (everything
    /// read was parsed; it returns to the reactor's cache until the next
    /// bytes arrive), watch
    /// `extra_fd` (once it exists) and wait for writability only while
    /// output is queued.
    /// `stream_wants_write`: the stream itself has bytes to send before it
    /// can go on (a TLS session's handshake or key update).
    pub fn update_interest(
        &mut self,
        t: &mut Thread,
        me: PollerId,
        extra_fd: Option<RawFd>,
        stream_wants_write: bool,
    ) {
        self.inb.release();
        if let (false, Some(fd)) = (self.extra_fd_added, extra_fd) {
            self.extra_fd_added = true;
            if let Err(e) = t.add_poller_fd(me, fd, Interest::READABLE) {
                tracing::error!(conn = self.kind, peer = %self.peer, error = %e, "cannot watch device completions");
                self.close("internal error");
            }
        }
        let want = if (!self.out.is_empty() || stream_wants_write) && !self.broken {
            Interest::BOTH
        } else {
            Interest::READABLE
        };
        if want != self.interest && t.set_interest(me, self.fd, want).is_ok() {
            self.interest = want;
        }
    }
}

/// The protocol half of a server connection: what [`pump`] asks of it.
pub trait Protocol {
    type Stream: Read + Write;
    fn wire(&mut self) -> &mut Wire<Self::Stream>;
    /// Work that needs no new input (device completions into replies,
    /// retries of refused requests, finished waits); whether any moved.
    fn advance(&mut self) -> bool;
    /// Parse and start what has arrived, reading more while the protocol
    /// can take it (back-pressure is the protocol's: a full slot table or
    /// reply queue stops reading); whether anything moved. The servers'
    /// loop is [`read_and_dispatch`] (the function).
    fn read_and_dispatch(&mut self) -> bool;
    /// Closing: drop input that can no longer complete (a half-received
    /// payload); whether anything changed.
    fn abandon_input(&mut self) -> bool {
        false
    }
    /// Whether anything must still finish before the connection can go
    /// (requests in flight, a wait for a helper).
    fn busy(&self) -> bool;
    /// An extra fd whose readiness means work (device completions).
    fn completions_fd(&self) -> Option<RawFd>;
    /// Device completions can only be polled for (an IOPOLL file channel
    /// with requests in flight): the poller wakes itself after each run
    /// instead of waiting for an fd, so the reactor keeps polling while
    /// such I/O is outstanding, in every mode.
    fn completions_polled(&self) -> bool {
        false
    }
    /// A request is held until this monotonic time (ns) by a rate limit
    /// (see `Channel::retry_at_ns`): the poller is woken then, not by an
    /// fd and without spinning.
    fn wake_at_ns(&self) -> Option<u64> {
        None
    }
    /// The stream must become writable before it can go on (a TLS
    /// handshake or key update stopped on a full socket).
    fn stream_wants_write(&self) -> bool {
        false
    }
    /// The stream holds input no socket event will announce (TLS
    /// plaintext already decrypted) and the protocol would take it now:
    /// the poller wakes itself.
    fn stranded_input(&self) -> bool {
        false
    }
    /// Internal consistency, checked after every run in debug builds.
    fn check_invariants(&self) {}
}

/// One poller run of a connection: rounds of (advance, write, read and
/// dispatch, advance, write) until a round moves nothing or `max_rounds`
/// are spent (then the poller wakes itself: more work stays in user
/// space and other connections get their turn). A connection that is
/// finished unregisters its poller, which drops it (and closes it).
pub fn pump<P: Protocol>(p: &mut P, t: &mut Thread, max_rounds: usize) -> PollStatus {
    let flush = |p: &mut P| crate::bufs::with_pool(|pool| p.wire().flush(pool));
    let mut status = PollStatus::Idle;
    let mut progressed_last = false;
    for _ in 0..max_rounds {
        let mut progress = p.advance();
        progress |= flush(p);
        if !p.wire().is_closing() {
            progress |= p.read_and_dispatch();
            progress |= p.advance();
            progress |= flush(p);
        } else {
            progress |= p.abandon_input();
        }
        progressed_last = progress;
        if !progress {
            break;
        }
        status = PollStatus::Busy;
    }
    let Some(me) = t.current_poller() else {
        return status;
    };
    let busy = p.busy();
    if p.wire().finished(busy) {
        // Unregister before the fds close (the stream and the device
        // channel drop with the connection, when the poller closure is).
        t.unregister_poller(me);
        return PollStatus::Busy;
    }
    #[cfg(debug_assertions)]
    p.check_invariants();
    let fd = p.completions_fd();
    let wants_write = p.stream_wants_write();
    p.wire().update_interest(t, me, fd, wants_write);
    if progressed_last || p.completions_polled() || p.stranded_input() {
        t.wake_poller(me);
    } else if let Some(at) = p.wake_at_ns() {
        t.wake_poller_at(me, at);
    }
    status
}

/// What the receive half needs of a connection: its wire. Every
/// [`Protocol`] has one (a server's, carrying [`Payload`]s); the engine's
/// replica socket has one carrying the engine's own payloads and is not a
/// [`Protocol`] (the engine core, not [`pump`], drives it).
pub trait Transport {
    type Stream: Read + Write;
    /// What follows a frame header in the output.
    type Out: OutPayload;
    fn wire(&mut self) -> &mut Wire<Self::Stream, Self::Out>;
}

impl<T: Protocol> Transport for T {
    type Stream = T::Stream;
    type Out = Payload;
    fn wire(&mut self) -> &mut Wire<Self::Stream, Self::Out> {
        Protocol::wire(self)
    }
}

/// The receive half of a protocol: what [`read_and_dispatch`] asks of
/// it. A server's [`Protocol::read_and_dispatch`] calls that function,
/// after anything that must come first (a TLS handshake that reads the
/// socket itself); the engine's replica socket calls it for each poller
/// run.
pub trait Receive: Transport {
    /// Why the connection closes when the peer's stream ends between
    /// frames ("client disconnected").
    const EOF_REASON: &'static str;
    /// Take one step from buffered input: parse a frame and start it, or
    /// move payload bytes (a protocol with write payloads calls
    /// [`step_frame`]); whether anything moved.
    fn step(&mut self) -> bool;
    /// Whether reading more bytes could make progress now: a frame's
    /// bytes are still owed ([`Recv::mid_frame`]), or a new request can
    /// be taken (back-pressure: a full slot table, a full reply queue or
    /// a request the channel refused stops reading).
    fn wants_input(&self) -> bool;
    /// Requests in flight: at the end of the stream a connection with
    /// none (and nothing queued) owes no reply and breaks at once.
    fn in_flight(&self) -> usize;
    /// A read of the stream returned `n` bytes (0: nothing, or the end).
    fn filled(&mut self, _n: usize) {}
    /// Read no more than this many bytes from the stream into
    /// [`Wire::inb`] next (see [`Wire::fill_at_most`]): a protocol that
    /// receives a large payload straight into its own buffer or a pipe
    /// asks for the rest of the current frame's header alone, so that no
    /// byte of the payload after it lands in the input buffer. Unlimited
    /// by default (many small frames per read).
    fn fill_at_most(&self) -> usize {
        usize::MAX
    }
}

/// Parse and start what has arrived, reading more while the protocol
/// wants input: the body of [`Protocol::read_and_dispatch`]. Buffered
/// bytes are stepped through first and the stream is read only when no
/// step moves, so that the frames of one read are all parsed before the
/// next (one `recv` for many small requests). At most `budget_bytes` are
/// read per call (each protocol's `READ_BUDGET_BYTES` says why its
/// figure). Whether anything moved.
pub fn read_and_dispatch<P: Receive>(p: &mut P, budget_bytes: usize) -> bool {
    let mut progress = false;
    let mut budget = budget_bytes;
    loop {
        if p.wire().is_closing() {
            break;
        }
        let moved = p.step();
        progress |= moved;
        if moved {
            continue;
        }
        if budget == 0 || !p.wants_input() {
            break;
        }
        let in_flight = p.in_flight();
        let max = p.fill_at_most();
        let n = p.wire().fill_at_most(max, in_flight, P::EOF_REASON);
        p.filled(n);
        if n == 0 {
            break;
        }
        progress = true;
        budget = budget.saturating_sub(n);
    }
    progress
}

/// Where a connection's input stands: between frames, or inside the
/// write payload of a frame whose header was taken. `F` is the decoded
/// header, kept until its payload is in (or drained).
pub enum Recv<F> {
    /// Waiting for a frame header.
    Header,
    /// Receiving the write payload of `frame` (its request holds `slot`)
    /// into `buf`: `filled` of its `buf.len()` bytes are there.
    Payload {
        slot: SlotId,
        frame: F,
        buf: IoBuf,
        filled: usize,
    },
    /// Discarding the payload of a refused write (`remaining` bytes still
    /// to come) before its error reply `error`, so that the stream stays
    /// in sync.
    Drain {
        remaining: u64,
        frame: F,
        error: u32,
    },
}

impl<F> Recv<F> {
    /// Receive `frame`'s payload, `buf.len()` bytes, into `buf` next.
    pub fn payload(slot: SlotId, frame: F, buf: IoBuf) -> Self {
        Recv::Payload {
            slot,
            frame,
            buf,
            filled: 0,
        }
    }

    /// Discard the next `bytes` (`frame`'s payload), then answer `frame`
    /// with `error`.
    pub fn drain(bytes: u64, frame: F, error: u32) -> Self {
        Recv::Drain {
            remaining: bytes,
            frame,
            error,
        }
    }

    /// Bytes of a frame are still owed: reading more makes progress
    /// whatever the back-pressure says.
    pub fn mid_frame(&self) -> bool {
        !matches!(self, Recv::Header)
    }
}

/// A protocol whose frames are a header and, for a write, a payload that
/// goes into an I/O buffer (NBD, the replica protocol): the hooks
/// [`step_frame`] and [`abandon_frame`] call. The protocol keeps its
/// [`Recv`] and parses headers; payloads and drains are moved here.
pub trait ReceiveFrames: Receive {
    /// A decoded frame header.
    type Frame: std::fmt::Debug;
    /// Why the connection closes when the stream ends inside a payload.
    const EOF_IN_PAYLOAD_REASON: &'static str;
    fn recv(&mut self) -> &mut Recv<Self::Frame>;
    /// Parse one frame header from [`Wire::inb`] and start it: a write
    /// sets [`Recv::payload`] (or [`Recv::drain`] when refused); whether
    /// anything moved.
    fn take_frame(&mut self) -> bool;
    /// The whole payload of `frame` is in `buf`: start its request.
    fn payload_received(&mut self, slot: SlotId, frame: Self::Frame, buf: IoBuf);
    /// The payload of the request in `slot` will never be whole (the
    /// stream ended, or the connection closes): free the slot.
    fn payload_lost(&mut self, slot: SlotId);
    /// The payload of the refused `frame` is drained: its error reply.
    fn drained(&mut self, frame: Self::Frame, error: u32);
}

/// One step of a framed protocol's input ([`Receive::step`] in the
/// transmission phase): a header ([`ReceiveFrames::take_frame`]), or
/// payload bytes moved into their buffer (what the input buffer holds,
/// then once it is empty straight from the stream: a large write is not
/// copied twice), or drained. Whether anything moved.
pub fn step_frame<P: ReceiveFrames>(p: &mut P) -> bool {
    match std::mem::replace(p.recv(), Recv::Header) {
        Recv::Header => p.take_frame(),
        Recv::Payload {
            slot,
            frame,
            mut buf,
            mut filled,
        } => match p.wire().receive(buf.as_mut_slice(), &mut filled) {
            Err(ended) => {
                crate::bufs::put(buf);
                p.payload_lost(slot);
                let in_flight = p.in_flight();
                p.wire().ended(ended, in_flight, P::EOF_IN_PAYLOAD_REASON);
                true
            }
            Ok(_) if filled == buf.len() => {
                p.payload_received(slot, frame, buf);
                true
            }
            Ok(progress) => {
                *p.recv() = Recv::Payload {
                    slot,
                    frame,
                    buf,
                    filled,
                };
                progress
            }
        },
        Recv::Drain {
            remaining,
            frame,
            error,
        } => {
            let inb = &mut p.wire().inb;
            let n = (inb.buffered() as u64).min(remaining);
            inb.consume(n as usize);
            let remaining = remaining - n;
            if remaining == 0 {
                p.drained(frame, error);
            } else {
                *p.recv() = Recv::Drain {
                    remaining,
                    frame,
                    error,
                };
            }
            n > 0
        }
    }
}

/// [`Protocol::abandon_input`] of a framed protocol: a closing connection
/// reads nothing more, so a write whose payload has not fully arrived is
/// dropped unanswered (never applied, never acknowledged: the peer sees
/// the connection close), and its slot freed; otherwise the slot would
/// keep the connection open for good. A refused write being drained
/// loses its error reply the same way. Whether anything was dropped.
pub fn abandon_frame<P: ReceiveFrames>(p: &mut P) -> bool {
    match std::mem::replace(p.recv(), Recv::Header) {
        Recv::Payload {
            slot, frame, buf, ..
        } => {
            let w = p.wire();
            tracing::debug!(conn = w.kind, peer = %w.peer, ?frame, "closing: write payload incomplete, dropped");
            crate::bufs::put(buf);
            p.payload_lost(slot);
            true
        }
        Recv::Drain { .. } => true,
        Recv::Header => false,
    }
}

/// Requests a connection hands its device channel (`lull_bdev`'s
/// `Channel::queue`, whose answer each call passes in): one the channel
/// refused as full, held and retried before more is read, and whether
/// requests were queued and not pushed yet, so that they are pushed once
/// per batch (one `io_uring_enter` for every request of a socket read,
/// not one each). `R` is the request type.
pub struct Submissions<R> {
    retry: Option<R>,
    unflushed: bool,
}

impl<R> Default for Submissions<R> {
    fn default() -> Self {
        Submissions {
            retry: None,
            unflushed: false,
        }
    }
}

impl<R> Submissions<R> {
    /// What the channel said to a request queued and not pushed
    /// (`Ok(None)`: queued; `Ok(Some(req))`: full, held for a retry;
    /// `Err(done)`: refused, its completion handed back to be completed
    /// now).
    pub fn queued<C>(&mut self, said: Result<Option<R>, C>) -> Option<C> {
        if matches!(said, Ok(None)) {
            self.unflushed = true;
        }
        self.pushed(said)
    }

    /// What the channel said to a request it was asked to push at once
    /// (`Channel::submit_now`): as [`Submissions::queued`], with nothing
    /// left to push.
    pub fn pushed<C>(&mut self, said: Result<Option<R>, C>) -> Option<C> {
        match said {
            Ok(None) => None,
            Ok(Some(req)) => {
                self.retry = Some(req);
                None
            }
            Err(done) => Some(done),
        }
    }

    /// The request held for a retry, to be submitted again.
    pub fn retry(&mut self) -> Option<R> {
        self.retry.take()
    }

    /// A request is held: no new one is read until it went.
    pub fn holding(&self) -> bool {
        self.retry.is_some()
    }

    /// Whether requests were queued since the last call: the caller pushes
    /// them now (`Channel::flush_submissions`).
    pub fn take_unflushed(&mut self) -> bool {
        std::mem::take(&mut self.unflushed)
    }
}

#[cfg(test)]
mod tests {
    //! The wire against a model: a peer that delivers its bytes in random
    //! pieces with "would block" in between, accepts writes in random short
    //! pieces, and may reset the connection at any point.
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;
    use std::cell::Cell;
    use std::io;
    use std::rc::Rc;

    /// A scripted peer: `input` is what it sent, handed out in `reads`-sized
    /// pieces (0 = would block), then the end of the stream if `eof` (else
    /// "would block" for ever); writes are accepted `writes`-sized pieces
    /// at a time (0 = would block); `reset_after` bytes of traffic either
    /// way, it resets. Reads and writes walk their sizes separately (one
    /// shared step let reads [1, 0] and writes [0, 1] always land on the
    /// zeros: a peer that never moves, not a wire that hangs).
    struct Peer {
        input: Vec<u8>,
        pos: usize,
        reads: Vec<usize>,
        writes: Vec<usize>,
        read_step: usize,
        write_step: usize,
        written: Vec<u8>,
        traffic: usize,
        reset_after: Option<usize>,
        eof: bool,
    }

    fn piece(sizes: &[usize], step: &mut usize) -> usize {
        *step += 1;
        sizes[*step % sizes.len()]
    }

    impl Peer {
        fn reset(&self) -> bool {
            self.reset_after.is_some_and(|r| self.traffic >= r)
        }
    }

    impl Read for Peer {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.reset() {
                return Err(io::ErrorKind::ConnectionReset.into());
            }
            if self.pos == self.input.len() && self.eof {
                return Ok(0);
            }
            if self.pos == self.input.len() {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = piece(&self.reads, &mut self.read_step)
                .min(buf.len())
                .min(self.input.len() - self.pos);
            if n == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            buf[..n].copy_from_slice(&self.input[self.pos..self.pos + n]);
            self.pos += n;
            self.traffic += n;
            Ok(n)
        }
    }

    impl Write for Peer {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.reset() {
                return Err(io::ErrorKind::ConnectionReset.into());
            }
            let n = piece(&self.writes, &mut self.write_step).min(buf.len());
            if n == 0 {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.written.extend_from_slice(&buf[..n]);
            self.traffic += n;
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A payload that counts how often it was recycled (an engine-style
    /// payload: not a server `Payload`).
    struct Tracked {
        bytes: Vec<u8>,
        recycled: Rc<Cell<usize>>,
    }

    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            &self.bytes
        }
    }

    impl OutPayload for Tracked {
        fn recycle(self, _: &mut BufPool) {
            self.recycled.set(self.recycled.get() + 1);
        }
    }

    /// A toy protocol on the wire: frames are a 2-byte big-endian length and
    /// that many bytes; each is answered with an 8-byte header and the
    /// frame's bytes reversed (as the payload `make` builds).
    fn serve<P: OutPayload>(
        w: &mut Wire<Peer, P>,
        pool: &mut BufPool,
        got: &mut Vec<Vec<u8>>,
        make: &impl Fn(Vec<u8>) -> P,
    ) -> bool {
        let mut progress = false;
        loop {
            let buffered = w.inb.peek();
            if buffered.len() >= 2 {
                let len = usize::from(u16::from_be_bytes([buffered[0], buffered[1]]));
                if buffered.len() >= 2 + len {
                    let frame = w.inb.take(2 + len).expect("buffered")[2..].to_vec();
                    let mut reply = frame.clone();
                    reply.reverse();
                    w.push(&(frame.len() as u64).to_be_bytes(), make(reply));
                    got.push(frame);
                    progress = true;
                    continue;
                }
            }
            if w.is_closing() || w.fill(0, "peer left") == 0 {
                break;
            }
            progress = true;
        }
        progress | w.flush(pool)
    }

    /// Serve `frames` from a scripted peer over a wire carrying payloads
    /// built by `make`, and check the outcome against the model. Returns
    /// the wire for payload-specific checks.
    fn check_wire<P: OutPayload>(
        frames: &[Vec<u8>],
        reads: Vec<usize>,
        writes: Vec<usize>,
        reset_at: Option<usize>,
        make: impl Fn(Vec<u8>) -> P,
    ) -> Result<(Wire<Peer, P>, usize), TestCaseError> {
        let mut input = Vec::new();
        for f in frames {
            input.extend_from_slice(&(f.len() as u16).to_be_bytes());
            input.extend_from_slice(f);
        }
        let peer = Peer {
            input,
            pos: 0,
            reads,
            writes,
            read_step: 0,
            write_step: 0,
            written: Vec::new(),
            traffic: 0,
            reset_after: reset_at,
            eof: false,
        };
        let mut w = Wire::new(peer, -1, 1024, "test", "peer".into());
        let mut pool = BufPool::new(1 << 20);
        let mut got = Vec::new();
        // Enough runs for every piece to move (each run moves at least
        // one piece unless the peer would block on both sides).
        for _ in 0..20_000 {
            let _ = serve(&mut w, &mut pool, &mut got, &make);
            if w.is_broken() || (got.len() == frames.len() && w.out.is_empty()) {
                break;
            }
        }
        // What was parsed is a prefix of what was sent, in order.
        prop_assert!(got.len() <= frames.len());
        prop_assert_eq!(&got[..], &frames[..got.len()]);
        // What was written is a prefix of the replies to what was parsed.
        let mut expect = Vec::new();
        for f in &got {
            expect.extend_from_slice(&(f.len() as u64).to_be_bytes());
            expect.extend(f.iter().rev());
        }
        let written = &w.stream.written;
        prop_assert!(written.len() <= expect.len());
        prop_assert_eq!(&written[..], &expect[..written.len()]);
        if w.is_broken() {
            // Only a reset breaks it, with a reason; nothing more is
            // written and the connection can go at once.
            prop_assert!(reset_at.is_some());
            prop_assert!(w.is_closing());
            prop_assert!(w.closing_reason().is_some());
            prop_assert!(w.finished(false));
            prop_assert!(!w.flush(&mut pool));
        } else {
            // Without a reset everything arrives and is answered.
            prop_assert_eq!(got.len(), frames.len());
            prop_assert_eq!(written.len(), expect.len());
            w.inb.release();
            prop_assert!(!w.inb.is_held(), "an idle wire holds no input buffer");
        }
        Ok((w, got.len()))
    }

    fn frames() -> impl Strategy<Value = Vec<Vec<u8>>> {
        prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..40)
    }
    fn reads() -> impl Strategy<Value = Vec<usize>> {
        prop::collection::vec(0usize..50, 1..8)
            .prop_filter("the peer sends at some point", |v| v.iter().any(|&n| n > 0))
    }
    fn writes() -> impl Strategy<Value = Vec<usize>> {
        prop::collection::vec(0usize..70, 1..8)
            .prop_filter("the peer reads at some point", |v| v.iter().any(|&n| n > 0))
    }

    proptest! {
        #[test]
        fn frames_survive_any_split_and_a_reset_breaks_cleanly(
            frames in frames(),
            reads in reads(),
            writes in writes(),
            reset_at in prop::option::of(0usize..4000),
        ) {
            check_wire(&frames, reads, writes, reset_at, Payload::Bytes)?;
        }

        /// The same with another payload type (the engine's replica client
        /// has its own): every payload pushed is recycled exactly once,
        /// when written or when the broken stream drops it, or is still
        /// queued.
        #[test]
        fn any_payload_type_is_written_or_recycled_once(
            frames in frames(),
            reads in reads(),
            writes in writes(),
            reset_at in prop::option::of(0usize..4000),
        ) {
            let recycled = Rc::new(Cell::new(0));
            let make = |bytes| Tracked { bytes, recycled: recycled.clone() };
            let (mut w, pushed) = check_wire(&frames, reads, writes, reset_at, make)?;
            let mut queued = 0;
            w.out.clear(|_| queued += 1);
            prop_assert_eq!(recycled.get() + queued, pushed);
            if !w.is_broken() {
                prop_assert_eq!(recycled.get(), pushed);
            }
        }
    }

    /// The receive half ([`read_and_dispatch`], [`step_frame`],
    /// [`abandon_frame`], [`Submissions`]) under a toy framed protocol.
    mod receive {
        use super::*;
        use crate::slots::SlotTable;

        /// A frame: a 3-byte header (kind, big-endian length), then for a
        /// write (`WRITE`) `len` payload bytes. `REFUSED` is a write whose
        /// payload is drained before its error reply; `READ` has no payload.
        #[derive(Debug, Clone, Copy)]
        struct Hdr {
            kind: u8,
            len: u16,
        }
        const WRITE: u8 = 0;
        const REFUSED: u8 = 1;
        const READ: u8 = 2;
        const HDR_LEN: usize = 3;
        const REFUSED_ERROR: u32 = 7;

        /// Replies: [kind, len, len, status], then a write's payload again.
        fn reply_header(h: Hdr, status: u32) -> [u8; 4] {
            let [a, b] = h.len.to_be_bytes();
            [h.kind, a, b, status as u8]
        }

        struct Toy {
            wire: Wire<Peer>,
            recv: Recv<Hdr>,
            slots: SlotTable<Hdr>,
            /// Write payloads received, in order.
            got: Vec<Vec<u8>>,
            /// Replies are pushed by `advance` (a device that completes
            /// later), not at once; the slot of a write is held until then.
            hold: bool,
            held: Vec<(Option<SlotId>, [u8; 4], Vec<u8>)>,
            budget_bytes: usize,
        }

        impl Toy {
            fn new(input: Vec<u8>, reads: Vec<usize>, slots: usize) -> Toy {
                let peer = Peer {
                    input,
                    pos: 0,
                    reads,
                    writes: vec![1 << 20],
                    read_step: 0,
                    write_step: 0,
                    written: Vec::new(),
                    traffic: 0,
                    reset_after: None,
                    eof: false,
                };
                Toy {
                    wire: Wire::new(peer, -1, 64, "toy", "peer".into()),
                    recv: Recv::Header,
                    slots: SlotTable::new(slots),
                    got: Vec::new(),
                    hold: false,
                    held: Vec::new(),
                    budget_bytes: usize::MAX,
                }
            }

            fn answer(&mut self, slot: Option<SlotId>, header: [u8; 4], payload: Vec<u8>) {
                if self.hold {
                    self.held.push((slot, header, payload));
                    return;
                }
                if let Some(slot) = slot {
                    self.slots.take(slot.to_wire()).expect("in flight");
                }
                self.wire.push(&header, Payload::Bytes(payload));
            }

            /// One round of the pump, without a reactor.
            fn round(&mut self, pool: &mut BufPool) -> bool {
                let mut progress = self.advance();
                progress |= self.wire.flush(pool);
                if !self.wire.is_closing() {
                    progress |= Protocol::read_and_dispatch(self);
                    progress |= self.advance();
                    progress |= self.wire.flush(pool);
                } else {
                    progress |= self.abandon_input();
                }
                progress
            }
        }

        impl Protocol for Toy {
            type Stream = Peer;
            fn wire(&mut self) -> &mut Wire<Peer> {
                &mut self.wire
            }
            fn advance(&mut self) -> bool {
                let held = std::mem::take(&mut self.held);
                let progress = !held.is_empty();
                for (slot, header, payload) in held {
                    if let Some(slot) = slot {
                        self.slots.take(slot.to_wire()).expect("in flight");
                    }
                    self.wire.push(&header, Payload::Bytes(payload));
                }
                progress
            }
            fn read_and_dispatch(&mut self) -> bool {
                read_and_dispatch(self, self.budget_bytes)
            }
            fn abandon_input(&mut self) -> bool {
                abandon_frame(self)
            }
            fn busy(&self) -> bool {
                self.slots.in_flight() > 0
            }
            fn completions_fd(&self) -> Option<RawFd> {
                None
            }
        }

        impl Receive for Toy {
            const EOF_REASON: &'static str = "peer left";
            fn step(&mut self) -> bool {
                step_frame(self)
            }
            fn wants_input(&self) -> bool {
                self.recv.mid_frame() || !self.slots.is_full()
            }
            fn in_flight(&self) -> usize {
                self.slots.in_flight()
            }
        }

        impl ReceiveFrames for Toy {
            type Frame = Hdr;
            const EOF_IN_PAYLOAD_REASON: &'static str = "peer left inside a payload";
            fn recv(&mut self) -> &mut Recv<Hdr> {
                &mut self.recv
            }
            fn take_frame(&mut self) -> bool {
                if self.slots.is_full() {
                    return false;
                }
                let Some(&[kind, a, b]) = self.wire.inb.take(HDR_LEN) else {
                    return false;
                };
                let h = Hdr {
                    kind,
                    len: u16::from_be_bytes([a, b]),
                };
                match kind {
                    WRITE => {
                        let slot = self.slots.insert(h).expect("checked");
                        let buf = crate::bufs::get(usize::from(h.len));
                        self.recv = Recv::payload(slot, h, buf);
                    }
                    REFUSED => self.recv = Recv::drain(u64::from(h.len), h, REFUSED_ERROR),
                    _ => self.answer(None, reply_header(h, 0), Vec::new()),
                }
                true
            }
            fn payload_received(&mut self, slot: SlotId, h: Hdr, buf: IoBuf) {
                let payload = buf.as_slice().to_vec();
                crate::bufs::put(buf);
                self.got.push(payload.clone());
                self.answer(Some(slot), reply_header(h, 0), payload);
            }
            fn payload_lost(&mut self, slot: SlotId) {
                self.slots.take(slot.to_wire()).expect("in flight");
            }
            fn drained(&mut self, h: Hdr, error: u32) {
                self.answer(None, reply_header(h, error), Vec::new());
            }
        }

        /// What the peer sends for `frames` (kind, payload; a READ's
        /// "payload" is only its length), and the replies it should get.
        fn script(frames: &[(u8, Vec<u8>)]) -> (Vec<u8>, Vec<u8>) {
            let (mut input, mut replies) = (Vec::new(), Vec::new());
            for (kind, payload) in frames {
                let h = Hdr {
                    kind: *kind,
                    len: payload.len() as u16,
                };
                input.push(h.kind);
                input.extend_from_slice(&h.len.to_be_bytes());
                match h.kind {
                    WRITE => {
                        input.extend_from_slice(payload);
                        replies.extend_from_slice(&reply_header(h, 0));
                        replies.extend_from_slice(payload);
                    }
                    REFUSED => {
                        input.extend_from_slice(payload);
                        replies.extend_from_slice(&reply_header(h, REFUSED_ERROR));
                    }
                    _ => replies.extend_from_slice(&reply_header(h, 0)),
                }
            }
            (input, replies)
        }

        fn writes(frames: &[(u8, Vec<u8>)]) -> Vec<Vec<u8>> {
            frames
                .iter()
                .filter(|(k, _)| *k == WRITE)
                .map(|(_, p)| p.clone())
                .collect()
        }

        proptest! {
            /// Payloads larger and smaller than the input buffer, split
            /// anywhere, held or answered at once, with a slot table of
            /// one or more, with or without a reset: what is received is
            /// what was sent, in order; refused payloads are drained (the
            /// stream stays in sync); what is answered is a prefix of the
            /// replies; without a reset everything is answered, and either
            /// way no slot is left behind once the connection is done.
            #[test]
            fn payloads_arrive_whole_and_drains_keep_the_stream_in_sync(
                frames in prop::collection::vec(
                    (0u8..3, prop::collection::vec(any::<u8>(), 0..200)), 0..30),
                reads in reads(),
                slots in 1usize..4,
                hold in any::<bool>(),
                budget_bytes in prop::option::of(1usize..64),
                reset_at in prop::option::of(0usize..3000),
            ) {
                let (input, replies) = script(&frames);
                let mut t = Toy::new(input, reads, slots);
                t.hold = hold;
                t.budget_bytes = budget_bytes.unwrap_or(usize::MAX);
                t.wire.stream.reset_after = reset_at;
                let mut pool = BufPool::new(1 << 20);
                for _ in 0..20_000 {
                    let _ = t.round(&mut pool);
                    if t.wire.finished(t.busy())
                        || (t.wire.stream.written.len() == replies.len() && t.wire.out.is_empty())
                    {
                        break;
                    }
                }
                let sent = writes(&frames);
                prop_assert!(t.got.len() <= sent.len());
                prop_assert_eq!(&t.got[..], &sent[..t.got.len()]);
                let written = &t.wire.stream.written;
                prop_assert_eq!(&written[..], &replies[..written.len()]);
                if t.wire.is_closing() {
                    prop_assert!(reset_at.is_some());
                    prop_assert!(t.wire.is_broken());
                    prop_assert_eq!(t.slots.in_flight(), 0, "a closing connection keeps no slot");
                    prop_assert!(t.wire.finished(t.busy()));
                } else {
                    prop_assert_eq!(written.len(), replies.len());
                    prop_assert_eq!(t.got.len(), sent.len());
                    prop_assert!(!t.recv.mid_frame());
                    prop_assert_eq!(t.slots.in_flight(), 0);
                }
            }
        }

        #[test]
        fn a_full_slot_table_stops_reading_until_a_completion() {
            let frames = [(WRITE, vec![1; 10]), (WRITE, vec![2; 10])];
            let (input, replies) = script(&frames);
            let mut t = Toy::new(input, vec![1 << 20], 1);
            t.hold = true;
            assert!(Protocol::read_and_dispatch(&mut t));
            assert_eq!(t.got, vec![vec![1; 10]]);
            assert!(!t.wants_input(), "one slot, held");
            assert_eq!(t.wire.inb.buffered(), HDR_LEN + 10, "the next frame waits");
            assert!(!Protocol::read_and_dispatch(&mut t));
            assert!(t.advance());
            assert!(Protocol::read_and_dispatch(&mut t));
            assert!(t.advance());
            crate::bufs::with_pool(|pool| assert!(t.wire.flush(pool)));
            assert_eq!(t.wire.stream.written, replies);
        }

        #[test]
        fn a_call_reads_at_most_its_budget_then_parses_what_it_read() {
            let frames: Vec<_> = (0..10).map(|_| (READ, Vec::new())).collect();
            let (input, _) = script(&frames);
            // Two frames per read.
            let mut t = Toy::new(input, vec![2 * HDR_LEN], 4);
            t.budget_bytes = 3 * HDR_LEN;
            assert!(Protocol::read_and_dispatch(&mut t));
            // Two reads (the second crossed the budget), four frames.
            assert_eq!(t.wire.stream.pos, 4 * HDR_LEN);
            assert_eq!(t.wire.out.bytes(), 4 * 4, "four replies");
            assert_eq!(t.wire.inb.buffered(), 0);
        }

        #[test]
        fn the_end_of_the_stream_inside_a_payload_frees_its_slot() {
            let (mut input, _) = script(&[(WRITE, vec![9; 100])]);
            input.truncate(HDR_LEN + 40);
            let mut t = Toy::new(input, vec![HDR_LEN, 20], 1);
            t.wire.stream.eof = true;
            let mut pool = BufPool::new(1 << 20);
            while t.round(&mut pool) {}
            assert_eq!(t.wire.closing_reason(), Some(Toy::EOF_IN_PAYLOAD_REASON));
            assert!(t.wire.is_broken(), "no reply is owed");
            assert_eq!(t.slots.in_flight(), 0);
            assert!(t.got.is_empty());
            assert!(t.wire.finished(t.busy()));
        }

        #[test]
        fn the_end_of_the_stream_between_frames_owes_replies_in_flight() {
            let (input, replies) = script(&[(WRITE, vec![3; 5])]);
            let mut t = Toy::new(input, vec![1 << 20], 2);
            t.hold = true;
            t.wire.stream.eof = true;
            assert!(Protocol::read_and_dispatch(&mut t));
            assert_eq!(t.wire.closing_reason(), Some(Toy::EOF_REASON));
            assert!(!t.wire.is_broken(), "the write in flight is still answered");
            let mut pool = BufPool::new(1 << 20);
            while t.round(&mut pool) {}
            assert_eq!(t.wire.stream.written, replies);
            assert!(t.wire.finished(t.busy()));
        }

        #[test]
        fn closing_abandons_a_payload_or_a_drain_once() {
            for kind in [WRITE, REFUSED] {
                let (mut input, _) = script(&[(kind, vec![5; 50])]);
                input.truncate(HDR_LEN + 10);
                let mut t = Toy::new(input, vec![1 << 20], 1);
                assert!(Protocol::read_and_dispatch(&mut t));
                assert!(t.recv.mid_frame());
                t.wire.close("stopping");
                assert!(t.abandon_input());
                assert!(!t.abandon_input(), "nothing left to drop");
                assert_eq!(t.slots.in_flight(), 0);
                assert!(t.wire.finished(t.busy()));
            }
        }

        #[test]
        fn submissions_hold_a_refused_request_and_push_once_per_batch() {
            let mut s: Submissions<u32> = Submissions::default();
            assert_eq!(s.queued::<()>(Ok(None)), None);
            assert_eq!(s.queued::<()>(Ok(None)), None);
            assert!(s.take_unflushed());
            assert!(!s.take_unflushed(), "pushed once for the batch");
            assert_eq!(s.queued::<()>(Ok(Some(7))), None);
            assert!(s.holding());
            assert!(!s.take_unflushed(), "a full channel took nothing");
            assert_eq!(s.retry(), Some(7));
            assert!(!s.holding());
            assert_eq!(s.queued(Err("failed")), Some("failed"));
            assert_eq!(s.pushed::<()>(Ok(None)), None);
            assert!(!s.take_unflushed(), "already pushed");
        }
    }

    /// [`Receive::fill_at_most`]: a protocol that asks for a header alone
    /// gets no byte of the payload after it in the input buffer; the
    /// payload comes straight from the stream into its own buffer (the
    /// engine's replica socket reads large READ replies so).
    #[test]
    fn fill_at_most_keeps_a_payload_out_of_the_input_buffer() {
        struct HeaderAlone {
            wire: Wire<std::io::Cursor<Vec<u8>>, Vec<u8>>,
            header: Option<Vec<u8>>,
            payload: Vec<u8>,
            got: usize,
            fills: Vec<usize>,
        }
        impl Transport for HeaderAlone {
            type Stream = std::io::Cursor<Vec<u8>>;
            type Out = Vec<u8>;
            fn wire(&mut self) -> &mut Wire<Self::Stream, Vec<u8>> {
                &mut self.wire
            }
        }
        impl Receive for HeaderAlone {
            const EOF_REASON: &'static str = "peer left";
            fn step(&mut self) -> bool {
                if self.header.is_none() {
                    let Some(h) = self.wire.inb.take(4) else {
                        return false;
                    };
                    self.header = Some(h.to_vec());
                    return true;
                }
                if self.got == self.payload.len() {
                    return false;
                }
                self.wire
                    .receive(&mut self.payload, &mut self.got)
                    .expect("the payload is in the stream")
            }
            fn wants_input(&self) -> bool {
                self.header.is_none()
            }
            fn in_flight(&self) -> usize {
                0
            }
            fn filled(&mut self, n: usize) {
                self.fills.push(n);
            }
            fn fill_at_most(&self) -> usize {
                4 - self.wire.inb.buffered()
            }
        }
        let stream = std::io::Cursor::new(b"HEADpayload!".to_vec());
        let mut p = HeaderAlone {
            wire: Wire::new(stream, -1, 64, "test", "peer".into()),
            header: None,
            payload: vec![0; 8],
            got: 0,
            fills: Vec::new(),
        };
        assert!(read_and_dispatch(&mut p, 1 << 20));
        assert_eq!(p.header.as_deref(), Some(&b"HEAD"[..]));
        assert_eq!(p.payload, b"payload!");
        // One read of the header alone; the payload never passed through
        // the input buffer.
        assert_eq!(p.fills, [4]);
        assert!(!p.wire.is_closing());
    }
}
