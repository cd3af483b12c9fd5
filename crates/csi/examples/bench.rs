//! The CSI plugin's own costs (issue 30): how long a volume takes from
//! CreateVolume to its first I/O, and what 100 volumes created and staged
//! at once cost the node daemons.
//!
//! ```text
//! scripts/bench-csi                          # 7 single runs, then 100 volumes
//! scripts/bench-csi --runs 3 --volumes 30    # shorter
//! ```
//!
//! The plugin's services run in this process, called directly as
//! `crates/csi/tests/failover.rs` does (ControllerPlugin, one NodePlugin
//! per node, the fuse attach method), against three real node daemons
//! (`lull serve --store` on loopback, started by the tests' common
//! module: the `lull` binary beside this one, or `LULL_BIN`). Needs root,
//! /dev/fuse, loop devices and nbdfuse.
//!
//! - **One volume**, `--runs` times, each on fresh names: CreateVolume
//!   (64 MiB, 2 replicas, block access) → NodeStageVolume on the node that
//!   holds no replica (its engine reaches both replicas over the network)
//!   → NodePublishVolume (a bind mount of the loop device on a file) →
//!   the first I/O through the published file: a 4 KiB O_DIRECT write and
//!   fsync (both replicas acknowledge it), then a 4 KiB O_DIRECT read
//!   elsewhere (not of the page just written: the loop device reads its
//!   file through the page cache, which holds that page). Each step
//!   timed; then unpublish, unstage and delete, timed apart.
//! - **The stage by parts**, `--runs` times: what NodeStageVolume does
//!   (lookups, `volume_create`, the wait for the engine's replicas,
//!   nbdfuse, losetup) done by hand, looking every 1 ms where the plugin
//!   looks every 100 ms (engine) and 50 ms (nbdfuse): the work, apart
//!   from the waits between looks.
//! - **Many volumes**, twice, each time on three fresh daemons:
//!   `--volumes` tasks at once, each CreateVolume then NodeStageVolume
//!   (block) on node `i % 3`; first each call made once, then each failed
//!   call retried after a backoff as a CO does. The wall time until all
//!   are staged, each call's time, the daemons' VmRSS before and with
//!   them staged, the nbdfuse processes' VmRSS. A volume that fails is
//!   reported with its step and error (grouped), with the connections
//!   the daemons' logs say they refused; one still running at
//!   [`PARALLEL_DEADLINE`] as timed out: the run ends and cleans up
//!   either way.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Nodes;
use lull_csi::attach::{self, AttachError, FuseDirs, Method, FUSE_READY_TIMEOUT};
use lull_csi::cluster::CallError;
use lull_csi::controller::ControllerPlugin;
use lull_csi::node::{NodeConfig, NodePlugin};
use lull_csi::pb::controller_server::Controller;
use lull_csi::pb::node_server::Node;
use lull_csi::pb::volume_capability::access_mode::Mode;
use lull_csi::pb::volume_capability::{AccessMode, AccessType, BlockVolume};
use lull_csi::pb::*;
use lull_csi::volume_id::VolumeId;
use serde_json::json;
use tonic::{Request, Status};

/// Every volume's size: small, so that 100 of them with 2 replicas fit
/// thin-provisioned stores on any disk (the daemons overcommit 100×).
const VOLUME_BYTES: i64 = 64 << 20;

/// The first I/O: one page, aligned for O_DIRECT.
const IO_BYTES: usize = 4096;

/// The node ids the common module's daemons have, in order.
const NODE_IDS: [&str; 3] = ["node1", "node2", "node3"];

/// How long the parallel phase may run: far above what 100 volumes take
/// here (seconds), and below the plugin's own deadlines stacked up (a
/// stage may wait 30 s for each of its daemon calls, its engine and
/// nbdfuse), so a limit hit shows as a report, not a hang.
const PARALLEL_DEADLINE: Duration = Duration::from_secs(180);

/// Upper bounds of the flags: a typo must not start 10,000 nbdfuse
/// processes or a run of hours.
const MAX_RUNS: usize = 100;
const MAX_VOLUMES: usize = 1000;

const DEFAULT_RUNS: usize = 7;
const DEFAULT_VOLUMES: usize = 100;

#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("{step}: {}: {}", status.code(), status.message())]
    Call { step: &'static str, status: Status },
    #[error("{step}: {path}: {source}", path = path.display())]
    Io {
        step: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{step}: {source}")]
    Node {
        step: &'static str,
        source: CallError,
    },
    #[error("{step}: {source}")]
    Attach {
        step: &'static str,
        source: AttachError,
    },
    #[error("{step}: nbdfuse exited, or did not serve its file within {FUSE_READY_TIMEOUT:?}")]
    FuseTimeout { step: &'static str },
    #[error("{step}: {IO_BYTES} bytes never written are not zeros")]
    Mismatch { step: &'static str },
    #[error("{step}: still running after {PARALLEL_DEADLINE:?}")]
    Timeout { step: &'static str },
}

impl BenchError {
    fn call(step: &'static str) -> impl FnOnce(Status) -> BenchError {
        move |status| BenchError::Call { step, status }
    }

    fn node(step: &'static str) -> impl FnOnce(CallError) -> BenchError {
        move |source| BenchError::Node { step, source }
    }

    fn attach(step: &'static str) -> impl FnOnce(AttachError) -> BenchError {
        move |source| BenchError::Attach { step, source }
    }
}

struct Args {
    runs: usize,
    volumes: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        runs: DEFAULT_RUNS,
        volumes: DEFAULT_VOLUMES,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let (slot, max) = match flag.as_str() {
            "--runs" => (&mut args.runs, MAX_RUNS),
            "--volumes" => (&mut args.volumes, MAX_VOLUMES),
            _ => return Err(format!("unknown argument {flag:?}")),
        };
        let value = it.next().ok_or(format!("{flag} needs a number"))?;
        match value.parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => *slot = n,
            _ => return Err(format!("{flag} {value:?}: a number from 1 to {max}")),
        }
    }
    Ok(args)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench: {e}\nusage: bench [--runs N] [--volumes N]");
            return ExitCode::from(2);
        }
    };
    if let Err(reason) = Method::Fuse.check(&attach::Host::default()).await {
        eprintln!("bench: {reason} (run as root; Debian package libnbd-bin)");
        return ExitCode::FAILURE;
    }
    let single_ok = single_volume(args.runs).await;
    // Volumes that fail when each call is made once are a result (a
    // limit, named in the report), not a failure of the run; with a CO's
    // retries every volume must stage.
    many_volumes(args.volumes, false).await;
    let retried_ok = many_volumes(args.volumes, true).await;
    if single_ok && retried_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The controller and a node plugin per daemon, in this process.
struct Plugins {
    controller: ControllerPlugin,
    nodes: HashMap<&'static str, NodePlugin>,
    /// Each node's NBD address, where its attach method connects.
    nodes_nbd: HashMap<&'static str, String>,
    work: PathBuf,
}

impl Plugins {
    fn new(nodes: &Nodes) -> Plugins {
        let node = |id: &str| {
            NodePlugin::new(
                Arc::clone(&nodes.cluster),
                NodeConfig {
                    node_id: id.to_string(),
                    state_dir: nodes.work.join(format!("state-{id}")),
                    attach: Method::Fuse,
                },
            )
        };
        Plugins {
            controller: ControllerPlugin::new(Arc::clone(&nodes.cluster)),
            nodes: NODE_IDS.into_iter().map(|id| (id, node(id))).collect(),
            nodes_nbd: NODE_IDS
                .into_iter()
                .map(|id| {
                    let nbd = nodes.cluster.node(id).and_then(|n| n.nbd.clone());
                    (
                        id,
                        nbd.expect("the common module gives every node an nbd address"),
                    )
                })
                .collect(),
            work: nodes.work.clone(),
        }
    }
}

fn block_cap() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

async fn create(controller: &ControllerPlugin, name: &str) -> Result<String, BenchError> {
    let created = controller
        .create_volume(Request::new(CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange {
                required_bytes: VOLUME_BYTES,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![block_cap()],
            parameters: HashMap::from([("replicas".to_string(), "2".to_string())]),
            ..Default::default()
        }))
        .await
        .map_err(BenchError::call("CreateVolume"))?;
    Ok(created
        .into_inner()
        .volume
        .expect("CreateVolume answers a volume")
        .volume_id)
}

fn staging_path(work: &Path, name: &str) -> String {
    work.join("staging")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

async fn stage(node: &NodePlugin, work: &Path, volume_id: &str) -> Result<(), BenchError> {
    let name = VolumeId::parse(volume_id).expect("the plugin's id").name;
    node.node_stage_volume(Request::new(NodeStageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging_path(work, &name),
        volume_capability: Some(block_cap()),
        ..Default::default()
    }))
    .await
    .map_err(BenchError::call("NodeStageVolume"))?;
    Ok(())
}

async fn unstage(node: &NodePlugin, work: &Path, volume_id: &str) -> Result<(), BenchError> {
    let name = VolumeId::parse(volume_id).expect("the plugin's id").name;
    node.node_unstage_volume(Request::new(NodeUnstageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging_path(work, &name),
    }))
    .await
    .map_err(BenchError::call("NodeUnstageVolume"))?;
    Ok(())
}

async fn delete(controller: &ControllerPlugin, volume_id: &str) -> Result<(), BenchError> {
    controller
        .delete_volume(Request::new(DeleteVolumeRequest {
            volume_id: volume_id.into(),
            ..Default::default()
        }))
        .await
        .map_err(BenchError::call("DeleteVolume"))?;
    Ok(())
}

/// The steps of one volume's way to its first I/O, and back.
#[derive(Debug, Clone, Copy, Default)]
struct Steps {
    create: Duration,
    stage: Duration,
    publish: Duration,
    first_write: Duration,
    first_read: Duration,
    teardown: Duration,
}

impl Steps {
    /// CreateVolume to the first write acknowledged.
    fn total(&self) -> Duration {
        self.create + self.stage + self.publish + self.first_write
    }
}

/// `--runs` volumes one after the other; prints each run and the
/// medians. False when a run failed.
async fn single_volume(runs: usize) -> bool {
    let nodes = Nodes::start("bench-single", Default::default()).await;
    let plugins = Plugins::new(&nodes);
    println!("## One volume: CreateVolume → NodeStageVolume → NodePublishVolume → first I/O");
    println!(
        "64 MiB, 2 replicas, block access, fuse attach; staged on the node without a replica\n"
    );
    println!("| run | create ms | stage ms | publish ms | first write ms | total ms | first read ms | teardown ms |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut all = Vec::with_capacity(runs);
    for run in 1..=runs {
        match single_run(&plugins, run).await {
            Ok(s) => {
                println!(
                    "| {run} | {} | {} | {} | {} | {} | {} | {} |",
                    ms(s.create),
                    ms(s.stage),
                    ms(s.publish),
                    ms(s.first_write),
                    ms(s.total()),
                    ms(s.first_read),
                    ms(s.teardown)
                );
                all.push(s);
            }
            Err(e) => {
                println!("| {run} | failed: {e} |");
                return false;
            }
        }
    }
    let column = |f: fn(&Steps) -> Duration| spread(all.iter().map(f).collect());
    println!(
        "| median (min–max) | {} | {} | {} | {} | {} | {} | {} |\n",
        column(|s| s.create),
        column(|s| s.stage),
        column(|s| s.publish),
        column(|s| s.first_write),
        column(Steps::total),
        column(|s| s.first_read),
        column(|s| s.teardown),
    );

    println!("### NodeStageVolume by parts, done by hand, looking every {HAND_POLL_INTERVAL:?}\n");
    println!("| run | lookups ms | volume_create ms | engine ready ms | nbdfuse serving ms | losetup ms | sum ms |");
    println!("|---|---|---|---|---|---|---|");
    let mut all = Vec::with_capacity(runs);
    for run in 1..=runs {
        match stage_by_hand(&nodes, &plugins, run).await {
            Ok(s) => {
                println!(
                    "| {run} | {} | {} | {} | {} | {} | {} |",
                    ms(s.lookups),
                    ms(s.engine_create),
                    ms(s.engine_ready),
                    ms(s.nbdfuse),
                    ms(s.losetup),
                    ms(s.total())
                );
                all.push(s);
            }
            Err(e) => {
                println!("| {run} | failed: {e} |");
                return false;
            }
        }
    }
    let column = |f: fn(&Parts) -> Duration| spread(all.iter().map(f).collect());
    println!(
        "| median (min–max) | {} | {} | {} | {} | {} | {} |\n",
        column(|s| s.lookups),
        column(|s| s.engine_create),
        column(|s| s.engine_ready),
        column(|s| s.nbdfuse),
        column(|s| s.losetup),
        column(Parts::total),
    );
    true
}

async fn single_run(p: &Plugins, run: usize) -> Result<Steps, BenchError> {
    let mut steps = Steps::default();
    let t = Instant::now();
    let volume_id = create(&p.controller, &format!("single-{run}")).await?;
    steps.create = t.elapsed();
    let id = VolumeId::parse(&volume_id).expect("the plugin's id");
    let here = NODE_IDS
        .into_iter()
        .find(|n| !id.nodes.iter().any(|r| r == n))
        .expect("2 replicas on 3 nodes leave one");
    let node = &p.nodes[here];

    let t = Instant::now();
    stage(node, &p.work, &volume_id).await?;
    steps.stage = t.elapsed();

    let target = p.work.join("publish").join(&id.name);
    let t = Instant::now();
    node.node_publish_volume(Request::new(NodePublishVolumeRequest {
        volume_id: volume_id.clone(),
        staging_target_path: staging_path(&p.work, &id.name),
        target_path: target.to_string_lossy().into_owned(),
        volume_capability: Some(block_cap()),
        ..Default::default()
    }))
    .await
    .map_err(BenchError::call("NodePublishVolume"))?;
    steps.publish = t.elapsed();

    let (write, read) = first_io(&target).await?;
    steps.first_write = write;
    steps.first_read = read;

    let t = Instant::now();
    node.node_unpublish_volume(Request::new(NodeUnpublishVolumeRequest {
        volume_id: volume_id.clone(),
        target_path: target.to_string_lossy().into_owned(),
    }))
    .await
    .map_err(BenchError::call("NodeUnpublishVolume"))?;
    unstage(node, &p.work, &volume_id).await?;
    delete(&p.controller, &volume_id).await?;
    steps.teardown = t.elapsed();
    Ok(steps)
}

/// A 4 KiB O_DIRECT write and fsync at offset 0 of the published device
/// file, then a 4 KiB O_DIRECT read in the middle of the volume (never
/// written: zeros, checked): each one's time.
async fn first_io(target: &Path) -> Result<(Duration, Duration), BenchError> {
    let target = target.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let io = |step| {
            let path = target.clone();
            move |source| BenchError::Io { step, path, source }
        };
        // O_DIRECT wants an aligned buffer: an aligned page inside a
        // vector twice that size.
        let mut raw = vec![0u8; 2 * IO_BYTES];
        let at = raw.as_ptr().align_offset(IO_BYTES);
        let buf = &mut raw[at..at + IO_BYTES];
        buf.fill(0x5a);
        let t = Instant::now();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
            .open(&target)
            .map_err(io("open"))?;
        f.write_all_at(buf, 0).map_err(io("first write"))?;
        f.sync_all().map_err(io("fsync"))?;
        let write = t.elapsed();
        let t = Instant::now();
        f.read_exact_at(buf, VOLUME_BYTES as u64 / 2)
            .map_err(io("first read"))?;
        let read = t.elapsed();
        if buf.iter().any(|b| *b != 0) {
            return Err(BenchError::Mismatch { step: "first read" });
        }
        Ok((write, read))
    })
    .await
    .expect("the I/O thread")
}

/// How often the stage by hand looks at the engine and at nbdfuse's
/// mount: fine against the steps' own times, so that what it measures is
/// the work, not the wait between looks.
const HAND_POLL_INTERVAL: Duration = Duration::from_millis(1);

/// NodeStageVolume's parts, done by hand as the plugin does them
/// (crates/csi/src/node.rs, attach.rs) but looking every
/// [`HAND_POLL_INTERVAL`].
#[derive(Debug, Clone, Copy, Default)]
struct Parts {
    /// store_get on each replica node (its replica address), replica_get.
    lookups: Duration,
    /// volume_create on this node's daemon.
    engine_create: Duration,
    /// Until replica_list shows no replica connecting and one healthy.
    engine_ready: Duration,
    /// nbdfuse started until its pid file is written and its mount shows.
    nbdfuse: Duration,
    /// losetup --find --show.
    losetup: Duration,
}

impl Parts {
    fn total(&self) -> Duration {
        self.lookups + self.engine_create + self.engine_ready + self.nbdfuse + self.losetup
    }
}

async fn stage_by_hand(nodes: &Nodes, p: &Plugins, run: usize) -> Result<Parts, BenchError> {
    let cluster = &nodes.cluster;
    let mut parts = Parts::default();
    let volume_id = create(&p.controller, &format!("parts-{run}")).await?;
    let id = VolumeId::parse(&volume_id).expect("the plugin's id");
    let here = NODE_IDS
        .into_iter()
        .find(|n| !id.nodes.iter().any(|r| r == n))
        .expect("2 replicas on 3 nodes leave one");

    let t = Instant::now();
    let mut links = Vec::with_capacity(id.nodes.len());
    for node in &id.nodes {
        let store = cluster
            .call(node, "store_get", json!({}))
            .await
            .map_err(BenchError::node("store_get"))?;
        let addr = store["replica_addr"].as_str().unwrap_or_default();
        links.push(format!("{addr}/{}", id.name));
    }
    let replica = cluster
        .call(&id.nodes[0], "replica_get", json!({ "name": id.name }))
        .await
        .map_err(BenchError::node("replica_get"))?;
    parts.lookups = t.elapsed();

    let t = Instant::now();
    let params = json!({
        "name": id.name,
        "size": replica["size_bytes"],
        "backend": format!("replicas={}", links.join("+")),
        "persist": false,
    });
    cluster
        .call(here, "volume_create", params)
        .await
        .map_err(BenchError::node("volume_create"))?;
    parts.engine_create = t.elapsed();

    let t = Instant::now();
    loop {
        let list = cluster
            .call(here, "replica_list", json!({ "volume": id.name }))
            .await
            .map_err(BenchError::node("replica_list"))?;
        let states: Vec<&str> = list
            .as_array()
            .map(|a| a.iter().filter_map(|r| r["state"].as_str()).collect())
            .unwrap_or_default();
        if states.contains(&"healthy") && !states.contains(&"connecting") {
            break;
        }
        if t.elapsed() > lull_csi::node::ENGINE_READY_TIMEOUT {
            return Err(BenchError::Timeout {
                step: "engine ready",
            });
        }
        tokio::time::sleep(HAND_POLL_INTERVAL).await;
    }
    parts.engine_ready = t.elapsed();

    let dirs = FuseDirs::new(&p.work.join(format!("state-hand-{here}")), &id.name);
    std::fs::create_dir_all(&dirs.mount).map_err(|source| BenchError::Io {
        step: "nbdfuse",
        path: dirs.mount.clone(),
        source,
    })?;
    let nbd = p.nodes_nbd[here].clone();
    let t = Instant::now();
    let mut nbdfuse = tokio::process::Command::new("nbdfuse")
        .arg("-P")
        .arg(&dirs.pid)
        .arg(&dirs.file)
        .arg(format!("nbd://{nbd}/{}", id.name))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|source| BenchError::Io {
            step: "nbdfuse",
            path: PathBuf::from("nbdfuse"),
            source,
        })?;
    loop {
        let mounted = lull_csi::mounts::mounted_at(&dirs.mount)
            .ok()
            .flatten()
            .is_some_and(|m| m.fs_type.starts_with("fuse"));
        if dirs.pid.exists() && mounted {
            break;
        }
        if t.elapsed() > FUSE_READY_TIMEOUT || matches!(nbdfuse.try_wait(), Ok(Some(_))) {
            let _ = nbdfuse.start_kill();
            return Err(BenchError::FuseTimeout { step: "nbdfuse" });
        }
        tokio::time::sleep(HAND_POLL_INTERVAL).await;
    }
    parts.nbdfuse = t.elapsed();

    let t = Instant::now();
    lull_csi::cmd::run(
        "losetup",
        &[
            std::ffi::OsStr::new("--find"),
            std::ffi::OsStr::new("--show"),
            dirs.file.as_os_str(),
        ],
    )
    .await
    .map_err(|e| BenchError::attach("losetup")(e.into()))?;
    parts.losetup = t.elapsed();

    // Undone as the plugin's unstage does: device, FUSE mount, engine;
    // then the volume, once the engine has let go of its replicas.
    attach::fuse_detach(&dirs)
        .await
        .map_err(BenchError::attach("detach"))?;
    let _ = std::fs::remove_dir(&dirs.dir);
    let _ = nbdfuse.wait().await;
    cluster
        .call(here, "volume_delete", json!({ "name": id.name }))
        .await
        .map_err(BenchError::node("volume_delete"))?;
    let released = Instant::now();
    loop {
        match delete(&p.controller, &volume_id).await {
            Ok(()) => break,
            // Refused while an engine still holds a replica.
            Err(_) if released.elapsed() < lull_csi::node::ENGINE_RELEASE_TIMEOUT => {
                tokio::time::sleep(HAND_POLL_INTERVAL * 10).await;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(parts)
}

/// Where each parallel volume is: the step it is in, for a report of the
/// ones still running at the deadline.
const STEP_CREATE: u8 = 0;
const STEP_STAGE: u8 = 1;
const STEP_DONE: u8 = 2;

fn step_name(step: u8) -> &'static str {
    match step {
        STEP_CREATE => "CreateVolume",
        STEP_STAGE => "NodeStageVolume",
        _ => "done",
    }
}

/// A CO's first wait before it retries a call, doubled at each retry
/// (the kubelet's operation backoff starts at 500 ms and doubles).
const RETRY_BACKOFF_START: Duration = Duration::from_millis(500);
const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(8);

/// The errors calls were retried after, by message (the volume's name
/// taken out), so that the same failure of many volumes is one line.
#[derive(Default)]
struct Retries(Mutex<BTreeMap<String, usize>>);

impl Retries {
    fn add(&self, e: &BenchError) {
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *map.entry(generic(&e.to_string())).or_default() += 1;
    }

    fn count(&self) -> usize {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .sum()
    }

    fn print(&self, what: &str) {
        for (message, n) in self.0.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            println!("- {what} {n} × after {message}");
        }
    }
}

/// Calls `call` until it succeeds, retrying after any error with a
/// backoff, as the kubelet and the external-provisioner do (the caller
/// bounds it with a deadline); with `retry` false, once.
async fn as_a_co<T, F, Fut>(retry: bool, retries: &Retries, mut call: F) -> Result<T, BenchError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, BenchError>>,
{
    let mut backoff = RETRY_BACKOFF_START;
    loop {
        match call().await {
            Err(e) if retry => {
                retries.add(&e);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
            }
            outcome => return outcome,
        }
    }
}

/// One parallel volume: its create and stage times (retries included).
struct Staged {
    volume_id: String,
    create: Duration,
    stage: Duration,
}

/// `count` volumes created and staged at once on three fresh daemons,
/// each call made once (`retry` false) or retried as a CO does; prints
/// the times and memory. False when a volume failed.
async fn many_volumes(count: usize, retry: bool) -> bool {
    let nodes = Nodes::start(
        if retry {
            "bench-many-retry"
        } else {
            "bench-many"
        },
        Default::default(),
    )
    .await;
    let plugins = Arc::new(Plugins::new(&nodes));
    let pids = daemon_pids(&nodes).await;
    let before: Vec<Proc> = pids.iter().map(|p| Proc::read(*p)).collect();

    let progress: Arc<Vec<AtomicU8>> = Arc::new((0..count).map(|_| AtomicU8::new(0)).collect());
    let retries = Arc::new(Retries::default());
    let deadline = tokio::time::Instant::now() + PARALLEL_DEADLINE;
    let start = Instant::now();
    let tasks: Vec<_> = (0..count)
        .map(|i| {
            let (p, progress, retries) = (
                Arc::clone(&plugins),
                Arc::clone(&progress),
                Arc::clone(&retries),
            );
            tokio::spawn(async move {
                let work = async {
                    let name = format!("many-{i}");
                    let t = Instant::now();
                    let volume_id =
                        as_a_co(retry, &retries, || create(&p.controller, &name)).await?;
                    let create = t.elapsed();
                    progress[i].store(STEP_STAGE, Ordering::Relaxed);
                    let node = &p.nodes[NODE_IDS[i % 3]];
                    let t = Instant::now();
                    as_a_co(retry, &retries, || stage(node, &p.work, &volume_id)).await?;
                    progress[i].store(STEP_DONE, Ordering::Relaxed);
                    Ok(Staged {
                        volume_id,
                        create,
                        stage: t.elapsed(),
                    })
                };
                match tokio::time::timeout_at(deadline, work).await {
                    Ok(r) => r,
                    Err(_) => Err(BenchError::Timeout {
                        step: step_name(progress[i].load(Ordering::Relaxed)),
                    }),
                }
            })
        })
        .collect();
    let mut staged = Vec::new();
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    for outcome in futures::future::join_all(tasks).await {
        match outcome.expect("a volume's task") {
            Ok(s) => staged.push(s),
            Err(e) => *failures.entry(generic(&e.to_string())).or_default() += 1,
        }
    }
    let wall = start.elapsed();
    let with: Vec<Proc> = pids.iter().map(|p| Proc::read(*p)).collect();
    let fuse = nbdfuse_rss_kib(&plugins.work, &staged);

    println!(
        "## {count} volumes created and staged at once on 3 nodes (2 replicas each, block, fuse), {}\n",
        if retry {
            "each failed call retried as a CO does (after 500 ms, doubling)"
        } else {
            "each call made once"
        }
    );
    println!(
        "{} of {count} staged in {:.2} s (wall, all tasks started together), {} retries",
        staged.len(),
        wall.as_secs_f64(),
        retries.count()
    );
    retries.print("retried");
    if !failures.is_empty() {
        println!("\nFAILED: {} volumes", count - staged.len());
        for (message, n) in &failures {
            println!("- {n} × {message}");
        }
    }
    // The limit by its own name: what the daemons logged when they
    // turned connections away.
    for (i, d) in nodes.daemons.iter().enumerate() {
        for (reason, n) in refusals(&d.dir.join("log")) {
            println!(
                "- {}'s daemon: {n} × RPC connection refused: {reason}",
                NODE_IDS[i]
            );
        }
    }
    if !staged.is_empty() {
        println!("\n| per volume | median | p90 | max |");
        println!("|---|---|---|---|");
        for (what, times) in [
            (
                "CreateVolume ms",
                staged.iter().map(|s| s.create).collect::<Vec<_>>(),
            ),
            (
                "NodeStageVolume ms",
                staged.iter().map(|s| s.stage).collect(),
            ),
        ] {
            let (median, p90, max) = percentiles(times);
            println!("| {what} | {median} | {p90} | {max} |");
        }
    }
    println!("\n| daemon | VmRSS before KiB | with volumes KiB | engines | replicas | threads before → with |");
    println!("|---|---|---|---|---|---|");
    for (i, id) in NODE_IDS.into_iter().enumerate() {
        let engines = staged
            .iter()
            .filter(|s| engine_node(&s.volume_id) == i)
            .count();
        let replicas = staged
            .iter()
            .filter(|s| {
                VolumeId::parse(&s.volume_id).is_some_and(|v| v.nodes.iter().any(|n| n == id))
            })
            .count();
        println!(
            "| {id} | {} | {} | {engines} | {replicas} | {} → {} |",
            thousands(before[i].rss_kib),
            thousands(with[i].rss_kib),
            before[i].threads,
            with[i].threads
        );
    }
    if let Some((n, kib)) = fuse {
        println!(
            "\nnbdfuse: {n} processes, {} KiB VmRSS in all ({} KiB each on average)",
            thousands(kib),
            thousands(kib / n.max(1) as u64)
        );
    }

    // Undo, timed: every volume unstaged, then deleted, all at once.
    let t = Instant::now();
    let undo_retries = Arc::new(Retries::default());
    let undo = teardown(&plugins, count, &undo_retries).await;
    println!(
        "\nunstaged and deleted in {:.2} s, {} retries{}",
        t.elapsed().as_secs_f64(),
        undo_retries.count(),
        match &undo {
            Ok(()) => String::new(),
            Err(e) => format!(" (FAILED: {e})"),
        }
    );
    undo_retries.print("retried");
    let after: Vec<Proc> = pids.iter().map(|p| Proc::read(*p)).collect();
    println!(
        "daemons' VmRSS after: {} KiB\n",
        after
            .iter()
            .map(|p| thousands(p.rss_kib))
            .collect::<Vec<_>>()
            .join(", ")
    );
    drop(nodes);
    failures.is_empty() && undo.is_ok()
}

/// The daemon's log lines of refused RPC connections, by reason.
fn refusals(log: &Path) -> BTreeMap<String, usize> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut by_reason = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.contains("RPC connection refused"))
    {
        let reason = line
            .split_once("reason=")
            .map_or(line, |(_, r)| r)
            .trim()
            .trim_matches('"');
        *by_reason.entry(reason.to_string()).or_default() += 1;
    }
    by_reason
}

/// Which node of [`NODE_IDS`] stages volume `many-I`.
fn engine_node(volume_id: &str) -> usize {
    let name = VolumeId::parse(volume_id).expect("the plugin's id").name;
    let i: usize = name
        .strip_prefix("many-")
        .and_then(|n| n.parse().ok())
        .expect("a volume of this run");
    i % 3
}

/// Every volume the stores hold (whatever stage or create got to),
/// unstaged on its node and deleted, each volume at once.
async fn teardown(
    p: &Arc<Plugins>,
    count: usize,
    retries: &Arc<Retries>,
) -> Result<(), BenchError> {
    let listed = p
        .controller
        .list_volumes(Request::new(ListVolumesRequest {
            max_entries: count as i32 + 1,
            starting_token: String::new(),
        }))
        .await
        .map_err(BenchError::call("ListVolumes"))?
        .into_inner();
    let undo = listed
        .entries
        .into_iter()
        .filter_map(|e| e.volume)
        .map(|v| {
            let (p, retries) = (Arc::clone(p), Arc::clone(retries));
            tokio::spawn(async move {
                let node = &p.nodes[NODE_IDS[engine_node(&v.volume_id)]];
                let undo = async {
                    as_a_co(true, &retries, || unstage(node, &p.work, &v.volume_id)).await?;
                    as_a_co(true, &retries, || delete(&p.controller, &v.volume_id)).await
                };
                tokio::time::timeout(PARALLEL_DEADLINE, undo)
                    .await
                    .unwrap_or(Err(BenchError::Timeout {
                        step: "NodeUnstageVolume and DeleteVolume",
                    }))
            })
        });
    for outcome in futures::future::join_all(undo).await {
        outcome.expect("a volume's teardown")?;
    }
    Ok(())
}

/// A failure's message with its volume's name taken out, so that the
/// same failure of many volumes is one line.
fn generic(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("many-") {
        let after = &rest[at + "many-".len()..];
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        out.push_str(&rest[..at + "many-".len()]);
        out.push_str(if digits > 0 { "N" } else { "" });
        rest = &after[digits..];
    }
    out.push_str(rest);
    out
}

/// Each daemon's pid, as the daemon reports it.
async fn daemon_pids(nodes: &Nodes) -> Vec<u32> {
    let mut pids = Vec::with_capacity(NODE_IDS.len());
    for id in NODE_IDS {
        let reactors = nodes
            .cluster
            .call(id, "framework_get_reactors", json!({}))
            .await
            .expect("framework_get_reactors");
        pids.push(
            reactors["pid"]
                .as_u64()
                .and_then(|p| u32::try_from(p).ok())
                .expect("framework_get_reactors has the pid"),
        );
    }
    pids
}

/// What /proc/PID/status says of a process's memory and threads.
struct Proc {
    rss_kib: u64,
    threads: u64,
}

impl Proc {
    fn read(pid: u32) -> Proc {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        Proc {
            rss_kib: status_field(&status, "VmRSS:"),
            threads: status_field(&status, "Threads:"),
        }
    }
}

/// A number field of /proc/PID/status (`VmRSS:  1234 kB`); 0 when absent.
fn status_field(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The staged volumes' nbdfuse processes (from their pid files): how many
/// and their VmRSS added up.
fn nbdfuse_rss_kib(work: &Path, staged: &[Staged]) -> Option<(usize, u64)> {
    let mut found = 0;
    let mut kib = 0;
    for s in staged {
        let id = VolumeId::parse(&s.volume_id)?;
        let node = NODE_IDS[engine_node(&s.volume_id)];
        let dirs = FuseDirs::new(&work.join(format!("state-{node}")), &id.name);
        let pid = std::fs::read_to_string(&dirs.pid).ok()?;
        let pid: u32 = pid.trim().parse().ok()?;
        found += 1;
        kib += Proc::read(pid).rss_kib;
    }
    (found > 0).then_some((found, kib))
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn median(sorted: &[Duration]) -> Duration {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2
    }
}

/// `median (min–max)` in ms.
fn spread(mut times: Vec<Duration>) -> String {
    times.sort();
    format!(
        "{} ({}–{})",
        ms(median(&times)),
        ms(times[0]),
        ms(times[times.len() - 1])
    )
}

/// Median, 90th percentile (nearest rank) and max, in ms.
fn percentiles(mut times: Vec<Duration>) -> (String, String, String) {
    times.sort();
    let rank90 = (times.len() * 9).div_ceil(10).max(1) - 1;
    (
        ms(median(&times)),
        ms(times[rank90]),
        ms(times[times.len() - 1]),
    )
}
