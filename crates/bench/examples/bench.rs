//! Runs the benchmark without the `lull` binary's CLI wiring:
//! `cargo run -p lull-bench --example bench -- --lull-exe target/release/lull --quick`.

use clap::Parser;

#[derive(Parser, Debug)]
struct Cli {
    /// The lull executable to benchmark.
    #[arg(long, default_value = "target/release/lull")]
    lull_exe: std::path::PathBuf,
    #[command(flatten)]
    bench: lull_bench::BenchArgs,
}

fn main() {
    let cli = Cli::parse();
    match lull_bench::run(&cli.bench, &cli.lull_exe) {
        Ok(report) => println!(
            "{} results written to {}",
            report.results.len(),
            cli.bench.out.display()
        ),
        Err(e) => {
            eprintln!("lull bench: {e}");
            std::process::exit(1);
        }
    }
}
