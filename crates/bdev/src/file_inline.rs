//! The inline file channel: a `FileDev` channel that reads and writes
//! with plain `pread`/`pwrite` on the calling thread, for files on a memory
//! filesystem (see [`crate::ring_options::Inline`] for why and when).
//!
//! It behaves as the malloc channel does (`crate::deferred`): `submit`
//! queues, `reap` runs what was queued in submission order and hands the
//! completions out, and there is no event fd (completions are ready at
//! the next `reap`). The
//! operations are those of the io_uring channel (`crate::file`), done
//! synchronously: FUA is an `fdatasync` after the data, Trim and
//! WriteZeroes are `fallocate` (punch hole, zero range) with the same
//! fallback to writing zeros where the filesystem refuses a mode (tmpfs
//! has no ZERO_RANGE), and a *fast* WriteZeroes that would need it fails
//! with `Unsupported`. Nothing is allocated per request.
//!
//! A channel told [`Channel::allow_splice`] answers a READ of at least
//! [`SENDFILE_READ_BYTES_MIN`] bytes that holds no hole with the file
//! range itself ([`Spliced::File`]) instead of reading it into the
//! buffer: the owner sends it with `sendfile`, page-cache pages into the
//! socket, no copy in lull. Only here: the file is on a memory
//! filesystem, so its pages are in memory and a `sendfile` on the reactor
//! never waits for a disk (the io_uring channel's files may be on one;
//! docs/PER_IO.md, "File reads by sendfile", says why it does not lend).

use std::fs::File;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::deferred::Deferred;
use crate::{
    validate_request, BdevError, Channel, Data, FileRange, IoCompletion, IoOp, IoRequest, Spliced,
};

/// Requests an inline channel holds (queued plus completed, not reaped):
/// the io_uring channel's depth (`FILE_CHANNEL_DEPTH`, which a compile-time
/// assert in `crate::file` holds equal), so both push back at the same
/// point.
pub const INLINE_CHANNEL_DEPTH: usize = 256;

/// Whether a transfer goes through the main descriptor: always without
/// O_DIRECT (`align` 0), with it only when the file offset, buffer offset
/// and length are all multiples of `align`. DIO alignments are powers of
/// two; anything else (u64::MAX: "never direct") routes everything through
/// the buffered descriptor. Shared by the io_uring and inline channels (`crate::file` imports it
/// from here: the inline channel imports nothing of it).
pub(crate) fn uses_main(align: u64, file_offset: u64, buf_offset: u64, len: u64) -> bool {
    align == 0 || (align.is_power_of_two() && (file_offset | buf_offset | len) & (align - 1) == 0)
}

/// READs at least this long are answered with the file range on a channel
/// told [`Channel::allow_splice`]; shorter ones are read into the buffer.
/// Each range costs its own `sendfile` call when sent, where copied
/// replies of a batch leave together in one `writev`, so small reads stay
/// copied. 32 KiB: the replica's threshold for the same trade
/// (`SENDFILE_READ_BYTES_MIN` in `lull_replica`), where the engine reads
/// a reply's header alone anyway.
pub const SENDFILE_READ_BYTES_MIN: u32 = 32 * 1024;

/// Zeros written where the filesystem cannot zero a range by itself, one
/// `pwrite` per chunk: static, so no channel allocates it (the kernel maps
/// its pages to the zero page until written, which they never are).
static ZEROS: [u8; ZERO_CHUNK_BYTES] = [0; ZERO_CHUNK_BYTES];

/// Bytes per zero-writing `pwrite` (the io_uring channel's zero buffer).
const ZERO_CHUNK_BYTES: usize = 1 << 20;

/// One transfer's bytes: read into, or written from.
enum Bytes<'a> {
    Into(&'a mut [u8]),
    From(&'a [u8]),
}

impl Bytes<'_> {
    fn len(&self) -> usize {
        match self {
            Bytes::Into(b) => b.len(),
            Bytes::From(b) => b.len(),
        }
    }
}

/// A per-thread inline channel to a `FileDev` (built by
/// `FileDev::open_channel` when the device resolved to inline).
#[derive(Debug)]
pub(crate) struct InlineChannel {
    file: InlineFile,
    queue: Deferred,
    /// Reads may be answered with file ranges ([`Channel::allow_splice`]).
    splice: bool,
}

/// What an inline channel runs its requests on.
#[derive(Debug)]
struct InlineFile {
    /// The main descriptor (O_DIRECT with `direct`).
    main: Arc<File>,
    /// The buffered descriptor for unaligned requests; `Some` iff `direct`.
    buffered: Option<Arc<File>>,
    /// 0 without O_DIRECT.
    direct_align_bytes: u64,
    size_bytes: Arc<AtomicU64>,
    punch_hole_ok: bool,
    zero_range_ok: bool,
    /// The device's count of inline reads and writes.
    inline_ios: Arc<AtomicU64>,
}

impl InlineChannel {
    pub(crate) fn new(
        main: Arc<File>,
        buffered: Option<Arc<File>>,
        direct_align_bytes: u64,
        size_bytes: Arc<AtomicU64>,
        inline_ios: Arc<AtomicU64>,
    ) -> InlineChannel {
        InlineChannel {
            file: InlineFile {
                main,
                buffered,
                direct_align_bytes,
                size_bytes,
                punch_hole_ok: true,
                zero_range_ok: true,
                inline_ios,
            },
            queue: Deferred::new(INLINE_CHANNEL_DEPTH, true, "inline file"),
            splice: false,
        }
    }
}

impl InlineFile {
    /// The descriptor for a transfer: O_DIRECT only when the file offset,
    /// length and buffer offset are aligned (as `FileChannel::file_for`).
    fn file_for(&self, file_offset: u64, buf_offset: u64, len: u64) -> &File {
        let main = uses_main(self.direct_align_bytes, file_offset, buf_offset, len);
        match &self.buffered {
            Some(b) if !main => b,
            _ => &self.main,
        }
    }

    /// Reads into or writes from all of `data` at `offset`, resuming short
    /// transfers; 0 bytes (EOF, no space) is an error, as on the io_uring
    /// channel.
    fn transfer(&self, mut data: Bytes<'_>, offset: u64) -> Result<(), BdevError> {
        let len = data.len();
        let mut done = 0usize;
        while done < len {
            let at = offset + done as u64;
            let file = self.file_for(at, done as u64, (len - done) as u64);
            let n = match &mut data {
                Bytes::Into(buf) => file.read_at(&mut buf[done..], at),
                Bytes::From(buf) => file.write_at(&buf[done..], at),
            };
            match n {
                Ok(0) => {
                    let kind = match data {
                        Bytes::Into(_) => io::ErrorKind::UnexpectedEof,
                        Bytes::From(_) => io::ErrorKind::WriteZero,
                    };
                    return Err(BdevError::Io(kind.into()));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(BdevError::Io(e)),
            }
        }
        Ok(())
    }

    /// Writes zeros over `[offset, offset + len)`, a chunk of `ZEROS` at a
    /// time.
    fn write_zeros(&self, offset: u64, len: u64) -> Result<(), BdevError> {
        let mut done = 0u64;
        while done < len {
            let chunk = (len - done).min(ZERO_CHUNK_BYTES as u64) as usize;
            self.transfer(Bytes::From(&ZEROS[..chunk]), offset + done)?;
            done += chunk as u64;
        }
        Ok(())
    }

    /// Trim or WriteZeroes: `fallocate` with `mode`, or zeros written
    /// when the filesystem refuses the mode (remembered per channel);
    /// `fast` refuses instead of writing.
    fn zero(&mut self, mode: i32, offset: u64, len: u64, fast: bool) -> Result<(), BdevError> {
        let refuse_fast = || {
            BdevError::Unsupported("fast zero: this filesystem cannot zero a range without writing")
        };
        let ok = if mode == libc::FALLOC_FL_ZERO_RANGE {
            self.zero_range_ok
        } else {
            self.punch_hole_ok
        };
        if ok && len > 0 {
            let flags = mode | libc::FALLOC_FL_KEEP_SIZE;
            match lull_uring::fallocate(&self.main, flags, offset, len) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    tracing::info!(
                        mode,
                        "fallocate mode unsupported here; writing zeros instead"
                    );
                    if mode == libc::FALLOC_FL_ZERO_RANGE {
                        self.zero_range_ok = false;
                    } else {
                        self.punch_hole_ok = false;
                    }
                }
                Err(e) => return Err(BdevError::Io(e)),
            }
        }
        if fast {
            return Err(refuse_fast());
        }
        self.write_zeros(offset, len)
    }

    fn sync(&self) -> Result<(), BdevError> {
        self.main.sync_data().map_err(BdevError::Io)
    }

    /// The range a READ of `[offset, offset + len)` is answered with on a
    /// splicing channel, or `None` when it is read into the buffer: too
    /// short to be worth a `sendfile` of its own, a `direct` file (whose
    /// writes bypass the page cache `sendfile` reads from), or a range
    /// with a hole in it (never written, or trimmed: an NBD structured
    /// reply makes hole chunks of those, which it can only do with the
    /// bytes; one `cachestat` over the range, no copy). The request was validated: the range
    /// lies inside the device, whose size is raised only once the file is
    /// that long.
    fn lendable(&self, offset: u64, len: u32) -> Option<FileRange> {
        if len < SENDFILE_READ_BYTES_MIN || self.direct_align_bytes != 0 || self.buffered.is_some()
        {
            return None;
        }
        if !lull_uring::range_cached(&self.main, offset, u64::from(len)).unwrap_or(false) {
            return None;
        }
        Some(FileRange {
            file: Arc::clone(&self.main),
            offset,
            len: len as usize,
        })
    }

    /// Runs one request; the buffer goes back with its completion. With
    /// `splice` a long enough READ is answered with its file range.
    fn execute(&mut self, req: &mut IoRequest, splice: bool) -> Result<Data, BdevError> {
        validate_request(req, self.size_bytes.load(Ordering::Acquire))?;
        if req.op == IoOp::Read && splice {
            if let Some(range) = self.lendable(req.offset, req.len) {
                return Ok(Data::Spliced(Spliced::File(range)));
            }
        }
        self.run(req).map(|()| Data::Buf)
    }

    /// Runs one request with the bytes in its buffer.
    fn run(&mut self, req: &mut IoRequest) -> Result<(), BdevError> {
        let (offset, len) = (req.offset, u64::from(req.len));
        match req.op {
            IoOp::Read | IoOp::Write { .. } => {
                // validate_request checked the buffer's length.
                let Some(buf) = req.buf.as_mut() else {
                    return Err(BdevError::BadRequest("read or write without a buffer"));
                };
                self.inline_ios.fetch_add(1, Ordering::Relaxed);
                let bytes = &mut buf.as_mut_slice()[..len as usize];
                let data = match req.op {
                    IoOp::Read => Bytes::Into(bytes),
                    _ => Bytes::From(bytes),
                };
                self.transfer(data, offset)?;
                if let IoOp::Write { fua: true } = req.op {
                    self.sync()?;
                }
                Ok(())
            }
            IoOp::Flush => self.sync(),
            IoOp::Trim => self.zero(libc::FALLOC_FL_PUNCH_HOLE, offset, len, false),
            IoOp::WriteZeroes { no_hole, fast, fua } => {
                let mode = if no_hole {
                    libc::FALLOC_FL_ZERO_RANGE
                } else {
                    libc::FALLOC_FL_PUNCH_HOLE
                };
                self.zero(mode, offset, len, fast)?;
                if fua {
                    self.sync()?;
                }
                Ok(())
            }
            IoOp::BlockStatus => Err(BdevError::Unsupported(
                "block status of a file device: BlockDevice::extents answers it",
            )),
            IoOp::ChangedSince => Err(BdevError::Unsupported("a file device has no snapshots")),
        }
    }
}

impl Channel for InlineChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        self.queue.submit(req)
    }

    fn flush_submissions(&mut self) {}

    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        let (file, splice) = (&mut self.file, self.splice);
        self.queue.reap(|req| file.execute(req, splice), done)
    }

    fn allow_splice(&mut self) {
        self.splice = true;
    }

    fn event_fd(&self) -> Option<RawFd> {
        None
    }

    fn in_flight(&self) -> usize {
        self.queue.in_flight()
    }
}
