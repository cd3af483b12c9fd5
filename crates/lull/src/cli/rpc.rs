//! `lull rpc METHOD [PARAMS]`: one JSON-RPC call through
//! [`lull_rpc::call`] (the Unix socket) or [`lull_rpc::call_tcp`]
//! (`--addr HOST:PORT`, TLS only), its result printed, its outcome as the
//! exit code.
//!
//! ```text
//! $ lull rpc volume_list
//! $ lull rpc --addr 10.0.0.7:5260 --tls-psk rpc.psk volume_list
//! $ lull rpc --addr 10.0.0.7:5260 --tls-certs /etc/lull/rpc-client volume_list
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use lull_rpc::{
    call, call_tcp, RpcClientError, RpcTls, DEFAULT_CLIENT_TIMEOUT_S, DEFAULT_RPC_SOCKET,
};
use serde_json::{json, Value};

use crate::cli::EXIT_USAGE;

/// `lull rpc`: call one method and print its result.
#[derive(clap::Args, Debug, Clone)]
pub struct RpcArgs {
    /// The server's Unix socket.
    #[arg(short = 's', long, default_value = DEFAULT_RPC_SOCKET)]
    pub socket: PathBuf,
    /// Call over TCP instead: the server's --rpc-listen address. TLS only:
    /// needs --tls-psk or --tls-certs.
    #[arg(long, value_name = "HOST:PORT", conflicts_with = "socket")]
    pub addr: Option<String>,
    /// With --addr: a username:hexkey file; the first entry is presented
    /// (the server's --rpc-tls-psk file must hold the same key).
    #[arg(
        long,
        value_name = "FILE",
        requires = "addr",
        conflicts_with = "tls_certs"
    )]
    pub tls_psk: Option<PathBuf>,
    /// With --addr: a directory with ca-cert.pem (the CA of the server's
    /// certificate), client-cert.pem and client-key.pem (qemu's
    /// tls-creds-x509 layout); the server's CA must have signed the client
    /// certificate.
    #[arg(long, value_name = "DIR", requires = "addr")]
    pub tls_certs: Option<PathBuf>,
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
/// that are not JSON, a bad --timeout, --addr without TLS credentials, or
/// credentials that cannot be loaded, exit 2.
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
    let outcome = match &args.addr {
        None => call(&args.socket, &args.method, params, timeout),
        Some(addr) => {
            let tls = match tls_flags(args) {
                Ok(tls) => tls,
                Err(msg) => return usage(&msg),
            };
            let ctx = match tls.client() {
                Ok(ctx) => ctx,
                Err(e) => return usage(&e.to_string()),
            };
            call_tcp(addr, &ctx, &args.method, params, timeout)
        }
    };
    match outcome {
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

/// The credentials `--addr` needs: exactly one of --tls-psk and
/// --tls-certs (clap refuses both; this also covers args built in code).
fn tls_flags(args: &RpcArgs) -> Result<RpcTls, String> {
    match (&args.tls_psk, &args.tls_certs) {
        (Some(file), None) => Ok(RpcTls::Psk(file.clone())),
        (None, Some(dir)) => Ok(RpcTls::Certs(dir.clone())),
        (None, None) => Err(
            "--addr needs --tls-psk FILE or --tls-certs DIR: JSON-RPC over TCP is TLS only".into(),
        ),
        (Some(_), Some(_)) => Err("give only one of --tls-psk and --tls-certs".into()),
    }
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("lull rpc: error: {msg}");
    ExitCode::from(EXIT_USAGE)
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use clap::Parser;
    use lull_rpc::{MethodRegistry, RpcMethodError, RpcServer, RpcTcpServer};

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
            addr: None,
            tls_psk: None,
            tls_certs: None,
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

    /// `--addr` goes through TLS or not at all; the flag checks come
    /// before any connection (a refused connection would exit 1, not 2).
    #[test]
    fn tcp_calls_need_tls() {
        let dir = std::env::temp_dir().join(format!("lull-cli-rpc-tcp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = |name: &str, hex: &str| {
            let path = dir.join(name);
            std::fs::write(&path, format!("admin:{hex}\n")).unwrap();
            path
        };
        let good = key("good.psk", &"5a".repeat(32));
        let wrong = key("wrong.psk", &"a5".repeat(32));
        let mut reg = MethodRegistry::new();
        reg.register("echo", Box::new(|params| Ok(params.unwrap_or(Value::Null))))
            .unwrap();
        let tls = RpcTls::Psk(good.clone()).server().unwrap();
        let server =
            RpcTcpServer::start("127.0.0.1:0".parse().unwrap(), tls, Arc::new(reg)).unwrap();
        let args = |psk: Option<&PathBuf>| RpcArgs {
            socket: PathBuf::from(DEFAULT_RPC_SOCKET),
            addr: Some(server.local_addr().to_string()),
            tls_psk: psk.cloned(),
            tls_certs: None,
            timeout_s: 30.0,
            method: "echo".into(),
            params: Some(r#"{"x": 1}"#.into()),
        };
        assert_eq!(run(&args(Some(&good))), ExitCode::SUCCESS);
        assert_eq!(run(&args(Some(&wrong))), ExitCode::FAILURE);
        assert_eq!(run(&args(None)), ExitCode::from(EXIT_USAGE));
        let missing = dir.join("missing.psk");
        assert_eq!(run(&args(Some(&missing))), ExitCode::from(EXIT_USAGE));
        let mut both = args(Some(&good));
        both.tls_certs = Some(dir.clone());
        assert_eq!(run(&both), ExitCode::from(EXIT_USAGE));
        // The server took the good call after the refusals, too.
        assert_eq!(run(&args(Some(&good))), ExitCode::SUCCESS);
        drop(server);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tcp_flag_combinations() {
        let parse = |flags: &[&str]| {
            Cli::try_parse_from(["lull-rpc"].iter().chain(flags).chain(&["rpc_get_methods"]))
        };
        let kind = |flags: &[&str]| parse(flags).err().map(|e| (e.kind(), e.exit_code()));
        use clap::error::ErrorKind::{ArgumentConflict, MissingRequiredArgument};
        assert_eq!(
            kind(&["--addr", "h:1", "-s", "/tmp/x.sock", "--tls-psk", "k"]),
            Some((ArgumentConflict, 2))
        );
        assert_eq!(
            kind(&["--addr", "h:1", "--tls-psk", "k", "--tls-certs", "d"]),
            Some((ArgumentConflict, 2))
        );
        assert_eq!(
            kind(&["--tls-psk", "k"]),
            Some((MissingRequiredArgument, 2))
        );
        assert_eq!(
            kind(&["--tls-certs", "d"]),
            Some((MissingRequiredArgument, 2))
        );
        let cli = parse(&["--addr", "node1:5260", "--tls-certs", "/etc/pki"]).unwrap();
        assert_eq!(cli.rpc.addr.as_deref(), Some("node1:5260"));
        assert_eq!(cli.rpc.tls_certs, Some(PathBuf::from("/etc/pki")));
        assert_eq!(cli.rpc.tls_psk, None);
        // --addr alone parses; `run` refuses it with the TLS message.
        let cli = parse(&["--addr", "node1:5260"]).unwrap();
        let msg = tls_flags(&cli.rpc).unwrap_err();
        assert!(
            msg.contains("TLS only") && msg.contains("--tls-psk"),
            "{msg}"
        );
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
        assert_eq!(cli.rpc.addr, None);
        assert_eq!(cli.rpc.timeout_s, DEFAULT_CLIENT_TIMEOUT_S);
    }
}
