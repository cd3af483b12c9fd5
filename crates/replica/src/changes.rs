//! Change records: for each replica of the volume that left the healthy
//! set, which regions of [`change_region_bytes`] were written here since
//! (the engine's CHANGES_START, see [`lull_proto::replica`]). A delta
//! rebuild copies only those regions to the replica when it comes back.
//!
//! ```ignore
//! let mut c = Changes::new(size_bytes);
//! c.start(&key)?;                                       // seeded with key.seed
//! c.note(offset, len);                                  // every modifying request
//! let record = c.get("r1@10.0.0.2:10900");
//! ```
//!
//! # Durability
//!
//! Bits are set in memory as requests arrive and stored by the
//! write-intent persister (`crate::intent`) in `DIR/changes.bin`, written
//! whole and renamed into place, *before* each store of the write-intent
//! record. Every write lies in a region whose intent bit was durable
//! before it was sent, and that bit is cleared on disk only by a store
//! that first stored the change bits set before it. So after a crash the
//! stored records together with the intent record cover every write: at
//! open each record is completed with the intent record's regions. A lost
//! intent record (or a changes file that does not decode) loses every
//! change record: those replicas get full rebuilds, and the log says so.
//!
//! # File layout
//!
//! Big-endian: `magic u32 "LULD" | version u32 | region_bytes u64 |
//! regions u64 | records u32`, then per record `generation u64 | name_len
//! u16 | name | bitmap` (`regions` bits, least significant first), then a
//! crc32 of everything before it.

use std::io;
use std::path::Path;

use lull_proto::replica::{change_region_bytes, change_regions, ChangeKey, MAX_CHANGE_PEER_BYTES};

use crate::durable;

/// File name of the records inside the replica directory.
pub const CHANGES_FILE: &str = "changes.bin";

/// Layout version; a file with another version is lost, never misread.
pub const CHANGES_FORMAT_VERSION: u32 = 1;

/// Records one replica keeps at once: one for every other replica a
/// volume may have (`lull_engine::MAX_REPLICAS` is 16). At most
/// 15 × 128 KiB for a volume of 64 GiB or more; 2 KiB each for 1 GiB.
pub const MAX_CHANGE_RECORDS: usize = 15;

/// "LULD" opens the file.
const CHANGES_MAGIC: u32 = u32::from_be_bytes(*b"LULD");

/// magic, version, region_bytes, regions, records.
const FILE_HEADER_BYTES: usize = 4 + 4 + 8 + 8 + 4;

/// Largest file accepted: every record at its largest.
const MAX_FILE_BYTES: u64 = (FILE_HEADER_BYTES
    + MAX_CHANGE_RECORDS * (8 + 2 + MAX_CHANGE_PEER_BYTES + (1 << 17))
    + 4) as u64;

/// One replica's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub peer: String,
    /// The generation the replica had when it left.
    pub generation: u64,
    pub bitmap: Vec<u8>,
}

/// Why CHANGES_START was refused.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("already {MAX_CHANGE_RECORDS} change records (one per other replica of a volume)")]
    TooMany,
    #[error("seed of {len} bytes for a record of {want}")]
    Seed { len: usize, want: usize },
}

impl StartError {
    pub fn errno(&self) -> i32 {
        match self {
            StartError::TooMany => libc::ENOSPC,
            StartError::Seed { .. } => libc::EINVAL,
        }
    }
}

/// The records of one replica (in memory; see the module doc for disk).
#[derive(Debug)]
pub struct Changes {
    region_bytes: u64,
    regions: u64,
    records: Vec<Record>,
    /// Changed since the last encode for a store.
    dirty: bool,
}

impl Changes {
    pub fn new(size_bytes: u64) -> Changes {
        Changes {
            region_bytes: change_region_bytes(size_bytes),
            regions: change_regions(size_bytes),
            records: Vec::new(),
            dirty: false,
        }
    }

    pub fn region_bytes(&self) -> u64 {
        self.region_bytes
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    pub fn records(&self) -> &[Record] {
        &self.records
    }

    /// Starts (or restarts) the record of `key.peer`, seeded with
    /// `key.seed` (the writes in flight when the peer left; empty: none).
    /// A seed shorter than the record is one an engine made before the
    /// volume grew (GROW keeps the region size): its regions are the
    /// first ones.
    pub fn start(&mut self, key: &ChangeKey) -> Result<(), StartError> {
        if key.seed.len() > self.bitmap_bytes() {
            return Err(StartError::Seed {
                len: key.seed.len(),
                want: self.bitmap_bytes(),
            });
        }
        let at = match self.records.iter().position(|r| r.peer == key.peer) {
            Some(i) => i,
            None if self.records.len() >= MAX_CHANGE_RECORDS => return Err(StartError::TooMany),
            None => {
                self.records.push(Record {
                    peer: key.peer.clone(),
                    generation: 0,
                    bitmap: Vec::new(),
                });
                self.records.len() - 1
            }
        };
        let mut bitmap = vec![0u8; self.bitmap_bytes()];
        for (b, s) in bitmap.iter_mut().zip(&key.seed) {
            *b = *s;
        }
        // Bits past the last region stay zero whatever the seed says.
        if !self.regions.is_multiple_of(8) {
            if let Some(last) = bitmap.last_mut() {
                *last &= (1u8 << (self.regions % 8)) - 1;
            }
        }
        self.records[at] = Record {
            peer: key.peer.clone(),
            generation: key.generation,
            bitmap,
        };
        self.dirty = true;
        Ok(())
    }

    /// Ends the record of `peer`; whether there was one.
    pub fn drop_peer(&mut self, peer: &str) -> bool {
        let before = self.records.len();
        self.records.retain(|r| r.peer != peer);
        let dropped = self.records.len() != before;
        self.dirty |= dropped;
        dropped
    }

    pub fn get(&self, peer: &str) -> Option<&Record> {
        self.records.iter().find(|r| r.peer == peer)
    }

    /// A modifying request over `[offset, offset + len)` arrived: its
    /// regions are set in every record. The caller checked the range.
    pub fn note(&mut self, offset: u64, len: u64) {
        if self.records.is_empty() || len == 0 {
            return;
        }
        let first = offset / self.region_bytes;
        let last = ((offset + len - 1) / self.region_bytes).min(self.regions - 1);
        for r in &mut self.records {
            for g in first..=last {
                let (byte, mask) = ((g / 8) as usize, 1u8 << (g % 8));
                if r.bitmap[byte] & mask == 0 {
                    r.bitmap[byte] |= mask;
                    self.dirty = true;
                }
            }
        }
    }

    /// Sets in every record the regions `intent` names (at open: what the
    /// stored records may lack after a crash).
    pub fn complete_with_intent(&mut self, intent: &[u8], intent_region_bytes: u64) {
        let mut records = std::mem::take(&mut self.records);
        for r in &mut records {
            self.add_intent(&mut r.bitmap, intent, intent_region_bytes);
        }
        self.records = records;
        self.dirty = true;
    }

    fn add_intent(&self, bitmap: &mut [u8], intent: &[u8], intent_region_bytes: u64) {
        let size = self.regions * self.region_bytes;
        for i in (0..intent.len() * 8).filter(|&i| intent[i / 8] & (1 << (i % 8)) != 0) {
            let start = i as u64 * intent_region_bytes;
            if start >= size {
                break;
            }
            let end = (start + intent_region_bytes).min(size);
            let first = start / self.region_bytes;
            let last = (end - 1) / self.region_bytes;
            // At most MAX_CHANGE_REGIONS, so both fit a u32.
            set_range(bitmap, first as u32, (last - first + 1) as u32, true);
        }
    }

    fn bitmap_bytes(&self) -> usize {
        (self.regions as usize).div_ceil(8)
    }

    /// The volume grew to `size_bytes` with the same region size (GROW):
    /// every record gets the new regions, none written, and is stored
    /// again with the new geometry.
    pub fn grow(&mut self, size_bytes: u64) {
        debug_assert_eq!(change_region_bytes(size_bytes), self.region_bytes);
        self.regions = change_regions(size_bytes).max(self.regions);
        let bytes = self.bitmap_bytes();
        for r in &mut self.records {
            r.bitmap.resize(bytes, 0);
        }
        self.dirty = true;
    }

    /// The file's bytes when the records changed since the last call.
    pub fn take_changed(&mut self) -> Option<Vec<u8>> {
        std::mem::take(&mut self.dirty).then(|| self.encode())
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            FILE_HEADER_BYTES
                + self
                    .records
                    .iter()
                    .map(|r| 10 + r.peer.len() + r.bitmap.len())
                    .sum::<usize>()
                + 4,
        );
        out.extend_from_slice(&CHANGES_MAGIC.to_be_bytes());
        out.extend_from_slice(&CHANGES_FORMAT_VERSION.to_be_bytes());
        out.extend_from_slice(&self.region_bytes.to_be_bytes());
        out.extend_from_slice(&self.regions.to_be_bytes());
        out.extend_from_slice(&(self.records.len() as u32).to_be_bytes());
        for r in &self.records {
            out.extend_from_slice(&r.generation.to_be_bytes());
            // Peer names are at most MAX_CHANGE_PEER_BYTES (the codec's check).
            out.extend_from_slice(&(r.peer.len() as u16).to_be_bytes());
            out.extend_from_slice(r.peer.as_bytes());
            out.extend_from_slice(&r.bitmap);
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_be_bytes());
        out
    }

    /// Records from a file's bytes, for a volume of this geometry.
    fn decode(&self, b: &[u8]) -> Result<Vec<Record>, &'static str> {
        let Some((body, crc)) = b.split_last_chunk::<4>() else {
            return Err("shorter than its checksum");
        };
        if crc32fast::hash(body) != u32::from_be_bytes(*crc) {
            return Err("checksum mismatch");
        }
        let mut r = Reader(body);
        if r.u32()? != CHANGES_MAGIC {
            return Err("bad magic");
        }
        if r.u32()? != CHANGES_FORMAT_VERSION {
            return Err("another format version");
        }
        if r.u64()? != self.region_bytes || r.u64()? != self.regions {
            return Err("region geometry of another volume size");
        }
        let n = r.u32()? as usize;
        if n > MAX_CHANGE_RECORDS {
            return Err("too many records");
        }
        let mut records = Vec::with_capacity(n);
        for _ in 0..n {
            let generation = r.u64()?;
            let len = r.u16()? as usize;
            if len == 0 || len > MAX_CHANGE_PEER_BYTES {
                return Err("bad peer name length");
            }
            let peer = std::str::from_utf8(r.take(len)?)
                .map_err(|_| "peer name is not UTF-8")?
                .to_string();
            let bitmap = r.take(self.bitmap_bytes())?.to_vec();
            records.push(Record {
                peer,
                generation,
                bitmap,
            });
        }
        if !r.0.is_empty() {
            return Err("trailing bytes");
        }
        Ok(records)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("truncated");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16, &'static str> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().unwrap_or_default(),
        ))
    }
    fn u32(&mut self) -> Result<u32, &'static str> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().unwrap_or_default(),
        ))
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_be_bytes(
            self.take(8)?.try_into().unwrap_or_default(),
        ))
    }
}

/// Loads `dir/changes.bin` for a volume of `size_bytes`, completed with the
/// write-intent record (`intent`, regions of `intent_region_bytes`);
/// `intent_lost`: that record was lost, and so are the change records.
/// Problems are logged and cost the records, never the replica.
pub fn load(
    dir: &Path,
    size_bytes: u64,
    intent: &[u8],
    intent_region_bytes: u64,
    intent_lost: bool,
) -> Changes {
    let mut c = Changes::new(size_bytes);
    let path = dir.join(CHANGES_FILE);
    let bytes = match durable::read_capped(&path, MAX_FILE_BYTES) {
        Ok(None) => return c,
        Ok(Some(b)) => b,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e,
                "change records unreadable: replicas away get full rebuilds");
            c.dirty = true;
            return c;
        }
    };
    let records = match c.decode(&bytes) {
        Ok(r) => r,
        Err(why) => {
            tracing::warn!(path = %path.display(), reason = why,
                "change records lost: replicas away get full rebuilds");
            c.dirty = true;
            return c;
        }
    };
    if intent_lost && !records.is_empty() {
        tracing::warn!(path = %path.display(), records = records.len(),
            "write-intent record lost, so the change records cannot be trusted: replicas away get full rebuilds");
        c.dirty = true;
        return c;
    }
    c.records = records;
    if !c.records.is_empty() {
        c.complete_with_intent(intent, intent_region_bytes);
        for r in &c.records {
            tracing::info!(peer = %r.peer, generation = r.generation,
                regions = r.bitmap.iter().map(|b| b.count_ones()).sum::<u32>(),
                "change record kept for a replica away");
        }
    }
    c
}

/// Stores the file's bytes durably (write, fsync, rename, fsync the
/// directory). Blocking: the persister thread only.
pub fn store(dir: &Path, bytes: &[u8]) -> io::Result<()> {
    durable::store_bytes(&dir.join(CHANGES_FILE), bytes)
        .map_err(|e| io::Error::other(e.to_string()))
}

/// Sets or clears bits `[first, first + count)`; true if any bit changed.
/// The caller checked the range against the region count. Both the
/// write-intent record (`crate::intent`) and the change records use it.
pub fn set_range(bitmap: &mut [u8], first: u32, count: u32, value: bool) -> bool {
    let mut changed = false;
    for i in first as usize..first as usize + count as usize {
        let (byte, mask) = (i / 8, 1u8 << (i % 8));
        let old = bitmap[byte];
        let new = if value { old | mask } else { old & !mask };
        changed |= new != old;
        bitmap[byte] = new;
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;

    const SIZE: u64 = 1 << 30;
    const IRB: u64 = 4 << 20;

    fn key(peer: &str, generation: u64) -> ChangeKey {
        ChangeKey {
            generation,
            peer: peer.into(),
            seed: Vec::new(),
        }
    }

    fn set(bitmap: &[u8]) -> Vec<usize> {
        (0..bitmap.len() * 8)
            .filter(|&i| bitmap[i / 8] & (1 << (i % 8)) != 0)
            .collect()
    }

    #[test]
    fn start_seeds_from_intent_and_note_sets_regions() {
        let mut c = Changes::new(SIZE);
        assert_eq!(c.region_bytes(), 64 << 10);
        let mut seed = vec![0u8; 2048];
        seed[8] = 0xff; // regions 64 to 71
        let seeded = ChangeKey {
            seed,
            ..key("b", 3)
        };
        c.start(&seeded).unwrap();
        let r = c.get("b").unwrap();
        assert_eq!(r.generation, 3);
        assert_eq!(set(&r.bitmap), (64..72).collect::<Vec<_>>());
        // A seed longer than the record is refused; a shorter one is an
        // engine's from before a GROW: its first regions.
        let long = ChangeKey {
            seed: vec![0u8; (c.regions as usize).div_ceil(8) + 1],
            ..key("c", 1)
        };
        assert!(c.start(&long).is_err());
        let short = ChangeKey {
            seed: vec![0x01; 1],
            ..key("c", 1)
        };
        c.start(&short).unwrap();
        assert_eq!(set(&c.get("c").unwrap().bitmap), [0]);
        assert!(c.drop_peer("c"));
        c.note(0, 4096);
        c.note((64 << 10) - 1, 2);
        c.note(SIZE - 1, 1);
        let r = c.get("b").unwrap();
        let mut want: Vec<usize> = vec![0, 1];
        want.extend(64..72);
        want.push(16383);
        assert_eq!(set(&r.bitmap), want);
        // A restart of the same peer replaces its record.
        c.start(&key("b", 5)).unwrap();
        assert_eq!(c.get("b").unwrap().generation, 5);
        assert!(set(&c.get("b").unwrap().bitmap).is_empty());
        assert!(c.drop_peer("b"));
        assert!(!c.drop_peer("b"));
        assert!(c.is_empty());
    }

    #[test]
    fn records_are_bounded() {
        let mut c = Changes::new(SIZE);
        for i in 0..MAX_CHANGE_RECORDS {
            c.start(&key(&format!("r{i}"), 1)).unwrap();
        }
        assert!(c.start(&key("one-more", 1)).is_err());
        // Restarting one already kept is no new record.
        c.start(&key("r0", 2)).unwrap();
    }

    #[test]
    fn round_trip_and_loss() {
        let dir = std::env::temp_dir().join(format!("lull-changes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let intent = vec![0u8; 32];
        // No file: no records.
        assert!(load(&dir, SIZE, &intent, IRB, false).is_empty());
        let mut c = Changes::new(SIZE);
        c.start(&key("b@h:1", 9)).unwrap();
        c.note(1 << 20, 8192);
        store(&dir, &c.take_changed().unwrap()).unwrap();
        assert!(c.take_changed().is_none(), "nothing changed since");
        let back = load(&dir, SIZE, &intent, IRB, false);
        assert_eq!(back.records(), c.records());
        // The intent record completes it after a crash.
        let mut intent2 = vec![0u8; 32];
        intent2[31] = 0x80; // the last intent region
        let back = load(&dir, SIZE, &intent2, IRB, false);
        let bits = set(&back.get("b@h:1").unwrap().bitmap);
        assert_eq!(bits.len(), 1 + 64);
        // A lost intent record loses them; so does a flipped byte, or
        // another volume size.
        assert!(load(&dir, SIZE, &intent, IRB, true).is_empty());
        assert!(load(&dir, SIZE * 2, &[0u8; 64], IRB, false).is_empty());
        let path = dir.join(CHANGES_FILE);
        let mut raw = std::fs::read(&path).unwrap();
        raw[40] ^= 0x5a;
        std::fs::write(&path, &raw).unwrap();
        assert!(load(&dir, SIZE, &intent, IRB, false).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
