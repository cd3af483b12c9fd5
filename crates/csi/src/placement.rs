//! Where a new volume's replicas go: a pure function from the nodes'
//! room and topology to a list of distinct nodes.
//!
//! ```text
//! nodes a (room 10G), b (room 50G), c (room 1G); 2 replicas of 5G
//!   -> [b, a]        most room first, never two on one node, c too full
//! same, with a in the first preferred topology
//!   -> [a, b]        a preferred node first, then by room
//! ```

/// One node as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub id: String,
    /// Bytes of new replicas the node's store takes (docs/NODE.md: the
    /// overcommit ratio times free plus allocated space, less what its
    /// replicas already reserve).
    pub room_bytes: u64,
    /// Index of the first preferred topology the node is in, if any.
    pub preferred_rank: Option<usize>,
}

/// Why no placement was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("{replicas} replicas of {size_bytes} bytes need {replicas} distinct nodes with room: {with_room} of the {reachable} reachable nodes have it (largest room: {largest_room_bytes} bytes)")]
    NoRoom {
        replicas: usize,
        size_bytes: u64,
        reachable: usize,
        with_room: usize,
        largest_room_bytes: u64,
    },
}

/// The storage room of a store from its `store_get` figures.
pub fn room_bytes(
    free_bytes: u64,
    allocated_bytes: u64,
    provisioned_bytes: u64,
    overcommit_percent: u64,
) -> u64 {
    let limit = (u128::from(free_bytes) + u128::from(allocated_bytes))
        * u128::from(overcommit_percent)
        / 100;
    u64::try_from(limit.saturating_sub(u128::from(provisioned_bytes))).unwrap_or(u64::MAX)
}

/// Picks `replicas` distinct nodes with at least `size_bytes` of room for
/// the volume `name`: nodes in a preferred topology first (in the order of
/// preference), then the ones with most room; ties by a hash of the volume
/// name and the node id, stable for one volume and different from one
/// volume to the next, so that volumes created at once (each seeing the
/// same room everywhere) spread over the nodes instead of piling onto the
/// first ids (the CSI benchmark saw 8 of 200 replicas on one of 3 nodes).
pub fn place(
    candidates: &[Candidate],
    replicas: usize,
    size_bytes: u64,
    name: &str,
) -> Result<Vec<String>, PlacementError> {
    let tie = |id: &str| {
        use sha2::Digest;
        let d = sha2::Sha256::new()
            .chain_update(name.as_bytes())
            .chain_update([0u8])
            .chain_update(id.as_bytes())
            .finalize();
        (
            u64::from_be_bytes(d[..8].try_into().unwrap_or_default()),
            id.to_string(),
        )
    };
    let mut fit: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.room_bytes >= size_bytes)
        .collect();
    fit.sort_by(|a, b| {
        let rank = |c: &Candidate| c.preferred_rank.unwrap_or(usize::MAX);
        rank(a)
            .cmp(&rank(b))
            .then(b.room_bytes.cmp(&a.room_bytes))
            .then_with(|| tie(&a.id).cmp(&tie(&b.id)))
    });
    fit.dedup_by(|a, b| a.id == b.id);
    if fit.len() < replicas {
        return Err(PlacementError::NoRoom {
            replicas,
            size_bytes,
            reachable: candidates.len(),
            with_room: fit.len(),
            largest_room_bytes: candidates.iter().map(|c| c.room_bytes).max().unwrap_or(0),
        });
    }
    Ok(fit[..replicas].iter().map(|c| c.id.clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(id: &str, room_bytes: u64, preferred_rank: Option<usize>) -> Candidate {
        Candidate {
            id: id.into(),
            room_bytes,
            preferred_rank,
        }
    }

    #[test]
    fn most_room_first_and_never_twice_on_a_node() {
        let nodes = [c("a", 10, None), c("b", 50, None), c("c", 1, None)];
        assert_eq!(place(&nodes, 2, 5, "v").unwrap(), ["b", "a"]);
        let err = place(&nodes, 3, 5, "v").unwrap_err();
        assert_eq!(
            err,
            PlacementError::NoRoom {
                replicas: 3,
                size_bytes: 5,
                reachable: 3,
                with_room: 2,
                largest_room_bytes: 50
            }
        );
        // The same node twice in the input still counts once.
        let twice = [c("a", 10, None), c("a", 10, None)];
        assert!(place(&twice, 2, 1, "v").is_err());
    }

    #[test]
    fn preferred_topology_first() {
        let nodes = [c("a", 10, Some(1)), c("b", 50, None), c("c", 20, Some(0))];
        assert_eq!(place(&nodes, 2, 5, "v").unwrap(), ["c", "a"]);
        assert_eq!(place(&nodes, 3, 5, "v").unwrap(), ["c", "a", "b"]);
    }

    /// 20 volumes of 2 replicas on 3 nodes, each placement taking its
    /// room: never two replicas of a volume on one node, the load spread,
    /// and a full cluster refused rather than doubled up.
    #[test]
    fn twenty_volumes_on_three_nodes() {
        let mut nodes = vec![c("a", 100, None), c("b", 100, None), c("c", 100, None)];
        for _ in 0..20 {
            let chosen = place(&nodes, 2, 7, "v").unwrap();
            assert_eq!(chosen.len(), 2);
            assert_ne!(chosen[0], chosen[1]);
            for id in &chosen {
                let n = nodes.iter_mut().find(|n| &n.id == id).unwrap();
                n.room_bytes -= 7;
            }
        }
        let rooms: Vec<u64> = nodes.iter().map(|n| n.room_bytes).collect();
        assert!(rooms.iter().max().unwrap() - rooms.iter().min().unwrap() <= 7);
        // A full node: placed on the others; two full: refused.
        nodes[0].room_bytes = 0;
        nodes[1].room_bytes = 100;
        nodes[2].room_bytes = 100;
        let chosen = place(&nodes, 2, 7, "v").unwrap();
        assert!(!chosen.contains(&"a".to_string()), "{chosen:?}");
        nodes[1].room_bytes = 6;
        assert!(matches!(
            place(&nodes, 2, 7, "v"),
            Err(PlacementError::NoRoom { with_room: 1, .. })
        ));
    }

    /// Volumes created at once see the same room everywhere: the ties
    /// spread them, and one volume's answer does not change.
    #[test]
    fn ties_spread_volumes_created_at_once() {
        let nodes = [c("n1", 100, None), c("n2", 100, None), c("n3", 100, None)];
        let mut count = std::collections::HashMap::new();
        for i in 0..99 {
            let name = format!("pvc-{i}");
            let chosen = place(&nodes, 2, 1, &name).unwrap();
            assert_eq!(chosen, place(&nodes, 2, 1, &name).unwrap(), "stable");
            for id in chosen {
                *count.entry(id).or_insert(0) += 1;
            }
        }
        // 198 replicas, 66 per node if even.
        assert!(count.values().all(|&n| (44..=88).contains(&n)), "{count:?}");
    }

    #[test]
    fn room_follows_the_store_rule() {
        assert_eq!(room_bytes(100, 0, 0, 100), 100);
        assert_eq!(room_bytes(100, 50, 120, 100), 30);
        assert_eq!(room_bytes(100, 0, 150, 200), 50);
        assert_eq!(room_bytes(10, 0, 50, 100), 0);
    }
}
