//! Per-volume QoS: token buckets over every connection of a volume
//! (SPDK's `bdev_set_qos_limit`, with its four limits and their names).
//!
//! One bucket per limit, refilled from the clock when looked at (no
//! timer, no thread): a request takes one I/O token and its bytes from
//! the byte buckets it counts against. A bucket may go into debt by one
//! request (a 32 MiB read under a 1 MB/s limit waits for the debt to be
//! paid before the next request, instead of never fitting), and keeps at
//! most [`QOS_BURST_NS`] of its rate in store. A request that finds a
//! bucket empty is handed back (`Full`) with the time the bucket refills:
//! the frontend holds it and its poller is woken then; nothing fails.
//!
//! Reads and writes count; flush, trim, zeroes and block status do not
//! (they move no data, and a throttled flush would hold durability).
//! The buckets are shared by the volume's channels on every reactor, so
//! a take locks a mutex: only for a volume with a limit set. A volume
//! without one pays one relaxed load per request.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use lull_bdev::IoOp;
use lull_reactor::rate::TokenBucket;

/// The longest a bucket saves up: 10 ms of its rate. A limit holds over
/// any window from 10 ms up; an idle volume cannot burst past it.
pub const QOS_BURST_NS: u64 = 10_000_000;

/// Largest limit taken: 10 M I/O per second, 1 TB/s (far above what one
/// volume moves; a mistake past it).
pub const QOS_MAX_IOS_PER_SEC: u64 = 10_000_000;
pub const QOS_MAX_MBYTES_PER_SEC: u64 = 1_000_000;

/// A volume's limits, SPDK's names; 0 is unlimited. MB are 10^6 bytes
/// as in SPDK (`rw_mbytes_per_sec`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct QosLimits {
    #[serde(default)]
    pub rw_ios_per_sec: u64,
    #[serde(default)]
    pub rw_mbytes_per_sec: u64,
    #[serde(default)]
    pub r_mbytes_per_sec: u64,
    #[serde(default)]
    pub w_mbytes_per_sec: u64,
}

impl QosLimits {
    pub fn is_unlimited(&self) -> bool {
        *self == QosLimits::default()
    }

    /// Each limit within its bound.
    pub fn check(&self) -> Result<(), String> {
        if self.rw_ios_per_sec > QOS_MAX_IOS_PER_SEC {
            return Err(format!("rw_ios_per_sec: at most {QOS_MAX_IOS_PER_SEC}"));
        }
        for (name, v) in [
            ("rw_mbytes_per_sec", self.rw_mbytes_per_sec),
            ("r_mbytes_per_sec", self.r_mbytes_per_sec),
            ("w_mbytes_per_sec", self.w_mbytes_per_sec),
        ] {
            if v > QOS_MAX_MBYTES_PER_SEC {
                return Err(format!("{name}: at most {QOS_MAX_MBYTES_PER_SEC}"));
            }
        }
        Ok(())
    }
}

/// One bucket per limit (`TokenBucket`: I/Os or bytes per second).
#[derive(Debug, Default)]
struct Buckets {
    ios: TokenBucket,
    rw_bytes: TokenBucket,
    r_bytes: TokenBucket,
    w_bytes: TokenBucket,
}

/// A volume's QoS state, shared by its channels.
#[derive(Debug, Default)]
pub struct Qos {
    limited: AtomicBool,
    limits: Mutex<QosLimits>,
    buckets: Mutex<Buckets>,
    /// Requests handed back at least once for the limit, and the time
    /// they waited in all (ns).
    throttled: AtomicU64,
    throttled_ns: AtomicU64,
}

impl Qos {
    /// Sets the limits (0: unlimited), effective for the next request.
    pub fn set(&self, limits: QosLimits, now_ns: u64) {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner()) = limits;
        let mb = 1_000_000;
        let bucket = |rate: u64| TokenBucket::new(rate, QOS_BURST_NS).starting_at(now_ns);
        *self.buckets.lock().unwrap_or_else(|p| p.into_inner()) = Buckets {
            ios: bucket(limits.rw_ios_per_sec),
            rw_bytes: bucket(limits.rw_mbytes_per_sec * mb),
            r_bytes: bucket(limits.r_mbytes_per_sec * mb),
            w_bytes: bucket(limits.w_mbytes_per_sec * mb),
        };
        self.limited
            .store(!limits.is_unlimited(), Ordering::Release);
    }

    pub fn limits(&self) -> QosLimits {
        *self.limits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a limit is set (the one load a request pays without).
    pub fn limited(&self) -> bool {
        self.limited.load(Ordering::Relaxed)
    }

    /// Takes a request's tokens: `Ok` when it may go now, `Err(at)` with
    /// the time it may.
    pub fn take(&self, op: IoOp, len: u32, now_ns: u64) -> Result<(), u64> {
        let (read, write) = match op {
            IoOp::Read => (true, false),
            IoOp::Write { .. } => (false, true),
            _ => return Ok(()),
        };
        let mut guard = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let b = &mut *guard;
        let mut wait = b.ios.wait_ns(now_ns).max(b.rw_bytes.wait_ns(now_ns));
        if read {
            wait = wait.max(b.r_bytes.wait_ns(now_ns));
        }
        if write {
            wait = wait.max(b.w_bytes.wait_ns(now_ns));
        }
        if wait > 0 {
            return Err(now_ns + wait);
        }
        let bytes = f64::from(len);
        b.ios.spend(1.0);
        b.rw_bytes.spend(bytes);
        if read {
            b.r_bytes.spend(bytes);
        }
        if write {
            b.w_bytes.spend(bytes);
        }
        Ok(())
    }

    /// A request that was held waited `ns` before it went.
    pub(crate) fn note_wait(&self, ns: u64) {
        self.throttled.fetch_add(1, Ordering::Relaxed);
        self.throttled_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Requests held by the limit so far, and their summed wait (ns).
    pub fn throttled(&self) -> (u64, u64) {
        (
            self.throttled.load(Ordering::Relaxed),
            self.throttled_ns.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const READ: IoOp = IoOp::Read;

    /// Requests admitted over `secs` seconds when each is retried at the
    /// time it is told.
    fn admitted(q: &Qos, op: IoOp, len: u32, secs: u64) -> u64 {
        let (mut now, end, mut n) = (0u64, secs * 1_000_000_000, 0);
        while now < end {
            match q.take(op, len, now) {
                Ok(()) => n += 1,
                Err(at) => {
                    assert!(at > now, "a retry time in the future");
                    now = at;
                }
            }
        }
        n
    }

    #[test]
    fn an_iops_limit_admits_its_rate() {
        let q = Qos::default();
        q.set(
            QosLimits {
                rw_ios_per_sec: 2_000,
                ..QosLimits::default()
            },
            0,
        );
        let n = admitted(&q, READ, 4096, 10);
        // The rate and the 10 ms of burst it starts with.
        assert!((20_000..=20_021).contains(&n), "{n}");
        assert_eq!(q.take(IoOp::Flush, 0, 0), Ok(()), "flush is not counted");
    }

    #[test]
    fn byte_limits_apply_to_their_direction_and_large_requests_wait_out_their_debt() {
        let q = Qos::default();
        q.set(
            QosLimits {
                r_mbytes_per_sec: 1,
                ..QosLimits::default()
            },
            0,
        );
        // 1 MB/s of 32 MiB reads: one goes (debt), the next waits ~33 s.
        assert_eq!(q.take(READ, 32 << 20, 0), Ok(()));
        let at = q.take(READ, 32 << 20, 0).expect_err("in debt");
        assert!((33_000_000_000..34_000_000_000).contains(&at), "{at}");
        assert_eq!(
            q.take(IoOp::Write { fua: false }, 1 << 20, 0),
            Ok(()),
            "writes are not limited"
        );
        q.set(q.limits(), 0);
        let n = admitted(&q, READ, 100_000, 10) as f64 * 0.1;
        assert!((9.0..=10.6).contains(&n), "about 10 MB in 10 s: {n}");
        q.set(QosLimits::default(), 0);
        assert!(!q.limited());
    }

    #[test]
    fn limits_are_bounded() {
        assert!(QosLimits {
            rw_ios_per_sec: QOS_MAX_IOS_PER_SEC + 1,
            ..QosLimits::default()
        }
        .check()
        .is_err());
        assert!(QosLimits::default().check().is_ok());
    }
}
