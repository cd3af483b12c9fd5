//! Snapshot exports and the `lull:changed:SNAPSHOT` metadata context,
//! through the real server (a reactor, a poll group, the connection pump)
//! and a raw NBD client on loopback. The device is a fake: a memory
//! device whose snapshots are fixed tables of what changed since each,
//! with read-only views, so these tests need none of the snapshot storage
//! (its own tests, and the end-to-end ones with nbdinfo and nbdcopy, are
//! the storage's). What is checked here is the NBD side: export names,
//! flags, `NBD_EPERM` for writes to a view, and block status replies with
//! one chunk per selected context.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lull_bdev::{push_change, BdevError, BlockDevice, ChangeRun, Channel, Extent, MallocDev};
use lull_nbd::{ListenAddr, NbdServer, EXPORT_FLAGS, READ_ONLY_EXPORT_FLAGS};
use lull_proto::nbd::structured::{self, BlockExtent};
use lull_proto::nbd::{self, Command, Request};
use lull_reactor::{Framework, FrameworkConfig, Mode, SchedulerConfig};
use lull_volume::{Storage, Volume, Volumes};

const MIB: u64 = 1 << 20;
/// Four memory chunks (`MALLOC_CHUNK_BYTES`), so extents have four parts.
const SIZE: u64 = 4 * MIB;
/// How long tear-down may take.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// What changed since each snapshot, over the whole device, by name,
/// oldest snapshot first.
type ChangeMap = Vec<(String, Vec<ChangeRun>)>;

fn run(mib: u64, changed: bool) -> ChangeRun {
    ChangeRun {
        length_bytes: mib * MIB,
        changed,
    }
}

/// A memory device with fixed snapshot tables. The live device has s1
/// and s2; its views share its memory (the tests read what the live
/// volume holds; only flags and block status matter here).
struct SnapDev {
    data: Arc<MallocDev>,
    read_only: bool,
    /// Ask `base:allocation` through the channel, as a replicated volume.
    by_channel: bool,
    /// Shared with the test, which deletes snapshots from it.
    changes: Arc<Mutex<ChangeMap>>,
    views: Vec<(String, Arc<SnapDev>)>,
}

impl SnapDev {
    /// The live device: since s1, the first and third MiB changed; since
    /// s2, only the third. Its views: s2, which changed the first MiB
    /// since s1, and s1, with nothing older.
    fn live(by_channel: bool) -> (Arc<SnapDev>, Arc<Mutex<ChangeMap>>) {
        let data = Arc::new(MallocDev::new(SIZE).expect("memory device"));
        let view = |changes: ChangeMap| {
            Arc::new(SnapDev {
                data: data.clone(),
                read_only: true,
                by_channel,
                changes: Arc::new(Mutex::new(changes)),
                views: Vec::new(),
            })
        };
        let s1 = view(Vec::new());
        let s2 = view(vec![("s1".into(), vec![run(1, true), run(3, false)])]);
        let changes = Arc::new(Mutex::new(vec![
            (
                "s1".to_string(),
                vec![run(1, true), run(1, false), run(1, true), run(1, false)],
            ),
            (
                "s2".to_string(),
                vec![run(2, false), run(1, true), run(1, false)],
            ),
        ]));
        let dev = Arc::new(SnapDev {
            data,
            read_only: false,
            by_channel,
            changes: changes.clone(),
            views: vec![("s1".into(), s1), ("s2".into(), s2)],
        });
        (dev, changes)
    }
}

impl BlockDevice for SnapDev {
    fn size_bytes(&self) -> u64 {
        self.data.size_bytes()
    }

    fn describe(&self) -> String {
        "snapshot test device".into()
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        // The memory channel serves IoOp::BlockStatus too.
        self.data.open_channel()
    }

    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>, BdevError> {
        if self.by_channel {
            return Ok(vec![Extent::data(len)]);
        }
        self.data.extents(offset, len, max_extents)
    }

    fn extents_by_channel(&self) -> bool {
        self.by_channel
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn has_snapshot(&self, name: &str) -> bool {
        self.changes.lock().unwrap().iter().any(|(n, _)| n == name)
    }

    fn snapshot_names(&self) -> Vec<String> {
        let changes = self.changes.lock().unwrap();
        changes.iter().map(|(n, _)| n.clone()).collect()
    }

    fn changed_since(
        &self,
        since: &str,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Result<Vec<ChangeRun>, BdevError> {
        let changes = self.changes.lock().unwrap();
        let Some((_, runs)) = changes.iter().find(|(n, _)| n == since) else {
            return Err(BdevError::NoSuchSnapshot(since.into()));
        };
        let (mut out, mut at, end) = (Vec::new(), 0, offset + len);
        for r in runs {
            let (start, stop) = (at.max(offset), (at + r.length_bytes).min(end));
            at += r.length_bytes;
            if start < stop {
                let piece = ChangeRun {
                    length_bytes: stop - start,
                    changed: r.changed,
                };
                if !push_change(&mut out, piece, max_runs) {
                    break;
                }
            }
        }
        Ok(out)
    }

    fn snapshot_view(&self, name: &str) -> Option<Arc<dyn BlockDevice>> {
        let (_, view) = self.views.iter().find(|(n, _)| n == name)?;
        Some(view.clone() as Arc<dyn BlockDevice>)
    }
}

/// A raw NBD client: fixed newstyle, options one at a time, requests.
struct Client {
    sock: TcpStream,
}

/// One option reply: its type and payload.
type OptReply = (u32, Vec<u8>);

/// One reply to a request.
#[derive(Debug)]
enum Reply {
    Simple {
        error: u32,
        cookie: u64,
    },
    /// Every chunk of a structured reply, the last with DONE.
    Chunks(Vec<(structured::ChunkHeader, Vec<u8>)>),
}

impl Client {
    fn connect(addr: SocketAddr) -> Client {
        let mut sock = TcpStream::connect(addr).expect("connect");
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut greeting = [0u8; nbd::SERVER_GREETING_LEN];
        sock.read_exact(&mut greeting).expect("greeting");
        assert_eq!(&greeting[..16], b"NBDMAGICIHAVEOPT");
        let flags = nbd::NBD_FLAG_C_FIXED_NEWSTYLE | nbd::NBD_FLAG_C_NO_ZEROES;
        sock.write_all(&flags.to_be_bytes()).unwrap();
        Client { sock }
    }

    /// Sends an option; returns its replies up to the final one (ACK or
    /// an error).
    fn option(&mut self, option: u32, data: &[u8]) -> Vec<OptReply> {
        let mut opt = nbd::IHAVEOPT.to_be_bytes().to_vec();
        opt.extend_from_slice(&option.to_be_bytes());
        opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
        opt.extend_from_slice(data);
        self.sock.write_all(&opt).unwrap();
        let mut replies = Vec::new();
        loop {
            let mut header = [0u8; nbd::OPTION_REPLY_HEADER_LEN];
            self.sock.read_exact(&mut header).expect("option reply");
            assert_eq!(header[..8], nbd::NBD_REP_MAGIC.to_be_bytes());
            assert_eq!(header[8..12], option.to_be_bytes());
            let reply_type = u32::from_be_bytes(header[12..16].try_into().unwrap());
            let len = u32::from_be_bytes(header[16..20].try_into().unwrap());
            let mut payload = vec![0u8; len as usize];
            self.sock.read_exact(&mut payload).unwrap();
            replies.push((reply_type, payload));
            if reply_type == nbd::NBD_REP_ACK || reply_type & nbd::NBD_REP_FLAG_ERROR != 0 {
                return replies;
            }
        }
    }

    fn structured_replies(&mut self) {
        let replies = self.option(nbd::NBD_OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(replies[0].0, nbd::NBD_REP_ACK);
    }

    /// `NBD_OPT_LIST_META_CONTEXT` or `SET_META_CONTEXT`; returns the
    /// contexts replied, `(id, name)`, and the final reply type.
    fn meta(&mut self, option: u32, export: &str, queries: &[&str]) -> (Vec<(u32, String)>, u32) {
        let mut p = (export.len() as u32).to_be_bytes().to_vec();
        p.extend_from_slice(export.as_bytes());
        p.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            p.extend_from_slice(&(q.len() as u32).to_be_bytes());
            p.extend_from_slice(q.as_bytes());
        }
        let mut replies = self.option(option, &p);
        let (last, _) = replies.pop().expect("a final reply");
        let contexts = replies
            .into_iter()
            .map(|(reply_type, payload)| {
                assert_eq!(reply_type, nbd::NBD_REP_META_CONTEXT);
                let id = u32::from_be_bytes(payload[..4].try_into().unwrap());
                (id, String::from_utf8(payload[4..].to_vec()).unwrap())
            })
            .collect();
        (contexts, last)
    }

    /// `NBD_OPT_GO`; returns the export's size and transmission flags.
    fn go(&mut self, export: &str) -> (u64, u16) {
        let mut p = (export.len() as u32).to_be_bytes().to_vec();
        p.extend_from_slice(export.as_bytes());
        p.extend_from_slice(&0u16.to_be_bytes());
        let replies = self.option(nbd::NBD_OPT_GO, &p);
        assert_eq!(replies.last().unwrap().0, nbd::NBD_REP_ACK, "GO {export}");
        let (_, info) = replies
            .iter()
            .find(|(t, p)| *t == nbd::NBD_REP_INFO && p[..2] == nbd::NBD_INFO_EXPORT.to_be_bytes())
            .expect("NBD_INFO_EXPORT");
        let size = u64::from_be_bytes(info[2..10].try_into().unwrap());
        (size, u16::from_be_bytes(info[10..12].try_into().unwrap()))
    }

    /// Sends a request (with `payload` for a write) and reads its reply.
    fn request(&mut self, command: Command, flags: u16, offset: u64, length: u32) -> Reply {
        let cookie = u64::from(length) ^ offset ^ 0x5eed;
        let header = nbd::encode_request(&Request {
            flags,
            command,
            cookie,
            offset,
            length,
        });
        self.sock.write_all(&header).unwrap();
        if command == Command::Write {
            self.sock.write_all(&vec![0xab; length as usize]).unwrap();
        }
        let reply = self.reply();
        let got = match &reply {
            Reply::Simple { cookie, .. } => *cookie,
            Reply::Chunks(chunks) => chunks[0].0.cookie,
        };
        assert_eq!(got, cookie, "reply to another request");
        reply
    }

    /// One whole reply. Structured replies only carry payloads the chunk
    /// length tells; simple replies here never carry data (every read is
    /// made with structured replies).
    fn reply(&mut self) -> Reply {
        let mut magic = [0u8; 4];
        self.sock.read_exact(&mut magic).expect("reply");
        if u32::from_be_bytes(magic) == nbd::NBD_SIMPLE_REPLY_MAGIC {
            let mut rest = [0u8; 12];
            self.sock.read_exact(&mut rest).unwrap();
            return Reply::Simple {
                error: u32::from_be_bytes(rest[..4].try_into().unwrap()),
                cookie: u64::from_be_bytes(rest[4..].try_into().unwrap()),
            };
        }
        let mut chunks = Vec::new();
        let mut first = Some(magic);
        loop {
            let mut header = [0u8; structured::CHUNK_HEADER_LEN];
            match first.take() {
                Some(magic) => {
                    header[..4].copy_from_slice(&magic);
                    self.sock.read_exact(&mut header[4..]).unwrap();
                }
                None => self.sock.read_exact(&mut header).unwrap(),
            }
            let h = structured::decode_chunk_header(&header).expect("chunk magic");
            let mut payload = vec![0u8; h.length as usize];
            self.sock.read_exact(&mut payload).unwrap();
            let done = h.flags & nbd::NBD_REPLY_FLAG_DONE != 0;
            chunks.push((h, payload));
            if done {
                return Reply::Chunks(chunks);
            }
        }
    }

    /// A block status reply's chunks as `(id, extents)`, in order; the
    /// last and only the last carries DONE.
    fn block_status(
        &mut self,
        flags: u16,
        offset: u64,
        length: u32,
    ) -> Vec<(u32, Vec<BlockExtent>)> {
        let Reply::Chunks(chunks) = self.request(Command::BlockStatus, flags, offset, length)
        else {
            panic!("block status answered with a simple reply");
        };
        let last = chunks.len() - 1;
        chunks
            .iter()
            .enumerate()
            .map(|(i, (h, payload))| {
                assert_eq!(
                    h.reply_type,
                    nbd::NBD_REPLY_TYPE_BLOCK_STATUS,
                    "{payload:?}"
                );
                assert_eq!(h.flags & nbd::NBD_REPLY_FLAG_DONE != 0, i == last);
                structured::decode_block_status(payload).expect("block status payload")
            })
            .collect()
    }

    /// A structured read succeeds (the connection is still served).
    fn read_ok(&mut self) {
        let Reply::Chunks(chunks) = self.request(Command::Read, 0, 0, 4096) else {
            panic!("a structured read answered with a simple reply");
        };
        for (h, _) in &chunks {
            assert!(
                h.reply_type == nbd::NBD_REPLY_TYPE_OFFSET_DATA
                    || h.reply_type == nbd::NBD_REPLY_TYPE_OFFSET_HOLE,
                "read failed: {chunks:?}"
            );
        }
    }
}

/// A server on loopback serving `vol` over `dev`.
struct Served {
    fw: Framework,
    server: NbdServer,
    addr: SocketAddr,
}

impl Served {
    fn start(dev: Arc<SnapDev>) -> Served {
        let fw = Framework::start(FrameworkConfig {
            pin: false,
            scheduler: SchedulerConfig {
                period_us: lull_reactor::scheduler::MAX_PERIOD_US,
                ..SchedulerConfig::default()
            },
            ..FrameworkConfig::new(vec![0], Mode::Interrupt)
        })
        .expect("framework");
        let volumes = Arc::new(Volumes::default());
        volumes
            .add(Volume::new("vol", Storage::Local(dev)))
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
        Served { fw, server, addr }
    }

    /// A client with structured replies and `queries` selected on
    /// `export`, in transmission; returns it and the export's flags.
    fn client(&self, export: &str, queries: &[&str]) -> (Client, u16) {
        let mut c = Client::connect(self.addr);
        c.structured_replies();
        if !queries.is_empty() {
            let (_, last) = c.meta(nbd::NBD_OPT_SET_META_CONTEXT, export, queries);
            assert_eq!(last, nbd::NBD_REP_ACK);
        }
        let (size, flags) = c.go(export);
        assert_eq!(size, SIZE);
        (c, flags)
    }

    fn stop(mut self) {
        assert_eq!(self.server.shutdown(STOP_TIMEOUT), 0, "connections left");
        self.fw.stop();
    }
}

/// Writes a 4 KiB block at the start of the first and third MiB through
/// the live volume, so `base:allocation` has data and holes.
fn write_some(served: &Served) {
    let (mut c, _) = served.client("vol", &[]);
    for offset in [0, 2 * MIB] {
        let reply = c.request(Command::Write, 0, offset, 4096);
        assert!(matches!(reply, Reply::Simple { error: 0, .. }), "{reply:?}");
    }
}

/// What the wire should say for `base:allocation` over `[offset, +len)`.
fn expected_base(dev: &SnapDev, offset: u64, len: u64, max: usize) -> Vec<BlockExtent> {
    dev.data
        .extents(offset, len, max)
        .unwrap()
        .iter()
        .map(|e| BlockExtent {
            length: e.length_bytes as u32,
            flags: if e.hole {
                structured::NBD_STATE_HOLE
            } else {
                0
            } | if e.zero {
                structured::NBD_STATE_ZERO
            } else {
                0
            },
        })
        .collect()
}

fn changed(mib: u64, yes: bool) -> BlockExtent {
    BlockExtent {
        length: (mib * MIB) as u32,
        flags: if yes {
            structured::LULL_STATE_CHANGED
        } else {
            0
        },
    }
}

#[test]
fn snapshot_exports_are_listed_and_read_only() {
    let (dev, _) = SnapDev::live(false);
    let served = Served::start(dev);
    let mut c = Client::connect(served.addr);
    let names: Vec<String> = c
        .option(nbd::NBD_OPT_LIST, &[])
        .iter()
        .filter(|(t, _)| *t == nbd::NBD_REP_SERVER)
        .map(|(_, p)| String::from_utf8(p[4..].to_vec()).unwrap())
        .collect();
    assert_eq!(names, ["vol", "vol@s1", "vol@s2"]);
    assert_eq!(
        c.go("vol@s2").1,
        READ_ONLY_EXPORT_FLAGS | nbd::NBD_FLAG_HAS_FLAGS
    );
    let ro = READ_ONLY_EXPORT_FLAGS;
    assert_ne!(ro & nbd::NBD_FLAG_READ_ONLY, 0);
    for absent in [
        nbd::NBD_FLAG_SEND_TRIM,
        nbd::NBD_FLAG_SEND_WRITE_ZEROES,
        nbd::NBD_FLAG_SEND_FAST_ZERO,
    ] {
        assert_eq!(ro & absent, 0, "flag {absent:#x} on a read-only export");
    }
    let (_, flags) = served.client("vol", &[]);
    assert_eq!(flags, EXPORT_FLAGS | nbd::NBD_FLAG_HAS_FLAGS);
    // A snapshot the volume lacks is no export.
    let mut c = Client::connect(served.addr);
    let mut p = 6u32.to_be_bytes().to_vec();
    p.extend_from_slice(b"vol@s9");
    p.extend_from_slice(&0u16.to_be_bytes());
    let replies = c.option(nbd::NBD_OPT_GO, &p);
    assert_eq!(replies.last().unwrap().0, nbd::NBD_REP_ERR_UNKNOWN);
    served.stop();
}

#[test]
fn writes_to_a_snapshot_export_get_eperm_and_the_connection_stays() {
    let (dev, _) = SnapDev::live(false);
    let served = Served::start(dev);
    let (mut c, _) = served.client("vol@s1", &[]);
    for (command, flags) in [
        (Command::Write, 0),
        (Command::Write, nbd::NBD_CMD_FLAG_FUA),
        (Command::Trim, 0),
        (Command::WriteZeroes, 0),
        (Command::WriteZeroes, nbd::NBD_CMD_FLAG_NO_HOLE),
    ] {
        let reply = c.request(command, flags, 4096, 8192);
        assert!(
            matches!(
                reply,
                Reply::Simple {
                    error: nbd::NBD_EPERM,
                    ..
                }
            ),
            "{command:?}: {reply:?}"
        );
    }
    // The write payloads were drained: the stream is in step.
    c.read_ok();
    let reply = c.request(Command::Flush, 0, 0, 0);
    assert!(matches!(reply, Reply::Simple { error: 0, .. }), "{reply:?}");
    served.stop();
}

#[test]
fn list_meta_context_lists_the_changed_contexts() {
    let (dev, _) = SnapDev::live(false);
    let served = Served::start(dev);
    let mut c = Client::connect(served.addr);
    c.structured_replies();
    let list = nbd::NBD_OPT_LIST_META_CONTEXT;
    let names = |v: Vec<(u32, String)>| v.into_iter().map(|(_, n)| n).collect::<Vec<_>>();
    let (contexts, last) = c.meta(list, "vol", &["lull:"]);
    assert_eq!(last, nbd::NBD_REP_ACK);
    assert_eq!(names(contexts), ["lull:changed:s1", "lull:changed:s2"]);
    let (contexts, _) = c.meta(list, "vol@s2", &[]);
    assert_eq!(names(contexts), ["base:allocation", "lull:changed:s1"]);
    let (contexts, _) = c.meta(list, "vol@s1", &["lull:changed:"]);
    assert!(contexts.is_empty());
    let (contexts, _) = c.meta(list, "vol", &["lull:changed:s2", "lull:changed:s3"]);
    assert_eq!(names(contexts), ["lull:changed:s2"]);
    let (contexts, last) = c.meta(list, "vol", &["lull:changed:vol@s1"]);
    assert!(contexts.is_empty());
    assert_eq!(last, nbd::NBD_REP_ERR_INVALID);
    // SET: an unknown snapshot is not selected; the known one gets its id.
    let set = nbd::NBD_OPT_SET_META_CONTEXT;
    let (contexts, last) = c.meta(set, "vol", &["lull:changed:s9", "lull:changed:s2"]);
    assert_eq!(last, nbd::NBD_REP_ACK);
    assert_eq!(
        contexts,
        [(structured::LULL_CHANGED_ID, "lull:changed:s2".to_string())]
    );
    served.stop();
}

/// Both contexts on a snapshot's export: base:allocation, then the
/// changes between s1 and s2; each chunk capped by REQ_ONE and the length.
fn both_contexts(by_channel: bool) {
    let (dev, _) = SnapDev::live(by_channel);
    let served = Served::start(dev.clone());
    write_some(&served);
    let queries = ["base:allocation", "lull:changed:s1"];
    let (mut c, _) = served.client("vol@s2", &queries);
    let chunks = c.block_status(0, 0, SIZE as u32);
    let view = &dev.views[1].1;
    assert_eq!(
        chunks,
        [
            (
                structured::BASE_ALLOCATION_ID,
                expected_base(view, 0, SIZE, structured::MAX_BLOCK_STATUS_EXTENTS)
            ),
            (
                structured::LULL_CHANGED_ID,
                vec![changed(1, true), changed(3, false)]
            ),
        ]
    );
    // REQ_ONE: one extent per context, none longer than asked.
    let chunks = c.block_status(nbd::NBD_CMD_FLAG_REQ_ONE, MIB / 2, 4096);
    assert_eq!(chunks.len(), 2);
    for (id, extents) in &chunks {
        assert_eq!(extents.len(), 1, "context {id}");
        assert!(extents[0].length <= 4096, "context {id}: {extents:?}");
    }
    assert_eq!(chunks[1].1[0].flags, structured::LULL_STATE_CHANGED);
    // A range in the middle: runs clipped to it.
    let chunks = c.block_status(0, MIB / 2, MIB as u32);
    assert_eq!(
        chunks[1],
        (
            structured::LULL_CHANGED_ID,
            vec![
                BlockExtent {
                    length: (MIB / 2) as u32,
                    flags: structured::LULL_STATE_CHANGED
                },
                BlockExtent {
                    length: (MIB / 2) as u32,
                    flags: 0
                },
            ]
        )
    );
    served.stop();
}

#[test]
fn block_status_carries_both_contexts() {
    both_contexts(false);
}

#[test]
fn block_status_carries_both_contexts_when_allocation_goes_by_channel() {
    both_contexts(true);
}

#[test]
fn changed_context_alone_on_the_live_volume() {
    let (dev, _) = SnapDev::live(false);
    let served = Served::start(dev);
    let (mut c, _) = served.client("vol", &["lull:changed:s1"]);
    let chunks = c.block_status(0, 0, SIZE as u32);
    assert_eq!(
        chunks,
        [(
            structured::LULL_CHANGED_ID,
            vec![
                changed(1, true),
                changed(1, false),
                changed(1, true),
                changed(1, false)
            ]
        )]
    );
    served.stop();
}

#[test]
fn a_deleted_snapshot_fails_block_status_and_the_connection_stays() {
    let (dev, changes) = SnapDev::live(false);
    let served = Served::start(dev);
    let (mut c, _) = served.client("vol", &["base:allocation", "lull:changed:s1"]);
    assert_eq!(c.block_status(0, 0, 4096).len(), 2);
    changes.lock().unwrap().retain(|(name, _)| name != "s1");
    let Reply::Chunks(chunks) = c.request(Command::BlockStatus, 0, 0, 4096) else {
        panic!("block status answered with a simple reply");
    };
    assert_eq!(chunks.len(), 1);
    let (h, payload) = &chunks[0];
    assert_eq!(h.reply_type, nbd::NBD_REPLY_TYPE_ERROR);
    assert_eq!(h.flags, nbd::NBD_REPLY_FLAG_DONE);
    assert_eq!(payload[..4], nbd::NBD_EINVAL.to_be_bytes());
    let message = String::from_utf8_lossy(&payload[6..]);
    assert!(message.contains("lull:changed:s1"), "{message}");
    c.read_ok();
    served.stop();
}
