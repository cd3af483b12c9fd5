//! Replicas and their connections: connect, probe (HELLO, INTENT_GET),
//! send requests into a connection's slot table, route reply frames, fail
//! a replica (and everything it had in flight), and time (request
//! timeouts, silence, keep-alives, reconnects). Their state (`Replica`,
//! `Conn`, the `Sub` in each slot) is in `types`.

use lull_bdev::{IoBuf, IoOp};
use lull_net::slots::SlotTable;
use lull_proto::replica::{self as proto, Header, Hello, Kind, HEADER_LEN};

use super::ids::{ConnId, ConnRef, ReplicaId, ReplicaSet, ReplicaTarget, MAX_REPLICAS};
use super::io::eio;
use super::rebuild::REBUILD_LOG_INTERVAL_NS;
use super::types::{
    Action, CState, Conn, Detach, Engine, LogLevel, Lookup, Milestone, Payload, RState, Received,
    Replica, Sub, SubKind,
};

/// What a SNAPSHOT request may take beyond the replica timeout before
/// the replica is failed: its chain waits up to 10 s for the requests in
/// flight to finish (`lull_bdev::chain::QUIESCE_TIMEOUT`) and then syncs
/// the head it freezes and its record, which on a busy disk takes longer
/// than a write; 20 s covers both.
pub const SNAPSHOT_EXTRA_TIMEOUT_NS: u64 = 20_000_000_000;

/// The longest wait between attempts on a replica that cannot be
/// authenticated: a wrong key or certificate is an operator's mistake, so
/// each end logs a refusal about once a minute until it is fixed, and a
/// fixed replica is back within a minute.
pub const AUTH_RETRY_INTERVAL_MS_MAX: u64 = 60_000;

/// Doublings of `reconnect_interval_ms` before the cap (2 s × 2^5 = 64 s
/// with the default interval); bounds the shift.
const AUTH_RETRY_DOUBLINGS_MAX: u32 = 5;

impl Engine {
    pub(super) fn push_replica(&mut self, addr: ReplicaTarget) -> ReplicaId {
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
            auth_failures: 0,
            next_conn: 0,
            intent: None,
            intent_lost: false,
            reconcile: None,
            lookup: Lookup::Off,
            last_rebuild: None,
            sync_token: 0,
        };
        if let Some(i) = self.replicas.position(|r| r.state == RState::Removed) {
            let epochs: Vec<u32> = self.replicas[i].conns.iter().map(|c| c.epoch).collect();
            self.replicas[i] = r;
            for (c, e) in self.replicas[i].conns.iter_mut().zip(epochs) {
                c.epoch = e;
            }
            i
        } else {
            self.replicas.push(r)
        }
    }

    // ---- replicas and connections ------------------------------------

    pub(super) fn live_conn(&self, c: ConnRef) -> Option<ReplicaId> {
        let r = self.replicas.get(c.replica)?;
        let conn = r.conns.get(c.conn)?;
        (conn.epoch == c.epoch && conn.state != CState::Down).then_some(c.replica)
    }

    /// Whether the engine waits for this connection attempt (the shell
    /// drops sockets of attempts it gave up on).
    pub fn conn_connecting(&self, c: ConnRef) -> bool {
        self.live_conn(c).is_some()
            && self.replicas[c.replica].conns[c.conn].state == CState::Connecting
    }

    /// Whether this connection is still in use.
    pub fn conn_live(&self, c: ConnRef) -> bool {
        self.live_conn(c).is_some()
    }

    fn conn_ref(&self, r: ReplicaId, c: ConnId) -> ConnRef {
        ConnRef {
            replica: r,
            conn: c,
            epoch: self.replicas[r].conns[c].epoch,
        }
    }

    pub(super) fn connect(&mut self, r: ReplicaId) {
        let now = self.now;
        let addr = self.replicas[r].addr.clone();
        self.replicas[r].state = RState::Connecting;
        for c in self.replicas[r].conns.ids() {
            let conn = &mut self.replicas[r].conns[c];
            conn.epoch = conn.epoch.wrapping_add(1);
            conn.state = CState::Connecting;
            conn.probe = None;
            conn.ping_out = false;
            conn.last_rx_ns = now;
            conn.last_tx_ns = now;
            let cref = self.conn_ref(r, c);
            self.out.push(Action::Connect {
                conn: cref,
                addr: addr.clone(),
            });
        }
    }

    pub(super) fn add_replica(&mut self, addr: ReplicaTarget) {
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
        let r = self.push_replica(addr.clone());
        self.log(LogLevel::Info, format!("replica {addr} added"));
        if self.started {
            self.connect(r);
        }
    }

    pub(super) fn remove_replica(&mut self, addr: ReplicaTarget) {
        match self
            .replicas
            .position(|r| r.addr == addr && r.state != RState::Removed)
        {
            Some(r) => self.fail_replica(r, "removed by the operator", true),
            None => self.log(
                LogLevel::Warn,
                format!("cannot remove replica {addr}: not part of the volume"),
            ),
        }
    }

    pub(super) fn healthy_set(&self) -> ReplicaSet {
        self.set_of(|s| s == RState::Healthy)
    }

    pub(super) fn write_set(&self) -> ReplicaSet {
        self.set_of(|s| matches!(s, RState::Healthy | RState::Rebuilding))
    }

    fn set_of(&self, f: impl Fn(RState) -> bool) -> ReplicaSet {
        self.replicas
            .iter_with_ids()
            .filter(|(_, r)| f(r.state))
            .map(|(i, _)| i)
            .collect()
    }

    pub(super) fn on_conn_up(&mut self, c: ConnRef) {
        let Some(r) = self.live_conn(c) else { return };
        let ci = c.conn;
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
        let payload = proto::encode_hello_request(&hello, self.replicas[r].addr.hello_name());
        if !self.send(
            r,
            ci,
            SubKind::Probe,
            Kind::Hello,
            0,
            payload.len() as u32,
            Payload::Control(payload),
        ) {
            self.fail_replica(r, "no slot for the HELLO probe", false);
        }
    }

    /// Queue a request on connection `c` of replica `r`; false when its slot
    /// table is full.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send(
        &mut self,
        r: ReplicaId,
        c: ConnId,
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
        if let Err(e) = proto::encode_header(&header, &mut bytes) {
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
    pub(super) fn pick_conn(&mut self, r: ReplicaId) -> Option<ConnId> {
        let rep = &mut self.replicas[r];
        let n = rep.conns.len();
        for k in 0..n {
            let c = ConnId::new((rep.next_conn + k) % n);
            if rep.conns[c].state == CState::Up && !rep.conns[c].slots.is_full() {
                rep.next_conn = (c.get() + 1) % n;
                return Some(c);
            }
        }
        None
    }

    pub(super) fn send_any(
        &mut self,
        r: ReplicaId,
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

    /// Replica `r` could not be authenticated: fail it, and wait
    /// `reconnect_interval_ms` doubled per failure in a row (at most
    /// [`AUTH_RETRY_INTERVAL_MS_MAX`]) before trying again, so a wrong key
    /// costs each end a log line a minute rather than one every 2 s.
    pub(super) fn auth_failed(&mut self, r: ReplicaId, reason: &str) {
        if matches!(self.replicas[r].state, RState::Failed | RState::Removed) {
            return;
        }
        self.fail_replica(r, reason, false);
        let rep = &mut self.replicas[r];
        rep.auth_failures = rep.auth_failures.saturating_add(1);
        let doublings = (rep.auth_failures - 1).min(AUTH_RETRY_DOUBLINGS_MAX);
        let wait_ms = self
            .opts
            .reconnect_interval_ms
            .saturating_mul(1 << doublings)
            .min(AUTH_RETRY_INTERVAL_MS_MAX.max(self.opts.reconnect_interval_ms));
        rep.retry_at_ns = self.now.saturating_add(wait_ms.saturating_mul(1_000_000));
    }

    /// Fail replica `r`: close its connections, finish everything it had in
    /// flight (reads go to another replica, writes count it as not having
    /// the data), and leave the healthy set. No slot survives this.
    pub(super) fn fail_replica(&mut self, r: ReplicaId, reason: &str, remove: bool) {
        let was = self.replicas[r].state;
        if was == RState::Removed || (was == RState::Failed && !remove) {
            return;
        }
        let addr = self.replicas[r].addr.clone();
        let now = self.now;
        if was == RState::Syncing {
            let token = self.replicas[r].sync_token;
            self.out.push(Action::StopLayerSync { token });
        }
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
            // A lookup in flight answers into nothing: the next return
            // starts a new one.
            rep.lookup = Lookup::Off;
        }
        // Its bits are no longer known: a replica that comes back is
        // rebuilt in full, and marked again before it is written.
        for g in &mut self.regions {
            g.marked.remove(r);
            g.marking.remove(r);
            g.clearing.remove(r);
        }
        if let Some(Detach::Flushing(m) | Detach::Detaching(m)) = self.detach.as_mut() {
            m.remove(r);
        }
        self.snapshot_replica_gone(r);
        self.grow_sub_failed(r);
        // The healthy set shrank: acknowledgements wait for a new
        // generation on the replicas left, and that must hold before the
        // failed replica's requests are drained below, or a write that
        // completes by this very failure would be acknowledged while the
        // failed replica, which lacks it, still has the same generation.
        if was == RState::Healthy && !self.healthy_set().is_empty() {
            self.start_bump();
            if !remove {
                self.start_change_records(r);
            }
        }
        if remove {
            self.drop_change_records(r);
        }
        let mut drained = Vec::new();
        for c in self.replicas[r].conns.ids() {
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
        self.milestone(Milestone::ReplicaFailed {
            replica: addr,
            was_healthy: was == RState::Healthy,
            removed: remove,
        });
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
            let healthy = self.healthy_set().len();
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
        self.milestone(Milestone::NoHealthyReplica);
        self.bump = None;
        for id in std::mem::take(&mut self.deferred) {
            self.finish_io(id, Err(eio("no healthy replica")));
        }
        let rebuilding: Vec<ReplicaId> = self
            .replicas
            .ids()
            .filter(|&i| self.replicas[i].state == RState::Rebuilding)
            .collect();
        for i in rebuilding {
            self.fail_replica(i, "no healthy replica left to rebuild from", false);
        }
    }

    /// A request of replica `r` ended without a good reply.
    pub(super) fn sub_failed(&mut self, r: ReplicaId, sub: Sub) {
        match sub.what {
            SubKind::Client(id) => {
                let Some(io) = self.ios.get_mut(id) else {
                    return;
                };
                io.outstanding -= 1;
                if matches!(io.op, IoOp::Read | IoOp::BlockStatus | IoOp::ChangedSince) {
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
            SubKind::ChangesGet(target) => self.lookup_failed(target, r),
            SubKind::Snapshot => self.snapshot_sub_failed(r, None),
            SubKind::Grow => self.grow_sub_failed(r),
            SubKind::SnapshotList(token) => self.snapshot_sub_failed(r, Some(token)),
            SubKind::Changes if sub.kind == Kind::ChangesStart => {
                self.changes_starting = self.changes_starting.saturating_sub(1);
            }
            // `fail_replica` forgets the replica's region masks and detach
            // steps: nothing to undo per request.
            SubKind::Probe
            | SubKind::IntentGet
            | SubKind::Ping
            | SubKind::Rebuild(_)
            | SubKind::Intent
            | SubKind::Changes
            | SubKind::Detach => {}
        }
    }

    // ---- frames ----------------------------------------------------------

    pub(super) fn protocol_error(&mut self, r: ReplicaId, sub: Option<Sub>, why: String) {
        if let Some(sub) = sub {
            self.sub_failed(r, sub);
        }
        self.fail_replica(r, &format!("protocol error: {why}"), false);
    }

    /// A frame arrived; its payload was received where `payload_sink`
    /// said. On a refusal below the payload drops with the frame (a pipe
    /// with it closes, its data unsent).
    pub(super) fn on_frame(&mut self, c: ConnRef, h: Header, payload: Received) {
        let Some(r) = self.live_conn(c) else {
            if let Some(b) = payload.into_buf() {
                lull_net::bufs::put(b);
            }
            return;
        };
        let ci = c.conn;
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
            SubKind::Probe => self.on_probe_reply(r, ci, h, payload.into_buf()),
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
            SubKind::IntentGet => self.on_intent_get_reply(r, h, payload.into_buf()),
            SubKind::Intent => self.on_intent_reply(r, sub, h),
            SubKind::Detach => self.on_detach_reply(r, h),
            SubKind::Changes => self.on_changes_reply(r, h),
            SubKind::ChangesGet(target) => {
                self.on_changes_get_reply(r, target, h, payload.into_buf())
            }
            SubKind::Snapshot => self.on_snapshot_reply(r, h),
            SubKind::Grow => self.on_grow_reply(r, h),
            SubKind::SnapshotList(token) => {
                self.on_snapshot_list_reply(r, token, h, payload.into_buf())
            }
        }
    }

    fn on_probe_reply(&mut self, r: ReplicaId, ci: ConnId, h: Header, payload: Option<IoBuf>) {
        let hello = match payload.as_ref().map(|b| proto::decode_hello(b.as_slice())) {
            Some(Ok(hello)) => hello,
            Some(Err(e)) => return self.protocol_error(r, None, format!("bad HELLO reply: {e}")),
            None => return self.protocol_error(r, None, "HELLO reply without payload".into()),
        };
        if let Some(b) = payload {
            lull_net::bufs::put(b);
        }
        if h.status == libc::EACCES as u32 {
            // A replica that requires TLS answers a plain HELLO this way
            // (its HELLO payload tells nothing) before it closes.
            return self.auth_failed(
                r,
                "replica refused this engine: it requires TLS (give lull serve \
                 --replica-tls-psk or --replica-tls-certs, as the replica's --tls-psk or --tls-certs)",
            );
        }
        if h.status == libc::ENOENT as u32 {
            // A store that holds no replica of the HELLO's name, or a
            // `lull replica` process asked for a named one: the address
            // answers, the replica is not there (its HELLO tells nothing).
            let why = format!(
                "HELLO refused: no such replica at {} (No such file or directory): create it on that node (replica_create) or fix the name",
                self.replicas[r].addr
            );
            return self.fail_replica(r, &why, false);
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
            if self.session_resumed {
                // This engine ran before its daemon restarted, and since
                // then another engine (the volume failed over to another
                // node) took this replica: the volume is that engine's.
                // Stand down on every replica, so none is written by two
                // engines at once (split brain), and never elect.
                self.fenced_by = Some(theirs);
                let why = format!(
                    "fenced: replica {} is owned by a newer engine session ({theirs:#x}) than this resumed one ({:#x}): \
                     the volume was taken over by another engine while this daemon was away; this engine stands down",
                    self.replicas[r].addr, self.session
                );
                self.milestone(Milestone::Fenced { session: theirs });
                let others: Vec<ReplicaId> = self.replicas.ids().filter(|&i| i != r).collect();
                for i in others {
                    self.fail_replica(i, &why, false);
                }
                return self.fail_replica(r, &why, false);
            }
            if !self.elected_once {
                self.session = theirs.saturating_add(1);
            }
            let why = format!(
                "replica is owned by a newer engine session ({theirs:#x}): another engine may be using it, or this host's clock is behind"
            );
            return self.fail_replica(r, &why, false);
        }
        if h.status != 0 {
            let errno = std::io::Error::from_raw_os_error(h.status as i32);
            return self.fail_replica(r, &format!("HELLO refused: {errno}"), false);
        }
        // The replica accepted this engine (a finished TLS handshake is not
        // enough: with TLS 1.3 a replica rejects the engine's certificate
        // only after the engine's side of the handshake is done, as an
        // alert on the first read), so the backoff starts over.
        self.replicas[r].auth_failures = 0;
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
                    .is_some_and(|p| p.flags & proto::HELLO_FLAG_CLEAN != 0)
            });
            let lost = self.replicas[r].conns.iter().any(|c| {
                c.probe
                    .is_some_and(|p| p.flags & proto::HELLO_FLAG_INTENT_LOST != 0)
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

    // ---- time --------------------------------------------------------------

    pub(super) fn on_tick(&mut self) {
        let now = self.now;
        let timeout = self.opts.replica_timeout_ms.saturating_mul(1_000_000);
        let keepalive = self.opts.keepalive_interval_ms.saturating_mul(1_000_000);
        for r in self.replicas.ids() {
            match self.replicas[r].state {
                RState::Removed => continue,
                RState::Failed => {
                    // Not while a layer sync job may still write to it
                    // (`layers`): it must not be back in use under it.
                    if now >= self.replicas[r].retry_at_ns && self.replicas[r].sync_token == 0 {
                        self.connect(r);
                    }
                    continue;
                }
                _ => {}
            }
            let mut why = None;
            for (ci, conn) in self.replicas[r].conns.iter_with_ids() {
                let limit = |s: &Sub| {
                    if matches!(s.kind, Kind::Snapshot | Kind::Grow) {
                        timeout.saturating_add(SNAPSHOT_EXTRA_TIMEOUT_NS)
                    } else {
                        timeout
                    }
                };
                if let Some((_, sub)) = conn
                    .slots
                    .iter()
                    .find(|(_, s)| now.saturating_sub(s.sent_ns) > limit(s))
                {
                    why = Some(format!(
                        "{:?} request timed out on connection {ci}",
                        sub.kind
                    ));
                    break;
                }
                // A connection answering a SNAPSHOT reads nothing else
                // until it is done: its own limit applies.
                let snapshotting = conn.slots.iter().any(|(_, s)| s.kind == Kind::Snapshot);
                if conn.state != CState::Down
                    && !snapshotting
                    && now.saturating_sub(conn.last_rx_ns) > timeout
                {
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
            for ci in self.replicas[r].conns.ids() {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::types::{EngineOptions, Event};

    fn connects(out: &mut Vec<Action>) -> Vec<ConnRef> {
        out.drain(..)
            .filter_map(|a| match a {
                Action::Connect { conn, .. } => Some(conn),
                _ => None,
            })
            .collect()
    }

    /// A replica that cannot be authenticated is retried after 2 s, 4 s,
    /// 8 s ... up to a minute; a plain connection failure keeps the fixed
    /// interval, and an authenticated connection resets the backoff.
    #[test]
    fn authentication_failures_back_off() {
        let opts = EngineOptions::default();
        let step_ns = opts.reconnect_interval_ms * 1_000_000;
        let addr = "127.0.0.1:7001".parse().unwrap();
        let mut e = Engine::new("v", 1 << 20, vec![addr], opts, 1);
        let mut out = Vec::new();
        let mut now = 0;
        e.start(now, &mut out);
        let mut waits = Vec::new();
        for _ in 0..8 {
            let conns = connects(&mut out);
            assert!(!conns.is_empty());
            let reason = "replica not authenticated: test".to_string();
            e.apply(
                Event::AuthFailed {
                    conn: conns[0],
                    reason,
                },
                now,
                &mut out,
            );
            // Tick every 100 ms until the next attempt.
            let failed_at = now;
            loop {
                now += 100_000_000;
                e.apply(Event::Tick, now, &mut out);
                if out.iter().any(|a| matches!(a, Action::Connect { .. })) {
                    break;
                }
            }
            waits.push((now - failed_at).div_ceil(step_ns));
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        // A connection that is up is not yet accepted (with TLS 1.3 the
        // replica may still reject the engine's certificate): no reset.
        let conns = connects(&mut out);
        e.apply(Event::ConnUp(conns[0]), now, &mut out);
        let r0 = ReplicaId::new(0);
        assert_eq!(e.replicas[r0].auth_failures, 8);
        // The replica answers the HELLO: accepted, the backoff starts over.
        let hello = out
            .iter()
            .find_map(|a| match a {
                Action::Send { conn, header, .. } if *conn == conns[0] => {
                    Some(proto::decode_header(header).expect("HELLO header"))
                }
                _ => None,
            })
            .expect("the engine sent HELLO");
        let me = Hello {
            volume_size: 1 << 20,
            generation: 0,
            flags: 0,
            session: 0,
        };
        let encoded = proto::encode_hello(&me);
        let mut payload = e.get_buf(encoded.len());
        payload.as_mut_slice().copy_from_slice(&encoded);
        e.apply(
            Event::Frame {
                conn: conns[0],
                header: hello.reply_with(0),
                payload: Received::Buf(payload),
            },
            now,
            &mut out,
        );
        assert_eq!(e.replicas[r0].auth_failures, 0);
        let reason = "replica not authenticated: test".to_string();
        let conn = conns[1];
        out.clear();
        e.apply(Event::AuthFailed { conn, reason }, now, &mut out);
        assert_eq!(e.replicas[r0].auth_failures, 1);
    }
}
