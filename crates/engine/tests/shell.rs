//! The reactor shell against in-process fake replicas (blocking std
//! threads speaking the replica protocol over loopback): sockets, channels,
//! eventfds, the tick, failure and EIO, without the `lull` binary.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lull_bdev::{BlockDevice, Channel, IoBuf, IoCompletion, IoOp, IoRequest};
use lull_engine::{EngineOptions, ReplicaState, ReplicatedDev};
use lull_proto::replica::{self as proto, Header, Hello, Kind, HEADER_LEN};
use lull_reactor::{Framework, FrameworkConfig, Mode};

const SIZE: u64 = 1 << 20;

struct Fake {
    addr: SocketAddr,
    dead: Arc<AtomicBool>,
}

fn fake_replica() -> Fake {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let data = Arc::new(Mutex::new(vec![0u8; SIZE as usize]));
    let dead = Arc::new(AtomicBool::new(false));
    let d2 = dead.clone();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { break };
            if d2.load(Ordering::SeqCst) {
                continue;
            }
            let (data, dead) = (data.clone(), d2.clone());
            std::thread::spawn(move || serve(s, data, dead));
        }
    });
    Fake { addr, dead }
}

fn serve(mut s: TcpStream, data: Arc<Mutex<Vec<u8>>>, dead: Arc<AtomicBool>) {
    let _ = s.set_read_timeout(Some(Duration::from_millis(100)));
    loop {
        let mut raw = [0u8; HEADER_LEN];
        loop {
            if dead.load(Ordering::SeqCst) {
                return;
            }
            match s.read_exact(&mut raw) {
                Ok(()) => break,
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::TimedOut =>
                {
                    continue
                }
                Err(_) => return,
            }
        }
        if dead.load(Ordering::SeqCst) {
            return;
        }
        let Ok(h) = proto::decode_header(&raw) else {
            return;
        };
        let mut payload = vec![0u8; proto::payload_len(&h)];
        if s.read_exact(&mut payload).is_err() {
            return;
        }
        let (o, l) = (h.offset as usize, h.length as usize);
        let (reply, out): (Header, Vec<u8>) = match h.kind {
            Kind::Hello => {
                let session = proto::decode_hello(&payload).map_or(0, |h| h.session);
                let me = Hello {
                    volume_size: SIZE,
                    generation: 1,
                    flags: proto::HELLO_FLAG_CLEAN,
                    session,
                };
                (h.reply_with(0), proto::encode_hello(&me).to_vec())
            }
            Kind::IntentGet => {
                // An empty record (the fake is always clean).
                let mut out = Vec::new();
                proto::encode_intent(0, &vec![0; proto::intent_bitmap_bytes(SIZE)], &mut out)
                    .unwrap();
                let mut r = h.reply_with(0);
                r.offset = u64::from(proto::intent_regions(SIZE));
                r.length = out.len() as u32;
                (r, out)
            }
            Kind::Read => (h.reply_with(0), data.lock().unwrap()[o..o + l].to_vec()),
            Kind::Write | Kind::WriteFua => {
                data.lock().unwrap()[o..o + l].copy_from_slice(&payload);
                (h.reply_with(0), Vec::new())
            }
            Kind::Extents => {
                // Everything is data: one extent over the whole range.
                let mut out = Vec::new();
                proto::encode_extents(&[(h.offset, u64::from(h.length))], &mut out).unwrap();
                let mut r = h.reply_with(0);
                r.offset = h.offset + u64::from(h.length);
                r.length = out.len() as u32;
                (r, out)
            }
            _ => (h.reply_with(0), Vec::new()),
        };
        let mut hb = [0u8; HEADER_LEN];
        proto::encode_header(&reply, &mut hb).unwrap();
        if s.write_all(&hb).is_err() || s.write_all(&out).is_err() {
            return;
        }
    }
}

fn io(
    ch: &mut Box<dyn Channel>,
    op: IoOp,
    offset: u64,
    data: Option<&[u8]>,
    len: u32,
) -> IoCompletion {
    let buf = match op {
        IoOp::Read | IoOp::Write { .. } => {
            let mut b = IoBuf::with_capacity(len as usize);
            b.set_len(len as usize);
            if let Some(d) = data {
                b.as_mut_slice().copy_from_slice(d);
            }
            Some(b)
        }
        _ => None,
    };
    ch.submit(IoRequest {
        tag: 1,
        op,
        offset,
        len,
        buf,
    })
    .map_err(|(_, e)| e)
    .unwrap();
    ch.flush_submissions();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut got = None;
        ch.reap(&mut |c| got = Some(c));
        if let Some(c) = got {
            return c;
        }
        assert!(Instant::now() < deadline, "no completion");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn replicated_dev_writes_reads_fails_over_and_eios() {
    let mut fw = Framework::start(FrameworkConfig {
        pin: false,
        ..FrameworkConfig::new(vec![0], Mode::Interrupt)
    })
    .unwrap();
    let (a, b) = (fake_replica(), fake_replica());
    let opts = EngineOptions {
        replica_timeout_ms: 1500,
        keepalive_interval_ms: 300,
        ..Default::default()
    };
    // Plain links: the fake replicas here speak the protocol in plaintext.
    let dev = ReplicatedDev::start(
        fw.handle(),
        0,
        "t",
        vec![a.addr.into(), b.addr.into()],
        SIZE,
        opts,
        None,
    )
    .unwrap();
    assert!(
        dev.wait_ready(Duration::from_secs(20)),
        "{:?}",
        dev.replica_status()
    );
    // Let the election wait for both (it does, both answer at once).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dev
        .replica_status()
        .iter()
        .all(|s| s.state == ReplicaState::Healthy)
    {
        assert!(Instant::now() < deadline, "{:?}", dev.replica_status());
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut ch = dev.open_channel().unwrap();
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 7) as u8).collect();
    let c = io(
        &mut ch,
        IoOp::Write { fua: false },
        4096,
        Some(&data),
        data.len() as u32,
    );
    assert!(c.result.is_ok(), "{:?}", c.result);
    let c = io(&mut ch, IoOp::Flush, 0, None, 0);
    assert!(c.result.is_ok());
    for _ in 0..4 {
        let c = io(&mut ch, IoOp::Read, 4096, None, data.len() as u32);
        assert!(c.result.is_ok());
        assert_eq!(c.buf.unwrap().as_slice(), &data[..]);
    }
    // One replica dies (its connections close, it refuses new ones): it is
    // failed and I/O goes on.
    a.dead.store(true, Ordering::SeqCst);
    let c = io(
        &mut ch,
        IoOp::Write { fua: true },
        0,
        Some(&data[..4096]),
        4096,
    );
    assert!(c.result.is_ok(), "{:?}", c.result);
    let st = dev.replica_status();
    assert!(st.iter().any(|s| s.state == ReplicaState::Failed), "{st:?}");
    let c = io(&mut ch, IoOp::Read, 0, None, 4096);
    assert_eq!(c.buf.unwrap().as_slice(), &data[..4096]);
    // The last one goes too: EIO, not stale data.
    b.dead.store(true, Ordering::SeqCst);
    let c = io(&mut ch, IoOp::Read, 0, None, 4096);
    assert_eq!(c.result.map_err(|e| e.errno()), Err(libc::EIO));
    drop(ch);
    drop(dev);
    fw.stop();
}
