//! A blocking replica-protocol client for helper threads, never a
//! reactor: the snapshot views' workers (`view`) and the layer copies of
//! a rebuild (`layers`). Every wait is bounded by a deadline; the socket
//! is non-blocking underneath and waits in `poll`, so a TLS link works the
//! same way (`lull_net::link`).
//!
//! ```ignore
//! let hello = Hello { volume_size, generation: 0, flags: 0, session: 0 };
//! let mut c = Client::connect(target.addr, tls, timeout, &hello, target.hello_name())?;
//! let (reply, list) = c.request(Kind::SnapshotList, 0, 0, &[])?;
//! ```

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use lull_net::link::{self as replica_link, LinkStream};
use lull_net::tls::TlsContext;
use lull_proto::replica::{self as proto, Header, Hello, Kind, HEADER_LEN, HELLO_LEN};

/// Why a connection to one replica ended or could not be made.
#[derive(Debug)]
pub(crate) enum LinkFailure {
    /// The replica does not hold the snapshot (HELLO answered `ENOENT`).
    NoSnapshot,
    Other(String),
}

impl std::fmt::Display for LinkFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkFailure::NoSnapshot => write!(f, "it does not hold the snapshot"),
            LinkFailure::Other(why) => write!(f, "{why}"),
        }
    }
}

fn io_failure(what: &str, e: io::Error) -> LinkFailure {
    LinkFailure::Other(format!("{what}: {e}"))
}

/// Connects to the replica at `addr` and says HELLO with `hello` and
/// `name` (a replica's, or a view's `REPLICA@SNAPSHOT`), all within
/// `timeout`. `ENOENT` (no such replica or snapshot) is
/// [`LinkFailure::NoSnapshot`].
pub(crate) fn open(
    addr: SocketAddr,
    tls: Option<&TlsContext>,
    timeout: Duration,
    hello: &Hello,
    name: &str,
) -> Result<LinkStream, LinkFailure> {
    let deadline = Instant::now() + timeout;
    let tcp = TcpStream::connect_timeout(&addr, timeout)
        .and_then(|s| {
            s.set_nodelay(true)?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .map_err(|e| io_failure("connect failed", e))?;
    let mut link = match tls {
        None => LinkStream::Plain(tcp),
        Some(ctx) => {
            let s = replica_link::client_handshake(ctx, tcp, addr.ip(), deadline).map_err(|e| {
                let hint = replica_link::handshake_hint(&e.to_string());
                LinkFailure::Other(format!("replica not authenticated: {e} ({hint})"))
            })?;
            LinkStream::Tls(Box::new(s))
        }
    };
    let payload = proto::encode_hello_request(hello, name);
    let header = Header::request(Kind::Hello, 0, 0, payload.len() as u32);
    let mut frame = encode(&header)?;
    frame.extend_from_slice(&payload);
    write_all(&mut link, &frame, deadline).map_err(|e| io_failure("send HELLO", e))?;
    let reply = read_header(&mut link, deadline)?;
    if reply.kind != Kind::Hello || !reply.reply {
        return Err(LinkFailure::Other(format!("answered HELLO with {reply:?}")));
    }
    let mut theirs = [0u8; HELLO_LEN];
    read_exact(&mut link, &mut theirs, deadline).map_err(|e| io_failure("read HELLO", e))?;
    match reply.status as i32 {
        0 => Ok(link),
        libc::ENOENT => Err(LinkFailure::NoSnapshot),
        errno => Err(LinkFailure::Other(format!(
            "HELLO refused: {}",
            io::Error::from_raw_os_error(errno)
        ))),
    }
}

/// One connection, one request at a time.
pub(crate) struct Client {
    link: LinkStream,
    timeout: Duration,
    next_id: u64,
}

impl Client {
    /// [`open`], as a client.
    pub(crate) fn connect(
        addr: SocketAddr,
        tls: Option<&TlsContext>,
        timeout: Duration,
        hello: &Hello,
        name: &str,
    ) -> Result<Client, LinkFailure> {
        Ok(Client {
            link: open(addr, tls, timeout, hello, name)?,
            timeout,
            next_id: 1,
        })
    }

    /// Sends one request (`payload` after its header: a WRITE's data, a
    /// SNAPSHOT's or CHANGED's request) and waits for its reply: the
    /// reply's header (its status may be an errno) and payload.
    pub(crate) fn request(
        &mut self,
        kind: Kind,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<(Header, Vec<u8>), String> {
        let id = self.next_id;
        self.next_id += 1;
        let deadline = Instant::now() + self.timeout;
        let h = Header::request(kind, id, offset, length);
        let mut frame = encode(&h).map_err(|e| e.to_string())?;
        frame.extend_from_slice(payload);
        write_all(&mut self.link, &frame, deadline).map_err(|e| format!("send {kind:?}: {e}"))?;
        let reply = read_header(&mut self.link, deadline).map_err(|e| e.to_string())?;
        if reply.kind != kind || !reply.reply || reply.id != id {
            return Err(format!("reply {reply:?} to {h:?}"));
        }
        let mut data = vec![0u8; proto::payload_len(&reply)];
        read_exact(&mut self.link, &mut data, deadline)
            .map_err(|e| format!("read the {kind:?} reply: {e}"))?;
        Ok((reply, data))
    }
}

pub(crate) fn encode(h: &Header) -> Result<Vec<u8>, LinkFailure> {
    let mut out = [0u8; HEADER_LEN];
    proto::encode_header(h, &mut out)
        .map_err(|e| LinkFailure::Other(format!("cannot encode {h:?}: {e}")))?;
    Ok(out.to_vec())
}

pub(crate) fn read_header(link: &mut LinkStream, deadline: Instant) -> Result<Header, LinkFailure> {
    let mut raw = [0u8; HEADER_LEN];
    read_exact(link, &mut raw, deadline).map_err(|e| io_failure("read a reply", e))?;
    proto::decode_header(&raw).map_err(|e| LinkFailure::Other(format!("bad reply header: {e}")))
}

/// Waits until the link's socket is ready for `out` (writing) or reading,
/// or `deadline` passes.
fn wait(link: &LinkStream, out: bool, deadline: Instant) -> io::Result<()> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the replica did not answer in time",
        ));
    }
    let Some(tcp) = link.tcp() else {
        return Err(io::ErrorKind::NotConnected.into());
    };
    let flags = if out || link.wants_write() {
        rustix::event::PollFlags::OUT | rustix::event::PollFlags::IN
    } else {
        rustix::event::PollFlags::IN
    };
    let fd = tcp.as_fd();
    let mut fds = [rustix::event::PollFd::new(&fd, flags)];
    let timeout = rustix::event::Timespec::try_from(left).ok();
    match rustix::event::poll(&mut fds, timeout.as_ref()) {
        Ok(_) | Err(rustix::io::Errno::INTR) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

pub(crate) fn write_all(
    link: &mut LinkStream,
    mut buf: &[u8],
    deadline: Instant,
) -> io::Result<()> {
    while !buf.is_empty() {
        match link.write(buf) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(link, true, deadline)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    loop {
        match link.flush() {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(link, true, deadline)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

pub(crate) fn read_exact(
    link: &mut LinkStream,
    buf: &mut [u8],
    deadline: Instant,
) -> io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        match link.read(&mut buf[at..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the replica closed the connection",
                ))
            }
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(link, false, deadline)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
