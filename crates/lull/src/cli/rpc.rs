//! `lull rpc METHOD [PARAMS]`: one JSON-RPC call through
//! [`lull_rpc::call`], its result printed, its outcome as the exit code.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use lull_rpc::{call, RpcClientError, DEFAULT_CLIENT_TIMEOUT_S, DEFAULT_RPC_SOCKET};
use serde_json::{json, Value};

use crate::cli::EXIT_USAGE;

/// `lull rpc`: call one method and print its result.
#[derive(clap::Args, Debug, Clone)]
pub struct RpcArgs {
    /// The server's Unix socket.
    #[arg(short = 's', long, default_value = DEFAULT_RPC_SOCKET)]
    pub socket: PathBuf,
    /// Seconds to wait for the response.
    #[arg(short = 't', long = "timeout", default_value_t = DEFAULT_CLIENT_TIMEOUT_S, value_name = "SECONDS")]
    pub timeout_s: f64,
    /// Method name, e.g. framework_get_reactors (rpc_get_methods lists them).
    pub method: String,
    /// Parameters as a JSON object, e.g. '{"name": "vol1", "size": "1G"}'.
    pub params: Option<String>,
}

/// Run `lull rpc`: the result as pretty JSON on stdout and exit 0; an error
/// response (as JSON) or an unreachable server on stderr and exit 1; params
/// that are not JSON, or a bad --timeout, exit 2.
pub fn run(args: &RpcArgs) -> ExitCode {
    let params = match &args.params {
        None => None,
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(v) => Some(v),
            Err(e) => {
                eprintln!("lull rpc: error: params are not valid JSON: {e}");
                return ExitCode::from(EXIT_USAGE);
            }
        },
    };
    let timeout = match Duration::try_from_secs_f64(args.timeout_s) {
        Ok(t) if !t.is_zero() => t,
        _ => {
            eprintln!("lull rpc: error: --timeout must be a positive number of seconds");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match call(&args.socket, &args.method, params, timeout) {
        Ok(result) => {
            use std::io::Write;
            // A closed pipe (`lull rpc ... | head`) is not an error of ours.
            let _ = writeln!(std::io::stdout(), "{}", pretty(&result));
            ExitCode::SUCCESS
        }
        Err(RpcClientError::Rpc {
            code,
            message,
            data,
        }) => {
            let mut err = json!({"code": code, "message": message});
            if let Some(d) = data {
                err["data"] = d;
            }
            eprintln!("{}", pretty(&err));
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("lull rpc: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use clap::Parser;
    use lull_rpc::{MethodRegistry, RpcMethodError, RpcServer};

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        rpc: RpcArgs,
    }

    #[test]
    fn exit_codes() {
        let dir = std::env::temp_dir().join(format!("lull-cli-rpc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("lull.sock");
        let mut reg = MethodRegistry::new();
        reg.register("echo", Box::new(|params| Ok(params.unwrap_or(Value::Null))))
            .unwrap();
        reg.register(
            "fail",
            Box::new(|_| Err(RpcMethodError::InvalidParams("no".into()))),
        )
        .unwrap();
        let server = RpcServer::start(&sock, Arc::new(reg)).unwrap();
        let args = |method: &str, params: Option<&str>| RpcArgs {
            socket: sock.clone(),
            timeout_s: 30.0,
            method: method.into(),
            params: params.map(String::from),
        };
        assert_eq!(run(&args("echo", None)), ExitCode::SUCCESS);
        assert_eq!(
            run(&args("echo", Some(r#"{"name": "vol0"}"#))),
            ExitCode::SUCCESS
        );
        assert_eq!(run(&args("fail", None)), ExitCode::FAILURE);
        assert_eq!(run(&args("no_such", None)), ExitCode::FAILURE);
        assert_eq!(run(&args("echo", Some("{not json"))), ExitCode::from(2));
        let mut bad_timeout = args("echo", None);
        bad_timeout.timeout_s = -1.0;
        assert_eq!(run(&bad_timeout), ExitCode::from(2));
        let mut gone = args("echo", None);
        gone.socket = sock.with_file_name("nobody-home.sock");
        assert_eq!(run(&gone), ExitCode::FAILURE);
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn parses_as_lull_rpc() {
        let cli = Cli::try_parse_from([
            "lull-rpc",
            "-s",
            "/tmp/x.sock",
            "volume_create",
            r#"{"name":"a","size":"1G"}"#,
        ])
        .unwrap();
        assert_eq!(cli.rpc.socket, PathBuf::from("/tmp/x.sock"));
        assert_eq!(cli.rpc.method, "volume_create");
        assert_eq!(
            cli.rpc.params.as_deref(),
            Some(r#"{"name":"a","size":"1G"}"#)
        );
        let cli = Cli::try_parse_from(["lull-rpc", "rpc_get_methods"]).unwrap();
        assert_eq!(cli.rpc.socket, PathBuf::from(DEFAULT_RPC_SOCKET));
        assert_eq!(cli.rpc.timeout_s, DEFAULT_CLIENT_TIMEOUT_S);
    }
}
