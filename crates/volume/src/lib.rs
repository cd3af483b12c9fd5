//! Volumes: what a frontend serves and the control plane manages. The
//! registry knows nothing of any protocol; both frontends, NBD (an export
//! is a volume) and the NVMe/TCP target (a subsystem per volume), look
//! volumes up here by name.
//!
//! ```
//! use std::sync::Arc;
//! use lull_volume::{Storage, Volume, Volumes};
//! let volumes = Volumes::default();
//! let dev = Arc::new(lull_bdev::MallocDev::new(1 << 20)?);
//! volumes.add(Volume::new("vol0", Storage::Local(dev)))?;
//! let v = volumes.get("").expect("the empty name is the first volume");
//! assert_eq!(v.dev().size_bytes(), 1 << 20);
//! // Replica management asks for the engine by matching, not by downcasting.
//! assert!(v.storage.replicated().is_none());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

mod qos;
mod snapshots;
mod stats;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use lull_bdev::{BdevError, BlockDevice, ChainDev, Channel, IoCompletion, IoRequest};
use lull_engine::ReplicatedDev;

pub use qos::{Qos, QosLimits, QOS_BURST_NS, QOS_MAX_IOS_PER_SEC, QOS_MAX_MBYTES_PER_SEC};
pub use snapshots::{
    no_clones, Cloned, ClonesOf, Flattened, Snapshot, SnapshotError, SnapshotReplicas, Snapshots,
    REPLICATED_SNAPSHOT_TIMEOUT,
};
pub use stats::{
    add_batched as add_batched_stats, bucket_le_ns, OpKind, StatsBatch, VolumeStats,
    VolumeStatsSnapshot, LATENCY_BUCKETS,
};

/// Longest volume name, in bytes. A volume's name is its NBD export name,
/// and NBD caps export names at 4096 bytes (`lull_proto::nbd::MAX_EXPORT_NAME_LEN`;
/// the NBD frontend asserts the two agree).
pub const MAX_VOLUME_NAME_LEN: usize = 4096;

/// Separates a volume's name from one of its snapshots' in an export name
/// (`vol0@s1`, as `zfs` and `rbd` write it). Snapshot names never hold it.
pub const SNAPSHOT_SEPARATOR: char = '@';

/// The export name of `volume`'s snapshot `snapshot` (`vol0@s1`), as
/// [`Volumes::resolve`] takes it apart.
pub fn snapshot_export(volume: &str, snapshot: &str) -> String {
    format!("{volume}{SNAPSHOT_SEPARATOR}{snapshot}")
}

/// Connections (NBD clients past the handshake) one volume serves at once
/// unless configured otherwise. Idle connections are cheap (a poller of a
/// few KiB; the scale test holds 2,000 on one volume), so the default sits
/// well above that and well below the server's 16,384, so that one volume
/// cannot take every connection of the server; an operator who knows the
/// clients lowers it. A replicated volume meets the engine's `MAX_CHANNELS`
/// (64) first, refused the same way in the handshake.
pub const DEFAULT_MAX_CONNECTIONS_PER_VOLUME: usize = 4096;

/// Largest configurable per-volume connection cap: the NBD server's own
/// connection cap (`lull_nbd::MAX_CONNECTIONS`).
pub const MAX_CONNECTIONS_PER_VOLUME: usize = 16_384;

/// Requests in flight on one volume, summed over all its connections (NBD
/// and NVMe/TCP), unless configured otherwise. Each connection already
/// stops at its own bound (NBD: 128; an NVMe/TCP queue: its negotiated
/// size, at most 128), but thousands of connections of one volume could
/// together pin thousands of times that in request buffers; this caps what
/// one volume holds: 4,096 is 32 connections at full depth, deeper than
/// any device queue in lull's reach (an NVMe SSD serves up to 1,023 per
/// queue; io_uring rings here are 256 deep), and at 128 KiB per request
/// 512 MiB of buffers at most. Past it a connection holds its next request
/// (back-pressure: it stops reading) until the volume's other requests
/// complete; nothing is refused. Replicated volumes meet the engine's own
/// bound (`MAX_CHANNELS` × `CHANNEL_DEPTH`) as well.
pub const DEFAULT_MAX_IN_FLIGHT_PER_VOLUME: usize = 4096;

/// Largest configurable per-volume in-flight cap: every connection of a
/// volume (`MAX_CONNECTIONS_PER_VOLUME`) at the NBD per-connection bound
/// (128) — a cap past it could never be reached.
pub const MAX_IN_FLIGHT_PER_VOLUME: usize = MAX_CONNECTIONS_PER_VOLUME * 128;

/// What one volume admits: connections and requests in flight. The same
/// for every volume of a server (configured at start).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeLimits {
    /// Connections (1 to [`MAX_CONNECTIONS_PER_VOLUME`]).
    pub connections: usize,
    /// Requests in flight over all connections (1 to
    /// [`MAX_IN_FLIGHT_PER_VOLUME`]).
    pub in_flight: usize,
}

impl Default for VolumeLimits {
    fn default() -> VolumeLimits {
        VolumeLimits {
            connections: DEFAULT_MAX_CONNECTIONS_PER_VOLUME,
            in_flight: DEFAULT_MAX_IN_FLIGHT_PER_VOLUME,
        }
    }
}

impl VolumeLimits {
    /// Whether both limits are within their ranges.
    pub fn valid(&self) -> bool {
        (1..=MAX_CONNECTIONS_PER_VOLUME).contains(&self.connections)
            && (1..=MAX_IN_FLIGHT_PER_VOLUME).contains(&self.in_flight)
    }
}

/// Errors of the volume registry.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {0:?} already exists")]
    DuplicateVolume(String),
    #[error("invalid volume name {0:?}: 1 to 4096 bytes, no NUL")]
    BadVolumeName(String),
    #[error("no volume {0:?}")]
    NoSuchVolume(String),
    /// The device refused the new size (smaller, unaligned, too big, or
    /// the file could not be extended).
    #[error("volume {name:?}: {source}")]
    Resize {
        name: String,
        #[source]
        source: lull_bdev::BdevError,
    },
}

/// Where a volume's blocks live. The data path uses [`Storage::dev`] for
/// any kind, the snapshot operations [`Storage::snapshots`] (the
/// `snapshots` module); control paths match on it to reach what only one
/// kind has (the replicas of a replicated volume).
#[derive(Clone)]
pub enum Storage {
    /// A device in this process: memory or a local file.
    Local(Arc<dyn BlockDevice>),
    /// A volume replicated to replica servers by its engine.
    Replicated(Arc<ReplicatedDev>),
    /// A local device that takes snapshots: a chain of layers over
    /// memory or a file (`lull_bdev::chain`).
    Layered(Arc<ChainDev>),
}

impl Storage {
    /// The block device, whatever the kind.
    pub fn dev(&self) -> &dyn BlockDevice {
        match self {
            Storage::Local(dev) => dev.as_ref(),
            Storage::Replicated(dev) => dev.as_ref(),
            Storage::Layered(dev) => dev.as_ref(),
        }
    }

    /// The kind, in a word: `local`, `replicated` or `layered`.
    pub fn kind(&self) -> &'static str {
        match self {
            Storage::Local(_) => "local",
            Storage::Replicated(_) => "replicated",
            Storage::Layered(_) => "layered",
        }
    }

    /// The chain of a volume that takes snapshots; `None` otherwise.
    pub fn layered(&self) -> Option<&Arc<ChainDev>> {
        match self {
            Storage::Layered(dev) => Some(dev),
            _ => None,
        }
    }

    /// The engine of a replicated volume; `None` for local storage.
    pub fn replicated(&self) -> Option<&Arc<ReplicatedDev>> {
        match self {
            Storage::Local(_) | Storage::Layered(_) => None,
            Storage::Replicated(dev) => Some(dev),
        }
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Storage::Local(_) => "Local",
            Storage::Replicated(_) => "Replicated",
            Storage::Layered(_) => "Layered",
        };
        write!(f, "{kind}({})", self.dev().describe())
    }
}

/// A named volume: its storage and its I/O counters.
pub struct Volume {
    pub name: String,
    pub storage: Storage,
    pub stats: Arc<VolumeStats>,
    /// Rate limits over all the volume's connections (`qos` module).
    pub qos: Qos,
    /// Connections holding a [`ConnPermit`].
    connections: AtomicUsize,
    /// Requests in flight through the volume's [`Volume::open_channel`]
    /// channels.
    in_flight: AtomicUsize,
    /// Times a request waited because the volume had its maximum in flight.
    in_flight_waits: AtomicU64,
}

/// One admitted connection of a volume; dropping it gives the place back.
#[derive(Debug)]
pub struct ConnPermit {
    volume: Arc<Volume>,
}

impl Drop for ConnPermit {
    fn drop(&mut self) {
        self.volume.connections.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Volume {
    pub fn new(name: &str, storage: Storage) -> Volume {
        Volume {
            name: name.to_string(),
            storage,
            stats: Arc::default(),
            qos: Qos::default(),
            connections: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            in_flight_waits: AtomicU64::new(0),
        }
    }

    /// A place for one more connection, if fewer than `max` hold one.
    pub fn try_connect(self: &Arc<Self>, max: usize) -> Option<ConnPermit> {
        self.connections
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| ConnPermit {
                volume: self.clone(),
            })
    }

    /// Connections admitted now.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    /// Requests in flight now, over all connections.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Times a request had to wait for the volume's in-flight cap.
    pub fn in_flight_waits(&self) -> u64 {
        self.in_flight_waits.load(Ordering::Relaxed)
    }

    /// A channel to the volume's device for one connection, whose requests
    /// count against the volume's cap of `max_in_flight`: past it,
    /// `submit` hands the request back as `BdevError::Full` (the frontend
    /// holds it and retries, see [`VolumeChannel`]).
    pub fn open_channel(
        self: &Arc<Self>,
        max_in_flight: usize,
    ) -> Result<Box<dyn Channel>, BdevError> {
        Ok(Box::new(VolumeChannel {
            inner: self.dev().open_channel()?,
            volume: self.clone(),
            max_in_flight,
            mine: 0,
            retry_at: None,
            held_since: None,
        }))
    }

    fn take_in_flight(&self, max: usize) -> bool {
        let taken = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if !taken {
            self.in_flight_waits.fetch_add(1, Ordering::Relaxed);
        }
        taken
    }

    fn give_in_flight(&self, n: usize) {
        if n > 0 {
            let before = self.in_flight.fetch_sub(n, Ordering::AcqRel);
            debug_assert!(before >= n, "volume in-flight count underflow");
        }
    }

    /// The volume's block device (see [`Storage::dev`]).
    pub fn dev(&self) -> &dyn BlockDevice {
        self.storage.dev()
    }
}

/// A connection's channel to its volume's device, counting its requests
/// against the volume's in-flight cap. A request past the cap comes back
/// from `submit` as `BdevError::Full`, the back-pressure every channel
/// already gives when its own queue is full: the frontend holds it and
/// retries. Unlike a full queue of its own, a connection held by the
/// volume's cap may have nothing of its own in flight, so no completion
/// of its own will wake it: a frontend with a held request and nothing in
/// flight keeps its poller awake (it polls until the volume's other
/// connections complete requests, which only happens under overload).
pub struct VolumeChannel {
    inner: Box<dyn Channel>,
    volume: Arc<Volume>,
    max_in_flight: usize,
    /// Requests of this channel counted in the volume's `in_flight`.
    mine: usize,
    /// The last `submit` was refused by the volume's QoS until then.
    retry_at: Option<u64>,
    /// When the QoS first held the request being retried.
    held_since: Option<u64>,
}

impl Channel for VolumeChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        self.retry_at = None;
        if !self.volume.take_in_flight(self.max_in_flight) {
            return Err((
                req,
                BdevError::Full {
                    capacity: self.max_in_flight,
                },
            ));
        }
        if self.volume.qos.limited() {
            use lull_reactor::Clock;
            let now = lull_reactor::MonotonicClock.now_ns();
            match self.volume.qos.take(req.op, req.len, now) {
                Ok(()) => {
                    if let Some(since) = self.held_since.take() {
                        self.volume.qos.note_wait(now.saturating_sub(since));
                    }
                }
                Err(at) => {
                    self.volume.give_in_flight(1);
                    self.retry_at = Some(at);
                    self.held_since.get_or_insert(now);
                    return Err((
                        req,
                        BdevError::Full {
                            capacity: self.max_in_flight,
                        },
                    ));
                }
            }
        }
        match self.inner.submit(req) {
            Ok(()) => {
                self.mine += 1;
                Ok(())
            }
            Err(e) => {
                self.volume.give_in_flight(1);
                Err(e)
            }
        }
    }

    fn flush_submissions(&mut self) {
        self.inner.flush_submissions();
    }

    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        let n = self.inner.reap(done);
        debug_assert!(n <= self.mine, "reaped more than was submitted");
        let n_mine = n.min(self.mine);
        self.mine -= n_mine;
        self.volume.give_in_flight(n_mine);
        n
    }

    fn event_fd(&self) -> Option<RawFd> {
        self.inner.event_fd()
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    fn polled(&self) -> bool {
        self.inner.polled()
    }

    fn allow_splice(&mut self) {
        self.inner.allow_splice();
    }

    fn allow_lend(&mut self) {
        self.inner.allow_lend();
    }

    fn lends(&self) -> bool {
        self.inner.lends()
    }

    fn set_changed_since(&mut self, since: &str) {
        self.inner.set_changed_since(since);
    }

    fn retry_at_ns(&self) -> Option<u64> {
        self.retry_at
    }
}

impl Drop for VolumeChannel {
    fn drop(&mut self) {
        // A connection that goes with requests still in the device (it
        // waits for them first; this is for the cases it cannot) gives
        // their places back, or the volume would lose them for good.
        self.volume.give_in_flight(self.mine);
    }
}

impl std::fmt::Debug for Volume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Volume({}, {} bytes, {})",
            self.name,
            self.dev().size_bytes(),
            self.dev().describe()
        )
    }
}

/// Watchers a registry holds: one per frontend that tells its clients
/// about changes (the NVMe/TCP target's asynchronous events), with room
/// to spare.
pub const MAX_WATCHERS: usize = 8;

/// A change in the registry, as watchers see it.
#[derive(Debug, Clone)]
pub enum VolumeChange {
    /// The volume left the registry (its connected clients still hold
    /// it until they disconnect).
    Removed(Arc<Volume>),
    /// The volume grew: `dev().size_bytes()` is the new size. NVMe/TCP
    /// hosts are told; NBD clients keep the size they negotiated (NBD
    /// has no resize notice) and new connections see the new one.
    Resized(Arc<Volume>),
}

type Watcher = Box<dyn Fn(&VolumeChange) + Send + Sync>;

/// The volumes a server serves, in the order they were added. The empty
/// name means the first (NBD's default export).
pub struct Volumes {
    list: RwLock<Vec<Arc<Volume>>>,
    watchers: Mutex<Vec<Watcher>>,
    limits: VolumeLimits,
}

impl std::fmt::Debug for Volumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.read().iter()).finish()
    }
}

impl Default for Volumes {
    fn default() -> Volumes {
        Volumes::with_limits(VolumeLimits::default())
    }
}

impl Volumes {
    /// A registry whose volumes each admit what `limits` allow (the
    /// caller validated them, see [`VolumeLimits::valid`]).
    pub fn with_limits(limits: VolumeLimits) -> Volumes {
        debug_assert!(limits.valid());
        Volumes {
            list: RwLock::default(),
            watchers: Mutex::default(),
            limits,
        }
    }

    pub fn limits(&self) -> VolumeLimits {
        self.limits
    }

    pub fn add(&self, volume: Volume) -> Result<Arc<Volume>, VolumeError> {
        if volume.name.is_empty()
            || volume.name.len() > MAX_VOLUME_NAME_LEN
            || volume.name.contains('\0')
        {
            return Err(VolumeError::BadVolumeName(volume.name));
        }
        let mut list = self.list.write().unwrap_or_else(|p| p.into_inner());
        if list.iter().any(|v| v.name == volume.name) {
            return Err(VolumeError::DuplicateVolume(volume.name));
        }
        let v = Arc::new(volume);
        list.push(v.clone());
        Ok(v)
    }

    /// Remove a volume from the list; connected clients keep using it
    /// until they disconnect. Watchers are told (after the list is
    /// updated, outside its lock).
    pub fn remove(&self, name: &str) -> Result<Arc<Volume>, VolumeError> {
        let v = {
            let mut list = self.list.write().unwrap_or_else(|p| p.into_inner());
            let pos = list
                .iter()
                .position(|v| v.name == name)
                .ok_or_else(|| VolumeError::NoSuchVolume(name.into()))?;
            list.remove(pos)
        };
        self.tell(&VolumeChange::Removed(v.clone()));
        Ok(v)
    }

    /// Grow a volume to `size_bytes` online (see
    /// [`lull_bdev::BlockDevice::grow`] for the sizes refused); watchers
    /// are told when the size changed. A replicated volume's engine grows
    /// every replica first (blocking the caller until they answered; it
    /// refuses unless every replica is healthy).
    pub fn resize(&self, name: &str, size_bytes: u64) -> Result<Arc<Volume>, VolumeError> {
        let v = self.named(name)?;
        let dev: &dyn BlockDevice = match &v.storage {
            Storage::Local(dev) => dev.as_ref(),
            Storage::Layered(dev) => dev.as_ref(),
            Storage::Replicated(dev) => dev.as_ref(),
        };
        let old = dev.size_bytes();
        dev.grow(size_bytes).map_err(|source| VolumeError::Resize {
            name: name.into(),
            source,
        })?;
        if dev.size_bytes() != old {
            self.tell(&VolumeChange::Resized(v.clone()));
        }
        Ok(v)
    }

    fn tell(&self, change: &VolumeChange) {
        for w in self
            .watchers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            w(change);
        }
    }

    /// Call `f` on every later change. A watcher must be quick and must
    /// not call back into the registry's watchers. `false` when
    /// [`MAX_WATCHERS`] are registered already.
    pub fn watch(&self, f: impl Fn(&VolumeChange) + Send + Sync + 'static) -> bool {
        let mut w = self.watchers.lock().unwrap_or_else(|p| p.into_inner());
        if w.len() >= MAX_WATCHERS {
            return false;
        }
        w.push(Box::new(f));
        true
    }

    /// A volume by name; `""` is the default (first) volume.
    pub fn get(&self, name: &str) -> Option<Arc<Volume>> {
        if name.is_empty() {
            return self.read().first().cloned();
        }
        self.named(name).ok()
    }

    /// What a frontend serves under an export name: the volume of that
    /// name (`""`: the default), or for `VOLUME@SNAPSHOT` a read-only view
    /// of that volume's snapshot ([`BlockDevice::snapshot_view`]), a new
    /// [`Volume`] outside the registry with its own counters. A volume
    /// whose own name holds the separator wins over a snapshot's view.
    pub fn resolve(&self, name: &str) -> Option<Arc<Volume>> {
        if let Some(v) = self.get(name) {
            return Some(v);
        }
        let (volume, snapshot) = name.rsplit_once(SNAPSHOT_SEPARATOR)?;
        let v = self.named(volume).ok()?;
        let view = v.dev().snapshot_view(snapshot)?;
        Some(Arc::new(Volume::new(name, Storage::Local(view))))
    }

    /// The volume with exactly this name (`""` names none), for control
    /// paths that must not fall back to the default volume.
    pub fn named(&self, name: &str) -> Result<Arc<Volume>, VolumeError> {
        self.read()
            .iter()
            .find(|v| v.name == name)
            .cloned()
            .ok_or_else(|| VolumeError::NoSuchVolume(name.into()))
    }

    pub fn list(&self) -> Vec<Arc<Volume>> {
        self.read().clone()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Volume>>> {
        self.list.read().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn malloc(name: &str) -> Volume {
        let dev = lull_bdev::MallocDev::new(4096).expect("malloc");
        Volume::new(name, Storage::Local(Arc::new(dev)))
    }

    #[test]
    fn registry_names() {
        let vs = Volumes::default();
        assert!(vs.get("").is_none());
        vs.add(malloc("a")).expect("add a");
        vs.add(malloc("b")).expect("add b");
        assert!(matches!(
            vs.add(malloc("a")),
            Err(VolumeError::DuplicateVolume(_))
        ));
        for bad in ["", "x\0y", &"n".repeat(MAX_VOLUME_NAME_LEN + 1)] {
            assert!(matches!(
                vs.add(malloc(bad)),
                Err(VolumeError::BadVolumeName(_))
            ));
        }
        assert_eq!(vs.get("").map(|v| v.name.clone()), Some("a".into()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        assert!(vs.watch(move |c| {
            if let VolumeChange::Removed(v) = c {
                s.lock().unwrap().push(v.name.clone());
            }
        }));
        assert_eq!(vs.get("b").map(|v| v.name.clone()), Some("b".into()));
        assert!(matches!(vs.named(""), Err(VolumeError::NoSuchVolume(_))));
        vs.remove("a").expect("remove a");
        assert!(matches!(vs.remove("a"), Err(VolumeError::NoSuchVolume(_))));
        assert_eq!(*seen.lock().unwrap(), vec!["a".to_string()]);
        for _ in 1..MAX_WATCHERS {
            assert!(vs.watch(|_| {}));
        }
        assert!(!vs.watch(|_| {}), "bounded");
        assert_eq!(vs.get("").map(|v| v.name.clone()), Some("b".into()));
        assert!(vs.list()[0].storage.replicated().is_none());
    }

    #[test]
    fn resize_grows_local_volumes_and_tells_watchers() {
        let vs = Volumes::default();
        vs.add(malloc("a")).expect("add a");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        assert!(vs.watch(move |c| {
            if let VolumeChange::Resized(v) = c {
                s.lock().unwrap().push(v.dev().size_bytes());
            }
        }));
        let v = vs.resize("a", 1 << 20).expect("grow");
        assert_eq!(v.dev().size_bytes(), 1 << 20);
        // The same size again: nothing changed, nobody told.
        vs.resize("a", 1 << 20).expect("same size");
        assert_eq!(*seen.lock().unwrap(), vec![1 << 20]);
        for (size, what) in [(4096, "shrink"), ((1 << 20) + 100, "unaligned")] {
            assert!(
                matches!(vs.resize("a", size), Err(VolumeError::Resize { .. })),
                "{what}"
            );
        }
        assert!(matches!(
            vs.resize("b", 1 << 20),
            Err(VolumeError::NoSuchVolume(_))
        ));
        assert_eq!(seen.lock().unwrap().len(), 1, "refusals tell nobody");
    }

    #[test]
    fn connection_permits_are_capped_and_given_back() {
        let v = Arc::new(malloc("a"));
        let one = v.try_connect(2).expect("first");
        let two = v.try_connect(2).expect("second");
        assert!(v.try_connect(2).is_none(), "a third past the cap of 2");
        drop(one);
        assert_eq!(v.connections(), 1);
        let _three = v.try_connect(2).expect("a place came back");
        drop(two);
        assert_eq!(v.connections(), 1);
    }

    fn write(tag: u64) -> IoRequest {
        IoRequest {
            tag,
            op: lull_bdev::IoOp::Write { fua: false },
            offset: 0,
            len: 512,
            buf: Some({
                let mut b = lull_bdev::IoBuf::with_capacity(512);
                b.set_len(512);
                b
            }),
        }
    }

    #[test]
    fn in_flight_is_capped_per_volume_over_its_channels() {
        let v = Arc::new(malloc("a"));
        let mut a = v.open_channel(3).expect("channel a");
        let mut b = v.open_channel(3).expect("channel b");
        a.submit(write(1)).expect("a 1");
        a.submit(write(2)).expect("a 2");
        b.submit(write(3)).expect("b 1");
        assert_eq!(v.in_flight(), 3);
        // The volume is at its cap: b's next request comes back as Full,
        // although b itself has one in flight only.
        let (back, e) = b.submit(write(4)).expect_err("past the volume's cap");
        assert_eq!(back.tag, 4);
        assert!(matches!(e, BdevError::Full { capacity: 3 }));
        assert_eq!(v.in_flight_waits(), 1);
        let mut tags = Vec::new();
        assert_eq!(a.reap(&mut |c| tags.push(c.tag)), 2);
        assert_eq!(tags, [1, 2]);
        assert_eq!(v.in_flight(), 1);
        b.submit(back).expect("room again");
        assert_eq!(v.in_flight(), 2);
        // A channel dropped with requests unreaped gives their places back.
        drop(b);
        assert_eq!(v.in_flight(), 0);
        drop(a);
        assert_eq!(v.in_flight(), 0);
    }
}
