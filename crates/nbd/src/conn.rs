//! One NBD client connection, run by its poller in a poll group.
//!
//! Each run of the poller goes round: reap device completions into replies,
//! write replies, read requests and submit them, until a round makes no
//! progress (or the round budget is spent, in which case the poller wakes
//! itself). Nothing blocks: a full socket raises the writable interest, a
//! full slot table or reply queue stops reading (back-pressure) until
//! completions or the socket free room.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use lull_bdev::{
    BdevError, ChangeRun, Channel, Data, Extent, IoBuf, IoCompletion, IoOp, IoRequest, Spliced,
};
use lull_net::server::Connection;
use lull_net::slots::{SlotId, SlotTable};
use lull_net::tls::TlsStream;
use lull_net::wire::{self, Receive as _, Recv, Submissions, Wire};
use lull_net::{bufs, shared, Payload};
use lull_proto::nbd::structured::{self, BlockExtent, ReadPiece};
use lull_proto::nbd::{
    self, ChangedContext, Command, HandshakeStatus, Request, ServerHandshake, Verdict, REQUEST_LEN,
    SIMPLE_REPLY_LEN,
};
use lull_reactor::{Clock, Interest, PollStatus, Thread};
use lull_volume::{OpKind, Volume};

use crate::stream::Stream;
use crate::{Admitted, ExportList, ServerShared};
use lull_volume::ConnPermit;

/// Requests in flight per connection. Bounds the slot table, the buffers a
/// client can pin (with `MAX_REPLY_QUEUE_BYTES`) and the device queue share
/// of one client. fio's kbench profile uses depth 64; qemu uses 16.
pub const MAX_IN_FLIGHT: usize = 128;

/// Reply bytes queued before the connection stops reading new requests: a
/// client that does not read its replies cannot make the server buffer
/// without bound. Two maximum-size reads.
pub const MAX_REPLY_QUEUE_BYTES: usize = 2 * nbd::MAX_PAYLOAD_BYTES as usize;

/// Input buffer size: many small requests per read syscall; write payloads
/// larger than what it holds are read straight into their I/O buffer. Held
/// only while bytes are buffered (see `lull_net::bufs`).
const READ_BUFFER_BYTES: usize = 256 * 1024;

/// Bytes read per poller run, so one busy client cannot hold its reactor
/// away from other threads for long.
const READ_BUDGET_BYTES: usize = 4 * 1024 * 1024;

/// Rounds per poller run (see the module doc); more work wakes the poller
/// again instead of looping here.
const MAX_ROUNDS: usize = 8;

#[derive(Clone, Copy)]
struct InFlight {
    cookie: u64,
    command: Command,
    offset: u64,
    length: u32,
    /// A WriteZeroes with `NBD_CMD_FLAG_FAST_ZERO`: a refusal is `NBD_ENOTSUP`.
    fast_zero: bool,
    /// A BlockStatus with `NBD_CMD_FLAG_REQ_ONE`: one extent per context.
    req_one: bool,
    /// A BlockStatus whose device request now is the `lull:changed:`
    /// one (`IoOp::ChangedSince`); its `base:allocation` extents, if any,
    /// wait in `Conn::stashed_base`.
    changed_step: bool,
    /// When the request was taken, for the latency histogram: read from
    /// the framework's clock (`clock_ns`), which falls back to the run's
    /// `now` only when no clock was set. The protocol logic itself takes
    /// time as an argument; only these latency stamps read the clock.
    start_ns: u64,
}

enum Phase {
    Handshake(ServerHandshake),
    Transmission {
        volume: Arc<Volume>,
        channel: Box<dyn Channel>,
        /// This connection's place on the volume (given back on drop).
        _permit: ConnPermit,
        size: u64,
        tflags: u16,
        /// Reads (and block status) answer in structured chunks.
        structured: bool,
        /// `base:allocation` was negotiated: block status reports it.
        base_allocation: bool,
        /// The `lull:changed:SNAPSHOT` context negotiated, if any: block
        /// status reports it too (asking the device inline, see
        /// `push_block_status`).
        changed: Option<ChangedContext>,
    },
}

pub(crate) struct Conn {
    /// The socket, its buffers and the closing/broken state
    /// (`lull_net::wire`, shared with the replica server).
    wire: Wire<Stream>,
    server: Arc<ServerShared>,
    phase: Phase,
    /// Requests in flight; a slot's wire id is the device tag (the
    /// client's cookie stays in the slot). Grows to the connection's
    /// deepest queue (at most `MAX_IN_FLIGHT`), so an idle or QD1
    /// connection keeps a few slots, not 128.
    slots: SlotTable<InFlight>,
    /// Between requests, or in a write's payload (`lull_net::wire`).
    recv: Recv<Request>,
    /// A request the device refused as full, and requests queued and not
    /// pushed yet (`advance` pushes them once per batch).
    subs: Submissions<IoRequest>,
    pub(crate) handshake_done: Arc<AtomicBool>,
    /// STARTTLS was acknowledged: once the ACK is written, the stream
    /// moves into a TLS session. No plaintext is read meanwhile.
    starting_tls: bool,
    /// Completions of one `reap`, kept so the hot path does not allocate.
    completions: Vec<IoCompletion>,
    /// A structured read's zero ranges and chunks, kept for the same
    /// reason (each at most `structured::MAX_READ_CHUNKS` long).
    read_zeros: Vec<(u32, u32)>,
    read_pieces: Vec<ReadPiece>,
    /// The `base:allocation` extents of block status requests whose
    /// `lull:changed:` part is being asked of the device, by slot (wire
    /// id); at most one per slot in flight.
    stashed_base: Vec<(u64, Vec<Extent>)>,
    /// `now` of the current poller run.
    now_ns: u64,
    /// The framework's clock, read when a request starts and completes
    /// for the latency histogram (the iteration's `now` is too coarse:
    /// a memory volume completes within one iteration).
    clock: Option<Arc<dyn Clock>>,
}

impl Connection for Conn {
    fn fd(&self) -> RawFd {
        self.wire.fd()
    }

    fn interest(&self) -> Interest {
        self.wire.interest()
    }

    fn greeted(&self) -> Arc<AtomicBool> {
        self.handshake_done.clone()
    }

    fn poll(&mut self, t: &mut Thread, now: u64, greeting_expired: bool) -> PollStatus {
        self.run(t, now, greeting_expired)
    }

    /// The export, once the handshake chose it: a volume's connections are
    /// spread over the poll groups.
    fn affinity(&self) -> Option<String> {
        match &self.phase {
            Phase::Transmission { volume, .. } if !self.wire.is_closing() => {
                Some(volume.name.clone())
            }
            _ => None,
        }
    }
}

impl wire::Protocol for Conn {
    type Stream = Stream;

    fn wire(&mut self) -> &mut Wire<Stream> {
        &mut self.wire
    }

    /// Reap, retry a held request, then push what was queued since the
    /// last round (the requests `read_and_dispatch` queued, which `pump`
    /// always follows with an `advance`, and any a completion queued).
    fn advance(&mut self) -> bool {
        let reaped = self.reap();
        let retried = self.retry_submit();
        self.flush_submissions();
        // Before the replies are written (see `lull_volume::StatsBatch`).
        lull_volume::add_batched_stats();
        reaped | retried
    }

    fn read_and_dispatch(&mut self) -> bool {
        wire::read_and_dispatch(self, READ_BUDGET_BYTES)
    }

    /// Closing in the middle of a write payload (a stop, a protocol error
    /// on the other half): the half-received write's slot is given back,
    /// so the connection can finish instead of waiting for bytes it will
    /// never read (it held the slot until the stop timeout before).
    fn abandon_input(&mut self) -> bool {
        wire::abandon_frame(self)
    }

    fn busy(&self) -> bool {
        self.in_flight() > 0
    }

    fn completions_fd(&self) -> Option<RawFd> {
        match &self.phase {
            Phase::Transmission { channel, .. } => channel.event_fd(),
            Phase::Handshake(_) => None,
        }
    }

    fn completions_polled(&self) -> bool {
        match &self.phase {
            // A held request with nothing of ours in flight waits for the
            // volume's other connections (its in-flight cap, see
            // `lull_volume::VolumeChannel`): no completion of ours will
            // wake us, so poll until there is room.
            // One held by a rate limit waits for its time instead
            // (`wake_at_ns`).
            Phase::Transmission { channel, .. } => {
                (channel.polled() && channel.in_flight() > 0)
                    || (self.subs.holding()
                        && channel.in_flight() == 0
                        && channel.retry_at_ns().is_none())
            }
            Phase::Handshake(_) => false,
        }
    }

    fn wake_at_ns(&self) -> Option<u64> {
        match &self.phase {
            Phase::Transmission { channel, .. } if self.subs.holding() => channel.retry_at_ns(),
            _ => None,
        }
    }

    fn stream_wants_write(&self) -> bool {
        matches!(&self.wire.stream, Stream::Tls(s) if s.wants_write())
    }

    fn stranded_input(&self) -> bool {
        matches!(&self.wire.stream, Stream::Tls(s) if s.pending() > 0)
            && !self.wire.is_closing()
            && self.wants_input()
    }
}

impl wire::Receive for Conn {
    const EOF_REASON: &'static str = "client disconnected";

    fn step(&mut self) -> bool {
        match self.phase {
            Phase::Handshake(_) => self.handshake_step(),
            Phase::Transmission { .. } => wire::step_frame(self),
        }
    }

    fn wants_input(&self) -> bool {
        match &self.phase {
            // The TLS handshake reads the socket itself.
            Phase::Handshake(_) => !self.starting_tls && !self.tls_handshaking(),
            Phase::Transmission { .. } => self.recv.mid_frame() || self.can_take_request(),
        }
    }

    fn in_flight(&self) -> usize {
        self.slots.in_flight()
    }
}

/// Requests and their write payloads (`lull_net::wire` moves the bytes).
impl wire::ReceiveFrames for Conn {
    type Frame = Request;
    const EOF_IN_PAYLOAD_REASON: &'static str =
        "client disconnected in the middle of a write payload";

    fn recv(&mut self) -> &mut Recv<Request> {
        &mut self.recv
    }

    /// A request header: refused, answered at once, or started.
    fn take_frame(&mut self) -> bool {
        if self.wire.inb.buffered() < REQUEST_LEN || !self.can_take_request() {
            return false;
        }
        let Phase::Transmission { size, tflags, .. } = &self.phase else {
            return false;
        };
        let (size, tflags) = (*size, *tflags);
        let mut header = [0u8; REQUEST_LEN];
        let Some(raw) = self.wire.inb.take(REQUEST_LEN) else {
            return false;
        };
        header.copy_from_slice(raw);
        let req = match nbd::decode_request(&header) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), error = %e, "bad request header");
                self.close(format!("bad request: {e}"));
                return true;
            }
        };
        match nbd::validate(&req, size, tflags) {
            Verdict::Disconnect(why) => {
                tracing::warn!(peer = %self.wire.peer(), ?req, why, "request cannot be answered; disconnecting");
                self.close(why);
            }
            Verdict::Error {
                nbd_error,
                drain_bytes,
            } => {
                if nbd_error == nbd::NBD_EPERM {
                    // A write to a read-only export (a snapshot): the
                    // client's mistake or probe, answered, not a fault of
                    // the server worth a warning.
                    tracing::debug!(peer = %self.wire.peer(), ?req, "refused a modifying request on a read-only export");
                } else {
                    tracing::warn!(peer = %self.wire.peer(), ?req, nbd_error, "refused request");
                }
                if drain_bytes > 0 {
                    self.recv = Recv::drain(u64::from(drain_bytes), req, nbd_error);
                } else {
                    self.push_error(req.cookie, req.command, nbd_error, "request refused");
                }
            }
            Verdict::Ok => self.start_request(req),
        }
        true
    }

    fn payload_received(&mut self, slot: SlotId, req: Request, buf: IoBuf) {
        let fua = req.flags & nbd::NBD_CMD_FLAG_FUA != 0;
        self.submit(slot, &req, IoOp::Write { fua }, Some(buf));
    }

    fn payload_lost(&mut self, slot: SlotId) {
        self.slots.take(slot.to_wire());
    }

    fn drained(&mut self, req: Request, error: u32) {
        self.push_reply(req.cookie, error, None);
    }
}

impl Conn {
    pub(crate) fn set_clock(&mut self, clock: Arc<dyn Clock>) {
        self.clock = Some(clock);
    }

    fn clock_ns(&self) -> u64 {
        self.clock.as_ref().map_or(self.now_ns, |c| c.now_ns())
    }

    pub(crate) fn new(stream: Stream, server: Arc<ServerShared>) -> Conn {
        let mut greeting = Vec::new();
        let policy = server
            .tls
            .as_ref()
            .map_or_else(Default::default, |t| t.policy);
        let hs = ServerHandshake::with_tls(&mut greeting, policy);
        let (fd, peer) = (stream.as_raw_fd(), stream.peer());
        // It waits for both directions at first, so the greeting goes out
        // at once.
        let mut wire = Wire::new(stream, fd, READ_BUFFER_BYTES, "NBD", peer);
        wire.push(&[], Payload::Bytes(greeting));
        Conn {
            wire,
            server,
            phase: Phase::Handshake(hs),
            slots: SlotTable::new(MAX_IN_FLIGHT),
            recv: Recv::Header,
            subs: Submissions::default(),
            handshake_done: Arc::new(AtomicBool::new(false)),
            starting_tls: false,
            completions: Vec::new(),
            read_zeros: Vec::new(),
            read_pieces: Vec::new(),
            stashed_base: Vec::new(),
            now_ns: 0,
            clock: None,
        }
    }

    /// Close because the handshake did not finish in time.
    pub(crate) fn handshake_timed_out(&self) -> bool {
        !self.handshake_done.load(Ordering::Relaxed)
    }

    fn close(&mut self, reason: impl Into<String>) {
        self.wire.close(reason);
    }

    /// The poller body: the deadline and shutdown checks, then the shared
    /// pump (`lull_net::wire::pump`). Returns Busy when anything moved.
    fn run(&mut self, t: &mut Thread, now: u64, deadline_passed: bool) -> PollStatus {
        self.now_ns = now;
        if deadline_passed && self.handshake_timed_out() {
            self.close("handshake timed out");
        }
        if !self.wire.is_closing() && self.server.conns.stopping() {
            self.close("server shutting down");
        }
        wire::pump(self, t, MAX_ROUNDS)
    }

    /// Move device completions into the reply queue.
    fn reap(&mut self) -> bool {
        let Phase::Transmission { channel, .. } = &mut self.phase else {
            return false;
        };
        let mut done = std::mem::take(&mut self.completions);
        let n = channel.reap(&mut |c| done.push(c));
        for c in done.drain(..) {
            self.complete(c);
        }
        self.completions = done;
        n > 0
    }

    fn complete(&mut self, c: IoCompletion) {
        let Some(inflight) = self.slots.take(c.tag) else {
            tracing::error!(peer = %self.wire.peer(), tag = c.tag, "completion for an unknown slot");
            return;
        };
        if let Phase::Transmission { volume, .. } = &self.phase {
            let op = match inflight.command {
                Command::Read => Some(OpKind::Read),
                Command::Write => Some(OpKind::Write),
                Command::Flush => Some(OpKind::Flush),
                Command::Trim => Some(OpKind::Trim),
                Command::WriteZeroes => Some(OpKind::WriteZeroes),
                Command::Disc | Command::Cache | Command::BlockStatus | Command::Unknown(_) => None,
            };
            if let Some(op) = op {
                let latency = self.clock_ns().saturating_sub(inflight.start_ns);
                volume.stats.record_batched(
                    op,
                    u64::from(inflight.length),
                    latency,
                    c.result.is_ok(),
                );
            }
        }
        let base = if inflight.changed_step {
            self.stashed_base
                .iter()
                .position(|(tag, _)| *tag == c.tag)
                .map(|i| self.stashed_base.swap_remove(i).1)
        } else {
            None
        };
        match c.result {
            Ok(()) if inflight.command == Command::BlockStatus && inflight.changed_step => {
                let runs: Vec<ChangeRun> = c
                    .buf
                    .as_ref()
                    .map(|b| lull_bdev::change_records(b.as_slice()).collect())
                    .unwrap_or_default();
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.push_block_status(
                    inflight.cookie,
                    inflight.offset,
                    inflight.length,
                    inflight.req_one,
                    base.as_deref(),
                    Some(runs),
                );
            }
            Ok(()) if inflight.command == Command::BlockStatus => {
                let extents: Vec<Extent> = c
                    .buf
                    .as_ref()
                    .map(|b| lull_bdev::extent_records(b.as_slice()).collect())
                    .unwrap_or_default();
                let changed_by_channel = match &self.phase {
                    Phase::Transmission {
                        volume, changed, ..
                    } => changed.is_some() && volume.dev().changed_by_channel(),
                    Phase::Handshake(_) => false,
                };
                if changed_by_channel {
                    // Now the `lull:changed:` part, in a slot again, with
                    // these extents kept for the reply.
                    let Some(slot) = self.slots.insert(InFlight {
                        changed_step: true,
                        ..inflight
                    }) else {
                        debug_assert!(false, "the slot just freed");
                        if let Some(b) = c.buf {
                            bufs::put(b);
                        }
                        return;
                    };
                    self.stashed_base.push((slot.to_wire(), extents));
                    let mut buf = c
                        .buf
                        .unwrap_or_else(|| bufs::get(lull_bdev::EXTENT_RECORD_LEN));
                    let records = max_extents(inflight.req_one) * lull_bdev::EXTENT_RECORD_LEN;
                    if buf.capacity() >= records {
                        buf.set_len(records);
                    }
                    self.submit_io(IoRequest {
                        tag: slot.to_wire(),
                        op: IoOp::ChangedSince,
                        offset: inflight.offset,
                        len: inflight.length,
                        buf: Some(buf),
                    });
                    return;
                }
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                // The device wrote at most as many records as the buffer
                // had room for: one for REQ_ONE.
                self.push_block_status(
                    inflight.cookie,
                    inflight.offset,
                    inflight.length,
                    inflight.req_one,
                    Some(&extents),
                    None,
                );
            }
            Ok(()) if inflight.command == Command::Read => match c.data {
                Data::Spliced(spliced) => {
                    if let Some(b) = c.buf {
                        bufs::put(b);
                    }
                    self.push_read_spliced(&inflight, spliced);
                }
                Data::Lent(lent) => {
                    if let Some(b) = c.buf {
                        bufs::put(b);
                    }
                    self.push_read_lent(&inflight, lent);
                }
                Data::Buf => match c.buf {
                    Some(buf) if self.structured() => self.push_read_structured(
                        inflight.cookie,
                        inflight.offset,
                        buf,
                        inflight.length,
                    ),
                    data => self.push_reply(inflight.cookie, 0, data),
                },
            },
            Ok(()) => {
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.push_reply(inflight.cookie, 0, None);
            }
            Err(e) => {
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                let errno = e.errno();
                let error = if inflight.fast_zero && errno == libc::EOPNOTSUPP {
                    // The one place the spec wants NBD_ENOTSUP: the
                    // client falls back to writing zeros itself.
                    tracing::debug!(peer = %self.wire.peer(), cookie = inflight.cookie, error = %e, "fast zero refused");
                    nbd::NBD_ENOTSUP
                } else {
                    tracing::warn!(peer = %self.wire.peer(), cookie = inflight.cookie, command = ?inflight.command, error = %e, "I/O failed");
                    nbd::errno_to_nbd(errno)
                };
                self.push_error(inflight.cookie, inflight.command, error, &e.to_string());
            }
        }
    }

    fn structured(&self) -> bool {
        matches!(
            self.phase,
            Phase::Transmission {
                structured: true,
                ..
            }
        )
    }

    /// An error reply: an error chunk for reads and block status when
    /// structured replies were negotiated (the spec lets every other
    /// command keep simple replies, as qemu-nbd does), else simple.
    fn push_error(&mut self, cookie: u64, command: Command, error: u32, message: &str) {
        if self.structured() && matches!(command, Command::Read | Command::BlockStatus) {
            let chunk = structured::encode_error(cookie, error, message);
            self.wire.push(&[], Payload::Bytes(chunk));
        } else {
            self.push_reply(cookie, error, None);
        }
    }

    /// A successful read as structured chunks: holes the device knows of
    /// (and that did read as zeros) go as hole chunks, the rest as data.
    /// Data goes from the buffer the device read into, with no copy: a
    /// read with no hole as one chunk, one with holes as slices of the
    /// buffer shared by its data chunks.
    fn push_read_structured(&mut self, cookie: u64, offset: u64, buf: IoBuf, len: u32) {
        let Phase::Transmission { volume, .. } = &self.phase else {
            bufs::put(buf);
            return;
        };
        let mut zero_ranges = std::mem::take(&mut self.read_zeros);
        zero_ranges.clear();
        let mut pieces = std::mem::take(&mut self.read_pieces);
        let data = buf.as_slice().get(..len as usize).unwrap_or_default();
        // Ask the device only when the data could hold a hole at all. A
        // device that cannot answer inline: the zeros read are the holes.
        if volume.dev().extents_by_channel() {
            structured::zero_runs_into(data, structured::MAX_READ_CHUNKS, &mut zero_ranges);
        } else if structured::may_hold_hole(data) {
            if let Ok(extents) =
                volume
                    .dev()
                    .extents(offset, u64::from(len), structured::MAX_READ_CHUNKS)
            {
                let mut at = 0u64;
                for e in extents {
                    if e.zero {
                        // Both fit: the extents lie inside the read.
                        zero_ranges.push((at as u32, e.length_bytes as u32));
                    }
                    at += e.length_bytes;
                }
            }
        }
        structured::plan_read_into(data, &zero_ranges, structured::MAX_READ_CHUNKS, &mut pieces);
        self.read_zeros = zero_ranges;
        self.push_read_pieces(cookie, offset, buf, len, &pieces);
        self.read_pieces = pieces;
    }

    /// A read whose data a descriptor holds: a pipe (a replicated
    /// volume's, spliced from the replica's socket) or a file range (a
    /// file volume's on a memory filesystem): the reply header, then the
    /// pipe spliced or the range sent (`sendfile`) into the socket, no
    /// copy. Structured replies send it as one data chunk: the bytes are
    /// not seen, so no hole is looked for in them (the volume's
    /// BLOCK_STATUS still reports its holes; a file range holds none, a
    /// device lends only ranges without a hole).
    fn push_read_spliced(&mut self, inflight: &InFlight, spliced: Spliced) {
        if spliced.len() != inflight.length as usize {
            self.wrong_read_length(inflight, spliced.len(), "spliced");
            spliced.release();
            return;
        }
        if let Phase::Transmission { volume, .. } = &self.phase {
            match spliced {
                Spliced::Pipe(_) => volume.stats.spliced_read_batched(),
                Spliced::File(_) => volume.stats.sendfile_read_batched(),
            }
        }
        let payload = match spliced {
            Spliced::Pipe(pipe) => Payload::Pipe(pipe),
            Spliced::File(r) => Payload::File {
                file: r.file,
                offset: r.offset,
                len: r.len,
            },
        };
        self.push_read_whole(inflight, payload);
    }

    /// A read whose data the device lent (a memory volume's): the reply
    /// header, then the bytes written from the device's memory (by the
    /// same `writev` as the header, or through the TLS session); the loan
    /// goes once they are written. Structured replies send one data
    /// chunk: a device lends only written memory, which `extents`
    /// reports as data, so there is no hole chunk to make of it.
    fn push_read_lent(&mut self, inflight: &InFlight, lent: lull_bdev::Lent) {
        if lent.len() != inflight.length as usize {
            self.wrong_read_length(inflight, lent.len(), "lent");
            return;
        }
        if let Phase::Transmission { volume, .. } = &self.phase {
            volume.stats.lent_read_batched();
        }
        self.push_read_whole(inflight, Payload::Lent(lent));
    }

    /// A read's data handed over whole (a pipe or a loan): the reply
    /// header, then `payload`; a structured reply as one data chunk.
    fn push_read_whole(&mut self, inflight: &InFlight, payload: Payload) {
        if self.structured() {
            let header = structured::encode_offset_data_header(
                inflight.cookie,
                nbd::NBD_REPLY_FLAG_DONE,
                inflight.offset,
                inflight.length,
            );
            self.wire.push(&header, payload);
        } else {
            self.push_simple(inflight.cookie, 0, payload);
        }
    }

    /// The device handed over `held` bytes (`how`: spliced or lent) for a
    /// read of another length: a bug; the read fails with EIO.
    fn wrong_read_length(&mut self, inflight: &InFlight, held: usize, how: &str) {
        tracing::error!(peer = %self.wire.peer(), cookie = inflight.cookie, held,
            length = inflight.length, how, "read data of the wrong length");
        self.push_error(
            inflight.cookie,
            Command::Read,
            nbd::NBD_EIO,
            "internal error",
        );
    }

    /// The chunks `plan_read` made of a read: one data chunk (no hole) from
    /// its buffer; otherwise hole chunks and data chunks that are slices of
    /// the buffer, shared by them.
    fn push_read_pieces(
        &mut self,
        cookie: u64,
        offset: u64,
        buf: IoBuf,
        len: u32,
        pieces: &[ReadPiece],
    ) {
        if let [ReadPiece::Data { .. }] = pieces {
            let header = structured::encode_offset_data_header(
                cookie,
                nbd::NBD_REPLY_FLAG_DONE,
                offset,
                len,
            );
            self.wire.push(&header, Payload::Buf(buf));
            return;
        }
        let last = pieces.len().saturating_sub(1);
        let data = pieces.iter().any(|p| matches!(p, ReadPiece::Data { .. }));
        let shared = if data {
            Some(shared::share(buf))
        } else {
            bufs::put(buf);
            None
        };
        for (i, piece) in pieces.iter().enumerate() {
            let flags = if i == last {
                nbd::NBD_REPLY_FLAG_DONE
            } else {
                0
            };
            match *piece {
                ReadPiece::Data { at, len } => {
                    let header = structured::encode_offset_data_header(
                        cookie,
                        flags,
                        offset + u64::from(at),
                        len,
                    );
                    let Some(buf) = &shared else {
                        continue; // never: there is a data piece
                    };
                    let slice = Payload::Slice {
                        buf: buf.clone(),
                        at: at as usize,
                        len: len as usize,
                    };
                    self.wire.push(&header, slice);
                }
                ReadPiece::Hole { at, len } => {
                    let chunk =
                        structured::encode_offset_hole(cookie, flags, offset + u64::from(at), len);
                    self.wire.push(&chunk, Payload::None);
                }
            }
        }
    }

    /// Answers `NBD_CMD_BLOCK_STATUS`: one chunk per negotiated context,
    /// each at most one extent with `REQ_ONE`, else at most
    /// `MAX_BLOCK_STATUS_EXTENTS` (a prefix of the range; the client asks
    /// again for the rest). `base:allocation` comes from the device's
    /// extents; a device that must do I/O to know (a replicated volume
    /// asks a replica) gets an `IoOp::BlockStatus` on the channel, in a
    /// slot like a read, and the reply is made in `complete`.
    /// `lull:changed:` is a metadata lookup made when the reply is
    /// (`push_block_status`), except on a device that must do I/O for it
    /// too (a replicated snapshot's view): then an `IoOp::ChangedSince`
    /// follows in the same slot (after the `IoOp::BlockStatus`, if any;
    /// the base extents wait in `stashed_base`), asking about the
    /// snapshot the connection's context names
    /// (`Channel::set_changed_since`, set when transmission starts).
    fn block_status(&mut self, req: &Request) {
        let Phase::Transmission {
            volume,
            base_allocation,
            changed,
            ..
        } = &self.phase
        else {
            return;
        };
        if !base_allocation && changed.is_none() {
            self.push_error(
                req.cookie,
                req.command,
                nbd::NBD_EINVAL,
                "no metadata context was negotiated",
            );
            return;
        }
        let req_one = req.flags & nbd::NBD_CMD_FLAG_REQ_ONE != 0;
        let max = max_extents(req_one);
        let base_by_channel = *base_allocation && volume.dev().extents_by_channel();
        let changed_by_channel = changed.is_some() && volume.dev().changed_by_channel();
        // The base extents, when the device answers them inline.
        let base = if *base_allocation && !base_by_channel {
            match volume.dev().extents(req.offset, u64::from(req.length), max) {
                Ok(extents) => Some(extents),
                Err(e) => {
                    tracing::warn!(peer = %self.wire.peer(), ?req, error = %e, "block status failed");
                    let error = nbd::errno_to_nbd(e.errno());
                    self.push_error(req.cookie, req.command, error, &e.to_string());
                    return;
                }
            }
        } else {
            None
        };
        if base_by_channel || changed_by_channel {
            // Base first (by channel, or inline and kept for the reply),
            // then the changed part (`complete` moves on to it).
            let start_ns = self.clock_ns();
            let Some(slot) = self.slots.insert(InFlight {
                cookie: req.cookie,
                command: req.command,
                offset: req.offset,
                length: req.length,
                fast_zero: false,
                req_one,
                changed_step: !base_by_channel,
                start_ns,
            }) else {
                debug_assert!(false, "take_request checked for a free slot");
                return;
            };
            let buf = bufs::get(max * lull_bdev::EXTENT_RECORD_LEN);
            if base_by_channel {
                self.submit(slot, req, IoOp::BlockStatus, Some(buf));
            } else {
                if let Some(base) = base {
                    self.stashed_base.push((slot.to_wire(), base));
                }
                self.submit(slot, req, IoOp::ChangedSince, Some(buf));
            }
            return;
        }
        self.push_block_status(
            req.cookie,
            req.offset,
            req.length,
            req_one,
            base.as_deref(),
            None,
        );
    }

    /// The reply to a block status request of `length` bytes at `offset`:
    /// the `base:allocation` chunk from `base` (when that context was
    /// negotiated), then the `lull:changed:` chunk (when that one was),
    /// asked of the device here; the last chunk carries DONE. Each
    /// context's extents are cut to what `REQ_ONE` allows and to the
    /// request's length. Any failure answers the whole request with one
    /// error chunk instead: in particular a snapshot deleted while the
    /// client is connected (`NBD_EINVAL`: the context the client chose
    /// names nothing any more, which no retry mends; the connection stays
    /// up and its base:allocation is still served if selected).
    fn push_block_status(
        &mut self,
        cookie: u64,
        offset: u64,
        length: u32,
        req_one: bool,
        base: Option<&[Extent]>,
        runs: Option<Vec<ChangeRun>>,
    ) {
        let Phase::Transmission {
            volume, changed, ..
        } = &self.phase
        else {
            return;
        };
        let max = max_extents(req_one);
        // An extent inside the request fits its u32 length.
        let cap = |len: u64| len.min(u64::from(length)) as u32;
        let changed_chunk = match changed {
            None => None,
            Some(context) => {
                let asked = match runs {
                    // Asked of the device through the channel.
                    Some(runs) => Ok(runs),
                    None => volume.dev().changed_since(
                        &context.snapshot,
                        offset,
                        u64::from(length),
                        max,
                    ),
                };
                match asked {
                    Ok(runs) => Some((context.id, change_extents(&runs, max, cap))),
                    Err(e) => {
                        let error = match e {
                            BdevError::NoSuchSnapshot(_) => nbd::NBD_EINVAL,
                            _ => nbd::errno_to_nbd(e.errno()),
                        };
                        let message = format!("{}: {e}", context.name());
                        tracing::warn!(peer = %self.wire.peer(), cookie, offset, length,
                            context = %context.name(), error = %e, "block status of the changed context failed");
                        self.push_error(cookie, Command::BlockStatus, error, &message);
                        return;
                    }
                }
            }
        };
        let base_chunk = base.map(|extents| {
            let extents: Vec<BlockExtent> = extents
                .iter()
                .filter(|e| e.length_bytes > 0)
                .take(max)
                .map(|e| BlockExtent {
                    length: cap(e.length_bytes),
                    flags: if e.hole {
                        structured::NBD_STATE_HOLE
                    } else {
                        0
                    } | if e.zero {
                        structured::NBD_STATE_ZERO
                    } else {
                        0
                    },
                })
                .collect();
            (structured::BASE_ALLOCATION_ID, extents)
        });
        let chunks: Vec<(u32, Vec<BlockExtent>)> =
            base_chunk.into_iter().chain(changed_chunk).collect();
        if chunks.is_empty() || chunks.iter().any(|(_, extents)| extents.is_empty()) {
            debug_assert!(false, "a device reported no extents");
            self.push_error(cookie, Command::BlockStatus, nbd::NBD_EIO, "no extents");
            return;
        }
        let bytes: usize = chunks
            .iter()
            .map(|(_, e)| structured::CHUNK_HEADER_LEN + 4 + 8 * e.len())
            .sum();
        let mut out = Vec::with_capacity(bytes);
        let last = chunks.len() - 1;
        for (i, (id, extents)) in chunks.iter().enumerate() {
            let flags = if i == last {
                nbd::NBD_REPLY_FLAG_DONE
            } else {
                0
            };
            structured::encode_block_status(&mut out, cookie, flags, *id, extents);
        }
        self.wire.push(&[], Payload::Bytes(out));
    }

    fn push_reply(&mut self, cookie: u64, error: u32, data: Option<IoBuf>) {
        self.push_simple(cookie, error, data.map_or(Payload::None, Payload::Buf));
    }

    /// A simple reply followed by `payload`.
    fn push_simple(&mut self, cookie: u64, error: u32, payload: Payload) {
        let mut header = [0u8; SIMPLE_REPLY_LEN];
        nbd::encode_simple_reply(&mut header, error, cookie);
        self.wire.push(&header, payload);
    }

    /// Whether a new request may be taken (back-pressure).
    fn can_take_request(&self) -> bool {
        !self.slots.is_full()
            && self.wire.out.bytes() < MAX_REPLY_QUEUE_BYTES
            && !self.subs.holding()
    }

    fn tls_handshaking(&self) -> bool {
        matches!(&self.wire.stream, Stream::Tls(s) if !s.is_established())
    }

    /// The STARTTLS ACK is written: move the stream into a TLS session.
    fn start_tls(&mut self) -> bool {
        if !self.wire.out.is_empty() {
            return false;
        }
        self.starting_tls = false;
        let Some(tls) = &self.server.tls else {
            self.close("STARTTLS acknowledged without TLS credentials");
            return true;
        };
        let plain = std::mem::replace(&mut self.wire.stream, Stream::Gone);
        match TlsStream::new(&tls.ctx, plain) {
            Ok(s) => self.wire.stream = Stream::Tls(Box::new(s)),
            Err(e) => self.close(format!("cannot start TLS: {e}")),
        }
        true
    }

    /// Drive the TLS handshake; once done, option haggling goes on inside.
    fn tls_step(&mut self) -> bool {
        let (Stream::Tls(s), Phase::Handshake(hs)) = (&mut self.wire.stream, &mut self.phase)
        else {
            return false;
        };
        match s.handshake() {
            Ok(true) => {
                hs.tls_started();
                true
            }
            Ok(false) => false,
            Err(e) => {
                // Wrong PSK, a refused certificate, a client that gave up:
                // the one log line is the close's.
                self.wire.set_broken();
                self.close(e.to_string());
                true
            }
        }
    }

    fn handshake_step(&mut self) -> bool {
        if self.starting_tls {
            return self.start_tls();
        }
        if self.tls_handshaking() {
            return self.tls_step();
        }
        let Phase::Handshake(hs) = &mut self.phase else {
            return false;
        };
        if self.wire.inb.buffered() == 0 {
            return false;
        }
        let mut reply = Vec::new();
        let peer = self.wire.peer().to_string();
        let exports = ExportList::of(&self.server.volumes, &peer);
        let result = hs.feed(self.wire.inb.peek(), &exports, &mut reply);
        let negotiated = hs.negotiated();
        if !reply.is_empty() {
            self.wire.out.push(&[], Payload::Bytes(reply));
        }
        match result {
            Ok((used, HandshakeStatus::NeedMore)) => {
                self.wire.inb.consume(used);
                if used == 0 && self.wire.inb.buffered() >= nbd::MAX_HANDSHAKE_MESSAGE_LEN {
                    self.close("handshake message too long");
                }
                used > 0
            }
            Ok((used, HandshakeStatus::Done { export_name, info })) => {
                self.wire.inb.consume(used);
                self.handshake_done.store(true, Ordering::Relaxed);
                // `admit` took the volume's place and opened its channel
                // before the final reply was written.
                let Some(Admitted {
                    volume,
                    channel,
                    permit,
                }) = exports.admitted.borrow_mut().take()
                else {
                    debug_assert!(false, "a finished handshake admitted its export");
                    self.close(format!("export {export_name:?} was not admitted"));
                    return true;
                };
                let tls = matches!(self.wire.stream, Stream::Tls(_));
                tracing::info!(peer = %self.wire.peer(), export = %volume.name, tls, "client connected");
                let mut channel = channel;
                // Read data may be lent by the device and written from its
                // memory (in-memory bytes: a TLS session encrypts them as
                // it would a buffer).
                channel.allow_lend();
                if !tls {
                    // The stream is the plain socket from here on: read
                    // data may come in a pipe and be spliced into it.
                    self.wire.allow_splice();
                    channel.allow_splice();
                }
                self.wire.set_context(&volume.name);
                if let Some(context) = &negotiated.changed {
                    if volume.dev().changed_by_channel() {
                        channel.set_changed_since(&context.snapshot);
                    }
                }
                self.phase = Phase::Transmission {
                    channel,
                    _permit: permit,
                    size: info.size_bytes,
                    tflags: info.transmission_flags,
                    structured: negotiated.structured_replies,
                    base_allocation: negotiated.base_allocation,
                    changed: negotiated.changed,
                    volume,
                };
                true
            }
            Ok((used, HandshakeStatus::StartTls)) => {
                self.wire.inb.consume(used);
                if self.wire.inb.buffered() > 0 {
                    self.wire.inb.consume(self.wire.inb.buffered());
                    self.close("client sent plaintext after NBD_OPT_STARTTLS");
                } else {
                    self.starting_tls = true;
                }
                true
            }
            Ok((used, HandshakeStatus::Aborted)) => {
                self.wire.inb.consume(used);
                self.close("client aborted the handshake");
                true
            }
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), error = %e, "bad handshake");
                self.close(format!("bad handshake: {e}"));
                true
            }
        }
    }

    fn start_request(&mut self, req: Request) {
        let fua = req.flags & nbd::NBD_CMD_FLAG_FUA != 0;
        let op = match req.command {
            Command::Disc => {
                self.close("client sent NBD_CMD_DISC");
                return;
            }
            Command::Read => IoOp::Read,
            Command::Write => IoOp::Write { fua },
            Command::Flush => IoOp::Flush,
            Command::Trim => IoOp::Trim,
            Command::WriteZeroes => {
                let fast = req.flags & nbd::NBD_CMD_FLAG_FAST_ZERO != 0;
                if fast && !self.zeroes_fast() {
                    // Refused before any work, as the spec asks: the
                    // client will write the zeros itself.
                    self.push_reply(req.cookie, nbd::NBD_ENOTSUP, None);
                    return;
                }
                IoOp::WriteZeroes {
                    no_hole: req.flags & nbd::NBD_CMD_FLAG_NO_HOLE != 0,
                    fua,
                    fast,
                }
            }
            Command::BlockStatus => {
                self.block_status(&req);
                return;
            }
            Command::Cache => {
                self.cache(&req);
                return;
            }
            Command::Unknown(_) => {
                // validate() refuses unknown commands; answer anyway.
                self.push_reply(req.cookie, nbd::NBD_EINVAL, None);
                return;
            }
        };
        let start_ns = self.clock_ns();
        let Some(slot) = self.slots.insert(InFlight {
            cookie: req.cookie,
            command: req.command,
            offset: req.offset,
            length: req.length,
            fast_zero: matches!(op, IoOp::WriteZeroes { fast: true, .. }),
            req_one: false,
            changed_step: false,
            start_ns,
        }) else {
            debug_assert!(false, "take_request checked for a free slot");
            return;
        };
        match op {
            IoOp::Read => {
                // A read a memory volume lends uses no buffer: take one
                // without the fixed arena's cost (`Channel::lends`).
                let lends =
                    matches!(&self.phase, Phase::Transmission { channel, .. } if channel.lends());
                let buf = if lends {
                    bufs::get_unregistered(req.length as usize)
                } else {
                    bufs::get(req.length as usize)
                };
                self.submit(slot, &req, op, Some(buf));
            }
            IoOp::Write { .. } => {
                let buf = bufs::get(req.length as usize);
                self.recv = Recv::payload(slot, req, buf);
            }
            _ => self.submit(slot, &req, op, None),
        }
    }

    fn zeroes_fast(&self) -> bool {
        match &self.phase {
            Phase::Transmission { volume, .. } => volume.dev().zeroes_fast(),
            Phase::Handshake(_) => false,
        }
    }

    /// `NBD_CMD_CACHE`: advice to the device (a prefetch for file
    /// volumes, nothing elsewhere); answered at once.
    fn cache(&mut self, req: &Request) {
        let Phase::Transmission { volume, .. } = &self.phase else {
            return;
        };
        let error = match volume.dev().prefetch(req.offset, u64::from(req.length)) {
            Ok(()) => 0,
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), ?req, error = %e, "cache (prefetch) failed");
                nbd::errno_to_nbd(e.errno())
            }
        };
        self.push_reply(req.cookie, error, None);
    }

    fn submit(&mut self, slot: SlotId, req: &Request, op: IoOp, buf: Option<IoBuf>) {
        let io = IoRequest {
            tag: slot.to_wire(),
            op,
            offset: req.offset,
            len: req.length,
            buf,
        };
        self.submit_io(io);
    }

    fn submit_io(&mut self, io: IoRequest) {
        let Phase::Transmission { channel, .. } = &mut self.phase else {
            return;
        };
        if let Some(done) = self.subs.queued(channel.queue(io)) {
            self.complete(done);
        }
    }

    /// Pushes the requests queued since the last push (`Submissions`).
    fn flush_submissions(&mut self) {
        if !self.subs.take_unflushed() {
            return;
        }
        if let Phase::Transmission { channel, .. } = &mut self.phase {
            channel.flush_submissions();
        }
    }

    fn retry_submit(&mut self) -> bool {
        let Some(io) = self.subs.retry() else {
            return false;
        };
        self.submit_io(io);
        !self.subs.holding()
    }
}

/// Extents per block status chunk: one with `REQ_ONE`.
fn max_extents(req_one: bool) -> usize {
    if req_one {
        1
    } else {
        structured::MAX_BLOCK_STATUS_EXTENTS
    }
}

/// A `lull:changed:` chunk's extents from the device's runs: at most
/// `max`, none empty, each cut by `cap` to the request.
fn change_extents(runs: &[ChangeRun], max: usize, cap: impl Fn(u64) -> u32) -> Vec<BlockExtent> {
    runs.iter()
        .filter(|r| r.length_bytes > 0)
        .take(max)
        .map(|r| BlockExtent {
            length: cap(r.length_bytes),
            flags: if r.changed {
                structured::LULL_STATE_CHANGED
            } else {
                0
            },
        })
        .collect()
}
