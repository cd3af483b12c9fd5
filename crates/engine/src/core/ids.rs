//! Typed ids for replicas and their connections.

/// Identifies one TCP connection of one replica; `epoch` changes at every
/// (re)connect so that events of an older connection are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnRef {
    pub replica: u32,
    pub conn: u32,
    pub epoch: u32,
}
