//! `lull backup ...`: the backup methods of a running server
//! (`backup_*`, crates/backup), one subcommand each, called as `lull rpc`
//! calls them, the result printed as JSON.
//!
//! ```text
//! $ lull backup target-add s3 's3://backups/a?endpoint=https://s3.local:9000' --credentials-file /etc/lull/s3
//! $ lull backup create vol0 --target s3 --wait
//! $ lull backup list --target s3 --volume vol0
//! $ lull backup restore --target s3 bk-1764000000000-1a2b3c4d vol0-restored --wait
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use lull_rpc::{DEFAULT_CLIENT_TIMEOUT_S, DEFAULT_RPC_SOCKET};
use serde_json::{json, Value};

use crate::cli::rpc::{self, RpcArgs};

/// How long a `--wait` call waits for its job (the server's own limit,
/// `lull_backup::rpc::MAX_WAIT`, with a minute to spare).
const WAIT_TIMEOUT_S: f64 = 3660.0;

#[derive(clap::Args, Debug, Clone)]
pub struct BackupArgs {
    /// The server's Unix socket.
    #[arg(short = 's', long, default_value = DEFAULT_RPC_SOCKET)]
    pub socket: PathBuf,
    #[command(subcommand)]
    pub command: BackupCommand,
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum BackupCommand {
    /// Add a backup target: s3://BUCKET/PREFIX?endpoint=URL&region=R or file:///DIR.
    TargetAdd {
        name: String,
        url: String,
        /// access_key_id and secret_access_key (KEY = VALUE lines).
        #[arg(long)]
        credentials_file: Option<PathBuf>,
        /// CA certificates (PEM) the S3 endpoint's certificate chains to.
        #[arg(long)]
        ca_file: Option<PathBuf>,
        /// 32 bytes (raw or 64 hex digits): chunks encrypted with AES-256-GCM.
        #[arg(long)]
        key_file: Option<PathBuf>,
    },
    /// The node's backup targets (never their secrets).
    TargetList,
    /// Forget a target (its backups stay on it).
    TargetRemove { name: String },
    /// Back a volume up (a new snapshot unless --snapshot names one).
    Create {
        volume: String,
        #[arg(long)]
        target: String,
        #[arg(long)]
        snapshot: Option<String>,
        /// Upload limit, MB/s.
        #[arg(long, value_name = "MB_PER_S")]
        bandwidth: Option<u64>,
        /// Wait for the backup to finish.
        #[arg(long)]
        wait: bool,
    },
    /// The backups on a target, oldest first.
    List {
        #[arg(long)]
        target: String,
        #[arg(long)]
        volume: Option<String>,
    },
    /// One backup's summary.
    Get {
        #[arg(long)]
        target: String,
        id: String,
    },
    /// Delete a backup, then the chunks no other backup holds.
    Delete {
        #[arg(long)]
        target: String,
        id: String,
        /// Leave the garbage for a later `gc`.
        #[arg(long)]
        no_gc: bool,
    },
    /// Delete every chunk no backup holds.
    Gc {
        #[arg(long)]
        target: String,
    },
    /// Fetch and hash every chunk of a backup again.
    Verify {
        #[arg(long)]
        target: String,
        id: String,
        #[arg(long)]
        wait: bool,
    },
    /// Restore a backup into a new volume.
    Restore {
        #[arg(long)]
        target: String,
        id: String,
        name: String,
        /// As volume_create takes it: malloc, file=PATH, replicas=...
        #[arg(long, default_value = "malloc")]
        backend: String,
        #[arg(long)]
        wait: bool,
    },
    /// Running and recent backup jobs.
    Jobs,
    /// One job (backup-ID, restore-ID, verify-ID).
    Job {
        id: String,
        #[arg(long)]
        wait: bool,
    },
    /// Serve a backup read-only (NBD, NVMe/TCP) before it is restored.
    Expose {
        #[arg(long)]
        target: String,
        id: String,
        /// The export's name [default: the backup's id].
        #[arg(long)]
        name: Option<String>,
    },
    /// Stop serving an exposed backup.
    Unexpose { name: String },
}

fn opt<T: serde::Serialize>(v: &mut Value, key: &str, x: &Option<T>) {
    if let Some(x) = x {
        v[key] = json!(x);
    }
}

/// The method and parameters a subcommand calls, and whether it waits.
fn call_of(c: &BackupCommand) -> (&'static str, Value, bool) {
    use BackupCommand as B;
    match c {
        B::TargetAdd {
            name,
            url,
            credentials_file,
            ca_file,
            key_file,
        } => {
            let mut p = json!({"name": name, "url": url});
            opt(&mut p, "credentials_file", credentials_file);
            opt(&mut p, "ca_file", ca_file);
            opt(&mut p, "key_file", key_file);
            ("backup_target_add", p, false)
        }
        B::TargetList => ("backup_target_list", json!({}), false),
        B::TargetRemove { name } => ("backup_target_remove", json!({"name": name}), false),
        B::Create {
            volume,
            target,
            snapshot,
            bandwidth,
            wait,
        } => {
            let mut p = json!({"volume": volume, "target": target, "wait": wait});
            opt(&mut p, "snapshot", snapshot);
            opt(&mut p, "bandwidth_mbytes_per_sec", bandwidth);
            ("backup_create", p, *wait)
        }
        B::List { target, volume } => {
            let mut p = json!({"target": target});
            opt(&mut p, "volume", volume);
            ("backup_list", p, false)
        }
        B::Get { target, id } => ("backup_get", json!({"target": target, "id": id}), false),
        B::Delete { target, id, no_gc } => (
            "backup_delete",
            json!({"target": target, "id": id, "gc": !no_gc}),
            false,
        ),
        B::Gc { target } => ("backup_gc", json!({"target": target}), false),
        B::Verify { target, id, wait } => (
            "backup_verify",
            json!({"target": target, "id": id, "wait": wait}),
            *wait,
        ),
        B::Restore {
            target,
            id,
            name,
            backend,
            wait,
        } => (
            "backup_restore",
            json!({"target": target, "backup": id, "name": name, "backend": backend, "wait": wait}),
            *wait,
        ),
        B::Jobs => ("backup_job_list", json!({}), false),
        B::Job { id, wait } => ("backup_job_get", json!({"id": id, "wait": wait}), *wait),
        B::Expose { target, id, name } => {
            let mut p = json!({"target": target, "backup": id});
            opt(&mut p, "name", name);
            ("backup_expose", p, false)
        }
        B::Unexpose { name } => ("backup_unexpose", json!({"name": name}), false),
    }
}

pub fn run(args: &BackupArgs) -> ExitCode {
    let (method, params, wait) = call_of(&args.command);
    rpc::run(&RpcArgs {
        socket: args.socket.clone(),
        addr: None,
        tls_psk: None,
        tls_certs: None,
        timeout_s: if wait {
            WAIT_TIMEOUT_S
        } else {
            DEFAULT_CLIENT_TIMEOUT_S
        },
        method: method.to_string(),
        params: Some(params.to_string()),
    })
}
