//! One NVMe/TCP queue pair (a TCP connection), run by its poller in a
//! poll group on the shared pump (`lull_net::wire`).
//!
//! The life of a queue pair: ICReq → ICResp (digests, alignment,
//! MAXH2CDATA), then a Fabrics Connect names the subsystem and the queue:
//! queue 0 creates a controller (dynamic model: the target picks its id),
//! queues 1.. join an existing controller by id. Admin commands are
//! answered at once from the controller's state; I/O commands go to the
//! volume's device channel, one slot per command in flight. The commands
//! of one read round are queued on the channel and pushed together, once
//! (`Channel::queue`, then `flush_submissions` from `advance`: one
//! `io_uring_enter` for a batch on a file volume, as NBD). A write whose
//! data is not in the capsule gets one R2T for all of it and its H2CData
//! PDUs are copied into the command's buffer; a read is answered with one
//! C2HData PDU and a CapsuleResp (or the C2HData alone, carrying SUCCESS,
//! when the host disabled SQ flow control).
//!
//! Spliced reads: on a queue pair with no TLS and no data digest, a
//! replicated volume may hand a read's data over in a pipe, spliced from
//! the replica's socket (`Channel::allow_splice`); the C2HData header goes
//! out and the pipe is spliced into the socket after it, with no copy in
//! lull (docs/PER_IO.md, "Spliced reads"). A file volume on a memory
//! filesystem hands over a file range the same way, sent with `sendfile`
//! (docs/PER_IO.md, "File reads by sendfile"). Data that does not hold
//! the command's length is not sent: the command fails with an error
//! status.
//!
//! PDUs are parsed whole from the input buffer (`limits::INBUF_BYTES`
//! holds the largest). Anything malformed at the transport level ends in a
//! C2HTermReq and a close, with a log line; a malformed command gets an
//! NVMe error status.

use std::io::{Read, Write};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use lull_bdev::{BdevError, Channel, Data, IoBuf, IoCompletion, IoOp, IoRequest, Spliced};
use lull_net::slots::{SlotId, SlotTable};
use lull_net::wire::{self, Submissions, Wire};
use lull_net::{bufs, Payload};
use lull_reactor::{Clock, Interest, PollStatus, PollerId, PollerKind, Thread};
use lull_volume::{ConnPermit, OpKind, Volume};

use crate::limits::*;
use crate::pdu::{self, DataHeader, Digests, IcResp, Pdu, PduError};
use crate::psk;
use crate::spec::{self, Cqe, Reply, Sqe, Status};
use crate::stream::{Stream, TLS_RECORD_HANDSHAKE};
use crate::target::{Controller, ControllerRef, Shared};

/// What a command in flight waits for.
enum Stage {
    /// Host data arriving through H2CData after our R2T: `filled` of the
    /// buffer's `want` bytes are there.
    Receiving { filled: usize, want: usize },
    /// Submitted to the device.
    Device,
}

struct Cmd {
    sqe: Sqe,
    buf: Option<IoBuf>,
    stage: Stage,
    start_ns: u64,
    /// Dataset Management: the (offset, length) byte ranges still to
    /// deallocate after the piece in flight (one device request at a
    /// time; at most 256 ranges).
    trims: Vec<(u64, u64)>,
}

/// An I/O queue's view of its namespace.
struct Namespace {
    volume: Arc<Volume>,
    channel: Box<dyn Channel>,
    /// This I/O queue's place on the volume: NVMe/TCP I/O queues count
    /// against the volume's connection cap as NBD connections do.
    _permit: ConnPermit,
    lba_shift: u8,
}

impl Namespace {
    /// The namespace's size in LBAs, read from the volume on every check
    /// (an atomic load): a volume grown while the queue is connected
    /// takes I/O in its new range at once, and since a volume never
    /// shrinks, a command checked against an older size stays in range.
    fn blocks(&self) -> u64 {
        self.volume.dev().size_bytes() >> self.lba_shift
    }
}

/// A connected queue.
struct Queue {
    qid: u16,
    /// Queue entries (SQSIZE + 1): the SQ head wraps at this.
    entries: u16,
    ctrl: ControllerRef,
    /// Set on I/O queues.
    ns: Option<Namespace>,
    /// The host disabled SQ flow control (Connect CATTR bit 2): it does
    /// not need the SQ head of each completion, so a successful command
    /// with data ends with a C2HData PDU carrying SUCCESS instead of a
    /// CapsuleResp (NVMe/TCP: SUCCESS may be set only then; the Linux
    /// target does the same).
    sqflow_disabled: bool,
}

enum Phase {
    /// Waiting for ICReq.
    Init,
    /// IC done, waiting for Connect.
    Connecting,
    Connected(Queue),
}

pub(crate) struct Conn<S> {
    wire: Wire<Stream<S>>,
    /// After a TLS handshake: the host and subsystem NQNs of the PSK
    /// identity the host proved it holds the key of. Connect must name
    /// the same two.
    tls_peer: Option<(String, String)>,
    shared: Arc<Shared>,
    phase: Phase,
    dg: Digests,
    /// Alignment of data in the PDUs we send ((HPDA + 1) * 4).
    c2h_align: usize,
    slots: SlotTable<Cmd>,
    /// CIDs of held Asynchronous Event Requests (admin queue).
    aers: Vec<u16>,
    sqhd: u16,
    /// A request the device refused as full (retried before reading
    /// more), and requests queued and not pushed yet: the commands of one
    /// read round are queued (`Channel::queue`) and `advance` pushes them
    /// once (`Channel::flush_submissions`), as NBD does.
    subs: Submissions<IoRequest>,
    greeted: Arc<AtomicBool>,
    completions: Vec<IoCompletion>,
    now_ns: u64,
    clock: Option<Arc<dyn Clock>>,
    /// Disconnect was asked: close once its response is out.
    disconnecting: bool,
    /// Admin queue with a KATO: the timer that wakes it to check.
    kato_timer: Option<PollerId>,
    /// The poller registered with the controller for a wake-up: when it
    /// goes (I/O queue) or raises an event (admin queue).
    waker: Option<PollerId>,
    /// A read in this poller run found the socket empty
    /// ([`lull_net::InBuf::drained`]): no more reads until the next run.
    /// The socket is watched level-triggered, so bytes that arrive later
    /// wake the poller again; without this, every run ended with a read
    /// that returned EAGAIN (two per command at QD1: three `recvfrom`
    /// per 4 KiB read where SPDK's target makes one).
    socket_drained: bool,
    /// When the bytes now being parsed were read (the clock is read once
    /// per read, not once per command): a command's latency starts here.
    received_ns: u64,
    /// Run on the socket after each read of a TLS session
    /// (`stream::quickack` for TCP).
    tls_after_read: Option<fn(&S)>,
}

impl<S: Read + Write + Send + 'static> lull_net::server::Connection for Conn<S> {
    fn fd(&self) -> RawFd {
        self.wire.fd()
    }

    fn interest(&self) -> Interest {
        self.wire.interest()
    }

    fn greeted(&self) -> Arc<AtomicBool> {
        self.greeted.clone()
    }

    fn poll(&mut self, t: &mut Thread, now: u64, greeting_expired: bool) -> PollStatus {
        self.now_ns = now;
        self.socket_drained = false;
        if greeting_expired && !self.greeted.load(Ordering::Relaxed) {
            if self.tls_handshaking() {
                // A handshake that stalls holds a socket and OpenSSL's
                // buffers: bounded by TLS_HANDSHAKE_TIMEOUT_US.
                self.wire.set_broken();
                self.wire.refuse(format!(
                    "TLS handshake not finished within {} ms",
                    TLS_HANDSHAKE_TIMEOUT_US / 1000
                ));
            } else {
                self.wire.close("no ICReq and Connect in time");
            }
        }
        if !self.wire.is_closing() && self.shared.conns.stopping() {
            self.wire.close("server shutting down");
        }
        self.watch_controller(t);
        let status = wire::pump(self, t, MAX_ROUNDS);
        // After the pump, so that a Keep Alive already received counts,
        // and so that a queue connected in this run registers now (an
        // idle queue may not run again until its controller goes).
        self.check_keepalive(t, now);
        self.watch_controller(t);
        if self.wire.is_closing() {
            // The timer goes before the connection does (the pump may
            // have finished it: it is dropped when this call returns).
            if let Some(id) = self.kato_timer.take() {
                t.unregister_poller(id);
            }
        }
        status
    }

    fn affinity(&self) -> Option<String> {
        match &self.phase {
            Phase::Connected(Queue { ns: Some(ns), .. }) if !self.wire.is_closing() => {
                Some(ns.volume.name.clone())
            }
            _ => None,
        }
    }
}

impl<S: Read + Write> wire::Protocol for Conn<S> {
    type Stream = Stream<S>;

    fn wire(&mut self) -> &mut Wire<Stream<S>> {
        &mut self.wire
    }

    fn stream_wants_write(&self) -> bool {
        self.wire.stream.tls().is_some_and(|s| s.wants_write())
    }

    /// Decrypted bytes OpenSSL holds are announced by no socket event.
    fn stranded_input(&self) -> bool {
        self.wire.stream.tls().is_some_and(|s| s.pending() > 0)
            && !self.wire.is_closing()
            && !self.disconnecting
            && self.can_read()
    }

    /// Reap, retry a held request, then push what was queued since the
    /// last round (the commands `read_and_dispatch` queued, which `pump`
    /// always follows with an `advance`, and any a completion queued: the
    /// next piece of a Dataset Management).
    fn advance(&mut self) -> bool {
        let reaped = self.reap();
        let retried = self.retry_submit();
        self.flush_submissions();
        let evented = self.deliver_event();
        // Before the replies are written (see `StatsBatch`).
        lull_volume::add_batched_stats();
        if self.disconnecting && !self.wire.is_closing() && self.slots.is_empty() {
            self.wire.close("host sent Disconnect");
        }
        reaped | retried | evented
    }

    fn read_and_dispatch(&mut self) -> bool {
        wire::read_and_dispatch(self, READ_BUDGET_BYTES)
    }

    fn abandon_input(&mut self) -> bool {
        // Writes waiting for H2CData can no longer complete.
        let mut dropped = false;
        self.slots.retain(|_, c| {
            if matches!(c.stage, Stage::Receiving { .. }) {
                if let Some(b) = c.buf.take() {
                    bufs::put(b);
                }
                dropped = true;
                false
            } else {
                true
            }
        });
        dropped
    }

    fn busy(&self) -> bool {
        self.slots.in_flight() > 0 || self.subs.holding()
    }

    fn completions_fd(&self) -> Option<RawFd> {
        match &self.phase {
            Phase::Connected(Queue { ns: Some(ns), .. }) => ns.channel.event_fd(),
            _ => None,
        }
    }

    fn completions_polled(&self) -> bool {
        match &self.phase {
            // A held request with nothing of ours in flight waits for the
            // volume's other connections (its in-flight cap, see
            // `lull_volume::VolumeChannel`): poll until there is room.
            // One held by a QoS limit waits for its time (`wake_at_ns`).
            Phase::Connected(Queue { ns: Some(ns), .. }) => {
                (ns.channel.polled() && ns.channel.in_flight() > 0)
                    || (self.subs.holding()
                        && ns.channel.in_flight() == 0
                        && ns.channel.retry_at_ns().is_none())
            }
            _ => false,
        }
    }

    fn wake_at_ns(&self) -> Option<u64> {
        match &self.phase {
            Phase::Connected(Queue { ns: Some(ns), .. }) if self.subs.holding() => {
                ns.channel.retry_at_ns()
            }
            _ => None,
        }
    }

    fn check_invariants(&self) {
        self.slots.check_invariants();
        debug_assert!(self.aers.len() <= MAX_AERS);
    }
}

/// Whole PDUs parsed from the input buffer (see the module doc): the
/// shared read loop, not the shared frame payloads.
impl<S: Read + Write> wire::Receive for Conn<S> {
    const EOF_REASON: &'static str = "host disconnected";

    /// Nothing more is taken once Disconnect was asked.
    fn step(&mut self) -> bool {
        if self.tls_handshaking() {
            return self.tls_step();
        }
        !self.disconnecting && self.take_pdu()
    }

    /// The TLS handshake reads the socket itself.
    fn wants_input(&self) -> bool {
        !self.disconnecting && !self.socket_drained && self.can_read() && !self.tls_handshaking()
    }

    fn in_flight(&self) -> usize {
        self.slots.in_flight()
    }

    /// A short read says the socket is drained (no read again this run);
    /// the commands of what arrived start their latency now.
    fn filled(&mut self, n: usize) {
        // A TLS read returns one record's plaintext at most, short of the
        // buffer while more records wait in the socket: no conclusion.
        self.socket_drained = self.wire.inb.drained() && self.wire.stream.tls().is_none();
        if n > 0 {
            self.received_ns = self.clock_ns();
        }
    }
}

impl<S: Read + Write> Conn<S> {
    pub(crate) fn new(stream: S, fd: RawFd, peer: String, shared: Arc<Shared>) -> Conn<S> {
        Conn {
            wire: Wire::new(Stream::Plain(stream), fd, INBUF_BYTES, "NVMe/TCP", peer),
            tls_peer: None,
            shared,
            phase: Phase::Init,
            dg: Digests::default(),
            c2h_align: 4,
            slots: SlotTable::new(MAX_QUEUE_ENTRIES),
            aers: Vec::new(),
            sqhd: 0,
            subs: Submissions::default(),
            greeted: Arc::new(AtomicBool::new(false)),
            completions: Vec::new(),
            now_ns: 0,
            clock: None,
            disconnecting: false,
            kato_timer: None,
            waker: None,
            socket_drained: false,
            received_ns: 0,
            tls_after_read: None,
        }
    }

    /// What to run on the socket after each read once it carries TLS.
    pub(crate) fn set_tls_after_read(&mut self, hook: fn(&S)) {
        self.tls_after_read = Some(hook);
    }

    /// Keep-alive and controller teardown. An admin queue with a KATO
    /// keeps a timer (every half KATO) that wakes it, and closes when no
    /// command came for a whole KATO: its controller goes with it. An I/O
    /// queue registers its poller with its controller, which wakes it when
    /// it goes; it then closes.
    fn watch_controller(&mut self, t: &mut Thread) {
        let Phase::Connected(q) = &self.phase else {
            return;
        };
        if self.wire.is_closing() {
            return;
        }
        let Some(me) = t.current_poller() else {
            return;
        };
        if q.qid == 0 {
            if self.waker != Some(me) {
                q.ctrl.set_admin_waker(t.handle(), me);
                self.waker = Some(me);
            }
            let kato_ms = q.ctrl.kato_ms();
            if kato_ms == 0 {
                return;
            }
            if self.kato_timer.is_none() {
                let period_us = (u64::from(kato_ms) * 1000 / 2).max(1000);
                let r = t.register_poller(
                    "nvmf-kato",
                    PollerKind::every_us(period_us),
                    &[],
                    Box::new(move |t, _now| {
                        t.wake_poller(me);
                        PollStatus::Idle
                    }),
                );
                match r {
                    Ok(id) => self.kato_timer = Some(id),
                    Err(e) => {
                        tracing::warn!(peer = %self.wire.peer(), error = %e, "no keep-alive timer: KATO not enforced on this controller")
                    }
                }
            }
        } else if !q.ctrl.alive() {
            self.wire
                .close("controller gone (its admin queue closed or timed out)");
        } else if self.waker != Some(me) {
            q.ctrl.add_io_waker(t.handle(), me);
            self.waker = Some(me);
        }
    }

    /// Complete a held Asynchronous Event Request with the controller's
    /// pending event, if both exist.
    fn deliver_event(&mut self) -> bool {
        let Phase::Connected(q) = &self.phase else {
            return false;
        };
        if q.qid != 0 || self.aers.is_empty() || self.wire.is_closing() {
            return false;
        }
        let Some(dw0) = q.ctrl.take_event() else {
            return false;
        };
        let cid = self.aers.remove(0);
        tracing::info!(peer = %self.wire.peer(), cntlid = q.ctrl.cntlid, cid, "asynchronous event: namespace attribute changed");
        self.respond(cid, Reply::dw0(dw0));
        true
    }

    /// An admin queue silent for a whole KATO closes (its controller, and
    /// so its I/O queues, go with it).
    fn check_keepalive(&mut self, t: &mut Thread, now: u64) {
        let Phase::Connected(q) = &self.phase else {
            return;
        };
        if q.qid != 0 || self.wire.is_closing() {
            return;
        }
        let kato_ms = q.ctrl.kato_ms();
        let idle_ns = now.saturating_sub(q.ctrl.last_keepalive_ns());
        let limit_ns = u64::from(kato_ms) * 1_000_000 * KATO_SLACK_PERCENT / 100;
        if kato_ms > 0 && idle_ns > limit_ns {
            tracing::warn!(peer = %self.wire.peer(), cntlid = q.ctrl.cntlid, kato_ms, "keep-alive timeout: tearing the controller down");
            self.wire
                .close(format!("keep-alive timeout ({kato_ms} ms)"));
            if let Some(me) = t.current_poller() {
                t.wake_poller(me);
            }
        }
    }

    pub(crate) fn set_clock(&mut self, clock: Arc<dyn Clock>) {
        self.clock = Some(clock);
    }

    fn clock_ns(&self) -> u64 {
        self.clock.as_ref().map_or(self.now_ns, |c| c.now_ns())
    }

    /// Let a replicated volume hand READ data over in a pipe
    /// (`Data::Spliced`) when its bytes can go from the pipe to
    /// the socket unchanged: a plain socket (no TLS session, which must
    /// encrypt them) and no data digest (DDGST, a CRC32C over bytes the
    /// target would have to read). Otherwise reads stay buffered.
    fn allow_splice(&mut self, channel: &mut dyn Channel) {
        if self.wire.stream.tls().is_none() && !self.dg.data {
            self.wire.allow_splice();
            channel.allow_splice();
        }
    }

    /// Whether reading more input could make progress (back-pressure: a
    /// retry pending, or too many reply bytes queued).
    fn can_read(&self) -> bool {
        !self.subs.holding() && self.wire.out.bytes() < MAX_REPLY_QUEUE_BYTES
    }

    fn tls_handshaking(&self) -> bool {
        self.wire.stream.tls().is_some_and(|s| !s.is_established())
    }

    /// The host's first byte opened a TLS record: move the stream into a
    /// TLS session, the bytes read so far in front of the socket.
    fn start_tls(&mut self) -> bool {
        let shared = self.shared.clone();
        let Some(ctx) = &shared.tls else {
            self.wire.set_broken();
            self.wire
                .refuse("a TLS ClientHello, and the target has no TLS context");
            return true;
        };
        let head = self.wire.inb.peek().to_vec();
        self.wire.inb.consume(head.len());
        if let Err(e) = self.wire.stream.start_tls(ctx, head, self.tls_after_read) {
            self.wire.set_broken();
            self.wire.refuse(format!("cannot start TLS: {e}"));
        }
        true
    }

    /// Drive the TLS handshake; once done, the ICReq comes inside it.
    fn tls_step(&mut self) -> bool {
        let Some(s) = self.wire.stream.tls_mut() else {
            return false;
        };
        match s.handshake() {
            Ok(true) => {
                let identity = s.psk_identity().unwrap_or_default();
                match psk::parse_identity(identity.as_bytes()) {
                    Some((_, host, sub)) => {
                        tracing::debug!(peer = %self.wire.peer(), identity = %identity, "TLS 1.3 session established");
                        self.tls_peer = Some((host.to_string(), sub.to_string()));
                    }
                    None => {
                        self.wire.set_broken();
                        self.wire.refuse(format!(
                            "TLS session with a PSK identity that is not NVMe's: {identity:?}"
                        ));
                    }
                }
                true
            }
            Ok(false) => false,
            Err(e) => {
                // A wrong key (bad binder), an unknown identity, a host
                // that gave up: the one log line is the refusal's.
                self.wire.set_broken();
                self.wire.refuse(e.to_string());
                true
            }
        }
    }

    /// End the connection for a transport error: a C2HTermReq echoing the
    /// offending header, a log line, and a close.
    fn fatal(&mut self, err: &PduError, offending: &[u8]) {
        tracing::warn!(peer = %self.wire.peer(), error = %err, "fatal NVMe/TCP transport error; sending C2HTermReq");
        let term = pdu::c2h_term_req(err, offending);
        self.wire.push(&[], Payload::Bytes(term));
        self.wire.close(format!("transport error: {err}"));
    }

    /// Parse and handle one whole PDU from the input buffer.
    fn take_pdu(&mut self) -> bool {
        if !self.can_read() {
            return false;
        }
        let buffered = self.wire.inb.peek();
        if matches!(self.phase, Phase::Init)
            && self.wire.stream.tls().is_none()
            && buffered.first() == Some(&TLS_RECORD_HANDSHAKE)
        {
            return self.start_tls();
        }
        let Some(ch) = pdu::common_header(buffered) else {
            return false;
        };
        // A new command needs a free slot; wait for one (data PDUs for
        // commands in flight go on).
        if ch.pdu_type == pdu::TYPE_CAPSULE_CMD && self.slots.is_full() {
            return false;
        }
        let ic_done = !matches!(self.phase, Phase::Init);
        if !ic_done && ch.pdu_type != pdu::TYPE_IC_REQ {
            let err = PduError::Sequence(ch.pdu_type);
            let head = buffered[..pdu::CH_LEN].to_vec();
            self.fatal(&err, &head);
            return true;
        }
        let dg = self.dg;
        let decoded = pdu::decode(buffered, dg);
        match decoded {
            Ok(None) => false,
            Ok(Some((p, used))) => {
                // Copy out what outlives the input buffer, then consume.
                match p {
                    Pdu::IcReq(r) if !ic_done => {
                        self.wire.inb.consume(used);
                        self.on_icreq(r);
                    }
                    Pdu::CapsuleCmd { sqe, data } => {
                        let data = if data.is_empty() {
                            None
                        } else {
                            let mut b = bufs::get(data.len());
                            b.as_mut_slice()[..data.len()].copy_from_slice(data);
                            Some(b)
                        };
                        self.wire.inb.consume(used);
                        self.on_capsule(Sqe(sqe), data);
                    }
                    Pdu::H2CData { hdr, data } => {
                        let r = Self::place_h2c(&mut self.slots, &hdr, data);
                        self.wire.inb.consume(used);
                        match r {
                            Ok(Some(slot)) => self.data_complete(slot),
                            Ok(None) => {}
                            Err(err) => {
                                let mut head = [0u8; pdu::DATA_HLEN];
                                head.copy_from_slice(
                                    &pdu::encode(
                                        &Pdu::H2CData { hdr, data: &[] },
                                        Digests::default(),
                                    )[..pdu::DATA_HLEN],
                                );
                                self.fatal(&err, &head);
                            }
                        }
                    }
                    Pdu::TermReq { fes, fei, .. } => {
                        self.wire.inb.consume(used);
                        tracing::warn!(peer = %self.wire.peer(), fes, fei, "host sent H2CTermReq");
                        self.wire.set_broken();
                        self.wire
                            .close("host terminated the connection (H2CTermReq)");
                    }
                    Pdu::IcReq(..)
                    | Pdu::IcResp(..)
                    | Pdu::CapsuleResp { .. }
                    | Pdu::C2HData { .. }
                    | Pdu::R2t(..) => {
                        let head = self.wire.inb.peek()[..pdu::CH_LEN].to_vec();
                        self.fatal(&PduError::Sequence(ch.pdu_type), &head);
                    }
                }
                true
            }
            Err(PduError::DataDigest(t)) if t == pdu::TYPE_CAPSULE_CMD => {
                // The command is intact (its header digest, if any, was
                // good); its data is not: a retryable error for it alone.
                let sqe = Sqe(buffered[8..72].try_into().unwrap_or([0; 64]));
                self.wire.inb.consume(ch.plen as usize);
                self.advance_sqhd();
                tracing::warn!(peer = %self.wire.peer(), cid = sqe.cid(), "data digest error in a command capsule");
                self.respond(sqe.cid(), Reply::status(Status::TRANSIENT_TRANSPORT_ERROR));
                true
            }
            Err(PduError::DataDigest(t)) if t == pdu::TYPE_H2C_DATA => {
                let cccid = u16::from_le_bytes([buffered[8], buffered[9]]);
                let ttag = u16::from_le_bytes([buffered[10], buffered[11]]);
                self.wire.inb.consume(ch.plen as usize);
                tracing::warn!(peer = %self.wire.peer(), cid = cccid, "data digest error in H2CData");
                if let Some(id) = self.find_receiving(ttag, cccid) {
                    if let Some(mut c) = self.slots.take(id.to_wire()) {
                        if let Some(b) = c.buf.take() {
                            bufs::put(b);
                        }
                    }
                    self.respond(cccid, Reply::status(Status::TRANSIENT_TRANSPORT_ERROR));
                }
                true
            }
            Err(err) => {
                // Echo the offending header (at least the common header,
                // at most what a TermReq carries, at most what arrived).
                let n = usize::from(ch.hlen)
                    .clamp(pdu::CH_LEN, pdu::TERM_REQ_MAX_COPY)
                    .min(buffered.len());
                let head = buffered[..n].to_vec();
                self.fatal(&err, &head);
                true
            }
        }
    }

    fn on_icreq(&mut self, r: pdu::IcReq) {
        self.dg = r.digests;
        self.c2h_align = (usize::from(r.hpda) + 1) * 4;
        let resp = pdu::encode(
            &Pdu::IcResp(IcResp {
                pfv: pdu::PFV,
                cpda: 0,
                digests: r.digests,
                maxh2cdata: MAX_H2C_DATA_BYTES as u32,
            }),
            Digests::default(),
        );
        self.wire.push(&[], Payload::Bytes(resp));
        self.phase = Phase::Connecting;
        tracing::debug!(peer = %self.wire.peer(), hdgst = r.digests.header, ddgst = r.digests.data, hpda = r.hpda, "ICReq");
    }

    fn advance_sqhd(&mut self) {
        let entries = match &self.phase {
            Phase::Connected(q) => q.entries,
            _ => MAX_QUEUE_ENTRIES as u16,
        };
        self.sqhd = (self.sqhd + 1) % entries.max(1);
    }

    /// A command capsule arrived (with its in-capsule data, if any).
    fn on_capsule(&mut self, sqe: Sqe, data: Option<IoBuf>) {
        self.advance_sqhd();
        if let Phase::Connected(q) = &self.phase {
            if q.qid == 0 {
                q.ctrl.touch(self.now_ns);
            }
        }
        let sgl = sqe.sgl();
        let cid = sqe.cid();
        let opc = sqe.opcode();
        let dir = if opc == spec::OPC_FABRICS {
            sqe.fctype() & 3
        } else {
            opc & 3
        };
        let host_data = dir & 1 == 1 && sgl.length > 0;
        if !host_data {
            if let Some(b) = data {
                // Data nobody asked for: ignore it, answer the command.
                bufs::put(b);
            }
            return self.execute(sqe, None);
        }
        let len = sgl.length as usize;
        match sgl.kind {
            spec::SGL_IN_CAPSULE => {
                let have = data.as_ref().map_or(0, |b| b.len());
                let off = sgl.address as usize;
                match data {
                    Some(mut b) if sgl.address <= have as u64 && off + len <= have => {
                        if off > 0 {
                            b.as_mut_slice().copy_within(off..off + len, 0);
                        }
                        self.execute(sqe, Some(b));
                    }
                    other => {
                        if let Some(b) = other {
                            bufs::put(b);
                        }
                        self.respond(cid, Reply::status(Status::DATA_SGL_LENGTH_INVALID));
                    }
                }
            }
            spec::SGL_TRANSPORT => {
                if let Some(b) = data {
                    bufs::put(b);
                }
                if len > MAX_TRANSFER_BYTES {
                    return self.respond(cid, Reply::status(Status::DATA_SGL_LENGTH_INVALID));
                }
                // Check a write before asking for its data.
                if let Err(status) = self.check_io(&sqe) {
                    return self.respond(cid, Reply::status(status));
                }
                let start_ns = self.received_ns;
                let Some(slot) = self.slots.insert(Cmd {
                    sqe,
                    buf: Some(bufs::get(len)),
                    stage: Stage::Receiving {
                        filled: 0,
                        want: len,
                    },
                    start_ns,
                    trims: Vec::new(),
                }) else {
                    // take_pdu() waits for a free slot before taking a capsule.
                    return self.respond(cid, Reply::status(Status::INTERNAL_ERROR));
                };
                let r2t = pdu::R2t {
                    cccid: cid,
                    ttag: slot.index() as u16,
                    r2to: 0,
                    r2tl: len as u32,
                };
                let h = pdu::r2t_header(&r2t, self.dg);
                self.wire.push(h.as_slice(), Payload::None);
            }
            _ => {
                if let Some(b) = data {
                    bufs::put(b);
                }
                self.respond(cid, Reply::status(Status::SGL_DESCRIPTOR_TYPE_INVALID));
            }
        }
    }

    fn find_receiving(&self, ttag: u16, cccid: u16) -> Option<SlotId> {
        self.slots
            .iter()
            .find(|(id, c)| {
                id.index() == usize::from(ttag)
                    && c.sqe.cid() == cccid
                    && matches!(c.stage, Stage::Receiving { .. })
            })
            .map(|(id, _)| id)
    }

    /// Copy an H2CData PDU's data into its command's buffer. `Ok(Some)`:
    /// the command has all its data.
    fn place_h2c(
        slots: &mut SlotTable<Cmd>,
        hdr: &DataHeader,
        data: &[u8],
    ) -> Result<Option<SlotId>, PduError> {
        let found = slots
            .iter()
            .find(|(id, c)| {
                id.index() == usize::from(hdr.ttag)
                    && c.sqe.cid() == hdr.cccid
                    && matches!(c.stage, Stage::Receiving { .. })
            })
            .map(|(id, _)| id);
        let Some(id) = found else {
            return Err(PduError::Unsupported {
                what: "H2CData transfer tag",
                value: u32::from(hdr.ttag),
            });
        };
        let Some(cmd) = slots.get_mut(id.to_wire()) else {
            return Err(PduError::Unsupported {
                what: "H2CData transfer tag",
                value: u32::from(hdr.ttag),
            });
        };
        let Stage::Receiving { filled, want } = &mut cmd.stage else {
            return Ok(None);
        };
        let off = hdr.datao as usize;
        // In order and inside what the R2T asked for (the host may split
        // it into PDUs of at most MAXH2CDATA).
        if off != *filled || off + data.len() > *want {
            return Err(PduError::DataTooLong {
                len: off + data.len(),
                max: *want,
            });
        }
        if let Some(b) = cmd.buf.as_mut() {
            b.as_mut_slice()[off..off + data.len()].copy_from_slice(data);
        }
        *filled += data.len();
        Ok((*filled == *want).then_some(id))
    }

    /// All host data of the command in `slot` arrived.
    fn data_complete(&mut self, slot: SlotId) {
        let Some(cmd) = self.slots.take(slot.to_wire()) else {
            return;
        };
        self.execute_with_start(cmd.sqe, cmd.buf, cmd.start_ns);
    }

    fn execute(&mut self, sqe: Sqe, data: Option<IoBuf>) {
        self.execute_with_start(sqe, data, self.received_ns);
    }

    fn execute_with_start(&mut self, sqe: Sqe, data: Option<IoBuf>, start_ns: u64) {
        let cid = sqe.cid();
        if sqe.opcode() == spec::OPC_FABRICS {
            let reply = self.fabrics(&sqe, data.as_ref());
            if let Some(b) = data {
                bufs::put(b);
            }
            return self.respond(cid, reply);
        }
        let (qid, is_io) = match &self.phase {
            Phase::Connected(q) => (q.qid, q.ns.is_some()),
            _ => {
                if let Some(b) = data {
                    bufs::put(b);
                }
                return self.respond(cid, Reply::status(Status::COMMAND_SEQUENCE_ERROR));
            }
        };
        if qid == 0 {
            if let Some(b) = data {
                bufs::put(b);
            }
            if sqe.opcode() == spec::ADMIN_ASYNC_EVENT_REQUEST {
                if self.aers.len() >= MAX_AERS {
                    return self.respond(cid, Reply::status(Status::ASYNC_EVENT_LIMIT_EXCEEDED));
                }
                // Held until an event (see `deliver_event`) or the end.
                self.aers.push(cid);
                self.deliver_event();
                return;
            }
            let reply = self.admin(&sqe);
            return self.respond(cid, reply);
        }
        debug_assert!(is_io);
        self.io(sqe, data, start_ns);
    }

    /// Send a command's data (if any) in one C2HData PDU, then its
    /// CapsuleResp.
    fn respond(&mut self, cid: u16, r: Reply) {
        if let Some(d) = r.data {
            if r.status.is_success() && !d.is_empty() {
                let mut b = bufs::get(d.len());
                b.as_mut_slice()[..d.len()].copy_from_slice(&d);
                let success = self.c2h_success() && r.dw0 == 0 && r.dw1 == 0;
                self.send_c2h(cid, b, d.len(), success);
                if success {
                    return;
                }
            }
        }
        self.send_resp(Cqe {
            dw0: r.dw0,
            dw1: r.dw1,
            sqhd: self.sqhd,
            cid,
            status: r.status,
        });
    }

    fn send_resp(&mut self, cqe: Cqe) {
        let h = pdu::capsule_resp_header(&cqe.encode(), self.dg);
        self.wire.push(h.as_slice(), Payload::None);
    }

    /// Whether a successful command's data may carry SUCCESS (and so no
    /// CapsuleResp follows): only when the host disabled SQ flow control.
    fn c2h_success(&self) -> bool {
        matches!(&self.phase, Phase::Connected(q) if q.sqflow_disabled)
    }

    /// One C2HData PDU with `len` bytes of `buf`, LAST_PDU set, and
    /// SUCCESS when `success` (the command's completion; see
    /// [`Conn::c2h_success`]).
    fn send_c2h(&mut self, cid: u16, buf: IoBuf, len: usize, success: bool) {
        let ddgst = self.dg.data.then(|| pdu::crc32c(&buf.as_slice()[..len]));
        let mut buf = buf;
        if buf.len() != len {
            // The pooled buffer may be longer than the data it holds.
            buf.set_len(len);
        }
        self.push_c2h(cid, len, success, Payload::Buf(buf));
        if let Some(d) = ddgst {
            self.wire.push(&d.to_le_bytes(), Payload::None);
        }
    }

    /// A read's data held by a descriptor (only on a connection that
    /// allowed it, see [`Conn::allow_splice`]): a pipe (a replicated
    /// volume's, spliced from the replica's socket) or a file range (a
    /// file volume's on a memory filesystem, sent with `sendfile`). One
    /// C2HData PDU whose data goes from the descriptor into the socket,
    /// no copy. Data of other than `len` bytes is not sent (a short or
    /// long PDU would desync the host): false, with a log line; the
    /// caller answers with an error.
    fn send_c2h_spliced(&mut self, cid: u16, spliced: Spliced, len: usize, success: bool) -> bool {
        if spliced.len() != len || self.dg.data {
            // The device handed over less or more than was asked, or
            // such data reached a link with a data digest: a bug either way.
            tracing::error!(peer = %self.wire.peer(), cid, held = spliced.len(), len,
                ddgst = self.dg.data, "spliced read of the wrong length or on a digest link");
            spliced.release();
            return false;
        }
        if let Phase::Connected(Queue { ns: Some(ns), .. }) = &self.phase {
            match spliced {
                Spliced::Pipe(_) => ns.volume.stats.spliced_read_batched(),
                Spliced::File(_) => ns.volume.stats.sendfile_read_batched(),
            }
        }
        let payload = match spliced {
            Spliced::Pipe(pipe) => Payload::Pipe(pipe),
            Spliced::File(r) => Payload::File {
                file: r.file,
                offset: r.offset,
                len: r.len,
            },
        };
        self.push_c2h(cid, len, success, payload);
        true
    }

    /// A read's data the device lent (a memory volume's): one C2HData PDU
    /// whose data is written from the device's memory, and its data
    /// digest, if negotiated, computed over those bytes (which do not
    /// change while the loan is held; docs/PER_IO.md, "Lent reads"). A
    /// loan of other than `len` bytes is not sent: false, with a log line;
    /// the caller answers with an error.
    fn send_c2h_lent(
        &mut self,
        cid: u16,
        lent: lull_bdev::Lent,
        len: usize,
        success: bool,
    ) -> bool {
        if lent.len() != len {
            // The device lent less or more than was asked: a bug.
            tracing::error!(peer = %self.wire.peer(), cid, lent = lent.len(), len,
                "lent read of the wrong length");
            return false;
        }
        if let Phase::Connected(Queue { ns: Some(ns), .. }) = &self.phase {
            ns.volume.stats.lent_read_batched();
        }
        let ddgst = self.dg.data.then(|| pdu::crc32c(lent.as_slice()));
        self.push_c2h(cid, len, success, Payload::Lent(lent));
        if let Some(d) = ddgst {
            self.wire.push(&d.to_le_bytes(), Payload::None);
        }
        true
    }

    /// One C2HData PDU's header (LAST_PDU set, SUCCESS when `success`),
    /// then `payload`, which holds its `len` data bytes.
    fn push_c2h(&mut self, cid: u16, len: usize, success: bool, payload: Payload) {
        let hdr = DataHeader {
            cccid: cid,
            ttag: 0,
            datao: 0,
            flags: if success {
                pdu::FLAG_LAST_PDU | pdu::FLAG_SUCCESS
            } else {
                pdu::FLAG_LAST_PDU
            },
        };
        let specific = pdu::data_specific(&hdr, len as u32);
        let h = pdu::encode_header(
            pdu::TYPE_C2H_DATA,
            hdr.flags,
            &specific,
            len,
            self.c2h_align,
            self.dg,
        );
        if h.len() <= lull_net::MAX_HEADER_LEN {
            self.wire.push(h.as_slice(), payload);
        } else {
            // Padded to a large HPDA: longer than a frame header.
            self.wire.push(&[], Payload::Bytes(h.as_slice().to_vec()));
            self.wire.push(&[], payload);
        }
    }

    // ---------------------------------------------------------------- fabrics

    fn fabrics(&mut self, sqe: &Sqe, data: Option<&IoBuf>) -> Reply {
        match sqe.fctype() {
            spec::FCTYPE_CONNECT => self.connect(sqe, data),
            spec::FCTYPE_PROPERTY_GET | spec::FCTYPE_PROPERTY_SET => match &self.phase {
                Phase::Connected(q) if q.qid == 0 => {
                    if sqe.fctype() == spec::FCTYPE_PROPERTY_GET {
                        property_get(&q.ctrl, sqe)
                    } else {
                        property_set(&q.ctrl, sqe)
                    }
                }
                Phase::Connected(_) => Reply::status(Status::INVALID_FIELD),
                _ => Reply::status(Status::COMMAND_SEQUENCE_ERROR),
            },
            spec::FCTYPE_DISCONNECT => {
                self.disconnecting = true;
                Reply::ok()
            }
            _ => Reply::status(Status::INVALID_OPCODE),
        }
    }

    fn connect(&mut self, sqe: &Sqe, data: Option<&IoBuf>) -> Reply {
        // Invalid parameter: dw0 holds IPO, the byte offset of the field,
        // in bits 15:0 and IATTR (1: in the Connect data, 0: in the
        // command) in bit 16 (NVMe-oF 1.1, Connect response; Linux's
        // nvmf_log_connect_error names the field from them).
        let invalid = |in_data: bool, offset: u16| Reply {
            dw0: (u32::from(in_data) << 16) | u32::from(offset),
            ..Reply::status(Status::CONNECT_INVALID_PARAMETERS)
        };
        if !matches!(self.phase, Phase::Connecting) {
            return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
        }
        let dw10 = sqe.dword(10);
        let dw11 = sqe.dword(11);
        if dw10 & 0xFFFF != 0 {
            return Reply::status(Status::CONNECT_INCOMPATIBLE_FORMAT);
        }
        let qid = (dw10 >> 16) as u16;
        let sqsize = (dw11 & 0xFFFF) as usize;
        let kato_ms = sqe.dword(12);
        if sqsize == 0 || sqsize + 1 > MAX_QUEUE_ENTRIES {
            return invalid(false, 44);
        }
        let Some(data) = data else {
            return invalid(false, 24);
        };
        let d = match spec::connect_data(&data.as_slice()[..data.len()]) {
            Ok(d) => d,
            Err(off) => return invalid(true, off),
        };
        let peer = self.wire.peer().to_string();
        let discovery = d.subnqn == spec::DISCOVERY_NQN;
        // A discovery controller has no volume (and no I/O queues).
        let volume = if discovery {
            if qid != 0 {
                return invalid(false, 42);
            }
            None
        } else {
            let Some(v) = self.shared.volume_by_nqn(&d.subnqn) else {
                tracing::warn!(peer = %peer, subnqn = %d.subnqn, "Connect to an unknown subsystem");
                return invalid(true, 256);
            };
            if !self.shared.host_allowed(&v.name, &d.hostnqn) {
                tracing::warn!(peer = %peer, subnqn = %d.subnqn, hostnqn = %d.hostnqn, qid, "Connect refused: host not on the subsystem's allowlist");
                return Reply::status(Status::CONNECT_INVALID_HOST);
            }
            if self.tls_peer.is_none() && self.shared.secure_channel_required(&v.name) {
                tracing::warn!(peer = %peer, subnqn = %d.subnqn, hostnqn = %d.hostnqn, qid, "Connect refused: the subsystem requires a secure channel (TLS with a PSK) and this queue pair is plaintext");
                return Reply::status(Status::CONNECT_INVALID_HOST);
            }
            Some(v)
        };
        if let Some((host, sub)) = &self.tls_peer {
            // The key proved who the host is for one subsystem: another
            // subsystem or host NQN over that session is refused.
            if *host != d.hostnqn || *sub != d.subnqn {
                tracing::warn!(peer = %peer, subnqn = %d.subnqn, hostnqn = %d.hostnqn, tls_hostnqn = %host, tls_subnqn = %sub, qid,
                    "Connect refused: the NQNs differ from the TLS PSK identity's");
                return Reply::status(Status::CONNECT_INVALID_HOST);
            }
        }
        let ctrl = if qid == 0 {
            if d.cntlid != 0xFFFF {
                // Dynamic controller model: the host must let us choose.
                return invalid(true, 16);
            }
            match self.shared.new_controller(&d, volume.clone(), kato_ms) {
                Some(c) => c,
                None => return Reply::status(Status::CONNECT_INVALID_HOST),
            }
        } else {
            let Some(c) = self.shared.controller(d.cntlid) else {
                return invalid(true, 16);
            };
            if c.subnqn != d.subnqn || c.hostnqn != d.hostnqn {
                return invalid(true, 16);
            }
            if !c.ready() {
                return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
            }
            if qid > c.io_queues() {
                return invalid(false, 42);
            }
            c
        };
        let ns = if let (true, Some(volume)) = (qid > 0, &volume) {
            let limits = self.shared.volumes.limits();
            let Some(permit) = volume.try_connect(limits.connections) else {
                tracing::warn!(peer = %peer, volume = %volume.name, limit = limits.connections, qid,
                    "Connect refused: the volume has its maximum of connections");
                return Reply::status(Status::CONNECT_CONTROLLER_BUSY);
            };
            let mut channel = match volume.open_channel(limits.in_flight) {
                Ok(ch) => ch,
                Err(e) => {
                    tracing::error!(peer = %peer, volume = %volume.name, error = %e, "cannot open a device channel");
                    return Reply::status(Status::INTERNAL_ERROR);
                }
            };
            self.allow_splice(channel.as_mut());
            // Read data may be lent by the device and sent from its memory
            // (in-memory bytes: TLS or not, digest or not).
            channel.allow_lend();
            let lba_shift = self.shared.lba_shift_of(&volume.name);
            Some(Namespace {
                lba_shift,
                channel,
                _permit: permit,
                volume: volume.clone(),
            })
        } else {
            None
        };
        let cntlid = ctrl.cntlid;
        if qid == 0 {
            ctrl.touch(self.now_ns);
        }
        let tls = self.tls_peer.is_some();
        tracing::info!(peer = %peer, subnqn = %d.subnqn, hostnqn = %d.hostnqn, cntlid, qid, entries = sqsize + 1, tls, "queue connected");
        let what = volume.as_ref().map_or("discovery", |v| v.name.as_str());
        self.wire
            .set_context(&format!("{what} ctrl {cntlid} q{qid}"));
        self.phase = Phase::Connected(Queue {
            qid,
            entries: (sqsize + 1) as u16,
            ctrl,
            ns,
            sqflow_disabled: (dw11 >> 16) & spec::CATTR_DISABLE_SQ_FLOW != 0,
        });
        self.greeted.store(true, Ordering::Relaxed);
        Reply::dw0(u32::from(cntlid))
    }

    // ------------------------------------------------------------------ admin

    fn admin(&self, sqe: &Sqe) -> Reply {
        let Phase::Connected(q) = &self.phase else {
            return Reply::status(Status::COMMAND_SEQUENCE_ERROR);
        };
        let ctrl: &Controller = &q.ctrl;
        let host_len = sqe.sgl().length as usize;
        let fit = |mut v: Vec<u8>| {
            v.truncate(host_len);
            Reply::data(v)
        };
        match sqe.opcode() {
            spec::ADMIN_IDENTIFY => {
                let cns = (sqe.dword(10) & 0xFF) as u8;
                let nsid = sqe.nsid();
                let volume = ctrl.volume.as_ref();
                match (cns, volume) {
                    (spec::CNS_CONTROLLER, _) => fit(self.shared.identify_controller(ctrl)),
                    // A deleted volume's namespace is inactive: its
                    // Identify data reads as zeros.
                    (spec::CNS_NAMESPACE, Some(_)) if nsid == 1 && !ctrl.ns_active() => {
                        fit(vec![0u8; spec::IDENTIFY_BYTES])
                    }
                    (spec::CNS_NAMESPACE, Some(v)) if nsid == 1 => {
                        fit(self.shared.identify_namespace(v))
                    }
                    (spec::CNS_NS_ID_DESCRIPTORS, Some(v)) if nsid == 1 && ctrl.ns_active() => {
                        fit(spec::ns_id_descriptors(
                            &spec::name_guid(&v.name),
                            &spec::name_eui64(&v.name),
                        ))
                    }
                    (spec::CNS_NAMESPACE | spec::CNS_NS_ID_DESCRIPTORS, _) => {
                        Reply::status(Status::INVALID_NAMESPACE)
                    }
                    (spec::CNS_ACTIVE_NS_LIST, _) => {
                        if nsid >= 0xFFFF_FFFE {
                            return Reply::status(Status::INVALID_NAMESPACE);
                        }
                        let mut v = vec![0u8; spec::IDENTIFY_BYTES];
                        if nsid < 1 && ctrl.ns_active() {
                            v[0] = 1;
                        }
                        fit(v)
                    }
                    _ => Reply::status(Status::INVALID_FIELD),
                }
            }
            spec::ADMIN_GET_FEATURES => ctrl.get_feature(sqe),
            spec::ADMIN_SET_FEATURES => ctrl.set_feature(sqe),
            spec::ADMIN_GET_LOG_PAGE => {
                let lid = (sqe.dword(10) & 0xFF) as u8;
                let page = match (lid, &ctrl.volume) {
                    (spec::LOG_DISCOVERY, None) => Some(self.shared.discovery_log(&ctrl.hostnqn)),
                    // RAE (dword 10 bit 15): retain the list.
                    (spec::LOG_CHANGED_NS_LIST, _) => {
                        Some(ctrl.changed_ns_log(sqe.dword(10) & (1 << 15) != 0))
                    }
                    _ => None,
                };
                get_log_page(sqe, page)
            }
            spec::ADMIN_KEEP_ALIVE => Reply::ok(),
            // Nothing is ever aborted: dw0 bit 0 says "not aborted".
            spec::ADMIN_ABORT => Reply::dw0(1),
            op => {
                tracing::debug!(peer = %self.wire.peer(), opcode = op, "unsupported admin command");
                Reply::status(Status::INVALID_OPCODE)
            }
        }
    }

    // --------------------------------------------------------------------- io

    /// Check an I/O command before its data is asked for or it starts.
    fn check_io(&self, sqe: &Sqe) -> Result<(), Status> {
        let Phase::Connected(Queue {
            ns: Some(ns), ctrl, ..
        }) = &self.phase
        else {
            return Err(Status::INVALID_OPCODE);
        };
        // The volume was deleted: namespace 1 is no longer attached.
        if !ctrl.ns_active() && sqe.opcode() != spec::NVM_FLUSH {
            return Err(Status::INVALID_NAMESPACE);
        }
        match sqe.opcode() {
            spec::NVM_FLUSH => {
                if sqe.nsid() != 1 && sqe.nsid() != 0xFFFF_FFFF {
                    return Err(Status::INVALID_NAMESPACE);
                }
                Ok(())
            }
            spec::NVM_DATASET_MANAGEMENT => {
                if sqe.nsid() != 1 {
                    return Err(Status::INVALID_NAMESPACE);
                }
                // NR is 0-based, so 1..=256 ranges of 16 bytes each.
                let need = dsm_ranges(sqe) * spec::DSM_RANGE_BYTES;
                let len = sqe.sgl().length as usize;
                if len < need || len > spec::DSM_MAX_RANGES * spec::DSM_RANGE_BYTES {
                    return Err(Status::DATA_SGL_LENGTH_INVALID);
                }
                Ok(())
            }
            spec::NVM_READ | spec::NVM_WRITE | spec::NVM_WRITE_ZEROES => {
                if sqe.nsid() != 1 {
                    return Err(Status::INVALID_NAMESPACE);
                }
                let (slba, nlb) = lba_range(sqe);
                match slba.checked_add(nlb) {
                    Some(end) if end <= ns.blocks() => {}
                    _ => return Err(Status::LBA_OUT_OF_RANGE),
                }
                if sqe.opcode() != spec::NVM_WRITE_ZEROES {
                    let bytes = (nlb << ns.lba_shift) as usize;
                    if bytes > MAX_TRANSFER_BYTES {
                        return Err(Status::INVALID_FIELD);
                    }
                    if sqe.sgl().length as usize != bytes {
                        return Err(Status::DATA_SGL_LENGTH_INVALID);
                    }
                }
                Ok(())
            }
            _ => Err(Status::INVALID_OPCODE),
        }
    }

    fn io(&mut self, sqe: Sqe, data: Option<IoBuf>, start_ns: u64) {
        let cid = sqe.cid();
        if let Err(status) = self.check_io(&sqe) {
            if let Some(b) = data {
                bufs::put(b);
            }
            return self.respond(cid, Reply::status(status));
        }
        if sqe.opcode() == spec::NVM_DATASET_MANAGEMENT {
            return self.dataset_management(sqe, data, start_ns);
        }
        let Phase::Connected(Queue { ns: Some(ns), .. }) = &self.phase else {
            return;
        };
        let shift = ns.lba_shift;
        let (slba, nlb) = lba_range(&sqe);
        let offset = slba << shift;
        let bytes = nlb << shift;
        let fua = sqe.dword(12) & (1 << 30) != 0;
        let (op, buf) = match sqe.opcode() {
            // A read a memory volume lends uses no buffer: take one
            // without the fixed arena's cost (`Channel::lends`).
            spec::NVM_READ if ns.channel.lends() => {
                (IoOp::Read, Some(bufs::get_unregistered(bytes as usize)))
            }
            spec::NVM_READ => (IoOp::Read, Some(bufs::get(bytes as usize))),
            spec::NVM_WRITE => (IoOp::Write { fua }, data),
            spec::NVM_FLUSH => (IoOp::Flush, None),
            _ => (
                IoOp::WriteZeroes {
                    // DEAC: the range may be deallocated.
                    no_hole: sqe.dword(12) & (1 << 25) == 0,
                    fua,
                    // NVMe's Write Zeroes may write zeros; it has no
                    // "fail unless fast" (NBD's FAST_ZERO).
                    fast: false,
                },
                None,
            ),
        };
        let Some(slot) = self.slots.insert(Cmd {
            sqe,
            buf: None,
            stage: Stage::Device,
            start_ns,
            trims: Vec::new(),
        }) else {
            if let Some(b) = buf {
                bufs::put(b);
            }
            return self.respond(cid, Reply::status(Status::INTERNAL_ERROR));
        };
        let (offset, len) = if op == IoOp::Flush {
            (0, 0)
        } else {
            (offset, bytes as u32)
        };
        self.submit_io(IoRequest {
            tag: slot.to_wire(),
            op,
            offset,
            len,
            buf,
        });
    }

    /// Dataset Management: with the Deallocate attribute, each range is
    /// discarded (the device's Trim: it reads back as zeros, as DLFEAT
    /// says), one device request at a time; without it the command is a
    /// hint and completes at once. Every range is checked before any is
    /// discarded.
    fn dataset_management(&mut self, sqe: Sqe, data: Option<IoBuf>, start_ns: u64) {
        let cid = sqe.cid();
        let Phase::Connected(Queue { ns: Some(ns), .. }) = &self.phase else {
            return;
        };
        let Some(data) = data else {
            return self.respond(cid, Reply::status(Status::DATA_SGL_LENGTH_INVALID));
        };
        let n = dsm_ranges(&sqe);
        let raw = &data.as_slice()[..data.len()];
        let mut trims = Vec::with_capacity(n);
        let mut bad = None;
        let blocks = ns.blocks();
        for r in raw.chunks_exact(spec::DSM_RANGE_BYTES).take(n) {
            let nlb = u64::from(u32::from_le_bytes([r[4], r[5], r[6], r[7]]));
            let slba = u64::from_le_bytes(r[8..16].try_into().unwrap_or([0xFF; 8]));
            match slba.checked_add(nlb) {
                Some(end) if end <= blocks => {}
                _ => {
                    bad = Some(Status::LBA_OUT_OF_RANGE);
                    break;
                }
            }
            if nlb > 0 {
                trims.push((slba << ns.lba_shift, nlb << ns.lba_shift));
            }
        }
        bufs::put(data);
        if let Some(status) = bad {
            return self.respond(cid, Reply::status(status));
        }
        if sqe.dword(11) & spec::DSM_ATTR_DEALLOCATE == 0 || trims.is_empty() {
            return self.respond(cid, Reply::ok());
        }
        // Popped from the end: start from the last range.
        trims.reverse();
        self.next_trim(Cmd {
            sqe,
            buf: None,
            stage: Stage::Device,
            start_ns,
            trims,
        });
    }

    /// Submit the next piece of a Dataset Management command: the front
    /// of its last range, at most `MAX_DEALLOCATE_CHUNK_BYTES` (a device
    /// request moves at most `u32` bytes). The list holds at most the
    /// command's 256 ranges: splitting is lazy.
    fn next_trim(&mut self, mut cmd: Cmd) {
        let cid = cmd.sqe.cid();
        let Some((offset, range_len)) = cmd.trims.pop() else {
            return self.respond(cid, Reply::ok());
        };
        let len = range_len.min(MAX_DEALLOCATE_CHUNK_BYTES);
        if len < range_len {
            cmd.trims.push((offset + len, range_len - len));
        }
        let Some(slot) = self.slots.insert(cmd) else {
            return self.respond(cid, Reply::status(Status::INTERNAL_ERROR));
        };
        self.submit_io(IoRequest {
            tag: slot.to_wire(),
            op: IoOp::Trim,
            offset,
            len: len as u32,
            buf: None,
        });
    }

    /// Queue `io` on the channel; `advance` pushes the batch
    /// (`flush_submissions`).
    fn submit_io(&mut self, io: IoRequest) {
        let Phase::Connected(Queue { ns: Some(ns), .. }) = &mut self.phase else {
            return;
        };
        if let Some(done) = self.subs.queued(ns.channel.queue(io)) {
            let now = self.clock_ns();
            self.complete(done, now);
        }
    }

    /// Pushes the requests queued since the last push (`Submissions`):
    /// one `io_uring_enter` (file volume) or one doorbell (replicated
    /// volume) for the commands of a read round.
    fn flush_submissions(&mut self) {
        if !self.subs.take_unflushed() {
            return;
        }
        if let Phase::Connected(Queue { ns: Some(ns), .. }) = &mut self.phase {
            ns.channel.flush_submissions();
        }
    }

    fn retry_submit(&mut self) -> bool {
        let Some(io) = self.subs.retry() else {
            return false;
        };
        self.submit_io(io);
        !self.subs.holding()
    }

    fn reap(&mut self) -> bool {
        let Phase::Connected(Queue { ns: Some(ns), .. }) = &mut self.phase else {
            return false;
        };
        let mut done = std::mem::take(&mut self.completions);
        let n = ns.channel.reap(&mut |c| done.push(c));
        // One clock read for the batch.
        let now = if done.is_empty() { 0 } else { self.clock_ns() };
        for c in done.drain(..) {
            self.complete(c, now);
        }
        self.completions = done;
        n > 0
    }

    /// A device request finished (`now_ns`: when it was reaped).
    fn complete(&mut self, c: IoCompletion, now_ns: u64) {
        let Some(cmd) = self.slots.take(c.tag) else {
            tracing::error!(peer = %self.wire.peer(), tag = c.tag, "completion for an unknown slot");
            return;
        };
        let cid = cmd.sqe.cid();
        let opc = cmd.sqe.opcode();
        if opc == spec::NVM_DATASET_MANAGEMENT && c.result.is_ok() && !cmd.trims.is_empty() {
            return self.next_trim(cmd);
        }
        if let Phase::Connected(Queue { ns: Some(ns), .. }) = &self.phase {
            let op = match opc {
                spec::NVM_READ => OpKind::Read,
                spec::NVM_WRITE => OpKind::Write,
                spec::NVM_FLUSH => OpKind::Flush,
                spec::NVM_DATASET_MANAGEMENT => OpKind::Trim,
                _ => OpKind::WriteZeroes,
            };
            let len = match opc {
                spec::NVM_FLUSH | spec::NVM_DATASET_MANAGEMENT => 0,
                _ => lba_range(&cmd.sqe).1 << ns.lba_shift,
            };
            let latency = now_ns.saturating_sub(cmd.start_ns);
            ns.volume
                .stats
                .record_batched(op, len, latency, c.result.is_ok());
        }
        match c.result {
            Ok(()) => {
                if opc == spec::NVM_READ {
                    let len = lba_range(&cmd.sqe).1 as usize;
                    let shift = match &self.phase {
                        Phase::Connected(Queue { ns: Some(ns), .. }) => ns.lba_shift,
                        _ => 9,
                    };
                    let len = len << shift;
                    // SUCCESS on the data PDU ends the command: no
                    // CapsuleResp follows (see `c2h_success`).
                    let success = self.c2h_success();
                    let sent = match (c.data, c.buf) {
                        (Data::Lent(lent), buf) => {
                            if let Some(b) = buf {
                                bufs::put(b);
                            }
                            Some(self.send_c2h_lent(cid, lent, len, success))
                        }
                        (Data::Spliced(spliced), buf) => {
                            if let Some(b) = buf {
                                bufs::put(b);
                            }
                            Some(self.send_c2h_spliced(cid, spliced, len, success))
                        }
                        (Data::Buf, Some(b)) => {
                            self.send_c2h(cid, b, len, success);
                            Some(true)
                        }
                        (Data::Buf, None) => None,
                    };
                    match sent {
                        Some(false) => {
                            return self.respond(cid, Reply::status(Status::INTERNAL_ERROR));
                        }
                        Some(true) if success => return,
                        _ => {}
                    }
                } else if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.respond(cid, Reply::ok());
            }
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), cid, opcode = opc, error = %e, "I/O failed");
                if let Some(b) = c.buf {
                    bufs::put(b);
                }
                self.respond(cid, Reply::status(bdev_status(&e)));
            }
        }
    }
}

/// (SLBA, NLB) of a Read, Write or Write Zeroes; NLB is 1-based here.
fn lba_range(sqe: &Sqe) -> (u64, u64) {
    let slba = u64::from(sqe.dword(10)) | (u64::from(sqe.dword(11)) << 32);
    let nlb = u64::from(sqe.dword(12) & 0xFFFF) + 1;
    (slba, nlb)
}

/// Ranges of a Dataset Management command (NR is 0-based).
fn dsm_ranges(sqe: &Sqe) -> usize {
    (sqe.dword(10) & 0xFF) as usize + 1
}

/// A device error as an NVMe status.
fn bdev_status(e: &BdevError) -> Status {
    match e {
        BdevError::OutOfRange { .. } => Status::LBA_OUT_OF_RANGE,
        BdevError::Unsupported(_) => Status::INVALID_OPCODE,
        BdevError::BadRequest(_) => Status::INVALID_FIELD,
        BdevError::ReadOnly => Status::NAMESPACE_WRITE_PROTECTED,
        // Snapshots are named on the control path, never on an I/O.
        BdevError::NoSuchSnapshot(_) | BdevError::BadName(_) | BdevError::InUse(_) => {
            Status::INVALID_FIELD
        }
        // A replicated volume with no healthy replica fails with Failed;
        // the host may retry once one is back.
        BdevError::Failed(_) => Status::NAMESPACE_NOT_READY,
        // OptionRefused happens only at open, the resize refusals only
        // on the control path, never on an I/O.
        BdevError::Full { .. }
        | BdevError::Io(_)
        | BdevError::OptionRefused { .. }
        | BdevError::Shrink { .. }
        | BdevError::TooLarge { .. }
        | BdevError::ResizeUnaligned { .. } => Status::INTERNAL_ERROR,
    }
}

fn property_get(ctrl: &Controller, sqe: &Sqe) -> Reply {
    let size8 = sqe.dword(10) & 7 == 1;
    let offset = sqe.dword(11);
    let value: u64 = match offset {
        spec::PROP_CAP => spec::cap(MAX_QUEUE_ENTRIES),
        spec::PROP_VS => u64::from(spec::VERSION),
        spec::PROP_CC => u64::from(ctrl.cc()),
        spec::PROP_CSTS => u64::from(ctrl.csts()),
        _ => return Reply::status(Status::INVALID_FIELD),
    };
    // CAP is the one 8-byte property; a 4-byte read of it returns its low
    // half, an 8-byte read of a 4-byte one is invalid.
    if size8 && offset != spec::PROP_CAP {
        return Reply::status(Status::INVALID_FIELD);
    }
    Reply {
        dw0: value as u32,
        dw1: if size8 { (value >> 32) as u32 } else { 0 },
        ..Reply::ok()
    }
}

fn property_set(ctrl: &Controller, sqe: &Sqe) -> Reply {
    let offset = sqe.dword(11);
    let value = sqe.dword(12);
    match offset {
        spec::PROP_CC => {
            ctrl.set_cc(value);
            Reply::ok()
        }
        _ => Reply::status(Status::INVALID_FIELD),
    }
}

/// Get Log Page; `page` is the page built by the controller when it has
/// one for this LID (the discovery log of a discovery controller, the
/// changed namespace list), else the generic pages are served here.
fn get_log_page(sqe: &Sqe, page: Option<Vec<u8>>) -> Reply {
    let dw10 = sqe.dword(10);
    let lid = (dw10 & 0xFF) as u8;
    let numd = ((u64::from(sqe.dword(11) & 0xFFFF) << 16) | u64::from(dw10 >> 16)) + 1;
    let len = (numd * 4) as usize;
    let offset = u64::from(sqe.dword(12)) | (u64::from(sqe.dword(13)) << 32);
    let page_len = match (lid, &page) {
        (_, Some(p)) => p.len(),
        (spec::LOG_DISCOVERY, None) => return Reply::status(Status::INVALID_FIELD),
        (spec::LOG_ERROR, None) => 64 * ERROR_LOG_ENTRIES,
        (spec::LOG_SMART | spec::LOG_FIRMWARE_SLOT, None) => 512,
        _ => return Reply::status(Status::INVALID_FIELD),
    };
    if offset % 4 != 0 || offset > page_len as u64 || len > sqe.sgl().length as usize {
        return Reply::status(Status::INVALID_FIELD);
    }
    let mut page = page.unwrap_or_else(|| vec![0u8; page_len]);
    if lid == spec::LOG_FIRMWARE_SLOT {
        page[0] = 1; // AFI: slot 1 active
        let fr = env!("CARGO_PKG_VERSION").as_bytes();
        let n = fr.len().min(8);
        page[8..8 + n].copy_from_slice(&fr[..n]);
        page[8 + n..16].fill(b' ');
    }
    let mut out = page.split_off(offset as usize);
    // Past the end of the page the host reads zeros.
    out.resize(len, 0);
    Reply::data(out)
}

#[cfg(test)]
mod tests;
