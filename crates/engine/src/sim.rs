//! Deterministic simulation: the engine core and in-memory replicas on one
//! thread, driven from one seed. The network delays and reorders frames,
//! breaks connections (a dropped TCP frame is a broken connection) and
//! crashes replicas for a while; a client issues reads, writes, trims and
//! flushes; a checker compares every read with an oracle of acknowledged
//! writes, and at the end every replica must hold the same bytes.
//!
//! ```text
//! cargo test -p lull-engine sim::   # 200 seeds
//! ```
//!
//! A replica crash keeps its data (a killed process leaves its writes in
//! the page cache, as in the real-process test); it loses its connections
//! and is unreachable for a while.
//!
//! The engine crashes too, at random points: in the middle of a write's
//! fan-out (each frame already sent to a replica independently arrives or
//! not, as a dead process's socket buffers do), during a rebuild and
//! during a reconcile. A new engine with a new session starts against the
//! same replicas, which fence the old one (frames of an older session that
//! arrive after the new session's HELLO are refused). Besides the oracle,
//! a stability checker asserts that two reads of a block with no write to
//! it in flight in between return the same data: reads never alternate.

use crate::core::ids::ReplicaTarget;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;

use lull_bdev::{IoBuf, IoOp, IoRequest};
use lull_proto::replica::{self as proto, Header, Hello, Kind, HEADER_LEN};

use crate::core::ids::{ConnId, ReplicaId};
use crate::core::{
    Action, ClientReq, ConnRef, CopyKind, Engine, Event, Milestone, Payload, Received, Sink,
};
use crate::{EngineOptions, ReplicaState};

/// splitmix64: tiny, deterministic, good enough to pick faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, per_million: u64) -> bool {
        self.below(1_000_000) < per_million
    }
}

/// 4 KiB blocks × 1024: a 4 MiB volume, four rebuild chunks.
const BLOCK: usize = 4096;
const BLOCKS: usize = 1024;
const SIZE: u64 = (BLOCK * BLOCKS) as u64;
const MS: u64 = 1_000_000;
const TICK_NS: u64 = 100 * MS;
/// Client requests in flight at once.
const CLIENT_QD: usize = 8;

fn block_pattern(stamp: u64, block: usize, out: &mut [u8]) {
    if stamp == 0 {
        out.fill(0);
        return;
    }
    out[..8].copy_from_slice(&stamp.to_le_bytes());
    out[8..16].copy_from_slice(&(block as u64).to_le_bytes());
    for (i, b) in out[16..].iter_mut().enumerate() {
        *b = (stamp as u8) ^ (i as u8) ^ (block as u8);
    }
}

fn block_stamp(data: &[u8], block: usize) -> Option<u64> {
    let stamp = u64::from_le_bytes(data[..8].try_into().ok()?);
    let mut expect = vec![0u8; BLOCK];
    block_pattern(stamp, block, &mut expect);
    (expect == data).then_some(stamp)
}

/// A pipe holding `data` (spliced from a scratch file), as the shell's
/// socket leaves a spliced payload.
fn pipe_with(data: &[u8]) -> lull_uring::pipes::SplicePipe {
    use std::io::{Seek, Write};
    use std::os::fd::AsRawFd;
    let mut pipe = lull_uring::pipes::get().expect("a pipe");
    let mut f = tempfile_in_tmp();
    f.write_all(data).expect("write a sim payload");
    f.rewind().expect("rewind");
    let mut moved = 0;
    while moved < data.len() {
        moved += pipe
            .fill_from(f.as_raw_fd(), data.len() - moved)
            .expect("splice a sim payload into a pipe");
    }
    pipe
}

/// A scratch file, removed at once (it lives while open).
fn tempfile_in_tmp() -> std::fs::File {
    let path = std::env::temp_dir().join(format!(
        "lull-sim-pipe-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("a scratch file");
    let _ = std::fs::remove_file(&path);
    f
}

struct SimReplica {
    data: Vec<u8>,
    allocated: Vec<bool>,
    generation: u64,
    clean: bool,
    up: bool,
    up_at: u64,
    /// The session that owns it (the last engine that said HELLO).
    owner: u64,
    /// The write-intent record, one flag per region (durable: the sim's
    /// replicas keep everything across crashes).
    intent: Vec<bool>,
    /// The record was lost: it reports every region, and not clean.
    lost: bool,
    /// Change records: (peer, generation, one flag per change region).
    changes: Vec<(String, u64, Vec<bool>)>,
    /// Snapshots taken (SNAPSHOT create): name and a copy of the data.
    snapshots: Vec<(String, Vec<u8>)>,
    /// Answers a revert EBUSY (as a replica whose merge runs).
    refuse_revert: bool,
}

/// Write-intent region of the simulated volume. The protocol's regions are
/// at least 4 MiB, the whole simulated volume; 256 KiB regions give it 16,
/// so that reconciling some regions and not others is exercised.
const SIM_REGION_BYTES: u64 = 256 << 10;

/// Tokens of the reconciles the sim asks for (`Sim::reconcile_snapshots`),
/// apart from its snapshot operations'.
const RECONCILE_TOKEN_BIT: u64 = 1 << 63;

/// Data segment of a simulated copy: 64 per volume, so that the copy
/// window fills and segments finish out of order.
const SIM_CHUNK_BYTES: u64 = 64 << 10;

fn sim_regions() -> usize {
    SIZE.div_ceil(SIM_REGION_BYTES) as usize
}

impl SimReplica {
    fn extents(&self, offset: u64, len: u64) -> (u64, Vec<(u64, u64)>) {
        let (start, end) = (
            offset as usize / BLOCK,
            ((offset + len) as usize).div_ceil(BLOCK).min(BLOCKS),
        );
        let mut ext: Vec<(u64, u64)> = Vec::new();
        let mut b = start;
        while b < end {
            if self.allocated[b] {
                let s = b;
                while b < end && self.allocated[b] {
                    b += 1;
                }
                if ext.len() == proto::MAX_EXTENTS_PER_REPLY {
                    return ((s * BLOCK) as u64, ext);
                }
                let lo = ((s * BLOCK) as u64).max(offset);
                let hi = ((b * BLOCK) as u64).min(offset + len);
                ext.push((lo, hi - lo));
            } else {
                b += 1;
            }
        }
        (offset + len, ext)
    }

    /// BLOCK_STATUS: per block, a hole (and zero) when never allocated
    /// and reading as zeros, else data; merged, at most
    /// `MAX_BLOCK_STATUS_PER_REPLY`.
    fn block_status(&self, offset: u64, len: u64) -> Vec<u8> {
        let end = offset + len;
        let mut ext: Vec<proto::StatusExtent> = Vec::new();
        let mut pos = offset;
        while pos < end {
            let b = pos as usize / BLOCK;
            let stop = (((b + 1) * BLOCK) as u64).min(end);
            let block = &self.data[b * BLOCK..(b + 1) * BLOCK];
            let hole = !self.allocated[b] && block.iter().all(|&x| x == 0);
            let flags = if hole {
                proto::STATUS_HOLE | proto::STATUS_ZERO
            } else {
                0
            };
            let full = ext.len() == proto::MAX_BLOCK_STATUS_PER_REPLY;
            match ext.last_mut() {
                Some(last) if last.flags == flags => last.length += stop - pos,
                _ if full => break,
                _ => ext.push(proto::StatusExtent {
                    length: stop - pos,
                    flags,
                }),
            }
            pos = stop;
        }
        let mut out = Vec::new();
        let _ = proto::encode_block_status(&ext, &mut out);
        out
    }

    /// Serve one request of engine session `session`; the reply frame
    /// (header, payload), or `None` when the request is fenced (a newer
    /// session owns the replica: the connection is closed, nothing sent).
    fn serve(&mut self, session: u64, h: &Header, payload: &[u8]) -> Option<(Header, Vec<u8>)> {
        let range_ok = h
            .offset
            .checked_add(u64::from(h.length))
            .is_some_and(|e| e <= SIZE);
        let (o, l) = (h.offset as usize, h.length as usize);
        if (h.kind.modifies() || h.kind == Kind::Detach) && session != self.owner {
            return None;
        }
        if h.kind.modifies() {
            self.clean = false;
        }
        if matches!(
            h.kind,
            Kind::Write | Kind::WriteFua | Kind::Trim | Kind::WriteZeroes
        ) && range_ok
            && l > 0
        {
            self.note_change(h.offset, l as u64);
        }
        Some(match h.kind {
            Kind::Hello => {
                let Ok(hello) = proto::decode_hello(payload) else {
                    return Some((h.reply_with(libc::EPROTO as u32), vec![0; 32]));
                };
                if hello.session != 0 && hello.session < self.owner {
                    // An older engine (a late frame of a dead one): refused.
                    let me = Hello {
                        volume_size: SIZE,
                        generation: self.generation,
                        flags: 0,
                        session: self.owner,
                    };
                    return Some((
                        h.reply_with(libc::ESTALE as u32),
                        proto::encode_hello(&me).to_vec(),
                    ));
                }
                if hello.session != 0 {
                    self.owner = hello.session;
                }
                if hello.flags & proto::HELLO_FLAG_ATTACH != 0 {
                    self.generation = self.generation.max(hello.generation);
                    self.clean = false;
                }
                let mut flags = if self.clean && !self.lost {
                    proto::HELLO_FLAG_CLEAN
                } else {
                    0
                };
                if self.lost {
                    flags |= proto::HELLO_FLAG_INTENT_LOST;
                }
                let me = Hello {
                    volume_size: SIZE,
                    generation: self.generation,
                    flags,
                    session: self.owner,
                };
                (h.reply_with(0), proto::encode_hello(&me).to_vec())
            }
            Kind::IntentMark | Kind::IntentClear => {
                let end = h.offset + u64::from(h.length);
                if end > self.intent.len() as u64 {
                    return Some((h.reply_with(libc::EINVAL as u32), Vec::new()));
                }
                for g in h.offset as usize..end as usize {
                    self.intent[g] = h.kind == Kind::IntentMark;
                }
                (h.reply_with(0), Vec::new())
            }
            // Snapshots are copies of the data (`Sim::maybe_snapshot`).
            Kind::Snapshot => match proto::decode_snapshot_request(payload) {
                Ok(req) => {
                    let at = self.snapshots.iter().position(|(n, _)| *n == req.name);
                    let status = match (req.op, at) {
                        (proto::SnapshotOp::Create, Some(_)) => libc::EEXIST,
                        (proto::SnapshotOp::Create, None) => {
                            self.snapshots.push((req.name, self.data.clone()));
                            0
                        }
                        // No simulated replica is a clone: nothing to
                        // copy in, as a replica without a base answers.
                        (proto::SnapshotOp::Flatten, _) => 0,
                        (_, None) => libc::ENOENT,
                        (proto::SnapshotOp::Delete, Some(i)) => {
                            self.snapshots.remove(i);
                            0
                        }
                        (proto::SnapshotOp::Revert, Some(_)) if self.refuse_revert => libc::EBUSY,
                        (proto::SnapshotOp::Revert, Some(i)) => {
                            // As a replica does: every region noted in the
                            // change records and the intent record first.
                            self.note_change(0, SIZE);
                            self.intent.iter_mut().for_each(|g| *g = true);
                            self.data = self.snapshots[i].1.clone();
                            self.snapshots.truncate(i + 1);
                            // What holds data is allocated (the chain's
                            // head is the snapshot's maps again).
                            for b in 0..BLOCKS {
                                if self.data[b * BLOCK..(b + 1) * BLOCK]
                                    .iter()
                                    .any(|&x| x != 0)
                                {
                                    self.allocated[b] = true;
                                }
                            }
                            0
                        }
                    };
                    (h.reply_with(status as u32), Vec::new())
                }
                Err(_) => (h.reply_with(libc::EINVAL as u32), Vec::new()),
            },
            Kind::SnapshotList => {
                let records: Vec<proto::SnapshotRecord> = self
                    .snapshots
                    .iter()
                    .map(|(name, _)| proto::SnapshotRecord {
                        name: name.clone(),
                        created_unix: 0,
                        allocated_bytes: 0,
                        merge_done: 0,
                        merge_total: 0,
                        inherited: false,
                    })
                    .collect();
                let out = proto::encode_snapshot_list(&records).unwrap_or_default();
                let mut r = h.reply_with(0);
                r.length = out.len() as u32;
                (r, out)
            }
            Kind::ChangesStart | Kind::ChangesGet | Kind::ChangesDrop => {
                let Ok(key) = proto::decode_change_key(h.kind, payload) else {
                    return Some((h.reply_with(libc::EPROTO as u32), Vec::new()));
                };
                let crb = proto::change_region_bytes(SIZE);
                let n = proto::change_regions(SIZE) as usize;
                let at = self.changes.iter().position(|c| c.0 == key.peer);
                match h.kind {
                    Kind::ChangesStart => {
                        let bits: Vec<bool> = (0..n)
                            .map(|g| key.seed.get(g / 8).is_some_and(|b| b & (1 << (g % 8)) != 0))
                            .collect();
                        if let Some(i) = at {
                            self.changes.remove(i);
                        }
                        self.changes.push((key.peer, key.generation, bits));
                        (h.reply_with(0), Vec::new())
                    }
                    Kind::ChangesDrop => {
                        if let Some(i) = at {
                            self.changes.remove(i);
                        }
                        (h.reply_with(0), Vec::new())
                    }
                    _ => match at.map(|i| &self.changes[i]) {
                        None => (h.reply_with(libc::ENOENT as u32), Vec::new()),
                        Some((_, g, _)) if *g != key.generation => {
                            let mut r = h.reply_with(libc::ESTALE as u32);
                            r.offset = *g;
                            (r, Vec::new())
                        }
                        Some((_, _, flags)) => {
                            let mut out = vec![0u8; n.div_ceil(8)];
                            for (g, _) in flags.iter().enumerate().filter(|(_, &b)| b) {
                                out[g / 8] |= 1 << (g % 8);
                            }
                            let mut r = h.reply_with(0);
                            r.offset = crb;
                            r.length = out.len() as u32;
                            (r, out)
                        }
                    },
                }
            }
            Kind::IntentGet => {
                let mut bits = vec![0u8; self.intent.len().div_ceil(8)];
                for (g, &set) in self.intent.iter().enumerate() {
                    if set {
                        bits[g / 8] |= 1 << (g % 8);
                    }
                }
                let mut out = Vec::new();
                let flags = if self.lost {
                    proto::INTENT_FLAG_LOST
                } else {
                    0
                };
                proto::encode_intent(flags, &bits, &mut out).expect("sim bitmap fits");
                let mut r = h.reply_with(0);
                r.offset = self.intent.len() as u64;
                r.length = out.len() as u32;
                (r, out)
            }
            Kind::Detach => {
                self.intent.iter_mut().for_each(|b| *b = false);
                self.lost = false;
                self.clean = true;
                (h.reply_with(0), Vec::new())
            }
            // The simulated volume has a fixed size: its replicas refuse
            // to grow, which exercises the grow's hold, drain, send and
            // resume without a size change (`sim_a_refused_grow_...`).
            Kind::Grow => (h.reply_with(libc::EOPNOTSUPP as u32), Vec::new()),
            _ if !range_ok => (h.reply_with(libc::EINVAL as u32), Vec::new()),
            Kind::Read => (h.reply_with(0), self.data[o..o + l].to_vec()),
            Kind::Write | Kind::WriteFua => {
                self.data[o..o + l].copy_from_slice(payload);
                for b in o / BLOCK..(o + l).div_ceil(BLOCK) {
                    self.allocated[b] = true;
                }
                (h.reply_with(0), Vec::new())
            }
            Kind::Trim | Kind::WriteZeroes => {
                self.data[o..o + l].fill(0);
                for b in o / BLOCK..(o + l).div_ceil(BLOCK) {
                    self.allocated[b] = h.kind == Kind::WriteZeroes;
                }
                (h.reply_with(0), Vec::new())
            }
            Kind::Flush | Kind::Ping => (h.reply_with(0), Vec::new()),
            Kind::BlockStatus => {
                let out = self.block_status(h.offset, u64::from(h.length));
                let mut r = h.reply_with(0);
                r.length = out.len() as u32;
                (r, out)
            }
            // The engine never asks it (views of snapshots ask it, over
            // their own connections).
            Kind::Changed | Kind::Clone => (h.reply_with(libc::EOPNOTSUPP as u32), Vec::new()),
            Kind::Extents => {
                let (end, ext) = self.extents(h.offset, u64::from(h.length));
                let mut out = Vec::new();
                let _ = proto::encode_extents(&ext, &mut out);
                let mut r = h.reply_with(0);
                r.offset = end;
                r.length = out.len() as u32;
                (r, out)
            }
        })
    }

    /// A modifying request arrived: every change record notes its regions.
    fn note_change(&mut self, offset: u64, len: u64) {
        let crb = proto::change_region_bytes(SIZE);
        for c in &mut self.changes {
            for g in offset / crb..(offset + len).div_ceil(crb) {
                c.2[g as usize] = true;
            }
        }
    }

    /// Writes land only in regions whose intent bit is set (what the
    /// engine's MARK-before-write guarantees; checked as frames arrive).
    fn check_intent(&self, h: &Header) {
        if matches!(
            h.kind,
            Kind::Write | Kind::WriteFua | Kind::Trim | Kind::WriteZeroes
        ) && h.length > 0
            && !self.lost
        {
            let rb = SIM_REGION_BYTES;
            let (first, last) = (h.offset / rb, (h.offset + u64::from(h.length) - 1) / rb);
            for g in first..=last {
                assert!(
                    self.intent[g as usize],
                    "{:?} [{}, +{}) in region {g} without its intent bit",
                    h.kind, h.offset, h.length
                );
            }
        }
    }
}

enum Dir {
    ToReplica,
    ToEngine,
}

struct Msg {
    conn: ConnRef,
    /// The engine session that sent it or that it answers.
    session: u64,
    dir: Dir,
    header: [u8; HEADER_LEN],
    payload: Vec<u8>,
}

enum Sched {
    Net(Msg),
    ConnResult(ConnRef, bool),
    /// A layer sync job's end (`Action::SyncLayers`), for the engine of
    /// `session` (a later engine ignores an earlier one's).
    Layers {
        session: u64,
        replica: crate::core::ids::ReplicaId,
        token: u64,
        source: usize,
        target: usize,
    },
}

struct Oracle {
    committed: Vec<u64>,
    maybe: Vec<Vec<u64>>,
}

#[derive(Clone)]
struct ClientOp {
    op: IoOp,
    offset: u64,
    len: u32,
    stamp: u64,
    /// Reads: per block, every value the block could hold while the read
    /// was in flight (acknowledged or possible at issue, plus writes issued
    /// meanwhile).
    allowed: Vec<Vec<u64>>,
    /// Reads: each block's write epoch at issue (see `Sim::epoch`).
    epochs: Vec<u64>,
}

pub(crate) struct Sim {
    rng: Rng,
    now: u64,
    engine: Engine,
    addrs: Vec<ReplicaTarget>,
    replicas: Vec<SimReplica>,
    queue: BTreeMap<(u64, u64), Sched>,
    seq: u64,
    oracle: Oracle,
    inflight: BTreeMap<u64, ClientOp>,
    next_tag: u64,
    next_stamp: u64,
    faults: bool,
    /// Per tick, the chance (per million) that the engine crashes while
    /// faults are on; higher while it rebuilds or reconciles.
    engine_crash_ppm: u64,
    reads_checked: u64,
    eio: u64,
    next_tick: u64,
    /// Log lines of the engines and the sim, for a failing seed's report
    /// (checks use `milestones` and `stats`, never this text).
    pub(crate) log: Vec<String>,
    /// Every engine's milestones (state changes as data), in order.
    pub(crate) milestones: Vec<Milestone>,
    /// Session of the engine running now (the sim numbers them 1, 2, ...).
    session: u64,
    /// The next `new_engine` resumes the running engine's session
    /// (`Engine::resume_session`: a daemon restarted) instead of taking
    /// the next one.
    resume_next: bool,
    /// Per block, bumped by every write issued, finished or abandoned
    /// over it: two reads that saw the same epoch had no write in between.
    epoch: Vec<u64>,
    /// Per block, client writes in flight over it (a read issued while one
    /// is may see either side of it, on either replica).
    writing: Vec<u32>,
    /// Per block, (epoch, stamp) of the last read with no write in flight
    /// over it: a later such read in the same epoch must return the same.
    stable: Vec<Option<(u64, u64)>>,
    pub(crate) stats: SimStats,
    /// Client tags in the order they completed.
    completed: Vec<u64>,
    /// Block status answers, in completion order, each checked true
    /// against the oracle.
    block_status: Vec<Vec<lull_bdev::Extent>>,
    /// The client's channel takes pipes, and the sim's sockets splice
    /// what the engine lets them ([`Sink::Pipe`]: a real, empty pipe as
    /// the token, the data in the buffer for the oracle). Off in the
    /// seeded runs.
    pipes: bool,
    /// Client reads whose completion brought their pipe back.
    spliced_reads: u64,
    /// Decides when snapshots are taken, apart from `rng`.
    snap_rng: Rng,
    /// The snapshot operation asked for and not answered: token, op, name.
    snap_pending: Option<(u64, proto::SnapshotOp, String)>,
    /// Outcomes of grows asked for, in order.
    grow_outcomes: Vec<Result<u64, String>>,
    /// Client writes in flight when a revert was asked for, and that
    /// snapshot's bytes per block: the engine drains writes it had sent
    /// before the revert runs, so such a write may have landed before it
    /// and been undone, though acknowledged after it.
    revert_racers: HashMap<u64, std::sync::Arc<Vec<u64>>>,
    /// The client also asks for snapshot operations now and then.
    random_snapshots: bool,
    /// A revert was asked for and may still land on some replica (until
    /// it answers, or its engine is gone): reads are not held to be
    /// stable meanwhile.
    revert_window: bool,
    /// Every replica was healthy at the last tick (`reconcile_snapshots`).
    all_healthy: bool,
    /// Reconciles asked for: their tokens (with `RECONCILE_TOKEN_BIT`).
    reconciles_asked: u64,
    snap_next: u64,
}

/// What a run exercised, counted from the sim's own events and the
/// engine's milestones (not log text).
#[derive(Default, Debug, Clone, Copy)]
pub(crate) struct SimStats {
    /// Replicas that failed (or were removed), from `ReplicaFailed`.
    pub replica_failures: u64,
    /// Times no healthy replica was left, from `NoHealthyReplica`.
    pub no_healthy: u64,
    pub elections: u64,
    pub rebuilds: u64,
    /// Delta rebuilds (copies restricted to a change record).
    pub deltas: u64,
    pub reconciles: u64,
    pub engine_crashes: u64,
    /// Crashes with a write sent to some replicas and not to others.
    pub crashes_mid_fanout: u64,
    pub crashes_in_rebuild: u64,
    pub crashes_in_reconcile: u64,
    pub old_frames_fenced: u64,
    pub old_frames_applied: u64,
    pub records_lost: u64,
    pub clean_detaches: u64,
    pub stable_reads: u64,
    /// Snapshots taken on every healthy replica, and refused (a replica
    /// not healthy, another operation running).
    pub snapshots: u64,
    pub snapshots_refused: u64,
    /// Reverts done, and those where a healthy replica lacked the
    /// snapshot (it is failed and copied in full from the others).
    pub reverts: u64,
    pub reverts_partial: u64,
    pub deletes: u64,
    /// Snapshots a layer sync copied to a replica that lacked them.
    pub layers_copied: u64,
    /// Snapshots on some replicas only, deleted by a reconcile.
    pub partial_deleted: u64,
}

impl Sim {
    pub(crate) fn new(seed: u64, n_replicas: usize) -> Sim {
        let addrs: Vec<ReplicaTarget> = (0..n_replicas)
            .map(|i| ReplicaTarget::from(SocketAddr::from(([10, 0, 0, i as u8 + 1], 7000))))
            .collect();
        let opts = EngineOptions {
            replica_timeout_ms: 2000,
            connections_per_replica: 2,
            reconnect_interval_ms: 1000,
            keepalive_interval_ms: 500,
            // Small, so that full tables (back-pressure) happen often.
            slots_per_connection: 6,
        };
        let mut sim = Sim {
            rng: Rng(seed),
            now: 0,
            engine: Engine::new("sim", SIZE, addrs.clone(), opts, 1),
            addrs,
            replicas: (0..n_replicas)
                .map(|_| SimReplica {
                    data: vec![0; SIZE as usize],
                    allocated: vec![false; BLOCKS],
                    generation: 0,
                    clean: true,
                    up: true,
                    up_at: 0,
                    owner: 0,
                    intent: vec![false; sim_regions()],
                    lost: false,
                    changes: Vec::new(),
                    snapshots: Vec::new(),
                    refuse_revert: false,
                })
                .collect(),
            queue: BTreeMap::new(),
            seq: 0,
            oracle: Oracle {
                committed: vec![0; BLOCKS],
                maybe: vec![Vec::new(); BLOCKS],
            },
            inflight: BTreeMap::new(),
            next_tag: 1,
            next_stamp: 1,
            faults: true,
            engine_crash_ppm: 0,
            reads_checked: 0,
            eio: 0,
            next_tick: 0,
            log: Vec::new(),
            milestones: Vec::new(),
            session: 1,
            resume_next: false,
            epoch: vec![0; BLOCKS],
            writing: vec![0; BLOCKS],
            stable: vec![None; BLOCKS],
            stats: SimStats::default(),
            completed: Vec::new(),
            block_status: Vec::new(),
            pipes: false,
            spliced_reads: 0,
            snap_rng: Rng(seed ^ 0x5eed_5a70),
            grow_outcomes: Vec::new(),
            snap_pending: None,
            revert_racers: HashMap::new(),
            random_snapshots: true,
            revert_window: false,
            all_healthy: false,
            reconciles_asked: 0,
            snap_next: 1,
        };
        sim.engine.set_region_bytes(SIM_REGION_BYTES);
        sim.engine.set_rebuild_chunk_bytes(SIM_CHUNK_BYTES);
        let mut out = Vec::new();
        sim.engine.start(0, &mut out);
        sim.perform(out);
        sim
    }

    fn schedule(&mut self, delay: u64, s: Sched) {
        self.seq += 1;
        self.queue.insert((self.now + delay, self.seq), s);
    }

    fn net_delay(&mut self) -> u64 {
        // Mostly fast, sometimes slow: reorders frames across connections
        // and replies of one connection.
        if self.rng.chance(50_000) {
            self.rng.below(300 * MS)
        } else {
            self.rng.below(2 * MS)
        }
    }

    fn apply(&mut self, ev: Event) {
        let mut out = Vec::new();
        self.engine.apply(ev, self.now, &mut out);
        self.engine.check_invariants();
        self.perform(out);
    }

    fn perform(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Send {
                    conn,
                    header,
                    payload,
                } => {
                    let bytes = match payload {
                        Payload::None => Vec::new(),
                        Payload::Control(h) => h.to_vec(),
                        Payload::Pipe(mut p) => {
                            let mut v = vec![0u8; p.held()];
                            let n = p.read_into(&mut v).expect("read a sim pipe");
                            assert_eq!(n, v.len(), "a sim pipe holds its payload");
                            lull_uring::pipes::put(p);
                            v
                        }
                        Payload::Data { buf, len } => buf.as_slice()[..len].to_vec(),
                    };
                    let d = self.net_delay();
                    let session = self.session;
                    self.schedule(
                        d,
                        Sched::Net(Msg {
                            conn,
                            session,
                            dir: Dir::ToReplica,
                            header,
                            payload: bytes,
                        }),
                    );
                }
                Action::Complete {
                    tag,
                    result,
                    buf,
                    spliced,
                    ..
                } => {
                    if let Some(pipe) = spliced {
                        let op = self.inflight.get(&tag).map(|c| c.op);
                        assert!(self.pipes && op == Some(IoOp::Read) && result.is_ok());
                        self.spliced_reads += 1;
                        lull_uring::pipes::put(pipe);
                    }
                    self.on_complete(tag, result.is_ok(), buf)
                }
                Action::Connect { conn, .. } => {
                    let up = self.replicas[conn.replica.get()].up;
                    let d = self.rng.below(20 * MS);
                    self.schedule(d, Sched::ConnResult(conn, up));
                }
                Action::Close { conn } => self.drop_conn(conn),
                Action::Log { msg, .. } => self.log.push(format!("{:>8} ms {msg}", self.now / MS)),
                Action::Milestone(m) => self.on_milestone(m),
                Action::ControlDone { token, outcome } => self.on_control_done(token, outcome),
                // The sim's job is one step, at its delivery (`sync_layers`);
                // the engine does not connect the replica before its answer.
                Action::StopLayerSync { .. } => {}
                Action::SyncLayers {
                    replica,
                    token,
                    source,
                    target,
                    ..
                } => {
                    let index = |t: &ReplicaTarget| {
                        self.addrs
                            .iter()
                            .position(|a| a == t)
                            .expect("a replica of the sim")
                    };
                    let (source, target) = (index(&source), index(&target));
                    // The job takes a while (a few chunks' round trips).
                    let d = 2 * MS + self.rng.below(20 * MS);
                    let session = self.session;
                    self.schedule(
                        d,
                        Sched::Layers {
                            session,
                            replica,
                            token,
                            source,
                            target,
                        },
                    );
                }
            }
        }
    }

    /// What the layer sync job does (`shell::layers`), on the sim's
    /// replicas at once: the target gets the snapshots the source holds
    /// and it lacks, and its live data is the newest of them. Fails when
    /// the source is down, or when the target holds snapshots and shares
    /// none with the source. A target down at the end crashed during the
    /// job: either before it changed anything, or after some of it (its
    /// live data reverted or trimmed, some snapshots copied): the answer
    /// says which.
    fn sync_layers(
        &mut self,
        source: usize,
        target: usize,
    ) -> Result<crate::core::LayersCopied, crate::core::LayerSyncError> {
        let fail = |why: &str| crate::core::LayerSyncError {
            why: why.into(),
            touched: false,
        };
        if !self.replicas[source].up {
            return Err(fail("sim: the source is down"));
        }
        let target_up = self.replicas[target].up;
        if !target_up && self.rng.chance(500_000) {
            return Err(fail("sim: the target is down"));
        }
        let wanted: Vec<(String, Vec<u8>)> = self.replicas[source].snapshots.clone();
        let ours: Vec<String> = self.replicas[target]
            .snapshots
            .iter()
            .map(|(n, _)| n.clone())
            .collect();
        let k = wanted
            .iter()
            .zip(&ours)
            .take_while(|((a, _), b)| a == *b)
            .count();
        if k == wanted.len() {
            return Ok(crate::core::LayersCopied::default());
        }
        if k == 0 && !ours.is_empty() {
            return Err(fail("sim: no snapshot in common"));
        }
        // A target that crashed got this many of the layers before.
        let layers = if target_up {
            wanted.len() - k
        } else {
            self.rng.below((wanted.len() - k) as u64) as usize
        };
        let t = &mut self.replicas[target];
        t.clean = false;
        t.note_change(0, SIZE);
        t.snapshots.truncate(k);
        match k.checked_sub(1) {
            Some(base) => t.data = wanted[base].1.clone(),
            None => {
                t.data.fill(0);
                t.allocated.fill(false);
            }
        }
        let mut copied = crate::core::LayersCopied::default();
        for (name, data) in &wanted[k..k + layers] {
            t.data = data.clone();
            for b in 0..BLOCKS {
                if t.data[b * BLOCK..(b + 1) * BLOCK].iter().any(|&x| x != 0) {
                    t.allocated[b] = true;
                }
            }
            t.snapshots.push((name.clone(), data.clone()));
            copied.layers += 1;
            copied.bytes += SIZE;
        }
        self.stats.layers_copied += u64::from(copied.layers);
        if !target_up {
            return Err(crate::core::LayerSyncError {
                why: "sim: the target crashed during the job".into(),
                touched: true,
            });
        }
        Ok(copied)
    }

    /// Counts an engine milestone and keeps it for the checks.
    fn on_milestone(&mut self, m: Milestone) {
        let st = &mut self.stats;
        match &m {
            Milestone::ReplicaFailed { .. } => st.replica_failures += 1,
            Milestone::NoHealthyReplica => st.no_healthy += 1,
            Milestone::Elected { .. } => st.elections += 1,
            Milestone::CopyComplete {
                kind: CopyKind::Full,
                ..
            } => st.rebuilds += 1,
            Milestone::CopyComplete {
                kind: CopyKind::Delta,
                ..
            } => st.deltas += 1,
            Milestone::CopyComplete {
                kind: CopyKind::Reconcile,
                ..
            } => st.reconciles += 1,
            Milestone::WaitingForReplicas { .. }
            | Milestone::Detached { .. }
            | Milestone::Fenced { .. } => {}
        }
        self.milestones.push(m);
    }

    /// Whether a milestone from index `from` on matches `f`.
    fn milestone_since(&self, from: usize, f: impl Fn(&Milestone) -> bool) -> bool {
        self.milestones[from..].iter().any(f)
    }

    /// The engine closed `conn`: what is in transit on it is lost.
    fn drop_conn(&mut self, conn: ConnRef) {
        let session = self.session;
        self.queue.retain(|_, s| match s {
            Sched::Net(m) => m.conn != conn || m.session != session,
            Sched::ConnResult(c, _) => *c != conn,
            // A job has its own connections.
            Sched::Layers { .. } => true,
        });
    }

    fn crash(&mut self, r: usize) {
        if !self.replicas[r].up {
            return;
        }
        let down = 200 * MS + self.rng.below(3000 * MS);
        self.replicas[r].up = false;
        self.replicas[r].up_at = self.now + down;
        self.log.push(format!(
            "{:>8} ms SIM crash replica {r} for {} ms",
            self.now / MS,
            down / MS
        ));
        // Frames in transit to and from it are lost.
        self.queue
            .retain(|_, s| !matches!(s, Sched::Net(m) if m.conn.replica.get() == r));
        // Half the time the engine sees the resets at once; otherwise it
        // finds out by the keep-alive timeout.
        for c in 0..2 {
            for e in 0..=self.max_epoch() {
                let conn = ConnRef {
                    replica: ReplicaId::new(r),
                    conn: ConnId::new(c),
                    epoch: e,
                };
                if self.engine.conn_live(conn) && self.rng.chance(500_000) {
                    self.apply(Event::ConnDown {
                        conn,
                        reason: "sim: connection reset".into(),
                    });
                }
            }
        }
    }

    fn max_epoch(&self) -> u32 {
        // Epochs grow by one per reconnect; a run has few.
        64
    }

    fn deliver(&mut self, s: Sched) {
        match s {
            Sched::Layers {
                session,
                replica,
                token,
                source,
                target,
            } => {
                if session != self.session {
                    return;
                }
                let result = self.sync_layers(source, target);
                self.apply(Event::LayersSynced {
                    replica,
                    token,
                    result,
                });
            }
            Sched::ConnResult(conn, ok) => {
                let ok = ok && self.replicas[conn.replica.get()].up;
                if ok {
                    self.apply(Event::ConnUp(conn));
                } else {
                    self.apply(Event::ConnDown {
                        conn,
                        reason: "sim: connection refused".into(),
                    });
                }
            }
            Sched::Net(m) => match m.dir {
                Dir::ToReplica => {
                    let r = m.conn.replica.get();
                    if !self.replicas[r].up {
                        return;
                    }
                    let current = m.session == self.session;
                    if current && self.faults && self.rng.chance(300) {
                        // A lost frame on TCP is a broken connection.
                        self.drop_conn(m.conn);
                        self.apply(Event::ConnDown {
                            conn: m.conn,
                            reason: "sim: frame dropped".into(),
                        });
                        return;
                    }
                    let Ok(h) = proto::decode_header(&m.header) else {
                        panic!("engine sent an undecodable header")
                    };
                    assert_eq!(
                        proto::payload_len(&h),
                        m.payload.len(),
                        "engine frame payload length"
                    );
                    if m.session == self.replicas[r].owner {
                        self.replicas[r].check_intent(&h);
                    }
                    let Some((reply, payload)) = self.replicas[r].serve(m.session, &h, &m.payload)
                    else {
                        self.stats.old_frames_fenced += 1;
                        if current {
                            // Only an older engine is ever fenced.
                            panic!("the running engine's {:?} was fenced", h.kind);
                        }
                        return;
                    };
                    if !current {
                        self.stats.old_frames_applied += u64::from(h.kind.modifies());
                        return; // its engine is gone: the reply goes nowhere
                    }
                    let mut bytes = [0u8; HEADER_LEN];
                    proto::encode_header(&reply, &mut bytes).expect("sim replica reply encodes");
                    let d = self.net_delay();
                    self.schedule(
                        d,
                        Sched::Net(Msg {
                            conn: m.conn,
                            session: m.session,
                            dir: Dir::ToEngine,
                            header: bytes,
                            payload,
                        }),
                    );
                }
                Dir::ToEngine if m.session != self.session => {}
                Dir::ToEngine => {
                    let h = proto::decode_header(&m.header).expect("sim replica header");
                    // As the shell's socket: the header first, then the
                    // payload into the sink the engine gives for it (no
                    // pipes here: a pipe sink takes it in its buffer).
                    let n = proto::payload_len(&h);
                    assert_eq!(n, m.payload.len(), "a sim frame's payload is its header's");
                    let payload = match n {
                        0 => Received::None,
                        _ => match self.engine.payload_sink(m.conn, &h) {
                            Sink::Pipe(mut buf) if self.pipes => {
                                // The data in both: a client read's check
                                // reads the buffer, a copy's WRITE the pipe.
                                buf.as_mut_slice().copy_from_slice(&m.payload);
                                Received::Spliced {
                                    buf,
                                    pipe: pipe_with(&m.payload),
                                }
                            }
                            sink => {
                                let mut b = sink.into_buf();
                                b.as_mut_slice().copy_from_slice(&m.payload);
                                Received::Buf(b)
                            }
                        },
                    };
                    self.apply(Event::Frame {
                        conn: m.conn,
                        header: h,
                        payload,
                    });
                }
            },
        }
    }

    // ---- client and oracle ------------------------------------------------

    fn overlaps_write_in_flight(&self, off: u64, len: u32) -> bool {
        self.inflight.values().any(|c| {
            !matches!(c.op, IoOp::Read | IoOp::Flush)
                && off < c.offset + u64::from(c.len)
                && c.offset < off + u64::from(len)
        })
    }

    fn client_issue(&mut self) {
        if self.inflight.len() >= CLIENT_QD {
            return;
        }
        let blocks = 1 + self.rng.below(16) as usize;
        let first = self.rng.below((BLOCKS - blocks) as u64 + 1) as usize;
        let (offset, len) = ((first * BLOCK) as u64, (blocks * BLOCK) as u32);
        let pick = self.rng.below(100);
        let op = match pick {
            0..=44 => IoOp::Read,
            45..=84 => IoOp::Write {
                fua: pick.is_multiple_of(7),
            },
            85..=89 => IoOp::Trim,
            90..=93 => IoOp::WriteZeroes {
                no_hole: false,
                fua: pick.is_multiple_of(2),
                fast: false,
            },
            _ => IoOp::Flush,
        };
        let modifies = !matches!(op, IoOp::Read | IoOp::Flush);
        if modifies && self.overlaps_write_in_flight(offset, len) {
            return;
        }
        let tag = self.next_tag;
        self.next_tag += 1;
        let stamp = if matches!(op, IoOp::Write { .. }) {
            self.next_stamp += 1;
            self.next_stamp
        } else {
            0
        };
        let buf = match op {
            IoOp::Read => Some(IoBuf::with_capacity(len as usize)).map(|mut b| {
                b.set_len(len as usize);
                b
            }),
            IoOp::Write { .. } => {
                let mut b = IoBuf::with_capacity(len as usize);
                b.set_len(len as usize);
                for i in 0..blocks {
                    block_pattern(
                        stamp,
                        first + i,
                        &mut b.as_mut_slice()[i * BLOCK..(i + 1) * BLOCK],
                    );
                }
                Some(b)
            }
            _ => None,
        };
        let (op_offset, op_len) = if matches!(op, IoOp::Flush) {
            (0, 0)
        } else {
            (offset, len)
        };
        if modifies {
            for b in first..first + blocks {
                self.oracle.maybe[b].push(stamp);
                self.epoch[b] += 1;
                self.writing[b] += 1;
            }
            for r in self
                .inflight
                .values_mut()
                .filter(|o| matches!(o.op, IoOp::Read))
            {
                let rf = r.offset as usize / BLOCK;
                for b in first..first + blocks {
                    if b >= rf && b < rf + r.allowed.len() {
                        r.allowed[b - rf].push(stamp);
                    }
                }
            }
        }
        let allowed = if matches!(op, IoOp::Read) {
            self.allowed_now(first, blocks)
        } else {
            Vec::new()
        };
        // A read's epoch is recorded only for blocks with no write in
        // flight (u64::MAX never matches): only those must be stable.
        let epochs = if matches!(op, IoOp::Read) {
            (first..first + blocks)
                .map(|b| {
                    if self.writing[b] == 0 {
                        self.epoch[b]
                    } else {
                        u64::MAX
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
        self.inflight.insert(
            tag,
            ClientOp {
                op,
                offset: op_offset,
                len: op_len,
                stamp,
                allowed,
                epochs,
            },
        );
        self.apply(Event::Client(ClientReq {
            channel: 0,
            takes_pipe: self.pipes,
            since: None,
            io: IoRequest {
                tag,
                op,
                offset: op_offset,
                len: op_len,
                buf,
            },
        }));
    }

    fn allowed_now(&self, first: usize, blocks: usize) -> Vec<Vec<u64>> {
        (first..first + blocks)
            .map(|b| {
                let mut v = self.oracle.maybe[b].clone();
                v.push(self.oracle.committed[b]);
                v
            })
            .collect()
    }

    fn on_complete(&mut self, tag: u64, ok: bool, buf: Option<IoBuf>) {
        let c = self
            .inflight
            .remove(&tag)
            .expect("completion for a known tag, exactly once");
        self.completed.push(tag);
        let first = (c.offset as usize) / BLOCK;
        let blocks = c.len as usize / BLOCK;
        if !matches!(c.op, IoOp::Read | IoOp::Flush | IoOp::BlockStatus) {
            for b in first..first + blocks {
                self.epoch[b] += 1;
                self.writing[b] -= 1;
            }
        }
        if !ok {
            self.eio += 1;
            self.revert_racers.remove(&tag);
            return; // a failed write stays "maybe" until superseded
        }
        match c.op {
            IoOp::Read => {
                let buf = buf.expect("read returns its buffer");
                assert_eq!(buf.len(), c.len as usize);
                for i in 0..blocks {
                    let b = first + i;
                    let data = &buf.as_slice()[i * BLOCK..(i + 1) * BLOCK];
                    let Some(stamp) = block_stamp(data, b) else {
                        panic!("t={} ms: block {b} read back corrupted", self.now / MS)
                    };
                    let allowed = c.allowed[i].contains(&stamp)
                        || stamp == self.oracle.committed[b]
                        || self.oracle.maybe[b].contains(&stamp);
                    assert!(
                        allowed,
                        "t={} ms: block {b} read stamp {stamp}, acknowledged {} (maybe {:?}, at issue {:?})",
                        self.now / MS,
                        self.oracle.committed[b],
                        self.oracle.maybe[b],
                        c.allowed[i]
                    );
                    // No write over the block since the read was issued,
                    // nor since the last such read: the same data. (Not
                    // while a revert may be landing: it changes data
                    // without a write, on each replica in its own time.)
                    if c.epochs[i] == self.epoch[b] && !self.revert_window {
                        match self.stable[b] {
                            Some((e, seen)) if e == self.epoch[b] => {
                                assert_eq!(
                                    stamp,
                                    seen,
                                    "t={} ms: block {b} read {stamp} after a read of {seen} with no write in between (reads alternate); the replicas hold {:?}\n{}",
                                    self.now / MS,
                                    self.replicas
                                        .iter()
                                        .map(|r| (block_stamp(&r.data[b * BLOCK..(b + 1) * BLOCK], b), r.allocated[b]))
                                        .collect::<Vec<_>>(),
                                    self.log.join("\n")
                                );
                                self.stats.stable_reads += 1;
                            }
                            _ => self.stable[b] = Some((self.epoch[b], stamp)),
                        }
                    }
                }
                self.reads_checked += 1;
            }
            IoOp::Flush => {}
            IoOp::BlockStatus => {
                let buf = buf.expect("block status returns its buffer");
                let ext: Vec<lull_bdev::Extent> =
                    lull_bdev::extent_records(buf.as_slice()).collect();
                assert!(!ext.is_empty(), "block status without extents");
                let mut at = c.offset;
                for e in &ext {
                    assert!(
                        e.length_bytes > 0 && at + e.length_bytes <= c.offset + u64::from(c.len)
                    );
                    if e.zero || e.hole {
                        // Only where every acknowledged or possible write
                        // left zeros (the sim's volume starts zeroed).
                        for b in at as usize / BLOCK..(at + e.length_bytes) as usize / BLOCK {
                            assert!(
                                self.oracle.committed[b] == 0 && self.oracle.maybe[b].is_empty(),
                                "t={} ms: block {b} reported as a hole but written",
                                self.now / MS
                            );
                        }
                    }
                    at += e.length_bytes;
                }
                self.block_status.push(ext);
            }
            _ => {
                let undone = self.revert_racers.remove(&tag);
                for b in first..first + blocks {
                    self.oracle.committed[b] = c.stamp;
                    self.oracle.maybe[b].clear();
                    if let Some(stamps) = &undone {
                        self.oracle.maybe[b].push(stamps[b]);
                    }
                    // Writes still in flight over this block stay possible.
                    let others: Vec<u64> = self
                        .inflight
                        .values()
                        .filter(|o| !matches!(o.op, IoOp::Read | IoOp::Flush))
                        .filter(|o| {
                            (o.offset as usize) / BLOCK <= b
                                && b < (o.offset as usize + o.len as usize) / BLOCK
                        })
                        .map(|o| o.stamp)
                        .collect();
                    self.oracle.maybe[b].extend(others);
                }
            }
        }
    }

    // ---- the run ---------------------------------------------------------------

    fn step_until(&mut self, until: u64, client: bool) {
        while self.now < until {
            let next_ev = self.queue.keys().next().map(|k| k.0).unwrap_or(u64::MAX);
            let next = next_ev.min(self.next_tick).min(until);
            self.now = self.now.max(next);
            if self.now >= self.next_tick {
                self.next_tick = self.now + TICK_NS;
                self.apply(Event::Tick);
                // As the shell does: when every replica becomes healthy,
                // reconcile their snapshot lists.
                let whole = self.engine.all_healthy();
                if whole && !self.all_healthy {
                    self.reconcile_snapshots();
                }
                self.all_healthy = whole;
                for r in 0..self.replicas.len() {
                    if !self.replicas[r].up && self.now >= self.replicas[r].up_at {
                        self.replicas[r].up = true;
                        self.log
                            .push(format!("{:>8} ms SIM replica {r} back", self.now / MS));
                    }
                }
                if self.faults && self.rng.chance(15_000) {
                    let r = self.rng.below(self.replicas.len() as u64) as usize;
                    self.crash(r);
                }
                let ppm = if self.engine.rebuilding() {
                    self.engine_crash_ppm * 8
                } else {
                    self.engine_crash_ppm
                };
                if self.faults && self.rng.chance(ppm) {
                    self.crash_engine();
                }
                if client {
                    for _ in 0..4 {
                        self.client_issue();
                    }
                    if self.random_snapshots {
                        self.maybe_snapshot();
                    }
                }
            }
            while let Some((&k, _)) = self.queue.iter().next() {
                if k.0 > self.now {
                    break;
                }
                let Some(s) = self.queue.remove(&k) else {
                    break;
                };
                self.deliver(s);
                if client && self.rng.chance(300_000) {
                    self.client_issue();
                }
            }
        }
    }

    /// Now and then (while the client writes) asks the engine for a
    /// snapshot; one at a time.
    fn maybe_snapshot(&mut self) {
        if self.snap_pending.is_some() || !self.snap_rng.chance(30_000) {
            return;
        }
        let token = self.snap_next;
        self.snap_next += 1;
        // Mostly creates; a revert or a delete of a snapshot some replica
        // holds one time in eight each.
        let held: Vec<String> = self
            .replicas
            .iter()
            .flat_map(|r| r.snapshots.iter().map(|(n, _)| n.clone()))
            .collect();
        let pick = self.snap_rng.below(8);
        let (op, name) = match (pick, held.is_empty()) {
            (0, false) => (
                proto::SnapshotOp::Revert,
                held[self.snap_rng.below(held.len() as u64) as usize].clone(),
            ),
            (1, false) => (
                proto::SnapshotOp::Delete,
                held[self.snap_rng.below(held.len() as u64) as usize].clone(),
            ),
            _ => (proto::SnapshotOp::Create, format!("s{token}")),
        };
        if op == proto::SnapshotOp::Revert {
            self.revert_may_land(&name);
        }
        self.snap_pending = Some((token, op, name.clone()));
        self.apply(Event::Snapshot { token, op, name });
    }

    /// Asks the engine to reconcile the replicas' snapshot lists (the
    /// shell does when the volume becomes whole).
    fn reconcile_snapshots(&mut self) {
        self.reconciles_asked += 1;
        let token = RECONCILE_TOKEN_BIT | self.reconciles_asked;
        self.apply(Event::ReconcileSnapshots { token });
    }

    /// Runs snapshot operation `op` on `name` while the client goes on,
    /// until its outcome is in.
    fn snapshot_op(&mut self, op: proto::SnapshotOp, name: &str) {
        assert!(self.snap_pending.is_none(), "one operation at a time");
        let token = self.snap_next;
        self.snap_next += 1;
        if op == proto::SnapshotOp::Revert {
            self.revert_may_land(name);
        }
        self.snap_pending = Some((token, op, name.to_string()));
        self.apply(Event::Snapshot {
            token,
            op,
            name: name.to_string(),
        });
        let deadline = self.now + 10_000 * MS;
        while self.snap_pending.is_some() {
            assert!(self.now < deadline, "{op:?} {name} never answered");
            self.step_until(self.now + 10 * MS, true);
        }
    }

    /// The bytes snapshot `name` holds, per block, from a replica that has
    /// it (every replica that has it holds the same, checked when it was
    /// taken).
    fn snapshot_stamps(&self, name: &str) -> Option<Vec<u64>> {
        let data = self
            .replicas
            .iter()
            .find_map(|r| r.snapshots.iter().find(|(n, _)| n == name))
            .map(|(_, d)| d)?;
        Some(
            (0..BLOCKS)
                .map(|b| block_stamp(&data[b * BLOCK..(b + 1) * BLOCK], b).unwrap_or(0))
                .collect(),
        )
    }

    /// A revert to `name` is asked for: from now on a read may see the
    /// snapshot's bytes (a replica reverts while reads go on), and no
    /// read sees the same bytes across it for want of a write.
    fn revert_may_land(&mut self, name: &str) {
        let Some(stamps) = self.snapshot_stamps(name) else {
            return;
        };
        for (b, &stamp) in stamps.iter().enumerate() {
            self.oracle.maybe[b].push(stamp);
            self.epoch[b] += 1;
        }
        self.revert_window = true;
        let stamps = std::sync::Arc::new(stamps);
        for (&tag, c) in &self.inflight {
            if !matches!(c.op, IoOp::Read | IoOp::Flush | IoOp::BlockStatus) {
                self.revert_racers.insert(tag, stamps.clone());
            }
        }
        for c in self.inflight.values_mut() {
            if c.op == IoOp::Read {
                let first = c.offset as usize / BLOCK;
                for (i, allowed) in c.allowed.iter_mut().enumerate() {
                    allowed.push(stamps[first + i]);
                }
            }
        }
    }

    /// A revert no longer lands anywhere: reads are stable again from here.
    fn close_revert_window(&mut self) {
        if std::mem::take(&mut self.revert_window) {
            for e in &mut self.epoch {
                *e += 1;
            }
        }
    }

    /// A revert to `name` is done: the volume holds the snapshot's bytes,
    /// and writes still in flight (held while it ran) may land on them.
    fn reverted(&mut self, name: &str) {
        let stamps = self
            .snapshot_stamps(name)
            .expect("a reverted snapshot is held by the replicas that reverted");
        for (b, &stamp) in stamps.iter().enumerate() {
            self.oracle.committed[b] = stamp;
            self.epoch[b] += 1;
            let others: Vec<u64> = self
                .inflight
                .values()
                .filter(|o| !matches!(o.op, IoOp::Read | IoOp::Flush | IoOp::BlockStatus))
                .filter(|o| {
                    (o.offset as usize) / BLOCK <= b
                        && b < (o.offset as usize + o.len as usize) / BLOCK
                })
                .map(|o| o.stamp)
                .collect();
            self.oracle.maybe[b] = others;
        }
    }

    /// A snapshot taken must be the same on every replica that holds it,
    /// and hold every write acknowledged before it (the engine held new
    /// writes and drained those in flight, so nothing was written since
    /// the replicas took it).
    fn on_control_done(&mut self, token: u64, outcome: crate::core::ControlOutcome) {
        if let crate::core::ControlOutcome::Grow(r) = outcome {
            self.grow_outcomes.push(r);
            return;
        }
        if token & RECONCILE_TOKEN_BIT != 0 {
            // A reconcile deleted a partial snapshot: look again.
            if let crate::core::ControlOutcome::Snapshot(Ok(())) = outcome {
                self.stats.partial_deleted += 1;
                self.reconcile_snapshots();
            }
            return;
        }
        let Some((pending, op, name)) = self.snap_pending.take() else {
            return;
        };
        if op == proto::SnapshotOp::Revert {
            self.close_revert_window();
        }
        assert_eq!(token, pending, "an answer for another request");
        match outcome {
            crate::core::ControlOutcome::Snapshot(Ok(())) if op == proto::SnapshotOp::Delete => {
                self.stats.deletes += 1;
            }
            crate::core::ControlOutcome::Snapshot(Ok(())) if op == proto::SnapshotOp::Revert => {
                self.stats.reverts += 1;
                let lacking = self.engine.status().iter().any(|s| {
                    s.last_error
                        .as_deref()
                        .is_some_and(|e| e.contains("did not revert"))
                });
                if lacking {
                    self.stats.reverts_partial += 1;
                }
                self.log
                    .push(format!("{:>8} ms SIM reverted to {name}", self.now / MS));
                self.reverted(&name);
            }
            crate::core::ControlOutcome::Snapshot(Ok(())) => {
                self.stats.snapshots += 1;
                let copies: Vec<&Vec<u8>> = self
                    .replicas
                    .iter()
                    .filter_map(|r| r.snapshots.iter().find(|(n, _)| *n == name))
                    .map(|(_, d)| d)
                    .collect();
                assert!(!copies.is_empty(), "snapshot {name} is on no replica");
                for c in &copies[1..] {
                    assert!(
                        *c == copies[0],
                        "snapshot {name} differs between replicas\n{}",
                        self.log.join("\n")
                    );
                }
                for b in 0..BLOCKS {
                    let s = block_stamp(&copies[0][b * BLOCK..(b + 1) * BLOCK], b);
                    let ok = s == Some(self.oracle.committed[b])
                        || s.is_some_and(|s| self.oracle.maybe[b].contains(&s));
                    assert!(
                        ok,
                        "snapshot {name}, block {b}: {s:?}, acknowledged {}\n{}",
                        self.oracle.committed[b],
                        self.log.join("\n")
                    );
                }
            }
            crate::core::ControlOutcome::Snapshot(Err(why)) => {
                self.stats.snapshots_refused += 1;
                self.log.push(format!(
                    "{:>8} ms SIM snapshot {name} refused: {why}",
                    self.now / MS
                ));
            }
            other => panic!("unexpected control outcome {other:?}"),
        }
    }

    /// Faults for `fault_ms`, then a quiet phase until every replica is
    /// healthy; then the whole volume must read back as the oracle says and
    /// every replica must hold the same bytes.
    pub(crate) fn run(&mut self, fault_ms: u64) {
        self.step_until(fault_ms * MS, true);
        self.faults = false;
        for r in 0..self.replicas.len() {
            self.replicas[r].up = true;
        }
        // Quiet: finish client I/O, let rebuilds complete.
        let deadline = self.now + 120_000 * MS;
        loop {
            self.step_until(self.now + 500 * MS, false);
            let st = self.engine.status();
            let all_healthy = st.iter().all(|s| s.state == ReplicaState::Healthy);
            if all_healthy
                && self.inflight.is_empty()
                && !self.engine.rebuilding()
                && self.engine.client_ios() == 0
            {
                break;
            }
            assert!(
                self.now < deadline,
                "did not converge: {st:?}\n{}",
                self.log.join("\n")
            );
        }
        // Whole-volume read through the engine.
        let tag = self.next_tag;
        self.next_tag += 1;
        let mut buf = IoBuf::with_capacity(SIZE as usize);
        buf.set_len(SIZE as usize);
        let allowed = self.allowed_now(0, BLOCKS);
        let epochs = (0..BLOCKS)
            .map(|b| {
                if self.writing[b] == 0 {
                    self.epoch[b]
                } else {
                    u64::MAX
                }
            })
            .collect();
        self.inflight.insert(
            tag,
            ClientOp {
                op: IoOp::Read,
                offset: 0,
                len: SIZE as u32,
                stamp: 0,
                allowed,
                epochs,
            },
        );
        self.apply(Event::Client(ClientReq {
            channel: 0,
            takes_pipe: false,
            since: None,
            io: IoRequest {
                tag,
                op: IoOp::Read,
                offset: 0,
                len: SIZE as u32,
                buf: Some(buf),
            },
        }));
        self.step_until(self.now + 1000 * MS, false);
        assert!(self.inflight.is_empty(), "final read did not complete");
        for r in 1..self.replicas.len() {
            let differ: Vec<String> = (0..BLOCKS)
                .filter(|&b| {
                    self.replicas[r].data[b * BLOCK..(b + 1) * BLOCK]
                        != self.replicas[0].data[b * BLOCK..(b + 1) * BLOCK]
                })
                .take(8)
                .map(|b| {
                    let stamp = |i: usize| {
                        block_stamp(&self.replicas[i].data[b * BLOCK..(b + 1) * BLOCK], b)
                    };
                    format!(
                        "block {b}: {:?} against {:?} (allocated {} and {})",
                        stamp(r),
                        stamp(0),
                        self.replicas[r].allocated[b],
                        self.replicas[0].allocated[b]
                    )
                })
                .collect();
            assert!(
                differ.is_empty(),
                "replica {r} differs from replica 0: {differ:?}\n{}",
                self.log.join("\n")
            );
        }
        // Every replica holds the same snapshots (a reconcile deleted those
        // a crash left on some only, a layer sync copied the rest) ...
        let names = |r: &SimReplica| {
            r.snapshots
                .iter()
                .map(|(n, _)| n.clone())
                .collect::<Vec<_>>()
        };
        for r in 1..self.replicas.len() {
            assert_eq!(
                names(&self.replicas[r]),
                names(&self.replicas[0]),
                "replicas {r} and 0 hold other snapshots\n{}",
                self.log.join("\n")
            );
        }
        // ... and a snapshot is the same wherever it is, whether taken
        // there or copied there by a layer sync.
        for r in 1..self.replicas.len() {
            for (name, data) in &self.replicas[r].snapshots {
                for other in &self.replicas[..r] {
                    if let Some((_, theirs)) = other.snapshots.iter().find(|(n, _)| n == name) {
                        assert!(
                            data == theirs,
                            "snapshot {name} differs between replicas\n{}",
                            self.log.join("\n")
                        );
                    }
                }
            }
        }
        // Every acknowledged write is there.
        for b in 0..BLOCKS {
            let s = block_stamp(&self.replicas[0].data[b * BLOCK..(b + 1) * BLOCK], b);
            let ok = s == Some(self.oracle.committed[b])
                || s.is_some_and(|s| self.oracle.maybe[b].contains(&s));
            assert!(
                ok,
                "block {b}: replica has {s:?}, acknowledged {}",
                self.oracle.committed[b]
            );
        }
    }

    /// The engine restarts (a new process) against the same replicas: the
    /// election must pick a fresh replica and the volume read back intact.
    #[allow(dead_code)]
    pub(crate) fn restart_engine(&mut self) {
        self.new_engine();
        self.run(0);
    }

    /// A new engine process (a new session) against the same replicas.
    /// What the old one had in flight is gone, except the frames it had
    /// already sent to replicas: each still arrives, or not, as it would
    /// from a dead process's socket buffers.
    fn new_engine(&mut self) {
        let opts = EngineOptions {
            slots_per_connection: 6,
            replica_timeout_ms: 2000,
            keepalive_interval_ms: 500,
            ..Default::default()
        };
        let queue = std::mem::take(&mut self.queue);
        for (k, s) in queue {
            if let Sched::Net(m) = s {
                if matches!(m.dir, Dir::ToReplica) && self.rng.chance(500_000) {
                    self.queue.insert(k, Sched::Net(m));
                }
            }
        }
        // Client requests of the old engine never complete; writes among
        // them may or may not have landed (they stay "maybe").
        for (_, c) in std::mem::take(&mut self.inflight) {
            if !matches!(c.op, IoOp::Read | IoOp::Flush) {
                let first = c.offset as usize / BLOCK;
                for b in first..first + c.len as usize / BLOCK {
                    self.epoch[b] += 1;
                    self.writing[b] -= 1;
                }
            }
        }
        // The old engine's snapshot operation dies with it.
        self.snap_pending = None;
        let resume = std::mem::take(&mut self.resume_next);
        if !resume {
            self.session += 1;
        }
        self.engine = Engine::new("sim", SIZE, self.addrs.clone(), opts, self.session);
        if resume {
            self.engine.resume_session();
        }
        self.all_healthy = false;
        self.close_revert_window();
        self.engine.set_region_bytes(SIM_REGION_BYTES);
        self.engine.set_rebuild_chunk_bytes(SIM_CHUNK_BYTES);
        let mut out = Vec::new();
        self.engine.start(self.now, &mut out);
        self.perform(out);
    }

    /// Kill the engine wherever it is and start a new one. Sometimes a
    /// replica's write-intent record is lost at the same time (it must
    /// then be repaired in full).
    fn crash_engine(&mut self) {
        self.stats.engine_crashes += 1;
        if self.engine.rebuilding() {
            if self
                .engine
                .status()
                .iter()
                .any(|s| matches!(s.state, ReplicaState::Reconciling { .. }))
            {
                self.stats.crashes_in_reconcile += 1;
            } else {
                self.stats.crashes_in_rebuild += 1;
            }
        }
        // Mid fan-out: a write whose frames reached some replicas only.
        let mut to: BTreeMap<u64, u32> = BTreeMap::new();
        for s in self.queue.values() {
            if let Sched::Net(m) = s {
                if matches!(m.dir, Dir::ToReplica) && m.session == self.session {
                    if let Ok(h) = proto::decode_header(&m.header) {
                        if h.kind.is_write() {
                            *to.entry(h.offset).or_default() |= 1 << m.conn.replica.get();
                        }
                    }
                }
            }
        }
        if !to.is_empty() {
            self.stats.crashes_mid_fanout += 1;
        }
        self.log.push(format!(
            "{:>8} ms SIM crash engine (session {})",
            self.now / MS,
            self.session
        ));
        if self.rng.chance(100_000) {
            let r = self.rng.below(self.replicas.len() as u64) as usize;
            self.replicas[r].lost = true;
            self.replicas[r].intent.iter_mut().for_each(|b| *b = true);
            self.stats.records_lost += 1;
            self.log.push(format!(
                "{:>8} ms SIM replica {r} loses its write-intent record",
                self.now / MS
            ));
        }
        self.new_engine();
    }

    /// Detach the engine cleanly (as `lull serve` does on SIGTERM) and
    /// start a new one: the replicas are clean and nothing is reconciled.
    fn detach_and_restart(&mut self) {
        let detach_from = self.milestones.len();
        let mut out = Vec::new();
        self.engine.apply(Event::Detach, self.now, &mut out);
        self.perform(out);
        let deadline = self.now + 30_000 * MS;
        while !self.engine.detached() {
            assert!(
                self.now < deadline,
                "detach did not finish\n{}",
                self.log.join("\n")
            );
            self.step_until(self.now + 100 * MS, false);
        }
        let healthy: Vec<usize> = (0..self.replicas.len())
            .filter(|&r| self.engine.status()[r].state == ReplicaState::Healthy)
            .collect();
        // The engine's report: every replica it says it left clean is, and
        // every replica still healthy is among them.
        let reported = self.milestones[detach_from..].iter().find_map(|m| match m {
            Milestone::Detached { clean } => Some(clean.clone()),
            _ => None,
        });
        let Some(reported) = reported else {
            panic!("the detach finished without a Detached milestone")
        };
        for addr in &reported {
            let r = self
                .addrs
                .iter()
                .position(|a| a == addr)
                .expect("a sim replica");
            assert!(
                self.replicas[r].clean && self.replicas[r].intent.iter().all(|b| !b),
                "the engine reported replica {r} clean, and it is not"
            );
        }
        for &r in &healthy {
            assert!(
                reported.contains(&self.addrs[r]),
                "healthy replica {r} missing from the detach's clean list {reported:?}"
            );
            assert!(
                self.replicas[r].clean && self.replicas[r].intent.iter().all(|b| !b),
                "replica {r} not clean after detach"
            );
        }
        self.stats.clean_detaches += 1;
        self.new_engine();
    }

    /// Takes replica `r` away until `back_at` (`u64::MAX`: for good).
    fn take_down(&mut self, r: usize, back_at: u64) {
        self.crash(r);
        self.replicas[r].up_at = back_at;
    }
}

#[derive(Default, Debug)]
struct Coverage {
    eio: u64,
    reads: u64,
    stats: SimStats,
}

impl Coverage {
    fn add(&mut self, s: &SimStats) {
        let t = &mut self.stats;
        t.replica_failures += s.replica_failures;
        t.no_healthy += s.no_healthy;
        t.elections += s.elections;
        t.rebuilds += s.rebuilds;
        t.reconciles += s.reconciles;
        t.deltas += s.deltas;
        t.engine_crashes += s.engine_crashes;
        t.crashes_mid_fanout += s.crashes_mid_fanout;
        t.crashes_in_rebuild += s.crashes_in_rebuild;
        t.crashes_in_reconcile += s.crashes_in_reconcile;
        t.old_frames_fenced += s.old_frames_fenced;
        t.old_frames_applied += s.old_frames_applied;
        t.records_lost += s.records_lost;
        t.clean_detaches += s.clean_detaches;
        t.stable_reads += s.stable_reads;
        t.snapshots += s.snapshots;
        t.snapshots_refused += s.snapshots_refused;
        t.reverts += s.reverts;
        t.reverts_partial += s.reverts_partial;
        t.deletes += s.deletes;
        t.layers_copied += s.layers_copied;
        t.partial_deleted += s.partial_deleted;
    }
}

/// One seed: faults (replica crashes, dropped frames, engine crashes on
/// three seeds in four) for 8 s, convergence, then a restart of the
/// engine: after a crash on odd seeds, after a clean detach on even ones.
/// Returns the finished simulation (`sim_seed_summary` describes it).
fn run_seed(seed: u64, cov: &mut Coverage) -> Sim {
    let n = 2 + (seed % 2) as usize;
    let mut sim = Sim::new(seed, n);
    sim.engine_crash_ppm = if seed % 4 == 3 { 0 } else { 20_000 };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sim.run(8_000);
        if seed.is_multiple_of(2) {
            sim.detach_and_restart();
            sim.run(0);
        } else {
            // Crash with the client busy, then let it converge.
            sim.faults = true;
            sim.engine_crash_ppm = 0;
            sim.step_until(sim.now + 1_000 * MS, true);
            sim.crash_engine();
            sim.faults = false;
            sim.step_until(sim.now + 2_000 * MS, true);
            sim.run(0);
        }
    }));
    if let Err(e) = result {
        let tail: Vec<&String> = sim.log.iter().rev().take(60).collect();
        eprintln!("seed {seed} failed; last log lines:");
        for l in tail.into_iter().rev() {
            eprintln!("  {l}");
        }
        std::panic::resume_unwind(e);
    }
    assert!(sim.reads_checked > 0, "seed {seed}: no read was checked");
    cov.eio += sim.eio;
    cov.reads += sim.reads_checked;
    cov.add(&sim.stats);
    sim
}

/// FNV-1a, for `sim_seed_summary`: fixed, so a summary compares across
/// builds and toolchains.
fn fnv1a(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= u64::from(b);
        *h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

/// The seed summary: one line per seed of `run_seed` (what `sim_many_seeds`
/// runs), with what the seed did: simulated end time, milestones, log lines,
/// reads checked, EIOs, the run's counters, the engine's final status, and
/// hashes of the milestones, the log text and every replica's bytes and
/// state. Two engines that behave the same print the same bytes, so a
/// refactor is checked by comparing the summaries of the two trees:
///
/// ```text
/// LULL_SIM_SEEDS=2000 cargo test -p lull-engine --profile ci --lib sim_seed_summary \
///     -- --ignored --nocapture | grep '^sim-summary ' > /tmp/sim-before.txt
/// ```
#[test]
#[ignore = "prints a per-seed summary to compare two trees; run by hand"]
fn sim_seed_summary() {
    let seeds: u64 = std::env::var("LULL_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let base: u64 = std::env::var("LULL_SIM_BASE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    for seed in base..base + seeds {
        let mut cov = Coverage::default();
        let sim = run_seed(seed, &mut cov);
        let mut milestones = FNV_OFFSET;
        for m in &sim.milestones {
            fnv1a(&mut milestones, format!("{m:?}\n").as_bytes());
        }
        let mut log = FNV_OFFSET;
        for l in &sim.log {
            fnv1a(&mut log, l.as_bytes());
            fnv1a(&mut log, b"\n");
        }
        let mut replicas = FNV_OFFSET;
        for r in &sim.replicas {
            fnv1a(&mut replicas, &r.data);
            let allocated: Vec<u8> = r.allocated.iter().map(|&a| u8::from(a)).collect();
            let intent: Vec<u8> = r.intent.iter().map(|&b| u8::from(b)).collect();
            fnv1a(&mut replicas, &allocated);
            fnv1a(&mut replicas, &intent);
            fnv1a(
                &mut replicas,
                format!("{} {} {} {}\n", r.generation, r.clean, r.owner, r.lost).as_bytes(),
            );
        }
        println!(
            "sim-summary seed={seed} end_ms={} milestones={} milestones_fnv={milestones:016x} \
             log_lines={} log_fnv={log:016x} reads={} eio={} generation={} \
             replicas_fnv={replicas:016x} status={:?} stats={:?}",
            sim.now / MS,
            sim.milestones.len(),
            sim.log.len(),
            sim.reads_checked,
            sim.eio,
            sim.engine.generation(),
            sim.engine.status(),
            sim.stats,
        );
    }
}

#[test]
fn sim_many_seeds() {
    let seeds: u64 = std::env::var("LULL_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200);
    let base: u64 = std::env::var("LULL_SIM_BASE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut cov = Coverage::default();
    // A long run goes on past a failing seed (its report is printed) and
    // lists every failure at the end; it says how far it got every
    // `PROGRESS_SEEDS` seeds, so a run stopped early still tells.
    const PROGRESS_SEEDS: u64 = 1000;
    let started = std::time::Instant::now();
    let mut failed = Vec::new();
    for seed in base..base + seeds {
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_seed(seed, &mut cov);
        }));
        if run.is_err() {
            failed.push(seed);
        }
        let done = seed - base + 1;
        if seeds >= PROGRESS_SEEDS && done.is_multiple_of(PROGRESS_SEEDS) {
            eprintln!(
                "sim: seeds {base}..{} done in {} s, failed: {failed:?}",
                seed + 1,
                started.elapsed().as_secs()
            );
        }
    }
    eprintln!("simulation coverage over {seeds} seeds: {cov:?}");
    assert!(failed.is_empty(), "failing seeds: {failed:?}");
    // The faults must actually have been exercised.
    let s = &cov.stats;
    assert!(
        seeds < 50
            || (s.replica_failures > 0
                && s.rebuilds > 0
                && s.deltas > 0
                && s.no_healthy > 0
                && s.engine_crashes > 0
                && s.crashes_mid_fanout > 0
                && s.crashes_in_rebuild + s.crashes_in_reconcile > 0
                && s.reconciles > 0
                && s.old_frames_fenced > 0
                && s.old_frames_applied > 0
                && s.clean_detaches > 0
                && s.stable_reads > 0
                && s.snapshots > 0
                && s.snapshots_refused > 0
                && s.reverts > 0
                && s.deletes > 0
                && s.layers_copied > 0),
        "{cov:?}"
    );
}

/// A revert that one healthy replica does not take, after the writes since
/// the snapshot have left every write-intent record: that replica leaves
/// the healthy set and must come back with the reverted bytes everywhere
/// (`run` checks every replica holds the same bytes and every read).
/// `lacks`: it lacks the snapshot (ENOENT), so its return copies it the
/// snapshot (a layer sync) and rebuilds it in full; otherwise it holds it
/// and refuses the revert (EBUSY), its snapshots match, and its delta
/// rebuild covers the whole volume (the change record the others keep for
/// it was seeded with all of it).
fn revert_not_taken_by_one_replica(lacks: bool) -> Sim {
    let mut sim = Sim::new(7, 2);
    sim.faults = false;
    sim.random_snapshots = false;
    sim.step_until(1_000 * MS, false);
    sim.step_until(2_000 * MS, true);
    sim.snapshot_op(proto::SnapshotOp::Create, "s1");
    assert_eq!(sim.stats.snapshots, 1, "{}", sim.log.join("\n"));
    if lacks {
        sim.replicas[1].snapshots.clear();
    } else {
        sim.replicas[1].refuse_revert = true;
    }
    sim.step_until(sim.now + 1_000 * MS, true);
    // Quiet until every write-intent bit is cleared: the writes since s1
    // are then in no record but the revert's.
    sim.step_until(
        sim.now + crate::core::INTENT_CLEAR_IDLE_NS + 2_000 * MS,
        false,
    );
    assert!(
        sim.replicas.iter().all(|r| r.intent.iter().all(|&g| !g)),
        "intent bits left"
    );
    let copies = sim.stats.rebuilds + sim.stats.deltas;
    sim.snapshot_op(proto::SnapshotOp::Revert, "s1");
    assert_eq!(sim.stats.reverts, 1, "{}", sim.log.join("\n"));
    assert_eq!(sim.stats.reverts_partial, 1, "{}", sim.log.join("\n"));
    sim.replicas[1].refuse_revert = false;
    sim.run(1_000);
    assert!(
        sim.stats.rebuilds + sim.stats.deltas > copies,
        "{}",
        sim.log.join("\n")
    );
    sim
}

#[test]
fn sim_a_replica_without_the_snapshot_gets_it_and_the_reverted_bytes() {
    let sim = revert_not_taken_by_one_replica(true);
    assert_eq!(sim.stats.layers_copied, 1, "{}", sim.log.join("\n"));
    assert_eq!(sim.replicas[1].snapshots, sim.replicas[0].snapshots);
}

#[test]
fn sim_a_replica_that_refused_a_revert_is_copied_over_the_whole_volume() {
    let sim = revert_not_taken_by_one_replica(false);
    assert_eq!(sim.stats.layers_copied, 0, "{}", sim.log.join("\n"));
    let whole =
        format!("change record on 10.0.0.1:7000: 64 region(s) of 65536 bytes, {SIZE} bytes;");
    assert!(
        sim.log
            .iter()
            .any(|l| l.contains("replica 10.0.0.2:7000") && l.contains(&whole)),
        "a delta of the whole volume: {}",
        sim.log.join("\n")
    );
}

/// A daemon restarted with no other engine meanwhile: its engine resumes
/// the session it had, the replicas (owned by that session) take it, it
/// is elected, and everything acknowledged reads back (`run`'s checks).
#[test]
fn sim_a_resumed_engine_takes_its_replicas_back() {
    let mut sim = Sim::new(5, 2);
    sim.faults = false;
    sim.step_until(1_000 * MS, false);
    sim.step_until(3_000 * MS, true);
    let session = sim.session;
    sim.resume_next = true;
    sim.new_engine();
    let restarted_at = sim.milestones.len();
    sim.step_until(sim.now + 5_000 * MS, true);
    assert_eq!(sim.session, session, "the session was resumed");
    assert!(
        sim.milestone_since(restarted_at, |m| matches!(m, Milestone::Elected { .. })),
        "the resumed engine was not elected: {}",
        sim.log.join("\n")
    );
    assert_eq!(sim.engine.fenced_by(), None);
    assert_eq!(sim.engine.final_session(), Some(session));
    sim.run(0);
}

/// A daemon restarted after another engine took a replica over (the
/// volume failed over): the resumed engine is fenced on every replica,
/// never elected, and writes nothing to any replica.
#[test]
fn sim_a_resumed_engine_meeting_a_newer_owner_stands_down() {
    let mut sim = Sim::new(6, 2);
    sim.faults = false;
    sim.step_until(1_000 * MS, false);
    sim.step_until(3_000 * MS, true);
    sim.step_until(sim.now + 1_000 * MS, false);
    assert!(sim.inflight.is_empty(), "client I/O did not finish");
    // Another engine, with a newer session, took replica 1 (it never
    // reached replica 0).
    let newer = sim.session + 10;
    sim.replicas[1].owner = newer;
    let before: Vec<Vec<u8>> = sim.replicas.iter().map(|r| r.data.clone()).collect();
    sim.resume_next = true;
    sim.new_engine();
    let restarted_at = sim.milestones.len();
    let eio_before = sim.eio;
    sim.step_until(sim.now + 10_000 * MS, true);
    assert_eq!(
        sim.engine.fenced_by(),
        Some(newer),
        "{}",
        sim.log.join("\n")
    );
    assert!(
        sim.milestone_since(
            restarted_at,
            |m| matches!(m, Milestone::Fenced { session } if *session == newer)
        ),
        "no Fenced milestone"
    );
    assert!(
        !sim.milestone_since(restarted_at, |m| matches!(m, Milestone::Elected { .. })),
        "a fenced engine was elected: {:?}",
        &sim.milestones[restarted_at..]
    );
    assert!(
        sim.engine
            .status()
            .iter()
            .all(|s| s.state == ReplicaState::Failed),
        "{:?}",
        sim.engine.status()
    );
    assert!(sim.eio > eio_before, "the client's I/O did not fail");
    for (r, data) in sim.replicas.iter().zip(&before) {
        assert!(
            r.data == *data,
            "a fenced engine's write landed on a replica"
        );
    }
}

#[test]
fn sim_without_faults_stays_healthy() {
    let mut sim = Sim::new(42, 3);
    sim.faults = false;
    // I/O before the first election fails (no healthy replica yet), as it
    // would before `wait_ready`; start the client after it.
    sim.step_until(1_000 * MS, false);
    sim.run(5_000);
    assert_eq!(sim.eio, 0);
    assert!(sim.engine.status().iter().all(|s| s.errors == 0));
}

#[test]
fn sim_all_replicas_down_is_eio_not_stale() {
    let mut sim = Sim::new(7, 2);
    sim.faults = false;
    sim.step_until(3_000 * MS, true);
    sim.crash(0);
    sim.crash(1);
    sim.step_until(3_500 * MS, true);
    sim.run(0);
}

/// Replica 1 misses writes while away; then the engine restarts while the
/// fresh replica 0 is the one away. The stale replica alone must not be
/// elected (reads would return data older than acknowledged writes): the
/// volume waits, failing I/O, until replica 0 is back.
#[test]
fn sim_restart_never_elects_a_stale_replica_alone() {
    let mut sim = Sim::new(11, 2);
    sim.faults = false;
    sim.step_until(1_000 * MS, false);
    sim.take_down(1, u64::MAX);
    sim.step_until(6_000 * MS, true);
    sim.step_until(9_000 * MS, false);
    assert!(sim.inflight.is_empty(), "client I/O did not finish");
    assert!(
        sim.oracle.committed.iter().any(|&s| s != 0),
        "no write was acknowledged while replica 1 was away"
    );
    assert!(
        sim.replicas[0].generation > sim.replicas[1].generation,
        "{}",
        sim.log.join("\n")
    );

    let now = sim.now;
    sim.take_down(0, u64::MAX);
    sim.replicas[1].up = true;
    sim.new_engine();
    let restarted_at = sim.milestones.len();
    let eio_before = sim.eio;
    sim.step_until(now + 20_000 * MS, true);
    let (fresh, stale) = (sim.addrs[0].clone(), sim.addrs[1].clone());
    assert!(
        !sim.milestone_since(restarted_at, |m| matches!(m, Milestone::Elected { .. })),
        "a stale replica was elected: {:?}",
        &sim.milestones[restarted_at..]
    );
    assert!(
        sim.milestone_since(restarted_at, |m| {
            *m == Milestone::WaitingForReplicas {
                missing: vec![fresh.clone()],
            }
        }),
        "{:?}",
        &sim.milestones[restarted_at..]
    );
    assert!(
        sim.eio > eio_before,
        "client I/O should fail while the volume waits"
    );

    // Replica 0 returns: it is elected, replica 1 rebuilt from it, and the
    // whole volume reads back as acknowledged (`run` checks every block).
    // The rebuild is a delta: replica 0 kept a change record for replica 1
    // from the moment it left, and the new engine finds it there.
    sim.replicas[0].up_at = sim.now;
    sim.step_until(sim.now + 500 * MS, false);
    sim.run(0);
    assert!(
        sim.milestone_since(restarted_at, |m| matches!(
            m,
            Milestone::Elected { source, .. } if *source == fresh
        )),
        "{:?}",
        &sim.milestones[restarted_at..]
    );
    assert!(
        sim.milestone_since(restarted_at, |m| *m
            == Milestone::CopyComplete {
                replica: stale.clone(),
                kind: CopyKind::Delta
            }),
        "the stale replica was not rebuilt from its change record: {:?}",
        &sim.milestones[restarted_at..]
    );
}

/// The operator's way out when the fresh replica is lost for good: removing
/// it lets the first election go ahead with the replicas that are left.
#[test]
fn sim_removing_a_lost_replica_lets_the_volume_start() {
    let mut sim = Sim::new(12, 2);
    sim.faults = false;
    sim.step_until(1_000 * MS, false);
    sim.take_down(0, u64::MAX);
    sim.new_engine();
    let restarted_at = sim.milestones.len();
    sim.step_until(10_000 * MS, false);
    assert!(
        !sim.milestone_since(restarted_at, |m| matches!(m, Milestone::Elected { .. })),
        "{:?}",
        &sim.milestones[restarted_at..]
    );
    let addr = sim.addrs[0].clone();
    sim.apply(Event::RemoveReplica(addr));
    sim.step_until(sim.now + 1_000 * MS, false);
    assert!(
        sim.milestone_since(restarted_at, |m| matches!(
            m,
            Milestone::Elected { source, .. } if *source == sim.addrs[1]
        )),
        "{:?}",
        &sim.milestones[restarted_at..]
    );
    let st = sim.engine.status();
    assert!(
        st.iter().any(|s| s.state == ReplicaState::Healthy),
        "{st:?}"
    );
}

/// Seeds that once failed, kept as regression cases.
/// - 1320: a replica failed while a TRIM was in flight to it; the TRIM
///   was acknowledged (by the other replica) before the generation bump
///   that the failure starts, the engine crashed before the bump, and the
///   restarted engine reconciled from the replica that lacked the TRIM:
///   an acknowledged TRIM was lost. The bump now starts before the failed
///   replica's requests are drained.
/// - 44314: a restarted engine elected the generation-3 replica and began
///   rebuilding the other (generation 1, intent record lost); the source
///   crashed before the election's bump completed, so the engine still
///   thought it knew generation 0, and three seconds later it elected the
///   half-rebuilt generation-1 replica: reads returned data older than
///   acknowledged writes. An election now raises the known generation to
///   the source's at once.
/// - 208012: an election's bump to generation 2 reached the source, whose
///   acknowledgement was lost when it crashed; with no healthy replica
///   left the bump was dropped, and the next election (of the other
///   replica) bumped to generation 2 again. Two replicas with different
///   data then both had generation 2: the first came back and was being
///   rebuilt when the engine crashed, and the restarted engine elected it
///   (reads older than acknowledged writes). A bump now never reuses a
///   number an earlier bump of the process started with.
#[test]
fn sim_regression_seeds() {
    const SEEDS: &[u64] = &[1320, 44314, 208012];
    let mut cov = Coverage::default();
    for &seed in SEEDS {
        run_seed(seed, &mut cov);
    }
}

/// A write waiting for its region's MARK is passed by a later write to a
/// marked region, but not by a later write that overlaps it: those two
/// complete in order and the later one's data is what the replicas hold.
#[test]
fn sim_a_write_waiting_for_marks_is_passed_but_overlapping_writes_keep_order() {
    let mut sim = Sim::new(5, 2);
    sim.faults = false;
    sim.step_until(1_000 * MS, false);
    let per_region = (SIM_REGION_BYTES as usize) / BLOCK;
    let write = |sim: &mut Sim, first: usize, blocks: usize| -> (u64, u64) {
        let (tag, stamp) = (sim.next_tag, sim.next_stamp + 1);
        sim.next_tag += 1;
        sim.next_stamp += 1;
        let mut buf = IoBuf::with_capacity(blocks * BLOCK);
        buf.set_len(blocks * BLOCK);
        for i in 0..blocks {
            block_pattern(
                stamp,
                first + i,
                &mut buf.as_mut_slice()[i * BLOCK..(i + 1) * BLOCK],
            );
            sim.oracle.maybe[first + i].push(stamp);
            sim.writing[first + i] += 1;
        }
        let (offset, len) = ((first * BLOCK) as u64, (blocks * BLOCK) as u32);
        sim.inflight.insert(
            tag,
            ClientOp {
                op: IoOp::Write { fua: false },
                offset,
                len,
                stamp,
                allowed: Vec::new(),
                epochs: Vec::new(),
            },
        );
        let io = IoRequest {
            tag,
            op: IoOp::Write { fua: false },
            offset,
            len,
            buf: Some(buf),
        };
        sim.apply(Event::Client(ClientReq {
            channel: 0,
            io,
            takes_pipe: false,
            since: None,
        }));
        (tag, stamp)
    };
    // Region 1 is marked by a first write; region 0 is not.
    let (w0, _) = write(&mut sim, per_region + 8, 1);
    sim.step_until(sim.now + 500 * MS, false);
    assert!(
        sim.completed.contains(&w0),
        "the first write did not complete"
    );
    // W1 spans regions 0 and 1 and waits for region 0's MARK. W3 (region
    // 1 only) may pass it; W2 overlaps W1 in region 1, where nothing needs
    // a MARK, and still must not.
    let (w1, _) = write(&mut sim, per_region - 1, 2);
    let (w3, _) = write(&mut sim, per_region + 4, 1);
    let (w2, s2) = write(&mut sim, per_region, 1);
    sim.step_until(sim.now + 2_000 * MS, false);
    let at = |t: u64| {
        sim.completed
            .iter()
            .position(|&c| c == t)
            .unwrap_or_else(|| panic!("write {t} did not complete"))
    };
    assert!(
        at(w3) < at(w1),
        "a write to a marked region waited behind a write waiting for its MARK"
    );
    assert!(at(w1) < at(w2), "overlapping writes completed out of order");
    for (r, rep) in sim.replicas.iter().enumerate() {
        let b = per_region;
        assert_eq!(
            block_stamp(&rep.data[b * BLOCK..(b + 1) * BLOCK], b),
            Some(s2),
            "replica {r} holds an older write than the last one"
        );
    }
}

/// NBD block status of a replicated volume: a BLOCK_STATUS to one healthy
/// replica, like a read, true against the oracle (holes only where nothing
/// was written), answered by the other replica when one is down, EIO when
/// none is healthy, and bounded by the client's buffer (REQ_ONE).
#[test]
fn sim_block_status_asks_a_healthy_replica() {
    use lull_bdev::{Extent, EXTENT_RECORD_LEN};
    let mut sim = Sim::new(9, 2);
    sim.faults = false;
    sim.step_until(1_000 * MS, false);
    let issue = |sim: &mut Sim, op: IoOp, offset: u64, len: u32, buf: IoBuf| -> u64 {
        let (tag, stamp) = (sim.next_tag, sim.next_stamp + 1);
        sim.next_tag += 1;
        sim.next_stamp += 1;
        if op != IoOp::BlockStatus {
            for b in offset as usize / BLOCK..(offset as usize + len as usize) / BLOCK {
                sim.oracle.maybe[b].push(stamp);
                sim.writing[b] += 1;
            }
        }
        sim.inflight.insert(
            tag,
            ClientOp {
                op,
                offset,
                len,
                stamp,
                allowed: Vec::new(),
                epochs: Vec::new(),
            },
        );
        let io = IoRequest {
            tag,
            op,
            offset,
            len,
            buf: Some(buf),
        };
        sim.apply(Event::Client(ClientReq {
            channel: 0,
            io,
            takes_pipe: false,
            since: None,
        }));
        tag
    };
    let mut data = IoBuf::with_capacity(2 * BLOCK);
    data.set_len(2 * BLOCK);
    let stamp = sim.next_stamp + 1;
    for i in 0..2 {
        block_pattern(
            stamp,
            4 + i,
            &mut data.as_mut_slice()[i * BLOCK..(i + 1) * BLOCK],
        );
    }
    let w = issue(
        &mut sim,
        IoOp::Write { fua: false },
        4 * BLOCK as u64,
        2 * BLOCK as u32,
        data,
    );
    sim.step_until(sim.now + 500 * MS, false);
    assert!(sim.completed.contains(&w), "the write did not complete");
    let records = |n: usize| {
        let mut b = IoBuf::with_capacity(n * EXTENT_RECORD_LEN);
        b.set_len(n * EXTENT_RECORD_LEN);
        b
    };
    let expect = [
        Extent::hole(4 * BLOCK as u64),
        Extent::data(2 * BLOCK as u64),
        Extent::hole(SIZE - 6 * BLOCK as u64),
    ];
    // Twice: reads and block status alternate between the replicas.
    for _ in 0..2 {
        let t = issue(&mut sim, IoOp::BlockStatus, 0, SIZE as u32, records(16));
        sim.step_until(sim.now + 200 * MS, false);
        assert!(sim.completed.contains(&t), "block status did not complete");
        assert_eq!(sim.block_status.last().unwrap(), &expect);
    }
    // REQ_ONE: a buffer of one record gets one extent.
    issue(
        &mut sim,
        IoOp::BlockStatus,
        4 * BLOCK as u64,
        8 * BLOCK as u32,
        records(1),
    );
    sim.step_until(sim.now + 200 * MS, false);
    assert_eq!(
        sim.block_status.last().unwrap(),
        &[Extent::data(2 * BLOCK as u64)]
    );
    // One replica down: the other answers, several times.
    sim.take_down(0, u64::MAX);
    sim.step_until(sim.now + 10_000 * MS, false);
    let answered = sim.block_status.len();
    for _ in 0..3 {
        issue(&mut sim, IoOp::BlockStatus, 0, SIZE as u32, records(16));
        sim.step_until(sim.now + 200 * MS, false);
    }
    assert_eq!(sim.block_status.len(), answered + 3, "{:?}", sim.log);
    assert_eq!(sim.block_status.last().unwrap(), &expect);
    assert_eq!(sim.eio, 0);
    // None healthy: EIO, never a made-up answer.
    sim.take_down(1, u64::MAX);
    sim.step_until(sim.now + 10_000 * MS, false);
    issue(&mut sim, IoOp::BlockStatus, 0, SIZE as u32, records(16));
    sim.step_until(sim.now + 200 * MS, false);
    assert_eq!(sim.eio, 1);
    assert_eq!(sim.block_status.len(), answered + 3);
}

/// A client whose channel takes pipes: a read's data goes from its reply
/// frame (`Received::Spliced`) to its completion (`Action::Complete`'s
/// `spliced`) with the pipe, through replica failures and retries, and
/// every read still checks out against the oracle.
#[test]
fn sim_a_spliced_read_carries_its_pipe_to_its_completion() {
    let mut sim = Sim::new(0, 2);
    sim.pipes = true;
    sim.run(8_000);
    assert!(sim.spliced_reads > 0, "no read was spliced");
    assert!(sim.reads_checked > 0);
    assert!(
        sim.stats.replica_failures > 0,
        "the faults did not fail a replica"
    );
}

/// A grow holds writes, drains them, sends GROW to every replica and, as
/// every replica refuses (the simulated volume has a fixed size), keeps
/// the size and the healthy set and lets writes go on, the oracle checked
/// throughout. A grow with a replica away, and a shrink, are refused at
/// once.
#[test]
fn sim_a_refused_grow_keeps_the_size_and_the_writes_go_on() {
    let mut sim = Sim::new(77, 2);
    sim.faults = false;
    sim.step_until(1_000 * MS, false);
    sim.step_until(1_500 * MS, true);
    sim.apply(Event::Grow {
        token: 1,
        size_bytes: 2 * SIZE,
    });
    let deadline = sim.now + 10_000 * MS;
    while sim.grow_outcomes.is_empty() {
        assert!(sim.now < deadline, "the grow never answered");
        sim.step_until(sim.now + 10 * MS, true);
    }
    let why = sim.grow_outcomes[0]
        .clone()
        .expect_err("every replica refused");
    assert!(why.contains("cannot grow"), "{why}");
    assert_eq!(sim.engine.size_bytes(), SIZE);
    assert_eq!(sim.engine.healthy_count(), 2, "{}", sim.log.join("\n"));
    sim.apply(Event::Grow {
        token: 2,
        size_bytes: SIZE - 4096,
    });
    sim.take_down(1, u64::MAX);
    sim.step_until(sim.now + 5_000 * MS, true);
    sim.apply(Event::Grow {
        token: 3,
        size_bytes: 2 * SIZE,
    });
    assert_eq!(sim.grow_outcomes.len(), 3);
    assert!(sim.grow_outcomes[1]
        .as_ref()
        .is_err_and(|w| w.contains("shrink")));
    assert!(sim.grow_outcomes[2]
        .as_ref()
        .is_err_and(|w| w.contains("every replica healthy")));
    sim.run(0);
}
