//! NBD requests up to 64 MiB (issue 33): libnbd writes and reads 40 and
//! 64 MiB, aligned and not, without negotiating block sizes, on memory,
//! file and 2-replica volumes; one byte more gets the spec's error and the
//! connection stays usable.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::common::tools::{run, uri};
use crate::common::{self, Kind, NbdClient, Replica, Scratch, Server};

const MAX: u32 = lull_proto::nbd::MAX_PAYLOAD_BYTES;

fn large_requests(server: &Server, export: &str) {
    let python = common::python_with_nbd();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/large_requests.py");
    let out = run(Command::new(python).arg(script).arg(uri(server, export)));
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}");
    assert!(text.trim_end().ends_with("ok"), "{text}");
    // Past the maximum: NBD_EINVAL (the request is drained, not read),
    // and the connection goes on.
    let mut c = NbdClient::connect(server.addr(), export).expect("connect");
    assert_eq!(
        c.read(0, MAX).expect("reply").map(|d| d.len()),
        Ok(MAX as usize)
    );
    assert_eq!(
        c.read(0, MAX + 1).expect("reply"),
        Err(lull_proto::nbd::NBD_EINVAL),
        "a read of 64 MiB + 1"
    );
    assert_eq!(
        c.write(0, &vec![7u8; MAX as usize + 1]).expect("reply"),
        lull_proto::nbd::NBD_EINVAL,
        "a write of 64 MiB + 1"
    );
    assert_eq!(
        c.write(4096, &[9u8; 4096]).expect("reply"),
        0,
        "then a write works"
    );
    assert_eq!(c.read(4096, 4096).expect("reply"), Ok(vec![9u8; 4096]));
    c.disconnect();
}

#[test]
fn requests_up_to_64_mib_on_memory_and_file_volumes() {
    let scratch = Scratch::new("large-local");
    let file = format!("f:256M:file={}", scratch.join("f.img").display());
    let mut server = Server::start(&["--volume", "m:256M", "--volume", &file]);
    large_requests(&server, "m");
    large_requests(&server, "f");
    server.assert_healthy();
}

#[test]
fn requests_up_to_64_mib_on_a_replicated_volume() {
    let scratch = Scratch::new("large-replicated");
    let a = Replica::start(Kind::Process, &scratch.join("a"), "256M");
    let b = Replica::start(Kind::Process, &scratch.join("b"), "256M");
    let spec = format!("v:256M:replicas={}+{}", a.target(), b.target());
    let mut server = Server::start(&["--replica-insecure", "--volume", &spec]);
    common::read_when_ready(&server, "v", 0, 4096, Duration::from_secs(30));
    large_requests(&server, "v");
    server.assert_healthy();
}
