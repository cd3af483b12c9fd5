//! The node's tools (mount, losetup, mkfs, blkid, nbdfuse, nvme,
//! nbd-client) run as child processes with a deadline; a missing tool is
//! named with its Debian package.
//!
//! ```ignore
//! let dev = run("losetup", &["--find", "--show", file]).await?;
//! ```

use std::ffi::OsStr;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::Command;

/// How long one tool may run. mkfs.ext4 with lazy inode tables and
/// mkfs.xfs finish in seconds on any size; a mount through FUSE waits
/// for the NBD connection. Two minutes is far above both and still ends
/// a call before a CO gives up on it.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

/// Most bytes of a tool's stderr kept in an error message.
const MAX_STDERR_BYTES: usize = 2048;

#[derive(Debug, thiserror::Error)]
pub enum CmdError {
    #[error("{program} is not installed (Debian package {package})")]
    Missing {
        program: String,
        package: &'static str,
    },
    #[error("{program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    #[error("{cmdline} did not finish within {TOOL_TIMEOUT:?}")]
    Timeout { cmdline: String },
    #[error("{cmdline} failed ({status}): {stderr}")]
    Failed {
        cmdline: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
}

impl CmdError {
    /// Whether a tool that ran and failed said its target is busy
    /// (umount's "target is busy", EBUSY's "Device or resource busy").
    pub fn says_busy(&self) -> bool {
        matches!(self, CmdError::Failed { stderr, .. } if stderr.contains("busy"))
    }

    /// The exit code of a tool that ran and failed.
    pub fn exit_code(&self) -> Option<i32> {
        match self {
            CmdError::Failed { status, .. } => status.code(),
            _ => None,
        }
    }
}

/// The Debian package that ships `program` (a name, or a path to it).
pub fn package_of(program: &str) -> &'static str {
    let name = std::path::Path::new(program)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(program);
    match name {
        "nbdfuse" => "libnbd-bin",
        "nvme" => "nvme-cli",
        "nbd-client" => "nbd-client",
        "modprobe" => "kmod",
        "mkfs.ext4" | "resize2fs" | "e2fsck" | "dumpe2fs" => "e2fsprogs",
        "mkfs.xfs" | "xfs_growfs" => "xfsprogs",
        "mount" | "umount" => "mount",
        _ => "util-linux",
    }
}

/// Runs `program args` and returns its stdout; any exit but 0 is an error
/// carrying the command line and stderr.
pub async fn run<S: AsRef<OsStr>>(program: &str, args: &[S]) -> Result<String, CmdError> {
    let cmdline = std::iter::once(program.to_string())
        .chain(
            args.iter()
                .map(|a| a.as_ref().to_string_lossy().into_owned()),
        )
        .collect::<Vec<_>>()
        .join(" ");
    let child = Command::new(program)
        .args(args)
        // Messages in one language: the plugin reads some
        // (`CmdError::says_busy`), and its errors are in English.
        .env("LC_ALL", "C")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| spawn_error(program, source))?;
    let out = match tokio::time::timeout(TOOL_TIMEOUT, child.wait_with_output()).await {
        Ok(out) => out.map_err(|source| spawn_error(program, source))?,
        Err(_) => return Err(CmdError::Timeout { cmdline }),
    };
    if !out.status.success() {
        let mut stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if stderr.len() > MAX_STDERR_BYTES {
            let mut cut = MAX_STDERR_BYTES;
            while !stderr.is_char_boundary(cut) {
                cut -= 1;
            }
            stderr.truncate(cut);
        }
        return Err(CmdError::Failed {
            cmdline,
            status: out.status,
            stderr,
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether `program` is on the PATH (or, given as a path, is a file).
pub fn installed(program: &str) -> bool {
    if program.contains('/') {
        return std::path::Path::new(program).is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

pub fn spawn_error(program: &str, source: std::io::Error) -> CmdError {
    if source.kind() == std::io::ErrorKind::NotFound {
        CmdError::Missing {
            program: program.to_string(),
            package: package_of(program),
        }
    } else {
        CmdError::Spawn {
            program: program.to_string(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn output_failure_and_missing_tools() {
        assert_eq!(run("echo", &["hi"]).await.unwrap(), "hi\n");
        let err = run("sh", &["-c", "echo oops >&2; exit 3"])
            .await
            .unwrap_err();
        assert_eq!(err.exit_code(), Some(3));
        assert!(!err.says_busy());
        assert!(err.to_string().contains("oops"), "{err}");
        let err = run(
            "sh",
            &["-c", "echo 'umount: /x: target is busy.' >&2; exit 32"],
        )
        .await
        .unwrap_err();
        assert!(err.says_busy(), "{err}");
        let err = run("no-such-tool-lull", &["x"]).await.unwrap_err();
        assert!(matches!(err, CmdError::Missing { .. }), "{err}");
        assert!(installed("sh"));
        assert!(installed("/bin/sh"));
        assert!(!installed("no-such-tool-lull"));
        assert!(!installed("/no/such/tool"));
        assert_eq!(package_of("/usr/sbin/nvme"), "nvme-cli");
        assert_eq!(package_of("nbd-client"), "nbd-client");
    }
}
