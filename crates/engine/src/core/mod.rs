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
//! source gives data and hole segments; up to `REBUILD_WINDOW_SEGMENTS`
//! segments (each at most `REBUILD_CHUNK_BYTES`) are copied at once, and
//! each is *locked* from the moment it enters that window: new client
//! writes overlapping it wait, writes already in flight over it drain, and
//! only then is the segment read from the source (so the read sees every
//! acknowledged write) and written to the target (holes are trimmed on the
//! target); the lock ends when the target acknowledges, in whatever order
//! the segments finish. Writes outside the locks go to both replicas;
//! those to segments not copied yet are later overwritten by the copy with
//! the same data.
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
//!   `proto::intent_region_bytes`): before the first write to a region, the
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
//! Split along its seams as crucible's upstairs is: this file holds
//! `apply` with the loop that runs after every event, and re-exports the
//! public names. A write's buffer is shared by its frames to every replica
//! (`lull_net::shared`).
//!
//! - `types`: every type the files share (the events, the actions, the
//!   milestones, the options and limits, the [`Engine`] and its state).
//! - [`ids`]: the typed replica and connection ids, the per-replica array
//!   and set.
//! - `replicas`: the replicas, their connections, frames and time
//!   (timeouts, keep-alives, reconnects).
//! - `election`: generations and elections.
//! - `intent`: the write-intent regions.
//! - `io`: the client request table, overlap tracking and dispatch.
//! - `rebuild`: rebuild and reconcile.
//! - `changes`: the change records of replicas away, delta rebuilds.
//! - `layers`: a returning replica's missing snapshot layers.
//! - `snapshot`: snapshots on every replica, one control operation.
//! - `grow`: growing the volume online.
//! - `detach`: the clean detach.
//! - `invariants`: [`Engine::check_invariants`].
//!
//! Imports run one way: `ids` imports nothing of the core, `types` only
//! `ids`, each behaviour file `types`, `ids` and at most a helper of
//! another behaviour file that does not import it back; nothing imports
//! this file, and nothing in the core imports from the crate around it.

mod changes;
mod detach;
mod election;
mod grow;
pub mod ids;
mod intent;
mod invariants;
mod io;
mod layers;
mod rebuild;
mod replicas;
mod snapshot;
mod types;

use std::collections::VecDeque;

use lull_bdev::IoBuf;
use lull_net::shared::SharedBufs;
use lull_net::slots::SlotTable;
use lull_proto::replica as proto;

use ids::ReplicaData;
use types::{RState, RebuildLimit, Region};

pub use election::{ELECTION_LOG_INTERVAL_NS, ELECTION_WAIT_NS};
pub use ids::{ConnRef, ReplicaTarget, MAX_REPLICAS};
pub use intent::{INTENT_CLEAR_IDLE_NS, MAX_CLEARS_PER_TICK};
pub use io::MARK_LOOKAHEAD;
pub use lull_net::shared::SharedBuf;
pub use rebuild::{
    REBUILD_LOG_INTERVAL_NS, REBUILD_SCAN_BYTES, REBUILD_TRIM_BYTES, REBUILD_WINDOW_SEGMENTS,
};
pub use replicas::{AUTH_RETRY_INTERVAL_MS_MAX, SNAPSHOT_EXTRA_TIMEOUT_NS};
pub use types::{
    Action, ClientReq, ControlOutcome, CopyDone, CopyKind, CopyProgress, Engine, EngineOptions,
    Event, LayerSyncError, LayersCopied, LogLevel, Milestone, NodeRebuildLimit, Payload, Received,
    ReplicaSnapshots, ReplicaState, ReplicaStatus, Sink, CHANNEL_DEPTH, MAX_CHANNELS,
    MAX_CLIENT_IOS, REBUILD_CHUNK_BYTES,
};

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
            changes_starting: 0,
            diverged: ids::ReplicaSet::EMPTY,
            generation: 0,
            generation_started: 0,
            bump: None,
            rebuild: None,
            rebuild_runs: 0,
            layer_syncs: 0,
            rebuild_limit: RebuildLimit::default(),
            read_rr: 0,
            election_start_ns: None,
            elected_once: false,
            election_logged_ns: None,
            session: session.max(1),
            session_resumed: false,
            fenced_by: None,
            region_bytes: proto::intent_region_bytes(size_bytes),
            rebuild_chunk_bytes: REBUILD_CHUNK_BYTES,
            regions: vec![Region::default(); proto::intent_regions(size_bytes) as usize],
            detach: None,
            snapshot: None,
            grow: None,
            snapshot_lists: Vec::new(),
            snapshot_ops: 0,
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
        assert!(n <= proto::MAX_INTENT_REGIONS as usize);
        self.regions = vec![Region::default(); n];
    }

    /// Copy data in segments of `chunk_bytes`: the simulator's volume is
    /// four real chunks, smaller ones fill the copy window.
    #[cfg(test)]
    pub(crate) fn set_rebuild_chunk_bytes(&mut self, chunk_bytes: u64) {
        assert!(chunk_bytes > 0 && chunk_bytes <= REBUILD_CHUNK_BYTES);
        self.rebuild_chunk_bytes = chunk_bytes;
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
            Event::SetRebuildLimit(bytes_per_sec) => {
                self.rebuild_limit.set(bytes_per_sec, now_ns);
                self.log(
                    LogLevel::Info,
                    format!("rebuild bandwidth limit {bytes_per_sec} bytes/s (0: none)"),
                );
            }
            Event::SetNodeRebuildLimit(node) => self.rebuild_limit.set_node(node),
            Event::Detach => self.start_detach(),
            Event::Snapshot { token, op, name } => self.start_snapshot(token, op, name),
            Event::SnapshotList { token } => self.start_snapshot_list(token, None),
            Event::Grow { token, size_bytes } => self.start_grow(token, size_bytes),
            Event::ReconcileSnapshots { token } => {
                let ops = self.snapshot_ops;
                self.start_snapshot_list(token, Some(ops));
            }
            Event::LayersSynced {
                replica,
                token,
                result,
            } => self.on_layers_synced(replica, token, result),
        }
        self.progress();
        self.rebuild_limit.count(self.rebuild.is_some());
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
        self.progress_lookups();
        self.progress_rebuild();
        self.dispatch_pending();
        // Sending may have freed the rebuild to move (and vice versa).
        self.progress_rebuild();
        self.progress_bump();
        self.progress_snapshot();
        self.progress_grow();
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
                RState::Syncing => ReplicaState::Rebuilding {
                    done_bytes: 0,
                    total_bytes: self.size_bytes,
                },
                RState::Healthy => ReplicaState::Healthy,
                RState::Failed => ReplicaState::Failed,
                RState::Rebuilding => {
                    let run = self.rebuild.as_ref().filter(|rb| rb.target == i);
                    let done_bytes = run.map_or(0, |rb| rb.done_bytes);
                    match (&r.reconcile, run) {
                        (Some(bits), _) => ReplicaState::Reconciling {
                            done_bytes,
                            total_bytes: self.bitmap_bytes(bits),
                        },
                        (None, Some(rb)) => ReplicaState::Rebuilding {
                            done_bytes,
                            total_bytes: rb.total_bytes,
                        },
                        (None, None) => ReplicaState::Rebuilding {
                            done_bytes,
                            total_bytes: self.size_bytes,
                        },
                    }
                }
            };
            let rebuild = self.rebuild.as_ref().filter(|rb| rb.target == i).map(|rb| {
                let elapsed_ns = self.now.saturating_sub(rb.started_ns).max(1);
                CopyProgress {
                    kind: rb.kind(),
                    bytes_total: rb.total_bytes,
                    bytes_done: rb.done_bytes,
                    rate_bytes_per_sec: (u128::from(rb.done_bytes) * 1_000_000_000
                        / u128::from(elapsed_ns)) as u64,
                }
            });
            let fresh = ReplicaStatus {
                addr: r.addr.clone(),
                rebuild,
                last_rebuild: r.last_rebuild,
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
