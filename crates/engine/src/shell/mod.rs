//! The reactor shell around [`Engine`](crate::core::Engine): one lull
//! thread per volume owns the replica sockets (one poller each), a timed
//! tick poller, and the request queues of the volume's channels. It only
//! collects events for the core and performs the actions it returns.
//!
//! ```ignore
//! // `tls`: the client credentials of replica links (`None`: plain links).
//! let dev = ReplicatedDev::start(fw.handle(), 0, "vol0", addrs, size, EngineOptions::default(), tls)?;
//! let mut ch = dev.open_channel()?;           // on an NBD connection thread
//! ch.submit(req)?; ch.flush_submissions();     // one wake-up per batch
//! // ... ch.event_fd() becomes readable ...
//! ch.reap(&mut |c| reply(c));
//! ```
//!
//! # Layout
//!
//! One file per job, each an `impl Shell` of its concern where it needs
//! the shell's state (as the core's files are `impl Engine`); the state
//! itself ([`Shell`](self), its lock, what it publishes) is here, so the
//! jobs import it from their parent and not from each other.
//!
//! - `channel`: the engine's channels, what NBD and NVMe/TCP connections
//!   submit to, and the doorbell that wakes the engine thread for them;
//!   completions back into a channel.
//! - `socket`: a replica socket ([`lull_net::wire::Wire`]) and its frame
//!   parser, read by the servers' receive loop
//!   ([`lull_net::wire::read_and_dispatch`]): headers, payloads received or
//!   spliced where the core says, frames out as events.
//! - `run`: the event loop: the socket, tick and doorbell pollers, feeding
//!   events to the core and performing its actions.
//! - `device`: [`ReplicatedDev`] (start, status, add and remove replicas,
//!   detach, channels) and the set-up of replica links (connect threads,
//!   TLS).
//! - `layers`: the layer sync job, copying a returning replica's missing
//!   snapshot layers on a helper thread.
//!
//! A read flows one way: the client's request comes through its channel as
//! `Event::Client`; when its reply's header arrives, the socket asks the
//! core where the payload goes (`Engine::payload_sink`: the client's
//! buffer, a pipe, or a buffer of the engine's) before reading any of it;
//! the frame goes to the core as `Event::Frame`, a spliced payload's pipe
//! in it (`Received::Spliced`), and comes out in the read's
//! `Action::Complete`, which the channel hands to its connection.

mod channel;
mod device;
mod layers;
mod run;
mod socket;

pub use device::{ReplicatedDev, SessionOutcome, CONTROL_RETRY_WINDOW, GROW_TIMEOUT};

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};

use lull_net::slots::SlotTable;
use lull_net::tls::TlsContext;
use lull_reactor::{PollerId, ThreadHandle};

use crate::core::ids::{ConnData, ReplicaData};
use crate::core::{Action, ConnRef, ControlOutcome, Engine, Event};
use crate::{EngineOptions, ReplicaStatus};
use channel::{ChanEntry, Doorbell};
use socket::{FrameIn, Sock};

/// Tick period: the resolution of timeouts, keep-alives and reconnects.
/// 100 ms is fine against second-scale timeouts and costs ~10 wake-ups/s.
const TICK_US: u64 = 100_000;

/// The engine thread's state: the core and everything around it. Only the
/// engine thread locks it ([`lock`]).
struct Shell {
    volume: String,
    core: Engine,
    opts: EngineOptions,
    /// The credentials replica links authenticate with; `None`: plain.
    tls: Option<TlsContext>,
    me: Option<ThreadHandle>,
    /// The timed poller driving timeouts, keep-alives and reconnects.
    tick: Option<PollerId>,
    /// Channels with submissions, and the poller that drains them.
    doorbell: Arc<Doorbell>,
    this: Weak<Mutex<Shell>>,
    /// Each replica connection's socket, once connected.
    socks: ReplicaData<ConnData<Option<Sock>>>,
    channels: SlotTable<ChanEntry>,
    /// Channels that got completions in this batch (`Shell::complete`).
    to_notify: Vec<u64>,
    /// Sockets written to in this batch, flushed after it.
    dirty: Vec<ConnRef>,
    actions: Vec<Action>,
    /// Events the shell itself raised while performing actions (a socket
    /// that broke on a write, a connect thread that did not start).
    followups: VecDeque<Event>,
    frames: Vec<FrameIn>,
    status: Arc<StatusShared>,
    status_dirty: bool,
    /// The replicas' snapshot lists were asked for once the volume first
    /// had a healthy replica (they fill `StatusShared::snapshots`).
    snapshots_asked: bool,
    /// Every replica was healthy at the last tick: when that becomes true
    /// their snapshot lists are reconciled.
    all_healthy: bool,
    /// Tokens of the shell's own list and reconcile requests
    /// ([`Shell::own_token`]).
    own_tokens: u64,
    /// The layer sync jobs running, by token: the flag that stops one
    /// (`layers`).
    layer_jobs: Vec<(u64, Arc<std::sync::atomic::AtomicBool>)>,
}

/// Tokens with this bit set are snapshot-list requests nobody waits for:
/// their outcome only refreshes the names the volume serves snapshots
/// under (`StatusShared::snapshots`).
const REFRESH_TOKEN_BIT: u64 = 1 << 63;

/// With [`REFRESH_TOKEN_BIT`]: a request of the shell's own, apart from
/// those `ReplicatedDev` numbers (each in-flight list has its own token).
const SHELL_TOKEN_BIT: u64 = 1 << 62;

/// Lock the shell. Only the engine thread locks it; a poisoned lock means
/// a panic there, and the state is still the engine's to judge.
fn lock(m: &Mutex<Shell>) -> MutexGuard<'_, Shell> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the engine thread publishes for the device's callers on other
/// threads (`Shell::publish_status`).
struct StatusShared {
    snapshot: Mutex<Vec<ReplicaStatus>>,
    /// Set (under `snapshot`'s lock) once a clean detach has finished.
    detached: AtomicBool,
    ready: Condvar,
    /// Outcomes of control requests (snapshots), by token, until their
    /// caller takes them.
    control: Mutex<std::collections::HashMap<u64, ControlOutcome>>,
    control_done: Condvar,
    /// Tokens whose caller stopped waiting: their outcome is dropped when
    /// it comes, not kept.
    control_abandoned: Mutex<std::collections::HashSet<u64>>,
    /// The names the volume's snapshots are served under, oldest first:
    /// every snapshot some healthy replica held at the last list (`None`
    /// before the first). Read on reactors (NBD's export list and
    /// `VOLUME@SNAPSHOT`), so never a network round trip there.
    snapshots: Mutex<Option<Vec<String>>>,
    /// The engine's session once final (its first election; 0 before),
    /// and the newer session that fenced a resumed engine (0: none). Set
    /// under `snapshot`'s lock, waited for on `ready`.
    session: AtomicU64,
    fenced_by: AtomicU64,
}

impl StatusShared {
    /// Takes the names from the replicas' lists: each snapshot any of them
    /// holds (a view reads from one that has it), oldest first. Lists that
    /// all failed change nothing.
    fn set_snapshots(&self, lists: &[crate::core::ReplicaSnapshots]) {
        let mut seen: Vec<(u64, String)> = Vec::new();
        let mut any = false;
        for (_, list) in lists {
            let Ok(records) = list else { continue };
            any = true;
            for r in records {
                if !seen.iter().any(|(_, n)| *n == r.name) {
                    seen.push((r.created_unix, r.name.clone()));
                }
            }
        }
        if !any {
            return;
        }
        // Stable: replicas list oldest first, and a second's ties keep it.
        seen.sort_by_key(|(created, _)| *created);
        *self.snapshots.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(seen.into_iter().map(|(_, n)| n).collect());
    }
}
