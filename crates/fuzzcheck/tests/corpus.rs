//! Replays every committed fuzz corpus (`fuzz/corpus/<target>/`) through the
//! check its fuzz target runs, on stable: what libFuzzer found once (a seed,
//! or a crash reproducer committed with its fix) stays tested in CI.

use std::path::{Path, PathBuf};

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = corpus_dir(target);
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (every fuzz target has a corpus)", dir.display()));
    let mut out: Vec<(PathBuf, Vec<u8>)> = entries
        .map(|e| e.expect("corpus entry").path())
        .filter(|p| p.is_file())
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "{}: empty corpus", dir.display());
    out
}

fn replay(target: &str) {
    let (_, check) = lull_fuzzcheck::TARGETS
        .iter()
        .find(|(name, _)| *name == target)
        .expect("a known target");
    for (path, bytes) in inputs(target) {
        let outcome = std::panic::catch_unwind(|| check(&bytes));
        assert!(outcome.is_ok(), "{target}: {} fails", path.display());
    }
}

#[test]
fn every_target_has_a_corpus_and_a_fuzz_target() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    for (name, _) in lull_fuzzcheck::TARGETS {
        assert!(corpus_dir(name).is_dir(), "no corpus for {name}");
        let source = fuzz.join("fuzz_targets").join(format!("{name}.rs"));
        let text = std::fs::read_to_string(&source)
            .unwrap_or_else(|e| panic!("{}: {e}", source.display()));
        assert!(
            text.contains(&format!("lull_fuzzcheck::{name}(")),
            "{} does not call lull_fuzzcheck::{name}",
            source.display()
        );
    }
}

#[test]
fn nbd_handshake() {
    replay("nbd_handshake");
}

#[test]
fn nbd_starttls() {
    replay("nbd_starttls");
}

#[test]
fn nbd_request() {
    replay("nbd_request");
}

#[test]
fn replica_frame() {
    replay("replica_frame");
}

#[test]
fn replica_reply() {
    replay("replica_reply");
}

#[test]
fn replica_meta() {
    replay("replica_meta");
}

#[test]
fn rpc_request() {
    replay("rpc_request");
}

#[test]
fn metrics_http() {
    replay("metrics_http");
}

#[test]
fn config_toml() {
    replay("config_toml");
}

#[test]
fn nvmf_pdu() {
    replay("nvmf_pdu");
}
