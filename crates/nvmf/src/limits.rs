//! Every bound of the NVMe/TCP target, with the reason for its number.

/// In-capsule data a command may carry (IOCCSZ = (64 + this) / 16). 8 KiB
/// holds the 1,024-byte Fabrics Connect data and one 4 KiB write (the
/// common case at QD1 needs no R2T round trip); larger writes use R2T.
/// SPDK's target defaults to 4 KiB; the Linux host sends in-capsule up to
/// what IOCCSZ allows.
pub const MAX_IN_CAPSULE_DATA_BYTES: usize = 8192;

/// Largest data transfer of one command (MDTS = 5: 2^5 pages of 4 KiB).
/// 128 KiB is what fio, SPDK's perf and the Linux host use for large
/// sequential I/O; it bounds the buffer one command pins.
pub const MAX_TRANSFER_BYTES: usize = 128 * 1024;

/// MDTS as Identify Controller reports it (a power of two of the 4 KiB
/// minimum page size).
pub const MDTS: u8 = 5;

/// MAXH2CDATA: most data bytes in one H2CData PDU. One whole transfer, so
/// one R2T is answered by one H2CData PDU (SPDK's target uses 128 KiB
/// too); the spec's floor is 4 KiB.
pub const MAX_H2C_DATA_BYTES: usize = MAX_TRANSFER_BYTES;

/// Most bytes one device request of a Dataset Management deallocate
/// covers: a range may span 2^32 - 1 LBAs, more than a request's `u32`
/// length, so ranges are split into requests of at most this (1 GiB,
/// a multiple of every LBA size).
pub const MAX_DEALLOCATE_CHUNK_BYTES: u64 = 1 << 30;

/// The TermReq data (the offending header) is at most 128 bytes.
pub const MAX_TERM_REQ_DATA_BYTES: usize = 128;

/// Largest PDU the target accepts: an H2CData PDU of MAXH2CDATA bytes with
/// its 24-byte header, both digests and the most padding a PDO allows.
/// PDUs are parsed whole from the connection's input buffer, which must
/// hold one: see [`INBUF_BYTES`].
pub const MAX_PDU_BYTES: usize = 24 + 4 + 255 + MAX_H2C_DATA_BYTES + 4;

/// The connection's input buffer (from the reactor's cache, held only
/// while bytes are unparsed): two of the largest PDUs, so that the next
/// one's bytes can be read while one is completed.
pub const INBUF_BYTES: usize = 256 * 1024 + 2 * 4096;
const _: () = assert!(INBUF_BYTES >= MAX_PDU_BYTES);

/// Queue entries per queue (CAP.MQES + 1) and so commands in flight per
/// queue pair. SPDK's perf asks for 128 by default at QD ≤ 128; the
/// Linux host asks for 128. Bounds the slot table and the buffers one
/// queue pair pins (128 × 128 KiB = 16 MiB at worst).
pub const MAX_QUEUE_ENTRIES: usize = 128;

/// I/O queues per controller (Set Features Number of Queues is clamped
/// to this). The Linux host asks for one per CPU; each is a TCP
/// connection in a poll group.
pub const MAX_IO_QUEUES: u16 = 64;

/// Controllers live at once over all subsystems (ids 1..=this). One per
/// host and subsystem in practice.
pub const MAX_CONTROLLERS: usize = 4096;

/// Connections (queue pairs, admin included) the target holds at once.
pub const MAX_CONNECTIONS: usize = 16_384;

/// A new connection must finish ICReq and Connect in this time.
pub const CONNECT_TIMEOUT_US: u64 = 10_000_000;

/// A TLS handshake must be done in this time, or the connection is
/// dropped with a log line: a host that stalls mid-handshake holds a
/// socket and OpenSSL's two record buffers (about 34 KiB). The handshake
/// is part of the connect window (the same timer ends both), so it is
/// that window: SPDK's and Linux's hosts finish in milliseconds.
pub const TLS_HANDSHAKE_TIMEOUT_US: u64 = CONNECT_TIMEOUT_US;
const _: () = assert!(TLS_HANDSHAKE_TIMEOUT_US <= CONNECT_TIMEOUT_US);

/// Asynchronous Event Requests held per controller (AERL + 1). Linux
/// sends one; SPDK sends up to AERL + 1.
pub const MAX_AERS: usize = 4;

/// Error log entries (ELPE + 1); the target logs none yet, the page reads
/// as zeros.
pub const ERROR_LOG_ENTRIES: usize = 1;

/// Reply bytes queued before a queue pair stops reading new commands: a
/// host that does not read its completions cannot make the target buffer
/// without bound. A full queue of the largest reads.
pub const MAX_REPLY_QUEUE_BYTES: usize = MAX_QUEUE_ENTRIES * MAX_TRANSFER_BYTES;

/// Bytes read per poller run, so one busy queue pair cannot hold its
/// reactor for long.
pub const READ_BUDGET_BYTES: usize = 4 * 1024 * 1024;

/// Pump rounds per poller run (see `lull_net::wire::pump`).
pub const MAX_ROUNDS: usize = 8;

/// An admin queue is torn down after this share of its KATO without a
/// command. Hosts send keep-alives on their own schedule: with a 1 s KATO,
/// SPDK's perf was seen to leave a whole second between admin commands
/// (a test run was torn down at exactly 1.000 s). SPDK's target
/// checks once per KATO (so tolerates up to two); half a KATO of slack
/// keeps such hosts and still tears a silent one down within 1.5–2 KATO.
pub const KATO_SLACK_PERCENT: u64 = 150;
