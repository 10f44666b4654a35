//! `check_invariants`: every cross-structure rule of the manager, checked in O(state).
//! Runs after every mutation in debug builds (small states) and after every operation of
//! the randomized model test.

use std::collections::HashMap;

use super::error::SeqStatus;
use super::manager::KvCacheManager;
use super::pages::PageStatus;
use super::router_events::RouterBlock;
use crate::ids::{PageId, SlotId, Tier};

impl KvCacheManager {
    /// Panics with a description of the first broken invariant:
    /// free + used = total per allocator and tier; every live page owns exactly its slot;
    /// lock and hold counts equal the references of active and suspended sequences, pins
    /// those of export leases;
    /// locked pages are on the GPU; queue membership equals evictability; tree blocks and
    /// their pages point at each other; committed ≤ history ≤ capacity and
    /// blocks = ceil(capacity / T) for every sequence; uncommitted pages are private.
    pub fn check_invariants(&self) {
        for tier in &self.allocators {
            for a in tier {
                a.check_invariants();
            }
        }
        let mut owners: HashMap<(Tier, u16, SlotId), PageId> = HashMap::new();
        let mut per_alloc: HashMap<(Tier, u16), u32> = HashMap::new();
        let mut queued = 0usize;
        for (pid, p) in self.pages.iter_live() {
            let a = &self.allocators[p.tier.index()][p.group.index()];
            assert!(
                a.is_occupied(p.slot),
                "page {pid} slot {} not occupied on {}",
                p.slot,
                p.tier
            );
            if let Some(other) = owners.insert((p.tier, p.group.get(), p.slot), pid) {
                panic!(
                    "pages {other} and {pid} share slot {} on {}",
                    p.slot, p.tier
                );
            }
            *per_alloc.entry((p.tier, p.group.get())).or_default() += 1;
            if p.status() == PageStatus::Locked {
                assert_eq!(p.tier, Tier::Gpu, "locked page {pid} off the GPU");
            }
            assert_eq!(
                p.queued.is_some(),
                self.is_evictable(p),
                "page {pid} queue membership ({:?}) vs evictable (status {:?}, tier {}, linked {})",
                p.queued,
                p.status(),
                p.tier,
                p.node.is_some()
            );
            if let Some((prio, stamp)) = p.queued {
                queued += 1;
                assert_eq!(prio, p.priority, "page {pid} queued under a stale priority");
                assert!(
                    self.queues.contains(p.tier, p.group, prio, stamp, pid),
                    "page {pid} not in its queue"
                );
            }
            assert!(
                !(p.status() == PageStatus::Droppable && p.node.is_none()),
                "page {pid} is unreferenced and uncached: it leaked"
            );
            if let Some(node) = p.node {
                let n = self
                    .tree
                    .get(node)
                    .unwrap_or_else(|| panic!("page {pid} links a dead block"));
                assert_eq!(
                    n.pages[p.life_cycle.index()],
                    pid,
                    "block does not point back at page {pid}"
                );
                assert!(p.committed, "linked page {pid} not committed");
            }
            if !p.committed {
                assert_eq!(
                    p.locks + p.holders,
                    1,
                    "uncommitted page {pid} is not private"
                );
            }
            assert_eq!(
                self.lc_group[p.life_cycle.index()],
                p.group,
                "page {pid} group"
            );
        }
        assert_eq!(queued, self.queues.total(), "queue sizes vs queued pages");
        for (t, tier) in self.allocators.iter().enumerate() {
            for (g, a) in tier.iter().enumerate() {
                let live = per_alloc
                    .get(&(Tier::ALL[t], g as u16))
                    .copied()
                    .unwrap_or(0);
                assert_eq!(
                    a.num_occupied(),
                    live,
                    "tier {t} group {g}: occupied slots vs live pages"
                );
            }
        }
        self.tree.check_invariants(self.tpb as usize);
        for (r, n) in self.tree.blocks() {
            assert_eq!(
                n.pages.len(),
                self.n_lc,
                "block {} pages per life cycle",
                n.key
            );
            for &pid in &n.pages {
                assert!(
                    self.pages[pid].live,
                    "block {} holds dead page {pid}",
                    n.key
                );
                assert_eq!(
                    self.pages[pid].node,
                    Some(r),
                    "page {pid} does not point at its block"
                );
            }
        }
        let mut refs: HashMap<PageId, (u32, u32, u32)> = HashMap::new();
        let mut live_seqs = 0;
        for (i, s) in self.seqs.iter().enumerate() {
            let Some(s) = s else { continue };
            live_seqs += 1;
            assert_eq!(
                self.by_id.get(&s.id),
                Some(&(i as u32)),
                "sequence {} index",
                s.id
            );
            assert!(
                s.committed() <= s.history && s.history <= s.capacity,
                "sequence {}: committed {} ≤ history {} ≤ capacity {}",
                s.id,
                s.committed(),
                s.history,
                s.capacity
            );
            assert_eq!(
                s.pages.len() as u64,
                s.capacity.div_ceil(self.tpb) * self.n_lc as u64,
                "sequence {}: blocks = ceil(capacity / T)",
                s.id
            );
            assert!(
                s.nodes.len() as u64 <= s.committed() / self.tpb + 1,
                "sequence {} node chain",
                s.id
            );
            if s.pinned {
                assert!(
                    s.status == SeqStatus::Suspended && s.pending_copy.is_none(),
                    "export lease {} is active or waits for a copy",
                    s.id
                );
            }
            if s.status == SeqStatus::Active {
                assert!(
                    s.pending_copy.is_none(),
                    "active sequence {} has a pending copy",
                    s.id
                );
            }
            for (j, &pid) in s.pages.iter().enumerate() {
                let p = &self.pages[pid];
                assert!(p.live, "sequence {} refers to dead page {pid}", s.id);
                assert_eq!(
                    p.life_cycle.index(),
                    j % self.n_lc,
                    "sequence {} page order",
                    s.id
                );
                let e = refs.entry(pid).or_default();
                match s.status {
                    SeqStatus::Active => {
                        e.0 += 1;
                        assert_eq!(
                            p.tier,
                            Tier::Gpu,
                            "active sequence {} page {pid} off the GPU",
                            s.id
                        );
                    }
                    SeqStatus::Suspended => e.1 += 1,
                }
                e.2 += u32::from(s.pinned);
            }
        }
        assert_eq!(live_seqs, self.by_id.len(), "sequence count");
        for (pid, p) in self.pages.iter_live() {
            let (locks, holders, pins) = refs.get(&pid).copied().unwrap_or((0, 0, 0));
            assert_eq!(
                (p.locks, p.holders, p.pins),
                (locks, holders, pins),
                "page {pid} reference counts (locks, holds, pins)"
            );
        }
        if self.record_router_events {
            // The media announced to routers are the media the pages give now.
            let mut announced: Vec<RouterBlock> = self
                .tree
                .blocks()
                .filter_map(|(_, n)| {
                    n.router_medium.map(|medium| RouterBlock {
                        hash: n.key.hash64(),
                        medium,
                    })
                })
                .collect();
            announced.sort_unstable();
            assert_eq!(
                announced,
                self.router_blocks(),
                "router media announced vs media of the pages"
            );
        }
    }
}
