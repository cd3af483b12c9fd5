//! Socket plumbing shared by every lull wire endpoint (the NBD server, the
//! NVMe/TCP target, the replica server and the engine's replica
//! connections): an input buffer that hands out whole messages, and an
//! output queue of framed replies written with one `writev` for many
//! frames.
//!
//! ```
//! use lull_net::{InBuf, OutQueue, Fill};
//! let mut out: OutQueue<Vec<u8>> = OutQueue::default();
//! out.push(&[1, 2, 3, 4], b"payload".to_vec());
//! let mut wire = Vec::new();
//! out.write_to(&mut wire, |_payload| {}).unwrap();
//! assert_eq!(wire, b"\x01\x02\x03\x04payload");
//!
//! let mut inb = InBuf::with_capacity(64);
//! assert_eq!(inb.fill(&mut &wire[..]).unwrap(), Fill::Read(11));
//! assert_eq!(inb.take(4), Some(&[1u8, 2, 3, 4][..]));
//! ```
//!
//! Nothing here blocks: both work on non-blocking sockets and report
//! "would block" as no progress.
//!
//! [`server`] holds the acceptor and connection table the servers share;
//! [`slots`] the table of requests in flight every connection keeps;
//! [`shared`] buffers several frames send from at once.

#![forbid(unsafe_code)]

pub mod bufs;
pub mod link;
pub mod server;
pub mod shared;
pub mod slots;
pub mod tls;
pub mod wire;

use std::collections::VecDeque;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsFd, RawFd};
use std::sync::Arc;

use lull_uring::{BufPool, IoBuf};

/// Largest frame header: the replica protocol's 32 bytes (NBD's simple
/// reply is 16).
pub const MAX_HEADER_LEN: usize = 32;

/// Slices gathered into one `writev`: 32 frames of header + payload. The
/// kernel's limit is 1024; 64 already amortises the syscall over a full
/// queue of small replies.
pub const MAX_IOVECS: usize = 64;

struct Frame<P> {
    header: [u8; MAX_HEADER_LEN],
    header_len: u8,
    payload: P,
    /// Bytes the payload sends from a descriptor after its in-memory ones
    /// ([`OutPayload::tail_len`], as pushed).
    tail_len: usize,
    /// Bytes of this frame already written.
    pos: usize,
}

impl<P: AsRef<[u8]>> Frame<P> {
    /// Header and in-memory payload bytes: what `writev` sends.
    fn mem_len(&self) -> usize {
        usize::from(self.header_len) + self.payload.as_ref().len()
    }

    fn len(&self) -> usize {
        self.mem_len() + self.tail_len
    }
}

/// Why the output stopped for good.
#[derive(Debug)]
pub enum WriteError {
    /// The peer accepts no more bytes (`write` returned 0).
    Closed,
    Io(io::Error),
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::Closed => f.write_str("peer stopped reading"),
            WriteError::Io(e) => write!(f, "write failed: {e}"),
        }
    }
}

/// Frames (a header and a payload) waiting to be written, in order.
/// Payloads come back through the `sent` callback once fully written, so
/// pooled buffers can be recycled. A payload with a descriptor tail (a
/// file range, a pipe: [`OutPayload::tail_len`]) is sent with `sendfile`
/// or `splice` after its header, by [`OutQueue::write_spliced`].
pub struct OutQueue<P> {
    frames: VecDeque<Frame<P>>,
    bytes: usize,
}

impl<P> Default for OutQueue<P> {
    fn default() -> Self {
        OutQueue {
            frames: VecDeque::new(),
            bytes: 0,
        }
    }
}

impl<P: OutPayload> OutQueue<P> {
    pub fn with_capacity(frames: usize) -> Self {
        OutQueue {
            frames: VecDeque::with_capacity(frames),
            bytes: 0,
        }
    }

    /// Queue a frame. `header` is at most [`MAX_HEADER_LEN`] bytes (a
    /// protocol constant; a longer one is a bug in the caller).
    pub fn push(&mut self, header: &[u8], payload: P) {
        assert!(
            header.len() <= MAX_HEADER_LEN,
            "frame header of {} bytes",
            header.len()
        );
        let mut h = [0u8; MAX_HEADER_LEN];
        h[..header.len()].copy_from_slice(header);
        let frame = Frame {
            header: h,
            header_len: header.len() as u8,
            tail_len: payload.tail_len(),
            payload,
            pos: 0,
        };
        self.bytes += frame.len();
        self.frames.push_back(frame);
    }

    pub fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    /// Bytes queued and not yet written.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Write as much as `w` takes now. Returns the bytes written (0 when it
    /// would block); fully written frames hand their payload to `sent`.
    /// A frame with a descriptor tail fails it (see [`OutQueue::write_spliced`]).
    pub fn write_to(
        &mut self,
        w: &mut impl Write,
        sent: impl FnMut(P),
    ) -> Result<usize, WriteError> {
        self.write_spliced(w, None, sent)
    }

    /// [`OutQueue::write_to`], sending descriptor tails into `sock`: the
    /// socket `w` writes to, when it is a plain one (`None` when bytes must
    /// go through `w`, e.g. a TLS session: a tail then fails the write).
    pub fn write_spliced(
        &mut self,
        w: &mut impl Write,
        sock: Option<RawFd>,
        mut sent: impl FnMut(P),
    ) -> Result<usize, WriteError> {
        let mut total = 0;
        loop {
            let queued = self.frames.len();
            let Some(front) = self.frames.front_mut() else {
                break;
            };
            let mem_len = front.mem_len();
            if front.pos >= mem_len && front.pos < front.len() {
                // The front frame's header and bytes are out: its tail.
                let Some(sock) = sock else {
                    return Err(WriteError::Io(io::Error::new(
                        io::ErrorKind::Unsupported,
                        "a spliced payload on a stream that cannot take one",
                    )));
                };
                let more = queued > 1;
                let done = front.pos - mem_len;
                match front
                    .payload
                    .send_tail(sock, done, front.tail_len - done, more)
                {
                    Ok(0) => {
                        return Err(WriteError::Io(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "a spliced payload ended early",
                        )))
                    }
                    Ok(k) => {
                        let k = k.min(front.tail_len - done);
                        front.pos += k;
                        total += k;
                        self.bytes -= k;
                        if front.pos == front.len() {
                            if let Some(f) = self.frames.pop_front() {
                                sent(f.payload);
                            }
                        }
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(WriteError::Io(e)),
                }
            }
            let mut iov: [IoSlice<'_>; MAX_IOVECS] = [IoSlice::new(&[]); MAX_IOVECS];
            let mut n = 0;
            // The batch ends with the bytes before a tail: they wait in
            // the socket for it (`MSG_MORE`), one segment instead of two.
            let mut before_tail = false;
            for f in &self.frames {
                if n + 2 > MAX_IOVECS {
                    break;
                }
                let hl = usize::from(f.header_len);
                if f.pos < hl {
                    iov[n] = IoSlice::new(&f.header[f.pos..hl]);
                    n += 1;
                }
                let p = f.payload.as_ref();
                let off = f.pos.saturating_sub(hl);
                if off < p.len() {
                    iov[n] = IoSlice::new(&p[off..]);
                    n += 1;
                }
                if f.tail_len > 0 {
                    // Its tail goes by `send_tail` once this is out.
                    before_tail = true;
                    break;
                }
            }
            let sent_now = match sock {
                Some(fd) if before_tail => lull_uring::splice::send_more(fd, &iov[..n]),
                _ => w.write_vectored(&iov[..n]),
            };
            let mut written = match sent_now {
                Ok(0) => return Err(WriteError::Closed),
                Ok(k) => k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(WriteError::Io(e)),
            };
            total += written;
            self.bytes -= written;
            while written > 0 {
                let Some(front) = self.frames.front_mut() else {
                    break;
                };
                // At most up to a tail: `writev` was given no more.
                let take = (front.mem_len().max(front.pos) - front.pos).min(written);
                front.pos += take;
                written -= take;
                if front.pos == front.len() {
                    if let Some(f) = self.frames.pop_front() {
                        sent(f.payload);
                    }
                } else if take == 0 {
                    break;
                }
            }
            // Frames with nothing to write (empty header and payload) end
            // here too.
            while self.frames.front().is_some_and(|f| f.len() == 0) {
                if let Some(f) = self.frames.pop_front() {
                    sent(f.payload);
                }
            }
        }
        Ok(total)
    }

    /// Drop every queued frame (the peer is gone), handing payloads back.
    pub fn clear(&mut self, mut sent: impl FnMut(P)) {
        for f in self.frames.drain(..) {
            sent(f.payload);
        }
        self.bytes = 0;
    }
}

/// What follows a frame header on the wire, for servers whose replies
/// carry pooled data buffers (read data) or small owned bytes (handshakes).
pub enum Payload {
    None,
    /// A pooled buffer, returned to its pool once sent.
    Buf(IoBuf),
    Bytes(Vec<u8>),
    /// `len` bytes at `at` of a buffer several frames send from (the data
    /// chunks of one structured read reply); the last frame sent returns
    /// it to the pool.
    Slice {
        buf: shared::SharedBuf,
        at: usize,
        len: usize,
    },
    /// `len` bytes of `file` from `offset`, sent with `sendfile` (a
    /// replica's read data on a plain link: page-cache pages handed to the
    /// socket, no copy). Only on a [`wire::Wire`] that allows splicing.
    File {
        file: Arc<std::fs::File>,
        offset: u64,
        len: usize,
    },
    /// Bytes held in a pipe, spliced into the socket (a replicated read's
    /// data as it came from the replica, no copy). Only on a
    /// [`wire::Wire`] that allows splicing.
    Pipe(lull_uring::pipes::SplicePipe),
    /// Bytes a device lent (a memory volume's read data), written from
    /// the device's memory as in-memory bytes (by `writev`, or through a
    /// TLS session that encrypts them). The loan is dropped once they are
    /// all written (or the stream is dropped), not before: until then it
    /// holds the memory (docs/PER_IO.md, "Lent reads").
    Lent(lull_uring::Lent),
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        match self {
            Payload::None => &[],
            Payload::Buf(b) => b.as_slice(),
            Payload::Bytes(v) => v,
            Payload::Slice { buf, at, len } => {
                let all = buf.as_slice();
                let start = (*at).min(all.len());
                &all[start..start.saturating_add(*len).min(all.len())]
            }
            Payload::Lent(l) => l.as_slice(),
            Payload::File { .. } | Payload::Pipe(_) => &[],
        }
    }
}

/// A payload an [`OutQueue`] (or a [`wire::Wire`]) can carry: its bytes,
/// and what becomes of it once written or dropped. The servers' replies
/// ([`Payload`]) give pooled buffers back; the engine's requests share
/// their write buffers and only drop them.
pub trait OutPayload: AsRef<[u8]> {
    /// Done with: fully written, or dropped with the stream.
    fn recycle(self, pool: &mut BufPool);

    /// Bytes sent from a descriptor after the in-memory ones (`as_ref`),
    /// with [`OutPayload::send_tail`]. Fixed for the payload's life.
    fn tail_len(&self) -> usize {
        0
    }

    /// Send up to `left` tail bytes, from tail byte `done` on, into the
    /// socket `sock` (`more`: other frames follow). Returns the bytes sent;
    /// `WouldBlock` when the socket is full.
    fn send_tail(
        &mut self,
        sock: RawFd,
        done: usize,
        left: usize,
        more: bool,
    ) -> io::Result<usize> {
        let _ = (sock, done, left, more);
        Err(io::ErrorKind::Unsupported.into())
    }
}

/// Owned bytes (examples, tests).
impl OutPayload for Vec<u8> {
    fn recycle(self, _: &mut BufPool) {}
}

impl OutPayload for Payload {
    fn recycle(self, pool: &mut BufPool) {
        match self {
            Payload::Buf(b) => pool.put(b),
            Payload::Slice { buf, .. } => shared::release(buf, pool),
            Payload::Pipe(p) => lull_uring::pipes::put(p),
            Payload::None | Payload::Bytes(_) | Payload::File { .. } | Payload::Lent(_) => {}
        }
    }

    fn tail_len(&self) -> usize {
        match self {
            Payload::File { len, .. } => *len,
            Payload::Pipe(p) => p.held(),
            _ => 0,
        }
    }

    fn send_tail(
        &mut self,
        sock: RawFd,
        done: usize,
        left: usize,
        more: bool,
    ) -> io::Result<usize> {
        match self {
            Payload::File { file, offset, .. } => {
                lull_uring::splice::sendfile(sock, file.as_fd(), *offset + done as u64, left)
            }
            Payload::Pipe(p) => p.drain_to(sock, left, more),
            _ => Err(io::ErrorKind::Unsupported.into()),
        }
    }
}

impl<P: OutPayload> OutQueue<P> {
    /// [`OutQueue::write_spliced`], recycling sent payloads into `pool`.
    pub fn write_pooled(
        &mut self,
        w: &mut impl Write,
        sock: Option<RawFd>,
        pool: &mut BufPool,
    ) -> Result<usize, WriteError> {
        self.write_spliced(w, sock, |p| p.recycle(pool))
    }

    /// [`OutQueue::clear`], recycling payloads into `pool`.
    pub fn clear_pooled(&mut self, pool: &mut BufPool) {
        self.clear(|p| p.recycle(pool))
    }
}

/// What one `fill` did.
#[derive(Debug, PartialEq, Eq)]
pub enum Fill {
    /// This many bytes arrived.
    Read(usize),
    /// Nothing now (would block), or no room in the buffer.
    Nothing,
    /// The peer closed its side.
    Eof,
}

/// An input buffer: bytes read from a socket, consumed from the front.
pub struct InBuf {
    /// Empty while released (nothing buffered): taken from the thread's
    /// cache when bytes are read, given back by [`InBuf::release`].
    buf: Box<[u8]>,
    capacity: usize,
    start: usize,
    end: usize,
    /// The last [`InBuf::fill`] found the stream empty (see
    /// [`InBuf::drained`]).
    drained: bool,
}

impl InBuf {
    /// An input buffer of `bytes`; no memory is taken until the first read.
    pub fn with_capacity(bytes: usize) -> InBuf {
        InBuf {
            buf: Box::default(),
            capacity: bytes,
            start: 0,
            end: 0,
            drained: false,
        }
    }

    /// Whether the last [`InBuf::fill`] found the stream empty: it read
    /// less than the room it offered, or nothing (would block, or end of
    /// stream). A stream socket hands out all it holds up to the room
    /// given, so another read before the socket is reported readable
    /// again would find nothing: a protocol may skip it (one system call
    /// per request saved). Only a hint: a socket watched level-triggered
    /// is reported again for any byte left.
    pub fn drained(&self) -> bool {
        self.drained
    }

    /// Give the memory back to the thread's cache if nothing is buffered
    /// (an idle connection then holds none); the next `fill` takes it again.
    pub fn release(&mut self) {
        if self.start == self.end && !self.buf.is_empty() {
            bufs::give_inbuf(std::mem::take(&mut self.buf));
            self.start = 0;
            self.end = 0;
        }
    }

    /// Whether memory is held (for tests and memory accounting).
    pub fn is_held(&self) -> bool {
        !self.buf.is_empty()
    }

    /// Bytes buffered and not consumed.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// The buffered bytes.
    pub fn peek(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Consume `n` buffered bytes (at most what is buffered).
    pub fn consume(&mut self, n: usize) {
        self.start += n.min(self.buffered());
    }

    /// Consume and return the next `n` bytes, if that many are buffered.
    pub fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.buffered() < n {
            return None;
        }
        let s = self.start;
        self.start += n;
        Some(&self.buf[s..s + n])
    }

    /// Move up to `dst.len()` buffered bytes into `dst`; returns how many.
    pub fn take_into(&mut self, dst: &mut [u8]) -> usize {
        let n = self.buffered().min(dst.len());
        dst[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
        self.start += n;
        n
    }

    /// [`InBuf::fill`], reading at most `max` bytes: a header alone, so
    /// that the payload after it can be read straight into its own buffer.
    pub fn fill_at_most(&mut self, r: &mut impl Read, max: usize) -> io::Result<Fill> {
        if max == 0 {
            // A read of nothing would look like the end of the stream.
            return Ok(Fill::Nothing);
        }
        self.fill(&mut Read::take(r, max as u64))
    }

    /// Read once from `r` into the free space (compacting first when the
    /// buffer's tail is full).
    pub fn fill(&mut self, r: &mut impl Read) -> io::Result<Fill> {
        if self.buf.is_empty() && self.capacity > 0 {
            self.buf = bufs::take_inbuf(self.capacity);
            self.start = 0;
            self.end = 0;
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > 0 && self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            // No room: whether the stream has more is not known.
            self.drained = false;
            return Ok(Fill::Nothing);
        }
        self.drained = true;
        loop {
            return match r.read(&mut self.buf[self.end..]) {
                Ok(0) => Ok(Fill::Eof),
                Ok(n) => {
                    self.end += n;
                    self.drained = self.end < self.buf.len();
                    Ok(Fill::Read(n))
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Fill::Nothing),
                Err(e) => Err(e),
            };
        }
    }
}

/// Fill `dst[*filled..]` from `r` until it is full or `r` would block: large
/// payloads go straight from the socket into their I/O buffer. Returns
/// whether any byte arrived, or `Fill::Eof`/an error as the outcome.
pub fn read_into(r: &mut impl Read, dst: &mut [u8], filled: &mut usize) -> io::Result<Fill> {
    let mut got = 0;
    while *filled < dst.len() {
        match r.read(&mut dst[*filled..]) {
            Ok(0) => return Ok(Fill::Eof),
            Ok(n) => {
                *filled += n;
                got += n;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    Ok(if got > 0 {
        Fill::Read(got)
    } else {
        Fill::Nothing
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A writer that takes at most `chunk` bytes per call and would block
    /// every other call.
    struct Trickle {
        out: Vec<u8>,
        chunk: usize,
        block: bool,
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.block = !self.block;
            if self.block {
                return Err(io::ErrorKind::WouldBlock.into());
            }
            let n = buf.len().min(self.chunk);
            self.out.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    proptest! {
        #[test]
        fn frames_arrive_whole_and_in_order(
            frames in proptest::collection::vec((0usize..=32, proptest::collection::vec(any::<u8>(), 0..300)), 0..80),
            chunk in 1usize..500,
        ) {
            let mut q: OutQueue<Vec<u8>> = OutQueue::default();
            let mut expected = Vec::new();
            for (i, (hl, payload)) in frames.iter().enumerate() {
                let header = vec![i as u8; *hl];
                expected.extend_from_slice(&header);
                expected.extend_from_slice(payload);
                q.push(&header, payload.clone());
            }
            prop_assert_eq!(q.bytes(), expected.len());
            let mut w = Trickle { out: Vec::new(), chunk, block: false };
            let mut returned = 0;
            for _ in 0..100_000 {
                if q.is_empty() { break; }
                q.write_to(&mut w, |_| returned += 1).unwrap();
            }
            prop_assert!(q.is_empty());
            prop_assert_eq!(q.bytes(), 0);
            prop_assert_eq!(returned, frames.len());
            prop_assert_eq!(w.out, expected);
        }

        #[test]
        fn inbuf_hands_out_what_was_read(data in proptest::collection::vec(any::<u8>(), 0..2000), cap in 1usize..300, step in 1usize..50) {
            let mut src = &data[..];
            let mut inb = InBuf::with_capacity(cap);
            let mut got = Vec::new();
            loop {
                match inb.fill(&mut src).unwrap() {
                    Fill::Eof => break,
                    Fill::Read(_) | Fill::Nothing => {}
                }
                while let Some(b) = inb.take(step.min(inb.buffered()).max(1)) {
                    got.extend_from_slice(b);
                }
            }
            got.extend_from_slice(inb.peek());
            prop_assert_eq!(got, data);
        }
    }

    /// `drained`: a read that got less than the room it offered, or
    /// nothing, found the stream empty; one that filled the room, or had
    /// no room, did not.
    #[test]
    fn a_short_read_says_the_stream_is_drained() {
        struct Blocking<'a>(&'a [u8]);
        impl Read for Blocking<'_> {
            fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
                if self.0.is_empty() {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                self.0.read(buf)
            }
        }
        let data = [7u8; 100];
        let mut src = Blocking(&data);
        let mut inb = InBuf::with_capacity(64);
        assert!(!inb.drained());
        assert_eq!(inb.fill(&mut src).unwrap(), Fill::Read(64));
        assert!(!inb.drained(), "the room was filled: more may wait");
        assert_eq!(inb.fill(&mut src).unwrap(), Fill::Nothing);
        assert!(!inb.drained(), "no room: nothing known");
        assert_eq!(inb.take(64).map(<[u8]>::len), Some(64));
        assert_eq!(inb.fill(&mut src).unwrap(), Fill::Read(36));
        assert!(inb.drained(), "a short read");
        assert_eq!(inb.fill(&mut src).unwrap(), Fill::Nothing);
        assert!(inb.drained(), "would block");
        let mut eof: &[u8] = &[];
        assert_eq!(inb.fill(&mut eof).unwrap(), Fill::Eof);
        assert!(inb.drained());
    }

    #[test]
    fn closed_and_cleared() {
        struct Zero;
        impl Write for Zero {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                Ok(0)
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let mut q: OutQueue<Vec<u8>> = OutQueue::default();
        q.push(&[1], vec![2]);
        assert!(matches!(
            q.write_to(&mut Zero, |_| {}),
            Err(WriteError::Closed)
        ));
        let mut back = 0;
        q.clear(|_| back += 1);
        assert_eq!((back, q.bytes(), q.is_empty()), (1, 0, true));
    }

    /// Frames with descriptor tails (a file range by `sendfile`, a pipe by
    /// `splice`) between in-memory ones, over a non-blocking socket whose
    /// reader is slower than the writer: every byte arrives in order, and
    /// a queue that may not splice refuses a tail instead of sending it
    /// around the stream.
    #[test]
    fn spliced_tails_arrive_in_order() {
        use std::net::{TcpListener, TcpStream};
        use std::os::fd::AsRawFd;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut rx, _) = l.accept().unwrap();
        tx.set_nonblocking(true).unwrap();
        let dir = std::env::temp_dir().join(format!("lull-net-tail-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("data");
        let data: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let file = Arc::new(std::fs::File::open(&path).unwrap());

        let mut q: OutQueue<Payload> = OutQueue::default();
        let mut expected = Vec::new();
        for i in 0..40usize {
            let header = [i as u8; 16];
            expected.extend_from_slice(&header);
            let (offset, len) = ((i * 12_345) as u64, 1 + i * 7_001);
            match i % 3 {
                0 => {
                    q.push(
                        &header,
                        Payload::File {
                            file: file.clone(),
                            offset,
                            len,
                        },
                    );
                    expected.extend_from_slice(&data[offset as usize..offset as usize + len]);
                }
                1 => q.push(&header, Payload::None),
                _ => {
                    let bytes = vec![i as u8; len % 5_000];
                    expected.extend_from_slice(&bytes);
                    q.push(&header, Payload::Bytes(bytes));
                }
            }
        }
        // A pipe tail: bytes spliced in from another socket.
        let l2 = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut feed = TcpStream::connect(l2.local_addr().unwrap()).unwrap();
        let (pipe_src, _) = l2.accept().unwrap();
        let piped: Vec<u8> = (0..100_000u32).map(|i| (i % 13) as u8).collect();
        feed.write_all(&piped).unwrap();
        let mut pipe = lull_uring::pipes::get().expect("a pipe");
        while pipe.held() < piped.len() {
            let left = piped.len() - pipe.held();
            match pipe.fill_from(pipe_src.as_raw_fd(), left) {
                Ok(n) => assert!(n > 0),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        q.push(&[0xee; 32], Payload::Pipe(pipe));
        expected.extend_from_slice(&[0xee; 32]);
        expected.extend_from_slice(&piped);
        q.push(&[0xdd; 8], Payload::Bytes(vec![1, 2, 3]));
        expected.extend_from_slice(&[0xdd; 8]);
        expected.extend_from_slice(&[1, 2, 3]);
        assert_eq!(q.bytes(), expected.len());

        // Without a socket to splice into, the first tail fails the write.
        let mut refused: OutQueue<Payload> = OutQueue::default();
        refused.push(
            &[1],
            Payload::File {
                file: file.clone(),
                offset: 0,
                len: 10,
            },
        );
        let mut sink = Vec::new();
        assert!(matches!(
            refused.write_to(&mut sink, |_| {}),
            Err(WriteError::Io(_))
        ));
        assert_eq!(sink, [1], "the header went, the tail did not");

        let want = expected.len();
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; want];
            let mut at = 0;
            while at < want {
                let n = rx.read(&mut got[at..(at + 3_000).min(want)]).unwrap();
                assert!(n > 0, "closed early");
                at += n;
            }
            got
        });
        let fd = tx.as_raw_fd();
        let mut returned = 0;
        while !q.is_empty() {
            q.write_spliced(&mut tx, Some(fd), |p| {
                returned += 1;
                if let Payload::Pipe(p) = p {
                    lull_uring::pipes::put(p);
                }
            })
            .unwrap();
        }
        assert_eq!(returned, 42);
        assert_eq!(q.bytes(), 0);
        let got = reader.join().unwrap();
        assert!(got == expected, "bytes differ");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file range queued while its file is cut shorter (a volume's
    /// backing file truncated by hand): `sendfile` finds the end early and
    /// the write fails with an error, which closes the connection
    /// (`Wire::flush`), never returns Ok(0) forever (a busy loop) or waits;
    /// the bytes that existed went first, nothing from past the range.
    #[test]
    fn a_file_range_cut_short_fails_the_write() {
        use std::net::{TcpListener, TcpStream};
        use std::os::fd::AsRawFd;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut rx, _) = l.accept().unwrap();
        tx.set_nonblocking(true).unwrap();
        let dir = std::env::temp_dir().join(format!("lull-net-cut-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("data");
        std::fs::write(&path, vec![0x42u8; 256 << 10]).unwrap();
        let file = Arc::new(std::fs::File::open(&path).unwrap());
        let mut q: OutQueue<Payload> = OutQueue::default();
        q.push(
            &[7; 16],
            Payload::File {
                file,
                offset: 64 << 10,
                len: 128 << 10,
            },
        );
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(100 << 10)
            .unwrap();
        let fd = tx.as_raw_fd();
        let mut outcome = None;
        // Bounded: each round moves bytes or fails; 1000 rounds of a
        // socket that is read below would be a hang.
        for _ in 0..1000 {
            match q.write_spliced(&mut tx, Some(fd), |_| {}) {
                Ok(_) => {}
                Err(e) => {
                    outcome = Some(e);
                    break;
                }
            }
        }
        let e = outcome.expect("the write failed instead of looping");
        assert!(e.to_string().contains("ended early"), "{e}");
        drop(tx);
        let mut got = Vec::new();
        rx.read_to_end(&mut got).unwrap();
        assert_eq!(
            got.len(),
            16 + (36 << 10),
            "the header, then the bytes up to the new end"
        );
        assert!(got[16..].iter().all(|&b| b == 0x42));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fill_at_most_reads_no_more_than_asked() {
        let data = [7u8; 100];
        let mut inb = InBuf::with_capacity(64);
        let mut r = &data[..];
        assert_eq!(inb.fill_at_most(&mut r, 32).unwrap(), Fill::Read(32));
        assert_eq!(inb.buffered(), 32);
        assert_eq!(inb.fill(&mut r).unwrap(), Fill::Read(32));
        assert_eq!(inb.buffered(), 64);
    }

    #[test]
    fn read_into_fills_until_would_block() {
        let data = [7u8; 100];
        let mut dst = [0u8; 64];
        let mut filled = 10;
        assert_eq!(
            read_into(&mut &data[..], &mut dst, &mut filled).unwrap(),
            Fill::Read(54)
        );
        assert_eq!(filled, 64);
        let mut filled = 0;
        assert_eq!(
            read_into(&mut &[][..], &mut dst, &mut filled).unwrap(),
            Fill::Eof
        );
    }
}
