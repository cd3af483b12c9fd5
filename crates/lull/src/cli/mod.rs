//! The command line: each subcommand's clap arguments, their resolution
//! into the typed configurations of the library crates, and the process
//! around a run (signals, the output lines, exit codes). The library
//! crates know nothing of clap, signals or exit codes.
//!
//! | command | flags and process | library it drives |
//! |---|---|---|
//! | `lull serve` | [`serve`] (settings from the `config` crate, volumes from `crate::storage`, RPC methods in `crate::control`) | `nbd`, `nvmf`, `engine`, `replica`, `rpc` |
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
//! - `serve`: `lull serve`.
//! - `signals`: the stop signals of the long-running commands.
//! - `top`: `lull top`.

pub(crate) mod backup;
pub(crate) mod bench;
mod choice;
pub(crate) mod csi;
pub(crate) mod replica;
pub(crate) mod rpc;
pub(crate) mod serve;
pub(crate) mod signals;
pub(crate) mod top;

use std::process::ExitCode;

use lull_reactor::FrameworkConfig;

/// Exit code for bad flags or configuration (as clap uses for bad flags).
pub(crate) const EXIT_USAGE: u8 = 2;

/// Prints `msg` as lull's usage error and gives [`EXIT_USAGE`].
pub(crate) fn usage_error(msg: impl std::fmt::Display) -> ExitCode {
    eprintln!("lull: error: {msg}");
    ExitCode::from(EXIT_USAGE)
}

const _: () =
    assert!(lull_config::FIXED_BUFFERS_MIB_DEFAULT << 20 == lull_uring::ARENA_BYTES_DEFAULT as u64);
const _: () =
    assert!(lull_config::FIXED_BUFFERS_MIB_MAX << 20 == lull_uring::ARENA_BYTES_MAX as u64);

/// `framework` with the io_uring hooks filled in: every reactor maps
/// `mib` MiB of fixed I/O buffers on its own thread when it starts (none
/// with 0), and reports them and the io_uring_enter calls made on its
/// thread in its stats. Pass the result to `Framework::start`.
pub(crate) fn init_fixed_buffers(mib: u64, framework: FrameworkConfig) -> FrameworkConfig {
    lull_uring::set_reactor_arena_bytes((mib << 20) as usize);
    let framework = FrameworkConfig {
        io_uring_enter_source: Some(lull_uring::thread_enter_calls),
        reactor_start_hook: Some(|_reactor| {
            let _ = lull_uring::init_thread_arena();
        }),
        fixed_buffer_source: Some(|| {
            lull_uring::thread_arena_stats().map_or(Default::default(), |a| {
                lull_reactor::FixedBufferUsage {
                    bytes: a.bytes as u64,
                    in_use_bytes: a.in_use_bytes as u64,
                    locked: a.locked,
                }
            })
        }),
        ..framework
    };
    if mib > 0 {
        tracing::info!(
            mib_per_reactor = mib,
            memlock_limit_bytes = ?lull_uring::memlock_limit_bytes(),
            "fixed I/O buffers: prefaulted, registered with io_uring"
        );
    }
    framework
}
