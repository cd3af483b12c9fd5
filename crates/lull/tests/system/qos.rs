//! Per-volume QoS measured from outside with fio's nbd engine: a limit
//! holds over all of a volume's connections, a neighbour on the same
//! reactor keeps its pace, a limit changed at run time takes effect at
//! once, bandwidth limits likewise; and the stall watchdog stays quiet
//! through a minute of load.
//!
//! These check rates a limit sets (the server's own promise), not speed.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, require, Server};

/// fio on `export`: `jobs` connections, each `qd` deep, for `secs`.
fn fio(server: &Server, export: &str, rw: &str, bs: &str, qd: u32, jobs: u32, secs: u32) -> Child {
    require("fio", "fio");
    Command::new("taskset")
        .args(["-c", "0", "fio", "--name=q", "--ioengine=nbd"])
        .arg(format!("--uri=nbd://{}/{export}", server.addr()))
        .args([
            &format!("--rw={rw}"),
            &format!("--bs={bs}"),
            &format!("--iodepth={qd}"),
            &format!("--numjobs={jobs}"),
            "--time_based",
            &format!("--runtime={secs}"),
            "--group_reporting",
            "--output-format=json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run fio")
}

/// IOPS and read bytes per second of a finished fio run.
fn rates(child: Child) -> (f64, f64) {
    let out = child.wait_with_output().expect("fio");
    let json = common::fio_json(&out);
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "fio error: {job}");
    let read = &job["read"];
    (
        read["iops"].as_f64().unwrap_or(0.0) + job["write"]["iops"].as_f64().unwrap_or(0.0),
        read["bw_bytes"].as_f64().unwrap_or(0.0),
    )
}

fn reads(server: &Server, volume: &str) -> u64 {
    let s = server.rpc("volume_get_stats", &format!(r#"{{"name":"{volume}"}}"#));
    s["reads"].as_u64().expect("reads")
}

fn within(value: f64, target: f64, tolerance: f64) -> bool {
    (value - target).abs() <= target * tolerance
}

#[test]
fn qos_limits_a_volume_over_its_connections_and_spares_its_neighbour() {
    let mut server = Server::start(&["--cores", "1", "--volume", "a:64M", "--volume", "b:64M"]);
    let set = server.rpc("volume_set_qos", r#"{"name":"a","rw_ios_per_sec":2000}"#);
    assert_eq!(set["limits"]["rw_ios_per_sec"], 2000, "{set}");
    // The neighbour alone, then beside the limited volume (two fio
    // connections on it, 32 deep each).
    let (alone, _) = rates(fio(&server, "b", "randread", "4k", 1, 1, 5));
    let a = fio(&server, "a", "randread", "4k", 32, 2, 10);
    std::thread::sleep(Duration::from_secs(2));
    let (beside, _) = rates(fio(&server, "b", "randread", "4k", 1, 1, 5));
    let (limited, _) = rates(a);
    println!(
        "a limited to 2,000: {limited:.0} IOPS; b alone {alone:.0}, beside a {beside:.0} ({:.3}x)",
        beside / alone
    );
    assert!(
        within(limited, 2000.0, 0.10),
        "2,000 IOPS +-10% over two connections: {limited:.0}"
    );
    // The neighbour is not held by a's limit (a's held connections wait
    // for a timed wake-up, not spinning on the shared reactor). Loose
    // here: the machine is shared; docs/BENCHMARKS.md has the measured ratio.
    assert!(
        beside >= 0.8 * alone,
        "b beside a: {beside:.0} against {alone:.0} alone"
    );
    let stats = server.rpc("volume_get_stats", r#"{"name":"a"}"#);
    assert!(
        stats["qos"]["throttled_requests"].as_u64().unwrap_or(0) > 0,
        "{stats}"
    );

    // Raised at run time: the new rate within a second.
    let a = fio(&server, "a", "randread", "4k", 32, 1, 6);
    std::thread::sleep(Duration::from_secs(2));
    server.rpc("volume_set_qos", r#"{"name":"a","rw_ios_per_sec":4000}"#);
    let raised = Instant::now();
    std::thread::sleep(Duration::from_secs(1));
    let (r0, t0) = (reads(&server, "a"), Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    let rate = (reads(&server, "a") - r0) as f64 / t0.elapsed().as_secs_f64();
    println!(
        "raised to 4,000 at {:?}: {rate:.0} IOPS from 1 s after",
        raised.elapsed()
    );
    // Held under the new limit and clearly past the old one: the raise
    // applied. (How close to 4,000 it gets depends on the machine's load:
    // two runs on a machine loaded by Kubernetes builds did 3,286 and
    // 3,767; the limiter's timed wake-ups come late there.)
    assert!(
        rate > 2000.0 * 1.1 && rate <= 4000.0 * 1.1,
        "past 2,000 and at most 4,000 IOPS +10% one second after the change: {rate:.0}"
    );
    rates(a);

    // A read bandwidth limit: 8 MB/s of 128 KiB reads.
    server.rpc(
        "volume_set_qos",
        r#"{"name":"a","rw_ios_per_sec":0,"r_mbytes_per_sec":8}"#,
    );
    let (_, bw) = rates(fio(&server, "a", "read", "128k", 8, 1, 5));
    println!("r_mbytes_per_sec 8: {:.2} MB/s", bw / 1e6);
    assert!(within(bw, 8e6, 0.10), "8 MB/s +-10%: {bw:.0} B/s");
    // Writes are not held by a read limit.
    server.rpc("volume_set_qos", r#"{"name":"a","w_mbytes_per_sec":4}"#);
    let (_, bw) = rates(fio(&server, "a", "read", "128k", 8, 1, 3));
    assert!(
        bw > 16e6,
        "reads unlimited once only writes are: {bw:.0} B/s"
    );
    // Bad input: a limit past its bound, an unknown volume, an unknown key.
    for bad in [
        r#"{"name":"a","rw_ios_per_sec":99999999999}"#,
        r#"{"name":"nope","rw_ios_per_sec":10}"#,
        r#"{"name":"a","iops":10}"#,
    ] {
        let (ok, text) = common::rpc_outcome(server.rpc_socket(), "volume_set_qos", bad);
        assert!(!ok, "{bad}: {text}");
    }
    server.assert_healthy();
}

/// A minute of mixed load on one reactor: the watchdog reports no stall.
#[test]
fn no_false_stall_in_a_minute_of_load() {
    let mut server = Server::start(&["--cores", "1", "--volume", "v:64M"]);
    let (iops, _) = rates(fio(&server, "v", "randrw", "4k", 32, 1, 60));
    let reactors = server.rpc("framework_get_reactors", "{}");
    println!("{iops:.0} IOPS over 60 s; reactors: {reactors}");
    assert!(iops > 0.0);
    let list = reactors["reactors"].as_array().expect("reactors");
    for r in list {
        assert_eq!(r["stalls"], 0, "a stall reported under plain load: {r}");
    }
    assert!(!server.stderr().contains("stalled"), "{}", server.stderr());
    server.assert_healthy();
}
