//! Child processes: servers under test, replicas and fio. Every child is
//! owned by a guard that stops it (SIGTERM, then SIGKILL after
//! [`STOP_TIMEOUT`]) when dropped, so an error or a panic in the harness never
//! leaves a server running.

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use crate::config::PORT_SPAN;

/// How long a server may take to accept its first TCP connection.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a server gets to exit after SIGTERM before SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(3);
/// Poll interval of the harness while waiting on a child (the harness is not
/// on a reactor; short sleeps keep it off the measured cores).
pub const WAIT_POLL: Duration = Duration::from_millis(10);
/// Longest stderr line kept as a skip or failure reason.
pub const REASON_CHARS_MAX: usize = 300;

/// A running child with its output in files (no pipes to fill up).
pub struct Proc {
    pub name: String,
    /// The command as a shell would run it.
    pub command: String,
    child: Child,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
    reaped: Option<ExitStatus>,
}

impl std::fmt::Debug for Proc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proc")
            .field("name", &self.name)
            .field("pid", &self.child.id())
            .finish()
    }
}

impl Proc {
    /// Starts `program args…`, pinned to `cpu` with taskset when given;
    /// stdout and stderr go to `<log_dir>/<name>.{out,err}`.
    pub fn spawn(
        name: &str,
        program: &str,
        args: &[String],
        cpu: Option<usize>,
        log_dir: &Path,
    ) -> std::io::Result<Proc> {
        let mut argv: Vec<String> = Vec::new();
        if let Some(cpu) = cpu {
            argv.extend(["taskset".into(), "-c".into(), cpu.to_string()]);
        }
        argv.push(program.into());
        argv.extend(args.iter().cloned());
        let stdout_path = log_dir.join(format!("{name}.out"));
        let stderr_path = log_dir.join(format!("{name}.err"));
        let child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(File::create(&stdout_path)?)
            .stderr(File::create(&stderr_path)?)
            .spawn()?;
        // Recorded without paths of the machine it ran on, so a committed
        // report can say it: relative to the current directory
        // (`target/release/lull`), and `$WORK` for the scratch directory.
        let cwd = std::env::current_dir()
            .ok()
            .map(|d| format!("{}/", d.display()));
        let work = log_dir.display().to_string();
        let command = argv
            .iter()
            .map(|w| {
                let w = cwd.as_deref().and_then(|c| w.strip_prefix(c)).unwrap_or(w);
                shell_quote(w)
            })
            .collect::<Vec<_>>()
            .join(" ")
            .replace(&work, "$WORK");
        tracing::debug!(pid = child.id(), %command, "started");
        Ok(Proc {
            name: name.into(),
            command,
            child,
            stdout_path,
            stderr_path,
            reaped: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some(status)` once the child has exited.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        if self.reaped.is_none() {
            self.reaped = self.child.try_wait().ok().flatten();
        }
        self.reaped
    }

    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.stdout_path).unwrap_or_default()
    }

    /// The last non-empty stderr line, or the exit status: why it failed.
    pub fn reason(&mut self) -> String {
        let err = std::fs::read_to_string(&self.stderr_path).unwrap_or_default();
        let line = err
            .lines()
            .map(str::trim)
            .rfind(|l| !l.is_empty())
            .map(|l| l.chars().take(REASON_CHARS_MAX).collect::<String>());
        match (line, self.exit_status()) {
            (Some(l), _) => l,
            (None, Some(st)) => format!("{} exited with {st}", self.name),
            (None, None) => format!("{} is still running", self.name),
        }
    }

    /// Waits for the child to exit; `None` on timeout (the child is left
    /// running for the caller, or the guard, to stop).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.exit_status() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            sleep(WAIT_POLL);
        }
    }

    /// Waits until `port` on loopback accepts a connection. Fails with the
    /// child's stderr if it exits first, or on timeout.
    pub fn wait_listening(&mut self, port: u16, timeout: Duration) -> Result<(), String> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let deadline = Instant::now() + timeout;
        loop {
            if self.exit_status().is_some() {
                return Err(self.reason());
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let reason = self.reason();
                return Err(format!(
                    "{} did not listen on port {port} within {} s ({reason})",
                    self.name,
                    timeout.as_secs()
                ));
            }
            sleep(WAIT_POLL * 2);
        }
    }

    /// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
    pub fn stop(&mut self) {
        if self.exit_status().is_some() {
            return;
        }
        // The child is not reaped yet, so its pid cannot have been reused.
        // `kill(1)` instead of libc::kill keeps this crate free of unsafe.
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if self.wait_timeout(STOP_TIMEOUT).is_none() {
            tracing::warn!(name = %self.name, pid = self.pid(), "no exit after SIGTERM; sending SIGKILL");
            let _ = self.child.kill();
            self.reaped = self.child.wait().ok();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The processes making up one target (replicas first, the server last).
/// Dropping it stops them in reverse start order.
#[derive(Debug, Default)]
pub struct Group {
    pub procs: Vec<Proc>,
    /// The lull server's JSON-RPC socket (lull targets only), where its
    /// `io_uring_enter` counts are read.
    pub rpc_socket: Option<PathBuf>,
}

impl Group {
    pub fn pids(&self) -> Vec<u32> {
        self.procs.iter().map(Proc::pid).collect()
    }

    /// The first member that has exited, with its reason.
    pub fn dead(&mut self) -> Option<String> {
        let p = self
            .procs
            .iter_mut()
            .find_map(|p| p.exit_status().is_some().then_some(p))?;
        let reason = p.reason();
        Some(format!("{} exited: {reason}", p.name))
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        while let Some(mut p) = self.procs.pop() {
            p.stop();
        }
    }
}

/// Hands out loopback ports from `base..base+PORT_SPAN`, a fresh one per
/// call, skipping ports something else holds.
#[derive(Debug)]
pub struct Ports {
    base: u16,
    next: u16,
}

impl Ports {
    pub fn new(base: u16) -> Ports {
        Ports { base, next: 0 }
    }

    pub fn take(&mut self) -> Option<u16> {
        for _ in 0..PORT_SPAN {
            let port = self.base + self.next % PORT_SPAN;
            self.next = self.next.wrapping_add(1) % PORT_SPAN;
            if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
                return Some(port);
            }
        }
        None
    }
}

/// A scratch directory removed on drop.
#[derive(Debug)]
pub struct WorkDir {
    pub path: PathBuf,
}

impl WorkDir {
    pub fn new(parent: &Path) -> std::io::Result<WorkDir> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = parent.join(format!("lull-bench-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&path)?;
        Ok(WorkDir { path })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!(path = %self.path.display(), error = %e, "could not remove work dir");
        }
    }
}

/// The first executable named `name` on PATH (or `name` itself if it has a
/// slash and exists).
pub fn which(name: &str) -> Option<PathBuf> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return p.is_file().then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// First line of `<tool> --version`, for the report.
pub fn tool_version(tool: &str) -> Option<String> {
    let out = Command::new(tool)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = if out.stdout.is_empty() {
        out.stderr
    } else {
        out.stdout
    };
    String::from_utf8_lossy(&text)
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
}

/// Quotes a command-line word for a POSIX shell when needed.
pub fn shell_quote(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        word.into()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_from_stderr_and_stop() {
        let dir = WorkDir::new(&std::env::temp_dir()).unwrap();
        let mut p = Proc::spawn(
            "fails",
            "sh",
            &[
                "-c".into(),
                "echo first >&2; echo 'error: unknown mode' >&2; exit 3".into(),
            ],
            None,
            &dir.path,
        )
        .unwrap();
        assert!(p.wait_timeout(Duration::from_secs(5)).is_some());
        assert_eq!(p.reason(), "error: unknown mode");
        // A process that ignores nothing stops on SIGTERM quickly.
        let mut s = Proc::spawn("sleeper", "sleep", &["30".into()], None, &dir.path).unwrap();
        // Its recorded command names no scratch path of this machine.
        let arg = format!("--dir={}/replica0", dir.path.display());
        let mut named = Proc::spawn("named", "true", &[arg], None, &dir.path).unwrap();
        assert_eq!(named.command, "true --dir=$WORK/replica0");
        assert!(named.wait_timeout(Duration::from_secs(5)).is_some());
        let t = Instant::now();
        s.stop();
        assert!(t.elapsed() < STOP_TIMEOUT);
        assert!(s.exit_status().is_some());
        // Exits before listening → its stderr is the reason.
        let mut q = Proc::spawn(
            "quitter",
            "sh",
            &["-c".into(), "echo 'bind failed' >&2".into()],
            None,
            &dir.path,
        )
        .unwrap();
        assert_eq!(
            q.wait_listening(1, Duration::from_secs(5)).unwrap_err(),
            "bind failed"
        );
        let path = dir.path.clone();
        drop(dir);
        assert!(!path.exists());
    }

    #[test]
    fn group_drop_stops_all() {
        let dir = WorkDir::new(&std::env::temp_dir()).unwrap();
        let mut g = Group::default();
        g.procs
            .push(Proc::spawn("a", "sleep", &["30".into()], None, &dir.path).unwrap());
        g.procs
            .push(Proc::spawn("b", "sleep", &["30".into()], None, &dir.path).unwrap());
        let pids = g.pids();
        assert!(g.dead().is_none());
        drop(g);
        for pid in pids {
            // Reaped children leave no /proc entry (or a new, unrelated one).
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            assert!(!stat.contains("(sleep)"), "{stat}");
        }
    }

    #[test]
    fn ports_skip_taken() {
        let held = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let port = held.local_addr().unwrap().port();
        if port <= u16::MAX - PORT_SPAN {
            let mut ports = Ports::new(port);
            assert_ne!(ports.take(), Some(port));
        }
        assert!(which("sh").is_some());
        assert!(which("definitely-not-a-tool-xyz").is_none());
    }

    #[test]
    fn shell_quoting() {
        assert_eq!(shell_quote("--jobs=a,b"), "--jobs=a,b");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote(""), "''");
    }
}
