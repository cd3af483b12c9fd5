//! The queue of a channel that runs its requests itself, synchronously
//! (the malloc channel, the inline file channel): `submit` queues, `reap`
//! runs what was queued in submission order and hands the completions
//! out. Completions were only ever delivered by `reap`, so the owner sees
//! what it sees of an io_uring channel, minus the event fd; and work done
//! at `reap` sees the whole batch (the malloc channel touches every read's
//! source before copying any).

use std::collections::VecDeque;

use crate::{BdevError, Data, IoCompletion, IoRequest};

/// Submitted requests and their completions, at most `depth` together.
#[derive(Debug)]
pub(crate) struct Deferred {
    pending: VecDeque<IoRequest>,
    done: VecDeque<IoCompletion>,
    depth: usize,
    /// What the channel is, for the debug line of a failed request.
    what: &'static str,
}

impl Deferred {
    /// `preallocate`: reserve room for `depth` of each now (a channel that
    /// must not allocate on its first burst); otherwise the queues grow to
    /// the owner's depth on first use and stay (an idle connection's
    /// channel stays small).
    pub(crate) fn new(depth: usize, preallocate: bool, what: &'static str) -> Deferred {
        let room = if preallocate { depth } else { 0 };
        Deferred {
            pending: VecDeque::with_capacity(room),
            done: VecDeque::with_capacity(depth),
            depth,
            what,
        }
    }

    /// Queues `req`; a full queue hands it back with `BdevError::Full`.
    pub(crate) fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        if self.in_flight() >= self.depth {
            let capacity = self.depth;
            return Err((req, BdevError::Full { capacity }));
        }
        self.pending.push_back(req);
        Ok(())
    }

    /// The requests not run yet, in order.
    pub(crate) fn pending(&self) -> impl Iterator<Item = &IoRequest> {
        self.pending.iter()
    }

    /// Runs every pending request with `execute`, in order, then delivers
    /// every completion to `done`; returns how many. `execute` says where
    /// a read's data is: in the request's buffer ([`Data::Buf`]), or a loan
    /// of the device's memory or a file range handed over instead.
    pub(crate) fn reap(
        &mut self,
        mut execute: impl FnMut(&mut IoRequest) -> Result<Data, BdevError>,
        done: &mut dyn FnMut(IoCompletion),
    ) -> usize {
        while let Some(mut req) = self.pending.pop_front() {
            let (result, data) = match execute(&mut req) {
                Ok(data) => (Ok(()), data),
                Err(e) => {
                    tracing::debug!(channel = self.what, tag = req.tag, error = %e, "request failed");
                    (Err(e), Data::Buf)
                }
            };
            self.done.push_back(IoCompletion {
                tag: req.tag,
                result,
                buf: req.buf,
                data,
            });
        }
        let n = self.done.len();
        while let Some(c) = self.done.pop_front() {
            done(c);
        }
        n
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.pending.len() + self.done.len()
    }
}
