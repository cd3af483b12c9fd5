use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use proptest::prelude::*;

use super::*;
use crate::{
    Data, FileOptions, FileRange, IoBuf, IoCompletion, IoOp, IoRequest, MallocDev, Spliced,
};

const SIZE: u64 = 256 << 10;

fn memory_chain(size: u64) -> ChainDev {
    let base: Arc<dyn BlockDevice> = Arc::new(MallocDev::new(size).expect("malloc"));
    ChainDev::open(Arc::new(MemoryStore::new(base)), size).expect("chain")
}

struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!(
            "lull-chain-{what}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn file_store(dir: &TempDir) -> Arc<dyn LayerStore> {
    Arc::new(FileStore::new(
        dir.0.join("vol.img"),
        FileOptions {
            create: true,
            ..FileOptions::default()
        },
    ))
}

/// Runs one request to completion on `ch`.
fn run(ch: &mut dyn Channel, op: IoOp, offset: u64, len: u32, buf: Option<IoBuf>) -> IoCompletion {
    let mut req = IoRequest {
        tag: 42,
        op,
        offset,
        len,
        buf,
    };
    loop {
        match ch.submit(req) {
            Ok(()) => break,
            Err((r, BdevError::Full { .. })) => {
                req = r;
                ch.reap(&mut |_| panic!("no other request is in flight"));
                std::thread::yield_now();
            }
            Err((_, e)) => {
                return IoCompletion {
                    tag: 42,
                    result: Err(e),
                    buf: None,
                    data: Data::Buf,
                }
            }
        }
    }
    ch.flush_submissions();
    loop {
        let mut out = None;
        ch.reap(&mut |c| out = Some(c));
        if let Some(c) = out {
            assert_eq!(c.tag, 42);
            return c;
        }
        match ch.event_fd() {
            Some(fd) => {
                lull_uring::wait_readable(fd, 1000).expect("poll");
            }
            None => std::thread::yield_now(),
        }
    }
}

fn write(ch: &mut dyn Channel, offset: u64, data: &[u8]) {
    let mut buf = IoBuf::with_capacity(data.len());
    buf.set_len(data.len());
    buf.as_mut_slice().copy_from_slice(data);
    let c = run(
        ch,
        IoOp::Write { fua: false },
        offset,
        data.len() as u32,
        Some(buf),
    );
    c.result.expect("write");
}

fn read(ch: &mut dyn Channel, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = IoBuf::with_capacity(len);
    buf.set_len(len);
    buf.as_mut_slice().fill(0xEE);
    let c = run(ch, IoOp::Read, offset, len as u32, Some(buf));
    c.result.expect("read");
    c.buf.expect("buffer back").as_slice()[..len].to_vec()
}

fn zero(ch: &mut dyn Channel, offset: u64, len: u32, trim: bool) {
    let op = if trim {
        IoOp::Trim
    } else {
        IoOp::WriteZeroes {
            no_hole: false,
            fua: false,
            fast: false,
        }
    };
    run(ch, op, offset, len, None).result.expect("zero");
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i / 512) as u8) | 1)
        .collect()
}

/// A read on a lending channel: whether it was lent, and its bytes
/// (the loan's, or the buffer's).
fn read_lent(ch: &mut dyn Channel, offset: u64, len: usize) -> (bool, Vec<u8>) {
    let mut buf = IoBuf::with_capacity(len);
    buf.set_len(len);
    buf.as_mut_slice().fill(0xEE);
    let c = run(ch, IoOp::Read, offset, len as u32, Some(buf));
    c.result.expect("read");
    match c.data {
        Data::Lent(l) => (true, l.as_slice().to_vec()),
        Data::Buf => (
            false,
            c.buf.expect("buffer back").as_slice()[..len].to_vec(),
        ),
        Data::Spliced(_) => panic!("a memory chain handed over a descriptor"),
    }
}

/// Lent reads (issue 33) through a chain over memory: without snapshots
/// the one layer lends; after a snapshot a read that lies in one layer is
/// still lent, a read made of both layers' runs and a copy-up of a
/// partial block use the lower layer's lent bytes: every read returns
/// what was written.
#[test]
fn lent_reads_pass_through_and_across_snapshots() {
    let chain = memory_chain(SIZE);
    let mut ch = chain.open_channel().expect("channel");
    ch.allow_lend();
    let mut want = pattern(3, SIZE as usize);
    write(&mut *ch, 0, &want);
    let (lent, got) = read_lent(&mut *ch, 4096, 8192);
    assert!(lent, "one layer: lent");
    assert_eq!(got, &want[4096..12288]);
    chain.snapshot("s1").expect("snapshot");
    // A copy-up: part of block 2 written in the new head.
    write(&mut *ch, 8192 + 100, &[0xAB; 50]);
    want[8192 + 100..8192 + 150].fill(0xAB);
    let (_, got) = read_lent(&mut *ch, 0, SIZE as usize);
    assert!(got == want, "a read across both layers");
    let (lent, got) = read_lent(&mut *ch, 8192, 4096);
    assert!(lent, "a read in the head alone: lent");
    assert_eq!(got, &want[8192..12288]);
    let (lent, got) = read_lent(&mut *ch, 16384, 4096);
    assert!(lent, "a read in the snapshot's layer alone: lent");
    assert_eq!(got, &want[16384..20480]);
    // A channel not told to lend gets bytes.
    let mut plain = chain.open_channel().expect("channel");
    assert!(read(&mut *plain, 0, SIZE as usize) == want);
}

/// A directory on tmpfs (/dev/shm), where file layers are read inline
/// and lend file ranges. Fails with a message where there is none.
fn memory_dir(what: &str) -> TempDir {
    let shm = std::path::Path::new("/dev/shm");
    let probe = std::fs::File::open(shm).unwrap_or_else(|e| {
        panic!("this test needs /dev/shm (tmpfs), which cannot be opened: {e}")
    });
    assert!(
        lull_uring::on_memory_filesystem(&probe).expect("fstatfs /dev/shm"),
        "this test needs /dev/shm on tmpfs; it is another filesystem here"
    );
    let p = shm.join(format!(
        "lull-chain-{what}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("dir in /dev/shm");
    TempDir(p)
}

/// A read on a splicing channel: its file range (if it was answered with
/// one), and its bytes (the range's, read back, or the buffer's).
fn read_spliced(ch: &mut dyn Channel, offset: u64, len: usize) -> (Option<FileRange>, Vec<u8>) {
    let mut buf = IoBuf::with_capacity(len);
    buf.set_len(len);
    buf.as_mut_slice().fill(0xEE);
    let c = run(ch, IoOp::Read, offset, len as u32, Some(buf));
    c.result.expect("read");
    match c.data {
        Data::Spliced(Spliced::File(r)) => {
            assert_eq!((r.offset, r.len), (offset, len), "the request's range");
            let mut got = vec![0u8; len];
            r.read_into(&mut got).expect("read the range");
            (Some(r), got)
        }
        Data::Spliced(Spliced::Pipe(_)) => panic!("a file chain handed over a pipe"),
        Data::Lent(_) => panic!("a file chain lent memory"),
        Data::Buf => (None, c.buf.expect("buffer back").as_slice()[..len].to_vec()),
    }
}

/// File ranges (issue 33) through a chain of files on tmpfs: without
/// snapshots the one layer's range is handed on; after a snapshot a read
/// in one layer still is, a read made of both layers' runs reads the
/// lower layer's range into its buffer; a range handed out stays
/// readable, inside its file, across a revert that drops its layer.
#[test]
fn file_ranges_pass_through_and_across_snapshots() {
    let dir = memory_dir("spliced");
    let chain = ChainDev::open(file_store(&dir), SIZE).expect("chain");
    let mut ch = chain.open_channel().expect("channel");
    ch.allow_splice();
    let min = crate::SENDFILE_READ_BYTES_MIN as usize;
    let mut want = pattern(5, SIZE as usize);
    write(&mut *ch, 0, &want);
    let (range, got) = read_spliced(&mut *ch, 4096, 2 * min);
    assert!(range.is_some(), "one layer: a file range");
    assert_eq!(got, &want[4096..4096 + 2 * min]);
    let (range, got) = read_spliced(&mut *ch, 0, min - 512);
    assert!(range.is_none(), "below the threshold: copied");
    assert_eq!(got, &want[..min - 512]);
    chain.snapshot("s1").expect("snapshot");
    // 4 KiB in the head at 64 KiB, and 64 KiB at 128 KiB.
    write(&mut *ch, 64 << 10, &[0xAB; 4096]);
    want[64 << 10..68 << 10].fill(0xAB);
    write(&mut *ch, 128 << 10, &pattern(77, 64 << 10));
    want[128 << 10..192 << 10].copy_from_slice(&pattern(77, 64 << 10));
    let (range, got) = read_spliced(&mut *ch, 0, 128 << 10);
    assert!(
        range.is_none(),
        "both layers' runs: put together in the buffer"
    );
    assert!(got == want[..128 << 10], "a read across both layers");
    let (head, got) = read_spliced(&mut *ch, 128 << 10, 64 << 10);
    assert!(head.is_some(), "a read in the head alone: a file range");
    assert_eq!(got, &want[128 << 10..192 << 10]);
    let (lower, got) = read_spliced(&mut *ch, 192 << 10, 64 << 10);
    assert!(
        lower.is_some(),
        "a read in the snapshot's layer alone: a file range"
    );
    assert_eq!(got, &want[192 << 10..]);
    // A revert drops the head's layer while its range is held (as a reply
    // queued behind a full socket would): the range still reads what it
    // showed, from the file it holds open; the chain reads s1's data.
    drop(ch);
    chain.revert("s1").expect("revert");
    let head = head.expect("held");
    let mut got = vec![0u8; 64 << 10];
    head.read_into(&mut got).expect("a dropped layer's range");
    assert_eq!(got, &want[128 << 10..192 << 10]);
    let mut ch = chain.open_channel().expect("channel");
    ch.allow_splice();
    let (_, got) = read_spliced(&mut *ch, 128 << 10, 64 << 10);
    assert_eq!(got, &pattern(5, SIZE as usize)[128 << 10..192 << 10]);
    // A channel not told to splice gets bytes.
    let mut plain = chain.open_channel().expect("channel");
    let mut buf = IoBuf::with_capacity(64 << 10);
    buf.set_len(64 << 10);
    let c = run(&mut *plain, IoOp::Read, 0, 64 << 10, Some(buf));
    assert!(matches!(c.data, Data::Buf) && c.result.is_ok());
}

#[test]
fn snapshot_keeps_what_was_written_before_it() {
    let chain = memory_chain(SIZE);
    let mut ch = chain.open_channel().expect("channel");
    let a = pattern(1, 64 << 10);
    write(ch.as_mut(), 0, &a);
    chain.snapshot("s1").expect("snapshot");
    let b = pattern(100, 16 << 10);
    write(ch.as_mut(), 8 << 10, &b);
    let mut want = a.clone();
    want[8 << 10..24 << 10].copy_from_slice(&b);
    assert_eq!(
        read(ch.as_mut(), 0, 64 << 10),
        want,
        "the live volume has B"
    );
    let view = chain.snapshot_view("s1").expect("view of s1");
    assert!(view.read_only());
    let mut v = view.open_channel().expect("view channel");
    assert_eq!(read(v.as_mut(), 0, 64 << 10), a, "the snapshot has A");
    let refused = run(
        v.as_mut(),
        IoOp::Write { fua: false },
        0,
        512,
        Some(IoBuf::with_capacity(512)),
    );
    assert!(matches!(refused.result, Err(BdevError::ReadOnly)));
    // What changed since s1: exactly the 16 KiB of B.
    let runs = chain.changed_since("s1", 0, SIZE, 100).expect("changed");
    assert_eq!(
        runs,
        [
            ChangeRun {
                length_bytes: 8 << 10,
                changed: false
            },
            ChangeRun {
                length_bytes: 16 << 10,
                changed: true
            },
            ChangeRun {
                length_bytes: SIZE - (24 << 10),
                changed: false
            },
        ]
    );
    assert!(matches!(
        chain.changed_since("nope", 0, 4096, 4),
        Err(BdevError::NoSuchSnapshot(_))
    ));
    assert_eq!(chain.snapshot_names(), ["s1"]);
}

#[test]
fn unaligned_writes_copy_the_rest_of_the_block_up() {
    let chain = memory_chain(SIZE);
    let mut ch = chain.open_channel().expect("channel");
    let a = pattern(7, 16 << 10);
    write(ch.as_mut(), 0, &a);
    chain.snapshot("s1").expect("snapshot");
    // 512 bytes in the middle of a block, and a write across two blocks'
    // edges.
    write(ch.as_mut(), 1024, &[0xAB; 512]);
    write(ch.as_mut(), 4096 + 3000, &[0xCD; 4000]);
    let mut want = a.clone();
    want[1024..1536].fill(0xAB);
    want[7096..11096].fill(0xCD);
    assert_eq!(read(ch.as_mut(), 0, 16 << 10), want);
    let mut v = chain.snapshot_view("s1").unwrap().open_channel().unwrap();
    assert_eq!(read(v.as_mut(), 0, 16 << 10), a);
}

#[test]
fn trim_and_zeroes_over_a_snapshot_read_zeros_and_keep_the_snapshot() {
    let chain = memory_chain(SIZE);
    let mut ch = chain.open_channel().expect("channel");
    let a = pattern(9, 3 << 20 >> 4);
    write(ch.as_mut(), 0, &a);
    chain.snapshot("s1").expect("snapshot");
    zero(ch.as_mut(), 100, 5000, true);
    zero(ch.as_mut(), 20_000, 30_000, false);
    let mut want = a.clone();
    want[100..5100].fill(0);
    want[20_000..50_000].fill(0);
    assert_eq!(read(ch.as_mut(), 0, a.len()), want);
    let mut v = chain.snapshot_view("s1").unwrap().open_channel().unwrap();
    assert_eq!(read(v.as_mut(), 0, a.len()), a);
}

#[test]
fn revert_clone_and_delete() {
    let chain = memory_chain(SIZE);
    let mut ch = chain.open_channel().expect("channel");
    let a = pattern(1, 32 << 10);
    write(ch.as_mut(), 0, &a);
    chain.snapshot("s1").unwrap();
    write(ch.as_mut(), 0, &pattern(50, 8 << 10));
    chain.snapshot("s2").unwrap();
    write(ch.as_mut(), 4096, &pattern(90, 4 << 10));
    let live = read(ch.as_mut(), 0, 32 << 10);

    // A clone of s1 is writable and independent.
    let base: Arc<dyn BlockDevice> = Arc::new(MallocDev::new(SIZE).unwrap());
    let clone = chain
        .clone_snapshot("s1", "c1", Arc::new(MemoryStore::new(base)))
        .expect("clone");
    let mut c = clone.open_channel().unwrap();
    assert_eq!(read(c.as_mut(), 0, 32 << 10), a);
    write(c.as_mut(), 0, &[0x11; 4096]);
    assert_eq!(
        read(ch.as_mut(), 0, 32 << 10),
        live,
        "the origin did not change"
    );
    let e = chain.delete_snapshot("s1").expect_err("s1 has a clone");
    assert!(e.to_string().contains("c1"), "{e}");

    // Deleting s2 merges it into the head; the volume reads the same.
    chain.delete_snapshot("s2").expect("delete s2");
    chain.wait_merge().expect("merge");
    assert_eq!(chain.snapshot_names(), ["s1"]);
    drop(ch);
    let mut ch = chain.open_channel().unwrap();
    assert_eq!(read(ch.as_mut(), 0, 32 << 10), live);

    // Flattening the clone lets go of s1.
    assert!(clone.flatten().expect("flatten"));
    assert!(chain.forget_clone("c1"));
    drop(c);
    let mut c = clone.open_channel().unwrap();
    let mut want = a.clone();
    want[..4096].fill(0x11);
    assert_eq!(read(c.as_mut(), 0, 32 << 10), want);
    assert_eq!(clone.layer_count(), 1);

    // Revert to s1 reads A again; s1 can go now too.
    assert_eq!(chain.revert("s1").expect("revert"), Vec::<String>::new());
    drop(ch);
    let mut ch = chain.open_channel().unwrap();
    assert_eq!(read(ch.as_mut(), 0, 32 << 10), a);
    chain.delete_snapshot("s1").expect("delete s1");
    chain.wait_merge().expect("merge");
    assert!(chain.snapshots().is_empty());
    drop(ch);
    let mut ch = chain.open_channel().unwrap();
    assert_eq!(read(ch.as_mut(), 0, 32 << 10), a);
}

#[test]
fn bad_names_and_the_layer_limit() {
    let chain = memory_chain(64 << 10);
    for bad in [
        "",
        "a@b",
        "a/b",
        ".hidden",
        "with space",
        &"n".repeat(MAX_SNAPSHOT_NAME_LEN + 1),
    ] {
        assert!(
            matches!(chain.snapshot(bad), Err(BdevError::BadName(_))),
            "{bad:?}"
        );
    }
    chain.snapshot("s").unwrap();
    assert!(
        matches!(chain.snapshot("s"), Err(BdevError::BadName(_))),
        "duplicate"
    );
    for i in 2..MAX_CHAIN_LAYERS {
        chain.snapshot(&format!("s{i}")).unwrap();
    }
    let e = chain.snapshot("one-too-many").expect_err("at the limit");
    assert!(e.to_string().contains("maximum"), "{e}");
}

#[test]
fn a_first_snapshot_cut_before_its_record_leaves_no_file() {
    let dir = TempDir::new("first-cut");
    {
        let chain = ChainDev::open(file_store(&dir), SIZE).expect("open");
        chain.sync().unwrap();
    }
    // The layer file of a first snapshot, its record never written (seed
    // 1795787965974914393 of system snapshot_crash:: found it).
    std::fs::create_dir_all(dir.0.join("vol.img.lull")).unwrap();
    std::fs::write(dir.0.join("vol.img.lull/L1.img"), b"x").unwrap();
    let chain = ChainDev::open(file_store(&dir), SIZE).expect("reopen");
    assert!(!dir.0.join("vol.img.lull/L1.img").exists());
    assert!(chain.snapshot_names().is_empty());
}

#[test]
fn a_file_chain_survives_reopening() {
    let dir = TempDir::new("reopen");
    let a = pattern(3, 64 << 10);
    let b = pattern(33, 8 << 10);
    {
        let chain = ChainDev::open(file_store(&dir), SIZE).expect("open");
        let mut ch = chain.open_channel().unwrap();
        write(ch.as_mut(), 0, &a);
        chain.snapshot("s1").unwrap();
        write(ch.as_mut(), 4096, &b);
        zero(ch.as_mut(), 32 << 10, 4096, true);
        chain.snapshot("s2").unwrap();
        chain.sync().unwrap();
    }
    // An orphan from a snapshot a crash cut short is removed at open.
    std::fs::write(dir.0.join("vol.img.lull/L99.img"), b"x").unwrap();
    let chain = ChainDev::open(file_store(&dir), SIZE).expect("reopen");
    assert!(!dir.0.join("vol.img.lull/L99.img").exists());
    assert_eq!(chain.snapshot_names(), ["s1", "s2"]);
    let mut ch = chain.open_channel().unwrap();
    let mut want = a.clone();
    want[4096..4096 + b.len()].copy_from_slice(&b);
    want[32 << 10..36 << 10].fill(0);
    assert_eq!(read(ch.as_mut(), 0, 64 << 10), want);
    let mut v = chain.snapshot_view("s1").unwrap().open_channel().unwrap();
    assert_eq!(read(v.as_mut(), 0, 64 << 10), a);
    let runs = chain.changed_since("s1", 0, 64 << 10, 16).unwrap();
    let changed: u64 = runs
        .iter()
        .filter(|r| r.changed)
        .map(|r| r.length_bytes)
        .sum();
    assert_eq!(changed, 12 << 10, "{runs:?}");
}

/// One step of the model test.
#[derive(Debug, Clone)]
enum Step {
    Write { offset: u64, len: u32, seed: u8 },
    Zero { offset: u64, len: u32, trim: bool },
    Snapshot,
    Delete(usize),
    Revert(usize),
}

fn step() -> impl Strategy<Value = Step> {
    let size = 64u64 << 10;
    prop_oneof![
        6 => (0..size, 1u32..12_000, any::<u8>()).prop_map(move |(o, l, s)| {
            let l = l.min((size - o) as u32).max(1);
            Step::Write { offset: o, len: l, seed: s }
        }),
        2 => (0..size, 1u32..20_000, any::<bool>()).prop_map(move |(o, l, t)| {
            let l = l.min((size - o) as u32).max(1);
            Step::Zero { offset: o, len: l, trim: t }
        }),
        2 => Just(Step::Snapshot),
        1 => (0usize..8).prop_map(Step::Delete),
        1 => (0usize..8).prop_map(Step::Revert),
    ]
}

fn check_against_model(steps: Vec<Step>, file: bool) {
    let size = 64u64 << 10;
    let dir = TempDir::new("model");
    let chain = if file {
        ChainDev::open(file_store(&dir), size).unwrap()
    } else {
        memory_chain(size)
    };
    let mut live = vec![0u8; size as usize];
    let mut snaps: Vec<(String, Vec<u8>)> = Vec::new();
    let mut n = 0;
    let mut ch = chain.open_channel().unwrap();
    for s in steps {
        match s {
            Step::Write { offset, len, seed } => {
                let data = pattern(seed, len as usize);
                write(ch.as_mut(), offset, &data);
                live[offset as usize..][..len as usize].copy_from_slice(&data);
            }
            Step::Zero { offset, len, trim } => {
                zero(ch.as_mut(), offset, len, trim);
                live[offset as usize..][..len as usize].fill(0);
            }
            Step::Snapshot => {
                n += 1;
                let name = format!("s{n}");
                chain.snapshot(&name).unwrap();
                snaps.push((name, live.clone()));
            }
            Step::Delete(i) if !snaps.is_empty() => {
                let (name, _) = snaps.remove(i % snaps.len());
                chain.delete_snapshot(&name).unwrap();
                chain.wait_merge().unwrap();
            }
            Step::Revert(i) if !snaps.is_empty() => {
                let i = i % snaps.len();
                chain.revert(&snaps[i].0).unwrap();
                live = snaps[i].1.clone();
                snaps.truncate(i + 1);
            }
            Step::Delete(_) | Step::Revert(_) => {}
        }
        assert_eq!(read(ch.as_mut(), 0, size as usize), live, "live volume");
    }
    for (name, want) in &snaps {
        let mut v = chain.snapshot_view(name).unwrap().open_channel().unwrap();
        assert_eq!(&read(v.as_mut(), 0, size as usize), want, "snapshot {name}");
    }
    // The map of changes since each snapshot covers every byte that differs.
    for (name, want) in &snaps {
        let runs = chain.changed_since(name, 0, size, usize::MAX).unwrap();
        let mut pos = 0usize;
        for r in runs {
            let end = pos + r.length_bytes as usize;
            if !r.changed {
                assert_eq!(
                    live[pos..end],
                    want[pos..end],
                    "unchanged since {name} at {pos}"
                );
            }
            pos = end;
        }
    }
    drop(ch);
    if file {
        drop(chain);
        let chain = ChainDev::open(file_store(&dir), size).unwrap();
        let mut ch = chain.open_channel().unwrap();
        assert_eq!(read(ch.as_mut(), 0, size as usize), live, "after reopening");
        for (name, want) in &snaps {
            let mut v = chain.snapshot_view(name).unwrap().open_channel().unwrap();
            assert_eq!(
                &read(v.as_mut(), 0, size as usize),
                want,
                "snapshot {name} reopened"
            );
        }
    }
}

/// A memory chain's layers share a reserve of freed chunks: a revert's
/// dropped head and a merged snapshot feed it, the next head's first
/// writes take from it, and nothing stale shows through: the volume, the
/// snapshots and the head's own device read what was written.
#[test]
fn a_memory_chain_reuses_freed_chunks_without_stale_data() {
    let chunk = crate::MALLOC_CHUNK_BYTES as u64;
    let size = 6 * chunk;
    let base: Arc<dyn BlockDevice> = Arc::new(MallocDev::new(size).expect("malloc"));
    let store = Arc::new(MemoryStore::new(base));
    let reserve = store.reserve().clone();
    let chain = ChainDev::open(store, size).expect("chain");
    let mut ch = chain.open_channel().unwrap();
    let mut live = pattern(3, size as usize);
    write(ch.as_mut(), 0, &live);
    let at_s1 = live.clone();
    chain.snapshot("s1").unwrap();
    // The head fills four chunks with other bytes, then is reverted away.
    write(ch.as_mut(), 0, &pattern(50, 4 * chunk as usize));
    chain.revert("s1").unwrap();
    // The old head goes when the last channel using it lets go.
    drop(ch);
    assert_eq!(reserve.chunks(), 4, "the dropped head's chunks are kept");
    let mut ch = chain.open_channel().unwrap();
    assert!(read(ch.as_mut(), 0, size as usize) == live, "reverted");
    // First writes to the new head: 4 KiB here and there, and a
    // 512-byte one (copied up) in another chunk.
    for (i, at) in [0u64, chunk + 8192, 3 * chunk + 4096]
        .into_iter()
        .enumerate()
    {
        let data = pattern(90 + i as u8, 4096);
        write(ch.as_mut(), at, &data);
        live[at as usize..at as usize + 4096].copy_from_slice(&data);
    }
    write(ch.as_mut(), 5 * chunk + 100, &[0x42; 512]);
    live[(5 * chunk + 100) as usize..(5 * chunk + 612) as usize].fill(0x42);
    assert_eq!(reserve.chunks(), 0, "the new head's chunks came from it");
    assert!(read(ch.as_mut(), 0, size as usize) == live, "first writes");
    // The head's own device holds zeros wherever it was not written.
    let head = chain.shared.state().head().dev.clone();
    let mut hc = head.open_channel().unwrap();
    let h = read(hc.as_mut(), 0, size as usize);
    for (i, (&got, &want)) in h.iter().zip(&live).enumerate() {
        let b = i as u64 / CHAIN_BLOCK_BYTES;
        let written = [
            0,
            (chunk + 8192) / 4096,
            (3 * chunk + 4096) / 4096,
            (5 * chunk) / 4096,
        ];
        if written.contains(&b) {
            assert_eq!(got, want, "head byte {i}");
        } else {
            assert_eq!(got, 0, "head byte {i} not written since the reuse");
        }
    }
    drop(hc);
    let mut v = chain.snapshot_view("s1").unwrap().open_channel().unwrap();
    assert!(read(v.as_mut(), 0, size as usize) == at_s1, "s1");
    drop(v);
    // Deleting s1 merges it into the head (its blocks the head lacks);
    // the merged layer is the volume's own base (no reserve), so the
    // reserve keeps what the merge did not take.
    chain.delete_snapshot("s1").unwrap();
    chain.wait_merge().unwrap();
    assert!(read(ch.as_mut(), 0, size as usize) == live, "merged");
    // Snapshot, a pass of first writes, revert, delete: twice, as the
    // benchmark does; every pass reads back.
    for round in 0..2u8 {
        chain.snapshot("p").unwrap();
        let data = pattern(120 + round, size as usize);
        write(ch.as_mut(), 0, &data);
        assert!(read(ch.as_mut(), 0, size as usize) == data, "pass {round}");
        chain.revert("p").unwrap();
        drop(ch);
        ch = chain.open_channel().unwrap();
        assert!(
            read(ch.as_mut(), 0, size as usize) == live,
            "reverted {round}"
        );
        chain.delete_snapshot("p").unwrap();
        chain.wait_merge().unwrap();
        assert!(
            read(ch.as_mut(), 0, size as usize) == live,
            "merged {round}"
        );
        assert!(reserve.chunks() <= 6);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn memory_chain_matches_a_model(steps in proptest::collection::vec(step(), 1..40)) {
        check_against_model(steps, false);
    }

    #[test]
    fn file_chain_matches_a_model(steps in proptest::collection::vec(step(), 1..25)) {
        check_against_model(steps, true);
    }
}

/// A snapshot taken and writes made while a delete's merge runs: the
/// merged blocks stay visible after the merge drops its layer, the new
/// snapshot holds what was acknowledged before it, and a clone of a
/// snapshot above the merged one stops the merge.
#[test]
fn snapshots_while_a_merge_runs_lose_nothing() {
    for file in [false, true] {
        let dir = TempDir::new(if file { "merge-file" } else { "merge-mem" });
        let size = 8u64 << 20;
        let chain = if file {
            ChainDev::open(file_store(&dir), size).unwrap()
        } else {
            memory_chain(size)
        };
        let mut ch = chain.open_channel().unwrap();
        let a = pattern(5, size as usize);
        write(ch.as_mut(), 0, &a);
        chain.snapshot("s1").unwrap();
        let b = pattern(77, 1 << 20);
        write(ch.as_mut(), 2 << 20, &b);
        chain.snapshot("s2").unwrap();
        let mut live = a.clone();
        live[2 << 20..3 << 20].copy_from_slice(&b);
        // s1 merges into s2 (a frozen layer) while the head moves on.
        chain.delete_snapshot("s1").unwrap();
        write(ch.as_mut(), 0, &[9; 4096]);
        live[..4096].fill(9);
        chain.snapshot("s3").unwrap();
        let at_s3 = live.clone();
        write(ch.as_mut(), 4096, &[8; 4096]);
        live[4096..8192].fill(8);
        chain.wait_merge().unwrap();
        assert_eq!(chain.snapshot_names(), ["s2", "s3"]);
        drop(ch);
        let mut ch = chain.open_channel().unwrap();
        assert!(
            read(ch.as_mut(), 0, size as usize) == live,
            "live after the merge"
        );
        let mut v = chain.snapshot_view("s3").unwrap().open_channel().unwrap();
        assert!(read(v.as_mut(), 0, size as usize) == at_s3, "s3");
        let mut v = chain.snapshot_view("s2").unwrap().open_channel().unwrap();
        let mut at_s2 = a.clone();
        at_s2[2 << 20..3 << 20].copy_from_slice(&b);
        assert!(
            read(v.as_mut(), 0, size as usize) == at_s2,
            "s2 took s1's blocks"
        );
        // A clone of s3 stands on s2: s2 cannot be merged away under it.
        let base: Arc<dyn BlockDevice> = Arc::new(MallocDev::new(size).unwrap());
        let _clone = chain
            .clone_snapshot("s3", "c", Arc::new(MemoryStore::new(base)))
            .unwrap();
        let e = chain
            .delete_snapshot("s2")
            .expect_err("in the clone's base");
        assert!(e.to_string().contains("base of clones c"), "{e}");
        if file {
            drop((ch, v));
            drop(chain);
            let chain = ChainDev::open(file_store(&dir), size).unwrap();
            let mut ch = chain.open_channel().unwrap();
            assert!(read(ch.as_mut(), 0, size as usize) == live, "live reopened");
        }
    }
}

#[test]
fn a_request_held_by_a_quiesce_names_a_retry_time() {
    let chain = memory_chain(SIZE);
    let mut ch = chain.open_channel().expect("channel");
    let quiet = chain.shared.quiesce().expect("quiesce");
    let mut buf = IoBuf::with_capacity(4096);
    buf.set_len(4096);
    let req = IoRequest {
        tag: 1,
        op: IoOp::Write { fua: false },
        offset: 0,
        len: 4096,
        buf: Some(buf),
    };
    use lull_reactor::Clock;
    let before = lull_reactor::MonotonicClock.now_ns();
    let Err((req, BdevError::Full { .. })) = ch.submit(req) else {
        panic!("a quiesced chain takes no request");
    };
    let at = ch.retry_at_ns().expect("a time to try again");
    assert!(at > before && at <= before + 10 * channel::PAUSED_RETRY_NS);
    drop(quiet);
    ch.submit(req)
        .map_err(|(_, e)| e)
        .expect("taken once resumed");
    assert_eq!(ch.retry_at_ns(), None);
}

#[test]
fn the_one_layer_and_its_file_are_known_before_and_after_a_merge() {
    let dir = TempDir::new("durable");
    let store = Arc::new(FileStore::new(
        dir.0.join("vol.img"),
        FileOptions {
            create: true,
            ..FileOptions::default()
        },
    ));
    let chain = ChainDev::open(store.clone(), SIZE).expect("chain");
    assert_eq!(chain.single_layer_id(), Some(0));
    assert!(store.page_cache_file(0).is_some());
    let g0 = chain.layers_generation();
    let mut ch = chain.open_channel().expect("channel");
    write(ch.as_mut(), 0, &pattern(1, 8192));
    chain.snapshot("s1").expect("snapshot");
    assert_eq!(chain.single_layer_id(), None);
    assert_ne!(chain.layers_generation(), g0);
    write(ch.as_mut(), 8192, &pattern(2, 4096));
    chain.delete_snapshot("s1").expect("delete");
    chain.wait_merge().expect("merge");
    // The one layer left is the head the snapshot started, not vol.img.
    let id = chain.single_layer_id().expect("one layer");
    assert_ne!(id, 0);
    assert!(!dir.0.join("vol.img").exists());
    let file = store.page_cache_file(id).expect("its file");
    let mut got = vec![0u8; 8192];
    std::os::unix::fs::FileExt::read_exact_at(file.as_ref(), &mut got, 0).unwrap();
    assert_eq!(
        got,
        pattern(1, 8192),
        "the merged blocks are in the one layer"
    );
    assert_eq!(read(ch.as_mut(), 8192, 4096), pattern(2, 4096));
}

#[test]
fn a_stopped_merge_leaves_the_snapshot_and_can_run_again() {
    let size: u64 = 64 << 20;
    let chain = memory_chain(size);
    let mut ch = chain.open_channel().expect("channel");
    let data = pattern(3, 1 << 20);
    for i in 0..64 {
        write(ch.as_mut(), i << 20, &data);
    }
    chain.snapshot("s1").expect("snapshot");
    write(ch.as_mut(), 0, &pattern(4, 4096));
    assert!(!chain.stop_merge(), "no merge runs");
    chain.delete_snapshot("s1").expect("delete");
    let stopped = chain.stop_merge();
    let names: Vec<String> = chain.snapshots().into_iter().map(|s| s.name).collect();
    if stopped {
        assert_eq!(names, ["s1"], "a stopped merge leaves its snapshot");
        assert!(chain.snapshots()[0].merging.is_none(), "and merges no more");
    }
    assert_eq!(read(ch.as_mut(), 0, 4096), pattern(4, 4096));
    assert_eq!(read(ch.as_mut(), 32 << 20, 4096), data[..4096].to_vec());
    if stopped {
        chain.delete_snapshot("s1").expect("delete again");
        chain.wait_merge().expect("merge");
    }
    assert!(chain.snapshots().is_empty());
    assert_eq!(read(ch.as_mut(), 63 << 20, 4096), data[..4096].to_vec());
}

/// A first snapshot takes a one-layer file chain's map as its writes
/// kept it (made at open, a bit per write since): every block written
/// before or while it is taken must be found afterwards. A fragmented
/// head (every other block written before the chain's writer starts)
/// and a writer filling the gaps meanwhile; every acknowledged write then
/// reads back through the live volume, and the snapshot holds what was
/// written before it began.
#[test]
fn writes_during_a_first_snapshots_scan_are_kept() {
    let dir = TempDir::new("first-scan");
    let blocks = 4096u64;
    let size = blocks * CHAIN_BLOCK_BYTES;
    let chain = Arc::new(ChainDev::open(file_store(&dir), size).unwrap());
    let block_of = |b: u64| pattern((b % 251) as u8 + 1, CHAIN_BLOCK_BYTES as usize);
    {
        let mut ch = chain.open_channel().unwrap();
        for b in (0..blocks).step_by(2) {
            write(ch.as_mut(), b * CHAIN_BLOCK_BYTES, &block_of(b));
        }
    }
    // The writer fills the gaps over and over (the same bytes each
    // pass) until told to stop, so it writes before, while and after the
    // snapshot is taken however fast the machine is.
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (chain, done, stop) = (chain.clone(), done.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut ch = chain.open_channel().unwrap();
            while !stop.load(Ordering::SeqCst) {
                for b in (1..blocks).step_by(2) {
                    write(ch.as_mut(), b * CHAIN_BLOCK_BYTES, &block_of(b));
                    done.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
    };
    // The first 32 gaps (blocks below 64) are written before it.
    while done.load(Ordering::SeqCst) < 32 {
        std::thread::yield_now();
    }
    chain.snapshot("s1").unwrap();
    let at_snapshot = done.load(Ordering::SeqCst);
    while done.load(Ordering::SeqCst) < at_snapshot + 64 {
        std::thread::yield_now();
    }
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    let mut ch = chain.open_channel().unwrap();
    for b in 0..blocks {
        assert!(
            read(
                ch.as_mut(),
                b * CHAIN_BLOCK_BYTES,
                CHAIN_BLOCK_BYTES as usize
            ) == block_of(b),
            "block {b} lost (the snapshot was taken after {at_snapshot} writes)"
        );
    }
    // The snapshot holds at least what was acknowledged before it began.
    let mut v = chain.snapshot_view("s1").unwrap().open_channel().unwrap();
    for b in (0..blocks).filter(|b| b % 2 == 0 || *b < 64) {
        assert!(
            read(
                v.as_mut(),
                b * CHAIN_BLOCK_BYTES,
                CHAIN_BLOCK_BYTES as usize
            ) == block_of(b),
            "block {b} missing from the snapshot"
        );
    }
}

/// A chain with snapshots grows: the new range reads as zeros from the
/// live volume and from every snapshot, takes writes, survives a merge of
/// an older snapshot into a newer one, and the chain reopens at the new
/// size with everything in place.
#[test]
fn a_chain_with_snapshots_grows_and_reopens_at_its_new_size() {
    let dir = TempDir::new("grow");
    let big = 2 * SIZE;
    let a = pattern(3, 64 << 10);
    let b = pattern(50, 16 << 10);
    {
        let chain = ChainDev::open(file_store(&dir), SIZE).expect("chain");
        let mut ch = chain.open_channel().expect("channel");
        write(ch.as_mut(), 0, &a);
        chain.snapshot("s1").expect("snapshot");
        assert!(matches!(
            chain.grow(SIZE - 4096),
            Err(BdevError::Shrink { .. })
        ));
        assert!(matches!(
            chain.grow(SIZE + 512),
            Err(BdevError::ResizeUnaligned { .. })
        ));
        chain.grow(big).expect("grow with a snapshot");
        chain.grow(big).expect("the same size again does nothing");
        assert_eq!(chain.size_bytes(), big);
        assert_eq!(read(ch.as_mut(), SIZE, 8192), vec![0; 8192]);
        assert_eq!(read(ch.as_mut(), 0, 64 << 10), a, "old data kept");
        write(ch.as_mut(), big - (16 << 10), &b);
        // Across the old end, unaligned: a copy-up of nothing below.
        write(ch.as_mut(), SIZE - 1024, &[0x5A; 2048]);
        let mut v = chain.snapshot_view("s1").unwrap().open_channel().unwrap();
        assert_eq!(
            read(v.as_mut(), SIZE, 4096),
            vec![0; 4096],
            "s1 reads zeros past its old end"
        );
        assert_eq!(read(v.as_mut(), 0, 64 << 10), a);
        drop(v);
        chain.snapshot("s2").expect("snapshot after the grow");
        chain.delete_snapshot("s1").expect("delete s1");
        chain.wait_merge().expect("merge s1 into s2");
        assert_eq!(chain.snapshot_names(), ["s2"]);
        assert_eq!(read(ch.as_mut(), big - (16 << 10), 16 << 10), b);
    }
    let chain = ChainDev::open(file_store(&dir), big).expect("reopen at the new size");
    let mut ch = chain.open_channel().expect("channel");
    assert_eq!(read(ch.as_mut(), 0, 64 << 10), a);
    assert_eq!(read(ch.as_mut(), SIZE - 1024, 2048), vec![0x5A; 2048]);
    assert_eq!(read(ch.as_mut(), big - (16 << 10), 16 << 10), b);
    assert_eq!(read(ch.as_mut(), SIZE + 4096, 4096), vec![0; 4096]);
    let mut v = chain.snapshot_view("s2").unwrap().open_channel().unwrap();
    assert_eq!(read(v.as_mut(), big - (16 << 10), 16 << 10), b);
    // A clone standing on this chain keeps its size.
    let clone_dir = TempDir::new("grow-clone");
    let clone = chain
        .clone_snapshot("s2", "c", file_store(&clone_dir))
        .expect("clone");
    assert!(matches!(
        clone.grow(2 * big),
        Err(BdevError::Unsupported(_))
    ));
}
