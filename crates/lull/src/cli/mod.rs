//! The command line: each subcommand's clap arguments, their resolution
//! into the typed configurations of the library crates, and the process
//! around a run (signals, the output lines, exit codes). The library
//! crates know nothing of clap, signals or exit codes.
//!
//! | command | flags and process | library it drives |
//! |---|---|---|
//! | `lull serve` | `main.rs` (settings from the `config` crate) | `nbd`, `engine`, `rpc` |
//! | `lull replica` | [`replica`] | `lull_replica::ReplicaServer` |
//! | `lull rpc` | [`rpc`] | `lull_rpc::call` |
//! | `lull bench` | [`bench`] | `lull_bench::run` |
//! | `lull top` | [`top`] | `lull_rpc::call`, `call_tcp` (read-only) |
//! | `lull csi` | [`csi`] | `lull_csi::run` |
//! | `lull backup` | [`backup`] | `lull_rpc::call` (the `backup_*` methods) |
//!
//! # Layout
//!
//! - `backup`: `lull backup`.
//! - `bench`: `lull bench`.
//! - `choice`: command-line names of library enums (`--mode`, ...).
//! - `csi`: `lull csi`.
//! - `replica`: `lull replica`.
//! - `rpc`: `lull rpc`.
//! - `signals`: the stop signals of the long-running commands.
//! - `top`: `lull top`.

pub(crate) mod backup;
pub(crate) mod bench;
mod choice;
pub(crate) mod csi;
pub(crate) mod replica;
pub(crate) mod rpc;
pub(crate) mod signals;
pub(crate) mod top;

use std::process::ExitCode;

/// Exit code for bad flags or configuration (as clap uses for bad flags).
pub(crate) const EXIT_USAGE: u8 = 2;

/// Prints `msg` as lull's usage error and gives [`EXIT_USAGE`].
pub(crate) fn usage_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("lull: error: {msg}");
    ExitCode::from(EXIT_USAGE)
}
