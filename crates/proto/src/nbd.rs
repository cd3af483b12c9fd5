//! The NBD wire protocol as a pure codec: bytes in, parsed events and
//! replies out, no sockets. The frontend in `lull-nbd` owns the I/O; this
//! module decides what every byte means and what to answer.
//!
//! Only the fixed newstyle handshake is served (no oldstyle).
//! `NBD_OPT_STARTTLS` is answered as the server's [`TlsPolicy`] says;
//! the TLS session itself is the caller's (see [`HandshakeStatus::StartTls`]).
//! Structured replies and the metadata contexts `base:allocation` and
//! `lull:changed:SNAPSHOT` (blocks written since a snapshot, for
//! incremental backups) are negotiated on request ([`structured`]);
//! clients that do not ask get simple replies. The reference is the NBD
//! protocol document, `doc/proto.md` in the NetworkBlockDevice/nbd
//! repository; caps on negotiation follow nbdkit's
//! `server/protocol-handshake-newstyle.c`.
//!
//! # Worked example
//!
//! A client connects, sends its flags and `NBD_OPT_GO` for the export
//! `disk`, then reads 4 KiB from it.
//!
//! ```
//! use lull_proto::nbd::{self, Command, ExportInfo, Exports, HandshakeStatus, Request,
//!                       ServerHandshake, Verdict};
//!
//! struct OneDisk;
//! impl Exports for OneDisk {
//!     fn names(&self) -> Vec<String> {
//!         vec!["disk".to_string()]
//!     }
//!     fn lookup(&self, name: &str) -> Option<ExportInfo> {
//!         // "" is the default export; this server makes it "disk".
//!         (name == "disk" || name.is_empty()).then(|| ExportInfo {
//!             size_bytes: 1 << 20,
//!             transmission_flags: nbd::NBD_FLAG_HAS_FLAGS | nbd::NBD_FLAG_SEND_FLUSH,
//!             description: None,
//!         })
//!     }
//! }
//!
//! // Accepting the connection queues the greeting; write `out` to the socket.
//! let mut out = Vec::new();
//! let mut handshake = ServerHandshake::new(&mut out);
//! assert_eq!(out.len(), nbd::SERVER_GREETING_LEN);
//! out.clear();
//!
//! // What the client sends: flags, then IHAVEOPT / NBD_OPT_GO / length /
//! // name length / name / zero information requests.
//! let mut received = Vec::new();
//! received.extend_from_slice(&nbd::NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes());
//! received.extend_from_slice(&nbd::IHAVEOPT.to_be_bytes());
//! received.extend_from_slice(&nbd::NBD_OPT_GO.to_be_bytes());
//! received.extend_from_slice(&10u32.to_be_bytes());
//! received.extend_from_slice(&4u32.to_be_bytes());
//! received.extend_from_slice(b"disk");
//! received.extend_from_slice(&0u16.to_be_bytes());
//!
//! // Partial input: only whole messages are consumed. Keep the rest and
//! // present it again with the bytes that arrive next.
//! let (used, status) = handshake.feed(&received[..7], &OneDisk, &mut out).unwrap();
//! assert_eq!((used, status), (4, HandshakeStatus::NeedMore));
//! let (used, status) = handshake.feed(&received[4..], &OneDisk, &mut out).unwrap();
//! assert_eq!(used, received.len() - 4);
//! let HandshakeStatus::Done { export_name, info } = status else { panic!("not done") };
//! assert_eq!(export_name, "disk");
//! // `out` holds NBD_REP_INFO replies and the final NBD_REP_ACK: flush it,
//! // then the connection is in the transmission phase.
//!
//! // Transmission: the client sends a 28-byte request header.
//! let header = nbd::encode_request(&Request {
//!     flags: 0,
//!     command: Command::Read,
//!     cookie: 7,
//!     offset: 0,
//!     length: 4096,
//! });
//! let request = nbd::decode_request(&header).unwrap();
//! let mut reply = [0u8; nbd::SIMPLE_REPLY_LEN];
//! match nbd::validate(&request, info.size_bytes, info.transmission_flags) {
//!     Verdict::Ok => {
//!         // Read from the device, then send the reply header and the data.
//!         nbd::encode_simple_reply(&mut reply, nbd::NBD_SUCCESS, request.cookie);
//!     }
//!     Verdict::Error { nbd_error, drain_bytes } => {
//!         // Discard `drain_bytes` of write payload first, then reply.
//!         assert_eq!(drain_bytes, 0);
//!         nbd::encode_simple_reply(&mut reply, nbd_error, request.cookie);
//!     }
//!     Verdict::Disconnect(why) => panic!("closing: {why}"),
//! }
//! ```
//!
//! # Layout
//!
//! - `structured`: structured replies (`NBD_OPT_STRUCTURED_REPLY`) and block status chunks.

use thiserror::Error;

pub mod structured;

// ---------------------------------------------------------------------------
// Magics.

/// `NBDMAGIC`: first 8 bytes of the server greeting (also `INIT_PASSWD`).
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: second word of the newstyle greeting, and the magic that
/// opens every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Oldstyle `cliserv_magic`. lull never sends it; listed so a capture can
/// be recognised.
pub const NBD_CLISERV_MAGIC: u64 = 0x0000_4202_8186_1253;
/// Opens every fixed newstyle option reply.
pub const NBD_REP_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Opens every transmission request.
pub const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
/// Opens a transmission request with extended headers (not negotiated by lull).
pub const NBD_EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Opens a simple reply (formerly `NBD_REPLY_MAGIC`).
pub const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Opens a structured reply chunk (see [`structured`]).
pub const NBD_STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Opens an extended reply chunk (not negotiated by lull).
pub const NBD_EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

// ---------------------------------------------------------------------------
// Handshake flags (server, 16 bits) and client flags (32 bits).

pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;

pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// The handshake flags lull advertises in its greeting.
pub const SERVER_HANDSHAKE_FLAGS: u16 = NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES;

/// Client flags lull understands; the spec says the server MUST drop a
/// client that sets any other bit (or one the server did not advertise).
const KNOWN_CLIENT_FLAGS: u32 = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;

// ---------------------------------------------------------------------------
// Transmission flags (16 bits, sent per export).

pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
pub const NBD_FLAG_BLOCK_STAT_PAYLOAD: u16 = 1 << 12;

// ---------------------------------------------------------------------------
// Option types.

pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_OPT_ABORT: u32 = 2;
pub const NBD_OPT_LIST: u32 = 3;
pub const NBD_OPT_PEEK_EXPORT: u32 = 4;
pub const NBD_OPT_STARTTLS: u32 = 5;
pub const NBD_OPT_INFO: u32 = 6;
pub const NBD_OPT_GO: u32 = 7;
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

// ---------------------------------------------------------------------------
// Option reply types. Errors have bit 31 set.

pub const NBD_REP_ACK: u32 = 1;
pub const NBD_REP_SERVER: u32 = 2;
pub const NBD_REP_INFO: u32 = 3;
pub const NBD_REP_META_CONTEXT: u32 = 4;
pub const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR | 4;
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR | 7;
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR | 8;
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;
pub const NBD_REP_ERR_EXT_HEADER_REQD: u32 = NBD_REP_FLAG_ERROR | 10;

// ---------------------------------------------------------------------------
// Information types (NBD_OPT_INFO / NBD_OPT_GO).

pub const NBD_INFO_EXPORT: u16 = 0;
pub const NBD_INFO_NAME: u16 = 1;
pub const NBD_INFO_DESCRIPTION: u16 = 2;
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------
// Command types and command flags.

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_CMD_TRIM: u16 = 4;
pub const NBD_CMD_CACHE: u16 = 5;
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;
pub const NBD_CMD_RESIZE: u16 = 8;

pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
pub const NBD_CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

// ---------------------------------------------------------------------------
// Structured replies (the encoders are in [`structured`]).

pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;
pub const NBD_REPLY_TYPE_NONE: u16 = 0;
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const NBD_REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
pub const NBD_REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

// ---------------------------------------------------------------------------
// Error values for the reply `error` field. The spec fixes these numbers;
// they match Linux errno values but are not errno values.

pub const NBD_SUCCESS: u32 = 0;
pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

/// Maps a host errno (positive, or negative as io_uring reports it) to the
/// NBD error to put in a reply.
///
/// The spec leaves errors it does not list to the server; nbdkit and qemu
/// answer `NBD_EINVAL` for those. lull answers `NBD_EIO`: requests are
/// validated at the edge (see [`validate`]) before they reach a device, so
/// an errno this table does not know came from the storage, not from the
/// request, and "I/O error" is what a block-device user should see (Linux's
/// nbd client turns every error into an I/O error anyway).
///
/// `EOPNOTSUPP` and `EOVERFLOW` become `NBD_EINVAL`: the spec says a server
/// SHOULD NOT send `NBD_ENOTSUP` or `NBD_EOVERFLOW` except for the
/// fast-zero and don't-fragment flags; the connection answers a refused
/// fast zero with `NBD_ENOTSUP` itself.
pub fn errno_to_nbd(errno: i32) -> u32 {
    match errno.saturating_abs() {
        0 => NBD_SUCCESS,
        libc::EPERM | libc::EACCES | libc::EROFS => NBD_EPERM,
        libc::EIO => NBD_EIO,
        libc::ENOMEM => NBD_ENOMEM,
        libc::EINVAL | libc::EOPNOTSUPP | libc::EOVERFLOW => NBD_EINVAL,
        // The spec asks servers to map EDQUOT and EFBIG to ENOSPC.
        libc::ENOSPC | libc::EDQUOT | libc::EFBIG => NBD_ENOSPC,
        libc::ESHUTDOWN => NBD_ESHUTDOWN,
        _ => NBD_EIO,
    }
}

// ---------------------------------------------------------------------------
// Message sizes.

/// Server greeting: NBDMAGIC, IHAVEOPT, 16-bit handshake flags.
pub const SERVER_GREETING_LEN: usize = 8 + 8 + 2;
/// Client flags, sent once after the greeting.
pub const CLIENT_FLAGS_LEN: usize = 4;
/// Option header: IHAVEOPT, option, payload length.
pub const OPTION_HEADER_LEN: usize = 8 + 4 + 4;
/// Option reply header: magic, option, reply type, payload length.
pub const OPTION_REPLY_HEADER_LEN: usize = 8 + 4 + 4 + 4;
/// Reply to `NBD_OPT_EXPORT_NAME` before the zero padding: size, flags.
pub const EXPORT_NAME_REPLY_LEN: usize = 8 + 2;
/// Zero padding after the `NBD_OPT_EXPORT_NAME` reply, left out when the
/// client set `NBD_FLAG_C_NO_ZEROES`.
pub const EXPORT_NAME_ZEROES_LEN: usize = 124;
/// Transmission request header: magic, flags, type, cookie, offset, length.
pub const REQUEST_LEN: usize = 28;
/// Simple reply header: magic, error, cookie.
pub const SIMPLE_REPLY_LEN: usize = 16;

// ---------------------------------------------------------------------------
// Limits.

/// Longest string the spec allows (export names, descriptions, error
/// messages): strings "MUST be no longer than 4096 bytes".
pub const MAX_STRING_LEN: usize = 4096;

/// Longest export name accepted, the spec's string limit.
pub const MAX_EXPORT_NAME_LEN: usize = MAX_STRING_LEN;

/// Most information requests in one `NBD_OPT_INFO`/`NBD_OPT_GO`. The spec
/// defines four information types and forbids repeating one, so 32 leaves
/// room for types added later while keeping the option a few KiB.
/// More gets `NBD_REP_ERR_TOO_BIG`.
pub const MAX_INFO_REQUESTS: u16 = 32;

/// Largest option payload accepted. Sized for the largest well-formed
/// option lull understands: `NBD_OPT_GO` with a maximal name and
/// [`MAX_INFO_REQUESTS`] requests (name length, name, count, requests).
/// Every option in use is far smaller; a longer one is treated as a denial
/// of service (which the spec allows) and ends the connection instead of
/// being buffered, as nbdkit does with its 4096-byte cap.
pub const MAX_OPTION_LEN: u32 =
    (4 + MAX_EXPORT_NAME_LEN + 2 + 2 * MAX_INFO_REQUESTS as usize) as u32;

/// Most bytes the caller of [`ServerHandshake::feed`] ever has to hold:
/// one option header and its payload.
pub const MAX_HANDSHAKE_MESSAGE_LEN: usize = OPTION_HEADER_LEN + MAX_OPTION_LEN as usize;

/// Options a client may send, the final `NBD_OPT_GO`/`NBD_OPT_EXPORT_NAME`
/// included, before it is disconnected. Real clients send under ten
/// (qemu: STRUCTURED_REPLY, SET_META_CONTEXT, GO); 32 is nbdkit's
/// `MAX_NR_OPTIONS`, and it stops a client from idling in negotiation.
pub const MAX_OPTIONS: u32 = 32;

/// Largest `NBD_CMD_READ`/`NBD_CMD_WRITE` length served, 64 MiB. The spec
/// tells interoperable clients to stay within 2^25 bytes (32 MiB) unless
/// told otherwise, but older clients that never negotiate block sizes send
/// more (nbd-tester-client's "integrityhuge" log has 40 MiB reads), and
/// nbdkit serves up to 64 MiB: so lull does too, and advertises it as the
/// maximum block size. It bounds the buffer one request can pin
/// (docs/LIMITS.md has what a connection can hold).
pub const MAX_PAYLOAD_BYTES: u32 = 64 * 1024 * 1024;

/// Largest write payload the server will read and discard to stay in sync
/// after refusing a `NBD_CMD_WRITE`. Draining costs bandwidth, not memory
/// (it goes through a scratch buffer), so a client that overshoots the
/// limit a little still gets an error reply; beyond twice the limit (the
/// bound nbdkit's `skip_over_write_buffer` uses) the connection is closed
/// rather than spending up to 4 GiB of reads on a misbehaving client.
pub const MAX_WRITE_DRAIN_BYTES: u32 = 2 * MAX_PAYLOAD_BYTES;

/// Advertised minimum block size: any byte offset and length is served.
pub const BLOCK_SIZE_MIN: u32 = 1;
/// Advertised preferred block size: the page size, below which the file
/// backend has to read-modify-write.
pub const BLOCK_SIZE_PREFERRED: u32 = 4096;
/// Advertised maximum block size, the READ/WRITE payload cap.
pub const BLOCK_SIZE_MAX: u32 = MAX_PAYLOAD_BYTES;

// ---------------------------------------------------------------------------
// Handshake.

/// What the server tells a client about one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub size_bytes: u64,
    /// `NBD_FLAG_*` transmission flags. The server fills these;
    /// `NBD_FLAG_HAS_FLAGS` is added by the codec if missing. Advertise
    /// only what the server does: [`validate`] accepts a command or flag
    /// exactly when these flags expose it.
    pub transmission_flags: u16,
    /// Shown to humans (`NBD_INFO_DESCRIPTION`); cut to
    /// [`MAX_STRING_LEN`] bytes on the wire.
    pub description: Option<String>,
}

/// The server's catalogue of exports, consulted during the handshake.
pub trait Exports {
    /// Names listed for `NBD_OPT_LIST`, in order.
    fn names(&self) -> Vec<String>;
    /// The export a client asked for. `""` is the default export; what it
    /// means (or whether there is one) is the server's choice.
    fn lookup(&self, name: &str) -> Option<ExportInfo>;
    /// The snapshots of `export` (one `lookup` found) that a
    /// `lull:changed:SNAPSHOT` context may name there, for
    /// `NBD_OPT_LIST_META_CONTEXT`; the codec lists at most
    /// [`structured::MAX_LISTED_CHANGED_CONTEXTS`] of them. Default: none.
    fn snapshot_names(&self, export: &str) -> Vec<String> {
        let _ = export;
        Vec::new()
    }
    /// Whether `export` has the snapshot `snapshot`, so that
    /// `lull:changed:SNAPSHOT` can be listed and selected for it.
    /// Default: no.
    fn has_snapshot(&self, export: &str, snapshot: &str) -> bool {
        let _ = (export, snapshot);
        false
    }
    /// Called when an `NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME` for `name` (an
    /// export `lookup` found) is about to succeed, before anything of the
    /// answer is sent: the server takes the export for this client here (a
    /// connection place, a device channel). `Err(reason)` refuses it: GO
    /// gets `NBD_REP_ERR_POLICY` with the reason and negotiation goes on;
    /// EXPORT_NAME, which has no error reply, ends the handshake
    /// ([`HandshakeError::Refused`]). Default: always admitted.
    fn admit(&self, name: &str) -> Result<(), String> {
        let _ = name;
        Ok(())
    }
}

/// Whether the server offers TLS, as qemu-nbd's and nbdkit's `--tls`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsPolicy {
    /// `NBD_OPT_STARTTLS` is unsupported.
    #[default]
    Off,
    /// Clients may upgrade; plain clients are served too.
    On,
    /// Every option but STARTTLS and ABORT is refused with
    /// `NBD_REP_ERR_TLS_REQD` until TLS is on, so no export name or size
    /// is told in plaintext; `NBD_OPT_EXPORT_NAME` (which cannot carry an
    /// error) ends the connection.
    Require,
}

/// Where the handshake stands after a [`ServerHandshake::feed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeStatus {
    /// Negotiation goes on: flush `out`, then feed more bytes.
    NeedMore,
    /// Negotiation finished: flush `out` (it holds the final reply), then
    /// serve `export_name` in the transmission phase. `info` is what the
    /// client was told.
    Done {
        export_name: String,
        info: ExportInfo,
    },
    /// The client sent `NBD_OPT_ABORT`. The ACK is queued in `out`; flush
    /// it (ignoring errors: the client may already be gone) and close.
    Aborted,
    /// The client sent `NBD_OPT_STARTTLS` and the ACK is queued in `out`:
    /// flush it in plaintext, run the TLS handshake on the same socket,
    /// call [`ServerHandshake::tls_started`] and feed what arrives through
    /// TLS. Bytes past the count were sent in plaintext after STARTTLS,
    /// before the ACK: a client must not do that, and honouring them
    /// would let an attacker inject options into the TLS session (nbdkit's
    /// CVE-2021-3716), so the caller refuses them and closes.
    StartTls,
}

/// A client broke the handshake in a way that ends the connection. Every
/// variant means: log it, flush `out` (it may hold replies to earlier
/// options in the same feed), and close.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum HandshakeError {
    #[error("client flags {flags:#x} set bits this server did not offer")]
    UnknownClientFlags { flags: u32 },
    #[error(
        "client flags {flags:#x} lack NBD_FLAG_C_FIXED_NEWSTYLE; only fixed newstyle is served"
    )]
    NotFixedNewstyle { flags: u32 },
    #[error("option magic {magic:#018x} is not IHAVEOPT")]
    BadOptionMagic { magic: u64 },
    #[error("option {option} carries {length_bytes} bytes, more than the {limit} accepted", limit = MAX_OPTION_LEN)]
    OptionTooLong { option: u32, length_bytes: u32 },
    #[error("client sent more than {limit} options", limit = MAX_OPTIONS)]
    TooManyOptions,
    /// `NBD_OPT_EXPORT_NAME` cannot carry an error reply, so a bad name
    /// ends the session.
    #[error("NBD_OPT_EXPORT_NAME carries an invalid name: {reason}")]
    InvalidExportName { reason: &'static str },
    /// The spec: the server MUST terminate the session when
    /// The server refused the export of an `NBD_OPT_EXPORT_NAME` (see
    /// [`Exports::admit`]); that option has no error reply, so it closes.
    #[error("NBD_OPT_EXPORT_NAME for {name:?} refused: {reason}")]
    Refused { name: String, reason: String },
    /// `NBD_OPT_EXPORT_NAME` names an export it does not have.
    #[error("NBD_OPT_EXPORT_NAME asked for unknown export {name:?}")]
    UnknownExport { name: String },
    /// TLS is required and the client chose an export with
    /// `NBD_OPT_EXPORT_NAME`, which cannot carry `NBD_REP_ERR_TLS_REQD`.
    #[error("TLS is required and the client sent NBD_OPT_EXPORT_NAME without it")]
    TlsRequired,
    /// `feed` was called after the handshake ended, or between `StartTls`
    /// and `tls_started` (a bug in the caller).
    #[error("the handshake has already finished")]
    Finished,
}

impl HandshakeError {
    /// The errno that best describes the error, for logs and counters.
    pub fn errno(&self) -> i32 {
        match self {
            HandshakeError::OptionTooLong { .. } => libc::EMSGSIZE,
            HandshakeError::UnknownExport { .. } => libc::ENOENT,
            HandshakeError::Refused { .. } => libc::EBUSY,
            HandshakeError::Finished => libc::EINVAL,
            HandshakeError::UnknownClientFlags { .. }
            | HandshakeError::NotFixedNewstyle { .. }
            | HandshakeError::BadOptionMagic { .. }
            | HandshakeError::TooManyOptions
            | HandshakeError::InvalidExportName { .. } => libc::EPROTO,
            HandshakeError::TlsRequired => libc::EACCES,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    ClientFlags,
    Options,
    /// STARTTLS was acknowledged; the caller runs the TLS handshake.
    AwaitingTls,
    Finished,
}

/// The server side of the fixed newstyle handshake, as a state machine:
/// bytes from the client in, replies for the client out.
#[derive(Debug)]
pub struct ServerHandshake {
    phase: Phase,
    /// The client set `NBD_FLAG_C_NO_ZEROES`.
    no_zeroes: bool,
    /// Options consumed so far, the final one included.
    options_seen: u32,
    /// The client sent `NBD_OPT_STRUCTURED_REPLY` (and was acknowledged).
    structured: bool,
    /// What the last `NBD_OPT_SET_META_CONTEXT` selected, and for which
    /// export; `None` when the selection is empty.
    selection: Option<MetaSelection>,
    /// The export chosen at the end is the one `selection` was made for.
    selection_holds: bool,
    tls: TlsPolicy,
    /// The TLS session is up (STARTTLS was acknowledged and the caller
    /// said the handshake finished).
    tls_active: bool,
}

/// The metadata contexts an `NBD_OPT_SET_META_CONTEXT` selected.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MetaSelection {
    /// The export they were selected for.
    export: String,
    base_allocation: bool,
    /// The snapshot of the selected `lull:changed:` context.
    changed: Option<String>,
}

/// What a finished handshake agreed to besides the export.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Negotiated {
    /// Replies use structured chunks for reads and block status.
    pub structured_replies: bool,
    /// `base:allocation` was selected for the chosen export: block status
    /// requests are served with context id
    /// [`structured::BASE_ALLOCATION_ID`].
    pub base_allocation: bool,
    /// The `lull:changed:SNAPSHOT` context selected for the chosen export,
    /// if any: block status replies carry a chunk for it too. One per
    /// connection: a SET naming several selects the first the export has
    /// (the others are not selected, so the client sees which one holds
    /// from the replies); a client wanting two comparisons opens two
    /// connections.
    pub changed: Option<ChangedContext>,
}

/// A selected `lull:changed:SNAPSHOT` context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangedContext {
    /// The snapshot the export is compared with.
    pub snapshot: String,
    /// The context id its block status chunks carry
    /// ([`structured::LULL_CHANGED_ID`]).
    pub id: u32,
}

impl ChangedContext {
    /// The context's name, `lull:changed:SNAPSHOT`.
    pub fn name(&self) -> String {
        format!("{}{}", structured::LULL_CHANGED_PREFIX, self.snapshot)
    }
}

/// What one whole option did to the negotiation.
enum Step {
    /// Not enough bytes for the next message.
    NeedMore,
    /// A message of this many bytes was handled; negotiation goes on.
    Continue(usize),
    /// A message of this many bytes ended the negotiation.
    Finish(usize, HandshakeStatus),
}

impl ServerHandshake {
    /// New handshake; appends the server greeting (NBDMAGIC, IHAVEOPT,
    /// `NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES`) to `out`.
    pub fn new(out: &mut Vec<u8>) -> Self {
        ServerHandshake::with_tls(out, TlsPolicy::Off)
    }

    /// [`ServerHandshake::new`] for a server whose TLS policy is `tls`.
    pub fn with_tls(out: &mut Vec<u8>, tls: TlsPolicy) -> Self {
        out.extend_from_slice(&NBDMAGIC.to_be_bytes());
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&SERVER_HANDSHAKE_FLAGS.to_be_bytes());
        ServerHandshake {
            phase: Phase::ClientFlags,
            no_zeroes: false,
            options_seen: 0,
            structured: false,
            selection: None,
            selection_holds: false,
            tls,
            tls_active: false,
        }
    }

    /// The TLS handshake after [`HandshakeStatus::StartTls`] succeeded:
    /// negotiation goes on inside TLS. What was negotiated in plaintext
    /// (structured replies, metadata contexts) is forgotten, as the spec
    /// asks, so nothing said before TLS shapes the session.
    pub fn tls_started(&mut self) {
        debug_assert_eq!(
            self.phase,
            Phase::AwaitingTls,
            "tls_started without STARTTLS"
        );
        if self.phase == Phase::AwaitingTls {
            self.phase = Phase::Options;
            self.tls_active = true;
            self.structured = false;
            self.selection = None;
            self.selection_holds = false;
        }
    }

    /// Whether option haggling runs inside TLS.
    pub fn tls_active(&self) -> bool {
        self.tls_active
    }

    /// What the client negotiated; meaningful once `feed` returned `Done`.
    pub fn negotiated(&self) -> Negotiated {
        let selection = self
            .selection
            .as_ref()
            .filter(|_| self.structured && self.selection_holds);
        Negotiated {
            structured_replies: self.structured,
            base_allocation: selection.is_some_and(|s| s.base_allocation),
            changed: selection
                .and_then(|s| s.changed.clone())
                .map(|snapshot| ChangedContext {
                    snapshot,
                    id: structured::LULL_CHANGED_ID,
                }),
        }
    }

    /// Records the export the negotiation ended with: its metadata
    /// contexts hold only if they were selected for that export.
    fn finish_with(&mut self, status: &HandshakeStatus) {
        if let HandshakeStatus::Done { export_name, .. } = status {
            self.selection_holds = self
                .selection
                .as_ref()
                .is_some_and(|s| s.export == *export_name);
        }
    }

    /// Feeds bytes received from the client.
    ///
    /// Handles every complete message at the front of `input`, appends the
    /// replies to `out`, and returns how many bytes it consumed with the
    /// resulting status. Bytes past that count are an incomplete message:
    /// keep them and pass them again, followed by whatever arrives next.
    /// The caller never needs to hold more than
    /// [`MAX_HANDSHAKE_MESSAGE_LEN`] such bytes. After `Done`, the bytes
    /// past the count already belong to the transmission phase.
    ///
    /// On `Err`, `out` keeps the replies to options handled before the bad
    /// one; flush them and close. Feeding after `Done`, `Aborted` or an
    /// error returns [`HandshakeError::Finished`].
    pub fn feed(
        &mut self,
        input: &[u8],
        exports: &dyn Exports,
        out: &mut Vec<u8>,
    ) -> Result<(usize, HandshakeStatus), HandshakeError> {
        let result = self.feed_inner(input, exports, out);
        match result {
            Ok((_, HandshakeStatus::NeedMore)) => {}
            Ok((_, HandshakeStatus::StartTls)) => self.phase = Phase::AwaitingTls,
            Ok(_) | Err(_) => self.phase = Phase::Finished,
        }
        #[cfg(debug_assertions)]
        self.check_invariants();
        result
    }

    /// Asserts the handshake's internal consistency.
    pub fn check_invariants(&self) {
        assert!(
            self.options_seen <= MAX_OPTIONS,
            "{} options accepted",
            self.options_seen
        );
        if self.phase == Phase::ClientFlags {
            assert_eq!(
                self.options_seen, 0,
                "options handled before the client flags"
            );
            assert!(!self.no_zeroes, "NO_ZEROES set before the client flags");
        }
        if let Some(selection) = &self.selection {
            assert!(
                self.structured,
                "a metadata context without structured replies"
            );
            assert!(
                selection.base_allocation || selection.changed.is_some(),
                "an empty selection kept"
            );
            if let Some(snapshot) = &selection.changed {
                assert!(
                    structured::changed_context_name(snapshot).is_some(),
                    "selected a changed context no client could name: {snapshot:?}"
                );
            }
        } else {
            assert!(!self.selection_holds, "no selection holds");
        }
        if self.tls_active {
            assert_ne!(self.tls, TlsPolicy::Off, "TLS on without a policy");
        }
    }

    fn feed_inner(
        &mut self,
        input: &[u8],
        exports: &dyn Exports,
        out: &mut Vec<u8>,
    ) -> Result<(usize, HandshakeStatus), HandshakeError> {
        let mut consumed = 0;
        loop {
            let rest = input.get(consumed..).unwrap_or_default();
            match self.phase {
                Phase::ClientFlags => {
                    let Some(flags) = Reader::new(rest).u32() else {
                        return Ok((consumed, HandshakeStatus::NeedMore));
                    };
                    self.accept_client_flags(flags)?;
                    consumed += CLIENT_FLAGS_LEN;
                }
                Phase::Options => match self.step_option(rest, exports, out)? {
                    Step::NeedMore => return Ok((consumed, HandshakeStatus::NeedMore)),
                    Step::Continue(used) => consumed += used,
                    Step::Finish(used, status) => return Ok((consumed + used, status)),
                },
                Phase::AwaitingTls | Phase::Finished => return Err(HandshakeError::Finished),
            }
        }
    }

    fn accept_client_flags(&mut self, flags: u32) -> Result<(), HandshakeError> {
        if flags & !KNOWN_CLIENT_FLAGS != 0 {
            return Err(HandshakeError::UnknownClientFlags { flags });
        }
        if flags & NBD_FLAG_C_FIXED_NEWSTYLE == 0 {
            return Err(HandshakeError::NotFixedNewstyle { flags });
        }
        self.no_zeroes = flags & NBD_FLAG_C_NO_ZEROES != 0;
        self.phase = Phase::Options;
        Ok(())
    }

    /// Handles the option at the front of `rest` if it is complete. Header
    /// errors are reported as soon as the bytes that show them arrive, so
    /// an over-long option is refused before any of its payload is held.
    /// Nothing changes until the whole option is present, so the same
    /// bytes can be offered again after `NeedMore`.
    fn step_option(
        &mut self,
        rest: &[u8],
        exports: &dyn Exports,
        out: &mut Vec<u8>,
    ) -> Result<Step, HandshakeError> {
        let mut header = Reader::new(rest);
        let Some(magic) = header.u64() else {
            return Ok(Step::NeedMore);
        };
        if magic != IHAVEOPT {
            return Err(HandshakeError::BadOptionMagic { magic });
        }
        let (Some(option), Some(length_bytes)) = (header.u32(), header.u32()) else {
            return Ok(Step::NeedMore);
        };
        if self.options_seen >= MAX_OPTIONS {
            return Err(HandshakeError::TooManyOptions);
        }
        if length_bytes > MAX_OPTION_LEN {
            return Err(HandshakeError::OptionTooLong {
                option,
                length_bytes,
            });
        }
        // Cannot truncate: length_bytes <= MAX_OPTION_LEN.
        let Some(payload) = header.bytes(length_bytes as usize) else {
            return Ok(Step::NeedMore);
        };
        let used = OPTION_HEADER_LEN + payload.len();
        let status = self.handle_option(option, payload, exports, out)?;
        self.options_seen += 1;
        if let Some(status) = &status {
            self.finish_with(status);
        }
        Ok(match status {
            None => Step::Continue(used),
            Some(status) => Step::Finish(used, status),
        })
    }

    /// Answers one complete option. `Some` ends the negotiation.
    fn handle_option(
        &mut self,
        option: u32,
        payload: &[u8],
        exports: &dyn Exports,
        out: &mut Vec<u8>,
    ) -> Result<Option<HandshakeStatus>, HandshakeError> {
        if self.tls == TlsPolicy::Require
            && !self.tls_active
            && option != NBD_OPT_STARTTLS
            && option != NBD_OPT_ABORT
        {
            if option == NBD_OPT_EXPORT_NAME {
                return Err(HandshakeError::TlsRequired);
            }
            put_reply(
                out,
                option,
                NBD_REP_ERR_TLS_REQD,
                &[b"TLS is required: send NBD_OPT_STARTTLS first"],
            );
            return Ok(None);
        }
        match option {
            NBD_OPT_STARTTLS => {
                let refusal: Option<(u32, &[u8])> = match (self.tls, self.tls_active) {
                    (TlsPolicy::Off, _) => Some((NBD_REP_ERR_UNSUP, b"TLS is not configured")),
                    (_, true) => Some((NBD_REP_ERR_INVALID, b"TLS is already on")),
                    _ if !payload.is_empty() => {
                        Some((NBD_REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data"))
                    }
                    _ => None,
                };
                Ok(match refusal {
                    Some((error, message)) => {
                        put_reply(out, option, error, &[message]);
                        None
                    }
                    None => {
                        put_reply(out, option, NBD_REP_ACK, &[]);
                        Some(HandshakeStatus::StartTls)
                    }
                })
            }
            NBD_OPT_EXPORT_NAME => self.export_name(payload, exports, out).map(Some),
            NBD_OPT_ABORT => {
                // The spec: the server SHOULD ignore any data sent with ABORT.
                put_reply(out, option, NBD_REP_ACK, &[]);
                Ok(Some(HandshakeStatus::Aborted))
            }
            NBD_OPT_LIST => {
                if payload.is_empty() {
                    list(exports, out);
                } else {
                    put_reply(
                        out,
                        option,
                        NBD_REP_ERR_INVALID,
                        &[b"NBD_OPT_LIST takes no data"],
                    );
                }
                Ok(None)
            }
            NBD_OPT_INFO | NBD_OPT_GO => Ok(info_or_go(option, payload, exports, out)),
            NBD_OPT_STRUCTURED_REPLY => {
                if payload.is_empty() {
                    self.structured = true;
                    put_reply(out, option, NBD_REP_ACK, &[]);
                } else {
                    put_reply(
                        out,
                        option,
                        NBD_REP_ERR_INVALID,
                        &[b"NBD_OPT_STRUCTURED_REPLY takes no data"],
                    );
                }
                Ok(None)
            }
            NBD_OPT_LIST_META_CONTEXT | NBD_OPT_SET_META_CONTEXT => {
                self.meta_context(option, payload, exports, out);
                Ok(None)
            }
            // Everything else, EXTENDED_HEADERS included, is
            // unsupported; the length told us where the next option starts.
            _ => {
                put_reply(
                    out,
                    option,
                    NBD_REP_ERR_UNSUP,
                    &[b"option not supported by lull"],
                );
                Ok(None)
            }
        }
    }

    /// Answers `NBD_OPT_LIST_META_CONTEXT` or `NBD_OPT_SET_META_CONTEXT`:
    /// one `NBD_REP_META_CONTEXT` per context listed or selected, then
    /// ACK. The contexts are `base:allocation` and `lull:changed:SNAPSHOT`
    /// for each snapshot of the export (see [`structured::LULL_NAMESPACE`]
    /// for the queries). SET replaces the selection, even when it fails.
    fn meta_context(
        &mut self,
        option: u32,
        payload: &[u8],
        exports: &dyn Exports,
        out: &mut Vec<u8>,
    ) {
        let setting = option == NBD_OPT_SET_META_CONTEXT;
        if setting {
            self.selection = None;
            if !self.structured {
                // The spec: SET before structured replies is invalid.
                put_reply(
                    out,
                    option,
                    NBD_REP_ERR_INVALID,
                    &[b"negotiate NBD_OPT_STRUCTURED_REPLY first"],
                );
                return;
            }
        }
        let request = match structured::parse_meta_request(payload) {
            Ok(request) => request,
            Err((reply_type, message)) => {
                put_reply(out, option, reply_type, &[message.as_bytes()]);
                return;
            }
        };
        if exports.lookup(request.export).is_none() {
            put_reply(out, option, NBD_REP_ERR_UNKNOWN, &[b"unknown export"]);
            return;
        }
        // At most MAX_META_QUERIES, checked by the parser.
        let mut queries = Vec::with_capacity(request.queries.len());
        for query in &request.queries {
            match structured::parse_query(query) {
                Ok(query) => queries.push(query),
                Err(message) => {
                    put_reply(out, option, NBD_REP_ERR_INVALID, &[message.as_bytes()]);
                    return;
                }
            }
        }
        if setting {
            self.selection = select_meta_contexts(request.export, &queries, exports, out);
        } else {
            list_meta_contexts(request.export, &queries, exports, out);
        }
        put_reply(out, option, NBD_REP_ACK, &[]);
    }

    fn export_name(
        &self,
        payload: &[u8],
        exports: &dyn Exports,
        out: &mut Vec<u8>,
    ) -> Result<HandshakeStatus, HandshakeError> {
        let name = parse_export_name(payload)
            .map_err(|reason| HandshakeError::InvalidExportName { reason })?;
        let mut info = exports
            .lookup(name)
            .ok_or_else(|| HandshakeError::UnknownExport {
                name: name.to_owned(),
            })?;
        exports
            .admit(name)
            .map_err(|reason| HandshakeError::Refused {
                name: name.to_owned(),
                reason,
            })?;
        info.transmission_flags |= NBD_FLAG_HAS_FLAGS;
        out.extend_from_slice(&info.size_bytes.to_be_bytes());
        out.extend_from_slice(&info.transmission_flags.to_be_bytes());
        if !self.no_zeroes {
            out.extend_from_slice(&[0; EXPORT_NAME_ZEROES_LEN]);
        }
        Ok(HandshakeStatus::Done {
            export_name: name.to_owned(),
            info,
        })
    }
}

/// Which optional information items a client asked for.
#[derive(Debug, Default)]
struct InfoWanted {
    name: bool,
    description: bool,
}

/// A parsed `NBD_OPT_INFO`/`NBD_OPT_GO` payload.
struct InfoRequest<'a> {
    name: &'a str,
    wanted: InfoWanted,
}

/// Parses an INFO/GO payload: name length, name, request count, requests.
/// On failure gives the error reply type and a message for the client.
fn parse_info_request(payload: &[u8]) -> Result<InfoRequest<'_>, (u32, &'static str)> {
    const INVALID: u32 = NBD_REP_ERR_INVALID;
    let mut reader = Reader::new(payload);
    let name_len = reader
        .u32()
        .ok_or((INVALID, "option shorter than 6 bytes"))?;
    let name_bytes = usize::try_from(name_len)
        .ok()
        .and_then(|len| reader.bytes(len))
        .ok_or((INVALID, "name length overruns the option"))?;
    let count = reader
        .u16()
        .ok_or((INVALID, "name length overruns the option"))?;
    let requests = reader.rest();
    if requests.len() != 2 * usize::from(count) {
        return Err((
            INVALID,
            "information request count does not match the option length",
        ));
    }
    if count > MAX_INFO_REQUESTS {
        return Err((NBD_REP_ERR_TOO_BIG, "too many information requests"));
    }
    let name = parse_export_name(name_bytes).map_err(|reason| (INVALID, reason))?;
    let mut wanted = InfoWanted::default();
    for request in requests.chunks_exact(2) {
        let &[high, low] = request else { continue };
        match u16::from_be_bytes([high, low]) {
            NBD_INFO_NAME => wanted.name = true,
            NBD_INFO_DESCRIPTION => wanted.description = true,
            // EXPORT and BLOCK_SIZE are always sent; the spec says to
            // ignore requests the server does not understand.
            _ => {}
        }
    }
    Ok(InfoRequest { name, wanted })
}

/// Answers `NBD_OPT_INFO` or `NBD_OPT_GO`; `Some` when a GO succeeded.
fn info_or_go(
    option: u32,
    payload: &[u8],
    exports: &dyn Exports,
    out: &mut Vec<u8>,
) -> Option<HandshakeStatus> {
    let request = match parse_info_request(payload) {
        Ok(request) => request,
        Err((reply_type, message)) => {
            put_reply(out, option, reply_type, &[message.as_bytes()]);
            return None;
        }
    };
    let Some(mut info) = exports.lookup(request.name) else {
        put_reply(out, option, NBD_REP_ERR_UNKNOWN, &[b"unknown export"]);
        return None;
    };
    if option == NBD_OPT_GO {
        if let Err(reason) = exports.admit(request.name) {
            let reason = truncate_str(&reason, MAX_STRING_LEN);
            put_reply(out, option, NBD_REP_ERR_POLICY, &[reason.as_bytes()]);
            return None;
        }
    }
    info.transmission_flags |= NBD_FLAG_HAS_FLAGS;

    // NBD_INFO_EXPORT is mandatory before an ACK.
    put_reply(
        out,
        option,
        NBD_REP_INFO,
        &[
            &NBD_INFO_EXPORT.to_be_bytes(),
            &info.size_bytes.to_be_bytes(),
            &info.transmission_flags.to_be_bytes(),
        ],
    );
    // Sent whether asked for or not: the spec lets a server send unrequested
    // information, clients ignore what they do not understand, and the
    // 64 MiB maximum differs from the default "unlimited", so a client
    // that does understand it should learn it even from NBD_OPT_INFO.
    put_reply(
        out,
        option,
        NBD_REP_INFO,
        &[
            &NBD_INFO_BLOCK_SIZE.to_be_bytes(),
            &BLOCK_SIZE_MIN.to_be_bytes(),
            &BLOCK_SIZE_PREFERRED.to_be_bytes(),
            &BLOCK_SIZE_MAX.to_be_bytes(),
        ],
    );
    if request.wanted.name {
        // lull has no canonical names apart from what the client typed.
        let info_type = NBD_INFO_NAME.to_be_bytes();
        put_reply(
            out,
            option,
            NBD_REP_INFO,
            &[&info_type, request.name.as_bytes()],
        );
    }
    if let (true, Some(description)) = (request.wanted.description, &info.description) {
        let info_type = NBD_INFO_DESCRIPTION.to_be_bytes();
        let text = truncate_str(description, MAX_STRING_LEN);
        put_reply(out, option, NBD_REP_INFO, &[&info_type, text.as_bytes()]);
    }
    put_reply(out, option, NBD_REP_ACK, &[]);

    (option == NBD_OPT_GO).then(|| HandshakeStatus::Done {
        export_name: request.name.to_owned(),
        info,
    })
}

/// The `NBD_REP_META_CONTEXT` replies of an `NBD_OPT_LIST_META_CONTEXT`
/// for `export`: with no query, every context; else those the queries
/// match. The id is 0, as the spec asks of LIST (it is reserved there).
fn list_meta_contexts(
    export: &str,
    queries: &[structured::Query<'_>],
    exports: &dyn Exports,
    out: &mut Vec<u8>,
) {
    use structured::Query;
    let option = NBD_OPT_LIST_META_CONTEXT;
    let everything = queries.is_empty();
    let any = |wanted: &dyn Fn(&Query<'_>) -> bool| everything || queries.iter().any(wanted);
    if any(&|q| matches!(q, Query::BaseAll | Query::BaseAllocation)) {
        put_meta_context(out, option, 0, structured::BASE_ALLOCATION);
    }
    // Names already listed, so an exact query after a wildcard does not
    // list a context twice (at most MAX_LISTED_CHANGED_CONTEXTS plus
    // MAX_META_QUERIES entries).
    let mut listed: Vec<String> = Vec::new();
    if any(&|q| matches!(q, Query::ChangedAll)) {
        let names = exports.snapshot_names(export);
        let contexts = names
            .iter()
            .filter_map(|snapshot| structured::changed_context_name(snapshot))
            .take(structured::MAX_LISTED_CHANGED_CONTEXTS);
        for name in contexts {
            put_meta_context(out, option, 0, &name);
            listed.push(name);
        }
    }
    for query in queries {
        let Query::Changed(snapshot) = query else {
            continue;
        };
        let Some(name) = structured::changed_context_name(snapshot) else {
            continue;
        };
        if !listed.contains(&name) && exports.has_snapshot(export, snapshot) {
            put_meta_context(out, option, 0, &name);
            listed.push(name);
        }
    }
}

/// The `NBD_REP_META_CONTEXT` replies of an `NBD_OPT_SET_META_CONTEXT`
/// for `export`, each with its own id, and the selection they make:
/// `base:allocation` if named, and the first `lull:changed:SNAPSHOT`
/// whose snapshot the export has (one per connection, see
/// [`Negotiated::changed`]). Wildcards and unknown contexts select
/// nothing, as the spec says. `None` when nothing was selected.
fn select_meta_contexts(
    export: &str,
    queries: &[structured::Query<'_>],
    exports: &dyn Exports,
    out: &mut Vec<u8>,
) -> Option<MetaSelection> {
    use structured::Query;
    let option = NBD_OPT_SET_META_CONTEXT;
    let base_allocation = queries.contains(&Query::BaseAllocation);
    let changed = queries.iter().find_map(|query| match query {
        Query::Changed(snapshot)
            if structured::changed_context_name(snapshot).is_some()
                && exports.has_snapshot(export, snapshot) =>
        {
            Some((*snapshot).to_owned())
        }
        _ => None,
    });
    if base_allocation {
        put_meta_context(
            out,
            option,
            structured::BASE_ALLOCATION_ID,
            structured::BASE_ALLOCATION,
        );
    }
    if let Some(snapshot) = &changed {
        let context = ChangedContext {
            snapshot: snapshot.clone(),
            id: structured::LULL_CHANGED_ID,
        };
        put_meta_context(out, option, context.id, &context.name());
    }
    (base_allocation || changed.is_some()).then(|| MetaSelection {
        export: export.to_owned(),
        base_allocation,
        changed,
    })
}

/// One `NBD_REP_META_CONTEXT`: a context id and name.
fn put_meta_context(out: &mut Vec<u8>, option: u32, id: u32, name: &str) {
    debug_assert!(
        name.len() <= MAX_STRING_LEN,
        "context name of {} bytes",
        name.len()
    );
    put_reply(
        out,
        option,
        NBD_REP_META_CONTEXT,
        &[&id.to_be_bytes(), name.as_bytes()],
    );
}

/// Answers `NBD_OPT_LIST`: one `NBD_REP_SERVER` per export, then ACK.
fn list(exports: &dyn Exports, out: &mut Vec<u8>) {
    for name in exports.names() {
        // A name a client could not send back is not worth listing.
        if parse_export_name(name.as_bytes()).is_err() {
            debug_assert!(false, "export name {name:?} breaks the NBD string rules");
            continue;
        }
        let name_len = wire_len(name.len()).to_be_bytes();
        put_reply(
            out,
            NBD_OPT_LIST,
            NBD_REP_SERVER,
            &[&name_len, name.as_bytes()],
        );
    }
    put_reply(out, NBD_OPT_LIST, NBD_REP_ACK, &[]);
}

/// Checks an export name against the spec's string rules.
fn parse_export_name(bytes: &[u8]) -> Result<&str, &'static str> {
    if bytes.len() > MAX_EXPORT_NAME_LEN {
        return Err("export name longer than 4096 bytes");
    }
    if bytes.contains(&0) {
        return Err("export name contains NUL");
    }
    std::str::from_utf8(bytes).map_err(|_| "export name is not UTF-8")
}

/// Appends one option reply whose payload is the concatenation of `parts`.
fn put_reply(out: &mut Vec<u8>, option: u32, reply_type: u32, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|part| part.len()).sum();
    out.extend_from_slice(&NBD_REP_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&wire_len(len).to_be_bytes());
    for part in parts {
        out.extend_from_slice(part);
    }
}

/// A reply payload length. Every payload this module builds is a string cut
/// to [`MAX_STRING_LEN`] plus a few fixed fields.
fn wire_len(len: usize) -> u32 {
    debug_assert!(len <= MAX_STRING_LEN + 16, "reply payload of {len} bytes");
    len as u32
}

/// The longest prefix of `text` that fits in `max_bytes` and ends on a
/// character boundary.
fn truncate_str(text: &str, max_bytes: usize) -> &str {
    let mut end = text.len().min(max_bytes);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}

/// Reads big-endian fields from the front of a slice; `None` when the
/// slice is too short, so untrusted lengths can never index out of range.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    fn bytes(&mut self, len: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.buf.split_at_checked(len)?;
        self.buf = tail;
        Some(head)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes(N)?.try_into().ok()
    }

    fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_be_bytes)
    }

    fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_be_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_be_bytes)
    }

    fn rest(self) -> &'a [u8] {
        self.buf
    }
}

// ---------------------------------------------------------------------------
// Transmission.

/// A transmission command type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    WriteZeroes,
    Cache,
    BlockStatus,
    /// Any other type. Never holds a value listed above.
    Unknown(u16),
}

impl Command {
    pub fn from_wire(value: u16) -> Self {
        match value {
            NBD_CMD_READ => Command::Read,
            NBD_CMD_WRITE => Command::Write,
            NBD_CMD_DISC => Command::Disc,
            NBD_CMD_FLUSH => Command::Flush,
            NBD_CMD_TRIM => Command::Trim,
            NBD_CMD_WRITE_ZEROES => Command::WriteZeroes,
            NBD_CMD_CACHE => Command::Cache,
            NBD_CMD_BLOCK_STATUS => Command::BlockStatus,
            other => Command::Unknown(other),
        }
    }

    pub fn to_wire(self) -> u16 {
        match self {
            Command::Read => NBD_CMD_READ,
            Command::Write => NBD_CMD_WRITE,
            Command::Disc => NBD_CMD_DISC,
            Command::Flush => NBD_CMD_FLUSH,
            Command::Trim => NBD_CMD_TRIM,
            Command::WriteZeroes => NBD_CMD_WRITE_ZEROES,
            Command::Cache => NBD_CMD_CACHE,
            Command::BlockStatus => NBD_CMD_BLOCK_STATUS,
            Command::Unknown(other) => other,
        }
    }

    /// Commands that change the export, refused on read-only exports.
    fn modifies(self) -> bool {
        matches!(self, Command::Write | Command::Trim | Command::WriteZeroes)
    }
}

/// A decoded request header. For `Write`, `length` bytes of payload follow
/// it on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// `NBD_CMD_FLAG_*` bits, unchecked; see [`validate`].
    pub flags: u16,
    pub command: Command,
    /// Opaque to the server; echoed in the reply (the spec's "handle").
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

/// A request header that cannot be parsed: the stream is out of sync, so
/// the connection must close.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RequestError {
    #[error("request magic {magic:#010x} is not NBD_REQUEST_MAGIC")]
    BadMagic { magic: u32 },
}

impl RequestError {
    /// The errno that best describes the error, for logs and counters.
    pub fn errno(&self) -> i32 {
        match self {
            RequestError::BadMagic { .. } => libc::EPROTO,
        }
    }
}

const _: () = assert!(4 + 2 + 2 + 8 + 8 + 4 == REQUEST_LEN);
const _: () = assert!(4 + 4 + 8 == SIMPLE_REPLY_LEN);

/// Decodes a request header. A bad magic is an error: the caller closes.
/// Everything else is decoded as sent; [`validate`] judges it.
pub fn decode_request(buf: &[u8; REQUEST_LEN]) -> Result<Request, RequestError> {
    let mut bytes = buf.iter().copied();
    let magic = u32::from_be_bytes(take(&mut bytes));
    if magic != NBD_REQUEST_MAGIC {
        return Err(RequestError::BadMagic { magic });
    }
    Ok(Request {
        flags: u16::from_be_bytes(take(&mut bytes)),
        command: Command::from_wire(u16::from_be_bytes(take(&mut bytes))),
        cookie: u64::from_be_bytes(take(&mut bytes)),
        offset: u64::from_be_bytes(take(&mut bytes)),
        length: u32::from_be_bytes(take(&mut bytes)),
    })
}

/// Encodes a request header (the client side; used by tests, the
/// simulator and benchmarks).
pub fn encode_request(request: &Request) -> [u8; REQUEST_LEN] {
    let mut buf = [0; REQUEST_LEN];
    let bytes = NBD_REQUEST_MAGIC
        .to_be_bytes()
        .into_iter()
        .chain(request.flags.to_be_bytes())
        .chain(request.command.to_wire().to_be_bytes())
        .chain(request.cookie.to_be_bytes())
        .chain(request.offset.to_be_bytes())
        .chain(request.length.to_be_bytes());
    for (slot, byte) in buf.iter_mut().zip(bytes) {
        *slot = byte;
    }
    buf
}

/// Encodes a simple reply header. For a successful `Read`, the data
/// follows it; for anything else, nothing does.
pub fn encode_simple_reply(out: &mut [u8; SIMPLE_REPLY_LEN], error_nbd: u32, cookie: u64) {
    let bytes = NBD_SIMPLE_REPLY_MAGIC
        .to_be_bytes()
        .into_iter()
        .chain(error_nbd.to_be_bytes())
        .chain(cookie.to_be_bytes());
    for (slot, byte) in out.iter_mut().zip(bytes) {
        *slot = byte;
    }
}

/// Decodes a simple reply header into `(error, cookie)` (the client side).
/// `None` when the magic is wrong.
pub fn decode_simple_reply(buf: &[u8; SIMPLE_REPLY_LEN]) -> Option<(u32, u64)> {
    let mut bytes = buf.iter().copied();
    let magic = u32::from_be_bytes(take(&mut bytes));
    let error = u32::from_be_bytes(take(&mut bytes));
    let cookie = u64::from_be_bytes(take(&mut bytes));
    (magic == NBD_SIMPLE_REPLY_MAGIC).then_some((error, cookie))
}

/// The next `N` bytes of a fixed-size header. The const asserts above tie
/// each header's fields to its length, so the fallback zero never shows.
fn take<const N: usize>(bytes: &mut impl Iterator<Item = u8>) -> [u8; N] {
    std::array::from_fn(|_| bytes.next().unwrap_or(0))
}

/// What to do with a request, judged against the export it is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Verdict {
    /// Perform it. For `Write`, read `length` payload bytes first; for
    /// `Disc`, finish the requests in flight and close without a reply.
    Ok,
    /// Read and discard `drain_bytes` of write payload (0 unless the
    /// command is `Write`; never more than [`MAX_WRITE_DRAIN_BYTES`]), then
    /// send a reply with `nbd_error` and no data.
    Error { nbd_error: u32, drain_bytes: u32 },
    /// The stream cannot be resynchronised: close the connection.
    Disconnect(&'static str),
}

/// Judges a decoded request against the export size and the transmission
/// flags the client was given. Pure: no state, no I/O.
///
/// Rules, in the order they are checked (the first that fails decides):
/// 1. Unknown command: `NBD_EINVAL`, as the spec says.
/// 2. `Disc`: always `Ok`; there is no reply to send an error in, and the
///    connection ends either way.
/// 3. A flag that is unknown or not applicable to the command:
///    `NBD_EINVAL`. FUA is accepted on every command when `SEND_FUA` was
///    advertised (the spec says the server MUST then accept it, even by
///    ignoring it); `NO_HOLE` and `FAST_ZERO` only on `WriteZeroes`, `DF`
///    only on `Read`, each only if the flag exposing it was advertised;
///    `REQ_ONE` only on `BlockStatus`.
/// 4. `Write`, `Trim` or `WriteZeroes` on a read-only export: `NBD_EPERM`,
///    as the spec asks, even though a read-only export does not advertise
///    trim or write zeroes (nbdkit orders its checks the same way): the
///    client learns the export is read-only, not that it sent nonsense.
/// 5. `Flush`, `Trim`, `WriteZeroes` or `Cache` not advertised:
///    `NBD_EINVAL`. (`BlockStatus` needs a negotiated metadata context,
///    which the connection checks.)
/// 6. `Flush` with a nonzero offset or length (reserved, MUST be zero):
///    `NBD_EINVAL`.
/// 7. `Read`/`Write` longer than [`MAX_PAYLOAD_BYTES`], the advertised
///    maximum block size: `NBD_EINVAL`. `Trim`, `WriteZeroes`, `Cache` and
///    `BlockStatus` carry no payload, so any length inside the export is
///    accepted.
/// 8. Zero length: `NBD_EINVAL`. The spec leaves the behaviour to the
///    server but says not to disconnect; nbdkit refuses it the same way,
///    and refusing here keeps zero-length I/O away from the devices.
/// 9. Past the end of the export (`offset + length` overflowing u64
///    counts as past the end): `NBD_ENOSPC` for `Write`/`WriteZeroes`,
///    `NBD_EINVAL` for `Read`/`Trim`, as the spec recommends.
///
/// Any error on a `Write` drains its payload so the stream stays in sync,
/// unless the payload is longer than [`MAX_WRITE_DRAIN_BYTES`]: then
/// `Disconnect`.
pub fn validate(request: &Request, export_size: u64, transmission_flags: u16) -> Verdict {
    let tflags = transmission_flags;
    let command = request.command;
    let refuse = |nbd_error| refuse(request, nbd_error);
    match command {
        Command::Unknown(_) => return refuse(NBD_EINVAL),
        Command::Disc => return Verdict::Ok,
        Command::Read
        | Command::Write
        | Command::Flush
        | Command::Trim
        | Command::WriteZeroes
        | Command::Cache
        | Command::BlockStatus => {}
    }
    if request.flags & !allowed_flags(command, tflags) != 0 {
        return refuse(NBD_EINVAL);
    }
    if command.modifies() && tflags & NBD_FLAG_READ_ONLY != 0 {
        return refuse(NBD_EPERM);
    }
    let advertised = match command {
        Command::Flush => tflags & NBD_FLAG_SEND_FLUSH != 0,
        Command::Trim => tflags & NBD_FLAG_SEND_TRIM != 0,
        Command::WriteZeroes => tflags & NBD_FLAG_SEND_WRITE_ZEROES != 0,
        Command::Cache => tflags & NBD_FLAG_SEND_CACHE != 0,
        // Whether a metadata context was negotiated is the connection's
        // to check (it is not in the transmission flags).
        _ => true,
    };
    if !advertised {
        return refuse(NBD_EINVAL);
    }
    if command == Command::Flush {
        return if request.offset == 0 && request.length == 0 {
            Verdict::Ok
        } else {
            refuse(NBD_EINVAL)
        };
    }
    let carries_data = matches!(command, Command::Read | Command::Write);
    if carries_data && request.length > MAX_PAYLOAD_BYTES {
        return refuse(NBD_EINVAL);
    }
    if request.length == 0 {
        return refuse(NBD_EINVAL);
    }
    let inside = request
        .offset
        .checked_add(u64::from(request.length))
        .is_some_and(|end| end <= export_size);
    if !inside {
        let grows = matches!(command, Command::Write | Command::WriteZeroes);
        return refuse(if grows { NBD_ENOSPC } else { NBD_EINVAL });
    }
    Verdict::Ok
}

/// The command flags a request of `command` may carry on an export
/// advertising `tflags`.
fn allowed_flags(command: Command, tflags: u16) -> u16 {
    let when = |flag: u16, tflag: u16| if tflags & tflag != 0 { flag } else { 0 };
    let fua = when(NBD_CMD_FLAG_FUA, NBD_FLAG_SEND_FUA);
    match command {
        Command::Read => fua | when(NBD_CMD_FLAG_DF, NBD_FLAG_SEND_DF),
        Command::WriteZeroes => {
            fua | NBD_CMD_FLAG_NO_HOLE | when(NBD_CMD_FLAG_FAST_ZERO, NBD_FLAG_SEND_FAST_ZERO)
        }
        Command::BlockStatus => fua | NBD_CMD_FLAG_REQ_ONE,
        Command::Write | Command::Flush | Command::Trim | Command::Disc | Command::Cache => fua,
        Command::Unknown(_) => 0,
    }
}

/// An error verdict, draining a refused write's payload when that is cheap
/// enough.
fn refuse(request: &Request, nbd_error: u32) -> Verdict {
    if request.command != Command::Write {
        return Verdict::Error {
            nbd_error,
            drain_bytes: 0,
        };
    }
    if request.length > MAX_WRITE_DRAIN_BYTES {
        return Verdict::Disconnect("refused write payload too large to drain");
    }
    Verdict::Error {
        nbd_error,
        drain_bytes: request.length,
    }
}

#[cfg(test)]
mod tests;
