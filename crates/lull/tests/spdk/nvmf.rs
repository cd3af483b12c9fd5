//! The NVMe/TCP target proven by SPDK's own initiator: spdk_nvme_identify,
//! spdk_nvme_perf and spdk_dd against `lull serve --nvmf-listen` on
//! loopback, and malformed PDUs from a raw socket.
//!
//! The SPDK tools are prebuilt in `../shared/tools/spdk` beside the repo
//! (or where `LULL_SPDK_TOOLS` says). Where they are not, each test that
//! needs them prints a loud SKIP line and returns: a clean clone may be
//! tested without them. The malformed-PDU test needs nothing.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{
    self, pattern, require, state, tools, Kind, NbdClient, Replica, Scratch, Server, IO_TIMEOUT,
};
use lull_nvmf::pdu::{self, Digests, IcReq, Pdu};

const VOLUME: &str = "vol0";
const VOLUME_BYTES: u64 = 64 << 20;

/// SPDK's tools these tests run, or `None` (with a SKIP line) when absent.
fn spdk_tools(test: &str) -> Option<PathBuf> {
    tools::spdk_tools(test, &["spdk_nvme_identify", "spdk_nvme_perf", "spdk_dd"])
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
    trid_of(addr, &lull_nvmf::subsystem_nqn(VOLUME))
}

/// The SPDK transport id of subsystem `nqn` at `addr`.
fn trid_of(addr: SocketAddr, nqn: &str) -> String {
    format!(
        "trtype:TCP adrfam:IPv4 traddr:{} trsvcid:{} subnqn:{nqn}",
        addr.ip(),
        addr.port(),
    )
}

/// Run an SPDK tool; (whether it exited 0, its stdout and stderr).
pub(crate) fn spdk_run(tools: &Path, bin: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(tools.join("bin").join(bin))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {bin}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Run an SPDK tool; panics with its output unless it exits 0.
fn spdk(tools: &Path, bin: &str, args: &[&str]) -> String {
    let (ok, text) = spdk_run(tools, bin, args);
    assert!(ok, "{bin} {args:?} failed:\n{text}");
    text
}

#[test]
fn spdk_identify_sees_the_controller_and_the_volume() {
    let Some(tools) = spdk_tools("spdk_identify_sees_the_controller_and_the_volume") else {
        return;
    };
    let _one = tools::spdk_alone();
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
    // spdk_nvme_identify has exited: the target closed its queues.
    state::wait_no_connections(addr.port(), IO_TIMEOUT);
}

/// NVMe/TCP I/O queues count against the volume's connection cap
/// (`--max-connections-per-volume`) as NBD connections do: with the one
/// place held by an NBD client, perf's I/O queue Connect is refused
/// (Controller Busy, with a log line) while the admin queue still
/// identifies; once the NBD client goes, perf runs.
#[test]
fn io_queues_count_against_the_per_volume_connection_cap() {
    let Some(tools) = spdk_tools("io_queues_count_against_the_per_volume_connection_cap") else {
        return;
    };
    let _one = tools::spdk_alone();
    let mut server = Server::start(&[
        "--volume",
        &format!("{VOLUME}:64M"),
        "--nvmf-listen",
        "127.0.0.1:0",
        "--max-connections-per-volume",
        "1",
    ]);
    let addr = server.nvmf_addr().expect("NVMe/TCP address");
    let nbd = NbdClient::connect(server.addr(), VOLUME).expect("the NBD client takes the place");
    let args = perf_args(&trid(addr), "randread", 1, 4096, 1, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (ok, out) = spdk_run(&tools, "spdk_nvme_perf", &args);
    assert!(
        !ok && !out.lines().any(|l| l.starts_with("Total")),
        "perf ran past the volume's connection cap:\n{out}"
    );
    // Connect Controller Busy: SCT 1h, SC 81h (129).
    assert!(out.contains("sct 1, sc 129"), "{out}");
    let id = spdk(
        &tools,
        "spdk_nvme_identify",
        &["--no-huge", "-d", "256", "-r", &trid(addr)],
    );
    assert!(id.contains("Namespace ID:1"), "identify:\n{id}");
    nbd.disconnect();
    // The place is free once the volume counts no connection.
    common::wait_until(IO_TIMEOUT, || {
        server.rpc("volume_get_stats", &format!(r#"{{"name":"{VOLUME}"}}"#))["connections"] == 0
    });
    let total = perf(&tools, addr, "randread", 1, 4096, &[]);
    eprintln!("lull nvmf randread QD1 once the place was free: {total}");
    server.assert_healthy();
}

#[test]
fn spdk_identify_reads_the_discovery_log() {
    let Some(tools) = spdk_tools("spdk_identify_reads_the_discovery_log") else {
        return;
    };
    let _one = tools::spdk_alone();
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

/// One spdk_nvme_perf run of 2 s on the default volume; returns its
/// "Total" line.
fn perf(
    tools: &Path,
    addr: SocketAddr,
    workload: &str,
    qd: u32,
    io_bytes: u32,
    extra: &[&str],
) -> String {
    perf_on(tools, &trid(addr), workload, qd, io_bytes, 2, extra)
}

/// One spdk_nvme_perf run of `seconds` against `tr`; fails on any error
/// line or no I/O; returns its "Total" line.
fn perf_on(
    tools: &Path,
    tr: &str,
    workload: &str,
    qd: u32,
    io_bytes: u32,
    seconds: u32,
    extra: &[&str],
) -> String {
    let args = perf_args(tr, workload, qd, io_bytes, seconds, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = spdk(tools, "spdk_nvme_perf", &args);
    check_perf(&out, &format!("{workload} QD{qd}"))
}

pub(crate) fn perf_args(
    tr: &str,
    workload: &str,
    qd: u32,
    io_bytes: u32,
    seconds: u32,
    extra: &[&str],
) -> Vec<String> {
    let mut args: Vec<String> = [
        "--no-huge",
        "-s",
        "256",
        "-c",
        "0x1",
        "-q",
        &qd.to_string(),
        "-o",
        &io_bytes.to_string(),
        "-w",
        workload,
        "-t",
        &seconds.to_string(),
        "-r",
        tr,
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// perf's output had no error and did I/O; its "Total" line.
pub(crate) fn check_perf(out: &str, what: &str) -> String {
    // perf's only error line on success is its I/O queue's "CQ transport
    // error -6" as it disconnects (SPDK's nvmf_tgt gets the same).
    for line in out.lines() {
        let l = line.to_ascii_lowercase();
        assert!(
            !(l.contains("fail") || (l.contains("error") && !l.contains("cq transport error -6"))),
            "perf {what} reported: {line}\n{out}"
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
    assert!(iops > 0.0, "perf {what} did no I/O: {total}");
    total
}

#[test]
fn spdk_perf_randwrite_then_randread_at_qd1_and_qd32() {
    let Some(tools) = spdk_tools("spdk_perf_randwrite_then_randread_at_qd1_and_qd32") else {
        return;
    };
    let _one = tools::spdk_alone();
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

/// An spdk_dd JSON config attaching subsystem `nqn` at `addr` as bdev
/// `N0` (its namespace is `N0n1`).
fn dd_config(dir: &Path, addr: SocketAddr, nqn: &str) -> PathBuf {
    dd_config_digests(dir, addr, nqn, Digests::default())
}

/// The digest settings the splice and sendfile tests run under: a label,
/// the digests spdk_dd's config asks for, and spdk_nvme_perf's flags for
/// the same.
fn digest_cases() -> [(&'static str, Digests, &'static [&'static str]); 3] {
    [
        ("no digest", Digests::default(), &[]),
        (
            "header digest",
            Digests {
                header: true,
                data: false,
            },
            &["-H"],
        ),
        (
            "header and data digests",
            Digests {
                header: true,
                data: true,
            },
            &["-H", "-I"],
        ),
    ]
}

/// [`dd_config`] with the header and data digests SPDK's initiator asks
/// for in its ICReq (`hdgst`, `ddgst`).
fn dd_config_digests(dir: &Path, addr: SocketAddr, nqn: &str, dg: Digests) -> PathBuf {
    let config = dir.join(format!("dd-{}.json", nqn.replace(':', "_")));
    std::fs::write(
        &config,
        format!(
            r#"{{"subsystems":[{{"subsystem":"bdev","config":[{{"method":"bdev_nvme_attach_controller",
 "params":{{"name":"N0","trtype":"tcp","adrfam":"IPv4","traddr":"{}","trsvcid":"{}",
 "subnqn":"{nqn}","hdgst":{},"ddgst":{}}}}}]}}]}}"#,
            addr.ip(),
            addr.port(),
            dg.header,
            dg.data,
        ),
    )
    .expect("write the dd config");
    config
}

/// spdk_dd: the file `input` onto the namespace from offset 0, in
/// requests of `bs` bytes.
fn dd_write(tools: &Path, config: &Path, input: &Path, bs: u32) {
    spdk(
        tools,
        "spdk_dd",
        &[
            "--no-huge",
            "-s",
            "1024",
            "--json",
            config.to_str().unwrap(),
            "--if",
            input.to_str().unwrap(),
            "--ob",
            "N0n1",
            "--bs",
            &bs.to_string(),
        ],
    );
}

/// spdk_dd: `bytes` from offset 0 of the namespace, in requests of `bs`.
fn dd_read(tools: &Path, config: &Path, output: &Path, bs: u32, bytes: usize) -> Vec<u8> {
    spdk(
        tools,
        "spdk_dd",
        &[
            "--no-huge",
            "-s",
            "1024",
            "--json",
            config.to_str().unwrap(),
            "--ib",
            "N0n1",
            "--of",
            output.to_str().unwrap(),
            "--bs",
            &bs.to_string(),
            "--count",
            &(bytes / bs as usize).to_string(),
        ],
    );
    std::fs::read(output).expect("read the dd output")
}

/// `bytes` of a pattern written through SPDK's initiator in `write_bs`
/// requests read back byte-identical in `read_bs` requests.
fn dd_round_trip(
    tools: &Path,
    dir: &Path,
    addr: SocketAddr,
    nqn: &str,
    seed: u64,
    bytes: usize,
    bs: (u32, u32),
) {
    dd_round_trip_digests(tools, dir, addr, nqn, Digests::default(), seed, bytes, bs);
}

/// [`dd_round_trip`] on a queue pair with the digests `dg`.
#[allow(clippy::too_many_arguments)]
fn dd_round_trip_digests(
    tools: &Path,
    dir: &Path,
    addr: SocketAddr,
    nqn: &str,
    dg: Digests,
    seed: u64,
    bytes: usize,
    (write_bs, read_bs): (u32, u32),
) {
    let config = dd_config_digests(dir, addr, nqn, dg);
    let input = dir.join("in.bin");
    let output = dir.join("out.bin");
    let data = pattern(seed, bytes);
    std::fs::write(&input, &data).expect("write the input");
    dd_write(tools, &config, &input, write_bs);
    let back = dd_read(tools, &config, &output, read_bs, bytes);
    assert_eq!(back.len(), data.len(), "{nqn}");
    assert!(
        back == data,
        "{nqn} ({dg:?}): spdk_dd read back (bs {read_bs}) other bytes than it wrote (bs {write_bs})"
    );
}

/// Lent reads (issue 33, docs/PER_IO.md): spdk_dd writes a pattern to a
/// memory volume and reads it back byte-identical in 4 KiB and 128 KiB
/// requests, without and then with header and data digests (the data
/// digest is computed over the lent bytes: a wrong one fails SPDK's
/// read); the volume's `lent_reads` counts the lent reads of each round.
#[test]
fn lent_reads_round_trip_with_and_without_digests() {
    let Some(tools) = spdk_tools("lent_reads_round_trip_with_and_without_digests") else {
        return;
    };
    let _one = tools::spdk_alone();
    let (mut server, addr) = serve();
    let dir = server.dir().clone();
    let nqn = lull_nvmf::subsystem_nqn(VOLUME);
    let lent_reads = |server: &Server| {
        server.rpc("volume_get_stats", &format!(r#"{{"name":"{VOLUME}"}}"#))["lent_reads"]
            .as_u64()
            .expect("lent_reads")
    };
    for (round, digests) in [false, true].into_iter().enumerate() {
        let dg = Digests {
            header: digests,
            data: digests,
        };
        let config = dd_config_digests(&dir, addr, &nqn, dg);
        let input = dir.join("lent-in.bin");
        let output = dir.join("lent-out.bin");
        let data = pattern(0x1e47 + round as u64, 8 << 20);
        std::fs::write(&input, &data).expect("write the input");
        dd_write(&tools, &config, &input, 131072);
        for bs in [4096, 131072] {
            let before = lent_reads(&server);
            let back = dd_read(&tools, &config, &output, bs, data.len());
            let after = lent_reads(&server);
            eprintln!("digests {digests}, bs {bs}: {} reads lent", after - before);
            assert!(
                back == data,
                "spdk_dd (digests {digests}, bs {bs}) read back other bytes than it wrote"
            );
            assert!(
                after > before,
                "the reads were lent (digests {digests}, bs {bs})"
            );
        }
    }
    server.assert_healthy();
}

#[test]
fn spdk_dd_round_trip_is_byte_identical_and_nbd_agrees() {
    let Some(tools) = spdk_tools("spdk_dd_round_trip_is_byte_identical_and_nbd_agrees") else {
        return;
    };
    require("qemu-io", "qemu-utils");
    require("nbdcopy", "libnbd-bin");
    let _one = tools::spdk_alone();
    let (mut server, addr) = serve();
    let dir = server.dir().clone();
    let config = dd_config(&dir, addr, &lull_nvmf::subsystem_nqn(VOLUME));
    let input = dir.join("in.bin");
    let output = dir.join("out.bin");
    let data = pattern(0x5eed, 16 << 20);
    std::fs::write(&input, &data).expect("write the input");
    dd_write(&tools, &config, &input, 131072);
    // The same volume over NBD at once, with real NBD clients: nbdcopy
    // reads what NVMe/TCP wrote, and what qemu-io writes is what NVMe/TCP
    // then reads.
    let uri = format!("nbd://{}/{VOLUME}", server.addr());
    let copy = dir.join("nbd.bin");
    let out = Command::new("nbdcopy")
        .args([&uri, copy.to_str().unwrap()])
        .output()
        .expect("run nbdcopy");
    assert!(out.status.success(), "nbdcopy: {out:?}");
    let over_nbd = std::fs::read(&copy).expect("read the nbdcopy output");
    assert_eq!(over_nbd.len() as u64, VOLUME_BYTES);
    assert!(
        over_nbd[..data.len()] == data[..],
        "NBD reads other bytes than NVMe/TCP wrote"
    );
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0xab 4M 1M", &uri])
        .output()
        .expect("run qemu-io");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("error") && !text.contains("fail"),
        "qemu-io: {out:?}"
    );
    let mut expect = data.clone();
    expect[4 << 20..5 << 20].fill(0xab);
    // NBD and NVMe/TCP interleaved on the volume over the same live
    // server, both ways, with the in-process NBD client too.
    let mut nbd = NbdClient::connect(server.addr(), VOLUME).expect("NBD connect");
    let over = pattern(0xb0b, 1 << 20);
    assert_eq!(nbd.write(8 << 20, &over).expect("NBD write"), 0);
    expect[8 << 20..9 << 20].copy_from_slice(&over);
    drop(nbd);
    let back = dd_read(&tools, &config, &output, 131072, expect.len());
    assert_eq!(back.len(), expect.len());
    assert!(
        back == expect,
        "spdk_dd read back other bytes than NVMe/TCP and NBD wrote"
    );
    server.assert_healthy();
}

#[test]
fn file_and_two_replica_volumes_round_trip_and_take_perf_load() {
    let Some(tools) = spdk_tools("file_and_two_replica_volumes_round_trip_and_take_perf_load")
    else {
        return;
    };
    let _one = tools::spdk_alone();
    let scratch = Scratch::new("nvmf-file-repl");
    let (ra, rb) = (
        Replica::start(Kind::Process, &scratch.join("a"), "32M"),
        Replica::start(Kind::Process, &scratch.join("b"), "32M"),
    );
    let file = scratch.join("f.img");
    let mut server = Server::start(&[
        "--replica-insecure",
        "--volume",
        &format!("f:32M:file={}", file.display()),
        "--volume",
        &format!("r:32M:replicas={}+{}", ra.target(), rb.target()),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    for (i, v) in ["f", "r"].into_iter().enumerate() {
        let nqn = lull_nvmf::subsystem_nqn(v);
        let tr = trid_of(addr, &nqn);
        // 4 KiB and 128 KiB (writes through R2T), each at QD1 and QD32.
        for (workload, qd, bytes, extra) in [
            ("randwrite", 1, 4096, &[][..]),
            ("randread", 32, 4096, &[][..]),
            ("randrw", 1, 131072, &["-M", "50"][..]),
            ("randrw", 32, 131072, &["-M", "50"][..]),
        ] {
            let total = perf_on(&tools, &tr, workload, qd, bytes, 1, extra);
            eprintln!("lull nvmf {v} {workload} {bytes} QD{qd}: {total}");
        }
        // Data: 128 KiB writes read back in 4 KiB reads, byte for byte.
        dd_round_trip(
            &tools,
            server.dir(),
            addr,
            &nqn,
            0xf11e + i as u64,
            8 << 20,
            (131072, 4096),
        );
    }
    server.assert_healthy();
    drop(server);
    // The replicas agree byte for byte with what was written: both hold
    // the same image (the server detached cleanly at stop).
    let image = |r: &Replica| std::fs::read(r.data_file()).expect("replica image");
    let (a, b) = (image(&ra), image(&rb));
    assert!(a == b, "the two replicas differ");
    assert!(
        a[..8 << 20] == pattern(0xf11e + 1, 8 << 20)[..],
        "the replicas do not hold what spdk_dd wrote"
    );
}

#[test]
fn a_4k_lba_volume_is_identified_and_round_trips() {
    let Some(tools) = spdk_tools("a_4k_lba_volume_is_identified_and_round_trips") else {
        return;
    };
    let _one = tools::spdk_alone();
    let mut server = Server::start(&[
        "--volume",
        "v4k:16M",
        "--nvmf-lba",
        "v4k=4096",
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    let nqn = lull_nvmf::subsystem_nqn("v4k");
    let out = spdk(
        &tools,
        "spdk_nvme_identify",
        &["--no-huge", "-d", "256", "-r", &trid_of(addr, &nqn)],
    );
    for want in [
        format!(
            "Size (in LBAs):                        {} ",
            (16u64 << 20) / 4096
        ),
        "LBA Format #00: Data Size:  4096".to_string(),
        "Current LBA Format:                    LBA Format #00".to_string(),
    ] {
        assert!(out.contains(&want), "identify lacks {want:?}:\n{out}");
    }
    dd_round_trip(
        &tools,
        server.dir(),
        addr,
        &nqn,
        0x4000,
        4 << 20,
        (4096, 131072),
    );
    // NBD is unaffected: it sees the volume's bytes as NVMe/TCP wrote
    // them, at any 512-byte offset.
    let mut nbd = NbdClient::connect(server.addr(), "v4k").expect("NBD connect");
    let head = nbd.read(512, 8192).expect("NBD read").expect("NBD status");
    assert!(
        head == pattern(0x4000, 8704)[512..],
        "NBD reads other bytes"
    );
    drop(nbd);
    let total = perf_on(
        &tools,
        &trid_of(addr, &nqn),
        "randrw",
        32,
        4096,
        1,
        &["-M", "50"],
    );
    eprintln!("lull nvmf 4k-LBA randrw 4k QD32: {total}");
    server.assert_healthy();
}

#[test]
fn four_io_queues_and_two_hosts_at_once() {
    let Some(tools) = spdk_tools("four_io_queues_and_two_hosts_at_once") else {
        return;
    };
    let _one = tools::spdk_alone();
    let (mut server, addr) = serve();
    // Two hosts (two perf processes with their own host NQNs and shared
    // memory groups), one with four I/O queues, at the same time.
    let spawn = |host: &str, shm: &str, extra: &[&str]| {
        let tr = format!("{} hostnqn:{host}", trid(addr));
        let mut args = perf_args(&tr, "randrw", 16, 4096, 2, &["-M", "50", "-i", shm]);
        args.extend(extra.iter().map(|a| a.to_string()));
        Command::new(tools.join("bin/spdk_nvme_perf"))
            .args(&args)
            .output()
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| spawn("nqn.2026-11.test:host-a", "1", &["-P", "4"]));
        let b = s.spawn(|| spawn("nqn.2026-11.test:host-b", "2", &[]));
        (a.join().expect("host a"), b.join().expect("host b"))
    });
    for (name, out) in [("a", a), ("b", b)] {
        let out = out.expect("run spdk_nvme_perf");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "host {name}: perf failed:\n{text}");
        let total = check_perf(&text, "randrw QD16");
        eprintln!("lull nvmf host {name}: {total}");
    }
    let log = server.stderr();
    for host in ["host-a", "host-b"] {
        assert!(log.contains(host), "no queue of {host} connected:\n{log}");
    }
    // Host a's controller had four I/O queues (qid 1..=4).
    let a_queues = log
        .lines()
        .filter(|l| l.contains("queue connected") && l.contains("host-a") && !l.contains("qid=0"))
        .count();
    assert_eq!(a_queues, 4, "host a's I/O queues:\n{log}");
    server.assert_healthy();
}

#[test]
fn every_mode_serves_spdk_perf() {
    let Some(tools) = spdk_tools("every_mode_serves_spdk_perf") else {
        return;
    };
    let _one = tools::spdk_alone();
    for mode in ["poll", "interrupt", "hybrid", "adaptive"] {
        let mut server = Server::start(&[
            "--mode",
            mode,
            "--volume",
            &format!("{VOLUME}:16M"),
            "--nvmf-listen",
            "127.0.0.1:0",
        ]);
        let addr = server.nvmf_addr().expect("the NVMe/TCP address");
        for qd in [1, 32] {
            let total = perf_on(&tools, &trid(addr), "randrw", qd, 4096, 1, &["-M", "50"]);
            eprintln!("lull nvmf {mode} randrw 4k QD{qd}: {total}");
        }
        server.assert_healthy();
    }
}

#[test]
fn a_host_not_on_the_allowlist_is_refused() {
    let Some(tools) = spdk_tools("a_host_not_on_the_allowlist_is_refused") else {
        return;
    };
    let _one = tools::spdk_alone();
    let nqn = "nqn.2026-11.test:guarded";
    let good = "nqn.2026-11.test:good-host";
    let mut server = Server::start(&[
        "--volume",
        &format!("{VOLUME}:16M"),
        "--nvmf-nqn",
        &format!("{VOLUME}={nqn}"),
        "--nvmf-allow-host",
        &format!("{VOLUME}={good}"),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    let tr = trid_of(addr, nqn);
    // SPDK's default host NQN is not on the list: perf cannot attach.
    let args = perf_args(&tr, "randread", 1, 4096, 1, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // (perf exits 0 even when it attached nothing: its output says.)
    let (_, out) = spdk_run(&tools, "spdk_nvme_perf", &args);
    assert!(
        out.contains("No valid NVMe controllers found") && !out.contains("Total"),
        "a host not on the allowlist attached:\n{out}"
    );
    // Connect Invalid Host: SCT 1h, SC 84h (132).
    assert!(out.contains("sct 1, sc 132"), "{out}");
    // The allowed host attaches and does I/O under the configured NQN.
    let total = perf_on(
        &tools,
        &format!("{tr} hostnqn:{good}"),
        "randread",
        1,
        4096,
        1,
        &[],
    );
    eprintln!("lull nvmf allowed host: {total}");
    server.assert_healthy();
}

/// A volume created over JSON-RPC with nvmf_nqn, nvmf_lba=4096 and
/// nvmf_allow_hosts is served with them (spdk_nvme_identify); bad
/// options are refused with a message; deleting the volume forgets them,
/// so one created again under its name gets the defaults.
#[test]
fn an_rpc_created_volume_is_served_with_its_nvmf_options() {
    let Some(tools) = spdk_tools("an_rpc_created_volume_is_served_with_its_nvmf_options") else {
        return;
    };
    let _one = tools::spdk_alone();
    let mut server = Server::start(&[
        "--volume",
        &format!("{VOLUME}:16M"),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let sock = server.rpc_socket().to_path_buf();
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    let rpc = |method: &str, params: &str| common::rpc_outcome(&sock, method, params);
    let nqn = "nqn.2026-11.test:r4k";
    let good = "nqn.2026-11.test:good-host";
    for (params, why) in [
        (
            format!(
                r#"{{"name": "r4k", "size": "16M", "nvmf_nqn": "{}"}}"#,
                lull_nvmf::subsystem_nqn(VOLUME)
            ),
            "already served",
        ),
        (
            r#"{"name": "r4k", "size": 16777728, "nvmf_lba": 4096}"#.to_string(),
            "not a multiple",
        ),
        (
            r#"{"name": "r4k", "size": "16M", "nvmf_nqn": "iqn.2026-11.test:x"}"#.to_string(),
            "NQN",
        ),
        (
            r#"{"name": "r4k", "size": "16M", "nvmf_allow_hosts": ["host"]}"#.to_string(),
            "allowed host",
        ),
        (
            r#"{"name": "r4k", "size": "16M", "nvmf_lba": 1024}"#.to_string(),
            "512 or 4096",
        ),
    ] {
        let (ok, out) = rpc("volume_create", &params);
        assert!(!ok && out.contains(why), "{params}: {out}");
    }
    let (ok, out) = rpc(
        "volume_create",
        &format!(r#"{{"name": "r4k", "size": "16M", "nvmf_nqn": "{nqn}", "nvmf_lba": 4096}}"#),
    );
    assert!(ok, "volume_create: {out}");
    let identify = |tr: &str| {
        spdk_run(
            &tools,
            "spdk_nvme_identify",
            &["--no-huge", "-d", "256", "-r", tr],
        )
    };
    let (ok, out) = identify(&trid_of(addr, nqn));
    assert!(ok, "identify:\n{out}");
    for want in [
        format!("Subsystem NQN:                         {nqn}"),
        format!(
            "Size (in LBAs):                        {} ",
            (16u64 << 20) / 4096
        ),
        "LBA Format #00: Data Size:  4096".to_string(),
    ] {
        assert!(out.contains(&want), "identify lacks {want:?}:\n{out}");
    }
    // An allowlist: spdk_nvme_identify takes no host NQN (it makes up
    // one), so perf, which does, attaches as each host.
    let guarded = "nqn.2026-11.test:guarded";
    let (ok, out) = rpc(
        "volume_create",
        &format!(
            r#"{{"name": "guarded", "size": "16M", "nvmf_nqn": "{guarded}", "nvmf_allow_hosts": ["{good}"]}}"#
        ),
    );
    assert!(ok, "volume_create: {out}");
    let tr = trid_of(addr, guarded);
    let args = perf_args(&tr, "randread", 1, 4096, 1, &[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_, out) = spdk_run(&tools, "spdk_nvme_perf", &args);
    assert!(
        out.contains("No valid NVMe controllers found") && !out.contains("Total"),
        "a host not on the allowlist attached:\n{out}"
    );
    // Connect Invalid Host: SCT 1h, SC 84h (132).
    assert!(out.contains("sct 1, sc 132"), "{out}");
    let total = perf_on(
        &tools,
        &format!("{tr} hostnqn:{good}"),
        "randread",
        1,
        4096,
        1,
        &[],
    );
    eprintln!("lull nvmf RPC-created allowlisted volume: {total}");

    // Deleted and created again without options: the defaults.
    let (ok, out) = rpc("volume_delete", r#"{"name": "r4k"}"#);
    assert!(ok, "volume_delete: {out}");
    let (ok, out) = rpc("volume_create", r#"{"name": "r4k", "size": "16M"}"#);
    assert!(ok, "volume_create again: {out}");
    let (ok, out) = identify(&trid_of(addr, &lull_nvmf::subsystem_nqn("r4k")));
    assert!(ok, "identify the default NQN:\n{out}");
    for want in [
        format!(
            "Size (in LBAs):                        {} ",
            (16u64 << 20) / 512
        ),
        "LBA Format #00: Data Size:   512".to_string(),
    ] {
        assert!(out.contains(&want), "identify lacks {want:?}:\n{out}");
    }
    let (_, out) = identify(&format!("{} hostnqn:{good}", trid_of(addr, nqn)));
    assert!(
        !out.contains("Size (in LBAs)"),
        "the forgotten NQN still serves:\n{out}"
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
        self.fabrics_connect_cattr(qid, cntlid, kato_ms, 0)
    }

    /// [`RawHost::fabrics_connect`] with Connect attributes (CATTR).
    fn fabrics_connect_cattr(
        &mut self,
        qid: u16,
        cntlid: u16,
        kato_ms: u32,
        cattr: u32,
    ) -> (u16, u32) {
        let mut sqe = [0u8; 64];
        sqe[0] = 0x7F;
        sqe[2] = 1;
        sqe[4] = 0x01;
        sqe[32..36].copy_from_slice(&1024u32.to_le_bytes());
        sqe[39] = 0x01; // in-capsule data
        sqe[40..44].copy_from_slice(&(u32::from(qid) << 16).to_le_bytes());
        sqe[44..48].copy_from_slice(&(31u32 | (cattr << 16)).to_le_bytes());
        sqe[48..52].copy_from_slice(&kato_ms.to_le_bytes());
        let mut d = vec![0u8; 1024];
        d[16..18].copy_from_slice(&cntlid.to_le_bytes());
        let nqn = lull_nvmf::subsystem_nqn(VOLUME);
        d[256..256 + nqn.len()].copy_from_slice(nqn.as_bytes());
        d[512..521].copy_from_slice(b"nqn.raw.1");
        self.command(sqe, &d)
    }

    /// Send a command that reads `len` bytes (transport SGL) and read
    /// the C2HData PDU and the CapsuleResp: (status field, data).
    fn read_command(&mut self, mut sqe: [u8; 64], len: u32) -> (u16, Vec<u8>) {
        sqe[32..36].copy_from_slice(&len.to_le_bytes());
        sqe[39] = 0x5A; // transport SGL data block
        let bytes = pdu::encode(&Pdu::CapsuleCmd { sqe, data: &[] }, Digests::default());
        self.sock.write_all(&bytes).expect("send a command");
        let mut head = [0u8; 24];
        self.sock.read_exact(&mut head).expect("a response");
        if head[0] == pdu::TYPE_CAPSULE_RESP {
            return (u16::from_le_bytes([head[22], head[23]]), Vec::new());
        }
        assert_eq!(head[0], pdu::TYPE_C2H_DATA);
        let mut data = vec![0u8; len as usize];
        self.sock.read_exact(&mut data).expect("the data");
        let mut resp = [0u8; 24];
        self.sock.read_exact(&mut resp).expect("CapsuleResp");
        assert_eq!(resp[0], pdu::TYPE_CAPSULE_RESP);
        (u16::from_le_bytes([resp[22], resp[23]]), data)
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
    // Why: nothing but the log says so (the host sees a close).
    server.assert_logged(&["keep-alive timeout"]);
    state::wait_no_connections(addr.port(), IO_TIMEOUT);
    server.assert_healthy();
}

/// A plain SQE: opcode, CID, NSID and dwords 10.. as given.
fn raw_sqe(opc: u8, cid: u16, nsid: u32, dwords: &[(usize, u32)]) -> [u8; 64] {
    let mut s = [0u8; 64];
    s[0] = opc;
    s[2..4].copy_from_slice(&cid.to_le_bytes());
    s[4..8].copy_from_slice(&nsid.to_le_bytes());
    for &(i, v) in dwords {
        s[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
    }
    s
}

/// No SPDK tool holds an Asynchronous Event Request open while a volume
/// changes, so a raw host does, over the real binary: the volume deleted
/// over JSON-RPC completes it (the admin queue sleeps in interrupt mode
/// until the event wakes it), log page 04h names namespace 1, and the
/// host's I/O gets Invalid Namespace.
#[test]
fn a_volume_deleted_over_rpc_completes_the_async_event_request() {
    let mut server = Server::start(&[
        "--mode",
        "interrupt",
        "--volume",
        &format!("{VOLUME}:16M"),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let sock = server.rpc_socket().to_path_buf();
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    let mut admin = RawHost::connect(addr);
    let (status, cntlid) = admin.fabrics_connect(0, 0xFFFF, 0);
    assert_eq!(status, 0);
    admin.enable();
    let mut io = RawHost::connect(addr);
    assert_eq!(io.fabrics_connect(1, cntlid as u16, 0).0, 0);
    // Set Features, Asynchronous Event Configuration: namespace attribute
    // notices; then one AER, held.
    let aec = raw_sqe(0x09, 3, 0, &[(10, 0x0B), (11, 1 << 8)]);
    assert_eq!(admin.command(aec, &[]).0, 0);
    let aer = pdu::encode(
        &Pdu::CapsuleCmd {
            sqe: raw_sqe(0x0C, 7, 0, &[]),
            data: &[],
        },
        Digests::default(),
    );
    admin.sock.write_all(&aer).expect("send the AER");

    let (ok, out) = common::rpc_outcome(
        &sock,
        "volume_delete",
        &format!(r#"{{"name": "{VOLUME}"}}"#),
    );
    assert!(ok, "volume_delete: {out}");

    let mut resp = [0u8; 24];
    admin
        .sock
        .read_exact(&mut resp)
        .expect("the AER completes when the volume is deleted");
    assert_eq!(resp[0], pdu::TYPE_CAPSULE_RESP);
    assert_eq!(u16::from_le_bytes([resp[20], resp[21]]), 7, "the AER's CID");
    assert_eq!(u16::from_le_bytes([resp[22], resp[23]]), 0, "success");
    // Notice (2), Namespace Attribute Changed (0), log page 04h.
    assert_eq!(
        u32::from_le_bytes(resp[8..12].try_into().unwrap()),
        0x0004_0002
    );
    // Get Log Page 04h (1 KiB): namespace 1, then nothing.
    let mut glp = raw_sqe(0x02, 8, 0xFFFF_FFFF, &[(10, (255 << 16) | 0x04)]);
    glp[32..36].copy_from_slice(&1024u32.to_le_bytes());
    glp[39] = 0x5A; // transport SGL data block
    let bytes = pdu::encode(
        &Pdu::CapsuleCmd {
            sqe: glp,
            data: &[],
        },
        Digests::default(),
    );
    admin.sock.write_all(&bytes).expect("send Get Log Page");
    let mut page = vec![0u8; 24 + 1024 + 24];
    admin.sock.read_exact(&mut page).expect("the log page");
    assert_eq!(page[0], pdu::TYPE_C2H_DATA);
    assert_eq!(u32::from_le_bytes(page[24..28].try_into().unwrap()), 1);
    assert!(page[28..24 + 1024].iter().all(|&b| b == 0));
    assert_eq!(page[24 + 1024], pdu::TYPE_CAPSULE_RESP);
    // I/O to the deleted namespace: Invalid Namespace, the queue stays.
    let mut read = raw_sqe(0x02, 9, 1, &[]);
    read[32..36].copy_from_slice(&512u32.to_le_bytes());
    read[39] = 0x5A;
    assert_eq!(
        io.command(read, &[]).0,
        lull_nvmf::spec::Status::INVALID_NAMESPACE.field()
    );
    server.assert_healthy();
}

/// A volume grown over JSON-RPC while a host is connected: the host's
/// held Asynchronous Event Request completes (namespace attribute
/// changed), log page 04h names namespace 1, Identify Namespace reports
/// the new NSZE/NCAP/NUSE, and the I/O queue connected before the grow
/// writes and reads across the old end. SPDK's tools hold no AER open,
/// so that part is a raw host, as for delete; then SPDK's initiator, on
/// new connections, identifies the new size and copies data across the
/// old end with spdk_dd, and NBD reads the same bytes.
#[test]
fn a_volume_grown_over_rpc_is_seen_by_connected_and_new_hosts() {
    const OLD_BYTES: u64 = 16 << 20;
    const NEW_BYTES: u64 = 40 << 20;
    let mut server = Server::start(&[
        "--mode",
        "interrupt",
        "--volume",
        &format!("{VOLUME}:16M"),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let sock = server.rpc_socket().to_path_buf();
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    let mut admin = RawHost::connect(addr);
    let (status, cntlid) = admin.fabrics_connect(0, 0xFFFF, 0);
    assert_eq!(status, 0);
    admin.enable();
    let mut io = RawHost::connect(addr);
    assert_eq!(io.fabrics_connect(1, cntlid as u16, 0).0, 0);
    let aec = raw_sqe(0x09, 3, 0, &[(10, 0x0B), (11, 1 << 8)]);
    assert_eq!(admin.command(aec, &[]).0, 0);
    let old_blocks = OLD_BYTES / 512;
    let new_blocks = NEW_BYTES / 512;
    let nsze = |admin: &mut RawHost, cid| {
        let (status, id) = admin.read_command(raw_sqe(0x06, cid, 1, &[(10, 0)]), 4096);
        assert_eq!(status, 0, "Identify Namespace");
        [0, 8, 16].map(|at| u64::from_le_bytes(id[at..at + 8].try_into().unwrap()))
    };
    assert_eq!(nsze(&mut admin, 4), [old_blocks; 3]);
    // 8 KiB across the old end: out of range before the grow.
    let across = old_blocks - 8;
    let data = pattern(21, 8192);
    let write = raw_sqe(
        0x01,
        5,
        1,
        &[(10, across as u32), (11, (across >> 32) as u32), (12, 15)],
    );
    let mut write_in_capsule = write;
    write_in_capsule[32..36].copy_from_slice(&8192u32.to_le_bytes());
    write_in_capsule[39] = 0x01; // in-capsule data
    assert_eq!(
        io.command(write_in_capsule, &data).0,
        lull_nvmf::spec::Status::LBA_OUT_OF_RANGE.field()
    );
    let aer = pdu::encode(
        &Pdu::CapsuleCmd {
            sqe: raw_sqe(0x0C, 7, 0, &[]),
            data: &[],
        },
        Digests::default(),
    );
    admin.sock.write_all(&aer).expect("send the AER");

    let (ok, out) = common::rpc_outcome(
        &sock,
        "volume_resize",
        &format!(r#"{{"name": "{VOLUME}", "size": {NEW_BYTES}}}"#),
    );
    assert!(ok, "volume_resize: {out}");

    let mut resp = [0u8; 24];
    admin
        .sock
        .read_exact(&mut resp)
        .expect("the AER completes when the volume grows");
    assert_eq!(resp[0], pdu::TYPE_CAPSULE_RESP);
    assert_eq!(u16::from_le_bytes([resp[20], resp[21]]), 7, "the AER's CID");
    assert_eq!(u16::from_le_bytes([resp[22], resp[23]]), 0, "success");
    assert_eq!(
        u32::from_le_bytes(resp[8..12].try_into().unwrap()),
        0x0004_0002,
        "Notice, Namespace Attribute Changed, log page 04h"
    );
    let glp = raw_sqe(0x02, 8, 0xFFFF_FFFF, &[(10, (255 << 16) | 0x04)]);
    let (status, page) = admin.read_command(glp, 1024);
    assert_eq!(status, 0);
    assert_eq!(u32::from_le_bytes(page[..4].try_into().unwrap()), 1);
    assert!(page[4..].iter().all(|&b| b == 0));
    assert_eq!(nsze(&mut admin, 9), [new_blocks; 3]);
    // The I/O queue from before the grow: across the old end, the last
    // LBA, and not one past it.
    assert_eq!(io.command(write_in_capsule, &data).0, 0, "write across");
    let read = |lba: u64, cid| {
        raw_sqe(
            0x02,
            cid,
            1,
            &[(10, lba as u32), (11, (lba >> 32) as u32), (12, 15)],
        )
    };
    let (status, back) = io.read_command(read(across, 10), 8192);
    assert_eq!(status, 0);
    assert!(back == data, "read back across the old end");
    let (status, tail) = io.read_command(read(new_blocks - 16, 11), 8192);
    assert_eq!(status, 0);
    assert!(tail.iter().all(|&b| b == 0), "the new tail reads as zeros");
    let (status, _) = io.read_command(read(new_blocks - 15, 12), 8192);
    assert_eq!(status, lull_nvmf::spec::Status::LBA_OUT_OF_RANGE.field());

    // SPDK's initiator, new connections: identify, and spdk_dd across the
    // old end (1 MiB from 512 KiB before it); NBD reads the same bytes.
    let Some(tools) = spdk_tools("a_volume_grown_over_rpc_is_seen_by_connected_and_new_hosts (SPDK part; the raw-host part above ran)") else {
        server.assert_healthy();
        return;
    };
    let _one = tools::spdk_alone();
    let out = spdk(
        &tools,
        "spdk_nvme_identify",
        &["--no-huge", "-d", "256", "-r", &trid(addr)],
    );
    let want = format!("Size (in LBAs):                        {new_blocks} ");
    assert!(out.contains(&want), "identify lacks {want:?}:\n{out}");
    let dir = Scratch::new("grow");
    let config = dd_config(&dir, addr, &lull_nvmf::subsystem_nqn(VOLUME));
    let input = dir.join("in.bin");
    let output = dir.join("out.bin");
    let bytes = 1usize << 20;
    let bs = 128u64 << 10;
    let start = OLD_BYTES - (512 << 10);
    let seek = (start / bs).to_string();
    let block = pattern(22, bytes);
    std::fs::write(&input, &block).expect("write the input");
    let common_args = [
        "--no-huge",
        "-s",
        "1024",
        "--json",
        config.to_str().unwrap(),
    ];
    let mut args = common_args.to_vec();
    args.extend_from_slice(&["--if", input.to_str().unwrap(), "--ob", "N0n1", "--bs"]);
    let bs_text = bs.to_string();
    args.extend_from_slice(&[&bs_text, "--seek", &seek]);
    spdk(&tools, "spdk_dd", &args);
    let count = (bytes as u64 / bs).to_string();
    let mut args = common_args.to_vec();
    args.extend_from_slice(&["--ib", "N0n1", "--of", output.to_str().unwrap(), "--bs"]);
    args.extend_from_slice(&[&bs_text, "--skip", &seek, "--count", &count]);
    spdk(&tools, "spdk_dd", &args);
    let back = std::fs::read(&output).expect("read the dd output");
    assert!(
        back == block,
        "spdk_dd read back other bytes across the old end"
    );
    let mut nbd = NbdClient::connect(server.addr(), VOLUME).expect("NBD connect");
    assert_eq!(
        nbd.size_bytes, NEW_BYTES,
        "a new NBD connection sees the new size"
    );
    let seen = nbd
        .read(start + (256 << 10), 512 << 10)
        .expect("NBD read")
        .expect("NBD read ok");
    assert!(
        seen[..] == block[256 << 10..768 << 10],
        "NBD reads what SPDK wrote across the old end"
    );
    nbd.disconnect();
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
    state::wait_no_connections(addr.port(), IO_TIMEOUT);
    server.assert_healthy();
}

/// A volume's QoS limit holds over NVMe/TCP too: spdk_nvme_perf at QD32
/// on a volume limited to 2,000 IOPS measures at most 2,200 over 5 s, and
/// at least half the limit (its queue, held by the limit, waits for a
/// timed wake-up).
#[test]
fn a_qos_limit_holds_over_nvme_tcp() {
    let Some(tools) = spdk_tools("a_qos_limit_holds_over_nvme_tcp") else {
        return;
    };
    let (mut server, addr) = serve();
    server.rpc(
        "volume_set_qos",
        &format!(r#"{{"name":"{VOLUME}","rw_ios_per_sec":2000}}"#),
    );
    let total = perf_on(&tools, &trid(addr), "randread", 32, 4096, 5, &[]);
    let iops: f64 = total
        .split_whitespace()
        .nth(2)
        .and_then(|v| v.parse().ok())
        .expect("IOPS in the Total line");
    println!("limited to 2,000 IOPS over NVMe/TCP: {total}");
    // The limit is an upper bound: +10% at most. Below it, a loaded
    // machine slows the client too (a CI run with builds beside it
    // measured 1,730), so the floor only says the held queue is woken
    // and goes on (a queue never woken would do a handful in 5 s).
    assert!(
        (1000.0..=2200.0).contains(&iops),
        "2,000 IOPS: at most +10%, and the held queue going on: {total}"
    );
    let stats = server.rpc("volume_get_stats", &format!(r#"{{"name":"{VOLUME}"}}"#));
    assert!(
        stats["qos"]["throttled_requests"].as_u64().unwrap_or(0) > 0,
        "{stats}"
    );
    server.assert_healthy();
}

/// `snapshot_expose` (issue 28): a snapshot served as an NVMe/TCP
/// subsystem of its own, its namespace write protected: spdk_dd reads
/// the snapshot's bytes (not the volume's later writes) and a write
/// through SPDK's initiator fails; `snapshot_unexpose` takes it away.
#[test]
fn an_exposed_snapshot_is_a_read_only_namespace() {
    let Some(tools) = spdk_tools("an_exposed_snapshot_is_a_read_only_namespace") else {
        return;
    };
    let _one = tools::spdk_alone();
    let dir = Scratch::new("nvmf-snapshot");
    let (mut server, addr) = serve();
    tools::qemu_io(&server, VOLUME, &["write -P 0xa5 0 4M"]);
    server.rpc(
        "snapshot_create",
        &format!(r#"{{"volume":"{VOLUME}","name":"s1"}}"#),
    );
    tools::qemu_io(&server, VOLUME, &["write -P 0xb6 0 1M"]);
    let info = server.rpc(
        "snapshot_expose",
        &format!(r#"{{"volume":"{VOLUME}","name":"s1"}}"#),
    );
    let export = format!("{VOLUME}@s1");
    assert_eq!(info["name"], export.as_str(), "{info}");
    let nqn = lull_nvmf::subsystem_nqn(&export);
    let config = dd_config(&dir, addr, &nqn);
    let got = dd_read(&tools, &config, &dir.join("s1.bin"), 1 << 20, 4 << 20);
    assert!(
        got.iter().all(|&b| b == 0xa5),
        "the snapshot's bytes over NVMe/TCP"
    );
    let input = dir.join("in.bin");
    std::fs::write(&input, vec![0x11u8; 1 << 20]).expect("write the input");
    let (ok, out) = spdk_run(
        &tools,
        "spdk_dd",
        &[
            "--no-huge",
            "-s",
            "1024",
            "--json",
            config.to_str().unwrap(),
            "--if",
            input.to_str().unwrap(),
            "--ob",
            "N0n1",
            "--bs",
            "1048576",
        ],
    );
    // spdk_dd exits 0 although its writes fail (SPDK v26.05); the target
    // refused each one (counted as errors, no byte written).
    println!("spdk_dd to the snapshot: exit ok {ok}\n{out}");
    let stats = server.rpc("volume_get_stats", &format!(r#"{{"name":"{export}"}}"#));
    assert!(
        stats["errors"].as_u64().unwrap_or(0) > 0,
        "writes refused: {stats}"
    );
    assert_eq!(
        stats["errors"], stats["writes"],
        "every write refused: {stats}"
    );
    assert_eq!(stats["write_bytes"], 0, "no byte written: {stats}");
    let again = dd_read(&tools, &config, &dir.join("s1b.bin"), 1 << 20, 4 << 20);
    assert!(again == got, "the refused write changed nothing");
    server.rpc(
        "snapshot_unexpose",
        &format!(r#"{{"volume":"{VOLUME}","name":"s1"}}"#),
    );
    let (ok, _) = spdk_run(
        &tools,
        "spdk_nvme_identify",
        &["--no-huge", "-d", "256", "-r", &trid_of(addr, &nqn)],
    );
    assert!(!ok, "the subsystem is gone after snapshot_unexpose");
    server.assert_healthy();
}

/// `snapshot_expose` of a 2-replica volume's snapshot: SPDK's spdk_dd
/// reads the snapshot's bytes through the exposed namespace (the engine's
/// snapshot view reads a replica), not the volume's later writes.
#[test]
fn an_exposed_replicated_snapshot_reads_over_nvmf() {
    let Some(tools) = spdk_tools("an_exposed_replicated_snapshot_reads_over_nvmf") else {
        return;
    };
    let _one = tools::spdk_alone();
    let dir = Scratch::new("nvmf-repl-snapshot");
    let (ra, rb) = (
        Replica::start(Kind::Process, &dir.join("a"), "32M"),
        Replica::start(Kind::Process, &dir.join("b"), "32M"),
    );
    let mut server = Server::start(&[
        "--replica-insecure",
        "--volume",
        &format!("r:32M:replicas={}+{}", ra.target(), rb.target()),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    server.wait_replicas(
        "r",
        std::time::Duration::from_secs(60),
        "both healthy",
        state::all_healthy,
    );
    tools::qemu_io(&server, "r", &["write -P 0xa5 0 4M"]);
    server.rpc("snapshot_create", r#"{"volume":"r","name":"s1"}"#);
    tools::qemu_io(&server, "r", &["write -P 0xb6 0 1M"]);
    let info = server.rpc("snapshot_expose", r#"{"volume":"r","name":"s1"}"#);
    assert_eq!(info["name"], "r@s1", "{info}");
    let config = dd_config(&dir, addr, &lull_nvmf::subsystem_nqn("r@s1"));
    let got = dd_read(&tools, &config, &dir.join("s1.bin"), 1 << 20, 4 << 20);
    assert!(
        got.iter().all(|&b| b == 0xa5),
        "the snapshot's bytes over NVMe/TCP"
    );
    server.rpc("snapshot_unexpose", r#"{"volume":"r","name":"s1"}"#);
    server.assert_healthy();
}

/// The lean path (issue 33): on a 2-replica volume over plain replica
/// links, NVMe/TCP reads go from the replica's socket to the host's in a
/// pipe, never copied by lull (docs/PER_IO.md, "Spliced reads"), when the
/// queue pair has no data digest: `spliced_reads` counts up, with a header
/// digest too (it covers the PDU header, which lull writes). With a data
/// digest (a CRC32C over the bytes) reads stay buffered and the counter
/// does not move. In every case spdk_dd reads back in 128 KiB requests
/// byte-identical what it wrote, and spdk_nvme_perf's 128 KiB reads at
/// QD32 (many C2HData PDUs in flight, spliced or not) keep the stream in
/// step (a PDU of the wrong length would end the run with transport
/// errors).
#[test]
fn two_replica_reads_are_spliced_over_nvme_tcp_unless_a_data_digest_is_on() {
    let test = "two_replica_reads_are_spliced_over_nvme_tcp_unless_a_data_digest_is_on";
    let Some(tools) = spdk_tools(test) else {
        return;
    };
    let _one = tools::spdk_alone();
    let scratch = Scratch::new("nvmf-spliced");
    let (ra, rb) = (
        Replica::start(Kind::Process, &scratch.join("a"), "32M"),
        Replica::start(Kind::Process, &scratch.join("b"), "32M"),
    );
    let mut server = Server::start(&[
        "--replica-insecure",
        "--volume",
        &format!("r:32M:replicas={}+{}", ra.target(), rb.target()),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    let nqn = lull_nvmf::subsystem_nqn("r");
    let spliced = |server: &Server| {
        let stats = server.rpc("volume_get_stats", r#"{"name":"r"}"#);
        stats["spliced_reads"].as_u64().expect("spliced_reads")
    };
    let bytes = 8 << 20;
    for (i, (label, dg, perf_flags)) in digest_cases().into_iter().enumerate() {
        let before = spliced(&server);
        let dir = server.dir().clone();
        let seed = 0x5911ce + i as u64;
        dd_round_trip_digests(&tools, &dir, addr, &nqn, dg, seed, bytes, (131072, 131072));
        let after_dd = spliced(&server);
        let total = perf_on(
            &tools,
            &trid_of(addr, &nqn),
            "read",
            32,
            131072,
            1,
            perf_flags,
        );
        let after_perf = spliced(&server);
        eprintln!(
            "{label}: spdk_dd's {} reads of 128 KiB: {} spliced; perf 128k read QD32 {total}: {} spliced",
            bytes / 131072,
            after_dd - before,
            after_perf - after_dd
        );
        if dg.data {
            assert_eq!(
                after_perf, before,
                "{label}: no read may be spliced on a queue pair with a data digest"
            );
        } else {
            assert!(
                after_dd > before && after_perf > after_dd,
                "{label}: reads were spliced (spdk_dd {before} -> {after_dd}, perf -> {after_perf})"
            );
        }
    }
    server.assert_healthy();
}

/// File reads by sendfile (issue 33, docs/PER_IO.md "File reads by
/// sendfile"): a file volume on tmpfs answers 128 KiB reads with file
/// ranges, which a queue pair without a data digest sends after the
/// C2HData header with `sendfile`. spdk_dd writes a pattern and reads it
/// back byte-identical in 128 KiB requests, and spdk_nvme_perf reads at
/// QD32, with no digest, a header digest (lull writes the header: still
/// sent) and a data digest too (never: the CRC32C needs the bytes, so the
/// reads are copied); the volume's `sendfile_reads` counts them.
#[test]
fn file_volume_reads_on_tmpfs_are_sent_with_sendfile_unless_a_data_digest_is_on() {
    let Some(tools) =
        spdk_tools("file_volume_reads_on_tmpfs_are_sent_with_sendfile_unless_a_data_digest_is_on")
    else {
        return;
    };
    let _one = tools::spdk_alone();
    let shm = Scratch::on_tmpfs("nvmf-sendfile");
    let mut server = Server::start(&[
        "--volume",
        &format!("f:32M:file={}", shm.join("f.img").display()),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    let nqn = lull_nvmf::subsystem_nqn("f");
    let stat = |server: &Server, key: &str| {
        let stats = server.rpc("volume_get_stats", r#"{"name":"f"}"#);
        stats[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {stats}"))
    };
    let bytes = 8 << 20;
    for (i, (label, dg, perf_flags)) in digest_cases().into_iter().enumerate() {
        let before = stat(&server, "sendfile_reads");
        let reads_before = stat(&server, "reads");
        let dir = server.dir().clone();
        let seed = 0xf11e5e + i as u64;
        dd_round_trip_digests(&tools, &dir, addr, &nqn, dg, seed, bytes, (131072, 131072));
        let after_dd = stat(&server, "sendfile_reads");
        let dd_reads = stat(&server, "reads") - reads_before;
        let total = perf_on(
            &tools,
            &trid_of(addr, &nqn),
            "read",
            32,
            131072,
            1,
            perf_flags,
        );
        let after_perf = stat(&server, "sendfile_reads");
        eprintln!(
            "{label}: spdk_dd's {dd_reads} reads: {} sent with sendfile; perf 128k read QD32 {total}: {} sent",
            after_dd - before,
            after_perf - after_dd
        );
        if dg.data {
            assert_eq!(
                after_perf, before,
                "{label}: no read may go by sendfile on a queue pair with a data digest"
            );
        } else {
            // spdk_dd's own 128 KiB reads at least (SPDK's bdev layer
            // may read a few small blocks at attach, which stay copied).
            assert!(
                after_dd - before >= (bytes / 131072) as u64,
                "{label}: every 128 KiB read of spdk_dd went by sendfile ({before} -> {after_dd} of {dd_reads} reads)"
            );
            assert!(
                after_perf > after_dd,
                "{label}: perf's reads went by sendfile ({after_dd} -> {after_perf})"
            );
        }
    }
    assert_eq!(stat(&server, "lent_reads"), 0);
    server.assert_healthy();
}

/// Batching (issue 33): the commands of one read round are queued on the
/// channel and pushed once, so on a file volume spdk_nvme_perf at QD32
/// costs fewer than one `io_uring_enter` per I/O (each command was pushed
/// alone before: one or more per I/O), with writes read back by spdk_dd.
#[test]
fn file_volume_commands_are_pushed_in_batches_over_nvme_tcp() {
    let test = "file_volume_commands_are_pushed_in_batches_over_nvme_tcp";
    let Some(tools) = spdk_tools(test) else {
        return;
    };
    let _one = tools::spdk_alone();
    let scratch = Scratch::new("nvmf-batch");
    let file = scratch.join("f.img");
    let mut server = Server::start(&[
        "--volume",
        &format!("f:32M:file={}", file.display()),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    let nqn = lull_nvmf::subsystem_nqn("f");
    let tr = trid_of(addr, &nqn);
    let counts = |server: &Server| {
        let stats = server.rpc("volume_get_stats", r#"{"name":"f"}"#);
        let enters = stats["io_uring_enters"]
            .as_u64()
            .unwrap_or_else(|| panic!("a file volume counts io_uring_enters: {stats}"));
        let ios =
            stats["reads"].as_u64().expect("reads") + stats["writes"].as_u64().expect("writes");
        (enters, ios)
    };
    for workload in ["randwrite", "randread"] {
        let (enters0, ios0) = counts(&server);
        let total = perf_on(&tools, &tr, workload, 32, 4096, 2, &[]);
        let (enters, ios) = counts(&server);
        let (enters, ios) = (enters - enters0, ios - ios0);
        assert!(ios > 1000, "{workload}: too little I/O to judge: {total}");
        let per_io = enters as f64 / ios as f64;
        eprintln!("{workload} 4k QD32 {total}: {enters} io_uring_enter over {ios} I/Os = {per_io:.3} per I/O");
        assert!(
            per_io < 1.0,
            "{workload} at QD32: {per_io:.3} io_uring_enter per I/O: the commands were not pushed in batches"
        );
    }
    dd_round_trip(
        &tools,
        server.dir(),
        addr,
        &nqn,
        0xba7c4,
        4 << 20,
        (131072, 4096),
    );
    server.assert_healthy();
}

/// A spliced read that is the command's completion (issue 33): SPDK's
/// initiator keeps SQ flow control on, so a raw host disables it (Connect
/// CATTR) on an I/O queue to a 2-replica volume and reads 128 KiB the NBD
/// client wrote: one C2HData PDU with LAST_PDU and SUCCESS, its data
/// spliced and byte-identical, and no CapsuleResp after it (the next
/// thing on the socket is the next read's PDU); a queue with flow control
/// gets LAST_PDU only and a CapsuleResp. `spliced_reads` counts them.
#[test]
fn a_spliced_read_carries_success_when_the_host_disabled_sq_flow_control() {
    let scratch = Scratch::new("nvmf-spliced-success");
    let (ra, rb) = (
        Replica::start(Kind::Process, &scratch.join("a"), "16M"),
        Replica::start(Kind::Process, &scratch.join("b"), "16M"),
    );
    let mut server = Server::start(&[
        "--replica-insecure",
        "--volume",
        &format!("{VOLUME}:16M:replicas={}+{}", ra.target(), rb.target()),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    success_on_descriptor_reads(&mut server, "spliced_reads");
}

/// The same for a file volume on tmpfs, whose reads go by `sendfile`
/// (docs/PER_IO.md, "File reads by sendfile"): LAST_PDU and SUCCESS on
/// the C2HData PDU whose data is the file range, byte-identical, no
/// CapsuleResp after it; `sendfile_reads` counts them.
#[test]
fn a_sendfile_read_carries_success_when_the_host_disabled_sq_flow_control() {
    let shm = Scratch::on_tmpfs("nvmf-sendfile-success");
    let mut server = Server::start(&[
        "--volume",
        &format!("{VOLUME}:16M:file={}", shm.join("f.img").display()),
        "--nvmf-listen",
        "127.0.0.1:0",
    ]);
    success_on_descriptor_reads(&mut server, "sendfile_reads");
}

/// The body of the two tests above: `key` is the volume's counter of
/// reads sent from a descriptor.
fn success_on_descriptor_reads(server: &mut Server, key: &str) {
    let addr = server.nvmf_addr().expect("the NVMe/TCP address");
    let data = pattern(0x5cce55, 4 * 131072);
    let mut nbd = NbdClient::connect(server.addr(), VOLUME).expect("NBD connect");
    assert_eq!(nbd.write(0, &data).expect("NBD write"), 0);
    drop(nbd);

    let mut admin = RawHost::connect(addr);
    let (status, cntlid) = admin.fabrics_connect(0, 0xFFFF, 0);
    assert_eq!(status, 0);
    admin.enable();
    let mut flow = RawHost::connect(addr);
    assert_eq!(flow.fabrics_connect(1, cntlid as u16, 0).0, 0);
    let mut noflow = RawHost::connect(addr);
    let cattr = lull_nvmf::spec::CATTR_DISABLE_SQ_FLOW;
    assert_eq!(
        noflow.fabrics_connect_cattr(2, cntlid as u16, 0, cattr).0,
        0
    );
    let spliced = |server: &Server| {
        let stats = server.rpc("volume_get_stats", &format!(r#"{{"name":"{VOLUME}"}}"#));
        stats[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {stats}"))
    };
    // 128 KiB at LBA `slba` (512-byte LBAs), command id `cid`.
    let read = |cid: u16, slba: u32| {
        let mut sqe = raw_sqe(0x02, cid, 1, &[(10, slba), (12, 255)]);
        sqe[32..36].copy_from_slice(&131072u32.to_le_bytes());
        sqe[39] = 0x5A; // transport SGL data block
        pdu::encode(&Pdu::CapsuleCmd { sqe, data: &[] }, Digests::default())
    };
    let before = spliced(server);

    // Flow control on: LAST_PDU, then a CapsuleResp.
    let (status, got) = {
        let bytes = read(11, 256);
        flow.sock.write_all(&bytes).expect("send a read");
        let mut head = [0u8; 24];
        flow.sock.read_exact(&mut head).expect("C2HData");
        assert_eq!(head[0], pdu::TYPE_C2H_DATA, "{head:?}");
        assert_eq!(head[1], pdu::FLAG_LAST_PDU, "flags {:#x}", head[1]);
        let mut got = vec![0u8; 131072];
        flow.sock.read_exact(&mut got).expect("the data");
        let mut resp = [0u8; 24];
        flow.sock.read_exact(&mut resp).expect("CapsuleResp");
        assert_eq!(resp[0], pdu::TYPE_CAPSULE_RESP);
        (u16::from_le_bytes([resp[22], resp[23]]), got)
    };
    assert_eq!(status, 0);
    assert!(got == data[131072..262144], "flow control on: other bytes");

    let after_flow = spliced(server);
    // Off: two reads sent together; each answered by its C2HData alone.
    let mut both = read(21, 512);
    both.extend_from_slice(&read(22, 0));
    noflow.sock.write_all(&both).expect("send two reads");
    let mut seen = Vec::new();
    for _ in 0..2 {
        let mut head = [0u8; 24];
        noflow.sock.read_exact(&mut head).expect("C2HData");
        assert_eq!(
            head[0],
            pdu::TYPE_C2H_DATA,
            "a C2HData, not a CapsuleResp: {head:?}"
        );
        assert_eq!(
            head[1],
            pdu::FLAG_LAST_PDU | pdu::FLAG_SUCCESS,
            "flags {:#x}",
            head[1]
        );
        let plen = u32::from_le_bytes(head[4..8].try_into().unwrap());
        assert_eq!(plen, 24 + 131072);
        let cid = u16::from_le_bytes([head[8], head[9]]);
        let mut got = vec![0u8; 131072];
        noflow.sock.read_exact(&mut got).expect("the data");
        let at = if cid == 21 { 262144 } else { 0 };
        assert!(got == data[at..at + 131072], "cid {cid}: other bytes");
        seen.push(cid);
    }
    seen.sort_unstable();
    assert_eq!(seen, [21, 22]);
    let after = spliced(server);
    eprintln!(
        "{key}: {} with flow control, {} without",
        after_flow - before,
        after - after_flow
    );
    // A read finds no pipe only when the pool is empty or its reply's
    // bytes were already buffered: at least one of these two was spliced,
    // so SUCCESS went out on a spliced PDU.
    assert!(
        after - after_flow >= 1,
        "no read without flow control was spliced"
    );
    // Nothing else is owed on the socket: a Flush gets its CapsuleResp
    // next.
    let (status, _) = noflow.command(raw_sqe(0x00, 23, 1, &[]), &[]);
    assert_eq!(status, 0);
    server.assert_healthy();
}

/// `backup_expose` (docs/BACKUPS.md): a backup, on a directory target,
/// served as an NVMe/TCP namespace before it is restored: spdk_dd reads
/// the bytes the volume held at the backup, not its later writes, chunks
/// fetched from the target as they are read.
#[test]
fn an_exposed_backup_is_a_namespace_spdk_reads() {
    let Some(tools) = spdk_tools("an_exposed_backup_is_a_namespace_spdk_reads") else {
        return;
    };
    let _one = tools::spdk_alone();
    let dir = Scratch::new("nvmf-backup");
    let (server, addr) = serve();
    let target = dir.join("target");
    std::fs::create_dir_all(&target).expect("target directory");
    server.rpc(
        "backup_target_add",
        &format!(r#"{{"name":"dir","url":"file://{}"}}"#, target.display()),
    );
    tools::qemu_io(&server, VOLUME, &["write -P 0xc3 0 3M"]);
    let b = server.rpc(
        "backup_create",
        &format!(r#"{{"volume":"{VOLUME}","target":"dir","wait":true}}"#),
    );
    assert_eq!(b["job"]["state"], "done", "{b}");
    tools::qemu_io(&server, VOLUME, &["write -P 0xd4 0 1M"]);
    let id = b["id"].as_str().expect("a backup id");
    server.rpc(
        "backup_expose",
        &format!(r#"{{"target":"dir","backup":"{id}"}}"#),
    );
    let config = dd_config(&dir, addr, &lull_nvmf::subsystem_nqn(id));
    let got = dd_read(&tools, &config, &dir.join("b.bin"), 1 << 20, 4 << 20);
    assert!(
        got[..3 << 20].iter().all(|&b| b == 0xc3),
        "the backup's bytes over NVMe/TCP"
    );
    assert!(got[3 << 20..].iter().all(|&b| b == 0), "zeros past them");
}
