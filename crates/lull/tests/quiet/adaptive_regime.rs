//! The adaptive mode's decision seen from outside (issue 34): a steady
//! load against a fresh server, several times, must get the same regime
//! each time, and the server must say what it rests on. The test reads
//! the regime the server reports; it asserts no timing.
//!
//! Where the load falls between the two thresholds, the regime depends on
//! the reactor's history and on the wake-up cost it measures, which
//! depends on what else runs: with other tests' servers on the same two
//! cores, a start measured wake-ups twice as dear and chose to spin where
//! the others slept (CI, 2026-11-27). So the load here lies outside that
//! band ([`LOADS`]), and the test runs in the quiet tier, with the
//! server's reactor on the last core and fio on core 0.
//!
//! ```text
//! cargo test -p lull --profile ci --test quiet adaptive_regime::
//! ```

use std::process::{Command, Stdio};
use std::time::Instant;

use serde_json::Value;

use crate::common::{free_port, require, rpc, scrape_metrics, Server};
use crate::quiet;

/// Fresh servers, one after the other.
const STARTS: usize = 4;

/// fio 4 KiB randread loads, (queue depth, rate limit), each from fresh
/// servers: QD4 at 8,000 IOPS, whose gaps (85-90 µs measured) lie well
/// above where sleeping pays on any machine measured (35-61 µs), so the
/// reactor must sleep every time, after probing spinning.
///
/// No load was found that must spin every time with fio's NBD engine on
/// these 2-core VMs: its turnaround alone leaves gaps near the band's
/// lower edge. Tried, four fresh servers a run: QD1 unlimited (gaps of
/// 14-18 µs, spinning 0.6-0.8x sleeping's cost) got spin in 3 of 4 (the
/// regime read after 2 s of load), then 0, 3 and 2 of 4 (read once the
/// reactor had decided); QD64 unlimited (the reactor almost never idle:
/// each regime's idle periods cost 2-18% of the work, a ratio of noise,
/// and either regime behaves as poll there) got spin in 4 and 3 of 4
/// (after 2 s), then 2 and 2 of 4 (once decided);
/// QD4 at 40,000 IOPS stretches its gaps back into the band while the
/// reactor sleeps (28-34 µs). 20,000 IOPS at QD4, the load that got the
/// poll regime from one start and the interrupt regime from the next
/// before the fix, leaves gaps of 33-61 µs: inside the band where the
/// reactor keeps the regime it is in (docs/REACTOR.md), on this VM and
/// on CI alike, and noise on a shared machine (a wake-up that cost twice
/// the usual during a probe) tipped one start in four there on CI, twice.
/// The benchmark (scripts/bench-adaptive) measures that load on a quiet
/// machine; this test checks the decision where it must not depend on
/// the start at all.
const LOADS: [(u32, Option<u32>); 1] = [(4, Some(8_000))];

/// Most seconds of load per start: the regime is read while the load
/// runs, once the reactor has decided (no probe running, and a second
/// probe done: the first one's confirmation or the periodic one a second
/// later). A reactor that is almost never idle (QD64) takes its 64 idle
/// periods per probe slowly, the more so on a busy machine: on CI one
/// start had not confirmed its switch after 2 s.
const LOAD_SECS: u32 = 10;

/// How long a start may take to decide.
const DECIDE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(8);

#[test]
fn a_steady_qd4_load_gets_the_same_regime_from_every_fresh_server() {
    let _quiet = quiet();
    require("fio", "fio");
    require("taskset", "util-linux");
    let mut regimes = Vec::new();
    for (qd, rate) in LOADS {
        regimes.push((qd, rate, same_regime_from_every_start(qd, rate)));
    }
    println!("regime by load (QD, IOPS limit): {regimes:?}");
}

/// [`STARTS`] fresh servers under fio at queue depth `qd` and `rate`:
/// the regime each reports (the same), with what it rests on, and the
/// metrics agreeing.
fn same_regime_from_every_start(qd: u32, rate: Option<u32>) -> String {
    let load = match rate {
        Some(r) => format!("QD{qd} at {r} IOPS"),
        None => format!("QD{qd} unlimited"),
    };
    // The server's reactor on the last core, fio on the first (one core:
    // both on it, which the test then checks all the same).
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let server_core = (cores - 1).to_string();
    let mut seen: Vec<Value> = Vec::new();
    for start in 0..STARTS {
        let metrics_port = free_port().port();
        let metrics = format!("127.0.0.1:{metrics_port}");
        let mut server = Server::start(&[
            "--cores",
            &server_core,
            "--mode",
            "adaptive",
            "--volume",
            "vol:64M",
            "--metrics",
            &metrics,
        ]);
        let uri = format!("nbd://{}/vol", server.addr());
        let mut fio = Command::new("taskset");
        fio.args([
            "-c",
            "0",
            "fio",
            "--name=steady",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randread",
            "--bs=4k",
            &format!("--iodepth={qd}"),
            "--time_based",
            &format!("--runtime={LOAD_SECS}"),
        ]);
        if let Some(rate) = rate {
            fio.arg(format!("--rate_iops={rate}"));
        }
        let mut fio = fio
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("fio (install the Debian package fio)");
        // The regime once decided, read while the load runs.
        let deadline = Instant::now() + DECIDE_TIMEOUT;
        let a = loop {
            std::thread::sleep(std::time::Duration::from_millis(100));
            if let Ok(Some(status)) = fio.try_wait() {
                let mut err = String::new();
                let _ =
                    std::io::Read::read_to_string(fio.stderr.as_mut().expect("piped"), &mut err);
                panic!("{load}, start {start}: fio ended early ({status}): {err}");
            }
            let reactors = rpc(server.rpc_socket(), "framework_get_reactors", "");
            let reactor = &reactors["reactors"][0];
            assert_eq!(reactor["mode"], "adaptive", "{reactor}");
            let a = reactor["adaptive"].clone();
            // No probe running or due to confirm, and one done since the
            // start (a switch, or a probe that kept the regime).
            let decided = a["probing"].is_null()
                && a["confirming"] == false
                && a["probes"].as_u64().unwrap_or(0) + a["switches"].as_u64().unwrap_or(0) >= 2;
            if decided {
                break a;
            }
            assert!(
                Instant::now() < deadline,
                "{load}, start {start}: no decision within {DECIDE_TIMEOUT:?}: {a}"
            );
        };
        let _ = fio.kill();
        let _ = fio.wait();
        let regime = a["regime"]
            .as_str()
            .unwrap_or_else(|| panic!("no regime: {a}"));
        assert!(["spin", "sleep"].contains(&regime), "{a}");
        // What it rests on: both regimes' costs were measured (a probe of
        // the other one ran), and the band for gaps of one length.
        for key in ["spin_cost_pct", "sleep_cost_pct", "saved_ns"] {
            assert!(
                a[key].as_u64().is_some(),
                "{load}, start {start}: no {key} in {a}"
            );
        }
        assert!(
            a["spin_below_ns"].as_u64() < a["sleep_above_ns"].as_u64(),
            "{a}"
        );
        // One decision, no flapping: a switch at most (from the start's
        // sleep), and its reason is given.
        let switches = a["switches"].as_u64().expect("switches");
        assert!(
            switches <= 1,
            "{load}, start {start}: {switches} switches: {a}"
        );
        if switches == 1 {
            let reason = a["last_switch"]["reason"].as_str().unwrap_or("");
            assert!(
                ["spin_cheaper", "sleep_cheaper", "gaps_long"].contains(&reason),
                "{a}"
            );
            assert_eq!(a["last_switch"]["to"], regime, "{a}");
        }

        // The metrics say the same.
        let body = scrape_metrics(metrics_port);
        let line = body
            .lines()
            .find(|l| l.starts_with("lull_reactor_adaptive_regime{"))
            .unwrap_or_else(|| panic!("no lull_reactor_adaptive_regime in:\n{body}"));
        assert!(line.contains(&format!("regime=\"{regime}\"")), "{line}");
        assert!(
            body.contains("lull_reactor_adaptive_cost_percent{"),
            "{body}"
        );
        seen.push(a);
        server.assert_healthy();
    }
    let regimes: Vec<&str> = seen.iter().map(|a| a["regime"].as_str().unwrap()).collect();
    assert!(
        regimes.iter().all(|r| *r == regimes[0]),
        "{STARTS} fresh servers under the same load ({load}) reported {regimes:?}:\n{}",
        seen.iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
    for a in &seen {
        println!("{load}: {a}");
    }
    regimes[0].to_string()
}
