//! Where a chain's layers and record live: memory, or files.
//!
//! A file volume `PATH` keeps its first layer in `PATH` itself and every
//! later one in `PATH.lull/L<id>.img`, with the chain's record in
//! `PATH.lull/chain.json`. The record is replaced atomically (written to
//! a temporary file, synced, renamed over, the directory synced), and a
//! new layer's file is created and synced before the record names it, so
//! a crash at any point leaves the old record or the new one: never a
//! record naming a file that is not there. Files the record does not name
//! (a layer created by a snapshot the crash cut short, one a merge or a
//! revert dropped before it was removed) are removed at open, logged.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use crate::file::{FileDev, FileOptions};
use crate::malloc::{ChunkReserve, MallocDev, CHUNK_RESERVE_MAX_BYTES};
use crate::{BdevError, BlockDevice};

/// One layer in a chain's record.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct LayerRecord {
    pub id: u64,
    /// `(name, created, in seconds since the epoch)` for a snapshot;
    /// `None` for the head.
    #[serde(default)]
    pub snapshot: Option<(String, u64)>,
    /// Where a layer of another chain lives (a clone's base): the file's
    /// path. `None`: the chain's own layer.
    #[serde(default)]
    pub foreign: Option<String>,
}

/// A volume using one of the chain's snapshots as its base.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CloneRef {
    pub volume: String,
    pub snapshot: String,
}

/// A chain's durable state: its layers bottom first, the head last.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChainRecord {
    pub layers: Vec<LayerRecord>,
    #[serde(default)]
    pub clones: Vec<CloneRef>,
}

impl ChainRecord {
    /// The record of a volume that never took a snapshot: one layer, id 0
    /// (the volume's own device).
    pub fn new_volume() -> ChainRecord {
        ChainRecord {
            layers: vec![LayerRecord {
                id: 0,
                snapshot: None,
                foreign: None,
            }],
            clones: Vec::new(),
        }
    }
}

/// Largest chain record read at open: 64 layers and as many clones with
/// names of a few hundred bytes each fit in a small fraction of it; a
/// bigger file is not one lull wrote.
pub const MAX_CHAIN_RECORD_BYTES: u64 = 1 << 20;

/// Keeps a chain's layers and its record.
pub trait LayerStore: Send + Sync {
    /// The committed record and a device for each of its layers, bottom
    /// first; with no record yet, a record of one layer (id 0) and its
    /// device of `size_bytes`.
    fn load(&self, size_bytes: u64) -> Result<(ChainRecord, Vec<Arc<dyn BlockDevice>>), BdevError>;
    /// A new, empty layer, durable before it returns.
    fn create_layer(&self, id: u64, size_bytes: u64) -> Result<Arc<dyn BlockDevice>, BdevError>;
    /// Makes `record` the chain's state, atomically and durably.
    fn commit(&self, record: &ChainRecord) -> Result<(), BdevError>;
    /// Frees a layer the committed record no longer names (best effort,
    /// logged on failure; open cleans up what is left).
    fn discard_layer(&self, id: u64);
    /// Where layer `id` lives, for a clone's record (a file's path);
    /// `None` where only the process holds it (memory).
    fn layer_location(&self, id: u64) -> Option<String>;
    /// The volume's own file, for a store of files.
    fn volume_path(&self) -> Option<PathBuf> {
        None
    }
    fn describe(&self) -> String;
}

/// Layers in memory; nothing survives the process, so nothing is recorded.
///
/// The layers it creates share one [`ChunkReserve`] of at most
/// [`CHUNK_RESERVE_MAX_BYTES`] (and no more than the volume's size): a
/// dropped layer's chunks (a revert's head, a merged snapshot) are
/// reused, zeroed, by the next head's first writes instead of being
/// faulted in afresh.
pub struct MemoryStore {
    base: Arc<dyn BlockDevice>,
    reserve: Arc<ChunkReserve>,
}

impl MemoryStore {
    /// A store whose first layer is `base` (a memory device).
    pub fn new(base: Arc<dyn BlockDevice>) -> MemoryStore {
        let size = usize::try_from(base.size_bytes()).unwrap_or(usize::MAX);
        MemoryStore {
            reserve: ChunkReserve::new(CHUNK_RESERVE_MAX_BYTES.min(size)),
            base,
        }
    }

    /// The chunks the store's layers share (for tests and stats).
    pub fn reserve(&self) -> &Arc<ChunkReserve> {
        &self.reserve
    }
}

impl LayerStore for MemoryStore {
    fn load(
        &self,
        _size_bytes: u64,
    ) -> Result<(ChainRecord, Vec<Arc<dyn BlockDevice>>), BdevError> {
        let record = ChainRecord::new_volume();
        Ok((record, vec![self.base.clone()]))
    }

    fn create_layer(&self, _id: u64, size_bytes: u64) -> Result<Arc<dyn BlockDevice>, BdevError> {
        Ok(Arc::new(MallocDev::with_reserve(
            size_bytes,
            Some(self.reserve.clone()),
        )?))
    }

    fn commit(&self, _record: &ChainRecord) -> Result<(), BdevError> {
        Ok(())
    }

    fn discard_layer(&self, _id: u64) {}

    fn layer_location(&self, _id: u64) -> Option<String> {
        None
    }

    fn describe(&self) -> String {
        self.base.describe()
    }
}

/// Layers in files next to the volume's file (module doc).
pub struct FileStore {
    path: PathBuf,
    dir: PathBuf,
    options: FileOptions,
    /// The layers this store opened, by id, for
    /// [`FileStore::page_cache_file`]; an entry goes stale when its layer
    /// is dropped (and is pruned at the next open).
    opened: Mutex<Vec<(u64, Weak<FileDev>)>>,
}

/// File name of a chain's record inside its layers' directory.
pub const CHAIN_RECORD_FILE: &str = "chain.json";

impl FileStore {
    pub fn new(path: impl AsRef<Path>, options: FileOptions) -> FileStore {
        let path = path.as_ref().to_path_buf();
        let mut dir = path.clone().into_os_string();
        dir.push(".lull");
        FileStore {
            path,
            dir: PathBuf::from(dir),
            options,
            opened: Mutex::default(),
        }
    }

    /// The file of layer `id` for reading its bytes out of the page cache
    /// by other means than a channel (a replica's `sendfile` READ
    /// replies), while the layer is open; `None` with `direct` (reads
    /// bypass the page cache) or for a layer this store did not open.
    pub fn page_cache_file(&self, id: u64) -> Option<Arc<File>> {
        let opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        opened
            .iter()
            .find(|(lid, _)| *lid == id)
            .and_then(|(_, dev)| dev.upgrade())
            .and_then(|dev| dev.page_cache_file())
    }

    /// The directory of the layers after the first and of the record.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn layer_path(&self, id: u64) -> PathBuf {
        if id == 0 {
            self.path.clone()
        } else {
            self.dir.join(format!("L{id}.img"))
        }
    }

    fn open_layer(
        &self,
        id: u64,
        path: &Path,
        size_bytes: u64,
        create: bool,
    ) -> Result<Arc<dyn BlockDevice>, BdevError> {
        let options = FileOptions {
            create,
            ..self.options
        };
        let dev = Arc::new(FileDev::open(path, size_bytes, options)?);
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        opened.retain(|(lid, d)| *lid != id && d.strong_count() > 0);
        opened.push((id, Arc::downgrade(&dev)));
        Ok(dev)
    }

    fn sync_dir(&self) -> Result<(), BdevError> {
        File::open(&self.dir)?.sync_all()?;
        Ok(())
    }

    fn read_record(&self) -> Result<Option<ChainRecord>, BdevError> {
        let path = self.dir.join(CHAIN_RECORD_FILE);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let len = file.metadata()?.len();
        if len > MAX_CHAIN_RECORD_BYTES {
            return Err(BdevError::Failed(format!(
                "{}: {len} bytes, more than a chain record's {MAX_CHAIN_RECORD_BYTES}",
                path.display()
            )));
        }
        let record: ChainRecord =
            serde_json::from_reader(std::io::BufReader::new(file)).map_err(|e| {
                BdevError::Failed(format!("{}: not a chain record: {e}", path.display()))
            })?;
        Ok(Some(record))
    }

    /// Removes layer files the record does not name.
    fn remove_orphans(&self, record: &ChainRecord) {
        let Ok(entries) = fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let Some(id) = name
                .strip_prefix('L')
                .and_then(|n| n.strip_suffix(".img"))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            if !record
                .layers
                .iter()
                .any(|l| l.id == id && l.foreign.is_none())
            {
                tracing::warn!(file = %e.path().display(),
                    "removing a layer file the chain record does not name (left by an operation a crash cut short)");
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

impl LayerStore for FileStore {
    fn load(&self, size_bytes: u64) -> Result<(ChainRecord, Vec<Arc<dyn BlockDevice>>), BdevError> {
        let Some(record) = self.read_record()? else {
            let record = ChainRecord::new_volume();
            // No record: the volume is its file alone, and a layer file
            // here is a first snapshot that a crash cut short before its
            // record was written.
            self.remove_orphans(&record);
            let dev = self.open_layer(0, &self.path, size_bytes, self.options.create)?;
            return Ok((record, vec![dev]));
        };
        if record.layers.is_empty() {
            return Err(BdevError::Failed(format!(
                "{}: the chain record names no layer",
                self.dir.join(CHAIN_RECORD_FILE).display()
            )));
        }
        self.remove_orphans(&record);
        let mut devs = Vec::with_capacity(record.layers.len());
        for l in &record.layers {
            let path = match &l.foreign {
                Some(p) => PathBuf::from(p),
                None => self.layer_path(l.id),
            };
            let dev = self
                .open_layer(l.id, &path, size_bytes, false)
                .map_err(|e| {
                    BdevError::Failed(format!(
                        "{}: layer {} ({}) cannot be opened: {e}",
                        self.dir.join(CHAIN_RECORD_FILE).display(),
                        l.id,
                        path.display()
                    ))
                })?;
            devs.push(dev);
        }
        tracing::info!(chain = %self.dir.display(), layers = record.layers.len(),
            snapshots = record.layers.iter().filter(|l| l.snapshot.is_some()).count(),
            clones = record.clones.len(), "chain record found");
        Ok((record, devs))
    }

    fn create_layer(&self, id: u64, size_bytes: u64) -> Result<Arc<dyn BlockDevice>, BdevError> {
        fs::create_dir_all(&self.dir)?;
        let path = self.layer_path(id);
        let dev = self.open_layer(id, &path, size_bytes, true)?;
        File::open(&path)?.sync_all()?;
        self.sync_dir()?;
        Ok(dev)
    }

    fn commit(&self, record: &ChainRecord) -> Result<(), BdevError> {
        fs::create_dir_all(&self.dir)?;
        let tmp = self.dir.join(format!("{CHAIN_RECORD_FILE}.tmp"));
        let bytes = serde_json::to_vec_pretty(record)
            .map_err(|e| BdevError::Failed(format!("chain record: {e}")))?;
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, self.dir.join(CHAIN_RECORD_FILE))?;
        self.sync_dir()?;
        Ok(())
    }

    fn discard_layer(&self, id: u64) {
        let path = self.layer_path(id);
        if id == 0 {
            tracing::info!(file = %path.display(), chain = %self.dir.display(),
                "the volume's first layer left the chain (merged or reverted away); its file is removed");
        }
        if let Err(e) = fs::remove_file(&path) {
            tracing::warn!(file = %path.display(), error = %e, "cannot remove a dropped layer's file");
        }
    }

    fn layer_location(&self, id: u64) -> Option<String> {
        let p = self.layer_path(id);
        Some(fs::canonicalize(&p).unwrap_or(p).display().to_string())
    }

    fn volume_path(&self) -> Option<PathBuf> {
        Some(self.path.clone())
    }

    fn describe(&self) -> String {
        format!("file:{}", self.path.display())
    }
}
