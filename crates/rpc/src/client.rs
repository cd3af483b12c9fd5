//! The client side: one call per connection, as SPDK's rpc.py does, and the
//! `lull rpc METHOD [PARAMS]` command.
//!
//! ```ignore
//! let reactors = call(Path::new(DEFAULT_RPC_SOCKET), "framework_get_reactors", None, Duration::from_secs(5))?;
//! ```

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
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

/// Exit code for a bad command line (as clap uses).
const EXIT_USAGE: u8 = 2;

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

/// `lull rpc`: call one method and print its result.
#[derive(clap::Args, Debug, Clone)]
pub struct RpcArgs {
    /// The server's Unix socket.
    #[arg(short = 's', long, default_value = DEFAULT_RPC_SOCKET)]
    pub socket: PathBuf,
    /// Seconds to wait for the response.
    #[arg(short = 't', long = "timeout", default_value_t = DEFAULT_CLIENT_TIMEOUT_S, value_name = "SECONDS")]
    pub timeout_s: f64,
    /// Method name, e.g. framework_get_reactors (rpc_get_methods lists them).
    pub method: String,
    /// Parameters as a JSON object, e.g. '{"name": "vol1", "size": "1G"}'.
    pub params: Option<String>,
}

/// Run `lull rpc`: the result as pretty JSON on stdout and exit 0; an error
/// response (as JSON) or an unreachable server on stderr and exit 1; params
/// that are not JSON, or a bad --timeout, exit 2.
pub fn run_client(args: &RpcArgs) -> ExitCode {
    let params = match &args.params {
        None => None,
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(v) => Some(v),
            Err(e) => {
                eprintln!("lull rpc: error: params are not valid JSON: {e}");
                return ExitCode::from(EXIT_USAGE);
            }
        },
    };
    let timeout = match Duration::try_from_secs_f64(args.timeout_s) {
        Ok(t) if !t.is_zero() => t,
        _ => {
            eprintln!("lull rpc: error: --timeout must be a positive number of seconds");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match call(&args.socket, &args.method, params, timeout) {
        Ok(result) => {
            use std::io::Write;
            // A closed pipe (`lull rpc ... | head`) is not an error of ours.
            let _ = writeln!(std::io::stdout(), "{}", pretty(&result));
            ExitCode::SUCCESS
        }
        Err(RpcClientError::Rpc {
            code,
            message,
            data,
        }) => {
            let mut err = json!({"code": code, "message": message});
            if let Some(d) = data {
                err["data"] = d;
            }
            eprintln!("{}", pretty(&err));
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("lull rpc: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
}
