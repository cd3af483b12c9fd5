//! Attach methods: how a volume's engine, running in this node's daemon,
//! becomes a block device on this node.
//!
//! | method | how | needs |
//! |---|---|---|
//! | `fuse` | libnbd's `nbdfuse` shows the volume's NBD export as one file, `losetup` makes the file a loop device | /dev/fuse, loop devices, nbdfuse (libnbd-bin), losetup |
//! | `nbd` | the kernel's nbd client | the `nbd` kernel module |
//! | `nvme-tcp` | the kernel's NVMe/TCP initiator (`nvme connect`) | the `nvme_tcp` kernel module |
//!
//! A method the kernel cannot do is refused with the reason before
//! anything is attached. `fuse` is built; `nbd` and `nvme-tcp` are checked
//! and, where the kernel has them, refused as not built yet.
//!
//! ```text
//! <state>/<volume>/fuse/disk   nbdfuse's view of nbd://<node nbd>/<volume>
//! <state>/<volume>/nbdfuse.pid written by nbdfuse once the file is served
//! /dev/loopN                   losetup of that file: the volume's device
//! ```

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::Command;

use crate::cmd::{self, CmdError};
use crate::mounts;

/// How long nbdfuse may take to serve its file (connect and NBD
/// handshake with the local daemon, then the FUSE mount): seconds at
/// most on a healthy node.
pub const FUSE_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest wait between two looks at nbdfuse's mount or a loop
/// device's release (the first come sooner: `crate::Backoff`): short
/// against [`FUSE_READY_TIMEOUT`], long against the cost of reading
/// mountinfo.
const STATE_POLL_INTERVAL: Duration = Duration::from_millis(50);

/// How long a detached loop device may take to let go of its file
/// (autoclear happens when its last opener closes it).
pub const LOOP_RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the unmount of nbdfuse's mount is tried again while the
/// kernel says it is busy. `losetup -j` stops naming the FUSE file a
/// moment before the kernel lets go of it: the loop driver clears the
/// device's backing file, announces the change, then drops its reference
/// (`__loop_clr_fd`, drivers/block/loop.c), and a detached device is
/// cleared only at its last close, which may be another process's
/// (`losetup -j` opens every bound loop device to read its status, so
/// volumes unstaged at once open each other's). A stress of 200 such
/// unmounts at once met "target is busy" once, and the next try 2 ms
/// later succeeded; 5 s is far above that under any load, and a file
/// someone really holds open still fails the unstage then (the CO
/// retries it).
pub const FUSE_UNMOUNT_BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The method a node plugin attaches with (`lull csi --attach`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Fuse,
    Nbd,
    NvmeTcp,
}

impl Method {
    pub fn parse(s: &str) -> Option<Method> {
        match s {
            "fuse" => Some(Method::Fuse),
            "nbd" => Some(Method::Nbd),
            "nvme-tcp" => Some(Method::NvmeTcp),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Method::Fuse => "fuse",
            Method::Nbd => "nbd",
            Method::NvmeTcp => "nvme-tcp",
        }
    }

    /// Whether this machine can attach with the method; the error is the
    /// reason, for the operator.
    pub fn check(self) -> Result<(), String> {
        match self {
            Method::Fuse => {
                for (path, what) in [
                    ("/dev/fuse", "FUSE (the fuse module)"),
                    ("/dev/loop-control", "loop devices (the loop module)"),
                ] {
                    if !Path::new(path).exists() {
                        return Err(format!("attach method fuse: no {path}: this kernel has no {what}"));
                    }
                }
                for tool in ["nbdfuse", "losetup"] {
                    if !cmd::installed(tool) {
                        return Err(format!(
                            "attach method fuse: {tool} is not installed (Debian package {})",
                            cmd::package_of(tool)
                        ));
                    }
                }
                Ok(())
            }
            Method::Nbd => kernel_module("nbd", "/dev/nbd0").and(Err(
                "attach method nbd: the kernel has the nbd module, but this plugin does not attach with it yet; use --attach fuse".into(),
            )),
            Method::NvmeTcp => kernel_module("nvme_tcp", "/dev/nvme-fabrics").and(Err(
                "attach method nvme-tcp: the kernel has nvme_tcp, but this plugin does not attach with it yet; use --attach fuse".into(),
            )),
        }
    }
}

fn kernel_module(module: &str, dev: &str) -> Result<(), String> {
    if Path::new("/sys/module").join(module).exists() || Path::new(dev).exists() {
        Ok(())
    } else {
        Err(format!(
            "this kernel has no {module} module loaded (no /sys/module/{module}, no {dev}; `modprobe {module}` on the host, or use --attach fuse)"
        ))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(transparent)]
    Tool(#[from] CmdError),
    #[error("{path}: {source}", path = path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("nbdfuse for {uri} exited before serving its file: {log}")]
    FuseExited { uri: String, log: String },
    #[error("nbdfuse for {uri} did not serve its file within {FUSE_READY_TIMEOUT:?}: {log}")]
    FuseTimeout { uri: String, log: String },
    #[error("loop devices {devices:?} still hold {file} {LOOP_RELEASE_TIMEOUT:?} after their detach (a process still has them open)", file = file.display())]
    LoopBusy { file: PathBuf, devices: Vec<String> },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> AttachError + '_ {
    move |source| AttachError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A volume's files under the plugin's state directory.
#[derive(Debug, Clone)]
pub struct FuseDirs {
    pub dir: PathBuf,
    pub mount: PathBuf,
    pub file: PathBuf,
    pub pid: PathBuf,
    pub log: PathBuf,
}

impl FuseDirs {
    pub fn new(state_dir: &Path, volume: &str) -> FuseDirs {
        let dir = state_dir.join(volume);
        let mount = dir.join("fuse");
        FuseDirs {
            file: mount.join("disk"),
            pid: dir.join("nbdfuse.pid"),
            log: dir.join("nbdfuse.log"),
            mount,
            dir,
        }
    }
}

async fn fuse_mounted(dirs: &FuseDirs) -> Result<bool, AttachError> {
    Ok(mounts::mounted_at(&dirs.mount)
        .map_err(io_err(&dirs.mount))?
        .is_some_and(|m| m.fs_type.starts_with("fuse")))
}

/// Attaches `volume` (an export of the NBD server at `nbd_addr`) with
/// nbdfuse and a loop device; returns the device. Attaching an attached
/// volume returns its device.
pub async fn fuse_attach(
    dirs: &FuseDirs,
    nbd_addr: &str,
    volume: &str,
) -> Result<String, AttachError> {
    std::fs::create_dir_all(&dirs.mount).map_err(io_err(&dirs.mount))?;
    let uri = format!("nbd://{nbd_addr}/{volume}");
    if !fuse_mounted(dirs).await? {
        let _ = std::fs::remove_file(&dirs.pid);
        let log = std::fs::File::create(&dirs.log).map_err(io_err(&dirs.log))?;
        let log2 = log.try_clone().map_err(io_err(&dirs.log))?;
        // nbdfuse stays in the foreground serving the file; it outlives
        // this call (tokio reaps it when it exits) and ends when its
        // mount is unmounted at unstage.
        let mut child = Command::new("nbdfuse")
            .arg("-P")
            .arg(&dirs.pid)
            .arg(&dirs.file)
            .arg(&uri)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0)
            .spawn()
            .map_err(|e| cmd::spawn_error("nbdfuse", e))?;
        let deadline = Instant::now() + FUSE_READY_TIMEOUT;
        let mut backoff = crate::Backoff::new(STATE_POLL_INTERVAL);
        loop {
            if dirs.pid.exists() && fuse_mounted(dirs).await? {
                break;
            }
            if let Ok(Some(_)) = child.try_wait() {
                return Err(AttachError::FuseExited {
                    uri,
                    log: read_log(&dirs.log),
                });
            }
            if Instant::now() >= deadline {
                let _ = child.start_kill();
                return Err(AttachError::FuseTimeout {
                    uri,
                    log: read_log(&dirs.log),
                });
            }
            backoff.wait().await;
        }
    }
    if let Some(dev) = loops_of(&dirs.file).await?.into_iter().next() {
        return Ok(dev);
    }
    let file = dirs.file.as_os_str();
    let out = cmd::run(
        "losetup",
        &[
            std::ffi::OsStr::new("--find"),
            std::ffi::OsStr::new("--show"),
            file,
        ],
    )
    .await?;
    Ok(out.trim().to_string())
}

/// Undoes [`fuse_attach`]: every loop device of the file detached, the
/// FUSE mount unmounted (nbdfuse exits), the volume's directory removed.
/// Detaching what is not attached succeeds.
pub async fn fuse_detach(dirs: &FuseDirs) -> Result<(), AttachError> {
    if fuse_mounted(dirs).await? {
        for dev in loops_of(&dirs.file).await? {
            match cmd::run("losetup", &["-d", &dev]).await {
                Ok(_) => {}
                // Gone between the listing and the detach.
                Err(e) if e.exit_code() == Some(1) && !Path::new(&dev).exists() => {}
                Err(e) => return Err(e.into()),
            }
        }
        let deadline = Instant::now() + LOOP_RELEASE_TIMEOUT;
        let mut backoff = crate::Backoff::new(STATE_POLL_INTERVAL);
        loop {
            let left = loops_of(&dirs.file).await?;
            if left.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                return Err(AttachError::LoopBusy {
                    file: dirs.file.clone(),
                    devices: left,
                });
            }
            backoff.wait().await;
        }
        unmount_fuse(&dirs.mount).await?;
    }
    for file in [&dirs.pid, &dirs.log] {
        match std::fs::remove_file(file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(file)(e)),
            _ => {}
        }
    }
    for dir in [&dirs.mount, &dirs.dir] {
        match std::fs::remove_dir(dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err(dir)(e)),
            _ => {}
        }
    }
    Ok(())
}

/// Unmounts nbdfuse's mount (nbdfuse exits), trying again while it is
/// busy for up to [`FUSE_UNMOUNT_BUSY_TIMEOUT`].
async fn unmount_fuse(mount: &Path) -> Result<(), AttachError> {
    let deadline = Instant::now() + FUSE_UNMOUNT_BUSY_TIMEOUT;
    let mut backoff = crate::Backoff::new(STATE_POLL_INTERVAL);
    loop {
        match cmd::run("umount", &[mount.as_os_str()]).await {
            Ok(_) => return Ok(()),
            Err(e) if e.says_busy() && Instant::now() < deadline => {
                tracing::debug!(mount = %mount.display(), error = %e, "FUSE mount busy; unmounting again");
                backoff.wait().await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// The loop devices backed by `file` (`losetup -j`).
pub async fn loops_of(file: &Path) -> Result<Vec<String>, AttachError> {
    let out = cmd::run("losetup", &[std::ffi::OsStr::new("-j"), file.as_os_str()]).await?;
    Ok(parse_losetup_j(&out))
}

/// `/dev/loop0: [0039]:2 (/path)` lines to device names.
fn parse_losetup_j(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.split_once(':').map(|(dev, _)| dev.trim().to_string()))
        .filter(|dev| dev.starts_with("/dev/"))
        .collect()
}

/// The last lines of nbdfuse's log, for an error message.
fn read_log(path: &Path) -> String {
    const TAIL_BYTES: usize = 1024;
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let text = text.trim();
    let mut start = text.len().saturating_sub(TAIL_BYTES);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    if text.is_empty() {
        "(no output)".into()
    } else {
        text[start..].to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_losetup_listing() {
        let out = "/dev/loop0: [0039]:2 (/var/lib/x/fuse/disk)\n/dev/loop3: [0039]:2 (/var/lib/x/fuse/disk)\n";
        assert_eq!(parse_losetup_j(out), ["/dev/loop0", "/dev/loop3"]);
        assert!(parse_losetup_j("").is_empty());
    }

    #[test]
    fn methods_parse_and_refuse_with_a_reason() {
        assert_eq!(Method::parse("fuse"), Some(Method::Fuse));
        assert_eq!(Method::parse("nvme-tcp"), Some(Method::NvmeTcp));
        assert_eq!(Method::parse("iscsi"), None);
        // Either the module is missing (named) or the method is not
        // built (named): never Ok for these two.
        for m in [Method::Nbd, Method::NvmeTcp] {
            let reason = m.check().unwrap_err();
            assert!(
                reason.contains("module") || reason.contains("not attach"),
                "{reason}"
            );
        }
    }
}
