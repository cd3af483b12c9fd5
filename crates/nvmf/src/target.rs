//! What the queue pairs of one target share: the volume registry, the
//! connection table, and the controllers (dynamic model: the admin
//! queue's Connect creates one and the target picks its id; I/O queues
//! name it). A controller's state is control-path only (properties,
//! features), behind a mutex; the data path never touches it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use lull_reactor::{PollerId, ThreadHandle};

use lull_net::server::Connections;
use lull_net::tls::ExternalPskContext;
use lull_volume::{Volume, VolumeChange, Volumes};

use crate::limits::{
    ERROR_LOG_ENTRIES, MAX_AERS, MAX_CONTROLLERS, MAX_IN_CAPSULE_DATA_BYTES, MAX_IO_QUEUES, MDTS,
};
use crate::psk::{self, Cipher};
use crate::spec::{self, ConnectData, Sqe, Status};
use crate::SubsystemOptions;

/// A host's TLS key for one subsystem: the retained PSK (derived from the
/// configured key and the host NQN when the key was added), and the suite
/// it is used with. Never printed.
#[derive(Clone)]
pub(crate) struct HostKey {
    pub(crate) cipher: Cipher,
    pub(crate) retained: Vec<u8>,
}

impl Drop for HostKey {
    fn drop(&mut self) {
        self.retained.fill(0);
    }
}

pub(crate) struct Shared {
    pub(crate) volumes: Arc<Volumes>,
    pub(crate) conns: Arc<Connections>,
    /// How each volume is served (NQN, LBA size, hosts); volumes not
    /// named get the defaults. Volumes created over RPC add theirs; a
    /// deleted volume's are forgotten.
    subsystems: RwLock<HashMap<String, SubsystemOptions>>,
    /// Where the target listens, for the discovery log.
    pub(crate) listen: std::net::SocketAddr,
    ctrls: Mutex<Ctrls>,
    /// TLS keys by (volume, host NQN). A volume with any key requires a
    /// secure channel. Keys belong to the volume's name and outlive its
    /// deletion (a volume created again under the name is not silently
    /// served in plaintext).
    psks: RwLock<BTreeMap<(String, String), HostKey>>,
    /// The TLS 1.3 server context; its PSK callback looks keys up here.
    /// `None` only if OpenSSL could not set one up (logged at start).
    pub(crate) tls: Option<ExternalPskContext>,
}

#[derive(Default)]
struct Ctrls {
    next: u16,
    live: HashMap<u16, Arc<Controller>>,
}

impl Shared {
    /// The target's shared state; it watches the registry so that a
    /// deleted volume's controllers raise a namespace-changed event.
    pub(crate) fn new(
        volumes: Arc<Volumes>,
        conns: Arc<Connections>,
        subsystems: HashMap<String, SubsystemOptions>,
        listen: std::net::SocketAddr,
    ) -> Arc<Shared> {
        let shared = Arc::new_cyclic(|weak: &std::sync::Weak<Shared>| {
            let weak = weak.clone();
            let tls = ExternalPskContext::server(move |identity| weak.upgrade()?.tls_key(identity));
            let tls = match tls {
                Ok(ctx) => Some(ctx),
                Err(e) => {
                    tracing::error!(error = %e, "cannot set up TLS: NVMe/TCP serves plaintext only");
                    None
                }
            };
            Shared {
                volumes: volumes.clone(),
                conns,
                subsystems: RwLock::new(subsystems),
                listen,
                ctrls: Mutex::new(Ctrls::default()),
                psks: RwLock::new(BTreeMap::new()),
                tls,
            }
        });
        let weak = Arc::downgrade(&shared);
        let watching = volumes.watch(move |change| {
            if let Some(s) = weak.upgrade() {
                s.on_volume_change(change);
            }
        });
        if !watching {
            tracing::warn!("volume registry has no room for another watcher: NVMe/TCP hosts will not be told of deleted volumes");
        }
        shared
    }

    /// A volume left the registry: its namespace is gone from every
    /// controller that serves it, and its options are forgotten (a volume
    /// created later under its name starts from the defaults). A volume
    /// grew: namespace 1 changed on every controller that serves it (its
    /// I/O queues read the size from the volume, so they already accept
    /// the new LBAs).
    fn on_volume_change(&self, change: &VolumeChange) {
        let (v, removed) = match change {
            VolumeChange::Removed(v) => (v, true),
            VolumeChange::Resized(v) => (v, false),
        };
        if removed {
            self.subsystems_mut().remove(&v.name);
        }
        let ctrls: Vec<_> = self
            .lock()
            .live
            .values()
            .filter(|c| c.volume.as_ref().is_some_and(|cv| Arc::ptr_eq(cv, v)))
            .cloned()
            .collect();
        for c in ctrls {
            if removed {
                tracing::info!(volume = %v.name, cntlid = c.cntlid, hostnqn = %c.hostnqn, "namespace 1 removed (volume deleted)");
                c.namespace_removed();
            } else if c.ns_active() {
                tracing::info!(volume = %v.name, cntlid = c.cntlid, hostnqn = %c.hostnqn,
                    size_bytes = v.dev().size_bytes(), "namespace 1 changed (volume grown)");
                c.namespace_changed(1);
            }
        }
    }

    fn subsystems(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, SubsystemOptions>> {
        self.subsystems.read().unwrap_or_else(|p| p.into_inner())
    }

    fn subsystems_mut(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, SubsystemOptions>> {
        self.subsystems.write().unwrap_or_else(|p| p.into_inner())
    }

    fn options(&self, volume: &str) -> Option<SubsystemOptions> {
        self.subsystems().get(volume).cloned()
    }

    /// Serve `volume` with `options` from now on: for a volume about to be
    /// created over RPC (its options must be in place before a host can
    /// reach it). Refused when the volume has options already, or when
    /// the NQN is another volume's.
    pub(crate) fn set_options(
        &self,
        volume: &str,
        options: SubsystemOptions,
    ) -> Result<(), crate::NvmfError> {
        crate::check_options(volume, &options)?;
        if self.volumes.named(volume).is_ok() {
            return Err(crate::NvmfError::Options(format!(
                "volume {volume:?} exists: NVMe/TCP options are set as a volume is created"
            )));
        }
        let mut subs = self.subsystems_mut();
        if subs.contains_key(volume) {
            return Err(crate::NvmfError::Options(format!(
                "volume {volume:?} has NVMe/TCP options already"
            )));
        }
        if let Some(nqn) = &options.nqn {
            let taken = nqn == spec::DISCOVERY_NQN
                || subs
                    .iter()
                    .any(|(name, o)| o.nqn.as_ref() == Some(nqn) && name != volume)
                || self.volumes.list().iter().any(|v| {
                    v.name != volume
                        && subs.get(&v.name).is_none_or(|o| o.nqn.is_none())
                        && crate::subsystem_nqn(&v.name) == *nqn
                });
            if taken {
                return Err(crate::NvmfError::Options(format!(
                    "NQN {nqn:?} is already served"
                )));
            }
        }
        subs.insert(volume.to_string(), options);
        Ok(())
    }

    /// Forget `volume`'s options (a create that failed after
    /// [`Shared::set_options`]).
    pub(crate) fn forget_options(&self, volume: &str) {
        self.subsystems_mut().remove(volume);
    }

    /// The NQN of a volume's subsystem.
    pub(crate) fn nqn_of(&self, volume: &str) -> String {
        match self.options(volume).and_then(|o| o.nqn) {
            Some(nqn) => nqn,
            None => crate::subsystem_nqn(volume),
        }
    }

    /// log2 of a volume's LBA size.
    pub(crate) fn lba_shift_of(&self, volume: &str) -> u8 {
        self.options(volume)
            .map_or(crate::LBA_SHIFT, |o| o.lba_shift)
    }

    /// Whether `hostnqn` may connect to the volume's subsystem (an empty
    /// list allows any host).
    pub(crate) fn host_allowed(&self, volume: &str, hostnqn: &str) -> bool {
        self.options(volume).is_none_or(|o| {
            o.allowed_hosts.is_empty() || o.allowed_hosts.iter().any(|h| h == hostnqn)
        })
    }

    fn psks(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<(String, String), HostKey>> {
        self.psks.read().unwrap_or_else(|p| p.into_inner())
    }

    fn psks_mut(&self) -> std::sync::RwLockWriteGuard<'_, BTreeMap<(String, String), HostKey>> {
        self.psks.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Give `hostnqn` a TLS key for `volume`'s subsystem (replacing one it
    /// had); from then on the subsystem requires a secure channel.
    pub(crate) fn set_host_key(
        &self,
        volume: &str,
        hostnqn: &str,
        key: &psk::ConfiguredKey,
    ) -> Result<(), crate::NvmfError> {
        let refuse = |reason: String| {
            Err(crate::NvmfError::Options(format!(
                "volume {volume:?}, host {hostnqn:?}: {reason}"
            )))
        };
        if self.tls.is_none() {
            return refuse("TLS could not be set up at start".into());
        }
        if key.cipher() != Cipher::Aes128GcmSha256 {
            return refuse(
                "a 48-byte key needs TLS_AES_256_GCM_SHA384, which lull does not offer: use a 32-byte key (NVMeTLSkey-1:01:...)".into(),
            );
        }
        let subnqn = self.nqn_of(volume);
        if !psk::identity_fits(hostnqn, &subnqn)
            || !psk::identity_fits(hostnqn, spec::DISCOVERY_NQN)
        {
            return refuse(format!(
                "the PSK identity (NVMe0R01 HOSTNQN SUBNQN) would be longer than {} bytes",
                psk::MAX_IDENTITY_LEN
            ));
        }
        let retained = match key.retained(hostnqn) {
            Ok(r) => r,
            Err(e) => return refuse(e.to_string()),
        };
        let k = HostKey {
            cipher: key.cipher(),
            retained,
        };
        self.psks_mut()
            .insert((volume.to_string(), hostnqn.to_string()), k);
        Ok(())
    }

    /// Take `hostnqn`'s key for `volume` away; whether it had one.
    pub(crate) fn remove_host_key(&self, volume: &str, hostnqn: &str) -> bool {
        self.psks_mut()
            .remove(&(volume.to_string(), hostnqn.to_string()))
            .is_some()
    }

    /// Whether a plaintext Connect to the volume's subsystem is refused:
    /// some host has a TLS key for it.
    pub(crate) fn secure_channel_required(&self, volume: &str) -> bool {
        self.psks()
            .range((volume.to_string(), String::new())..)
            .next()
            .is_some_and(|((v, _), _)| v == volume)
    }

    fn has_key(&self, volume: &str, hostnqn: &str) -> bool {
        self.psks()
            .contains_key(&(volume.to_string(), hostnqn.to_string()))
    }

    /// The TLS PSK for the identity a host presented, or `None` (logged)
    /// to fail the handshake. A discovery identity is answered with the
    /// host's first key (by volume name): any key proves the host.
    pub(crate) fn tls_key(&self, identity: &[u8]) -> Option<Vec<u8>> {
        let Some((cipher, host, sub)) = psk::parse_identity(identity) else {
            tracing::warn!(identity = %String::from_utf8_lossy(identity), "TLS refused: not an NVMe PSK identity (NVMe0R01 HOSTNQN SUBNQN)");
            return None;
        };
        let keys = self.psks();
        let key = if sub == spec::DISCOVERY_NQN {
            keys.iter().find(|((_, h), _)| h == host).map(|(_, k)| k)
        } else {
            let volume = self.volume_by_nqn(sub);
            volume.and_then(|v| keys.get(&(v.name.clone(), host.to_string())))
        };
        let Some(key) = key else {
            tracing::warn!(hostnqn = %host, subnqn = %sub, "TLS refused: no PSK for this host and subsystem");
            return None;
        };
        if key.cipher != cipher {
            tracing::warn!(hostnqn = %host, subnqn = %sub, "TLS refused: the identity names another hash than the host's key");
            return None;
        }
        // The identity is UTF-8 (parse_identity checked).
        let id = std::str::from_utf8(identity).ok()?;
        match psk::tls_psk(&key.retained, id, cipher) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::error!(hostnqn = %host, subnqn = %sub, error = %e, "TLS refused: cannot derive the TLS PSK");
                None
            }
        }
    }

    /// The volume whose subsystem is `subnqn`.
    pub(crate) fn volume_by_nqn(&self, subnqn: &str) -> Option<Arc<Volume>> {
        self.volumes
            .list()
            .into_iter()
            .find(|v| self.nqn_of(&v.name) == subnqn)
    }

    fn lock(&self) -> MutexGuard<'_, Ctrls> {
        self.ctrls.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new controller for an admin queue; `None` when every id is taken.
    /// It lives until its admin queue's [`ControllerRef`] is dropped.
    pub(crate) fn new_controller(
        self: &Arc<Self>,
        d: &ConnectData,
        volume: Option<Arc<Volume>>,
        kato_ms: u32,
    ) -> Option<ControllerRef> {
        let mut c = self.lock();
        if c.live.len() >= MAX_CONTROLLERS {
            return None;
        }
        // Ids 1..=MAX_CONTROLLERS (0xFFFF and above are reserved), the
        // next free one after the last handed out.
        let mut id = c.next;
        loop {
            id = id % MAX_CONTROLLERS as u16 + 1;
            if !c.live.contains_key(&id) {
                break;
            }
        }
        c.next = id;
        let ctrl = Arc::new(Controller {
            cntlid: id,
            subnqn: d.subnqn.clone(),
            hostnqn: d.hostnqn.clone(),
            volume,
            alive: AtomicBool::new(true),
            ns_removed: AtomicBool::new(false),
            last_keepalive_ns: AtomicU64::new(0),
            io_wakers: Mutex::new(Vec::new()),
            admin_waker: Mutex::new(None),
            state: Mutex::new(CtrlState {
                kato_ms,
                io_queues: MAX_IO_QUEUES,
                vwc: true,
                ..CtrlState::default()
            }),
        });
        c.live.insert(id, ctrl.clone());
        Some(ControllerRef {
            ctrl,
            shared: Some(self.clone()),
        })
    }

    /// The live controller `cntlid`, for an I/O queue's Connect.
    pub(crate) fn controller(&self, cntlid: u16) -> Option<ControllerRef> {
        self.lock().live.get(&cntlid).map(|c| ControllerRef {
            ctrl: c.clone(),
            shared: None,
        })
    }

    pub(crate) fn controller_count(&self) -> usize {
        self.lock().live.len()
    }

    pub(crate) fn identify_controller(&self, c: &Controller) -> Vec<u8> {
        let name = c.volume.as_ref().map_or(spec::DISCOVERY_NQN, |v| &v.name);
        let guid = spec::name_guid(name);
        let serial = format!(
            "{:016x}",
            u64::from_be_bytes(guid[..8].try_into().unwrap_or([0; 8]))
        );
        spec::identify_controller(&spec::ControllerInfo {
            cntlid: c.cntlid,
            serial: &serial,
            subnqn: &c.subnqn,
            nn: u32::from(c.volume.is_some()),
            ioccsz_bytes: 64 + MAX_IN_CAPSULE_DATA_BYTES,
            mdts: MDTS,
            aerl: (MAX_AERS - 1) as u8,
            elpe: (ERROR_LOG_ENTRIES - 1) as u8,
            // KATO is enforced with a timer at half of it: 100 ms
            // granularity is plenty.
            kas: 1,
            discovery: c.volume.is_none(),
        })
    }

    pub(crate) fn identify_namespace(&self, v: &Volume) -> Vec<u8> {
        let lba_shift = self.lba_shift_of(&v.name);
        spec::identify_namespace(&spec::NamespaceInfo {
            blocks: v.dev().size_bytes() >> lba_shift,
            lba_shift,
            nguid: spec::name_guid(&v.name),
            eui64: spec::name_eui64(&v.name),
            write_protected: v.dev().read_only(),
        })
    }

    /// The discovery log for `hostnqn`: the subsystem of every volume it
    /// may connect to, at the target's address. The generation counter
    /// is the number of volumes (a host that sees it change reads the
    /// log again).
    pub(crate) fn discovery_log(&self, hostnqn: &str) -> Vec<u8> {
        let all = self.volumes.list();
        // A subsystem that requires a secure channel is listed to the
        // hosts that have a key for it, saying so (TREQ, TSAS).
        let entries: Vec<_> = all
            .iter()
            .filter(|v| self.host_allowed(&v.name, hostnqn))
            .filter_map(|v| {
                let secure_channel = self.secure_channel_required(&v.name);
                if secure_channel && !self.has_key(&v.name, hostnqn) {
                    return None;
                }
                Some(spec::DiscoveryEntry {
                    subnqn: self.nqn_of(&v.name),
                    addr: self.listen,
                    secure_channel,
                })
            })
            .collect();
        spec::discovery_log(all.len() as u64, &entries)
    }
}

/// A queue's hold on its controller. The admin queue's owns it: when that
/// queue closes, the controller is gone (I/O queues that still hold it go
/// on until they close; new ones cannot join it).
pub(crate) struct ControllerRef {
    ctrl: Arc<Controller>,
    shared: Option<Arc<Shared>>,
}

impl std::ops::Deref for ControllerRef {
    type Target = Controller;
    fn deref(&self) -> &Controller {
        &self.ctrl
    }
}

impl Drop for ControllerRef {
    fn drop(&mut self) {
        if let Some(s) = self.shared.take() {
            s.lock().live.remove(&self.ctrl.cntlid);
            // Its I/O queues close too: wake each so that it sees.
            self.ctrl.alive.store(false, Ordering::SeqCst);
            let wakers = std::mem::take(&mut *self.ctrl.wakers());
            for (thread, poller) in wakers {
                let _ = thread.send(move |t| {
                    t.wake_poller(poller);
                });
            }
            tracing::info!(cntlid = self.ctrl.cntlid, hostnqn = %self.ctrl.hostnqn, "controller removed");
        }
    }
}

pub(crate) struct Controller {
    pub(crate) cntlid: u16,
    pub(crate) subnqn: String,
    pub(crate) hostnqn: String,
    /// `None` for a discovery controller.
    pub(crate) volume: Option<Arc<Volume>>,
    /// Cleared when the admin queue goes (closed, or KATO expired).
    alive: AtomicBool,
    /// Set when the volume was deleted: namespace 1 is inactive.
    ns_removed: AtomicBool,
    /// When the admin queue last received a command (the poll's `now`).
    last_keepalive_ns: AtomicU64,
    /// The pollers of the I/O queues, woken when the controller goes.
    io_wakers: Mutex<Vec<(ThreadHandle, PollerId)>>,
    /// The admin queue's poller, woken when an asynchronous event is
    /// raised.
    admin_waker: Mutex<Option<(ThreadHandle, PollerId)>>,
    state: Mutex<CtrlState>,
}

#[derive(Default)]
struct CtrlState {
    cc: u32,
    csts: u32,
    kato_ms: u32,
    aec: u32,
    vwc: bool,
    /// I/O queues granted (Set Features Number of Queues).
    io_queues: u16,
    /// The Changed Namespace List (log page 04h): NSIDs changed since the
    /// host last read it.
    changed_ns: Vec<u32>,
    /// A namespace-attribute notice waits for an Asynchronous Event
    /// Request.
    event_pending: bool,
    /// A notice was sent and the host has not read the log page yet:
    /// further notices of the kind wait (NVMe base spec, "Asynchronous
    /// Event Request": an event type is masked until its log page is
    /// read).
    event_masked: bool,
}

/// Asynchronous Event Configuration bit 8: Namespace Attribute Notices.
pub(crate) const AEC_NS_ATTRIBUTE: u32 = 1 << 8;

/// A completed Asynchronous Event Request's dword 0: type Notice (2),
/// information Namespace Attribute Changed (0), log page 04h.
pub(crate) const AEN_NS_ATTRIBUTE_CHANGED: u32 = 2 | ((spec::LOG_CHANGED_NS_LIST as u32) << 16);

const CC_EN: u32 = 1;
const CC_SHN_MASK: u32 = 3 << 14;
const CSTS_RDY: u32 = 1;
const CSTS_SHST_COMPLETE: u32 = 2 << 2;

impl Controller {
    fn st(&self) -> MutexGuard<'_, CtrlState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wakers(&self) -> MutexGuard<'_, Vec<(ThreadHandle, PollerId)>> {
        self.io_wakers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the controller still exists (its admin queue is open).
    pub(crate) fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// An I/O queue's poller, to wake when the controller goes. A queue
    /// moved to another group registers again (the stale entry's wake is
    /// ignored by its thread).
    pub(crate) fn add_io_waker(&self, thread: ThreadHandle, poller: PollerId) {
        let mut w = self.wakers();
        // Bounded: I/O queues per controller, and a move or two each.
        if w.len() < 4 * usize::from(MAX_IO_QUEUES) {
            w.push((thread, poller));
        }
    }

    /// The admin queue's poller, to wake when an event is raised. A queue
    /// moved to another group registers again.
    pub(crate) fn set_admin_waker(&self, thread: ThreadHandle, poller: PollerId) {
        *self.admin_waker.lock().unwrap_or_else(|p| p.into_inner()) = Some((thread, poller));
    }

    /// Whether namespace 1 is still attached (its volume not deleted).
    pub(crate) fn ns_active(&self) -> bool {
        self.volume.is_some() && !self.ns_removed.load(Ordering::SeqCst)
    }

    /// The volume was deleted: namespace 1 becomes inactive, joins the
    /// Changed Namespace List, and a notice is raised if the host asked
    /// for namespace attribute notices and none is outstanding.
    pub(crate) fn namespace_removed(&self) {
        self.ns_removed.store(true, Ordering::SeqCst);
        self.namespace_changed(1);
    }

    /// Namespace `nsid` changed (removed, or grown): it joins the Changed
    /// Namespace List, and a notice is raised if the host asked for
    /// namespace attribute notices and none is outstanding.
    pub(crate) fn namespace_changed(&self, nsid: u32) {
        let raise = {
            let mut s = self.st();
            // At most one namespace: the list cannot grow past one entry.
            if !s.changed_ns.contains(&nsid) {
                s.changed_ns.push(nsid);
            }
            if s.aec & AEC_NS_ATTRIBUTE != 0 && !s.event_masked {
                s.event_pending = true;
            }
            s.event_pending
        };
        if raise {
            let waker = self
                .admin_waker
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            if let Some((thread, poller)) = waker {
                let _ = thread.send(move |t| {
                    t.wake_poller(poller);
                });
            }
        }
    }

    /// The dword 0 of an Asynchronous Event Request to complete now, if
    /// an event waits; the event is then masked until its log page is
    /// read.
    pub(crate) fn take_event(&self) -> Option<u32> {
        let mut s = self.st();
        if !s.event_pending {
            return None;
        }
        s.event_pending = false;
        s.event_masked = true;
        Some(AEN_NS_ATTRIBUTE_CHANGED)
    }

    /// Log page 04h: the changed NSIDs, zero-filled to 4 KiB. Unless
    /// `retain` (RAE), reading clears the list and unmasks the event.
    pub(crate) fn changed_ns_log(&self, retain: bool) -> Vec<u8> {
        let mut s = self.st();
        let mut page = vec![0u8; spec::CHANGED_NS_LIST_BYTES];
        for (i, nsid) in s.changed_ns.iter().enumerate() {
            page[i * 4..i * 4 + 4].copy_from_slice(&nsid.to_le_bytes());
        }
        if !retain {
            s.changed_ns.clear();
            s.event_masked = false;
        }
        page
    }

    /// The admin queue received a command at `now_ns`.
    pub(crate) fn touch(&self, now_ns: u64) {
        self.last_keepalive_ns.store(now_ns, Ordering::Relaxed);
    }

    pub(crate) fn last_keepalive_ns(&self) -> u64 {
        self.last_keepalive_ns.load(Ordering::Relaxed)
    }

    /// The keep-alive timeout in ms (0: none), from Connect or Set
    /// Features.
    pub(crate) fn kato_ms(&self) -> u32 {
        self.st().kato_ms
    }

    pub(crate) fn cc(&self) -> u32 {
        self.st().cc
    }

    pub(crate) fn csts(&self) -> u32 {
        self.st().csts
    }

    /// Enabled and ready: I/O queues may connect.
    pub(crate) fn ready(&self) -> bool {
        self.st().csts & CSTS_RDY != 0
    }

    pub(crate) fn io_queues(&self) -> u16 {
        self.st().io_queues
    }

    /// A write of CC: enable makes the controller ready at once (nothing
    /// to initialise); a shutdown notification completes at once (the
    /// volume's data is flushed by its own Flush commands and at stop);
    /// disable clears ready.
    pub(crate) fn set_cc(&self, value: u32) {
        let mut s = self.st();
        let was = s.cc;
        s.cc = value;
        if value & CC_SHN_MASK != 0 {
            s.csts |= CSTS_SHST_COMPLETE;
        } else {
            s.csts &= !CSTS_SHST_COMPLETE;
        }
        if value & CC_EN != 0 {
            s.csts |= CSTS_RDY;
        } else if was & CC_EN != 0 || s.csts & CSTS_RDY != 0 {
            s.csts &= !CSTS_RDY;
        }
    }

    pub(crate) fn get_feature(&self, sqe: &Sqe) -> crate::spec::Reply {
        use crate::spec::Reply;
        let fid = (sqe.dword(10) & 0xFF) as u8;
        let sel = (sqe.dword(10) >> 8) & 7;
        let s = self.st();
        if sel == 3 {
            // Supported capabilities: none saveable, none per namespace,
            // the settable ones changeable.
            return match fid {
                spec::FEAT_NUMBER_OF_QUEUES
                | spec::FEAT_KEEP_ALIVE_TIMER
                | spec::FEAT_ASYNC_EVENT_CONFIG
                | spec::FEAT_VOLATILE_WRITE_CACHE => Reply::dw0(1 << 2),
                spec::FEAT_ARBITRATION
                | spec::FEAT_POWER_MANAGEMENT
                | spec::FEAT_TEMPERATURE_THRESHOLD
                | spec::FEAT_ERROR_RECOVERY => Reply::dw0(0),
                _ => Reply::status(Status::INVALID_FIELD),
            };
        }
        match fid {
            spec::FEAT_NUMBER_OF_QUEUES => {
                let n = u32::from(s.io_queues - 1);
                Reply::dw0((n << 16) | n)
            }
            spec::FEAT_KEEP_ALIVE_TIMER => Reply::dw0(s.kato_ms),
            spec::FEAT_ASYNC_EVENT_CONFIG => Reply::dw0(s.aec),
            spec::FEAT_VOLATILE_WRITE_CACHE => Reply::dw0(u32::from(s.vwc)),
            spec::FEAT_ARBITRATION | spec::FEAT_POWER_MANAGEMENT | spec::FEAT_ERROR_RECOVERY => {
                Reply::dw0(0)
            }
            // Composite temperature threshold: 343 K, as NVMe drives
            // commonly report.
            spec::FEAT_TEMPERATURE_THRESHOLD => Reply::dw0(343),
            _ => Reply::status(Status::INVALID_FIELD),
        }
    }

    pub(crate) fn set_feature(&self, sqe: &Sqe) -> crate::spec::Reply {
        use crate::spec::Reply;
        let fid = (sqe.dword(10) & 0xFF) as u8;
        let dw11 = sqe.dword(11);
        let mut s = self.st();
        match fid {
            spec::FEAT_NUMBER_OF_QUEUES => {
                let (nsq, ncq) = (dw11 & 0xFFFF, dw11 >> 16);
                if nsq == 0xFFFF || ncq == 0xFFFF {
                    return Reply::status(Status::INVALID_FIELD);
                }
                let n = (nsq.min(ncq) + 1).min(u32::from(MAX_IO_QUEUES));
                s.io_queues = n as u16;
                Reply::dw0(((n - 1) << 16) | (n - 1))
            }
            spec::FEAT_KEEP_ALIVE_TIMER => {
                s.kato_ms = dw11;
                Reply::ok()
            }
            spec::FEAT_ASYNC_EVENT_CONFIG => {
                s.aec = dw11;
                Reply::ok()
            }
            spec::FEAT_VOLATILE_WRITE_CACHE => {
                s.vwc = dw11 & 1 != 0;
                Reply::ok()
            }
            _ => Reply::status(Status::INVALID_FIELD),
        }
    }
}
