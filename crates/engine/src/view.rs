//! A replicated volume's snapshot, served read-only (`VOLUME@SNAPSHOT`):
//! a [`BlockDevice`] whose reads go to one replica that holds the
//! snapshot, over a view connection of the replica protocol (version 6: a
//! HELLO naming `REPLICA@SNAPSHOT`, session 0; see `lull_proto::replica`).
//!
//! ```ignore
//! // What `ReplicatedDev::snapshot_view` returns for a snapshot it knows:
//! let view = dev.snapshot_view("s1").expect("s1 exists");
//! assert!(view.read_only());
//! let mut ch = view.open_channel()?;   // a worker thread and its connection
//! ch.submit_now(read_request)?;       // completes through `event_fd`
//! ```
//!
//! **Which replica.** Every replica that holds a snapshot holds the same
//! bytes in it: the engine takes a snapshot on every healthy replica at
//! once, with writes held and drained (`core::snapshot`), and a snapshot
//! never changes afterwards. So any replica that has it will do: a view
//! tries the replicas in order (those the engine last saw healthy first)
//! and stays with the first that answers; one that does not hold the
//! snapshot (a replica added later, or one a crash left without it)
//! answers `ENOENT` and the next is tried. A view needs no election and
//! takes nothing over: it never writes, and the engine of the live volume
//! goes on undisturbed.
//!
//! **Off the reactor.** Each channel has a worker thread ("lull-view")
//! with its own connection, doing blocking I/O with the engine's replica
//! timeout on every wait; requests reach it through a queue, completions
//! come back through a queue and an eventfd, so the reactor that owns
//! the channel never blocks. The worker takes every request queued at
//! once, sends them all, and completes each as its reply comes; a
//! connection that fails (an error, a bad frame, a timeout) is dropped
//! and the requests it had not answered are sent again to the next
//! replica (reads change nothing, so resending is safe), each replica at
//! most once per batch; when none is left they fail with `EIO` and the
//! log names each replica's reason. This is the backup path (nbdcopy,
//! qemu-img), where a thread per connection costs little; the live
//! volume's data path stays on the engine's reactor.
//!
//! Bounds: [`VIEW_CHANNEL_DEPTH`] requests in flight per channel,
//! [`MAX_VIEW_CHANNELS`] channels (threads and connections) per view.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lull_bdev::{
    BdevError, BlockDevice, ChangeRun, Channel, Extent, IoCompletion, IoOp, IoRequest,
};
use lull_net::link::LinkStream;
use lull_net::tls::TlsContext;
use lull_proto::replica::{self as proto, Header, Hello, Kind, HEADER_LEN};
use lull_reactor::sys::EventFd;

use crate::client::{self, encode, read_exact, read_header, write_all, LinkFailure};
use crate::core::ReplicaTarget;

/// Requests in flight per view channel: a backup client's queue (nbdcopy
/// keeps 64 requests per connection in flight) fits, and the requests of
/// one batch (32-byte frames) fit a socket's send buffer many times over.
pub const VIEW_CHANNEL_DEPTH: usize = 64;

/// Channels per view: each is a thread and a connection to a replica.
/// nbdcopy opens 4 connections, qemu-img 1; the NBD server's per-volume
/// connection limit applies to a view's export too.
pub const MAX_VIEW_CHANNELS: usize = 16;

/// What a view needs to reach the replicas.
pub(crate) struct ViewConfig {
    pub(crate) volume: String,
    pub(crate) snapshot: String,
    pub(crate) size_bytes: u64,
    /// The replicas to try, in order.
    pub(crate) targets: Vec<ReplicaTarget>,
    /// The volume's snapshots older than this one, oldest first: those
    /// `lull:changed:` may name on this view.
    pub(crate) older: Vec<String>,
    pub(crate) tls: Option<TlsContext>,
    /// Bounds every connect, handshake, send and reply wait.
    pub(crate) timeout: Duration,
}

/// A snapshot of a replicated volume, read-only.
pub struct ReplicatedSnapshotView {
    config: Arc<ViewConfig>,
    open: Arc<AtomicUsize>,
}

impl ReplicatedSnapshotView {
    pub(crate) fn new(config: ViewConfig) -> ReplicatedSnapshotView {
        ReplicatedSnapshotView {
            config: Arc::new(config),
            open: Arc::new(AtomicUsize::new(0)),
        }
    }
}

impl BlockDevice for ReplicatedSnapshotView {
    fn size_bytes(&self) -> u64 {
        self.config.size_bytes
    }

    fn describe(&self) -> String {
        let replicas: Vec<String> = self.config.targets.iter().map(|t| t.to_string()).collect();
        format!(
            "snapshot {} of replicas={}",
            self.config.snapshot,
            replicas.join("+")
        )
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        if self.open.fetch_add(1, Ordering::AcqRel) >= MAX_VIEW_CHANNELS {
            self.open.fetch_sub(1, Ordering::AcqRel);
            return Err(BdevError::Full {
                capacity: MAX_VIEW_CHANNELS,
            });
        }
        match ViewChannel::start(self.config.clone(), self.open.clone()) {
            Ok(ch) => Ok(Box::new(ch)),
            Err(e) => {
                self.open.fetch_sub(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// Block status is a BLOCK_STATUS request to the replica the channel
    /// reads from (`IoOp::BlockStatus`).
    fn extents_by_channel(&self) -> bool {
        true
    }

    fn read_only(&self) -> bool {
        true
    }

    /// The snapshots older than this one (as for a local view).
    fn snapshot_names(&self) -> Vec<String> {
        self.config.older.clone()
    }

    fn has_snapshot(&self, name: &str) -> bool {
        self.config.older.iter().any(|n| n == name)
    }

    /// "Changed since" an older snapshot is a CHANGED request to the
    /// replica the channel reads from (`IoOp::ChangedSince`).
    fn changed_by_channel(&self) -> bool {
        true
    }
}

/// Completions from the worker, and the eventfd that says there are some.
struct Done {
    queue: Mutex<VecDeque<IoCompletion>>,
    event: EventFd,
}

impl Done {
    fn push(&self, c: IoCompletion) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(c);
        self.event.notify();
    }
}

/// A request for the worker, with the snapshot a CHANGED asks about.
struct Job {
    req: IoRequest,
    since: Option<Arc<str>>,
}

struct ViewChannel {
    /// To the worker; dropping it ends the worker once its batch is done.
    to_worker: mpsc::Sender<Job>,
    /// The snapshot `IoOp::ChangedSince` asks about (`set_changed_since`).
    since: Option<Arc<str>>,
    done: Arc<Done>,
    /// Accepted and not yet handed to the worker.
    queued: Vec<IoRequest>,
    /// Completions made here (refusals, flushes), delivered by `reap`.
    local: Vec<IoCompletion>,
    in_flight: usize,
    size_bytes: u64,
    open: Arc<AtomicUsize>,
}

impl ViewChannel {
    fn start(config: Arc<ViewConfig>, open: Arc<AtomicUsize>) -> Result<ViewChannel, BdevError> {
        let done = Arc::new(Done {
            queue: Mutex::new(VecDeque::new()),
            event: EventFd::new().map_err(BdevError::Io)?,
        });
        let (to_worker, from_channel) = mpsc::channel();
        let worker_done = done.clone();
        let size_bytes = config.size_bytes;
        std::thread::Builder::new()
            .name("lull-view".into())
            .spawn(move || Worker::new(config, worker_done).run(&from_channel))
            .map_err(BdevError::Io)?;
        Ok(ViewChannel {
            to_worker,
            since: None,
            done,
            queued: Vec::new(),
            local: Vec::new(),
            in_flight: 0,
            size_bytes,
            open,
        })
    }

    fn complete_here(&mut self, req: IoRequest, result: Result<(), BdevError>) {
        self.local.push(IoCompletion {
            tag: req.tag,
            result,
            buf: req.buf,
            data: lull_bdev::Data::Buf,
        });
        self.done.event.notify();
    }
}

impl Drop for ViewChannel {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Channel for ViewChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        if self.in_flight >= VIEW_CHANNEL_DEPTH {
            return Err((
                req,
                BdevError::Full {
                    capacity: VIEW_CHANNEL_DEPTH,
                },
            ));
        }
        match req.op {
            IoOp::Read | IoOp::BlockStatus => {}
            IoOp::ChangedSince if self.since.is_some() => {}
            IoOp::ChangedSince => {
                return Err((
                    req,
                    BdevError::BadRequest("changed-since without a snapshot to compare with"),
                ));
            }
            // Nothing is ever written: nothing to make durable.
            IoOp::Flush => {
                self.in_flight += 1;
                self.complete_here(req, Ok(()));
                return Ok(());
            }
            IoOp::Write { .. } | IoOp::Trim | IoOp::WriteZeroes { .. } => {
                return Err((req, BdevError::ReadOnly));
            }
        }
        let end = req.offset.checked_add(u64::from(req.len));
        if req.len == 0 || end.is_none_or(|end| end > self.size_bytes) {
            let size = self.size_bytes;
            let (offset, len) = (req.offset, u64::from(req.len));
            return Err((req, BdevError::OutOfRange { offset, len, size }));
        }
        self.in_flight += 1;
        self.queued.push(req);
        Ok(())
    }

    fn flush_submissions(&mut self) {
        for req in self.queued.drain(..) {
            let since = (req.op == IoOp::ChangedSince)
                .then(|| self.since.clone())
                .flatten();
            if let Err(mpsc::SendError(Job { req, .. })) = self.to_worker.send(Job { req, since }) {
                // The worker is gone (it cannot start a connection
                // thread's work again): fail the request here.
                self.local.push(IoCompletion {
                    tag: req.tag,
                    result: Err(BdevError::Failed(
                        "the snapshot view's worker stopped".into(),
                    )),
                    buf: req.buf,
                    data: lull_bdev::Data::Buf,
                });
                self.done.event.notify();
            }
        }
    }

    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        self.done.event.drain();
        let mut n = 0;
        for c in self.local.drain(..) {
            done(c);
            n += 1;
        }
        let got: Vec<IoCompletion> = self
            .done
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for c in got {
            done(c);
            n += 1;
        }
        self.in_flight -= n.min(self.in_flight);
        n
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.done.event.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn set_changed_since(&mut self, since: &str) {
        self.since = Some(Arc::from(since));
    }
}

/// One channel's worker: its connection and where it is in the list.
struct Worker {
    config: Arc<ViewConfig>,
    done: Arc<Done>,
    link: Option<LinkStream>,
    /// The target `link` goes to, or the next to try.
    target: usize,
    next_id: u64,
}

impl Worker {
    fn new(config: Arc<ViewConfig>, done: Arc<Done>) -> Worker {
        Worker {
            config,
            done,
            link: None,
            target: 0,
            next_id: 1,
        }
    }

    /// Serves batches until the channel is dropped.
    fn run(mut self, from_channel: &mpsc::Receiver<Job>) {
        while let Ok(first) = from_channel.recv() {
            let mut batch = vec![first];
            while batch.len() < VIEW_CHANNEL_DEPTH {
                match from_channel.try_recv() {
                    Ok(req) => batch.push(req),
                    Err(_) => break,
                }
            }
            self.serve(batch);
        }
    }

    /// Serves one batch: on the current replica, then on the next ones
    /// for what is left, each replica at most once.
    fn serve(&mut self, mut batch: Vec<Job>) {
        let n = self.config.targets.len();
        let mut reasons: Vec<String> = Vec::new();
        for _ in 0..n {
            if self.link.is_none() {
                match self.connect(self.target) {
                    Ok(link) => self.link = Some(link),
                    Err(why) => {
                        if !matches!(why, LinkFailure::NoSnapshot) {
                            tracing::warn!(volume = %self.config.volume, snapshot = %self.config.snapshot,
                                replica = %self.config.targets[self.target], reason = %why,
                                "snapshot view: cannot read from this replica, trying the next");
                        }
                        reasons.push(format!("{}: {why}", self.config.targets[self.target]));
                        self.target = (self.target + 1) % n;
                        continue;
                    }
                }
            }
            match self.send_and_complete(&mut batch) {
                Ok(()) => return,
                Err(why) => {
                    tracing::warn!(volume = %self.config.volume, snapshot = %self.config.snapshot,
                        replica = %self.config.targets[self.target], reason = %why,
                        unanswered = batch.len(), "snapshot view: the replica connection failed; its unanswered reads go to the next replica");
                    reasons.push(format!("{}: {why}", self.config.targets[self.target]));
                    self.link = None;
                    self.target = (self.target + 1) % n;
                }
            }
        }
        let why = format!(
            "no replica served snapshot {:?} of volume {:?} ({})",
            self.config.snapshot,
            self.config.volume,
            reasons.join("; ")
        );
        tracing::error!(volume = %self.config.volume, snapshot = %self.config.snapshot,
            requests = batch.len(), "{why}");
        for Job { req, .. } in batch {
            self.done.push(IoCompletion {
                tag: req.tag,
                result: Err(BdevError::Failed(why.clone())),
                buf: req.buf,
                data: lull_bdev::Data::Buf,
            });
        }
    }

    /// Connects to target `i` and opens the view (HELLO `REPLICA@SNAPSHOT`).
    fn connect(&mut self, i: usize) -> Result<LinkStream, LinkFailure> {
        let target = &self.config.targets[i];
        let hello = Hello {
            volume_size: self.config.size_bytes,
            generation: 0,
            flags: 0,
            session: 0,
        };
        let name = proto::view_hello_name(target.hello_name(), &self.config.snapshot);
        client::open(
            target.addr,
            self.config.tls.as_ref(),
            self.config.timeout,
            &hello,
            &name,
        )
    }

    /// Sends every request of `batch`, then completes each as its reply
    /// comes. On a failure the requests not yet answered stay in `batch`.
    fn send_and_complete(&mut self, batch: &mut Vec<Job>) -> Result<(), String> {
        let Some(link) = self.link.as_mut() else {
            return Err("no connection".into());
        };
        let first_id = self.next_id;
        let mut out = Vec::with_capacity(batch.len() * HEADER_LEN);
        for (i, Job { req, since }) in batch.iter().enumerate() {
            let id = first_id + i as u64;
            let (h, payload) = match (req.op, since) {
                (IoOp::BlockStatus, _) => (
                    Header::request(Kind::BlockStatus, id, req.offset, req.len),
                    None,
                ),
                (IoOp::ChangedSince, Some(since)) => {
                    let p = proto::encode_changed_request(&proto::ChangedRequest {
                        length: req.len,
                        since: since.to_string(),
                    })
                    .map_err(|e| format!("cannot encode CHANGED: {e}"))?;
                    (
                        Header::request(Kind::Changed, id, req.offset, p.len() as u32),
                        Some(p),
                    )
                }
                _ => (Header::request(Kind::Read, id, req.offset, req.len), None),
            };
            out.extend_from_slice(&encode(&h).map_err(|e| e.to_string())?);
            if let Some(p) = payload {
                out.extend_from_slice(&p);
            }
        }
        self.next_id += batch.len() as u64;
        write_all(link, &out, Instant::now() + self.config.timeout)
            .map_err(|e| format!("send: {e}"))?;
        // Requests by wire id; answered ones become `None`.
        let mut waiting: Vec<Option<Job>> = batch.drain(..).map(Some).collect();
        let mut left = waiting.len();
        let result = (|| {
            while left > 0 {
                let deadline = Instant::now() + self.config.timeout;
                let reply = read_header(link, deadline).map_err(|e| e.to_string())?;
                let index = reply
                    .id
                    .checked_sub(first_id)
                    .and_then(|i| usize::try_from(i).ok())
                    .filter(|&i| i < waiting.len());
                let Some(Job { req, since }) = index.and_then(|i| waiting[i].take()) else {
                    return Err(format!("a reply to no request of this batch: {reply:?}"));
                };
                left -= 1;
                let c = complete(link, req, &reply, deadline);
                match c {
                    Ok(c) => self.done.push(c),
                    Err((req, why)) => {
                        // The stream is out of step: this request goes to
                        // the next replica with the others.
                        if let Some(slot) = index.and_then(|i| waiting.get_mut(i)) {
                            *slot = Some(Job { req, since });
                        }
                        return Err(why);
                    }
                }
            }
            Ok(())
        })();
        batch.extend(waiting.into_iter().flatten());
        result
    }
}

/// The completion of `req` from its reply `h` (the payload read from
/// `link`); `Err` hands the request back when the stream cannot go on.
fn complete(
    link: &mut LinkStream,
    mut req: IoRequest,
    h: &Header,
    deadline: Instant,
) -> Result<IoCompletion, (IoRequest, String)> {
    let expected = match req.op {
        IoOp::BlockStatus => Kind::BlockStatus,
        IoOp::ChangedSince => Kind::Changed,
        _ => Kind::Read,
    };
    if h.kind != expected || !h.reply {
        return Err((req, format!("reply {h:?} to a {expected:?}")));
    }
    let done = |req: IoRequest, result| IoCompletion {
        tag: req.tag,
        result,
        buf: req.buf,
        data: lull_bdev::Data::Buf,
    };
    if h.status != 0 {
        let e = io::Error::from_raw_os_error(h.status as i32);
        return Ok(done(req, Err(BdevError::Io(e))));
    }
    let len = proto::payload_len(h);
    match expected {
        Kind::Read => {
            if h.offset != req.offset || len != req.len as usize {
                let why = format!("READ reply {h:?} is not for [{}, +{})", req.offset, req.len);
                return Err((req, why));
            }
            let Some(buf) = req.buf.as_mut().filter(|b| b.capacity() >= len) else {
                return Err((req, "a READ without room for its data".into()));
            };
            buf.set_len(len);
            if let Err(e) = read_exact(link, buf.as_mut_slice(), deadline) {
                return Err((req, format!("read READ data: {e}")));
            }
            Ok(done(req, Ok(())))
        }
        _ => {
            let mut payload = vec![0u8; len];
            if let Err(e) = read_exact(link, &mut payload, deadline) {
                return Err((req, format!("read {expected:?} records: {e}")));
            }
            let ext = match proto::decode_block_status(&payload) {
                Ok(ext) => ext,
                Err(e) => return Err((req, format!("bad {expected:?} reply: {e}"))),
            };
            let covered: u64 = ext.iter().map(|e| e.length).sum();
            if h.offset != req.offset || covered > u64::from(req.len) {
                return Err((
                    req,
                    format!("{expected:?} reply outside the requested range"),
                ));
            }
            if expected == Kind::Changed {
                let runs: Vec<ChangeRun> = ext
                    .iter()
                    .map(|e| ChangeRun {
                        length_bytes: e.length,
                        changed: e.flags & proto::STATUS_CHANGED != 0,
                    })
                    .collect();
                if let Some(buf) = req.buf.as_mut() {
                    let n = lull_bdev::put_change_records(&runs, buf.as_mut_slice());
                    buf.set_len(n);
                }
                return Ok(done(req, Ok(())));
            }
            let extents: Vec<Extent> = ext
                .iter()
                .map(|e| Extent {
                    length_bytes: e.length,
                    hole: e.flags & proto::STATUS_HOLE != 0,
                    zero: e.flags & proto::STATUS_ZERO != 0,
                })
                .collect();
            if let Some(buf) = req.buf.as_mut() {
                let n = lull_bdev::put_extent_records(&extents, buf.as_mut_slice());
                buf.set_len(n);
            }
            Ok(done(req, Ok(())))
        }
    }
}
