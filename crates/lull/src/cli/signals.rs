//! The stop signals of the long-running commands (`lull serve`, `lull
//! replica`): SIGINT and SIGTERM end the process cleanly.

use std::process::ExitCode;

use signal_hook::iterator::Signals;

/// Takes over SIGINT and SIGTERM. Call it before any thread starts, so
/// every thread inherits the mask and only the waiter (`forever().next()`)
/// sees them. The error is printed here; the caller exits with the code.
pub(crate) fn stop_signals() -> Result<Signals, ExitCode> {
    Signals::new([signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM]).map_err(|e| {
        eprintln!("lull: error: cannot install signal handlers: {e}");
        ExitCode::FAILURE
    })
}
