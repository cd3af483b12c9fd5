//! From a frame to its answer: the frame's admission (fencing, views,
//! payloads), the request switch (`start_request`), the data channel's
//! submissions and completions, and the replies queued on the pump.

use super::*;

impl Conn {
    /// The header of the frame at the front of the input, or `None` when
    /// it did not decode and the connection was refused or closed.
    fn decode_frame_header(&mut self, raw: &[u8; HEADER_LEN]) -> Option<Header> {
        match proto::decode_header(raw) {
            Ok(h) => Some(h),
            Err(FrameError::BadVersion(version)) => {
                self.wire.inb.consume(HEADER_LEN);
                tracing::warn!(peer = %self.wire.peer(), version, ours = proto::PROTOCOL_VERSION, "peer speaks another protocol version");
                let mut header = [0u8; HEADER_LEN];
                proto::encode_refusal(proto::raw_id(raw), libc::EPROTO as u32, &mut header);
                let payload = self.our_hello(self.current_generation());
                self.wire.out.push(&header, Payload::Bytes(payload));
                self.close(format!(
                    "protocol version {version} is not {}",
                    proto::PROTOCOL_VERSION
                ));
                None
            }
            Err(_)
                if matches!(self.phase, Phase::AwaitHello)
                    && raw[0] == TLS_RECORD_HANDSHAKE
                    && !self.wire.stream.is_tls() =>
            {
                self.wire.set_broken();
                self.wire.refuse(
                    "the peer opens a TLS handshake, and this replica serves plain links \
                     (--insecure): start it with --tls-psk or --tls-certs, or the engine \
                     with --replica-insecure",
                );
                None
            }
            Err(e) => {
                self.wire.inb.consume(HEADER_LEN);
                tracing::warn!(peer = %self.wire.peer(), error = %e, "bad frame header");
                self.close(format!("bad frame: {e}"));
                None
            }
        }
    }

    /// A request frame `h` by its kind; false while its payload is not all
    /// buffered yet (the frame stays where it is).
    fn take_request(&mut self, h: Header) -> bool {
        match (&self.phase, h.kind) {
            (_, Kind::Hello) => return self.take_hello(h),
            (Phase::AwaitHello, kind) => {
                self.wire.inb.consume(HEADER_LEN);
                tracing::warn!(peer = %self.wire.peer(), ?kind, "first frame is not HELLO");
                self.close("first frame is not HELLO");
            }
            // Before anything below counts the request in the fence or
            // waits for the dirty record: a view changes nothing.
            (_, kind) if self.view.is_some() && !served_on_view(kind) => self.refuse_on_view(h),
            (_, Kind::Changed) => return self.take_changed(h),
            (_, Kind::Clone) => return self.take_clone(h),
            (_, kind) if kind.has_change_key() => return self.take_change_key(h),
            (_, Kind::Snapshot) => return self.take_snapshot(h),
            (_, kind) if kind.modifies() || kind == Kind::Detach => self.take_modifying(h),
            _ => {
                self.wire.inb.consume(HEADER_LEN);
                self.start_request(h);
            }
        }
        true
    }

    /// The bytes of `h`'s payload after the header, if they are all in.
    fn payload_end(&self, h: &Header) -> Option<usize> {
        let end = HEADER_LEN + proto::payload_len(h);
        (self.wire.inb.buffered() >= end).then_some(end)
    }

    fn take_hello(&mut self, h: Header) -> bool {
        // The record and the replica's name: at most
        // MAX_HELLO_REQUEST_LEN, checked by `decode_header`.
        let Some(end) = self.payload_end(&h) else {
            return false;
        };
        let decoded = proto::decode_hello_request(&self.wire.inb.peek()[HEADER_LEN..end])
            .map(|(hello, name)| (hello, name.to_string()));
        self.wire.inb.consume(end);
        match decoded {
            Ok((hello, name)) => self.handle_hello(h, hello, &name),
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), error = %e, "bad HELLO");
                self.close(format!("bad HELLO: {e}"));
            }
        }
        true
    }

    fn take_changed(&mut self, h: Header) -> bool {
        // The range's length and a snapshot name: at most
        // MAX_CHANGED_REQUEST_LEN, checked by `decode_header`.
        let Some(end) = self.payload_end(&h) else {
            return false;
        };
        let decoded = proto::decode_changed_request(&self.wire.inb.peek()[HEADER_LEN..end]);
        self.wire.inb.consume(end);
        match decoded {
            Ok(request) => self.changed(h, &request),
            Err(e) => {
                // Framed right, so the stream is in sync: refused,
                // the connection goes on.
                tracing::warn!(peer = %self.wire.peer(), ?h, error = %e, "CHANGED refused: bad request");
                self.push_error(h, libc::EINVAL);
            }
        }
        true
    }

    fn take_clone(&mut self, h: Header) -> bool {
        // The new replica's name: at most MAX_REPLICA_NAME_BYTES,
        // checked by `decode_header`.
        let Some(end) = self.payload_end(&h) else {
            return false;
        };
        let decoded =
            proto::decode_clone_request(&self.wire.inb.peek()[HEADER_LEN..end]).map(str::to_string);
        self.wire.inb.consume(end);
        match (decoded, &self.view) {
            (Ok(name), Some(view)) => {
                let snapshot = view.snapshot.clone();
                self.start_snapshot(h, SnapshotJob::Clone { snapshot, name });
            }
            (Ok(_), None) => {
                tracing::warn!(peer = %self.wire.peer(), ?h,
                    "CLONE refused: it is asked on a snapshot view connection (REPLICA@SNAPSHOT)");
                self.push_error(h, libc::EINVAL);
            }
            (Err(e), _) => {
                tracing::warn!(peer = %self.wire.peer(), ?h, error = %e, "CLONE refused: bad request");
                self.push_error(h, libc::EINVAL);
            }
        }
        true
    }

    fn take_change_key(&mut self, h: Header) -> bool {
        // The key follows the header: at most MAX_CHANGE_KEY_LEN,
        // checked by `decode_header`.
        let kind = h.kind;
        let end = HEADER_LEN + proto::payload_len(&h);
        if let Some(taken) = self.admit_with_payload(h, end) {
            return taken;
        }
        let key = proto::decode_change_key(kind, &self.wire.inb.peek()[HEADER_LEN..end]);
        self.wire.inb.consume(end);
        match key {
            Ok(key) => self.changes_request(h, key),
            Err(e) => {
                if kind.modifies() {
                    self.fence_exit();
                }
                tracing::warn!(peer = %self.wire.peer(), error = %e, "bad change key");
                self.close(format!("bad change key: {e}"));
            }
        }
        true
    }

    fn take_snapshot(&mut self, h: Header) -> bool {
        // The op and the name: at most MAX_SNAPSHOT_REQUEST_LEN,
        // checked by `decode_header`.
        let end = HEADER_LEN + proto::payload_len(&h);
        if let Some(taken) = self.admit_with_payload(h, end) {
            return taken;
        }
        let decoded = proto::decode_snapshot_request(&self.wire.inb.peek()[HEADER_LEN..end]);
        self.wire.inb.consume(end);
        match decoded {
            Ok(request) => self.start_snapshot(h, SnapshotJob::Run(request)),
            Err(e) => {
                // Framed right, so the stream is in sync: a bad op
                // or name is refused, the connection goes on.
                tracing::warn!(peer = %self.wire.peer(), error = %e, "SNAPSHOT refused: bad request");
                self.fence_exit();
                self.push_error(h, libc::EINVAL);
            }
        }
        true
    }

    /// A request that modifies the replica (or DETACH): counted in the
    /// fence before anything is taken (see `crate::fence`).
    fn take_modifying(&mut self, h: Header) {
        if let Err(owner) = self.server().fences.enter(&self.fence) {
            self.wire.inb.consume(HEADER_LEN);
            self.fenced_request(h, owner);
            return;
        }
        if h.kind.modifies() && !self.server().dirty.load(Ordering::SeqCst) {
            self.fence_exit();
            // Leave the frame buffered: it is taken (and counted
            // again) once the record says dirty.
            self.start_meta_wait(MetaFor::Dirty, MetaJob::Attach(0));
            return;
        }
        self.wire.inb.consume(HEADER_LEN);
        self.start_request(h);
    }

    /// An error reply, after draining a write's payload.
    /// For a request whose small payload is taken with its header (a
    /// change key, a SNAPSHOT): `Some(false)` while the payload is not all
    /// buffered; for a modifying one, `Some(true)` when it was refused
    /// (a fenced session) or waits (the record must say dirty first; the
    /// frame stays buffered and is taken, and counted, again then).
    /// `None`: go on, counted in the fence if it modifies.
    pub(super) fn admit_with_payload(&mut self, h: Header, end: usize) -> Option<bool> {
        if self.wire.inb.buffered() < end {
            return Some(false);
        }
        if h.kind.modifies() {
            if let Err(owner) = self.server().fences.enter(&self.fence) {
                self.wire.inb.consume(end);
                self.fenced_request(h, owner);
                return Some(true);
            }
            if !self.server().dirty.load(Ordering::SeqCst) {
                self.fence_exit();
                self.start_meta_wait(MetaFor::Dirty, MetaJob::Attach(0));
                return Some(true);
            }
        }
        None
    }

    /// A request a view does not serve ([`served_on_view`]): `EROFS`,
    /// after draining whatever payload it carries (a write's, a change
    /// key, a SNAPSHOT's op and name), so the stream stays in sync and the
    /// connection goes on. Nothing was counted or noted for it.
    pub(super) fn refuse_on_view(&mut self, req: Header) {
        self.wire.inb.consume(HEADER_LEN);
        tracing::warn!(peer = %self.wire.peer(), ?req, snapshot = self.view.as_ref().map(|v| v.snapshot.as_str()),
            "refused request: a snapshot view is read-only");
        let payload = proto::payload_len(&req) as u64;
        if payload > 0 {
            self.recv = Recv::drain(payload, req, libc::EROFS as u32);
        } else {
            self.push_error(req, libc::EROFS);
        }
    }

    pub(super) fn refuse(&mut self, req: Header, errno: i32) {
        if req.kind.is_write() && req.length > 0 {
            self.recv = Recv::drain(u64::from(req.length), req, errno as u32);
        } else {
            self.push_error(req, errno);
        }
    }

    /// A decoded request on a connection past HELLO. Modifying requests
    /// and DETACH arrive counted in the fence; every path below that
    /// answers or drops one without a slot gives the count back.
    pub(super) fn start_request(&mut self, req: Header) {
        let counted = req.kind.modifies() || req.kind == Kind::Detach;
        if !matches!(self.phase, Phase::Ready { .. }) {
            debug_assert!(false, "start_request before HELLO");
            if counted {
                self.fence_exit();
            }
            return;
        }
        if req.kind != Kind::Ping && self.drop_draws.chance(self.port.faults.drop) {
            tracing::warn!(peer = %self.wire.peer(), ?req, "fault injection: dropping the connection");
            if counted {
                self.fence_exit();
            }
            self.close("fault injection (--fault-drop)");
            return;
        }
        match req.kind {
            Kind::Ping => {
                self.push_reply(req.reply_with(0), Payload::None);
                return;
            }
            Kind::IntentGet => return self.intent_get(req),
            Kind::IntentMark | Kind::IntentClear => return self.intent_update(req),
            Kind::SnapshotList => return self.start_snapshot(req, SnapshotJob::List),
            Kind::Snapshot | Kind::Changed | Kind::Clone => {
                // `take_frame` takes these with their payload.
                debug_assert!(false, "{:?} handled in take_frame", req.kind);
                if counted {
                    self.fence_exit();
                }
                self.push_error(req, libc::EINVAL);
                return;
            }
            Kind::Detach => return self.start_meta_wait(MetaFor::Detach(req), MetaJob::Detach),
            Kind::Grow => return self.start_snapshot(req, SnapshotJob::Grow(req.offset)),
            _ => {}
        }
        let size = self.server().size_bytes();
        let in_range = req
            .offset
            .checked_add(u64::from(req.length))
            .is_some_and(|end| end <= size);
        if !in_range && req.kind != Kind::Flush {
            tracing::warn!(peer = %self.wire.peer(), ?req, "refused request: out of range");
            if counted {
                self.fence_exit();
            }
            self.refuse(req, libc::EINVAL);
            return;
        }
        let op = match req.kind {
            Kind::Extents => {
                let (dev, layered) = self.data_device();
                self.extents(req, &*dev, layered);
                return;
            }
            Kind::BlockStatus => {
                let (dev, layered) = self.data_device();
                self.block_status(req, &*dev, layered);
                return;
            }
            // Nothing to do for an empty range; the device need not see it.
            Kind::Read | Kind::Write | Kind::WriteFua | Kind::Trim | Kind::WriteZeroes
                if req.length == 0 =>
            {
                self.push_reply(req.reply_with(0), Payload::None);
                if counted {
                    self.fence_exit();
                }
                return;
            }
            Kind::Write | Kind::WriteFua | Kind::Trim | Kind::WriteZeroes => {
                // In range and not empty: every change record notes it
                // before it can reach the data.
                self.server()
                    .intent
                    .note_write(req.offset, u64::from(req.length));
                match req.kind {
                    Kind::Write => IoOp::Write { fua: false },
                    Kind::WriteFua => IoOp::Write { fua: true },
                    Kind::Trim => IoOp::Trim,
                    _ => IoOp::WriteZeroes {
                        no_hole: false,
                        fua: false,
                        fast: false,
                    },
                }
            }
            Kind::Read => IoOp::Read,
            Kind::Flush => IoOp::Flush,
            Kind::Ping
            | Kind::Hello
            | Kind::Detach
            | Kind::IntentMark
            | Kind::IntentClear
            | Kind::IntentGet
            | Kind::ChangesStart
            | Kind::ChangesGet
            | Kind::ChangesDrop
            | Kind::Snapshot
            | Kind::SnapshotList
            | Kind::Changed
            | Kind::Clone
            | Kind::Grow => {
                debug_assert!(false, "{:?} handled above", req.kind);
                return;
            }
        };
        if matches!(op, IoOp::Read) && req.length >= SENDFILE_READ_BYTES_MIN && self.wire.splices()
        {
            if let Some(file) = self.sendfile_file() {
                // Straight from the page cache, in order with the other
                // replies. The socket's bytes are the file's pages, read
                // when the engine receives them (docs/PER_IO.md, "Spliced
                // reads": the engine has no write to the range
                // outstanding then).
                let payload = Payload::File {
                    file,
                    offset: req.offset,
                    len: req.length as usize,
                };
                self.server().sendfile_reads.fetch_add(1, Ordering::Relaxed);
                self.push_reply(req.reply_with(0), payload);
                return;
            }
        }
        // From here the slot holds the fence count, until `complete` or
        // `release_slot`.
        let Some(slot) = self.slots.insert(req) else {
            debug_assert!(false, "take_frame checked for a free slot");
            if counted {
                self.fence_exit();
            }
            self.push_error(req, libc::EAGAIN);
            return;
        };
        match op {
            IoOp::Read => {
                let buf = bufs::get(req.length as usize);
                self.submit(slot, &req, op, Some(buf));
            }
            IoOp::Write { .. } => {
                let buf = bufs::get(req.length as usize);
                self.recv = Recv::payload(slot, req, buf);
            }
            _ => self.submit(slot, &req, op, None),
        }
    }

    /// The data channel: the view's on a view connection (no faults
    /// injected there: `--fault-*` wraps the live chain), else the chain's
    /// (behind the fault injector when there is one).
    pub(super) fn open_channel(&self) -> Option<Box<dyn Channel>> {
        let opened = match (&self.view, &self.server().faulty) {
            (Some(view), _) => view.dev.open_channel(),
            (None, Some(faulty)) => faulty.open_channel(),
            (None, None) => self.server().chain.open_channel(),
        };
        match opened {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::error!(peer = %self.wire.peer(), error = %e, "cannot open a data file channel");
                None
            }
        }
    }

    /// Move channel completions into the reply queue.
    pub(super) fn reap(&mut self) -> bool {
        let Phase::Ready { channel } = &mut self.phase else {
            return false;
        };
        let mut done = std::mem::take(&mut self.completions);
        let n = channel.reap(&mut |c| done.push(c));
        for c in done.drain(..) {
            self.complete(c);
        }
        self.completions = done;
        n > 0
    }

    pub(super) fn complete(&mut self, c: IoCompletion) {
        let Some(req) = self.slots.take(c.tag) else {
            tracing::error!(peer = %self.wire.peer(), tag = c.tag, "completion for an unknown slot");
            return;
        };
        match c.result {
            Ok(()) if req.kind == Kind::Read => match c.buf {
                Some(buf) if buf.len() == req.length as usize => {
                    self.push_reply(req.reply_with(0), Payload::Buf(buf));
                }
                other => {
                    tracing::error!(peer = %self.wire.peer(), id = req.id, "read completed without its buffer");
                    if let Some(b) = other {
                        bufs::put(b);
                    }
                    self.push_reply(req.reply_with(libc::EIO as u32), Payload::None);
                }
            },
            Ok(()) => {
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.push_reply(req.reply_with(0), Payload::None);
            }
            Err(e) if e.errno() == libc::ENOSPC => {
                let r = self.server();
                tracing::error!(peer = %self.wire.peer(), replica = r.name.as_deref().unwrap_or(""),
                    dir = %r.dir.display(), kind = ?req.kind, offset = req.offset, length = req.length,
                    "no space left for the replica's data (ENOSPC): this request fails on this replica, and its engine fails the replica");
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.push_reply(req.reply_with(libc::ENOSPC as u32), Payload::None);
            }
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), id = req.id, kind = ?req.kind, offset = req.offset,
                    length = req.length, error = %e, "I/O failed");
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.push_reply(req.reply_with(e.errno().unsigned_abs()), Payload::None);
            }
        }
        if req.kind.modifies() {
            self.fence_exit();
        }
    }

    pub(super) fn push_reply(&mut self, reply: Header, payload: Payload) {
        let mut header = [0u8; HEADER_LEN];
        let encoded = proto::encode_header(&reply, &mut header);
        if let Err(e) = encoded {
            // Our own reply broke a protocol limit: a bug, not input.
            tracing::error!(peer = %self.wire.peer(), ?reply, error = %e, "cannot encode reply");
            self.close("internal error");
            if let Payload::Buf(b) = payload {
                bufs::put(b);
            }
            return;
        }
        debug_assert_eq!(
            proto::payload_len(&reply),
            payload.as_ref().len() + payload.tail_len()
        );
        self.wire.push(&header, payload);
    }

    pub(super) fn push_error(&mut self, req: Header, errno: i32) {
        self.push_reply(req.reply_with(errno as u32), Payload::None);
    }

    /// Whether a new request may be taken (back-pressure).
    pub(super) fn can_take_request(&self) -> bool {
        !self.slots.is_full()
            && self.wire.out.bytes() < MAX_REPLY_QUEUE_BYTES
            && !self.subs.holding()
    }

    /// The file a READ reply may go from with `sendfile`, decided per
    /// request: the chain's only layer's while it has one layer (every
    /// request then passes straight to that file, so its pages are the
    /// volume's bytes); none once it has snapshots (a block may be in any
    /// layer). Looked up again only when the chain's layers generation
    /// moved: one atomic load per read otherwise.
    ///
    /// A reply queued just before a snapshot is still right, though the
    /// socket reads its bytes from the file after the snapshot: the
    /// snapshot freezes that file as it is (every write acknowledged
    /// before it is in it) and sends later writes to the new head, so the
    /// range keeps its bytes there; and the engine sends no write to a
    /// range while a read of it is outstanding (docs/PER_IO.md, "Spliced
    /// reads"). The only layer never leaves a chain by being dropped, only
    /// frozen (a revert or a merge drops layers only when there are
    /// snapshots), and a file unlinked later stays readable through the
    /// descriptor the reply holds.
    ///
    /// A generation that moved during the lookup leaves this request
    /// without `sendfile`. One that did not may hide a state a control
    /// operation is installing (it sets the state, then the generation),
    /// which it does under its quiesce, with the layer it freezes synced
    /// or the merge into the child done: the answer fits either state.
    ///
    /// None on a view connection: the head file holds the live data, not
    /// the snapshot's.
    pub(super) fn sendfile_file(&mut self) -> Option<Arc<File>> {
        let r = self.replica.as_ref()?;
        if !r.sendfile || self.view.is_some() {
            return None;
        }
        let generation = r.chain.layers_generation();
        if let Some((seen, file)) = &self.sendfile_cache {
            if *seen == generation {
                return file.clone();
            }
        }
        let file = r
            .chain
            .single_layer_id()
            .and_then(|id| r.layers.page_cache_file(id));
        if r.chain.layers_generation() != generation {
            return None;
        }
        self.sendfile_cache = Some((generation, file.clone()));
        file
    }

    /// Frees a slot whose request is abandoned (a write whose payload
    /// never fully arrived).
    pub(super) fn release_slot(&mut self, slot: SlotId) {
        if let Some(req) = self.slots.take(slot.to_wire()) {
            if req.kind.modifies() {
                self.fence_exit();
            }
        }
    }

    pub(super) fn submit(&mut self, slot: SlotId, req: &Header, op: IoOp, buf: Option<IoBuf>) {
        let io = IoRequest {
            tag: slot.to_wire(),
            op,
            offset: req.offset,
            len: req.length,
            buf,
        };
        self.submit_io(io);
    }

    pub(super) fn submit_io(&mut self, io: IoRequest) {
        let Phase::Ready { channel } = &mut self.phase else {
            return;
        };
        if let Some(done) = self.subs.queued(channel.queue(io)) {
            self.complete(done);
        }
    }

    /// Pushes the requests queued since the last push (`Submissions`).
    pub(super) fn flush_submissions(&mut self) {
        if !self.subs.take_unflushed() {
            return;
        }
        if let Phase::Ready { channel } = &mut self.phase {
            channel.flush_submissions();
        }
    }

    pub(super) fn retry_submit(&mut self) -> bool {
        let Some(io) = self.subs.retry() else {
            return false;
        };
        self.submit_io(io);
        !self.subs.holding()
    }
}

/// Frames and their write payloads (`lull_net::wire` moves the bytes).
impl wire::ReceiveFrames for Conn {
    type Frame = Header;
    const EOF_IN_PAYLOAD_REASON: &'static str =
        "peer disconnected in the middle of a write payload";

    fn recv(&mut self) -> &mut Recv<Header> {
        &mut self.recv
    }

    /// A frame header: HELLO first, then requests (see the module doc).
    fn take_frame(&mut self) -> bool {
        if self.wire.inb.buffered() < HEADER_LEN {
            return false;
        }
        if self.wait.is_some() {
            return false;
        }
        if matches!(self.phase, Phase::Ready { .. }) && !self.can_take_request() {
            return false;
        }
        let mut raw = [0u8; HEADER_LEN];
        raw.copy_from_slice(&self.wire.inb.peek()[..HEADER_LEN]);
        if self.refuse_plain {
            self.refuse_plaintext(&raw);
            return true;
        }
        let Some(h) = self.decode_frame_header(&raw) else {
            return true;
        };
        if h.reply {
            self.wire.inb.consume(HEADER_LEN);
            tracing::warn!(peer = %self.wire.peer(), ?h, "peer sent a reply frame");
            self.close("unexpected reply frame");
            return true;
        }
        self.take_request(h)
    }

    fn payload_received(&mut self, slot: SlotId, req: Header, buf: IoBuf) {
        let op = IoOp::Write {
            fua: req.kind == Kind::WriteFua,
        };
        self.submit(slot, &req, op, Some(buf));
    }

    fn payload_lost(&mut self, slot: SlotId) {
        self.release_slot(slot);
    }

    fn drained(&mut self, req: Header, status: u32) {
        self.push_error(req, status as i32);
    }
}

/// Whether a view connection serves `kind` (from its snapshot); it
/// answers every other request `EROFS` (`Conn::refuse_on_view`). Every
/// kind is named, so a new one is placed here on purpose.
pub(super) fn served_on_view(kind: Kind) -> bool {
    match kind {
        Kind::Hello
        | Kind::Read
        | Kind::BlockStatus
        | Kind::Extents
        | Kind::Changed
        | Kind::Clone
        | Kind::Ping => true,
        Kind::Write
        | Kind::WriteFua
        | Kind::Flush
        | Kind::Trim
        | Kind::WriteZeroes
        | Kind::Detach
        | Kind::IntentMark
        | Kind::IntentClear
        | Kind::IntentGet
        | Kind::ChangesStart
        | Kind::ChangesGet
        | Kind::ChangesDrop
        | Kind::Snapshot
        | Kind::SnapshotList
        | Kind::Grow => false,
    }
}
