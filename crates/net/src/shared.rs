//! Buffers shared by several frames at once, with no copy per frame and no
//! heap allocation per share: a replicated write's payload, read by its
//! frame to every replica (the engine), and a structured read reply's data
//! chunks, each a slice of the one buffer the device read into (the
//! servers' [`crate::Payload::Slice`]).
//!
//! ```
//! use lull_net::shared::SharedBufs;
//! use lull_uring::IoBuf;
//! let mut shares = SharedBufs::new(16);
//! let mut buf = IoBuf::with_capacity(4096);
//! buf.set_len(4096);
//! let shared = shares.share(buf);                // at dispatch
//! let (to_a, to_b) = (shared.clone(), shared.clone());
//! drop((to_a, to_b));                             // both frames written
//! let buf = shares.unshare(shared).expect("no frame holds it");
//! assert_eq!((buf.len(), shares.cached()), (4096, 1));
//! ```
//!
//! A fresh `Arc` per share would be one allocation per request. These
//! `Arc`s are kept instead: a buffer moves into one when shared and out of
//! it when the last holder is done, and the emptied `Arc` waits for the
//! next share.

use std::cell::RefCell;
use std::sync::Arc;

use lull_uring::{BufPool, IoBuf};

/// Empty `Arc`s each thread keeps for the servers' shared replies
/// ([`share`], [`release`]): structured read replies with holes in flight
/// at once on one reactor. About 40 bytes each; past it a share allocates.
pub const THREAD_SHARES_CACHED: usize = 1024;

thread_local! {
    static SHARES: RefCell<SharedBufs> = RefCell::new(SharedBufs::new(THREAD_SHARES_CACHED));
}

/// Share `buf` in one of this thread's cached `Arc`s.
pub fn share(buf: IoBuf) -> SharedBuf {
    SHARES.with_borrow_mut(|s| s.share(buf))
}

/// One holder of a shared buffer is done with it: the last one gives the
/// buffer to `pool` and the `Arc` to this thread's cache.
pub fn release(shared: SharedBuf, pool: &mut BufPool) {
    SHARES.with_borrow_mut(|s| {
        if let Ok(buf) = s.unshare(shared) {
            pool.put(buf);
        }
    })
}

/// A buffer read by several frames at once (clones are cheap). `None` only
/// while it waits in [`SharedBufs`] for its next write.
#[derive(Debug, Clone)]
pub struct SharedBuf(Arc<Option<IoBuf>>);

impl SharedBuf {
    /// A shared buffer of its own (off the hot path: a rebuild's chunk).
    pub fn new(buf: IoBuf) -> SharedBuf {
        SharedBuf(Arc::new(Some(buf)))
    }

    pub fn as_slice(&self) -> &[u8] {
        self.0.as_ref().as_ref().map_or(&[], IoBuf::as_slice)
    }

    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    pub fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }
}

/// A cache of empty `Arc`s for [`SharedBuf`]s.
#[derive(Debug)]
pub struct SharedBufs {
    free: Vec<Arc<Option<IoBuf>>>,
    /// `Arc`s kept at most; more are freed.
    max_cached: usize,
}

impl SharedBufs {
    /// A cache keeping at most `max_cached` `Arc`s (each about 40 bytes):
    /// as many as buffers shared at once under the load that should not
    /// allocate.
    pub fn new(max_cached: usize) -> SharedBufs {
        SharedBufs {
            free: Vec::new(),
            max_cached,
        }
    }

    /// Share `buf`, in a cached `Arc` when there is one.
    pub fn share(&mut self, buf: IoBuf) -> SharedBuf {
        let mut arc = self.free.pop().unwrap_or_default();
        match Arc::get_mut(&mut arc) {
            Some(slot) => {
                *slot = Some(buf);
                SharedBuf(arc)
            }
            // Cannot happen: only unshared `Arc`s are cached.
            None => SharedBuf::new(buf),
        }
    }

    /// Take the buffer back once no frame holds it any more, and keep the
    /// `Arc`; while a frame still holds it, `Err` gives it back.
    pub fn unshare(&mut self, shared: SharedBuf) -> Result<IoBuf, SharedBuf> {
        let mut arc = shared.0;
        let Some(buf) = Arc::get_mut(&mut arc).and_then(Option::take) else {
            return Err(SharedBuf(arc));
        };
        if self.free.len() < self.max_cached {
            self.free.push(arc);
        }
        Ok(buf)
    }

    /// `Arc`s cached.
    pub fn cached(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_buffer_comes_back_and_its_arc_is_reused() {
        let mut shares = SharedBufs::new(4);
        let mut buf = IoBuf::with_capacity(4096);
        buf.set_len(4096);
        buf.as_mut_slice()[0] = 7;
        let shared = shares.share(buf);
        let frame = shared.clone();
        assert_eq!(frame.as_slice()[0], 7);
        // A frame still holds it: not taken, given back.
        let shared = shares.unshare(shared).expect_err("still shared");
        drop(frame);
        let buf = shares.unshare(shared).expect("unshared");
        assert_eq!(buf.as_slice()[0], 7);
        assert_eq!(shares.cached(), 1);
        let again = shares.share(buf);
        assert_eq!(shares.cached(), 0);
        assert_eq!(again.len(), 4096);
    }

    #[test]
    fn slices_of_one_buffer_are_sent_and_the_last_returns_it() {
        use crate::{OutQueue, Payload};
        let mut pool = BufPool::new(1 << 20);
        let mut buf = pool.get(8192);
        buf.as_mut_slice()[..4096].fill(1);
        buf.as_mut_slice()[4096..].fill(2);
        let shared = share(buf);
        let mut out: OutQueue<Payload> = OutQueue::default();
        out.push(
            b"a",
            Payload::Slice {
                buf: shared.clone(),
                at: 4096,
                len: 4096,
            },
        );
        out.push(
            b"b",
            Payload::Slice {
                buf: shared,
                at: 0,
                len: 100,
            },
        );
        let mut wire = Vec::new();
        out.write_pooled(&mut wire, None, &mut pool).unwrap();
        assert_eq!(wire.len(), 1 + 4096 + 1 + 100);
        assert!(wire[1..4097].iter().all(|&b| b == 2));
        assert!(wire[4098..].iter().all(|&b| b == 1));
        // Back in the pool once, after the last slice went.
        assert_eq!(pool.get(8192).as_slice()[4096], 2);
        assert_eq!(pool.stats().allocations, 1);
    }
}
