//! End-to-end run of the harness with a stand-in for the lull binary: a shell
//! script that serves `serve`/`replica` with `nbdkit memory` and refuses the
//! `hybrid` mode the way a real server refuses an unsupported one. Needs fio
//! (package fio) and nbdkit (package nbdkit).

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

use lull_bench::{BenchConfig, JobKind, PeerChoice, VolumeKind};
use lull_reactor::Mode;

const FAKE_LULL: &str = r#"#!/bin/sh
# fake lull: serve|replica --listen 127.0.0.1:PORT ... --mode MODE
cmd=$1; shift
port=
mode=
while [ $# -gt 0 ]; do
  case $1 in
    --listen) port=${2##*:}; shift 2 ;;
    --mode) mode=$2; shift 2 ;;
    *) shift ;;
  esac
done
if [ "$mode" = hybrid ]; then
  echo "lull: starting" >&2
  echo "error: event mode hybrid is not supported on this kernel" >&2
  exit 2
fi
exec nbdkit -f --exit-with-parent -i 127.0.0.1 -p "$port" memory size=64M
"#;

fn need(tool: &str, package: &str) {
    assert!(
        lull_bench::server::which(tool).is_some(),
        "{tool} not found: install package {package}"
    );
}

#[test]
fn quick_run_with_fake_lull_writes_parseable_reports() {
    need("fio", "fio");
    need("nbdkit", "nbdkit");
    let dir = std::env::temp_dir().join(format!("lull-bench-fake-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe: PathBuf = dir.join("lull");
    std::fs::write(&exe, FAKE_LULL).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.join("out");
    // As `lull bench --quick --jobs randread-iops,randwrite-lat --modes
    // poll,hybrid --hybrid-periods 10,1000 --volumes malloc,replica1,replica2
    // --peers none --ramp-secs 0.3 --idle-secs 0.3 --size 64M --port-base
    // 23400 --out OUT`.
    let config = BenchConfig {
        quick: true,
        jobs: vec![JobKind::RandreadIops, JobKind::RandwriteLat],
        modes: vec![Mode::Poll, Mode::Hybrid],
        hybrid_periods: vec![10, 1000],
        volumes: vec![
            VolumeKind::Malloc,
            VolumeKind::Replica1,
            VolumeKind::Replica2,
        ],
        peers: vec![PeerChoice::None],
        ramp_secs: Some(0.3),
        idle_secs: Some(0.3),
        size: Some("64M".into()),
        port_base: 23400,
        out: out.clone(),
        ..BenchConfig::default()
    };
    let report = lull_bench::run(&config, &exe).unwrap();

    let names: Vec<&str> = report.targets.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "lull-poll-malloc",
            "lull-hybrid@10-malloc",
            "lull-hybrid@1000-malloc",
            "lull-poll-replica1",
            "lull-hybrid@10-replica1",
            "lull-hybrid@1000-replica1",
            "lull-poll-replica2",
            "lull-hybrid@10-replica2",
            "lull-hybrid@1000-replica2"
        ]
    );
    let hybrid = &report.targets[1];
    assert_eq!(
        serde_json::to_value(&hybrid.status).unwrap()["reason"],
        "error: event mode hybrid is not supported on this kernel"
    );
    // One replica process beside the server for replica1, two for replica2.
    for (t, replicas) in [("lull-poll-replica1", 1), ("lull-poll-replica2", 2)] {
        let tr = report.targets.iter().find(|r| r.name == t).unwrap();
        let cmd = tr.command.as_deref().unwrap();
        assert_eq!(cmd.matches(" replica --listen ").count(), replicas, "{cmd}");
        assert_eq!(cmd.matches('+').count(), replicas - 1, "{cmd}");
        assert!(!cmd.contains("--nvme-ioq-poll-period-us"), "{cmd}");
    }
    for (t, job) in [
        ("lull-poll-malloc", JobKind::RandreadIops),
        ("lull-poll-replica1", JobKind::RandreadIops),
        ("lull-poll-replica2", JobKind::RandwriteLat),
    ] {
        let c = report
            .results
            .iter()
            .find(|c| c.target == t && c.job == job)
            .unwrap();
        assert_eq!(c.runs_ok, 1, "{t} {job:?}: {:?}", c.failures);
        assert!(c.iops.unwrap().median > 0.0);
        assert!(c.cpu_us_per_io.unwrap().median > 0.0);
        assert!((c.vs_poll.as_ref().unwrap().speed - 1.0).abs() < 1e-9);
    }
    assert!(report.targets[0].idle_cpu_pct.is_some());

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["samples"].as_array().unwrap().len(), 6);
    assert_eq!(json["modes_summary"].as_array().unwrap().len(), 9);
    assert_eq!(json["targets"][1]["target"]["hybrid_period_us"], 10);
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("skipped: error: event mode hybrid"));
    assert!(md.contains("## Modes summary"));
    assert!(md.contains("| lull-hybrid@1000-replica1 (skipped) |"));
    // randread-lat was not run: its cells are blank.
    assert!(md.contains("| lull-poll-malloc | "), "{md}");
    let row = md
        .lines()
        .find(|l| l.starts_with("| lull-poll-malloc | ") && l.matches('|').count() == 8)
        .unwrap();
    assert!(row.contains(" |  |  | "), "{row}");
    for p in &report.plots {
        assert!(std::fs::read(out.join(p)).unwrap().starts_with(b"\x89PNG"));
    }
    assert!(report.plots.contains(&"cpu_vs_latency.png".to_string()));
    std::fs::remove_dir_all(&dir).unwrap();
}
