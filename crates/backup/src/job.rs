//! Backup, restore and verify jobs: each runs on a thread of its own
//! (the volume's I/O) and on the backup runtime (the target's), reports
//! its progress while it runs, and keeps its result when done.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use serde::Serialize;
use serde_json::{json, Value};

use crate::catalog::{self, now_unix_ms, Lock};
use crate::chunks::{
    self, fetch_chunk, fetch_object, Changed, Known, Limiter, PatchPlan, ReadChunk, StoredChunk,
    CHANGE_WINDOW_CHUNKS,
};
use crate::devio::DevIo;
use crate::format::{
    self, BackupStats, Manifest, CHUNK_BYTES, FORMAT_VERSION, PATCH_FORMAT_VERSION,
};
use crate::target::Target;
use crate::{lock, BackupError, Backups, MAX_FINISHED_JOBS, MAX_RUNNING_JOBS};

/// Chunks between the volume and the target at once per job: read and
/// waiting, being compressed, being sent. Eight keep a link with 10 ms of
/// latency busy at 2 MiB per PUT (200 MB/s) and hold ~32 MiB.
pub const CHUNKS_IN_FLIGHT: usize = 8;

/// Snapshots a backup takes for itself (none named) start with this;
/// when the next backup of the volume to the same target completes,
/// the one before it is deleted (it is not needed as a base any more).
pub const AUTO_SNAPSHOT_PREFIX: &str = "lull-backup-";

/// Bad chunks a failed verify names in its error (all are logged).
pub const VERIFY_NAMED_MAX: usize = 16;

/// Largest bandwidth limit accepted (MB/s): 100 GB/s, past any link.
pub const MAX_BANDWIDTH_MBYTES_PER_SEC: u64 = 100_000;

/// What `backup_create` asks for.
#[derive(Debug, Clone, Default)]
pub struct BackupRequest {
    pub volume: String,
    pub target: String,
    /// An existing snapshot to back up; `None`: take one now.
    pub snapshot: Option<String>,
    /// Upload limit in MB/s (0: none).
    pub bandwidth_mbytes_per_sec: u64,
    /// The schedule that asks (recorded in the manifest).
    pub schedule: Option<String>,
    /// `volume` names a replica of this node's store, not a volume: its
    /// snapshot `snapshot` (required) is read from the replica's own
    /// files, with no engine (the CSI controller's backup snapshots; every
    /// replica holds the same bytes in a snapshot).
    pub replica: bool,
}

/// What `backup_restore` asks for.
#[derive(Debug, Clone, Default)]
pub struct RestoreRequest {
    pub target: String,
    pub backup: String,
    /// The new volume's name and backend (as `volume_create` takes them).
    pub name: String,
    pub backend: String,
    pub persist: bool,
    /// `name` is a new replica of this node's store (created, never
    /// attached: generation 0, no snapshot, no engine), filled in place
    /// rather than a new volume made (the CSI controller's volume from a
    /// backup snapshot: each node fills its own replica).
    pub replica: bool,
}

#[derive(Default)]
pub struct Progress {
    pub total_bytes: AtomicU64,
    pub done_bytes: AtomicU64,
    pub sent_bytes: AtomicU64,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    Running,
    Done,
    Failed,
}

/// A job as `backup_job_list` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct JobInfo {
    pub id: String,
    pub kind: &'static str,
    pub volume: String,
    pub target: String,
    /// The backup it makes, restores or verifies.
    pub backup: String,
    /// The snapshot a backup job reads (`None` until it is known: one it
    /// takes itself).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// It reads or fills a replica of the store, not a volume.
    pub replica: bool,
    pub state: JobState,
    pub total_bytes: u64,
    pub done_bytes: u64,
    pub sent_bytes: u64,
    pub elapsed_ms: u64,
    /// Bytes done per second so far (MB/s).
    pub rate_mbytes_per_sec: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
}

struct Job {
    info: Mutex<JobInfo>,
    /// Shared with the job's upload tasks, which count what they send.
    progress: Arc<Progress>,
    started: Instant,
}

impl Job {
    fn snapshot(&self) -> JobInfo {
        let mut i = lock(&self.info).clone();
        i.total_bytes = self.progress.total_bytes.load(Ordering::Relaxed);
        i.done_bytes = self.progress.done_bytes.load(Ordering::Relaxed);
        i.sent_bytes = self.progress.sent_bytes.load(Ordering::Relaxed);
        let secs = self.started.elapsed().as_secs_f64();
        if matches!(i.state, JobState::Running) {
            i.elapsed_ms = (secs * 1000.0) as u64;
        }
        let secs = (i.elapsed_ms as f64 / 1000.0).max(0.001);
        i.rate_mbytes_per_sec = (i.done_bytes as f64 / 1e6 / secs * 10.0).round() / 10.0;
        i
    }

    fn finish(&self, r: &Result<Value, BackupError>) {
        let mut i = lock(&self.info);
        i.elapsed_ms = self.started.elapsed().as_millis() as u64;
        match r {
            Ok(v) => {
                i.state = JobState::Done;
                i.result = Some(v.clone());
            }
            Err(e) => {
                i.state = JobState::Failed;
                i.error = Some(e.to_string());
            }
        }
    }
}

/// The node's jobs: running ones, and the last finished ones.
#[derive(Default)]
pub struct Jobs {
    running: BTreeMap<String, Arc<Job>>,
    finished: VecDeque<Arc<Job>>,
    /// Volumes with a backup running (one at a time per volume).
    busy_volumes: BTreeMap<String, String>,
}

/// What a job is about, for [`Backups::start_job`].
struct NewJob<'a> {
    kind: &'static str,
    volume: &'a str,
    target: &'a str,
    backup: &'a str,
    /// One such job per volume at once (backups and restores).
    exclusive_volume: bool,
    snapshot: Option<&'a str>,
    replica: bool,
}

impl Backups {
    fn start_job(self: &Arc<Self>, new: NewJob<'_>) -> Result<Arc<Job>, BackupError> {
        let NewJob {
            kind,
            volume,
            target,
            backup,
            exclusive_volume,
            snapshot,
            replica,
        } = new;
        let mut jobs = lock(&self.jobs);
        if jobs.running.len() >= MAX_RUNNING_JOBS {
            return Err(BackupError::Busy(format!(
                "{MAX_RUNNING_JOBS} backup jobs run on this node already; retry when one is done"
            )));
        }
        if exclusive_volume {
            if let Some(other) = jobs.busy_volumes.get(volume) {
                return Err(BackupError::Busy(format!(
                    "a backup of volume {volume:?} runs already ({other}): one at a time per volume"
                )));
            }
            jobs.busy_volumes
                .insert(volume.to_string(), backup.to_string());
        }
        let job = Arc::new(Job {
            info: Mutex::new(JobInfo {
                id: format!("{kind}-{backup}"),
                kind,
                volume: volume.to_string(),
                target: target.to_string(),
                backup: backup.to_string(),
                snapshot: snapshot.map(str::to_string),
                replica,
                state: JobState::Running,
                total_bytes: 0,
                done_bytes: 0,
                sent_bytes: 0,
                elapsed_ms: 0,
                rate_mbytes_per_sec: 0.0,
                error: None,
                result: None,
            }),
            progress: Arc::new(Progress::default()),
            started: Instant::now(),
        });
        let id = lock(&job.info).id.clone();
        jobs.running.insert(id, job.clone());
        Ok(job)
    }

    /// Runs `run` for `job` on a thread of its own; the job's result is
    /// what it returns.
    fn spawn_job(
        self: &Arc<Self>,
        job: &Arc<Job>,
        thread: &str,
        run: impl FnOnce(&Backups, &Job) -> Result<Value, BackupError> + Send + 'static,
    ) -> Result<JobInfo, BackupError> {
        let (me, j) = (self.clone(), job.clone());
        let spawned = std::thread::Builder::new()
            .name(thread.into())
            .spawn(move || {
                let r = run(&me, &j);
                me.end_job(&j, &r);
            });
        if let Err(e) = spawned {
            let why = format!("{thread} thread: {e}");
            self.end_job(job, &Err(BackupError::Failed(why.clone())));
            return Err(BackupError::Failed(why));
        }
        Ok(job.snapshot())
    }

    fn end_job(&self, job: &Arc<Job>, r: &Result<Value, BackupError>) {
        job.finish(r);
        let info = lock(&job.info).clone();
        let mut jobs = lock(&self.jobs);
        jobs.running.remove(&info.id);
        if jobs.busy_volumes.get(&info.volume) == Some(&info.backup) {
            jobs.busy_volumes.remove(&info.volume);
        }
        jobs.finished.push_back(job.clone());
        while jobs.finished.len() > MAX_FINISHED_JOBS {
            jobs.finished.pop_front();
        }
        match r {
            Ok(_) => tracing::info!(
                job = info.id,
                volume = info.volume,
                target = info.target,
                elapsed_ms = info.elapsed_ms,
                "backup job done"
            ),
            Err(e) => tracing::warn!(job = info.id, volume = info.volume, target = info.target,
                error = %e, "backup job failed"),
        }
    }

    /// Running jobs and the last finished ones.
    pub fn jobs(&self) -> Vec<JobInfo> {
        let jobs = lock(&self.jobs);
        jobs.finished
            .iter()
            .chain(jobs.running.values())
            .map(|j| j.snapshot())
            .collect()
    }

    /// One job by id (`backup-bk-...`, `restore-bk-...`, `verify-bk-...`).
    pub fn job(&self, id: &str) -> Option<JobInfo> {
        let jobs = lock(&self.jobs);
        jobs.running
            .get(id)
            .or_else(|| jobs.finished.iter().rev().find(|j| lock(&j.info).id == id))
            .map(|j| j.snapshot())
    }

    /// Waits for a job to finish (`wait: true` on the RPC), at most `limit`.
    pub fn wait_job(&self, id: &str, limit: Duration) -> Option<JobInfo> {
        let deadline = Instant::now() + limit;
        loop {
            let j = self.job(id)?;
            if !matches!(j.state, JobState::Running) || Instant::now() >= deadline {
                return Some(j);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts a backup; returns its job (whose `backup` is the new
    /// backup's id) at once.
    pub fn create(self: &Arc<Self>, req: BackupRequest) -> Result<JobInfo, BackupError> {
        if req.bandwidth_mbytes_per_sec > MAX_BANDWIDTH_MBYTES_PER_SEC {
            return Err(BackupError::Config(format!(
                "bandwidth_mbytes_per_sec: at most {MAX_BANDWIDTH_MBYTES_PER_SEC}"
            )));
        }
        let t = self.target(&req.target)?;
        let dev = self.source(&req)?;
        let size = dev.size_bytes();
        if size > format::MAX_BACKUP_VOLUME_BYTES {
            return Err(BackupError::Volume(format!(
                "volume {:?}: {size} bytes, past the {} a backup takes",
                req.volume,
                format::MAX_BACKUP_VOLUME_BYTES
            )));
        }
        if let Some(s) = &req.snapshot {
            if !dev.has_snapshot(s) {
                return Err(BackupError::Volume(format!(
                    "{} {:?} has no snapshot {s:?}",
                    if req.replica { "replica" } else { "volume" },
                    req.volume
                )));
            }
        }
        let id = format::new_backup_id(now_unix_ms());
        let job = self.start_job(NewJob {
            kind: "backup",
            volume: &req.volume,
            target: &req.target,
            backup: &id,
            exclusive_volume: true,
            snapshot: req.snapshot.as_deref(),
            replica: req.replica,
        })?;
        self.spawn_job(&job, "lull-backup", move |me, j| {
            me.run_backup(j, &t, &req, &id)
        })
    }

    /// The device a backup reads: the volume's, or with `replica` the
    /// store's replica's chain (a snapshot named: a backup takes no
    /// snapshot of a replica itself, every replica must hold it).
    fn source(&self, req: &BackupRequest) -> Result<Arc<dyn lull_bdev::BlockDevice>, BackupError> {
        if req.replica {
            if req.snapshot.is_none() {
                return Err(BackupError::Volume(format!(
                    "replica {:?}: a backup of a replica names its snapshot (snapshot)",
                    req.volume
                )));
            }
            return self
                .control
                .replica_device(&req.volume)
                .map_err(|e| BackupError::Volume(format!("replica {:?}: {e}", req.volume)));
        }
        let v = self
            .volumes
            .named(&req.volume)
            .map_err(|e| BackupError::Volume(e.to_string()))?;
        if v.storage.layered().is_none() && v.storage.replicated().is_none() {
            return Err(BackupError::Volume(format!(
                "volume {:?} ({}) takes no snapshots, so no backups: memory, file and replicated volumes do",
                req.volume,
                v.dev().describe()
            )));
        }
        Ok(storage_dev(&v.storage))
    }

    fn run_backup(
        &self,
        job: &Job,
        t: &Target,
        req: &BackupRequest,
        id: &str,
    ) -> Result<Value, BackupError> {
        let started = Instant::now();
        let dev = self.source(req)?;
        self.rt.block_on(t.check())?;
        // The lock first: no collection may start while chunks this
        // backup counts on could be deleted.
        let lock_ = Lock::new(id, "backup");
        self.rt
            .block_on(async {
                catalog::put_lock(t, &lock_).await?;
                match catalog::live_locks(t, id)
                    .await?
                    .into_iter()
                    .find(|l| l.kind == "gc")
                {
                    Some(g) => Err(BackupError::Busy(format!(
                        "target {}: a garbage collection runs ({} on {}); back up when it is done",
                        t.config.name, g.id, g.host
                    ))),
                    None => Ok(()),
                }
            })
            .inspect_err(|_| self.rt.block_on(catalog::drop_lock(t, id)))?;
        let refresh = {
            let (t, mut l) = (t.clone(), lock_.clone());
            self.rt.spawn(async move {
                loop {
                    tokio::time::sleep(catalog::LOCK_REFRESH).await;
                    l.refreshed_unix_ms = now_unix_ms();
                    if let Err(e) = catalog::put_lock(&t, &l).await {
                        tracing::warn!(lock = l.id, error = %e, "backup lock not refreshed");
                    }
                }
            })
        };
        let r = self.backup_locked(job, t, req, id, &dev, started);
        refresh.abort();
        self.rt.block_on(catalog::drop_lock(t, id));
        r
    }

    fn backup_locked(
        &self,
        job: &Job,
        t: &Target,
        req: &BackupRequest,
        id: &str,
        dev: &Arc<dyn lull_bdev::BlockDevice>,
        started: Instant,
    ) -> Result<Value, BackupError> {
        let volume = &req.volume;
        let snapshot = match &req.snapshot {
            Some(s) => s.clone(),
            None => {
                let name = format!("{AUTO_SNAPSHOT_PREFIX}{}", &id[3..]);
                self.control
                    .snapshot_create(volume, &name)
                    .map_err(|e| BackupError::Volume(format!("snapshot of {volume:?}: {e}")))?;
                lock(&job.info).snapshot = Some(name.clone());
                name
            }
        };
        let r = self.backup_snapshot(job, t, req, id, dev, &snapshot, started);
        if r.is_err() && req.snapshot.is_none() {
            // Its own snapshot is no base for anything now.
            if let Err(e) = self.control.snapshot_delete(volume, &snapshot) {
                tracing::warn!(volume, snapshot, error = %e, "the failed backup's snapshot stays");
            }
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn backup_snapshot(
        &self,
        job: &Job,
        t: &Target,
        req: &BackupRequest,
        id: &str,
        dev: &Arc<dyn lull_bdev::BlockDevice>,
        snapshot: &str,
        started: Instant,
    ) -> Result<Value, BackupError> {
        let volume = &req.volume;
        let view = dev.snapshot_view(snapshot).ok_or_else(|| {
            BackupError::Volume(format!(
                "volume {volume:?}: snapshot {snapshot:?} cannot be read"
            ))
        })?;
        let size = view.size_bytes();
        let n = size.div_ceil(CHUNK_BYTES) as usize;
        job.progress.total_bytes.store(size, Ordering::Relaxed);
        // The newest backup of this volume on this target whose snapshot
        // the volume still has is the parent: only what changed since
        // is read.
        let all = self.rt.block_on(catalog::manifests(t))?;
        let parent = all.iter().rev().find(|m| {
            m.volume == *volume
                && m.chunk_bytes == CHUNK_BYTES
                && m.size_bytes <= size
                && m.snapshot != snapshot
                && dev.has_snapshot(&m.snapshot)
        });
        let mut io = DevIo::open(view.clone())?;
        let allocated = allocated_chunks(&mut io, size)?;
        let mut stats = BackupStats::default();
        let mut chunks: Vec<Option<String>> = vec![None; n];
        let mut patches = BTreeMap::new();
        let known = Arc::new(Known::of(all.iter().filter(|m| m.volume == *volume)));
        let (tx, rx) = tokio::sync::mpsc::channel::<ReadChunk>(CHUNKS_IN_FLIGHT);
        let uploads = self.rt.spawn(upload_chunks(
            t.clone(),
            rx,
            known,
            Arc::new(Limiter::new(req.bandwidth_mbytes_per_sec)),
            job.progress.clone(),
        ));
        let mut read_error = None;
        let mut changed = Vec::new();
        for i in 0..n {
            let (off, len) = format::chunk_range(i, CHUNK_BYTES, size);
            if let (Some(p), 0) = (parent, i % CHANGE_WINDOW_CHUNKS) {
                let count = CHANGE_WINDOW_CHUNKS.min(n - i);
                let end = size.min((i + count) as u64 * CHUNK_BYTES);
                match io.changed(&p.snapshot, off, end - off) {
                    Ok(runs) => changed = chunks::changed_by_chunk(&runs, i, count),
                    Err(e) => {
                        read_error = Some(BackupError::from(e));
                        break;
                    }
                }
            }
            let here = parent.map(|_| &changed[i % CHANGE_WINDOW_CHUNKS]);
            // Unchanged: the parent held it at this length (a grown
            // volume's old last chunk is read again).
            let unchanged = parent.is_some_and(|p| {
                i < p.chunks.len()
                    && p.chunk_range(i).1 == len
                    && here == Some(&Changed::Blocks(Vec::new()))
            });
            if let (true, Some(p)) = (unchanged, parent) {
                chunks[i] = p.chunks[i].clone();
                if let Some(patch) = p.patches.get(&i) {
                    patches.insert(i, patch.clone());
                }
                stats.chunks_unchanged += 1;
            } else if !allocated[i] {
                stats.chunks_zero += 1;
            } else {
                let data = match io.read(off, len) {
                    Ok(d) => d,
                    Err(e) => {
                        read_error = Some(BackupError::from(e));
                        break;
                    }
                };
                stats.bytes_read += len;
                let patch = parent
                    .zip(here)
                    .and_then(|(p, ch)| PatchPlan::new(p, i, len, ch));
                if data.iter().all(|&b| b == 0) {
                    stats.chunks_zero += 1;
                } else if tx.blocking_send(ReadChunk { i, data, patch }).is_err() {
                    break; // the uploads failed: their error is below
                }
            }
            job.progress.done_bytes.store(off + len, Ordering::Relaxed);
        }
        drop(tx);
        let uploaded = self
            .rt
            .block_on(uploads)
            .map_err(|e| BackupError::Failed(format!("upload task: {e}")))?;
        if let Some(e) = read_error {
            return Err(e);
        }
        for s in uploaded? {
            stats.count(&s);
            chunks[s.i] = Some(s.name);
            if let Some(p) = s.patch {
                patches.insert(s.i, p);
            }
        }
        job.progress
            .sent_bytes
            .store(stats.bytes_uploaded, Ordering::Relaxed);
        stats.duration_ms = started.elapsed().as_millis() as u64;
        let m = Manifest {
            format: if patches.is_empty() {
                FORMAT_VERSION
            } else {
                PATCH_FORMAT_VERSION
            },
            id: id.to_string(),
            volume: volume.clone(),
            size_bytes: size,
            chunk_bytes: CHUNK_BYTES,
            snapshot: snapshot.to_string(),
            created_unix_ms: now_unix_ms(),
            parent: parent.map(|p| p.id.clone()),
            schedule: req.schedule.clone(),
            chunks,
            patches,
            stats,
        };
        m.check()?;
        self.rt.block_on(catalog::put_manifest(t, &m))?;
        tracing::info!(volume, target = %t.config.name, backup = id, snapshot,
            parent = ?m.parent, uploaded = m.stats.bytes_uploaded, read = m.stats.bytes_read,
            "backup complete");
        // The parent's own snapshot was kept as this backup's base; this
        // one's takes over.
        if let Some(p) = parent.filter(|_| !req.replica) {
            if p.snapshot.starts_with(AUTO_SNAPSHOT_PREFIX) {
                if let Err(e) = self.control.snapshot_delete(volume, &p.snapshot) {
                    tracing::info!(volume, snapshot = p.snapshot, error = %e,
                        "the previous backup's snapshot stays");
                }
            }
        }
        Ok(summary(&m))
    }

    /// Starts a restore of a backup into a new volume.
    pub fn restore(self: &Arc<Self>, req: RestoreRequest) -> Result<JobInfo, BackupError> {
        let t = self.target(&req.target)?;
        let m = self.rt.block_on(catalog::manifest(&t, &req.backup))?;
        if req.replica {
            self.check_new_replica(&req.name, m.size_bytes)?;
        } else if self.volumes.named(&req.name).is_ok() {
            return Err(BackupError::Volume(format!(
                "volume {:?} exists already: a restore makes a new volume",
                req.name
            )));
        }
        let job = self.start_job(NewJob {
            kind: "restore",
            volume: &req.name,
            target: &req.target,
            backup: &req.backup,
            exclusive_volume: true,
            snapshot: Some(&m.snapshot),
            replica: req.replica,
        })?;
        self.spawn_job(&job, "lull-restore", move |me, j| {
            me.run_restore(j, &t, &req, &m)
        })
    }

    /// A restore writes into a replica only while nothing else can have:
    /// created and never attached (generation 0, no engine session, no
    /// snapshot), at least the backup's size.
    fn check_new_replica(&self, name: &str, size_bytes: u64) -> Result<(), BackupError> {
        let info = self
            .control
            .replica_get(name)
            .map_err(|e| BackupError::Volume(format!("replica {name:?}: {e}")))?;
        let new = info["generation"].as_u64() == Some(0)
            && info["held_by_session"].is_null()
            && info["snapshots"].as_array().is_some_and(|s| s.is_empty());
        if !new {
            return Err(BackupError::Volume(format!(
                "replica {name:?} is not new (generation {}, session {}, snapshots {}): a restore fills only a replica no engine has attached",
                info["generation"], info["held_by_session"], info["snapshots"]
            )));
        }
        let have = info["size_bytes"].as_u64().unwrap_or(0);
        if have < size_bytes {
            return Err(BackupError::Volume(format!(
                "replica {name:?} is {have} bytes, smaller than the backup's {size_bytes}"
            )));
        }
        Ok(())
    }

    fn run_restore(
        &self,
        job: &Job,
        t: &Target,
        req: &RestoreRequest,
        m: &Manifest,
    ) -> Result<Value, BackupError> {
        let started = Instant::now();
        if req.replica {
            // A failed fill stays for the retry to write again: the
            // replica is its caller's, and nothing has attached it.
            let dev = self
                .control
                .replica_device(&req.name)
                .map_err(|e| BackupError::Volume(format!("replica {:?}: {e}", req.name)))?;
            return self.restore_into(job, t, req, m, dev, started);
        }
        let new = lull_rpc::NewVolume {
            name: req.name.clone(),
            size_bytes: m.size_bytes,
            backend: req.backend.clone(),
            persist: req.persist,
            ..Default::default()
        };
        self.control
            .volume_create(&new)
            .map_err(|e| BackupError::Volume(format!("volume {:?}: {e}", req.name)))?;
        let r = self
            .volumes
            .named(&req.name)
            .map_err(|e| BackupError::Volume(e.to_string()))
            .and_then(|v| self.restore_into(job, t, req, m, storage_dev(&v.storage), started));
        if r.is_err() {
            // Nothing half-restored stays behind under the name.
            let name = lull_rpc::VolumeName {
                name: req.name.clone(),
            };
            if let Err(e) = self.control.volume_delete(&name) {
                tracing::error!(volume = req.name, error = %e, "a failed restore's volume could not be deleted");
            }
        }
        r
    }

    fn restore_into(
        &self,
        job: &Job,
        t: &Target,
        req: &RestoreRequest,
        m: &Manifest,
        dev: Arc<dyn lull_bdev::BlockDevice>,
        started: Instant,
    ) -> Result<Value, BackupError> {
        let mut io = DevIo::open(dev)?;
        job.progress
            .total_bytes
            .store(m.size_bytes, Ordering::Relaxed);
        let wanted: Vec<usize> = (0..m.chunks.len())
            .filter(|&i| m.chunks[i].is_some())
            .collect();
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(usize, Vec<u8>)>(CHUNKS_IN_FLIGHT);
        let fetch = {
            let (t, m) = (t.clone(), Arc::new(m.clone()));
            self.rt.spawn(async move {
                let mut s = futures::stream::iter(wanted)
                    .map(|i| {
                        let (t, m) = (t.clone(), m.clone());
                        async move { fetch_chunk(&t, &m, i).await.map(|d| (i, d)) }
                    })
                    .buffered(CHUNKS_IN_FLIGHT);
                while let Some(r) = s.next().await {
                    let (i, Some(d)) = r? else {
                        continue; // zeros: none is asked for
                    };
                    if tx.send((i, d)).await.is_err() {
                        break;
                    }
                }
                Ok::<(), BackupError>(())
            })
        };
        let mut written = 0u64;
        let mut write_error = None;
        while let Some((i, data)) = rx.blocking_recv() {
            let (off, len) = m.chunk_range(i);
            if let Err(e) = io.write(off, &data) {
                write_error = Some(BackupError::from(e));
                break;
            }
            written += len;
            job.progress.done_bytes.store(off + len, Ordering::Relaxed);
            job.progress.sent_bytes.store(written, Ordering::Relaxed);
        }
        drop(rx);
        let fetched = self
            .rt
            .block_on(fetch)
            .map_err(|e| BackupError::Failed(format!("fetch task: {e}")))?;
        if let Some(e) = write_error {
            return Err(e);
        }
        fetched?;
        io.flush()?;
        job.progress
            .done_bytes
            .store(m.size_bytes, Ordering::Relaxed);
        tracing::info!(volume = req.name, target = %t.config.name, backup = m.id,
            bytes = written, "restore complete");
        Ok(json!({
            "volume": req.name,
            "backup": m.id,
            "size_bytes": m.size_bytes,
            "bytes_written": written,
            "duration_ms": started.elapsed().as_millis() as u64,
        }))
    }

    /// Starts a verify of a backup: every chunk it names fetched, decoded
    /// and hashed again.
    pub fn verify(self: &Arc<Self>, target: &str, backup: &str) -> Result<JobInfo, BackupError> {
        let t = self.target(target)?;
        let m = self.rt.block_on(catalog::manifest(&t, backup))?;
        let job = self.start_job(NewJob {
            kind: "verify",
            volume: &m.volume,
            target,
            backup,
            exclusive_volume: false,
            snapshot: Some(&m.snapshot),
            replica: false,
        })?;
        self.spawn_job(&job, "lull-verify", move |me, j| {
            me.rt.block_on(verify_chunks(&t, &m, &j.progress))
        })
    }
}

/// The volume's device as an `Arc`, to open a channel on a job's thread.
pub(crate) fn storage_dev(s: &lull_volume::Storage) -> Arc<dyn lull_bdev::BlockDevice> {
    match s {
        lull_volume::Storage::Local(d) => d.clone(),
        lull_volume::Storage::Replicated(d) => d.clone(),
        lull_volume::Storage::Layered(d) => d.clone(),
    }
}

/// What `backup_create`'s job reports when done.
pub fn summary(m: &Manifest) -> Value {
    json!({
        "id": m.id,
        "volume": m.volume,
        "snapshot": m.snapshot,
        "size_bytes": m.size_bytes,
        "created_unix_ms": m.created_unix_ms,
        "parent": m.parent,
        "schedule": m.schedule,
        "chunks": m.chunks.len(),
        "stats": m.stats,
    })
}

/// Which chunks of a device hold allocated blocks (the others are zeros,
/// never read).
fn allocated_chunks(io: &mut DevIo, size: u64) -> Result<Vec<bool>, BackupError> {
    let mut allocated = vec![false; size.div_ceil(CHUNK_BYTES) as usize];
    let mut at = 0u64;
    for e in io.extents(0, size)? {
        if !(e.hole || e.zero) {
            let first = (at / CHUNK_BYTES) as usize;
            let last = ((at + e.length_bytes - 1) / CHUNK_BYTES) as usize;
            for a in allocated.iter_mut().take(last + 1).skip(first) {
                *a = true;
            }
        }
        at += e.length_bytes;
    }
    Ok(allocated)
}

impl BackupStats {
    /// Counts how a chunk went to the target.
    fn count(&mut self, s: &StoredChunk) {
        match (&s.patch, s.sent) {
            (_, None) => self.chunks_deduplicated += 1,
            (Some(_), Some(_)) => self.chunks_patched += 1,
            (None, Some(_)) => self.chunks_uploaded += 1,
        }
        self.bytes_uploaded += s.sent.unwrap_or(0);
    }
}

/// Stores the chunks a backup reads, [`CHUNKS_IN_FLIGHT`] at once.
async fn upload_chunks(
    t: Target,
    rx: tokio::sync::mpsc::Receiver<ReadChunk>,
    known: Arc<Known>,
    limiter: Arc<Limiter>,
    progress: Arc<Progress>,
) -> Result<Vec<StoredChunk>, BackupError> {
    let stream =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|w| (w, rx)) });
    stream
        .map(|chunk| {
            let (t, known, limiter, progress) =
                (t.clone(), known.clone(), limiter.clone(), progress.clone());
            async move { chunks::store_chunk(&t, chunk, &known, &limiter, &progress.sent_bytes).await }
        })
        .buffer_unordered(CHUNKS_IN_FLIGHT)
        .try_collect()
        .await
}

/// Checks every chunk a manifest names; the result names the bad ones.
async fn verify_chunks(
    t: &Target,
    m: &Manifest,
    progress: &Progress,
) -> Result<Value, BackupError> {
    // Whole chunks once per name; a patched chunk each (its base, its
    // patch and what they make).
    let mut whole: BTreeMap<&str, (usize, Vec<usize>)> = BTreeMap::new();
    let mut patched = Vec::new();
    for (i, c) in m.chunks.iter().enumerate() {
        match c {
            Some(_) if m.patches.contains_key(&i) => patched.push(i),
            Some(c) => {
                let len = m.chunk_range(i).1 as usize;
                whole.entry(c).or_insert((len, Vec::new())).1.push(i);
            }
            None => {}
        }
    }
    progress.total_bytes.store(m.size_bytes, Ordering::Relaxed);
    let per_chunk = m.size_bytes / (m.chunks.len().max(1) as u64);
    let work = whole
        .into_iter()
        .map(|(name, (len, at))| (Some((name, len)), at))
        .chain(patched.into_iter().map(|i| (None, vec![i])));
    let checked: Vec<(Vec<usize>, Result<(), BackupError>)> = futures::stream::iter(work)
        .map(|(whole, at)| async move {
            let r = match whole {
                Some((name, len)) => fetch_object(t, name, len).await.map(|_| ()),
                None => fetch_chunk(t, m, at[0]).await.map(|_| ()),
            };
            progress
                .done_bytes
                .fetch_add(per_chunk * at.len() as u64, Ordering::Relaxed);
            (at, r)
        })
        .buffer_unordered(CHUNKS_IN_FLIGHT)
        .collect()
        .await;
    let mut bad = Vec::new();
    for (at, r) in &checked {
        match r {
            Ok(()) => {}
            Err(BackupError::BadChunk { chunk, why }) => {
                bad.push(json!({"chunk": chunk, "indexes": at, "error": why}))
            }
            Err(e) => return Err(BackupError::Failed(format!("verify of {}: {e}", m.id))),
        }
    }
    progress.done_bytes.store(m.size_bytes, Ordering::Relaxed);
    if !bad.is_empty() {
        tracing::error!(target = %t.config.name, backup = m.id, bad = bad.len(), "backup verify found bad chunks");
        // The job fails, naming them (the first few in the message).
        let named: Vec<String> = bad
            .iter()
            .take(VERIFY_NAMED_MAX)
            .map(|b| {
                format!(
                    "{} (chunk {}: {})",
                    b["chunk"].as_str().unwrap_or(""),
                    b["indexes"],
                    b["error"].as_str().unwrap_or("")
                )
            })
            .collect();
        return Err(BackupError::Corrupt(format!(
            "backup {}: {} of {} chunks bad: {}{}",
            m.id,
            bad.len(),
            checked.len(),
            named.join("; "),
            if bad.len() > VERIFY_NAMED_MAX {
                "; ..."
            } else {
                ""
            }
        )));
    }
    Ok(json!({
        "backup": m.id,
        "ok": bad.is_empty(),
        "chunks_checked": checked.len(),
        "bad_chunks": bad,
    }))
}
