//! Per-volume I/O counters and a latency histogram, updated by every
//! connection of the volume and readable from anywhere (RPC, metrics).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Histogram buckets: request latency ≤ 1 µs · 2^i, i in 0..LATENCY_BUCKETS
/// (1 µs to ~4.2 s), plus one for everything slower. Powers of two keep the
/// bucket choice a leading-zeros count.
pub const LATENCY_BUCKETS: usize = 23;

/// Upper bound (inclusive) of bucket `i`, in ns.
pub fn bucket_le_ns(i: usize) -> u64 {
    1_000u64 << i
}

fn bucket_of(latency_ns: u64) -> usize {
    // Smallest i with latency_ns ≤ 1000 · 2^i.
    let units = latency_ns.div_ceil(1_000).max(1);
    let i = (64 - (units - 1).leading_zeros()) as usize;
    i.min(LATENCY_BUCKETS)
}

/// What a request was, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Write,
    Flush,
    Trim,
    WriteZeroes,
}

/// Counters of one volume.
#[derive(Debug, Default)]
pub struct VolumeStats {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    trims: AtomicU64,
    write_zeroes: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    errors: AtomicU64,
    latency_sum_ns: AtomicU64,
    latency_max_ns: AtomicU64,
    buckets: [AtomicU64; LATENCY_BUCKETS + 1],
    /// Reads whose data went from the device's socket to the client's
    /// with `splice`, never copied into memory (a replicated volume).
    spliced_reads: AtomicU64,
    /// Reads whose data was sent from the device's memory, lent, never
    /// copied into a buffer (a memory volume; docs/PER_IO.md, "Lent reads").
    lent_reads: AtomicU64,
    /// Reads whose data went from the device's file to the client's
    /// socket with `sendfile`, never copied into a buffer (a file volume
    /// on a memory filesystem; docs/PER_IO.md, "File reads by sendfile").
    sendfile_reads: AtomicU64,
}

/// A snapshot of [`VolumeStats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeStatsSnapshot {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub trims: u64,
    pub write_zeroes: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    pub latency_sum_ns: u64,
    pub latency_max_ns: u64,
    /// Per-bucket counts (not cumulative); the last is the overflow bucket.
    pub buckets: Vec<u64>,
    pub spliced_reads: u64,
    pub lent_reads: u64,
    pub sendfile_reads: u64,
}

impl VolumeStatsSnapshot {
    pub fn ops(&self) -> u64 {
        self.reads + self.writes + self.flushes + self.trims + self.write_zeroes
    }

    pub fn latency_mean_ns(&self) -> u64 {
        self.latency_sum_ns.checked_div(self.ops()).unwrap_or(0)
    }

    /// The upper bound of the bucket holding quantile `q` (0..=1).
    pub fn latency_quantile_le_ns(&self, q: f64) -> u64 {
        let total: u64 = self.buckets.iter().sum();
        if total == 0 {
            return 0;
        }
        let rank = ((total as f64) * q.clamp(0.0, 1.0)).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return if i < LATENCY_BUCKETS {
                    bucket_le_ns(i)
                } else {
                    self.latency_max_ns
                };
            }
        }
        self.latency_max_ns
    }
}

/// Counts of finished requests not yet added to a volume's
/// [`VolumeStats`] ([`VolumeStats::add`]): a connection counts its
/// requests in its thread's batch ([`VolumeStats::record_batched`]) and
/// adds the batch once per round ([`add_batched`]) instead of making one
/// atomic add per counter per request. At a QD32 host's ~20 requests a
/// round, the five to seven locked adds a request cost (about 25 ns of a
/// 4 KiB read's 1.6 µs on the benchmark machine) become as many per
/// round. A connection adds the batch before it writes the replies of the
/// requests it counts (its `advance` runs before every write of its
/// socket), so a client that got a reply finds its request counted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StatsBatch {
    reads: u64,
    writes: u64,
    flushes: u64,
    trims: u64,
    write_zeroes: u64,
    read_bytes: u64,
    write_bytes: u64,
    errors: u64,
    latency_sum_ns: u64,
    latency_max_ns: u64,
    buckets: [u64; LATENCY_BUCKETS + 1],
    spliced_reads: u64,
    lent_reads: u64,
    sendfile_reads: u64,
}

impl StatsBatch {
    /// Count one finished request (as [`VolumeStats::record`]).
    pub fn record(&mut self, op: OpKind, bytes: u64, latency_ns: u64, ok: bool) {
        match op {
            OpKind::Read => {
                self.reads += 1;
                if ok {
                    self.read_bytes += bytes;
                }
            }
            OpKind::Write => {
                self.writes += 1;
                if ok {
                    self.write_bytes += bytes;
                }
            }
            OpKind::Flush => self.flushes += 1,
            OpKind::Trim => self.trims += 1,
            OpKind::WriteZeroes => self.write_zeroes += 1,
        }
        if !ok {
            self.errors += 1;
        }
        self.latency_sum_ns = self.latency_sum_ns.saturating_add(latency_ns);
        self.latency_max_ns = self.latency_max_ns.max(latency_ns);
        self.buckets[bucket_of(latency_ns)] += 1;
    }

    /// A read was answered from a pipe (see `spliced_reads`).
    pub fn spliced_read(&mut self) {
        self.spliced_reads += 1;
    }

    /// A read was answered from lent device memory (see `lent_reads`).
    pub fn lent_read(&mut self) {
        self.lent_reads += 1;
    }

    /// A read was answered from a file with `sendfile` (see
    /// `sendfile_reads`).
    pub fn sendfile_read(&mut self) {
        self.sendfile_reads += 1;
    }

    /// Nothing counted since the last [`VolumeStats::add`].
    pub fn is_empty(&self) -> bool {
        *self == StatsBatch::default()
    }
}

thread_local! {
    /// This thread's batch and the counters it goes to: one volume's at a
    /// time (a connection adds its batch at the end of each round, so the
    /// next connection on the thread finds it empty; one that finds
    /// another volume's batch adds that one first). Memory: one batch per
    /// thread, none per connection.
    static BATCH: RefCell<Option<(Arc<VolumeStats>, StatsBatch)>> = const { RefCell::new(None) };
}

/// Add this thread's batch ([`VolumeStats::record_batched`]) to its
/// volume's counters. Cheap when there is none.
pub fn add_batched() {
    BATCH.with_borrow_mut(|b| {
        if let Some((stats, mut batch)) = b.take() {
            stats.add(&mut batch);
        }
    });
}

/// Run `f` on this thread's batch for `stats` (adding another volume's
/// batch first).
fn with_batch(stats: &Arc<VolumeStats>, f: impl FnOnce(&mut StatsBatch)) {
    BATCH.with_borrow_mut(|b| match b {
        Some((s, batch)) if Arc::ptr_eq(s, stats) => f(batch),
        _ => {
            if let Some((s, mut batch)) = b.take() {
                s.add(&mut batch);
            }
            let mut batch = StatsBatch::default();
            f(&mut batch);
            *b = Some((stats.clone(), batch));
        }
    });
}

impl VolumeStats {
    /// [`VolumeStats::record`] into this thread's batch, added to the
    /// counters by the next [`add_batched`] on this thread.
    pub fn record_batched(self: &Arc<Self>, op: OpKind, bytes: u64, latency_ns: u64, ok: bool) {
        with_batch(self, |b| b.record(op, bytes, latency_ns, ok));
    }

    /// [`VolumeStats::spliced_read`] into this thread's batch.
    pub fn spliced_read_batched(self: &Arc<Self>) {
        with_batch(self, StatsBatch::spliced_read);
    }

    /// [`VolumeStats::lent_read`] into this thread's batch.
    pub fn lent_read_batched(self: &Arc<Self>) {
        with_batch(self, StatsBatch::lent_read);
    }

    /// [`VolumeStats::sendfile_read`] into this thread's batch.
    pub fn sendfile_read_batched(self: &Arc<Self>) {
        with_batch(self, StatsBatch::sendfile_read);
    }

    /// Count one finished request.
    pub fn record(&self, op: OpKind, bytes: u64, latency_ns: u64, ok: bool) {
        let r = Ordering::Relaxed;
        match op {
            OpKind::Read => {
                self.reads.fetch_add(1, r);
                if ok {
                    self.read_bytes.fetch_add(bytes, r);
                }
            }
            OpKind::Write => {
                self.writes.fetch_add(1, r);
                if ok {
                    self.write_bytes.fetch_add(bytes, r);
                }
            }
            OpKind::Flush => {
                self.flushes.fetch_add(1, r);
            }
            OpKind::Trim => {
                self.trims.fetch_add(1, r);
            }
            OpKind::WriteZeroes => {
                self.write_zeroes.fetch_add(1, r);
            }
        }
        if !ok {
            self.errors.fetch_add(1, r);
        }
        self.latency_sum_ns.fetch_add(latency_ns, r);
        self.latency_max_ns.fetch_max(latency_ns, r);
        self.buckets[bucket_of(latency_ns)].fetch_add(1, r);
    }

    pub fn snapshot(&self) -> VolumeStatsSnapshot {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        VolumeStatsSnapshot {
            reads: g(&self.reads),
            writes: g(&self.writes),
            flushes: g(&self.flushes),
            trims: g(&self.trims),
            write_zeroes: g(&self.write_zeroes),
            read_bytes: g(&self.read_bytes),
            write_bytes: g(&self.write_bytes),
            errors: g(&self.errors),
            latency_sum_ns: g(&self.latency_sum_ns),
            latency_max_ns: g(&self.latency_max_ns),
            buckets: self.buckets.iter().map(g).collect(),
            spliced_reads: g(&self.spliced_reads),
            lent_reads: g(&self.lent_reads),
            sendfile_reads: g(&self.sendfile_reads),
        }
    }

    /// Add a connection's batch of counts, and empty it.
    pub fn add(&self, batch: &mut StatsBatch) {
        if batch.is_empty() {
            return;
        }
        let r = Ordering::Relaxed;
        let add = |a: &AtomicU64, n: u64| {
            if n != 0 {
                a.fetch_add(n, r);
            }
        };
        add(&self.reads, batch.reads);
        add(&self.writes, batch.writes);
        add(&self.flushes, batch.flushes);
        add(&self.trims, batch.trims);
        add(&self.write_zeroes, batch.write_zeroes);
        add(&self.read_bytes, batch.read_bytes);
        add(&self.write_bytes, batch.write_bytes);
        add(&self.errors, batch.errors);
        add(&self.latency_sum_ns, batch.latency_sum_ns);
        if batch.latency_max_ns != 0 {
            self.latency_max_ns.fetch_max(batch.latency_max_ns, r);
        }
        for (a, n) in self.buckets.iter().zip(batch.buckets) {
            add(a, n);
        }
        add(&self.spliced_reads, batch.spliced_reads);
        add(&self.lent_reads, batch.lent_reads);
        add(&self.sendfile_reads, batch.sendfile_reads);
        *batch = StatsBatch::default();
    }

    /// A read was answered from a pipe (see `spliced_reads`).
    pub fn spliced_read(&self) {
        self.spliced_reads.fetch_add(1, Ordering::Relaxed);
    }

    /// A read was answered from lent device memory (see `lent_reads`).
    pub fn lent_read(&self) {
        self.lent_reads.fetch_add(1, Ordering::Relaxed);
    }

    /// A read was answered from a file range with `sendfile` (see
    /// `sendfile_reads`).
    pub fn sendfile_read(&self) {
        self.sendfile_reads.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch added to the volume's counters gives the same snapshot as
    /// recording each request directly, and is empty afterwards.
    #[test]
    fn a_batch_adds_up_to_the_same_counts() {
        let direct = VolumeStats::default();
        let batched = VolumeStats::default();
        let mut batch = StatsBatch::default();
        let ops = [
            (OpKind::Read, 4096, 10_000, true),
            (OpKind::Write, 8192, 30_000, true),
            (OpKind::Write, 8192, 5_000_000, false),
            (OpKind::Flush, 0, 100_000, true),
            (OpKind::Trim, 1 << 20, 2_000, true),
            (OpKind::WriteZeroes, 65536, 900, false),
            (OpKind::Read, 131072, 70_000, true),
        ];
        for (i, (op, bytes, ns, ok)) in ops.into_iter().enumerate() {
            direct.record(op, bytes, ns, ok);
            batch.record(op, bytes, ns, ok);
            if i == 3 {
                batched.add(&mut batch);
                assert!(batch.is_empty());
            }
        }
        direct.lent_read();
        direct.spliced_read();
        direct.spliced_read();
        direct.sendfile_read();
        batch.lent_read();
        batch.spliced_read();
        batch.spliced_read();
        batch.sendfile_read();
        batched.add(&mut batch);
        assert!(batch.is_empty());
        batched.add(&mut batch);
        assert_eq!(batched.snapshot(), direct.snapshot());
        assert_eq!(direct.snapshot().ops(), 7);
    }

    /// The thread's batch reaches each volume's counters at
    /// `add_batched`, or when a request of another volume is counted on
    /// the thread first; nothing is counted twice or lost.
    #[test]
    fn the_thread_batch_goes_to_its_own_volume() {
        let a = Arc::new(VolumeStats::default());
        let b = Arc::new(VolumeStats::default());
        a.record_batched(OpKind::Read, 4096, 1_000, true);
        a.lent_read_batched();
        assert_eq!(a.snapshot().reads, 0, "batched, not added yet");
        b.record_batched(OpKind::Write, 512, 3_000, true);
        assert_eq!(
            (a.snapshot().reads, a.snapshot().lent_reads),
            (1, 1),
            "added when b's came"
        );
        b.spliced_read_batched();
        add_batched();
        add_batched();
        let sb = b.snapshot();
        assert_eq!(
            (sb.writes, sb.write_bytes, sb.spliced_reads, sb.reads),
            (1, 512, 1, 0)
        );
        assert_eq!(a.snapshot().ops(), 1);
    }

    #[test]
    fn buckets_are_powers_of_two_microseconds() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1_000), 0);
        assert_eq!(bucket_of(1_001), 1);
        assert_eq!(bucket_of(2_000), 1);
        assert_eq!(bucket_of(3_000), 2);
        assert_eq!(bucket_of(1_000 << 22), 22);
        assert_eq!(bucket_of(u64::MAX), LATENCY_BUCKETS);
        for i in 0..LATENCY_BUCKETS {
            assert_eq!(bucket_of(bucket_le_ns(i)), i);
            assert_eq!(bucket_of(bucket_le_ns(i) + 1), i + 1);
        }
    }

    #[test]
    fn record_and_summarise() {
        let s = VolumeStats::default();
        s.record(OpKind::Read, 4096, 10_000, true);
        s.record(OpKind::Write, 8192, 30_000, true);
        s.record(OpKind::Write, 8192, 5_000_000, false);
        s.record(OpKind::Flush, 0, 100_000, true);
        let snap = s.snapshot();
        assert_eq!(
            (snap.reads, snap.writes, snap.flushes, snap.errors),
            (1, 2, 1, 1)
        );
        assert_eq!((snap.read_bytes, snap.write_bytes), (4096, 8192));
        assert_eq!(snap.ops(), 4);
        assert_eq!(
            snap.latency_mean_ns(),
            (10_000 + 30_000 + 5_000_000 + 100_000) / 4
        );
        assert_eq!(snap.latency_quantile_le_ns(0.25), 16_000);
        assert_eq!(snap.latency_quantile_le_ns(0.5), 32_000);
        assert_eq!(snap.latency_quantile_le_ns(1.0), bucket_le_ns(13));
        assert_eq!(snap.latency_max_ns, 5_000_000);
    }
}
