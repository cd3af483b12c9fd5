//! [`Engine::check_invariants`]: run after every event in debug builds
//! and by the simulator.

use std::cell::RefCell;

use lull_net::slots::SlotId;

use lull_proto::replica::Kind;

use super::io::overlaps;
use super::rebuild::REBUILD_WINDOW_SEGMENTS;
use super::types::{CState, Engine, IoId, RState, Rebuild, Step, SubKind};

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
            self.check_rebuild(rb);
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

impl Engine {
    /// The copy window: bounded, in offset order, below the queue and the
    /// scan; no client write in flight overlaps a segment past waiting for
    /// them; every request of the run in flight is the one its segment's
    /// step (or the scan) says, and nothing else is.
    fn check_rebuild(&self, rb: &Rebuild) {
        // Admission stops at the bound; a recheck that splits a hole adds
        // its rest to the window, and none starts over the bound.
        assert!(
            rb.window.len() <= 2 * REBUILD_WINDOW_SEGMENTS,
            "copy window over its bound"
        );
        assert!(
            rb.done_bytes <= rb.total_bytes,
            "copy progress past its total"
        );
        assert!(rb.scanned <= self.size_bytes);
        let mut prev_end = 0;
        for e in &rb.window {
            assert!(
                e.seg.len > 0 && e.seg.offset >= prev_end,
                "copy window out of order"
            );
            prev_end = e.seg.end();
            if !matches!(e.step, Step::Draining) {
                let range = (e.seg.offset, e.seg.end());
                assert!(
                    !self
                        .writes_in_flight
                        .iter()
                        .any(|&(_, s, end)| overlaps((s, end), range)),
                    "a client write in flight over a segment being copied"
                );
            }
        }
        for s in &rb.segments {
            assert!(s.len > 0 && s.offset >= prev_end, "copy queue out of order");
            prev_end = s.end();
        }
        assert!(prev_end <= rb.scanned, "segments past the scan");
        assert!(rb.cursor() <= rb.scanned);
        if let Some(start) = rb.scan {
            assert!(start >= rb.scanned, "a scan behind the scanned range");
        }
        let mut subs = 0;
        for (ri, r) in self.replicas.iter_with_ids() {
            for c in &r.conns {
                for (_, s) in c.slots.iter() {
                    if !matches!(s.what, SubKind::Rebuild(run) if run == rb.run) {
                        continue;
                    }
                    subs += 1;
                    if s.kind == Kind::Extents && rb.scan == Some(s.offset) {
                        assert_eq!(ri, rb.source);
                        continue;
                    }
                    let e = rb
                        .window
                        .iter()
                        .find(|e| e.seg.offset == s.offset)
                        .expect("a copy request with no segment in the window");
                    let (who, ok) = match e.step {
                        Step::Rechecking => (rb.source, s.kind == Kind::Extents),
                        Step::Reading => (rb.source, s.kind == Kind::Read),
                        Step::Writing => (rb.target, matches!(s.kind, Kind::Write | Kind::Trim)),
                        Step::Draining | Step::ReadDone(_) | Step::ReadSpliced(_) => (ri, false),
                    };
                    assert!(
                        ok && who == ri,
                        "copy request {:?} for a segment not at that step",
                        s.kind
                    );
                }
            }
        }
        let expected = usize::from(rb.scan.is_some())
            + rb.window
                .iter()
                .filter(|e| matches!(e.step, Step::Rechecking | Step::Reading | Step::Writing))
                .count();
        assert_eq!(subs, expected, "copy requests in flight");
    }
}

thread_local! {
    /// `check_invariants`' counters, kept between calls: debug builds run
    /// the check after every event, and fresh vectors each time would be
    /// heap allocations per request that release builds do not make (the
    /// allocation tests run with debug assertions on).
    static CHECK_COUNTS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}
