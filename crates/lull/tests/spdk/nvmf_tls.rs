//! NVMe/TCP over TLS 1.3 with pre-shared keys (TP 8011), proven by
//! SPDK's initiator (`spdk_nvme_perf -S ssl --psk-path`, `spdk_dd` with a
//! keyring key) against `lull serve --nvmf-psk VOLUME=HOSTNQN=KEYFILE`,
//! by SPDK's own nvmf_tgt taking the same key file (the cross-check that
//! the key format, the identity and the derivation are SPDK's), and by a
//! raw TLS host for what no SPDK tool does (discovery over TLS, a
//! session whose Connect names another subsystem, a stalled handshake).
//!
//! SPDK's tools come from `../shared/tools/spdk` or `LULL_SPDK_TOOLS`;
//! tests that need them print SKIP and return without them.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{pattern, tools, Server, IO_TIMEOUT};
use crate::nvmf::{perf_args, spdk_run};
use lull_net::tls::{ExternalPskContext, TlsStream};
use lull_nvmf::pdu::{self, Digests, IcReq, Pdu};
use lull_nvmf::psk::{self, RetainedHash};
use lull_nvmf::spec::DISCOVERY_NQN;

const VOLUME: &str = "vol0";
const HOST: &str = "nqn.2026-11.test:tls-host1";
const OTHER_HOST: &str = "nqn.2026-11.test:tls-host2";

fn spdk_tools(test: &str) -> Option<PathBuf> {
    tools::spdk_tools(test, &["spdk_nvme_perf", "spdk_dd", "nvmf_tgt"])
}

/// A key file in the interchange format, 0600, without a final newline
/// (SPDK's keyring reads the file whole and wants the closing colon
/// last). The key is 32 bytes from `seed`.
fn key_file(dir: &Path, name: &str, seed: u64) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    let key = pattern(seed, 32);
    std::fs::write(&path, psk::format_interchange(&key, RetainedHash::Sha256))
        .expect("write the key file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .expect("chmod the key file");
    path
}

/// `lull serve` with volumes `vol0` (a key for HOST) and `open` (no key),
/// both over NVMe/TCP; the key file's path.
fn serve_tls() -> (Server, SocketAddr, PathBuf) {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("lull-nvmf-tls-keys-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("key dir");
    let key = key_file(&dir, "host1.key", 0x7e5);
    let server = Server::start(&[
        "--volume",
        &format!("{VOLUME}:64M"),
        "--volume",
        "open:16M",
        "--nvmf-listen",
        "127.0.0.1:0",
        "--nvmf-psk",
        &format!("{VOLUME}={HOST}={}", key.display()),
    ]);
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    (server, addr, key)
}

fn trid(addr: SocketAddr, subnqn: &str, hostnqn: &str) -> String {
    format!(
        "trtype:TCP adrfam:IPv4 traddr:{} trsvcid:{} subnqn:{subnqn} hostnqn:{hostnqn}",
        addr.ip(),
        addr.port()
    )
}

/// spdk_nvme_perf over TLS (`-S ssl --psk-path`, or plaintext with no
/// key) for `seconds`: (exit status, output).
fn perf_tls(
    tools: &Path,
    tr: &str,
    key: Option<&Path>,
    workload: &str,
    qd: u32,
    seconds: u32,
) -> (bool, String) {
    let key_arg = key.map(|k| k.display().to_string());
    let tls: Vec<&str> = match &key_arg {
        Some(k) => vec!["-S", "ssl", "--psk-path", k],
        None => Vec::new(),
    };
    let args = perf_args(tr, workload, qd, 4096, seconds, &tls);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    spdk_run(tools, "spdk_nvme_perf", &args)
}

/// perf's Total line, after checking it exited 0, reported no error
/// (`nvmf::check_perf`) and did I/O.
fn total(ok: bool, out: &str, what: &str) -> String {
    assert!(ok, "{what}: perf failed:\n{out}");
    crate::nvmf::check_perf(out, what)
}

#[test]
fn spdk_perf_over_tls_at_qd1_and_qd32() {
    let Some(tools) = spdk_tools("spdk_perf_over_tls_at_qd1_and_qd32") else {
        return;
    };
    let _one = tools::spdk_alone();
    let (mut server, addr, key) = serve_tls();
    let tr = trid(addr, &lull_nvmf::subsystem_nqn(VOLUME), HOST);
    for (workload, qd) in [("randwrite", 32), ("randread", 1), ("randread", 32)] {
        let (ok, out) = perf_tls(&tools, &tr, Some(&key), workload, qd, 2);
        let t = total(ok, &out, &format!("TLS {workload} QD{qd}"));
        eprintln!("lull nvmf TLS {workload} 4k QD{qd}: {t}");
    }
    // 128 KiB reads and writes (R2T, H2CData and C2HData of many
    // records) with header and data digests, inside TLS.
    let key_arg = key.display().to_string();
    let extra = ["-M", "50", "-H", "-I", "-S", "ssl", "--psk-path", &key_arg];
    let args = perf_args(&tr, "randrw", 32, 131072, 2, &extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out) = spdk_run(&tools, "spdk_nvme_perf", &args);
    let t = total(ok, &out, "TLS randrw 128k QD32 with digests");
    eprintln!("lull nvmf TLS randrw 128k QD32 digests: {t}");
    // The queue pairs were TLS ones (the one place that says so).
    server.assert_logged(&["queue connected", HOST, "tls=true"]);
    server.assert_healthy();
}

#[test]
fn a_wrong_key_and_a_plaintext_host_are_refused() {
    let Some(tools) = spdk_tools("a_wrong_key_and_a_plaintext_host_are_refused") else {
        return;
    };
    let _one = tools::spdk_alone();
    let (mut server, addr, key) = serve_tls();
    let dir = key.parent().expect("key dir").to_path_buf();
    let wrong = key_file(&dir, "wrong.key", 0xbad);
    let tr = trid(addr, &lull_nvmf::subsystem_nqn(VOLUME), HOST);

    // A wrong key: the TLS binder does not verify, nothing attaches.
    let (_, out) = perf_tls(&tools, &tr, Some(&wrong), "randread", 1, 1);
    assert!(
        out.contains("No valid NVMe controllers found") && !out.contains("Total"),
        "a host with a wrong key attached:\n{out}"
    );
    server.assert_logged(&["refusing connection", "TLS handshake failed", "binder"]);

    // Plaintext to the subsystem that requires TLS: Connect Invalid Host
    // (SCT 1h, SC 84h = 132), with a log line.
    let (_, out) = perf_tls(&tools, &tr, None, "randread", 1, 1);
    assert!(
        out.contains("No valid NVMe controllers found") && !out.contains("Total"),
        "a plaintext host attached to a secure-channel subsystem:\n{out}"
    );
    assert!(out.contains("sct 1, sc 132"), "{out}");
    server.assert_logged(&["Connect refused", "requires a secure channel"]);

    // A host without a key gets nothing over TLS either.
    let tr_other = trid(addr, &lull_nvmf::subsystem_nqn(VOLUME), OTHER_HOST);
    let (_, out) = perf_tls(&tools, &tr_other, Some(&key), "randread", 1, 1);
    assert!(!out.contains("Total"), "{out}");
    server.assert_logged(&["no PSK for this host and subsystem", OTHER_HOST]);

    // The volume without keys still serves plaintext hosts, and the
    // right key still works after all that.
    let tr_open = trid(addr, &lull_nvmf::subsystem_nqn("open"), OTHER_HOST);
    let (ok, out) = perf_tls(&tools, &tr_open, None, "randread", 1, 1);
    total(ok, &out, "plaintext to the open volume");
    let (ok, out) = perf_tls(&tools, &tr, Some(&key), "randread", 1, 1);
    total(ok, &out, "TLS with the right key");
    server.assert_healthy();
}

#[test]
fn spdk_dd_round_trip_over_tls_is_byte_identical() {
    let Some(tools) = spdk_tools("spdk_dd_round_trip_over_tls_is_byte_identical") else {
        return;
    };
    let _one = tools::spdk_alone();
    let (mut server, addr, key) = serve_tls();
    let dir = server.dir().clone();
    // bdev_nvme_attach_controller's "psk" names a keyring key.
    let config = dir.join("dd-tls.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"subsystems":[
 {{"subsystem":"keyring","config":[{{"method":"keyring_file_add_key","params":{{"name":"key0","path":"{}"}}}}]}},
 {{"subsystem":"bdev","config":[{{"method":"bdev_nvme_attach_controller",
 "params":{{"name":"N0","trtype":"tcp","adrfam":"IPv4","traddr":"{}","trsvcid":"{}",
 "subnqn":"{}","hostnqn":"{HOST}","psk":"key0"}}}}]}}]}}"#,
            key.display(),
            addr.ip(),
            addr.port(),
            lull_nvmf::subsystem_nqn(VOLUME),
        ),
    )
    .expect("write the dd config");
    let input = dir.join("in.bin");
    let output = dir.join("out.bin");
    let bytes = 16 << 20;
    let data = pattern(0x7157, bytes);
    std::fs::write(&input, &data).expect("write the input");
    let dd = |args: &[&str]| {
        let mut all = vec![
            "--no-huge",
            "-s",
            "1024",
            "--json",
            config.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        let (ok, out) = spdk_run(&tools, "spdk_dd", &all);
        assert!(ok, "spdk_dd {args:?} failed:\n{out}");
    };
    dd(&[
        "--if",
        input.to_str().unwrap(),
        "--ob",
        "N0n1",
        "--bs",
        "131072",
    ]);
    let count = (bytes / 4096).to_string();
    dd(&[
        "--ib",
        "N0n1",
        "--of",
        output.to_str().unwrap(),
        "--bs",
        "4096",
        "--count",
        &count,
    ]);
    let back = std::fs::read(&output).expect("read the dd output");
    assert_eq!(back.len(), data.len());
    assert!(back == data, "spdk_dd over TLS read back other bytes");
    server.assert_logged(&["queue connected", HOST, "tls=true"]);
    server.assert_healthy();
}

/// SPDK's nvmf_tgt, killed on drop.
struct NvmfTgt {
    child: Child,
    sock: PathBuf,
    tools: PathBuf,
}

impl NvmfTgt {
    fn start(tools: &Path, dir: &Path) -> NvmfTgt {
        let sock = dir.join("spdk.sock");
        let _ = std::fs::remove_file(&sock);
        let log = std::fs::File::create(dir.join("nvmf_tgt.log")).expect("nvmf_tgt log");
        let child = Command::new(tools.join("bin/nvmf_tgt"))
            .args(["--no-huge", "-s", "1024", "-m", "0x2", "-r"])
            .arg(&sock)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("start nvmf_tgt");
        let tgt = NvmfTgt {
            child,
            sock,
            tools: tools.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !tgt.sock.exists() {
            assert!(Instant::now() < deadline, "nvmf_tgt made no RPC socket");
            std::thread::sleep(Duration::from_millis(50));
        }
        // The socket exists before the RPC server answers: retry the
        // first call.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !tgt.try_rpc(&["spdk_get_version"]).0 {
            assert!(Instant::now() < deadline, "nvmf_tgt does not answer RPC");
            std::thread::sleep(Duration::from_millis(100));
        }
        tgt
    }

    fn try_rpc(&self, args: &[&str]) -> (bool, String) {
        let out = Command::new("python3")
            .arg(self.tools.join("scripts/rpc.py"))
            .arg("-s")
            .arg(&self.sock)
            .args(args)
            .output()
            .expect("run rpc.py");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    fn rpc(&self, args: &[&str]) {
        let (ok, text) = self.try_rpc(args);
        assert!(ok, "rpc.py {args:?}: {text}");
    }
}

impl Drop for NvmfTgt {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The key file lull takes is one SPDK's nvmf_tgt takes too (keyring
/// file key, `nvmf_subsystem_add_host --psk`, a `--secure-channel`
/// listener), and the same perf command line reaches both: the
/// interchange format, the identity and the derivation are SPDK's.
#[test]
fn nvmf_tgt_takes_the_same_key_file() {
    let Some(tools) = spdk_tools("nvmf_tgt_takes_the_same_key_file") else {
        return;
    };
    let _one = tools::spdk_alone();
    let (mut server, addr, key) = serve_tls();
    let tr = trid(addr, &lull_nvmf::subsystem_nqn(VOLUME), HOST);
    let (ok, out) = perf_tls(&tools, &tr, Some(&key), "randread", 1, 1);
    eprintln!("lull TLS: {}", total(ok, &out, "lull over TLS"));

    let tgt = NvmfTgt::start(&tools, server.dir());
    let nqn = "nqn.2016-06.io.spdk:tls1";
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
        .to_string();
    tgt.rpc(&["nvmf_create_transport", "-t", "TCP"]);
    tgt.rpc(&["bdev_malloc_create", "-b", "Malloc0", "32", "512"]);
    tgt.rpc(&["nvmf_create_subsystem", nqn, "-s", "SPDK1"]);
    tgt.rpc(&["nvmf_subsystem_add_ns", nqn, "Malloc0"]);
    tgt.rpc(&[
        "nvmf_subsystem_add_listener",
        nqn,
        "-t",
        "tcp",
        "-a",
        "127.0.0.1",
        "-s",
        &port,
        "--secure-channel",
    ]);
    tgt.rpc(&["keyring_file_add_key", "key0", key.to_str().unwrap()]);
    tgt.rpc(&["nvmf_subsystem_add_host", nqn, HOST, "--psk", "key0"]);
    let tgt_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let (ok, out) = perf_tls(
        &tools,
        &trid(tgt_addr, nqn, HOST),
        Some(&key),
        "randread",
        1,
        1,
    );
    eprintln!("nvmf_tgt TLS: {}", total(ok, &out, "nvmf_tgt over TLS"));
    drop(tgt);
    server.assert_healthy();
}

/// A raw NVMe/TCP host over TLS 1.3, blocking, one command at a time.
struct TlsHost {
    s: TlsStream<TcpStream>,
}

impl TlsHost {
    /// TLS with `hostnqn`'s key as SPDK derives it for `subnqn`, then
    /// ICReq.
    fn connect(addr: SocketAddr, key: &Path, hostnqn: &str, subnqn: &str) -> TlsHost {
        let configured = psk::load_key_file(key).expect("the key file");
        let id = psk::identity(hostnqn, subnqn, configured.cipher());
        let retained = configured.retained(hostnqn).expect("retained PSK");
        let tls_key = psk::tls_psk(&retained, &id, configured.cipher()).expect("TLS PSK");
        let ctx = ExternalPskContext::client(&id, &tls_key).expect("client context");
        let tcp = TcpStream::connect(addr).expect("connect");
        tcp.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        let mut s = TlsStream::external_psk(&ctx, tcp).expect("TLS session");
        assert!(
            s.handshake().expect("the TLS handshake"),
            "blocking handshake"
        );
        let mut h = TlsHost { s };
        let ic = pdu::encode(
            &Pdu::IcReq(IcReq {
                pfv: 0,
                hpda: 0,
                digests: Digests::default(),
                maxr2t: 0,
            }),
            Digests::default(),
        );
        h.s.write_all(&ic).expect("ICReq");
        let mut resp = [0u8; 128];
        h.s.read_exact(&mut resp).expect("ICResp");
        assert_eq!(resp[0], pdu::TYPE_IC_RESP);
        h
    }

    /// Fabrics Connect of the admin queue: the status field.
    fn connect_admin(&mut self, hostnqn: &str, subnqn: &str) -> u16 {
        let mut sqe = [0u8; 64];
        sqe[0] = 0x7F;
        sqe[2] = 1;
        sqe[4] = 0x01;
        sqe[32..36].copy_from_slice(&1024u32.to_le_bytes());
        sqe[39] = 0x01; // in-capsule data
        sqe[44..48].copy_from_slice(&31u32.to_le_bytes());
        let mut d = vec![0u8; 1024];
        d[16..18].copy_from_slice(&0xFFFFu16.to_le_bytes());
        d[256..256 + subnqn.len()].copy_from_slice(subnqn.as_bytes());
        d[512..512 + hostnqn.len()].copy_from_slice(hostnqn.as_bytes());
        let bytes = pdu::encode(&Pdu::CapsuleCmd { sqe, data: &d }, Digests::default());
        self.s.write_all(&bytes).expect("Connect");
        let mut resp = [0u8; 24];
        self.s.read_exact(&mut resp).expect("CapsuleResp");
        assert_eq!(resp[0], pdu::TYPE_CAPSULE_RESP);
        u16::from_le_bytes([resp[22], resp[23]])
    }

    /// Get Log Page 70h (the discovery log), `len` bytes.
    fn discovery_log(&mut self, len: u32) -> Vec<u8> {
        let mut sqe = [0u8; 64];
        sqe[0] = 0x02;
        sqe[2] = 2;
        let numd = len / 4 - 1;
        sqe[40..44].copy_from_slice(&((numd << 16) | 0x70).to_le_bytes());
        sqe[32..36].copy_from_slice(&len.to_le_bytes());
        sqe[39] = 0x5A; // transport SGL data block
        let bytes = pdu::encode(&Pdu::CapsuleCmd { sqe, data: &[] }, Digests::default());
        self.s.write_all(&bytes).expect("Get Log Page");
        let mut head = [0u8; 24];
        self.s.read_exact(&mut head).expect("C2HData");
        assert_eq!(head[0], pdu::TYPE_C2H_DATA);
        let mut data = vec![0u8; len as usize];
        self.s.read_exact(&mut data).expect("the log");
        let mut resp = [0u8; 24];
        self.s.read_exact(&mut resp).expect("CapsuleResp");
        assert_eq!(u16::from_le_bytes([resp[22], resp[23]]), 0);
        data
    }
}

/// No SPDK tool reads a discovery log over TLS (perf's discovery probe
/// uses no key), so a raw host does: over TLS with its key, the log lists
/// both volumes, the keyed one marked secure channel required (TREQ 01b)
/// over TLS 1.3 (TSAS SECTYPE 2); a session whose identity named one
/// subsystem cannot Connect to another (Connect Invalid Host).
#[test]
fn discovery_over_tls_marks_the_secure_subsystem() {
    let (mut server, addr, key) = serve_tls();
    let mut h = TlsHost::connect(addr, &key, HOST, DISCOVERY_NQN);
    assert_eq!(h.connect_admin(HOST, DISCOVERY_NQN), 0);
    let log = h.discovery_log(3 * 1024);
    assert_eq!(u64::from_le_bytes(log[8..16].try_into().unwrap()), 2);
    let mut seen = Vec::new();
    for r in log[1024..].chunks(1024) {
        let end = r[256..512].iter().position(|&b| b == 0).unwrap_or(256);
        let nqn = String::from_utf8_lossy(&r[256..256 + end]).into_owned();
        seen.push((nqn, r[3], r[768]));
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![
            (lull_nvmf::subsystem_nqn("open"), 0b10, 0),
            (lull_nvmf::subsystem_nqn(VOLUME), 0b01, 2),
        ]
    );

    // The identity named vol0: a Connect to "open" over it is refused.
    let mut h = TlsHost::connect(addr, &key, HOST, &lull_nvmf::subsystem_nqn(VOLUME));
    let invalid_host = lull_nvmf::spec::Status::CONNECT_INVALID_HOST.field();
    assert_eq!(
        h.connect_admin(HOST, &lull_nvmf::subsystem_nqn("open")),
        invalid_host
    );
    server.assert_logged(&["Connect refused", "differ from the TLS PSK identity"]);
    let mut h = TlsHost::connect(addr, &key, HOST, &lull_nvmf::subsystem_nqn(VOLUME));
    assert_eq!(h.connect_admin(HOST, &lull_nvmf::subsystem_nqn(VOLUME)), 0);
    server.assert_healthy();
}

/// A host that opens a TLS record and then says nothing is dropped when
/// the handshake window ends (`TLS_HANDSHAKE_TIMEOUT_US`), with a log
/// line; a ClientHello that is garbage is dropped at once.
#[test]
fn a_stalled_or_garbled_handshake_is_dropped() {
    let (mut server, addr, _key) = serve_tls();
    // A TLS record header promising 512 bytes of handshake, and 3 of them.
    let mut garbled = TcpStream::connect(addr).expect("connect");
    garbled.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    garbled
        .write_all(&[
            0x16, 0x03, 0x01, 0x00, 0x08, 0xde, 0xad, 0xbe, 0xef, 0, 0, 0, 0,
        ])
        .expect("send garbage");
    let mut b = [0u8; 64];
    let n = garbled.read(&mut b).unwrap_or(0);
    // An alert at most, then the close.
    if n > 0 {
        assert_eq!(b[0], 0x15, "a TLS alert, if anything");
    }
    server.assert_logged(&["refusing connection", "TLS handshake failed"]);

    let mut stalled = TcpStream::connect(addr).expect("connect");
    let window = Duration::from_micros(lull_nvmf::limits::TLS_HANDSHAKE_TIMEOUT_US);
    stalled
        .set_read_timeout(Some(window + Duration::from_secs(10)))
        .unwrap();
    stalled
        .write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01])
        .expect("send a partial ClientHello");
    let start = Instant::now();
    let mut b = [0u8; 64];
    match stalled.read(&mut b) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("a stalled handshake stayed open: {other:?}"),
    }
    let waited = start.elapsed();
    assert!(
        waited + Duration::from_secs(1) >= window,
        "closed after {waited:?}, before the window of {window:?}"
    );
    server.assert_logged(&["refusing connection", "TLS handshake not finished"]);
    server.assert_healthy();
}

/// Host keys over RPC: `nvmf_host_psk_add` makes the open volume take
/// TLS only (the key works, plaintext is refused), `nvmf_host_psk_remove`
/// opens it again; a bad key file and an unknown volume are refused and
/// change nothing.
#[test]
fn host_keys_are_added_and_removed_over_rpc() {
    let Some(tools) = spdk_tools("host_keys_are_added_and_removed_over_rpc") else {
        return;
    };
    let _one = tools::spdk_alone();
    let (mut server, addr, key) = serve_tls();
    let dir = key.parent().expect("key dir").to_path_buf();
    let tr = trid(addr, &lull_nvmf::subsystem_nqn("open"), OTHER_HOST);
    let other_key = key_file(&dir, "other.key", 0x0be);
    let bad = dir.join("bad.key");
    std::fs::write(&bad, "NVMeTLSkey-1:01:not a key:").expect("write");
    for (params, why) in [
        (
            format!(
                r#"{{"volume":"open","hostnqn":"{OTHER_HOST}","key_file":"{}"}}"#,
                bad.display()
            ),
            "bad.key",
        ),
        (
            format!(
                r#"{{"volume":"nope","hostnqn":"{OTHER_HOST}","key_file":"{}"}}"#,
                other_key.display()
            ),
            "nope",
        ),
    ] {
        let (ok, text) =
            crate::common::rpc_outcome(server.rpc_socket(), "nvmf_host_psk_add", &params);
        assert!(!ok && text.contains(why), "{params}: {text}");
    }
    let (ok, out) = perf_tls(&tools, &tr, None, "randread", 1, 1);
    total(ok, &out, "plaintext to the open volume before any key");

    let reply = server.rpc(
        "nvmf_host_psk_add",
        &format!(
            r#"{{"volume":"open","hostnqn":"{OTHER_HOST}","key_file":"{}"}}"#,
            other_key.display()
        ),
    );
    assert_eq!(reply["secure_channel_required"], true, "{reply}");
    assert!(
        !reply.to_string().contains("NVMeTLSkey"),
        "the key is never echoed"
    );
    let (ok, out) = perf_tls(&tools, &tr, Some(&other_key), "randread", 1, 1);
    total(ok, &out, "TLS with the key added over RPC");
    let (_, out) = perf_tls(&tools, &tr, None, "randread", 1, 1);
    assert!(
        out.contains("sct 1, sc 132"),
        "plaintext refused once keyed:\n{out}"
    );

    let reply = server.rpc(
        "nvmf_host_psk_remove",
        &format!(r#"{{"volume":"open","hostnqn":"{OTHER_HOST}"}}"#),
    );
    assert_eq!(reply["secure_channel_required"], false, "{reply}");
    let (ok, out) = perf_tls(&tools, &tr, None, "randread", 1, 1);
    total(ok, &out, "plaintext again once the key is gone");
    server.assert_healthy();
}
