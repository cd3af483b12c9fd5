//! What is mounted where, from `/proc/self/mountinfo`: the node service
//! decides from this alone whether a stage or publish is already done, so
//! that every call can be repeated (CSI's idempotency) and nothing but the
//! kernel holds the node's state.
//!
//! ```text
//! 36 35 98:0 /mnt1 /mnt/with\040space rw,noatime master:1 - ext3 /dev/root rw
//!                  ^ mount point (field 5, octal escapes)            ^ source
//! ```

use std::path::{Path, PathBuf};

/// One line of mountinfo, the fields the node service reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub source: String,
}

/// Parses mountinfo text; lines that do not parse are skipped (the
/// kernel writes the file, a future field must not break the plugin).
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<Mount> {
    let (head, tail) = line.split_once(" - ")?;
    let mount_point = head.split(' ').nth(4)?;
    let mut tail = tail.split(' ');
    let fs_type = tail.next()?;
    let source = tail.next()?;
    Some(Mount {
        mount_point: PathBuf::from(unescape(mount_point)),
        fs_type: unescape(fs_type),
        source: unescape(source),
    })
}

/// Undoes the kernel's octal escapes (`\040` space, `\011` tab, `\012`
/// newline, `\134` backslash).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            let digits = bytes.get(i + 1..i + 4).unwrap_or(&[]);
            if digits.len() == 3 && digits.iter().all(|b| (b'0'..=b'7').contains(b)) {
                let v = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(v) = u8::try_from(v) {
                    out.push(v);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mounts of this process's namespace, read now.
pub fn current() -> std::io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read_to_string("/proc/self/mountinfo")?))
}

/// The topmost mount at `path` (the path made absolute and free of
/// symbolic links first), if something is mounted there.
pub fn mounted_at(path: &Path) -> std::io::Result<Option<Mount>> {
    let path = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(current()?.into_iter().rev().find(|m| m.mount_point == path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kernel_lines() {
        let text = "\
36 35 98:0 /mnt1 /mnt/with\\040space rw,noatime master:1 - ext3 /dev/root rw,errors=continue
37 36 0:52 / /var/lib/lull-csi/v/fuse rw,nosuid,nodev - fuse.nbdfuse nbdfuse rw,user_id=0
garbage line
";
        let mounts = parse(text);
        assert_eq!(mounts.len(), 2);
        assert_eq!(mounts[0].mount_point, PathBuf::from("/mnt/with space"));
        assert_eq!(mounts[0].fs_type, "ext3");
        assert_eq!(mounts[0].source, "/dev/root");
        assert_eq!(mounts[1].fs_type, "fuse.nbdfuse");
    }

    #[test]
    fn unescapes_only_octal_triples() {
        assert_eq!(unescape("a\\040b"), "a b");
        assert_eq!(unescape("a\\134b"), "a\\b");
        assert_eq!(unescape("a\\9b"), "a\\9b");
        assert_eq!(unescape("end\\04"), "end\\04");
        assert_eq!(unescape("\\"), "\\");
    }

    #[test]
    fn the_root_is_a_mount_point() {
        assert!(mounted_at(Path::new("/")).unwrap().is_some());
        assert!(mounted_at(Path::new("/no/such/path")).unwrap().is_none());
    }
}
