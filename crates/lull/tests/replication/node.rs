//! A node: `lull serve --store DIR` holding many replicas on one port,
//! created over JSON-RPC (the Unix socket and TCP with TLS), volumes on
//! other daemons using them, everything SIGKILLed and restarted; bad input
//! at every edge; a store whose filesystem fills; a `lull replica`
//! directory adopted by a store. Real clients (qemu-io, nbdcopy, fio)
//! check the data.
//!
//! ```text
//! cargo test -p lull --profile ci --test replication node::
//! ```

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{
    self, require, rpc, rpc_outcome, state, Kind, Replica, Scratch, Server, Tmpfs,
};
use serde_json::{json, Value};

/// How long volumes may take to have every replica healthy after a start
/// (a reconcile after a crash included) on a loaded 2-core machine.
const HEALTHY_TIMEOUT: Duration = Duration::from_secs(90);
const RPC_TIMEOUT: Duration = Duration::from_secs(20);

/// A PSK file (`identity:hexkey`) for the network RPC.
fn psk_file(path: &Path, key_byte: u8) {
    let key: String = (0..32).map(|i| format!("{:02x}", key_byte ^ i)).collect();
    std::fs::write(path, format!("admin:{key}\n")).expect("write the PSK file");
}

fn tcp_call(addr: SocketAddr, psk: &Path, method: &str, params: Value) -> Result<Value, String> {
    let ctx = lull_rpc::RpcTls::Psk(psk.to_path_buf())
        .client()
        .map_err(|e| e.to_string())?;
    lull_rpc::call_tcp(
        &addr.to_string(),
        &ctx,
        method,
        (!params.is_null()).then_some(params),
        RPC_TIMEOUT,
    )
    .map_err(|e| e.to_string())
}

/// A daemon's fixed addresses and directories, so it restarts as itself.
struct Node {
    store: PathBuf,
    replica_port: SocketAddr,
    rpc_sock: PathBuf,
    /// `--rpc-listen` and its PSK, when the node serves RPC over TCP.
    rpc_tcp: Option<(SocketAddr, PathBuf)>,
    extra: Vec<String>,
}

impl Node {
    fn new(dir: &Path, name: &str) -> Node {
        Node {
            store: dir.join(name),
            replica_port: common::free_port(),
            rpc_sock: dir.join(format!("{name}.sock")),
            rpc_tcp: None,
            extra: Vec::new(),
        }
    }

    fn args(&self) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--store".into(),
            self.store.display().to_string(),
            "--replica-listen".into(),
            self.replica_port.to_string(),
            "--replica-insecure".into(),
            "--rpc-socket".into(),
            self.rpc_sock.display().to_string(),
        ];
        if let Some((addr, psk)) = &self.rpc_tcp {
            a.extend([
                "--rpc-listen".into(),
                addr.to_string(),
                "--rpc-tls-psk".into(),
                psk.display().to_string(),
            ]);
        }
        a.extend(self.extra.iter().cloned());
        a
    }

    fn start(&self) -> Server {
        let args = self.args();
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        Server::start(&refs)
    }

    /// Starts the daemon expecting it to refuse to start: its exit status
    /// and stderr.
    fn start_fails(&self) -> (std::process::ExitStatus, String) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_lull"))
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(self.args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn lull serve");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait().expect("wait") {
                let mut err = String::new();
                child
                    .stderr
                    .take()
                    .expect("stderr")
                    .read_to_string(&mut err)
                    .expect("read stderr");
                return (status, err);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("lull serve started over a corrupt record (it should have refused)");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn rpc(&self, method: &str, params: Value) -> Value {
        rpc(&self.rpc_sock, method, &params_text(&params))
    }

    fn rpc_err(&self, method: &str, params: Value) -> String {
        let (ok, text) = rpc_outcome(&self.rpc_sock, method, &params_text(&params));
        assert!(!ok, "{method} {params} should have failed: {text}");
        text
    }

    fn target(&self, replica: &str) -> String {
        format!("{}/{replica}", self.replica_port)
    }
}

fn params_text(p: &Value) -> String {
    if p.is_null() {
        String::new()
    } else {
        p.to_string()
    }
}

/// Waits until every volume named has all its replicas healthy.
fn wait_healthy(node: &Node, server: &Server, volumes: &[String]) {
    let deadline = Instant::now() + HEALTHY_TIMEOUT;
    for v in volumes {
        let mut list = Vec::new();
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            common::wait_until(left, || {
                list = state::replica_states(&node.rpc_sock, v);
                state::all_healthy(&list)
            }),
            "volume {v}: replicas {list:?}; log:\n{}",
            server.stderr()
        );
    }
}

fn qemu_io(server: &Server, volume: &str, cmds: &[&str]) -> String {
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = c
        .arg(format!("nbd://{}/{volume}", server.addr()))
        .output()
        .expect("run qemu-io");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success()
            && !text.contains("Pattern verification failed")
            && !text.contains("failed"),
        "qemu-io {cmds:?} on {volume}: {text}"
    );
    text
}

fn nbdcopy(from: &str, to: &str) {
    let out = Command::new("nbdcopy")
        .args([from, to])
        .output()
        .expect("run nbdcopy");
    assert!(
        out.status.success(),
        "nbdcopy {from} {to}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn fio(server: &Server, volume: &str, verify_only: bool) {
    let mut c = Command::new("fio");
    c.args([
        "--name=node",
        "--ioengine=nbd",
        &format!("--uri=nbd://{}/{volume}", server.addr()),
        "--rw=write",
        "--bs=16k",
        "--size=4M",
        "--iodepth=8",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--output-format=json",
    ]);
    if verify_only {
        c.arg("--verify_only=1");
    }
    common::fio_json(&c.output().expect("run fio"));
}

/// The test file for nbdcopy: 4 MiB of a pattern no block repeats.
fn pattern_file(path: &Path) -> Vec<u8> {
    let data = common::pattern(42, 4 << 20);
    std::fs::write(path, &data).expect("write the pattern file");
    data
}

#[test]
fn five_hundred_replicas_and_a_hundred_volumes_survive_sigkill() {
    require("qemu-io", "qemu-utils");
    require("nbdcopy", "libnbd-bin");
    require("fio", "fio");
    const VOLUMES: usize = 100;
    const IDLE: usize = 400;
    let dir = Scratch::new("node-scale");
    let psk = dir.join("rpc.psk");
    psk_file(&psk, 0x3c);
    // Store A: 500 replicas (one of each volume, and 400 idle), created
    // over RPC on TCP with TLS. Store B: the other replica of each volume,
    // over its Unix socket. C: the engines, whose volumes are node state.
    // Thin provisioning lets a small CI disk hold the test (the data
    // written is a few MiB).
    let mut a = Node::new(&dir, "a");
    a.rpc_tcp = Some((common::free_port(), psk.clone()));
    a.extra = vec!["--store-overcommit".into(), "50".into()];
    let mut b = Node::new(&dir, "b");
    b.extra = a.extra.clone();
    let c = Node::new(&dir, "c");
    let (a_tcp, _) = a.rpc_tcp.clone().expect("tcp");

    let mut sa = a.start();
    let mut sb = b.start();
    let mut sc = c.start();
    for i in 0..VOLUMES {
        tcp_call(
            a_tcp,
            &psk,
            "replica_create",
            json!({"name": format!("v{i}.r0"), "size": "4M"}),
        )
        .unwrap_or_else(|e| panic!("replica_create v{i}.r0: {e}"));
        b.rpc(
            "replica_create",
            json!({"name": format!("v{i}.r1"), "size": "4M"}),
        );
    }
    for i in 0..IDLE {
        tcp_call(
            a_tcp,
            &psk,
            "replica_create",
            json!({"name": format!("idle-{i}"), "size": "4M"}),
        )
        .unwrap_or_else(|e| panic!("replica_create idle-{i}: {e}"));
    }
    // The CLI over TCP, once.
    let out = Command::new(env!("CARGO_BIN_EXE_lull"))
        .args(["rpc", "--addr", &a_tcp.to_string(), "--tls-psk"])
        .arg(&psk)
        .args(["replica_get", r#"{"name": "idle-7"}"#])
        .output()
        .expect("lull rpc --addr");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(got["size_bytes"], 4 << 20);

    let names: Vec<String> = (0..VOLUMES).map(|i| format!("v{i}")).collect();
    for (i, v) in names.iter().enumerate() {
        let backend = format!(
            "replicas={}+{}",
            a.target(&format!("v{i}.r0")),
            b.target(&format!("v{i}.r1"))
        );
        c.rpc(
            "volume_create",
            json!({"name": v, "size": "4M", "backend": backend}),
        );
    }
    wait_healthy(&c, &sc, &names);

    // Real clients write on three volumes.
    qemu_io(
        &sc,
        "v0",
        &["write -P 0x5a 0 1M", "write -P 0xa5 3M 64k", "flush"],
    );
    let file = pattern_file(&dir.join("pattern.bin"));
    nbdcopy(
        &dir.join("pattern.bin").display().to_string(),
        &format!("nbd://{}/v1", sc.addr()),
    );
    fio(&sc, "v2", false);
    let held = a.rpc("replica_get", json!({"name": "v0.r0"}));
    assert!(held["held_by_session"].is_string(), "{held}");

    // A crash of all three daemons: nothing flushed, detached or stopped.
    sa.kill();
    sb.kill();
    sc.kill();
    let sa = a.start();
    let _sb = b.start();
    let sc = c.start();
    let store_a = tcp_call(a_tcp, &psk, "store_get", Value::Null).expect("store_get");
    assert_eq!(
        store_a["replicas"].as_array().map(Vec::len),
        Some(VOLUMES + IDLE)
    );
    assert_eq!(
        b.rpc("store_get", Value::Null)["replicas"]
            .as_array()
            .map(Vec::len),
        Some(VOLUMES)
    );
    let listed = c.rpc("volume_list", Value::Null);
    assert_eq!(listed.as_array().map(Vec::len), Some(VOLUMES), "{listed}");
    wait_healthy(&c, &sc, &names);
    qemu_io(
        &sc,
        "v0",
        &[
            "read -P 0x5a 0 1M",
            "read -P 0xa5 3M 64k",
            "read -P 0 1M 2M",
        ],
    );
    let back = dir.join("back.bin");
    nbdcopy(
        &format!("nbd://{}/v1", sc.addr()),
        &back.display().to_string(),
    );
    assert!(
        std::fs::read(&back).expect("read back") == file,
        "v1 differs after the restart"
    );
    fio(&sc, "v2", true);
    // An idle replica is as it was: clean, generation 0, nothing held.
    let idle = a.rpc("replica_get", json!({"name": "idle-399"}));
    assert_eq!(
        (idle["clean"].as_bool(), idle["generation"].as_u64()),
        (Some(true), Some(0)),
        "{idle}"
    );
    drop(sa);
}

#[test]
fn bad_input_is_refused_and_nothing_is_created_half_way() {
    let dir = Scratch::new("node-bad");
    let psk = dir.join("rpc.psk");
    psk_file(&psk, 0x11);
    let mut a = Node::new(&dir, "a");
    let a_tcp = common::free_port();
    a.rpc_tcp = Some((a_tcp, psk.clone()));
    let c = Node::new(&dir, "c");
    let mut sa = a.start();
    let sc = c.start();
    a.rpc("replica_create", json!({"name": "r0", "size": "8M"}));

    let refusals = [
        (json!({"name": "r0", "size": "8M"}), "already exists"),
        (json!({"name": "z", "size": 0}), "greater than 0"),
        (json!({"name": "z", "size": 4095}), "multiple of 4096"),
        (json!({"name": "z", "size": 6144}), "multiple of 4096"),
        (json!({"name": "z", "size": "1000T"}), "not enough space"),
        (json!({"name": "a/b", "size": "8M"}), "only A-Z"),
        (json!({"name": "..", "size": "8M"}), "starts with a letter"),
        (json!({"name": "a\u{0}b", "size": "8M"}), "without NUL"),
        (json!({"name": "a".repeat(300), "size": "8M"}), "253"),
        (json!({"name": "", "size": "8M"}), "1 to 253"),
    ];
    for (params, why) in refusals {
        let text = a.rpc_err("replica_create", params.clone());
        assert!(text.contains(why), "{params}: {text}");
    }
    let store = a.rpc("store_get", Value::Null);
    assert_eq!(
        store["replicas"].as_array().map(Vec::len),
        Some(1),
        "{store}"
    );
    let dirs: Vec<_> = std::fs::read_dir(a.store.join("replicas"))
        .expect("replicas dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        dirs,
        vec![std::ffi::OsString::from("r0")],
        "a refused create left files"
    );
    assert!(a
        .rpc_err("replica_delete", json!({"name": "nosuch"}))
        .contains("no replica"));
    assert!(a
        .rpc_err("replica_get", json!({"name": "nosuch"}))
        .contains("no replica"));

    // A HELLO naming a replica the store does not hold: the engine's
    // replica fails with the store's refusal, the other volume works.
    c.rpc(
        "volume_create",
        json!({"name": "ghost", "size": "8M", "backend": format!("replicas={}", a.target("nosuch"))}),
    );
    c.rpc(
        "volume_create",
        json!({"name": "good", "size": "8M", "backend": format!("replicas={}", a.target("r0"))}),
    );
    wait_healthy(&c, &sc, &["good".to_string()]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = &c.rpc("replica_list", json!({"volume": "ghost"}))[0];
        if r["state"] == "failed"
            && r["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("No such file"))
        {
            break;
        }
        assert!(Instant::now() < deadline, "ghost replica: {r}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // An engine holds r0: deleting it is refused with the session named.
    let held = a.rpc_err("replica_delete", json!({"name": "r0"}));
    assert!(held.contains("held by engine session 0x"), "{held}");

    // RPC over TCP: plaintext, and TLS with the wrong key, get a closed
    // connection and nothing else; the right key still works after.
    let mut plain = TcpStream::connect(a_tcp).expect("connect");
    plain
        .set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    let _ = plain.write_all(br#"{"jsonrpc":"2.0","id":1,"method":"store_get"}"#);
    let mut reply = Vec::new();
    let _ = plain.read_to_end(&mut reply);
    assert!(
        !String::from_utf8_lossy(&reply).contains("jsonrpc"),
        "plaintext got a JSON-RPC answer: {reply:?}"
    );
    let wrong = dir.join("wrong.psk");
    psk_file(&wrong, 0x99);
    assert!(tcp_call(a_tcp, &wrong, "store_get", Value::Null).is_err());
    let store = tcp_call(a_tcp, &psk, "store_get", Value::Null).expect("the right key works");
    assert_eq!(store["replicas"].as_array().map(Vec::len), Some(1));

    // A corrupt store record, then a corrupt node state: the daemon
    // refuses to start, naming the file and the byte, and leaves both.
    drop(sc);
    assert!(sa
        .terminate(Duration::from_secs(20))
        .is_some_and(|s| s.success()));
    let record = a.store.join("store.json");
    let text = std::fs::read_to_string(&record).expect("store.json");
    std::fs::write(&record, &text[..text.len() - 5]).expect("truncate");
    let (status, err) = a.start_fails();
    assert!(!status.success());
    assert!(err.contains("store.json: corrupt at byte"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&record).expect("kept"),
        text[..text.len() - 5]
    );
    std::fs::write(&record, &text).expect("restore");
    let volumes = c.store.join("volumes.json");
    let vtext = std::fs::read_to_string(&volumes).expect("volumes.json");
    std::fs::write(
        &volumes,
        vtext.replace("\"size_bytes\"", "\"size_bytes\" x"),
    )
    .expect("corrupt");
    let (status, err) = c.start_fails();
    assert!(!status.success());
    assert!(err.contains("volumes.json: corrupt at byte"), "{err}");
    std::fs::write(&volumes, &vtext).expect("restore");
    // A volume recorded by the node and declared by --volume as well: the
    // daemon refuses to start rather than pick one.
    let mut twice = Node::new(&dir, "c");
    twice.replica_port = c.replica_port;
    twice.extra = vec!["--volume".into(), "good:8M:malloc".into()];
    let (status, err) = twice.start_fails();
    assert!(!status.success());
    assert!(err.contains("\"good\" is declared by --volume"), "{err}");
    // Both back: everything is there.
    let _sa = a.start();
    let _sc = c.start();
    assert_eq!(
        a.rpc("store_get", Value::Null)["replicas"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    assert_eq!(
        c.rpc("volume_list", Value::Null).as_array().map(Vec::len),
        Some(2)
    );
}

#[test]
fn a_full_store_fails_its_replica_and_acknowledged_data_stays() {
    require("qemu-io", "qemu-utils");
    let dir = Scratch::new("node-enospc");
    // Store A on a 16 MiB filesystem, thin-provisioned past it; B roomy.
    let small = Tmpfs::mount(&dir.join("small"), "16M");
    let mut a = Node::new(&dir, "a");
    a.store = small.0.join("store");
    a.extra = vec!["--store-overcommit".into(), "4".into()];
    let b = Node::new(&dir, "b");
    let c = Node::new(&dir, "c");
    let sa = a.start();
    let _sb = b.start();
    let sc = c.start();
    a.rpc("replica_create", json!({"name": "r0", "size": "32M"}));
    b.rpc("replica_create", json!({"name": "r1", "size": "32M"}));
    c.rpc(
        "volume_create",
        json!({"name": "v", "size": "32M", "backend": format!("replicas={}+{}", a.target("r0"), b.target("r1"))}),
    );
    wait_healthy(&c, &sc, &["v".to_string()]);
    qemu_io(&sc, "v", &["write -P 0x11 0 8M", "flush"]);
    // Past what A's filesystem holds: A fails with ENOSPC, B takes it all.
    qemu_io(&sc, "v", &["write -P 0x22 8M 16M", "flush"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let list = c.rpc("replica_list", json!({"volume": "v"}));
        let r0 = list
            .as_array()
            .expect("list")
            .iter()
            .find(|r| r["addr"].as_str().is_some_and(|s| s.ends_with("/r0")))
            .expect("r0 listed")
            .clone();
        if r0["state"] != "healthy" {
            assert!(r0["errors"].as_u64() >= Some(1), "{r0}");
            break;
        }
        assert!(Instant::now() < deadline, "r0 never failed: {list}");
        std::thread::sleep(Duration::from_millis(100));
    }
    qemu_io(&sc, "v", &["read -P 0x11 0 8M", "read -P 0x22 8M 16M"]);
    let store = a.rpc("store_get", Value::Null);
    assert!(store["free_bytes"].as_u64() < Some(1 << 20), "{store}");
    assert!(
        sa.stderr()
            .contains("no space left for the replica's data (ENOSPC)"),
        "{}",
        sa.stderr()
    );
}

#[test]
fn a_lull_replica_directory_is_adopted_by_a_store() {
    require("qemu-io", "qemu-utils");
    let dir = Scratch::new("node-import");
    let mut replica = Replica::start(Kind::Process, &dir.join("old-replica"), "8M");
    let old = replica.replica_dir();
    {
        let engine = Server::start(&[
            "--replica-insecure",
            "--volume",
            &format!("v:8M:replicas={}", replica.target()),
        ]);
        qemu_io(&engine, "v", &["write -P 0x77 4k 1M", "flush"]);
        // A clean stop detaches: the replica is clean.
        let mut engine = engine;
        assert!(engine
            .terminate(Duration::from_secs(30))
            .is_some_and(|s| s.success()));
    }
    let a = Node::new(&dir, "a");
    let _sa = a.start();
    // In use by the running `lull replica`: refused, nothing moved.
    let busy = a.rpc_err(
        "replica_import",
        json!({"name": "old", "dir": old.display().to_string()}),
    );
    assert!(busy.contains("in use"), "{busy}");
    assert!(old.join("data.img").exists());
    replica.kill();
    let got = a.rpc(
        "replica_import",
        json!({"name": "old", "dir": old.display().to_string()}),
    );
    assert_eq!(
        (got["generation"].as_u64(), got["clean"].as_bool()),
        (Some(1), Some(true)),
        "{got}"
    );
    assert!(!old.exists(), "the directory moved under the store");
    let c = Node::new(&dir, "c");
    let sc = c.start();
    c.rpc(
        "volume_create",
        json!({"name": "v", "size": "8M", "backend": format!("replicas={}", a.target("old"))}),
    );
    wait_healthy(&c, &sc, &["v".to_string()]);
    qemu_io(&sc, "v", &["read -P 0x77 4k 1M", "read -P 0 0 4k"]);
    // Not a replica directory: refused.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).expect("mkdir");
    let text = a.rpc_err(
        "replica_import",
        json!({"name": "e", "dir": empty.display().to_string()}),
    );
    assert!(text.contains("not a lull replica directory"), "{text}");
}

/// Volumes a node records keep their QoS limits and their snapshots over
/// a restart (a file volume's chain is found again next to its file).
#[test]
fn a_nodes_volumes_keep_their_qos_and_snapshots_over_a_restart() {
    let dir = Scratch::new("node-qos");
    let a = Node::new(&dir, "a");
    let server = a.start();
    let file = dir.join("v.img");
    a.rpc(
        "volume_create",
        json!({"name": "v", "size": "8M", "backend": format!("file={}", file.display())}),
    );
    a.rpc(
        "volume_set_qos",
        json!({"name": "v", "rw_ios_per_sec": 1500, "w_mbytes_per_sec": 3}),
    );
    qemu_io(&server, "v", &["write -P 0x3c 0 1M"]);
    a.rpc("snapshot_create", json!({"volume": "v", "name": "before"}));
    qemu_io(&server, "v", &["write -P 0x3d 0 1M"]);
    drop(server);
    let server = a.start();
    let stats = a.rpc("volume_get_stats", json!({"name": "v"}));
    assert_eq!(stats["qos"]["limits"]["rw_ios_per_sec"], 1500, "{stats}");
    assert_eq!(stats["qos"]["limits"]["w_mbytes_per_sec"], 3, "{stats}");
    let list = a.rpc("snapshot_list", json!({"volume": "v"}));
    assert_eq!(list[0]["name"], "before", "{list}");
    qemu_io(&server, "v", &["read -P 0x3d 0 1M"]);
    // Unlimited again: the record forgets the limits.
    a.rpc("volume_set_qos", json!({"name": "v"}));
    drop(server);
    let _server = a.start();
    let stats = a.rpc("volume_get_stats", json!({"name": "v"}));
    assert_eq!(stats["qos"]["limits"]["rw_ios_per_sec"], 0, "{stats}");
}

/// The node's rebuild limits (`node_set_rebuild_limit`, and
/// `volume_set_rebuild_limit` without a name) are recorded with its
/// volumes and restored at start; a volume's own limit wins over the
/// one set for every volume.
#[test]
fn a_nodes_rebuild_limits_survive_a_restart() {
    let dir = Scratch::new("node-rebuild-limits");
    let a = Node::new(&dir, "a");
    let server = a.start();
    let mut names = Vec::new();
    for v in ["v", "w"] {
        for r in ["r0", "r1"] {
            a.rpc(
                "replica_create",
                json!({"name": format!("{v}.{r}"), "size": "8M"}),
            );
        }
        a.rpc(
            "volume_create",
            json!({"name": v, "size": "8M", "backend": format!("replicas={}+{}",
                a.target(&format!("{v}.r0")), a.target(&format!("{v}.r1")))}),
        );
        names.push(v.to_string());
    }
    wait_healthy(&a, &server, &names);
    a.rpc("node_set_rebuild_limit", json!({"mbytes_per_sec": 30}));
    a.rpc("volume_set_rebuild_limit", json!({"mbytes_per_sec": 20}));
    a.rpc(
        "volume_set_rebuild_limit",
        json!({"name": "w", "mbytes_per_sec": 5}),
    );
    let limits = |a: &Node, v: &str| {
        let stats = a.rpc("volume_get_stats", json!({"name": v}));
        (
            stats["node_rebuild_limit_bytes_per_sec"].as_u64(),
            stats["rebuild_limit_bytes_per_sec"].as_u64(),
        )
    };
    assert_eq!(limits(&a, "v"), (Some(30_000_000), Some(20_000_000)));
    assert_eq!(limits(&a, "w"), (Some(30_000_000), Some(5_000_000)));
    drop(server);
    let server = a.start();
    wait_healthy(&a, &server, &names);
    assert_eq!(limits(&a, "v"), (Some(30_000_000), Some(20_000_000)));
    assert_eq!(limits(&a, "w"), (Some(30_000_000), Some(5_000_000)));
    // A volume created now takes the limit set for every volume.
    for r in ["r0", "r1"] {
        a.rpc(
            "replica_create",
            json!({"name": format!("x.{r}"), "size": "8M"}),
        );
    }
    a.rpc(
        "volume_create",
        json!({"name": "x", "size": "8M", "backend": format!("replicas={}+{}",
            a.target("x.r0"), a.target("x.r1"))}),
    );
    assert_eq!(limits(&a, "x"), (Some(30_000_000), Some(20_000_000)));
    // Cleared: the record forgets them.
    a.rpc("node_set_rebuild_limit", json!({"mbytes_per_sec": 0}));
    a.rpc("volume_set_rebuild_limit", json!({"mbytes_per_sec": 0}));
    drop(server);
    let server = a.start();
    names.push("x".into());
    wait_healthy(&a, &server, &names);
    assert_eq!(limits(&a, "v"), (Some(0), Some(0)));
}
