//! Test certificates: a CA, a server and a client certificate made with
//! the `openssl` command. Shared by the lull binary's test tiers (through
//! `common`) and by crates/rpc/tests (by path: that crate cannot depend on
//! the binary's tests), so it uses nothing else of `common`.

use std::path::Path;
use std::process::{Command, Stdio};

/// A CA, a server certificate for 127.0.0.1 and localhost, and a client
/// certificate, in qemu's tls-creds-x509 layout (one directory serves both
/// ends: each loads only its own files), made with the `openssl` command.
/// Each call makes a new CA, so two directories do not trust each other.
pub fn make_pki(dir: &Path) {
    let found = Command::new("sh")
        .args(["-c", "command -v openssl"])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "openssl not found: install the Debian package openssl (scripts/test does)"
    );
    std::fs::create_dir_all(dir).expect("create the pki directory");
    let ossl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("run openssl");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let ca = [
        &[
            "req",
            "-x509",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=lull test CA",
        ][..],
        &ec[..],
        &["-keyout", "ca-key.pem", "-out", "ca-cert.pem"],
        &["-addext", "basicConstraints=critical,CA:TRUE"],
        &["-addext", "keyUsage=critical,keyCertSign,cRLSign"],
    ]
    .concat();
    ossl(&ca);
    let leaf =
        "keyUsage=critical,digitalSignature,keyEncipherment\nbasicConstraints=critical,CA:FALSE\n";
    for (who, ext) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        ),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        let extfile = format!("{who}.ext");
        std::fs::write(dir.join(&extfile), format!("{ext}{leaf}")).expect("extension file");
        let (key, csr, cert) = (
            format!("{who}-key.pem"),
            format!("{who}.csr"),
            format!("{who}-cert.pem"),
        );
        let subject = format!("/CN=lull test {who}");
        ossl(
            &[
                &["req", "-nodes", "-subj", &subject][..],
                &ec[..],
                &["-keyout", &key, "-out", &csr],
            ]
            .concat(),
        );
        ossl(&[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            &csr,
            "-CA",
            "ca-cert.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-extfile",
            &extfile,
            "-out",
            &cert,
        ]);
    }
}
