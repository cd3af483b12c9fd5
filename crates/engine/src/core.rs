//! The engine core: a pure state machine. Events in (client requests,
//! replica frames, connections up and down, clock ticks), actions out
//! (frames to send, completions, connects, closes, log lines). It never
//! reads a clock or touches a socket, so the simulation in `sim.rs` drives
//! it deterministically and the reactor shell in `shell.rs` only moves
//! bytes.
//!
//! ```ignore
//! let mut e = Engine::new("vol0", 1 << 30, vec![a, b], EngineOptions::default());
//! let mut out = Vec::new();
//! e.start(0, &mut out);                       // Connect{..} for every connection
//! e.apply(Event::ConnUp(conn), now, &mut out); // HELLO probe goes out
//! e.check_invariants();
//! ```
//!
//! # Data path
//!
//! A write (also TRIM, WRITE_ZEROES) goes to every Healthy and Rebuilding
//! replica and completes when every one of them has answered; it succeeds
//! when at least one replica that is still Healthy acknowledged it (a
//! replica that fails it is failed and leaves the healthy set). A read goes
//! to one Healthy replica, round-robin; a failed read is retried on another.
//! FLUSH goes to every Healthy and Rebuilding replica.
//!
//! Overlapping writes are serialised: a write that overlaps one in flight
//! waits, so two replicas can never apply two overlapping writes in
//! different orders (they travel on different TCP connections).
//!
//! # Generations
//!
//! Each replica persists a generation. Whenever the healthy set changes
//! (attach, a replica failed, a rebuild finished) the engine bumps the
//! generation on every healthy replica (HELLO with the attach flag) and
//! holds write acknowledgements until all of them persisted it. A replica
//! that missed acknowledged writes therefore always has a lower generation
//! than the ones that have them, and the election after a restart picks
//! the freshest. That election waits for every replica of the volume (one
//! that is away may be the freshest; see `ELECTION_WAIT_NS`).
//!
//! # Rebuild and the copy/write race
//!
//! A replica that comes back is Rebuilding: it receives every new write but
//! serves no read. The copy walks the volume in order: EXTENTS on the
//! source gives data and hole segments; each segment (at most
//! `REBUILD_CHUNK_BYTES`) is *locked*: new client writes overlapping it
//! wait, writes already in flight over it drain, and only then is the
//! segment read from the source (so the read sees every acknowledged
//! write) and written to the target (holes are trimmed on the target).
//! Writes outside the lock go to both replicas; those beyond the copy
//! cursor are later overwritten by the copy with the same data.
//!
//! # Engine crashes: clean detach, write intent, reconcile
//!
//! An engine that dies may leave a write on some replicas and not on
//! others, at equal generations. Three things keep reads from ever
//! alternating between old and new data afterwards:
//!
//! - **Sessions.** Each engine process has a session (from the clock, so
//!   later engines have larger ones), sent in every HELLO; a replica
//!   answers a newer session's HELLO only once the writes of older
//!   sessions it already took have completed, and refuses older sessions
//!   from then on (see `lull_proto::replica`). Nothing of a dead engine
//!   lands after the new one has looked.
//! - **Clean detach.** A replica is clean only when the last engine
//!   detached from it after a FLUSH with nothing in flight ([`Event::Detach`]).
//!   Replicas of one generation that are all clean are identical.
//! - **Write intent** (md's write-intent bitmap, one bit per region of
//!   `wire::intent_region_bytes`): before the first write to a region, the
//!   engine sets the region's bit on every replica it writes to
//!   (INTENT_MARK, durable before the reply) and holds the write until all
//!   of them answered; it clears the bit (INTENT_CLEAR) once the region has
//!   had no write for `INTENT_CLEAR_IDLE_NS`. A write sent to any replica
//!   therefore lies in a region whose bit is durable on that replica, so
//!   the union of the bitmaps covers every block where replicas of one
//!   generation may differ. Cost per write: a bit test per region it spans;
//!   per region, one MARK round trip (an fdatasync on each replica, shared
//!   by every MARK that arrives meanwhile) when it turns from quiet to busy.
//!   Rebuild and reconcile copies obey the same rule on their target.
//!
//! After an election where the replicas of the freshest generation are not
//! all clean, the source serves alone while each other replica of that
//! generation is **reconciled**: a rebuild restricted to the union of the
//! bitmaps (a replica whose record was lost reports every region, so that
//! is a full copy). Until then it takes writes but serves no read, so every
//! read comes from one copy.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;

use lull_bdev::{BdevError, BufPool, IoBuf, IoOp, IoRequest};
use lull_net::slots::{SlotId, SlotTable};
use lull_proto::replica::{self as wire, Header, Hello, Kind, HEADER_LEN, HELLO_LEN};

use crate::{EngineOptions, ReplicaState, ReplicaStatus};

/// Replicas one volume may have (configured plus added). Longhorn runs 3;
/// the bound keeps replica sets in a `u32` bit mask.
pub const MAX_REPLICAS: usize = 16;

/// Client requests the engine holds at once (queued, in flight or waiting
/// for a generation bump): channels × `CHANNEL_DEPTH` with room to spare.
/// Requests beyond it are refused with EAGAIN-style back-pressure at the
/// channel (see `shell::MAX_CHANNELS`).
pub const MAX_CLIENT_IOS: usize = crate::shell::MAX_CHANNELS * crate::shell::CHANNEL_DEPTH;

/// A client request's id: its wire id in the engine's request table. It
/// never leaves the process; the generation makes a late reference to a
/// finished request find nothing instead of its slot's next tenant.
type IoId = u64;

/// Bytes copied per rebuild step. 1 MiB amortises the round trips while
/// keeping the range held from client writes short (a few ms).
pub const REBUILD_CHUNK_BYTES: u64 = 1 << 20;

/// Largest hole trimmed on the rebuild target in one request: TRIM carries
/// a u32 length; 1 GiB keeps each request well inside it.
pub const REBUILD_TRIM_BYTES: u64 = 1 << 30;

/// Range scanned per EXTENTS request. The replica stops earlier when it has
/// `MAX_EXTENTS_PER_REPLY` extents; 1 GiB fits the u32 length field.
pub const REBUILD_SCAN_BYTES: u64 = 1 << 30;

/// How long a later election (every healthy replica failed while the
/// engine ran) waits for every replica to answer before it picks the
/// freshest of those that did. The engine then knows the generation every
/// acknowledged write reached, and no replica below it is a candidate, so
/// waiting longer only chooses among equally fresh ones.
///
/// The first election after the engine starts has no such knowledge: a
/// replica that is away may hold acknowledged writes the others missed.
/// That election therefore waits for every replica of the volume, however
/// long it takes; an operator who knows a replica is lost for good removes
/// it (`replica_remove`) and accepts whatever it alone held.
pub const ELECTION_WAIT_NS: u64 = 3_000_000_000;

/// While the first election waits for a replica, the wait is logged this
/// often.
pub const ELECTION_LOG_INTERVAL_NS: u64 = 10_000_000_000;

/// Rebuild progress is logged at least this often.
pub const REBUILD_LOG_INTERVAL_NS: u64 = 5_000_000_000;

/// A region's write-intent bit is cleared once no write has touched it for
/// this long (md's bitmap daemon waits 5 s too). Shorter would cost more
/// MARKs (fsyncs) on regions that are written in bursts; longer only grows
/// what a crash leaves to reconcile.
pub const INTENT_CLEAR_IDLE_NS: u64 = 5_000_000_000;

/// INTENT_CLEAR requests sent per replica per tick: clearing is background
/// work and must not fill the slot tables that client I/O needs.
pub const MAX_CLEARS_PER_TICK: usize = 32;

/// Requests that wait for their regions' MARKs and that later requests
/// may pass, and pending requests looked at past them to send their MARKs
/// too, so that the replicas persist a burst of newly written regions in
/// one fsync instead of one after the other. 64 is the queue depth of a
/// busy client; the bound keeps each pass over the queue short.
pub const MARK_LOOKAHEAD: usize = 64;

/// Identifies one TCP connection of one replica; `epoch` changes at every
/// (re)connect so that events of an older connection are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnRef {
    pub replica: u32,
    pub conn: u32,
    pub epoch: u32,
}

/// A client request as the channel submitted it, and which channel.
#[derive(Debug)]
pub struct ClientReq {
    /// The shell's id for the channel, given back in the completion.
    pub channel: u64,
    pub io: IoRequest,
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
    /// A decoded frame (payload of `payload_len(&header)` bytes, if any).
    Frame {
        conn: ConnRef,
        header: Header,
        payload: Option<IoBuf>,
    },
    /// Time passed (timeouts, keep-alives, reconnects, progress logs).
    Tick,
    AddReplica(SocketAddr),
    RemoveReplica(SocketAddr),
    /// Detach cleanly: refuse new requests, let those in flight finish,
    /// FLUSH and DETACH every healthy replica (they become clean).
    Detach,
}

/// Bytes that follow a header on the wire.
#[derive(Debug)]
pub enum Payload {
    None,
    Hello([u8; HELLO_LEN]),
    /// The first `len` bytes of a shared write buffer (shared by every
    /// replica the write goes to; returned to the client afterwards).
    Data {
        buf: Arc<IoBuf>,
        len: usize,
    },
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        match self {
            Payload::None => &[],
            Payload::Hello(h) => h,
            Payload::Data { buf, len } => &buf.as_slice()[..(*len).min(buf.len())],
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
    },
    Connect {
        conn: ConnRef,
        addr: SocketAddr,
    },
    Close {
        conn: ConnRef,
    },
    Log {
        level: LogLevel,
        msg: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RState {
    /// Connections being set up and probed (HELLO).
    Connecting,
    /// Every connection answered HELLO; waiting for an election.
    Probed,
    Healthy,
    /// Receives writes, serves no reads, being (or waiting to be) rebuilt.
    Rebuilding,
    Failed,
    Removed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CState {
    Down,
    Connecting,
    /// Connected, HELLO probe sent.
    Hello,
    Up,
}

#[derive(Debug, Clone, Copy)]
enum SubKind {
    Client(IoId),
    Probe,
    /// INTENT_GET after the probe.
    IntentGet,
    Attach(u64),
    Ping,
    Rebuild(u64),
    /// INTENT_MARK or INTENT_CLEAR of regions `[offset, offset + length)`.
    Intent,
    /// FLUSH or DETACH of a clean detach.
    Detach,
}

/// One request in a connection's slot table.
#[derive(Debug, Clone, Copy)]
struct Sub {
    what: SubKind,
    kind: Kind,
    offset: u64,
    length: u32,
    sent_ns: u64,
}

struct Conn {
    state: CState,
    epoch: u32,
    slots: SlotTable<Sub>,
    last_rx_ns: u64,
    last_tx_ns: u64,
    ping_out: bool,
    probe: Option<Hello>,
}

struct Replica {
    addr: SocketAddr,
    state: RState,
    conns: Vec<Conn>,
    /// Last generation the replica reported or persisted for us.
    generation: u64,
    clean: bool,
    /// Highest generation this replica persisted at our request.
    attached_gen: u64,
    attach_in_flight: bool,
    errors: u64,
    last_error: Option<String>,
    retry_at_ns: u64,
    next_conn: usize,
    /// Its write-intent bitmap (INTENT_GET after the probe), kept until
    /// the election that uses it.
    intent: Option<Vec<u8>>,
    intent_lost: bool,
    /// While Rebuilding: the regions to reconcile (a copy restricted to
    /// them), or `None` for a full rebuild.
    reconcile: Option<Vec<u8>>,
}

/// Write-intent state of one region (see the module doc). 24 bytes; a
/// volume has at most `wire::MAX_INTENT_REGIONS` (16,384) regions, so at
/// most 384 KiB per volume.
#[derive(Debug, Clone, Copy, Default)]
struct Region {
    /// Replicas whose bit for this region is durable (MARK answered, or
    /// reported by INTENT_GET before the election).
    marked: u32,
    /// Replicas with a MARK of it in flight.
    marking: u32,
    /// Replicas with a CLEAR of it in flight; writes to it wait meanwhile,
    /// or a CLEAR overtaken by a write's MARK could erase that MARK.
    clearing: u32,
    /// Modifying client requests in flight over it.
    writes: u32,
    /// When the last of them finished.
    last_write_ns: u64,
}

enum IoData {
    None,
    Read(Option<IoBuf>),
    Write(Arc<IoBuf>),
}

struct ClientIo {
    channel: u64,
    tag: u64,
    op: IoOp,
    offset: u64,
    len: u32,
    data: IoData,
    outstanding: u32,
    acked: u32,
    /// WRITE_ZEROES with FUA: a FLUSH follows (the wire has no FUA for it).
    flush_after: bool,
    /// Counted in its regions' `writes` (from dispatch to its last reply).
    in_regions: bool,
}

impl ClientIo {
    fn modifies(&self) -> bool {
        matches!(
            self.op,
            IoOp::Write { .. } | IoOp::Trim | IoOp::WriteZeroes { .. }
        )
    }
    fn end(&self) -> u64 {
        self.offset + u64::from(self.len)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Segment {
    offset: u64,
    len: u64,
    data: bool,
    /// A hole confirmed by an EXTENTS of the source while the segment was
    /// held; only such a hole may be trimmed on the target.
    verified: bool,
}

impl Segment {
    fn end(&self) -> u64 {
        self.offset + self.len
    }
}

enum Step {
    Idle,
    Scanning,
    /// Holding the front segment: waiting for overlapping writes to drain.
    Draining,
    /// Asking the source again, under the lock, whether a hole is still one.
    Rechecking,
    Reading,
    /// Data read from the source, waiting for a slot on the target.
    ReadDone(Arc<IoBuf>),
    Writing,
}

struct Rebuild {
    run: u64,
    target: usize,
    source: usize,
    /// Reconcile: only these regions are copied (bitmap over write-intent
    /// regions); `None` copies the whole volume.
    regions: Option<Vec<u8>>,
    /// Bytes the run covers (the volume, or its regions to reconcile), and
    /// how many of them are done.
    total_bytes: u64,
    done_bytes: u64,
    /// Everything below is copied.
    cursor: u64,
    segments: VecDeque<Segment>,
    step: Step,
    started_ns: u64,
    copied_bytes: u64,
    last_log_ns: u64,
    last_log_pct: u64,
}

impl Rebuild {
    fn lock(&self) -> Option<(u64, u64)> {
        match self.step {
            Step::Idle | Step::Scanning => None,
            _ => self.segments.front().map(|s| (s.offset, s.end())),
        }
    }
}

struct Bump {
    generation: u64,
}

/// What `dispatch` did with a pending request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dispatch {
    /// Sent, or finished (failed or nothing to do): off the queue.
    Done,
    /// Must wait for slots, an overlapping write or the rebuild lock.
    Wait,
    /// Waits only for its regions' MARKs (sent): later requests may pass.
    WaitMarks,
}

/// Steps of a clean detach ([`Event::Detach`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Detach {
    /// Waiting for every request (client, MARK, CLEAR, rebuild) to finish.
    Draining,
    /// FLUSH sent to the replicas in the mask.
    Flushing(u32),
    /// DETACH sent to the replicas in the mask.
    Detaching(u32),
    Done,
}

fn has_bit(bitmap: &[u8], i: usize) -> bool {
    bitmap.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0)
}

fn count_bits(bitmap: &[u8]) -> u64 {
    bitmap.iter().map(|b| u64::from(b.count_ones())).sum()
}

/// The engine of one volume.
pub struct Engine {
    volume: String,
    size_bytes: u64,
    opts: EngineOptions,
    replicas: Vec<Replica>,
    ios: SlotTable<ClientIo>,
    pending: VecDeque<IoId>,
    writes_in_flight: Vec<IoId>,
    deferred: Vec<IoId>,
    generation: u64,
    bump: Option<Bump>,
    rebuild: Option<Rebuild>,
    rebuild_runs: u64,
    read_rr: usize,
    election_start_ns: Option<u64>,
    /// An election has run in this process (so `generation` is known).
    elected_once: bool,
    election_logged_ns: Option<u64>,
    /// This engine process's session (non-zero), sent in every HELLO.
    session: u64,
    region_bytes: u64,
    regions: Vec<Region>,
    detach: Option<Detach>,
    pool: BufPool,
    now: u64,
    out: Vec<Action>,
    started: bool,
}

/// Buffers the engine caches (read replies, rebuild chunks).
const ENGINE_BUF_CACHE_BYTES: usize = 64 << 20;

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

fn eio(why: &str) -> BdevError {
    BdevError::Failed(why.to_string())
}

impl Engine {
    /// Change the keep-alive interval at run time (kept below the replica
    /// timeout, or idle replicas would time out).
    pub fn set_keepalive_interval_ms(&mut self, ms: u64) {
        self.opts.keepalive_interval_ms =
            ms.clamp(1, self.opts.replica_timeout_ms.saturating_sub(1).max(1));
    }

    /// `session` identifies this engine process to the replicas: non-zero,
    /// and larger than any earlier engine's (the shell takes the clock).
    pub fn new(
        volume: &str,
        size_bytes: u64,
        replicas: Vec<SocketAddr>,
        opts: EngineOptions,
        session: u64,
    ) -> Engine {
        let mut e = Engine {
            volume: volume.to_string(),
            size_bytes,
            opts,
            replicas: Vec::new(),
            ios: SlotTable::new(MAX_CLIENT_IOS),
            pending: VecDeque::new(),
            writes_in_flight: Vec::new(),
            deferred: Vec::new(),
            generation: 0,
            bump: None,
            rebuild: None,
            rebuild_runs: 0,
            read_rr: 0,
            election_start_ns: None,
            elected_once: false,
            election_logged_ns: None,
            session: session.max(1),
            region_bytes: wire::intent_region_bytes(size_bytes),
            regions: vec![Region::default(); wire::intent_regions(size_bytes) as usize],
            detach: None,
            pool: BufPool::new(ENGINE_BUF_CACHE_BYTES),
            now: 0,
            out: Vec::new(),
            started: false,
        };
        for addr in replicas.into_iter().take(MAX_REPLICAS) {
            e.push_replica(addr);
        }
        e
    }

    fn push_replica(&mut self, addr: SocketAddr) -> usize {
        let conns = (0..self.opts.connections_per_replica.max(1))
            .map(|_| Conn {
                state: CState::Down,
                epoch: 0,
                slots: SlotTable::new(self.opts.slots_per_connection),
                last_rx_ns: 0,
                last_tx_ns: 0,
                ping_out: false,
                probe: None,
            })
            .collect();
        let r = Replica {
            addr,
            state: RState::Failed,
            conns,
            generation: 0,
            clean: false,
            attached_gen: 0,
            attach_in_flight: false,
            errors: 0,
            last_error: None,
            retry_at_ns: 0,
            next_conn: 0,
            intent: None,
            intent_lost: false,
            reconcile: None,
        };
        if let Some(i) = self
            .replicas
            .iter()
            .position(|r| r.state == RState::Removed)
        {
            let epochs: Vec<u32> = self.replicas[i].conns.iter().map(|c| c.epoch).collect();
            self.replicas[i] = r;
            for (c, e) in self.replicas[i].conns.iter_mut().zip(epochs) {
                c.epoch = e;
            }
            i
        } else {
            self.replicas.push(r);
            self.replicas.len() - 1
        }
    }

    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// The simulation's volume is smaller than one protocol region; it
    /// uses smaller regions (its replicas too) to exercise partial
    /// reconciles. Only before `start`.
    #[cfg(test)]
    pub(crate) fn set_region_bytes(&mut self, region_bytes: u64) {
        assert!(!self.started && region_bytes > 0);
        self.region_bytes = region_bytes;
        let n = self.size_bytes.div_ceil(region_bytes) as usize;
        assert!(n <= wire::MAX_INTENT_REGIONS as usize);
        self.regions = vec![Region::default(); n];
    }

    /// Buffer for an incoming payload of `len` bytes (read replies land in
    /// it and are handed to the client without a copy).
    pub fn get_buf(&mut self, len: usize) -> IoBuf {
        self.pool.get(len)
    }

    pub fn put_buf(&mut self, buf: IoBuf) {
        self.pool.put(buf);
    }

    /// Start connecting to every replica.
    pub fn start(&mut self, now_ns: u64, out: &mut Vec<Action>) {
        self.now = now_ns;
        self.started = true;
        for r in 0..self.replicas.len() {
            self.connect(r);
        }
        out.append(&mut self.out);
    }

    /// Apply one event; the actions to perform are appended to `out`.
    pub fn apply(&mut self, event: Event, now_ns: u64, out: &mut Vec<Action>) {
        self.now = now_ns;
        match event {
            Event::Client(req) => self.on_client(req),
            Event::ConnUp(c) => self.on_conn_up(c),
            Event::ConnDown { conn, reason } => {
                if let Some(r) = self.live_conn(conn) {
                    self.fail_replica(r, &reason, false);
                }
            }
            Event::Frame {
                conn,
                header,
                payload,
            } => self.on_frame(conn, header, payload),
            Event::Tick => self.on_tick(),
            Event::AddReplica(addr) => self.add_replica(addr),
            Event::RemoveReplica(addr) => self.remove_replica(addr),
            Event::Detach => self.start_detach(),
        }
        self.progress();
        #[cfg(debug_assertions)]
        self.check_invariants();
        out.append(&mut self.out);
    }

    fn log(&mut self, level: LogLevel, msg: String) {
        self.out.push(Action::Log {
            level,
            msg: format!("volume {}: {msg}", self.volume),
        });
    }

    // ---- replicas and connections ------------------------------------

    fn live_conn(&self, c: ConnRef) -> Option<usize> {
        let r = self.replicas.get(c.replica as usize)?;
        let conn = r.conns.get(c.conn as usize)?;
        (conn.epoch == c.epoch && conn.state != CState::Down).then_some(c.replica as usize)
    }

    /// Whether the engine waits for this connection attempt (the shell
    /// drops sockets of attempts it gave up on).
    pub fn conn_connecting(&self, c: ConnRef) -> bool {
        self.live_conn(c).is_some()
            && self.replicas[c.replica as usize].conns[c.conn as usize].state == CState::Connecting
    }

    /// Whether this connection is still in use.
    pub fn conn_live(&self, c: ConnRef) -> bool {
        self.live_conn(c).is_some()
    }

    fn conn_ref(&self, r: usize, c: usize) -> ConnRef {
        ConnRef {
            replica: r as u32,
            conn: c as u32,
            epoch: self.replicas[r].conns[c].epoch,
        }
    }

    fn connect(&mut self, r: usize) {
        let now = self.now;
        let addr = self.replicas[r].addr;
        self.replicas[r].state = RState::Connecting;
        for c in 0..self.replicas[r].conns.len() {
            let conn = &mut self.replicas[r].conns[c];
            conn.epoch = conn.epoch.wrapping_add(1);
            conn.state = CState::Connecting;
            conn.probe = None;
            conn.ping_out = false;
            conn.last_rx_ns = now;
            conn.last_tx_ns = now;
            let cref = self.conn_ref(r, c);
            self.out.push(Action::Connect { conn: cref, addr });
        }
    }

    fn add_replica(&mut self, addr: SocketAddr) {
        if self
            .replicas
            .iter()
            .any(|r| r.addr == addr && r.state != RState::Removed)
        {
            self.log(
                LogLevel::Warn,
                format!("replica {addr} is already part of the volume"),
            );
            return;
        }
        let live = self
            .replicas
            .iter()
            .filter(|r| r.state != RState::Removed)
            .count();
        if live >= MAX_REPLICAS {
            self.log(
                LogLevel::Error,
                format!("cannot add replica {addr}: at most {MAX_REPLICAS} replicas"),
            );
            return;
        }
        let r = self.push_replica(addr);
        self.log(LogLevel::Info, format!("replica {addr} added"));
        if self.started {
            self.connect(r);
        }
    }

    fn remove_replica(&mut self, addr: SocketAddr) {
        match self
            .replicas
            .iter()
            .position(|r| r.addr == addr && r.state != RState::Removed)
        {
            Some(r) => self.fail_replica(r, "removed by the operator", true),
            None => self.log(
                LogLevel::Warn,
                format!("cannot remove replica {addr}: not part of the volume"),
            ),
        }
    }

    fn healthy_mask(&self) -> u32 {
        self.mask_of(|s| s == RState::Healthy)
    }

    fn write_mask(&self) -> u32 {
        self.mask_of(|s| matches!(s, RState::Healthy | RState::Rebuilding))
    }

    fn mask_of(&self, f: impl Fn(RState) -> bool) -> u32 {
        self.replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| f(r.state))
            .fold(0, |m, (i, _)| m | (1 << i))
    }

    fn on_conn_up(&mut self, c: ConnRef) {
        let Some(r) = self.live_conn(c) else { return };
        let ci = c.conn as usize;
        if self.replicas[r].conns[ci].state != CState::Connecting {
            return;
        }
        self.replicas[r].conns[ci].state = CState::Hello;
        self.replicas[r].conns[ci].last_rx_ns = self.now;
        let hello = Hello {
            volume_size: self.size_bytes,
            generation: 0,
            flags: 0,
            session: self.session,
        };
        if !self.send(
            r,
            ci,
            SubKind::Probe,
            Kind::Hello,
            0,
            HELLO_LEN as u32,
            Payload::Hello(wire::encode_hello(&hello)),
        ) {
            self.fail_replica(r, "no slot for the HELLO probe", false);
        }
    }

    /// Queue a request on connection `c` of replica `r`; false when its slot
    /// table is full.
    #[allow(clippy::too_many_arguments)]
    fn send(
        &mut self,
        r: usize,
        c: usize,
        what: SubKind,
        kind: Kind,
        offset: u64,
        length: u32,
        payload: Payload,
    ) -> bool {
        let now = self.now;
        let conn = &mut self.replicas[r].conns[c];
        let Some(id) = conn.slots.insert(Sub {
            what,
            kind,
            offset,
            length,
            sent_ns: now,
        }) else {
            return false;
        };
        conn.last_tx_ns = now;
        let header = Header::request(kind, id.to_wire(), offset, length);
        let mut bytes = [0u8; HEADER_LEN];
        if let Err(e) = wire::encode_header(&header, &mut bytes) {
            // Our own request broke a frame limit: a bug, caught here rather
            // than by the replica.
            conn.slots.take(id.to_wire());
            debug_assert!(false, "cannot encode {header:?}: {e}");
            return false;
        }
        let cref = self.conn_ref(r, c);
        self.out.push(Action::Send {
            conn: cref,
            header: bytes,
            payload,
        });
        true
    }

    /// A connection of `r` (Up) with a free slot, spreading load round-robin.
    fn pick_conn(&mut self, r: usize) -> Option<usize> {
        let rep = &mut self.replicas[r];
        let n = rep.conns.len();
        for k in 0..n {
            let c = (rep.next_conn + k) % n;
            if rep.conns[c].state == CState::Up && !rep.conns[c].slots.is_full() {
                rep.next_conn = (c + 1) % n;
                return Some(c);
            }
        }
        None
    }

    fn send_any(
        &mut self,
        r: usize,
        what: SubKind,
        kind: Kind,
        offset: u64,
        length: u32,
        payload: Payload,
    ) -> bool {
        match self.pick_conn(r) {
            Some(c) => self.send(r, c, what, kind, offset, length, payload),
            None => false,
        }
    }

    /// Fail replica `r`: close its connections, finish everything it had in
    /// flight (reads go to another replica, writes count it as not having
    /// the data), and leave the healthy set. No slot survives this.
    fn fail_replica(&mut self, r: usize, reason: &str, remove: bool) {
        let was = self.replicas[r].state;
        if was == RState::Removed || (was == RState::Failed && !remove) {
            return;
        }
        let addr = self.replicas[r].addr;
        let now = self.now;
        {
            let rep = &mut self.replicas[r];
            rep.state = if remove {
                RState::Removed
            } else {
                RState::Failed
            };
            if !remove {
                rep.errors += 1;
            }
            rep.last_error = Some(reason.to_string());
            rep.retry_at_ns =
                now.saturating_add(self.opts.reconnect_interval_ms.saturating_mul(1_000_000));
            rep.attach_in_flight = false;
            rep.intent = None;
            rep.intent_lost = false;
            rep.reconcile = None;
        }
        // Its bits are no longer known: a replica that comes back is
        // rebuilt in full, and marked again before it is written.
        let bit = !(1u32 << r);
        for g in &mut self.regions {
            g.marked &= bit;
            g.marking &= bit;
            g.clearing &= bit;
        }
        if let Some(Detach::Flushing(m) | Detach::Detaching(m)) = self.detach.as_mut() {
            *m &= bit;
        }
        // The healthy set shrank: acknowledgements wait for a new
        // generation on the replicas left, and that must hold before the
        // failed replica's requests are drained below, or a write that
        // completes by this very failure would be acknowledged while the
        // failed replica, which lacks it, still has the same generation.
        if was == RState::Healthy && self.healthy_mask() != 0 {
            self.start_bump();
        }
        let mut drained = Vec::new();
        for c in 0..self.replicas[r].conns.len() {
            if self.replicas[r].conns[c].state != CState::Down {
                let cref = self.conn_ref(r, c);
                self.out.push(Action::Close { conn: cref });
            }
            let conn = &mut self.replicas[r].conns[c];
            conn.state = CState::Down;
            conn.ping_out = false;
            conn.probe = None;
            conn.slots.drain(|_, sub| drained.push(sub));
        }
        let level = if was == RState::Healthy {
            LogLevel::Error
        } else {
            LogLevel::Warn
        };
        let verb = if remove { "removed" } else { "failed" };
        self.log(
            level,
            format!("replica {addr} {verb} (was {was:?}): {reason}"),
        );
        for sub in drained {
            self.sub_failed(r, sub);
        }
        if let Some(rb) = &self.rebuild {
            if rb.target == r || rb.source == r {
                let target = rb.target;
                self.rebuild = None;
                if target != r {
                    // Writes of the aborted run may still be in flight to the
                    // target; a fresh start after reconnecting is the safe way.
                    self.fail_replica(target, "rebuild source failed", false);
                }
            }
        }
        if was == RState::Healthy {
            let healthy = self.healthy_mask().count_ones();
            if healthy == 0 {
                self.on_no_healthy();
            } else {
                self.log(
                    LogLevel::Warn,
                    format!("degraded: {healthy} healthy replica(s) left"),
                );
            }
        }
    }

    fn on_no_healthy(&mut self) {
        self.log(
            LogLevel::Error,
            "no healthy replica left: I/O fails with EIO until one is back".into(),
        );
        self.bump = None;
        for id in std::mem::take(&mut self.deferred) {
            self.finish_io(id, Err(eio("no healthy replica")));
        }
        let rebuilding: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].state == RState::Rebuilding)
            .collect();
        for i in rebuilding {
            self.fail_replica(i, "no healthy replica left to rebuild from", false);
        }
    }

    /// A request of replica `r` ended without a good reply.
    fn sub_failed(&mut self, r: usize, sub: Sub) {
        match sub.what {
            SubKind::Client(id) => {
                let Some(io) = self.ios.get_mut(id) else {
                    return;
                };
                io.outstanding -= 1;
                if matches!(io.op, IoOp::Read) {
                    // Try again on another healthy replica.
                    self.pending.push_front(id);
                } else if io.outstanding == 0 {
                    self.io_subs_done(id);
                }
                let _ = r;
            }
            SubKind::Attach(_) => {
                if let Some(rep) = self.replicas.get_mut(r) {
                    rep.attach_in_flight = false;
                }
            }
            // `fail_replica` forgets the replica's region masks and detach
            // steps: nothing to undo per request.
            SubKind::Probe
            | SubKind::IntentGet
            | SubKind::Ping
            | SubKind::Rebuild(_)
            | SubKind::Intent
            | SubKind::Detach => {}
        }
    }

    // ---- generations and elections ------------------------------------

    fn start_bump(&mut self) {
        let seen = self
            .replicas
            .iter()
            .map(|r| r.generation.max(r.attached_gen))
            .max()
            .unwrap_or(0);
        let pending = self.bump.as_ref().map_or(0, |b| b.generation);
        let generation = self.generation.max(seen).max(pending) + 1;
        self.bump = Some(Bump { generation });
    }

    fn progress_bump(&mut self) {
        let Some(b) = &self.bump else { return };
        let generation = b.generation;
        let mut done = true;
        for r in 0..self.replicas.len() {
            let rep = &self.replicas[r];
            if rep.state != RState::Healthy || rep.attached_gen >= generation {
                continue;
            }
            done = false;
            if rep.attach_in_flight {
                continue;
            }
            let hello = Hello {
                volume_size: self.size_bytes,
                generation,
                flags: wire::HELLO_FLAG_ATTACH,
                session: self.session,
            };
            let payload = Payload::Hello(wire::encode_hello(&hello));
            if self.send_any(
                r,
                SubKind::Attach(generation),
                Kind::Hello,
                0,
                HELLO_LEN as u32,
                payload,
            ) {
                self.replicas[r].attach_in_flight = true;
            }
        }
        if done {
            self.generation = generation;
            self.bump = None;
            self.log(
                LogLevel::Info,
                format!("generation {generation} persisted on every healthy replica"),
            );
            for id in std::mem::take(&mut self.deferred) {
                self.finish_io(id, Ok(()));
            }
        }
    }

    fn maybe_elect(&mut self) {
        if self.healthy_mask() != 0 {
            self.election_start_ns = None;
            return;
        }
        let live: Vec<usize> = (0..self.replicas.len())
            .filter(|&i| self.replicas[i].state != RState::Removed)
            .collect();
        let candidates: Vec<usize> = live
            .iter()
            .copied()
            .filter(|&i| {
                self.replicas[i].state == RState::Probed
                    && self.replicas[i].generation >= self.generation
            })
            .collect();
        if candidates.is_empty() {
            return;
        }
        let start = *self.election_start_ns.get_or_insert(self.now);
        let all_answered = live
            .iter()
            .all(|&i| self.replicas[i].state == RState::Probed);
        if !all_answered {
            if self.elected_once {
                if self.now < start.saturating_add(ELECTION_WAIT_NS) {
                    return;
                }
            } else {
                if self
                    .election_logged_ns
                    .is_none_or(|t| self.now >= t.saturating_add(ELECTION_LOG_INTERVAL_NS))
                {
                    self.election_logged_ns = Some(self.now);
                    let missing: Vec<String> = live
                        .iter()
                        .filter(|&&i| self.replicas[i].state != RState::Probed)
                        .map(|&i| self.replicas[i].addr.to_string())
                        .collect();
                    self.log(
                        LogLevel::Warn,
                        format!(
                            "volume not started: waiting for replica(s) {} (any of them may hold the newest data); \
                             `lull rpc replica_remove` one that is lost for good to start without it",
                            missing.join(", ")
                        ),
                    );
                }
                return;
            }
        }
        let Some(&source) = candidates.iter().max_by_key(|&&i| {
            let r = &self.replicas[i];
            (r.generation, r.clean, std::cmp::Reverse(i))
        }) else {
            return;
        };
        let (sgen, sclean) = (
            self.replicas[source].generation,
            self.replicas[source].clean,
        );
        // From here on the engine knows acknowledged writes may have reached
        // generation `sgen`: should every healthy replica fail before the
        // bump that follows completes, a later election must not pick a
        // replica below it (sim seed 44314: a half-rebuilt replica of
        // generation 1 was elected while the generation-3 source was away,
        // and reads went back to old data).
        self.generation = self.generation.max(sgen);
        // Equal generations hold the same acknowledged writes. Only if every
        // one of them was detached cleanly are they also equal everywhere
        // else; otherwise a dead engine may have left a write on some of
        // them, inside the union of their write-intent bitmaps.
        let peers: Vec<usize> = live
            .iter()
            .copied()
            .filter(|&i| {
                self.replicas[i].state == RState::Probed && self.replicas[i].generation == sgen
            })
            .collect();
        let all_clean = peers.iter().all(|&i| self.replicas[i].clean);
        let union = (!all_clean).then(|| self.intent_union(&peers));
        let mut healthy = Vec::new();
        let mut reconciling = Vec::new();
        for &i in &live {
            if self.replicas[i].state != RState::Probed {
                continue;
            }
            self.replicas[i].intent = None;
            if i == source || (all_clean && peers.contains(&i)) {
                self.replicas[i].state = RState::Healthy;
                healthy.push(self.replicas[i].addr.to_string());
            } else {
                self.replicas[i].state = RState::Rebuilding;
                if peers.contains(&i) {
                    self.replicas[i].reconcile = union.clone();
                    reconciling.push(self.replicas[i].addr.to_string());
                }
            }
        }
        self.election_start_ns = None;
        self.election_logged_ns = None;
        self.elected_once = true;
        let src = self.replicas[source].addr;
        self.log(
            LogLevel::Info,
            format!(
                "elected replica {src} (generation {sgen}, clean {sclean}) as source; healthy: {}",
                healthy.join(", ")
            ),
        );
        if let Some(u) = &union {
            let (n, bytes) = (count_bits(u), self.bitmap_bytes(u));
            let msg = if reconciling.is_empty() {
                format!("unclean stop: {n} region(s) ({bytes} bytes) may have had writes in flight; no other replica of generation {sgen} to reconcile")
            } else {
                format!(
                    "unclean stop: reconciling {} from {src} over {n} write-intent region(s) ({bytes} bytes) before they serve reads",
                    reconciling.join(", ")
                )
            };
            self.log(LogLevel::Warn, msg);
        }
        self.start_bump();
    }

    /// The union of the write-intent bitmaps of `peers` (a missing or lost
    /// record counts as every region), and the region masks set from it:
    /// each region's bit is durable on the peers that reported it.
    fn intent_union(&mut self, peers: &[usize]) -> Vec<u8> {
        let n = self.regions.len();
        let mut union = vec![0u8; n.div_ceil(8)];
        let now = self.now;
        for &i in peers {
            let bit = 1u32 << i;
            let addr = self.replicas[i].addr;
            let lost = self.replicas[i].intent_lost
                || self.replicas[i]
                    .intent
                    .as_ref()
                    .is_none_or(|b| b.len() != union.len());
            if lost {
                self.log(
                    LogLevel::Warn,
                    format!("replica {addr}: write-intent record lost or unreadable: every region is compared and repaired"),
                );
            }
            for (g, region) in self.regions.iter_mut().enumerate() {
                let set = lost
                    || self.replicas[i]
                        .intent
                        .as_deref()
                        .is_some_and(|b| has_bit(b, g));
                if set {
                    union[g / 8] |= 1 << (g % 8);
                    // A lost record is all ones in the replica's memory
                    // and again after its restart: as good as durable.
                    region.marked |= bit;
                    region.last_write_ns = now;
                }
            }
        }
        union
    }

    /// Bytes of the volume covered by the regions set in `bitmap`.
    fn bitmap_bytes(&self, bitmap: &[u8]) -> u64 {
        (0..self.regions.len())
            .filter(|&g| has_bit(bitmap, g))
            .map(|g| self.region_end(g) - g as u64 * self.region_bytes)
            .sum()
    }

    fn region_end(&self, g: usize) -> u64 {
        ((g as u64 + 1) * self.region_bytes).min(self.size_bytes)
    }

    /// First and last region of `[offset, offset + len)`, `len` > 0.
    fn region_span(&self, offset: u64, len: u64) -> (usize, usize) {
        let last = (offset + len.max(1) - 1) / self.region_bytes;
        (
            (offset / self.region_bytes) as usize,
            (last as usize).min(self.regions.len() - 1),
        )
    }

    /// The first run `[start, end)` of regions in `[from, to)` for which
    /// `pred` holds.
    fn region_run(
        &self,
        from: usize,
        to: usize,
        pred: impl Fn(&Region) -> bool,
    ) -> Option<(usize, usize)> {
        let start = (from..to).find(|&g| pred(&self.regions[g]))?;
        let end = (start..to).find(|&g| !pred(&self.regions[g])).unwrap_or(to);
        Some((start, end))
    }

    /// INTENT_MARK or INTENT_CLEAR of regions `[start, end)` to replica `r`;
    /// false when it has no free slot.
    fn send_intent(&mut self, r: usize, kind: Kind, start: usize, end: usize) -> bool {
        let count = (end - start) as u32;
        self.send_any(r, SubKind::Intent, kind, start as u64, count, Payload::None)
    }

    /// Whether regions `first..=last` have a durable write-intent bit on
    /// every replica of `need` and no CLEAR in flight. If not, sends the
    /// MARKs that are missing (once; their replies call `progress` again).
    fn ensure_marked(&mut self, first: usize, last: usize, need: u32) -> bool {
        if self.regions[first..=last]
            .iter()
            .all(|x| x.clearing == 0 && x.marked & need == need)
        {
            return true;
        }
        for r in 0..self.replicas.len() {
            let bit = 1u32 << r;
            if need & bit == 0 {
                continue;
            }
            // A region being cleared is marked only once the CLEAR is
            // answered: on another connection the MARK could overtake it.
            let missing = |x: &Region| (x.marked | x.marking) & bit == 0 && x.clearing == 0;
            let mut from = first;
            while let Some((start, end)) = self.region_run(from, last + 1, missing) {
                if !self.send_intent(r, Kind::IntentMark, start, end) {
                    // No free slot: tried again on the next event.
                    return false;
                }
                for x in &mut self.regions[start..end] {
                    x.marking |= bit;
                }
                from = end;
            }
        }
        false
    }

    /// Count client request `id` in the regions it writes (at dispatch).
    fn hold_regions(&mut self, id: IoId) {
        let Some(io) = self.ios.get(id) else {
            return;
        };
        let (first, last) = self.region_span(io.offset, u64::from(io.len));
        for x in &mut self.regions[first..=last] {
            x.writes += 1;
        }
        if let Some(io) = self.ios.get_mut(id) {
            io.in_regions = true;
        }
    }

    /// Uncount it once every replica answered it.
    fn release_regions(&mut self, id: IoId) {
        let Some(io) = self.ios.get_mut(id) else {
            return;
        };
        if !std::mem::take(&mut io.in_regions) {
            return;
        }
        let (offset, len) = (io.offset, u64::from(io.len));
        let (first, last) = self.region_span(offset, len);
        let now = self.now;
        for x in &mut self.regions[first..=last] {
            x.writes -= 1;
            x.last_write_ns = now;
        }
    }

    /// Clear the write-intent bits of regions quiet for
    /// `INTENT_CLEAR_IDLE_NS`. Not while any replica is rebuilt or
    /// reconciled (the bits say what a reconcile interrupted by a crash
    /// still has to do) nor while detaching (DETACH clears everything).
    fn clear_quiet_regions(&mut self) {
        if self.detach.is_some()
            || self.rebuild.is_some()
            || self.replicas.iter().any(|r| r.state == RState::Rebuilding)
        {
            return;
        }
        let now = self.now;
        let n = self.regions.len();
        for r in 0..self.replicas.len() {
            if self.replicas[r].state != RState::Healthy {
                continue;
            }
            let bit = 1u32 << r;
            let quiet = |x: &Region| {
                x.marked & bit != 0
                    && x.writes == 0
                    && x.marking == 0
                    && now.saturating_sub(x.last_write_ns) >= INTENT_CLEAR_IDLE_NS
            };
            let mut from = 0;
            for _ in 0..MAX_CLEARS_PER_TICK {
                let Some((start, end)) = self.region_run(from, n, quiet) else {
                    break;
                };
                if !self.send_intent(r, Kind::IntentClear, start, end) {
                    break;
                }
                for x in &mut self.regions[start..end] {
                    x.marked &= !bit;
                    x.clearing |= bit;
                }
                from = end;
            }
        }
    }

    fn on_intent_reply(&mut self, r: usize, sub: Sub, h: Header) {
        if h.status != 0 {
            return self.fail_replica(
                r,
                &format!(
                    "{:?} of regions [{}, +{}) failed with errno {}",
                    h.kind, sub.offset, sub.length, h.status
                ),
                false,
            );
        }
        let bit = 1u32 << r;
        let (first, count) = (sub.offset as usize, sub.length as usize);
        let end = first.saturating_add(count).min(self.regions.len());
        for x in &mut self.regions[first.min(end)..end] {
            if sub.kind == Kind::IntentMark {
                x.marking &= !bit;
                x.marked |= bit;
            } else {
                x.clearing &= !bit;
            }
        }
    }

    /// The INTENT_GET reply that completes a probe.
    fn on_intent_get_reply(&mut self, r: usize, h: Header, payload: Option<IoBuf>) {
        if h.status != 0 {
            if let Some(b) = payload {
                self.pool.put(b);
            }
            return self.fail_replica(
                r,
                &format!("INTENT_GET failed with errno {}", h.status),
                false,
            );
        }
        let Some(buf) = payload else {
            return self.protocol_error(r, None, "INTENT_GET reply without payload".into());
        };
        let parsed =
            wire::decode_intent(buf.as_slice()).map(|(flags, bits)| (flags, bits.to_vec()));
        self.pool.put(buf);
        let (flags, bits) = match parsed {
            Ok(p) => p,
            Err(e) => return self.protocol_error(r, None, format!("bad INTENT_GET reply: {e}")),
        };
        if bits.len() != self.regions.len().div_ceil(8) || h.offset != self.regions.len() as u64 {
            let why = format!(
                "INTENT_GET reply for {} regions, the volume has {}",
                h.offset,
                self.regions.len()
            );
            return self.protocol_error(r, None, why);
        }
        let rep = &mut self.replicas[r];
        rep.intent_lost |= flags & wire::INTENT_FLAG_LOST != 0;
        rep.intent = Some(bits);
        let (addr, generation, clean, lost) =
            (rep.addr, rep.generation, rep.clean, rep.intent_lost);
        let marked = self.replicas[r].intent.as_deref().map_or(0, count_bits);
        if self.healthy_mask() != 0 {
            self.replicas[r].state = RState::Rebuilding;
            self.replicas[r].reconcile = None;
            self.log(
                LogLevel::Info,
                format!("replica {addr} connected (generation {generation}); it will be rebuilt"),
            );
        } else {
            self.replicas[r].state = RState::Probed;
            let record = if lost {
                "lost".to_string()
            } else {
                format!("{marked} region(s) marked")
            };
            self.log(LogLevel::Info, format!("replica {addr} connected (generation {generation}, clean {clean}, write intent: {record})"));
        }
    }

    // ---- client requests -----------------------------------------------

    fn on_client(&mut self, req: ClientReq) {
        let (channel, mut req) = (req.channel, req.io);
        if self.detach.is_some() {
            let buf = req.buf.take();
            let e = BdevError::Failed("the volume is detaching (engine shutting down)".into());
            self.out.push(Action::Complete {
                channel,
                tag: req.tag,
                result: Err(e),
                buf,
            });
            return;
        }
        if let Err(e) = lull_bdev::validate_request(&req, self.size_bytes) {
            let buf = req.buf.take();
            self.out.push(Action::Complete {
                channel,
                tag: req.tag,
                result: Err(e),
                buf,
            });
            return;
        }
        if matches!(req.op, IoOp::Read | IoOp::Write { .. }) && req.len > wire::MAX_IO_BYTES {
            let buf = req.buf.take();
            let e =
                BdevError::BadRequest("request larger than the replica protocol's MAX_IO_BYTES");
            self.out.push(Action::Complete {
                channel,
                tag: req.tag,
                result: Err(e),
                buf,
            });
            return;
        }
        if req.len == 0 && !matches!(req.op, IoOp::Flush) {
            let buf = req.buf.take();
            self.out.push(Action::Complete {
                channel,
                tag: req.tag,
                result: Ok(()),
                buf,
            });
            return;
        }
        if self.ios.is_full() {
            let buf = req.buf.take();
            let e = BdevError::Full {
                capacity: MAX_CLIENT_IOS,
            };
            self.out.push(Action::Complete {
                channel,
                tag: req.tag,
                result: Err(e),
                buf,
            });
            return;
        }
        let data = match req.op {
            IoOp::Read => IoData::Read(req.buf.take()),
            IoOp::Write { .. } => match req.buf.take() {
                Some(b) => IoData::Write(Arc::new(b)),
                None => IoData::None,
            },
            _ => IoData::None,
        };
        let flush_after = matches!(req.op, IoOp::WriteZeroes { fua: true, .. });
        let Some(id) = self.ios.insert(ClientIo {
            channel,
            tag: req.tag,
            op: req.op,
            offset: req.offset,
            len: req.len,
            data,
            outstanding: 0,
            acked: 0,
            flush_after,
            in_regions: false,
        }) else {
            debug_assert!(false, "checked for room above");
            return;
        };
        self.pending.push_back(id.to_wire());
    }

    /// Complete client request `id` and free its entry.
    fn finish_io(&mut self, id: IoId, result: Result<(), BdevError>) {
        self.release_regions(id);
        let Some(io) = self.ios.take(id) else {
            return;
        };
        if let Some(p) = self.writes_in_flight.iter().position(|&w| w == id) {
            self.writes_in_flight.swap_remove(p);
        }
        let buf = match io.data {
            IoData::None => None,
            IoData::Read(b) => b,
            IoData::Write(arc) => match Arc::try_unwrap(arc) {
                Ok(b) => Some(b),
                Err(arc) => {
                    // A send queue still holds the buffer (cannot happen: a
                    // replica answers only after the whole frame, and a
                    // failed connection's queue is closed first). Copy so
                    // the client still gets a buffer back.
                    let mut b = self.pool.get(arc.len());
                    b.as_mut_slice().copy_from_slice(arc.as_slice());
                    Some(b)
                }
            },
        };
        self.out.push(Action::Complete {
            channel: io.channel,
            tag: io.tag,
            result,
            buf,
        });
    }

    /// Every replica answered (or failed) a write-like request or FLUSH.
    fn io_subs_done(&mut self, id: IoId) {
        // Every replica it went to has answered: nothing of it is in
        // flight in its regions any more.
        self.release_regions(id);
        let healthy = self.healthy_mask();
        let Some(io) = self.ios.get_mut(id) else {
            return;
        };
        if io.acked & healthy == 0 {
            self.finish_io(id, Err(eio("no healthy replica acknowledged the request")));
            return;
        }
        if io.flush_after {
            io.flush_after = false;
            io.op = IoOp::Flush;
            io.acked = 0;
            if let Some(p) = self.writes_in_flight.iter().position(|&w| w == id) {
                self.writes_in_flight.swap_remove(p);
            }
            self.pending.push_front(id);
            return;
        }
        if self.bump.is_some() {
            if let Some(p) = self.writes_in_flight.iter().position(|&w| w == id) {
                self.writes_in_flight.swap_remove(p);
            }
            self.deferred.push(id);
        } else {
            self.finish_io(id, Ok(()));
        }
    }

    /// Try to send pending request `id`: done (sent or finished), or it
    /// must wait (slots full, overlap with a write in flight or the rebuild
    /// lock), or it waits only for its regions' MARKs.
    fn dispatch(&mut self, id: IoId) -> Dispatch {
        let healthy = self.healthy_mask();
        if healthy == 0 {
            self.finish_io(id, Err(eio("no healthy replica")));
            return Dispatch::Done;
        }
        let Some(io) = self.ios.get(id) else {
            return Dispatch::Done;
        };
        let (op, offset, len) = (io.op, io.offset, io.len);
        if matches!(op, IoOp::Read) {
            let n = self.replicas.len();
            for k in 0..n {
                let r = (self.read_rr + k) % n;
                if healthy & (1 << r) == 0 {
                    continue;
                }
                if self.send_any(
                    r,
                    SubKind::Client(id),
                    Kind::Read,
                    offset,
                    len,
                    Payload::None,
                ) {
                    self.read_rr = (r + 1) % n;
                    if let Some(io) = self.ios.get_mut(id) {
                        io.outstanding = 1;
                    }
                    return Dispatch::Done;
                }
            }
            return Dispatch::Wait;
        }
        let io_range = (offset, offset + u64::from(len));
        let modifies = !matches!(op, IoOp::Flush);
        if modifies {
            if self
                .rebuild
                .as_ref()
                .and_then(Rebuild::lock)
                .is_some_and(|l| overlaps(l, io_range))
            {
                return Dispatch::Wait;
            }
            for &w in &self.writes_in_flight {
                if let Some(other) = self.ios.get(w) {
                    if overlaps((other.offset, other.end()), io_range) {
                        return Dispatch::Wait;
                    }
                }
            }
        }
        let targets = self.write_mask();
        if modifies {
            let (first, last) = self.region_span(offset, u64::from(len));
            if !self.ensure_marked(first, last, targets) {
                return Dispatch::WaitMarks;
            }
        }
        // All or nothing: every target needs a free slot now.
        let mut conns = [usize::MAX; MAX_REPLICAS];
        for (r, slot) in conns.iter_mut().enumerate().take(self.replicas.len()) {
            if targets & (1 << r) != 0 {
                match self.pick_conn(r) {
                    Some(c) => *slot = c,
                    None => return Dispatch::Wait,
                }
            }
        }
        let (kind, payload_buf) = match (&self.ios.get(id).map(|i| &i.data), op) {
            (Some(IoData::Write(b)), IoOp::Write { fua }) => (
                if fua { Kind::WriteFua } else { Kind::Write },
                Some(b.clone()),
            ),
            (_, IoOp::Trim) => (Kind::Trim, None),
            (_, IoOp::WriteZeroes { .. }) => (Kind::WriteZeroes, None),
            (_, IoOp::Flush) => (Kind::Flush, None),
            _ => {
                self.finish_io(id, Err(BdevError::BadRequest("write without a buffer")));
                return Dispatch::Done;
            }
        };
        let (w_off, w_len) = if kind == Kind::Flush {
            (0, 0)
        } else {
            (offset, len)
        };
        let mut sent = 0;
        for (r, &c) in conns.iter().enumerate().take(self.replicas.len()) {
            if c == usize::MAX {
                continue;
            }
            let payload = match &payload_buf {
                Some(b) => Payload::Data {
                    buf: b.clone(),
                    len: len as usize,
                },
                None => Payload::None,
            };
            if self.send(r, c, SubKind::Client(id), kind, w_off, w_len, payload) {
                sent += 1;
            }
        }
        if let Some(io) = self.ios.get_mut(id) {
            io.outstanding = sent;
            io.acked = 0;
        }
        if modifies {
            self.writes_in_flight.push(id);
            self.hold_regions(id);
        }
        if sent == 0 {
            self.io_subs_done(id);
        }
        Dispatch::Done
    }

    // ---- frames ----------------------------------------------------------

    fn protocol_error(&mut self, r: usize, sub: Option<Sub>, why: String) {
        if let Some(sub) = sub {
            self.sub_failed(r, sub);
        }
        self.fail_replica(r, &format!("protocol error: {why}"), false);
    }

    fn on_frame(&mut self, c: ConnRef, h: Header, payload: Option<IoBuf>) {
        let Some(r) = self.live_conn(c) else {
            if let Some(b) = payload {
                self.pool.put(b);
            }
            return;
        };
        let ci = c.conn as usize;
        self.replicas[r].conns[ci].last_rx_ns = self.now;
        if !h.reply {
            return self.protocol_error(r, None, format!("replica sent a request ({:?})", h.kind));
        }
        let Some(sub) = self.replicas[r].conns[ci].slots.take(h.id) else {
            return self.protocol_error(
                r,
                None,
                format!("reply {:?} for unknown request id {:#x}", h.kind, h.id),
            );
        };
        if sub.kind != h.kind {
            return self.protocol_error(
                r,
                Some(sub),
                format!("reply kind {:?} for a {:?} request", h.kind, sub.kind),
            );
        }
        let echoes = matches!(
            h.kind,
            Kind::Read
                | Kind::Write
                | Kind::WriteFua
                | Kind::Trim
                | Kind::WriteZeroes
                | Kind::IntentMark
                | Kind::IntentClear
        );
        if echoes && (h.offset != sub.offset || h.length != sub.length) {
            return self.protocol_error(
                r,
                Some(sub),
                format!("{:?} reply for the wrong range", h.kind),
            );
        }
        match sub.what {
            SubKind::Probe => self.on_probe_reply(r, ci, h, payload),
            SubKind::Attach(g) => {
                self.replicas[r].attach_in_flight = false;
                if h.status != 0 {
                    return self.protocol_error(
                        r,
                        None,
                        format!("attach refused with errno {}", h.status),
                    );
                }
                let rep = &mut self.replicas[r];
                rep.attached_gen = rep.attached_gen.max(g);
                rep.generation = rep.generation.max(g);
            }
            SubKind::Ping => {
                self.replicas[r].conns[ci].ping_out = false;
                if h.status != 0 {
                    self.fail_replica(r, &format!("PING failed with errno {}", h.status), false);
                }
            }
            SubKind::Client(id) => self.on_client_reply(r, sub, id, h, payload),
            SubKind::Rebuild(run) => self.on_rebuild_reply(r, sub, run, h, payload),
            SubKind::IntentGet => self.on_intent_get_reply(r, h, payload),
            SubKind::Intent => self.on_intent_reply(r, sub, h),
            SubKind::Detach => self.on_detach_reply(r, h),
        }
    }

    fn on_probe_reply(&mut self, r: usize, ci: usize, h: Header, payload: Option<IoBuf>) {
        let hello = match payload.as_ref().map(|b| wire::decode_hello(b.as_slice())) {
            Some(Ok(hello)) => hello,
            Some(Err(e)) => return self.protocol_error(r, None, format!("bad HELLO reply: {e}")),
            None => return self.protocol_error(r, None, "HELLO reply without payload".into()),
        };
        if let Some(b) = payload {
            self.pool.put(b);
        }
        if hello.volume_size != self.size_bytes {
            let why = format!(
                "size mismatch: replica has {} bytes, the volume is {} bytes",
                hello.volume_size, self.size_bytes
            );
            return self.fail_replica(r, &why, false);
        }
        if h.status == libc::ESTALE as u32 && hello.session > self.session {
            // Sessions order engines (the shell draws them from the clock):
            // a replica owned by a newer session refuses older ones, which
            // fences late frames of a dead engine. Before the first
            // election, a newer owner is another engine that ran since
            // (or a clock behind): take a session past it and try again.
            // After it, another engine has taken the replica over.
            let theirs = hello.session;
            if !self.elected_once {
                self.session = theirs.saturating_add(1);
            }
            let why = format!(
                "replica is owned by a newer engine session ({theirs:#x}): another engine may be using it, or this host's clock is behind"
            );
            return self.fail_replica(r, &why, false);
        }
        if h.status != 0 {
            return self.fail_replica(r, &format!("HELLO refused with errno {}", h.status), false);
        }
        let conn = &mut self.replicas[r].conns[ci];
        conn.state = CState::Up;
        conn.probe = Some(hello);
        if self.replicas[r].conns.iter().all(|c| c.state == CState::Up) {
            let generation = self.replicas[r]
                .conns
                .iter()
                .filter_map(|c| c.probe.map(|p| p.generation))
                .max()
                .unwrap_or(0);
            let clean = self.replicas[r].conns.iter().all(|c| {
                c.probe
                    .is_some_and(|p| p.flags & wire::HELLO_FLAG_CLEAN != 0)
            });
            let lost = self.replicas[r].conns.iter().any(|c| {
                c.probe
                    .is_some_and(|p| p.flags & wire::HELLO_FLAG_INTENT_LOST != 0)
            });
            let rep = &mut self.replicas[r];
            rep.generation = generation;
            rep.clean = clean && !lost;
            rep.intent_lost = lost;
            rep.intent = None;
            rep.attached_gen = 0;
            // Every connection has answered this session's HELLO, so no
            // write of an earlier engine can land on it any more: now its
            // write-intent record is final.
            if !self.send(
                r,
                ci,
                SubKind::IntentGet,
                Kind::IntentGet,
                0,
                0,
                Payload::None,
            ) {
                self.fail_replica(r, "no slot for INTENT_GET", false);
            }
        }
    }

    fn on_client_reply(&mut self, r: usize, sub: Sub, id: IoId, h: Header, payload: Option<IoBuf>) {
        if self.ios.get(id).is_none() {
            debug_assert!(false, "reply for a finished client request");
            return;
        }
        if h.status != 0 {
            if let Some(b) = payload {
                self.pool.put(b);
            }
            self.sub_failed(r, sub);
            let why = format!(
                "{:?} [{}, +{}) failed with errno {}",
                h.kind, h.offset, h.length, h.status
            );
            return self.fail_replica(r, &why, false);
        }
        if h.kind == Kind::Read {
            let Some(mut data) = payload else {
                return self.protocol_error(r, Some(sub), "READ reply without data".into());
            };
            if data.len() != sub.length as usize {
                self.pool.put(data);
                return self.protocol_error(r, Some(sub), "READ reply of the wrong length".into());
            }
            data.set_len(sub.length as usize);
            if let Some(io) = self.ios.get_mut(id) {
                io.outstanding = 0;
                // Hand the received buffer to the client; recycle theirs.
                if let IoData::Read(slot) = &mut io.data {
                    if let Some(old) = slot.replace(data) {
                        self.pool.put(old);
                    }
                }
            }
            return self.finish_io(id, Ok(()));
        }
        if let Some(b) = payload {
            self.pool.put(b);
        }
        let Some(io) = self.ios.get_mut(id) else {
            return;
        };
        io.acked |= 1 << r;
        io.outstanding -= 1;
        if io.outstanding == 0 {
            self.io_subs_done(id);
        }
    }

    // ---- rebuild -----------------------------------------------------------

    fn start_rebuild_if_needed(&mut self) {
        if self.rebuild.is_some() {
            return;
        }
        let Some(target) = self
            .replicas
            .iter()
            .position(|r| r.state == RState::Rebuilding)
        else {
            return;
        };
        let healthy = self.healthy_mask();
        let Some(source) = (0..self.replicas.len()).find(|&i| healthy & (1 << i) != 0) else {
            return;
        };
        self.rebuild_runs += 1;
        let regions = self.replicas[target].reconcile.clone();
        let total_bytes = regions
            .as_deref()
            .map_or(self.size_bytes, |b| self.bitmap_bytes(b));
        self.rebuild = Some(Rebuild {
            run: self.rebuild_runs,
            target,
            source,
            regions,
            total_bytes,
            done_bytes: 0,
            cursor: 0,
            segments: VecDeque::new(),
            step: Step::Idle,
            started_ns: self.now,
            copied_bytes: 0,
            last_log_ns: self.now,
            last_log_pct: 0,
        });
        let (t, s) = (self.replicas[target].addr, self.replicas[source].addr);
        let what = if self.replicas[target].reconcile.is_some() {
            "reconcile"
        } else {
            "rebuild"
        };
        self.log(
            LogLevel::Info,
            format!("{what} of replica {t} from {s} started ({total_bytes} bytes)"),
        );
    }

    /// The next range `[start, end)` the run copies from `cursor` on: the
    /// rest of the volume, or for a reconcile the next run of regions to
    /// reconcile. `None` when nothing is left.
    fn next_copy_range(&self, rb: &Rebuild) -> Option<(u64, u64)> {
        if rb.cursor >= self.size_bytes {
            return None;
        }
        let Some(bits) = rb.regions.as_deref() else {
            return Some((rb.cursor, self.size_bytes));
        };
        let n = self.regions.len();
        let mut g = (rb.cursor / self.region_bytes) as usize;
        while g < n && !has_bit(bits, g) {
            g += 1;
        }
        if g == n {
            return None;
        }
        let start = rb.cursor.max(g as u64 * self.region_bytes);
        while g < n && has_bit(bits, g) {
            g += 1;
        }
        Some((start, self.region_end(g - 1)))
    }

    fn progress_rebuild(&mut self) {
        self.start_rebuild_if_needed();
        loop {
            let Some(rb) = self.rebuild.as_mut() else {
                return;
            };
            let (run, source, target) = (rb.run, rb.source, rb.target);
            match &rb.step {
                Step::Idle => {
                    if let Some(_seg) = rb.segments.front() {
                        rb.step = Step::Draining;
                        continue;
                    }
                    let Some((start, end)) = self
                        .rebuild
                        .as_ref()
                        .and_then(|rb| self.next_copy_range(rb))
                    else {
                        return self.finish_rebuild();
                    };
                    let len = REBUILD_SCAN_BYTES.min(end - start) as u32;
                    if self.send_any(
                        source,
                        SubKind::Rebuild(run),
                        Kind::Extents,
                        start,
                        len,
                        Payload::None,
                    ) {
                        if let Some(rb) = self.rebuild.as_mut() {
                            rb.cursor = start;
                            rb.step = Step::Scanning;
                        }
                    }
                    return;
                }
                Step::Draining => {
                    let Some(seg) = rb.segments.front().copied() else {
                        rb.step = Step::Idle;
                        continue;
                    };
                    let range = (seg.offset, seg.end());
                    let busy = self.writes_in_flight.iter().any(|&w| {
                        self.ios
                            .get(w)
                            .is_some_and(|io| overlaps((io.offset, io.end()), range))
                    });
                    if busy {
                        return;
                    }
                    // Every change to a replica happens under its intent
                    // bit, copies too: a reconcile writes the target at
                    // its own generation, and should this engine die as
                    // well, the target's bit must still say the region
                    // may differ. (A full rebuild's target is behind and
                    // rebuilt in full anyway; one rule is simpler to
                    // check, and costs one MARK per region copied.)
                    let (first, last) = self.region_span(seg.offset, seg.len);
                    if !self.ensure_marked(first, last, 1 << target) {
                        return;
                    }
                    // The scan may be stale by now (a write may have landed in a
                    // hole): a hole is re-checked under the lock before the
                    // target's copy of it is trimmed.
                    let (who, kind, next) = match (seg.data, seg.verified) {
                        (true, _) => (source, Kind::Read, Step::Reading),
                        (false, true) => (target, Kind::Trim, Step::Writing),
                        (false, false) => (source, Kind::Extents, Step::Rechecking),
                    };
                    if self.send_any(
                        who,
                        SubKind::Rebuild(run),
                        kind,
                        seg.offset,
                        seg.len as u32,
                        Payload::None,
                    ) {
                        if let Some(rb) = self.rebuild.as_mut() {
                            rb.step = next;
                        }
                    }
                    return;
                }
                Step::ReadDone(buf) => {
                    let Some(seg) = rb.segments.front().copied() else {
                        return;
                    };
                    let payload = Payload::Data {
                        buf: buf.clone(),
                        len: seg.len as usize,
                    };
                    if self.send_any(
                        target,
                        SubKind::Rebuild(run),
                        Kind::Write,
                        seg.offset,
                        seg.len as u32,
                        payload,
                    ) {
                        if let Some(rb) = self.rebuild.as_mut() {
                            rb.step = Step::Writing;
                        }
                    }
                    return;
                }
                Step::Scanning | Step::Rechecking | Step::Reading | Step::Writing => return,
            }
        }
    }

    fn on_rebuild_reply(
        &mut self,
        r: usize,
        sub: Sub,
        run: u64,
        h: Header,
        payload: Option<IoBuf>,
    ) {
        let current = self.rebuild.as_ref().is_some_and(|rb| rb.run == run);
        if !current {
            if let Some(b) = payload {
                self.pool.put(b);
            }
            return;
        }
        if h.status != 0 {
            if let Some(b) = payload {
                self.pool.put(b);
            }
            let why = format!(
                "rebuild {:?} [{}, +{}) failed with errno {}",
                h.kind, h.offset, h.length, h.status
            );
            return self.fail_replica(r, &why, false);
        }
        match h.kind {
            Kind::Extents => {
                let Some(buf) = payload else {
                    // Zero extents: payload_len is 0 and no buffer comes.
                    return self.on_extents(r, sub, h, &[]);
                };
                let parsed = wire::decode_extents(buf.as_slice());
                self.pool.put(buf);
                match parsed {
                    Ok(ext) => self.on_extents(r, sub, h, &ext),
                    Err(e) => self.protocol_error(r, None, format!("bad EXTENTS reply: {e}")),
                }
            }
            Kind::Read => {
                let Some(buf) = payload else {
                    return self.protocol_error(r, None, "READ reply without data".into());
                };
                if let Some(rb) = self.rebuild.as_mut() {
                    rb.step = Step::ReadDone(Arc::new(buf));
                }
            }
            Kind::Write | Kind::Trim => {
                let Some(rb) = self.rebuild.as_mut() else {
                    return;
                };
                if let Some(seg) = rb.segments.pop_front() {
                    rb.cursor = seg.end();
                    rb.done_bytes += seg.len;
                    if seg.data {
                        rb.copied_bytes += seg.len;
                    }
                }
                rb.step = Step::Idle;
                let pct = rb.done_bytes.saturating_mul(100) / rb.total_bytes.max(1);
                let due = self.now.saturating_sub(rb.last_log_ns) >= REBUILD_LOG_INTERVAL_NS;
                if pct >= rb.last_log_pct + 10 || due {
                    rb.last_log_pct = pct;
                    rb.last_log_ns = self.now;
                    let msg = self.rebuild_progress_line();
                    self.log(LogLevel::Info, msg);
                }
            }
            _ => self.protocol_error(
                r,
                None,
                format!("unexpected {:?} reply during rebuild", h.kind),
            ),
        }
    }

    fn rebuild_progress_line(&self) -> String {
        let Some(rb) = &self.rebuild else {
            return String::new();
        };
        let secs = (self.now.saturating_sub(rb.started_ns) as f64 / 1e9).max(1e-9);
        let mib_s = rb.copied_bytes as f64 / (1 << 20) as f64 / secs;
        format!(
            "{} of replica {}: {}% ({} of {} bytes scanned, {:.1} MiB copied, {:.1} MiB/s)",
            if rb.regions.is_some() {
                "reconcile"
            } else {
                "rebuild"
            },
            self.replicas[rb.target].addr,
            rb.done_bytes.saturating_mul(100) / rb.total_bytes.max(1),
            rb.done_bytes,
            rb.total_bytes,
            rb.copied_bytes as f64 / (1 << 20) as f64,
            mib_s
        )
    }

    /// Turn an EXTENTS reply into hole and data segments over the scanned
    /// range. Every field is untrusted: ranges must be sorted, inside the
    /// scan, and the scan must move forward.
    fn on_extents(&mut self, r: usize, sub: Sub, h: Header, ext: &[(u64, u64)]) {
        let start = sub.offset;
        let end_req = sub.offset + u64::from(sub.length);
        let scan_end = h.offset;
        if scan_end <= start || scan_end > end_req {
            return self.protocol_error(
                r,
                None,
                format!("EXTENTS scan end {scan_end} outside ({start}, {end_req}]"),
            );
        }
        let mut segs = VecDeque::new();
        let mut pos = start;
        for &(off, len) in ext {
            let Some(e_end) = off.checked_add(len) else {
                return self.protocol_error(r, None, "EXTENTS record overflows".into());
            };
            if len == 0 || off < pos || e_end > scan_end {
                return self.protocol_error(
                    r,
                    None,
                    "EXTENTS records unsorted or outside the scan".into(),
                );
            }
            push_segments(&mut segs, pos, off, false);
            push_segments(&mut segs, off, e_end, true);
            pos = e_end;
        }
        push_segments(&mut segs, pos, scan_end, false);
        let Some(rb) = self.rebuild.as_mut() else {
            return;
        };
        if matches!(rb.step, Step::Rechecking) {
            // Refine the held segment; its first piece stayed locked all
            // along, so what the source said about it still holds.
            let Some(held) = rb.segments.pop_front() else {
                return;
            };
            if let Some(first) = segs.front_mut() {
                first.verified = true;
            }
            push_segments(&mut segs, scan_end, held.end(), false);
            while let Some(s) = segs.pop_back() {
                rb.segments.push_front(s);
            }
            rb.step = Step::Draining;
        } else {
            rb.segments = segs;
            rb.step = Step::Idle;
        }
    }

    fn finish_rebuild(&mut self) {
        let Some(rb) = self.rebuild.take() else {
            return;
        };
        let secs = (self.now.saturating_sub(rb.started_ns) as f64 / 1e9).max(1e-9);
        let addr = self.replicas[rb.target].addr;
        self.replicas[rb.target].state = RState::Healthy;
        self.replicas[rb.target].reconcile = None;
        self.log(
            LogLevel::Info,
            format!(
                "{} complete: replica {addr} is healthy ({:.1} MiB copied in {:.1} s, {:.1} MiB/s)",
                if rb.regions.is_some() {
                    "reconcile"
                } else {
                    "rebuild"
                },
                rb.copied_bytes as f64 / (1 << 20) as f64,
                secs,
                rb.copied_bytes as f64 / (1 << 20) as f64 / secs
            ),
        );
        self.start_bump();
    }

    // ---- time --------------------------------------------------------------

    fn on_tick(&mut self) {
        let now = self.now;
        let timeout = self.opts.replica_timeout_ms.saturating_mul(1_000_000);
        let keepalive = self.opts.keepalive_interval_ms.saturating_mul(1_000_000);
        for r in 0..self.replicas.len() {
            match self.replicas[r].state {
                RState::Removed => continue,
                RState::Failed => {
                    if now >= self.replicas[r].retry_at_ns {
                        self.connect(r);
                    }
                    continue;
                }
                _ => {}
            }
            let mut why = None;
            for (ci, conn) in self.replicas[r].conns.iter().enumerate() {
                if let Some((_, sub)) = conn
                    .slots
                    .iter()
                    .find(|(_, s)| now.saturating_sub(s.sent_ns) > timeout)
                {
                    why = Some(format!(
                        "{:?} request timed out on connection {ci}",
                        sub.kind
                    ));
                    break;
                }
                if conn.state != CState::Down && now.saturating_sub(conn.last_rx_ns) > timeout {
                    why = Some(format!(
                        "silent for more than {} ms on connection {ci}",
                        self.opts.replica_timeout_ms
                    ));
                    break;
                }
            }
            if let Some(why) = why {
                self.fail_replica(r, &why, false);
                continue;
            }
            for ci in 0..self.replicas[r].conns.len() {
                let conn = &self.replicas[r].conns[ci];
                if conn.state == CState::Up
                    && !conn.ping_out
                    && now.saturating_sub(conn.last_tx_ns) >= keepalive
                    && self.send(r, ci, SubKind::Ping, Kind::Ping, 0, 0, Payload::None)
                {
                    self.replicas[r].conns[ci].ping_out = true;
                }
            }
        }
        self.clear_quiet_regions();
        if self
            .rebuild
            .as_ref()
            .is_some_and(|rb| now.saturating_sub(rb.last_log_ns) >= REBUILD_LOG_INTERVAL_NS)
        {
            let msg = self.rebuild_progress_line();
            if let Some(rb) = self.rebuild.as_mut() {
                rb.last_log_ns = now;
            }
            self.log(LogLevel::Info, msg);
        }
    }

    // ---- the loop after every event -----------------------------------------

    fn progress(&mut self) {
        self.maybe_elect();
        self.progress_bump();
        self.progress_rebuild();
        // Requests go in order, except that one waiting only for its
        // regions' MARKs is set aside (parked) and those behind it may pass
        // it, as long as they overlap no parked request and are not a
        // FLUSH: overlapping writes keep their order, and a new volume's
        // first writes do not all queue behind one fdatasync.
        let mut parked: Vec<IoId> = Vec::new();
        let mut parked_ranges: Vec<(u64, u64)> = Vec::new();
        let mut waits_for_marks = false;
        while let Some(&id) = self.pending.front() {
            let Some(io) = self.ios.get(id) else {
                debug_assert!(false, "pending request {id} has no entry");
                self.pending.pop_front();
                continue;
            };
            let range = (io.offset, io.end());
            if !parked.is_empty()
                && (matches!(io.op, IoOp::Flush)
                    || parked_ranges.iter().any(|&p| overlaps(p, range)))
            {
                break;
            }
            match self.dispatch(id) {
                Dispatch::Done => {
                    // dispatch may have pushed the id back (no: only
                    // failures do); pop exactly the entry we looked at.
                    if self.pending.front() == Some(&id) {
                        self.pending.pop_front();
                    }
                    continue;
                }
                Dispatch::Wait => break,
                Dispatch::WaitMarks => waits_for_marks = true,
            }
            if parked.len() >= MARK_LOOKAHEAD {
                break;
            }
            self.pending.pop_front();
            parked.push(id);
            parked_ranges.push(range);
        }
        for id in parked.into_iter().rev() {
            self.pending.push_front(id);
        }
        if waits_for_marks {
            self.mark_ahead();
        }
        // Sending may have freed the rebuild to move (and vice versa).
        self.progress_rebuild();
        self.progress_bump();
        self.progress_detach();
    }

    /// The first pending write waits for MARKs: send those of the writes
    /// queued behind it too, so the replicas persist them in one go.
    fn mark_ahead(&mut self) {
        let targets = self.write_mask();
        let ahead: Vec<(u64, u64)> = self
            .pending
            .iter()
            .skip(1)
            .take(MARK_LOOKAHEAD)
            .filter_map(|&id| self.ios.get(id))
            .filter(|io| io.modifies())
            .map(|io| (io.offset, u64::from(io.len)))
            .collect();
        for (offset, len) in ahead {
            let (first, last) = self.region_span(offset, len);
            self.ensure_marked(first, last, targets);
        }
    }

    // ---- clean detach ------------------------------------------------------------

    fn start_detach(&mut self) {
        if self.detach.is_some() {
            return;
        }
        self.detach = Some(Detach::Draining);
        self.log(
            LogLevel::Info,
            "detaching: new requests are refused, those in flight finish".into(),
        );
        if let Some(rb) = self.rebuild.take() {
            let addr = self.replicas[rb.target].addr;
            self.log(LogLevel::Info, format!("rebuild of replica {addr} stopped by the detach; it starts again at the next attach"));
        }
    }

    /// Drain, then FLUSH every healthy replica, then DETACH them: each
    /// step waits for the replies of the previous one, so a replica is
    /// marked clean only with every write of this engine durable on it.
    fn progress_detach(&mut self) {
        let Some(step) = self.detach else { return };
        match step {
            Detach::Draining => {
                let busy = self.replicas.iter().any(|r| {
                    r.conns.iter().any(|c| {
                        c.slots
                            .iter()
                            .any(|(_, s)| !matches!(s.what, SubKind::Ping))
                    })
                });
                if self.client_ios() != 0 || self.bump.is_some() || busy {
                    return;
                }
                let mask = self.send_to_healthy(Kind::Flush);
                self.detach = Some(Detach::Flushing(mask));
                self.progress_detach();
            }
            Detach::Flushing(0) if self.bump.is_none() => {
                let mask = self.send_to_healthy(Kind::Detach);
                self.detach = Some(Detach::Detaching(mask));
                self.progress_detach();
            }
            Detach::Detaching(0) => {
                self.detach = Some(Detach::Done);
                let clean: Vec<String> = (0..self.replicas.len())
                    .filter(|&i| self.replicas[i].state == RState::Healthy)
                    .map(|i| self.replicas[i].addr.to_string())
                    .collect();
                if clean.is_empty() {
                    self.log(
                        LogLevel::Warn,
                        "detached with no healthy replica: none is marked clean".into(),
                    );
                } else {
                    self.log(
                        LogLevel::Info,
                        format!(
                            "detached cleanly: {} clean at generation {}",
                            clean.join(", "),
                            self.generation
                        ),
                    );
                }
            }
            _ => {}
        }
    }

    /// Send `kind` (FLUSH or DETACH) to every healthy replica; the mask of
    /// those it went to (one without a free slot is failed: nothing else
    /// is in flight at this point, so that cannot happen to a live one).
    fn send_to_healthy(&mut self, kind: Kind) -> u32 {
        let mut mask = 0;
        for r in 0..self.replicas.len() {
            if self.replicas[r].state != RState::Healthy {
                continue;
            }
            if self.send_any(r, SubKind::Detach, kind, 0, 0, Payload::None) {
                mask |= 1 << r;
            } else {
                self.fail_replica(r, &format!("no slot for {kind:?} at detach"), false);
            }
        }
        mask
    }

    fn on_detach_reply(&mut self, r: usize, h: Header) {
        if h.status != 0 {
            return self.fail_replica(
                r,
                &format!("{:?} at detach failed with errno {}", h.kind, h.status),
                false,
            );
        }
        if let Some(Detach::Flushing(m) | Detach::Detaching(m)) = self.detach.as_mut() {
            *m &= !(1u32 << r);
        }
    }

    /// Whether a clean detach ([`Event::Detach`]) has finished.
    pub fn detached(&self) -> bool {
        self.detach == Some(Detach::Done)
    }

    // ---- observation -------------------------------------------------------------

    pub fn status(&self) -> Vec<ReplicaStatus> {
        self.replicas
            .iter()
            .enumerate()
            .filter(|(_, r)| r.state != RState::Removed)
            .map(|(i, r)| ReplicaStatus {
                addr: r.addr,
                state: match r.state {
                    RState::Connecting | RState::Probed => ReplicaState::Connecting,
                    RState::Healthy => ReplicaState::Healthy,
                    RState::Failed | RState::Removed => ReplicaState::Failed,
                    RState::Rebuilding => {
                        let run = self.rebuild.as_ref().filter(|rb| rb.target == i);
                        let done_bytes = run.map_or(0, |rb| rb.done_bytes);
                        match &r.reconcile {
                            Some(bits) => ReplicaState::Reconciling {
                                done_bytes,
                                total_bytes: self.bitmap_bytes(bits),
                            },
                            None => ReplicaState::Rebuilding {
                                done_bytes,
                                total_bytes: self.size_bytes,
                            },
                        }
                    }
                },
                generation: r.generation,
                in_flight: r.conns.iter().map(|c| c.slots.in_flight()).sum(),
                errors: r.errors,
                last_error: r.last_error.clone(),
            })
            .collect()
    }

    pub fn healthy_count(&self) -> usize {
        self.healthy_mask().count_ones() as usize
    }

    /// Client requests held by the engine (queued, in flight or deferred).
    pub fn client_ios(&self) -> usize {
        self.ios.in_flight()
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn rebuilding(&self) -> bool {
        self.rebuild.is_some()
    }

    /// Every client request is in exactly one place, every slot belongs to
    /// a live connection, replica states agree with their connections.
    pub fn check_invariants(&self) {
        self.ios.check_invariants();
        let slot = |id: IoId| SlotId::from_wire(id).index();
        let mut subs_of = vec![0u32; self.ios.allocated()];
        for (ri, r) in self.replicas.iter().enumerate() {
            for c in &r.conns {
                c.slots.check_invariants();
                if c.state == CState::Down {
                    assert_eq!(
                        c.slots.in_flight(),
                        0,
                        "replica {ri}: slots on a closed connection"
                    );
                }
                for (_, s) in c.slots.iter() {
                    if let SubKind::Client(id) = s.what {
                        assert!(self.ios.get(id).is_some(), "slot names a finished request");
                        subs_of[slot(id)] += 1;
                    }
                }
            }
            if matches!(r.state, RState::Healthy | RState::Rebuilding) {
                assert!(
                    r.conns.iter().all(|c| c.state == CState::Up),
                    "replica {ri} {:?} with a connection down",
                    r.state
                );
            }
            if matches!(r.state, RState::Failed | RState::Removed) {
                assert!(r.conns.iter().all(|c| c.state == CState::Down));
            }
        }
        let mut place = vec![0u8; self.ios.allocated()];
        for &id in self.pending.iter().chain(self.deferred.iter()) {
            assert!(
                self.ios.get(id).is_some(),
                "finished request {id} still queued"
            );
            place[slot(id)] += 1;
        }
        for (sid, io) in self.ios.iter() {
            let id = sid.to_wire();
            assert_eq!(
                subs_of[sid.index()],
                io.outstanding,
                "request {id}: outstanding count"
            );
            let queued = place[sid.index()];
            assert!(queued <= 1, "request {id} queued twice");
            assert!(
                queued == 1 || io.outstanding > 0,
                "request {id} is nowhere (leaked)"
            );
            if queued == 1 {
                assert_eq!(io.outstanding, 0, "request {id} both queued and in flight");
            }
            if io.modifies() && io.outstanding > 0 {
                assert!(self.writes_in_flight.contains(&id));
            }
        }
        if let Some(rb) = &self.rebuild {
            assert_eq!(self.replicas[rb.target].state, RState::Rebuilding);
            assert_eq!(self.replicas[rb.source].state, RState::Healthy);
            assert!(rb.cursor <= self.size_bytes);
        }
        if self.healthy_mask() == 0 {
            assert!(
                self.deferred.is_empty(),
                "acks deferred with no healthy replica"
            );
        }
        // Write intent: masks only name live replicas; a bit is marked,
        // being marked or being cleared, one at a time; `writes` counts
        // exactly the dispatched writes over the region.
        let live = self.write_mask();
        let mut writes = vec![0u32; self.regions.len()];
        for (_, io) in self.ios.iter().filter(|(_, io)| io.in_regions) {
            let (first, last) = self.region_span(io.offset, u64::from(io.len));
            for w in &mut writes[first..=last] {
                *w += 1;
            }
        }
        for (g, x) in self.regions.iter().enumerate() {
            assert_eq!(
                (x.marked | x.marking | x.clearing) & !live,
                0,
                "region {g}: bit of a replica outside the write set"
            );
            assert_eq!(
                x.marked & x.marking,
                0,
                "region {g}: marked and being marked"
            );
            assert_eq!(
                x.marked & x.clearing,
                0,
                "region {g}: marked and being cleared"
            );
            assert_eq!(x.writes, writes[g], "region {g}: write count");
        }
        // Every write in flight to a replica lies in regions whose bit is
        // durable on that replica: the property reconcile relies on.
        for (ri, r) in self.replicas.iter().enumerate() {
            for c in &r.conns {
                for (_, s) in c.slots.iter() {
                    let SubKind::Client(id) = s.what else {
                        continue;
                    };
                    let Some(io) = self.ios.get(id).filter(|io| io.modifies()) else {
                        continue;
                    };
                    let (first, last) = self.region_span(io.offset, u64::from(io.len));
                    for (g, x) in self.regions[first..=last].iter().enumerate() {
                        assert!(
                            x.marked & (1 << ri) != 0,
                            "write to replica {ri} in region {} without its intent bit",
                            first + g
                        );
                    }
                }
            }
        }
    }
}

/// Append [from, to) as segments of at most the chunk size for its kind.
fn push_segments(segs: &mut VecDeque<Segment>, from: u64, to: u64, data: bool) {
    let chunk = if data {
        REBUILD_CHUNK_BYTES
    } else {
        REBUILD_TRIM_BYTES
    };
    let mut pos = from;
    while pos < to {
        let len = chunk.min(to - pos);
        segs.push_back(Segment {
            offset: pos,
            len,
            data,
            verified: false,
        });
        pos += len;
    }
}
