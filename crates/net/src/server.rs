//! The scaffolding every lull server shares (the NBD server, the replica
//! server, and the NVMe/TCP target to come): an acceptor thread on the main
//! reactor, **poll groups** (one lull thread per reactor, per server) that
//! hold the connections as pollers, a table of live connections with a
//! limit, a deadline for the client's greeting (handshake, HELLO), and a
//! drain on shutdown that lets every connection finish its in-flight
//! requests.
//!
//! Why poll groups (SPDK's nvmf poll groups): a connection as a lull thread
//! of its own costs an epoll set, an eventfd, a timerfd and a message queue,
//! and every reactor iteration visits every thread. As a poller in a group
//! it costs one poller entry; the group's epoll set reports the
//! connections with work, and only those run. Connections go round-robin
//! over the groups (one group per reactor), which spreads clients over the
//! cores at accept time; the scheduler moves whole groups later. A volume's
//! connections are not grouped together: a busy volume with several
//! connections (qemu multi-conn, nbdcopy) should use several cores.
//!
//! A server supplies its listener ([`Listener`]) and its connection
//! ([`Connection`]); the protocol lives there, the plumbing here.
//!
//! ```ignore
//! let conns = Arc::new(Connections::new(Limits { name: "nbd", max_connections: 1024, greeting_timeout_us: 10_000_000 }));
//! let acceptor = Acceptor::start(fw, &conns, listeners, move |stream| Conn::new(stream, shared.clone()))?;
//! // … on stop:
//! acceptor.stop();
//! let still_open = acceptor.drain(Duration::from_secs(30));
//! ```

use std::collections::HashMap;
use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use lull_reactor::{
    FrameworkHandle, Interest, PollStatus, PollerId, PollerKind, ReactorError, Thread, ThreadHandle,
};

/// Raises the process's descriptor limit to its hard limit and logs the
/// result: each connection holds one descriptor (its socket; a file
/// volume's connection also its io_uring). Call once at start, before
/// serving.
pub fn raise_fd_limit(server: &str) {
    match lull_reactor::sys::raise_nofile_limit() {
        Ok((before, now)) => tracing::info!(
            server,
            fd_limit = now,
            was = before,
            connections_about = now / FDS_PER_CONNECTION,
            "file descriptor limit"
        ),
        Err(e) => tracing::warn!(server, error = %e, "cannot raise the file descriptor limit"),
    }
}

/// Descriptors one connection holds (its socket, and a file volume's
/// io_uring and its eventfd), for the capacity logged at start.
const FDS_PER_CONNECTION: u64 = 3;

/// "Out of file descriptors" is logged at most this often while it lasts:
/// a flood of connections must not become a flood of log lines.
const SHED_LOG_INTERVAL_NS: u64 = 1_000_000_000;

/// Connections accepted per acceptor poll. The acceptor re-wakes itself
/// when the batch fills, so a burst of connects cannot hold the main
/// reactor for long.
pub const ACCEPT_BATCH: usize = 16;

/// A listening socket of some kind (TCP, Unix).
pub trait Listener: Send + 'static {
    type Stream: Send + 'static;
    /// Accept one pending connection; `WouldBlock` when there is none.
    fn accept(&self) -> io::Result<Self::Stream>;
    /// Make an accepted stream fit for a reactor (non-blocking, no Nagle).
    fn prepare(stream: &Self::Stream) -> io::Result<()>;
    /// The peer, for log lines.
    fn peer(stream: &Self::Stream) -> String;
    fn fd(&self) -> RawFd;
}

/// TCP as most servers want it: accepted sockets are non-blocking and send
/// without Nagle's delay (replies are small and latency-bound).
impl Listener for TcpListener {
    type Stream = TcpStream;

    fn accept(&self) -> io::Result<TcpStream> {
        TcpListener::accept(self).map(|(s, _)| s)
    }

    fn prepare(s: &TcpStream) -> io::Result<()> {
        s.set_nonblocking(true)?;
        s.set_nodelay(true)
    }

    fn peer(s: &TcpStream) -> String {
        s.peer_addr()
            .map_or_else(|_| "tcp:?".into(), |a| a.to_string())
    }

    fn fd(&self) -> RawFd {
        self.as_raw_fd()
    }
}

/// One accepted connection, run by its poller in a poll group. Dropping it
/// closes it.
pub trait Connection: Send + 'static {
    fn fd(&self) -> RawFd;
    /// What the poller waits for on `fd` in the event-driven modes.
    fn interest(&self) -> Interest;
    /// Set once the client's greeting is done; until then the greeting
    /// deadline applies.
    fn greeted(&self) -> Arc<AtomicBool>;
    /// Make progress. `greeting_expired`: the deadline passed before the
    /// greeting was done (the connection should say why and close). A
    /// connection that is done unregisters its poller
    /// (`t.unregister_poller(me)`): the poller, and with it the connection,
    /// is dropped when the call returns. Never `t.exit()`: the thread is
    /// the group's.
    fn poll(&mut self, t: &mut Thread, now: u64, greeting_expired: bool) -> PollStatus;
    /// What the connection serves, once it is known (an NBD export after
    /// the handshake): connections of one volume are spread over the poll
    /// groups, so that a busy volume can use several cores. `None` keeps
    /// the connection where it was placed.
    fn affinity(&self) -> Option<String> {
        None
    }
}

/// A server's name (for threads, pollers and log lines) and its limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub name: &'static str,
    /// Connections open at once; more are accepted and closed with a log
    /// line.
    pub max_connections: usize,
    /// How long a new connection has for its greeting.
    pub greeting_timeout_us: u64,
}

struct Entry {
    /// The poll group the connection is in (or moving to), and its index.
    group: ThreadHandle,
    group_index: usize,
    /// `None` while it starts or moves between groups.
    poller: Option<PollerId>,
    /// What it serves ([`Connection::affinity`]), once known.
    key: Option<String>,
}

/// The live connections of one server.
pub struct Connections {
    limits: Limits,
    stopping: AtomicBool,
    table: Mutex<HashMap<u64, Entry>>,
    changed: Condvar,
    /// Connections accepted so far: numbers them and places them
    /// round-robin over the poll groups.
    accepted: AtomicUsize,
    /// A descriptor held in reserve (nginx's and libev's trick): when the
    /// process is out of descriptors, a pending connection cannot be
    /// accepted and its listener stays readable, so an event-driven
    /// reactor would spin on it. Closing the reserve lets it be accepted
    /// and closed at once; then the reserve is taken again.
    reserve: Mutex<Option<std::fs::File>>,
    /// When the last "out of descriptors" line was logged (ns; one a second).
    shed_logged_ns: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Connections({}, {} open)", self.limits.name, self.len())
    }
}

impl Connections {
    pub fn new(limits: Limits) -> Connections {
        Connections {
            limits,
            stopping: AtomicBool::new(false),
            table: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            accepted: AtomicUsize::new(0),
            reserve: Mutex::new(std::fs::File::open("/dev/null").ok()),
            shed_logged_ns: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Out of descriptors: accept one pending connection with the reserve
    /// descriptor and close it, so the listener does not stay readable.
    /// Returns whether a connection was shed.
    fn shed<L: Listener>(&self, listener: &L, now_ns: u64, error: &io::Error) -> bool {
        let mut reserve = self.reserve.lock().unwrap_or_else(|p| p.into_inner());
        let had = reserve.take().is_some();
        let shed = had && listener.accept().is_ok();
        *reserve = std::fs::File::open("/dev/null").ok();
        drop(reserve);
        self.log_out_of_fds(now_ns, error);
        shed
    }

    /// The "out of file descriptors" line, at most once a second.
    fn log_out_of_fds(&self, now_ns: u64, error: &dyn std::fmt::Display) {
        let last = self.shed_logged_ns.load(Ordering::Relaxed);
        if now_ns.saturating_sub(last) >= SHED_LOG_INTERVAL_NS || last == 0 {
            self.shed_logged_ns.store(now_ns.max(1), Ordering::Relaxed);
            tracing::warn!(
                server = self.limits.name, error = %error, open = self.len(),
                "out of file descriptors: new connections are closed at once (raise `ulimit -n`)"
            );
        }
    }

    /// The server is stopping: connections finish what they have in flight
    /// and close; no new one is accepted.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Entry>> {
        // A panic elsewhere must not take the table down with it.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Removes a connection from the table when its poller closure (and so the
/// connection) is dropped, on every path (also when its start message is
/// refused and dropped).
struct Registration {
    conns: Arc<Connections>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.id);
        self.conns.changed.notify_all();
    }
}

/// A server's acceptor thread, its poll groups and its connection table.
pub struct Acceptor {
    conns: Arc<Connections>,
    thread: ThreadHandle,
    groups: Arc<Vec<ThreadHandle>>,
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.conns.fmt(f)
    }
}

impl Acceptor {
    /// Start accepting on `listeners` (already bound) on reactor 0; each
    /// accepted stream becomes `make(stream)`, a poller in one of the
    /// server's poll groups (one per reactor).
    pub fn start<L, C, F>(
        fw: &FrameworkHandle,
        conns: &Arc<Connections>,
        listeners: Vec<L>,
        make: F,
    ) -> Result<Acceptor, ReactorError>
    where
        L: Listener,
        C: Connection,
        F: Fn(L::Stream) -> C + Send + Sync + 'static,
    {
        let name = conns.limits.name;
        let groups = (0..fw.reactor_count())
            .map(|r| fw.spawn_thread(r, &format!("{name}-group-{r}"), |_| {}))
            .collect::<Result<Vec<_>, _>>()?;
        let groups = Arc::new(groups);
        let c = conns.clone();
        let g = groups.clone();
        let make = Arc::new(make);
        let thread = fw.spawn_thread(0, &format!("{name}-acceptor"), move |t| {
            for l in listeners {
                let fd = l.fd();
                let (conns, make, groups) = (c.clone(), make.clone(), g.clone());
                let r = t.register_poller(
                    &format!("{name}-accept"),
                    PollerKind::Active,
                    &[(fd, Interest::READABLE)],
                    Box::new(move |t, _now| accept_some(t, &l, &conns, &groups, &*make)),
                );
                if let Err(e) = r {
                    tracing::error!(server = name, error = %e, "cannot register the accept poller");
                }
            }
        })?;
        Ok(Acceptor {
            conns: conns.clone(),
            thread,
            groups,
        })
    }

    pub fn connections(&self) -> &Arc<Connections> {
        &self.conns
    }

    /// Stop accepting (the listeners close) and tell every connection to
    /// finish and close. Returns false when it was already stopping.
    pub fn stop(&self) -> bool {
        if self.conns.stopping.swap(true, Ordering::SeqCst) {
            return false;
        }
        let _ = self.thread.send(|t| t.exit());
        for c in self.conns.lock().values() {
            if let Some(id) = c.poller {
                let _ = c.group.send(move |t| {
                    t.wake_poller(id);
                });
            }
        }
        true
    }

    /// After [`Acceptor::stop`], wait up to `timeout` for every connection
    /// to close. Returns the connections still open (0 on a clean stop).
    pub fn drain(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut table = self.conns.lock();
        while !table.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            table = self
                .conns
                .changed
                .wait_timeout(table, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let left = table.len();
        drop(table);
        // The server is done with its groups (connections still open after
        // the timeout close with them).
        if self.conns.stopping() {
            for g in self.groups.iter() {
                let _ = g.send(|t| t.exit());
            }
        }
        left
    }
}

fn accept_some<L: Listener, C: Connection>(
    t: &mut Thread,
    listener: &L,
    conns: &Arc<Connections>,
    groups: &Arc<Vec<ThreadHandle>>,
    make: &(dyn Fn(L::Stream) -> C + Send + Sync),
) -> PollStatus {
    let name = conns.limits.name;
    let mut status = PollStatus::Idle;
    for _ in 0..ACCEPT_BATCH {
        let stream = match listener.accept() {
            Ok(s) => s,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                break
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                if conns.shed(listener, t.now_ns(), &e) {
                    status = PollStatus::Busy;
                    continue;
                }
                break;
            }
            Err(e) => {
                // ECONNABORTED and friends: log and go on; the listener stays.
                tracing::warn!(server = name, error = %e, "accept failed");
                break;
            }
        };
        status = PollStatus::Busy;
        if conns.stopping() {
            break;
        }
        let peer = L::peer(&stream);
        if let Err(e) = L::prepare(&stream) {
            tracing::warn!(server = name, peer = %peer, error = %e, "cannot set up accepted socket");
            continue;
        }
        let limit = conns.limits.max_connections;
        if conns.len() >= limit {
            tracing::warn!(server = name, peer = %peer, limit, "too many connections; closing new one");
            continue;
        }
        if let Err(e) = place_connection(make(stream), peer.clone(), conns, groups) {
            tracing::error!(server = name, peer = %peer, error = %e, "cannot start a connection; closed");
        }
    }
    // More may be waiting beyond the batch.
    if status.is_busy() {
        if let Some(me) = t.current_poller() {
            t.wake_poller(me);
        }
    }
    status
}

/// Hand a connection to the next poll group, round-robin.
fn place_connection<C: Connection>(
    conn: C,
    peer: String,
    conns: &Arc<Connections>,
    groups: &Arc<Vec<ThreadHandle>>,
) -> Result<(), lull_reactor::SendError> {
    let n = conns.accepted.fetch_add(1, Ordering::Relaxed);
    let id = n as u64;
    let group_index = n % groups.len();
    let group = &groups[group_index];
    // In the table before it runs, so that a stop sees it; the registration
    // takes it out again on every path, a refused start included.
    conns.lock().insert(
        id,
        Entry {
            group: group.clone(),
            group_index,
            poller: None,
            key: None,
        },
    );
    let registration = Registration {
        conns: conns.clone(),
        id,
    };
    let groups = groups.clone();
    group.send(move |t| start_connection(t, conn, peer, registration, groups))
}

fn start_connection<C: Connection>(
    t: &mut Thread,
    mut conn: C,
    peer: String,
    registration: Registration,
    groups: Arc<Vec<ThreadHandle>>,
) {
    let conns = registration.conns.clone();
    let conn_id = registration.id;
    let name = conns.limits.name;
    let fd = conn.fd();
    let interest = conn.interest();
    let greeted = conn.greeted();
    let expired = Arc::new(AtomicBool::new(false));
    let expired_seen = expired.clone();
    let mut spread = false;
    let poller = t.register_poller(
        &format!("{name}-conn"),
        PollerKind::Active,
        &[(fd, interest)],
        Box::new(move |t, now| {
            let status = conn.poll(t, now, expired_seen.load(Ordering::Relaxed));
            if !spread {
                if let Some(key) = conn.affinity() {
                    spread = true;
                    spread_by_affinity(t, &registration, key, &groups);
                }
            }
            status
        }),
    );
    let id = match poller {
        Ok(id) => id,
        Err(e) => {
            // The poller closure (and the connection) is dropped: closed.
            tracing::error!(server = name, peer = %peer, error = %e, "cannot register connection poller");
            return;
        }
    };
    // Run it once now: a greeting may be queued, or the poller may need to
    // learn its id.
    t.wake_poller(id);
    if let Some(c) = conns.lock().get_mut(&conn_id) {
        c.poller = Some(id);
    }
    let timer = t.register_poller(
        &format!("{name}-greeting-timeout"),
        PollerKind::every_us(conns.limits.greeting_timeout_us),
        &[],
        Box::new(move |t, _now| {
            if !greeted.load(Ordering::Relaxed) {
                expired.store(true, Ordering::Relaxed);
                t.wake_poller(id);
            }
            if let Some(me) = t.current_poller() {
                t.unregister_poller(me);
            }
            PollStatus::Busy
        }),
    );
    if let Err(e) = timer {
        tracing::warn!(server = name, peer = %peer, error = %e, "no greeting deadline for this connection");
    }
    tracing::debug!(server = name, peer = %peer, group = t.name(), conn = conn_id, "connection accepted");
}

/// A connection learnt what it serves: if its group holds more of that
/// volume's connections than another group does, move it there (between
/// two runs of its group, by a message to the group itself). Groups sit on
/// different reactors, or can be moved apart by the scheduler when they
/// get busy; connections of one volume in one group could never be.
fn spread_by_affinity(
    t: &mut Thread,
    registration: &Registration,
    key: String,
    groups: &Arc<Vec<ThreadHandle>>,
) {
    let Some(me) = t.current_poller() else {
        return;
    };
    let conns = registration.conns.clone();
    let conn_id = registration.id;
    let mut table = conns.lock();
    let mut counts = vec![0usize; groups.len()];
    for (id, e) in table.iter() {
        if *id != conn_id && e.key.as_deref() == Some(key.as_str()) {
            counts[e.group_index] += 1;
        }
    }
    let Some(entry) = table.get_mut(&conn_id) else {
        return;
    };
    entry.key = Some(key);
    let here = entry.group_index;
    // The emptiest group; staying wins ties.
    let best = (0..groups.len())
        .min_by_key(|&g| (counts[g], g != here))
        .unwrap_or(here);
    if counts[best] >= counts[here] || conns.stopping() {
        return;
    }
    // Counted in its new group at once, so that connections deciding
    // meanwhile see it there.
    entry.group_index = best;
    entry.group = groups[best].clone();
    entry.poller = None;
    drop(table);
    let target = groups[best].clone();
    let back = t.handle();
    let sent = back.send(move |t| move_connection(t, me, here, best, target, conns, conn_id));
    if sent.is_err() {
        tracing::warn!(group = t.name(), "cannot queue a connection move; it stays");
    }
}

/// Detach the connection's poller from this group and attach it to
/// `target` (group `to`); if `target` cannot take it, it stays (group
/// `from`).
fn move_connection(
    t: &mut Thread,
    poller: PollerId,
    from: usize,
    to: usize,
    target: ThreadHandle,
    conns: Arc<Connections>,
    conn_id: u64,
) {
    let Some(p) = t.detach_poller(poller) else {
        if t.has_poller(poller) {
            // Paused: it cannot move now; it stays where it is.
            if let Some(e) = conns.lock().get_mut(&conn_id) {
                e.group_index = from;
                e.group = t.handle();
                e.poller = Some(poller);
            }
        }
        // Otherwise it finished meanwhile (its registration is gone with it).
        return;
    };
    let slot = Arc::new(Mutex::new(Some(p)));
    let taken = slot.clone();
    let c = conns.clone();
    let sent = target.send(move |t| {
        let Some(p) = taken.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            return;
        };
        attach_connection(t, p, &c, conn_id, to);
    });
    if sent.is_err() {
        let p = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = p {
            if let Some(e) = conns.lock().get_mut(&conn_id) {
                e.group_index = from;
                e.group = t.handle();
            }
            attach_connection(t, p, &conns, conn_id, from);
        }
    } else {
        tracing::info!(
            server = conns.limits.name,
            conn = conn_id,
            from,
            to,
            "connection moved to spread its volume over poll groups"
        );
    }
}

fn attach_connection(
    t: &mut Thread,
    p: lull_reactor::DetachedPoller,
    conns: &Arc<Connections>,
    conn_id: u64,
    group_index: usize,
) {
    match t.attach_poller(p) {
        Ok(id) => {
            if let Some(e) = conns.lock().get_mut(&conn_id) {
                e.poller = Some(id);
                e.group_index = group_index;
            }
        }
        // The poller (and the connection) is dropped: it closes.
        Err(e) => {
            tracing::error!(server = conns.limits.name, error = %e, "cannot attach a moved connection; closing it")
        }
    }
}
