//! Small JSON records replaced atomically and durably (the store's list of
//! replicas, a node's volumes): write a temporary file beside the record,
//! fsync it, rename it over the record, fsync the directory. A crash leaves
//! the old record or the new one, never a torn one. A record that does not
//! parse names its file and the byte where it stops making sense: a node
//! never starts empty over a record it could not read.
//!
//! ```ignore
//! #[derive(Serialize, Deserialize)]
//! struct Record { names: Vec<String> }
//! let path = Path::new("/var/lib/lull/store/store.json");
//! durable::store_json(path, &Record { names: vec!["r0".into()] })?; // blocking
//! let back: Option<Record> = durable::load_json(path, 1 << 20)?;
//! ```

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Errors reading or writing a record.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "{path}: corrupt at byte {byte}: {reason} (the file is left as it is; fix or move it away)"
    )]
    Corrupt {
        path: PathBuf,
        byte: u64,
        reason: String,
    },
    #[error("{path}: larger than {max_bytes} bytes: not a lull record")]
    TooLarge { path: PathBuf, max_bytes: u64 },
}

impl RecordError {
    pub fn errno(&self) -> i32 {
        match self {
            RecordError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            RecordError::Corrupt { .. } | RecordError::TooLarge { .. } => libc::EINVAL,
        }
    }
}

/// The byte offset of serde_json's (line, column), both 1-based, in `text`.
fn byte_of(text: &str, line: usize, column: usize) -> u64 {
    let before: usize = text
        .split_inclusive('\n')
        .take(line.saturating_sub(1))
        .map(str::len)
        .sum();
    (before + column.saturating_sub(1)) as u64
}

/// Decodes `text`, read from `path` (named in errors only).
pub fn parse_json<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T, RecordError> {
    serde_json::from_str(text).map_err(|e| RecordError::Corrupt {
        path: path.to_path_buf(),
        byte: byte_of(text, e.line(), e.column()),
        reason: e.to_string(),
    })
}

/// The first `max_bytes + 1` bytes of the file at `path` (one more than
/// allowed, so a caller sees that it is too large without reading it all);
/// `Ok(None)` when there is no such file.
pub fn read_capped(path: &Path, max_bytes: u64) -> io::Result<Option<Vec<u8>>> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut bytes = Vec::new();
    file.take(max_bytes + 1).read_to_end(&mut bytes)?;
    Ok(Some(bytes))
}

/// Reads and decodes the record at `path`; `Ok(None)` when there is none.
/// A record over `max_bytes` is refused unread.
pub fn load_json<T: DeserializeOwned>(
    path: &Path,
    max_bytes: u64,
) -> Result<Option<T>, RecordError> {
    let read = read_capped(path, max_bytes).map_err(|source| RecordError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let Some(bytes) = read else {
        return Ok(None);
    };
    if bytes.len() as u64 > max_bytes {
        return Err(RecordError::TooLarge {
            path: path.to_path_buf(),
            max_bytes,
        });
    }
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) => t,
        Err(e) => {
            return Err(RecordError::Corrupt {
                path: path.to_path_buf(),
                byte: e.valid_up_to() as u64,
                reason: "not UTF-8".into(),
            })
        }
    };
    parse_json(path, text).map(Some)
}

/// Replaces the file at `path` with `bytes`, atomically and durably.
/// Blocking (two fsyncs): never on a reactor.
pub fn store_bytes(path: &Path, bytes: &[u8]) -> Result<(), RecordError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    let write = || -> io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    write().map_err(|source| RecordError::Io {
        path: tmp.clone(),
        source,
    })?;
    std::fs::rename(&tmp, path).map_err(|source| RecordError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // The rename is durable only once the directory is.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| RecordError::Io {
            path: dir.to_path_buf(),
            source,
        })
}

/// Encodes `value` as pretty JSON (and a newline) and stores it with
/// [`store_bytes`].
pub fn store_json<T: Serialize>(path: &Path, value: &T) -> Result<(), RecordError> {
    let mut text = serde_json::to_string_pretty(value).map_err(|e| RecordError::Corrupt {
        path: path.to_path_buf(),
        byte: 0,
        reason: format!("cannot encode: {e}"),
    })?;
    text.push('\n');
    store_bytes(path, text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct R {
        names: Vec<String>,
    }

    #[test]
    fn round_trip_and_corruption_named_by_byte() {
        let d = std::env::temp_dir().join(format!("lull-durable-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("r.json");
        assert!(load_json::<R>(&path, 1024).unwrap().is_none());
        let r = R {
            names: vec!["a".into(), "b".into()],
        };
        store_json(&path, &r).unwrap();
        assert_eq!(load_json::<R>(&path, 1024).unwrap(), Some(r));
        assert!(!d.join("r.json.tmp").exists());

        // A torn record: cut in the middle of the second line.
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::write(&path, &text[..15]).unwrap();
        match load_json::<R>(&path, 1024) {
            Err(RecordError::Corrupt { byte, .. }) => assert_eq!(byte, 15),
            other => panic!("{other:?}"),
        }
        std::fs::write(&path, "{\"names\": [1]}").unwrap();
        match load_json::<R>(&path, 1024) {
            Err(e @ RecordError::Corrupt { byte: 11, .. }) => {
                assert!(e.to_string().contains("r.json: corrupt at byte 11"), "{e}")
            }
            other => panic!("{other:?}"),
        }
        std::fs::write(&path, [b'{', 0xff]).unwrap();
        assert!(matches!(
            load_json::<R>(&path, 1024),
            Err(RecordError::Corrupt { byte: 1, .. })
        ));
        std::fs::write(&path, vec![b' '; 2000]).unwrap();
        assert!(matches!(
            load_json::<R>(&path, 1024),
            Err(RecordError::TooLarge { .. })
        ));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
