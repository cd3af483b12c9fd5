//! Structured replies, block status, fast zero and cache proven by real
//! clients: nbdinfo --map, qemu-img map and convert, and libnbd's Python
//! bindings (what nbdsh runs) against the real binary on loopback.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use crate::common::tools::{nbdinfo_map, qemu_img_map, qemu_io, run, uri, write_around_holes};
use crate::common::{self, Server};

const MIB: u64 = 1 << 20;

/// Removed when the test passes (`common::Scratch`).
fn tempdir(name: &str) -> common::Scratch {
    common::Scratch::new(&format!("sparse-{name}"))
}

/// Fresh: one hole of the whole size. After writing [1, 3) MiB and
/// [8, 9) MiB and discarding [2, 3) MiB: data exactly there.
fn maps_follow_writes(args: &[&str]) {
    let mut server = Server::start(args);
    let (nbdinfo, qemu) = write_around_holes(&server, "v");
    assert_eq!(nbdinfo_map(&server, "v"), nbdinfo);
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
    let dir = common::Scratch::on_tmpfs("sparse");
    let spec = format!("v:16M:file={}", dir.join("v.img").display());
    libnbd_checks(&["--volume", &spec], "1", "0");
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
