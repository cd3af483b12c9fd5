//! Volumes: what a frontend serves and the control plane manages. The
//! registry knows nothing of any protocol; the NBD frontend (and a future
//! NVMe/TCP one) look volumes up here by name.
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

mod stats;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use lull_bdev::BlockDevice;
use lull_engine::ReplicatedDev;

pub use stats::{bucket_le_ns, OpKind, VolumeStats, VolumeStatsSnapshot, LATENCY_BUCKETS};

/// Longest volume name, in bytes. A volume's name is its NBD export name,
/// and NBD caps export names at 4096 bytes (`lull_proto::nbd::MAX_EXPORT_NAME_LEN`;
/// the NBD frontend asserts the two agree).
pub const MAX_VOLUME_NAME_LEN: usize = 4096;

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

/// Errors of the volume registry.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("volume {0:?} already exists")]
    DuplicateVolume(String),
    #[error("invalid volume name {0:?}: 1 to 4096 bytes, no NUL")]
    BadVolumeName(String),
    #[error("no volume {0:?}")]
    NoSuchVolume(String),
    /// Its replicas would have to grow together, in step with the
    /// engine; that is not built yet.
    #[error("volume {0:?}: resize of replicated volumes is not supported yet")]
    ResizeReplicated(String),
    /// The device refused the new size (smaller, unaligned, too big, or
    /// the file could not be extended).
    #[error("volume {name:?}: {source}")]
    Resize {
        name: String,
        #[source]
        source: lull_bdev::BdevError,
    },
}

/// Where a volume's blocks live. Control paths match on it to reach what
/// only one kind has (the replicas of a replicated volume); the data path
/// uses [`Storage::dev`] for either.
#[derive(Clone)]
pub enum Storage {
    /// A device in this process: memory or a local file.
    Local(Arc<dyn BlockDevice>),
    /// A volume replicated to replica servers by its engine.
    Replicated(Arc<ReplicatedDev>),
}

impl Storage {
    /// The block device, whatever the kind.
    pub fn dev(&self) -> &dyn BlockDevice {
        match self {
            Storage::Local(dev) => dev.as_ref(),
            Storage::Replicated(dev) => dev.as_ref(),
        }
    }

    /// The engine of a replicated volume; `None` for local storage.
    pub fn replicated(&self) -> Option<&Arc<ReplicatedDev>> {
        match self {
            Storage::Local(_) => None,
            Storage::Replicated(dev) => Some(dev),
        }
    }
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self {
            Storage::Local(_) => "Local",
            Storage::Replicated(_) => "Replicated",
        };
        write!(f, "{kind}({})", self.dev().describe())
    }
}

/// A named volume: its storage and its I/O counters.
pub struct Volume {
    pub name: String,
    pub storage: Storage,
    pub stats: VolumeStats,
    /// Connections holding a [`ConnPermit`].
    connections: AtomicUsize,
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
            stats: VolumeStats::default(),
            connections: AtomicUsize::new(0),
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

    /// The volume's block device (see [`Storage::dev`]).
    pub fn dev(&self) -> &dyn BlockDevice {
        self.storage.dev()
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
    max_connections_per_volume: usize,
}

impl std::fmt::Debug for Volumes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.read().iter()).finish()
    }
}

impl Default for Volumes {
    fn default() -> Volumes {
        Volumes::with_max_connections_per_volume(DEFAULT_MAX_CONNECTIONS_PER_VOLUME)
    }
}

impl Volumes {
    /// A registry whose volumes each admit at most `max` connections
    /// (1 to [`MAX_CONNECTIONS_PER_VOLUME`]; the caller validated it).
    pub fn with_max_connections_per_volume(max: usize) -> Volumes {
        debug_assert!((1..=MAX_CONNECTIONS_PER_VOLUME).contains(&max));
        Volumes {
            list: RwLock::default(),
            watchers: Mutex::default(),
            max_connections_per_volume: max,
        }
    }

    pub fn max_connections_per_volume(&self) -> usize {
        self.max_connections_per_volume
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

    /// Grow a local volume to `size_bytes` online (see
    /// [`lull_bdev::BlockDevice::grow`] for the sizes refused); watchers
    /// are told when the size changed. A replicated volume is refused.
    pub fn resize(&self, name: &str, size_bytes: u64) -> Result<Arc<Volume>, VolumeError> {
        let v = self.named(name)?;
        let dev = match &v.storage {
            Storage::Local(dev) => dev,
            Storage::Replicated(_) => return Err(VolumeError::ResizeReplicated(name.into())),
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
}
