//! Kernel feature probes that need raw system calls.

use std::os::fd::{AsRawFd, BorrowedFd};

/// O_DIRECT alignment requirements of an open file, from
/// `statx(STATX_DIOALIGN)` (Linux 6.1+).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DioAlign {
    /// Required alignment of user buffers, in bytes.
    pub mem_bytes: u32,
    /// Required alignment of file offsets and lengths, in bytes.
    pub offset_bytes: u32,
}

/// The file's O_DIRECT alignment, or `None` when the kernel or filesystem
/// does not report it (or reports that O_DIRECT is unsupported).
pub fn dio_alignment(fd: BorrowedFd<'_>) -> Option<DioAlign> {
    // SAFETY: `libc::statx` is plain old data; all-zero is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the path is a valid NUL-terminated empty string, used with
    // AT_EMPTY_PATH on a descriptor we borrow; `stx` is a valid out-pointer.
    let rc = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 || stx.stx_mask & libc::STATX_DIOALIGN == 0 || stx.stx_dio_offset_align == 0 {
        return None;
    }
    Some(DioAlign {
        mem_bytes: stx.stx_dio_mem_align,
        offset_bytes: stx.stx_dio_offset_align,
    })
}

/// The first allocated (data) range of `file` at or after `offset`, from
/// `lseek(SEEK_DATA)` then `lseek(SEEK_HOLE)`: `Some((data_start,
/// hole_start))`, or `None` when there is no data at or after `offset`.
///
/// Both calls are non-sleeping metadata lookups on a local file. They move
/// the descriptor's file offset, which lull never uses (its I/O passes
/// explicit offsets), and each call returns its own result, so concurrent
/// callers sharing one `File` still get correct answers. A filesystem
/// without hole tracking reports the whole file as data.
pub fn seek_data_hole(file: &std::fs::File, offset: u64) -> std::io::Result<Option<(u64, u64)>> {
    let Ok(start) = libc::off_t::try_from(offset) else {
        return Ok(None);
    };
    let fd = file.as_raw_fd();
    // SAFETY: lseek takes no pointers; `fd` is open for the borrow of `file`.
    let data = unsafe { libc::lseek(fd, start, libc::SEEK_DATA) };
    if data < 0 {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(e),
        };
    }
    // SAFETY: as above.
    let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
    if hole < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Both are non-negative offsets returned by the kernel.
    Ok(Some((data as u64, hole as u64)))
}

/// `cachestat(2)`'s number: 451 on every architecture (a syscall added
/// after the tables were unified; the libc crate names it for some
/// targets only).
const SYS_CACHESTAT: libc::c_long = 451;

/// `struct cachestat_range` (include/uapi/linux/mman.h).
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// `struct cachestat` (include/uapi/linux/mman.h).
#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// Whether every page of `[offset, offset + len)` of `file` holds data:
/// in the page cache, or for a memory filesystem's file swapped out
/// (which `cachestat(2)` counts as evicted). A page that is neither was
/// never written or was punched out: a hole. One `cachestat` over the
/// range (Linux 6.5+), whose cost grows with the range, not the file: on
/// a memory filesystem `lseek(SEEK_HOLE)` walks the page cache from
/// `offset` to the first hole, which in a written file is its end (about
/// 4 ms for the rest of a 256 MiB tmpfs file). `Err` where the kernel has
/// no `cachestat`; an empty range is `Ok(true)`.
pub fn range_cached(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<bool> {
    if len == 0 {
        return Ok(true);
    }
    let page = page_size();
    let pages = (offset + len - 1) / page - offset / page + 1;
    let range = CachestatRange { off: offset, len };
    let mut stat = Cachestat::default();
    // The structs are `repr(C)` copies of the kernel's uapi ones; flags 0.
    // SAFETY: both pointers are to live values of the layouts the kernel
    // expects, for the call; the fd is open for the borrow of `file`.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const CachestatRange,
            &mut stat as *mut Cachestat,
            0u32,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stat.nr_cache + stat.nr_evicted >= pages)
}

/// The system's page size in bytes.
fn page_size() -> u64 {
    // SAFETY: sysconf takes no pointers.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// `posix_fadvise(POSIX_FADV_WILLNEED)` on `[offset, offset + len)`: starts
/// readahead into the page cache and returns (NBD_CMD_CACHE).
pub fn fadvise_willneed(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    let (Ok(start), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Ok(());
    };
    let (fd, advice) = (file.as_raw_fd(), libc::POSIX_FADV_WILLNEED);
    // SAFETY: fadvise takes no pointers; the descriptor is open for the
    // borrow of `file`.
    let rc = unsafe { libc::posix_fadvise(fd, start, len, advice) };
    // posix_fadvise returns the error number instead of setting errno.
    match rc {
        0 => Ok(()),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// `fallocate(2)` on `[offset, offset + len)` with `mode` (the
/// `FALLOC_FL_*` flags), blocking: for files whose allocation is a memory
/// operation (the file backend's inline channel, on tmpfs); io_uring's
/// `IORING_OP_FALLOCATE` elsewhere.
pub fn fallocate(file: &std::fs::File, mode: i32, offset: u64, len: u64) -> std::io::Result<()> {
    let (Ok(start), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Err(std::io::Error::from_raw_os_error(libc::EFBIG));
    };
    let fd = file.as_raw_fd();
    // SAFETY: fallocate takes no pointers; the descriptor is open for the
    // borrow of `file`.
    let rc = unsafe { libc::fallocate(fd, mode, start, len) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `RAMFS_MAGIC` (linux/magic.h); the libc crate does not name it.
const RAMFS_MAGIC: libc::__fsword_t = 0x8584_58f6u32 as libc::__fsword_t;

/// Whether `file` lives on a memory filesystem (tmpfs or ramfs, by
/// `fstatfs`'s `f_type`): its reads and writes copy pages and never wait
/// for a device, but io_uring cannot issue them without blocking (no
/// FMODE_NOWAIT), so it hands every one to a kernel worker thread.
pub fn on_memory_filesystem(file: &std::fs::File) -> std::io::Result<bool> {
    // SAFETY: `libc::statfs` is plain old data; all-zero is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid out-pointer; the descriptor is open for the
    // borrow of `file`.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_type == libc::TMPFS_MAGIC || st.f_type == RAMFS_MAGIC)
}

/// `IORING_SETUP_IOPOLL` (linux/io_uring.h).
pub const IORING_SETUP_IOPOLL: u32 = 1 << 0;
/// `IORING_SETUP_HYBRID_IOPOLL` (linux/io_uring.h, Linux 6.13+): sleep
/// about the expected completion time before polling. Needs IOPOLL.
pub const IORING_SETUP_HYBRID_IOPOLL: u32 = 1 << 17;

/// Whether the kernel accepts an io_uring set up with `flags`: creates a
/// one-entry ring with a raw `io_uring_setup` and closes it at once. For
/// flags the io-uring crate's builder does not offer. `Err` carries the
/// kernel's answer (EINVAL: an unknown flag or combination).
pub fn setup_flags_supported(flags: u32) -> std::io::Result<()> {
    // struct io_uring_params is 120 bytes of u32 fields (sq_entries,
    // cq_entries, flags, ...; the offsets the kernel fills in follow);
    // `flags` is the third word.
    let mut params = [0u32; 30];
    params[2] = flags;
    // SAFETY: io_uring_setup reads and writes the 120-byte params block,
    // which `params` is, and takes no other pointer.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a non-negative result is a new descriptor nobody else owns.
    drop(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) });
    Ok(())
}
