//! Backups end to end: what goes to the target comes back byte for byte
//! (nbdcopy of the restored volume against nbdcopy of the volume when it
//! was backed up), incrementals read and send only what changed, a
//! clone's backup sends nothing new, deletes collect garbage, damage is
//! found and named, a daemon killed mid-backup lists nothing half-done,
//! and an exposed backup reads before anything was restored.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::common::replica::{Kind, Replica};
use crate::common::state::all_healthy;
use crate::common::{self, require, tools, Scratch, Server};
use crate::s3::S3;

const HEAL_TIMEOUT: Duration = Duration::from_secs(120);

/// `lull rpc` with a timeout a `"wait": true` job fits in.
fn rpc(server: &Server, method: &str, params: &str) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_lull"))
        .args(["rpc", "--timeout", "600", "--socket"])
        .arg(server.rpc_socket())
        .args([method, params])
        .output()
        .expect("run lull rpc");
    assert!(
        out.status.success(),
        "lull rpc {method} {params} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("rpc JSON")
}

/// The error text of a call that must fail.
fn refused(server: &Server, method: &str, params: &str) -> String {
    let (ok, text) = common::rpc_outcome(server.rpc_socket(), method, params);
    assert!(!ok, "{method} {params} should be refused: {text}");
    text
}

fn add_s3(server: &Server, s3: &S3, scratch: &Path, name: &str, prefix: &str) {
    let creds = s3.credentials(scratch);
    let p = serde_json::json!({"name": name, "url": s3.url(prefix), "credentials_file": creds});
    rpc(server, "backup_target_add", &p.to_string());
}

fn add_dir(server: &Server, dir: &Path, name: &str) {
    std::fs::create_dir_all(dir).expect("target directory");
    let p = serde_json::json!({"name": name, "url": format!("file://{}", dir.display())});
    rpc(server, "backup_target_add", &p.to_string());
}

/// A backup of `volume` to `target`, waited for: its result (the summary
/// with stats). Fails the test when the job failed.
fn backup(server: &Server, volume: &str, target: &str) -> Value {
    let p = serde_json::json!({"volume": volume, "target": target, "wait": true});
    let r = rpc(server, "backup_create", &p.to_string());
    assert_eq!(r["job"]["state"], "done", "backup of {volume} failed: {r}");
    r["job"]["result"].clone()
}

/// A restore, waited for: the job as it ended.
fn restore(server: &Server, target: &str, backup: &str, name: &str, backend: &str) -> Value {
    let p = serde_json::json!({"target": target, "backup": backup, "name": name,
        "backend": backend, "wait": true});
    rpc(server, "backup_restore", &p.to_string())
}

/// nbdcopy of an export into a file.
fn image(server: &Server, export: &str, file: &Path) {
    require("nbdcopy", "libnbd-bin");
    let out = tools::run(
        Command::new("nbdcopy")
            .arg(tools::uri(server, export))
            .arg(file),
    );
    assert!(out.status.success(), "nbdcopy {export}: {out:?}");
}

fn assert_same(a: &Path, b: &Path) {
    let out = tools::run(Command::new("cmp").arg(a).arg(b));
    assert!(
        out.status.success(),
        "{} and {} differ: {}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Incompressible data, `len` bytes, into `file`: a new seed each call,
/// so no two calls write the same chunks.
fn random_file(file: &Path, len: usize) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEED: AtomicU64 = AtomicU64::new(1);
    let seed = SEED.fetch_add(1, Ordering::Relaxed) ^ u64::from(std::process::id()) << 32;
    std::fs::write(file, common::pattern(seed, len)).expect("write random data");
}

/// Writes `file` into `export` at `offset` with qemu-img (the volume's
/// own size stays).
fn write_file(server: &Server, export: &str, file: &Path, offset: u64) {
    let len = std::fs::metadata(file).expect("file").len();
    let out = tools::run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        &format!("write -s {} {offset} {len}", file.display()),
        &tools::uri(server, export),
    ]));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && !text.contains("failed"),
        "qemu-io: {text}"
    );
}

/// Backs `volume` up to `target` and restores that backup into a new
/// memory volume `restored`: the two read the same (nbdcopy and cmp).
/// Returns the backup's summary.
fn round_trip(
    server: &Server,
    scratch: &Path,
    volume: &str,
    target: &str,
    restored: &str,
) -> Value {
    let b = backup(server, volume, target);
    let want = scratch.join(format!("{volume}-want.img"));
    image(server, volume, &want);
    let r = restore(
        server,
        target,
        b["id"].as_str().unwrap(),
        restored,
        "malloc",
    );
    assert_eq!(r["state"], "done", "{r}");
    let got = scratch.join(format!("{restored}-got.img"));
    image(server, restored, &got);
    assert_same(&want, &got);
    b
}

/// Full, then incremental: both restore byte-identical, the incremental
/// read only the changed chunks and named the full one its parent.
fn full_then_incremental(server: &Server, scratch: &Scratch, target: &str, volume: &str) {
    let data = scratch.join("data");
    random_file(&data, 5 << 20);
    write_file(server, volume, &data, 0);
    tools::qemu_io(server, volume, &["write -P 0x5c 30M 1M"]);
    let first = backup(server, volume, target);
    let first_img = scratch.join("first.img");
    image(server, volume, &first_img);
    assert_eq!(first["parent"], Value::Null);
    assert_eq!(first["stats"]["chunks_uploaded"], 4, "{first}");
    // One chunk rewritten, one written anew.
    tools::qemu_io(
        server,
        volume,
        &["write -P 0x77 1M 4k", "write -P 0x78 40M 64k"],
    );
    let second = backup(server, volume, target);
    let second_img = scratch.join("second.img");
    image(server, volume, &second_img);
    assert_eq!(second["parent"], first["id"], "{second}");
    let stats = &second["stats"];
    assert_eq!(
        stats["bytes_read"],
        2 * (2 << 20),
        "only the 2 changed chunks read: {stats}"
    );
    // Both are patches (over the parent's chunk, and over zeros): their
    // 17 blocks sent, not two chunks.
    assert_eq!(stats["chunks_patched"], 2, "{stats}");
    assert_eq!(stats["chunks_uploaded"], 0, "{stats}");
    assert!(
        stats["bytes_uploaded"].as_u64().unwrap() < 17 * 4096 + 4096,
        "{stats}"
    );
    assert!(stats["chunks_unchanged"].as_u64().unwrap() >= 3, "{stats}");
    for (b, img, which) in [
        (&first, &first_img, "first"),
        (&second, &second_img, "second"),
    ] {
        let name = &format!("{volume}-{which}");
        let r = restore(server, target, b["id"].as_str().unwrap(), name, "malloc");
        assert_eq!(r["state"], "done", "{r}");
        let got = scratch.join(format!("{name}.img"));
        image(server, name, &got);
        assert_same(img, &got);
    }
}

/// The manifest of backup `id` on a directory target.
fn manifest(dir: &Path, id: &str) -> Value {
    let text = std::fs::read(dir.join("backups").join(format!("{id}.json"))).expect("manifest");
    serde_json::from_slice(&text).expect("manifest JSON")
}

/// Writes scattered over a volume: an incremental sends the changed 4 KiB
/// blocks as patches of the parent's chunks (the next one folds its
/// parent's patch in, a chunk rewritten whole is sent whole); every
/// backup restores, exposes and verifies byte-identical; a damaged patch
/// is named; deleting the parent keeps the chunks the patches stand on.
#[test]
fn scattered_writes_back_up_as_patches_of_their_chunks() {
    let scratch = Scratch::new("backup-patches");
    let dir = scratch.join("nfs");
    let server = Server::start(&["--volume", "v:16M"]);
    add_dir(&server, &dir, "dir");
    let data = scratch.join("data");
    random_file(&data, 8 << 20);
    write_file(&server, "v", &data, 0);
    let first = backup(&server, "v", "dir");
    let imgs = [
        scratch.join("1.img"),
        scratch.join("2.img"),
        scratch.join("3.img"),
    ];
    image(&server, "v", &imgs[0]);
    // Three random blocks in each of the 4 written chunks, one in an
    // unwritten one.
    let block = scratch.join("block");
    let blocks = [
        5u64, 300, 511, 521, 712, 912, 1024, 1500, 1535, 1613, 1614, 2047, 3000,
    ];
    for at in blocks {
        random_file(&block, 4096);
        write_file(&server, "v", &block, at * 4096);
    }
    let second = backup(&server, "v", "dir");
    image(&server, "v", &imgs[1]);
    let stats = &second["stats"];
    let changed = blocks.len() as u64 * 4096;
    assert_eq!(stats["chunks_patched"], 5, "{stats}");
    assert_eq!(stats["chunks_uploaded"], 0, "{stats}");
    let sent = stats["bytes_uploaded"].as_u64().unwrap();
    // The test's data compresses a little (zstd takes ~12 %): at most
    // 1.1x the changed bytes, and more than half of them.
    assert!(
        sent * 2 >= changed && sent * 10 <= changed * 11,
        "an incremental of {changed} changed bytes sent {sent}: {stats}"
    );
    // Again over the same chunk (its parent's patch folded in), and chunk
    // 3 rewritten whole.
    random_file(&block, 4096);
    write_file(&server, "v", &block, 6 * 4096);
    random_file(&data, 2 << 20);
    write_file(&server, "v", &data, 6 << 20);
    let third = backup(&server, "v", "dir");
    image(&server, "v", &imgs[2]);
    let stats = &third["stats"];
    assert_eq!(stats["chunks_patched"], 1, "{stats}");
    assert_eq!(stats["chunks_uploaded"], 1, "{stats}");
    let m3 = manifest(&dir, third["id"].as_str().unwrap());
    assert_eq!(m3["format"], 2, "{m3}");
    assert_eq!(
        m3["patches"]["0"]["blocks"], 4,
        "blocks 5, 300, 511 and 6: {m3}"
    );
    assert!(m3["patches"].get("3").is_none(), "{m3}");
    let ids: Vec<String> = [&first, &second, &third]
        .iter()
        .map(|b| b["id"].as_str().unwrap().to_string())
        .collect();
    for (k, (id, img)) in ids.iter().zip(&imgs).enumerate() {
        let name = format!("r{k}");
        let r = restore(&server, "dir", id, &name, "malloc");
        assert_eq!(r["state"], "done", "{r}");
        let got = scratch.join(format!("{name}.img"));
        image(&server, &name, &got);
        assert_same(img, &got);
        let one = serde_json::json!({"target": "dir", "id": id, "wait": true}).to_string();
        assert_eq!(rpc(&server, "backup_verify", &one)["state"], "done");
    }
    let e = rpc(
        &server,
        "backup_expose",
        &format!(
            r#"{{"target": "dir", "backup": "{}", "name": "x"}}"#,
            ids[2]
        ),
    );
    assert_eq!(e["name"], "x");
    let got = scratch.join("exposed.img");
    image(&server, "x", &got);
    assert_same(&imgs[2], &got);
    rpc(&server, "backup_unexpose", r#"{"name": "x"}"#);
    // The third's patches stand on the first's chunks and hold the
    // second's objects: deleting both collects none of them.
    for id in &ids[..2] {
        let p = serde_json::json!({"target": "dir", "id": id});
        rpc(&server, "backup_delete", &p.to_string());
    }
    let r = restore(&server, "dir", &ids[2], "r3", "malloc");
    assert_eq!(r["state"], "done", "{r}");
    let got = scratch.join("r3.img");
    image(&server, "r3", &got);
    assert_same(&imgs[2], &got);
    // A damaged patch: verify names it, a restore fails and leaves nothing.
    let object = m3["patches"]["0"]["object"].as_str().unwrap();
    let path = dir.join("chunks").join(&object[..2]).join(object);
    let mut bytes = std::fs::read(&path).expect("the patch object");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    let one = serde_json::json!({"target": "dir", "id": ids[2], "wait": true}).to_string();
    let v = rpc(&server, "backup_verify", &one);
    assert_eq!(v["state"], "failed", "{v}");
    assert!(v["error"].as_str().unwrap().contains(object), "{v}");
    let r = restore(&server, "dir", &ids[2], "r4", "malloc");
    assert_eq!(r["state"], "failed", "{r}");
}

/// A memory volume to S3 and a file volume to a directory: full and
/// incremental backups restore byte-identical.
#[test]
fn memory_and_file_volumes_back_up_and_restore_identical() {
    let scratch = Scratch::new("backup-local");
    let s3 = S3::start(&scratch.join("s3"));
    let file = scratch.join("vol.img");
    let spec_file = format!("f:64M:file={}", file.display());
    let server = Server::start(&["--volume", "m:64M", "--volume", &spec_file]);
    add_s3(&server, &s3, &scratch, "s3", "local");
    add_dir(&server, &scratch.join("nfs"), "dir");
    let m = Scratch::new("backup-local-m");
    full_then_incremental(&server, &m, "s3", "m");
    let f = Scratch::new("backup-local-f");
    full_then_incremental(&server, &f, "dir", "f");
    // Both targets list what they hold, per volume.
    let listed = rpc(&server, "backup_list", r#"{"target": "s3", "volume": "m"}"#);
    assert_eq!(listed.as_array().unwrap().len(), 2);
    assert!(s3.dir("local").join("lull-backup.json").is_file());
    // The backup's own snapshots: only the newest is kept as the next base.
    let snaps = rpc(&server, "snapshot_list", r#"{"volume": "m"}"#);
    assert_eq!(snaps.as_array().unwrap().len(), 1, "{snaps}");
}

/// A 2-replica volume backs up through its engine and restores into a new
/// replicated volume (and a memory one), byte-identical.
#[test]
fn a_replicated_volume_backs_up_and_restores_into_new_replicas() {
    let scratch = Scratch::new("backup-replicated");
    let s3 = S3::start(&scratch.join("s3"));
    let a = Replica::start(Kind::Process, &scratch.join("a"), "64M");
    let b = Replica::start(Kind::Process, &scratch.join("b"), "64M");
    let spec = format!("v:64M:replicas={}+{}", a.target(), b.target());
    let server = Server::start(&["--replica-insecure", "--volume", &spec]);
    server.wait_replicas("v", HEAL_TIMEOUT, "both healthy", all_healthy);
    add_s3(&server, &s3, &scratch, "s3", "replicated");
    full_then_incremental(&server, &scratch, "s3", "v");
    let c = Replica::start(Kind::Process, &scratch.join("c"), "64M");
    let d = Replica::start(Kind::Process, &scratch.join("d"), "64M");
    let last = rpc(&server, "backup_list", r#"{"target": "s3", "volume": "v"}"#);
    let id = last.as_array().unwrap().last().unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let backend = format!("replicas={}+{}", c.target(), d.target());
    let r = restore(&server, "s3", &id, "w", &backend);
    assert_eq!(r["state"], "done", "{r}");
    server.wait_replicas("w", HEAL_TIMEOUT, "both healthy", all_healthy);
    let got = scratch.join("w.img");
    image(&server, "w", &got);
    assert_same(&scratch.join("second.img"), &got);
}

/// A clone of a backed-up volume's snapshot sends nothing new; deleting
/// backups collects the chunks only they held, and nothing else.
#[test]
fn clones_deduplicate_and_deletes_collect_garbage() {
    let scratch = Scratch::new("backup-dedup");
    let s3 = S3::start(&scratch.join("s3"));
    let server = Server::start(&["--volume", "v:32M"]);
    add_s3(&server, &s3, &scratch, "s3", "dedup");
    let data = scratch.join("data");
    random_file(&data, 8 << 20);
    write_file(&server, "v", &data, 0);
    let first = backup(&server, "v", "s3");
    rpc(
        &server,
        "snapshot_create",
        r#"{"volume": "v", "name": "s"}"#,
    );
    rpc(
        &server,
        "volume_clone",
        r#"{"snapshot": "v@s", "name": "c", "backend": "malloc"}"#,
    );
    let clone = backup(&server, "c", "s3");
    let stats = &clone["stats"];
    assert_eq!(
        stats["chunks_uploaded"], 0,
        "a clone's backup sends nothing: {stats}"
    );
    assert_eq!(stats["chunks_deduplicated"], 4, "{stats}");
    // New data in v: its next backup holds chunks the others do not.
    random_file(&data, 4 << 20);
    write_file(&server, "v", &data, 16 << 20);
    let second = backup(&server, "v", "s3");
    assert_eq!(second["stats"]["chunks_uploaded"], 2, "{second}");
    let chunks = || walk(&s3.dir("dedup").join("chunks"));
    assert_eq!(chunks(), 6);
    // The first and the clone's share their chunks with the second's
    // unchanged ones: deleting the second frees its 2 new chunks.
    let d = rpc(
        &server,
        "backup_delete",
        &format!(
            r#"{{"target": "s3", "id": "{}"}}"#,
            second["id"].as_str().unwrap()
        ),
    );
    assert_eq!(d["gc"]["chunks_deleted"], 2, "{d}");
    assert_eq!(chunks(), 4);
    for b in [&first, &clone] {
        let d = rpc(
            &server,
            "backup_delete",
            &format!(
                r#"{{"target": "s3", "id": "{}"}}"#,
                b["id"].as_str().unwrap()
            ),
        );
        assert!(d["gc"].is_object(), "{d}");
    }
    assert_eq!(chunks(), 0, "no manifest left, no chunk left");
}

/// Files under `dir`, recursively.
fn walk(dir: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.map(|e| e.expect("dir entry").path())
        .map(|p| if p.is_dir() { walk(&p) } else { 1 })
        .sum()
}

/// A chunk flipped or missing on the target: verify fails naming it, a
/// restore fails naming it and leaves no volume behind.
#[test]
fn damaged_chunks_are_found_and_named() {
    let scratch = Scratch::new("backup-damage");
    let s3 = S3::start(&scratch.join("s3"));
    let server = Server::start(&["--volume", "v:16M"]);
    add_s3(&server, &s3, &scratch, "s3", "damage");
    let data = scratch.join("data");
    random_file(&data, 6 << 20);
    write_file(&server, "v", &data, 0);
    let b = backup(&server, "v", "s3");
    let id = b["id"].as_str().unwrap();
    let one = serde_json::json!({"target": "s3", "id": id, "wait": true}).to_string();
    assert_eq!(rpc(&server, "backup_verify", &one)["state"], "done");
    let mut files: Vec<PathBuf> = Vec::new();
    collect(&s3.dir("damage").join("chunks"), &mut files);
    files.sort();
    assert_eq!(files.len(), 3);
    let flipped = &files[0];
    let mut bytes = std::fs::read(flipped).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(flipped, bytes).unwrap();
    std::fs::remove_file(&files[1]).unwrap();
    let v = rpc(&server, "backup_verify", &one);
    assert_eq!(v["state"], "failed", "{v}");
    let err = v["error"].as_str().unwrap();
    for f in &files[..2] {
        let name = f.file_name().unwrap().to_str().unwrap();
        assert!(err.contains(name), "verify names {name}: {err}");
    }
    assert!(err.contains("missing"), "{err}");
    let r = restore(&server, "s3", id, "r", "malloc");
    assert_eq!(r["state"], "failed", "{r}");
    let err = r["error"].as_str().unwrap();
    assert!(err.contains("chunk") && err.contains("bad"), "{err}");
    let vols = rpc(&server, "volume_list", "{}");
    assert!(
        !vols.to_string().contains("\"r\""),
        "a failed restore leaves no volume: {vols}"
    );
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten() {
        let p = e.expect("entry").path();
        if p.is_dir() {
            collect(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// `lull serve` SIGKILLed in the middle of a backup: nothing is listed
/// half-done, the chunks it sent are collected, and the next backup
/// completes and restores identical.
#[test]
fn a_backup_cut_by_sigkill_is_never_listed() {
    let scratch = Scratch::new("backup-kill");
    let s3 = S3::start(&scratch.join("s3"));
    let store = scratch.join("store");
    let store_arg = store.display().to_string();
    let mut server = Server::start(&[
        "--store",
        &store_arg,
        "--replica-listen",
        "127.0.0.1:0",
        "--replica-insecure",
        "--volume",
        "v:64M",
    ]);
    add_s3(&server, &s3, &scratch, "s3", "kill");
    let data = scratch.join("data");
    random_file(&data, 32 << 20);
    write_file(&server, "v", &data, 0);
    // 2 MB/s: 32 MiB takes ~16 s, killed after the first chunks landed.
    let r = rpc(
        &server,
        "backup_create",
        r#"{"volume": "v", "target": "s3", "bandwidth_mbytes_per_sec": 2}"#,
    );
    let job = r["job"]["id"].as_str().unwrap().to_string();
    let sent = common::wait_until(Duration::from_secs(30), || {
        let j = rpc(&server, "backup_job_get", &format!(r#"{{"id": "{job}"}}"#));
        j["sent_bytes"].as_u64().unwrap_or(0) > 0
    });
    assert!(sent, "the backup sent nothing in 30 s");
    server.kill();
    // The target survives the daemon: recorded under its store.
    let server = Server::start(&[
        "--store",
        &store_arg,
        "--replica-listen",
        "127.0.0.1:0",
        "--replica-insecure",
        "--volume",
        "v:64M",
    ]);
    let listed = rpc(&server, "backup_list", r#"{"target": "s3"}"#);
    assert_eq!(
        listed,
        serde_json::json!([]),
        "a cut backup is never listed"
    );
    assert!(
        walk(&s3.dir("kill").join("chunks")) > 0,
        "the cut backup sent chunks"
    );
    // The killed daemon's lock is seen as gone (its pid is dead).
    let gc = rpc(&server, "backup_gc", r#"{"target": "s3"}"#);
    assert!(gc["chunks_deleted"].as_u64().unwrap() > 0, "{gc}");
    assert_eq!(walk(&s3.dir("kill").join("chunks")), 0);
    write_file(&server, "v", &data, 0);
    round_trip(&server, &scratch, "v", "s3", "r");
}

/// An exposed backup is a read-only export that nbdcopy, qemu-img and
/// nbdinfo read before anything was restored, holes where the volume
/// had none of its data.
#[test]
fn an_exposed_backup_reads_before_it_is_restored() {
    let scratch = Scratch::new("backup-expose");
    let s3 = S3::start(&scratch.join("s3"));
    let server = Server::start(&["--volume", "v:32M"]);
    add_s3(&server, &s3, &scratch, "s3", "expose");
    let data = scratch.join("data");
    random_file(&data, 3 << 20);
    write_file(&server, "v", &data, 8 << 20);
    let b = backup(&server, "v", "s3");
    let id = b["id"].as_str().unwrap();
    let want = scratch.join("want.img");
    image(&server, "v", &want);
    // The operator's command line says the same as the RPC.
    let out = Command::new(env!("CARGO_BIN_EXE_lull"))
        .arg("backup")
        .arg("--socket")
        .arg(server.rpc_socket())
        .args(["list", "--target", "s3"])
        .output()
        .expect("run lull backup");
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && listed.contains(id),
        "lull backup list: {listed}"
    );
    let e = rpc(
        &server,
        "backup_expose",
        &format!(r#"{{"target": "s3", "backup": "{id}", "name": "old"}}"#),
    );
    assert_eq!(e["name"], "old");
    let got = scratch.join("got.img");
    image(&server, "old", &got);
    assert_same(&want, &got);
    let out = tools::run(
        Command::new("qemu-img")
            .args(["compare", "-f", "raw", "-F", "raw"])
            .arg(tools::uri(&server, "old"))
            .arg(&want),
    );
    assert!(out.status.success(), "qemu-img compare: {out:?}");
    let map = tools::nbdinfo_map(&server, "old");
    assert!(
        map.iter().any(|(off, _, t)| *off == 0 && t & 1 == 1),
        "a hole at 0: {map:?}"
    );
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write 0 4k"])
        .arg(tools::uri(&server, "old"))
        .output()
        .expect("run qemu-io");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() && text.contains("Permission denied"),
        "a write to an exposed backup is refused: {text}"
    );
    rpc(&server, "backup_unexpose", r#"{"name": "old"}"#);
    refused(&server, "backup_unexpose", r#"{"name": "old"}"#);
}

/// An encrypted target holds no plaintext; its key is checked when the
/// target is added; the backup restores identical.
#[test]
fn an_encrypted_target_holds_ciphertext_and_refuses_another_key() {
    let scratch = Scratch::new("backup-crypt");
    let server = Server::start(&["--volume", "v:16M"]);
    let dir = scratch.join("nfs");
    std::fs::create_dir_all(&dir).unwrap();
    let key = scratch.join("key");
    std::fs::write(&key, [0x11u8; 32]).unwrap();
    let add = |name: &str, key: &Path| {
        serde_json::json!({"name": name, "url": format!("file://{}", dir.display()), "key_file": key}).to_string()
    };
    rpc(&server, "backup_target_add", &add("enc", &key));
    tools::qemu_io(&server, "v", &["write -P 0x61 0 2M"]);
    round_trip(&server, &scratch, "v", "enc", "r");
    let mut files = Vec::new();
    collect(&dir.join("chunks"), &mut files);
    assert_eq!(files.len(), 1);
    let stored = std::fs::read(&files[0]).unwrap();
    assert!(
        !stored.windows(64).any(|w| w.iter().all(|&x| x == 0x61)),
        "plaintext on the target"
    );
    let other = scratch.join("other-key");
    std::fs::write(&other, [0x22u8; 32]).unwrap();
    let e = refused(&server, "backup_target_add", &add("enc2", &other));
    assert!(e.contains("another key"), "{e}");
    let e = refused(
        &server,
        "backup_target_add",
        &serde_json::json!({"name": "plain", "url": format!("file://{}", dir.display())})
            .to_string(),
    );
    assert!(e.contains("encrypted"), "{e}");
    let listed = rpc(&server, "backup_target_list", "{}").to_string();
    assert!(
        !listed.contains("\\u0011") && listed.contains("key_file"),
        "{listed}"
    );
}

/// What an operator gets wrong, and a target that is not there: clear
/// errors, nothing created.
#[test]
fn bad_targets_and_requests_get_clear_errors() {
    let scratch = Scratch::new("backup-faults");
    let s3 = S3::start(&scratch.join("s3"));
    let mut server = Server::start(&["--volume", "v:64M", "--volume", "n:16M:faulty=malloc"]);
    let creds = s3.credentials(&scratch);
    let dead = common::free_port();
    let cases = [
        (
            serde_json::json!({"name": "t", "url": format!("s3://lulltest/x?endpoint=http://{dead}"), "credentials_file": creds}),
            "target t",
        ),
        (
            serde_json::json!({"name": "t", "url": s3.url("x"), "credentials_file": scratch.join("missing")}),
            "credentials file",
        ),
        (
            serde_json::json!({"name": "t", "url": format!("s3://nobucket/x?endpoint=http://{}", s3.addr), "credentials_file": creds}),
            "target t",
        ),
        (
            serde_json::json!({"name": "t", "url": "file:///nonexistent/lull/target"}),
            "does not exist",
        ),
        (
            serde_json::json!({"name": "t/x", "url": "file:///tmp"}),
            "target name",
        ),
        (serde_json::json!({"name": "t", "url": "ftp://x"}), "s3://"),
    ];
    for (p, want) in &cases {
        let e = refused(&server, "backup_target_add", &p.to_string());
        assert!(e.contains(want), "{p}: {e}");
    }
    let wrong = scratch.join("wrong");
    std::fs::write(&wrong, "access_key_id = nope\nsecret_access_key = nope\n").unwrap();
    let e = refused(
        &server,
        "backup_target_add",
        &serde_json::json!({"name": "t", "url": s3.url("x"), "credentials_file": wrong})
            .to_string(),
    );
    assert!(
        e.contains("target t") && !e.contains("nope"),
        "wrong credentials, no secret echoed: {e}"
    );
    assert_eq!(
        rpc(&server, "backup_target_list", "{}"),
        serde_json::json!([])
    );
    add_s3(&server, &s3, &scratch, "s3", "faults");
    let data = scratch.join("data");
    random_file(&data, 16 << 20);
    write_file(&server, "v", &data, 0);
    // Two backups of one volume: the second is refused while the first runs.
    let slow = rpc(
        &server,
        "backup_create",
        r#"{"volume": "v", "target": "s3", "bandwidth_mbytes_per_sec": 4}"#,
    );
    let e = refused(
        &server,
        "backup_create",
        r#"{"volume": "v", "target": "s3"}"#,
    );
    assert!(e.contains("runs already"), "{e}");
    let job = slow["job"]["id"].as_str().unwrap();
    let j = rpc(
        &server,
        "backup_job_get",
        &format!(r#"{{"id": "{job}", "wait": true}}"#),
    );
    assert_eq!(j["state"], "done", "{j}");
    for (method, p, want) in [
        (
            "backup_create",
            r#"{"volume": "nope", "target": "s3"}"#,
            "no volume",
        ),
        (
            "backup_create",
            r#"{"volume": "n", "target": "s3"}"#,
            "takes no snapshots",
        ),
        (
            "backup_create",
            r#"{"volume": "v", "target": "nope"}"#,
            "no backup target",
        ),
        (
            "backup_create",
            r#"{"volume": "v", "target": "s3", "snapshot": "nope"}"#,
            "no snapshot",
        ),
        (
            "backup_get",
            r#"{"target": "s3", "id": "../../x"}"#,
            "backup id",
        ),
        (
            "backup_get",
            r#"{"target": "s3", "id": "bk-0000000000000-00000000"}"#,
            "no backup",
        ),
        (
            "backup_restore",
            r#"{"target": "s3", "backup": "bk-0000000000000-00000000", "name": "r"}"#,
            "no backup",
        ),
    ] {
        let e = refused(&server, method, p);
        assert!(e.contains(want), "{method} {p}: {e}");
    }
    let id = j["backup"].as_str().unwrap();
    let e = refused(
        &server,
        "backup_restore",
        &format!(r#"{{"target": "s3", "backup": "{id}", "name": "v"}}"#),
    );
    assert!(e.contains("exists already"), "{e}");
    server.assert_healthy();
}

/// A schedule backs a volume up every interval, keeps its last 2 backups
/// (deleting and collecting the rest), and is resumed after a restart.
#[test]
fn a_schedule_backs_up_keeps_its_last_and_survives_a_restart() {
    let scratch = Scratch::new("backup-schedule");
    let s3 = S3::start(&scratch.join("s3"));
    let store = scratch.join("store");
    let store_arg = store.display().to_string();
    let args = [
        "--store",
        &store_arg,
        "--replica-listen",
        "127.0.0.1:0",
        "--replica-insecure",
        "--volume",
        "v:16M",
    ];
    let mut server = Server::start(&args);
    add_s3(&server, &s3, &scratch, "s3", "sched");
    let data = scratch.join("data");
    random_file(&data, 2 << 20);
    write_file(&server, "v", &data, 0);
    rpc(
        &server,
        "backup_schedule_set",
        r#"{"volume": "v", "target": "s3", "interval_secs": 1, "keep_last": 2}"#,
    );
    let mine = |server: &Server| -> Vec<Value> {
        rpc(server, "backup_list", r#"{"target": "s3", "volume": "v"}"#)
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["schedule"] == "v@s3")
            .cloned()
            .collect()
    };
    // Each backup of new data: with 2 kept, the older ones' chunks go.
    let mut made = 0;
    let mut seen = std::collections::BTreeSet::new();
    let ok = common::wait_until(Duration::from_secs(60), || {
        for b in mine(&server) {
            if seen.insert(b["id"].as_str().unwrap().to_string()) {
                made += 1;
                random_file(&data, 2 << 20);
                write_file(&server, "v", &data, 0);
            }
        }
        made >= 4
    });
    assert!(ok, "4 scheduled backups within 60 s: {made}");
    let kept_ok = common::wait_until(Duration::from_secs(20), || {
        mine(&server).len() == 2 && walk(&s3.dir("sched").join("chunks")) <= 3
    });
    assert!(
        kept_ok,
        "2 kept, the rest collected: {:?} {}",
        mine(&server),
        walk(&s3.dir("sched").join("chunks"))
    );
    let listed = rpc(&server, "backup_schedule_list", "{}");
    assert_eq!(listed[0]["keep_last"], 2, "{listed}");
    server.kill();
    let server = Server::start(&args);
    let listed = rpc(&server, "backup_schedule_list", "{}");
    assert_eq!(
        listed[0]["interval_secs"], 1,
        "resumed after a restart: {listed}"
    );
    let before: Vec<String> = mine(&server)
        .iter()
        .map(|b| b["id"].as_str().unwrap().to_string())
        .collect();
    let resumed = common::wait_until(Duration::from_secs(30), || {
        mine(&server)
            .iter()
            .any(|b| !before.contains(&b["id"].as_str().unwrap().to_string()))
    });
    assert!(resumed, "a scheduled backup after the restart");
    rpc(
        &server,
        "backup_schedule_remove",
        r#"{"volume": "v", "target": "s3"}"#,
    );
    assert_eq!(
        rpc(&server, "backup_schedule_list", "{}"),
        serde_json::json!([])
    );
}

/// A standby follows its source's backups read-only, and activated it
/// is writable holding the last complete backup.
#[test]
fn a_standby_volume_follows_backups_and_activates_writable() {
    let scratch = Scratch::new("backup-standby");
    let s3 = S3::start(&scratch.join("s3"));
    let server = Server::start(&["--volume", "v:16M"]);
    add_s3(&server, &s3, &scratch, "s3", "standby");
    let data = scratch.join("data");
    random_file(&data, 3 << 20);
    write_file(&server, "v", &data, 0);
    backup(&server, "v", "s3");
    let first = scratch.join("first.img");
    image(&server, "v", &first);
    rpc(
        &server,
        "backup_standby_create",
        r#"{"name": "dr", "target": "s3", "volume": "v", "poll_secs": 1}"#,
    );
    let holds = |id: &str| {
        let l = rpc(&server, "backup_standby_list", "{}");
        l[0]["applied"] == id
    };
    let b1 = rpc(&server, "backup_list", r#"{"target": "s3"}"#)[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        common::wait_until(Duration::from_secs(30), || holds(&b1)),
        "first restore"
    );
    let got = scratch.join("got1.img");
    image(&server, "dr", &got);
    assert_same(&first, &got);
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write 0 4k"])
        .arg(tools::uri(&server, "dr"))
        .output()
        .expect("run qemu-io");
    assert!(!out.status.success(), "a standby is read-only");
    // A new backup of the source, with a chunk zeroed and one rewritten.
    tools::qemu_io(&server, "v", &["write -z 0 2M", "write -P 0x42 10M 4k"]);
    let b2 = backup(&server, "v", "s3")["id"]
        .as_str()
        .unwrap()
        .to_string();
    let second = scratch.join("second.img");
    image(&server, "v", &second);
    assert!(
        common::wait_until(Duration::from_secs(30), || holds(&b2)),
        "caught up"
    );
    let got = scratch.join("got2.img");
    image(&server, "dr", &got);
    assert_same(&second, &got);
    let a = rpc(&server, "backup_standby_activate", r#"{"name": "dr"}"#);
    assert_eq!(a["backup"], b2.as_str(), "{a}");
    tools::qemu_io(&server, "dr", &["write -P 0x99 0 4k", "read -P 0x99 0 4k"]);
    assert_eq!(
        rpc(&server, "backup_standby_list", "{}"),
        serde_json::json!([])
    );
}

/// An S3 endpoint over TLS: refused without its CA (the certificate is
/// checked), used with `ca_file`, the backup restored identical.
#[test]
fn an_https_endpoint_takes_its_ca_file() {
    let scratch = Scratch::new("backup-tls");
    let pki = scratch.join("pki");
    common::make_pki(&pki);
    let s3 = S3::start_tls(&scratch.join("s3"), &pki);
    let server = Server::start(&["--volume", "v:16M"]);
    let creds = s3.credentials(&scratch);
    let without =
        serde_json::json!({"name": "tls", "url": s3.url("tls"), "credentials_file": creds});
    let e = refused(&server, "backup_target_add", &without.to_string());
    assert!(e.contains("target tls"), "{e}");
    let with = serde_json::json!({"name": "tls", "url": s3.url("tls"), "credentials_file": creds,
        "ca_file": pki.join("ca-cert.pem")});
    rpc(&server, "backup_target_add", &with.to_string());
    tools::qemu_io(&server, "v", &["write -P 0x3c 0 3M"]);
    round_trip(&server, &scratch, "v", "tls", "r");
}

/// A target whose filesystem fills: the backup fails with the reason,
/// nothing is listed, and once there is room again the next backup
/// completes.
#[test]
fn a_full_target_fails_the_backup_and_lists_nothing() {
    let scratch = Scratch::new("backup-full");
    let small = scratch.join("small");
    let _fs = common::Tmpfs::mount(&small, "6M");
    let server = Server::start(&["--volume", "v:32M"]);
    add_dir(&server, &small.join("t"), "small");
    let data = scratch.join("data");
    random_file(&data, 12 << 20);
    write_file(&server, "v", &data, 0);
    let p = r#"{"volume": "v", "target": "small", "wait": true}"#;
    let r = rpc(&server, "backup_create", p);
    assert_eq!(r["job"]["state"], "failed", "{r}");
    let err = r["job"]["error"].as_str().unwrap();
    assert!(
        err.contains("target small") && err.to_lowercase().contains("space"),
        "{err}"
    );
    assert_eq!(
        rpc(&server, "backup_list", r#"{"target": "small"}"#),
        serde_json::json!([])
    );
    // Room again: what the cut backup left is collected, a smaller
    // volume's backup fits.
    let gc = rpc(&server, "backup_gc", r#"{"target": "small"}"#);
    assert!(gc["chunks_deleted"].as_u64().unwrap() > 0, "{gc}");
    tools::qemu_io(&server, "v", &["write -z 0 32M", "write -P 0x21 0 1M"]);
    let b = backup(&server, "v", "small");
    assert_eq!(b["stats"]["chunks_uploaded"], 1, "{b}");
}
