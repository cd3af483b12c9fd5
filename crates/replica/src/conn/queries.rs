//! The requests that read the replica's maps rather than its data:
//! EXTENTS and BLOCK_STATUS (the chain's or the file's allocation),
//! CHANGED (blocks changed since a snapshot), the write-intent record
//! and the change records (INTENT_GET, CHANGES).

use super::*;

impl Conn {
    /// CHANGES_START / _GET / _DROP with its key (START and DROP counted
    /// in the fence). START waits until durable, as INTENT_MARK does; DROP
    /// is answered at once; GET answers the record's bitmap, `ENOENT` when
    /// there is none for the peer, `ESTALE` (with the record's generation
    /// as the reply's offset) when it is for another generation.
    pub(super) fn changes_request(&mut self, req: Header, key: proto::ChangeKey) {
        let intent = self.server().intent.clone();
        match req.kind {
            Kind::ChangesStart => match intent.changes_start(&key) {
                Ok(Ok(seq)) => {
                    tracing::info!(peer = %self.wire.peer(), replica = %key.peer,
                        generation = key.generation, "change record started for a replica away");
                    self.wait = Some(Wait::Intent { req, seq });
                }
                Ok(Err(e)) => {
                    tracing::warn!(peer = %self.wire.peer(), replica = %key.peer, error = %e,
                        "change record refused");
                    self.fence_exit();
                    self.push_error(req, e.errno());
                }
                Err(e) => {
                    self.fence_exit();
                    self.intent_failed(req, e);
                }
            },
            Kind::ChangesDrop => {
                let dropped = intent.changes_drop(&key.peer);
                self.fence_exit();
                match dropped {
                    Ok(dropped) => {
                        if dropped {
                            tracing::info!(peer = %self.wire.peer(), replica = %key.peer,
                                "change record ended");
                        }
                        self.push_reply(req.reply_with(0), Payload::None);
                    }
                    Err(e) => self.intent_failed(req, e),
                }
            }
            _ => {
                let (record, region_bytes) = intent.changes_get(&key.peer);
                match record {
                    None => self.push_error(req, libc::ENOENT),
                    Some((generation, _)) if generation != key.generation => {
                        let mut reply = req.reply_with(libc::ESTALE as u32);
                        reply.offset = generation;
                        self.push_reply(reply, Payload::None);
                    }
                    Some((_, bitmap)) => {
                        let mut reply = req.reply_with(0);
                        reply.offset = region_bytes;
                        // At most MAX_CHANGE_BITMAP_BYTES by the region size.
                        reply.length = bitmap.len() as u32;
                        self.push_reply(reply, Payload::Bytes(bitmap));
                    }
                }
            }
        }
    }

    /// INTENT_GET: the bitmap as it is in memory (a superset of what is
    /// durable: marks are set before they are stored, clears persist
    /// lazily), flagged when the record was lost.
    pub(super) fn intent_get(&mut self, req: Header) {
        let (lost, bitmap) = self.server().intent.snapshot();
        let flags = if lost { INTENT_FLAG_LOST } else { 0 };
        let mut payload = Vec::with_capacity(proto::INTENT_HEADER_LEN + bitmap.len());
        if let Err(e) = proto::encode_intent(flags, &bitmap, &mut payload) {
            tracing::error!(peer = %self.wire.peer(), error = %e, "cannot encode the write-intent record");
            self.push_error(req, libc::EIO);
            return;
        }
        let mut reply = req.reply_with(0);
        reply.offset = u64::from(self.server().regions());
        reply.length = payload.len() as u32;
        self.push_reply(reply, Payload::Bytes(payload));
    }

    /// The device this connection's data requests ask: its snapshot's
    /// view, or the live chain. With whether it answers allocation from
    /// layer maps (`layered`: a scan per 4 KiB block, bounded per reply by
    /// [`MAX_MAP_SCAN_BYTES`]); a view is taken as layered, since the
    /// device does not say how many layers it has (at worst the peer asks
    /// again more often).
    pub(super) fn data_device(&self) -> (Arc<dyn BlockDevice>, bool) {
        match &self.view {
            Some(view) => (view.dev.clone(), true),
            None => {
                let chain = self.server().chain.clone();
                let layered = chain.single_layer_id().is_none();
                (chain, layered)
            }
        }
    }

    /// Answers EXTENTS inline from `dev`'s allocation
    /// (`BlockDevice::extents`; [`Conn::data_device`]): a chain of one
    /// layer asks its file (SEEK_DATA/SEEK_HOLE, non-sleeping metadata
    /// lookups, ≤ 2 lseeks per extent), a `layered` one its maps (at most
    /// [`MAX_MAP_SCAN_BYTES`] of them per reply). A reply holds at most
    /// `MAX_EXTENTS_PER_REPLY` extents, so the reactor is held for
    /// microseconds; the peer continues from the scan end the reply
    /// reports. A block any layer holds is data: what a rebuild copies is
    /// the live volume (a view's: the snapshot).
    pub(super) fn extents(&mut self, req: Header, dev: &dyn BlockDevice, layered: bool) {
        let mut end = req.offset + u64::from(req.length);
        if layered {
            end = end.min(req.offset.saturating_add(MAX_MAP_SCAN_BYTES));
        }
        let mut pos = req.offset;
        let mut found: Vec<(u64, u64)> = Vec::new();
        'scan: while pos < end && found.len() < MAX_EXTENTS_PER_REPLY {
            // Holes and data alternate: twice as many cover as many data.
            let extents = match dev.extents(pos, end - pos, 2 * MAX_EXTENTS_PER_REPLY) {
                Ok(extents) if !extents.is_empty() => extents,
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(peer = %self.wire.peer(), offset = pos, error = %e, "allocation scan failed");
                    self.push_error(req, e.errno());
                    return;
                }
            };
            for e in extents {
                // Within the range asked, whatever the device reports.
                let len = e.length_bytes.min(end - pos);
                if !e.hole {
                    let full = found.len() == MAX_EXTENTS_PER_REPLY;
                    match found.last_mut() {
                        Some(last) if last.0 + last.1 == pos => last.1 += len,
                        _ if full => break 'scan,
                        _ => found.push((pos, len)),
                    }
                }
                pos += len;
                if pos >= end {
                    break;
                }
            }
        }
        let mut payload = Vec::with_capacity(found.len() * proto::EXTENT_LEN);
        if let Err(e) = proto::encode_extents(&found, &mut payload) {
            tracing::error!(peer = %self.wire.peer(), error = %e, "cannot encode extents");
            self.push_error(req, libc::EIO);
            return;
        }
        let mut reply = req.reply_with(0);
        reply.offset = pos;
        reply.length = payload.len() as u32;
        self.push_reply(reply, Payload::Bytes(payload));
    }

    /// Answers BLOCK_STATUS inline from `dev`'s allocation, like EXTENTS
    /// (at most `MAX_BLOCK_STATUS_PER_REPLY` extents; a `layered` device
    /// scans at most [`MAX_MAP_SCAN_BYTES`] of its maps). A block no
    /// layer holds reads as zeros, so it is reported as hole and zero;
    /// allocated ranges as data. The range was checked against the
    /// volume by the caller.
    pub(super) fn block_status(&mut self, req: Header, dev: &dyn BlockDevice, layered: bool) {
        if req.length == 0 {
            tracing::warn!(peer = %self.wire.peer(), ?req, "refused request: empty BLOCK_STATUS");
            self.push_error(req, libc::EINVAL);
            return;
        }
        let mut length = u64::from(req.length);
        if layered {
            length = length.min(MAX_MAP_SCAN_BYTES);
        }
        let extents = match dev.extents(req.offset, length, MAX_BLOCK_STATUS_PER_REPLY) {
            Ok(extents) => extents,
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), ?req, error = %e, "block status failed");
                self.push_error(req, e.errno());
                return;
            }
        };
        let records: Vec<StatusExtent> = extents
            .iter()
            .map(|e| StatusExtent {
                length: e.length_bytes,
                flags: if e.hole { proto::STATUS_HOLE } else { 0 }
                    | if e.zero { proto::STATUS_ZERO } else { 0 },
            })
            .collect();
        self.push_status_records(req, &records);
    }

    /// The reply to a BLOCK_STATUS or CHANGED request: `records`
    /// encoded (`encode_block_status`), `EIO` if they cannot be.
    pub(super) fn push_status_records(&mut self, req: Header, records: &[StatusExtent]) {
        let mut payload = Vec::with_capacity(records.len() * proto::STATUS_EXTENT_LEN);
        if let Err(e) = proto::encode_block_status(records, &mut payload) {
            tracing::error!(peer = %self.wire.peer(), ?req, error = %e, "cannot encode a status reply");
            self.push_error(req, libc::EIO);
            return;
        }
        let mut reply = req.reply_with(0);
        reply.length = payload.len() as u32;
        self.push_reply(reply, Payload::Bytes(payload));
    }

    /// Answers CHANGED inline: which runs of `[offset, offset + length)`
    /// were written since snapshot `since` (`BlockDevice::changed_since`
    /// of the live chain, or of a view: up to its snapshot), as
    /// BLOCK_STATUS-shaped records flagged [`proto::STATUS_CHANGED`]. It
    /// looks at the layer maps block by block whatever the chain's shape,
    /// so a reply scans at most [`MAX_MAP_SCAN_BYTES`] of them and covers
    /// a prefix of the range (the peer asks again for the rest). `EINVAL`
    /// for a range empty or outside the volume; `ENOENT` for no snapshot
    /// `since` on this device (on a view, one not older than the view's).
    pub(super) fn changed(&mut self, req: Header, request: &ChangedRequest) {
        let size = self.server().size_bytes();
        let in_range = request.length > 0
            && req
                .offset
                .checked_add(u64::from(request.length))
                .is_some_and(|end| end <= size);
        if !in_range {
            tracing::warn!(peer = %self.wire.peer(), ?req, length = request.length, size,
                "refused request: CHANGED range empty or out of range");
            self.push_error(req, libc::EINVAL);
            return;
        }
        // A view's own snapshot is in its chain, as its top layer: the
        // protocol wants a snapshot older than the view's.
        if self
            .view
            .as_ref()
            .is_some_and(|v| v.snapshot == request.since)
        {
            tracing::warn!(peer = %self.wire.peer(), since = %request.since,
                "refused CHANGED: since is the view's own snapshot, not an older one");
            self.push_error(req, libc::ENOENT);
            return;
        }
        let (dev, _) = self.data_device();
        let length = u64::from(request.length).min(MAX_MAP_SCAN_BYTES);
        let runs = match dev.changed_since(
            &request.since,
            req.offset,
            length,
            MAX_BLOCK_STATUS_PER_REPLY,
        ) {
            Ok(runs) => runs,
            Err(e) => {
                tracing::warn!(peer = %self.wire.peer(), ?req, since = %request.since, error = %e,
                    errno = e.errno(), "CHANGED failed");
                self.push_error(req, e.errno());
                return;
            }
        };
        let records: Vec<StatusExtent> = runs
            .iter()
            .map(|r| StatusExtent {
                length: r.length_bytes,
                flags: if r.changed { proto::STATUS_CHANGED } else { 0 },
            })
            .collect();
        self.push_status_records(req, &records);
    }
}
