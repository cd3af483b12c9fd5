//! Write intent: one bit per region of `proto::intent_region_bytes` on
//! every replica, set (INTENT_MARK) before the first write to a region and
//! cleared (INTENT_CLEAR) once the region has been quiet; the masks of
//! which replica holds, is setting or is clearing which bit (`Region`, in
//! `types`).

use lull_bdev::IoBuf;
use lull_proto::replica::{self as proto, Header, Kind};

use super::ids::{ReplicaId, ReplicaSet};
use super::types::{Engine, IoId, LogLevel, Payload, RState, Region, Sub, SubKind};

/// A region's write-intent bit is cleared once no write has touched it for
/// this long (md's bitmap daemon waits 5 s too). Shorter would cost more
/// MARKs (fsyncs) on regions that are written in bursts; longer only grows
/// what a crash leaves to reconcile.
pub const INTENT_CLEAR_IDLE_NS: u64 = 5_000_000_000;

/// INTENT_CLEAR requests sent per replica per tick: clearing is background
/// work and must not fill the slot tables that client I/O needs.
pub const MAX_CLEARS_PER_TICK: usize = 32;

pub(super) fn has_bit(bitmap: &[u8], i: usize) -> bool {
    bitmap.get(i / 8).is_some_and(|b| b & (1 << (i % 8)) != 0)
}

pub(super) fn count_bits(bitmap: &[u8]) -> u64 {
    bitmap.iter().map(|b| u64::from(b.count_ones())).sum()
}

impl Engine {
    /// Bytes of the volume covered by the write-intent regions set in
    /// `bitmap`.
    pub(super) fn bitmap_bytes(&self, bitmap: &[u8]) -> u64 {
        self.regions_bytes(bitmap, self.region_bytes)
    }

    /// Bytes of the volume covered by the regions of `region_bytes` set in
    /// `bitmap` (write-intent regions, or a change record's).
    pub(super) fn regions_bytes(&self, bitmap: &[u8], region_bytes: u64) -> u64 {
        (0..self.size_bytes.div_ceil(region_bytes))
            .filter(|&g| has_bit(bitmap, g as usize))
            .map(|g| ((g + 1) * region_bytes).min(self.size_bytes) - g * region_bytes)
            .sum()
    }

    pub(super) fn region_end(&self, g: usize) -> u64 {
        ((g as u64 + 1) * self.region_bytes).min(self.size_bytes)
    }

    /// First and last region of `[offset, offset + len)`, `len` > 0.
    pub(super) fn region_span(&self, offset: u64, len: u64) -> (usize, usize) {
        let last = (offset + len.max(1) - 1) / self.region_bytes;
        (
            (offset / self.region_bytes) as usize,
            (last as usize).min(self.regions.len() - 1),
        )
    }

    /// The first run `[start, end)` of regions in `[from, to)` for which
    /// `pred` holds.
    fn region_run(
        &self,
        from: usize,
        to: usize,
        pred: impl Fn(&Region) -> bool,
    ) -> Option<(usize, usize)> {
        let start = (from..to).find(|&g| pred(&self.regions[g]))?;
        let end = (start..to).find(|&g| !pred(&self.regions[g])).unwrap_or(to);
        Some((start, end))
    }

    /// INTENT_MARK or INTENT_CLEAR of regions `[start, end)` to replica `r`;
    /// false when it has no free slot.
    fn send_intent(&mut self, r: ReplicaId, kind: Kind, start: usize, end: usize) -> bool {
        let count = (end - start) as u32;
        self.send_any(r, SubKind::Intent, kind, start as u64, count, Payload::None)
    }

    /// Whether regions `first..=last` have a durable write-intent bit on
    /// every replica of `need` and no CLEAR in flight. If not, sends the
    /// MARKs that are missing (once; their replies call `progress` again).
    pub(super) fn ensure_marked(&mut self, first: usize, last: usize, need: ReplicaSet) -> bool {
        if self.regions[first..=last]
            .iter()
            .all(|x| x.clearing.is_empty() && x.marked.contains_all(need))
        {
            return true;
        }
        for r in need.iter() {
            // A region being cleared is marked only once the CLEAR is
            // answered: on another connection the MARK could overtake it.
            let missing =
                |x: &Region| !x.marked.union(x.marking).contains(r) && x.clearing.is_empty();
            let mut from = first;
            while let Some((start, end)) = self.region_run(from, last + 1, missing) {
                if !self.send_intent(r, Kind::IntentMark, start, end) {
                    // No free slot: tried again on the next event.
                    return false;
                }
                for x in &mut self.regions[start..end] {
                    x.marking.insert(r);
                }
                from = end;
            }
        }
        false
    }

    /// Count client request `id` in the regions it writes (at dispatch).
    pub(super) fn hold_regions(&mut self, id: IoId) {
        let Some(io) = self.ios.get(id) else {
            return;
        };
        let (first, last) = self.region_span(io.offset, u64::from(io.len));
        for x in &mut self.regions[first..=last] {
            x.writes += 1;
        }
        if let Some(io) = self.ios.get_mut(id) {
            io.in_regions = true;
        }
    }

    /// Uncount it once every replica answered it.
    pub(super) fn release_regions(&mut self, id: IoId) {
        let Some(io) = self.ios.get_mut(id) else {
            return;
        };
        if !std::mem::take(&mut io.in_regions) {
            return;
        }
        let (offset, len) = (io.offset, u64::from(io.len));
        let (first, last) = self.region_span(offset, len);
        let now = self.now;
        for x in &mut self.regions[first..=last] {
            x.writes -= 1;
            x.last_write_ns = now;
        }
    }

    /// Clear the write-intent bits of regions quiet for
    /// `INTENT_CLEAR_IDLE_NS`. Not while any replica is rebuilt or
    /// reconciled (the bits say what a reconcile interrupted by a crash
    /// still has to do) nor while detaching (DETACH clears everything),
    /// nor while a revert waits to start (it waits for CLEARs in flight:
    /// `core::snapshot`).
    pub(super) fn clear_quiet_regions(&mut self) {
        if self.detach.is_some()
            || self
                .snapshot
                .as_ref()
                .is_some_and(|j| j.op == lull_proto::replica::SnapshotOp::Revert)
            || self.rebuild.is_some()
            || self.replicas.iter().any(|r| r.state == RState::Rebuilding)
        {
            return;
        }
        let now = self.now;
        let n = self.regions.len();
        for r in self.replicas.ids() {
            if self.replicas[r].state != RState::Healthy {
                continue;
            }
            let quiet = |x: &Region| {
                x.marked.contains(r)
                    && x.writes == 0
                    && x.marking.is_empty()
                    && now.saturating_sub(x.last_write_ns) >= INTENT_CLEAR_IDLE_NS
            };
            let mut from = 0;
            for _ in 0..MAX_CLEARS_PER_TICK {
                let Some((start, end)) = self.region_run(from, n, quiet) else {
                    break;
                };
                if !self.send_intent(r, Kind::IntentClear, start, end) {
                    break;
                }
                for x in &mut self.regions[start..end] {
                    x.marked.remove(r);
                    x.clearing.insert(r);
                }
                from = end;
            }
        }
    }

    pub(super) fn on_intent_reply(&mut self, r: ReplicaId, sub: Sub, h: Header) {
        if h.status != 0 {
            return self.fail_replica(
                r,
                &format!(
                    "{:?} of regions [{}, +{}) failed with errno {}",
                    h.kind, sub.offset, sub.length, h.status
                ),
                false,
            );
        }
        let (first, count) = (sub.offset as usize, sub.length as usize);
        let end = first.saturating_add(count).min(self.regions.len());
        for x in &mut self.regions[first.min(end)..end] {
            if sub.kind == Kind::IntentMark {
                x.marking.remove(r);
                x.marked.insert(r);
            } else {
                x.clearing.remove(r);
            }
        }
    }

    /// The INTENT_GET reply that completes a probe.
    pub(super) fn on_intent_get_reply(&mut self, r: ReplicaId, h: Header, payload: Option<IoBuf>) {
        if h.status != 0 {
            if let Some(b) = payload {
                lull_net::bufs::put(b);
            }
            return self.fail_replica(
                r,
                &format!("INTENT_GET failed with errno {}", h.status),
                false,
            );
        }
        let Some(buf) = payload else {
            return self.protocol_error(r, None, "INTENT_GET reply without payload".into());
        };
        let parsed =
            proto::decode_intent(buf.as_slice()).map(|(flags, bits)| (flags, bits.to_vec()));
        lull_net::bufs::put(buf);
        let (flags, bits) = match parsed {
            Ok(p) => p,
            Err(e) => return self.protocol_error(r, None, format!("bad INTENT_GET reply: {e}")),
        };
        if bits.len() != self.regions.len().div_ceil(8) || h.offset != self.regions.len() as u64 {
            let why = format!(
                "INTENT_GET reply for {} regions, the volume has {}",
                h.offset,
                self.regions.len()
            );
            return self.protocol_error(r, None, why);
        }
        let rep = &mut self.replicas[r];
        rep.intent_lost |= flags & proto::INTENT_FLAG_LOST != 0;
        rep.intent = Some(bits);
        let (addr, generation, clean, lost) =
            (rep.addr.clone(), rep.generation, rep.clean, rep.intent_lost);
        let marked = self.replicas[r].intent.as_deref().map_or(0, count_bits);
        if !self.healthy_set().is_empty() {
            self.log(
                LogLevel::Info,
                format!("replica {addr} connected (generation {generation}); it will be rebuilt"),
            );
            self.start_layer_sync(r);
        } else {
            self.replicas[r].state = RState::Probed;
            let record = if lost {
                "lost".to_string()
            } else {
                format!("{marked} region(s) marked")
            };
            self.log(LogLevel::Info, format!("replica {addr} connected (generation {generation}, clean {clean}, write intent: {record})"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::types::EngineOptions;

    #[test]
    fn region_spans_runs_and_bitmap_bytes() {
        let mut e = Engine::new(
            "v",
            10 * 4096 + 512,
            Vec::new(),
            EngineOptions::default(),
            1,
        );
        e.set_region_bytes(4096);
        assert_eq!(e.regions.len(), 11);
        assert_eq!(e.region_span(0, 1), (0, 0));
        assert_eq!(e.region_span(4095, 2), (0, 1));
        assert_eq!(e.region_span(10 * 4096, 512), (10, 10));
        // The last region is short: it ends with the volume.
        assert_eq!(e.region_end(10), 10 * 4096 + 512);
        assert_eq!(e.bitmap_bytes(&[0b0000_0011, 0b0000_0100]), 2 * 4096 + 512);
        let r = ReplicaId::new(0);
        for g in [2, 3, 4, 7] {
            e.regions[g].marked.insert(r);
        }
        let marked = |x: &Region| x.marked.contains(r);
        assert_eq!(e.region_run(0, 11, marked), Some((2, 5)));
        assert_eq!(e.region_run(5, 11, marked), Some((7, 8)));
        assert_eq!(e.region_run(8, 11, marked), None);
    }
}
