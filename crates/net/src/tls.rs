//! TLS for lull's sockets (NBD's `NBD_OPT_STARTTLS`, the replica links),
//! through OpenSSL: X.509 certificates in qemu's `tls-creds-x509`
//! directory layout, or pre-shared keys in the `username:hexkey` file
//! format nbdkit and libnbd use (rustls has no external-PSK support).
//!
//! ```no_run
//! use lull_net::tls::{Creds, Role, TlsContext, TlsStream};
//! let ctx = TlsContext::new(&Creds::Psk("keys.psk".into()), Role::Server).unwrap();
//! let tcp = std::net::TcpStream::connect("127.0.0.1:10809").unwrap();
//! tcp.set_nonblocking(true).unwrap();
//! let mut tls = TlsStream::new(&ctx, tcp).unwrap();
//! // Drive it from the poller: `Ok(false)` means "wait for the socket
//! // (writable too when `wants_write()`) and call again".
//! while !tls.handshake().unwrap() {}
//! ```
//!
//! A [`TlsStream`] is a non-blocking `Read + Write`: OpenSSL's WANT_READ
//! and WANT_WRITE come out as `WouldBlock`, and [`TlsStream::wants_write`]
//! says when the socket must become writable before a read can go on (a
//! TLS 1.3 key update answered while reading). Writes may be partial and
//! may be retried from a moved buffer, as `OutQueue` does.
//!
//! Memory: OpenSSL holds a read and a write buffer of one TLS record
//! (16 KiB plus overhead) each, allocated at the handshake and kept while
//! the connection lives (docs/LIMITS.md).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslFiletype, SslMethod, SslMode, SslOptions,
    SslStream, SslVerifyMode, SslVersion,
};

/// Entries read from a PSK file. A key file lists the few identities
/// allowed to connect; past this it is rather a mistake (the wrong file).
pub const MAX_PSK_IDENTITIES: usize = 1024;

/// Largest PSK file read. [`MAX_PSK_IDENTITIES`] lines of a maximal
/// identity and key fit many times over.
pub const MAX_PSK_FILE_BYTES: u64 = 1 << 20;

/// Longest identity, OpenSSL's `PSK_MAX_IDENTITY_LEN` (256) minus the NUL.
pub const MAX_PSK_IDENTITY_LEN: usize = 255;

/// Longest key in bytes, OpenSSL's `PSK_MAX_PSK_LEN`; libnbd's
/// `psktool`-made keys are 32 bytes.
pub const MAX_PSK_KEY_BYTES: usize = 512;

/// Where the credentials come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Creds {
    /// A directory laid out as qemu's `tls-creds-x509`: `server-cert.pem`
    /// and `server-key.pem` for a server, `client-cert.pem` and
    /// `client-key.pem` for a client, `ca-cert.pem` to verify the peer.
    X509(PathBuf),
    /// A `username:hexkey` file (nbdkit's `--tls-psk`, libnbd's
    /// `tls-psk-file`).
    Psk(PathBuf),
}

/// Which end of the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Server,
    Client,
}

/// Why credentials could not be loaded or a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("{path} line {line}: {reason}")]
    PskFormat {
        path: PathBuf,
        line: usize,
        reason: &'static str,
    },
    #[error("{path}: {reason}")]
    Creds { path: PathBuf, reason: String },
    #[error("TLS setup failed: {0}")]
    Setup(#[from] openssl::error::ErrorStack),
    #[error("TLS handshake failed: {0}")]
    Handshake(String),
}

/// Keys of a PSK file, by identity.
#[derive(Clone, PartialEq, Eq)]
pub struct PskKeys {
    /// In file order: a client uses the first.
    entries: Vec<(String, Vec<u8>)>,
    by_identity: HashMap<String, usize>,
}

impl std::fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print a key.
        let names: Vec<&str> = self.entries.iter().map(|(n, _)| n.as_str()).collect();
        write!(f, "PskKeys({names:?})")
    }
}

impl PskKeys {
    /// Read a `username:hexkey` file: one entry a line; blank lines and
    /// lines starting with `#` are skipped.
    pub fn load(path: &Path) -> Result<PskKeys, TlsError> {
        let read_err = |source| TlsError::Read {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(read_err)?;
        let mut text = String::new();
        file.take(MAX_PSK_FILE_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(read_err)?;
        if text.len() as u64 > MAX_PSK_FILE_BYTES {
            return Err(TlsError::Creds {
                path: path.to_path_buf(),
                reason: format!("larger than {MAX_PSK_FILE_BYTES} bytes"),
            });
        }
        PskKeys::parse(&text).map_err(|(line, reason)| TlsError::PskFormat {
            path: path.to_path_buf(),
            line,
            reason,
        })
    }

    /// Parse a PSK file's text; an error names the 1-based line.
    pub fn parse(text: &str) -> Result<PskKeys, (usize, &'static str)> {
        let mut keys = PskKeys {
            entries: Vec::new(),
            by_identity: HashMap::new(),
        };
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((name, hex)) = line.split_once(':') else {
                return Err((n, "expected username:hexkey"));
            };
            if name.is_empty() || name.len() > MAX_PSK_IDENTITY_LEN || name.contains('\0') {
                return Err((n, "the username is empty, too long or holds a NUL"));
            }
            let key =
                decode_hex(hex.trim()).ok_or((n, "the key is not an even run of hex digits"))?;
            if key.is_empty() || key.len() > MAX_PSK_KEY_BYTES {
                return Err((n, "the key is empty or longer than 512 bytes"));
            }
            if keys.entries.len() == MAX_PSK_IDENTITIES {
                return Err((n, "more than 1024 entries"));
            }
            if keys.by_identity.contains_key(name) {
                return Err((n, "the username appears twice"));
            }
            keys.by_identity
                .insert(name.to_string(), keys.entries.len());
            keys.entries.push((name.to_string(), key));
        }
        if keys.entries.is_empty() {
            return Err((0, "no username:hexkey entry"));
        }
        Ok(keys)
    }

    /// The key of `identity`, if the file lists it.
    pub fn key(&self, identity: &str) -> Option<&[u8]> {
        self.by_identity
            .get(identity)
            .map(|&i| self.entries[i].1.as_slice())
    }

    /// The first entry: what a client presents.
    pub fn first(&self) -> (&str, &[u8]) {
        let (name, key) = &self.entries[0];
        (name, key)
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes()
        .chunks(2)
        .map(|p| Some((digit(p[0])? << 4) | digit(p[1])?))
        .collect()
}

/// Credentials loaded into an OpenSSL context, shared by every connection
/// of a server (or every link of an engine).
#[derive(Clone)]
pub struct TlsContext {
    ctx: SslContext,
    creds: Creds,
    role: Role,
    /// Client certificates are required and verified (X.509 with a CA).
    verifies_peer: bool,
}

impl std::fmt::Debug for TlsContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsContext({:?})", self.creds)
    }
}

impl TlsContext {
    /// Load `creds` for `role`. A server with X.509 credentials requires
    /// and verifies client certificates when `ca-cert.pem` is present; a
    /// client always verifies the server against `ca-cert.pem`.
    pub fn new(creds: &Creds, role: Role) -> Result<TlsContext, TlsError> {
        let method = match role {
            Role::Server => SslMethod::tls_server(),
            Role::Client => SslMethod::tls_client(),
        };
        let mut b = SslContext::builder(method)?;
        b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
        // No renegotiation (a write that needs reads mid-stream, and an
        // old attack surface); OutQueue retries a short write from a moved
        // buffer and is fine with partial writes.
        b.set_options(SslOptions::NO_RENEGOTIATION);
        b.set_mode(SslMode::ENABLE_PARTIAL_WRITE | SslMode::ACCEPT_MOVING_WRITE_BUFFER);
        if role == Role::Server {
            // No session resumption: sessions are long-lived block device
            // connections, and tickets would be bytes sent for nothing.
            b.set_num_tickets(0)?;
        }
        let verifies_peer = match creds {
            Creds::X509(dir) => x509(&mut b, dir, role)?,
            Creds::Psk(file) => {
                psk(&mut b, PskKeys::load(file)?, role);
                true
            }
        };
        Ok(TlsContext {
            ctx: b.build(),
            creds: creds.clone(),
            role,
            verifies_peer,
        })
    }

    pub fn creds(&self) -> &Creds {
        &self.creds
    }

    /// Whether the peer must prove who it is (PSK, or X.509 with a CA).
    pub fn verifies_peer(&self) -> bool {
        self.verifies_peer
    }
}

fn pem(dir: &Path, name: &str) -> Result<PathBuf, TlsError> {
    let path = dir.join(name);
    match std::fs::metadata(&path) {
        Ok(_) => Ok(path),
        Err(source) => Err(TlsError::Read { path, source }),
    }
}

fn x509(b: &mut SslContextBuilder, dir: &Path, role: Role) -> Result<bool, TlsError> {
    let (cert, key) = match role {
        Role::Server => ("server-cert.pem", "server-key.pem"),
        Role::Client => ("client-cert.pem", "client-key.pem"),
    };
    let bad = |path: &Path, e: openssl::error::ErrorStack| TlsError::Creds {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let cert = pem(dir, cert)?;
    b.set_certificate_chain_file(&cert)
        .map_err(|e| bad(&cert, e))?;
    let key = pem(dir, key)?;
    b.set_private_key_file(&key, SslFiletype::PEM)
        .map_err(|e| bad(&key, e))?;
    b.check_private_key().map_err(|e| bad(&key, e))?;
    let ca = dir.join("ca-cert.pem");
    let has_ca = ca.exists();
    if has_ca {
        b.set_ca_file(&ca).map_err(|e| bad(&ca, e))?;
    }
    match (role, has_ca) {
        (Role::Server, true) => {
            b.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT)
        }
        (Role::Server, false) => b.set_verify(SslVerifyMode::NONE),
        (Role::Client, true) => b.set_verify(SslVerifyMode::PEER),
        (Role::Client, false) => {
            return Err(TlsError::Creds {
                path: ca,
                reason: "a client needs the CA to verify the server".into(),
            })
        }
    }
    Ok(has_ca)
}

fn psk(b: &mut SslContextBuilder, keys: PskKeys, role: Role) {
    match role {
        Role::Server => b.set_psk_server_callback(move |_ssl, identity, out| {
            let key = identity
                .and_then(|id| std::str::from_utf8(id).ok())
                .and_then(|id| keys.key(id));
            match key {
                Some(k) if k.len() <= out.len() => {
                    out[..k.len()].copy_from_slice(k);
                    Ok(k.len())
                }
                // An unknown identity: 0 bytes of key fails the handshake.
                _ => Ok(0),
            }
        }),
        Role::Client => b.set_psk_client_callback(move |_ssl, _hint, id_out, key_out| {
            let (name, key) = keys.first();
            // The identity goes out NUL-terminated; both lengths are
            // within OpenSSL's buffers (MAX_PSK_IDENTITY_LEN, MAX_PSK_KEY_BYTES).
            if name.len() >= id_out.len() || key.len() > key_out.len() {
                return Ok(0);
            }
            id_out[..name.len()].copy_from_slice(name.as_bytes());
            id_out[name.len()] = 0;
            key_out[..key.len()].copy_from_slice(key);
            Ok(key.len())
        }),
    }
}

/// The TLS 1.3 suite of [`ExternalPskContext`]: OpenSSL's PSK callbacks
/// give TLS 1.3 a key without a hash, which it uses with the SHA-256 suite
/// only; NVMe/TCP names this suite for 32-byte keys (TP 8011).
pub const EXTERNAL_PSK_CIPHERSUITE: &str = "TLS_AES_128_GCM_SHA256";

/// TLS 1.3 with external pre-shared keys looked up per identity by the
/// caller (NVMe/TCP's TLS, TP 8011): no certificates, one cipher suite
/// ([`EXTERNAL_PSK_CIPHERSUITE`]), no session tickets, nothing older than
/// TLS 1.3. Unlike [`TlsContext`]'s `username:hexkey` files, the caller
/// computes each key from the identity (NVMe derives it from the host's
/// configured key and the identity itself).
#[derive(Clone)]
pub struct ExternalPskContext {
    ctx: SslContext,
    role: Role,
}

impl std::fmt::Debug for ExternalPskContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExternalPskContext({:?})", self.role)
    }
}

/// Where a server session keeps the identity its client presented:
/// OpenSSL records none for a TLS 1.3 PSK found through the server
/// callback (`SSL_get_psk_identity` returns NULL then), so the callback
/// keeps it. One process-wide index (OpenSSL's indexes are never freed).
fn identity_index() -> Result<openssl::ex_data::Index<Ssl, String>, TlsError> {
    static INDEX: std::sync::OnceLock<openssl::ex_data::Index<Ssl, String>> =
        std::sync::OnceLock::new();
    if let Some(i) = INDEX.get() {
        return Ok(*i);
    }
    let i = Ssl::new_ex_index::<String>()?;
    Ok(*INDEX.get_or_init(|| i))
}

fn tls13_only(role: Role) -> Result<SslContextBuilder, TlsError> {
    let method = match role {
        Role::Server => SslMethod::tls_server(),
        Role::Client => SslMethod::tls_client(),
    };
    let mut b = SslContext::builder(method)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
    b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
    b.set_ciphersuites(EXTERNAL_PSK_CIPHERSUITE)?;
    b.set_options(SslOptions::NO_RENEGOTIATION | SslOptions::NO_TICKET);
    b.set_mode(SslMode::ENABLE_PARTIAL_WRITE | SslMode::ACCEPT_MOVING_WRITE_BUFFER);
    if role == Role::Server {
        b.set_num_tickets(0)?;
    }
    Ok(b)
}

impl ExternalPskContext {
    /// A server context: `key_of(identity)` returns the key for the
    /// identity a client presents, or `None` to fail the handshake (an
    /// unknown identity is the caller's to log). Keys longer than
    /// [`MAX_PSK_KEY_BYTES`] fail the handshake too.
    pub fn server<F>(key_of: F) -> Result<ExternalPskContext, TlsError>
    where
        F: Fn(&[u8]) -> Option<Vec<u8>> + Send + Sync + 'static,
    {
        let mut b = tls13_only(Role::Server)?;
        let index = identity_index()?;
        b.set_psk_server_callback(move |ssl, identity, out| {
            let Some(identity) = identity else {
                return Ok(0);
            };
            if identity.len() <= MAX_PSK_IDENTITY_LEN {
                ssl.set_ex_data(index, String::from_utf8_lossy(identity).into_owned());
            }
            let Some(mut key) = key_of(identity) else {
                return Ok(0);
            };
            let n = key.len();
            let fits = n <= out.len();
            if fits {
                out[..n].copy_from_slice(&key);
            }
            // Do not leave key bytes in a freed allocation.
            key.fill(0);
            Ok(if fits { n } else { 0 })
        });
        Ok(ExternalPskContext {
            ctx: b.build(),
            role: Role::Server,
        })
    }

    /// A client context presenting `identity` with `key` (tests, tools).
    pub fn client(identity: &str, key: &[u8]) -> Result<ExternalPskContext, TlsError> {
        if identity.len() > MAX_PSK_IDENTITY_LEN || key.is_empty() || key.len() > MAX_PSK_KEY_BYTES
        {
            return Err(TlsError::Handshake(
                "PSK identity or key too long, or an empty key".into(),
            ));
        }
        let mut b = tls13_only(Role::Client)?;
        let identity = identity.to_string();
        let key = key.to_vec();
        b.set_psk_client_callback(move |_ssl, _hint, id_out, key_out| {
            if identity.len() >= id_out.len() || key.len() > key_out.len() {
                return Ok(0);
            }
            id_out[..identity.len()].copy_from_slice(identity.as_bytes());
            id_out[identity.len()] = 0;
            key_out[..key.len()].copy_from_slice(&key);
            Ok(key.len())
        });
        Ok(ExternalPskContext {
            ctx: b.build(),
            role: Role::Client,
        })
    }
}

/// The hash an [`hkdf`] runs over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HkdfHash {
    Sha256,
    Sha384,
}

impl HkdfHash {
    /// The hash's output length in bytes.
    pub fn len_bytes(self) -> usize {
        match self {
            HkdfHash::Sha256 => 32,
            HkdfHash::Sha384 => 48,
        }
    }
}

/// HKDF (RFC 5869): Extract with an empty salt, then Expand with `info`
/// to the hash's length, as OpenSSL's `EVP_PKEY_HKDF` does in its default
/// mode (what SPDK's `nvme_tcp_derive_*_psk` call).
pub fn hkdf(hash: HkdfHash, ikm: &[u8], info: &[u8]) -> Result<Vec<u8>, TlsError> {
    use openssl::md::Md;
    use openssl::pkey::Id;
    use openssl::pkey_ctx::PkeyCtx;
    let md = match hash {
        HkdfHash::Sha256 => Md::sha256(),
        HkdfHash::Sha384 => Md::sha384(),
    };
    let mut ctx = PkeyCtx::new_id(Id::HKDF)?;
    ctx.derive_init()?;
    ctx.set_hkdf_md(md)?;
    ctx.set_hkdf_key(ikm)?;
    ctx.set_hkdf_salt(&[])?;
    ctx.add_hkdf_info(info)?;
    let mut out = vec![0u8; hash.len_bytes()];
    let n = ctx.derive(Some(&mut out))?;
    out.truncate(n);
    Ok(out)
}

/// Largest plaintext of one TLS record (RFC 8446 §5.1): what
/// [`TlsStream::write_coalesced`] gathers into one record at most.
pub const MAX_RECORD_PLAINTEXT_BYTES: usize = 16 * 1024;

/// A TLS session over a non-blocking stream.
pub struct TlsStream<S> {
    ssl: SslStream<S>,
    /// Small slices gathered into one record ([`TlsStream::write_coalesced`]);
    /// empty until the first use, then [`MAX_RECORD_PLAINTEXT_BYTES`].
    gather: Vec<u8>,
    established: bool,
    /// The last operation stopped because the socket could not take the
    /// bytes OpenSSL had to send: wait for writability.
    wants_write: bool,
}

impl<S> std::fmt::Debug for TlsStream<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsStream(established: {})", self.established)
    }
}

impl<S: Read + Write> TlsStream<S> {
    /// A session on `stream`, as the server or the client `ctx` was built
    /// for; the handshake runs through [`TlsStream::handshake`].
    pub fn new(ctx: &TlsContext, stream: S) -> Result<TlsStream<S>, TlsError> {
        TlsStream::with_ssl(Ssl::new(&ctx.ctx)?, stream, ctx.role)
    }

    /// A client session that also checks the server's certificate names
    /// `ip` (X.509; a PSK proves itself).
    pub fn client_for_ip(
        ctx: &TlsContext,
        stream: S,
        ip: std::net::IpAddr,
    ) -> Result<TlsStream<S>, TlsError> {
        let mut ssl = Ssl::new(&ctx.ctx)?;
        if matches!(ctx.creds, Creds::X509(_)) {
            ssl.param_mut().set_ip(ip)?;
        }
        TlsStream::with_ssl(ssl, stream, ctx.role)
    }

    /// A server session for an external-PSK context (NVMe/TCP's TLS).
    pub fn external_psk(ctx: &ExternalPskContext, stream: S) -> Result<TlsStream<S>, TlsError> {
        TlsStream::with_ssl(Ssl::new(&ctx.ctx)?, stream, ctx.role)
    }

    fn with_ssl(mut ssl: Ssl, stream: S, role: Role) -> Result<TlsStream<S>, TlsError> {
        // A server context accepts, a client context connects.
        match role {
            Role::Server => ssl.set_accept_state(),
            Role::Client => ssl.set_connect_state(),
        }
        Ok(TlsStream {
            ssl: SslStream::new(ssl, stream)?,
            gather: Vec::new(),
            established: false,
            wants_write: false,
        })
    }

    /// Advance the handshake: `Ok(true)` once it is done, `Ok(false)` when
    /// it waits for the socket (writable too if [`TlsStream::wants_write`]).
    pub fn handshake(&mut self) -> Result<bool, TlsError> {
        if self.established {
            return Ok(true);
        }
        match self.ssl.do_handshake() {
            Ok(()) => {
                self.established = true;
                self.wants_write = false;
                Ok(true)
            }
            Err(e) => match e.code() {
                ErrorCode::WANT_READ => {
                    self.wants_write = false;
                    Ok(false)
                }
                ErrorCode::WANT_WRITE => {
                    self.wants_write = true;
                    Ok(false)
                }
                _ => Err(TlsError::Handshake(describe(&e))),
            },
        }
    }

    pub fn is_established(&self) -> bool {
        self.established
    }

    /// Whether the socket must become writable before the session can go
    /// on (see the module doc).
    pub fn wants_write(&self) -> bool {
        self.wants_write
    }

    /// Plaintext decrypted and not yet read: no socket event will announce
    /// it, so a reader that stops with some pending must come back by
    /// itself.
    pub fn pending(&self) -> usize {
        self.ssl.ssl().pending()
    }

    pub fn get_ref(&self) -> &S {
        self.ssl.get_ref()
    }

    /// The identity a PSK client presented (for log lines; for an
    /// [`ExternalPskContext`] server, the identity whose key the
    /// handshake proved).
    pub fn psk_identity(&self) -> Option<String> {
        let ssl = self.ssl.ssl();
        if let Some(id) = ssl.psk_identity() {
            return Some(String::from_utf8_lossy(id).into_owned());
        }
        let index = identity_index().ok()?;
        ssl.ex_data(index).cloned()
    }

    /// `write_vectored` that puts small slices into one record: a frame
    /// header, a small payload and the next frame's header go out as one
    /// record (one `send`, one record for the peer to open) where
    /// `Write::write_vectored` makes one record of each. When the first
    /// non-empty slice is shorter than a record, slices are copied
    /// together up to [`MAX_RECORD_PLAINTEXT_BYTES`]; a larger first slice
    /// is written as it is. A retry after `WouldBlock` is given the same
    /// bytes first (the queue has not moved) and at least as many, as
    /// OpenSSL requires of a repeated write.
    pub fn write_coalesced(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let Some(first) = bufs.iter().find(|b| !b.is_empty()) else {
            return Ok(0);
        };
        if first.len() >= MAX_RECORD_PLAINTEXT_BYTES || bufs.len() == 1 {
            return self.write(first);
        }
        let mut gather = std::mem::take(&mut self.gather);
        gather.clear();
        gather.reserve_exact(MAX_RECORD_PLAINTEXT_BYTES);
        for b in bufs {
            let room = MAX_RECORD_PLAINTEXT_BYTES - gather.len();
            if room == 0 {
                break;
            }
            gather.extend_from_slice(&b[..b.len().min(room)]);
        }
        let r = self.write(&gather);
        self.gather = gather;
        r
    }

    /// Map an OpenSSL error of a read or write: `Ok(0)` at the end of the
    /// stream, `WouldBlock` for WANT_READ/WANT_WRITE.
    fn io_result(&mut self, e: openssl::ssl::Error) -> io::Result<usize> {
        match e.code() {
            ErrorCode::ZERO_RETURN => Ok(0),
            ErrorCode::WANT_READ => {
                self.wants_write = false;
                Err(io::ErrorKind::WouldBlock.into())
            }
            ErrorCode::WANT_WRITE => {
                self.wants_write = true;
                Err(io::ErrorKind::WouldBlock.into())
            }
            // The peer closed the socket without a close_notify.
            ErrorCode::SYSCALL if e.io_error().is_none() => Ok(0),
            _ => {
                let text = describe(&e);
                Err(e.into_io_error().unwrap_or_else(|_| io::Error::other(text)))
            }
        }
    }
}

/// An OpenSSL error as one line: the reason and, when there is one, the
/// library's error stack (e.g. "certificate verify failed").
fn describe(e: &openssl::ssl::Error) -> String {
    match (e.io_error(), e.ssl_error()) {
        (Some(io), _) => io.to_string(),
        (None, Some(stack)) => stack.to_string(),
        (None, None) if e.code() == ErrorCode::SYSCALL => "the peer closed the connection".into(),
        (None, None) => e.to_string(),
    }
}

impl<S: Read + Write> Read for TlsStream<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.ssl.ssl_read(buf) {
                Ok(n) => {
                    self.wants_write = false;
                    return Ok(n);
                }
                // A record without application data (a session ticket, a
                // key update) was consumed: go on while the socket has
                // bytes, so none are left unannounced.
                Err(e) if e.code() == ErrorCode::WANT_READ && e.io_error().is_none() => {}
                Err(e) => return self.io_result(e),
            }
        }
    }
}

impl<S: Read + Write> Write for TlsStream<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        match self.ssl.ssl_write(buf) {
            Ok(n) => {
                self.wants_write = false;
                Ok(n)
            }
            Err(e) => match self.io_result(e) {
                // A write that meets the end of the stream: the peer left.
                Ok(_) => Err(io::ErrorKind::BrokenPipe.into()),
                other => other,
            },
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_file_parses_and_refuses_bad_lines() {
        let k = PskKeys::parse("# keys\nalice:00ff10\n\nbob:DEADBEEF\n").unwrap();
        assert_eq!(k.key("alice"), Some(&[0x00, 0xff, 0x10][..]));
        assert_eq!(k.key("bob"), Some(&[0xde, 0xad, 0xbe, 0xef][..]));
        assert_eq!(k.key("carol"), None);
        assert_eq!(k.first().0, "alice");
        assert!(!format!("{k:?}").contains("ff"), "keys never printed");
        assert_eq!(PskKeys::parse("alice").unwrap_err().0, 1);
        assert_eq!(PskKeys::parse("a:0\n").unwrap_err().0, 1);
        assert_eq!(PskKeys::parse("a:zz\n").unwrap_err().0, 1);
        assert_eq!(PskKeys::parse("a:00\n:00\n").unwrap_err().0, 2);
        assert_eq!(PskKeys::parse("a:00\na:11\n").unwrap_err().0, 2);
        assert_eq!(PskKeys::parse("a:\n").unwrap_err().0, 1);
        assert_eq!(PskKeys::parse("\n# none\n").unwrap_err().0, 0);
    }

    /// RFC 5869 test case 3 (SHA-256, empty salt and info): the first 32
    /// bytes of its OKM are T(1), what [`hkdf`] returns.
    #[test]
    fn hkdf_matches_rfc_5869() {
        let okm = hkdf(HkdfHash::Sha256, &[0x0b; 22], &[]).unwrap();
        let hex: String = okm.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d"
        );
        assert_eq!(hkdf(HkdfHash::Sha384, b"k", b"i").unwrap().len(), 48);
    }

    /// A blocking handshake of `client` against `server` over a socket
    /// pair; the server's result, after one line echoed when it succeeds.
    fn external_psk_session(client: ExternalPskContext, server: ExternalPskContext) -> bool {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            let mut c = TlsStream::external_psk(&client, a).unwrap();
            // The client's context is a client: it connects.
            while !c.handshake().unwrap_or(true) {}
            let _ = c.write(b"ping");
        });
        let mut s = TlsStream::external_psk(&server, b).unwrap();
        let ok = loop {
            match s.handshake() {
                Ok(true) => break true,
                Ok(false) => {}
                Err(_) => break false,
            }
        };
        if ok {
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).unwrap();
            assert_eq!(&buf, b"ping");
            assert_eq!(s.psk_identity().as_deref(), Some("id-1"));
        }
        drop(s);
        t.join().unwrap();
        ok
    }

    #[test]
    fn external_psk_handshakes_with_the_right_key_only() {
        let server =
            || ExternalPskContext::server(|id| (id == b"id-1").then(|| vec![7u8; 32])).unwrap();
        let right = ExternalPskContext::client("id-1", &[7u8; 32]).unwrap();
        assert!(external_psk_session(right, server()));
        let wrong = ExternalPskContext::client("id-1", &[8u8; 32]).unwrap();
        assert!(!external_psk_session(wrong, server()));
        let unknown = ExternalPskContext::client("id-2", &[7u8; 32]).unwrap();
        assert!(!external_psk_session(unknown, server()));
    }
}
