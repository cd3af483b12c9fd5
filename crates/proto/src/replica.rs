//! The replica wire protocol (engine ↔ replica) as a pure codec: fixed
//! 32-byte frame headers, the HELLO record and EXTENTS lists. No sockets;
//! `lull-replica` (server) and `lull-engine` (client) own the I/O.
//!
//! Every frame is a [`HEADER_LEN`]-byte header, big-endian:
//!
//! ```text
//! magic u32 "LULR" | version u16 | kind u16 | id u64 | offset u64 | length u32 | status u32
//! ```
//!
//! followed by [`payload_len`] bytes. A reply has the request's kind with
//! [`REPLY_FLAG`] set and the request's id; replies may come out of order.
//! `status` is 0 in requests and 0 or a positive errno in replies.
//!
//! | kind | request payload | reply (status 0) payload | reply `offset` / `length` |
//! | --- | --- | --- | --- |
//! | HELLO | [`Hello`] ([`HELLO_LEN`]), then the replica's name (0 to [`MAX_REPLICA_NAME_BYTES`]) | [`Hello`] (also on error) | 0 / `HELLO_LEN` |
//! | READ | none (`length` ≤ [`MAX_IO_BYTES`] to read) | `length` bytes of data | echo |
//! | WRITE, WRITE_FUA | `length` ≤ `MAX_IO_BYTES` bytes | none | echo |
//! | FLUSH, PING | none (`length` 0) | none | 0 / 0 |
//! | TRIM, WRITE_ZEROES | none (`length` = range) | none | echo |
//! | EXTENTS | none (`length` = range to scan) | `length` bytes = N × 16 | **scan end** / `16 × N` |
//! | DETACH | none (`length` 0) | none | 0 / 0 |
//! | INTENT_MARK, INTENT_CLEAR | none (`offset` = first region, `length` = regions) | none | echo |
//! | INTENT_GET | none (`offset`, `length` 0) | [`INTENT_HEADER_LEN`] + bitmap bytes | regions / payload bytes |
//! | BLOCK_STATUS | none (`length` = range) | N × 16 ([`StatusExtent`]) | echo `offset` / `16 × N` |
//! | CHANGES_START, CHANGES_DROP | [`ChangeKey`] (`length` = 10 + name, + seed for START) | none | 0 / 0 |
//! | CHANGES_GET | [`ChangeKey`] | the record's bitmap | region bytes / bitmap bytes |
//! | SNAPSHOT | [`SnapshotRequest`] (op u8, then the name) | none | 0 / 0 |
//! | SNAPSHOT_LIST | none (`length` 0) | N × [`SnapshotRecord`] | 0 / payload bytes |
//! | CHANGED | [`ChangedRequest`] (range length u32, then a snapshot name) | N × 16 ([`StatusExtent`], flag [`STATUS_CHANGED`]) | echo `offset` / `16 × N` |
//! | CLONE | the new replica's name (1 to [`MAX_REPLICA_NAME_BYTES`]) | none | 0 / 0 |
//! | GROW | none (`offset` = the new volume size, `length` 0) | none | echo `offset` / 0 |
//!
//! EXTENTS replies: `offset` is where the scan stopped (exclusive); the
//! caller continues from there until it reaches the end of its range. The
//! payload is N records of (offset u64, length u64), sorted, non-empty,
//! non-overlapping, N ≤ [`MAX_EXTENTS_PER_REPLY`].
//!
//! BLOCK_STATUS replies (version 3): N records of (length u64, flags u32,
//! reserved u32 = 0), 1 ≤ N ≤ [`MAX_BLOCK_STATUS_PER_REPLY`], no empty
//! length, that cover a prefix of the requested range from its `offset`
//! on, in order; the caller asks again for the rest. Flags are
//! [`STATUS_HOLE`] (not allocated in the replica's data file) and
//! [`STATUS_ZERO`] (reads as zeros). The engine asks only a healthy
//! replica (in sync, not rebuilding), the one it would read from.
//!
//! Error replies (status ≠ 0) carry no payload, except HELLO replies,
//! which always carry the replica's [`Hello`] so a mismatch can be logged.
//!
//! A HELLO request may name the replica after its [`Hello`] record
//! ([`encode_hello_request`]): a node's store serves many replicas on one
//! port and the name says which one the connection is for (`ENOENT` when
//! it holds none of that name). A `lull replica` process serves one
//! replica and takes only unnamed HELLOs. The name is fixed by the first
//! HELLO of a connection. Names follow [`check_replica_name`].
//!
//! # Sessions, clean detach and the write-intent record (version 2)
//!
//! Every engine process has a non-zero **session**, larger than any
//! earlier engine's (the engine takes it from the clock), and sends it in
//! each HELLO. A HELLO with a session larger than the replica's current
//! owner *takes the replica over*: the replica stops taking modifying
//! requests from every other session, waits until their writes already
//! submitted have completed, and only then answers. A HELLO with a smaller
//! session is refused with `ESTALE` (the reply's `session` names the
//! owner), so a late frame of a dead engine cannot take the replica back.
//! So once an engine holds a HELLO reply, no write of an earlier
//! (crashed) engine can land afterwards. Connections of a fenced session
//! are closed; session 0 (a tool) never takes over and gets `ESTALE` for
//! modifying requests while an engine owns the replica.
//!
//! **Clean** ([`HELLO_FLAG_CLEAN`] in a HELLO reply) means: the last engine
//! attached to this replica detached cleanly (DETACH, after a FLUSH), so
//! replicas of one generation that are all clean hold the same bytes. Any
//! attach, and any modifying request, makes the replica dirty on disk
//! first; only DETACH makes it clean again.
//!
//! The **write-intent record** is a bitmap with one bit per region of
//! [`intent_region_bytes`] (md's write-intent bitmap): the engine sets a
//! region's bit on every replica it will write (INTENT_MARK, answered once
//! durable) before it sends the first write there, and clears it
//! (INTENT_CLEAR, persisted lazily: a lost clear only costs a needless
//! resync) once the region has been quiet for a while. After an engine
//! crash, the regions that may differ between replicas of one generation
//! are the union of their bitmaps (INTENT_GET). A replica whose record is
//! unreadable reports every bit set and [`HELLO_FLAG_INTENT_LOST`].
//!
//! # Change records (version 4)
//!
//! When a replica leaves the healthy set, the engine asks every replica
//! still healthy to keep a **change record** for it (CHANGES_START with a
//! [`ChangeKey`]: the engine's name for the absent replica and the
//! generation it had): one bit per region of [`change_region_bytes`]
//! (64 KiB and up), seeded with the regions of the writes that were in
//! flight when it left (the key's seed) and set by the replica for every
//! modifying request it takes from then on, whoever sends it. (The engine
//! holds new writes until every START is answered.) When the
//! absent replica comes back with that generation, the engine reads the
//! record (CHANGES_GET) and copies only those regions (a delta rebuild);
//! `ENOENT` (no record for that name) or `ESTALE` (a record for another
//! generation; the reply's `offset` is that generation) mean a full
//! rebuild. CHANGES_DROP ends a record once its replica is healthy again.
//! A replica keeps the records across an engine's death (in memory) and
//! its own (on disk, stored with the write-intent record and completed
//! from it at start), and loses them only with its write-intent record.
//!
//! # Snapshots (version 5)
//!
//! A replica's data is a chain of layers (`lull_bdev::chain`): a writable
//! head over read-only snapshots. SNAPSHOT runs one control operation on
//! the chain by snapshot name ([`SnapshotOp`]): **create** freezes the
//! head as the snapshot and starts an empty one, **delete** merges the
//! snapshot into its child (in the background; the reply comes once the
//! merge has started, SNAPSHOT_LIST shows its progress), **revert** makes
//! the live data the snapshot's and drops the newer snapshots. It is a
//! modifying request (fenced like a write), answered once the chain's
//! record is durable; errors: `EEXIST` (create: the name is taken),
//! `ENOENT` (no such snapshot), `EINVAL` (a bad name or op), `EMLINK` (the
//! chain is at its layer limit), `EBUSY` (a merge runs), `EIO` otherwise.
//! The engine holds new writes and lets those in flight finish before it
//! sends SNAPSHOT to every healthy replica, so the snapshot holds the same
//! writes on each. SNAPSHOT_LIST answers the replica's snapshots, oldest
//! first ([`SnapshotRecord`]).
//!
//! # Snapshot views and CHANGED (version 6)
//!
//! A HELLO whose name is `REPLICA@SNAPSHOT` (`@SNAPSHOT` for a `lull
//! replica` process; [`view_hello_name`]) opens a **view** connection: it
//! reads the snapshot as it was taken. It must carry session 0 and no
//! attach flag (it never takes the replica over, and is never fenced: a
//! snapshot does not change), else `EINVAL`; a snapshot the replica does
//! not hold is `ENOENT` (the reply carries the replica's [`Hello`]), and
//! the connection closes after either. On a view connection READ,
//! BLOCK_STATUS, EXTENTS, CHANGED and PING are served from the snapshot;
//! every other request is answered `EROFS`, and the connection goes on. A
//! view keeps its layers readable while it is open: a delete of the
//! snapshot merges it meanwhile, and the view still reads the snapshot's
//! bytes.
//!
//! CHANGED asks which bytes of `[offset, offset + length)` were written
//! (or trimmed, or zeroed) since snapshot `since` was taken: on a view,
//! up to the view's snapshot. The reply holds 1 to
//! [`MAX_BLOCK_STATUS_PER_REPLY`] records as BLOCK_STATUS's, with
//! [`STATUS_CHANGED`] set on written runs, covering a prefix of the range
//! (the caller asks again for the rest). `ENOENT`: no snapshot `since`
//! (or not older than the view's); `EINVAL`: a range outside the volume
//! or empty.
//!
//! # Clones (version 7)
//!
//! CLONE, on a view connection (`REPLICA@SNAPSHOT`) to a node's store,
//! makes a new replica of the store, named by the payload, whose base is
//! the view's snapshot: its lower layers are the snapshot and those below
//! it, shared with the origin replica, not copied (the snapshot and those
//! below it cannot be deleted while the clone stands on them, and the
//! origin replica cannot be deleted). The new replica starts clean at
//! generation 0, as a created one, so replicas cloned from the same
//! snapshot of one volume's replicas hold the same bytes and attach as
//! one volume with nothing to rebuild. A CLONE naming a replica that is
//! already a clone of this same snapshot answers success (a retry);
//! errors: `EEXIST` (the name is taken otherwise), `ENOSPC` (the store's
//! room), `EMLINK` (the chain would pass its layer limit), `EINVAL` (a bad
//! name, or CLONE on a connection that is not a view), `EOPNOTSUPP` (a
//! `lull replica` process, which serves one replica).
//!
//! SNAPSHOT's **flatten** op, named by the base's snapshot, starts
//! copying a clone's base into it in the background (as a delete's
//! merge); once it is done the replica stands alone, its inherited
//! snapshots are gone and its origin may delete them. A replica that
//! has no base answers success; one whose base is another snapshot,
//! `ENOENT`. SNAPSHOT_LIST marks a base's snapshots inherited
//! ([`SNAPSHOT_FLAG_INHERITED`]); they show as merging while a flatten
//! runs.
//! # Growing a volume: GROW (version 7)
//!
//! GROW asks the replica to grow its volume to `offset` bytes online: every
//! layer of its chain serves the new range as zeros (the files are extended
//! sparsely), the metadata record holds the new size and the write-intent
//! record (with the change records) has the new size's regions, all durable
//! before the reply. From the reply on, requests are checked against the
//! new size and a HELLO must carry it. It is a modifying request (fenced
//! like a write). Growing to the current size answers success (a retried
//! request does nothing). Refused with `EINVAL`: a smaller size (replicas
//! never shrink), one not a multiple of [`GROW_ALIGN_BYTES`] or past
//! [`MAX_GROW_BYTES`], or one that would change the volume's write-intent
//! or change-record region size ([`grow_keeps_regions`]: both sides derive
//! the regions from the size, and records of writes in flight must keep
//! meaning the same bytes); `EBUSY` while a snapshot is being merged;
//! `EIO` when the files or records could not be written.
//!
//! The engine sends GROW only when every replica of the volume is healthy,
//! after holding new writes and letting those in flight finish (as for
//! SNAPSHOT), and takes the new size once every replica has answered; a
//! replica that fails it leaves the healthy set and, at the old size, is
//! refused at HELLO until it is grown.
//!
//! # Worked example
//!
//! ```
//! use lull_proto::replica::{self, Header, Hello, Kind};
//!
//! // The engine attaches: HELLO with its volume size and new generation.
//! let hello = Hello { volume_size: 1 << 30, generation: 7, flags: replica::HELLO_FLAG_ATTACH, session: 0x5eed };
//! let request = Header::request(Kind::Hello, 1, 0, replica::HELLO_LEN as u32);
//! let mut wire = [0u8; replica::HEADER_LEN];
//! replica::encode_header(&request, &mut wire).unwrap();
//! let mut frame = wire.to_vec();
//! frame.extend_from_slice(&replica::encode_hello(&hello));
//!
//! // The replica decodes the header, then reads `payload_len` more bytes.
//! let (head, rest) = frame.split_first_chunk::<{ replica::HEADER_LEN }>().unwrap();
//! let got = replica::decode_header(head).unwrap();
//! assert_eq!(got, request);
//! assert_eq!(replica::payload_len(&got), rest.len());
//! assert_eq!(replica::decode_hello(rest).unwrap(), hello);
//!
//! // A READ of 4 KiB, answered with the data.
//! let read = Header::request(Kind::Read, 2, 4096, 4096);
//! assert_eq!(replica::payload_len(&read), 0);
//! let reply = read.reply_with(0);
//! assert!(reply.reply && reply.id == 2);
//! assert_eq!(replica::payload_len(&reply), 4096);
//! ```

use thiserror::Error;

/// "LULR": opens every frame, so a stray connection (an NBD client, a
/// port scanner) is recognised at its first four bytes.
pub const MAGIC: u32 = 0x4C55_4C52;
/// Protocol version carried in every header; a peer with another version
/// is refused at HELLO (EPROTO) rather than misparsed later. Version 2
/// added sessions (fencing), DETACH and the write-intent record; version 3
/// added BLOCK_STATUS; version 4 the change records (CHANGES_START, _GET,
/// _DROP); version 5 the snapshots (SNAPSHOT, SNAPSHOT_LIST); version 6
/// the snapshot views (a HELLO naming `REPLICA@SNAPSHOT`) and CHANGED;
/// version 7 clones (CLONE on a view, SNAPSHOT's flatten, and the
/// inherited flag of a SNAPSHOT_LIST record) and GROW (online growth of a
/// replicated volume).
pub const PROTOCOL_VERSION: u16 = 7;
/// Bytes in a frame header: 4 + 2 + 2 + 8 + 8 + 4 + 4.
pub const HEADER_LEN: usize = 32;
/// Bytes in the HELLO / HELLO_REPLY payload: four u64 (size, generation,
/// flags, session), fixed so both sides can read it without a
/// length-prefixed parser.
pub const HELLO_LEN: usize = 32;
/// Longest replica name, in bytes: a Kubernetes object name (a DNS
/// subdomain, at most 253 bytes) fits, and so does the directory the store
/// keeps it in (NAME_MAX is 255). It bounds a HELLO request's payload.
pub const MAX_REPLICA_NAME_BYTES: usize = 253;
/// Separates the replica's name from a snapshot's in a view HELLO
/// (`REPLICA@SNAPSHOT`, or `@SNAPSHOT` for a `lull replica` process):
/// neither a replica's nor a snapshot's name holds it.
pub const VIEW_SEPARATOR: char = '@';
/// Longest name a HELLO request carries: a replica's, the separator and
/// a snapshot's.
pub const MAX_HELLO_NAME_BYTES: usize = MAX_REPLICA_NAME_BYTES + 1 + MAX_SNAPSHOT_NAME_BYTES;
/// Longest HELLO request payload: the record and the longest name.
pub const MAX_HELLO_REQUEST_LEN: usize = HELLO_LEN + MAX_HELLO_NAME_BYTES;
/// Bytes in one EXTENTS record: (offset u64, length u64).
pub const EXTENT_LEN: usize = 16;
/// Largest READ or WRITE payload in one frame. 64 MiB matches the NBD
/// frontend's payload cap, so one NBD request maps to one replica request,
/// and it bounds the receive buffer a peer can make us allocate.
pub const MAX_IO_BYTES: u32 = 64 << 20;
/// Most extents in one EXTENTS reply. 256 records are 4 KiB of payload and
/// at most ~512 `lseek` calls on the replica, which keeps one request's
/// inline work on the reactor short; callers continue from the scan end.
pub const MAX_EXTENTS_PER_REPLY: usize = 256;
/// Largest EXTENTS reply payload.
pub const MAX_EXTENTS_BYTES: u32 = (MAX_EXTENTS_PER_REPLY * EXTENT_LEN) as u32;
/// Bytes in one BLOCK_STATUS record: length u64, flags u32, reserved u32.
pub const STATUS_EXTENT_LEN: usize = 16;
/// Most records in one BLOCK_STATUS reply. Like EXTENTS: 256 records are
/// 4 KiB of payload and at most ~512 `lseek` calls, answered inline on the
/// replica's reactor, so one request holds it for microseconds; an NBD
/// client asks again from where the reply stopped.
pub const MAX_BLOCK_STATUS_PER_REPLY: usize = 256;
/// Largest BLOCK_STATUS reply payload.
pub const MAX_BLOCK_STATUS_BYTES: u32 = (MAX_BLOCK_STATUS_PER_REPLY * STATUS_EXTENT_LEN) as u32;
/// BLOCK_STATUS flag: the range is not allocated in the replica's data.
pub const STATUS_HOLE: u32 = 1 << 0;
/// BLOCK_STATUS flag: the range reads as zeros.
pub const STATUS_ZERO: u32 = 1 << 1;

/// Set in `kind` on every reply.
pub const REPLY_FLAG: u16 = 0x8000;

/// HELLO request flag: the sender is the engine attaching to the volume;
/// the replica marks itself dirty and persists `generation` if higher.
pub const HELLO_FLAG_ATTACH: u64 = 1 << 0;
/// HELLO reply flag: the last engine attached to the replica detached
/// cleanly (DETACH after FLUSH) and nothing has written to it since.
pub const HELLO_FLAG_CLEAN: u64 = 1 << 0;
/// HELLO reply flag: the replica's write-intent record was missing or
/// unreadable at start; it reports every region as possibly different
/// (a full compare-and-repair), never an empty record.
pub const HELLO_FLAG_INTENT_LOST: u64 = 1 << 1;

/// Smallest write-intent region. A region is the unit resynced after an
/// engine crash and the unit whose first write costs a durable INTENT_MARK
/// (one fsync on every replica, shared by every mark waiting at that
/// moment). 4 MiB keeps a resync of one region to milliseconds while a
/// 1 GiB volume has 256 regions to warm up.
pub const INTENT_REGION_MIN_BYTES: u64 = 4 << 20;
/// Most write-intent regions per volume: the bitmap is at most 2 KiB, so
/// it fits one 4 KiB record slot and one INTENT_GET reply; volumes above
/// 64 GiB get larger regions (a power of two).
pub const MAX_INTENT_REGIONS: u32 = 16384;
/// Largest bitmap, in bytes.
pub const MAX_INTENT_BITMAP_BYTES: usize = MAX_INTENT_REGIONS as usize / 8;
/// INTENT_GET reply payload: a u64 of flags ([`INTENT_FLAG_LOST`]) before
/// the bitmap.
pub const INTENT_HEADER_LEN: usize = 8;
/// INTENT_GET flag: the record was lost; every bit is set.
pub const INTENT_FLAG_LOST: u64 = 1 << 0;
/// Largest INTENT_GET reply payload.
pub const MAX_INTENT_GET_BYTES: u32 = (INTENT_HEADER_LEN + MAX_INTENT_BITMAP_BYTES) as u32;

pub const KIND_HELLO: u16 = 1;
pub const KIND_READ: u16 = 2;
pub const KIND_WRITE: u16 = 3;
pub const KIND_WRITE_FUA: u16 = 4;
pub const KIND_FLUSH: u16 = 5;
pub const KIND_TRIM: u16 = 6;
pub const KIND_WRITE_ZEROES: u16 = 7;
pub const KIND_PING: u16 = 8;
pub const KIND_EXTENTS: u16 = 9;
pub const KIND_DETACH: u16 = 10;
pub const KIND_INTENT_MARK: u16 = 11;
pub const KIND_INTENT_CLEAR: u16 = 12;
pub const KIND_INTENT_GET: u16 = 13;
pub const KIND_BLOCK_STATUS: u16 = 14;
pub const KIND_CHANGES_START: u16 = 15;
pub const KIND_CHANGES_GET: u16 = 16;
pub const KIND_CHANGES_DROP: u16 = 17;
pub const KIND_SNAPSHOT: u16 = 18;
pub const KIND_SNAPSHOT_LIST: u16 = 19;
pub const KIND_CHANGED: u16 = 20;
pub const KIND_CLONE: u16 = 21;
pub const KIND_GROW: u16 = 22;

/// A GROW's new size is a multiple of 4 KiB: the chain's block and the
/// largest LBA size a frontend serves (`lull_bdev::RESIZE_ALIGN_BYTES`).
pub const GROW_ALIGN_BYTES: u64 = 4096;
/// Largest size a GROW asks for: 2^62 bytes, far past any file a replica
/// can hold, and small enough that offsets plus a request's length never
/// overflow a u64.
pub const MAX_GROW_BYTES: u64 = 1 << 62;

/// CHANGED request payload before the name: the range's length (u32).
pub const CHANGED_HEADER_LEN: usize = 4;
/// Longest CHANGED request payload: the range's length and the longest
/// snapshot name.
pub const MAX_CHANGED_REQUEST_LEN: usize = CHANGED_HEADER_LEN + MAX_SNAPSHOT_NAME_BYTES;
/// Flag of a CHANGED reply record: the run was written since the snapshot.
pub const STATUS_CHANGED: u32 = 1 << 0;

/// Longest snapshot name, in bytes: the chain's own bound
/// (`lull_bdev::chain::MAX_SNAPSHOT_NAME_LEN`), which keeps an export name
/// `VOLUME@SNAPSHOT` and a layer's file name short.
pub const MAX_SNAPSHOT_NAME_BYTES: usize = 200;
/// Longest SNAPSHOT request payload: the op and the longest name.
pub const MAX_SNAPSHOT_REQUEST_LEN: usize = 1 + MAX_SNAPSHOT_NAME_BYTES;
/// Most records in a SNAPSHOT_LIST reply: a chain's layers
/// (`lull_bdev::chain::MAX_CHAIN_LAYERS`, 64) bound its snapshots.
pub const MAX_SNAPSHOT_RECORDS: usize = 64;
/// Bytes of a [`SnapshotRecord`] before its name: four u64, the flags
/// (u32) and the name's length (u16).
pub const SNAPSHOT_RECORD_HEADER_LEN: usize = 4 * 8 + 4 + 2;
/// [`SnapshotRecord`] flag: the snapshot belongs to the replica this one
/// was cloned from (a layer of its base), see [`SnapshotRecord::inherited`].
pub const SNAPSHOT_FLAG_INHERITED: u32 = 1 << 0;
/// Largest SNAPSHOT_LIST reply payload.
pub const MAX_SNAPSHOT_LIST_BYTES: u32 =
    (MAX_SNAPSHOT_RECORDS * (SNAPSHOT_RECORD_HEADER_LEN + MAX_SNAPSHOT_NAME_BYTES)) as u32;

/// Smallest change-record region: the unit a delta rebuild copies for a
/// write made while a replica was away. 64 KiB: a random 4 KiB write
/// costs 64 KiB of copy (16×) where a write-intent region would cost
/// 4 MiB (1,024×), and a 1 GiB volume's record is 2 KiB.
pub const CHANGE_REGION_MIN_BYTES: u64 = 64 << 10;
/// Most change-record regions per volume: a record (and a CHANGES_GET
/// reply) is at most 128 KiB; volumes above 64 GiB get larger regions (a
/// power of two).
pub const MAX_CHANGE_REGIONS: u64 = 1 << 20;
/// Largest change-record bitmap, in bytes.
pub const MAX_CHANGE_BITMAP_BYTES: u32 = (MAX_CHANGE_REGIONS / 8) as u32;
/// Longest peer name in a change request: the engine's name for the
/// replica (`NAME@HOST:PORT`): a replica name ([`MAX_REPLICA_NAME_BYTES`])
/// and a host name (253) with a port fit.
pub const MAX_CHANGE_PEER_BYTES: usize = 512;
/// A change request's payload before the peer name: the peer's generation
/// (u64) and the name's length (u16).
pub const CHANGE_KEY_HEADER_LEN: usize = 8 + 2;
/// Longest CHANGES_GET / CHANGES_DROP payload.
pub const MAX_CHANGE_KEY_LEN: usize = CHANGE_KEY_HEADER_LEN + MAX_CHANGE_PEER_BYTES;
/// Longest CHANGES_START payload: a key and a seed bitmap.
pub const MAX_CHANGE_START_LEN: usize = MAX_CHANGE_KEY_LEN + MAX_CHANGE_BITMAP_BYTES as usize;

const _: () = assert!(4 + 2 + 2 + 8 + 8 + 4 + 4 == HEADER_LEN);
const _: () = assert!(4 * 8 == HELLO_LEN);

/// A request kind (replies use the same kind with `Header::reply` set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Hello,
    Read,
    Write,
    WriteFua,
    Flush,
    Trim,
    WriteZeroes,
    Ping,
    Extents,
    /// The engine detaches cleanly: the replica syncs its data, empties its
    /// write-intent record and marks itself clean, then answers.
    Detach,
    /// Set regions `[offset, offset + length)` in the write-intent record;
    /// answered once durable.
    IntentMark,
    /// Clear regions `[offset, offset + length)`; persisted lazily.
    IntentClear,
    /// Read the whole write-intent record.
    IntentGet,
    /// The allocation of `[offset, offset + length)`: hole / zero flags
    /// per extent, for NBD block status (version 3).
    BlockStatus,
    /// Start recording, on this replica, which change regions are written
    /// from now on for the peer a [`ChangeKey`] names (a replica that left
    /// the healthy set at that generation), seeded with the write-intent
    /// record; replaces a record for the same peer. Answered once durable.
    ChangesStart,
    /// Read the change record of a peer ([`ChangeKey`]): the bitmap when
    /// the record is for that generation.
    ChangesGet,
    /// End the change record of a peer (it is healthy again, or removed).
    ChangesDrop,
    /// Create, delete or revert to a snapshot ([`SnapshotRequest`]);
    /// answered once durable (version 5).
    Snapshot,
    /// The replica's snapshots, oldest first ([`SnapshotRecord`]s).
    SnapshotList,
    /// Which runs of a range were written since a snapshot ([`ChangedRequest`];
    /// version 6): on a view connection, between that snapshot and the
    /// view's.
    Changed,
    /// On a view connection to a store: make a new replica, named by the
    /// payload, whose base is the view's snapshot (version 7).
    Clone,
    /// Grow the volume to `offset` bytes (version 7); answered once durable.
    Grow,
}

impl Kind {
    /// Every kind, for tests and tables.
    pub const ALL: [Kind; 22] = [
        Kind::Hello,
        Kind::Read,
        Kind::Write,
        Kind::WriteFua,
        Kind::Flush,
        Kind::Trim,
        Kind::WriteZeroes,
        Kind::Ping,
        Kind::Extents,
        Kind::Detach,
        Kind::IntentMark,
        Kind::IntentClear,
        Kind::IntentGet,
        Kind::BlockStatus,
        Kind::ChangesStart,
        Kind::ChangesGet,
        Kind::ChangesDrop,
        Kind::Snapshot,
        Kind::SnapshotList,
        Kind::Changed,
        Kind::Clone,
        Kind::Grow,
    ];

    /// The kind for a wire code *without* [`REPLY_FLAG`]; `None` if unknown.
    pub fn from_wire(code: u16) -> Option<Kind> {
        Some(match code {
            KIND_HELLO => Kind::Hello,
            KIND_READ => Kind::Read,
            KIND_WRITE => Kind::Write,
            KIND_WRITE_FUA => Kind::WriteFua,
            KIND_FLUSH => Kind::Flush,
            KIND_TRIM => Kind::Trim,
            KIND_WRITE_ZEROES => Kind::WriteZeroes,
            KIND_PING => Kind::Ping,
            KIND_EXTENTS => Kind::Extents,
            KIND_DETACH => Kind::Detach,
            KIND_INTENT_MARK => Kind::IntentMark,
            KIND_INTENT_CLEAR => Kind::IntentClear,
            KIND_INTENT_GET => Kind::IntentGet,
            KIND_BLOCK_STATUS => Kind::BlockStatus,
            KIND_CHANGES_START => Kind::ChangesStart,
            KIND_CHANGES_GET => Kind::ChangesGet,
            KIND_CHANGES_DROP => Kind::ChangesDrop,
            KIND_SNAPSHOT => Kind::Snapshot,
            KIND_SNAPSHOT_LIST => Kind::SnapshotList,
            KIND_CHANGED => Kind::Changed,
            KIND_CLONE => Kind::Clone,
            KIND_GROW => Kind::Grow,
            _ => return None,
        })
    }

    /// The wire code without [`REPLY_FLAG`].
    pub fn to_wire(self) -> u16 {
        match self {
            Kind::Hello => KIND_HELLO,
            Kind::Read => KIND_READ,
            Kind::Write => KIND_WRITE,
            Kind::WriteFua => KIND_WRITE_FUA,
            Kind::Flush => KIND_FLUSH,
            Kind::Trim => KIND_TRIM,
            Kind::WriteZeroes => KIND_WRITE_ZEROES,
            Kind::Ping => KIND_PING,
            Kind::Extents => KIND_EXTENTS,
            Kind::Detach => KIND_DETACH,
            Kind::IntentMark => KIND_INTENT_MARK,
            Kind::IntentClear => KIND_INTENT_CLEAR,
            Kind::IntentGet => KIND_INTENT_GET,
            Kind::BlockStatus => KIND_BLOCK_STATUS,
            Kind::ChangesStart => KIND_CHANGES_START,
            Kind::ChangesGet => KIND_CHANGES_GET,
            Kind::ChangesDrop => KIND_CHANGES_DROP,
            Kind::Snapshot => KIND_SNAPSHOT,
            Kind::SnapshotList => KIND_SNAPSHOT_LIST,
            Kind::Changed => KIND_CHANGED,
            Kind::Clone => KIND_CLONE,
            Kind::Grow => KIND_GROW,
        }
    }

    /// Kinds whose request carries a `length`-byte payload.
    pub fn is_write(self) -> bool {
        matches!(self, Kind::Write | Kind::WriteFua)
    }

    /// Kinds that change the replica's data or records: refused from a
    /// fenced session, and they make a clean replica dirty first.
    pub fn modifies(self) -> bool {
        matches!(
            self,
            Kind::Write
                | Kind::WriteFua
                | Kind::Trim
                | Kind::WriteZeroes
                | Kind::IntentMark
                | Kind::IntentClear
                | Kind::ChangesStart
                | Kind::ChangesDrop
                | Kind::Snapshot
                | Kind::Grow
        )
    }

    /// Kinds whose request carries a [`ChangeKey`] payload.
    pub fn has_change_key(self) -> bool {
        matches!(
            self,
            Kind::ChangesStart | Kind::ChangesGet | Kind::ChangesDrop
        )
    }
}

/// A decoded frame header. Valid by construction when it came from
/// [`decode_header`]; [`encode_header`] checks the same limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    /// True for replies (`kind | REPLY_FLAG` on the wire).
    pub reply: bool,
    /// Chosen by the requester, echoed in the reply.
    pub id: u64,
    pub offset: u64,
    pub length: u32,
    /// 0 in requests; 0 or a positive errno in replies.
    pub status: u32,
}

impl Header {
    /// A request header (status 0).
    pub fn request(kind: Kind, id: u64, offset: u64, length: u32) -> Header {
        Header {
            kind,
            reply: false,
            id,
            offset,
            length,
            status: 0,
        }
    }

    /// The reply to this request with `status`, echoing offset and length
    /// where the table in the module docs says so. Callers adjust
    /// `offset`/`length` for EXTENTS replies (scan end, payload bytes)
    /// and the payload bytes of INTENT_GET and BLOCK_STATUS replies.
    pub fn reply_with(&self, status: u32) -> Header {
        let (offset, length) = match self.kind {
            Kind::Hello => (0, HELLO_LEN as u32),
            Kind::Flush
            | Kind::Ping
            | Kind::Detach
            | Kind::ChangesStart
            | Kind::ChangesGet
            | Kind::ChangesDrop
            | Kind::Snapshot
            | Kind::SnapshotList
            | Kind::Clone => (0, 0),
            Kind::Extents | Kind::IntentGet | Kind::BlockStatus | Kind::Changed | Kind::Grow => {
                (self.offset, 0)
            }
            Kind::Read
            | Kind::Write
            | Kind::WriteFua
            | Kind::Trim
            | Kind::WriteZeroes
            | Kind::IntentMark
            | Kind::IntentClear => (self.offset, self.length),
        };
        Header {
            kind: self.kind,
            reply: true,
            id: self.id,
            offset,
            length,
            status,
        }
    }
}

/// The HELLO / HELLO_REPLY payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub volume_size: u64,
    pub generation: u64,
    /// Request: [`HELLO_FLAG_ATTACH`]. Reply: [`HELLO_FLAG_CLEAN`],
    /// [`HELLO_FLAG_INTENT_LOST`].
    pub flags: u64,
    /// Request: the engine's session (0 for a tool, which never takes the
    /// replica over). Reply: the session that owns the replica now.
    pub session: u64,
}

/// A frame that cannot be accepted. Header errors mean the stream is out of
/// sync or from a foreign peer: the receiver closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("frame magic {0:#010x} is not LULR")]
    BadMagic(u32),
    #[error("protocol version {0}, expected {PROTOCOL_VERSION}")]
    BadVersion(u16),
    #[error("unknown frame kind {0:#06x}")]
    UnknownKind(u16),
    #[error("{kind:?} frame length {length} exceeds its limit")]
    TooLong { kind: Kind, length: u32 },
    #[error("bad payload: {0}")]
    BadPayload(&'static str),
}

impl FrameError {
    /// The errno that best describes the error, for logs, counters and the
    /// `status` of a refusal.
    pub fn errno(&self) -> i32 {
        match self {
            FrameError::BadMagic(_)
            | FrameError::BadVersion(_)
            | FrameError::UnknownKind(_)
            | FrameError::BadPayload(_) => libc::EPROTO,
            FrameError::TooLong { .. } => libc::EMSGSIZE,
        }
    }
}

/// The id field of a raw header, readable even when [`decode_header`]
/// refuses it (to address a HELLO refusal for a wrong version).
pub fn raw_id(buf: &[u8; HEADER_LEN]) -> u64 {
    u64::from_be_bytes(field(buf, 8))
}

fn field<const N: usize>(buf: &[u8; HEADER_LEN], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&buf[at..at + N]);
    out
}

/// The limits every header obeys, on encode and decode alike.
fn check(h: &Header) -> Result<(), FrameError> {
    if !h.reply && h.status != 0 {
        return Err(FrameError::BadPayload("request status must be 0"));
    }
    let too_long = |limit: u32| {
        if h.length > limit {
            Err(FrameError::TooLong {
                kind: h.kind,
                length: h.length,
            })
        } else {
            Ok(())
        }
    };
    match h.kind {
        Kind::Hello => {
            let length = h.length as usize;
            if h.reply && length != HELLO_LEN {
                return Err(FrameError::BadPayload(
                    "HELLO reply length must be HELLO_LEN",
                ));
            }
            if !h.reply && !(HELLO_LEN..=MAX_HELLO_REQUEST_LEN).contains(&length) {
                return Err(FrameError::BadPayload(
                    "HELLO length must be HELLO_LEN plus a name of at most MAX_HELLO_NAME_BYTES",
                ));
            }
        }
        Kind::Read | Kind::Write | Kind::WriteFua => too_long(MAX_IO_BYTES)?,
        Kind::Flush | Kind::Ping | Kind::Detach | Kind::Grow => too_long(0)?,
        // The length is a range on the volume, not a payload; u32 bounds it.
        Kind::Trim | Kind::WriteZeroes => {}
        Kind::IntentMark | Kind::IntentClear => {
            let end = h.offset.checked_add(u64::from(h.length));
            if end.is_none_or(|e| e > u64::from(MAX_INTENT_REGIONS)) {
                return Err(FrameError::BadPayload(
                    "intent regions past MAX_INTENT_REGIONS",
                ));
            }
        }
        Kind::IntentGet => {
            if h.reply {
                too_long(MAX_INTENT_GET_BYTES)?;
                if h.status == 0 && (h.length as usize) < INTENT_HEADER_LEN {
                    return Err(FrameError::BadPayload(
                        "INTENT_GET reply without its header",
                    ));
                }
                if h.status != 0 && h.length != 0 {
                    return Err(FrameError::BadPayload(
                        "INTENT_GET error reply carries a payload",
                    ));
                }
            } else {
                too_long(0)?;
            }
        }
        Kind::ChangesStart | Kind::ChangesGet | Kind::ChangesDrop if !h.reply => {
            let length = h.length as usize;
            let max = if h.kind == Kind::ChangesStart {
                MAX_CHANGE_START_LEN
            } else {
                MAX_CHANGE_KEY_LEN
            };
            if !(CHANGE_KEY_HEADER_LEN + 1..=max).contains(&length) {
                return Err(FrameError::BadPayload(
                    "change request length must be a key with a peer name of 1 to MAX_CHANGE_PEER_BYTES (and a seed for CHANGES_START)",
                ));
            }
        }
        Kind::ChangesGet => {
            too_long(MAX_CHANGE_BITMAP_BYTES)?;
            if h.status != 0 && h.length != 0 {
                return Err(FrameError::BadPayload(
                    "CHANGES_GET error reply carries a payload",
                ));
            }
        }
        Kind::ChangesStart | Kind::ChangesDrop => too_long(0)?,
        Kind::Snapshot if !h.reply => {
            if !(2..=MAX_SNAPSHOT_REQUEST_LEN).contains(&(h.length as usize)) {
                return Err(FrameError::BadPayload(
                    "SNAPSHOT length must be the op and a name of 1 to MAX_SNAPSHOT_NAME_BYTES",
                ));
            }
        }
        Kind::Snapshot => too_long(0)?,
        Kind::Clone if !h.reply => {
            if !(1..=MAX_REPLICA_NAME_BYTES).contains(&(h.length as usize)) {
                return Err(FrameError::BadPayload(
                    "CLONE length must be a replica name of 1 to MAX_REPLICA_NAME_BYTES",
                ));
            }
        }
        Kind::Clone => too_long(0)?,
        Kind::SnapshotList => {
            if h.reply {
                too_long(MAX_SNAPSHOT_LIST_BYTES)?;
                if h.status != 0 && h.length != 0 {
                    return Err(FrameError::BadPayload(
                        "SNAPSHOT_LIST error reply carries a payload",
                    ));
                }
            } else {
                too_long(0)?;
            }
        }
        Kind::Changed if !h.reply => {
            if !(CHANGED_HEADER_LEN + 1..=MAX_CHANGED_REQUEST_LEN).contains(&(h.length as usize)) {
                return Err(FrameError::BadPayload(
                    "CHANGED length must be the range's length and a name of 1 to MAX_SNAPSHOT_NAME_BYTES",
                ));
            }
        }
        Kind::BlockStatus | Kind::Changed => {
            if h.reply {
                too_long(MAX_BLOCK_STATUS_BYTES)?;
                if !(h.length as usize).is_multiple_of(STATUS_EXTENT_LEN) {
                    return Err(FrameError::BadPayload(
                        "BLOCK_STATUS reply length not a multiple of 16",
                    ));
                }
                if h.status != 0 && h.length != 0 {
                    return Err(FrameError::BadPayload(
                        "BLOCK_STATUS error reply carries extents",
                    ));
                }
            }
        }
        Kind::Extents => {
            if h.reply {
                too_long(MAX_EXTENTS_BYTES)?;
                if !(h.length as usize).is_multiple_of(EXTENT_LEN) {
                    return Err(FrameError::BadPayload(
                        "EXTENTS reply length not a multiple of 16",
                    ));
                }
                if h.status != 0 && h.length != 0 {
                    return Err(FrameError::BadPayload(
                        "EXTENTS error reply carries extents",
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Decodes and checks a header: magic, version, kind and the length limit
/// of its kind. Any error means the connection must close.
pub fn decode_header(buf: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
    let magic = u32::from_be_bytes(field(buf, 0));
    if magic != MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    let version = u16::from_be_bytes(field(buf, 4));
    if version != PROTOCOL_VERSION {
        return Err(FrameError::BadVersion(version));
    }
    let code = u16::from_be_bytes(field(buf, 6));
    let kind = Kind::from_wire(code & !REPLY_FLAG).ok_or(FrameError::UnknownKind(code))?;
    let header = Header {
        kind,
        reply: code & REPLY_FLAG != 0,
        id: u64::from_be_bytes(field(buf, 8)),
        offset: u64::from_be_bytes(field(buf, 16)),
        length: u32::from_be_bytes(field(buf, 24)),
        status: u32::from_be_bytes(field(buf, 28)),
    };
    check(&header)?;
    Ok(header)
}

/// Encodes a header after checking the same limits as [`decode_header`],
/// so a peer never receives a frame it would refuse.
pub fn encode_header(h: &Header, out: &mut [u8; HEADER_LEN]) -> Result<(), FrameError> {
    check(h)?;
    let code = h.kind.to_wire() | if h.reply { REPLY_FLAG } else { 0 };
    out[0..4].copy_from_slice(&MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out[6..8].copy_from_slice(&code.to_be_bytes());
    out[8..16].copy_from_slice(&h.id.to_be_bytes());
    out[16..24].copy_from_slice(&h.offset.to_be_bytes());
    out[24..28].copy_from_slice(&h.length.to_be_bytes());
    out[28..32].copy_from_slice(&h.status.to_be_bytes());
    Ok(())
}

/// Encodes a HELLO reply header that refuses a peer whose header could not
/// be decoded (wrong version): kind HELLO|REPLY, this side's version.
pub fn encode_refusal(id: u64, status: u32, out: &mut [u8; HEADER_LEN]) {
    let h = Header {
        kind: Kind::Hello,
        reply: true,
        id,
        offset: 0,
        length: HELLO_LEN as u32,
        status,
    };
    // A HELLO reply of HELLO_LEN always passes `check`.
    let _ = encode_header(&h, out);
}

/// Bytes that follow this header on the wire. Only meaningful for headers
/// that passed [`decode_header`] / [`encode_header`].
pub fn payload_len(h: &Header) -> usize {
    let length = h.length as usize;
    match (h.kind, h.reply) {
        (Kind::Hello, true) => HELLO_LEN,
        (Kind::Hello, false) => length,
        (Kind::Write | Kind::WriteFua, false) => length,
        (
            Kind::ChangesStart
            | Kind::ChangesGet
            | Kind::ChangesDrop
            | Kind::Snapshot
            | Kind::Changed
            | Kind::Clone,
            false,
        ) => length,
        (
            Kind::Read
            | Kind::Extents
            | Kind::IntentGet
            | Kind::BlockStatus
            | Kind::ChangesGet
            | Kind::SnapshotList
            | Kind::Changed,
            true,
        ) if h.status == 0 => length,
        _ => 0,
    }
}

/// Encodes a HELLO payload.
pub fn encode_hello(h: &Hello) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[0..8].copy_from_slice(&h.volume_size.to_be_bytes());
    out[8..16].copy_from_slice(&h.generation.to_be_bytes());
    out[16..24].copy_from_slice(&h.flags.to_be_bytes());
    out[24..32].copy_from_slice(&h.session.to_be_bytes());
    out
}

/// Decodes a HELLO payload; it must be exactly [`HELLO_LEN`] bytes.
pub fn decode_hello(b: &[u8]) -> Result<Hello, FrameError> {
    let Some(b) = b
        .first_chunk::<HELLO_LEN>()
        .filter(|_| b.len() == HELLO_LEN)
    else {
        return Err(FrameError::BadPayload(
            "HELLO payload is not HELLO_LEN bytes",
        ));
    };
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i * 8..i * 8 + 8]);
        u64::from_be_bytes(w)
    };
    Ok(Hello {
        volume_size: word(0),
        generation: word(1),
        flags: word(2),
        session: word(3),
    })
}

/// Whether `name` may name a replica: 1 to [`MAX_REPLICA_NAME_BYTES`]
/// bytes of `A-Z a-z 0-9 - _ .`, starting with a letter or digit (so never
/// `.`, `..` or a hidden file, and never a path: it is a directory name in
/// the store). The error says what is wrong.
pub fn check_replica_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("a replica name is empty");
    }
    if name.len() > MAX_REPLICA_NAME_BYTES {
        return Err("a replica name has at most 253 bytes");
    }
    if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        return Err("a replica name starts with a letter or a digit");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err("a replica name has only A-Z a-z 0-9 - _ .");
    }
    Ok(())
}

/// Encodes a HELLO request payload: the record, then `name` (empty: an
/// unnamed HELLO, for a `lull replica` process; `REPLICA@SNAPSHOT` for a
/// view, [`view_hello_name`]). The caller checked the names
/// ([`check_replica_name`], [`check_snapshot_name`]).
pub fn encode_hello_request(h: &Hello, name: &str) -> Vec<u8> {
    debug_assert!({
        let (replica, snapshot) = split_hello_name(name);
        (replica.is_empty() || check_replica_name(replica).is_ok())
            && snapshot.is_none_or(|s| check_snapshot_name(s).is_ok())
    });
    let mut out = Vec::with_capacity(HELLO_LEN + name.len());
    out.extend_from_slice(&encode_hello(h));
    out.extend_from_slice(name.as_bytes());
    out
}

/// Decodes a HELLO request payload: the record and the replica's name
/// (`""` when the HELLO names none). A name that is not valid is an error.
pub fn decode_hello_request(b: &[u8]) -> Result<(Hello, &str), FrameError> {
    if b.len() < HELLO_LEN || b.len() > MAX_HELLO_REQUEST_LEN {
        return Err(FrameError::BadPayload(
            "HELLO request payload is not HELLO_LEN plus a name",
        ));
    }
    let (record, name) = b.split_at(HELLO_LEN);
    let hello = decode_hello(record)?;
    let name = std::str::from_utf8(name)
        .map_err(|_| FrameError::BadPayload("HELLO replica name is not UTF-8"))?;
    let (replica, snapshot) = split_hello_name(name);
    if !replica.is_empty() {
        check_replica_name(replica).map_err(FrameError::BadPayload)?;
    }
    if let Some(snapshot) = snapshot {
        check_snapshot_name(snapshot).map_err(FrameError::BadPayload)?;
    }
    Ok((hello, name))
}

/// A HELLO's name split into the replica's (empty: a `lull replica`
/// process's one replica) and, for a snapshot view, the snapshot's.
pub fn split_hello_name(name: &str) -> (&str, Option<&str>) {
    match name.split_once(VIEW_SEPARATOR) {
        Some((replica, snapshot)) => (replica, Some(snapshot)),
        None => (name, None),
    }
}

/// The HELLO name of a view of `snapshot` of replica `replica` (empty for
/// a `lull replica` process).
pub fn view_hello_name(replica: &str, snapshot: &str) -> String {
    format!("{replica}{VIEW_SEPARATOR}{snapshot}")
}

/// The snapshot naming rule, as the chain has it
/// (`lull_bdev::chain::check_snapshot_name`): 1 to
/// [`MAX_SNAPSHOT_NAME_BYTES`] bytes of letters, digits, `-`, `_`, `.`
/// and `:`, not starting with `.`.
pub fn check_snapshot_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > MAX_SNAPSHOT_NAME_BYTES {
        return Err("a snapshot name has 1 to 200 bytes");
    }
    if name.starts_with('.') {
        return Err("a snapshot name does not start with '.'");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b))
    {
        return Err("a snapshot name has only A-Z a-z 0-9 - _ . :");
    }
    Ok(())
}

/// A CHANGED request: the runs of `[offset, offset + length)` (`offset` in
/// the header) written since snapshot `since`. Wire: length u32, then the
/// name (`length` in the header is the payload's bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangedRequest {
    pub length: u32,
    pub since: String,
}

/// Encodes a CHANGED request's payload.
pub fn encode_changed_request(r: &ChangedRequest) -> Result<Vec<u8>, FrameError> {
    check_snapshot_name(&r.since).map_err(FrameError::BadPayload)?;
    let mut out = Vec::with_capacity(CHANGED_HEADER_LEN + r.since.len());
    out.extend_from_slice(&r.length.to_be_bytes());
    out.extend_from_slice(r.since.as_bytes());
    Ok(out)
}

/// Decodes a CHANGED request's payload.
pub fn decode_changed_request(b: &[u8]) -> Result<ChangedRequest, FrameError> {
    let Some((length, name)) = b.split_first_chunk::<CHANGED_HEADER_LEN>() else {
        return Err(FrameError::BadPayload("CHANGED payload without its length"));
    };
    let since = std::str::from_utf8(name)
        .map_err(|_| FrameError::BadPayload("CHANGED snapshot name is not UTF-8"))?;
    check_snapshot_name(since).map_err(FrameError::BadPayload)?;
    Ok(ChangedRequest {
        length: u32::from_be_bytes(*length),
        since: since.to_string(),
    })
}

/// Bytes per write-intent region of a volume of `volume_size` bytes: at
/// least [`INTENT_REGION_MIN_BYTES`], a power of two, and large enough that
/// the volume has at most [`MAX_INTENT_REGIONS`] regions. Both sides
/// compute it, so it is never negotiated.
pub fn intent_region_bytes(volume_size: u64) -> u64 {
    let per = volume_size.div_ceil(u64::from(MAX_INTENT_REGIONS));
    per.checked_next_power_of_two()
        .unwrap_or(1 << 63)
        .max(INTENT_REGION_MIN_BYTES)
}

/// Write-intent regions of a volume of `volume_size` bytes (≤ [`MAX_INTENT_REGIONS`]).
pub fn intent_regions(volume_size: u64) -> u32 {
    let n = volume_size.div_ceil(intent_region_bytes(volume_size));
    // At most MAX_INTENT_REGIONS by the choice of region size.
    n.min(u64::from(MAX_INTENT_REGIONS)) as u32
}

/// Bitmap bytes of a volume of `volume_size` bytes.
pub fn intent_bitmap_bytes(volume_size: u64) -> usize {
    (intent_regions(volume_size) as usize).div_ceil(8)
}

/// Bytes per change-record region of a volume of `volume_size` bytes: at
/// least [`CHANGE_REGION_MIN_BYTES`], a power of two, and large enough
/// that the volume has at most [`MAX_CHANGE_REGIONS`] regions. Both sides
/// compute it; a CHANGES_GET reply names it too.
pub fn change_region_bytes(volume_size: u64) -> u64 {
    volume_size
        .div_ceil(MAX_CHANGE_REGIONS)
        .checked_next_power_of_two()
        .unwrap_or(1 << 63)
        .max(CHANGE_REGION_MIN_BYTES)
}

/// Whether a volume of `old_size` bytes may grow to `new_size` without
/// changing its write-intent or change-record region size (GROW's
/// condition): regions are derived from the size on both sides, so a
/// record of writes in flight must keep naming the same bytes. Up to 64
/// GiB the regions are the smallest (4 MiB and 64 KiB); past it a volume
/// grows within its power of two.
pub fn grow_keeps_regions(old_size: u64, new_size: u64) -> bool {
    intent_region_bytes(old_size) == intent_region_bytes(new_size)
        && change_region_bytes(old_size) == change_region_bytes(new_size)
}

/// Change-record regions of a volume of `volume_size` bytes.
pub fn change_regions(volume_size: u64) -> u64 {
    volume_size
        .div_ceil(change_region_bytes(volume_size))
        .min(MAX_CHANGE_REGIONS)
}

/// The payload of CHANGES_START, _GET and _DROP: which replica a change
/// record is for (the engine's name for it) and the generation it had when
/// it left the healthy set; for CHANGES_START also the regions to seed the
/// record with (the writes in flight when it left), a bitmap of
/// [`change_regions`] bits or empty. Wire: generation u64, name length
/// u16, the name's bytes, the seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeKey {
    pub generation: u64,
    pub peer: String,
    pub seed: Vec<u8>,
}

/// Encodes a change request's payload; the peer name must be 1 to
/// [`MAX_CHANGE_PEER_BYTES`] bytes, the seed at most
/// [`MAX_CHANGE_BITMAP_BYTES`].
pub fn encode_change_key(key: &ChangeKey) -> Result<Vec<u8>, FrameError> {
    if key.peer.is_empty() || key.peer.len() > MAX_CHANGE_PEER_BYTES {
        return Err(FrameError::BadPayload(
            "change peer name must be 1 to MAX_CHANGE_PEER_BYTES bytes",
        ));
    }
    if key.seed.len() > MAX_CHANGE_BITMAP_BYTES as usize {
        return Err(FrameError::BadPayload("change seed longer than a record"));
    }
    let mut out = Vec::with_capacity(CHANGE_KEY_HEADER_LEN + key.peer.len() + key.seed.len());
    out.extend_from_slice(&key.generation.to_be_bytes());
    out.extend_from_slice(&(key.peer.len() as u16).to_be_bytes());
    out.extend_from_slice(key.peer.as_bytes());
    out.extend_from_slice(&key.seed);
    Ok(out)
}

/// Decodes the payload of a `kind` change request (a seed only with
/// CHANGES_START).
pub fn decode_change_key(kind: Kind, b: &[u8]) -> Result<ChangeKey, FrameError> {
    if b.len() > MAX_CHANGE_START_LEN {
        return Err(FrameError::BadPayload("change key too long"));
    }
    let Some((head, rest)) = b.split_first_chunk::<CHANGE_KEY_HEADER_LEN>() else {
        return Err(FrameError::BadPayload("change key shorter than its header"));
    };
    let generation = u64::from_be_bytes([
        head[0], head[1], head[2], head[3], head[4], head[5], head[6], head[7],
    ]);
    let len = usize::from(u16::from_be_bytes([head[8], head[9]]));
    if len == 0 || len > MAX_CHANGE_PEER_BYTES || len > rest.len() {
        return Err(FrameError::BadPayload("bad change peer name length"));
    }
    let (name, seed) = rest.split_at(len);
    if !seed.is_empty() && kind != Kind::ChangesStart {
        return Err(FrameError::BadPayload("only CHANGES_START carries a seed"));
    }
    let peer = std::str::from_utf8(name)
        .map_err(|_| FrameError::BadPayload("change peer name is not UTF-8"))?;
    Ok(ChangeKey {
        generation,
        peer: peer.to_string(),
        seed: seed.to_vec(),
    })
}

/// What a SNAPSHOT request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SnapshotOp {
    /// Freeze the live data as the snapshot; writes go to a new head.
    Create,
    /// Merge the snapshot into its child (in the background), then drop it.
    Delete,
    /// Make the live data the snapshot's; newer snapshots are dropped.
    Revert,
    /// Copy a clone's base into it (in the background), after which it
    /// stands alone; the name is its base's snapshot (version 7).
    Flatten,
}

impl SnapshotOp {
    pub fn to_wire(self) -> u8 {
        match self {
            SnapshotOp::Create => 1,
            SnapshotOp::Delete => 2,
            SnapshotOp::Revert => 3,
            SnapshotOp::Flatten => 4,
        }
    }

    pub fn from_wire(b: u8) -> Option<SnapshotOp> {
        Some(match b {
            1 => SnapshotOp::Create,
            2 => SnapshotOp::Delete,
            3 => SnapshotOp::Revert,
            4 => SnapshotOp::Flatten,
            _ => return None,
        })
    }
}

/// A SNAPSHOT request's payload: the op (u8), then the snapshot's name
/// (1 to [`MAX_SNAPSHOT_NAME_BYTES`] bytes of UTF-8; the replica checks
/// the chain's naming rule).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRequest {
    pub op: SnapshotOp,
    pub name: String,
}

/// Encodes a SNAPSHOT request's payload.
pub fn encode_snapshot_request(r: &SnapshotRequest) -> Result<Vec<u8>, FrameError> {
    if r.name.is_empty() || r.name.len() > MAX_SNAPSHOT_NAME_BYTES {
        return Err(FrameError::BadPayload(
            "snapshot name must be 1 to MAX_SNAPSHOT_NAME_BYTES bytes",
        ));
    }
    let mut out = Vec::with_capacity(1 + r.name.len());
    out.push(r.op.to_wire());
    out.extend_from_slice(r.name.as_bytes());
    Ok(out)
}

/// Decodes a SNAPSHOT request's payload.
pub fn decode_snapshot_request(b: &[u8]) -> Result<SnapshotRequest, FrameError> {
    let Some((&op, name)) = b.split_first() else {
        return Err(FrameError::BadPayload("empty SNAPSHOT payload"));
    };
    let op = SnapshotOp::from_wire(op).ok_or(FrameError::BadPayload("unknown SNAPSHOT op"))?;
    if name.is_empty() || name.len() > MAX_SNAPSHOT_NAME_BYTES {
        return Err(FrameError::BadPayload(
            "snapshot name must be 1 to MAX_SNAPSHOT_NAME_BYTES bytes",
        ));
    }
    let name = std::str::from_utf8(name)
        .map_err(|_| FrameError::BadPayload("snapshot name is not UTF-8"))?;
    Ok(SnapshotRequest {
        op,
        name: name.to_string(),
    })
}

/// A CLONE request's payload: the new replica's name
/// ([`check_replica_name`]).
pub fn encode_clone_request(name: &str) -> Result<Vec<u8>, FrameError> {
    check_replica_name(name).map_err(FrameError::BadPayload)?;
    Ok(name.as_bytes().to_vec())
}

/// Decodes a CLONE request's payload: the new replica's name.
pub fn decode_clone_request(b: &[u8]) -> Result<&str, FrameError> {
    let name =
        std::str::from_utf8(b).map_err(|_| FrameError::BadPayload("replica name is not UTF-8"))?;
    check_replica_name(name).map_err(FrameError::BadPayload)?;
    Ok(name)
}

/// One snapshot in a SNAPSHOT_LIST reply. Wire: created_unix u64,
/// allocated_bytes u64, merge_done u64, merge_total u64 (both 0 unless a
/// delete or a flatten is merging it), flags u32
/// ([`SNAPSHOT_FLAG_INHERITED`]), name length u16, the name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub name: String,
    /// Seconds since the Unix epoch when it was taken.
    pub created_unix: u64,
    /// Bytes its own layer holds.
    pub allocated_bytes: u64,
    /// A delete's merge: bytes copied so far and in all.
    pub merge_done: u64,
    pub merge_total: u64,
    /// A layer of the replica's base (it was cloned from another
    /// replica's snapshot): readable, never deleted or merged by this
    /// replica, and gone once it is flattened. Replicas of one volume
    /// compare only the snapshots they do not inherit.
    pub inherited: bool,
}

/// Encodes a SNAPSHOT_LIST reply payload: at most
/// [`MAX_SNAPSHOT_RECORDS`] records, names of 1 to
/// [`MAX_SNAPSHOT_NAME_BYTES`] bytes.
pub fn encode_snapshot_list(records: &[SnapshotRecord]) -> Result<Vec<u8>, FrameError> {
    if records.len() > MAX_SNAPSHOT_RECORDS {
        return Err(FrameError::BadPayload(
            "more than MAX_SNAPSHOT_RECORDS snapshots",
        ));
    }
    let mut out = Vec::new();
    for r in records {
        if r.name.is_empty() || r.name.len() > MAX_SNAPSHOT_NAME_BYTES {
            return Err(FrameError::BadPayload(
                "snapshot name must be 1 to MAX_SNAPSHOT_NAME_BYTES bytes",
            ));
        }
        for v in [
            r.created_unix,
            r.allocated_bytes,
            r.merge_done,
            r.merge_total,
        ] {
            out.extend_from_slice(&v.to_be_bytes());
        }
        let flags = if r.inherited {
            SNAPSHOT_FLAG_INHERITED
        } else {
            0
        };
        out.extend_from_slice(&flags.to_be_bytes());
        out.extend_from_slice(&(r.name.len() as u16).to_be_bytes());
        out.extend_from_slice(r.name.as_bytes());
    }
    Ok(out)
}

/// Decodes a SNAPSHOT_LIST reply payload.
pub fn decode_snapshot_list(mut b: &[u8]) -> Result<Vec<SnapshotRecord>, FrameError> {
    if b.len() > MAX_SNAPSHOT_LIST_BYTES as usize {
        return Err(FrameError::BadPayload("SNAPSHOT_LIST reply too long"));
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        if out.len() == MAX_SNAPSHOT_RECORDS {
            return Err(FrameError::BadPayload(
                "more than MAX_SNAPSHOT_RECORDS snapshots",
            ));
        }
        let Some((head, rest)) = b.split_first_chunk::<SNAPSHOT_RECORD_HEADER_LEN>() else {
            return Err(FrameError::BadPayload("snapshot record cut short"));
        };
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&head[i * 8..i * 8 + 8]);
            u64::from_be_bytes(w)
        };
        let flags = u32::from_be_bytes([head[32], head[33], head[34], head[35]]);
        if flags & !SNAPSHOT_FLAG_INHERITED != 0 {
            return Err(FrameError::BadPayload("unknown snapshot record flags"));
        }
        let len = usize::from(u16::from_be_bytes([head[36], head[37]]));
        if len == 0 || len > MAX_SNAPSHOT_NAME_BYTES || len > rest.len() {
            return Err(FrameError::BadPayload("bad snapshot name length"));
        }
        let (name, rest) = rest.split_at(len);
        let name = std::str::from_utf8(name)
            .map_err(|_| FrameError::BadPayload("snapshot name is not UTF-8"))?;
        out.push(SnapshotRecord {
            name: name.to_string(),
            created_unix: word(0),
            allocated_bytes: word(1),
            merge_done: word(2),
            merge_total: word(3),
            inherited: flags & SNAPSHOT_FLAG_INHERITED != 0,
        });
        b = rest;
    }
    Ok(out)
}

/// Encodes an INTENT_GET reply payload: flags, then the bitmap (bit `i`
/// of byte `i / 8`, least significant first, is region `i`).
pub fn encode_intent(flags: u64, bitmap: &[u8], out: &mut Vec<u8>) -> Result<(), FrameError> {
    if bitmap.len() > MAX_INTENT_BITMAP_BYTES {
        return Err(FrameError::TooLong {
            kind: Kind::IntentGet,
            length: u32::try_from(bitmap.len() + INTENT_HEADER_LEN).unwrap_or(u32::MAX),
        });
    }
    out.reserve(INTENT_HEADER_LEN + bitmap.len());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(bitmap);
    Ok(())
}

/// Decodes an INTENT_GET reply payload into (flags, bitmap).
pub fn decode_intent(b: &[u8]) -> Result<(u64, &[u8]), FrameError> {
    if b.len() > MAX_INTENT_GET_BYTES as usize {
        return Err(FrameError::TooLong {
            kind: Kind::IntentGet,
            length: u32::try_from(b.len()).unwrap_or(u32::MAX),
        });
    }
    let Some((flags, bitmap)) = b.split_first_chunk::<INTENT_HEADER_LEN>() else {
        return Err(FrameError::BadPayload(
            "INTENT_GET payload shorter than its header",
        ));
    };
    Ok((u64::from_be_bytes(*flags), bitmap))
}

/// Extents must be non-empty, sorted, non-overlapping, free of overflow
/// and at most [`MAX_EXTENTS_PER_REPLY`]; checked on both sides.
fn check_extents(ext: &[(u64, u64)]) -> Result<(), FrameError> {
    if ext.len() > MAX_EXTENTS_PER_REPLY {
        let length = u32::try_from(ext.len().saturating_mul(EXTENT_LEN)).unwrap_or(u32::MAX);
        return Err(FrameError::TooLong {
            kind: Kind::Extents,
            length,
        });
    }
    let mut floor = 0u64;
    for &(offset, length) in ext {
        if length == 0 {
            return Err(FrameError::BadPayload("empty extent"));
        }
        if offset < floor {
            return Err(FrameError::BadPayload("extents unsorted or overlapping"));
        }
        floor = offset
            .checked_add(length)
            .ok_or(FrameError::BadPayload("extent end overflows"))?;
    }
    Ok(())
}

/// Appends an EXTENTS reply payload (`16 × ext.len()` bytes) to `out`.
pub fn encode_extents(ext: &[(u64, u64)], out: &mut Vec<u8>) -> Result<(), FrameError> {
    check_extents(ext)?;
    out.reserve(ext.len() * EXTENT_LEN);
    for &(offset, length) in ext {
        out.extend_from_slice(&offset.to_be_bytes());
        out.extend_from_slice(&length.to_be_bytes());
    }
    Ok(())
}

/// Decodes an EXTENTS reply payload.
pub fn decode_extents(b: &[u8]) -> Result<Vec<(u64, u64)>, FrameError> {
    if b.len() > MAX_EXTENTS_BYTES as usize {
        let length = u32::try_from(b.len()).unwrap_or(u32::MAX);
        return Err(FrameError::TooLong {
            kind: Kind::Extents,
            length,
        });
    }
    if !b.len().is_multiple_of(EXTENT_LEN) {
        return Err(FrameError::BadPayload(
            "EXTENTS payload not a multiple of 16",
        ));
    }
    let ext: Vec<(u64, u64)> = b
        .chunks_exact(EXTENT_LEN)
        .map(|rec| {
            let mut o = [0u8; 8];
            let mut l = [0u8; 8];
            o.copy_from_slice(&rec[..8]);
            l.copy_from_slice(&rec[8..]);
            (u64::from_be_bytes(o), u64::from_be_bytes(l))
        })
        .collect();
    check_extents(&ext)?;
    Ok(ext)
}

/// One BLOCK_STATUS record: `length` bytes with [`STATUS_HOLE`] /
/// [`STATUS_ZERO`] flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusExtent {
    pub length: u64,
    pub flags: u32,
}

/// Records must number 1 to [`MAX_BLOCK_STATUS_PER_REPLY`], with no empty
/// length, only known flags, and a total that fits a u64; the caller
/// checks the total against its request.
fn check_status(ext: &[StatusExtent]) -> Result<(), FrameError> {
    if ext.len() > MAX_BLOCK_STATUS_PER_REPLY {
        let length = u32::try_from(ext.len().saturating_mul(STATUS_EXTENT_LEN)).unwrap_or(u32::MAX);
        return Err(FrameError::TooLong {
            kind: Kind::BlockStatus,
            length,
        });
    }
    if ext.is_empty() {
        return Err(FrameError::BadPayload("BLOCK_STATUS reply without extents"));
    }
    let mut total = 0u64;
    for e in ext {
        if e.length == 0 {
            return Err(FrameError::BadPayload("empty BLOCK_STATUS extent"));
        }
        if e.flags & !(STATUS_HOLE | STATUS_ZERO) != 0 {
            return Err(FrameError::BadPayload("unknown BLOCK_STATUS flags"));
        }
        total = total
            .checked_add(e.length)
            .ok_or(FrameError::BadPayload("BLOCK_STATUS extents overflow"))?;
    }
    Ok(())
}

/// Appends a BLOCK_STATUS reply payload (`16 × ext.len()` bytes) to `out`.
pub fn encode_block_status(ext: &[StatusExtent], out: &mut Vec<u8>) -> Result<(), FrameError> {
    check_status(ext)?;
    out.reserve(ext.len() * STATUS_EXTENT_LEN);
    for e in ext {
        out.extend_from_slice(&e.length.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes());
    }
    Ok(())
}

/// Decodes a BLOCK_STATUS reply payload.
pub fn decode_block_status(b: &[u8]) -> Result<Vec<StatusExtent>, FrameError> {
    if b.len() > MAX_BLOCK_STATUS_BYTES as usize {
        let length = u32::try_from(b.len()).unwrap_or(u32::MAX);
        return Err(FrameError::TooLong {
            kind: Kind::BlockStatus,
            length,
        });
    }
    if !b.len().is_multiple_of(STATUS_EXTENT_LEN) {
        return Err(FrameError::BadPayload(
            "BLOCK_STATUS payload not a multiple of 16",
        ));
    }
    let mut ext = Vec::with_capacity(b.len() / STATUS_EXTENT_LEN);
    for rec in b.chunks_exact(STATUS_EXTENT_LEN) {
        let mut length = [0u8; 8];
        let mut flags = [0u8; 4];
        let mut reserved = [0u8; 4];
        length.copy_from_slice(&rec[..8]);
        flags.copy_from_slice(&rec[8..12]);
        reserved.copy_from_slice(&rec[12..]);
        if reserved != [0; 4] {
            return Err(FrameError::BadPayload("BLOCK_STATUS reserved bits set"));
        }
        ext.push(StatusExtent {
            length: u64::from_be_bytes(length),
            flags: u32::from_be_bytes(flags),
        });
    }
    check_status(&ext)?;
    Ok(ext)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn enc(h: &Header) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        encode_header(h, &mut b).unwrap();
        b
    }

    #[test]
    fn layout_is_big_endian() {
        let h = Header {
            kind: Kind::Write,
            reply: false,
            id: 0x0102_0304_0506_0708,
            offset: 0x1112_1314_1516_1718,
            length: 0x2122,
            status: 0,
        };
        let b = enc(&h);
        assert_eq!(&b[0..4], b"LULR");
        assert_eq!(&b[4..8], &[0, 7, 0, 3]);
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(
            &b[16..24],
            &[0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18]
        );
        assert_eq!(&b[24..32], &[0, 0, 0x21, 0x22, 0, 0, 0, 0]);
        assert_eq!(decode_header(&b).unwrap(), h);
        assert_eq!(raw_id(&b), h.id);
        assert_eq!(payload_len(&h), 0x2122);
    }

    #[test]
    fn reply_flag() {
        let h = Header::request(Kind::Ping, 9, 0, 0).reply_with(0);
        let b = enc(&h);
        assert_eq!(u16::from_be_bytes([b[6], b[7]]), KIND_PING | REPLY_FLAG);
        assert_eq!(decode_header(&b).unwrap(), h);
    }

    #[test]
    fn refuses_bad_magic_version_kind() {
        let mut b = enc(&Header::request(Kind::Ping, 1, 0, 0));
        b[0] = b'X';
        assert!(matches!(decode_header(&b), Err(FrameError::BadMagic(_))));
        let mut b = enc(&Header::request(Kind::Ping, 1, 0, 0));
        b[5] = 1;
        assert_eq!(decode_header(&b), Err(FrameError::BadVersion(1)));
        assert_eq!(FrameError::BadVersion(1).errno(), libc::EPROTO);
        let mut b = enc(&Header::request(Kind::Ping, 1, 0, 0));
        b[7] = 0;
        assert_eq!(decode_header(&b), Err(FrameError::UnknownKind(0)));
        b[6] = 0x80;
        b[7] = 23;
        assert_eq!(decode_header(&b), Err(FrameError::UnknownKind(0x8017)));
        // The version before clones and GROW is refused, naming both.
        let mut b = enc(&Header::request(Kind::Hello, 1, 0, HELLO_LEN as u32));
        b[5] = 6;
        assert_eq!(decode_header(&b), Err(FrameError::BadVersion(6)));
        assert_eq!(
            FrameError::BadVersion(6).to_string(),
            "protocol version 6, expected 7"
        );
    }

    #[test]
    fn snapshot_requests_and_lists() {
        for op in [SnapshotOp::Create, SnapshotOp::Delete, SnapshotOp::Revert] {
            let r = SnapshotRequest {
                op,
                name: "daily-2026.11.27".into(),
            };
            let b = encode_snapshot_request(&r).unwrap();
            assert_eq!(decode_snapshot_request(&b).unwrap(), r);
            // The header check takes the payload's length.
            let h = Header::request(Kind::Snapshot, 9, 0, b.len() as u32);
            let mut wire = [0u8; HEADER_LEN];
            encode_header(&h, &mut wire).unwrap();
            assert_eq!(decode_header(&wire).unwrap(), h);
            assert_eq!(payload_len(&h), b.len());
            assert!(Kind::Snapshot.modifies());
        }
        let long = "x".repeat(MAX_SNAPSHOT_NAME_BYTES + 1);
        for name in ["", long.as_str()] {
            let r = SnapshotRequest {
                op: SnapshotOp::Create,
                name: name.into(),
            };
            assert!(encode_snapshot_request(&r).is_err(), "{name:?}");
        }
        assert!(decode_snapshot_request(&[9, b'a']).is_err(), "unknown op");
        assert!(decode_snapshot_request(&[1]).is_err(), "no name");
        assert!(decode_snapshot_request(&[1, 0xff]).is_err(), "not UTF-8");
        let mut too_long = [0u8; HEADER_LEN];
        let h = Header::request(Kind::Snapshot, 1, 0, MAX_SNAPSHOT_REQUEST_LEN as u32);
        encode_header(&h, &mut too_long).unwrap();
        too_long[24..28].copy_from_slice(&(MAX_SNAPSHOT_REQUEST_LEN as u32 + 1).to_be_bytes());
        assert!(decode_header(&too_long).is_err());

        let records: Vec<SnapshotRecord> = (0..MAX_SNAPSHOT_RECORDS)
            .map(|i| SnapshotRecord {
                name: format!("s{i}"),
                created_unix: 1_790_000_000 + i as u64,
                allocated_bytes: 4096 * i as u64,
                merge_done: i as u64,
                merge_total: 2 * i as u64,
                inherited: i % 3 == 0,
            })
            .collect();
        let b = encode_snapshot_list(&records).unwrap();
        assert_eq!(decode_snapshot_list(&b).unwrap(), records);
        assert_eq!(decode_snapshot_list(&[]).unwrap(), vec![]);
        assert!(
            decode_snapshot_list(&b[..b.len() - 1]).is_err(),
            "cut short"
        );
        let mut more = records.clone();
        more.push(records[0].clone());
        assert!(encode_snapshot_list(&more).is_err());
        // A flag this version does not know is refused, not ignored.
        let mut unknown = encode_snapshot_list(&records[..1]).unwrap();
        unknown[35] |= 2;
        assert!(decode_snapshot_list(&unknown).is_err());
        let full = vec![
            SnapshotRecord {
                name: "n".repeat(MAX_SNAPSHOT_NAME_BYTES),
                created_unix: 0,
                allocated_bytes: 0,
                merge_done: 0,
                merge_total: 0,
                inherited: true,
            };
            MAX_SNAPSHOT_RECORDS
        ];
        assert_eq!(
            encode_snapshot_list(&full).unwrap().len(),
            MAX_SNAPSHOT_LIST_BYTES as usize
        );
        // A reply header with the list's length passes; an error reply
        // with a payload does not.
        let reply = Header::request(Kind::SnapshotList, 3, 0, 0).reply_with(0);
        let ok = Header {
            length: b.len() as u32,
            ..reply
        };
        let mut wire = [0u8; HEADER_LEN];
        encode_header(&ok, &mut wire).unwrap();
        assert_eq!(payload_len(&decode_header(&wire).unwrap()), b.len());
        let bad = Header {
            status: 5,
            length: 10,
            ..reply
        };
        assert!(encode_header(&bad, &mut wire).is_err());
    }

    #[test]
    fn clone_requests() {
        let b = encode_clone_request("pvc-2.r0").unwrap();
        assert_eq!(decode_clone_request(&b).unwrap(), "pvc-2.r0");
        assert!(encode_clone_request("").is_err());
        assert!(encode_clone_request("a/b").is_err());
        assert!(decode_clone_request(b"a@b").is_err(), "an @ names a view");
        assert!(decode_clone_request(&[0xff]).is_err(), "not UTF-8");
        let h = Header::request(Kind::Clone, 4, 0, b.len() as u32);
        let mut wire = [0u8; HEADER_LEN];
        encode_header(&h, &mut wire).unwrap();
        assert_eq!(payload_len(&decode_header(&wire).unwrap()), b.len());
        for len in [0, MAX_REPLICA_NAME_BYTES + 1] {
            let bad = Header::request(Kind::Clone, 4, 0, len as u32);
            assert!(encode_header(&bad, &mut wire).is_err(), "{len}");
        }
        assert_eq!(
            SnapshotOp::from_wire(SnapshotOp::Flatten.to_wire()),
            Some(SnapshotOp::Flatten)
        );
    }

    #[test]
    fn change_keys_and_regions() {
        let key = ChangeKey {
            generation: 7,
            peer: "r1@10.0.0.2:10900".into(),
            seed: Vec::new(),
        };
        let wire = encode_change_key(&key).unwrap();
        assert_eq!(&wire[..10], &[0, 0, 0, 0, 0, 0, 0, 7, 0, 17]);
        assert_eq!(decode_change_key(Kind::ChangesGet, &wire).unwrap(), key);
        let seeded = ChangeKey {
            seed: vec![0xff; 2048],
            ..key.clone()
        };
        let seeded_wire = encode_change_key(&seeded).unwrap();
        assert_eq!(
            decode_change_key(Kind::ChangesStart, &seeded_wire).unwrap(),
            seeded
        );
        assert!(decode_change_key(Kind::ChangesDrop, &seeded_wire).is_err());
        let h = Header::request(Kind::ChangesStart, 1, 0, MAX_CHANGE_START_LEN as u32);
        assert_eq!(decode_header(&enc(&h)).unwrap(), h);
        let len = wire.len() as u32;
        for kind in [Kind::ChangesStart, Kind::ChangesGet, Kind::ChangesDrop] {
            let h = Header::request(kind, 1, 0, len);
            assert_eq!(decode_header(&enc(&h)).unwrap(), h);
            assert_eq!(payload_len(&h), wire.len());
            let mut out = [0u8; HEADER_LEN];
            let max = if kind == Kind::ChangesStart {
                MAX_CHANGE_START_LEN
            } else {
                MAX_CHANGE_KEY_LEN
            };
            for bad in [0, 10, max as u32 + 1] {
                let h = Header::request(kind, 1, 0, bad);
                assert!(encode_header(&h, &mut out).is_err(), "{kind:?} {bad}");
            }
        }
        // Replies: only CHANGES_GET carries a payload, the bitmap.
        let get = Header::request(Kind::ChangesGet, 1, 0, len);
        let mut ok = get.reply_with(0);
        ok.offset = CHANGE_REGION_MIN_BYTES;
        ok.length = MAX_CHANGE_BITMAP_BYTES;
        assert_eq!(
            payload_len(&decode_header(&enc(&ok)).unwrap()),
            MAX_CHANGE_BITMAP_BYTES as usize
        );
        let mut out = [0u8; HEADER_LEN];
        ok.length += 1;
        assert!(encode_header(&ok, &mut out).is_err());
        let stale = get.reply_with(libc::ESTALE as u32);
        assert_eq!(payload_len(&stale), 0);
        let start = Header::request(Kind::ChangesStart, 1, 0, len).reply_with(0);
        assert_eq!((start.length, payload_len(&start)), (0, 0));
        assert!(Kind::ChangesStart.modifies() && Kind::ChangesDrop.modifies());
        assert!(!Kind::ChangesGet.modifies());
        // Bad payloads.
        assert!(decode_change_key(Kind::ChangesGet, &wire[..10]).is_err());
        assert!(decode_change_key(Kind::ChangesGet, &wire[..wire.len() - 1]).is_err());
        assert!(
            decode_change_key(Kind::ChangesGet, &[0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0xff]).is_err()
        );
        let empty = ChangeKey {
            peer: String::new(),
            ..key.clone()
        };
        assert!(encode_change_key(&empty).is_err());
        let long = ChangeKey {
            peer: "x".repeat(MAX_CHANGE_PEER_BYTES + 1),
            ..key.clone()
        };
        assert!(encode_change_key(&long).is_err());
        // Geometry: 64 KiB up to 64 GiB, then powers of two; never more
        // than MAX_CHANGE_REGIONS.
        assert_eq!(change_region_bytes(1 << 30), 64 << 10);
        assert_eq!(change_regions(1 << 30), 16384);
        assert_eq!(change_region_bytes(64 << 30), 64 << 10);
        assert_eq!(change_region_bytes((64 << 30) + 1), 128 << 10);
        assert_eq!(change_regions(1 << 40), MAX_CHANGE_REGIONS);
        assert_eq!(change_regions(1), 1);
        assert!(change_regions(u64::MAX) <= MAX_CHANGE_REGIONS);
    }

    #[test]
    fn limits_both_ways() {
        let mut out = [0u8; HEADER_LEN];
        for kind in [Kind::Read, Kind::Write, Kind::WriteFua] {
            let ok = Header::request(kind, 1, 0, MAX_IO_BYTES);
            assert!(encode_header(&ok, &mut out).is_ok());
            let bad = Header::request(kind, 1, 0, MAX_IO_BYTES + 1);
            assert_eq!(
                encode_header(&bad, &mut out),
                Err(FrameError::TooLong {
                    kind,
                    length: MAX_IO_BYTES + 1
                })
            );
            // Same bytes forged on the wire are refused by decode.
            let mut raw = enc(&ok);
            raw[24..28].copy_from_slice(&(MAX_IO_BYTES + 1).to_be_bytes());
            assert!(matches!(
                decode_header(&raw),
                Err(FrameError::TooLong { .. })
            ));
        }
        assert!(encode_header(&Header::request(Kind::Hello, 1, 0, 31), &mut out).is_err());
        assert!(encode_header(&Header::request(Kind::Flush, 1, 0, 1), &mut out).is_err());
        assert!(encode_header(&Header::request(Kind::Trim, 1, 0, u32::MAX), &mut out).is_ok());
        assert!(encode_header(&Header::request(Kind::Extents, 1, 0, u32::MAX), &mut out).is_ok());
        let mut ext = Header::request(Kind::Extents, 1, 0, 0).reply_with(0);
        ext.length = MAX_EXTENTS_BYTES;
        assert!(encode_header(&ext, &mut out).is_ok());
        ext.length += 16;
        assert!(encode_header(&ext, &mut out).is_err());
        ext.length = 17;
        assert!(encode_header(&ext, &mut out).is_err());
        let mut req = Header::request(Kind::Read, 1, 0, 0);
        req.status = 5;
        assert!(encode_header(&req, &mut out).is_err());
    }

    #[test]
    fn payload_lengths() {
        let read = Header::request(Kind::Read, 1, 0, 4096);
        assert_eq!(payload_len(&read), 0);
        assert_eq!(payload_len(&read.reply_with(0)), 4096);
        assert_eq!(payload_len(&read.reply_with(libc::EIO as u32)), 0);
        let write = Header::request(Kind::WriteFua, 1, 0, 512);
        assert_eq!(payload_len(&write), 512);
        assert_eq!(payload_len(&write.reply_with(0)), 0);
        let hello = Header::request(Kind::Hello, 1, 0, HELLO_LEN as u32);
        assert_eq!(payload_len(&hello), HELLO_LEN);
        assert_eq!(
            payload_len(&hello.reply_with(libc::EPROTO as u32)),
            HELLO_LEN
        );
        let trim = Header::request(Kind::Trim, 1, 0, 1 << 30);
        assert_eq!(payload_len(&trim), 0);
    }

    #[test]
    fn refusal_decodes() {
        let mut out = [0u8; HEADER_LEN];
        encode_refusal(42, libc::EPROTO as u32, &mut out);
        let h = decode_header(&out).unwrap();
        assert_eq!(
            (h.kind, h.reply, h.id, h.status),
            (Kind::Hello, true, 42, libc::EPROTO as u32)
        );
        assert_eq!(payload_len(&h), HELLO_LEN);
    }

    #[test]
    fn hello_round_trip() {
        let h = Hello {
            volume_size: 1 << 40,
            generation: 3,
            flags: HELLO_FLAG_ATTACH,
            session: 0xdead_beef,
        };
        assert_eq!(decode_hello(&encode_hello(&h)).unwrap(), h);
        assert!(decode_hello(&[0; 31]).is_err());
        assert!(decode_hello(&[0; 33]).is_err());
    }

    #[test]
    fn changed_requests_round_trip_and_bad_ones_are_refused() {
        let r = ChangedRequest {
            length: 1 << 20,
            since: "s1".into(),
        };
        let p = encode_changed_request(&r).unwrap();
        assert_eq!(decode_changed_request(&p).unwrap(), r);
        let mut out = [0u8; HEADER_LEN];
        let req = Header::request(Kind::Changed, 9, 4096, p.len() as u32);
        encode_header(&req, &mut out).unwrap();
        let got = decode_header(&out).unwrap();
        assert_eq!(payload_len(&got), p.len());
        // The reply: records like BLOCK_STATUS's, the offset echoed.
        let mut reply = req.reply_with(0);
        assert_eq!((reply.offset, reply.length), (4096, 0));
        reply.length = 2 * STATUS_EXTENT_LEN as u32;
        encode_header(&reply, &mut out).unwrap();
        assert_eq!(payload_len(&decode_header(&out).unwrap()), 32);
        reply.length = 17;
        assert!(
            encode_header(&reply, &mut out).is_err(),
            "not whole records"
        );
        for bad in [&b""[..], b"\0\0\0\x01", b"\0\0\0\x01.s", b"\0\0\0\x01a@b"] {
            assert!(decode_changed_request(bad).is_err(), "{bad:?} accepted");
        }
        for len in [CHANGED_HEADER_LEN, MAX_CHANGED_REQUEST_LEN + 1] {
            let h = Header::request(Kind::Changed, 1, 0, len as u32);
            assert!(encode_header(&h, &mut out).is_err(), "length {len}");
        }
        assert!(encode_changed_request(&ChangedRequest {
            length: 1,
            since: "a".repeat(MAX_SNAPSHOT_NAME_BYTES + 1)
        })
        .is_err());
    }

    #[test]
    fn hello_request_names_a_replica() {
        let h = Hello {
            volume_size: 1 << 30,
            generation: 1,
            flags: 0,
            session: 7,
        };
        let named = encode_hello_request(&h, "pvc-1.r0");
        assert_eq!(decode_hello_request(&named).unwrap(), (h, "pvc-1.r0"));
        assert_eq!(decode_hello_request(&encode_hello(&h)).unwrap(), (h, ""));
        let longest = view_hello_name(
            &"a".repeat(MAX_REPLICA_NAME_BYTES),
            &"s".repeat(MAX_SNAPSHOT_NAME_BYTES),
        );
        let frame = encode_hello_request(&h, &longest);
        assert_eq!(frame.len(), MAX_HELLO_REQUEST_LEN);
        // A view: the replica's name (or none), '@', the snapshot's.
        for (name, replica, snapshot) in [
            ("r0@s1", "r0", Some("s1")),
            ("@daily:2026-11-27", "", Some("daily:2026-11-27")),
            ("r0", "r0", None),
        ] {
            let p = encode_hello_request(&h, name);
            assert_eq!(decode_hello_request(&p).unwrap(), (h, name));
            assert_eq!(split_hello_name(name), (replica, snapshot));
        }
        assert!(decode_hello_request(&frame).is_ok());
        let mut too_long = frame.clone();
        too_long.push(b'a');
        assert!(decode_hello_request(&too_long).is_err());
        for bad in [
            "..", ".hidden", "a/b", "a\0b", "é", "-x", "a b", "r0@", "r0@.s", "r0@s/1", "r0@s@t",
            "@",
        ] {
            let mut p = encode_hello(&h).to_vec();
            p.extend_from_slice(bad.as_bytes());
            assert!(decode_hello_request(&p).is_err(), "{bad:?} accepted");
            assert!(check_replica_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(check_replica_name("").is_err());
        assert!(check_replica_name(&"a".repeat(300)).is_err());
        // Headers: a request's length says how long the name is; a reply's
        // is always the bare record.
        let mut out = [0u8; HEADER_LEN];
        let req = Header::request(Kind::Hello, 1, 0, named.len() as u32);
        encode_header(&req, &mut out).unwrap();
        assert_eq!(payload_len(&decode_header(&out).unwrap()), named.len());
        let long = Header::request(Kind::Hello, 1, 0, MAX_HELLO_REQUEST_LEN as u32 + 1);
        assert!(encode_header(&long, &mut out).is_err());
        let mut reply = req.reply_with(0);
        assert_eq!(reply.length as usize, HELLO_LEN);
        reply.length = named.len() as u32;
        assert!(encode_header(&reply, &mut out).is_err());
    }

    #[test]
    fn extents_checks() {
        let mut out = Vec::new();
        encode_extents(&[(0, 4096), (8192, 4096)], &mut out).unwrap();
        assert_eq!(out.len(), 32);
        assert_eq!(decode_extents(&out).unwrap(), vec![(0, 4096), (8192, 4096)]);
        assert!(encode_extents(&[(0, 0)], &mut out).is_err());
        assert!(encode_extents(&[(4096, 10), (0, 10)], &mut out).is_err());
        assert!(encode_extents(&[(0, 10), (5, 10)], &mut out).is_err());
        assert!(encode_extents(&[(u64::MAX, 2)], &mut out).is_err());
        let many = vec![(0u64, 1u64); MAX_EXTENTS_PER_REPLY + 1];
        assert!(matches!(
            encode_extents(&many, &mut out),
            Err(FrameError::TooLong { .. })
        ));
        assert!(decode_extents(&[0; 15]).is_err());
        assert!(decode_extents(&vec![0; MAX_EXTENTS_BYTES as usize + 16]).is_err());
        assert_eq!(decode_extents(&[]).unwrap(), vec![]);
    }

    #[test]
    fn block_status_checks() {
        let ext = [
            StatusExtent {
                length: 4096,
                flags: STATUS_HOLE | STATUS_ZERO,
            },
            StatusExtent {
                length: 1 << 20,
                flags: 0,
            },
        ];
        let mut out = Vec::new();
        encode_block_status(&ext, &mut out).unwrap();
        assert_eq!(out.len(), 32);
        assert_eq!(&out[..8], &4096u64.to_be_bytes());
        assert_eq!(&out[8..12], &3u32.to_be_bytes());
        assert_eq!(decode_block_status(&out).unwrap(), ext.to_vec());
        let bad = |length, flags| [StatusExtent { length, flags }];
        assert!(encode_block_status(&bad(0, 0), &mut out).is_err());
        assert!(encode_block_status(&bad(1, 4), &mut out).is_err());
        assert!(encode_block_status(&[], &mut out).is_err());
        let overflow = [bad(u64::MAX, 0)[0], bad(1, 0)[0]];
        assert!(encode_block_status(&overflow, &mut out).is_err());
        let many = vec![bad(1, 0)[0]; MAX_BLOCK_STATUS_PER_REPLY + 1];
        assert!(matches!(
            encode_block_status(&many, &mut out),
            Err(FrameError::TooLong { .. })
        ));
        let mut reserved = Vec::new();
        encode_block_status(&bad(1, 0), &mut reserved).unwrap();
        reserved[15] = 1;
        assert!(decode_block_status(&reserved).is_err());
        assert!(decode_block_status(&[]).is_err());
        assert!(decode_block_status(&[0; 15]).is_err());
        assert!(decode_block_status(&vec![0; MAX_BLOCK_STATUS_BYTES as usize + 16]).is_err());
        // Header limits: a reply of at most MAX_BLOCK_STATUS_BYTES, in
        // whole records, with no payload on error.
        let mut h = [0u8; HEADER_LEN];
        let req = Header::request(Kind::BlockStatus, 1, 4096, u32::MAX);
        assert!(encode_header(&req, &mut h).is_ok());
        assert_eq!(payload_len(&req), 0);
        let mut rep = req.reply_with(0);
        assert_eq!((rep.offset, rep.length), (4096, 0));
        rep.length = MAX_BLOCK_STATUS_BYTES;
        assert!(encode_header(&rep, &mut h).is_ok());
        assert_eq!(payload_len(&rep), MAX_BLOCK_STATUS_BYTES as usize);
        rep.length += 16;
        assert!(encode_header(&rep, &mut h).is_err());
        rep.length = 17;
        assert!(encode_header(&rep, &mut h).is_err());
        let mut err = req.reply_with(libc::EIO as u32);
        assert!(encode_header(&err, &mut h).is_ok());
        assert_eq!(payload_len(&err), 0);
        err.length = 16;
        assert!(encode_header(&err, &mut h).is_err());
        assert!(!Kind::BlockStatus.modifies());
    }

    #[test]
    fn grow_frames_and_regions() {
        let req = Header::request(Kind::Grow, 3, 2 << 30, 0);
        let mut h = [0u8; HEADER_LEN];
        assert!(encode_header(&req, &mut h).is_ok());
        assert_eq!(decode_header(&h).ok(), Some(req));
        assert_eq!(payload_len(&req), 0);
        let reply = req.reply_with(0);
        assert_eq!((reply.offset, reply.length), (2 << 30, 0));
        assert!(Kind::Grow.modifies());
        let mut bad = req;
        bad.length = 1;
        assert!(
            encode_header(&bad, &mut h).is_err(),
            "GROW carries no payload"
        );
        // Up to 64 GiB both region sizes stay the smallest.
        assert!(grow_keeps_regions(1 << 20, 64 << 30));
        assert!(!grow_keeps_regions(1 << 30, (64 << 30) + 4096));
        assert!(grow_keeps_regions(100 << 30, 128 << 30));
        assert!(!grow_keeps_regions(100 << 30, (128 << 30) + 4096));
    }

    #[test]
    fn intent_regions_and_limits() {
        assert_eq!(intent_region_bytes(1 << 30), INTENT_REGION_MIN_BYTES);
        assert_eq!(intent_regions(1 << 30), 256);
        assert_eq!(intent_regions(1), 1);
        assert_eq!(intent_regions(64 << 30), MAX_INTENT_REGIONS);
        assert_eq!(intent_region_bytes((64 << 30) + 512), 8 << 20);
        assert!(intent_regions((64 << 30) + 512) <= MAX_INTENT_REGIONS);
        assert!(intent_regions(u64::MAX) <= MAX_INTENT_REGIONS);
        assert_eq!(intent_bitmap_bytes(1 << 30), 32);
        let mut out = [0u8; HEADER_LEN];
        let ok = Header::request(Kind::IntentMark, 1, 0, MAX_INTENT_REGIONS);
        assert!(encode_header(&ok, &mut out).is_ok());
        let bad = Header::request(Kind::IntentClear, 1, 1, MAX_INTENT_REGIONS);
        assert!(encode_header(&bad, &mut out).is_err());
        assert!(encode_header(&Header::request(Kind::Detach, 1, 0, 1), &mut out).is_err());
        assert!(encode_header(&Header::request(Kind::IntentGet, 1, 0, 1), &mut out).is_err());
        let mut get = Header::request(Kind::IntentGet, 1, 0, 0).reply_with(0);
        get.length = MAX_INTENT_GET_BYTES;
        assert!(encode_header(&get, &mut out).is_ok());
        assert_eq!(payload_len(&get), MAX_INTENT_GET_BYTES as usize);
        get.length += 1;
        assert!(encode_header(&get, &mut out).is_err());
        get.length = 4;
        assert!(encode_header(&get, &mut out).is_err());
        let mut payload = Vec::new();
        encode_intent(INTENT_FLAG_LOST, &[0xff, 0x01], &mut payload).unwrap();
        assert_eq!(
            decode_intent(&payload).unwrap(),
            (INTENT_FLAG_LOST, &[0xff, 0x01][..])
        );
        assert!(decode_intent(&[0; 7]).is_err());
        assert!(encode_intent(0, &[0; MAX_INTENT_BITMAP_BYTES + 1], &mut payload).is_err());
        assert!(
            Kind::IntentMark.modifies() && !Kind::IntentGet.modifies() && !Kind::Detach.modifies()
        );
    }

    fn any_kind() -> impl Strategy<Value = Kind> {
        proptest::sample::select(Kind::ALL.to_vec())
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::array::uniform32(any::<u8>())) {
            if let Ok(h) = decode_header(&bytes) {
                let mut again = [0u8; HEADER_LEN];
                encode_header(&h, &mut again).unwrap();
                prop_assert_eq!(again, bytes);
                prop_assert!(payload_len(&h) <= MAX_IO_BYTES as usize);
            }
        }

        #[test]
        fn decode_valid_prefix_never_panics(
            kind in any::<u16>(), id in any::<u64>(), offset in any::<u64>(),
            length in any::<u32>(), status in any::<u32>(),
        ) {
            let mut b = [0u8; HEADER_LEN];
            b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
            b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
            b[6..8].copy_from_slice(&kind.to_be_bytes());
            b[8..16].copy_from_slice(&id.to_be_bytes());
            b[16..24].copy_from_slice(&offset.to_be_bytes());
            b[24..28].copy_from_slice(&length.to_be_bytes());
            b[28..32].copy_from_slice(&status.to_be_bytes());
            match decode_header(&b) {
                Ok(h) => {
                    let mut again = [0u8; HEADER_LEN];
                    encode_header(&h, &mut again).unwrap();
                    prop_assert_eq!(again, b);
                    prop_assert!(payload_len(&h) <= MAX_IO_BYTES as usize);
                }
                Err(e) => prop_assert!(e.errno() > 0),
            }
        }

        #[test]
        fn encode_decode_round_trip(
            kind in any_kind(), reply in any::<bool>(), id in any::<u64>(),
            offset in any::<u64>(), length in any::<u32>(), status in any::<u32>(),
        ) {
            let h = Header { kind, reply, id, offset, length, status: if reply { status } else { 0 } };
            let mut b = [0u8; HEADER_LEN];
            match encode_header(&h, &mut b) {
                Ok(()) => prop_assert_eq!(decode_header(&b).unwrap(), h),
                Err(e) => {
                    // Whatever encode refuses, decode refuses too.
                    let code = kind.to_wire() | if reply { REPLY_FLAG } else { 0 };
                    b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
                    b[4..6].copy_from_slice(&PROTOCOL_VERSION.to_be_bytes());
                    b[6..8].copy_from_slice(&code.to_be_bytes());
                    b[8..16].copy_from_slice(&id.to_be_bytes());
                    b[16..24].copy_from_slice(&offset.to_be_bytes());
                    b[24..28].copy_from_slice(&length.to_be_bytes());
                    b[28..32].copy_from_slice(&h.status.to_be_bytes());
                    prop_assert_eq!(decode_header(&b), Err(e));
                }
            }
        }

        #[test]
        fn hello_round_trips(v in any::<u64>(), g in any::<u64>(), f in any::<u64>(), s in any::<u64>()) {
            let h = Hello { volume_size: v, generation: g, flags: f, session: s };
            prop_assert_eq!(decode_hello(&encode_hello(&h)).unwrap(), h);
        }

        #[test]
        fn extents_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(ext) = decode_extents(&bytes) {
                let mut out = Vec::new();
                encode_extents(&ext, &mut out).unwrap();
                prop_assert_eq!(out, bytes);
            }
        }

        #[test]
        fn snapshot_list_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Ok(records) = decode_snapshot_list(&bytes) {
                prop_assert_eq!(encode_snapshot_list(&records).unwrap(), bytes);
            }
        }

        #[test]
        fn snapshot_request_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..260)) {
            if let Ok(r) = decode_snapshot_request(&bytes) {
                prop_assert_eq!(encode_snapshot_request(&r).unwrap(), bytes);
            }
        }

        #[test]
        fn block_status_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            if let Ok(ext) = decode_block_status(&bytes) {
                let mut out = Vec::new();
                encode_block_status(&ext, &mut out).unwrap();
                prop_assert_eq!(out, bytes);
            }
        }

        #[test]
        fn extents_round_trip(gaps in proptest::collection::vec((0u64..1 << 20, 1u64..1 << 20), 0..=MAX_EXTENTS_PER_REPLY)) {
            let mut at = 0u64;
            let ext: Vec<(u64, u64)> = gaps.into_iter().map(|(gap, len)| {
                let e = (at + gap, len);
                at = e.0 + len;
                e
            }).collect();
            let mut out = Vec::new();
            encode_extents(&ext, &mut out).unwrap();
            prop_assert_eq!(out.len(), ext.len() * EXTENT_LEN);
            prop_assert_eq!(decode_extents(&out).unwrap(), ext);
        }
    }
}
