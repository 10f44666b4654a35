//! Slot allocator with ready fences (one per pool group per tier).
//!
//! Order of preference when handing out a slot: (1) a recycled slot whose last user's
//! fence has completed, (2) a never-issued id, (3) a recycled slot still in flight, with
//! the fence to wait for made explicit in the [`SlotGrant`]. Multi-allocation is
//! all-or-nothing; releasing a slot that is not occupied is an error.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::fence::Fence;
use crate::ids::SlotId;

/// A slot handed out, and the fence its new owner must wait for before writing it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct SlotGrant {
    /// The slot.
    pub slot: SlotId,
    /// `Some(f)`: the previous owner's work ends at `f`; wait for it before writing.
    pub wait_for: Option<Fence>,
}

/// Misuse or exhaustion of a [`SlotAllocator`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SlotError {
    /// Not enough slots.
    #[error("out of slots: {requested} requested, {available} available")]
    OutOfSlots {
        /// Requested.
        requested: u32,
        /// Available (free, ready or not).
        available: u32,
    },
    /// Releasing a slot that is not in use (a double release).
    #[error("slot {slot} is not in use: it was released twice or never allocated")]
    NotOccupied {
        /// The slot.
        slot: SlotId,
    },
    /// A slot id past the capacity.
    #[error("slot {slot} is out of range (capacity {capacity})")]
    OutOfRange {
        /// The slot.
        slot: SlotId,
        /// The capacity.
        capacity: u32,
    },
}

/// Hands out slot ids `0..capacity`.
#[derive(Clone, Debug)]
pub struct SlotAllocator {
    capacity: u32,
    /// Ids `>= next_fresh` were never issued.
    next_fresh: u32,
    /// Recycled slots whose fence has completed (LIFO: the most recently freed slot is
    /// the most likely to be cache-warm).
    ready: Vec<SlotId>,
    /// Recycled slots still in flight, smallest fence first.
    pending: BinaryHeap<Reverse<(Fence, SlotId)>>,
    occupied: Vec<u64>,
    num_occupied: u32,
}

impl SlotAllocator {
    /// An allocator of `capacity` slots, none issued.
    pub fn new(capacity: u32) -> Self {
        SlotAllocator {
            capacity,
            next_fresh: 0,
            ready: Vec::new(),
            pending: BinaryHeap::new(),
            occupied: vec![0; capacity.div_ceil(64) as usize],
            num_occupied: 0,
        }
    }

    /// Total slots.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Slots in use.
    pub fn num_occupied(&self) -> u32 {
        self.num_occupied
    }

    /// Slots that can be handed out (ready, never issued, or in flight).
    pub fn available(&self) -> u32 {
        self.capacity - self.num_occupied
    }

    /// Whether `slot` is in use.
    pub fn is_occupied(&self, slot: SlotId) -> bool {
        slot.get() < self.capacity
            && self.occupied[slot.index() / 64] & (1 << (slot.get() % 64)) != 0
    }

    fn promote(&mut self, completed: Fence) {
        while let Some(Reverse((f, s))) = self.pending.peek().copied() {
            if f > completed {
                break;
            }
            self.pending.pop();
            self.ready.push(s);
        }
    }

    fn mark(&mut self, slot: SlotId) {
        self.occupied[slot.index() / 64] |= 1 << (slot.get() % 64);
        self.num_occupied += 1;
    }

    /// Hands out one slot. `completed` is the device completion watermark.
    pub fn allocate(&mut self, completed: Fence) -> Result<SlotGrant, SlotError> {
        self.promote(completed);
        let grant = if let Some(slot) = self.ready.pop() {
            SlotGrant {
                slot,
                wait_for: None,
            }
        } else if self.next_fresh < self.capacity {
            self.next_fresh += 1;
            SlotGrant {
                slot: SlotId(self.next_fresh - 1),
                wait_for: None,
            }
        } else if let Some(Reverse((f, slot))) = self.pending.pop() {
            SlotGrant {
                slot,
                wait_for: Some(f),
            }
        } else {
            return Err(SlotError::OutOfSlots {
                requested: 1,
                available: 0,
            });
        };
        self.mark(grant.slot);
        Ok(grant)
    }

    /// Hands out `n` slots or none.
    pub fn allocate_many(
        &mut self,
        n: u32,
        completed: Fence,
        out: &mut Vec<SlotGrant>,
    ) -> Result<(), SlotError> {
        if n > self.available() {
            return Err(SlotError::OutOfSlots {
                requested: n,
                available: self.available(),
            });
        }
        out.reserve(n as usize);
        for _ in 0..n {
            out.push(
                self.allocate(completed)
                    .expect("invariant: availability was checked"),
            );
        }
        Ok(())
    }

    /// Returns `slot`; its next owner must not write it before `last_use` completes.
    pub fn release(&mut self, slot: SlotId, last_use: Fence) -> Result<(), SlotError> {
        if slot.get() >= self.capacity {
            return Err(SlotError::OutOfRange {
                slot,
                capacity: self.capacity,
            });
        }
        if !self.is_occupied(slot) {
            return Err(SlotError::NotOccupied { slot });
        }
        self.occupied[slot.index() / 64] &= !(1 << (slot.get() % 64));
        self.num_occupied -= 1;
        if last_use == Fence::NONE {
            self.ready.push(slot);
        } else {
            self.pending.push(Reverse((last_use, slot)));
        }
        Ok(())
    }

    /// Panics with a description when the bookkeeping is inconsistent.
    pub fn check_invariants(&self) {
        let bits: u32 = self.occupied.iter().map(|w| w.count_ones()).sum();
        assert_eq!(bits, self.num_occupied, "occupied bitset vs count");
        let free =
            self.ready.len() as u32 + self.pending.len() as u32 + (self.capacity - self.next_fresh);
        assert_eq!(
            free + self.num_occupied,
            self.capacity,
            "free + used = total"
        );
        let mut seen = vec![false; self.capacity as usize];
        let recycled = self
            .ready
            .iter()
            .copied()
            .chain(self.pending.iter().map(|r| r.0 .1));
        for s in recycled {
            assert!(
                s.get() < self.next_fresh,
                "recycled slot {s} was never issued"
            );
            assert!(!self.is_occupied(s), "recycled slot {s} is occupied");
            assert!(!seen[s.index()], "slot {s} recycled twice");
            seen[s.index()] = true;
        }
        for s in self.next_fresh..self.capacity {
            assert!(
                !self.is_occupied(SlotId(s)),
                "never-issued slot {s} is occupied"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[SlotGrant]) -> Vec<u32> {
        v.iter().map(|g| g.slot.get()).collect()
    }

    #[test]
    fn fresh_ids_in_order_then_exhaustion() {
        let mut a = SlotAllocator::new(4);
        let mut out = Vec::new();
        a.allocate_many(4, Fence::NONE, &mut out).unwrap();
        assert_eq!(ids(&out), vec![0, 1, 2, 3]);
        assert!(out.iter().all(|g| g.wait_for.is_none()));
        assert_eq!(
            a.allocate(Fence::NONE),
            Err(SlotError::OutOfSlots {
                requested: 1,
                available: 0
            })
        );
        a.check_invariants();
    }

    #[test]
    fn preference_ready_then_fresh_then_pending() {
        let mut a = SlotAllocator::new(4);
        let s0 = a.allocate(Fence::NONE).unwrap().slot;
        let s1 = a.allocate(Fence::NONE).unwrap().slot;
        a.release(s0, Fence(5)).unwrap(); // in flight until fence 5
        a.release(s1, Fence::NONE).unwrap(); // ready at once
        let completed = Fence(2);
        // Ready recycled first.
        assert_eq!(
            a.allocate(completed).unwrap(),
            SlotGrant {
                slot: SlotId(1),
                wait_for: None
            }
        );
        // Then never-issued ids.
        assert_eq!(a.allocate(completed).unwrap().slot, SlotId(2));
        assert_eq!(a.allocate(completed).unwrap().slot, SlotId(3));
        // Then the in-flight slot, with its fence.
        assert_eq!(
            a.allocate(completed).unwrap(),
            SlotGrant {
                slot: SlotId(0),
                wait_for: Some(Fence(5))
            }
        );
        a.check_invariants();
    }

    #[test]
    fn in_flight_slot_not_ready_before_its_fence() {
        let mut a = SlotAllocator::new(2);
        let s = a.allocate(Fence::NONE).unwrap().slot;
        a.release(s, Fence(3)).unwrap();
        // Fence 3 not complete: the fresh id 1 is preferred.
        assert_eq!(a.allocate(Fence(2)).unwrap().slot, SlotId(1));
        a.release(SlotId(1), Fence(4)).unwrap();
        // Watermark 3: slot 0 is ready, slot 1 (fence 4) is not.
        assert_eq!(
            a.allocate(Fence(3)).unwrap(),
            SlotGrant {
                slot: SlotId(0),
                wait_for: None
            }
        );
        assert_eq!(
            a.allocate(Fence(3)).unwrap(),
            SlotGrant {
                slot: SlotId(1),
                wait_for: Some(Fence(4))
            }
        );
    }

    #[test]
    fn pending_slots_come_back_smallest_fence_first() {
        let mut a = SlotAllocator::new(3);
        let mut out = Vec::new();
        a.allocate_many(3, Fence::NONE, &mut out).unwrap();
        a.release(SlotId(0), Fence(9)).unwrap();
        a.release(SlotId(1), Fence(7)).unwrap();
        a.release(SlotId(2), Fence(8)).unwrap();
        let mut got = Vec::new();
        a.allocate_many(3, Fence::NONE, &mut got).unwrap();
        assert_eq!(
            got.iter()
                .map(|g| (g.slot.get(), g.wait_for.unwrap().0))
                .collect::<Vec<_>>(),
            vec![(1, 7), (2, 8), (0, 9)]
        );
    }

    #[test]
    fn allocate_many_is_all_or_nothing() {
        let mut a = SlotAllocator::new(3);
        let mut out = Vec::new();
        a.allocate_many(2, Fence::NONE, &mut out).unwrap();
        let before = (a.available(), a.num_occupied());
        let mut more = Vec::new();
        assert_eq!(
            a.allocate_many(2, Fence::NONE, &mut more),
            Err(SlotError::OutOfSlots {
                requested: 2,
                available: 1
            })
        );
        assert!(more.is_empty());
        assert_eq!((a.available(), a.num_occupied()), before);
        a.check_invariants();
    }

    #[test]
    fn double_release_and_range_errors() {
        let mut a = SlotAllocator::new(2);
        let s = a.allocate(Fence::NONE).unwrap().slot;
        a.release(s, Fence::NONE).unwrap();
        assert_eq!(
            a.release(s, Fence::NONE),
            Err(SlotError::NotOccupied { slot: s })
        );
        assert_eq!(
            a.release(SlotId(1), Fence::NONE),
            Err(SlotError::NotOccupied { slot: SlotId(1) })
        );
        assert_eq!(
            a.release(SlotId(2), Fence::NONE),
            Err(SlotError::OutOfRange {
                slot: SlotId(2),
                capacity: 2
            })
        );
        a.check_invariants();
    }

    #[test]
    fn large_capacity_bitset() {
        let mut a = SlotAllocator::new(130);
        let mut out = Vec::new();
        a.allocate_many(130, Fence::NONE, &mut out).unwrap();
        assert!(a.is_occupied(SlotId(129)));
        a.release(SlotId(129), Fence::NONE).unwrap();
        assert!(!a.is_occupied(SlotId(129)));
        assert_eq!(a.allocate(Fence::NONE).unwrap().slot, SlotId(129));
        a.check_invariants();
    }
}
