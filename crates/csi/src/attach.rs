//! Attach methods: how a volume's engine, running in this node's daemon,
//! becomes a block device on this node, and how that is undone.
//!
//! | method | how | needs | undone by |
//! |---|---|---|---|
//! | `fuse` | libnbd's `nbdfuse` shows the volume's NBD export as one file, `losetup` makes the file a loop device | /dev/fuse, loop devices, nbdfuse (libnbd-bin), losetup | `losetup -d`, unmount of the FUSE file (nbdfuse exits) |
//! | `nbd` | the kernel's nbd client: `nbd-client -N VOLUME HOST PORT /dev/nbdN` on a free device (no `/sys/block/nbdN/pid`) | the `nbd` module, nbd-client | `nbd-client -d /dev/nbdN` |
//! | `nvme-tcp` | the kernel's NVMe/TCP initiator: `nvme connect -t tcp -a ADDR -s PORT -n NQN` to the daemon's target, the engine exported under the volume's NQN | the `nvme_tcp` module, /dev/nvme-fabrics, nvme-cli | `nvme disconnect -n NQN` |
//!
//! A method the kernel cannot do ([`Method::check`]: the module is
//! missing and one `modprobe` did not load it, a device node or tool is
//! missing) is refused with the reason before anything is created. The
//! node service undoes a stage that fails after its engine was created:
//! the attach is detached and the volume's state directory removed, so a
//! volume is never left half-attached.
//!
//! What each method attached is recorded under the plugin's state
//! directory, one directory per volume, before the kernel is asked, so
//! that unstage undoes exactly that (also after a restart of the plugin,
//! or with another `--attach` given since):
//!
//! ```text
//! <state>/<volume>/fuse/disk     nbdfuse's view of nbd://<node nbd>/<volume>
//! <state>/<volume>/nbdfuse.pid   written by nbdfuse once the file is served
//! /dev/loopN                     losetup of that file: the fuse device
//! <state>/<volume>/nbd.json      {"device": "nbd3", "host", "port", "export"}
//! <state>/<volume>/nvme-tcp.json {"nqn", "traddr", "trsvcid", "hostnqn"}
//! ```
//!
//! Where the kernel's state is read from (sysfs, /dev) and which tools
//! run (`nvme`, `nbd-client`, `modprobe`) is a [`Host`]: the real node by
//! default. The tests of `nbd` and `nvme-tcp` (crates/csi/tests/attach.rs)
//! give a fake sysfs tree and fake tools that record their argv: they
//! prove the plugin's logic (the commands it runs, what it records, waits
//! for and undoes, idempotency, the clean-up of a failed stage), not the
//! kernel's side. The machines this was built on have no `nbd` or
//! `nvme_tcp` module: there the refusal is tested for real; the kernel
//! path of both methods runs in the kernel tier's VM (Debian's kernel:
//! crates/csi/tests/kernel.rs, scripts/kernel-vm.d/tests/60-csi.sh).
//!
//! # Layout
//!
//! - `nbd`: the kernel's nbd client connected to this node's daemon.
//! - `nvme_tcp`: the kernel's NVMe/TCP initiator (`nvme connect`).

mod nbd;
mod nvme_tcp;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::Command;

use crate::cmd::{self, CmdError};
use crate::mounts;

pub use nbd::{NBD_CONNECT_TIMEOUT, NBD_DISCONNECT_TIMEOUT};
pub use nvme_tcp::{
    nqn_of, NQN_PREFIX, NVME_DISCONNECT_TIMEOUT, NVME_NAMESPACE_TIMEOUT, NVME_RESCAN_TIMEOUT,
};

/// How long nbdfuse may take to serve its file (connect and NBD
/// handshake with the local daemon, then the FUSE mount): seconds at
/// most on a healthy node.
pub const FUSE_READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest wait between two looks at a state the kernel or a tool
/// changes (nbdfuse's mount, a loop device's release, a namespace's
/// device, an nbd device's pid; the first looks come sooner:
/// `crate::Backoff`): short against the timeouts, long against the cost
/// of a look.
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

/// What the attach methods touch on the node: sysfs, the device nodes,
/// nvme-cli's host NQN file and the tools that talk to the kernel.
/// [`Host::default`] is the real node. A test gives a fake sysfs tree,
/// a fake /dev and fake tools, which proves the plugin's logic, not the
/// kernel's side (module doc).
#[derive(Debug, Clone)]
pub struct Host {
    /// sysfs: `/sys`.
    pub sys: PathBuf,
    /// The device nodes: `/dev`.
    pub dev: PathBuf,
    /// This host's NVMe host NQN (nvme-cli's): `/etc/nvme/hostnqn`. When
    /// present the plugin connects with it and lets only it connect to
    /// the volume's subsystem; when absent, nvme-cli picks one and the
    /// subsystem takes any host.
    pub hostnqn_file: PathBuf,
    /// nvme-cli's `nvme` (a name on the PATH, or a path).
    pub nvme: String,
    /// `nbd-client`.
    pub nbd_client: String,
    /// `modprobe`, tried once when a method's module is not loaded.
    pub modprobe: String,
}

impl Default for Host {
    fn default() -> Host {
        Host {
            sys: PathBuf::from("/sys"),
            dev: PathBuf::from("/dev"),
            hostnqn_file: PathBuf::from("/etc/nvme/hostnqn"),
            nvme: "nvme".into(),
            nbd_client: "nbd-client".into(),
            modprobe: "modprobe".into(),
        }
    }
}

impl Host {
    /// The host NQN from [`Host::hostnqn_file`], when it holds one.
    pub fn host_nqn(&self) -> Result<Option<String>, AttachError> {
        match std::fs::read_to_string(&self.hostnqn_file) {
            Ok(s) => {
                let nqn = s.trim();
                Ok((!nqn.is_empty()).then(|| nqn.to_string()))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&self.hostnqn_file)(e)),
        }
    }
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
    /// reason, for the operator. A kernel module that is not loaded is
    /// asked for once (`modprobe`) before the method is refused.
    pub async fn check(self, host: &Host) -> Result<(), String> {
        let name = self.name();
        let (module, devices, tools): (Option<&str>, Vec<(PathBuf, &str)>, Vec<&str>) = match self {
            Method::Fuse => (
                None,
                vec![
                    (host.dev.join("fuse"), "FUSE (the fuse module)"),
                    (
                        host.dev.join("loop-control"),
                        "loop devices (the loop module)",
                    ),
                ],
                vec!["nbdfuse", "losetup"],
            ),
            Method::Nbd => (
                Some("nbd"),
                vec![(host.dev.join("nbd0"), "nbd devices (the nbd module)")],
                vec![host.nbd_client.as_str()],
            ),
            Method::NvmeTcp => (
                Some("nvme_tcp"),
                vec![(
                    host.dev.join("nvme-fabrics"),
                    "the NVMe over Fabrics device (the nvme_fabrics module)",
                )],
                vec![host.nvme.as_str()],
            ),
        };
        if let Some(module) = module {
            kernel_module(host, name, module).await?;
        }
        for (path, what) in devices {
            if !path.exists() {
                return Err(format!(
                    "attach method {name}: no {}: this node has no {what}{}",
                    path.display(),
                    if self == Method::Fuse {
                        ""
                    } else {
                        " (is the host's /dev mounted into the plugin's container?)"
                    }
                ));
            }
        }
        for tool in tools {
            if !cmd::installed(tool) {
                return Err(format!(
                    "attach method {name}: {tool} is not installed (Debian package {})",
                    cmd::package_of(tool)
                ));
            }
        }
        Ok(())
    }
}

/// Whether `module` is loaded (`/sys/module/NAME`, which a built-in
/// module with parameters has too); if not, `modprobe` is run once and
/// the kernel looked at again.
async fn kernel_module(host: &Host, method: &str, module: &str) -> Result<(), String> {
    let sys = host.sys.join("module").join(module);
    if sys.exists() {
        return Ok(());
    }
    let tried = match cmd::run(&host.modprobe, &[module]).await {
        Ok(_) => "ran".to_string(),
        Err(e) => e.to_string(),
    };
    if sys.exists() {
        tracing::info!(module, "kernel module loaded with modprobe");
        return Ok(());
    }
    Err(format!(
        "attach method {method}: this kernel has no {module} module loaded (no {}; modprobe {module}: {tried}); load it on the host (modprobe {module}), or use --attach fuse",
        sys.display()
    ))
}

/// Where the volume's engine serves it on this node's daemon: what an
/// attach connects to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Export {
    /// The daemon's NBD server (`HOST:PORT`), export named after the
    /// volume: the `fuse` and `nbd` methods.
    Nbd { addr: String },
    /// The daemon's NVMe/TCP target (`HOST:PORT`), the volume's
    /// subsystem `nqn`, connected as `hostnqn` (nvme-cli's own when
    /// none): the `nvme-tcp` method.
    Nvmf {
        addr: String,
        nqn: String,
        hostnqn: Option<String>,
    },
}

/// A volume's device on this node, and the method that attached it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attached {
    pub method: Method,
    pub device: String,
}

/// The node plugin's attach: the configured method, the node it acts
/// on, and the per-volume records under the state directory.
#[derive(Debug)]
pub struct Attacher {
    pub method: Method,
    pub host: Host,
    state_dir: PathBuf,
    /// Held while a free nbd device is chosen and connected: two volumes
    /// staged at once must not take the same one.
    nbd_pick: tokio::sync::Mutex<()>,
}

impl Attacher {
    pub fn new(method: Method, host: Host, state_dir: PathBuf) -> Attacher {
        Attacher {
            method,
            host,
            state_dir,
            nbd_pick: tokio::sync::Mutex::new(()),
        }
    }

    /// [`Method::check`] of the configured method on this node.
    pub async fn check(&self) -> Result<(), String> {
        self.method.check(&self.host).await
    }

    /// The volume's directory under the state directory.
    pub fn volume_dir(&self, volume: &str) -> PathBuf {
        self.state_dir.join(volume)
    }

    /// Attaches `volume` with the configured method; returns its device.
    /// Attaching an attached volume returns its device (the same one).
    /// What a failed attach set up is left for [`Attacher::detach`],
    /// which the node service runs on failure.
    pub async fn attach(&self, volume: &str, export: &Export) -> Result<String, AttachError> {
        let dir = self.volume_dir(volume);
        match (self.method, export) {
            (Method::Fuse, Export::Nbd { addr }) => {
                fuse_attach(&FuseDirs::new(&self.state_dir, volume), addr, volume).await
            }
            (Method::Nbd, Export::Nbd { addr }) => {
                nbd::attach(&self.host, &self.state_dir, volume, addr, &self.nbd_pick).await
            }
            (Method::NvmeTcp, Export::Nvmf { addr, nqn, hostnqn }) => {
                nvme_tcp::attach(&self.host, &dir, addr, nqn, hostnqn.as_deref()).await
            }
            (method, export) => Err(AttachError::Export {
                method: method.name(),
                export: format!("{export:?}"),
            }),
        }
    }

    /// The volume's attached device, by whichever method attached it
    /// (its record); `None` when it is not attached.
    pub async fn attached(&self, volume: &str) -> Result<Option<Attached>, AttachError> {
        let dir = self.volume_dir(volume);
        if let Some(device) = nvme_tcp::device(&self.host, &dir)? {
            return Ok(Some(Attached {
                method: Method::NvmeTcp,
                device,
            }));
        }
        if let Some(device) = nbd::device(&self.host, &dir)? {
            return Ok(Some(Attached {
                method: Method::Nbd,
                device,
            }));
        }
        let fuse = FuseDirs::new(&self.state_dir, volume);
        if fuse.mount.exists() {
            if let Some(device) = loops_of(&fuse.file).await?.into_iter().next() {
                return Ok(Some(Attached {
                    method: Method::Fuse,
                    device,
                }));
            }
        }
        Ok(None)
    }

    /// Undoes whatever is recorded for the volume (every method's
    /// record, whatever `--attach` says now), then removes its directory.
    /// Detaching what is not attached succeeds.
    pub async fn detach(&self, volume: &str) -> Result<(), AttachError> {
        let dir = self.volume_dir(volume);
        nvme_tcp::detach(&self.host, &dir).await?;
        nbd::detach(&self.host, &dir).await?;
        fuse_detach(&FuseDirs::new(&self.state_dir, volume)).await?;
        // A record's temporary file, left by a plugin that died while
        // writing it (the record itself was not written: nothing ran).
        for record in [nvme_tcp::RECORD_FILE, nbd::RECORD_FILE] {
            remove_file(&dir.join(format!(".{record}.tmp")))?;
        }
        match std::fs::remove_dir(&dir) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(&dir)(e)),
            _ => Ok(()),
        }
    }

    /// Asks the attached device to take the volume's new size: `fuse`
    /// `losetup -c` (the loop device rereads its file's size, which
    /// nbdfuse does not change: FUSE_GROWS_ONLY_AT_STAGE in the node
    /// service), `nvme-tcp` `nvme ns-rescan` of each controller (the
    /// kernel reads the namespace's size again, in the background), `nbd`
    /// nothing (the size is the NBD handshake's, set at connect).
    pub async fn refresh_size(&self, volume: &str, attached: &Attached) -> Result<(), AttachError> {
        match attached.method {
            Method::Fuse => {
                cmd::run("losetup", &["-c", &attached.device]).await?;
                Ok(())
            }
            Method::NvmeTcp => nvme_tcp::rescan(&self.host, &self.volume_dir(volume)).await,
            Method::Nbd => Ok(()),
        }
    }

    /// How many volumes this node can attach at once: the nbd devices the
    /// module made (`nbds_max`) for `nbd`; no limit of the plugin's own
    /// (0) for the others.
    pub fn max_volumes(&self) -> i64 {
        match self.method {
            Method::Nbd => i64::try_from(nbd::devices(&self.host).len()).unwrap_or(0),
            _ => 0,
        }
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
    #[error("attach method {method} cannot attach to {export} (a bug)")]
    Export {
        method: &'static str,
        export: String,
    },
    #[error("{what} {addr:?} is not HOST:PORT")]
    Address { what: &'static str, addr: String },
    #[error("{path}: {reason}", path = path.display())]
    Record { path: PathBuf, reason: String },
    #[error("nvme connect to {nqn} answered, but no namespace block device of it appeared within {NVME_NAMESPACE_TIMEOUT:?} (sysfs: {seen})")]
    NoNamespace { nqn: String, seen: String },
    #[error("{nqn} still has controllers {controllers:?} {NVME_DISCONNECT_TIMEOUT:?} after nvme disconnect")]
    StillConnected {
        nqn: String,
        controllers: Vec<String>,
    },
    #[error("{nqn} is connected already to {elsewhere:?}, not to this node's daemon at {addr} (another target serves the volume's NQN to this host: disconnect it first, nvme disconnect -n {nqn})")]
    ConnectedElsewhere {
        nqn: String,
        addr: String,
        elsewhere: Vec<String>,
    },
    #[error("no free nbd device: all of {count} are connected or taken by other volumes (the nbd module's nbds_max)")]
    NoFreeNbd { count: usize },
    #[error("{device}: nbd-client answered, but the kernel shows no connection (no {pid}) within {NBD_CONNECT_TIMEOUT:?}", pid = pid.display())]
    NbdNotConnected { device: String, pid: PathBuf },
    #[error("{device}: still connected {NBD_DISCONNECT_TIMEOUT:?} after nbd-client -d")]
    NbdStillConnected { device: String },
}

impl AttachError {
    /// The gRPC status of a failed attach or detach: what the node lacks
    /// (a tool, a free device, a usable address) FAILED_PRECONDITION or
    /// RESOURCE_EXHAUSTED, the rest INTERNAL; `volume` names it.
    pub fn status(&self, volume: &str, doing: &str) -> tonic::Status {
        let message = format!("volume {volume}: {doing}: {self}");
        match self {
            AttachError::Tool(CmdError::Missing { .. })
            | AttachError::Address { .. }
            | AttachError::ConnectedElsewhere { .. } => tonic::Status::failed_precondition(message),
            AttachError::NoFreeNbd { .. } => tonic::Status::resource_exhausted(message),
            _ => tonic::Status::internal(message),
        }
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> AttachError + '_ {
    move |source| AttachError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// `HOST:PORT` (`[V6]:PORT` too) to a host (without brackets) and a
/// port, as nvme-cli and nbd-client take them.
fn split_addr(what: &'static str, addr: &str) -> Result<(String, u16), AttachError> {
    let bad = || AttachError::Address {
        what,
        addr: addr.to_string(),
    };
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port: u16 = port.parse().map_err(|_| bad())?;
    if host.is_empty() || port == 0 {
        return Err(bad());
    }
    Ok((host.to_string(), port))
}

/// A method's record in a volume's directory; `None` when there is none.
fn read_json<T: serde::de::DeserializeOwned>(
    dir: &Path,
    file: &str,
) -> Result<Option<T>, AttachError> {
    let path = dir.join(file);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| AttachError::Record {
                path,
                reason: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(io_err(&path)(e)),
    }
}

/// Writes a record whole and durably (a temporary file, synced, renamed
/// over it, the directory synced) before the kernel is asked: a crash
/// leaves the old record or the new one, never a part.
fn write_json<T: serde::Serialize>(dir: &Path, file: &str, value: &T) -> Result<(), AttachError> {
    use std::io::Write;
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    let path = dir.join(file);
    let tmp = dir.join(format!(".{file}.tmp"));
    let bytes = serde_json::to_vec(value).expect("a record serializes");
    let mut f = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(&bytes)
        .and_then(|()| f.sync_all())
        .map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// Removes a file; one already gone is removed.
fn remove_file(path: &Path) -> Result<(), AttachError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(path)(e)),
        _ => Ok(()),
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
/// FUSE mount unmounted (nbdfuse exits), its files and mount point
/// removed (the volume's directory is [`Attacher::detach`]'s). Detaching
/// what is not attached succeeds.
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
    match std::fs::remove_dir(&dirs.mount) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_err(&dirs.mount)(e)),
        _ => Ok(()),
    }
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
    fn addresses_split() {
        let s = |a| split_addr("x", a);
        assert_eq!(s("127.0.0.1:4420").unwrap(), ("127.0.0.1".into(), 4420));
        assert_eq!(s("[::1]:4420").unwrap(), ("::1".into(), 4420));
        assert_eq!(s("node-a:4420").unwrap(), ("node-a".into(), 4420));
        for bad in ["127.0.0.1", ":4420", "h:0", "h:99999", "h:x"] {
            assert!(s(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn methods_parse() {
        assert_eq!(Method::parse("fuse"), Some(Method::Fuse));
        assert_eq!(Method::parse("nbd"), Some(Method::Nbd));
        assert_eq!(Method::parse("nvme-tcp"), Some(Method::NvmeTcp));
        assert_eq!(Method::parse("iscsi"), None);
        for m in [Method::Fuse, Method::Nbd, Method::NvmeTcp] {
            assert_eq!(Method::parse(m.name()), Some(m));
        }
    }

    /// The check on a fake node: the module first (one modprobe tried),
    /// then the device node, then the tool; each refusal names what is
    /// missing.
    #[tokio::test]
    async fn a_method_the_node_cannot_do_is_refused_with_what_is_missing() {
        use std::os::unix::fs::PermissionsExt;
        let root = std::env::temp_dir().join(format!("lull-csi-check-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("dev")).unwrap();
        let mut host = Host {
            sys: root.join("sys"),
            dev: root.join("dev"),
            hostnqn_file: root.join("hostnqn"),
            nvme: "/no/such/nvme".into(),
            nbd_client: "/no/such/nbd-client".into(),
            modprobe: "/no/such/modprobe".into(),
        };
        for (m, module) in [(Method::NvmeTcp, "nvme_tcp"), (Method::Nbd, "nbd")] {
            let reason = m.check(&host).await.unwrap_err();
            assert!(
                reason.contains(&format!("no {module} module"))
                    && reason.contains("kmod")
                    && reason.contains(m.name()),
                "{reason}"
            );
        }
        // A modprobe that fails: its words are in the reason.
        let modprobe = root.join("modprobe");
        let script = |path: &Path, body: &str| {
            std::fs::write(path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        script(
            &modprobe,
            "echo \"modprobe: FATAL: Module $1 not found\" >&2; exit 1",
        );
        host.modprobe = modprobe.to_string_lossy().into_owned();
        let reason = Method::NvmeTcp.check(&host).await.unwrap_err();
        assert!(reason.contains("Module nvme_tcp not found"), "{reason}");
        // A modprobe that loads it: the device node is looked at next.
        script(
            &modprobe,
            &format!(
                "echo \"$@\" >>{0}/modprobe.log; mkdir -p {0}/sys/module/$1",
                root.display()
            ),
        );
        let reason = Method::NvmeTcp.check(&host).await.unwrap_err();
        assert!(reason.contains("nvme-fabrics"), "{reason}");
        std::fs::write(root.join("dev/nvme-fabrics"), "").unwrap();
        let reason = Method::NvmeTcp.check(&host).await.unwrap_err();
        assert!(reason.contains("nvme-cli"), "{reason}");
        host.nvme = "/bin/true".into();
        Method::NvmeTcp.check(&host).await.unwrap();
        // Loaded now: modprobe is not run again.
        Method::NvmeTcp.check(&host).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(root.join("modprobe.log")).unwrap(),
            "nvme_tcp\n",
            "modprobe runs only while the module is missing"
        );
        let reason = Method::Nbd.check(&host).await.unwrap_err();
        assert!(reason.contains("nbd0"), "{reason}");
        std::fs::write(root.join("dev/nbd0"), "").unwrap();
        let reason = Method::Nbd.check(&host).await.unwrap_err();
        assert!(reason.contains("Debian package nbd-client"), "{reason}");
        host.nbd_client = "/bin/true".into();
        Method::Nbd.check(&host).await.unwrap();
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_host_nqn_is_read_when_there() {
        let root = std::env::temp_dir().join(format!("lull-csi-hostnqn-{}", std::process::id()));
        std::fs::create_dir_all(&root).unwrap();
        let host = Host {
            hostnqn_file: root.join("hostnqn"),
            ..Host::default()
        };
        assert_eq!(host.host_nqn().unwrap(), None);
        std::fs::write(&host.hostnqn_file, "\n").unwrap();
        assert_eq!(host.host_nqn().unwrap(), None);
        std::fs::write(&host.hostnqn_file, "nqn.2014-08.org.nvmexpress:uuid:x\n").unwrap();
        assert_eq!(
            host.host_nqn().unwrap().as_deref(),
            Some("nqn.2014-08.org.nvmexpress:uuid:x")
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
