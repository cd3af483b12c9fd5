//! Volume ids: where a volume's replicas are, written into the id itself
//! so that nothing but Kubernetes (the PersistentVolume's volume handle)
//! holds cluster state.
//!
//! ```text
//! CreateVolume name "pvc-5c1e..."  ->  lull name "pvc-5c1e..." (kept: short and valid)
//! CreateVolume name of 128 bytes   ->  lull name "h-3f0a...", 32 hex digits of its SHA-256
//! replicas on node-a and node-c    ->  volume id "pvc-5c1e...@node-a+node-c"
//! ```
//!
//! Every node of the id holds one replica named after the volume; the
//! engine is created under the same name on the node that stages it.

use sha2::{Digest, Sha256};

/// The CSI spec's general size limit on a string field (spec "Size
/// Limits"): a volume id must fit.
pub const MAX_VOLUME_ID_BYTES: usize = 128;

/// Longest CSI name kept as the lull name; longer ones are hashed. 64
/// bytes leave room in [`MAX_VOLUME_ID_BYTES`] for [`MAX_REPLICAS`] node
/// ids of [`MAX_NODE_ID_BYTES`], and a Kubernetes PV name (`pvc-` and a
/// UUID, 40 bytes) fits.
pub const MAX_NAME_BYTES: usize = 64;

/// Longest node id in the node list (see [`MAX_NAME_BYTES`]).
pub const MAX_NODE_ID_BYTES: usize = 20;

/// Most replicas of one volume: each is a full copy written on every
/// write, and three survive any two failures, which is what Longhorn and
/// Mayastor default or cap to as well.
pub const MAX_REPLICAS: usize = 3;

/// Hex digits of the SHA-256 kept in a hashed name: 128 bits.
const HASH_HEX_DIGITS: usize = 32;

/// Prefix of a hashed name.
pub(crate) const HASH_PREFIX: &str = "h-";

const _: () =
    assert!(MAX_NAME_BYTES + 1 + MAX_REPLICAS * (MAX_NODE_ID_BYTES + 1) <= MAX_VOLUME_ID_BYTES);

/// A volume's placement: its lull name and the nodes holding its replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeId {
    pub name: String,
    pub nodes: Vec<String>,
}

impl VolumeId {
    /// Parses an id; `None` for anything this plugin did not write (the
    /// callers answer NotFound, or success for a delete).
    pub fn parse(id: &str) -> Option<VolumeId> {
        if id.len() > MAX_VOLUME_ID_BYTES {
            return None;
        }
        let (name, nodes) = id.split_once('@')?;
        if !valid_name(name) || name.len() > MAX_NAME_BYTES {
            return None;
        }
        let nodes: Vec<String> = nodes.split('+').map(String::from).collect();
        if nodes.is_empty() || nodes.len() > MAX_REPLICAS {
            return None;
        }
        if !nodes.iter().all(|n| valid_node_id(n)) {
            return None;
        }
        for (i, n) in nodes.iter().enumerate() {
            if nodes[..i].contains(n) {
                return None;
            }
        }
        Some(VolumeId {
            name: name.to_string(),
            nodes,
        })
    }

    /// The id's text.
    pub fn format(&self) -> String {
        format!("{}@{}", self.name, self.nodes.join("+"))
    }
}

/// The lull name of a CSI volume name: the name itself when it is a valid
/// store name of at most [`MAX_NAME_BYTES`] that cannot be taken for a
/// hashed one; else `h-` and 32 hex digits of its SHA-256.
pub fn lull_name(csi_name: &str) -> String {
    if valid_name(csi_name) && csi_name.len() <= MAX_NAME_BYTES && !looks_hashed(csi_name) {
        return csi_name.to_string();
    }
    hashed_name(csi_name)
}

/// `h-` and 32 hex digits of the SHA-256 of `csi_name`: the name of a
/// volume or snapshot whose CSI name cannot serve as it is.
pub(crate) fn hashed_name(csi_name: &str) -> String {
    let digest = Sha256::digest(csi_name.as_bytes());
    let mut name = String::from(HASH_PREFIX);
    for byte in &digest[..HASH_HEX_DIGITS / 2] {
        name.push_str(&format!("{byte:02x}"));
    }
    name
}

/// Whether `name` has the shape of [`hashed_name`]'s (a CSI name of that
/// shape is hashed too, so two CSI names never meet in one lull name).
pub(crate) fn looks_hashed(name: &str) -> bool {
    name.strip_prefix(HASH_PREFIX).is_some_and(|hex| {
        hex.len() == HASH_HEX_DIGITS && hex.bytes().all(|b| b.is_ascii_hexdigit())
    })
}

/// A store replica name (docs/NODE.md "Names and sizes"), with no `@` or
/// `+` (so an id splits unambiguously; neither is allowed there anyway).
pub fn valid_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes[0].is_ascii_alphanumeric()
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A node id: a valid name of at most [`MAX_NODE_ID_BYTES`].
pub fn valid_node_id(id: &str) -> bool {
    valid_name(id) && id.len() <= MAX_NODE_ID_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        let id = VolumeId {
            name: "pvc-1".into(),
            nodes: vec!["a".into(), "b".into()],
        };
        assert_eq!(id.format(), "pvc-1@a+b");
        assert_eq!(VolumeId::parse("pvc-1@a+b"), Some(id));
    }

    #[test]
    fn foreign_ids_do_not_parse() {
        for bad in [
            "fake-vol-id",
            "",
            "@a",
            "v@",
            "v@a+a",
            "v@a+b+c+d",
            "v@a/b",
            "../x@a",
            &format!("{}@a", "x".repeat(MAX_NAME_BYTES + 1)),
        ] {
            assert_eq!(VolumeId::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn long_or_odd_names_are_hashed_and_stable() {
        assert_eq!(lull_name("pvc-1"), "pvc-1");
        let long = "x".repeat(128);
        let hashed = lull_name(&long);
        assert_eq!(hashed.len(), HASH_PREFIX.len() + HASH_HEX_DIGITS);
        assert_eq!(hashed, lull_name(&long));
        assert_ne!(hashed, lull_name(&"x".repeat(127)));
        assert!(looks_hashed(&hashed));
        // A name that looks hashed is hashed again, so no readable name
        // can collide with the hash of another.
        assert_ne!(lull_name(&hashed), hashed);
        assert!(lull_name("has space").starts_with(HASH_PREFIX));
        assert!(lull_name("a@b").starts_with(HASH_PREFIX));
        // The longest id fits the CSI limit.
        let id = VolumeId {
            name: "n".repeat(MAX_NAME_BYTES),
            nodes: (0..MAX_REPLICAS)
                .map(|i| format!("{i}").repeat(MAX_NODE_ID_BYTES))
                .collect(),
        };
        assert!(id.format().len() <= MAX_VOLUME_ID_BYTES);
        assert_eq!(VolumeId::parse(&id.format()), Some(id));
    }
}
