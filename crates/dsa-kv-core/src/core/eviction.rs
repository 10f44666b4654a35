//! Eviction queues, one per (tier, pool group): lowest priority first, then least
//! recently used. A page is in the queue of its tier and group exactly when it is
//! evictable: droppable and committed, or held and not on the last tier.

use std::collections::BTreeSet;

use crate::ids::{PageId, PoolGroupId, Tier};

/// Lowest eviction priority.
pub const MIN_PRIORITY: u8 = 0;
/// Highest eviction priority (evicted last).
pub const MAX_PRIORITY: u8 = 100;
/// Default priority of committed pages.
pub const DEFAULT_PRIORITY: u8 = 35;

#[derive(Debug)]
pub(crate) struct EvictionQueues {
    num_groups: usize,
    queues: Vec<BTreeSet<(u8, u64, PageId)>>,
    clock: u64,
}

impl EvictionQueues {
    pub(super) fn new(num_groups: usize) -> Self {
        EvictionQueues {
            num_groups,
            queues: vec![BTreeSet::new(); num_groups * Tier::ALL.len()],
            clock: 0,
        }
    }

    fn q(&self, tier: Tier, group: PoolGroupId) -> usize {
        tier.index() * self.num_groups + group.index()
    }

    /// Inserts with a fresh LRU stamp; returns the stamp.
    pub(super) fn push(
        &mut self,
        tier: Tier,
        group: PoolGroupId,
        priority: u8,
        page: PageId,
    ) -> u64 {
        self.clock += 1;
        self.restore(tier, group, priority, self.clock, page);
        self.clock
    }

    /// Inserts with a given stamp (rollback of an exclusion).
    pub(super) fn restore(
        &mut self,
        tier: Tier,
        group: PoolGroupId,
        priority: u8,
        stamp: u64,
        page: PageId,
    ) {
        let q = self.q(tier, group);
        let fresh = self.queues[q].insert((priority, stamp, page));
        debug_assert!(fresh, "page {page} queued twice");
    }

    pub(super) fn remove(
        &mut self,
        tier: Tier,
        group: PoolGroupId,
        priority: u8,
        stamp: u64,
        page: PageId,
    ) {
        let q = self.q(tier, group);
        let found = self.queues[q].remove(&(priority, stamp, page));
        debug_assert!(found, "page {page} missing from its queue");
    }

    pub(super) fn len(&self, tier: Tier, group: PoolGroupId) -> usize {
        self.queues[self.q(tier, group)].len()
    }

    /// The next `n` victims in eviction order, without removing them.
    pub(super) fn peek(
        &self,
        tier: Tier,
        group: PoolGroupId,
        n: usize,
    ) -> impl Iterator<Item = PageId> + '_ {
        self.queues[self.q(tier, group)].iter().take(n).map(|e| e.2)
    }

    pub(super) fn contains(
        &self,
        tier: Tier,
        group: PoolGroupId,
        priority: u8,
        stamp: u64,
        page: PageId,
    ) -> bool {
        self.queues[self.q(tier, group)].contains(&(priority, stamp, page))
    }

    pub(super) fn total(&self) -> usize {
        self.queues.iter().map(BTreeSet::len).sum()
    }
}
