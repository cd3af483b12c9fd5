//! `FixedArena`: one reactor's I/O buffers in one mapping made at start:
//! prefaulted (`MAP_POPULATE`), locked in memory where the limits allow
//! (`mlock`), and registered with every file channel's io_uring as a fixed
//! buffer, so an I/O neither takes a page fault nor makes the kernel pin
//! and unpin its pages (`IORING_OP_READ_FIXED` / `WRITE_FIXED`).
//!
//! ```
//! use lull_uring::FixedArena;
//! let arena = FixedArena::new(1 << 20).expect("mmap");
//! let buf = arena.get(5000).expect("a free 8 KiB buffer");
//! assert_eq!((buf.len(), buf.capacity()), (5000, 8192));
//! assert!(buf.is_fixed());
//! assert_eq!(arena.stats().in_use_bytes, 8192);
//! drop(buf); // back to the arena's free list, from any thread
//! assert_eq!(arena.stats().in_use_bytes, 0);
//! ```
//!
//! The mapping is cut into size classes of 4 KiB to 128 KiB, each with the
//! same number of buffers and a lock-free free list (`ArrayQueue`, sized
//! at creation), so taking and returning a buffer allocates nothing and a
//! buffer can go back from whichever thread drops it. [`crate::BufPool`]
//! takes from the calling thread's arena first (one per reactor, created
//! by [`init_thread_arena`] on the reactor thread) and falls back to the
//! heap when the arena has no free buffer big enough.

use std::cell::OnceCell;
use std::io;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crossbeam_queue::ArrayQueue;

use crate::buf::IoBuf;

/// Smallest arena buffer: one page (O_DIRECT's alignment and the smallest
/// NBD request lull sees in practice).
pub const ARENA_CLASS_MIN_BYTES: usize = 4096;
/// Largest arena buffer: 128 KiB, the request size of sequential
/// workloads (kbench's 128 KiB jobs) and of the kernel's default
/// readahead (`read_ahead_kb` = 128), the unit of buffered sequential
/// reads through a kernel NBD device. Larger requests (clients may send
/// up to 64 MiB) take heap buffers and plain READ/WRITE: a class of 1 MiB
/// buffers would cost 8 times the memory of the 128 KiB one.
pub const ARENA_CLASS_MAX_BYTES: usize = 128 << 10;
const ARENA_CLASSES: usize =
    (ARENA_CLASS_MAX_BYTES.trailing_zeros() - ARENA_CLASS_MIN_BYTES.trailing_zeros()) as usize + 1;
/// One buffer of every class (4 + 8 + ... + 128 KiB = 252 KiB): every
/// class gets the same number of buffers, `arena bytes / ARENA_SET_BYTES`,
/// so a queue of requests of any one size fits.
pub const ARENA_SET_BYTES: usize = 2 * ARENA_CLASS_MAX_BYTES - ARENA_CLASS_MIN_BYTES;

/// Arena bytes per reactor by default: 16 MiB, 65 buffers of each class,
/// so a queue depth of 64 in any one size up to 128 KiB (kbench's QD64
/// jobs) runs from fixed buffers on a reactor. It is pinned memory: more
/// costs RAM for every reactor whether or not its volumes are busy.
pub const ARENA_BYTES_DEFAULT: usize = 16 << 20;
/// Largest arena: io_uring registers one arena as one buffer (an iovec),
/// and the kernel refuses a registered buffer above 1 GiB.
pub const ARENA_BYTES_MAX: usize = 1 << 30;
/// Arenas a ring registers at most (one per reactor): a buffer is matched
/// to its registered region by a linear scan per I/O, which must stay a
/// few compares. Buffers of arenas past it use plain READ/WRITE.
pub const RING_ARENAS_MAX: usize = 64;

/// An arena's state, for reactor stats.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes mapped (and prefaulted).
    pub bytes: usize,
    /// Whether `mlock` succeeded (false: prefaulted but may be swapped).
    pub locked: bool,
    /// Bytes in buffers handed out and not yet returned.
    pub in_use_bytes: usize,
    /// Buffers of each class.
    pub bufs_per_class: usize,
}

/// One mapping of prefaulted, page-aligned buffers in size classes, with
/// lock-free free lists. Shared (`Arc`) by the thread that takes from it,
/// the buffers it lent out and the rings it is registered with; unmapped
/// when the last of them goes.
pub struct FixedArena {
    base: NonNull<u8>,
    len_bytes: usize,
    bufs_per_class: usize,
    /// Offset of each class's first buffer from `base`.
    class_offset: [usize; ARENA_CLASSES],
    /// Free buffer indexes of each class (capacity `bufs_per_class`, so a
    /// return never fails). FIFO: ...
    free: [ArrayQueue<u32>; ARENA_CLASSES],
    /// ... so each class also keeps its most recently returned index here
    /// (`NO_BUF` when empty) and hands it out first: at low queue depth
    /// the same buffer, warm in the CPU cache, serves request after
    /// request instead of a walk through the whole class.
    hot: [AtomicU32; ARENA_CLASSES],
    locked: bool,
}

// The arena owns its mapping; the bytes of a buffer are reached only
// through the `IoBuf` that popped its index (unique until it is pushed back).
// SAFETY: as just said, and the free lists are thread-safe queues.
unsafe impl Send for FixedArena {}
// SAFETY: as above; `&FixedArena` only pops and pushes indexes.
unsafe impl Sync for FixedArena {}

/// `FixedArena::hot` holding no index.
const NO_BUF: u32 = u32::MAX;

fn class_size(class: usize) -> usize {
    ARENA_CLASS_MIN_BYTES << class
}

fn class_for_len(len: usize) -> usize {
    let size = len.max(ARENA_CLASS_MIN_BYTES).next_power_of_two();
    (size.trailing_zeros() - ARENA_CLASS_MIN_BYTES.trailing_zeros()) as usize
}

/// One warning per process when `mlock` is refused (every reactor would
/// say the same).
static MLOCK_WARNED: AtomicBool = AtomicBool::new(false);

impl FixedArena {
    /// Maps `bytes` (rounded down to whole sets of buffers; at least
    /// `ARENA_SET_BYTES`, at most `ARENA_BYTES_MAX`) with `MAP_POPULATE`
    /// and tries to `mlock` it; a refused `mlock` is logged (once per
    /// process) and leaves the arena prefaulted but unlocked.
    pub fn new(bytes: usize) -> io::Result<Arc<FixedArena>> {
        if !(ARENA_SET_BYTES..=ARENA_BYTES_MAX).contains(&bytes) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "fixed buffer arena of {bytes} bytes: expected {ARENA_SET_BYTES} to {ARENA_BYTES_MAX}"
                ),
            ));
        }
        let bufs_per_class = bytes / ARENA_SET_BYTES;
        let len_bytes = bufs_per_class * ARENA_SET_BYTES;
        // SAFETY: an anonymous private mapping at an address the kernel
        // picks; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len_bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let Some(base) = NonNull::new(raw.cast::<u8>()) else {
            return Err(io::Error::other("mmap returned NULL"));
        };
        // A child process (a spawned tool) must not copy pinned I/O pages.
        // Advice only: failure changes nothing for this process.
        // SAFETY: the range is the mapping just made.
        let _ = unsafe { libc::madvise(raw, len_bytes, libc::MADV_DONTFORK) };
        // SAFETY: the range is the mapping just made.
        let locked = unsafe { libc::mlock(raw, len_bytes) } == 0;
        if !locked {
            let error = io::Error::last_os_error();
            if !MLOCK_WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(bytes = len_bytes, memlock_limit_bytes = ?memlock_limit_bytes(), %error,
                    "cannot mlock the fixed I/O buffers (RLIMIT_MEMLOCK too low and no CAP_IPC_LOCK); they stay prefaulted but unlocked (may be swapped out)");
            }
        }
        let mut class_offset = [0; ARENA_CLASSES];
        let mut offset = 0;
        for (class, start) in class_offset.iter_mut().enumerate() {
            *start = offset;
            offset += bufs_per_class * class_size(class);
        }
        debug_assert_eq!(offset, len_bytes);
        let free = std::array::from_fn(|_| {
            let q = ArrayQueue::new(bufs_per_class);
            for i in 0..bufs_per_class as u32 {
                let _ = q.push(i);
            }
            q
        });
        Ok(Arc::new(FixedArena {
            base,
            len_bytes,
            bufs_per_class,
            class_offset,
            free,
            hot: std::array::from_fn(|_| AtomicU32::new(NO_BUF)),
            locked,
        }))
    }

    /// A buffer of `len` bytes (capacity its class, or the next class with
    /// a free buffer), or `None` when `len` is above
    /// `ARENA_CLASS_MAX_BYTES` or no class big enough has one free.
    pub fn get(self: &Arc<Self>, len: usize) -> Option<IoBuf> {
        if len > ARENA_CLASS_MAX_BYTES {
            return None;
        }
        for class in class_for_len(len)..ARENA_CLASSES {
            let hot = self.hot[class].swap(NO_BUF, Ordering::Acquire);
            let index = if hot != NO_BUF {
                Some(hot)
            } else {
                self.free[class].pop()
            };
            if let Some(index) = index {
                let offset = self.class_offset[class] + index as usize * class_size(class);
                // SAFETY: `offset` is inside the mapping (index < bufs_per_class).
                let ptr = unsafe { NonNull::new_unchecked(self.base.as_ptr().add(offset)) };
                // The index was popped from the free list; this buffer's drop
                // pushes it back.
                // SAFETY: so no other `IoBuf` covers these bytes meanwhile.
                let mut buf = unsafe { IoBuf::from_arena(ptr, class_size(class), self.clone()) };
                buf.set_len(len);
                return Some(buf);
            }
        }
        None
    }

    /// Returns a buffer's bytes to the free list (`IoBuf`'s drop).
    pub(crate) fn give_back(&self, ptr: NonNull<u8>, capacity: usize) {
        let class = class_for_len(capacity);
        let offset = ptr.as_ptr() as usize - self.base.as_ptr() as usize;
        let index = (offset - self.class_offset[class]) / capacity;
        debug_assert!(class_size(class) == capacity && index < self.bufs_per_class);
        let older = self.hot[class].swap(index as u32, Ordering::AcqRel);
        if older != NO_BUF && self.free[class].push(older).is_err() {
            // Cannot happen: each index is out at most once.
            debug_assert!(false, "fixed arena free list overflow");
        }
    }

    /// Start and length of the mapping (what a ring registers).
    pub fn region(&self) -> (*mut u8, usize) {
        (self.base.as_ptr(), self.len_bytes)
    }

    /// Whether `[ptr, ptr + len)` lies inside the mapping.
    pub fn contains(&self, ptr: *const u8, len: usize) -> bool {
        let start = self.base.as_ptr() as usize;
        let p = ptr as usize;
        p >= start
            && p.checked_add(len)
                .is_some_and(|end| end <= start + self.len_bytes)
    }

    /// Size, lock state and use.
    pub fn stats(&self) -> ArenaStats {
        let in_use_bytes = (0..ARENA_CLASSES)
            .map(|c| {
                let hot = usize::from(self.hot[c].load(Ordering::Relaxed) != NO_BUF);
                self.bufs_per_class.saturating_sub(self.free[c].len() + hot) * class_size(c)
            })
            .sum();
        ArenaStats {
            bytes: self.len_bytes,
            locked: self.locked,
            in_use_bytes,
            bufs_per_class: self.bufs_per_class,
        }
    }

    /// Checks the free lists (tests).
    pub fn check_invariants(&self) {
        for (class, q) in self.free.iter().enumerate() {
            let hot = usize::from(self.hot[class].load(Ordering::Relaxed) != NO_BUF);
            assert!(
                q.len() + hot <= self.bufs_per_class,
                "class {class} over-full"
            );
        }
    }
}

impl Drop for FixedArena {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; no buffer or ring holds the
        // arena any more (each keeps an `Arc`), so nothing uses it.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len_bytes) };
    }
}

impl std::fmt::Debug for FixedArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FixedArena")
            .field("base", &self.base)
            .field("stats", &self.stats())
            .finish()
    }
}

/// `RLIMIT_MEMLOCK`'s soft limit (`None`: unlimited or unknown).
pub fn memlock_limit_bytes() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out-pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    (rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

thread_local! {
    /// This OS thread's arena (reactor threads; set once).
    static THREAD_ARENA: OnceCell<Arc<FixedArena>> = const { OnceCell::new() };
}

/// Bytes of the arena [`init_thread_arena`] makes (0: none).
static REACTOR_ARENA_BYTES: AtomicUsize = AtomicUsize::new(ARENA_BYTES_DEFAULT);

/// Every installed thread arena that is still alive, for rings to
/// register. Short (one per reactor); touched when a thread starts and
/// when a channel opens, never per I/O.
static ARENAS: Mutex<Vec<Weak<FixedArena>>> = Mutex::new(Vec::new());

/// Sets the size of the arenas [`init_thread_arena`] creates (0: none,
/// buffers come from the heap). Call before the reactors start.
pub fn set_reactor_arena_bytes(bytes: usize) {
    REACTOR_ARENA_BYTES.store(bytes, Ordering::Relaxed);
}

/// Creates the calling thread's arena of the configured size (once; a
/// later call returns the existing one). A reactor thread calls it at
/// start, after pinning, so the pages come from its core's memory node.
/// `None` when arenas are off or the mapping failed (logged; the thread
/// then uses heap buffers).
pub fn init_thread_arena() -> Option<Arc<FixedArena>> {
    if let Some(existing) = thread_arena() {
        return Some(existing);
    }
    let bytes = REACTOR_ARENA_BYTES.load(Ordering::Relaxed);
    if bytes == 0 {
        return None;
    }
    match FixedArena::new(bytes) {
        Ok(arena) => {
            let s = arena.stats();
            tracing::debug!(
                bytes = s.bytes,
                locked = s.locked,
                bufs_per_class = s.bufs_per_class,
                "fixed I/O buffer arena ready"
            );
            install_thread_arena(arena.clone());
            Some(arena)
        }
        Err(error) => {
            tracing::warn!(bytes, %error, "cannot map the fixed I/O buffer arena; this reactor uses heap buffers");
            None
        }
    }
}

/// Makes `arena` the calling thread's arena and lists it for rings to
/// register. `false` (and nothing changes) if the thread has one already.
pub fn install_thread_arena(arena: Arc<FixedArena>) -> bool {
    let weak = Arc::downgrade(&arena);
    if !THREAD_ARENA.with(|cell| cell.set(arena).is_ok()) {
        return false;
    }
    let mut all = ARENAS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    all.retain(|w| w.strong_count() > 0);
    all.push(weak);
    true
}

/// The calling thread's arena, if it has one.
pub fn thread_arena() -> Option<Arc<FixedArena>> {
    THREAD_ARENA.with(|cell| cell.get().cloned())
}

/// The calling thread's arena's stats (a reactor publishes them).
pub fn thread_arena_stats() -> Option<ArenaStats> {
    THREAD_ARENA.with(|cell| cell.get().map(|a| a.stats()))
}

/// A buffer from the calling thread's arena (`BufPool::get`).
pub(crate) fn thread_arena_get(len: usize) -> Option<IoBuf> {
    if len > ARENA_CLASS_MAX_BYTES {
        return None;
    }
    THREAD_ARENA.with(|cell| cell.get()?.get(len))
}

/// Every live thread arena (at most `RING_ARENAS_MAX`, oldest first): what
/// a file channel's ring registers, so buffers from any reactor's arena
/// (a poll group the scheduler moved keeps getting buffers from its new
/// reactor) go through READ_FIXED/WRITE_FIXED.
pub fn thread_arenas() -> Vec<Arc<FixedArena>> {
    let all = ARENAS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    all.iter()
        .filter_map(Weak::upgrade)
        .take(RING_ARENAS_MAX)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: usize = 4 * ARENA_SET_BYTES; // 4 buffers per class

    #[test]
    fn get_put_and_classes() {
        let arena = FixedArena::new(SMALL).expect("arena");
        let s = arena.stats();
        assert_eq!((s.bytes, s.bufs_per_class, s.in_use_bytes), (SMALL, 4, 0));
        let a = arena.get(1).expect("4K");
        let b = arena.get(ARENA_CLASS_MAX_BYTES).expect("128K");
        assert_eq!((a.len(), a.capacity()), (1, 4096));
        assert_eq!(b.capacity(), ARENA_CLASS_MAX_BYTES);
        assert_eq!(a.as_ptr() as usize % 4096, 0);
        assert!(arena.contains(b.as_ptr(), b.capacity()));
        assert!(arena.get(ARENA_CLASS_MAX_BYTES + 1).is_none());
        assert_eq!(arena.stats().in_use_bytes, 4096 + (128 << 10));
        drop(a);
        drop(b);
        assert_eq!(arena.stats().in_use_bytes, 0);
        arena.check_invariants();
    }

    #[test]
    fn a_full_class_borrows_from_a_bigger_one_then_runs_out() {
        let arena = FixedArena::new(SMALL).expect("arena");
        // 4 of each class: 4 KiB gets take 4 KiB, then 8 KiB, ... buffers.
        let bufs: Vec<IoBuf> = (0..4 * ARENA_CLASSES)
            .map(|_| arena.get(4096).expect("some class has room"))
            .collect();
        assert!(arena.get(4096).is_none(), "exhausted");
        assert_eq!(arena.stats().in_use_bytes, SMALL);
        // Buffers never overlap.
        let mut ranges: Vec<(usize, usize)> = bufs
            .iter()
            .map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + b.capacity()))
            .collect();
        ranges.sort();
        assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0));
        drop(bufs);
        assert_eq!(arena.stats().in_use_bytes, 0);
    }

    #[test]
    fn dropped_on_another_thread_goes_home() {
        let arena = FixedArena::new(SMALL).expect("arena");
        let mut buf = arena.get(8192).expect("buf");
        buf.as_mut_slice().fill(0xab);
        std::thread::spawn(move || drop(buf)).join().expect("join");
        assert_eq!(arena.stats().in_use_bytes, 0);
        let again = arena.get(8192).expect("returned buffer reused");
        assert!(again.as_slice().iter().all(|&b| b == 0xab));
    }

    #[test]
    fn the_arena_outlives_its_owner_while_buffers_are_out() {
        let arena = FixedArena::new(SMALL).expect("arena");
        let mut buf = arena.get(4096).expect("buf");
        drop(arena);
        buf.as_mut_slice().fill(1); // still mapped: the buffer holds it
        drop(buf);
    }

    fn thread_minor_faults() -> i64 {
        // SAFETY: all-zero is a valid rusage.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `u` is a valid out-pointer.
        assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) }, 0);
        u.ru_minflt
    }

    #[test]
    fn pages_are_prefaulted() {
        let arena = FixedArena::new(SMALL).expect("arena");
        let (base, len) = arena.region();
        let pages = len / 4096;
        let mut resident = vec![0u8; pages];
        // SAFETY: the range is the arena's mapping; `resident` has one
        // byte per page.
        let rc = unsafe { libc::mincore(base.cast(), len, resident.as_mut_ptr()) };
        assert_eq!(rc, 0);
        assert!(
            resident.iter().all(|&r| r & 1 == 1),
            "every page resident after MAP_POPULATE"
        );
        // Writing every page of every buffer takes no page fault.
        let bufs: Vec<IoBuf> = std::iter::from_fn(|| arena.get(4096)).collect();
        let before = thread_minor_faults();
        let mut bufs = bufs;
        for b in &mut bufs {
            let cap = b.capacity();
            b.set_len(cap);
            for page in b.as_mut_slice().chunks_mut(4096) {
                page[0] = 1;
            }
        }
        let faults = thread_minor_faults() - before;
        // A handful at most (the test's own stack or allocator), not one
        // per page (there are `pages` of them).
        assert!(
            faults < 8,
            "{faults} faults touching {pages} prefaulted pages"
        );
    }

    #[test]
    fn a_refused_mlock_leaves_a_usable_unlocked_arena() {
        // Capabilities are per thread: drop CAP_IPC_LOCK on a fresh thread,
        // then ask for more than RLIMIT_MEMLOCK allows.
        let Some(limit) = memlock_limit_bytes() else {
            eprintln!("SKIP: RLIMIT_MEMLOCK is unlimited here; mlock cannot be refused");
            return;
        };
        std::thread::spawn(move || {
            drop_cap_ipc_lock();
            let bytes = (limit as usize + (1 << 20)).div_ceil(ARENA_SET_BYTES) * ARENA_SET_BYTES;
            let arena = FixedArena::new(bytes.min(ARENA_BYTES_MAX)).expect("mapped anyway");
            let s = arena.stats();
            assert!(!s.locked, "mlock of {} bytes over a {limit} limit", s.bytes);
            let mut buf = arena.get(4096).expect("usable");
            buf.as_mut_slice().fill(3);
        })
        .join()
        .expect("join");
    }

    /// Clears CAP_IPC_LOCK from the calling thread's effective set
    /// (capset, version 3). Harmless when the thread lacks it.
    fn drop_cap_ipc_lock() {
        const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
        const CAP_IPC_LOCK: u32 = 14;
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        #[derive(Clone, Copy, Default)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let mut header = Header {
            version: LINUX_CAPABILITY_VERSION_3,
            pid: 0,
        };
        let mut data = [Data::default(); 2];
        // SAFETY: capget reads the header and fills two Data records.
        let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
        assert_eq!(rc, 0, "capget");
        data[0].effective &= !(1 << CAP_IPC_LOCK);
        // SAFETY: capset reads the header and two Data records; pid 0 is
        // the calling thread.
        let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
        assert_eq!(rc, 0, "capset");
    }

    proptest::proptest! {
        /// Any sequence of gets and drops: buffers never overlap, stay
        /// inside the mapping, and `in_use_bytes` is what is out.
        #[test]
        fn buffers_never_overlap(ops in proptest::collection::vec((proptest::bool::ANY, 0usize..200_000), 1..300)) {
            let arena = FixedArena::new(2 * ARENA_SET_BYTES).expect("arena");
            let mut out: Vec<IoBuf> = Vec::new();
            for (get, n) in ops {
                if get || out.is_empty() {
                    match arena.get(n) {
                        Some(buf) => {
                            proptest::prop_assert!(buf.capacity() >= n && buf.len() == n);
                            proptest::prop_assert!(arena.contains(buf.as_ptr(), buf.capacity()));
                            out.push(buf);
                        }
                        None => proptest::prop_assert!(
                            n > ARENA_CLASS_MAX_BYTES
                                || out.iter().filter(|b| b.capacity() >= n.max(1)).count() > 0
                        ),
                    }
                } else {
                    drop(out.swap_remove(n % out.len()));
                }
                let mut ranges: Vec<(usize, usize)> = out
                    .iter()
                    .map(|b| (b.as_ptr() as usize, b.as_ptr() as usize + b.capacity()))
                    .collect();
                ranges.sort();
                proptest::prop_assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0));
                let out_bytes: usize = out.iter().map(IoBuf::capacity).sum();
                proptest::prop_assert_eq!(arena.stats().in_use_bytes, out_bytes);
                arena.check_invariants();
            }
        }
    }

    #[test]
    fn thread_arena_serves_the_pool_and_falls_back_to_the_heap() {
        std::thread::spawn(|| {
            let arena = FixedArena::new(SMALL).expect("arena");
            assert!(install_thread_arena(arena.clone()));
            assert!(!install_thread_arena(arena.clone()), "once per thread");
            assert!(thread_arenas().iter().any(|a| Arc::ptr_eq(a, &arena)));
            let mut pool = crate::BufPool::new(1 << 20);
            let fixed: Vec<IoBuf> = (0..4 * ARENA_CLASSES).map(|_| pool.get(4096)).collect();
            assert!(fixed.iter().all(IoBuf::is_fixed));
            let heap = pool.get(4096);
            assert!(!heap.is_fixed(), "exhausted arena: heap");
            assert!(!pool.get(ARENA_CLASS_MAX_BYTES + 1).is_fixed());
            assert_eq!(pool.stats().arena_gets, 4 * ARENA_CLASSES as u64);
            // put: fixed buffers go home, heap ones into the cache.
            fixed.into_iter().for_each(|b| pool.put(b));
            pool.put(heap);
            assert_eq!(arena.stats().in_use_bytes, 0);
            assert_eq!(pool.stats().cached_bufs, 1);
            pool.check_invariants();
            assert!(pool.get(4096).is_fixed(), "the arena first again");
        })
        .join()
        .expect("join");
    }
}
