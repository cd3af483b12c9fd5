//! Finding where one JSON value ends in a byte stream, without parsing it.
//!
//! ```ignore
//! let mut f = JsonFramer::new(MAX_REQUEST_BYTES);
//! f.extend(b"{\"a\": [1, \"]\"]} {\"b\"");
//! let first = f.next_frame()?.unwrap();   // b"{\"a\": [1, \"]\"]}"
//! assert!(f.next_frame()?.is_none());     // the second object is incomplete
//! ```
//!
//! SPDK's rpc.py writes one JSON object and reads one back, with no
//! delimiter; other clients send newline-delimited or back-to-back values.
//! The framer tracks only string, escape and bracket depth, byte by byte and
//! incrementally, so a value that arrives in many small reads costs O(n) to
//! frame (re-running a full parser on every read would cost O(n²)). The frame
//! is then parsed once by serde_json, which catches everything the scan does
//! not (bad literals, mismatched brackets, bad UTF-8, depth > 128).
//!
//! Only objects and arrays are framed: a top-level scalar (`12` then `3`?)
//! has no end marker, and is no valid request anyway.

use std::io::{self, Read};

/// Bytes read from the socket per `read` call.
const READ_CHUNK_BYTES: usize = 64 * 1024;

/// Why no frame could be taken.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("a JSON value exceeds the limit of {limit} bytes")]
    TooLarge { limit: usize },
    /// Valid JSON may start with this byte, but not an object or array.
    #[error("expected a JSON object or array, found a value starting with {0:?}")]
    NotStructured(char),
    #[error("expected a JSON object or array, found byte 0x{0:02x}")]
    Garbage(u8),
    #[error("the stream ended inside a JSON value")]
    Truncated,
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// An incremental framer over a growing buffer.
#[derive(Debug)]
pub struct JsonFramer {
    buf: Vec<u8>,
    limit: usize,
    /// Next byte to scan.
    pos: usize,
    /// Whether a value has started at `buf[0]` (leading whitespace is
    /// dropped as it is scanned).
    in_value: bool,
    depth: u32,
    in_string: bool,
    escape: bool,
}

impl JsonFramer {
    pub fn new(limit: usize) -> JsonFramer {
        JsonFramer {
            buf: Vec::new(),
            limit,
            pos: 0,
            in_value: false,
            depth: 0,
            in_string: false,
            escape: false,
        }
    }

    /// Whether part of a value is buffered (a read now would be mid-request).
    pub fn mid_value(&self) -> bool {
        self.in_value
    }

    pub fn extend(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Take the next complete value's bytes, if one is buffered.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameError> {
        if !self.in_value {
            let skip = self
                .buf
                .iter()
                .take_while(|b| b.is_ascii_whitespace())
                .count();
            self.buf.drain(..skip);
            self.pos = 0;
            match self.buf.first() {
                None => return Ok(None),
                Some(b'{' | b'[') => {
                    self.in_value = true;
                    self.depth = 0;
                    self.in_string = false;
                    self.escape = false;
                }
                Some(&b)
                    if b == b'"'
                        || b == b'-'
                        || b.is_ascii_digit()
                        || matches!(b, b't' | b'f' | b'n') =>
                {
                    return Err(FrameError::NotStructured(b as char))
                }
                Some(&b) => return Err(FrameError::Garbage(b)),
            }
        }
        while self.pos < self.buf.len() {
            let b = self.buf[self.pos];
            self.pos += 1;
            if self.in_string {
                if self.escape {
                    self.escape = false;
                } else if b == b'\\' {
                    self.escape = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        if self.pos > self.limit {
                            return Err(FrameError::TooLarge { limit: self.limit });
                        }
                        let rest = self.buf.split_off(self.pos);
                        let frame = std::mem::replace(&mut self.buf, rest);
                        self.pos = 0;
                        self.in_value = false;
                        return Ok(Some(frame));
                    }
                }
                _ => {}
            }
        }
        if self.buf.len() > self.limit {
            return Err(FrameError::TooLarge { limit: self.limit });
        }
        Ok(None)
    }

    /// Read from `r` until a complete value is framed. `Ok(None)` is a clean
    /// end of stream between values.
    pub fn read_frame<R: Read>(&mut self, r: &mut R) -> Result<Option<Vec<u8>>, FrameError> {
        let mut chunk = vec![0u8; READ_CHUNK_BYTES];
        loop {
            if let Some(frame) = self.next_frame()? {
                return Ok(Some(frame));
            }
            // `next_frame` fails past the limit, so the buffer never holds
            // more than the limit plus one chunk.
            let n = match r.read(&mut chunk) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(FrameError::Io(e)),
            };
            if n == 0 {
                // Whitespace-only leftovers are a clean end.
                return match self.next_frame()? {
                    Some(frame) => Ok(Some(frame)),
                    None if self.in_value => Err(FrameError::Truncated),
                    None => Ok(None),
                };
            }
            self.extend(&chunk[..n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(input: &[u8], limit: usize) -> Result<Vec<String>, FrameError> {
        let mut f = JsonFramer::new(limit);
        let mut r = input;
        let mut out = Vec::new();
        while let Some(fr) = f.read_frame(&mut r)? {
            out.push(String::from_utf8_lossy(&fr).into_owned());
        }
        Ok(out)
    }

    #[test]
    fn back_to_back_newline_and_nested() {
        let got = frames(b" {\"a\":\"}\\\"{\"}{\"b\":[1,{}]}\n[1,2]\n\n", 1 << 20).unwrap();
        assert_eq!(got, vec!["{\"a\":\"}\\\"{\"}", "{\"b\":[1,{}]}", "[1,2]"]);
    }

    #[test]
    fn byte_at_a_time() {
        let input = b"{\"method\":\"x\",\"p\":{\"q\":\"]]\"}}  {}";
        let mut f = JsonFramer::new(1 << 20);
        let mut got = Vec::new();
        for b in input {
            f.extend(&[*b]);
            while let Some(fr) = f.next_frame().unwrap() {
                got.push(fr);
            }
        }
        assert_eq!(got.len(), 2);
        assert_eq!(&got[0][..], &input[..input.len() - 4]);
    }

    #[test]
    fn errors() {
        assert!(matches!(
            frames(b"{\"a\":1", 100),
            Err(FrameError::Truncated)
        ));
        assert!(matches!(
            frames(b"hello", 100),
            Err(FrameError::Garbage(b'h'))
        ));
        assert!(matches!(
            frames(b"42", 100),
            Err(FrameError::NotStructured('4'))
        ));
        let big = format!("{{\"a\":\"{}\"}}", "x".repeat(200));
        assert!(matches!(
            frames(big.as_bytes(), 100),
            Err(FrameError::TooLarge { limit: 100 })
        ));
        assert_eq!(frames(b"   \n ", 100).unwrap().len(), 0);
    }
}
