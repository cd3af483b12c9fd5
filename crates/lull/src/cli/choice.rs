//! Command-line values that name a variant of a library enum (`--mode`
//! values, bench jobs, volume kinds, peers). The enums live in crates that
//! know nothing of clap, so clap reaches them through [`Choice`] and
//! [`parser`] instead of a `ValueEnum` derive; names, help lines and error
//! messages are the ones the derive gave.
//!
//! ```ignore
//! #[arg(long, value_parser = choice::parser::<Mode>())]
//! mode: Mode,
//! ```

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use lull_bench::nvmf::perf::NvmfJob;
use lull_bench::{JobKind, PeerChoice, Profile, SpdkPeer, VolumeKind};
use lull_reactor::Mode;

/// An enum whose variants are chosen by name on the command line.
pub(crate) trait Choice: Copy + Send + Sync + 'static {
    /// Every variant, in the order `--help` lists them.
    const ALL: &'static [Self];
    /// The name typed on the command line.
    fn name(self) -> &'static str;
    /// A line shown beside the name in `--help`.
    fn help(self) -> Option<&'static str> {
        None
    }
}

/// A clap value parser that accepts the names of `T`'s variants.
pub(crate) fn parser<T: Choice>() -> impl TypedValueParser<Value = T> {
    let values = T::ALL.iter().map(|&v| {
        let value = PossibleValue::new(v.name());
        match v.help() {
            Some(help) => value.help(help),
            None => value,
        }
    });
    PossibleValuesParser::new(values).map(|name: String| {
        *T::ALL
            .iter()
            .find(|v| v.name() == name)
            .expect("PossibleValuesParser passes only the names it was given")
    })
}

/// The names of `values`, for clap's `default_values`.
pub(crate) fn names<T: Choice>(values: &[T]) -> Vec<&'static str> {
    values.iter().map(|v| v.name()).collect()
}

impl Choice for Mode {
    const ALL: &'static [Mode] = &Mode::ALL;
    fn name(self) -> &'static str {
        self.as_str()
    }
}

impl Choice for JobKind {
    const ALL: &'static [JobKind] = &JobKind::ALL;
    fn name(self) -> &'static str {
        self.as_str()
    }
    fn help(self) -> Option<&'static str> {
        Some(match self {
            JobKind::RandreadIops => "4 KiB random read IOPS at QD64",
            JobKind::RandwriteIops => "4 KiB random write IOPS at QD64",
            JobKind::SeqreadBw => "128 KiB sequential read bandwidth at QD64",
            JobKind::SeqwriteBw => "128 KiB sequential write bandwidth at QD64",
            JobKind::RandreadLat => "4 KiB random read latency at QD1",
            JobKind::RandwriteLat => "4 KiB random write latency at QD1",
        })
    }
}

impl Choice for VolumeKind {
    const ALL: &'static [VolumeKind] = &VolumeKind::ALL;
    fn name(self) -> &'static str {
        self.as_str()
    }
    fn help(self) -> Option<&'static str> {
        Some(match self {
            VolumeKind::Malloc => "Memory backend",
            VolumeKind::File => "File backend (io_uring) on a preallocated file in a temp dir",
            VolumeKind::Replica1 => "One local replica server on its own directory",
            VolumeKind::Replica2 => "Two local replica servers, each on its own directory",
        })
    }
}

impl Choice for PeerChoice {
    const ALL: &'static [PeerChoice] = &PeerChoice::ALL;
    fn name(self) -> &'static str {
        self.as_str()
    }
    fn help(self) -> Option<&'static str> {
        Some(match self {
            PeerChoice::Nbdkit => "`nbdkit memory`",
            PeerChoice::QemuNbd => "`qemu-nbd` on a raw file with io_uring",
            PeerChoice::None => "No peers",
        })
    }
}

impl Choice for Profile {
    const ALL: &'static [Profile] = &Profile::ALL;
    fn name(self) -> &'static str {
        self.as_str()
    }
    fn help(self) -> Option<&'static str> {
        Some(match self {
            Profile::Kbench => "fio's nbd engine over NBD against nbdkit and qemu-nbd",
            Profile::Nvmf => "spdk_nvme_perf over NVMe/TCP against SPDK's nvmf_tgt",
        })
    }
}

impl Choice for NvmfJob {
    const ALL: &'static [NvmfJob] = &NvmfJob::ALL;
    fn name(self) -> &'static str {
        self.as_str()
    }
    fn help(self) -> Option<&'static str> {
        Some(self.describe())
    }
}

impl Choice for SpdkPeer {
    const ALL: &'static [SpdkPeer] = &SpdkPeer::ALL;
    fn name(self) -> &'static str {
        self.as_str()
    }
    fn help(self) -> Option<&'static str> {
        Some(match self {
            SpdkPeer::Poll => "nvmf_tgt polling (its default)",
            SpdkPeer::Interrupt => "nvmf_tgt --interrupt-mode",
            SpdkPeer::PollResp => {
                "nvmf_tgt polling with c2h_success off: a CapsuleResp after every read, as lull"
            }
            SpdkPeer::None => "No SPDK target",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct Cli {
        #[arg(long, value_parser = parser::<Mode>(), value_delimiter = ',')]
        modes: Vec<Mode>,
    }

    #[test]
    fn names_parse_to_variants() {
        let cli = Cli::try_parse_from(["x", "--modes", "poll,adaptive"]).unwrap();
        assert_eq!(cli.modes, [Mode::Poll, Mode::Adaptive]);
        let err = Cli::try_parse_from(["x", "--modes", "spin"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::InvalidValue);
        assert!(
            err.to_string()
                .contains("[possible values: poll, interrupt, hybrid, adaptive]"),
            "{err}"
        );
        assert_eq!(names(&[Mode::Hybrid, Mode::Poll]), ["hybrid", "poll"]);
    }

    #[test]
    fn every_variant_has_its_own_name() {
        fn distinct<T: Choice>() {
            let mut n = names(T::ALL);
            n.sort();
            n.dedup();
            assert_eq!(n.len(), T::ALL.len());
        }
        distinct::<Mode>();
        distinct::<JobKind>();
        distinct::<VolumeKind>();
        distinct::<PeerChoice>();
        distinct::<Profile>();
        distinct::<NvmfJob>();
        distinct::<SpdkPeer>();
    }
}
