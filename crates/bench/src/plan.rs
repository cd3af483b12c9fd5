//! What to measure and in which order.
//!
//! Targets are interleaved so that a noisy neighbour hurts every target alike:
//! for each repeat, for each job, every target runs once (A B C A B C …).
//! Each (repeat, job, target) step starts the target's server afresh and
//! stops it afterwards, so only one server ever runs (a poll-mode lull would
//! otherwise spin on the server core while another target is measured). The
//! server's idle CPU is measured on its first step of every repeat.
//!
//! ```
//! use lull_bench::plan::schedule;
//! use lull_bench::fio::JobKind;
//! let steps = schedule(2, &[JobKind::RandreadIops, JobKind::RandreadLat], 3);
//! assert_eq!(steps.len(), 12);
//! assert_eq!(steps.iter().take(3).map(|s| s.target).collect::<Vec<_>>(), [0, 1, 2]);
//! assert!(steps[0].measure_idle && !steps[3].measure_idle && steps[6].measure_idle);
//! ```

use serde::Serialize;

use lull_reactor::Mode;

use crate::config::{PeerChoice, VolumeKind};
use crate::fio::JobKind;

/// A server under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Target {
    Lull {
        mode: Mode,
        volume: VolumeKind,
        /// Hybrid mode only: the replica-connection poll period, µs, passed
        /// as `--nvme-ioq-poll-period-us`.
        #[serde(skip_serializing_if = "Option::is_none")]
        hybrid_period_us: Option<u32>,
    },
    /// `nbdkit memory`.
    Nbdkit,
    /// `qemu-nbd` on a raw file with io_uring.
    QemuNbd,
}

impl Target {
    /// A lull target; `hybrid_period_us` is kept for the hybrid mode only.
    pub fn lull(mode: Mode, volume: VolumeKind, hybrid_period_us: Option<u32>) -> Target {
        Target::Lull {
            mode,
            volume,
            hybrid_period_us: hybrid_period_us.filter(|_| mode == Mode::Hybrid),
        }
    }

    /// `lull-poll-malloc`, `lull-hybrid@10-replica2`, `nbdkit-memory`, …
    pub fn name(&self) -> String {
        match self {
            Target::Lull {
                mode,
                volume,
                hybrid_period_us,
            } => {
                let period = hybrid_period_us
                    .map(|p| format!("@{p}"))
                    .unwrap_or_default();
                format!("lull-{}{period}-{}", mode.as_str(), volume.as_str())
            }
            Target::Nbdkit => "nbdkit-memory".into(),
            Target::QemuNbd => "qemu-nbd-file".into(),
        }
    }

    pub fn is_peer(&self) -> bool {
        !matches!(self, Target::Lull { .. })
    }

    /// The executable this target needs besides lull itself.
    pub fn peer_binary(&self) -> Option<(&'static str, &'static str)> {
        match self {
            Target::Lull { .. } => None,
            Target::Nbdkit => Some(("nbdkit", "nbdkit")),
            Target::QemuNbd => Some(("qemu-nbd", "qemu-utils")),
        }
    }

    /// Whether the target serves a file (needs the shared data file).
    pub fn uses_data_file(&self) -> bool {
        matches!(
            self,
            Target::QemuNbd
                | Target::Lull {
                    volume: VolumeKind::File,
                    ..
                }
        )
    }
}

/// Targets in report order: lull modes × volumes (hybrid once per poll
/// period in `hybrid_periods_us`), then peers.
pub fn targets(
    lull: bool,
    modes: &[Mode],
    hybrid_periods_us: &[u32],
    volumes: &[VolumeKind],
    peers: &[PeerChoice],
) -> Vec<Target> {
    let mut out = Vec::new();
    let mut push = |t: Target| {
        if !out.contains(&t) {
            out.push(t);
        }
    };
    if lull {
        for &volume in volumes {
            for &mode in modes {
                if mode == Mode::Hybrid {
                    for &p in hybrid_periods_us {
                        push(Target::lull(mode, volume, Some(p)));
                    }
                } else {
                    push(Target::lull(mode, volume, None));
                }
            }
        }
    }
    for p in peers {
        match p {
            PeerChoice::Nbdkit => push(Target::Nbdkit),
            PeerChoice::QemuNbd => push(Target::QemuNbd),
            PeerChoice::None => {}
        }
    }
    out
}

/// One server start + one fio run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// 0-based repeat.
    pub repeat: u32,
    pub job: JobKind,
    /// Index into the target list.
    pub target: usize,
    /// Measure the server's idle CPU before the job.
    pub measure_idle: bool,
}

/// The interleaved run order (see the module docs).
pub fn schedule(repeats: u32, jobs: &[JobKind], target_count: usize) -> Vec<Step> {
    let mut steps = Vec::with_capacity(repeats as usize * jobs.len() * target_count);
    for repeat in 0..repeats {
        for (j, &job) in jobs.iter().enumerate() {
            for target in 0..target_count {
                steps.push(Step {
                    repeat,
                    job,
                    target,
                    measure_idle: j == 0,
                });
            }
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_order_and_names() {
        let t = targets(
            true,
            &[Mode::Poll, Mode::Adaptive],
            &[100],
            &[VolumeKind::Malloc, VolumeKind::Replica2],
            &[PeerChoice::QemuNbd, PeerChoice::Nbdkit, PeerChoice::Nbdkit],
        );
        let names: Vec<String> = t.iter().map(Target::name).collect();
        assert_eq!(
            names,
            [
                "lull-poll-malloc",
                "lull-adaptive-malloc",
                "lull-poll-replica2",
                "lull-adaptive-replica2",
                "qemu-nbd-file",
                "nbdkit-memory"
            ]
        );
        assert!(targets(
            true,
            &[Mode::Poll],
            &[100],
            &[VolumeKind::Malloc],
            &[PeerChoice::None]
        )
        .iter()
        .all(|t| !t.is_peer()));
        assert_eq!(
            targets(
                false,
                &[Mode::Poll],
                &[100],
                &[VolumeKind::Malloc],
                &[PeerChoice::Nbdkit]
            ),
            vec![Target::Nbdkit]
        );
        assert!(Target::QemuNbd.uses_data_file() && !Target::Nbdkit.uses_data_file());
    }

    #[test]
    fn hybrid_once_per_period() {
        let t = targets(
            true,
            &[Mode::Poll, Mode::Hybrid, Mode::Adaptive],
            &[10, 1000, 10],
            &[VolumeKind::Malloc, VolumeKind::Replica1],
            &[PeerChoice::None],
        );
        let names: Vec<String> = t.iter().map(Target::name).collect();
        assert_eq!(
            names,
            [
                "lull-poll-malloc",
                "lull-hybrid@10-malloc",
                "lull-hybrid@1000-malloc",
                "lull-adaptive-malloc",
                "lull-poll-replica1",
                "lull-hybrid@10-replica1",
                "lull-hybrid@1000-replica1",
                "lull-adaptive-replica1",
            ]
        );
        assert_eq!(
            t[1],
            Target::Lull {
                mode: Mode::Hybrid,
                volume: VolumeKind::Malloc,
                hybrid_period_us: Some(10)
            }
        );
        // The period only sticks to the hybrid mode.
        assert_eq!(
            Target::lull(Mode::Poll, VolumeKind::File, Some(10)).name(),
            "lull-poll-file"
        );
        // No periods → no hybrid targets; the other modes are unaffected.
        let t = targets(
            true,
            &[Mode::Hybrid, Mode::Interrupt],
            &[],
            &[VolumeKind::Malloc],
            &[PeerChoice::None],
        );
        assert_eq!(
            t,
            vec![Target::lull(Mode::Interrupt, VolumeKind::Malloc, None)]
        );
        let json =
            serde_json::to_value(Target::lull(Mode::Hybrid, VolumeKind::Malloc, Some(10))).unwrap();
        assert_eq!(json["hybrid_period_us"], 10);
        let json =
            serde_json::to_value(Target::lull(Mode::Poll, VolumeKind::Malloc, None)).unwrap();
        assert!(json.get("hybrid_period_us").is_none());
    }

    #[test]
    fn schedule_interleaves() {
        let jobs = [JobKind::RandreadIops, JobKind::SeqwriteBw];
        let s = schedule(2, &jobs, 2);
        let order: Vec<(u32, JobKind, usize)> =
            s.iter().map(|s| (s.repeat, s.job, s.target)).collect();
        assert_eq!(
            order,
            [
                (0, jobs[0], 0),
                (0, jobs[0], 1),
                (0, jobs[1], 0),
                (0, jobs[1], 1),
                (1, jobs[0], 0),
                (1, jobs[0], 1),
                (1, jobs[1], 0),
                (1, jobs[1], 1)
            ]
        );
        assert_eq!(s.iter().filter(|s| s.measure_idle).count(), 4);
        assert!(schedule(3, &jobs, 0).is_empty());
    }
}
