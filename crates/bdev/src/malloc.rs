//! `MallocDev`: a sparse memory-backed device.
//!
//! Storage is split into `MALLOC_CHUNK_BYTES` chunks, each allocated on its
//! first write and behind its own lock, so connections on different OS
//! threads (multi-connection NBD) can share the volume. Never-written chunks
//! read as zeros; trimming or zeroing a whole chunk frees it.
//!
//! A channel runs its requests when they are reaped, in submission
//! order; a small read's source is prefetched into the CPU's caches when
//! it is submitted, a larger one's first byte touched before the batch
//! (see `MallocChannel`).
//!
//! A device may draw its chunks from a [`ChunkReserve`] shared with other
//! devices (a memory chain's layers share one): chunks its whole-chunk
//! trims and its drop free go there, up to a bound, and its new chunks
//! come from there, zeroed, before the allocator is asked. A chunk fresh
//! from the allocator is untouched memory whose every 4 KiB page faults
//! on its first write (about 1.3 to 2.7 us a page on the benchmark VM,
//! against 0.2 us for a write to a page already there); a reserved one
//! costs a 1 MiB memset once (see docs/BENCHMARKS.md, "Snapshots").
//!
//! A channel told [`Channel::allow_lend`] answers a read that lies in
//! one written chunk with a loan of the chunk ([`Data::Lent`](crate::Data::Lent))
//! instead of copying it into the request's buffer: the frontend sends
//! the reply from the chunk, and the kernel's copy into the socket is
//! the only one. The lifetime rule (docs/PER_IO.md, "Lent reads"): a
//! loan holds the chunk's memory (an `Arc`) until the reply is written,
//! and the bytes it shows never change. A write or partial zero of a
//! chunk that is lent copies the chunk first (copy on write: the device
//! takes the copy, the loans keep the old memory, freed with the last
//! one), so a read returns the data as of when it ran, never a mix; a
//! whole-chunk trim, or the device dropped with its volume, only drops
//! the device's reference. The device never shrinks, so no loan
//! outlives its range. Reads that cross a chunk boundary, touch a
//! never-written chunk (a hole: zeros written into the buffer, no
//! device memory touched) or run past a short chunk's end are copied as
//! before.
//!
//! The device grows online ([`BlockDevice::grow`]): the chunk table is a
//! list of segments of doubling length, created as the size needs them
//! and never moved, so readers index it without a lock while it grows;
//! the size is an atomic that is raised once the chunks behind it exist.
//!
//! ```
//! use lull_bdev::{BlockDevice, BufPool, IoOp, IoRequest, MallocDev};
//! let dev = MallocDev::new(1 << 20).unwrap();
//! let mut ch = dev.open_channel().unwrap();
//! let mut pool = BufPool::new(1 << 20);
//! let mut buf = pool.get(3);
//! buf.as_mut_slice().copy_from_slice(b"abc");
//! ch.submit(IoRequest { tag: 1, op: IoOp::Write { fua: false }, offset: 5, len: 3, buf: Some(buf) }).unwrap();
//! ch.flush_submissions();
//! let mut results = Vec::new();
//! ch.reap(&mut |c| results.push((c.tag, c.result.is_ok())));
//! assert_eq!(results, vec![(1, true)]);
//! ```

use crate::deferred::Deferred;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};

use crate::{
    check_grow, push_extent, validate_request, BdevError, BlockDevice, Channel, Data, Extent,
    IoCompletion, IoOp, IoRequest, Lent, LentRegion,
};

/// Allocation and locking granularity. 1 MiB keeps the chunk table small
/// (about 24 bytes of metadata per MiB, 24 MiB per TiB of volume) while
/// costing little memory for scattered small writes: chunks are allocated
/// zeroed, which the allocator serves from fresh mmap'd pages, so the
/// untouched pages of a chunk take no RAM. Lock contention is rare (only
/// several connections writing the same MiB at once).
pub const MALLOC_CHUNK_BYTES: usize = 1 << 20;

/// Largest read whose every cache line `MallocChannel::submit` prefetches
/// (`lull_uring::prefetch`): 16 KiB, four pages, 256 lines. A QD32 batch
/// of such reads prefetches at most 512 KiB, which the L2 caches of the
/// machines lull runs on hold (0.5 to 2 MiB a core), so the lines are
/// still there when the copy comes; a larger read is sequential enough
/// for the hardware prefetcher, and prefetching a batch of 128 KiB reads
/// (4 MiB) would only push earlier lines out.
pub const PREFETCH_READ_BYTES_MAX: usize = 16 << 10;

/// Largest malloc device, also the most it can grow to: 16 TiB, whose
/// chunk table (16 Mi entries of 32 bytes, and up to twice that in the
/// growable table's segments: at most 1 GiB) is the most we accept to
/// allocate up front for a memory device.
pub const MALLOC_SIZE_MAX_BYTES: u64 = 16 << 40;

/// Completions a malloc channel holds before `submit` returns `Full`: the
/// queue depth of an NBD connection (it cannot have more in flight), so a
/// caller that reaps after each batch never sees `Full`.
pub const MALLOC_CHANNEL_DEPTH: usize = 256;

/// One chunk: its memory once written, shared with the loans of reads
/// being sent from it (module doc). A writer takes it exclusive first
/// (`Arc::make_mut`: a copy only while it is lent).
type Chunk = RwLock<Option<Arc<Box<[u8]>>>>;

/// Most bytes of freed chunks a [`ChunkReserve`] keeps for reuse: 64 MiB
/// (64 chunks). A memory chain drops whole layers (a revert drops the
/// head, a merge the snapshot it merged) and takes new chunks for its
/// new head right after; reusing resident chunks saves the page faults
/// of fresh ones. The reserve is memory the volume held before, kept
/// instead of given back: at most this much per chain beyond its data,
/// whether or not it is used again (docs/LIMITS.md).
pub const CHUNK_RESERVE_MAX_BYTES: usize = 64 << 20;

/// Full-size chunks freed by devices sharing the reserve, kept (resident)
/// for their next chunk: at most `max_chunks`. What comes out is zeroed
/// before use; what goes in is taken as it is.
#[derive(Debug)]
pub struct ChunkReserve {
    chunks: Mutex<Vec<Box<[u8]>>>,
    max_chunks: usize,
}

impl ChunkReserve {
    /// A reserve of at most `max_bytes` (rounded down to whole chunks).
    pub fn new(max_bytes: usize) -> Arc<ChunkReserve> {
        let max_chunks = max_bytes / MALLOC_CHUNK_BYTES;
        Arc::new(ChunkReserve {
            chunks: Mutex::new(Vec::with_capacity(max_chunks)),
            max_chunks,
        })
    }

    /// Chunks held now (for tests and stats).
    pub fn chunks(&self) -> usize {
        self.chunks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// A zeroed chunk of [`MALLOC_CHUNK_BYTES`], if one is kept. Never
    /// waits: a reserve in use by another thread is skipped (the caller
    /// allocates).
    fn take(&self) -> Option<Box<[u8]>> {
        let mut chunk = self.chunks.try_lock().ok()?.pop()?;
        chunk.fill(0);
        Some(chunk)
    }

    /// Keeps `chunk` if it is full-size and there is room; else it is
    /// freed.
    fn give(&self, chunk: Box<[u8]>) {
        if chunk.len() != MALLOC_CHUNK_BYTES {
            return;
        }
        let mut chunks = self.chunks.lock().unwrap_or_else(PoisonError::into_inner);
        if chunks.len() < self.max_chunks {
            chunks.push(chunk);
        }
    }
}

/// Chunks in the first segment of the chunk table; segment `k` holds
/// `SEGMENT0_CHUNKS << k`. 64 chunks (64 MiB of volume, about 1.5 KiB of
/// table) keep small devices small; doubling keeps the segment count
/// logarithmic in the size.
const SEGMENT0_CHUNKS: usize = 64;

/// Segments of the chunk table: enough for [`MALLOC_SIZE_MAX_BYTES`]
/// (asserted below).
const SEGMENTS: usize = 19;

const _: () = assert!(
    (SEGMENT0_CHUNKS as u64) * ((1u64 << SEGMENTS) - 1) * (MALLOC_CHUNK_BYTES as u64)
        >= MALLOC_SIZE_MAX_BYTES
);

/// Segment and index inside it of chunk `index`.
fn segment_of(index: usize) -> (usize, usize) {
    let q = index / SEGMENT0_CHUNKS + 1;
    let seg = (usize::BITS - 1 - q.leading_zeros()) as usize;
    (seg, index - SEGMENT0_CHUNKS * ((1 << seg) - 1))
}

struct Inner {
    /// The device's size. Raised by `grow` only after the chunks it covers
    /// exist; never lowered.
    size_bytes: AtomicU64,
    /// The chunk table, in segments created on demand (see the module doc).
    segments: [OnceLock<Box<[Chunk]>>; SEGMENTS],
    /// Serializes `grow` (the control plane's; the data path never takes it).
    growing: Mutex<()>,
    /// Where new chunks come from first and freed ones go (module doc).
    reserve: Option<Arc<ChunkReserve>>,
    /// Chunks copied because a write met a loan of them (module doc).
    lend_copies: AtomicU64,
}

impl Drop for Inner {
    /// The chunks go to the reserve, as many as it keeps.
    fn drop(&mut self) {
        let Some(reserve) = &self.reserve else {
            return;
        };
        for seg in self.segments.iter_mut().filter_map(OnceLock::get_mut) {
            for chunk in seg.iter_mut() {
                let data = chunk.get_mut().unwrap_or_else(PoisonError::into_inner);
                // A lent chunk stays with its loans, freed with the last.
                if let Some(Ok(data)) = data.take().map(Arc::try_unwrap) {
                    reserve.give(data);
                }
            }
        }
    }
}

/// A sparse memory-backed block device.
#[derive(Clone)]
pub struct MallocDev {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MallocDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MallocDev")
            .field("size_bytes", &self.inner.size())
            .field("chunks_allocated", &self.chunks_allocated())
            .finish()
    }
}

impl MallocDev {
    /// A device of `size_bytes` bytes, all reading as zeros.
    pub fn new(size_bytes: u64) -> Result<MallocDev, BdevError> {
        MallocDev::with_reserve(size_bytes, None)
    }

    /// A device of `size_bytes` bytes, all reading as zeros, whose chunks
    /// come from `reserve` first and go back to it (module doc).
    pub fn with_reserve(
        size_bytes: u64,
        reserve: Option<Arc<ChunkReserve>>,
    ) -> Result<MallocDev, BdevError> {
        if size_bytes > MALLOC_SIZE_MAX_BYTES {
            return Err(BdevError::Unsupported("malloc device larger than 16 TiB"));
        }
        let inner = Inner {
            size_bytes: AtomicU64::new(0),
            segments: std::array::from_fn(|_| OnceLock::new()),
            growing: Mutex::new(()),
            reserve,
            lend_copies: AtomicU64::new(0),
        };
        inner.make_chunks(size_bytes);
        inner.size_bytes.store(size_bytes, Ordering::Release);
        Ok(MallocDev {
            inner: Arc::new(inner),
        })
    }

    /// Chunks copied because a write or partial zero met a loan of them
    /// (module doc): what copy-on-write cost so far.
    pub fn lend_copies(&self) -> u64 {
        self.inner.lend_copies.load(Ordering::Relaxed)
    }

    /// Chunks currently holding memory (for tests and stats).
    pub fn chunks_allocated(&self) -> usize {
        self.inner
            .segments
            .iter()
            .filter_map(OnceLock::get)
            .flat_map(|s| s.iter())
            .filter(|c| c.read().unwrap_or_else(PoisonError::into_inner).is_some())
            .count()
    }
}

/// The pieces of `[offset, offset + len)` per chunk: (chunk index, offset
/// inside the chunk, piece length, offset inside the request).
fn pieces(offset: u64, len: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> {
    let chunk = MALLOC_CHUNK_BYTES as u64;
    let mut done = 0usize;
    std::iter::from_fn(move || {
        if done >= len {
            return None;
        }
        let pos = offset + done as u64;
        let index = (pos / chunk) as usize;
        let within = (pos % chunk) as usize;
        let piece = (MALLOC_CHUNK_BYTES - within).min(len - done);
        let item = (index, within, piece, done);
        done += piece;
        Some(item)
    })
}

impl Inner {
    fn size(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// Creates the segments that chunks of a device of `size_bytes` need.
    /// Called by `new` and, under `growing`, by `grow`, before the size is
    /// raised.
    fn make_chunks(&self, size_bytes: u64) {
        let count = size_bytes.div_ceil(MALLOC_CHUNK_BYTES as u64) as usize;
        if count == 0 {
            return;
        }
        let (last, _) = segment_of(count - 1);
        for (k, seg) in self.segments.iter().enumerate().take(last + 1) {
            seg.get_or_init(|| {
                (0..SEGMENT0_CHUNKS << k)
                    .map(|_| RwLock::new(None))
                    .collect()
            });
        }
    }

    /// Chunk `index`; `None` past the chunks made so far. The callers
    /// validated their range against the size, whose chunks exist, so
    /// `None` is a bug there: they refuse rather than panic.
    fn chunk(&self, index: usize) -> Result<&Chunk, BdevError> {
        let (seg, at) = segment_of(index);
        self.segments
            .get(seg)
            .and_then(OnceLock::get)
            .and_then(|s| s.get(at))
            .ok_or(BdevError::BadRequest("chunk index"))
    }

    /// Length of chunk `index` in a device of the current size (the last
    /// one may be short). Read under the chunk's lock: a chunk allocated
    /// before a grow may be shorter than this (see `write`).
    fn chunk_len(&self, index: usize) -> usize {
        let start = index as u64 * MALLOC_CHUNK_BYTES as u64;
        self.size()
            .saturating_sub(start)
            .min(MALLOC_CHUNK_BYTES as u64) as usize
    }

    /// Load one byte at `offset` (if it is in range and its chunk holds
    /// memory), so that its page's TLB entry and first cache line are on
    /// their way before the copy that needs them (see `MallocChannel`).
    fn touch(&self, offset: u64) {
        self.with_bytes_from(offset, |bytes| {
            if let Some(b) = bytes.first() {
                std::hint::black_box(*b);
            }
        });
    }

    /// Start loading the bytes a read of `len` at `offset` will copy into
    /// the CPU's caches, without waiting (`lull_uring::prefetch`): the
    /// part in its first chunk, if that chunk holds memory (a hole reads
    /// nothing).
    fn prefetch(&self, offset: u64, len: usize) {
        self.with_bytes_from(offset, |bytes| {
            lull_uring::prefetch(&bytes[..len.min(bytes.len())]);
        });
    }

    /// Run `f` on the bytes of `offset`'s chunk from `offset` to the
    /// chunk's end, under the chunk's lock; nothing when the chunk holds
    /// no memory (a hole) or `offset` is past it.
    fn with_bytes_from(&self, offset: u64, f: impl FnOnce(&[u8])) {
        let index = (offset / MALLOC_CHUNK_BYTES as u64) as usize;
        let within = (offset % MALLOC_CHUNK_BYTES as u64) as usize;
        if let Ok(chunk) = self.chunk(index) {
            if let Some(data) = &*chunk.read().unwrap_or_else(PoisonError::into_inner) {
                if let Some(bytes) = data.get(within..).filter(|b| !b.is_empty()) {
                    f(bytes);
                }
            }
        }
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), BdevError> {
        for (index, within, piece, at) in pieces(offset, dst.len()) {
            let chunk = self.chunk(index)?;
            let out = &mut dst[at..at + piece];
            match &*chunk.read().unwrap_or_else(PoisonError::into_inner) {
                Some(data) => {
                    // The old last chunk of a grown device ends at the old
                    // size; past it, it was never written: zeros.
                    let have = data.len().saturating_sub(within).min(piece);
                    if have > 0 {
                        out[..have].copy_from_slice(&data[within..within + have]);
                    }
                    out[have..].fill(0);
                }
                None => out.fill(0),
            }
        }
        Ok(())
    }

    /// `[offset, offset + len)` lent, when it lies in one written chunk
    /// and inside that chunk's memory (module doc); `None`: copy it.
    fn lend(&self, offset: u64, len: usize) -> Option<Lent> {
        let mut one = pieces(offset, len);
        let (index, within, piece, _) = one.next()?;
        if piece != len {
            return None;
        }
        let chunk = self.chunk(index).ok()?;
        let data = chunk.read().unwrap_or_else(PoisonError::into_inner);
        let region: LentRegion = Arc::clone(data.as_ref()?);
        Lent::new(region, within, len)
    }

    /// The chunk's memory, for changing: copied first when loans share it
    /// (module doc), so the bytes they show stay as they were.
    fn own<'a>(&self, data: &'a mut Arc<Box<[u8]>>) -> &'a mut Box<[u8]> {
        if Arc::strong_count(data) > 1 {
            self.lend_copies.fetch_add(1, Ordering::Relaxed);
        }
        Arc::make_mut(data)
    }

    fn write(&self, offset: u64, src: &[u8]) -> Result<(), BdevError> {
        for (index, within, piece, at) in pieces(offset, src.len()) {
            let chunk = self.chunk(index)?;
            let mut guard = chunk.write().unwrap_or_else(PoisonError::into_inner);
            let need = within + piece;
            let data = guard
                .get_or_insert_with(|| Arc::new(self.new_chunk(self.chunk_len(index).max(need))));
            if data.len() < need {
                // Allocated short, as the last chunk, before a grow: extend
                // a copy of it (rare: once per grow at most; loans keep
                // the old one).
                let mut longer = data.to_vec();
                longer.resize(self.chunk_len(index).max(need), 0);
                *data = Arc::new(longer.into_boxed_slice());
            }
            self.own(data)[within..need].copy_from_slice(&src[at..at + piece]);
        }
        Ok(())
    }

    /// A zeroed chunk of `len` bytes: from the reserve when there is one
    /// and `len` is a whole chunk, else fresh from the allocator.
    fn new_chunk(&self, len: usize) -> Box<[u8]> {
        if len == MALLOC_CHUNK_BYTES {
            if let Some(chunk) = self.reserve.as_ref().and_then(|r| r.take()) {
                return chunk;
            }
        }
        vec![0u8; len].into_boxed_slice()
    }

    fn zero(&self, offset: u64, len: usize) -> Result<(), BdevError> {
        for (index, within, piece, _) in pieces(offset, len) {
            let chunk = self.chunk(index)?;
            let mut guard = chunk.write().unwrap_or_else(PoisonError::into_inner);
            // Under the lock: a grow that extended this chunk, and a write
            // past the old end, are seen here, so they are not dropped.
            let whole = within == 0 && piece == self.chunk_len(index);
            if whole {
                // A lent chunk stays with its loans, freed with the last.
                if let (Some(Ok(data)), Some(reserve)) =
                    (guard.take().map(Arc::try_unwrap), &self.reserve)
                {
                    reserve.give(data);
                }
            } else if let Some(data) = guard.as_mut() {
                let end = (within + piece).min(data.len());
                if within < end {
                    self.own(data)[within..end].fill(0);
                }
            }
        }
        Ok(())
    }

    /// Chunk-granular: a chunk never written (or trimmed or zeroed whole)
    /// is a hole; an allocated one is data, even if it holds zeros.
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>, BdevError> {
        let inner = self;
        let size = inner.size();
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= size && len > 0)
            .ok_or(BdevError::OutOfRange { offset, len, size })?;
        let chunk = MALLOC_CHUNK_BYTES as u64;
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end {
            let index = (pos / chunk) as usize;
            let piece = ((index as u64 + 1) * chunk).min(end) - pos;
            let allocated = inner
                .chunk(index)
                .is_ok_and(|c| c.read().unwrap_or_else(PoisonError::into_inner).is_some());
            let e = if allocated {
                Extent::data(piece)
            } else {
                Extent::hole(piece)
            };
            if !push_extent(&mut out, e, max_extents.max(1)) {
                break;
            }
            pos += piece;
        }
        Ok(out)
    }

    /// Runs `req`; a read may be answered with a loan when `lend` (the
    /// channel was told [`Channel::allow_lend`]), its buffer untouched.
    fn execute(&self, req: &mut IoRequest, lend: bool) -> Result<Option<Lent>, BdevError> {
        validate_request(req, self.size())?;
        let len = req.len as usize;
        if req.op == IoOp::Read && lend && len > 0 {
            if let Some(lent) = self.lend(req.offset, len) {
                return Ok(Some(lent));
            }
        }
        self.execute_copying(req).map(|()| None)
    }

    fn execute_copying(&self, req: &mut IoRequest) -> Result<(), BdevError> {
        let len = req.len as usize;
        match req.op {
            IoOp::Read => match req.buf.as_mut() {
                Some(buf) => self.read(req.offset, &mut buf.as_mut_slice()[..len]),
                None => Err(BdevError::BadRequest("read without a buffer")),
            },
            IoOp::Write { .. } => match req.buf.as_ref() {
                Some(buf) => self.write(req.offset, &buf.as_slice()[..len]),
                None => Err(BdevError::BadRequest("write without a buffer")),
            },
            // Memory is as durable as it gets.
            IoOp::Flush => Ok(()),
            // Memory has no "allocated zeros" worth keeping: no_hole is met
            // by reading back zeros either way.
            IoOp::Trim | IoOp::WriteZeroes { .. } => self.zero(req.offset, len),
            // What `extents` says, as records (validated: a buffer of at
            // least one record).
            IoOp::ChangedSince => Err(BdevError::Unsupported("a memory device has no snapshots")),
            IoOp::BlockStatus => match req.buf.as_mut() {
                Some(buf) => {
                    let max = buf.len() / crate::EXTENT_RECORD_LEN;
                    let ext = self.extents(req.offset, u64::from(req.len), max)?;
                    let n = crate::put_extent_records(&ext, buf.as_mut_slice());
                    buf.set_len(n);
                    Ok(())
                }
                None => Err(BdevError::BadRequest("block status without a buffer")),
            },
        }
    }
}

impl BlockDevice for MallocDev {
    fn size_bytes(&self) -> u64 {
        self.inner.size()
    }

    /// New chunks first, then the size: a request validated against the
    /// new size finds its chunks.
    fn grow(&self, size_bytes: u64) -> Result<(), BdevError> {
        let _one = self
            .inner
            .growing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let old = self.inner.size();
        check_grow(old, size_bytes, MALLOC_SIZE_MAX_BYTES)?;
        self.inner.make_chunks(size_bytes);
        self.inner.size_bytes.store(size_bytes, Ordering::Release);
        tracing::info!(from = old, to = size_bytes, "malloc device grown");
        Ok(())
    }

    fn describe(&self) -> String {
        "malloc".to_string()
    }

    /// Chunk-granular: a chunk never written (or trimmed or zeroed whole)
    /// is a hole; an allocated one is data, even if it holds zeros.
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>, BdevError> {
        self.inner.extents(offset, len, max_extents)
    }

    /// Zeroing whole chunks drops them; parts are a memset. Never slow.
    fn zeroes_fast(&self) -> bool {
        true
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        Ok(Box::new(MallocChannel {
            inner: Arc::clone(&self.inner),
            queue: Deferred::new(MALLOC_CHANNEL_DEPTH, false, "malloc"),
            lend: false,
        }))
    }
}

/// A malloc channel: `submit` queues the request; `reap` executes what
/// was submitted, in order, and hands the completions out.
///
/// Why not copy in `submit`: a batch of random 4 KiB reads (a QD32 host
/// sends ~16 at once) copies from memory that is not in cache, and each
/// copy first waits for its page's TLB walk and its cache lines. `submit`
/// prefetches every line of a read of at most [`PREFETCH_READ_BYTES_MAX`]
/// (`lull_uring::prefetch`, which does not wait), so the misses of the
/// whole batch overlap each other and the work between the request's
/// arrival and its copy (the rest of the batch parsed, the replies
/// built; for a lent read the copy is the kernel's, into the socket).
/// A larger read's lines stream in behind its copy anyway (the
/// hardware prefetcher follows a sequential copy), so `reap` only
/// touches its first byte before it copies any, which overlaps the TLB
/// walks and first lines (in a C microbenchmark on the benchmark
/// machine, batches of 16 random 4 KiB copies out of 128 one-MiB chunks
/// took ~280 ns per copy with the touches first, ~430 without).
/// Completions were only ever delivered by `reap`, so the owner sees no
/// difference; writes still land before their completion.
struct MallocChannel {
    inner: Arc<Inner>,
    queue: Deferred,
    /// Reads may be answered with loans ([`Channel::allow_lend`]).
    lend: bool,
}

impl Channel for MallocChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        if req.op == IoOp::Read && req.len as usize <= PREFETCH_READ_BYTES_MAX {
            self.inner.prefetch(req.offset, req.len as usize);
        }
        self.queue.submit(req)
    }

    fn flush_submissions(&mut self) {}

    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        if self.queue.pending().nth(1).is_some() {
            for req in self.queue.pending() {
                if req.op == IoOp::Read && req.len as usize > PREFETCH_READ_BYTES_MAX {
                    self.inner.touch(req.offset);
                }
            }
        }
        let (inner, lend) = (&self.inner, self.lend);
        self.queue.reap(
            |req| {
                inner
                    .execute(req, lend)
                    .map(|l| l.map_or(Data::Buf, Data::Lent))
            },
            done,
        )
    }

    fn allow_lend(&mut self) {
        self.lend = true;
    }

    fn lends(&self) -> bool {
        self.lend
    }

    fn event_fd(&self) -> Option<RawFd> {
        None
    }

    fn in_flight(&self) -> usize {
        self.queue.in_flight()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BufPool;
    use proptest::prelude::*;

    const CHUNK: u64 = MALLOC_CHUNK_BYTES as u64;

    fn run(
        ch: &mut dyn Channel,
        tag: u64,
        op: IoOp,
        offset: u64,
        len: u32,
        buf: Option<IoBuf>,
    ) -> IoCompletion {
        ch.submit(IoRequest {
            tag,
            op,
            offset,
            len,
            buf,
        })
        .map_err(|(_, e)| e)
        .expect("submit");
        ch.flush_submissions();
        let mut out = None;
        assert_eq!(ch.reap(&mut |c| out = Some(c)), 1);
        let c = out.expect("completion");
        assert_eq!(c.tag, tag);
        c
    }

    use crate::IoBuf;

    fn write(ch: &mut dyn Channel, pool: &mut BufPool, offset: u64, data: &[u8]) {
        let mut buf = pool.get(data.len());
        buf.as_mut_slice().copy_from_slice(data);
        let c = run(
            ch,
            1,
            IoOp::Write { fua: false },
            offset,
            data.len() as u32,
            Some(buf),
        );
        c.result.expect("write ok");
        pool.put(c.buf.expect("buf back"));
    }

    fn read(ch: &mut dyn Channel, pool: &mut BufPool, offset: u64, len: usize) -> Vec<u8> {
        let c = run(ch, 2, IoOp::Read, offset, len as u32, Some(pool.get(len)));
        c.result.expect("read ok");
        let buf = c.buf.expect("buf back");
        let v = buf.as_slice()[..len].to_vec();
        pool.put(buf);
        v
    }

    #[test]
    fn unaligned_round_trip_across_chunks() {
        let dev = MallocDev::new(4 * CHUNK + 123).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut pool = BufPool::new(64 << 20);
        let data: Vec<u8> = (0..(2 * CHUNK as usize + 777))
            .map(|i| (i % 251) as u8 + 1)
            .collect();
        let offset = CHUNK - 333;
        write(&mut *ch, &mut pool, offset, &data);
        assert_eq!(read(&mut *ch, &mut pool, offset, data.len()), data);
        // Sparse parts read as zeros, including the unwritten start.
        assert!(read(&mut *ch, &mut pool, 0, 4096).iter().all(|&b| b == 0));
        let around = read(&mut *ch, &mut pool, offset - 10, 20);
        assert_eq!(&around[..10], &[0; 10]);
        assert_eq!(&around[10..], &data[..10]);
        // The short last chunk works.
        write(&mut *ch, &mut pool, 4 * CHUNK + 100, &[9; 23]);
        assert_eq!(
            read(&mut *ch, &mut pool, 4 * CHUNK + 99, 24),
            [&[0][..], &[9; 23]].concat()
        );
        assert_eq!(dev.chunks_allocated(), 5);
    }

    /// A read on a lending channel, its loan (if lent) and its buffer.
    fn read_lent(
        ch: &mut dyn Channel,
        pool: &mut BufPool,
        offset: u64,
        len: usize,
    ) -> (Option<Lent>, Vec<u8>) {
        let mut buf = pool.get(len);
        buf.as_mut_slice().fill(0xee);
        let c = run(ch, 2, IoOp::Read, offset, len as u32, Some(buf));
        c.result.expect("read ok");
        let buf = c.buf.expect("buf back");
        let v = buf.as_slice()[..len].to_vec();
        pool.put(buf);
        let lent = match c.data {
            Data::Lent(l) => Some(l),
            Data::Buf => None,
            Data::Spliced(_) => panic!("a memory channel handed over a descriptor"),
        };
        (lent, v)
    }

    /// A lending channel lends reads inside one written chunk (the bytes
    /// written, the buffer untouched); it copies reads of holes (zeros,
    /// no chunk made), across a chunk boundary and past a short chunk's
    /// end; a channel not told to lend never does.
    #[test]
    fn lends_reads_inside_one_written_chunk() {
        let dev = MallocDev::new(3 * CHUNK + 8192).unwrap();
        let mut ch = dev.open_channel().unwrap();
        ch.allow_lend();
        let mut pool = BufPool::new(64 << 20);
        let data: Vec<u8> = (0..3 * CHUNK as usize)
            .map(|i| (i % 251) as u8 + 1)
            .collect();
        write(&mut *ch, &mut pool, 0, &data);
        for (offset, len) in [
            (0, 4096),
            (CHUNK + 512, 131072),
            (2 * CHUNK, CHUNK as usize),
            (7, 1),
        ] {
            let (lent, buf) = read_lent(&mut *ch, &mut pool, offset, len);
            let lent = lent.expect("lent");
            assert!(lent.as_slice() == &data[offset as usize..offset as usize + len]);
            assert!(buf.iter().all(|&b| b == 0xee), "the buffer is not written");
        }
        // Across a boundary: copied, right.
        let (lent, buf) = read_lent(&mut *ch, &mut pool, CHUNK - 100, 200);
        assert!(lent.is_none());
        assert_eq!(buf, &data[CHUNK as usize - 100..CHUNK as usize + 100]);
        // A hole: zeros in the buffer, nothing lent, no chunk made.
        let (lent, buf) = read_lent(&mut *ch, &mut pool, 3 * CHUNK, 4096);
        assert!(lent.is_none());
        assert!(buf.iter().all(|&b| b == 0));
        assert_eq!(dev.chunks_allocated(), 3);
        // A short last chunk, grown past: its old end is where loans stop.
        write(&mut *ch, &mut pool, 3 * CHUNK, &[5; 4096]);
        dev.grow(4 * CHUNK).unwrap();
        let (lent, _) = read_lent(&mut *ch, &mut pool, 3 * CHUNK + 4096, 4096);
        assert!(lent
            .expect("inside the short chunk")
            .as_slice()
            .iter()
            .all(|&b| b == 0));
        let (lent, buf) = read_lent(&mut *ch, &mut pool, 3 * CHUNK + 8192, 4096);
        assert!(lent.is_none(), "past the short chunk's memory: copied");
        assert!(buf.iter().all(|&b| b == 0));
        // Not told to lend: copies.
        let mut plain = dev.open_channel().unwrap();
        let (lent, buf) = read_lent(&mut *plain, &mut pool, 0, 4096);
        assert!(lent.is_none());
        assert_eq!(buf, &data[..4096]);
    }

    /// A loan keeps its bytes as they were and its memory alive: a write
    /// to the lent chunk copies it (the device sees the write, the loan
    /// the old bytes), a whole-chunk trim and the device's drop leave the
    /// memory to the loan; an unshared chunk is not copied.
    #[test]
    fn a_loan_outlives_writes_trims_and_the_device() {
        let reserve = ChunkReserve::new(4 * MALLOC_CHUNK_BYTES);
        let dev = MallocDev::with_reserve(2 * CHUNK, Some(reserve.clone())).unwrap();
        let mut ch = dev.open_channel().unwrap();
        ch.allow_lend();
        let mut pool = BufPool::new(64 << 20);
        write(&mut *ch, &mut pool, 0, &[1; 8192]);
        write(&mut *ch, &mut pool, CHUNK, &[2; 8192]);
        write(&mut *ch, &mut pool, 0, &[3; 4096]);
        assert_eq!(dev.lend_copies(), 0, "no loan: written in place");
        let (a, _) = read_lent(&mut *ch, &mut pool, 0, 8192);
        let a = a.expect("lent");
        write(&mut *ch, &mut pool, 4096, &[4; 4096]);
        assert_eq!(dev.lend_copies(), 1, "the lent chunk was copied");
        assert_eq!(&a.as_slice()[..4096], &[3; 4096][..]);
        assert_eq!(
            &a.as_slice()[4096..],
            &[1; 4096][..],
            "the loan kept the old bytes"
        );
        assert_eq!(read(&mut *ch, &mut pool, 4096, 4096), vec![4; 4096]);
        // A partial zero of a lent chunk copies it too.
        let (b, _) = read_lent(&mut *ch, &mut pool, CHUNK, 4096);
        let b = b.expect("lent");
        run(
            &mut *ch,
            3,
            IoOp::WriteZeroes {
                no_hole: true,
                fua: false,
                fast: false,
            },
            CHUNK,
            512,
            None,
        )
        .result
        .unwrap();
        assert_eq!(dev.lend_copies(), 2);
        assert_eq!(b.as_slice(), &[2; 4096][..]);
        // A whole-chunk trim drops the device's reference; the lent memory
        // does not go to the reserve.
        let (b2, _) = read_lent(&mut *ch, &mut pool, CHUNK, 4096);
        let b2 = b2.expect("lent");
        run(&mut *ch, 4, IoOp::Trim, CHUNK, CHUNK as u32, None)
            .result
            .unwrap();
        assert_eq!(reserve.chunks(), 0);
        assert_eq!(b.as_slice(), &[2; 4096][..]);
        assert_eq!(&b2.as_slice()[..512], &[0; 512][..]);
        assert_eq!(&b2.as_slice()[512..], &[2; 3584][..]);
        assert!(read(&mut *ch, &mut pool, CHUNK, 4096)
            .iter()
            .all(|&x| x == 0));
        // The device dropped: the loans still read their bytes; the
        // unshared chunk went to the reserve.
        let (c, _) = read_lent(&mut *ch, &mut pool, 0, 4096);
        let c = c.expect("lent");
        drop(ch);
        drop(dev);
        assert_eq!(reserve.chunks(), 0, "the one chunk left is lent");
        assert_eq!(c.as_slice(), &[3; 4096][..]);
        assert_eq!(&a.as_slice()[4096..], &[1; 4096][..]);
        assert_eq!(b.as_slice(), &[2; 4096][..]);
    }

    /// Writers on other threads rewrite a block with whole patterns while
    /// a lending channel reads it: every loan shows one whole pattern (the
    /// old or the new, never a mix), and keeps showing it while it is held.
    #[test]
    fn loans_racing_writes_show_whole_old_or_new_data() {
        let dev = MallocDev::new(2 * CHUNK).unwrap();
        let rounds = 2000u32;
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let writer = s.spawn(|| {
                let mut ch = dev.open_channel().unwrap();
                let mut pool = BufPool::new(1 << 20);
                let mut i = 0u8;
                while !stop.load(Ordering::Relaxed) {
                    i = i.wrapping_add(1);
                    write(&mut *ch, &mut pool, CHUNK + 4096, &[i; 8192]);
                }
            });
            let mut ch = dev.open_channel().unwrap();
            ch.allow_lend();
            let mut pool = BufPool::new(1 << 20);
            write(&mut *ch, &mut pool, CHUNK + 4096, &[0; 8192]);
            let mut held = std::collections::VecDeque::new();
            // At least `rounds`, and on until writes met loans (the
            // writer may start late on a busy machine), for a bounded time.
            let start = std::time::Instant::now();
            let mut done = 0;
            while done < rounds
                || (dev.lend_copies() < 10 && start.elapsed() < std::time::Duration::from_secs(20))
            {
                done += 1;
                let (lent, _) = read_lent(&mut *ch, &mut pool, CHUNK + 4096, 8192);
                let lent = lent.expect("lent");
                let first = lent.as_slice()[0];
                assert!(
                    lent.as_slice().iter().all(|&b| b == first),
                    "a mix of writes"
                );
                held.push_back((first, lent));
                if held.len() > 8 {
                    let (first, lent) = held.pop_front().unwrap();
                    assert!(
                        lent.as_slice().iter().all(|&b| b == first),
                        "a loan changed"
                    );
                }
            }
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap();
        });
        assert!(dev.lend_copies() > 0, "writes met loans: the race happened");
    }

    /// Requests run in `reap`, in submission order: a read submitted
    /// after a write of the same range in one batch sees it; reads of
    /// never-written chunks and bad requests in a batch (touched first)
    /// complete as alone; `in_flight` and the depth count what is
    /// pending.
    #[test]
    fn a_batch_runs_at_reap_in_submission_order() {
        let dev = MallocDev::new(4 * CHUNK).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut pool = BufPool::new(64 << 20);
        let mut wbuf = pool.get(4096);
        wbuf.as_mut_slice().fill(0x77);
        let reqs = [
            (1, IoOp::Read, CHUNK, None),
            (2, IoOp::Write { fua: false }, CHUNK + 512, Some(wbuf)),
            (3, IoOp::Read, CHUNK, Some(pool.get(4096))),
            (4, IoOp::Read, 3 * CHUNK, Some(pool.get(4096))),
            (5, IoOp::Read, 4 * CHUNK, Some(pool.get(4096))),
        ];
        for (tag, op, offset, buf) in reqs {
            ch.submit(IoRequest {
                tag,
                op,
                offset,
                len: 4096,
                buf,
            })
            .map_err(|(_, e)| e)
            .expect("submit");
        }
        ch.flush_submissions();
        assert_eq!(ch.in_flight(), 5);
        assert_eq!(dev.chunks_allocated(), 0, "nothing runs before reap");
        let mut got = Vec::new();
        assert_eq!(ch.reap(&mut |c| got.push(c)), 5);
        assert_eq!(ch.in_flight(), 0);
        let tags: Vec<u64> = got.iter().map(|c| c.tag).collect();
        assert_eq!(tags, [1, 2, 3, 4, 5]);
        assert!(matches!(got[0].result, Err(BdevError::BadRequest(_))));
        assert!(got[1].result.is_ok());
        let read = got[2].buf.as_ref().expect("buf").as_slice();
        assert!(read[..512].iter().all(|&b| b == 0));
        assert!(read[512..].iter().all(|&b| b == 0x77));
        assert!(got[3]
            .buf
            .as_ref()
            .expect("buf")
            .as_slice()
            .iter()
            .all(|&b| b == 0));
        assert!(matches!(got[4].result, Err(BdevError::OutOfRange { .. })));

        // The depth counts pending requests.
        for tag in 0..MALLOC_CHANNEL_DEPTH as u64 {
            ch.submit(IoRequest {
                tag,
                op: IoOp::Flush,
                offset: 0,
                len: 0,
                buf: None,
            })
            .map_err(|(_, e)| e)
            .expect("submit");
        }
        let full = ch.submit(IoRequest {
            tag: 999,
            op: IoOp::Flush,
            offset: 0,
            len: 0,
            buf: None,
        });
        assert!(matches!(full, Err((_, BdevError::Full { .. }))));
        assert_eq!(ch.reap(&mut |_| {}), MALLOC_CHANNEL_DEPTH);
    }

    #[test]
    fn trim_and_write_zeroes_zero_and_free() {
        let dev = MallocDev::new(3 * CHUNK).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut pool = BufPool::new(64 << 20);
        write(&mut *ch, &mut pool, 0, &vec![0xaa; 3 * CHUNK as usize]);
        assert_eq!(dev.chunks_allocated(), 3);
        // Trim the middle chunk exactly plus 10 bytes each side.
        let c = run(&mut *ch, 3, IoOp::Trim, CHUNK - 10, CHUNK as u32 + 20, None);
        c.result.unwrap();
        assert_eq!(dev.chunks_allocated(), 2);
        let v = read(&mut *ch, &mut pool, CHUNK - 11, CHUNK as usize + 22);
        assert_eq!(v[0], 0xaa);
        assert!(v[1..v.len() - 1].iter().all(|&b| b == 0));
        assert_eq!(v[v.len() - 1], 0xaa);
        let c = run(
            &mut *ch,
            4,
            IoOp::WriteZeroes {
                no_hole: true,
                fua: true,
                fast: true,
            },
            5,
            7,
            None,
        );
        c.result.unwrap();
        assert_eq!(
            read(&mut *ch, &mut pool, 4, 9),
            [0xaa, 0, 0, 0, 0, 0, 0, 0, 0xaa]
        );
    }

    #[test]
    fn extents_follow_allocated_chunks() {
        let dev = MallocDev::new(4 * CHUNK + 100).unwrap();
        let size = dev.size_bytes();
        assert_eq!(dev.extents(0, size, 8).unwrap(), [Extent::hole(size)]);
        let mut ch = dev.open_channel().unwrap();
        let mut pool = BufPool::new(64 << 20);
        write(&mut *ch, &mut pool, CHUNK + 5, &[1; 10]);
        write(&mut *ch, &mut pool, 4 * CHUNK + 1, &[1; 10]);
        assert_eq!(
            dev.extents(10, size - 10, 8).unwrap(),
            [
                Extent::hole(CHUNK - 10),
                Extent::data(CHUNK),
                Extent::hole(2 * CHUNK),
                Extent::data(100),
            ]
        );
        // A cap describes a prefix.
        assert_eq!(dev.extents(0, size, 1).unwrap(), [Extent::hole(CHUNK)]);
        assert_eq!(dev.extents(CHUNK, 3, 1).unwrap(), [Extent::data(3)]);
        assert!(dev.extents(size, 1, 1).is_err());
        // Zeroing a whole chunk makes it a hole again.
        let zero = IoOp::WriteZeroes {
            no_hole: false,
            fua: false,
            fast: true,
        };
        run(&mut *ch, 3, zero, CHUNK, CHUNK as u32, None)
            .result
            .unwrap();
        assert_eq!(
            dev.extents(0, 4 * CHUNK, 8).unwrap(),
            [Extent::hole(4 * CHUNK)]
        );
    }

    #[test]
    fn bad_requests_complete_with_errors() {
        let dev = MallocDev::new(8192).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut pool = BufPool::new(1 << 20);
        let c = run(&mut *ch, 5, IoOp::Read, 8000, 200, Some(pool.get(200)));
        assert!(matches!(
            c.result,
            Err(BdevError::OutOfRange {
                offset: 8000,
                len: 200,
                size: 8192
            })
        ));
        assert!(c.buf.is_some());
        let c = run(
            &mut *ch,
            6,
            IoOp::Write { fua: false },
            u64::MAX - 1,
            10,
            Some(pool.get(10)),
        );
        assert_eq!(c.result.unwrap_err().errno(), libc::EINVAL);
        let c = run(&mut *ch, 7, IoOp::Trim, 8193, 0, None);
        assert!(matches!(c.result, Err(BdevError::OutOfRange { .. })));
        let c = run(&mut *ch, 8, IoOp::Read, 0, 100, None);
        assert!(matches!(c.result, Err(BdevError::BadRequest(_))));
        let c = run(&mut *ch, 9, IoOp::Read, 0, 100, Some(pool.get(50)));
        assert!(matches!(c.result, Err(BdevError::BadRequest(_))));
        run(&mut *ch, 10, IoOp::Flush, 0, 0, None).result.unwrap();
        run(&mut *ch, 11, IoOp::Read, 8192, 0, Some(pool.get(0)))
            .result
            .unwrap();
        assert_eq!(dev.chunks_allocated(), 0);
    }

    #[test]
    fn full_channel_hands_the_request_back() {
        let dev = MallocDev::new(4096).unwrap();
        let mut ch = dev.open_channel().unwrap();
        for tag in 0..MALLOC_CHANNEL_DEPTH as u64 {
            ch.submit(IoRequest {
                tag,
                op: IoOp::Flush,
                offset: 0,
                len: 0,
                buf: None,
            })
            .unwrap();
        }
        assert_eq!(ch.in_flight(), MALLOC_CHANNEL_DEPTH);
        let (req, err) = ch
            .submit(IoRequest {
                tag: 999,
                op: IoOp::Flush,
                offset: 0,
                len: 0,
                buf: None,
            })
            .unwrap_err();
        assert_eq!(req.tag, 999);
        assert!(matches!(
            err,
            BdevError::Full {
                capacity: MALLOC_CHANNEL_DEPTH
            }
        ));
        let mut tags = Vec::new();
        assert_eq!(ch.reap(&mut |c| tags.push(c.tag)), MALLOC_CHANNEL_DEPTH);
        assert_eq!(tags, (0..MALLOC_CHANNEL_DEPTH as u64).collect::<Vec<_>>());
        assert_eq!(ch.in_flight(), 0);
        assert!(ch.event_fd().is_none());
    }

    #[test]
    fn channels_on_several_threads_share_the_device() {
        let dev = MallocDev::new(4 * CHUNK).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let dev = &dev;
                s.spawn(move || {
                    let mut ch = dev.open_channel().unwrap();
                    let mut pool = BufPool::new(1 << 20);
                    // Interleaved 512-byte stripes in the same chunks.
                    for i in 0..64u64 {
                        write(
                            &mut *ch,
                            &mut pool,
                            (i * 4 + u64::from(t)) * 512,
                            &[t + 1; 512],
                        );
                    }
                });
            }
        });
        let mut ch = dev.open_channel().unwrap();
        let mut pool = BufPool::new(1 << 20);
        let v = read(&mut *ch, &mut pool, 0, 64 * 4 * 512);
        for (i, stripe) in v.chunks(512).enumerate() {
            assert!(stripe.iter().all(|&b| b == (i % 4) as u8 + 1));
        }
    }

    /// Chunks freed by a whole-chunk trim and by a dropped device go to
    /// the reserve (as many as it keeps, full-size only); a device taking
    /// one sees zeros wherever it did not write.
    #[test]
    fn a_reserve_reuses_freed_chunks_and_hands_out_zeros() {
        let reserve = ChunkReserve::new(2 * MALLOC_CHUNK_BYTES + 4096);
        let mut pool = BufPool::new(64 << 20);
        {
            // Three full chunks and a short last one, all written.
            let dev = MallocDev::with_reserve(3 * CHUNK + 8192, Some(reserve.clone())).unwrap();
            let mut ch = dev.open_channel().unwrap();
            write(
                &mut *ch,
                &mut pool,
                0,
                &vec![0xaa; 3 * CHUNK as usize + 8192],
            );
            assert_eq!(reserve.chunks(), 0);
            run(&mut *ch, 3, IoOp::Trim, CHUNK, CHUNK as u32, None)
                .result
                .unwrap();
            assert_eq!(reserve.chunks(), 1, "a whole-chunk trim gives its chunk");
            assert_eq!(dev.chunks_allocated(), 3);
        }
        assert_eq!(reserve.chunks(), 2, "at most what the reserve keeps");
        let dev = MallocDev::with_reserve(4 * CHUNK, Some(reserve.clone())).unwrap();
        let mut ch = dev.open_channel().unwrap();
        write(&mut *ch, &mut pool, 2 * CHUNK + 5, &[7; 10]);
        write(&mut *ch, &mut pool, 3 * CHUNK, &[9; 4096]);
        assert_eq!(reserve.chunks(), 0, "both new chunks came from the reserve");
        let v = read(&mut *ch, &mut pool, 2 * CHUNK, 2 * CHUNK as usize);
        let mut want = vec![0u8; 2 * CHUNK as usize];
        want[5..15].fill(7);
        want[CHUNK as usize..CHUNK as usize + 4096].fill(9);
        assert!(
            v == want,
            "a reserved chunk reads as zeros where not written"
        );
        // Past the reserve: fresh chunks.
        write(&mut *ch, &mut pool, 0, &[1; 4096]);
        assert_eq!(dev.chunks_allocated(), 3);
        assert!(read(&mut *ch, &mut pool, 4096, CHUNK as usize - 4096)
            .iter()
            .all(|&b| b == 0));
        // A reserve of nothing keeps nothing.
        let none = ChunkReserve::new(MALLOC_CHUNK_BYTES - 1);
        {
            let d = MallocDev::with_reserve(CHUNK, Some(none.clone())).unwrap();
            let mut ch = d.open_channel().unwrap();
            write(&mut *ch, &mut pool, 0, &[1; 10]);
        }
        assert_eq!(none.chunks(), 0);
    }

    #[test]
    fn segments_cover_the_chunk_indexes() {
        assert_eq!(segment_of(0), (0, 0));
        assert_eq!(segment_of(SEGMENT0_CHUNKS - 1), (0, SEGMENT0_CHUNKS - 1));
        assert_eq!(segment_of(SEGMENT0_CHUNKS), (1, 0));
        assert_eq!(
            segment_of(3 * SEGMENT0_CHUNKS - 1),
            (1, 2 * SEGMENT0_CHUNKS - 1)
        );
        assert_eq!(segment_of(3 * SEGMENT0_CHUNKS), (2, 0));
        let last = (MALLOC_SIZE_MAX_BYTES / CHUNK) as usize - 1;
        let (seg, at) = segment_of(last);
        assert!(seg < SEGMENTS && at < SEGMENT0_CHUNKS << seg);
    }

    #[test]
    fn grows_online_and_keeps_the_data() {
        // A short last chunk, written, then grown past it: the old data
        // stays, the new tail reads as zeros and takes writes, and a
        // channel opened before the grow sees the new size.
        let old = 2 * CHUNK + 8192;
        let dev = MallocDev::new(old).unwrap();
        let mut ch = dev.open_channel().unwrap();
        let mut pool = BufPool::new(64 << 20);
        write(&mut *ch, &mut pool, old - 4096, &[7; 4096]);
        let past = run(&mut *ch, 1, IoOp::Read, old, 4096, Some(pool.get(4096)));
        assert!(matches!(past.result, Err(BdevError::OutOfRange { .. })));
        pool.put(past.buf.unwrap());
        let new = 200 * CHUNK;
        dev.grow(new).expect("grow");
        assert_eq!(dev.size_bytes(), new);
        assert_eq!(read(&mut *ch, &mut pool, old - 4096, 4096), vec![7; 4096]);
        assert!(read(&mut *ch, &mut pool, old, 8192).iter().all(|&b| b == 0));
        // Into the old short chunk past its end, and far into a new segment.
        write(&mut *ch, &mut pool, old - 10, &[9; 20]);
        write(&mut *ch, &mut pool, new - 4096, &[5; 4096]);
        let mut want = vec![7u8; 4096 - 10];
        want.extend_from_slice(&[9; 20]);
        want.extend_from_slice(&[0; 10]);
        assert_eq!(read(&mut *ch, &mut pool, old - 4096, 4096 + 20), want);
        assert_eq!(read(&mut *ch, &mut pool, new - 4096, 4096), vec![5; 4096]);
        // Zeroing the whole grown chunk frees it.
        run(&mut *ch, 3, IoOp::Trim, 2 * CHUNK, CHUNK as u32, None)
            .result
            .unwrap();
        assert!(read(&mut *ch, &mut pool, old - 10, 20)
            .iter()
            .all(|&b| b == 0));
        assert_eq!(
            dev.extents(2 * CHUNK, CHUNK, 4).unwrap(),
            [Extent::hole(CHUNK)]
        );
        // The same size again is a no-op.
        dev.grow(new).expect("same size");
        assert_eq!(dev.size_bytes(), new);
    }

    #[test]
    fn grow_refuses_shrinking_odd_sizes_and_too_big() {
        let dev = MallocDev::new(1 << 20).unwrap();
        assert!(matches!(
            dev.grow(4096),
            Err(BdevError::Shrink {
                size: 1048576,
                requested: 4096
            })
        ));
        assert!(matches!(
            dev.grow((2 << 20) + 512),
            Err(BdevError::ResizeUnaligned { .. })
        ));
        assert!(matches!(
            dev.grow(MALLOC_SIZE_MAX_BYTES + 4096),
            Err(BdevError::TooLarge { .. })
        ));
        assert_eq!(dev.size_bytes(), 1 << 20, "a refused grow changes nothing");
    }

    #[test]
    fn a_grow_under_concurrent_io_loses_nothing() {
        // Writers on other threads keep writing, below the old end and at
        // the tail, while the device grows step by step: every write reads
        // back, and a request checked against any size seen stays in range.
        let dev = MallocDev::new(CHUNK + 4096).unwrap();
        let steps = 64u64;
        std::thread::scope(|s| {
            for t in 0..2u8 {
                let dev = &dev;
                s.spawn(move || {
                    let mut ch = dev.open_channel().unwrap();
                    let mut pool = BufPool::new(1 << 20);
                    for i in 0..256u64 {
                        // Thread 0 below the old end, thread 1 at the
                        // current tail (past the old end): never overlapping.
                        let offset = match t {
                            0 => (i * 4096) % (CHUNK / 2),
                            _ => dev.size_bytes() - 4096,
                        };
                        let fill = (i as u8) | 1;
                        write(&mut *ch, &mut pool, offset, &[fill; 4096]);
                        assert_eq!(read(&mut *ch, &mut pool, offset, 4096), vec![fill; 4096]);
                    }
                });
            }
            for k in 1..=steps {
                dev.grow(CHUNK + 4096 + k * (CHUNK / 2)).expect("grow");
            }
        });
        assert_eq!(dev.size_bytes(), CHUNK + 4096 + steps * (CHUNK / 2));
    }

    #[derive(Debug, Clone)]
    enum Step {
        Write { offset: u64, len: usize, seed: u8 },
        Trim { offset: u64, len: usize },
        Zero { offset: u64, len: usize },
        Read { offset: u64, len: usize },
    }

    fn step(size: u64) -> impl Strategy<Value = Step> {
        let range =
            (0..size).prop_flat_map(move |o| (Just(o), 0..=((size - o).min(3 * CHUNK) as usize)));
        prop_oneof![
            (range.clone(), any::<u8>()).prop_map(|((offset, len), seed)| Step::Write {
                offset,
                len,
                seed
            }),
            range
                .clone()
                .prop_map(|(offset, len)| Step::Trim { offset, len }),
            range
                .clone()
                .prop_map(|(offset, len)| Step::Zero { offset, len }),
            range.prop_map(|(offset, len)| Step::Read { offset, len }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]
        #[test]
        fn matches_a_vec_oracle(steps in proptest::collection::vec(step(4 * CHUNK + 1000), 1..24)) {
            let size = 4 * CHUNK + 1000;
            let dev = MallocDev::new(size).unwrap();
            let mut ch = dev.open_channel().unwrap();
            let mut pool = BufPool::new(64 << 20);
            let mut oracle = vec![0u8; size as usize];
            for s in steps {
                match s {
                    Step::Write { offset, len, seed } => {
                        let data: Vec<u8> = (0..len).map(|i| seed.wrapping_add(i as u8) | 1).collect();
                        write(&mut *ch, &mut pool, offset, &data);
                        oracle[offset as usize..offset as usize + len].copy_from_slice(&data);
                    }
                    Step::Trim { offset, len } => {
                        run(&mut *ch, 3, IoOp::Trim, offset, len as u32, None).result.unwrap();
                        oracle[offset as usize..offset as usize + len].fill(0);
                    }
                    Step::Zero { offset, len } => {
                        let op = IoOp::WriteZeroes { no_hole: len % 2 == 0, fua: false, fast: len % 3 == 0 };
                        run(&mut *ch, 4, op, offset, len as u32, None).result.unwrap();
                        oracle[offset as usize..offset as usize + len].fill(0);
                    }
                    Step::Read { offset, len } => {
                        let got = read(&mut *ch, &mut pool, offset, len);
                        prop_assert_eq!(&got[..], &oracle[offset as usize..offset as usize + len]);
                    }
                }
            }
            let all = read(&mut *ch, &mut pool, 0, size as usize);
            prop_assert!(all == oracle);
        }
    }
}
