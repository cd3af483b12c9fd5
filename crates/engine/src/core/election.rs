//! Generations and elections: a generation bump on every change of the
//! healthy set (acknowledgements wait for it), and the election of the
//! freshest replica as the source when no replica is healthy.

use lull_proto::replica::{self as proto, Hello, Kind};

use super::ids::{ReplicaId, ReplicaSet, ReplicaTarget};
use super::intent::{count_bits, has_bit};
use super::types::{Bump, Engine, LogLevel, Milestone, Payload, RState, SubKind};

/// How long a later election (every healthy replica failed while the
/// engine ran) waits for every replica to answer before it picks the
/// freshest of those that did. The engine then knows the generation every
/// acknowledged write reached, and no replica below it is a candidate, so
/// waiting longer only chooses among equally fresh ones.
///
/// The first election after the engine starts has no such knowledge: a
/// replica that is away may hold acknowledged writes the others missed.
/// That election therefore waits for every replica of the volume, however
/// long it takes; an operator who knows a replica is lost for good removes
/// it (`replica_remove`) and accepts whatever it alone held.
pub const ELECTION_WAIT_NS: u64 = 3_000_000_000;

/// While the first election waits for a replica, the wait is logged this
/// often.
pub const ELECTION_LOG_INTERVAL_NS: u64 = 10_000_000_000;

impl Engine {
    // ---- generations and elections ------------------------------------

    pub(super) fn start_bump(&mut self) {
        let seen = self
            .replicas
            .iter()
            .map(|r| r.generation.max(r.attached_gen))
            .max()
            .unwrap_or(0);
        let pending = self.bump.as_ref().map_or(0, |b| b.generation);
        // Never a number an earlier bump started with (see
        // `generation_started`): generations name one history each.
        let generation = self
            .generation
            .max(seen)
            .max(pending)
            .max(self.generation_started)
            + 1;
        self.generation_started = generation;
        self.bump = Some(Bump { generation });
    }

    pub(super) fn progress_bump(&mut self) {
        let Some(b) = &self.bump else { return };
        let generation = b.generation;
        let mut done = true;
        for r in self.replicas.ids() {
            let rep = &self.replicas[r];
            if rep.state != RState::Healthy || rep.attached_gen >= generation {
                continue;
            }
            done = false;
            if rep.attach_in_flight {
                continue;
            }
            let hello = Hello {
                volume_size: self.size_bytes,
                generation,
                flags: proto::HELLO_FLAG_ATTACH,
                session: self.session,
            };
            let payload = proto::encode_hello_request(&hello, rep.addr.hello_name());
            let length = payload.len() as u32;
            if self.send_any(
                r,
                SubKind::Attach(generation),
                Kind::Hello,
                0,
                length,
                Payload::Control(payload),
            ) {
                self.replicas[r].attach_in_flight = true;
            }
        }
        if done {
            self.generation = generation;
            self.bump = None;
            self.log(
                LogLevel::Info,
                format!("generation {generation} persisted on every healthy replica"),
            );
            for id in std::mem::take(&mut self.deferred) {
                self.finish_io(id, Ok(()));
            }
        }
    }

    pub(super) fn maybe_elect(&mut self) {
        // A resumed engine that another engine took the volume from
        // never elects: no replica it could still reach may serve.
        if self.fenced_by.is_some() {
            return;
        }
        if !self.healthy_set().is_empty() {
            self.election_start_ns = None;
            return;
        }
        let live: Vec<ReplicaId> = self
            .replicas
            .ids()
            .filter(|&i| self.replicas[i].state != RState::Removed)
            .collect();
        let candidates: Vec<ReplicaId> = live
            .iter()
            .copied()
            .filter(|&i| {
                self.replicas[i].state == RState::Probed
                    && self.replicas[i].generation >= self.generation
            })
            .collect();
        if candidates.is_empty() {
            return;
        }
        let start = *self.election_start_ns.get_or_insert(self.now);
        let all_answered = live
            .iter()
            .all(|&i| self.replicas[i].state == RState::Probed);
        if !all_answered {
            if self.elected_once {
                if self.now < start.saturating_add(ELECTION_WAIT_NS) {
                    return;
                }
            } else {
                if self
                    .election_logged_ns
                    .is_none_or(|t| self.now >= t.saturating_add(ELECTION_LOG_INTERVAL_NS))
                {
                    self.election_logged_ns = Some(self.now);
                    let missing: Vec<ReplicaTarget> = live
                        .iter()
                        .filter(|&&i| self.replicas[i].state != RState::Probed)
                        .map(|&i| self.replicas[i].addr.clone())
                        .collect();
                    let list: Vec<String> = missing.iter().map(|a| a.to_string()).collect();
                    self.log(
                        LogLevel::Warn,
                        format!(
                            "volume not started: waiting for replica(s) {} (any of them may hold the newest data); \
                             `lull rpc replica_remove` one that is lost for good to start without it",
                            list.join(", ")
                        ),
                    );
                    self.milestone(Milestone::WaitingForReplicas { missing });
                }
                return;
            }
        }
        let Some(&source) = candidates.iter().max_by_key(|&&i| {
            let r = &self.replicas[i];
            (r.generation, r.clean, std::cmp::Reverse(i))
        }) else {
            return;
        };
        let (sgen, sclean) = (
            self.replicas[source].generation,
            self.replicas[source].clean,
        );
        // From here on the engine knows acknowledged writes may have reached
        // generation `sgen`: should every healthy replica fail before the
        // bump that follows completes, a later election must not pick a
        // replica below it (sim seed 44314: a half-rebuilt replica of
        // generation 1 was elected while the generation-3 source was away,
        // and reads went back to old data).
        self.generation = self.generation.max(sgen);
        // Equal generations hold the same acknowledged writes. Only if every
        // one of them was detached cleanly are they also equal everywhere
        // else; otherwise a dead engine may have left a write on some of
        // them, inside the union of their write-intent bitmaps.
        let peers: ReplicaSet = live
            .iter()
            .copied()
            .filter(|&i| {
                self.replicas[i].state == RState::Probed && self.replicas[i].generation == sgen
            })
            .collect();
        let all_clean = peers.iter().all(|i| self.replicas[i].clean);
        let union = (!all_clean).then(|| self.intent_union(peers));
        let mut healthy = Vec::new();
        let mut reconciling = Vec::new();
        let mut stale = Vec::new();
        for &i in &live {
            if self.replicas[i].state != RState::Probed {
                continue;
            }
            if i == source || (all_clean && peers.contains(i)) {
                self.replicas[i].intent = None;
                self.replicas[i].state = RState::Healthy;
                healthy.push(self.replicas[i].addr.to_string());
            } else if peers.contains(i) {
                self.replicas[i].state = RState::Rebuilding;
                self.replicas[i].intent = None;
                self.replicas[i].reconcile = union.clone();
                reconciling.push(self.replicas[i].addr.clone());
            } else {
                stale.push(i);
            }
        }
        // Once the healthy set is whole: the stale ones get the snapshots
        // first, then their rebuild (`layers`).
        for i in stale {
            self.start_layer_sync(i);
        }
        self.election_start_ns = None;
        self.election_logged_ns = None;
        self.elected_once = true;
        let src = self.replicas[source].addr.clone();
        self.log(
            LogLevel::Info,
            format!(
                "elected replica {src} (generation {sgen}, clean {sclean}) as source; healthy: {}",
                healthy.join(", ")
            ),
        );
        self.milestone(Milestone::Elected {
            source: src.clone(),
            generation: sgen,
            clean: sclean,
            reconciling: reconciling.clone(),
        });
        if let Some(u) = &union {
            let (n, bytes) = (count_bits(u), self.bitmap_bytes(u));
            let msg = if reconciling.is_empty() {
                format!("unclean stop: {n} region(s) ({bytes} bytes) may have had writes in flight; no other replica of generation {sgen} to reconcile")
            } else {
                format!(
                    "unclean stop: reconciling {} from {src} over {n} write-intent region(s) ({bytes} bytes) before they serve reads",
                    reconciling
                        .iter()
                        .map(|a| a.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            self.log(LogLevel::Warn, msg);
        }
        self.start_bump();
    }

    /// The union of the write-intent bitmaps of `peers` (a missing or lost
    /// record counts as every region), and the region masks set from it:
    /// each region's bit is durable on the peers that reported it.
    fn intent_union(&mut self, peers: ReplicaSet) -> Vec<u8> {
        let n = self.regions.len();
        let mut union = vec![0u8; n.div_ceil(8)];
        let now = self.now;
        for i in peers.iter() {
            let addr = self.replicas[i].addr.clone();
            let lost = self.replicas[i].intent_lost
                || self.replicas[i]
                    .intent
                    .as_ref()
                    .is_none_or(|b| b.len() != union.len());
            if lost {
                self.log(
                    LogLevel::Warn,
                    format!("replica {addr}: write-intent record lost or unreadable: every region is compared and repaired"),
                );
            }
            for (g, region) in self.regions.iter_mut().enumerate() {
                let set = lost
                    || self.replicas[i]
                        .intent
                        .as_deref()
                        .is_some_and(|b| has_bit(b, g));
                if set {
                    union[g / 8] |= 1 << (g % 8);
                    // A lost record is all ones in the replica's memory
                    // and again after its restart: as good as durable.
                    region.marked.insert(i);
                    region.last_write_ns = now;
                }
            }
        }
        union
    }
}
