//! A token bucket refilled from the caller's clock: the rate limits of a
//! volume's QoS (`lull_volume`) and of a replicated volume's rebuild
//! (`lull_engine`). No timer and no thread: the bucket is refilled when
//! it is looked at, and says when it will hold a token again.
//!
//! ```
//! use lull_reactor::rate::TokenBucket;
//! let mut b = TokenBucket::new(1_000, 1_000_000); // 1,000/s, 1 ms of burst
//! assert!(b.take(1.0, 0));
//! assert!(!b.take(1.0, 0), "the burst of one is spent");
//! // Any positive balance lets the next one go: a few ns here.
//! assert!(b.wait_ns(0) > 0);
//! assert!(b.take(5.0, 10), "into debt by one request");
//! let w = b.wait_ns(10);
//! assert!((4_990_000..=5_000_001).contains(&w), "about 5 ms of debt: {w}");
//! ```

/// Tokens per second, saving at most `burst_ns` of them; a take may put
/// the bucket into debt by one (a request larger than the burst goes, and
/// the next waits the debt out instead of never fitting). A rate of 0 is
/// no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TokenBucket {
    rate: u64,
    cap: f64,
    tokens: f64,
    last_ns: u64,
}

impl TokenBucket {
    /// A full bucket of `rate` tokens per second saving `burst_ns` of them.
    pub fn new(rate: u64, burst_ns: u64) -> TokenBucket {
        TokenBucket::with_cap(rate, rate as f64 * burst_ns as f64 / 1e9)
    }

    /// A full bucket saving at most `cap` tokens.
    pub fn with_cap(rate: u64, cap: f64) -> TokenBucket {
        TokenBucket {
            rate,
            cap,
            tokens: cap,
            last_ns: 0,
        }
    }

    /// Starts counting time at `now_ns` (a bucket made before the clock's
    /// first reading).
    pub fn starting_at(mut self, now_ns: u64) -> TokenBucket {
        self.last_ns = now_ns;
        self
    }

    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// Adds what `now_ns` brings since the last look.
    pub fn refill(&mut self, now_ns: u64) {
        let elapsed = now_ns.saturating_sub(self.last_ns);
        self.last_ns = self.last_ns.max(now_ns);
        if self.rate > 0 {
            self.tokens = (self.tokens + self.rate as f64 * elapsed as f64 / 1e9).min(self.cap);
        }
    }

    /// Nanoseconds after `now_ns` (refilled first) until the bucket holds
    /// a token; 0 when it does now (or has no limit).
    pub fn wait_ns(&mut self, now_ns: u64) -> u64 {
        self.refill(now_ns);
        if self.rate == 0 || self.tokens > 0.0 {
            0
        } else {
            ((-self.tokens + 1e-6) * 1e9 / self.rate as f64).ceil() as u64 + 1
        }
    }

    /// Spends `n` tokens, into debt if need be (call after `wait_ns` said 0
    /// for every bucket a request takes from).
    pub fn spend(&mut self, n: f64) {
        if self.rate > 0 {
            self.tokens -= n;
        }
    }

    /// Takes `n` tokens if the bucket holds any at `now_ns`.
    pub fn take(&mut self, n: f64, now_ns: u64) -> bool {
        if self.wait_ns(now_ns) > 0 {
            return false;
        }
        self.spend(n);
        true
    }
}
