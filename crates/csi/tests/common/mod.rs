//! What the tests that run real node daemons share: three `lull serve
//! --store` processes on loopback (the `lull` binary the workspace
//! built), their node list and keys, and the clean-up of whatever a
//! failed test left attached.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lull_csi::cluster::Cluster;
use serde_json::{json, Value};

/// How long the daemons get to start, and a fenced engine to give up.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// The `lull` binary: `LULL_BIN`, else the one cargo built beside this
/// test (`target/<profile>/lull`; `cargo test --workspace` builds it).
pub fn lull_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("LULL_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .join("lull");
    assert!(
        bin.exists(),
        "no lull binary at {} (build it: cargo build -p lull, or cargo test --workspace; or set LULL_BIN)",
        bin.display()
    );
    bin
}

/// One node daemon, killed when dropped.
pub struct Daemon {
    pub dir: PathBuf,
    /// The ports it serves on: 0 until its first start binds them (the
    /// kernel picks, so no other test or outgoing connection holds them);
    /// a restart binds the same ones again.
    pub rpc_port: u16,
    pub replica_port: u16,
    pub nbd_port: u16,
    /// Serves NVMe/TCP (`--nvmf-listen`) on this port when `nvmf`: 0
    /// until its first start binds it, as the others.
    pub nvmf: bool,
    pub nvmf_port: u16,
    /// Extra flags of `lull serve` (e.g. another --store-overcommit).
    pub extra: Vec<String>,
    child: Option<Child>,
}

impl Daemon {
    /// Starts it and waits until it serves (its stdout's `listening on`),
    /// learning the ports it bound; panics with its log if it exits or
    /// takes longer than [`DEADLINE`].
    pub fn start(&mut self, work: &Path) {
        std::fs::create_dir_all(self.dir.join("store")).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("log"))
            .unwrap();
        let mut child = Command::new(lull_bin())
            .arg("serve")
            .arg("--store")
            .arg(self.dir.join("store"))
            .args([
                "--replica-listen",
                &format!("127.0.0.1:{}", self.replica_port),
            ])
            .arg("--replica-tls-psk")
            .arg(work.join("replica.psk"))
            .args(["--rpc-listen", &format!("127.0.0.1:{}", self.rpc_port)])
            .arg("--rpc-tls-psk")
            .arg(work.join("rpc.psk"))
            .arg("--rpc-socket")
            .arg(self.dir.join("rpc.sock"))
            .args(["--listen", &format!("127.0.0.1:{}", self.nbd_port)])
            .args(if self.nvmf {
                vec![
                    "--nvmf-listen".to_string(),
                    format!("127.0.0.1:{}", self.nvmf_port),
                ]
            } else {
                Vec::new()
            })
            .args(["--fixed-buffers-mib", "0"])
            .args(&self.extra)
            // Thin-provisioned unless the test says: test volumes are
            // never written in full.
            .args(if self.extra.iter().any(|a| a == "--store-overcommit") {
                &[][..]
            } else {
                &["--store-overcommit", "100"][..]
            })
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("start lull serve");
        let stdout = child.stdout.take().expect("piped stdout");
        self.child = Some(child);
        let (tx, rx) = std::sync::mpsc::channel();
        // Reads the start-up lines, then drains the rest so the daemon
        // never blocks on a full pipe.
        std::thread::spawn(move || {
            use std::io::BufRead;
            let port = |addr: &str| addr.trim().rsplit(':').next()?.parse::<u16>().ok();
            let (mut replica, mut rpc, mut nvmf) = (None, None, None);
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("nvmf listening on ") {
                    nvmf = port(rest);
                } else if let Some(rest) = line.strip_prefix("replica store ") {
                    replica = rest
                        .rsplit_once(" on ")
                        .and_then(|(_, a)| a.split_once(": "))
                        .and_then(|(a, _)| port(a));
                } else if let Some(rest) = line.strip_prefix("rpc on tcp ") {
                    rpc = port(rest.trim_end_matches(" (TLS)"));
                } else if let Some(rest) = line.strip_prefix("listening on ") {
                    let _ = tx.send((replica, rpc, port(rest), nvmf));
                }
            }
        });
        let deadline = Instant::now() + DEADLINE;
        loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok((Some(replica), Some(rpc), Some(nbd), nvmf)) if nvmf.is_some() == self.nvmf => {
                    (self.replica_port, self.rpc_port, self.nbd_port) = (replica, rpc, nbd);
                    self.nvmf_port = nvmf.unwrap_or(0);
                    return;
                }
                Ok(ports) => panic!(
                    "{}: start-up lines without every port {ports:?}; log:\n{}",
                    self.dir.display(),
                    self.log()
                ),
                Err(_) => {}
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "{}: lull serve exited ({status}) before it served; log:\n{}",
                    self.dir.display(),
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{}: lull serve did not serve within {DEADLINE:?}; log:\n{}",
                self.dir.display(),
                self.log()
            );
        }
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    /// Sends `sig` (`-STOP`, `-CONT`) to the running daemon.
    pub fn signal(&self, sig: &str) {
        let pid = self.child.as_ref().expect("the daemon runs").id();
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {pid}");
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whatever a failed run left attached under the test's directory: its
/// FUSE mounts (lazily unmounted) and loop devices.
pub struct Leftovers(pub PathBuf);

impl Drop for Leftovers {
    fn drop(&mut self) {
        self.clean();
    }
}

impl Leftovers {
    pub fn clean(&self) {
        let dir = self.0.to_string_lossy().into_owned();
        if let Ok(out) = Command::new("losetup").arg("-a").output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some((dev, rest)) = line.split_once(':') {
                    if rest.contains(&dir) {
                        let _ = Command::new("losetup").args(["-d", dev]).status();
                    }
                }
            }
        }
        if let Ok(mounts) = lull_csi::mounts::current() {
            for m in mounts.iter().rev() {
                if m.mount_point.starts_with(&self.0) {
                    let _ = Command::new("umount")
                        .arg("-l")
                        .arg(&m.mount_point)
                        .status();
                }
            }
        }
    }
}

pub fn psk(path: &Path, user: &str, byte: u8) {
    let hex: String = (0..32).map(|i| format!("{:02x}", byte ^ i)).collect();
    std::fs::write(path, format!("{user}:{hex}\n")).unwrap();
}

/// Panics unless this machine can attach with the fuse method (the tests
/// that stage with it need root, nbdfuse and loop devices).
pub async fn require_fuse() {
    if let Err(reason) = lull_csi::attach::Method::Fuse
        .check(&lull_csi::attach::Host::default())
        .await
    {
        panic!("this test attaches with nbdfuse and loop devices: {reason} (run as root; Debian package libnbd-bin)");
    }
}

/// Waits, with the deadline, until `check` gives a value.
pub async fn wait_for<T, F, Fut>(what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Three node daemons, node1 to node3, started, with their node list and
/// the plugin's view of them.
pub struct Nodes {
    pub work: PathBuf,
    pub daemons: Vec<Daemon>,
    pub cluster: Arc<Cluster>,
    _leftovers: Leftovers,
}

impl Nodes {
    /// Starts them under a fresh directory named after `test`; `extra`
    /// gives each daemon's extra flags.
    pub async fn start(test: &str, extra: [Vec<String>; 3]) -> Nodes {
        Nodes::start_with_nvmf(test, extra, [false; 3]).await
    }

    /// As [`Nodes::start`]; the daemons with `nvmf` set also serve
    /// NVMe/TCP on loopback, and their node list entries say where
    /// (`"nvmf"`).
    pub async fn start_with_nvmf(test: &str, extra: [Vec<String>; 3], nvmf: [bool; 3]) -> Nodes {
        let work = std::env::temp_dir().join(format!("lull-csi-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).unwrap();
        let leftovers = Leftovers(work.clone());
        psk(&work.join("rpc.psk"), "admin", 0x5a);
        psk(&work.join("replica.psk"), "lull", 0xa5);
        let mut daemons: Vec<Daemon> = extra
            .into_iter()
            .zip(nvmf)
            .enumerate()
            .map(|(i, (extra, nvmf))| Daemon {
                dir: work.join(format!("node{}", i + 1)),
                rpc_port: 0,
                replica_port: 0,
                nbd_port: 0,
                nvmf,
                nvmf_port: 0,
                extra,
                child: None,
            })
            .collect();
        for d in &mut daemons {
            d.start(&work);
        }
        let nodes: Vec<Value> = daemons
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let mut node = json!({"id": format!("node{}", i + 1), "rpc": format!("127.0.0.1:{}", d.rpc_port),
                       "tls_psk": "rpc.psk", "nbd": format!("127.0.0.1:{}", d.nbd_port)});
                if d.nvmf {
                    node["nvmf"] = json!(format!("127.0.0.1:{}", d.nvmf_port));
                }
                node
            })
            .collect();
        std::fs::write(
            work.join("nodes.json"),
            json!({ "nodes": nodes }).to_string(),
        )
        .unwrap();
        let cluster = Arc::new(
            Cluster::new(lull_csi::nodes::load(&work.join("nodes.json")).unwrap()).unwrap(),
        );
        for n in 1..=3 {
            let node = format!("node{n}");
            let c = Arc::clone(&cluster);
            wait_for("the node daemons", || {
                let (c, node) = (Arc::clone(&c), node.clone());
                async move { c.call(&node, "store_get", json!({})).await.ok() }
            })
            .await;
        }
        Nodes {
            work,
            daemons,
            cluster,
            _leftovers: leftovers,
        }
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        for d in &mut self.daemons {
            d.kill();
        }
        self._leftovers.clean();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.work);
        }
    }
}
