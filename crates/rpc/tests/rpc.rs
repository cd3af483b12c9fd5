//! The JSON-RPC server over a real Unix socket: every lull method against a
//! real one-reactor framework and the fake control plane, and malformed input;
//! then the same registry over TCP with TLS (PSK and mutual certificates),
//! and clients without the key.
//!
//! The certificate tests need the `openssl` command (Debian package
//! openssl; scripts/test installs it).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

// The lull binary's test certificates (this crate cannot depend on its
// tests).
#[path = "../../lull/tests/common/pki.rs"]
mod pki;
use pki::make_pki;

use lull_reactor::{Framework, FrameworkConfig, Mode};
use lull_rpc::testing::FakeControl;
use lull_rpc::*;
use lull_volume::{Storage, Volume, Volumes};
use serde_json::{json, Value};

const TIMEOUT: Duration = Duration::from_secs(30);

/// A fresh directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "lull-rpc-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Setup {
    _dir: TempDir,
    sock: PathBuf,
    fw: Framework,
    volumes: Arc<Volumes>,
    /// What the Unix socket serves, for a TCP server to serve too.
    registry: Arc<MethodRegistry>,
    server: Option<RpcServer>,
}

fn setup() -> Setup {
    let dir = TempDir::new();
    let sock = dir.0.join("lull.sock");
    let fw = Framework::start(test_config()).unwrap();
    fw.handle().spawn_thread(0, "test_thread", |_| {}).unwrap();
    let volumes = Arc::new(Volumes::default());
    volumes
        .add(Volume::new(
            "vol0",
            Storage::Local(Arc::new(lull_bdev::MallocDev::new(1 << 20).unwrap())),
        ))
        .unwrap();
    let control = Arc::new(FakeControl::new(volumes.clone()));
    let mut reg = MethodRegistry::new();
    register_lull_methods(
        &mut reg,
        LullContext {
            fw: fw.handle().clone(),
            volumes: volumes.clone(),
            control,
        },
    )
    .unwrap();
    let registry = Arc::new(reg);
    let server = RpcServer::start(&sock, registry.clone()).unwrap();
    Setup {
        _dir: dir,
        sock,
        fw,
        volumes,
        registry,
        server: Some(server),
    }
}

impl Setup {
    fn call(&self, method: &str, params: Value) -> Result<Value, RpcClientError> {
        let params = if params.is_null() { None } else { Some(params) };
        call(&self.sock, method, params, TIMEOUT)
    }

    fn ok(&self, method: &str, params: Value) -> Value {
        self.call(method, params)
            .unwrap_or_else(|e| panic!("{method}: {e}"))
    }

    fn code(&self, method: &str, params: Value) -> i64 {
        match self.call(method, params) {
            Err(RpcClientError::Rpc { code, .. }) => code,
            other => panic!("{method}: expected an error response, got {other:?}"),
        }
    }

    fn message(&self, method: &str, params: Value) -> String {
        match self.call(method, params) {
            Err(RpcClientError::Rpc { message, .. }) => message,
            other => panic!("{method}: expected an error response, got {other:?}"),
        }
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        self.fw.stop();
    }
}

/// Send raw bytes, optionally half-close, and read every response until the
/// server closes (or the read times out).
fn raw(path: &Path, bytes: &[u8], half_close: bool) -> (Vec<Value>, bool) {
    let mut s = UnixStream::connect(path).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // A server that gave up on a huge request closes while we still write.
    let _ = s.write_all(bytes);
    if half_close {
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
    let mut out = Vec::new();
    let closed = loop {
        let mut buf = [0u8; 4096];
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break false
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(e) => panic!("read: {e}"),
        }
    };
    let values = serde_json::Deserializer::from_slice(&out)
        .into_iter::<Value>()
        .map(|v| v.unwrap())
        .collect();
    (values, closed)
}

fn err_code(v: &Value) -> i64 {
    v["error"]["code"]
        .as_i64()
        .unwrap_or_else(|| panic!("not an error response: {v}"))
}

#[test]
fn every_method() {
    let t = setup();
    let methods = t.ok("rpc_get_methods", Value::Null);
    for m in LULL_METHODS.iter().chain([&RPC_GET_METHODS]) {
        assert!(
            methods.as_array().unwrap().contains(&json!(m)),
            "{m} missing from {methods}"
        );
    }

    let r = t.ok("framework_get_reactors", Value::Null);
    assert_eq!(r["tick_rate"], json!(TICK_RATE_HZ));
    let reactors = r["reactors"].as_array().unwrap();
    assert_eq!(reactors.len(), 1);
    assert_eq!(reactors[0]["index"], json!(0));
    assert_eq!(reactors[0]["lcore"], json!(0));
    assert_eq!(reactors[0]["mode"], json!("interrupt"));
    assert_eq!(reactors[0]["interrupt_mode_enabled"], json!(true));
    for k in [
        "tid",
        "busy",
        "idle",
        "iterations",
        "wakeups",
        "usr",
        "sys",
        "voluntary_ctxsw",
        "involuntary_ctxsw",
        "minor_faults",
        "major_faults",
        "io_uring_enters",
        "fixed_buffer_bytes",
        "fixed_buffer_in_use_bytes",
    ] {
        assert!(reactors[0][k].is_u64(), "{k} in {r}");
    }
    assert!(reactors[0]["fixed_buffer_locked"].is_boolean(), "{r}");
    let names: Vec<&str> = reactors[0]["lw_threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"test_thread"), "{r}");

    // The reactor's mode shows up as Longhorn's InterruptModeEnabled.
    t.fw.handle().set_mode(0, Mode::Poll).unwrap();
    let r = t.ok("framework_get_reactors", json!({}));
    assert_eq!(r["reactors"][0]["mode"], json!("poll"));
    assert_eq!(r["reactors"][0]["interrupt_mode_enabled"], json!(false));
    assert_eq!(r["reactors"][0]["in_interrupt"], json!(false));
    t.fw.handle().set_mode(0, Mode::Interrupt).unwrap();

    let s = t.ok("thread_get_stats", Value::Null);
    assert_eq!(s["tick_rate"], json!(TICK_RATE_HZ));
    let th = s["threads"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "test_thread")
        .unwrap()
        .clone();
    for k in [
        "id",
        "busy",
        "idle",
        "reactor",
        "active_pollers_count",
        "timed_pollers_count",
        "paused_pollers_count",
    ] {
        assert!(th[k].is_u64(), "{k} in {th}");
    }

    let o = t.ok("engine_get_options", Value::Null);
    assert_eq!(o["mode"], json!("interrupt"));
    assert_eq!(o["nvme_ioq_poll_period_us"], json!(100));
    let o = t.ok(
        "engine_set_options",
        json!({"data-engine-interrupt-mode-enabled": false, "data-engine-nvme-ioq-poll-period-us": 50}),
    );
    assert_eq!(
        (
            o["mode"].clone(),
            o["interrupt_mode_enabled"].clone(),
            o["nvme_ioq_poll_period_us"].clone()
        ),
        (json!("poll"), json!(false), json!(50))
    );
    let o = t.ok(
        "engine_set_options",
        json!({"mode": "interrupt", "nvme_adminq_poll_period_us": 5000}),
    );
    assert_eq!(o["interrupt_mode_enabled"], json!(true));
    assert_eq!(
        t.ok("engine_get_options", Value::Null)["nvme_adminq_poll_period_us"],
        json!(5000)
    );
    assert_eq!(
        t.code(
            "engine_set_options",
            json!({"data-engine-nvme-ioq-poll-period-us": 0})
        ),
        INVALID_PARAMS
    );
    assert_eq!(
        t.code(
            "engine_set_options",
            json!({"data-engine-interrupt-mode-enabled": "yes"})
        ),
        INVALID_PARAMS
    );
    assert_eq!(
        t.code("engine_set_options", json!({"mode": "turbo"})),
        INTERNAL_ERROR,
        "the engine refuses it"
    );

    assert_eq!(
        t.ok("volume_list", Value::Null),
        json!([{"name": "vol0", "size_bytes": 1 << 20, "backend": "malloc"}])
    );
    let c = t.ok("volume_create", json!({"name": "vol1", "size": "2M"}));
    assert_eq!(c["size_bytes"], json!(2 << 20));
    t.ok(
        "volume_create",
        json!({"name": "vol2", "size": 4096, "backend": "malloc"}),
    );
    let list = t.ok("volume_list", Value::Null);
    assert_eq!(list.as_array().unwrap().len(), 3);
    assert_eq!(
        list[1],
        json!({"name": "vol1", "size_bytes": 2 << 20, "backend": "malloc"})
    );
    assert_eq!(
        t.code("volume_create", json!({"name": "vol1", "size": "1M"})),
        INTERNAL_ERROR,
        "duplicate"
    );
    assert_eq!(
        t.code(
            "volume_create",
            json!({"name": "vol3", "size": "1M", "backend": "tape"})
        ),
        INTERNAL_ERROR
    );
    assert_eq!(
        t.code("volume_create", json!({"name": "vol3", "size": "lots"})),
        INVALID_PARAMS
    );
    assert_eq!(
        t.code("volume_create", json!({"name": "vol3", "size": true})),
        INVALID_PARAMS
    );
    assert_eq!(
        t.code("volume_create", json!({"name": 3, "size": 4096})),
        INVALID_PARAMS
    );
    assert_eq!(
        t.code("volume_create", json!({"name": "", "size": 4096})),
        INVALID_PARAMS
    );
    assert_eq!(
        t.code("volume_create", json!({"size": 4096})),
        INVALID_PARAMS
    );
    assert_eq!(
        t.code(
            "volume_create",
            json!({"name": "v", "size": 4096, "colour": "red"})
        ),
        INVALID_PARAMS
    );
    assert_eq!(t.code("volume_create", json!(["v", 4096])), INVALID_PARAMS);

    let st = t.ok("volume_get_stats", json!({"name": "vol1"}));
    assert_eq!(st["name"], json!("vol1"));
    assert_eq!(
        t.code("volume_get_stats", json!({"name": "nope"})),
        INTERNAL_ERROR
    );

    assert_eq!(
        t.ok(
            "replica_add",
            json!({"volume": "vol1", "addr": "10.0.0.2:9502"})
        ),
        json!(true)
    );
    t.ok(
        "replica_add",
        json!({"volume": "vol1", "addr": "10.0.0.3:9502"}),
    );
    assert_eq!(
        t.code(
            "replica_add",
            json!({"volume": "vol1", "addr": "10.0.0.3:9502"})
        ),
        INTERNAL_ERROR
    );
    assert_eq!(
        t.code("replica_add", json!({"volume": "vol1"})),
        INVALID_PARAMS
    );
    assert_eq!(
        t.code(
            "replica_add",
            json!({"volume": "vol1", "addr": "x".repeat(MAX_REPLICA_ADDR_LEN + 1)})
        ),
        INVALID_PARAMS
    );
    let l = t.ok("replica_list", json!({"volume": "vol1"}));
    assert_eq!(l.as_array().unwrap().len(), 2);
    assert_eq!(
        t.ok(
            "replica_remove",
            json!({"volume": "vol1", "addr": "10.0.0.2:9502"})
        ),
        json!(true)
    );
    assert_eq!(
        t.code(
            "replica_remove",
            json!({"volume": "vol1", "addr": "10.0.0.2:9502"})
        ),
        INTERNAL_ERROR
    );
    assert_eq!(
        t.ok("replica_list", json!({"volume": "vol1"})),
        json!([{"addr": "10.0.0.3:9502", "healthy": true}])
    );

    // volume_resize: grows; refuses shrinking, odd sizes and unknown
    // volumes with the server's message; bad parameters at the edge.
    let r = t.ok("volume_resize", json!({"name": "vol1", "size": "4M"}));
    assert_eq!(r["size_bytes"], json!(4 << 20));
    assert_eq!(
        t.ok("volume_resize", json!({"name": "vol1", "size": 4 << 20}))["size_bytes"],
        json!(4 << 20),
        "the same size again is a no-op"
    );
    for (params, code) in [
        (json!({"name": "vol1", "size": "1M"}), INTERNAL_ERROR),
        (
            json!({"name": "vol1", "size": (8 << 20) + 1}),
            INTERNAL_ERROR,
        ),
        (json!({"name": "nope", "size": "8M"}), INTERNAL_ERROR),
        (json!({"name": "vol1", "size": 0}), INVALID_PARAMS),
        (json!({"name": "vol1"}), INVALID_PARAMS),
        (
            json!({"name": "vol1", "size": "8M", "shrink": true}),
            INVALID_PARAMS,
        ),
    ] {
        assert_eq!(t.code("volume_resize", params.clone()), code, "{params}");
    }
    assert!(t
        .message("volume_resize", json!({"name": "vol1", "size": "1M"}))
        .contains("cannot shrink"));
    // NVMe/TCP options are checked at the edge (the fake server has no
    // target: it accepts what passes).
    for bad in [
        json!({"name": "n1", "size": "1M", "nvmf_lba": 1024}),
        json!({"name": "n1", "size": "1M", "nvmf_nqn": ""}),
        json!({"name": "n1", "size": "1M", "nvmf_nqn": "n".repeat(224)}),
        json!({"name": "n1", "size": "1M", "nvmf_allow_hosts": "nqn.x"}),
        json!({"name": "n1", "size": "1M", "nvmf_allow_hosts": vec!["nqn.h"; 257]}),
    ] {
        assert_eq!(
            t.code("volume_create", bad.clone()),
            INVALID_PARAMS,
            "{bad}"
        );
    }

    assert_eq!(t.ok("volume_delete", json!({"name": "vol2"})), json!(true));
    assert_eq!(
        t.code("volume_delete", json!({"name": "vol2"})),
        INTERNAL_ERROR
    );
    assert_eq!(t.volumes.list().len(), 2);

    assert_eq!(
        t.code("framework_get_reactors", json!({"verbose": true})),
        INVALID_PARAMS
    );
    assert_eq!(t.code("no_such_method", Value::Null), METHOD_NOT_FOUND);
}

#[test]
fn scheduler_methods() {
    let t = setup();
    let s = t.ok("framework_get_scheduler", Value::Null);
    assert_eq!(s["scheduler_name"], json!("static"));
    assert_eq!(s["scheduler_period"], json!(1_000_000));
    assert_eq!(
        (&s["load_limit"], &s["core_limit"], &s["core_busy"]),
        (&json!(20), &json!(80), &json!(95))
    );
    assert!(s["governor_name"].is_string(), "{s}");

    // SPDK's parameter names; unset tunables keep their values.
    t.ok(
        "framework_set_scheduler",
        json!({"name": "dynamic", "period": 200_000, "core_limit": 70}),
    );
    let s = t.ok("framework_get_scheduler", Value::Null);
    assert_eq!(s["scheduler_name"], json!("dynamic"));
    assert_eq!(s["scheduler_period"], json!(200_000));
    assert_eq!(s["core_limit"], json!(70));
    assert_eq!(s["load_limit"], json!(20));
    t.ok(
        "framework_set_scheduler",
        json!({"name": "static", "period_us": 500_000}),
    );
    let s = t.ok("framework_get_scheduler", Value::Null);
    assert_eq!(s["scheduler_name"], json!("static"));
    assert_eq!(s["core_limit"], json!(70), "tunables are kept for later");

    for bad in [
        json!({"name": "round-robin"}),
        json!({"name": "dynamic", "period_us": 1}),
        json!({"name": "dynamic", "load_limit": 90, "core_limit": 80}),
        json!({"name": "dynamic", "core_busy": 300}),
        json!({"name": "static", "core_limit": 50}),
        json!({"name": "dynamic", "bogus": 1}),
        json!({}),
    ] {
        assert_eq!(
            t.code("framework_set_scheduler", bad.clone()),
            -32602,
            "{bad}"
        );
    }
    assert_eq!(
        t.ok("framework_get_scheduler", Value::Null)["scheduler_name"],
        json!("static")
    );

    let r = t.ok("framework_get_reactors", Value::Null);
    assert_eq!(r["reactors"][0]["sleeping"], json!(false), "{r}");
    assert!(r["reactors"][0]["threads_moved_in"].is_u64());
    let th = t.ok("thread_get_stats", Value::Null);
    assert_eq!(th["threads"][0]["pinned"], json!(false), "{th}");
}

#[test]
fn malformed_input() {
    let t = setup();
    let p = &t.sock;

    let (v, closed) = raw(p, b"hello\n", false);
    assert_eq!(v.len(), 1);
    assert_eq!(err_code(&v[0]), PARSE_ERROR);
    assert!(closed);

    let (v, closed) = raw(p, br#"{"jsonrpc":"2.0","id":1,"method":"rpc_get_"#, true);
    assert_eq!(err_code(&v[0]), PARSE_ERROR, "truncated");
    assert!(closed);

    let (v, closed) = raw(p, br#"{"jsonrpc":"2.0","id":1,"method":"x",}"#, false);
    assert_eq!(err_code(&v[0]), PARSE_ERROR, "trailing comma");
    assert!(closed);

    let (v, _) = raw(
        p,
        b"{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"\xff\"}",
        false,
    );
    assert_eq!(err_code(&v[0]), PARSE_ERROR, "invalid UTF-8");

    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let (v, _) = raw(p, deep.as_bytes(), false);
    assert_eq!(
        err_code(&v[0]),
        PARSE_ERROR,
        "nesting beyond serde_json's limit"
    );

    let huge = format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"x","params":{{"a":"{}"}}}}"#,
        "x".repeat(2 * MAX_REQUEST_BYTES)
    );
    let (v, closed) = raw(p, huge.as_bytes(), false);
    assert_eq!(v.len(), 1);
    assert_eq!(err_code(&v[0]), INVALID_REQUEST, "over the size limit");
    assert!(v[0]["error"]["message"].as_str().unwrap().contains("limit"));
    assert!(closed);

    let (v, closed) = raw(p, b"42", false);
    assert_eq!(err_code(&v[0]), INVALID_REQUEST);
    assert!(closed);

    // Errors that keep the connection: several requests, back to back and
    // newline-delimited, on one write, answered in order.
    let reqs = concat!(
        r#"{"jsonrpc":"2.0","id":1,"method":"no_such"}"#,
        r#"{"jsonrpc":"2.0","id":2,"method":"volume_create","params":{"name":"v","size":"1G","extra":1}}"#,
        "\n",
        r#"{"jsonrpc":"2.0","id":3,"method":"volume_create","params":{"name":["v"],"size":1}}"#,
        "\n  \n",
        r#"{"jsonrpc":"2.0","method":"volume_list"}"#,
        r#"{"jsonrpc":"2.0","id":"four","method":"volume_list","params":null}"#,
        r#"{"id":5,"method":"volume_list"}"#,
        r#"[]"#,
        r#"[{"jsonrpc":"2.0","id":6,"method":"volume_list"},{"jsonrpc":"2.0","method":"volume_list"},{"jsonrpc":"2.0","id":7,"method":"nope"}]"#,
        r#"{"jsonrpc":"2.0","id":8,"method":"engine_set_options","params":{"nvme_ioq_poll_period_us":-1}}"#,
    );
    let (v, closed) = raw(p, reqs.as_bytes(), true);
    assert!(closed);
    assert_eq!(v.len(), 8, "{v:?}");
    assert_eq!(
        (v[0]["id"].clone(), err_code(&v[0])),
        (json!(1), METHOD_NOT_FOUND)
    );
    assert_eq!(
        (v[1]["id"].clone(), err_code(&v[1])),
        (json!(2), INVALID_PARAMS)
    );
    assert!(
        v[1]["error"]["message"].as_str().unwrap().contains("extra"),
        "{}",
        v[1]
    );
    assert_eq!(
        (v[2]["id"].clone(), err_code(&v[2])),
        (json!(3), INVALID_PARAMS)
    );
    // The notification got no answer.
    assert_eq!(v[3]["id"], json!("four"));
    assert_eq!(v[3]["result"][0]["name"], json!("vol0"));
    assert_eq!(v[3]["jsonrpc"], json!("2.0"));
    assert_eq!(
        (v[4]["id"].clone(), err_code(&v[4])),
        (json!(5), INVALID_REQUEST)
    );
    assert_eq!(err_code(&v[5]), INVALID_REQUEST, "empty batch");
    let batch = v[6].as_array().unwrap();
    assert_eq!(batch.len(), 2);
    assert_eq!(batch[0]["id"], json!(6));
    assert!(batch[0]["result"].is_array());
    assert_eq!(
        (batch[1]["id"].clone(), err_code(&batch[1])),
        (json!(7), METHOD_NOT_FOUND)
    );
    assert_eq!(
        (v[7]["id"].clone(), err_code(&v[7])),
        (json!(8), INVALID_PARAMS)
    );

    // The server is still fine.
    t.ok("volume_list", Value::Null);
}

#[test]
fn socket_file_rules() {
    let t = setup();
    let mode = std::fs::metadata(&t.sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    let leftovers: Vec<_> = std::fs::read_dir(t.sock.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        leftovers,
        vec![std::ffi::OsString::from("lull.sock")],
        "no temporary files left"
    );

    // A live server's socket is refused.
    let reg = Arc::new(MethodRegistry::new());
    assert!(matches!(
        RpcServer::start(&t.sock, reg.clone()),
        Err(RpcError::InUse(_))
    ));

    let dir = TempDir::new();
    // A regular file is never replaced.
    let file = dir.0.join("not-a-socket");
    std::fs::write(&file, b"keep me").unwrap();
    assert!(matches!(
        RpcServer::start(&file, reg.clone()),
        Err(RpcError::NotASocket(_))
    ));
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");

    // A dead server's socket is replaced.
    let stale = dir.0.join("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let s = RpcServer::start(&stale, reg.clone()).unwrap();
    assert_eq!(
        call(&stale, "rpc_get_methods", None, TIMEOUT).unwrap(),
        json!(["rpc_get_methods"])
    );
    s.shutdown();
    assert!(!stale.exists(), "shutdown removes the socket");
    assert!(matches!(
        call(&stale, "rpc_get_methods", None, TIMEOUT),
        Err(RpcClientError::Connect { .. })
    ));

    assert!(matches!(
        RpcServer::start(&dir.0.join("no/such/dir/s.sock"), reg),
        Err(RpcError::Bind { .. })
    ));
}

#[test]
fn connection_cap() {
    let t = setup();
    let held: Vec<UnixStream> = (0..MAX_RPC_CONNECTIONS)
        .map(|_| UnixStream::connect(&t.sock).unwrap())
        .collect();
    // Every held connection is served (one round trip each proves it was
    // admitted before the next connect).
    for s in &held {
        let mut s = s;
        s.write_all(br#"{"jsonrpc":"2.0","id":1,"method":"rpc_get_methods"}"#)
            .unwrap();
        let mut buf = [0u8; 4096];
        assert!(s.read(&mut buf).unwrap() > 0);
    }
    let (v, closed) = raw(
        &t.sock,
        br#"{"jsonrpc":"2.0","id":1,"method":"rpc_get_methods"}"#,
        false,
    );
    assert_eq!(err_code(&v[0]), SERVER_BUSY);
    assert!(closed);
    drop(held);
}

#[test]
fn client_calls() {
    let t = setup();
    let timeout = Duration::from_secs(30);
    assert!(call(&t.sock, "volume_list", None, timeout).is_ok());
    assert!(call(
        &t.sock,
        "volume_get_stats",
        Some(serde_json::json!({"name": "vol0"})),
        timeout
    )
    .is_ok());
    match call(&t.sock, "no_such", None, timeout) {
        Err(RpcClientError::Rpc { code, .. }) => assert_eq!(code, METHOD_NOT_FOUND),
        other => panic!("{other:?}"),
    }
    let gone = t.sock.with_file_name("nobody-home.sock");
    assert!(matches!(
        call(&gone, "volume_list", None, timeout),
        Err(RpcClientError::Connect { .. })
    ));
}

/// One unpinned reactor on core 0 (tests share the machine), interrupt mode
/// so it sleeps instead of spinning.
fn test_config() -> FrameworkConfig {
    let mut c = FrameworkConfig::new(vec![0], Mode::Interrupt);
    c.pin = false;
    c
}

// JSON-RPC over TCP, TLS only.

const PSK_HEX: &str = "2b7e151628aed2a6abf7158809cf4f3c8a1e0b2c3d4e5f60718293a4b5c6d7e8";
const WRONG_PSK_HEX: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

/// A request any server of this file answers.
const GET_METHODS: &[u8] = br#"{"jsonrpc":"2.0","id":1,"method":"rpc_get_methods"}"#;

/// Every line the process logs at INFO and above, from the first call on.
static LOG: std::sync::Mutex<Vec<u8>> = std::sync::Mutex::new(Vec::new());

struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_logs() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let subscriber = tracing_subscriber::fmt()
            .with_writer(|| LogWriter)
            .with_ansi(false)
            .without_time()
            .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one subscriber");
    });
}

/// The WARN lines that name `peer` (a client's local address).
fn warn_lines(peer: SocketAddr) -> Vec<String> {
    let field = format!("peer={peer}");
    let log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    String::from_utf8_lossy(&log)
        .lines()
        .filter(|l| l.contains(" WARN ") || l.starts_with("WARN "))
        .filter(|l| l.split(' ').any(|word| word == field))
        .map(String::from)
        .collect()
}

/// Wait for the server's WARN line about `peer`, and check it is the only
/// one and says `why`.
fn refused_once(peer: SocketAddr, why: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let lines = warn_lines(peer);
        if !lines.is_empty() {
            assert_eq!(
                lines.len(),
                1,
                "one WARN line per refused connection: {lines:#?}"
            );
            assert!(lines[0].contains(why), "{why:?} not in {:?}", lines[0]);
            return lines[0].clone();
        }
        assert!(
            Instant::now() < deadline,
            "no WARN line about {peer} in the log:\n{}",
            String::from_utf8_lossy(&LOG.lock().unwrap())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Send `GET_METHODS` (when the TLS session let us) and read until the
/// server closes: every byte of application data it sent. Panics if the
/// server neither answers nor closes (a hang).
fn drain<S: Read + Write>(s: &mut S) -> Vec<u8> {
    let _ = s.write_all(GET_METHODS);
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!("the server neither answered nor closed the connection")
            }
            // A reset, or OpenSSL reading the server's alert: closed.
            Err(_) => return got,
        }
    }
}

/// Connect with the client context `ctx` (whatever its key): the local
/// address, and the application data the server sent (the handshake may
/// fail, then there is none).
fn tls_attempt(addr: SocketAddr, ctx: &lull_net::tls::TlsContext) -> (SocketAddr, Vec<u8>) {
    let tcp = TcpStream::connect(addr).unwrap();
    let local = tcp.local_addr().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    match lull_net::link::client_handshake(ctx, tcp, addr.ip(), deadline) {
        Ok(mut tls) => {
            let tcp = tls.get_ref();
            tcp.set_nonblocking(false).unwrap();
            tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            (local, drain(&mut tls))
        }
        Err(_) => (local, Vec::new()),
    }
}

/// Plain TCP: send `bytes`, read what comes back until the server closes.
fn plain_attempt(addr: SocketAddr, bytes: &[u8]) -> (SocketAddr, Vec<u8>) {
    let mut tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let local = tcp.local_addr().unwrap();
    let _ = tcp.write_all(bytes);
    let mut got = Vec::new();
    let _ = tcp.read_to_end(&mut got).map_err(|e| {
        assert!(
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "the server neither answered nor closed the connection"
        )
    });
    (local, got)
}

fn psk_file(dir: &Path, name: &str, line: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("{line}\n")).unwrap();
    path
}

fn start_tcp(registry: &Arc<MethodRegistry>, tls: &RpcTls) -> RpcTcpServer {
    let tls = tls.server().unwrap();
    RpcTcpServer::start("127.0.0.1:0".parse().unwrap(), tls, registry.clone()).unwrap()
}

#[test]
fn tcp_with_psk_serves_the_same_methods_and_refuses_strangers() {
    capture_logs();
    let t = setup();
    let keys = TempDir::new();
    let good = psk_file(&keys.0, "good.psk", &format!("admin:{PSK_HEX}"));
    let wrong = psk_file(&keys.0, "wrong.psk", &format!("admin:{WRONG_PSK_HEX}"));
    let stranger = psk_file(&keys.0, "stranger.psk", &format!("mallory:{PSK_HEX}"));
    let server = start_tcp(&t.registry, &RpcTls::Psk(good.clone()));
    let addr = server.local_addr();
    let target = addr.to_string();
    let client = RpcTls::Psk(good).client().unwrap();

    // The same registry as the Unix socket, with the same answers.
    let over_tcp = call_tcp(&target, &client, "volume_list", None, TIMEOUT).unwrap();
    assert_eq!(over_tcp, t.ok("volume_list", Value::Null));
    assert!(over_tcp.to_string().contains("vol0"), "{over_tcp}");
    match call_tcp(&target, &client, "no_such", None, TIMEOUT) {
        Err(RpcClientError::Rpc { code, .. }) => assert_eq!(code, METHOD_NOT_FOUND),
        other => panic!("{other:?}"),
    }
    let stats = call_tcp(
        &target,
        &client,
        "volume_get_stats",
        Some(json!({"name": "vol0"})),
        TIMEOUT,
    );
    assert!(stats.is_ok(), "{stats:?}");

    // Plaintext JSON-RPC: nothing back, one line naming the reason.
    let (peer, got) = plain_attempt(addr, GET_METHODS);
    assert!(
        got.is_empty(),
        "plaintext got {:?}",
        String::from_utf8_lossy(&got)
    );
    let line = refused_once(peer, "not TLS");
    assert!(line.contains("0x7b"), "{line}");
    let mut refused = vec![peer];

    // A wrong key under a known identity, and the right key under an
    // unknown one.
    for file in [&wrong, &stranger] {
        let ctx = RpcTls::Psk(file.clone()).client().unwrap();
        let (peer, got) = tls_attempt(addr, &ctx);
        assert!(
            got.is_empty(),
            "{}: got {:?}",
            file.display(),
            String::from_utf8_lossy(&got)
        );
        refused_once(peer, "TLS handshake failed");
        refused.push(peer);
        // What the client reports: the handshake, not a reply.
        match call_tcp(&target, &ctx, "volume_list", None, TIMEOUT) {
            Err(RpcClientError::Tls { .. }) => {}
            other => panic!("{}: expected a TLS error, got {other:?}", file.display()),
        }
    }

    // TLS, but garbage instead of a ClientHello.
    let mut garbage = vec![0x16, 0x03, 0x01, 0x00, 0x05];
    garbage.extend_from_slice(b"hello");
    let (peer, got) = plain_attempt(addr, &garbage);
    // At most OpenSSL's alert record (type 0x15, 5 + 2 bytes): TLS, no
    // JSON-RPC.
    assert!(
        got.is_empty() || (got[0] == 0x15 && got.len() == 7),
        "got {got:02x?}"
    );
    refused_once(peer, "TLS handshake failed");
    refused.push(peer);

    // A client that connects and leaves at once.
    let peer = TcpStream::connect(addr).unwrap().local_addr().unwrap();
    refused_once(peer, "closed the connection before a TLS handshake");
    refused.push(peer);

    // Still serving the right key, and still one line per refusal.
    assert_eq!(
        call_tcp(&target, &client, "volume_list", None, TIMEOUT).unwrap(),
        over_tcp
    );
    for peer in refused {
        assert_eq!(warn_lines(peer).len(), 1, "{peer}");
    }

    // A clean stop: open sessions are closed, the port is let go.
    let mut held = TcpStream::connect(addr).unwrap();
    held.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    server.shutdown();
    let mut buf = [0u8; 16];
    assert!(matches!(held.read(&mut buf), Ok(0) | Err(_)));
    assert!(
        TcpStream::connect(addr).is_err(),
        "{addr} still accepts after the stop"
    );
    drop(t);
}

#[test]
fn tcp_with_mutual_certificates() {
    capture_logs();
    let t = setup();
    let dir = TempDir::new();
    let pki = dir.0.join("pki");
    make_pki(&pki);
    let server = start_tcp(&t.registry, &RpcTls::Certs(pki.clone()));
    let addr = server.local_addr();
    let target = addr.to_string();
    let client = RpcTls::Certs(pki.clone()).client().unwrap();
    let listed = call_tcp(&target, &client, "volume_list", None, TIMEOUT).unwrap();
    assert_eq!(listed, t.ok("volume_list", Value::Null));

    // No client certificate at all (TlsContext always loads one, so plain
    // OpenSSL): TLS 1.3 lets the client finish its side, then the server
    // refuses.
    let mut refused = Vec::new();
    {
        let mut b =
            openssl::ssl::SslConnector::builder(openssl::ssl::SslMethod::tls_client()).unwrap();
        b.set_ca_file(pki.join("ca-cert.pem")).unwrap();
        let connector = b.build();
        let tcp = TcpStream::connect(addr).unwrap();
        tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let peer = tcp.local_addr().unwrap();
        if let Ok(mut tls) = connector.connect("127.0.0.1", tcp) {
            let got = drain(&mut tls);
            assert!(got.is_empty(), "got {:?}", String::from_utf8_lossy(&got));
        }
        let line = refused_once(peer, "TLS handshake failed");
        assert!(line.contains("certificate"), "{line}");
        refused.push(peer);
    }

    // A certificate from another CA: the client trusts the server, the
    // server does not trust the client.
    let other = dir.0.join("other");
    make_pki(&other);
    let mixed = dir.0.join("mixed");
    std::fs::create_dir_all(&mixed).unwrap();
    std::fs::copy(pki.join("ca-cert.pem"), mixed.join("ca-cert.pem")).unwrap();
    for f in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(other.join(f), mixed.join(f)).unwrap();
    }
    let untrusted = RpcTls::Certs(mixed).client().unwrap();
    let (peer, got) = tls_attempt(addr, &untrusted);
    assert!(got.is_empty(), "got {:?}", String::from_utf8_lossy(&got));
    refused_once(peer, "TLS handshake failed");
    refused.push(peer);

    // A PSK client on a certificate port.
    let keys = psk_file(&dir.0, "k.psk", &format!("admin:{PSK_HEX}"));
    let (peer, got) = tls_attempt(addr, &RpcTls::Psk(keys).client().unwrap());
    assert!(got.is_empty());
    refused_once(peer, "TLS handshake failed");
    refused.push(peer);

    // Still serving the right client.
    assert_eq!(
        call_tcp(&target, &client, "volume_list", None, TIMEOUT).unwrap(),
        listed
    );
    for peer in refused {
        assert_eq!(warn_lines(peer).len(), 1, "{peer}");
    }

    // A server directory without ca-cert.pem would let anyone in: refused
    // before anything listens.
    let no_ca = dir.0.join("no-ca");
    std::fs::create_dir_all(&no_ca).unwrap();
    for f in ["server-cert.pem", "server-key.pem"] {
        std::fs::copy(pki.join(f), no_ca.join(f)).unwrap();
    }
    match RpcTls::Certs(no_ca.clone()).server() {
        Err(RpcTlsError::NoClientCa(path)) => assert_eq!(path, no_ca.join("ca-cert.pem")),
        other => panic!("expected NoClientCa, got {other:?}"),
    }
    drop(server);
}

/// A peer that connects and says nothing is closed after the handshake
/// timeout, with its one line; the server serves others meanwhile.
#[test]
fn tcp_silent_client_is_closed_at_the_handshake_timeout() {
    capture_logs();
    let keys = TempDir::new();
    let good = psk_file(&keys.0, "good.psk", &format!("admin:{PSK_HEX}"));
    let mut reg = MethodRegistry::new();
    reg.register("echo", Box::new(|p| Ok(p.unwrap_or(Value::Null))))
        .unwrap();
    let server = start_tcp(&Arc::new(reg), &RpcTls::Psk(good.clone()));
    let addr = server.local_addr();
    let mut silent = TcpStream::connect(addr).unwrap();
    silent
        .set_read_timeout(Some(TLS_HANDSHAKE_TIMEOUT * 3))
        .unwrap();
    let peer = silent.local_addr().unwrap();
    let started = Instant::now();
    let client = RpcTls::Psk(good).client().unwrap();
    let echo = call_tcp(
        &addr.to_string(),
        &client,
        "echo",
        Some(json!({"a": 1})),
        TIMEOUT,
    );
    assert_eq!(echo.unwrap(), json!({"a": 1}));
    let mut buf = [0u8; 16];
    match silent.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the silent connection was not closed: {other:?}"),
    }
    assert!(
        started.elapsed() >= TLS_HANDSHAKE_TIMEOUT - Duration::from_millis(500),
        "closed after {:?}, before the handshake timeout",
        started.elapsed()
    );
    refused_once(peer, "no TLS handshake within");
}

/// Past `MAX_RPC_CONNECTIONS` open TCP connections a new one is closed at
/// once with a line; a slot freed is taken again.
#[test]
fn tcp_connection_cap() {
    capture_logs();
    let keys = TempDir::new();
    let good = psk_file(&keys.0, "good.psk", &format!("admin:{PSK_HEX}"));
    let server = start_tcp(&Arc::new(MethodRegistry::new()), &RpcTls::Psk(good.clone()));
    let addr = server.local_addr();
    let client = RpcTls::Psk(good).client().unwrap();
    // Each held session answers once, so it was admitted before the next.
    let mut held = Vec::new();
    for _ in 0..MAX_RPC_CONNECTIONS {
        let tcp = TcpStream::connect(addr).unwrap();
        let deadline = Instant::now() + TIMEOUT;
        let mut tls = lull_net::link::client_handshake(&client, tcp, addr.ip(), deadline).unwrap();
        tls.get_ref().set_nonblocking(false).unwrap();
        tls.get_ref().set_read_timeout(Some(TIMEOUT)).unwrap();
        tls.write_all(GET_METHODS).unwrap();
        let mut framer = JsonFramer::new(MAX_RESPONSE_BYTES);
        let frame = framer.read_frame(&mut tls).unwrap().expect("an answer");
        let v: Value = serde_json::from_slice(&frame).unwrap();
        assert_eq!(v["result"], json!([RPC_GET_METHODS]));
        held.push(tls);
    }
    let (peer, got) = tls_attempt(addr, &client);
    assert!(got.is_empty());
    refused_once(peer, "too many connections");
    // What a client is told: the server hung up before the handshake,
    // perhaps at its limit; not that the credentials differ.
    match call_tcp(&addr.to_string(), &client, RPC_GET_METHODS, None, TIMEOUT) {
        Err(e @ RpcClientError::ClosedBeforeTls { .. }) => {
            let text = e.to_string();
            let limit = format!("at its limit of {MAX_RPC_CONNECTIONS} JSON-RPC connections");
            assert!(text.contains(&limit), "{text}");
            assert!(!text.contains("credentials do not match"), "{text}");
        }
        other => panic!("past the cap: {other:?}"),
    }
    drop(held);
    // The slots come back as the server sees the closes.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match call_tcp(&addr.to_string(), &client, RPC_GET_METHODS, None, TIMEOUT) {
            Ok(v) => {
                assert_eq!(v, json!([RPC_GET_METHODS]));
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "no slot came back: {e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A stop must not depend on the socket path still being ours: two servers
/// starting on one path at the same instant may both bind, and the later
/// rename wins. The stop of the other one used to wake its accept thread by
/// connecting to the path, reached the winner instead, and waited forever.
#[test]
fn stop_returns_when_another_socket_was_renamed_over_the_path() {
    let dir = TempDir::new();
    let path = dir.0.join("rpc.sock");
    let server = RpcServer::start(&path, Arc::new(MethodRegistry::new())).unwrap();
    let other_path = dir.0.join("other.sock");
    let other = UnixListener::bind(&other_path).unwrap();
    std::fs::rename(&other_path, &path).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        server.shutdown();
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the stop returned while another server owns the path");
    // The winner's socket file is not removed by the loser's stop.
    assert!(path.exists());
    drop(other);
}
