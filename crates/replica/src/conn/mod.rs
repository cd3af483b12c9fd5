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
//!
//! # Layout
//!
//! This file holds the connection's state ([`Conn`]), its pump hooks and
//! its run loop; each job is an `impl Conn` of its own file, as the
//! engine shell's are, and the jobs import the state from here, not from
//! each other:
//!
//! - `session`: HELLO, fencing of an older engine, a takeover, TLS.
//! - `waits`: the metadata, snapshot and write-intent waits.
//! - `queries`: EXTENTS, BLOCK_STATUS, CHANGED, INTENT_GET, CHANGES.
//! - `dispatch`: a frame's admission, the request switch, the data
//!   channel's submissions and completions, the replies.

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

mod dispatch;
mod queries;
mod session;
mod waits;

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
}

#[cfg(test)]
mod tests {
    use super::dispatch::served_on_view;
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
