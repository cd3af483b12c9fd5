//! Change records and delta rebuilds: when a healthy replica leaves the
//! healthy set, every replica still healthy keeps a record of the regions
//! written from then on (CHANGES_START, keyed by the absent replica's name
//! and generation; `lull_proto::replica`, "Change records"). When it comes
//! back with that generation, a healthy replica's record (CHANGES_GET)
//! restricts its copy to those regions: a delta rebuild. Without one (a
//! new or replaced replica, another generation, a record lost with its
//! replica's write-intent record) the copy is a full rebuild, and the log
//! says why. The records live on the replicas, so an engine that dies and
//! starts again finds them.
//!
//! The record is seeded with the regions of the writes in flight when the
//! replica left (it may or may not have them), and no new write goes out
//! until every CHANGES_START is answered (a write sent on another
//! connection could otherwise reach a healthy replica before its START
//! and be missed): client writes wait one round trip when a replica
//! fails, as their acknowledgements already wait for the generation bump.
//!
//! What a delta copies is the record's regions, plus:
//! - the regions the returning replica's own write-intent record names
//!   (its writes that a crash of its own may have lost: a replica clears
//!   an intent bit on disk only after the data under it is durable);
//! - the ranges of writes in flight when the CHANGES_GET was sent (sent
//!   before the replica rejoined the write set, they may reach the record
//!   after the GET).

use lull_bdev::IoBuf;
use lull_proto::replica::{self as proto, ChangeKey, Header, Kind};

use super::ids::{ReplicaId, ReplicaSet};
use super::intent::count_bits;
use super::types::{CopyMap, Engine, LogLevel, Lookup, Payload, RState, SubKind};

impl Engine {
    /// The change key of replica `r`: its name and the generation it
    /// holds (the highest it reported or persisted for this engine).
    /// `None` when its name is too long for a key (a full rebuild then).
    fn change_key(&self, r: ReplicaId, seed: Vec<u8>) -> Option<Vec<u8>> {
        let rep = &self.replicas[r];
        let key = ChangeKey {
            generation: rep.generation.max(rep.attached_gen),
            peer: rep.addr.to_string(),
            seed,
        };
        proto::encode_change_key(&key).ok()
    }

    /// Healthy replica `r` just failed: every replica still healthy starts
    /// a change record for it.
    pub(super) fn start_change_records(&mut self, r: ReplicaId) {
        let mut seed = CopyMap {
            bits: vec![0u8; proto::change_regions(self.size_bytes).div_ceil(8) as usize],
            region_bytes: proto::change_region_bytes(self.size_bytes),
        };
        for &(_, start, end) in &self.writes_in_flight {
            set_map_range(&mut seed, start, end);
        }
        if self.diverged.contains(r) {
            self.diverged.remove(r);
            set_map_range(&mut seed, 0, self.size_bytes);
        }
        let Some(key) = self.change_key(r, seed.bits) else {
            let addr = self.replicas[r].addr.clone();
            return self.log(
                LogLevel::Warn,
                format!(
                    "replica {addr}: name too long for a change record; it will be rebuilt in full"
                ),
            );
        };
        for h in self.healthy_set().iter() {
            if self.send_any(
                h,
                SubKind::Changes,
                Kind::ChangesStart,
                0,
                key.len() as u32,
                Payload::Control(key.clone()),
            ) {
                self.changes_starting += 1;
            }
        }
    }

    /// Replica `r` is healthy again (or removed): the healthy replicas end
    /// their change records for it.
    pub(super) fn drop_change_records(&mut self, r: ReplicaId) {
        let Some(key) = self.change_key(r, Vec::new()) else {
            return;
        };
        for h in self.healthy_set().iter().filter(|&h| h != r) {
            self.send_any(
                h,
                SubKind::Changes,
                Kind::ChangesDrop,
                0,
                key.len() as u32,
                Payload::Control(key.clone()),
            );
        }
    }

    /// A replica that came back to be rebuilt (not reconciled): look for a
    /// change record of its generation; generation 0 is a new replica.
    pub(super) fn begin_lookup(&mut self, r: ReplicaId) {
        let rep = &mut self.replicas[r];
        if rep.generation > 0 {
            rep.lookup = Lookup::Ask {
                asked: ReplicaSet::EMPTY,
            };
            return;
        }
        rep.lookup = Lookup::Off;
        let addr = rep.addr.clone();
        self.log(
            LogLevel::Info,
            format!("replica {addr} is new (generation 0): full rebuild"),
        );
    }

    /// Sends the CHANGES_GETs due: each replica in `Lookup::Ask` asks the
    /// next healthy replica it has not asked; with none left, it is
    /// rebuilt in full.
    pub(super) fn progress_lookups(&mut self) {
        for r in self.replicas.ids() {
            if self.replicas[r].state != RState::Rebuilding {
                continue;
            }
            let asked = match &self.replicas[r].lookup {
                Lookup::Ask { asked } => *asked,
                Lookup::Found { from, .. } if !self.healthy_set().contains(*from) => {
                    // Its holder left: another may hold one too.
                    ReplicaSet::only(*from)
                }
                _ => continue,
            };
            let Some(from) = self.healthy_set().iter().find(|&h| !asked.contains(h)) else {
                self.replicas[r].lookup = Lookup::Off;
                let (addr, generation) =
                    (self.replicas[r].addr.clone(), self.replicas[r].generation);
                self.log(
                    LogLevel::Info,
                    format!(
                        "replica {addr} (generation {generation}): no healthy replica holds a change record for it; full rebuild"
                    ),
                );
                continue;
            };
            let Some(key) = self.change_key(r, Vec::new()) else {
                self.replicas[r].lookup = Lookup::Off;
                continue;
            };
            let racing = self
                .writes_in_flight
                .iter()
                .map(|&(_, start, end)| (start, end))
                .collect();
            if self.send_any(
                from,
                SubKind::ChangesGet(r),
                Kind::ChangesGet,
                0,
                key.len() as u32,
                Payload::Control(key),
            ) {
                self.replicas[r].lookup = Lookup::Asking {
                    from,
                    asked: asked.union(ReplicaSet::only(from)),
                    racing,
                };
            }
        }
    }

    /// The CHANGES_GET asked of `from` for `target` ended without a reply
    /// (its connection broke): ask the others.
    pub(super) fn lookup_failed(&mut self, target: ReplicaId, from: ReplicaId) {
        if let Some(rep) = self.replicas.get_mut(target) {
            if let Lookup::Asking { from: f, asked, .. } = &rep.lookup {
                if *f == from {
                    rep.lookup = Lookup::Ask { asked: *asked };
                }
            }
        }
    }

    pub(super) fn on_changes_reply(&mut self, r: ReplicaId, h: Header) {
        if h.kind == Kind::ChangesStart {
            self.changes_starting = self.changes_starting.saturating_sub(1);
        }
        if h.status != 0 {
            let addr = self.replicas[r].addr.clone();
            let errno = std::io::Error::from_raw_os_error(h.status as i32);
            self.log(
                LogLevel::Warn,
                format!(
                    "replica {addr}: {:?} refused: {errno}; a replica away may be rebuilt in full",
                    h.kind
                ),
            );
        }
    }

    pub(super) fn on_changes_get_reply(
        &mut self,
        from: ReplicaId,
        target: ReplicaId,
        h: Header,
        payload: Option<IoBuf>,
    ) {
        let bits = payload.map(|b| {
            let v = b.as_slice().to_vec();
            lull_net::bufs::put(b);
            v
        });
        let Some(rep) = self.replicas.get(target) else {
            return;
        };
        let Lookup::Asking {
            from: f,
            asked,
            racing,
        } = &rep.lookup
        else {
            return;
        };
        if *f != from || rep.state != RState::Rebuilding {
            return;
        }
        let (asked, racing) = (*asked, racing.clone());
        let (addr, generation) = (rep.addr.clone(), rep.generation);
        let holder = self.replicas[from].addr.clone();
        if h.status != 0 {
            let why = match h.status as i32 {
                libc::ENOENT => "none for it".to_string(),
                libc::ESTALE => format!("one for generation {}", h.offset),
                e => format!("refused: {}", std::io::Error::from_raw_os_error(e)),
            };
            self.log(
                LogLevel::Info,
                format!(
                    "replica {addr} (generation {generation}): change record on {holder}: {why}"
                ),
            );
            self.replicas[target].lookup = Lookup::Ask { asked };
            return;
        }
        let region_bytes = h.offset;
        let regions = self.size_bytes.div_ceil(region_bytes.max(1));
        let bits = bits.unwrap_or_default();
        if region_bytes == 0 || bits.len() as u64 != regions.div_ceil(8) {
            return self.protocol_error(
                from,
                None,
                format!("CHANGES_GET reply: {} bytes of regions of {region_bytes} bytes for a volume of {}", bits.len(), self.size_bytes),
            );
        }
        let mut map = CopyMap { bits, region_bytes };
        let recorded = self.map_bytes(&map);
        // Its own writes a crash of its own may have lost, and writes that
        // may have reached the record after the GET.
        let Some(own) = self.replicas[target].intent.take() else {
            self.log(
                LogLevel::Warn,
                format!("replica {addr}: its write-intent record is not known; full rebuild"),
            );
            self.replicas[target].lookup = Lookup::Off;
            return;
        };
        for g in 0..self.regions.len() {
            if super::intent::has_bit(&own, g) {
                let start = g as u64 * self.region_bytes;
                set_map_range(&mut map, start, self.region_end(g));
            }
        }
        for (start, end) in racing {
            set_map_range(&mut map, start, end);
        }
        let total = self.map_bytes(&map);
        self.log(
            LogLevel::Info,
            format!(
                "replica {addr} (generation {generation}): change record on {holder}: {} region(s) of {region_bytes} bytes, {recorded} bytes; delta rebuild of {total} bytes",
                count_bits(&map.bits)
            ),
        );
        self.replicas[target].lookup = Lookup::Found { from, map };
    }

    /// Bytes of the volume the regions of `map` cover.
    pub(super) fn map_bytes(&self, map: &CopyMap) -> u64 {
        self.regions_bytes(&map.bits, map.region_bytes)
    }
}

/// Sets the regions of `map` that `[start, end)` touches.
fn set_map_range(map: &mut CopyMap, start: u64, end: u64) {
    if end <= start {
        return;
    }
    let rb = map.region_bytes;
    for g in start / rb..=(end - 1) / rb {
        if let Some(b) = map.bits.get_mut((g / 8) as usize) {
            *b |= 1 << (g % 8);
        }
    }
}
