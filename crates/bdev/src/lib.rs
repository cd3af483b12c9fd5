//! Block devices: the `BlockDevice` trait and its backends.
//!
//! A `BlockDevice` is shared by every connection of a volume; each lull thread
//! that does I/O opens its own [`Channel`] (SPDK's io channel): the channel owns
//! the per-thread resources (an io_uring ring for `file`), is used from one
//! thread only, and reports completions through [`Channel::reap`].
//!
//! ```
//! use lull_bdev::{BlockDevice, BufPool, IoCompletion, IoOp, IoRequest, MallocDev};
//! let dev = MallocDev::new(1 << 30)?;
//! let mut ch = dev.open_channel()?;
//! let mut pool = BufPool::new(64 << 20);
//! let buf = pool.get(4096);
//! ch.submit(IoRequest { tag: 7, op: IoOp::Read, offset: 0, len: 4096, buf: Some(buf) })
//!     .map_err(|(_req, e)| e)?;
//! ch.flush_submissions(); // one syscall per batch of submits (file backend)
//! // A file channel completes later: wait until `ch.event_fd()` is readable.
//! ch.reap(&mut |c: IoCompletion| {
//!     assert_eq!(c.tag, 7);
//!     pool.put(c.buf.expect("buffer comes back"));
//! });
//! # Ok::<(), lull_bdev::BdevError>(())
//! ```

#![forbid(unsafe_code)]

use std::os::fd::RawFd;

pub use lull_uring::{BufPool, IoBuf, Lent, LentRegion};

pub mod chain;
mod deferred;
pub mod faulty;
pub mod file;
mod file_inline;
pub mod malloc;
mod ring_options;
pub mod units;

pub use chain::{ChainDev, SnapshotInfo};
pub use faulty::{Faults, FaultyDev, Probability, FAULTY_MAX_HELD, MAX_FAULT_DELAY_US};
pub use file::{FileDev, FileOptions, FILE_CHANNEL_DEPTH, FILE_SIZE_MAX_BYTES, MAX_PREFETCH_BYTES};
pub use file_inline::SENDFILE_READ_BYTES_MIN;
pub use malloc::{MallocDev, MALLOC_CHANNEL_DEPTH, MALLOC_CHUNK_BYTES, MALLOC_SIZE_MAX_BYTES};
pub use ring_options::{Inline, IoPoll, RingOptions, SQPOLL_IDLE_MS_DEFAULT, SQPOLL_IDLE_MS_MAX};
pub use units::{human_bytes, parse_size_bytes};

/// What an I/O does. Offsets and lengths are in bytes; devices accept any
/// byte granularity (O_DIRECT file devices bounce unaligned requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoOp {
    /// Read `len` bytes at `offset` into the request's buffer.
    Read,
    /// Write the request's buffer (`len` bytes) at `offset`; with `fua` the
    /// data is durable when the completion arrives.
    Write { fua: bool },
    /// Make every completed write durable.
    Flush,
    /// Discard the range; it reads back as zeros afterwards.
    Trim,
    /// Zero the range. With `no_hole` the range must stay allocated. With
    /// `fast` the device must not fall back to writing zeros: it fails
    /// with `BdevError::Unsupported` instead (NBD's fast zero; callers ask
    /// only when [`BlockDevice::zeroes_fast`] says it can).
    WriteZeroes {
        no_hole: bool,
        fua: bool,
        fast: bool,
    },
    /// The allocation of `[offset, offset + len)`, for devices that cannot
    /// answer [`BlockDevice::extents`] inline (a replicated volume asks a
    /// replica): the completion's buffer holds [`EXTENT_RECORD_LEN`]-byte
    /// records ([`put_extent_records`]) covering a non-empty prefix of the
    /// range, at most as many as the request's buffer had room for, and
    /// its length is set to the bytes written. Only channels of devices
    /// whose [`BlockDevice::extents_by_channel`] is true serve it; the
    /// others refuse it with `Unsupported`.
    BlockStatus,
    /// Which bytes of `[offset, offset + len)` were written since the
    /// snapshot the channel was told ([`Channel::set_changed_since`]), for
    /// devices that cannot answer [`BlockDevice::changed_since`] inline (a
    /// replicated snapshot's view asks a replica): the completion's buffer
    /// holds [`EXTENT_RECORD_LEN`]-byte records ([`put_change_records`])
    /// covering a non-empty prefix of the range, as many as it has room
    /// for, and its length is set to the bytes written. Only channels of
    /// devices whose [`BlockDevice::changed_by_channel`] is true serve it;
    /// the others refuse it with `Unsupported`.
    ChangedSince,
}

/// One request handed to a channel. `buf` is `Some` for `Read` (length at
/// least `len`) and `Write` (holds the data), `None` otherwise. The buffer
/// belongs to the in-flight operation until its completion returns it.
#[derive(Debug)]
pub struct IoRequest {
    pub tag: u64,
    pub op: IoOp,
    pub offset: u64,
    pub len: u32,
    pub buf: Option<IoBuf>,
}

/// The completion of one request: its tag, its result, its buffer back
/// and where a successful READ's data is.
#[derive(Debug)]
pub struct IoCompletion {
    pub tag: u64,
    pub result: Result<(), BdevError>,
    /// The request's buffer, back to its owner whatever `data` says.
    pub buf: Option<IoBuf>,
    /// What the data is: in `buf`, or held elsewhere (then `buf`'s bytes
    /// are not the data).
    pub data: Data,
}

impl IoCompletion {
    /// A completion carrying its buffer back, its data (if any) in it.
    pub fn new(tag: u64, result: Result<(), BdevError>, buf: Option<IoBuf>) -> IoCompletion {
        IoCompletion {
            tag,
            result,
            buf,
            data: Data::Buf,
        }
    }
}

/// Where a completion's data is: one value, so that a frontend matches
/// one enum to know how to send a read's bytes.
#[derive(Debug, Default)]
pub enum Data {
    /// In the request's own buffer ([`IoCompletion::buf`]); also every
    /// completion that carries no data (a write, a failure).
    #[default]
    Buf,
    /// A successful READ's data held by a descriptor, a pipe or a file
    /// range: only for a channel that was told [`Channel::allow_splice`],
    /// which sends it on with `splice` or `sendfile`.
    Spliced(Spliced),
    /// A successful READ's data lent from the device's memory instead of
    /// copied into `buf`: only for a channel that was told
    /// [`Channel::allow_lend`], which sends these bytes and drops the loan
    /// once they are written. The loan keeps the memory allocated; what
    /// may change the bytes meanwhile is the device's rule (`MallocDev`:
    /// nothing; docs/PER_IO.md, "Lent reads").
    Lent(Lent),
}

/// A READ's data held by a descriptor, sent on to a plain socket without
/// passing through lull's memory ([`Data::Spliced`]).
#[derive(Debug)]
pub enum Spliced {
    /// In a pipe: a replicated volume's, spliced from the replica's socket.
    Pipe(lull_uring::pipes::SplicePipe),
    /// In a file's page cache: a file volume's on a memory filesystem,
    /// sent with `sendfile` (docs/PER_IO.md, "File reads by sendfile").
    File(FileRange),
}

/// `len` bytes of `file` from `offset`. The bytes are the page cache's
/// when the kernel copies them out, not when the range was made: a write
/// to the range meanwhile shows in them (docs/PER_IO.md, "File reads by
/// sendfile").
#[derive(Debug, Clone)]
pub struct FileRange {
    pub file: std::sync::Arc<std::fs::File>,
    pub offset: u64,
    pub len: usize,
}

impl FileRange {
    /// Copies the range into `dst` (`len` bytes), for a caller that needs
    /// the bytes themselves (a chain putting a read together from several
    /// layers). A file shorter than the range is an error, as a short
    /// `pread` is on the copying path.
    pub fn read_into(&self, dst: &mut [u8]) -> Result<(), BdevError> {
        use std::os::unix::fs::FileExt;
        let Some(dst) = dst.get_mut(..self.len) else {
            return Err(BdevError::BadRequest("file range longer than its buffer"));
        };
        self.file.read_exact_at(dst, self.offset)?;
        Ok(())
    }
}

impl Data {
    /// Done with it unsent: a pipe goes back to its pool, a loan ends.
    pub fn release(self) {
        if let Data::Spliced(s) = self {
            s.release();
        }
    }
}

impl Spliced {
    /// The data's length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Spliced::Pipe(p) => p.held(),
            Spliced::File(r) => r.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Done with it unsent: a pipe goes back to its pool.
    pub fn release(self) {
        if let Spliced::Pipe(p) = self {
            lull_uring::pipes::put(p);
        }
    }
}

/// Errors of the block layer. Each maps to an errno (and from there to an
/// NBD error code).
#[derive(Debug, thiserror::Error)]
pub enum BdevError {
    #[error("request [{offset}, +{len}) is outside the device of {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("channel is full ({capacity} requests in flight)")]
    Full { capacity: usize },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("device failed: {0}")]
    Failed(String),
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// A device option the kernel or the device cannot honour (at open).
    #[error("option {option} refused: {reason}")]
    OptionRefused {
        option: &'static str,
        reason: String,
    },
    /// The request itself is malformed (e.g. a read without a buffer of
    /// `len` bytes). The NBD layer validates first, so this is a bug there.
    #[error("bad request: {0}")]
    BadRequest(&'static str),
    /// A resize to a smaller size: connected clients would lose the data
    /// past the new end, and hold a size they negotiated.
    #[error("cannot shrink the device from {size} to {requested} bytes: only growing is supported (data past the new end would be lost under connected clients)")]
    Shrink { size: u64, requested: u64 },
    /// A resize past the backend's largest size.
    #[error("cannot grow the device to {requested} bytes: this backend's maximum is {max} bytes")]
    TooLarge { requested: u64, max: u64 },
    /// A resize to a size that is not a multiple of [`RESIZE_ALIGN_BYTES`].
    #[error("cannot grow the device to {requested} bytes: the size must be a multiple of {RESIZE_ALIGN_BYTES}")]
    ResizeUnaligned { requested: u64 },
    /// A write, trim or zero on a read-only device (a snapshot).
    #[error("the device is read-only")]
    ReadOnly,
    /// A snapshot name the device does not have.
    #[error("no snapshot {0:?}")]
    NoSuchSnapshot(String),
    /// A name refused (a snapshot's: bad characters, taken already).
    #[error("{0}")]
    BadName(String),
    /// Something else uses what the operation would change or drop (a
    /// clone's base, a merge running).
    #[error("{0}")]
    InUse(String),
}

impl BdevError {
    /// The errno this error reduces to on the wire.
    pub fn errno(&self) -> i32 {
        match self {
            BdevError::OutOfRange { .. } => libc::EINVAL,
            BdevError::Full { .. } => libc::EAGAIN,
            BdevError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            BdevError::Failed(_) => libc::EIO,
            BdevError::Unsupported(_) | BdevError::OptionRefused { .. } => libc::EOPNOTSUPP,
            BdevError::BadRequest(_)
            | BdevError::Shrink { .. }
            | BdevError::TooLarge { .. }
            | BdevError::ResizeUnaligned { .. } => libc::EINVAL,
            BdevError::ReadOnly => libc::EPERM,
            BdevError::NoSuchSnapshot(_) => libc::ENOENT,
            BdevError::BadName(_) => libc::EINVAL,
            BdevError::InUse(_) => libc::EBUSY,
        }
    }
}

/// A device grows in multiples of 4 KiB: the largest LBA size the
/// NVMe/TCP target serves (so a namespace of either LBA format stays a
/// whole number of blocks) and the usual O_DIRECT alignment (so the new
/// tail of a `direct` file device takes the direct path like the rest).
pub const RESIZE_ALIGN_BYTES: u64 = 4096;

/// Checks a grow of a device of `size_bytes` to `requested` bytes, for a
/// backend whose largest size is `max_bytes`: never smaller, a multiple
/// of [`RESIZE_ALIGN_BYTES`], at most `max_bytes`. Growing to the
/// current size is allowed (a retried request does nothing).
pub fn check_grow(size_bytes: u64, requested: u64, max_bytes: u64) -> Result<(), BdevError> {
    if requested < size_bytes {
        return Err(BdevError::Shrink {
            size: size_bytes,
            requested,
        });
    }
    if !requested.is_multiple_of(RESIZE_ALIGN_BYTES) {
        return Err(BdevError::ResizeUnaligned { requested });
    }
    if requested > max_bytes {
        return Err(BdevError::TooLarge {
            requested,
            max: max_bytes,
        });
    }
    Ok(())
}

/// Checks a request against a device of `size_bytes`: the range must lie
/// inside the device (except `Flush`, which has none), and `Read`/`Write`
/// need a buffer of at least `len` bytes.
pub fn validate_request(req: &IoRequest, size_bytes: u64) -> Result<(), BdevError> {
    let (op, offset, len, buf) = (req.op, req.offset, req.len, req.buf.as_ref());
    if !matches!(op, IoOp::Flush) {
        let len = u64::from(len);
        match offset.checked_add(len) {
            Some(end) if end <= size_bytes => {}
            _ => {
                return Err(BdevError::OutOfRange {
                    offset,
                    len,
                    size: size_bytes,
                })
            }
        }
    }
    if matches!(op, IoOp::BlockStatus | IoOp::ChangedSince) {
        if len == 0 {
            return Err(BdevError::BadRequest("block status of an empty range"));
        }
        if buf.is_none_or(|b| b.len() < EXTENT_RECORD_LEN) {
            return Err(BdevError::BadRequest(
                "block status without room for one extent record",
            ));
        }
    }
    if matches!(op, IoOp::Read | IoOp::Write { .. }) {
        match buf {
            Some(buf) if buf.len() >= len as usize => {}
            Some(_) => {
                return Err(BdevError::BadRequest(
                    "buffer shorter than the request length",
                ))
            }
            None => return Err(BdevError::BadRequest("read or write without a buffer")),
        }
    }
    Ok(())
}

/// A run of bytes with one allocation state, from [`BlockDevice::extents`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length_bytes: u64,
    /// Not allocated (sparse). A hole always reads as zeros here.
    pub hole: bool,
    /// Known to read as zeros.
    pub zero: bool,
}

impl Extent {
    /// `length_bytes` of allocated data, contents unknown: what a device
    /// that cannot tell reports.
    pub fn data(length_bytes: u64) -> Extent {
        Extent {
            length_bytes,
            hole: false,
            zero: false,
        }
    }

    /// `length_bytes` of unallocated space reading as zeros.
    pub fn hole(length_bytes: u64) -> Extent {
        Extent {
            length_bytes,
            hole: true,
            zero: true,
        }
    }
}

/// Appends `e` to `out`, merging it into the last extent when their states
/// match. Returns false (leaving `out` alone) when that would need a new
/// extent beyond `max`.
pub fn push_extent(out: &mut Vec<Extent>, e: Extent, max: usize) -> bool {
    if e.length_bytes == 0 {
        return true;
    }
    if let Some(last) = out.last_mut() {
        if last.hole == e.hole && last.zero == e.zero {
            last.length_bytes += e.length_bytes;
            return true;
        }
    }
    if out.len() >= max {
        return false;
    }
    out.push(e);
    true
}

/// Bytes of one extent record in an [`IoOp::BlockStatus`] buffer: the
/// length (u64), then flags (u64: bit 0 hole, bit 1 zero), little-endian.
/// It never leaves the process.
pub const EXTENT_RECORD_LEN: usize = 16;

/// Writes as many of `ext` as fit into `buf` as [`EXTENT_RECORD_LEN`]-byte
/// records; returns the bytes written.
pub fn put_extent_records(ext: &[Extent], buf: &mut [u8]) -> usize {
    let mut n = 0;
    for (e, rec) in ext.iter().zip(buf.chunks_exact_mut(EXTENT_RECORD_LEN)) {
        let flags = u64::from(e.hole) | (u64::from(e.zero) << 1);
        rec[..8].copy_from_slice(&e.length_bytes.to_le_bytes());
        rec[8..].copy_from_slice(&flags.to_le_bytes());
        n += EXTENT_RECORD_LEN;
    }
    n
}

/// The extents in a buffer filled by [`put_extent_records`] (whole
/// records only).
pub fn extent_records(buf: &[u8]) -> impl Iterator<Item = Extent> + '_ {
    buf.chunks_exact(EXTENT_RECORD_LEN).map(|rec| {
        let mut length = [0u8; 8];
        let mut flags = [0u8; 8];
        length.copy_from_slice(&rec[..8]);
        flags.copy_from_slice(&rec[8..]);
        let flags = u64::from_le_bytes(flags);
        Extent {
            length_bytes: u64::from_le_bytes(length),
            hole: flags & 1 != 0,
            zero: flags & 2 != 0,
        }
    })
}

/// Writes as many of `runs` as fit into `buf` as [`EXTENT_RECORD_LEN`]-byte
/// records (the length, then flags: bit 0 changed; little-endian), for
/// [`IoOp::ChangedSince`]; returns the bytes written.
pub fn put_change_records(runs: &[ChangeRun], buf: &mut [u8]) -> usize {
    let mut n = 0;
    for (r, rec) in runs.iter().zip(buf.chunks_exact_mut(EXTENT_RECORD_LEN)) {
        rec[..8].copy_from_slice(&r.length_bytes.to_le_bytes());
        rec[8..].copy_from_slice(&u64::from(r.changed).to_le_bytes());
        n += EXTENT_RECORD_LEN;
    }
    n
}

/// The runs in a buffer filled by [`put_change_records`] (whole records
/// only).
pub fn change_records(buf: &[u8]) -> impl Iterator<Item = ChangeRun> + '_ {
    buf.chunks_exact(EXTENT_RECORD_LEN).map(|rec| {
        let mut length = [0u8; 8];
        let mut flags = [0u8; 8];
        length.copy_from_slice(&rec[..8]);
        flags.copy_from_slice(&rec[8..]);
        ChangeRun {
            length_bytes: u64::from_le_bytes(length),
            changed: u64::from_le_bytes(flags) & 1 != 0,
        }
    })
}

/// A run of bytes of one state in a "changed since a snapshot" map, from
/// [`BlockDevice::changed_since`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChangeRun {
    pub length_bytes: u64,
    /// Written (or trimmed, or zeroed) after the snapshot was taken: an
    /// incremental backup copies it.
    pub changed: bool,
}

/// Appends `run` to `out`, merging it into the last run of the same state.
/// Returns false (leaving `out` alone) when that needs a run beyond `max`.
pub fn push_change(out: &mut Vec<ChangeRun>, run: ChangeRun, max: usize) -> bool {
    if run.length_bytes == 0 {
        return true;
    }
    if let Some(last) = out.last_mut() {
        if last.changed == run.changed {
            last.length_bytes += run.length_bytes;
            return true;
        }
    }
    if out.len() >= max {
        return false;
    }
    out.push(run);
    true
}

/// A volume's storage, shared by all its connections.
pub trait BlockDevice: Send + Sync {
    /// Size in bytes. Hot paths call it (an atomic load where the device
    /// can grow): a request checked against the size it returned stays
    /// valid, since a device never shrinks while it is open.
    fn size_bytes(&self) -> u64;
    /// Grow the device to `size_bytes` online (see [`check_grow`] for
    /// what is refused). Control path only: it may block briefly (a file
    /// is extended with `ftruncate`). Requests in flight, and channels
    /// opened before, see the new size at once. Default: the device
    /// cannot grow.
    fn grow(&self, size_bytes: u64) -> Result<(), BdevError> {
        let _ = size_bytes;
        Err(BdevError::Unsupported("this device cannot be resized"))
    }
    /// A short description for logs and `volume_list` ("malloc", "file:/path").
    fn describe(&self) -> String;
    /// Open a per-thread channel.
    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError>;
    /// Make everything written so far durable, blocking. For shutdown and
    /// tools, never for a reactor (the data path flushes with `IoOp::Flush`).
    fn sync(&self) -> Result<(), BdevError> {
        Ok(())
    }
    /// The allocation of `[offset, offset + len)` (inside the device, with
    /// `len` above 0): at most `max_extents` (>= 1) extents, in order, adjacent ones
    /// in different states, covering a non-empty prefix of the range (the
    /// caller asks again for the rest). Called on a reactor, so it must
    /// not block on I/O: a metadata lookup at most. The default, for
    /// devices that cannot tell, is "all data", which is always true.
    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>, BdevError> {
        let _ = (offset, max_extents);
        Ok(vec![Extent::data(len)])
    }
    /// True when the allocation must be asked for through a channel
    /// ([`IoOp::BlockStatus`]) because finding it takes I/O (a replicated
    /// volume asks a replica over the network); [`BlockDevice::extents`]
    /// then only says "all data". Default: false, `extents` answers.
    fn extents_by_channel(&self) -> bool {
        false
    }
    /// True when "changed since a snapshot" must be asked for through a
    /// channel ([`IoOp::ChangedSince`], after
    /// [`Channel::set_changed_since`]) because finding it takes I/O (a
    /// replicated snapshot's view asks a replica);
    /// [`BlockDevice::changed_since`] is then not called. Default: false.
    fn changed_by_channel(&self) -> bool {
        false
    }
    /// Whether `IoOp::WriteZeroes { fast: true, .. }` can succeed: the
    /// device zeroes without writing zeros (freeing memory, punching or
    /// zeroing a file range). Default: no, so a fast zero is refused at
    /// once and the client falls back to what it would do anyway.
    fn zeroes_fast(&self) -> bool {
        false
    }
    /// `io_uring_enter` calls its channels made so far (`None`: the
    /// device does not use io_uring).
    fn io_uring_enters(&self) -> Option<u64> {
        None
    }
    /// Reads and writes its channels sent to the kernel from registered
    /// (fixed) buffers and from plain ones (`None`: the device does not
    /// use io_uring).
    fn buffer_ios(&self) -> Option<BufferIos> {
        None
    }
    /// Advises that `[offset, offset + len)` will be read soon (NBD_CMD_CACHE).
    /// Advisory: it may do nothing, or only part; it must not block on I/O.
    /// Default: nothing to prefetch.
    fn prefetch(&self, offset: u64, len: u64) -> Result<(), BdevError> {
        let _ = (offset, len);
        Ok(())
    }
    /// A read-only device (a snapshot's view): its channels refuse writes,
    /// trims and zeroes with [`BdevError::ReadOnly`], and frontends tell
    /// clients (NBD's `NBD_FLAG_READ_ONLY`). Default: writable.
    fn read_only(&self) -> bool {
        false
    }
    /// Whether the device has a snapshot of this name (so
    /// [`BlockDevice::changed_since`] and [`BlockDevice::snapshot_view`]
    /// can answer for it). Default: a device without snapshots.
    fn has_snapshot(&self, name: &str) -> bool {
        let _ = name;
        false
    }
    /// The names of the device's snapshots, oldest first (for a snapshot's
    /// view: the snapshots older than it). Default: none.
    fn snapshot_names(&self) -> Vec<String> {
        Vec::new()
    }
    /// Which bytes of `[offset, offset + len)` (inside the device, `len`
    /// above 0) were written since the snapshot `since` was taken: at most
    /// `max_runs` (>= 1) runs, in order, adjacent ones in different
    /// states, covering a non-empty prefix of the range. On a snapshot's
    /// view, "since" ends at that snapshot. A metadata lookup, called on a
    /// reactor: it must not block on I/O. Default: no snapshots, so
    /// [`BdevError::NoSuchSnapshot`].
    fn changed_since(
        &self,
        since: &str,
        offset: u64,
        len: u64,
        max_runs: usize,
    ) -> Result<Vec<ChangeRun>, BdevError> {
        let _ = (offset, len, max_runs);
        Err(BdevError::NoSuchSnapshot(since.to_string()))
    }
    /// A read-only device showing the snapshot `name` as it was taken, or
    /// `None` when there is no such snapshot. The view keeps what it reads
    /// alive (a snapshot deleted meanwhile stays readable through it until
    /// the view is dropped, or the delete waits; the device documents
    /// which). Default: `None`.
    fn snapshot_view(&self, name: &str) -> Option<std::sync::Arc<dyn BlockDevice>> {
        let _ = name;
        None
    }
}

/// How a device's reads and writes went to the kernel: through io_uring
/// with a fixed or a plain buffer, counted per operation (a short
/// transfer's remainder is another one), or inline, counted per request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BufferIos {
    /// `IORING_OP_READ_FIXED` / `WRITE_FIXED`: the buffer was in a
    /// registered arena.
    pub fixed: u64,
    /// Plain `READ` / `WRITE`: a heap buffer, an arena the ring has not
    /// registered, or the `fixed=off` option.
    pub plain: u64,
    /// `pread` / `pwrite` on the reactor, without io_uring: a file on a
    /// memory filesystem (`inline`).
    pub inline: u64,
}

/// A per-thread I/O queue to a device. Used from one thread only.
pub trait Channel: Send {
    /// Queue a request. A full channel hands the request back with
    /// `BdevError::Full`; that is back-pressure, never an unbounded queue.
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)>;
    /// Push queued requests to the device (one syscall for a batch).
    fn flush_submissions(&mut self);
    /// Queue `req` and push it to the device, as a frontend connection
    /// does: `Ok(None)` when queued; `Ok(Some(req))` when the channel is
    /// full (hold it and retry once completions are reaped); `Err` with the
    /// request's failed completion when the channel refused it.
    // The Err is a completion (136 bytes since it can carry a file range),
    // moved once per refused request, as every completion is moved; boxing
    // it would allocate on that path.
    #[allow(clippy::result_large_err)]
    fn submit_now(&mut self, req: IoRequest) -> Result<Option<IoRequest>, IoCompletion> {
        let queued = self.queue(req);
        if matches!(queued, Ok(None)) {
            self.flush_submissions();
        }
        queued
    }
    /// [`Channel::submit_now`] without the push: the caller queues a
    /// batch (the requests of one socket read) and calls
    /// `flush_submissions` once after it, so a file channel makes one
    /// `io_uring_enter` per batch, not per request.
    #[allow(clippy::result_large_err)] // as `submit_now`
    fn queue(&mut self, req: IoRequest) -> Result<Option<IoRequest>, IoCompletion> {
        match self.submit(req) {
            Ok(()) => Ok(None),
            Err((req, BdevError::Full { .. })) => Ok(Some(req)),
            Err((req, e)) => Err(IoCompletion {
                tag: req.tag,
                result: Err(e),
                buf: req.buf,
                data: crate::Data::Buf,
            }),
        }
    }
    /// Deliver every available completion to `done`; returns how many.
    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize;
    /// A file descriptor that becomes readable when completions are ready,
    /// for event-driven reactors. `None`: completions are available from
    /// `reap` right after `submit`, no waiting is ever needed.
    fn event_fd(&self) -> Option<RawFd>;
    /// Requests submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Completions are found only by calling `reap` (an IOPOLL ring): while
    /// requests are in flight the owner must run again without waiting
    /// for an fd, as a poller that wakes itself. `event_fd` is `None`.
    fn polled(&self) -> bool {
        false
    }
    /// After a `submit` handed a request back as `Full` because of a rate
    /// limit (a volume's QoS), the monotonic time (ns) at which it may go:
    /// the owner waits for that time rather than polling. `None`: the
    /// channel was full for want of room, and a completion makes room.
    fn retry_at_ns(&self) -> Option<u64> {
        None
    }
    /// The owner sends READ data on to a plain socket and can take it held
    /// by a descriptor ([`Data::Spliced`]): a device that moves its
    /// data from a socket (a replicated volume) may then hand it over in a
    /// pipe, and a file whose pages are in memory (a file volume on a
    /// memory filesystem, read inline) as a file range, with no copy in
    /// lull. Others ignore it.
    fn allow_splice(&mut self) {}
    /// The owner sends READ data from memory it does not own and can take
    /// a loan of it ([`Data::Lent`]); a device that holds its data
    /// in memory (a memory volume) may then lend it instead of copying it
    /// into the request's buffer. Others ignore it.
    fn allow_lend(&mut self) {}
    /// Reads may come back lent ([`Channel::allow_lend`] was called and
    /// the device lends): the owner's read buffers then mostly go unused,
    /// so it need not take them from a reactor's fixed (io_uring
    /// registered) arena, whose buffers cost more to take and give back
    /// than the thread cache's (`BufPool::get_unregistered`).
    fn lends(&self) -> bool {
        false
    }
    /// The snapshot [`IoOp::ChangedSince`] requests of this channel ask
    /// about (a connection selects one `lull:changed:` context). Only
    /// channels of devices whose [`BlockDevice::changed_by_channel`] is
    /// true use it; others ignore it.
    fn set_changed_since(&mut self, since: &str) {
        let _ = since;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extent_records_round_trip() {
        let ext = [
            Extent::hole(4096),
            Extent::data(1 << 40),
            Extent {
                length_bytes: 512,
                hole: false,
                zero: true,
            },
        ];
        let mut buf = [0u8; 2 * EXTENT_RECORD_LEN + 3];
        assert_eq!(put_extent_records(&ext, &mut buf), 2 * EXTENT_RECORD_LEN);
        let back: Vec<Extent> = extent_records(&buf[..2 * EXTENT_RECORD_LEN]).collect();
        assert_eq!(back, ext[..2]);
        let mut big = [0u8; 4 * EXTENT_RECORD_LEN];
        let n = put_extent_records(&ext, &mut big);
        assert_eq!(extent_records(&big[..n]).collect::<Vec<_>>(), ext);
    }
}
