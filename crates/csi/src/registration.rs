//! The kubelet's plugin-registration API (`pluginregistration` v1), served
//! by the node plugin itself: the kubelet watches
//! `/var/lib/kubelet/plugins_registry` for sockets, calls `GetInfo` on a
//! new one to learn the driver's name and CSI endpoint, registers the
//! driver (it calls `NodeGetInfo` there and writes the CSINode object), and
//! reports the outcome with `NotifyRegistrationStatus`. This is what the
//! node-driver-registrar sidecar does; serving it here drops that sidecar
//! from every node (and it is not on the Go module proxy, which the
//! cluster tier builds its sidecars from).
//!
//! The socket is removed when the plugin stops, which the kubelet takes as
//! the driver's deregistration; a restarted plugin makes it anew and is
//! registered again.
//!
//! The kubelet's gRPC client (grpc-go dialling a bare socket path) sends
//! the socket's path as the HTTP/2 `:authority`, which is not a valid
//! authority, and h2 (under tonic) refuses such a request with
//! PROTOCOL_ERROR (kubernetes/kubernetes#108254, hyperium/h2#487, open).
//! Each kubelet connection therefore goes through [`AuthorityFix`], which
//! rewrites the `:authority` of every request header block to `localhost`
//! on its way to the gRPC server, frames and HPACK otherwise untouched.

use std::path::PathBuf;
use std::sync::Mutex;

use tonic::{Request, Response, Status};

use crate::identity::DRIVER_NAME;

/// The registration messages and service, generated from
/// `proto/pluginregistration.proto`.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("pluginregistration");
}

/// The plugin type the kubelet's CSI handler registers.
pub const CSI_PLUGIN_TYPE: &str = "CSIPlugin";

/// The CSI versions offered to the kubelet (its CSI handler takes 1.x).
pub const SUPPORTED_VERSIONS: &[&str] = &["1.0.0"];

/// Where the node plugin serves registration: a socket in the kubelet's
/// plugin-registration directory (`--registration-dir`), naming the CSI
/// endpoint by its path on the host (`--kubelet-registration-path`), which
/// is not the path inside the plugin's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistrationConfig {
    /// The directory the kubelet watches (as the plugin's container
    /// mounts it), usually the host's /var/lib/kubelet/plugins_registry.
    pub dir: PathBuf,
    /// The CSI socket's path as the kubelet sees it, e.g.
    /// /var/lib/kubelet/plugins/csi.lull.io/csi.sock.
    pub kubelet_endpoint: String,
}

impl RegistrationConfig {
    /// The registration socket: `DRIVER-reg.sock` in the directory, the
    /// name node-driver-registrar uses (one per driver).
    pub fn socket(&self) -> PathBuf {
        self.dir.join(format!("{DRIVER_NAME}-reg.sock"))
    }
}

/// The `Registration` service.
#[derive(Debug)]
pub struct RegistrationPlugin {
    kubelet_endpoint: String,
    /// The kubelet's last word: registered, or why not (for the log and
    /// the tests).
    status: Mutex<Option<Result<(), String>>>,
}

impl RegistrationPlugin {
    pub fn new(kubelet_endpoint: String) -> RegistrationPlugin {
        RegistrationPlugin {
            kubelet_endpoint,
            status: Mutex::new(None),
        }
    }

    /// What the kubelet last reported: `None` before it has.
    pub fn status(&self) -> Option<Result<(), String>> {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[tonic::async_trait]
impl pb::registration_server::Registration for std::sync::Arc<RegistrationPlugin> {
    async fn get_info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::PluginInfo>, Status> {
        Ok(Response::new(pb::PluginInfo {
            r#type: CSI_PLUGIN_TYPE.to_string(),
            name: DRIVER_NAME.to_string(),
            endpoint: self.kubelet_endpoint.clone(),
            supported_versions: SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<pb::RegistrationStatus>,
    ) -> Result<Response<pb::RegistrationStatusResponse>, Status> {
        let r = request.into_inner();
        let status = if r.plugin_registered {
            tracing::info!(driver = DRIVER_NAME, "registered with the kubelet");
            Ok(())
        } else {
            // The kubelet retries when the socket is made again; the
            // plugin goes on serving (a CO other than the kubelet may
            // still use it), loudly.
            tracing::error!(driver = DRIVER_NAME, error = %r.error, "the kubelet refused the registration");
            Err(r.error)
        };
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
        Ok(Response::new(pb::RegistrationStatusResponse {}))
    }
}

/// The HTTP/2 client preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The largest HTTP/2 frame payload (the protocol's own limit, 2^24 - 1).
const MAX_FRAME_PAYLOAD: usize = (1 << 24) - 1;

/// The largest header block gathered from HEADERS and CONTINUATION frames
/// (a gRPC request's headers are a few hundred bytes).
const MAX_HEADER_BLOCK: usize = 1 << 20;

const FRAME_HEADERS: u8 = 0x1;
const FRAME_CONTINUATION: u8 = 0x9;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;

/// HPACK's static table index of `:authority`.
const HPACK_AUTHORITY: u64 = 1;

/// What every rewritten request says its authority is.
const AUTHORITY: &[u8] = b"localhost";

/// Rewrites the `:authority` of the HTTP/2 requests on one connection
/// (the client-to-server direction; see the module doc).
#[derive(Debug, Default)]
pub struct AuthorityFix;

impl AuthorityFix {
    /// Copies `from` (the kubelet) to `to` (the gRPC server) until `from`
    /// ends, each request's header block rewritten.
    pub async fn run<R, W>(mut from: R, mut to: W) -> std::io::Result<()>
    where
        R: tokio::io::AsyncRead + Unpin,
        W: tokio::io::AsyncWrite + Unpin,
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
        let mut preface = [0u8; 24];
        from.read_exact(&mut preface).await?;
        if preface != PREFACE {
            return Err(bad("not an HTTP/2 client preface"));
        }
        to.write_all(&preface).await?;
        // HEADERS (and its CONTINUATIONs) gathered until END_HEADERS.
        let mut pending: Option<(u8, u32, Vec<u8>, Vec<u8>)> = None;
        loop {
            let mut head = [0u8; 9];
            match from.read_exact(&mut head).await {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    to.shutdown().await.ok();
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
            let len =
                (usize::from(head[0]) << 16) | (usize::from(head[1]) << 8) | usize::from(head[2]);
            let (kind, flags) = (head[3], head[4]);
            let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
            if len > MAX_FRAME_PAYLOAD {
                return Err(bad("HTTP/2 frame too large"));
            }
            let mut payload = vec![0u8; len];
            from.read_exact(&mut payload).await?;
            match (kind, pending.as_mut()) {
                (FRAME_HEADERS, None) => {
                    let (priority, fragment) = headers_fragment(flags, &payload)
                        .ok_or_else(|| bad("malformed HEADERS frame"))?;
                    pending = Some((flags, stream, priority, fragment));
                }
                (FRAME_CONTINUATION, Some((_, s, _, block))) if *s == stream => {
                    if block.len() + payload.len() > MAX_HEADER_BLOCK {
                        return Err(bad("header block too large"));
                    }
                    block.extend_from_slice(&payload);
                }
                (_, Some(_)) => return Err(bad("a frame inside a header block")),
                _ => {
                    to.write_all(&head).await?;
                    to.write_all(&payload).await?;
                    continue;
                }
            }
            if flags & FLAG_END_HEADERS == 0 {
                continue;
            }
            let (first_flags, stream, priority, block) = pending.take().expect("gathered above");
            let block = rewrite_authority(&block).ok_or_else(|| bad("malformed HPACK block"))?;
            let mut body = priority;
            body.extend_from_slice(&block);
            if body.len() > MAX_FRAME_PAYLOAD {
                return Err(bad("header block too large"));
            }
            // One HEADERS frame, unpadded, END_HEADERS; END_STREAM and
            // PRIORITY as the client sent them.
            let flags = (first_flags & !FLAG_PADDED) | FLAG_END_HEADERS;
            let n = body.len();
            let head = [
                (n >> 16) as u8,
                (n >> 8) as u8,
                n as u8,
                FRAME_HEADERS,
                flags,
                (stream >> 24) as u8,
                (stream >> 16) as u8,
                (stream >> 8) as u8,
                stream as u8,
            ];
            to.write_all(&head).await?;
            to.write_all(&body).await?;
        }
    }
}

/// Buffer of each in-process pipe between a kubelet connection and the
/// gRPC server: a few frames.
const PIPE_BYTES: usize = 64 << 10;

/// The registration socket's connections as the gRPC server takes them:
/// each kubelet connection joined to the server by an in-process pipe,
/// its requests through [`AuthorityFix`], the answers copied back as they
/// are. The accept loop ends with the stream.
pub fn incoming(
    listener: tokio::net::UnixListener,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<tokio::io::DuplexStream>> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        loop {
            let conn = tokio::select! {
                c = listener.accept() => c,
                _ = tx.closed() => return,
            };
            let conn = match conn {
                Ok((c, _)) => c,
                Err(e) => {
                    tracing::warn!("registration socket: accept: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (server, pipe) = tokio::io::duplex(PIPE_BYTES);
            let (from_kubelet, mut to_kubelet) = conn.into_split();
            let (mut from_server, to_server) = tokio::io::split(pipe);
            tokio::spawn(async move {
                if let Err(e) = AuthorityFix::run(from_kubelet, to_server).await {
                    tracing::debug!("registration connection: {e}");
                }
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut from_server, &mut to_kubelet).await;
            });
            if tx.send(Ok(server)).await.is_err() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// A HEADERS frame's priority bytes (kept) and header block fragment
/// (its padding dropped).
fn headers_fragment(flags: u8, payload: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let mut p = payload;
    let mut pad = 0usize;
    if flags & FLAG_PADDED != 0 {
        pad = usize::from(*p.first()?);
        p = &p[1..];
    }
    let mut priority = Vec::new();
    if flags & FLAG_PRIORITY != 0 {
        priority = p.get(..5)?.to_vec();
        p = &p[5..];
    }
    let end = p.len().checked_sub(pad)?;
    Some((priority, p[..end].to_vec()))
}

/// An HPACK integer with an `n`-bit prefix at `b[*i]`; advances `*i`.
fn hpack_int(b: &[u8], i: &mut usize, n: u32) -> Option<u64> {
    let mask = (1u64 << n) - 1;
    let mut v = u64::from(*b.get(*i)?) & mask;
    *i += 1;
    if v < mask {
        return Some(v);
    }
    let mut shift = 0u32;
    loop {
        let byte = *b.get(*i)?;
        *i += 1;
        v = v.checked_add(u64::from(byte & 0x7f).checked_shl(shift)?)?;
        shift += 7;
        if byte & 0x80 == 0 || shift > 56 {
            return (byte & 0x80 == 0).then_some(v);
        }
    }
}

/// Skips an HPACK string literal at `b[*i]`.
fn hpack_skip_string(b: &[u8], i: &mut usize) -> Option<()> {
    let len = usize::try_from(hpack_int(b, i, 7)?).ok()?;
    let end = i.checked_add(len)?;
    (end <= b.len()).then(|| *i = end)
}

/// The header block with the value of every literal `:authority` field
/// (name by the static table's index) replaced by `localhost`, each
/// field's representation kept, so that the server's dynamic table holds
/// the same entries at the same places as the client's (only smaller, so
/// it never evicts one the client still refers to).
fn rewrite_authority(b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let start = i;
        let first = b[i];
        let prefix = if first & 0x80 != 0 {
            hpack_int(b, &mut i, 7)?; // indexed field
            out.extend_from_slice(&b[start..i]);
            continue;
        } else if first & 0xc0 == 0x40 {
            6 // literal, incremental indexing
        } else if first & 0xe0 == 0x20 {
            hpack_int(b, &mut i, 5)?; // dynamic table size update
            out.extend_from_slice(&b[start..i]);
            continue;
        } else {
            4 // literal without indexing, never indexed
        };
        let name = hpack_int(b, &mut i, prefix)?;
        if name == 0 {
            hpack_skip_string(b, &mut i)?;
        }
        let value_at = i;
        hpack_skip_string(b, &mut i)?;
        if name == HPACK_AUTHORITY {
            out.extend_from_slice(&b[start..value_at]);
            out.push(AUTHORITY.len() as u8); // not Huffman, length < 127
            out.extend_from_slice(AUTHORITY);
        } else {
            out.extend_from_slice(&b[start..i]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::registration_server::Registration;

    #[test]
    fn the_authority_of_a_header_block_becomes_localhost() {
        // :method POST (indexed 3), :authority "/run/x.sock" (literal with
        // incremental indexing, name index 1, not Huffman), a literal
        // with a literal name ("te": "trailers", without indexing), a
        // size update, and a later request's reference to the dynamic entry.
        let mut block = vec![0x83, 0x41, 11];
        block.extend_from_slice(b"/run/x.sock");
        block.extend_from_slice(&[0x00, 2, b't', b'e', 8]);
        block.extend_from_slice(b"trailers");
        block.extend_from_slice(&[0x3f, 0xe1, 0x1f, 0xbe]);
        let out = rewrite_authority(&block).unwrap();
        let mut want = vec![0x83, 0x41, 9];
        want.extend_from_slice(b"localhost");
        want.extend_from_slice(&[0x00, 2, b't', b'e', 8]);
        want.extend_from_slice(b"trailers");
        want.extend_from_slice(&[0x3f, 0xe1, 0x1f, 0xbe]);
        assert_eq!(out, want);
        // a Huffman-coded value (H bit) is replaced too, and a block cut
        // short is refused
        let huff = [0x41, 0x83, 0xaa, 0xbb, 0xcc];
        assert_eq!(rewrite_authority(&huff).unwrap()[..3], [0x41, 9, b'l']);
        assert!(rewrite_authority(&[0x41, 20, b'x']).is_none());
    }

    #[tokio::test]
    async fn frames_pass_and_headers_are_joined_and_rewritten() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, proxy_in) = tokio::io::duplex(1 << 16);
        let (proxy_out, mut server) = tokio::io::duplex(1 << 16);
        let task = tokio::spawn(AuthorityFix::run(proxy_in, proxy_out));
        let frame = |kind: u8, flags: u8, stream: u32, body: &[u8]| {
            let n = body.len();
            let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, kind, flags];
            f.extend_from_slice(&stream.to_be_bytes());
            f.extend_from_slice(body);
            f
        };
        let settings = frame(0x4, 0, 0, &[]);
        // HEADERS (padded, 1 byte of padding) + CONTINUATION
        let mut h = vec![1u8, 0x83, 0x41, 3, b'/', b'a', b'b'];
        h.push(0); // padding
        let mut sent = PREFACE.to_vec();
        sent.extend(settings.clone());
        sent.extend(frame(FRAME_HEADERS, FLAG_PADDED | 0x1, 1, &h));
        sent.extend(frame(FRAME_CONTINUATION, FLAG_END_HEADERS, 1, &[0x86]));
        client.write_all(&sent).await.unwrap();
        drop(client);
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        task.await.unwrap().unwrap();
        let mut want = PREFACE.to_vec();
        want.extend(settings);
        let mut block = vec![0x83, 0x41, 9];
        block.extend_from_slice(b"localhost");
        block.push(0x86);
        want.extend(frame(FRAME_HEADERS, FLAG_END_HEADERS | 0x1, 1, &block));
        assert_eq!(got, want);
    }

    #[tokio::test]
    async fn tells_the_kubelet_the_driver_and_its_host_endpoint() {
        let plugin = std::sync::Arc::new(RegistrationPlugin::new(
            "/var/lib/kubelet/plugins/csi.lull.io/csi.sock".into(),
        ));
        let info = plugin
            .get_info(Request::new(pb::InfoRequest {}))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(info.r#type, "CSIPlugin");
        assert_eq!(info.name, DRIVER_NAME);
        assert_eq!(
            info.endpoint,
            "/var/lib/kubelet/plugins/csi.lull.io/csi.sock"
        );
        assert_eq!(info.supported_versions, vec!["1.0.0".to_string()]);
        assert_eq!(plugin.status(), None);
        plugin
            .notify_registration_status(Request::new(pb::RegistrationStatus {
                plugin_registered: false,
                error: "no".into(),
            }))
            .await
            .unwrap();
        assert_eq!(plugin.status(), Some(Err("no".into())));
        plugin
            .notify_registration_status(Request::new(pb::RegistrationStatus {
                plugin_registered: true,
                error: String::new(),
            }))
            .await
            .unwrap();
        assert_eq!(plugin.status(), Some(Ok(())));
    }

    #[test]
    fn the_socket_is_named_after_the_driver() {
        let c = RegistrationConfig {
            dir: "/registration".into(),
            kubelet_endpoint: "/x".into(),
        };
        assert_eq!(
            c.socket(),
            PathBuf::from("/registration/csi.lull.io-reg.sock")
        );
    }
}
