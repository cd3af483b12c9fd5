//! The scaffolding every lull server shares (the NBD server, the replica
//! server, and the NVMe/TCP target to come): an acceptor thread on the main
//! reactor, one lull thread per connection spread round-robin over the
//! reactors, a table of live connections with a limit, a deadline for the
//! client's greeting (handshake, HELLO), and a drain on shutdown that lets
//! every connection finish its in-flight requests.
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

/// Message queue of a connection's thread. A connection receives only its
/// start, the stop/drain wake-up and the wake-ups of the helpers it waits
/// for (metadata writes, fencing), a handful at a time; the default queue
/// (65,536 messages, 1.5 MiB resident) made every idle connection cost
/// 1.5 MiB. A send to a full queue is refused to the sender; for a
/// wake-up that loses nothing, since the queue then holds wake-ups that
/// run the poller after the refused one was sent, and a poller run
/// re-checks everything it waits for.
pub const CONN_MAILBOX_CAPACITY: usize = 64;

/// Raises the process's descriptor limit to its hard limit and logs the
/// result: each connection holds about three descriptors (its socket, its
/// thread's epoll and eventfd). Call once at start, before serving.
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

/// Descriptors one connection holds (socket, thread epoll, thread eventfd),
/// for the capacity logged at start.
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

/// One accepted connection, run by the poller of the lull thread it owns.
/// Dropping it closes it.
pub trait Connection: Send + 'static {
    fn fd(&self) -> RawFd;
    /// What the poller waits for on `fd` in the event-driven modes.
    fn interest(&self) -> Interest;
    /// Set once the client's greeting is done; until then the greeting
    /// deadline applies.
    fn greeted(&self) -> Arc<AtomicBool>;
    /// Make progress. `greeting_expired`: the deadline passed before the
    /// greeting was done (the connection should say why and close). A
    /// connection that is done calls `t.exit()`.
    fn poll(&mut self, t: &mut Thread, now: u64, greeting_expired: bool) -> PollStatus;
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
    thread: ThreadHandle,
    poller: Option<PollerId>,
}

/// The live connections of one server.
pub struct Connections {
    limits: Limits,
    stopping: AtomicBool,
    table: Mutex<HashMap<u64, Entry>>,
    changed: Condvar,
    /// Connections accepted so far: names them and places them round-robin.
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
/// connection) is dropped, on every path.
struct Registration {
    conns: Arc<Connections>,
    thread_id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.thread_id);
        self.conns.changed.notify_all();
    }
}

/// A server's acceptor thread and its connection table.
pub struct Acceptor {
    conns: Arc<Connections>,
    thread: ThreadHandle,
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.conns.fmt(f)
    }
}

impl Acceptor {
    /// Start accepting on `listeners` (already bound) on reactor 0; each
    /// accepted stream becomes `make(stream)` on a thread of its own.
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
        let c = conns.clone();
        let make = Arc::new(make);
        let thread = fw.spawn_thread(0, &format!("{name}-acceptor"), move |t| {
            for l in listeners {
                let fd = l.fd();
                let (conns, make) = (c.clone(), make.clone());
                let r = t.register_poller(
                    &format!("{name}-accept"),
                    PollerKind::Active,
                    &[(fd, Interest::READABLE)],
                    Box::new(move |t, _now| accept_some(t, &l, &conns, &*make)),
                );
                if let Err(e) = r {
                    tracing::error!(server = name, error = %e, "cannot register the accept poller");
                }
            }
        })?;
        Ok(Acceptor {
            conns: conns.clone(),
            thread,
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
                let _ = c.thread.send(move |t| {
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
        table.len()
    }
}

fn accept_some<L: Listener, C: Connection>(
    t: &mut Thread,
    listener: &L,
    conns: &Arc<Connections>,
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
        match spawn_connection(t, make(stream), peer.clone(), conns) {
            Ok(()) => {}
            // Its epoll and eventfd did not fit: the stream closes here.
            Err(ReactorError::Sys(e))
                if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) =>
            {
                conns.log_out_of_fds(t.now_ns(), &e);
            }
            Err(e) => {
                tracing::error!(server = name, peer = %peer, error = %e, "cannot start a connection thread")
            }
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

fn spawn_connection<C: Connection>(
    t: &mut Thread,
    conn: C,
    peer: String,
    conns: &Arc<Connections>,
) -> Result<(), ReactorError> {
    let fw = t.framework().ok_or(ReactorError::Detached)?.clone();
    let n = conns.accepted.fetch_add(1, Ordering::Relaxed);
    let reactor = n % fw.reactor_count();
    let c = conns.clone();
    // Register in the table before the thread runs, so that a stop sees it.
    let mut table = conns.lock();
    let name = conns.limits.name;
    let handle = fw.spawn_thread_with_mailbox(
        reactor,
        &format!("{name}-conn-{n}"),
        CONN_MAILBOX_CAPACITY,
        move |t| start_connection(t, conn, peer, c),
    )?;
    table.insert(
        handle.id(),
        Entry {
            thread: handle,
            poller: None,
        },
    );
    Ok(())
}

fn start_connection<C: Connection>(
    t: &mut Thread,
    mut conn: C,
    peer: String,
    conns: Arc<Connections>,
) {
    let name = conns.limits.name;
    let registration = Registration {
        conns: conns.clone(),
        thread_id: t.id(),
    };
    let fd = conn.fd();
    let interest = conn.interest();
    let greeted = conn.greeted();
    let expired = Arc::new(AtomicBool::new(false));
    let expired_seen = expired.clone();
    let poller = t.register_poller(
        &format!("{name}-conn"),
        PollerKind::Active,
        &[(fd, interest)],
        Box::new(move |t, now| {
            let _keep = &registration;
            conn.poll(t, now, expired_seen.load(Ordering::Relaxed))
        }),
    );
    let id = match poller {
        Ok(id) => id,
        Err(e) => {
            tracing::error!(server = name, peer = %peer, error = %e, "cannot register connection poller");
            t.exit();
            return;
        }
    };
    // Run it once now: a greeting may be queued, or the poller may need to
    // learn its id.
    t.wake_poller(id);
    if let Some(c) = conns.lock().get_mut(&t.id()) {
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
    tracing::debug!(server = name, peer = %peer, thread = t.name(), "connection accepted");
}
