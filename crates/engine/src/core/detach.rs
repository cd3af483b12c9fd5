//! The clean detach: drain, FLUSH and DETACH every healthy replica so
//! the next engine trusts them as identical.

use lull_proto::replica::{Header, Kind};

use super::replicas::{RState, SubKind};
use super::{Engine, LogLevel, Payload};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Detach {
    /// Waiting for every request (client, MARK, CLEAR, rebuild) to finish.
    Draining,
    /// FLUSH sent to the replicas in the mask.
    Flushing(u32),
    /// DETACH sent to the replicas in the mask.
    Detaching(u32),
    Done,
}

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
            let addr = self.replicas[rb.target].addr;
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
                let mask = self.send_to_healthy(Kind::Flush);
                self.detach = Some(Detach::Flushing(mask));
                self.progress_detach();
            }
            Detach::Flushing(0) if self.bump.is_none() => {
                let mask = self.send_to_healthy(Kind::Detach);
                self.detach = Some(Detach::Detaching(mask));
                self.progress_detach();
            }
            Detach::Detaching(0) => {
                self.detach = Some(Detach::Done);
                let clean: Vec<String> = (0..self.replicas.len())
                    .filter(|&i| self.replicas[i].state == RState::Healthy)
                    .map(|i| self.replicas[i].addr.to_string())
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
                            clean.join(", "),
                            self.generation
                        ),
                    );
                }
            }
            _ => {}
        }
    }

    /// Send `kind` (FLUSH or DETACH) to every healthy replica; the mask of
    /// those it went to (one without a free slot is failed: nothing else
    /// is in flight at this point, so that cannot happen to a live one).
    fn send_to_healthy(&mut self, kind: Kind) -> u32 {
        let mut mask = 0;
        for r in 0..self.replicas.len() {
            if self.replicas[r].state != RState::Healthy {
                continue;
            }
            if self.send_any(r, SubKind::Detach, kind, 0, 0, Payload::None) {
                mask |= 1 << r;
            } else {
                self.fail_replica(r, &format!("no slot for {kind:?} at detach"), false);
            }
        }
        mask
    }

    pub(super) fn on_detach_reply(&mut self, r: usize, h: Header) {
        if h.status != 0 {
            return self.fail_replica(
                r,
                &format!("{:?} at detach failed with errno {}", h.kind, h.status),
                false,
            );
        }
        if let Some(Detach::Flushing(m) | Detach::Detaching(m)) = self.detach.as_mut() {
            *m &= !(1u32 << r);
        }
    }

    /// Whether a clean detach ([`Event::Detach`]) has finished.
    pub fn detached(&self) -> bool {
        self.detach == Some(Detach::Done)
    }
}
