//! The reactor's small fence around Linux syscalls: epoll, eventfd, timerfd,
//! CPU affinity and per-thread resource usage. The only module of this crate
//! that uses `unsafe`; everything it exports is safe.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Readiness a poller waits for on a file descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interest {
    pub readable: bool,
    pub writable: bool,
}

impl Interest {
    pub const READABLE: Interest = Interest {
        readable: true,
        writable: false,
    };
    pub const WRITABLE: Interest = Interest {
        readable: false,
        writable: true,
    };
    pub const BOTH: Interest = Interest {
        readable: true,
        writable: true,
    };
    /// Registered, but reporting nothing (errors and hang-ups still wake).
    pub const NONE: Interest = Interest {
        readable: false,
        writable: false,
    };

    fn events(self) -> u32 {
        let mut ev = 0;
        if self.readable {
            ev |= libc::EPOLLIN | libc::EPOLLRDHUP;
        }
        if self.writable {
            ev |= libc::EPOLLOUT;
        }
        ev as u32
    }
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// An epoll instance, level-triggered throughout: a poller that leaves work
/// behind is reported again, so no readiness is ever lost between iterations.
#[derive(Debug)]
pub struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: epoll_create1 takes no pointers; a non-negative return is a
        // new fd that we exclusively own.
        let fd = cvt(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Epoll { fd })
    }

    pub fn add(&self, fd: RawFd, interest: Interest, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, interest, token)
    }

    pub fn modify(&self, fd: RawFd, interest: Interest, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, interest, token)
    }

    pub fn delete(&self, fd: RawFd) -> io::Result<()> {
        // SAFETY: EPOLL_CTL_DEL ignores the event pointer since Linux 2.6.9; a
        // null pointer is allowed.
        cvt(unsafe {
            libc::epoll_ctl(
                self.fd.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd,
                std::ptr::null_mut(),
            )
        })?;
        Ok(())
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, interest: Interest, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event {
            events: interest.events(),
            u64: token,
        };
        // SAFETY: `ev` is a valid epoll_event that lives across the call; the
        // kernel copies it.
        cvt(unsafe { libc::epoll_ctl(self.fd.as_raw_fd(), op, fd, &mut ev) })?;
        Ok(())
    }

    /// Wait for events. `timeout_ms` < 0 blocks; 0 only checks. Returns the
    /// number of entries of `events` filled. EINTR is reported as 0 events.
    pub fn wait(&self, events: &mut [libc::epoll_event], timeout_ms: i32) -> io::Result<usize> {
        let max = events.len().min(i32::MAX as usize) as libc::c_int;
        let fd = self.fd.as_raw_fd();
        // The system call itself, not glibc's `epoll_wait`: that one is a
        // pthread cancellation point and brackets the call with two atomic
        // updates of the thread's cancel state, ~5 % of a spinning
        // reactor's time at QD1 (lull never cancels threads).
        // `epoll_pwait` with no signal mask is `epoll_wait`, on every
        // architecture (arm64 has no `epoll_wait`).
        // A null sigmask is allowed (its size is then ignored).
        // SAFETY: `events` is valid and writable for `max` entries throughout.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_epoll_pwait,
                fd,
                events.as_mut_ptr(),
                max,
                timeout_ms,
                std::ptr::null::<libc::sigset_t>(),
                0usize,
            )
        };
        if ret < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                return Ok(0);
            }
            return Err(err);
        }
        Ok(ret as usize)
    }
}

impl AsRawFd for Epoll {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A zeroed event array for `Epoll::wait`.
pub fn event_buffer(n: usize) -> Vec<libc::epoll_event> {
    vec![libc::epoll_event { events: 0, u64: 0 }; n]
}

/// A non-blocking eventfd used as a doorbell.
#[derive(Debug)]
pub struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: no pointers; a non-negative return is a new owned fd.
        let fd = cvt(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })?;
        // SAFETY: `fd` is fresh and owned only here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(EventFd { fd })
    }

    /// Ring the doorbell. A full counter (EAGAIN) already means "ringing".
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Reset the doorbell; returns whether it had been rung.
    pub fn drain(&self) -> bool {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64.
        let n = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        n == 8
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// A non-blocking one-shot CLOCK_MONOTONIC timerfd.
#[derive(Debug)]
pub struct TimerFd {
    fd: OwnedFd,
}

impl TimerFd {
    pub fn new() -> io::Result<TimerFd> {
        // SAFETY: no pointers; a non-negative return is a new owned fd.
        let fd = cvt(unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
            )
        })?;
        // SAFETY: `fd` is fresh and owned only here.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(TimerFd { fd })
    }

    /// Arm to fire once after `delay_ns` (0 disarms, so callers pass ≥ 1).
    pub fn arm(&self, delay_ns: u64) -> io::Result<()> {
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (delay_ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (delay_ns % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: `spec` is a valid itimerspec; the old-value pointer may be null.
        cvt(unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) })?;
        Ok(())
    }

    /// Consume an expiry, if any.
    pub fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64.
        let _ = unsafe { libc::read(self.fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
    }
}

impl AsRawFd for TimerFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Pin the calling OS thread to one CPU.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("cpu {cpu} out of range"),
        ));
    }
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` < CPU_SETSIZE was checked above.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the caller.
    cvt(unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) })?;
    Ok(())
}

/// CPUs this process may run on.
pub fn allowed_cpus() -> io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data; all-zero is a valid value.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is writable and of the size passed.
    cvt(unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) })?;
    // SAFETY: CPU_ISSET only reads `set`, and every index is < CPU_SETSIZE.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Raises the soft limit on open file descriptors to the hard limit (each
/// connection holds a socket and its thread's epoll and eventfd). Returns
/// (soft limit before, soft limit now).
pub fn raise_nofile_limit() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit.
    cvt(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) })?;
    let before = lim.rlim_cur;
    if lim.rlim_cur < lim.rlim_max {
        lim.rlim_cur = lim.rlim_max;
        // SAFETY: `lim` is a valid rlimit with soft <= hard.
        cvt(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) })?;
    }
    Ok((before, lim.rlim_cur))
}

/// The calling OS thread's kernel id.
pub fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// Resource usage of the calling OS thread.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ThreadUsage {
    pub user_ns: u64,
    pub system_ns: u64,
    pub voluntary_ctxsw: u64,
    pub involuntary_ctxsw: u64,
    pub minor_faults: u64,
    pub major_faults: u64,
}

pub fn thread_usage() -> ThreadUsage {
    // SAFETY: rusage is plain data; all-zero is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return ThreadUsage::default();
    }
    let tv_ns = |tv: libc::timeval| tv.tv_sec as u64 * 1_000_000_000 + tv.tv_usec as u64 * 1000;
    ThreadUsage {
        user_ns: tv_ns(ru.ru_utime),
        system_ns: tv_ns(ru.ru_stime),
        voluntary_ctxsw: ru.ru_nvcsw as u64,
        involuntary_ctxsw: ru.ru_nivcsw as u64,
        minor_faults: ru.ru_minflt as u64,
        major_faults: ru.ru_majflt as u64,
    }
}

/// CLOCK_MONOTONIC in nanoseconds, through the vDSO (~20 ns): one read,
/// without `Instant`'s conversions (`Instant::elapsed` added a third to the
/// cost of the reactor's clock reads in a QD1 profile).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec. CLOCK_MONOTONIC cannot
    // fail on Linux; on failure `ts` stays zero.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU time the calling OS thread has used, in ns (0 if the clock is
/// unavailable). A syscall (the vDSO does not serve thread CPU clocks):
/// the adaptive mode reads it only around a sleep, to measure what a
/// sleep-and-wake costs.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
