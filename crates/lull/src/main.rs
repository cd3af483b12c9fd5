//! `lull`: the binary. `lull serve` with no argument serves a 1 GiB memory
//! volume `vol0` on 127.0.0.1:10809.
//!
//! # Layout
//!
//! - `cli`: the command line: each subcommand's flags and the process
//!   around its run (`cli/serve` for `lull serve`).
//! - `control`: the RPC methods' side in the running server (JSON,
//!   locking, the node's record); the operations themselves are the
//!   volume layer's (`lull_volume::Storage`, `Snapshots`).
//! - `node`: the node's record of the volumes created over RPC.
//! - `storage`: the `Storage` factory (a volume's backend opened).

#![forbid(unsafe_code)]

mod cli;
mod control;
mod node;
mod storage;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "lull",
    version,
    about = "A user-space, replicated block storage engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve volumes over NBD (and NVMe/TCP with --nvmf-listen).
    // Boxed: its many flags make it far larger than the other variants.
    Serve(Box<cli::serve::ServeArgs>),
    /// Serve one replica of a replicated volume.
    Replica(cli::replica::ReplicaArgs),
    /// Call a JSON-RPC method of a running server.
    Rpc(cli::rpc::RpcArgs),
    /// Measure lull in each mode against peer NBD servers with fio, or
    /// (--profile nvmf) against SPDK's nvmf_tgt with spdk_nvme_perf.
    Bench(cli::bench::BenchArgs),
    /// A live terminal view of a running server: reactors, threads,
    /// volumes, replicas (--once: a plain-text snapshot).
    Top(cli::top::TopArgs),
    /// The Kubernetes CSI plugin: Identity, Controller and Node services
    /// over gRPC on a Unix socket (docs/KUBERNETES.md).
    Csi(cli::csi::CsiArgs),
    /// Backups of a running server's volumes: targets, create, list,
    /// restore, verify, delete, expose (the backup_* RPC methods).
    Backup(cli::backup::BackupArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match cli.command {
        Command::Serve(args) => cli::serve::run(*args),
        Command::Replica(args) => cli::replica::run(&args),
        Command::Rpc(args) => cli::rpc::run(&args),
        Command::Bench(args) => cli::bench::run(&args),
        Command::Top(args) => cli::top::run(&args),
        Command::Csi(args) => cli::csi::run(&args),
        Command::Backup(args) => cli::backup::run(&args),
    }
}
