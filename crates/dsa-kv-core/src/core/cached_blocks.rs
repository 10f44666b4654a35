//! A read-only view of the reuse tree's pages and their tiers: the state that
//! [`KvEvent`](super::KvEvent)s describe, so a consumer of the events (a router, a test)
//! can check its mirror against the truth.

use std::collections::HashMap;

use serde::Serialize;

use super::manager::KvCacheManager;
use super::radix::NodeRef;
use super::reuse_key::BlockKey;
use super::router_events::{Medium, RouterBlock};
use crate::ids::{LifeCycleId, Tier};

/// One life cycle's page of a block in the reuse tree.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, Serialize)]
pub struct CachedPage {
    /// The block's chained key.
    pub key: BlockKey,
    /// The parent block's key (`None` for the first block under a scope root).
    pub parent: Option<BlockKey>,
    /// The life cycle the page belongs to.
    pub life_cycle: LifeCycleId,
    /// Where the page is now.
    pub tier: Tier,
}

impl KvCacheManager {
    /// Every page of every block in the reuse tree, sorted by (key, life cycle).
    /// O(blocks × life cycles) and allocating: meant for tests and diagnostics, not for
    /// the step path.
    pub fn cached_blocks(&self) -> Vec<CachedPage> {
        let mut out: Vec<CachedPage> = self
            .tree
            .blocks()
            .flat_map(|(r, node)| {
                let parent = self.tree.parent_block_key(r);
                node.pages
                    .iter()
                    .enumerate()
                    .map(move |(lc, &pid)| CachedPage {
                        key: node.key,
                        parent,
                        life_cycle: LifeCycleId(lc as u16),
                        tier: self.pages[pid].tier,
                    })
            })
            .collect();
        out.sort_unstable();
        out
    }
}

impl KvCacheManager {
    /// Every full block of the reuse tree as a router sees it (hash and medium, see
    /// [`RouterEvent`](super::RouterEvent)), sorted: what replaying
    /// [`take_router_events`](Self::take_router_events) from the start gives.
    /// Allocating; for resynchronizing a router and for tests.
    pub fn router_blocks(&self) -> Vec<RouterBlock> {
        self.router_blocks_covering(|_| true)
    }

    /// [`router_blocks`](Self::router_blocks) restricted to the blocks at or above one
    /// for which `keep` holds (a windowed model's blocks a hit can reach: those with a
    /// tail at or below them).
    pub(crate) fn router_blocks_covering(
        &self,
        keep: impl Fn(&BlockKey) -> bool,
    ) -> Vec<RouterBlock> {
        let order = self.tree.blocks_top_down();
        // Bottom up: a block is covered when `keep` holds for it or a block below it.
        let mut covered: HashMap<NodeRef, bool> = HashMap::new();
        for &r in order.iter().rev() {
            let c = keep(&self.tree.node(r).key) || covered.get(&r).copied().unwrap_or(false);
            if c {
                if let Some(p) = self.tree.parent_block(r) {
                    covered.insert(p, true);
                }
            }
            covered.insert(r, c);
        }
        // Computed from the pages, top down, independently of the media the events
        // announced (which the invariant checks hold against this).
        let mut on_gpu: HashMap<NodeRef, bool> = HashMap::new();
        let mut out = Vec::new();
        for r in order {
            let parent_on_gpu = self.tree.parent_block(r).is_none_or(|p| on_gpu[&p]);
            let gpu = parent_on_gpu && self.pages_on_gpu(r);
            on_gpu.insert(r, gpu);
            if self.tree.node(r).tokens.len() == self.tpb as usize && covered[&r] {
                out.push(RouterBlock {
                    hash: self.tree.node(r).key.hash64(),
                    medium: if gpu { Medium::Gpu } else { Medium::CpuPinned },
                });
            }
        }
        out.sort_unstable();
        out
    }

    /// A `BlockStored` for every full block of the reuse tree on its announced medium,
    /// parents first (seeds a windowed model's router filter).
    pub(crate) fn router_stored_all(&self) -> Vec<super::RouterEvent> {
        self.tree
            .blocks_top_down()
            .into_iter()
            .filter_map(|r| {
                let medium = self.tree.node(r).router_medium?;
                Some(self.router_stored(r, medium))
            })
            .collect()
    }
}
