//! The table of requests in flight on one connection, after Longhorn
//! engine PR #1246: request slots indexed by request id plus a free list of
//! ids. A reply's (or a completion's) id finds its request directly (no
//! map, no scan); the capacity bounds requests in flight, and a full table
//! is back-pressure for the caller, never a queue.
//!
//! ```
//! use lull_net::slots::SlotTable;
//! let mut t: SlotTable<&str> = SlotTable::new(2);
//! let a = t.insert("a").unwrap();
//! let _b = t.insert("b").unwrap();
//! assert!(t.insert("c").is_none()); // full: the caller waits
//! assert_eq!(t.take(a.to_wire()), Some("a"));
//! assert_eq!(t.take(a.to_wire()), None); // a stale or duplicate reply
//! let c = t.insert("c").unwrap(); // a's slot again, with a new id
//! assert_eq!((c.index(), t.get(a.to_wire())), (a.index(), None));
//! ```
//!
//! Ids carry a generation: a slot reused after its request finished gets a
//! new id, so a late or duplicated reply for the old request is recognised
//! as stale instead of completing the new one. Where the id never leaves
//! the process (an NBD connection's device tags) the generation costs
//! nothing and still catches a double completion.
//!
//! The table grows lazily: `new(capacity)` allocates nothing, and slots are
//! added one at a time when no freed slot is left, up to the capacity. An
//! idle connection holds no slots and a queue-depth-1 connection one, not
//! the 128 its bound allows (memory per idle connection is what limits how
//! many a server holds). Ids are handed out exactly as from a table filled
//! up front: the lowest never-used index when no slot is free, otherwise
//! the most recently freed slot.

use std::cell::RefCell;

/// Names one request in flight: slot index (low 32 bits of the wire id)
/// and the slot's generation (high 32 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId {
    index: u32,
    generation: u32,
}

impl SlotId {
    /// The id sent on the wire (or used as a device tag); the reply echoes
    /// it.
    pub fn to_wire(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.index)
    }

    /// Any u64 is a well-formed id; whether it names a request in flight
    /// is for the table to say.
    pub fn from_wire(id: u64) -> SlotId {
        SlotId {
            index: id as u32,
            generation: (id >> 32) as u32,
        }
    }

    /// The slot's position in the table: dense, below the capacity.
    pub fn index(self) -> usize {
        self.index as usize
    }
}

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// A bounded, lazily grown table of requests in flight.
pub struct SlotTable<T> {
    /// Slots ever used; never longer than `capacity`.
    slots: Vec<Slot<T>>,
    /// Indices of the slots in `slots` that hold no request, the most
    /// recently freed last.
    free: Vec<u32>,
    capacity: usize,
}

impl<T> std::fmt::Debug for SlotTable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotTable({}/{})", self.in_flight(), self.capacity())
    }
}

impl<T> SlotTable<T> {
    /// A table of at most `capacity` slots (at least one; at most
    /// `u32::MAX`, since an index is 32 bits on the wire). Allocates
    /// nothing until the first insert.
    pub fn new(capacity: usize) -> SlotTable<T> {
        SlotTable {
            slots: Vec::new(),
            free: Vec::new(),
            capacity: capacity.clamp(1, u32::MAX as usize),
        }
    }

    /// The bound on requests in flight.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn is_empty(&self) -> bool {
        self.in_flight() == 0
    }

    pub fn is_full(&self) -> bool {
        self.free.is_empty() && self.slots.len() >= self.capacity
    }

    /// Requests that can still be inserted.
    pub fn free_slots(&self) -> usize {
        self.capacity - self.in_flight()
    }

    /// Slots allocated so far (for memory accounting and tests).
    pub fn allocated(&self) -> usize {
        self.slots.len()
    }

    /// Store `value` in a free slot; `None` when the table is full.
    pub fn insert(&mut self, value: T) -> Option<SlotId> {
        let index = match self.free.pop() {
            Some(index) => index,
            None if self.slots.len() < self.capacity => {
                self.slots.push(Slot {
                    generation: 0,
                    value: None,
                });
                // Fits: capacity is at most u32::MAX.
                (self.slots.len() - 1) as u32
            }
            None => return None,
        };
        let slot = &mut self.slots[index as usize];
        debug_assert!(slot.value.is_none());
        slot.value = Some(value);
        Some(SlotId {
            index,
            generation: slot.generation,
        })
    }

    /// The request a wire id names, if it is in flight.
    pub fn get(&self, wire_id: u64) -> Option<&T> {
        let id = SlotId::from_wire(wire_id);
        let slot = self.slots.get(id.index as usize)?;
        if slot.generation != id.generation {
            return None;
        }
        slot.value.as_ref()
    }

    pub fn get_mut(&mut self, wire_id: u64) -> Option<&mut T> {
        let id = SlotId::from_wire(wire_id);
        let slot = self.slots.get_mut(id.index as usize)?;
        if slot.generation != id.generation {
            return None;
        }
        slot.value.as_mut()
    }

    /// Finish the request a wire id names and free its slot. Unknown,
    /// stale and duplicate ids (untrusted input) give `None`.
    pub fn take(&mut self, wire_id: u64) -> Option<T> {
        let id = SlotId::from_wire(wire_id);
        let slot = self.slots.get_mut(id.index as usize)?;
        if slot.generation != id.generation {
            return None;
        }
        let value = slot.value.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free.push(id.index);
        Some(value)
    }

    /// Finish every request in flight (a connection died): each is handed
    /// to `f` exactly once and every slot is free afterwards.
    pub fn drain(&mut self, mut f: impl FnMut(SlotId, T)) {
        for (index, slot) in self.slots.iter_mut().enumerate() {
            if let Some(value) = slot.value.take() {
                let id = SlotId {
                    index: index as u32,
                    generation: slot.generation,
                };
                slot.generation = slot.generation.wrapping_add(1);
                self.free.push(index as u32);
                f(id, value);
            }
        }
    }

    /// Keep only the requests `keep` says yes to; the others leave the
    /// table (their slots are freed, their ids go stale) and are dropped.
    /// For entries that end by a condition found in a periodic scan rather
    /// than by an id arriving.
    pub fn retain(&mut self, mut keep: impl FnMut(SlotId, &mut T) -> bool) {
        for (index, slot) in self.slots.iter_mut().enumerate() {
            let id = SlotId {
                index: index as u32,
                generation: slot.generation,
            };
            if slot.value.as_mut().is_some_and(|v| !keep(id, v)) {
                slot.value = None;
                slot.generation = slot.generation.wrapping_add(1);
                self.free.push(index as u32);
            }
        }
    }

    /// Requests in flight, in slot order (for timeout scans and checks).
    pub fn iter(&self) -> impl Iterator<Item = (SlotId, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            s.value.as_ref().map(|v| {
                (
                    SlotId {
                        index: i as u32,
                        generation: s.generation,
                    },
                    v,
                )
            })
        })
    }

    /// Free list and occupancy agree: every allocated slot is either free
    /// (listed once) or occupied, never both, and the table never grew
    /// past its capacity.
    pub fn check_invariants(&self) {
        assert!(
            self.slots.len() <= self.capacity,
            "{} slots allocated, capacity {}",
            self.slots.len(),
            self.capacity
        );
        CHECK_MARKS.with_borrow_mut(|listed| {
            listed.clear();
            listed.resize(self.slots.len(), false);
            for &i in &self.free {
                let i = i as usize;
                assert!(i < self.slots.len(), "free id {i} out of range");
                assert!(!listed[i], "free id {i} listed twice");
                listed[i] = true;
                assert!(self.slots[i].value.is_none(), "free id {i} holds a request");
            }
            for (i, s) in self.slots.iter().enumerate() {
                assert!(
                    listed[i] || s.value.is_some(),
                    "slot {i} leaked: neither free nor in flight"
                );
            }
        });
        assert_eq!(self.in_flight(), self.iter().count());
    }
}

thread_local! {
    /// `check_invariants`' marks, kept between calls: debug builds run the
    /// check on every event, and a fresh vector each time would be a heap
    /// allocation per request that release builds do not make (the
    /// allocation tests run with debug assertions on).
    static CHECK_MARKS: RefCell<Vec<bool>> = const { RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Debug, Clone)]
    enum Op {
        Insert,
        Take(usize),
        TakeStale(usize),
        TakeGarbage(u64),
        Get(usize),
        GetStale(usize),
        Drain,
        /// Keep the values divisible by this.
        Retain(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Insert),
            3 => any::<usize>().prop_map(Op::Take),
            1 => any::<usize>().prop_map(Op::TakeStale),
            1 => any::<u64>().prop_map(Op::TakeGarbage),
            1 => any::<usize>().prop_map(Op::Get),
            1 => any::<usize>().prop_map(Op::GetStale),
            1 => Just(Op::Drain),
            1 => (1u32..4).prop_map(Op::Retain),
        ]
    }

    /// An id in flight in the model, picked by `k` (sorted, so a case
    /// replays the same picks).
    fn pick(model: &HashMap<u64, u32>, k: usize) -> Option<u64> {
        let mut ids: Vec<u64> = model.keys().copied().collect();
        ids.sort_unstable();
        (!ids.is_empty()).then(|| ids[k % ids.len()])
    }

    proptest! {
        /// Against a model (a map from wire id to value): ids are unique
        /// among requests in flight, every request comes out exactly once
        /// (take or drain), stale and garbage ids find and complete
        /// nothing, the table never exceeds its capacity, and it allocates
        /// no more slots than the most ever in flight at once.
        #[test]
        fn slot_table_matches_model(cap in 1usize..40, ops in proptest::collection::vec(op(), 0..300)) {
            let mut t = SlotTable::new(cap);
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut retired: Vec<u64> = Vec::new();
            let mut next = 0u32;
            let mut peak = 0usize;
            for op in ops {
                match op {
                    Op::Insert => match t.insert(next) {
                        Some(id) => {
                            prop_assert!(model.len() < cap);
                            prop_assert!(id.index() < cap);
                            prop_assert!(model.insert(id.to_wire(), next).is_none(), "id reused while in flight");
                            next += 1;
                        }
                        None => {
                            prop_assert_eq!(model.len(), cap);
                            prop_assert!(t.is_full());
                        }
                    },
                    Op::Take(k) => {
                        let Some(id) = pick(&model, k) else { continue };
                        prop_assert_eq!(t.take(id), model.remove(&id));
                        retired.push(id);
                    }
                    Op::TakeStale(k) => {
                        if retired.is_empty() { continue; }
                        let id = retired[k % retired.len()];
                        // A retired id is never handed out again while its
                        // generation has not wrapped (it cannot, here).
                        prop_assert!(!model.contains_key(&id));
                        prop_assert_eq!(t.take(id), None);
                    }
                    Op::TakeGarbage(id) => {
                        let expect = model.remove(&id);
                        prop_assert_eq!(t.take(id), expect);
                        if expect.is_some() { retired.push(id); }
                    }
                    Op::Get(k) => {
                        let Some(id) = pick(&model, k) else { continue };
                        prop_assert_eq!(t.get(id), model.get(&id));
                        prop_assert_eq!(t.get_mut(id).map(|v| *v), model.get(&id).copied());
                    }
                    Op::GetStale(k) => {
                        if retired.is_empty() { continue; }
                        let id = retired[k % retired.len()];
                        prop_assert_eq!(t.get(id), None);
                        prop_assert!(t.get_mut(id).is_none());
                    }
                    Op::Drain => {
                        let mut seen = Vec::new();
                        t.drain(|id, v| seen.push((id.to_wire(), v)));
                        prop_assert_eq!(seen.len(), model.len());
                        for (id, v) in seen {
                            prop_assert_eq!(model.remove(&id), Some(v));
                            retired.push(id);
                        }
                    }
                    Op::Retain(m) => {
                        t.retain(|id, v| {
                            assert_eq!(model.get(&id.to_wire()), Some(&*v));
                            *v % m == 0
                        });
                        let dropped: Vec<u64> = model.iter().filter(|(_, v)| *v % m != 0).map(|(id, _)| *id).collect();
                        for id in dropped {
                            model.remove(&id);
                            retired.push(id);
                        }
                    }
                }
                peak = peak.max(model.len());
                t.check_invariants();
                prop_assert_eq!(t.in_flight(), model.len());
                prop_assert_eq!(t.free_slots(), cap - model.len());
                prop_assert_eq!(t.is_empty(), model.is_empty());
                prop_assert!(t.in_flight() <= cap);
                prop_assert_eq!(t.allocated(), peak, "grew past the deepest queue");
                let listed: HashMap<u64, u32> = t.iter().map(|(id, v)| (id.to_wire(), *v)).collect();
                prop_assert_eq!(&listed, &model);
            }
        }
    }

    #[test]
    fn full_table_is_back_pressure() {
        let mut t = SlotTable::new(2);
        let a = t.insert(1).unwrap();
        t.insert(2).unwrap();
        assert!(t.insert(3).is_none());
        assert_eq!(t.take(a.to_wire()), Some(1));
        let c = t.insert(3).unwrap();
        assert_eq!(c.index(), a.index());
        assert_ne!(c.to_wire(), a.to_wire(), "a reused slot gets a new id");
        assert_eq!(t.take(a.to_wire()), None);
        t.check_invariants();
    }

    #[test]
    fn grows_only_as_deep_as_the_queue() {
        let mut t: SlotTable<u64> = SlotTable::new(128);
        assert_eq!(t.allocated(), 0, "an idle table holds no slots");
        for i in 0..1000 {
            let id = t.insert(i).unwrap();
            assert_eq!(id.index(), 0);
            assert_eq!(t.take(id.to_wire()), Some(i));
        }
        assert_eq!(t.allocated(), 1, "queue depth 1 uses one slot");
        assert!(t.free_slots() == 128 && !t.is_full());
    }

    #[test]
    fn ids_come_in_the_order_of_a_prefilled_table() {
        // Lowest unused index first, then the most recently freed: the
        // engine's deterministic simulation relies on this order.
        let mut t = SlotTable::new(8);
        let ids: Vec<SlotId> = (0..4).map(|i| t.insert(i).unwrap()).collect();
        assert_eq!(
            ids.iter().map(|id| id.index()).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        t.take(ids[1].to_wire());
        t.take(ids[3].to_wire());
        assert_eq!(t.insert(9).unwrap().index(), 3);
        assert_eq!(t.insert(9).unwrap().index(), 1);
        assert_eq!(t.insert(9).unwrap().index(), 4);
    }
}
