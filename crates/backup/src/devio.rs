//! Blocking I/O on a volume's device from a backup job's own thread
//! (never a reactor): a [`Channel`] opened on the thread, requests sent
//! several at a time, completions waited for on the channel's eventfd.
//!
//! ```ignore
//! let mut io = DevIo::open(view)?;            // a snapshot's view
//! let runs = io.changed("s1", 0, size)?;      // what changed since s1
//! let data = io.read(0, CHUNK_BYTES as u32)?; // the first chunk
//! ```

use std::sync::Arc;
use std::time::Duration;

use lull_bdev::{
    change_records, extent_records, BdevError, BlockDevice, ChangeRun, Channel, Extent, IoBuf,
    IoCompletion, IoOp, IoRequest, EXTENT_RECORD_LEN,
};
use lull_reactor::sys::{event_buffer, Epoll, Interest};

/// Bytes per request: a chunk is two requests, sent together.
pub const REQUEST_BYTES: u32 = 1 << 20;

/// Longest wait for one completion: past the engine's replica timeout
/// (a replica that stops answering is dropped, and the request goes to
/// another), so a request still unanswered after it is lost.
pub const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// Records asked for per extent or change query (16 bytes each).
const RECORDS_PER_QUERY: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum DevIoError {
    #[error(transparent)]
    Bdev(#[from] BdevError),
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    #[error("cannot wait for completions: {0}")]
    Wait(std::io::Error),
}

/// A channel of one device and what waiting on it needs.
pub struct DevIo {
    dev: Arc<dyn BlockDevice>,
    ch: Box<dyn Channel>,
    epoll: Option<Epoll>,
    next_tag: u64,
    since: Option<String>,
}

impl DevIo {
    pub fn open(dev: Arc<dyn BlockDevice>) -> Result<DevIo, DevIoError> {
        let ch = dev.open_channel()?;
        let epoll = match ch.event_fd() {
            Some(fd) => {
                let ep = Epoll::new().map_err(DevIoError::Wait)?;
                ep.add(fd, Interest::READABLE, 0)
                    .map_err(DevIoError::Wait)?;
                Some(ep)
            }
            None => None,
        };
        Ok(DevIo {
            dev,
            ch,
            epoll,
            next_tag: 1,
            since: None,
        })
    }

    pub fn size_bytes(&self) -> u64 {
        self.dev.size_bytes()
    }

    /// Sends `reqs` and waits for all of them; their completions in the
    /// order given.
    fn run(&mut self, reqs: Vec<IoRequest>) -> Result<Vec<IoCompletion>, DevIoError> {
        let first = self.next_tag;
        let n = reqs.len();
        self.next_tag += n as u64;
        let mut done: Vec<Option<IoCompletion>> = (0..n).map(|_| None).collect();
        let mut waiting = 0usize;
        let mut queue: std::collections::VecDeque<IoRequest> = reqs.into();
        while waiting > 0 || !queue.is_empty() {
            while let Some(req) = queue.pop_front() {
                match self.ch.submit_now(req) {
                    Ok(None) => waiting += 1,
                    Ok(Some(held)) => {
                        queue.push_front(held);
                        break;
                    }
                    Err(c) => {
                        let i = (c.tag - first) as usize;
                        done[i] = Some(c);
                    }
                }
            }
            if waiting == 0 {
                break;
            }
            // Reap before waiting: a channel may complete a request on
            // the spot (a view's flush) without ringing its eventfd.
            let reaped = self.ch.reap(&mut |c: IoCompletion| {
                let i = (c.tag - first) as usize;
                if let Some(slot) = done.get_mut(i) {
                    *slot = Some(c);
                    waiting -= 1;
                }
            });
            if reaped == 0 && waiting > 0 {
                self.wait()?;
            }
        }
        Ok(done
            .into_iter()
            .map(|c| c.expect("every request completed"))
            .collect())
    }

    fn wait(&mut self) -> Result<(), DevIoError> {
        let Some(ep) = &self.epoll else {
            if self.ch.polled() {
                std::thread::yield_now();
            }
            return Ok(());
        };
        let mut events = event_buffer(1);
        let n = ep
            .wait(&mut events, IO_TIMEOUT.as_millis() as i32)
            .map_err(DevIoError::Wait)?;
        if n == 0 {
            return Err(DevIoError::Timeout(IO_TIMEOUT));
        }
        Ok(())
    }

    fn request(&self, op: IoOp, offset: u64, len: u32, buf: Option<IoBuf>, tag: u64) -> IoRequest {
        IoRequest {
            tag,
            op,
            offset,
            len,
            buf,
        }
    }

    /// `len` bytes at `offset`.
    pub fn read(&mut self, offset: u64, len: u64) -> Result<Vec<u8>, DevIoError> {
        let mut reqs = Vec::new();
        let mut at = 0u64;
        let tag0 = self.next_tag;
        while at < len {
            let n = (len - at).min(u64::from(REQUEST_BYTES)) as u32;
            let mut buf = IoBuf::with_capacity(n as usize);
            buf.set_len(n as usize);
            reqs.push(self.request(
                IoOp::Read,
                offset + at,
                n,
                Some(buf),
                tag0 + reqs.len() as u64,
            ));
            at += u64::from(n);
        }
        let mut out = Vec::with_capacity(len as usize);
        for c in self.run(reqs)? {
            c.result?;
            let buf = c
                .buf
                .ok_or(BdevError::BadRequest("a read came back without its buffer"))?;
            out.extend_from_slice(buf.as_slice());
        }
        Ok(out)
    }

    /// Writes `data` at `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<(), DevIoError> {
        let mut reqs = Vec::new();
        let tag0 = self.next_tag;
        for (k, piece) in data.chunks(REQUEST_BYTES as usize).enumerate() {
            let mut buf = IoBuf::with_capacity(piece.len());
            buf.set_len(piece.len());
            buf.as_mut_slice().copy_from_slice(piece);
            let at = offset + (k * REQUEST_BYTES as usize) as u64;
            let op = IoOp::Write { fua: false };
            reqs.push(self.request(op, at, piece.len() as u32, Some(buf), tag0 + k as u64));
        }
        for c in self.run(reqs)? {
            c.result?;
        }
        Ok(())
    }

    /// Zeroes `[offset, offset + len)`.
    pub fn zero(&mut self, offset: u64, len: u64) -> Result<(), DevIoError> {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(u64::from(u32::MAX) & !4095) as u32;
            let op = IoOp::WriteZeroes {
                no_hole: false,
                fua: false,
                fast: false,
            };
            let tag = self.next_tag;
            let req = self.request(op, offset + at, n, None, tag);
            for c in self.run(vec![req])? {
                c.result?;
            }
            at += u64::from(n);
        }
        Ok(())
    }

    /// Makes every write so far durable.
    pub fn flush(&mut self) -> Result<(), DevIoError> {
        let tag = self.next_tag;
        let req = self.request(IoOp::Flush, 0, 0, None, tag);
        for c in self.run(vec![req])? {
            c.result?;
        }
        Ok(())
    }

    /// The allocation of `[offset, offset + len)`, all of it.
    pub fn extents(&mut self, offset: u64, len: u64) -> Result<Vec<Extent>, DevIoError> {
        let mut out = Vec::new();
        let mut at = offset;
        while at < offset + len {
            let left = offset + len - at;
            let part: Vec<Extent> = if self.dev.extents_by_channel() {
                extent_records(&self.records(IoOp::BlockStatus, at, left)?).collect()
            } else {
                self.dev.extents(at, left, RECORDS_PER_QUERY)?
            };
            let covered: u64 = part.iter().map(|e| e.length_bytes).sum();
            if covered == 0 {
                return Err(BdevError::Failed("the device reported no extent".into()).into());
            }
            for e in part {
                let e = Extent {
                    length_bytes: e.length_bytes.min(offset + len - at),
                    ..e
                };
                at += e.length_bytes;
                lull_bdev::push_extent(&mut out, e, usize::MAX);
                if at >= offset + len {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Which bytes of `[offset, offset + len)` changed since snapshot
    /// `since` (on a snapshot's view: up to that snapshot), all of it.
    pub fn changed(
        &mut self,
        since: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<ChangeRun>, DevIoError> {
        if self.dev.changed_by_channel() && self.since.as_deref() != Some(since) {
            self.ch.set_changed_since(since);
            self.since = Some(since.to_string());
        }
        let mut out = Vec::new();
        let mut at = offset;
        while at < offset + len {
            let left = offset + len - at;
            let part: Vec<ChangeRun> = if self.dev.changed_by_channel() {
                change_records(&self.records(IoOp::ChangedSince, at, left)?).collect()
            } else {
                self.dev.changed_since(since, at, left, RECORDS_PER_QUERY)?
            };
            let covered: u64 = part.iter().map(|r| r.length_bytes).sum();
            if covered == 0 {
                return Err(BdevError::Failed("the device reported no change run".into()).into());
            }
            for r in part {
                let r = ChangeRun {
                    length_bytes: r.length_bytes.min(offset + len - at),
                    ..r
                };
                at += r.length_bytes;
                lull_bdev::push_change(&mut out, r, usize::MAX);
                if at >= offset + len {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// One BlockStatus or ChangedSince request's records.
    fn records(&mut self, op: IoOp, offset: u64, len: u64) -> Result<Vec<u8>, DevIoError> {
        let n = RECORDS_PER_QUERY * EXTENT_RECORD_LEN;
        let mut buf = IoBuf::with_capacity(n);
        buf.set_len(n);
        let len = len.min(u64::from(u32::MAX) & !4095).max(1) as u32;
        let tag = self.next_tag;
        let req = self.request(op, offset, len, Some(buf), tag);
        let c = self.run(vec![req])?.pop().expect("one completion");
        c.result?;
        Ok(c.buf.map(|b| b.as_slice().to_vec()).unwrap_or_default())
    }
}
