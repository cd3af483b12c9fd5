//! The replica's metadata record: volume size, generation and clean flag,
//! kept in `DIR/meta.json` and replaced atomically (write a temporary
//! file, fsync it, rename it over the old one, fsync the directory), so a
//! crash leaves either the old record or the new one, never a torn one.
//!
//! ```ignore
//! let dir = Path::new("/var/lib/lull/r0");
//! let meta = Meta::load(dir)?.unwrap_or(Meta::new(1 << 30));
//! Meta { clean: false, ..meta }.store(dir)?; // blocking: never on a reactor
//! ```

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Version of the metadata record's layout; a record with another version
/// is refused rather than guessed at.
pub const META_FORMAT_VERSION: u32 = 1;

/// File name of the record inside the replica directory.
pub const META_FILE: &str = "meta.json";
/// The temporary file a store writes before it renames it over the
/// record (`crate::durable`: the record's name and `.tmp`).
#[cfg(test)]
const META_TMP_FILE: &str = "meta.json.tmp";

/// Largest metadata file accepted. The record is ~100 bytes; anything much
/// larger is not ours, and reading it whole must stay cheap.
pub const META_MAX_BYTES: u64 = 64 * 1024;

/// Errors reading or writing the record.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path}: not a lull replica metadata record: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path}: metadata format version {found}, this lull reads {META_FORMAT_VERSION}")]
    Version { path: PathBuf, found: u32 },
}

impl MetaError {
    pub fn errno(&self) -> i32 {
        match self {
            MetaError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            MetaError::Corrupt { .. } | MetaError::Version { .. } => libc::EINVAL,
        }
    }
}

/// The metadata record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    pub format_version: u32,
    pub volume_size: u64,
    /// Raised by the engine at each attach; the freshest replicas after a
    /// crash are those with the highest generation.
    pub generation: u64,
    /// True only while the last engine attached to the replica detached
    /// cleanly (DETACH, after its I/O completed and a FLUSH) and nothing
    /// has modified it since; false from an attach or the first modifying
    /// request on. A dirty replica may differ from its peers (in the
    /// regions its write-intent record names). Stopping the replica
    /// process does not change it.
    pub clean: bool,
}

impl Meta {
    /// The record of a new, empty replica: generation 0, clean (all zeros
    /// is a consistent state of a volume no engine has written yet).
    pub fn new(volume_size: u64) -> Meta {
        Meta {
            format_version: META_FORMAT_VERSION,
            volume_size,
            generation: 0,
            clean: true,
        }
    }

    /// Reads `dir/meta.json`; `Ok(None)` when it does not exist.
    pub fn load(dir: &Path) -> Result<Option<Meta>, MetaError> {
        let path = dir.join(META_FILE);
        let io_err = |source| MetaError::Io {
            path: path.clone(),
            source,
        };
        let Some(bytes) = crate::durable::read_capped(&path, META_MAX_BYTES).map_err(io_err)?
        else {
            return Ok(None);
        };
        let text = String::from_utf8(bytes)
            .map_err(|e| io_err(io::Error::new(io::ErrorKind::InvalidData, e)))?;
        Meta::parse(&path, &text).map(Some)
    }

    /// Checks and decodes the text of a record read from `path` (named in
    /// errors only): at most `META_MAX_BYTES`, JSON of this shape, this
    /// format version. What [`Meta::load`] does once it has the text.
    pub fn parse(path: &Path, text: &str) -> Result<Meta, MetaError> {
        if text.len() as u64 > META_MAX_BYTES {
            return Err(MetaError::Corrupt {
                path: path.to_path_buf(),
                reason: format!("larger than {META_MAX_BYTES} bytes"),
            });
        }
        let meta: Meta = serde_json::from_str(text).map_err(|e| MetaError::Corrupt {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        if meta.format_version != META_FORMAT_VERSION {
            return Err(MetaError::Version {
                path: path.to_path_buf(),
                found: meta.format_version,
            });
        }
        Ok(meta)
    }

    /// The text [`Meta::store`] writes: pretty JSON and a newline.
    pub fn encode(&self) -> Result<String, serde_json::Error> {
        let mut text = serde_json::to_string_pretty(self)?;
        text.push('\n');
        Ok(text)
    }

    /// Replaces `dir/meta.json` atomically and durably. Blocking (two
    /// fsyncs): call it from a helper thread or at startup and shutdown,
    /// never from a reactor.
    pub fn store(&self, dir: &Path) -> Result<(), MetaError> {
        let path = dir.join(META_FILE);
        let text = self.encode().map_err(|e| MetaError::Corrupt {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        crate::durable::store_bytes(&path, text.as_bytes()).map_err(|e| match e {
            crate::durable::RecordError::Io { path, source } => MetaError::Io { path, source },
            other => MetaError::Corrupt {
                path,
                reason: other.to_string(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("lull-replica-meta-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn round_trip_and_replace() {
        let d = tmpdir("rt");
        assert_eq!(Meta::load(&d).unwrap(), None);
        let m = Meta::new(1 << 30);
        m.store(&d).unwrap();
        assert_eq!(Meta::load(&d).unwrap(), Some(m));
        let m2 = Meta {
            generation: 9,
            clean: false,
            ..m
        };
        m2.store(&d).unwrap();
        assert_eq!(Meta::load(&d).unwrap(), Some(m2));
        assert!(!d.join(META_TMP_FILE).exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn refuses_garbage_and_other_versions() {
        let d = tmpdir("bad");
        std::fs::write(d.join(META_FILE), b"{not json").unwrap();
        assert!(matches!(Meta::load(&d), Err(MetaError::Corrupt { .. })));
        std::fs::write(
            d.join(META_FILE),
            br#"{"format_version":2,"volume_size":1,"generation":0,"clean":true}"#,
        )
        .unwrap();
        assert!(matches!(
            Meta::load(&d),
            Err(MetaError::Version { found: 2, .. })
        ));
        std::fs::write(d.join(META_FILE), vec![b' '; META_MAX_BYTES as usize + 10]).unwrap();
        assert!(matches!(Meta::load(&d), Err(MetaError::Corrupt { .. })));
        let _ = std::fs::remove_dir_all(&d);
    }
}
