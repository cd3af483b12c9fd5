//! Event modes seen from outside: idle CPU, and real clients in each mode.
//! Functional checks (does it sleep, does it serve); speed is measured by
//! `lull bench`, never asserted here.

use std::time::Duration;

use crate::common::{assert_good_client_works, process_cpu_ticks, NbdClient, Server};

#[test]
fn adaptive_with_16_idle_clients_sleeps() {
    let mut args = vec!["--mode".to_string(), "adaptive".to_string()];
    for i in 0..16 {
        args.push("--volume".into());
        args.push(format!("v{i}:16M"));
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut server = Server::start(&args);
    // Each client does some I/O (so the adaptive windows have history),
    // then stays connected and idle.
    let mut clients = Vec::new();
    for i in 0..16 {
        let export = format!("v{i}");
        assert_good_client_works(server.addr(), &export, 0);
        let mut c = NbdClient::connect(server.addr(), &export).expect("connect");
        for k in 0..50u64 {
            assert_eq!(c.write(k * 4096, &[k as u8; 4096]).unwrap(), 0);
        }
        clients.push(c);
    }
    std::thread::sleep(Duration::from_millis(500));
    let before = process_cpu_ticks(server.pid());
    std::thread::sleep(Duration::from_secs(5));
    let used = process_cpu_ticks(server.pid()) - before;
    // < 1% of a core over 5 s is < 5 ticks of 10 ms.
    assert!(
        used < 5,
        "16 idle clients cost {} ms of CPU in 5 s",
        used * 10
    );
    for c in clients {
        c.disconnect();
    }
    server.assert_healthy();
}

#[test]
fn every_mode_serves_real_clients() {
    for mode in ["poll", "interrupt", "hybrid", "adaptive"] {
        let mut server = Server::start(&["--mode", mode, "--volume", "vol:16M"]);
        for i in 0..4 {
            assert_good_client_works(server.addr(), "vol", i * 65536);
        }
        server.assert_healthy();
    }
}
