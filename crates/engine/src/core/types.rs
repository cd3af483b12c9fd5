//! The types the engine core's files share: the options and limits, the
//! events in and actions out, what operators see, and the engine's state
//! ([`Engine`] and everything it holds: replicas and their connections,
//! client requests, the rebuild, the generation bump, write-intent regions,
//! the detach). Data only, with a few accessors; the behaviour is in the
//! other files, each an `impl Engine` of one concern.
//!
//! ```ignore
//! // Every file of the core imports from here and `ids`, never from
//! // `core/mod.rs` or from the crate above it:
//! use super::ids::{ReplicaId, ReplicaSet};
//! use super::types::{Engine, LogLevel, Payload, RState, Sub, SubKind};
//! ```
//!
//! This module imports nothing from the core but `ids` (the leaf), so no
//! import runs in a circle: `ids` ← `types` ← the behaviour files ←
//! `mod.rs` (which re-exports the public names).

use std::collections::VecDeque;

use lull_bdev::{BdevError, IoBuf, IoOp, IoRequest};
use lull_net::shared::{SharedBuf, SharedBufs};
use lull_net::slots::SlotTable;
use lull_proto::replica::{Header, Hello, Kind, HEADER_LEN};
use lull_uring::pipes::SplicePipe;

use super::ids::{ConnData, ConnRef, ReplicaData, ReplicaId, ReplicaSet, ReplicaTarget};

// ---- options and limits -----------------------------------------------------

/// Engine settings. Defaults follow Longhorn where it has a setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// A replica silent (no reply, no keep-alive answer) or slower than this
    /// on any request is failed. Longhorn's default is 8 s.
    pub replica_timeout_ms: u64,
    /// TCP connections per replica; requests spread over them.
    pub connections_per_replica: usize,
    /// How often a failed replica's address is tried again.
    pub reconnect_interval_ms: u64,
    /// An idle connection sends a PING this often.
    pub keepalive_interval_ms: u64,
    /// Request slots per connection: bounds in-flight I/O per connection.
    pub slots_per_connection: usize,
}

impl Default for EngineOptions {
    fn default() -> EngineOptions {
        EngineOptions {
            replica_timeout_ms: 8000,
            connections_per_replica: 2,
            reconnect_interval_ms: 2000,
            keepalive_interval_ms: 1000,
            slots_per_connection: 128,
        }
    }
}

/// Channels (NBD connections) one volume serves at once. Bounds the
/// engine's request table (`MAX_CHANNELS * CHANNEL_DEPTH`); NBD clients
/// open 1 to 16 connections per export.
pub const MAX_CHANNELS: usize = 64;

/// Requests one channel may have in the engine. At least the NBD
/// connection's own limit (128), so the engine is never its bottleneck; a
/// channel at its depth returns `BdevError::Full` and retries after its own
/// next completion (which always comes: the count only counts its own).
pub const CHANNEL_DEPTH: usize = 256;

/// Client requests the engine holds at once (queued, in flight or waiting
/// for a generation bump): channels × `CHANNEL_DEPTH` with room to spare.
/// Requests beyond it are refused with EAGAIN-style back-pressure at the
/// channel.
pub const MAX_CLIENT_IOS: usize = MAX_CHANNELS * CHANNEL_DEPTH;

// ---- events in, actions out -------------------------------------------------

/// A client request as the channel submitted it, and which channel.
#[derive(Debug)]
pub struct ClientReq {
    /// The shell's id for the channel, given back in the completion.
    pub channel: u64,
    pub io: IoRequest,
    /// The channel sends READ data on with `splice` and takes it in a pipe
    /// ([`lull_bdev::Channel::allow_splice`]): this read's reply may be
    /// spliced ([`Sink::Pipe`]).
    pub takes_pipe: bool,
    /// For `IoOp::ChangedSince`: the snapshot the channel asks about
    /// ([`lull_bdev::Channel::set_changed_since`]).
    pub since: Option<std::sync::Arc<str>>,
}

/// What happened.
#[derive(Debug)]
pub enum Event {
    Client(ClientReq),
    /// A connection the engine asked for is established.
    ConnUp(ConnRef),
    /// A connection failed to connect, broke, or sent an undecodable frame.
    ConnDown {
        conn: ConnRef,
        reason: String,
    },
    /// A connection was made but the replica could not be authenticated
    /// (or refused this engine's credentials): failed like `ConnDown`, and
    /// retried less and less often, since a wrong key does not fix itself.
    AuthFailed {
        conn: ConnRef,
        reason: String,
    },
    /// A decoded frame, with its payload of `payload_len(&header)` bytes
    /// received where [`Engine::payload_sink`] said when the header came.
    Frame {
        conn: ConnRef,
        header: Header,
        payload: Received,
    },
    /// Time passed (timeouts, keep-alives, reconnects, progress logs).
    Tick,
    AddReplica(ReplicaTarget),
    RemoveReplica(ReplicaTarget),
    /// Limit rebuild and reconcile copies to this many data bytes per
    /// second (0: no limit), from the next segment on.
    SetRebuildLimit(u64),
    /// Take rebuild and reconcile copies from this node-wide budget too.
    SetNodeRebuildLimit(NodeRebuildLimit),
    /// Detach cleanly: refuse new requests, let those in flight finish,
    /// FLUSH and DETACH every healthy replica (they become clean).
    Detach,
    /// A snapshot operation on every healthy replica (`snapshot`); its
    /// outcome comes out as [`Action::ControlDone`] with `token`.
    Snapshot {
        token: u64,
        op: lull_proto::replica::SnapshotOp,
        name: String,
    },
    /// Every healthy replica's snapshots, as [`Action::ControlDone`].
    SnapshotList {
        token: u64,
    },
    /// Grow the volume to `size_bytes` on every replica, then itself
    /// (`grow`); the outcome comes out as [`Action::ControlDone`] with
    /// `token`.
    Grow {
        token: u64,
        size_bytes: u64,
    },
    /// The lists as for `SnapshotList`; then, if every replica is healthy
    /// and no snapshot operation started meanwhile, a snapshot that some
    /// replicas hold and others lack (a create an engine crash cut) is
    /// deleted, as an operation with `token` (`snapshot`). Either outcome
    /// comes out with `token`.
    ReconcileSnapshots {
        token: u64,
    },
    /// The outcome of an [`Action::SyncLayers`] job.
    LayersSynced {
        replica: ReplicaId,
        token: u64,
        result: Result<LayersCopied, LayerSyncError>,
    },
}

/// Why a layer sync did not finish, and whether it changed the target
/// before it stopped (its live data then is no longer what its change
/// records describe).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSyncError {
    pub why: String,
    pub touched: bool,
}

/// What a layer sync copied (`layers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LayersCopied {
    /// Snapshots created on the target.
    pub layers: u32,
    /// Data bytes written to it for them.
    pub bytes: u64,
}

/// The outcome of a control request ([`Event::Snapshot`],
/// [`Event::SnapshotList`]), for the caller waiting on its token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlOutcome {
    Snapshot(Result<(), String>),
    /// Each healthy replica's answer.
    SnapshotLists(Result<Vec<ReplicaSnapshots>, String>),
    /// The volume's size after a grow, or why it did not grow.
    Grow(Result<u64, String>),
}

/// A token bucket over the data bytes rebuild and reconcile copy: a
/// segment enters the copy window only while the bucket holds tokens, and
/// takes its length (the bucket may go into debt by one segment). Refilled
/// from the engine's clock at every event; the shell's tick (100 ms) wakes
/// a run that waits. Client I/O never takes from it: the limit is a fixed
/// share left to the rebuild, the rest of the link is the clients'.
#[derive(Debug, Default)]
pub struct RebuildLimit {
    bucket: lull_reactor::rate::TokenBucket,
    /// The node's total, shared by every engine of the process
    /// ([`NodeRebuildLimit`]): this engine's copy takes its share of it
    /// from `node_bucket` too.
    node: Option<NodeRebuildLimit>,
    node_bucket: lull_reactor::rate::TokenBucket,
    /// Counted among the node's running copies.
    counted: bool,
}

/// The node's total for rebuild and reconcile copies
/// (`node_set_rebuild_limit`), shared by every engine of the process:
/// each running copy gets an equal share of it (the total over the number
/// of copies running), so the sum holds and no volume starves another.
/// Cloned handles share it. 0 is no limit.
#[derive(Debug, Clone, Default)]
pub struct NodeRebuildLimit(std::sync::Arc<NodeShared>);

#[derive(Debug, Default)]
struct NodeShared {
    bytes_per_sec: std::sync::atomic::AtomicU64,
    copies: std::sync::atomic::AtomicU64,
}

impl NodeRebuildLimit {
    pub fn set(&self, bytes_per_sec: u64) {
        self.0
            .bytes_per_sec
            .store(bytes_per_sec, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn bytes_per_sec(&self) -> u64 {
        self.0
            .bytes_per_sec
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Copies running now, on every volume of the node.
    pub fn copies(&self) -> u64 {
        self.0.copies.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One running copy's share (0: no limit).
    fn share(&self) -> u64 {
        let total = self.bytes_per_sec();
        if total == 0 {
            return 0;
        }
        (total / self.copies().max(1)).max(1)
    }
}

/// Bytes copied per rebuild step: what a pipe takes
/// (`lull_uring::splice::PIPE_PAYLOAD_BYTES_MAX`), so that on a plain link
/// the source's READ reply is spliced into a pipe and from the pipe into
/// the target's WRITE, with no copy in lull (a copy through a buffer cost
/// two: 1,028 MiB/s against nbdcopy's 1,704 reading the same volume).
pub const REBUILD_CHUNK_BYTES: u64 = lull_uring::splice::PIPE_PAYLOAD_BYTES_MAX as u64;

/// One replica's answer to SNAPSHOT_LIST.
pub type ReplicaSnapshots = (
    ReplicaTarget,
    Result<Vec<lull_proto::replica::SnapshotRecord>, String>,
);

/// A bucket of `bytes_per_sec` saving 200 ms of its rate (two shell ticks,
/// so a run waiting between ticks loses none of its share), at least one
/// segment.
fn rebuild_bucket(bytes_per_sec: u64, now: u64) -> lull_reactor::rate::TokenBucket {
    let cap = (bytes_per_sec as f64 * 0.2).max(REBUILD_CHUNK_BYTES as f64);
    lull_reactor::rate::TokenBucket::with_cap(bytes_per_sec, cap).starting_at(now)
}

impl RebuildLimit {
    /// A limit of `bytes_per_sec` (0: none) from `now`.
    pub(super) fn set(&mut self, bytes_per_sec: u64, now: u64) {
        self.bucket = rebuild_bucket(bytes_per_sec, now);
    }

    /// Whether a segment of `len` bytes may start now (taking its tokens
    /// from the volume's bucket and its share of the node's, or from
    /// neither).
    pub(super) fn take(&mut self, len: u64, now: u64) -> bool {
        if let Some(node) = &self.node {
            let share = node.share();
            if share != self.node_bucket.rate() {
                self.node_bucket = rebuild_bucket(share, now);
            }
        }
        if self.bucket.wait_ns(now) > 0 || self.node_bucket.wait_ns(now) > 0 {
            return false;
        }
        self.bucket.spend(len as f64);
        self.node_bucket.spend(len as f64);
        true
    }

    pub(super) fn set_node(&mut self, node: NodeRebuildLimit) {
        let running = self.counted;
        self.count(false);
        self.node = Some(node);
        self.count(running);
    }

    /// Whether this engine's copy is running (counted in the node's
    /// shares); called after every event.
    pub(super) fn count(&mut self, running: bool) {
        let Some(node) = &self.node else { return };
        if running != self.counted {
            let copies = &node.0.copies;
            if running {
                copies.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            } else {
                copies.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            }
            self.counted = running;
        }
    }
}

impl Drop for RebuildLimit {
    /// An engine dropped in the middle of a copy (its volume deleted)
    /// leaves the node's count.
    fn drop(&mut self) {
        self.count(false);
    }
}

/// Bytes that follow a header on the wire.
#[derive(Debug)]
pub enum Payload {
    None,
    /// A HELLO record and the replica's name (none for a `lull replica`
    /// process), or a change key: made once per connection, attach or
    /// change of the healthy set, never per I/O.
    Control(Vec<u8>),
    /// The first `len` bytes of a shared write buffer (shared by every
    /// replica the write goes to; returned to the client afterwards).
    Data {
        buf: SharedBuf,
        len: usize,
    },
    /// A copy's data as the source replica sent it, spliced from its
    /// socket into a pipe and from the pipe into the target's (no copy in
    /// lull; plain links only).
    Pipe(SplicePipe),
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        match self {
            Payload::None => &[],
            Payload::Control(h) => h,
            Payload::Data { buf, len } => &buf.as_slice()[..(*len).min(buf.len())],
            // Its bytes are in the pipe: the socket sends them as a tail.
            Payload::Pipe(_) => &[],
        }
    }
}

/// Where a frame's payload is to be received: the core's answer to its
/// header ([`Engine::payload_sink`]), asked before any byte of the payload
/// is read. The payload then comes back in the frame's [`Event::Frame`] as
/// [`Received`].
#[derive(Debug)]
pub enum Sink {
    /// The buffer of the client READ the frame answers, lent by its
    /// request until the frame comes back: the client's reply is sent from
    /// the bytes the socket wrote, and a read holds one buffer, not two.
    ClientBuffer(IoBuf),
    /// As `ClientBuffer`, for a client whose channel takes pipes: the
    /// payload may be spliced from the socket into a pipe instead
    /// ([`Received::Spliced`], no copy in lull), if the socket can (a plain
    /// link, a read of 32 KiB or more that fits a pipe, none of it
    /// buffered yet, a pipe to be had: the shell's socket knows);
    /// otherwise it is received into the buffer.
    Pipe(IoBuf),
    /// A buffer of the engine's, from the thread's cache: any other
    /// payload (HELLO, INTENT_GET, EXTENTS, BLOCK_STATUS, rebuild reads, a
    /// client READ whose buffer cannot take it).
    Own(IoBuf),
}

impl Sink {
    /// The buffer to receive into, whatever the sink (for a receiver that
    /// cannot splice, such as the simulator).
    pub fn into_buf(self) -> IoBuf {
        match self {
            Sink::ClientBuffer(b) | Sink::Pipe(b) | Sink::Own(b) => b,
        }
    }
}

/// A frame's payload as received, in the sink [`Engine::payload_sink`]
/// gave for it.
#[derive(Debug)]
pub enum Received {
    /// The frame has none (`payload_len` is 0).
    None,
    /// In the buffer of a [`Sink`].
    Buf(IoBuf),
    /// A client READ's data spliced into `pipe` ([`Sink::Pipe`]); `buf` is
    /// the client's buffer, whose bytes are not the data. Both go to the
    /// read's completion ([`Action::Complete`]).
    Spliced { buf: IoBuf, pipe: SplicePipe },
}

impl Received {
    /// The payload's buffer, for a frame whose data cannot be in a pipe
    /// (any but a client READ's) or whose reply is refused: a pipe with it
    /// is dropped, which closes it and drops the data it holds (as
    /// `lull_uring::pipes::put` does with a pipe that is not empty).
    pub(super) fn into_buf(self) -> Option<IoBuf> {
        match self {
            Received::None => None,
            Received::Buf(b) | Received::Spliced { buf: b, .. } => Some(b),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Info,
    Warn,
    Error,
}

/// What to do.
#[derive(Debug)]
pub enum Action {
    Send {
        conn: ConnRef,
        header: [u8; HEADER_LEN],
        payload: Payload,
    },
    Complete {
        channel: u64,
        tag: u64,
        result: Result<(), BdevError>,
        buf: Option<IoBuf>,
        /// A successful READ's data in the pipe it was spliced into
        /// ([`Received::Spliced`]); `buf`'s bytes are then not the data.
        spliced: Option<SplicePipe>,
    },
    Connect {
        conn: ConnRef,
        addr: ReplicaTarget,
    },
    Close {
        conn: ConnRef,
    },
    Log {
        level: LogLevel,
        msg: String,
    },
    /// A state change of the volume, as data (its log line says the same
    /// in words).
    Milestone(Milestone),
    /// A control request finished.
    ControlDone {
        token: u64,
        outcome: ControlOutcome,
    },
    /// Copy the snapshots `source` holds and `target` lacks to `target`
    /// (`layers`), off the engine thread; answer with
    /// [`Event::LayersSynced`] and `token`. `session` is the engine's (the
    /// target's writes are fenced by it).
    SyncLayers {
        replica: ReplicaId,
        token: u64,
        source: ReplicaTarget,
        target: ReplicaTarget,
        session: u64,
    },
    /// The layer sync job `token` is no longer wanted (its replica
    /// failed): stop it at its next step. It still answers.
    StopLayerSync {
        token: u64,
    },
}

/// A state change of the volume that an observer may count or check: the
/// simulation asserts on these instead of matching log text; the shell
/// drops them (it logs the line emitted with each). The engine emits them
/// only when the volume changes state (a replica fails, an election, a
/// copy finishes, a detach), never per request, so the data path does not
/// pay for them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Milestone {
    /// A replica left the volume's working set: it failed, or the operator
    /// removed it (`removed`). `was_healthy`: it served reads until now.
    ReplicaFailed {
        replica: ReplicaTarget,
        was_healthy: bool,
        removed: bool,
    },
    /// The last healthy replica failed: I/O fails with EIO until one is
    /// back.
    NoHealthyReplica,
    /// The first election of this engine waits for these replicas (any of
    /// them may hold the newest data). Repeated at most every
    /// `ELECTION_LOG_INTERVAL_NS` while it waits.
    WaitingForReplicas { missing: Vec<ReplicaTarget> },
    /// An election chose `source` (of `generation`) to serve; the
    /// `reconciling` replicas have its generation but may differ from it
    /// inside their write-intent regions.
    Elected {
        source: ReplicaTarget,
        generation: u64,
        clean: bool,
        reconciling: Vec<ReplicaTarget>,
    },
    /// A copy of `kind` (full, or restricted to write-intent regions or
    /// to a change record) finished and `replica` is healthy.
    CopyComplete {
        replica: ReplicaTarget,
        kind: CopyKind,
    },
    /// A clean detach finished; `clean` are the replicas it marked clean.
    Detached { clean: Vec<ReplicaTarget> },
    /// A resumed engine (`Engine::resume_session`) found a replica owned
    /// by the newer `session`: another engine took the volume over, and
    /// this one stands down for good.
    Fenced { session: u64 },
}

// ---- what operators see -----------------------------------------------------

/// Where a replica stands, as reported to operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaState {
    /// Connecting, handshaking, or waiting for the election.
    Connecting,
    /// In the healthy set: receives writes and serves reads.
    Healthy,
    /// Out of the healthy set; retried every `reconnect_interval_ms`.
    Failed,
    /// Receives writes, serves no reads until the copy finishes.
    Rebuilding { done_bytes: u64, total_bytes: u64 },
    /// Of the source's generation but possibly different after an engine
    /// crash: receives writes, serves no reads until the regions the
    /// write-intent records name are copied from the source.
    Reconciling { done_bytes: u64, total_bytes: u64 },
}

/// One replica's status (`replica_status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaStatus {
    pub addr: ReplicaTarget,
    pub state: ReplicaState,
    pub generation: u64,
    /// Requests in flight on its connections.
    pub in_flight: usize,
    /// Times it was failed.
    pub errors: u64,
    pub last_error: Option<String>,
    /// The copy to it running now, if one is.
    pub rebuild: Option<CopyProgress>,
    /// The last copy to it that finished.
    pub last_rebuild: Option<CopyDone>,
}

// ---- the engine's state -----------------------------------------------------

/// The engine of one volume. Its methods are in `mod.rs` (`new`, `apply`,
/// the loop after every event, observation) and in the behaviour files.
pub struct Engine {
    pub(super) volume: String,
    pub(super) size_bytes: u64,
    pub(super) opts: EngineOptions,
    pub(super) replicas: ReplicaData<Replica>,
    pub(super) ios: SlotTable<ClientIo>,
    pub(super) pending: VecDeque<IoId>,
    /// Requests that modify data, sent and not finished, with their byte
    /// ranges `[start, end)` beside them: every dispatch of a write checks
    /// them all for overlap, so the check reads this one array and not
    /// each request's entry in `ios`.
    pub(super) writes_in_flight: Vec<(IoId, u64, u64)>,
    pub(super) deferred: Vec<IoId>,
    /// CHANGES_START requests not answered yet: no write goes out
    /// meanwhile (`changes`).
    pub(super) changes_starting: u32,
    /// Replicas failed because their data differs from their peers'
    /// everywhere (a revert they did not take): the change records
    /// started for them cover the whole volume, so their return copies
    /// it all.
    pub(super) diverged: ReplicaSet,
    pub(super) generation: u64,
    /// The highest generation any bump of this process has started (and
    /// so may have sent in an ATTACH). A bump that does not finish (every
    /// healthy replica failed) may still have reached a replica whose
    /// acknowledgement was lost; the next bump must not reuse its number
    /// for another healthy set, or two replicas with different data would
    /// claim the same generation (simulator seed 208012).
    pub(super) generation_started: u64,
    pub(super) bump: Option<Bump>,
    pub(super) rebuild: Option<Rebuild>,
    pub(super) rebuild_runs: u64,
    /// Layer syncs started (`layers`): the next one's token.
    pub(super) layer_syncs: u64,
    /// The rebuild bandwidth limit (`Event::SetRebuildLimit`).
    pub(super) rebuild_limit: RebuildLimit,
    pub(super) read_rr: usize,
    pub(super) election_start_ns: Option<u64>,
    /// An election has run in this process (so `generation` is known).
    pub(super) elected_once: bool,
    pub(super) election_logged_ns: Option<u64>,
    /// This engine process's session (non-zero), sent in every HELLO.
    pub(super) session: u64,
    /// The session is the one this volume's engine ran with before a
    /// restart of its daemon (`Engine::resume_session`): it is never
    /// raised past a replica's owner, because a newer owner is another
    /// engine that took the volume over since.
    pub(super) session_resumed: bool,
    /// Set when a resumed engine met a replica owned by a newer session
    /// (that session): the engine stands down for good (no election).
    pub(super) fenced_by: Option<u64>,
    pub(super) region_bytes: u64,
    pub(super) regions: Vec<Region>,
    /// Data segment size of a copy: `REBUILD_CHUNK_BYTES` (smaller in the
    /// simulator).
    pub(super) rebuild_chunk_bytes: u64,
    pub(super) detach: Option<Detach>,
    /// The snapshot operation running, if one is (writes wait meanwhile).
    pub(super) snapshot: Option<SnapshotJob>,
    /// The grow running, if one is (writes wait meanwhile).
    pub(super) grow: Option<GrowJob>,
    /// SNAPSHOT_LIST requests waiting for answers.
    pub(super) snapshot_lists: Vec<SnapshotList>,
    /// Snapshot operations started: a reconcile's lists are judged
    /// against it.
    pub(super) snapshot_ops: u64,
    /// The `Arc`s write buffers are shared in, kept between writes: as many
    /// as writes the engine can hold, so a steady load never allocates
    /// (about 40 bytes each, 640 KiB at most).
    pub(super) shares: SharedBufs,
    pub(super) now: u64,
    pub(super) out: Vec<Action>,
    pub(super) started: bool,
}

/// A snapshot operation (`snapshot`).
pub(super) struct SnapshotJob {
    pub(super) token: u64,
    pub(super) op: lull_proto::replica::SnapshotOp,
    pub(super) name: String,
    /// The SNAPSHOT request's payload.
    pub(super) payload: Vec<u8>,
    pub(super) step: SnapshotStep,
    pub(super) started_ns: u64,
    /// Refusals so far, one line per replica.
    pub(super) errors: Vec<String>,
    /// Replicas that answered it with success.
    pub(super) took: ReplicaSet,
}

/// A grow of the volume (`grow`).
pub(super) struct GrowJob {
    pub(super) token: u64,
    pub(super) size_bytes: u64,
    pub(super) step: SnapshotStep,
    pub(super) started_ns: u64,
    /// Refusals and failures so far, one line per replica.
    pub(super) errors: Vec<String>,
    /// Replicas that answered it with success.
    pub(super) took: ReplicaSet,
}

pub(super) enum SnapshotStep {
    /// Writes are held; waiting for those in flight to finish.
    Draining,
    /// SNAPSHOT sent; these replicas have not answered.
    Sent(ReplicaSet),
}

impl SnapshotStep {
    /// (still draining, every replica sent to has answered).
    pub(super) fn progress(&self) -> (bool, bool) {
        match self {
            SnapshotStep::Draining => (true, false),
            SnapshotStep::Sent(waiting) => (false, waiting.is_empty()),
        }
    }
}

/// A SNAPSHOT_LIST request to every healthy replica (`snapshot`).
pub(super) struct SnapshotList {
    pub(super) token: u64,
    pub(super) waiting: ReplicaSet,
    pub(super) got: Vec<ReplicaSnapshots>,
    /// A reconcile ([`Event::ReconcileSnapshots`]): the count of snapshot
    /// operations started when it was asked for (one started since makes
    /// the lists stale).
    pub(super) reconcile: Option<u64>,
}

// Replicas and their connections (`replicas`).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RState {
    /// Connections being set up and probed (HELLO).
    Connecting,
    /// Every connection answered HELLO; waiting for an election.
    Probed,
    /// Stale and about to be rebuilt: first the snapshots a healthy
    /// replica holds and it lacks are copied to it (`layers`). No writes,
    /// no reads.
    Syncing,
    Healthy,
    /// Receives writes, serves no reads, being (or waiting to be) rebuilt.
    Rebuilding,
    Failed,
    Removed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CState {
    Down,
    Connecting,
    /// Connected, HELLO probe sent.
    Hello,
    Up,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum SubKind {
    Client(IoId),
    Probe,
    /// INTENT_GET after the probe.
    IntentGet,
    Attach(u64),
    Ping,
    Rebuild(u64),
    /// INTENT_MARK or INTENT_CLEAR of regions `[offset, offset + length)`.
    Intent,
    /// CHANGES_START or CHANGES_DROP (`changes`).
    Changes,
    /// CHANGES_GET for the replica that came back.
    ChangesGet(ReplicaId),
    /// FLUSH or DETACH of a clean detach.
    Detach,
    /// SNAPSHOT of the operation running (`snapshot`).
    Snapshot,
    /// SNAPSHOT_LIST for the list request of this token.
    SnapshotList(u64),
    /// GROW of the grow running (`grow`).
    Grow,
}

/// One request in a connection's slot table.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sub {
    pub(super) what: SubKind,
    pub(super) kind: Kind,
    pub(super) offset: u64,
    pub(super) length: u32,
    pub(super) sent_ns: u64,
}

pub(super) struct Conn {
    pub(super) state: CState,
    pub(super) epoch: u32,
    pub(super) slots: SlotTable<Sub>,
    pub(super) last_rx_ns: u64,
    pub(super) last_tx_ns: u64,
    pub(super) ping_out: bool,
    pub(super) probe: Option<Hello>,
}

pub(super) struct Replica {
    pub(super) addr: ReplicaTarget,
    pub(super) state: RState,
    pub(super) conns: ConnData<Conn>,
    /// Last generation the replica reported or persisted for us.
    pub(super) generation: u64,
    pub(super) clean: bool,
    /// Highest generation this replica persisted at our request.
    pub(super) attached_gen: u64,
    pub(super) attach_in_flight: bool,
    pub(super) errors: u64,
    pub(super) last_error: Option<String>,
    pub(super) retry_at_ns: u64,
    /// Authentication failures in a row (reset when the replica accepts a
    /// HELLO): each doubles the wait before the next attempt.
    pub(super) auth_failures: u32,
    pub(super) next_conn: usize,
    /// Its write-intent bitmap (INTENT_GET after the probe), kept until
    /// the election that uses it.
    pub(super) intent: Option<Vec<u8>>,
    pub(super) intent_lost: bool,
    /// While Rebuilding: the regions to reconcile (a copy restricted to
    /// them), or `None` for a full rebuild.
    pub(super) reconcile: Option<Vec<u8>>,
    /// While Rebuilding and not reconciling: the search for a change
    /// record that makes its copy a delta (`changes`).
    pub(super) lookup: Lookup,
    /// The last copy to this replica that finished.
    pub(super) last_rebuild: Option<CopyDone>,
    /// The token of the layer sync job running for it (0: none). Set
    /// while Syncing, and kept if it fails meanwhile: it is not connected
    /// again until the job has answered (a job still writing to it must
    /// not find it back in use), and the shell is told to stop the job.
    pub(super) sync_token: u64,
}

/// The search for a change record of a replica that came back
/// (`changes`).
#[derive(Debug, Clone)]
pub(super) enum Lookup {
    /// None (a full rebuild, or a reconcile).
    Off,
    /// Ask the healthy replicas not in `asked`, one at a time.
    Ask { asked: ReplicaSet },
    /// A CHANGES_GET is out to `from`. `racing`: the ranges of writes in
    /// flight when it was sent, which may reach `from` after it and are
    /// not going to the replica that came back.
    Asking {
        from: ReplicaId,
        asked: ReplicaSet,
        racing: Vec<(u64, u64)>,
    },
    /// `from` holds a record: copy the regions of `map`.
    Found { from: ReplicaId, map: CopyMap },
}

/// Regions to copy: bit `i` covers `[i × region_bytes, (i + 1) ×
/// region_bytes)` of the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CopyMap {
    pub(super) bits: Vec<u8>,
    pub(super) region_bytes: u64,
}

// Client requests (`io`).

/// A client request's id: its wire id in the engine's request table. It
/// never leaves the process; the generation makes a late reference to a
/// finished request find nothing instead of its slot's next tenant.
pub(super) type IoId = u64;

pub(super) struct ClientIo {
    pub(super) channel: u64,
    /// The channel takes a READ's data in a pipe (`ClientReq::takes_pipe`).
    pub(super) takes_pipe: bool,
    pub(super) tag: u64,
    pub(super) op: IoOp,
    pub(super) offset: u64,
    pub(super) len: u32,
    pub(super) data: IoData,
    pub(super) outstanding: u32,
    pub(super) acked: ReplicaSet,
    /// WRITE_ZEROES with FUA: a FLUSH follows (the wire has no FUA for it).
    pub(super) flush_after: bool,
    /// Counted in its regions' `writes` (from dispatch to its last reply).
    pub(super) in_regions: bool,
    /// `IoOp::ChangedSince`: the snapshot it asks about.
    pub(super) since: Option<std::sync::Arc<str>>,
}

impl ClientIo {
    pub(super) fn modifies(&self) -> bool {
        matches!(
            self.op,
            IoOp::Write { .. } | IoOp::Trim | IoOp::WriteZeroes { .. }
        )
    }
    pub(super) fn end(&self) -> u64 {
        self.offset + u64::from(self.len)
    }
}

pub(super) enum IoData {
    None,
    /// A read's buffer, or a block status's record buffer.
    Read(Option<IoBuf>),
    /// A write's buffer, shared by its frames to every replica.
    Write(SharedBuf),
}

// Rebuild and reconcile (`rebuild`).

pub(super) struct Rebuild {
    pub(super) run: u64,
    pub(super) target: ReplicaId,
    pub(super) source: ReplicaId,
    /// Reconcile and delta: only these regions are copied; `None` copies
    /// the whole volume.
    pub(super) regions: Option<CopyMap>,
    pub(super) kind: CopyKind,
    /// Bytes the run covers (the volume, or its regions to reconcile), and
    /// how many of them are done (counted as each segment's write or trim
    /// is acknowledged, in whatever order they come).
    pub(super) total_bytes: u64,
    pub(super) done_bytes: u64,
    /// Everything below has been scanned: its segments are queued, in the
    /// window or done.
    pub(super) scanned: u64,
    /// The start of the EXTENTS scan in flight, if one is.
    pub(super) scan: Option<u64>,
    /// Segments scanned and not started yet, in offset order, all above
    /// the window's.
    pub(super) segments: VecDeque<Segment>,
    /// Segments being copied, in offset order: admitted while fewer than
    /// `REBUILD_WINDOW_SEGMENTS`, and at most twice that when rechecked
    /// holes split (the rest of each stays in). Each holds its range from
    /// client writes from the moment it enters until its write or trim is
    /// acknowledged, when it leaves (possibly before older ones).
    pub(super) window: VecDeque<InFlight>,
    pub(super) started_ns: u64,
    pub(super) copied_bytes: u64,
    pub(super) last_log_ns: u64,
    pub(super) last_log_pct: u64,
}

impl Rebuild {
    /// Whether a segment in the window holds a range overlapping `range`
    /// (a client write to it waits).
    pub(super) fn locks(&self, range: (u64, u64)) -> bool {
        self.window
            .iter()
            .any(|e| e.seg.offset < range.1 && range.0 < e.seg.end())
    }

    /// Everything below is copied (or outside the run's regions): the
    /// oldest segment not finished bounds it, since segments finish out of
    /// order.
    pub(super) fn cursor(&self) -> u64 {
        self.window
            .front()
            .map(|e| e.seg.offset)
            .or_else(|| self.segments.front().map(|s| s.offset))
            .unwrap_or(self.scanned)
    }

    pub(super) fn kind(&self) -> CopyKind {
        self.kind
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Segment {
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) data: bool,
    /// A hole confirmed by an EXTENTS of the source while the segment was
    /// held; only such a hole may be trimmed on the target.
    pub(super) verified: bool,
}

impl Segment {
    pub(super) fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// A segment in the copy window and where its copy stands.
pub(super) struct InFlight {
    pub(super) seg: Segment,
    pub(super) step: Step,
}

pub(super) enum Step {
    /// Holding the segment: waiting for overlapping writes to drain.
    Draining,
    /// Asking the source again, under the lock, whether a hole is still one.
    Rechecking,
    Reading,
    /// Data read from the source, waiting for a slot on the target: in a
    /// buffer, or in a pipe (`Payload::Pipe`).
    ReadDone(SharedBuf),
    ReadSpliced(SplicePipe),
    Writing,
}

/// What a copy to a replica covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyKind {
    /// The whole volume (a replica behind, or new).
    Full,
    /// The regions write-intent records name after an engine crash.
    Reconcile,
    /// The regions written while the replica was away (a change record).
    Delta,
}

impl CopyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CopyKind::Full => "full",
            CopyKind::Reconcile => "reconcile",
            CopyKind::Delta => "delta",
        }
    }
}

/// A copy running to a replica (`replica_list`'s `rebuild`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyProgress {
    pub kind: CopyKind,
    pub bytes_total: u64,
    pub bytes_done: u64,
    /// `bytes_done` over the time since the copy started.
    pub rate_bytes_per_sec: u64,
}

/// The last copy to a replica that finished (`replica_list`'s
/// `last_rebuild`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyDone {
    pub kind: CopyKind,
    /// Bytes the copy covered (holes included).
    pub bytes: u64,
    /// Bytes of data read from the source and written.
    pub bytes_copied: u64,
    pub duration_ns: u64,
}

// Generations (`election`), write intent (`intent`), the clean detach
// (`detach`).

pub(super) struct Bump {
    pub(super) generation: u64,
}

/// Write-intent state of one region (see `intent`'s module doc). 24 bytes;
/// a volume has at most `lull_proto::replica::MAX_INTENT_REGIONS` (16,384)
/// regions, so at most 384 KiB per volume.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Region {
    /// Replicas whose bit for this region is durable (MARK answered, or
    /// reported by INTENT_GET before the election).
    pub(super) marked: ReplicaSet,
    /// Replicas with a MARK of it in flight.
    pub(super) marking: ReplicaSet,
    /// Replicas with a CLEAR of it in flight; writes to it wait meanwhile,
    /// or a CLEAR overtaken by a write's MARK could erase that MARK.
    pub(super) clearing: ReplicaSet,
    /// Modifying client requests in flight over it.
    pub(super) writes: u32,
    /// When the last of them finished.
    pub(super) last_write_ns: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Detach {
    /// Waiting for every request (client, MARK, CLEAR, rebuild) to finish.
    Draining,
    /// FLUSH sent to these replicas, not yet answered.
    Flushing(ReplicaSet),
    /// DETACH sent to these replicas, not yet answered.
    Detaching(ReplicaSet),
    Done,
}

#[cfg(test)]
mod rebuild_limit_tests {
    use super::RebuildLimit;

    /// Bytes a limited copy moves in `secs` seconds of 1 MiB segments,
    /// looking again every 100 ms (the shell's tick) when told to wait.
    fn copied(limit: &mut RebuildLimit, start_ns: u64, secs: u64) -> u64 {
        let (mut now, end, mut bytes) = (start_ns, start_ns + secs * 1_000_000_000, 0);
        while now < end {
            if limit.take(1 << 20, now) {
                bytes += 1 << 20;
            } else {
                now += 100_000_000;
            }
        }
        bytes
    }

    #[test]
    fn a_rebuild_limit_holds_its_rate_and_changes_at_once() {
        let mut l = RebuildLimit::default();
        assert!(l.take(1 << 30, 0), "no limit: everything goes");
        l.set(10_000_000, 0);
        let b = copied(&mut l, 0, 10) as f64;
        // The rate, plus the 200 ms saved at the start and one segment of debt.
        assert!((100e6..=104e6).contains(&b), "{b}");
        l.set(50_000_000, 10_000_000_000);
        let b = copied(&mut l, 10_000_000_000, 10) as f64;
        assert!((500e6..=512e6).contains(&b), "{b}");
    }
}
