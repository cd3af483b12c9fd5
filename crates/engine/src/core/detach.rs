//! The clean detach: drain, FLUSH and DETACH every healthy replica so
//! the next engine trusts them as identical.

use lull_proto::replica::{Header, Kind};

use super::ids::{ReplicaId, ReplicaSet, ReplicaTarget};
use super::types::{Detach, Engine, LogLevel, Milestone, Payload, RState, SubKind};

impl Engine {
    // ---- clean detach ------------------------------------------------------------

    pub(super) fn start_detach(&mut self) {
        if self.detach.is_some() {
            return;
        }
        self.detach = Some(Detach::Draining);
        self.log(
            LogLevel::Info,
            "detaching: new requests are refused, those in flight finish".into(),
        );
        if let Some(rb) = self.rebuild.take() {
            let addr = self.replicas[rb.target].addr.clone();
            self.log(LogLevel::Info, format!("rebuild of replica {addr} stopped by the detach; it starts again at the next attach"));
        }
    }

    /// Drain, then FLUSH every healthy replica, then DETACH them: each
    /// step waits for the replies of the previous one, so a replica is
    /// marked clean only with every write of this engine durable on it.
    pub(super) fn progress_detach(&mut self) {
        let Some(step) = self.detach else { return };
        match step {
            Detach::Draining => {
                let busy = self.replicas.iter().any(|r| {
                    r.conns.iter().any(|c| {
                        c.slots
                            .iter()
                            .any(|(_, s)| !matches!(s.what, SubKind::Ping))
                    })
                });
                if self.client_ios() != 0 || self.bump.is_some() || busy {
                    return;
                }
                let sent = self.send_to_healthy(Kind::Flush);
                self.detach = Some(Detach::Flushing(sent));
                self.progress_detach();
            }
            Detach::Flushing(waiting) if waiting.is_empty() && self.bump.is_none() => {
                let sent = self.send_to_healthy(Kind::Detach);
                self.detach = Some(Detach::Detaching(sent));
                self.progress_detach();
            }
            Detach::Detaching(waiting) if waiting.is_empty() => {
                self.detach = Some(Detach::Done);
                let clean: Vec<ReplicaTarget> = self
                    .replicas
                    .iter()
                    .filter(|r| r.state == RState::Healthy)
                    .map(|r| r.addr.clone())
                    .collect();
                if clean.is_empty() {
                    self.log(
                        LogLevel::Warn,
                        "detached with no healthy replica: none is marked clean".into(),
                    );
                } else {
                    self.log(
                        LogLevel::Info,
                        format!(
                            "detached cleanly: {} clean at generation {}",
                            clean
                                .iter()
                                .map(|a| a.to_string())
                                .collect::<Vec<_>>()
                                .join(", "),
                            self.generation
                        ),
                    );
                }
                self.milestone(Milestone::Detached { clean });
            }
            _ => {}
        }
    }

    /// Send `kind` (FLUSH or DETACH) to every healthy replica; the set of
    /// those it went to (one without a free slot is failed: nothing else
    /// is in flight at this point, so that cannot happen to a live one).
    fn send_to_healthy(&mut self, kind: Kind) -> ReplicaSet {
        let mut sent = ReplicaSet::EMPTY;
        for r in self.replicas.ids() {
            if self.replicas[r].state != RState::Healthy {
                continue;
            }
            if self.send_any(r, SubKind::Detach, kind, 0, 0, Payload::None) {
                sent.insert(r);
            } else {
                self.fail_replica(r, &format!("no slot for {kind:?} at detach"), false);
            }
        }
        sent
    }

    pub(super) fn on_detach_reply(&mut self, r: ReplicaId, h: Header) {
        if h.status != 0 {
            return self.fail_replica(
                r,
                &format!("{:?} at detach failed with errno {}", h.kind, h.status),
                false,
            );
        }
        if let Some(Detach::Flushing(m) | Detach::Detaching(m)) = self.detach.as_mut() {
            m.remove(r);
        }
    }

    /// Whether a clean detach ([`Event::Detach`]) has finished.
    pub fn detached(&self) -> bool {
        self.detach == Some(Detach::Done)
    }
}
