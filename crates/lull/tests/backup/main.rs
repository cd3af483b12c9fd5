//! The backup tier: backups of memory, file and replicated volumes to a
//! real S3 server (Versity's gateway, `versitygw`, built from the Go
//! module proxy by scripts/test) and to a directory, restored and read
//! back with the real clients (nbdcopy, qemu-img, qemu-io), and the
//! faults an operator meets. docs/TESTING.md has every tier.
//!
//! ```text
//! LULL_VERSITYGW=/var/tmp/lull-go/bin/versitygw cargo test -p lull --profile ci --test backup
//! ```

#[path = "../common/mod.rs"]
mod common;

mod backups;
mod s3;
