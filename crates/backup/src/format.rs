//! What a backup target holds, byte for byte (docs/BACKUPS.md says the
//! same for someone restoring without lull):
//!
//! ```text
//! PREFIX/lull-backup.json          the target's marker: format, encrypted, key check
//! PREFIX/chunks/ab/abcdef...       one chunk: zstd frame of its plaintext (encrypted:
//!                                  nonce(12) | AES-256-GCM ciphertext | tag(16))
//! PREFIX/backups/BACKUP-ID.json    one backup's manifest, written last
//! PREFIX/locks/JOB-ID.json         a running backup's or collection's lock
//! ```
//!
//! A chunk is [`CHUNK_BYTES`] of the volume (the last one shorter), named
//! by the BLAKE3 hash of its plaintext (keyed, on an encrypted target, so
//! names say nothing about contents to someone without the key): the same
//! data is stored once per target, whatever volume or backup holds it.
//! A chunk of zeros is not stored at all (`null` in the manifest).
//!
//! A chunk an incremental backup finds changed in only a few 4 KiB
//! blocks is stored as a *patch* of its parent's chunk (a [`Patch`]: the
//! base chunk's name and an object holding the changed blocks), so a
//! write scattered over the volume costs its blocks, not a 2 MiB chunk
//! each. A patch is always of a whole stored chunk (or of zeros), never of
//! another patch: a restore fetches at most two objects per chunk.
//!
//! ```
//! use lull_backup::format::{ChunkCodec, CHUNK_BYTES};
//! let codec = ChunkCodec::plain();
//! let data = vec![7u8; CHUNK_BYTES as usize];
//! let (name, stored) = codec.encode(&data)?;
//! assert!(stored.len() < data.len()); // compressed
//! assert_eq!(codec.decode(&name, &stored, data.len())?, data);
//! # Ok::<(), lull_backup::BackupError>(())
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::BackupError;

/// The on-target format this code writes and reads. A target or manifest
/// of another format is refused (never half-understood).
pub const FORMAT_VERSION: u32 = 1;

/// The manifest format of a backup that holds patches: a lull that reads
/// only [`FORMAT_VERSION`] refuses it rather than restore a patched chunk
/// as if it were whole. A manifest with no patch is written as format 1,
/// as before, so older lulls still read every backup they could.
pub const PATCH_FORMAT_VERSION: u32 = 2;

/// A patch's block: the change map's (and the chain's) block, the
/// smallest unit a volume's writes mark changed.
pub const PATCH_BLOCK_BYTES: u64 = 4096;

/// Most blocks in one patch: a quarter of a chunk (512 KiB). Past it a
/// patch saves less than 4x over the whole chunk while every later
/// incremental of that chunk sends its blocks again (a patch is always
/// of the whole chunk it started from): the chunk is sent whole and
/// becomes the next patches' base.
pub const PATCH_MAX_BLOCKS: u32 = (CHUNK_BYTES / PATCH_BLOCK_BYTES / 4) as u32;

/// Bytes of volume per chunk: Longhorn's backup block size, so a chunk is
/// one S3 PUT of a size object stores like (well past their per-request
/// overhead, under every single-PUT limit), and an incremental backup
/// uploads at most 2 MiB for every changed region.
pub const CHUNK_BYTES: u64 = 2 << 20;

/// zstd level for chunks: the fastest level. A backup is bound by the
/// link or the node's CPU, which the volumes' I/O shares; level 1 takes
/// most of what level 3 would save on compressible data at a fraction of
/// the CPU, and on incompressible data it gives up quickly (raw blocks).
pub const ZSTD_LEVEL: i32 = 1;

/// The marker object at the target's prefix.
pub const MARKER: &str = "lull-backup.json";
/// Where chunks live under the prefix (then two hex digits, then the name).
pub const CHUNK_DIR: &str = "chunks";
/// Where manifests live under the prefix.
pub const MANIFEST_DIR: &str = "backups";
/// Where locks live under the prefix.
pub const LOCK_DIR: &str = "locks";

/// Largest volume a backup takes: its manifest lists every chunk (66
/// bytes of JSON each) and is held whole in memory when read: 16 TiB is
/// 8 Mi chunks, a 550 MB manifest, the most a node should parse.
pub const MAX_BACKUP_VOLUME_BYTES: u64 = 16 << 40;

/// Largest manifest read back (a manifest of the largest volume, with
/// room): anything longer is not one of ours.
pub const MAX_MANIFEST_BYTES: u64 = 600 << 20;

/// Nonce and tag of an encrypted chunk (AES-256-GCM).
const NONCE_LEN: usize = 12;
const TAG_LEN: usize = 16;

/// A target's marker: what every lull that uses the target checks first.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Marker {
    pub format: u32,
    pub chunk_bytes: u64,
    /// Chunks and their names are under a key (`key_file`).
    pub encrypted: bool,
    /// A check value of the key (BLAKE3 derived, 16 bytes hex): a wrong
    /// key is refused when the target is added, not found at restore.
    pub key_check: Option<String>,
}

/// One backup: written last, after every chunk it names is stored, so a
/// backup that was cut (a crash, a lost target) is never listed.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    pub id: String,
    pub volume: String,
    pub size_bytes: u64,
    pub chunk_bytes: u64,
    /// The snapshot of the volume the backup copied.
    pub snapshot: String,
    pub created_unix_ms: u64,
    /// The backup this one is incremental from (its unchanged chunks
    /// were taken from that manifest, not read); `None`: a full backup.
    /// Every manifest lists all its chunks: a parent can be deleted.
    pub parent: Option<String>,
    /// The recurring schedule that made it (retention applies to those).
    #[serde(default)]
    pub schedule: Option<String>,
    /// Chunk `i` holds bytes `[i * chunk_bytes, (i + 1) * chunk_bytes)`
    /// (the last one up to `size_bytes`): the name of its plaintext, or
    /// `None` for zeros. The name is that of a stored chunk unless
    /// `patches` holds `i`.
    pub chunks: Vec<Option<String>>,
    /// The chunks stored as a patch of another, by index: their plaintext
    /// is the patch applied to its base, and hashes to `chunks[i]`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub patches: BTreeMap<usize, Patch>,
    pub stats: BackupStats,
}

/// A chunk stored as changed blocks over a stored chunk.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Patch {
    /// The stored chunk it changes; `None`: a chunk of zeros.
    pub base: Option<String>,
    /// The object holding the changed blocks (under `chunks/` like a
    /// chunk, named by the hash of its plaintext: [`encode_patch`]).
    pub object: String,
    /// How many blocks it holds (1 to [`PATCH_MAX_BLOCKS`]).
    pub blocks: u32,
}

/// What one backup did.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct BackupStats {
    /// Bytes read from the snapshot (unchanged chunks are not read).
    pub bytes_read: u64,
    /// Chunks stored as a patch of their parent's (their blocks are in
    /// `bytes_uploaded`).
    #[serde(default)]
    pub chunks_patched: u64,
    /// Bytes sent to the target (compressed, encrypted).
    pub bytes_uploaded: u64,
    pub chunks_uploaded: u64,
    /// Chunks the target had already (from this or any other backup).
    pub chunks_deduplicated: u64,
    /// Chunks taken from the parent without reading.
    pub chunks_unchanged: u64,
    pub chunks_zero: u64,
    pub duration_ms: u64,
}

impl Manifest {
    /// Checks what a manifest read from a target must satisfy before
    /// anything trusts it.
    pub fn check(&self) -> Result<(), BackupError> {
        let bad = |why: String| Err(BackupError::Corrupt(format!("manifest {}: {why}", self.id)));
        let readable = match self.format {
            FORMAT_VERSION => self.patches.is_empty(),
            PATCH_FORMAT_VERSION => true,
            _ => false,
        };
        if !readable {
            return bad(format!(
                "format {} with {} patches (this lull reads {FORMAT_VERSION} without \
                 patches and {PATCH_FORMAT_VERSION})",
                self.format,
                self.patches.len()
            ));
        }
        if self.chunk_bytes == 0 || self.chunk_bytes > 64 << 20 {
            return bad(format!("chunk size {}", self.chunk_bytes));
        }
        if self.size_bytes > MAX_BACKUP_VOLUME_BYTES {
            return bad(format!("size {}", self.size_bytes));
        }
        if self.chunks.len() as u64 != self.size_bytes.div_ceil(self.chunk_bytes) {
            return bad(format!(
                "{} chunks for {} bytes",
                self.chunks.len(),
                self.size_bytes
            ));
        }
        if let Some(n) = self.chunks.iter().flatten().find(|n| !valid_chunk_name(n)) {
            return bad(format!("chunk name {n:?}"));
        }
        for (&i, p) in &self.patches {
            if self.chunks.get(i).is_none_or(Option::is_none) {
                return bad(format!("a patch of chunk {i}, which is not a stored chunk"));
            }
            if !valid_chunk_name(&p.object)
                || p.base.as_deref().is_some_and(|b| !valid_chunk_name(b))
            {
                return bad(format!("chunk {i}'s patch names {p:?}"));
            }
            if p.blocks == 0 || p.blocks > PATCH_MAX_BLOCKS {
                return bad(format!("chunk {i}'s patch of {} blocks", p.blocks));
            }
            if !self.chunk_range(i).1.is_multiple_of(PATCH_BLOCK_BYTES) {
                return bad(format!("a patch of chunk {i}, which is not whole blocks"));
            }
        }
        Ok(())
    }

    /// The names of the objects the backup needs: its whole chunks, and
    /// each patch's object and base (with repeats).
    pub fn stored_objects(&self) -> impl Iterator<Item = &str> {
        self.chunks.iter().enumerate().flat_map(move |(i, c)| {
            let (a, b) = match self.patches.get(&i) {
                Some(p) => (Some(p.object.as_str()), p.base.as_deref()),
                None => (c.as_deref(), None),
            };
            a.into_iter().chain(b)
        })
    }

    /// The byte range chunk `i` covers.
    pub fn chunk_range(&self, i: usize) -> (u64, u64) {
        chunk_range(i, self.chunk_bytes, self.size_bytes)
    }
}

/// The byte range `[offset, offset + len)` of chunk `i` of a volume.
pub fn chunk_range(i: usize, chunk_bytes: u64, size_bytes: u64) -> (u64, u64) {
    let offset = i as u64 * chunk_bytes;
    (offset, chunk_bytes.min(size_bytes - offset))
}

/// 64 lower-case hex digits.
pub fn valid_chunk_name(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The object path of a chunk under the target's prefix.
pub fn chunk_path(name: &str) -> String {
    format!("{CHUNK_DIR}/{}/{name}", &name[..2])
}

/// The plaintext of a patch holding `blocks` (block indexes within the
/// chunk, increasing) of `chunk`: the count (u32, little-endian), each
/// index (u32 LE), then each block's [`PATCH_BLOCK_BYTES`] in that order.
pub fn encode_patch(chunk: &[u8], blocks: &[u32]) -> Vec<u8> {
    let bs = PATCH_BLOCK_BYTES as usize;
    let mut out = Vec::with_capacity(4 + blocks.len() * (4 + bs));
    out.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    for b in blocks {
        out.extend_from_slice(&b.to_le_bytes());
    }
    for &b in blocks {
        let at = b as usize * bs;
        out.extend_from_slice(&chunk[at..at + bs]);
    }
    out
}

/// The plaintext length of a patch of `blocks` blocks.
pub fn patch_len(blocks: u32) -> usize {
    4 + blocks as usize * (4 + PATCH_BLOCK_BYTES as usize)
}

/// The block indexes a patch's plaintext holds, checked: its count is
/// `blocks`, its length that count's, its indexes increasing and inside a
/// chunk of `chunk_len` bytes.
pub fn patch_blocks(patch: &[u8], blocks: u32, chunk_len: usize) -> Result<Vec<u32>, String> {
    if patch.len() != patch_len(blocks) {
        return Err(format!("{} bytes for {blocks} blocks", patch.len()));
    }
    let word = |at: usize| u32::from_le_bytes(patch[at..at + 4].try_into().expect("4 bytes"));
    if word(0) != blocks {
        return Err(format!(
            "it counts {} blocks, its manifest {blocks}",
            word(0)
        ));
    }
    let in_chunk = (chunk_len as u64 / PATCH_BLOCK_BYTES) as u32;
    let out: Vec<u32> = (0..blocks as usize).map(|k| word(4 + 4 * k)).collect();
    if out.windows(2).any(|w| w[0] >= w[1]) || out.last().is_some_and(|&b| b >= in_chunk) {
        return Err("its block indexes are not increasing inside the chunk".into());
    }
    Ok(out)
}

/// Writes a patch's blocks over `chunk` (its base's plaintext, or zeros).
pub fn apply_patch(chunk: &mut [u8], patch: &[u8], blocks: u32) -> Result<(), String> {
    let indexes = patch_blocks(patch, blocks, chunk.len())?;
    let bs = PATCH_BLOCK_BYTES as usize;
    let data = &patch[4 + 4 * indexes.len()..];
    for (k, b) in indexes.iter().enumerate() {
        let at = *b as usize * bs;
        chunk[at..at + bs].copy_from_slice(&data[k * bs..(k + 1) * bs]);
    }
    Ok(())
}

/// The object path of a manifest under the target's prefix.
pub fn manifest_path(id: &str) -> String {
    format!("{MANIFEST_DIR}/{id}.json")
}

/// A backup id: `bk-` then the creation time (ms, zero-padded, so ids
/// sort by age) and 8 random hex digits.
pub fn new_backup_id(now_unix_ms: u64) -> String {
    let mut r = [0u8; 4];
    // openssl's CSPRNG; it fails only if the kernel has no entropy source.
    openssl::rand::rand_bytes(&mut r).expect("random bytes");
    format!("bk-{now_unix_ms:013}-{}", hex(&r))
}

/// Whether `id` has the shape of [`new_backup_id`] (an RPC parameter or an
/// object name): nothing else becomes an object path.
pub fn valid_backup_id(id: &str) -> bool {
    let Some(rest) = id.strip_prefix("bk-") else {
        return false;
    };
    let Some((ms, r)) = rest.split_once('-') else {
        return false;
    };
    ms.len() == 13
        && ms.bytes().all(|b| b.is_ascii_digit())
        && r.len() == 8
        && r.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A target's key: 32 bytes, from a key file (raw, or 64 hex digits).
#[derive(Clone)]
pub struct Key {
    aead: [u8; 32],
    names: [u8; 32],
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)") // never the bytes
    }
}

impl Key {
    /// The key in a key file: 32 raw bytes, or 64 hex digits (a trailing
    /// newline allowed).
    pub fn from_file_bytes(bytes: &[u8]) -> Result<Key, BackupError> {
        let raw: [u8; 32] = if bytes.len() == 32 {
            bytes.try_into().expect("32 bytes")
        } else {
            let text = std::str::from_utf8(bytes).unwrap_or("").trim();
            let mut out = [0u8; 32];
            if text.len() != 64 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(BackupError::Config(
                    "key file: 32 raw bytes or 64 hex digits expected".into(),
                ));
            }
            for (i, o) in out.iter_mut().enumerate() {
                *o = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).expect("hex digits");
            }
            out
        };
        Ok(Key {
            aead: blake3::derive_key("lull backup 2026 chunk encryption", &raw),
            names: blake3::derive_key("lull backup 2026 chunk names", &raw),
        })
    }

    /// The check value recorded in the target's marker.
    pub fn check_value(&self) -> String {
        hex(&blake3::derive_key("lull backup 2026 key check", &self.aead)[..16])
    }
}

/// Turns a chunk's plaintext into what the target stores, and back.
#[derive(Clone, Debug)]
pub struct ChunkCodec {
    key: Option<Key>,
}

impl ChunkCodec {
    pub fn plain() -> ChunkCodec {
        ChunkCodec { key: None }
    }

    pub fn encrypted(key: Key) -> ChunkCodec {
        ChunkCodec { key: Some(key) }
    }

    pub fn is_encrypted(&self) -> bool {
        self.key.is_some()
    }

    /// The key's check value, for the target's marker.
    pub fn key_check(&self) -> Option<String> {
        self.key.as_ref().map(Key::check_value)
    }

    /// The chunk's name for `data`.
    pub fn name(&self, data: &[u8]) -> String {
        match &self.key {
            None => blake3::hash(data).to_hex().to_string(),
            Some(k) => blake3::keyed_hash(&k.names, data).to_hex().to_string(),
        }
    }

    /// `(name, stored bytes)` of a chunk.
    pub fn encode(&self, data: &[u8]) -> Result<(String, Vec<u8>), BackupError> {
        let name = self.name(data);
        let stored = self.seal(&name, data)?;
        Ok((name, stored))
    }

    /// The stored bytes of a chunk whose name ([`ChunkCodec::name`]) is
    /// known: compressed, and encrypted under its name on a keyed target.
    pub fn seal(&self, name: &str, data: &[u8]) -> Result<Vec<u8>, BackupError> {
        let packed = zstd::bulk::compress(data, ZSTD_LEVEL)
            .map_err(|e| BackupError::Failed(format!("zstd: {e}")))?;
        let Some(k) = &self.key else {
            return Ok(packed);
        };
        let mut nonce = [0u8; NONCE_LEN];
        openssl::rand::rand_bytes(&mut nonce).map_err(openssl_error)?;
        let mut tag = [0u8; TAG_LEN];
        let sealed = openssl::symm::encrypt_aead(
            openssl::symm::Cipher::aes_256_gcm(),
            &k.aead,
            Some(&nonce),
            name.as_bytes(),
            &packed,
            &mut tag,
        )
        .map_err(openssl_error)?;
        let mut out = Vec::with_capacity(NONCE_LEN + sealed.len() + TAG_LEN);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out.extend_from_slice(&tag);
        Ok(out)
    }

    /// The plaintext of the chunk `name` from its stored bytes, checked:
    /// it must decrypt (the tag), decompress to exactly `len` bytes, and
    /// hash to its name. Anything else is [`BackupError::BadChunk`].
    pub fn decode(&self, name: &str, stored: &[u8], len: usize) -> Result<Vec<u8>, BackupError> {
        let bad = |why: &str| BackupError::BadChunk {
            chunk: name.to_string(),
            why: why.to_string(),
        };
        let opened;
        let packed: &[u8] = match &self.key {
            None => stored,
            Some(k) => {
                if stored.len() < NONCE_LEN + TAG_LEN {
                    return Err(bad("shorter than a nonce and a tag"));
                }
                let (nonce, rest) = stored.split_at(NONCE_LEN);
                let (sealed, tag) = rest.split_at(rest.len() - TAG_LEN);
                opened = openssl::symm::decrypt_aead(
                    openssl::symm::Cipher::aes_256_gcm(),
                    &k.aead,
                    Some(nonce),
                    name.as_bytes(),
                    sealed,
                    tag,
                )
                .map_err(|_| bad("does not decrypt (wrong key, or altered)"))?;
                &opened
            }
        };
        let data = zstd::bulk::decompress(packed, len)
            .map_err(|_| bad("not a zstd frame of its length"))?;
        if data.len() != len {
            return Err(bad("wrong length"));
        }
        if self.name(&data) != name {
            return Err(bad("its contents do not hash to its name"));
        }
        Ok(data)
    }
}

fn openssl_error(e: openssl::error::ErrorStack) -> BackupError {
    BackupError::Failed(format!("openssl: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_round_trip_and_refuse_damage() {
        let key = Key::from_file_bytes(&[9u8; 32]).unwrap();
        for codec in [ChunkCodec::plain(), ChunkCodec::encrypted(key)] {
            let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
            let (name, mut stored) = codec.encode(&data).unwrap();
            assert!(valid_chunk_name(&name));
            assert_eq!(codec.decode(&name, &stored, data.len()).unwrap(), data);
            assert!(codec.decode(&name, &stored, data.len() + 1).is_err());
            let last = stored.len() - 1;
            stored[last] ^= 1;
            assert!(matches!(
                codec.decode(&name, &stored, data.len()),
                Err(BackupError::BadChunk { .. })
            ));
        }
    }

    #[test]
    fn keyed_names_differ_and_keys_check() {
        let a = Key::from_file_bytes(&[1u8; 32]).unwrap();
        let hex_key = format!("{}\n", "01".repeat(32));
        let a2 = Key::from_file_bytes(hex_key.as_bytes()).unwrap();
        let b = Key::from_file_bytes(&[2u8; 32]).unwrap();
        assert_eq!(a.check_value(), a2.check_value());
        assert_ne!(a.check_value(), b.check_value());
        let data = b"some data";
        assert_ne!(
            ChunkCodec::plain().name(data),
            ChunkCodec::encrypted(a).name(data)
        );
        assert!(Key::from_file_bytes(b"short").is_err());
    }

    #[test]
    fn ids_and_manifest_checks() {
        let id = new_backup_id(1_764_000_000_000);
        assert!(valid_backup_id(&id), "{id}");
        for bad in ["", "bk-1-2", "../x", "bk-1764000000000-ZZZZZZZZ"] {
            assert!(!valid_backup_id(bad), "{bad}");
        }
        let mut m = Manifest {
            format: FORMAT_VERSION,
            id,
            volume: "v".into(),
            size_bytes: CHUNK_BYTES + 1,
            chunk_bytes: CHUNK_BYTES,
            snapshot: "s".into(),
            created_unix_ms: 0,
            parent: None,
            schedule: None,
            chunks: vec![None, Some("a".repeat(64))],
            patches: BTreeMap::new(),
            stats: BackupStats::default(),
        };
        m.check().unwrap();
        // A patch: only in format 2, only of a stored chunk, within bounds.
        let patch = Patch {
            base: None,
            object: "b".repeat(64),
            blocks: 3,
        };
        m.size_bytes = 2 * CHUNK_BYTES;
        m.patches.insert(1, patch.clone());
        assert!(m.check().is_err(), "format 1 with a patch");
        m.format = PATCH_FORMAT_VERSION;
        m.check().unwrap();
        let objects: Vec<&str> = m.stored_objects().collect();
        assert_eq!(objects, vec!["b".repeat(64)]);
        m.patches.insert(0, patch.clone());
        assert!(m.check().is_err(), "a patch of a zero chunk entry");
        m.patches.remove(&0);
        m.patches.insert(
            1,
            Patch {
                blocks: PATCH_MAX_BLOCKS + 1,
                ..patch
            },
        );
        assert!(m.check().is_err(), "too many blocks");
        m.patches.clear();
        m.format = FORMAT_VERSION;
        m.size_bytes = CHUNK_BYTES + 1;
        assert_eq!(m.chunk_range(1), (CHUNK_BYTES, 1));
        m.chunks.push(None);
        assert!(m.check().is_err());
        m.chunks.pop();
        m.chunks[1] = Some("../../etc/passwd".into());
        assert!(m.check().is_err());
    }
}
