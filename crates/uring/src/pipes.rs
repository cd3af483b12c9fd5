//! The process's pipes for spliced payloads ([`crate::splice::Pipe`]):
//! a replicated read's data goes from the replica's socket into a pipe on
//! the engine thread and from the pipe into the client's socket on the
//! connection's thread, so pipes travel between threads; one shared pool
//! (a lock-free queue) takes them back from any of them.
//!
//! ```
//! if let Some(pipe) = lull_uring::pipes::get() {
//!     assert_eq!(pipe.held(), 0);
//!     lull_uring::pipes::put(pipe);
//! }
//! ```

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::splice::Pipe;
use crossbeam_queue::ArrayQueue;

/// Pipes in the process at most, in use or pooled: each is two
/// descriptors and a 64-slot ring in the kernel (about 2.5 KiB, plus the
/// pages it holds while in use). A spliced read holds one from its
/// reply's arrival until its data is sent to the client, so this bounds
/// spliced reads in flight; past it reads take the copying path. 256: four
/// clients at queue depth 64 (the NBD connection's default depth).
pub const PIPES_MAX: usize = 256;

static POOL: OnceLock<ArrayQueue<SplicePipe>> = OnceLock::new();
static LIVE: AtomicUsize = AtomicUsize::new(0);
static REFUSED_LOGGED: AtomicBool = AtomicBool::new(false);

fn pool() -> &'static ArrayQueue<SplicePipe> {
    POOL.get_or_init(|| ArrayQueue::new(PIPES_MAX))
}

/// A pipe counted against [`PIPES_MAX`] while it exists.
#[derive(Debug)]
pub struct SplicePipe(Pipe);

impl Deref for SplicePipe {
    type Target = Pipe;
    fn deref(&self) -> &Pipe {
        &self.0
    }
}

impl DerefMut for SplicePipe {
    fn deref_mut(&mut self) -> &mut Pipe {
        &mut self.0
    }
}

impl Drop for SplicePipe {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An empty pipe: a pooled one, or a new one while fewer than
/// [`PIPES_MAX`] exist. `None` when none can be had (the caller copies
/// instead); a kernel refusal is logged once per process.
pub fn get() -> Option<SplicePipe> {
    if let Some(p) = pool().pop() {
        return Some(p);
    }
    if LIVE.fetch_add(1, Ordering::AcqRel) >= PIPES_MAX {
        LIVE.fetch_sub(1, Ordering::AcqRel);
        return None;
    }
    match Pipe::new() {
        Ok(p) => Some(SplicePipe(p)),
        Err(e) => {
            LIVE.fetch_sub(1, Ordering::AcqRel);
            if !REFUSED_LOGGED.swap(true, Ordering::Relaxed) {
                tracing::warn!(error = %e, "cannot make a pipe for spliced reads; copying instead");
            }
            None
        }
    }
}

/// Give a pipe back. One that still holds bytes (its payload was never
/// sent: the connection broke) is closed, which drops them.
pub fn put(pipe: SplicePipe) {
    if pipe.held() == 0 {
        // A full pool cannot happen (it holds every pipe there is); drop
        // the extra one if it does.
        let _ = pool().push(pipe);
    }
}

/// Pipes in the process, in use or pooled (for tests and stats).
pub fn live() -> usize {
    LIVE.load(Ordering::Acquire)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    /// An empty pipe given back is reused; one that still holds bytes is
    /// closed (and stops counting), so no pooled pipe ever holds stale
    /// data.
    #[test]
    fn empty_pipes_come_back_and_full_ones_close() {
        let a = get().expect("a pipe");
        let before = live();
        put(a);
        let b = get().expect("the pooled pipe");
        assert_eq!(live(), before, "reused, not a new one");

        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (rx, _) = l.accept().unwrap();
        tx.write_all(b"left over").unwrap();
        let mut b = b;
        while b.held() < 9 {
            match b.fill_from(rx.as_raw_fd(), 9) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        put(b);
        assert_eq!(live(), before - 1, "a pipe with bytes in it is closed");
        let c = get().expect("a new pipe");
        assert_eq!(c.held(), 0);
        put(c);
    }
}
