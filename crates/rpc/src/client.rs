//! The client side. Over the Unix socket, one call per connection, as
//! SPDK's rpc.py does (the `lull rpc METHOD [PARAMS]` command is this call
//! in the binary); over TCP with TLS, [`crate::call_tcp`] does the same
//! and [`crate::RpcTcpConnection`] keeps a session for many calls
//! (`tcp_client.rs`).
//!
//! ```ignore
//! let reactors = call(Path::new(DEFAULT_RPC_SOCKET), "framework_get_reactors", None, Duration::from_secs(5))?;
//! let tls = RpcTls::Certs("/etc/lull/rpc-client".into()).client()?;
//! let volumes = call_tcp("10.0.0.7:5260", &tls, "volume_list", None, Duration::from_secs(5))?;
//! ```

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lull_net::tls::TlsError;
use serde_json::Value;

use crate::framing::{FrameError, JsonFramer};
use crate::server::MAX_RPC_CONNECTIONS;

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
    /// The server ended the connection before it answered the TLS
    /// handshake with a single byte, so no credentials were compared. A
    /// `lull serve` does this to a connection past its
    /// `MAX_RPC_CONNECTIONS`, and when it stops.
    #[error("{addr} hung up before answering the TLS handshake: {source} (no credentials were compared: the server may be at its limit of {MAX_RPC_CONNECTIONS} JSON-RPC connections, or stopping)")]
    ClosedBeforeTls { addr: String, source: io::Error },
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

/// Send one request and read its response before `deadline`.
fn exchange(
    stream: &mut UnixStream,
    method: &str,
    params: Option<Value>,
    deadline: Instant,
    timeout: Duration,
) -> Result<Value, RpcClientError> {
    const ID: u64 = 1;
    let bytes = request_bytes(method, params.as_ref(), ID)?;
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
    let set_timeouts = |s: &UnixStream| -> Result<(), RpcClientError> {
        let t = remaining(deadline, timeout)?;
        s.set_read_timeout(Some(t))
            .and_then(|()| s.set_write_timeout(Some(t)))
            .map_err(io_err)
    };
    set_timeouts(stream)?;
    stream.write_all(&bytes).map_err(io_err)?;
    let mut framer = JsonFramer::new(MAX_RESPONSE_BYTES);
    let frame = loop {
        set_timeouts(stream)?;
        match framer.read_frame(stream) {
            Ok(Some(f)) => break f,
            Ok(None) | Err(FrameError::Truncated) => return Err(RpcClientError::Closed),
            Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(FrameError::Io(e)) => return Err(io_err(e)),
            Err(e) => return Err(RpcClientError::BadResponse(e.to_string())),
        }
    };
    match parse_response(&frame) {
        (outcome @ Err(RpcClientError::Rpc { .. }), _) => outcome,
        (outcome, Some(ID)) => outcome,
        (Err(e), _) => Err(e),
        (Ok(_), _) => Err(RpcClientError::BadResponse(format!(
            "unexpected id in {}",
            String::from_utf8_lossy(&frame)
        ))),
    }
}

/// A request object's bytes.
pub(crate) fn request_bytes(
    method: &str,
    params: Option<&Value>,
    id: u64,
) -> Result<Vec<u8>, RpcClientError> {
    #[derive(serde::Serialize)]
    struct Request<'a> {
        jsonrpc: &'static str,
        method: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        params: Option<&'a Value>,
        id: u64,
    }
    serde_json::to_vec(&Request {
        jsonrpc: "2.0",
        method,
        params,
        id,
    })
    .map_err(|e| RpcClientError::BadResponse(e.to_string()))
}

/// A response's outcome (its `result`, or its error object as `Rpc`) and
/// its id when that is a number; the caller compares the id with its
/// request's.
pub(crate) fn parse_response(frame: &[u8]) -> (Result<Value, RpcClientError>, Option<u64>) {
    let response: Value = match serde_json::from_slice(frame) {
        Ok(v) => v,
        Err(e) => return (Err(RpcClientError::BadResponse(e.to_string())), None),
    };
    let id = response.get("id").and_then(Value::as_u64);
    if let Some(err) = response.get("error") {
        let code = err.get("code").and_then(Value::as_i64).unwrap_or_default();
        let message = err
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let e = RpcClientError::Rpc {
            code,
            message,
            data: err.get("data").cloned(),
        };
        return (Err(e), id);
    }
    let outcome = response.get("result").cloned().ok_or_else(|| {
        RpcClientError::BadResponse(format!("neither result nor error in {response}"))
    });
    (outcome, id)
}

pub(crate) fn remaining(deadline: Instant, timeout: Duration) -> Result<Duration, RpcClientError> {
    let left = deadline.saturating_duration_since(Instant::now());
    // A zero timeout means "block forever" to set_read_timeout (an error).
    if left.is_zero() {
        return Err(RpcClientError::Timeout(timeout));
    }
    Ok(left)
}
