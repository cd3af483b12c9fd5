//! Runs the benchmark through the library, without the `lull` binary's
//! command line: a quick run with the default modes and peers,
//! `cargo run -p lull-bench --example bench -- target/release/lull [OUT_DIR]`.
//! `lull bench --help` lists what a full run can be asked for.

use std::path::PathBuf;

use lull_bench::BenchConfig;

fn main() {
    let mut args = std::env::args_os().skip(1);
    let lull_exe = args
        .next()
        .map_or_else(|| PathBuf::from("target/release/lull"), PathBuf::from);
    let config = BenchConfig {
        quick: true,
        out: args
            .next()
            .map_or(BenchConfig::default().out, PathBuf::from),
        ..BenchConfig::default()
    };
    match lull_bench::run(&config, &lull_exe) {
        Ok(report) => println!(
            "{} results written to {}",
            report.results.len(),
            config.out.display()
        ),
        Err(e) => {
            eprintln!("lull bench: {e}");
            std::process::exit(1);
        }
    }
}
