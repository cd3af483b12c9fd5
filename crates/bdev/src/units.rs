//! Sizes as people write them: `4096`, `64K`, `1G`, `2TiB` (binary units).

/// Parse a size in bytes with an optional binary suffix (K, M, G, T; also
/// KB/KiB and any case). Zero and sizes past `i64::MAX` (the kernel's
/// `off_t`) are refused.
pub fn parse_size_bytes(s: &str) -> Result<u64, String> {
    let bad = |why: &str| format!("invalid size {s:?}: {why}");
    let t = s.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits_end);
    if num.is_empty() {
        return Err(bad("expected a number with an optional K/M/G/T suffix"));
    }
    let n: u64 = num.parse().map_err(|_| bad("too large"))?;
    let shift = match suffix.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(bad("use a K, M, G or T (binary) suffix")),
    };
    let v = n
        .checked_mul(1u64 << shift)
        .ok_or_else(|| bad("too large"))?;
    if v == 0 {
        return Err(bad("must be greater than zero"));
    }
    if v > i64::MAX as u64 {
        return Err(bad("too large"));
    }
    Ok(v)
}

/// `1073741824` → `1.0 GiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_size_bytes("64K").unwrap(), 64 << 10);
        assert_eq!(parse_size_bytes("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size_bytes("1gib").unwrap(), 1 << 30);
        assert_eq!(parse_size_bytes("2TiB").unwrap(), 2 << 40);
        assert_eq!(parse_size_bytes("3m").unwrap(), 3 << 20);
        for bad in ["", "G", "1X", "0", "-1", "99999999999T", "1.5G", "9000000T"] {
            assert!(parse_size_bytes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn human() {
        assert_eq!(human_bytes(512), "512.0 B");
        assert_eq!(human_bytes(1 << 30), "1.0 GiB");
        assert_eq!(human_bytes(3 << 19), "1.5 MiB");
    }
}
