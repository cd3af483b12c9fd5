//! `lull bench --quick` end to end: the report files exist and parse.

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
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("lull-poll-malloc") && md.contains("randread-iops"));
    for p in json["plots"].as_array().unwrap() {
        let bytes = std::fs::read(out.join(p.as_str().unwrap())).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"));
    }
    std::fs::remove_dir_all(&out).unwrap();
}
