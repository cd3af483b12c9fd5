//! The control plane against the real binary: `lull rpc` methods, mode
//! switches under fio verify load, and a Prometheus scrape.

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{self, Server};

fn rpc(sock: &Path, method: &str, params: Option<&str>) -> (i32, serde_json::Value, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lull"));
    c.args(["rpc", "-s"]).arg(sock).arg(method);
    if let Some(p) = params {
        c.arg(p);
    }
    let out = c.output().expect("run lull rpc");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let json = serde_json::from_str(if out.status.success() {
        &stdout
    } else {
        &stderr
    })
    .unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), json, stderr)
}

#[test]
fn rpc_methods_answer() {
    let mut server = Server::start(&["--volume", "vol:16M"]);
    let sock = server.rpc_socket().to_path_buf();
    let (code, r, _) = rpc(&sock, "framework_get_reactors", None);
    assert_eq!(code, 0);
    let reactors = r["reactors"].as_array().expect("reactors");
    assert_eq!(reactors.len(), 1);
    assert_eq!(reactors[0]["mode"], "adaptive", "adaptive is the default");
    assert_eq!(reactors[0]["interrupt_mode_enabled"], true);

    let (code, r, _) = rpc(
        &sock,
        "engine_set_options",
        Some(r#"{"data-engine-interrupt-mode-enabled": false}"#),
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["mode"], "poll");
    let (_, r, _) = rpc(&sock, "framework_get_reactors", None);
    assert_eq!(r["reactors"][0]["interrupt_mode_enabled"], false);
    let (code, r, _) = rpc(
        &sock,
        "engine_set_options",
        Some(r#"{"mode": "hybrid", "data-engine-nvme-ioq-poll-period-us": 250}"#),
    );
    assert_eq!(code, 0, "{r}");
    let (_, r, _) = rpc(&sock, "engine_get_options", None);
    assert_eq!(
        (r["mode"].as_str(), r["nvme_ioq_poll_period_us"].as_u64()),
        (Some("hybrid"), Some(250))
    );
    let (code, _, err) = rpc(&sock, "engine_set_options", Some(r#"{"mode": "turbo"}"#));
    assert_eq!(code, 1, "{err}");
    let (code, _, err) = rpc(
        &sock,
        "engine_set_options",
        Some(r#"{"nvme_ioq_poll_period_us": 0}"#),
    );
    assert_eq!(code, 1, "{err}");

    let (code, r, _) = rpc(
        &sock,
        "volume_create",
        Some(r#"{"name": "extra", "size": "8M", "backend": "malloc"}"#),
    );
    assert_eq!(code, 0, "{r}");
    let (_, r, _) = rpc(&sock, "volume_list", None);
    let names: Vec<&str> = r
        .as_array()
        .or(r["volumes"].as_array())
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["vol", "extra"]);
    common::assert_good_client_works(server.addr(), "extra", 0);
    let (code, r, _) = rpc(&sock, "volume_get_stats", Some(r#"{"name": "extra"}"#));
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        (r["reads"].as_u64(), r["writes"].as_u64()),
        (Some(1), Some(1)),
        "{r}"
    );
    assert_eq!(r["write_bytes"].as_u64(), Some(4096));
    let (code, _, _) = rpc(&sock, "volume_delete", Some(r#"{"name": "extra"}"#));
    assert_eq!(code, 0);
    let (code, _, _) = rpc(&sock, "volume_get_stats", Some(r#"{"name": "extra"}"#));
    assert_eq!(code, 1);
    let (code, _, _) = rpc(&sock, "replica_list", Some(r#"{"volume": "vol"}"#));
    assert_eq!(code, 1, "a memory volume has no replicas");

    let (code, _, err) = rpc(&sock, "no_such_method", None);
    assert_eq!(code, 1);
    assert!(err.contains("-32601"), "{err}");
    let (code, _, err) = rpc(&sock, "volume_create", Some(r#"{"name": 7}"#));
    assert_eq!(code, 1);
    assert!(err.contains("-32602"), "{err}");
    // Malformed JSON on the raw socket: an error object, and the server lives.
    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"{\"jsonrpc\": \"2.0\", \"method\": ]]]")
        .unwrap();
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    assert!(reply.contains("-32700"), "{reply}");
    let mode = std::fs::metadata(&sock)
        .map(|m| std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o777)
        .unwrap();
    assert_eq!(mode, 0o600);
    server.assert_healthy();
}

#[test]
fn switching_modes_every_200ms_under_fio_verify() {
    let mut server = Server::start(&["--volume", "vol:64M", "--cores", "0-1"]);
    let sock = server.rpc_socket().to_path_buf();
    // One fio run may end before the modes have cycled twice (a quiet
    // machine writes its 384 MiB in about a second): run it again, each
    // run verified, until they have.
    let modes = ["poll", "interrupt", "hybrid", "adaptive"];
    let start = Instant::now();
    let mut switches = 0;
    let mut runs = 0;
    while switches < 8 {
        let mut fio = Command::new("fio")
            .args([
                "--name=switch",
                "--ioengine=nbd",
                &format!("--uri=nbd://{}/vol", server.addr()),
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=32",
                "--numjobs=2",
                "--offset_increment=32M",
                "--loops=6",
                "--size=32M",
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--verify_state_save=0",
                "--output-format=json",
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("fio (install the Debian package fio)");
        let status = loop {
            if let Some(s) = fio.try_wait().unwrap() {
                break s;
            }
            assert!(start.elapsed() < Duration::from_secs(120), "fio stalled");
            let mode = modes[switches % modes.len()];
            let (code, r, err) = rpc(
                &sock,
                "engine_set_options",
                Some(&format!(r#"{{"mode": "{mode}"}}"#)),
            );
            assert_eq!(code, 0, "{r} {err}");
            switches += 1;
            std::thread::sleep(Duration::from_millis(200));
        };
        runs += 1;
        let mut out = String::new();
        fio.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        assert!(status.success(), "fio run {runs} failed: {out}");
        let json: serde_json::Value = serde_json::from_str(&out[out.find('{').unwrap()..]).unwrap();
        for job in json["jobs"].as_array().unwrap() {
            assert_eq!(job["error"], 0, "fio run {runs}: {job}");
        }
    }
    server.assert_healthy();
}

#[test]
fn metrics_scrape_parses() {
    let port = common::free_port().port();
    let mut server = Server::start(&[
        "--volume",
        "vol:16M",
        "--metrics",
        &format!("127.0.0.1:{port}"),
        "--mode",
        "adaptive",
    ]);
    common::assert_good_client_works(server.addr(), "vol", 0);
    let body = common::scrape_metrics(port);
    let samples = parse_exposition(&body);
    let get = |name: &str, label: &str| {
        samples
            .iter()
            .find(|(n, l, _)| n == name && l.contains(label))
            .map(|s| s.2)
            .unwrap_or_else(|| panic!("no sample {name}{{{label}}} in:\n{body}"))
    };
    assert_eq!(get("lull_volume_reads_total", "volume=\"vol\""), 1.0);
    assert_eq!(get("lull_volume_writes_total", "volume=\"vol\""), 1.0);
    assert_eq!(
        get("lull_volume_latency_seconds_count", "volume=\"vol\""),
        2.0
    );
    assert!(get("lull_reactor_idle_seconds_total", "reactor=\"0\"") > 0.0);
    assert!(samples
        .iter()
        .any(|(n, _, _)| n == "lull_reactor_spins_idle_total"));
    server.assert_healthy();
}

/// A strict parser of the Prometheus/OpenMetrics text format: every line
/// is a comment (`# HELP`, `# TYPE`, `# UNIT`, `# EOF`) or a sample
/// `name{labels} value`. Returns (name, labels, value).
fn parse_exposition(text: &str) -> Vec<(String, String, f64)> {
    let mut out = Vec::new();
    let mut saw_eof = false;
    for line in text.lines() {
        assert!(!saw_eof, "content after # EOF: {line}");
        if line == "# EOF" {
            saw_eof = true;
            continue;
        }
        if let Some(rest) = line.strip_prefix("# ") {
            let kind = rest.split_whitespace().next().unwrap_or("");
            assert!(
                ["HELP", "TYPE", "UNIT"].contains(&kind),
                "bad comment line: {line}"
            );
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad sample line: {line}"));
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in: {line}")),
        };
        let (name, labels) = match series.find('{') {
            Some(i) => {
                assert!(series.ends_with('}'), "unclosed labels: {line}");
                (&series[..i], &series[i + 1..series.len() - 1])
            }
            None => (series, ""),
        };
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name: {line}"
        );
        out.push((name.to_string(), labels.to_string(), value));
    }
    assert!(!out.is_empty(), "no samples");
    out
}
