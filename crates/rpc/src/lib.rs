//! lull's control plane: JSON-RPC 2.0 over a Unix socket (SPDK's
//! convention, method names after SPDK's) and over TCP with TLS only (see
//! [`RpcTcpServer`]), the client `lull rpc` uses (and
//! [`RpcTcpConnection`], a TCP session for many calls), and Prometheus
//! metrics over HTTP.
//!
//! ```ignore
//! use lull_rpc::*;
//! let mut reg = MethodRegistry::new();
//! register_lull_methods(&mut reg, LullContext { fw: fw.handle().clone(), volumes, control })?;
//! let reg = Arc::new(reg);
//! let rpc = RpcServer::start(Path::new(DEFAULT_RPC_SOCKET), reg.clone())?;
//! let tls = RpcTls::Psk("/etc/lull/rpc.psk".into()).server()?;
//! let rpc_tcp = RpcTcpServer::start("0.0.0.0:5260".parse()?, tls, reg)?;
//! let metrics = MetricsServer::start("127.0.0.1:9555".parse()?, source)?;
//! // $ lull rpc framework_get_reactors
//! // $ lull rpc engine_set_options '{"data-engine-interrupt-mode-enabled": false}'
//! // $ lull rpc --addr 10.0.0.7:5260 --tls-psk rpc.psk volume_list
//! // $ curl -s http://127.0.0.1:9555/metrics
//! ```
//!
//! Everything here runs on ordinary OS threads, never on a reactor, so
//! management traffic cannot delay the data path. Each server has a
//! connection cap, a request size limit and I/O timeouts (see the constants).

#![forbid(unsafe_code)]

mod client;
mod conns;
mod framing;
mod http;
mod methods;
mod metrics;
mod scheduler;
mod server;
mod tcp;
mod tcp_client;
pub mod testing;

pub use scheduler::{framework_get_scheduler, register_scheduler_methods};
pub use tcp::{RpcServerTls, RpcTcpServer, RpcTls, RpcTlsError, TLS_HANDSHAKE_TIMEOUT};

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

pub use client::{
    call, RpcClientError, DEFAULT_CLIENT_TIMEOUT_S, DEFAULT_RPC_SOCKET, MAX_RESPONSE_BYTES,
};
pub use framing::{FrameError, JsonFramer};
pub use http::{parse_head, HttpError, RequestHead};
pub use methods::{
    framework_get_reactors, parse_size, register_lull_methods, thread_get_stats, ControlError,
    ControlPlane, LullContext, NewVolume, NoParams, Options, OptionsChange, ReplicaAddr,
    ReplicaVolume, VolumeInfo, VolumeName, VolumeResize, LULL_METHODS, MAX_BACKEND_LEN,
    MAX_MODE_NAME_LEN, MAX_NQN_LEN, MAX_NVMF_ALLOWED_HOSTS, MAX_POLL_PERIOD_US,
    MAX_REPLICA_ADDR_LEN, MAX_VOLUME_NAME_LEN, NVMF_LBA_SIZES, TICK_RATE_HZ,
};
pub use metrics::{
    encode_snapshot, metrics_response, reactor_metrics, MetricsError, MetricsServer,
    MetricsSnapshot, MetricsSource, ReactorMetrics, ReplicaMetrics, StoreMetrics, VolumeMetrics,
    HTTP_IO_TIMEOUT, MAX_HTTP_REQUEST_BYTES, MAX_METRICS_CONNECTIONS, METRICS_PATH,
    OPENMETRICS_CONTENT_TYPE,
};
pub use server::{
    answer_frame, error_response, frame_error_response, handle_value, no_params, parse_params,
    MethodRegistry, RpcHandler, RpcMethodError, RpcServer, INTERNAL_ERROR, INVALID_PARAMS,
    INVALID_REQUEST, MAX_BATCH_LEN, MAX_METHOD_NAME_LEN, MAX_REQUEST_BYTES, MAX_RPC_CONNECTIONS,
    METHOD_NOT_FOUND, PARSE_ERROR, REQUEST_IO_TIMEOUT, RPC_GET_METHODS, SERVER_BUSY,
};
pub use tcp_client::{call_tcp, RpcTcpConnection, SentCall};

/// Errors of the RPC server and registry.
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    #[error("another server is listening on {}", .0.display())]
    InUse(PathBuf),
    #[error("{} exists and is not a socket; not replacing it", .0.display())]
    NotASocket(PathBuf),
    #[error("cannot bind {}: {source}", path.display())]
    Bind { path: PathBuf, source: io::Error },
    #[error("cannot listen on {addr}: {source}")]
    BindTcp { addr: SocketAddr, source: io::Error },
    #[error("invalid method name {0:?}: 1 to {MAX_METHOD_NAME_LEN} bytes of [A-Za-z0-9_]")]
    BadMethodName(String),
    #[error("method {0:?} is already registered")]
    DuplicateMethod(String),
    #[error("cannot start the RPC thread: {0}")]
    Thread(io::Error),
}
