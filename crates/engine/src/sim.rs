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

use std::collections::BTreeMap;
use std::net::SocketAddr;

use lull_bdev::{IoBuf, IoOp, IoRequest};
use lull_proto::replica::{self as wire, Header, Hello, Kind, HEADER_LEN};

use crate::core::{Action, ClientReq, ConnRef, Engine, Event, Payload};
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

struct SimReplica {
    data: Vec<u8>,
    allocated: Vec<bool>,
    generation: u64,
    clean: bool,
    up: bool,
    up_at: u64,
}

impl SimReplica {
    fn extents(&self, offset: u64, len: u64) -> (u64, Vec<(u64, u64)>) {
        let (start, end) = (offset as usize / BLOCK, ((offset + len) as usize).div_ceil(BLOCK).min(BLOCKS));
        let mut ext: Vec<(u64, u64)> = Vec::new();
        let mut b = start;
        while b < end {
            if self.allocated[b] {
                let s = b;
                while b < end && self.allocated[b] {
                    b += 1;
                }
                if ext.len() == wire::MAX_EXTENTS_PER_REPLY {
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

    /// Serve one request; the reply frame (header, payload).
    fn serve(&mut self, h: &Header, payload: &[u8]) -> (Header, Vec<u8>) {
        let range_ok = h.offset.checked_add(u64::from(h.length)).is_some_and(|e| e <= SIZE);
        let (o, l) = (h.offset as usize, h.length as usize);
        match h.kind {
            Kind::Hello => {
                let Ok(hello) = wire::decode_hello(payload) else { return (h.reply_with(libc::EPROTO as u32), vec![0; 32]) };
                if hello.flags & wire::HELLO_FLAG_ATTACH != 0 {
                    self.generation = self.generation.max(hello.generation);
                }
                let flags = if self.clean { wire::HELLO_FLAG_CLEAN } else { 0 };
                if hello.flags & wire::HELLO_FLAG_ATTACH != 0 {
                    self.clean = false;
                }
                let me = Hello { volume_size: SIZE, generation: self.generation, flags };
                (h.reply_with(0), wire::encode_hello(&me).to_vec())
            }
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
            Kind::Extents => {
                let (end, ext) = self.extents(h.offset, u64::from(h.length));
                let mut out = Vec::new();
                let _ = wire::encode_extents(&ext, &mut out);
                let mut r = h.reply_with(0);
                r.offset = end;
                r.length = out.len() as u32;
                (r, out)
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
    dir: Dir,
    header: [u8; HEADER_LEN],
    payload: Vec<u8>,
}

enum Sched {
    Net(Msg),
    ConnResult(ConnRef, bool),
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
}

pub(crate) struct Sim {
    rng: Rng,
    now: u64,
    engine: Engine,
    addrs: Vec<SocketAddr>,
    replicas: Vec<SimReplica>,
    queue: BTreeMap<(u64, u64), Sched>,
    seq: u64,
    oracle: Oracle,
    inflight: BTreeMap<u64, ClientOp>,
    next_tag: u64,
    next_stamp: u64,
    faults: bool,
    reads_checked: u64,
    eio: u64,
    next_tick: u64,
    pub(crate) log: Vec<String>,
}

impl Sim {
    pub(crate) fn new(seed: u64, n_replicas: usize) -> Sim {
        let addrs: Vec<SocketAddr> = (0..n_replicas).map(|i| SocketAddr::from(([10, 0, 0, i as u8 + 1], 7000))).collect();
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
            engine: Engine::new("sim", SIZE, addrs.clone(), opts),
            addrs,
            replicas: (0..n_replicas)
                .map(|_| SimReplica {
                    data: vec![0; SIZE as usize],
                    allocated: vec![false; BLOCKS],
                    generation: 0,
                    clean: true,
                    up: true,
                    up_at: 0,
                })
                .collect(),
            queue: BTreeMap::new(),
            seq: 0,
            oracle: Oracle { committed: vec![0; BLOCKS], maybe: vec![Vec::new(); BLOCKS] },
            inflight: BTreeMap::new(),
            next_tag: 1,
            next_stamp: 1,
            faults: true,
            reads_checked: 0,
            eio: 0,
            next_tick: 0,
            log: Vec::new(),
        };
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
                Action::Send { conn, header, payload } => {
                    let bytes = match payload {
                        Payload::None => Vec::new(),
                        Payload::Hello(h) => h.to_vec(),
                        Payload::Data { buf, len } => buf.as_slice()[..len].to_vec(),
                    };
                    let d = self.net_delay();
                    self.schedule(d, Sched::Net(Msg { conn, dir: Dir::ToReplica, header, payload: bytes }));
                }
                Action::Complete { tag, result, buf, .. } => self.on_complete(tag, result.is_ok(), buf),
                Action::Connect { conn, .. } => {
                    let up = self.replicas[conn.replica as usize].up;
                    let d = self.rng.below(20 * MS);
                    self.schedule(d, Sched::ConnResult(conn, up));
                }
                Action::Close { conn } => self.drop_conn(conn),
                Action::Log { msg, .. } => self.log.push(format!("{:>8} ms {msg}", self.now / MS)),
            }
        }
    }

    fn drop_conn(&mut self, conn: ConnRef) {
        self.queue.retain(|_, s| match s {
            Sched::Net(m) => m.conn != conn,
            Sched::ConnResult(c, _) => *c != conn,
        });
    }

    fn crash(&mut self, r: usize) {
        if !self.replicas[r].up {
            return;
        }
        let down = 200 * MS + self.rng.below(3000 * MS);
        self.replicas[r].up = false;
        self.replicas[r].up_at = self.now + down;
        self.log.push(format!("{:>8} ms SIM crash replica {r} for {} ms", self.now / MS, down / MS));
        // Frames in transit to and from it are lost.
        self.queue.retain(|_, s| !matches!(s, Sched::Net(m) if m.conn.replica as usize == r));
        // Half the time the engine sees the resets at once; otherwise it
        // finds out by the keep-alive timeout.
        for c in 0..2u32 {
            for e in 0..=self.max_epoch() {
                let conn = ConnRef { replica: r as u32, conn: c, epoch: e };
                if self.engine.conn_live(conn) && self.rng.chance(500_000) {
                    self.apply(Event::ConnDown { conn, reason: "sim: connection reset".into() });
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
            Sched::ConnResult(conn, ok) => {
                let ok = ok && self.replicas[conn.replica as usize].up;
                if ok {
                    self.apply(Event::ConnUp(conn));
                } else {
                    self.apply(Event::ConnDown { conn, reason: "sim: connection refused".into() });
                }
            }
            Sched::Net(m) => match m.dir {
                Dir::ToReplica => {
                    let r = m.conn.replica as usize;
                    if !self.replicas[r].up {
                        return;
                    }
                    if self.faults && self.rng.chance(300) {
                        // A lost frame on TCP is a broken connection.
                        self.drop_conn(m.conn);
                        self.apply(Event::ConnDown { conn: m.conn, reason: "sim: frame dropped".into() });
                        return;
                    }
                    let Ok(h) = wire::decode_header(&m.header) else { panic!("engine sent an undecodable header") };
                    assert_eq!(wire::payload_len(&h), m.payload.len(), "engine frame payload length");
                    let (reply, payload) = self.replicas[r].serve(&h, &m.payload);
                    let mut bytes = [0u8; HEADER_LEN];
                    wire::encode_header(&reply, &mut bytes).expect("sim replica reply encodes");
                    let d = self.net_delay();
                    self.schedule(d, Sched::Net(Msg { conn: m.conn, dir: Dir::ToEngine, header: bytes, payload }));
                }
                Dir::ToEngine => {
                    let h = wire::decode_header(&m.header).expect("sim replica header");
                    let payload = (!m.payload.is_empty()).then(|| {
                        let mut b = self.engine.get_buf(m.payload.len());
                        b.as_mut_slice().copy_from_slice(&m.payload);
                        b
                    });
                    self.apply(Event::Frame { conn: m.conn, header: h, payload });
                }
            },
        }
    }

    // ---- client and oracle ------------------------------------------------

    fn overlaps_write_in_flight(&self, off: u64, len: u32) -> bool {
        self.inflight.values().any(|c| {
            !matches!(c.op, IoOp::Read | IoOp::Flush) && off < c.offset + u64::from(c.len) && c.offset < off + u64::from(len)
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
            45..=84 => IoOp::Write { fua: pick.is_multiple_of(7) },
            85..=89 => IoOp::Trim,
            90..=93 => IoOp::WriteZeroes { no_hole: false, fua: pick.is_multiple_of(2) },
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
                    block_pattern(stamp, first + i, &mut b.as_mut_slice()[i * BLOCK..(i + 1) * BLOCK]);
                }
                Some(b)
            }
            _ => None,
        };
        let (op_offset, op_len) = if matches!(op, IoOp::Flush) { (0, 0) } else { (offset, len) };
        if modifies {
            for b in first..first + blocks {
                self.oracle.maybe[b].push(stamp);
            }
            for r in self.inflight.values_mut().filter(|o| matches!(o.op, IoOp::Read)) {
                let rf = r.offset as usize / BLOCK;
                for b in first..first + blocks {
                    if b >= rf && b < rf + r.allowed.len() {
                        r.allowed[b - rf].push(stamp);
                    }
                }
            }
        }
        let allowed = if matches!(op, IoOp::Read) { self.allowed_now(first, blocks) } else { Vec::new() };
        self.inflight.insert(tag, ClientOp { op, offset: op_offset, len: op_len, stamp, allowed });
        self.apply(Event::Client(ClientReq { channel: 0, io: IoRequest { tag, op, offset: op_offset, len: op_len, buf } }));
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
        let c = self.inflight.remove(&tag).expect("completion for a known tag, exactly once");
        if !ok {
            self.eio += 1;
            return; // a failed write stays "maybe" until superseded
        }
        let first = (c.offset as usize) / BLOCK;
        let blocks = c.len as usize / BLOCK;
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
                }
                self.reads_checked += 1;
            }
            IoOp::Flush => {}
            _ => {
                for b in first..first + blocks {
                    self.oracle.committed[b] = c.stamp;
                    self.oracle.maybe[b].clear();
                    // Writes still in flight over this block stay possible.
                    let others: Vec<u64> = self
                        .inflight
                        .values()
                        .filter(|o| !matches!(o.op, IoOp::Read | IoOp::Flush))
                        .filter(|o| (o.offset as usize) / BLOCK <= b && b < (o.offset as usize + o.len as usize) / BLOCK)
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
                for r in 0..self.replicas.len() {
                    if !self.replicas[r].up && self.now >= self.replicas[r].up_at {
                        self.replicas[r].up = true;
                        self.log.push(format!("{:>8} ms SIM replica {r} back", self.now / MS));
                    }
                }
                if self.faults && self.rng.chance(15_000) {
                    let r = self.rng.below(self.replicas.len() as u64) as usize;
                    self.crash(r);
                }
                if client {
                    for _ in 0..4 {
                        self.client_issue();
                    }
                }
            }
            while let Some((&k, _)) = self.queue.iter().next() {
                if k.0 > self.now {
                    break;
                }
                let Some(s) = self.queue.remove(&k) else { break };
                self.deliver(s);
                if client && self.rng.chance(300_000) {
                    self.client_issue();
                }
            }
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
            if all_healthy && self.inflight.is_empty() && !self.engine.rebuilding() && self.engine.client_ios() == 0 {
                break;
            }
            assert!(self.now < deadline, "did not converge: {st:?}\n{}", self.log.join("\n"));
        }
        // Whole-volume read through the engine.
        let tag = self.next_tag;
        self.next_tag += 1;
        let mut buf = IoBuf::with_capacity(SIZE as usize);
        buf.set_len(SIZE as usize);
        let allowed = self.allowed_now(0, BLOCKS);
        self.inflight.insert(tag, ClientOp { op: IoOp::Read, offset: 0, len: SIZE as u32, stamp: 0, allowed });
        self.apply(Event::Client(ClientReq { channel: 0, io: IoRequest { tag, op: IoOp::Read, offset: 0, len: SIZE as u32, buf: Some(buf) } }));
        self.step_until(self.now + 1000 * MS, false);
        assert!(self.inflight.is_empty(), "final read did not complete");
        for r in 1..self.replicas.len() {
            assert!(self.replicas[r].data == self.replicas[0].data, "replica {r} differs from replica 0\n{}", self.log.join("\n"));
        }
        // Every acknowledged write is there.
        for b in 0..BLOCKS {
            let s = block_stamp(&self.replicas[0].data[b * BLOCK..(b + 1) * BLOCK], b);
            let ok = s == Some(self.oracle.committed[b]) || s.is_some_and(|s| self.oracle.maybe[b].contains(&s));
            assert!(ok, "block {b}: replica has {s:?}, acknowledged {}", self.oracle.committed[b]);
        }
    }

    /// The engine restarts (a new process) against the same replicas: the
    /// election must pick a fresh replica and the volume read back intact.
    pub(crate) fn restart_engine(&mut self) {
        self.new_engine();
        self.run(0);
    }

    /// A new engine process against the same replicas; frames of the old
    /// one are lost with it.
    fn new_engine(&mut self) {
        let opts = EngineOptions { slots_per_connection: 6, replica_timeout_ms: 2000, keepalive_interval_ms: 500, ..Default::default() };
        self.queue.clear();
        self.engine = Engine::new("sim", SIZE, self.addrs.clone(), opts);
        let mut out = Vec::new();
        self.engine.start(self.now, &mut out);
        self.perform(out);
    }

    /// Takes replica `r` away until `back_at` (`u64::MAX`: for good).
    fn take_down(&mut self, r: usize, back_at: u64) {
        self.crash(r);
        self.replicas[r].up_at = back_at;
    }
}

#[derive(Default, Debug)]
struct Coverage {
    failures: usize,
    rebuilds: usize,
    no_healthy: usize,
    elections: usize,
    eio: u64,
    reads: u64,
}

fn run_seed(seed: u64, cov: &mut Coverage) {
    let n = 2 + (seed % 2) as usize;
    let mut sim = Sim::new(seed, n);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sim.run(8_000);
        sim.restart_engine();
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
    let count = |p: &str| sim.log.iter().filter(|l| l.contains(p)).count();
    cov.failures += count(" failed (was");
    cov.rebuilds += count("rebuild complete");
    cov.no_healthy += count("no healthy replica left");
    cov.elections += count("elected replica");
    cov.eio += sim.eio;
    cov.reads += sim.reads_checked;
}

#[test]
fn sim_many_seeds() {
    let seeds: u64 = std::env::var("LULL_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(200);
    let base: u64 = std::env::var("LULL_SIM_BASE").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut cov = Coverage::default();
    for seed in base..base + seeds {
        run_seed(seed, &mut cov);
    }
    eprintln!("simulation coverage over {seeds} seeds: {cov:?}");
    // The faults must actually have been exercised.
    assert!(seeds < 50 || (cov.failures > 0 && cov.rebuilds > 0 && cov.no_healthy > 0), "{cov:?}");
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
    assert!(sim.oracle.committed.iter().any(|&s| s != 0), "no write was acknowledged while replica 1 was away");
    assert!(sim.replicas[0].generation > sim.replicas[1].generation, "{}", sim.log.join("\n"));

    let now = sim.now;
    sim.take_down(0, u64::MAX);
    sim.replicas[1].up = true;
    sim.new_engine();
    let restarted_at = sim.log.len();
    let eio_before = sim.eio;
    sim.step_until(now + 20_000 * MS, true);
    let after = &sim.log[restarted_at..];
    assert!(!after.iter().any(|l| l.contains("elected replica")), "a stale replica was elected:\n{}", after.join("\n"));
    assert!(after.iter().any(|l| l.contains("waiting for replica(s) 10.0.0.1:7000")), "{}", after.join("\n"));
    assert!(sim.eio > eio_before, "client I/O should fail while the volume waits");

    // Replica 0 returns: it is elected, replica 1 rebuilt from it, and the
    // whole volume reads back as acknowledged (`run` checks every block).
    sim.replicas[0].up_at = sim.now;
    sim.step_until(sim.now + 500 * MS, false);
    sim.run(0);
    assert!(sim.log[restarted_at..].iter().any(|l| l.contains("elected replica 10.0.0.1:7000")), "{}", sim.log.join("\n"));
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
    let restarted_at = sim.log.len();
    sim.step_until(10_000 * MS, false);
    assert!(!sim.log[restarted_at..].iter().any(|l| l.contains("elected replica")), "{}", sim.log.join("\n"));
    let addr = sim.addrs[0];
    sim.apply(Event::RemoveReplica(addr));
    sim.step_until(sim.now + 1_000 * MS, false);
    assert!(sim.log[restarted_at..].iter().any(|l| l.contains("elected replica 10.0.0.2:7000")), "{}", sim.log.join("\n"));
    let st = sim.engine.status();
    assert!(st.iter().any(|s| s.state == ReplicaState::Healthy), "{st:?}");
}
