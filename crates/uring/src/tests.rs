//! Ring and queue tests against a real temp file.

use std::os::fd::AsFd;
use std::path::PathBuf;

use crate::*;

struct TempFile(PathBuf, std::fs::File);

impl TempFile {
    fn new(tag: &str, size: u64) -> TempFile {
        let path = std::env::temp_dir().join(format!(
            "lull-uring-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("create temp file");
        file.set_len(size).expect("set_len");
        TempFile(path, file)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn ring_nop_round_trip_and_eventfd() {
    let mut ring = Ring::new(8).expect("io_uring available");
    // SAFETY: NOPs touch no memory.
    unsafe { ring.push_chain(&[(1, RingOp::Nop), (2, RingOp::Nop)]) }.expect("room");
    ring.submit().expect("submit");
    assert!(wait_readable(ring.event_fd(), 5000).expect("poll"));
    let mut seen = Vec::new();
    while seen.len() < 2 {
        ring.reap(|ud, res| seen.push((ud, res)));
    }
    seen.sort();
    assert_eq!(seen, vec![(1, 0), (2, 0)]);
    // reap drained the eventfd: not readable any more.
    assert!(!wait_readable(ring.event_fd(), 0).expect("poll"));
}

#[test]
fn queue_write_then_read_back() {
    let tmp = TempFile::new("q", 1 << 20);
    let mut q: IoQueue<&'static str> = IoQueue::new(16, &[tmp.1.as_fd()]).expect("queue");
    let mut buf = IoBuf::with_capacity(8192);
    buf.set_len(8192);
    buf.as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = i as u8);
    let w = q.alloc("write", Some(buf)).expect("slot");
    q.push(
        w,
        &[
            (
                1,
                QueueOp::Write {
                    file: 0,
                    buf_offset: 0,
                    len: 8192,
                    file_offset: 4096,
                },
            ),
            (
                2,
                QueueOp::Fsync {
                    file: 0,
                    datasync: true,
                },
            ),
        ],
    )
    .expect("push");
    // While in flight the buffer is fenced off.
    assert!(q.buf(w).is_none());
    assert!(q.release(w).is_none());
    assert_eq!(q.push(w, &[(0, QueueOp::Nop)]), Err(PushError::Busy));
    q.submit_and_wait(2).expect("wait");
    let mut kinds = Vec::new();
    while let Some(c) = q.next_completion() {
        assert_eq!(c.slot, w);
        kinds.push((c.kind, c.result));
    }
    kinds.sort();
    assert_eq!(kinds, vec![(1, 8192), (2, 0)]);
    let (ctx, buf) = q.release(w).expect("released");
    assert_eq!(ctx, "write");
    let written = buf.expect("buffer back");

    let mut rbuf = IoBuf::with_capacity(4096);
    rbuf.set_len(4096);
    let r = q.alloc("read", Some(rbuf)).expect("slot");
    q.push(
        r,
        &[(
            0,
            QueueOp::Read {
                file: 0,
                buf_offset: 0,
                len: 4096,
                file_offset: 8192,
            },
        )],
    )
    .expect("push");
    q.submit_and_wait(1).expect("wait");
    let c = q.next_completion().expect("completion");
    assert_eq!(c.result, 4096);
    let (_, rbuf) = q.release(r).expect("released");
    assert_eq!(rbuf.expect("buf").as_slice(), &written.as_slice()[4096..]);
    q.check_invariants();
    assert_eq!(q.in_use(), 0);
}

#[test]
fn queue_rejects_bad_pushes_and_fills_up() {
    let tmp = TempFile::new("bad", 4096);
    let mut q: IoQueue<u32> = IoQueue::new(4, &[tmp.1.as_fd()]).expect("queue");
    let cap = q.capacity();
    let mut buf = IoBuf::with_capacity(4096);
    buf.set_len(100);
    let s = q.alloc(0, Some(buf)).expect("slot");
    let read = |len| QueueOp::Read {
        file: 0,
        buf_offset: 0,
        len,
        file_offset: 0,
    };
    assert_eq!(q.push(s, &[(0, read(101))]), Err(PushError::BadRange));
    assert_eq!(
        q.push(
            s,
            &[(
                0,
                QueueOp::Fsync {
                    file: 1,
                    datasync: false
                }
            )]
        ),
        Err(PushError::BadFile)
    );
    assert_eq!(q.push(s, &[]), Err(PushError::BadChain));
    for i in 1..cap {
        q.alloc(i as u32, None).expect("slot");
    }
    assert_eq!(q.alloc(99, None).map_err(|(c, _)| c), Err(99));
    q.check_invariants();
}

#[test]
fn queue_drop_waits_for_in_flight_io() {
    let tmp = TempFile::new("drop", 4 << 20);
    let mut q: IoQueue<()> = IoQueue::new(8, &[tmp.1.as_fd()]).expect("queue");
    for _ in 0..8 {
        let mut buf = IoBuf::with_capacity(512 << 10);
        buf.set_len(512 << 10);
        let s = q.alloc((), Some(buf)).expect("slot");
        q.push(
            s,
            &[(
                0,
                QueueOp::Read {
                    file: 0,
                    buf_offset: 0,
                    len: 512 << 10,
                    file_offset: 0,
                },
            )],
        )
        .expect("push");
    }
    q.submit().expect("submit");
    drop(q); // must not free buffers under the kernel; miri-free smoke test
}

#[test]
fn dio_alignment_probe_does_not_fail() {
    let tmp = TempFile::new("dio", 4096);
    // Either answer is fine; it must not error out or panic.
    let _ = probe::dio_alignment(tmp.1.as_fd());
}

#[test]
fn enters_are_counted_per_thread_and_per_ring() {
    let counter = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut ring = Ring::new(8).expect("io_uring available");
    ring.set_enter_counter(counter.clone());
    let before = thread_enter_calls();
    // SAFETY: a NOP touches no memory.
    unsafe { ring.push_chain(&[(1, RingOp::Nop)]) }.expect("room");
    ring.submit().expect("submit");
    ring.submit_and_wait(1).expect("wait");
    assert_eq!(thread_enter_calls() - before, 2);
    assert_eq!(counter.load(std::sync::atomic::Ordering::Relaxed), 2);
    // Another thread's enters are its own.
    let other = std::thread::spawn(thread_enter_calls).join().expect("join");
    assert_eq!(other, 0);
}

#[test]
fn sqpoll_ring_round_trip() {
    let setup = RingSetup {
        sqpoll_idle_ms: Some(10),
        ..RingSetup::default()
    };
    let mut ring = match Ring::with_setup(8, setup) {
        Ok(r) => r,
        Err(e) => panic!("SQPOLL refused on this kernel: {e}"),
    };
    assert_eq!(ring.setup(), setup);
    // SAFETY: a NOP touches no memory.
    unsafe { ring.push_chain(&[(9, RingOp::Nop)]) }.expect("room");
    ring.submit().expect("submit");
    assert!(wait_readable(ring.event_fd(), 5000).expect("poll"));
    let mut seen = Vec::new();
    while seen.is_empty() {
        ring.reap(|ud, res| seen.push((ud, res)));
    }
    assert_eq!(seen, vec![(9, 0)]);
}

#[test]
fn hybrid_iopoll_ring_is_made_and_completes_nops() {
    let flags = probe::IORING_SETUP_IOPOLL | probe::IORING_SETUP_HYBRID_IOPOLL;
    if let Err(e) = probe::setup_flags_supported(flags) {
        eprintln!(
            "SKIP hybrid_iopoll_ring_is_made_and_completes_nops: the kernel refuses IORING_SETUP_HYBRID_IOPOLL ({e}); it needs Linux 6.13+"
        );
        return;
    }
    let setup = RingSetup {
        iopoll: true,
        hybrid_iopoll: true,
        ..RingSetup::default()
    };
    let mut ring = Ring::with_setup(8, setup).expect("a hybrid IOPOLL ring");
    assert_eq!(ring.setup(), setup);
    for round in 0..3u64 {
        // SAFETY: NOPs touch no memory.
        unsafe { ring.push_chain(&[(round * 2, RingOp::Nop), (round * 2 + 1, RingOp::Nop)]) }
            .expect("room");
        ring.submit_and_wait(2).expect("submit and wait");
        let mut seen = Vec::new();
        while let Some(c) = ring.pop() {
            seen.push(c);
        }
        seen.sort();
        assert_eq!(seen, vec![(round * 2, 0), (round * 2 + 1, 0)]);
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Pushes one op on a fresh slot, waits for it, returns (result, buffer).
fn one_op(q: &mut IoQueue<()>, buf: IoBuf, op: QueueOp) -> (i32, IoBuf) {
    let s = q.alloc((), Some(buf)).expect("slot");
    q.push(s, &[(0, op)]).expect("push");
    q.submit_and_wait(1).expect("wait");
    let c = q.next_completion().expect("completion");
    let (_, buf) = q.release(s).expect("released");
    (c.result, buf.expect("buffer back"))
}

#[test]
fn fixed_buffers_move_the_right_bytes_and_others_go_plain() {
    let tmp = TempFile::new("fixed", 1 << 20);
    let arena = FixedArena::new(4 * ARENA_SET_BYTES).expect("arena");
    let other = FixedArena::new(ARENA_SET_BYTES).expect("unregistered arena");
    {
        let mut q: IoQueue<()> = IoQueue::new(8, &[tmp.1.as_fd()]).expect("queue");
        assert_eq!(
            q.register_arenas(std::slice::from_ref(&arena))
                .expect("register"),
            1
        );
        assert_eq!(q.registered_arenas(), 1);
        let write = |len: u32, at: u64| QueueOp::Write {
            file: 0,
            buf_offset: 0,
            len,
            file_offset: at,
        };
        let read = |len: u32, at: u64| QueueOp::Read {
            file: 0,
            buf_offset: 0,
            len,
            file_offset: at,
        };
        // WRITE_FIXED of 128 KiB and of 4 KiB, from the arena.
        let big = pattern(128 << 10, 1);
        let mut w = arena.get(big.len()).expect("arena buf");
        w.as_mut_slice().copy_from_slice(&big);
        assert_eq!(one_op(&mut q, w, write(128 << 10, 0)).0, 128 << 10);
        let small = pattern(4096, 2);
        let mut w = arena.get(4096).expect("arena buf");
        w.as_mut_slice().copy_from_slice(&small);
        assert_eq!(one_op(&mut q, w, write(4096, 256 << 10)).0, 4096);
        assert_eq!(q.buffer_ios(), (2, 0));
        // READ_FIXED back, at an offset inside the buffer too.
        let (n, r) = one_op(
            &mut q,
            arena.get(128 << 10).expect("buf"),
            read(128 << 10, 0),
        );
        assert_eq!((n, r.as_slice() == &big[..]), (128 << 10, true));
        let s = q.alloc((), arena.get(8192)).expect("slot");
        let op = QueueOp::Read {
            file: 0,
            buf_offset: 4096,
            len: 4096,
            file_offset: 256 << 10,
        };
        q.push(s, &[(0, op)]).expect("push");
        q.submit_and_wait(1).expect("wait");
        assert_eq!(q.next_completion().expect("cqe").result, 4096);
        let (_, r) = q.release(s).expect("released");
        assert_eq!(&r.expect("buf").as_slice()[4096..], &small[..]);
        assert_eq!(q.buffer_ios(), (4, 0));
        // A heap buffer and another (unregistered) arena's go plain.
        let mut heap = IoBuf::with_capacity(4096);
        heap.set_len(4096);
        let (n, r) = one_op(&mut q, heap, read(4096, 256 << 10));
        assert_eq!((n, r.as_slice() == &small[..]), (4096, true));
        let (n, r) = one_op(&mut q, other.get(4096).expect("buf"), read(4096, 256 << 10));
        assert_eq!((n, r.as_slice() == &small[..]), (4096, true));
        assert_eq!(q.buffer_ios(), (4, 2));
        // Registering twice is refused; the first registration stays.
        assert!(q.register_arenas(&[other]).is_err());
        q.check_invariants();
    }
    assert_eq!(arena.stats().in_use_bytes, 0);
}

#[test]
fn unregistered_queue_sends_arena_buffers_plain() {
    let tmp = TempFile::new("plain", 1 << 20);
    let arena = FixedArena::new(ARENA_SET_BYTES).expect("arena");
    let mut q: IoQueue<()> = IoQueue::new(8, &[tmp.1.as_fd()]).expect("queue");
    let data = pattern(4096, 9);
    let mut w = arena.get(4096).expect("buf");
    w.as_mut_slice().copy_from_slice(&data);
    let op = QueueOp::Write {
        file: 0,
        buf_offset: 0,
        len: 4096,
        file_offset: 0,
    };
    assert_eq!(one_op(&mut q, w, op).0, 4096);
    assert_eq!(q.buffer_ios(), (0, 1));
}

#[test]
fn rings_share_one_registration_and_outlive_a_new_template() {
    let tmp = TempFile::new("clone", 1 << 20);
    let first = FixedArena::new(ARENA_SET_BYTES).expect("arena");
    let second = FixedArena::new(ARENA_SET_BYTES).expect("arena");
    let sqpoll = RingSetup {
        sqpoll_idle_ms: Some(10),
        ..RingSetup::default()
    };
    let mut a: IoQueue<()> = IoQueue::new(8, &[tmp.1.as_fd()]).expect("queue");
    let mut b: IoQueue<()> = IoQueue::with_setup(8, &[tmp.1.as_fd()], sqpoll).expect("queue");
    let mut c: IoQueue<()> = IoQueue::new(8, &[tmp.1.as_fd()]).expect("queue");
    assert_eq!(a.register_arenas(std::slice::from_ref(&first)).unwrap(), 1);
    assert_eq!(b.register_arenas(std::slice::from_ref(&first)).unwrap(), 1);
    // Another arena set: a new template; `a` and `b` keep theirs.
    assert_eq!(
        c.register_arenas(&[second.clone(), first.clone()]).unwrap(),
        2
    );
    let data = pattern(4096, 5);
    let write = |at: u64| QueueOp::Write {
        file: 0,
        buf_offset: 0,
        len: 4096,
        file_offset: at,
    };
    let read = QueueOp::Read {
        file: 0,
        buf_offset: 0,
        len: 4096,
        file_offset: 0,
    };
    let mut w = first.get(4096).expect("buf");
    w.as_mut_slice().copy_from_slice(&data);
    assert_eq!(one_op(&mut a, w, write(0)).0, 4096);
    let (n, r) = one_op(&mut b, first.get(4096).expect("buf"), read);
    assert_eq!((n, r.as_slice() == &data[..]), (4096, true));
    drop(r);
    let (n, r) = one_op(&mut c, second.get(4096).expect("buf"), read);
    assert_eq!((n, r.as_slice() == &data[..]), (4096, true));
    drop(r);
    assert_eq!(a.buffer_ios(), (1, 0));
    assert_eq!(b.buffer_ios(), (1, 0));
    assert_eq!(c.buffer_ios(), (1, 0));
    let release = uname_release();
    let (major, minor) = kernel_version(&release);
    if (major, minor) >= (6, 12) {
        assert!(
            !crate::ring::CLONE_UNSUPPORTED.load(std::sync::atomic::Ordering::Relaxed),
            "Linux {release} clones registered buffers"
        );
    }
}

fn uname_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .expect("osrelease")
        .trim()
        .to_string()
}

fn kernel_version(release: &str) -> (u32, u32) {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (major, minor)
}
