//! One engine connection to the replica, run by its poller in a poll group
//! (the shape of `lull-nbd`'s connection).
//!
//! Each run of the poller goes round: reap file-channel completions into
//! replies, write replies, read frames and submit them, until a round makes
//! no progress (or the round budget is spent, in which case the poller
//! wakes itself). Nothing blocks: a full socket raises the writable
//! interest; a full slot table or reply queue stops reading
//! (back-pressure) until completions or the socket free room. Replies go
//! out in completion order; the engine matches them by id.
//!
//! Edge rules: a frame that does not decode closes the connection (a wrong
//! version first gets a HELLO refusal with EPROTO); a well-formed request
//! that cannot be served (out of range) gets an error reply, after its
//! write payload is drained so the stream stays in sync.
//!
//! Waits: while a connection waits for one of the following it reads no
//! frames (its in-flight I/O goes on), and its poller is woken by a
//! message when the wait may be over; nothing spins.
//!
//! - Metadata: a HELLO with the attach flag is answered only once its
//!   generation is durable; DETACH once the clean record is; and the first
//!   modifying request on a replica whose record still says clean waits
//!   until the record says dirty, so data never changes under a record
//!   that claims a clean detach.
//! - Write intent: INTENT_MARK is answered once the persister has made it
//!   durable (one fdatasync shared by every mark waiting).
//! - Takeover: a HELLO of a non-zero session is answered only once no
//!   connection of another session has a modifying request in flight
//!   (see `crate::fence`).
//! - Snapshots: SNAPSHOT (counted in the fence, like a write) and
//!   SNAPSHOT_LIST run on a helper thread (`crate::snapshots`) and are
//!   answered when it is done. The chain's quiesce waits for every
//!   channel's requests in flight, this connection's too: they go on
//!   completing while it waits.
//!
//! Fencing: every modifying request (and ATTACH, DETACH) is counted in the
//! connection's fence from the moment its header is decoded until its
//! reply is queued. A request from a session that does not own the
//! replica is not taken: an engine's connection (non-zero session) is
//! closed, a tool's (session 0) gets `ESTALE`.
//!
//! Snapshot views (version 6): a HELLO naming `REPLICA@SNAPSHOT` makes
//! the connection a view of that snapshot (`BlockDevice::snapshot_view`,
//! read-only, holding its layers while it is open). Its data channel is
//! the view's; READ, BLOCK_STATUS, EXTENTS, CHANGED and PING are served
//! from it (READs never with `sendfile`: the head file is not the
//! snapshot), and every other request is answered `EROFS` (a write's
//! payload drained) before it is counted anywhere: a view never takes
//! the replica over, is never fenced, and changes no record. CLONE
//! (version 7) is asked on a view only: it makes a new replica of the
//! store whose base is the view's snapshot (`store::Index::clone_replica`,
//! on a helper thread), and changes nothing of this one.
//!
//! Authentication: with TLS credentials, the first byte must open a TLS
//! handshake (a plain peer is refused with a warning naming it), and the
//! handshake runs on the poller like any read, before the HELLO; it counts
//! against the HELLO timeout. A failed handshake (wrong key, untrusted
//! certificate) closes the connection with one warning. A plain replica
//! (`--insecure`) refuses a peer whose first byte opens a TLS handshake
//! with a warning too, so a half-configured pair says so on both ends.

use std::fs::File;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};

use lull_bdev::faulty::SplitMix64;
use lull_bdev::{BlockDevice, Channel, IoBuf, IoCompletion, IoOp, IoRequest};
use lull_net::link::{handshake_hint, LinkStream, TLS_RECORD_HANDSHAKE};
use lull_net::server::Connection;
use lull_net::slots::{SlotId, SlotTable};
use lull_net::tls::TlsStream;
use lull_net::wire::{self, Receive as _, Recv, Submissions, Wire};
use lull_net::{bufs, OutPayload, Payload};
use lull_proto::replica::{
    self as proto, ChangedRequest, FrameError, Header, Hello, Kind, StatusExtent, HEADER_LEN,
    HELLO_FLAG_ATTACH, HELLO_LEN, INTENT_FLAG_LOST, MAX_BLOCK_STATUS_PER_REPLY,
    MAX_EXTENTS_PER_REPLY, MAX_IO_BYTES,
};
use lull_reactor::{Interest, PollStatus, PollerId, Thread, ThreadHandle};

use crate::fence::{Claim, ConnFence};
use crate::intent::IntentError;
use crate::snapshots::{SnapshotDone, SnapshotJob};
use crate::SnapshotError;
use crate::{MetaJob, Port, ReplicaError, Shared};

/// Requests in flight per connection: the file channel's ring depth
/// (`FILE_CHANNEL_DEPTH`), so a full slot table, not a full ring, is what
/// stops reading. It also bounds the buffers one peer can pin.
pub const MAX_IN_FLIGHT: usize = lull_bdev::FILE_CHANNEL_DEPTH as usize;

/// Reply bytes queued before the connection stops reading new requests: a
/// peer that does not read its replies cannot make the replica buffer
/// without bound. Two maximum-size reads.
pub const MAX_REPLY_QUEUE_BYTES: usize = 2 * MAX_IO_BYTES as usize;

/// READ replies at least this long go from the data file's page cache
/// into the socket with `sendfile` (`ReplicaConfig::sendfile`), with no
/// read into a buffer and no copy out of it; smaller ones are read and
/// sent from a buffer, batched with other replies in one `writev`. 32 KiB:
/// the engine reads the header of a reply this long alone and its
/// payload straight from the socket (`HEADER_ALONE_READ_BYTES` in
/// `lull_engine`), so the second system call per reply is paid there too.
pub const SENDFILE_READ_BYTES_MIN: u32 = 32 * 1024;

/// Bytes of a layered chain's maps one EXTENTS or BLOCK_STATUS reply
/// scans (the peer asks again from where the reply stopped): a lookup per
/// 4 KiB block, 65,536 of them, about 100 µs on the reactor. A chain of
/// one layer answers from SEEK_DATA/SEEK_HOLE, whose cost does not grow
/// with the range, and is not bounded by this.
pub const MAX_MAP_SCAN_BYTES: u64 = 256 << 20;

/// Input buffer size: many small frames per read syscall; write payloads
/// larger than what it holds are read straight into their I/O buffer.
const READ_BUFFER_BYTES: usize = 256 * 1024;

/// Bytes read per poller run, so one busy peer cannot hold its reactor
/// away from other threads for long.
const READ_BUDGET_BYTES: usize = 4 * 1024 * 1024;

/// Rounds per poller run (see the module doc); more work wakes the poller
/// again instead of looping here.
const MAX_ROUNDS: usize = 8;

enum Phase {
    /// No HELLO yet: the first frame must be one.
    AwaitHello,
    /// Serving requests (and further HELLOs).
    Ready { channel: Box<dyn Channel> },
}

/// What a metadata write answers when it is done.
enum MetaFor {
    /// Marking the replica dirty before a modifying request, whose frame
    /// stays buffered until then.
    Dirty,
    /// An attach HELLO (counted in the fence).
    Attach(Header),
    /// A DETACH (counted in the fence).
    Detach(Header),
}

/// What the connection waits for before it reads another frame (see the
/// module doc).
enum Wait {
    Meta {
        what: MetaFor,
        rx: mpsc::Receiver<Result<u64, ReplicaError>>,
    },
    /// An INTENT_MARK (counted in the fence), answered once `seq` is durable.
    Intent { req: Header, seq: u64 },
    /// A HELLO of this connection's session, answered once other sessions
    /// have drained.
    Takeover { req: Header, hello: Hello },
    /// A SNAPSHOT (counted in the fence) or SNAPSHOT_LIST on a helper
    /// thread.
    Snapshot {
        req: Header,
        /// What it does, for the log line of its answer.
        what: String,
        rx: mpsc::Receiver<Result<SnapshotDone, SnapshotError>>,
    },
}

/// The snapshot a view connection reads (see the module doc).
struct View {
    /// As its first HELLO named it; a later HELLO must name it again.
    snapshot: String,
    /// Read-only; it holds the snapshot's layers while the connection is
    /// open, so a delete of the snapshot merges it meanwhile and the view
    /// still reads the bytes it had.
    dev: Arc<dyn BlockDevice>,
}

impl Wait {
    /// Whether the wait holds a fence count.
    fn counted(&self) -> bool {
        match self {
            Wait::Intent { .. }
            | Wait::Meta {
                what: MetaFor::Attach(_) | MetaFor::Detach(_),
                ..
            } => true,
            Wait::Snapshot { req, .. } => req.kind.modifies(),
            Wait::Meta { .. } | Wait::Takeover { .. } => false,
        }
    }
}

pub(crate) struct Conn {
    /// The socket, its buffers and the closing/broken state
    /// (`lull_net::wire`, shared with the NBD server).
    wire: Wire<LinkStream>,
    /// The port the connection came in on: its credentials and what it
    /// serves.
    port: Arc<Port>,
    /// The replica the first HELLO named (found through `port`); `None`
    /// before it.
    replica: Option<Arc<Shared>>,
    /// The snapshot a view connection reads (its first HELLO named
    /// `REPLICA@SNAPSHOT`); `None` for a connection to the live data.
    view: Option<View>,
    /// TLS is required and the peer's first byte has not been seen yet
    /// (the stream is still plain).
    tls_expected: bool,
    /// TLS is required and the peer speaks plaintext: its first frame is
    /// answered with an EACCES HELLO refusal, then the connection closes.
    refuse_plain: bool,
    phase: Phase,
    /// Request header of each request in flight; a slot's wire id is the
    /// I/O tag. Grows to the deepest queue the peer has used.
    slots: SlotTable<Header>,
    /// Between frames, or in a write's payload (`lull_net::wire`).
    recv: Recv<Header>,
    /// A request the channel refused as full, and requests queued and not
    /// pushed yet (`advance` pushes them once per batch).
    subs: Submissions<IoRequest>,
    pub(crate) hello_done: Arc<AtomicBool>,
    wait: Option<Wait>,
    /// Draws for `--fault-drop` (seeded per connection).
    drop_draws: SplitMix64,
    /// The session of the first HELLO; every later HELLO must carry it.
    session: Option<u64>,
    /// This connection's count of modifying requests in flight.
    fence: Arc<ConnFence>,
    /// This connection's poll group and poller, learnt on the first run; a
    /// metadata helper, the intent persister or a takeover wakes the
    /// poller through them.
    me: Option<(ThreadHandle, PollerId)>,
    /// Completions of one `reap`, kept so the hot path does not allocate.
    completions: Vec<IoCompletion>,
    /// The file `sendfile` READ replies go from (`None`: none may now),
    /// as found at a layers generation of the chain (`Conn::sendfile_file`).
    sendfile_cache: Option<(u64, Option<Arc<File>>)>,
}

impl Connection for Conn {
    fn fd(&self) -> RawFd {
        self.wire.fd()
    }

    fn interest(&self) -> Interest {
        self.wire.interest()
    }

    fn greeted(&self) -> Arc<AtomicBool> {
        self.hello_done.clone()
    }

    fn poll(&mut self, t: &mut Thread, _now: u64, greeting_expired: bool) -> PollStatus {
        self.run(t, greeting_expired)
    }
}

impl wire::Protocol for Conn {
    type Stream = LinkStream;

    fn wire(&mut self) -> &mut Wire<LinkStream> {
        &mut self.wire
    }

    /// Waits, reaps, retries a held request, then pushes what was queued
    /// since the last round (`read_and_dispatch`'s requests: `pump`
    /// always follows it with an `advance`).
    fn advance(&mut self) -> bool {
        let waited = self.check_wait();
        let reaped = self.reap();
        let retried = self.retry_submit();
        self.flush_submissions();
        waited | reaped | retried
    }

    /// TLS before anything else (the handshake reads the socket itself),
    /// then frames.
    fn read_and_dispatch(&mut self) -> bool {
        if self.tls_expected || self.wire.stream.handshaking() {
            if let Some(progress) = self.tls_step() {
                return progress;
            }
        }
        wire::read_and_dispatch(self, READ_BUDGET_BYTES)
    }

    /// A write whose payload will not arrive is dropped unanswered
    /// (`wire::abandon_frame`): otherwise its slot, and its fence count,
    /// would keep the connection open for good, and a takeover waiting
    /// for it would wait for ever.
    fn abandon_input(&mut self) -> bool {
        wire::abandon_frame(self)
    }

    /// Requests in flight, or a wait for a metadata write, an intent store
    /// or a takeover.
    fn busy(&self) -> bool {
        self.in_flight() > 0 || self.wait.is_some()
    }

    fn completions_fd(&self) -> Option<RawFd> {
        match &self.phase {
            Phase::Ready { channel } => channel.event_fd(),
            _ => None,
        }
    }

    /// A request the chain handed back while it is quiesced (a snapshot
    /// operation) is tried again at the time it says: no completion may
    /// come to wake this connection before.
    fn wake_at_ns(&self) -> Option<u64> {
        match &self.phase {
            Phase::Ready { channel } if self.subs.holding() => channel.retry_at_ns(),
            _ => None,
        }
    }

    fn completions_polled(&self) -> bool {
        match &self.phase {
            Phase::Ready { channel } => channel.polled() && channel.in_flight() > 0,
            _ => false,
        }
    }

    fn stream_wants_write(&self) -> bool {
        self.wire.stream.wants_write()
    }

    fn stranded_input(&self) -> bool {
        self.wire.stream.pending() > 0 && !self.wire.is_closing() && self.wants_input()
    }

    fn check_invariants(&self) {
        Conn::check_invariants(self);
    }
}

impl wire::Receive for Conn {
    const EOF_REASON: &'static str = "peer disconnected";

    fn step(&mut self) -> bool {
        wire::step_frame(self)
    }

    fn wants_input(&self) -> bool {
        match &self.phase {
            _ if self.wait.is_some() => false,
            _ if self.recv.mid_frame() => true,
            Phase::AwaitHello => true,
            Phase::Ready { .. } => self.can_take_request(),
        }
    }

    fn in_flight(&self) -> usize {
        self.slots.in_flight()
    }
}

/// Frames and their write payloads (`lull_net::wire` moves the bytes).
impl wire::ReceiveFrames for Conn {
    type Frame = Header;
    const EOF_IN_PAYLOAD_REASON: &'static str =
        "peer disconnected in the middle of a write payload";

    fn recv(&mut self) -> &mut Recv<Header> {
        &mut self.recv
    }

    /// A frame header: HELLO first, then requests (see the module doc).
    fn take_frame(&mut self) -> bool {
        if self.wire.inb.buffered() < HEADER_LEN {
            return false;
        }
        if self.wait.is_some() {
            return false;
        }
        if matches!(self.phase, Phase::Ready { .. }) && !self.can_take_request() {
            return false;
        }
        let mut raw = [0u8; HEADER_LEN];
        raw.copy_from_slice(&self.wire.inb.peek()[..HEADER_LEN]);
        if self.refuse_plain {
            self.refuse_plaintext(&raw);
            return true;
        }
        let h = match proto::decode_header(&raw) {
            Ok(h) => h,
            Err(FrameError::BadVersion(version)) => {
                self.wire.inb.consume(HEADER_LEN);
                tracing::warn!(peer = %self.wire.peer(), version, ours = proto::PROTOCOL_VERSION, "peer speaks another protocol version");
                let mut header = [0u8; HEADER_LEN];
                proto::encode_refusal(proto::raw_id(&raw), libc::EPROTO as u32, &mut header);
                let payload = self.our_hello(self.current_generation());
                self.wire.out.push(&header, Payload::Bytes(payload));
                self.close(format!(
                    "protocol version {version} is not {}",
                    proto::PROTOCOL_VERSION
                ));
                return true;
            }
            Err(_)
                if matches!(self.phase, Phase::AwaitHello)
                    && raw[0] == TLS_RECORD_HANDSHAKE
                    && !self.wire.stream.is_tls() =>
            {
                self.wire.set_broken();
                self.wire.refuse(
                    "the peer opens a TLS handshake, and this replica serves plain links \
                     (--insecure): start it with --tls-psk or --tls-certs, or the engine \
                     with --replica-insecure",
                );
                return true;
            }
            Err(e) => {
                self.wire.inb.consume(HEADER_LEN);
                tracing::warn!(peer = %self.wire.peer(), error = %e, "bad frame header");
                self.close(format!("bad frame: {e}"));
                return true;
            }
        };
        if h.reply {
            self.wire.inb.consume(HEADER_LEN);
            tracing::warn!(peer = %self.wire.peer(), ?h, "peer sent a reply frame");
            self.close("unexpected reply frame");
            return true;
        }
        match (&self.phase, h.kind) {
            (_, Kind::Hello) => {
                // The record and the replica's name: at most
                // MAX_HELLO_REQUEST_LEN, checked by `decode_header`.
                let end = HEADER_LEN + proto::payload_len(&h);
                if self.wire.inb.buffered() < end {
                    return false;
                }
                let decoded = proto::decode_hello_request(&self.wire.inb.peek()[HEADER_LEN..end])
                    .map(|(hello, name)| (hello, name.to_string()));
                self.wire.inb.consume(end);
                match decoded {
                    Ok((hello, name)) => self.handle_hello(h, hello, &name),
                    Err(e) => {
                        tracing::warn!(peer = %self.wire.peer(), error = %e, "bad HELLO");
                        self.close(format!("bad HELLO: {e}"));
                    }
                }
            }
            (Phase::AwaitHello, kind) => {
                self.wire.inb.consume(HEADER_LEN);
                tracing::warn!(peer = %self.wire.peer(), ?kind, "first frame is not HELLO");
                self.close("first frame is not HELLO");
            }
            // Before anything below counts the request in the fence or
            // waits for the dirty record: a view changes nothing.
            (_, kind) if self.view.is_some() && !served_on_view(kind) => self.refuse_on_view(h),
            (_, Kind::Changed) => {
                // The range's length and a snapshot name: at most
                // MAX_CHANGED_REQUEST_LEN, checked by `decode_header`.
                let end = HEADER_LEN + proto::payload_len(&h);
                if self.wire.inb.buffered() < end {
                    return false;
                }
                let decoded = proto::decode_changed_request(&self.wire.inb.peek()[HEADER_LEN..end]);
                self.wire.inb.consume(end);
                match decoded {
                    Ok(request) => self.changed(h, &request),
                    Err(e) => {
                        // Framed right, so the stream is in sync: refused,
                        // the connection goes on.
                        tracing::warn!(peer = %self.wire.peer(), ?h, error = %e, "CHANGED refused: bad request");
                        self.push_error(h, libc::EINVAL);
                    }
                }
            }
            (_, Kind::Clone) => {
                // The new replica's name: at most MAX_REPLICA_NAME_BYTES,
                // checked by `decode_header`.
                let end = HEADER_LEN + proto::payload_len(&h);
                if self.wire.inb.buffered() < end {
                    return false;
                }
                let decoded = proto::decode_clone_request(&self.wire.inb.peek()[HEADER_LEN..end])
                    .map(str::to_string);
                self.wire.inb.consume(end);
                match (decoded, &self.view) {
                    (Ok(name), Some(view)) => {
                        let snapshot = view.snapshot.clone();
                        self.start_snapshot(h, SnapshotJob::Clone { snapshot, name });
                    }
                    (Ok(_), None) => {
                        tracing::warn!(peer = %self.wire.peer(), ?h,
                            "CLONE refused: it is asked on a snapshot view connection (REPLICA@SNAPSHOT)");
                        self.push_error(h, libc::EINVAL);
                    }
                    (Err(e), _) => {
                        tracing::warn!(peer = %self.wire.peer(), ?h, error = %e, "CLONE refused: bad request");
                        self.push_error(h, libc::EINVAL);
                    }
                }
            }
            (_, kind) if kind.has_change_key() => {
                // The key follows the header: at most MAX_CHANGE_KEY_LEN,
                // checked by `decode_header`.
                let end = HEADER_LEN + proto::payload_len(&h);
                if let Some(taken) = self.admit_with_payload(h, end) {
                    return taken;
                }
                let key = proto::decode_change_key(kind, &self.wire.inb.peek()[HEADER_LEN..end]);
                self.wire.inb.consume(end);
                match key {
                    Ok(key) => self.changes_request(h, key),
                    Err(e) => {
                        if kind.modifies() {
                            self.fence_exit();
                        }
                        tracing::warn!(peer = %self.wire.peer(), error = %e, "bad change key");
                        self.close(format!("bad change key: {e}"));
                    }
                }
            }
            (_, Kind::Snapshot) => {
                // The op and the name: at most MAX_SNAPSHOT_REQUEST_LEN,
                // checked by `decode_header`.
                let end = HEADER_LEN + proto::payload_len(&h);
                if let Some(taken) = self.admit_with_payload(h, end) {
                    return taken;
                }
                let decoded =
                    proto::decode_snapshot_request(&self.wire.inb.peek()[HEADER_LEN..end]);
                self.wire.inb.consume(end);
                match decoded {
                    Ok(request) => self.start_snapshot(h, SnapshotJob::Run(request)),
                    Err(e) => {
                        // Framed right, so the stream is in sync: a bad op
                        // or name is refused, the connection goes on.
                        tracing::warn!(peer = %self.wire.peer(), error = %e, "SNAPSHOT refused: bad request");
                        self.fence_exit();
                        self.push_error(h, libc::EINVAL);
                    }
                }
            }
            (_, kind) if kind.modifies() || kind == Kind::Detach => {
                // Counted before anything is taken (see `crate::fence`).
                if let Err(owner) = self.server().fences.enter(&self.fence) {
                    self.wire.inb.consume(HEADER_LEN);
                    self.fenced_request(h, owner);
                    return true;
                }
                if kind.modifies() && !self.server().dirty.load(Ordering::SeqCst) {
                    self.fence_exit();
                    // Leave the frame buffered: it is taken (and counted
                    // again) once the record says dirty.
                    self.start_meta_wait(MetaFor::Dirty, MetaJob::Attach(0));
                    return true;
                }
                self.wire.inb.consume(HEADER_LEN);
                self.start_request(h);
            }
            _ => {
                self.wire.inb.consume(HEADER_LEN);
                self.start_request(h);
            }
        }
        true
    }

    fn payload_received(&mut self, slot: SlotId, req: Header, buf: IoBuf) {
        let op = IoOp::Write {
            fua: req.kind == Kind::WriteFua,
        };
        self.submit(slot, &req, op, Some(buf));
    }

    fn payload_lost(&mut self, slot: SlotId) {
        self.release_slot(slot);
    }

    fn drained(&mut self, req: Header, status: u32) {
        self.push_error(req, status as i32);
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // A takeover may be waiting for this connection's requests; they
        // are gone with it (normally none are left: a connection finishes
        // only with nothing in flight).
        if let Some(r) = &self.replica {
            r.fences.conn_gone();
        }
    }
}

impl Conn {
    pub(crate) fn new(stream: TcpStream, port: Arc<Port>) -> Conn {
        // Counted in a replica's fences once a HELLO names the replica.
        let fence = Arc::new(ConnFence::default());
        // Unknown only if the peer is already gone; the first read says so.
        let peer = stream
            .peer_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let fd = stream.as_raw_fd();
        let drop_draws = SplitMix64::new(
            port.faults
                .seed
                .wrapping_add(port.conns_accepted.fetch_add(1, Ordering::Relaxed)),
        );
        let tls_expected = port.tls.is_some();
        let mut wire = Wire::new(
            LinkStream::Plain(stream),
            fd,
            READ_BUFFER_BYTES,
            "replica",
            peer.to_string(),
        );
        if !tls_expected {
            // The stream stays the plain socket for good.
            wire.allow_splice();
        }
        Conn {
            wire,
            port,
            replica: None,
            view: None,
            tls_expected,
            refuse_plain: false,
            phase: Phase::AwaitHello,
            slots: SlotTable::new(MAX_IN_FLIGHT),
            recv: Recv::Header,
            subs: Submissions::default(),
            hello_done: Arc::new(AtomicBool::new(false)),
            drop_draws,
            wait: None,
            session: None,
            fence,
            me: None,
            completions: Vec::new(),
            sendfile_cache: None,
        }
    }

    fn close(&mut self, reason: impl Into<String>) {
        self.wire.close(reason);
    }

    /// The poller body. Returns Busy when anything moved.
    fn run(&mut self, t: &mut Thread, hello_deadline_passed: bool) -> PollStatus {
        if self.me.is_none() {
            self.me = t.current_poller().map(|id| (t.handle(), id));
            if let Some(me) = &self.me {
                self.fence.set_waiter(me.clone());
            }
        }
        if hello_deadline_passed && !self.hello_done.load(Ordering::Relaxed) {
            self.close("no HELLO in time");
        }
        if !self.wire.is_closing() && self.port.conns.stopping() {
            self.close("replica shutting down");
        }
        if !self.wire.is_closing()
            && self
                .replica
                .as_ref()
                .is_some_and(|r| r.deleted.load(Ordering::SeqCst))
        {
            self.close("replica deleted from the store");
        }
        self.check_fenced();
        wire::pump(self, t, MAX_ROUNDS)
    }

    /// Slot table and output accounting agree (debug builds, every run).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub(crate) fn check_invariants(&self) {
        self.slots.check_invariants();
        let modifying = self.slots.iter().filter(|(_, h)| h.kind.modifies()).count();
        let waiting = usize::from(self.wait.as_ref().is_some_and(Wait::counted));
        assert_eq!(
            self.fence.modifying(),
            modifying + waiting,
            "fence count out of step with the modifying requests in flight"
        );
    }

    /// The session of an engine connection (non-zero), if known.
    fn engine_session(&self) -> Option<u64> {
        self.session.filter(|&s| s != 0)
    }

    /// An engine connection whose session no longer owns the replica
    /// closes (after its requests in flight finish).
    fn check_fenced(&mut self) {
        let Some(session) = self.engine_session() else {
            return;
        };
        let owner = self.server().fences.owner();
        if owner != session && !self.wire.is_closing() {
            self.close(format!(
                "fenced: engine session {owner:#x} took the replica over from {session:#x}"
            ));
        }
    }

    /// A request counted by `fences.enter` is answered or abandoned.
    fn fence_exit(&self) {
        self.server().fences.exit(&self.fence);
    }

    /// The HELLO reply payload: this replica's size, generation, flags
    /// (clean, intent lost) and owner session now.
    /// Before a HELLO named a replica on a store, all zeros: nothing
    /// about any replica goes to a peer that has not said which it wants
    /// (a `lull replica` process has only the one).
    fn our_hello(&self, generation: u64) -> Vec<u8> {
        let Some(r) = self.known_replica() else {
            return vec![0; HELLO_LEN];
        };
        proto::encode_hello(&Hello {
            volume_size: r.size_bytes(),
            generation,
            flags: r.hello_flags(),
            session: r.fences.owner(),
        })
        .to_vec()
    }

    /// The replica this connection serves. Only past the first HELLO,
    /// which every frame after it is (`take_frame` refuses anything else
    /// first).
    fn server(&self) -> &Arc<Shared> {
        self.replica
            .as_ref()
            .expect("a connection's replica is known from its first HELLO on")
    }

    /// A HELLO reply with `errno` and this replica's HELLO.
    fn refuse_hello(&mut self, req: Header, errno: i32) {
        let payload = self.our_hello(self.current_generation());
        self.push_reply(req.reply_with(errno as u32), Payload::Bytes(payload));
    }

    fn current_generation(&self) -> u64 {
        self.known_replica()
            .map_or(0, |r| r.generation.load(Ordering::SeqCst))
    }

    /// The replica this connection is for: the one its HELLO named, or
    /// before that the only one a `lull replica` port serves.
    fn known_replica(&self) -> Option<&Arc<Shared>> {
        match (&self.replica, &self.port.served) {
            (Some(r), _) => Some(r),
            (None, crate::Served::One(r)) => Some(r),
            (None, crate::Served::Store(_)) => None,
        }
    }

    /// Finish the current wait when it is over.
    fn check_wait(&mut self) -> bool {
        match &self.wait {
            None => false,
            Some(Wait::Meta { .. }) => self.check_meta_wait(),
            Some(Wait::Intent { .. }) => self.check_intent_wait(),
            Some(Wait::Takeover { .. }) => self.check_takeover(),
            Some(Wait::Snapshot { .. }) => self.check_snapshot_wait(),
        }
    }

    /// Finish a metadata wait when its helper has answered.
    fn check_meta_wait(&mut self) -> bool {
        let Some(Wait::Meta { rx, .. }) = &self.wait else {
            return false;
        };
        let result = match rx.try_recv() {
            Ok(r) => r,
            Err(mpsc::TryRecvError::Empty) => return false,
            Err(mpsc::TryRecvError::Disconnected) => Err(ReplicaError::ShuttingDown),
        };
        let Some(Wait::Meta { what, .. }) = self.wait.take() else {
            return false;
        };
        if !matches!(what, MetaFor::Dirty) {
            self.fence_exit();
        }
        match (result, what) {
            (Ok(generation), MetaFor::Attach(req)) => {
                let payload = self.our_hello(generation);
                self.push_reply(req.reply_with(0), Payload::Bytes(payload));
                tracing::info!(peer = %self.wire.peer(), generation, "engine attached");
            }
            (Ok(_), MetaFor::Detach(req)) => {
                self.push_reply(req.reply_with(0), Payload::None);
                tracing::info!(peer = %self.wire.peer(), "engine detached");
            }
            (Ok(_), MetaFor::Dirty) => {}
            (Err(e @ ReplicaError::DetachBusy { .. }), MetaFor::Detach(req)) => {
                // Nothing changed: the engine may detach again later.
                tracing::warn!(peer = %self.wire.peer(), error = %e, "DETACH refused");
                self.push_error(req, e.errno());
            }
            (Err(e), what) => {
                tracing::error!(peer = %self.wire.peer(), error = %e, "cannot persist the replica metadata");
                match what {
                    MetaFor::Attach(req) => self.refuse_hello(req, e.errno()),
                    MetaFor::Detach(req) => self.push_error(req, e.errno()),
                    MetaFor::Dirty => {}
                }
                // A write cannot be taken without a dirty record: the peer
                // sees the connection close and fails over.
                self.close(format!("metadata write failed: {e}"));
            }
        }
        true
    }

    /// Starts a metadata write on a helper thread and makes this
    /// connection wait for it. Attach and detach arrive counted in the
    /// fence.
    fn start_meta_wait(&mut self, what: MetaFor, job: MetaJob) {
        let started = match self.me.clone() {
            Some((thread, poller)) => self.server().meta_async(job, thread, poller),
            // `poll` learns `me` before reading anything.
            None => Err(ReplicaError::ShuttingDown),
        };
        match started {
            Ok(rx) => self.wait = Some(Wait::Meta { what, rx }),
            Err(e) => {
                tracing::error!(peer = %self.wire.peer(), error = %e, "cannot start a metadata write");
                match what {
                    MetaFor::Attach(req) => {
                        self.fence_exit();
                        self.refuse_hello(req, e.errno());
                    }
                    MetaFor::Detach(req) => {
                        self.fence_exit();
                        self.push_error(req, e.errno());
                    }
                    MetaFor::Dirty => {}
                }
                self.close(format!("metadata write failed: {e}"));
            }
        }
    }

    /// Starts a SNAPSHOT (arriving counted in the fence) or SNAPSHOT_LIST
    /// on a helper thread and makes this connection wait for it.
    fn start_snapshot(&mut self, req: Header, job: SnapshotJob) {
        let what = match &job {
            SnapshotJob::Run(r) => format!("{:?} {:?}", r.op, r.name),
            SnapshotJob::List => "list".to_string(),
            SnapshotJob::Clone { snapshot, name } => format!("clone {snapshot:?} as {name:?}"),
            SnapshotJob::Grow(size) => format!("grow to {size} bytes"),
        };
        let started = match self.me.clone() {
            Some((thread, poller)) => {
                let store = match &self.port.served {
                    crate::Served::Store(index) => Some(index.clone()),
                    crate::Served::One(_) => None,
                };
                self.server().snapshot_async(job, store, thread, poller)
            }
            // `poll` learns `me` before reading anything.
            None => Err(ReplicaError::ShuttingDown),
        };
        match started {
            Ok(rx) => self.wait = Some(Wait::Snapshot { req, what, rx }),
            Err(e) => {
                tracing::error!(peer = %self.wire.peer(), what, error = %e, "cannot start a snapshot operation");
                if req.kind.modifies() {
                    self.fence_exit();
                }
                self.push_error(req, e.errno());
            }
        }
    }

    /// Answer a SNAPSHOT or SNAPSHOT_LIST once its helper is done.
    fn check_snapshot_wait(&mut self) -> bool {
        let Some(Wait::Snapshot { rx, .. }) = &self.wait else {
            return false;
        };
        let result = match rx.try_recv() {
            Ok(r) => r,
            Err(mpsc::TryRecvError::Empty) => return false,
            Err(mpsc::TryRecvError::Disconnected) => Err(SnapshotError::Closed),
        };
        let Some(Wait::Snapshot { req, what, .. }) = self.wait.take() else {
            return false;
        };
        if req.kind.modifies() {
            self.fence_exit();
        }
        let replica = self.server().name.clone().unwrap_or_default();
        match result {
            Ok(SnapshotDone::List(payload)) => {
                let mut reply = req.reply_with(0);
                // At most MAX_SNAPSHOT_LIST_BYTES (`snapshot_list`).
                reply.length = payload.len() as u32;
                self.push_reply(reply, Payload::Bytes(payload));
            }
            Ok(SnapshotDone::Ran) => {
                tracing::info!(peer = %self.wire.peer(), replica, what, "snapshot operation done");
                self.push_reply(req.reply_with(0), Payload::None);
            }
            Err(e) if e.is_refusal() => {
                tracing::warn!(peer = %self.wire.peer(), replica, what, error = %e, errno = e.errno(),
                    "snapshot operation refused");
                self.push_error(req, e.errno());
            }
            Err(e) => {
                tracing::error!(peer = %self.wire.peer(), replica, what, error = %e, errno = e.errno(),
                    "snapshot operation failed");
                self.push_error(req, e.errno());
            }
        }
        true
    }

    /// Answer an INTENT_MARK once it is durable.
    fn check_intent_wait(&mut self) -> bool {
        let (Some(Wait::Intent { req, seq }), Some(me)) = (&self.wait, &self.me) else {
            return false;
        };
        let (req, seq) = (*req, *seq);
        let Some(result) = self.server().intent.poll_durable(seq, me) else {
            return false;
        };
        self.wait = None;
        self.fence_exit();
        match result {
            Ok(()) => self.push_reply(req.reply_with(0), Payload::None),
            Err(e) => self.intent_failed(req, e),
        }
        true
    }

    /// The write-intent record cannot be persisted: the engine must not
    /// write where the mark is not durable, so the connection ends.
    fn intent_failed(&mut self, req: Header, e: IntentError) {
        tracing::error!(peer = %self.wire.peer(), ?req, error = %e, "write-intent record failed");
        self.push_error(req, libc::EIO);
        self.close(format!("write-intent record failed: {e}"));
    }

    /// Answer a HELLO of this connection's session once no connection of
    /// another session has a modifying request in flight.
    fn check_takeover(&mut self) -> bool {
        let Some(Wait::Takeover { req, hello }) = &self.wait else {
            return false;
        };
        let (req, hello) = (*req, *hello);
        let owner = self.server().fences.owner();
        if owner != hello.session {
            // A newer session took over while this one waited.
            self.wait = None;
            if let Some(me) = &self.me {
                self.server().fences.forget(me);
            }
            self.refuse_hello(req, libc::ESTALE);
            self.close(format!(
                "fenced: engine session {owner:#x} took the replica over from {:#x}",
                hello.session
            ));
            return true;
        }
        if self.wire.is_closing() {
            // The peer is gone or the replica is stopping: nobody to answer.
            self.wait = None;
            if let Some(me) = &self.me {
                self.server().fences.forget(me);
            }
            return true;
        }
        if !self
            .server()
            .fences
            .drained(hello.session, self.me.as_ref())
        {
            return false;
        }
        self.wait = None;
        self.finish_hello(req, hello);
        true
    }

    /// The data channel: the view's on a view connection (no faults
    /// injected there: `--fault-*` wraps the live chain), else the chain's
    /// (behind the fault injector when there is one).
    fn open_channel(&self) -> Option<Box<dyn Channel>> {
        let opened = match (&self.view, &self.server().faulty) {
            (Some(view), _) => view.dev.open_channel(),
            (None, Some(faulty)) => faulty.open_channel(),
            (None, None) => self.server().chain.open_channel(),
        };
        match opened {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::error!(peer = %self.wire.peer(), error = %e, "cannot open a data file channel");
                None
            }
        }
    }

    /// Move channel completions into the reply queue.
    fn reap(&mut self) -> bool {
        let Phase::Ready { channel } = &mut self.phase else {
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
        let Some(req) = self.slots.take(c.tag) else {
            tracing::error!(peer = %self.wire.peer(), tag = c.tag, "completion for an unknown slot");
            return;
        };
        match c.result {
            Ok(()) if req.kind == Kind::Read => match c.buf {
                Some(buf) if buf.len() == req.length as usize => {
                    self.push_reply(req.reply_with(0), Payload::Buf(buf));
                }
                other => {
                    tracing::error!(peer = %self.wire.peer(), id = req.id, "read completed without its buffer");
                    if let Some(b) = other {
                        bufs::put(b);
                    }
                    self.push_reply(req.reply_with(libc::EIO as u32), Payload::None);
                }
            },
            Ok(()) => {
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.push_reply(req.reply_with(0), Payload::None);
            }
            Err(e) if e.errno() == libc::ENOSPC => {
                let r = self.server();
                tracing::error!(peer = %self.wire.peer(), replica = r.name.as_deref().unwrap_or(""),
                    dir = %r.dir.display(), kind = ?req.kind, offset = req.offset, length = req.length,
                    "no space left for the replica's data (ENOSPC): this request fails on this replica, and its engine fails the replica");
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.push_reply(req.reply_with(libc::ENOSPC as u32), Payload::None);
            }
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), id = req.id, kind = ?req.kind, offset = req.offset,
                    length = req.length, error = %e, "I/O failed");
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.push_reply(req.reply_with(e.errno().unsigned_abs()), Payload::None);
            }
        }
        if req.kind.modifies() {
            self.fence_exit();
        }
    }

    fn push_reply(&mut self, reply: Header, payload: Payload) {
        let mut header = [0u8; HEADER_LEN];
        let encoded = proto::encode_header(&reply, &mut header);
        if let Err(e) = encoded {
            // Our own reply broke a protocol limit: a bug, not input.
            tracing::error!(peer = %self.wire.peer(), ?reply, error = %e, "cannot encode reply");
            self.close("internal error");
            if let Payload::Buf(b) = payload {
                bufs::put(b);
            }
            return;
        }
        debug_assert_eq!(
            proto::payload_len(&reply),
            payload.as_ref().len() + payload.tail_len()
        );
        self.wire.push(&header, payload);
    }

    fn push_error(&mut self, req: Header, errno: i32) {
        self.push_reply(req.reply_with(errno as u32), Payload::None);
    }

    /// Whether a new request may be taken (back-pressure).
    fn can_take_request(&self) -> bool {
        !self.slots.is_full()
            && self.wire.out.bytes() < MAX_REPLY_QUEUE_BYTES
            && !self.subs.holding()
    }

    /// TLS before anything else: check the peer's first byte, then drive
    /// the handshake. `Some(progress)` while it is not established.
    fn tls_step(&mut self) -> Option<bool> {
        if self.tls_expected {
            let mut first = [0u8; 1];
            let Some(tcp) = self.wire.stream.tcp() else {
                return Some(false);
            };
            match tcp.peek(&mut first) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Some(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => return Some(false),
                Err(e) => {
                    self.wire.set_broken();
                    self.close(format!("read failed: {e}"));
                    return Some(true);
                }
                Ok(0) => {
                    self.wire.set_broken();
                    self.close("peer disconnected before the TLS handshake");
                    return Some(true);
                }
                Ok(_) if first[0] != TLS_RECORD_HANDSHAKE => {
                    // Plaintext: its first frame gets a refusal the engine
                    // can log (`take_frame`), then the connection closes.
                    self.tls_expected = false;
                    self.refuse_plain = true;
                    return None;
                }
                Ok(_) => {}
            }
            self.tls_expected = false;
            let LinkStream::Plain(tcp) = std::mem::replace(&mut self.wire.stream, LinkStream::Gone)
            else {
                unreachable!("the stream is plain until the first byte is seen")
            };
            let ctx = self
                .port
                .tls
                .as_ref()
                .expect("TLS expected without a context");
            match TlsStream::new(ctx, tcp) {
                Ok(s) => self.wire.stream = LinkStream::Tls(Box::new(s)),
                Err(e) => {
                    self.wire.set_broken();
                    self.close(format!("cannot start TLS: {e}"));
                    return Some(true);
                }
            }
        }
        let LinkStream::Tls(s) = &mut self.wire.stream else {
            return None;
        };
        match s.handshake() {
            Ok(true) => {
                tracing::info!(peer = %self.wire.peer(), "replica link authenticated (TLS)");
                Some(true)
            }
            Ok(false) => Some(false),
            Err(e) => {
                let hint = handshake_hint(&e.to_string());
                self.wire.set_broken();
                self.wire.refuse(format!("not authenticated: {e} ({hint})"));
                Some(true)
            }
        }
    }

    /// A plaintext peer on a replica that requires TLS: answer its first
    /// frame (a HELLO, from an engine with plain links) with an EACCES
    /// refusal whose HELLO payload is all zeros (nothing about the replica
    /// goes to an unauthenticated peer), and close. What it sent is read
    /// first, so the close is a FIN, not a reset that could beat the
    /// refusal to the engine.
    fn refuse_plaintext(&mut self, raw: &[u8; HEADER_LEN]) {
        let frame = self
            .wire
            .inb
            .buffered()
            .min(HEADER_LEN + proto::MAX_HELLO_REQUEST_LEN);
        self.wire.inb.consume(frame);
        let mut header = [0u8; HEADER_LEN];
        proto::encode_refusal(proto::raw_id(raw), libc::EACCES as u32, &mut header);
        self.wire
            .out
            .push(&header, Payload::Bytes(vec![0; HELLO_LEN]));
        self.wire.refuse(
            "not authenticated: the peer speaks plain replica protocol, and this \
             replica requires TLS (an engine started with --replica-insecure?)",
        );
    }

    /// A modifying request or DETACH from a session that does not own the
    /// replica: an engine's connection closes (its engine is dead or was
    /// replaced; it must not write); a tool, or DETACH, gets `ESTALE`.
    fn fenced_request(&mut self, req: Header, owner: u64) {
        if let Some(session) = self.engine_session().filter(|_| req.kind != Kind::Detach) {
            self.close(format!(
                "fenced: engine session {owner:#x} took the replica over from {session:#x}"
            ));
            return;
        }
        tracing::warn!(peer = %self.wire.peer(), ?req, owner, session = self.session.unwrap_or(0),
            "refused: the replica is owned by another session");
        self.refuse(req, libc::ESTALE);
    }

    /// An error reply, after draining a write's payload.
    /// For a request whose small payload is taken with its header (a
    /// change key, a SNAPSHOT): `Some(false)` while the payload is not all
    /// buffered; for a modifying one, `Some(true)` when it was refused
    /// (a fenced session) or waits (the record must say dirty first; the
    /// frame stays buffered and is taken, and counted, again then).
    /// `None`: go on, counted in the fence if it modifies.
    fn admit_with_payload(&mut self, h: Header, end: usize) -> Option<bool> {
        if self.wire.inb.buffered() < end {
            return Some(false);
        }
        if h.kind.modifies() {
            if let Err(owner) = self.server().fences.enter(&self.fence) {
                self.wire.inb.consume(end);
                self.fenced_request(h, owner);
                return Some(true);
            }
            if !self.server().dirty.load(Ordering::SeqCst) {
                self.fence_exit();
                self.start_meta_wait(MetaFor::Dirty, MetaJob::Attach(0));
                return Some(true);
            }
        }
        None
    }

    /// A request a view does not serve ([`served_on_view`]): `EROFS`,
    /// after draining whatever payload it carries (a write's, a change
    /// key, a SNAPSHOT's op and name), so the stream stays in sync and the
    /// connection goes on. Nothing was counted or noted for it.
    fn refuse_on_view(&mut self, req: Header) {
        self.wire.inb.consume(HEADER_LEN);
        tracing::warn!(peer = %self.wire.peer(), ?req, snapshot = self.view.as_ref().map(|v| v.snapshot.as_str()),
            "refused request: a snapshot view is read-only");
        let payload = proto::payload_len(&req) as u64;
        if payload > 0 {
            self.recv = Recv::drain(payload, req, libc::EROFS as u32);
        } else {
            self.push_error(req, libc::EROFS);
        }
    }

    fn refuse(&mut self, req: Header, errno: i32) {
        if req.kind.is_write() && req.length > 0 {
            self.recv = Recv::drain(u64::from(req.length), req, errno as u32);
        } else {
            self.push_error(req, errno);
        }
    }

    /// A HELLO: the first opens the data channel (a view's, when it names
    /// a snapshot) and fixes the session. A non-zero session newer than
    /// the owner takes the replica over (older ones get `ESTALE`); an
    /// engine's HELLO is answered once other sessions have drained, then
    /// as [`Conn::finish_hello`] says.
    fn handle_hello(&mut self, req: Header, hello: Hello, name: &str) {
        self.hello_done.store(true, Ordering::Relaxed);
        let (replica_name, snapshot) = proto::split_hello_name(name);
        match &self.replica {
            None => match self.port.find(replica_name) {
                Ok(replica) => {
                    // A view's fence is counted too (it lists the
                    // connection), and never entered: session 0, and
                    // `take_frame` refuses what it would count.
                    replica.fences.adopt(&self.fence);
                    self.replica = Some(replica);
                }
                Err((errno, why)) => {
                    tracing::warn!(peer = %self.wire.peer(), replica = replica_name, "{why}");
                    self.refuse_hello(req, errno);
                    self.close(why);
                    return;
                }
            },
            Some(r) if r.name.as_deref().unwrap_or("") != replica_name => {
                tracing::warn!(peer = %self.wire.peer(), first = ?r.name, now = replica_name, "HELLO names another replica");
                self.close("HELLO names another replica than the connection's first");
                return;
            }
            Some(_) => {}
        }
        let first = matches!(self.phase, Phase::AwaitHello);
        if !first && self.view.as_ref().map(|v| v.snapshot.as_str()) != snapshot {
            tracing::warn!(peer = %self.wire.peer(), first = ?self.view.as_ref().map(|v| &v.snapshot),
                now = ?snapshot, "HELLO names another snapshot view");
            self.close("HELLO names another snapshot view than the connection's first");
            return;
        }
        if let Some(snapshot) = snapshot {
            if hello.session != 0 || hello.flags & HELLO_FLAG_ATTACH != 0 {
                tracing::warn!(peer = %self.wire.peer(), snapshot, session = hello.session, flags = hello.flags,
                    "view HELLO refused: a snapshot view takes session 0 and no attach flag");
                self.refuse_hello(req, libc::EINVAL);
                self.close("a snapshot view HELLO with a session or the attach flag");
                return;
            }
            if first {
                let Some(dev) = self.server().chain.snapshot_view(snapshot) else {
                    tracing::warn!(peer = %self.wire.peer(), replica = replica_name, snapshot,
                        "view HELLO refused: no such snapshot");
                    self.refuse_hello(req, libc::ENOENT);
                    self.close(format!("no snapshot {snapshot:?} to view"));
                    return;
                };
                tracing::info!(peer = %self.wire.peer(), replica = replica_name, snapshot, "snapshot view opened");
                self.view = Some(View {
                    snapshot: snapshot.to_string(),
                    dev,
                });
            }
        }
        if hello.volume_size != self.server().size_bytes() {
            tracing::warn!(peer = %self.wire.peer(), theirs = hello.volume_size, ours = self.server().size_bytes(),
                "HELLO with another volume size");
            self.refuse_hello(req, libc::EINVAL);
            self.close("volume size mismatch");
            return;
        }
        match self.session {
            Some(s) if s != hello.session => {
                tracing::warn!(peer = %self.wire.peer(), first = s, now = hello.session, "HELLO with another session");
                self.close("HELLO with another session on the same connection");
                return;
            }
            Some(_) => {}
            None => {
                self.session = Some(hello.session);
                self.fence.set_session(hello.session);
            }
        }
        if hello.session != 0 {
            match self.server().fences.claim(hello.session) {
                Claim::Stale { owner } => {
                    tracing::info!(peer = %self.wire.peer(), session = hello.session, owner,
                        "HELLO of an older engine session refused");
                    self.refuse_hello(req, libc::ESTALE);
                    self.close(format!(
                        "stale engine session {:#x} (owner {owner:#x})",
                        hello.session
                    ));
                    return;
                }
                Claim::Owner { previous } if previous != hello.session => {
                    tracing::info!(peer = %self.wire.peer(), old = previous, new = hello.session,
                        "engine session took the replica over");
                    self.server().fences.wake_others(hello.session);
                }
                Claim::Owner { .. } => {}
            }
        }
        if matches!(self.phase, Phase::AwaitHello) {
            let Some(channel) = self.open_channel() else {
                self.refuse_hello(req, libc::EIO);
                self.close("cannot open a data file channel");
                return;
            };
            self.phase = Phase::Ready { channel };
        }
        if hello.session != 0 {
            // Checked in the next round; usually nothing is in flight.
            self.wait = Some(Wait::Takeover { req, hello });
        } else {
            self.finish_hello(req, hello);
        }
    }

    /// A HELLO past the takeover: one with the attach flag is answered once
    /// its generation is durable (attaching is for the owner, and counts
    /// as a modifying request); a plain one at once. The engine probes with
    /// a plain HELLO and attaches later on any of its connections.
    fn finish_hello(&mut self, req: Header, hello: Hello) {
        if hello.flags & HELLO_FLAG_ATTACH == 0 {
            let payload = self.our_hello(self.current_generation());
            self.push_reply(req.reply_with(0), Payload::Bytes(payload));
            return;
        }
        if let Err(owner) = self.server().fences.enter(&self.fence) {
            tracing::warn!(peer = %self.wire.peer(), session = hello.session, owner,
                "attach refused: the replica is owned by another session");
            self.refuse_hello(req, libc::ESTALE);
            return;
        }
        // Persisting the attach is two fsyncs: a helper thread does it.
        self.start_meta_wait(MetaFor::Attach(req), MetaJob::Attach(hello.generation));
    }

    /// A decoded request on a connection past HELLO. Modifying requests
    /// and DETACH arrive counted in the fence; every path below that
    /// answers or drops one without a slot gives the count back.
    fn start_request(&mut self, req: Header) {
        let counted = req.kind.modifies() || req.kind == Kind::Detach;
        if !matches!(self.phase, Phase::Ready { .. }) {
            debug_assert!(false, "start_request before HELLO");
            if counted {
                self.fence_exit();
            }
            return;
        }
        if req.kind != Kind::Ping && self.drop_draws.chance(self.port.faults.drop) {
            tracing::warn!(peer = %self.wire.peer(), ?req, "fault injection: dropping the connection");
            if counted {
                self.fence_exit();
            }
            self.close("fault injection (--fault-drop)");
            return;
        }
        match req.kind {
            Kind::Ping => {
                self.push_reply(req.reply_with(0), Payload::None);
                return;
            }
            Kind::IntentGet => return self.intent_get(req),
            Kind::IntentMark | Kind::IntentClear => return self.intent_update(req),
            Kind::SnapshotList => return self.start_snapshot(req, SnapshotJob::List),
            Kind::Snapshot | Kind::Changed | Kind::Clone => {
                // `take_frame` takes these with their payload.
                debug_assert!(false, "{:?} handled in take_frame", req.kind);
                if counted {
                    self.fence_exit();
                }
                self.push_error(req, libc::EINVAL);
                return;
            }
            Kind::Detach => return self.start_meta_wait(MetaFor::Detach(req), MetaJob::Detach),
            Kind::Grow => return self.start_snapshot(req, SnapshotJob::Grow(req.offset)),
            _ => {}
        }
        let size = self.server().size_bytes();
        let in_range = req
            .offset
            .checked_add(u64::from(req.length))
            .is_some_and(|end| end <= size);
        if !in_range && req.kind != Kind::Flush {
            tracing::warn!(peer = %self.wire.peer(), ?req, "refused request: out of range");
            if counted {
                self.fence_exit();
            }
            self.refuse(req, libc::EINVAL);
            return;
        }
        let op = match req.kind {
            Kind::Extents => {
                let (dev, layered) = self.data_device();
                self.extents(req, &*dev, layered);
                return;
            }
            Kind::BlockStatus => {
                let (dev, layered) = self.data_device();
                self.block_status(req, &*dev, layered);
                return;
            }
            // Nothing to do for an empty range; the device need not see it.
            Kind::Read | Kind::Write | Kind::WriteFua | Kind::Trim | Kind::WriteZeroes
                if req.length == 0 =>
            {
                self.push_reply(req.reply_with(0), Payload::None);
                if counted {
                    self.fence_exit();
                }
                return;
            }
            Kind::Write | Kind::WriteFua | Kind::Trim | Kind::WriteZeroes => {
                // In range and not empty: every change record notes it
                // before it can reach the data.
                self.server()
                    .intent
                    .note_write(req.offset, u64::from(req.length));
                match req.kind {
                    Kind::Write => IoOp::Write { fua: false },
                    Kind::WriteFua => IoOp::Write { fua: true },
                    Kind::Trim => IoOp::Trim,
                    _ => IoOp::WriteZeroes {
                        no_hole: false,
                        fua: false,
                        fast: false,
                    },
                }
            }
            Kind::Read => IoOp::Read,
            Kind::Flush => IoOp::Flush,
            Kind::Ping
            | Kind::Hello
            | Kind::Detach
            | Kind::IntentMark
            | Kind::IntentClear
            | Kind::IntentGet
            | Kind::ChangesStart
            | Kind::ChangesGet
            | Kind::ChangesDrop
            | Kind::Snapshot
            | Kind::SnapshotList
            | Kind::Changed
            | Kind::Clone
            | Kind::Grow => {
                debug_assert!(false, "{:?} handled above", req.kind);
                return;
            }
        };
        if matches!(op, IoOp::Read) && req.length >= SENDFILE_READ_BYTES_MIN && self.wire.splices()
        {
            if let Some(file) = self.sendfile_file() {
                // Straight from the page cache, in order with the other
                // replies. The socket's bytes are the file's pages, read
                // when the engine receives them (docs/PER_IO.md, "Spliced
                // reads": the engine has no write to the range
                // outstanding then).
                let payload = Payload::File {
                    file,
                    offset: req.offset,
                    len: req.length as usize,
                };
                self.server().sendfile_reads.fetch_add(1, Ordering::Relaxed);
                self.push_reply(req.reply_with(0), payload);
                return;
            }
        }
        // From here the slot holds the fence count, until `complete` or
        // `release_slot`.
        let Some(slot) = self.slots.insert(req) else {
            debug_assert!(false, "take_frame checked for a free slot");
            if counted {
                self.fence_exit();
            }
            self.push_error(req, libc::EAGAIN);
            return;
        };
        match op {
            IoOp::Read => {
                let buf = bufs::get(req.length as usize);
                self.submit(slot, &req, op, Some(buf));
            }
            IoOp::Write { .. } => {
                let buf = bufs::get(req.length as usize);
                self.recv = Recv::payload(slot, req, buf);
            }
            _ => self.submit(slot, &req, op, None),
        }
    }

    /// INTENT_MARK / INTENT_CLEAR (counted in the fence): regions
    /// `[offset, offset + length)`. A mark waits until durable (the
    /// connection reads no frames meanwhile); a clear is answered at once
    /// and persisted lazily.
    fn intent_update(&mut self, req: Header) {
        let regions = self.server().regions();
        let in_range = req
            .offset
            .checked_add(u64::from(req.length))
            .is_some_and(|end| end <= u64::from(regions));
        if !in_range {
            tracing::warn!(peer = %self.wire.peer(), ?req, regions, "refused request: regions out of range");
            self.fence_exit();
            self.push_error(req, libc::EINVAL);
            return;
        }
        // In range, so the first region fits a u32 (regions is one).
        let first = req.offset as u32;
        if req.kind == Kind::IntentClear {
            let cleared = self.server().intent.clear(first, req.length);
            self.fence_exit();
            match cleared {
                Ok(()) => self.push_reply(req.reply_with(0), Payload::None),
                Err(e) => self.intent_failed(req, e),
            }
            return;
        }
        match self.server().intent.mark(first, req.length) {
            // Still counted: the wait gives it back.
            Ok(seq) => self.wait = Some(Wait::Intent { req, seq }),
            Err(e) => {
                self.fence_exit();
                self.intent_failed(req, e);
            }
        }
    }

    /// CHANGES_START / _GET / _DROP with its key (START and DROP counted
    /// in the fence). START waits until durable, as INTENT_MARK does; DROP
    /// is answered at once; GET answers the record's bitmap, `ENOENT` when
    /// there is none for the peer, `ESTALE` (with the record's generation
    /// as the reply's offset) when it is for another generation.
    fn changes_request(&mut self, req: Header, key: proto::ChangeKey) {
        let intent = self.server().intent.clone();
        match req.kind {
            Kind::ChangesStart => match intent.changes_start(&key) {
                Ok(Ok(seq)) => {
                    tracing::info!(peer = %self.wire.peer(), replica = %key.peer,
                        generation = key.generation, "change record started for a replica away");
                    self.wait = Some(Wait::Intent { req, seq });
                }
                Ok(Err(e)) => {
                    tracing::warn!(peer = %self.wire.peer(), replica = %key.peer, error = %e,
                        "change record refused");
                    self.fence_exit();
                    self.push_error(req, e.errno());
                }
                Err(e) => {
                    self.fence_exit();
                    self.intent_failed(req, e);
                }
            },
            Kind::ChangesDrop => {
                let dropped = intent.changes_drop(&key.peer);
                self.fence_exit();
                match dropped {
                    Ok(dropped) => {
                        if dropped {
                            tracing::info!(peer = %self.wire.peer(), replica = %key.peer,
                                "change record ended");
                        }
                        self.push_reply(req.reply_with(0), Payload::None);
                    }
                    Err(e) => self.intent_failed(req, e),
                }
            }
            _ => {
                let (record, region_bytes) = intent.changes_get(&key.peer);
                match record {
                    None => self.push_error(req, libc::ENOENT),
                    Some((generation, _)) if generation != key.generation => {
                        let mut reply = req.reply_with(libc::ESTALE as u32);
                        reply.offset = generation;
                        self.push_reply(reply, Payload::None);
                    }
                    Some((_, bitmap)) => {
                        let mut reply = req.reply_with(0);
                        reply.offset = region_bytes;
                        // At most MAX_CHANGE_BITMAP_BYTES by the region size.
                        reply.length = bitmap.len() as u32;
                        self.push_reply(reply, Payload::Bytes(bitmap));
                    }
                }
            }
        }
    }

    /// INTENT_GET: the bitmap as it is in memory (a superset of what is
    /// durable: marks are set before they are stored, clears persist
    /// lazily), flagged when the record was lost.
    fn intent_get(&mut self, req: Header) {
        let (lost, bitmap) = self.server().intent.snapshot();
        let flags = if lost { INTENT_FLAG_LOST } else { 0 };
        let mut payload = Vec::with_capacity(proto::INTENT_HEADER_LEN + bitmap.len());
        if let Err(e) = proto::encode_intent(flags, &bitmap, &mut payload) {
            tracing::error!(peer = %self.wire.peer(), error = %e, "cannot encode the write-intent record");
            self.push_error(req, libc::EIO);
            return;
        }
        let mut reply = req.reply_with(0);
        reply.offset = u64::from(self.server().regions());
        reply.length = payload.len() as u32;
        self.push_reply(reply, Payload::Bytes(payload));
    }

    /// The device this connection's data requests ask: its snapshot's
    /// view, or the live chain. With whether it answers allocation from
    /// layer maps (`layered`: a scan per 4 KiB block, bounded per reply by
    /// [`MAX_MAP_SCAN_BYTES`]); a view is taken as layered, since the
    /// device does not say how many layers it has (at worst the peer asks
    /// again more often).
    fn data_device(&self) -> (Arc<dyn BlockDevice>, bool) {
        match &self.view {
            Some(view) => (view.dev.clone(), true),
            None => {
                let chain = self.server().chain.clone();
                let layered = chain.single_layer_id().is_none();
                (chain, layered)
            }
        }
    }

    /// Answers EXTENTS inline from `dev`'s allocation
    /// (`BlockDevice::extents`; [`Conn::data_device`]): a chain of one
    /// layer asks its file (SEEK_DATA/SEEK_HOLE, non-sleeping metadata
    /// lookups, ≤ 2 lseeks per extent), a `layered` one its maps (at most
    /// [`MAX_MAP_SCAN_BYTES`] of them per reply). A reply holds at most
    /// `MAX_EXTENTS_PER_REPLY` extents, so the reactor is held for
    /// microseconds; the peer continues from the scan end the reply
    /// reports. A block any layer holds is data: what a rebuild copies is
    /// the live volume (a view's: the snapshot).
    fn extents(&mut self, req: Header, dev: &dyn BlockDevice, layered: bool) {
        let mut end = req.offset + u64::from(req.length);
        if layered {
            end = end.min(req.offset.saturating_add(MAX_MAP_SCAN_BYTES));
        }
        let mut pos = req.offset;
        let mut found: Vec<(u64, u64)> = Vec::new();
        'scan: while pos < end && found.len() < MAX_EXTENTS_PER_REPLY {
            // Holes and data alternate: twice as many cover as many data.
            let extents = match dev.extents(pos, end - pos, 2 * MAX_EXTENTS_PER_REPLY) {
                Ok(extents) if !extents.is_empty() => extents,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(peer = %self.wire.peer(), offset = pos, error = %e, "allocation scan failed");
                    self.push_error(req, e.errno());
                    return;
                }
            };
            for e in extents {
                // Within the range asked, whatever the device reports.
                let len = e.length_bytes.min(end - pos);
                if !e.hole {
                    let full = found.len() == MAX_EXTENTS_PER_REPLY;
                    match found.last_mut() {
                        Some(last) if last.0 + last.1 == pos => last.1 += len,
                        _ if full => break 'scan,
                        _ => found.push((pos, len)),
                    }
                }
                pos += len;
                if pos >= end {
                    break;
                }
            }
        }
        let mut payload = Vec::with_capacity(found.len() * proto::EXTENT_LEN);
        if let Err(e) = proto::encode_extents(&found, &mut payload) {
            tracing::error!(peer = %self.wire.peer(), error = %e, "cannot encode extents");
            self.push_error(req, libc::EIO);
            return;
        }
        let mut reply = req.reply_with(0);
        reply.offset = pos;
        reply.length = payload.len() as u32;
        self.push_reply(reply, Payload::Bytes(payload));
    }

    /// Answers BLOCK_STATUS inline from `dev`'s allocation, like EXTENTS
    /// (at most `MAX_BLOCK_STATUS_PER_REPLY` extents; a `layered` device
    /// scans at most [`MAX_MAP_SCAN_BYTES`] of its maps). A block no
    /// layer holds reads as zeros, so it is reported as hole and zero;
    /// allocated ranges as data. The range was checked against the
    /// volume by the caller.
    fn block_status(&mut self, req: Header, dev: &dyn BlockDevice, layered: bool) {
        if req.length == 0 {
            tracing::warn!(peer = %self.wire.peer(), ?req, "refused request: empty BLOCK_STATUS");
            self.push_error(req, libc::EINVAL);
            return;
        }
        let mut length = u64::from(req.length);
        if layered {
            length = length.min(MAX_MAP_SCAN_BYTES);
        }
        let extents = match dev.extents(req.offset, length, MAX_BLOCK_STATUS_PER_REPLY) {
            Ok(extents) => extents,
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), ?req, error = %e, "block status failed");
                self.push_error(req, e.errno());
                return;
            }
        };
        let records: Vec<StatusExtent> = extents
            .iter()
            .map(|e| StatusExtent {
                length: e.length_bytes,
                flags: if e.hole { proto::STATUS_HOLE } else { 0 }
                    | if e.zero { proto::STATUS_ZERO } else { 0 },
            })
            .collect();
        self.push_status_records(req, &records);
    }

    /// The reply to a BLOCK_STATUS or CHANGED request: `records`
    /// encoded (`encode_block_status`), `EIO` if they cannot be.
    fn push_status_records(&mut self, req: Header, records: &[StatusExtent]) {
        let mut payload = Vec::with_capacity(records.len() * proto::STATUS_EXTENT_LEN);
        if let Err(e) = proto::encode_block_status(records, &mut payload) {
            tracing::error!(peer = %self.wire.peer(), ?req, error = %e, "cannot encode a status reply");
            self.push_error(req, libc::EIO);
            return;
        }
        let mut reply = req.reply_with(0);
        reply.length = payload.len() as u32;
        self.push_reply(reply, Payload::Bytes(payload));
    }

    /// Answers CHANGED inline: which runs of `[offset, offset + length)`
    /// were written since snapshot `since` (`BlockDevice::changed_since`
    /// of the live chain, or of a view: up to its snapshot), as
    /// BLOCK_STATUS-shaped records flagged [`proto::STATUS_CHANGED`]. It
    /// looks at the layer maps block by block whatever the chain's shape,
    /// so a reply scans at most [`MAX_MAP_SCAN_BYTES`] of them and covers
    /// a prefix of the range (the peer asks again for the rest). `EINVAL`
    /// for a range empty or outside the volume; `ENOENT` for no snapshot
    /// `since` on this device (on a view, one not older than the view's).
    fn changed(&mut self, req: Header, request: &ChangedRequest) {
        let size = self.server().size_bytes();
        let in_range = request.length > 0
            && req
                .offset
                .checked_add(u64::from(request.length))
                .is_some_and(|end| end <= size);
        if !in_range {
            tracing::warn!(peer = %self.wire.peer(), ?req, length = request.length, size,
                "refused request: CHANGED range empty or out of range");
            self.push_error(req, libc::EINVAL);
            return;
        }
        // A view's own snapshot is in its chain, as its top layer: the
        // protocol wants a snapshot older than the view's.
        if self
            .view
            .as_ref()
            .is_some_and(|v| v.snapshot == request.since)
        {
            tracing::warn!(peer = %self.wire.peer(), since = %request.since,
                "refused CHANGED: since is the view's own snapshot, not an older one");
            self.push_error(req, libc::ENOENT);
            return;
        }
        let (dev, _) = self.data_device();
        let length = u64::from(request.length).min(MAX_MAP_SCAN_BYTES);
        let runs = match dev.changed_since(
            &request.since,
            req.offset,
            length,
            MAX_BLOCK_STATUS_PER_REPLY,
        ) {
            Ok(runs) => runs,
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), ?req, since = %request.since, error = %e,
                    errno = e.errno(), "CHANGED failed");
                self.push_error(req, e.errno());
                return;
            }
        };
        let records: Vec<StatusExtent> = runs
            .iter()
            .map(|r| StatusExtent {
                length: r.length_bytes,
                flags: if r.changed { proto::STATUS_CHANGED } else { 0 },
            })
            .collect();
        self.push_status_records(req, &records);
    }

    /// The file a READ reply may go from with `sendfile`, decided per
    /// request: the chain's only layer's while it has one layer (every
    /// request then passes straight to that file, so its pages are the
    /// volume's bytes); none once it has snapshots (a block may be in any
    /// layer). Looked up again only when the chain's layers generation
    /// moved: one atomic load per read otherwise.
    ///
    /// A reply queued just before a snapshot is still right, though the
    /// socket reads its bytes from the file after the snapshot: the
    /// snapshot freezes that file as it is (every write acknowledged
    /// before it is in it) and sends later writes to the new head, so the
    /// range keeps its bytes there; and the engine sends no write to a
    /// range while a read of it is outstanding (docs/PER_IO.md, "Spliced
    /// reads"). The only layer never leaves a chain by being dropped, only
    /// frozen (a revert or a merge drops layers only when there are
    /// snapshots), and a file unlinked later stays readable through the
    /// descriptor the reply holds.
    ///
    /// A generation that moved during the lookup leaves this request
    /// without `sendfile`. One that did not may hide a state a control
    /// operation is installing (it sets the state, then the generation),
    /// which it does under its quiesce, with the layer it freezes synced
    /// or the merge into the child done: the answer fits either state.
    ///
    /// None on a view connection: the head file holds the live data, not
    /// the snapshot's.
    fn sendfile_file(&mut self) -> Option<Arc<File>> {
        let r = self.replica.as_ref()?;
        if !r.sendfile || self.view.is_some() {
            return None;
        }
        let generation = r.chain.layers_generation();
        if let Some((seen, file)) = &self.sendfile_cache {
            if *seen == generation {
                return file.clone();
            }
        }
        let file = r
            .chain
            .single_layer_id()
            .and_then(|id| r.layers.page_cache_file(id));
        if r.chain.layers_generation() != generation {
            return None;
        }
        self.sendfile_cache = Some((generation, file.clone()));
        file
    }

    /// Frees a slot whose request is abandoned (a write whose payload
    /// never fully arrived).
    fn release_slot(&mut self, slot: SlotId) {
        if let Some(req) = self.slots.take(slot.to_wire()) {
            if req.kind.modifies() {
                self.fence_exit();
            }
        }
    }

    fn submit(&mut self, slot: SlotId, req: &Header, op: IoOp, buf: Option<IoBuf>) {
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
        let Phase::Ready { channel } = &mut self.phase else {
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
        if let Phase::Ready { channel } = &mut self.phase {
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

/// Whether a view connection serves `kind` (from its snapshot); it
/// answers every other request `EROFS` (`Conn::refuse_on_view`). Every
/// kind is named, so a new one is placed here on purpose.
fn served_on_view(kind: Kind) -> bool {
    match kind {
        Kind::Hello
        | Kind::Read
        | Kind::BlockStatus
        | Kind::Extents
        | Kind::Changed
        | Kind::Clone
        | Kind::Ping => true,
        Kind::Write
        | Kind::WriteFua
        | Kind::Flush
        | Kind::Trim
        | Kind::WriteZeroes
        | Kind::Detach
        | Kind::IntentMark
        | Kind::IntentClear
        | Kind::IntentGet
        | Kind::ChangesStart
        | Kind::ChangesGet
        | Kind::ChangesDrop
        | Kind::Snapshot
        | Kind::SnapshotList
        | Kind::Grow => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A view serves only what reads, and nothing that modifies (what
    /// the fence counts) gets past its check.
    #[test]
    fn a_view_serves_no_modifying_request() {
        for kind in Kind::ALL {
            if kind.modifies() || kind == Kind::Detach {
                assert!(!served_on_view(kind), "{kind:?}");
            }
        }
        assert!(!Kind::Changed.modifies());
    }
}
