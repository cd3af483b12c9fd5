//! NVMe/TCP PDUs (NVMe/TCP Transport Specification 1.0, §3.6): pure
//! encoding and decoding, no I/O. Every length and offset a peer sends is
//! checked here; a bad one is a [`PduError`] that says which field, and
//! maps to the fatal error status and field offset of the C2HTermReq the
//! target answers with.
//!
//! ```
//! use lull_nvmf::pdu::{self, Digests, Pdu};
//! let dg = Digests { header: true, data: true };
//! let sqe = [7u8; 64];
//! let bytes = pdu::encode(&Pdu::CapsuleCmd { sqe, data: b"in-capsule" }, dg);
//! let (got, used) = pdu::decode(&bytes, dg).unwrap().expect("whole PDU");
//! assert_eq!(used, bytes.len());
//! assert_eq!(got, Pdu::CapsuleCmd { sqe, data: b"in-capsule" });
//! // A truncated PDU is not an error, only not there yet.
//! assert_eq!(pdu::decode(&bytes[..10], dg).unwrap(), None);
//! ```
//!
//! Layout of every PDU: an 8-byte common header (type, flags, HLEN, PDO,
//! PLEN), the rest of the PDU header (HLEN bytes in all), a 4-byte header
//! digest (CRC32C, little endian) if negotiated, padding up to PDO, the
//! data, and a 4-byte data digest over the data if negotiated. ICReq and
//! ICResp never carry digests.

use crate::limits::{
    MAX_H2C_DATA_BYTES, MAX_IN_CAPSULE_DATA_BYTES, MAX_PDU_BYTES, MAX_TERM_REQ_DATA_BYTES,
};

/// Common header length.
pub const CH_LEN: usize = 8;
/// Digest length (header or data).
pub const DIGEST_LEN: usize = 4;
/// ICReq and ICResp are 128 bytes, header only.
pub const IC_LEN: usize = 128;
/// CapsuleCmd header: common header and a 64-byte submission queue entry.
pub const CAPSULE_CMD_HLEN: usize = CH_LEN + 64;
/// CapsuleResp header: common header and a 16-byte completion queue entry.
pub const CAPSULE_RESP_HLEN: usize = CH_LEN + 16;
/// H2CData, C2HData, R2T and the TermReqs have 24-byte headers.
pub const DATA_HLEN: usize = 24;
/// The only PDU format version there is (NVMe/TCP 1.0).
pub const PFV: u16 = 0;

pub const TYPE_IC_REQ: u8 = 0x00;
pub const TYPE_IC_RESP: u8 = 0x01;
pub const TYPE_H2C_TERM_REQ: u8 = 0x02;
pub const TYPE_C2H_TERM_REQ: u8 = 0x03;
pub const TYPE_CAPSULE_CMD: u8 = 0x04;
pub const TYPE_CAPSULE_RESP: u8 = 0x05;
pub const TYPE_H2C_DATA: u8 = 0x06;
pub const TYPE_C2H_DATA: u8 = 0x07;
pub const TYPE_R2T: u8 = 0x09;

/// Flags of the common header.
pub const FLAG_HDGST: u8 = 0x01;
pub const FLAG_DDGST: u8 = 0x02;
/// H2CData/C2HData: the last PDU of a transfer.
pub const FLAG_LAST_PDU: u8 = 0x04;
/// C2HData: the command succeeded and no CapsuleResp follows.
pub const FLAG_SUCCESS: u8 = 0x08;

/// Fatal error status of a TermReq (NVMe/TCP 1.0, Figure 23).
pub const FES_INVALID_HEADER_FIELD: u16 = 0x01;
pub const FES_PDU_SEQUENCE_ERROR: u16 = 0x02;
pub const FES_HEADER_DIGEST_ERROR: u16 = 0x03;
pub const FES_DATA_OUT_OF_RANGE: u16 = 0x04;
pub const FES_DATA_LIMIT_EXCEEDED: u16 = 0x05;
pub const FES_UNSUPPORTED_PARAMETER: u16 = 0x06;

/// Which digests were negotiated (ICReq/ICResp DGST field).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

impl Digests {
    fn hd(self) -> usize {
        if self.header {
            DIGEST_LEN
        } else {
            0
        }
    }
}

/// ICReq (host → controller).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcReq {
    pub pfv: u16,
    /// Host PDU data alignment: data in C2H PDUs starts at a multiple of
    /// `(hpda + 1) * 4` bytes.
    pub hpda: u8,
    pub digests: Digests,
    /// Outstanding R2Ts per command the host accepts, 0-based.
    pub maxr2t: u32,
}

/// ICResp (controller → host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcResp {
    pub pfv: u16,
    /// Controller PDU data alignment, as `hpda`.
    pub cpda: u8,
    pub digests: Digests,
    /// Most data bytes in one H2CData PDU.
    pub maxh2cdata: u32,
}

/// The header fields of H2CData and C2HData.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    /// Command capsule CID the data belongs to.
    pub cccid: u16,
    /// Transfer tag (H2CData: the R2T's; C2HData: reserved).
    pub ttag: u16,
    /// Offset of this PDU's data in the command's data.
    pub datao: u32,
    /// PDU flags (LAST_PDU, SUCCESS); digest flags are set by the encoder.
    pub flags: u8,
}

/// R2T: the controller asks for `r2tl` bytes at `r2to` of command `cccid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct R2t {
    pub cccid: u16,
    pub ttag: u16,
    pub r2to: u32,
    pub r2tl: u32,
}

/// One decoded PDU; data borrows from the input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pdu<'a> {
    IcReq(IcReq),
    IcResp(IcResp),
    CapsuleCmd {
        sqe: [u8; 64],
        data: &'a [u8],
    },
    CapsuleResp {
        cqe: [u8; 16],
    },
    H2CData {
        hdr: DataHeader,
        data: &'a [u8],
    },
    C2HData {
        hdr: DataHeader,
        data: &'a [u8],
    },
    R2t(R2t),
    /// H2CTermReq (`from_host`) or C2HTermReq: fatal error status, field
    /// information, and (up to 128 bytes of) the offending PDU header.
    TermReq {
        from_host: bool,
        fes: u16,
        fei: u32,
        data: &'a [u8],
    },
}

/// A PDU the peer sent that cannot be taken. Each is fatal to the
/// connection: the answer is a TermReq with [`PduError::fes`] and
/// [`PduError::fei`] (the byte offset of the bad field in the header).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PduError {
    #[error("unknown PDU type {0:#04x}")]
    UnknownType(u8),
    #[error("PDU type {pdu_type:#04x}: HLEN {hlen}, expected {expected}")]
    HeaderLength {
        pdu_type: u8,
        hlen: u8,
        expected: usize,
    },
    #[error("PDU type {pdu_type:#04x}: PLEN {plen} out of bounds [{min}, {max}]")]
    PduLength {
        pdu_type: u8,
        plen: u32,
        min: usize,
        max: usize,
    },
    #[error("PDU type {pdu_type:#04x}: PDO {pdo} does not fit HLEN {hlen} and PLEN {plen}")]
    DataOffset {
        pdu_type: u8,
        pdo: u8,
        hlen: u8,
        plen: u32,
    },
    #[error(
        "PDU type {pdu_type:#04x}: digest flags {flags:#04x} disagree with the negotiated digests"
    )]
    DigestFlags { pdu_type: u8, flags: u8 },
    #[error("header digest mismatch (PDU type {0:#04x})")]
    HeaderDigest(u8),
    #[error("data digest mismatch (PDU type {0:#04x})")]
    DataDigest(u8),
    #[error("data length {len} exceeds the limit of {max} bytes")]
    DataTooLong { len: usize, max: usize },
    #[error("PDU type {0:#04x} out of sequence")]
    Sequence(u8),
    #[error("{what} {value} unsupported")]
    Unsupported { what: &'static str, value: u32 },
}

impl PduError {
    /// The TermReq fatal error status for this error.
    pub fn fes(&self) -> u16 {
        match self {
            PduError::HeaderDigest(_) => FES_HEADER_DIGEST_ERROR,
            PduError::DataTooLong { .. } => FES_DATA_LIMIT_EXCEEDED,
            PduError::Unsupported { .. } => FES_UNSUPPORTED_PARAMETER,
            PduError::Sequence(_) => FES_PDU_SEQUENCE_ERROR,
            _ => FES_INVALID_HEADER_FIELD,
        }
    }

    /// The TermReq fatal error information: the offset of the bad field.
    pub fn fei(&self) -> u32 {
        match self {
            PduError::UnknownType(_) | PduError::Sequence(_) => 0,
            PduError::DigestFlags { .. } => 1,
            PduError::HeaderLength { .. } => 2,
            PduError::DataOffset { .. } => 3,
            PduError::PduLength { .. } | PduError::DataTooLong { .. } => 4,
            PduError::Unsupported { .. } => 8,
            PduError::HeaderDigest(_) | PduError::DataDigest(_) => 0,
        }
    }
}

/// The common header, as far as it is read before the whole PDU is there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommonHeader {
    pub pdu_type: u8,
    pub flags: u8,
    pub hlen: u8,
    pub pdo: u8,
    pub plen: u32,
}

/// The common header at the start of `buf`, if 8 bytes are there.
pub fn common_header(buf: &[u8]) -> Option<CommonHeader> {
    let b = buf.get(..CH_LEN)?;
    Some(CommonHeader {
        pdu_type: b[0],
        flags: b[1],
        hlen: b[2],
        pdo: b[3],
        plen: u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
    })
}

/// CRC32C as NVMe/TCP digests use it (RFC 3720's CRC32C).
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// The header length each PDU type has, and the most data it may carry.
fn shape(pdu_type: u8) -> Result<(usize, usize), PduError> {
    Ok(match pdu_type {
        TYPE_IC_REQ | TYPE_IC_RESP => (IC_LEN, 0),
        TYPE_H2C_TERM_REQ | TYPE_C2H_TERM_REQ => (DATA_HLEN, MAX_TERM_REQ_DATA_BYTES),
        TYPE_CAPSULE_CMD => (CAPSULE_CMD_HLEN, MAX_IN_CAPSULE_DATA_BYTES),
        TYPE_CAPSULE_RESP => (CAPSULE_RESP_HLEN, 0),
        TYPE_H2C_DATA => (DATA_HLEN, MAX_H2C_DATA_BYTES),
        // C2HData is only decoded by tests (and initiators); a read of the
        // largest transfer comes in one PDU.
        TYPE_C2H_DATA => (DATA_HLEN, crate::limits::MAX_TRANSFER_BYTES),
        TYPE_R2T => (DATA_HLEN, 0),
        other => return Err(PduError::UnknownType(other)),
    })
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Decode one PDU from the front of `buf`. `Ok(None)`: not all of it has
/// arrived (the common header's PLEN, once there, has been checked, so a
/// caller may wait for that many bytes). `Ok(Some((pdu, used)))`: a whole
/// PDU of `used` bytes. Digests are those negotiated; ICReq/ICResp have
/// none whatever was negotiated.
pub fn decode(buf: &[u8], dg: Digests) -> Result<Option<(Pdu<'_>, usize)>, PduError> {
    let Some(ch) = common_header(buf) else {
        return Ok(None);
    };
    let t = ch.pdu_type;
    let (hlen, max_data) = shape(t)?;
    if usize::from(ch.hlen) != hlen {
        return Err(PduError::HeaderLength {
            pdu_type: t,
            hlen: ch.hlen,
            expected: hlen,
        });
    }
    let is_ic = matches!(t, TYPE_IC_REQ | TYPE_IC_RESP);
    let hd = if is_ic { 0 } else { dg.hd() };
    // The flags must say what was negotiated: HDGSTF on every PDU after
    // the IC exchange when header digests are on; DDGSTF on every PDU with
    // data when data digests are on.
    let flags_hd = ch.flags & FLAG_HDGST != 0;
    let flags_dd = ch.flags & FLAG_DDGST != 0;
    let plen = ch.plen as usize;
    let min = hlen + hd;
    let has_data = plen > min;
    let dd = if dg.data && has_data && !is_ic {
        DIGEST_LEN
    } else {
        0
    };
    let max = (min + max_data + dd + 128).min(MAX_PDU_BYTES);
    if plen < min || plen > max {
        return Err(PduError::PduLength {
            pdu_type: t,
            plen: ch.plen,
            min,
            max,
        });
    }
    if flags_hd != (hd > 0) || (has_data && flags_dd != (dd > 0)) || (!has_data && flags_dd) {
        return Err(PduError::DigestFlags {
            pdu_type: t,
            flags: ch.flags,
        });
    }
    // Where the data starts: PDO, at or after the header (and its digest),
    // leaving room for the data digest; no data means PDO is 0 or ignored.
    let pdo = usize::from(ch.pdo);
    let data_range = if has_data {
        if pdo < min || pdo + dd > plen {
            return Err(PduError::DataOffset {
                pdu_type: t,
                pdo: ch.pdo,
                hlen: ch.hlen,
                plen: ch.plen,
            });
        }
        pdo..plen - dd
    } else {
        plen..plen
    };
    if data_range.len() > max_data {
        return Err(PduError::DataTooLong {
            len: data_range.len(),
            max: max_data,
        });
    }
    if buf.len() < plen {
        return Ok(None);
    }
    let h = &buf[..hlen];
    if hd > 0 && crc32c(h).to_le_bytes() != buf[hlen..hlen + DIGEST_LEN] {
        return Err(PduError::HeaderDigest(t));
    }
    let data = &buf[data_range.clone()];
    if dd > 0 && crc32c(data).to_le_bytes() != buf[plen - DIGEST_LEN..plen] {
        return Err(PduError::DataDigest(t));
    }
    let pdu = match t {
        TYPE_IC_REQ => {
            let pfv = le16(h, 8);
            if pfv != PFV {
                return Err(PduError::Unsupported {
                    what: "PDU format version",
                    value: u32::from(pfv),
                });
            }
            let hpda = h[10];
            if hpda > 31 {
                return Err(PduError::Unsupported {
                    what: "HPDA",
                    value: u32::from(hpda),
                });
            }
            Pdu::IcReq(IcReq {
                pfv,
                hpda,
                digests: Digests {
                    header: h[11] & 1 != 0,
                    data: h[11] & 2 != 0,
                },
                maxr2t: le32(h, 12),
            })
        }
        TYPE_IC_RESP => Pdu::IcResp(IcResp {
            pfv: le16(h, 8),
            cpda: h[10],
            digests: Digests {
                header: h[11] & 1 != 0,
                data: h[11] & 2 != 0,
            },
            maxh2cdata: le32(h, 12),
        }),
        TYPE_CAPSULE_CMD => {
            let mut sqe = [0u8; 64];
            sqe.copy_from_slice(&h[CH_LEN..CH_LEN + 64]);
            Pdu::CapsuleCmd { sqe, data }
        }
        TYPE_CAPSULE_RESP => {
            let mut cqe = [0u8; 16];
            cqe.copy_from_slice(&h[CH_LEN..CH_LEN + 16]);
            Pdu::CapsuleResp { cqe }
        }
        TYPE_H2C_DATA | TYPE_C2H_DATA => {
            let datal = le32(h, 16) as usize;
            if datal != data.len() {
                return Err(PduError::PduLength {
                    pdu_type: t,
                    plen: ch.plen,
                    min: pdo + datal + dd,
                    max: pdo + datal + dd,
                });
            }
            let hdr = DataHeader {
                cccid: le16(h, 8),
                ttag: le16(h, 10),
                datao: le32(h, 12),
                flags: ch.flags & (FLAG_LAST_PDU | FLAG_SUCCESS),
            };
            if t == TYPE_H2C_DATA {
                Pdu::H2CData { hdr, data }
            } else {
                Pdu::C2HData { hdr, data }
            }
        }
        TYPE_R2T => Pdu::R2t(R2t {
            cccid: le16(h, 8),
            ttag: le16(h, 10),
            r2to: le32(h, 12),
            r2tl: le32(h, 16),
        }),
        TYPE_H2C_TERM_REQ | TYPE_C2H_TERM_REQ => Pdu::TermReq {
            from_host: t == TYPE_H2C_TERM_REQ,
            fes: le16(h, 8),
            fei: le32(h, 10),
            data,
        },
        other => return Err(PduError::UnknownType(other)),
    };
    Ok(Some((pdu, plen)))
}

/// Largest data alignment a header is padded to: HPDA is at most 31
/// (checked in ICReq), so `(31 + 1) * 4` bytes.
pub const MAX_PDU_ALIGN: usize = 128;

/// Most bytes [`encode_header`] writes: the 128-byte ICReq/ICResp (no
/// digest), or a data PDU's 24-byte header and digest padded to a PDO of
/// at most [`MAX_PDU_ALIGN`] (a CapsuleCmd's 76 bytes with its digest
/// stay under it too).
pub const MAX_ENCODED_HEADER: usize = 128;

/// An encoded PDU header (and its digest and padding up to PDO), ready to
/// precede the data in an output frame. A fixed buffer: encoding the
/// header of every reply allocates nothing.
#[derive(Debug, Clone)]
pub struct Header {
    bytes: [u8; MAX_ENCODED_HEADER],
    len: usize,
}

impl Header {
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn push(&mut self, b: &[u8]) {
        self.bytes[self.len..self.len + b.len()].copy_from_slice(b);
        self.len += b.len();
    }
}

/// Encode the header part of a PDU of type `t` whose type-specific header
/// is `specific` (HLEN − 8 bytes, at most 120), carrying `data_len` data
/// bytes whose start is aligned to `align` bytes (clamped to
/// 1..=[`MAX_PDU_ALIGN`]). Returns the header, header digest and
/// padding: the data (and its digest, if `dg.data`) follow.
pub fn encode_header(
    t: u8,
    flags: u8,
    specific: &[u8],
    data_len: usize,
    align: usize,
    dg: Digests,
) -> Header {
    let is_ic = matches!(t, TYPE_IC_REQ | TYPE_IC_RESP);
    let specific = &specific[..specific.len().min(IC_LEN - CH_LEN)];
    let align = align.clamp(1, MAX_PDU_ALIGN);
    let hlen = CH_LEN + specific.len();
    let hd = if is_ic { 0 } else { dg.hd() };
    let dd = if dg.data && data_len > 0 && !is_ic {
        DIGEST_LEN
    } else {
        0
    };
    let pdo = if data_len > 0 {
        (hlen + hd).div_ceil(align) * align
    } else {
        0
    };
    let plen = if data_len > 0 {
        pdo + data_len + dd
    } else {
        hlen + hd
    };
    let mut f = flags;
    if hd > 0 {
        f |= FLAG_HDGST;
    }
    if dd > 0 {
        f |= FLAG_DDGST;
    }
    let mut h = Header {
        bytes: [0; MAX_ENCODED_HEADER],
        len: 0,
    };
    h.push(&[t, f, hlen as u8, pdo as u8]);
    h.push(&(plen as u32).to_le_bytes());
    h.push(specific);
    if hd > 0 {
        let d = crc32c(&h.bytes[..hlen]);
        h.push(&d.to_le_bytes());
    }
    // The padding: the buffer is zeroed. An IC PDU has no digest and no
    // data; a data PDU's header and digest are at most 28 bytes, so PDO
    // fits (asserted by the const below).
    if data_len > 0 {
        debug_assert!(pdo <= MAX_ENCODED_HEADER);
        h.len = h.len.max(pdo.min(MAX_ENCODED_HEADER));
    }
    h
}

const _: () = assert!(MAX_ENCODED_HEADER >= IC_LEN);
const _: () = assert!(MAX_ENCODED_HEADER >= MAX_PDU_ALIGN);
const _: () = assert!(MAX_ENCODED_HEADER >= CAPSULE_CMD_HLEN + DIGEST_LEN);

/// The type-specific header of a CapsuleResp: the 16-byte CQE.
pub fn capsule_resp_header(cqe: &[u8; 16], dg: Digests) -> Header {
    encode_header(TYPE_CAPSULE_RESP, 0, cqe, 0, 1, dg)
}

/// The header of an R2T PDU.
pub fn r2t_header(r: &R2t, dg: Digests) -> Header {
    encode_header(TYPE_R2T, 0, &r2t_specific(r), 0, 1, dg)
}

fn r2t_specific(r: &R2t) -> [u8; 16] {
    let mut s = [0u8; DATA_HLEN - CH_LEN];
    s[0..2].copy_from_slice(&r.cccid.to_le_bytes());
    s[2..4].copy_from_slice(&r.ttag.to_le_bytes());
    s[4..8].copy_from_slice(&r.r2to.to_le_bytes());
    s[8..12].copy_from_slice(&r.r2tl.to_le_bytes());
    s
}

/// The type-specific header of H2CData/C2HData.
pub fn data_specific(hdr: &DataHeader, datal: u32) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[0..2].copy_from_slice(&hdr.cccid.to_le_bytes());
    s[2..4].copy_from_slice(&hdr.ttag.to_le_bytes());
    s[4..8].copy_from_slice(&hdr.datao.to_le_bytes());
    s[8..12].copy_from_slice(&datal.to_le_bytes());
    s
}

/// Encode a whole PDU (header, digests, padding, data): for small PDUs
/// and tests. Data PDUs are aligned to 4 bytes past their header (CPDA and
/// HPDA 0).
pub fn encode(pdu: &Pdu<'_>, dg: Digests) -> Vec<u8> {
    let (t, flags, specific, data): (u8, u8, Vec<u8>, &[u8]) = match pdu {
        Pdu::IcReq(r) => {
            let mut s = vec![0u8; IC_LEN - CH_LEN];
            s[0..2].copy_from_slice(&r.pfv.to_le_bytes());
            s[2] = r.hpda;
            s[3] = u8::from(r.digests.header) | (u8::from(r.digests.data) << 1);
            s[4..8].copy_from_slice(&r.maxr2t.to_le_bytes());
            (TYPE_IC_REQ, 0, s, &[])
        }
        Pdu::IcResp(r) => {
            let mut s = vec![0u8; IC_LEN - CH_LEN];
            s[0..2].copy_from_slice(&r.pfv.to_le_bytes());
            s[2] = r.cpda;
            s[3] = u8::from(r.digests.header) | (u8::from(r.digests.data) << 1);
            s[4..8].copy_from_slice(&r.maxh2cdata.to_le_bytes());
            (TYPE_IC_RESP, 0, s, &[])
        }
        Pdu::CapsuleCmd { sqe, data } => (TYPE_CAPSULE_CMD, 0, sqe.to_vec(), data),
        Pdu::CapsuleResp { cqe } => (TYPE_CAPSULE_RESP, 0, cqe.to_vec(), &[]),
        Pdu::H2CData { hdr, data } => (
            TYPE_H2C_DATA,
            hdr.flags,
            data_specific(hdr, data.len() as u32).to_vec(),
            data,
        ),
        Pdu::C2HData { hdr, data } => (
            TYPE_C2H_DATA,
            hdr.flags,
            data_specific(hdr, data.len() as u32).to_vec(),
            data,
        ),
        Pdu::R2t(r) => (TYPE_R2T, 0, r2t_specific(r).to_vec(), &[]),
        Pdu::TermReq {
            from_host,
            fes,
            fei,
            data,
        } => {
            let mut s = vec![0u8; DATA_HLEN - CH_LEN];
            s[0..2].copy_from_slice(&fes.to_le_bytes());
            s[2..6].copy_from_slice(&fei.to_le_bytes());
            let t = if *from_host {
                TYPE_H2C_TERM_REQ
            } else {
                TYPE_C2H_TERM_REQ
            };
            (t, 0, s, data)
        }
    };
    let mut out = encode_header(t, flags, &specific, data.len(), 1, dg)
        .as_slice()
        .to_vec();
    out.extend_from_slice(data);
    let is_ic = matches!(t, TYPE_IC_REQ | TYPE_IC_RESP);
    if dg.data && !data.is_empty() && !is_ic {
        out.extend_from_slice(&crc32c(data).to_le_bytes());
    }
    out
}

/// A TermReq carries at most this much of the offending PDU's header.
pub const TERM_REQ_MAX_COPY: usize = 128;

/// A C2HTermReq for `err` about the PDU that starts `offending` (up to
/// [`TERM_REQ_MAX_COPY`] bytes of its header are echoed). TermReqs carry
/// no digests.
pub fn c2h_term_req(err: &PduError, offending: &[u8]) -> Vec<u8> {
    let copy = &offending[..offending.len().min(TERM_REQ_MAX_COPY)];
    encode(
        &Pdu::TermReq {
            from_host: false,
            fes: err.fes(),
            fei: err.fei(),
            data: copy,
        },
        Digests::default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NONE: Digests = Digests {
        header: false,
        data: false,
    };
    const BOTH: Digests = Digests {
        header: true,
        data: true,
    };

    /// The fixed-buffer headers of the reply path are what `encode`
    /// writes, with and without digests, and a C2HData header is padded
    /// to the host's alignment (HPDA 0..=31) and decodes.
    #[test]
    fn reply_headers_match_encode_and_pad_to_hpda() {
        let r2t = R2t {
            cccid: 7,
            ttag: 3,
            r2to: 0,
            r2tl: 8192,
        };
        let cqe: [u8; 16] = std::array::from_fn(|i| i as u8 + 1);
        for dg in [
            NONE,
            BOTH,
            Digests {
                header: true,
                data: false,
            },
        ] {
            assert_eq!(
                r2t_header(&r2t, dg).as_slice(),
                &encode(&Pdu::R2t(r2t), dg)[..]
            );
            assert_eq!(
                capsule_resp_header(&cqe, dg).as_slice(),
                &encode(&Pdu::CapsuleResp { cqe }, dg)[..]
            );
            for hpda in 0..=31usize {
                let align = (hpda + 1) * 4;
                let hdr = DataHeader {
                    cccid: 9,
                    ttag: 0,
                    datao: 0,
                    flags: FLAG_LAST_PDU,
                };
                let data = [0xC3u8; 100];
                let h = encode_header(
                    TYPE_C2H_DATA,
                    hdr.flags,
                    &data_specific(&hdr, data.len() as u32),
                    data.len(),
                    align,
                    dg,
                );
                assert_eq!(h.len() % align, 0);
                assert!(h.len() <= MAX_ENCODED_HEADER);
                let mut pdu = h.as_slice().to_vec();
                pdu.extend_from_slice(&data);
                if dg.data {
                    pdu.extend_from_slice(&crc32c(&data).to_le_bytes());
                }
                let (p, used) = decode(&pdu, dg).unwrap().unwrap();
                assert_eq!(used, pdu.len());
                assert!(
                    matches!(p, Pdu::C2HData { hdr: d, data: got } if d == hdr && got == &data[..])
                );
            }
        }
    }

    #[test]
    fn icreq_of_spdk_decodes() {
        // An ICReq as SPDK's initiator sends it: PFV 0, HPDA 0, both
        // digests asked for, MAXR2T 0.
        let mut b = vec![0u8; 128];
        b[..8].copy_from_slice(&[0, 0, 128, 0, 128, 0, 0, 0]);
        b[11] = 3;
        let (p, used) = decode(&b, BOTH).unwrap().unwrap();
        assert_eq!(used, 128);
        assert_eq!(
            p,
            Pdu::IcReq(IcReq {
                pfv: 0,
                hpda: 0,
                digests: BOTH,
                maxr2t: 0
            })
        );
    }

    #[test]
    fn every_bad_field_is_named() {
        let good = encode(
            &Pdu::CapsuleCmd {
                sqe: [1; 64],
                data: &[9; 100],
            },
            BOTH,
        );
        assert!(decode(&good, BOTH).unwrap().is_some());
        let bad = |at: usize, v: u8| {
            let mut b = good.clone();
            b[at] = v;
            decode(&b, BOTH).unwrap_err()
        };
        assert_eq!(bad(0, 0x42), PduError::UnknownType(0x42));
        assert!(matches!(bad(2, 71), PduError::HeaderLength { .. }));
        assert!(matches!(bad(3, 10), PduError::DataOffset { .. }));
        assert!(matches!(bad(1, 0), PduError::DigestFlags { .. }));
        assert!(matches!(bad(20, 0), PduError::HeaderDigest(_)));
        let last = good.len() - 10;
        assert!(matches!(bad(last, 0), PduError::DataDigest(_)));
        // PLEN past the limit is refused from the common header alone,
        // before the bytes arrive.
        let mut b = good[..8].to_vec();
        b[4..8].copy_from_slice(&(1u32 << 30).to_le_bytes());
        assert!(matches!(
            decode(&b, BOTH).unwrap_err(),
            PduError::PduLength { .. }
        ));
        // PLEN shorter than the header.
        let mut b = good.clone();
        b[4..8].copy_from_slice(&10u32.to_le_bytes());
        assert!(matches!(
            decode(&b, BOTH).unwrap_err(),
            PduError::PduLength { .. }
        ));
        // In-capsule data beyond the limit.
        let big = encode(
            &Pdu::CapsuleCmd {
                sqe: [0; 64],
                data: &vec![0; MAX_IN_CAPSULE_DATA_BYTES + 4],
            },
            NONE,
        );
        assert!(decode(&big, NONE).is_err());
        // An ICReq of another format version.
        let mut ic = encode(
            &Pdu::IcReq(IcReq {
                pfv: 0,
                hpda: 0,
                digests: NONE,
                maxr2t: 0,
            }),
            NONE,
        );
        ic[8] = 1;
        let e = decode(&ic, NONE).unwrap_err();
        assert_eq!(e.fes(), FES_UNSUPPORTED_PARAMETER);
    }

    #[test]
    fn h2c_datal_must_match_the_pdu() {
        let mut b = encode(
            &Pdu::H2CData {
                hdr: DataHeader {
                    cccid: 1,
                    ttag: 2,
                    datao: 0,
                    flags: FLAG_LAST_PDU,
                },
                data: &[5; 64],
            },
            NONE,
        );
        b[16] = 65;
        assert!(matches!(
            decode(&b, NONE).unwrap_err(),
            PduError::PduLength { .. }
        ));
    }

    #[test]
    fn term_req_echoes_the_offending_header() {
        let err = PduError::UnknownType(0x33);
        let t = c2h_term_req(&err, &[0x33; 200]);
        let (p, _) = decode(&t, NONE).unwrap().unwrap();
        match p {
            Pdu::TermReq {
                from_host,
                fes,
                fei,
                data,
            } => {
                assert!(!from_host);
                assert_eq!((fes, fei), (FES_INVALID_HEADER_FIELD, 0));
                assert_eq!(data.len(), TERM_REQ_MAX_COPY);
            }
            other => panic!("{other:?}"),
        }
    }

    fn digests() -> impl Strategy<Value = Digests> {
        (any::<bool>(), any::<bool>()).prop_map(|(header, data)| Digests { header, data })
    }

    fn data_header() -> impl Strategy<Value = DataHeader> {
        (
            any::<u16>(),
            any::<u16>(),
            any::<u32>(),
            prop::sample::select(vec![0, FLAG_LAST_PDU, FLAG_LAST_PDU | FLAG_SUCCESS]),
        )
            .prop_map(|(cccid, ttag, datao, flags)| DataHeader {
                cccid,
                ttag,
                datao,
                flags,
            })
    }

    proptest! {
        #[test]
        fn round_trip(
            dg in digests(),
            kind in 0u8..8,
            sqe in prop::collection::vec(any::<u8>(), 64),
            data in prop::collection::vec(any::<u8>(), 0..5000),
            hdr in data_header(),
            words in (any::<u16>(), any::<u32>(), any::<u32>()),
            split in any::<prop::sample::Index>(),
        ) {
            let mut s = [0u8; 64];
            s.copy_from_slice(&sqe);
            let mut c = [0u8; 16];
            c.copy_from_slice(&sqe[..16]);
            let term = &data[..data.len().min(TERM_REQ_MAX_COPY)];
            let pdu = match kind {
                0 => Pdu::IcReq(IcReq { pfv: 0, hpda: (words.0 % 32) as u8, digests: dg, maxr2t: words.1 }),
                1 => Pdu::IcResp(IcResp { pfv: 0, cpda: 0, digests: dg, maxh2cdata: words.1 }),
                2 => Pdu::CapsuleCmd { sqe: s, data: &data },
                3 => Pdu::CapsuleResp { cqe: c },
                4 => Pdu::H2CData { hdr, data: &data },
                5 => Pdu::C2HData { hdr, data: &data },
                6 => Pdu::R2t(R2t { cccid: words.0, ttag: words.0 ^ 1, r2to: words.1, r2tl: words.2 }),
                _ => Pdu::TermReq { from_host: words.0 % 2 == 0, fes: words.0, fei: words.1, data: term },
            };
            let bytes = encode(&pdu, dg);
            let (got, used) = decode(&bytes, dg).unwrap().expect("whole");
            prop_assert_eq!(used, bytes.len());
            prop_assert_eq!(got, pdu);
            // Any prefix is "not yet", never an error or a wrong PDU.
            let cut = split.index(bytes.len());
            prop_assert_eq!(decode(&bytes[..cut], dg).unwrap(), None);
        }

        /// Garbage never panics; whatever decodes used no more than it had.
        #[test]
        fn garbage_is_an_error_or_a_pdu(bytes in prop::collection::vec(any::<u8>(), 0..300), dg in digests()) {
            if let Ok(Some((_, used))) = decode(&bytes, dg) {
                prop_assert!(used <= bytes.len());
            }
        }
    }
}
