//! `IoQueue<T>`: the safe layer over [`Ring`]. A fixed table of slots, each
//! owning the `IoBuf` its operations read or write; the buffer cannot leave
//! the slot (nor be borrowed) while any of the slot's operations is in
//! flight, and dropping the queue waits for them. That is the whole
//! unsafety boundary: callers (the `file` bdev) never see a raw pointer.
//! A read or write whose buffer lies in an arena registered with
//! [`IoQueue::register_arenas`] goes as READ_FIXED/WRITE_FIXED, any other
//! as plain READ/WRITE ([`IoQueue::buffer_ios`] counts both).
//!
//! ```no_run
//! use lull_uring::{IoBuf, IoQueue, QueueOp};
//! use std::os::fd::AsFd;
//! let file = std::fs::File::open("/etc/hostname")?;
//! let mut q: IoQueue<&str> = IoQueue::new(64, &[file.as_fd()])?;
//! let mut buf = IoBuf::with_capacity(4096);
//! buf.set_len(4096);
//! let slot = q.alloc("my read", Some(buf)).expect("free slot");
//! q.push(slot, &[(0, QueueOp::Read { file: 0, buf_offset: 0, len: 4096, file_offset: 0 })])?;
//! q.submit()?;
//! // ... later, when q.event_fd() is readable:
//! q.drain_event_fd();
//! while let Some(c) = q.next_completion() {
//!     assert!(c.result >= 0);
//!     let (ctx, buf) = q.release(c.slot).expect("no op left in flight");
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::cell::RefCell;
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};

use crate::buf::IoBuf;
use crate::ring::{Ring, RingError, RingOp, RingSetup, Target, CHAIN_OPS_MAX};

/// Index of a slot in an `IoQueue`. Only `IoQueue::alloc` makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId(u32);

impl SlotId {
    /// The slot's index, `< capacity`.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One operation on a slot, for `IoQueue::push`. Buffer ranges are offsets
/// into the slot's `IoBuf`; files are indexes into the descriptors given to
/// `IoQueue::new`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueOp {
    Read {
        file: u32,
        buf_offset: usize,
        len: u32,
        file_offset: u64,
    },
    Write {
        file: u32,
        buf_offset: usize,
        len: u32,
        file_offset: u64,
    },
    Fsync {
        file: u32,
        datasync: bool,
    },
    Fallocate {
        file: u32,
        offset: u64,
        len: u64,
        mode: i32,
    },
    Nop,
}

/// Why `IoQueue::push` refused; nothing was pushed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    #[error("submission queue full")]
    SqFull,
    #[error("slot is not allocated")]
    BadSlot,
    #[error("slot already has operations in flight")]
    Busy,
    #[error("chain is empty or longer than {CHAIN_OPS_MAX} operations")]
    BadChain,
    #[error("file index is not registered")]
    BadFile,
    #[error("buffer range is outside the slot's buffer (or the slot has none)")]
    BadRange,
}

/// A completion: which slot, the `kind` given at push, and the result
/// (bytes transferred, 0, or `-errno`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueCompletion {
    pub slot: SlotId,
    pub kind: u32,
    pub result: i32,
}

struct Slot<T> {
    ctx: Option<T>,
    buf: Option<IoBuf>,
    /// CQEs still to come for this slot. While non-zero the kernel may use
    /// `buf`, so it is neither lent nor released.
    pending: u32,
}

/// A ring plus a fixed table of in-flight slots with a free list.
pub struct IoQueue<T> {
    ring: Ring,
    slots: Box<[Slot<T>]>,
    free: Vec<u32>,
    files: u32,
    pending_total: usize,
    /// Reads and writes pushed as READ_FIXED/WRITE_FIXED (the buffer lay
    /// in a registered arena) ...
    fixed_ios: u64,
    /// ... and as plain READ/WRITE.
    plain_ios: u64,
}

impl<T> IoQueue<T> {
    /// A queue with `entries` slots and a ring of `entries` SQ entries,
    /// with `files` registered as fixed files `0..files.len()`.
    pub fn new(entries: u32, files: &[BorrowedFd<'_>]) -> Result<IoQueue<T>, RingError> {
        IoQueue::with_setup(entries, files, RingSetup::default())
    }

    /// As [`IoQueue::new`], on a ring set up with `setup` (SQPOLL, IOPOLL).
    pub fn with_setup(
        entries: u32,
        files: &[BorrowedFd<'_>],
        setup: RingSetup,
    ) -> Result<IoQueue<T>, RingError> {
        let entries = entries.max(1);
        let mut ring = Ring::with_setup(entries, setup)?;
        if !files.is_empty() {
            let raw: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
            ring.register_files(&raw)?;
        }
        // One slot per SQ entry: with at most CHAIN_OPS_MAX CQEs per slot
        // in flight, the CQ (2x SQ) can never overflow.
        let slots: Box<[Slot<T>]> = (0..entries)
            .map(|_| Slot {
                ctx: None,
                buf: None,
                pending: 0,
            })
            .collect();
        let free = (0..entries).rev().collect();
        Ok(IoQueue {
            ring,
            slots,
            free,
            files: files.len() as u32,
            pending_total: 0,
            fixed_ios: 0,
            plain_ios: 0,
        })
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Slots allocated and not yet released.
    pub fn in_use(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// The ring's completion eventfd. On an IOPOLL ring it fires only
    /// after a `submit` polled completions in: poll the queue instead.
    pub fn event_fd(&self) -> RawFd {
        self.ring.event_fd()
    }

    /// How the ring was set up.
    pub fn setup(&self) -> RingSetup {
        self.ring.setup()
    }

    /// Registers `arenas` with the ring (see [`Ring::register_arenas`]):
    /// from then on a read or write whose buffer lies in one of them goes
    /// as READ_FIXED/WRITE_FIXED, any other buffer as plain READ/WRITE.
    pub fn register_arenas(
        &mut self,
        arenas: &[std::sync::Arc<crate::FixedArena>],
    ) -> Result<usize, RingError> {
        self.ring.register_arenas(arenas)
    }

    /// Arenas registered with the ring.
    pub fn registered_arenas(&self) -> usize {
        self.ring.registered_arenas()
    }

    /// Reads and writes pushed so far from registered (fixed) buffers and
    /// from others: `(fixed, plain)`.
    pub fn buffer_ios(&self) -> (u64, u64) {
        (self.fixed_ios, self.plain_ios)
    }

    /// Counts the ring's `io_uring_enter` calls into `counter` too.
    pub fn set_enter_counter(&mut self, counter: std::sync::Arc<std::sync::atomic::AtomicU64>) {
        self.ring.set_enter_counter(counter);
    }

    /// Takes a free slot for `ctx` and `buf`; hands them back when every
    /// slot is taken (back-pressure).
    pub fn alloc(&mut self, ctx: T, buf: Option<IoBuf>) -> Result<SlotId, (T, Option<IoBuf>)> {
        let Some(index) = self.free.pop() else {
            return Err((ctx, buf));
        };
        let slot = &mut self.slots[index as usize];
        debug_assert!(slot.ctx.is_none() && slot.buf.is_none() && slot.pending == 0);
        slot.ctx = Some(ctx);
        slot.buf = buf;
        Ok(SlotId(index))
    }

    fn slot(&self, id: SlotId) -> Option<&Slot<T>> {
        self.slots.get(id.index()).filter(|s| s.ctx.is_some())
    }

    fn slot_mut(&mut self, id: SlotId) -> Option<&mut Slot<T>> {
        self.slots.get_mut(id.index()).filter(|s| s.ctx.is_some())
    }

    /// The slot's context (None if the slot is not allocated).
    pub fn ctx(&self, id: SlotId) -> Option<&T> {
        self.slot(id)?.ctx.as_ref()
    }

    /// The slot's context, mutably. Allowed while operations are in flight:
    /// the kernel never sees the context.
    pub fn ctx_mut(&mut self, id: SlotId) -> Option<&mut T> {
        self.slot_mut(id)?.ctx.as_mut()
    }

    /// Operations of the slot still in flight.
    pub fn pending(&self, id: SlotId) -> u32 {
        self.slot(id).map_or(0, |s| s.pending)
    }

    /// The slot's buffer, only while none of its operations is in flight.
    pub fn buf(&self, id: SlotId) -> Option<&IoBuf> {
        self.slot(id).filter(|s| s.pending == 0)?.buf.as_ref()
    }

    /// The slot's buffer, mutably, only while none of its operations is in
    /// flight.
    pub fn buf_mut(&mut self, id: SlotId) -> Option<&mut IoBuf> {
        self.slot_mut(id).filter(|s| s.pending == 0)?.buf.as_mut()
    }

    /// Replaces the slot's buffer and returns the old one. Refused (the new
    /// buffer handed back) while operations are in flight or when the slot
    /// is not allocated.
    pub fn replace_buf(
        &mut self,
        id: SlotId,
        buf: Option<IoBuf>,
    ) -> Result<Option<IoBuf>, Option<IoBuf>> {
        match self.slot_mut(id) {
            Some(slot) if slot.pending == 0 => Ok(std::mem::replace(&mut slot.buf, buf)),
            _ => Err(buf),
        }
    }

    /// Frees the slot and returns its context and buffer; `None` while
    /// operations are in flight or when the slot is not allocated.
    pub fn release(&mut self, id: SlotId) -> Option<(T, Option<IoBuf>)> {
        let slot = self.slot_mut(id)?;
        if slot.pending != 0 {
            return None;
        }
        let ctx = slot.ctx.take()?;
        let buf = slot.buf.take();
        self.free.push(id.0);
        Some((ctx, buf))
    }

    /// Pushes `ops` for the slot as one linked chain (see
    /// [`Ring::push_chain`]); each completion comes back with its `kind`
    /// (the first tuple field). The slot must have nothing in flight. If the
    /// SQ lacks room the queue submits first; `SqFull` only if that did not
    /// free enough.
    pub fn push(&mut self, id: SlotId, ops: &[(u32, QueueOp)]) -> Result<(), PushError> {
        if ops.is_empty() || ops.len() > CHAIN_OPS_MAX {
            return Err(PushError::BadChain);
        }
        let files = self.files;
        let slot = self.slots.get_mut(id.index()).ok_or(PushError::BadSlot)?;
        if slot.ctx.is_none() {
            return Err(PushError::BadSlot);
        }
        if slot.pending != 0 {
            return Err(PushError::Busy);
        }
        let ring = &self.ring;
        let (mut fixed_ios, mut plain_ios) = (0, 0);
        let mut raw = [(0u64, RingOp::Nop); CHAIN_OPS_MAX];
        for (i, &(kind, op)) in ops.iter().enumerate() {
            let user_data = (u64::from(kind) << 32) | u64::from(id.0);
            let fixed = |file: u32| {
                if file < files {
                    Ok(Target::Fixed(file))
                } else {
                    Err(PushError::BadFile)
                }
            };
            let in_buf = |buf: &Option<IoBuf>, buf_offset: usize, len: u32| match buf {
                Some(buf)
                    if buf_offset
                        .checked_add(len as usize)
                        .is_some_and(|end| end <= buf.len()) =>
                {
                    Ok(())
                }
                _ => Err(PushError::BadRange),
            };
            let ring_op = match op {
                QueueOp::Read {
                    file,
                    buf_offset,
                    len,
                    file_offset,
                } => {
                    in_buf(&slot.buf, buf_offset, len)?;
                    let target = fixed(file)?;
                    let base = slot
                        .buf
                        .as_mut()
                        .map_or(std::ptr::null_mut(), |b| b.as_mut_ptr());
                    let buf = base.wrapping_add(buf_offset);
                    match registered_index(ring, slot.buf.as_ref(), buf, len) {
                        Some(buf_index) => {
                            fixed_ios += 1;
                            RingOp::ReadFixed {
                                target,
                                buf,
                                len,
                                offset: file_offset,
                                buf_index,
                            }
                        }
                        None => {
                            plain_ios += 1;
                            RingOp::Read {
                                target,
                                buf,
                                len,
                                offset: file_offset,
                            }
                        }
                    }
                }
                QueueOp::Write {
                    file,
                    buf_offset,
                    len,
                    file_offset,
                } => {
                    in_buf(&slot.buf, buf_offset, len)?;
                    let target = fixed(file)?;
                    let base = slot.buf.as_ref().map_or(std::ptr::null(), |b| b.as_ptr());
                    let buf = base.wrapping_add(buf_offset);
                    match registered_index(ring, slot.buf.as_ref(), buf, len) {
                        Some(buf_index) => {
                            fixed_ios += 1;
                            RingOp::WriteFixed {
                                target,
                                buf,
                                len,
                                offset: file_offset,
                                buf_index,
                            }
                        }
                        None => {
                            plain_ios += 1;
                            RingOp::Write {
                                target,
                                buf,
                                len,
                                offset: file_offset,
                            }
                        }
                    }
                }
                QueueOp::Fsync { file, datasync } => RingOp::Fsync {
                    target: fixed(file)?,
                    datasync,
                },
                QueueOp::Fallocate {
                    file,
                    offset,
                    len,
                    mode,
                } => RingOp::Fallocate {
                    target: fixed(file)?,
                    offset,
                    len,
                    mode,
                },
                QueueOp::Nop => RingOp::Nop,
            };
            raw[i] = (user_data, ring_op);
        }
        if self.ring.sq_space() < ops.len() {
            self.ring.submit().map_err(|e| {
                tracing::warn!(error = %e, "io_uring submit failed while making SQ room");
                PushError::SqFull
            })?;
            if self.ring.sq_space() < ops.len() {
                return Err(PushError::SqFull);
            }
        }
        // Every pointer points into the slot's `IoBuf` (range checked
        // above), whose memory (heap or arena) stays put while the slot
        // holds it; a *Fixed op's range lies in the arena registered at
        // its index (checked by `fixed_buf_index`), which the ring keeps
        // mapped. From here until the slot's `pending` count is back to 0 (each CQE of
        // this chain decrements it in `next_completion`), `buf`, `buf_mut`,
        // `replace_buf` and `release` refuse to lend or return the buffer,
        // so nobody else touches it; `Drop` waits for all pending CQEs
        // before the buffers or the ring go away. Targets are registered
        // fixed files, which the ring keeps referenced.
        // SAFETY: push_chain's rules hold by the slot discipline above.
        unsafe { self.ring.push_chain(&raw[..ops.len()]) }.map_err(|_| PushError::SqFull)?;
        let slot = &mut self.slots[id.index()];
        slot.pending += ops.len() as u32;
        self.pending_total += ops.len();
        self.fixed_ios += fixed_ios;
        self.plain_ios += plain_ios;
        Ok(())
    }

    /// Hands pushed operations to the kernel (one non-blocking syscall;
    /// none on an SQPOLL ring whose kernel thread is awake). On an IOPOLL
    /// ring it also polls the device for completions.
    pub fn submit(&mut self) -> Result<usize, RingError> {
        self.ring.submit()
    }

    /// Submits and blocks until at least `want` completions are ready.
    /// Not for reactors (they sleep on `event_fd`); for tests and teardown.
    pub fn submit_and_wait(&mut self, want: usize) -> Result<usize, RingError> {
        self.ring.submit_and_wait(want)
    }

    /// Resets the eventfd; call before a round of `next_completion` (see
    /// [`Ring::drain_event_fd`]).
    pub fn drain_event_fd(&mut self) {
        self.ring.drain_event_fd();
    }

    /// Pops one completion and updates the slot's in-flight count.
    pub fn next_completion(&mut self) -> Option<QueueCompletion> {
        loop {
            let (user_data, result) = self.ring.pop()?;
            let index = (user_data & u64::from(u32::MAX)) as u32;
            let kind = (user_data >> 32) as u32;
            match self.slots.get_mut(index as usize) {
                Some(slot) if slot.pending > 0 => {
                    slot.pending -= 1;
                    self.pending_total -= 1;
                    return Some(QueueCompletion {
                        slot: SlotId(index),
                        kind,
                        result,
                    });
                }
                _ => {
                    // Cannot happen: every SQE we push names a slot with a
                    // pending count. Drop it rather than corrupt the table.
                    tracing::error!(user_data, result, "io_uring completion for no pending slot");
                    debug_assert!(false, "stray io_uring completion {user_data:#x}");
                }
            }
        }
    }

    /// Operations in flight over all slots.
    pub fn pending_total(&self) -> usize {
        self.pending_total
    }

    /// Checks the slot table (debug builds and tests).
    pub fn check_invariants(&self) {
        let mut pending = 0usize;
        CHECK_MARKS.with_borrow_mut(|free_seen| {
            free_seen.clear();
            free_seen.resize(self.slots.len(), false);
            for &index in &self.free {
                let slot = &self.slots[index as usize];
                assert!(
                    !free_seen[index as usize],
                    "slot {index} twice on the free list"
                );
                free_seen[index as usize] = true;
                assert!(slot.ctx.is_none() && slot.buf.is_none() && slot.pending == 0);
            }
            for (index, slot) in self.slots.iter().enumerate() {
                assert!(
                    free_seen[index] || slot.ctx.is_some(),
                    "slot {index} leaked"
                );
                assert!(slot.pending as usize <= CHAIN_OPS_MAX);
                pending += slot.pending as usize;
            }
        });
        assert_eq!(pending, self.pending_total);
    }
}

thread_local! {
    /// `check_invariants`' marks, kept between calls: debug builds check
    /// after every completion, and a fresh vector each time would be a heap
    /// allocation per request that release builds do not make (the
    /// allocation tests run with debug assertions on).
    static CHECK_MARKS: RefCell<Vec<bool>> = const { RefCell::new(Vec::new()) };
}

impl<T> Drop for IoQueue<T> {
    fn drop(&mut self) {
        // The kernel may still read or write slot buffers: wait for every
        // pending CQE before they are freed. This blocks, but only when a
        // channel is closed with I/O outstanding.
        let _ = self.ring.submit();
        while self.pending_total > 0 {
            if let Err(e) = self.ring.submit_and_wait(1) {
                // Cannot wait: leak the buffers rather than free memory the
                // kernel may still write to.
                tracing::error!(error = %e, pending = self.pending_total,
                    "io_uring teardown cannot wait for in-flight I/O; leaking its buffers");
                for slot in self.slots.iter_mut() {
                    if slot.pending > 0 {
                        std::mem::forget(slot.buf.take());
                    }
                }
                return;
            }
            while self.next_completion().is_some() {}
        }
    }
}

impl<T> fmt::Debug for IoQueue<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoQueue")
            .field("ring", &self.ring)
            .field("capacity", &self.slots.len())
            .field("in_use", &self.in_use())
            .field("pending_total", &self.pending_total)
            .finish()
    }
}

/// The registered buffer index for `len` bytes at `ptr` of `buf`, when
/// `buf` lives in an arena `ring` registered. Only an arena buffer can lie
/// in one: a heap buffer skips the scan.
fn registered_index(ring: &Ring, buf: Option<&IoBuf>, ptr: *const u8, len: u32) -> Option<u16> {
    if buf.is_some_and(IoBuf::is_fixed) {
        ring.fixed_buf_index(ptr, len as usize)
    } else {
        None
    }
}
