//! The stop signals of the long-running commands (`lull serve`, `lull
//! replica`): SIGINT and SIGTERM end the process cleanly.

use std::process::ExitCode;

use signal_hook::iterator::Signals;

/// Takes over SIGINT and SIGTERM: signal-hook installs handlers that
/// record them for `forever().next()` to return, so they no longer end the
/// process at once (no signal mask is involved: whichever thread the
/// kernel picks runs the handler). Call it before the reactors start, so
/// a stop asked for during start-up is seen by the wait that follows. The
/// error is printed here; the caller exits with the code.
pub(crate) fn stop_signals() -> Result<Signals, ExitCode> {
    Signals::new([signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM]).map_err(|e| {
        eprintln!("lull: error: cannot install signal handlers: {e}");
        ExitCode::FAILURE
    })
}
