//! Buffers shared by the connections of one reactor: I/O buffers (request
//! payloads) and input buffers (the bytes read from a socket and not yet
//! parsed). A connection holds them only while it has work; an idle
//! connection holds none, so its memory is its bookkeeping (a few KiB) no
//! matter how busy it once was.
//!
//! ```
//! let buf = lull_net::bufs::get(4096);
//! assert_eq!(buf.len(), 4096);
//! lull_net::bufs::put(buf); // cached for the next connection on this thread
//! ```
//!
//! The caches are per OS thread (a reactor runs all its connections on one),
//! so taking and returning is a list push or pop with no lock. A buffer
//! returned on another thread (a completion that crossed reactors) joins
//! that thread's cache.

use std::cell::RefCell;

use lull_uring::{BufPool, IoBuf};

/// I/O buffer bytes cached per reactor thread: a full queue (128) of
/// 128 KiB requests on two connections. Past it returned buffers are
/// freed. Resident memory per reactor is bounded by this, not by the
/// number of connections.
pub const THREAD_IO_CACHE_BYTES: usize = 32 << 20;

/// Input buffers cached per reactor thread: one per connection with
/// bytes read and unparsed at the same moment, which on one thread is rare
/// beyond a handful (a buffer goes back as soon as its connection has
/// parsed everything it read).
pub const THREAD_INBUF_CACHE: usize = 16;

thread_local! {
    static IO: RefCell<BufPool> = RefCell::new(BufPool::new(THREAD_IO_CACHE_BYTES));
    static INBUFS: RefCell<Vec<Box<[u8]>>> = const { RefCell::new(Vec::new()) };
}

/// An I/O buffer of `len` bytes (contents unspecified), from this thread's
/// cache when one fits.
pub fn get(len: usize) -> IoBuf {
    IO.with_borrow_mut(|p| p.get(len))
}

/// [`get`] bypassing the reactor's fixed arena
/// ([`BufPool::get_unregistered`]): for a read a memory volume will
/// likely lend (`lull_bdev::Channel::lends`).
pub fn get_unregistered(len: usize) -> IoBuf {
    IO.with_borrow_mut(|p| p.get_unregistered(len))
}

/// Give an I/O buffer back to this thread's cache.
pub fn put(buf: IoBuf) {
    IO.with_borrow_mut(|p| p.put(buf));
}

/// Run `f` with this thread's I/O buffer cache (to hand it to a writer that
/// returns many buffers).
pub fn with_pool<R>(f: impl FnOnce(&mut BufPool) -> R) -> R {
    IO.with_borrow_mut(f)
}

/// An input buffer of `len` bytes (contents unspecified).
pub(crate) fn take_inbuf(len: usize) -> Box<[u8]> {
    let cached = INBUFS.with_borrow_mut(|c| {
        let i = c.iter().position(|b| b.len() == len)?;
        Some(c.swap_remove(i))
    });
    cached.unwrap_or_else(|| vec![0u8; len].into_boxed_slice())
}

pub(crate) fn give_inbuf(buf: Box<[u8]>) {
    INBUFS.with_borrow_mut(|c| {
        if c.len() < THREAD_INBUF_CACHE {
            c.push(buf);
        }
    });
}
