//! Chunks between a job and its target: a backup's chunk named,
//! deduplicated and stored whole or as a patch of its parent's; a
//! backup's chunk fetched back and checked, whichever way it was stored.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use lull_bdev::ChangeRun;
use object_store::{ObjectStoreExt, PutPayload};

use crate::format::{
    self, chunk_path, Manifest, Patch, CHUNK_BYTES, PATCH_BLOCK_BYTES, PATCH_MAX_BLOCKS,
};
use crate::target::Target;
use crate::{lock, BackupError};

/// One chunk's plaintext object (a whole chunk or a patch), fetched and
/// checked against its name.
pub(crate) async fn fetch_object(
    t: &Target,
    name: &str,
    len: usize,
) -> Result<Vec<u8>, BackupError> {
    let r = match t.store.get(&t.path(&chunk_path(name))).await {
        Ok(r) => r,
        Err(object_store::Error::NotFound { .. }) => {
            return Err(BackupError::BadChunk {
                chunk: name.to_string(),
                why: "missing from the target".into(),
            })
        }
        Err(e) => return Err(t.error(e)),
    };
    let stored = r.bytes().await.map_err(|e| t.error(e))?;
    let codec = t.codec.clone();
    let name = name.to_string();
    tokio::task::spawn_blocking(move || codec.decode(&name, &stored, len))
        .await
        .map_err(|e| BackupError::Failed(format!("decode task: {e}")))?
}

/// Chunk `i` of a backup, fetched and checked (`None`: zeros). A patched
/// chunk is its base with the patch's blocks over it, and must hash to
/// the name the manifest gives the chunk.
pub(crate) async fn fetch_chunk(
    t: &Target,
    m: &Manifest,
    i: usize,
) -> Result<Option<Vec<u8>>, BackupError> {
    let Some(name) = &m.chunks[i] else {
        return Ok(None);
    };
    let len = m.chunk_range(i).1 as usize;
    let Some(p) = m.patches.get(&i) else {
        return fetch_object(t, name, len).await.map(Some);
    };
    let base = async {
        match &p.base {
            Some(b) => fetch_object(t, b, len).await,
            None => Ok(vec![0; len]),
        }
    };
    let patch = fetch_object(t, &p.object, format::patch_len(p.blocks));
    let (mut data, patch) = futures::try_join!(base, patch)?;
    let (codec, name, p) = (t.codec.clone(), name.clone(), p.clone());
    tokio::task::spawn_blocking(move || {
        format::apply_patch(&mut data, &patch, p.blocks).map_err(|why| BackupError::BadChunk {
            chunk: p.object.clone(),
            why: format!("not a patch of chunk {i}: {why}"),
        })?;
        if codec.name(&data) != name {
            return Err(BackupError::BadChunk {
                chunk: name,
                why: format!(
                    "its base {} and patch {} do not make it",
                    p.base.as_deref().unwrap_or("(zeros)"),
                    p.object
                ),
            });
        }
        Ok(Some(data))
    })
    .await
    .map_err(|e| BackupError::Failed(format!("patch task: {e}")))?
}

/// Chunks whose change runs one query asks for: 256 MiB of volume, so the
/// runs held at once stay bounded (one per changed 4 KiB block at most:
/// 64 Ki) whatever the volume's size.
pub const CHANGE_WINDOW_CHUNKS: usize = 128;

/// What changed in a chunk since the parent's snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Changed {
    /// These blocks (indexes within the chunk, increasing; empty: none).
    Blocks(Vec<u32>),
    /// More than a patch holds: the chunk is sent whole.
    Many,
}

/// The changed blocks of each of the `count` chunks from chunk `first`,
/// from change runs that start at the first one's offset.
pub fn changed_by_chunk(runs: &[ChangeRun], first: usize, count: usize) -> Vec<Changed> {
    let mut out = vec![Changed::Blocks(Vec::new()); count];
    let mut at = first as u64 * CHUNK_BYTES;
    for r in runs {
        let (start, end) = (at, at + r.length_bytes);
        at = end;
        if !r.changed || r.length_bytes == 0 {
            continue;
        }
        let last = (((end - 1) / CHUNK_BYTES) as usize).min(first + count - 1);
        for c in (start / CHUNK_BYTES) as usize..=last {
            let base = c as u64 * CHUNK_BYTES;
            let b0 = (start.max(base) - base) / PATCH_BLOCK_BYTES;
            let b1 = (end.min(base + CHUNK_BYTES) - base).div_ceil(PATCH_BLOCK_BYTES);
            let slot = &mut out[c - first];
            if let Changed::Blocks(list) = slot {
                if list.len() as u64 + (b1 - b0) > PATCH_MAX_BLOCKS as u64 {
                    *slot = Changed::Many;
                } else {
                    // Runs are in order and do not overlap: still increasing.
                    list.extend((b0..b1).map(|b| b as u32));
                }
            }
        }
    }
    out
}

/// A changed chunk the reader hands the uploads.
pub(crate) struct ReadChunk {
    pub i: usize,
    pub data: Vec<u8>,
    /// Set when the chunk may be stored as a patch of the parent's.
    pub patch: Option<PatchPlan>,
}

/// How a changed chunk can be a patch: the parent's entry for it and the
/// blocks changed since.
pub(crate) struct PatchPlan {
    pub changed: Vec<u32>,
    /// The parent's stored chunk (or `None`, zeros) the patch goes over.
    pub base: Option<String>,
    /// The parent's own patch of that base: its blocks go in this one too.
    pub parent_patch: Option<Patch>,
}

impl PatchPlan {
    /// The plan for chunk `i` of a backup whose parent is `p`, or `None`
    /// when it is sent whole: the parent lacks the chunk or held it at
    /// another length, or too much changed.
    pub fn new(p: &Manifest, i: usize, len: u64, changed: &Changed) -> Option<PatchPlan> {
        let Changed::Blocks(blocks) = changed else {
            return None;
        };
        if i >= p.chunks.len()
            || p.chunk_range(i).1 != len
            || !len.is_multiple_of(PATCH_BLOCK_BYTES)
        {
            return None;
        }
        let parent_patch = p.patches.get(&i).cloned();
        let base = match &parent_patch {
            Some(pp) => pp.base.clone(),
            None => p.chunks[i].clone(),
        };
        Some(PatchPlan {
            changed: blocks.clone(),
            base,
            parent_patch,
        })
    }
}

/// How a chunk went to the target.
pub(crate) struct StoredChunk {
    pub i: usize,
    pub name: String,
    pub patch: Option<Patch>,
    /// Bytes sent (`None`: the target had it, nothing sent).
    pub sent: Option<u64>,
}

/// What the target is known to hold before a backup asks it: the objects
/// of the volume's backups, and the chunks they hold as patches.
#[derive(Default)]
pub(crate) struct Known {
    pub objects: HashSet<String>,
    pub patched: HashMap<String, Patch>,
}

impl Known {
    pub fn of<'a>(manifests: impl Iterator<Item = &'a Manifest>) -> Known {
        let mut k = Known::default();
        for m in manifests {
            k.objects.extend(m.stored_objects().map(str::to_string));
            for (i, p) in &m.patches {
                if let Some(name) = &m.chunks[*i] {
                    k.patched.insert(name.clone(), p.clone());
                }
            }
        }
        k
    }
}

/// An upload rate limit shared by a job's uploads.
pub(crate) struct Limiter {
    bytes_per_sec: u64,
    next: Mutex<Instant>,
}

impl Limiter {
    pub fn new(mbytes_per_sec: u64) -> Limiter {
        Limiter {
            bytes_per_sec: mbytes_per_sec * 1_000_000,
            next: Mutex::new(Instant::now()),
        }
    }

    async fn take(&self, bytes: u64) {
        if self.bytes_per_sec == 0 {
            return;
        }
        let start = {
            let mut next = lock(&self.next);
            let start = (*next).max(Instant::now());
            *next = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec as f64);
            start
        };
        tokio::time::sleep_until(start.into()).await;
    }
}

/// Stores one changed chunk: nothing when the target holds it (whole, or
/// as a patch a backup of the volume made), else as a patch of its
/// parent's chunk when the plan allows, else whole. Only what is sent is
/// compressed.
pub(crate) async fn store_chunk(
    t: &Target,
    chunk: ReadChunk,
    known: &Known,
    limiter: &Limiter,
    sent_bytes: &AtomicU64,
) -> Result<StoredChunk, BackupError> {
    let ReadChunk { i, data, patch } = chunk;
    let codec = t.codec.clone();
    let (data, name) = tokio::task::spawn_blocking(move || {
        let name = codec.name(&data);
        (data, name)
    })
    .await
    .map_err(|e| BackupError::Failed(format!("hash task: {e}")))?;
    let stored = |patch, sent| StoredChunk {
        i,
        name: name.clone(),
        patch,
        sent,
    };
    if known.objects.contains(&name) {
        return Ok(stored(None, None));
    }
    if let Some(p) = known.patched.get(&name) {
        return Ok(stored(Some(p.clone()), None));
    }
    if present(t, &name).await? {
        return Ok(stored(None, None));
    }
    if let Some(plan) = patch {
        if let Some((base, blocks)) = fold_parent_patch(t, plan, data.len(), i).await? {
            let plain = format::encode_patch(&data, &blocks);
            let object = t.codec.name(&plain);
            let sent = if known.objects.contains(&object) || present(t, &object).await? {
                0
            } else {
                put(t, &object, plain, limiter, sent_bytes).await?
            };
            let p = Patch {
                base,
                object,
                blocks: blocks.len() as u32,
            };
            return Ok(stored(Some(p), Some(sent)));
        }
    }
    let sent = put(t, &name, data, limiter, sent_bytes).await?;
    Ok(stored(None, Some(sent)))
}

/// The base and blocks of a chunk's patch: the blocks changed since the
/// parent and those of the parent's own patch (fetched), or `None` when
/// they are more than a patch holds. A parent patch that cannot be read
/// back sends the chunk whole (and says so) rather than fail the backup.
async fn fold_parent_patch(
    t: &Target,
    plan: PatchPlan,
    len: usize,
    i: usize,
) -> Result<Option<(Option<String>, Vec<u32>)>, BackupError> {
    let mut blocks = plan.changed;
    if let Some(pp) = &plan.parent_patch {
        let prev = match fetch_object(t, &pp.object, format::patch_len(pp.blocks)).await {
            Ok(prev) => prev,
            Err(BackupError::BadChunk { chunk, why }) => {
                tracing::warn!(target = %t.config.name, chunk, why, index = i,
                    "the parent's patch cannot be read: this chunk is sent whole");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        match format::patch_blocks(&prev, pp.blocks, len) {
            Ok(old) => blocks.extend(old),
            Err(why) => {
                tracing::warn!(target = %t.config.name, chunk = pp.object, why, index = i,
                    "the parent's patch is not one: this chunk is sent whole");
                return Ok(None);
            }
        }
        blocks.sort_unstable();
        blocks.dedup();
    }
    if blocks.is_empty() || blocks.len() > PATCH_MAX_BLOCKS as usize {
        return Ok(None);
    }
    Ok(Some((plan.base, blocks)))
}

/// Whether the target holds the object `name`.
async fn present(t: &Target, name: &str) -> Result<bool, BackupError> {
    match t.store.head(&t.path(&chunk_path(name))).await {
        Ok(_) => Ok(true),
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(t.error(e)),
    }
}

/// Seals and stores the object `name`; the bytes sent.
async fn put(
    t: &Target,
    name: &str,
    plain: Vec<u8>,
    limiter: &Limiter,
    sent_bytes: &AtomicU64,
) -> Result<u64, BackupError> {
    let (codec, owned) = (t.codec.clone(), name.to_string());
    let sealed = tokio::task::spawn_blocking(move || codec.seal(&owned, &plain))
        .await
        .map_err(|e| BackupError::Failed(format!("encode task: {e}")))??;
    let n = sealed.len() as u64;
    limiter.take(n).await;
    t.store
        .put(&t.path(&chunk_path(name)), PutPayload::from(sealed))
        .await
        .map_err(|e| t.error(e))?;
    sent_bytes.fetch_add(n, Ordering::Relaxed);
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(changed: bool, length_bytes: u64) -> ChangeRun {
        ChangeRun {
            length_bytes,
            changed,
        }
    }

    #[test]
    fn change_runs_become_each_chunks_blocks() {
        let bs = PATCH_BLOCK_BYTES;
        // From chunk 2: block 1 of chunk 2, the last block of chunk 2 and
        // the first two of chunk 3, then all of chunk 4 (too many).
        let runs = [
            run(false, bs),
            run(true, bs),
            run(false, CHUNK_BYTES - 3 * bs),
            run(true, 3 * bs),
            run(false, CHUNK_BYTES - 2 * bs),
            run(true, CHUNK_BYTES),
        ];
        let got = changed_by_chunk(&runs, 2, 4);
        let last = (CHUNK_BYTES / bs) as u32 - 1;
        assert_eq!(
            got,
            vec![
                Changed::Blocks(vec![1, last]),
                Changed::Blocks(vec![0, 1]),
                Changed::Many,
                Changed::Blocks(vec![]),
            ]
        );
    }

    #[test]
    fn patches_round_trip_and_refuse_what_is_not_one() {
        let len = CHUNK_BYTES as usize;
        let new: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let plain = format::encode_patch(&new, &[0, 7, 511]);
        assert_eq!(plain.len(), format::patch_len(3));
        let mut base = vec![0u8; len];
        format::apply_patch(&mut base, &plain, 3).unwrap();
        let bs = PATCH_BLOCK_BYTES as usize;
        for b in [0, 7, 511] {
            assert_eq!(base[b * bs..(b + 1) * bs], new[b * bs..(b + 1) * bs]);
        }
        assert!(base[bs..7 * bs].iter().all(|&x| x == 0));
        // Wrong count, a block past the chunk, indexes out of order.
        assert!(format::apply_patch(&mut base, &plain, 2).is_err());
        assert!(format::patch_blocks(&plain, 3, 100 * bs).is_err());
        let mut swapped = plain.clone();
        swapped[4..8].copy_from_slice(&9u32.to_le_bytes());
        assert!(format::patch_blocks(&swapped, 3, len).is_err());
    }
}
