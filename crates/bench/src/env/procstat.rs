//! A server's CPU time, context switches and page faults, from /proc.
//!
//! CPU time and faults come from `/proc/<pid>/stat`, which sums every thread
//! of the process, including threads that already exited. Context switches
//! are only kept per task, so they are summed over `/proc/<pid>/task/*/status`
//! (a thread that exits inside the window loses its count; lull's reactors
//! live as long as the server).
//!
//! ```
//! use lull_bench::env::procstat::parse_stat;
//! let s = parse_stat("42 (lull reactor 0) S 1 42 42 0 -1 4194560 7 0 1 0 30 12 0 0 20 0 3 0").unwrap();
//! assert_eq!((s.utime_ticks, s.stime_ticks, s.minor_faults, s.major_faults), (30, 12, 7, 1));
//! ```

use std::path::Path;
use std::process::Command;

use serde::Serialize;

/// Clock ticks per second when `getconf CLK_TCK` cannot tell: Linux has
/// reported USER_HZ = 100 to user space on every architecture for decades.
pub const CLK_TCK_DEFAULT: u64 = 100;

/// Counters of one process (or the sum over several) at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ProcCounters {
    pub utime_ticks: u64,
    pub stime_ticks: u64,
    pub minor_faults: u64,
    pub major_faults: u64,
    pub voluntary_ctxt_switches: u64,
    pub nonvoluntary_ctxt_switches: u64,
}

impl ProcCounters {
    pub fn cpu_ticks(&self) -> u64 {
        self.utime_ticks + self.stime_ticks
    }

    pub fn ctxt_switches(&self) -> u64 {
        self.voluntary_ctxt_switches + self.nonvoluntary_ctxt_switches
    }

    pub fn faults(&self) -> u64 {
        self.minor_faults + self.major_faults
    }

    /// Field-wise sum.
    pub fn add(&self, o: &ProcCounters) -> ProcCounters {
        ProcCounters {
            utime_ticks: self.utime_ticks + o.utime_ticks,
            stime_ticks: self.stime_ticks + o.stime_ticks,
            minor_faults: self.minor_faults + o.minor_faults,
            major_faults: self.major_faults + o.major_faults,
            voluntary_ctxt_switches: self.voluntary_ctxt_switches + o.voluntary_ctxt_switches,
            nonvoluntary_ctxt_switches: self.nonvoluntary_ctxt_switches
                + o.nonvoluntary_ctxt_switches,
        }
    }

    /// `self - earlier`, saturating: a counter that went backwards (a thread
    /// exited and took its context switches with it) counts as zero.
    pub fn since(&self, earlier: &ProcCounters) -> ProcCounters {
        ProcCounters {
            utime_ticks: self.utime_ticks.saturating_sub(earlier.utime_ticks),
            stime_ticks: self.stime_ticks.saturating_sub(earlier.stime_ticks),
            minor_faults: self.minor_faults.saturating_sub(earlier.minor_faults),
            major_faults: self.major_faults.saturating_sub(earlier.major_faults),
            voluntary_ctxt_switches: self
                .voluntary_ctxt_switches
                .saturating_sub(earlier.voluntary_ctxt_switches),
            nonvoluntary_ctxt_switches: self
                .nonvoluntary_ctxt_switches
                .saturating_sub(earlier.nonvoluntary_ctxt_switches),
        }
    }
}

/// The fields of a `/proc/<pid>/stat` line we use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatFields {
    pub minor_faults: u64,
    pub major_faults: u64,
    pub utime_ticks: u64,
    pub stime_ticks: u64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProcParseError {
    #[error("stat line has no ')' closing the command name")]
    NoComm,
    #[error("stat line has {0} fields after the command name, need at least 13")]
    TooFewFields(usize),
    #[error("stat field {field} is not a number: {text:?}")]
    BadNumber { field: usize, text: String },
    #[error("status has no {0} line")]
    MissingStatus(&'static str),
}

/// Parses a `/proc/<pid>/stat` line. The command name (field 2) is in
/// parentheses and may itself hold spaces and parentheses, so fields are
/// counted from the last `)`.
pub fn parse_stat(line: &str) -> Result<StatFields, ProcParseError> {
    let close = line.rfind(')').ok_or(ProcParseError::NoComm)?;
    // Fields after the name, starting with field 3 (state).
    let rest: Vec<&str> = line[close + 1..].split_ascii_whitespace().collect();
    if rest.len() < 13 {
        return Err(ProcParseError::TooFewFields(rest.len()));
    }
    // proc(5) numbers fields from 1; rest[0] is field 3.
    let field = |n: usize| -> Result<u64, ProcParseError> {
        let text = rest[n - 3];
        text.parse().map_err(|_| ProcParseError::BadNumber {
            field: n,
            text: text.into(),
        })
    };
    Ok(StatFields {
        minor_faults: field(10)?,
        major_faults: field(12)?,
        utime_ticks: field(14)?,
        stime_ticks: field(15)?,
    })
}

/// Parses `(voluntary, nonvoluntary)` context switches from a
/// `/proc/<pid>/status` or `/proc/<pid>/task/<tid>/status` text.
pub fn parse_status_ctxt(text: &str) -> Result<(u64, u64), ProcParseError> {
    let get = |key: &'static str| -> Result<u64, ProcParseError> {
        let line = text
            .lines()
            .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix(':')))
            .ok_or(ProcParseError::MissingStatus(key))?;
        line.trim().parse().map_err(|_| ProcParseError::BadNumber {
            field: 0,
            text: line.trim().into(),
        })
    };
    Ok((
        get("voluntary_ctxt_switches")?,
        get("nonvoluntary_ctxt_switches")?,
    ))
}

/// Combines a process's stat line with its threads' status texts.
pub fn counters_from(
    stat_line: &str,
    task_statuses: &[String],
) -> Result<ProcCounters, ProcParseError> {
    let stat = parse_stat(stat_line)?;
    let mut c = ProcCounters {
        utime_ticks: stat.utime_ticks,
        stime_ticks: stat.stime_ticks,
        minor_faults: stat.minor_faults,
        major_faults: stat.major_faults,
        ..ProcCounters::default()
    };
    for s in task_statuses {
        let (v, n) = parse_status_ctxt(s)?;
        c.voluntary_ctxt_switches += v;
        c.nonvoluntary_ctxt_switches += n;
    }
    Ok(c)
}

#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    #[error("process {pid} is gone: {source}")]
    Gone { pid: u32, source: std::io::Error },
    #[error("process {pid}: {source}")]
    Parse { pid: u32, source: ProcParseError },
}

/// Reads the counters of one live process from `proc_root` (normally `/proc`).
pub fn sample_pid(proc_root: &Path, pid: u32) -> Result<ProcCounters, SampleError> {
    let dir = proc_root.join(pid.to_string());
    let gone = |source| SampleError::Gone { pid, source };
    let stat = std::fs::read_to_string(dir.join("stat")).map_err(gone)?;
    let mut statuses = Vec::new();
    for entry in std::fs::read_dir(dir.join("task")).map_err(gone)? {
        let entry = entry.map_err(gone)?;
        // A thread may exit between readdir and read; skip it.
        if let Ok(s) = std::fs::read_to_string(entry.path().join("status")) {
            statuses.push(s);
        }
    }
    counters_from(&stat, &statuses).map_err(|source| SampleError::Parse { pid, source })
}

/// Sum of the counters of several processes (a server and its replicas).
pub fn sample_pids(proc_root: &Path, pids: &[u32]) -> Result<ProcCounters, SampleError> {
    let mut total = ProcCounters::default();
    for &pid in pids {
        total = total.add(&sample_pid(proc_root, pid)?);
    }
    Ok(total)
}

/// Run time of one task in ns: the first field of
/// `/proc/<pid>/task/<tid>/schedstat` (time spent on a CPU).
pub fn parse_schedstat_run_ns(text: &str) -> Result<u64, ProcParseError> {
    let first = text.split_ascii_whitespace().next().unwrap_or("");
    first.parse().map_err(|_| ProcParseError::BadNumber {
        field: 1,
        text: first.into(),
    })
}

/// Sum of the run times (ns) of the live threads of `pids`, from
/// `/proc/<pid>/task/*/schedstat`: CPU time at nanosecond resolution, where
/// utime+stime count clock ticks (10 ms). A thread that exits inside a window
/// takes its time with it; the servers measured keep their threads.
pub fn run_ns_pids(proc_root: &Path, pids: &[u32]) -> Result<u64, SampleError> {
    let mut total = 0u64;
    for &pid in pids {
        let gone = |source| SampleError::Gone { pid, source };
        for entry in
            std::fs::read_dir(proc_root.join(pid.to_string()).join("task")).map_err(gone)?
        {
            let entry = entry.map_err(gone)?;
            // A thread may exit between readdir and read; skip it.
            if let Ok(s) = std::fs::read_to_string(entry.path().join("schedstat")) {
                total += parse_schedstat_run_ns(&s)
                    .map_err(|source| SampleError::Parse { pid, source })?;
            }
        }
    }
    Ok(total)
}

/// Clock ticks per second, from `getconf CLK_TCK` (asked once per run; no
/// `unsafe` sysconf call in this crate).
pub fn clk_tck() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .filter(|&t: &u64| t > 0)
        .unwrap_or(CLK_TCK_DEFAULT)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Recorded from a two-thread process, with the name changed to one that
    // holds spaces and parentheses.
    const STAT: &str = "5260 (lull (reactor) 0) S 5213 5213 3495 0 -1 4194304 100 0 3 0 250 75 0 0 20 0 2 0 27857 3133440 383 18446744073709551615 94621316104192 94621316124073 140730682461312 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 94621316140080 94621316141696 94622280564736 140730682468864 140730682468884 140730682468884 140730682470379 0\n";
    const STATUS_MAIN: &str = "Name:\tlull\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t5260\nThreads:\t2\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t3\n";
    const STATUS_REACTOR: &str = "Name:\tlull reactor 0\nState:\tR (running)\nvoluntary_ctxt_switches:\t1000\nnonvoluntary_ctxt_switches:\t250\n";

    #[test]
    fn stat_with_odd_command_name() {
        let s = parse_stat(STAT).unwrap();
        assert_eq!(
            s,
            StatFields {
                minor_faults: 100,
                major_faults: 3,
                utime_ticks: 250,
                stime_ticks: 75
            }
        );
    }

    #[test]
    fn stat_errors() {
        assert_eq!(parse_stat("5260 lull S 1 2"), Err(ProcParseError::NoComm));
        assert_eq!(
            parse_stat("5260 (x) S 1 2"),
            Err(ProcParseError::TooFewFields(3))
        );
        assert!(matches!(
            parse_stat("1 (x) S 0 0 0 0 0 0 zz 0 0 0 0 0"),
            Err(ProcParseError::BadNumber { field: 10, .. })
        ));
        assert!(matches!(
            parse_stat("1 (x) S 0 0 0 0 0 0 0 0 0 0 -5 0"),
            Err(ProcParseError::BadNumber { field: 14, .. })
        ));
    }

    #[test]
    fn status_and_totals() {
        assert_eq!(parse_status_ctxt(STATUS_REACTOR).unwrap(), (1000, 250));
        assert_eq!(
            parse_status_ctxt("Name:\tx\n"),
            Err(ProcParseError::MissingStatus("voluntary_ctxt_switches"))
        );
        let c = counters_from(STAT, &[STATUS_MAIN.into(), STATUS_REACTOR.into()]).unwrap();
        assert_eq!(c.cpu_ticks(), 325);
        assert_eq!(c.ctxt_switches(), 1265);
        assert_eq!(c.faults(), 103);
        let later = ProcCounters {
            utime_ticks: 300,
            voluntary_ctxt_switches: 5,
            ..c
        };
        let d = later.since(&c);
        assert_eq!(d.utime_ticks, 50);
        assert_eq!(d.voluntary_ctxt_switches, 0); // went backwards: saturates
        assert_eq!(c.add(&c).cpu_ticks(), 650);
    }

    #[test]
    fn fake_proc_tree() {
        let root = std::env::temp_dir().join(format!("lull-bench-proc-{}", std::process::id()));
        let task = root.join("77/task");
        std::fs::create_dir_all(task.join("77")).unwrap();
        std::fs::create_dir_all(task.join("78")).unwrap();
        std::fs::write(root.join("77/stat"), STAT).unwrap();
        std::fs::write(task.join("77/status"), STATUS_MAIN).unwrap();
        std::fs::write(task.join("78/status"), STATUS_REACTOR).unwrap();
        let c = sample_pids(&root, &[77, 77]).unwrap();
        assert_eq!(c.cpu_ticks(), 650);
        assert_eq!(c.ctxt_switches(), 2530);
        assert!(matches!(
            sample_pid(&root, 79),
            Err(SampleError::Gone { pid: 79, .. })
        ));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn schedstat_run_time() {
        assert_eq!(
            parse_schedstat_run_ns("3404948711 487974152 661\n"),
            Ok(3_404_948_711)
        );
        assert!(parse_schedstat_run_ns("").is_err());
        assert!(parse_schedstat_run_ns("x 1 2").is_err());
        let root = std::env::temp_dir().join(format!("lull-bench-sched-{}", std::process::id()));
        let task = root.join("90/task");
        std::fs::create_dir_all(task.join("90")).unwrap();
        std::fs::create_dir_all(task.join("91")).unwrap();
        std::fs::write(task.join("90/schedstat"), "1000 5 2\n").unwrap();
        std::fs::write(task.join("91/schedstat"), "250 0 1\n").unwrap();
        assert_eq!(run_ns_pids(&root, &[90]).unwrap(), 1250);
        assert!(matches!(
            run_ns_pids(&root, &[92]),
            Err(SampleError::Gone { pid: 92, .. })
        ));
        std::fs::remove_dir_all(&root).unwrap();
        assert!(run_ns_pids(Path::new("/proc"), &[std::process::id()]).unwrap() > 0);
    }

    #[test]
    fn live_self() {
        let c = sample_pid(Path::new("/proc"), std::process::id()).unwrap();
        assert!(c.minor_faults > 0);
        assert!(clk_tck() > 0);
    }
}
