//! A connected client socket: TCP or Unix, non-blocking, plain or (after
//! `NBD_OPT_STARTTLS`) inside a TLS session. The variant is matched once
//! per read or write call; a plain connection pays nothing else.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;

use lull_net::tls::TlsStream;

#[derive(Debug)]
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// The plain stream inside a TLS session (TCP or Unix).
    Tls(Box<TlsStream<Stream>>),
    /// Only while the plain stream moves into its TLS session.
    Gone,
}

fn gone() -> io::Error {
    io::ErrorKind::NotConnected.into()
}

impl Stream {
    pub(crate) fn prepare(&self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_nonblocking(true)?;
                // Replies are small and latency-bound: never wait for Nagle.
                s.set_nodelay(true)
            }
            Stream::Unix(s) => s.set_nonblocking(true),
            Stream::Tls(s) => s.get_ref().prepare(),
            Stream::Gone => Err(gone()),
        }
    }

    pub(crate) fn peer(&self) -> String {
        match self {
            Stream::Tcp(s) => s
                .peer_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "tcp:?".into()),
            Stream::Unix(_) => "unix".into(),
            Stream::Tls(s) => s.get_ref().peer(),
            Stream::Gone => "gone".into(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
            Stream::Tls(s) => s.read(buf),
            Stream::Gone => Err(gone()),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
            Stream::Tls(s) => s.write(buf),
            Stream::Gone => Err(gone()),
        }
    }
    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write_vectored(bufs),
            Stream::Unix(s) => s.write_vectored(bufs),
            // One TLS record per call: the first non-empty slice.
            Stream::Tls(s) => s.write_vectored(bufs),
            Stream::Gone => Err(gone()),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for Stream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Unix(s) => s.as_raw_fd(),
            Stream::Tls(s) => s.get_ref().as_raw_fd(),
            Stream::Gone => -1,
        }
    }
}
