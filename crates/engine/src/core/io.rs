//! Client requests: the request table, the pending queue, overlap
//! tracking (overlapping writes are serialised), dispatch to the replicas
//! and completion. A request's entry (`ClientIo`) is in `types`.

use lull_bdev::{BdevError, IoBuf, IoOp};
use lull_proto::replica::{self as proto, Header, Kind};
use lull_uring::pipes::SplicePipe;

use super::ids::{ConnId, ConnRef, ReplicaId, ReplicaSet, MAX_REPLICAS};
use super::types::{
    Action, ClientIo, ClientReq, Engine, IoData, IoId, Payload, Received, Sink, Sub, SubKind,
    MAX_CLIENT_IOS,
};

/// Requests that wait for their regions' MARKs and that later requests
/// may pass, and pending requests looked at past them to send their MARKs
/// too, so that the replicas persist a burst of newly written regions in
/// one fsync instead of one after the other. 64 is the queue depth of a
/// busy client; the bound keeps each pass over the queue short.
pub const MARK_LOOKAHEAD: usize = 64;

/// What `dispatch` did with a pending request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dispatch {
    /// Sent, or finished (failed or nothing to do): off the queue.
    Done,
    /// Must wait for slots, an overlapping write or the rebuild lock.
    Wait,
    /// Waits only for its regions' MARKs (sent): later requests may pass.
    WaitMarks,
}

pub(super) fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

pub(super) fn eio(why: &str) -> BdevError {
    BdevError::Failed(why.to_string())
}

impl Engine {
    // ---- client requests -----------------------------------------------

    /// Answer a client request at once, before it becomes an I/O (refused,
    /// or nothing to do), its buffer handed back.
    fn answer_now(
        &mut self,
        channel: u64,
        req: &mut lull_bdev::IoRequest,
        result: Result<(), BdevError>,
    ) {
        let buf = req.buf.take();
        self.out.push(Action::Complete {
            channel,
            tag: req.tag,
            result,
            buf,
            spliced: None,
        });
    }

    pub(super) fn on_client(&mut self, req: ClientReq) {
        let (channel, takes_pipe, since, mut req) =
            (req.channel, req.takes_pipe, req.since, req.io);
        if req.op == IoOp::ChangedSince && since.is_none() {
            let e = BdevError::BadRequest("changed-since without a snapshot to compare with");
            return self.answer_now(channel, &mut req, Err(e));
        }
        if self.detach.is_some() {
            let e = BdevError::Failed("the volume is detaching (engine shutting down)".into());
            return self.answer_now(channel, &mut req, Err(e));
        }
        if let Err(e) = lull_bdev::validate_request(&req, self.size_bytes) {
            return self.answer_now(channel, &mut req, Err(e));
        }
        if matches!(req.op, IoOp::Read | IoOp::Write { .. }) && req.len > proto::MAX_IO_BYTES {
            let e =
                BdevError::BadRequest("request larger than the replica protocol's MAX_IO_BYTES");
            return self.answer_now(channel, &mut req, Err(e));
        }
        if req.len == 0 && !matches!(req.op, IoOp::Flush) {
            return self.answer_now(channel, &mut req, Ok(()));
        }
        if self.ios.is_full() {
            let e = BdevError::Full {
                capacity: MAX_CLIENT_IOS,
            };
            return self.answer_now(channel, &mut req, Err(e));
        }
        let data = match req.op {
            IoOp::Read | IoOp::BlockStatus | IoOp::ChangedSince => IoData::Read(req.buf.take()),
            IoOp::Write { .. } => match req.buf.take() {
                Some(b) => IoData::Write(self.shares.share(b)),
                None => IoData::None,
            },
            _ => IoData::None,
        };
        let flush_after = matches!(req.op, IoOp::WriteZeroes { fua: true, .. });
        let Some(id) = self.ios.insert(ClientIo {
            channel,
            takes_pipe,
            tag: req.tag,
            op: req.op,
            offset: req.offset,
            len: req.len,
            data,
            outstanding: 0,
            acked: ReplicaSet::EMPTY,
            flush_after,
            in_regions: false,
            since,
        }) else {
            debug_assert!(false, "checked for room above");
            return;
        };
        self.pending.push_back(id.to_wire());
    }

    /// Complete client request `id` and free its entry.
    pub(super) fn finish_io(&mut self, id: IoId, result: Result<(), BdevError>) {
        self.complete_io(id, result, None);
    }

    /// [`Engine::finish_io`], with a READ's data in the pipe it was spliced
    /// into, if it was.
    fn complete_io(
        &mut self,
        id: IoId,
        result: Result<(), BdevError>,
        spliced: Option<SplicePipe>,
    ) {
        self.release_regions(id);
        let Some(io) = self.ios.take(id) else {
            return;
        };
        self.forget_write(id);
        let buf = match io.data {
            IoData::None => None,
            IoData::Read(b) => b,
            IoData::Write(shared) => match self.shares.unshare(shared) {
                Ok(b) => Some(b),
                Err(shared) => {
                    // A send queue still holds the buffer (cannot happen: a
                    // replica answers only after the whole frame, and a
                    // failed connection's queue is closed first). Copy so
                    // the client still gets a buffer back.
                    let mut b = lull_net::bufs::get(shared.len());
                    b.as_mut_slice().copy_from_slice(shared.as_slice());
                    Some(b)
                }
            },
        };
        self.out.push(Action::Complete {
            channel: io.channel,
            tag: io.tag,
            result,
            buf,
            spliced,
        });
    }

    /// `id` is no longer a write in flight (finished, or turned into its
    /// FLUSH, or waiting for a generation bump).
    fn forget_write(&mut self, id: IoId) {
        if let Some(p) = self.writes_in_flight.iter().position(|&(w, ..)| w == id) {
            self.writes_in_flight.swap_remove(p);
        }
    }

    /// Every replica answered (or failed) a write-like request or FLUSH.
    pub(super) fn io_subs_done(&mut self, id: IoId) {
        // Every replica it went to has answered: nothing of it is in
        // flight in its regions any more.
        self.release_regions(id);
        let healthy = self.healthy_set();
        let Some(io) = self.ios.get_mut(id) else {
            return;
        };
        if !io.acked.intersects(healthy) {
            self.finish_io(id, Err(eio("no healthy replica acknowledged the request")));
            return;
        }
        if io.flush_after {
            io.flush_after = false;
            io.op = IoOp::Flush;
            io.acked = ReplicaSet::EMPTY;
            self.forget_write(id);
            self.pending.push_front(id);
            return;
        }
        if self.bump.is_some() {
            self.forget_write(id);
            self.deferred.push(id);
        } else {
            self.finish_io(id, Ok(()));
        }
    }

    /// Try to send pending request `id`: done (sent or finished), or it
    /// must wait (slots full, overlap with a write in flight or the rebuild
    /// lock), or it waits only for its regions' MARKs.
    fn dispatch(&mut self, id: IoId) -> Dispatch {
        let healthy = self.healthy_set();
        if healthy.is_empty() {
            self.finish_io(id, Err(eio("no healthy replica")));
            return Dispatch::Done;
        }
        let Some(io) = self.ios.get(id) else {
            return Dispatch::Done;
        };
        let (op, offset, len) = (io.op, io.offset, io.len);
        // A read, a block status or a changed-since goes to one healthy
        // replica: in sync, not rebuilding or reconciling, so what it says
        // is what every healthy replica would read there.
        if matches!(op, IoOp::Read | IoOp::BlockStatus | IoOp::ChangedSince) {
            let (kind, length, payload) = match op {
                IoOp::Read => (Kind::Read, len, None),
                IoOp::BlockStatus => (Kind::BlockStatus, len, None),
                _ => {
                    let since = io.since.as_deref().unwrap_or_default().to_string();
                    match proto::encode_changed_request(&proto::ChangedRequest {
                        length: len,
                        since,
                    }) {
                        Ok(p) => (Kind::Changed, p.len() as u32, Some(p)),
                        Err(e) => {
                            self.finish_io(id, Err(BdevError::Failed(format!("CHANGED: {e}"))));
                            return Dispatch::Done;
                        }
                    }
                }
            };
            let n = self.replicas.len();
            for k in 0..n {
                let r = ReplicaId::new((self.read_rr + k) % n);
                if !healthy.contains(r) {
                    continue;
                }
                let payload = payload.clone().map_or(Payload::None, Payload::Control);
                if self.send_any(r, SubKind::Client(id), kind, offset, length, payload) {
                    self.read_rr = (r.get() + 1) % n;
                    if let Some(io) = self.ios.get_mut(id) {
                        io.outstanding = 1;
                    }
                    return Dispatch::Done;
                }
            }
            return Dispatch::Wait;
        }
        let io_range = (offset, offset + u64::from(len));
        let modifies = !matches!(op, IoOp::Flush);
        if modifies {
            // A replica just left: its change records must be in place on
            // every healthy replica before they take another write.
            if self.changes_starting > 0 {
                return Dispatch::Wait;
            }
            // A snapshot operation holds new writes until every replica
            // has answered it (`snapshot`).
            if self.snapshot_holds_writes() || self.grow_holds_writes() {
                return Dispatch::Wait;
            }
            if self.rebuild.as_ref().is_some_and(|rb| rb.locks(io_range)) {
                return Dispatch::Wait;
            }
            if self
                .writes_in_flight
                .iter()
                .any(|&(_, start, end)| overlaps((start, end), io_range))
            {
                return Dispatch::Wait;
            }
        }
        let targets = self.write_set();
        if modifies {
            let (first, last) = self.region_span(offset, u64::from(len));
            if !self.ensure_marked(first, last, targets) {
                return Dispatch::WaitMarks;
            }
        }
        // All or nothing: every target needs a free slot now.
        let mut conns: [Option<ConnId>; MAX_REPLICAS] = [None; MAX_REPLICAS];
        for r in targets.iter() {
            match self.pick_conn(r) {
                Some(c) => conns[r.get()] = Some(c),
                None => return Dispatch::Wait,
            }
        }
        let (kind, payload_buf) = match (&self.ios.get(id).map(|i| &i.data), op) {
            (Some(IoData::Write(b)), IoOp::Write { fua }) => (
                if fua { Kind::WriteFua } else { Kind::Write },
                Some(b.clone()),
            ),
            (_, IoOp::Trim) => (Kind::Trim, None),
            (_, IoOp::WriteZeroes { .. }) => (Kind::WriteZeroes, None),
            (_, IoOp::Flush) => (Kind::Flush, None),
            _ => {
                self.finish_io(id, Err(BdevError::BadRequest("write without a buffer")));
                return Dispatch::Done;
            }
        };
        let (w_off, w_len) = if kind == Kind::Flush {
            (0, 0)
        } else {
            (offset, len)
        };
        let mut sent = 0;
        for r in targets.iter() {
            let Some(c) = conns[r.get()] else {
                continue;
            };
            let payload = match &payload_buf {
                Some(b) => Payload::Data {
                    buf: b.clone(),
                    len: len as usize,
                },
                None => Payload::None,
            };
            if self.send(r, c, SubKind::Client(id), kind, w_off, w_len, payload) {
                sent += 1;
            }
        }
        if let Some(io) = self.ios.get_mut(id) {
            io.outstanding = sent;
            io.acked = ReplicaSet::EMPTY;
        }
        if modifies {
            self.writes_in_flight.push((id, io_range.0, io_range.1));
            self.hold_regions(id);
        }
        if sent == 0 {
            self.io_subs_done(id);
        }
        Dispatch::Done
    }

    /// Where the payload of frame `h`, arriving on connection `c`, is to
    /// be received. The receiver (the shell's socket; the simulator alike)
    /// asks once per frame whose header announces a payload
    /// (`proto::payload_len(h) > 0`), when the header has arrived and
    /// before any byte of the payload is read, and gives the sink back
    /// with the frame in [`Event::Frame`](super::Event::Frame) as
    /// [`Received`] (or drops it with the connection, if that fails
    /// first). The payload always fits: every buffer given is
    /// `payload_len(h)` bytes long.
    ///
    /// A successful READ reply to a client read goes straight into the
    /// client's own buffer ([`Sink::ClientBuffer`], or [`Sink::Pipe`] when
    /// the client's channel takes pipes), taken out of the request now:
    /// the frame puts it back, or, if this connection fails first, the
    /// read is retried on another replica into a buffer of the engine's.
    /// Anything else gets a buffer from the thread's cache
    /// ([`Sink::Own`], [`Engine::get_buf`]).
    ///
    /// Nothing else changes and no action follows: what the frame means
    /// (an answer, or a protocol error whose buffer is dropped with it) is
    /// decided when it arrives, in `apply`, like any other event.
    pub fn payload_sink(&mut self, c: ConnRef, h: &Header) -> Sink {
        let len = proto::payload_len(h);
        debug_assert!(len > 0, "payload_sink for a frame without payload");
        match self.client_read_buf(c, h, len) {
            Some((buf, true)) => Sink::Pipe(buf),
            Some((buf, false)) => Sink::ClientBuffer(buf),
            None if self.is_copy_read(c, h) => Sink::Pipe(self.get_buf(len)),
            None => Sink::Own(self.get_buf(len)),
        }
    }

    /// Whether `h` answers a rebuild or reconcile READ with data: it may
    /// be spliced into a pipe and from there into the target's socket.
    fn is_copy_read(&self, c: ConnRef, h: &Header) -> bool {
        h.reply
            && h.kind == Kind::Read
            && h.status == 0
            && self.live_conn(c).is_some_and(|r| {
                self.replicas[r].conns[c.conn]
                    .slots
                    .get(h.id)
                    .is_some_and(|s| matches!(s.what, SubKind::Rebuild(_)))
            })
    }

    /// The client's buffer for `len` bytes of read reply `h`, and whether
    /// its channel takes pipes.
    fn client_read_buf(&mut self, c: ConnRef, h: &Header, len: usize) -> Option<(IoBuf, bool)> {
        if !h.reply || h.kind != Kind::Read || h.status != 0 {
            return None;
        }
        let r = self.live_conn(c)?;
        let sub = self.replicas[r].conns[c.conn].slots.get(h.id)?;
        let SubKind::Client(id) = sub.what else {
            return None;
        };
        if sub.kind != Kind::Read || sub.length as usize != len {
            return None; // on_frame refuses it; a fresh buffer takes it
        }
        let io = self.ios.get_mut(id)?;
        let IoData::Read(slot) = &mut io.data else {
            return None;
        };
        let mut buf = slot.take_if(|b| b.capacity() >= len)?;
        buf.set_len(len);
        Some((buf, io.takes_pipe))
    }

    pub(super) fn on_client_reply(
        &mut self,
        r: ReplicaId,
        sub: Sub,
        id: IoId,
        h: Header,
        payload: Received,
    ) {
        if self.ios.get(id).is_none() {
            debug_assert!(false, "reply for a finished client request");
            return;
        }
        if h.kind == Kind::Changed && matches!(h.status as i32, libc::ENOENT | libc::EINVAL) {
            // A refusal of what was asked (no such snapshot, or not
            // older), not a failure of the replica: the client hears it.
            if let Some(b) = payload.into_buf() {
                lull_net::bufs::put(b);
            }
            let since = self.ios.get(id).and_then(|io| io.since.clone());
            if let Some(io) = self.ios.get_mut(id) {
                io.outstanding = 0;
            }
            let e = BdevError::NoSuchSnapshot(since.as_deref().unwrap_or_default().to_string());
            return self.finish_io(id, Err(e));
        }
        if h.status != 0 {
            if let Some(b) = payload.into_buf() {
                lull_net::bufs::put(b);
            }
            self.sub_failed(r, sub);
            let why = format!(
                "{:?} [{}, +{}) failed with errno {}",
                h.kind, h.offset, h.length, h.status
            );
            return self.fail_replica(r, &why, false);
        }
        if matches!(h.kind, Kind::BlockStatus | Kind::Changed) {
            return self.on_status_reply(r, sub, id, h, payload.into_buf());
        }
        if h.kind == Kind::Read {
            let (mut data, spliced) = match payload {
                Received::Buf(b) => (b, None),
                Received::Spliced { buf, pipe } => (buf, Some(pipe)),
                Received::None => {
                    return self.protocol_error(r, Some(sub), "READ reply without data".into())
                }
            };
            if data.len() != sub.length as usize {
                // A pipe with it closes here, and its data with it.
                lull_net::bufs::put(data);
                return self.protocol_error(r, Some(sub), "READ reply of the wrong length".into());
            }
            data.set_len(sub.length as usize);
            if let Some(io) = self.ios.get_mut(id) {
                io.outstanding = 0;
                // Hand the received buffer to the client; recycle theirs
                // (none when it was received into theirs: `payload_sink`).
                if let IoData::Read(slot) = &mut io.data {
                    if let Some(old) = slot.replace(data) {
                        lull_net::bufs::put(old);
                    }
                }
            }
            return self.complete_io(id, Ok(()), spliced);
        }
        if let Some(b) = payload.into_buf() {
            lull_net::bufs::put(b);
        }
        let Some(io) = self.ios.get_mut(id) else {
            return;
        };
        io.acked.insert(r);
        io.outstanding -= 1;
        if io.outstanding == 0 {
            self.io_subs_done(id);
        }
    }

    /// A BLOCK_STATUS or CHANGED reply: checked (it covers a prefix of the
    /// request's range), then written into the client's buffer as
    /// `lull_bdev` records (extents, or change runs), as many as it has
    /// room for (one for NBD's REQ_ONE).
    fn on_status_reply(
        &mut self,
        r: ReplicaId,
        sub: Sub,
        id: IoId,
        h: Header,
        payload: Option<IoBuf>,
    ) {
        let what = h.kind;
        let Some(data) = payload else {
            return self.protocol_error(r, Some(sub), format!("{what:?} reply without records"));
        };
        let parsed = proto::decode_block_status(data.as_slice());
        lull_net::bufs::put(data);
        let ext = match parsed {
            Ok(ext) => ext,
            Err(e) => return self.protocol_error(r, Some(sub), format!("bad {what:?} reply: {e}")),
        };
        let Some(io) = self.ios.get_mut(id) else {
            return;
        };
        // decode_block_status checked that the sum does not overflow.
        let covered: u64 = ext.iter().map(|e| e.length).sum();
        if h.offset != io.offset || covered > u64::from(io.len) {
            return self.protocol_error(
                r,
                Some(sub),
                format!("{what:?} reply outside the requested range"),
            );
        }
        io.outstanding = 0;
        if let IoData::Read(Some(buf)) = &mut io.data {
            let n = if what == Kind::Changed {
                let runs: Vec<lull_bdev::ChangeRun> = ext
                    .iter()
                    .map(|e| lull_bdev::ChangeRun {
                        length_bytes: e.length,
                        changed: e.flags & proto::STATUS_CHANGED != 0,
                    })
                    .collect();
                lull_bdev::put_change_records(&runs, buf.as_mut_slice())
            } else {
                let extents: Vec<lull_bdev::Extent> = ext
                    .iter()
                    .map(|e| lull_bdev::Extent {
                        length_bytes: e.length,
                        hole: e.flags & proto::STATUS_HOLE != 0,
                        zero: e.flags & proto::STATUS_ZERO != 0,
                    })
                    .collect();
                lull_bdev::put_extent_records(&extents, buf.as_mut_slice())
            };
            buf.set_len(n);
        }
        self.finish_io(id, Ok(()))
    }

    /// The first pending write waits for MARKs: send those of the writes
    /// queued behind it too, so the replicas persist them in one go.
    fn mark_ahead(&mut self) {
        let targets = self.write_set();
        let ahead: Vec<(u64, u64)> = self
            .pending
            .iter()
            .skip(1)
            .take(MARK_LOOKAHEAD)
            .filter_map(|&id| self.ios.get(id))
            .filter(|io| io.modifies())
            .map(|io| (io.offset, u64::from(io.len)))
            .collect();
        for (offset, len) in ahead {
            let (first, last) = self.region_span(offset, len);
            self.ensure_marked(first, last, targets);
        }
    }

    /// Send what can go of the pending requests.
    pub(super) fn dispatch_pending(&mut self) {
        // Requests go in order, except that one waiting only for its
        // regions' MARKs is set aside (parked) and those behind it may pass
        // it, as long as they overlap no parked request and are not a
        // FLUSH: overlapping writes keep their order, and a new volume's
        // first writes do not all queue behind one fdatasync.
        let mut parked: Vec<IoId> = Vec::new();
        let mut parked_ranges: Vec<(u64, u64)> = Vec::new();
        let mut waits_for_marks = false;
        while let Some(&id) = self.pending.front() {
            let Some(io) = self.ios.get(id) else {
                debug_assert!(false, "pending request {id} has no entry");
                self.pending.pop_front();
                continue;
            };
            let range = (io.offset, io.end());
            if !parked.is_empty()
                && (matches!(io.op, IoOp::Flush)
                    || parked_ranges.iter().any(|&p| overlaps(p, range)))
            {
                break;
            }
            match self.dispatch(id) {
                Dispatch::Done => {
                    // dispatch may have pushed the id back (no: only
                    // failures do); pop exactly the entry we looked at.
                    if self.pending.front() == Some(&id) {
                        self.pending.pop_front();
                    }
                    continue;
                }
                Dispatch::Wait => break,
                Dispatch::WaitMarks => waits_for_marks = true,
            }
            if parked.len() >= MARK_LOOKAHEAD {
                break;
            }
            self.pending.pop_front();
            parked.push(id);
            parked_ranges.push(range);
        }
        for id in parked.into_iter().rev() {
            self.pending.push_front(id);
        }
        if waits_for_marks {
            self.mark_ahead();
        }
    }
}
