//! Block status of a replicated volume proven by real clients: two real
//! `lull replica` processes, a real `lull serve` on loopback, and
//! nbdinfo --map, qemu-img map and convert, nbdcopy and libnbd's Python
//! bindings. The engine asks one healthy replica (BLOCK_STATUS, replica
//! protocol version 3), so the maps must show exactly what was written,
//! also while one replica is down.
//!
//! ```text
//! cargo test -p lull --profile ci --test replication sparse_replicated::
//! ```
//!
//! Needs `nbdinfo`, `nbdcopy` (package `libnbd-bin`), `qemu-img`/`qemu-io`
//! (`qemu-utils`) and `python3-libnbd`; scripts/test installs them.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::tools::{nbdinfo_map, qemu_img_map, qemu_io, run, uri, write_around_holes};
use crate::common::{self, require, Kind, Replica, Scratch, Server};

const MIB: u64 = 1 << 20;
/// How long the volume may take to have a healthy replica after start.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Two replicas of `size` and a server with volume `v` on them, readable.
fn two_replicas(scratch: &Scratch, size: &str) -> (Server, Replica, Replica) {
    let a = Replica::start(Kind::Process, &scratch.join("a"), size);
    let b = Replica::start(Kind::Process, &scratch.join("b"), size);
    let spec = format!("v:{size}:replicas={}+{}", a.target(), b.target());
    let server = Server::start(&["--replica-insecure", "--volume", &spec]);
    common::read_when_ready(&server, "v", 0, 4096, READY_TIMEOUT);
    (server, a, b)
}

/// Fresh: one hole. After writing [1, 3) MiB and [8, 9) MiB and
/// discarding [2, 3) MiB: data exactly there, by nbdinfo and qemu-img,
/// from both replicas (reads and block status alternate between them),
/// and the same with one replica killed.
#[test]
fn map_of_a_two_replica_volume_with_and_without_a_replica() {
    let scratch = Scratch::new("map");
    let (mut server, mut a, _b) = two_replicas(&scratch, "16M");
    let (expected, qemu) = write_around_holes(&server, "v");
    // Twice: the engine alternates replicas, so both answer.
    for _ in 0..2 {
        assert_eq!(nbdinfo_map(&server, "v"), expected);
        assert_eq!(qemu_img_map(&server, "v"), qemu);
    }
    a.kill();
    assert_eq!(nbdinfo_map(&server, "v"), expected, "{}", server.stderr());
    assert_eq!(qemu_img_map(&server, "v"), qemu);
    qemu_io(&server, "v", &["read -P 0x22 8M 1M", "read -P 0 9M 1M"]);
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
        .args([&uri(&server, "v"), "0", "0"]));
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
    qemu_io(
        &server,
        "v",
        &["write -P 0x5a 0 4M", "write -P 0xa5 700M 4M"],
    );
    let written = 8 * MIB;
    let qemu_dest = scratch.join("qemu.img");
    run(Command::new("qemu-img").args([
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        &uri(&server, "v"),
        qemu_dest.to_str().unwrap(),
    ]));
    let nbdcopy_dest = scratch.join("nbdcopy.img");
    // nbdcopy writes into an existing file of the right size.
    std::fs::File::create(&nbdcopy_dest)
        .and_then(|f| f.set_len(1 << 30))
        .expect("create the nbdcopy destination");
    run(Command::new("nbdcopy").args([&uri(&server, "v"), nbdcopy_dest.to_str().unwrap()]));
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
