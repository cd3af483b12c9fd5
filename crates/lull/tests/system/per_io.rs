//! Per-I/O cost, with real clients: the file backend's io_uring options
//! (`sqpoll`, `iopoll`, `hybrid_iopoll`, `iopoll=auto`) either carry fio's
//! verified writes or stop the server at start with an error naming the
//! option; the steady state of a `direct` file volume takes (almost) no
//! page faults; the counters behind both are exposed over RPC.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, require, Kind, Replica, Scratch, Server, START_TIMEOUT};

/// Page faults per I/O the server may take in steady state (issue 13): a
/// fault per thousand requests, i.e. none on the per-request path.
const STEADY_FAULTS_PER_IO_MAX: f64 = 0.001;

/// fio's warm-up before the measured window: connection set-up, buffer
/// caches filling, the reactor's first spin decisions.
const WARMUP_SECS: u64 = 2;
/// The measured window.
const MEASURE_SECS: u64 = 5;

fn tempdir(name: &str) -> PathBuf {
    let d =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("perio-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// fio's nbd engine writes 16 MiB at random with crc32c and reads it all
/// back, failing on the first mismatch.
fn fio_verify(server: &Server) {
    require("fio", "fio");
    let out = Command::new("fio")
        .args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri=nbd://{}/vol", server.addr()),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--output-format=json",
        ])
        .output()
        .expect("run fio");
    let json = common::fio_json(&out);
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "fio error: {job}");
    assert!(
        job["read"]["total_ios"].as_u64().unwrap() >= 4096,
        "verify reads ran: {job}"
    );
}

/// `lull serve` with `args`: `Ok(server)` once it listens, or `Err(log)`
/// when it exits first (a refused option).
fn start_or_refused(args: &[&str], dir: &Path) -> Result<Server, String> {
    let log_path = dir.join("refused.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let (mut child, rx) = common::spawn_with_stdout(
        Command::new(env!("CARGO_BIN_EXE_lull"))
            .args(["serve", "--listen", "127.0.0.1:0", "--rpc-socket"])
            .arg(dir.join("probe.sock"))
            .args(args),
        log,
    );
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "lull serve exited 0 at start");
            return Err(std::fs::read_to_string(&log_path).unwrap_or_default());
        }
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(50)) {
            if line.starts_with("listening on ") {
                // It works: stop this probe and start the real one.
                let _ = child.kill();
                let _ = child.wait();
                return Ok(Server::start(args));
            }
        }
        assert!(
            Instant::now() < deadline,
            "lull serve neither started nor exited"
        );
    }
}

#[test]
fn file_ring_options_carry_verified_io_or_are_refused_by_name() {
    let dir = tempdir("options");
    let img = dir.join("f.img");
    let img = img.display();
    // Options that work on any Linux with io_uring (SQPOLL is unprivileged
    // since 5.11; auto falls back to interrupts where it cannot poll).
    for flags in [
        "sqpoll",
        "direct,sqpoll=5",
        "direct,iopoll=auto",
        "iopoll=auto",
    ] {
        let spec = format!("vol:16M:file={img},{flags}");
        let mut server = Server::start(&["--volume", &spec]);
        fio_verify(&server);
        server.assert_healthy();
        if flags.contains("auto") && flags.contains("direct") {
            // Either it polls, or it says once why it does not.
            let log = server.stderr();
            let fell_back = log.contains("iopoll=auto: using interrupt completions");
            let polls = log.contains("iopoll=true");
            assert!(
                fell_back ^ polls,
                "iopoll=auto said neither or both:\n{log}"
            );
        }
    }
    // Options that need a polling block device: IOPOLL without O_DIRECT is
    // always refused; with it, this VM's disk (no poll queues) refuses.
    for (flags, option) in [
        ("iopoll", "iopoll"),
        ("hybrid_iopoll", "hybrid_iopoll"),
        ("direct,iopoll", "iopoll"),
        ("direct,hybrid_iopoll", "hybrid_iopoll"),
    ] {
        let spec = format!("vol:16M:file={img},{flags}");
        match start_or_refused(&["--volume", &spec], &dir) {
            Err(log) => {
                let needle = format!("option {option} refused: ");
                assert!(log.contains(&needle), "{flags}: no {needle:?} in:\n{log}");
                eprintln!(
                    "{flags}: refused as expected: {}",
                    log.lines().last().unwrap_or("")
                );
                if !flags.contains("direct") {
                    assert!(
                        log.contains("O_DIRECT"),
                        "{flags}: reason should name O_DIRECT:\n{log}"
                    );
                }
            }
            Ok(mut server) => {
                assert!(
                    flags == "direct,iopoll",
                    "{flags} started; only direct,iopoll on a polling device may"
                );
                fio_verify(&server);
                server.assert_healthy();
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn file_on_tmpfs_runs_inline_and_carries_verified_io() {
    // A file volume on tmpfs reads and writes inline by default.
    let shm = Scratch::on_tmpfs("perio-inline");
    let img = shm.join("f.img");
    let img = img.display();
    for (flags, inline) in [("", true), ("inline", true), ("inline=off", false)] {
        let spec = format!(
            "vol:16M:file={img}{}{flags}",
            if flags.is_empty() { "" } else { "," }
        );
        let sock = shm.join("rpc.sock");
        let mut server =
            Server::start(&["--volume", &spec, "--rpc-socket", sock.to_str().unwrap()]);
        fio_verify(&server);
        server.assert_healthy();
        let stats = common::rpc(&sock, "volume_get_stats", r#"{"name":"vol"}"#);
        let logged_inline = server.stderr().contains("reads and writes run inline");
        drop(server);
        let count = |k: &str| {
            stats[k]
                .as_u64()
                .unwrap_or_else(|| panic!("{k} in {stats}"))
        };
        let (ring, inline_ios) = (
            count("fixed_buffer_ios") + count("plain_buffer_ios"),
            count("inline_ios"),
        );
        if inline {
            // 4096 verified writes and their reads, none through a ring.
            assert!(
                inline_ios >= 8192 && ring == 0,
                "{flags:?}: inline {inline_ios}, ring {ring}"
            );
            assert!(logged_inline, "{flags:?}: no log line");
        } else {
            assert!(
                inline_ios == 0 && ring >= 8192,
                "{flags:?}: inline {inline_ios}, ring {ring}"
            );
        }
    }
    // `inline` insists: refused off a memory filesystem and with a ring option.
    let disk = tempdir("inline-refused");
    for (file, flags, reason) in [
        (disk.join("f.img"), "inline", "not on a memory filesystem"),
        (
            shm.join("f.img"),
            "inline,sqpoll",
            "cannot be combined with sqpoll",
        ),
    ] {
        let spec = format!("vol:16M:file={},{flags}", file.display());
        match start_or_refused(&["--volume", &spec], &disk) {
            Err(log) => {
                assert!(log.contains("option inline refused: "), "{flags}: {log}");
                assert!(log.contains(reason), "{flags}: no {reason:?} in:\n{log}");
            }
            Ok(_) => panic!("{flags} on {} started; it must be refused", file.display()),
        }
    }
    std::fs::remove_dir_all(&disk).unwrap();
}

/// Minor + major page faults of a whole process, from /proc/PID/stat.
fn process_faults(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc/PID/stat");
    let fields: Vec<&str> = stat[stat.rfind(')').expect("stat comm") + 2..]
        .split_whitespace()
        .collect();
    // state is field 3 of stat(5); minflt is 10, majflt 12.
    fields[7].parse::<u64>().expect("minflt") + fields[9].parse::<u64>().expect("majflt")
}

#[test]
fn steady_state_direct_file_volume_takes_no_page_faults() {
    require("fio", "fio");
    let dir = tempdir("faults");
    let sock = dir.join("rpc.sock");
    let spec = format!("vol:64M:file={},direct", dir.join("f.img").display());
    let mut server = Server::start(&["--volume", &spec, "--rpc-socket", sock.to_str().unwrap()]);
    let pid = server.pid();
    let reactors_before = common::rpc(&sock, "framework_get_reactors", "");
    let fio = Command::new("fio")
        .args([
            "--name=steady",
            "--ioengine=nbd",
            &format!("--uri=nbd://{}/vol", server.addr()),
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=32",
            "--size=64M",
            "--time_based",
            &format!("--ramp_time={WARMUP_SECS}"),
            &format!("--runtime={MEASURE_SECS}"),
            "--output-format=json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run fio");
    // fio's stats start after its ramp; the fault window starts a little
    // later, so it holds no start-up work and at most the same I/O.
    std::thread::sleep(Duration::from_millis(WARMUP_SECS * 1000 + 500));
    let faults_before = process_faults(pid);
    let out = fio.wait_with_output().expect("fio");
    let faults = process_faults(pid) - faults_before;
    let json = common::fio_json(&out);
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "fio error: {job}");
    let ios =
        job["read"]["total_ios"].as_u64().unwrap() + job["write"]["total_ios"].as_u64().unwrap();
    assert!(ios > 1000, "too little I/O to judge: {job}");
    let per_io = faults as f64 / ios as f64;
    eprintln!("steady state: {faults} page faults over {ios} I/Os = {per_io:.6} per I/O");
    assert!(
        per_io < STEADY_FAULTS_PER_IO_MAX,
        "{faults} page faults over {ios} I/Os ({per_io:.6}/IO) is not below {STEADY_FAULTS_PER_IO_MAX}"
    );

    // The counters: the reactors made io_uring_enter calls for the file
    // channels, and the volume's count rose with its I/O.
    let enters = |v: &serde_json::Value| -> u64 {
        v["reactors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["io_uring_enters"].as_u64().expect("io_uring_enters"))
            .sum()
    };
    // Reactors publish their counters every 50 ms: wait for the rise.
    let mut reactors_after = serde_json::Value::Null;
    common::wait_until(common::IO_TIMEOUT, || {
        reactors_after = common::rpc(&sock, "framework_get_reactors", "");
        enters(&reactors_after) > enters(&reactors_before)
    });
    assert!(
        enters(&reactors_after) > enters(&reactors_before),
        "no io_uring_enter counted on any reactor: {reactors_after}"
    );
    let faults_counted: u64 = reactors_after["reactors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["minor_faults"].as_u64().unwrap())
        .sum();
    assert!(
        faults_counted > 0,
        "a reactor thread takes some faults at start"
    );
    let stats = common::rpc(&sock, "volume_get_stats", r#"{"name":"vol"}"#);
    let vol_enters = stats["io_uring_enters"]
        .as_u64()
        .expect("file volume counts enters");
    let vol_ios = stats["reads"].as_u64().unwrap() + stats["writes"].as_u64().unwrap();
    assert!(vol_ios >= ios, "{stats}");
    assert!(
        vol_enters > 0 && vol_enters <= 2 * vol_ios + 1000,
        "{stats}"
    );
    eprintln!(
        "io_uring_enter per I/O: {:.3}",
        vol_enters as f64 / vol_ios as f64
    );
    server.assert_healthy();
    drop(server);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `lull replica` with these `--uring` options and more flags.
fn replica(dir: &Path, uring: &str, extra: &[&str]) -> Result<Replica, String> {
    let flags = [&["--uring", uring][..], extra].concat();
    Replica::try_start_with(Kind::Process, dir, "16M", &flags)
}

/// Stops a `lull replica` (SIGTERM, a clean stop) and reads its data
/// file's `(fixed, plain)` buffer I/O counts from its stop line.
fn stop_replica(r: &mut Replica, label: &str) -> (u64, u64) {
    r.stop();
    let counts = (
        r.stop_counter("fixed_buffer_ios"),
        r.stop_counter("plain_buffer_ios"),
    );
    eprintln!("replica {label}: (fixed, plain) buffer I/Os {counts:?}");
    counts
}

/// `fio_verify` on a replicated volume whose one replica is a `lull
/// replica --uring {uring}` in `dir`; that replica's data-file I/O
/// counters at its stop: (fixed-buffer, plain).
fn fio_on_replica(dir: &Path, uring: &str) -> (u64, u64) {
    let mut r = match replica(dir, uring, &[]) {
        Ok(r) => r,
        Err(log) => panic!("lull replica --uring {uring} refused:\n{log}"),
    };
    let mut server = Server::start(&[
        "--replica-insecure",
        "--volume",
        &format!("vol:16M:replicas={}", r.target()),
    ]);
    fio_verify(&server);
    server.assert_healthy();
    drop(server);
    stop_replica(&mut r, uring)
}

#[test]
fn replica_data_file_takes_the_same_ring_options() {
    let dir = Scratch::new("perio-replica");
    // SQPOLL on an O_DIRECT data file carries a replicated volume.
    // Its data file's I/O went through the reactors' fixed buffers.
    let (fixed, plain) = fio_on_replica(&dir.join("sqpoll"), "direct,sqpoll=5");
    assert!(
        fixed > 0,
        "replica I/O from fixed buffers: {fixed} fixed, {plain} plain"
    );
    // fixed=off: none did.
    let (fixed, plain) = fio_on_replica(&dir.join("fixed-off"), "direct,fixed=off");
    assert!(
        fixed == 0 && plain > 0,
        "fixed=off: {fixed} fixed, {plain} plain"
    );
    // IOPOLL without O_DIRECT is refused by name, at start.
    match replica(&dir.join("iopoll"), "iopoll", &[]) {
        Err(log) => assert!(
            log.contains("option iopoll refused: ") && log.contains("O_DIRECT"),
            "no clear refusal in:\n{log}"
        ),
        Ok(_) => panic!("lull replica --uring iopoll started without O_DIRECT"),
    }
}

/// fio's nbd engine writes `size` at `bs` (random 4 KiB, or sequential
/// for larger blocks) with crc32c and reads it all back.
fn fio_verify_bs(server: &Server, bs: &str, rw: &str) -> u64 {
    require("fio", "fio");
    let out = Command::new("fio")
        .args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri=nbd://{}/vol", server.addr()),
            &format!("--rw={rw}"),
            // "A-B": sizes from A to B (fio's --bsrange).
            &match bs.split_once('-') {
                Some(_) => format!("--bsrange={bs}"),
                None => format!("--bs={bs}"),
            },
            "--iodepth=16",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--output-format=json",
        ])
        .output()
        .expect("run fio");
    let json = common::fio_json(&out);
    let job = &json["jobs"][0];
    assert_eq!(job["error"], 0, "fio error ({bs} {rw}): {job}");
    let reads = job["read"]["total_ios"].as_u64().unwrap();
    assert!(reads > 0, "verify reads ran: {job}");
    reads + job["write"]["total_ios"].as_u64().unwrap()
}

/// Fixed buffers (issue 13): on a `direct` file volume fio's verified
/// writes and reads go through READ_FIXED/WRITE_FIXED from the reactors'
/// prefaulted arenas, counted in `volume_get_stats`; with `fixed=off`, or
/// with no arena (`--fixed-buffers-mib 0`), none do and the data is as
/// right.
#[test]
fn fixed_buffers_carry_verified_io_and_are_counted() {
    let dir = tempdir("fixed");
    let img = dir.join("f.img");
    for (flags, extra, expect_fixed) in [
        ("direct", None, true),
        ("direct,fixed=off", None, false),
        ("direct", Some("0"), false),
    ] {
        let sock = dir.join("rpc.sock");
        let spec = format!("vol:16M:file={},{flags}", img.display());
        let mut args = vec!["--volume", &spec, "--rpc-socket", sock.to_str().unwrap()];
        if let Some(mib) = extra {
            args.extend(["--fixed-buffers-mib", mib]);
        }
        let mut server = Server::start(&args);
        let ios =
            fio_verify_bs(&server, "4k", "randwrite") + fio_verify_bs(&server, "128k", "write");
        let stats = common::rpc(&sock, "volume_get_stats", r#"{"name":"vol"}"#);
        let fixed = stats["fixed_buffer_ios"]
            .as_u64()
            .expect("fixed_buffer_ios");
        let plain = stats["plain_buffer_ios"]
            .as_u64()
            .expect("plain_buffer_ios");
        eprintln!("{flags} {extra:?}: {ios} fio I/Os; {fixed} fixed, {plain} plain");
        if expect_fixed {
            assert!(fixed >= ios, "every fio I/O went fixed: {stats}");
            assert_eq!(plain, 0, "{stats}");
        } else {
            assert_eq!(fixed, 0, "{stats}");
            assert!(plain >= ios, "{stats}");
        }
        // Reactors publish their arena's state every 50 ms: wait until
        // each has (without an arena there is nothing to wait for).
        let mut reactors = serde_json::Value::Null;
        common::wait_until(common::IO_TIMEOUT, || {
            reactors = common::rpc(&sock, "framework_get_reactors", "");
            extra == Some("0")
                || reactors["reactors"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|r| r["fixed_buffer_bytes"].as_u64() > Some(0))
        });
        for r in reactors["reactors"].as_array().unwrap() {
            let bytes = r["fixed_buffer_bytes"]
                .as_u64()
                .expect("fixed_buffer_bytes");
            if extra == Some("0") {
                assert_eq!(bytes, 0, "no arena with --fixed-buffers-mib 0: {r}");
            } else {
                assert!(bytes > 15 << 20 && bytes <= 16 << 20, "16 MiB arena: {r}");
                assert!(r["fixed_buffer_in_use_bytes"].as_u64().unwrap() <= bytes);
                eprintln!(
                    "reactor {}: arena locked: {}",
                    r["index"], r["fixed_buffer_locked"]
                );
            }
        }
        server.assert_healthy();
        drop(server);
        let _ = std::fs::remove_file(&img);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Spliced reads (issue 13, docs/PER_IO.md): on a 2-replica volume over
/// plain links, READs of 32 to 128 KiB go from the replica's page cache
/// with sendfile and through the engine in a pipe, never copied by lull.
/// fio's verified writes and reads (structured replies, block sizes from
/// 4 KiB to 256 KiB, so both paths and the boundaries run) and libnbd
/// with simple replies read back what was written; the counters say which path
/// ran: the volume's `spliced_reads`, each replica's `sendfile_reads`
/// (none with `--no-sendfile`, whose replies the engine still splices).
#[test]
fn replicated_reads_are_spliced_and_carry_verified_data() {
    require("fio", "fio");
    let python = common::python_with_nbd();
    let dir = Scratch::new("perio-spliced");
    for extra in [&[][..], &["--no-sendfile"][..]] {
        let label = if extra.is_empty() {
            "sendfile"
        } else {
            "no-sendfile"
        };
        let start = |name: &str| match replica(
            &dir.join(format!("{label}-{name}")),
            "inline=auto",
            extra,
        ) {
            Ok(r) => r,
            Err(log) => panic!("lull replica {extra:?} refused:\n{log}"),
        };
        let (mut r0, mut r1) = (start("r0"), start("r1"));
        let spec = format!("vol:16M:replicas={}+{}", r0.target(), r1.target());
        let mut server = Server::start(&["--replica-insecure", "--volume", &spec]);
        fio_verify_bs(&server, "128k", "write");
        fio_verify_bs(&server, "4k-256k", "randwrite");
        // Simple replies (libnbd asks for structured ones by default).
        let script = format!(
            "import nbd\n\
             h = nbd.NBD()\n\
             h.set_request_structured_replies(False)\n\
             h.connect_uri('nbd://{}/vol')\n\
             assert not h.get_structured_replies_negotiated()\n\
             for i, n in enumerate([32768, 65536, 131072, 4096, 262144]):\n\
             \x20   data = bytes((i * 7 + j) % 251 for j in range(n))\n\
             \x20   h.pwrite(data, 1048576 * (i + 1))\n\
             \x20   assert h.pread(n, 1048576 * (i + 1)) == data, n\n",
            server.addr()
        );
        let out = Command::new(python)
            .args(["-c", &script])
            .output()
            .expect("run python3");
        assert!(
            out.status.success(),
            "libnbd with simple replies ({label}): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stats = server.rpc("volume_get_stats", r#"{"name":"vol"}"#);
        let spliced = stats["spliced_reads"].as_u64().expect("spliced_reads");
        let reads = stats["reads"].as_u64().expect("reads");
        eprintln!("{label}: {spliced} of {reads} reads spliced");
        assert!(
            spliced > 0 && spliced < reads,
            "some reads spliced, not all: {stats}"
        );
        server.assert_healthy();
        drop(server);
        stop_replica(&mut r0, "inline=auto");
        stop_replica(&mut r1, "inline=auto");
        let sent: u64 = [&r0, &r1]
            .iter()
            .map(|r| r.stop_counter("sendfile_reads"))
            .sum();
        eprintln!("{label}: replicas sent {sent} reads with sendfile");
        if extra.is_empty() {
            assert!(sent > 0, "the replicas used sendfile");
        } else {
            assert_eq!(sent, 0, "--no-sendfile: no sendfile");
        }
    }
}

/// Runs a Python script with libnbd; panics with its stderr on failure.
fn python_nbd(script: &str, what: &str) {
    let out = Command::new(common::python_with_nbd())
        .args(["-c", script])
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Lent reads (issue 33, docs/PER_IO.md): a memory volume answers reads
/// inside one written chunk from its own memory. nbdcopy writes a
/// pattern and reads the volume back byte-identical (structured replies,
/// 256 KiB requests), qemu-io verifies a pattern region, libnbd with
/// simple replies reads unaligned ranges and ranges across a chunk
/// boundary and in holes; the volume's `lent_reads` counts the lent ones
/// (some, not all: holes and boundary-crossing reads are copied).
/// The clients' part of the lent and sendfile tests, on a 32 MiB volume
/// `vol`: nbdcopy writes 24 MiB of pattern (from `seed`; the last 8 MiB
/// stay holes) and reads the volume back byte-identical, which moves the
/// volume's `counter`; then qemu-io writes 0x5c over 3 MiB..4 MiB and
/// verifies it. Returns the input file, rewritten to hold what the
/// volume's first 24 MiB now hold.
fn copy_round_trip(server: &Server, dir: &Path, seed: u64, counter: &str) -> PathBuf {
    let uri = format!("nbd://{}/vol", server.addr());
    let stat = |key: &str| {
        server.rpc("volume_get_stats", r#"{"name":"vol"}"#)[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in volume_get_stats"))
    };
    let mut data = common::pattern(seed, 24 << 20);
    let input = dir.join("in.bin");
    std::fs::write(&input, &data).expect("write the input");
    let out = Command::new("nbdcopy")
        .args([input.to_str().unwrap(), &uri])
        .output()
        .expect("run nbdcopy");
    assert!(out.status.success(), "nbdcopy to the volume: {out:?}");
    let before = stat(counter);
    let copy = dir.join("out.bin");
    let out = Command::new("nbdcopy")
        .args([&uri, copy.to_str().unwrap()])
        .output()
        .expect("run nbdcopy");
    assert!(out.status.success(), "nbdcopy from the volume: {out:?}");
    let back = std::fs::read(&copy).expect("read the copy");
    assert_eq!(back.len(), 32 << 20);
    assert!(
        back[..data.len()] == data[..],
        "nbdcopy read other bytes than it wrote"
    );
    assert!(
        back[data.len()..].iter().all(|&b| b == 0),
        "holes read as zeros"
    );
    let after = stat(counter);
    assert!(
        after > before,
        "nbdcopy's reads moved {counter}: {before} -> {after}"
    );
    let out = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 0x5c 3M 1M",
            "-c",
            "read -P 0x5c 3M 1M",
            "-c",
            "read -P 0x5c 3145728 4096",
            "-c",
            "read -P 0 28M 64k",
            &uri,
        ])
        .output()
        .expect("run qemu-io");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("fail") && !text.contains("error"),
        "qemu-io: {out:?}"
    );
    data[3 << 20..4 << 20].fill(0x5c);
    std::fs::write(&input, &data).expect("rewrite the input");
    input
}

/// Some of volume `vol`'s reads, not all, were counted in `counter` (the
/// short reads of the tests' libnbd scripts are copied); the stats back.
fn some_reads_counted(server: &Server, counter: &str) -> serde_json::Value {
    let stats = server.rpc("volume_get_stats", r#"{"name":"vol"}"#);
    let counted = stats[counter]
        .as_u64()
        .unwrap_or_else(|| panic!("{counter}"));
    let reads = stats["reads"].as_u64().expect("reads");
    eprintln!("{counted} of {reads} reads counted in {counter}");
    assert!(
        counted > 0 && counted < reads,
        "some reads in {counter}, not all: {stats}"
    );
    stats
}

#[test]
fn memory_volume_reads_are_lent_and_byte_identical() {
    common::require("nbdcopy", "libnbd-bin");
    common::require("qemu-io", "qemu-utils");
    let dir = Scratch::new("perio-lent");
    let server = Server::start(&["--volume", "vol:32M"]);
    let uri = format!("nbd://{}/vol", server.addr());
    let input = copy_round_trip(&server, &dir, 0x1e47, "lent_reads");
    // Simple replies, unaligned, across a chunk boundary, in a hole.
    let script = format!(
        "import nbd\n\
         h = nbd.NBD()\n\
         h.set_request_structured_replies(False)\n\
         h.connect_uri('{uri}')\n\
         assert not h.get_structured_replies_negotiated()\n\
         data = open('{input}', 'rb').read()\n\
         for off, n in [(5, 4091), (1048576 - 100, 200), (7 << 20, 131072), (2 << 20, 1 << 20)]:\n\
         \x20   assert h.pread(n, off) == data[off:off + n], (off, n)\n\
         assert h.pread(4096, 30 << 20) == bytes(4096)\n",
        input = input.display()
    );
    python_nbd(&script, "libnbd with simple replies");
    some_reads_counted(&server, "lent_reads");
    let mut server = server;
    server.assert_healthy();
}

/// File reads by sendfile (issue 33, docs/PER_IO.md "File reads by
/// sendfile"): a file volume on tmpfs answers reads of 32 KiB and more
/// with the file's range, which the NBD connection sends with `sendfile`.
/// nbdcopy writes a pattern and reads the volume back byte-identical
/// (structured replies, 256 KiB requests), qemu-io verifies a pattern
/// region, libnbd with simple replies reads short and unaligned ranges
/// (copied), long ones and the device's last bytes (sent), and holes; the
/// volume's `sendfile_reads` counts the sent ones (some, not all). Then
/// the same file behind a server that requires TLS: nbdcopy over nbds://
/// reads the same bytes and nothing is sent with `sendfile` (a TLS
/// session encrypts the bytes, so it never takes a file range).
#[test]
fn file_volume_reads_on_tmpfs_are_sent_with_sendfile_and_byte_identical() {
    common::require("nbdcopy", "libnbd-bin");
    common::require("qemu-io", "qemu-utils");
    let dir = Scratch::new("perio-sendfile");
    let shm = Scratch::on_tmpfs("perio-sendfile");
    let img = shm.join("f.img");
    let spec = format!("vol:32M:file={}", img.display());
    let server = Server::start(&["--volume", &spec]);
    let uri = format!("nbd://{}/vol", server.addr());
    let input = copy_round_trip(&server, &dir, 0x5e4d, "sendfile_reads");
    let data = std::fs::read(&input).expect("read the input back");
    // Simple replies: short and unaligned (copied), long, long and
    // unaligned, the device's last 64 KiB (sent), a hole.
    let script = format!(
        "import nbd\n\
         h = nbd.NBD()\n\
         h.set_request_structured_replies(False)\n\
         h.connect_uri('{uri}')\n\
         assert not h.get_structured_replies_negotiated()\n\
         data = open('{input}', 'rb').read() + bytes(8 << 20)\n\
         for off, n in [(5, 4091), (1048576 - 100, 200), (7 << 20, 131072), (2 << 20, 1 << 20),\n\
         \x20              ((3 << 20) - 777, 65536 + 3), ((32 << 20) - 65536, 65536)]:\n\
         \x20   assert h.pread(n, off) == data[off:off + n], (off, n)\n\
         assert h.pread(131072, 30 << 20) == bytes(131072)\n",
        input = input.display()
    );
    python_nbd(&script, "libnbd with simple replies");
    let stats = some_reads_counted(&server, "sendfile_reads");
    assert_eq!(stats["lent_reads"].as_u64(), Some(0), "{stats}");
    let mut server = server;
    server.assert_healthy();
    drop(server);

    // The same file through TLS: the same bytes, no sendfile.
    let keys = dir.join("keys.psk");
    std::fs::write(
        &keys,
        "alice:2b7e151628aed2a6abf7158809cf4f3c8a1e0b2c3d4e5f60718293a4b5c6d7e8\n",
    )
    .expect("write the psk file");
    let mut server = Server::start(&["--volume", &spec, "--tls-psk", keys.to_str().unwrap()]);
    // The user in the authority too: libnbd 1.14 otherwise asks
    // getlogin_r, which fails without a login terminal.
    let tls_uri = format!(
        "nbds://alice@{}/vol?tls-psk-file={}&tls-username=alice",
        server.addr(),
        keys.display()
    );
    let copy = dir.join("out-tls.bin");
    let out = Command::new("nbdcopy")
        .args([&tls_uri, copy.to_str().unwrap()])
        .output()
        .expect("run nbdcopy");
    assert!(out.status.success(), "nbdcopy over TLS: {out:?}");
    let back = std::fs::read(&copy).expect("read the copy");
    assert!(
        back[..data.len()] == data[..] && back[data.len()..].iter().all(|&b| b == 0),
        "nbdcopy over TLS read other bytes"
    );
    let stats = server.rpc("volume_get_stats", r#"{"name":"vol"}"#);
    assert!(stats["reads"].as_u64().expect("reads") > 0, "{stats}");
    assert_eq!(
        stats["sendfile_reads"].as_u64(),
        Some(0),
        "TLS: nothing sent with sendfile: {stats}"
    );
    server.assert_healthy();
}

/// File ranges queued behind a full socket when the volume's file is cut
/// shorter by hand, then punched (docs/PER_IO.md, "File reads by
/// sendfile"): a client asks for 60 MiB in 512 KiB reads and reads no
/// reply until all of them were answered with file ranges (most wait in
/// the connection's queue), then the file is punched (those bytes go out
/// as zeros) and truncated to 1 MiB: the ranges past the new end cannot
/// be sent whole, so the server closes the connection (no hang, no short
/// reply followed by other bytes) and stays healthy; a new client is
/// served (a read inside the file, sent with sendfile again).
#[test]
fn file_ranges_queued_while_the_file_is_cut_end_in_a_clean_close() {
    const READ_BYTES: u32 = 512 << 10;
    // 60 MiB: more than a loopback socket's buffers hold (up to
    // tcp_rmem's 32 MiB maximum and tcp_wmem's 4 MiB) and than the
    // connection's 128 requests, under its 128 MiB reply queue.
    const READS: u64 = 120;
    let shm = Scratch::on_tmpfs("perio-cut");
    let img = shm.join("f.img");
    let spec = format!("vol:64M:file={}", img.display());
    let mut server = Server::start(&["--volume", &spec]);
    let data = common::pattern(0xc07, 64 << 20);
    let mut c = common::NbdClient::connect(server.addr(), "vol").expect("connect");
    for at in (0..data.len()).step_by(4 << 20) {
        assert_eq!(
            c.write(at as u64, &data[at..at + (4 << 20)])
                .expect("write"),
            0
        );
    }
    let sent = |server: &Server| {
        server.rpc("volume_get_stats", r#"{"name":"vol"}"#)["sendfile_reads"]
            .as_u64()
            .expect("sendfile_reads")
    };
    let before = sent(&server);
    let mut offsets = std::collections::HashMap::new();
    for i in 0..READS {
        let cookie = c
            .send(
                lull_proto::nbd::Command::Read,
                0,
                i * u64::from(READ_BYTES),
                READ_BYTES,
                &[],
            )
            .expect("send a read");
        offsets.insert(cookie, (i * u64::from(READ_BYTES)) as usize);
    }
    assert!(
        common::wait_until(common::IO_TIMEOUT, || sent(&server) - before == READS),
        "every read was answered with a file range"
    );
    // Punch the first 4 MiB (replies still queued show zeros there or the
    // old bytes: the page cache's when sent), then cut the file.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .expect("open the volume's file");
    let punched = Command::new("fallocate")
        .args(["--punch-hole", "--offset", "0", "--length", "4MiB"])
        .arg(&img)
        .status()
        .expect("run fallocate (util-linux)");
    assert!(punched.success(), "fallocate --punch-hole");
    f.set_len(1 << 20).expect("truncate the volume's file");
    // Read replies until the server closes: whole replies up to where the
    // file ends, each holding either the pattern or zeros.
    let mut got = 0u64;
    let end = loop {
        let at = match c.reply() {
            Ok((0, cookie)) => offsets[&cookie],
            Ok((e, cookie)) => {
                panic!("reply {cookie} with error {e}: a range is sent or the connection ends")
            }
            Err(e) => break e,
        };
        let mut buf = vec![0u8; READ_BYTES as usize];
        match std::io::Read::read_exact(&mut c.sock, &mut buf) {
            Ok(()) => {}
            Err(e) => break e,
        }
        assert!(
            buf == data[at..at + READ_BYTES as usize] || buf.iter().all(|&b| b == 0),
            "reply {got}: neither the written bytes nor zeros"
        );
        got += 1;
    };
    assert!(
        got < READS,
        "every reply arrived whole although the file was cut: {got}"
    );
    assert!(
        matches!(
            end.kind(),
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
        ),
        "the connection ended by a close, not a timeout: {end}"
    );
    eprintln!("{got} of {READS} replies whole before the close");
    // The close says why: the operator's one clue to a file cut under
    // the volume.
    server.assert_logged(&["a spliced payload ended early"]);
    server.assert_healthy();
    let mut c = common::NbdClient::connect(server.addr(), "vol").expect("a new client");
    let back = c.read(0, 128 << 10).expect("read").expect("no error");
    assert!(back.iter().all(|&b| b == 0), "punched: zeros");
    server.assert_healthy();
}

/// Writes racing lent reads of the same blocks (issue 33's rule,
/// docs/PER_IO.md "Lent reads"): libnbd sends, many rounds over, a read
/// and a write of the same 64 KiB together (read first, then write, then
/// the other order), and a second connection rewrites the same blocks
/// meanwhile. Every read returns one whole pattern: the old or the new,
/// never a mix; the server stays healthy and lent the reads.
#[test]
fn writes_racing_lent_reads_return_old_or_new_data() {
    let server = Server::start(&["--volume", "vol:8M"]);
    let uri = format!("nbd://{}/vol", server.addr());
    let script = format!(
        "import nbd, threading\n\
         N = 65536\n\
         OFF = 1048576 + 8192\n\
         ROUNDS = 400\n\
         def pat(v):\n\
         \x20   return bytes([v]) * N\n\
         h = nbd.NBD()\n\
         h.connect_uri('{uri}')\n\
         h.pwrite(pat(1), OFF)\n\
         stop = threading.Event()\n\
         def rewrite():\n\
         \x20   g = nbd.NBD()\n\
         \x20   g.connect_uri('{uri}')\n\
         \x20   v = 100\n\
         \x20   while not stop.is_set():\n\
         \x20       v = 100 + (v - 99) % 100\n\
         \x20       g.pwrite(pat(v), OFF)\n\
         t = threading.Thread(target=rewrite)\n\
         t.start()\n\
         try:\n\
         \x20   for i in range(ROUNDS):\n\
         \x20       new = 2 + i % 90\n\
         \x20       rb = nbd.Buffer(N)\n\
         \x20       wb = nbd.Buffer.from_bytearray(bytearray(pat(new)))\n\
         \x20       if i % 2 == 0:\n\
         \x20           c1 = h.aio_pread(rb, OFF)\n\
         \x20           c2 = h.aio_pwrite(wb, OFF)\n\
         \x20       else:\n\
         \x20           c2 = h.aio_pwrite(wb, OFF)\n\
         \x20           c1 = h.aio_pread(rb, OFF)\n\
         \x20       d1 = d2 = False\n\
         \x20       while not (d1 and d2):\n\
         \x20           d1 = d1 or h.aio_command_completed(c1)\n\
         \x20           d2 = d2 or h.aio_command_completed(c2)\n\
         \x20           if not (d1 and d2):\n\
         \x20               h.poll(-1)\n\
         \x20       got = rb.to_bytearray()\n\
         \x20       assert len(set(got)) == 1, ('a mix', i, sorted(set(got))[:8])\n\
         finally:\n\
         \x20   stop.set()\n\
         \x20   t.join()\n"
    );
    python_nbd(&script, "reads racing writes");
    let stats = server.rpc("volume_get_stats", r#"{"name":"vol"}"#);
    let lent = stats["lent_reads"].as_u64().expect("lent_reads");
    eprintln!("{lent} reads lent under racing writes");
    assert!(lent > 0, "the racing reads were lent: {stats}");
    let mut server = server;
    server.assert_healthy();
}
