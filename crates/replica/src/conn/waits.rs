//! What a connection waits for off the reactor: a metadata write (HELLO's
//! generation, a clean detach), a snapshot job on its helper thread, a
//! write-intent change made durable; each checked when the connection
//! runs, the request answered when it is done.

use super::*;

impl Conn {
    /// Finish the current wait when it is over.
    pub(super) fn check_wait(&mut self) -> bool {
        match &self.wait {
            None => false,
            Some(Wait::Meta { .. }) => self.check_meta_wait(),
            Some(Wait::Intent { .. }) => self.check_intent_wait(),
            Some(Wait::Takeover { .. }) => self.check_takeover(),
            Some(Wait::Snapshot { .. }) => self.check_snapshot_wait(),
        }
    }

    /// Finish a metadata wait when its helper has answered.
    pub(super) fn check_meta_wait(&mut self) -> bool {
        let Some(Wait::Meta { rx, .. }) = &self.wait else {
            return false;
        };
        let result = match rx.try_recv() {
            Ok(r) => r,
            Err(mpsc::TryRecvError::Empty) => return false,
            Err(mpsc::TryRecvError::Disconnected) => Err(ReplicaError::ShuttingDown),
        };
        let Some(Wait::Meta { what, .. }) = self.wait.take() else {
            return false;
        };
        if !matches!(what, MetaFor::Dirty) {
            self.fence_exit();
        }
        match (result, what) {
            (Ok(generation), MetaFor::Attach(req)) => {
                let payload = self.our_hello(generation);
                self.push_reply(req.reply_with(0), Payload::Bytes(payload));
                tracing::info!(peer = %self.wire.peer(), generation, "engine attached");
            }
            (Ok(_), MetaFor::Detach(req)) => {
                self.push_reply(req.reply_with(0), Payload::None);
                tracing::info!(peer = %self.wire.peer(), "engine detached");
            }
            (Ok(_), MetaFor::Dirty) => {}
            (Err(e @ ReplicaError::DetachBusy { .. }), MetaFor::Detach(req)) => {
                // Nothing changed: the engine may detach again later.
                tracing::warn!(peer = %self.wire.peer(), error = %e, "DETACH refused");
                self.push_error(req, e.errno());
            }
            (Err(e), what) => {
                tracing::error!(peer = %self.wire.peer(), error = %e, "cannot persist the replica metadata");
                match what {
                    MetaFor::Attach(req) => self.refuse_hello(req, e.errno()),
                    MetaFor::Detach(req) => self.push_error(req, e.errno()),
                    MetaFor::Dirty => {}
                }
                // A write cannot be taken without a dirty record: the peer
                // sees the connection close and fails over.
                self.close(format!("metadata write failed: {e}"));
            }
        }
        true
    }

    /// Starts a metadata write on a helper thread and makes this
    /// connection wait for it. Attach and detach arrive counted in the
    /// fence.
    pub(super) fn start_meta_wait(&mut self, what: MetaFor, job: MetaJob) {
        let started = match self.me.clone() {
            Some((thread, poller)) => self.server().meta_async(job, thread, poller),
            // `poll` learns `me` before reading anything.
            None => Err(ReplicaError::ShuttingDown),
        };
        match started {
            Ok(rx) => self.wait = Some(Wait::Meta { what, rx }),
            Err(e) => {
                tracing::error!(peer = %self.wire.peer(), error = %e, "cannot start a metadata write");
                match what {
                    MetaFor::Attach(req) => {
                        self.fence_exit();
                        self.refuse_hello(req, e.errno());
                    }
                    MetaFor::Detach(req) => {
                        self.fence_exit();
                        self.push_error(req, e.errno());
                    }
                    MetaFor::Dirty => {}
                }
                self.close(format!("metadata write failed: {e}"));
            }
        }
    }

    /// Starts a SNAPSHOT (arriving counted in the fence) or SNAPSHOT_LIST
    /// on a helper thread and makes this connection wait for it.
    pub(super) fn start_snapshot(&mut self, req: Header, job: SnapshotJob) {
        let what = match &job {
            SnapshotJob::Run(r) => format!("{:?} {:?}", r.op, r.name),
            SnapshotJob::List => "list".to_string(),
            SnapshotJob::Clone { snapshot, name } => format!("clone {snapshot:?} as {name:?}"),
            SnapshotJob::Grow(size) => format!("grow to {size} bytes"),
        };
        let started = match self.me.clone() {
            Some((thread, poller)) => {
                let store = match &self.port.served {
                    crate::Served::Store(index) => Some(index.clone()),
                    crate::Served::One(_) => None,
                };
                self.server().snapshot_async(job, store, thread, poller)
            }
            // `poll` learns `me` before reading anything.
            None => Err(ReplicaError::ShuttingDown),
        };
        match started {
            Ok(rx) => self.wait = Some(Wait::Snapshot { req, what, rx }),
            Err(e) => {
                tracing::error!(peer = %self.wire.peer(), what, error = %e, "cannot start a snapshot operation");
                if req.kind.modifies() {
                    self.fence_exit();
                }
                self.push_error(req, e.errno());
            }
        }
    }

    /// Answer a SNAPSHOT or SNAPSHOT_LIST once its helper is done.
    pub(super) fn check_snapshot_wait(&mut self) -> bool {
        let Some(Wait::Snapshot { rx, .. }) = &self.wait else {
            return false;
        };
        let result = match rx.try_recv() {
            Ok(r) => r,
            Err(mpsc::TryRecvError::Empty) => return false,
            Err(mpsc::TryRecvError::Disconnected) => Err(SnapshotError::Closed),
        };
        let Some(Wait::Snapshot { req, what, .. }) = self.wait.take() else {
            return false;
        };
        if req.kind.modifies() {
            self.fence_exit();
        }
        let replica = self.server().name.clone().unwrap_or_default();
        match result {
            Ok(SnapshotDone::List(payload)) => {
                let mut reply = req.reply_with(0);
                // At most MAX_SNAPSHOT_LIST_BYTES (`snapshot_list`).
                reply.length = payload.len() as u32;
                self.push_reply(reply, Payload::Bytes(payload));
            }
            Ok(SnapshotDone::Ran) => {
                tracing::info!(peer = %self.wire.peer(), replica, what, "snapshot operation done");
                self.push_reply(req.reply_with(0), Payload::None);
            }
            Err(e) if e.is_refusal() => {
                tracing::warn!(peer = %self.wire.peer(), replica, what, error = %e, errno = e.errno(),
                    "snapshot operation refused");
                self.push_error(req, e.errno());
            }
            Err(e) => {
                tracing::error!(peer = %self.wire.peer(), replica, what, error = %e, errno = e.errno(),
                    "snapshot operation failed");
                self.push_error(req, e.errno());
            }
        }
        true
    }

    /// Answer an INTENT_MARK once it is durable.
    pub(super) fn check_intent_wait(&mut self) -> bool {
        let (Some(Wait::Intent { req, seq }), Some(me)) = (&self.wait, &self.me) else {
            return false;
        };
        let (req, seq) = (*req, *seq);
        let Some(result) = self.server().intent.poll_durable(seq, me) else {
            return false;
        };
        self.wait = None;
        self.fence_exit();
        match result {
            Ok(()) => self.push_reply(req.reply_with(0), Payload::None),
            Err(e) => self.intent_failed(req, e),
        }
        true
    }

    /// The write-intent record cannot be persisted: the engine must not
    /// write where the mark is not durable, so the connection ends.
    pub(super) fn intent_failed(&mut self, req: Header, e: IntentError) {
        tracing::error!(peer = %self.wire.peer(), ?req, error = %e, "write-intent record failed");
        self.push_error(req, libc::EIO);
        self.close(format!("write-intent record failed: {e}"));
    }

    /// INTENT_MARK / INTENT_CLEAR (counted in the fence): regions
    /// `[offset, offset + length)`. A mark waits until durable (the
    /// connection reads no frames meanwhile); a clear is answered at once
    /// and persisted lazily.
    pub(super) fn intent_update(&mut self, req: Header) {
        let regions = self.server().regions();
        let in_range = req
            .offset
            .checked_add(u64::from(req.length))
            .is_some_and(|end| end <= u64::from(regions));
        if !in_range {
            tracing::warn!(peer = %self.wire.peer(), ?req, regions, "refused request: regions out of range");
            self.fence_exit();
            self.push_error(req, libc::EINVAL);
            return;
        }
        // In range, so the first region fits a u32 (regions is one).
        let first = req.offset as u32;
        if req.kind == Kind::IntentClear {
            let cleared = self.server().intent.clear(first, req.length);
            self.fence_exit();
            match cleared {
                Ok(()) => self.push_reply(req.reply_with(0), Payload::None),
                Err(e) => self.intent_failed(req, e),
            }
            return;
        }
        match self.server().intent.mark(first, req.length) {
            // Still counted: the wait gives it back.
            Ok(seq) => self.wait = Some(Wait::Intent { req, seq }),
            Err(e) => {
                self.fence_exit();
                self.intent_failed(req, e);
            }
        }
    }
}
