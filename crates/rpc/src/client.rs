//! The client side: one call per connection, as SPDK's rpc.py does (the
//! `lull rpc METHOD [PARAMS]` command is this call in the binary), over the
//! Unix socket or over TCP with TLS.
//!
//! ```ignore
//! let reactors = call(Path::new(DEFAULT_RPC_SOCKET), "framework_get_reactors", None, Duration::from_secs(5))?;
//! let tls = RpcTls::Certs("/etc/lull/rpc-client".into()).client()?;
//! let volumes = call_tcp("10.0.0.7:5260", &tls, "volume_list", None, Duration::from_secs(5))?;
//! ```

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lull_net::link::client_handshake;
use lull_net::tls::{TlsContext, TlsError, TlsStream};
use serde_json::{json, Value};

use crate::framing::{FrameError, JsonFramer};

/// Where `lull serve` listens and `lull rpc` connects by default (SPDK uses
/// /var/tmp/spdk.sock).
pub const DEFAULT_RPC_SOCKET: &str = "/var/tmp/lull.sock";

/// Largest response the client reads. Responses grow with the number of lull
/// threads (one per NBD connection, at most 1024, ~300 bytes each in
/// `thread_get_stats`); 16 MiB is far above that and still bounded.
pub const MAX_RESPONSE_BYTES: usize = 16 << 20;

/// Default for `lull rpc --timeout`, as rpc.py's.
pub const DEFAULT_CLIENT_TIMEOUT_S: f64 = 60.0;

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum RpcClientError {
    #[error("cannot connect to {path}: {source} (is `lull serve` running with this RPC socket?)", path = path.display())]
    Connect { path: PathBuf, source: io::Error },
    #[error("no response within {0:?}")]
    Timeout(Duration),
    #[error(
        "cannot connect to {addr}: {source} (is `lull serve` running with --rpc-listen on it?)"
    )]
    ConnectTcp { addr: String, source: io::Error },
    /// The TLS handshake failed: the two ends do not share a key or trust
    /// each other's certificates, or the server is no TLS server.
    #[error("TLS with {addr} failed: {source} ({hint})")]
    Tls {
        addr: String,
        source: TlsError,
        hint: &'static str,
    },
    #[error("connection error: {0}")]
    Io(#[source] io::Error),
    #[error("the server closed the connection without a response")]
    Closed,
    #[error("malformed response: {0}")]
    BadResponse(String),
    /// The server answered with a JSON-RPC error object.
    #[error("error {code}: {message}")]
    Rpc {
        code: i64,
        message: String,
        data: Option<Value>,
    },
}

/// Call `method` on the server at `socket` and return its `result`.
pub fn call(
    socket: &Path,
    method: &str,
    params: Option<Value>,
    timeout: Duration,
) -> Result<Value, RpcClientError> {
    let deadline = Instant::now() + timeout;
    let mut stream = UnixStream::connect(socket).map_err(|source| RpcClientError::Connect {
        path: socket.to_path_buf(),
        source,
    })?;
    exchange(&mut stream, method, params, deadline, timeout)
}

/// Call `method` on the TCP server at `addr` (`HOST:PORT`; each address
/// it resolves to is tried in turn) through TLS with the client context
/// `tls` (see [`crate::RpcTls::client`]), and return its `result`.
/// `timeout` bounds connect, handshake, request and response together;
/// only the name lookup is the system resolver's to bound.
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
    // One small request and one reply: no Nagle delay on either.
    tcp.set_nodelay(true).map_err(RpcClientError::Io)?;
    let mut stream = client_handshake(tls, tcp, peer.ip(), deadline).map_err(|source| {
        if Instant::now() >= deadline {
            return RpcClientError::Timeout(timeout);
        }
        let hint = crate::tcp::rpc_handshake_hint(&source.to_string());
        RpcClientError::Tls {
            addr: peer_name(addr, peer),
            source,
            hint,
        }
    })?;
    // The handshake leaves the socket non-blocking (for a reactor); this
    // call blocks with timeouts.
    stream
        .get_ref()
        .set_nonblocking(false)
        .map_err(RpcClientError::Io)?;
    exchange(&mut stream, method, params, deadline, timeout)
}

/// `addr` as given, with the address it resolved to when that differs.
fn peer_name(addr: &str, peer: SocketAddr) -> String {
    if addr == peer.to_string() {
        addr.to_string()
    } else {
        format!("{addr} ({peer})")
    }
}

/// A connected stream whose socket timeouts the client sets before each
/// read and write.
trait Timed: Read + Write {
    fn set_timeouts(&self, t: Duration) -> io::Result<()>;
}

impl Timed for UnixStream {
    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
}

impl Timed for TlsStream<TcpStream> {
    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        self.get_ref().set_read_timeout(Some(t))?;
        self.get_ref().set_write_timeout(Some(t))
    }
}

/// Send one request and read its response before `deadline`.
fn exchange<S: Timed>(
    stream: &mut S,
    method: &str,
    params: Option<Value>,
    deadline: Instant,
    timeout: Duration,
) -> Result<Value, RpcClientError> {
    const ID: u64 = 1;
    let mut request = json!({"jsonrpc": "2.0", "method": method, "id": ID});
    if let Some(p) = params {
        request["params"] = p;
    }
    let bytes =
        serde_json::to_vec(&request).map_err(|e| RpcClientError::BadResponse(e.to_string()))?;
    let io_err = |e: io::Error| {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            RpcClientError::Timeout(timeout)
        } else {
            RpcClientError::Io(e)
        }
    };
    stream
        .set_timeouts(remaining(deadline, timeout)?)
        .map_err(io_err)?;
    stream.write_all(&bytes).map_err(io_err)?;
    let mut framer = JsonFramer::new(MAX_RESPONSE_BYTES);
    let frame = loop {
        stream
            .set_timeouts(remaining(deadline, timeout)?)
            .map_err(io_err)?;
        match framer.read_frame(stream) {
            Ok(Some(f)) => break f,
            Ok(None) | Err(FrameError::Truncated) => return Err(RpcClientError::Closed),
            Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(FrameError::Io(e)) => return Err(io_err(e)),
            Err(e) => return Err(RpcClientError::BadResponse(e.to_string())),
        }
    };
    let response: Value =
        serde_json::from_slice(&frame).map_err(|e| RpcClientError::BadResponse(e.to_string()))?;
    if let Some(err) = response.get("error") {
        let code = err.get("code").and_then(Value::as_i64).unwrap_or_default();
        let message = err
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        return Err(RpcClientError::Rpc {
            code,
            message,
            data: err.get("data").cloned(),
        });
    }
    if response.get("id") != Some(&json!(ID)) {
        return Err(RpcClientError::BadResponse(format!(
            "unexpected id in {response}"
        )));
    }
    response.get("result").cloned().ok_or_else(|| {
        RpcClientError::BadResponse(format!("neither result nor error in {response}"))
    })
}

fn remaining(deadline: Instant, timeout: Duration) -> Result<Duration, RpcClientError> {
    let left = deadline.saturating_duration_since(Instant::now());
    // A zero timeout means "block forever" to set_read_timeout (an error).
    if left.is_zero() {
        return Err(RpcClientError::Timeout(timeout));
    }
    Ok(left)
}
