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

/// Snapshots every 200 ms while fio writes at queue depth 32 (with
/// verify) on one part of the volume and a recorded writer
/// (`scripts/snapshot-io.py`, 8 writes in flight) on another, and a
/// replica killed and started again in the middle: no write fails, fio's
/// verify passes, each snapshot taken holds exactly what was acknowledged
/// when it was taken (read through its export, from one replica and then
/// from the other alone). Every snapshot ends up on both replicas: the
/// one whose operation the kill cut completed on the replica left, and
/// the killed one gets it back (a layer sync) before its rebuild.
#[test]
fn snapshots_under_load_hold_what_was_acknowledged() {
    let (scratch, mut a, mut b, mut server) = start("snap-load");
    let python = common::python_with_nbd();
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
            "--runtime=9",
            "--verify=crc32c",
            "--verify_backlog=64",
            "--output-format=json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start fio");
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/snapshot-io.py");
    let record = scratch.join("snapshot-io.json");
    let socket = server
        .rpc_socket()
        .to_str()
        .expect("a UTF-8 path")
        .to_string();
    let writer = std::process::Command::new(python)
        .arg(&script)
        .args([
            "run",
            &uri,
            &socket,
            "v",
            &(32u64 << 20).to_string(),
            "4096",
            "8",
            "200",
            env!("CARGO_BIN_EXE_lull"),
        ])
        .arg(&record)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start scripts/snapshot-io.py");
    // A replica away for a second in the middle: snapshots are refused
    // meanwhile, and it comes back with the ones taken before.
    std::thread::sleep(Duration::from_secs(3));
    b.kill();
    server.wait_replicas("v", HEAL_TIMEOUT, "b failed", |rs| {
        rs.iter().any(|r| r.state == "failed")
    });
    std::thread::sleep(Duration::from_secs(1));
    b.restart();
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy again", all_healthy);
    let out = writer.wait_with_output().expect("scripts/snapshot-io.py");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "scripts/snapshot-io.py run: {text}");
    let out = fio.wait_with_output().expect("fio");
    // fio ran to its end (a bad verify fails it) with no I/O error.
    let report = common::fio_json(&out);
    assert_eq!(report["jobs"][0]["error"], 0, "{report}");

    // Every snapshot on both replicas, and each one's bytes the same on
    // the other replica alone.
    let list = server.rpc("snapshot_list", r#"{"volume":"v"}"#);
    let snaps = list.as_array().expect("a list");
    assert!(snaps.len() >= 10, "{list}");
    for snap in snaps {
        assert_eq!(snap["complete"], true, "{snap}");
        assert_eq!(snap["replicas"].as_array().map(Vec::len), Some(2), "{snap}");
    }
    a.kill();
    server.wait_replicas("v", HEAL_TIMEOUT, "a failed", |rs| {
        rs.iter().any(|r| r.state == "failed")
    });
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg("check")
        .arg(&record)
        .output()
        .expect("scripts/snapshot-io.py check");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the snapshots read from b alone: {text}"
    );
    a.restart();
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy again", all_healthy);
    server.assert_healthy();
}

/// The bytes `nbdcopy` reads from `export`.
fn copy_out(server: &Server, scratch: &Scratch, export: &str) -> Vec<u8> {
    common::require("nbdcopy", "libnbd-bin");
    let out = scratch.join(format!("{}.img", export.replace('@', "_at_")));
    let _ = std::fs::remove_file(&out);
    tools::run(
        std::process::Command::new("nbdcopy")
            .arg(tools::uri(server, export))
            .arg(&out),
    );
    std::fs::read(&out).expect("read the copy")
}

/// Each export's `nbdcopy` equals its image; `when` says what the test
/// did before, for the failure message.
fn expect_copies(server: &Server, scratch: &Scratch, exports: &[(&str, &[u8])], when: &str) {
    for (export, image) in exports {
        assert!(
            copy_out(server, scratch, export) == *image,
            "{export} does not hold what it should ({when})"
        );
    }
}

/// A 64 MiB image with `fill` bytes written over `(offset, len)` ranges.
fn image(fills: &[(u8, u64, u64)]) -> Vec<u8> {
    let mut img = vec![0u8; 64 << 20];
    for &(byte, offset, len) in fills {
        img[offset as usize..(offset + len) as usize].fill(byte);
    }
    img
}

/// A replicated volume's snapshot, read by real clients through its
/// read-only export `v@s1` while the live volume holds later writes:
/// nbdcopy copies the snapshot's bytes, nbdinfo maps its allocation,
/// libnbd sees the read-only flag and a write refused with EPERM. With the
/// replica the view reads from killed, the copy reads from the other.
#[test]
fn a_replicated_snapshot_is_served_read_only_over_nbd() {
    let (scratch, mut a, _b, mut server) = start("snap-repl-view");
    tools::qemu_io(&server, "v", &["write -P 0xa1 0 4M", "write -P 0xa2 8M 1M"]);
    let snap = server.rpc("snapshot_create", r#"{"volume":"v","name":"s1"}"#);
    assert_eq!(snap["export"], "v@s1", "{snap}");
    tools::qemu_io(
        &server,
        "v",
        &["write -P 0xb1 0 2M", "write -P 0xb2 32M 1M"],
    );
    // An incremental backup's map: what changed between s1 and s2 (not
    // what was written after s2), block by block, from the replicas.
    tools::qemu_io(
        &server,
        "v",
        &["write -P 0xb3 40M 100", "write -P 0xb4 44M 8K"],
    );
    server.rpc("snapshot_create", r#"{"volume":"v","name":"s2"}"#);
    tools::qemu_io(&server, "v", &["write -P 0xc1 48M 1M"]);
    assert_eq!(
        tools::nbdinfo_changed(&server, "v@s2", "lull:changed:s1"),
        [
            (0, 2 << 20),
            (32 << 20, 1 << 20),
            (40 << 20, 4096),
            (44 << 20, 8192)
        ]
    );
    // Both contexts in one request (base:allocation then lull:changed,
    // each asked of a replica in turn): libnbd sees both, consistent.
    let python = common::python_with_nbd();
    let both = tools::run(std::process::Command::new(python).args([
        "-c",
        "import nbd, sys\nh = nbd.NBD()\nh.add_meta_context('base:allocation')\nh.add_meta_context('lull:changed:s1')\nh.connect_uri(sys.argv[1])\nseen = {}\ndef cb(ctx, off, ents, err):\n    seen.setdefault(ctx, []).extend(ents)\n    return 0\noff = 0\nsize = h.get_size()\nwhile off < size:\n    seen.clear()\n    h.block_status(min(size - off, 1 << 30), off, cb)\n    step = min(sum(seen[c][0::2]) for c in seen)\n    for c in sorted(seen):\n        at = off\n        for i in range(0, len(seen[c]), 2):\n            print(c, at, seen[c][i], seen[c][i + 1])\n            at += seen[c][i]\n    off += step\n",
        &tools::uri(&server, "v@s2"),
    ]));
    let text = String::from_utf8_lossy(&both.stdout);
    let mut changed: Vec<(u64, u64)> = Vec::new();
    let mut base_data_at_32m = false;
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (o, l, flags): (u64, u64, u32) = (
            f[1].parse().unwrap(),
            f[2].parse().unwrap(),
            f[3].parse().unwrap(),
        );
        if f[0] == "lull:changed:s1" && flags & 1 != 0 {
            match changed.last_mut() {
                Some((co, cl)) if *co + *cl == o => *cl += l,
                _ => changed.push((o, l)),
            }
        }
        if f[0] == "base:allocation" && o <= 32 << 20 && 32 << 20 < o + l {
            base_data_at_32m = flags & 1 == 0;
        }
    }
    assert!(
        base_data_at_32m,
        "base:allocation: 32M is data in s2:\n{text}"
    );
    assert_eq!(
        changed,
        [
            (0, 2 << 20),
            (32 << 20, 1 << 20),
            (40 << 20, 4096),
            (44 << 20, 8192)
        ],
        "{text}"
    );
    // On the live volume: since s1, those and the write after s2 (asked
    // of a healthy replica by the engine).
    assert_eq!(
        tools::nbdinfo_changed(&server, "v", "lull:changed:s1"),
        [
            (0, 2 << 20),
            (32 << 20, 1 << 20),
            (40 << 20, 4096),
            (44 << 20, 8192),
            (48 << 20, 1 << 20)
        ]
    );
    let at_s1 = image(&[(0xa1, 0, 4 << 20), (0xa2, 8 << 20, 1 << 20)]);
    let mut now = image(&[
        (0xa1, 0, 4 << 20),
        (0xa2, 8 << 20, 1 << 20),
        (0xb1, 0, 2 << 20),
        (0xb2, 32 << 20, 1 << 20),
        (0xb3, 40 << 20, 100),
        (0xb4, 44 << 20, 8 << 10),
    ]);
    let at_s2 = now.clone();
    now[48 << 20..49 << 20].fill(0xc1);
    expect_copies(
        &server,
        &scratch,
        &[("v@s1", &at_s1), ("v", &now), ("v@s2", &at_s2)],
        "writes after each snapshot",
    );

    // Its map is the snapshot's: 32M.. is a hole there, data live.
    let data_at = |map: &tools::NbdinfoMap, offset: u64| {
        map.iter()
            .find(|(o, l, _)| *o <= offset && offset < o + l)
            .map(|(_, _, t)| t & 1 == 0)
            .expect("the map covers the volume")
    };
    let snap_map = tools::nbdinfo_map(&server, "v@s1");
    assert!(
        data_at(&snap_map, 0) && data_at(&snap_map, 8 << 20),
        "{snap_map:?}"
    );
    assert!(
        !data_at(&snap_map, 32 << 20),
        "32M is a hole in s1: {snap_map:?}"
    );
    assert!(data_at(&tools::nbdinfo_map(&server, "v"), 32 << 20));

    // Read-only: the flag, and a write refused.
    let python = common::python_with_nbd();
    let out = tools::run(std::process::Command::new(python).args([
        "-c",
        "import nbd, sys\nh = nbd.NBD()\nh.connect_uri(sys.argv[1])\nassert h.is_read_only(), 'read-only flag'\ntry:\n    h.pwrite(b'x' * 4096, 0)\n    print('written')\nexcept nbd.Error as e:\n    print('refused', e.errno)\n",
        &tools::uri(&server, "v@s1"),
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.trim() == "refused EPERM" || text.trim() == "refused 1",
        "a write to v@s1: {text}"
    );
    // A snapshot that does not exist is no export.
    common::require("nbdinfo", "libnbd-bin");
    let missing = std::process::Command::new("nbdinfo")
        .arg(tools::uri(&server, "v@nope"))
        .output()
        .expect("run nbdinfo");
    assert!(!missing.status.success(), "v@nope was served");

    // The replica listed first (both healthy) is killed: the view reads
    // from the other.
    a.kill();
    expect_copies(
        &server,
        &scratch,
        &[("v@s1", &at_s1)],
        "the first replica killed",
    );
    a.restart();
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy again", all_healthy);
    server.assert_healthy();
}

/// A replica added to a volume with snapshots gets every one of them
/// before its rebuild (a layer sync from a healthy replica): with the two
/// first replicas killed, the new one alone serves the live data and each
/// snapshot's bytes.
#[test]
fn a_new_replica_gets_every_snapshot() {
    let (scratch, mut a, mut b, mut server) = start("snap-new-replica");
    tools::qemu_io(
        &server,
        "v",
        &["write -P 0xa1 0 4M", "write -P 0xa2 20M 1M"],
    );
    server.rpc("snapshot_create", r#"{"volume":"v","name":"s1"}"#);
    tools::qemu_io(&server, "v", &["write -P 0xb1 2M 4M", "write -P 0 20M 64K"]);
    server.rpc("snapshot_create", r#"{"volume":"v","name":"s2"}"#);
    tools::qemu_io(&server, "v", &["write -P 0xc1 40M 1M"]);
    let at_s1 = image(&[(0xa1, 0, 4 << 20), (0xa2, 20 << 20, 1 << 20)]);
    let at_s2 = image(&[
        (0xa1, 0, 4 << 20),
        (0xa2, 20 << 20, 1 << 20),
        (0xb1, 2 << 20, 4 << 20),
        (0, 20 << 20, 64 << 10),
    ]);
    let mut now = at_s2.clone();
    now[40 << 20..41 << 20].fill(0xc1);

    let mut c = Replica::start(Kind::Process, &scratch.join("c"), "64M");
    server.rpc(
        "replica_add",
        &format!(r#"{{"volume":"v","addr":"{}"}}"#, c.target()),
    );
    server.wait_replicas("v", HEAL_TIMEOUT, "three healthy", |rs| {
        rs.len() == 3 && all_healthy(rs)
    });
    let list = server.rpc("snapshot_list", r#"{"volume":"v"}"#);
    for snap in list.as_array().expect("a list") {
        assert_eq!(snap["complete"], true, "{list}");
        assert_eq!(snap["replicas"].as_array().map(Vec::len), Some(3), "{list}");
    }

    // The new replica alone.
    a.kill();
    b.kill();
    server.wait_replicas("v", HEAL_TIMEOUT, "a and b failed", |rs| {
        rs.iter().filter(|r| r.state == "failed").count() == 2
    });
    expect_copies(
        &server,
        &scratch,
        &[("v@s1", &at_s1), ("v@s2", &at_s2), ("v", &now)],
        "read from the new replica alone",
    );
    a.restart();
    b.restart();
    server.wait_replicas("v", HEAL_TIMEOUT, "all healthy again", all_healthy);
    c.kill();
    server.assert_healthy();
}

/// Bits of `snapshot_list`: (name, inherited, clones) of each snapshot.
fn listed(server: &Server, volume: &str) -> Vec<(String, bool, Vec<String>)> {
    server
        .rpc("snapshot_list", &format!(r#"{{"volume":"{volume}"}}"#))
        .as_array()
        .expect("a list")
        .iter()
        .map(|s| {
            let clones = s["clones"]
                .as_array()
                .expect("clones")
                .iter()
                .map(|c| c.as_str().expect("a name").to_string())
                .collect();
            (
                s["name"].as_str().expect("a name").to_string(),
                s["inherited"].as_bool().expect("inherited"),
                clones,
            )
        })
        .collect()
}

/// A clone of a replicated volume's snapshot is a replicated volume whose
/// replicas are made on its origin's replicas' stores (CLONE on a view),
/// sharing the snapshot's layers: it reads the snapshot, writes apart
/// from its origin, survives a replica's restart, and once flattened
/// stands alone and lets the snapshot go. Real clients read and write.
#[test]
fn a_replicated_snapshot_is_cloned_on_its_replicas_stores_and_flattened() {
    let scratch = Scratch::new("snap-repl-clone");
    let mut a = Replica::start(Kind::Store, &scratch.join("a"), "64M");
    let b = Replica::start(Kind::Store, &scratch.join("b"), "64M");
    let spec = format!("v:64M:replicas={}+{}", a.target(), b.target());
    // A node (`--store`): it records the clone's origin, and so names the
    // clone when the snapshot's delete is refused.
    let node_dir = scratch.join("node");
    let replica_port = common::free_port().to_string();
    let mut server = Server::start(&[
        "--replica-insecure",
        "--store",
        node_dir.to_str().expect("a path"),
        "--replica-listen",
        &replica_port,
        "--volume",
        &spec,
    ]);
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy", all_healthy);
    tools::qemu_io(
        &server,
        "v",
        &["write -P 0xa1 0 4M", "write -P 0xa2 20M 1M"],
    );
    server.rpc("snapshot_create", r#"{"volume":"v","name":"s1"}"#);
    tools::qemu_io(&server, "v", &["write -P 0xb1 2M 4M"]);
    let at_s1 = image(&[(0xa1, 0, 4 << 20), (0xa2, 20 << 20, 1 << 20)]);
    let v_now = image(&[
        (0xa1, 0, 4 << 20),
        (0xa2, 20 << 20, 1 << 20),
        (0xb1, 2 << 20, 4 << 20),
    ]);

    // Bad input first: nothing is made for it.
    let why = refused(
        &server,
        "volume_clone",
        r#"{"snapshot":"v@nope","name":"c"}"#,
    );
    assert!(why.contains("nope"), "{why}");
    let why = refused(
        &server,
        "volume_clone",
        r#"{"snapshot":"v@s1","name":"c","backend":"malloc"}"#,
    );
    assert!(why.contains("backend"), "{why}");
    let why = refused(&server, "volume_clone", r#"{"snapshot":"v@s1","name":"v"}"#);
    assert!(why.contains("exists"), "{why}");

    let info = server.rpc("volume_clone", r#"{"snapshot":"v@s1","name":"c"}"#);
    assert_eq!(info["name"], "c", "{info}");
    server.wait_replicas("c", HEAL_TIMEOUT, "the clone's replicas healthy", |rs| {
        rs.len() == 2 && all_healthy(rs)
    });
    let targets: Vec<String> = server.replicas("c").into_iter().map(|r| r.addr).collect();
    assert!(
        targets[0].ends_with("/c.r0") && targets[1].ends_with("/c.r1"),
        "{targets:?}"
    );
    // Made on the origin's stores, sharing its layers: the store lists
    // it, and its files hold only its own head.
    let made = common::rpc(&a.rpc_socket(), "replica_get", r#"{"name":"c.r0"}"#);
    assert!(
        made["allocated_bytes"].as_u64().expect("bytes") < 1 << 20,
        "{made}"
    );
    expect_copies(&server, &scratch, &[("c", &at_s1)], "a new clone");
    assert_eq!(listed(&server, "c"), [("s1".to_string(), true, vec![])]);
    assert_eq!(
        listed(&server, "v"),
        [("s1".to_string(), false, vec!["c".to_string()])]
    );

    // Writes go apart; the snapshot and the origin are untouched.
    tools::qemu_io(
        &server,
        "c",
        &["write -P 0xc1 20M 64K", "write -P 0xc2 40M 1M"],
    );
    let mut c_now = at_s1.clone();
    c_now[20 << 20..(20 << 20) + (64 << 10)].fill(0xc1);
    c_now[40 << 20..41 << 20].fill(0xc2);
    expect_copies(
        &server,
        &scratch,
        &[
            ("c", &c_now),
            ("v", &v_now),
            ("v@s1", &at_s1),
            ("c@s1", &at_s1),
        ],
        "writes to the clone",
    );
    server.rpc("snapshot_create", r#"{"volume":"c","name":"cs1"}"#);

    // What the clone stands on cannot go, and the refusal names it.
    let why = refused(&server, "snapshot_delete", r#"{"volume":"v","name":"s1"}"#);
    assert!(why.contains("\"c\"") || why.contains(" c"), "{why}");
    let why = refused(&server, "snapshot_delete", r#"{"volume":"c","name":"s1"}"#);
    assert!(why.contains("flatten"), "{why}");
    let (ok, why) = common::rpc_outcome(&a.rpc_socket(), "replica_delete", r#"{"name":"r"}"#);
    assert!(!ok && why.contains("c.r0"), "{why}");

    // A replica of both volumes away and back: both heal (the clone's
    // layer sync leaves the inherited base alone).
    a.kill();
    server.wait_replicas("c", HEAL_TIMEOUT, "c's first replica failed", |rs| {
        rs.iter().any(|r| r.state == "failed")
    });
    tools::qemu_io(&server, "c", &["write -P 0xc3 48M 1M"]);
    c_now[48 << 20..49 << 20].fill(0xc3);
    a.restart();
    server.wait_replicas("c", HEAL_TIMEOUT, "the clone healthy again", all_healthy);
    server.wait_replicas("v", HEAL_TIMEOUT, "the origin healthy again", all_healthy);

    // Flatten: every replica copies the base in; then the snapshot is
    // free, and the clone reads the same.
    server.rpc("volume_flatten", r#"{"name":"c"}"#);
    let flat = crate::common::state::wait_until(HEAL_TIMEOUT, || {
        listed(&server, "c")
            .iter()
            .all(|(_, inherited, _)| !inherited)
    });
    assert!(flat, "c still lists its base: {:?}", listed(&server, "c"));
    assert_eq!(listed(&server, "c"), [("cs1".to_string(), false, vec![])]);
    let why = refused(&server, "volume_flatten", r#"{"name":"c"}"#);
    assert!(why.contains("not a clone"), "{why}");
    server.rpc("snapshot_delete", r#"{"volume":"v","name":"s1"}"#);
    let gone = crate::common::state::wait_until(HEAL_TIMEOUT, || names(&server).is_empty());
    assert!(gone, "s1 still listed: {:?}", names(&server));
    expect_copies(
        &server,
        &scratch,
        &[("c", &c_now), ("v", &v_now)],
        "after the flatten and the origin's delete",
    );
    server.assert_healthy();
}
