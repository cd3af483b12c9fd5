//! [`Engine::check_invariants`]: run after every event in debug builds
//! and by the simulator.

use std::cell::RefCell;

use lull_net::slots::SlotId;

use super::types::{CState, Engine, IoId, RState, SubKind};

impl Engine {
    /// Every client request is in exactly one place, every slot belongs to
    /// a live connection, replica states agree with their connections.
    pub fn check_invariants(&self) {
        CHECK_COUNTS.with_borrow_mut(|counts| {
            let n = self.ios.allocated();
            counts.clear();
            counts.resize(2 * n + self.regions.len(), 0);
            let (subs_of, rest) = counts.split_at_mut(n);
            let (place, writes) = rest.split_at_mut(n);
            self.check_with(subs_of, place, writes);
        });
    }

    /// `check_invariants` with zeroed counters: per request entry, its
    /// frames in flight (`subs_of`) and its places in the queues
    /// (`place`); per write-intent region, the writes over it.
    fn check_with(&self, subs_of: &mut [u32], place: &mut [u32], writes: &mut [u32]) {
        self.ios.check_invariants();
        let slot = |id: IoId| SlotId::from_wire(id).index();
        for (ri, r) in self.replicas.iter_with_ids() {
            for c in &r.conns {
                c.slots.check_invariants();
                if c.state == CState::Down {
                    assert_eq!(
                        c.slots.in_flight(),
                        0,
                        "replica {ri}: slots on a closed connection"
                    );
                }
                for (_, s) in c.slots.iter() {
                    if let SubKind::Client(id) = s.what {
                        assert!(self.ios.get(id).is_some(), "slot names a finished request");
                        subs_of[slot(id)] += 1;
                    }
                }
            }
            if matches!(r.state, RState::Healthy | RState::Rebuilding) {
                assert!(
                    r.conns.iter().all(|c| c.state == CState::Up),
                    "replica {ri} {:?} with a connection down",
                    r.state
                );
            }
            if matches!(r.state, RState::Failed | RState::Removed) {
                assert!(r.conns.iter().all(|c| c.state == CState::Down));
            }
        }
        for &id in self.pending.iter().chain(self.deferred.iter()) {
            assert!(
                self.ios.get(id).is_some(),
                "finished request {id} still queued"
            );
            place[slot(id)] += 1;
        }
        for (sid, io) in self.ios.iter() {
            let id = sid.to_wire();
            assert_eq!(
                subs_of[sid.index()],
                io.outstanding,
                "request {id}: outstanding count"
            );
            let queued = place[sid.index()];
            assert!(queued <= 1, "request {id} queued twice");
            assert!(
                queued == 1 || io.outstanding > 0,
                "request {id} is nowhere (leaked)"
            );
            if queued == 1 {
                assert_eq!(io.outstanding, 0, "request {id} both queued and in flight");
            }
            if io.modifies() && io.outstanding > 0 {
                assert!(self.writes_in_flight.contains(&(id, io.offset, io.end())));
            }
        }
        if let Some(rb) = &self.rebuild {
            assert_eq!(self.replicas[rb.target].state, RState::Rebuilding);
            assert_eq!(self.replicas[rb.source].state, RState::Healthy);
            assert!(rb.cursor <= self.size_bytes);
        }
        if self.healthy_set().is_empty() {
            assert!(
                self.deferred.is_empty(),
                "acks deferred with no healthy replica"
            );
        }
        // Write intent: masks only name live replicas; a bit is marked,
        // being marked or being cleared, one at a time; `writes` counts
        // exactly the dispatched writes over the region.
        let live = self.write_set();
        for (_, io) in self.ios.iter().filter(|(_, io)| io.in_regions) {
            let (first, last) = self.region_span(io.offset, u64::from(io.len));
            for w in &mut writes[first..=last] {
                *w += 1;
            }
        }
        for (g, x) in self.regions.iter().enumerate() {
            assert!(
                live.contains_all(x.marked.union(x.marking).union(x.clearing)),
                "region {g}: bit of a replica outside the write set"
            );
            assert!(
                !x.marked.intersects(x.marking),
                "region {g}: marked and being marked"
            );
            assert!(
                !x.marked.intersects(x.clearing),
                "region {g}: marked and being cleared"
            );
            assert_eq!(x.writes, writes[g], "region {g}: write count");
        }
        // Every write in flight to a replica lies in regions whose bit is
        // durable on that replica: the property reconcile relies on.
        for (ri, r) in self.replicas.iter_with_ids() {
            for c in &r.conns {
                for (_, s) in c.slots.iter() {
                    let SubKind::Client(id) = s.what else {
                        continue;
                    };
                    let Some(io) = self.ios.get(id).filter(|io| io.modifies()) else {
                        continue;
                    };
                    let (first, last) = self.region_span(io.offset, u64::from(io.len));
                    for (g, x) in self.regions[first..=last].iter().enumerate() {
                        assert!(
                            x.marked.contains(ri),
                            "write to replica {ri} in region {} without its intent bit",
                            first + g
                        );
                    }
                }
            }
        }
    }
}

thread_local! {
    /// `check_invariants`' counters, kept between calls: debug builds run
    /// the check after every event, and fresh vectors each time would be
    /// heap allocations per request that release builds do not make (the
    /// allocation tests run with debug assertions on).
    static CHECK_COUNTS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}
