//! The client side: one call per connection, as SPDK's rpc.py does (the
//! `lull rpc METHOD [PARAMS]` command is this call in the binary).
//!
//! ```ignore
//! let reactors = call(Path::new(DEFAULT_RPC_SOCKET), "framework_get_reactors", None, Duration::from_secs(5))?;
//! ```

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
    let stream = UnixStream::connect(socket).map_err(|source| RpcClientError::Connect {
        path: socket.to_path_buf(),
        source,
    })?;
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
        .set_write_timeout(Some(remaining(deadline, timeout)?))
        .map_err(io_err)?;
    (&stream).write_all(&bytes).map_err(io_err)?;
    let mut framer = JsonFramer::new(MAX_RESPONSE_BYTES);
    let frame = loop {
        stream
            .set_read_timeout(Some(remaining(deadline, timeout)?))
            .map_err(io_err)?;
        match framer.read_frame(&mut &stream) {
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
