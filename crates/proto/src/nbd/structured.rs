//! Structured replies (`NBD_OPT_STRUCTURED_REPLY`) and block status
//! (`base:allocation` and lull's `lull:changed:SNAPSHOT`), as pure
//! encoders and decoders.
//!
//! A structured reply is one or more chunks, each a 20-byte header (magic,
//! flags, type, cookie, payload length) and a payload; the last chunk of a
//! reply carries `NBD_REPLY_FLAG_DONE`.
//!
//! ```
//! use lull_proto::nbd::{self, structured::{self, ReadPiece}};
//!
//! // A 12 KiB read at 1 MiB whose middle 4 KiB the device knows to be a
//! // hole (and which did read as zeros): data, hole, data.
//! let mut data = vec![7u8; 12 * 1024];
//! data[4096..8192].fill(0);
//! let pieces = structured::plan_read(&data, &[(4096, 4096)], structured::MAX_READ_CHUNKS);
//! assert_eq!(
//!     pieces,
//!     [
//!         ReadPiece::Data { at: 0, len: 4096 },
//!         ReadPiece::Hole { at: 4096, len: 4096 },
//!         ReadPiece::Data { at: 8192, len: 4096 },
//!     ]
//! );
//! // The last chunk carries DONE.
//! let hole = structured::encode_offset_hole(9, 0, (1 << 20) + 4096, 4096);
//! let header = structured::decode_chunk_header(hole[..20].try_into().unwrap()).unwrap();
//! assert_eq!(header.reply_type, nbd::NBD_REPLY_TYPE_OFFSET_HOLE);
//! assert_eq!(header.length, 12);
//! ```

use super::{
    NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_BLOCK_STATUS, NBD_REPLY_TYPE_ERROR, NBD_REPLY_TYPE_NONE,
    NBD_REPLY_TYPE_OFFSET_DATA, NBD_REPLY_TYPE_OFFSET_HOLE, NBD_STRUCTURED_REPLY_MAGIC,
};

/// Chunk header: magic, flags, type, cookie, payload length.
pub const CHUNK_HEADER_LEN: usize = 4 + 2 + 2 + 8 + 4;
/// An `NBD_REPLY_TYPE_OFFSET_DATA` chunk up to its data: header, offset.
pub const OFFSET_DATA_HEADER_LEN: usize = CHUNK_HEADER_LEN + 8;
/// A whole `NBD_REPLY_TYPE_OFFSET_HOLE` chunk: header, offset, length.
pub const OFFSET_HOLE_LEN: usize = CHUNK_HEADER_LEN + 8 + 4;

/// `base:allocation` extent flag: the range is not allocated.
pub const NBD_STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` extent flag: the range reads as zeros.
pub const NBD_STATE_ZERO: u32 = 1 << 1;

/// The spec's allocation context.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// The id lull gives `base:allocation` in `NBD_REP_META_CONTEXT`; the spec
/// leaves ids to the server, which only needs them distinct.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// lull's own namespace of metadata contexts. The spec asks a server to
/// document its namespace's queries: `lull:` and `lull:changed:` list
/// every `lull:changed:SNAPSHOT` of the export (LIST only; SET selects
/// nothing with them, as the spec recommends for an empty leaf-name);
/// `lull:changed:SNAPSHOT` names one. Any other `lull:` leaf is an
/// unknown context, ignored.
pub const LULL_NAMESPACE: &str = "lull:";
/// `lull:changed:SNAPSHOT`: which bytes of the export were written (or
/// trimmed, or zeroed) after SNAPSHOT was taken. On a snapshot's export
/// (`vol@s2`) "after" ends at that snapshot, so `lull:changed:s1` there is
/// what changed between s1 and s2: what an incremental backup copies.
pub const LULL_CHANGED_PREFIX: &str = "lull:changed:";
/// The id lull gives the `lull:changed:` context a client selected. A
/// connection has at most one (see `nbd::Negotiated::changed`), so one id
/// serves every snapshot's context.
pub const LULL_CHANGED_ID: u32 = 2;
const _: () = assert!(LULL_CHANGED_ID != BASE_ALLOCATION_ID);
/// `lull:changed:` extent flag: the range changed since the snapshot; a
/// range without it did not.
pub const LULL_STATE_CHANGED: u32 = 1 << 0;
/// Characters no snapshot name holds (the volume registry's separator in
/// `VOLUME@SNAPSHOT` export names, and a path separator): a
/// `lull:changed:` query naming one is malformed (`NBD_REP_ERR_INVALID`),
/// not merely unknown.
pub const SNAPSHOT_NAME_FORBIDDEN: [char; 2] = ['@', '/'];
/// Longest snapshot name a `lull:changed:` context can carry: the whole
/// context name is an NBD string, at most [`super::MAX_STRING_LEN`]
/// bytes. A longer snapshot is never listed (no query could name it).
pub const MAX_CHANGED_SNAPSHOT_NAME_LEN: usize = super::MAX_STRING_LEN - LULL_CHANGED_PREFIX.len();
/// Most `lull:changed:` contexts one `NBD_OPT_LIST_META_CONTEXT` answer
/// lists (a wildcard query or no query). A real chain of snapshots is far
/// shorter and is listed whole; the cap bounds what a device with a very
/// long chain makes one answer cost: at most 256 replies of at most
/// 4 KiB + 24 bytes, about 1 MiB with maximal names (a few KiB with real
/// ones). The spec lets a server list fewer than every context; a
/// snapshot past the cap is still listed for its exact name and can be
/// selected.
pub const MAX_LISTED_CHANGED_CONTEXTS: usize = 256;

/// Most extents in one `NBD_REPLY_TYPE_BLOCK_STATUS` chunk. The spec lets
/// a server describe only a prefix of the range (the client asks again
/// from where the reply ended), so a reply's size need not follow the
/// request's length: 1,024 extents are an 8 KiB payload, a bounded cost
/// per request however fragmented the device, and enough that a map of a
/// well-sparse volume takes few round trips (qemu-nbd caps at similar
/// sizes; nbdkit at 2^20 extents, which lull does not need).
pub const MAX_BLOCK_STATUS_EXTENTS: usize = 1024;

/// Most chunks one read reply is split into. Each chunk costs a header
/// and, for data between holes, a copy out of the read buffer; a read
/// fragmented beyond this sends its tail as one data chunk, which is
/// always correct (holes are an optimisation of the wire, never needed).
pub const MAX_READ_CHUNKS: usize = 64;

/// Shortest run of zeros sent as a hole chunk: below this the 32-byte hole
/// chunk and the split data chunk around it cost about what they save.
pub const MIN_HOLE_BYTES: u32 = 4096;

/// Most queries in one `NBD_OPT_LIST_META_CONTEXT` or
/// `NBD_OPT_SET_META_CONTEXT`. The option length cap already bounds the
/// work; this says sooner what a real client needs (qemu sends one or two)
/// and refuses the rest with `NBD_REP_ERR_TOO_BIG`.
pub const MAX_META_QUERIES: u32 = 32;

/// A decoded chunk header (the client side: tests, tools).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    pub flags: u16,
    pub reply_type: u16,
    pub cookie: u64,
    /// Payload bytes after the header.
    pub length: u32,
}

/// Encodes a chunk header.
pub fn encode_chunk_header(header: &ChunkHeader) -> [u8; CHUNK_HEADER_LEN] {
    let mut out = [0u8; CHUNK_HEADER_LEN];
    out[0..4].copy_from_slice(&NBD_STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&header.flags.to_be_bytes());
    out[6..8].copy_from_slice(&header.reply_type.to_be_bytes());
    out[8..16].copy_from_slice(&header.cookie.to_be_bytes());
    out[16..20].copy_from_slice(&header.length.to_be_bytes());
    out
}

/// Decodes a chunk header; `None` when the magic is wrong.
pub fn decode_chunk_header(buf: &[u8; CHUNK_HEADER_LEN]) -> Option<ChunkHeader> {
    let mut r = super::Reader::new(buf);
    let magic = r.u32()?;
    let header = ChunkHeader {
        flags: r.u16()?,
        reply_type: r.u16()?,
        cookie: r.u64()?,
        length: r.u32()?,
    };
    (magic == NBD_STRUCTURED_REPLY_MAGIC).then_some(header)
}

/// The header of an offset-data chunk carrying `data_len` bytes read at
/// `offset`; the data follows it on the wire. `flags` is 0 or
/// `NBD_REPLY_FLAG_DONE`.
pub fn encode_offset_data_header(
    cookie: u64,
    flags: u16,
    offset: u64,
    data_len: u32,
) -> [u8; OFFSET_DATA_HEADER_LEN] {
    let mut out = [0u8; OFFSET_DATA_HEADER_LEN];
    out[..CHUNK_HEADER_LEN].copy_from_slice(&encode_chunk_header(&ChunkHeader {
        flags,
        reply_type: NBD_REPLY_TYPE_OFFSET_DATA,
        cookie,
        // data_len <= MAX_PAYLOAD_BYTES, far below u32::MAX - 8.
        length: data_len.saturating_add(8),
    }));
    out[CHUNK_HEADER_LEN..].copy_from_slice(&offset.to_be_bytes());
    out
}

/// A whole offset-hole chunk: `hole_len` bytes at `offset` read as zeros.
pub fn encode_offset_hole(
    cookie: u64,
    flags: u16,
    offset: u64,
    hole_len: u32,
) -> [u8; OFFSET_HOLE_LEN] {
    let mut out = [0u8; OFFSET_HOLE_LEN];
    out[..CHUNK_HEADER_LEN].copy_from_slice(&encode_chunk_header(&ChunkHeader {
        flags,
        reply_type: NBD_REPLY_TYPE_OFFSET_HOLE,
        cookie,
        length: 12,
    }));
    out[CHUNK_HEADER_LEN..CHUNK_HEADER_LEN + 8].copy_from_slice(&offset.to_be_bytes());
    out[CHUNK_HEADER_LEN + 8..].copy_from_slice(&hole_len.to_be_bytes());
    out
}

/// The final chunk of a reply that has nothing more to say
/// (`NBD_REPLY_TYPE_NONE` with `DONE`).
pub fn encode_done(cookie: u64) -> [u8; CHUNK_HEADER_LEN] {
    encode_chunk_header(&ChunkHeader {
        flags: NBD_REPLY_FLAG_DONE,
        reply_type: NBD_REPLY_TYPE_NONE,
        cookie,
        length: 0,
    })
}

/// A whole `NBD_REPLY_TYPE_ERROR` chunk with `DONE`: the request failed
/// with `error_nbd`; `message` (cut to the spec's string limit) is for
/// humans.
pub fn encode_error(cookie: u64, error_nbd: u32, message: &str) -> Vec<u8> {
    debug_assert_ne!(error_nbd, 0, "an error chunk needs an error");
    let message = super::truncate_str(message, super::MAX_STRING_LEN);
    let mut out = Vec::with_capacity(CHUNK_HEADER_LEN + 6 + message.len());
    out.extend_from_slice(&encode_chunk_header(&ChunkHeader {
        flags: NBD_REPLY_FLAG_DONE,
        reply_type: NBD_REPLY_TYPE_ERROR,
        cookie,
        // At most 4096 + 6.
        length: (6 + message.len()) as u32,
    }));
    out.extend_from_slice(&error_nbd.to_be_bytes());
    out.extend_from_slice(&(message.len() as u16).to_be_bytes());
    out.extend_from_slice(message.as_bytes());
    out
}

/// One `base:allocation` extent: `length` bytes with `NBD_STATE_*` flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockExtent {
    pub length: u32,
    pub flags: u32,
}

/// A whole `NBD_REPLY_TYPE_BLOCK_STATUS` chunk for `context_id`, appended
/// to `out`. `flags` is `NBD_REPLY_FLAG_DONE` on the last chunk of the
/// reply (one chunk per selected context), else 0. `extents` must be
/// non-empty, at most [`MAX_BLOCK_STATUS_EXTENTS`] long, with no zero
/// lengths (the spec's rules; asserted).
pub fn encode_block_status(
    out: &mut Vec<u8>,
    cookie: u64,
    flags: u16,
    context_id: u32,
    extents: &[BlockExtent],
) {
    assert!(
        !extents.is_empty() && extents.len() <= MAX_BLOCK_STATUS_EXTENTS,
        "{} extents in a block status reply",
        extents.len()
    );
    debug_assert!(extents.iter().all(|e| e.length > 0), "zero-length extent");
    debug_assert!(
        flags & !NBD_REPLY_FLAG_DONE == 0,
        "block status flags {flags:#x}"
    );
    out.extend_from_slice(&encode_chunk_header(&ChunkHeader {
        flags,
        reply_type: NBD_REPLY_TYPE_BLOCK_STATUS,
        cookie,
        // At most 4 + 8 * 1024.
        length: (4 + 8 * extents.len()) as u32,
    }));
    out.extend_from_slice(&context_id.to_be_bytes());
    for e in extents {
        out.extend_from_slice(&e.length.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
    }
}

/// Decodes a block status payload (after the chunk header) into its
/// context id and extents (the client side). `None` when malformed.
pub fn decode_block_status(payload: &[u8]) -> Option<(u32, Vec<BlockExtent>)> {
    let mut r = super::Reader::new(payload);
    let id = r.u32()?;
    let rest = r.rest();
    if rest.is_empty() || !rest.len().is_multiple_of(8) {
        return None;
    }
    let extents = rest
        .chunks_exact(8)
        .map(|e| {
            let mut r = super::Reader::new(e);
            Some(BlockExtent {
                length: r.u32()?,
                flags: r.u32()?,
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some((id, extents))
}

/// One chunk of a read reply, in bytes relative to the read's offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPiece {
    Data { at: u32, len: u32 },
    Hole { at: u32, len: u32 },
}

/// Splits a completed read into chunks. `zero_ranges` are `(at, len)`
/// ranges of the buffer the device reported as reading zeros, in order
/// and not overlapping; each becomes a hole only if the bytes read there
/// really are zeros (a write racing the extent lookup can make the report
/// stale, and the data read is what the client must get), and only if it
/// is at least [`MIN_HOLE_BYTES`] long. At most `max_chunks` pieces; the
/// pieces are in order, non-empty, and cover the buffer exactly.
pub fn plan_read(data: &[u8], zero_ranges: &[(u32, u32)], max_chunks: usize) -> Vec<ReadPiece> {
    let mut pieces = Vec::new();
    plan_read_into(data, zero_ranges, max_chunks, &mut pieces);
    pieces
}

/// [`plan_read`] into `pieces` (cleared first), so that a connection can
/// keep one vector for every read instead of allocating one per read.
pub fn plan_read_into(
    data: &[u8],
    zero_ranges: &[(u32, u32)],
    max_chunks: usize,
    pieces: &mut Vec<ReadPiece>,
) {
    pieces.clear();
    let total = u32::try_from(data.len()).unwrap_or(u32::MAX);
    let max_chunks = max_chunks.max(1);
    let mut pos = 0u32;
    for &(at, len) in zero_ranges {
        // Clip to the buffer and to what is not covered yet.
        let start = at.max(pos).min(total);
        let end = at.saturating_add(len).min(total);
        if end <= start || end - start < MIN_HOLE_BYTES {
            continue;
        }
        // Room for: data before, the hole, and a data tail.
        if pieces.len() + usize::from(start > pos) + 2 > max_chunks {
            break;
        }
        let zeros = data
            .get(start as usize..end as usize)
            .is_some_and(|s| s.iter().all(|&b| b == 0));
        if !zeros {
            continue;
        }
        if start > pos {
            pieces.push(ReadPiece::Data {
                at: pos,
                len: start - pos,
            });
        }
        pieces.push(ReadPiece::Hole {
            at: start,
            len: end - start,
        });
        pos = end;
    }
    if pos < total {
        pieces.push(ReadPiece::Data {
            at: pos,
            len: total - pos,
        });
    }
}

/// Whether a read buffer could hold a hole worth sending: some
/// [`MIN_HOLE_BYTES`]-sized block of it (counted from its start) is all
/// zeros. A buffer of data fails on the first byte of each block, so this
/// spares the device's extent lookup (syscalls, for a file) on nearly
/// every read of written data; the price is that a zero run long enough
/// for a hole but covering no whole block goes as data, which is correct.
pub fn may_hold_hole(data: &[u8]) -> bool {
    data.chunks_exact(MIN_HOLE_BYTES as usize)
        .any(|block| block.iter().all(|&b| b == 0))
}

/// The runs of whole all-zero [`MIN_HOLE_BYTES`] blocks of a read buffer
/// (counted from its start), as `(at, len)` for [`plan_read`], at most
/// `max_ranges` of them. For a device that cannot tell its holes inline (a
/// replicated volume): a hole chunk only says "reads as zeros", which the
/// data just read proves.
pub fn zero_runs(data: &[u8], max_ranges: usize) -> Vec<(u32, u32)> {
    let mut runs = Vec::new();
    zero_runs_into(data, max_ranges, &mut runs);
    runs
}

/// [`zero_runs`] into `runs` (cleared first), for a vector kept between
/// reads.
pub fn zero_runs_into(data: &[u8], max_ranges: usize, runs: &mut Vec<(u32, u32)>) {
    runs.clear();
    let block = MIN_HOLE_BYTES as usize;
    for (i, b) in data.chunks_exact(block).enumerate() {
        if !b.iter().all(|&x| x == 0) {
            continue;
        }
        // A read is at most a u32 long, so its offsets fit.
        let at = (i * block) as u32;
        let full = runs.len() >= max_ranges;
        match runs.last_mut() {
            Some(last) if last.0 + last.1 == at => last.1 += MIN_HOLE_BYTES,
            _ if full => break,
            _ => runs.push((at, MIN_HOLE_BYTES)),
        }
    }
}

/// A parsed `NBD_OPT_LIST_META_CONTEXT`/`NBD_OPT_SET_META_CONTEXT`
/// payload: export name length, name, query count, queries.
#[derive(Debug)]
pub(super) struct MetaRequest<'a> {
    pub(super) export: &'a str,
    pub(super) queries: Vec<&'a str>,
}

/// Parses a meta context option; on failure the error reply type and a
/// message for the client.
pub(super) fn parse_meta_request(payload: &[u8]) -> Result<MetaRequest<'_>, (u32, &'static str)> {
    use super::{NBD_REP_ERR_INVALID as INVALID, NBD_REP_ERR_TOO_BIG};
    let mut r = super::Reader::new(payload);
    let name_len = r.u32().ok_or((INVALID, "option shorter than 8 bytes"))?;
    let name = usize::try_from(name_len)
        .ok()
        .and_then(|len| r.bytes(len))
        .ok_or((INVALID, "name length overruns the option"))?;
    let export = super::parse_export_name(name).map_err(|why| (INVALID, why))?;
    let count = r.u32().ok_or((INVALID, "query count missing"))?;
    if count > MAX_META_QUERIES {
        return Err((NBD_REP_ERR_TOO_BIG, "too many meta context queries"));
    }
    let mut queries = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let len = r
            .u32()
            .ok_or((INVALID, "query length overruns the option"))?;
        // A query is an NBD string, so a context name can be no longer.
        let len = usize::try_from(len)
            .ok()
            .filter(|&len| len <= super::MAX_STRING_LEN)
            .ok_or((INVALID, "query longer than the 4096 bytes of an NBD string"))?;
        let bytes = r.bytes(len).ok_or((INVALID, "query overruns the option"))?;
        let query = std::str::from_utf8(bytes).map_err(|_| (INVALID, "query is not UTF-8"))?;
        if query.contains('\0') {
            return Err((INVALID, "query contains NUL"));
        }
        queries.push(query);
    }
    if !r.rest().is_empty() {
        return Err((INVALID, "bytes after the last query"));
    }
    Ok(MetaRequest { export, queries })
}

/// What one metadata context query names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Query<'a> {
    /// `base:`: every `base:` context (LIST only; the spec says SET MUST
    /// ignore it).
    BaseAll,
    /// `base:allocation`.
    BaseAllocation,
    /// `lull:` or `lull:changed:`: every snapshot's changed context (LIST
    /// only; SET selects nothing with an empty leaf-name).
    ChangedAll,
    /// `lull:changed:SNAPSHOT`, with a name that could be a snapshot's.
    Changed(&'a str),
    /// A context lull does not serve: another namespace, another leaf,
    /// or no namespace at all. The spec says to ignore it.
    Unknown,
}

/// Classifies a query; `Err` (a message for `NBD_REP_ERR_INVALID`, which
/// the spec allows for "a leaf name that is invalid for a known
/// namespace") when it names a snapshot no snapshot could be.
pub(super) fn parse_query(query: &str) -> Result<Query<'_>, &'static str> {
    if query == "base:" {
        return Ok(Query::BaseAll);
    }
    if query == BASE_ALLOCATION {
        return Ok(Query::BaseAllocation);
    }
    if query == LULL_NAMESPACE || query == LULL_CHANGED_PREFIX {
        return Ok(Query::ChangedAll);
    }
    let Some(snapshot) = query.strip_prefix(LULL_CHANGED_PREFIX) else {
        return Ok(Query::Unknown);
    };
    if snapshot.contains(SNAPSHOT_NAME_FORBIDDEN) {
        return Err("lull:changed: names a snapshot, and snapshot names hold no '@' or '/'");
    }
    Ok(Query::Changed(snapshot))
}

/// The `lull:changed:` context of `snapshot`, or `None` when no client
/// could name it (empty, a forbidden character, NUL, too long): such a
/// name from a device is not listed.
pub fn changed_context_name(snapshot: &str) -> Option<String> {
    let valid = !snapshot.is_empty()
        && snapshot.len() <= MAX_CHANGED_SNAPSHOT_NAME_LEN
        && !snapshot.contains(SNAPSHOT_NAME_FORBIDDEN)
        && !snapshot.contains('\0');
    valid.then(|| format!("{LULL_CHANGED_PREFIX}{snapshot}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn chunk_header_layout_matches_the_spec() {
        let h = encode_offset_data_header(0x0102_0304_0506_0708, NBD_REPLY_FLAG_DONE, 4096, 512);
        assert_eq!(&h[0..4], &[0x66, 0x8e, 0x33, 0xef]);
        assert_eq!(&h[4..6], &[0, 1]); // DONE
        assert_eq!(&h[6..8], &[0, 1]); // OFFSET_DATA
        assert_eq!(&h[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&h[16..20], &520u32.to_be_bytes());
        assert_eq!(&h[20..28], &4096u64.to_be_bytes());

        let hole = encode_offset_hole(1, 0, 8192, 4096);
        assert_eq!(&hole[6..8], &[0, 2]);
        assert_eq!(&hole[16..20], &12u32.to_be_bytes());
        assert_eq!(&hole[28..32], &4096u32.to_be_bytes());

        let done = encode_done(5);
        let d = decode_chunk_header(&done).unwrap();
        assert_eq!((d.flags, d.reply_type, d.cookie, d.length), (1, 0, 5, 0));

        let err = encode_error(6, crate::nbd::NBD_EIO, "disk on fire");
        let e = decode_chunk_header(err[..20].try_into().unwrap()).unwrap();
        assert_eq!(e.reply_type, NBD_REPLY_TYPE_ERROR);
        assert_eq!(e.flags, NBD_REPLY_FLAG_DONE);
        assert_eq!(e.length as usize, err.len() - 20);
        assert_eq!(&err[20..24], &5u32.to_be_bytes());
        assert_eq!(&err[24..26], &12u16.to_be_bytes());
        assert_eq!(&err[26..], b"disk on fire");
    }

    #[test]
    fn error_messages_are_cut_to_the_string_limit() {
        let long = "é".repeat(3000); // 6000 bytes
        let err = encode_error(1, crate::nbd::NBD_EIO, &long);
        let len = u16::from_be_bytes([err[24], err[25]]) as usize;
        assert!(len <= crate::nbd::MAX_STRING_LEN);
        assert!(std::str::from_utf8(&err[26..]).is_ok());
        assert_eq!(err.len(), 26 + len);
    }

    #[test]
    fn zero_runs_find_whole_zero_blocks() {
        let b = MIN_HOLE_BYTES as usize;
        let mut data = vec![0u8; 5 * b + 7];
        data[2 * b + 1] = 1;
        let m = MIN_HOLE_BYTES;
        assert_eq!(zero_runs(&data, 8), [(0, 2 * m), (3 * m, 2 * m)]);
        assert_eq!(zero_runs(&data, 1), [(0, 2 * m)]);
        assert_eq!(zero_runs(&data[..b - 1], 8), []);
        let pieces = plan_read(&data, &zero_runs(&data, 8), MAX_READ_CHUNKS);
        assert_eq!(
            pieces,
            [
                ReadPiece::Hole { at: 0, len: 2 * m },
                ReadPiece::Data { at: 2 * m, len: m },
                ReadPiece::Hole {
                    at: 3 * m,
                    len: 2 * m
                },
                ReadPiece::Data { at: 5 * m, len: 7 },
            ]
        );
    }

    #[test]
    fn block_status_round_trips() {
        let extents = [
            BlockExtent {
                length: 1 << 20,
                flags: NBD_STATE_HOLE | NBD_STATE_ZERO,
            },
            BlockExtent {
                length: 4096,
                flags: 0,
            },
        ];
        let mut out = Vec::new();
        encode_block_status(
            &mut out,
            3,
            NBD_REPLY_FLAG_DONE,
            BASE_ALLOCATION_ID,
            &extents,
        );
        let h = decode_chunk_header(out[..20].try_into().unwrap()).unwrap();
        assert_eq!(h.reply_type, NBD_REPLY_TYPE_BLOCK_STATUS);
        assert_eq!(h.length as usize, out.len() - 20);
        assert_eq!(
            decode_block_status(&out[20..]),
            Some((BASE_ALLOCATION_ID, extents.to_vec()))
        );
        assert_eq!(decode_block_status(&out[20..27]), None);
    }

    #[test]
    #[should_panic(expected = "extents in a block status reply")]
    fn block_status_refuses_more_than_the_cap() {
        let e = BlockExtent {
            length: 1,
            flags: 0,
        };
        encode_block_status(
            &mut Vec::new(),
            1,
            NBD_REPLY_FLAG_DONE,
            1,
            &[e; MAX_BLOCK_STATUS_EXTENTS + 1],
        );
    }

    #[test]
    fn reported_zeros_that_are_not_zero_stay_data() {
        let data = vec![1u8; 16384];
        assert_eq!(
            plan_read(&data, &[(0, 16384)], MAX_READ_CHUNKS),
            [ReadPiece::Data { at: 0, len: 16384 }]
        );
        let zeros = vec![0u8; 16384];
        assert_eq!(
            plan_read(&zeros, &[(0, 16384)], MAX_READ_CHUNKS),
            [ReadPiece::Hole { at: 0, len: 16384 }]
        );
        // Too short to be worth a hole.
        assert_eq!(
            plan_read(&zeros, &[(0, 100)], MAX_READ_CHUNKS),
            [ReadPiece::Data { at: 0, len: 16384 }]
        );
    }

    #[test]
    fn only_buffers_with_a_zero_block_may_hold_a_hole() {
        let mut data = vec![1u8; 3 * 4096];
        assert!(!may_hold_hole(&data));
        data[100..4196].fill(0); // a zero run of 4096 across two blocks
        assert!(!may_hold_hole(&data));
        data[4096..8192].fill(0);
        assert!(may_hold_hole(&data));
        assert!(!may_hold_hole(&[0u8; 4095]));
    }

    #[test]
    fn meta_requests_parse_and_refuse() {
        let mut p = Vec::new();
        p.extend_from_slice(&4u32.to_be_bytes());
        p.extend_from_slice(b"disk");
        p.extend_from_slice(&2u32.to_be_bytes());
        for q in ["base:allocation", "qemu:dirty-bitmap:x"] {
            p.extend_from_slice(&(q.len() as u32).to_be_bytes());
            p.extend_from_slice(q.as_bytes());
        }
        let m = parse_meta_request(&p).unwrap();
        assert_eq!(m.export, "disk");
        assert_eq!(m.queries, ["base:allocation", "qemu:dirty-bitmap:x"]);
        assert!(parse_meta_request(&p[..p.len() - 1]).is_err());
        let mut extra = p.clone();
        extra.push(0);
        assert!(parse_meta_request(&extra).is_err());
        let mut many = Vec::new();
        many.extend_from_slice(&0u32.to_be_bytes());
        many.extend_from_slice(&(MAX_META_QUERIES + 1).to_be_bytes());
        assert_eq!(
            parse_meta_request(&many).unwrap_err().0,
            crate::nbd::NBD_REP_ERR_TOO_BIG
        );
        // A query longer than an NBD string is refused as such.
        let long = "x".repeat(crate::nbd::MAX_STRING_LEN + 1);
        let mut p = Vec::new();
        p.extend_from_slice(&0u32.to_be_bytes());
        p.extend_from_slice(&1u32.to_be_bytes());
        p.extend_from_slice(&(long.len() as u32).to_be_bytes());
        p.extend_from_slice(long.as_bytes());
        let (reply, message) = parse_meta_request(&p).unwrap_err();
        assert_eq!(reply, crate::nbd::NBD_REP_ERR_INVALID);
        assert!(message.contains("4096"), "{message}");
        let mut nul = Vec::new();
        nul.extend_from_slice(&0u32.to_be_bytes());
        nul.extend_from_slice(&1u32.to_be_bytes());
        nul.extend_from_slice(&3u32.to_be_bytes());
        nul.extend_from_slice(b"a\0b");
        assert_eq!(
            parse_meta_request(&nul).unwrap_err().1,
            "query contains NUL"
        );
    }

    #[test]
    fn queries_are_classified() {
        assert_eq!(parse_query("base:"), Ok(Query::BaseAll));
        assert_eq!(parse_query("base:allocation"), Ok(Query::BaseAllocation));
        assert_eq!(parse_query("base:other"), Ok(Query::Unknown));
        assert_eq!(parse_query("lull:"), Ok(Query::ChangedAll));
        assert_eq!(parse_query("lull:changed:"), Ok(Query::ChangedAll));
        assert_eq!(parse_query("lull:changed:s1"), Ok(Query::Changed("s1")));
        // Leaf-names may hold colons.
        assert_eq!(parse_query("lull:changed:a:b"), Ok(Query::Changed("a:b")));
        assert_eq!(parse_query("lull:changes"), Ok(Query::Unknown));
        assert_eq!(parse_query("lull:other:x"), Ok(Query::Unknown));
        assert_eq!(parse_query("qemu:dirty-bitmap:x"), Ok(Query::Unknown));
        assert_eq!(parse_query("no-namespace"), Ok(Query::Unknown));
        assert_eq!(parse_query(""), Ok(Query::Unknown));
        assert!(parse_query("lull:changed:vol0@s1").is_err());
        assert!(parse_query("lull:changed:a/b").is_err());
        assert!(parse_query("lull:changed:/").is_err());
    }

    #[test]
    fn changed_context_names_meet_the_string_rules() {
        assert_eq!(
            changed_context_name("s1").as_deref(),
            Some("lull:changed:s1")
        );
        assert_eq!(changed_context_name(""), None);
        assert_eq!(changed_context_name("a@b"), None);
        assert_eq!(changed_context_name("a/b"), None);
        assert_eq!(changed_context_name("a\0b"), None);
        let longest = "s".repeat(MAX_CHANGED_SNAPSHOT_NAME_LEN);
        let name = changed_context_name(&longest).unwrap();
        assert_eq!(name.len(), crate::nbd::MAX_STRING_LEN);
        assert_eq!(changed_context_name(&format!("{longest}s")), None);
    }

    #[test]
    fn block_status_chunks_before_the_last_lack_done() {
        let e = [BlockExtent {
            length: 4096,
            flags: LULL_STATE_CHANGED,
        }];
        let mut out = Vec::new();
        encode_block_status(&mut out, 4, 0, LULL_CHANGED_ID, &e);
        let h = decode_chunk_header(out[..20].try_into().unwrap()).unwrap();
        assert_eq!(h.flags, 0);
        assert_eq!(
            decode_block_status(&out[20..]),
            Some((LULL_CHANGED_ID, e.to_vec()))
        );
    }

    fn zero_ranges(len: u32) -> impl Strategy<Value = Vec<(u32, u32)>> {
        proptest::collection::vec((0..len, 0..len), 0..12).prop_map(|mut v| {
            v.sort();
            v
        })
    }

    proptest! {
        #[test]
        fn read_plans_cover_the_buffer_and_holes_are_zeros(
            len in 1u32..65536,
            ranges in zero_ranges(65536),
            zero_runs in proptest::collection::vec((0u32..65536, 0u32..32768), 0..8),
            max_chunks in 1usize..12,
        ) {
            let mut data = vec![0xa5u8; len as usize];
            for (at, n) in zero_runs {
                let end = at.saturating_add(n).min(len);
                if at < end {
                    data[at as usize..end as usize].fill(0);
                }
            }
            let pieces = plan_read(&data, &ranges, max_chunks);
            prop_assert!(pieces.len() <= max_chunks);
            let mut pos = 0u32;
            let mut rebuilt = Vec::new();
            for p in &pieces {
                match *p {
                    ReadPiece::Data { at, len } => {
                        prop_assert_eq!(at, pos);
                        prop_assert!(len > 0);
                        rebuilt.extend_from_slice(&data[at as usize..(at + len) as usize]);
                        pos += len;
                    }
                    ReadPiece::Hole { at, len } => {
                        prop_assert_eq!(at, pos);
                        prop_assert!(len >= MIN_HOLE_BYTES);
                        rebuilt.extend(std::iter::repeat_n(0u8, len as usize));
                        pos += len;
                    }
                }
            }
            prop_assert_eq!(pos, len);
            prop_assert!(rebuilt == data);
        }

        #[test]
        fn chunk_headers_round_trip(flags: u16, reply_type: u16, cookie: u64, length: u32) {
            let h = ChunkHeader { flags, reply_type, cookie, length };
            prop_assert_eq!(decode_chunk_header(&encode_chunk_header(&h)), Some(h));
        }
    }
}
