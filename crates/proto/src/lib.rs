//! Wire formats for lull, with no I/O: bytes in, parsed events and
//! replies out. The socket-facing crates (`nbd`, `replica`) drive these
//! codecs; limits and version constants live here so that every parser
//! checks the same numbers.

#![forbid(unsafe_code)]

pub mod nbd;
pub mod replica;
