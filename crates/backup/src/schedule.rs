//! Recurring backups: a schedule per volume and target (every
//! `interval_secs`), with retention (keep the last N, or those younger
//! than an age) over the backups the schedule made; recorded under the
//! node's store and resumed after a restart.
//!
//! ```text
//! lull rpc backup_schedule_set '{"volume": "vol0", "target": "s3", "interval_secs": 3600, "keep_last": 24}'
//! ```
//!
//! One thread ("lull-backup-cron") looks at the schedules every
//! [`SCHEDULE_TICK`]: a due schedule whose volume is on this node starts
//! a backup (a schedule never overlaps itself: the next is due an
//! interval after the last one ended); when it ends, retention deletes
//! the schedule's backups past what it keeps, then collects garbage.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::catalog::{self, now_unix_ms};
use crate::job::{BackupRequest, JobState};
use crate::{lock, BackupError, Backups};

/// How often the schedules are looked at.
pub const SCHEDULE_TICK: Duration = Duration::from_secs(1);

/// Shortest interval: one tick (a schedule shorter than its backups takes
/// simply runs them back to back, never two at once).
pub const MIN_SCHEDULE_INTERVAL_SECS: u64 = 1;

/// Longest interval: a year.
pub const MAX_SCHEDULE_INTERVAL_SECS: u64 = 366 * 24 * 3600;

/// Schedules per node.
pub const MAX_SCHEDULES: usize = 256;

/// The file under the node's state directory that records schedules.
pub const SCHEDULE_FILE: &str = "backup-schedules.json";

/// A recurring backup, as `backup_schedule_set` takes it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    pub volume: String,
    pub target: String,
    pub interval_secs: u64,
    /// Keep this schedule's newest N backups (at least 1).
    #[serde(default)]
    pub keep_last: Option<u64>,
    /// Keep this schedule's backups younger than this. With `keep_last`
    /// too, a backup either keeps is kept; with neither, all are.
    #[serde(default)]
    pub keep_within_secs: Option<u64>,
    #[serde(default)]
    pub bandwidth_mbytes_per_sec: u64,
    /// When its last backup ended (recorded, so a restart keeps the pace).
    #[serde(default)]
    pub last_unix_ms: Option<u64>,
}

impl Schedule {
    /// What its backups' manifests say made them.
    pub fn id(&self) -> String {
        format!("{}@{}", self.volume, self.target)
    }

    pub fn check(&self) -> Result<(), BackupError> {
        if !(MIN_SCHEDULE_INTERVAL_SECS..=MAX_SCHEDULE_INTERVAL_SECS).contains(&self.interval_secs)
        {
            return Err(BackupError::Config(format!(
                "interval_secs: {MIN_SCHEDULE_INTERVAL_SECS} to {MAX_SCHEDULE_INTERVAL_SECS}"
            )));
        }
        if self.keep_last == Some(0) {
            return Err(BackupError::Config(
                "keep_last: at least 1 (the newest backup is the next one's base)".into(),
            ));
        }
        Ok(())
    }

    fn due(&self, now_ms: u64) -> bool {
        self.last_unix_ms
            .is_none_or(|l| now_ms >= l.saturating_add(self.interval_secs * 1000))
    }
}

/// A schedule and the job it runs now.
#[derive(Debug, Clone)]
pub(crate) struct Scheduled {
    pub(crate) schedule: Schedule,
    running: Option<String>,
}

type Key = (String, String);

impl Backups {
    pub(crate) fn load_schedules(&self) -> Result<(), BackupError> {
        let list: Vec<Schedule> = self.read_state(SCHEDULE_FILE)?;
        let mut s = lock(&self.schedules);
        for schedule in list {
            let key = (schedule.volume.clone(), schedule.target.clone());
            s.insert(
                key,
                Scheduled {
                    schedule,
                    running: None,
                },
            );
        }
        Ok(())
    }

    fn save_schedules(&self, s: &BTreeMap<Key, Scheduled>) -> Result<(), BackupError> {
        let list: Vec<&Schedule> = s.values().map(|x| &x.schedule).collect();
        self.write_state(
            SCHEDULE_FILE,
            &serde_json::to_vec_pretty(&list).expect("schedules serialize"),
        )
    }

    /// Sets (or replaces) the schedule of a volume to a target.
    pub fn schedule_set(&self, mut schedule: Schedule) -> Result<(), BackupError> {
        schedule.check()?;
        self.target(&schedule.target)?;
        self.volumes
            .named(&schedule.volume)
            .map_err(|e| BackupError::Volume(e.to_string()))?;
        let mut s = lock(&self.schedules);
        let key = (schedule.volume.clone(), schedule.target.clone());
        let old = s.get(&key).cloned();
        if old.is_none() && s.len() >= MAX_SCHEDULES {
            return Err(BackupError::Config(format!(
                "this node has {MAX_SCHEDULES} backup schedules already"
            )));
        }
        schedule.last_unix_ms = old.as_ref().and_then(|o| o.schedule.last_unix_ms);
        let running = old.and_then(|o| o.running);
        s.insert(key.clone(), Scheduled { schedule, running });
        if let Err(e) = self.save_schedules(&s) {
            s.remove(&key);
            return Err(e);
        }
        tracing::info!(volume = key.0, target = key.1, "backup schedule set");
        Ok(())
    }

    pub fn schedule_remove(&self, volume: &str, target: &str) -> Result<(), BackupError> {
        let mut s = lock(&self.schedules);
        let key = (volume.to_string(), target.to_string());
        let Some(old) = s.remove(&key) else {
            return Err(BackupError::Config(format!(
                "no backup schedule of volume {volume:?} to target {target:?}"
            )));
        };
        if let Err(e) = self.save_schedules(&s) {
            s.insert(key, old);
            return Err(e);
        }
        Ok(())
    }

    pub fn schedule_list(&self) -> Vec<Schedule> {
        lock(&self.schedules)
            .values()
            .map(|s| s.schedule.clone())
            .collect()
    }

    /// Starts the thread that runs the schedules; it ends with the last
    /// `Arc` of the node's backups.
    pub(crate) fn start_cron(self: &Arc<Self>) -> Result<(), BackupError> {
        let me: Weak<Backups> = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("lull-backup-cron".into())
            .spawn(move || loop {
                std::thread::sleep(SCHEDULE_TICK);
                match me.upgrade() {
                    Some(b) => {
                        b.tick();
                        b.follow_standbys();
                    }
                    None => return,
                }
            })
            .map(|_| ())
            .map_err(|e| BackupError::Failed(format!("schedule thread: {e}")))
    }

    fn tick(self: &Arc<Self>) {
        let now = now_unix_ms();
        let list: Vec<(Key, Scheduled)> = lock(&self.schedules)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (key, sc) in list {
            if let Some(job) = &sc.running {
                let state = self.job(job).map(|j| j.state);
                if matches!(state, Some(JobState::Running)) {
                    continue;
                }
                self.ended(&key, matches!(state, Some(JobState::Done)), &sc.schedule);
                continue;
            }
            if !sc.schedule.due(now) || self.volumes.named(&key.0).is_err() {
                continue;
            }
            let req = BackupRequest {
                volume: key.0.clone(),
                target: key.1.clone(),
                snapshot: None,
                bandwidth_mbytes_per_sec: sc.schedule.bandwidth_mbytes_per_sec,
                schedule: Some(sc.schedule.id()),
                replica: false,
            };
            match self.create(req) {
                Ok(j) => {
                    if let Some(s) = lock(&self.schedules).get_mut(&key) {
                        s.running = Some(j.id);
                    }
                }
                // A backup of the volume runs (an operator's): next tick.
                Err(BackupError::Busy(_)) => {}
                Err(e) => {
                    tracing::warn!(volume = key.0, target = key.1, error = %e,
                        "scheduled backup not started; next try in one interval");
                    self.ended(&key, false, &sc.schedule);
                }
            }
        }
    }

    /// A scheduled backup ended (or could not start): the next is due an
    /// interval from now; a good one is followed by retention.
    fn ended(&self, key: &Key, good: bool, schedule: &Schedule) {
        {
            let mut s = lock(&self.schedules);
            if let Some(sc) = s.get_mut(key) {
                sc.running = None;
                sc.schedule.last_unix_ms = Some(now_unix_ms());
            }
            if let Err(e) = self.save_schedules(&s) {
                tracing::warn!(error = %e, "backup schedules not recorded");
            }
        }
        if good {
            if let Err(e) = self.retain(schedule) {
                tracing::warn!(volume = key.0, target = key.1, error = %e, "backup retention failed; next time");
            }
        }
    }

    /// Deletes the schedule's backups past what it keeps, then collects.
    fn retain(&self, schedule: &Schedule) -> Result<(), BackupError> {
        if schedule.keep_last.is_none() && schedule.keep_within_secs.is_none() {
            return Ok(());
        }
        let t = self.target(&schedule.target)?;
        let id = schedule.id();
        let now = now_unix_ms();
        self.rt.block_on(async {
            let mut mine: Vec<_> = catalog::manifests(&t)
                .await?
                .into_iter()
                .filter(|m| m.volume == schedule.volume && m.schedule.as_deref() == Some(&id))
                .collect();
            mine.sort_by_key(|m| std::cmp::Reverse(m.created_unix_ms));
            let mut deleted = 0;
            for (n, m) in mine.iter().enumerate() {
                let by_count = schedule.keep_last.is_some_and(|k| (n as u64) < k);
                let by_age = schedule
                    .keep_within_secs
                    .is_some_and(|s| now.saturating_sub(m.created_unix_ms) < s * 1000);
                if by_count || by_age || n == 0 {
                    continue;
                }
                use object_store::ObjectStoreExt;
                t.store
                    .delete(&t.path(&crate::format::manifest_path(&m.id)))
                    .await
                    .map_err(|e| t.error(e))?;
                tracing::info!(
                    backup = m.id,
                    schedule = id,
                    "backup past its schedule's retention deleted"
                );
                deleted += 1;
            }
            if deleted > 0 {
                catalog::collect(&t).await?;
            }
            Ok(())
        })
    }
}
