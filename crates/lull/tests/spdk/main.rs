//! The SPDK tier: NVMe/TCP against SPDK's own initiator tools
//! (spdk_nvme_identify, spdk_nvme_perf, spdk_dd) and raw hosts, over TLS
//! too (and SPDK's nvmf_tgt with the same keys), and the
//! smoke runs of the benchmarks (`lull bench`, scripts/bench-per-io,
//! `lull bench --profile nvmf` against SPDK's nvmf_tgt). SPDK's tools are
//! not a Debian package: without them (LULL_SPDK_TOOLS, or
//! ../shared/tools/spdk) their tests print SKIP and scripts/test says so.
//! docs/TESTING.md has every tier.
//!
//! ```text
//! cargo test -p lull --profile ci --test spdk
//! cargo test -p lull --profile ci --test spdk nvmf::
//! cargo test -p lull --profile ci --test spdk nvmf_tls::
//! ```

#[path = "../common/mod.rs"]
mod common;

mod bench_smoke;
mod nvmf;
mod nvmf_tls;
