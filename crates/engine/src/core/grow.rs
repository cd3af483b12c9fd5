//! Growing a replicated volume online: GROW on every replica, then the
//! engine's own size.
//!
//! As a snapshot operation does (`snapshot`), a grow holds new writes
//! (trims and zeroing too) and lets those in flight finish, then sends
//! GROW to every healthy replica at once; reads go on. Once all have
//! answered, the volume takes the new size (its write-intent regions
//! with it) and writes go again, so no write past the old end reaches a
//! replica that has not grown.
//!
//! It needs every replica of the volume healthy, as a snapshot does: a
//! replica away or being rebuilt would come back at the old size. (One
//! that does is refused at HELLO, "size mismatch", and is never taken as
//! healthy: grow it, or replace it.) A replica that fails or refuses GROW
//! while its peers take it leaves the healthy set for the same reason;
//! when none takes it the size stays. Shrinking is refused, and so are a
//! size that is not a multiple of [`proto::GROW_ALIGN_BYTES`] and one that
//! would change the region sizes ([`proto::grow_keeps_regions`]).

use lull_proto::replica::{self as proto, Header, Kind};

use super::ids::{ReplicaId, ReplicaSet};
use super::types::{
    ControlOutcome, Engine, GrowJob, LogLevel, Payload, Region, SnapshotStep, SubKind,
};

impl Engine {
    /// Starts a grow to `size_bytes`; its outcome goes out as
    /// [`super::Action::ControlDone`] with `token` (the volume's size
    /// then, or why not).
    pub(super) fn start_grow(&mut self, token: u64, size_bytes: u64) {
        if let Err(why) = self.grow_refusal(size_bytes) {
            self.log(
                LogLevel::Warn,
                format!("grow to {size_bytes} bytes refused: {why}"),
            );
            return self.grow_done(token, Err(why));
        }
        if size_bytes == self.size_bytes {
            return self.grow_done(token, Ok(size_bytes));
        }
        self.log(
            LogLevel::Info,
            format!(
                "grow from {} to {size_bytes} bytes: holding new writes until every replica answers",
                self.size_bytes
            ),
        );
        self.grow = Some(GrowJob {
            token,
            size_bytes,
            step: SnapshotStep::Draining,
            started_ns: self.now,
            errors: Vec::new(),
            took: ReplicaSet::EMPTY,
        });
    }

    /// Why a grow to `size_bytes` cannot start now, in words.
    fn grow_refusal(&self, size_bytes: u64) -> Result<(), String> {
        if size_bytes < self.size_bytes {
            return Err(format!(
                "cannot shrink the volume from {} to {size_bytes} bytes: only growing is supported",
                self.size_bytes
            ));
        }
        if size_bytes == self.size_bytes {
            return Ok(());
        }
        if !size_bytes.is_multiple_of(proto::GROW_ALIGN_BYTES) || size_bytes > proto::MAX_GROW_BYTES
        {
            return Err(format!(
                "the size must be a multiple of {} bytes and at most {}",
                proto::GROW_ALIGN_BYTES,
                proto::MAX_GROW_BYTES
            ));
        }
        if !proto::grow_keeps_regions(self.size_bytes, size_bytes) {
            return Err(format!(
                "growing from {} to {size_bytes} bytes would change the write-intent or change-record region size: a replicated volume grows within 64 GiB, or within the power of two above its size",
                self.size_bytes
            ));
        }
        if self.grow.is_some() {
            return Err("another grow of this volume is running".into());
        }
        if self.snapshot.is_some() {
            return Err("a snapshot operation of this volume is running: try again".into());
        }
        if self.detach.is_some() {
            return Err("the volume is detaching".into());
        }
        self.every_replica_healthy(
            "a replicated volume grows only with every replica healthy (one away would come back at the old size)",
        )
    }

    /// Whether writes wait for a grow.
    pub(super) fn grow_holds_writes(&self) -> bool {
        self.grow.is_some()
    }

    /// Moves the grow on: once the writes in flight have finished, GROW
    /// goes to every healthy replica; once all have answered, the size.
    pub(super) fn progress_grow(&mut self) {
        let Some((draining, answered)) = self.grow.as_ref().map(|job| job.step.progress()) else {
            return;
        };
        if draining {
            if !self.writes_settled() {
                return;
            }
            let healthy = self.healthy_set();
            if healthy.is_empty() {
                let Some(job) = self.grow.take() else {
                    return;
                };
                return self.grow_done(job.token, Err("no healthy replica is left".into()));
            }
            if healthy.iter().any(|r| self.pick_conn(r).is_none()) {
                return;
            }
            let Some(size) = self.grow.as_ref().map(|j| j.size_bytes) else {
                return;
            };
            let mut sent = ReplicaSet::EMPTY;
            for r in healthy.iter() {
                if self.send_any(r, SubKind::Grow, Kind::Grow, size, 0, Payload::None) {
                    sent.insert(r);
                }
            }
            if let Some(job) = self.grow.as_mut() {
                job.step = SnapshotStep::Sent(sent);
            }
            return self.progress_grow();
        }
        if !answered {
            return;
        }
        let Some(job) = self.grow.take() else {
            return;
        };
        let took_ms = self.now.saturating_sub(job.started_ns) / 1_000_000;
        if job.took.is_empty() {
            let why = if job.errors.is_empty() {
                "every replica it went to failed before answering".to_string()
            } else {
                job.errors.join("; ")
            };
            self.log(
                LogLevel::Warn,
                format!("grow to {} bytes failed: {why}", job.size_bytes),
            );
            return self.grow_done(job.token, Err(why));
        }
        // The replicas that took it have the new size: so does the volume.
        let old = self.size_bytes;
        self.size_bytes = job.size_bytes;
        let regions = job.size_bytes.div_ceil(self.region_bytes) as usize;
        debug_assert!(regions <= proto::MAX_INTENT_REGIONS as usize);
        self.regions
            .resize(regions.max(self.regions.len()), Region::default());
        // A healthy replica that did not grow is at the old size: it
        // leaves the healthy set, and is refused at HELLO until grown.
        for r in self.healthy_set().iter() {
            if !job.took.contains(r) {
                self.fail_replica(
                    r,
                    &format!(
                        "it did not grow to {} bytes as its peers did",
                        job.size_bytes
                    ),
                    false,
                );
            }
        }
        let level = if job.errors.is_empty() {
            LogLevel::Info
        } else {
            LogLevel::Warn
        };
        self.log(
            level,
            format!(
                "grown from {old} to {} bytes on {} replica(s) in {took_ms} ms; writes go on{}",
                job.size_bytes,
                job.took.len(),
                if job.errors.is_empty() {
                    String::new()
                } else {
                    format!(" (failed: {})", job.errors.join("; "))
                }
            ),
        );
        self.grow_done(job.token, Ok(job.size_bytes));
    }

    pub(super) fn on_grow_reply(&mut self, r: ReplicaId, h: Header) {
        let addr = self.replicas[r].addr.clone();
        let Some(job) = self.grow.as_mut() else {
            return;
        };
        let SnapshotStep::Sent(waiting) = &mut job.step else {
            return;
        };
        waiting.remove(r);
        let errno = h.status as i32;
        if errno == 0 {
            job.took.insert(r);
            return;
        }
        let what = match errno {
            libc::EINVAL => "it refused the size".to_string(),
            libc::EBUSY => "a snapshot is being merged (deleted) there".to_string(),
            libc::EOPNOTSUPP => "its chain cannot grow (a clone not flattened?)".to_string(),
            e => format!("errno {e}"),
        };
        job.errors.push(format!("replica {addr}: {what}"));
    }

    /// A GROW of replica `r` ended without a reply, or the replica left.
    pub(super) fn grow_sub_failed(&mut self, r: ReplicaId) {
        let addr = self.replicas[r].addr.clone();
        if let Some(job) = self.grow.as_mut() {
            if let SnapshotStep::Sent(waiting) = &mut job.step {
                if waiting.contains(r) {
                    waiting.remove(r);
                    job.errors
                        .push(format!("replica {addr}: it failed before answering"));
                }
            }
        }
    }

    fn grow_done(&mut self, token: u64, outcome: Result<u64, String>) {
        self.out.push(super::types::Action::ControlDone {
            token,
            outcome: ControlOutcome::Grow(outcome),
        });
    }
}
