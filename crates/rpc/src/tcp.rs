//! JSON-RPC over TCP, TLS only: the same requests, method registry and
//! limits as the Unix socket (`server.rs`), so a node can be managed from
//! another machine. Every client proves who it is in the TLS handshake,
//! with a pre-shared key or a certificate signed by the server's CA; one
//! that cannot gets a closed connection, never a byte of JSON-RPC, and the
//! server logs one WARN line naming the peer and the reason.
//!
//! ```ignore
//! use lull_rpc::{call_tcp, RpcTcpServer, RpcTls};
//! // The server (what `lull serve --rpc-listen 0.0.0.0:5260
//! // --rpc-tls-psk /etc/lull/rpc.psk` runs):
//! let tls = RpcTls::Psk("/etc/lull/rpc.psk".into()).server()?;
//! let server = RpcTcpServer::start("0.0.0.0:5260".parse()?, tls, Arc::new(registry))?;
//! // A client (what `lull rpc --addr 10.0.0.7:5260 --tls-psk rpc.psk
//! // volume_list` runs):
//! let ctx = RpcTls::Psk("rpc.psk".into()).client()?;
//! let volumes = call_tcp("10.0.0.7:5260", &ctx, "volume_list", None, Duration::from_secs(5))?;
//! drop(server); // stops accepting and closes every connection
//! ```
//!
//! Credentials, in the formats of `lull_net::tls`:
//!
//! - **PSK**: a file of `username:hexkey` lines (nbdkit's `--tls-psk`;
//!   `psktool -u admin -p rpc.psk` makes one, so does
//!   `echo "admin:$(openssl rand -hex 32)" > rpc.psk`). The server accepts
//!   every identity its file lists; a client presents the first of its file.
//! - **Certificates**: a directory in qemu's `tls-creds-x509` layout. The
//!   server's holds `server-cert.pem`, `server-key.pem` and `ca-cert.pem`,
//!   which is required here: it is the CA every client's certificate must
//!   be signed by. A client's holds `client-cert.pem`, `client-key.pem` and
//!   `ca-cert.pem` (the CA of the server's certificate), and the server's
//!   certificate must name the IP address the client connects to
//!   (`subjectAltName = IP:...`), as for replica links.
//!
//! There is no plaintext mode: whoever reaches this port can create and
//! delete volumes, so the network listener exists only with authentication.
//! Local management stays on the Unix socket, guarded by its file mode.
//!
//! Bounds: a connection takes one of `MAX_RPC_CONNECTIONS` slots (a set of
//! its own, beside the Unix socket's) from accept on, handshake included,
//! and the handshake must finish within [`TLS_HANDSHAKE_TIMEOUT`] however
//! the peer paces its bytes; after it, `REQUEST_IO_TIMEOUT` and
//! `MAX_REQUEST_BYTES` apply as on the Unix socket. Past the cap a
//! connection is closed at once with a log line: a `SERVER_BUSY` reply
//! could only go out inside TLS, after the handshake the cap is there to
//! bound.

use std::cell::Cell;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use lull_net::link::{handshake_hint, TLS_RECORD_HANDSHAKE};
use lull_net::tls::{Creds, Role, TlsContext, TlsError, TlsStream};

use crate::conns::{ConnSet, Slot};
use crate::server::{
    serve_requests, MethodRegistry, MAX_RPC_CONNECTIONS, REQUEST_IO_TIMEOUT, SHUTDOWN_WAIT,
};
use crate::RpcError;

/// A client must finish the TLS handshake within this time of being
/// accepted, or it is closed. A handshake is two round trips and a few
/// milliseconds of crypto; 10 s covers a slow link or a loaded machine many
/// times over (NBD's `HANDSHAKE_TIMEOUT_US` is the same), and bounds how
/// long a peer that never authenticates holds one of the
/// `MAX_RPC_CONNECTIONS` slots.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Pause after a failed accept (EMFILE and friends): the error persists
/// for a while, and retrying at once would spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

/// How long a stop tries to connect to its own listener to wake the
/// blocking accept: loopback answers in microseconds.
const WAKE_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How the TCP listener authenticates, as the operator chose it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RpcTls {
    /// A `username:hexkey` file.
    Psk(PathBuf),
    /// A qemu `tls-creds-x509` directory.
    Certs(PathBuf),
}

/// Why RPC TLS credentials cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RpcTlsError {
    /// The files could not be read or loaded (the error names the file).
    #[error("JSON-RPC TLS: {0}")]
    Load(#[from] TlsError),
    /// A server certificate directory without `ca-cert.pem` would let any
    /// client in.
    #[error("JSON-RPC TLS: {} is missing: JSON-RPC over TCP requires client certificates, and this is the CA that must sign them", .0.display())]
    NoClientCa(PathBuf),
}

/// A server TLS context that makes every client prove itself (a PSK, or a
/// certificate signed by the CA). Made only by [`RpcTls::server`], so no
/// TCP listener can start that lets an unauthenticated client in.
#[derive(Debug, Clone)]
pub struct RpcServerTls(TlsContext);

impl RpcTls {
    pub fn creds(&self) -> Creds {
        match self {
            RpcTls::Psk(file) => Creds::Psk(file.clone()),
            RpcTls::Certs(dir) => Creds::X509(dir.clone()),
        }
    }

    /// Load the server side: `server-cert.pem`, `server-key.pem` and the
    /// required `ca-cert.pem`, or the PSK file.
    pub fn server(&self) -> Result<RpcServerTls, RpcTlsError> {
        let ctx = TlsContext::new(&self.creds(), Role::Server)?;
        if !ctx.verifies_peer() {
            // Only certificates without a CA verify no one (a PSK always
            // authenticates the peer).
            let missing = match self {
                RpcTls::Certs(dir) => dir.join("ca-cert.pem"),
                RpcTls::Psk(file) => file.clone(),
            };
            return Err(RpcTlsError::NoClientCa(missing));
        }
        Ok(RpcServerTls(ctx))
    }

    /// Load the client side (`client-cert.pem`, `client-key.pem`,
    /// `ca-cert.pem`, or the PSK file), for [`crate::call_tcp`] and
    /// [`crate::RpcTcpConnection`].
    pub fn client(&self) -> Result<TlsContext, RpcTlsError> {
        Ok(TlsContext::new(&self.creds(), Role::Client)?)
    }
}

/// A running JSON-RPC server on a TCP port, TLS only. Dropping it stops it
/// as [`RpcTcpServer::shutdown`] does.
pub struct RpcTcpServer {
    local_addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    conns: Arc<ConnSet<TcpStream>>,
}

impl std::fmt::Debug for RpcTcpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RpcTcpServer({})", self.local_addr)
    }
}

impl RpcTcpServer {
    /// Listen on `addr` (port 0 picks a free one; see
    /// [`RpcTcpServer::local_addr`]) and serve `registry` to clients that
    /// authenticate with `tls`.
    pub fn start(
        addr: SocketAddr,
        tls: RpcServerTls,
        registry: Arc<MethodRegistry>,
    ) -> Result<RpcTcpServer, RpcError> {
        let bind_err = |source| RpcError::BindTcp { addr, source };
        let listener = TcpListener::bind(addr).map_err(bind_err)?;
        let local_addr = listener.local_addr().map_err(bind_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = ConnSet::new(MAX_RPC_CONNECTIONS);
        let creds = tls.0.creds().clone();
        let accept = {
            let stop = stop.clone();
            let conns = conns.clone();
            std::thread::Builder::new()
                .name("rpc-tcp-accept".into())
                .spawn(move || accept_loop(listener, tls.0, registry, stop, conns))
                .map_err(RpcError::Thread)?
        };
        tracing::info!(addr = %local_addr, tls = ?creds, "JSON-RPC server listening on TCP (TLS only)");
        Ok(RpcTcpServer {
            local_addr,
            stop,
            accept: Some(accept),
            conns,
        })
    }

    /// The address bound (the real port when started on port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stop accepting and close every connection (waiting a little for a
    /// method that is running).
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        stop_accept(self.local_addr, &self.stop, accept, "RPC TCP");
        let left = self.conns.close_all(SHUTDOWN_WAIT);
        if left > 0 {
            tracing::warn!(connections = left, "RPC TCP connections still busy at stop");
        }
    }
}

impl Drop for RpcTcpServer {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// Stop the blocking accept thread `accept` of a TCP listener bound to
/// `addr` (the RPC and metrics servers): raise `stop`, wake its accept
/// with a connection of our own, and join it. If that connection fails
/// the thread is left (with a warning naming the `what` server).
pub(crate) fn stop_accept(addr: SocketAddr, stop: &AtomicBool, accept: JoinHandle<()>, what: &str) {
    stop.store(true, Ordering::SeqCst);
    match TcpStream::connect_timeout(&wake_addr(addr), WAKE_CONNECT_TIMEOUT) {
        Ok(_) => {
            let _ = accept.join();
        }
        Err(e) => {
            tracing::warn!(%addr, error = %e, "cannot wake the {what} accept thread; leaving it");
        }
    }
}

/// Where to connect to reach a listener bound to `a` from this host: a
/// wildcard address is reached on loopback.
fn wake_addr(a: SocketAddr) -> SocketAddr {
    let ip = match a.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, a.port())
}

fn accept_loop(
    listener: TcpListener,
    tls: TlsContext,
    registry: Arc<MethodRegistry>,
    stop: Arc<AtomicBool>,
    conns: Arc<ConnSet<TcpStream>>,
) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let tcp = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "RPC TCP accept failed");
                std::thread::sleep(ACCEPT_BACKOFF);
                continue;
            }
        };
        let peer = match tcp.peer_addr() {
            Ok(p) => p,
            // Reset between accept and now: nothing to serve or to name.
            Err(e) => {
                tracing::debug!(error = %e, "RPC TCP peer left before it was served");
                continue;
            }
        };
        let handle = match tcp.try_clone() {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(%peer, reason = %e, "RPC connection refused: cannot track it");
                continue;
            }
        };
        let Some(slot) = conns.admit(handle) else {
            tracing::warn!(
                %peer,
                reason = %format!("too many connections (limit {MAX_RPC_CONNECTIONS})"),
                "RPC connection refused"
            );
            continue;
        };
        let (tls, registry, stop) = (tls.clone(), registry.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("rpc-tcp-conn".into())
            .spawn(move || serve_connection(tcp, peer, &tls, &registry, &stop, slot));
        if let Err(e) = spawned {
            tracing::warn!(%peer, reason = %e, "RPC connection refused: cannot start its thread");
        }
    }
}

/// Why a connection was closed before it could send a request.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("the client closed the connection before a TLS handshake")]
    ClosedEarly,
    #[error("no TLS handshake within {0:?}")]
    Timeout(Duration),
    #[error("not TLS: the first byte is 0x{0:02x} (plaintext JSON-RPC? this port is TLS only)")]
    NotTls(u8),
    #[error("{error} ({hint})")]
    Handshake { error: TlsError, hint: &'static str },
    #[error("socket error before the TLS handshake: {0}")]
    Io(io::Error),
}

/// Authenticate, then serve requests as the Unix socket does. A refusal is
/// one WARN line (a debug line when the server is stopping: the stop closed
/// it) and a closed connection.
fn serve_connection(
    tcp: TcpStream,
    peer: SocketAddr,
    tls: &TlsContext,
    registry: &MethodRegistry,
    stop: &AtomicBool,
    _slot: Slot<TcpStream>,
) {
    let mut session = match authenticate(tcp, tls) {
        Ok(s) => s,
        Err(refusal) => {
            if stop.load(Ordering::SeqCst) {
                tracing::debug!(%peer, reason = %refusal, "RPC connection closed at stop");
            } else {
                tracing::warn!(%peer, reason = %refusal, "RPC connection refused: not authenticated");
            }
            return;
        }
    };
    // Every line of this connection from now on names its peer.
    let _span = tracing::info_span!("rpc_tcp", %peer).entered();
    // Debug, not info: a remote poller would log a line a second.
    let how = match (session.psk_identity(), tls.creds()) {
        (Some(identity), _) => format!("PSK identity {identity}"),
        (None, Creds::Psk(_)) => "PSK".to_string(),
        (None, Creds::X509(_)) => "client certificate".to_string(),
    };
    tracing::debug!(with = %how, "RPC client authenticated (TLS)");
    let tcp = &session.get_ref().tcp;
    if let Err(e) = tcp
        .set_read_timeout(Some(REQUEST_IO_TIMEOUT))
        .and_then(|()| tcp.set_write_timeout(Some(REQUEST_IO_TIMEOUT)))
    {
        tracing::warn!(error = %e, "cannot set RPC socket timeouts");
        return;
    }
    session.get_ref().deadline.set(None);
    serve_requests(&mut session, registry);
}

/// Run the server side of the TLS handshake, bounded by
/// [`TLS_HANDSHAKE_TIMEOUT`] in total.
fn authenticate(tcp: TcpStream, tls: &TlsContext) -> Result<TlsStream<Bounded>, Refusal> {
    let deadline = Instant::now() + TLS_HANDSHAKE_TIMEOUT;
    // Replies are single small writes the client waits for: no Nagle.
    tcp.set_nodelay(true).map_err(Refusal::Io)?;
    tcp.set_read_timeout(Some(TLS_HANDSHAKE_TIMEOUT))
        .map_err(Refusal::Io)?;
    // The first byte tells a plaintext client (JSON starts with `{` or
    // `[`) from a TLS one, for the log line; OpenSSL would only say
    // "wrong version number".
    let mut first = [0u8; 1];
    loop {
        match tcp.peek(&mut first) {
            Ok(0) => return Err(Refusal::ClosedEarly),
            Ok(_) if first[0] != TLS_RECORD_HANDSHAKE => return Err(Refusal::NotTls(first[0])),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if is_timeout(&e) => return Err(Refusal::Timeout(TLS_HANDSHAKE_TIMEOUT)),
            Err(e) => return Err(Refusal::Io(e)),
        }
    }
    let bounded = Bounded {
        tcp,
        deadline: Cell::new(Some(deadline)),
    };
    let mut session = TlsStream::new(tls, bounded).map_err(|error| Refusal::Handshake {
        error,
        hint: "cannot start a TLS session",
    })?;
    loop {
        match session.handshake() {
            Ok(true) => return Ok(session),
            // A read timed out (the socket timeout is what is left).
            Ok(false) if Instant::now() < deadline => {}
            Ok(false) => return Err(Refusal::Timeout(TLS_HANDSHAKE_TIMEOUT)),
            Err(_) if Instant::now() >= deadline => {
                return Err(Refusal::Timeout(TLS_HANDSHAKE_TIMEOUT))
            }
            Err(error) => {
                let hint = rpc_handshake_hint(&error.to_string());
                return Err(Refusal::Handshake { error, hint });
            }
        }
    }
}

/// A hint for an operator reading a failed handshake's OpenSSL reason:
/// `handshake_hint`'s where it recognises the reason; its catch-all names
/// replica settings, so RPC gives its own. A socket reset or broken
/// mid-handshake says nothing about credentials, so it gets a hint of its
/// own, not the catch-all's.
pub(crate) fn rpc_handshake_hint(reason: &str) -> &'static str {
    let r = reason.to_ascii_lowercase();
    if r.contains("reset by peer") || r.contains("broken pipe") {
        return "the peer reset the connection during the handshake: it went away or gave up; nothing says the credentials differ";
    }
    let hint = handshake_hint(reason);
    // An empty reason matches nothing: that is the catch-all.
    if hint == handshake_hint("") {
        "the two ends' JSON-RPC TLS credentials do not match (a key of the server's PSK file, or a client certificate its CA signed)"
    } else {
        hint
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// A socket whose reads and writes fail once `deadline` has passed, so a
/// handshake is bounded in total: a peer that sends one byte every few
/// seconds would otherwise keep OpenSSL reading past any per-read timeout.
/// Without a deadline (after the handshake) it is the plain socket, with
/// the timeouts set on it.
struct Bounded {
    tcp: TcpStream,
    deadline: Cell<Option<Instant>>,
}

impl Bounded {
    /// Shorten the socket timeouts to what is left before the deadline.
    fn arm(&self) -> io::Result<()> {
        let Some(deadline) = self.deadline.get() else {
            return Ok(());
        };
        let left = deadline.saturating_duration_since(Instant::now());
        // A zero timeout means "block forever" to the socket: refuse first.
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.tcp.set_read_timeout(Some(left))?;
        self.tcp.set_write_timeout(Some(left))
    }
}

impl Read for Bounded {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm()?;
        self.tcp.read(buf)
    }
}

impl Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm()?;
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.tcp.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_listeners_are_woken_on_loopback() {
        let a: SocketAddr = "0.0.0.0:5260".parse().unwrap();
        assert_eq!(wake_addr(a), "127.0.0.1:5260".parse().unwrap());
        let a: SocketAddr = "[::]:5260".parse().unwrap();
        assert_eq!(wake_addr(a), "[::1]:5260".parse().unwrap());
        let a: SocketAddr = "10.1.2.3:5260".parse().unwrap();
        assert_eq!(wake_addr(a), a);
    }

    #[test]
    fn hints_never_send_an_rpc_operator_to_replica_settings() {
        for reason in ["", "unexpected message", "no suitable signature algorithm"] {
            let hint = rpc_handshake_hint(reason);
            assert!(hint.contains("JSON-RPC"), "{reason:?}: {hint}");
            assert!(!hint.contains("replica"), "{reason:?}: {hint}");
        }
        // A reset is no credentials mismatch.
        for reason in [
            "Connection reset by peer (os error 104)",
            "Broken pipe (os error 32)",
        ] {
            let hint = rpc_handshake_hint(reason);
            assert!(hint.contains("reset the connection"), "{reason:?}: {hint}");
            assert!(!hint.contains("credentials do not match"), "{hint}");
        }
        // A reason handshake_hint knows keeps its hint.
        let psk = rpc_handshake_hint("binder does not verify: decrypt error");
        assert_eq!(psk, handshake_hint("decrypt error"));
        assert!(!psk.contains("JSON-RPC"));
    }

    #[test]
    fn a_bounded_socket_refuses_past_its_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (tcp, _) = listener.accept().unwrap();
        let mut b = Bounded {
            tcp,
            deadline: Cell::new(Some(Instant::now())),
        };
        let err = b.read(&mut [0u8; 1]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        let err = b.write(b"x").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        // Without a deadline it is the socket: the write goes out.
        b.deadline.set(None);
        assert_eq!(b.write(b"x").unwrap(), 1);
    }
}
