//! Growing a replicated volume online (issue 30): `volume_resize` has the
//! engine hold new writes, drain those in flight, grow every replica
//! (GROW, replica protocol v7) and then itself. Real clients: qemu-io
//! writes and checks patterns, fio keeps writing (with verify) through the
//! grow, nbdinfo sees the new size on a new connection; replicas are
//! restarted afterwards and must come back at the new size, healthy.
//!
//! ```text
//! cargo test -p lull --profile ci --test replication grow::
//! ```

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::state::all_healthy;
use crate::common::tools::{self, run, uri};
use crate::common::{self, require, Kind, Replica, Scratch, Server};

const HEAL_TIMEOUT: Duration = Duration::from_secs(120);
const OLD_BYTES: u64 = 64 << 20;
const NEW_BYTES: u64 = 128 << 20;

/// A 64 MiB volume "v" on a `lull replica` process and a store replica.
fn start(dir: &str) -> (Scratch, Replica, Replica, Server) {
    let scratch = Scratch::new(dir);
    let a = Replica::start(Kind::Process, &scratch.join("a"), "64M");
    let b = Replica::start(Kind::Store, &scratch.join("b"), "64M");
    let spec = format!("v:64M:replicas={}+{}", a.target(), b.target());
    let server = Server::start(&["--replica-insecure", "--volume", &spec]);
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy", all_healthy);
    (scratch, a, b, server)
}

fn nbdinfo_size(server: &Server) -> u64 {
    require("nbdinfo", "libnbd-bin");
    let out = run(Command::new("nbdinfo").args(["--size", &uri(server, "v")]));
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("nbdinfo --size prints a number")
}

fn writes(server: &Server) -> u64 {
    server.rpc("volume_get_stats", r#"{"name":"v"}"#)["writes"]
        .as_u64()
        .expect("volume_get_stats has writes")
}

/// Kills `r`, waits for the engine to see it failed, starts it again and
/// waits for every replica healthy: it came back at the new size (a
/// replica at another size is refused at HELLO, never healthy).
fn restart(server: &Server, r: &mut Replica) {
    r.kill();
    server.wait_replicas("v", HEAL_TIMEOUT, "the killed replica failed", |rs| {
        rs.iter().any(|x| x.state == "failed")
    });
    r.restart();
    server.wait_replicas(
        "v",
        HEAL_TIMEOUT,
        "healthy again after a restart",
        all_healthy,
    );
}

/// Reads `cmds` with `other` killed (the replica left serves alone),
/// then starts it again and waits for both healthy.
fn read_alone(server: &Server, other: &mut Replica, cmds: &[String]) {
    other.kill();
    server.wait_replicas("v", HEAL_TIMEOUT, "the other replica failed", |rs| {
        rs.iter().any(|x| x.state == "failed")
    });
    tools::qemu_io(server, "v", cmds);
    other.restart();
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy again", all_healthy);
}

/// A 2-replica volume (one replica a process, one in a store) written
/// with a pattern grows from 64 to 128 MiB while fio writes with verify;
/// a new connection sees 128 MiB, the old data is intact, the new range
/// reads zeros and takes writes; each replica restarted comes back at
/// the new size and healthy (the store's record has it), and the data
/// reads the same from each.
#[test]
fn a_replicated_volume_grows_online_under_io() {
    require("fio", "fio");
    let (_scratch, mut a, mut b, mut server) = start("grow-online");
    tools::qemu_io(&server, "v", &["write -P 0xa5 0 8M"]);
    let before = writes(&server);
    let fio = Command::new("fio")
        .args([
            "--name=w",
            "--ioengine=nbd",
            &format!("--uri={}", uri(&server, "v")),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--offset=16M",
            "--size=32M",
            "--time_based",
            "--runtime=6",
            "--verify=crc32c",
            "--verify_backlog=64",
            "--output-format=json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start fio");
    // The grow lands while fio writes: wait until its writes arrive.
    assert!(
        common::state::wait_until(Duration::from_secs(30), || writes(&server) > before + 1000),
        "fio's writes never arrived; log:\n{}",
        server.stderr()
    );
    let reply = server.rpc("volume_resize", r#"{"name": "v", "size": "128M"}"#);
    assert_eq!(reply["size_bytes"].as_u64(), Some(NEW_BYTES), "{reply}");
    assert!(
        writes(&server) > before + 1000,
        "fio was writing during the grow"
    );
    let out = fio.wait_with_output().expect("fio");
    let report = common::fio_json(&out);
    assert_eq!(report["jobs"][0]["error"], 0, "{report}");
    server.assert_logged(&["grown from 67108864 to 134217728 bytes on 2 replica(s)"]);
    server.wait_replicas("v", HEAL_TIMEOUT, "both still healthy", all_healthy);

    assert_eq!(nbdinfo_size(&server), NEW_BYTES, "a new connection");
    let checks = [
        "read -P 0xa5 0 8M".to_string(),
        format!(
            "read -P 0 {OLD_BYTES} {}",
            NEW_BYTES - OLD_BYTES - (4 << 20)
        ),
    ];
    tools::qemu_io(&server, "v", &checks);
    let writes_new = [
        format!("write -P 0x3c {} 8192", OLD_BYTES - 4096),
        format!("write -P 0x5e {} 4M", NEW_BYTES - (4 << 20)),
        format!("read -P 0x3c {} 8192", OLD_BYTES - 4096),
        format!("read -P 0x5e {} 4M", NEW_BYTES - (4 << 20)),
    ];
    tools::qemu_io(&server, "v", &writes_new);
    let all = [
        "read -P 0xa5 0 8M".to_string(),
        format!("read -P 0x3c {} 8192", OLD_BYTES - 4096),
        format!("read -P 0 {} 4M", OLD_BYTES + 4096),
        format!("read -P 0x5e {} 4M", NEW_BYTES - (4 << 20)),
    ];

    // Each replica restarted (a process asked for 64M, a store from its
    // record) comes back at 128 MiB and healthy; then each is read alone.
    restart(&server, &mut a);
    restart(&server, &mut b);
    let record = std::fs::read_to_string(b.replica_dir().join("../../store.json"))
        .expect("the store's record");
    assert!(
        record.contains(&format!("\"size_bytes\": {NEW_BYTES}")),
        "store.json has the new size: {record}"
    );
    read_alone(&server, &mut b, &all);
    read_alone(&server, &mut a, &all);
    assert_eq!(nbdinfo_size(&server), NEW_BYTES);
    server.assert_healthy();
}

/// What a grow refuses, with the reason and the volume left as it was:
/// a smaller size, one not a multiple of 4 KiB, one that would change
/// the region sizes, and any size while a replica is away. Once it is
/// back and healthy, the grow goes through.
#[test]
fn growing_a_replicated_volume_refuses_bad_sizes_and_a_replica_away() {
    let (_scratch, _a, mut b, mut server) = start("grow-refused");
    let refused = |params: &str, want: &str| {
        let (ok, out) = common::rpc_outcome(server.rpc_socket(), "volume_resize", params);
        assert!(!ok && out.contains(want), "{params}: {out}");
    };
    refused(r#"{"name": "v", "size": "32M"}"#, "cannot shrink");
    refused(
        &format!(r#"{{"name": "v", "size": {}}}"#, OLD_BYTES + 512),
        "multiple of 4096",
    );
    refused(r#"{"name": "v", "size": "128G"}"#, "region size");
    b.kill();
    server.wait_replicas("v", HEAL_TIMEOUT, "b failed", |rs| {
        rs.iter().any(|x| x.state == "failed")
    });
    refused(
        r#"{"name": "v", "size": "128M"}"#,
        "grows only with every replica healthy",
    );
    assert_eq!(nbdinfo_size(&server), OLD_BYTES, "the size stays");
    b.restart();
    server.wait_replicas("v", HEAL_TIMEOUT, "b healthy again", all_healthy);
    let reply = server.rpc("volume_resize", r#"{"name": "v", "size": "128M"}"#);
    assert_eq!(reply["size_bytes"].as_u64(), Some(NEW_BYTES), "{reply}");
    // The same size again: nothing to do, no error.
    let reply = server.rpc("volume_resize", r#"{"name": "v", "size": "128M"}"#);
    assert_eq!(reply["size_bytes"].as_u64(), Some(NEW_BYTES), "{reply}");
    assert_eq!(nbdinfo_size(&server), NEW_BYTES);
    server.assert_healthy();
}
