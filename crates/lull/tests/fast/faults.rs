//! Fault injection seen by real clients: a volume on the faulty backend
//! answers some requests with EIO and stays usable; a replica started with
//! fault flags does not stop a replicated volume from serving correct data.

use std::path::Path;
use std::process::Command;

use crate::common::{self, Server};

/// The counts `faulty.py` printed, by name.
fn count(text: &str, name: &str) -> u64 {
    text.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name}= in {text}"))
}

#[test]
fn faulty_backend_replies_eio_and_the_connection_stays_usable() {
    let python = common::python_with_nbd();
    let mut server = Server::start(&[
        "--volume",
        "v:16M:faulty=malloc,read_err=0.3,write_err=0.3,flush_err=0.3,delay_us=500,seed=11",
    ]);
    // The warning an operator must see, with the seed that replays it.
    server.assert_logged(&["FAULT INJECTION ENABLED", "seed=11"]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/faulty.py");
    let out = Command::new(python)
        .arg(script)
        .args([&format!("nbd://{}/v", server.addr()), "300"])
        .output()
        .expect("run faulty.py");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && text.trim_end().ends_with("ok"),
        "faulty.py failed ({}):\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    // 300 tries of each at p = 0.3: about 90 failures each; 0 or 300 would
    // mean the injection (or the EIO reply) does not work.
    for kind in ["write", "read", "flush"] {
        let (ok, eio) = (
            count(&text, &format!("{kind}_ok")),
            count(&text, &format!("{kind}_eio")),
        );
        assert_eq!(ok + eio, 300, "{kind}");
        assert!(
            (40..=150).contains(&eio),
            "{kind}: {eio} EIO of 300 at p = 0.3"
        );
    }
    server.assert_healthy();
    // A fresh client still gets served (a read may fail, so retry a few).
    common::require("qemu-io", "qemu-utils");
    let ok = (0..20).any(|_| {
        Command::new("qemu-io")
            .args([
                "-f",
                "raw",
                "-c",
                "read 0 4k",
                &format!("nbd://{}/v", server.addr()),
            ])
            .output()
            .is_ok_and(|o| {
                o.status.success() && !String::from_utf8_lossy(&o.stdout).contains("error")
            })
    });
    assert!(ok, "qemu-io never read successfully in 20 tries at p = 0.3");
    server.assert_healthy();
}

#[test]
fn faulty_backend_from_the_config_file() {
    let dir = common::Scratch::new("faults-conf");
    let conf = dir.join("lull.toml");
    std::fs::write(
        &conf,
        "[[volume]]\nname = \"v\"\nsize = \"1M\"\nbackend = \"faulty=malloc,read_err=1,seed=3\"\n",
    )
    .expect("write the config");
    let mut server = Server::start(&["--config", conf.to_str().expect("utf-8 path")]);
    server.assert_logged(&["FAULT INJECTION ENABLED"]);
    let mut client = common::NbdClient::connect(server.addr(), "v").expect("connect");
    assert_eq!(client.write(0, &[1; 512]).expect("write"), 0);
    assert_eq!(client.read(0, 512).expect("read"), Err(libc::EIO as u32));
    assert_eq!(
        client.read(0, 512).expect("read"),
        Err(libc::EIO as u32),
        "every read fails at p = 1"
    );
    server.assert_healthy();
}
