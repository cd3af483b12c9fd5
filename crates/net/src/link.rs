//! Replica links (engine ↔ replica): how they are secured, and the stream
//! that carries them. A link is a TLS session that starts right after the
//! TCP connect, before any replica-protocol frame (no STARTTLS): the
//! engine is the TLS client, the replica the server, and both prove who
//! they are (the same pre-shared key, or certificates signed by one CA on
//! both ends). Plain TCP only when the operator asked for it
//! (`--insecure`), with a warning at start.
//!
//! ```
//! use lull_net::link::LinkAuth;
//! let auth = LinkAuth::from_flags(None, None, true, LinkAuth::REPLICA_FLAGS).unwrap();
//! assert_eq!(auth, Some(LinkAuth::Insecure));
//! let err = LinkAuth::from_flags(Some("k.psk".into()), None, true, LinkAuth::REPLICA_FLAGS);
//! assert!(err.unwrap_err().contains("only one"));
//! ```

use std::io::{self, IoSlice, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::path::PathBuf;
use std::time::Instant;

use crate::tls::{Creds, Role, TlsContext, TlsError, TlsStream};

/// The first byte of a TLS connection (a handshake record, RFC 8446
/// §5.1). A replica-protocol frame starts with `MAGIC` ('L'), so one byte
/// tells a plain peer from a TLS one for the log line.
pub const TLS_RECORD_HANDSHAKE: u8 = 0x16;

/// The warning both ends log at start when links are plain.
pub const INSECURE_WARNING: &str = "replica links are not authenticated (--insecure): anyone who reaches a replica port can read and overwrite the replica or pose as the engine, and anyone who can answer on a replica address can pose as a replica";

/// How replica links are secured, as the operator chose it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkAuth {
    /// Plain TCP (`--insecure`).
    Insecure,
    /// TLS with a PSK file or an X.509 directory.
    Tls(Creds),
}

impl LinkAuth {
    /// `lull replica`'s flags, for messages.
    pub const REPLICA_FLAGS: [&'static str; 3] =
        ["--tls-psk FILE", "--tls-certs DIR", "--insecure"];
    /// `lull serve`'s flags (and config keys), for messages.
    pub const SERVE_FLAGS: [&'static str; 3] = [
        "--replica-tls-psk FILE (replica_tls_psk)",
        "--replica-tls-certs DIR (replica_tls_certs)",
        "--replica-insecure (replica_insecure = true)",
    ];

    /// At most one of the three choices; `Ok(None)` when none is given
    /// (the caller decides whether that is an error). `names` name the
    /// three flags in that order, for the message.
    pub fn from_flags(
        psk: Option<PathBuf>,
        certs: Option<PathBuf>,
        insecure: bool,
        names: [&str; 3],
    ) -> Result<Option<LinkAuth>, String> {
        match (psk, certs, insecure) {
            (None, None, false) => Ok(None),
            (Some(f), None, false) => Ok(Some(LinkAuth::Tls(Creds::Psk(f)))),
            (None, Some(d), false) => Ok(Some(LinkAuth::Tls(Creds::X509(d)))),
            (None, None, true) => Ok(Some(LinkAuth::Insecure)),
            _ => Err(format!(
                "replica links: give only one of {}, {} or {}",
                names[0], names[1], names[2]
            )),
        }
    }

    /// The message for "none given".
    pub fn missing(names: [&str; 3]) -> String {
        format!(
            "replica links need {}, {} or {} (plain links only when asked for)",
            names[0], names[1], names[2]
        )
    }

    /// The TLS context for `role`, or `None` for plain links. A replica
    /// with certificates must verify the engine's: the directory needs
    /// `ca-cert.pem` (an engine always verifies the replica's).
    pub fn context(&self, role: Role) -> Result<Option<TlsContext>, TlsError> {
        let LinkAuth::Tls(creds) = self else {
            return Ok(None);
        };
        let ctx = TlsContext::new(creds, role)?;
        if !ctx.verifies_peer() {
            let Creds::X509(dir) = creds else {
                unreachable!("a PSK always verifies the peer")
            };
            return Err(TlsError::Creds {
                path: dir.join("ca-cert.pem"),
                reason: "replica links are mutual: the CA that signed the engine's certificate is needed".into(),
            });
        }
        Ok(Some(ctx))
    }
}

/// A hint for an operator reading a failed handshake's OpenSSL reason.
pub fn handshake_hint(reason: &str) -> &'static str {
    let r = reason.to_ascii_lowercase();
    if r.contains("decrypt") || r.contains("bad record mac") || r.contains("psk") {
        "the two ends do not share the same pre-shared key"
    } else if r.contains("certificate") || r.contains("verify") {
        "the peer's certificate is not trusted (or it sent none)"
    } else if r.contains("wrong version number")
        || r.contains("packet length")
        || r.contains("record layer failure")
        || r.contains("http request")
        || r.contains("unexpected eof")
        || r.contains("closed the connection")
    {
        "the peer does not speak TLS or refused this end's credentials"
    } else if r.contains("no shared cipher") || r.contains("handshake failure") {
        "the two ends use different kinds of credentials (PSK against certificates?)"
    } else {
        "check both ends' replica TLS settings"
    }
}

/// Run the client side of a handshake on a connected socket, blocking
/// (for a connect helper thread, never a reactor) until `deadline`, then
/// leave the socket non-blocking. `ip` is the replica's address, checked
/// against its certificate. The caller's deadline bounds it (the engine
/// gives connect and handshake together its connect timeout), so a peer
/// that accepts the connection and says nothing cannot hold the thread.
pub fn client_handshake(
    ctx: &TlsContext,
    tcp: TcpStream,
    ip: IpAddr,
    deadline: Instant,
) -> Result<TlsStream<TcpStream>, TlsError> {
    let setup = |e: io::Error| TlsError::Handshake(format!("socket setup: {e}"));
    // Non-blocking, waiting in `poll` between rounds: a blocking socket
    // with a timeout fails a read cut short by a signal with EINTR even
    // under SA_RESTART (signal(7)), which OpenSSL cannot resume (a process
    // with children takes SIGCHLD: `lull csi` under its nbdfuse).
    tcp.set_nonblocking(true).map_err(setup)?;
    let mut tls = TlsStream::client_for_ip(ctx, tcp, ip)?;
    while !tls.handshake()? {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TlsError::Handshake(
                "timed out (the peer accepted the connection and did not answer)".into(),
            ));
        }
        let flags = if tls.wants_write() {
            rustix::event::PollFlags::OUT
        } else {
            rustix::event::PollFlags::IN
        };
        let mut fds = [rustix::event::PollFd::new(tls.get_ref(), flags)];
        let timeout = rustix::event::Timespec::try_from(left).ok();
        match rustix::event::poll(&mut fds, timeout.as_ref()) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(setup(e.into())),
        }
    }
    Ok(tls)
}

/// A replica link's stream: plain TCP, or TCP inside a TLS session. The
/// variant is matched once per read or write call; a plain link pays
/// nothing else.
#[derive(Debug)]
pub enum LinkStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
    /// Only while the plain stream moves into its TLS session.
    Gone,
}

fn gone() -> io::Error {
    io::ErrorKind::NotConnected.into()
}

impl LinkStream {
    pub fn tcp(&self) -> Option<&TcpStream> {
        match self {
            LinkStream::Plain(s) => Some(s),
            LinkStream::Tls(s) => Some(s.get_ref()),
            LinkStream::Gone => None,
        }
    }

    /// The TLS session must write before it can go on (see
    /// [`TlsStream::wants_write`]); never for a plain link.
    pub fn wants_write(&self) -> bool {
        matches!(self, LinkStream::Tls(s) if s.wants_write())
    }

    /// Decrypted bytes no socket event will announce (see
    /// [`TlsStream::pending`]).
    pub fn pending(&self) -> usize {
        match self {
            LinkStream::Plain(_) | LinkStream::Gone => 0,
            LinkStream::Tls(s) => s.pending(),
        }
    }

    /// Whether the TLS handshake still has to finish.
    pub fn handshaking(&self) -> bool {
        matches!(self, LinkStream::Tls(s) if !s.is_established())
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, LinkStream::Tls(_))
    }
}

impl Read for LinkStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            LinkStream::Plain(s) => s.read(buf),
            LinkStream::Tls(s) => s.read(buf),
            LinkStream::Gone => Err(gone()),
        }
    }
}

impl Write for LinkStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            LinkStream::Plain(s) => s.write(buf),
            LinkStream::Tls(s) => s.write(buf),
            LinkStream::Gone => Err(gone()),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            LinkStream::Plain(s) => s.write_vectored(bufs),
            // One TLS record per call: the first non-empty slice.
            LinkStream::Tls(s) => s.write_vectored(bufs),
            LinkStream::Gone => Err(gone()),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_one_choice() {
        let n = LinkAuth::REPLICA_FLAGS;
        assert_eq!(LinkAuth::from_flags(None, None, false, n), Ok(None));
        assert_eq!(
            LinkAuth::from_flags(Some("k".into()), None, false, n),
            Ok(Some(LinkAuth::Tls(Creds::Psk("k".into()))))
        );
        assert_eq!(
            LinkAuth::from_flags(None, Some("d".into()), false, n),
            Ok(Some(LinkAuth::Tls(Creds::X509("d".into()))))
        );
        for (p, c, i) in [
            (Some("k"), Some("d"), false),
            (Some("k"), None, true),
            (None, Some("d"), true),
            (Some("k"), Some("d"), true),
        ] {
            let e = LinkAuth::from_flags(p.map(Into::into), c.map(Into::into), i, n).unwrap_err();
            assert!(
                e.contains("--tls-psk FILE") && e.contains("--insecure"),
                "{e}"
            );
        }
        let m = LinkAuth::missing(n);
        assert!(m.contains("--tls-psk") && m.contains("--tls-certs") && m.contains("--insecure"));
    }

    #[test]
    fn plain_links_have_no_context_and_hints_name_the_cause() {
        assert!(LinkAuth::Insecure.context(Role::Server).unwrap().is_none());
        assert!(
            handshake_hint("error:0A000119:SSL routines::decryption failed or bad record mac")
                .contains("pre-shared key")
        );
        assert!(handshake_hint("certificate verify failed").contains("not trusted"));
        assert!(handshake_hint("wrong version number").contains("does not speak TLS"));
    }
}
