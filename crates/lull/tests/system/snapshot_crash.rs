//! Snapshot operations cut short by SIGKILL (issue 28, crash safety): a
//! file volume whose server is killed at a random moment of a
//! `snapshot_create`, `snapshot_delete` (its merge) or `volume_revert`
//! opens again with either the old state or the new one,
//! never a mix: the live volume reads as before or after the operation,
//! every snapshot listed reads as it was taken, and the chain's files are
//! exactly the ones its record names.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::tools::{qemu_io, run, uri};
use crate::common::{self, Scratch, Server};

const MIB: usize = 1 << 20;
const SIZE: usize = 16 * MIB;
const ROUNDS: u64 = 14;

/// A small deterministic generator (the test prints its seed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn copy_out(server: &Server, export: &str, dir: &Path) -> Vec<u8> {
    let out = dir.join("copy.img");
    let _ = std::fs::remove_file(&out);
    run(Command::new("nbdcopy").arg(uri(server, export)).arg(&out));
    std::fs::read(&out).expect("read the copy")
}

/// The snapshots the server lists, oldest first.
fn listed(server: &Server) -> Vec<String> {
    let list = server.rpc("snapshot_list", r#"{"volume":"v"}"#);
    list.as_array()
        .expect("a list")
        .iter()
        .map(|s| s["name"].as_str().expect("name").to_string())
        .collect()
}

/// Starts `lull rpc METHOD PARAMS` without waiting for it.
fn rpc_in_background(server: &Server, method: &str, params: &str) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_lull"))
        .args(["rpc", "--socket"])
        .arg(server.rpc_socket())
        .args([method, params])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("lull rpc")
}

#[test]
fn snapshot_operations_cut_by_sigkill_leave_the_old_state_or_the_new() {
    common::require("nbdcopy", "libnbd-bin");
    let seed = std::env::var("SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                | 1
        });
    println!("SEED={seed}");
    let mut rng = Rng(seed);
    let dir = Scratch::new("snapshot-crash");
    let file = dir.join("v.img");
    let spec = format!("v:16M:file={}", file.display());
    let args = ["--volume", spec.as_str()];
    let mut server = Server::start(&args);
    // The model: the live volume and each snapshot's content.
    let mut live = vec![0u8; SIZE];
    let mut snaps: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut n = 0;
    for round in 0..ROUNDS {
        // Some data first, so there is something to copy up and merge.
        let (at, len, byte) = (
            rng.below(12) as usize * MIB,
            (1 + rng.below(4)) as usize * MIB,
            (round as u8).wrapping_mul(37) | 1,
        );
        qemu_io(&server, "v", &[format!("write -P {byte:#x} {at} {len}")]);
        live[at..at + len].fill(byte);
        let before_live = live.clone();
        let op = rng.below(4);
        let (method, params, what) = match op {
            1 if !order.is_empty() => {
                let s = order[rng.below(order.len() as u64) as usize].clone();
                let p = format!(r#"{{"volume":"v","name":"{s}"}}"#);
                ("snapshot_delete", p, format!("delete {s}"))
            }
            2 if !order.is_empty() => {
                let s = order[rng.below(order.len() as u64) as usize].clone();
                let p = format!(r#"{{"volume":"v","snapshot":"{s}","force":true}}"#);
                ("volume_revert", p, format!("revert to {s}"))
            }
            _ => {
                n += 1;
                let s = format!("s{n}");
                let p = format!(r#"{{"volume":"v","name":"{s}"}}"#);
                ("snapshot_create", p, format!("create {s}"))
            }
        };
        let mut rpc = rpc_in_background(&server, method, &params);
        std::thread::sleep(Duration::from_micros(rng.below(40_000)));
        server.kill();
        let _ = rpc.wait();
        server = Server::start(&args);
        let names = listed(&server);
        let now = copy_out(&server, "v", &dir);
        println!("round {round}: {what}, killed; after restart {names:?}");
        // Which of the two states came back, by what the server lists.
        match method {
            "snapshot_create" => {
                let s = format!("s{n}");
                if names.contains(&s) {
                    snaps.insert(s.clone(), before_live.clone());
                    order.push(s);
                }
                assert!(now == before_live, "{what}: the live volume changed");
            }
            "snapshot_delete" => {
                let s = what.trim_start_matches("delete ").to_string();
                if !names.contains(&s) {
                    snaps.remove(&s);
                    order.retain(|o| *o != s);
                }
                assert!(now == before_live, "{what}: the live volume changed");
            }
            _ => {
                let s = what.trim_start_matches("revert to ").to_string();
                let i = order.iter().position(|o| *o == s).expect("in the model");
                let reverted = names[..] == order[..=i] && now == snaps[&s];
                let unchanged = names == order && now == before_live;
                assert!(
                    reverted || unchanged,
                    "{what}: neither the old nor the new state"
                );
                if reverted && !unchanged {
                    // Reverted: the newer snapshots went with it.
                    for o in order.drain(i + 1..) {
                        snaps.remove(&o);
                    }
                    live = snaps[&s].clone();
                }
            }
        }
        assert_eq!(names, order, "{what}: the snapshots listed");
        for (name, want) in &snaps {
            let got = copy_out(&server, &format!("v@{name}"), &dir);
            assert!(&got == want, "{what}: snapshot {name} reads as taken");
        }
        // Only the files the record names: the volume's layers.
        let chain = std::fs::read_to_string(dir.join("v.img.lull/chain.json")).unwrap_or_default();
        if let Ok(entries) = std::fs::read_dir(dir.join("v.img.lull")) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if let Some(id) = name.strip_prefix('L').and_then(|n| n.strip_suffix(".img")) {
                    assert!(
                        chain.contains(&format!("\"id\": {id}")),
                        "{what}: {name} is not in the record:\n{chain}"
                    );
                }
            }
        }
    }
    server.assert_healthy();
}
