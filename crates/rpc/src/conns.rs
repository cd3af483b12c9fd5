//! The open connections of a server, capped, so a stop can close them and
//! wait for their threads.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A stream a stop can shut down from another thread.
pub(crate) trait Closable: Send + 'static {
    fn close(&self);
}

impl Closable for UnixStream {
    fn close(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Closable for TcpStream {
    fn close(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

struct Inner<S> {
    open: HashMap<u64, S>,
    next_id: u64,
    closing: bool,
}

pub(crate) struct ConnSet<S: Closable> {
    cap: usize,
    inner: Mutex<Inner<S>>,
    changed: Condvar,
}

/// Holds a connection's slot; dropping it frees the slot.
pub(crate) struct Slot<S: Closable> {
    set: Arc<ConnSet<S>>,
    id: u64,
}

impl<S: Closable> Drop for Slot<S> {
    fn drop(&mut self) {
        let mut inner = self.set.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.open.remove(&self.id);
        self.set.changed.notify_all();
    }
}

impl<S: Closable> ConnSet<S> {
    pub(crate) fn new(cap: usize) -> Arc<ConnSet<S>> {
        Arc::new(ConnSet {
            cap,
            inner: Mutex::new(Inner {
                open: HashMap::new(),
                next_id: 0,
                closing: false,
            }),
            changed: Condvar::new(),
        })
    }

    /// Take a slot for a connection (`handle` is a clone of its stream, kept
    /// to close it at stop); `None` when the set is full or closing.
    pub(crate) fn admit(self: &Arc<Self>, handle: S) -> Option<Slot<S>> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.closing || inner.open.len() >= self.cap {
            return None;
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.open.insert(id, handle);
        Some(Slot {
            set: self.clone(),
            id,
        })
    }

    /// Refuse new connections, shut down the open ones and wait up to
    /// `timeout` for their threads to let go. Returns how many are left (a
    /// method still running holds its slot until it returns).
    pub(crate) fn close_all(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.closing = true;
        for s in inner.open.values() {
            s.close();
        }
        while !inner.open.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            inner = match self.changed.wait_timeout(inner, deadline - now) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
        inner.open.len()
    }
}
