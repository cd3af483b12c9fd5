//! The client over TCP with TLS: [`RpcTcpConnection`], one authenticated
//! session that carries call after call, and [`call_tcp`], one call on a
//! connection of its own (what `lull rpc --addr` makes).
//!
//! ```ignore
//! let tls = RpcTls::Psk("rpc.psk".into()).client()?;
//! let mut conn = RpcTcpConnection::connect("10.0.0.7:5260", &tls, Duration::from_secs(5))?;
//! let store = conn.call("store_get", None, Duration::from_secs(5))?;
//! // A caller that would send a request again on a new connection splits
//! // the call: an error of `send` means the server never had all of it.
//! let sent = conn.send("volume_list", None, Duration::from_secs(5))?;
//! let volumes = conn.receive(sent, Duration::from_secs(5))?;
//! assert!(conn.is_usable()); // keep it for the next call
//! ```
//!
//! The server answers the requests of a connection one after another and
//! keeps an idle connection open (`serve_requests`; `REQUEST_IO_TIMEOUT`
//! applies only inside a request), so a client that makes many calls pays
//! one TCP connect and one TLS handshake, and holds one of the server's
//! `MAX_RPC_CONNECTIONS` slots, instead of one per call.
//!
//! The socket is non-blocking from connect to close, and every wait is a
//! `poll` bounded by the call's deadline: a blocking socket with a timeout
//! fails a read cut short by a signal with EINTR even under SA_RESTART
//! (signal(7)), which OpenSSL reports as a failed read (a process with
//! children takes SIGCHLD: `lull csi` under its nbdfuse and losetup).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use lull_net::tls::{TlsContext, TlsStream};
use serde_json::Value;

use crate::client::{parse_response, remaining, request_bytes, RpcClientError, MAX_RESPONSE_BYTES};
use crate::framing::JsonFramer;

/// Bytes read from the socket at a time: one TLS record's plaintext at
/// most, which is all one `SSL_read` returns.
const READ_CHUNK_BYTES: usize = 16 * 1024;

/// Call `method` on the TCP server at `addr` (`HOST:PORT`; each address
/// it resolves to is tried in turn) through TLS with the client context
/// `tls` (see [`crate::RpcTls::client`]), on a connection of its own, and
/// return its `result`. `timeout` bounds connect, handshake, request and
/// response together; only the name lookup is the system resolver's to
/// bound.
///
/// With certificates, the server's must name the IP address connected to.
/// A server that refuses this client's certificate does so after the
/// client's side of a TLS 1.3 handshake is done: that comes back as an
/// `Io` error (OpenSSL's alert) or `Closed`, not as `Tls`.
pub fn call_tcp(
    addr: &str,
    tls: &TlsContext,
    method: &str,
    params: Option<Value>,
    timeout: Duration,
) -> Result<Value, RpcClientError> {
    let deadline = Instant::now() + timeout;
    let mut conn = RpcTcpConnection::open(addr, tls, deadline, timeout)?;
    let sent = conn.send_by(method, params.as_ref(), deadline, timeout)?;
    conn.receive_by(sent, deadline, timeout)
}

/// A request written in full, whose response [`RpcTcpConnection::receive`]
/// reads.
#[derive(Debug)]
#[must_use = "a request sent must have its response read before the next one is sent"]
pub struct SentCall {
    id: u64,
}

/// One JSON-RPC session with a TCP server, TLS authenticated, for call
/// after call. Requests go one at a time: each has its response read
/// before the next is sent (the server answers in order; JSON-RPC ids
/// number them, and a response with another id ends the connection).
///
/// After any failure but the server's own error reply (timeout, I/O
/// error, a response that does not parse) the connection is out of step
/// with the server and [`RpcTcpConnection::is_usable`] turns false: drop
/// it. Dropping closes the socket.
#[derive(Debug)]
pub struct RpcTcpConnection {
    /// The address as given, with the one connected to when they differ.
    name: String,
    tls: TlsStream<Wire>,
    framer: JsonFramer,
    next_id: u64,
    usable: bool,
}

impl RpcTcpConnection {
    /// Connect to `addr` (`HOST:PORT`; each address it resolves to is
    /// tried in turn) and authenticate with the client context `tls`
    /// (see [`crate::RpcTls::client`]), within `timeout`.
    ///
    /// A server that ends the connection before it answers the handshake
    /// with a single byte (a `lull serve` past its connection limit, or
    /// stopping) is [`RpcClientError::ClosedBeforeTls`]; `Tls`, with a
    /// hint about credentials, is kept for a handshake the server took
    /// part in.
    pub fn connect(
        addr: &str,
        tls: &TlsContext,
        timeout: Duration,
    ) -> Result<RpcTcpConnection, RpcClientError> {
        RpcTcpConnection::open(addr, tls, Instant::now() + timeout, timeout)
    }

    /// `addr` as given, with the address it resolved to when that differs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the connection can carry another call: no failure has left
    /// it out of step with the server. (Whether the server still holds it
    /// open is checked by the next [`RpcTcpConnection::send`].)
    pub fn is_usable(&self) -> bool {
        self.usable
    }

    /// Call `method` and return its `result`, within `timeout`.
    pub fn call(
        &mut self,
        method: &str,
        params: Option<&Value>,
        timeout: Duration,
    ) -> Result<Value, RpcClientError> {
        let deadline = Instant::now() + timeout;
        let sent = self.send_by(method, params, deadline, timeout)?;
        self.receive_by(sent, deadline, timeout)
    }

    /// Write a request for `method`, within `timeout`. First checks that
    /// the server has not closed the connection since the last call (an
    /// idle connection is closed by a server that stops or restarts).
    ///
    /// An error here means the server did not receive the whole request,
    /// so it cannot have run it: the caller may send it again on another
    /// connection. (A request cut short never parses as a complete JSON
    /// value, and the server runs only complete ones.)
    pub fn send(
        &mut self,
        method: &str,
        params: Option<&Value>,
        timeout: Duration,
    ) -> Result<SentCall, RpcClientError> {
        self.send_by(method, params, Instant::now() + timeout, timeout)
    }

    /// Read the response to `sent`, within `timeout`, and return its
    /// `result`. An error here but `Rpc` (the server's error reply) leaves
    /// it unknown whether the server ran the request.
    pub fn receive(&mut self, sent: SentCall, timeout: Duration) -> Result<Value, RpcClientError> {
        self.receive_by(sent, Instant::now() + timeout, timeout)
    }

    fn open(
        addr: &str,
        tls: &TlsContext,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<RpcTcpConnection, RpcClientError> {
        let connect_err = |source| RpcClientError::ConnectTcp {
            addr: addr.to_string(),
            source,
        };
        let mut last_err = io::Error::new(io::ErrorKind::NotFound, "the name has no address");
        let mut connected = None;
        for peer in addr.to_socket_addrs().map_err(connect_err)? {
            match TcpStream::connect_timeout(&peer, remaining(deadline, timeout)?) {
                Ok(tcp) => {
                    connected = Some((tcp, peer));
                    break;
                }
                Err(e) => last_err = e,
            }
        }
        let Some((tcp, peer)) = connected else {
            return Err(connect_err(last_err));
        };
        let name = peer_name(addr, peer);
        // Small requests and replies, each waited for: no Nagle delay.
        tcp.set_nodelay(true).map_err(RpcClientError::Io)?;
        tcp.set_nonblocking(true).map_err(RpcClientError::Io)?;
        let tls_err = |source: lull_net::tls::TlsError| {
            let hint = crate::tcp::rpc_handshake_hint(&source.to_string());
            RpcClientError::Tls {
                addr: name.clone(),
                source,
                hint,
            }
        };
        let mut session =
            TlsStream::client_for_ip(tls, Wire::new(tcp), peer.ip()).map_err(tls_err)?;
        loop {
            match session.handshake() {
                Ok(true) => break,
                Ok(false) => wait(&session, deadline, timeout)?,
                Err(_) if Instant::now() >= deadline => {
                    return Err(RpcClientError::Timeout(timeout))
                }
                Err(source) => {
                    if let Some(source) = session.get_ref().unanswered_end() {
                        return Err(RpcClientError::ClosedBeforeTls { addr: name, source });
                    }
                    return Err(tls_err(source));
                }
            }
        }
        Ok(RpcTcpConnection {
            name,
            tls: session,
            framer: JsonFramer::new(MAX_RESPONSE_BYTES),
            next_id: 1,
            usable: true,
        })
    }

    fn send_by(
        &mut self,
        method: &str,
        params: Option<&Value>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<SentCall, RpcClientError> {
        if !self.usable {
            return Err(RpcClientError::Io(io::Error::new(
                io::ErrorKind::NotConnected,
                "the connection failed in an earlier call",
            )));
        }
        let id = self.next_id;
        let sent = self.check_open().and_then(|()| {
            let bytes = request_bytes(method, params, id)?;
            self.write_all(&bytes, deadline, timeout)
        });
        if let Err(e) = sent {
            self.usable = false;
            return Err(e);
        }
        self.next_id += 1;
        Ok(SentCall { id })
    }

    fn receive_by(
        &mut self,
        sent: SentCall,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Value, RpcClientError> {
        let frame = match self.read_frame(deadline, timeout) {
            Ok(frame) => frame,
            Err(e) => {
                self.usable = false;
                return Err(e);
            }
        };
        // Anything past the response (a second value, part of one) was
        // never asked for: the two ends are out of step.
        if !matches!(self.framer.next_frame(), Ok(None)) || self.framer.mid_value() {
            self.usable = false;
        }
        let (outcome, id) = parse_response(&frame);
        if id != Some(sent.id) {
            self.usable = false;
            if outcome.is_ok() {
                return Err(RpcClientError::BadResponse(format!(
                    "the response has id {id:?}, the request had {}",
                    sent.id
                )));
            }
        }
        outcome
    }

    /// Whether the server still holds the idle connection open: a server
    /// that closed it (a stop, a restart) has left its end of stream, or
    /// a reset, to read; a live one has sent nothing since its last reply.
    fn check_open(&mut self) -> Result<(), RpcClientError> {
        let mut byte = [0u8; 1];
        loop {
            return match self.tls.read(&mut byte) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(0) => Err(RpcClientError::Closed),
                Ok(_) => Err(RpcClientError::BadResponse(
                    "the server sent bytes between calls".into(),
                )),
                Err(e) => Err(RpcClientError::Io(e)),
            };
        }
    }

    fn write_all(
        &mut self,
        mut bytes: &[u8],
        deadline: Instant,
        timeout: Duration,
    ) -> Result<(), RpcClientError> {
        while !bytes.is_empty() {
            match self.tls.write(bytes) {
                Ok(0) => return Err(RpcClientError::Io(io::ErrorKind::WriteZero.into())),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait(&self.tls, deadline, timeout)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(RpcClientError::Io(e)),
            }
        }
        Ok(())
    }

    fn read_frame(
        &mut self,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Vec<u8>, RpcClientError> {
        let mut chunk = [0u8; READ_CHUNK_BYTES];
        loop {
            match self.framer.next_frame() {
                Ok(Some(frame)) => return Ok(frame),
                Ok(None) => {}
                Err(e) => return Err(RpcClientError::BadResponse(e.to_string())),
            }
            match self.tls.read(&mut chunk) {
                Ok(0) => return Err(RpcClientError::Closed),
                Ok(n) => self.framer.extend(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    wait(&self.tls, deadline, timeout)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(RpcClientError::Io(e)),
            }
        }
    }
}

/// Wait until the session can go on (its socket readable, or writable
/// when it [wants to write](TlsStream::wants_write)) or `deadline`
/// passes. A signal ends the wait early; the caller tries again.
fn wait(tls: &TlsStream<Wire>, deadline: Instant, timeout: Duration) -> Result<(), RpcClientError> {
    let left = remaining(deadline, timeout)?;
    let flags = if tls.wants_write() {
        rustix::event::PollFlags::OUT
    } else {
        rustix::event::PollFlags::IN
    };
    let mut fds = [rustix::event::PollFd::new(&tls.get_ref().tcp, flags)];
    let left = rustix::event::Timespec::try_from(left).ok();
    match rustix::event::poll(&mut fds, left.as_ref()) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(RpcClientError::Io(e.into())),
    }
}

/// `addr` as given, with the address it resolved to when that differs.
fn peer_name(addr: &str, peer: SocketAddr) -> String {
    if addr == peer.to_string() {
        addr.to_string()
    } else {
        format!("{addr} ({peer})")
    }
}

/// The socket under a client's TLS session, noting what tells a server
/// that hung up without a word from one that took part in a handshake
/// and refused it: whether any byte came back, and how the socket ended.
#[derive(Debug)]
struct Wire {
    tcp: TcpStream,
    received_bytes: u64,
    /// The end of stream or socket error met first.
    ended: Option<End>,
}

/// How a socket ended (`io::Error` is not `Clone`: its errno, or kind).
#[derive(Debug, Clone, Copy)]
enum End {
    Eof,
    Errno(i32),
    Kind(io::ErrorKind),
}

impl End {
    fn error(self) -> io::Error {
        match self {
            End::Eof => io::Error::new(io::ErrorKind::UnexpectedEof, "end of stream"),
            End::Errno(errno) => io::Error::from_raw_os_error(errno),
            End::Kind(kind) => kind.into(),
        }
    }
}

impl Wire {
    fn new(tcp: TcpStream) -> Wire {
        Wire {
            tcp,
            received_bytes: 0,
            ended: None,
        }
    }

    /// How the connection ended, when it ended before the server sent a
    /// single byte.
    fn unanswered_end(&self) -> Option<io::Error> {
        match self.ended {
            Some(end) if self.received_bytes == 0 => Some(end.error()),
            _ => None,
        }
    }

    fn note(&mut self, e: &io::Error) {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ) {
            return;
        }
        self.ended.get_or_insert(match e.raw_os_error() {
            Some(errno) => End::Errno(errno),
            None => End::Kind(e.kind()),
        });
    }
}

impl Read for Wire {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.tcp.read(buf) {
            Ok(0) if !buf.is_empty() => {
                self.ended.get_or_insert(End::Eof);
                Ok(0)
            }
            Ok(n) => {
                self.received_bytes += n as u64;
                Ok(n)
            }
            Err(e) => {
                self.note(&e);
                Err(e)
            }
        }
    }
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tcp.write(buf).inspect_err(|e| self.note(e))
    }

    fn flush(&mut self) -> io::Result<()> {
        self.tcp.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::thread::JoinHandle;

    use lull_net::tls::{Creds, Role};
    use serde_json::json;

    use super::*;
    use crate::{MethodRegistry, RpcMethodError, RpcTcpServer, RpcTls};

    const TIMEOUT: Duration = Duration::from_secs(20);
    const KEY: &str = "admin:2b7e151628aed2a6abf7158809cf4f3c8a1e0b2c3d4e5f60718293a4b5c6d7e8";
    const OTHER_KEY: &str =
        "admin:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    /// A PSK file of one line, removed on drop.
    struct KeyFile(PathBuf);

    impl KeyFile {
        fn new(line: &str) -> KeyFile {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "lull-rpc-tcp-client-{}-{}.psk",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::write(&path, format!("{line}\n")).unwrap();
            KeyFile(path)
        }

        fn client(&self) -> TlsContext {
            RpcTls::Psk(self.0.clone()).client().unwrap()
        }
    }

    impl Drop for KeyFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A real server with `echo` and `count` (how many times it ran).
    fn server(key: &KeyFile) -> (RpcTcpServer, Arc<AtomicUsize>) {
        let runs = Arc::new(AtomicUsize::new(0));
        let mut reg = MethodRegistry::new();
        reg.register("echo", Box::new(|p| Ok(p.unwrap_or(Value::Null))))
            .unwrap();
        let counter = runs.clone();
        reg.register(
            "count",
            Box::new(move |_| Ok(json!(counter.fetch_add(1, Ordering::SeqCst) + 1))),
        )
        .unwrap();
        reg.register(
            "fail",
            Box::new(|_| Err(RpcMethodError::Internal("no".into()))),
        )
        .unwrap();
        let tls = RpcTls::Psk(key.0.clone()).server().unwrap();
        let server =
            RpcTcpServer::start("127.0.0.1:0".parse().unwrap(), tls, Arc::new(reg)).unwrap();
        (server, runs)
    }

    /// A server of one connection that answers each request with what
    /// `answer` makes of it (nothing: no answer), until `answer` has
    /// answered `requests` of them; then it closes.
    fn fake_server<F>(key: &KeyFile, requests: usize, answer: F) -> (SocketAddr, JoinHandle<()>)
    where
        F: Fn(&Value) -> Option<Vec<u8>> + Send + 'static,
    {
        let ctx = TlsContext::new(&Creds::Psk(key.0.clone()), Role::Server).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let thread = std::thread::spawn(move || {
            let (tcp, _) = listener.accept().unwrap();
            tcp.set_read_timeout(Some(TIMEOUT)).unwrap();
            let mut tls = TlsStream::new(&ctx, tcp).unwrap();
            while !tls.handshake().unwrap() {}
            let mut framer = JsonFramer::new(MAX_RESPONSE_BYTES);
            for _ in 0..requests {
                let Ok(Some(frame)) = framer.read_frame(&mut tls) else {
                    return;
                };
                let request: Value = serde_json::from_slice(&frame).unwrap();
                match answer(&request) {
                    Some(bytes) => tls.write_all(&bytes).unwrap(),
                    // Hold the connection, answering nothing.
                    None => {
                        let _ = framer.read_frame(&mut tls);
                        return;
                    }
                }
            }
        });
        (addr, thread)
    }

    /// Until the client's socket has something to read (here: the
    /// server's end of stream).
    fn wait_readable(conn: &RpcTcpConnection) {
        let mut fds = [rustix::event::PollFd::new(
            &conn.tls.get_ref().tcp,
            rustix::event::PollFlags::IN,
        )];
        let t = rustix::event::Timespec::try_from(TIMEOUT).unwrap();
        assert_eq!(rustix::event::poll(&mut fds, Some(&t)).unwrap(), 1);
    }

    #[test]
    fn one_connection_carries_call_after_call() {
        let key = KeyFile::new(KEY);
        let (server, runs) = server(&key);
        let addr = server.local_addr().to_string();
        let mut conn = RpcTcpConnection::connect(&addr, &key.client(), TIMEOUT).unwrap();
        assert_eq!(conn.name(), addr);
        for i in 1..=100u64 {
            let params = json!({"i": i});
            assert_eq!(conn.call("echo", Some(&params), TIMEOUT).unwrap(), params);
            assert_eq!(conn.call("count", None, TIMEOUT).unwrap(), json!(i));
        }
        assert_eq!(runs.load(Ordering::SeqCst), 100);
        // The server's error reply is an answer: the session goes on.
        match conn.call("fail", None, TIMEOUT) {
            Err(RpcClientError::Rpc { message, .. }) => assert_eq!(message, "no"),
            other => panic!("{other:?}"),
        }
        assert!(conn.is_usable());
        let sent = conn.send("count", None, TIMEOUT).unwrap();
        assert_eq!(conn.receive(sent, TIMEOUT).unwrap(), json!(101));
        // The one-call function is the same session, opened and closed.
        assert_eq!(
            call_tcp(&addr, &key.client(), "echo", Some(json!([1])), TIMEOUT).unwrap(),
            json!([1])
        );
    }

    /// A server that closed an idle connection (it stopped) fails the
    /// next `send` before any byte of the request is written: the caller
    /// may send it elsewhere, and nothing ran it.
    #[test]
    fn send_on_a_connection_the_server_closed_fails_unsent() {
        let key = KeyFile::new(KEY);
        let (server, runs) = server(&key);
        let addr = server.local_addr().to_string();
        let mut conn = RpcTcpConnection::connect(&addr, &key.client(), TIMEOUT).unwrap();
        assert_eq!(conn.call("count", None, TIMEOUT).unwrap(), json!(1));
        server.shutdown();
        wait_readable(&conn);
        match conn.send("count", None, TIMEOUT) {
            Err(RpcClientError::Closed | RpcClientError::Io(_)) => {}
            other => panic!("{other:?}"),
        }
        assert!(!conn.is_usable());
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // And it stays failed.
        assert!(conn.send("count", None, TIMEOUT).is_err());
    }

    /// A server that accepts and hangs up without a byte (a `lull serve`
    /// past its connection limit) is reported as that, whether its close
    /// met the ClientHello (a reset) or came first (an end of stream);
    /// never as credentials that do not match.
    #[test]
    fn a_server_that_hangs_up_unanswered_is_not_a_credentials_error() {
        let key = KeyFile::new(KEY);
        for read_hello_first in [false, true] {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let thread = std::thread::spawn(move || {
                let (tcp, _) = listener.accept().unwrap();
                if read_hello_first {
                    // Closing with the hello unread sends a reset.
                    tcp.set_read_timeout(Some(TIMEOUT)).unwrap();
                    let _ = tcp.peek(&mut [0u8; 1]);
                }
            });
            let err = RpcTcpConnection::connect(&addr, &key.client(), TIMEOUT).unwrap_err();
            thread.join().unwrap();
            let RpcClientError::ClosedBeforeTls { ref source, .. } = err else {
                panic!("{read_hello_first}: {err:?}");
            };
            assert!(
                matches!(
                    source.kind(),
                    io::ErrorKind::ConnectionReset
                        | io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::BrokenPipe
                ),
                "{source:?}"
            );
            let text = err.to_string();
            assert!(text.contains("at its limit of"), "{text}");
            assert!(!text.contains("do not match"), "{text}");
        }
    }

    /// Credentials the server refuses in the handshake are still a TLS
    /// error with the hint about keys.
    #[test]
    fn a_refused_key_is_a_tls_error() {
        let key = KeyFile::new(KEY);
        let other = KeyFile::new(OTHER_KEY);
        let (server, runs) = server(&key);
        let addr = server.local_addr().to_string();
        match RpcTcpConnection::connect(&addr, &other.client(), TIMEOUT) {
            Err(RpcClientError::Tls { hint, .. }) => {
                assert!(hint.contains("pre-shared key"), "{hint}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(runs.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_response_to_another_request_ends_the_connection() {
        let key = KeyFile::new(KEY);
        let (addr, thread) = fake_server(&key, 2, |req| {
            let id = req["id"].as_u64().unwrap();
            // The first answered right, the second with the wrong id.
            let id = if id == 1 { id } else { id + 7 };
            Some(serde_json::to_vec(&json!({"jsonrpc": "2.0", "id": id, "result": true})).unwrap())
        });
        let mut conn =
            RpcTcpConnection::connect(&addr.to_string(), &key.client(), TIMEOUT).unwrap();
        assert_eq!(conn.call("x", None, TIMEOUT).unwrap(), json!(true));
        match conn.call("x", None, TIMEOUT) {
            Err(RpcClientError::BadResponse(why)) => assert!(why.contains("id"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(!conn.is_usable());
        thread.join().unwrap();
    }

    #[test]
    fn bytes_past_the_response_end_the_connection() {
        let key = KeyFile::new(KEY);
        let (addr, thread) = fake_server(&key, 1, |req| {
            let r = json!({"jsonrpc": "2.0", "id": req["id"], "result": 1});
            Some(format!("{r}{r}").into_bytes())
        });
        let mut conn =
            RpcTcpConnection::connect(&addr.to_string(), &key.client(), TIMEOUT).unwrap();
        // The answer is taken; the session is not.
        assert_eq!(conn.call("x", None, TIMEOUT).unwrap(), json!(1));
        assert!(!conn.is_usable());
        thread.join().unwrap();
    }

    #[test]
    fn a_response_late_past_the_timeout_ends_the_connection() {
        let key = KeyFile::new(KEY);
        let (addr, thread) = fake_server(&key, 1, |_| None);
        let mut conn =
            RpcTcpConnection::connect(&addr.to_string(), &key.client(), TIMEOUT).unwrap();
        let t = Duration::from_millis(100);
        match conn.call("x", None, t) {
            Err(RpcClientError::Timeout(d)) => assert_eq!(d, t),
            other => panic!("{other:?}"),
        }
        assert!(!conn.is_usable());
        drop(conn);
        thread.join().unwrap();
    }
}
