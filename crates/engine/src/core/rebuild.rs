//! Rebuild and reconcile: copy the volume (or the regions a crash may
//! have left different) from the source to a replica that came back.
//! Up to `REBUILD_WINDOW_SEGMENTS` segments are copied at once, each under
//! a lock that holds overlapping client writes from the moment it enters
//! the window until its write is acknowledged; segments finish in any
//! order. A run's state (`Rebuild`, its `Segment`s, `InFlight` and `Step`)
//! is in `types`.

use std::collections::VecDeque;

use lull_net::shared::SharedBuf;
use lull_proto::replica::{self as proto, Header, Kind};

use super::ids::{ReplicaId, ReplicaSet};
use super::intent::has_bit;
use super::io::overlaps;
use super::types::{
    CopyDone, CopyKind, CopyMap, Engine, InFlight, LogLevel, Lookup, Milestone, Payload, RState,
    Rebuild, Received, Segment, Step, Sub, SubKind,
};

/// Segments copied at once. One segment at a time left the link idle for
/// a read's and a write's round trip per segment (~26 MiB/s reconciling,
/// ~257 MiB/s rebuilding, on loopback); 64 segments of 128 KiB keep 8 MiB
/// in flight, reads of later segments overlapping writes of earlier ones,
/// while bounding what a run holds: 8 MiB of data (in pipes or buffers)
/// locked against client writes, and one request slot each (a replica's
/// two connections have 256). A hole that a recheck splits keeps its rest
/// in the window, and no recheck starts while the window is over the
/// bound, so it holds at most twice as many.
pub const REBUILD_WINDOW_SEGMENTS: usize = 64;

/// Largest hole trimmed on the rebuild target in one request: TRIM carries
/// a u32 length; 1 GiB keeps each request well inside it.
pub const REBUILD_TRIM_BYTES: u64 = 1 << 30;

/// Range scanned per EXTENTS request. The replica stops earlier when it has
/// `MAX_EXTENTS_PER_REPLY` extents; 1 GiB fits the u32 length field.
pub const REBUILD_SCAN_BYTES: u64 = 1 << 30;

/// Rebuild progress is logged at least this often.
pub const REBUILD_LOG_INTERVAL_NS: u64 = 5_000_000_000;

impl Engine {
    // ---- rebuild -----------------------------------------------------------

    fn start_rebuild_if_needed(&mut self) {
        if self.rebuild.is_some() {
            return;
        }
        // A replica still looking for a change record waits.
        let Some(target) = self.replicas.position(|r| {
            r.state == RState::Rebuilding
                && !matches!(r.lookup, Lookup::Ask { .. } | Lookup::Asking { .. })
        }) else {
            return;
        };
        let healthy = self.healthy_set();
        let Some(first) = healthy.iter().next() else {
            return;
        };
        let (source, regions, kind) = match (
            &self.replicas[target].reconcile,
            &self.replicas[target].lookup,
        ) {
            (Some(bits), _) => (
                first,
                Some(CopyMap {
                    bits: bits.clone(),
                    region_bytes: self.region_bytes,
                }),
                CopyKind::Reconcile,
            ),
            (None, Lookup::Found { from, map }) if healthy.contains(*from) => {
                (*from, Some(map.clone()), CopyKind::Delta)
            }
            // Its record's holder left: `progress_lookups` asks again.
            (None, Lookup::Found { .. }) => return,
            (None, _) => (first, None, CopyKind::Full),
        };
        self.rebuild_runs += 1;
        let total_bytes = regions
            .as_ref()
            .map_or(self.size_bytes, |m| self.map_bytes(m));
        let rb = Rebuild {
            run: self.rebuild_runs,
            target,
            source,
            regions,
            kind,
            total_bytes,
            done_bytes: 0,
            scanned: 0,
            scan: None,
            segments: VecDeque::new(),
            window: VecDeque::with_capacity(REBUILD_WINDOW_SEGMENTS),
            started_ns: self.now,
            copied_bytes: 0,
            last_log_ns: self.now,
            last_log_pct: 0,
        };
        self.rebuild = Some(rb);
        let (t, s) = (
            self.replicas[target].addr.clone(),
            self.replicas[source].addr.clone(),
        );
        let what = if kind == CopyKind::Reconcile {
            "reconcile"
        } else {
            "rebuild"
        };
        let kind = kind.as_str();
        self.log(
            LogLevel::Info,
            format!("{what} of replica {t} from {s} started (kind {kind}, {total_bytes} bytes)"),
        );
    }

    /// The next range `[start, end)` the run scans from `scanned` on: the
    /// rest of the volume, or for a copy restricted to regions the rest of
    /// the volume from the next of them (one scan covers many scattered
    /// regions; `on_extents` keeps what lies in them). `None` when nothing
    /// is left.
    fn next_copy_range(&self, rb: &Rebuild) -> Option<(u64, u64)> {
        if rb.scanned >= self.size_bytes {
            return None;
        }
        let Some(map) = rb.regions.as_ref() else {
            return Some((rb.scanned, self.size_bytes));
        };
        let (bits, region_bytes) = (&map.bits, map.region_bytes);
        let n = self.size_bytes.div_ceil(region_bytes) as usize;
        let mut g = (rb.scanned / region_bytes) as usize;
        while g < n && !has_bit(bits, g) {
            g += 1;
        }
        if g == n {
            return None;
        }
        Some((rb.scanned.max(g as u64 * region_bytes), self.size_bytes))
    }

    pub(super) fn progress_rebuild(&mut self) {
        self.start_rebuild_if_needed();
        let Some(rb) = self.rebuild.as_mut() else {
            return;
        };
        let run = rb.run;
        // Admit queued segments into the window, data ones within the
        // bandwidth limit (holes move no data).
        let now = self.now;
        while rb.window.len() < REBUILD_WINDOW_SEGMENTS {
            let Some(&seg) = rb.segments.front() else {
                break;
            };
            if seg.data && !self.rebuild_limit.take(seg.len, now) {
                break;
            }
            rb.segments.pop_front();
            rb.window.push_back(InFlight {
                seg,
                step: Step::Draining,
            });
        }
        // Scan ahead while the window copies what the last scan found.
        if rb.segments.is_empty() && rb.scan.is_none() {
            let (source, empty) = (rb.source, rb.window.is_empty());
            let next = self
                .rebuild
                .as_ref()
                .and_then(|rb| self.next_copy_range(rb));
            match next {
                // Not while a snapshot operation runs: the replica would
                // join the healthy set without the snapshot the others
                // take (`snapshot`); it finishes once that one ends.
                None if empty && self.snapshot.is_none() => return self.finish_rebuild(),
                None if empty => return,
                None => {}
                Some((start, end)) => {
                    let len = REBUILD_SCAN_BYTES.min(end - start) as u32;
                    if self.send_any(
                        source,
                        SubKind::Rebuild(run),
                        Kind::Extents,
                        start,
                        len,
                        Payload::None,
                    ) {
                        if let Some(rb) = self.rebuild.as_mut() {
                            rb.scan = Some(start);
                        }
                    }
                }
            }
        }
        let n = self.rebuild.as_ref().map_or(0, |rb| rb.window.len());
        for i in 0..n {
            if !self.advance_segment(run, i) {
                return;
            }
        }
    }

    /// Move the `i`th segment of the window one step if it can. `false`
    /// when the run is gone.
    fn advance_segment(&mut self, run: u64, i: usize) -> bool {
        let Some(rb) = self.rebuild.as_ref().filter(|rb| rb.run == run) else {
            return false;
        };
        let (source, target) = (rb.source, rb.target);
        let Some(e) = rb.window.get(i) else {
            return true;
        };
        let seg = e.seg;
        let (who, kind, payload, next) = match &e.step {
            Step::Draining => {
                let range = (seg.offset, seg.end());
                let busy = self
                    .writes_in_flight
                    .iter()
                    .any(|&(_, start, end)| overlaps((start, end), range));
                if busy {
                    return true;
                }
                // Every change to a replica happens under its intent bit,
                // copies too: a reconcile writes the target at its own
                // generation, and should this engine die as well, the
                // target's bit must still say the region may differ. (A
                // full rebuild's target is behind and rebuilt in full
                // anyway; one rule is simpler to check, and costs one MARK
                // per region copied.)
                let (first, last) = self.region_span(seg.offset, seg.len);
                if !self.ensure_marked(first, last, ReplicaSet::only(target)) {
                    return true;
                }
                // The scan may be stale by now (a write may have landed in a
                // hole): a hole is re-checked under the lock before the
                // target's copy of it is trimmed.
                match (seg.data, seg.verified) {
                    (true, _) => (source, Kind::Read, Payload::None, Step::Reading),
                    (false, true) => (target, Kind::Trim, Payload::None, Step::Writing),
                    // A recheck may split the hole and add its rest to
                    // the window; none starts while the window is over its
                    // bound, so it never holds more than twice the bound.
                    (false, false) if rb_len(self) > REBUILD_WINDOW_SEGMENTS => return true,
                    (false, false) => (source, Kind::Extents, Payload::None, Step::Rechecking),
                }
            }
            Step::ReadDone(buf) => {
                let payload = Payload::Data {
                    buf: buf.clone(),
                    len: seg.len as usize,
                };
                (target, Kind::Write, payload, Step::Writing)
            }
            Step::ReadSpliced(_) => {
                // The pipe moves into the frame: only once a slot is sure.
                let Some(c) = self.pick_conn(target) else {
                    return true;
                };
                let Some(e) = self.rebuild.as_mut().and_then(|rb| rb.window.get_mut(i)) else {
                    return true;
                };
                let Step::ReadSpliced(pipe) = std::mem::replace(&mut e.step, Step::Writing) else {
                    return true;
                };
                self.send(
                    target,
                    c,
                    SubKind::Rebuild(run),
                    Kind::Write,
                    seg.offset,
                    seg.len as u32,
                    Payload::Pipe(pipe),
                );
                return self.rebuild.as_ref().is_some_and(|rb| rb.run == run);
            }
            Step::Rechecking | Step::Reading | Step::Writing => return true,
        };
        if self.send_any(
            who,
            SubKind::Rebuild(run),
            kind,
            seg.offset,
            seg.len as u32,
            payload,
        ) {
            if let Some(e) = self
                .rebuild
                .as_mut()
                .filter(|rb| rb.run == run)
                .and_then(|rb| rb.window.get_mut(i))
            {
                e.step = next;
            }
        }
        self.rebuild.as_ref().is_some_and(|rb| rb.run == run)
    }

    /// The window's segment at `offset` in a step matching `pred`.
    fn window_index(&self, offset: u64, pred: fn(&Step) -> bool) -> Option<usize> {
        self.rebuild
            .as_ref()?
            .window
            .iter()
            .position(|e| e.seg.offset == offset && pred(&e.step))
    }

    pub(super) fn on_rebuild_reply(
        &mut self,
        r: ReplicaId,
        sub: Sub,
        run: u64,
        h: Header,
        received: Received,
    ) {
        // A spliced READ reply: its data is in the pipe, the buffer unused.
        let (payload, pipe) = match received {
            Received::Spliced { buf, pipe } => (Some(buf), Some(pipe)),
            Received::Buf(b) => (Some(b), None),
            Received::None => (None, None),
        };
        let current = self.rebuild.as_ref().is_some_and(|rb| rb.run == run);
        if !current {
            if let Some(b) = payload {
                lull_net::bufs::put(b);
            }
            if let Some(p) = pipe {
                lull_uring::pipes::put(p);
            }
            return;
        }
        if let Some(pipe) = pipe {
            if let Some(b) = payload {
                lull_net::bufs::put(b);
            }
            if h.status != 0 || h.kind != Kind::Read {
                lull_uring::pipes::put(pipe);
                return self.protocol_error(r, None, "a spliced reply that is no READ data".into());
            }
            let i = self.window_index(sub.offset, |s| matches!(s, Step::Reading));
            match (i, self.rebuild.as_mut()) {
                (Some(i), Some(rb)) => rb.window[i].step = Step::ReadSpliced(pipe),
                _ => lull_uring::pipes::put(pipe),
            }
            return;
        }
        if h.status != 0 {
            if let Some(b) = payload {
                lull_net::bufs::put(b);
            }
            let why = format!(
                "rebuild {:?} [{}, +{}) failed with errno {}",
                h.kind, h.offset, h.length, h.status
            );
            return self.fail_replica(r, &why, false);
        }
        match h.kind {
            Kind::Extents => {
                let Some(buf) = payload else {
                    // Zero extents: payload_len is 0 and no buffer comes.
                    return self.on_extents(r, sub, h, &[]);
                };
                let parsed = proto::decode_extents(buf.as_slice());
                lull_net::bufs::put(buf);
                match parsed {
                    Ok(ext) => self.on_extents(r, sub, h, &ext),
                    Err(e) => self.protocol_error(r, None, format!("bad EXTENTS reply: {e}")),
                }
            }
            Kind::Read => {
                let Some(buf) = payload else {
                    return self.protocol_error(r, None, "READ reply without data".into());
                };
                let i = self.window_index(sub.offset, |s| matches!(s, Step::Reading));
                match (i, self.rebuild.as_mut()) {
                    (Some(i), Some(rb)) => rb.window[i].step = Step::ReadDone(SharedBuf::new(buf)),
                    _ => lull_net::bufs::put(buf),
                }
            }
            Kind::Write | Kind::Trim => {
                let i = self.window_index(sub.offset, |s| matches!(s, Step::Writing));
                let Some(rb) = self.rebuild.as_mut() else {
                    return;
                };
                if let Some(e) = i.and_then(|i| rb.window.remove(i)) {
                    rb.done_bytes += e.seg.len;
                    if e.seg.data {
                        rb.copied_bytes += e.seg.len;
                    }
                }
                let pct = rb.done_bytes.saturating_mul(100) / rb.total_bytes.max(1);
                let due = self.now.saturating_sub(rb.last_log_ns) >= REBUILD_LOG_INTERVAL_NS;
                if pct >= rb.last_log_pct + 10 || due {
                    rb.last_log_pct = pct;
                    rb.last_log_ns = self.now;
                    let msg = self.rebuild_progress_line();
                    self.log(LogLevel::Info, msg);
                }
            }
            _ => self.protocol_error(
                r,
                None,
                format!("unexpected {:?} reply during rebuild", h.kind),
            ),
        }
    }

    pub(super) fn rebuild_progress_line(&self) -> String {
        let Some(rb) = &self.rebuild else {
            return String::new();
        };
        let secs = (self.now.saturating_sub(rb.started_ns) as f64 / 1e9).max(1e-9);
        let mib_s = rb.copied_bytes as f64 / (1 << 20) as f64 / secs;
        format!(
            "{} of replica {}: {}% ({} of {} bytes scanned, {:.1} MiB copied, {:.1} MiB/s)",
            match rb.kind {
                CopyKind::Reconcile => "reconcile",
                CopyKind::Delta => "delta rebuild",
                CopyKind::Full => "rebuild",
            },
            self.replicas[rb.target].addr,
            rb.done_bytes.saturating_mul(100) / rb.total_bytes.max(1),
            rb.done_bytes,
            rb.total_bytes,
            rb.copied_bytes as f64 / (1 << 20) as f64,
            mib_s
        )
    }

    /// Turn an EXTENTS reply into hole and data segments over the scanned
    /// range. Every field is untrusted: ranges must be sorted, inside the
    /// scan, and the scan must move forward.
    fn on_extents(&mut self, r: ReplicaId, sub: Sub, h: Header, ext: &[(u64, u64)]) {
        let start = sub.offset;
        let end_req = sub.offset + u64::from(sub.length);
        let scan_end = h.offset;
        if scan_end <= start || scan_end > end_req {
            return self.protocol_error(
                r,
                None,
                format!("EXTENTS scan end {scan_end} outside ({start}, {end_req}]"),
            );
        }
        let chunk = self.rebuild_chunk_bytes;
        let mut segs = VecDeque::new();
        let mut pos = start;
        for &(off, len) in ext {
            let Some(e_end) = off.checked_add(len) else {
                return self.protocol_error(r, None, "EXTENTS record overflows".into());
            };
            if len == 0 || off < pos || e_end > scan_end {
                return self.protocol_error(
                    r,
                    None,
                    "EXTENTS records unsorted or outside the scan".into(),
                );
            }
            push_segments(&mut segs, pos, off, false, chunk);
            push_segments(&mut segs, off, e_end, true, chunk);
            pos = e_end;
        }
        push_segments(&mut segs, pos, scan_end, false, chunk);
        let recheck = self.window_index(start, |s| matches!(s, Step::Rechecking));
        let Some(rb) = self.rebuild.as_mut() else {
            return;
        };
        if let Some(i) = recheck {
            // Refine the held segment; its first piece stayed locked all
            // along, so what the source said about it still holds. The
            // rest stays in the window, held, as one hole to check again
            // (rarely: only a write since the scan, or a reply cut short,
            // leaves one).
            let held = rb.window[i].seg;
            let Some(mut first) = segs.pop_front() else {
                return;
            };
            first.verified = true;
            rb.window[i] = InFlight {
                seg: first,
                step: Step::Draining,
            };
            if first.end() < held.end() {
                let rest = Segment {
                    offset: first.end(),
                    len: held.end() - first.end(),
                    data: false,
                    verified: false,
                };
                rb.window.insert(
                    i + 1,
                    InFlight {
                        seg: rest,
                        step: Step::Draining,
                    },
                );
            }
        } else if rb.scan == Some(start) {
            rb.scan = None;
            rb.scanned = scan_end;
            match &rb.regions {
                Some(map) => rb.segments.extend(clip(segs, &map.bits, map.region_bytes)),
                None => rb.segments.extend(segs),
            }
        }
    }

    fn finish_rebuild(&mut self) {
        let Some(rb) = self.rebuild.take() else {
            return;
        };
        let duration_ns = self.now.saturating_sub(rb.started_ns);
        let secs = (duration_ns as f64 / 1e9).max(1e-9);
        let addr = self.replicas[rb.target].addr.clone();
        self.replicas[rb.target].state = RState::Healthy;
        self.replicas[rb.target].reconcile = None;
        self.replicas[rb.target].lookup = Lookup::Off;
        self.replicas[rb.target].intent = None;
        self.replicas[rb.target].last_rebuild = Some(CopyDone {
            kind: rb.kind(),
            bytes: rb.done_bytes,
            bytes_copied: rb.copied_bytes,
            duration_ns,
        });
        self.log(
            LogLevel::Info,
            format!(
                "{} complete: replica {addr} is healthy (kind {}, {} bytes in {:.1} s, \
                 {:.1} MiB copied, {:.1} MiB/s)",
                if rb.kind == CopyKind::Reconcile {
                    "reconcile"
                } else {
                    "rebuild"
                },
                rb.kind().as_str(),
                rb.done_bytes,
                secs,
                rb.copied_bytes as f64 / (1 << 20) as f64,
                rb.copied_bytes as f64 / (1 << 20) as f64 / secs
            ),
        );
        self.milestone(Milestone::CopyComplete {
            replica: addr,
            kind: rb.kind,
        });
        // Healthy again: the records kept for it while it was away end.
        self.drop_change_records(rb.target);
        self.start_bump();
    }
}

/// The parts of `segs` inside the regions set in `bits` (regions of
/// `region_bytes`), in order.
fn clip(segs: VecDeque<Segment>, bits: &[u8], region_bytes: u64) -> VecDeque<Segment> {
    let mut out = VecDeque::new();
    for s in segs {
        let mut pos = s.offset;
        while pos < s.end() {
            let g = pos / region_bytes;
            let run_end = {
                let mut e = g;
                let set = has_bit(bits, g as usize);
                while (e + 1) * region_bytes < s.end() && has_bit(bits, (e + 1) as usize) == set {
                    e += 1;
                }
                ((e + 1) * region_bytes).min(s.end())
            };
            if has_bit(bits, g as usize) {
                out.push_back(Segment {
                    offset: pos,
                    len: run_end - pos,
                    ..s
                });
            }
            pos = run_end;
        }
    }
    out
}

fn rb_len(e: &Engine) -> usize {
    e.rebuild.as_ref().map_or(0, |rb| rb.window.len())
}

/// Append [from, to) as segments of at most the chunk size for its kind
/// (`data_chunk` for data).
fn push_segments(segs: &mut VecDeque<Segment>, from: u64, to: u64, data: bool, data_chunk: u64) {
    let chunk = if data { data_chunk } else { REBUILD_TRIM_BYTES };
    let mut pos = from;
    while pos < to {
        let len = chunk.min(to - pos);
        segs.push_back(Segment {
            offset: pos,
            len,
            data,
            verified: false,
        });
        pos += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::types::REBUILD_CHUNK_BYTES;

    #[test]
    fn the_node_limit_is_shared_equally_by_running_copies() {
        use crate::core::types::{NodeRebuildLimit, RebuildLimit};
        let node = NodeRebuildLimit::default();
        node.set(10_000_000);
        let (mut a, mut b) = (RebuildLimit::default(), RebuildLimit::default());
        a.set_node(node.clone());
        b.set_node(node.clone());
        a.count(true);
        b.count(true);
        assert_eq!(node.copies(), 2);
        // Over 10 s, each takes 1 MiB segments whenever it may.
        let mut got = [0u64; 2];
        let mut now = 0;
        while now < 10_000_000_000 {
            for (i, l) in [&mut a, &mut b].into_iter().enumerate() {
                while l.take(REBUILD_CHUNK_BYTES, now) {
                    got[i] += REBUILD_CHUNK_BYTES;
                }
            }
            now += 10_000_000;
        }
        for g in got {
            // 5 MB/s each for 10 s, plus the saved burst and one segment
            // of debt.
            assert!((50_000_000..=53_500_000).contains(&g), "{got:?}");
        }
        b.count(false);
        assert_eq!(node.copies(), 1);
        drop(a);
        assert_eq!(node.copies(), 0, "a dropped engine leaves the count");
    }

    #[test]
    fn clipping_keeps_only_the_regions_set() {
        let seg = |offset, len, data| Segment {
            offset,
            len,
            data,
            verified: false,
        };
        // Regions of 10: 1, 2 and 5 set.
        let bits = [0b0010_0110u8];
        let segs = VecDeque::from([seg(0, 25, true), seg(25, 40, false)]);
        let got: Vec<(u64, u64, bool)> = clip(segs, &bits, 10)
            .iter()
            .map(|s| (s.offset, s.len, s.data))
            .collect();
        assert_eq!(got, [(10, 15, true), (25, 5, false), (50, 10, false)]);
        assert!(clip(VecDeque::from([seg(30, 20, true)]), &bits, 10).is_empty());
    }

    #[test]
    fn segments_are_cut_at_the_chunk_of_their_kind() {
        let mut segs = VecDeque::new();
        push_segments(
            &mut segs,
            0,
            2 * REBUILD_CHUNK_BYTES + 5,
            true,
            REBUILD_CHUNK_BYTES,
        );
        let lens: Vec<u64> = segs.iter().map(|s| s.len).collect();
        assert_eq!(lens, [REBUILD_CHUNK_BYTES, REBUILD_CHUNK_BYTES, 5]);
        assert_eq!(segs[2].end(), 2 * REBUILD_CHUNK_BYTES + 5);
        assert!(segs.iter().all(|s| s.data && !s.verified));
        segs.clear();
        push_segments(&mut segs, 7, 7, false, REBUILD_CHUNK_BYTES);
        assert!(segs.is_empty());
        push_segments(
            &mut segs,
            0,
            REBUILD_TRIM_BYTES + 1,
            false,
            REBUILD_CHUNK_BYTES,
        );
        let holes: Vec<(u64, u64)> = segs.iter().map(|s| (s.offset, s.len)).collect();
        assert_eq!(holes, [(0, REBUILD_TRIM_BYTES), (REBUILD_TRIM_BYTES, 1)]);
    }
}
