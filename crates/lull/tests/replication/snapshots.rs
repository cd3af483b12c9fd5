//! Snapshots of a replicated volume (issue 28): the engine holds new
//! writes, lets those in flight finish, and has every healthy replica take
//! the snapshot under one name; revert and delete run the same way. Real
//! clients write and read (qemu-io, fio); each replica is then read alone
//! (the other killed) to check that both hold the same snapshot and data.
//!
//! ```text
//! cargo test -p lull --profile ci --test replication snapshots::
//! ```

use std::time::Duration;

use crate::common::state::all_healthy;
use crate::common::{self, tools, Kind, Replica, Scratch, Server};

const HEAL_TIMEOUT: Duration = Duration::from_secs(120);

fn start(dir: &str) -> (Scratch, Replica, Replica, Server) {
    let scratch = Scratch::new(dir);
    let a = Replica::start(Kind::Process, &scratch.join("a"), "64M");
    let b = Replica::start(Kind::Process, &scratch.join("b"), "64M");
    let spec = format!("v:64M:replicas={}+{}", a.target(), b.target());
    let server = Server::start(&["--replica-insecure", "--volume", &spec]);
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy", all_healthy);
    (scratch, a, b, server)
}

fn names(server: &Server) -> Vec<String> {
    server
        .rpc("snapshot_list", r#"{"volume":"v"}"#)
        .as_array()
        .expect("a list")
        .iter()
        .map(|s| s["name"].as_str().expect("a name").to_string())
        .collect()
}

fn refused(server: &Server, method: &str, params: &str) -> String {
    let (ok, text) = common::rpc_outcome(server.rpc_socket(), method, params);
    assert!(!ok, "{method} {params} should be refused: {text}");
    text
}

/// Reads `cmds` through the server with only `alone` of the two replicas
/// up: `other` is killed first and started again after (it is rebuilt).
fn read_alone(server: &Server, other: &mut Replica, cmds: &[&str]) {
    other.kill();
    server.wait_replicas("v", HEAL_TIMEOUT, "the other replica failed", |rs| {
        rs.iter().any(|r| r.state == "failed")
    });
    tools::qemu_io(server, "v", cmds);
    other.restart();
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy again", all_healthy);
}

/// Write A, snapshot, write B, revert: both replicas read A; the snapshot
/// is listed on both; delete merges it away; names and states the
/// operation cannot take are refused with the reason.
#[test]
fn a_replicated_volume_takes_reverts_and_deletes_snapshots() {
    let (_scratch, mut a, mut b, mut server) = start("snap-repl");
    tools::qemu_io(&server, "v", &["write -P 0xa1 0 4M", "write -P 0xa2 8M 1M"]);
    let snap = server.rpc("snapshot_create", r#"{"volume":"v","name":"s1"}"#);
    assert_eq!(snap["name"], "s1", "{snap}");
    assert_eq!(snap["complete"], true, "{snap}");
    assert_eq!(
        snap["replicas"].as_array().map(Vec::len),
        Some(2),
        "both replicas hold it: {snap}"
    );
    tools::qemu_io(
        &server,
        "v",
        &["write -P 0xb1 0 2M", "write -P 0xb2 32M 1M"],
    );
    tools::qemu_io(
        &server,
        "v",
        &[
            "read -P 0xb1 0 2M",
            "read -P 0xa1 2M 2M",
            "read -P 0xb2 32M 1M",
        ],
    );
    assert_eq!(names(&server), ["s1"]);

    // Refusals, each with its reason.
    let text = refused(&server, "snapshot_create", r#"{"volume":"v","name":"s1"}"#);
    assert!(text.contains("exists"), "{text}");
    for bad in ["a@b", "a/b", "", ".x"] {
        let text = refused(
            &server,
            "snapshot_create",
            &format!(r#"{{"volume":"v","name":"{bad}"}}"#),
        );
        assert!(text.contains("name"), "{bad:?}: {text}");
    }
    let text = refused(
        &server,
        "volume_revert",
        r#"{"volume":"v","snapshot":"nope"}"#,
    );
    assert!(text.contains("nope"), "{text}");

    // Revert: the live data is the snapshot's again, on both replicas.
    let reply = server.rpc("volume_revert", r#"{"volume":"v","snapshot":"s1"}"#);
    assert_eq!(reply["dropped_snapshots"], serde_json::json!([]), "{reply}");
    let expect = [
        "read -P 0xa1 0 4M",
        "read -P 0xa2 8M 1M",
        "read -P 0 32M 1M",
    ];
    tools::qemu_io(&server, "v", &expect);
    read_alone(&server, &mut b, &expect);
    read_alone(&server, &mut a, &expect);

    // Writes after the revert go on; a second snapshot stacks.
    tools::qemu_io(&server, "v", &["write -P 0xc1 4M 1M"]);
    server.rpc("snapshot_create", r#"{"volume":"v","name":"s2"}"#);
    assert_eq!(names(&server), ["s1", "s2"]);

    // While a replica is away, no snapshot operation runs: it would miss
    // it.
    b.kill();
    server.wait_replicas("v", HEAL_TIMEOUT, "b failed", |rs| {
        rs.iter().any(|r| r.state == "failed")
    });
    let text = refused(&server, "snapshot_create", r#"{"volume":"v","name":"s3"}"#);
    assert!(text.contains("every replica healthy"), "{text}");
    b.restart();
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy again", all_healthy);

    // Delete: merged into its child on each replica; the data stays.
    server.rpc("snapshot_delete", r#"{"volume":"v","name":"s1"}"#);
    let deadline = std::time::Instant::now() + HEAL_TIMEOUT;
    while names(&server) != ["s2"] {
        assert!(
            std::time::Instant::now() < deadline,
            "s1 never merged away: {:?}",
            names(&server)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let text = refused(&server, "snapshot_delete", r#"{"volume":"v","name":"s1"}"#);
    assert!(text.contains("s1"), "{text}");
    let now = [
        "read -P 0xa1 0 4M",
        "read -P 0xc1 4M 1M",
        "read -P 0xa2 8M 1M",
    ];
    tools::qemu_io(&server, "v", &now);
    read_alone(&server, &mut a, &now);
    server.assert_healthy();
}

/// Snapshots taken while fio writes at queue depth 32: every one
/// completes on both replicas, no write fails, and fio's verify of what
/// it wrote passes afterwards.
#[test]
fn snapshots_under_load_hold_writes_briefly_and_lose_none() {
    let (_scratch, _a, _b, mut server) = start("snap-load");
    let uri = format!("nbd://{}/v", server.addr());
    let fio = std::process::Command::new("fio")
        .args([
            "--name=w",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--size=32M",
            "--time_based",
            "--runtime=4",
            "--verify=crc32c",
            "--verify_backlog=64",
            "--output-format=json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start fio");
    std::thread::sleep(Duration::from_millis(500));
    for i in 0..10 {
        let reply = server.rpc(
            "snapshot_create",
            &format!(r#"{{"volume":"v","name":"load-{i}"}}"#),
        );
        assert_eq!(reply["complete"], true, "{reply}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = fio.wait_with_output().expect("fio");
    // fio ran to its end (a bad verify fails it) with no I/O error.
    let report = common::fio_json(&out);
    assert_eq!(report["jobs"][0]["error"], 0, "{report}");
    let list = names(&server);
    assert_eq!(list.len(), 10, "{list:?}");
    server.assert_healthy();
}
