//! `FaultyDev`: a fault-injecting wrapper around another device, for tests
//! and for operators rehearsing failures (`--volume
//! NAME:SIZE:faulty=malloc,read_err=0.01,delay_us=500`).
//!
//! Each request fails with EIO with the probability its kind is given
//! (reads `read_err`; writes, trims and write-zeroes `write_err`; flushes
//! `flush_err`) instead of reaching the inner device, and every completion,
//! failed or not, is held back `delay_us` before the channel hands it out.
//! The delay is a timer, never a sleep: the channel's [`Channel::event_fd`]
//! becomes readable when the earliest held completion is due, so a reactor
//! waiting on it wakes then. The random draws come from a seeded generator
//! (each channel draws from `seed` plus its channel number), so a run can be
//! repeated.
//!
//! ```
//! use std::sync::Arc;
//! use lull_bdev::{BlockDevice, BufPool, FaultyDev, Faults, IoOp, IoRequest, MallocDev, Probability};
//! let faults = Faults { write_err: Probability::new(1.0)?, seed: 7, ..Faults::default() };
//! let dev = FaultyDev::new(Arc::new(MallocDev::new(1 << 20)?), faults);
//! let mut ch = dev.open_channel()?;
//! let mut pool = BufPool::new(1 << 20);
//! ch.submit(IoRequest { tag: 1, op: IoOp::Write { fua: false }, offset: 0, len: 512, buf: Some(pool.get(512)) })
//!     .map_err(|(_req, e)| e)?;
//! let mut failed = Vec::new();
//! ch.reap(&mut |c| failed.push(c.result.map_err(|e| e.errno())));
//! assert_eq!(failed, vec![Err(libc::EIO)]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use lull_reactor::sys::{Epoll, TimerFd};
use lull_reactor::{Clock, Interest, MonotonicClock};

use crate::{BdevError, BlockDevice, Channel, Extent, IoCompletion, IoOp, IoRequest};

/// Longest injected delay: 10 s. Long enough to trip any timeout a test or
/// rehearsal wants to trip (the engine's replica timeout defaults to 8 s),
/// short enough that a typo does not freeze a volume for hours.
pub const MAX_FAULT_DELAY_US: u64 = 10_000_000;

/// Completions a faulty channel holds back (delayed or injected failures)
/// before `submit` says `Full`: well above what one frontend connection
/// keeps in flight (128 NBD requests), so only a runaway caller meets it.
pub const FAULTY_MAX_HELD: usize = 4096;

/// A probability in `[0, 1]`: valid by construction, never NaN.
#[derive(Debug, Clone, Copy, Default, PartialEq, PartialOrd)]
pub struct Probability(f64);

// Never NaN (checked in `new`), so equality is reflexive.
impl Eq for Probability {}

impl Probability {
    pub const NEVER: Probability = Probability(0.0);

    pub fn new(p: f64) -> Result<Probability, String> {
        if (0.0..=1.0).contains(&p) {
            Ok(Probability(p))
        } else {
            Err(format!("probability {p} is outside 0..1"))
        }
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

impl std::str::FromStr for Probability {
    type Err = String;
    fn from_str(s: &str) -> Result<Probability, String> {
        let p: f64 = s
            .parse()
            .map_err(|_| format!("{s:?} is not a probability (a number from 0 to 1)"))?;
        Probability::new(p)
    }
}

/// What a [`FaultyDev`] injects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    pub read_err: Probability,
    pub write_err: Probability,
    pub flush_err: Probability,
    /// Every completion is held back this long (at most [`MAX_FAULT_DELAY_US`]).
    pub delay_us: u64,
    /// The generator's seed; channel `n` draws from `seed + n`.
    pub seed: u64,
}

/// A small seeded generator (SplitMix64): statistically fine for fault
/// draws, and the same seed gives the same faults on every machine.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: Probability) -> bool {
        // 53 random bits: a uniform double in [0, 1).
        let u = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        u < p.get()
    }
}

/// A device whose channels inject the configured faults.
pub struct FaultyDev {
    inner: Arc<dyn BlockDevice>,
    faults: Faults,
    clock: Arc<dyn Clock>,
    channels_opened: AtomicU64,
}

impl std::fmt::Debug for FaultyDev {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyDev")
            .field("inner", &self.inner.describe())
            .field("faults", &self.faults)
            .finish()
    }
}

impl FaultyDev {
    pub fn new(inner: Arc<dyn BlockDevice>, faults: Faults) -> FaultyDev {
        FaultyDev::with_clock(inner, faults, Arc::new(MonotonicClock))
    }

    /// With the clock that decides when a delayed completion is due (tests
    /// pass a `FakeClock`).
    pub fn with_clock(
        inner: Arc<dyn BlockDevice>,
        faults: Faults,
        clock: Arc<dyn Clock>,
    ) -> FaultyDev {
        let faults = Faults {
            delay_us: faults.delay_us.min(MAX_FAULT_DELAY_US),
            ..faults
        };
        FaultyDev {
            inner,
            faults,
            clock,
            channels_opened: AtomicU64::new(0),
        }
    }

    pub fn faults(&self) -> Faults {
        self.faults
    }
}

impl BlockDevice for FaultyDev {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn grow(&self, size_bytes: u64) -> Result<(), BdevError> {
        self.inner.grow(size_bytes)
    }

    fn describe(&self) -> String {
        let f = &self.faults;
        format!(
            "faulty({}, read_err={}, write_err={}, flush_err={}, delay_us={}, seed={})",
            self.inner.describe(),
            f.read_err.get(),
            f.write_err.get(),
            f.flush_err.get(),
            f.delay_us,
            f.seed
        )
    }

    fn open_channel(&self) -> Result<Box<dyn Channel>, BdevError> {
        let inner = self.inner.open_channel()?;
        let n = self.channels_opened.fetch_add(1, Ordering::Relaxed);
        let timer = TimerFd::new()?;
        let epoll = Epoll::new()?;
        epoll.add(timer.as_raw_fd(), Interest::READABLE, 0)?;
        if let Some(fd) = inner.event_fd() {
            epoll.add(fd, Interest::READABLE, 1)?;
        }
        Ok(Box::new(FaultyChannel {
            inner,
            faults: self.faults,
            rng: SplitMix64::new(self.faults.seed.wrapping_add(n)),
            clock: self.clock.clone(),
            held: VecDeque::new(),
            timer,
            epoll,
            armed_for_ns: None,
        }))
    }

    fn sync(&self) -> Result<(), BdevError> {
        self.inner.sync()
    }

    fn extents(&self, offset: u64, len: u64, max_extents: usize) -> Result<Vec<Extent>, BdevError> {
        self.inner.extents(offset, len, max_extents)
    }

    fn zeroes_fast(&self) -> bool {
        self.inner.zeroes_fast()
    }

    fn prefetch(&self, offset: u64, len: u64) -> Result<(), BdevError> {
        self.inner.prefetch(offset, len)
    }

    fn io_uring_enters(&self) -> Option<u64> {
        self.inner.io_uring_enters()
    }

    fn buffer_ios(&self) -> Option<crate::BufferIos> {
        self.inner.buffer_ios()
    }
}

/// One channel: the inner channel, plus the completions held back until
/// their time. An injected failure is held from its submission, an inner
/// completion from when it is reaped; every one gets the same delay, so
/// `held` stays in due order.
struct FaultyChannel {
    inner: Box<dyn Channel>,
    faults: Faults,
    rng: SplitMix64,
    clock: Arc<dyn Clock>,
    held: VecDeque<(u64, IoCompletion)>,
    timer: TimerFd,
    /// Readable when the inner channel's completions are ready or the timer
    /// fired: the one fd a reactor waits on.
    epoll: Epoll,
    /// The due time the timer is armed for, so it is re-armed only when the
    /// head of `held` changes.
    armed_for_ns: Option<u64>,
}

impl FaultyChannel {
    fn injects(&mut self, op: IoOp) -> bool {
        let p = match op {
            IoOp::Read | IoOp::BlockStatus | IoOp::ChangedSince => self.faults.read_err,
            IoOp::Write { .. } | IoOp::Trim | IoOp::WriteZeroes { .. } => self.faults.write_err,
            IoOp::Flush => self.faults.flush_err,
        };
        self.rng.chance(p)
    }

    fn hold(&mut self, now_ns: u64, c: IoCompletion) {
        self.held
            .push_back((now_ns + self.faults.delay_us * 1000, c));
    }

    /// Arm the timer for the earliest held completion (at least 1 ns ahead,
    /// since 0 would disarm it), so the reactor wakes when it is due.
    fn arm(&mut self, now_ns: u64) {
        let Some(&(due_ns, _)) = self.held.front() else {
            self.armed_for_ns = None;
            return;
        };
        if self.armed_for_ns == Some(due_ns) {
            return;
        }
        if let Err(e) = self.timer.arm(due_ns.saturating_sub(now_ns).max(1)) {
            // Without the timer an event-driven reactor would not wake for
            // these completions; a poll-mode one still would. Say so.
            tracing::error!("faulty device: cannot arm its timer: {e}");
        }
        self.armed_for_ns = Some(due_ns);
    }
}

impl Channel for FaultyChannel {
    fn submit(&mut self, req: IoRequest) -> Result<(), (IoRequest, BdevError)> {
        if self.held.len() >= FAULTY_MAX_HELD {
            return Err((
                req,
                BdevError::Full {
                    capacity: FAULTY_MAX_HELD,
                },
            ));
        }
        if self.injects(req.op) {
            let now_ns = self.clock.now_ns();
            let c = IoCompletion {
                tag: req.tag,
                result: Err(BdevError::Io(std::io::Error::from_raw_os_error(libc::EIO))),
                buf: req.buf,
                data: crate::Data::Buf,
            };
            self.hold(now_ns, c);
            self.arm(now_ns);
            return Ok(());
        }
        self.inner.submit(req)
    }

    fn flush_submissions(&mut self) {
        self.inner.flush_submissions();
    }

    fn reap(&mut self, done: &mut dyn FnMut(IoCompletion)) -> usize {
        let now_ns = self.clock.now_ns();
        self.timer.drain();
        self.armed_for_ns = None;
        let mut from_inner = Vec::new();
        self.inner.reap(&mut |c| from_inner.push(c));
        for c in from_inner {
            self.hold(now_ns, c);
        }
        let mut n = 0;
        while self.held.front().is_some_and(|(due, _)| *due <= now_ns) {
            let (_, c) = self.held.pop_front().expect("front checked");
            done(c);
            n += 1;
        }
        self.arm(now_ns);
        n
    }

    fn event_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held.len()
    }

    /// An IOPOLL inner channel is found only by reaping: the owner keeps
    /// running while it has I/O in flight (the timer still wakes it for
    /// held completions).
    fn polled(&self) -> bool {
        self.inner.polled()
    }

    /// A request the inner channel handed back (a chain quiesced for a
    /// snapshot) is tried again when it says.
    fn retry_at_ns(&self) -> Option<u64> {
        self.inner.retry_at_ns()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BufPool, MallocDev};
    use lull_reactor::FakeClock;

    fn faulty(faults: Faults, clock: Arc<dyn Clock>) -> FaultyDev {
        FaultyDev::with_clock(
            Arc::new(MallocDev::new(1 << 20).expect("malloc")),
            faults,
            clock,
        )
    }

    fn req(tag: u64, op: IoOp, pool: &mut BufPool) -> IoRequest {
        let buf = matches!(op, IoOp::Read | IoOp::Write { .. }).then(|| pool.get(4096));
        IoRequest {
            tag,
            op,
            offset: (tag % 256) * 4096,
            len: 4096,
            buf,
        }
    }

    /// Submits `count` requests of `op` one at a time; returns how many failed
    /// with EIO (and checks nothing else failed or went missing).
    fn failures(ch: &mut Box<dyn Channel>, op: IoOp, count: u64, pool: &mut BufPool) -> u64 {
        let mut eio = 0;
        for tag in 0..count {
            ch.submit(req(tag, op, pool))
                .map_err(|(_r, e)| e)
                .expect("submit");
            ch.flush_submissions();
            let mut got = 0;
            ch.reap(&mut |c| {
                assert_eq!(c.tag, tag);
                match c.result {
                    Ok(()) => {}
                    Err(e) => {
                        assert_eq!(e.errno(), libc::EIO);
                        eio += 1;
                    }
                }
                if let Some(b) = c.buf {
                    pool.put(b);
                }
                got += 1;
            });
            assert_eq!(
                got, 1,
                "a malloc-backed request completes at once without delay"
            );
        }
        eio
    }

    #[test]
    fn error_rates_stay_within_bounds() {
        let faults = Faults {
            read_err: Probability::new(0.1).unwrap(),
            write_err: Probability::new(0.5).unwrap(),
            flush_err: Probability::new(1.0).unwrap(),
            delay_us: 0,
            seed: 42,
        };
        let dev = faulty(faults, Arc::new(FakeClock::new(0)));
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(1 << 20);
        let n = 10_000;
        // Binomial(10 000, p): 5 standard deviations is under 150 for p = 0.1
        // and 250 for p = 0.5; a broken draw (always, never, or the wrong
        // probability) lands far outside.
        let reads = failures(&mut ch, IoOp::Read, n, &mut pool);
        assert!(
            (850..=1150).contains(&reads),
            "read failures {reads} of {n} at p = 0.1"
        );
        let writes = failures(&mut ch, IoOp::Write { fua: false }, n, &mut pool);
        assert!(
            (4750..=5250).contains(&writes),
            "write failures {writes} of {n} at p = 0.5"
        );
        let trims = failures(&mut ch, IoOp::Trim, n, &mut pool);
        assert!(
            (4750..=5250).contains(&trims),
            "trim failures {trims} of {n} at p = 0.5"
        );
        assert_eq!(failures(&mut ch, IoOp::Flush, 100, &mut pool), 100);
        // The never case never fires.
        let clean = faulty(Faults::default(), Arc::new(FakeClock::new(0)));
        let mut ch = clean.open_channel().expect("channel");
        assert_eq!(failures(&mut ch, IoOp::Read, n, &mut pool), 0);
    }

    #[test]
    fn the_same_seed_fails_the_same_requests() {
        let run = |seed| {
            let faults = Faults {
                read_err: Probability::new(0.3).unwrap(),
                seed,
                ..Faults::default()
            };
            let dev = faulty(faults, Arc::new(FakeClock::new(0)));
            let mut ch = dev.open_channel().expect("channel");
            let mut pool = BufPool::new(1 << 20);
            let mut pattern = Vec::new();
            for tag in 0..200 {
                ch.submit(req(tag, IoOp::Read, &mut pool))
                    .map_err(|(_r, e)| e)
                    .expect("submit");
                ch.reap(&mut |c| pattern.push(c.result.is_err()));
            }
            pattern
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn completions_wait_for_their_delay_on_the_clock() {
        let clock = FakeClock::new(1_000);
        let faults = Faults {
            write_err: Probability::new(0.5).unwrap(),
            delay_us: 300,
            seed: 1,
            ..Faults::default()
        };
        let dev = faulty(faults, Arc::new(clock.clone()));
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(1 << 20);
        for tag in 0..20 {
            ch.submit(req(tag, IoOp::Write { fua: false }, &mut pool))
                .map_err(|(_r, e)| e)
                .expect("submit");
        }
        let mut tags = Vec::new();
        assert_eq!(
            ch.reap(&mut |c| tags.push(c.tag)),
            0,
            "nothing is due before the delay"
        );
        clock.advance(299_000);
        assert_eq!(ch.reap(&mut |c| tags.push(c.tag)), 0, "nor 1 us before it");
        assert_eq!(ch.in_flight(), 20);
        clock.advance(1_000);
        assert_eq!(ch.reap(&mut |c| tags.push(c.tag)), 20);
        tags.sort_unstable();
        assert_eq!(
            tags,
            (0..20).collect::<Vec<_>>(),
            "all of them, failed or not"
        );
        assert_eq!(ch.in_flight(), 0);
    }

    #[test]
    fn the_event_fd_wakes_when_a_delayed_completion_is_due() {
        let faults = Faults {
            delay_us: 20_000,
            ..Faults::default()
        };
        let dev = FaultyDev::new(Arc::new(MallocDev::new(1 << 20).expect("malloc")), faults);
        let mut ch = dev.open_channel().expect("channel");
        let mut pool = BufPool::new(1 << 20);
        let start = std::time::Instant::now();
        ch.submit(req(9, IoOp::Read, &mut pool))
            .map_err(|(_r, e)| e)
            .expect("submit");
        let waiter = Epoll::new().expect("epoll");
        let fd = ch.event_fd().expect("a faulty channel has an event fd");
        waiter.add(fd, Interest::READABLE, 0).expect("add");
        let mut events = lull_reactor::sys::event_buffer(1);
        let mut got = Vec::new();
        while got.is_empty() {
            ch.reap(&mut |c| got.push(c.tag));
            if got.is_empty() {
                // Blocks until the timer fires (the test's own thread, not a reactor).
                let n = waiter.wait(&mut events, 5_000).expect("wait");
                assert_eq!(n, 1, "the event fd became readable within 5 s");
            }
        }
        assert_eq!(got, vec![9]);
        assert!(start.elapsed() >= std::time::Duration::from_millis(20));
    }

    #[test]
    fn probabilities_are_checked() {
        assert!("0".parse::<Probability>().is_ok());
        assert!("1".parse::<Probability>().is_ok());
        assert!("0.25".parse::<Probability>().is_ok());
        for bad in ["-0.1", "1.5", "NaN", "x", ""] {
            assert!(bad.parse::<Probability>().is_err(), "{bad}");
        }
    }
}
