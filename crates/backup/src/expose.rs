//! A backup served before it is restored: a read-only [`BlockDevice`]
//! whose reads fetch the chunks they touch from the target on demand,
//! into a bounded cache, so an NBD or NVMe/TCP client can read a backup
//! (and a restore can start serving) before anything was copied.
//!
//! ```ignore
//! // backup_expose {"target": "s3", "backup": "bk-..."}: the export bk-...
//! let dev = BackupDev::new(target, manifest, runtime_handle);
//! volumes.add(Volume::new("bk-...", Storage::Local(Arc::new(dev))))?;
//! ```
//!
//! Each channel has a worker thread that takes its requests in order and
//! fetches what the cache lacks (a sequential reader's next chunk is
//! fetched ahead, [`READ_AHEAD_CHUNKS`]); chunks of zeros are holes and
//! never fetched. Several connections (nbdcopy opens 4) fetch in
//! parallel, one worker each.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use lull_bdev::{BdevError, BlockDevice, Channel, Extent, IoCompletion, IoOp, IoRequest};
use lull_reactor::sys::EventFd;

use crate::chunks::fetch_chunk;
use crate::format::Manifest;
use crate::lock;
use crate::target::Target;

/// Chunks an exposed backup keeps in memory: 32 × 2 MiB = 64 MiB per
/// exposed backup, enough for every connection's chunk in flight and its
/// read-ahead.
pub const EXPOSE_CACHE_CHUNKS: usize = 32;

/// Chunks fetched ahead of a sequential reader.
pub const READ_AHEAD_CHUNKS: usize = 2;

/// Requests in flight per channel (nbdcopy keeps 64 per connection).
pub const EXPOSE_CHANNEL_DEPTH: usize = 64;

/// Channels (worker threads) per exposed backup.
pub const MAX_EXPOSE_CHANNELS: usize = 16;

/// Exposed backups per node.
pub const MAX_EXPOSED: usize = 16;

/// An exposed backup, as `backup_expose` made it.
#[derive(Debug, Clone)]
pub struct Exposed {
    pub name: String,
    pub target: String,
    pub backup: String,
}

struct Shared {
    target: Target,
    manifest: Manifest,
    rt: tokio::runtime::Handle,
    cache: Mutex<Cache>,
    open: AtomicUsize,
}

#[derive(Default)]
struct Cache {
    chunks: HashMap<usize, Arc<Vec<u8>>>,
    order: VecDeque<usize>,
}

impl Cache {
    fn get(&mut self, i: usize) -> Option<Arc<Vec<u8>>> {
        let c = self.chunks.get(&i).cloned()?;
        if let Some(p) = self.order.iter().position(|&k| k == i) {
            self.order.remove(p);
        }
        self.order.push_back(i);
        Some(c)
    }

    fn put(&mut self, i: usize, data: Arc<Vec<u8>>) {
        if self.chunks.insert(i, data).is_none() {
            self.order.push_back(i);
        }
        while self.order.len() > EXPOSE_CACHE_CHUNKS {
            if let Some(old) = self.order.pop_front() {
                self.chunks.remove(&old);
            }
        }
    }
}

/// A backup as a read-only block device.
pub struct BackupDev {
    shared: Arc<Shared>,
}

impl BackupDev {
    pub fn new(target: Target, manifest: Manifest, rt: tokio::runtime::Handle) -> BackupDev {
        BackupDev {
            shared: Arc::new(Shared {
                target,
                manifest,
                rt,
                cache: Mutex::new(Cache::default()),
                open: AtomicUsize::new(0),
            }),
        }
    }
}

impl Shared {
    /// Chunk `i`'s plaintext (`None`: zeros), from the cache or the target.
    fn chunk(&self, i: usize) -> Result<Option<Arc<Vec<u8>>>, BdevError> {
        let Some(name) = &self.manifest.chunks[i] else {
            return Ok(None);
        };
        if let Some(c) = lock(&self.cache).get(i) {
            return Ok(Some(c));
        }
        let data = self
            .rt
            .block_on(fetch_chunk(&self.target, &self.manifest, i))
            .map_err(|e| {
                tracing::warn!(backup = self.manifest.id, chunk = name, error = %e, "exposed backup: chunk fetch failed");
                BdevError::Failed(e.to_string())
            })?;
        let Some(data) = data else {
            return Ok(None);
        };
        let data = Arc::new(data);
        lock(&self.cache).put(i, data.clone());
        Ok(Some(data))
    }

    /// Fetches chunk `i` in the background if it is not cached.
    fn prefetch(self: &Arc<Self>, i: usize) {
        if i >= self.manifest.chunks.len() || self.manifest.chunks[i].is_none() {
            return;
        }
        if lock(&self.cache).chunks.contains_key(&i) {
            return;
        }
        let me = self.clone();
        self.rt.spawn(async move {
            // A failure here is the reader's to see (it fetches again).
            if let Ok(Some(d)) = fetch_chunk(&me.target, &me.manifest, i).await {
                lock(&me.cache).put(i, Arc::new(d));
            }
        });
    }

    fn read(self: &Arc<Self>, offset: u64, out: &mut [u8]) -> Result<(), BdevError> {
        let cb = self.manifest.chunk_bytes;
        let mut done = 0usize;
        let mut last = 0;
        while done < out.len() {
            let at = offset + done as u64;
            let i = (at / cb) as usize;
            let within = (at % cb) as usize;
            let (_, clen) = self.manifest.chunk_range(i);
            let n = (clen as usize - within).min(out.len() - done);
            match self.chunk(i)? {
                Some(data) => out[done..done + n].copy_from_slice(&data[within..within + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
            last = i;
        }
        for k in 1..=READ_AHEAD_CHUNKS {
            self.prefetch(last + k);
        }
        Ok(())
    }
}

impl BlockDevice for BackupDev {
    fn size_bytes(&self) -> u64 {
        self.shared.manifest.size_bytes
    }

    fn describe(&self) -> String {
        format!(
            "backup {} of {} on target {}",
            self.shared.manifest.id, self.shared.manifest.volume, self.shared.target.config.name
        )
    }

    fn read_only(&self) -> bool {
        true
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        let shared = &self.shared;
        if shared.open.fetch_add(1, Ordering::AcqRel) >= MAX_EXPOSE_CHANNELS {
            shared.open.fetch_sub(1, Ordering::AcqRel);
            return Err(BdevError::Full {
                capacity: MAX_EXPOSE_CHANNELS,
            });
        }
        let done = Arc::new(Done {
            queue: Mutex::new(VecDeque::new()),
            event: EventFd::new().inspect_err(|_| {
                shared.open.fetch_sub(1, Ordering::AcqRel);
            })?,
        });
        let (tx, rx) = mpsc::channel::<IoRequest>();
        let (s, d) = (shared.clone(), done.clone());
        std::thread::Builder::new()
            .name("lull-expose".into())
            .spawn(move || worker(&s, &d, rx))
            .map_err(|e| {
                shared.open.fetch_sub(1, Ordering::AcqRel);
                BdevError::Io(e)
            })?;
        Ok(Box::new(ExposeChannel {
            shared: shared.clone(),
            to_worker: tx,
            done,
            queued: Vec::new(),
            local: Vec::new(),
            in_flight: 0,
        }))
    }

    /// Chunks of zeros are holes: a metadata lookup.
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>, BdevError> {
        let m = &self.shared.manifest;
        let mut out = Vec::new();
        let mut at = offset;
        while at < offset + len {
            let i = (at / m.chunk_bytes) as usize;
            let (coff, clen) = m.chunk_range(i);
            let n = (coff + clen).min(offset + len) - at;
            let e = match m.chunks[i] {
                Some(_) => Extent::data(n),
                None => Extent::hole(n),
            };
            if !lull_bdev::push_extent(&mut out, e, max) {
                break;
            }
            at += n;
        }
        Ok(out)
    }
}

struct Done {
    queue: Mutex<VecDeque<IoCompletion>>,
    event: EventFd,
}

struct ExposeChannel {
    shared: Arc<Shared>,
    to_worker: mpsc::Sender<IoRequest>,
    done: Arc<Done>,
    queued: Vec<IoRequest>,
    local: Vec<IoCompletion>,
    in_flight: usize,
}

impl Drop for ExposeChannel {
    fn drop(&mut self) {
        // The worker ends when its sender goes.
        self.shared.open.fetch_sub(1, Ordering::AcqRel);
    }
}

fn worker(shared: &Arc<Shared>, done: &Done, rx: mpsc::Receiver<IoRequest>) {
    while let Ok(mut req) = rx.recv() {
        let result = match (&mut req.buf, req.op) {
            (Some(buf), IoOp::Read) => {
                shared.read(req.offset, &mut buf.as_mut_slice()[..req.len as usize])
            }
            _ => Err(BdevError::BadRequest(
                "an exposed backup's worker serves reads",
            )),
        };
        lock(&done.queue).push_back(IoCompletion::new(req.tag, result, req.buf));
        done.event.notify();
    }
}

impl Channel for ExposeChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        if self.in_flight >= EXPOSE_CHANNEL_DEPTH {
            return Err((
                req,
                BdevError::Full {
                    capacity: EXPOSE_CHANNEL_DEPTH,
                },
            ));
        }
        let size = self.shared.manifest.size_bytes;
        if let Err(e) = lull_bdev::validate_request(&req, size) {
            return Err((req, e));
        }
        match req.op {
            IoOp::Read => {
                self.in_flight += 1;
                self.queued.push(req);
                Ok(())
            }
            IoOp::Flush => {
                self.in_flight += 1;
                self.local.push(IoCompletion::new(req.tag, Ok(()), req.buf));
                self.done.event.notify();
                Ok(())
            }
            IoOp::Write { .. } | IoOp::Trim | IoOp::WriteZeroes { .. } => {
                Err((req, BdevError::ReadOnly))
            }
            IoOp::BlockStatus | IoOp::ChangedSince => Err((
                req,
                BdevError::Unsupported("an exposed backup answers block status inline"),
            )),
        }
    }

    fn flush_submissions(&mut self) {
        for req in self.queued.drain(..) {
            if let Err(mpsc::SendError(req)) = self.to_worker.send(req) {
                self.local.push(IoCompletion::new(
                    req.tag,
                    Err(BdevError::Failed(
                        "the exposed backup's worker stopped".into(),
                    )),
                    req.buf,
                ));
                self.done.event.notify();
            }
        }
    }

    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        self.done.event.drain();
        let mut got: Vec<IoCompletion> = self.local.drain(..).collect();
        got.extend(lock(&self.done.queue).drain(..));
        let n = got.len();
        self.in_flight -= n;
        for c in got {
            done(c);
        }
        n
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.done.event.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }
}

impl crate::Backups {
    /// Serves a backup read-only under `name` (default: the backup's id)
    /// over every frontend, fetching chunks as they are read.
    pub fn expose(
        &self,
        target: &str,
        backup: &str,
        name: Option<&str>,
    ) -> Result<Exposed, crate::BackupError> {
        let t = self.target(target)?;
        let m = self.rt.block_on(crate::catalog::manifest(&t, backup))?;
        let name = name.unwrap_or(backup).to_string();
        let mut exposed = lock(&self.exposed);
        if exposed.len() >= MAX_EXPOSED {
            return Err(crate::BackupError::Busy(format!(
                "{MAX_EXPOSED} backups are exposed on this node already"
            )));
        }
        let dev = BackupDev::new(t, m, self.rt.handle().clone());
        self.volumes
            .add(lull_volume::Volume::new(
                &name,
                lull_volume::Storage::Local(Arc::new(dev)),
            ))
            .map_err(|e| crate::BackupError::Volume(e.to_string()))?;
        let e = Exposed {
            name: name.clone(),
            target: target.to_string(),
            backup: backup.to_string(),
        };
        exposed.insert(name.clone(), e.clone());
        tracing::info!(volume = name, target, backup, "backup exposed read-only");
        Ok(e)
    }

    /// Stops serving an exposed backup (connected clients keep it until
    /// they disconnect).
    pub fn unexpose(&self, name: &str) -> Result<(), crate::BackupError> {
        let mut exposed = lock(&self.exposed);
        if exposed.remove(name).is_none() {
            return Err(crate::BackupError::Volume(format!(
                "no exposed backup {name:?}"
            )));
        }
        self.volumes
            .remove(name)
            .map_err(|e| crate::BackupError::Volume(e.to_string()))?;
        Ok(())
    }

    pub fn exposed(&self) -> Vec<Exposed> {
        lock(&self.exposed).values().cloned().collect()
    }
}
