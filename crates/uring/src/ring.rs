//! `Ring`: a thin wrapper over one io_uring instance for one thread, with an
//! eventfd registered so a reactor can sleep in `epoll_wait` until a
//! completion arrives.
//!
//! Pushing an operation is `unsafe`: the kernel reads or writes the memory
//! an SQE points at until its CQE is posted, which the borrow checker cannot
//! see. [`crate::IoQueue`] is the safe layer on top: it keeps each
//! operation's `IoBuf` in a slot table until the completion arrives.
//!
//! ```no_run
//! use lull_uring::{Ring, RingOp};
//! let mut ring = Ring::new(64)?;
//! // SAFETY: a NOP touches no memory.
//! unsafe { ring.push_chain(&[(7, RingOp::Nop)]) }.expect("SQ has room");
//! ring.submit()?;
//! ring.reap(|user_data, result| assert_eq!((user_data, result), (7, 0)));
//! # Ok::<(), lull_uring::RingError>(())
//! ```

use std::cell::Cell;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use io_uring::{opcode, squeue, types, IoUring};

use crate::arena::{FixedArena, RING_ARENAS_MAX};

// A registered buffer index is a u16 in the SQE.
const _: () = assert!(RING_ARENAS_MAX <= u16::MAX as usize);

/// Longest chain of linked SQEs pushed at once (a write and its FUA fsync).
/// Bounding it bounds the CQEs a slot can have in flight, which keeps the
/// completion queue (twice the SQ) from overflowing.
pub const CHAIN_OPS_MAX: usize = 2;

/// Errors from creating or driving a ring.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    /// The kernel refuses io_uring (`io_uring_setup` failed with EPERM or
    /// ENOSYS): disabled by `kernel.io_uring_disabled`, a seccomp filter
    /// (containers), or a kernel built without it.
    #[error("io_uring is unavailable ({source}); check the kernel.io_uring_disabled sysctl and the container's seccomp profile")]
    Unavailable {
        #[source]
        source: io::Error,
    },
    /// Any other system call failure.
    #[error("io_uring {what} failed: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

impl RingError {
    /// The errno this error reduces to.
    pub fn errno(&self) -> i32 {
        match self {
            RingError::Unavailable { source } | RingError::Io { source, .. } => {
                source.raw_os_error().unwrap_or(libc::EIO)
            }
        }
    }
}

/// The SQ has no room for the whole chain; nothing was pushed. Call
/// `submit` and retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("io_uring submission queue is full")]
pub struct SqFull;

/// Which file an operation targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A plain file descriptor (looked up by the kernel at issue time).
    Fd(RawFd),
    /// An index into the files registered with `Ring::register_files`.
    Fixed(u32),
}

/// One operation for `Ring::push_chain`, with raw memory pointers.
#[derive(Debug, Clone, Copy)]
pub enum RingOp {
    /// Read `len` bytes at file offset `offset` into `buf`.
    Read {
        target: Target,
        buf: *mut u8,
        len: u32,
        offset: u64,
    },
    /// Write `len` bytes from `buf` at file offset `offset`.
    Write {
        target: Target,
        buf: *const u8,
        len: u32,
        offset: u64,
    },
    /// `Read` into registered buffer `buf_index` (`IORING_OP_READ_FIXED`):
    /// `buf..buf + len` must lie inside it (else the op fails, EFAULT).
    ReadFixed {
        target: Target,
        buf: *mut u8,
        len: u32,
        offset: u64,
        buf_index: u16,
    },
    /// `Write` from registered buffer `buf_index` (`IORING_OP_WRITE_FIXED`).
    WriteFixed {
        target: Target,
        buf: *const u8,
        len: u32,
        offset: u64,
        buf_index: u16,
    },
    /// fsync, or fdatasync with `datasync`.
    Fsync { target: Target, datasync: bool },
    /// fallocate(mode, offset, len).
    Fallocate {
        target: Target,
        offset: u64,
        len: u64,
        mode: i32,
    },
    /// Does nothing; completes with 0. Used to post a completion through
    /// the ring (and its eventfd).
    Nop,
}

fn entry_for(op: RingOp) -> squeue::Entry {
    macro_rules! with_target {
        ($target:expr, |$fd:ident| $build:expr) => {
            match $target {
                Target::Fd(raw) => {
                    let $fd = types::Fd(raw);
                    $build
                }
                Target::Fixed(index) => {
                    let $fd = types::Fixed(index);
                    $build
                }
            }
        };
    }
    match op {
        RingOp::Read {
            target,
            buf,
            len,
            offset,
        } => with_target!(target, |fd| opcode::Read::new(fd, buf, len)
            .offset(offset)
            .build()),
        RingOp::Write {
            target,
            buf,
            len,
            offset,
        } => with_target!(target, |fd| opcode::Write::new(fd, buf, len)
            .offset(offset)
            .build()),
        RingOp::ReadFixed {
            target,
            buf,
            len,
            offset,
            buf_index,
        } => with_target!(target, |fd| opcode::ReadFixed::new(fd, buf, len, buf_index)
            .offset(offset)
            .build()),
        RingOp::WriteFixed {
            target,
            buf,
            len,
            offset,
            buf_index,
        } => with_target!(target, |fd| opcode::WriteFixed::new(
            fd, buf, len, buf_index
        )
        .offset(offset)
        .build()),
        RingOp::Fsync { target, datasync } => {
            let flags = if datasync {
                types::FsyncFlags::DATASYNC
            } else {
                types::FsyncFlags::empty()
            };
            with_target!(target, |fd| opcode::Fsync::new(fd).flags(flags).build())
        }
        RingOp::Fallocate {
            target,
            offset,
            len,
            mode,
        } => with_target!(target, |fd| opcode::Fallocate::new(fd, len)
            .offset(offset)
            .mode(mode)
            .build()),
        RingOp::Nop => opcode::Nop::new().build(),
    }
}

thread_local! {
    /// `io_uring_enter` calls this OS thread made through any `Ring`.
    static THREAD_ENTERS: Cell<u64> = const { Cell::new(0) };
}

/// `io_uring_enter` system calls the calling OS thread has made through
/// lull's rings (submit, wait, and the GETEVENTS an IOPOLL ring is reaped
/// with). A reactor reads it for its own counters: a thread-local read,
/// no syscall.
pub fn thread_enter_calls() -> u64 {
    THREAD_ENTERS.with(|c| c.get())
}

/// How a ring is set up beyond its size: the file backend's `sqpoll`,
/// `iopoll` and `hybrid_iopoll` options.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RingSetup {
    /// `IORING_SETUP_SQPOLL` with this `sq_thread_idle` (ms): a kernel
    /// thread takes submissions, so a submit is a memory write while the
    /// thread is awake and an `io_uring_enter` only to wake it.
    pub sqpoll_idle_ms: Option<u32>,
    /// `IORING_SETUP_IOPOLL`: completions are found by polling the device
    /// (an `io_uring_enter` with GETEVENTS), never by interrupt, so the
    /// eventfd only fires after such a poll and a reactor must poll the
    /// ring while I/O is in flight. Needs O_DIRECT files on a device with
    /// poll queues.
    pub iopoll: bool,
    /// With `iopoll`: `IORING_SETUP_HYBRID_IOPOLL` (Linux 6.13+), which
    /// sleeps about a request's expected service time before polling for
    /// it, trading a little latency for much of polling's CPU.
    pub hybrid_iopoll: bool,
}

/// `IORING_SETUP_CQSIZE` (linux/io_uring.h): `cq_entries` is given.
const IORING_SETUP_CQSIZE: u32 = 1 << 3;
/// Words of `struct io_uring_params` (120 bytes of u32 and u64 fields).
const PARAMS_WORDS: usize = 30;
/// Index of `flags` in those words (after sq_entries and cq_entries).
const PARAMS_FLAGS: usize = 2;

/// A raw `io_uring_setup` (for flags the io-uring crate's builder cannot
/// ask for): the new ring's descriptor and the parameters the kernel
/// filled in.
fn raw_setup(
    entries: u32,
    cq_entries: u32,
    flags: u32,
) -> io::Result<(OwnedFd, [u32; PARAMS_WORDS])> {
    let mut params = [0u32; PARAMS_WORDS];
    params[1] = cq_entries;
    params[PARAMS_FLAGS] = flags;
    // SAFETY: io_uring_setup reads and writes the 120-byte params block,
    // which `params` is, and takes no other pointer.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, entries, params.as_mut_ptr()) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a non-negative result is a new descriptor nobody else owns.
    Ok((unsafe { OwnedFd::from_raw_fd(fd as RawFd) }, params))
}

/// An IOPOLL ring with `IORING_SETUP_HYBRID_IOPOLL`, which the io-uring
/// crate (0.7) cannot request: the kernel makes it with a raw
/// `io_uring_setup`, and the crate adopts it (`IoUring::from_fd`) with the
/// parameters of a ring `builder` makes the same way without the flag.
/// That is sound only if the flag changes nothing the crate reads (entry
/// counts, features, ring offsets); two raw set-ups, with and without the
/// flag, are compared word by word first, and a difference refuses the
/// ring (EINVAL) rather than guess. The flag itself is read by no code of
/// the crate (it asks only whether a ring is SQPOLL or IOPOLL).
fn build_hybrid_iopoll(
    builder: &io_uring::Builder,
    entries: u32,
    cq_entries: u32,
) -> io::Result<IoUring> {
    // The builder's flags: CQSIZE and IOPOLL (64-byte SQEs, 16-byte CQEs).
    let base = IORING_SETUP_CQSIZE | crate::probe::IORING_SETUP_IOPOLL;
    let (_plain_fd, plain) = raw_setup(entries, cq_entries, base)?;
    let (fd, hybrid) = raw_setup(
        entries,
        cq_entries,
        base | crate::probe::IORING_SETUP_HYBRID_IOPOLL,
    )?;
    let same = plain
        .iter()
        .zip(&hybrid)
        .enumerate()
        .all(|(i, (a, b))| i == PARAMS_FLAGS || a == b);
    if !same {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "this kernel lays out a hybrid-IOPOLL ring unlike a plain IOPOLL one; lull cannot adopt it",
        ));
    }
    let template = builder.build(entries)?;
    let params = template.params().clone();
    if (params.sq_entries(), params.cq_entries()) != (hybrid[0], hybrid[1]) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the io-uring crate's ring and the raw hybrid-IOPOLL ring differ in size",
        ));
    }
    drop(template);
    // `fd` is an io_uring made with the builder's flags plus HYBRID_IOPOLL,
    // which changed no parameter the kernel filled in (the comparison
    // above: same entries, features and offsets as a ring without it, whose
    // parameters are the builder's, made with the same flags and sizes).
    // SAFETY: so `params` describe `fd`'s ring; the descriptor moves into it.
    unsafe { IoUring::from_fd(fd.into_raw_fd(), params) }
}

/// The ring that holds the process's registration of the fixed arenas,
/// for other rings to clone (see [`Ring::register_arenas`]), and the
/// arenas it registered (kept mapped while it lives).
struct Template {
    ring: IoUring,
    arenas: Vec<Arc<FixedArena>>,
}

static TEMPLATE: std::sync::Mutex<Option<Template>> = std::sync::Mutex::new(None);

/// The kernel refused IORING_REGISTER_CLONE_BUFFERS once: register per ring.
pub(crate) static CLONE_UNSUPPORTED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

enum CloneError {
    /// The kernel does not know the operation (before 6.12).
    Unsupported(io::Error),
    Failed(io::Error),
}

/// Registers each arena's whole mapping as one fixed buffer of `ring`.
///
/// # Safety
/// The arenas must stay mapped until `ring` is dropped (callers keep an `Arc`).
unsafe fn register_iovecs(ring: &IoUring, arenas: &[Arc<FixedArena>]) -> io::Result<()> {
    let mut iovecs = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; RING_ARENAS_MAX];
    for (iov, arena) in iovecs.iter_mut().zip(arenas) {
        let (base, len) = arena.region();
        iov.iov_base = base.cast();
        iov.iov_len = len;
    }
    let n = arenas.len().min(RING_ARENAS_MAX);
    // SAFETY: each iovec is an arena's whole mapping, which stays mapped
    // for the ring's life (the caller's guarantee).
    unsafe { ring.submitter().register_buffers(&iovecs[..n]) }
}

/// One io_uring instance plus its completion eventfd. Used by one thread.
pub struct Ring {
    ring: IoUring,
    event_fd: OwnedFd,
    setup: RingSetup,
    /// Also counts this ring's `io_uring_enter` calls (the device's total
    /// over its channels), when set.
    enter_counter: Option<Arc<AtomicU64>>,
    /// Arenas registered as fixed buffers, buffer index = position. Held
    /// so their memory outlives the registration.
    arenas: Vec<Arc<FixedArena>>,
}

impl Ring {
    /// A ring with `entries` SQ entries (rounded up to a power of two by the
    /// kernel) and a CQ twice that size, with a non-blocking eventfd
    /// registered for completion notifications.
    pub fn new(entries: u32) -> Result<Ring, RingError> {
        Ring::with_setup(entries, RingSetup::default())
    }

    /// As [`Ring::new`], with SQPOLL and/or IOPOLL. The kernel refusing a
    /// flag is `RingError::Io { what: "setup", .. }` (EINVAL: unknown or
    /// bad combination; EPERM for SQPOLL without the privilege).
    pub fn with_setup(entries: u32, setup: RingSetup) -> Result<Ring, RingError> {
        let mut builder = IoUring::builder();
        builder.setup_cqsize(entries.saturating_mul(2));
        if let Some(idle_ms) = setup.sqpoll_idle_ms {
            builder.setup_sqpoll(idle_ms);
        }
        if setup.iopoll {
            builder.setup_iopoll();
        }
        let built = if setup.iopoll && setup.hybrid_iopoll {
            build_hybrid_iopoll(&builder, entries, entries.saturating_mul(2))
        } else {
            builder.build(entries)
        };
        let ring = built.map_err(|source| match source.raw_os_error() {
            Some(libc::EPERM) if setup.sqpoll_idle_ms.is_some() => RingError::Io {
                what: "setup (SQPOLL)",
                source,
            },
            Some(libc::EPERM) | Some(libc::ENOSYS) => RingError::Unavailable { source },
            _ => RingError::Io {
                what: "setup",
                source,
            },
        })?;
        // SAFETY: eventfd takes no pointers; a non-negative result is a new
        // descriptor that nothing else owns.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(RingError::Io {
                what: "eventfd",
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: `raw` is a fresh descriptor owned by nobody else.
        let event_fd = unsafe { OwnedFd::from_raw_fd(raw) };
        ring.submitter()
            .register_eventfd(event_fd.as_raw_fd())
            .map_err(|source| RingError::Io {
                what: "register_eventfd",
                source,
            })?;
        Ok(Ring {
            ring,
            event_fd,
            setup,
            enter_counter: None,
            arenas: Vec::new(),
        })
    }

    /// How the ring was set up.
    pub fn setup(&self) -> RingSetup {
        self.setup
    }

    /// Counts this ring's `io_uring_enter` calls into `counter` as well as
    /// into the thread's count.
    pub fn set_enter_counter(&mut self, counter: Arc<AtomicU64>) {
        self.enter_counter = Some(counter);
    }

    fn count_enter(&self) {
        THREAD_ENTERS.with(|c| c.set(c.get() + 1));
        if let Some(c) = &self.enter_counter {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Whether `submit` will make a system call: always, except on an
    /// SQPOLL ring whose kernel thread is awake (the io-uring crate then
    /// only publishes the SQ tail), mirroring the crate's own test.
    fn submit_enters(&mut self) -> bool {
        if self.setup.sqpoll_idle_ms.is_none() {
            return true;
        }
        let sq = self.ring.submission();
        sq.need_wakeup() || sq.cq_overflow() || sq.taskrun()
    }

    /// The eventfd that becomes readable when completions are posted.
    /// `reap` drains it.
    pub fn event_fd(&self) -> RawFd {
        self.event_fd.as_raw_fd()
    }

    /// Registers files for `Target::Fixed(index)`. The ring holds its own
    /// reference to each file, so closing the descriptors later is harmless
    /// and saves a file lookup per operation.
    pub fn register_files(&mut self, fds: &[RawFd]) -> Result<(), RingError> {
        self.ring
            .submitter()
            .register_files(fds)
            .map_err(|source| RingError::Io {
                what: "register_files",
                source,
            })
    }

    /// Registers `arenas` (at most `RING_ARENAS_MAX`, the rest ignored) as
    /// this ring's fixed buffers, buffer index = position; once per ring.
    /// Returns how many.
    ///
    /// The kernel pins the arenas once per process, in a template ring
    /// (counted against RLIMIT_MEMLOCK without CAP_IPC_LOCK: ENOMEM past
    /// it); each ring then clones that table (`IORING_REGISTER_CLONE_BUFFERS`,
    /// Linux 6.12+), which shares the pinned pages instead of pinning
    /// them again and costs the ring a table of pointers, not a page list
    /// per arena (64 KiB per 16 MiB): a file volume opens a ring per
    /// connection. On an older kernel each ring registers the arenas
    /// itself.
    pub fn register_arenas(&mut self, arenas: &[Arc<FixedArena>]) -> Result<usize, RingError> {
        if !self.arenas.is_empty() {
            return Err(RingError::Io {
                what: "register_buffers",
                source: io::Error::from_raw_os_error(libc::EBUSY),
            });
        }
        let arenas = &arenas[..arenas.len().min(RING_ARENAS_MAX)];
        if arenas.is_empty() {
            return Ok(0);
        }
        if !CLONE_UNSUPPORTED.load(Ordering::Relaxed) {
            match self.clone_registration(arenas) {
                Ok(()) => {
                    self.arenas.extend(arenas.iter().cloned());
                    return Ok(arenas.len());
                }
                Err(CloneError::Unsupported(e)) => {
                    tracing::debug!(error = %e,
                        "io_uring cannot clone registered buffers (Linux < 6.12); each ring registers them");
                    CLONE_UNSUPPORTED.store(true, Ordering::Relaxed);
                }
                Err(CloneError::Failed(source)) => {
                    return Err(RingError::Io {
                        what: "register_buffers",
                        source,
                    })
                }
            }
        }
        // SAFETY: see `register_iovecs`; the arenas are pushed below and
        // dropped only with the ring.
        unsafe { register_iovecs(&self.ring, arenas) }.map_err(|source| RingError::Io {
            what: "register_buffers",
            source,
        })?;
        self.arenas.extend(arenas.iter().cloned());
        Ok(arenas.len())
    }

    /// Clones the template ring's buffer table, (re)building the template
    /// first when it holds other arenas.
    fn clone_registration(&mut self, arenas: &[Arc<FixedArena>]) -> Result<(), CloneError> {
        let mut template = TEMPLATE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let current = template.as_ref().is_some_and(|t| {
            t.arenas.len() == arenas.len()
                && t.arenas.iter().zip(arenas).all(|(a, b)| Arc::ptr_eq(a, b))
        });
        if !current {
            let ring = IoUring::new(1).map_err(CloneError::Failed)?;
            // SAFETY: the template keeps the arenas (`Template::arenas`)
            // for as long as its ring lives.
            unsafe { register_iovecs(&ring, arenas) }.map_err(CloneError::Failed)?;
            *template = Some(Template {
                ring,
                arenas: arenas.to_vec(),
            });
        }
        let src = template.as_ref().map_or(-1, |t| t.ring.as_raw_fd());
        self.ring
            .submitter()
            .register_buffers_clone(src)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => CloneError::Unsupported(e),
                _ => CloneError::Failed(e),
            })
    }

    /// The registered buffer index whose arena holds `ptr..ptr + len`.
    pub fn fixed_buf_index(&self, ptr: *const u8, len: usize) -> Option<u16> {
        self.arenas
            .iter()
            .position(|a| a.contains(ptr, len))
            .map(|i| i as u16)
    }

    /// Arenas registered (0: none, every op uses plain READ/WRITE).
    pub fn registered_arenas(&self) -> usize {
        self.arenas.len()
    }

    /// Free SQ entries.
    pub fn sq_space(&mut self) -> usize {
        let sq = self.ring.submission();
        sq.capacity() - sq.len()
    }

    /// SQ entries (a power of two).
    pub fn sq_capacity(&mut self) -> usize {
        self.ring.submission().capacity()
    }

    /// Pushes `ops` as one chain: each is linked (`IOSQE_IO_LINK`) to the
    /// next, so a later op starts only after the earlier succeeded in full
    /// (a failure or a short read/write cancels the rest with `-ECANCELED`).
    /// All or nothing: with too little SQ room nothing is pushed.
    ///
    /// The kernel uses the memory and descriptors named by `ops` until the
    /// CQE carrying each op's `user_data` has been reaped. Until then:
    /// - for `Read`, `buf..buf+len` must be valid for writes and must not be
    ///   read or written by anyone else (no Rust reference may exist to it);
    /// - for `Write`, `buf..buf+len` must be valid for reads and not written;
    /// - the same for `ReadFixed` / `WriteFixed` (whose range the kernel
    ///   also checks against the registered buffer);
    /// - a `Target::Fd` descriptor must stay open and refer to the same file
    ///   (linked ops look their file up when they start, after `submit`);
    /// - the `Ring` must not be dropped (dropping it tears the ring down
    ///   while the kernel may still use the memory).
    ///
    /// # Safety
    /// The caller upholds every rule above until each op's CQE is reaped.
    pub unsafe fn push_chain(&mut self, ops: &[(u64, RingOp)]) -> Result<(), SqFull> {
        if ops.is_empty() {
            return Ok(());
        }
        if ops.len() > CHAIN_OPS_MAX {
            return Err(SqFull);
        }
        let mut entries: [squeue::Entry; CHAIN_OPS_MAX] =
            std::array::from_fn(|_| opcode::Nop::new().build());
        let last = ops.len() - 1;
        for (i, &(user_data, op)) in ops.iter().enumerate() {
            let mut entry = entry_for(op).user_data(user_data);
            if i < last {
                entry = entry.flags(squeue::Flags::IO_LINK);
            }
            entries[i] = entry;
        }
        let mut sq = self.ring.submission();
        // SAFETY: the caller guarantees the memory and descriptors named by
        // the entries stay valid until their completions (see # Safety).
        unsafe { sq.push_multiple(&entries[..ops.len()]) }.map_err(|_| SqFull)
    }

    /// Hands pushed SQEs to the kernel without waiting for anything.
    /// Returns how many were consumed. EINTR is retried; EAGAIN/EBUSY (the
    /// kernel is short of resources or completions need reaping) return 0:
    /// call again after `reap`.
    pub fn submit(&mut self) -> Result<usize, RingError> {
        loop {
            if self.submit_enters() {
                self.count_enter();
            }
            match self.ring.submit() {
                Ok(n) => return Ok(n),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EBUSY)) => {
                    return Ok(0)
                }
                Err(source) => {
                    return Err(RingError::Io {
                        what: "enter",
                        source,
                    })
                }
            }
        }
    }

    /// Submits and blocks until at least `want` completions are available.
    /// Not for reactors; for tests and teardown.
    pub fn submit_and_wait(&mut self, want: usize) -> Result<usize, RingError> {
        loop {
            if want > 0 || self.submit_enters() {
                self.count_enter();
            }
            match self.ring.submit_and_wait(want) {
                Ok(n) => return Ok(n),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(source) => {
                    return Err(RingError::Io {
                        what: "enter",
                        source,
                    })
                }
            }
        }
    }

    /// Resets the eventfd counter (non-blocking) so a level-triggered epoll
    /// stops reporting it. Call *before* reading the CQ: a completion
    /// posted after the drain then re-arms the eventfd instead of being
    /// missed.
    pub fn drain_event_fd(&mut self) {
        let mut counter = 0u64;
        // The eventfd is non-blocking, so EAGAIN (nothing to drain) is the
        // only expected failure and needs no handling.
        // SAFETY: reads 8 bytes into a local u64 from a descriptor we own.
        let _ = unsafe {
            libc::read(
                self.event_fd.as_raw_fd(),
                (&mut counter as *mut u64).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }

    /// Pops one completion: `(user_data, result)`, result being the
    /// syscall's return value or `-errno`. Does not touch the eventfd.
    pub fn pop(&mut self) -> Option<(u64, i32)> {
        if self.ring.submission().cq_overflow() {
            // With IORING_FEAT_NODROP the kernel parks overflowed CQEs; an
            // enter with GETEVENTS flushes them into the CQ.
            let _ = self.ring.submitter().submit_and_wait(0);
        }
        let cqe = self.ring.completion().next()?;
        Some((cqe.user_data(), cqe.result()))
    }

    /// Drains the eventfd, then hands every available completion to
    /// `done(user_data, result)`. Returns how many.
    pub fn reap(&mut self, mut done: impl FnMut(u64, i32)) -> usize {
        self.drain_event_fd();
        let mut n = 0;
        while let Some((user_data, result)) = self.pop() {
            done(user_data, result);
            n += 1;
        }
        n
    }
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("fd", &self.ring.as_raw_fd())
            .field("event_fd", &self.event_fd.as_raw_fd())
            .finish()
    }
}

/// Blocks until `fd` is readable or `timeout_ms` passes (negative: no
/// timeout); returns whether it is readable. For tests and tools that wait
/// on a channel's eventfd outside a reactor; a reactor uses its epoll.
pub fn wait_readable(fd: RawFd, timeout_ms: i32) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: `pfd` is one valid pollfd on the stack; poll only reads
        // and writes it.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if rc >= 0 {
            return Ok(rc > 0 && pfd.revents & libc::POLLIN != 0);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}
