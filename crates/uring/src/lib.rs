//! lull-uring: the one crate that touches io_uring and raw buffers.
//!
//! - [`IoBuf`] / [`BufPool`]: page-aligned buffers and a per-thread pool so
//!   the I/O path allocates nothing in steady state.
//! - [`FixedArena`]: a reactor's prefaulted (and where allowed locked)
//!   buffers, registered with io_uring so I/O uses READ_FIXED/WRITE_FIXED.
//! - [`Ring`]: one io_uring plus a completion eventfd; pushing is `unsafe`.
//! - [`IoQueue`]: the safe layer: a slot table owning each operation's
//!   buffer until its completion arrives.
//! - [`Lent`]: bytes a device lends to a reply (a memory volume's read),
//!   sent from the device's memory instead of a copy.
//! - [`prefetch`]: start loading bytes into the CPU's caches before a
//!   copy needs them (a memory volume's reads).
//! - [`probe`]: kernel feature probes (O_DIRECT alignment).
//! - [`splice`]: `sendfile` and pipes that move payload pages between
//!   descriptors without a user-space copy; [`pipes`]: the process's pool
//!   of such pipes.
//!
//! ```no_run
//! use lull_uring::{BufPool, IoQueue, QueueOp};
//! use std::os::fd::AsFd;
//! let file = std::fs::OpenOptions::new().read(true).write(true).open("/tmp/x")?;
//! let mut pool = BufPool::new(64 << 20);
//! let mut q: IoQueue<u64> = IoQueue::new(256, &[file.as_fd()])?;
//! let slot = q.alloc(42, Some(pool.get(4096))).expect("free slot");
//! q.push(slot, &[(0, QueueOp::Write { file: 0, buf_offset: 0, len: 4096, file_offset: 0 })])?;
//! q.submit()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// The one crate that touches io_uring unsafely (docs/STYLE.md habit 8): the
// workspace denies unsafe code, this crate allows it; every block has a
// SAFETY comment.
#![allow(unsafe_code)]

mod arena;
mod buf;
mod lent;
pub mod pipes;
mod prefetch;
pub mod probe;
mod queue;
mod ring;
pub mod splice;

pub use arena::{
    init_thread_arena, install_thread_arena, memlock_limit_bytes, set_reactor_arena_bytes,
    thread_arena, thread_arena_stats, thread_arenas, ArenaStats, FixedArena, ARENA_BYTES_DEFAULT,
    ARENA_BYTES_MAX, ARENA_CLASS_MAX_BYTES, ARENA_CLASS_MIN_BYTES, ARENA_SET_BYTES,
    RING_ARENAS_MAX,
};
pub use buf::{
    BufPool, BufPoolStats, IoBuf, IO_BUF_ALIGN_BYTES, POOL_BUFS_PER_CLASS_MAX,
    POOL_CLASS_MAX_BYTES, POOL_CLASS_MIN_BYTES,
};
pub use lent::{Lent, LentRegion};
pub use prefetch::{prefetch, CACHE_LINE_BYTES};
pub use probe::{fadvise_willneed, fallocate, on_memory_filesystem, range_cached, seek_data_hole};
pub use queue::{IoQueue, PushError, QueueCompletion, QueueOp, SlotId};
pub use ring::{
    thread_enter_calls, wait_readable, Ring, RingError, RingOp, RingSetup, SqFull, Target,
    CHAIN_OPS_MAX,
};

#[cfg(test)]
mod tests;
