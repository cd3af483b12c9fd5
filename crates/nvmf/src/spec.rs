//! NVMe and NVMe-oF structures the target reads and writes: submission
//! queue entries, completions, status codes, properties, and the data of
//! Identify. Pure, no I/O. Offsets follow NVMe Base 1.4 and NVMe-oF 1.1
//! (SPDK's `include/spdk/nvme_spec.h` and `nvmf_spec.h` have the same).

/// A 64-byte submission queue entry, read field by field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sqe(pub [u8; 64]);

impl Sqe {
    pub fn opcode(&self) -> u8 {
        self.0[0]
    }
    pub fn cid(&self) -> u16 {
        u16::from_le_bytes([self.0[2], self.0[3]])
    }
    pub fn nsid(&self) -> u32 {
        self.dword(1)
    }
    /// Command dword `n` (0..16).
    pub fn dword(&self, n: usize) -> u32 {
        let b = &self.0[n * 4..n * 4 + 4];
        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    /// The Fabrics command type (byte 4 of a Fabrics command).
    pub fn fctype(&self) -> u8 {
        self.0[4]
    }
    /// The data pointer as one SGL descriptor (bytes 24..40).
    pub fn sgl(&self) -> Sgl {
        let b = &self.0[24..40];
        Sgl {
            address: u64::from_le_bytes(b[0..8].try_into().unwrap_or([0; 8])),
            length: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            kind: b[15],
        }
    }
}

/// The SGL descriptor of an NVMe/TCP command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sgl {
    pub address: u64,
    pub length: u32,
    /// Type (high nibble) and subtype (low nibble).
    pub kind: u8,
}

/// Data Block, offset subtype: data in the capsule at `address`.
pub const SGL_IN_CAPSULE: u8 = 0x01;
/// Transport SGL Data Block, transport-specific subtype: data moved by
/// R2T/H2CData (host to controller) or C2HData.
pub const SGL_TRANSPORT: u8 = 0x5A;

/// A completion queue entry to send.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cqe {
    pub dw0: u32,
    pub dw1: u32,
    pub sqhd: u16,
    pub cid: u16,
    pub status: Status,
}

impl Cqe {
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        b[8..10].copy_from_slice(&self.sqhd.to_le_bytes());
        // SQID: fabrics hosts ignore it (one SQ per connection).
        b[12..14].copy_from_slice(&self.cid.to_le_bytes());
        b[14..16].copy_from_slice(&self.status.field().to_le_bytes());
        b
    }
}

/// A status code type and code. `Status::SUCCESS` is zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Status {
    pub sct: u8,
    pub sc: u8,
    /// Do Not Retry.
    pub dnr: bool,
}

impl Status {
    pub const SUCCESS: Status = Status::generic(0x00);
    pub const INVALID_OPCODE: Status = Status::generic(0x01).no_retry();
    pub const INVALID_FIELD: Status = Status::generic(0x02).no_retry();
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0B).no_retry();
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0C).no_retry();
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::generic(0x11).no_retry();
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::generic(0x0F).no_retry();
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::generic(0x22);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80).no_retry();
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82);
    /// Namespace is Write Protected (a snapshot's namespace).
    pub const NAMESPACE_WRITE_PROTECTED: Status = Status::generic(0x20).no_retry();
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09).no_retry();
    pub const INVALID_QUEUE_ID: Status = Status::specific(0x01).no_retry();
    pub const INVALID_QUEUE_SIZE: Status = Status::specific(0x02).no_retry();
    pub const FEATURE_NOT_CHANGEABLE: Status = Status::specific(0x0E).no_retry();
    pub const ASYNC_EVENT_LIMIT_EXCEEDED: Status = Status::specific(0x05);
    /// Fabrics Connect: a parameter is invalid (dw0 says which).
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::specific(0x82).no_retry();
    pub const CONNECT_INVALID_HOST: Status = Status::specific(0x84).no_retry();
    /// The subsystem cannot take the queue now (its volume has its
    /// maximum of connections); the host may retry later.
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::specific(0x81);
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::specific(0x80).no_retry();

    pub const fn generic(sc: u8) -> Status {
        Status {
            sct: 0,
            sc,
            dnr: false,
        }
    }
    pub const fn specific(sc: u8) -> Status {
        Status {
            sct: 1,
            sc,
            dnr: false,
        }
    }
    pub const fn no_retry(self) -> Status {
        Status { dnr: true, ..self }
    }
    pub fn is_success(&self) -> bool {
        self.sct == 0 && self.sc == 0
    }
    /// The completion's status field (phase tag 0: fabrics have none).
    pub fn field(&self) -> u16 {
        (u16::from(self.dnr) << 15) | (u16::from(self.sct & 7) << 9) | (u16::from(self.sc) << 1)
    }
}

// Opcodes.
pub const OPC_FABRICS: u8 = 0x7F;
pub const FCTYPE_PROPERTY_SET: u8 = 0x00;
pub const FCTYPE_CONNECT: u8 = 0x01;
pub const FCTYPE_PROPERTY_GET: u8 = 0x04;
pub const FCTYPE_DISCONNECT: u8 = 0x08;
/// Connect CATTR (dword 11 bits 23:16) bit 2: the host disables SQ flow
/// control.
pub const CATTR_DISABLE_SQ_FLOW: u32 = 1 << 2;

pub const ADMIN_GET_LOG_PAGE: u8 = 0x02;
pub const ADMIN_IDENTIFY: u8 = 0x06;
pub const ADMIN_ABORT: u8 = 0x08;
pub const ADMIN_SET_FEATURES: u8 = 0x09;
pub const ADMIN_GET_FEATURES: u8 = 0x0A;
pub const ADMIN_ASYNC_EVENT_REQUEST: u8 = 0x0C;
pub const ADMIN_KEEP_ALIVE: u8 = 0x18;

pub const NVM_FLUSH: u8 = 0x00;
pub const NVM_WRITE: u8 = 0x01;
pub const NVM_READ: u8 = 0x02;
pub const NVM_WRITE_ZEROES: u8 = 0x08;
pub const NVM_DATASET_MANAGEMENT: u8 = 0x09;
/// Dataset Management: one range is 16 bytes (context attributes, NLB,
/// SLBA); NR (8 bits, 0-based) allows at most 256.
pub const DSM_RANGE_BYTES: usize = 16;
pub const DSM_MAX_RANGES: usize = 256;
/// Dataset Management dword 11: the Deallocate attribute.
pub const DSM_ATTR_DEALLOCATE: u32 = 1 << 2;

// Properties (NVMe-oF 1.1 §3.4).
pub const PROP_CAP: u32 = 0x00;
pub const PROP_VS: u32 = 0x08;
pub const PROP_CC: u32 = 0x14;
pub const PROP_CSTS: u32 = 0x1C;

/// NVMe version reported: 1.3 (namespace identification descriptors; no
/// I/O command set profiles, which 2.0 would make the host ask for).
pub const VERSION: u32 = 0x0001_0300;

// Features.
pub const FEAT_ARBITRATION: u8 = 0x01;
pub const FEAT_POWER_MANAGEMENT: u8 = 0x02;
pub const FEAT_TEMPERATURE_THRESHOLD: u8 = 0x04;
pub const FEAT_ERROR_RECOVERY: u8 = 0x05;
pub const FEAT_VOLATILE_WRITE_CACHE: u8 = 0x06;
pub const FEAT_NUMBER_OF_QUEUES: u8 = 0x07;
pub const FEAT_ASYNC_EVENT_CONFIG: u8 = 0x0B;
pub const FEAT_KEEP_ALIVE_TIMER: u8 = 0x0F;

// Log pages.
pub const LOG_ERROR: u8 = 0x01;
pub const LOG_SMART: u8 = 0x02;
pub const LOG_FIRMWARE_SLOT: u8 = 0x03;
pub const LOG_CHANGED_NS_LIST: u8 = 0x04;
pub const LOG_DISCOVERY: u8 = 0x70;
/// The Changed Namespace List page: 1,024 NSIDs.
pub const CHANGED_NS_LIST_BYTES: usize = 4096;

// Identify CNS values.
pub const CNS_NAMESPACE: u8 = 0x00;
pub const CNS_CONTROLLER: u8 = 0x01;
pub const CNS_ACTIVE_NS_LIST: u8 = 0x02;
pub const CNS_NS_ID_DESCRIPTORS: u8 = 0x03;

/// Identify data and log pages of 4 KiB.
pub const IDENTIFY_BYTES: usize = 4096;

/// The NQN prefix of lull's subsystems: `nqn.2026-11.io.lull:<volume>`.
pub const NQN_PREFIX: &str = "nqn.2026-11.io.lull:";
/// The well-known discovery NQN.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// The CAP property: MQES, CQR (contiguous queues required, as fabrics
/// must), TO (ready timeout, 500 ms units), CSS (NVM command set),
/// MPSMIN/MPSMAX 0 (4 KiB pages).
pub fn cap(queue_entries: usize) -> u64 {
    let mqes = (queue_entries - 1) as u64 & 0xFFFF;
    let cqr = 1u64 << 16;
    let to = 30u64 << 24; // 15 s
    let css_nvm = 1u64 << 37;
    mqes | cqr | to | css_nvm
}

fn put_str(dst: &mut [u8], s: &str) {
    // ASCII, space padded (SN, MN, FR).
    for (d, c) in dst.iter_mut().zip(s.bytes().chain(std::iter::repeat(b' '))) {
        *d = c;
    }
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// What Identify Controller reports.
#[derive(Debug, Clone)]
pub struct ControllerInfo<'a> {
    pub cntlid: u16,
    pub serial: &'a str,
    pub subnqn: &'a str,
    /// Namespaces (1 for a volume's subsystem).
    pub nn: u32,
    pub ioccsz_bytes: usize,
    pub mdts: u8,
    pub aerl: u8,
    pub elpe: u8,
    /// Keep-alive granularity supported (100 ms units); 0 for none.
    pub kas: u16,
    /// A discovery controller (CNTRLTYPE 2, no namespaces, no I/O).
    pub discovery: bool,
}

/// Identify Controller data (CNS 1), 4 KiB.
pub fn identify_controller(c: &ControllerInfo<'_>) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_BYTES];
    // VID/SSVID 0: no PCI vendor.
    put_str(&mut b[4..24], c.serial);
    put_str(&mut b[24..64], "lull");
    put_str(&mut b[64..72], env!("CARGO_PKG_VERSION"));
    b[72] = 6; // RAB: recommended arbitration burst (2^6)
    b[76] = 0b011; // CMIC: may have several ports and controllers
    b[77] = c.mdts;
    put16(&mut b, 78, c.cntlid);
    put32(&mut b, 80, VERSION);
    put32(&mut b, 92, 1 << 8); // OAES: namespace attribute notices
    b[111] = if c.discovery { 2 } else { 1 }; // CNTRLTYPE
    b[258] = 3; // ACL: 4 aborts (0-based)
    b[259] = c.aerl;
    b[260] = 0b11; // FRMW: slot 1 read-only, one slot
    b[261] = 0b100; // LPA: extended data for Get Log Page
    b[262] = c.elpe;
    put16(&mut b, 320, c.kas);
    b[512] = 0x66; // SQES: 64 bytes
    b[513] = 0x44; // CQES: 16 bytes
    put16(&mut b, 514, crate::limits::MAX_QUEUE_ENTRIES as u16); // MAXCMD
    put32(&mut b, 516, c.nn);
    put16(&mut b, 520, (1 << 2) | (1 << 3)); // ONCS: Dataset Management, Write Zeroes
    b[525] = 1; // VWC: a volatile write cache (Flush does something)
                // SGLS: SGLs supported, address as offset, transport SGL data block.
    put32(&mut b, 536, 1 | (1 << 20) | (1 << 21));
    let nqn = c.subnqn.as_bytes();
    let n = nqn.len().min(255);
    b[768..768 + n].copy_from_slice(&nqn[..n]);
    // NVMe-oF attributes: IOCCSZ, IORCSZ in 16-byte units; ICDOFF 0;
    // FCATT 0 (dynamic controller model); MSDBD 1.
    put32(&mut b, 1792, (c.ioccsz_bytes / 16) as u32);
    put32(&mut b, 1796, 1);
    b[1803] = 1;
    // Power state 0: MP 0 (not reported).
    b
}

/// What Identify Namespace reports.
#[derive(Debug, Clone, Copy)]
pub struct NamespaceInfo {
    pub blocks: u64,
    /// log2 of the LBA size (9 for 512 B, 12 for 4 KiB).
    pub lba_shift: u8,
    pub nguid: [u8; 16],
    /// The IEEE Extended Unique Identifier, from the same name
    /// ([`name_eui64`]).
    pub eui64: [u8; 8],
    /// A snapshot's namespace: writes are refused (NSATTR bit 0).
    pub write_protected: bool,
}

/// Identify Namespace data (CNS 0), 4 KiB.
pub fn identify_namespace(ns: &NamespaceInfo) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_BYTES];
    put64(&mut b, 0, ns.blocks); // NSZE
    put64(&mut b, 8, ns.blocks); // NCAP
    put64(&mut b, 16, ns.blocks); // NUSE
    b[24] = 0; // NSFEAT
    b[25] = 0; // NLBAF: one format (0-based)
    b[26] = 0; // FLBAS: format 0
    b[30] = 1; // NMIC: may be attached to several controllers (shared)
    b[33] = 0b1001; // DLFEAT: deallocated blocks read as zeros; WZ deallocates
    b[99] = u8::from(ns.write_protected); // NSATTR: write protected
    b[104..120].copy_from_slice(&ns.nguid);
    b[120..128].copy_from_slice(&ns.eui64);
    // LBA format 0: no metadata, LBADS, best relative performance.
    b[128 + 2] = ns.lba_shift;
    b
}

/// Namespace identification descriptors (CNS 3): the EUI-64, the NGUID,
/// and the NGUID's bytes as a UUID (as Identify Namespace reports them:
/// Linux compares the two and refuses a namespace whose ids change).
pub fn ns_id_descriptors(nguid: &[u8; 16], eui64: &[u8; 8]) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_BYTES];
    b[0] = 1; // NIDT: EUI-64
    b[1] = 8;
    b[4..12].copy_from_slice(eui64);
    b[12] = 2; // NIDT: NGUID
    b[13] = 16;
    b[16..32].copy_from_slice(nguid);
    b[32] = 3; // NIDT: UUID
    b[33] = 16;
    b[36..52].copy_from_slice(nguid);
    b
}

/// A stable EUI-64 from a name: a third FNV-1a hash of it, with the
/// locally administered bit set and the group bit clear (IEEE's rule for
/// an identifier no OUI was bought for), so it can never collide with a
/// vendor's.
pub fn name_eui64(name: &str) -> [u8; 8] {
    let h = name.bytes().fold(0x6c62_272e_07bb_0142_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    });
    let mut e = h.to_be_bytes();
    e[0] = (e[0] & !0b01) | 0b10;
    e
}

/// A stable 16-byte id from a name (FNV-1a 128 is not in std; two 64-bit
/// FNV-1a hashes of the name with different seeds will do: ids need to
/// be stable and distinct, not secret).
pub fn name_guid(name: &str) -> [u8; 16] {
    let h = |seed: u64| {
        name.bytes().fold(seed, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
        })
    };
    let mut g = [0u8; 16];
    g[..8].copy_from_slice(&h(0xcbf2_9ce4_8422_2325).to_be_bytes());
    g[8..].copy_from_slice(&h(0x84222325_cbf29ce4).to_be_bytes());
    // A UUID of version 8 (custom) and the RFC 4122 variant.
    g[6] = (g[6] & 0x0F) | 0x80;
    g[8] = (g[8] & 0x3F) | 0x80;
    g
}

/// One subsystem in a discovery log: its NQN, reachable over TCP at
/// `addr`, over TLS 1.3 only when `secure_channel`.
#[derive(Debug, Clone)]
pub struct DiscoveryEntry {
    pub subnqn: String,
    pub addr: std::net::SocketAddr,
    pub secure_channel: bool,
}

/// Size of the discovery log header and of each entry.
pub const DISCOVERY_RECORD_BYTES: usize = 1024;

/// The discovery log page (NVMe-oF 1.1 §5.3): a 1 KiB header (generation
/// counter, number of records, record format 0) and one 1 KiB record per
/// subsystem (TCP, IPv4 or IPv6, NVM subsystem, secure channel required
/// or not, dynamic controllers, the address and port as text, TLS 1.3 or
/// no security).
pub fn discovery_log(genctr: u64, entries: &[DiscoveryEntry]) -> Vec<u8> {
    let mut b = vec![0u8; DISCOVERY_RECORD_BYTES * (1 + entries.len())];
    put64(&mut b, 0, genctr);
    put64(&mut b, 8, entries.len() as u64);
    for (i, e) in entries.iter().enumerate() {
        let r = &mut b[DISCOVERY_RECORD_BYTES * (i + 1)..DISCOVERY_RECORD_BYTES * (i + 2)];
        r[0] = 3; // TRTYPE: TCP
        r[1] = if e.addr.is_ipv4() { 1 } else { 2 }; // ADRFAM
        r[2] = 2; // SUBTYPE: NVM subsystem
                  // TREQ: secure channel required (01b) or not required (10b).
        r[3] = if e.secure_channel { 0b01 } else { 0b10 };
        put16(r, 4, 0); // PORTID
        put16(r, 6, 0xFFFF); // CNTLID: dynamic
        put16(r, 8, crate::limits::MAX_QUEUE_ENTRIES as u16); // ASQSZ
        let copy = |dst: &mut [u8], s: &str| {
            let n = s.len().min(dst.len());
            dst[..n].copy_from_slice(&s.as_bytes()[..n]);
        };
        // TRSVCID and TRADDR are ASCII, space padded.
        r[32..64].fill(b' ');
        copy(&mut r[32..64], &e.addr.port().to_string());
        copy(&mut r[256..512], &e.subnqn);
        r[512..768].fill(b' ');
        copy(&mut r[512..768], &e.addr.ip().to_string());
        // TSAS for TCP: SECTYPE 2 (TLS 1.3) or 0 (no security).
        r[768] = if e.secure_channel { 2 } else { 0 };
    }
    b
}

/// The Fabrics Connect data (1,024 bytes) as far as the target reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectData {
    pub hostid: [u8; 16],
    pub cntlid: u16,
    pub subnqn: String,
    pub hostnqn: String,
}

/// Bytes of the Connect data.
pub const CONNECT_DATA_BYTES: usize = 1024;

/// An NQN field: up to 256 bytes, NUL-terminated, UTF-8.
fn nqn(field: &[u8]) -> Option<String> {
    let end = field.iter().position(|&c| c == 0).unwrap_or(field.len());
    std::str::from_utf8(&field[..end]).ok().map(str::to_string)
}

/// Parse the Connect data; `Err(offset)` names the bad field's byte.
pub fn connect_data(b: &[u8]) -> Result<ConnectData, u16> {
    if b.len() < CONNECT_DATA_BYTES {
        return Err(0);
    }
    let mut hostid = [0u8; 16];
    hostid.copy_from_slice(&b[0..16]);
    Ok(ConnectData {
        hostid,
        cntlid: u16::from_le_bytes([b[16], b[17]]),
        subnqn: nqn(&b[256..512]).ok_or(256u16)?,
        hostnqn: nqn(&b[512..768]).ok_or(512u16)?,
    })
}

/// How the result of an admin or fabrics command goes back: the CQE's
/// status and dwords, and the data the host reads (the queue pair sends
/// it, `conn`; the controller's commands make it, `target`).
pub(crate) struct Reply {
    pub(crate) status: Status,
    pub(crate) dw0: u32,
    pub(crate) dw1: u32,
    pub(crate) data: Option<Vec<u8>>,
}

impl Reply {
    pub(crate) fn status(status: Status) -> Reply {
        Reply {
            status,
            dw0: 0,
            dw1: 0,
            data: None,
        }
    }
    pub(crate) fn ok() -> Reply {
        Reply::status(Status::SUCCESS)
    }
    pub(crate) fn dw0(dw0: u32) -> Reply {
        Reply { dw0, ..Reply::ok() }
    }
    pub(crate) fn data(data: Vec<u8>) -> Reply {
        Reply {
            data: Some(data),
            ..Reply::ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_field_layout() {
        assert_eq!(Status::SUCCESS.field(), 0);
        // SCT 0, SC 0x80, DNR: 0x8000 | 0x100.
        assert_eq!(Status::LBA_OUT_OF_RANGE.field(), 0x8100);
        assert_eq!(
            Status::CONNECT_INVALID_PARAMETERS.field(),
            0x8000 | 0x200 | 0x104
        );
    }

    #[test]
    fn identify_fields_where_the_spec_puts_them() {
        let c = identify_controller(&ControllerInfo {
            cntlid: 7,
            serial: "abc",
            subnqn: "nqn.2026-11.io.lull:v",
            nn: 1,
            ioccsz_bytes: 64 + 8192,
            mdts: 5,
            aerl: 3,
            elpe: 0,
            kas: 10,
            discovery: false,
        });
        assert_eq!(&c[4..8], b"abc ");
        assert_eq!(u16::from_le_bytes([c[78], c[79]]), 7);
        assert_eq!(c[77], 5);
        assert_eq!(&c[768..789], b"nqn.2026-11.io.lull:v");
        assert_eq!(u32::from_le_bytes(c[1792..1796].try_into().unwrap()), 516);
        let mut info = NamespaceInfo {
            blocks: 2048,
            lba_shift: 9,
            nguid: [1; 16],
            eui64: [2; 8],
            write_protected: false,
        };
        let ns = identify_namespace(&info);
        assert_eq!(u64::from_le_bytes(ns[0..8].try_into().unwrap()), 2048);
        assert_eq!(ns[130], 9);
        assert_eq!(ns[99], 0, "NSATTR: writable");
        assert_eq!(ns[30], 1, "NMIC: shared, so Linux makes a multipath head");
        assert_eq!(&ns[104..120], &[1; 16], "NGUID");
        assert_eq!(&ns[120..128], &[2; 8], "EUI64");
        assert_eq!(c[76] & 0b10, 0b10, "CMIC: several controllers");
        info.write_protected = true;
        assert_eq!(identify_namespace(&info)[99], 1, "NSATTR: write protected");
        assert_ne!(name_guid("a"), name_guid("b"));
        assert_ne!(name_eui64("a"), name_eui64("b"));
        assert_eq!(name_eui64("v1"), name_eui64("v1"), "stable across restarts");
        assert_eq!(
            name_eui64("v1")[0] & 0b11,
            0b10,
            "locally administered, unicast"
        );
        assert_eq!(cap(128) & 0xFFFF, 127);
    }

    #[test]
    fn namespace_id_descriptors_list_eui64_nguid_and_uuid() {
        let (g, e) = ([7u8; 16], [9u8; 8]);
        let d = ns_id_descriptors(&g, &e);
        assert_eq!((d[0], d[1]), (1, 8));
        assert_eq!(&d[4..12], &e);
        assert_eq!((d[12], d[13]), (2, 16));
        assert_eq!(&d[16..32], &g);
        assert_eq!((d[32], d[33]), (3, 16));
        assert_eq!(&d[36..52], &g);
        assert_eq!(d[52], 0, "the list ends");
    }

    #[test]
    fn discovery_log_records() {
        let addr: std::net::SocketAddr = "127.0.0.1:4420".parse().unwrap();
        let log = discovery_log(
            3,
            &[
                DiscoveryEntry {
                    subnqn: "nqn.x".into(),
                    addr,
                    secure_channel: false,
                },
                DiscoveryEntry {
                    subnqn: "nqn.tls".into(),
                    addr,
                    secure_channel: true,
                },
            ],
        );
        assert_eq!(log.len(), 3072);
        assert_eq!(u64::from_le_bytes(log[8..16].try_into().unwrap()), 2);
        // TREQ and TSAS.SECTYPE: not required and none; required and TLS 1.3.
        assert_eq!((log[1024 + 3], log[1024 + 768]), (0b10, 0));
        assert_eq!((log[2048 + 3], log[2048 + 768]), (0b01, 2));
        let r = &log[1024..];
        assert_eq!((r[0], r[1], r[2]), (3, 1, 2));
        assert_eq!(&r[32..37], b"4420 ");
        assert_eq!(&r[256..262], b"nqn.x\0");
        assert_eq!(&r[512..522], b"127.0.0.1 ");
    }

    #[test]
    fn connect_data_fields() {
        let mut b = vec![0u8; 1024];
        b[16..18].copy_from_slice(&0xFFFFu16.to_le_bytes());
        b[256..260].copy_from_slice(b"nqn1");
        b[512..515].copy_from_slice(b"hst");
        let d = connect_data(&b).unwrap();
        assert_eq!(
            (d.cntlid, d.subnqn.as_str(), d.hostnqn.as_str()),
            (0xFFFF, "nqn1", "hst")
        );
        b[300] = 0xFF; // not UTF-8 before the NUL? it is after "nqn1\0": ignored
        assert!(connect_data(&b).is_ok());
        b[258] = 0xFF;
        assert_eq!(connect_data(&b), Err(256));
        assert_eq!(connect_data(&b[..100]), Err(0));
    }
}
