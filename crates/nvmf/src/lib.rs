//! The NVMe/TCP frontend: serves each volume of the registry as an NVM
//! subsystem `nqn.2026-11.io.lull:<volume>` (namespace 1 is the volume)
//! to NVMe/TCP hosts (SPDK's initiator, the Linux `nvme-tcp` host), on the
//! reactor framework and the connection pump NBD uses.
//!
//! ```ignore
//! let server = NvmfServer::start(fw.handle(), volumes, "127.0.0.1:4420".parse()?, HashMap::new())?;
//! // spdk_nvme_identify -r 'trtype:TCP adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.2026-11.io.lull:vol0'
//! server.shutdown(Duration::from_secs(30));
//! ```
//!
//! Layers: [`pdu`] (the NVMe/TCP PDUs, pure), [`spec`] (NVMe and
//! NVMe-oF structures, pure), [`limits`] (every bound and why), `target`
//! (controllers shared by a host's queue pairs) and `conn` (one queue
//! pair: a `lull_net::server::Connection` whose protocol runs on
//! `lull_net::wire::pump`), [`psk`] (TLS pre-shared keys: the interchange
//! format, the identity, the derivation) and `stream` (a queue pair's
//! socket, plain or TLS 1.3: one listener serves both, told apart by the
//! host's first byte). docs/NVMF.md says what is implemented.
//!
//! The per-I/O path is NBD's (issue 33): a queue pair queues the commands
//! of one socket read on the volume's channel and pushes them once
//! (`lull_net::wire::Submissions`), and where no TLS session and no data
//! digest touch the bytes, a replicated volume's read data goes from the
//! replica's socket to the host's in a pipe (`Channel::allow_splice`,
//! counted as the volume's `spliced_reads`; docs/PER_IO.md), and a file
//! volume on tmpfs's from its page cache with `sendfile`
//! (`sendfile_reads`).

#![forbid(unsafe_code)]

mod conn;
pub mod limits;
pub mod pdu;
pub mod psk;
pub mod spec;
mod stream;
mod target;

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lull_net::server::{Acceptor, Connections, Limits};
use lull_reactor::{FrameworkHandle, ReactorError};
use lull_volume::Volumes;

use crate::conn::Conn;
use crate::target::Shared;

/// The NQN of a volume's subsystem.
pub fn subsystem_nqn(volume: &str) -> String {
    format!("{}{volume}", spec::NQN_PREFIX)
}

/// log2 of the default LBA size: 512-byte blocks (what SPDK's and Linux's
/// hosts handle with any I/O size). A volume may have 4 KiB LBAs instead
/// ([`SubsystemOptions::lba_shift`]).
pub const LBA_SHIFT: u8 = 9;

/// log2 of the 4 KiB LBA size.
pub const LBA_SHIFT_4K: u8 = 12;

/// How one volume is served, where it differs from the defaults. Volumes
/// without options get the default NQN, 512-byte LBAs and any host;
/// volumes created over RPC may bring theirs ([`Subsystems::set`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubsystemOptions {
    /// The subsystem's NQN; `None`: [`subsystem_nqn`] of the volume.
    pub nqn: Option<String>,
    /// log2 of the namespace's LBA size: [`LBA_SHIFT`] or [`LBA_SHIFT_4K`].
    pub lba_shift: u8,
    /// Host NQNs that may connect; empty: any host (as SPDK's
    /// `nvmf_subsystem_allow_any_host`).
    pub allowed_hosts: Vec<String>,
}

impl Default for SubsystemOptions {
    fn default() -> SubsystemOptions {
        SubsystemOptions {
            nqn: None,
            lba_shift: LBA_SHIFT,
            allowed_hosts: Vec::new(),
        }
    }
}

/// Errors of the NVMe/TCP frontend.
#[derive(Debug, thiserror::Error)]
pub enum NvmfError {
    #[error("cannot listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: io::Error },
    #[error("NVMe/TCP subsystem options: {0}")]
    Options(String),
    #[error(transparent)]
    Reactor(#[from] ReactorError),
    #[error(transparent)]
    KeyFile(#[from] psk::KeyFileError),
}

/// A host's TLS key for a volume's subsystem, from a key file in the PSK
/// interchange format (`lull serve --nvmf-psk VOLUME=HOSTNQN=KEYFILE`).
/// A volume with any key requires a secure channel: plaintext Connects
/// to it are refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PskEntry {
    pub volume: String,
    pub hostnqn: String,
    pub key_file: PathBuf,
}

/// What the target itself requires of a volume's options (the config
/// crate checks NQN syntax and sizes before).
pub(crate) fn check_options(volume: &str, o: &SubsystemOptions) -> Result<(), NvmfError> {
    if o.lba_shift != LBA_SHIFT && o.lba_shift != LBA_SHIFT_4K {
        return Err(NvmfError::Options(format!(
            "volume {volume:?}: LBA size 2^{}: 512 or 4096 only",
            o.lba_shift
        )));
    }
    Ok(())
}

/// The target's per-volume options, for the control plane: a volume
/// created over RPC gets its NQN, LBA size and host allowlist here
/// before it is added to the registry; a deleted volume's are forgotten
/// by the target itself.
#[derive(Clone)]
pub struct Subsystems {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Subsystems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Subsystems({})", self.shared.listen)
    }
}

impl Subsystems {
    /// Serve the volume about to be created as `volume` with `options`.
    /// Refused (`NvmfError::Options`) when the volume exists already, has
    /// options, the LBA size is not 512 or 4096, or the NQN is served.
    pub fn set(&self, volume: &str, options: SubsystemOptions) -> Result<(), NvmfError> {
        self.shared.set_options(volume, options)
    }

    /// Forget a volume's options: for a create that failed after `set`.
    pub fn forget(&self, volume: &str) {
        self.shared.forget_options(volume);
    }

    /// The NQN a volume is served under.
    pub fn nqn_of(&self, volume: &str) -> String {
        self.shared.nqn_of(volume)
    }

    /// Give `hostnqn` a TLS key (PSK interchange format) for `volume`'s
    /// subsystem, replacing the one it had; the subsystem then requires a
    /// secure channel. Queue pairs already connected are not affected.
    /// Refused for 48-byte keys (the SHA-384 suite is not offered) and
    /// identities too long for OpenSSL.
    pub fn set_host_psk(
        &self,
        volume: &str,
        hostnqn: &str,
        key: &psk::ConfiguredKey,
    ) -> Result<(), NvmfError> {
        self.shared.set_host_key(volume, hostnqn, key)
    }

    /// Take `hostnqn`'s key for `volume` away (the last key gone, the
    /// subsystem takes plaintext Connects again); whether it had one.
    pub fn remove_host_psk(&self, volume: &str, hostnqn: &str) -> bool {
        self.shared.remove_host_key(volume, hostnqn)
    }

    /// Whether the volume's subsystem refuses plaintext Connects.
    pub fn secure_channel_required(&self, volume: &str) -> bool {
        self.shared.secure_channel_required(volume)
    }
}

/// A running NVMe/TCP target.
pub struct NvmfServer {
    shared: Arc<Shared>,
    acceptor: Acceptor,
    addr: SocketAddr,
}

impl std::fmt::Debug for NvmfServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NvmfServer({})", self.addr)
    }
}

impl NvmfServer {
    /// Bind `addr` (errors are reported here) and start accepting on the
    /// main reactor; queue pairs go round robin over one poll group per
    /// reactor (`nvmf-group-N`). `subsystems` maps volume names to how
    /// they are served (see [`SubsystemOptions`]).
    pub fn start(
        fw: &FrameworkHandle,
        volumes: Arc<Volumes>,
        addr: SocketAddr,
        subsystems: HashMap<String, SubsystemOptions>,
    ) -> Result<NvmfServer, NvmfError> {
        NvmfServer::start_with_psks(fw, volumes, addr, subsystems, &[])
    }

    /// [`NvmfServer::start`], with TLS keys for some hosts: every key file
    /// is read and checked first (an error names the file), and a volume
    /// with a key takes TLS 1.3 connections only. TLS and plaintext hosts
    /// share the listener (a TLS ClientHello's first byte is 0x16, an
    /// ICReq's 0x00).
    pub fn start_with_psks(
        fw: &FrameworkHandle,
        volumes: Arc<Volumes>,
        addr: SocketAddr,
        subsystems: HashMap<String, SubsystemOptions>,
        psks: &[PskEntry],
    ) -> Result<NvmfServer, NvmfError> {
        for (name, o) in &subsystems {
            check_options(name, o)?;
        }
        let mut keys = Vec::with_capacity(psks.len());
        for p in psks {
            keys.push((p, psk::load_key_file(&p.key_file)?));
        }
        let err = |source| NvmfError::Listen { addr, source };
        let listener = TcpListener::bind(addr).map_err(err)?;
        listener.set_nonblocking(true).map_err(err)?;
        let addr = listener.local_addr().map_err(err)?;
        let conns = Arc::new(Connections::new(Limits {
            name: "nvmf",
            max_connections: limits::MAX_CONNECTIONS,
            greeting_timeout_us: limits::CONNECT_TIMEOUT_US,
        }));
        let shared = Shared::new(volumes, conns.clone(), subsystems, addr);
        for (p, key) in &keys {
            shared
                .set_host_key(&p.volume, &p.hostnqn, key)
                .map_err(|e| match e {
                    NvmfError::Options(reason) => NvmfError::KeyFile(psk::KeyFileError {
                        path: p.key_file.clone(),
                        reason,
                    }),
                    other => other,
                })?;
        }
        let s = shared.clone();
        let clock = fw.clock();
        let acceptor = Acceptor::start(fw, &conns, vec![listener], move |stream: TcpStream| {
            let fd = stream.as_raw_fd();
            let peer = stream
                .peer_addr()
                .map_or_else(|_| "tcp:?".into(), |a| a.to_string());
            let mut c = Conn::new(stream, fd, peer, s.clone());
            c.set_clock(clock.clone());
            c.set_tls_after_read(stream::quickack);
            c
        })?;
        Ok(NvmfServer {
            shared,
            acceptor,
            addr,
        })
    }

    /// The bound address (with the real port for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The NQN a volume is served under (configured, or [`subsystem_nqn`]).
    pub fn nqn_of(&self, volume: &str) -> String {
        self.shared.nqn_of(volume)
    }

    /// The per-volume options, for volumes created over RPC.
    pub fn subsystems(&self) -> Subsystems {
        Subsystems {
            shared: self.shared.clone(),
        }
    }

    /// Queue pairs open (admin and I/O).
    pub fn connection_count(&self) -> usize {
        self.shared.conns.len()
    }

    /// Controllers live (one per connected host and subsystem).
    pub fn controller_count(&self) -> usize {
        self.shared.controller_count()
    }

    /// Stop accepting, let every queue pair finish its commands in flight,
    /// then close. Returns the connections still open after `timeout`.
    pub fn shutdown(&self, timeout: Duration) -> usize {
        self.acceptor.stop();
        self.acceptor.drain(timeout)
    }
}
