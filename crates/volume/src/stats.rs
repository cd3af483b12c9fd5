//! Per-volume I/O counters and a latency histogram, updated by every
//! connection of the volume and readable from anywhere (RPC, metrics).

use std::sync::atomic::{AtomicU64, Ordering};

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

impl VolumeStats {
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
