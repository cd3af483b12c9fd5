//! A replica socket and its frame parser: frames out to a replica, and
//! frames in, each reported to the core as an event.
//!
//! ```ignore
//! // Action::Send:
//! sock.send(&header, payload);        // queued on the wire
//! sock.flush(t)?;                     // written, interest updated
//! // The socket's poller (`run`):
//! sock.read_frames(&mut core, conn, &mut frames)?;
//! for (header, payload) in frames.drain(..) {
//!     shell.run(t, Event::Frame { conn, header, payload }, now);
//! }
//! ```
//!
//! The parser decodes a header, then asks the core where its payload goes
//! ([`Engine::payload_sink`]) before reading a byte of it, receives it
//! there (or splices it into a pipe, for a [`Sink::Pipe`] the socket can
//! splice: docs/PER_IO.md, "Spliced reads"), and hands the frame over with
//! its payload ([`Received`]). Nothing else of the core is called here:
//! what a frame means is the core's business when the event arrives.

use lull_bdev::{BufPool, IoBuf};
use lull_net::link::LinkStream;
use lull_net::wire::{self, Ended, Receive, SpliceIn, Transport, Wire};
use lull_net::OutPayload;
use lull_proto::replica::{self as proto, Header, HEADER_LEN};
use lull_reactor::{PollerId, Thread};
use lull_uring::pipes::SplicePipe;
use lull_uring::splice::PIPE_PAYLOAD_BYTES_MAX;

use super::Shell;
use crate::core::{ConnRef, Engine, Payload, Received, Sink};

/// Why a replica connection ended when the replica closed it.
const REPLICA_CLOSED: &str = "replica closed the connection";

/// Socket input buffer: many small replies per read syscall; large read
/// payloads go straight from the socket into their buffer.
pub(super) const READ_BUFFER_BYTES: usize = 256 * 1024;

/// Bytes read per socket per poller run (into the input buffer, or
/// straight into payload buffers and pipes), so one busy replica
/// connection cannot hold the engine thread from the others.
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

/// Where the parser is in the frame it reads.
enum Recv {
    Header,
    /// Receiving the payload into the buffer of its sink.
    Payload {
        header: Header,
        buf: IoBuf,
        filled: usize,
    },
    /// A client READ's data spliced from the socket into a pipe
    /// ([`Sink::Pipe`]; docs/PER_IO.md, "Spliced reads"). `buf` is the
    /// client's buffer, which travels with the pipe.
    Spliced {
        header: Header,
        buf: IoBuf,
        pipe: SplicePipe,
    },
}

/// A frame read from a replica: its header and its payload as received.
pub(super) type FrameIn = (Header, Received);

/// A replica connection: the transport half is the servers' [`Wire`] (input
/// buffer, framed output, interest, closing state) carrying the core's
/// payloads; the frames it reads are events for the core, which decides
/// about failures and reconnects (so it is not run by `lull_net::wire::pump`).
pub(super) struct Sock {
    pub(super) wire: Wire<LinkStream, Payload>,
    pub(super) poller: PollerId,
    recv: Recv,
    /// READs of at least `HEADER_ALONE_READ_BYTES` sent and not answered:
    /// while there are any, headers are read alone.
    large_reads: usize,
}

/// The engine's frames carry shared write buffers or inline bytes: once
/// written they are only dropped (the core returns client buffers on
/// completion).
impl OutPayload for Payload {
    fn recycle(self, _: &mut BufPool) {
        if let Payload::Pipe(p) = self {
            lull_uring::pipes::put(p);
        }
    }

    /// A copy's spliced data: sent from its pipe after the header.
    fn tail_len(&self) -> usize {
        match self {
            Payload::Pipe(p) => p.held(),
            _ => 0,
        }
    }

    fn send_tail(
        &mut self,
        sock: std::os::fd::RawFd,
        done: usize,
        left: usize,
        more: bool,
    ) -> std::io::Result<usize> {
        let _ = done;
        match self {
            Payload::Pipe(p) => p.drain_to(sock, left, more),
            _ => Err(std::io::ErrorKind::Unsupported.into()),
        }
    }
}

/// A READ request or reply of at least `HEADER_ALONE_READ_BYTES` (a reply
/// names the request's kind and length, whatever its status).
fn is_large_read(h: &Header) -> bool {
    h.kind == proto::Kind::Read && h.length >= HEADER_ALONE_READ_BYTES
}

impl Sock {
    pub(super) fn new(wire: Wire<LinkStream, Payload>, poller: PollerId) -> Sock {
        Sock {
            wire,
            poller,
            recv: Recv::Header,
            large_reads: 0,
        }
    }

    /// Queue a frame (`Action::Send`); `flush` writes it.
    pub(super) fn send(&mut self, header: &[u8; HEADER_LEN], payload: Payload) {
        if proto::decode_header(header).is_ok_and(|h| is_large_read(&h)) {
            self.large_reads += 1;
        }
        self.wire.push(header, payload);
    }

    /// Whether the read failure `reason` is the replica refusing this
    /// engine's credentials: with TLS 1.3 the client's handshake is over
    /// before the server has checked the client's certificate, so that
    /// refusal arrives as a TLS alert on the first read, not in
    /// `client_handshake`.
    pub(super) fn tls_refused(&self, reason: &str) -> bool {
        self.wire.stream.is_tls() && reason.contains("alert")
    }

    /// The reason this connection failed, once it has.
    fn failed(&self) -> Option<String> {
        self.wire.closing_reason().map(str::to_string)
    }

    /// How to receive the `n` payload bytes of `header` into `sink`: a
    /// [`Sink::Pipe`] is spliced into a pipe when the socket can (a plain
    /// link, a READ of at least `HEADER_ALONE_READ_BYTES` that fits a
    /// pipe, nothing of the payload buffered yet, and a pipe to be had);
    /// every other payload goes into its sink's buffer.
    fn receive_into(&self, header: Header, n: usize, sink: Sink) -> Recv {
        let buf = match sink {
            Sink::Pipe(buf)
                if self.wire.splices()
                    && is_large_read(&header)
                    && n <= PIPE_PAYLOAD_BYTES_MAX
                    && self.wire.inb.buffered() == 0 =>
            {
                match lull_uring::pipes::get() {
                    Some(pipe) => return Recv::Spliced { header, buf, pipe },
                    None => buf,
                }
            }
            Sink::Pipe(buf) | Sink::ClientBuffer(buf) | Sink::Own(buf) => buf,
        };
        Recv::Payload {
            header,
            buf,
            filled: 0,
        }
    }

    /// Read and decode what the socket has, within the budget: the
    /// servers' receive loop ([`wire::read_and_dispatch`]) over this
    /// socket's frames ([`Reading`]). For each header that announces a
    /// payload the core is asked where it goes (`Engine::payload_sink`,
    /// the one call into the core); whole frames go to `frames`. An error
    /// (EOF, bad frame) ends the connection.
    pub(super) fn read_frames(
        &mut self,
        engine: &mut Engine,
        conn: ConnRef,
        frames: &mut Vec<FrameIn>,
    ) -> Result<bool, String> {
        if let Some(reason) = self.failed() {
            return Err(reason);
        }
        let mut reading = Reading {
            sock: self,
            engine,
            conn,
            frames,
            budget: READ_BUDGET_BYTES,
            error: None,
            spliced_some: false,
        };
        let progress =
            wire::read_and_dispatch(&mut reading, READ_BUDGET_BYTES) || reading.spliced_some;
        if let Some(reason) = reading.error.take() {
            return Err(reason);
        }
        match self.failed() {
            Some(reason) => Err(reason),
            None => Ok(progress),
        }
    }

    /// Write queued frames; an error ends the connection. Then wait for
    /// writability only while output is queued.
    pub(super) fn flush(&mut self, t: &mut Thread) -> Result<bool, String> {
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

/// One poller run's read of a replica socket: the socket, the core it
/// asks where payloads go, and the frames read so far.
struct Reading<'a> {
    sock: &'a mut Sock,
    engine: &'a mut Engine,
    conn: ConnRef,
    frames: &'a mut Vec<FrameIn>,
    /// Bytes this run may still take from the socket: read into the input
    /// buffer, and received or spliced straight into a payload's buffer or
    /// pipe (`READ_BUDGET_BYTES`).
    budget: usize,
    /// Why the connection ends (a bad frame, the stream ended inside a
    /// payload): nothing more is read.
    error: Option<String>,
    /// Payload bytes were spliced in a step that then waited for the
    /// socket (a step that moved nothing more, to the loop).
    spliced_some: bool,
}

impl Transport for Reading<'_> {
    type Stream = LinkStream;
    type Out = Payload;
    fn wire(&mut self) -> &mut Wire<LinkStream, Payload> {
        &mut self.sock.wire
    }
}

impl Receive for Reading<'_> {
    const EOF_REASON: &'static str = REPLICA_CLOSED;

    fn step(&mut self) -> bool {
        if self.error.is_some() {
            return false;
        }
        match self.step_frame() {
            Ok(moved) => moved,
            Err(reason) => {
                self.error = Some(reason);
                false
            }
        }
    }

    /// The engine reads whatever its replicas send (what it asked for),
    /// within the budget; a payload being spliced waits for the socket
    /// alone (a read into the input buffer would take its bytes).
    fn wants_input(&self) -> bool {
        self.error.is_none() && self.budget > 0 && !matches!(self.sock.recv, Recv::Spliced { .. })
    }

    /// No reply is owed to a replica: at its end of stream the connection
    /// breaks at once.
    fn in_flight(&self) -> usize {
        0
    }

    fn filled(&mut self, n: usize) {
        self.budget = self.budget.saturating_sub(n);
    }

    /// While a large READ is in flight, a header is read alone
    /// (`HEADER_ALONE_READ_BYTES`).
    fn fill_at_most(&self) -> usize {
        if self.sock.large_reads > 0 && matches!(self.sock.recv, Recv::Header) {
            HEADER_LEN.saturating_sub(self.sock.wire.inb.buffered())
        } else {
            usize::MAX
        }
    }
}

impl Reading<'_> {
    /// One step from what is buffered or waiting in the socket: decode a
    /// header (and ask the core where its payload goes), or move payload
    /// bytes into their buffer or pipe. Whether anything moved.
    fn step_frame(&mut self) -> Result<bool, String> {
        let sock = &mut *self.sock;
        match &mut sock.recv {
            Recv::Header => {
                let Some(bytes) = sock.wire.inb.take(HEADER_LEN) else {
                    return Ok(false);
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
                    sock.large_reads = sock.large_reads.saturating_sub(1);
                }
                let n = proto::payload_len(&header);
                if n == 0 {
                    self.frames.push((header, Received::None));
                } else {
                    let sink = self.engine.payload_sink(self.conn, &header);
                    sock.recv = sock.receive_into(header, n, sink);
                }
                Ok(true)
            }
            Recv::Payload { buf, filled, .. } => {
                // Buffered bytes first, then large payloads straight from
                // the socket; only the latter count against the budget
                // (buffered ones did when they were read).
                let len = buf.len();
                let direct = *filled + sock.wire.inb.buffered().min(len - *filled);
                let moved = sock
                    .wire
                    .receive(buf.as_mut_slice(), filled)
                    .map_err(ended)?;
                self.budget = self.budget.saturating_sub(filled.saturating_sub(direct));
                if *filled < len {
                    return Ok(moved);
                }
                if let Recv::Payload { header, buf, .. } =
                    std::mem::replace(&mut sock.recv, Recv::Header)
                {
                    self.frames.push((header, Received::Buf(buf)));
                }
                Ok(true)
            }
            Recv::Spliced { buf, pipe, .. } => {
                let len = buf.len();
                let mut spliced = 0;
                let at = sock.wire.splice_in(pipe, len, &mut spliced);
                self.budget = self.budget.saturating_sub(spliced);
                match at.map_err(ended)? {
                    // Nothing more to do until the socket is readable
                    // again: no second try (a `splice` and a `FIONREAD`
                    // for nothing), but the bytes moved count.
                    SpliceIn::Waiting => {
                        self.spliced_some |= spliced > 0;
                        Ok(false)
                    }
                    SpliceIn::PipeFull => {
                        // Receive the rest into the buffer, after what the
                        // pipe holds.
                        let held = pipe.held();
                        let copied = pipe
                            .read_into(&mut buf.as_mut_slice()[..held])
                            .map_err(|e| format!("read failed: {e}"))?;
                        if let Recv::Spliced { header, buf, pipe } =
                            std::mem::replace(&mut sock.recv, Recv::Header)
                        {
                            lull_uring::pipes::put(pipe);
                            sock.recv = Recv::Payload {
                                header,
                                buf,
                                filled: copied,
                            };
                        }
                        Ok(true)
                    }
                    SpliceIn::Whole => {
                        if let Recv::Spliced { header, buf, pipe } =
                            std::mem::replace(&mut sock.recv, Recv::Header)
                        {
                            self.frames.push((header, Received::Spliced { buf, pipe }));
                        }
                        Ok(true)
                    }
                }
            }
        }
    }
}

/// Why the connection ends when its stream ended inside a payload.
fn ended(how: Ended) -> String {
    match how {
        Ended::Eof => REPLICA_CLOSED.into(),
        Ended::Failed(e) => format!("read failed: {e}"),
    }
}

impl Shell {
    /// `Action::Close`: unregister the socket's poller and shut it down,
    /// abortively.
    pub(super) fn close(&mut self, t: &mut Thread, conn: ConnRef) {
        let (r, c) = (conn.replica, conn.conn);
        let Some(slot) = self.socks.get_mut(r).and_then(|v| v.get_mut(c)) else {
            return;
        };
        if let Some(sock) = slot.take() {
            // Unregister before the fd closes (the stream drops after).
            t.unregister_poller(sock.poller);
            if let Some(tcp) = sock.wire.stream.tcp() {
                // An abortive close: a reset, and the socket's send queue
                // dropped. Only a failed (or removed) replica's
                // connections close here, and the core has finished
                // their requests as failed; a plain close would leave
                // the queued writes to the kernel, which sends them once
                // a cut link heals, and a replica rebuilt and attached
                // again by then would execute them (the same engine
                // session) over newer data (docs/OPERATING.md, "Late
                // writes").
                let _ = socket2::SockRef::from(tcp).set_linger(Some(std::time::Duration::ZERO));
                let _ = tcp.shutdown(std::net::Shutdown::Both);
            }
            drop(sock);
        }
    }
}
