//! The server scaffolding on a real framework and real TCP sockets, with a
//! line protocol small enough to read at a glance: the client greets with
//! `hello\n`, the server answers `ok\n`, then echoes. Checks the limits the
//! NBD and replica servers rely on: the connection limit, the greeting
//! deadline, and stop + drain.
//!
//! ```text
//! cargo test -p lull-net --test server
//! ```

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use lull_net::server::{Acceptor, Connection, Connections, Limits};
use lull_reactor::{Framework, FrameworkConfig, Interest, Mode, PollStatus, Thread};

/// How long a client waits for any one answer.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

struct Echo {
    stream: TcpStream,
    conns: Arc<Connections>,
    greeted: Arc<AtomicBool>,
    input: Vec<u8>,
}

impl Echo {
    fn close(&mut self, t: &mut Thread, last_words: &[u8]) -> PollStatus {
        let _ = self.stream.write_all(last_words);
        if let Some(me) = t.current_poller() {
            t.unregister_poller(me);
        }
        PollStatus::Busy
    }
}

impl Connection for Echo {
    fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }
    fn interest(&self) -> Interest {
        Interest::READABLE
    }
    fn greeted(&self) -> Arc<AtomicBool> {
        self.greeted.clone()
    }
    fn poll(&mut self, t: &mut Thread, _now: u64, greeting_expired: bool) -> PollStatus {
        if greeting_expired && !self.greeted.load(Ordering::Relaxed) {
            return self.close(t, b"timeout\n");
        }
        if self.conns.stopping() {
            return self.close(t, b"bye\n");
        }
        let mut buf = [0u8; 256];
        match self.stream.read(&mut buf) {
            Ok(0) => self.close(t, b""),
            Ok(n) => {
                self.input.extend_from_slice(&buf[..n]);
                while let Some(end) = self.input.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = self.input.drain(..=end).collect();
                    if !self.greeted.load(Ordering::Relaxed) {
                        if line != b"hello\n" {
                            return self.close(t, b"bad greeting\n");
                        }
                        self.greeted.store(true, Ordering::Relaxed);
                        let _ = self.stream.write_all(b"ok\n");
                    } else {
                        let _ = self.stream.write_all(&line);
                    }
                }
                PollStatus::Busy
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => PollStatus::Idle,
            Err(_) => self.close(t, b""),
        }
    }
}

struct Setup {
    fw: Framework,
    acceptor: Acceptor,
    addr: SocketAddr,
}

fn start(mode: Mode, max_connections: usize, greeting_timeout_us: u64) -> Setup {
    let fw = Framework::start(FrameworkConfig {
        pin: false,
        ..FrameworkConfig::new(vec![0], mode)
    })
    .expect("framework");
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.set_nonblocking(true).expect("nonblocking");
    let addr = l.local_addr().expect("addr");
    let conns = Arc::new(Connections::new(Limits {
        name: "echo",
        max_connections,
        greeting_timeout_us,
    }));
    let c = conns.clone();
    let acceptor = Acceptor::start(fw.handle(), &conns, vec![l], move |stream| Echo {
        stream,
        conns: c.clone(),
        greeted: Arc::new(AtomicBool::new(false)),
        input: Vec::new(),
    })
    .expect("acceptor");
    Setup { fw, acceptor, addr }
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
    s
}

/// Everything the server sends until it closes the connection (a reset
/// counts as a close: closing a socket with unread input sends one).
fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    match s.read_to_end(&mut out) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
        Err(e) => panic!(
            "the server did not close the connection: {e} (got {:?})",
            String::from_utf8_lossy(&out)
        ),
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn greet(s: &mut TcpStream) {
    s.write_all(b"hello\n").expect("greet");
    let mut ok = [0u8; 3];
    s.read_exact(&mut ok).expect("greeting answer");
    assert_eq!(&ok, b"ok\n");
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + IO_TIMEOUT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn a_silent_connection_is_closed_at_the_greeting_deadline() {
    for mode in [Mode::Interrupt, Mode::Adaptive, Mode::Poll] {
        let mut s = start(mode, 8, 200_000);
        let mut silent = connect(s.addr);
        let mut good = connect(s.addr);
        greet(&mut good);
        let t0 = Instant::now();
        assert_eq!(read_to_close(&mut silent), "timeout\n", "{mode}");
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{mode}: closed after {:?}",
            t0.elapsed()
        );
        // The greeted connection is not touched by its own (expired) deadline.
        std::thread::sleep(Duration::from_millis(300));
        good.write_all(b"still here\n").expect("write");
        let mut echo = [0u8; 11];
        good.read_exact(&mut echo).expect("echo");
        assert_eq!(&echo, b"still here\n");
        wait_until("the silent connection leaves the table", || {
            s.acceptor.connections().len() == 1
        });
        s.fw.stop();
    }
}

#[test]
fn connections_past_the_limit_are_closed_and_room_is_reused() {
    let mut s = start(Mode::Interrupt, 2, 10_000_000);
    let mut a = connect(s.addr);
    let mut b = connect(s.addr);
    greet(&mut a);
    greet(&mut b);
    let mut c = connect(s.addr);
    let _ = c.write_all(b"hello\n");
    assert_eq!(
        read_to_close(&mut c),
        "",
        "the connection over the limit must be closed unanswered"
    );
    assert_eq!(s.acceptor.connections().len(), 2);
    // A client that leaves frees its place.
    drop(a);
    wait_until("the closed connection leaves the table", || {
        s.acceptor.connections().len() == 1
    });
    let mut d = connect(s.addr);
    greet(&mut d);
    s.fw.stop();
}

#[test]
fn stop_closes_every_connection_and_drain_waits_for_them() {
    let mut s = start(Mode::Adaptive, 8, 10_000_000);
    let mut clients: Vec<TcpStream> = (0..3).map(|_| connect(s.addr)).collect();
    for c in &mut clients {
        greet(c);
    }
    assert!(s.acceptor.stop(), "the first stop stops");
    assert!(!s.acceptor.stop(), "a second stop is a no-op");
    assert_eq!(
        s.acceptor.drain(IO_TIMEOUT),
        0,
        "connections left after the drain"
    );
    for c in &mut clients {
        assert_eq!(read_to_close(c), "bye\n");
    }
    // The listener is gone: a new client is refused or closed at once.
    wait_until("the listener closes", || match TcpStream::connect(s.addr) {
        Err(_) => true,
        Ok(mut late) => {
            late.set_read_timeout(Some(Duration::from_millis(200)))
                .expect("timeout");
            matches!(late.read(&mut [0u8; 1]), Ok(0) | Err(_))
        }
    });
    s.fw.stop();
}
