//! The in-flight table of one replica connection, after Longhorn engine
//! PR #1246: a fixed array of request slots indexed by request id plus a
//! free list of ids. A reply's id finds its request directly (no map, no
//! scan); the array size bounds in-flight requests, and a full table is
//! back-pressure for the caller, never a queue.
//!
//! ```ignore
//! let mut t: SlotTable<&str> = SlotTable::new(2);
//! let a = t.insert("a").unwrap();
//! let b = t.insert("b").unwrap();
//! assert!(t.insert("c").is_none()); // full: the caller waits
//! assert_eq!(t.take(a.to_wire()), Some("a"));
//! assert_eq!(t.take(a.to_wire()), None); // a stale or duplicate reply
//! ```
//!
//! Ids carry a generation: a slot reused after its request finished gets a
//! new id, so a late or duplicated reply for the old request is recognised
//! as stale instead of completing the new one.

/// Names one in-flight request: slot index (low 32 bits of the wire id)
/// and the slot's generation (high 32 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId {
    index: u32,
    generation: u32,
}

impl SlotId {
    /// The id sent on the wire; the reply echoes it.
    pub fn to_wire(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.index)
    }

    pub fn from_wire(id: u64) -> SlotId {
        SlotId {
            index: id as u32,
            generation: (id >> 32) as u32,
        }
    }

    pub fn index(self) -> usize {
        self.index as usize
    }
}

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// A fixed-capacity table of in-flight requests.
pub struct SlotTable<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
}

impl<T> std::fmt::Debug for SlotTable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SlotTable({}/{})", self.in_flight(), self.capacity())
    }
}

impl<T> SlotTable<T> {
    /// A table of `capacity` slots (at least one).
    pub fn new(capacity: usize) -> SlotTable<T> {
        let capacity = capacity.clamp(1, u32::MAX as usize);
        SlotTable {
            slots: (0..capacity)
                .map(|_| Slot {
                    generation: 0,
                    value: None,
                })
                .collect(),
            // Reversed so that ids are handed out from 0 upwards (easier logs).
            free: (0..capacity as u32).rev().collect(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    pub fn is_full(&self) -> bool {
        self.free.is_empty()
    }

    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// Store `value` in a free slot; `None` when the table is full.
    pub fn insert(&mut self, value: T) -> Option<SlotId> {
        let index = self.free.pop()?;
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

    /// Finish every in-flight request (a connection died): each is handed
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

    /// In-flight requests, for timeout scans.
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

    /// Free list and occupancy agree: every slot is either free (listed
    /// once) or occupied, never both, and in-flight never exceeds capacity.
    pub fn check_invariants(&self) {
        let mut listed = vec![false; self.slots.len()];
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
        assert!(self.in_flight() <= self.capacity());
    }
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
        Drain,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Insert),
            3 => any::<usize>().prop_map(Op::Take),
            1 => any::<usize>().prop_map(Op::TakeStale),
            1 => any::<u64>().prop_map(Op::TakeGarbage),
            1 => Just(Op::Drain),
        ]
    }

    proptest! {
        /// Against a model: ids are unique among in-flight requests, every
        /// request comes out exactly once (take or drain), stale and garbage
        /// ids complete nothing, and the table never exceeds its capacity.
        #[test]
        fn slot_table_matches_model(cap in 1usize..16, ops in proptest::collection::vec(op(), 0..200)) {
            let mut t = SlotTable::new(cap);
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut retired: Vec<u64> = Vec::new();
            let mut next = 0u32;
            let mut out = 0usize;
            for op in ops {
                match op {
                    Op::Insert => match t.insert(next) {
                        Some(id) => {
                            prop_assert!(model.len() < cap);
                            prop_assert!(model.insert(id.to_wire(), next).is_none(), "id reused while in flight");
                            next += 1;
                        }
                        None => prop_assert_eq!(model.len(), cap),
                    },
                    Op::Take(k) => {
                        if model.is_empty() { continue; }
                        let mut ids: Vec<u64> = model.keys().copied().collect();
                        ids.sort_unstable();
                        let id = ids[k % ids.len()];
                        prop_assert_eq!(t.take(id), model.remove(&id));
                        retired.push(id);
                        out += 1;
                    }
                    Op::TakeStale(k) => {
                        if retired.is_empty() { continue; }
                        let id = retired[k % retired.len()];
                        if !model.contains_key(&id) {
                            prop_assert_eq!(t.take(id), None);
                        }
                    }
                    Op::TakeGarbage(id) => {
                        let expect = model.remove(&id);
                        prop_assert_eq!(t.take(id), expect);
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
                }
                t.check_invariants();
                prop_assert_eq!(t.in_flight(), model.len());
                prop_assert!(t.in_flight() <= cap);
            }
            let _ = out;
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
}
