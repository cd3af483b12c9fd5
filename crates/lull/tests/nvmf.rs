//! The NVMe/TCP target proven by SPDK's own initiator: spdk_nvme_identify,
//! spdk_nvme_perf and spdk_dd against `lull serve --nvmf-listen` on
//! loopback, and malformed PDUs from a raw socket.
//!
//! The SPDK tools are prebuilt in `../shared/tools/spdk` beside the repo
//! (or where `LULL_SPDK_TOOLS` says). Where they are not, each test that
//! needs them prints a loud SKIP line and returns: a clean clone may be
//! tested without them. The malformed-PDU test needs nothing.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use common::{pattern, NbdClient, Server, IO_TIMEOUT};
use lull_nvmf::pdu::{self, Digests, IcReq, Pdu};

/// SPDK processes run one at a time: each takes 256 MiB to 1 GiB of
/// memory without hugepages, and the machine is small.
static SPDK: Mutex<()> = Mutex::new(());

const VOLUME: &str = "vol0";
const VOLUME_BYTES: u64 = 64 << 20;

/// Where the SPDK tools are, or `None` (with a SKIP line) when absent.
fn spdk_tools(test: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("LULL_SPDK_TOOLS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tools/spdk")
        });
    if dir.join("bin/spdk_nvme_identify").exists() {
        Some(dir)
    } else {
        eprintln!(
            "SKIP {test}: SPDK tools not found at {} (set LULL_SPDK_TOOLS; they need libssl3 libnuma1 libuuid1 libkeyutils1 libaio1)",
            dir.display()
        );
        println!("SKIP {test}: no SPDK tools at {}", dir.display());
        None
    }
}

fn serve() -> (Server, SocketAddr) {
    let server = Server::start(&[
        "--volume",
        &format!("{VOLUME}:64M"),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let addr = server
        .nvmf_addr()
        .expect("the server prints its NVMe/TCP address");
    (server, addr)
}

fn trid(addr: SocketAddr) -> String {
    format!(
        "trtype:TCP adrfam:IPv4 traddr:{} trsvcid:{} subnqn:{}",
        addr.ip(),
        addr.port(),
        lull_nvmf::subsystem_nqn(VOLUME)
    )
}

/// Run an SPDK tool; panics with its output unless it exits 0.
fn spdk(tools: &Path, bin: &str, args: &[&str]) -> String {
    let out = Command::new(tools.join("bin").join(bin))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {bin}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{bin} {args:?} failed with {}:\n{text}",
        out.status
    );
    text
}

#[test]
fn spdk_identify_sees_the_controller_and_the_volume() {
    let Some(tools) = spdk_tools("spdk_identify_sees_the_controller_and_the_volume") else {
        return;
    };
    let _one = SPDK.lock().unwrap_or_else(|p| p.into_inner());
    let (mut server, addr) = serve();
    let out = spdk(
        &tools,
        "spdk_nvme_identify",
        &["--no-huge", "-d", "256", "-r", &trid(addr)],
    );
    let blocks = VOLUME_BYTES / 512;
    for want in [
        "Model Number:                          lull".to_string(),
        format!("Subsystem NQN:                         nqn.2026-11.io.lull:{VOLUME}"),
        "Max Data Transfer Size:                131072".to_string(),
        "Namespace ID:1".to_string(),
        format!("Size (in LBAs):                        {blocks} "),
        "LBA Format #00: Data Size:   512".to_string(),
    ] {
        assert!(out.contains(&want), "identify lacks {want:?}:\n{out}");
    }
    server.assert_healthy();
    server.assert_logged("controller removed");
}

#[test]
fn spdk_identify_reads_the_discovery_log() {
    let Some(tools) = spdk_tools("spdk_identify_reads_the_discovery_log") else {
        return;
    };
    let _one = SPDK.lock().unwrap_or_else(|p| p.into_inner());
    let mut server = Server::start(&[
        "--volume",
        "a:16M",
        "--volume",
        "b:16M",
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    // spdk_nvme_discover needs hugepages; identify on the discovery NQN
    // prints the same log.
    let tr = format!(
        "trtype:TCP adrfam:IPv4 traddr:{} trsvcid:{} subnqn:{}",
        addr.ip(),
        addr.port(),
        lull_nvmf::spec::DISCOVERY_NQN
    );
    let out = spdk(
        &tools,
        "spdk_nvme_identify",
        &["--no-huge", "-d", "256", "-r", &tr],
    );
    assert!(
        out.contains("Number of Records:                     2"),
        "{out}"
    );
    for v in ["a", "b"] {
        let want = format!("NVM Subsystem Qualified Name:          nqn.2026-11.io.lull:{v}");
        assert!(out.contains(&want), "discovery log lacks {want:?}:\n{out}");
    }
    assert!(out.contains(&format!(
        "Transport Service Identifier:          {}",
        addr.port()
    )));
    server.assert_healthy();
}

/// One spdk_nvme_perf run; returns its "Total" line.
fn perf(
    tools: &Path,
    addr: SocketAddr,
    workload: &str,
    qd: u32,
    io_bytes: u32,
    extra: &[&str],
) -> String {
    let (q, o) = (qd.to_string(), io_bytes.to_string());
    let tr = trid(addr);
    let mut args = vec![
        "--no-huge",
        "-s",
        "256",
        "-c",
        "0x1",
        "-q",
        &q,
        "-o",
        &o,
        "-w",
        workload,
        "-t",
        "2",
        "-r",
        &tr,
    ];
    args.extend_from_slice(extra);
    let out = spdk(tools, "spdk_nvme_perf", &args);
    // perf's only error line on success is its I/O queue's "CQ transport
    // error -6" as it disconnects (SPDK's nvmf_tgt gets the same).
    for line in out.lines() {
        let l = line.to_ascii_lowercase();
        assert!(
            !(l.contains("fail") || (l.contains("error") && !l.contains("cq transport error -6"))),
            "perf {workload} QD{qd} reported: {line}\n{out}"
        );
    }
    let total = out
        .lines()
        .find(|l| l.starts_with("Total"))
        .unwrap_or_else(|| panic!("perf printed no Total:\n{out}"))
        .to_string();
    let iops: f64 = total
        .split_whitespace()
        .nth(2)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    assert!(iops > 0.0, "perf {workload} QD{qd} did no I/O: {total}");
    total
}

#[test]
fn spdk_perf_randwrite_then_randread_at_qd1_and_qd32() {
    let Some(tools) = spdk_tools("spdk_perf_randwrite_then_randread_at_qd1_and_qd32") else {
        return;
    };
    let _one = SPDK.lock().unwrap_or_else(|p| p.into_inner());
    let (mut server, addr) = serve();
    for workload in ["randwrite", "randread"] {
        for qd in [1, 32] {
            // One run with a 1 s KATO for its 2 s: SPDK's keep-alives
            // must keep the controller.
            let extra: &[&str] = if qd == 1 { &["-k", "1000"] } else { &[] };
            let total = perf(&tools, addr, workload, qd, 4096, extra);
            eprintln!("lull nvmf {workload} 4k QD{qd}: {total}");
        }
    }
    // 128 KiB (R2T for writes) with header and data digests.
    let total = perf(
        &tools,
        addr,
        "randrw",
        32,
        131072,
        &["-M", "50", "-H", "-I"],
    );
    eprintln!("lull nvmf randrw 128k QD32 digests: {total}");
    assert!(
        !server.stderr().contains("keep-alive timeout"),
        "a host sending keep-alives timed out:\n{}",
        server.stderr()
    );
    server.assert_healthy();
}

#[test]
fn spdk_dd_round_trip_is_byte_identical_and_nbd_agrees() {
    let Some(tools) = spdk_tools("spdk_dd_round_trip_is_byte_identical_and_nbd_agrees") else {
        return;
    };
    let _one = SPDK.lock().unwrap_or_else(|p| p.into_inner());
    let (mut server, addr) = serve();
    let dir = server.dir().clone();
    let config = dir.join("dd.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"subsystems":[{{"subsystem":"bdev","config":[{{"method":"bdev_nvme_attach_controller",
 "params":{{"name":"N0","trtype":"tcp","adrfam":"IPv4","traddr":"{}","trsvcid":"{}",
 "subnqn":"{}"}}}}]}}]}}"#,
            addr.ip(),
            addr.port(),
            lull_nvmf::subsystem_nqn(VOLUME)
        ),
    )
    .expect("write the dd config");
    let input = dir.join("in.bin");
    let output = dir.join("out.bin");
    let data = pattern(0x5eed, 16 << 20);
    std::fs::write(&input, &data).expect("write the input");
    let cfg = config.to_str().unwrap();
    spdk(
        &tools,
        "spdk_dd",
        &[
            "--no-huge",
            "-s",
            "1024",
            "--json",
            cfg,
            "--if",
            input.to_str().unwrap(),
            "--ob",
            "N0n1",
            "--bs",
            "131072",
        ],
    );
    // The same volume over NBD at once: it reads what NVMe/TCP wrote, and
    // what it writes is what NVMe/TCP then reads.
    let mut nbd = NbdClient::connect(server.addr(), VOLUME).expect("NBD connect");
    let mut expect = data.clone();
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        let got = nbd
            .read((i as u64) << 20, chunk.len() as u32)
            .expect("NBD read")
            .expect("NBD read status");
        assert!(
            got == chunk,
            "NBD reads other bytes at MiB {i} than NVMe/TCP wrote"
        );
    }
    let over = pattern(0xb0b, 1 << 20);
    assert_eq!(nbd.write(4 << 20, &over).expect("NBD write"), 0);
    expect[4 << 20..5 << 20].copy_from_slice(&over);
    drop(nbd);
    spdk(
        &tools,
        "spdk_dd",
        &[
            "--no-huge",
            "-s",
            "1024",
            "--json",
            cfg,
            "--ib",
            "N0n1",
            "--of",
            output.to_str().unwrap(),
            "--bs",
            "131072",
            "--count",
            "128",
        ],
    );
    let back = std::fs::read(&output).expect("read the output");
    assert_eq!(back.len(), expect.len());
    assert!(
        back == expect,
        "spdk_dd read back other bytes than NVMe/TCP and NBD wrote"
    );
    server.assert_healthy();
}

/// Read PDUs until the target closes; returns their types.
fn read_until_closed(sock: &mut TcpStream) -> Vec<u8> {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the target neither answered nor closed: {e}"),
        }
    }
    let mut types = Vec::new();
    let mut at = 0;
    while let Some(ch) = pdu::common_header(&bytes[at..]) {
        types.push(ch.pdu_type);
        at += (ch.plen as usize).max(pdu::CH_LEN);
        if at >= bytes.len() {
            break;
        }
    }
    types
}

/// A raw NVMe/TCP host: ICReq, then commands one at a time.
struct RawHost {
    sock: TcpStream,
}

impl RawHost {
    fn connect(addr: SocketAddr) -> RawHost {
        let mut sock = TcpStream::connect(addr).expect("connect");
        sock.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        let ic = pdu::encode(
            &Pdu::IcReq(IcReq {
                pfv: 0,
                hpda: 0,
                digests: Digests::default(),
                maxr2t: 0,
            }),
            Digests::default(),
        );
        sock.write_all(&ic).expect("ICReq");
        let mut resp = [0u8; 128];
        sock.read_exact(&mut resp).expect("ICResp");
        assert_eq!(resp[0], pdu::TYPE_IC_RESP);
        RawHost { sock }
    }

    /// Send a command (with in-capsule data) and read its CapsuleResp:
    /// (status field, dw0).
    fn command(&mut self, sqe: [u8; 64], data: &[u8]) -> (u16, u32) {
        let bytes = pdu::encode(&Pdu::CapsuleCmd { sqe, data }, Digests::default());
        self.sock.write_all(&bytes).expect("send a command");
        let mut resp = [0u8; 24];
        self.sock.read_exact(&mut resp).expect("CapsuleResp");
        assert_eq!(resp[0], pdu::TYPE_CAPSULE_RESP);
        (
            u16::from_le_bytes([resp[22], resp[23]]),
            u32::from_le_bytes(resp[8..12].try_into().unwrap()),
        )
    }

    /// Fabrics Connect of queue `qid` to `cntlid` with a KATO.
    fn fabrics_connect(&mut self, qid: u16, cntlid: u16, kato_ms: u32) -> (u16, u32) {
        let mut sqe = [0u8; 64];
        sqe[0] = 0x7F;
        sqe[2] = 1;
        sqe[4] = 0x01;
        sqe[32..36].copy_from_slice(&1024u32.to_le_bytes());
        sqe[39] = 0x01; // in-capsule data
        sqe[40..44].copy_from_slice(&(u32::from(qid) << 16).to_le_bytes());
        sqe[44..48].copy_from_slice(&31u32.to_le_bytes());
        sqe[48..52].copy_from_slice(&kato_ms.to_le_bytes());
        let mut d = vec![0u8; 1024];
        d[16..18].copy_from_slice(&cntlid.to_le_bytes());
        let nqn = lull_nvmf::subsystem_nqn(VOLUME);
        d[256..256 + nqn.len()].copy_from_slice(nqn.as_bytes());
        d[512..521].copy_from_slice(b"nqn.raw.1");
        self.command(sqe, &d)
    }

    fn enable(&mut self) {
        let mut sqe = [0u8; 64];
        sqe[0] = 0x7F;
        sqe[2] = 2;
        sqe[4] = 0x00; // Property Set
        sqe[44..48].copy_from_slice(&0x14u32.to_le_bytes()); // CC
        sqe[48..52].copy_from_slice(&1u32.to_le_bytes()); // EN
        assert_eq!(self.command(sqe, &[]).0, 0);
    }
}

#[test]
fn a_silent_host_is_torn_down_after_kato() {
    let (mut server, addr) = serve();
    let mut admin = RawHost::connect(addr);
    let (status, cntlid) = admin.fabrics_connect(0, 0xFFFF, 1000);
    assert_eq!(status, 0);
    admin.enable();
    let mut io = RawHost::connect(addr);
    assert_eq!(io.fabrics_connect(1, cntlid as u16, 0).0, 0);
    // Nothing more is sent: after about a second both queues close.
    for (what, sock) in [("admin", &mut admin.sock), ("I/O", &mut io.sock)] {
        let mut b = [0u8; 64];
        match sock.read(&mut b) {
            Ok(0) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            other => panic!("the {what} queue of a silent host stayed open: {other:?}"),
        }
    }
    server.assert_logged("keep-alive timeout");
    server.assert_logged("controller gone");
    server.assert_healthy();
}

#[test]
fn malformed_pdus_end_in_a_term_req_and_a_close() {
    let (mut server, addr) = serve();
    let icreq = pdu::encode(
        &Pdu::IcReq(IcReq {
            pfv: 0,
            hpda: 0,
            digests: Digests::default(),
            maxr2t: 0,
        }),
        Digests::default(),
    );
    let cases: [(&str, Vec<u8>); 4] = [
        ("garbage instead of ICReq", vec![0xAB; 200]),
        (
            "an unknown PDU type after ICReq",
            [&icreq[..], &[0x42, 0, 24, 0, 24, 0, 0, 0]].concat(),
        ),
        (
            "a PLEN of 1 GiB",
            [&icreq[..], &[4, 0, 72, 0, 0, 0, 0, 0x40]].concat(),
        ),
        (
            "a capsule with a short header",
            [&icreq[..], &[4, 0, 8, 0, 8, 0, 0, 0]].concat(),
        ),
    ];
    for (what, bytes) in cases {
        let mut sock = TcpStream::connect(addr).expect("connect");
        sock.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        sock.write_all(&bytes).expect("send");
        let types = read_until_closed(&mut sock);
        assert_eq!(
            types.last(),
            Some(&pdu::TYPE_C2H_TERM_REQ),
            "{what}: expected a C2HTermReq last, got PDU types {types:?}"
        );
    }
    // A host that connects and goes silent is closed after the deadline
    // only; one that vanishes mid-PDU leaves nothing behind.
    let mut sock = TcpStream::connect(addr).expect("connect");
    sock.write_all(&icreq[..64]).expect("send half an ICReq");
    drop(sock);
    std::thread::sleep(Duration::from_millis(200));
    server.assert_logged("transport error");
    server.assert_healthy();
}
