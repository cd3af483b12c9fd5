//! Block status of a replicated volume proven by real clients: two real
//! `lull replica` processes, a real `lull serve` on loopback, and
//! nbdinfo --map, qemu-img map and convert, nbdcopy and libnbd's Python
//! bindings. The engine asks one healthy replica (BLOCK_STATUS, replica
//! protocol version 3), so the maps must show exactly what was written,
//! also while one replica is down.
//!
//! ```text
//! cargo test -p lull --test sparse_replicated
//! ```
//!
//! Needs `nbdinfo`, `nbdcopy` (package `libnbd-bin`), `qemu-img`/`qemu-io`
//! (`qemu-utils`) and `python3-libnbd`; scripts/test installs them.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{require, NbdClient, Server};

const MIB: u64 = 1 << 20;
/// How long the volume may take to have a healthy replica after start.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const HOLE_ZERO: u32 = 3;

fn free_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
    l.local_addr().expect("local addr")
}

/// A scratch directory, removed when the test passes.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("sparse-repl-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("create the scratch directory");
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        } else {
            eprintln!("scratch kept in {}", self.0.display());
        }
    }
}

/// A `lull replica` process, killed when dropped.
struct Replica {
    child: Option<Child>,
    addr: SocketAddr,
    dir: PathBuf,
}

impl Replica {
    fn start(dir: &Path, size: &str) -> Replica {
        let addr = free_port();
        std::fs::create_dir_all(dir).expect("replica dir");
        let log = std::fs::File::create(dir.join("replica.log")).expect("replica log");
        let child = Command::new(env!("CARGO_BIN_EXE_lull"))
            .args(["replica", "--listen", &addr.to_string(), "--size", size])
            // Plain links: authentication is tests/replica_tls.rs's.
            .arg("--insecure")
            .arg("--dir")
            .arg(dir.join("data"))
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("spawn lull replica");
        let r = Replica {
            child: Some(child),
            addr,
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_err() {
            assert!(
                Instant::now() < deadline,
                "replica on {addr} did not start; log:\n{}",
                r.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        r
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("replica.log")).unwrap_or_default()
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Two replicas of `size` and a server with volume `v` on them, readable.
fn two_replicas(scratch: &Scratch, size: &str) -> (Server, Replica, Replica) {
    let a = Replica::start(&scratch.0.join("a"), size);
    let b = Replica::start(&scratch.0.join("b"), size);
    let spec = format!("v:{size}:replicas={}+{}", a.addr, b.addr);
    let server = Server::start(&["--replica-insecure", "--volume", &spec]);
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Ok(mut c) = NbdClient::connect(server.addr(), "v") {
            if let Ok(Ok(_)) = c.read(0, 4096) {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "volume never became readable; log:\n{}",
            server.stderr()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    (server, a, b)
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn uri(server: &Server) -> String {
    format!("nbd://{}/v", server.addr())
}

/// `nbdinfo --map`: (offset, length, type) per line.
fn nbdinfo_map(server: &Server) -> Vec<(u64, u64, u32)> {
    require("nbdinfo", "libnbd-bin");
    let out = run(Command::new("nbdinfo").args(["--map", &uri(server)]));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("nbdinfo --map:\n{text}");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[0].parse().expect("offset"),
                f[1].parse().expect("length"),
                f[2].parse().expect("type"),
            )
        })
        .collect()
}

/// `qemu-img map --output=json`: (start, length, data, zero) per entry.
fn qemu_img_map(server: &Server) -> Vec<(u64, u64, bool, bool)> {
    require("qemu-img", "qemu-utils");
    let out =
        run(Command::new("qemu-img").args(["map", "--output=json", "-f", "raw", &uri(server)]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("qemu-img JSON");
    json.as_array()
        .expect("array")
        .iter()
        .map(|e| {
            (
                e["start"].as_u64().unwrap(),
                e["length"].as_u64().unwrap(),
                e["data"].as_bool().unwrap(),
                e["zero"].as_bool().unwrap(),
            )
        })
        .collect()
}

fn qemu_io(server: &Server, cmds: &[&str]) {
    require("qemu-io", "qemu-utils");
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(uri(server));
    let out = run(&mut c);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("failed"), "qemu-io: {text}");
}

/// Fresh: one hole. After writing [1, 3) MiB and [8, 9) MiB and
/// discarding [2, 3) MiB: data exactly there, by nbdinfo and qemu-img,
/// from both replicas (reads and block status alternate between them),
/// and the same with one replica killed.
#[test]
fn map_of_a_two_replica_volume_with_and_without_a_replica() {
    let scratch = Scratch::new("map");
    let size = 16 * MIB;
    let (mut server, mut a, _b) = two_replicas(&scratch, "16M");
    assert_eq!(nbdinfo_map(&server), [(0, size, HOLE_ZERO)]);
    assert_eq!(qemu_img_map(&server), [(0, size, false, true)]);
    qemu_io(
        &server,
        &[
            "write -P 0x11 1M 2M",
            "write -P 0x22 8M 1M",
            "discard 2M 1M",
            "read -P 0x11 1M 1M",
            "read -P 0 2M 1M",
        ],
    );
    let expected = [
        (0, MIB, HOLE_ZERO),
        (MIB, MIB, 0),
        (2 * MIB, 6 * MIB, HOLE_ZERO),
        (8 * MIB, MIB, 0),
        (9 * MIB, 7 * MIB, HOLE_ZERO),
    ];
    let qemu: Vec<(u64, u64, bool, bool)> = expected
        .iter()
        .map(|&(o, l, t)| (o, l, t == 0, t != 0))
        .collect();
    // Twice: the engine alternates replicas, so both answer.
    for _ in 0..2 {
        assert_eq!(nbdinfo_map(&server), expected);
        assert_eq!(qemu_img_map(&server), qemu);
    }
    a.kill();
    assert_eq!(nbdinfo_map(&server), expected, "{}", server.stderr());
    assert_eq!(qemu_img_map(&server), qemu);
    qemu_io(&server, &["read -P 0x22 8M 1M", "read -P 0 9M 1M"]);
    server.assert_healthy();
}

/// Structured reads, block status with REQ_ONE, and fast zero (refused
/// with NBD_ENOTSUP on a replicated volume: the replica protocol has no
/// fast zero) through libnbd's Python bindings.
#[test]
fn libnbd_block_status_and_req_one_on_a_two_replica_volume() {
    let python = common::python_with_nbd();
    let scratch = Scratch::new("libnbd");
    let (mut server, _a, _b) = two_replicas(&scratch, "16M");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/structured.py");
    let out = run(Command::new(python)
        .arg(script)
        .args([&uri(&server), "0", "0"]));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(text.trim_end().ends_with("ok"), "{text}");
    server.assert_healthy();
}

/// A sparse 1 GiB two-replica volume copied to a sparse file by
/// `qemu-img convert` and by `nbdcopy`: the destination allocates within
/// 1 % of what was written, and holds the data.
#[test]
fn copies_of_a_sparse_two_replica_volume_stay_sparse() {
    require("nbdcopy", "libnbd-bin");
    let scratch = Scratch::new("copy");
    let (mut server, _a, _b) = two_replicas(&scratch, "1G");
    qemu_io(&server, &["write -P 0x5a 0 4M", "write -P 0xa5 700M 4M"]);
    let written = 8 * MIB;
    let qemu_dest = scratch.0.join("qemu.img");
    run(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &uri(&server),
        qemu_dest.to_str().unwrap(),
    ]));
    let nbdcopy_dest = scratch.0.join("nbdcopy.img");
    // nbdcopy writes into an existing file of the right size.
    std::fs::File::create(&nbdcopy_dest)
        .and_then(|f| f.set_len(1 << 30))
        .expect("create the nbdcopy destination");
    run(Command::new("nbdcopy").args([&uri(&server), nbdcopy_dest.to_str().unwrap()]));
    for dest in [&qemu_dest, &nbdcopy_dest] {
        let meta = std::fs::metadata(dest).expect("copy");
        assert_eq!(meta.len(), 1 << 30);
        let allocated = meta.blocks() * 512;
        println!(
            "{}: allocated {allocated} of {written} written",
            dest.display()
        );
        assert!(
            allocated <= written + written / 100,
            "{} allocates {allocated} bytes for {written} written",
            dest.display()
        );
        let copy = std::fs::read(dest).expect("read copy");
        assert!(copy[..4 << 20].iter().all(|&b| b == 0x5a));
        assert!(copy[700 << 20..704 << 20].iter().all(|&b| b == 0xa5));
        assert!(copy[4 << 20..700 << 20].iter().all(|&b| b == 0));
        assert!(copy[704 << 20..].iter().all(|&b| b == 0));
    }
    server.assert_healthy();
}
