//! The transport half of a server connection, shared by the NBD and the
//! replica server (nbdkit splits `connections.c` from `protocol.c` the
//! same way): the stream, the bytes read and not yet parsed, the framed
//! output, the poller's interest, and whether the connection is closing or
//! broken. The protocol half parses frames out of [`Wire::inb`], starts
//! requests and pushes replies; it never touches the socket itself. The
//! engine's replica client uses the same wire with its own payload type
//! (request frames sharing the client's write buffer), driven by the
//! engine core rather than by [`pump`].
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
use lull_uring::BufPool;

use crate::{Fill, InBuf, OutPayload, OutQueue, Payload};

/// How a stream ended in the middle of a payload.
#[derive(Debug)]
pub enum Ended {
    Eof,
    Failed(std::io::Error),
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
    /// reply queue stops reading); whether anything moved.
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
    }
    status
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
    /// pieces (0 = would block); writes are accepted `writes`-sized pieces
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
}
