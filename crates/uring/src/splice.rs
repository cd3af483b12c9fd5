//! Moving payload bytes between descriptors without copying them through
//! user space: `sendfile(2)` from a file to a socket, and pipes that
//! `splice(2)` a socket's received pages in and out again (docs/PER_IO.md,
//! "Spliced reads").
//!
//! Over TCP the kernel hands page references along instead of copying:
//! `sendfile` from the page cache attaches the file's pages to the socket
//! buffers, `splice` from a TCP socket into a pipe takes references to the
//! pages the data arrived in, and `splice` from the pipe into another
//! socket attaches them to that socket's buffers. The one copy left is the
//! final receiver's `recv`.
//!
//! The pages are shared, not snapshotted: bytes a `sendfile` sent are read
//! from the page cache when the receiver copies them, so a write to the
//! same range of the file before that is visible in them. Callers use it
//! only where no write to the range can be outstanding (docs/PER_IO.md).
//!
//! Sockets are named by raw descriptor (`RawFd`): the callers are
//! connections that keep their socket's number beside the stream that owns
//! it, for as long as the stream lives. A descriptor that is not open
//! fails the call with `EBADF`; nothing here touches memory through it.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// Pipe capacity a [`Pipe`] asks for (`F_SETPIPE_SZ`): 64 slots of one
/// page, so a payload of up to [`PIPE_PAYLOAD_BYTES_MAX`] fits even when
/// some of its pages arrive split in two (each piece of a socket buffer
/// takes a slot). Within the kernel's default `pipe-max-size` (1 MiB).
pub const PIPE_BYTES: usize = 256 * 1024;

/// The largest payload a [`Pipe`] is asked to hold: half its slots' worth
/// of pages, see [`PIPE_BYTES`].
pub const PIPE_PAYLOAD_BYTES_MAX: usize = PIPE_BYTES / 2;

/// Runs a system call returning a byte count (or -1 and errno) until it
/// is not interrupted by a signal.
fn retrying(mut call: impl FnMut() -> libc::ssize_t) -> io::Result<usize> {
    loop {
        let rc = call();
        if rc >= 0 {
            return Ok(rc as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// `sendfile(2)`: up to `len` bytes of `file` from `offset` into the
/// socket `sock`, non-blocking if the socket is. Returns the bytes sent
/// (0 at the file's end). `WouldBlock` when the socket is full.
pub fn sendfile(sock: RawFd, file: BorrowedFd<'_>, offset: u64, len: usize) -> io::Result<usize> {
    let Ok(mut off) = libc::off_t::try_from(offset) else {
        return Err(io::Error::from_raw_os_error(libc::EFBIG));
    };
    // The file is open for its borrow; a closed socket fails with EBADF.
    retrying(|| {
        // SAFETY: `off` is a valid in/out pointer for the call.
        unsafe { libc::sendfile(sock, file.as_raw_fd(), &mut off, len) }
    })
}

/// `sendmsg(2)` of `bufs` with `MSG_MORE`: the bytes wait in the socket
/// for what follows at once (a spliced payload after its header), so both
/// leave in one segment instead of the header alone in its own. Returns
/// the bytes taken; `WouldBlock` when the socket is full.
pub fn send_more(sock: RawFd, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
    // SAFETY: `msghdr` is plain old data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // IoSlice is ABI-compatible with iovec (std documents it so); the
    // kernel only reads through the pointer.
    msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = bufs.len();
    // No control data, no address; a closed socket fails with EBADF.
    retrying(|| {
        // SAFETY: `msg` points at `bufs`, valid for the call.
        unsafe { libc::sendmsg(sock, &msg, libc::MSG_MORE | libc::MSG_NOSIGNAL) }
    })
}

/// Bytes a socket (or pipe) holds that a read would return now
/// (`FIONREAD`).
pub fn readable_bytes(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer, which is valid
    // for the call (a closed descriptor fails with EBADF).
    let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// A non-blocking pipe that holds payload bytes as page references: filled
/// from one socket ([`Pipe::fill_from`]), emptied into another
/// ([`Pipe::drain_to`]) or into memory ([`Pipe::read_into`]). Knows how
/// many bytes it holds.
#[derive(Debug)]
pub struct Pipe {
    /// The read end, as a `File` for plain reads ([`Pipe::read_into`]).
    read: File,
    write: OwnedFd,
    held: usize,
}

impl Pipe {
    /// A pipe of [`PIPE_BYTES`]. Fails where the kernel refuses the size
    /// (an unprivileged user past `pipe-user-pages-soft`, or a
    /// `pipe-max-size` below it).
    pub fn new() -> io::Result<Pipe> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid out-pointer for two ints.
        let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded: both are new descriptors nobody else owns.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let read = File::from(read);
        // SAFETY: F_SETPIPE_SZ takes an int argument, no pointer.
        let rc = unsafe {
            libc::fcntl(
                write.as_raw_fd(),
                libc::F_SETPIPE_SZ,
                PIPE_BYTES as libc::c_int,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        if (rc as usize) < PIPE_BYTES {
            return Err(io::Error::other(format!(
                "pipe capacity {rc} bytes, {PIPE_BYTES} asked for"
            )));
        }
        Ok(Pipe {
            read,
            write,
            held: 0,
        })
    }

    /// Bytes in the pipe.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Splice up to `max` bytes from the socket `from` into the pipe.
    /// Returns the bytes moved; `Ok(0)` is the end of `from`'s stream.
    /// `WouldBlock` when `from` has nothing now or the pipe is full (tell
    /// them apart with [`readable_bytes`] on `from`).
    pub fn fill_from(&mut self, from: RawFd, max: usize) -> io::Result<usize> {
        let n = splice(from, self.write.as_raw_fd(), max, 0)?;
        self.held += n;
        Ok(n)
    }

    /// Splice up to `max` of the pipe's bytes into the socket `to`
    /// (`more`: more bytes follow at once, as `MSG_MORE`). Returns the
    /// bytes moved; `WouldBlock` when the socket is full.
    pub fn drain_to(&mut self, to: RawFd, max: usize, more: bool) -> io::Result<usize> {
        let max = max.min(self.held);
        if max == 0 {
            return Ok(0);
        }
        let flags = if more { libc::SPLICE_F_MORE } else { 0 };
        let n = splice(self.read.as_raw_fd(), to, max, flags)?;
        self.held -= n;
        Ok(n)
    }

    /// Copy the pipe's bytes into `dst` (at most its length), emptying the
    /// pipe by as much. Returns the bytes read.
    pub fn read_into(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let want = dst.len().min(self.held);
        let mut got = 0;
        while got < want {
            match self.read.read(&mut dst[got..want]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.held -= got;
                    return Err(e);
                }
            }
        }
        self.held -= got;
        Ok(got)
    }
}

fn splice(from: RawFd, to: RawFd, max: usize, flags: libc::c_uint) -> io::Result<usize> {
    // Both ends are pipes or sockets, which take no offsets (null
    // pointers); a closed descriptor fails with EBADF.
    let flags = flags | libc::SPLICE_F_NONBLOCK | libc::SPLICE_F_MOVE;
    retrying(|| {
        // SAFETY: no pointers but the null offsets splice allows.
        unsafe {
            libc::splice(
                from,
                std::ptr::null_mut(),
                to,
                std::ptr::null_mut(),
                max,
                flags,
            )
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsFd;

    fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// File → socket (sendfile) → pipe (splice) → socket (splice) → recv:
    /// the bytes arrive whole and in order, and the pipe counts them.
    #[test]
    fn sendfile_and_pipes_carry_bytes_between_sockets() {
        let dir = std::env::temp_dir().join(format!("lull-splice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("data");
        let data: Vec<u8> = (0..PIPE_PAYLOAD_BYTES_MAX + 4096)
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        std::fs::write(&path, &data).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let (src, mid_in) = tcp_pair();
        let (mid_out, mut dst) = tcp_pair();
        mid_in.set_nonblocking(true).unwrap();
        mid_out.set_nonblocking(true).unwrap();
        let (at, len) = (4096u64, PIPE_PAYLOAD_BYTES_MAX);
        let mut sent = 0;
        while sent < len {
            sent += sendfile(src.as_raw_fd(), file.as_fd(), at + sent as u64, len - sent).unwrap();
        }
        let mut pipe = Pipe::new().unwrap();
        while pipe.held() < len {
            match pipe.fill_from(mid_in.as_raw_fd(), len - pipe.held()) {
                Ok(n) => assert!(n > 0, "end of stream"),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(pipe.held(), len);
        let reader = std::thread::spawn(move || {
            let mut got = vec![0u8; len];
            dst.read_exact(&mut got).unwrap();
            got
        });
        while pipe.held() > 0 {
            match pipe.drain_to(mid_out.as_raw_fd(), usize::MAX, false) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(
            reader.join().unwrap(),
            &data[at as usize..at as usize + len]
        );
        drop(src);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// `read_into` empties the pipe into memory; `readable_bytes` tells a
    /// socket with data from an empty one.
    #[test]
    fn a_pipe_drains_into_memory() {
        let (mut a, b) = tcp_pair();
        b.set_nonblocking(true).unwrap();
        assert_eq!(readable_bytes(b.as_raw_fd()).unwrap(), 0);
        a.write_all(b"hello pipe").unwrap();
        while readable_bytes(b.as_raw_fd()).unwrap() < 10 {
            std::thread::yield_now();
        }
        let mut pipe = Pipe::new().unwrap();
        assert_eq!(pipe.fill_from(b.as_raw_fd(), 64).unwrap(), 10);
        let err = pipe.fill_from(b.as_raw_fd(), 64).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        let mut out = [0u8; 4];
        assert_eq!(pipe.read_into(&mut out).unwrap(), 4);
        assert_eq!(&out, b"hell");
        let mut rest = [0u8; 32];
        assert_eq!(pipe.read_into(&mut rest).unwrap(), 6);
        assert_eq!(&rest[..6], b"o pipe");
        assert_eq!(pipe.held(), 0);
        drop(a);
        assert_eq!(
            pipe.fill_from(b.as_raw_fd(), 64).unwrap(),
            0,
            "end of stream"
        );
    }
}
