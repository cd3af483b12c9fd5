//! The benchmarks' smoke runs: `lull bench --quick`, scripts/bench-per-io
//! and `lull bench --profile nvmf` end to end, the report files exist and
//! parse. Only that they run and record what they should: the numbers of
//! so short a run mean nothing, and none is asserted.

use crate::common::tools;

#[test]
fn bench_quick_smoke_writes_reports() {
    assert!(
        std::process::Command::new("fio")
            .arg("--version")
            .output()
            .is_ok(),
        "fio not found: install the Debian package fio (scripts/test does)"
    );
    let out = std::env::temp_dir().join(format!("lull-bench-smoke-{}", std::process::id()));
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_lull"))
        .args([
            "bench",
            "--quick",
            "--modes",
            "poll",
            "--peers",
            "none",
            "--port-base",
            "24100",
            "--out",
        ])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(json["targets"][0]["name"], "lull-poll-malloc");
    assert_eq!(
        json["targets"][0]["status"]["state"], "ok",
        "{}",
        json["targets"][0]
    );
    let results = json["results"].as_array().unwrap();
    assert_eq!(results.len(), 6);
    for r in results {
        assert_eq!(r["runs_ok"], 1, "{r}");
        assert!(r["iops"]["median"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["cpu_us_per_io"]["median"].as_f64().unwrap() > 0.0, "{r}");
        // Read over the server's RPC socket: a memory volume makes none.
        assert_eq!(
            r["io_uring_enters_per_io"]["median"].as_f64(),
            Some(0.0),
            "{r}"
        );
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("lull-poll-malloc") && md.contains("randread-iops"));
    assert!(md.contains("| uring enters/IO |"), "{md}");
    for p in json["plots"].as_array().unwrap() {
        let bytes = std::fs::read(out.join(p.as_str().unwrap())).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"));
    }
    std::fs::remove_dir_all(&out).unwrap();
}

/// scripts/bench-per-io (issue 13's benchmark) end to end on this build:
/// one repeat of one short job on a file, a memory and a 1-replica volume.
/// Only that it runs and records what it should; the numbers of so short a
/// run mean nothing.
#[test]
fn bench_per_io_script_smoke() {
    for (tool, package) in [
        ("fio", "fio"),
        ("python3", "python3"),
        ("taskset", "util-linux"),
    ] {
        assert!(
            std::process::Command::new("sh")
                .args(["-c", &format!("command -v {tool}")])
                .output()
                .unwrap()
                .status
                .success(),
            "{tool} not found: install the Debian package {package} (scripts/test does)"
        );
    }
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // Under target/, not /tmp: the file volume is opened with O_DIRECT,
    // which tmpfs refuses.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("bench-per-io-{}", std::process::id()));
    let output = std::process::Command::new(repo.join("scripts/bench-per-io"))
        .args(["1", "1", "--ramp", "0.3", "--size", "32M"])
        .args([
            "--targets",
            "file,memory,replica1-c1",
            "--jobs",
            "qd64-randwrite",
        ])
        .arg("--out")
        .arg(dir.join("out"))
        .arg("--file-dir")
        .arg(dir.join("file"))
        .env("LULL", env!("CARGO_BIN_EXE_lull"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench-per-io failed: {stderr}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("out/results.json")).unwrap())
            .unwrap();
    for t in ["file", "memory", "replica1-c1"] {
        assert_eq!(json["status"][t], "ok", "{t}: {stderr}");
    }
    let runs = json["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3, "{runs:?}");
    for r in runs {
        assert!(r["error"].is_null(), "{r}");
        assert!(r["iops"].as_f64().unwrap() > 0.0, "{r}");
        let enters = r["io_uring_enters_per_io"].as_f64().unwrap();
        match r["target"].as_str().unwrap() {
            // A file volume's writes go through io_uring_enter (no
            // SQPOLL); a memory volume has no ring. How many writes one
            // enter carries depends on the machine's load (at QD 64 on a
            // busy machine, 14 of them: 0.07 enters per I/O), so only
            // "some" is checked.
            "file" => assert!(enters > 0.0, "{r}"),
            _ => assert_eq!(enters, 0.0, "{r}"),
        }
        // Paths relative to the repo or placeholders ($WORK, $SHM): no
        // absolute path of this machine.
        let command = r["command"].as_str().unwrap();
        assert!(
            !command
                .split([' ', ',', '=', '+'])
                .any(|w| w.starts_with('/')),
            "{command}"
        );
    }
    let replica = runs.iter().find(|r| r["target"] == "replica1-c1").unwrap();
    assert!(
        replica["procs"]["replica0"]["cpu_us_per_io"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("**qd64-randwrite**"), "{stdout}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `lull bench --profile nvmf` end to end, one short job against lull and
/// against SPDK's nvmf_tgt: both measured, numbers in report.json.
#[test]
fn bench_nvmf_smoke_measures_lull_and_nvmf_tgt() {
    let Some(tools) = tools::spdk_tools(
        "bench_nvmf_smoke_measures_lull_and_nvmf_tgt",
        &["spdk_nvme_perf", "nvmf_tgt"],
    ) else {
        return;
    };
    let _one = tools::spdk_alone();
    let out = std::env::temp_dir().join(format!("lull-bench-nvmf-smoke-{}", std::process::id()));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_lull"))
        .args([
            "bench",
            "--profile",
            "nvmf",
            "--quick",
            "--modes",
            "adaptive",
            "--spdk-peers",
            "poll",
            "--nvmf-jobs",
            "randread-qd1",
            "--ramp-secs",
            "0",
            "--idle-secs",
            "0.5",
            "--port-base",
            "26100",
            "--spdk-tools",
        ])
        .arg(&tools)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "lull bench --profile nvmf failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let names: Vec<&str> = json["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["lull-adaptive", "spdk-poll"]);
    for t in json["targets"].as_array().unwrap() {
        assert!(t["skipped"].is_null(), "{t}");
        assert!(t["idle_cpu_pct"]["median"].as_f64().is_some(), "{t}");
    }
    let results = json["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    for r in results {
        assert_eq!(r["runs_ok"], 1, "{r}");
        assert!(r["iops"]["median"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["lat_p99_us"]["median"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["cpu_us_per_io"]["median"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(results[0]["iops_vs_spdk_poll"]["median"].as_f64().unwrap() > 0.0);
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        md.contains("## randread-qd1") && md.contains("| spdk-poll |"),
        "{md}"
    );
    // Every step filled its target's volume first (raw/*-fill.txt, perf's
    // own output of a sequential write with a Total line).
    let fills: Vec<_> = std::fs::read_dir(out.join("raw"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with("-fill.txt"))
        .collect();
    assert_eq!(fills.len(), 2, "one fill per step");
    for f in fills {
        let text = std::fs::read_to_string(f.path()).unwrap();
        assert!(text.contains("Total"), "{}: {text}", f.path().display());
    }
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn bench_nvmf_without_spdk_tools_fails_with_a_message() {
    let out = std::env::temp_dir().join(format!("lull-bench-nvmf-none-{}", std::process::id()));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_lull"))
        .args([
            "bench",
            "--profile",
            "nvmf",
            "--spdk-tools",
            "/nonexistent/spdk",
        ])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(!output.status.success());
    let err = String::from_utf8_lossy(&output.stderr);
    assert!(
        err.contains("SPDK tools not found at /nonexistent/spdk"),
        "{err}"
    );
    assert!(!out.exists(), "no report without tools");
}
