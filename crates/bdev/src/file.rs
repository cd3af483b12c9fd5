//! `FileDev`: a volume stored in a (sparse) file, driven through io_uring.
//!
//! Each channel owns an io_uring ring and a slot table ([`IoQueue`]) of
//! `FILE_CHANNEL_DEPTH` in-flight requests; a full table is back-pressure
//! (`BdevError::Full`). Request buffers stay in their slot until the
//! completion hands them back, so the I/O path allocates nothing.
//!
//! ```no_run
//! use lull_bdev::{BlockDevice, FileDev, FileOptions, IoOp, IoRequest, BufPool};
//! let dev = FileDev::open("/var/lib/lull/vol0", 1 << 30, FileOptions { direct: true, create: true, ..Default::default() })?;
//! let mut ch = dev.open_channel()?;
//! let mut pool = BufPool::new(64 << 20);
//! ch.submit(IoRequest { tag: 1, op: IoOp::Read, offset: 0, len: 4096, buf: Some(pool.get(4096)) })
//!     .map_err(|(_, e)| e)?;
//! ch.flush_submissions(); // one io_uring_enter for the batch
//! // ... when ch.event_fd() is readable:
//! ch.reap(&mut |c| { /* reply to the client */ });
//! # Ok::<(), lull_bdev::BdevError>(())
//! ```
//!
//! # Mapping
//!
//! - Read/Write: `IORING_OP_READ`/`WRITE`, or `READ_FIXED`/`WRITE_FIXED`
//!   when the buffer lies in a reactor's fixed arena (each channel's ring
//!   registers every reactor's arena at open unless `fixed=off`; see
//!   [`lull_uring::FixedArena`]); short transfers are resubmitted for the
//!   remainder; 0 bytes (EOF, no space) completes with an error.
//! - FUA (Write, WriteZeroes): the last data operation is linked
//!   (`IOSQE_IO_LINK`) to an `fdatasync`.
//! - Flush: `fdatasync`.
//! - Trim, and WriteZeroes without `no_hole`: `fallocate(PUNCH_HOLE |
//!   KEEP_SIZE)`; WriteZeroes with `no_hole`: `fallocate(ZERO_RANGE |
//!   KEEP_SIZE)`. If the filesystem refuses the mode (EOPNOTSUPP; tmpfs has
//!   no ZERO_RANGE) the range is written with zeros instead, and the channel
//!   remembers not to try that mode again; a *fast* WriteZeroes fails with
//!   `Unsupported` instead of writing zeros (NBD's fast zero).
//! - Block status (`BlockDevice::extents`): `lseek(SEEK_DATA/SEEK_HOLE)` on
//!   the main descriptor; holes read as zeros.
//! - Cache (`BlockDevice::prefetch`): `posix_fadvise(WILLNEED)` on the
//!   buffered descriptor, at most `MAX_PREFETCH_BYTES` per call.
//!
//! # Growing
//!
//! [`BlockDevice::grow`] extends a regular file with `ftruncate` (sparse)
//! before raising the size every channel reads (one atomic shared with
//! them), so no request checked against the new size finds the file
//! short. A block device node grows only up to its own size.
//!
//! # O_DIRECT and unaligned requests
//!
//! With `direct`, requests whose offset and length are multiples of the
//! file's O_DIRECT alignment (from `statx(STATX_DIOALIGN)`, else 4096, which
//! suits every logical block size up to 4 KiB) go through the O_DIRECT
//! descriptor. Unaligned ones (qemu-io with odd offsets) go through a second,
//! buffered descriptor of the same file. The kernel keeps the two coherent
//! for requests that do not overlap in time: a direct read or write first
//! writes back dirty cached pages in its range and a direct write then drops
//! them, and `fdatasync` covers both (it syncs the inode). The page cache also
//! merges concurrent sub-block writes to the same block correctly, which a
//! user-space read-modify-write could only do with a cross-thread range lock.
//! What is not defined is the result of *concurrent overlapping* writes, as
//! for any block device.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, RawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lull_uring::{BufPool, IoBuf, IoQueue, QueueCompletion, QueueOp, RingError, RingSetup, SlotId};

use crate::file_inline::{uses_main, InlineChannel, INLINE_CHANNEL_DEPTH};
use crate::ring_options::{self, RingOptions};

use crate::{
    check_grow, validate_request, BdevError, BlockDevice, BufferIos, Channel, IoCompletion, IoOp,
    IoRequest,
};

/// Requests a file channel keeps in flight (slots, and SQ entries of its
/// ring). 256 matches an NBD connection's useful queue depth (fio and qemu
/// rarely go past 128) while keeping the ring and slot table a few KiB.
pub const FILE_CHANNEL_DEPTH: u32 = 256;
const _: () = assert!(INLINE_CHANNEL_DEPTH == FILE_CHANNEL_DEPTH as usize);

/// Most bytes one `prefetch` asks the kernel to read ahead. NBD_CMD_CACHE
/// may name up to 4 GiB; the advice is only advice, so a prefix is as
/// valid as the whole, and this bounds the page cache one request can
/// fill and the time `fadvise` spends starting readahead on the reactor.
/// 32 MiB is half the largest read lull serves (64 MiB) and the largest
/// most clients send.
pub const MAX_PREFETCH_BYTES: u64 = 32 << 20;

/// Size of the zero buffer used when the filesystem cannot zero a range by
/// itself: big enough that writing zeros is not syscall-bound, small enough
/// to keep a few cached per channel.
const ZERO_BUF_BYTES: usize = 1 << 20;

/// Bytes of zero buffers a channel keeps cached (four of them).
const CHANNEL_POOL_BYTES: usize = 4 * ZERO_BUF_BYTES;

/// O_DIRECT alignment assumed when the kernel does not report it.
const DIRECT_ALIGN_DEFAULT_BYTES: u64 = 4096;

/// Fixed-file index of the main descriptor (O_DIRECT if `direct`).
const FILE_MAIN: u32 = 0;
/// Fixed-file index of the buffered descriptor (only with `direct`).
const FILE_BUFFERED: u32 = 1;

// Completion kinds, to tell the CQEs of one chain apart.
const KIND_DATA: u32 = 1;
const KIND_SYNC: u32 = 2;
const KIND_FALLOC: u32 = 3;
const KIND_NOP: u32 = 4;

/// Largest file device, also the most it can grow to: the kernel's file
/// offsets are signed 64-bit (`off_t`), as `parse_size_bytes` already
/// enforces for configured sizes. The filesystem may refuse less (EFBIG),
/// which is reported as an I/O error.
pub const FILE_SIZE_MAX_BYTES: u64 = i64::MAX as u64;

/// How to open a `FileDev`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FileOptions {
    /// Open with O_DIRECT (bypass the page cache for aligned requests).
    pub direct: bool,
    /// Create the file if it does not exist.
    pub create: bool,
    /// io_uring options (SQPOLL, IOPOLL), checked at open.
    pub ring: RingOptions,
}

/// A block device stored in a file (or a block device node).
#[derive(Debug)]
pub struct FileDev {
    path: PathBuf,
    /// The device's size, shared with every channel; raised by `grow`
    /// once the file is long enough, never lowered.
    size_bytes: Arc<AtomicU64>,
    /// Serializes `grow` (control path only).
    growing: std::sync::Mutex<()>,
    direct: bool,
    main: Arc<File>,
    /// Buffered descriptor for unaligned requests; `Some` iff `direct`.
    buffered: Option<Arc<File>>,
    /// O_DIRECT alignment of file offsets and lengths (0 without direct).
    direct_align_bytes: u64,
    /// The ring setup every channel uses, as `open` resolved it.
    setup: RingSetup,
    /// `io_uring_enter` calls made by all of this device's channels.
    enters: Arc<AtomicU64>,
    /// Register the reactors' fixed arenas with each channel's ring.
    fixed_buffers: bool,
    /// Reads and writes of all channels from fixed and from plain buffers.
    buffer_ios: Arc<BufferIoCounters>,
    /// Channels run inline (`crate::file_inline`), without a ring.
    inline: bool,
    /// Reads and writes the inline channels did.
    inline_ios: Arc<AtomicU64>,
}

/// `BufferIos`, shared by a device's channels.
#[derive(Debug, Default)]
struct BufferIoCounters {
    fixed: AtomicU64,
    plain: AtomicU64,
}

/// One log line per process when a ring cannot register the fixed
/// arenas (every channel would say the same).
static REGISTER_FAILED_LOGGED: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

impl FileDev {
    /// Opens (or with `create`, creates) `path` as a device of `size_bytes`.
    ///
    /// A regular file shorter than `size_bytes` is extended (sparsely). A
    /// longer one is used as is: the device is its first `size_bytes` bytes
    /// and the tail is left untouched (logged), so a volume can be served at
    /// a smaller size without destroying data. Block device nodes are used
    /// as they are.
    pub fn open(
        path: impl AsRef<Path>,
        size_bytes: u64,
        options: FileOptions,
    ) -> Result<FileDev, BdevError> {
        let path = path.as_ref().to_path_buf();
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true).create(options.create);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(&path)
        };
        let main = open(options.direct).map_err(|e| {
            tracing::error!(path = %path.display(), direct = options.direct, error = %e, "cannot open file backend");
            if options.direct && e.raw_os_error() == Some(libc::EINVAL) {
                BdevError::Unsupported("O_DIRECT is not supported by this filesystem")
            } else {
                BdevError::Io(e)
            }
        })?;
        let meta = main.metadata()?;
        if meta.file_type().is_file() {
            let len = meta.len();
            if len < size_bytes {
                main.set_len(size_bytes)?;
                tracing::info!(path = %path.display(), from = len, to = size_bytes, "extended backing file (sparse)");
            } else if len > size_bytes {
                tracing::warn!(path = %path.display(), file_bytes = len, size_bytes,
                    "backing file is larger than the volume; its tail is left untouched");
            }
        } else if !meta.file_type().is_block_device() {
            return Err(BdevError::Unsupported(
                "file backend needs a regular file or a block device",
            ));
        }
        let (buffered, direct_align_bytes) = if options.direct {
            let buffered = open(false)?;
            let align = match lull_uring::probe::dio_alignment(main.as_fd()) {
                Some(a) if a.mem_bytes as usize <= lull_uring::IO_BUF_ALIGN_BYTES => {
                    u64::from(a.offset_bytes.max(a.mem_bytes)).max(1)
                }
                Some(a) => {
                    // IoBufs are page aligned; a stricter memory alignment
                    // cannot be met, so every request goes buffered.
                    tracing::warn!(path = %path.display(), mem_align = a.mem_bytes,
                        "O_DIRECT memory alignment above 4096; using buffered I/O");
                    u64::MAX
                }
                None => DIRECT_ALIGN_DEFAULT_BYTES,
            };
            (Some(buffered), align)
        } else {
            (None, 0)
        };
        let inline = ring_options::resolve_inline(&path, &main, &meta, options.ring)?;
        let setup = ring_options::resolve(&path, &meta, options.direct, options.ring)?;
        Ok(FileDev {
            path,
            size_bytes: Arc::new(AtomicU64::new(size_bytes)),
            growing: std::sync::Mutex::new(()),
            direct: options.direct,
            main: Arc::new(main),
            buffered: buffered.map(Arc::new),
            direct_align_bytes,
            setup,
            enters: Arc::new(AtomicU64::new(0)),
            fixed_buffers: options.ring.fixed_buffers,
            buffer_ios: Arc::new(BufferIoCounters::default()),
            inline,
            inline_ios: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Whether channels read and write inline, without io_uring (see
    /// [`crate::Inline`]).
    pub fn is_inline(&self) -> bool {
        self.inline
    }

    /// The data file, for reading its bytes out of the page cache by
    /// other means than a channel (`sendfile` of a replica's read replies);
    /// `None` with `direct`, whose reads bypass the page cache.
    pub fn page_cache_file(&self) -> Option<Arc<File>> {
        (!self.direct).then(|| self.main.clone())
    }

    /// Whether aligned requests bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Alignment (bytes) a request's offset and length need to go through
    /// O_DIRECT; `None` without `direct`.
    pub fn direct_align_bytes(&self) -> Option<u64> {
        self.direct.then_some(self.direct_align_bytes)
    }

    /// Opens a concrete io_uring file channel (`open_channel` boxes this,
    /// or an inline channel when the device resolved to inline).
    pub fn open_file_channel(&self) -> Result<FileChannel, BdevError> {
        let mut fds = vec![self.main.as_fd()];
        if let Some(b) = &self.buffered {
            fds.push(b.as_fd());
        }
        let mut queue = IoQueue::with_setup(FILE_CHANNEL_DEPTH, &fds, self.setup).map_err(|e| {
            tracing::error!(path = %self.path.display(), error = %e, "cannot open a file channel");
            match e {
                RingError::Unavailable { .. } => BdevError::Unsupported(
                    "io_uring is unavailable (io_uring_setup refused: check the kernel.io_uring_disabled sysctl and seccomp)",
                ),
                other => BdevError::Io(io::Error::from_raw_os_error(other.errno())),
            }
        })?;
        queue.set_enter_counter(self.enters.clone());
        if self.fixed_buffers {
            let arenas = lull_uring::thread_arenas();
            if let Err(e) = queue.register_arenas(&arenas) {
                if !REGISTER_FAILED_LOGGED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(path = %self.path.display(), error = %e, arenas = arenas.len(),
                        memlock_limit_bytes = ?lull_uring::memlock_limit_bytes(),
                        "cannot register the fixed I/O buffers with io_uring; file I/O uses plain READ/WRITE");
                }
            }
        }
        let capacity = queue.capacity();
        Ok(FileChannel {
            buffer_ios: self.buffer_ios.clone(),
            published_ios: (0, 0),
            polled: self.setup.iopoll,
            queue,
            pool: BufPool::new(CHANNEL_POOL_BYTES),
            parked: Vec::with_capacity(capacity),
            size_bytes: self.size_bytes.clone(),
            direct_align_bytes: self.direct_align_bytes,
            punch_hole_ok: true,
            zero_range_ok: true,
        })
    }
}

impl BlockDevice for FileDev {
    fn size_bytes(&self) -> u64 {
        self.size_bytes.load(Ordering::Acquire)
    }

    /// `ftruncate` a regular file up to the new size (sparse; a longer
    /// file keeps its tail, which becomes part of the device), then raise
    /// the size. A block device node grows up to its own size only.
    fn grow(&self, size_bytes: u64) -> Result<(), BdevError> {
        use std::io::{Seek, SeekFrom};
        let _one = self
            .growing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let old = self.size_bytes();
        let meta = self.main.metadata()?;
        let max = if meta.file_type().is_block_device() {
            // The node's size: where its end is.
            (&*self.main).seek(SeekFrom::End(0))?
        } else {
            FILE_SIZE_MAX_BYTES
        };
        check_grow(old, size_bytes, max)?;
        if meta.file_type().is_file() && meta.len() < size_bytes {
            self.main.set_len(size_bytes).map_err(|e| {
                tracing::error!(path = %self.path.display(), to = size_bytes, error = %e, "cannot extend the backing file");
                BdevError::Io(e)
            })?;
        }
        self.size_bytes.store(size_bytes, Ordering::Release);
        tracing::info!(path = %self.path.display(), from = old, to = size_bytes, "file device grown");
        Ok(())
    }

    fn describe(&self) -> String {
        let mut flags = Vec::new();
        if self.direct {
            flags.push("O_DIRECT");
        }
        if self.setup.sqpoll_idle_ms.is_some() {
            flags.push("SQPOLL");
        }
        if self.setup.iopoll {
            flags.push("IOPOLL");
        }
        if !self.fixed_buffers {
            flags.push("fixed=off");
        }
        if self.inline {
            flags.push("inline");
        }
        if flags.is_empty() {
            format!("file:{}", self.path.display())
        } else {
            format!("file:{} ({})", self.path.display(), flags.join(", "))
        }
    }

    fn io_uring_enters(&self) -> Option<u64> {
        Some(self.enters.load(Ordering::Relaxed))
    }

    fn buffer_ios(&self) -> Option<BufferIos> {
        Some(BufferIos {
            fixed: self.buffer_ios.fixed.load(Ordering::Relaxed),
            plain: self.buffer_ios.plain.load(Ordering::Relaxed),
            inline: self.inline_ios.load(Ordering::Relaxed),
        })
    }

    fn sync(&self) -> Result<(), BdevError> {
        self.main.sync_data()?;
        Ok(())
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        if self.inline {
            return Ok(Box::new(InlineChannel::new(
                self.main.clone(),
                self.buffered.clone(),
                self.direct_align_bytes,
                self.size_bytes.clone(),
                self.inline_ios.clone(),
            )));
        }
        Ok(Box::new(self.open_file_channel()?))
    }

    fn extents(
        &self,
        offset: u64,
        len: u64,
        max_extents: usize,
    ) -> Result<Vec<crate::Extent>, BdevError> {
        use crate::{push_extent, Extent};
        let size = self.size_bytes();
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= size && len > 0)
            .ok_or(BdevError::OutOfRange { offset, len, size })?;
        let max = max_extents.max(1);
        let mut out = Vec::new();
        let mut pos = offset;
        while pos < end {
            // (data_start, hole_start) of the next data at or after pos.
            let (data, hole) = match lull_uring::seek_data_hole(&self.main, pos)? {
                Some((data, hole)) => (data.min(end), hole.min(end)),
                None => (end, end),
            };
            if !push_extent(&mut out, Extent::hole(data.saturating_sub(pos)), max) {
                break;
            }
            if !push_extent(&mut out, Extent::data(hole.saturating_sub(data)), max) {
                break;
            }
            if hole <= pos {
                // The kernel said nothing new; never loop on it.
                push_extent(&mut out, Extent::data(end - pos), max);
                break;
            }
            pos = hole;
        }
        if out.is_empty() {
            out.push(Extent::data(len));
        }
        Ok(out)
    }

    /// Zeroing is `fallocate`; a filesystem that refuses it makes the
    /// fast request fail (see the module doc), not slow.
    fn zeroes_fast(&self) -> bool {
        true
    }

    fn prefetch(&self, offset: u64, len: u64) -> Result<(), BdevError> {
        let len = len.min(MAX_PREFETCH_BYTES);
        // Readahead fills the page cache, which only buffered reads use:
        // with O_DIRECT only unaligned requests would see it.
        let file = self.buffered.as_ref().unwrap_or(&self.main);
        lull_uring::fadvise_willneed(file, offset, len)?;
        Ok(())
    }
}

/// What a slot is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Flush,
    /// Trim or WriteZeroes through fallocate.
    Falloc {
        mode: i32,
    },
    /// Trim or WriteZeroes by writing a zero buffer (fallocate refused).
    WriteZeros,
}

/// Per-request state kept in the slot table.
#[derive(Debug)]
struct Op {
    tag: u64,
    /// The request as submitted (to hand it back on `Full`).
    op: IoOp,
    offset: u64,
    len: u64,
    kind: Kind,
    /// Bytes transferred (or zeroed) so far.
    done: u64,
    /// Needs an fdatasync after the data (FUA).
    fua: bool,
    /// The fdatasync (FUA or Flush) has completed.
    synced: bool,
    /// First error seen; the request completes with it.
    error: Option<BdevError>,
    /// The caller's buffer for requests that carry none into the kernel
    /// (Flush/Trim/WriteZeroes), handed back untouched.
    spare_buf: Option<IoBuf>,
}

/// What to do next for a slot.
enum Plan {
    Complete,
    Push([(u32, QueueOp); 2], usize),
}

/// A per-thread channel to a `FileDev`: its own ring and slot table.
#[derive(Debug)]
pub struct FileChannel {
    queue: IoQueue<Op>,
    /// IOPOLL ring: completions appear only when `reap` polls for them.
    polled: bool,
    /// Zero buffers for the WriteZeros fallback.
    pool: BufPool,
    /// Slots whose next operations could not be pushed (SQ full); retried
    /// by `flush_submissions` and `reap`. Capacity = slots: never grows.
    parked: Vec<SlotId>,
    /// The device's size (its `FileDev`'s, shared: a grow shows at once).
    size_bytes: Arc<AtomicU64>,
    /// 0 without O_DIRECT.
    direct_align_bytes: u64,
    punch_hole_ok: bool,
    zero_range_ok: bool,
    /// The device's fixed/plain counters, and how much of the queue's own
    /// counts was added to them (published once per batch, not per I/O).
    buffer_ios: Arc<BufferIoCounters>,
    published_ios: (u64, u64),
}

fn cqe_error(result: i32) -> BdevError {
    BdevError::Io(io::Error::from_raw_os_error(-result))
}

impl FileChannel {
    /// Which descriptor a transfer uses: O_DIRECT only when the file offset,
    /// length and buffer offset are all aligned.
    fn file_for(&self, file_offset: u64, buf_offset: u64, len: u64) -> u32 {
        if uses_main(self.direct_align_bytes, file_offset, buf_offset, len) {
            FILE_MAIN
        } else {
            FILE_BUFFERED
        }
    }

    fn sync_op() -> (u32, QueueOp) {
        (
            KIND_SYNC,
            QueueOp::Fsync {
                file: FILE_MAIN,
                datasync: true,
            },
        )
    }

    /// Decides the next operations of a slot with nothing in flight.
    fn plan(&mut self, slot: SlotId) -> Plan {
        let Some(op) = self.queue.ctx(slot) else {
            return Plan::Complete;
        };
        if op.error.is_some() {
            return Plan::Complete;
        }
        let (kind, offset, len, done, fua, synced) =
            (op.kind, op.offset, op.len, op.done, op.fua, op.synced);
        let nop = (KIND_NOP, QueueOp::Nop);
        let sync_only = |push_sync: bool| {
            if push_sync {
                Plan::Push([Self::sync_op(), nop], 1)
            } else {
                Plan::Complete
            }
        };
        if done >= len {
            return sync_only((fua || kind == Kind::Flush) && !synced);
        }
        let remaining = len - done;
        let data = match kind {
            Kind::Flush => return sync_only(!synced),
            Kind::Falloc { mode } => (
                KIND_FALLOC,
                QueueOp::Fallocate {
                    file: FILE_MAIN,
                    offset: offset + done,
                    len: remaining,
                    mode,
                },
            ),
            Kind::Read | Kind::Write => {
                // len <= u32::MAX: it came from a u32.
                let chunk = remaining.min(u64::from(u32::MAX));
                let file = self.file_for(offset + done, done, chunk);
                let (buf_offset, len32, file_offset) = (done as usize, chunk as u32, offset + done);
                let q = if kind == Kind::Read {
                    QueueOp::Read {
                        file,
                        buf_offset,
                        len: len32,
                        file_offset,
                    }
                } else {
                    QueueOp::Write {
                        file,
                        buf_offset,
                        len: len32,
                        file_offset,
                    }
                };
                (KIND_DATA, q)
            }
            Kind::WriteZeros => {
                if self.queue.buf(slot).is_none() {
                    let mut zeros = self.pool.get(ZERO_BUF_BYTES);
                    zeros.as_mut_slice().fill(0);
                    if let Err(Some(zeros)) = self.queue.replace_buf(slot, Some(zeros)) {
                        // Cannot happen (nothing in flight); keep the buffer.
                        self.pool.put(zeros);
                    }
                }
                let zeros_len = self.queue.buf(slot).map_or(0, |b| b.len()) as u64;
                let chunk = remaining.min(zeros_len);
                if chunk == 0 {
                    if let Some(op) = self.queue.ctx_mut(slot) {
                        op.error = Some(BdevError::BadRequest("no zero buffer"));
                    }
                    return Plan::Complete;
                }
                let file = self.file_for(offset + done, 0, chunk);
                (
                    KIND_DATA,
                    QueueOp::Write {
                        file,
                        buf_offset: 0,
                        len: chunk as u32,
                        file_offset: offset + done,
                    },
                )
            }
        };
        let last_round = match data.1 {
            QueueOp::Read { len, .. } | QueueOp::Write { len, .. } => u64::from(len) == remaining,
            _ => true,
        };
        if fua && last_round {
            Plan::Push([data, Self::sync_op()], 2)
        } else {
            Plan::Push([data, nop], 1)
        }
    }

    /// Pushes the plan's operations; `Ok(true)` when the request is
    /// finished instead. `Err` when the SQ is full.
    fn advance(&mut self, slot: SlotId) -> Result<bool, ()> {
        match self.plan(slot) {
            Plan::Complete => Ok(true),
            Plan::Push(ops, n) => match self.queue.push(slot, &ops[..n]) {
                Ok(()) => Ok(false),
                Err(lull_uring::PushError::SqFull) => Err(()),
                Err(e) => {
                    // A bug in `plan`; fail the request, never the thread.
                    tracing::error!(error = %e, "file channel built a bad io_uring chain");
                    if let Some(op) = self.queue.ctx_mut(slot) {
                        op.error = Some(BdevError::BadRequest("internal: bad io_uring chain"));
                    }
                    Ok(true)
                }
            },
        }
    }

    /// Records one CQE in the slot's state.
    fn on_cqe(&mut self, c: QueueCompletion) {
        let mut fallback = None;
        let Some(op) = self.queue.ctx_mut(c.slot) else {
            return;
        };
        let set_error = |op: &mut Op, e: BdevError| {
            if op.error.is_none() {
                tracing::debug!(tag = op.tag, error = %e, "file request failed");
                op.error = Some(e);
            }
        };
        match c.kind {
            KIND_DATA if c.result < 0 => set_error(op, cqe_error(c.result)),
            KIND_DATA if c.result == 0 => {
                let kind = if op.kind == Kind::Read {
                    io::ErrorKind::UnexpectedEof
                } else {
                    io::ErrorKind::WriteZero
                };
                set_error(op, BdevError::Io(kind.into()));
            }
            KIND_DATA => op.done += c.result as u64,
            // Cancelled because the write before it was short: the next
            // round pushes another sync.
            KIND_SYNC if c.result == -libc::ECANCELED => {}
            KIND_SYNC if c.result < 0 => set_error(op, cqe_error(c.result)),
            KIND_SYNC => op.synced = true,
            KIND_FALLOC
                if c.result == -libc::EOPNOTSUPP
                    && matches!(op.op, IoOp::WriteZeroes { fast: true, .. }) =>
            {
                set_error(
                    op,
                    BdevError::Unsupported(
                        "fast zero: this filesystem cannot zero a range without writing",
                    ),
                )
            }
            KIND_FALLOC if c.result == -libc::EOPNOTSUPP => {
                if let Kind::Falloc { mode } = op.kind {
                    fallback = Some(mode);
                }
                op.kind = Kind::WriteZeros;
            }
            KIND_FALLOC if c.result < 0 => set_error(op, cqe_error(c.result)),
            KIND_FALLOC => op.done = op.len,
            _ => {}
        }
        if let Some(mode) = fallback {
            tracing::info!(
                mode,
                "fallocate mode unsupported here; writing zeros instead"
            );
            if mode & libc::FALLOC_FL_ZERO_RANGE != 0 {
                self.zero_range_ok = false;
            } else {
                self.punch_hole_ok = false;
            }
        }
    }

    /// Frees a finished slot and builds its completion.
    fn finish(&mut self, slot: SlotId) -> Option<IoCompletion> {
        let (op, buf) = self.queue.release(slot)?;
        let buf = match op.kind {
            Kind::Read | Kind::Write => buf,
            _ => {
                // A zero buffer of ours, if any; the caller gets its own back.
                if let Some(zeros) = buf {
                    self.pool.put(zeros);
                }
                op.spare_buf
            }
        };
        Some(IoCompletion {
            tag: op.tag,
            result: op.error.map_or(Ok(()), Err),
            buf,
            data: crate::Data::Buf,
        })
    }

    fn retry_parked(&mut self) {
        while let Some(&slot) = self.parked.last() {
            match self.advance(slot) {
                Err(()) => return, // still full; keep them parked
                Ok(false) => {
                    self.parked.pop();
                }
                Ok(true) => {
                    // Finished without a CQE to deliver it through (only
                    // after an internal error): post a NOP for it.
                    if self.queue.push(slot, &[(KIND_NOP, QueueOp::Nop)]).is_err() {
                        return;
                    }
                    self.parked.pop();
                }
            }
        }
    }

    /// Adds the fixed/plain I/Os pushed since the last call to the
    /// device's counters.
    fn publish_buffer_ios(&mut self) {
        let (fixed, plain) = self.queue.buffer_ios();
        let (was_fixed, was_plain) = self.published_ios;
        if fixed != was_fixed {
            self.buffer_ios
                .fixed
                .fetch_add(fixed - was_fixed, Ordering::Relaxed);
        }
        if plain != was_plain {
            self.buffer_ios
                .plain
                .fetch_add(plain - was_plain, Ordering::Relaxed);
        }
        self.published_ios = (fixed, plain);
    }

    /// Arenas this channel's ring registered (0: plain I/O only).
    pub fn registered_arenas(&self) -> usize {
        self.queue.registered_arenas()
    }

    /// Checks the slot table (debug builds and tests).
    pub fn check_invariants(&self) {
        self.queue.check_invariants();
        assert!(self.parked.len() <= self.queue.in_use());
    }
}

impl Drop for FileChannel {
    fn drop(&mut self) {
        self.publish_buffer_ios();
    }
}

impl Channel for FileChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        let capacity = self.queue.capacity();
        if self.queue.in_use() >= capacity {
            return Err((req, BdevError::Full { capacity }));
        }
        let error = validate_request(&req, self.size_bytes.load(Ordering::Acquire)).err();
        let IoRequest {
            tag,
            op,
            offset,
            len,
            buf,
        } = req;
        let (kind, fua) = match op {
            // Refused below: `FileDev::extents` answers inline.
            IoOp::BlockStatus | IoOp::ChangedSince => (Kind::Flush, false),
            IoOp::Read => (Kind::Read, false),
            IoOp::Write { fua } => (Kind::Write, fua),
            IoOp::Flush => (Kind::Flush, false),
            IoOp::Trim => (
                Kind::Falloc {
                    mode: libc::FALLOC_FL_PUNCH_HOLE,
                },
                false,
            ),
            IoOp::WriteZeroes {
                no_hole: false,
                fua,
                ..
            } => (
                Kind::Falloc {
                    mode: libc::FALLOC_FL_PUNCH_HOLE,
                },
                fua,
            ),
            IoOp::WriteZeroes {
                no_hole: true, fua, ..
            } => (
                Kind::Falloc {
                    mode: libc::FALLOC_FL_ZERO_RANGE,
                },
                fua,
            ),
        };
        let kind = match kind {
            Kind::Falloc { mode } => {
                let ok = if mode == libc::FALLOC_FL_ZERO_RANGE {
                    self.zero_range_ok
                } else {
                    self.punch_hole_ok
                };
                if ok {
                    Kind::Falloc {
                        mode: mode | libc::FALLOC_FL_KEEP_SIZE,
                    }
                } else {
                    Kind::WriteZeros
                }
            }
            k => k,
        };
        let fast = matches!(op, IoOp::WriteZeroes { fast: true, .. });
        let error = match kind {
            Kind::WriteZeros if fast && error.is_none() => Some(BdevError::Unsupported(
                "fast zero: this filesystem cannot zero a range without writing",
            )),
            _ if op == IoOp::BlockStatus => Some(BdevError::Unsupported(
                "block status of a file device: BlockDevice::extents answers it",
            )),
            _ if op == IoOp::ChangedSince => {
                Some(BdevError::Unsupported("a file device has no snapshots"))
            }
            _ => error,
        };
        let (slot_buf, spare_buf) = match kind {
            Kind::Read | Kind::Write => (buf, None),
            _ => (None, buf),
        };
        let ctx = Op {
            tag,
            op,
            offset,
            len: if kind == Kind::Flush {
                0
            } else {
                u64::from(len)
            },
            kind,
            done: 0,
            fua,
            synced: false,
            error,
            spare_buf,
        };
        let hand_back = |op: Op, slot_buf: Option<IoBuf>, capacity| {
            let req = IoRequest {
                tag: op.tag,
                op: op.op,
                offset: op.offset,
                len,
                buf: slot_buf.or(op.spare_buf),
            };
            (req, BdevError::Full { capacity })
        };
        let slot = match self.queue.alloc(ctx, slot_buf) {
            Ok(slot) => slot,
            Err((op, slot_buf)) => return Err(hand_back(op, slot_buf, capacity)),
        };
        let pushed = match self.advance(slot) {
            Ok(false) => Ok(()),
            // Nothing to do (zero length, or invalid): complete through a
            // NOP so the completion arrives by the ring and its eventfd.
            Ok(true) => self
                .queue
                .push(slot, &[(KIND_NOP, QueueOp::Nop)])
                .map_err(|_| ()),
            Err(()) => Err(()),
        };
        if pushed.is_err() {
            // SQ full even after submitting: back-pressure.
            return match self.queue.release(slot) {
                Some((op, slot_buf)) => Err(hand_back(op, slot_buf, capacity)),
                None => Ok(()), // unreachable: nothing was pushed
            };
        }
        Ok(())
    }

    fn flush_submissions(&mut self) {
        if !self.parked.is_empty() {
            self.retry_parked();
        }
        if let Err(e) = self.queue.submit() {
            tracing::error!(error = %e, "io_uring submit failed; will retry on the next flush");
        }
        self.publish_buffer_ios();
    }

    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        if self.polled && self.queue.pending_total() > 0 {
            // An IOPOLL ring posts completions only when asked: an enter
            // with GETEVENTS (which `submit` does on such a ring) polls
            // the device.
            if let Err(e) = self.queue.submit() {
                tracing::error!(error = %e, "io_uring completion poll failed");
            }
        }
        // Drain the eventfd before reading the CQ, so a CQE posted in
        // between re-arms it rather than being missed.
        self.queue.drain_event_fd();
        let mut delivered = 0;
        let mut pushed = false;
        while let Some(c) = self.queue.next_completion() {
            self.on_cqe(c);
            if self.queue.pending(c.slot) > 0 {
                continue; // the rest of its chain is still coming
            }
            match self.advance(c.slot) {
                Ok(true) => {
                    if let Some(completion) = self.finish(c.slot) {
                        done(completion);
                        delivered += 1;
                    }
                }
                Ok(false) => pushed = true,
                Err(()) => self.parked.push(c.slot),
            }
        }
        if !self.parked.is_empty() {
            self.retry_parked();
            pushed = true;
        }
        if pushed {
            // Continuations (short transfers, FUA syncs, zero rounds) go to
            // the kernel now, without waiting for the caller's next flush.
            if let Err(e) = self.queue.submit() {
                tracing::error!(error = %e, "io_uring submit of continuations failed");
            }
        }
        self.publish_buffer_ios();
        #[cfg(debug_assertions)]
        self.check_invariants();
        delivered
    }

    fn event_fd(&self) -> Option<RawFd> {
        // An IOPOLL ring's eventfd fires only after `reap` polled: nothing
        // to wait on. Its owner polls instead (`polled`).
        (!self.polled).then(|| self.queue.event_fd())
    }

    fn polled(&self) -> bool {
        self.polled
    }

    fn in_flight(&self) -> usize {
        self.queue.in_use()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A unique temp directory, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        /// In TMPDIR.
        fn new(tag: &str) -> TempDir {
            let base = std::env::temp_dir();
            TempDir::under(&base, tag)
                .unwrap_or_else(|e| panic!("create a temp dir in {}: {e}", base.display()))
        }

        fn under(base: &Path, tag: &str) -> io::Result<TempDir> {
            use std::sync::atomic::{AtomicU32, Ordering};
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let path = base.join(format!(
                "lull-bdev-{tag}-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&path)?;
            Ok(TempDir(path))
        }

        /// For a test of the O_DIRECT path: in the first of TMPDIR,
        /// /var/tmp and the workspace's target directory whose
        /// filesystem accepts O_DIRECT (ramfs, tmpfs before Linux 6.6 and
        /// some FUSE and network filesystems refuse it). If none does,
        /// the test fails naming each refusal: a direct case that passed
        /// without running would hide the path it exists to check.
        fn for_direct(tag: &str) -> TempDir {
            let bases = [
                std::env::temp_dir(),
                PathBuf::from("/var/tmp"),
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"),
            ];
            let mut refusals = Vec::new();
            for base in &bases {
                match TempDir::under(base, tag).and_then(|dir| dir.probe_direct().map(|()| dir)) {
                    Ok(dir) => {
                        if !refusals.is_empty() {
                            eprintln!(
                                "note: O_DIRECT refused on {}; running on {}",
                                refusals.join(", "),
                                dir.0.display()
                            );
                        }
                        return dir;
                    }
                    Err(e) => refusals.push(format!("{} ({e})", base.display())),
                }
            }
            panic!(
                "this O_DIRECT test cannot run: O_DIRECT refused on {}; point TMPDIR at \
                 a filesystem that accepts O_DIRECT (ext4, xfs, btrfs)",
                refusals.join(", ")
            )
        }

        /// [`TempDir::for_direct`] for a direct case, else [`TempDir::new`].
        fn for_io(tag: &str, direct: bool) -> TempDir {
            if direct {
                TempDir::for_direct(tag)
            } else {
                TempDir::new(tag)
            }
        }

        /// Whether a file here opens with O_DIRECT, as `FileDev::open`
        /// opens it.
        fn probe_direct(&self) -> io::Result<()> {
            let path = self.0.join("o_direct-probe");
            let opened = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path);
            let _ = std::fs::remove_file(&path);
            opened.map(drop)
        }

        fn file(&self) -> PathBuf {
            self.0.join("vol")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Opens a device. A filesystem that refuses O_DIRECT fails the test
    /// with a message: a direct case that passed without running would
    /// hide the path it exists to check (direct cases make `dir` with
    /// [`TempDir::for_direct`], which looks for a filesystem that accepts
    /// it). The io_uring channel always (`inline=off`), wherever TMPDIR is.
    fn open(dir: &TempDir, size: u64, direct: bool) -> FileDev {
        let ring = RingOptions {
            inline: crate::Inline::Off,
            ..RingOptions::default()
        };
        match FileDev::open(
            dir.file(),
            size,
            FileOptions {
                direct,
                create: true,
                ring,
            },
        ) {
            Ok(dev) => dev,
            Err(BdevError::Unsupported(why)) if direct => panic!(
                "this O_DIRECT test cannot run: {why} ({}); point TMPDIR at a \
                 filesystem that accepts O_DIRECT (ext4, xfs, btrfs)",
                dir.0.display()
            ),
            Err(e) => panic!("open {}: {e}", dir.file().display()),
        }
    }

    /// Submits `reqs`, flushes once and waits (on the eventfd) for all
    /// completions, sorted by tag.
    fn run_all(ch: &mut dyn Channel, reqs: Vec<IoRequest>) -> Vec<IoCompletion> {
        let want = reqs.len();
        for req in reqs {
            ch.submit(req).map_err(|(_, e)| e).expect("submit");
        }
        ch.flush_submissions();
        let mut out = Vec::with_capacity(want);
        if ch.polled() {
            // IOPOLL: no fd; reaping polls the device.
            assert!(ch.event_fd().is_none());
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while out.len() < want {
                ch.reap(&mut |c| out.push(c));
                assert!(
                    std::time::Instant::now() < deadline,
                    "timed out polling for I/O"
                );
            }
            out.sort_by_key(|c| c.tag);
            return out;
        }
        let Some(fd) = ch.event_fd() else {
            // Inline: everything completes at the first reap.
            ch.reap(&mut |c| out.push(c));
            assert_eq!(out.len(), want, "an inline channel completes at reap");
            assert_eq!(ch.in_flight(), 0, "slot leak");
            out.sort_by_key(|c| c.tag);
            return out;
        };
        while out.len() < want {
            if ch.reap(&mut |c| out.push(c)) == 0 {
                assert!(
                    lull_uring::wait_readable(fd, 10_000).expect("poll"),
                    "timed out waiting for I/O"
                );
            }
        }
        assert_eq!(ch.in_flight(), 0, "slot leak");
        out.sort_by_key(|c| c.tag);
        out
    }

    fn run(
        ch: &mut dyn Channel,
        op: IoOp,
        offset: u64,
        len: u32,
        buf: Option<IoBuf>,
    ) -> IoCompletion {
        run_all(
            ch,
            vec![IoRequest {
                tag: 0,
                op,
                offset,
                len,
                buf,
            }],
        )
        .pop()
        .expect("one")
    }

    fn write(ch: &mut dyn Channel, pool: &mut BufPool, offset: u64, data: &[u8], fua: bool) {
        let mut buf = pool.get(data.len());
        buf.as_mut_slice().copy_from_slice(data);
        let c = run(
            ch,
            IoOp::Write { fua },
            offset,
            data.len() as u32,
            Some(buf),
        );
        c.result.expect("write");
        pool.put(c.buf.expect("buffer back"));
    }

    fn read(ch: &mut dyn Channel, pool: &mut BufPool, offset: u64, len: usize) -> Vec<u8> {
        let c = run(ch, IoOp::Read, offset, len as u32, Some(pool.get(len)));
        c.result.expect("read");
        let buf = c.buf.expect("buffer back");
        let v = buf.as_slice()[..len].to_vec();
        pool.put(buf);
        v
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1)
            .collect()
    }

    fn round_trip(direct: bool) {
        let dir = TempDir::for_io("rt", direct);
        let dev = open(&dir, 8 << 20, direct);
        round_trip_on(&dir, &dev);
    }

    /// Writes and reads back aligned, unaligned and large ranges of an
    /// 8 MiB `dev` (in `dir`), then checks the file itself.
    fn round_trip_on(dir: &TempDir, dev: &FileDev) {
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(64 << 20);
        // Aligned, unaligned, and large (over the 1 MiB zero buffer).
        let cases: [(u64, usize); 5] = [
            (0, 4096),
            (4096 * 3, 65536),
            (12345, 777),
            (1 << 20, 3 << 20),
            (511, 4097),
        ];
        for (i, &(offset, len)) in cases.iter().enumerate() {
            let data = pattern(len, i as u8);
            write(&mut *ch, &mut pool, offset, &data, i % 2 == 0);
            assert_eq!(read(&mut *ch, &mut pool, offset, len), data, "case {i}");
        }
        // Never-written space reads as zeros.
        assert!(read(&mut *ch, &mut pool, 6 << 20, 1 << 20)
            .iter()
            .all(|&b| b == 0));
        // Flush, then the data is in the file for anyone to read.
        run(&mut *ch, IoOp::Flush, 0, 0, None)
            .result
            .expect("flush");
        let on_disk = std::fs::read(dir.file()).expect("read file");
        assert_eq!(on_disk.len(), 8 << 20);
        assert_eq!(&on_disk[12345..12345 + 777], &pattern(777, 2)[..]);
        assert_eq!(&on_disk[511..511 + 4097], &pattern(4097, 4)[..]);
    }

    #[test]
    fn round_trip_buffered() {
        round_trip(false);
    }

    #[test]
    fn round_trip_direct() {
        round_trip(true);
    }

    /// Grow with a channel open: the file is extended, the new tail reads
    /// as zeros and takes aligned (direct) and unaligned writes through
    /// the old channel; shrinking, odd sizes and too big are refused.
    fn grow(direct: bool) {
        let dir = TempDir::for_io("grow", direct);
        let old = 1 << 20;
        let dev = open(&dir, old, direct);
        let mut ch = dev.open_channel().expect("channel (io_uring)");
        let mut pool = BufPool::new(8 << 20);
        write(&mut *ch, &mut pool, old - 4096, &pattern(4096, 1), false);
        let c = run(&mut *ch, IoOp::Read, old, 4096, Some(pool.get(4096)));
        assert!(matches!(c.result, Err(BdevError::OutOfRange { .. })));
        pool.put(c.buf.expect("buffer back"));
        let new = 3 << 20;
        dev.grow(new).expect("grow");
        assert_eq!(dev.size_bytes(), new);
        assert_eq!(std::fs::metadata(dir.file()).unwrap().len(), new);
        assert!(read(&mut *ch, &mut pool, old, 8192).iter().all(|&b| b == 0));
        write(&mut *ch, &mut pool, new - 4096, &pattern(4096, 2), true);
        write(&mut *ch, &mut pool, old + 3, &pattern(100, 3), false);
        assert_eq!(
            read(&mut *ch, &mut pool, new - 4096, 4096),
            pattern(4096, 2)
        );
        assert_eq!(read(&mut *ch, &mut pool, old + 3, 100), pattern(100, 3));
        assert_eq!(
            read(&mut *ch, &mut pool, old - 4096, 4096),
            pattern(4096, 1)
        );
        assert!(dev.extents(old, new - old, 8).is_ok());
        assert!(matches!(dev.grow(old), Err(BdevError::Shrink { .. })));
        assert!(matches!(
            dev.grow(new + 512),
            Err(BdevError::ResizeUnaligned { .. })
        ));
        assert!(matches!(
            dev.grow(FILE_SIZE_MAX_BYTES + 1),
            Err(BdevError::TooLarge { .. })
        ));
        assert_eq!(dev.size_bytes(), new);
        dev.grow(new).expect("the same size is a no-op");
    }

    #[test]
    fn grow_buffered() {
        grow(false);
    }

    #[test]
    fn grow_direct() {
        grow(true);
    }

    fn zeroing(direct: bool, fallocate: bool) {
        let dir = TempDir::for_io("zero", direct);
        let dev = open(&dir, 4 << 20, direct);
        let mut ch = dev.open_file_channel().expect("channel");
        if !fallocate {
            // As if the filesystem had refused both modes.
            ch.punch_hole_ok = false;
            ch.zero_range_ok = false;
        }
        zeroing_on(&dir, &mut ch);
    }

    /// Trims and zeroes ranges of a 4 MiB device's channel `ch` and checks
    /// the data read back and the file (in `dir`).
    fn zeroing_on(dir: &TempDir, ch: &mut dyn Channel) {
        let mut pool = BufPool::new(64 << 20);
        let data = pattern(4 << 20, 9);
        write(&mut *ch, &mut pool, 0, &data, false);
        let mut oracle = data.clone();
        let ops = [
            (IoOp::Trim, 100u64, 10_000u32),
            (
                IoOp::WriteZeroes {
                    no_hole: false,
                    fua: false,
                    fast: false,
                },
                65536,
                65536,
            ),
            (
                IoOp::WriteZeroes {
                    no_hole: true,
                    fua: true,
                    fast: false,
                },
                200_001,
                1_500_000,
            ),
            (
                IoOp::WriteZeroes {
                    no_hole: true,
                    fua: false,
                    fast: false,
                },
                3 << 20,
                4096,
            ),
        ];
        for (op, offset, len) in ops {
            let c = run(&mut *ch, op, offset, len, None);
            c.result.unwrap_or_else(|e| panic!("{op:?}: {e}"));
            oracle[offset as usize..(offset + u64::from(len)) as usize].fill(0);
        }
        assert!(read(&mut *ch, &mut pool, 0, 4 << 20) == oracle);
        assert_eq!(ch.in_flight(), 0);
        run(&mut *ch, IoOp::Flush, 0, 0, None)
            .result
            .expect("flush");
        assert!(std::fs::read(dir.file()).expect("read file") == oracle);
        // A passed-in buffer comes back untouched with the completion.
        let c = run(&mut *ch, IoOp::Trim, 0, 10, Some(pool.get(10)));
        assert_eq!(c.buf.map(|b| b.len()), Some(10));
    }

    #[test]
    fn trim_and_write_zeroes_buffered() {
        zeroing(false, true);
    }

    #[test]
    fn trim_and_write_zeroes_direct() {
        zeroing(true, true);
    }

    #[test]
    fn write_zeroes_fallback_writes_zeros() {
        zeroing(false, false);
        zeroing(true, false);
    }

    #[test]
    fn zero_range_refused_by_tmpfs_falls_back() {
        // tmpfs has PUNCH_HOLE but no ZERO_RANGE: the EOPNOTSUPP path.
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("note: no /dev/shm; skipping the tmpfs fallback case");
            return;
        }
        let dir = TempDir(shm.join(format!("lull-bdev-shm-{}", std::process::id())));
        std::fs::create_dir_all(&dir.0).expect("mkdir in /dev/shm");
        let dev = open(&dir, 1 << 20, false);
        let mut ch = dev.open_file_channel().expect("channel");
        let mut pool = BufPool::new(8 << 20);
        write(&mut ch, &mut pool, 0, &[5u8; 8192], false);
        let op = IoOp::WriteZeroes {
            no_hole: true,
            fua: true,
            fast: false,
        };
        run(&mut ch, op, 100, 5000, None)
            .result
            .expect("write zeroes");
        let v = read(&mut ch, &mut pool, 0, 8192);
        assert!(
            v[..100].iter().all(|&b| b == 5)
                && v[100..5100].iter().all(|&b| b == 0)
                && v[5100..].iter().all(|&b| b == 5)
        );
        eprintln!(
            "tmpfs zero_range_ok after the request: {}",
            ch.zero_range_ok
        );
    }

    #[test]
    fn extents_show_holes_and_data() {
        use crate::Extent;
        let dir = TempDir::new("ext");
        let dev = open(&dir, 8 << 20, false);
        let size = dev.size_bytes();
        assert_eq!(dev.extents(0, size, 16).unwrap(), [Extent::hole(size)]);
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(8 << 20);
        write(&mut *ch, &mut pool, 1 << 20, &[7u8; 1 << 20], false);
        write(&mut *ch, &mut pool, 5 << 20, &[7u8; 4096], false);
        let map = dev.extents(0, size, 16).unwrap();
        // Filesystems allocate in blocks; 1 MiB and 4 KiB aligned writes
        // are whole blocks everywhere lull runs.
        assert_eq!(
            map,
            [
                Extent::hole(1 << 20),
                Extent::data(1 << 20),
                Extent::hole(3 << 20),
                Extent::data(4096),
                Extent::hole((3 << 20) - 4096),
            ]
        );
        assert_eq!(map.iter().map(|e| e.length_bytes).sum::<u64>(), size);
        assert_eq!(dev.extents(0, size, 2).unwrap(), map[..2]);
        assert_eq!(
            dev.extents((1 << 20) + 1, 10, 16).unwrap(),
            [Extent::data(10)]
        );
        assert!(dev.extents(size - 1, 2, 16).is_err());
        // Punching makes it a hole again; prefetch is only advice.
        let zero = IoOp::WriteZeroes {
            no_hole: false,
            fua: false,
            fast: true,
        };
        run(&mut *ch, zero, 1 << 20, 1 << 20, None)
            .result
            .expect("fast zero");
        assert_eq!(
            dev.extents(0, 4 << 20, 16).unwrap(),
            [Extent::hole(4 << 20)]
        );
        dev.prefetch(0, u64::from(u32::MAX)).expect("prefetch");
        assert!(dev.zeroes_fast());
    }

    #[test]
    fn fast_zero_never_writes_zeros() {
        // tmpfs has no ZERO_RANGE: a fast NO_HOLE zero fails, before and
        // after the channel learnt it.
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            eprintln!("note: no /dev/shm; skipping the tmpfs fast zero case");
            return;
        }
        let dir = TempDir(shm.join(format!("lull-bdev-fz-{}", std::process::id())));
        std::fs::create_dir_all(&dir.0).expect("mkdir in /dev/shm");
        let dev = open(&dir, 1 << 20, false);
        let mut ch = dev.open_file_channel().expect("channel");
        let mut pool = BufPool::new(8 << 20);
        write(&mut ch, &mut pool, 0, &[5u8; 8192], false);
        let fast = IoOp::WriteZeroes {
            no_hole: true,
            fua: false,
            fast: true,
        };
        for _ in 0..2 {
            let c = run(&mut ch, fast, 0, 4096, None);
            assert!(
                matches!(c.result, Err(BdevError::Unsupported(_))),
                "{:?}",
                c.result
            );
            assert!(read(&mut ch, &mut pool, 0, 4096).iter().all(|&b| b == 5));
            let slow = IoOp::WriteZeroes {
                no_hole: true,
                fua: false,
                fast: false,
            };
            run(&mut ch, slow, 8000, 10, None)
                .result
                .expect("slow zero");
        }
        // Punching a hole is fast on tmpfs.
        let punch = IoOp::WriteZeroes {
            no_hole: false,
            fua: false,
            fast: true,
        };
        run(&mut ch, punch, 0, 4096, None)
            .result
            .expect("fast punch");
        assert!(read(&mut ch, &mut pool, 0, 4096).iter().all(|&b| b == 0));
    }

    #[test]
    fn bad_requests_complete_with_errors() {
        let dir = TempDir::new("bad");
        let dev = open(&dir, 1 << 20, false);
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(1 << 20);
        let reqs = vec![
            IoRequest {
                tag: 1,
                op: IoOp::Read,
                offset: (1 << 20) - 10,
                len: 20,
                buf: Some(pool.get(20)),
            },
            IoRequest {
                tag: 2,
                op: IoOp::Write { fua: true },
                offset: u64::MAX,
                len: 1,
                buf: Some(pool.get(1)),
            },
            IoRequest {
                tag: 3,
                op: IoOp::Trim,
                offset: 2 << 20,
                len: 0,
                buf: None,
            },
            IoRequest {
                tag: 4,
                op: IoOp::Read,
                offset: 0,
                len: 10,
                buf: None,
            },
            IoRequest {
                tag: 5,
                op: IoOp::Write { fua: false },
                offset: 0,
                len: 10,
                buf: Some(pool.get(9)),
            },
            IoRequest {
                tag: 6,
                op: IoOp::Read,
                offset: 1 << 20,
                len: 0,
                buf: Some(pool.get(0)),
            },
        ];
        let out = run_all(&mut *ch, reqs);
        assert!(matches!(out[0].result, Err(BdevError::OutOfRange { .. })));
        assert!(out[0].buf.is_some());
        assert!(matches!(out[1].result, Err(BdevError::OutOfRange { .. })));
        assert!(matches!(out[2].result, Err(BdevError::OutOfRange { .. })));
        assert!(matches!(out[3].result, Err(BdevError::BadRequest(_))));
        assert!(matches!(out[4].result, Err(BdevError::BadRequest(_))));
        assert!(out[5].result.is_ok());
        // Nothing was written.
        assert!(std::fs::read(dir.file())
            .expect("read")
            .iter()
            .all(|&b| b == 0));
    }

    #[test]
    fn truncated_file_gives_an_error_not_a_panic() {
        let dir = TempDir::new("eof");
        let dev = open(&dir, 1 << 20, false);
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(1 << 20);
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.file())
            .unwrap()
            .set_len(4096)
            .unwrap();
        let c = run(&mut *ch, IoOp::Read, 0, 8192, Some(pool.get(8192)));
        // The first 4096 bytes arrive, then the resubmitted remainder hits EOF.
        assert!(
            matches!(&c.result, Err(BdevError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof)
        );
        assert_eq!(c.result.unwrap_err().errno(), libc::EIO);
    }

    #[test]
    fn full_channel_returns_full_and_drains() {
        let dir = TempDir::new("full");
        let dev = open(&dir, 1 << 20, false);
        let mut ch = dev.open_file_channel().expect("channel");
        let mut pool = BufPool::new(8 << 20);
        let depth = FILE_CHANNEL_DEPTH as u64;
        for tag in 0..depth {
            let mut buf = pool.get(4096);
            buf.as_mut_slice().fill(tag as u8);
            let req = IoRequest {
                tag,
                op: IoOp::Write { fua: false },
                offset: (tag % 256) * 4096,
                len: 4096,
                buf: Some(buf),
            };
            ch.submit(req).map_err(|(_, e)| e).expect("room");
        }
        assert_eq!(ch.in_flight(), FILE_CHANNEL_DEPTH as usize);
        let (req, err) = ch
            .submit(IoRequest {
                tag: 999,
                op: IoOp::Read,
                offset: 0,
                len: 4096,
                buf: Some(pool.get(4096)),
            })
            .expect_err("full");
        assert_eq!(req.tag, 999);
        assert!(req.buf.is_some());
        assert!(
            matches!(err, BdevError::Full { capacity } if capacity == FILE_CHANNEL_DEPTH as usize)
        );
        assert_eq!(err.errno(), libc::EAGAIN);
        ch.flush_submissions();
        let mut n = 0;
        while n < depth as usize {
            let got = ch.reap(&mut |c| {
                c.result.expect("write");
                pool.put(c.buf.expect("buf"));
            });
            if got == 0 {
                assert!(lull_uring::wait_readable(ch.event_fd().unwrap(), 10_000).unwrap());
            }
            n += got;
        }
        assert_eq!(ch.in_flight(), 0);
        ch.check_invariants();
        // With nothing in flight, one more reap leaves the eventfd drained
        // (the kernel may ring it just after a reap that already took the
        // last completion: a spurious wake-up, never a lost one).
        assert_eq!(ch.reap(&mut |_| panic!("nothing is in flight")), 0);
        assert!(!lull_uring::wait_readable(ch.event_fd().unwrap(), 0).unwrap());
        // The buffers were reused: one allocation per buffer ever in flight.
        assert!(pool.stats().allocations <= depth + 1);
    }

    #[test]
    fn steady_state_allocates_no_buffers() {
        let dir = TempDir::new("steady");
        let dev = open(&dir, 1 << 20, false);
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(8 << 20);
        for round in 0..50u64 {
            let reqs = (0..16)
                .map(|i| IoRequest {
                    tag: i,
                    op: IoOp::Write {
                        fua: round % 10 == 0,
                    },
                    offset: i * 4096,
                    len: 4096,
                    buf: Some(pool.get(4096)),
                })
                .collect();
            for c in run_all(&mut *ch, reqs) {
                c.result.expect("write");
                pool.put(c.buf.expect("buf"));
            }
        }
        assert_eq!(pool.stats().allocations, 16);
    }

    #[test]
    fn dropping_a_channel_with_io_in_flight_is_safe() {
        let dir = TempDir::new("drop");
        let dev = open(&dir, 8 << 20, false);
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(64 << 20);
        for tag in 0..8 {
            let req = IoRequest {
                tag,
                op: IoOp::Read,
                offset: 0,
                len: 1 << 20,
                buf: Some(pool.get(1 << 20)),
            };
            ch.submit(req).map_err(|(_, e)| e).expect("submit");
        }
        ch.flush_submissions();
        drop(ch); // waits for the kernel before freeing the buffers
    }

    #[test]
    fn sub_block_writes_from_two_channels_merge() {
        let dir = TempDir::new("merge");
        let dev = open(&dir, 1 << 20, true);
        std::thread::scope(|s| {
            for t in 0..2u64 {
                let dev = &dev;
                s.spawn(move || {
                    let mut ch = dev.open_channel().expect("channel");
                    let mut pool = BufPool::new(1 << 20);
                    let reqs = (0..64)
                        .map(|i| {
                            let mut buf = pool.get(512);
                            buf.as_mut_slice().fill(t as u8 + 1);
                            IoRequest {
                                tag: i,
                                op: IoOp::Write { fua: false },
                                offset: (i * 2 + t) * 512,
                                len: 512,
                                buf: Some(buf),
                            }
                        })
                        .collect();
                    for c in run_all(&mut *ch, reqs) {
                        c.result.expect("write");
                    }
                });
            }
        });
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(1 << 20);
        let v = read(&mut *ch, &mut pool, 0, 128 * 512);
        for (i, sector) in v.chunks(512).enumerate() {
            assert!(sector.iter().all(|&b| b == (i % 2) as u8 + 1), "sector {i}");
        }
    }

    #[test]
    fn direct_channel_routes_only_aligned_io_to_o_direct() {
        let dir = TempDir::for_direct("route");
        let dev = open(&dir, 1 << 20, true);
        let a = dev.direct_align_bytes().expect("direct");
        assert!(a > 0 && a <= 4096, "alignment {a}");
        let ch = dev.open_file_channel().expect("channel");
        assert_eq!(ch.file_for(0, 0, 4096), FILE_MAIN);
        assert_eq!(ch.file_for(8192, 4096, 65536), FILE_MAIN);
        assert_eq!(ch.file_for(1, 0, 4096), FILE_BUFFERED);
        assert_eq!(ch.file_for(0, 0, 4095), FILE_BUFFERED);
        assert_eq!(ch.file_for(4096, 7, 4096), FILE_BUFFERED);
        let plain = FileDev::open(
            dir.0.join("plain"),
            4096,
            FileOptions {
                direct: false,
                create: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            plain.open_file_channel().unwrap().file_for(1, 1, 1),
            FILE_MAIN
        );
    }

    fn open_with(dir: &TempDir, direct: bool, flags: &str) -> Result<FileDev, BdevError> {
        open_sized(dir, 1 << 20, direct, flags)
    }

    /// Opens (creating) a device of `size` in `dir` with `flags` as in a
    /// `file=` spec.
    fn open_sized(
        dir: &TempDir,
        size: u64,
        direct: bool,
        flags: &str,
    ) -> Result<FileDev, BdevError> {
        let mut d = direct;
        let ring = RingOptions::parse_list(flags, &mut d).expect("flags parse");
        FileDev::open(
            dir.file(),
            size,
            FileOptions {
                direct: d,
                create: true,
                ring,
            },
        )
    }

    /// Writes a pattern through a channel of `dev` and reads it back.
    fn write_read_back(dev: &FileDev) {
        let mut pool = BufPool::new(1 << 20);
        let mut ch = dev.open_channel().expect("channel");
        let data = pattern(65536, 9);
        write(ch.as_mut(), &mut pool, 8192, &data, true);
        assert_eq!(read(ch.as_mut(), &mut pool, 8192, data.len()), data);
    }

    #[test]
    fn sqpoll_works_and_io_uring_enters_are_counted() {
        let dir = TempDir::for_direct("sqpoll");
        // The same work on a plain ring: an enter per submit.
        let plain = open_with(&dir, false, "").unwrap();
        write_read_back(&plain);
        let plain_enters = plain
            .io_uring_enters()
            .expect("a file device counts enters");
        assert!(
            plain_enters >= 2,
            "{plain_enters} enters for a write and a read"
        );
        for direct in [false, true] {
            let dev = match open_with(&dir, direct, "sqpoll=5") {
                Ok(dev) => dev,
                Err(e) => panic!("sqpoll (direct: {direct}) refused: {e}"),
            };
            assert_eq!(dev.is_direct(), direct);
            assert!(dev.describe().contains("SQPOLL"), "{}", dev.describe());
            write_read_back(&dev);
            // The SQ thread takes submissions while awake: enters happen
            // only to wake it, never more than one per submit.
            let enters = dev.io_uring_enters().unwrap();
            assert!(
                enters <= plain_enters,
                "sqpoll {enters} > plain {plain_enters}"
            );
        }
    }

    #[test]
    fn iopoll_needs_direct_and_a_polling_device() {
        let dir = TempDir::for_direct("iopoll");
        for flags in ["iopoll", "hybrid_iopoll"] {
            match open_with(&dir, false, flags) {
                Err(BdevError::OptionRefused { option, reason }) => {
                    assert_eq!(option, flags);
                    assert!(reason.contains("O_DIRECT"), "{reason}");
                }
                other => panic!("{flags} without direct: {other:?}"),
            }
            match open_with(&dir, true, flags) {
                Err(BdevError::OptionRefused { option, reason }) => {
                    // This VM's disk has no poll queues; a tmpfs temp dir
                    // has no block device at all.
                    assert_eq!(option, flags);
                    eprintln!("{flags} refused, as expected here: {reason}");
                    assert!(
                        reason.contains("poll queues")
                            || reason.contains("not on a block device")
                            || reason.contains("6.13"),
                        "{reason}"
                    );
                    let e = BdevError::OptionRefused { option, reason };
                    assert!(e
                        .to_string()
                        .starts_with(&format!("option {flags} refused: ")));
                }
                Ok(dev) => {
                    // A device with poll queues: the ring is polled.
                    assert!(dev.open_channel().unwrap().polled());
                    write_read_back(&dev);
                }
                Err(e) => panic!("{flags}: unexpected error {e}"),
            }
        }
        // auto never fails for the device's sake: it falls back.
        match open_with(&dir, true, "iopoll=auto") {
            Ok(dev) => {
                assert!(dev.is_direct());
                write_read_back(&dev);
            }
            Err(e) => panic!("iopoll=auto: {e}"),
        }
        let dev = open_with(&dir, false, "iopoll=auto").expect("auto without direct falls back");
        assert!(!dev.open_channel().unwrap().polled());
        write_read_back(&dev);
    }

    #[test]
    fn open_rules() {
        let dir = TempDir::new("open");
        let missing = FileDev::open(
            dir.file(),
            4096,
            FileOptions {
                direct: false,
                create: false,
                ..Default::default()
            },
        );
        assert!(
            matches!(missing, Err(BdevError::Io(ref e)) if e.kind() == io::ErrorKind::NotFound)
        );
        std::fs::write(dir.file(), [7u8; 100]).unwrap();
        let dev = FileDev::open(dir.file(), 8192, FileOptions::default()).expect("extend");
        assert_eq!(std::fs::metadata(dir.file()).unwrap().len(), 8192);
        drop(dev);
        let dev = FileDev::open(dir.file(), 4096, FileOptions::default()).expect("shrink view");
        assert_eq!(dev.size_bytes(), 4096);
        assert_eq!(
            std::fs::metadata(dir.file()).unwrap().len(),
            8192,
            "tail left alone"
        );
        assert!(dev.describe().starts_with("file:"));
    }

    #[derive(Debug, Clone)]
    enum Step {
        Write {
            offset: u64,
            len: usize,
            seed: u8,
            fua: bool,
        },
        Trim {
            offset: u64,
            len: usize,
        },
        Zero {
            offset: u64,
            len: usize,
            no_hole: bool,
        },
        Read {
            offset: u64,
            len: usize,
        },
    }

    const PROP_SIZE: u64 = (1 << 20) + 4096 * 3 + 17;

    fn step() -> impl Strategy<Value = Step> {
        let range = (0..PROP_SIZE).prop_flat_map(|o| {
            let max = (PROP_SIZE - o).min(300_000) as usize;
            (Just(o), 0..=max)
        });
        // Mix in 4 KiB-aligned ranges so O_DIRECT paths are exercised.
        let aligned = (0..PROP_SIZE / 4096).prop_flat_map(|b| {
            let max = ((PROP_SIZE / 4096 - b).min(64)) as usize;
            (Just(b * 4096), (0..=max).prop_map(|n| n * 4096))
        });
        let range = prop_oneof![range, aligned];
        prop_oneof![
            3 => (range.clone(), any::<u8>(), any::<bool>()).prop_map(|((offset, len), seed, fua)| Step::Write { offset, len, seed, fua }),
            1 => range.clone().prop_map(|(offset, len)| Step::Trim { offset, len }),
            1 => (range.clone(), any::<bool>()).prop_map(|((offset, len), no_hole)| Step::Zero { offset, len, no_hole }),
            2 => range.prop_map(|(offset, len)| Step::Read { offset, len }),
        ]
    }

    fn check_against_oracle(direct: bool, steps: Vec<Step>) -> Result<(), TestCaseError> {
        let dir = TempDir::for_io("prop", direct);
        let dev = open(&dir, PROP_SIZE, direct);
        check_dev_against_oracle(&dev, steps)
    }

    fn check_dev_against_oracle(dev: &FileDev, steps: Vec<Step>) -> Result<(), TestCaseError> {
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(16 << 20);
        let mut oracle = vec![0u8; PROP_SIZE as usize];
        for s in steps {
            match s {
                Step::Write {
                    offset,
                    len,
                    seed,
                    fua,
                } => {
                    let data = pattern(len, seed);
                    write(&mut *ch, &mut pool, offset, &data, fua);
                    oracle[offset as usize..offset as usize + len].copy_from_slice(&data);
                }
                Step::Trim { offset, len } => {
                    run(&mut *ch, IoOp::Trim, offset, len as u32, None)
                        .result
                        .expect("trim");
                    oracle[offset as usize..offset as usize + len].fill(0);
                }
                Step::Zero {
                    offset,
                    len,
                    no_hole,
                } => {
                    let op = IoOp::WriteZeroes {
                        no_hole,
                        fua: false,
                        fast: false,
                    };
                    run(&mut *ch, op, offset, len as u32, None)
                        .result
                        .expect("write zeroes");
                    oracle[offset as usize..offset as usize + len].fill(0);
                }
                Step::Read { offset, len } => {
                    let got = read(&mut *ch, &mut pool, offset, len);
                    prop_assert!(
                        got[..] == oracle[offset as usize..offset as usize + len],
                        "read at {offset}+{len}"
                    );
                }
            }
        }
        prop_assert!(read(&mut *ch, &mut pool, 0, PROP_SIZE as usize) == oracle);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        #[test]
        fn buffered_matches_a_vec_oracle(steps in proptest::collection::vec(step(), 1..20)) {
            check_against_oracle(false, steps)?;
        }

        #[test]
        fn direct_matches_a_vec_oracle(steps in proptest::collection::vec(step(), 1..20)) {
            check_against_oracle(true, steps)?;
        }
    }

    mod fixed_buffer_tests {
        use super::*;

        /// On a thread with a fixed arena: writes through arena buffers
        /// (WRITE_FIXED), reads back through arena buffers (READ_FIXED) and a
        /// heap one (plain READ); all agree. Returns the device's counts.
        fn round_trip_on_an_arena_thread(direct: bool, flags: &'static str) -> BufferIos {
            std::thread::spawn(move || {
                let arena = lull_uring::FixedArena::new(4 << 20).expect("arena");
                assert!(lull_uring::install_thread_arena(arena.clone()));
                let dir = TempDir::for_io(if direct { "fixed-d" } else { "fixed-b" }, direct);
                let dev = open_with(&dir, direct, flags).expect("open");
                let mut ch = dev.open_file_channel().expect("channel");
                let fixed_on = !flags.contains("fixed=off");
                assert_eq!(ch.registered_arenas() > 0, fixed_on);
                let mut pool = BufPool::new(1 << 20);
                for (i, len) in [4096usize, 8192, 65536, 128 << 10].into_iter().enumerate() {
                    let offset = (i as u64) << 17;
                    let data = pattern(len, i as u8 + 1);
                    let mut buf = pool.get(len);
                    assert!(buf.is_fixed(), "the arena serves {len} bytes");
                    buf.as_mut_slice().copy_from_slice(&data);
                    let c = run(
                        &mut ch,
                        IoOp::Write { fua: false },
                        offset,
                        len as u32,
                        Some(buf),
                    );
                    c.result.expect("write");
                    pool.put(c.buf.expect("buf"));
                    assert_eq!(read(&mut ch, &mut pool, offset, len), data);
                    let mut heap = IoBuf::with_capacity(len);
                    heap.set_len(len);
                    let c = run(&mut ch, IoOp::Read, offset, len as u32, Some(heap));
                    c.result.expect("heap read");
                    assert_eq!(c.buf.expect("buf").as_slice(), &data[..]);
                }
                drop(ch);
                assert_eq!(arena.stats().in_use_bytes, 0, "every buffer went home");
                dev.buffer_ios().expect("a file device counts")
            })
            .join()
            .expect("join")
        }

        #[test]
        fn fixed_buffers_round_trip_buffered_and_direct() {
            for direct in [false, true] {
                let ios = round_trip_on_an_arena_thread(direct, "");
                let want = BufferIos {
                    fixed: 8,
                    plain: 4,
                    inline: 0,
                };
                assert_eq!(ios, want, "direct: {direct}");
            }
        }

        #[test]
        fn fixed_off_sends_everything_plain() {
            let ios = round_trip_on_an_arena_thread(true, "fixed=off");
            assert_eq!(
                ios,
                BufferIos {
                    fixed: 0,
                    plain: 12,
                    inline: 0
                }
            );
        }
    }

    /// The inline channel (`inline`, the default on a memory filesystem).
    mod inline_tests {
        use super::*;

        /// A directory on tmpfs (/dev/shm). Fails with a message where
        /// there is none: the inline path exists for exactly that case.
        fn memory_dir(tag: &str) -> TempDir {
            let shm = Path::new("/dev/shm");
            let probe = File::open(shm).unwrap_or_else(|e| {
                panic!("the inline tests need /dev/shm (tmpfs), which cannot be opened: {e}")
            });
            assert!(
                lull_uring::on_memory_filesystem(&probe).expect("fstatfs /dev/shm"),
                "the inline tests need /dev/shm on tmpfs; it is another filesystem here"
            );
            let dir = TempDir(shm.join(format!(
                "lull-bdev-inline-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            )));
            std::fs::create_dir_all(&dir.0).expect("mkdir in /dev/shm");
            dir
        }

        /// A directory on a disk filesystem: TMPDIR unless that is a
        /// memory filesystem, else the crate's target directory.
        fn disk_dir(tag: &str) -> TempDir {
            let dir = TempDir::new(tag);
            let on_memory = File::open(&dir.0)
                .and_then(|d| lull_uring::on_memory_filesystem(&d))
                .expect("fstatfs TMPDIR");
            if !on_memory {
                return dir;
            }
            let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
            let dir = TempDir(base.join(format!("lull-bdev-disk-{tag}-{}", std::process::id())));
            std::fs::create_dir_all(&dir.0).expect("mkdir in target/");
            dir
        }

        fn open_flags(dir: &TempDir, size: u64, flags: &str) -> Result<FileDev, BdevError> {
            open_sized(dir, size, false, flags)
        }

        fn refused_option(r: Result<FileDev, BdevError>) -> (&'static str, String) {
            match r {
                Err(BdevError::OptionRefused { option, reason }) => (option, reason),
                Err(e) => panic!("expected a refusal, got {e}"),
                Ok(dev) => panic!("expected a refusal, got {}", dev.describe()),
            }
        }

        #[test]
        fn inline_is_the_default_on_tmpfs_only() {
            let mem = memory_dir("rules");
            let dev = open_flags(&mem, 1 << 20, "").expect("auto on tmpfs");
            assert!(dev.is_inline());
            assert!(dev.describe().contains("inline"), "{}", dev.describe());
            let ch = dev.open_channel().expect("channel");
            assert!(ch.event_fd().is_none() && !ch.polled());
            drop((ch, dev));
            for flags in ["inline=off", "iopoll=auto"] {
                let dev = open_flags(&mem, 1 << 20, flags).expect(flags);
                assert!(!dev.is_inline(), "{flags}");
                assert!(dev.open_channel().expect("ring").event_fd().is_some() || dev.setup.iopoll);
            }
            let (option, reason) = refused_option(open_flags(&mem, 1 << 20, "inline,iopoll=auto"));
            assert_eq!(option, "inline");
            assert!(reason.contains("iopoll"), "{reason}");

            let disk = disk_dir("rules");
            let dev = open_flags(&disk, 1 << 20, "").expect("auto on a disk");
            assert!(!dev.is_inline());
            drop(dev);
            let (option, reason) = refused_option(open_flags(&disk, 1 << 20, "inline=on"));
            assert_eq!(option, "inline");
            assert!(reason.contains("memory filesystem"), "{reason}");
        }

        #[test]
        fn inline_round_trip() {
            let dir = memory_dir("rt");
            let dev = open_flags(&dir, 8 << 20, "inline").expect("open");
            round_trip_on(&dir, &dev);
            // Reads and writes are counted as inline, never as ring I/O.
            let ios = dev.buffer_ios().expect("counted");
            assert_eq!((ios.fixed, ios.plain), (0, 0));
            assert_eq!(ios.inline, 11, "5 writes + 6 reads");
            assert_eq!(dev.io_uring_enters(), Some(0));
        }

        #[test]
        fn inline_trim_and_write_zeroes() {
            let dir = memory_dir("zero");
            let dev = open_flags(&dir, 4 << 20, "").expect("open");
            let mut ch = dev.open_channel().expect("channel");
            zeroing_on(&dir, &mut *ch);
            // tmpfs punches holes but has no ZERO_RANGE: a fast zero that
            // would have to write zeros is refused, one that punches works.
            let fast = |no_hole| IoOp::WriteZeroes {
                no_hole,
                fua: false,
                fast: true,
            };
            let c = run(&mut *ch, fast(true), 0, 4096, None);
            assert!(
                matches!(c.result, Err(BdevError::Unsupported(_))),
                "{:?}",
                c.result
            );
            run(&mut *ch, fast(false), 0, 4096, None)
                .result
                .expect("fast zero by punching a hole");
        }

        #[test]
        fn inline_bad_requests_and_a_full_channel() {
            let dir = memory_dir("bad");
            let dev = open_flags(&dir, 1 << 20, "").expect("open");
            let mut ch = dev.open_channel().expect("channel");
            let mut pool = BufPool::new(4 << 20);
            let c = run(
                &mut *ch,
                IoOp::Read,
                (1 << 20) - 10,
                4096,
                Some(pool.get(4096)),
            );
            assert!(matches!(c.result, Err(BdevError::OutOfRange { .. })));
            let c = run(&mut *ch, IoOp::Read, 0, 4096, Some(pool.get(100)));
            assert!(matches!(c.result, Err(BdevError::BadRequest(_))));
            let c = run(&mut *ch, IoOp::BlockStatus, 0, 4096, Some(pool.get(4096)));
            assert!(c.result.is_err());
            for tag in 0..INLINE_DEPTH as u64 {
                let req = IoRequest {
                    tag,
                    op: IoOp::Flush,
                    offset: 0,
                    len: 0,
                    buf: None,
                };
                ch.submit(req).map_err(|(_, e)| e).expect("room");
            }
            let req = IoRequest {
                tag: 9999,
                op: IoOp::Flush,
                offset: 0,
                len: 0,
                buf: None,
            };
            assert!(matches!(ch.submit(req), Err((_, BdevError::Full { .. }))));
            assert_eq!(ch.reap(&mut |c| c.result.expect("flush")), INLINE_DEPTH);
            assert_eq!(ch.in_flight(), 0);
        }

        /// A read on `ch` and its file range, if it was answered with one.
        fn read_range(
            ch: &mut dyn Channel,
            pool: &mut BufPool,
            offset: u64,
            len: u32,
        ) -> (Option<crate::FileRange>, IoCompletion) {
            let mut c = run(ch, IoOp::Read, offset, len, Some(pool.get(len as usize)));
            let range = match std::mem::take(&mut c.data) {
                crate::Data::Spliced(crate::Spliced::File(r)) => Some(r),
                crate::Data::Spliced(crate::Spliced::Pipe(_)) => {
                    panic!("a file channel handed over a pipe")
                }
                crate::Data::Lent(_) => panic!("a file channel lent memory"),
                crate::Data::Buf => None,
            };
            (range, c)
        }

        /// The bytes of `r` as `sendfile` sends them, through a socket pair.
        fn sent_bytes(r: &crate::FileRange) -> Vec<u8> {
            use std::io::Read as _;
            use std::os::fd::{AsFd as _, AsRawFd as _};
            let (a, mut b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
            let reader = std::thread::spawn(move || {
                let mut got = Vec::new();
                b.read_to_end(&mut got).expect("read the socket");
                got
            });
            let mut done = 0;
            while done < r.len {
                let n = lull_uring::splice::sendfile(
                    a.as_raw_fd(),
                    r.file.as_fd(),
                    r.offset + done as u64,
                    r.len - done,
                )
                .expect("sendfile");
                assert!(n > 0, "sendfile ended early at {done} of {}", r.len);
                done += n;
            }
            drop(a);
            reader.join().expect("reader")
        }

        /// A channel told `allow_splice` answers a READ of at least
        /// `SENDFILE_READ_BYTES_MIN` with its file range (the request's
        /// offset and length; the buffer comes back untouched), which
        /// `sendfile` sends as written; shorter reads, reads before the
        /// opt-in and reads past the device's end are not lent.
        #[test]
        fn inline_lends_long_reads_as_file_ranges() {
            let dir = memory_dir("lend");
            let size = 4u64 << 20;
            let dev = open_flags(&dir, size, "").expect("open");
            assert!(dev.is_inline());
            let mut ch = dev.open_channel().expect("channel");
            let mut pool = BufPool::new(8 << 20);
            let data = pattern(size as usize, 11);
            write(ch.as_mut(), &mut pool, 0, &data, false);
            let min = crate::SENDFILE_READ_BYTES_MIN;

            let (range, c) = read_range(ch.as_mut(), &mut pool, 0, 2 * min);
            assert!(range.is_none(), "not told: copied");
            assert_eq!(
                c.buf.expect("buffer").as_slice()[..2 * min as usize],
                data[..2 * min as usize]
            );

            ch.allow_splice();
            let before = dev.buffer_ios().expect("counted").inline;
            for (offset, len) in [(4096, min), (100, 128 << 10), (size - u64::from(min), min)] {
                let mut buf = pool.get(len as usize);
                buf.as_mut_slice().fill(0xEE);
                let c = run(ch.as_mut(), IoOp::Read, offset, len, Some(buf));
                c.result.expect("read");
                let crate::Data::Spliced(crate::Spliced::File(r)) = c.data else {
                    panic!("[{offset}, +{len}) was not answered with a file range")
                };
                assert_eq!((r.offset, r.len), (offset, len as usize));
                assert!(
                    c.buf.expect("buffer").as_slice()[..len as usize]
                        .iter()
                        .all(|&b| b == 0xEE),
                    "a lent read's buffer is untouched"
                );
                let at = offset as usize;
                assert!(
                    sent_bytes(&r) == data[at..at + len as usize],
                    "[{offset}, +{len}) sent"
                );
            }
            assert_eq!(
                dev.buffer_ios().expect("counted").inline,
                before,
                "no pread for a range"
            );

            // Below the threshold: copied.
            let (range, c) = read_range(ch.as_mut(), &mut pool, 512, min - 512);
            assert!(range.is_none(), "below the threshold");
            let n = (min - 512) as usize;
            assert_eq!(c.buf.expect("buffer").as_slice()[..n], data[512..512 + n]);
            // Past the end: refused, nothing lent.
            let (range, c) = read_range(ch.as_mut(), &mut pool, size - 4096, min);
            assert!(range.is_none());
            assert!(
                matches!(c.result, Err(BdevError::OutOfRange { .. })),
                "{:?}",
                c.result
            );

            // The range is the page cache's, not a snapshot: a write after
            // it was made shows in what is sent (docs/PER_IO.md, "File
            // reads by sendfile"); a trim, as zeros.
            let (range, _) = read_range(ch.as_mut(), &mut pool, 1 << 20, min);
            let r = range.expect("lent");
            write(ch.as_mut(), &mut pool, 1 << 20, &vec![0x5A; 4096], false);
            run(ch.as_mut(), IoOp::Trim, (1 << 20) + 4096, 4096, None)
                .result
                .expect("trim");
            let sent = sent_bytes(&r);
            assert!(sent[..4096].iter().all(|&b| b == 0x5A));
            assert!(sent[4096..8192].iter().all(|&b| b == 0));
            assert!(sent[8192..] == data[(1 << 20) + 8192..(1 << 20) + min as usize]);

            // A range with a hole in it (that trim) is read into the
            // buffer: NBD makes hole chunks of holes, which needs the bytes.
            let at = (1 << 20) - 4096;
            let (range, c) = read_range(ch.as_mut(), &mut pool, at, 2 * min);
            assert!(range.is_none(), "a range holding a hole");
            let got = c.buf.expect("buffer");
            let got = &got.as_slice()[..2 * min as usize];
            assert_eq!(got[..4096], data[at as usize..at as usize + 4096]);
            assert!(got[8192..12288].iter().all(|&b| b == 0));
            // A never-written file is all hole: nothing lent.
            let fresh = memory_dir("lend-fresh");
            let dev = open_flags(&fresh, 1 << 20, "").expect("open");
            let mut ch = dev.open_channel().expect("channel");
            ch.allow_splice();
            let (range, c) = read_range(ch.as_mut(), &mut pool, 0, 128 << 10);
            assert!(range.is_none(), "a hole");
            assert!(c.buf.expect("buffer").as_slice()[..128 << 10]
                .iter()
                .all(|&b| b == 0));
        }

        /// Only the inline channel lends, and only through a buffered
        /// descriptor: a `direct` file on tmpfs and the io_uring channel
        /// (`inline=off`) read into the buffer even when told to splice.
        #[test]
        fn direct_and_ring_channels_do_not_lend() {
            let dir = memory_dir("nolend");
            let mut pool = BufPool::new(4 << 20);
            let min = crate::SENDFILE_READ_BYTES_MIN;
            let data = pattern(256 << 10, 3);
            let mut cases = vec![(
                "inline=off",
                open_flags(&dir, 1 << 20, "inline=off").expect("ring"),
            )];
            let _ = std::fs::remove_file(dir.file());
            match open_sized(&dir, 1 << 20, true, "inline") {
                Ok(dev) => cases.push(("direct,inline", dev)),
                Err(e) => eprintln!(
                    "SKIPPED the direct case: this kernel's tmpfs refuses O_DIRECT ({e}); \
                     the inline channel lends only when `direct_align_bytes == 0` anyway"
                ),
            }
            for (what, dev) in cases {
                let mut ch = dev.open_channel().expect("channel");
                ch.allow_splice();
                write(ch.as_mut(), &mut pool, 0, &data, false);
                for len in [min, 128 << 10] {
                    let (range, c) = read_range(ch.as_mut(), &mut pool, 0, len);
                    assert!(range.is_none(), "{what}: lent");
                    c.result.expect("read");
                    assert!(
                        c.buf.expect("buffer").as_slice()[..len as usize] == data[..len as usize],
                        "{what}: bytes"
                    );
                }
            }
        }

        const INLINE_DEPTH: usize = crate::file_inline::INLINE_CHANNEL_DEPTH;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
            #[test]
            fn inline_matches_a_vec_oracle(steps in proptest::collection::vec(step(), 1..20)) {
                let dir = memory_dir("prop");
                let dev = open_flags(&dir, PROP_SIZE, "inline").expect("open");
                check_dev_against_oracle(&dev, steps)?;
            }
        }
    }
}
