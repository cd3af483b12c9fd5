//! Delta rebuilds (issue 29): a replica away while the volume is written
//! comes back and receives only the regions written meanwhile, from the
//! change record its healthy peer kept; an engine SIGKILLed while it is
//! away, or during the delta copy, does not turn the delta into a full
//! rebuild; a replica replaced by an empty one at the same address is
//! rebuilt in full. The test computes its bound from its own writes and
//! reads what the engine reports (`replica_list`'s `last_rebuild`), then
//! compares the replicas' data files byte for byte.
//!
//! ```text
//! cargo test -p lull --profile ci --test replication delta::
//! ```

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::state::all_healthy;
use crate::common::{self, tools, Kind, Replica, Scratch, Server};

/// A change region (`lull_proto::replica::CHANGE_REGION_MIN_BYTES`).
const REGION: u64 = 64 << 10;
const REBUILD_TIMEOUT: Duration = Duration::from_secs(180);

/// `n` distinct 4 KiB-aligned offsets in `[0, span)`, from `seed`
/// (splitmix64), sorted.
fn offsets(seed: u64, n: usize, span: u64) -> Vec<u64> {
    let mut x = seed;
    let mut set = BTreeSet::new();
    while set.len() < n {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        set.insert((z % (span / 4096)) * 4096);
    }
    set.into_iter().collect()
}

/// 4 KiB writes of `pattern` at `offsets`, through qemu-io (one process).
fn write_at(server: &Server, offsets: &[u64], pattern: u8) {
    let cmds: Vec<String> = offsets
        .iter()
        .map(|o| format!("write -P {pattern:#x} {o} 4k"))
        .collect();
    tools::qemu_io(server, "v", &cmds);
}

/// Bytes of the change regions the writes at `offsets` touch: what a
/// delta rebuild must copy at most (no write was in flight when the
/// replica left, and its own write-intent record was empty).
fn bound(offsets: &[u64]) -> u64 {
    let regions: BTreeSet<u64> = offsets.iter().map(|o| o / REGION).collect();
    regions.len() as u64 * REGION
}

/// Waits until a replica's write-intent record (`intent.bin`, its newest
/// valid slot) is empty: the writes of the fill are quiet and cleared, so
/// what the replica itself may have lost is nothing (see
/// `lull_replica::intent` for the layout).
fn wait_intent_empty(r: &Replica) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let raw = std::fs::read(r.intent_file()).unwrap_or_default();
        let newest = raw
            .chunks_exact(4096)
            .filter(|s| &s[0..4] == b"LULI")
            .max_by_key(|s| u64::from_be_bytes(s[8..16].try_into().expect("seq")));
        if newest.is_some_and(|s| s[32..].iter().all(|&b| b == 0)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the write-intent record of {} never emptied",
            r.target()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `replica_list`'s entry for `target`.
fn entry(server: &Server, target: &str) -> serde_json::Value {
    let list = server.rpc("replica_list", r#"{"volume":"v"}"#);
    list.as_array()
        .and_then(|a| a.iter().find(|r| r["addr"] == target).cloned())
        .unwrap_or_else(|| panic!("{target} not in {list}"))
}

fn wait_failed(server: &Server, target: &str) {
    server.wait_replica("v", target, Duration::from_secs(20), "failed", |r| {
        r.state == "failed"
    });
}

fn identical(a: &Path, b: &Path, server: &Server) {
    let (fa, fb) = (
        std::fs::read(a).expect("read a"),
        std::fs::read(b).expect("read b"),
    );
    assert_eq!(fa.len(), fb.len());
    if let Some(at) = fa.iter().zip(&fb).position(|(x, y)| x != y) {
        panic!(
            "the replicas differ at byte {at}; server log:\n{}",
            server.stderr()
        );
    }
}

/// The issue's test: a 1 GiB volume filled, one replica SIGKILLed, 2,000
/// random 4 KiB writes inside the first 64 MiB, the replica restarted: a
/// delta rebuild that copies at most the regions written, and identical
/// replicas. Then the same replica replaced by an empty one at the same
/// address: a full rebuild.
#[test]
fn a_replica_away_gets_a_delta_rebuild_of_what_changed() {
    let scratch = Scratch::on_tmpfs("delta-1g");
    let a = Replica::start(Kind::Process, &scratch.join("a"), "1G");
    let mut b = Replica::start(Kind::Process, &scratch.join("b"), "1G");
    let spec = format!("v:1G:replicas={}+{}", a.target(), b.target());
    let mut server = Server::start(&["--replica-insecure", "--volume", &spec]);
    common::read_when_ready(&server, "v", 0, 4096, Duration::from_secs(30));
    tools::qemu_io(&server, "v", &["write -P 0x11 0 1G"]);
    wait_intent_empty(&b);
    b.kill();
    wait_failed(&server, &b.target());

    let writes = offsets(29, 2000, 64 << 20);
    write_at(&server, &writes, 0x22);
    let limit = bound(&writes);
    b.restart();
    server.wait_replicas("v", REBUILD_TIMEOUT, "both healthy", all_healthy);
    let last = entry(&server, &b.target())["last_rebuild"].clone();
    println!("delta after 2,000 writes: {last} (bound {limit} bytes)");
    assert_eq!(last["kind"], "delta", "{last}; log:\n{}", server.stderr());
    let (bytes, copied) = (
        last["bytes"].as_u64().expect("bytes"),
        last["bytes_copied"].as_u64().expect("bytes_copied"),
    );
    assert!(bytes <= limit && copied <= bytes, "{last}: bound {limit}");
    assert!(
        bytes >= 2000 * 4096,
        "{last}: fewer bytes than were written"
    );
    server.assert_logged(&["change record on", "delta rebuild of"]);
    identical(&a.data_file(), &b.data_file(), &server);
    tools::qemu_io(&server, "v", &[format!("read -P 0x22 {} 4k", writes[1999])]);

    // Replaced by an empty replica at the same address: a full rebuild.
    b.kill();
    wait_failed(&server, &b.target());
    std::fs::remove_dir_all(b.replica_dir()).expect("remove b's data");
    b.restart();
    server.wait_replicas("v", REBUILD_TIMEOUT, "both healthy", all_healthy);
    let last = entry(&server, &b.target())["last_rebuild"].clone();
    println!("after a replacement: {last}");
    assert_eq!(last["kind"], "full", "{last}");
    assert_eq!(last["bytes"], 1u64 << 30, "{last}");
    server.assert_logged(&["is new (generation 0): full rebuild"]);
    identical(&a.data_file(), &b.data_file(), &server);
    server.assert_healthy();
}

/// The engine is SIGKILLed while the replica is away, and again while the
/// delta rebuild runs (slowed by the rebuild limit, with fio writing and
/// verifying elsewhere on the volume): each time the next engine finds
/// the change record on the healthy replica and the copy stays a delta;
/// fio sees no bad data; the replicas end identical.
#[test]
fn engine_kills_keep_a_delta_rebuild_a_delta() {
    common::require("fio", "fio");
    let scratch = Scratch::on_tmpfs("delta-kill");
    let a = Replica::start(Kind::Process, &scratch.join("a"), "256M");
    let mut b = Replica::start(Kind::Process, &scratch.join("b"), "256M");
    let spec = format!("v:256M:replicas={}+{}", a.target(), b.target());
    let args = ["--replica-insecure", "--volume", spec.as_str()];
    let mut server = Server::start(&args);
    common::read_when_ready(&server, "v", 0, 4096, Duration::from_secs(30));
    tools::qemu_io(&server, "v", &["write -P 0x11 0 256M"]);
    wait_intent_empty(&b);
    b.kill();
    wait_failed(&server, &b.target());
    let writes = offsets(30, 500, 32 << 20);
    write_at(&server, &writes, 0x33);

    // The engine dies while the replica is away; the next one waits for
    // it (it may hold the newest data, as far as a new engine knows).
    server.kill();
    let mut server = Server::start(&args);
    // Slow the copy so the engine can die in the middle of it.
    server.rpc(
        "volume_set_rebuild_limit",
        r#"{"name":"v","mbytes_per_sec":1}"#,
    );
    b.restart();
    common::read_when_ready(&server, "v", 0, 4096, Duration::from_secs(60));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let e = entry(&server, &b.target());
        if e["rebuild"]["kind"] == "delta" && e["rebuild"]["bytes_done"].as_u64() > Some(0) {
            // Progress and its ETA at the rate so far (1 MB/s here).
            let eta = e["rebuild"]["eta_secs"]
                .as_f64()
                .expect("an ETA once bytes are done");
            let left = e["rebuild"]["bytes_total"].as_u64().unwrap_or(0)
                - e["rebuild"]["bytes_done"].as_u64().unwrap_or(0);
            assert!(eta > 0.0 && left > 0, "{e}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no delta rebuild under way: {e}; log:\n{}",
            server.stderr()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // fio writes and verifies away from the delta's regions meanwhile.
    let fio = Command::new("fio")
        .args([
            "--name=delta",
            "--ioengine=nbd",
            &format!("--uri=nbd://{}/v", server.addr()),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=8",
            "--offset=128M",
            "--size=64M",
            "--time_based",
            "--runtime=30",
            "--verify=crc32c",
            "--verify_backlog=64",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--output-format=terse",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn fio");
    std::thread::sleep(Duration::from_secs(2));
    server.kill();
    crate::replication::assert_fio_saw_no_bad_data(fio, "");

    // The third engine: still a delta (the replica kept its generation,
    // the healthy one its record), and it completes.
    let server = Server::start(&args);
    server.wait_replicas("v", REBUILD_TIMEOUT, "both healthy", all_healthy);
    let last = entry(&server, &b.target())["last_rebuild"].clone();
    println!("after two engine kills: {last}");
    assert_eq!(last["kind"], "delta", "{last}; log:\n{}", server.stderr());
    // The record grew by what fio wrote while the replica was rebuilt, but
    // never covers the volume.
    assert!(last["bytes"].as_u64().expect("bytes") < 256 << 20, "{last}");
    let mut c = common::NbdClient::connect(server.addr(), "v").expect("connect");
    let cookie = c
        .send(lull_proto::nbd::Command::Flush, 0, 0, 0, &[])
        .expect("flush");
    assert_eq!(c.reply_to(cookie).expect("flush reply"), 0);
    c.disconnect();
    identical(&a.data_file(), &b.data_file(), &server);
    tools::qemu_io(&server, "v", &[format!("read -P 0x33 {} 4k", writes[0])]);
}
