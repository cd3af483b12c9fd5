//! The event loop of a volume's engine thread (its state, [`Shell`], is
//! the parent module's): the pollers that collect events (each replica
//! socket, the tick; the doorbell's is in `channel`), and running the
//! core: apply an event, perform the actions, apply what they cause.
//!
//! ```ignore
//! // A poller collected an event; all of the shell runs it the same way:
//! lock(&shell).run(t, Event::Frame { conn, header, payload }, now);
//! // run: core.apply(event) -> actions; perform each (Send: the socket's
//! // queue; Complete: the channel's; Connect, Close, Log); flush the
//! // sockets written to; apply the follow-ups (a socket that broke);
//! // ring the channels that got completions; publish the status.
//! ```

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use lull_bdev::IoCompletion;
use lull_net::link as replica_link;
use lull_net::slots::SlotTable;
use lull_net::tls::TlsContext;
use lull_reactor::{PollStatus, PollerKind, Thread};

use super::channel::{Doorbell, CHANNEL_ENTRIES_MAX};
use super::socket::Sock;
use super::{lock, Shell, StatusShared, REFRESH_TOKEN_BIT, SHELL_TOKEN_BIT, TICK_US};
use crate::core::ids::ReplicaData;
use crate::core::{Action, ConnRef, Engine, Event, LogLevel};
use crate::{EngineOptions, ReplicaState};

impl Shell {
    pub(super) fn new(
        volume: &str,
        core: Engine,
        opts: EngineOptions,
        tls: Option<TlsContext>,
        doorbell: Arc<Doorbell>,
        this: Weak<Mutex<Shell>>,
        status: Arc<StatusShared>,
    ) -> Shell {
        Shell {
            volume: volume.to_string(),
            core,
            opts,
            tls,
            me: None,
            tick: None,
            doorbell,
            this,
            socks: ReplicaData::new(),
            channels: SlotTable::new(CHANNEL_ENTRIES_MAX),
            to_notify: Vec::new(),
            dirty: Vec::new(),
            actions: Vec::new(),
            followups: VecDeque::new(),
            frames: Vec::new(),
            status,
            status_dirty: true,
            snapshots_asked: false,
            all_healthy: false,
            own_tokens: 0,
            layer_jobs: Vec::new(),
        }
    }

    /// On the engine thread, once: register the tick and the doorbell,
    /// start the core (connect to every replica) and publish the status.
    pub(super) fn start(&mut self, t: &mut Thread, this: &Arc<Mutex<Shell>>) {
        self.me = Some(t.handle());
        let now = t.now_ns();
        self.register_tick(t, this, TICK_US);
        self.register_doorbell(t, this);
        let mut out = std::mem::take(&mut self.actions);
        self.core.start(now, &mut out);
        self.actions = out;
        self.run_actions(t, now);
        self.publish_status();
    }

    pub(super) fn sock(&mut self, c: ConnRef) -> Option<&mut Sock> {
        self.socks.get_mut(c.replica)?.get_mut(c.conn)?.as_mut()
    }

    /// Apply `event` (and the follow-ups it causes) to the core and perform
    /// the actions. Returns whether there was any action (work done).
    pub(super) fn run(&mut self, t: &mut Thread, event: Event, now: u64) -> bool {
        let mut acted = false;
        self.followups.push_back(event);
        while let Some(ev) = self.followups.pop_front() {
            self.core.apply(ev, now, &mut self.actions);
            acted |= !self.actions.is_empty();
            let mut actions = std::mem::take(&mut self.actions);
            for a in actions.drain(..) {
                self.perform(t, a);
            }
            self.actions = actions;
            self.flush_dirty(t);
        }
        self.ring_channels();
        if self.status_dirty {
            self.publish_status();
        }
        acted
    }

    /// Perform the actions the core has already returned (after a batch
    /// of events applied without `run`), then the follow-ups.
    pub(super) fn run_actions(&mut self, t: &mut Thread, now: u64) {
        let mut actions = std::mem::take(&mut self.actions);
        for a in actions.drain(..) {
            self.perform(t, a);
        }
        self.actions = actions;
        self.flush_dirty(t);
        let evs: Vec<Event> = self.followups.drain(..).collect();
        for ev in evs {
            self.run(t, ev, now);
        }
        self.ring_channels();
    }

    fn perform(&mut self, t: &mut Thread, a: Action) {
        match a {
            Action::Send {
                conn,
                header,
                payload,
            } => {
                let Some(sock) = self.sock(conn) else { return };
                sock.send(&header, payload);
                if !self.dirty.contains(&conn) {
                    self.dirty.push(conn);
                }
            }
            Action::Complete {
                channel,
                tag,
                result,
                buf,
                spliced,
            } => self.complete(
                channel,
                IoCompletion {
                    tag,
                    result,
                    buf,
                    data: spliced.map_or(lull_bdev::Data::Buf, |p| {
                        lull_bdev::Data::Spliced(lull_bdev::Spliced::Pipe(p))
                    }),
                },
            ),
            Action::Connect { conn, addr } => self.connect(conn, addr),
            Action::SyncLayers {
                replica,
                token,
                source,
                target,
                session,
            } => self.sync_layers(replica, token, source, target, session),
            Action::StopLayerSync { token } => self.stop_layer_sync(token),
            Action::Close { conn } => self.close(t, conn),
            Action::Log { level, msg } => {
                self.status_dirty = true;
                match level {
                    LogLevel::Info => tracing::info!("{msg}"),
                    LogLevel::Warn => tracing::warn!("{msg}"),
                    LogLevel::Error => tracing::error!("{msg}"),
                }
            }
            // The log line emitted with it says the same; milestones are
            // for the simulation's checks.
            Action::Milestone(_) => {}
            Action::ControlDone { token, outcome } => {
                if let crate::core::ControlOutcome::SnapshotLists(Ok(lists)) = &outcome {
                    self.status.set_snapshots(lists);
                }
                if token & REFRESH_TOKEN_BIT != 0 {
                    match &outcome {
                        crate::core::ControlOutcome::SnapshotLists(Err(why)) => {
                            tracing::warn!(volume = %self.volume, reason = %why,
                                "cannot refresh the names of the volume's snapshots");
                        }
                        // A reconcile deleted a partial snapshot: look again
                        // (there may be more; the names change too).
                        crate::core::ControlOutcome::Snapshot(Ok(())) => {
                            let token = self.own_token();
                            self.followups
                                .push_back(Event::ReconcileSnapshots { token });
                        }
                        crate::core::ControlOutcome::Snapshot(Err(why)) => {
                            tracing::warn!(volume = %self.volume, reason = %why,
                                "a snapshot on some replicas only was not deleted; delete it with snapshot_delete");
                        }
                        crate::core::ControlOutcome::SnapshotLists(Ok(_))
                        | crate::core::ControlOutcome::Grow(_) => {}
                    }
                    return;
                }
                // The outcomes' lock, then the abandoned set's: the order
                // the waiting caller takes them in (`wait_control`), so a
                // caller giving up and its outcome arriving cannot cross.
                let mut done = self
                    .status
                    .control
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                let abandoned = self
                    .status
                    .control_abandoned
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&token);
                if abandoned {
                    drop(done);
                    tracing::warn!(
                        token,
                        ?outcome,
                        "a control request ended after its caller gave up waiting"
                    );
                    return;
                }
                done.insert(token, outcome);
                drop(done);
                self.status.control_done.notify_all();
            }
        }
    }

    /// (Re)register the tick poller with period `period_us`.
    pub(super) fn register_tick(
        &mut self,
        t: &mut Thread,
        this: &Arc<Mutex<Shell>>,
        period_us: u64,
    ) {
        if let Some(old) = self.tick.take() {
            t.unregister_poller(old);
        }
        let tick_shell = this.clone();
        match t.register_poller(
            "engine-tick",
            PollerKind::every_us(period_us),
            &[],
            Box::new(move |t, now| lock(&tick_shell).on_tick(t, now)),
        ) {
            Ok(id) => self.tick = Some(id),
            Err(e) => {
                tracing::error!(volume = %self.volume, error = %e, "cannot register the engine tick")
            }
        }
    }

    fn flush_dirty(&mut self, t: &mut Thread) {
        let dirty = std::mem::take(&mut self.dirty);
        for conn in &dirty {
            self.flush_sock(t, *conn);
        }
        self.dirty = dirty;
        self.dirty.clear();
    }

    fn flush_sock(&mut self, t: &mut Thread, conn: ConnRef) -> bool {
        let Some(sock) = self.sock(conn) else {
            return false;
        };
        match sock.flush(t) {
            Ok(p) => p,
            Err(reason) => {
                let event = self.down_event(conn, reason);
                self.followups.push_back(event);
                true
            }
        }
    }

    /// The event of a connection that failed for `reason`: an
    /// authentication failure when the replica refused our TLS
    /// credentials (an alert), else a plain disconnection.
    fn down_event(&mut self, conn: ConnRef, reason: String) -> Event {
        match self.sock(conn) {
            Some(sock) if sock.tls_refused(&reason) => Event::AuthFailed {
                conn,
                reason: format!(
                    "replica not authenticated: {reason} ({})",
                    replica_link::handshake_hint(&reason)
                ),
            },
            _ => Event::ConnDown { conn, reason },
        }
    }

    /// A replica socket's poller: read its frames and run each as an
    /// `Event::Frame` (a spliced payload's pipe in it), then flush.
    pub(super) fn on_socket(&mut self, t: &mut Thread, conn: ConnRef, now: u64) -> PollStatus {
        let mut frames = std::mem::take(&mut self.frames);
        let (r, c) = (conn.replica, conn.conn);
        let read = match self
            .socks
            .get_mut(r)
            .and_then(|v| v.get_mut(c))
            .and_then(Option::as_mut)
        {
            Some(sock) => sock.read_frames(&mut self.core, conn, &mut frames),
            None => return PollStatus::Idle,
        };
        let mut busy = !frames.is_empty();
        for (header, payload) in frames.drain(..) {
            self.run(
                t,
                Event::Frame {
                    conn,
                    header,
                    payload,
                },
                now,
            );
        }
        self.frames = frames;
        match read {
            Ok(p) => busy |= p,
            Err(reason) => {
                let event = self.down_event(conn, reason);
                self.run(t, event, now);
                return PollStatus::Busy;
            }
        }
        // Plaintext a TLS session decrypted and the read budget left: no
        // socket event will announce it, so come back by ourselves.
        if let Some(sock) = self.sock(conn) {
            if sock.wire.stream.pending() > 0 {
                let poller = sock.poller;
                t.wake_poller(poller);
            }
        }
        if self.flush_sock(t, conn) {
            busy = true;
            let evs: Vec<Event> = self.followups.drain(..).collect();
            for ev in evs {
                self.run(t, ev, now);
            }
        }
        if busy {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }

    /// Busy when the tick made the core act (a keep-alive ping, a
    /// timeout, a reconnect, an intent CLEAR), Idle when it only looked.
    fn on_tick(&mut self, t: &mut Thread, now: u64) -> PollStatus {
        let acted = self.run(t, Event::Tick, now);
        self.reclaim_channels();
        self.publish_status();
        let all_healthy = self.core.all_healthy();
        if all_healthy && !self.all_healthy {
            // A replica rebuilt (or the volume started whole): a snapshot
            // a crash left on some replicas only can go now.
            self.snapshots_asked = true;
            let token = self.own_token();
            self.run(t, Event::ReconcileSnapshots { token }, now);
        }
        self.all_healthy = all_healthy;
        if !self.snapshots_asked && self.core.elected_once() {
            // The names the volume's snapshots are served under, known
            // before a client asks for one (`ReplicatedDev::snapshot_view`);
            // and a snapshot a crash left on some replicas only goes.
            self.snapshots_asked = true;
            let token = self.own_token();
            self.run(t, Event::ReconcileSnapshots { token }, now);
        }
        if acted {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }

    /// A token for a list or reconcile the shell asks for itself.
    fn own_token(&mut self) -> u64 {
        self.own_tokens += 1;
        REFRESH_TOKEN_BIT | SHELL_TOKEN_BIT | self.own_tokens
    }

    fn publish_status(&mut self) {
        self.status_dirty = false;
        let detached = self.core.detached();
        let mut guard = self
            .status
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        self.core.status_into(&mut guard);
        let ready = guard.iter().any(|s| s.state == ReplicaState::Healthy);
        self.status.detached.store(detached, Ordering::Release);
        let session = self.core.final_session().unwrap_or(0);
        let fenced = self.core.fenced_by().unwrap_or(0);
        self.status.session.store(session, Ordering::Release);
        self.status.fenced_by.store(fenced, Ordering::Release);
        drop(guard);
        if ready || detached || session != 0 || fenced != 0 {
            self.status.ready.notify_all();
        }
    }

    /// Unregister every socket's poller and end the thread.
    pub(super) fn shutdown(&mut self, t: &mut Thread) {
        for conns in &mut self.socks {
            for sock in conns.iter_mut().filter_map(Option::take) {
                t.unregister_poller(sock.poller);
            }
        }
        t.exit();
    }
}
