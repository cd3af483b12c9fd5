//! Typed ids for replicas and their connections, and the containers
//! indexed by them (crucible's `ClientId` and `ClientData<T>`; here the
//! number of replicas changes at run time, up to [`MAX_REPLICAS`]).
//!
//! ```
//! use lull_engine::core::ids::{ReplicaData, ReplicaId, ReplicaSet};
//! let mut names = ReplicaData::new();
//! let a = names.push("a");
//! let b = names.push("b");
//! assert_eq!((a, names[b]), (ReplicaId::new(0), "b"));
//! let set = ReplicaSet::only(b);
//! assert!(set.contains(b) && !set.contains(a));
//! assert_eq!(set.iter().collect::<Vec<_>>(), [b]);
//! ```

use std::fmt;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::ops::{Index, IndexMut};
use std::sync::Arc;

/// Replicas one volume may have (configured plus added). Longhorn runs 3;
/// the bound keeps a [`ReplicaSet`] in one `u32`.
pub const MAX_REPLICAS: usize = 16;

/// TCP connections per replica (the upper bound of
/// `EngineOptions::connections_per_replica`): 16 is far past any gain on
/// one NIC queue.
pub const MAX_CONNECTIONS_PER_REPLICA: usize = 16;

/// Where a replica is: its server's address and, for a replica in a
/// node's store (many replicas on one port), its name, sent in the HELLO.
/// Written `HOST:PORT` (a `lull replica` process) or `HOST:PORT/NAME`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ReplicaTarget {
    pub addr: SocketAddr,
    /// `None` for a `lull replica` process; checked by
    /// `lull_proto::replica::check_replica_name` when set.
    pub name: Option<Arc<str>>,
}

impl ReplicaTarget {
    /// A `lull replica` process at `addr`.
    pub fn process(addr: SocketAddr) -> ReplicaTarget {
        ReplicaTarget { addr, name: None }
    }

    /// `HOST:PORT` and the checked name of `HOST:PORT[/NAME]`: the one
    /// place that reads a replica's name from text.
    pub fn split_name(s: &str) -> Result<(&str, Option<Arc<str>>), String> {
        match s.split_once('/') {
            Some((addr, name)) => {
                lull_proto::replica::check_replica_name(name).map_err(|e| format!("{s}: {e}"))?;
                Ok((addr, Some(Arc::from(name))))
            }
            None => Ok((s, None)),
        }
    }

    /// The name a HELLO carries (`""`: none).
    pub fn hello_name(&self) -> &str {
        self.name.as_deref().unwrap_or("")
    }
}

/// As [`fmt::Display`]: `Debug` output (logs, milestones, the simulator's
/// summaries) reads like the address it was before replicas had names.
impl fmt::Debug for ReplicaTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl From<SocketAddr> for ReplicaTarget {
    fn from(addr: SocketAddr) -> ReplicaTarget {
        ReplicaTarget::process(addr)
    }
}

/// `IP:PORT` or `IP:PORT/NAME` with a literal address (no name lookup:
/// `lull_engine::parse_replica` resolves host names).
impl std::str::FromStr for ReplicaTarget {
    type Err = String;

    fn from_str(s: &str) -> Result<ReplicaTarget, String> {
        let (addr, name) = ReplicaTarget::split_name(s)?;
        let addr = addr
            .parse()
            .map_err(|e| format!("{s}: {e} (expected IP:PORT[/NAME])"))?;
        Ok(ReplicaTarget { addr, name })
    }
}

impl fmt::Display for ReplicaTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(name) => write!(f, "{}/{name}", self.addr),
            None => write!(f, "{}", self.addr),
        }
    }
}

/// An index below a fixed bound, for [`IdVec`].
pub trait Id: Copy {
    /// Panics at or past the bound: an index that large is a bug.
    fn new(index: usize) -> Self;
    fn get(self) -> usize;
}

/// A replica of the engine: its index, below [`MAX_REPLICAS`]. A removed
/// replica's index is reused by the next one added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReplicaId(u8);

/// One of a replica's connections, below `MAX_CONNECTIONS_PER_REPLICA`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ConnId(u8);

impl Id for ReplicaId {
    fn new(index: usize) -> ReplicaId {
        assert!(index < MAX_REPLICAS, "replica index {index}");
        ReplicaId(index as u8)
    }
    fn get(self) -> usize {
        usize::from(self.0)
    }
}

impl Id for ConnId {
    fn new(index: usize) -> ConnId {
        assert!(
            index < MAX_CONNECTIONS_PER_REPLICA,
            "connection index {index}"
        );
        ConnId(index as u8)
    }
    fn get(self) -> usize {
        usize::from(self.0)
    }
}

impl ReplicaId {
    pub fn new(index: usize) -> ReplicaId {
        Id::new(index)
    }
    pub fn get(self) -> usize {
        Id::get(self)
    }
}

impl ConnId {
    pub fn new(index: usize) -> ConnId {
        Id::new(index)
    }
    pub fn get(self) -> usize {
        Id::get(self)
    }
}

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Identifies one TCP connection of one replica; `epoch` changes at every
/// (re)connect so that events of an older connection are ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnRef {
    pub replica: ReplicaId,
    pub conn: ConnId,
    pub epoch: u32,
}

/// A set of replicas: bit `i` is replica `i`.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaSet(u32);

const _: () = assert!(MAX_REPLICAS <= u32::BITS as usize);

impl ReplicaSet {
    pub const EMPTY: ReplicaSet = ReplicaSet(0);

    pub fn only(r: ReplicaId) -> ReplicaSet {
        ReplicaSet(1 << r.0)
    }
    pub fn contains(self, r: ReplicaId) -> bool {
        self.0 & (1 << r.0) != 0
    }
    pub fn insert(&mut self, r: ReplicaId) {
        self.0 |= 1 << r.0;
    }
    pub fn remove(&mut self, r: ReplicaId) {
        self.0 &= !(1 << r.0);
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }
    /// Whether every replica of `other` is in this set.
    pub fn contains_all(self, other: ReplicaSet) -> bool {
        self.0 & other.0 == other.0
    }
    /// Whether the sets share a replica.
    pub fn intersects(self, other: ReplicaSet) -> bool {
        self.0 & other.0 != 0
    }
    /// The replicas of this set that are not in `other`.
    pub fn without(self, other: ReplicaSet) -> ReplicaSet {
        ReplicaSet(self.0 & !other.0)
    }
    pub fn union(self, other: ReplicaSet) -> ReplicaSet {
        ReplicaSet(self.0 | other.0)
    }
    /// The members, in increasing order.
    pub fn iter(self) -> impl Iterator<Item = ReplicaId> {
        (0..MAX_REPLICAS as u8)
            .filter(move |&i| self.0 & (1 << i) != 0)
            .map(ReplicaId)
    }
}

impl FromIterator<ReplicaId> for ReplicaSet {
    fn from_iter<I: IntoIterator<Item = ReplicaId>>(iter: I) -> ReplicaSet {
        let mut s = ReplicaSet::EMPTY;
        for r in iter {
            s.insert(r);
        }
        s
    }
}

impl fmt::Debug for ReplicaSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries(self.iter().map(ReplicaId::get))
            .finish()
    }
}

/// A vector indexed by an [`Id`] (`ReplicaData<T>`, `ConnData<T>`).
#[derive(Debug, Clone)]
pub struct IdVec<I, T> {
    items: Vec<T>,
    id: PhantomData<I>,
}

/// Data kept per replica, indexed by [`ReplicaId`].
pub type ReplicaData<T> = IdVec<ReplicaId, T>;

/// Data kept per connection of a replica, indexed by [`ConnId`].
pub type ConnData<T> = IdVec<ConnId, T>;

impl<I: Id, T> IdVec<I, T> {
    pub fn new() -> Self {
        IdVec {
            items: Vec::new(),
            id: PhantomData,
        }
    }
    /// Append `item`; its id (panics past the id's bound).
    pub fn push(&mut self, item: T) -> I {
        let id = I::new(self.items.len());
        self.items.push(item);
        id
    }
    pub fn len(&self) -> usize {
        self.items.len()
    }
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    pub fn get(&self, id: I) -> Option<&T> {
        self.items.get(id.get())
    }
    pub fn get_mut(&mut self, id: I) -> Option<&mut T> {
        self.items.get_mut(id.get())
    }
    /// Every id, in increasing order.
    pub fn ids(&self) -> impl Iterator<Item = I> + use<I, T> {
        (0..self.items.len()).map(I::new)
    }
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.items.iter()
    }
    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, T> {
        self.items.iter_mut()
    }
    /// Every item with its id, in increasing order of ids.
    pub fn iter_with_ids(&self) -> impl Iterator<Item = (I, &T)> {
        self.items.iter().enumerate().map(|(i, t)| (I::new(i), t))
    }
    /// The first id whose item satisfies `pred`.
    pub fn position(&self, pred: impl Fn(&T) -> bool) -> Option<I> {
        self.items.iter().position(pred).map(I::new)
    }
}

impl<I: Id, T> Default for IdVec<I, T> {
    fn default() -> Self {
        IdVec::new()
    }
}

impl<I: Id, T> FromIterator<T> for IdVec<I, T> {
    /// Panics past the id's bound.
    fn from_iter<It: IntoIterator<Item = T>>(iter: It) -> Self {
        let mut v = IdVec::new();
        for t in iter {
            v.push(t);
        }
        v
    }
}

impl<'a, I: Id, T> IntoIterator for &'a IdVec<I, T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

impl<'a, I: Id, T> IntoIterator for &'a mut IdVec<I, T> {
    type Item = &'a mut T;
    type IntoIter = std::slice::IterMut<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.items.iter_mut()
    }
}

impl<I: Id, T> Index<I> for IdVec<I, T> {
    type Output = T;
    fn index(&self, id: I) -> &T {
        &self.items[id.get()]
    }
}

impl<I: Id, T> IndexMut<I> for IdVec<I, T> {
    fn index_mut(&mut self, id: I) -> &mut T {
        &mut self.items[id.get()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_hold_what_was_inserted_in_order() {
        let (a, b, last) = (
            ReplicaId::new(0),
            ReplicaId::new(3),
            ReplicaId::new(MAX_REPLICAS - 1),
        );
        let mut s = ReplicaSet::EMPTY;
        assert!(s.is_empty());
        s.insert(b);
        s.insert(last);
        s.insert(a);
        s.insert(a);
        assert_eq!(s.len(), 3);
        assert_eq!(s.iter().collect::<Vec<_>>(), [a, b, last]);
        assert_eq!(format!("{s:?}"), format!("{{0, 3, {}}}", MAX_REPLICAS - 1));
        assert!(s.contains_all(ReplicaSet::only(b)));
        assert!(!ReplicaSet::only(b).contains_all(s));
        assert_eq!(
            s.without(ReplicaSet::only(b)),
            [a, last].into_iter().collect()
        );
        assert_eq!(ReplicaSet::only(a).union(ReplicaSet::only(b)).len(), 2);
        assert!(s.intersects(ReplicaSet::only(last)));
        s.remove(last);
        assert!(!s.contains(last) && !s.intersects(ReplicaSet::only(last)));
    }

    #[test]
    fn ids_index_their_vectors() {
        let mut v: ReplicaData<&str> = ReplicaData::new();
        let ids: Vec<ReplicaId> = ["x", "y", "z"].into_iter().map(|n| v.push(n)).collect();
        assert_eq!(v.ids().collect::<Vec<_>>(), ids);
        assert_eq!(v[ids[1]], "y");
        v[ids[2]] = "w";
        assert_eq!(v.position(|&n| n == "w"), Some(ids[2]));
        assert_eq!(v.get(ReplicaId::new(5)), None);
        let conns: ConnData<u32> = (0..4).collect();
        assert_eq!(conns[ConnId::new(3)], 3);
        assert_eq!(ConnId::new(3).to_string(), "3");
    }

    #[test]
    #[should_panic(expected = "replica index")]
    fn a_replica_id_past_the_bound_is_a_bug() {
        let _ = ReplicaId::new(MAX_REPLICAS);
    }
}
