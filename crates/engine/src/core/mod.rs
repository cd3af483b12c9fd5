//! The engine core: a pure state machine. Events in (client requests,
//! replica frames, connections up and down, clock ticks), actions out
//! (frames to send, completions, connects, closes, log lines, milestones:
//! state changes as data). It never
//! reads a clock or touches a socket, so the simulation (`crate::sim`)
//! drives it deterministically and the reactor shell (`crate::shell`) only
//! moves bytes.
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

//! # Layout
//!
//! Split along its seams as crucible's upstairs is: this file holds the
//! events, the actions, the [`Engine`] and `apply` with the loop that runs
//! after every event; [`ids`] the typed replica and connection ids and the
//! per-replica array and set; `replicas` the replicas, their connections,
//! frames and time (timeouts, keep-alives, reconnects); `election`
//! generations and elections; `intent` the write-intent regions; `io` the
//! client request table, overlap tracking and dispatch; `rebuild` rebuild
//! and reconcile; `detach` the clean detach; `invariants`
//! [`Engine::check_invariants`]. A write's buffer is shared by its frames
//! to every replica (`lull_net::shared`).

mod detach;
mod election;
pub mod ids;
mod intent;
mod invariants;
mod io;
mod rebuild;
mod replicas;

pub use ids::ReplicaTarget;
use std::collections::VecDeque;

use lull_bdev::{BdevError, IoBuf, IoRequest};
use lull_net::shared::SharedBufs;
use lull_net::slots::SlotTable;
use lull_proto::replica::{self as wire, Header, HEADER_LEN};

use crate::{EngineOptions, ReplicaState, ReplicaStatus};

use detach::Detach;
use election::Bump;
use ids::ReplicaData;
use intent::Region;
use io::{ClientIo, IoId};
use rebuild::Rebuild;
use replicas::{RState, Replica};

pub use election::{ELECTION_LOG_INTERVAL_NS, ELECTION_WAIT_NS};
pub use ids::ConnRef;
pub use intent::{INTENT_CLEAR_IDLE_NS, MAX_CLEARS_PER_TICK};
pub use io::MARK_LOOKAHEAD;
pub use lull_net::shared::SharedBuf;
pub use rebuild::{
    REBUILD_CHUNK_BYTES, REBUILD_LOG_INTERVAL_NS, REBUILD_SCAN_BYTES, REBUILD_TRIM_BYTES,
};
pub use replicas::AUTH_RETRY_INTERVAL_MS_MAX;

/// Replicas one volume may have (configured plus added). Longhorn runs 3;
/// the bound keeps a [`ids::ReplicaSet`] in one `u32`.
pub const MAX_REPLICAS: usize = 16;

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
    /// A connection was made but the replica could not be authenticated
    /// (or refused this engine's credentials): failed like `ConnDown`, and
    /// retried less and less often, since a wrong key does not fix itself.
    AuthFailed {
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
    AddReplica(ReplicaTarget),
    RemoveReplica(ReplicaTarget),
    /// Detach cleanly: refuse new requests, let those in flight finish,
    /// FLUSH and DETACH every healthy replica (they become clean).
    Detach,
}

/// Bytes that follow a header on the wire.
#[derive(Debug)]
pub enum Payload {
    None,
    /// A HELLO record and the replica's name (none for a `lull replica`
    /// process): made once per connection or attach, never per I/O.
    Hello(Vec<u8>),
    /// The first `len` bytes of a shared write buffer (shared by every
    /// replica the write goes to; returned to the client afterwards).
    Data {
        buf: SharedBuf,
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
    /// A rebuild (`reconcile`: restricted to write-intent regions) finished
    /// and `replica` is healthy.
    CopyComplete {
        replica: ReplicaTarget,
        reconcile: bool,
    },
    /// A clean detach finished; `clean` are the replicas it marked clean.
    Detached { clean: Vec<ReplicaTarget> },
}

/// The engine of one volume.
pub struct Engine {
    volume: String,
    size_bytes: u64,
    opts: EngineOptions,
    replicas: ReplicaData<Replica>,
    ios: SlotTable<ClientIo>,
    pending: VecDeque<IoId>,
    /// Requests that modify data, sent and not finished, with their byte
    /// ranges `[start, end)` beside them: every dispatch of a write checks
    /// them all for overlap, so the check reads this one array and not
    /// each request's entry in `ios`.
    writes_in_flight: Vec<(IoId, u64, u64)>,
    deferred: Vec<IoId>,
    generation: u64,
    /// The highest generation any bump of this process has started (and
    /// so may have sent in an ATTACH). A bump that does not finish (every
    /// healthy replica failed) may still have reached a replica whose
    /// acknowledgement was lost; the next bump must not reuse its number
    /// for another healthy set, or two replicas with different data would
    /// claim the same generation (simulator seed 208012).
    generation_started: u64,
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
    /// The `Arc`s write buffers are shared in, kept between writes: as many
    /// as writes the engine can hold, so a steady load never allocates
    /// (about 40 bytes each, 640 KiB at most).
    shares: SharedBufs,
    now: u64,
    out: Vec<Action>,
    started: bool,
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
        replicas: Vec<ReplicaTarget>,
        opts: EngineOptions,
        session: u64,
    ) -> Engine {
        let mut e = Engine {
            volume: volume.to_string(),
            size_bytes,
            opts,
            replicas: ReplicaData::new(),
            ios: SlotTable::new(MAX_CLIENT_IOS),
            pending: VecDeque::new(),
            writes_in_flight: Vec::new(),
            deferred: Vec::new(),
            generation: 0,
            generation_started: 0,
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
            shares: SharedBufs::new(MAX_CLIENT_IOS),
            now: 0,
            out: Vec::new(),
            started: false,
        };
        for addr in replicas.into_iter().take(MAX_REPLICAS) {
            e.push_replica(addr);
        }
        e
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
    /// it and are handed to the client without a copy). From the calling
    /// reactor thread's cache (`lull_net::bufs`), the one the client's
    /// buffers come from and go back to: a read's reply buffer goes to the
    /// client and the client's buffer comes back here, so a cache of the
    /// engine's own would be drained by every read and refilled by none
    /// (a fresh, zeroed 128 KiB heap buffer per read once the reactor's
    /// fixed arena is all lent out: ~15 page faults per 128 KiB read).
    pub fn get_buf(&mut self, len: usize) -> IoBuf {
        lull_net::bufs::get(len)
    }

    pub fn put_buf(&mut self, buf: IoBuf) {
        lull_net::bufs::put(buf);
    }

    /// Start connecting to every replica.
    pub fn start(&mut self, now_ns: u64, out: &mut Vec<Action>) {
        self.now = now_ns;
        self.started = true;
        for r in self.replicas.ids() {
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
            Event::AuthFailed { conn, reason } => {
                if let Some(r) = self.live_conn(conn) {
                    self.auth_failed(r, &reason);
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

    fn milestone(&mut self, m: Milestone) {
        self.out.push(Action::Milestone(m));
    }

    // ---- the loop after every event -----------------------------------------

    fn progress(&mut self) {
        self.maybe_elect();
        self.progress_bump();
        self.progress_rebuild();
        self.dispatch_pending();
        // Sending may have freed the rebuild to move (and vice versa).
        self.progress_rebuild();
        self.progress_bump();
        self.progress_detach();
    }

    // ---- observation -------------------------------------------------------------

    pub fn status(&self) -> Vec<ReplicaStatus> {
        let mut out = Vec::new();
        self.status_into(&mut out);
        out
    }

    /// [`Engine::status`] into `out`, reusing its entries and their error
    /// strings: the shell publishes the status every tick, and a fresh
    /// vector each time would be ten heap allocations a second per volume.
    pub fn status_into(&self, out: &mut Vec<ReplicaStatus>) {
        let mut n = 0;
        for (i, r) in self.replicas.iter_with_ids() {
            let state = match r.state {
                RState::Removed => continue,
                RState::Connecting | RState::Probed => ReplicaState::Connecting,
                RState::Healthy => ReplicaState::Healthy,
                RState::Failed => ReplicaState::Failed,
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
            };
            let fresh = ReplicaStatus {
                addr: r.addr.clone(),
                state,
                generation: r.generation,
                in_flight: r.conns.iter().map(|c| c.slots.in_flight()).sum(),
                errors: r.errors,
                last_error: None,
            };
            let Some(o) = out.get_mut(n) else {
                out.push(ReplicaStatus {
                    last_error: r.last_error.clone(),
                    ..fresh
                });
                n += 1;
                continue;
            };
            let last_error = std::mem::take(&mut o.last_error);
            *o = fresh;
            o.last_error = match (last_error, &r.last_error) {
                (Some(mut kept), Some(e)) => {
                    kept.clone_from(e);
                    Some(kept)
                }
                (_, e) => e.clone(),
            };
            n += 1;
        }
        out.truncate(n);
    }

    pub fn healthy_count(&self) -> usize {
        self.healthy_set().len()
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
}
