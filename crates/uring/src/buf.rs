//! `IoBuf`: an owned, page-aligned heap buffer that can be handed to the
//! kernel (O_DIRECT needs aligned memory), and `BufPool`, a per-thread cache
//! of them so the steady-state I/O path allocates nothing.
//!
//! ```
//! use lull_uring::{BufPool, IoBuf};
//! let mut pool = BufPool::new(64 << 20);
//! let mut buf = pool.get(5000); // an 8 KiB buffer, len 5000
//! buf.as_mut_slice()[0] = 1;
//! pool.put(buf); // cached for the next get of the same size class
//! assert_eq!(pool.get(8192).capacity(), 8192);
//! assert_eq!(pool.stats().allocations, 1);
//! ```

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::arena::FixedArena;

/// Alignment and capacity granularity of every `IoBuf`: one page, which
/// satisfies O_DIRECT on every logical block size up to 4 KiB.
pub const IO_BUF_ALIGN_BYTES: usize = 4096;

/// An owned, `IO_BUF_ALIGN_BYTES`-aligned, zero-initialised buffer, from
/// the heap or from a [`FixedArena`] (prefaulted, registered with
/// io_uring; see [`IoBuf::is_fixed`]). An arena buffer goes back to its
/// arena when dropped, on whatever thread.
///
/// Its capacity is a multiple of 4096 bytes and never changes; its length
/// (`len`) is the part that is in use, at most the capacity. All bytes up to
/// the capacity are always initialised (zeroed at allocation, then whatever
/// was last written), so growing the length never exposes uninitialised
/// memory.
pub struct IoBuf {
    ptr: NonNull<u8>,
    capacity: usize,
    len: usize,
    /// `Some`: the bytes are a buffer of this arena (returned to it on
    /// drop); `None`: a heap allocation of `capacity` bytes.
    arena: Option<Arc<FixedArena>>,
}

// SAFETY: `IoBuf` uniquely owns its heap allocation or arena buffer (like
// `Box<[u8]>`); the arena it may hold is `Send + Sync`.
unsafe impl Send for IoBuf {}
// SAFETY: shared references only give out `&[u8]`, which is `Sync`.
unsafe impl Sync for IoBuf {}

impl IoBuf {
    /// A zeroed buffer of at least `capacity` bytes (rounded up to a multiple
    /// of 4096, at least 4096), with length 0.
    ///
    /// Aborts via `handle_alloc_error` if memory is exhausted, as `Vec` does.
    pub fn with_capacity(capacity: usize) -> IoBuf {
        let capacity = capacity
            .max(1)
            .checked_next_multiple_of(IO_BUF_ALIGN_BYTES)
            .unwrap_or(usize::MAX - (IO_BUF_ALIGN_BYTES - 1));
        let layout = match Layout::from_size_align(capacity, IO_BUF_ALIGN_BYTES) {
            Ok(layout) => layout,
            // Only a capacity near usize::MAX gets here; treat it as OOM.
            Err(_) => alloc::handle_alloc_error(Layout::new::<u8>()),
        };
        // SAFETY: `layout` has a non-zero size (capacity >= 4096).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        IoBuf {
            ptr,
            capacity,
            len: 0,
            arena: None,
        }
    }

    /// A buffer over `capacity` bytes of `arena` at `ptr`, length 0.
    ///
    /// # Safety
    /// `ptr..ptr + capacity` is one buffer of `arena` (4096-aligned,
    /// initialised), taken off its free list: nothing else uses it until
    /// this `IoBuf` gives it back on drop.
    pub(crate) unsafe fn from_arena(
        ptr: NonNull<u8>,
        capacity: usize,
        arena: Arc<FixedArena>,
    ) -> IoBuf {
        IoBuf {
            ptr,
            capacity,
            len: 0,
            arena: Some(arena),
        }
    }

    /// Whether the buffer lives in a [`FixedArena`] (prefaulted, and
    /// registered with the rings of file channels: READ_FIXED/WRITE_FIXED).
    pub fn is_fixed(&self) -> bool {
        self.arena.is_some()
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated (a multiple of 4096).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the length. Bytes newly exposed keep whatever they last held
    /// (zero if never written). Lengths above the capacity are clamped to
    /// it; `set_len` never panics.
    pub fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.capacity, "IoBuf::set_len past capacity");
        self.len = len.min(self.capacity);
    }

    /// The bytes in use.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `capacity` initialised bytes owned by
        // `self`, `len <= capacity`, and `&self` prevents mutation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes in use, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Start of the allocation (aligned to 4096).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the allocation, for writing (aligned to 4096).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    fn layout(&self) -> Layout {
        // Cannot fail: the same size and alignment were accepted at allocation.
        Layout::from_size_align(self.capacity, IO_BUF_ALIGN_BYTES)
            .unwrap_or_else(|_| Layout::new::<u8>())
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        match self.arena.take() {
            Some(arena) => arena.give_back(self.ptr, self.capacity),
            // SAFETY: `ptr` was returned by `alloc_zeroed` with this exact
            // layout and is freed only here, once.
            None => unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout()) },
        }
    }
}

impl fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .field("fixed", &self.is_fixed())
            .finish()
    }
}

/// Smallest pooled size class: one page.
pub const POOL_CLASS_MIN_BYTES: usize = 4096;
/// Largest pooled size class: 32 MiB, half the NBD maximum payload (the
/// common clients' largest request). Larger buffers (40 and 64 MiB
/// requests of clients that do not negotiate block sizes) are allocated
/// exactly and freed on `put`, so a pool never caches them.
pub const POOL_CLASS_MAX_BYTES: usize = 32 << 20;
const POOL_CLASSES: usize =
    (POOL_CLASS_MAX_BYTES.trailing_zeros() - POOL_CLASS_MIN_BYTES.trailing_zeros()) as usize + 1;
/// Buffers kept per size class: enough for a full queue (256 in flight) of
/// one size plus slack; more than that is a burst, not a steady state.
pub const POOL_BUFS_PER_CLASS_MAX: usize = 512;

/// Allocation counters of a `BufPool`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BufPoolStats {
    /// Buffers allocated because no cached one fitted.
    pub allocations: u64,
    /// `get`s served from the cache.
    pub reuses: u64,
    /// Buffers freed by `put` because a cap was reached.
    pub frees: u64,
    /// Bytes currently cached.
    pub cached_bytes: usize,
    /// Buffers currently cached.
    pub cached_bufs: usize,
    /// `get`s served from the calling thread's fixed arena (neither
    /// allocated nor cached here).
    pub arena_gets: u64,
}

/// A per-thread cache of `IoBuf`s in power-of-two size classes from 4 KiB to
/// 32 MiB. `get` takes a buffer from the calling thread's fixed arena when
/// it has one that fits (reactor threads; see [`crate::init_thread_arena`]),
/// else reuses a cached heap buffer of the request's class or allocates
/// one; `put` returns an arena buffer to its arena and caches a heap one
/// unless the class holds `POOL_BUFS_PER_CLASS_MAX` buffers or the pool
/// would exceed the byte cap given to `new`.
///
/// Not `Sync`: one pool per lull thread. It is `Send`, so a thread can move
/// between reactors with it.
pub struct BufPool {
    classes: [Vec<IoBuf>; POOL_CLASSES],
    max_cached_bytes: usize,
    stats: BufPoolStats,
}

impl BufPool {
    /// An empty pool that caches at most `max_cached_bytes` bytes.
    pub fn new(max_cached_bytes: usize) -> BufPool {
        BufPool {
            classes: std::array::from_fn(|_| Vec::new()),
            max_cached_bytes,
            stats: BufPoolStats::default(),
        }
    }

    /// The class index whose buffers hold `len` bytes, if `len` is poolable.
    fn class_for_len(len: usize) -> Option<usize> {
        if len > POOL_CLASS_MAX_BYTES {
            return None;
        }
        let size = len.max(POOL_CLASS_MIN_BYTES).next_power_of_two();
        Some((size.trailing_zeros() - POOL_CLASS_MIN_BYTES.trailing_zeros()) as usize)
    }

    fn class_size(class: usize) -> usize {
        POOL_CLASS_MIN_BYTES << class
    }

    /// A buffer with `len() == len` and capacity `len` rounded up to its
    /// size class. Its contents are whatever the previous user left.
    pub fn get(&mut self, len: usize) -> IoBuf {
        if let Some(buf) = crate::arena::thread_arena_get(len) {
            self.stats.arena_gets += 1;
            return buf;
        }
        self.get_unregistered(len)
    }

    /// [`BufPool::get`] without the thread's fixed arena: a buffer from
    /// this pool's classes (a list pop, no atomics) or the allocator,
    /// for I/O that gains nothing from a buffer registered with io_uring
    /// (a memory volume's read, which is usually lent rather than copied
    /// into it).
    pub fn get_unregistered(&mut self, len: usize) -> IoBuf {
        let mut buf = match Self::class_for_len(len) {
            Some(class) => match self.classes[class].pop() {
                Some(buf) => {
                    self.stats.reuses += 1;
                    self.stats.cached_bytes -= buf.capacity();
                    self.stats.cached_bufs -= 1;
                    buf
                }
                None => {
                    self.stats.allocations += 1;
                    IoBuf::with_capacity(Self::class_size(class))
                }
            },
            None => {
                self.stats.allocations += 1;
                IoBuf::with_capacity(len)
            }
        };
        buf.set_len(len);
        buf
    }

    /// Returns a buffer to the pool (or frees it when a cap is reached).
    /// Buffers of any origin are accepted: one lands in the largest class it
    /// can serve.
    pub fn put(&mut self, buf: IoBuf) {
        if buf.is_fixed() {
            drop(buf); // home to its arena
            return;
        }
        let cap = buf.capacity();
        let class = if cap > POOL_CLASS_MAX_BYTES {
            None
        } else {
            // Largest power of two <= cap, so the buffer serves every get of
            // that class.
            let floor = 1usize << (usize::BITS - 1 - cap.leading_zeros());
            Self::class_for_len(floor)
        };
        let fits = match class {
            Some(class) => {
                self.classes[class].len() < POOL_BUFS_PER_CLASS_MAX
                    && self.stats.cached_bytes + cap <= self.max_cached_bytes
            }
            None => false,
        };
        match class {
            Some(class) if fits => {
                self.stats.cached_bytes += cap;
                self.stats.cached_bufs += 1;
                self.classes[class].push(buf);
            }
            _ => {
                self.stats.frees += 1;
                drop(buf);
            }
        }
    }

    /// Allocates `count` buffers able to hold `len` bytes and caches them
    /// (within the caps), so that later `get`s allocate nothing. Returns how
    /// many were cached.
    pub fn prefill(&mut self, len: usize, count: usize) -> usize {
        let before = self.stats.cached_bufs;
        for _ in 0..count {
            let buf = IoBuf::with_capacity(Self::class_for_len(len).map_or(len, Self::class_size));
            self.stats.allocations += 1;
            self.put(buf);
        }
        self.stats.cached_bufs - before
    }

    /// Allocation counters.
    pub fn stats(&self) -> BufPoolStats {
        self.stats
    }

    /// Checks the counters against the cached buffers (debug builds and
    /// tests).
    pub fn check_invariants(&self) {
        let mut bytes = 0;
        let mut bufs = 0;
        for (class, list) in self.classes.iter().enumerate() {
            assert!(list.len() <= POOL_BUFS_PER_CLASS_MAX);
            for buf in list {
                assert!(!buf.is_fixed(), "arena buffers are never cached");
                assert!(buf.capacity() >= Self::class_size(class));
                assert_eq!(buf.as_ptr() as usize % IO_BUF_ALIGN_BYTES, 0);
                bytes += buf.capacity();
                bufs += 1;
            }
        }
        assert_eq!(bytes, self.stats.cached_bytes);
        assert_eq!(bufs, self.stats.cached_bufs);
        assert!(bytes <= self.max_cached_bytes);
    }
}

impl fmt::Debug for BufPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufPool")
            .field("max_cached_bytes", &self.max_cached_bytes)
            .field("stats", &self.stats)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn iobuf_is_aligned_zeroed_and_rounded() {
        let mut buf = IoBuf::with_capacity(5000);
        assert_eq!(buf.capacity(), 8192);
        assert_eq!(buf.len(), 0);
        assert_eq!(buf.as_ptr() as usize % 4096, 0);
        buf.set_len(8192);
        assert!(buf.as_slice().iter().all(|&b| b == 0));
        buf.as_mut_slice()[8191] = 7;
        buf.set_len(10);
        buf.set_len(8192);
        assert_eq!(buf.as_slice()[8191], 7);
        assert_eq!(IoBuf::with_capacity(0).capacity(), 4096);
    }

    #[test]
    fn pool_reuses_and_respects_caps() {
        let mut pool = BufPool::new(3 * 4096);
        let a = pool.get(100);
        assert_eq!((a.len(), a.capacity()), (100, 4096));
        let b = pool.get(4096);
        let c = pool.get(4097);
        assert_eq!(c.capacity(), 8192);
        pool.put(a);
        pool.put(b);
        pool.put(c); // 4096 + 4096 + 8192 > cap: freed
        assert_eq!(pool.stats().frees, 1);
        assert_eq!(pool.stats().cached_bytes, 8192);
        pool.check_invariants();
        let _ = pool.get(1);
        let _ = pool.get(1);
        assert_eq!(pool.stats().allocations, 3);
        assert_eq!(pool.stats().reuses, 2);
        pool.check_invariants();
    }

    #[test]
    fn pool_steady_state_allocates_nothing() {
        let mut pool = BufPool::new(64 << 20);
        assert_eq!(pool.prefill(128 << 10, 8), 8);
        let before = pool.stats().allocations;
        for _ in 0..1000 {
            let bufs: Vec<IoBuf> = (0..8).map(|_| pool.get(128 << 10)).collect();
            bufs.into_iter().for_each(|b| pool.put(b));
        }
        assert_eq!(pool.stats().allocations, before);
    }

    #[test]
    fn oversized_buffers_are_not_cached() {
        let mut pool = BufPool::new(usize::MAX);
        let big = pool.get(POOL_CLASS_MAX_BYTES + 1);
        assert!(big.capacity() > POOL_CLASS_MAX_BYTES);
        pool.put(big);
        assert_eq!(pool.stats().cached_bufs, 0);
        let odd = IoBuf::with_capacity(12288);
        pool.put(odd); // lands in the 8 KiB class
        assert_eq!(pool.get(8192).capacity(), 12288);
        pool.check_invariants();
    }

    proptest! {
        #[test]
        fn pool_invariants_hold(ops in proptest::collection::vec((any::<bool>(), 0usize..300_000), 1..200)) {
            let mut pool = BufPool::new(1 << 20);
            let mut out = Vec::new();
            for (get, len) in ops {
                if get || out.is_empty() {
                    let buf = pool.get(len);
                    prop_assert_eq!(buf.len(), len);
                    prop_assert!(buf.capacity() >= len);
                    out.push(buf);
                } else {
                    pool.put(out.swap_remove(len % out.len()));
                }
                pool.check_invariants();
            }
        }
    }
}
