//! The data path proven by real NBD clients: nbdinfo, qemu-io, qemu-img,
//! nbdcopy and fio's nbd engine against the real binary on loopback.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::tools::{qemu_io, run, uri};
use crate::common::{self, pattern, require, Server};

fn write_file(path: &Path, data: &[u8]) {
    std::fs::write(path, data).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

#[test]
fn nbdinfo_lists_every_volume_with_its_size() {
    require("nbdinfo", "libnbd-bin");
    let dir = tempdir("list");
    let file = dir.join("b.img");
    let sock = dir.join("nbd.sock");
    let mut server = Server::start(&[
        "--volume",
        "a:16M",
        "--volume",
        &format!("b:64M:file={}", file.display()),
        "--socket",
        sock.to_str().unwrap(),
    ]);
    let out = run(Command::new("nbdinfo").args([
        "--list",
        "--json",
        &format!("nbd://{}", server.addr()),
    ]));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("nbdinfo JSON");
    let exports = json["exports"].as_array().expect("exports");
    let got: Vec<(String, u64)> = exports
        .iter()
        .map(|e| {
            (
                e["export-name"].as_str().unwrap().to_string(),
                e["export-size"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![("a".to_string(), 16 << 20), ("b".to_string(), 64 << 20)]
    );
    // The Unix socket serves the same exports.
    let out = run(Command::new("nbdinfo").args([
        "--size",
        &format!("nbd+unix:///b?socket={}", sock.display()),
    ]));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        (64u64 << 20).to_string()
    );
    // The default export (empty name) is the first volume.
    let out = run(Command::new("nbdinfo").args(["--size", &format!("nbd://{}", server.addr())]));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        (16u64 << 20).to_string()
    );
    server.assert_healthy();
}

/// Removed when the test passes (`common::Scratch`).
fn tempdir(name: &str) -> common::Scratch {
    common::Scratch::new(&format!("real-{name}"))
}

fn qemu_io_patterns(backend_args: &[&str]) {
    let mut server = Server::start(backend_args);
    // (pattern, offset, length): aligned, unaligned, crossing 1 MiB chunk
    // boundaries, tiny and large.
    let writes: [(u8, u64, u64); 6] = [
        (0x11, 0, 4096),
        (0x22, 4095, 3),
        (0x33, (1 << 20) - 1000, 70_001),
        (0x44, 5 << 20, 1 << 20),
        (0x55, (7 << 20) + 511, 1),
        (0x66, (16 << 20) - 4096, 4096),
    ];
    let mut cmds: Vec<String> = writes
        .iter()
        .map(|(p, o, l)| format!("write -P {p:#x} {o} {l}"))
        .collect();
    // 0x11 was overwritten at 4095..4098 by 0x22.
    cmds.push("read -P 0x11 0 4095".into());
    cmds.extend(
        writes[1..]
            .iter()
            .map(|(p, o, l)| format!("read -P {p:#x} {o} {l}")),
    );
    cmds.push("read -P 0 4098 8192".into());
    cmds.push(format!("read -P 0 {} 4096", 9 << 20));
    qemu_io(&server, "vol", &cmds);
    // A second connection sees the same data.
    qemu_io(
        &server,
        "vol",
        &[format!("read -P 0x44 {} {}", 5 << 20, 1 << 20)],
    );
    server.assert_healthy();
}

#[test]
fn qemu_io_patterns_on_malloc() {
    qemu_io_patterns(&["--volume", "vol:16M"]);
}

#[test]
fn qemu_io_patterns_on_file() {
    let dir = tempdir("qio-file");
    qemu_io_patterns(&[
        "--volume",
        &format!("vol:16M:file={}", dir.join("v.img").display()),
    ]);
}

#[test]
fn qemu_io_patterns_on_direct_file() {
    let dir = tempdir("qio-direct");
    qemu_io_patterns(&[
        "--volume",
        &format!("vol:16M:file={},direct", dir.join("v.img").display()),
    ]);
}

#[test]
fn qemu_img_convert_round_trip_is_byte_identical() {
    require("qemu-img", "qemu-utils");
    let dir = tempdir("convert");
    let src = dir.join("src.raw");
    let back = dir.join("back.raw");
    let data = pattern(42, 64 << 20);
    write_file(&src, &data);
    let mut server = Server::start(&["--volume", "vol:64M"]);
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(uri(&server, "vol")));
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(uri(&server, "vol"))
        .arg(&back));
    assert!(
        std::fs::read(&back).unwrap() == data,
        "qemu-img round trip differs"
    );
    server.assert_healthy();
}

#[test]
fn nbdcopy_with_four_connections_round_trips() {
    require("nbdcopy", "libnbd-bin");
    let dir = tempdir("nbdcopy");
    let src = dir.join("src.raw");
    let back = dir.join("back.raw");
    let data = pattern(7, 64 << 20);
    write_file(&src, &data);
    let file = dir.join("vol.img");
    for args in [
        vec!["--volume".to_string(), "vol:64M".to_string()],
        vec![
            "--volume".into(),
            format!("vol:64M:file={}", file.display()),
        ],
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut server = Server::start(&args);
        run(Command::new("nbdcopy")
            .args(["--connections=4", "--requests=16"])
            .arg(&src)
            .arg(uri(&server, "vol")));
        let _ = std::fs::remove_file(&back);
        run(Command::new("nbdcopy")
            .args(["--connections=4"])
            .arg(uri(&server, "vol"))
            .arg(&back));
        assert!(
            std::fs::read(&back).unwrap() == data,
            "nbdcopy round trip differs ({args:?})"
        );
        server.assert_healthy();
    }
}

fn fio_verify(server: &Server, iodepth: u32) {
    require("fio", "fio");
    let out = run(Command::new("fio").args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri={}", uri(server, "vol")),
        "--rw=randwrite",
        "--bs=4k",
        &format!("--iodepth={iodepth}"),
        "--size=32M",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--verify_state_save=0",
        "--output-format=json",
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value =
        serde_json::from_str(&text[text.find('{').expect("fio JSON")..]).expect("fio JSON");
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "fio error: {job}");
    assert!(job["write"]["total_ios"].as_u64().unwrap() >= 8192, "{job}");
    assert!(
        job["read"]["total_ios"].as_u64().unwrap() >= 8192,
        "verify reads ran: {job}"
    );
}

#[test]
fn fio_randwrite_verify_on_both_backends() {
    let dir = tempdir("fio");
    for backend in [
        "malloc".to_string(),
        format!("file={}", dir.join("f.img").display()),
    ] {
        let mut server = Server::start(&["--volume", &format!("vol:32M:{backend}")]);
        fio_verify(&server, 1);
        fio_verify(&server, 32);
        server.assert_healthy();
    }
}

#[test]
fn fio_verify_in_poll_mode() {
    let mut server = Server::start(&["--volume", "vol:32M", "--mode", "poll"]);
    fio_verify(&server, 32);
    server.assert_healthy();
}

#[test]
fn trim_and_write_zeroes_read_back_as_zeros() {
    let dir = tempdir("zero");
    for backend in [
        "malloc".to_string(),
        format!("file={}", dir.join("z.img").display()),
    ] {
        let mut server = Server::start(&["--volume", &format!("vol:8M:{backend}")]);
        qemu_io(
            &server,
            "vol",
            &[
                "write -P 0x5a 0 4M",
                // TRIM
                "discard 64k 64k",
                // WRITE_ZEROES with NO_HOLE (qemu sets it without -u) and without.
                "write -z 256k 100k",
                "write -z -u 1M 1M",
                // Unaligned zeroing.
                "write -z 3000001 777",
                "read -P 0 64k 64k",
                "read -P 0 256k 100k",
                "read -P 0 1M 1M",
                "read -P 0 3000001 777",
                "read -P 0x5a 0 64k",
                "read -P 0x5a 128k 128k",
                "read -P 0x5a 2M 902849",
                "read -P 0x5a 3000778 100",
            ],
        );
        server.assert_healthy();
    }
}

#[test]
fn after_flush_the_file_holds_the_data() {
    let dir = tempdir("flush");
    let img = dir.join("f.img");
    let mut server = Server::start(&["--volume", &format!("vol:8M:file={},direct", img.display())]);
    qemu_io(
        &server,
        "vol",
        &["write -P 0x77 4096 128k", "write -P 0x78 100000 3", "flush"],
    );
    let file = std::fs::read(&img).unwrap();
    assert_eq!(file.len(), 8 << 20);
    assert!(file[4096..100_000].iter().all(|&b| b == 0x77));
    assert!(file[100_000..100_003].iter().all(|&b| b == 0x78));
    assert!(file[100_003..4096 + 131_072].iter().all(|&b| b == 0x77));
    assert!(file[..4096].iter().all(|&b| b == 0));
    server.assert_healthy();
}

#[test]
fn sigterm_finishes_and_exits_zero() {
    require("qemu-io", "qemu-utils");
    let dir = tempdir("sigterm");
    let img = dir.join("s.img");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lull"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--volume",
            &format!("vol:8M:file={}", img.display()),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut addr = None;
    let mut line = String::new();
    while std::io::BufRead::read_line(&mut stdout, &mut line).unwrap() > 0 {
        if let Some(a) = line.trim().strip_prefix("listening on ") {
            addr = Some(a.to_string());
            break;
        }
        line.clear();
    }
    let addr = addr.expect("server printed its address");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x31 0 1M"])
        .arg(format!("nbd://{addr}/vol")));
    run(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "lull did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "exit status {status}");
    let file = std::fs::read(&img).unwrap();
    assert!(file[..1 << 20].iter().all(|&b| b == 0x31));
}

#[test]
fn bad_flags_and_config_exit_with_code_2() {
    let dir = tempdir("badcfg");
    let cfg = dir.join("bad.toml");
    write_file(&cfg, b"lisen = \"127.0.0.1:1\"\n");
    let cases: Vec<Vec<String>> = vec![
        vec!["serve".into(), "--volume".into(), "x:12Q".into()],
        vec!["serve".into(), "--mode".into(), "turbo".into()],
        vec!["serve".into(), "--cores".into(), "999".into()],
        vec!["serve".into(), "--listen".into(), "nowhere".into()],
        vec!["serve".into(), "--config".into(), cfg.display().to_string()],
        vec![
            "serve".into(),
            "--config".into(),
            dir.join("missing.toml").display().to_string(),
        ],
        vec!["serve".into(), "--bogus".into()],
    ];
    for args in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_lull"))
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.stderr.is_empty(), "{args:?} printed no message");
    }
}

#[test]
fn config_file_serves_its_volumes() {
    require("nbdinfo", "libnbd-bin");
    let dir = tempdir("cfg");
    let cfg = dir.join("lull.toml");
    write_file(
        &cfg,
        format!(
            "mode = \"poll\"\n[[volume]]\nname = \"c1\"\nsize = \"4M\"\n[[volume]]\nname = \"c2\"\nsize = \"8M\"\nbackend = \"file={}\"\n",
            dir.join("c2.img").display()
        )
        .as_bytes(),
    );
    let mut server = Server::start(&["--config", cfg.to_str().unwrap()]);
    let out = run(Command::new("nbdinfo").args(["--size", &uri(&server, "c2")]));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        (8u64 << 20).to_string()
    );
    server.assert_healthy();
}

/// A memory and a file volume grown over RPC while an NBD client is
/// connected: new connections (nbdinfo, qemu-io) see the new size and
/// write and read the new tail; the connection from before keeps the size
/// it negotiated (NBD has no resize notice), so a request past its old
/// end is refused and one inside still works; shrinking, odd sizes and
/// replicated volumes are refused with a message.
#[test]
fn a_volume_grown_over_rpc_shows_its_new_size_to_new_nbd_connections() {
    require("nbdinfo", "libnbd-bin");
    require("qemu-io", "qemu-utils");
    let dir = tempdir("grow");
    let img = dir.join("g.img");
    let mut server = Server::start(&[
        "--volume",
        "mem:8M",
        "--volume",
        &format!("file:8M:file={},direct", img.display()),
    ]);
    let sock = server.rpc_socket().to_path_buf();
    for (volume, new_size) in [("mem", "24M"), ("file", "20M")] {
        let new_bytes = lull_bdev::parse_size_bytes(new_size).unwrap();
        let old_bytes = 8u64 << 20;
        let mut before = common::NbdClient::connect(server.addr(), volume).expect("connect");
        assert_eq!(before.size_bytes, old_bytes);
        let (ok, out) = common::rpc_outcome(
            &sock,
            "volume_resize",
            &format!(r#"{{"name": "{volume}", "size": "{new_size}"}}"#),
        );
        assert!(ok, "volume_resize {volume}: {out}");
        let reply: serde_json::Value = serde_json::from_str(&out).expect("JSON result");
        assert_eq!(reply["size_bytes"].as_u64(), Some(new_bytes), "{out}");

        let out = run(Command::new("nbdinfo").args(["--size", &uri(&server, volume)]));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            new_bytes.to_string(),
            "{volume}: a new connection sees the new size"
        );
        // The new tail, across the old end and at the very end.
        let across = old_bytes - 4096;
        let tail = new_bytes - 65536;
        qemu_io(
            &server,
            volume,
            &[
                format!("write -P 0xab {across} 8192"),
                format!("write -P 0xcd {tail} 65536"),
                format!("read -P 0xab {across} 8192"),
                format!("read -P 0xcd {tail} 65536"),
                format!("read -P 0 {} 4096", old_bytes + 8192),
            ],
        );
        // The connection from before keeps its negotiated size.
        let cookie = before
            .send(lull_proto::nbd::Command::Read, 0, old_bytes, 4096, &[])
            .expect("send");
        assert_eq!(
            before.reply_to(cookie).expect("reply"),
            lull_proto::nbd::NBD_EINVAL,
            "{volume}: past the size this connection negotiated"
        );
        assert_eq!(
            before.read(across, 4096).expect("read").expect("inside"),
            vec![0xab; 4096]
        );
        before.disconnect();
    }
    // The file grew with it (sparse).
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 20 << 20);
    for (params, want) in [
        (r#"{"name": "mem", "size": "16M"}"#, "cannot shrink"),
        (r#"{"name": "mem", "size": 33554944}"#, "multiple of 4096"),
        (r#"{"name": "mem", "size": "32T"}"#, "maximum"),
        (r#"{"name": "nope", "size": "32M"}"#, "no volume"),
    ] {
        let (ok, out) = common::rpc_outcome(&sock, "volume_resize", params);
        assert!(!ok && out.contains(want), "{params}: {out}");
    }
    let out = run(Command::new("nbdinfo").args(["--size", &uri(&server, "mem")]));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "25165824");
    // The server reports the sizes it serves.
    let list = server.rpc("volume_list", "");
    let sizes: Vec<(&str, u64)> = list
        .as_array()
        .expect("volume_list returns a list")
        .iter()
        .map(|v| {
            (
                v["name"].as_str().unwrap(),
                v["size_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(sizes, [("mem", 24 << 20), ("file", 20 << 20)], "{list}");
    server.assert_healthy();
}
