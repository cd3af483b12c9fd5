//! Snapshots, clones and revert proven by real clients: qemu-io writes,
//! `nbdcopy` reads a snapshot's read-only export `VOLUME@SNAPSHOT`,
//! `nbdinfo --map=lull:changed:S` lists what an incremental backup must
//! copy, libnbd's Python bindings see writes to a snapshot refused.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::tools::{nbdinfo_changed, qemu_io, run, uri};
use crate::common::{self, NbdClient, Server};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;

/// What the volume holds, kept by the test as it writes.
struct Image(Vec<u8>);

impl Image {
    fn new() -> Image {
        Image(vec![0; SIZE as usize])
    }

    fn write(&mut self, server: &Server, export: &str, byte: u8, offset: u64, len: u64) {
        qemu_io(
            server,
            export,
            &[format!("write -P {byte:#x} {offset} {len}")],
        );
        self.0[offset as usize..(offset + len) as usize].fill(byte);
    }
}

/// `nbdcopy` of an export into a file; its bytes.
fn copy_out(server: &Server, export: &str, dir: &Path) -> Vec<u8> {
    common::require("nbdcopy", "libnbd-bin");
    let out = dir.join(format!("{}.img", export.replace('@', "_at_")));
    let _ = std::fs::remove_file(&out);
    run(Command::new("nbdcopy").arg(uri(server, export)).arg(&out));
    std::fs::read(&out).expect("read the copy")
}

/// Blocks (4 KiB) touched by writes `(offset, length)`, as merged extents.
fn blocks_of(writes: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut blocks: Vec<u64> = writes
        .iter()
        .flat_map(|&(o, l)| (o / 4096)..(o + l).div_ceil(4096))
        .collect();
    blocks.sort_unstable();
    blocks.dedup();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for b in blocks {
        match runs.last_mut() {
            Some((o, l)) if *o + *l == b * 4096 => *l += 4096,
            _ => runs.push((b * 4096, 4096)),
        }
    }
    runs
}

fn rpc_ok(server: &Server, method: &str, params: &str) -> serde_json::Value {
    server.rpc(method, params)
}

fn rpc_refused(server: &Server, method: &str, params: &str) -> String {
    let (ok, text) = common::rpc_outcome(server.rpc_socket(), method, params);
    assert!(!ok, "{method} {params} should have been refused: {text}");
    text
}

/// Waits until `volume` has no snapshot being merged.
fn wait_merges(server: &Server, volume: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let list = rpc_ok(
            server,
            "snapshot_list",
            &format!(r#"{{"volume":"{volume}"}}"#),
        );
        let busy = list
            .as_array()
            .expect("a list")
            .iter()
            .any(|s| !s["merging"].is_null());
        if !busy {
            return list;
        }
        assert!(Instant::now() < deadline, "merges did not finish: {list}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn snapshots_end_to_end(backend: Option<&Path>) {
    let dir = common::Scratch::new("snapshots");
    let spec = match backend {
        Some(d) => format!("vol0:16M:file={}", d.join("vol0.img").display()),
        None => "vol0:16M".to_string(),
    };
    let mut server = Server::start(&["--volume", &spec]);
    let mut image = Image::new();
    image.write(&server, "vol0", 0xa1, 0, 4 * MIB);
    let a = image.0.clone();
    let s1 = rpc_ok(
        &server,
        "snapshot_create",
        r#"{"volume":"vol0","name":"s1"}"#,
    );
    assert_eq!(s1["export"], "vol0@s1", "{s1}");

    // Between s1 and s2: aligned writes, an unaligned one inside a block
    // s1 holds (copied up), one across two blocks' edges.
    let between = [
        (MIB, MIB),
        (6 * MIB, 64 << 10),
        (3 * MIB + 100, 512),
        (5 * MIB - 300, 1000),
    ];
    for (i, &(o, l)) in between.iter().enumerate() {
        image.write(&server, "vol0", 0xb0 + i as u8, o, l);
    }
    let b = image.0.clone();
    assert!(copy_out(&server, "vol0@s1", &dir) == a, "vol0@s1 holds A");
    assert!(copy_out(&server, "vol0", &dir) == b, "vol0 holds B");
    rpc_ok(
        &server,
        "snapshot_create",
        r#"{"volume":"vol0","name":"s2"}"#,
    );
    image.write(&server, "vol0", 0xc1, 8 * MIB, MIB);

    // What changed between s1 and s2: exactly the blocks written then.
    assert_eq!(
        nbdinfo_changed(&server, "vol0@s2", "lull:changed:s1"),
        blocks_of(&between)
    );
    // On the live volume: those and the write after s2.
    let mut since_s1 = between.to_vec();
    since_s1.push((8 * MIB, MIB));
    assert_eq!(
        nbdinfo_changed(&server, "vol0", "lull:changed:s1"),
        blocks_of(&since_s1)
    );

    // A snapshot's export is read-only: libnbd sees EPERM.
    let python = common::python_with_nbd();
    let out = run(Command::new(python).args([
        "-c",
        "import nbd, sys\nh = nbd.NBD()\nh.connect_uri(sys.argv[1])\nassert h.is_read_only(), 'read-only flag'\ntry:\n    h.pwrite(b'x' * 4096, 0)\n    print('written')\nexcept nbd.Error as e:\n    print('refused', e.errno)\n",
        &uri(&server, "vol0@s1"),
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.trim() == "refused EPERM" || text.trim() == "refused 1",
        "a write to vol0@s1: {text}"
    );

    // A clone of s1 reads A, takes writes, and leaves the origin alone.
    let c = rpc_ok(
        &server,
        "volume_clone",
        r#"{"snapshot":"vol0@s1","name":"c1"}"#,
    );
    assert_eq!(c["name"], "c1", "{c}");
    qemu_io(
        &server,
        "c1",
        &[
            "read -P 0xa1 0 4M",
            "write -P 0xd1 0 1M",
            "read -P 0xd1 0 1M",
        ],
    );
    qemu_io(&server, "vol0", &["read -P 0xa1 0 1M"]);
    let refused = rpc_refused(
        &server,
        "snapshot_delete",
        r#"{"volume":"vol0","name":"s1"}"#,
    );
    assert!(
        refused.contains("c1"),
        "the error names the clone: {refused}"
    );
    // A second clone, deleted: it lets go of s1 (c1 still holds it).
    rpc_ok(
        &server,
        "volume_clone",
        r#"{"snapshot":"vol0@s1","name":"c2"}"#,
    );
    rpc_ok(&server, "volume_delete", r#"{"name":"c2"}"#);
    let list = rpc_ok(&server, "snapshot_list", r#"{"volume":"vol0"}"#);
    assert_eq!(list[0]["clones"], serde_json::json!(["c1"]), "{list}");

    // Revert is refused while a client is connected, then done.
    let client = NbdClient::connect(server.addr(), "vol0").expect("connect");
    let refused = rpc_refused(
        &server,
        "volume_revert",
        r#"{"volume":"vol0","snapshot":"s1"}"#,
    );
    assert!(refused.contains("connected"), "{refused}");
    client.disconnect();
    let deadline = Instant::now() + Duration::from_secs(10);
    let reverted = loop {
        let (ok, text) = common::rpc_outcome(
            server.rpc_socket(),
            "volume_revert",
            r#"{"volume":"vol0","snapshot":"s1"}"#,
        );
        if ok {
            break text;
        }
        assert!(Instant::now() < deadline, "revert still refused: {text}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(reverted.contains("s2"), "s2 was dropped: {reverted}");
    assert!(copy_out(&server, "vol0", &dir) == a, "reverted to A");

    // The clone lets go of s1 once flattened; then s1 can be deleted,
    // and the volume still reads A.
    rpc_ok(&server, "volume_flatten", r#"{"name":"c1"}"#);
    qemu_io(&server, "c1", &["read -P 0xd1 0 1M", "read -P 0xa1 1M 3M"]);
    rpc_ok(
        &server,
        "snapshot_delete",
        r#"{"volume":"vol0","name":"s1"}"#,
    );
    let list = wait_merges(&server, "vol0");
    assert_eq!(list, serde_json::json!([]), "{list}");
    assert!(copy_out(&server, "vol0", &dir) == a, "A after the merge");
    server.assert_healthy();
}

#[test]
fn snapshots_of_a_memory_volume() {
    snapshots_end_to_end(None);
}

#[test]
fn snapshots_of_a_file_volume_survive_a_restart() {
    let dir = common::Scratch::new("snapshots-file");
    snapshots_end_to_end(Some(&dir));
    // The same file again: the chain is found, and its snapshots.
    let spec = format!("vol0:16M:file={}", dir.join("vol0.img").display());
    let server = Server::start(&["--volume", &spec]);
    rpc_ok(
        &server,
        "snapshot_create",
        r#"{"volume":"vol0","name":"again"}"#,
    );
    drop(server);
    let mut server = Server::start(&["--volume", &spec]);
    let list = rpc_ok(&server, "snapshot_list", r#"{"volume":"vol0"}"#);
    assert_eq!(list[0]["name"], "again", "{list}");
    let again = copy_out(&server, "vol0@again", &dir);
    assert!(
        again[..4 * MIB as usize].iter().all(|&b| b == 0xa1),
        "A in vol0@again"
    );
    // The clone's file sits next to the origin's, and came back too.
    assert!(dir.join("c1.img.lull/chain.json").exists() || dir.join("c1.img").exists());
    server.assert_healthy();
}

#[test]
fn bad_snapshot_requests_are_refused() {
    let mut server = Server::start(&["--volume", "vol0:1M"]);
    for bad in ["", "a@b", "a/b", ".x", "has space"] {
        let text = rpc_refused(
            &server,
            "snapshot_create",
            &format!(r#"{{"volume":"vol0","name":"{bad}"}}"#),
        );
        assert!(text.contains("name"), "{bad:?}: {text}");
    }
    rpc_ok(
        &server,
        "snapshot_create",
        r#"{"volume":"vol0","name":"s"}"#,
    );
    let text = rpc_refused(
        &server,
        "snapshot_create",
        r#"{"volume":"vol0","name":"s"}"#,
    );
    assert!(text.contains("exists"), "{text}");
    rpc_refused(
        &server,
        "snapshot_create",
        r#"{"volume":"nope","name":"s"}"#,
    );
    rpc_refused(
        &server,
        "snapshot_delete",
        r#"{"volume":"vol0","name":"nope"}"#,
    );
    rpc_refused(
        &server,
        "volume_revert",
        r#"{"volume":"vol0","snapshot":"nope"}"#,
    );
    rpc_refused(&server, "volume_clone", r#"{"snapshot":"vol0","name":"c"}"#);
    rpc_refused(&server, "volume_flatten", r#"{"name":"vol0"}"#);
    // A chain at its limit: 64 layers, the head included.
    for i in 2..64 {
        rpc_ok(
            &server,
            "snapshot_create",
            &format!(r#"{{"volume":"vol0","name":"s{i}"}}"#),
        );
    }
    let text = rpc_refused(
        &server,
        "snapshot_create",
        r#"{"volume":"vol0","name":"last"}"#,
    );
    assert!(text.contains("maximum"), "{text}");
    // Writes to a snapshot's export over the raw protocol: NBD_EPERM,
    // and the connection goes on.
    let mut c = NbdClient::connect(server.addr(), "vol0@s").expect("connect to vol0@s");
    assert_eq!(c.write(0, &[1; 4096]).expect("reply"), 1, "NBD_EPERM");
    assert!(c.read(0, 4096).expect("reply").is_ok(), "reads go on");
    c.disconnect();
    server.assert_healthy();
}

/// The documented backup: a full copy of s1 with nbdcopy, then
/// scripts/incremental-backup.py copies only what changed up to s2; the
/// result equals s2 byte for byte, and the bytes sent are exactly the
/// changed blocks.
#[test]
fn incremental_backup_with_libnbd_restores_the_later_snapshot() {
    let dir = common::Scratch::new("incremental");
    let mut server = Server::start(&["--volume", "vol0:16M"]);
    qemu_io(&server, "vol0", &["write -P 0x11 0 12M"]);
    rpc_ok(
        &server,
        "snapshot_create",
        r#"{"volume":"vol0","name":"s1"}"#,
    );
    let backup = dir.join("backup.img");
    run(Command::new("nbdcopy")
        .arg(uri(&server, "vol0@s1"))
        .arg(&backup));
    // 1% of the 4 KiB blocks, spread out, one unaligned.
    let writes: Vec<(u64, u64)> = (0..40u64)
        .map(|i| (i * 397 * 4096 % SIZE, 4096))
        .chain([(13 * MIB + 10, 100)])
        .collect();
    for (i, &(o, l)) in writes.iter().enumerate() {
        qemu_io(
            &server,
            "vol0",
            &[format!("write -P {:#x} {o} {l}", 0x20 + i as u8)],
        );
    }
    rpc_ok(
        &server,
        "snapshot_create",
        r#"{"volume":"vol0","name":"s2"}"#,
    );
    qemu_io(&server, "vol0", &["write -P 0x99 0 1M"]);
    let python = common::python_with_nbd();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/incremental-backup.py");
    let out = run(Command::new(python)
        .arg(script)
        .arg(uri(&server, "vol0@s2"))
        .arg("s1")
        .arg(&backup));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    let changed: u64 = blocks_of(&writes).iter().map(|&(_, l)| l).sum();
    assert!(
        text.starts_with(&format!("copied {changed} bytes")),
        "only the changed blocks ({changed} bytes) are sent: {text}"
    );
    let s2 = copy_out(&server, "vol0@s2", &dir);
    assert!(
        std::fs::read(&backup).expect("backup") == s2,
        "backup == s2"
    );
    server.assert_healthy();
}
