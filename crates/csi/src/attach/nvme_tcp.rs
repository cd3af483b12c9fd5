//! The `nvme-tcp` attach: the kernel's NVMe/TCP initiator connected to
//! this node's daemon, whose engine exports the volume as namespace 1 of
//! the subsystem [`nqn_of`] the volume (docs/NVMF.md).
//!
//! ```text
//! stage    <dir>/nvme-tcp.json  {"nqn", "traddr", "trsvcid", "hostnqn"}   (first)
//!          nvme connect -t tcp -a TRADDR -s TRSVCID -n NQN [--hostnqn H]
//!          /sys/class/nvme-subsystem/*/subsysnqn == NQN
//!            -> its namespace: nvme<S>n1 there (native multipath), else
//!               nvme<C>n1 under a controller /sys/class/nvme/nvme<C>
//!            -> /dev/nvme<S>n1
//! unstage  nvme disconnect -n NQN (when a controller of it is there), the record removed
//! expand   nvme ns-rescan /dev/nvme<C> for each controller
//! ```
//!
//! Only [`super::Host`]'s sysfs and /dev are read, and only its `nvme`
//! runs, so a test can run all of this against a fake tree and a fake
//! `nvme` (crates/csi/tests/attach.rs). On a real kernel (Debian's, in
//! the kernel tier's VM: crates/csi/tests/kernel.rs) the layout above
//! is what 6.12 shows, the namespace being the subsystem's multipath
//! head; there a controller whose target died stays in its subsystem
//! (`connecting`), so "connected already" is a controller at the
//! recorded address, not any controller of the NQN.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{
    read_json, remove_file, split_addr, write_json, AttachError, Host, STATE_POLL_INTERVAL,
};
use crate::cmd;

/// The prefix of the NQN a volume's subsystem is served under: the
/// daemon's default (`lull_nvmf::NQN_PREFIX`, docs/NVMF.md), so the NQN
/// names the same subsystem whether or not the plugin created the engine.
pub const NQN_PREFIX: &str = "nqn.2026-11.io.lull:";

/// `nvme connect --reconnect-delay`: seconds between the kernel's tries
/// to reconnect a lost controller. The daemon re-creates a staged
/// volume's engine at its restart (`volume_create`'s `resume`) within
/// about a second, so a 1 s delay bounds the pod's I/O pause across a
/// restart or an upgrade near 2 s (the kernel's own default, 10 s, would
/// make every restart a 10 s stall).
pub const NVME_RECONNECT_DELAY_SECS: &str = "1";

/// `nvme connect --ctrl-loss-tmo`: seconds the kernel keeps trying before
/// it gives the controller up and fails the pod's I/O. Ten minutes (the
/// kernel's default, said explicitly so it does not change under us):
/// long enough for any restart or upgrade of the daemon, short enough
/// that a node whose daemon is gone for good fails its I/O instead of
/// hanging it forever (the volume then fails over by restaging).
pub const NVME_CTRL_LOSS_TMO_SECS: &str = "600";

/// How long the namespace's block device may take to appear after `nvme
/// connect` answered: the kernel scans the controller's namespaces in
/// the background and udev (or devtmpfs) makes the node; milliseconds on
/// a healthy node. 30 s covers a loaded one and ends before a CO gives
/// up on the call.
pub const NVME_NAMESPACE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the controllers may take to go after `nvme disconnect`
/// answered (the subsystem is freed with its last controller).
pub const NVME_DISCONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a namespace may take to show its new size after `nvme
/// ns-rescan` (the kernel reads it again in the background).
pub const NVME_RESCAN_TIMEOUT: Duration = Duration::from_secs(10);

/// The record of what this method attached, in the volume's directory.
pub(super) const RECORD_FILE: &str = "nvme-tcp.json";

/// The NQN of `volume`'s subsystem.
pub fn nqn_of(volume: &str) -> String {
    format!("{NQN_PREFIX}{volume}")
}

/// What a stage connected: enough to find it in sysfs and disconnect it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    nqn: String,
    traddr: String,
    trsvcid: String,
    #[serde(default)]
    hostnqn: Option<String>,
}

/// Directory entries of `dir` named `nvme` and digits, then (when
/// `namespace`) `n` and digits: controllers (`nvme0`) or namespace
/// block devices (`nvme0n1`); not the hidden per-path devices
/// (`nvme0c1n1`), which have no device node.
fn nvme_entries(dir: &Path, namespace: bool) -> Vec<String> {
    let Ok(read) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = read
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            let Some(rest) = n.strip_prefix("nvme") else {
                return false;
            };
            let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
            match (namespace, rest.split_once('n')) {
                (false, None) => digits(rest),
                (true, Some((ctrl, ns))) => digits(ctrl) && digits(ns),
                _ => false,
            }
        })
        .collect();
    names.sort();
    names
}

/// The sysfs directory of the subsystem whose `subsysnqn` is `nqn`.
fn subsystem(host: &Host, nqn: &str) -> Option<PathBuf> {
    let class = host.sys.join("class/nvme-subsystem");
    std::fs::read_dir(class)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| std::fs::read_to_string(p.join("subsysnqn")).is_ok_and(|s| s.trim() == nqn))
}

/// The subsystem's controllers (`nvme3`).
fn controllers(subsystem: &Path) -> Vec<String> {
    nvme_entries(subsystem, false)
}

/// A controller's transport address as sysfs has it
/// (`/sys/class/nvme/nvme<C>/address`: `traddr=127.0.0.1,trsvcid=4420`,
/// and `,src_addr=...` on newer kernels); `None` when unreadable.
fn address_of(host: &Host, controller: &str) -> Option<String> {
    std::fs::read_to_string(host.sys.join("class/nvme").join(controller).join("address"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// Whether a sysfs `address` names `traddr` and `trsvcid`.
fn address_is(address: &str, traddr: &str, trsvcid: &str) -> bool {
    let field = |key: &str| {
        address
            .split(',')
            .find_map(|kv| kv.trim().strip_prefix(key)?.strip_prefix('='))
    };
    field("traddr") == Some(traddr) && field("trsvcid") == Some(trsvcid)
}

/// The subsystem's controllers split into those at `traddr:trsvcid` (a
/// controller whose address sysfs does not show counts as there) and
/// the addresses of the others.
fn controllers_at(
    host: &Host,
    subsystem: &Path,
    traddr: &str,
    trsvcid: &str,
) -> (Vec<String>, Vec<String>) {
    let mut here = Vec::new();
    let mut elsewhere = Vec::new();
    for c in controllers(subsystem) {
        match address_of(host, &c) {
            Some(a) if !address_is(&a, traddr, trsvcid) => elsewhere.push(format!("{c}: {a}")),
            _ => here.push(c),
        }
    }
    (here, elsewhere)
}

/// The block device of the volume's namespace (namespace 1), as a name
/// under /dev: the subsystem's namespace head when the kernel has native
/// multipath (`nvme<S>n1` in the subsystem's directory), else the
/// namespace of one of its controllers (`nvme<C>n1` under
/// /sys/class/nvme/nvme<C>).
fn namespace(host: &Host, subsystem: &Path) -> Option<String> {
    let first_ns = |names: Vec<String>| names.into_iter().find(|n| n.ends_with("n1"));
    first_ns(nvme_entries(subsystem, true)).or_else(|| {
        controllers(subsystem)
            .into_iter()
            .find_map(|c| first_ns(nvme_entries(&host.sys.join("class/nvme").join(c), true)))
    })
}

/// The namespace's device path when its node exists.
fn device_of(host: &Host, nqn: &str) -> Option<String> {
    let sub = subsystem(host, nqn)?;
    let name = namespace(host, &sub)?;
    let dev = host.dev.join(name);
    dev.exists().then(|| dev.to_string_lossy().into_owned())
}

/// The volume's device when this method attached it (a record, and the
/// kernel shows its namespace).
pub(super) fn device(host: &Host, dir: &Path) -> Result<Option<String>, AttachError> {
    Ok(read_json::<Record>(dir, RECORD_FILE)?.and_then(|r| device_of(host, &r.nqn)))
}

/// What sysfs shows of the subsystem, for an error message.
fn seen(host: &Host, nqn: &str) -> String {
    match subsystem(host, nqn) {
        None => format!("no subsystem with subsysnqn {nqn}"),
        Some(sub) => format!(
            "{}: controllers {:?}, namespace {:?}",
            sub.display(),
            controllers(&sub),
            namespace(host, &sub)
        ),
    }
}

/// Connects the volume's subsystem (recorded first) and waits for its
/// namespace's device; a subsystem connected already is not connected
/// again (`nvme connect` refuses a duplicate). Returns the device.
pub(super) async fn attach(
    host: &Host,
    dir: &Path,
    addr: &str,
    nqn: &str,
    hostnqn: Option<&str>,
) -> Result<String, AttachError> {
    let (traddr, trsvcid) = split_addr("the node's nvmf address", addr)?;
    let record = Record {
        nqn: nqn.to_string(),
        traddr,
        trsvcid: trsvcid.to_string(),
        hostnqn: hostnqn.map(str::to_string),
    };
    // Connected already means connected to this daemon: a subsystem of
    // the NQN whose controllers are all at another address (another
    // daemon on this host served the volume, and its controller is left
    // reconnecting to it) would answer that target's namespace, not this
    // engine's. Refused before the record, so a failed stage's detach
    // leaves that connection alone.
    let (here, elsewhere) = subsystem(host, nqn)
        .map(|s| controllers_at(host, &s, &record.traddr, &record.trsvcid))
        .unwrap_or_default();
    if here.is_empty() && !elsewhere.is_empty() {
        return Err(AttachError::ConnectedElsewhere {
            nqn: nqn.to_string(),
            addr: addr.to_string(),
            elsewhere,
        });
    }
    if read_json::<Record>(dir, RECORD_FILE)?.as_ref() != Some(&record) {
        write_json(dir, RECORD_FILE, &record)?;
    }
    let connected = !here.is_empty();
    if !connected {
        let mut args: Vec<&str> = vec![
            "connect",
            "-t",
            "tcp",
            "-a",
            &record.traddr,
            "-s",
            &record.trsvcid,
            "-n",
            nqn,
            "--reconnect-delay",
            NVME_RECONNECT_DELAY_SECS,
            "--ctrl-loss-tmo",
            NVME_CTRL_LOSS_TMO_SECS,
        ];
        if let Some(h) = hostnqn {
            args.extend(["--hostnqn", h]);
        }
        cmd::run(&host.nvme, &args).await?;
        tracing::info!(nqn, addr, hostnqn, "nvme connect answered");
    }
    let deadline = Instant::now() + NVME_NAMESPACE_TIMEOUT;
    let mut backoff = crate::Backoff::new(STATE_POLL_INTERVAL);
    loop {
        if let Some(dev) = device_of(host, nqn) {
            return Ok(dev);
        }
        if Instant::now() >= deadline {
            return Err(AttachError::NoNamespace {
                nqn: nqn.to_string(),
                seen: seen(host, nqn),
            });
        }
        backoff.wait().await;
    }
}

/// Undoes [`attach`]: `nvme disconnect -n NQN` when the recorded
/// subsystem has controllers, a wait until they are gone, the record
/// removed. Nothing recorded, or nothing connected any more, succeeds.
pub(super) async fn detach(host: &Host, dir: &Path) -> Result<(), AttachError> {
    let Some(record) = read_json::<Record>(dir, RECORD_FILE)? else {
        return Ok(());
    };
    let nqn = record.nqn.as_str();
    let left = || {
        subsystem(host, nqn)
            .map(|s| controllers(&s))
            .unwrap_or_default()
    };
    if !left().is_empty() {
        cmd::run(&host.nvme, &["disconnect", "-n", nqn]).await?;
        tracing::info!(nqn, "nvme disconnect answered");
        let deadline = Instant::now() + NVME_DISCONNECT_TIMEOUT;
        let mut backoff = crate::Backoff::new(STATE_POLL_INTERVAL);
        loop {
            let controllers = left();
            if controllers.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(AttachError::StillConnected {
                    nqn: nqn.to_string(),
                    controllers,
                });
            }
            backoff.wait().await;
        }
    }
    remove_file(&dir.join(RECORD_FILE))
}

/// `nvme ns-rescan` of each controller of the recorded subsystem: the
/// kernel reads the namespace's size again (in the background: the
/// caller waits for the size, [`NVME_RESCAN_TIMEOUT`]).
pub(super) async fn rescan(host: &Host, dir: &Path) -> Result<(), AttachError> {
    let Some(record) = read_json::<Record>(dir, RECORD_FILE)? else {
        return Ok(());
    };
    let Some(sub) = subsystem(host, &record.nqn) else {
        return Ok(());
    };
    for c in controllers(&sub) {
        let dev = host.dev.join(&c);
        cmd::run(
            &host.nvme,
            &[std::ffi::OsStr::new("ns-rescan"), dev.as_os_str()],
        )
        .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sysfs as a kernel with and without native multipath lays it out.
    #[test]
    fn finds_the_namespace_of_a_subsystem() {
        let root = std::env::temp_dir().join(format!("lull-csi-nvme-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let host = Host {
            sys: root.join("sys"),
            dev: root.join("dev"),
            ..Host::default()
        };
        let subs = host.sys.join("class/nvme-subsystem");
        let mk = |p: PathBuf| std::fs::create_dir_all(p).unwrap();
        // Another subsystem, a local disk.
        mk(subs.join("nvme-subsys0/nvme0n1"));
        std::fs::write(
            subs.join("nvme-subsys0/subsysnqn"),
            "nqn.2014.08.org.nvmexpress:disk\n",
        )
        .unwrap();
        // Multipath: the head in the subsystem, a hidden path under the controller.
        mk(subs.join("nvme-subsys1/nvme1"));
        mk(subs.join("nvme-subsys1/nvme1n1"));
        mk(host.sys.join("class/nvme/nvme1/nvme1c1n1"));
        std::fs::write(
            subs.join("nvme-subsys1/subsysnqn"),
            "nqn.2026-11.io.lull:a\n",
        )
        .unwrap();
        // No multipath: the namespace under its controller.
        mk(subs.join("nvme-subsys2/nvme4"));
        mk(host.sys.join("class/nvme/nvme4/nvme4n1"));
        std::fs::write(subs.join("nvme-subsys2/subsysnqn"), "nqn.2026-11.io.lull:b").unwrap();
        mk(host.dev.clone());
        for d in ["nvme1n1", "nvme4n1"] {
            std::fs::write(host.dev.join(d), "").unwrap();
        }
        // The controllers' addresses, as a kernel shows them.
        mk(host.sys.join("class/nvme/nvme4"));
        std::fs::write(
            host.sys.join("class/nvme/nvme4/address"),
            "traddr=127.0.0.1,trsvcid=4420,src_addr=127.0.0.1\n",
        )
        .unwrap();
        let sub = subsystem(&host, &nqn_of("b")).unwrap();
        assert_eq!(
            controllers_at(&host, &sub, "127.0.0.1", "4420"),
            (vec!["nvme4".to_string()], vec![])
        );
        assert_eq!(
            controllers_at(&host, &sub, "127.0.0.1", "4421"),
            (
                vec![],
                vec!["nvme4: traddr=127.0.0.1,trsvcid=4420,src_addr=127.0.0.1".to_string()]
            )
        );
        assert!(!address_is(
            "traddr=127.0.0.10,trsvcid=4420",
            "127.0.0.1",
            "4420"
        ));
        let dev = |n: &str| host.dev.join(n).to_string_lossy().into_owned();
        assert_eq!(device_of(&host, &nqn_of("a")), Some(dev("nvme1n1")));
        assert_eq!(device_of(&host, &nqn_of("b")), Some(dev("nvme4n1")));
        assert_eq!(device_of(&host, &nqn_of("c")), None);
        let sub = subsystem(&host, &nqn_of("a")).unwrap();
        assert_eq!(controllers(&sub), ["nvme1"]);
        // A device node not made yet is not a device.
        std::fs::remove_file(host.dev.join("nvme4n1")).unwrap();
        assert_eq!(device_of(&host, &nqn_of("b")), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
