//! The replica server on loopback, driven by a tiny blocking client that
//! speaks the codec in `lull_proto::replica`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use lull_proto::replica::{
    self as wire, ChangedRequest, Header, Hello, Kind, SnapshotOp, SnapshotRecord, SnapshotRequest,
    StatusExtent, HEADER_LEN, HELLO_FLAG_ATTACH, HELLO_FLAG_CLEAN, HELLO_FLAG_INTENT_LOST,
    HELLO_LEN, INTENT_FLAG_LOST,
};
use lull_reactor::{Framework, FrameworkConfig, Mode};
use lull_replica::intent::IntentFile;
use lull_replica::{
    Meta, ReplicaConfig, ReplicaError, ReplicaServer, Store, StoreConfig, INTENT_FILE,
    INTENT_SLOT_BYTES,
};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;
/// Write-intent regions of SIZE: 16 of 4 MiB.
const REGIONS: u32 = 16;

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let base = std::env::var_os("CARGO_TARGET_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let d = base.join(format!("lull-replica-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        TempDir(d)
    }
}

impl Drop for TempDir {
    /// A passing test removes its directory; a failing one (the drop runs
    /// while panicking) keeps it and says where.
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("test files kept in {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn framework() -> Framework {
    framework_in(Mode::Interrupt)
}

/// A framework of one unpinned core (the last allowed) in `mode`.
fn framework_in(mode: Mode) -> Framework {
    let cpus = lull_reactor::sys::allowed_cpus().expect("affinity");
    let core = *cpus.last().expect("a cpu");
    Framework::start(FrameworkConfig {
        pin: false,
        ..FrameworkConfig::new(vec![core], mode)
    })
    .expect("framework")
}

fn config(dir: &Path, size_bytes: u64) -> ReplicaConfig {
    ReplicaConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        dir: dir.to_path_buf(),
        size_bytes,
        direct: false,
        faults: Default::default(),
        ring: Default::default(),
        // These tests speak the replica protocol themselves, in plaintext.
        link: lull_net::link::LinkAuth::Insecure,
        sendfile: true,
    }
}

/// A replica server of SIZE on `dir`.
fn serve(fw: &Framework, dir: &Path) -> ReplicaServer {
    ReplicaServer::start(fw.handle(), &config(dir, SIZE)).unwrap()
}

/// A test's directory `name`, a framework, and a replica server on it.
fn replica(name: &str) -> (TempDir, Framework, ReplicaServer) {
    let dir = TempDir::new(name);
    let fw = framework();
    let server = serve(&fw, &dir.0);
    (dir, fw, server)
}

/// Drops `clients` (one, a tuple of them, or `()`), then shuts `server`
/// down.
fn shut_down<C>(clients: C, server: ReplicaServer) {
    drop(clients);
    server.shutdown(Duration::from_secs(10)).unwrap();
}

/// A test's end: `shut_down`, then the framework stops.
fn finish<C>(clients: C, server: ReplicaServer, mut fw: Framework) {
    shut_down(clients, server);
    fw.stop();
}

/// A store on `dir` with new replicas `names` of SIZE.
fn open_store(fw: &Framework, dir: &TempDir, names: &[&str]) -> Store {
    let store = Store::open(
        fw.handle(),
        &StoreConfig {
            dir: dir.0.clone(),
            ..StoreConfig::default()
        },
    )
    .unwrap();
    for name in names {
        store.create(name, SIZE).unwrap();
    }
    store
}

/// A store test's end: drops `clients`, shuts `store` down, drops it, and
/// stops the framework.
fn finish_store<C>(clients: C, store: Store, mut fw: Framework) {
    drop(clients);
    store.shutdown(Duration::from_secs(10)).unwrap();
    drop(store);
    fw.stop();
}

fn meta(dir: &Path) -> Meta {
    Meta::load(dir)
        .expect("meta readable")
        .expect("meta exists")
}

struct Client {
    s: TcpStream,
    next_id: u64,
    /// Sent in every HELLO: 0 for a tool, non-zero for an engine.
    session: u64,
}

impl Client {
    /// A tool's connection (session 0).
    fn connect(addr: SocketAddr) -> Client {
        Client::engine(addr, 0)
    }

    /// An engine's connection with `session`.
    fn engine(addr: SocketAddr, session: u64) -> Client {
        let s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // Header and payload are two writes: without this, Nagle holds the
        // second until the replica's delayed ACK (~40 ms per request).
        s.set_nodelay(true).unwrap();
        Client {
            s,
            next_id: 1,
            session,
        }
    }

    fn send(&mut self, h: &Header, payload: &[u8]) {
        let mut raw = [0u8; HEADER_LEN];
        wire::encode_header(h, &mut raw).expect("encodable");
        self.s.write_all(&raw).unwrap();
        self.s.write_all(payload).unwrap();
    }

    fn recv(&mut self) -> (Header, Vec<u8>) {
        let mut raw = [0u8; HEADER_LEN];
        self.s.read_exact(&mut raw).expect("reply header");
        let h = wire::decode_header(&raw).expect("valid reply");
        assert!(h.reply);
        let mut payload = vec![0u8; wire::payload_len(&h)];
        self.s.read_exact(&mut payload).expect("reply payload");
        (h, payload)
    }

    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Request and wait for its reply (no other request outstanding).
    fn call(&mut self, kind: Kind, offset: u64, length: u32, payload: &[u8]) -> (Header, Vec<u8>) {
        let id = self.id();
        self.send(&Header::request(kind, id, offset, length), payload);
        let (h, p) = self.recv();
        assert_eq!((h.id, h.kind), (id, kind));
        (h, p)
    }

    fn hello(&mut self, volume_size: u64, generation: u64, flags: u64) -> (Header, Hello) {
        let body = wire::encode_hello(&Hello {
            volume_size,
            generation,
            flags,
            session: self.session,
        });
        let (h, p) = self.call(Kind::Hello, 0, HELLO_LEN as u32, &body);
        (h, wire::decode_hello(&p).expect("hello payload"))
    }

    /// A plain HELLO (the engine's probe); status 0 expected.
    fn probe(&mut self) -> Hello {
        let (h, hello) = self.hello(SIZE, 0, 0);
        assert_eq!(h.status, 0);
        hello
    }

    fn detach(&mut self) -> u32 {
        self.status(Kind::Detach, 0, 0)
    }

    /// INTENT_GET: (flags, regions set).
    fn intent(&mut self) -> (u64, Vec<u32>) {
        let (h, p) = self.call(Kind::IntentGet, 0, 0, &[]);
        assert_eq!(h.status, 0);
        assert_eq!(h.offset, u64::from(REGIONS), "reply offset = region count");
        let (flags, bitmap) = wire::decode_intent(&p).expect("intent payload");
        assert_eq!(bitmap.len(), wire::intent_bitmap_bytes(SIZE));
        (flags, set_bits(bitmap))
    }

    fn attach(&mut self, generation: u64) -> Hello {
        let (h, hello) = self.hello(SIZE, generation, HELLO_FLAG_ATTACH);
        assert_eq!(h.status, 0);
        hello
    }

    /// An engine's connection with `session` (0: a tool's), attached with
    /// `generation`.
    fn attached(addr: SocketAddr, session: u64, generation: u64) -> Client {
        let mut c = Client::engine(addr, session);
        c.attach(generation);
        c
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.call(Kind::Write, offset, data.len() as u32, data)
            .0
            .status
    }

    fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        let (h, p) = self.call(Kind::Read, offset, len, &[]);
        assert_eq!(h.status, 0);
        assert_eq!(p.len(), len as usize);
        p
    }

    fn status(&mut self, kind: Kind, offset: u64, length: u32) -> u32 {
        self.call(kind, offset, length, &[]).0.status
    }

    /// EOF (or a reset) within the read timeout.
    fn expect_closed(&mut self) {
        let mut b = [0u8; 64];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
                Err(e) => panic!("expected the replica to close the connection: {e}"),
            }
        }
    }
}

fn set_bits(bitmap: &[u8]) -> Vec<u32> {
    (0..bitmap.len() as u32 * 8)
        .filter(|&i| bitmap[i as usize / 8] & (1 << (i % 8)) != 0)
        .collect()
}

/// The regions set in the record on disk now (not what the server holds
/// in memory): what a crash would leave.
fn intent_on_disk(dir: &Path) -> Vec<u32> {
    let (_, loaded) = IntentFile::open(dir, SIZE, false).expect("intent file");
    assert!(loaded.lost.is_none(), "{:?}", loaded.lost);
    set_bits(&loaded.bitmap)
}

/// Seq of each slot of the record on disk.
fn slot_seqs(dir: &Path) -> [u64; 2] {
    let raw = std::fs::read(dir.join(INTENT_FILE)).unwrap();
    let seq = |slot: usize| {
        let at = slot * INTENT_SLOT_BYTES + 8;
        u64::from_be_bytes(raw[at..at + 8].try_into().unwrap())
    };
    [seq(0), seq(1)]
}

fn flip_byte(path: &Path, at: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0xa5], at).unwrap();
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn io_round_trip_flush_trim_extents_ping() {
    let (dir, fw, server) = replica("io");
    let mut c = Client::connect(server.local_addr());
    let probe = c.probe();
    assert_eq!(
        probe.flags & (HELLO_FLAG_CLEAN | HELLO_FLAG_INTENT_LOST),
        HELLO_FLAG_CLEAN,
        "a new replica starts clean"
    );
    let hello = c.attach(5);
    assert_eq!(hello.volume_size, SIZE);
    assert_eq!(hello.generation, 5);
    assert_eq!(hello.flags & HELLO_FLAG_CLEAN, 0, "attached: dirty");

    let a = pattern(1, 256 * 1024);
    let b = pattern(2, 64 * 1024);
    assert_eq!(c.write(MIB, &a), 0);
    assert_eq!(
        c.call(Kind::WriteFua, 8 * MIB, b.len() as u32, &b).0.status,
        0
    );
    assert_eq!(c.read(MIB, a.len() as u32), a);
    assert_eq!(c.read(8 * MIB, b.len() as u32), b);
    // Unaligned, small.
    assert_eq!(c.write(3 * MIB + 7, b"hello"), 0);
    assert_eq!(c.read(3 * MIB + 5, 9), b"\0\0hello\0\0");

    assert_eq!(c.status(Kind::Flush, 0, 0), 0);
    let file = std::fs::File::open(dir.0.join("data.img")).unwrap();
    let mut on_disk = vec![0u8; a.len()];
    file.read_exact_at(&mut on_disk, MIB).unwrap();
    assert_eq!(on_disk, a);

    // Trim the second half of `a`; it reads back as zeros.
    let half = (a.len() / 2) as u64;
    assert_eq!(c.status(Kind::Trim, MIB + half, half as u32), 0);
    let back = c.read(MIB, a.len() as u32);
    assert_eq!(&back[..half as usize], &a[..half as usize]);
    assert!(back[half as usize..].iter().all(|&x| x == 0));
    assert_eq!(c.status(Kind::WriteZeroes, 8 * MIB, 4096), 0);
    assert!(c.read(8 * MIB, 4096).iter().all(|&x| x == 0));

    // Extents over the whole volume, continuing from each reply's scan end.
    let mut extents = Vec::new();
    let mut pos = 0;
    while pos < SIZE {
        let len = (SIZE - pos).min(u64::from(u32::MAX)) as u32;
        let (h, p) = c.call(Kind::Extents, pos, len, &[]);
        assert_eq!(h.status, 0);
        assert!(h.offset > pos, "scan must advance");
        extents.extend(wire::decode_extents(&p).unwrap());
        pos = h.offset;
    }
    let covered = |off: u64, len: u64| extents.iter().any(|&(o, l)| o <= off && off + len <= o + l);
    assert!(covered(MIB, half), "{extents:?}");
    assert!(
        covered(8 * MIB + 4096, b.len() as u64 - 4096),
        "{extents:?}"
    );
    assert!(covered(3 * MIB + 7, 5), "{extents:?}");
    // Sparse: far less than the volume is allocated, and the trimmed half
    // is not reported.
    let total: u64 = extents.iter().map(|e| e.1).sum();
    assert!(total < 4 * MIB, "{extents:?}");
    assert!(!covered(MIB + half, half), "{extents:?}");
    // A sub-range scan reports only what lies inside it.
    let (h, p) = c.call(Kind::Extents, MIB + 4096, 8192, &[]);
    assert_eq!((h.status, h.offset), (0, MIB + 4096 + 8192));
    assert_eq!(wire::decode_extents(&p).unwrap(), vec![(MIB + 4096, 8192)]);

    // BLOCK_STATUS: hole and zero where nothing was written or it was
    // trimmed, data where `a`'s first half is, covering the range from
    // its start; REQ_ONE-sized questions are the engine's business.
    let hz = wire::STATUS_HOLE | wire::STATUS_ZERO;
    let (h, p) = c.call(Kind::BlockStatus, 0, (2 * MIB) as u32, &[]);
    assert_eq!((h.status, h.offset), (0, 0));
    let got = wire::decode_block_status(&p).unwrap();
    let st = |length, flags| wire::StatusExtent { length, flags };
    assert_eq!(
        got,
        [st(MIB, hz), st(half, 0), st(MIB - half, hz)],
        "block status of [0, 2 MiB)"
    );
    let (h, p) = c.call(Kind::BlockStatus, MIB + half, half as u32, &[]);
    assert_eq!(h.status, 0);
    assert_eq!(wire::decode_block_status(&p).unwrap(), [st(half, hz)]);
    // Every extent of a whole-volume question, bounded per reply.
    let (h, p) = c.call(Kind::BlockStatus, 0, SIZE as u32, &[]);
    assert_eq!(h.status, 0);
    let got = wire::decode_block_status(&p).unwrap();
    assert!(got.len() <= wire::MAX_BLOCK_STATUS_PER_REPLY);
    assert!(got.iter().map(|e| e.length).sum::<u64>() <= SIZE);
    assert_eq!(c.status(Kind::BlockStatus, SIZE, 1) as i32, libc::EINVAL);
    assert_eq!(c.status(Kind::BlockStatus, 0, 0) as i32, libc::EINVAL);

    assert_eq!(c.status(Kind::Ping, 0, 0), 0);

    // Out of range: an error reply; the connection stays usable (and a
    // refused write's payload is drained).
    assert_eq!(c.status(Kind::Read, SIZE - 4096, 8192) as i32, libc::EINVAL);
    assert_eq!(c.write(SIZE, &pattern(3, 4096)) as i32, libc::EINVAL);
    assert_eq!(
        c.status(Kind::Trim, u64::MAX - 10, 4096) as i32,
        libc::EINVAL
    );
    assert_eq!(c.status(Kind::Extents, SIZE, 1) as i32, libc::EINVAL);
    assert_eq!(c.status(Kind::Ping, 0, 0), 0);
    assert_eq!(c.read(MIB, 16), a[..16].to_vec());

    finish(c, server, fw);
}

#[test]
fn pipelined_requests_complete_by_id() {
    let (_dir, fw, server) = replica("pipeline");
    let mut c = Client::attached(server.local_addr(), 0, 1);
    const N: u64 = 300; // more than MAX_IN_FLIGHT: back-pressure must hold
    let chunk = 16 * 1024;
    for i in 0..N {
        let data = pattern(i as u8, chunk);
        c.send(
            &Header::request(Kind::Write, 1000 + i, i * chunk as u64, chunk as u32),
            &data,
        );
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..N {
        let (h, _) = c.recv();
        assert_eq!((h.kind, h.status), (Kind::Write, 0));
        assert!(seen.insert(h.id));
    }
    for i in 0..N {
        c.send(
            &Header::request(Kind::Read, 5000 + i, i * chunk as u64, chunk as u32),
            &[],
        );
    }
    for _ in 0..N {
        let (h, p) = c.recv();
        assert_eq!((h.kind, h.status), (Kind::Read, 0));
        let i = h.id - 5000;
        assert_eq!(p, pattern(i as u8, chunk), "read {i}");
    }
    finish(c, server, fw);
}

#[test]
fn generation_and_clean_flag_persist_across_restarts() {
    let (dir, fw, server) = replica("meta");
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (0, true));
    assert!(server.is_clean());
    let mut c = Client::engine(server.local_addr(), 1);
    assert_eq!(c.probe().flags & HELLO_FLAG_CLEAN, HELLO_FLAG_CLEAN);
    let hello = c.attach(7);
    assert_eq!((hello.generation, hello.flags & HELLO_FLAG_CLEAN), (7, 0));
    // Attached: dirty, durably, before the HELLO reply.
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (7, false));
    assert_eq!(c.write(0, b"persist me"), 0);
    // A second engine connection with a lower generation keeps the higher.
    let mut c2 = Client::engine(server.local_addr(), 1);
    assert_eq!(c2.attach(3).generation, 7);
    // A replica stopped with an engine attached stays dirty: that engine
    // may have written to its other replicas what this one never got.
    shut_down((c, c2), server);
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (7, false));

    let server = serve(&fw, &dir.0);
    assert!(!server.is_clean());
    assert_eq!(server.generation(), 7);
    let mut c = Client::engine(server.local_addr(), 2);
    let hello = c.probe();
    assert_eq!((hello.generation, hello.flags & HELLO_FLAG_CLEAN), (7, 0));
    // The engine detaches cleanly: clean at once, and across a restart.
    assert_eq!(c.status(Kind::Flush, 0, 0), 0);
    assert_eq!(c.detach(), 0);
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (7, true));
    assert_eq!(c.probe().flags & HELLO_FLAG_CLEAN, HELLO_FLAG_CLEAN);
    shut_down(c, server);
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (7, true));

    // Restart: clean is reported; a higher generation is taken.
    let server = serve(&fw, &dir.0);
    assert!(server.is_clean());
    let mut c = Client::engine(server.local_addr(), 3);
    assert_eq!(c.probe().flags & HELLO_FLAG_CLEAN, HELLO_FLAG_CLEAN);
    let hello = c.attach(9);
    assert_eq!((hello.generation, hello.flags & HELLO_FLAG_CLEAN), (9, 0));
    assert_eq!(c.read(0, 10), b"persist me");
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (9, false));
    // Dropped without shutdown (a crash, as far as the record knows).
    drop(c);
    drop(server);
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (9, false));
    // Let the old connection threads release the lock-holding server.
    std::thread::sleep(Duration::from_millis(200));

    let server = serve(&fw, &dir.0);
    assert!(!server.is_clean());
    let mut c = Client::connect(server.local_addr());
    let (h, hello) = c.hello(SIZE, 0, 0);
    assert_eq!(
        (h.status, hello.generation, hello.flags & HELLO_FLAG_CLEAN),
        (0, 9, 0)
    );
    finish(c, server, fw);
}

#[test]
fn size_mismatch_is_refused() {
    let (dir, mut fw, server) = replica("size");
    // A HELLO with another size: EINVAL with our size, then close.
    let mut c = Client::connect(server.local_addr());
    let (h, hello) = c.hello(SIZE * 2, 1, HELLO_FLAG_ATTACH);
    assert_eq!(h.status as i32, libc::EINVAL);
    assert_eq!(hello.volume_size, SIZE);
    c.expect_closed();
    // The refused attach did not dirty the replica.
    assert!(meta(&dir.0).clean);
    server.shutdown(Duration::from_secs(10)).unwrap();

    let err = ReplicaServer::start(fw.handle(), &config(&dir.0, SIZE * 2)).unwrap_err();
    assert!(
        matches!(
            err,
            ReplicaError::SizeMismatch {
                meta_size: SIZE,
                ..
            }
        ),
        "{err}"
    );
    fw.stop();
}

#[test]
fn a_directory_serves_one_replica_at_a_time() {
    let (dir, fw, server) = replica("lock");
    let err = ReplicaServer::start(fw.handle(), &config(&dir.0, SIZE)).unwrap_err();
    assert!(matches!(err, ReplicaError::Locked { .. }), "{err}");
    finish((), server, fw);
}

#[test]
fn wrong_version_gets_eproto_then_close() {
    let (dir, fw, server) = replica("version");
    let mut c = Client::connect(server.local_addr());
    let mut raw = [0u8; HEADER_LEN];
    wire::encode_header(
        &Header::request(Kind::Hello, 77, 0, HELLO_LEN as u32),
        &mut raw,
    )
    .unwrap();
    // Version 2: an engine from before BLOCK_STATUS.
    raw[4..6].copy_from_slice(&2u16.to_be_bytes());
    c.s.write_all(&raw).unwrap();
    c.s.write_all(&wire::encode_hello(&Hello {
        volume_size: SIZE,
        generation: 1,
        flags: HELLO_FLAG_ATTACH,
        session: 0,
    }))
    .unwrap();
    let (h, p) = c.recv();
    assert_eq!(
        (h.kind, h.id, h.status as i32),
        (Kind::Hello, 77, libc::EPROTO)
    );
    assert_eq!(wire::decode_hello(&p).unwrap().volume_size, SIZE);
    c.expect_closed();
    assert!(meta(&dir.0).clean);
    finish((), server, fw);
}

#[test]
fn garbage_closes_only_its_connection() {
    let (_dir, fw, server) = replica("garbage");
    let mut good = Client::attached(server.local_addr(), 0, 1);
    assert_eq!(good.write(0, b"still here"), 0);

    // Garbage before HELLO.
    let mut bad = Client::connect(server.local_addr());
    bad.s
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n0123456789")
        .unwrap();
    bad.expect_closed();

    // Garbage after HELLO: bad magic, unknown kind, oversized write.
    let mut bad = Client::attached(server.local_addr(), 0, 1);
    bad.s.write_all(&[0xffu8; HEADER_LEN]).unwrap();
    bad.expect_closed();

    let mut bad = Client::attached(server.local_addr(), 0, 1);
    let mut raw = [0u8; HEADER_LEN];
    wire::encode_header(&Header::request(Kind::Ping, 1, 0, 0), &mut raw).unwrap();
    raw[6..8].copy_from_slice(&99u16.to_be_bytes());
    bad.s.write_all(&raw).unwrap();
    bad.expect_closed();

    let mut bad = Client::attached(server.local_addr(), 0, 1);
    wire::encode_header(&Header::request(Kind::Write, 1, 0, 0), &mut raw).unwrap();
    raw[24..28].copy_from_slice(&(wire::MAX_IO_BYTES + 1).to_be_bytes());
    bad.s.write_all(&raw).unwrap();
    bad.expect_closed();

    // A request before HELLO, a later HELLO with another size, a reply.
    let mut bad = Client::connect(server.local_addr());
    bad.send(&Header::request(Kind::Ping, 1, 0, 0), &[]);
    bad.expect_closed();
    let mut bad = Client::attached(server.local_addr(), 0, 1);
    let (h, _) = bad.hello(SIZE + 4096, 1, 0);
    assert_eq!(h.status as i32, libc::EINVAL);
    bad.expect_closed();
    // A reply frame sent to the replica.
    let mut bad = Client::attached(server.local_addr(), 0, 1);
    bad.send(&Header::request(Kind::Ping, 1, 0, 0).reply_with(0), &[]);
    bad.expect_closed();

    // The first connection is unaffected, and new ones work.
    assert_eq!(good.read(0, 10), b"still here");
    let mut fresh = Client::attached(server.local_addr(), 0, 1);
    assert_eq!(fresh.status(Kind::Ping, 0, 0), 0);
    finish((good, fresh), server, fw);
}

#[test]
fn probe_then_attach_and_writes_without_attach_dirty_first() {
    let (dir, mut fw, server) = replica("probe");

    // The engine's pattern: a plain HELLO probe, reads, then an attach on
    // the same connection.
    let mut c = Client::connect(server.local_addr());
    let (h, hello) = c.hello(SIZE, 4, 0);
    assert_eq!(
        (h.status, hello.generation),
        (0, 0),
        "a probe changes nothing"
    );
    assert!(c.read(0, 4096).iter().all(|&x| x == 0));
    assert_eq!(c.status(Kind::Flush, 0, 0), 0);
    assert!(meta(&dir.0).clean, "reads do not dirty the replica");
    assert_eq!(c.attach(4).generation, 4);
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (4, false));
    assert_eq!(c.detach(), 0);
    shut_down(c, server);
    assert!(meta(&dir.0).clean);

    // A rebuild target is written without an attach: the record turns
    // dirty (durably) before the first write lands, and so do the other
    // modifying requests (here an INTENT_MARK, then after a detach a
    // CLEAR).
    let server = serve(&fw, &dir.0);
    let mut c = Client::connect(server.local_addr());
    c.hello(SIZE, 0, 0);
    assert!(meta(&dir.0).clean);
    assert_eq!(c.call(Kind::Trim, 0, 4096, &[]).0.status, 0);
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (4, false));
    assert_eq!(c.write(4096, b"rebuilt"), 0);
    assert_eq!(c.read(4096, 7), b"rebuilt");
    assert_eq!(c.detach(), 0);
    assert!(meta(&dir.0).clean);
    assert_eq!(c.status(Kind::IntentMark, 0, 1), 0);
    assert!(!meta(&dir.0).clean);
    assert_eq!(c.detach(), 0);
    assert_eq!(c.status(Kind::IntentClear, 0, 1), 0);
    assert!(!meta(&dir.0).clean);
    // Written, not detached: a stop leaves it dirty.
    shut_down(c, server);
    assert_eq!((meta(&dir.0).generation, meta(&dir.0).clean), (4, false));
    fw.stop();
}

#[test]
fn shutdown_finishes_connected_peers() {
    let (dir, mut fw, server) = replica("shutdown");
    let addr = server.local_addr();
    let mut c = Client::attached(addr, 0, 2);
    // Queue writes, then stop while they may still be in flight: each gets
    // its reply before the connection closes.
    for i in 0..32u64 {
        c.send(
            &Header::request(Kind::Write, 100 + i, i * 65536, 65536),
            &pattern(i as u8, 65536),
        );
    }
    let mut replies = 0;
    while replies < 32 {
        let (h, _) = c.recv();
        assert_eq!(h.status, 0);
        replies += 1;
    }
    server.shutdown(Duration::from_secs(10)).unwrap();
    c.expect_closed();
    assert!(!meta(&dir.0).clean, "the engine never detached");
    assert!(TcpStream::connect(addr)
        .map(|mut s| {
            let mut b = [0u8; 1];
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            matches!(s.read(&mut b), Ok(0) | Err(_))
        })
        .unwrap_or(true));
    fw.stop();
}

#[test]
fn extents_continue_past_one_reply() {
    let (_dir, fw, server) = replica("many-extents");
    let mut c = Client::attached(server.local_addr(), 0, 1);
    let n = wire::MAX_EXTENTS_PER_REPLY as u64 + 44;
    let stride = 64 * 1024;
    for i in 0..n {
        assert_eq!(c.write(i * stride, &pattern(i as u8, 4096)), 0);
    }
    let (h, p) = c.call(Kind::Extents, 0, SIZE as u32, &[]);
    let first = wire::decode_extents(&p).unwrap();
    assert_eq!(h.status, 0);
    assert_eq!(first.len(), wire::MAX_EXTENTS_PER_REPLY);
    assert!(h.offset < SIZE, "a full reply stops early");
    let (h2, p2) = c.call(Kind::Extents, h.offset, (SIZE - h.offset) as u32, &[]);
    assert_eq!(h2.offset, SIZE);
    let all: Vec<(u64, u64)> = first
        .into_iter()
        .chain(wire::decode_extents(&p2).unwrap())
        .collect();
    assert_eq!(all.len() as u64, n);
    for (i, &(off, len)) in all.iter().enumerate() {
        assert_eq!(off, i as u64 * stride);
        assert!(len >= 4096 && len < stride, "{off} {len}");
    }
    finish(c, server, fw);
}

#[test]
fn serves_in_poll_mode() {
    let dir = TempDir::new("poll");
    let fw = framework_in(Mode::Poll);
    let server = serve(&fw, &dir.0);
    let mut c = Client::attached(server.local_addr(), 0, 1);
    let data = pattern(9, 128 * 1024);
    assert_eq!(c.write(4 * MIB, &data), 0);
    assert_eq!(c.status(Kind::Flush, 0, 0), 0);
    assert_eq!(c.read(4 * MIB, data.len() as u32), data);
    finish(c, server, fw);
}

/// Waits (bounded) until the server has closed all but `n` connections.
fn wait_connections(server: &ReplicaServer, n: usize) {
    for _ in 0..500 {
        if server.connection_count() <= n {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!(
        "{} connections still open, expected {n}",
        server.connection_count()
    );
}

#[test]
fn intent_marks_are_durable_before_the_reply_and_clears_persist() {
    let (dir, fw, server) = replica("intent");
    let mut c = Client::attached(server.local_addr(), 0x10, 1);
    assert_eq!(c.intent(), (0, vec![]), "a new replica's record is empty");
    assert_eq!(c.status(Kind::IntentMark, 0, 2), 0);
    // On disk by the time the reply arrives, not only in memory.
    assert_eq!(intent_on_disk(&dir.0), vec![0, 1]);
    assert_eq!(c.status(Kind::IntentMark, 9, 1), 0);
    assert_eq!(intent_on_disk(&dir.0), vec![0, 1, 9]);
    assert_eq!(c.status(Kind::IntentMark, 15, 1), 0);
    assert_eq!(c.intent(), (0, vec![0, 1, 9, 15]));
    // Marks from several connections at once all become durable (they
    // share stores).
    let mut others: Vec<Client> = (0..4)
        .map(|_| {
            let mut o = Client::engine(server.local_addr(), 0x10);
            o.probe();
            o
        })
        .collect();
    for (i, o) in others.iter_mut().enumerate() {
        o.send(&Header::request(Kind::IntentMark, 7, 3 + i as u64, 1), &[]);
    }
    for o in &mut others {
        let (h, _) = o.recv();
        assert_eq!((h.kind, h.status), (Kind::IntentMark, 0));
    }
    assert_eq!(intent_on_disk(&dir.0), vec![0, 1, 3, 4, 5, 6, 9, 15]);
    assert_eq!(c.status(Kind::IntentClear, 3, 4), 0);
    // A crash: what was marked survives.
    drop((c, others));
    drop(server);
    std::thread::sleep(Duration::from_millis(200));

    let server = serve(&fw, &dir.0);
    let mut tool = Client::connect(server.local_addr());
    let hello = tool.probe();
    assert_eq!(hello.flags & (HELLO_FLAG_CLEAN | HELLO_FLAG_INTENT_LOST), 0);
    let (flags, bits) = tool.intent();
    assert_eq!(flags, 0);
    assert!(
        [0, 1, 9, 15].iter().all(|b| bits.contains(b)),
        "marks lost in a crash: {bits:?}"
    );
    // Clears are lazy, but a stop persists them.
    let mut c = Client::attached(server.local_addr(), 0x11, 2);
    assert_eq!(c.status(Kind::IntentClear, 0, 16), 0);
    assert_eq!(c.status(Kind::IntentMark, 1, 1), 0);
    assert_eq!(c.intent(), (0, vec![1]));
    shut_down((c, tool), server);
    assert_eq!(intent_on_disk(&dir.0), vec![1]);
    let server = serve(&fw, &dir.0);
    let mut tool = Client::connect(server.local_addr());
    tool.probe();
    assert_eq!(tool.intent(), (0, vec![1]));
    finish(tool, server, fw);
}

#[test]
fn a_corrupt_intent_record_is_lost_and_one_bad_slot_is_survived() {
    let (dir, fw, server) = replica("intent-lost");
    let mut c = Client::attached(server.local_addr(), 0x20, 1);
    // Separate stores (each mark is answered before the next is sent).
    assert_eq!(c.status(Kind::IntentMark, 3, 1), 0);
    assert_eq!(c.status(Kind::IntentMark, 5, 1), 0);
    shut_down(c, server);
    assert!(!meta(&dir.0).clean);
    let path = dir.0.join(INTENT_FILE);

    // The newest slot torn (a byte of its bitmap): the older one is used,
    // which holds the mark of region 3 but not yet 5.
    let seqs = slot_seqs(&dir.0);
    let (newest, older) = if seqs[0] > seqs[1] { (0, 1) } else { (1, 0) };
    assert_eq!(seqs[newest], seqs[older] + 1);
    let saved = std::fs::read(&path).unwrap();
    flip_byte(&path, (newest * INTENT_SLOT_BYTES + 32) as u64);
    let server = serve(&fw, &dir.0);
    assert!(!server.intent_lost());
    let mut tool = Client::connect(server.local_addr());
    let hello = tool.probe();
    assert_eq!(hello.flags & (HELLO_FLAG_CLEAN | HELLO_FLAG_INTENT_LOST), 0);
    assert_eq!(tool.intent(), (0, vec![3]));
    shut_down(tool, server);

    // Both slots corrupt while the replica is dirty: lost. Every region
    // is reported, and the replica is not clean.
    std::fs::write(&path, &saved).unwrap();
    flip_byte(&path, 0);
    flip_byte(&path, (INTENT_SLOT_BYTES + 28) as u64);
    let server = serve(&fw, &dir.0);
    assert!(server.intent_lost() && !server.is_clean());
    let mut c = Client::engine(server.local_addr(), 0x21);
    let hello = c.probe();
    assert_eq!(
        hello.flags & (HELLO_FLAG_CLEAN | HELLO_FLAG_INTENT_LOST),
        HELLO_FLAG_INTENT_LOST
    );
    assert_eq!(c.intent(), (INTENT_FLAG_LOST, (0..REGIONS).collect()));
    // Only a clean detach ends it (an empty record made durable).
    c.attach(2);
    assert_eq!(c.detach(), 0);
    assert!(!server.intent_lost() && server.is_clean());
    assert_eq!(c.intent(), (0, vec![]));
    let hello = c.probe();
    assert_eq!(
        hello.flags & (HELLO_FLAG_CLEAN | HELLO_FLAG_INTENT_LOST),
        HELLO_FLAG_CLEAN
    );
    shut_down(c, server);
    assert_eq!(intent_on_disk(&dir.0), Vec::<u32>::new());

    // No record at all on a dirty replica (one an engine left dirty before
    // records existed): lost too.
    let server = serve(&fw, &dir.0);
    let c = Client::attached(server.local_addr(), 0x22, 3);
    shut_down(c, server);
    std::fs::remove_file(&path).unwrap();
    let server = serve(&fw, &dir.0);
    assert!(server.intent_lost());
    let mut tool = Client::connect(server.local_addr());
    assert_eq!(
        tool.probe().flags & HELLO_FLAG_INTENT_LOST,
        HELLO_FLAG_INTENT_LOST
    );
    assert_eq!(tool.intent().0, INTENT_FLAG_LOST);
    finish(tool, server, fw);
}

#[test]
fn detach_makes_the_replica_clean_and_only_the_owner_may() {
    let (dir, mut fw, server) = replica("detach");
    let mut c = Client::attached(server.local_addr(), 0x30, 1);
    assert_eq!(c.status(Kind::IntentMark, 0, 1), 0);
    assert_eq!(c.write(0, b"detached"), 0);
    assert_eq!(c.status(Kind::Flush, 0, 0), 0);
    // Not the owner: a tool (session 0) while an engine owns the replica.
    let mut tool = Client::connect(server.local_addr());
    tool.probe();
    assert_eq!(tool.detach() as i32, libc::ESTALE);
    assert!(!meta(&dir.0).clean);
    assert_eq!(c.detach(), 0);
    assert!(meta(&dir.0).clean);
    assert_eq!(c.intent(), (0, vec![]));
    assert_eq!(intent_on_disk(&dir.0), Vec::<u32>::new());
    shut_down((c, tool), server);

    let server = serve(&fw, &dir.0);
    assert!(server.is_clean());
    let mut c = Client::engine(server.local_addr(), 0x31);
    let hello = c.probe();
    assert_eq!(hello.flags & HELLO_FLAG_CLEAN, HELLO_FLAG_CLEAN);
    assert_eq!(hello.session, 0x31, "the reply names the owner");
    assert_eq!(c.intent(), (0, vec![]));
    assert_eq!(c.read(0, 8), b"detached");
    // Any modifying request makes it dirty again.
    assert_eq!(c.write(4096, b"x"), 0);
    assert!(!meta(&dir.0).clean);
    assert_eq!(c.probe().flags & HELLO_FLAG_CLEAN, 0);
    shut_down(c, server);
    assert!(!meta(&dir.0).clean);
    fw.stop();
}

#[test]
fn a_new_engine_session_fences_the_old_one() {
    let (_dir, fw, server) = replica("fence");
    let mut a = Client::attached(server.local_addr(), 100, 1);
    assert_eq!(a.write(0, b"from A"), 0);
    let mut tool = Client::connect(server.local_addr());
    assert_eq!(tool.probe().session, 100);

    // A dies in the middle of a write payload: that write is taken (and
    // counted) but never complete, and must neither land nor hold up B.
    let mut raw = [0u8; HEADER_LEN];
    wire::encode_header(&Header::request(Kind::Write, 8, 3 * 4096, 4096), &mut raw).unwrap();
    a.s.write_all(&raw).unwrap();
    a.s.write_all(&pattern(8, 100)).unwrap();
    std::thread::sleep(Duration::from_millis(50));

    // B (newer) takes the replica over; A's connection is closed by the
    // replica, and what A sends afterwards is not applied.
    let mut b = Client::engine(server.local_addr(), 200);
    let hello = b.probe();
    assert_eq!(hello.session, 200);
    assert_eq!(server.owner_session(), 200);
    let mut raw = [0u8; HEADER_LEN];
    wire::encode_header(&Header::request(Kind::Write, 9, 4096, 6), &mut raw).unwrap();
    // The socket may already be closed: a failed send is fine.
    let _ = a.s.write_all(&raw).and_then(|()| a.s.write_all(b"late A"));
    a.expect_closed();
    assert_eq!(b.read(4096, 6), vec![0u8; 6], "a fenced write landed");
    assert_eq!(
        b.read(3 * 4096, 4096),
        vec![0u8; 4096],
        "a torn write landed"
    );
    assert_eq!(b.read(0, 6), b"from A");

    // A tool may read, but not modify, while an engine owns the replica.
    assert_eq!(tool.write(8192, b"tool") as i32, libc::ESTALE);
    assert_eq!(tool.status(Kind::Trim, 0, 4096) as i32, libc::ESTALE);
    assert_eq!(tool.status(Kind::IntentMark, 0, 1) as i32, libc::ESTALE);
    let (h, _) = tool.hello(SIZE, 5, HELLO_FLAG_ATTACH);
    assert_eq!(h.status as i32, libc::ESTALE);
    assert_eq!(tool.read(0, 6), b"from A");
    assert_eq!(b.read(8192, 4), vec![0u8; 4]);

    // An older session cannot take the replica back.
    let mut late = Client::engine(server.local_addr(), 150);
    let (h, hello) = late.hello(SIZE, 0, 0);
    assert_eq!((h.status as i32, hello.session), (libc::ESTALE, 200));
    late.expect_closed();
    // And one connection cannot change its session.
    let mut b2 = Client::engine(server.local_addr(), 200);
    b2.probe();
    b2.session = 300;
    b2.send(
        &Header::request(Kind::Hello, 5, 0, HELLO_LEN as u32),
        &wire::encode_hello(&Hello {
            volume_size: SIZE,
            generation: 0,
            flags: 0,
            session: 300,
        }),
    );
    b2.expect_closed();
    assert_eq!(server.owner_session(), 200);

    // B works as ever.
    b.attach(2);
    assert_eq!(b.write(4096, b"from B"), 0);
    assert_eq!(b.read(4096, 6), b"from B");
    assert_eq!(tool.read(4096, 6), b"from B");
    finish((b, tool), server, fw);
}

#[test]
fn a_takeover_answers_after_the_old_writes_and_takes_no_later_one() {
    let (_dir, fw, server) = replica("takeover");
    let addr = server.local_addr();
    let mut a = Client::attached(addr, 1000, 1);
    const CHUNK: usize = MIB as usize;
    const CHUNKS: u64 = 48;
    let (sent_tx, sent_rx) = std::sync::mpsc::channel();
    // A streams writes without waiting for replies, as an engine does.
    let writer = std::thread::spawn(move || {
        for i in 0..CHUNKS {
            let data = pattern(i as u8 + 1, CHUNK);
            let h = Header::request(Kind::Write, 100 + i, i * CHUNK as u64, CHUNK as u32);
            let mut raw = [0u8; HEADER_LEN];
            wire::encode_header(&h, &mut raw).unwrap();
            if a.s
                .write_all(&raw)
                .and_then(|()| a.s.write_all(&data))
                .is_err()
            {
                break;
            }
            let _ = sent_tx.send(i);
        }
        drop(sent_tx);
        a
    });
    // Take over in the middle of the stream.
    for _ in 0..8 {
        sent_rx.recv().unwrap();
    }
    let mut b = Client::engine(addr, 2000);
    b.probe();
    let read_all = |b: &mut Client| {
        (0..CHUNKS)
            .map(|i| b.read(i * CHUNK as u64, CHUNK as u32))
            .collect::<Vec<_>>()
    };
    let seen = read_all(&mut b);
    // Each chunk is all there or not at all (nothing of A is in flight).
    for (i, chunk) in seen.iter().enumerate() {
        assert!(
            chunk.iter().all(|&x| x == 0) || *chunk == pattern(i as u8 + 1, CHUNK),
            "chunk {i} half written when B got its HELLO reply"
        );
    }
    // A is cut off: nothing it sends from now on lands.
    let a = writer.join().unwrap();
    let _ = a.s.shutdown(std::net::Shutdown::Write);
    wait_connections(&server, 1);
    assert_eq!(
        read_all(&mut b),
        seen,
        "a write of A landed after B's HELLO reply"
    );
    finish((a, b), server, fw);
}

#[test]
fn intent_ranges_past_the_regions_are_refused() {
    let (_dir, fw, server) = replica("intent-range");
    let mut c = Client::attached(server.local_addr(), 7, 1);
    assert_eq!(
        c.status(Kind::IntentMark, u64::from(REGIONS), 1) as i32,
        libc::EINVAL
    );
    assert_eq!(
        c.status(Kind::IntentMark, u64::from(REGIONS) - 1, 2) as i32,
        libc::EINVAL
    );
    assert_eq!(
        c.status(Kind::IntentClear, 0, REGIONS + 1) as i32,
        libc::EINVAL
    );
    // The connection goes on.
    assert_eq!(c.status(Kind::IntentMark, u64::from(REGIONS) - 1, 1), 0);
    assert_eq!(c.status(Kind::IntentMark, 0, 0), 0);
    assert_eq!(c.status(Kind::Ping, 0, 0), 0);
    assert_eq!(c.intent(), (0, vec![REGIONS - 1]));
    assert_eq!(c.write(0, b"ok"), 0);
    finish(c, server, fw);
}

/// A replica that requires a PSK: a plaintext engine gets an EACCES HELLO
/// refusal that tells it nothing about the replica, and cannot take it
/// over; a wrong key fails the handshake; the right key serves.
#[test]
fn a_psk_replica_refuses_plaintext_and_wrong_keys() {
    use lull_net::link::{client_handshake, LinkAuth};
    use lull_net::tls::{Creds, Role};

    let dir = TempDir::new("psk");
    std::fs::create_dir_all(&dir.0).unwrap();
    let key = dir.0.join("replica.psk");
    let wrong = dir.0.join("wrong.psk");
    std::fs::write(&key, "lull:00112233445566778899aabbccddeeff\n").unwrap();
    std::fs::write(&wrong, "lull:ffeeddccbbaa99887766554433221100\n").unwrap();
    let fw = framework();
    let psk = |path: &Path| LinkAuth::Tls(Creds::Psk(path.to_path_buf()));
    let cfg = ReplicaConfig {
        link: psk(&key),
        sendfile: true,
        ..config(&dir.0.join("data"), SIZE)
    };
    let server = ReplicaServer::start(fw.handle(), &cfg).unwrap();
    let addr = server.local_addr();

    let mut plain = Client::engine(addr, 5);
    let body = wire::encode_hello(&Hello {
        volume_size: SIZE,
        generation: 9,
        flags: HELLO_FLAG_ATTACH,
        session: 5,
    });
    plain.send(
        &Header::request(Kind::Hello, 41, 0, HELLO_LEN as u32),
        &body,
    );
    let (h, p) = plain.recv();
    assert_eq!(
        (h.kind, h.id, h.status as i32),
        (Kind::Hello, 41, libc::EACCES)
    );
    assert!(p.iter().all(|&b| b == 0), "nothing told before TLS: {p:?}");
    plain.expect_closed();
    assert_eq!(server.owner_session(), 0, "a plaintext engine took it over");

    let deadline = || std::time::Instant::now() + Duration::from_secs(10);
    let connect = || TcpStream::connect(addr).unwrap();
    let ctx = psk(&wrong).context(Role::Client).unwrap().unwrap();
    let e = client_handshake(&ctx, connect(), addr.ip(), deadline()).unwrap_err();
    assert!(e.to_string().contains("TLS handshake failed"), "{e}");

    let ctx = psk(&key).context(Role::Client).unwrap().unwrap();
    let mut tls = client_handshake(&ctx, connect(), addr.ip(), deadline()).unwrap();
    tls.get_ref().set_nonblocking(false).unwrap();
    tls.get_ref()
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut raw = [0u8; HEADER_LEN];
    wire::encode_header(
        &Header::request(Kind::Hello, 42, 0, HELLO_LEN as u32),
        &mut raw,
    )
    .unwrap();
    let probe = wire::encode_hello(&Hello {
        volume_size: SIZE,
        generation: 0,
        flags: 0,
        session: 0,
    });
    tls.write_all(&[&raw[..], &probe[..]].concat()).unwrap();
    tls.read_exact(&mut raw).unwrap();
    let h = wire::decode_header(&raw).unwrap();
    assert_eq!((h.kind, h.id, h.status), (Kind::Hello, 42, 0));
    let mut p = vec![0u8; wire::payload_len(&h)];
    tls.read_exact(&mut p).unwrap();
    assert_eq!(wire::decode_hello(&p).unwrap().volume_size, SIZE);
    finish(tls, server, fw);
}

// Snapshots (protocol version 5): SNAPSHOT and SNAPSHOT_LIST over the
// socket, on the chain of layers a replica's data is.

impl Client {
    /// SNAPSHOT `op` of `name`: the reply's status.
    fn snapshot(&mut self, op: SnapshotOp, name: &str) -> u32 {
        let payload = wire::encode_snapshot_request(&SnapshotRequest {
            op,
            name: name.into(),
        })
        .expect("encodable");
        self.call(Kind::Snapshot, 0, payload.len() as u32, &payload)
            .0
            .status
    }

    /// SNAPSHOT with a raw payload (what the codec would refuse to make).
    fn snapshot_raw(&mut self, payload: &[u8]) -> u32 {
        self.call(Kind::Snapshot, 0, payload.len() as u32, payload)
            .0
            .status
    }

    /// SNAPSHOT_LIST, oldest first.
    fn snapshots(&mut self) -> Vec<SnapshotRecord> {
        let (h, p) = self.call(Kind::SnapshotList, 0, 0, &[]);
        assert_eq!(h.status, 0);
        assert_eq!(h.length as usize, p.len());
        wire::decode_snapshot_list(&p).expect("snapshot list")
    }

    fn snapshot_names(&mut self) -> Vec<String> {
        self.snapshots().into_iter().map(|s| s.name).collect()
    }

    /// Every data extent of the volume (EXTENTS, continued to the end).
    fn all_extents(&mut self) -> Vec<(u64, u64)> {
        let mut extents = Vec::new();
        let mut pos = 0;
        while pos < SIZE {
            let (h, p) = self.call(Kind::Extents, pos, (SIZE - pos) as u32, &[]);
            assert_eq!(h.status, 0);
            assert!(h.offset > pos, "the scan advances");
            extents.extend(wire::decode_extents(&p).unwrap());
            pos = h.offset;
        }
        extents
    }

    /// Waits (bounded) until no snapshot of the list is `name`.
    fn wait_snapshot_gone(&mut self, name: &str) {
        for _ in 0..1000 {
            if !self.snapshot_names().iter().any(|n| n == name) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("snapshot {name} still listed after 10 s");
    }
}

fn layers_dir(dir: &Path) -> PathBuf {
    dir.join("data.img.lull")
}

#[test]
fn snapshot_create_list_write_revert_and_delete() {
    let (dir, fw, server) = replica("snap");
    let mut c = Client::attached(server.local_addr(), 0x50, 1);
    assert_eq!(c.snapshots(), vec![], "a new replica has no snapshot");
    // A change record for a replica away: a revert must note every region.
    let key = wire::encode_change_key(&wire::ChangeKey {
        generation: 1,
        peer: "r9@h:1".into(),
        seed: Vec::new(),
    })
    .unwrap();
    assert_eq!(
        c.call(Kind::ChangesStart, 0, key.len() as u32, &key)
            .0
            .status,
        0
    );

    // A: 256 KiB at 1 MiB (sendfile-sized reads) and a small write.
    let a = pattern(1, 256 * 1024);
    assert_eq!(c.write(MIB, &a), 0);
    assert_eq!(c.write(5 * MIB + 100, b"small A"), 0);
    assert!(!layers_dir(&dir.0).exists(), "no layer before a snapshot");
    let sent = server.sendfile_reads();
    assert_eq!(c.read(MIB, a.len() as u32), a);
    assert_eq!(server.sendfile_reads(), sent + 1, "one layer: sendfile");
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    let list = c.snapshots();
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].name, "s1");
    assert!(list[0].created_unix >= before, "{list:?}");
    assert!(list[0].allocated_bytes >= a.len() as u64, "{list:?}");
    assert_eq!((list[0].merge_done, list[0].merge_total), (0, 0));
    assert!(layers_dir(&dir.0).join("chain.json").is_file());

    // B after the snapshot: the volume reads B, unaligned writes over
    // the snapshot's blocks copy up, and the snapshot keeps A.
    let b = pattern(2, 128 * 1024);
    assert_eq!(c.write(MIB + 64 * 1024, &b), 0);
    assert_eq!(c.write(5 * MIB + 102, b"ALL"), 0);
    let mut ab = a.clone();
    ab[64 * 1024..64 * 1024 + b.len()].copy_from_slice(&b);
    let sent = server.sendfile_reads();
    assert_eq!(c.read(MIB, a.len() as u32), ab);
    assert_eq!(server.sendfile_reads(), sent, "layers: no sendfile");
    assert_eq!(c.read(5 * MIB + 100, 7), b"smALL A");
    // B in a region A never touched, and the allocation covers both.
    assert_eq!(c.write(40 * MIB, &b), 0);
    let extents = c.all_extents();
    let covered = |off: u64, len: u64| extents.iter().any(|&(o, l)| o <= off && off + len <= o + l);
    assert!(covered(MIB, a.len() as u64), "{extents:?}");
    assert!(covered(40 * MIB, b.len() as u64), "{extents:?}");
    assert!(!covered(20 * MIB, 4096), "{extents:?}");
    let (h, p) = c.call(Kind::BlockStatus, 40 * MIB - 4096, 8192, &[]);
    assert_eq!(h.status, 0);
    let st = |length, flags| wire::StatusExtent { length, flags };
    assert_eq!(
        wire::decode_block_status(&p).unwrap(),
        [st(4096, wire::STATUS_HOLE | wire::STATUS_ZERO), st(4096, 0)]
    );
    assert_eq!(c.status(Kind::Flush, 0, 0), 0);

    // Revert: the snapshot's bytes again, and every region possibly
    // different (write-intent and change record).
    assert_eq!(c.snapshot(SnapshotOp::Revert, "s1"), 0);
    assert_eq!(c.read(MIB, a.len() as u32), a);
    assert_eq!(c.read(5 * MIB + 100, 7), b"small A");
    assert_eq!(c.read(40 * MIB, b.len() as u32), vec![0; b.len()]);
    assert_eq!(c.snapshot_names(), ["s1"], "reverting keeps the snapshot");
    assert_eq!(c.intent(), (0, (0..REGIONS).collect()));
    assert_eq!(intent_on_disk(&dir.0), (0..REGIONS).collect::<Vec<_>>());
    let (h, bitmap) = c.call(Kind::ChangesGet, 0, key.len() as u32, &key);
    assert_eq!(h.status, 0);
    let regions = wire::change_regions(SIZE) as u32;
    assert_eq!(set_bits(&bitmap), (0..regions).collect::<Vec<_>>());

    // A second snapshot over C, then delete the first: it merges into
    // its child and leaves the list; the data does not change.
    let cc = pattern(3, 64 * 1024);
    assert_eq!(c.write(2 * MIB, &cc), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "s2"), 0);
    assert_eq!(c.write(3 * MIB, &cc), 0);
    assert_eq!(c.snapshot_names(), ["s1", "s2"]);
    assert_eq!(c.snapshot(SnapshotOp::Delete, "s1"), 0);
    c.wait_snapshot_gone("s1");
    assert_eq!(c.snapshot_names(), ["s2"]);
    assert_eq!(c.read(MIB, a.len() as u32), a);
    assert_eq!(c.read(2 * MIB, cc.len() as u32), cc);
    assert_eq!(c.read(3 * MIB, cc.len() as u32), cc);
    // The first layer was merged away: data.img is gone, the volume
    // lives in its later layers. Reverting to s2 drops C at 3 MiB.
    assert_eq!(c.snapshot(SnapshotOp::Revert, "s2"), 0);
    assert_eq!(c.read(3 * MIB, cc.len() as u32), vec![0; cc.len()]);
    assert_eq!(c.read(MIB, a.len() as u32), a);
    // Deleting the last snapshot leaves one layer: reads (sendfile-sized
    // too) pass straight to it again.
    assert_eq!(c.snapshot(SnapshotOp::Delete, "s2"), 0);
    c.wait_snapshot_gone("s2");
    assert!(!dir.0.join("data.img").exists(), "merged away");
    let sent = server.sendfile_reads();
    assert_eq!(c.read(MIB, a.len() as u32), a);
    assert_eq!(
        server.sendfile_reads(),
        sent + 1,
        "one layer again (not data.img): sendfile"
    );
    assert_eq!(c.read(2 * MIB, cc.len() as u32), cc);
    assert_eq!(c.write(MIB, &b), 0);
    assert_eq!(c.read(MIB, b.len() as u32), b);
    finish(c, server, fw);
}

#[test]
fn bad_snapshot_requests_are_refused_with_their_errno() {
    let (_dir, fw, server) = replica("snap-bad");
    let mut c = Client::attached(server.local_addr(), 0x60, 1);
    assert_eq!(c.write(0, b"data"), 0);
    for name in ["a@b", "a/b", ".hidden", "with space", "é"] {
        assert_eq!(
            c.snapshot(SnapshotOp::Create, name) as i32,
            libc::EINVAL,
            "{name:?}"
        );
    }
    // An unknown op and a name that is not UTF-8: EINVAL, and the
    // connection goes on.
    assert_eq!(c.snapshot_raw(&[9, b's']) as i32, libc::EINVAL);
    assert_eq!(c.snapshot_raw(&[1, 0xff, 0xfe]) as i32, libc::EINVAL);
    assert_eq!(c.snapshot_names(), Vec::<String>::new());
    let longest = "n".repeat(wire::MAX_SNAPSHOT_NAME_BYTES);
    assert_eq!(c.snapshot(SnapshotOp::Create, &longest), 0);
    assert_eq!(
        c.snapshot(SnapshotOp::Create, &longest) as i32,
        libc::EEXIST
    );
    assert_eq!(c.snapshot(SnapshotOp::Delete, "nope") as i32, libc::ENOENT);
    assert_eq!(c.snapshot(SnapshotOp::Revert, "nope") as i32, libc::ENOENT);
    // The chain's limit: 64 layers (63 snapshots and the head).
    for i in 1..lull_bdev::chain::MAX_CHAIN_LAYERS - 1 {
        assert_eq!(c.snapshot(SnapshotOp::Create, &format!("s{i}")), 0, "s{i}");
    }
    assert_eq!(c.snapshots().len(), lull_bdev::chain::MAX_CHAIN_LAYERS - 1);
    assert_eq!(
        c.snapshot(SnapshotOp::Create, "one-more") as i32,
        libc::EMLINK
    );
    assert_eq!(c.read(0, 4), b"data");
    // A name longer than the protocol's bound is a framing error: the
    // connection closes.
    let mut raw = [0u8; HEADER_LEN];
    let h = Header::request(Kind::Snapshot, 77, 0, wire::MAX_SNAPSHOT_REQUEST_LEN as u32);
    wire::encode_header(&h, &mut raw).unwrap();
    raw[24..28].copy_from_slice(&(wire::MAX_SNAPSHOT_REQUEST_LEN as u32 + 1).to_be_bytes());
    c.s.write_all(&raw).unwrap();
    c.s.write_all(&vec![b'x'; wire::MAX_SNAPSHOT_REQUEST_LEN + 1])
        .unwrap();
    c.expect_closed();
    finish(c, server, fw);
}

#[test]
fn snapshots_are_for_the_owner_only() {
    let (dir, fw, server) = replica("snap-fence");
    let mut tool = Client::connect(server.local_addr());
    tool.probe();
    // With no engine owning it, a tool may take one (and a clean replica
    // is marked dirty first, as for any modifying request).
    assert!(server.is_clean());
    assert_eq!(tool.snapshot(SnapshotOp::Create, "by-tool"), 0);
    assert!(!meta(&dir.0).clean);
    let mut e = Client::attached(server.local_addr(), 0x70, 1);
    // Once an engine owns it: a tool gets ESTALE, and may still list.
    assert_eq!(tool.snapshot(SnapshotOp::Create, "t2") as i32, libc::ESTALE);
    assert_eq!(
        tool.snapshot(SnapshotOp::Delete, "by-tool") as i32,
        libc::ESTALE
    );
    assert_eq!(tool.snapshot_names(), ["by-tool"]);
    // An engine fenced by a newer one: its connection closes instead.
    let mut newer = Client::engine(server.local_addr(), 0x71);
    newer.probe();
    let payload = wire::encode_snapshot_request(&SnapshotRequest {
        op: SnapshotOp::Create,
        name: "late".into(),
    })
    .unwrap();
    let mut raw = [0u8; HEADER_LEN];
    let h = Header::request(Kind::Snapshot, 99, 0, payload.len() as u32);
    wire::encode_header(&h, &mut raw).unwrap();
    // The socket may already be closed: a failed send is fine.
    let _ = e.s.write_all(&raw).and_then(|()| e.s.write_all(&payload));
    e.expect_closed();
    assert_eq!(newer.snapshot_names(), ["by-tool"]);
    assert_eq!(newer.snapshot(SnapshotOp::Create, "s2"), 0);
    assert_eq!(newer.snapshot_names(), ["by-tool", "s2"]);
    finish((tool, newer), server, fw);
}

#[test]
fn snapshots_survive_a_restart_and_old_directories_open_unchanged() {
    let dir = TempDir::new("snap-restart");
    let fw = framework();
    let a = pattern(4, 96 * 1024);
    let b = pattern(5, 96 * 1024);

    // A replica from before snapshots: data.img alone, and it stays so.
    let server = serve(&fw, &dir.0);
    let mut c = Client::attached(server.local_addr(), 0x80, 1);
    assert_eq!(c.write(0, &a), 0);
    shut_down(c, server);
    assert!(!layers_dir(&dir.0).exists());
    let server = serve(&fw, &dir.0);
    let mut c = Client::attached(server.local_addr(), 0x81, 2);
    assert_eq!(c.read(0, a.len() as u32), a);
    assert!(!layers_dir(&dir.0).exists(), "opened without migration");

    assert_eq!(c.snapshot(SnapshotOp::Create, "before-b"), 0);
    assert_eq!(c.write(0, &b), 0);
    assert_eq!(c.status(Kind::Flush, 0, 0), 0);
    shut_down(c, server);

    let server = serve(&fw, &dir.0);
    let mut c = Client::attached(server.local_addr(), 0x82, 3);
    assert_eq!(c.snapshot_names(), ["before-b"]);
    assert_eq!(c.read(0, b.len() as u32), b);
    assert_eq!(c.snapshot(SnapshotOp::Revert, "before-b"), 0);
    assert_eq!(c.read(0, a.len() as u32), a);
    // A merge stopped by a shutdown leaves the snapshot in place.
    assert_eq!(c.write(8 * MIB, &b), 0);
    assert_eq!(c.snapshot(SnapshotOp::Delete, "before-b"), 0);
    shut_down(c, server);
    let server = serve(&fw, &dir.0);
    let mut c = Client::attached(server.local_addr(), 0x83, 4);
    let left = c.snapshot_names();
    assert!(left.is_empty() || left == ["before-b"], "{left:?}");
    assert_eq!(c.read(0, a.len() as u32), a);
    assert_eq!(c.read(8 * MIB, b.len() as u32), b);
    finish(c, server, fw);
}

#[test]
fn a_store_replica_deleted_takes_its_layers_along() {
    let dir = TempDir::new("snap-store");
    let fw = framework();
    let store = open_store(&fw, &dir, &["r1"]);
    let rdir = dir.0.join("replicas").join("r1");
    let mut c = Client::connect(store.local_addr());
    let (h, _) = c.hello_named("r1", 0);
    assert_eq!(h.status, 0);
    // Enough data that the merge below runs for a while.
    let chunk = pattern(6, 1 << 20);
    for i in 0..32 {
        assert_eq!(c.write(i * MIB, &chunk), 0);
    }
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    assert_eq!(c.write(40 * MIB, &chunk), 0);
    let info = store.get("r1").unwrap();
    assert!(
        info.allocated_bytes >= 33 * MIB,
        "every layer counts: {info:?}"
    );
    assert!(layers_dir(&rdir).join("chain.json").is_file());
    // Delete the snapshot (a merge starts), then the replica.
    assert_eq!(c.snapshot(SnapshotOp::Delete, "s1"), 0);
    drop(c);
    store.delete("r1").unwrap();
    assert!(!rdir.exists());
    // A merge stopped, not running on: nothing comes back.
    std::thread::sleep(Duration::from_millis(200));
    assert!(!rdir.exists(), "the replica's directory came back");
    assert_eq!(
        std::fs::read_dir(dir.0.join("replicas")).unwrap().count(),
        0
    );
    // The name is free again.
    store.create("r1", SIZE).unwrap();

    // A `lull replica` directory whose first layer was merged away (no
    // data.img, its chain in data.img.lull/) is adopted with its layers.
    let outside = TempDir::new("snap-store-import");
    let server = serve(&fw, &outside.0);
    let mut c = Client::connect(server.local_addr());
    c.probe();
    assert_eq!(c.write(0, &chunk), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "a"), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "b"), 0);
    assert_eq!(c.snapshot(SnapshotOp::Delete, "a"), 0);
    c.wait_snapshot_gone("a");
    shut_down(c, server);
    assert!(!outside.0.join("data.img").exists());
    store.import("r2", &outside.0).unwrap();
    let mut c = Client::connect(store.local_addr());
    assert_eq!(c.hello_named("r2", 0).0.status, 0);
    assert_eq!(c.snapshot_names(), ["b"]);
    assert_eq!(c.read(0, chunk.len() as u32), chunk);
    finish_store(c, store, fw);
}

#[test]
fn writes_and_reads_go_on_while_snapshots_are_taken() {
    let (_dir, fw, server) = replica("snap-load");
    let mut c = Client::attached(server.local_addr(), 0x90, 1);
    let addr = server.local_addr();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // One request at a time: a request the chain holds during a
    // snapshot has nothing else in flight to wake its connection.
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut w = Client::engine(addr, 0x90);
            w.probe();
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let off = (n % 512) * 64 * 1024;
                let data = pattern(n as u8, 36 * 1024);
                assert_eq!(w.write(off, &data), 0);
                assert_eq!(w.read(off, data.len() as u32), data, "write {n}");
                n += 1;
            }
            n
        })
    };
    for i in 0..20 {
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(c.snapshot(SnapshotOp::Create, &format!("s{i}")), 0);
    }
    for i in 0..19 {
        assert_eq!(c.snapshot(SnapshotOp::Delete, &format!("s{i}")), 0);
        c.wait_snapshot_gone(&format!("s{i}"));
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let n = writer.join().expect("the writer saw its data");
    assert!(n > 20, "{n} writes");
    assert_eq!(c.snapshot_names(), ["s19"]);
    finish(c, server, fw);
}

// Snapshot views and CHANGED (protocol version 6): a HELLO naming
// `REPLICA@SNAPSHOT` reads the snapshot; CHANGED lists what was written
// since one.

impl Client {
    /// A HELLO naming `name` (a replica, or a view `REPLICA@SNAPSHOT`)
    /// with `flags` and this client's session: the reply and its HELLO.
    fn hello_named(&mut self, name: &str, flags: u64) -> (Header, Hello) {
        let body = wire::encode_hello_request(
            &Hello {
                volume_size: SIZE,
                generation: 0,
                flags,
                session: self.session,
            },
            name,
        );
        let (h, p) = self.call(Kind::Hello, 0, body.len() as u32, &body);
        (h, wire::decode_hello(&p).expect("hello payload"))
    }

    /// A view of `snapshot` on a `lull replica` process, opened.
    fn view(addr: SocketAddr, snapshot: &str) -> Client {
        let mut v = Client::connect(addr);
        let (h, hello) = v.hello_named(&wire::view_hello_name("", snapshot), 0);
        assert_eq!(h.status, 0, "view of {snapshot}");
        assert_eq!(hello.volume_size, SIZE);
        v
    }

    /// CHANGED since `since` over `[offset, offset + length)`: the status
    /// and the records (none on an error).
    fn changed(&mut self, offset: u64, length: u32, since: &str) -> (u32, Vec<StatusExtent>) {
        let payload = wire::encode_changed_request(&ChangedRequest {
            length,
            since: since.into(),
        })
        .expect("encodable");
        let (h, p) = self.call(Kind::Changed, offset, payload.len() as u32, &payload);
        if h.status != 0 {
            assert!(p.is_empty());
            return (h.status, Vec::new());
        }
        assert_eq!(h.offset, offset, "the offset is echoed");
        assert_eq!(h.length as usize, p.len());
        (h.status, wire::decode_block_status(&p).expect("records"))
    }

    /// The byte ranges of the whole volume written since `since`
    /// (CHANGED, continued to the end), merged.
    fn changed_ranges(&mut self, since: &str) -> Vec<(u64, u64)> {
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        let mut pos = 0;
        while pos < SIZE {
            let (status, records) = self.changed(pos, (SIZE - pos) as u32, since);
            assert_eq!(status, 0, "CHANGED since {since} at {pos}");
            assert!(!records.is_empty() && records.len() <= wire::MAX_BLOCK_STATUS_PER_REPLY);
            for r in records {
                assert!(
                    r.length > 0 && r.flags & !wire::STATUS_CHANGED == 0,
                    "{r:?}"
                );
                if r.flags & wire::STATUS_CHANGED != 0 {
                    match ranges.last_mut() {
                        Some(last) if last.0 + last.1 == pos => last.1 += r.length,
                        _ => ranges.push((pos, r.length)),
                    }
                }
                pos += r.length;
            }
        }
        assert_eq!(pos, SIZE, "the records end at the range's end");
        ranges
    }

    /// BLOCK_STATUS of `[offset, offset + length)`, status 0 expected.
    fn block_status(&mut self, offset: u64, length: u32) -> Vec<StatusExtent> {
        let (h, p) = self.call(Kind::BlockStatus, offset, length, &[]);
        assert_eq!(h.status, 0);
        wire::decode_block_status(&p).unwrap()
    }
}

const HOLE_ZERO: u32 = wire::STATUS_HOLE | wire::STATUS_ZERO;

fn status_extent(length: u64, flags: u32) -> StatusExtent {
    StatusExtent { length, flags }
}

#[test]
fn a_view_reads_its_snapshot_not_the_live_data() {
    let (_dir, fw, server) = replica("view");
    let addr = server.local_addr();
    let mut c = Client::attached(addr, 0x80, 1);
    let a = pattern(1, 256 * 1024);
    let small = pattern(2, 8192);
    assert_eq!(c.write(MIB, &a), 0);
    assert_eq!(c.write(8 * MIB, &small), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    // After s1: `a` overwritten in part, `small` trimmed, new data where
    // s1 holds none.
    let b = pattern(3, 128 * 1024);
    assert_eq!(c.write(MIB + 64 * 1024, &b), 0);
    assert_eq!(c.status(Kind::Trim, 8 * MIB, small.len() as u32), 0);
    assert_eq!(c.write(20 * MIB, &b), 0);
    let mut ab = a.clone();
    ab[64 * 1024..64 * 1024 + b.len()].copy_from_slice(&b);
    assert_eq!(c.read(MIB, a.len() as u32), ab);

    let mut v = Client::view(addr, "s1");
    let sent = server.sendfile_reads();
    assert_eq!(v.read(MIB, a.len() as u32), a, "s1's bytes");
    assert_eq!(v.read(8 * MIB, small.len() as u32), small);
    assert_eq!(v.read(20 * MIB, 4096), vec![0; 4096]);
    assert_eq!(
        server.sendfile_reads(),
        sent,
        "a view never sends the head file"
    );
    assert_eq!(v.status(Kind::Ping, 0, 0), 0);
    // The allocation is s1's: nothing at 20 MiB (the head has data).
    assert_eq!(
        v.block_status(20 * MIB - 4096, 8192),
        [status_extent(8192, HOLE_ZERO)]
    );
    assert_eq!(
        c.block_status(20 * MIB - 4096, 8192),
        [status_extent(4096, HOLE_ZERO), status_extent(4096, 0)]
    );
    assert_eq!(
        v.block_status(MIB - 4096, 4096 + a.len() as u32 + 4096),
        [
            status_extent(4096, HOLE_ZERO),
            status_extent(a.len() as u64, 0),
            status_extent(4096, HOLE_ZERO),
        ]
    );
    let extents = v.all_extents();
    let covered = |off: u64, len: u64| extents.iter().any(|&(o, l)| o <= off && off + len <= o + l);
    assert!(covered(MIB, a.len() as u64), "{extents:?}");
    assert!(covered(8 * MIB, small.len() as u64), "{extents:?}");
    assert!(!covered(20 * MIB, 4096), "{extents:?}");
    assert!(c
        .all_extents()
        .iter()
        .any(|&(o, l)| o <= 20 * MIB && 20 * MIB < o + l));
    // Out of range on a view, as on any connection.
    assert_eq!(v.status(Kind::Read, SIZE - 4096, 8192) as i32, libc::EINVAL);
    assert_eq!(v.status(Kind::BlockStatus, SIZE, 1) as i32, libc::EINVAL);
    // A later HELLO naming the same view is answered.
    let (h, _) = v.hello_named("@s1", 0);
    assert_eq!(h.status, 0);
    assert_eq!(v.read(MIB, 4096), a[..4096].to_vec());
    // The live data did not change under the view.
    assert_eq!(c.read(MIB, a.len() as u32), ab);
    finish((c, v), server, fw);
}

#[test]
fn a_view_refuses_what_modifies_and_changes_no_record() {
    let (dir, fw, server) = replica("view-rofs");
    let addr = server.local_addr();
    let mut c = Client::attached(addr, 0x81, 1);
    let a = pattern(4, 64 * 1024);
    assert_eq!(c.write(MIB, &a), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    assert_eq!(c.status(Kind::Flush, 0, 0), 0);
    assert_eq!(c.detach(), 0);
    assert!(server.is_clean() && meta(&dir.0).clean);
    assert_eq!(c.intent(), (0, vec![]));

    let mut v = Client::view(addr, "s1");
    let erofs = libc::EROFS as u32;
    // Writes, one larger than the replica's input buffer: their payloads
    // are drained.
    assert_eq!(v.write(MIB, &pattern(5, 4096)), erofs);
    assert_eq!(v.write(0, &pattern(6, 1 << 20)), erofs);
    assert_eq!(
        v.call(Kind::WriteFua, MIB, 4096, &pattern(7, 4096))
            .0
            .status,
        erofs
    );
    for (kind, offset, length) in [
        (Kind::Trim, MIB, 4096),
        (Kind::WriteZeroes, MIB, 4096),
        (Kind::Flush, 0, 0),
        (Kind::Detach, 0, 0),
        (Kind::IntentMark, 0, 1),
        (Kind::IntentClear, 0, 1),
        (Kind::IntentGet, 0, 0),
        (Kind::SnapshotList, 0, 0),
    ] {
        assert_eq!(v.status(kind, offset, length), erofs, "{kind:?}");
    }
    assert_eq!(v.snapshot(SnapshotOp::Create, "v1"), erofs);
    assert_eq!(v.snapshot(SnapshotOp::Delete, "s1"), erofs);
    assert_eq!(v.snapshot(SnapshotOp::Revert, "s1"), erofs);
    let key = |seed: Vec<u8>| {
        wire::encode_change_key(&wire::ChangeKey {
            generation: 1,
            peer: "r9@h:1".into(),
            seed,
        })
        .unwrap()
    };
    let (start, key) = (key(vec![0xff; 8]), key(Vec::new()));
    assert_eq!(
        v.call(Kind::ChangesStart, 0, start.len() as u32, &start)
            .0
            .status,
        erofs
    );
    for kind in [Kind::ChangesGet, Kind::ChangesDrop] {
        assert_eq!(
            v.call(kind, 0, key.len() as u32, &key).0.status,
            erofs,
            "{kind:?}"
        );
    }
    // The connection goes on, and reads s1.
    assert_eq!(v.status(Kind::Ping, 0, 0), 0);
    assert_eq!(v.read(MIB, a.len() as u32), a);

    // Nothing changed: data, snapshots, the clean record, the
    // write-intent record, the change records.
    let mut t = Client::connect(addr);
    let probe = t.probe();
    assert_eq!(probe.flags & HELLO_FLAG_CLEAN, HELLO_FLAG_CLEAN);
    assert!(server.is_clean() && meta(&dir.0).clean);
    assert_eq!(t.read(MIB, a.len() as u32), a);
    assert_eq!(t.read(0, 4096), vec![0; 4096]);
    assert_eq!(t.snapshot_names(), ["s1"]);
    assert_eq!(t.intent(), (0, vec![]));
    assert_eq!(intent_on_disk(&dir.0), Vec::<u32>::new());
    assert_eq!(
        t.call(Kind::ChangesGet, 0, key.len() as u32, &key).0.status as i32,
        libc::ENOENT
    );
    // The view counts in no fence: the engine's session still owns the
    // replica, and takes it again at once.
    assert_eq!(c.attach(2).generation, 2);
    finish((c, v, t), server, fw);
}

#[test]
fn bad_view_hellos_are_refused_and_close() {
    let (_dir, fw, server) = replica("view-bad");
    let addr = server.local_addr();
    let mut c = Client::connect(addr);
    c.probe();
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "s2"), 0);

    // No such snapshot: ENOENT, with the replica's HELLO.
    let mut v = Client::connect(addr);
    let (h, hello) = v.hello_named("@nope", 0);
    assert_eq!(h.status as i32, libc::ENOENT);
    assert_eq!(hello.volume_size, SIZE);
    v.expect_closed();
    // A replica name on a `lull replica` process: ENOENT.
    let mut v = Client::connect(addr);
    assert_eq!(v.hello_named("r1@s1", 0).0.status as i32, libc::ENOENT);
    v.expect_closed();
    // A session, or the attach flag: EINVAL.
    let mut v = Client::engine(addr, 0x99);
    assert_eq!(v.hello_named("@s1", 0).0.status as i32, libc::EINVAL);
    v.expect_closed();
    let mut v = Client::connect(addr);
    let (h, _) = v.hello_named("@s1", HELLO_FLAG_ATTACH);
    assert_eq!(h.status as i32, libc::EINVAL);
    v.expect_closed();
    // A later HELLO naming another view, or the live data, closes.
    let mut v = Client::view(addr, "s1");
    let body = wire::encode_hello_request(
        &Hello {
            volume_size: SIZE,
            generation: 0,
            flags: 0,
            session: 0,
        },
        "@s2",
    );
    v.send(
        &Header::request(Kind::Hello, 50, 0, body.len() as u32),
        &body,
    );
    v.expect_closed();
    let mut v = Client::view(addr, "s1");
    v.send(
        &Header::request(Kind::Hello, 51, 0, HELLO_LEN as u32),
        &body[..HELLO_LEN],
    );
    v.expect_closed();
    // And a live connection does not become a view.
    c.send(
        &Header::request(Kind::Hello, 52, 0, body.len() as u32),
        &body,
    );
    c.expect_closed();
    // The replica serves on.
    let mut c = Client::connect(addr);
    c.probe();
    assert_eq!(c.snapshot_names(), ["s1", "s2"]);
    finish(c, server, fw);
}

#[test]
fn changed_lists_the_blocks_written_since_a_snapshot() {
    let (_dir, fw, server) = replica("changed");
    let addr = server.local_addr();
    let mut c = Client::attached(addr, 0x82, 1);
    // Before s1 (and a snapshot-free replica has nothing to compare to).
    assert_eq!(c.write(0, &pattern(1, 8192)), 0);
    assert_eq!(c.changed(0, 4096, "s1").0 as i32, libc::ENOENT);
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    assert_eq!(c.changed_ranges("s1"), vec![], "nothing written yet");
    // Between s1 and s2: an unaligned write over two 4 KiB blocks, a
    // small one, a trim of data s1 holds.
    assert_eq!(c.write(MIB + 100, &pattern(2, 4096)), 0);
    assert_eq!(c.write(5 * MIB + 10, b"ten bytes!"), 0);
    assert_eq!(c.status(Kind::Trim, 0, 4096), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "s2"), 0);
    // After s2.
    assert_eq!(c.write(9 * MIB, &pattern(3, 4096)), 0);

    let s1_to_s2 = vec![(0, 4096), (MIB, 8192), (5 * MIB, 4096)];
    let mut s1_to_now = s1_to_s2.clone();
    s1_to_now.push((9 * MIB, 4096));
    assert_eq!(c.changed_ranges("s1"), s1_to_now);
    assert_eq!(c.changed_ranges("s2"), vec![(9 * MIB, 4096)]);
    // A sub-range: records cover it from its offset.
    assert_eq!(
        c.changed(MIB - 4096, 4 * 4096, "s1"),
        (
            0,
            vec![
                status_extent(4096, 0),
                status_extent(8192, wire::STATUS_CHANGED),
                status_extent(4096, 0),
            ]
        )
    );

    // On a view of s2: what was written between s1 and s2, not later.
    let mut v = Client::view(addr, "s2");
    assert_eq!(v.changed_ranges("s1"), s1_to_s2);
    // Not older than the view's snapshot: ENOENT.
    assert_eq!(v.changed(0, 4096, "s2").0 as i32, libc::ENOENT);
    let mut v1 = Client::view(addr, "s1");
    assert_eq!(v1.changed(0, 4096, "s2").0 as i32, libc::ENOENT);

    // Refusals; the connection goes on.
    for conn in [&mut c, &mut v] {
        assert_eq!(conn.changed(0, 4096, "nope").0 as i32, libc::ENOENT);
        assert_eq!(conn.changed(SIZE - 4096, 8192, "s1").0 as i32, libc::EINVAL);
        assert_eq!(conn.changed(SIZE, 1, "s1").0 as i32, libc::EINVAL);
        assert_eq!(conn.changed(0, 0, "s1").0 as i32, libc::EINVAL);
        assert_eq!(
            conn.changed(u64::MAX - 10, 4096, "s1").0 as i32,
            libc::EINVAL
        );
        // A payload the codec would not make: a bad name, not UTF-8.
        for bad in [&b"\0\0\x10\0a b"[..], b"\0\0\x10\0\xff\xfe"] {
            let (h, _) = conn.call(Kind::Changed, 0, bad.len() as u32, bad);
            assert_eq!(h.status as i32, libc::EINVAL, "{bad:?}");
        }
        assert_eq!(conn.status(Kind::Ping, 0, 0), 0);
    }
    // CHANGED modifies nothing: a clean replica stays clean under it.
    assert_eq!(c.status(Kind::Flush, 0, 0), 0);
    assert_eq!(c.detach(), 0);
    assert_eq!(c.changed_ranges("s2"), vec![(9 * MIB, 4096)]);
    assert!(server.is_clean());
    finish((c, v, v1), server, fw);
}

#[test]
fn a_view_reads_its_snapshot_while_it_is_deleted() {
    let (_dir, fw, server) = replica("view-delete");
    let addr = server.local_addr();
    let mut c = Client::attached(addr, 0x83, 1);
    // Enough data that the merge runs for a while.
    let a = pattern(1, 1 << 20);
    for i in 0..16 {
        assert_eq!(c.write(i * MIB, &a), 0);
    }
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    let b = pattern(2, 256 * 1024);
    assert_eq!(c.write(MIB, &b), 0);
    assert_eq!(c.write(40 * MIB, &b), 0);

    let mut v = Client::view(addr, "s1");
    assert_eq!(v.read(MIB, b.len() as u32), a[..b.len()].to_vec());
    let status_before = v.block_status(0, SIZE as u32);
    assert_eq!(c.snapshot(SnapshotOp::Delete, "s1"), 0);
    // Reads during the merge and after it: s1's bytes throughout.
    let mut rounds = 0;
    while c.snapshot_names().iter().any(|n| n == "s1") {
        assert_eq!(v.read(MIB, b.len() as u32), a[..b.len()].to_vec());
        rounds += 1;
        assert!(rounds < 10_000, "the merge of s1 does not end");
    }
    assert_eq!(c.snapshot_names(), Vec::<String>::new());
    // The live chain is one layer again: its reads go with sendfile; the
    // view's (the same range, sendfile-sized) must not, or it would send
    // the live bytes.
    let sent = server.sendfile_reads();
    assert_eq!(c.read(MIB, b.len() as u32), b);
    assert_eq!(server.sendfile_reads(), sent + 1, "one layer: sendfile");
    for i in 0..16 {
        assert_eq!(v.read(i * MIB, a.len() as u32), a, "MiB {i}");
    }
    assert_eq!(v.read(40 * MIB, 4096), vec![0; 4096]);
    assert_eq!(server.sendfile_reads(), sent + 1, "never for a view");
    assert_eq!(v.block_status(0, SIZE as u32), status_before);
    // The snapshot is gone for new views and for CHANGED.
    let mut late = Client::connect(addr);
    assert_eq!(late.hello_named("@s1", 0).0.status as i32, libc::ENOENT);
    assert_eq!(c.changed(0, 4096, "s1").0 as i32, libc::ENOENT);
    // The view's layers go when it closes: the live data is unchanged.
    drop(v);
    assert_eq!(c.read(MIB, b.len() as u32), b);
    assert_eq!(c.read(2 * MIB, a.len() as u32), a);
    assert_eq!(c.read(40 * MIB, b.len() as u32), b);
    finish((c, late), server, fw);
}

#[test]
fn a_store_serves_views_by_replica_and_snapshot() {
    let dir = TempDir::new("view-store");
    let fw = framework();
    let store = open_store(&fw, &dir, &["r1", "r2"]);
    let addr = store.local_addr();
    let mut c = Client::connect(addr);
    assert_eq!(c.hello_named("r1", 0).0.status, 0);
    let a = pattern(1, 8192);
    assert_eq!(c.write(0, &a), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    assert_eq!(c.write(0, &pattern(2, 8192)), 0);

    let mut v = Client::connect(addr);
    assert_eq!(
        v.hello_named(&wire::view_hello_name("r1", "s1"), 0)
            .0
            .status,
        0
    );
    assert_eq!(v.read(0, 8192), a);
    assert_eq!(v.changed(0, 8192, "s1").0 as i32, libc::ENOENT, "not older");
    // The other replica has no such snapshot; an unknown one, no data.
    let mut v2 = Client::connect(addr);
    let (h, _) = v2.hello_named(&wire::view_hello_name("r2", "s1"), 0);
    assert_eq!(h.status as i32, libc::ENOENT);
    v2.expect_closed();
    let mut v3 = Client::connect(addr);
    let (h, _) = v3.hello_named(&wire::view_hello_name("r3", "s1"), 0);
    assert_eq!(h.status as i32, libc::ENOENT);
    v3.expect_closed();
    // A view needs a replica's name on a store.
    let mut v4 = Client::connect(addr);
    let (h, _) = v4.hello_named("@s1", 0);
    assert_eq!(h.status as i32, libc::ENOENT);
    v4.expect_closed();
    assert_eq!(c.changed_ranges("s1"), vec![(0, 8192)]);
    finish_store((c, v), store, fw);
}

impl Client {
    /// CLONE (on a view connection): the reply's status.
    fn clone_as(&mut self, name: &str) -> u32 {
        self.call(Kind::Clone, 0, name.len() as u32, name.as_bytes())
            .0
            .status
    }

    /// Waits until no snapshot is listed as merging (a delete's or a
    /// flatten's merge ran to its end).
    fn wait_merges(&mut self) {
        for _ in 0..1000 {
            if self.snapshots().iter().all(|s| s.merge_total == 0) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("a merge still runs after 10 s");
    }
}

#[test]
fn a_store_clones_a_snapshot_shared_and_flattens_it() {
    let dir = TempDir::new("clone-store");
    let fw = framework();
    let store = open_store(&fw, &dir, &["r1"]);
    let addr = store.local_addr();
    let mut c = Client::connect(addr);
    assert_eq!(c.hello_named("r1", 0).0.status, 0);
    let (a, b) = (pattern(1, 8192), pattern(2, 8192));
    assert_eq!(c.write(0, &a), 0);
    assert_eq!(c.write(4 * MIB, &a), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    assert_eq!(c.write(0, &b), 0);

    let mut v = Client::connect(addr);
    let (h, _) = v.hello_named(&wire::view_hello_name("r1", "s1"), 0);
    assert_eq!(h.status, 0);
    assert_eq!(v.clone_as("c1"), 0);
    assert_eq!(v.clone_as("c1"), 0, "the same clone again is a retry");
    assert_eq!(v.clone_as("r1") as i32, libc::EEXIST);
    assert_eq!(v.clone_as("bad/name") as i32, libc::EINVAL);
    assert_eq!(v.read(0, 8192), a, "the view goes on");
    // CLONE is a view's request.
    assert_eq!(c.clone_as("c9") as i32, libc::EINVAL);
    assert!(store.get("c9").is_err());
    // A new replica: clean at generation 0, as a created one.
    let info = store.get("c1").unwrap();
    assert!(info.clean && info.generation == 0, "{info:?}");

    // The clone reads the snapshot, writes on its own, and shares the
    // origin's layers (its directory holds only its head).
    let mut k = Client::connect(addr);
    assert_eq!(k.hello_named("c1", 0).0.status, 0);
    assert_eq!(k.read(0, 8192), a);
    let records = k.snapshots();
    assert_eq!(records.len(), 1);
    assert!(
        records[0].name == "s1" && records[0].inherited,
        "{records:?}"
    );
    assert!(!c.snapshots()[0].inherited);
    let d = pattern(3, 4096);
    assert_eq!(k.write(4096, &d), 0);
    assert_eq!(k.read(4096, 4096), d);
    assert_eq!(c.read(0, 8192), b, "the origin's live data is its own");
    assert_eq!(v.read(0, 8192), a, "and so is its snapshot");
    assert!(store.get("c1").unwrap().allocated_bytes < 1 << 20);

    // What the clone stands on cannot go, and the refusals say why.
    assert_eq!(c.snapshot(SnapshotOp::Delete, "s1") as i32, libc::EBUSY);
    assert_eq!(k.snapshot(SnapshotOp::Delete, "s1") as i32, libc::EBUSY);
    let e = store.delete("r1").unwrap_err();
    assert!(e.to_string().contains("c1"), "{e}");
    assert_eq!(e.errno(), libc::EBUSY);
    // A second clone, kept through a restart below.
    assert_eq!(v.clone_as("c2"), 0);
    drop(v);

    // Flatten: a wrong base is refused; the right one copies the base in
    // the background, after which the clone stands alone.
    assert_eq!(k.snapshot(SnapshotOp::Flatten, "s0") as i32, libc::ENOENT);
    assert_eq!(k.snapshot(SnapshotOp::Flatten, "s1"), 0);
    k.wait_snapshot_gone("s1");
    assert_eq!(k.read(0, 4096), a[..4096].to_vec());
    assert_eq!(k.read(4096, 4096), d);
    assert_eq!(k.read(4 * MIB, 8192), a);
    assert_eq!(
        k.snapshot(SnapshotOp::Flatten, "s1"),
        0,
        "again: nothing to do"
    );
    // c2 still holds s1.
    assert_eq!(c.snapshot(SnapshotOp::Delete, "s1") as i32, libc::EBUSY);
    finish_store((c, k), store, fw);

    // After a restart the clone still stands on its base, and once it is
    // deleted the origin's snapshot may go.
    let fw = framework();
    let store = Store::open(
        fw.handle(),
        &StoreConfig {
            dir: dir.0.clone(),
            ..StoreConfig::default()
        },
    )
    .unwrap();
    let addr = store.local_addr();
    let mut k2 = Client::connect(addr);
    assert_eq!(k2.hello_named("c2", 0).0.status, 0);
    assert_eq!(k2.read(0, 8192), a);
    assert_eq!(k2.read(4 * MIB, 8192), a);
    drop(k2);
    store.delete("c2").unwrap();
    let mut c = Client::connect(addr);
    assert_eq!(c.hello_named("r1", 0).0.status, 0);
    assert_eq!(c.snapshot(SnapshotOp::Delete, "s1"), 0);
    c.wait_merges();
    c.wait_snapshot_gone("s1");
    assert_eq!(c.read(0, 8192), b);
    assert_eq!(c.read(4 * MIB, 8192), a);
    let mut k = Client::connect(addr);
    assert_eq!(k.hello_named("c1", 0).0.status, 0);
    assert_eq!(
        k.read(4 * MIB, 8192),
        a,
        "the flattened clone reads its own copy"
    );
    store.delete("r1").unwrap();
    finish_store((c, k), store, fw);
}

/// GROW (protocol v7): the volume grows online with its snapshots, the
/// new range reads zeros and takes writes, bad sizes are refused with
/// EINVAL, only the owner grows it, and a restart (asked for the old
/// size) opens at the new one with its intent record intact; in a store,
/// `store.json` follows.
#[test]
fn grow_is_online_durable_and_refuses_bad_sizes() {
    let (dir, fw, server) = replica("grow");
    let big = 2 * SIZE;
    let a = pattern(11, 64 * 1024);
    let b = pattern(12, 64 * 1024);
    let mut c = Client::attached(server.local_addr(), 0x90, 1);
    assert_eq!(c.write(0, &a), 0);
    assert_eq!(c.snapshot(SnapshotOp::Create, "s1"), 0);
    assert_eq!(c.write(SIZE, &b), libc::EINVAL as u32, "past the end");
    let einval = libc::EINVAL as u32;
    assert_eq!(c.status(Kind::Grow, SIZE - 4096, 0), einval, "shrink");
    assert_eq!(c.status(Kind::Grow, SIZE + 512, 0), einval, "unaligned");
    assert_eq!(
        c.status(Kind::Grow, 128 << 30, 0),
        einval,
        "the region sizes would change"
    );
    // Another session cannot grow what an engine owns.
    let mut tool = Client::connect(server.local_addr());
    tool.probe();
    assert_eq!(
        tool.status(Kind::Grow, big, 0),
        libc::ESTALE as u32,
        "a tool while an engine owns the replica"
    );
    assert_eq!(c.status(Kind::Grow, big, 0), 0);
    assert_eq!(c.status(Kind::Grow, big, 0), 0, "again: nothing to do");
    assert_eq!(server.size_bytes(), big);
    assert_eq!(meta(&dir.0).volume_size, big);
    assert_eq!(
        c.read(SIZE, 8192),
        vec![0; 8192],
        "the new range reads zeros"
    );
    assert_eq!(c.write(big - b.len() as u64, &b), 0);
    assert_eq!(c.read(0, a.len() as u32), a);
    assert_eq!(c.snapshot_names(), ["s1"]);
    // The intent record has the new regions (INTENT_GET answers them).
    let (h, p) = c.call(Kind::IntentGet, 0, 0, &[]);
    assert_eq!(h.status, 0);
    assert_eq!(h.offset, u64::from(wire::intent_regions(big)));
    assert_eq!(
        wire::decode_intent(&p).expect("intent").1.len(),
        wire::intent_bitmap_bytes(big)
    );
    assert_eq!(c.status(Kind::Flush, 0, 0), 0);
    shut_down((c, tool), server);

    // Asked for the old size, it opens at the size it was grown to.
    let server = serve(&fw, &dir.0);
    assert_eq!(server.size_bytes(), big);
    let mut c = Client::engine(server.local_addr(), 0x91);
    let (h, hello) = c.hello(SIZE, 2, HELLO_FLAG_ATTACH);
    assert_ne!(h.status, 0, "a HELLO of the old size is refused");
    assert_eq!(hello.volume_size, big);
    let mut c = Client::engine(server.local_addr(), 0x92);
    let (h, hello) = c.hello(big, 2, HELLO_FLAG_ATTACH);
    assert_eq!(h.status, 0);
    assert_eq!(
        hello.flags & HELLO_FLAG_INTENT_LOST,
        0,
        "intent record kept"
    );
    assert_eq!(c.read(0, a.len() as u32), a);
    assert_eq!(c.read(big - b.len() as u64, b.len() as u32), b);
    shut_down(c, server);

    // In a store: the record follows the replica's size.
    let sdir = TempDir::new("grow-store");
    let store = open_store(&fw, &sdir, &["r1"]);
    let mut c = Client::connect(store.local_addr());
    assert_eq!(c.hello_named("r1", 0).0.status, 0);
    assert_eq!(c.status(Kind::Grow, big, 0), 0);
    assert_eq!(store.get("r1").unwrap().size_bytes, big);
    let record = std::fs::read_to_string(sdir.0.join("store.json")).unwrap();
    assert!(
        record.contains(&format!("\"size_bytes\": {big}")),
        "store.json: {record}"
    );
    drop(c);
    store.shutdown(Duration::from_secs(10)).unwrap();
    drop(store);
    let store = Store::open(
        fw.handle(),
        &StoreConfig {
            dir: sdir.0.clone(),
            ..StoreConfig::default()
        },
    )
    .unwrap();
    assert_eq!(store.get("r1").unwrap().size_bytes, big);
    finish_store((), store, fw);
}

/// `replica_resize`: a store grows a replica no engine holds (a volume
/// attached nowhere), and refuses one an engine holds, a shrink, a bad
/// size and a name it lacks; the same size again changes nothing; data
/// stays and the size survives a restart.
#[test]
fn a_store_grows_a_replica_no_engine_holds() {
    let fw = framework();
    let sdir = TempDir::new("store-grow-idle");
    let store = open_store(&fw, &sdir, &["r1"]);
    let big = 2 * SIZE;
    let data = pattern(9, 64 * 1024);
    let mut c = Client::engine(store.local_addr(), 0x51);
    assert_eq!(c.hello_named("r1", HELLO_FLAG_ATTACH).0.status, 0);
    assert_eq!(c.write(SIZE - data.len() as u64, &data), 0);
    // Held by the engine's session: refused, nothing changes.
    let held = store.grow("r1", big).unwrap_err();
    assert!(
        matches!(
            held,
            lull_replica::StoreError::GrowHeld { session: 0x51, .. }
        ),
        "{held}"
    );
    assert!(held.is_refusal());
    assert_eq!(store.get("r1").unwrap().size_bytes, SIZE);
    assert_eq!(c.detach(), 0);
    drop(c);
    // The engine's connection closes on the replica's reactor: wait for
    // the store to see it gone (state, not a sleep).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while store.get("r1").unwrap().held_by_session.is_some() {
        assert!(std::time::Instant::now() < deadline, "still held");
        std::thread::sleep(Duration::from_millis(10));
    }
    let grown = store.grow("r1", big).unwrap();
    assert_eq!(grown.size_bytes, big);
    assert_eq!(
        store.grow("r1", big).unwrap().size_bytes,
        big,
        "same size again"
    );
    let shrink = store.grow("r1", SIZE).unwrap_err();
    assert!(
        shrink.is_refusal() && shrink.to_string().contains("shrink"),
        "{shrink}"
    );
    assert!(matches!(
        store.grow("r1", big + 512).unwrap_err(),
        lull_replica::StoreError::BadSize(_)
    ));
    assert!(matches!(
        store.grow("nosuch", big).unwrap_err(),
        lull_replica::StoreError::NotFound(_)
    ));
    let record = std::fs::read_to_string(sdir.0.join("store.json")).unwrap();
    assert!(
        record.contains(&format!("\"size_bytes\": {big}")),
        "store.json: {record}"
    );
    // An engine of the new size is taken, the old data reads back and
    // the new range reads as zeros; one of the old size is refused.
    let mut old = Client::engine(store.local_addr(), 0x52);
    assert_ne!(old.hello_named("r1", 0).0.status, 0, "old size taken");
    let mut c = Client::engine(store.local_addr(), 0x53);
    let body = wire::encode_hello_request(
        &Hello {
            volume_size: big,
            generation: 0,
            flags: 0,
            session: 0x53,
        },
        "r1",
    );
    let id = c.id();
    c.send(
        &Header::request(Kind::Hello, id, 0, body.len() as u32),
        &body,
    );
    assert_eq!(c.recv().0.status, 0);
    assert_eq!(c.read(SIZE - data.len() as u64, data.len() as u32), data);
    assert_eq!(c.read(big - 4096, 4096), vec![0; 4096]);
    drop((c, old));
    store.shutdown(Duration::from_secs(10)).unwrap();
    drop(store);
    let store = Store::open(
        fw.handle(),
        &StoreConfig {
            dir: sdir.0.clone(),
            ..StoreConfig::default()
        },
    )
    .unwrap();
    assert_eq!(store.get("r1").unwrap().size_bytes, big);
    finish_store((), store, fw);
}
