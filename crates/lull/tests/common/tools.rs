//! The real clients the tests drive (qemu-io, qemu-img, nbdinfo) and
//! SPDK's prebuilt tools: run, checked, their output read.
//!
//! ```ignore
//! qemu_io(&server, "vol0", &["write -P 0x5a 0 1M", "read -P 0x5a 0 1M"]);
//! assert_eq!(nbdinfo_map(&server, "vol0"), [(0, 16 << 20, 3)]);
//! ```

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard};

use super::{require, Server};

/// Runs `cmd` to its end; fails the test with its output unless it exits 0.
pub fn run(cmd: &mut Command) -> Output {
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

/// `nbd://ADDR/EXPORT` of a server's export.
pub fn uri(server: &Server, export: &str) -> String {
    format!("nbd://{}/{export}", server.addr())
}

/// qemu-io commands against an export over plain NBD; fails the test on
/// a failed command or verification. Returns stdout and stderr.
pub fn qemu_io<S: AsRef<str>>(server: &Server, export: &str, cmds: &[S]) -> String {
    require("qemu-io", "qemu-utils");
    let mut c = Command::new("qemu-io");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd.as_ref()]);
    }
    c.arg(uri(server, export));
    let out = run(&mut c);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("failed") && !text.contains("error"),
        "qemu-io reported a failure:\n{text}"
    );
    text
}

/// A map as `nbdinfo --map` prints it: (offset, length, type) per line.
pub type NbdinfoMap = Vec<(u64, u64, u32)>;

/// A map as `qemu-img map --output=json` prints it: (start, length, data,
/// zero) per entry.
pub type QemuImgMap = Vec<(u64, u64, bool, bool)>;

/// `nbdinfo --map` of an export.
pub fn nbdinfo_map(server: &Server, export: &str) -> NbdinfoMap {
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

/// The extents `nbdinfo --map=CONTEXT` reports with type 1 (changed),
/// merged: `(offset, length)`.
pub fn nbdinfo_changed(server: &Server, export: &str, context: &str) -> Vec<(u64, u64)> {
    require("nbdinfo", "libnbd-bin");
    let out = run(Command::new("nbdinfo")
        .arg(format!("--map={context}"))
        .arg(uri(server, export)));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("nbdinfo --map={context} {export}:\n{text}");
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(o), Some(l), Some(t)) = (f.first(), f.get(1), f.get(2)) else {
            continue;
        };
        let (o, l, t): (u64, u64, u32) =
            (o.parse().unwrap(), l.parse().unwrap(), t.parse().unwrap());
        if t & 1 == 0 {
            continue;
        }
        match runs.last_mut() {
            Some((ro, rl)) if *ro + *rl == o => *rl += l,
            _ => runs.push((o, l)),
        }
    }
    runs
}

/// `qemu-img map --output=json` of an export.
pub fn qemu_img_map(server: &Server, export: &str) -> QemuImgMap {
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

/// nbdinfo's type of a hole that reads as zeros (`hole,zero`).
pub const HOLE_ZERO: u32 = 3;

/// The maps of a fresh 16 MiB `export` (one hole, by nbdinfo and by
/// qemu-img); then qemu-io writes [1, 3) MiB and [8, 9) MiB and discards
/// [2, 3) MiB. Returns the maps that must follow, as nbdinfo and qemu-img
/// show them, for the caller to check (once, or again after killing a
/// replica).
pub fn write_around_holes(server: &Server, export: &str) -> (NbdinfoMap, QemuImgMap) {
    const MIB: u64 = 1 << 20;
    let size = 16 * MIB;
    assert_eq!(nbdinfo_map(server, export), [(0, size, HOLE_ZERO)]);
    assert_eq!(qemu_img_map(server, export), [(0, size, false, true)]);
    qemu_io(
        server,
        export,
        &[
            "write -P 0x11 1M 2M",
            "write -P 0x22 8M 1M",
            "discard 2M 1M",
            "read -P 0x11 1M 1M",
            "read -P 0 2M 1M",
        ],
    );
    let nbdinfo = vec![
        (0, MIB, HOLE_ZERO),
        (MIB, MIB, 0),
        (2 * MIB, 6 * MIB, HOLE_ZERO),
        (8 * MIB, MIB, 0),
        (9 * MIB, 7 * MIB, HOLE_ZERO),
    ];
    let qemu_img = nbdinfo
        .iter()
        .map(|&(o, l, t)| (o, l, t == 0, t != 0))
        .collect();
    (nbdinfo, qemu_img)
}

/// Where SPDK's prebuilt tools are (`LULL_SPDK_TOOLS`, or
/// ../shared/tools/spdk beside the repository), or `None` with a SKIP line
/// when `bin/` lacks one of `bins`: they are not a Debian package, so
/// scripts/test cannot install them; it says loudly that these tests
/// skip (docs/TESTING.md).
pub fn spdk_tools(test: &str, bins: &[&str]) -> Option<PathBuf> {
    let dir = std::env::var_os("LULL_SPDK_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tools/spdk")
        });
    if bins.iter().all(|b| dir.join("bin").join(b).exists()) {
        Some(dir)
    } else {
        eprintln!(
            "SKIP {test}: SPDK tools ({}) not found at {} (set LULL_SPDK_TOOLS; they need libssl3 libnuma1 libuuid1 libkeyutils1 libaio1)",
            bins.join(", "),
            dir.display()
        );
        println!("SKIP {test}: no SPDK tools at {}", dir.display());
        None
    }
}

/// SPDK processes run one at a time: each takes 256 MiB to 1 GiB of
/// memory without hugepages, and the machine is small.
static SPDK: Mutex<()> = Mutex::new(());

/// Holds the SPDK lock: no other test of the binary runs an SPDK tool
/// meanwhile (a test that failed holding it does not poison it).
pub fn spdk_alone() -> MutexGuard<'static, ()> {
    SPDK.lock().unwrap_or_else(|p| p.into_inner())
}
