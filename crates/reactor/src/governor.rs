//! Core frequency control for the scheduler (SPDK's governor): the dynamic
//! scheduler lowers the main core's frequency while only idle threads run
//! there and raises it when they are busy. Linux cpufreq is the one
//! implementation; where `/sys/devices/system/cpu/cpuN/cpufreq/` is absent
//! or read-only (VMs, containers) the governor is unsupported, which is
//! reported once and changes nothing else.

use std::fs;
use std::path::PathBuf;

/// Frequency steps between a core's lowest and highest frequency when the
/// driver lists no available frequencies: ten steps take a core from its
/// minimum to its maximum in ten periods.
const FREQ_STEPS: u64 = 10;

/// What a governor can do to one core.
pub trait Governor: Send {
    fn name(&self) -> &'static str;
    /// The core's frequency range and current cap, in kHz.
    fn core_freqs(&self, core: usize) -> std::io::Result<CoreFreq>;
    /// One step up (no-op at the top).
    fn core_freq_up(&mut self, core: usize) -> std::io::Result<()>;
    /// One step down (no-op at the bottom).
    fn core_freq_down(&mut self, core: usize) -> std::io::Result<()>;
    /// Straight to the highest frequency.
    fn core_freq_max(&mut self, core: usize) -> std::io::Result<()>;
}

/// A core's frequencies, in kHz.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoreFreq {
    pub min_khz: u64,
    pub max_khz: u64,
    /// The current cap (`scaling_max_freq`).
    pub cap_khz: u64,
}

/// Linux cpufreq: caps a core's frequency through `scaling_max_freq`.
#[derive(Debug)]
pub struct Cpufreq {
    root: PathBuf,
}

impl Cpufreq {
    /// The cpufreq governor for `cores`, if every one of them has a
    /// writable `scaling_max_freq`; otherwise why not.
    pub fn probe(cores: &[usize]) -> Result<Cpufreq, String> {
        Cpufreq::probe_at(PathBuf::from("/sys/devices/system/cpu"), cores)
    }

    fn probe_at(root: PathBuf, cores: &[usize]) -> Result<Cpufreq, String> {
        let gov = Cpufreq { root };
        for &core in cores {
            let path = gov.file(core, "scaling_max_freq");
            let meta = fs::metadata(&path)
                .map_err(|e| format!("{}: {e} (no cpufreq for core {core})", path.display()))?;
            // Read-only sysfs files have no write permission bit, even for root.
            if meta.permissions().readonly() {
                return Err(format!("{} is read-only", path.display()));
            }
            gov.core_freqs(core)
                .map_err(|e| format!("core {core}: cannot read its frequencies: {e}"))?;
        }
        Ok(gov)
    }

    fn file(&self, core: usize, name: &str) -> PathBuf {
        self.root.join(format!("cpu{core}/cpufreq/{name}"))
    }

    fn read_khz(&self, core: usize, name: &str) -> std::io::Result<u64> {
        fs::read_to_string(self.file(core, name))?
            .trim()
            .parse()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    /// The frequencies the core may be capped at, ascending.
    fn levels(&self, core: usize, f: &CoreFreq) -> Vec<u64> {
        let listed = fs::read_to_string(self.file(core, "scaling_available_frequencies"))
            .ok()
            .map(|s| {
                let mut v: Vec<u64> = s
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                v.sort_unstable();
                v.dedup();
                v
            })
            .filter(|v| !v.is_empty());
        listed.unwrap_or_else(|| {
            let span = f.max_khz.saturating_sub(f.min_khz);
            (0..=FREQ_STEPS)
                .map(|i| f.min_khz + span * i / FREQ_STEPS)
                .collect()
        })
    }

    fn set_cap(&self, core: usize, khz: u64) -> std::io::Result<()> {
        fs::write(self.file(core, "scaling_max_freq"), khz.to_string())
    }

    fn step(&mut self, core: usize, up: bool) -> std::io::Result<()> {
        let f = self.core_freqs(core)?;
        let levels = self.levels(core, &f);
        let next = if up {
            levels.iter().copied().find(|&l| l > f.cap_khz)
        } else {
            levels.iter().rev().copied().find(|&l| l < f.cap_khz)
        };
        match next {
            Some(khz) => self.set_cap(core, khz),
            None => Ok(()),
        }
    }
}

impl Governor for Cpufreq {
    fn name(&self) -> &'static str {
        "cpufreq"
    }

    fn core_freqs(&self, core: usize) -> std::io::Result<CoreFreq> {
        Ok(CoreFreq {
            min_khz: self.read_khz(core, "cpuinfo_min_freq")?,
            max_khz: self.read_khz(core, "cpuinfo_max_freq")?,
            cap_khz: self.read_khz(core, "scaling_max_freq")?,
        })
    }

    fn core_freq_up(&mut self, core: usize) -> std::io::Result<()> {
        self.step(core, true)
    }

    fn core_freq_down(&mut self, core: usize) -> std::io::Result<()> {
        self.step(core, false)
    }

    fn core_freq_max(&mut self, core: usize) -> std::io::Result<()> {
        let f = self.core_freqs(core)?;
        if f.cap_khz != f.max_khz {
            self.set_cap(core, f.max_khz)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_sysfs(min: u64, max: u64, cap: u64, levels: Option<&str>) -> (PathBuf, Cpufreq) {
        let root = std::env::temp_dir().join(format!(
            "lull-cpufreq-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let dir = root.join("cpu0/cpufreq");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("cpuinfo_min_freq"), format!("{min}\n")).unwrap();
        fs::write(dir.join("cpuinfo_max_freq"), format!("{max}\n")).unwrap();
        fs::write(dir.join("scaling_max_freq"), format!("{cap}\n")).unwrap();
        if let Some(l) = levels {
            fs::write(dir.join("scaling_available_frequencies"), l).unwrap();
        }
        let gov = Cpufreq::probe_at(root.clone(), &[0]).unwrap();
        (root, gov)
    }

    #[test]
    fn steps_through_listed_frequencies() {
        let (root, mut g) = fake_sysfs(
            1_000_000,
            3_000_000,
            3_000_000,
            Some("1000000 2000000 3000000\n"),
        );
        g.core_freq_down(0).unwrap();
        assert_eq!(g.core_freqs(0).unwrap().cap_khz, 2_000_000);
        g.core_freq_down(0).unwrap();
        g.core_freq_down(0).unwrap();
        assert_eq!(
            g.core_freqs(0).unwrap().cap_khz,
            1_000_000,
            "stops at the bottom"
        );
        g.core_freq_up(0).unwrap();
        assert_eq!(g.core_freqs(0).unwrap().cap_khz, 2_000_000);
        g.core_freq_max(0).unwrap();
        assert_eq!(g.core_freqs(0).unwrap().cap_khz, 3_000_000);
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn steps_evenly_without_a_list() {
        let (root, mut g) = fake_sysfs(1_000_000, 2_000_000, 2_000_000, None);
        g.core_freq_down(0).unwrap();
        assert_eq!(g.core_freqs(0).unwrap().cap_khz, 1_900_000);
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn missing_cpufreq_is_unsupported_with_a_reason() {
        let err = Cpufreq::probe_at(PathBuf::from("/nonexistent-lull"), &[0]).unwrap_err();
        assert!(err.contains("no cpufreq for core 0"), "{err}");
    }
}
