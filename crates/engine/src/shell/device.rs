//! The replicated device, [`ReplicatedDev`]: the `BlockDevice` a volume
//! holds, which starts the engine's thread and is its control path (status,
//! readiness, adding and removing replicas, the clean detach, channels);
//! and the set-up of replica links: a short-lived connect thread per
//! attempt (TCP connect, TLS client handshake) that hands the stream to
//! the engine thread, where it becomes a socket with its poller.
//!
//! ```ignore
//! let dev = ReplicatedDev::start(fw.handle(), 0, "vol0", addrs, size, EngineOptions::default(), tls)?;
//! dev.wait_ready(Duration::from_secs(10));    // main thread only
//! dev.add_replica(target)?;                   // an Event for the core
//! let ch = dev.open_channel()?;               // channel.rs
//! dev.detach(Duration::from_secs(30))?;       // at `lull serve`'s stop
//! ```

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use lull_bdev::{BdevError, BlockDevice, Channel};
use lull_net::link::{self as replica_link, LinkStream};
use lull_net::tls::TlsContext;
use lull_net::wire::Wire;
use lull_reactor::{FrameworkHandle, PollerKind, Thread, ThreadHandle};

use super::channel::{Doorbell, EngineChannel};
use super::socket::{Sock, READ_BUFFER_BYTES};
use super::{lock, Shell, StatusShared, TICK_US};
use crate::core::ids::{ConnData, ReplicaTarget};
use crate::core::{ConnRef, ControlOutcome, Engine, Event, NodeRebuildLimit, MAX_CHANNELS};
use crate::{EngineError, EngineOptions, ReplicaState, ReplicaStatus};

/// A connect attempt gives up after this long (or the replica timeout, if
/// shorter): it runs on its own short-lived OS thread.
const CONNECT_TIMEOUT_MS_MAX: u64 = 10_000;

/// How long [`BlockDevice::grow`] of a replicated volume waits for its
/// outcome: the engine fails a replica whose GROW takes longer than its
/// replica timeout plus `SNAPSHOT_EXTRA_TIMEOUT_NS` (20 s: a chain's
/// quiesce, then fsyncs of its records), so with the default timeouts
/// the answer comes well within it (as for snapshots, 60 s).
pub const GROW_TIMEOUT: Duration = Duration::from_secs(60);

/// A session for this engine: the wall clock in nanoseconds, so that a
/// later engine has a larger session and the replicas refuse the frames of
/// an earlier one (see `lull_proto::replica`). Two engines started within
/// the same nanosecond, or a clock behind the last engine's, are handled by
/// the core (it takes a session past the replica's owner before the first
/// election).
fn new_session() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    u64::try_from(t).unwrap_or(u64::MAX).max(1)
}

/// What [`ReplicatedDev::wait_session`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionOutcome {
    /// The session is final: the engine was elected.
    Final(u64),
    /// A resumed engine met a replica owned by this newer session: the
    /// volume is another engine's now, and this one stands down.
    Fenced(u64),
    /// The engine thread ended first.
    Ended,
    TimedOut,
}

/// How often [`ReplicatedDev::wait_session`] looks whether the engine
/// thread exited (an exit is not a status change that wakes it): a wait
/// with no deadline ends at most this long after the thread.
const SESSION_EXIT_CHECK: Duration = Duration::from_secs(1);

/// A replicated volume: a `BlockDevice` whose I/O goes to replica servers.
pub struct ReplicatedDev {
    volume: String,
    /// The volume's size: the core's, raised once a grow is done on the
    /// replicas (`core::grow`).
    size_bytes: AtomicU64,
    replicas_desc: String,
    /// The replicas as the operator configured them, changed by
    /// `add_replica`/`remove_replica` as the core will (a node records
    /// them; the core's own view is `replica_status`).
    targets: Mutex<Vec<ReplicaTarget>>,
    engine: ThreadHandle,
    doorbell: Arc<Doorbell>,
    shell: Arc<Mutex<Shell>>,
    status: Arc<StatusShared>,
    open_channels: Arc<AtomicUsize>,
    /// The rebuild bandwidth limit last set (bytes per second, 0: none),
    /// as the core has it once the event arrived.
    rebuild_limit: std::sync::atomic::AtomicU64,
    /// Tokens of control requests (snapshots), so each caller finds its
    /// own outcome.
    control_tokens: std::sync::atomic::AtomicU64,
    /// What a snapshot's view connects with: the links' credentials and
    /// the replica timeout.
    tls: Option<TlsContext>,
    view_timeout: Duration,
}

impl std::fmt::Debug for ReplicatedDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReplicatedDev({}, {})", self.volume, self.replicas_desc)
    }
}

impl ReplicatedDev {
    /// Start the engine of `volume` on a new lull thread on `reactor`. Does
    /// not block: connections are made in the background; see `wait_ready`.
    pub fn start(
        fw: &FrameworkHandle,
        reactor: usize,
        volume: &str,
        replicas: Vec<ReplicaTarget>,
        size_bytes: u64,
        opts: EngineOptions,
        tls: Option<TlsContext>,
    ) -> Result<Arc<ReplicatedDev>, EngineError> {
        Self::start_with(fw, reactor, volume, replicas, size_bytes, opts, tls, None)
    }

    /// As [`Self::start`], and with `resume` the session this volume's
    /// engine had before its daemon restarted (what [`Self::final_session`]
    /// said then): the engine takes its replicas back only if no other
    /// engine took them over meanwhile, and otherwise stands down
    /// ([`Self::wait_session`] says `Fenced`).
    #[allow(clippy::too_many_arguments)]
    pub fn start_with(
        fw: &FrameworkHandle,
        reactor: usize,
        volume: &str,
        replicas: Vec<ReplicaTarget>,
        size_bytes: u64,
        opts: EngineOptions,
        tls: Option<TlsContext>,
        resume: Option<u64>,
    ) -> Result<Arc<ReplicatedDev>, EngineError> {
        opts.validate()?;
        if replicas.is_empty() || replicas.len() > crate::core::MAX_REPLICAS {
            return Err(EngineError::ReplicaCount {
                got: replicas.len(),
            });
        }
        if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
            return Err(EngineError::BadSize(size_bytes));
        }
        let replicas_desc = replicas
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join("+");
        let status = Arc::new(StatusShared {
            snapshot: Mutex::new(Vec::new()),
            detached: AtomicBool::new(false),
            control: Mutex::new(std::collections::HashMap::new()),
            control_done: Condvar::new(),
            control_abandoned: Mutex::new(std::collections::HashSet::new()),
            snapshots: Mutex::new(None),
            ready: Condvar::new(),
            session: AtomicU64::new(0),
            fenced_by: AtomicU64::new(0),
        });
        let doorbell = Arc::new(Doorbell::new());
        let shell = Arc::new_cyclic(|weak| {
            let mut core = Engine::new(
                volume,
                size_bytes,
                replicas.clone(),
                opts.clone(),
                resume.unwrap_or_else(new_session),
            );
            if resume.is_some() {
                core.resume_session();
            }
            Mutex::new(Shell::new(
                volume,
                core,
                opts.clone(),
                tls.clone(),
                doorbell.clone(),
                weak.clone(),
                status.clone(),
            ))
        });
        let init_shell = shell.clone();
        let engine = fw.spawn_thread(
            reactor,
            &format!("engine-{volume}"),
            move |t: &mut Thread| lock(&init_shell).start(t, &init_shell),
        )?;
        Ok(Arc::new(ReplicatedDev {
            volume: volume.to_string(),
            size_bytes: AtomicU64::new(size_bytes),
            replicas_desc,
            targets: Mutex::new(replicas),
            rebuild_limit: std::sync::atomic::AtomicU64::new(0),
            control_tokens: std::sync::atomic::AtomicU64::new(1),
            tls,
            view_timeout: Duration::from_millis(opts.replica_timeout_ms),
            engine,
            doorbell,
            shell,
            status,
            open_channels: Arc::new(AtomicUsize::new(0)),
        }))
    }

    /// Wait until at least one replica is healthy. For the main thread
    /// (start-up, tools), never for a reactor.
    /// The session this engine's writes carry, once final (after its
    /// first election): what a node records to resume the engine after a
    /// restart ([`Self::start_with`]).
    pub fn final_session(&self) -> Option<u64> {
        match self.status.session.load(Ordering::Acquire) {
            0 => None,
            s => Some(s),
        }
    }

    /// Blocks until the engine's session is final (its first election),
    /// a resumed engine was fenced by a newer one, the engine thread
    /// exited, or `timeout` passed.
    pub fn wait_session(&self, timeout: Option<Duration>) -> SessionOutcome {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        let mut snap = self
            .status
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(s) = self.fenced_by() {
                return SessionOutcome::Fenced(s);
            }
            if let Some(s) = self.final_session() {
                return SessionOutcome::Final(s);
            }
            if self.engine.has_exited() {
                return SessionOutcome::Ended;
            }
            // Woken at every published status change; the thread's exit
            // publishes none, so it is looked at every second too.
            let now = std::time::Instant::now();
            let wait = match deadline {
                Some(d) if now >= d => return SessionOutcome::TimedOut,
                Some(d) => (d - now).min(SESSION_EXIT_CHECK),
                None => SESSION_EXIT_CHECK,
            };
            snap = match self.status.ready.wait_timeout(snap, wait) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }

    /// The newer session that fenced this resumed engine, if one did
    /// (it stands down for good: [`Self::wait_session`]).
    pub fn fenced_by(&self) -> Option<u64> {
        match self.status.fenced_by.load(Ordering::Acquire) {
            0 => None,
            s => Some(s),
        }
    }

    /// Whether a replica became healthy within `timeout`; false at once
    /// for a resumed engine that was fenced (none ever will).
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        self.wait_status(timeout, false, |snap| {
            snap.iter().any(|s| s.state == ReplicaState::Healthy) || self.fenced_by().is_some()
        }) && self.fenced_by().is_none()
    }

    /// Block until `done` holds of the replicas' states (it is asked again
    /// at each change of them, `status.ready`) or `timeout` passes, or
    /// with `exit_ends` the engine thread has exited: whether it held.
    fn wait_status(
        &self,
        timeout: Duration,
        exit_ends: bool,
        done: impl Fn(&[ReplicaStatus]) -> bool,
    ) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut snap = self
            .status
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if done(&snap) {
                return true;
            }
            let now = std::time::Instant::now();
            if now >= deadline || (exit_ends && self.engine.has_exited()) {
                return false;
            }
            snap = match self.status.ready.wait_timeout(snap, deadline - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }

    /// Detach cleanly (for `lull serve`'s stop, after the frontends have
    /// drained): new requests are refused, those in flight finish, every
    /// healthy replica is flushed and marked clean, so the next start trusts
    /// them as identical without reconciling. Blocks the calling thread
    /// (never a reactor) up to `timeout`; false if it did not finish (the
    /// replicas then stay dirty and the next start reconciles them).
    pub fn detach(&self, timeout: Duration) -> Result<bool, EngineError> {
        self.event(Event::Detach)?;
        Ok(self.wait_status(timeout, true, |_| {
            self.status.detached.load(Ordering::Acquire)
        }))
    }

    /// Runs snapshot operation `op` on `name` on every healthy replica
    /// (the engine holds new writes until all have answered; see
    /// `core::snapshot`). Blocks the calling thread (never a reactor) up
    /// to `timeout`. `Err` says why, in words.
    pub fn snapshot(
        &self,
        op: lull_proto::replica::SnapshotOp,
        name: &str,
        timeout: Duration,
    ) -> Result<(), String> {
        retry_passing(|| {
            let token = self.next_token();
            self.event(Event::Snapshot {
                token,
                op,
                name: name.to_string(),
            })
            .map_err(|e| e.to_string())?;
            let outcome = self.wait_control(token, timeout);
            // Whatever the outcome (a failed create may have landed on
            // some replicas), the names served change only with the lists.
            self.refresh_snapshots();
            match outcome? {
                ControlOutcome::Snapshot(r) => r,
                other => Err(format!("unexpected answer {other:?}")),
            }
        })
    }

    /// Asks the replicas for their snapshots in the background, to update
    /// the names the volume serves snapshots under.
    fn refresh_snapshots(&self) {
        let token = super::REFRESH_TOKEN_BIT | self.next_token();
        if let Err(e) = self.event(Event::SnapshotList { token }) {
            tracing::warn!(volume = %self.volume, error = %e, "cannot refresh the snapshot names");
        }
    }

    /// Every healthy replica's snapshots (oldest first), or why not.
    pub fn snapshot_lists(
        &self,
        timeout: Duration,
    ) -> Result<Vec<crate::core::ReplicaSnapshots>, String> {
        let token = self.next_token();
        self.event(Event::SnapshotList { token })
            .map_err(|e| e.to_string())?;
        match self.wait_control(token, timeout)? {
            ControlOutcome::SnapshotLists(r) => r,
            other => Err(format!("unexpected answer {other:?}")),
        }
    }

    fn next_token(&self) -> u64 {
        self.control_tokens.fetch_add(1, Ordering::Relaxed)
    }

    /// Waits for the outcome of control request `token`.
    fn wait_control(&self, token: u64, timeout: Duration) -> Result<ControlOutcome, String> {
        let deadline = std::time::Instant::now() + timeout;
        let mut done = self
            .status
            .control
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(outcome) = done.remove(&token) {
                return Ok(outcome);
            }
            let now = std::time::Instant::now();
            if now >= deadline {
                self.status
                    .control_abandoned
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(token);
                return Err(format!(
                    "no answer within {timeout:?} (the operation may still finish)"
                ));
            }
            if self.engine.has_exited() {
                return Err("the engine has stopped".into());
            }
            done = match self
                .status
                .control_done
                .wait_timeout(done, (deadline - now).min(Duration::from_millis(100)))
            {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }

    /// The replicas as of the engine's last tick (at most 100 ms old) or
    /// state change. Readable from any thread.
    pub fn replica_status(&self) -> Vec<ReplicaStatus> {
        self.status
            .snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Send keep-alives on idle replica connections every `period_us`
    /// (hybrid mode uses Longhorn's `nvme_adminq_poll_period_us`, 10 ms by
    /// default; the other modes the engine's `keepalive_interval_ms`). The
    /// engine's tick runs at least that often.
    pub fn set_keepalive_period_us(&self, period_us: u64) -> Result<(), EngineError> {
        let shell = self.shell.clone();
        self.engine
            .send(move |t| {
                let mut sh = lock(&shell);
                sh.core.set_keepalive_interval_ms(period_us.div_ceil(1000));
                sh.register_tick(t, &shell, period_us.clamp(1, TICK_US));
            })
            .map_err(|_| EngineError::Stopped)
    }

    /// Add a replica (it is rebuilt, then joins the healthy set).
    pub fn add_replica(&self, addr: ReplicaTarget) -> Result<(), EngineError> {
        {
            let mut targets = self.targets.lock().unwrap_or_else(|e| e.into_inner());
            if !targets.contains(&addr) && targets.len() < crate::core::MAX_REPLICAS {
                targets.push(addr.clone());
            }
        }
        self.event(Event::AddReplica(addr))
    }

    /// Remove a replica from the volume (its connections close now).
    pub fn remove_replica(&self, addr: ReplicaTarget) -> Result<(), EngineError> {
        self.targets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|t| *t != addr);
        self.event(Event::RemoveReplica(addr))
    }

    /// Limits the volume's rebuild and reconcile copies to `bytes_per_sec`
    /// data bytes per second (0: no limit), from the next segment on.
    pub fn set_rebuild_limit(&self, bytes_per_sec: u64) -> Result<(), EngineError> {
        self.event(Event::SetRebuildLimit(bytes_per_sec))?;
        self.rebuild_limit
            .store(bytes_per_sec, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Takes this volume's rebuild and reconcile copies from the node's
    /// total too (one budget shared by every volume of the process).
    pub fn set_node_rebuild_limit(&self, node: NodeRebuildLimit) -> Result<(), EngineError> {
        self.event(Event::SetNodeRebuildLimit(node))
    }

    /// The rebuild bandwidth limit (bytes per second, 0: none).
    pub fn rebuild_limit(&self) -> u64 {
        self.rebuild_limit
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The replicas configured now (the volume's `replicas=`, with those
    /// added and removed since).
    pub fn replica_targets(&self) -> Vec<ReplicaTarget> {
        self.targets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Makes on each replica's store a clone of snapshot `snapshot` of that
    /// replica (CLONE on a view, replica protocol version 7), named
    /// `names(i, replica)`: the replicas of a new volume whose base is the
    /// snapshot, shared, not copied. Blocking (a connection per replica
    /// and the stores' file creation): an RPC thread, never a reactor.
    /// Every replica must hold the snapshot; a CLONE already made is
    /// answered as made, so a call cut halfway can be made again.
    pub fn clone_replicas(
        &self,
        snapshot: &str,
        names: impl Fn(usize, &ReplicaTarget) -> String,
    ) -> Result<Vec<ReplicaTarget>, String> {
        let timeout =
            self.view_timeout + Duration::from_nanos(crate::core::SNAPSHOT_EXTRA_TIMEOUT_NS);
        let hello = lull_proto::replica::Hello {
            volume_size: self.size_bytes.load(Ordering::Acquire),
            generation: 0,
            flags: 0,
            session: 0,
        };
        let mut made = Vec::new();
        for (i, t) in self.replica_targets().iter().enumerate() {
            let Some(origin) = t.name.as_deref() else {
                return Err(format!(
                    "replica {t} is a lull replica process: clones are made by a node's replica store (lull serve --store)"
                ));
            };
            let name = names(i, t);
            let failed = |why: String| {
                let done: Vec<String> =
                    made.iter().map(|m: &ReplicaTarget| m.to_string()).collect();
                format!(
                    "cloning {origin}@{snapshot} on {} as {name:?}: {why} (made before it: {done:?}; volume_clone again completes them, replica_delete on their stores removes them)",
                    t.addr
                )
            };
            let view = lull_proto::replica::view_hello_name(origin, snapshot);
            let mut c =
                crate::client::Client::connect(t.addr, self.tls.as_ref(), timeout, &hello, &view)
                    .map_err(|e| failed(e.to_string()))?;
            let payload = lull_proto::replica::encode_clone_request(&name)
                .map_err(|e| failed(e.to_string()))?;
            let (reply, _) = c
                .request(
                    lull_proto::replica::Kind::Clone,
                    0,
                    payload.len() as u32,
                    &payload,
                )
                .map_err(failed)?;
            if reply.status != 0 {
                return Err(failed(
                    std::io::Error::from_raw_os_error(reply.status as i32).to_string(),
                ));
            }
            made.push(ReplicaTarget {
                addr: t.addr,
                name: Some(Arc::from(name.as_str())),
            });
        }
        Ok(made)
    }

    fn event(&self, ev: Event) -> Result<(), EngineError> {
        let shell = self.shell.clone();
        self.engine
            .send(move |t| {
                let now = t.now_ns();
                lock(&shell).run(t, ev, now);
            })
            .map_err(|_| EngineError::Stopped)
    }

    pub fn volume(&self) -> &str {
        &self.volume
    }
}

impl BlockDevice for ReplicatedDev {
    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// Grows every replica, then the volume (`core::grow`): writes wait
    /// meanwhile, reads go on. Refused unless every replica is healthy.
    /// Blocks the calling thread (never a reactor) up to
    /// [`GROW_TIMEOUT`].
    fn grow(&self, size_bytes: u64) -> Result<(), BdevError> {
        lull_bdev::check_grow(
            self.size_bytes(),
            size_bytes,
            lull_proto::replica::MAX_GROW_BYTES,
        )?;
        if size_bytes == self.size_bytes() {
            return Ok(());
        }
        let size = retry_passing(|| {
            let token = self.next_token();
            self.event(Event::Grow { token, size_bytes })
                .map_err(|e| e.to_string())?;
            match self.wait_control(token, GROW_TIMEOUT)? {
                ControlOutcome::Grow(r) => r,
                other => Err(format!("unexpected answer {other:?}")),
            }
        })
        .map_err(BdevError::Failed)?;
        self.size_bytes.fetch_max(size, Ordering::AcqRel);
        Ok(())
    }

    fn describe(&self) -> String {
        format!("replicas={}", self.replicas_desc)
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        if self.engine.has_exited() {
            return Err(BdevError::Failed("volume engine stopped".into()));
        }
        let n = self.open_channels.fetch_add(1, Ordering::AcqRel);
        if n >= MAX_CHANNELS {
            self.open_channels.fetch_sub(1, Ordering::AcqRel);
            return Err(BdevError::Full {
                capacity: MAX_CHANNELS,
            });
        }
        let channel = EngineChannel::new(
            self.engine.clone(),
            self.doorbell.clone(),
            self.shell.clone(),
            self.open_channels.clone(),
        );
        match channel {
            Ok(ch) => Ok(Box::new(ch)),
            Err(e) => {
                self.open_channels.fetch_sub(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// Block status is a BLOCK_STATUS request to one healthy replica, sent
    /// like a read (`IoOp::BlockStatus` on a channel); `extents` keeps the
    /// default "all data", which is true but tells a client nothing.
    fn extents_by_channel(&self) -> bool {
        true
    }

    /// Acknowledged FLUSHes are durable on every healthy replica already;
    /// each replica also syncs on its own clean shutdown. At process exit
    /// the reactors (and this engine's thread) are gone, so there is nothing
    /// left to send.
    fn sync(&self) -> Result<(), BdevError> {
        Ok(())
    }

    /// "Changed since" a snapshot is a CHANGED request to one healthy
    /// replica, sent like a block status (`IoOp::ChangedSince`).
    fn changed_by_channel(&self) -> bool {
        true
    }

    /// Whether a replica held `name` at the last list: `lull:changed:NAME`
    /// on the live volume may be selected (a replica that lacks it
    /// answers the request `ENOENT`, which the client sees).
    fn has_snapshot(&self, name: &str) -> bool {
        self.snapshot_names().iter().any(|n| n == name)
    }

    /// The snapshots some replica held at the last list: asked for once
    /// the volume first had a healthy replica, and after every snapshot
    /// operation.
    fn snapshot_names(&self) -> Vec<String> {
        self.status
            .snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_default()
    }

    /// A read-only view reading from a replica that holds the snapshot
    /// (`crate::view`): no I/O here, its channels connect.
    fn snapshot_view(&self, name: &str) -> Option<Arc<dyn BlockDevice>> {
        let names = self.snapshot_names();
        if !names.iter().any(|n| n == name) {
            return None;
        }
        // Those the engine last saw healthy first: they hold every
        // snapshot taken while they were.
        let mut status = self.replica_status();
        status.sort_by_key(|r| r.state != ReplicaState::Healthy);
        let mut targets: Vec<ReplicaTarget> = status.into_iter().map(|r| r.addr).collect();
        for t in self.replica_targets() {
            if !targets.contains(&t) {
                targets.push(t);
            }
        }
        let older = names.iter().take_while(|n| *n != name).cloned().collect();
        Some(Arc::new(crate::view::ReplicatedSnapshotView::new(
            crate::view::ViewConfig {
                volume: self.volume.clone(),
                snapshot: name.to_string(),
                size_bytes: self.size_bytes(),
                targets,
                older,
                tls: self.tls.clone(),
                timeout: self.view_timeout,
            },
        )))
    }
}

impl Drop for ReplicatedDev {
    fn drop(&mut self) {
        let shell = self.shell.clone();
        let _ = self.engine.send(move |t| lock(&shell).shutdown(t));
    }
}

/// How long a control operation (a snapshot operation, a grow) that the
/// core refused for a passing state is asked again, by the RPC thread
/// that waits for it: a new generation being stored after the healthy
/// set changed (a replica round trip or two), a grow or a snapshot
/// operation running. The core says so with "try again" at the end of
/// its refusal.
pub const CONTROL_RETRY_WINDOW: Duration = Duration::from_secs(5);

/// Pause between two asks within [`CONTROL_RETRY_WINDOW`].
const CONTROL_RETRY_PAUSE: Duration = Duration::from_millis(20);

/// `op`, asked again while it is refused for a passing state (see
/// [`CONTROL_RETRY_WINDOW`]); its last answer.
fn retry_passing<T>(mut op: impl FnMut() -> Result<T, String>) -> Result<T, String> {
    let deadline = std::time::Instant::now() + CONTROL_RETRY_WINDOW;
    loop {
        match op() {
            Err(why) if why.ends_with("try again") && std::time::Instant::now() < deadline => {
                std::thread::sleep(CONTROL_RETRY_PAUSE);
            }
            done => return done,
        }
    }
}

// ---- replica links ----------------------------------------------------------

/// Why a replica link could not be made; each carries the reason the
/// core logs.
enum LinkError {
    /// No connection (refused, unreachable, timed out).
    Connect(String),
    /// Connected, but the TLS handshake failed: the replica could not be
    /// authenticated or refused this engine's credentials.
    Auth(String),
}

/// Connect to a replica (blocking, on a connect helper thread) and, with
/// credentials, authenticate before any frame: the whole of it within
/// `timeout`.
fn connect_link(
    addr: SocketAddr,
    timeout: Duration,
    tls: Option<&TlsContext>,
) -> Result<LinkStream, LinkError> {
    let deadline = std::time::Instant::now() + timeout;
    let tcp = TcpStream::connect_timeout(&addr, timeout)
        .and_then(|s| {
            s.set_nodelay(true)?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .map_err(|e| LinkError::Connect(format!("connect failed: {e}")))?;
    let Some(ctx) = tls else {
        return Ok(LinkStream::Plain(tcp));
    };
    match replica_link::client_handshake(ctx, tcp, addr.ip(), deadline) {
        Ok(s) => Ok(LinkStream::Tls(Box::new(s))),
        Err(e) => {
            let hint = replica_link::handshake_hint(&e.to_string());
            Err(LinkError::Auth(format!(
                "replica not authenticated: {e} ({hint})"
            )))
        }
    }
}

impl Shell {
    /// std has no non-blocking connect (and socket2 is not a dependency), so
    /// a short-lived OS thread does the blocking `connect_timeout` (and, with
    /// credentials, the TLS handshake, blocking too, within the same
    /// timeout) and hands the stream to the engine thread as a message. A
    /// replica that cannot be authenticated is a failed connection like a
    /// refused one: the core fails the replica and retries it every
    /// `reconnect_interval_ms`, one log line each time. At most one attempt per
    /// connection is outstanding (the core issues a new one only after this
    /// one is resolved or abandoned, and the timeout bounds it).
    pub(super) fn connect(&mut self, conn: ConnRef, target: ReplicaTarget) {
        let (Some(me), Some(shell)) = (self.me.clone(), self.this.upgrade()) else {
            return;
        };
        let timeout =
            Duration::from_millis(self.opts.replica_timeout_ms.min(CONNECT_TIMEOUT_MS_MAX));
        let tls = self.tls.clone();
        let spawned = std::thread::Builder::new()
            .name("lull-connect".into())
            .spawn(move || {
                let result = connect_link(target.addr, timeout, tls.as_ref());
                let _ = me.send(move |t| {
                    let now = t.now_ns();
                    lock(&shell).on_connected(t, conn, result, now);
                });
            });
        if let Err(e) = spawned {
            self.followups.push_back(Event::ConnDown {
                conn,
                reason: format!("cannot start a connect thread: {e}"),
            });
        }
    }

    /// On the engine thread, a connect attempt's result: a link becomes a
    /// socket with its poller (`Event::ConnUp`), a failure an event for
    /// the core.
    fn on_connected(
        &mut self,
        t: &mut Thread,
        conn: ConnRef,
        result: Result<LinkStream, LinkError>,
        now: u64,
    ) {
        if !self.core.conn_connecting(conn) {
            return; // an attempt the engine gave up on; the stream drops here
        }
        let stream = match result {
            Ok(s) => s,
            Err(LinkError::Connect(reason)) => {
                self.run(t, Event::ConnDown { conn, reason }, now);
                return;
            }
            Err(LinkError::Auth(reason)) => {
                self.run(t, Event::AuthFailed { conn, reason }, now);
                return;
            }
        };
        let Some(shell) = self.this.upgrade() else {
            return;
        };
        let Some(tcp) = stream.tcp() else {
            return; // never: a connected link has its socket
        };
        let fd = tcp.as_raw_fd();
        let name = format!("{}-r{}c{}", self.volume, conn.replica, conn.conn);
        let peer = tcp
            .peer_addr()
            .map_or_else(|_| "-".to_string(), |a| a.to_string());
        let plain = !stream.is_tls();
        let mut wire = Wire::new(stream, fd, READ_BUFFER_BYTES, "replica client", peer);
        wire.set_context(&name);
        if plain {
            // READ replies may be spliced from the socket (`Recv::Spliced`).
            wire.allow_splice();
        }
        let poller = t.register_poller(
            &name,
            PollerKind::Active,
            &[(fd, wire.interest())],
            Box::new(move |t, now| lock(&shell).on_socket(t, conn, now)),
        );
        let poller = match poller {
            Ok(p) => p,
            Err(e) => {
                self.run(
                    t,
                    Event::ConnDown {
                        conn,
                        reason: format!("cannot poll the socket: {e}"),
                    },
                    now,
                );
                return;
            }
        };
        // The initiator side: in hybrid mode drained every
        // nvme_ioq_poll_period_us instead of woken by the socket.
        if let Err(e) = t.mark_initiator(poller) {
            tracing::warn!(volume = %self.volume, error = %e, "cannot mark a replica connection as initiator");
        }
        let (r, c) = (conn.replica, conn.conn);
        while self.socks.len() <= r.get() {
            self.socks.push(ConnData::new());
        }
        while self.socks[r].len() <= c.get() {
            self.socks[r].push(None);
        }
        if let Some(old) = self.socks[r][c].take() {
            t.unregister_poller(old.poller);
        }
        let sock = self.socks[r][c].insert(Sock::new(wire, poller));
        // A new wire waits for writability too; nothing is queued yet.
        sock.wire.update_interest(t, poller, None, false);
        self.run(t, Event::ConnUp(conn), now);
    }
}
