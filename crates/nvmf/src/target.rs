//! What the queue pairs of one target share: the volume registry, the
//! connection table, and the controllers (dynamic model: the admin
//! queue's Connect creates one and the target picks its id; I/O queues
//! name it). A controller's state is control-path only (properties,
//! features), behind a mutex; the data path never touches it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use lull_reactor::{PollerId, ThreadHandle};

use lull_net::server::Connections;
use lull_volume::{Volume, Volumes};

use crate::limits::{
    ERROR_LOG_ENTRIES, MAX_AERS, MAX_CONTROLLERS, MAX_IN_CAPSULE_DATA_BYTES, MAX_IO_QUEUES, MDTS,
};
use crate::spec::{self, ConnectData, Sqe, Status};

pub(crate) struct Shared {
    pub(crate) volumes: Arc<Volumes>,
    pub(crate) conns: Arc<Connections>,
    /// log2 of the LBA size every namespace reports.
    pub(crate) lba_shift: u8,
    /// Where the target listens, for the discovery log.
    pub(crate) listen: std::net::SocketAddr,
    ctrls: Mutex<Ctrls>,
}

#[derive(Default)]
struct Ctrls {
    next: u16,
    live: HashMap<u16, Arc<Controller>>,
}

impl Shared {
    pub(crate) fn new(
        volumes: Arc<Volumes>,
        conns: Arc<Connections>,
        lba_shift: u8,
        listen: std::net::SocketAddr,
    ) -> Shared {
        Shared {
            volumes,
            conns,
            lba_shift,
            listen,
            ctrls: Mutex::new(Ctrls::default()),
        }
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
            last_keepalive_ns: AtomicU64::new(0),
            io_wakers: Mutex::new(Vec::new()),
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
        spec::identify_namespace(&spec::NamespaceInfo {
            blocks: v.dev().size_bytes() >> self.lba_shift,
            lba_shift: self.lba_shift,
            nguid: spec::name_guid(&v.name),
        })
    }

    /// The discovery log: every volume's subsystem at the target's
    /// address. The generation counter is the number of volumes (a host
    /// that sees it change reads the log again).
    pub(crate) fn discovery_log(&self) -> Vec<u8> {
        let entries: Vec<_> = self
            .volumes
            .list()
            .iter()
            .map(|v| spec::DiscoveryEntry {
                subnqn: crate::subsystem_nqn(&v.name),
                addr: self.listen,
            })
            .collect();
        spec::discovery_log(entries.len() as u64, &entries)
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
    /// When the admin queue last received a command (the poll's `now`).
    last_keepalive_ns: AtomicU64,
    /// The pollers of the I/O queues, woken when the controller goes.
    io_wakers: Mutex<Vec<(ThreadHandle, PollerId)>>,
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
}

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

    pub(crate) fn get_feature(&self, sqe: &Sqe) -> crate::conn::Reply {
        use crate::conn::Reply;
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

    pub(crate) fn set_feature(&self, sqe: &Sqe) -> crate::conn::Reply {
        use crate::conn::Reply;
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
