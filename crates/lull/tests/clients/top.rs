//! `lull top` against the real binary: `--once` and the interactive view
//! (driven in tmux: send-keys to type, capture-pane to read the screen)
//! over a `lull serve` with three memory volumes, two of them under fio's
//! nbd engine; and a server killed under either, which must end top with
//! one line and exit status 1.
//!
//! ```text
//! cargo test -p lull --profile ci --test clients top:: -- --nocapture
//! ```
//!
//! fio and tmux (Debian packages fio and tmux) must be installed; a test
//! fails, naming the package, when one is not (scripts/test installs both).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{require, rpc, Scratch, Server};

/// The volumes: two under fio, one idle; their names sort differently by
/// name and by IOPS, so a sort key shows in the order.
const IDLE: &str = "a-idle";
const BUSY: [&str; 2] = ["b-busy", "c-busy"];

/// fio runs longer than any test here and is killed when the test ends.
const FIO_RUNTIME_S: u64 = 300;

/// Longest wait for a state the test expects (fio's first reads, a screen,
/// top's exit). Generous: CI shares 2 cores between the server, two fio
/// processes and the test.
const WAIT: Duration = Duration::from_secs(30);

/// The lull binary under test.
const LULL: &str = env!("CARGO_BIN_EXE_lull");

/// A fio process reading one volume at random, killed when dropped.
struct Fio(Child);

impl Fio {
    fn start(server: &Server, volume: &str) -> Fio {
        let child = Command::new("fio")
            .args([
                "--name=top",
                "--ioengine=nbd",
                &format!("--uri=nbd://{}/{volume}", server.addr()),
                "--rw=randread",
                "--bs=4k",
                "--iodepth=8",
                "--time_based",
                &format!("--runtime={FIO_RUNTIME_S}"),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn fio");
        Fio(child)
    }
}

impl Drop for Fio {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `f` until it gives a value or [`WAIT`] passes; `what` names
/// the state in the failure.
fn wait_until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A server with the three volumes and its RPC socket in `dir`.
fn server(dir: &Path) -> (Server, PathBuf) {
    let sock = dir.join("rpc.sock");
    let sock_arg = sock.to_str().expect("a UTF-8 path").to_string();
    let mut args = vec!["--cores", "0-1", "--rpc-socket", &sock_arg];
    let volumes: Vec<String> = [IDLE, BUSY[0], BUSY[1]]
        .iter()
        .map(|v| format!("{v}:64M"))
        .collect();
    for v in &volumes {
        args.extend(["--volume", v]);
    }
    (Server::start(&args), sock)
}

/// fio on both busy volumes, once each has served reads (the server's
/// counters say so).
fn load(server: &Server, sock: &Path) -> Vec<Fio> {
    require("fio", "fio");
    let fio: Vec<Fio> = BUSY.iter().map(|v| Fio::start(server, v)).collect();
    for v in BUSY {
        wait_until(&format!("fio's reads on {v}"), || {
            let stats = rpc(sock, "volume_get_stats", &format!(r#"{{"name": "{v}"}}"#));
            (stats["reads"].as_u64() > Some(0)).then_some(())
        });
    }
    fio
}

/// The rows of the table whose header starts with `title`: the header's
/// words and each row's, up to the blank line that ends the table.
fn table(text: &str, title: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let mut lines = text.lines().skip_while(|l| !l.starts_with(title));
    let words = |l: &str| l.split_whitespace().map(String::from).collect::<Vec<_>>();
    let header = words(
        lines
            .next()
            .unwrap_or_else(|| panic!("no {title} table in:\n{text}")),
    );
    let rows = lines
        .take_while(|l| !l.trim().is_empty())
        .map(words)
        .collect();
    (header, rows)
}

#[test]
fn once_names_every_reactor_and_volume_with_rates_for_the_busy_ones() {
    let dir = Scratch::new("top-once");
    let (server, sock) = server(&dir);
    // A QoS limit on one busy volume, low enough to hold fio back.
    rpc(
        &sock,
        "volume_set_qos",
        &format!(r#"{{"name": "{}", "rw_ios_per_sec": 500}}"#, BUSY[0]),
    );
    let _fio = load(&server, &sock);
    let out = Command::new(LULL)
        .args(["top", "--once", "--period-ms", "1000", "--socket"])
        .arg(&sock)
        .output()
        .expect("run lull top --once");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    println!("{text}");
    assert!(out.status.success(), "lull top --once failed: {err}");
    assert!(!text.contains('\x1b'), "escape codes in --once output");
    let title = text.lines().next().unwrap_or_default();
    assert!(title.starts_with("lull top  pid "), "{title}");
    assert!(title.ends_with(&format!("  {}", sock.display())), "{title}");

    let reactors = rpc(&sock, "framework_get_reactors", "");
    let indices: Vec<String> = reactors["reactors"]
        .as_array()
        .expect("reactors")
        .iter()
        .map(|r| r["index"].to_string())
        .collect();
    assert_eq!(indices.len(), 2, "--cores 0-1");
    let (_, rows) = table(&text, "REACTOR");
    let shown: Vec<String> = rows.iter().map(|r| r[0].clone()).collect();
    assert_eq!(shown, indices, "every reactor, in order:\n{text}");

    let (header, rows) = table(&text, "VOLUME");
    let iops_at = header.iter().position(|h| h == "IOPS").expect("IOPS");
    let iops = |name: &str| -> f64 {
        let row = rows
            .iter()
            .find(|r| r[0] == name)
            .unwrap_or_else(|| panic!("no row for {name}:\n{text}"));
        row[iops_at]
            .parse()
            .unwrap_or_else(|_| panic!("IOPS of {name}: {:?}", row[iops_at]))
    };
    assert_eq!(rows.len(), 3, "{text}");
    for v in BUSY {
        assert!(iops(v) > 0.0, "{v} is under fio:\n{text}");
    }
    assert_eq!(iops(IDLE), 0.0, "{IDLE} is idle:\n{text}");
    // The default sort is by IOPS, busiest first: the idle volume is last.
    assert_eq!(rows[2][0], IDLE, "{text}");
    // The limited volume shows its limit and time held by it.
    let at = |h: &str| {
        header
            .iter()
            .position(|x| x == h)
            .unwrap_or_else(|| panic!("no {h}"))
    };
    let limited = rows.iter().find(|r| r[0] == BUSY[0]).expect("limited row");
    assert_eq!(limited[at("QOS")], "500io", "{text}");
    assert!(
        limited[at("THRms/s")].parse::<f64>().unwrap_or(0.0) > 0.0,
        "{text}"
    );
    let free = rows.iter().find(|r| r[0] == BUSY[1]).expect("free row");
    assert_eq!(free[at("QOS")], "-", "{text}");
}

/// A tmux server of the test's own (its socket in the test's directory,
/// no configuration read), killed when dropped.
struct Tmux {
    socket: PathBuf,
}

impl Tmux {
    /// A detached 80×24 session running `command` (through sh).
    fn start(dir: &Path, command: &str) -> Tmux {
        require("tmux", "tmux");
        let tmux = Tmux {
            socket: dir.join("tmux.sock"),
        };
        tmux.run(&["new-session", "-d", "-x", "80", "-y", "24", command]);
        tmux
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-f", "/dev/null", "-S"])
            .arg(&self.socket)
            .args(args);
        c
    }

    fn run(&self, args: &[&str]) -> String {
        let out = self.command(args).output().expect("run tmux");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys"];
        args.extend(keys);
        self.run(&args);
    }

    /// The screen once `ok` holds for it.
    fn wait_for(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let mut last = String::new();
        let deadline = Instant::now() + WAIT;
        loop {
            match self.command(&["capture-pane", "-p"]).output() {
                Ok(out) if out.status.success() => {
                    last = String::from_utf8_lossy(&out.stdout).into_owned();
                    if ok(&last) {
                        return last;
                    }
                }
                _ => {}
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; the screen:\n{last}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether the session (and so the command in its pane) still runs.
    fn alive(&self) -> bool {
        self.command(&["has-session"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self
            .command(&["kill-server"])
            .stderr(Stdio::null())
            .status();
    }
}

/// `lull top ARGS` in tmux, its stderr and exit status kept in files
/// (`top.err`, `top.status`) for the test to read after it ends.
fn top_in_tmux(dir: &Path, sock: &Path, args: &str) -> Tmux {
    let command = format!(
        "'{LULL}' top --socket '{}' {args} 2>'{}'; echo $? >'{}'",
        sock.display(),
        dir.join("top.err").display(),
        dir.join("top.status").display()
    );
    Tmux::start(dir, &command)
}

/// top's exit status and stderr, once it has exited.
fn top_exit(dir: &Path) -> (i32, String) {
    let status = wait_until("lull top to exit", || {
        let text = std::fs::read_to_string(dir.join("top.status")).ok()?;
        text.trim().parse::<i32>().ok()
    });
    let err = std::fs::read_to_string(dir.join("top.err")).unwrap_or_default();
    (status, err)
}

/// The names of the volume rows on a screen, top to bottom.
fn volume_order(screen: &str) -> Vec<String> {
    let (_, rows) = table(screen, "VOLUME");
    rows.into_iter()
        .map(|r| r[0].clone())
        .filter(|n| n == IDLE || BUSY.contains(&n.as_str()))
        .collect()
}

#[test]
fn interactive_view_in_tmux_sorts_filters_and_quits_on_q() {
    let dir = Scratch::new("top-tmux");
    let (server, sock) = server(&dir);
    let _fio = load(&server, &sock);
    let tmux = top_in_tmux(&dir, &sock, "--sort name --period-ms 500");
    // Rates are there from the second sample on.
    let screen = tmux.wait_for("a screen with rates", |s| s.contains("rates over"));
    println!("{screen}");
    for line in screen.lines() {
        assert!(line.chars().count() <= 80, "wider than 80: {line:?}");
    }
    assert_eq!(screen.lines().count(), 24, "{screen}");
    assert!(screen.contains("\nREACTOR "), "{screen}");
    assert!(screen.contains("\nTHREAD "), "{screen}");
    assert_eq!(volume_order(&screen), [IDLE, BUSY[0], BUSY[1]], "by name");
    let help = screen.lines().last().expect("a help line");
    assert!(help.starts_with("q quit  s sort (name asc)"), "{help:?}");

    // `s` moves on from name to IOPS, busiest first: the idle volume last.
    tmux.keys(&["s"]);
    let screen = tmux.wait_for("the IOPS order", |s| s.contains("sort (iops desc)"));
    assert_eq!(
        volume_order(&screen).last().map(String::as_str),
        Some(IDLE),
        "{screen}"
    );
    // `r` reverses it.
    tmux.keys(&["r"]);
    let screen = tmux.wait_for("the reversed order", |s| s.contains("sort (iops asc)"));
    assert_eq!(
        volume_order(&screen).first().map(String::as_str),
        Some(IDLE),
        "{screen}"
    );
    // `/` filters by name as it is typed.
    tmux.keys(&["/", "c-", "Enter"]);
    let screen = tmux.wait_for("the filter", |s| s.contains("1 of 3 volumes match"));
    assert_eq!(volume_order(&screen), [BUSY[1]], "{screen}");

    tmux.keys(&["q"]);
    let (status, err) = top_exit(&dir);
    assert_eq!(status, 0, "q exits 0; stderr: {err}");
    assert!(err.is_empty(), "nothing on stderr after q: {err}");
    wait_until("the pane's command to end", || {
        (!tmux.alive()).then_some(())
    });
}

#[test]
fn ctrl_c_quits_the_interactive_view() {
    let dir = Scratch::new("top-ctrl-c");
    let (_server, sock) = server(&dir);
    let tmux = top_in_tmux(&dir, &sock, "");
    tmux.wait_for("the first screen", |s| s.contains("VOLUME"));
    tmux.keys(&["C-c"]);
    let (status, err) = top_exit(&dir);
    assert_eq!(status, 0, "Ctrl-C exits 0; stderr: {err}");
    wait_until("the pane's command to end", || {
        (!tmux.alive()).then_some(())
    });
}

/// top's one line about the server it lost: a single line naming the
/// socket, no panic.
fn assert_went_away(err: &str, sock: &Path) {
    assert!(!err.contains("panicked"), "a panic: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err:?}");
    let expected = format!("lull top: the server at {} went away: ", sock.display());
    assert!(err.starts_with(&expected), "{err:?}");
}

#[test]
fn a_server_killed_under_the_interactive_view_ends_it_with_one_line() {
    let dir = Scratch::new("top-killed");
    let (mut server, sock) = server(&dir);
    let tmux = top_in_tmux(&dir, &sock, "--period-ms 200");
    tmux.wait_for("a screen with rates", |s| s.contains("rates over"));
    server.kill();
    let (status, err) = top_exit(&dir);
    assert_eq!(status, 1, "stderr: {err}");
    assert_went_away(&err, &sock);
    wait_until("the pane's command to end", || {
        (!tmux.alive()).then_some(())
    });
}

#[test]
fn a_server_killed_under_once_ends_it_with_one_line() {
    let dir = Scratch::new("top-once-killed");
    let (mut server, sock) = server(&dir);
    // The first sample is taken at once (milliseconds); the second waits
    // the period, and the server dies in between.
    let top = Command::new(LULL)
        .args(["top", "--once", "--period-ms", "5000", "--socket"])
        .arg(&sock)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn lull top --once");
    std::thread::sleep(Duration::from_millis(1500));
    server.kill();
    let out = top.wait_with_output().expect("lull top --once");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(
        out.stdout.is_empty(),
        "no snapshot without its second sample"
    );
    assert_went_away(&err, &sock);

    // No server at all: one line too, saying so.
    let out = Command::new(LULL)
        .args(["top", "--once", "--socket"])
        .arg(&sock)
        .output()
        .expect("run lull top --once");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert_eq!(err.lines().count(), 1, "{err:?}");
    assert!(
        err.starts_with(&format!(
            "lull top: cannot reach the server at {}: ",
            sock.display()
        )),
        "{err:?}"
    );
}
