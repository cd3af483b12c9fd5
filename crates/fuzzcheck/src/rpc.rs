//! The control-plane targets: JSON-RPC requests on the Unix socket and the
//! HTTP request head of the metrics endpoint.

use std::sync::OnceLock;

use lull_rpc::testing::FakeSource;
use lull_rpc::{
    answer_frame, frame_error_response, metrics_response, no_params, parse_head, parse_params,
    FrameError, JsonFramer, MethodRegistry, RequestHead, MAX_HTTP_REQUEST_BYTES, MAX_REQUEST_BYTES,
};
use serde_json::Value;

use crate::{chunks, split_chunking};

/// A small request limit, so inputs of libFuzzer's size reach the
/// too-large refusal too.
const SMALL_REQUEST_BYTES: usize = 64;

/// Frames one connection handles at most per input.
const MAX_FRAMES: usize = 256;

/// Reads one metrics request is cut into at most. The head parser rescans
/// the whole buffer on every read (as the server does; fine for its 1 KiB
/// reads and 8 KiB limit), so thousands of one-byte reads would only make
/// each run slow, not find more.
const MAX_HTTP_READS: usize = 64;

/// A registry with the built-in `rpc_get_methods` and methods that take
/// any params, none, and named ones (`deny_unknown_fields`), as lull's do.
fn registry() -> &'static MethodRegistry {
    static REGISTRY: OnceLock<MethodRegistry> = OnceLock::new();
    REGISTRY.get_or_init(|| {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Named {
            name: String,
            size: Option<u64>,
            backend: Option<String>,
        }
        let mut r = MethodRegistry::new();
        r.register("echo", Box::new(|p| Ok(p.unwrap_or(Value::Null))))
            .expect("register echo");
        r.register(
            "ping",
            Box::new(|p| no_params(p).map(|()| Value::Bool(true))),
        )
        .expect("register ping");
        r.register(
            "volume_get",
            Box::new(|p| parse_params::<Named>(p).map(|n| Value::String(n.name))),
        )
        .expect("register volume_get");
        r
    })
}

/// What one connection does with a client stream, as a transcript: each
/// response sent, and the error that closed it (if any).
#[derive(Debug, PartialEq)]
enum Event {
    Reply(Value),
    Close(Value),
    /// End of stream inside a value: closed without a reply.
    Truncated,
}

/// Drive a connection's framer and request handling as
/// `server.rs::serve_connection` does, the input arriving in `pieces`.
fn converse(pieces: &[&[u8]], limit: usize) -> Vec<Event> {
    let mut framer = JsonFramer::new(limit);
    let mut out = Vec::new();
    let mut frames = 0;
    for piece in pieces {
        framer.extend(piece);
        loop {
            match framer.next_frame() {
                Ok(Some(frame)) => {
                    frames += 1;
                    check_frame(&frame, limit);
                    match answer_frame(registry(), &frame) {
                        Ok(Some(response)) => out.push(Event::Reply(check_response(response))),
                        Ok(None) => {}
                        Err(refusal) => {
                            out.push(Event::Close(check_response(refusal)));
                            return out;
                        }
                    }
                    if frames == MAX_FRAMES {
                        return out;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    assert!(!matches!(e, FrameError::Io(_) | FrameError::Truncated));
                    out.push(Event::Close(check_response(frame_error_response(&e))));
                    return out;
                }
            }
        }
    }
    if framer.mid_value() {
        out.push(Event::Truncated);
    }
    out
}

/// A frame is one whole object or array within the limit; if it parses,
/// its re-encoding frames as exactly one frame too.
fn check_frame(frame: &[u8], limit: usize) {
    assert!(frame.len() <= limit);
    assert!(matches!(frame.first(), Some(b'{' | b'[')), "{frame:?}");
    assert!(matches!(frame.last(), Some(b'}' | b']')), "{frame:?}");
    if let Ok(value) = serde_json::from_slice::<Value>(frame) {
        let bytes = serde_json::to_vec(&value).expect("a parsed value encodes");
        assert_eq!(single_frame(&bytes), Some(bytes));
    }
}

/// Every response is a JSON-RPC 2.0 response (or a batch of them) whose
/// encoding frames as one value, as a client reads it.
fn check_response(response: Value) -> Value {
    let each = |r: &Value| {
        assert_eq!(r["jsonrpc"], "2.0", "{r}");
        assert!(r.get("result").is_some() != r.get("error").is_some(), "{r}");
        if let Some(e) = r.get("error") {
            assert!(e["code"].is_i64() && e["message"].is_string(), "{r}");
        }
    };
    match &response {
        Value::Array(batch) => {
            assert!(!batch.is_empty());
            batch.iter().for_each(each);
        }
        other => each(other),
    }
    let bytes = serde_json::to_vec(&response).expect("a response encodes");
    assert_eq!(single_frame(&bytes), Some(bytes.clone()));
    let again: Value = serde_json::from_slice(&bytes).expect("a response parses");
    assert_eq!(
        serde_json::to_vec(&again).expect("a response encodes"),
        bytes
    );
    response
}

/// The one frame `bytes` hold, if they hold exactly one.
fn single_frame(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut f = JsonFramer::new(bytes.len().max(1));
    f.extend(bytes);
    let frame = f.next_frame().ok()??;
    (f.next_frame().ok()?.is_none() && !f.mid_value()).then_some(frame)
}

/// Feeds arbitrary client bytes to the JSON-RPC server's framer
/// (`JsonFramer`) and request handling (`answer_frame`: serde_json, then
/// the JSON-RPC 2.0 rules of `handle_value` and a registry's
/// `parse_params`), in arbitrary chunks.
///
/// Input layout: byte 0 (low 3 bits) says how many chunk-size bytes follow;
/// the rest is the client stream (one byte at a time without sizes).
/// Checks: no panic; frames are whole objects or arrays within the limit;
/// responses are well-formed JSON-RPC whose encoding frames and re-encodes
/// stably; chunking never changes the transcript, at the real
/// `MAX_REQUEST_BYTES` and at a small limit.
pub fn rpc_request(data: &[u8]) {
    let Some((sizes, input)) = split_chunking(data) else {
        return;
    };
    for limit in [MAX_REQUEST_BYTES, SMALL_REQUEST_BYTES] {
        let whole = converse(&[input], limit);
        let chunked = converse(&chunks(input, &sizes), limit);
        assert_eq!(whole, chunked, "limit {limit}");
    }
}

/// Feeds arbitrary client bytes to the metrics endpoint's request-head
/// parser (`parse_head`) and router (`metrics_response`), growing the
/// buffer chunk by chunk as `metrics.rs::read_head` does.
///
/// Input layout: as `rpc_request`.
/// Checks: no panic; a response is given at the latest once the buffer
/// reaches `MAX_HTTP_REQUEST_BYTES`; it is one of the statuses the server
/// sends, with a Content-Length that matches a GET's body; a parsed head
/// rebuilt as `METHOD TARGET HTTP/1.1` parses to the same head.
pub fn metrics_http(data: &[u8]) {
    let Some((sizes, input)) = split_chunking(data) else {
        return;
    };
    let source = FakeSource::default();
    let mut pieces = chunks(input, &sizes);
    if pieces.len() > MAX_HTTP_READS {
        pieces = chunks(input, &[input.len().div_ceil(MAX_HTTP_READS)]);
    }
    let mut buf = Vec::new();
    let mut response = metrics_response(&buf, &source);
    for piece in pieces {
        if response.is_some() {
            break;
        }
        buf.extend_from_slice(piece);
        response = metrics_response(&buf, &source);
    }
    let Some(response) = response else {
        assert!(buf.len() < MAX_HTTP_REQUEST_BYTES);
        return;
    };
    let head = parse_head(&buf, MAX_HTTP_REQUEST_BYTES);
    check_http_response(&response, head.as_ref().ok().and_then(Option::as_ref));
    if let Ok(Some(head)) = head {
        let rebuilt = format!("{} {} HTTP/1.1\r\n\r\n", head.method, head.target);
        let again = parse_head(rebuilt.as_bytes(), MAX_HTTP_REQUEST_BYTES);
        assert_eq!(again, Ok(Some(head)));
    }
}

fn check_http_response(response: &[u8], head: Option<&RequestHead>) {
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head ends with a blank line");
    let text = std::str::from_utf8(&response[..split]).expect("a response head is UTF-8");
    let body = &response[split + 4..];
    let status = text
        .strip_prefix("HTTP/1.1 ")
        .and_then(|s| s.get(..3))
        .expect("a status line");
    assert!(
        ["200", "400", "404", "405", "431"].contains(&status),
        "{text}"
    );
    let length: usize = text
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .expect("a Content-Length")
        .parse()
        .expect("a numeric Content-Length");
    let head_request = head.is_some_and(|h| h.method == "HEAD");
    if head_request && status == "200" {
        assert!(body.is_empty());
    } else {
        assert_eq!(length, body.len());
    }
}
