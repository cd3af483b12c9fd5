//! Heap allocations per request on the NBD hot path, counted by a global
//! allocator: a client drives 4 KiB writes and reads through the real
//! server (a reactor, a poll group, the connection pump) against a volume,
//! and the test counts allocations made by every thread except the
//! client's own during the steady-state requests. One test per path: a
//! memory volume, a file volume (buffered and O_DIRECT), and a volume
//! replicated to two real replica servers in this process (the engine's
//! thread, the replicas' connection and write-intent threads all count).
//! Each path is measured with simple replies and with structured replies
//! (as libnbd, hence fio's nbd engine and nbdcopy, and qemu negotiate
//! them), each one request at a time and `DEEP_QUEUE_DEPTH` at a time.
//!
//! Issue 13 asks for zero per request. Each test measures and reports; the
//! bound it asserts is `ALLOCS_PER_REQUEST_MAX`.

// The one exception to the workspace's `unsafe_code = "deny"` outside
// `uring` and the reactor's `sys`: counting allocations means
// implementing the unsafe `GlobalAlloc` trait. Every block forwards to
// `System` unchanged (test code, never linked into lull).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lull_bdev::{BlockDevice, FileDev, FileOptions, MallocDev};
use lull_engine::{EngineOptions, ReplicaState, ReplicatedDev};
use lull_nbd::{ListenAddr, NbdServer};
use lull_reactor::{Framework, FrameworkConfig, Mode, SchedulerConfig};
use lull_replica::{ReplicaConfig, ReplicaServer};
use lull_volume::{Storage, Volume, Volumes};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the client's thread: its own allocations are not the
    /// server's.
    static EXEMPT: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    // SAFETY: the caller's contract is System's; counting touches none of its memory.
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !EXEMPT.with(|e| e.get()) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }
    // SAFETY: as `alloc`: the caller's contract is System's.
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !EXEMPT.with(|e| e.get()) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    // SAFETY: as `alloc`: the caller's contract is System's.
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !EXEMPT.with(|e| e.get()) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    // SAFETY: as `alloc`: the caller's contract is System's.
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Requests in the measured steady state (issue 13: 10,000).
const REQUESTS: usize = 10_000;
/// Requests before it: connection set-up, caches filling.
const WARMUP_REQUESTS: usize = 2_000;
/// Requests in flight at once in the second run of each path: enough that
/// several overlap at every stage (NBD slots, the engine, each replica),
/// and a divisor of half of `REQUESTS` and of `WARMUP_REQUESTS`.
const DEEP_QUEUE_DEPTH: usize = 20;
/// What the hot path may allocate per request, at most, on average.
const ALLOCS_PER_REQUEST_MAX: f64 = 0.01;
/// Size of every test volume: the requests rotate over its first 1 MiB.
const VOLUME_BYTES: u64 = 1 << 20;
/// Replicas of the replicated volume (Longhorn's smallest redundant set).
const REPLICAS: usize = 2;
/// How long a test waits for the engine to find its replicas healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long tear-down may take (detach, drain, stop).
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The counter is process-wide and tests run on parallel threads: each
/// test holds this for its whole run, so no other test's threads count.
static SERIAL: Mutex<()> = Mutex::new(());

const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const NBD_STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
const NBD_OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const NBD_OPT_EXPORT_NAME: u32 = 1;
const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
const NBD_REP_ACK: u32 = 1;
const NBD_REPLY_FLAG_DONE: u16 = 1;
const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
const NBD_CMD_READ: u16 = 0;
const NBD_CMD_WRITE: u16 = 1;
const BLOCK: usize = 4096;
/// The byte every write writes (never zero: reads are of data, not holes).
const PATTERN: u8 = 0x5a;

/// Which replies the client asks for: simple ones, or structured ones as
/// libnbd (fio's nbd engine, nbdcopy) and qemu do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replies {
    Simple,
    Structured,
}

struct Client {
    sock: TcpStream,
    replies: Replies,
    header: [u8; 28],
    reply: [u8; 16],
    chunk: [u8; 20],
    offset: [u8; 8],
    data: Box<[u8]>,
    read: Box<[u8]>,
}

impl Client {
    /// Fixed newstyle with NBD_OPT_EXPORT_NAME: the shortest handshake
    /// (after NBD_OPT_STRUCTURED_REPLY, with `Replies::Structured`).
    fn connect(addr: std::net::SocketAddr, replies: Replies) -> Client {
        let mut sock = TcpStream::connect(addr).expect("connect");
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        sock.set_nodelay(true).unwrap();
        let mut greeting = [0u8; 18];
        sock.read_exact(&mut greeting).expect("greeting");
        assert_eq!(&greeting[..16], b"NBDMAGICIHAVEOPT");
        // NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES
        sock.write_all(&3u32.to_be_bytes()).unwrap();
        let option = |sock: &mut TcpStream, option: u32, data: &[u8]| {
            let mut opt = Vec::new();
            opt.extend_from_slice(b"IHAVEOPT");
            opt.extend_from_slice(&option.to_be_bytes());
            opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
            opt.extend_from_slice(data);
            sock.write_all(&opt).unwrap();
        };
        if replies == Replies::Structured {
            option(&mut sock, NBD_OPT_STRUCTURED_REPLY, &[]);
            let mut reply = [0u8; 20];
            sock.read_exact(&mut reply).expect("option reply");
            assert_eq!(reply[..8], NBD_OPT_REPLY_MAGIC.to_be_bytes());
            assert_eq!(
                reply[12..16],
                NBD_REP_ACK.to_be_bytes(),
                "structured replies refused"
            );
        }
        option(&mut sock, NBD_OPT_EXPORT_NAME, b"vol");
        let mut export = [0u8; 10];
        sock.read_exact(&mut export).expect("export reply");
        Client {
            sock,
            replies,
            header: [0; 28],
            reply: [0; 16],
            chunk: [0; 20],
            offset: [0; 8],
            data: vec![PATTERN; BLOCK].into_boxed_slice(),
            read: vec![0; BLOCK].into_boxed_slice(),
        }
    }

    /// Send one request (a write with its payload); allocates nothing.
    fn send(&mut self, cmd: u16, cookie: u64, offset: u64) {
        let h = &mut self.header;
        h[..4].copy_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        h[4..6].copy_from_slice(&0u16.to_be_bytes());
        h[6..8].copy_from_slice(&cmd.to_be_bytes());
        h[8..16].copy_from_slice(&cookie.to_be_bytes());
        h[16..24].copy_from_slice(&offset.to_be_bytes());
        h[24..28].copy_from_slice(&(BLOCK as u32).to_be_bytes());
        self.sock.write_all(&self.header).expect("send request");
        if cmd == NBD_CMD_WRITE {
            self.sock.write_all(&self.data).expect("send payload");
        }
    }

    /// Receive the reply to one request of kind `cmd` (replies to a batch
    /// of one kind have one size, in whatever order they come); returns
    /// its cookie. Allocates nothing.
    fn receive(&mut self, cmd: u16) -> u64 {
        let cookie;
        if cmd == NBD_CMD_READ && self.replies == Replies::Structured {
            // Written data: one offset-data chunk, the last.
            let c = &mut self.chunk;
            self.sock.read_exact(c).expect("reply chunk");
            assert_eq!(c[..4], NBD_STRUCTURED_REPLY_MAGIC.to_be_bytes());
            assert_eq!(c[4..6], NBD_REPLY_FLAG_DONE.to_be_bytes());
            assert_eq!(
                c[6..8],
                NBD_REPLY_TYPE_OFFSET_DATA.to_be_bytes(),
                "not a data chunk"
            );
            assert_eq!(c[16..20], (8 + BLOCK as u32).to_be_bytes());
            cookie = u64::from_be_bytes(c[8..16].try_into().unwrap());
            self.sock
                .read_exact(&mut self.offset)
                .expect("chunk offset");
            assert_eq!(u64::from_be_bytes(self.offset) % BLOCK as u64, 0);
        } else {
            self.sock.read_exact(&mut self.reply).expect("reply");
            assert_eq!(self.reply[..4], NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
            assert_eq!(self.reply[4..8], [0; 4], "request failed");
            cookie = u64::from_be_bytes(self.reply[8..16].try_into().unwrap());
        }
        if cmd == NBD_CMD_READ {
            self.sock.read_exact(&mut self.read).expect("read payload");
            assert!(self.read.iter().all(|&b| b == PATTERN), "read other data");
        }
        cookie
    }

    /// `n` requests, `depth` at a time: `depth` writes, then `depth` reads
    /// of the blocks just written, at rotating offsets. `n` is a multiple
    /// of `2 * depth`.
    fn run(&mut self, n: usize, first_cookie: u64, depth: usize) {
        assert!(n.is_multiple_of(2 * depth), "whole batches");
        let mut seen = vec![false; depth];
        for i in (0..n).step_by(depth) {
            let cmd = if (i / depth).is_multiple_of(2) {
                NBD_CMD_WRITE
            } else {
                NBD_CMD_READ
            };
            let first = first_cookie + i as u64;
            let first_block = (i / 2) / depth * depth;
            for j in 0..depth {
                let offset = ((first_block + j) % 256 * BLOCK) as u64;
                self.send(cmd, first + j as u64, offset);
            }
            seen.fill(false);
            for _ in 0..depth {
                let cookie = self.receive(cmd);
                let j = cookie.checked_sub(first).expect("cookie of this batch") as usize;
                assert!(j < depth && !seen[j], "unexpected reply {cookie}");
                seen[j] = true;
            }
        }
    }
}

/// Allocations of the server's threads over the steady-state requests,
/// with simple and with structured replies, one request at a time and
/// `DEEP_QUEUE_DEPTH` at a time.
struct Measured {
    runs: Vec<Run>,
}

struct Run {
    replies: Replies,
    depth: usize,
    allocs: u64,
    idle: u64,
}

impl Measured {
    /// Assert the bound on each run, after saying what was measured.
    fn check(&self, path: &str, bound: f64) {
        for run in &self.runs {
            let (replies, depth, allocs, idle) = (run.replies, run.depth, run.allocs, run.idle);
            let per_request = allocs as f64 / REQUESTS as f64;
            eprintln!(
                "{path}, {replies:?} replies, depth {depth}: {allocs} heap allocations by server threads over {REQUESTS} requests ({per_request:.4} per request); {idle} in as long idle"
            );
            assert!(
                per_request <= bound,
                "{path}, {replies:?} replies, depth {depth}: {allocs} allocations over {REQUESTS} requests ({per_request:.4} per request) exceeds {bound}"
            );
        }
    }
}

/// One reactor in interrupt mode, not pinned (tests share the machine).
/// The scheduler's period is set past the run: each period gathers thread
/// statistics on the scheduler's own thread (a few allocations a second,
/// control plane, not data path), which a slow run (a debug build on a
/// loaded machine) would otherwise count against its requests.
fn framework() -> Framework {
    Framework::start(FrameworkConfig {
        pin: false,
        scheduler: SchedulerConfig {
            period_us: lull_reactor::scheduler::MAX_PERIOD_US,
            ..SchedulerConfig::default()
        },
        ..FrameworkConfig::new(vec![0], Mode::Interrupt)
    })
    .expect("framework")
}

/// Serve `storage` as `vol` over NBD on `fw`, warm up, then count the
/// server's allocations over `REQUESTS` requests (and as long idle, for
/// attribution: timers and the scheduler's period allocate on their own).
fn measure(fw: &Framework, storage: Storage) -> Measured {
    let volumes = Arc::new(Volumes::default());
    volumes
        .add(Volume::new("vol", storage))
        .expect("add volume");
    let server = NbdServer::start(
        fw.handle(),
        volumes,
        &[ListenAddr::Tcp("127.0.0.1:0".parse().unwrap())],
        None,
    )
    .expect("nbd server");
    let ListenAddr::Tcp(addr) = server.local_addrs()[0].clone() else {
        unreachable!("bound a TCP address")
    };
    let mut runs = Vec::new();
    for replies in [Replies::Simple, Replies::Structured] {
        for depth in [1, DEEP_QUEUE_DEPTH] {
            let mut client = Client::connect(addr, replies);
            client.run(WARMUP_REQUESTS, 1, depth);
            let before = ALLOCS.load(Ordering::Relaxed);
            let started = std::time::Instant::now();
            client.run(REQUESTS, 1 + WARMUP_REQUESTS as u64, depth);
            let allocs = ALLOCS.load(Ordering::Relaxed) - before;
            let took = started.elapsed();
            let before_idle = ALLOCS.load(Ordering::Relaxed);
            std::thread::sleep(took);
            let idle = ALLOCS.load(Ordering::Relaxed) - before_idle;
            runs.push(Run {
                replies,
                depth,
                allocs,
                idle,
            });
        }
    }
    server.shutdown(STOP_TIMEOUT);
    Measured { runs }
}

/// A directory under cargo's test scratch space, removed when dropped
/// unless the test failed.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        // Under target/, not /tmp: a tmpfs refuses O_DIRECT.
        let base = option_env!("CARGO_TARGET_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let d = base.join(format!("lull-allocations-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("test directory");
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test files kept in {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The test thread's own allocations (set-up, the client) are not the
/// server's.
fn exempt_this_thread() {
    EXEMPT.with(|e| e.set(true));
}

#[test]
fn steady_state_nbd_requests_allocate_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    exempt_this_thread();
    let mut fw = framework();
    let dev = MallocDev::new(VOLUME_BYTES).expect("malloc volume");
    let m = measure(&fw, Storage::Local(Arc::new(dev)));
    fw.stop();
    m.check("memory volume", ALLOCS_PER_REQUEST_MAX);
}

fn file_volume(direct: bool) -> Measured {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    exempt_this_thread();
    let dir = TempDir::new(if direct { "file-direct" } else { "file" });
    let mut fw = framework();
    let dev = FileDev::open(
        dir.0.join("data"),
        VOLUME_BYTES,
        FileOptions {
            direct,
            create: true,
            ring: Default::default(),
        },
    )
    .expect("file volume");
    let m = measure(&fw, Storage::Local(Arc::new(dev)));
    fw.stop();
    m
}

#[test]
fn steady_state_file_requests_allocate_nothing() {
    file_volume(false).check("file volume", ALLOCS_PER_REQUEST_MAX);
}

#[test]
fn steady_state_direct_file_requests_allocate_nothing() {
    file_volume(true).check("file volume (O_DIRECT)", ALLOCS_PER_REQUEST_MAX);
}

/// The engine (on the NBD server's framework) against `REPLICAS` replica
/// servers on a framework of their own, as `lull serve` and `lull replica`
/// run in separate processes: plain links on loopback.
#[test]
fn steady_state_replicated_requests_allocate_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    exempt_this_thread();
    let dir = TempDir::new("replicated");
    let mut replica_fw = framework();
    let replicas: Vec<ReplicaServer> = (0..REPLICAS)
        .map(|i| {
            ReplicaServer::start(
                replica_fw.handle(),
                &ReplicaConfig {
                    listen: "127.0.0.1:0".parse().unwrap(),
                    dir: dir.0.join(format!("r{i}")),
                    size_bytes: VOLUME_BYTES,
                    direct: false,
                    ring: Default::default(),
                    faults: Default::default(),
                    link: lull_net::link::LinkAuth::Insecure,
                    sendfile: true,
                },
            )
            .expect("replica server")
        })
        .collect();
    let mut fw = framework();
    let dev = ReplicatedDev::start(
        fw.handle(),
        0,
        "vol",
        replicas.iter().map(|r| r.local_addr().into()).collect(),
        VOLUME_BYTES,
        EngineOptions::default(),
        None,
    )
    .expect("engine");
    assert!(dev.wait_ready(READY_TIMEOUT), "no replica became healthy");
    let all_healthy = || {
        dev.replica_status()
            .iter()
            .all(|r| r.state == ReplicaState::Healthy)
    };
    let deadline = std::time::Instant::now() + READY_TIMEOUT;
    while !all_healthy() {
        assert!(
            std::time::Instant::now() < deadline,
            "replicas not all healthy: {:?}",
            dev.replica_status()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let m = measure(&fw, Storage::Replicated(dev.clone()));
    // Every replica still took every write: the count is of the replicated
    // path, not of a degraded one.
    assert!(all_healthy(), "{:?}", dev.replica_status());
    assert!(
        dev.detach(STOP_TIMEOUT).expect("detach"),
        "detach timed out"
    );
    assert_eq!(dev.size_bytes(), VOLUME_BYTES);
    drop(dev);
    fw.stop();
    for r in replicas {
        r.shutdown(STOP_TIMEOUT).expect("replica stops cleanly");
    }
    replica_fw.stop();
    m.check("replicated volume (2 replicas)", ALLOCS_PER_REQUEST_MAX);
}
