//! Structured replies, block status, fast zero and cache proven by real
//! clients: nbdinfo --map, qemu-img map and convert, and libnbd's Python
//! bindings (what nbdsh runs) against the real binary on loopback.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output};

use common::{require, Server};

const MIB: u64 = 1 << 20;

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

fn uri(server: &Server, export: &str) -> String {
    format!("nbd://{}/{}", server.addr(), export)
}

/// Removed when the test passes (`common::Scratch`).
fn tempdir(name: &str) -> common::Scratch {
    common::Scratch::new(&format!("sparse-{name}"))
}

/// `nbdinfo --map`: (offset, length, type) per line.
fn nbdinfo_map(server: &Server, export: &str) -> Vec<(u64, u64, u32)> {
    require("nbdinfo", "libnbd-bin");
    let out = run(Command::new("nbdinfo").args(["--map", &uri(server, export)]));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("nbdinfo --map {export}:\n{text}");
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
fn qemu_img_map(server: &Server, export: &str) -> Vec<(u64, u64, bool, bool)> {
    require("qemu-img", "qemu-utils");
    let out = run(Command::new("qemu-img").args([
        "map",
        "--output=json",
        "-f",
        "raw",
        &uri(server, export),
    ]));
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

fn qemu_io(server: &Server, export: &str, cmds: &[&str]) {
    require("qemu-io", "qemu-utils");
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    c.arg(uri(server, export));
    let out = run(&mut c);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("failed"), "qemu-io: {text}");
}

const HOLE_ZERO: u32 = 3;

/// Fresh: one hole of the whole size. After writing [1, 3) MiB and
/// [8, 9) MiB and discarding [2, 3) MiB: data exactly there.
fn maps_follow_writes(args: &[&str]) {
    let size = 16 * MIB;
    let mut server = Server::start(args);
    assert_eq!(nbdinfo_map(&server, "v"), [(0, size, HOLE_ZERO)]);
    assert_eq!(qemu_img_map(&server, "v"), [(0, size, false, true)]);

    qemu_io(
        &server,
        "v",
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
    assert_eq!(nbdinfo_map(&server, "v"), expected);
    let qemu: Vec<(u64, u64, bool, bool)> = expected
        .iter()
        .map(|&(o, l, t)| (o, l, t == 0, t != 0))
        .collect();
    assert_eq!(qemu_img_map(&server, "v"), qemu);
    server.assert_healthy();
}

#[test]
fn map_of_a_malloc_volume() {
    maps_follow_writes(&["--volume", "v:16M"]);
}

#[test]
fn map_of_a_file_volume() {
    let dir = tempdir("map-file");
    let spec = format!("v:16M:file={}", dir.join("v.img").display());
    maps_follow_writes(&["--volume", &spec]);
}

/// Structured reads of holes and data, block status with REQ_ONE, fast
/// zero and cache, through libnbd's Python bindings (nbdsh's engine).
/// The expectations are "1", "0" or "any" (fast zero, fast zero with
/// NO_HOLE), as the script takes them.
fn libnbd_checks(args: &[&str], expect_fast_zero: &str, expect_fast_no_hole: &str) {
    let python = common::python_with_nbd();
    let mut server = Server::start(args);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/structured.py");
    let out = run(Command::new(python).arg(script).args([
        &uri(&server, "v"),
        expect_fast_zero,
        expect_fast_no_hole,
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(text.trim_end().ends_with("ok"), "{text}");
    server.assert_healthy();
}

#[test]
fn libnbd_structured_reads_block_status_fast_zero_malloc() {
    libnbd_checks(&["--volume", "v:16M"], "1", "1");
}

#[test]
fn libnbd_structured_reads_block_status_fast_zero_file() {
    let dir = tempdir("libnbd-file");
    let spec = format!("v:16M:file={}", dir.join("v.img").display());
    // NO_HOLE is fallocate(ZERO_RANGE): whether it is fast depends on
    // the filesystem the target directory is on.
    libnbd_checks(&["--volume", &spec], "1", "any");
}

#[test]
fn libnbd_fast_zero_is_refused_where_the_filesystem_cannot() {
    // tmpfs punches holes but has no ZERO_RANGE: a fast NO_HOLE zero gets
    // NBD_ENOTSUP and leaves the data alone; a plain fast zero works.
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("note: no /dev/shm; skipping the tmpfs fast zero case");
        return;
    }
    let dir = shm.join(format!("lull-sparse-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir in /dev/shm");
    let spec = format!("v:16M:file={}", dir.join("v.img").display());
    libnbd_checks(&["--volume", &spec], "1", "0");
    let _ = std::fs::remove_dir_all(&dir);
}

/// qemu-img convert of a sparse 1 GiB volume to a sparse file moves only
/// the data: the destination's allocation is what was written.
fn convert_stays_sparse(name: &str, args: &[&str]) {
    // Each test its own directory: tests run in parallel.
    let dir = tempdir(name);
    let mut server = Server::start(args);
    qemu_io(
        &server,
        "v",
        &["write -P 0x5a 0 4M", "write -P 0xa5 700M 4M"],
    );
    let written = 8 * MIB;
    let dest = dir.join("copy.img");
    run(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &uri(&server, "v"),
        dest.to_str().unwrap(),
    ]));
    let meta = std::fs::metadata(&dest).expect("copy");
    assert_eq!(meta.len(), 1 << 30);
    let allocated = meta.blocks() * 512;
    println!("allocated {allocated} of {written} written");
    assert!(
        allocated <= written + written / 100,
        "copy allocates {allocated} bytes for {written} written"
    );
    let copy = std::fs::read(&dest).expect("read copy");
    assert!(copy[..4 << 20].iter().all(|&b| b == 0x5a));
    assert!(copy[700 << 20..704 << 20].iter().all(|&b| b == 0xa5));
    assert!(copy[4 << 20..700 << 20].iter().all(|&b| b == 0));
    server.assert_healthy();
}

#[test]
fn qemu_img_convert_of_a_sparse_malloc_volume_stays_sparse() {
    convert_stays_sparse("convert-malloc-dest", &["--volume", "v:1G"]);
}

#[test]
fn qemu_img_convert_of_a_sparse_file_volume_stays_sparse() {
    let dir = tempdir("convert-file");
    let spec = format!("v:1G:file={}", dir.join("v.img").display());
    convert_stays_sparse("convert-file-dest", &["--volume", &spec]);
}
