//! The session half of a replica connection: HELLO (the replica named,
//! the engine's session checked against the owner's), fencing of an older
//! engine, a takeover waiting for the old session's writes, and the TLS
//! handshake before the first frame.

use super::*;

impl Conn {
    /// The session of an engine connection (non-zero), if known.
    pub(super) fn engine_session(&self) -> Option<u64> {
        self.session.filter(|&s| s != 0)
    }

    /// An engine connection whose session no longer owns the replica
    /// closes (after its requests in flight finish).
    pub(super) fn check_fenced(&mut self) {
        let Some(session) = self.engine_session() else {
            return;
        };
        let owner = self.server().fences.owner();
        if owner != session && !self.wire.is_closing() {
            self.close(format!(
                "fenced: engine session {owner:#x} took the replica over from {session:#x}"
            ));
        }
    }

    /// A request counted by `fences.enter` is answered or abandoned.
    pub(super) fn fence_exit(&self) {
        self.server().fences.exit(&self.fence);
    }

    /// The HELLO reply payload: this replica's size, generation, flags
    /// (clean, intent lost) and owner session now.
    /// Before a HELLO named a replica on a store, all zeros: nothing
    /// about any replica goes to a peer that has not said which it wants
    /// (a `lull replica` process has only the one).
    pub(super) fn our_hello(&self, generation: u64) -> Vec<u8> {
        let Some(r) = self.known_replica() else {
            return vec![0; HELLO_LEN];
        };
        proto::encode_hello(&Hello {
            volume_size: r.size_bytes(),
            generation,
            flags: r.hello_flags(),
            session: r.fences.owner(),
        })
        .to_vec()
    }

    /// The replica this connection serves. Only past the first HELLO,
    /// which every frame after it is (`take_frame` refuses anything else
    /// first).
    pub(super) fn server(&self) -> &Arc<Shared> {
        self.replica
            .as_ref()
            .expect("a connection's replica is known from its first HELLO on")
    }

    /// A HELLO reply with `errno` and this replica's HELLO.
    pub(super) fn refuse_hello(&mut self, req: Header, errno: i32) {
        let payload = self.our_hello(self.current_generation());
        self.push_reply(req.reply_with(errno as u32), Payload::Bytes(payload));
    }

    pub(super) fn current_generation(&self) -> u64 {
        self.known_replica()
            .map_or(0, |r| r.generation.load(Ordering::SeqCst))
    }

    /// The replica this connection is for: the one its HELLO named, or
    /// before that the only one a `lull replica` port serves.
    pub(super) fn known_replica(&self) -> Option<&Arc<Shared>> {
        match (&self.replica, &self.port.served) {
            (Some(r), _) => Some(r),
            (None, crate::Served::One(r)) => Some(r),
            (None, crate::Served::Store(_)) => None,
        }
    }

    /// Answer a HELLO of this connection's session once no connection of
    /// another session has a modifying request in flight.
    pub(super) fn check_takeover(&mut self) -> bool {
        let Some(Wait::Takeover { req, hello }) = &self.wait else {
            return false;
        };
        let (req, hello) = (*req, *hello);
        let owner = self.server().fences.owner();
        if owner != hello.session {
            // A newer session took over while this one waited.
            self.wait = None;
            if let Some(me) = &self.me {
                self.server().fences.forget(me);
            }
            self.refuse_hello(req, libc::ESTALE);
            self.close(format!(
                "fenced: engine session {owner:#x} took the replica over from {:#x}",
                hello.session
            ));
            return true;
        }
        if self.wire.is_closing() {
            // The peer is gone or the replica is stopping: nobody to answer.
            self.wait = None;
            if let Some(me) = &self.me {
                self.server().fences.forget(me);
            }
            return true;
        }
        if !self
            .server()
            .fences
            .drained(hello.session, self.me.as_ref())
        {
            return false;
        }
        self.wait = None;
        self.finish_hello(req, hello);
        true
    }

    /// TLS before anything else: check the peer's first byte, then drive
    /// the handshake. `Some(progress)` while it is not established.
    pub(super) fn tls_step(&mut self) -> Option<bool> {
        if self.tls_expected {
            let mut first = [0u8; 1];
            let Some(tcp) = self.wire.stream.tcp() else {
                return Some(false);
            };
            match tcp.peek(&mut first) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Some(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => return Some(false),
                Err(e) => {
                    self.wire.set_broken();
                    self.close(format!("read failed: {e}"));
                    return Some(true);
                }
                Ok(0) => {
                    self.wire.set_broken();
                    self.close("peer disconnected before the TLS handshake");
                    return Some(true);
                }
                Ok(_) if first[0] != TLS_RECORD_HANDSHAKE => {
                    // Plaintext: its first frame gets a refusal the engine
                    // can log (`take_frame`), then the connection closes.
                    self.tls_expected = false;
                    self.refuse_plain = true;
                    return None;
                }
                Ok(_) => {}
            }
            self.tls_expected = false;
            let LinkStream::Plain(tcp) = std::mem::replace(&mut self.wire.stream, LinkStream::Gone)
            else {
                unreachable!("the stream is plain until the first byte is seen")
            };
            let ctx = self
                .port
                .tls
                .as_ref()
                .expect("TLS expected without a context");
            match TlsStream::new(ctx, tcp) {
                Ok(s) => self.wire.stream = LinkStream::Tls(Box::new(s)),
                Err(e) => {
                    self.wire.set_broken();
                    self.close(format!("cannot start TLS: {e}"));
                    return Some(true);
                }
            }
        }
        let LinkStream::Tls(s) = &mut self.wire.stream else {
            return None;
        };
        match s.handshake() {
            Ok(true) => {
                tracing::info!(peer = %self.wire.peer(), "replica link authenticated (TLS)");
                Some(true)
            }
            Ok(false) => Some(false),
            Err(e) => {
                let hint = handshake_hint(&e.to_string());
                self.wire.set_broken();
                self.wire.refuse(format!("not authenticated: {e} ({hint})"));
                Some(true)
            }
        }
    }

    /// A plaintext peer on a replica that requires TLS: answer its first
    /// frame (a HELLO, from an engine with plain links) with an EACCES
    /// refusal whose HELLO payload is all zeros (nothing about the replica
    /// goes to an unauthenticated peer), and close. What it sent is read
    /// first, so the close is a FIN, not a reset that could beat the
    /// refusal to the engine.
    pub(super) fn refuse_plaintext(&mut self, raw: &[u8; HEADER_LEN]) {
        let frame = self
            .wire
            .inb
            .buffered()
            .min(HEADER_LEN + proto::MAX_HELLO_REQUEST_LEN);
        self.wire.inb.consume(frame);
        let mut header = [0u8; HEADER_LEN];
        proto::encode_refusal(proto::raw_id(raw), libc::EACCES as u32, &mut header);
        self.wire
            .out
            .push(&header, Payload::Bytes(vec![0; HELLO_LEN]));
        self.wire.refuse(
            "not authenticated: the peer speaks plain replica protocol, and this \
             replica requires TLS (an engine started with --replica-insecure?)",
        );
    }

    /// A modifying request or DETACH from a session that does not own the
    /// replica: an engine's connection closes (its engine is dead or was
    /// replaced; it must not write); a tool, or DETACH, gets `ESTALE`.
    pub(super) fn fenced_request(&mut self, req: Header, owner: u64) {
        if let Some(session) = self.engine_session().filter(|_| req.kind != Kind::Detach) {
            self.close(format!(
                "fenced: engine session {owner:#x} took the replica over from {session:#x}"
            ));
            return;
        }
        tracing::warn!(peer = %self.wire.peer(), ?req, owner, session = self.session.unwrap_or(0),
            "refused: the replica is owned by another session");
        self.refuse(req, libc::ESTALE);
    }

    /// A HELLO: the first opens the data channel (a view's, when it names
    /// a snapshot) and fixes the session. A non-zero session newer than
    /// the owner takes the replica over (older ones get `ESTALE`); an
    /// engine's HELLO is answered once other sessions have drained, then
    /// as [`Conn::finish_hello`] says.
    pub(super) fn handle_hello(&mut self, req: Header, hello: Hello, name: &str) {
        self.hello_done.store(true, Ordering::Relaxed);
        let (replica_name, snapshot) = proto::split_hello_name(name);
        match &self.replica {
            None => match self.port.find(replica_name) {
                Ok(replica) => {
                    // A view's fence is counted too (it lists the
                    // connection), and never entered: session 0, and
                    // `take_frame` refuses what it would count.
                    replica.fences.adopt(&self.fence);
                    self.replica = Some(replica);
                }
                Err((errno, why)) => {
                    tracing::warn!(peer = %self.wire.peer(), replica = replica_name, "{why}");
                    self.refuse_hello(req, errno);
                    self.close(why);
                    return;
                }
            },
            Some(r) if r.name.as_deref().unwrap_or("") != replica_name => {
                tracing::warn!(peer = %self.wire.peer(), first = ?r.name, now = replica_name, "HELLO names another replica");
                self.close("HELLO names another replica than the connection's first");
                return;
            }
            Some(_) => {}
        }
        let first = matches!(self.phase, Phase::AwaitHello);
        if !first && self.view.as_ref().map(|v| v.snapshot.as_str()) != snapshot {
            tracing::warn!(peer = %self.wire.peer(), first = ?self.view.as_ref().map(|v| &v.snapshot),
                now = ?snapshot, "HELLO names another snapshot view");
            self.close("HELLO names another snapshot view than the connection's first");
            return;
        }
        if let Some(snapshot) = snapshot {
            if hello.session != 0 || hello.flags & HELLO_FLAG_ATTACH != 0 {
                tracing::warn!(peer = %self.wire.peer(), snapshot, session = hello.session, flags = hello.flags,
                    "view HELLO refused: a snapshot view takes session 0 and no attach flag");
                self.refuse_hello(req, libc::EINVAL);
                self.close("a snapshot view HELLO with a session or the attach flag");
                return;
            }
            if first {
                let Some(dev) = self.server().chain.snapshot_view(snapshot) else {
                    tracing::warn!(peer = %self.wire.peer(), replica = replica_name, snapshot,
                        "view HELLO refused: no such snapshot");
                    self.refuse_hello(req, libc::ENOENT);
                    self.close(format!("no snapshot {snapshot:?} to view"));
                    return;
                };
                tracing::info!(peer = %self.wire.peer(), replica = replica_name, snapshot, "snapshot view opened");
                self.view = Some(View {
                    snapshot: snapshot.to_string(),
                    dev,
                });
            }
        }
        if hello.volume_size != self.server().size_bytes() {
            tracing::warn!(peer = %self.wire.peer(), theirs = hello.volume_size, ours = self.server().size_bytes(),
                "HELLO with another volume size");
            self.refuse_hello(req, libc::EINVAL);
            self.close("volume size mismatch");
            return;
        }
        match self.session {
            Some(s) if s != hello.session => {
                tracing::warn!(peer = %self.wire.peer(), first = s, now = hello.session, "HELLO with another session");
                self.close("HELLO with another session on the same connection");
                return;
            }
            Some(_) => {}
            None => {
                self.session = Some(hello.session);
                self.fence.set_session(hello.session);
            }
        }
        if hello.session != 0 {
            match self.server().fences.claim(hello.session) {
                Claim::Stale { owner } => {
                    tracing::info!(peer = %self.wire.peer(), session = hello.session, owner,
                        "HELLO of an older engine session refused");
                    self.refuse_hello(req, libc::ESTALE);
                    self.close(format!(
                        "stale engine session {:#x} (owner {owner:#x})",
                        hello.session
                    ));
                    return;
                }
                Claim::Owner { previous } if previous != hello.session => {
                    tracing::info!(peer = %self.wire.peer(), old = previous, new = hello.session,
                        "engine session took the replica over");
                    self.server().fences.wake_others(hello.session);
                }
                Claim::Owner { .. } => {}
            }
        }
        if matches!(self.phase, Phase::AwaitHello) {
            let Some(channel) = self.open_channel() else {
                self.refuse_hello(req, libc::EIO);
                self.close("cannot open a data file channel");
                return;
            };
            self.phase = Phase::Ready { channel };
        }
        if hello.session != 0 {
            // Checked in the next round; usually nothing is in flight.
            self.wait = Some(Wait::Takeover { req, hello });
        } else {
            self.finish_hello(req, hello);
        }
    }

    /// A HELLO past the takeover: one with the attach flag is answered once
    /// its generation is durable (attaching is for the owner, and counts
    /// as a modifying request); a plain one at once. The engine probes with
    /// a plain HELLO and attaches later on any of its connections.
    pub(super) fn finish_hello(&mut self, req: Header, hello: Hello) {
        if hello.flags & HELLO_FLAG_ATTACH == 0 {
            let payload = self.our_hello(self.current_generation());
            self.push_reply(req.reply_with(0), Payload::Bytes(payload));
            return;
        }
        if let Err(owner) = self.server().fences.enter(&self.fence) {
            tracing::warn!(peer = %self.wire.peer(), session = hello.session, owner,
                "attach refused: the replica is owned by another session");
            self.refuse_hello(req, libc::ESTALE);
            return;
        }
        // Persisting the attach is two fsyncs: a helper thread does it.
        self.start_meta_wait(MetaFor::Attach(req), MetaJob::Attach(hello.generation));
    }
}
