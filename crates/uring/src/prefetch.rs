//! [`prefetch`]: ask the CPU to start loading bytes into its caches now,
//! without waiting for them, so a copy that needs them later finds them
//! there. A memory volume's random 4 KiB read copies from memory that is
//! not in cache (the kernel's copy into the socket, for a lent read);
//! prefetching the reads of a batch when they are queued lets those
//! misses overlap each other and the rest of the batch's work instead of
//! stalling the copy, one cache line at a time (docs/PER_IO.md, "Lent
//! reads").
//!
//! ```
//! let data = vec![7u8; 8192];
//! lull_uring::prefetch(&data[100..4196]);
//! assert_eq!(data[100], 7); // a hint only: nothing changes
//! ```

/// Bytes per cache line on the CPUs lull runs on (x86-64, and the
/// common 64-byte aarch64 parts); a wrong guess only wastes hints.
pub const CACHE_LINE_BYTES: usize = 64;

/// Start loading every cache line of `bytes` into the CPU's caches. A
/// hint: it never faults, never blocks and changes nothing; on a CPU
/// without a prefetch instruction lull uses, it does nothing.
#[inline]
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        if bytes.is_empty() {
            return;
        }
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // The line of the first byte, then every line after it that
        // holds one of the bytes (the last one included).
        let start = bytes.as_ptr() as usize;
        let first = start & !(CACHE_LINE_BYTES - 1);
        let end = start + bytes.len();
        let mut line = first;
        while line < end {
            let at = line.max(start) - start;
            // PREFETCHT0 needs SSE, which every x86-64 CPU has, reads no
            // memory architecturally and cannot fault, whatever the address.
            // SAFETY: a hint that cannot fault, at an address inside
            // `bytes` (`at` < `bytes.len()`).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(at).cast::<i8>()) };
            line += CACHE_LINE_BYTES;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any range, aligned or not, empty or spanning many lines, is
    /// accepted and leaves the bytes as they were.
    #[test]
    fn any_range_is_a_harmless_hint() {
        let data: Vec<u8> = (0..=255u8).cycle().take(3 * 4096 + 17).collect();
        let before = data.clone();
        for (at, len) in [
            (0, 0),
            (0, 1),
            (63, 2),
            (1, 4096),
            (4095, 8193),
            (0, data.len()),
        ] {
            prefetch(&data[at..at + len]);
        }
        prefetch(&data[data.len()..]);
        assert_eq!(data, before);
    }
}
