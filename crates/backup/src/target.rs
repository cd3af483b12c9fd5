//! Backup targets: where backups go. `s3://BUCKET/PREFIX?endpoint=URL&region=R`
//! (any S3-compatible server; path-style requests, which self-hosted
//! servers need) or `file:///DIR` (a directory: an NFS mount in a
//! cluster), both through the `object_store` crate's one API.
//!
//! ```
//! use lull_backup::target::TargetUrl;
//! let u = TargetUrl::parse("s3://backups/cluster-a?endpoint=https://s3.local:9000&region=eu-1")?;
//! assert_eq!(u, TargetUrl::S3 {
//!     bucket: "backups".into(),
//!     prefix: "cluster-a".into(),
//!     endpoint: Some("https://s3.local:9000".into()),
//!     region: "eu-1".into(),
//! });
//! assert!(TargetUrl::parse("file://relative").is_err());
//! # Ok::<(), lull_backup::BackupError>(())
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use serde::{Deserialize, Serialize};

use crate::format::{self, ChunkCodec, Key, Marker};
use crate::BackupError;

/// Region when the URL names none (what S3-compatible servers accept).
pub const DEFAULT_REGION: &str = "us-east-1";

/// Longest target URL (a bucket is at most 63 bytes, a path PATH_MAX).
pub const MAX_URL_LEN: usize = 4096 + 256;

/// Longest target name; names are `[A-Za-z0-9._-]`.
pub const MAX_TARGET_NAME_LEN: usize = 64;

/// One request to the target, connect to last byte: a 2 MiB chunk over a
/// slow 1 MB/s link takes 2 s; past 60 s the target is taken as gone.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Connecting to the target: an unreachable one is known in 5 s.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Retries of one request (transient errors: 5xx, resets, timeouts):
/// object_store's default is 10 over 3 minutes, which hides an
/// unreachable target from an operator for that long; 3 retries over at
/// most 15 s ride out a restart of the server, and then the job fails
/// with the reason.
pub const REQUEST_RETRIES: usize = 3;
pub const RETRY_TIMEOUT: Duration = Duration::from_secs(15);

/// Longest credentials, CA or key file read (a CA bundle is ~200 KiB).
pub const MAX_SECRET_FILE_BYTES: u64 = 1 << 20;

/// A parsed target URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetUrl {
    S3 {
        bucket: String,
        prefix: String,
        endpoint: Option<String>,
        region: String,
    },
    File {
        dir: PathBuf,
    },
}

impl TargetUrl {
    pub fn parse(url: &str) -> Result<TargetUrl, BackupError> {
        let bad = |why: &str| Err(BackupError::Config(format!("target url {url:?}: {why}")));
        if url.len() > MAX_URL_LEN {
            return bad("too long");
        }
        if let Some(path) = url.strip_prefix("file://") {
            if !path.starts_with('/') {
                return bad("file:// takes an absolute directory (file:///DIR)");
            }
            return Ok(TargetUrl::File { dir: path.into() });
        }
        let Some(rest) = url.strip_prefix("s3://") else {
            return bad("s3://BUCKET/PREFIX?endpoint=URL&region=R or file:///DIR expected");
        };
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !bucket_ok {
            return bad("bucket: 3 to 63 of a-z, 0-9, '-', '.'");
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|p| p == "." || p == "..") {
            return bad("prefix with . or ..");
        }
        let (mut endpoint, mut region) = (None, DEFAULT_REGION.to_string());
        for kv in query.split('&').filter(|s| !s.is_empty()) {
            match kv.split_once('=') {
                Some(("endpoint", v)) if v.starts_with("http://") || v.starts_with("https://") => {
                    endpoint = Some(v.to_string())
                }
                Some(("endpoint", _)) => return bad("endpoint must be an http:// or https:// URL"),
                Some(("region", v)) if !v.is_empty() => region = v.to_string(),
                _ => {
                    return bad(&format!(
                        "unknown query parameter {kv:?} (endpoint, region)"
                    ))
                }
            }
        }
        Ok(TargetUrl::S3 {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            endpoint,
            region,
        })
    }
}

/// A target as configured (`backup_target_add`): what a node records in
/// its state. Secrets stay in the files it names; only paths are kept.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    pub name: String,
    pub url: String,
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

/// Checks a target name.
pub fn check_target_name(name: &str) -> Result<(), BackupError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_TARGET_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(BackupError::Config(format!(
            "target name {name:?}: 1 to {MAX_TARGET_NAME_LEN} of A-Z, a-z, 0-9, '.', '_', '-'"
        )))
    }
}

/// An opened target: the store, the prefix and the chunk codec.
#[derive(Clone, Debug)]
pub struct Target {
    pub config: TargetConfig,
    pub store: Arc<dyn ObjectStore>,
    prefix: String,
    pub codec: ChunkCodec,
}

fn read_secret(what: &str, path: &std::path::Path) -> Result<Vec<u8>, BackupError> {
    use std::io::Read;
    let f = std::fs::File::open(path)
        .map_err(|e| BackupError::Config(format!("{what} {}: {e}", path.display())))?;
    let mut buf = Vec::new();
    f.take(MAX_SECRET_FILE_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| BackupError::Config(format!("{what} {}: {e}", path.display())))?;
    if buf.len() as u64 > MAX_SECRET_FILE_BYTES {
        return Err(BackupError::Config(format!(
            "{what} {}: longer than {MAX_SECRET_FILE_BYTES} bytes",
            path.display()
        )));
    }
    Ok(buf)
}

/// `access_key_id` and `secret_access_key` from a credentials file:
/// `KEY = VALUE` lines (quotes around the value and `#` comments
/// allowed), or the environment (`AWS_ACCESS_KEY_ID`,
/// `AWS_SECRET_ACCESS_KEY`) when no file is named.
fn credentials(file: Option<&std::path::Path>) -> Result<Option<(String, String)>, BackupError> {
    let Some(path) = file else {
        return Ok(
            match (
                std::env::var("AWS_ACCESS_KEY_ID"),
                std::env::var("AWS_SECRET_ACCESS_KEY"),
            ) {
                (Ok(a), Ok(s)) => Some((a, s)),
                _ => None,
            },
        );
    };
    let text = String::from_utf8(read_secret("credentials file", path)?).map_err(|_| {
        BackupError::Config(format!("credentials file {}: not UTF-8", path.display()))
    })?;
    let (mut id, mut secret) = (None, None);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with('[') {
            continue;
        }
        let Some((k, v)) = line.split_once('=').or_else(|| line.split_once(':')) else {
            continue;
        };
        let v = v.trim().trim_matches('"').to_string();
        match k.trim() {
            "access_key_id" | "aws_access_key_id" => id = Some(v),
            "secret_access_key" | "aws_secret_access_key" => secret = Some(v),
            _ => {}
        }
    }
    match (id, secret) {
        (Some(a), Some(s)) => Ok(Some((a, s))),
        _ => Err(BackupError::Config(format!(
            "credentials file {}: needs access_key_id and secret_access_key",
            path.display()
        ))),
    }
}

impl Target {
    /// Opens a target (no request is made yet: see [`Target::check`]).
    pub fn open(config: TargetConfig) -> Result<Target, BackupError> {
        check_target_name(&config.name)?;
        let codec = match &config.key_file {
            Some(f) => ChunkCodec::encrypted(Key::from_file_bytes(&read_secret("key file", f)?)?),
            None => ChunkCodec::plain(),
        };
        let (store, prefix): (Arc<dyn ObjectStore>, String) = match TargetUrl::parse(&config.url)? {
            TargetUrl::File { dir } => {
                if config.credentials_file.is_some() || config.ca_file.is_some() {
                    return Err(BackupError::Config(
                        "a file:// target takes no credentials_file or ca_file".into(),
                    ));
                }
                // A missing directory is refused rather than made: an NFS
                // mount that is not there must not become a local one.
                if !dir.is_dir() {
                    return Err(BackupError::Config(format!(
                        "target directory {} does not exist (or is not a directory)",
                        dir.display()
                    )));
                }
                let fs = object_store::local::LocalFileSystem::new_with_prefix(&dir)
                    .map_err(|e| BackupError::Config(format!("{}: {e}", dir.display())))?;
                (Arc::new(fs), String::new())
            }
            TargetUrl::S3 {
                bucket,
                prefix,
                endpoint,
                region,
            } => {
                let mut client = object_store::ClientOptions::new()
                    .with_timeout(REQUEST_TIMEOUT)
                    .with_connect_timeout(CONNECT_TIMEOUT);
                if let Some(ca) = &config.ca_file {
                    let pem = read_secret("ca file", ca)?;
                    for cert in object_store::Certificate::from_pem_bundle(&pem).map_err(|e| {
                        BackupError::Config(format!("ca file {}: {e}", ca.display()))
                    })? {
                        client = client.with_root_certificate(cert);
                    }
                }
                let mut b = object_store::aws::AmazonS3Builder::new()
                    .with_bucket_name(&bucket)
                    .with_region(&region)
                    .with_virtual_hosted_style_request(false)
                    .with_retry(object_store::RetryConfig {
                        max_retries: REQUEST_RETRIES,
                        retry_timeout: RETRY_TIMEOUT,
                        ..Default::default()
                    });
                if let Some(e) = &endpoint {
                    client = client.with_allow_http(e.starts_with("http://"));
                    b = b.with_endpoint(e);
                }
                match credentials(config.credentials_file.as_deref())? {
                    Some((id, secret)) => {
                        b = b.with_access_key_id(id).with_secret_access_key(secret)
                    }
                    None => b = b.with_skip_signature(true),
                }
                let s3 = b
                    .with_client_options(client)
                    .build()
                    .map_err(|e| BackupError::Config(format!("target {}: {e}", config.name)))?;
                (Arc::new(s3), prefix)
            }
        };
        Ok(Target {
            config,
            store,
            prefix,
            codec,
        })
    }

    /// The object path of `rel` under the prefix.
    pub fn path(&self, rel: &str) -> ObjPath {
        if self.prefix.is_empty() {
            ObjPath::from(rel)
        } else {
            ObjPath::from(format!("{}/{rel}", self.prefix))
        }
    }

    /// Reads the marker, or writes it on a target nobody used yet;
    /// refuses a target of another format, chunk size or key.
    pub async fn check(&self) -> Result<Marker, BackupError> {
        let want = Marker {
            format: format::FORMAT_VERSION,
            chunk_bytes: format::CHUNK_BYTES,
            encrypted: self.codec.is_encrypted(),
            key_check: self.key_check(),
        };
        let path = self.path(format::MARKER);
        let found = match self.store.get(&path).await {
            Ok(r) => Some(r.bytes().await.map_err(|e| self.error(e))?),
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => return Err(self.error(e)),
        };
        let Some(bytes) = found else {
            let body = serde_json::to_vec_pretty(&want).expect("marker serializes");
            let put = object_store::PutOptions::from(object_store::PutMode::Create);
            match self
                .store
                .put_opts(&path, PutPayload::from(body), put)
                .await
            {
                // Another node wrote it first: check theirs.
                Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => {}
                // Some servers do not do conditional PUTs: a plain one.
                Err(object_store::Error::NotImplemented { .. }) => {
                    let body = serde_json::to_vec_pretty(&want).expect("marker serializes");
                    self.store
                        .put(&path, PutPayload::from(body))
                        .await
                        .map_err(|e| self.error(e))?;
                }
                Err(e) => return Err(self.error(e)),
            }
            return Box::pin(self.check_existing()).await;
        };
        self.compare_marker(&bytes, &want)
    }

    async fn check_existing(&self) -> Result<Marker, BackupError> {
        let want = Marker {
            format: format::FORMAT_VERSION,
            chunk_bytes: format::CHUNK_BYTES,
            encrypted: self.codec.is_encrypted(),
            key_check: self.key_check(),
        };
        let r = self
            .store
            .get(&self.path(format::MARKER))
            .await
            .map_err(|e| self.error(e))?;
        let bytes = r.bytes().await.map_err(|e| self.error(e))?;
        self.compare_marker(&bytes, &want)
    }

    fn compare_marker(&self, bytes: &[u8], want: &Marker) -> Result<Marker, BackupError> {
        let have: Marker = serde_json::from_slice(bytes).map_err(|e| {
            BackupError::Corrupt(format!("target {}: marker: {e}", self.config.name))
        })?;
        let name = &self.config.name;
        if have.format != want.format || have.chunk_bytes != want.chunk_bytes {
            return Err(BackupError::Config(format!(
                "target {name}: format {} with {}-byte chunks; this lull writes format {} with {}-byte chunks",
                have.format, have.chunk_bytes, want.format, want.chunk_bytes
            )));
        }
        match (have.encrypted, want.encrypted) {
            (true, false) => Err(BackupError::Config(format!(
                "target {name} is encrypted: give its key_file"
            ))),
            (false, true) => Err(BackupError::Config(format!(
                "target {name} is not encrypted: it takes no key_file"
            ))),
            _ if have.key_check != want.key_check => Err(BackupError::Config(format!(
                "target {name}: the key_file holds another key than the target's"
            ))),
            _ => Ok(have),
        }
    }

    fn key_check(&self) -> Option<String> {
        self.codec.key_check()
    }

    /// An object store error as this target's.
    pub fn error(&self, e: object_store::Error) -> BackupError {
        BackupError::Target {
            target: self.config.name.clone(),
            source: Box::new(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            TargetUrl::parse("s3://bucket").unwrap(),
            TargetUrl::S3 {
                bucket: "bucket".into(),
                prefix: "".into(),
                endpoint: None,
                region: DEFAULT_REGION.into()
            }
        );
        for bad in [
            "s3://B",
            "s3://ok-bucket/a/../b",
            "s3://ok-bucket?endpoint=ftp://x",
            "s3://ok-bucket?color=red",
            "http://x",
            "file://x",
        ] {
            assert!(TargetUrl::parse(bad).is_err(), "{bad}");
        }
        assert!(check_target_name("nfs-1").is_ok());
        assert!(check_target_name("a/b").is_err());
    }

    #[test]
    fn credentials_files() {
        let dir = std::env::temp_dir().join(format!("lull-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("c");
        std::fs::write(&f, "# s3\naccess_key_id = AK\nsecret_access_key=\"SK\"\n").unwrap();
        assert_eq!(
            credentials(Some(&f)).unwrap(),
            Some(("AK".into(), "SK".into()))
        );
        std::fs::write(&f, "access_key_id = AK\n").unwrap();
        let e = credentials(Some(&f)).unwrap_err().to_string();
        assert!(e.contains("secret_access_key") && !e.contains("AK"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
