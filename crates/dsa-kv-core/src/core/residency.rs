//! Where pages live and how they move: eviction-queue membership, freeing, dropping from
//! the last tier (which removes the block and its subtree from the reuse tree),
//! cascading eviction GPU → host → drop with an exact feasibility check made *before*
//! anything moves, and the copy plans that carry the bytes.

use super::events::KvEvent;
use super::manager::KvCacheManager;
use super::pages::{Page, PageStatus};
use super::radix::Removed;
use super::router_events::RouterEvent;
use super::slot_allocator::SlotGrant;
use crate::ids::{Fence, LifeCycleId, PageId, PoolGroupId, SlotId, Tier};
use crate::ops::{CopyPlan, GroupCopy};

impl KvCacheManager {
    /// The coldest tier pages can fall to.
    pub(super) fn last_tier(&self) -> Tier {
        if self.has_host_tier() {
            Tier::Host
        } else {
            Tier::Gpu
        }
    }

    /// Evictable: droppable and linked into the tree, or held (not pinned) and not on the
    /// last tier.
    pub(super) fn is_evictable(&self, p: &Page) -> bool {
        match p.status() {
            PageStatus::Locked => false,
            PageStatus::Held => p.pins == 0 && p.tier != self.last_tier(),
            PageStatus::Droppable => p.node.is_some(),
        }
    }

    /// Takes a page out of its eviction queue; returns its stamp for an exact restore.
    pub(super) fn dequeue(&mut self, pid: PageId) -> Option<(u8, u64)> {
        let p = &mut self.pages[pid];
        let (prio, stamp) = p.queued.take()?;
        let (tier, group) = (p.tier, p.group);
        self.queues.remove(tier, group, prio, stamp, pid);
        Some((prio, stamp))
    }

    /// Puts a page back with the key [`dequeue`](Self::dequeue) returned.
    pub(super) fn requeue(&mut self, pid: PageId, key: (u8, u64)) {
        let p = &mut self.pages[pid];
        debug_assert!(p.queued.is_none());
        p.queued = Some(key);
        let (tier, group) = (p.tier, p.group);
        self.queues.restore(tier, group, key.0, key.1, pid);
    }

    /// Re-derives queue membership after the page's references changed (a use: the
    /// page goes to the most-recently-used end).
    pub(super) fn refresh_queue(&mut self, pid: PageId) {
        self.dequeue(pid);
        if self.is_evictable(&self.pages[pid]) {
            let p = &self.pages[pid];
            let (tier, group, prio) = (p.tier, p.group, p.priority);
            let stamp = self.queues.push(tier, group, prio, pid);
            self.pages[pid].queued = Some((prio, stamp));
        }
    }

    /// After a reference went away: free a page nobody needs, else re-queue it.
    pub(super) fn settle(&mut self, pid: PageId) {
        let p = &self.pages[pid];
        if p.status() == PageStatus::Droppable && p.node.is_none() {
            self.free_page(pid);
        } else {
            self.refresh_queue(pid);
        }
    }

    /// Drops one reference (a lock if `locked`, else a hold) and settles the page.
    pub(super) fn unref(&mut self, pid: PageId, locked: bool) {
        let p = &mut self.pages[pid];
        if locked {
            debug_assert!(p.locks > 0);
            p.locks -= 1;
        } else {
            debug_assert!(p.holders > 0);
            p.holders -= 1;
        }
        self.settle(pid);
    }

    /// Adds a reference (a lock if `locked`, else a hold).
    pub(super) fn add_ref(&mut self, pid: PageId, locked: bool) {
        let p = &mut self.pages[pid];
        if locked {
            debug_assert_eq!(p.tier, Tier::Gpu, "only GPU pages can be locked");
            p.locks += 1;
        } else {
            p.holders += 1;
        }
        self.refresh_queue(pid);
    }

    /// Releases a page's slot (the next owner waits for all work issued so far) and
    /// its record.
    pub(super) fn free_page(&mut self, pid: PageId) {
        self.dequeue(pid);
        let p = &self.pages[pid];
        let fence = self.clock.issued().max(p.ready);
        self.allocators[p.tier.index()][p.group.index()]
            .release(p.slot, fence)
            .expect("invariant: a live page owns its slot");
        self.pages.release(pid);
    }

    /// Unlinks pages of removed tree blocks (a subtree in pre-order); frees those nobody
    /// refers to. Routers hear of the removals children first: a tree router that drops
    /// a block's descendants with it (Dynamo's does) then never meets a removal of a
    /// block it already dropped.
    pub(super) fn handle_removed(&mut self, removed: Vec<Removed>) {
        if self.record_router_events {
            for r in removed.iter().rev() {
                if let Some(medium) = r.router_medium {
                    self.router_events.push(RouterEvent::BlockRemoved {
                        block_hashes: vec![r.key.hash64()],
                        medium,
                    });
                }
            }
        }
        for r in removed {
            if self.opts.record_events {
                self.events.push(KvEvent::Removed { key: r.key });
            }
            for pid in r.pages {
                self.pages[pid].node = None;
                self.settle(pid);
            }
        }
    }

    /// Drops a droppable committed page from the last tier: its block and every
    /// descendant leave the reuse tree (a missing block makes its descendants
    /// unreachable).
    fn drop_page(&mut self, pid: PageId) {
        let node = self.pages[pid]
            .node
            .expect("invariant: only pages linked into the tree are dropped");
        debug_assert_eq!(self.pages[pid].status(), PageStatus::Droppable);
        let mut removed = Vec::new();
        self.tree.remove_subtree(node, &mut removed);
        self.stats.dropped_pages += 1;
        self.handle_removed(removed);
        debug_assert!(!self.pages[pid].live, "the dropped page is freed");
    }

    /// Allocates one slot on `tier` for `group` (the caller made room).
    pub(super) fn grant(&mut self, tier: Tier, group: PoolGroupId) -> SlotGrant {
        let completed = self.clock.completed();
        self.allocators[tier.index()][group.index()]
            .allocate(completed)
            .expect("invariant: room was made before allocating")
    }

    /// Appends a copy to the current operation's plan (issuing its fence on first use);
    /// returns the plan's fence.
    pub(super) fn plan_copy(
        &mut self,
        group: PoolGroupId,
        src: (Tier, SlotId),
        dst: (Tier, SlotId),
        dst_wait: Option<Fence>,
    ) -> Fence {
        if self.current_plan.is_none() {
            let fence = self.clock.issue();
            self.current_plan = Some(CopyPlan {
                fence,
                wait_for: Fence::NONE,
                copies: Vec::new(),
            });
        }
        let plan = self.current_plan.as_mut().expect("invariant: just created");
        if let Some(w) = dst_wait.filter(|&w| w < plan.fence) {
            plan.wait_for = plan.wait_for.max(w);
        }
        match plan.copies.last_mut() {
            Some(c) if c.pool_group == group && c.src_tier == src.0 && c.dst_tier == dst.0 => {
                c.pairs.push((src.1, dst.1));
            }
            _ => plan.copies.push(GroupCopy {
                pool_group: group,
                src_tier: src.0,
                dst_tier: dst.0,
                pairs: vec![(src.1, dst.1)],
            }),
        }
        plan.fence
    }

    /// Ends the current operation: its copy plan (if any) joins the queue for storage.
    pub(super) fn finish_plan(&mut self) {
        if let Some(p) = self.current_plan.take() {
            self.copy_plans.push(p);
        }
    }

    /// Moves a page to `to` (slot allocated there; the caller made room). The page keeps
    /// its identity; the old slot is released behind the copy.
    pub(super) fn migrate(&mut self, pid: PageId, to: Tier) {
        let (from, group, old_slot, lc) = {
            let p = &self.pages[pid];
            (p.tier, p.group, p.slot, p.life_cycle)
        };
        debug_assert_ne!(from, to);
        self.dequeue(pid);
        let g = self.grant(to, group);
        let fence = self.plan_copy(group, (from, old_slot), (to, g.slot), g.wait_for);
        self.allocators[from.index()][group.index()]
            .release(old_slot, fence)
            .expect("invariant: a live page owns its slot");
        let bytes = self.group_slot_bytes[group.index()];
        if to == Tier::Host {
            self.stats.offloaded_pages += 1;
            self.stats.offloaded_bytes += bytes;
        } else {
            self.stats.onboarded_pages += 1;
            self.stats.onboarded_bytes += bytes;
        }
        let p = &mut self.pages[pid];
        p.tier = to;
        p.slot = g.slot;
        p.ready = fence;
        if let (Some(node), true) = (p.node, self.opts.record_events) {
            let key = self.tree.node(node).key;
            self.events.push(KvEvent::TierUpdated {
                key,
                life_cycle: lc,
                from,
                to,
            });
        }
        if let (Some(node), true) = (self.pages[pid].node, self.record_router_events) {
            self.router_refresh(node);
        }
        self.refresh_queue(pid);
    }

    /// Whether `needs[g]` free GPU slots per group can be made by evicting, and if so
    /// makes them (offloading to the host tier, dropping from the last tier). Checks
    /// everything before moving anything: on `false` no structure has changed.
    pub(super) fn make_room_on_gpu(&mut self, needs: &[u32]) -> bool {
        // An injected storage refusal comes first, before anything is looked at or moved.
        if self.faults.as_mut().is_some_and(|f| f.fire()) {
            return false;
        }
        for (g, &need) in needs.iter().enumerate() {
            if !self.room_feasible(PoolGroupId(g as u16), need) {
                return false;
            }
        }
        for (g, &need) in needs.iter().enumerate() {
            self.evict_gpu(PoolGroupId(g as u16), need);
        }
        true
    }

    /// `(victims needed, held victims among them)` for `need` GPU slots of `group`, or
    /// `None` when not enough pages are evictable.
    fn gpu_victims(&self, group: PoolGroupId, need: u32) -> Option<(usize, usize)> {
        let free = self.allocators[0][group.index()].available();
        let k = need.saturating_sub(free) as usize;
        if k > self.queues.len(Tier::Gpu, group) {
            return None;
        }
        let held = self
            .queues
            .peek(Tier::Gpu, group, k)
            .filter(|&p| self.pages[p].status() == PageStatus::Held)
            .count();
        Some((k, held))
    }

    fn host_room(&self, group: PoolGroupId) -> usize {
        self.allocators[1][group.index()].available() as usize + self.queues.len(Tier::Host, group)
    }

    fn room_feasible(&self, group: PoolGroupId, need: u32) -> bool {
        match self.gpu_victims(group, need) {
            None => false,
            Some((_, held)) => held == 0 || (self.has_host_tier() && held <= self.host_room(group)),
        }
    }

    fn evict_gpu(&mut self, group: PoolGroupId, need: u32) {
        let (k, held) = self
            .gpu_victims(group, need)
            .expect("invariant: feasibility was checked");
        if k == 0 {
            return;
        }
        let victims: Vec<PageId> = self.queues.peek(Tier::Gpu, group, k).collect();
        for &v in &victims {
            self.dequeue(v);
        }
        if !self.has_host_tier() {
            for v in victims {
                if self.pages[v].live {
                    self.drop_page(v);
                }
            }
            return;
        }
        // Held victims must move; droppable ones move while the host has room (its own
        // droppable pages count as room), the coldest of them are dropped otherwise.
        let room = self.host_room(group);
        assert!(held <= room, "invariant: feasibility was checked");
        let droppable: Vec<PageId> = victims
            .iter()
            .copied()
            .filter(|&p| self.pages[p].status() == PageStatus::Droppable)
            .collect();
        let n_drop = droppable.len() - droppable.len().min(room - held);
        for &v in &droppable[..n_drop] {
            if self.pages[v].live {
                self.drop_page(v);
            }
        }
        let to_move: Vec<PageId> = victims
            .into_iter()
            .filter(|&p| self.pages[p].live && self.pages[p].tier == Tier::Gpu)
            .collect();
        let moving = to_move.len() as u32;
        while self.allocators[1][group.index()].available() < moving {
            let v = self
                .queues
                .peek(Tier::Host, group, 1)
                .next()
                .expect("invariant: host room was counted");
            self.dequeue(v);
            self.drop_page(v);
        }
        for v in to_move {
            if self.pages[v].live {
                self.migrate(v, Tier::Host);
            }
        }
    }

    /// Allocates `n` new GPU pages of life cycle `lc` (room was made), locked once.
    pub(super) fn new_locked_pages(
        &mut self,
        lc: LifeCycleId,
        n: usize,
        out: &mut Vec<(PageId, Option<Fence>)>,
    ) {
        let group = self.lc_group[lc.index()];
        for _ in 0..n {
            let g = self.grant(Tier::Gpu, group);
            let pid = self.pages.alloc(Page {
                live: true,
                life_cycle: lc,
                group,
                tier: Tier::Gpu,
                slot: g.slot,
                locks: 1,
                holders: 0,
                pins: 0,
                node: None,
                committed: false,
                priority: 0,
                queued: None,
                ready: g.wait_for.unwrap_or(Fence::NONE),
            });
            out.push((pid, g.wait_for));
        }
    }
}
