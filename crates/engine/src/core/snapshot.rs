//! Snapshots of a replicated volume: one control operation (create,
//! delete, revert; [`SnapshotOp`]) on every healthy replica under one
//! name, and the replicas' snapshot lists.
//!
//! An operation first holds new writes (trims and zeroing too) and lets
//! those in flight finish; then it sends SNAPSHOT to every healthy
//! replica at once and, once all have answered, lets writes go again. So
//! every write acknowledged before the operation started is in the
//! snapshot on every replica, and none that started after it is: the
//! snapshot is crash-consistent across the replicas. Reads go on
//! meanwhile (each replica holds its own for the moment its chain
//! switches heads).
//!
//! It needs every replica of the volume healthy: a replica away would
//! miss the operation, and a rebuild that copies snapshot layers is not
//! built yet (docs/SNAPSHOTS.md). A replica that fails during the
//! operation leaves the healthy set as a failed write would, and the
//! operation completes on the others. An answer other than success fails
//! the operation and names the replica; for a delete, a replica that
//! does not hold the snapshot counts as done (so deleting a snapshot that
//! a crash left on some replicas only cleans it up).

use lull_proto::replica::{self as proto, Header, Kind, SnapshotOp, SnapshotRequest};

use super::ids::{ReplicaId, ReplicaSet};
use super::types::{
    Action, ControlOutcome, Engine, LogLevel, Payload, RState, SnapshotJob, SnapshotList,
    SnapshotStep, SubKind,
};

impl Engine {
    /// Starts `op` on snapshot `name`; its outcome goes out as
    /// [`Action::ControlDone`] with `token`.
    pub(super) fn start_snapshot(&mut self, token: u64, op: SnapshotOp, name: String) {
        if let Err(why) = self.snapshot_refusal(&name) {
            return self.control_done(token, ControlOutcome::Snapshot(Err(why)));
        }
        let Ok(payload) = proto::encode_snapshot_request(&SnapshotRequest {
            op,
            name: name.clone(),
        }) else {
            return self.control_done(
                token,
                ControlOutcome::Snapshot(Err(format!("invalid snapshot name {name:?}"))),
            );
        };
        self.log(
            LogLevel::Info,
            format!("snapshot {op:?} {name:?}: holding new writes until every replica answers"),
        );
        self.snapshot_ops += 1;
        self.snapshot = Some(SnapshotJob {
            token,
            op,
            name,
            payload,
            step: SnapshotStep::Draining,
            started_ns: self.now,
            errors: Vec::new(),
            took: ReplicaSet::EMPTY,
        });
    }

    /// Why an operation cannot start now, in words for the operator.
    fn snapshot_refusal(&self, name: &str) -> Result<(), String> {
        if self.snapshot.is_some() {
            return Err("another snapshot operation of this volume is running".into());
        }
        if self.detach.is_some() {
            return Err("the volume is detaching".into());
        }
        if self.grow.is_some() {
            return Err("the volume is growing: try again".into());
        }
        if name.is_empty() || name.len() > proto::MAX_SNAPSHOT_NAME_BYTES {
            return Err(format!(
                "a snapshot name is 1 to {} bytes",
                proto::MAX_SNAPSHOT_NAME_BYTES
            ));
        }
        self.every_replica_healthy(
            "snapshots of a replicated volume need every replica healthy (one away would miss it; it gets the snapshots taken before when it comes back, then its rebuild)",
        )
    }

    /// Refuses a control operation that needs every replica healthy (a
    /// snapshot operation, a grow): names the first replica that is not
    /// and why the operation needs them all (`needs`); also while the
    /// volume has had no healthy set yet, or stores a new generation
    /// (a passing state: "try again").
    pub(super) fn every_replica_healthy(&self, needs: &str) -> Result<(), String> {
        for r in self.replicas.iter() {
            let state = match r.state {
                RState::Healthy | RState::Removed => continue,
                RState::Syncing => "getting the snapshots it lacks",
                RState::Rebuilding => "being rebuilt",
                RState::Failed => "failed",
                _ => "connecting",
            };
            return Err(format!("replica {} is {state}: {needs}", r.addr));
        }
        if self.healthy_set().is_empty() || !self.elected_once {
            return Err("the volume has no healthy replica yet".into());
        }
        if self.bump.is_some() {
            return Err(
                "the volume's healthy set just changed and its new generation is being stored on the replicas: try again"
                    .into(),
            );
        }
        Ok(())
    }

    /// Whether the volume has had a healthy set (an election) yet: from
    /// then on its replicas' snapshot lists can be asked for.
    pub fn elected_once(&self) -> bool {
        self.elected_once
    }

    /// Makes this engine's session (given to `Engine::new`) the one the
    /// volume's engine ran with before its daemon restarted, so the
    /// replicas tell whether another engine took the volume over since:
    /// the session is never raised past a replica's owner, and a newer
    /// owner fences this engine on every replica ([`Self::fenced_by`]).
    /// Called before the first event.
    pub fn resume_session(&mut self) {
        self.session_resumed = true;
    }

    /// The session this engine's writes carry, once it is final (the
    /// first election; before it a fresh engine may still take one past
    /// a replica's owner): what a node records to resume it after a
    /// restart.
    pub fn final_session(&self) -> Option<u64> {
        self.elected_once.then_some(self.session)
    }

    /// The newer session that fenced this resumed engine, if one did.
    pub fn fenced_by(&self) -> Option<u64> {
        self.fenced_by
    }

    /// Whether every replica of the volume is healthy and their
    /// generation stored (the moment to reconcile their snapshot lists,
    /// [`super::types::Event::ReconcileSnapshots`]: a snapshot operation
    /// can run).
    pub fn all_healthy(&self) -> bool {
        self.elected_once
            && self.bump.is_none()
            && self
                .replicas
                .iter()
                .all(|r| matches!(r.state, RState::Healthy | RState::Removed))
    }

    /// No write in flight, no generation bump and no change record being
    /// started: an operation that holds writes (a snapshot, a grow) may
    /// go to the replicas.
    pub(super) fn writes_settled(&self) -> bool {
        self.writes_in_flight.is_empty() && self.bump.is_none() && self.changes_starting == 0
    }

    /// Whether writes wait for a snapshot operation.
    pub(super) fn snapshot_holds_writes(&self) -> bool {
        self.snapshot.is_some()
    }

    /// Moves the operation on: once the writes in flight have finished and
    /// every healthy replica has a free slot, SNAPSHOT goes to all of
    /// them; once all have answered, the outcome goes out.
    pub(super) fn progress_snapshot(&mut self) {
        let Some((draining, answered)) = self.snapshot.as_ref().map(|job| job.step.progress())
        else {
            return;
        };
        if draining {
            if !self.writes_settled() {
                return;
            }
            // A revert sets every write-intent bit on the replicas; a CLEAR
            // still in flight could land after that and clear one (its
            // region then goes unrepaired if the engine dies halfway
            // through the revert). Let those finish first.
            let reverting = self
                .snapshot
                .as_ref()
                .is_some_and(|j| j.op == SnapshotOp::Revert);
            if reverting && self.regions.iter().any(|x| !x.clearing.is_empty()) {
                return;
            }
            let healthy = self.healthy_set();
            if healthy.is_empty() {
                // Every replica failed while writes drained: nothing
                // took it.
                let Some(job) = self.snapshot.take() else {
                    return;
                };
                return self.control_done(
                    job.token,
                    ControlOutcome::Snapshot(Err("no healthy replica is left".into())),
                );
            }
            if healthy.iter().any(|r| self.pick_conn(r).is_none()) {
                return;
            }
            let Some(payload) = self.snapshot.as_ref().map(|j| j.payload.clone()) else {
                return;
            };
            let mut sent = ReplicaSet::EMPTY;
            for r in healthy.iter() {
                if self.send_any(
                    r,
                    SubKind::Snapshot,
                    Kind::Snapshot,
                    0,
                    payload.len() as u32,
                    Payload::Control(payload.clone()),
                ) {
                    sent.insert(r);
                }
            }
            if let Some(job) = self.snapshot.as_mut() {
                job.step = SnapshotStep::Sent(sent);
            }
            return self.progress_snapshot();
        }
        if !answered {
            return;
        }
        let Some(job) = self.snapshot.take() else {
            return;
        };
        let took_ms = self.now.saturating_sub(job.started_ns) / 1_000_000;
        if job.op == SnapshotOp::Revert && !job.took.is_empty() {
            // A replica sets every write-intent region durably before it
            // reverts (its data differs from its peers' everywhere until
            // each has reverted). Every region is marked on them now, as
            // the engine sees it, and cleared the usual way once quiet.
            let now = self.now;
            // Those that answered and are still in the write set (one that
            // failed since is not marked: its bits are not known).
            let live = self.write_set();
            for x in &mut self.regions {
                // A MARK in flight makes its bit marked when answered.
                for r in job.took.iter().filter(|&r| live.contains(r)) {
                    if !x.marking.contains(r) {
                        x.marked.insert(r);
                    }
                }
                x.last_write_ns = now;
            }
            // A healthy replica that did not revert (it lacked the
            // snapshot, or failed the request) now differs from those that
            // did, everywhere: it leaves the healthy set and is copied in
            // full from them when it returns, never read meanwhile.
            for r in self.healthy_set().iter() {
                if !job.took.contains(r) {
                    self.diverged.insert(r);
                    self.fail_replica(
                        r,
                        &format!(
                            "it did not revert to snapshot {:?} as its peers did: it is rebuilt from them",
                            job.name
                        ),
                        false,
                    );
                }
            }
        }
        let outcome = if job.errors.is_empty() && job.took.is_empty() {
            // Every replica it went to failed before answering.
            self.log(
                LogLevel::Warn,
                format!(
                    "snapshot {:?} {:?}: no replica answered before failing",
                    job.op, job.name
                ),
            );
            Err("every replica it went to failed before answering".into())
        } else if job.op == SnapshotOp::Revert && !job.took.is_empty() && !job.errors.is_empty() {
            // The volume is reverted (those that did not were failed above
            // and are rebuilt from those that did): that is the outcome.
            self.log(
                LogLevel::Warn,
                format!(
                    "snapshot {:?} {:?} done on {} replica(s) in {took_ms} ms; the others are rebuilt from them: {}",
                    job.op,
                    job.name,
                    job.took.len(),
                    job.errors.join("; ")
                ),
            );
            Ok(())
        } else if job.errors.is_empty() {
            self.log(
                LogLevel::Info,
                format!(
                    "snapshot {:?} {:?} done on every healthy replica in {took_ms} ms; writes go on",
                    job.op, job.name
                ),
            );
            Ok(())
        } else {
            let why = job.errors.join("; ");
            self.log(
                LogLevel::Warn,
                format!("snapshot {:?} {:?} failed: {why}", job.op, job.name),
            );
            Err(why)
        };
        self.control_done(job.token, ControlOutcome::Snapshot(outcome));
    }

    pub(super) fn on_snapshot_reply(&mut self, r: ReplicaId, h: Header) {
        let addr = self.replicas[r].addr.clone();
        let Some(job) = self.snapshot.as_mut() else {
            return;
        };
        let SnapshotStep::Sent(waiting) = &mut job.step else {
            return;
        };
        waiting.remove(r);
        let errno = h.status as i32;
        let done = errno == 0 || (errno == libc::ENOENT && job.op == SnapshotOp::Delete);
        if done {
            job.took.insert(r);
        } else {
            let what = match errno {
                libc::EEXIST => "a snapshot of that name exists".to_string(),
                libc::ENOENT => "no snapshot of that name".to_string(),
                libc::EINVAL => "invalid snapshot name".to_string(),
                libc::EMLINK => "its chain holds the most layers it can".to_string(),
                libc::EBUSY => "a snapshot is being merged, or clones stand on it (replica_get on its node names them)".to_string(),
                libc::EOPNOTSUPP => "it takes no snapshots".to_string(),
                e => format!("errno {e}"),
            };
            job.errors.push(format!("replica {addr}: {what}"));
            if errno == libc::EIO {
                // Its data path failed: it leaves the healthy set, as a
                // replica that fails a write does.
                self.fail_replica(r, "SNAPSHOT failed with EIO", false);
            }
        }
    }

    /// A replica left while the operation waited for it: it is no longer
    /// in the healthy set, which the operation is about.
    pub(super) fn snapshot_replica_gone(&mut self, r: ReplicaId) {
        if let Some(SnapshotStep::Sent(waiting)) = self.snapshot.as_mut().map(|j| &mut j.step) {
            waiting.remove(r);
        }
        for list in &mut self.snapshot_lists {
            if list.waiting.contains(r) {
                list.waiting.remove(r);
                let addr = self.replicas[r].addr.clone();
                list.got.push((addr, Err("the replica failed".into())));
            }
        }
    }

    /// A SNAPSHOT or SNAPSHOT_LIST request of replica `r` ended without a
    /// reply (its connection went down).
    pub(super) fn snapshot_sub_failed(&mut self, r: ReplicaId, list: Option<u64>) {
        let addr = self.replicas[r].addr.clone();
        match list {
            None => {
                if let Some(job) = self.snapshot.as_mut() {
                    if let SnapshotStep::Sent(waiting) = &mut job.step {
                        if waiting.contains(r) {
                            waiting.remove(r);
                            job.errors
                                .push(format!("replica {addr}: its connection went down"));
                        }
                    }
                }
            }
            Some(token) => {
                if let Some(l) = self.snapshot_lists.iter_mut().find(|l| l.token == token) {
                    if l.waiting.contains(r) {
                        l.waiting.remove(r);
                        l.got.push((addr, Err("its connection went down".into())));
                    }
                }
                self.finish_snapshot_lists();
            }
        }
    }

    /// Asks every healthy replica for its snapshots; the answers go out
    /// as [`Action::ControlDone`] with `token`.
    pub(super) fn start_snapshot_list(&mut self, token: u64, reconcile: Option<u64>) {
        let mut list = SnapshotList {
            token,
            waiting: ReplicaSet::EMPTY,
            got: Vec::new(),
            reconcile,
        };
        for r in self.healthy_set().iter() {
            if self.send_any(
                r,
                SubKind::SnapshotList(token),
                Kind::SnapshotList,
                0,
                0,
                Payload::None,
            ) {
                list.waiting.insert(r);
            } else {
                let addr = self.replicas[r].addr.clone();
                list.got
                    .push((addr, Err("no free request slot; try again".into())));
            }
        }
        self.snapshot_lists.push(list);
        self.finish_snapshot_lists();
    }

    pub(super) fn on_snapshot_list_reply(
        &mut self,
        r: ReplicaId,
        token: u64,
        h: Header,
        payload: Option<lull_bdev::IoBuf>,
    ) {
        let addr = self.replicas[r].addr.clone();
        let answer = if h.status != 0 {
            Err(format!("errno {}", h.status))
        } else {
            proto::decode_snapshot_list(payload.as_ref().map_or(&[][..], |b| b.as_slice()))
                .map_err(|e| format!("bad SNAPSHOT_LIST reply: {e}"))
        };
        if let Some(b) = payload {
            lull_net::bufs::put(b);
        }
        if let Some(list) = self.snapshot_lists.iter_mut().find(|l| l.token == token) {
            list.waiting.remove(r);
            list.got.push((addr, answer));
        }
        self.finish_snapshot_lists();
    }

    /// Sends out the lists that have every answer.
    fn finish_snapshot_lists(&mut self) {
        let mut i = 0;
        while i < self.snapshot_lists.len() {
            if self.snapshot_lists[i].waiting.is_empty() {
                let list = self.snapshot_lists.swap_remove(i);
                if let Some(name) = self.partial_snapshot(&list) {
                    self.log(
                        LogLevel::Warn,
                        format!(
                            "snapshot {name:?} is on some replicas only (a create an engine crash cut): deleting it"
                        ),
                    );
                    self.start_snapshot(list.token, SnapshotOp::Delete, name);
                    continue;
                }
                let outcome = if list.got.is_empty() {
                    Err("the volume has no healthy replica".into())
                } else {
                    Ok(list.got)
                };
                self.control_done(list.token, ControlOutcome::SnapshotLists(outcome));
            } else {
                i += 1;
            }
        }
    }

    /// For a reconcile's lists: the first snapshot some replicas hold and
    /// others lack, when the lists still stand (every replica healthy and
    /// answered, no snapshot operation started since they were asked
    /// for). Replicas of one generation took a create together or the
    /// operation was cut before it answered: the snapshot was never
    /// acknowledged, and deleting it leaves the state before the create.
    /// (A replica that failed during a create is rebuilt, and gets it
    /// then: `layers`.)
    fn partial_snapshot(&self, list: &SnapshotList) -> Option<String> {
        let asked_at = list.reconcile?;
        if asked_at != self.snapshot_ops || self.snapshot.is_some() {
            return None;
        }
        let live = self.replicas.iter().filter(|r| r.state != RState::Removed);
        if live.clone().any(|r| r.state != RState::Healthy) {
            return None;
        }
        let lists: Vec<&Vec<proto::SnapshotRecord>> = list
            .got
            .iter()
            .filter_map(|(_, l)| l.as_ref().ok())
            .collect();
        if lists.len() != list.got.len() || lists.len() != live.count() || lists.len() < 2 {
            return None;
        }
        // A clone's inherited snapshots are its base, not its own: a
        // replica that flattened has none, one a crash cut has them still.
        lists
            .iter()
            .flat_map(|l| l.iter())
            .filter(|r| !r.inherited)
            .find(|r| {
                !lists
                    .iter()
                    .all(|l| l.iter().any(|o| o.name == r.name && !o.inherited))
            })
            .map(|r| r.name.clone())
    }

    fn control_done(&mut self, token: u64, outcome: ControlOutcome) {
        self.out.push(Action::ControlDone { token, outcome });
    }
}
