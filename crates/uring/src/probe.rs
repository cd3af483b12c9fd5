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
