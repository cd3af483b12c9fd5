//! The config-file target: `lull serve --config FILE`.

use std::net::SocketAddr;

use lull_config::{resolve, ConfigFile, Overrides};

/// CPUs the resolver is told the process may use.
const ALLOWED_CPUS: &[usize] = &[0, 1, 2, 3];

/// Whether resolving `file` could look a name up in DNS: a `replicas=`
/// backend whose addresses are not all IP:PORT literals (the resolver's
/// `to_socket_addrs` would ask the system resolver; a fuzzer must not).
fn needs_dns(file: &ConfigFile) -> bool {
    file.volume.iter().any(|v| {
        v.backend
            .as_deref()
            .and_then(|b| b.strip_prefix("replicas="))
            .is_some_and(|list| {
                list.split('+')
                    .any(|a| a.trim().parse::<SocketAddr>().is_err())
            })
    })
}

/// Parses arbitrary bytes as the TOML config file and resolves it with no
/// flags, as `lull serve --config FILE` does (a file that is not UTF-8 is
/// refused when it is read, before parsing).
///
/// Input layout: the file's bytes.
/// Checks: no panic; parsing and resolving are deterministic (a second run
/// gives the same settings or the same message); resolved settings keep
/// their promises (cores allowed and non-empty, volume names unique and
/// non-empty, a poll period of at least 1 µs, somewhere to listen).
pub fn config_toml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let run = || {
        let file = ConfigFile::parse(text)?;
        if needs_dns(&file) {
            return Ok(None);
        }
        resolve(file, Overrides::default(), ALLOWED_CPUS).map(Some)
    };
    let first = run();
    let second = run();
    match (&first, &second) {
        (Ok(a), Ok(b)) => assert_eq!(a, b),
        (Err(a), Err(b)) => assert_eq!(a.0, b.0),
        _ => panic!("config resolved differently twice: {first:?} / {second:?}"),
    }
    let Ok(Some(settings)) = first else {
        return;
    };
    assert!(!settings.cores.is_empty());
    assert!(settings.cores.iter().all(|c| ALLOWED_CPUS.contains(c)));
    assert!(settings.ioq_poll_period_us >= 1);
    assert!(settings.listen.is_some() || settings.socket.is_some());
    assert!(!settings.volumes.is_empty());
    let mut names: Vec<&str> = settings.volumes.iter().map(|v| v.name.as_str()).collect();
    assert!(names.iter().all(|n| !n.is_empty()));
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), settings.volumes.len());
}
