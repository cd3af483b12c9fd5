//! A chain's channel: splits reads by layer, sends writes to the head,
//! copies blocks up, writes zeros over lower layers' blocks.
//!
//! Each request the owner submits becomes an `Op` in a slot table; the
//! requests sent to the layers' channels ("subs") carry the slot and the
//! sub's byte offset inside the op in their tag. A chain of one layer
//! skips all of it: requests pass to the layer with their own tags.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use lull_reactor::sys::{Epoll, EventFd};
use lull_reactor::Interest;

use super::map::block_span;
use super::{Shared, State, CHAIN_BLOCK_BYTES};
use crate::{
    validate_request, BdevError, Channel, Data, IoBuf, IoCompletion, IoOp, IoRequest, Spliced,
};

/// Requests of the owner in flight on one chain channel: a frontend
/// connection's depth (NBD's 128, an NVMe/TCP queue's) with room to spare.
/// Past it `submit` says `Full`.
pub const CHAIN_CHANNEL_DEPTH: usize = 256;

/// Bytes of zeros one write carries when zeroing over a lower layer's
/// blocks, and how many such writes one request keeps in flight: a 4 GiB
/// trim holds 2 MiB of zero buffers at a time, not 4 GiB.
const ZERO_CHUNK_BYTES: u64 = 1 << 20;
const ZERO_CHUNKS_IN_FLIGHT: u32 = 2;

/// Slots: every owner's request and the zero-fill chunks they may have.
const MAX_OPS: usize = CHAIN_CHANNEL_DEPTH * (1 + ZERO_CHUNKS_IN_FLIGHT as usize);

/// How long an owner whose request was handed back because the chain is
/// quiesced (a snapshot, revert or merge step) or because a copy-up holds
/// a block of it waits before it tries again. No completion of its own
/// may come to wake it (it may have nothing else in flight), so it is
/// told a time ([`Channel::retry_at_ns`]); a quiesce lasts a sync of the
/// head or one merge step (milliseconds), so 100 µs keeps the added
/// latency small at a few wake-ups per millisecond.
pub(super) const PAUSED_RETRY_NS: u64 = 100_000;

/// What a slot's op is doing.
enum Stage {
    /// Subs read into the op's buffer (or the buffer is lent to the one
    /// sub: `buf` is `None` until it comes back).
    Read,
    /// The op's buffer is lent to the head's write; blocks are marked
    /// held by the head when it completes.
    Write,
    /// The edge blocks of an unaligned write are read into `x`, the
    /// block-aligned image of the write (from byte `a0`).
    CopyRead { x: IoBuf, a0: u64 },
    /// `x` is being written to the head as `[a0, a1)`.
    CopyWrite { a0: u64, a1: u64 },
    /// Forwarded to the head as it is (flush; trim or zeroes where no
    /// lower layer holds a block).
    Pass,
    /// Zeros written over `[next, end)` in chunks (child ops).
    ZeroFill { next: u64, end: u64, fua: bool },
}

struct Op {
    tag: u64,
    op: IoOp,
    offset: u64,
    len: u32,
    buf: Option<IoBuf>,
    /// Subs (or child ops) in flight.
    pending: u32,
    error: Option<BdevError>,
    stage: Stage,
    /// A zero-fill's chunk: the slot of its zero-fill.
    parent: Option<u32>,
    /// Blocks `[first, end)` locked for a copy-up.
    lock: Option<(u64, u64)>,
    /// A read sent whole to one layer that lent its data or answered
    /// with a file range: handed on to the owner (who allowed lending or
    /// splicing) instead of the buffer's bytes.
    data: Data,
}

/// How the owner learns of completions: an epoll fd over the layers'
/// channels' fds and a doorbell (for completions made without I/O); or
/// none when the layers complete at `reap` (memory).
struct Wake {
    epoll: Epoll,
    doorbell: EventFd,
    /// The doorbell was rung since `reap` last drained it: only then is
    /// it read (a read is a syscall, per `reap`, that a one-layer chain's
    /// pass-through does not make).
    rung: std::cell::Cell<bool>,
}

const DOORBELL_TOKEN: u64 = u64::MAX;

pub(crate) struct ChainChannel {
    shared: Arc<Shared>,
    state: Arc<State>,
    generation: u64,
    /// Layer channels by index in `state`, opened on first use, with the
    /// layer id they were opened for.
    layers: Vec<Option<(u64, Box<dyn Channel>)>>,
    /// The owner's requests in flight, as the quiesce sees them.
    busy: Arc<AtomicUsize>,
    parents: usize,
    ops: Vec<Option<Op>>,
    free: Vec<u32>,
    /// Subs waiting for room in a layer's channel.
    queued: VecDeque<(usize, IoRequest)>,
    /// Zero-fill chunks waiting for a copy-up lock.
    stalled: Vec<u32>,
    ready: VecDeque<IoCompletion>,
    /// Subs a layer refused, completed at the next `reap`.
    failed: Vec<IoCompletion>,
    /// Layers with submissions to push (bit per index).
    dirty: u64,
    wake: Option<Wake>,
    polled: bool,
    reaped: Vec<(usize, IoCompletion)>,
    /// The last `submit` was handed back for a pause or a copy-up lock:
    /// when to try again (monotonic ns).
    retry_at: Option<u64>,
    /// The owner takes lent read data ([`Channel::allow_lend`]): the
    /// layers' channels are told so too. A layer's lent data is copied
    /// where the chain needs bytes (a read made of several layers' runs,
    /// a copy-up's read) and handed on when a read went whole to one
    /// layer (always, without snapshots).
    lend: bool,
    /// The owner takes read data held by a descriptor
    /// ([`Channel::allow_splice`]): the layers' channels are told so too,
    /// and their file ranges are read where the chain needs bytes and
    /// handed on as loans are.
    splice: bool,
}

impl ChainChannel {
    pub(crate) fn new(shared: Arc<Shared>) -> Result<ChainChannel, BdevError> {
        let state = shared.state();
        let generation = shared.generation.load(Ordering::Acquire);
        let busy = Arc::new(AtomicUsize::new(0));
        {
            // Closed channels' entries go as new ones come (a volume that
            // never quiesces must not keep one per connection it ever had).
            let mut list = shared.channels.lock().unwrap_or_else(|p| p.into_inner());
            list.retain(|w| w.strong_count() > 0);
            list.push(Arc::downgrade(&busy));
        }
        let mut ch = ChainChannel {
            layers: (0..state.layers.len()).map(|_| None).collect(),
            shared,
            state,
            generation,
            busy,
            parents: 0,
            ops: Vec::new(),
            free: Vec::new(),
            queued: VecDeque::new(),
            stalled: Vec::new(),
            ready: VecDeque::new(),
            failed: Vec::new(),
            dirty: 0,
            wake: None,
            polled: false,
            reaped: Vec::new(),
            retry_at: None,
            lend: false,
            splice: false,
        };
        // The head's channel decides how completions are waited for, for
        // the channel's whole life (an owner registers the fd once).
        let head = ch.state.layers.len() - 1;
        ch.layer(head)?;
        let (fd, polled) = match &ch.layers[head] {
            Some((_, c)) => (c.event_fd(), c.polled()),
            None => (None, false),
        };
        ch.polled = polled;
        if let (Some(fd), false) = (fd, polled) {
            let epoll = Epoll::new()?;
            let doorbell = EventFd::new()?;
            epoll.add(doorbell.as_raw_fd(), Interest::READABLE, DOORBELL_TOKEN)?;
            epoll.add(fd, Interest::READABLE, head as u64)?;
            ch.wake = Some(Wake {
                epoll,
                doorbell,
                rung: std::cell::Cell::new(false),
            });
        }
        Ok(ch)
    }

    /// The channel of layer `i`, opened (and watched) on first use.
    fn layer(&mut self, i: usize) -> Result<&mut Box<dyn Channel>, BdevError> {
        let id = self.state.layers[i].id;
        if self.layers[i].as_ref().is_none_or(|(lid, _)| *lid != id) {
            let mut c = self.state.layers[i].dev.open_channel()?;
            if self.lend {
                c.allow_lend();
            }
            if self.splice {
                c.allow_splice();
            }
            if let (Some(w), Some(fd)) = (&self.wake, c.event_fd()) {
                w.epoll.add(fd, Interest::READABLE, i as u64)?;
            }
            self.polled |= c.polled();
            if let Some((_, old)) = self.layers[i].replace((id, c)) {
                self.unwatch(old.as_ref());
            }
        }
        Ok(&mut self.layers[i].as_mut().expect("opened above").1)
    }

    fn unwatch(&self, c: &dyn Channel) {
        if let (Some(w), Some(fd)) = (&self.wake, c.event_fd()) {
            let _ = w.epoll.delete(fd);
        }
    }

    fn passthrough(&self) -> bool {
        self.state.top.is_none()
    }

    fn head(&self) -> usize {
        self.state.layers.len() - 1
    }

    /// Takes the chain's new state when it changed and nothing is in
    /// flight here (control operations quiesce first, so that is when).
    fn refresh(&mut self) {
        let g = self.shared.generation.load(Ordering::Acquire);
        if g == self.generation || self.parents > 0 || !self.queued.is_empty() {
            return;
        }
        let state = self.shared.state();
        let mut old: Vec<(u64, Box<dyn Channel>)> = self.layers.drain(..).flatten().collect();
        self.layers = state
            .layers
            .iter()
            .map(|l| {
                old.iter()
                    .position(|(id, _)| *id == l.id)
                    .map(|p| old.swap_remove(p))
            })
            .collect();
        for (_, c) in old {
            self.unwatch(c.as_ref());
        }
        // Channels kept may sit at another index now: watch them under it.
        if let Some(w) = &self.wake {
            for (i, slot) in self.layers.iter().enumerate() {
                if let Some(fd) = slot.as_ref().and_then(|(_, c)| c.event_fd()) {
                    let _ = w.epoll.modify(fd, Interest::READABLE, i as u64);
                }
            }
        }
        self.state = state;
        self.generation = g;
    }

    fn set_busy(&self, n: usize) {
        self.busy.store(n, Ordering::SeqCst);
    }

    /// `req` handed back as full for a reason no completion of this
    /// channel ends (a pause, another channel's copy-up): the owner is
    /// told when to try again.
    fn held(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        use lull_reactor::Clock;
        self.retry_at = Some(lull_reactor::MonotonicClock.now_ns() + PAUSED_RETRY_NS);
        Err((
            req,
            BdevError::Full {
                capacity: CHAIN_CHANNEL_DEPTH,
            },
        ))
    }

    fn alloc(&mut self, op: Op) -> Option<u32> {
        if let Some(s) = self.free.pop() {
            self.ops[s as usize] = Some(op);
            return Some(s);
        }
        if self.ops.len() >= MAX_OPS {
            return None;
        }
        self.ops.push(Some(op));
        Some((self.ops.len() - 1) as u32)
    }

    fn op(&mut self, slot: u32) -> &mut Op {
        self.ops[slot as usize]
            .as_mut()
            .expect("a slot in use has an op")
    }

    /// Sends a sub to layer `i`, or queues it until the layer has room.
    fn send(&mut self, i: usize, req: IoRequest) {
        if !self.queued.is_empty() {
            self.queued.push_back((i, req));
            return;
        }
        let ch = match self.layer(i) {
            Ok(ch) => ch,
            Err(e) => return self.sub_failed(req, e),
        };
        match ch.submit(req) {
            Ok(()) => self.dirty |= 1 << i,
            Err((req, BdevError::Full { .. })) => self.queued.push_back((i, req)),
            Err((req, e)) => self.sub_failed(req, e),
        }
    }

    /// A sub a layer refused completes with the error at the next
    /// `reap`, never inside the call that sent it (the op it belongs to
    /// is still being set up).
    fn sub_failed(&mut self, req: IoRequest, e: BdevError) {
        self.failed.push(IoCompletion {
            tag: req.tag,
            result: Err(e),
            buf: req.buf,
            data: Data::Buf,
        });
        self.ring();
    }

    fn push_queued(&mut self) {
        while let Some((i, req)) = self.queued.pop_front() {
            let ch = match self.layer(i) {
                Ok(ch) => ch,
                Err(e) => {
                    self.sub_failed(req, e);
                    continue;
                }
            };
            match ch.submit(req) {
                Ok(()) => self.dirty |= 1 << i,
                Err((req, BdevError::Full { .. })) => {
                    self.queued.push_front((i, req));
                    break;
                }
                Err((req, e)) => self.sub_failed(req, e),
            }
        }
    }

    fn sub(
        tag_slot: u32,
        rel: u64,
        op: IoOp,
        offset: u64,
        len: u64,
        buf: Option<IoBuf>,
    ) -> IoRequest {
        IoRequest {
            tag: (u64::from(tag_slot) << 32) | rel,
            op,
            offset,
            len: len as u32,
            buf,
        }
    }

    fn fresh_buf(len: u64) -> IoBuf {
        let mut b = IoBuf::with_capacity(len as usize);
        b.set_len(len as usize);
        b
    }

    /// Starts a read: one sub per run of blocks with the same top layer.
    fn start_read(&mut self, slot: u32) {
        let (offset, len) = {
            let op = self.op(slot);
            (op.offset, u64::from(op.len))
        };
        let top = self.state.top.clone().expect("layered");
        let end = offset + len;
        let mut runs: Vec<(u8, u64, u64)> = Vec::new();
        let mut pos = offset;
        while pos < end {
            let blk = pos / CHAIN_BLOCK_BYTES;
            let stop = ((blk + 1) * CHAIN_BLOCK_BYTES).min(end);
            let v = top.get(blk);
            match runs.last_mut() {
                Some((lv, _, e)) if *lv == v => *e = stop,
                _ => runs.push((v, pos, stop)),
            }
            pos = stop;
        }
        if let [(v, _, _)] = runs[..] {
            if v > 0 {
                let buf = self.op(slot).buf.take();
                let op = self.op(slot);
                op.pending = 1;
                let req = Self::sub(slot, 0, IoOp::Read, offset, len, buf);
                self.send(usize::from(v) - 1, req);
                return;
            }
        }
        let mut subs = Vec::new();
        {
            let op = self.op(slot);
            let buf = op.buf.as_mut().expect("a read has its buffer");
            for &(v, a, b) in &runs {
                let rel = (a - offset) as usize;
                if v == 0 {
                    buf.as_mut_slice()[rel..rel + (b - a) as usize].fill(0);
                } else {
                    subs.push((usize::from(v) - 1, a, b));
                }
            }
            op.pending = subs.len() as u32;
        }
        for (layer, a, b) in subs {
            let req = Self::sub(
                slot,
                a - offset,
                IoOp::Read,
                a,
                b - a,
                Some(Self::fresh_buf(b - a)),
            );
            self.send(layer, req);
        }
        self.settle(slot);
    }

    /// Whether the owner's own writes in flight touch blocks `[b0, b1)`.
    fn own_writes_touch(&self, skip: u32, b0: u64, b1: u64) -> bool {
        self.ops.iter().enumerate().any(|(i, o)| {
            i as u32 != skip
                && o.as_ref().is_some_and(|o| {
                    matches!(
                        o.stage,
                        Stage::Write
                            | Stage::CopyRead { .. }
                            | Stage::CopyWrite { .. }
                            | Stage::Pass
                    ) && o.pending > 0
                        && {
                            let (a, b) = block_span(o.offset, u64::from(o.len));
                            a < b1 && b0 < b
                        }
                })
        })
    }

    /// Starts a write (an owner's or a zero-fill chunk). `false`: blocked
    /// by a copy-up in flight; nothing was sent.
    fn start_write(&mut self, slot: u32) -> bool {
        let (offset, len, fua) = {
            let op = self.op(slot);
            let fua = matches!(op.op, IoOp::Write { fua: true });
            (op.offset, u64::from(op.len), fua)
        };
        let size = self.shared.size();
        let (b0, b1) = block_span(offset, len);
        if self.shared.blocks_locked(b0, b1) {
            return false;
        }
        let head = self.head();
        let end = offset + len;
        let block_end = |b: u64| ((b + 1) * CHAIN_BLOCK_BYTES).min(size);
        let partial = |b: u64| offset > b * CHAIN_BLOCK_BYTES || end < block_end(b);
        // The first and last block (the same one for a write inside one
        // block): only they can be partial. An array, not a Vec: this
        // runs for every write to a layered chain.
        let edges = if b1 - 1 != b0 { [b0, b1 - 1] } else { [b0, b0] };
        let edges = &edges[..if b1 - 1 != b0 { 2 } else { 1 }];
        // A block-aligned write (the common first write after a snapshot)
        // asks no map.
        let copy = {
            let top = self.state.top.as_deref().expect("layered");
            edges.iter().any(|&b| {
                partial(b) && {
                    let v = top.get(b);
                    v != 0 && usize::from(v) - 1 != head
                }
            })
        };
        if !copy {
            let buf = self.op(slot).buf.take();
            let op = self.op(slot);
            op.stage = Stage::Write;
            op.pending = 1;
            let req = Self::sub(slot, 0, IoOp::Write { fua }, offset, len, buf);
            self.send(head, req);
            return true;
        }
        if self.own_writes_touch(slot, b0, b1) || !self.shared.lock_blocks(b0, b1) {
            return false;
        }
        let a0 = b0 * CHAIN_BLOCK_BYTES;
        let a1 = block_end(b1 - 1);
        let top = self.state.top.clone().expect("layered");
        let mut reads = Vec::new();
        for &b in edges {
            if partial(b) {
                let v = top.get(b);
                if v != 0 {
                    reads.push((usize::from(v) - 1, b * CHAIN_BLOCK_BYTES, block_end(b)));
                }
            }
        }
        let op = self.op(slot);
        op.lock = Some((b0, b1));
        op.stage = Stage::CopyRead {
            x: Self::fresh_buf(a1 - a0),
            a0,
        };
        op.pending = reads.len() as u32;
        for (layer, a, b) in reads {
            let req = Self::sub(
                slot,
                a - a0,
                IoOp::Read,
                a,
                b - a,
                Some(Self::fresh_buf(b - a)),
            );
            self.send(layer, req);
        }
        self.settle(slot);
        true
    }

    /// Starts a trim or zeroing: passed to the head when no lower layer
    /// holds a block of it, else zeros are written (module doc).
    fn start_zero(&mut self, slot: u32) {
        let (offset, len, op_kind) = {
            let op = self.op(slot);
            (op.offset, u64::from(op.len), op.op)
        };
        let (b0, b1) = block_span(offset, len);
        let head = self.head();
        let lower = self.state.layers[..head]
            .iter()
            .any(|l| l.held.any_in(b0, b1));
        if !lower {
            let op = self.op(slot);
            op.stage = Stage::Pass;
            op.pending = 1;
            let req = Self::sub(slot, 0, op_kind, offset, len, None);
            self.send(head, req);
            return;
        }
        let fua = matches!(op_kind, IoOp::WriteZeroes { fua: true, .. });
        let op = self.op(slot);
        op.stage = Stage::ZeroFill {
            next: offset,
            end: offset + len,
            fua,
        };
        self.advance_zero(slot);
    }

    /// Sends a zero-fill's next chunks, or finishes it.
    fn advance_zero(&mut self, slot: u32) {
        loop {
            let op = self.op(slot);
            let Stage::ZeroFill { next, end, fua } = op.stage else {
                return;
            };
            if next >= end || op.pending >= ZERO_CHUNKS_IN_FLIGHT || op.error.is_some() {
                break;
            }
            let n = (end - next).min(ZERO_CHUNK_BYTES);
            op.stage = Stage::ZeroFill {
                next: next + n,
                end,
                fua,
            };
            op.pending += 1;
            let child = Op {
                tag: 0,
                op: IoOp::Write { fua },
                offset: next,
                len: n as u32,
                buf: Some(Self::fresh_buf(n)),
                pending: 0,
                error: None,
                stage: Stage::Write,
                parent: Some(slot),
                lock: None,
                data: Data::Buf,
            };
            let Some(c) = self.alloc(child) else {
                let op = self.op(slot);
                op.pending -= 1;
                op.stage = Stage::ZeroFill { next, end, fua };
                break;
            };
            if !self.start_write(c) {
                self.stalled.push(c);
            }
        }
        self.settle(slot);
    }

    /// Handles one sub's completion.
    fn on_sub(&mut self, c: IoCompletion) {
        let slot = (c.tag >> 32) as u32;
        let rel = (c.tag & 0xFFFF_FFFF) as usize;
        let mut next_write = None;
        let mut data = c.data;
        {
            let op = self.op(slot);
            op.pending -= 1;
            if let Err(e) = c.result {
                op.error.get_or_insert(e);
            }
            match &mut op.stage {
                Stage::Read => match (&mut op.buf, c.buf) {
                    (None, b) => {
                        op.buf = b;
                        op.data = std::mem::take(&mut data);
                    }
                    (Some(dst), Some(src)) => match std::mem::take(&mut data) {
                        // A sub of a read made of several runs: the
                        // chain needs the bytes.
                        Data::Spliced(s) => {
                            if let Err(e) = Self::read_spliced(s, &mut dst.as_mut_slice()[rel..]) {
                                op.error.get_or_insert(e);
                            }
                        }
                        held => {
                            let bytes = match &held {
                                Data::Lent(l) => l.as_slice(),
                                _ => src.as_slice(),
                            };
                            let n = bytes.len();
                            dst.as_mut_slice()[rel..rel + n].copy_from_slice(bytes);
                        }
                    },
                    (Some(_), None) => {}
                },
                Stage::Write | Stage::Pass => {
                    if op.buf.is_none() {
                        op.buf = c.buf;
                    }
                    if op.error.is_none() && matches!(op.stage, Stage::Write) {
                        let (b0, b1) = block_span(op.offset, u64::from(op.len));
                        mark(&self.state, b0, b1);
                    }
                }
                Stage::CopyRead { x, a0 } => {
                    match std::mem::take(&mut data) {
                        Data::Spliced(s) => {
                            if let Err(e) = Self::read_spliced(s, &mut x.as_mut_slice()[rel..]) {
                                op.error.get_or_insert(e);
                            }
                        }
                        held => {
                            if let Some(src) = c.buf {
                                let bytes = match &held {
                                    Data::Lent(l) => l.as_slice(),
                                    _ => src.as_slice(),
                                };
                                let n = bytes.len();
                                x.as_mut_slice()[rel..rel + n].copy_from_slice(bytes);
                            }
                        }
                    }
                    if op.pending == 0 && op.error.is_none() {
                        let a0 = *a0;
                        let mut x = std::mem::replace(x, IoBuf::with_capacity(0));
                        let at = (op.offset - a0) as usize;
                        let n = op.len as usize;
                        if let Some(data) = &op.buf {
                            x.as_mut_slice()[at..at + n].copy_from_slice(&data.as_slice()[..n]);
                        }
                        let a1 = a0 + x.len() as u64;
                        let fua = matches!(op.op, IoOp::Write { fua: true });
                        op.stage = Stage::CopyWrite { a0, a1 };
                        op.pending = 1;
                        next_write = Some(Self::sub(
                            slot,
                            0,
                            IoOp::Write { fua },
                            a0,
                            a1 - a0,
                            Some(x),
                        ));
                    }
                }
                Stage::CopyWrite { a0, a1 } => {
                    if op.error.is_none() {
                        let (b0, b1) = block_span(*a0, *a1 - *a0);
                        mark(&self.state, b0, b1);
                    }
                }
                Stage::ZeroFill { .. } => {}
            }
        }
        // Data for a stage that takes none (a failed read's, a write's).
        data.release();
        if let Some(req) = next_write {
            let head = self.head();
            self.send(head, req);
        }
        self.settle(slot);
    }

    /// The bytes of a layer's descriptor-held read, where the chain needs
    /// them in memory: a file range is read (a layer lends only ranges
    /// of a file on a memory filesystem, so this waits for no disk, and
    /// is the copy the layer would have made); a pipe, which no layer
    /// hands over, is a bug.
    fn read_spliced(s: Spliced, dst: &mut [u8]) -> Result<(), BdevError> {
        match s {
            Spliced::File(r) => r.read_into(dst),
            Spliced::Pipe(p) => {
                lull_uring::pipes::put(p);
                Err(BdevError::Failed("a chain layer handed over a pipe".into()))
            }
        }
    }

    /// Finishes the op in `slot` if nothing of it is in flight.
    fn settle(&mut self, slot: u32) {
        {
            let Some(op) = self.ops[slot as usize].as_mut() else {
                return;
            };
            if op.pending > 0
                || matches!(op.stage, Stage::ZeroFill { next, end, .. } if next < end && op.error.is_none())
            {
                return;
            }
        }
        let op = self.ops[slot as usize].take().expect("settled once");
        self.free.push(slot);
        if let Some((b0, b1)) = op.lock {
            self.shared.unlock_blocks(b0, b1);
        }
        let result = op.error.map_or(Ok(()), Err);
        match op.parent {
            Some(p) => {
                let parent = self.op(p);
                parent.pending -= 1;
                if let Err(e) = result {
                    parent.error.get_or_insert(e);
                }
                self.advance_zero(p);
            }
            None => {
                self.parents -= 1;
                self.set_busy(self.parents);
                self.ready.push_back(IoCompletion {
                    tag: op.tag,
                    result,
                    buf: op.buf,
                    data: op.data,
                });
            }
        }
    }

    fn ring(&self) {
        if let Some(w) = &self.wake {
            w.doorbell.notify();
            w.rung.set(true);
        }
    }

    /// One round of reaping the layers; whether anything happened.
    fn reap_layers(&mut self) -> bool {
        let mut got = std::mem::take(&mut self.reaped);
        for (i, slot) in self.layers.iter_mut().enumerate() {
            if let Some((_, ch)) = slot {
                if ch.in_flight() > 0 || ch.event_fd().is_none() {
                    ch.reap(&mut |c| got.push((i, c)));
                }
            }
        }
        got.extend(self.failed.drain(..).map(|c| (usize::MAX, c)));
        let any = !got.is_empty();
        for (_, c) in got.drain(..) {
            self.on_sub(c);
        }
        self.reaped = got;
        let stalled = std::mem::take(&mut self.stalled);
        let mut moved = false;
        for s in stalled {
            if self.start_write(s) {
                moved = true;
            } else {
                self.stalled.push(s);
            }
        }
        self.push_queued();
        self.flush_dirty();
        any || moved
    }

    fn flush_dirty(&mut self) {
        let mut d = std::mem::take(&mut self.dirty);
        while d != 0 {
            let i = d.trailing_zeros() as usize;
            d &= d - 1;
            if let Some((_, ch)) = self.layers.get_mut(i).and_then(Option::as_mut) {
                ch.flush_submissions();
            }
        }
    }
}

/// Marks blocks `[b0, b1)` as the head's, in its bitmap and the top map.
fn mark(state: &State, b0: u64, b1: u64) {
    let head = state.layers.len() - 1;
    state.layers[head].held.set_range(b0, b1);
    if let Some(top) = &state.top {
        top.set_range(b0, b1, head as u8 + 1);
    }
}

impl Channel for ChainChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        self.retry_at = None;
        if self.shared.paused.load(Ordering::SeqCst) > 0 {
            return self.held(req);
        }
        self.refresh();
        let modifies = matches!(
            req.op,
            IoOp::Write { .. } | IoOp::Trim | IoOp::WriteZeroes { .. }
        );
        if modifies && self.state.read_only {
            return Err((req, BdevError::ReadOnly));
        }
        if self.parents >= CHAIN_CHANNEL_DEPTH {
            return Err((
                req,
                BdevError::Full {
                    capacity: CHAIN_CHANNEL_DEPTH,
                },
            ));
        }
        // Counted before the pause is looked at again: the quiesce sets
        // the pause, then sums the counts (both SeqCst), so one of the
        // two sees the other.
        self.set_busy(self.parents + 1);
        if self.shared.paused.load(Ordering::SeqCst) > 0 {
            self.set_busy(self.parents);
            return self.held(req);
        }
        if self.passthrough() {
            if modifies {
                // The one layer's map stays current (a trim leaves its
                // bits set: held blocks read as what they hold), so a
                // first snapshot takes it as it is, with no scan while
                // writes wait.
                let (first, end) = block_span(req.offset, u64::from(req.len));
                self.state.layers[0].held.set_range(first, end);
            }
            let r = match self.layer(0) {
                Ok(ch) => ch.submit(req),
                Err(e) => Err((req, e)),
            };
            match r {
                Ok(()) => self.parents += 1,
                Err(e) => {
                    self.set_busy(self.parents);
                    return Err(e);
                }
            }
            return Ok(());
        }
        if let Err(e) = validate_request(&req, self.shared.size()) {
            self.set_busy(self.parents);
            return Err((req, e));
        }
        if matches!(req.op, IoOp::BlockStatus | IoOp::ChangedSince)
            || matches!(req.op, IoOp::WriteZeroes { fast: true, .. })
        {
            self.set_busy(self.parents);
            return Err((
                req,
                BdevError::Unsupported(
                    "a chain of layers answers block status and changed-since inline, and zeroes by writing",
                ),
            ));
        }
        if self.free.is_empty() && self.ops.len() >= MAX_OPS {
            self.set_busy(self.parents);
            return Err((
                req,
                BdevError::Full {
                    capacity: CHAIN_CHANNEL_DEPTH,
                },
            ));
        }
        let IoRequest {
            tag,
            op,
            offset,
            len,
            buf,
        } = req;
        let slot = self
            .alloc(Op {
                tag,
                op,
                offset,
                len,
                buf,
                pending: 0,
                error: None,
                stage: Stage::Read,
                parent: None,
                lock: None,
                data: Data::Buf,
            })
            .expect("room checked above");
        self.parents += 1;
        match op {
            IoOp::Read => self.start_read(slot),
            IoOp::Write { .. } => {
                if !self.start_write(slot) {
                    // A copy-up holds a block of it: hand it back, the
                    // owner retries (as for a full channel).
                    let o = self.ops[slot as usize].take().expect("just made");
                    self.free.push(slot);
                    self.parents -= 1;
                    self.set_busy(self.parents);
                    return self.held(IoRequest {
                        tag: o.tag,
                        op: o.op,
                        offset: o.offset,
                        len: o.len,
                        buf: o.buf,
                    });
                }
            }
            IoOp::Trim | IoOp::WriteZeroes { .. } => self.start_zero(slot),
            IoOp::Flush => {
                let o = self.op(slot);
                o.stage = Stage::Pass;
                o.pending = 1;
                let head = self.head();
                self.send(head, Self::sub(slot, 0, IoOp::Flush, 0, 0, None));
            }
            IoOp::BlockStatus | IoOp::ChangedSince => unreachable!("refused above"),
        }
        if !self.ready.is_empty() || !self.stalled.is_empty() {
            self.ring();
        }
        Ok(())
    }

    fn flush_submissions(&mut self) {
        if self.passthrough() {
            if let Some(Some((_, ch))) = self.layers.first_mut() {
                ch.flush_submissions();
            }
            return;
        }
        self.flush_dirty();
    }

    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        if self.passthrough() {
            let n = match self.layers.first_mut() {
                Some(Some((_, ch))) => ch.reap(done),
                _ => 0,
            };
            self.parents -= n.min(self.parents);
            self.set_busy(self.parents);
            return n;
        }
        if let Some(w) = &self.wake {
            if w.rung.replace(false) {
                w.doorbell.drain();
            }
        }
        // Layers that complete at `reap` (memory) finish a multi-step op
        // (a copy-up's read, then its write) in one call.
        let mut rounds = 0;
        while self.reap_layers() && rounds < 64 {
            rounds += 1;
        }
        let n = self.ready.len();
        while let Some(c) = self.ready.pop_front() {
            done(c);
        }
        if !self.stalled.is_empty() {
            self.ring();
        }
        n
    }

    fn event_fd(&self) -> Option<RawFd> {
        if self.polled {
            return None;
        }
        self.wake.as_ref().map(|w| w.epoll_fd())
    }

    fn in_flight(&self) -> usize {
        self.parents
    }

    fn allow_lend(&mut self) {
        self.lend = true;
        for (_, c) in self.layers.iter_mut().flatten() {
            c.allow_lend();
        }
    }

    fn allow_splice(&mut self) {
        self.splice = true;
        for (_, c) in self.layers.iter_mut().flatten() {
            c.allow_splice();
        }
    }

    fn lends(&self) -> bool {
        self.lend && self.layers.iter().flatten().all(|(_, c)| c.lends())
    }

    fn polled(&self) -> bool {
        self.polled
    }

    fn retry_at_ns(&self) -> Option<u64> {
        self.retry_at
    }
}

impl Wake {
    fn epoll_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }
}

/// Blocking I/O to a layer for a merge (its own thread, never a
/// reactor): one request at a time, waiting on the channel's fd.
#[derive(Default)]
pub(crate) struct SyncIo {
    channels: Vec<(usize, Box<dyn Channel>)>,
}

/// How long one wait for a layer's completion sleeps before it looks again.
const SYNC_WAIT_MS: i32 = 100;

impl SyncIo {
    fn run(
        &mut self,
        dev: &dyn crate::BlockDevice,
        req: IoRequest,
    ) -> Result<Option<IoBuf>, BdevError> {
        let key = dev as *const dyn crate::BlockDevice as *const () as usize;
        let i = match self.channels.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                self.channels.push((key, dev.open_channel()?));
                self.channels.len() - 1
            }
        };
        let ch = &mut self.channels[i].1;
        ch.submit(req).map_err(|(_, e)| e)?;
        ch.flush_submissions();
        loop {
            let mut out = None;
            ch.reap(&mut |c| out = Some(c));
            if let Some(c) = out {
                return c.result.map(|()| c.buf);
            }
            match ch.event_fd() {
                Some(fd) => {
                    lull_uring::wait_readable(fd, SYNC_WAIT_MS)?;
                }
                None => std::thread::yield_now(),
            }
        }
    }

    pub(crate) fn read(
        &mut self,
        dev: &dyn crate::BlockDevice,
        offset: u64,
        len: u64,
    ) -> Result<IoBuf, BdevError> {
        let buf = ChainChannel::fresh_buf(len);
        let req = ChainChannel::sub(0, 0, IoOp::Read, offset, len, Some(buf));
        self.run(dev, req)?.ok_or(BdevError::Failed(
            "a read came back without its buffer".into(),
        ))
    }

    pub(crate) fn write(
        &mut self,
        dev: &dyn crate::BlockDevice,
        offset: u64,
        buf: IoBuf,
    ) -> Result<(), BdevError> {
        let len = buf.len() as u64;
        let req = ChainChannel::sub(0, 0, IoOp::Write { fua: false }, offset, len, Some(buf));
        self.run(dev, req).map(drop)
    }

    pub(crate) fn flush(&mut self, dev: &dyn crate::BlockDevice) -> Result<(), BdevError> {
        let req = ChainChannel::sub(0, 0, IoOp::Flush, 0, 0, None);
        self.run(dev, req).map(drop)
    }
}

impl Drop for ChainChannel {
    fn drop(&mut self) {
        // Locks of copy-ups the owner gave up on (it drops the channel
        // only when nothing is in flight, or on its way out).
        for op in self.ops.iter().flatten() {
            if let Some((b0, b1)) = op.lock {
                self.shared.unlock_blocks(b0, b1);
            }
        }
        self.set_busy(0);
    }
}
