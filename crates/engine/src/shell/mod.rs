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
//! One file per job, each an `impl Shell` of its concern where it needs
//! the shell's state (as the core's files are `impl Engine`):
//!
//! - `channel`: the engine's channels, what NBD and NVMe/TCP connections
//!   submit to, and the doorbell that wakes the engine thread for them;
//!   completions back into a channel.
//! - `socket`: a replica socket ([`lull_net::wire::Wire`]) and its frame
//!   parser, read by the servers' receive loop
//!   ([`lull_net::wire::read_and_dispatch`]): headers, payloads received or
//!   spliced where the core says, frames out as events.
//! - `run`: the event loop: the shell's state, the socket, tick and
//!   doorbell pollers, feeding events to the core and performing its
//!   actions.
//! - `device`: [`ReplicatedDev`] (start, status, add and remove replicas,
//!   detach, channels) and the set-up of replica links (connect threads,
//!   TLS).
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
