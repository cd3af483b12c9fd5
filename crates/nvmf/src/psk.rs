//! NVMe/TCP's TLS pre-shared keys (TP 8011; NVMe TCP transport 1.1
//! §3.6), as SPDK's `include/spdk_internal/nvme_tcp.h` implements them:
//! the PSK interchange format a key file holds, the PSK identity a host
//! presents, and the two HKDF steps from the configured key to the key
//! TLS uses.
//!
//! ```
//! use lull_nvmf::psk::{self, Cipher};
//! // SPDK's unit-test key (32 bytes, retained hash SHA-256).
//! let k = psk::parse_interchange("NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:").unwrap();
//! assert_eq!(k.cipher(), Cipher::Aes128GcmSha256);
//! let id = psk::identity("nqn.2016-06.io.spdk:host1", "nqn.2016-06.io.spdk:cnode1", k.cipher());
//! assert_eq!(id, "NVMe0R01 nqn.2016-06.io.spdk:host1 nqn.2016-06.io.spdk:cnode1");
//! let retained = k.retained("nqn.2016-06.io.spdk:host1").unwrap();
//! let tls_key = psk::tls_psk(&retained, &id, k.cipher()).unwrap();
//! assert_eq!(tls_key.len(), 32);
//! ```
//!
//! - Interchange format: `NVMeTLSkey-1:HH:BASE64:` where BASE64 encodes
//!   the configured key (32 or 48 bytes) followed by its CRC-32 (IEEE,
//!   little endian), and HH is the hash that turns it into the retained
//!   key: `00` none (the configured key is the retained key), `01`
//!   SHA-256 (32-byte keys), `02` SHA-384 (48-byte keys).
//! - The key's length picks the TLS suite: 32 bytes
//!   TLS_AES_128_GCM_SHA256, 48 bytes TLS_AES_256_GCM_SHA384.
//! - Identity: `NVMe0R0S HOSTNQN SUBNQN`, S = 1 for the SHA-256 suite, 2
//!   for SHA-384 (`NVMe`, TLS 1.3 = `0`, retained key = `R`).
//! - Retained key: HKDF(hash, configured, HkdfLabel(len, "tls13 HostNQN",
//!   hostnqn)); TLS key: HKDF(suite hash, retained, HkdfLabel(len,
//!   "tls13 nvme-tls-psk", identity)), each with an empty salt, where
//!   HkdfLabel is RFC 8446's (a 2-byte big-endian length of the key put
//!   in, then the length-prefixed label and context).

use std::io::Read;
use std::path::{Path, PathBuf};

use lull_net::tls::{hkdf, HkdfHash, TlsError};

/// The interchange format's prefix (version 1).
pub const INTERCHANGE_PREFIX: &str = "NVMeTLSkey-1:";

/// Largest key file read: an interchange string is under 100 bytes, so a
/// larger file is the wrong file.
pub const MAX_KEY_FILE_BYTES: u64 = 4096;

/// The identity's prefix: NVMe, TLS 1.3 (0), a retained PSK (R).
pub const IDENTITY_PREFIX: &str = "NVMe0R";

/// Longest identity OpenSSL hands a server's PSK callback
/// (`PSK_MAX_IDENTITY_LEN`, 256, minus the NUL); SPDK refuses identities
/// over 255 bytes in its derivation too. `NVMe0R01 ` and two NQNs must
/// fit, so long NQNs leave no room: [`identity_fits`] checks.
pub const MAX_IDENTITY_LEN: usize = 255;

/// The hash of the interchange format's `HH` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetainedHash {
    /// `00`: the configured key is the retained key.
    None,
    /// `01`: HKDF-SHA-256.
    Sha256,
    /// `02`: HKDF-SHA-384.
    Sha384,
}

/// The TLS 1.3 suite a key is used with (from its length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cipher {
    /// 32-byte keys: TLS_AES_128_GCM_SHA256 (the one lull serves).
    Aes128GcmSha256,
    /// 48-byte keys: TLS_AES_256_GCM_SHA384.
    Aes256GcmSha384,
}

impl Cipher {
    fn hash(self) -> HkdfHash {
        match self {
            Cipher::Aes128GcmSha256 => HkdfHash::Sha256,
            Cipher::Aes256GcmSha384 => HkdfHash::Sha384,
        }
    }

    /// The identity's hash digits.
    fn digits(self) -> &'static str {
        match self {
            Cipher::Aes128GcmSha256 => "01",
            Cipher::Aes256GcmSha384 => "02",
        }
    }
}

/// Why a key in the interchange format was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("not a PSK interchange key: expected NVMeTLSkey-1:HH:BASE64:")]
    Format,
    #[error("unknown hash {0:02x} (00 none, 01 SHA-256, 02 SHA-384)")]
    UnknownHash(u8),
    #[error("the key is not valid base64")]
    Base64,
    #[error("the key decodes to {decoded} bytes: expected 32 or 48 bytes and a 4-byte CRC-32 (hash {hash:02x} wants {want})")]
    Length {
        decoded: usize,
        hash: u8,
        want: &'static str,
    },
    #[error("the key's CRC-32 is {stored:08x}, its bytes give {computed:08x}: a damaged or mistyped key")]
    Crc { stored: u32, computed: u32 },
}

/// A configured PSK: its bytes (32 or 48) and the hash to the retained
/// key. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct ConfiguredKey {
    bytes: Vec<u8>,
    hash: RetainedHash,
}

impl std::fmt::Debug for ConfiguredKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ConfiguredKey({} bytes, {:?})",
            self.bytes.len(),
            self.hash
        )
    }
}

impl Drop for ConfiguredKey {
    fn drop(&mut self) {
        self.bytes.fill(0);
    }
}

impl ConfiguredKey {
    /// The TLS suite this key is used with.
    pub fn cipher(&self) -> Cipher {
        if self.bytes.len() == 48 {
            Cipher::Aes256GcmSha384
        } else {
            Cipher::Aes128GcmSha256
        }
    }

    pub fn retained_hash(&self) -> RetainedHash {
        self.hash
    }

    /// The retained PSK for `hostnqn`.
    pub fn retained(&self, hostnqn: &str) -> Result<Vec<u8>, TlsError> {
        let hash = match self.hash {
            RetainedHash::None => return Ok(self.bytes.clone()),
            RetainedHash::Sha256 => HkdfHash::Sha256,
            RetainedHash::Sha384 => HkdfHash::Sha384,
        };
        hkdf(
            hash,
            &self.bytes,
            &hkdf_label(self.bytes.len(), "tls13 HostNQN", hostnqn.as_bytes()),
        )
    }
}

/// RFC 8446's HkdfLabel as SPDK builds it: the length of the key put in
/// (2 bytes, big endian), then the label and the context, each with a
/// one-byte length. Label and context are at most 255 bytes (NQNs are
/// at most 223, identities at most [`MAX_IDENTITY_LEN`]).
fn hkdf_label(key_len: usize, label: &str, context: &[u8]) -> Vec<u8> {
    debug_assert!(label.len() <= 255 && context.len() <= 255);
    let mut info = Vec::with_capacity(4 + label.len() + context.len());
    info.extend_from_slice(&(key_len as u16).to_be_bytes());
    info.push(label.len() as u8);
    info.extend_from_slice(label.as_bytes());
    info.push(context.len() as u8);
    info.extend_from_slice(context);
    info
}

/// The TLS PSK for `identity` from a retained key.
pub fn tls_psk(retained: &[u8], identity: &str, cipher: Cipher) -> Result<Vec<u8>, TlsError> {
    if identity.len() > MAX_IDENTITY_LEN {
        return Err(TlsError::Handshake(format!(
            "PSK identity longer than {MAX_IDENTITY_LEN} bytes"
        )));
    }
    hkdf(
        cipher.hash(),
        retained,
        &hkdf_label(retained.len(), "tls13 nvme-tls-psk", identity.as_bytes()),
    )
}

/// The PSK identity a host presents to a subsystem.
pub fn identity(hostnqn: &str, subnqn: &str, cipher: Cipher) -> String {
    format!("{IDENTITY_PREFIX}{} {hostnqn} {subnqn}", cipher.digits())
}

/// Whether the identity of `hostnqn` and `subnqn` is short enough for
/// OpenSSL and SPDK ([`MAX_IDENTITY_LEN`]).
pub fn identity_fits(hostnqn: &str, subnqn: &str) -> bool {
    IDENTITY_PREFIX.len() + 2 + 1 + hostnqn.len() + 1 + subnqn.len() <= MAX_IDENTITY_LEN
}

/// A PSK identity taken apart: (suite, host NQN, subsystem NQN). `None`
/// for anything else (an NQN holds no space, so the split is
/// unambiguous).
pub fn parse_identity(id: &[u8]) -> Option<(Cipher, &str, &str)> {
    let id = std::str::from_utf8(id).ok()?;
    let rest = id.strip_prefix(IDENTITY_PREFIX)?;
    let (digits, rest) = rest.split_once(' ')?;
    let cipher = match digits {
        "01" => Cipher::Aes128GcmSha256,
        "02" => Cipher::Aes256GcmSha384,
        _ => return None,
    };
    let (host, sub) = rest.split_once(' ')?;
    if host.is_empty() || sub.is_empty() || sub.contains(' ') {
        return None;
    }
    Some((cipher, host, sub))
}

/// Parse a key in the interchange format (surrounding whitespace, such
/// as a file's final newline, is ignored).
pub fn parse_interchange(text: &str) -> Result<ConfiguredKey, KeyError> {
    let text = text.trim();
    let rest = text
        .strip_prefix(INTERCHANGE_PREFIX)
        .ok_or(KeyError::Format)?;
    let rest = rest.strip_suffix(':').ok_or(KeyError::Format)?;
    let (hh, b64) = rest.split_once(':').ok_or(KeyError::Format)?;
    if hh.len() != 2 || b64.contains(':') {
        return Err(KeyError::Format);
    }
    let h = u8::from_str_radix(hh, 16).map_err(|_| KeyError::Format)?;
    let hash = match h {
        0 => RetainedHash::None,
        1 => RetainedHash::Sha256,
        2 => RetainedHash::Sha384,
        other => return Err(KeyError::UnknownHash(other)),
    };
    let mut decoded = decode_base64(b64).ok_or(KeyError::Base64)?;
    let (key_len, want) = match (hash, decoded.len()) {
        (RetainedHash::Sha256, 36) | (RetainedHash::None, 36) => (32, ""),
        (RetainedHash::Sha384, 52) | (RetainedHash::None, 52) => (48, ""),
        (RetainedHash::Sha256, n) => (n, "32"),
        (RetainedHash::Sha384, n) => (n, "48"),
        (RetainedHash::None, n) => (n, "32 or 48"),
    };
    if !want.is_empty() {
        decoded.fill(0);
        return Err(KeyError::Length {
            decoded: decoded.len(),
            hash: h,
            want,
        });
    }
    let stored = u32::from_le_bytes(decoded[key_len..key_len + 4].try_into().unwrap_or([0; 4]));
    let computed = crc32_ieee(&decoded[..key_len]);
    if stored != computed {
        decoded.fill(0);
        return Err(KeyError::Crc { stored, computed });
    }
    decoded[key_len..].fill(0);
    decoded.truncate(key_len);
    Ok(ConfiguredKey {
        bytes: decoded,
        hash,
    })
}

/// Format a key in the interchange format (for tests and docs; `nvme
/// gen-tls-key` makes the same string).
pub fn format_interchange(key: &[u8], hash: RetainedHash) -> String {
    let mut raw = key.to_vec();
    raw.extend_from_slice(&crc32_ieee(key).to_le_bytes());
    let hh = match hash {
        RetainedHash::None => 0,
        RetainedHash::Sha256 => 1,
        RetainedHash::Sha384 => 2,
    };
    let s = format!("{INTERCHANGE_PREFIX}{hh:02x}:{}:", encode_base64(&raw));
    raw.fill(0);
    s
}

/// Why a key file could not be used.
#[derive(Debug, thiserror::Error)]
#[error("NVMe/TCP PSK file {path}: {reason}")]
pub struct KeyFileError {
    pub path: PathBuf,
    pub reason: String,
}

/// Read a key file: one key in the interchange format (what `nvme
/// gen-tls-key` prints and SPDK's keyring_file reads).
pub fn load_key_file(path: &Path) -> Result<ConfiguredKey, KeyFileError> {
    let bad = |reason: String| KeyFileError {
        path: path.to_path_buf(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut text = String::new();
    file.take(MAX_KEY_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| bad(e.to_string()))?;
    if text.len() as u64 > MAX_KEY_FILE_BYTES {
        return Err(bad(format!("larger than {MAX_KEY_FILE_BYTES} bytes")));
    }
    let key = parse_interchange(&text).map_err(|e| bad(e.to_string()));
    // The text held the key in base64: do not leave it in freed memory.
    let mut bytes = text.into_bytes();
    bytes.fill(0);
    key
}

/// CRC-32 (IEEE 802.3, reflected, as zlib's `crc32`), the interchange
/// format's check.
pub fn crc32_ieee(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

const B64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

fn encode_base64(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(B64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Standard base64 with `=` padding, strictly: a length that is a
/// multiple of 4, padding only at the end.
fn decode_base64(s: &str) -> Option<Vec<u8>> {
    let s = s.as_bytes();
    if s.is_empty() || !s.len().is_multiple_of(4) {
        return None;
    }
    let value = |c: u8| B64.iter().position(|&x| x == c).map(|v| v as u32);
    let mut out = Vec::with_capacity(s.len() / 4 * 3);
    let quads = s.len() / 4;
    for (i, q) in s.chunks(4).enumerate() {
        let pad = q.iter().rev().take_while(|&&c| c == b'=').count();
        if pad > 2 || (pad > 0 && i + 1 != quads) {
            return None;
        }
        let mut n = 0u32;
        for &c in &q[..4 - pad] {
            n = (n << 6) | value(c)?;
        }
        n <<= 6 * pad as u32;
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPDK's unit-test key (test/unit/lib/nvmf/tcp.c/tcp_ut.c).
    const SPDK_KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
    /// SPDK's functional-test key (test/nvmf/host/async_init.sh): the
    /// ASCII of 00112233445566778899aabbccddeeff.
    const ASYNC_INIT_KEY: &str =
        "NVMeTLSkey-1:01:MDAxMTIyMzM0NDU1NjY3Nzg4OTlhYWJiY2NkZGVlZmZwJEiQ:";
    const HOST: &str = "nqn.2016-06.io.spdk:host1";
    const SUB: &str = "nqn.2016-06.io.spdk:cnode1";

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn spdk_keys_parse() {
        let k = parse_interchange(SPDK_KEY).unwrap();
        assert_eq!(k.retained_hash(), RetainedHash::Sha256);
        assert_eq!(k.cipher(), Cipher::Aes128GcmSha256);
        let k = parse_interchange(&format!("{ASYNC_INIT_KEY}\n")).unwrap();
        assert_eq!(k.bytes, b"00112233445566778899aabbccddeeff");
        assert!(!format!("{k:?}").contains("0011"), "keys never printed");
        assert_eq!(
            format_interchange(b"00112233445566778899aabbccddeeff", RetainedHash::Sha256),
            ASYNC_INIT_KEY
        );
    }

    #[test]
    fn bad_keys_are_refused_with_the_reason() {
        // One base64 digit changed: the CRC no longer matches.
        let bad = SPDK_KEY.replace("VRLb", "VRLc");
        assert!(matches!(parse_interchange(&bad), Err(KeyError::Crc { .. })));
        // Hash 02 wants 48 bytes; this one has 32.
        let wrong = SPDK_KEY.replace(":01:", ":02:");
        assert!(matches!(
            parse_interchange(&wrong),
            Err(KeyError::Length {
                decoded: 36,
                hash: 2,
                ..
            })
        ));
        // A 16-byte key is no NVMe key.
        let short = format_interchange(&[7u8; 16], RetainedHash::None);
        assert!(matches!(
            parse_interchange(&short),
            Err(KeyError::Length { decoded: 20, .. })
        ));
        assert_eq!(
            parse_interchange(&SPDK_KEY.replace(":01:", ":03:")),
            Err(KeyError::UnknownHash(3))
        );
        assert_eq!(
            parse_interchange(&SPDK_KEY.replace(":01:", ":zz:")),
            Err(KeyError::Format)
        );
        assert_eq!(
            parse_interchange(SPDK_KEY.trim_end_matches(':')),
            Err(KeyError::Format)
        );
        assert_eq!(
            parse_interchange("DHHC-1:01:VRLbtnN9:"),
            Err(KeyError::Format)
        );
        assert_eq!(
            parse_interchange("NVMeTLSkey-1:01:VRL*tnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"),
            Err(KeyError::Base64)
        );
        // 48-byte keys parse (the SHA-384 suite); serving them is refused
        // by the target, not here.
        let k48 = format_interchange(&[9u8; 48], RetainedHash::Sha384);
        assert_eq!(
            parse_interchange(&k48).unwrap().cipher(),
            Cipher::Aes256GcmSha384
        );
    }

    #[test]
    fn identity_matches_spdk() {
        // tcp_ut.c: test_nvmf_tcp_tls_generate_psk_id.
        assert_eq!(
            identity(HOST, SUB, Cipher::Aes128GcmSha256),
            "NVMe0R01 nqn.2016-06.io.spdk:host1 nqn.2016-06.io.spdk:cnode1"
        );
        let id = identity(HOST, SUB, Cipher::Aes256GcmSha384);
        assert_eq!(
            parse_identity(id.as_bytes()),
            Some((Cipher::Aes256GcmSha384, HOST, SUB))
        );
        assert_eq!(parse_identity(b"NVMe1R01 a b"), None);
        assert_eq!(parse_identity(b"NVMe0R03 a b"), None);
        assert_eq!(parse_identity(b"NVMe0R01 a"), None);
        assert_eq!(parse_identity(b"NVMe0R01 a b c"), None);
        assert!(identity_fits(HOST, SUB));
        assert!(!identity_fits(&"n".repeat(230), SUB));
    }

    /// Vectors computed independently of OpenSSL (Python's hmac and
    /// hashlib, RFC 5869 by hand) from SPDK's definition, for SPDK's
    /// unit-test key, host and subsystem.
    #[test]
    fn derivation_matches_known_vectors() {
        let k = parse_interchange(SPDK_KEY).unwrap();
        let retained = k.retained(HOST).unwrap();
        assert_eq!(hex(&retained), RETAINED_SPDK_KEY_HOST1);
        let id = identity(HOST, SUB, k.cipher());
        let t = tls_psk(&retained, &id, k.cipher()).unwrap();
        assert_eq!(hex(&t), TLS_PSK_SPDK_KEY_HOST1_CNODE1);
        // Hash 00: the configured key is the retained key.
        let k0 = parse_interchange(&format_interchange(
            b"00112233445566778899aabbccddeeff",
            RetainedHash::None,
        ))
        .unwrap();
        assert_eq!(
            k0.retained(HOST).unwrap(),
            b"00112233445566778899aabbccddeeff"
        );
        // Different suites give different keys (tcp_ut.c's check).
        let t384 = tls_psk(&retained, &id, Cipher::Aes256GcmSha384).unwrap();
        assert_eq!(t384.len(), 48);
        assert_ne!(&t384[..32], &t[..]);
    }

    const RETAINED_SPDK_KEY_HOST1: &str =
        "b984602631ba729339562d4d3fed69a588dbbbf14b74d7f3d1dd890093d5f607";
    const TLS_PSK_SPDK_KEY_HOST1_CNODE1: &str =
        "f68998173a208526b3e5b21ccca3f7d87c6d229af58bc59a04cc29459caa4ae8";

    proptest::proptest! {
        #[test]
        fn base64_round_trips(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 1..80)) {
            proptest::prop_assert_eq!(decode_base64(&encode_base64(&data)), Some(data));
        }

        #[test]
        fn parse_never_panics(s in "\\PC{0,120}") {
            let _ = parse_interchange(&s);
            let _ = parse_identity(s.as_bytes());
        }
    }
}
