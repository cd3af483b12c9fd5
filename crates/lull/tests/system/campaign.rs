//! The crash and fault campaign's short version: `scripts/campaign` for
//! six rounds (an engine kill, a replica node kill, replica I/O errors, an
//! engine kill during a snapshot, one during a revert, a clone flattened
//! and deleted), with the real binary, fio, nbdcopy and libnbd. The long
//! version's results are in docs/CAMPAIGN.md.

use crate::common;
use std::path::Path;
use std::process::Command;

#[test]
fn short_crash_and_fault_campaign() {
    common::require("fio", "fio");
    common::require("qemu-io", "qemu-utils");
    common::require("nbdcopy", "libnbd-bin");
    // scripts/campaign drives libnbd from the system Python.
    common::python_with_nbd();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/campaign");
    let out = Command::new("bash")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_lull"))
        .env("SEED", "21")
        .env("ROUNDS", "6")
        .env("ROUND_S", "2")
        .env(
            "ACTIONS",
            "kill-serve kill-replica io-errors snapshot-kill revert-kill clone",
        )
        .env("TMPDIR", env!("CARGO_TARGET_TMPDIR"))
        .output()
        .expect("run scripts/campaign");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(
        out.status.success() && text.contains("campaign passed"),
        "the campaign failed ({}):\n{text}",
        out.status
    );
    for round in [
        "round 1: kill-serve",
        "round 2: kill-replica",
        "round 3: io-errors",
        "round 4: snapshot-kill",
        "round 5: revert-kill",
        "round 6: clone",
    ] {
        assert!(text.contains(round), "no {round:?} in:\n{text}");
    }
}
