//! A real S3 server for the tests: Versity's gateway over a directory
//! (`versitygw posix DIR`), one per test on a port of its own. Its bucket
//! `lulltest` is a directory under DIR, so a test can also reach the
//! stored objects as files (to damage a chunk, or count them).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::{free_port, wait_until};

pub const BUCKET: &str = "lulltest";
pub const ACCESS_KEY: &str = "lull-test-ak";
pub const SECRET_KEY: &str = "lull-test-sk";

/// The gateway binary: `LULL_VERSITYGW`, else `versitygw` on PATH, else
/// Go's default install directory. Missing: the test fails, saying how
/// to get it (scripts/test builds it).
fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("LULL_VERSITYGW") {
        return p.into();
    }
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let p = Path::new(dir).join("versitygw");
        if p.is_file() {
            return p;
        }
    }
    let home = std::env::var("HOME").unwrap_or_default();
    let p = Path::new(&home).join("go/bin/versitygw");
    assert!(
        p.is_file(),
        "no versitygw (the S3 server of the backup tier): run scripts/test, or \
         `go install github.com/versity/versitygw/cmd/versitygw@v1.8.0` and set LULL_VERSITYGW"
    );
    p
}

pub struct S3 {
    child: Child,
    pub addr: SocketAddr,
    pub root: PathBuf,
    scheme: &'static str,
}

impl S3 {
    pub fn start(root: &Path) -> S3 {
        S3::start_with(root, None)
    }

    /// Over TLS with the certificate of `pki` (`make_pki`'s
    /// server-cert.pem and server-key.pem, for 127.0.0.1).
    pub fn start_tls(root: &Path, pki: &Path) -> S3 {
        S3::start_with(root, Some(pki))
    }

    fn start_with(root: &Path, pki: Option<&Path>) -> S3 {
        std::fs::create_dir_all(root.join(BUCKET)).expect("bucket directory");
        let addr = free_port();
        let log = std::fs::File::create(root.with_extension("log")).expect("gateway log");
        let mut cmd = Command::new(binary());
        cmd.env("ROOT_ACCESS_KEY", ACCESS_KEY)
            .env("ROOT_SECRET_KEY", SECRET_KEY)
            .args(["--port", &addr.to_string()]);
        if let Some(pki) = pki {
            cmd.arg("--cert")
                .arg(pki.join("server-cert.pem"))
                .arg("--key")
                .arg(pki.join("server-key.pem"));
        }
        let child = cmd
            .arg("posix")
            .arg(root)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("start versitygw");
        let up = wait_until(Duration::from_secs(20), || {
            std::net::TcpStream::connect(addr).is_ok()
        });
        assert!(up, "versitygw did not listen on {addr}");
        S3 {
            child,
            addr,
            root: root.to_path_buf(),
            scheme: if pki.is_some() { "https" } else { "http" },
        }
    }

    /// `s3://lulltest/PREFIX?endpoint=...`
    pub fn url(&self, prefix: &str) -> String {
        format!(
            "s3://{BUCKET}/{prefix}?endpoint={}://{}",
            self.scheme, self.addr
        )
    }

    /// The directory that holds `PREFIX`'s objects.
    pub fn dir(&self, prefix: &str) -> PathBuf {
        self.root.join(BUCKET).join(prefix)
    }

    /// A credentials file in `dir` with this server's keys.
    pub fn credentials(&self, dir: &Path) -> PathBuf {
        let f = dir.join("s3-credentials");
        std::fs::write(
            &f,
            format!("access_key_id = {ACCESS_KEY}\nsecret_access_key = {SECRET_KEY}\n"),
        )
        .expect("credentials file");
        f
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
