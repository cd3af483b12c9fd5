//! The layer sync job (`core::layers`): on a helper thread ("lull-layers"),
//! with the blocking client (`crate::client`), copy to a stale replica the
//! snapshots a healthy one holds and it lacks, oldest first, then answer
//! the core with `Event::LayersSynced`.
//!
//! ```text
//! source [s1 s2 s3 s4] head     target [s1 s2] head'
//!   1. target: SNAPSHOT revert s2          (its live data is s2's again)
//!   2. for s3, s4: CHANGED since the one below, on a view of the source's
//!      snapshot; READ those runs from the view, WRITE them to the
//!      target; FLUSH; SNAPSHOT create under the same name
//! ```
//!
//! With no snapshot in common the target's live data is trimmed first and
//! the first snapshot's data blocks (BLOCK_STATUS on its view) are copied.
//! A clone's inherited snapshots (its base, shared with its origin) are
//! neither compared nor copied: a snapshot's view reads the base's blocks
//! as its own, so a replica without the base gets them in its first
//! snapshot (or the rebuild).
//! A snapshot being merged away on the source (a delete running) is not
//! copied; the next one's CHANGED covers its blocks. A target holding
//! snapshots its source lacks below the first they share is not touched
//! (the job says so and the rebuild goes on without the layers); newer
//! ones go with the revert.
//!
//! The source is read with session 0 (a tool: it takes nothing over), the
//! target written with the engine's session (its writes are fenced with
//! the engine's). Data moves one chunk at a time: this copies what a
//! replica missed, a fraction of the volume, and the rebuild that follows
//! is the pipelined copy.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lull_proto::replica::{
    self as proto, Hello, Kind, SnapshotOp, SnapshotRecord, SnapshotRequest, STATUS_CHANGED,
    STATUS_HOLE,
};

use super::{lock, Shell};
use crate::client::Client;
use crate::core::ids::ReplicaId;
use crate::core::{Event, LayerSyncError, LayersCopied, ReplicaTarget, SNAPSHOT_EXTRA_TIMEOUT_NS};

/// Bytes read from the source and written to the target per request.
pub const LAYER_COPY_CHUNK_BYTES: u64 = 1 << 20;

/// Range asked per CHANGED or BLOCK_STATUS request (the reply covers a
/// prefix of it); 1 GiB fits the protocol's u32 lengths.
const LAYER_SCAN_BYTES: u64 = 1 << 30;

/// Largest TRIM sent: TRIM carries a u32 length.
const LAYER_TRIM_BYTES: u64 = 1 << 30;

/// What one job needs, owned by its thread.
struct Job {
    volume: String,
    source: ReplicaTarget,
    target: ReplicaTarget,
    session: u64,
    size_bytes: u64,
    tls: Option<lull_net::tls::TlsContext>,
    timeout: Duration,
    /// Set when the engine no longer wants it (its replica failed): it
    /// stops before its next request.
    stop: Arc<AtomicBool>,
}

impl Shell {
    /// Starts the layer sync of `replica` (`Action::SyncLayers`); its
    /// outcome comes back to the core as `Event::LayersSynced`.
    pub(super) fn sync_layers(
        &mut self,
        replica: ReplicaId,
        token: u64,
        source: ReplicaTarget,
        target: ReplicaTarget,
        session: u64,
    ) {
        let (Some(me), Some(shell)) = (self.me.clone(), self.this.upgrade()) else {
            return;
        };
        let stop = Arc::new(AtomicBool::new(false));
        self.layer_jobs.push((token, stop.clone()));
        let job = Job {
            stop,
            volume: self.volume.clone(),
            source,
            target,
            session,
            size_bytes: self.core.size_bytes(),
            tls: self.tls.clone(),
            timeout: Duration::from_millis(self.opts.replica_timeout_ms),
        };
        let spawned = std::thread::Builder::new()
            .name("lull-layers".into())
            .spawn(move || {
                let mut touched = false;
                let result = job
                    .run(&mut touched)
                    .map_err(|why| LayerSyncError { why, touched });
                let _ = me.send(move |t| {
                    let now = t.now_ns();
                    let event = Event::LayersSynced {
                        replica,
                        token,
                        result,
                    };
                    let mut shell = lock(&shell);
                    shell.layer_jobs.retain(|(t, _)| *t != token);
                    shell.run(t, event, now);
                });
            });
        if let Err(e) = spawned {
            self.layer_jobs.retain(|(t, _)| *t != token);
            self.followups.push_back(Event::LayersSynced {
                replica,
                token,
                result: Err(LayerSyncError {
                    why: format!("cannot start the layer copy thread: {e}"),
                    touched: false,
                }),
            });
        }
    }
}

impl Shell {
    /// Tells the layer sync job `token` to stop (`Action::StopLayerSync`).
    pub(super) fn stop_layer_sync(&mut self, token: u64) {
        if let Some((_, stop)) = self.layer_jobs.iter().find(|(t, _)| *t == token) {
            stop.store(true, Ordering::SeqCst);
        }
    }
}

impl Job {
    /// `Err` once the engine asked the job to stop.
    fn go_on(&self) -> Result<(), String> {
        if self.stop.load(Ordering::SeqCst) {
            return Err("stopped: the replica failed".into());
        }
        Ok(())
    }

    fn hello(&self, session: u64) -> Hello {
        Hello {
            volume_size: self.size_bytes,
            generation: 0,
            flags: 0,
            session,
        }
    }

    fn connect(&self, target: &ReplicaTarget, session: u64, name: &str) -> Result<Client, String> {
        // A SNAPSHOT on the target syncs and may wait for a quiesce.
        let timeout = if session == 0 {
            self.timeout
        } else {
            self.timeout + Duration::from_nanos(SNAPSHOT_EXTRA_TIMEOUT_NS)
        };
        Client::connect(
            target.addr,
            self.tls.as_ref(),
            timeout,
            &self.hello(session),
            name,
        )
        .map_err(|e| format!("replica {target} ({name:?}): {e}"))
    }

    /// The job; `touched` is set once it has changed the target.
    fn run(&self, touched: &mut bool) -> Result<LayersCopied, String> {
        let mut src = self.connect(&self.source, 0, self.source.hello_name())?;
        let mut dst = self.connect(&self.target, self.session, self.target.hello_name())?;
        let theirs = snapshot_list(&mut src)?;
        // A clone's inherited snapshots are its base, shared with its
        // origin, not copied: a replica cloned from the same snapshot has
        // them, a flattened one or a new one reads their blocks as its own.
        let ours: Vec<String> = snapshot_list(&mut dst)?
            .into_iter()
            .filter(|s| !s.inherited)
            .map(|s| s.name)
            .collect();
        // A snapshot being merged away is on its way out: not copied.
        let wanted: Vec<String> = theirs
            .into_iter()
            .filter(|s| s.merge_total == 0 && !s.inherited)
            .map(|s| s.name)
            .collect();
        let k = wanted.iter().zip(&ours).take_while(|(a, b)| a == b).count();
        if k == wanted.len() {
            if ours.len() > k {
                tracing::warn!(volume = %self.volume, replica = %self.target, extra = ?&ours[k..],
                    "the replica holds snapshots its source does not (an operation a crash cut); they are left");
            }
            return Ok(LayersCopied::default());
        }
        tracing::info!(volume = %self.volume, replica = %self.target, source = %self.source,
            missing = ?&wanted[k..], "copying the snapshots the replica lacks");
        if k > 0 {
            *touched = true;
            snapshot(&mut dst, SnapshotOp::Revert, &wanted[k - 1])?;
        } else if !ours.is_empty() {
            return Err(format!(
                "it holds snapshots its source does not ({ours:?}) and none in common with it: they are left, and the source's are not copied"
            ));
        } else {
            *touched = true;
            self.trim_all(&mut dst)?;
        }
        let mut copied = LayersCopied::default();
        for i in k..wanted.len() {
            self.go_on()?;
            let name = &wanted[i];
            let view_name = proto::view_hello_name(self.source.hello_name(), name);
            let mut view = self.connect(&self.source, 0, &view_name)?;
            let below = i.checked_sub(1).map(|b| wanted[b].as_str());
            copied.bytes += self.copy_layer(&mut view, &mut dst, below)?;
            expect_ok(dst.request(Kind::Flush, 0, 0, &[]), "FLUSH")?;
            snapshot(&mut dst, SnapshotOp::Create, name)?;
            copied.layers += 1;
            tracing::info!(volume = %self.volume, replica = %self.target, snapshot = %name,
                bytes = copied.bytes, "snapshot copied");
        }
        Ok(copied)
    }

    /// Writes to `dst` the blocks of `view`'s snapshot that changed since
    /// `below` (all its data when `None`); returns the bytes written.
    fn copy_layer(
        &self,
        view: &mut Client,
        dst: &mut Client,
        below: Option<&str>,
    ) -> Result<u64, String> {
        let mut pos = 0;
        let mut bytes = 0;
        while pos < self.size_bytes {
            let len = (self.size_bytes - pos).min(LAYER_SCAN_BYTES) as u32;
            let runs = match below {
                Some(since) => changed(view, pos, len, since)?,
                None => data_runs(view, pos, len)?,
            };
            let covered: u64 = runs.iter().map(|&(l, _)| l).sum();
            if runs.is_empty() || covered > u64::from(len) {
                return Err(format!(
                    "the source's map of [{pos}, +{len}) covers {covered} bytes"
                ));
            }
            for (l, copy) in runs {
                if copy {
                    self.go_on()?;
                    copy_range(view, dst, pos, l)?;
                    bytes += l;
                }
                pos += l;
            }
        }
        Ok(bytes)
    }

    fn trim_all(&self, dst: &mut Client) -> Result<(), String> {
        let mut pos = 0;
        while pos < self.size_bytes {
            let len = (self.size_bytes - pos).min(LAYER_TRIM_BYTES);
            expect_ok(dst.request(Kind::Trim, pos, len as u32, &[]), "TRIM")?;
            pos += len;
        }
        Ok(())
    }
}

/// A reply's status as a result, naming the request.
fn expect_ok(
    reply: Result<(proto::Header, Vec<u8>), String>,
    what: &str,
) -> Result<Vec<u8>, String> {
    let (h, data) = reply?;
    if h.status != 0 {
        return Err(format!(
            "{what} failed: {}",
            std::io::Error::from_raw_os_error(h.status as i32)
        ));
    }
    Ok(data)
}

fn snapshot_list(c: &mut Client) -> Result<Vec<SnapshotRecord>, String> {
    let data = expect_ok(c.request(Kind::SnapshotList, 0, 0, &[]), "SNAPSHOT_LIST")?;
    proto::decode_snapshot_list(&data).map_err(|e| format!("bad SNAPSHOT_LIST reply: {e}"))
}

fn snapshot(c: &mut Client, op: SnapshotOp, name: &str) -> Result<(), String> {
    let payload = proto::encode_snapshot_request(&SnapshotRequest {
        op,
        name: name.to_string(),
    })
    .map_err(|e| e.to_string())?;
    expect_ok(
        c.request(Kind::Snapshot, 0, payload.len() as u32, &payload),
        &format!("SNAPSHOT {op:?} {name:?}"),
    )
    .map(|_| ())
}

/// CHANGED since `since` over a prefix of `[pos, +len)`: (length, changed).
fn changed(view: &mut Client, pos: u64, len: u32, since: &str) -> Result<Vec<(u64, bool)>, String> {
    let payload = proto::encode_changed_request(&proto::ChangedRequest {
        length: len,
        since: since.to_string(),
    })
    .map_err(|e| e.to_string())?;
    let data = expect_ok(
        view.request(Kind::Changed, pos, payload.len() as u32, &payload),
        "CHANGED",
    )?;
    let ext = proto::decode_block_status(&data).map_err(|e| format!("bad CHANGED reply: {e}"))?;
    Ok(ext
        .iter()
        .map(|e| (e.length, e.flags & STATUS_CHANGED != 0))
        .collect())
}

/// BLOCK_STATUS over a prefix of `[pos, +len)`: (length, holds data).
fn data_runs(view: &mut Client, pos: u64, len: u32) -> Result<Vec<(u64, bool)>, String> {
    let data = expect_ok(
        view.request(Kind::BlockStatus, pos, len, &[]),
        "BLOCK_STATUS",
    )?;
    let ext =
        proto::decode_block_status(&data).map_err(|e| format!("bad BLOCK_STATUS reply: {e}"))?;
    Ok(ext
        .iter()
        .map(|e| (e.length, e.flags & STATUS_HOLE == 0))
        .collect())
}

/// READ `[pos, +len)` from the view and WRITE it to the target, a chunk at
/// a time.
fn copy_range(view: &mut Client, dst: &mut Client, pos: u64, len: u64) -> Result<(), String> {
    let mut at = pos;
    while at < pos + len {
        let n = (pos + len - at).min(LAYER_COPY_CHUNK_BYTES) as u32;
        let data = expect_ok(view.request(Kind::Read, at, n, &[]), "READ")?;
        if data.len() != n as usize {
            return Err(format!("READ of {n} bytes answered {}", data.len()));
        }
        expect_ok(dst.request(Kind::Write, at, n, &data), "WRITE")?;
        at += u64::from(n);
    }
    Ok(())
}
