//! The file backend's I/O options (`sqpoll[=IDLE_MS]`, `iopoll`,
//! `hybrid_iopoll`, `iopoll=auto`, `fixed=on|off`, `inline[=on|off|auto]`): parsing, and checking them against the
//! kernel and the device at open, so that a refusal is a start-up error
//! naming the option and the reason rather than an I/O error later.
//!
//! ```
//! use lull_bdev::{IoPoll, RingOptions};
//! let mut direct = false;
//! let mut o = RingOptions::default();
//! for flag in ["direct", "sqpoll=20", "iopoll=auto"] {
//!     assert!(o.parse_flag(flag, &mut direct).unwrap());
//! }
//! assert_eq!((direct, o.sqpoll_idle_ms, o.iopoll), (true, Some(20), IoPoll::Auto));
//! assert!(!o.parse_flag("nonsense", &mut direct).unwrap());
//! ```

use std::fs::Metadata;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use lull_uring::{IoQueue, RingSetup};

use crate::BdevError;

/// `sq_thread_idle` when `sqpoll` is given without a value: how long the
/// kernel's SQ thread keeps polling (a full core) after the last
/// submission before it sleeps. Short, because lull spends CPU only while
/// it pays: 50 ms covers the gaps of a busy stream and costs at most
/// 50 ms of a core after the last request.
pub const SQPOLL_IDLE_MS_DEFAULT: u32 = 50;

/// Largest `sqpoll=IDLE_MS` accepted: 10 s of polling after the last
/// request is already far past any use; more is a typo.
pub const SQPOLL_IDLE_MS_MAX: u32 = 10_000;

/// How a file channel's ring finds completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoPoll {
    /// Interrupts (the default): the ring's eventfd wakes the reactor.
    #[default]
    Off,
    /// `IORING_SETUP_IOPOLL`; refused where the kernel or device cannot.
    On,
    /// `IORING_SETUP_HYBRID_IOPOLL` (with IOPOLL; Linux 6.13+).
    Hybrid,
    /// IOPOLL where it is possible, else interrupts (logged once).
    Auto,
}

/// Whether a file channel reads and writes inline, on the reactor, with
/// plain `pread`/`pwrite`, instead of through an io_uring ring.
///
/// io_uring issues a buffered read or write without blocking only when
/// the filesystem supports it (FMODE_NOWAIT); tmpfs and ramfs do not, so
/// the kernel hands every such request to an io-wq worker thread: two
/// context switches and a wake-up per batch, on the reactor's core. On a
/// memory filesystem the copy itself never waits for a device, so doing
/// it inline is cheaper and blocks the reactor no longer than a memory
/// volume's copy does (pages swapped out are the exception: reading them
/// back waits for the swap device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Inline {
    /// Inline on a memory filesystem (tmpfs, ramfs) when no ring option
    /// (`sqpoll`, `iopoll`) asks for a ring; io_uring elsewhere.
    #[default]
    Auto,
    /// Inline; refused unless the file is on a memory filesystem (a disk
    /// read would stall every connection of the reactor).
    On,
    /// io_uring always (for comparison).
    Off,
}

/// io_uring options of a file device (`FileOptions::ring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingOptions {
    /// `sqpoll[=IDLE_MS]`: a kernel thread polls the submission queue.
    pub sqpoll_idle_ms: Option<u32>,
    pub iopoll: IoPoll,
    /// `fixed=on` (default) / `fixed=off`: each channel's ring registers
    /// the reactors' fixed buffer arenas, and I/O on buffers from them
    /// uses READ_FIXED/WRITE_FIXED (no page pinning per I/O). Off: plain
    /// READ/WRITE always (for comparison).
    pub fixed_buffers: bool,
    /// `inline=auto|on|off` (`inline` is `inline=on`): see [`Inline`].
    pub inline: Inline,
}

impl Default for RingOptions {
    fn default() -> RingOptions {
        RingOptions {
            sqpoll_idle_ms: None,
            iopoll: IoPoll::Off,
            fixed_buffers: true,
            inline: Inline::Auto,
        }
    }
}

impl RingOptions {
    /// Applies one comma-separated flag of a `file=PATH,...` spec:
    /// `direct`, `sqpoll`, `sqpoll=IDLE_MS`, `iopoll`, `iopoll=auto`,
    /// `hybrid_iopoll`, `fixed=on`, `fixed=off`, `inline`, `inline=on`,
    /// `inline=off`, `inline=auto`. `Ok(false)` for a word that is none of them (so a
    /// caller can tell a flag from part of a path); `Err` for a known flag
    /// with a bad value.
    pub fn parse_flag(&mut self, flag: &str, direct: &mut bool) -> Result<bool, String> {
        match flag {
            "direct" => *direct = true,
            "sqpoll" => self.sqpoll_idle_ms = Some(SQPOLL_IDLE_MS_DEFAULT),
            "iopoll" => self.iopoll = IoPoll::On,
            "iopoll=auto" => self.iopoll = IoPoll::Auto,
            "hybrid_iopoll" => self.iopoll = IoPoll::Hybrid,
            "fixed=on" => self.fixed_buffers = true,
            "fixed=off" => self.fixed_buffers = false,
            "inline" | "inline=on" => self.inline = Inline::On,
            "inline=off" => self.inline = Inline::Off,
            "inline=auto" => self.inline = Inline::Auto,
            _ => {
                if let Some(v) = flag.strip_prefix("sqpoll=") {
                    let ms = v
                        .parse::<u32>()
                        .ok()
                        .filter(|ms| *ms <= SQPOLL_IDLE_MS_MAX)
                        .ok_or_else(|| {
                            format!("sqpoll={v}: expected an idle time in ms, 0 to {SQPOLL_IDLE_MS_MAX}")
                        })?;
                    self.sqpoll_idle_ms = Some(ms);
                } else if let Some(v) = flag.strip_prefix("iopoll=") {
                    return Err(format!(
                        "iopoll={v}: expected iopoll, iopoll=auto or hybrid_iopoll"
                    ));
                } else if let Some(v) = flag.strip_prefix("fixed=") {
                    return Err(format!("fixed={v}: expected fixed=on or fixed=off"));
                } else if let Some(v) = flag.strip_prefix("inline=") {
                    return Err(format!(
                        "inline={v}: expected inline, inline=on, inline=off or inline=auto"
                    ));
                } else {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// Parses a comma-separated list of flags (`lull replica --uring`).
    pub fn parse_list(list: &str, direct: &mut bool) -> Result<RingOptions, String> {
        let mut o = RingOptions::default();
        for flag in list.split(',').filter(|f| !f.is_empty()) {
            if !o.parse_flag(flag, direct)? {
                return Err(format!(
                    "unknown file option {flag:?}: expected direct, sqpoll[=IDLE_MS], iopoll, iopoll=auto, hybrid_iopoll, fixed=on|off or inline[=on|off|auto]"
                ));
            }
        }
        Ok(o)
    }

    /// The flags, as they would be written in a spec (for `describe`).
    pub fn describe(&self) -> String {
        let mut out = Vec::new();
        if let Some(ms) = self.sqpoll_idle_ms {
            out.push(format!("sqpoll={ms}"));
        }
        match self.iopoll {
            IoPoll::Off => {}
            IoPoll::On => out.push("iopoll".into()),
            IoPoll::Hybrid => out.push("hybrid_iopoll".into()),
            IoPoll::Auto => out.push("iopoll=auto".into()),
        }
        if !self.fixed_buffers {
            out.push("fixed=off".into());
        }
        match self.inline {
            Inline::Auto => {}
            Inline::On => out.push("inline".into()),
            Inline::Off => out.push("inline=off".into()),
        }
        out.join(",")
    }
}

fn refused(option: &'static str, reason: String) -> BdevError {
    BdevError::OptionRefused { option, reason }
}

/// Where the device's `io_poll` attribute lives: the queue of the block
/// device holding the file (or of the device node itself), its parent's
/// for a partition. `Err` when there is no block device (tmpfs, overlay).
fn io_poll_attr(meta: &Metadata) -> Result<(String, PathBuf), String> {
    let dev = if meta.file_type().is_block_device() {
        meta.rdev()
    } else {
        meta.dev()
    };
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    let base = PathBuf::from(format!("/sys/dev/block/{major}:{minor}"));
    let name = std::fs::canonicalize(&base)
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .ok_or_else(|| {
            format!("the file is not on a block device (device {major}:{minor}, e.g. tmpfs or overlayfs)")
        })?;
    let own = base.join("queue/io_poll");
    let attr = if own.exists() {
        own
    } else {
        base.join("../queue/io_poll")
    };
    Ok((format!("{name} ({major}:{minor})"), attr))
}

/// Why IOPOLL cannot work for this file, or `None` when it can.
fn iopoll_refusal(meta: &Metadata, direct: bool, hybrid: bool) -> Option<String> {
    if !direct {
        return Some("polled completions need O_DIRECT: add the direct option".into());
    }
    if hybrid {
        let flags =
            lull_uring::probe::IORING_SETUP_IOPOLL | lull_uring::probe::IORING_SETUP_HYBRID_IOPOLL;
        if let Err(e) = lull_uring::probe::setup_flags_supported(flags) {
            return Some(format!(
                "the kernel refuses IORING_SETUP_HYBRID_IOPOLL ({e}); it needs Linux 6.13 or later"
            ));
        }
    }
    let (name, attr) = match io_poll_attr(meta) {
        Ok(found) => found,
        Err(why) => return Some(why),
    };
    match std::fs::read_to_string(&attr) {
        Ok(v) if v.trim() == "1" => None,
        Ok(v) => Some(format!(
            "block device {name} has no poll queues ({} is {}; for NVMe set the nvme module's poll_queues)",
            attr.display(),
            v.trim()
        )),
        Err(e) => Some(format!(
            "cannot tell whether block device {name} polls ({}: {e})",
            attr.display()
        )),
    }
}

/// Checks `options` for the file at `path` (already open, `meta` its
/// metadata) and returns the ring setup its channels use. A refused option
/// is an error naming it; `iopoll=auto` falls back to interrupts with one
/// log line. SQPOLL and IOPOLL are tried on a small ring here, so the
/// kernel's refusal surfaces at open.
pub(crate) fn resolve(
    path: &Path,
    meta: &Metadata,
    direct: bool,
    options: RingOptions,
) -> Result<RingSetup, BdevError> {
    let mut setup = RingSetup {
        sqpoll_idle_ms: options.sqpoll_idle_ms,
        ..RingSetup::default()
    };
    let (option, hybrid) = match options.iopoll {
        IoPoll::Off => ("", false),
        IoPoll::On | IoPoll::Auto => ("iopoll", false),
        IoPoll::Hybrid => ("hybrid_iopoll", true),
    };
    if options.iopoll != IoPoll::Off {
        match iopoll_refusal(meta, direct, hybrid) {
            None if hybrid => {
                setup.iopoll = true;
                setup.hybrid_iopoll = true;
            }
            None => setup.iopoll = true,
            Some(reason) if options.iopoll == IoPoll::Auto => {
                tracing::info!(path = %path.display(), %reason,
                    "iopoll=auto: using interrupt completions");
            }
            Some(reason) => return Err(refused(option, reason)),
        }
    }
    if setup == RingSetup::default() {
        return Ok(setup);
    }
    // One probe ring with the flags: the kernel says no here, not at the
    // first connection.
    if let Err(e) = IoQueue::<()>::with_setup(1, &[], setup) {
        let option = if setup.sqpoll_idle_ms.is_some() {
            "sqpoll"
        } else {
            "iopoll"
        };
        return Err(refused(option, format!("the kernel refuses the ring: {e}")));
    }
    tracing::info!(path = %path.display(), sqpoll_idle_ms = ?setup.sqpoll_idle_ms,
        iopoll = setup.iopoll, "file backend io_uring options");
    Ok(setup)
}

/// Whether the file's channels run inline (see [`Inline`]): `auto` picks
/// inline on a memory filesystem unless a ring option is set; `on` is
/// refused on any other filesystem and with a ring option, naming the
/// reason. Logged once per device when inline.
pub(crate) fn resolve_inline(
    path: &Path,
    file: &std::fs::File,
    meta: &Metadata,
    options: RingOptions,
) -> Result<bool, BdevError> {
    if options.inline == Inline::Off {
        return Ok(false);
    }
    let ring_option = if options.sqpoll_idle_ms.is_some() {
        Some("sqpoll")
    } else if options.iopoll != IoPoll::Off {
        Some("iopoll")
    } else {
        None
    };
    let memory_fs = meta.file_type().is_file()
        && lull_uring::on_memory_filesystem(file).unwrap_or_else(|e| {
            tracing::warn!(path = %path.display(), error = %e, "fstatfs failed; assuming a disk filesystem");
            false
        });
    let on = options.inline == Inline::On;
    match (ring_option, memory_fs) {
        (Some(ring), _) if on => Err(refused(
            "inline",
            format!("inline I/O uses no io_uring ring, so it cannot be combined with {ring}"),
        )),
        (Some(_), _) => Ok(false),
        (None, false) if on => Err(refused(
            "inline",
            "the file is not on a memory filesystem (tmpfs, ramfs): an inline read or write could wait for the disk and stall every connection of the reactor".into(),
        )),
        (None, false) => Ok(false),
        (None, true) => {
            tracing::info!(path = %path.display(),
                "file on a memory filesystem: reads and writes run inline on the reactor (io_uring would hand each to a kernel worker thread; inline=off to use it anyway)");
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(list: &str) -> Result<(bool, RingOptions), String> {
        let mut direct = false;
        RingOptions::parse_list(list, &mut direct).map(|o| (direct, o))
    }

    #[test]
    fn flags_parse_and_bad_values_are_refused() {
        assert_eq!(parse("").unwrap(), (false, RingOptions::default()));
        let (direct, o) = parse("direct,sqpoll").unwrap();
        assert!(direct);
        assert_eq!(o.sqpoll_idle_ms, Some(SQPOLL_IDLE_MS_DEFAULT));
        assert_eq!(parse("hybrid_iopoll").unwrap().1.iopoll, IoPoll::Hybrid);
        assert_eq!(parse("iopoll").unwrap().1.iopoll, IoPoll::On);
        assert_eq!(parse("sqpoll=0").unwrap().1.sqpoll_idle_ms, Some(0));
        assert!(parse("sqpoll=10001").unwrap_err().contains("sqpoll=10001"));
        assert!(parse("sqpoll=x").is_err());
        assert!(parse("iopoll=maybe").unwrap_err().contains("iopoll=maybe"));
        assert!(parse("fast").unwrap_err().contains("unknown file option"));
        let o = parse("sqpoll=5,iopoll=auto").unwrap().1;
        assert_eq!(o.describe(), "sqpoll=5,iopoll=auto");
        assert!(
            RingOptions::default().fixed_buffers,
            "fixed buffers by default"
        );
        let o = parse("direct,fixed=off").unwrap().1;
        assert!(!o.fixed_buffers);
        assert_eq!(o.describe(), "fixed=off");
        assert!(parse("fixed=off,fixed=on").unwrap().1.fixed_buffers);
        assert!(parse("fixed=maybe").unwrap_err().contains("fixed=maybe"));
        assert_eq!(RingOptions::default().inline, Inline::Auto);
        for (flag, want) in [
            ("inline", Inline::On),
            ("inline=on", Inline::On),
            ("inline=off", Inline::Off),
            ("inline=auto", Inline::Auto),
        ] {
            assert_eq!(parse(flag).unwrap().1.inline, want, "{flag}");
        }
        assert_eq!(parse("inline=off").unwrap().1.describe(), "inline=off");
        assert_eq!(parse("inline=on").unwrap().1.describe(), "inline");
        assert!(parse("inline=yes").unwrap_err().contains("inline=yes"));
    }
}
