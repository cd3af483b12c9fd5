//! Core lists as operators write them: `3`, `0,2`, `0-3`, `0-1,4`.

/// Largest core number accepted: far above any machine lull runs on, low
/// enough that `0-4000000000` cannot allocate gigabytes.
pub const MAX_CORE: usize = 1023;

/// Parse a core list; a core listed twice is an error.
pub fn parse_core_list(s: &str) -> Result<Vec<usize>, String> {
    let bad = || format!("invalid core list {s:?}: expected e.g. 0,2-3");
    let mut cores = Vec::new();
    for part in s.split(',').map(str::trim) {
        match part.split_once('-') {
            Some((a, b)) => {
                let a: usize = a.trim().parse().map_err(|_| bad())?;
                let b: usize = b.trim().parse().map_err(|_| bad())?;
                if a > b || b > MAX_CORE {
                    return Err(bad());
                }
                cores.extend(a..=b);
            }
            None => {
                let c: usize = part.parse().map_err(|_| bad())?;
                if c > MAX_CORE {
                    return Err(bad());
                }
                cores.push(c);
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(d) = cores.iter().find(|c| !seen.insert(**c)) {
        return Err(format!("core {d} is listed twice in {s:?}"));
    }
    Ok(cores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn core_lists() {
        assert_eq!(parse_core_list("1").unwrap(), vec![1]);
        assert_eq!(parse_core_list("0-2,5").unwrap(), vec![0, 1, 2, 5]);
        assert_eq!(parse_core_list(" 3 , 1-1").unwrap(), vec![3, 1]);
        for bad in ["", "a", "3-1", "1,1", "0-5000", "5000", "1-"] {
            assert!(parse_core_list(bad).is_err(), "{bad}");
        }
    }
}
