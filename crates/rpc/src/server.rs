//! The JSON-RPC 2.0 server: a method registry, the request/response rules
//! (pure functions over `serde_json::Value`), and the Unix socket listener
//! (the TCP listener, TLS only, is in `tcp.rs` and serves the same loop).
//!
//! ```ignore
//! let mut reg = MethodRegistry::new();
//! reg.register("echo", Box::new(|p| Ok(p.unwrap_or(Value::Null))))?;
//! let server = RpcServer::start(Path::new("/var/tmp/lull.sock"), Arc::new(reg))?;
//! // lull rpc echo '{"x": 1}'
//! server.shutdown();
//! ```
//!
//! Management traffic runs on ordinary OS threads, one per connection (at
//! most `MAX_RPC_CONNECTIONS`), never on a reactor: a slow method or a flood
//! of requests must not delay the data path.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use crate::conns::{ConnSet, Slot};
use crate::framing::{FrameError, JsonFramer};
use crate::RpcError;

/// JSON-RPC 2.0 error codes.
pub const PARSE_ERROR: i64 = -32700;
pub const INVALID_REQUEST: i64 = -32600;
pub const METHOD_NOT_FOUND: i64 = -32601;
pub const INVALID_PARAMS: i64 = -32602;
pub const INTERNAL_ERROR: i64 = -32603;
/// Implementation-defined server error (JSON-RPC reserves -32000..-32099):
/// the server refused the connection because it is at its cap.
pub const SERVER_BUSY: i64 = -32000;

/// Largest request (one JSON value, or one batch). The largest real request
/// is a few hundred bytes (`volume_create` with a 4 KiB name at most); 1 MiB
/// leaves room for batches while bounding what a client can make the server
/// buffer: `MAX_RPC_CONNECTIONS` × 1 MiB = 64 MiB at worst.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// Connections served at once. Management clients are few (an operator,
/// `lull top`, Longhorn's instance manager); SPDK caps its JSON-RPC server at
/// 64 connections too. Past the cap a connection gets a `SERVER_BUSY` error
/// and is closed.
pub const MAX_RPC_CONNECTIONS: usize = 64;

/// Requests in one batch. A batch is bounded in bytes already; this bounds
/// the work (method calls) one request can queue on a connection thread.
pub const MAX_BATCH_LEN: usize = 256;

/// Longest method name a registry accepts; SPDK's are under 64 bytes. Also
/// the most of an unknown method's name echoed back in an error.
pub const MAX_METHOD_NAME_LEN: usize = 128;

/// A request that has begun must arrive in full within this time, and a
/// reply must be taken by the client within it; otherwise the connection is
/// closed, so a stalled client cannot hold a connection thread mid-request.
/// An idle connection between requests is kept (Longhorn's SPDK client keeps
/// one open); the cap bounds how many.
pub const REQUEST_IO_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a stop waits for connection threads (a method may be running).
pub(crate) const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);

/// The built-in method listing all methods.
pub const RPC_GET_METHODS: &str = "rpc_get_methods";

/// Why a method failed; each maps to a JSON-RPC error code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RpcMethodError {
    /// -32602: the parameters do not fit the method.
    #[error("Invalid parameters: {0}")]
    InvalidParams(String),
    /// -32603: the method was valid but failed.
    #[error("{0}")]
    Internal(String),
    /// Any other code, e.g. an application code in -32000..-32099.
    #[error("{message}")]
    Custom { code: i64, message: String },
}

impl RpcMethodError {
    pub fn code(&self) -> i64 {
        match self {
            RpcMethodError::InvalidParams(_) => INVALID_PARAMS,
            RpcMethodError::Internal(_) => INTERNAL_ERROR,
            RpcMethodError::Custom { code, .. } => *code,
        }
    }
}

/// A method: takes the request's `params` (absent → `None`), returns the
/// `result`. Runs on a connection thread; it may block, but should not for
/// long (a stop waits `SHUTDOWN_WAIT` for it).
pub type RpcHandler = Box<dyn Fn(Option<Value>) -> Result<Value, RpcMethodError> + Send + Sync>;

/// Decode named parameters into `T` (use `#[serde(deny_unknown_fields)]`).
/// Absent params decode as `{}`, so a struct of optional fields accepts
/// them; positional (array) params are refused, as SPDK does.
pub fn parse_params<T: DeserializeOwned>(params: Option<Value>) -> Result<T, RpcMethodError> {
    let v = match params {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(v @ Value::Object(_)) => v,
        Some(_) => {
            return Err(RpcMethodError::InvalidParams(
                "params must be an object (named parameters)".into(),
            ))
        }
    };
    serde_json::from_value(v).map_err(|e| RpcMethodError::InvalidParams(e.to_string()))
}

/// Refuse any params except none or `{}`.
pub fn no_params(params: Option<Value>) -> Result<(), RpcMethodError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Empty {}
    parse_params::<Empty>(params).map(|_| ())
}

/// The methods a server answers.
#[derive(Default)]
pub struct MethodRegistry {
    methods: BTreeMap<String, RpcHandler>,
}

impl std::fmt::Debug for MethodRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MethodRegistry")
            .field("methods", &self.names())
            .finish()
    }
}

impl MethodRegistry {
    /// A registry with only the built-in `rpc_get_methods`.
    pub fn new() -> MethodRegistry {
        MethodRegistry::default()
    }

    /// Add a method. Names are 1 to `MAX_METHOD_NAME_LEN` bytes of ASCII
    /// letters, digits and `_`; a name is registered once.
    pub fn register(&mut self, name: &str, handler: RpcHandler) -> Result<(), RpcError> {
        let valid = !name.is_empty()
            && name.len() <= MAX_METHOD_NAME_LEN
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid {
            return Err(RpcError::BadMethodName(name.to_string()));
        }
        if name == RPC_GET_METHODS || self.methods.contains_key(name) {
            return Err(RpcError::DuplicateMethod(name.to_string()));
        }
        self.methods.insert(name.to_string(), handler);
        Ok(())
    }

    /// Every method name, sorted, the built-in included.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.methods.keys().cloned().collect();
        names.push(RPC_GET_METHODS.to_string());
        names.sort();
        names
    }

    /// Run one method by name.
    pub fn call(&self, method: &str, params: Option<Value>) -> Result<Value, RpcMethodError> {
        if method == RPC_GET_METHODS {
            // SPDK's options; every lull method is available at runtime.
            #[derive(serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            #[allow(dead_code)]
            struct GetMethods {
                current: Option<bool>,
                include_aliases: Option<bool>,
            }
            parse_params::<GetMethods>(params)?;
            return Ok(json!(self.names()));
        }
        let Some(handler) = self.methods.get(method) else {
            return Err(RpcMethodError::Custom {
                code: METHOD_NOT_FOUND,
                message: format!(
                    "Method not found: {}",
                    truncate(method, MAX_METHOD_NAME_LEN)
                ),
            });
        };
        match catch_unwind(AssertUnwindSafe(|| handler(params))) {
            Ok(r) => r,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                tracing::error!(method, panic = %what, "RPC method panicked");
                Err(RpcMethodError::Internal(format!(
                    "method {method} failed unexpectedly"
                )))
            }
        }
    }
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// An error response.
pub fn error_response(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

/// Answer one parsed request value (a request or a batch). `None`: nothing
/// to send (notifications only).
pub fn handle_value(registry: &MethodRegistry, v: Value) -> Option<Value> {
    match v {
        Value::Array(items) => {
            if items.is_empty() {
                return Some(error_response(
                    Value::Null,
                    INVALID_REQUEST,
                    "Invalid Request: empty batch",
                ));
            }
            if items.len() > MAX_BATCH_LEN {
                let msg = format!(
                    "Invalid Request: batch of {} exceeds {MAX_BATCH_LEN} requests",
                    items.len()
                );
                return Some(error_response(Value::Null, INVALID_REQUEST, &msg));
            }
            let out: Vec<Value> = items
                .into_iter()
                .filter_map(|r| handle_request(registry, r))
                .collect();
            if out.is_empty() {
                None
            } else {
                Some(Value::Array(out))
            }
        }
        other => handle_request(registry, other),
    }
}

fn handle_request(registry: &MethodRegistry, v: Value) -> Option<Value> {
    let Value::Object(mut obj) = v else {
        return Some(error_response(
            Value::Null,
            INVALID_REQUEST,
            "Invalid Request: not an object",
        ));
    };
    let (id, notification) = match obj.remove("id") {
        None => (Value::Null, true),
        Some(id @ (Value::Null | Value::Number(_) | Value::String(_))) => (id, false),
        Some(_) => {
            return Some(error_response(
                Value::Null,
                INVALID_REQUEST,
                "Invalid Request: id must be a string, number or null",
            ))
        }
    };
    let bad = |msg: &str| {
        Some(error_response(
            id.clone(),
            INVALID_REQUEST,
            &format!("Invalid Request: {msg}"),
        ))
    };
    if obj.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
        return bad("jsonrpc must be \"2.0\"");
    }
    let method = match obj.remove("method") {
        Some(Value::String(m)) => m,
        _ => return bad("method must be a string"),
    };
    let params = match obj.remove("params") {
        None | Some(Value::Null) => None,
        Some(p @ (Value::Object(_) | Value::Array(_))) => Some(p),
        Some(_) => return bad("params must be an object or array"),
    };
    let result = registry.call(&method, params);
    if let Err(e) = &result {
        tracing::debug!(method = truncate(&method, MAX_METHOD_NAME_LEN), code = e.code(), error = %e, "RPC failed");
    }
    if notification {
        return None;
    }
    Some(match result {
        Ok(r) => json!({"jsonrpc": "2.0", "id": id, "result": r}),
        Err(e) => error_response(id, e.code(), &e.to_string()),
    })
}

/// A running JSON-RPC server on a Unix socket.
pub struct RpcServer {
    path: PathBuf,
    /// The inode bound, so a stop removes the socket file only if it is
    /// still ours.
    ino: u64,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
    /// Closed at stop: wakes the accept thread.
    wake: Option<std::io::PipeWriter>,
    conns: Arc<ConnSet<UnixStream>>,
}

impl std::fmt::Debug for RpcServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RpcServer({})", self.path.display())
    }
}

impl RpcServer {
    /// Listen on `path` (mode 0600) and serve `registry`. A socket file left
    /// by a dead server is replaced; a live server's is refused, and so is
    /// any path that is not a socket.
    pub fn start(path: &Path, registry: Arc<MethodRegistry>) -> Result<RpcServer, RpcError> {
        let (listener, ino) = bind_private(path)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = ConnSet::new(MAX_RPC_CONNECTIONS);
        // The accept thread waits on the listener and on this pipe; a stop
        // closes the write end. (Connecting to our own path to wake it is
        // not enough: another server may have renamed its socket over the
        // path since, and the wake-up would reach that one.)
        let (wake_rx, wake) = match std::io::pipe().and_then(|p| {
            listener.set_nonblocking(true)?;
            Ok(p)
        }) {
            Ok(p) => p,
            Err(e) => {
                remove_if_ours(path, ino);
                return Err(RpcError::Thread(e));
            }
        };
        let accept = {
            let stop = stop.clone();
            let conns = conns.clone();
            std::thread::Builder::new()
                .name("rpc-accept".into())
                .spawn(move || accept_loop(listener, wake_rx, registry, stop, conns))
                .map_err(RpcError::Thread)
        };
        let accept = match accept {
            Ok(j) => j,
            Err(e) => {
                remove_if_ours(path, ino);
                return Err(e);
            }
        };
        tracing::info!(path = %path.display(), "JSON-RPC server listening");
        Ok(RpcServer {
            path: path.to_path_buf(),
            ino,
            stop,
            accept: Some(accept),
            wake: Some(wake),
            conns,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stop accepting, close every connection, remove the socket file.
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        let Some(accept) = self.accept.take() else {
            return;
        };
        self.stop.store(true, Ordering::SeqCst);
        // Closing the pipe's write end wakes the accept thread's poll.
        drop(self.wake.take());
        let _ = accept.join();
        let left = self.conns.close_all(SHUTDOWN_WAIT);
        if left > 0 {
            tracing::warn!(connections = left, "RPC connections still busy at stop");
        }
        remove_if_ours(&self.path, self.ino);
    }
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn remove_if_ours(path: &Path, ino: u64) {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.ino() == ino) {
        let _ = std::fs::remove_file(path);
    }
}

/// Distinguishes the private directories of servers in one process.
static BIND_SEQ: AtomicU64 = AtomicU64::new(0);

/// Bind `path` so that it is never connectable with looser permissions than
/// 0600, without touching the process umask: bind inside a fresh 0700
/// directory beside `path` (no one else can reach the socket there), chmod
/// it to 0600, then rename it into place (a socket stays bound through a
/// rename; the rename is atomic). The directory is removed afterwards.
///
/// A stale socket (nothing accepts on it) is replaced; a live one is
/// refused. Two servers starting on one path at the same instant may both
/// pass that check; the later rename wins.
fn bind_private(path: &Path) -> Result<(UnixListener, u64), RpcError> {
    let bind_err = |source: io::Error| RpcError::Bind {
        path: path.to_path_buf(),
        source,
    };
    if path.file_name().is_none() {
        return Err(bind_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a file path",
        )));
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => match UnixStream::connect(path) {
            Ok(_) => return Err(RpcError::InUse(path.to_path_buf())),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                tracing::info!(path = %path.display(), "removing stale RPC socket");
                std::fs::remove_file(path).map_err(bind_err)?;
            }
            Err(e) => return Err(bind_err(e)),
        },
        Ok(_) => return Err(RpcError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let seq = BIND_SEQ.fetch_add(1, Ordering::Relaxed);
    let dir = parent.join(format!(".lullrpc.{}.{seq}", std::process::id()));
    let tmp = dir.join("s");
    // Leftover from a crashed process that had our pid: not recursive, so
    // only that layout is ever removed.
    let _ = std::fs::remove_file(&tmp);
    let _ = std::fs::remove_dir(&dir);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(bind_err)?;
    let result = (|| {
        let listener = UnixListener::bind(&tmp)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        std::fs::rename(&tmp, path)?;
        let ino = std::fs::symlink_metadata(path)?.ino();
        Ok((listener, ino))
    })();
    let _ = std::fs::remove_file(&tmp);
    let _ = std::fs::remove_dir(&dir);
    result.map_err(bind_err)
}

fn accept_loop(
    listener: UnixListener,
    wake: std::io::PipeReader,
    registry: Arc<MethodRegistry>,
    stop: Arc<AtomicBool>,
    conns: Arc<ConnSet<UnixStream>>,
) {
    use rustix::event::{poll, PollFd, PollFlags};
    loop {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let mut fds = [
            PollFd::new(&listener, PollFlags::IN),
            PollFd::new(&wake, PollFlags::IN),
        ];
        if let Err(e) = poll(&mut fds, None) {
            if e != rustix::io::Errno::INTR {
                tracing::warn!(error = %e, "RPC accept: poll failed");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        if !fds[1].revents().is_empty() {
            // The write end closed: a stop.
            return;
        }
        let stream = match listener.accept() {
            // The listener is non-blocking for the poll; a connection is
            // served with blocking reads and writes under its timeouts.
            Ok((s, _)) if s.set_nonblocking(false).is_ok() => s,
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "RPC accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let slot = stream.try_clone().ok().and_then(|h| conns.admit(h));
        let Some(slot) = slot else {
            tracing::warn!(
                limit = MAX_RPC_CONNECTIONS,
                "RPC connection refused: too many connections"
            );
            let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
            let msg = format!("server busy: {MAX_RPC_CONNECTIONS} connections open");
            let _ = send(
                &mut &stream,
                &error_response(Value::Null, SERVER_BUSY, &msg),
            );
            continue;
        };
        let registry = registry.clone();
        let spawned = std::thread::Builder::new()
            .name("rpc-conn".into())
            .spawn(move || serve_connection(stream, &registry, slot));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start an RPC connection thread");
        }
    }
}

fn send<W: Write>(stream: &mut W, v: &Value) -> io::Result<()> {
    let mut bytes = serde_json::to_vec(v).map_err(io::Error::other)?;
    bytes.push(b'\n');
    stream.write_all(&bytes)
}

/// Serve requests until the client closes, breaks the framing, or stalls.
fn serve_connection(stream: UnixStream, registry: &MethodRegistry, _slot: Slot<UnixStream>) {
    if let Err(e) = stream
        .set_read_timeout(Some(REQUEST_IO_TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(REQUEST_IO_TIMEOUT)))
    {
        tracing::warn!(error = %e, "cannot set RPC socket timeouts");
        return;
    }
    serve_requests(&mut &stream, registry);
}

/// The request loop of one connection, whatever carries it (a Unix socket,
/// a TLS session over TCP): the same framing, limits and answers. The
/// caller has set `REQUEST_IO_TIMEOUT` as the socket's read and write
/// timeout, so a read or write that waits longer comes back as
/// `WouldBlock`/`TimedOut`.
pub(crate) fn serve_requests<S: Read + Write>(stream: &mut S, registry: &MethodRegistry) {
    let mut framer = JsonFramer::new(MAX_REQUEST_BYTES);
    loop {
        let frame = match framer.read_frame(stream) {
            Ok(Some(frame)) => frame,
            Ok(None) => return,
            Err(FrameError::Io(e))
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if framer.mid_value() {
                    tracing::warn!("RPC request not completed in time; closing the connection");
                    return;
                }
                continue;
            }
            Err(FrameError::Io(_)) => return,
            Err(e) => {
                tracing::debug!(error = %e, "bad RPC framing; closing the connection");
                let _ = send(stream, &frame_error_response(&e));
                return;
            }
        };
        match answer_frame(registry, &frame) {
            Ok(Some(response)) => {
                if send(stream, &response).is_err() {
                    return;
                }
            }
            Ok(None) => {}
            Err(refusal) => {
                let _ = send(stream, &refusal);
                return;
            }
        }
    }
}

/// The error a connection sends before it closes on a framing error (any
/// `FrameError` but `Io`, which closes without a word).
pub fn frame_error_response(e: &FrameError) -> Value {
    let code = match e {
        FrameError::TooLarge { .. } | FrameError::NotStructured(_) => INVALID_REQUEST,
        _ => PARSE_ERROR,
    };
    let prefix = if code == PARSE_ERROR {
        "Parse error"
    } else {
        "Invalid Request"
    };
    error_response(Value::Null, code, &format!("{prefix}: {e}"))
}

/// Answer one framed request (what [`JsonFramer`] returned): `Ok(Some)` is
/// the response, `Ok(None)` nothing to send (notifications only), `Err` a
/// parse error to send before closing the connection.
pub fn answer_frame(registry: &MethodRegistry, frame: &[u8]) -> Result<Option<Value>, Value> {
    let value: Value = match serde_json::from_slice(frame) {
        Ok(v) => v,
        Err(e) => {
            tracing::debug!(error = %e, "malformed JSON-RPC request; closing the connection");
            return Err(error_response(
                Value::Null,
                PARSE_ERROR,
                &format!("Parse error: {e}"),
            ));
        }
    };
    Ok(handle_value(registry, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registry() -> MethodRegistry {
        let mut r = MethodRegistry::new();
        r.register("echo", Box::new(|p| Ok(p.unwrap_or(Value::Null))))
            .unwrap();
        r.register("boom", Box::new(|_| panic!("kaboom"))).unwrap();
        r
    }

    #[test]
    fn register_rules() {
        let mut r = registry();
        assert!(matches!(
            r.register("echo", Box::new(|_| Ok(Value::Null))),
            Err(RpcError::DuplicateMethod(_))
        ));
        assert!(matches!(
            r.register(RPC_GET_METHODS, Box::new(|_| Ok(Value::Null))),
            Err(RpcError::DuplicateMethod(_))
        ));
        assert!(matches!(
            r.register("", Box::new(|_| Ok(Value::Null))),
            Err(RpcError::BadMethodName(_))
        ));
        assert!(matches!(
            r.register("a b", Box::new(|_| Ok(Value::Null))),
            Err(RpcError::BadMethodName(_))
        ));
        assert_eq!(r.names(), vec!["boom", "echo", "rpc_get_methods"]);
    }

    /// Found by fuzzing (`fuzz/corpus/rpc_request/crash-float-id-echo`):
    /// serde_json's default float parsing can be one ULP off, so an id
    /// that is not an integer of 64 bits came back as another number.
    #[test]
    fn ids_echo_the_number_the_client_sent() {
        let r = registry();
        for frame in [
            &br#"{"jsonrpc":"2.0","method":"echo","id":1222222222222222222222222222222}"#[..],
            br#"{"sonrpc":"3.0","id":1222222222222222222222222222222}"#,
            br#"{"jsonrpc":"2.0","method":"echo","id":0.30000000000000004441}"#,
        ] {
            let resp = answer_frame(&r, frame).unwrap().unwrap();
            let sent: Value = serde_json::from_slice(frame).unwrap();
            let want: f64 = std::str::from_utf8(frame)
                .unwrap()
                .split("\"id\":")
                .nth(1)
                .unwrap()
                .trim_end_matches('}')
                .parse()
                .unwrap();
            assert_eq!(sent["id"].as_f64(), Some(want));
            assert_eq!(resp["id"].as_f64(), Some(want));
            let text = serde_json::to_string(&resp).unwrap();
            let again: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(serde_json::to_string(&again).unwrap(), text);
        }
    }

    #[test]
    fn request_rules() {
        let r = registry();
        let call = |v: Value| handle_value(&r, v);
        let ok =
            call(json!({"jsonrpc": "2.0", "id": 7, "method": "echo", "params": {"a": 1}})).unwrap();
        assert_eq!(ok, json!({"jsonrpc": "2.0", "id": 7, "result": {"a": 1}}));
        let code = |v: Option<Value>| v.unwrap()["error"]["code"].as_i64().unwrap();
        assert_eq!(
            code(call(json!({"jsonrpc": "2.0", "id": 1, "method": "nope"}))),
            METHOD_NOT_FOUND
        );
        assert_eq!(
            code(call(json!({"jsonrpc": "1.0", "id": 1, "method": "echo"}))),
            INVALID_REQUEST
        );
        assert_eq!(
            code(call(json!({"jsonrpc": "2.0", "id": 1, "method": 5}))),
            INVALID_REQUEST
        );
        assert_eq!(
            code(call(json!({"jsonrpc": "2.0", "id": [1], "method": "echo"}))),
            INVALID_REQUEST
        );
        assert_eq!(
            code(call(
                json!({"jsonrpc": "2.0", "id": 1, "method": "echo", "params": 3})
            )),
            INVALID_REQUEST
        );
        assert_eq!(
            code(call(json!({"jsonrpc": "2.0", "id": 1, "method": "boom"}))),
            INTERNAL_ERROR
        );
        assert_eq!(
            code(call(
                json!({"jsonrpc": "2.0", "id": 1, "method": "rpc_get_methods", "params": {"x": 1}})
            )),
            INVALID_PARAMS
        );
        assert_eq!(code(call(json!([]))), INVALID_REQUEST);
        assert_eq!(code(call(json!(17))), INVALID_REQUEST);
        // A notification gets no answer, even when it fails.
        assert!(call(json!({"jsonrpc": "2.0", "method": "boom"})).is_none());
        let batch = call(json!([
            {"jsonrpc": "2.0", "id": "a", "method": "echo", "params": [1]},
            {"jsonrpc": "2.0", "method": "echo"},
            5
        ]))
        .unwrap();
        let batch = batch.as_array().unwrap();
        assert_eq!(batch.len(), 2);
        assert_eq!(batch[0]["result"], json!([1]));
        assert_eq!(batch[1]["error"]["code"], json!(INVALID_REQUEST));
        let long = "x".repeat(10_000);
        let resp = call(json!({"jsonrpc": "2.0", "id": 1, "method": long})).unwrap();
        assert!(resp["error"]["message"].as_str().unwrap().len() < 200);
    }
}
