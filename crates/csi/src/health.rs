//! A volume's health as the controller sees it: a pure function from what
//! the replica nodes and the engine's node answered to the CSI health
//! entries (one per status and reason, as the spec asks).
//!
//! ```text
//! node-b unreachable, node-a holds its replica, engine on node-c says
//! node-a's replica is rebuilding
//!   -> DEGRADED ReplicaNodeUnreachable "node-b: ..."
//!      DEGRADED ReplicaRebuilding      "node-c's engine: 10.0.0.7:10900/pvc-1 rebuilding"
//! no replica answers -> INACCESSIBLE NoReplica
//! ```

use std::collections::BTreeMap;

use crate::pb::volume_health::VolumeHealthEntry;
use crate::pb::VolumeHealthErrorType;

/// What one replica node said about the volume's replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaSeen {
    Present,
    Missing,
    Unreachable(String),
}

/// The health entries of a volume.
/// `replicas`: each replica node and what it said; `engines`: each node
/// running the volume's engine, with the state of each of its replicas
/// (`replica_list`: addr, state).
pub fn entries(
    replicas: &[(String, ReplicaSeen)],
    engines: &[(String, Vec<(String, String)>)],
) -> Vec<VolumeHealthEntry> {
    // (status, reason) -> messages, ordered so that the answer is stable.
    let mut found: Found = BTreeMap::new();
    let mut add = |status: VolumeHealthErrorType, reason: &'static str, msg: String| {
        found.entry((status as i32, reason)).or_default().push(msg);
    };
    let present = replicas
        .iter()
        .filter(|(_, s)| *s == ReplicaSeen::Present)
        .count();
    if present == 0 {
        add(
            VolumeHealthErrorType::Inaccessible,
            "NoReplica",
            "no replica node holds the volume's replica or answers".into(),
        );
    }
    for (node, seen) in replicas {
        match seen {
            ReplicaSeen::Present => {}
            ReplicaSeen::Missing => add(
                VolumeHealthErrorType::Degraded,
                "ReplicaMissing",
                format!("node {node} does not hold its replica"),
            ),
            ReplicaSeen::Unreachable(why) => add(
                VolumeHealthErrorType::Degraded,
                "ReplicaNodeUnreachable",
                format!("node {node}: {why}"),
            ),
        }
    }
    engine_entries(engines, &mut add);
    collect(found)
}

/// The entries of what the engines say of their replicas alone (the node
/// service's view: its own engine).
pub fn engine_only(engines: &[(String, Vec<(String, String)>)]) -> Vec<VolumeHealthEntry> {
    let mut found: Found = BTreeMap::new();
    let mut add = |status: VolumeHealthErrorType, reason: &'static str, msg: String| {
        found.entry((status as i32, reason)).or_default().push(msg);
    };
    engine_entries(engines, &mut add);
    collect(found)
}

type Found = BTreeMap<(i32, &'static str), Vec<String>>;

fn engine_entries(
    engines: &[(String, Vec<(String, String)>)],
    add: &mut impl FnMut(VolumeHealthErrorType, &'static str, String),
) {
    for (node, states) in engines {
        if !states.iter().any(|(_, state)| state == "healthy") {
            // No healthy replica: the engine fails I/O with EIO.
            add(
                VolumeHealthErrorType::Inaccessible,
                "NoHealthyReplica",
                format!("{node}'s engine has no healthy replica"),
            );
        }
        for (addr, state) in states {
            let reason = match state.as_str() {
                "healthy" => continue,
                "failed" => "ReplicaFailed",
                "rebuilding" | "reconciling" => "ReplicaRebuilding",
                _ => "ReplicaConnecting",
            };
            add(
                VolumeHealthErrorType::Degraded,
                reason,
                format!("{node}'s engine: {addr} {state}"),
            );
        }
    }
}

fn collect(found: Found) -> Vec<VolumeHealthEntry> {
    found
        .into_iter()
        .map(|((status, reason), msgs)| VolumeHealthEntry {
            status,
            reason: reason.to_string(),
            message: msgs.join("; "),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthy_volume_has_no_entries() {
        let replicas = [
            ("a".to_string(), ReplicaSeen::Present),
            ("b".to_string(), ReplicaSeen::Present),
        ];
        let engines = [(
            "c".to_string(),
            vec![
                ("a:1/v".to_string(), "healthy".to_string()),
                ("b:1/v".to_string(), "healthy".to_string()),
            ],
        )];
        assert!(entries(&replicas, &engines).is_empty());
        assert!(entries(&replicas, &[]).is_empty());
    }

    #[test]
    fn degraded_and_inaccessible_one_entry_per_reason() {
        let replicas = [
            ("a".to_string(), ReplicaSeen::Present),
            ("b".to_string(), ReplicaSeen::Unreachable("refused".into())),
            ("c".to_string(), ReplicaSeen::Unreachable("timeout".into())),
        ];
        let engines = [(
            "a".to_string(),
            vec![
                ("a:1/v".to_string(), "rebuilding".to_string()),
                ("b:1/v".to_string(), "failed".to_string()),
            ],
        )];
        let e = entries(&replicas, &engines);
        let reasons: Vec<&str> = e.iter().map(|x| x.reason.as_str()).collect();
        // Rebuilding and failed: nothing serves reads, so inaccessible too.
        assert_eq!(
            reasons,
            [
                "ReplicaFailed",
                "ReplicaNodeUnreachable",
                "ReplicaRebuilding",
                "NoHealthyReplica"
            ]
        );
        assert!(e[1].message.contains("refused") && e[1].message.contains("timeout"));
        let dead = [(
            "a".to_string(),
            vec![("b:1/v".to_string(), "failed".to_string())],
        )];
        let d = engine_only(&dead);
        assert_eq!(d.len(), 2);
        assert!(d
            .iter()
            .any(|x| x.status == VolumeHealthErrorType::Inaccessible as i32
                && x.reason == "NoHealthyReplica"));
        assert!(e[..3]
            .iter()
            .all(|x| x.status == VolumeHealthErrorType::Degraded as i32));

        let gone = [
            ("a".to_string(), ReplicaSeen::Missing),
            ("b".to_string(), ReplicaSeen::Unreachable("down".into())),
        ];
        let e = entries(&gone, &[]);
        assert_eq!(e[0].status, VolumeHealthErrorType::Degraded as i32);
        assert!(e
            .iter()
            .any(|x| x.status == VolumeHealthErrorType::Inaccessible as i32
                && x.reason == "NoReplica"));
    }
}
