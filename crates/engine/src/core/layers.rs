//! Snapshot layers for a replica about to be rebuilt. A replica that comes
//! back stale lacks the snapshots taken while it was away (and one whose
//! operation a crash or a kill cut): before its rebuild, a job off the
//! engine thread (the shell's `layers`) copies them to it from a healthy
//! replica, oldest first: it reverts the replica to the newest snapshot
//! both hold (or empties its live data when they hold none), then for
//! each snapshot it lacks writes the blocks that changed since the one
//! below (read through a view of the source's snapshot, `CHANGED`) and
//! takes the snapshot under the same name. Meanwhile the replica is
//! `Syncing`: out of the write set (a snapshot taken on it must hold the
//! source's bytes and nothing newer) and serving no reads.
//!
//! Snapshot operations are refused while a replica is not healthy, so the
//! source's chain does not change under the job. A job that copied
//! anything (or failed after it changed the replica) has changed the
//! replica's live data, so its rebuild is a full one; a job that found
//! nothing to copy, or failed before it changed anything (a connection
//! refused, a list that did not come), leaves the replica as it was, and
//! its rebuild may be a delta. A crash in the
//! middle leaves snapshots that are each complete (taken only after their
//! blocks were written) and a stale replica, which the next engine syncs
//! again from where it stopped.

use super::ids::ReplicaId;
use super::types::{Action, Engine, LayerSyncError, LayersCopied, LogLevel, Lookup, RState};

impl Engine {
    /// Replica `r` was probed stale while a healthy set exists: its layer
    /// sync starts (its rebuild follows, `on_layers_synced`).
    pub(super) fn start_layer_sync(&mut self, r: ReplicaId) {
        let Some(source) = self.healthy_set().iter().next() else {
            self.replicas[r].state = RState::Probed;
            return;
        };
        self.layer_syncs += 1;
        let token = self.layer_syncs;
        let rep = &mut self.replicas[r];
        rep.state = RState::Syncing;
        rep.reconcile = None;
        rep.lookup = Lookup::Off;
        rep.sync_token = token;
        let action = Action::SyncLayers {
            replica: r,
            token,
            source: self.replicas[source].addr.clone(),
            target: self.replicas[r].addr.clone(),
            session: self.session,
        };
        self.out.push(action);
    }

    /// The job for replica `r` ended: its rebuild starts (full when the
    /// job changed its data).
    pub(super) fn on_layers_synced(
        &mut self,
        r: ReplicaId,
        token: u64,
        result: Result<LayersCopied, LayerSyncError>,
    ) {
        let Some(rep) = self.replicas.get_mut(r) else {
            return;
        };
        if rep.sync_token != token {
            return; // not this replica's job (never: one runs at a time)
        }
        rep.sync_token = 0;
        if rep.state != RState::Syncing {
            return; // it failed meanwhile: it may be connected again now
        }
        let addr = rep.addr.clone();
        let full = match result {
            Ok(c) if c.layers == 0 => false,
            Ok(c) => {
                self.log(
                    LogLevel::Info,
                    format!(
                        "replica {addr}: copied {} snapshot(s) it lacked ({} bytes); its live data is the newest snapshot's now, so it is rebuilt in full",
                        c.layers, c.bytes
                    ),
                );
                true
            }
            Err(e) => {
                let how = if e.touched {
                    "it is rebuilt in full"
                } else {
                    "it is rebuilt without them"
                };
                self.log(
                    LogLevel::Warn,
                    format!(
                        "replica {addr}: its snapshots were not brought up to date ({}); {how}",
                        e.why
                    ),
                );
                e.touched
            }
        };
        if self.healthy_set().is_empty() {
            self.replicas[r].state = RState::Probed;
            return;
        }
        self.replicas[r].state = RState::Rebuilding;
        if full {
            self.replicas[r].lookup = Lookup::Off;
        } else {
            self.begin_lookup(r);
        }
    }
}
