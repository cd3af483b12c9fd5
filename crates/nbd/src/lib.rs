//! The NBD frontend: serves volumes to any NBD client over TCP or a Unix
//! socket, from lull threads on the reactor framework.
//!
//! ```ignore
//! let volumes = Arc::new(lull_volume::Volumes::default());
//! volumes.add(Volume::new("vol0", Storage::Local(Arc::new(MallocDev::new(1 << 30)?))))?;
//! let server = NbdServer::start(fw.handle(), volumes, &[ListenAddr::Tcp("127.0.0.1:10809".parse()?)])?;
//! // nbdinfo nbd://127.0.0.1:10809/vol0
//! server.shutdown(Duration::from_secs(30));
//! ```
//!
//! One acceptor thread on the main reactor; each connection is a poller
//! (owning the socket and the connection's device channel) in one of the
//! server's poll groups, one lull thread per reactor, placed round-robin
//! and then spread so a volume's connections sit in different groups. That scaffolding
//! (acceptor, connection table and limit, handshake deadline, drain) is
//! `lull_net::server`; the protocol is in `conn`. Volumes (and their I/O
//! counters) come from the `lull_volume` registry; an export is a volume,
//! or `VOLUME@SNAPSHOT`, a read-only view of one of its snapshots
//! ([`Volumes::resolve`]), served with `NBD_FLAG_READ_ONLY`. The metadata
//! context `lull:changed:SNAPSHOT` reports which blocks changed since a
//! snapshot (see `lull_proto::nbd::structured::LULL_CHANGED_PREFIX`).

#![forbid(unsafe_code)]

mod conn;
mod stream;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use lull_net::server::{self, Acceptor, Connections, Limits};
use lull_net::tls::TlsContext;
use lull_proto::nbd::{self, ExportInfo, Exports, TlsPolicy};
use lull_reactor::{FrameworkHandle, ReactorError};
use lull_volume::{ConnPermit, Volume, VolumeLimits, Volumes};

pub use conn::{MAX_IN_FLIGHT, MAX_REPLY_QUEUE_BYTES};

// A volume's name is its export name: every name the registry accepts must
// fit on the wire.
const _: () = assert!(lull_volume::MAX_VOLUME_NAME_LEN <= nbd::MAX_EXPORT_NAME_LEN);

use crate::conn::Conn;
use crate::stream::Stream;

/// Connections the server holds at once. An idle connection is a poller in
/// a poll group and costs a few KiB (5.4 KiB measured, docs/BENCHMARKS.md §1.3); a busy one
/// up to its input buffer and `MAX_IN_FLIGHT` requests. Real nodes hold
/// hundreds of volumes with a few connections each; past this a new
/// connection is accepted and closed at once (with a log line), so a flood
/// cannot exhaust memory or fds.
pub const MAX_CONNECTIONS: usize = 16_384;

/// A client must finish the handshake within this time, or it is
/// disconnected: a silent connection must not hold a slot forever. qemu and
/// nbdkit use similar limits (nbdkit: 60 s); clients here negotiate in
/// milliseconds.
pub const HANDSHAKE_TIMEOUT_US: u64 = 10_000_000;

/// Transmission flags of every lull export. `SEND_FAST_ZERO` on every
/// export: a device that cannot zero fast refuses such requests at once
/// with `NBD_ENOTSUP`, which is the flag's whole contract. `CACHE` on
/// every export: a prefetch for file volumes, a successful no-op
/// elsewhere. No `ROTATIONAL`: lull's backends are memory, files (whose
/// own layout the kernel schedules) and replicas over the network, none
/// of which gains from elevator ordering by the client.
pub const EXPORT_FLAGS: u16 = nbd::NBD_FLAG_HAS_FLAGS
    | nbd::NBD_FLAG_SEND_FLUSH
    | nbd::NBD_FLAG_SEND_FUA
    | nbd::NBD_FLAG_SEND_TRIM
    | nbd::NBD_FLAG_SEND_WRITE_ZEROES
    | nbd::NBD_FLAG_CAN_MULTI_CONN
    | nbd::NBD_FLAG_SEND_CACHE
    | nbd::NBD_FLAG_SEND_FAST_ZERO;

/// Transmission flags of a read-only export (a snapshot's view): no trim,
/// write zeroes or fast zero, as nbdkit and qemu-nbd advertise read-only
/// exports (the spec only requires refusing writes; advertising commands
/// that always fail would mislead clients that plan around them, and
/// `NBD_FLAG_SEND_FAST_ZERO` MUST be clear without `SEND_WRITE_ZEROES`).
/// Writes, trims and zeroes sent anyway get `NBD_EPERM`
/// (`lull_proto::nbd::validate`). Flush and FUA stay: harmless no-ops that
/// clients such as qemu send regardless; CACHE and multi-conn hold as on
/// any export.
pub const READ_ONLY_EXPORT_FLAGS: u16 = (EXPORT_FLAGS
    & !(nbd::NBD_FLAG_SEND_TRIM | nbd::NBD_FLAG_SEND_WRITE_ZEROES | nbd::NBD_FLAG_SEND_FAST_ZERO))
    | nbd::NBD_FLAG_READ_ONLY;

/// Snapshots of one volume `NBD_OPT_LIST` names as `VOLUME@SNAPSHOT`
/// after the volume itself, oldest first. A real chain is far shorter and
/// is listed whole; the cap bounds the reply one volume with a very long
/// chain adds (at most 256 names of at most 4 KiB). A snapshot past it is
/// still served by name.
pub const MAX_LISTED_SNAPSHOTS_PER_VOLUME: usize = 256;

/// Export names one handshake step keeps resolved (see [`ExportList`]).
/// Every option names at most one export and a handshake has at most
/// `MAX_OPTIONS` options, so a step never needs more; past it, a name is
/// resolved again (correct, only slower).
const MAX_RESOLVED_EXPORTS: usize = nbd::MAX_OPTIONS as usize;

// The codec refuses `lull:changed:` queries naming a snapshot with the
// registry's separator: no snapshot holds it.
const _: () = assert!(
    nbd::structured::SNAPSHOT_NAME_FORBIDDEN[0] == lull_volume::SNAPSHOT_SEPARATOR
        || nbd::structured::SNAPSHOT_NAME_FORBIDDEN[1] == lull_volume::SNAPSHOT_SEPARATOR
);

/// Errors of the NBD frontend.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: String, source: io::Error },
    #[error(transparent)]
    Reactor(#[from] ReactorError),
}

/// The volumes as one handshake step sees them. An export name resolves
/// through [`Volumes::resolve`]: a volume, or for `VOLUME@SNAPSHOT` a new
/// read-only [`Volume`] over the snapshot's view. What a name resolved to
/// is kept for the step (at most [`MAX_RESOLVED_EXPORTS`] names), so the
/// `lookup` and `admit` of one `NBD_OPT_GO` (and a meta context option's
/// lookups) see the same `Arc<Volume>`, and a snapshot's view is made once,
/// not per question. A GO or EXPORT_NAME takes a connection place on its
/// volume and opens the device channel before it is answered
/// ([`Exports::admit`]), so a volume that cannot take the connection
/// refuses it in the handshake; what was taken waits in `admitted` for the
/// connection.
pub(crate) struct ExportList<'a> {
    volumes: &'a Volumes,
    limits: VolumeLimits,
    peer: &'a str,
    /// Names resolved in this step, with what they resolved to.
    resolved: std::cell::RefCell<Vec<(String, Option<Arc<Volume>>)>>,
    pub(crate) admitted: std::cell::RefCell<Option<Admitted>>,
}

/// An export taken for a connection: its place and its channel.
pub(crate) struct Admitted {
    pub(crate) volume: Arc<Volume>,
    pub(crate) channel: Box<dyn lull_bdev::Channel>,
    pub(crate) permit: ConnPermit,
}

impl<'a> ExportList<'a> {
    pub(crate) fn of(volumes: &'a Volumes, peer: &'a str) -> ExportList<'a> {
        ExportList {
            volumes,
            limits: volumes.limits(),
            peer,
            resolved: std::cell::RefCell::new(Vec::new()),
            admitted: std::cell::RefCell::new(None),
        }
    }

    /// The volume (or snapshot view) an export name stands for, resolved
    /// once per step (a name that resolved to nothing is kept too).
    fn find(&self, name: &str) -> Option<Arc<Volume>> {
        if let Some((_, volume)) = self.resolved.borrow().iter().find(|(n, _)| n == name) {
            return volume.clone();
        }
        let volume = self.volumes.resolve(name);
        let mut resolved = self.resolved.borrow_mut();
        if resolved.len() < MAX_RESOLVED_EXPORTS {
            resolved.push((name.to_owned(), volume.clone()));
        }
        volume
    }
}

impl Exports for ExportList<'_> {
    /// Each volume, then its snapshots as `VOLUME@SNAPSHOT` (at most
    /// [`MAX_LISTED_SNAPSHOTS_PER_VOLUME`]; a combined name that breaks
    /// the NBD string rules is left out, as no client could send it back).
    fn names(&self) -> Vec<String> {
        let mut names = Vec::new();
        for volume in self.volumes.list() {
            let snapshots = volume.dev().snapshot_names();
            names.push(volume.name.clone());
            let views = snapshots
                .iter()
                .map(|s| lull_volume::snapshot_export(&volume.name, s))
                .filter(|name| name.len() <= nbd::MAX_EXPORT_NAME_LEN && !name.contains('\0'))
                .take(MAX_LISTED_SNAPSHOTS_PER_VOLUME);
            names.extend(views);
        }
        names
    }

    fn admit(&self, name: &str) -> Result<(), String> {
        let Some(volume) = self.find(name) else {
            return Err("unknown export".into());
        };
        let max = self.limits.connections;
        let Some(permit) = volume.try_connect(max) else {
            tracing::warn!(peer = %self.peer, export = %volume.name, limit = max,
                "refused a connection: the volume has its maximum of connections");
            return Err(format!(
                "export {:?} already has its maximum of {max} connections",
                volume.name
            ));
        };
        let channel = volume.open_channel(self.limits.in_flight).map_err(|e| {
            tracing::error!(peer = %self.peer, export = %volume.name, error = %e,
                "refused a connection: cannot open a device channel");
            format!("export {:?} cannot take a connection now: {e}", volume.name)
        })?;
        *self.admitted.borrow_mut() = Some(Admitted {
            volume,
            channel,
            permit,
        });
        Ok(())
    }

    fn lookup(&self, name: &str) -> Option<ExportInfo> {
        let v = self.find(name)?;
        let transmission_flags = if v.dev().read_only() {
            READ_ONLY_EXPORT_FLAGS
        } else {
            EXPORT_FLAGS
        };
        Some(ExportInfo {
            size_bytes: v.dev().size_bytes(),
            transmission_flags,
            description: Some(v.dev().describe()),
        })
    }

    fn snapshot_names(&self, export: &str) -> Vec<String> {
        self.find(export)
            .map(|v| v.dev().snapshot_names())
            .unwrap_or_default()
    }

    fn has_snapshot(&self, export: &str, snapshot: &str) -> bool {
        self.find(export)
            .is_some_and(|v| v.dev().has_snapshot(snapshot))
    }
}

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl server::Listener for Listener {
    type Stream = Stream;

    fn accept(&self) -> io::Result<Stream> {
        match self {
            Listener::Tcp(s) => s.accept().map(|(s, _)| Stream::Tcp(s)),
            Listener::Unix(s, _) => s.accept().map(|(s, _)| Stream::Unix(s)),
        }
    }

    fn prepare(stream: &Stream) -> io::Result<()> {
        stream.prepare()
    }

    fn peer(stream: &Stream) -> String {
        stream.peer()
    }

    fn fd(&self) -> RawFd {
        match self {
            Listener::Tcp(s) => s.as_raw_fd(),
            Listener::Unix(s, _) => s.as_raw_fd(),
        }
    }
}

impl Listener {
    fn bind(addr: &ListenAddr) -> Result<Listener, NbdError> {
        let err = |source| NbdError::Listen {
            addr: addr.to_string(),
            source,
        };
        let l = match addr {
            ListenAddr::Tcp(a) => Listener::Tcp(TcpListener::bind(a).map_err(err)?),
            ListenAddr::Unix(p) => {
                remove_stale_socket(p);
                Listener::Unix(UnixListener::bind(p).map_err(err)?, p.clone())
            }
        };
        match &l {
            Listener::Tcp(s) => s.set_nonblocking(true).map_err(err)?,
            Listener::Unix(s, _) => s.set_nonblocking(true).map_err(err)?,
        }
        Ok(l)
    }

    fn local(&self) -> ListenAddr {
        match self {
            Listener::Tcp(s) => s
                .local_addr()
                .map(ListenAddr::Tcp)
                .unwrap_or(ListenAddr::Tcp(([0, 0, 0, 0], 0).into())),
            Listener::Unix(_, p) => ListenAddr::Unix(p.clone()),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A socket file left by a server that died is removed; one that a live
/// server answers on is left alone (bind then fails with "address in use").
fn remove_stale_socket(path: &Path) {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if meta.file_type().is_socket() && std::os::unix::net::UnixStream::connect(path).is_err() {
            let _ = std::fs::remove_file(path);
        }
    }
}

pub(crate) struct ServerShared {
    pub(crate) volumes: Arc<Volumes>,
    pub(crate) conns: Arc<Connections>,
    pub(crate) tls: Option<NbdTls>,
}

/// TLS on the NBD server: the policy `NBD_OPT_STARTTLS` is answered by,
/// and the credentials of the sessions it starts.
#[derive(Debug, Clone)]
pub struct NbdTls {
    pub policy: TlsPolicy,
    pub ctx: TlsContext,
}

/// A running NBD server.
pub struct NbdServer {
    shared: Arc<ServerShared>,
    acceptor: Acceptor,
    addrs: Vec<ListenAddr>,
}

impl std::fmt::Debug for NbdServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NbdServer({:?})", self.addrs)
    }
}

impl NbdServer {
    /// Bind every address (errors are reported here, synchronously) and
    /// start accepting on the main reactor. With `tls`, clients may (or,
    /// with [`TlsPolicy::Require`], must) upgrade with `NBD_OPT_STARTTLS`.
    pub fn start(
        fw: &FrameworkHandle,
        volumes: Arc<Volumes>,
        listen: &[ListenAddr],
        tls: Option<NbdTls>,
    ) -> Result<NbdServer, NbdError> {
        NbdServer::start_with(fw, volumes, listen, tls, MAX_CONNECTIONS)
    }

    /// As [`NbdServer::start`], holding at most `max_connections` (1 to
    /// [`MAX_CONNECTIONS`]) connections at once.
    pub fn start_with(
        fw: &FrameworkHandle,
        volumes: Arc<Volumes>,
        listen: &[ListenAddr],
        tls: Option<NbdTls>,
        max_connections: usize,
    ) -> Result<NbdServer, NbdError> {
        let listeners = listen
            .iter()
            .map(Listener::bind)
            .collect::<Result<Vec<_>, _>>()?;
        let addrs = listeners.iter().map(Listener::local).collect();
        let conns = Arc::new(Connections::new(Limits {
            name: "nbd",
            max_connections: max_connections.clamp(1, MAX_CONNECTIONS),
            greeting_timeout_us: HANDSHAKE_TIMEOUT_US,
        }));
        let shared = Arc::new(ServerShared {
            volumes,
            conns: conns.clone(),
            tls: tls.filter(|t| t.policy != TlsPolicy::Off),
        });
        let s = shared.clone();
        let clock = fw.clock();
        let acceptor = Acceptor::start(fw, &conns, listeners, move |stream| {
            let mut conn = Conn::new(stream, s.clone());
            conn.set_clock(clock.clone());
            conn
        })?;
        Ok(NbdServer {
            shared,
            acceptor,
            addrs,
        })
    }

    /// The bound addresses (with the real port for port 0).
    pub fn local_addrs(&self) -> &[ListenAddr] {
        &self.addrs
    }

    pub fn volumes(&self) -> &Arc<Volumes> {
        &self.shared.volumes
    }

    pub fn connection_count(&self) -> usize {
        self.shared.conns.len()
    }

    /// Stop accepting, let every connection finish its in-flight requests
    /// and send their replies, then close. Returns the connections still open
    /// after `timeout` (0 on a clean stop).
    pub fn shutdown(&self, timeout: Duration) -> usize {
        self.acceptor.stop();
        self.acceptor.drain(timeout)
    }
}
