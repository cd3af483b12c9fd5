//! The `nbd` attach: the kernel's nbd client connected to this node's
//! daemon's NBD server, export named after the volume, with `nbd-client`
//! (Debian package nbd-client; 3.24 configures the device over netlink
//! and exits).
//!
//! ```text
//! stage    a free device: /sys/block/nbdN without pid, recorded by no other volume
//!          <dir>/nbd.json  {"device": "nbdN", "host", "port", "export"}   (first)
//!          nbd-client -N VOLUME HOST PORT /dev/nbdN
//!          /sys/block/nbdN/pid appears: connected
//! unstage  nbd-client -d /dev/nbdN (when connected), a wait until pid is gone, the record removed
//! expand   nothing: the device keeps the size of its NBD handshake
//! ```
//!
//! As for `nvme-tcp`, only [`super::Host`]'s sysfs and /dev are read and
//! only its `nbd-client` runs: crates/csi/tests/attach.rs uses fakes,
//! crates/csi/tests/kernel.rs the real kernel (in the kernel tier's VM).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{
    read_json, remove_file, split_addr, write_json, AttachError, Host, STATE_POLL_INTERVAL,
};
use crate::cmd;

/// How long the kernel may take to show the connection (`pid`) after
/// nbd-client answered: it configures the device before it exits, so
/// this is a bound, not an expected wait.
pub const NBD_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a device may take to let go after `nbd-client -d` (the
/// kernel tears the connection down once in-flight requests end).
pub const NBD_DISCONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The record of what this method attached, in the volume's directory.
pub(super) const RECORD_FILE: &str = "nbd.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Record {
    /// `nbd3`: /dev/nbd3, /sys/block/nbd3.
    device: String,
    host: String,
    port: u16,
    export: String,
}

/// The kernel's nbd devices (`nbd0` ...), in number order.
pub(super) fn devices(host: &Host) -> Vec<String> {
    let Ok(read) = std::fs::read_dir(host.sys.join("block")) else {
        return Vec::new();
    };
    let mut devs: Vec<(u32, String)> = read
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| Some((n.strip_prefix("nbd")?.parse().ok()?, n)))
        .collect();
    devs.sort();
    devs.into_iter().map(|(_, n)| n).collect()
}

/// `/sys/block/NAME/pid`: present while the device is connected.
fn pid_file(host: &Host, name: &str) -> PathBuf {
    host.sys.join("block").join(name).join("pid")
}

fn connected(host: &Host, name: &str) -> bool {
    pid_file(host, name).exists()
}

fn dev_path(host: &Host, name: &str) -> String {
    host.dev.join(name).to_string_lossy().into_owned()
}

/// The volume's device when this method attached it (a record, and the
/// kernel shows the device connected).
pub(super) fn device(host: &Host, dir: &Path) -> Result<Option<String>, AttachError> {
    Ok(read_json::<Record>(dir, RECORD_FILE)?
        .filter(|r| connected(host, &r.device))
        .map(|r| dev_path(host, &r.device)))
}

/// Devices other volumes' records name (taken, even while not connected:
/// their stage is between the record and the connect, or their
/// connection dropped and their unstage will disconnect that device).
fn recorded_elsewhere(state_dir: &Path, volume: &str) -> Vec<String> {
    let Ok(read) = std::fs::read_dir(state_dir) else {
        return Vec::new();
    };
    read.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str() != Some(volume))
        .filter_map(|e| read_json::<Record>(&e.path(), RECORD_FILE).ok().flatten())
        .map(|r| r.device)
        .collect()
}

/// Connects the volume's export on a free nbd device (its recorded one
/// when a record is left) and waits until the kernel shows it connected.
/// A volume connected already answers its device. Returns the device.
pub(super) async fn attach(
    host: &Host,
    state_dir: &Path,
    volume: &str,
    addr: &str,
    pick: &tokio::sync::Mutex<()>,
) -> Result<String, AttachError> {
    let dir = state_dir.join(volume);
    let recorded = read_json::<Record>(&dir, RECORD_FILE)?;
    if let Some(r) = &recorded {
        if connected(host, &r.device) {
            return Ok(dev_path(host, &r.device));
        }
    }
    let (nbd_host, port) = split_addr("the node's nbd address", addr)?;
    // Chosen and connected under the lock: a device is free until its
    // connection shows, and two stages at once would take the same one.
    let _pick = pick.lock().await;
    let name = match recorded {
        Some(r) => r.device,
        None => {
            let taken = recorded_elsewhere(state_dir, volume);
            let all = devices(host);
            all.iter()
                .find(|n| !connected(host, n) && !taken.contains(n))
                .cloned()
                .ok_or(AttachError::NoFreeNbd { count: all.len() })?
        }
    };
    let record = Record {
        device: name.clone(),
        host: nbd_host,
        port,
        export: volume.to_string(),
    };
    write_json(&dir, RECORD_FILE, &record)?;
    let dev = dev_path(host, &name);
    let port = port.to_string();
    cmd::run(&host.nbd_client, &["-N", volume, &record.host, &port, &dev]).await?;
    tracing::info!(volume, device = %dev, addr, "nbd-client connected");
    let deadline = Instant::now() + NBD_CONNECT_TIMEOUT;
    let mut backoff = crate::Backoff::new(STATE_POLL_INTERVAL);
    while !connected(host, &name) {
        if Instant::now() >= deadline {
            return Err(AttachError::NbdNotConnected {
                device: dev,
                pid: pid_file(host, &name),
            });
        }
        backoff.wait().await;
    }
    Ok(dev)
}

/// Undoes [`attach`]: `nbd-client -d` of the recorded device while it is
/// connected, a wait until the kernel lets go, the record removed.
/// Nothing recorded, or a device no longer connected, succeeds.
pub(super) async fn detach(host: &Host, dir: &Path) -> Result<(), AttachError> {
    let Some(record) = read_json::<Record>(dir, RECORD_FILE)? else {
        return Ok(());
    };
    let name = record.device.as_str();
    if connected(host, name) {
        let dev = dev_path(host, name);
        cmd::run(&host.nbd_client, &["-d", &dev]).await?;
        tracing::info!(device = %dev, export = %record.export, "nbd-client disconnected");
        let deadline = Instant::now() + NBD_DISCONNECT_TIMEOUT;
        let mut backoff = crate::Backoff::new(STATE_POLL_INTERVAL);
        while connected(host, name) {
            if Instant::now() >= deadline {
                return Err(AttachError::NbdStillConnected { device: dev });
            }
            backoff.wait().await;
        }
    }
    remove_file(&dir.join(RECORD_FILE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_in_number_order_and_taken_ones() {
        let root = std::env::temp_dir().join(format!("lull-csi-nbd-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let host = Host {
            sys: root.join("sys"),
            dev: root.join("dev"),
            ..Host::default()
        };
        for n in [10, 2, 0, 1] {
            std::fs::create_dir_all(host.sys.join(format!("block/nbd{n}"))).unwrap();
        }
        std::fs::create_dir_all(host.sys.join("block/loop0")).unwrap();
        assert_eq!(devices(&host), ["nbd0", "nbd1", "nbd2", "nbd10"]);
        std::fs::write(pid_file(&host, "nbd0"), "1\n").unwrap();
        assert!(connected(&host, "nbd0") && !connected(&host, "nbd1"));
        let state = root.join("state");
        let rec = Record {
            device: "nbd1".into(),
            host: "127.0.0.1".into(),
            port: 10809,
            export: "a".into(),
        };
        write_json(&state.join("a"), RECORD_FILE, &rec).unwrap();
        assert_eq!(recorded_elsewhere(&state, "b"), ["nbd1"]);
        assert!(recorded_elsewhere(&state, "a").is_empty());
        assert_eq!(
            read_json::<Record>(&state.join("a"), RECORD_FILE).unwrap(),
            Some(rec)
        );
        assert_eq!(device(&host, &state.join("a")).unwrap(), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
