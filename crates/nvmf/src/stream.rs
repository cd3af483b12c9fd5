//! A queue pair's byte stream: the plain socket, or (when the host's
//! first byte opened a TLS record) a TLS 1.3 session over it. The variant
//! is matched once per read or write call; a plain queue pair pays
//! nothing else.
//!
//! The bytes that told TLS from NVMe/TCP were already read into the
//! connection's input buffer: they go back in front of the socket
//! ([`Rewound`]) so that OpenSSL reads the ClientHello whole.

use std::io::{self, IoSlice, Read, Write};

use lull_net::tls::{ExternalPskContext, TlsError, TlsStream};

/// The first byte of a TLS handshake record (RFC 8446 §5.1,
/// ContentType handshake). An NVMe/TCP host's first PDU is an ICReq,
/// PDU type 0x00: one byte tells them apart, as the Linux target does.
pub const TLS_RECORD_HANDSHAKE: u8 = 0x16;

/// A stream with bytes already read from it put back in front, and a
/// hook run after each read that got bytes from the stream itself.
pub struct Rewound<S> {
    head: Vec<u8>,
    pos: usize,
    inner: S,
    after_read: Option<fn(&S)>,
}

impl<S> std::fmt::Debug for Rewound<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Rewound({} bytes ahead)", self.head.len() - self.pos)
    }
}

impl<S> Rewound<S> {
    pub fn new(head: Vec<u8>, inner: S, after_read: Option<fn(&S)>) -> Rewound<S> {
        Rewound {
            head,
            pos: 0,
            inner,
            after_read,
        }
    }
}

/// Acknowledge at once what was just read (TCP_QUICKACK, which the
/// kernel clears again by itself, so it is set after every read). SPDK's
/// TLS initiator writes a PDU as several records (one `SSL_write` per
/// piece) on a socket with Nagle's algorithm on: the second record waits
/// for the ACK of the first, and the target, which answers only once the
/// whole PDU is in, would delay that ACK by up to 40 ms. A 128 KiB write
/// over TLS waited about 40 ms per H2CData PDU without it.
pub(crate) fn quickack(s: &std::net::TcpStream) {
    use std::os::linux::net::TcpStreamExt;
    let _ = s.set_quickack(true);
}

impl<S: Read> Read for Rewound<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.pos < self.head.len() {
            let n = buf.len().min(self.head.len() - self.pos);
            buf[..n].copy_from_slice(&self.head[self.pos..self.pos + n]);
            self.pos += n;
            if self.pos == self.head.len() {
                self.head = Vec::new();
                self.pos = 0;
            }
            return Ok(n);
        }
        let n = self.inner.read(buf)?;
        if let (Some(hook), true) = (self.after_read, n > 0) {
            hook(&self.inner);
        }
        Ok(n)
    }
}

impl<S: Write> Write for Rewound<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.inner.write_vectored(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[derive(Debug)]
pub(crate) enum Stream<S> {
    Plain(S),
    Tls(Box<TlsStream<Rewound<S>>>),
    /// Only while the plain stream moves into its TLS session.
    Gone,
}

fn gone() -> io::Error {
    io::ErrorKind::NotConnected.into()
}

impl<S: Read + Write> Stream<S> {
    /// Move the plain stream into a server TLS session, with `head` (the
    /// bytes read so far) in front of it.
    pub(crate) fn start_tls(
        &mut self,
        ctx: &ExternalPskContext,
        head: Vec<u8>,
        after_read: Option<fn(&S)>,
    ) -> Result<(), TlsError> {
        let Stream::Plain(plain) = std::mem::replace(self, Stream::Gone) else {
            return Err(TlsError::Handshake("TLS started twice".into()));
        };
        let s = TlsStream::external_psk(ctx, Rewound::new(head, plain, after_read))?;
        *self = Stream::Tls(Box::new(s));
        Ok(())
    }

    pub(crate) fn tls(&self) -> Option<&TlsStream<Rewound<S>>> {
        match self {
            Stream::Tls(s) => Some(s),
            _ => None,
        }
    }

    pub(crate) fn tls_mut(&mut self) -> Option<&mut TlsStream<Rewound<S>>> {
        match self {
            Stream::Tls(s) => Some(s),
            _ => None,
        }
    }

    /// The plain stream (tests look into it).
    #[cfg(test)]
    pub(crate) fn plain(&self) -> &S {
        match self {
            Stream::Plain(s) => s,
            _ => panic!("not a plain stream"),
        }
    }

    #[cfg(test)]
    pub(crate) fn plain_mut(&mut self) -> &mut S {
        match self {
            Stream::Plain(s) => s,
            _ => panic!("not a plain stream"),
        }
    }
}

impl<S: Read + Write> Read for Stream<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
            Stream::Gone => Err(gone()),
        }
    }
}

impl<S: Read + Write> Write for Stream<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
            Stream::Gone => Err(gone()),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Plain(s) => s.write_vectored(bufs),
            // A reply's header, data and completion in one record.
            Stream::Tls(s) => s.write_coalesced(bufs),
            Stream::Gone => Err(gone()),
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
    fn rewound_reads_the_head_first() {
        let mut r = Rewound::new(b"ab".to_vec(), std::io::Cursor::new(b"cd".to_vec()), None);
        let mut out = [0u8; 1];
        assert_eq!(r.read(&mut out).unwrap(), 1);
        assert_eq!(&out, b"a");
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).unwrap();
        assert_eq!(rest, b"bcd");
    }
}
