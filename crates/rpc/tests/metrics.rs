//! The metrics endpoint, scraped over HTTP and read back with a strict
//! OpenMetrics text parser written here (independent of the encoder).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use lull_reactor::{Framework, FrameworkConfig, Mode};
use lull_rpc::testing::FakeSource;
use lull_rpc::*;

// ---- a strict OpenMetrics text parser ----

#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

#[derive(Debug, Default)]
struct Family {
    kind: String,
    help: String,
    unit: Option<String>,
    samples: Vec<Sample>,
}

fn is_name(s: &str, colon: bool) -> bool {
    let mut chars = s.chars();
    let first_ok = matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || (colon && c == ':'));
    first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':'))
}

fn parse_value(s: &str) -> Result<f64, String> {
    match s {
        "+Inf" => Ok(f64::INFINITY),
        "-Inf" => Ok(f64::NEG_INFINITY),
        "NaN" => Ok(f64::NAN),
        _ => s.parse::<f64>().map_err(|_| format!("bad value {s:?}")),
    }
}

/// `{a="x",b="y\"z"}` → map; returns the rest of the line after `}`.
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = s.strip_prefix('{').ok_or("expected {")?;
    if let Some(r) = rest.strip_prefix('}') {
        return Ok((labels, r));
    }
    loop {
        let eq = rest.find('=').ok_or("label without =")?;
        let name = &rest[..eq];
        if !is_name(name, false) {
            return Err(format!("bad label name {name:?}"));
        }
        rest = rest[eq + 1..]
            .strip_prefix('"')
            .ok_or("label value must be quoted")?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value".into()),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => return Err(format!("bad escape {other:?}")),
                },
                Some((_, '\n')) => return Err("raw newline in label value".into()),
                Some((_, c)) => value.push(c),
            }
        };
        if labels.insert(name.to_string(), value).is_some() {
            return Err(format!("label {name} twice"));
        }
        rest = &rest[end + 1..];
        if let Some(r) = rest.strip_prefix(',') {
            rest = r;
        } else if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        } else {
            return Err("expected , or } after a label".into());
        }
    }
}

/// The sample names a family of `kind` may have.
fn allowed_suffixes(kind: &str) -> &'static [&'static str] {
    match kind {
        "counter" => &["_total", "_created"],
        "gauge" | "unknown" => &[""],
        "histogram" => &["_bucket", "_sum", "_count", "_created"],
        "info" => &["_info"],
        _ => &[],
    }
}

fn parse_exposition(text: &str) -> Result<BTreeMap<String, Family>, String> {
    let body = text
        .strip_suffix("# EOF\n")
        .ok_or("must end with \"# EOF\\n\"")?;
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    let mut current: Option<String> = None;
    for (n, line) in body.lines().enumerate() {
        let err = |m: String| format!("line {}: {m}: {line:?}", n + 1);
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let (Some(kw), Some(name)) = (parts.next(), parts.next()) else {
                return Err(err("bad comment".into()));
            };
            let arg = parts.next().ok_or_else(|| err("missing argument".into()))?;
            if !is_name(name, true) {
                return Err(err(format!("bad metric name {name:?}")));
            }
            if current.as_deref() != Some(name) {
                if families.contains_key(name) {
                    return Err(err(format!("family {name} declared twice")));
                }
                families.insert(name.to_string(), Family::default());
                current = Some(name.to_string());
            }
            let f = families
                .get_mut(name)
                .ok_or_else(|| err("no family".into()))?;
            match kw {
                "HELP" => f.help = arg.to_string(),
                "TYPE" => {
                    if allowed_suffixes(arg).is_empty() {
                        return Err(err(format!("unknown type {arg}")));
                    }
                    f.kind = arg.to_string();
                }
                "UNIT" => {
                    if !name.ends_with(&format!("_{arg}")) {
                        return Err(err("metric name must end with its unit".into()));
                    }
                    f.unit = Some(arg.to_string());
                }
                _ => return Err(err(format!("unknown keyword {kw}"))),
            }
            continue;
        }
        if line.is_empty() || line.starts_with('#') {
            return Err(err("empty line or bad comment".into()));
        }
        let name_end = line
            .find(['{', ' '])
            .ok_or_else(|| err("no value".into()))?;
        let name = &line[..name_end];
        let (labels, rest) = if line[name_end..].starts_with('{') {
            parse_labels(&line[name_end..]).map_err(&err)?
        } else {
            (BTreeMap::new(), &line[name_end..])
        };
        let mut fields = rest
            .strip_prefix(' ')
            .ok_or_else(|| err("expected a space before the value".into()))?
            .split(' ');
        let value = parse_value(fields.next().unwrap_or("")).map_err(&err)?;
        if let Some(ts) = fields.next() {
            parse_value(ts).map_err(&err)?;
        }
        if fields.next().is_some() {
            return Err(err("trailing fields".into()));
        }
        let fam_name = current
            .clone()
            .ok_or_else(|| err("sample before any # TYPE".into()))?;
        let fam = families
            .get_mut(&fam_name)
            .ok_or_else(|| err("no family".into()))?;
        let ok = allowed_suffixes(&fam.kind)
            .iter()
            .any(|s| name == format!("{fam_name}{s}"));
        if !ok {
            return Err(err(format!(
                "sample {name} does not belong to {} family {fam_name}",
                fam.kind
            )));
        }
        fam.samples.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    for (name, f) in &families {
        if f.kind.is_empty() || f.help.is_empty() {
            return Err(format!("family {name} lacks TYPE or HELP"));
        }
        if f.kind == "histogram" {
            check_histogram(name, f)?;
        }
    }
    Ok(families)
}

/// Buckets ascending by `le`, cumulative, ending at +Inf == _count.
fn check_histogram(name: &str, f: &Family) -> Result<(), String> {
    let mut by_series: BTreeMap<Vec<(String, String)>, Vec<&Sample>> = BTreeMap::new();
    for s in &f.samples {
        let key = s
            .labels
            .iter()
            .filter(|(k, _)| *k != "le")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        by_series.entry(key).or_default().push(s);
    }
    for (series, samples) in by_series {
        let buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.name.ends_with("_bucket"))
            .map(|s| (parse_value(&s.labels["le"]).unwrap(), s.value))
            .collect();
        let count = samples
            .iter()
            .find(|s| s.name.ends_with("_count"))
            .ok_or(format!("{name} {series:?}: no _count"))?
            .value;
        samples
            .iter()
            .find(|s| s.name.ends_with("_sum"))
            .ok_or(format!("{name}: no _sum"))?;
        if buckets
            .windows(2)
            .any(|w| w[0].0 >= w[1].0 || w[0].1 > w[1].1)
        {
            return Err(format!(
                "{name} {series:?}: buckets not ascending and cumulative: {buckets:?}"
            ));
        }
        match buckets.last() {
            Some((le, n)) if le.is_infinite() && *n == count => {}
            _ => {
                return Err(format!(
                    "{name} {series:?}: last bucket must be +Inf == _count"
                ))
            }
        }
    }
    Ok(())
}

#[test]
fn parser_is_strict() {
    let ok = "# HELP x_total A.\n# TYPE x counter\n";
    assert!(
        parse_exposition(&format!("{ok}# EOF\n")).is_err(),
        "HELP for another name"
    );
    let good = "# HELP x A.\n# TYPE x counter\nx_total{a=\"1\"} 3\n# EOF\n";
    assert_eq!(parse_exposition(good).unwrap()["x"].samples[0].value, 3.0);
    for bad in [
        "# HELP x A.\n# TYPE x counter\nx{a=\"1\"} 3\n# EOF\n",
        "# HELP x A.\n# TYPE x counter\nx_total{a=\"1} 3\n# EOF\n",
        "# HELP x A.\n# TYPE x counter\nx_total{a=\"1\"} three\n# EOF\n",
        "# HELP x A.\n# TYPE x counter\nx_total 3\n",
        "# HELP x A.\n# TYPE x gauge\nx{a=\"\\q\"} 3\n# EOF\n",
        "# HELP h A.\n# TYPE h histogram\nh_sum 1\nh_count 2\nh_bucket{le=\"1\"} 1\nh_bucket{le=\"+Inf\"} 1\n# EOF\n",
    ] {
        assert!(parse_exposition(bad).is_err(), "{bad}");
    }
}

// ---- the endpoint ----

fn snapshot() -> MetricsSnapshot {
    MetricsSnapshot {
        reactors: vec![
            ReactorMetrics {
                index: 0,
                core: 2,
                mode: "interrupt".into(),
                interrupt_mode_enabled: true,
                busy_ns: 1_500_000_000,
                idle_ns: 250_000_000,
                iterations: 1000,
                wakeups: 77,
                minor_faults: 5,
                io_uring_enters: 42,
                fixed_buffer_bytes: 16 << 20,
                fixed_buffer_in_use_bytes: 8192,
                fixed_buffer_locked: true,
                ..Default::default()
            },
            ReactorMetrics {
                index: 1,
                core: 3,
                mode: "poll".into(),
                interrupt_mode_enabled: false,
                busy_ns: 3,
                spins_with_work: 11,
                spins_idle: 12,
                spin_ns: 2_000_000_000,
                ..Default::default()
            },
        ],
        volumes: vec![
            VolumeMetrics {
                name: "vol0".into(),
                reads: 10,
                writes: 20,
                read_bytes: 40960,
                write_bytes: 81920,
                latency_buckets: vec![(10_000.0, 5), (100_000.0, 20), (1_000_000.0, 4)],
                latency_sum_ns: 1_500_000,
                latency_count: 30,
                io_uring_enters: Some(31),
                fixed_buffer_ios: Some(25),
                plain_buffer_ios: Some(5),
                inline_ios: Some(7),
                spliced_reads: 3,
                lent_reads: 6,
                sendfile_reads: 8,
                qos_throttled: 4,
                qos_throttled_seconds: 0.25,
                qos_rw_ios_per_sec: 2000,
            },
            VolumeMetrics {
                name: "we\"ird\\name\nx".into(),
                ..Default::default()
            },
        ],
        replicas: vec![
            ReplicaMetrics {
                volume: "vol0".into(),
                addr: "10.0.0.2:9502".into(),
                healthy: true,
                ..Default::default()
            },
            ReplicaMetrics {
                volume: "vol0".into(),
                addr: "10.0.0.3:9502".into(),
                healthy: false,
                rebuild_bytes_total: 1 << 30,
                rebuild_bytes_done: 1 << 20,
                rebuild_rate_bytes_per_sec: 5_000_000,
            },
        ],
        store: Some(StoreMetrics {
            capacity_bytes: 100 << 30,
            free_bytes: 3 << 30,
            allocated_bytes: 40 << 30,
            provisioned_bytes: 150 << 30,
            replicas: 7,
        }),
    }
}

struct Response {
    status: u16,
    headers: BTreeMap<String, String>,
    body: String,
}

fn request(addr: SocketAddr, raw: &[u8]) -> Response {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(raw).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap();
    let mut parts = status_line.splitn(3, ' ');
    assert_eq!(parts.next(), Some("HTTP/1.1"));
    let status = parts.next().unwrap().parse().unwrap();
    let headers = lines
        .map(|l| {
            let (k, v) = l.split_once(": ").unwrap();
            (k.to_ascii_lowercase(), v.to_string())
        })
        .collect();
    Response {
        status,
        headers,
        body: body.to_string(),
    }
}

fn get(addr: SocketAddr, path: &str) -> Response {
    request(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/openmetrics-text\r\n\r\n").as_bytes(),
    )
}

fn sample<'a>(
    fams: &'a BTreeMap<String, Family>,
    family: &str,
    name: &str,
    labels: &[(&str, &str)],
) -> &'a Sample {
    let want: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    fams.get(family)
        .unwrap_or_else(|| panic!("no family {family}"))
        .samples
        .iter()
        .find(|s| s.name == name && s.labels == want)
        .unwrap_or_else(|| panic!("no {name}{want:?} in {family}"))
}

#[test]
fn scrape() {
    let server = MetricsServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(FakeSource::new(snapshot())),
    )
    .unwrap();
    let addr = server.local_addr();
    let r = get(addr, "/metrics");
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["content-type"], OPENMETRICS_CONTENT_TYPE);
    assert_eq!(r.headers["content-length"], r.body.len().to_string());
    let f = parse_exposition(&r.body).unwrap_or_else(|e| panic!("{e}\n{}", r.body));

    let kinds: BTreeMap<&str, &str> = f
        .iter()
        .map(|(k, v)| (k.as_str(), v.kind.as_str()))
        .collect();
    let want = BTreeMap::from([
        ("lull_reactor_busy_seconds", "counter"),
        ("lull_reactor_idle_seconds", "counter"),
        ("lull_reactor_iterations", "counter"),
        ("lull_reactor_wakeups", "counter"),
        ("lull_reactor_spins_with_work", "counter"),
        ("lull_reactor_spins_idle", "counter"),
        ("lull_reactor_spin_seconds", "counter"),
        ("lull_reactor_spin_with_work_seconds", "counter"),
        ("lull_reactor_ready_events", "counter"),
        ("lull_reactor_spin_window_ns", "gauge"),
        ("lull_reactor_wake_latency_ns", "gauge"),
        ("lull_reactor_wake_cpu_ns", "gauge"),
        ("lull_reactor_minor_faults", "counter"),
        ("lull_reactor_major_faults", "counter"),
        ("lull_reactor_voluntary_ctxsw", "counter"),
        ("lull_reactor_involuntary_ctxsw", "counter"),
        ("lull_reactor_io_uring_enters", "counter"),
        ("lull_reactor_fixed_buffer_bytes", "gauge"),
        ("lull_reactor_fixed_buffer_in_use_bytes", "gauge"),
        ("lull_reactor_fixed_buffer_locked", "gauge"),
        ("lull_reactor_mode", "gauge"),
        ("lull_reactor_interrupt_mode_enabled", "gauge"),
        ("lull_reactor_stalls", "counter"),
        ("lull_reactor_stalled_ms", "gauge"),
        ("lull_volume_reads", "counter"),
        ("lull_volume_writes", "counter"),
        ("lull_volume_read_bytes", "counter"),
        ("lull_volume_written_bytes", "counter"),
        ("lull_volume_spliced_reads", "counter"),
        ("lull_volume_lent_reads", "counter"),
        ("lull_volume_sendfile_reads", "counter"),
        ("lull_volume_qos_throttled", "counter"),
        ("lull_volume_qos_throttled_seconds", "counter"),
        ("lull_volume_io_uring_enters", "counter"),
        ("lull_volume_fixed_buffer_ios", "counter"),
        ("lull_volume_plain_buffer_ios", "counter"),
        ("lull_volume_inline_ios", "counter"),
        ("lull_volume_latency_seconds", "histogram"),
        ("lull_replica_healthy", "gauge"),
        ("lull_replica_rebuild_total_bytes", "gauge"),
        ("lull_replica_rebuild_done_bytes", "gauge"),
        ("lull_replica_rebuild_rate_bytes_per_second", "gauge"),
        ("lull_store_capacity_bytes", "gauge"),
        ("lull_store_free_bytes", "gauge"),
        ("lull_store_allocated_bytes", "gauge"),
        ("lull_store_provisioned_bytes", "gauge"),
        ("lull_store_replicas", "gauge"),
    ]);
    assert_eq!(kinds, want);
    assert_eq!(
        sample(&f, "lull_store_free_bytes", "lull_store_free_bytes", &[]).value,
        (3u64 << 30) as f64
    );
    assert_eq!(
        sample(&f, "lull_store_replicas", "lull_store_replicas", &[]).value,
        7.0
    );
    assert_eq!(
        f["lull_reactor_busy_seconds"].unit.as_deref(),
        Some("seconds")
    );

    let r0 = [("reactor", "0"), ("core", "2")];
    let r1 = [("reactor", "1"), ("core", "3")];
    assert_eq!(
        sample(
            &f,
            "lull_reactor_busy_seconds",
            "lull_reactor_busy_seconds_total",
            &r0
        )
        .value,
        1.5
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_idle_seconds",
            "lull_reactor_idle_seconds_total",
            &r0
        )
        .value,
        0.25
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_iterations",
            "lull_reactor_iterations_total",
            &r0
        )
        .value,
        1000.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_wakeups",
            "lull_reactor_wakeups_total",
            &r0
        )
        .value,
        77.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_spins_with_work",
            "lull_reactor_spins_with_work_total",
            &r1
        )
        .value,
        11.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_spins_idle",
            "lull_reactor_spins_idle_total",
            &r1
        )
        .value,
        12.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_spin_seconds",
            "lull_reactor_spin_seconds_total",
            &r1
        )
        .value,
        2.0
    );
    let mode = |r: &[(&str, &str)], m: &str| {
        let mut l = r.to_vec();
        l.push(("mode", m));
        sample(&f, "lull_reactor_mode", "lull_reactor_mode", &l).value
    };
    assert_eq!((mode(&r0, "interrupt"), mode(&r1, "poll")), (1.0, 1.0));
    assert_eq!(f["lull_reactor_mode"].samples.len(), 2);
    assert_eq!(
        sample(
            &f,
            "lull_reactor_interrupt_mode_enabled",
            "lull_reactor_interrupt_mode_enabled",
            &r0
        )
        .value,
        1.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_interrupt_mode_enabled",
            "lull_reactor_interrupt_mode_enabled",
            &r1
        )
        .value,
        0.0
    );

    assert_eq!(
        sample(
            &f,
            "lull_reactor_minor_faults",
            "lull_reactor_minor_faults_total",
            &r0
        )
        .value,
        5.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_io_uring_enters",
            "lull_reactor_io_uring_enters_total",
            &r0
        )
        .value,
        42.0
    );

    let v0 = [("volume", "vol0")];
    assert_eq!(
        sample(
            &f,
            "lull_volume_io_uring_enters",
            "lull_volume_io_uring_enters_total",
            &v0
        )
        .value,
        31.0
    );
    // Only volumes that use io_uring have the counter.
    assert_eq!(f["lull_volume_io_uring_enters"].samples.len(), 1);
    assert_eq!(
        sample(
            &f,
            "lull_volume_fixed_buffer_ios",
            "lull_volume_fixed_buffer_ios_total",
            &v0
        )
        .value,
        25.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_volume_plain_buffer_ios",
            "lull_volume_plain_buffer_ios_total",
            &v0
        )
        .value,
        5.0
    );
    assert_eq!(f["lull_volume_plain_buffer_ios"].samples.len(), 1);
    assert_eq!(
        sample(
            &f,
            "lull_volume_spliced_reads",
            "lull_volume_spliced_reads_total",
            &v0
        )
        .value,
        3.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_volume_lent_reads",
            "lull_volume_lent_reads_total",
            &v0
        )
        .value,
        6.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_volume_sendfile_reads",
            "lull_volume_sendfile_reads_total",
            &v0
        )
        .value,
        8.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_volume_qos_throttled",
            "lull_volume_qos_throttled_total",
            &v0
        )
        .value,
        4.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_volume_qos_throttled_seconds",
            "lull_volume_qos_throttled_seconds_total",
            &v0
        )
        .value,
        0.25
    );
    assert_eq!(
        sample(
            &f,
            "lull_volume_inline_ios",
            "lull_volume_inline_ios_total",
            &v0
        )
        .value,
        7.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_fixed_buffer_bytes",
            "lull_reactor_fixed_buffer_bytes",
            &r0
        )
        .value,
        16.0 * 1024.0 * 1024.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_reactor_fixed_buffer_locked",
            "lull_reactor_fixed_buffer_locked",
            &r0
        )
        .value,
        1.0
    );
    assert_eq!(
        sample(&f, "lull_volume_reads", "lull_volume_reads_total", &v0).value,
        10.0
    );
    assert_eq!(
        sample(&f, "lull_volume_writes", "lull_volume_writes_total", &v0).value,
        20.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_volume_read_bytes",
            "lull_volume_read_bytes_total",
            &v0
        )
        .value,
        40960.0
    );
    assert_eq!(
        sample(
            &f,
            "lull_volume_written_bytes",
            "lull_volume_written_bytes_total",
            &v0
        )
        .value,
        81920.0
    );
    let h = "lull_volume_latency_seconds";
    let bucket = |le: &str| {
        sample(
            &f,
            h,
            &format!("{h}_bucket"),
            &[("volume", "vol0"), ("le", le)],
        )
        .value
    };
    let les: Vec<f64> = f[h]
        .samples
        .iter()
        .filter(|s| s.name.ends_with("_bucket") && s.labels["volume"] == "vol0")
        .map(|s| parse_value(&s.labels["le"]).unwrap())
        .collect();
    assert_eq!(les, vec![1e-5, 1e-4, 1e-3, f64::INFINITY]);
    assert_eq!(bucket("+Inf"), 30.0);
    assert_eq!(sample(&f, h, &format!("{h}_count"), &v0).value, 30.0);
    assert_eq!(sample(&f, h, &format!("{h}_sum"), &v0).value, 0.0015);
    let cumulative: Vec<f64> = f[h]
        .samples
        .iter()
        .filter(|s| s.name.ends_with("_bucket") && s.labels["volume"] == "vol0")
        .map(|s| s.value)
        .collect();
    assert_eq!(cumulative, vec![5.0, 25.0, 29.0, 30.0]);
    // An awkward name survives escaping.
    let weird = [("volume", "we\"ird\\name\nx")];
    assert_eq!(
        sample(&f, "lull_volume_reads", "lull_volume_reads_total", &weird).value,
        0.0
    );
    assert_eq!(
        sample(
            &f,
            h,
            &format!("{h}_bucket"),
            &[("volume", "we\"ird\\name\nx"), ("le", "+Inf")]
        )
        .value,
        0.0
    );

    let rep = |a: &str| {
        sample(
            &f,
            "lull_replica_healthy",
            "lull_replica_healthy",
            &[("volume", "vol0"), ("replica", a)],
        )
        .value
    };
    assert_eq!((rep("10.0.0.2:9502"), rep("10.0.0.3:9502")), (1.0, 0.0));
    let rebuild = |name: &str| {
        sample(
            &f,
            name,
            name,
            &[("volume", "vol0"), ("replica", "10.0.0.3:9502")],
        )
        .value
    };
    assert_eq!(
        (
            rebuild("lull_replica_rebuild_total_bytes"),
            rebuild("lull_replica_rebuild_done_bytes"),
            rebuild("lull_replica_rebuild_rate_bytes_per_second"),
        ),
        ((1u64 << 30) as f64, (1u64 << 20) as f64, 5e6)
    );

    // HEAD: same headers, no body.
    let head = request(addr, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    assert!(head.headers["content-length"].parse::<usize>().unwrap() > 0);

    assert_eq!(get(addr, "/metrics?debug=1").status, 200);
    assert_eq!(get(addr, "/").status, 404);
    assert_eq!(get(addr, "/metricsx").status, 404);
    let post = request(addr, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(post.status, 405);
    assert_eq!(post.headers["allow"], "GET, HEAD");
    assert_eq!(request(addr, b"garbage\r\n\r\n").status, 400);
    assert_eq!(request(addr, b"GET /metrics HTTP/2\r\n\r\n").status, 400);
    let huge = format!(
        "GET /metrics HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(MAX_HTTP_REQUEST_BYTES)
    );
    assert_eq!(request(addr, huge.as_bytes()).status, 431);

    server.shutdown();
    assert!(
        TcpStream::connect(addr).is_err(),
        "stopped servers do not accept"
    );
}

#[test]
fn connection_cap() {
    let server = MetricsServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(FakeSource::default()),
    )
    .unwrap();
    let addr = server.local_addr();
    // Connections that send half a request hold their slots.
    let held: Vec<TcpStream> = (0..MAX_METRICS_CONNECTIONS)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
            s
        })
        .collect();
    // Slots are taken in accept order; wait until all are taken (no
    // timing: the over-cap answer is what proves it).
    let busy = loop {
        let r = get(addr, "/metrics");
        if r.status == 503 {
            break r;
        }
        std::thread::yield_now();
    };
    assert_eq!(busy.status, 503);
    drop(held);
    server.shutdown();
}

#[test]
fn real_framework_snapshot() {
    let mut fw = Framework::start(test_config()).unwrap();
    let snap = MetricsSnapshot {
        reactors: reactor_metrics(fw.handle()),
        ..Default::default()
    };
    fw.stop();
    assert_eq!(snap.reactors.len(), 1);
    assert_eq!(snap.reactors[0].mode, "interrupt");
    assert!(snap.reactors[0].interrupt_mode_enabled);
    let text = encode_snapshot(snap).unwrap();
    let f = parse_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(
        f["lull_reactor_mode"].samples[0].labels["mode"],
        "interrupt"
    );
    assert!(f["lull_volume_reads"].samples.is_empty());
}

/// One unpinned reactor on core 0 (tests share the machine), interrupt mode
/// so it sleeps instead of spinning.
fn test_config() -> FrameworkConfig {
    let mut c = FrameworkConfig::new(vec![0], Mode::Interrupt);
    c.pin = false;
    c
}
