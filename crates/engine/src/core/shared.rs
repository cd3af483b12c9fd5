//! Write payloads shared by every replica a write goes to: one buffer, not
//! a copy per replica, and no heap allocation per write.
//!
//! ```ignore
//! let mut shares = SharedBufs::default();
//! let shared = shares.share(client_buf);        // at dispatch
//! let to_a = Payload::Data { buf: shared.clone(), len };
//! let to_b = Payload::Data { buf: shared.clone(), len };
//! // ... both frames written, both replicas answered ...
//! let client_buf = shares.unshare(shared).expect("no frame holds it");
//! ```
//!
//! A fresh `Arc` per write would be one allocation per request. These
//! `Arc`s are kept instead: the client's buffer moves into one at dispatch
//! and out of it at completion, and the emptied `Arc` waits for the next
//! write.

use std::sync::Arc;

use lull_bdev::IoBuf;

use super::MAX_CLIENT_IOS;

/// Empty `Arc`s kept for later writes: as many as writes the engine can
/// hold at once, so a steady load never allocates, and the cache never
/// holds more than the deepest load it has seen (about 40 bytes each:
/// 640 KiB at most).
const SHARES_CACHED_MAX: usize = MAX_CLIENT_IOS;

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

/// The engine's cache of empty [`SharedBuf`]s.
#[derive(Debug, Default)]
pub struct SharedBufs {
    free: Vec<Arc<Option<IoBuf>>>,
}

impl SharedBufs {
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
        if self.free.len() < SHARES_CACHED_MAX {
            self.free.push(arc);
        }
        Ok(buf)
    }

    /// `Arc`s cached.
    #[cfg(test)]
    pub fn cached(&self) -> usize {
        self.free.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_buffer_comes_back_and_its_arc_is_reused() {
        let mut shares = SharedBufs::default();
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
}
