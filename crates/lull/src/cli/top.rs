//! `lull top`: a live terminal view of a running `lull serve`: its
//! reactors, lull threads, volumes, replicas and store, refreshed every
//! second from the server's JSON-RPC (what `lull rpc` calls; nothing is
//! changed on the server).
//!
//! ```text
//! $ lull top                                      # /var/tmp/lull.sock
//! $ lull top --socket /run/lull/rpc.sock --sort p99
//! $ lull top --addr 10.0.0.7:5260 --tls-psk rpc.psk --period-ms 2000
//! $ lull top --once --filter pvc- > top.txt       # plain text, for scripts
//! ```
//!
//! On an 80×24 terminal, two volumes under fio (4k random reads, queue
//! depth 8) and one idle:
//!
//! ```text
//! lull top  pid 9489  3 volumes  rates over 1.00s  /var/tmp/lull.sock
//! REACTOR CORE MODE     BUSY% CPU% SLEEP INTR WAKE/s THREADS MOVES
//! 0          1 adaptive  97.4 61.5 no    yes     113       2   0/0
//!
//! THREAD       ID REACTOR BUSY% CONN MOVES WAKE/s
//! nbd-group-0   1       0  97.4    2     0    113
//! nbd-acceptor  2       0   0.0    1     0      0
//!
//! VOLUME  IOPS MiB/s RMiB/s WMiB/s P50  P99 INFL CONN ERR STATE
//! b-busy 57426 224.3  224.3    0.0 1us 16us    0    1   0 malloc
//! c-busy 52511 205.1  205.1    0.0 2us 16us    0    1   0 malloc
//! a-idle     0   0.0    0.0    0.0   -    -    0    0   0 malloc
//!
//! q quit  s sort (iops desc)  r reverse  / filter
//! ```
//!
//! # Keys
//!
//! | key | does |
//! |---|---|
//! | `s` | next volume sort key: iops, mibs, p99, inflight, conns, name |
//! | `r` | reverse the order (numbers sort largest first, names a to z) |
//! | `/` | type a filter (live); Enter keeps it, Esc goes back to the last one |
//! | Esc | clear the filter |
//! | `q`, Ctrl-C | quit (exit 0) |
//!
//! The filter keeps the volumes, replicas and store replicas whose name
//! contains the text, ignoring case.
//!
//! # Flags
//!
//! - `--socket PATH` (`-s`): the server's `--rpc-socket` [default:
//!   /var/tmp/lull.sock]; or `--addr HOST:PORT` with `--tls-psk FILE` or
//!   `--tls-certs DIR`: the server's `--rpc-listen`, as for `lull rpc`.
//! - `--period-ms N`: time between samples, 100 to 60000 [default: 1000].
//! - `--once`: take two samples `--period-ms` apart, print the rates
//!   between them as plain text and exit. Columns are separated by
//!   spaces and no cell holds one (except `LAST_ERROR`, the last column
//!   of the replica table); no escape codes, every row, every column.
//! - `--sort KEY`: the first sort key [default: iops]; `--filter TEXT`:
//!   the first filter.
//!
//! # Columns and where they come from
//!
//! Rates (`/s`, `%`, IOPS, MiB/s) are the difference between two samples
//! divided by the time between them; `-` until there are two.
//!
//! | table | column | RPC method: field |
//! |---|---|---|
//! | reactors | REACTOR, CORE, MODE | `framework_get_reactors`: `index`, `core`, `mode` |
//! | | BUSY% | `busy` (ns running pollers and messages) per wall time |
//! | | CPU% | `usr` + `sys` (the reactor thread's CPU time) per wall time |
//! | | SLEEP, INTR | `sleeping`, `interrupt_mode_enabled` |
//! | | WAKE/s | `wakeups` per second |
//! | | THREADS, MOVES | `lw_threads` count; `threads_moved_in`/`threads_moved_out` totals |
//! | threads | THREAD, ID, REACTOR | `thread_get_stats`: `name`, `id`, `reactor` |
//! | | BUSY%, WAKE/s | `busy` per wall time, `wakeups` per second |
//! | | CONN | `sources`: a poll group's connections |
//! | | MOVES | reactor changes top saw between its samples (the server keeps no per-thread count) |
//! | volumes | VOLUME | `volume_list`: `name` |
//! | | IOPS | `volume_get_stats`: `reads` + `writes` per second |
//! | | MiB/s, RMiB/s, WMiB/s | `read_bytes` + `write_bytes`, each, per second |
//! | | P50, P99 | `latency_ns.p50_le`, `p99_le`: since the server started, not per interval |
//! | | INFL, CONN, ERR | `in_flight`, `connections` now; `errors` total |
//! | | STATE | the backend (`volume_list`: `backend`), or for a replicated volume from `replica_list`: healthy, degraded:H/N, rebuild:P%, reconcile:P% |
//! | replicas | VOLUME, REPLICA, STATE | `replica_list`: `addr`, `state` |
//! | | DONE%, MiB/s | `rebuild.done_bytes` of `total_bytes`, and per second |
//! | | GEN, INFL, ERR, LAST_ERROR | `generation`, `in_flight`, `errors`, `last_error` |
//! | store | STORE ... REPLICAS | `store_get`: `dir`, `capacity_bytes`, `free_bytes`, `allocated_bytes`, `provisioned_bytes`, `overcommit_percent` |
//! | store replicas | STORE_REPLICA ... SESSION | `store_get`: `replicas[]`: `name`, `size_bytes`, `allocated_bytes`, `generation`, `connections`, `clean`, `intent_bits_set` (`lost` if `intent_lost`), `held_by_session` |
//!
//! The store tables appear on a daemon started with `--store`, the replica
//! table when a volume is replicated. On a small terminal the columns that
//! do not fit are dropped (the least needed first), long names are cut
//! with `~`, and a table's rows that do not fit are counted in a `+N more`
//! line; the volumes get the room first.
//!
//! # Exit status
//!
//! 0 after `q`, Ctrl-C or SIGINT/SIGTERM/SIGHUP; 1 when the server cannot
//! be reached or goes away (the terminal is restored first, then one line:
//! `lull top: the server at PATH went away: ...`); 2 for bad flags, or no
//! terminal without `--once`.
//!
//! Module layout: [`sample`] makes the RPC calls, [`model`] turns two
//! samples into rates and holds the view's state machine (keys in,
//! redraw/quit out), [`render`] is a pure function from the model to lines
//! of text, and [`term`] is the terminal loop around them.
//!
//! # Layout
//!
//! - `sample`: one sample of a running server (the JSON-RPC calls made).
//! - `model`: what the view shows, from two samples, and its state (sort, filter).
//! - `render`: the model as lines of text, a pure function.
//! - `term`: the interactive view on a terminal.

mod model;
mod render;
mod sample;
mod term;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use lull_rpc::{RpcTls, DEFAULT_RPC_SOCKET};

use self::model::{SortKey, Top, View, MAX_FILTER_LEN};
use self::sample::{Sampler, Source};
use crate::cli::EXIT_USAGE;

/// Shortest refresh period. A sample is several RPC connections (one per
/// volume), each taking one of the server's 64 RPC slots for its moment;
/// and below 0.1 s a busy % is a handful of poller runs, noise rather
/// than load.
const PERIOD_MS_MIN: u64 = 100;

/// Longest refresh period: past a minute the view is no longer live (the
/// Prometheus endpoint is for long-term trends).
const PERIOD_MS_MAX: u64 = 60_000;

const PERIOD_MS_DEFAULT: u64 = 1_000;

/// `lull top`: the live view of a running server.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct TopArgs {
    /// The server's Unix socket (its --rpc-socket).
    #[arg(short = 's', long, value_name = "PATH", default_value = DEFAULT_RPC_SOCKET)]
    pub(crate) socket: PathBuf,
    /// Read over TCP instead: the server's --rpc-listen address. TLS only:
    /// needs --tls-psk or --tls-certs.
    #[arg(long, value_name = "HOST:PORT", conflicts_with = "socket")]
    pub(crate) addr: Option<String>,
    /// With --addr: a username:hexkey file; the first entry is presented.
    #[arg(
        long,
        value_name = "FILE",
        requires = "addr",
        conflicts_with = "tls_certs"
    )]
    pub(crate) tls_psk: Option<PathBuf>,
    /// With --addr: a directory with ca-cert.pem, client-cert.pem and
    /// client-key.pem (qemu's tls-creds-x509 layout).
    #[arg(long, value_name = "DIR", requires = "addr")]
    pub(crate) tls_certs: Option<PathBuf>,
    /// Time between samples, in milliseconds (100 to 60000).
    #[arg(long, value_name = "N", default_value_t = PERIOD_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(PERIOD_MS_MIN..=PERIOD_MS_MAX))]
    pub(crate) period_ms: u64,
    /// Print one plain-text snapshot (two samples --period-ms apart, so
    /// rates are real) and exit.
    #[arg(long)]
    pub(crate) once: bool,
    /// The volume sort key (`s` cycles it).
    #[arg(long, value_enum, value_name = "KEY", default_value_t = SortKey::Iops)]
    pub(crate) sort: SortKey,
    /// Show only volumes, replicas and store replicas whose name contains
    /// TEXT (`/` changes it).
    #[arg(long, value_name = "TEXT", default_value = "")]
    pub(crate) filter: String,
}

/// Run `lull top`: exit 0 when asked to stop, 1 when the server cannot be
/// read or goes away, 2 for bad flags.
pub(crate) fn run(args: &TopArgs) -> ExitCode {
    let source = match source(args) {
        Ok(s) => s,
        Err(msg) => {
            eprintln!("lull top: error: {msg}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if args.filter.chars().count() > MAX_FILTER_LEN {
        eprintln!("lull top: error: --filter is longer than any volume name ({MAX_FILTER_LEN})");
        return ExitCode::from(EXIT_USAGE);
    }
    let view = View {
        sort: args.sort,
        filter: args.filter.clone(),
        ..View::default()
    };
    let period = Duration::from_millis(args.period_ms);
    if args.once {
        once(source, period, view)
    } else {
        term::run(source, period, view)
    }
}

/// Where to read: the socket, or the TCP address with its TLS context
/// loaded (an error is the operator's: exit 2).
fn source(args: &TopArgs) -> Result<Source, String> {
    let Some(addr) = &args.addr else {
        return Ok(Source::Socket(args.socket.clone()));
    };
    let tls = match (&args.tls_psk, &args.tls_certs) {
        (Some(file), None) => RpcTls::Psk(file.clone()),
        (None, Some(dir)) => RpcTls::Certs(dir.clone()),
        (None, None) => {
            return Err(
                "--addr needs --tls-psk FILE or --tls-certs DIR: JSON-RPC over TCP is TLS only"
                    .into(),
            )
        }
        (Some(_), Some(_)) => return Err("give only one of --tls-psk and --tls-certs".into()),
    };
    let tls = tls.client().map_err(|e| e.to_string())?;
    Ok(Source::Tcp {
        addr: addr.clone(),
        tls,
    })
}

/// `--once`: two samples `period` apart, the snapshot on stdout.
fn once(source: Source, period: Duration, view: View) -> ExitCode {
    let mut top = Top::new(source.name(), view);
    let mut sampler = Sampler::new(source);
    for n in 0..2 {
        if n > 0 {
            std::thread::sleep(period);
        }
        match sampler.sample(Instant::now()) {
            Ok(sample) => top.sampled(sample),
            Err(e) => {
                eprintln!("{}", top.failure(&e));
                return ExitCode::FAILURE;
            }
        }
    }
    let Some(model) = &top.model else {
        return ExitCode::FAILURE; // two samples were taken: unreachable
    };
    let text = render::snapshot(model, &top.view, &top.server);
    // A closed pipe (`lull top --once | head`) is not an error of ours.
    let _ = std::io::stdout().write_all(text.as_bytes());
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        top: TopArgs,
    }

    #[test]
    fn flags() {
        let parse = |flags: &[&str]| Cli::try_parse_from(["lull-top"].iter().chain(flags));
        let cli = parse(&[]).unwrap();
        assert_eq!(cli.top.socket, PathBuf::from(DEFAULT_RPC_SOCKET));
        assert_eq!(cli.top.period_ms, PERIOD_MS_DEFAULT);
        assert_eq!(cli.top.sort, SortKey::Iops);
        assert!(!cli.top.once);
        let cli = parse(&["--once", "--sort", "p99", "--filter", "pvc", "-s", "/x"]).unwrap();
        assert!(cli.top.once);
        assert_eq!(cli.top.sort, SortKey::P99);
        assert_eq!(cli.top.filter, "pvc");
        assert_eq!(cli.top.socket, PathBuf::from("/x"));
        for bad in [
            &["--period-ms", "99"][..],
            &["--period-ms", "60001"],
            &["--sort", "size"],
            &["--tls-psk", "k"],
            &["--addr", "h:1", "--tls-psk", "k", "--tls-certs", "d"],
        ] {
            let err = parse(bad).err().map(|e| e.exit_code());
            assert_eq!(err, Some(2), "{bad:?}");
        }
        assert!(parse(&["--period-ms", "100"]).is_ok());
        let cli = parse(&["--addr", "node1:5260"]).unwrap();
        assert!(source(&cli.top).unwrap_err().contains("TLS only"));
    }
}
