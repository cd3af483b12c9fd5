//! Just enough HTTP/1.x for one GET route: parse a request head, format a
//! response. No keep-alive, no bodies, no I/O here.
//!
//! ```ignore
//! let head = parse_head(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 8192)?.unwrap();
//! assert_eq!((head.method.as_str(), head.path()), ("GET", "/metrics"));
//! ```

/// Why no request could be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HttpError {
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    #[error("request head too large")]
    TooLarge,
    #[error("timed out")]
    Timeout,
    #[error("connection closed")]
    Closed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub target: String,
}

impl RequestHead {
    /// The target without its query string.
    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }
}

/// Parse a request head from the start of `buf`: `Ok(None)` until the blank
/// line that ends it has arrived. Headers are not interpreted.
pub fn parse_head(buf: &[u8], limit: usize) -> Result<Option<RequestHead>, HttpError> {
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .or_else(|| buf.windows(2).position(|w| w == b"\n\n"));
    let Some(end) = end else {
        return if buf.len() >= limit {
            Err(HttpError::TooLarge)
        } else {
            Ok(None)
        };
    };
    if end > limit {
        return Err(HttpError::TooLarge);
    }
    let head = std::str::from_utf8(&buf[..end])
        .map_err(|_| HttpError::Malformed("request head is not UTF-8"))?;
    let line = head.lines().next().unwrap_or("");
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::Malformed(
            "request line is not METHOD TARGET VERSION",
        ));
    };
    if method.is_empty() || !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(HttpError::Malformed("bad method"));
    }
    if !target.starts_with('/') {
        return Err(HttpError::Malformed("target must be an absolute path"));
    }
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::Malformed("only HTTP/1.x"));
    }
    Ok(Some(RequestHead {
        method: method.to_string(),
        target: target.to_string(),
    }))
}

/// A complete `Connection: close` response. `with_body: false` (HEAD) keeps
/// the headers, Content-Length included, and drops the body.
pub(crate) fn response(
    code: u16,
    reason: &str,
    extra_headers: &[(&str, &str)],
    content_type: &str,
    body: &[u8],
    with_body: bool,
) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (k, v) in extra_headers {
        out.push_str(k);
        out.push_str(": ");
        out.push_str(v);
        out.push_str("\r\n");
    }
    out.push_str("\r\n");
    let mut out = out.into_bytes();
    if with_body {
        out.extend_from_slice(body);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads() {
        let h = parse_head(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n", 100)
            .unwrap()
            .unwrap();
        assert_eq!((h.method.as_str(), h.path()), ("GET", "/metrics"));
        assert_eq!(parse_head(b"GET /metrics HTTP/1.1\r\nHost:", 100), Ok(None));
        assert!(parse_head(b"GET /metrics HTTP/1.0\n\n", 100)
            .unwrap()
            .is_some());
        assert_eq!(parse_head(&[b'a'; 100], 100), Err(HttpError::TooLarge));
        for bad in [
            &b"GET\r\n\r\n"[..],
            b"get / HTTP/1.1\r\n\r\n",
            b"GET x HTTP/1.1\r\n\r\n",
            b"GET / SPDY\r\n\r\n",
            b"GET  / HTTP/1.1\r\n\r\n",
            b"\xff / HTTP/1.1\r\n\r\n",
        ] {
            assert!(
                matches!(parse_head(bad, 100), Err(HttpError::Malformed(_))),
                "{bad:?}"
            );
        }
    }
}
